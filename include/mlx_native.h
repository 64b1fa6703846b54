/* mlx-native: flash attention for LLM prefill (F32/F16/BF16 Q, F16 K/V, GQA, described or
 * explicit masks, batches, lse) on the CPU, CUDA and Metal. Generated from rust/src/ffi.rs by
 * cbindgen: do not edit; see include/cbindgen.toml.
 *
 * Every function returns 0 on success or an error code, and mlxn_last_error() says what went
 * wrong (per thread): 1 device not found, 2 backend unavailable, 3 command failed, 4 kernel
 * did not compile, 5 allocation failed, 6 invalid argument, 7 kernel not found, 8
 * unsupported dtype, 9 invalid handle, 10 internal error. A failed call writes none of its
 * outputs. Objects are uint64_t handles; 0 is never one. DType codes: 0 F32, 1 F16, 2 BF16,
 * 3 U8, 4 U16, 5 U32, 6 I32. examples/c/prefill.c runs one prefill. */

#ifndef MLX_NATIVE_H
#define MLX_NATIVE_H

#include <stddef.h>
#include <stdint.h>

// What `mlxn_buffer_info` reports.
typedef struct MlxnBufferInfo {
  // `DType` code.
  uint32_t dtype;
  // Dimensions used in `shape` (0 for a flat buffer).
  uint32_t ndim;
  uint64_t shape[8];
  // Bytes visible through the buffer.
  uint64_t byte_len;
  // Host address of the first byte where the memory is host-visible, else null.
  void *host_ptr;
  // 0 CPU, 1 CUDA, 2 Metal.
  uint32_t backend;
} MlxnBufferInfo;

// A plan's run options, as the C ABI passes them (`mlxn_prefill_plan_new`,
// `mlxn_encoder_set_options`). Each left unset (`has_kv_splits` 0, a null name) is the
// library's own choice, which the environment may override (the README's table); a value given wins.
typedef struct MlxnRunOptions {
  // CUDA, with `has_kv_splits` 1: 0 or 1 never split the walk over the cache; 2, 4, 8
  // or 16: that many parts, where the launch can take them. With 0 the shape decides.
  int64_t kv_splits;
  int32_t has_kv_splits;
  // CUDA (Hopper form): null, `auto` (head pairs where the group of query heads splits
  // in two, else query pairs), `off` (the one-CTA forms) or `queries` (query pairs only).
  const char *cta_pairs;
  // CUDA: null, `auto` (the device's own form) or `portable` (the mma.sync form, built
  // for the device's plain architecture).
  const char *cuda_form;
  // CPU: null or an instruction set of `mlxn_cpu_info`'s `detected`, or `amx-emulated`.
  const char *cpu_isa;
} MlxnRunOptions;

// Shapes and strides of one dispatch. Strides are in elements. `#[repr(C)]`: the C ABI
// passes it as it is.
typedef struct MlxnFlashAttnPrefillTensorParams {
  uint32_t rows;
  uint32_t n_heads;
  uint32_t n_kv_heads;
  uint32_t head_dim;
  // Cache rows the kernel walks; a multiple of [`CACHE_ROWS_PER_STEP`].
  uint32_t kv_pad;
  uint32_t q_row_stride;
  uint32_t q_head_stride;
  uint32_t k_row_stride;
  uint32_t k_head_stride;
  uint32_t v_row_stride;
  uint32_t v_head_stride;
  // Pre-softmax scale folded into Q (1.0 for Gemma 4).
  float scale;
} MlxnFlashAttnPrefillTensorParams;

// Shapes, strides and the mask description of one prefill. Strides are in elements (the
// last axis of every tensor is contiguous); `#[repr(C)]`: the C ABI passes it as it is.
//
// Fixed length: `batch` sequences of `rows` query rows and `kv_len` cache rows, sequence
// `b` at `b * <x>_strides[0]`. Variable length (`cu_seqlens_*` bound): `rows` and `kv_len`
// are the totals, the batch strides must be 0, and sequence `b` owns rows
// `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of Q and O and `cu_seqlens_k[b]..` of K and V.
typedef struct MlxnFlashAttnPrefillParams {
  // Q `[batch, rows, n_heads, head_dim]`: batch, row and head strides.
  uint64_t q_strides[3];
  // K `[batch, kv_len, n_kv_heads, head_dim]`.
  uint64_t k_strides[3];
  // V, as K.
  uint64_t v_strides[3];
  // O `[batch, rows, n_heads, head_dim]`.
  uint64_t out_strides[3];
  // The explicit mask `[batch or 1, rows, kv_len]`: batch stride (0: one mask for every
  // sequence) and row stride. Ignored without a mask.
  uint64_t mask_strides[2];
  // lse `[batch, n_heads, rows]` (variable length: `[n_heads, total rows]`): batch and
  // head strides; rows are contiguous. Ignored without lse.
  uint64_t lse_strides[2];
  uint32_t batch;
  uint32_t rows;
  uint32_t kv_len;
  uint32_t n_heads;
  uint32_t n_kv_heads;
  uint32_t head_dim;
  // 1: query row r sees cache row j only if `j <= r + kv_len - rows` (per sequence).
  uint32_t causal;
  // `w >= 1`: also only if `j > r + kv_len - rows - w` (needs `causal`); 0: no window.
  uint32_t window;
  // Folded into Q before Q is rounded to half (SPEC 2, step 1).
  float scale;
  // Columns of V and O; 0: `head_dim` (they differ only at (576, 512), SPEC 10).
  uint32_t head_dim_v;
  // SPEC 10: above 0, `s = softcap * tanh(s / softcap)` before the mask is added.
  float softcap;
  // SPEC 10: above 0, the explicit mask is scaled by each head's ALiBi slope.
  float max_bias;
  // With `has_offset` 1: query row r of every sequence sits at position `r + offset` of its
  // cache, for `causal` and `window` (a chunk of queries against a chunk of the cache, as
  // context parallelism computes them); with 0, the prompt is the end of its cache
  // (`offset = kv_len - rows` per sequence, SPEC 6).
  int32_t offset;
  uint32_t has_offset;
  // With `has_window_right` 1: query row r (at cache position `p = r + offset`) sees cache
  // row j only if `j <= p + window_right` (the right side of flash-attn's
  // `window_size=(left, right)`; its left side is `window = left + 1`). Without causal
  // only: causal caps the right side at 0 and this is then ignored.
  uint32_t window_right;
  uint32_t has_window_right;
  // flash-attn's `alibi_slopes`: 0 none; 1 an F32 `[n_heads]` buffer; 2 `[batch, n_heads]`.
  // Each computed score gains `-slope_h * |p - j|`. Not with `max_bias > 0`.
  uint32_t alibi_slopes;
} MlxnFlashAttnPrefillParams;

// FP8 K/V's descale factors (SPEC 11, FlashAttention-3's `k_descale`, `v_descale`), as the
// plan calls take them: each a null pointer with length 0 (every factor 1), one value (for
// every KV head) or `n_kv_heads` values (one per KV head). The value of an element `x` of K
// is `k[g] * float(x)`. Only with FP8 K/V (`kv_dtype` 7 or 8).
typedef struct MlxnKvDescale {
  const float *k;
  uint32_t k_len;
  const float *v;
  uint32_t v_len;
} MlxnKvDescale;

// Elements each operand of a prefill plan must hold (bytes for `blk`, which the plan owns,
// and for `workspace`).
typedef struct MlxnPrefillExtents {
  uint64_t q;
  uint64_t k;
  uint64_t v;
  uint64_t out;
  uint64_t mask;
  uint64_t blk;
  uint64_t lse;
  uint64_t sinks;
  // F32 ALiBi slopes (`[n_heads]` or `[batch, n_heads]`; 0 without).
  uint64_t alibi_slopes;
  // Bytes of scratch a run can use to go faster (0: none helps): the CUDA attention
  // splits its walk over the cache when the shape leaves the GPU idle. Pass a buffer
  // of this size to each run (one per run in flight), or 0 to run unsplit.
  uint64_t workspace;
} MlxnPrefillExtents;

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The library version, a static NUL-terminated string.
const char *mlxn_version(void);

// The message of the last failed call on this thread (empty if none). Valid until the
// next failing call on this thread.
const char *mlxn_last_error(void);

// Comma-separated names of the backends that can open a device here, best first.
//
// # Safety
// `buf` must hold `cap` bytes (or be null); `needed` must be null or valid.
int32_t mlxn_backends(char *buf, size_t cap, size_t *needed);

// The CPU backend's facts: `isa=<in use>;detected=<a,b,..>;threads=<n>;memory=<bytes>;
// runtime=<rayon | openmp (path)>` (memory: the most a buffer may take, RAM plus swap within
// the cgroup limit, 0 unknown; runtime: what runs the kernels' parallel jobs).
//
// # Safety
// As for [`mlxn_backends`].
int32_t mlxn_cpu_info(char *buf, size_t cap, size_t *needed);

// Make the CPU kernels use one instruction set (`amx`, `avx512`, `avx2+fma+f16c`,
// `portable`, or `amx-emulated`: the AMX kernels on software tiles, on any CPU), or the best
// available with null, `""` or `auto`. Process-wide; for tests and benchmarks.
//
// # Safety
// `name` must be null or a NUL-terminated string.
int32_t mlxn_cpu_force_isa(const char *name);

// Make the CPU kernels run on `threads` threads from the next run on (0: back to the
// default: `RAYON_NUM_THREADS`, else every core the process may use). Process-wide.
int32_t mlxn_cpu_set_threads(uint32_t threads);

// Run the CPU kernels' parallel jobs on the OpenMP runtime already loaded in this process
// (PyTorch's libgomp; `on` 1), or on the library's own pool (`on` 0). `found` (may be null)
// gets 1 where such a runtime was found and is used now. Process-wide.
//
// # Safety
// `found` must be null or valid.
int32_t mlxn_cpu_use_openmp(int32_t on, int32_t *found);

// Make every CUDA launch use the CTA-pair choice `mode` (`"0"`: the one-CTA forms,
// `"queries"`: query pairs only, `"1"`: head pairs where they fit), or go back to
// `MLX_NATIVE_CUDA_PAIR`'s with null or `""`. Process-wide; for tests and benchmarks.
//
// # Safety
// `mode` must be null or a NUL-terminated string.
int32_t mlxn_cuda_force_pair(const char *mode);

// The settings read from the environment (each once, the first time any is asked for:
// this call reads them) whose values were not understood and were ignored: one message a
// line, each naming the variable and its value; empty when there are none.
//
// # Safety
// As for [`mlxn_backends`].
int32_t mlxn_settings_report(char *buf, size_t cap, size_t *needed);

// The measured FMA peak of the CPU in GFLOP/s (f32, an FMA counting 2 FLOP per lane) on
// `threads` threads (0: all the threads the kernels use), with the instruction set the
// kernels use now. Runs a calibrated register-only loop for about a quarter of a second.
//
// # Safety
// `out_gflops` must be valid.
int32_t mlxn_cpu_fma_peak(uint32_t threads, double *out_gflops);

// The measured AMX-BF16 peak of the CPU in GFLOP/s (TDPBF16PS on tile registers, a
// multiply-add counting 2 FLOP) on `threads` threads (0: all the threads the kernels use),
// as [`mlxn_cpu_fma_peak`] measures the FMA peak. Status `BackendUnavailable` where the CPU
// or its OS offers no AMX tiles.
//
// # Safety
// `out_gflops` must be valid.
int32_t mlxn_cpu_amx_peak(uint32_t threads, double *out_gflops);

// The bf16 products the CPU's AMX kernels sum for each product of the attention with K/V of
// `kv_dtype` (1 F16, 2 BF16): `qk` for Q.K^T and `pv` for P.V, each 1 to 4 (1 or 2 with
// BF16), or 0 and 0 for the default (see docs/spec.md, "AMX"). Process-wide; for
// measurements and tests that compare the splits.
//
// # Safety
// None beyond the call itself.
int32_t mlxn_cpu_set_amx_products(int32_t kv_dtype, uint32_t qk, uint32_t pv);

// The bf16 products the AMX kernels use now with K/V of `kv_dtype` (1 F16, 2 BF16).
//
// # Safety
// `qk` and `pv` must be valid.
int32_t mlxn_cpu_amx_products(int32_t kv_dtype, uint32_t *qk, uint32_t *pv);

// Handles (devices, buffers, encoders) open now, process-wide; for leak checks.
//
// # Safety
// `out` must be valid.
int32_t mlxn_handle_count(uint64_t *out);

// Open a device: `auto`, `cpu`, `cuda`, `cuda:N`, `metal`.
//
// # Safety
// `backend` must be a NUL-terminated string; `out` must be valid.
int32_t mlxn_device_open(const char *backend, uint64_t *out);

// Close a device handle. Buffers and encoders made from it stay usable until they are
// freed; the device itself goes when the last of them does.
int32_t mlxn_device_close(uint64_t dev);

// A one-line description of the device and its backend code (0 CPU, 1 CUDA, 2 Metal).
//
// # Safety
// As for [`mlxn_backends`]; `backend` must be null or valid.
int32_t mlxn_device_info(uint64_t dev, uint32_t *backend, char *buf, size_t cap, size_t *needed);

// Whether the tensor flash-attention pipeline for `head_dim` builds on the device
// (`*out` = 1 or 0). An unsupported head dim is an error.
//
// # Safety
// `out` must be valid.
int32_t mlxn_flash_attn_prefill_tensor_available(uint64_t dev, uint32_t head_dim, int32_t *out);

// A new zero-filled buffer of `shape` (`ndim` dims) elements of `dtype` on the device.
//
// # Safety
// `shape` must hold `ndim` values; `out` must be valid.
int32_t mlxn_buffer_new(uint64_t dev,
                        uint32_t dtype,
                        const uint64_t *shape,
                        size_t ndim,
                        uint64_t *out);

// A buffer over `nbytes` bytes of host memory at `ptr`, used in place (no copy) where the
// backend can (the CPU); the caller keeps the memory alive until the buffer is freed.
//
// # Safety
// `ptr` must point to `nbytes` bytes that stay valid until the buffer handle is freed and
// no dispatch that uses it is pending; `shape` must hold `ndim` values; `out` valid.
int32_t mlxn_buffer_wrap_host(uint64_t dev,
                              void *ptr,
                              size_t nbytes,
                              uint32_t dtype,
                              const uint64_t *shape,
                              size_t ndim,
                              uint64_t *out);

// A buffer over `nbytes` bytes of device memory at address `addr` (a CUDA tensor of
// PyTorch or CuPy), used in place; the device must be a CUDA device and the address
// memory of that device. The caller keeps the memory alive until the buffer is freed.
//
// # Safety
// `addr` must stay allocated until the buffer handle is freed and no dispatch that uses
// it is pending; `shape` must hold `ndim` values; `out` must be valid.
int32_t mlxn_buffer_wrap_device(uint64_t dev,
                                uint64_t addr,
                                size_t nbytes,
                                uint32_t dtype,
                                const uint64_t *shape,
                                size_t ndim,
                                uint64_t *out);

// Wait for the work queued on another library's CUDA stream (`stream`, as the CUDA
// Array Interface gives it: a `cudaStream_t`, or 1 / 2 for the default streams) before
// the device uses memory that work writes. An error on devices without streams.
int32_t mlxn_device_wait_stream(uint64_t dev, uint64_t stream);

// Compile every CUDA kernel source of the library with NVRTC for `arch` (`sm_90a`,
// `sm_80`, ...), without a GPU; the string is ptxas's report (registers, spills per
// entry point). `BackendUnavailable` when NVRTC cannot be loaded, `ShaderCompilationError`
// with the compiler's log when a source does not compile.
//
// # Safety
// `arch` must be a NUL-terminated string; otherwise as for [`mlxn_backends`].
int32_t mlxn_cuda_compile_check(const char *arch, char *buf, size_t cap, size_t *needed);

// Describe a buffer.
//
// # Safety
// `out` must be valid.
int32_t mlxn_buffer_info(uint64_t buf, struct MlxnBufferInfo *out);

// Copy `n` bytes at byte `offset` of the buffer into `dst`.
//
// # Safety
// `dst` must hold `n` bytes.
int32_t mlxn_buffer_read(uint64_t buf, size_t offset, void *dst, size_t n);

// Copy `n` bytes from `src` into the buffer at byte `offset`.
//
// # Safety
// `src` must hold `n` bytes.
int32_t mlxn_buffer_write(uint64_t buf, size_t offset, const void *src, size_t n);

// A new buffer handle over `byte_len` bytes at `byte_offset` of `buf`, as `dtype` with
// `shape` (`ndim` dims, 0 for flat): the same memory, no copy; it keeps the memory alive
// after `buf` is freed. The offset must be aligned to `dtype`.
//
// # Safety
// `shape` must hold `ndim` values; `out` must be valid.
int32_t mlxn_buffer_view(uint64_t buf,
                         size_t byte_offset,
                         size_t byte_len,
                         uint32_t dtype,
                         const uint64_t *shape,
                         size_t ndim,
                         uint64_t *out);

// Free a buffer handle. Memory a pending dispatch still uses stays until it is done.
int32_t mlxn_buffer_free(uint64_t buf);

// A new command encoder on the device.
//
// # Safety
// `out` must be valid.
int32_t mlxn_encoder_new(uint64_t dev, uint64_t *out);

// Record the encoder's next dispatches with the run options `options` (null: the
// defaults), checked as `mlxn_prefill_plan_new` checks them.
//
// # Safety
// `options` must be null or valid, its strings null or NUL-terminated.
int32_t mlxn_encoder_set_options(uint64_t enc, const struct MlxnRunOptions *options);

// Dispatches recorded and not yet committed.
//
// # Safety
// `out` must be valid.
int32_t mlxn_encoder_pending(uint64_t enc, uint64_t *out);

// Run every recorded dispatch and wait for them to finish.
int32_t mlxn_encoder_commit_and_wait(uint64_t enc);

// Run every recorded dispatch on the caller's CUDA stream (a `cudaStream_t`) and return
// without waiting (CUDA devices); devices without streams run them now and wait.
int32_t mlxn_encoder_commit_on_stream(uint64_t enc, uint64_t stream);

// Free an encoder; dispatches it recorded and never committed are dropped unrun.
int32_t mlxn_encoder_free(uint64_t enc);

// `dispatch_flash_attn_prefill_tensor_f16`: record one flash-attention dispatch.
//
// # Safety
// `params` must be valid.
int32_t mlxn_dispatch_flash_attn_prefill_tensor_f16(uint64_t enc,
                                                    uint64_t q,
                                                    uint64_t k,
                                                    uint64_t v,
                                                    uint64_t mask,
                                                    uint64_t blk,
                                                    uint64_t out,
                                                    const struct MlxnFlashAttnPrefillTensorParams *params);

// `dispatch_flash_attn_prefill_blk`: record one mask classification.
int32_t mlxn_dispatch_flash_attn_prefill_blk(uint64_t enc,
                                             uint64_t mask,
                                             uint64_t blk,
                                             uint32_t rows,
                                             uint32_t kv_pad,
                                             uint32_t bq,
                                             uint32_t bk);

// Queries per threadgroup (the blk `bq`) at `head_dim`.
//
// # Safety
// `out` must be valid.
int32_t mlxn_queries_per_threadgroup(uint32_t head_dim, uint32_t *out);

// Whether this build has a prefill kernel for Q/K head dim `head_dim`, V head dim
// `head_dim_v` (0: the same) and K/V dtype code `kv_dtype`: 0, or the error that names the
// head dims it takes.
int32_t mlxn_flash_attn_prefill_supports(uint32_t head_dim, uint32_t head_dim_v, uint32_t kv_dtype);

// Threadgroup memory of one dispatch of the Metal kernel at `head_dim`.
//
// # Safety
// `out` must be valid.
int32_t mlxn_threadgroup_memory_bytes(uint32_t head_dim, uint64_t *out);

// `kv_len` rounded up to a multiple of the cache step.
//
// # Safety
// `out` must be valid.
int32_t mlxn_kv_pad(uint32_t kv_len, uint32_t *out);

// Cache rows per step (the blk `bk`).
uint32_t mlxn_cache_rows_per_step(void);

// `dispatch_flash_attn_prefill`: record one prefill over a batch (SPEC 6-10). `mask`,
// `blk`, `cu_seqlens_q`, `cu_seqlens_k`, `lse`, `sinks`, `alibi_slopes` and `workspace` are
// optional: 0 for none (`alibi_slopes`: F32 `[n_heads]` or `[batch, n_heads]`, as
// `params->alibi_slopes` says). `workspace`: scratch for this dispatch alone, of at least the bytes a plan of
// the same prefill reports (`MlxnPrefillExtents::workspace`), with which the CUDA
// attention may split its walk over the cache; without one it does not.
//
// # Safety
// `params` must be valid.
int32_t mlxn_dispatch_flash_attn_prefill(uint64_t enc,
                                         uint64_t q,
                                         uint64_t k,
                                         uint64_t v,
                                         uint64_t out,
                                         uint64_t mask,
                                         uint64_t blk,
                                         uint64_t cu_seqlens_q,
                                         uint64_t cu_seqlens_k,
                                         uint64_t lse,
                                         uint64_t sinks,
                                         uint64_t alibi_slopes,
                                         uint64_t workspace,
                                         const struct MlxnFlashAttnPrefillParams *params);

// `dispatch_flash_attn_prefill_mask_blk`: record the classification of an explicit mask
// (`params`' shapes and mask strides) into its tile table.
//
// # Safety
// `params` must be valid.
int32_t mlxn_dispatch_flash_attn_prefill_mask_blk(uint64_t enc,
                                                  uint64_t mask,
                                                  uint64_t blk,
                                                  const struct MlxnFlashAttnPrefillParams *params);

// Bytes of the explicit mask's tile table of a prefill.
//
// # Safety
// `params` and `out` must be valid.
int32_t mlxn_flash_attn_prefill_mask_table_bytes(const struct MlxnFlashAttnPrefillParams *params,
                                                 uint64_t *out);

// Plan a prefill on its shapes (FlashInfer's `plan`): checks `params` with the operands'
// dtypes (`DType` codes of q, of k and v, of out) and which optional operands there are
// (`has_mask`, `has_lse`, `has_sinks`: 0 or 1). For a variable-length batch `cu_seqlens_q` and
// `cu_seqlens_k` point to `batch + 1` int32 in host memory each (checked here and copied
// to the device); null for fixed length. Quantised K/V (SPEC 11, the CPU and CUDA backends): `kv_dtype`
// 7 (FP8 E4M3), 8 (FP8 E5M2) or 9 (Q8_0 blocks, K/V strides in bytes); `descale`: FP8's
// factors ([`MlxnKvDescale`]), null for none. `options`: the run options (null: the defaults),
// each checked here; `mlxn_prefill_plan_choices` says what the backend chose under them.
//
// # Safety
// `params` and `out` must be valid; the cu_seqlens pointers null or `batch + 1` values;
// `options` null or valid.
int32_t mlxn_prefill_plan_new(uint64_t dev,
                              const struct MlxnFlashAttnPrefillParams *params,
                              uint32_t q_dtype,
                              uint32_t kv_dtype,
                              uint32_t out_dtype,
                              int32_t has_mask,
                              int32_t has_lse,
                              int32_t has_sinks,
                              const int32_t *cu_seqlens_q,
                              const int32_t *cu_seqlens_k,
                              const struct MlxnKvDescale *descale,
                              const struct MlxnRunOptions *options,
                              uint64_t *out);

// Plan a prefill on paged K/V (SPEC 11), as [`mlxn_prefill_plan_new`] does otherwise: `k`
// and `v` are the caches `[num_blocks, block_size, n_kv_heads, head_dim]`, whose (block,
// row, head) strides are `params.k_strides` / `v_strides` (`params.kv_len` is not read);
// `block_table` points to `batch * max_blocks` int32 in host memory (row-major), `seqused_k`
// to `batch` int32 (each sequence's cache length); both are checked here (an entry a
// sequence reads outside `[0, num_blocks)`, a length below 0 or beyond its table row) and
// copied for the plan's runs. `cu_seqlens_q`: `batch + 1` int32 offsets of the queries
// (variable length), or null for `params.rows` query rows per sequence. `options`: the run
// options (null: the defaults). Runs on the CPU backend; elsewhere an `InvalidArgument`
// naming `block_table`.
//
// # Safety
// `params` and `out` must be valid; the pointers hold the counts above (`cu_seqlens_q`
// may be null); `options` null or valid.
int32_t mlxn_prefill_plan_new_paged(uint64_t dev,
                                    const struct MlxnFlashAttnPrefillParams *params,
                                    uint32_t q_dtype,
                                    uint32_t kv_dtype,
                                    uint32_t out_dtype,
                                    int32_t has_mask,
                                    int32_t has_lse,
                                    int32_t has_sinks,
                                    const int32_t *cu_seqlens_q,
                                    const int32_t *block_table,
                                    uint32_t max_blocks,
                                    const int32_t *seqused_k,
                                    uint32_t num_blocks,
                                    uint32_t block_size,
                                    const struct MlxnKvDescale *descale,
                                    const struct MlxnRunOptions *options,
                                    uint64_t *out);

// What each operand of a plan must hold.
//
// # Safety
// `out` must be valid.
int32_t mlxn_prefill_plan_extents(uint64_t plan_handle, struct MlxnPrefillExtents *out);

// What the plan's backend chose under its options, as `name=value` pairs separated by
// `;`: `form` (`cpu`, `hopper`, `portable`, `metal`), and where they apply `arch` (the
// CUDA target), `pairs` (the CTA-pair forms allowed), `splits` (the parts of a run given
// its workspace; 1: none) and `isa` (the CPU's instruction set). As for [`mlxn_backends`].
//
// # Safety
// As for [`mlxn_backends`].
int32_t mlxn_prefill_plan_choices(uint64_t plan_handle, char *buf, size_t cap, size_t *needed);

// Run a plan on data (FlashInfer's `run`): each operand by address (a host pointer on the
// CPU and Metal, a device address on CUDA), holding what [`mlxn_prefill_plan_extents`]
// says; `mask`, `lse`, `sinks` and `alibi_slopes` 0 when the plan has none. `workspace`: 0, or scratch of
// the extents' `workspace` bytes for this run alone (it may then run faster). `stream`: 0
// runs on the library's stream and waits; a CUDA stream (`cudaStream_t`) enqueues the run
// on it and returns at once (CUDA devices; elsewhere the run happens now).
//
// # Safety
// Every address must point to memory of the plan's device holding its operand's extent,
// valid until the run is complete; outputs must not be read or written meanwhile.
int32_t mlxn_prefill_plan_run(uint64_t plan_handle,
                              uint64_t q,
                              uint64_t k,
                              uint64_t v,
                              uint64_t mask,
                              uint64_t out,
                              uint64_t lse,
                              uint64_t sinks,
                              uint64_t alibi_slopes,
                              uint64_t workspace,
                              uint64_t stream);

// Record a run of a plan on an encoder (FlashInfer's `run`, deferred to the encoder's
// commit), each operand as a buffer handle of the plan's device holding what
// [`mlxn_prefill_plan_extents`] says; `mask`, `lse`, `sinks`, `alibi_slopes` and
// `workspace` 0 as for [`mlxn_prefill_plan_run`]. The mask's classification is recorded
// first when the plan has one. The plan's own operands go with it: its sequence offsets and,
// for a paged plan (SPEC 11), its block table and lengths, which the buffer-level
// [`mlxn_dispatch_flash_attn_prefill`] cannot take. `enc` must be an encoder of the plan's
// device (the device handle the plan was made on), as the buffers must be. Nothing is
// recorded if an argument is wrong.
int32_t mlxn_prefill_plan_encode(uint64_t plan_handle,
                                 uint64_t enc,
                                 uint64_t q,
                                 uint64_t k,
                                 uint64_t v,
                                 uint64_t mask,
                                 uint64_t out,
                                 uint64_t lse,
                                 uint64_t sinks,
                                 uint64_t alibi_slopes,
                                 uint64_t workspace);

// Free a prefill plan.
int32_t mlxn_prefill_plan_free(uint64_t plan_handle);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* MLX_NATIVE_H */
