//! The C ABI: the only place that speaks C.
//!
//! - Objects (devices, buffers, encoders) are opaque `uint64_t` handles. A handle is never
//!   reused, so a closed, stale, null or wrong-kind handle is an `MLXN_INVALID_HANDLE`
//!   error, not undefined behaviour.
//! - Every call returns an `int32_t` status: 0 on success, else [`MlxError::code`]. The
//!   message of the last failure on the calling thread is [`mlxn_last_error`].
//! - No panic crosses the boundary: each call runs under `catch_unwind`, and a panic is
//!   reported as an `Internal` error.
//! - A call that fails writes none of its output parameters and dispatches nothing.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

use crate::backend::BackendKind;
use crate::buffer::MlxBuffer;
use crate::device::MlxDevice;
use crate::dtypes::DType;
use crate::encoder::CommandEncoder;
use crate::error::{MlxError, Result};
use crate::kernel_registry::KernelRegistry;
use crate::ops::flash_attn_prefill::{
    self as prefill, FlashAttnPrefillBuffers, FlashAttnPrefillParams, PrefillOperands,
};
use crate::ops::flash_attn_prefill_blk::{self, FlashAttnPrefillBlkParams};
use crate::ops::flash_attn_prefill_paged::PagedKv;
use crate::ops::flash_attn_prefill_plan::{FlashAttnPrefillPlan, PrefillRunBuffers};
use crate::ops::flash_attn_prefill_tensor::{self as fa, FlashAttnPrefillTensorParams};
use crate::options::{kv_splits_ok, CtaPairs, CudaForm, RunOptions};

/// Most dimensions a buffer's shape may have through the C ABI.
pub const MLXN_MAX_DIMS: usize = 8;

/// Parameters of `mlxn_dispatch_flash_attn_prefill_tensor_f16` (strides in elements): the
/// op's own params struct, `#[repr(C)]`, named `MlxnFlashAttnPrefillTensorParams` in the C
/// header (`cbindgen.toml` renames it).
pub type MlxnFlashAttnPrefillTensorParams = FlashAttnPrefillTensorParams;

/// What `mlxn_buffer_info` reports.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MlxnBufferInfo {
    /// `DType` code.
    pub dtype: u32,
    /// Dimensions used in `shape` (0 for a flat buffer).
    pub ndim: u32,
    pub shape: [u64; 8],
    /// Bytes visible through the buffer.
    pub byte_len: u64,
    /// Host address of the first byte where the memory is host-visible, else null.
    pub host_ptr: *mut c_void,
    /// 0 CPU, 1 CUDA, 2 Metal.
    pub backend: u32,
}

struct DeviceCtx {
    device: MlxDevice,
    registry: Mutex<KernelRegistry>,
}

struct EncoderCtx {
    ctx: Arc<DeviceCtx>,
    encoder: Mutex<CommandEncoder>,
}

struct PlanCtx {
    ctx: Arc<DeviceCtx>,
    plan: FlashAttnPrefillPlan,
}

enum Object {
    Device(Arc<DeviceCtx>),
    Buffer(MlxBuffer),
    Encoder(Arc<EncoderCtx>),
    Plan(Arc<PlanCtx>),
}

impl Object {
    fn kind(&self) -> &'static str {
        match self {
            Object::Device(_) => "device",
            Object::Buffer(_) => "buffer",
            Object::Encoder(_) => "encoder",
            Object::Plan(_) => "prefill plan",
        }
    }
}

static HANDLES: LazyLock<Mutex<HashMap<u64, Object>>> = LazyLock::new(|| Mutex::new(HashMap::new()));
static NEXT_HANDLE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Lock, ignoring poisoning: every critical section here leaves its data consistent.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn insert(obj: Object) -> u64 {
    let h = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
    lock(&HANDLES).insert(h, obj);
    h
}

fn lookup<T>(h: u64, want: &str, pick: impl FnOnce(&Object) -> Option<T>) -> Result<T> {
    if h == 0 {
        return Err(MlxError::InvalidHandle(format!("null {want} handle")));
    }
    let table = lock(&HANDLES);
    match table.get(&h) {
        None => Err(MlxError::InvalidHandle(format!("{want} handle {h} is closed or was never issued"))),
        Some(obj) => {
            pick(obj).ok_or_else(|| MlxError::InvalidHandle(format!("handle {h} is a {}, not a {want}", obj.kind())))
        }
    }
}

fn device(h: u64) -> Result<Arc<DeviceCtx>> {
    lookup(h, "device", |o| match o {
        Object::Device(d) => Some(d.clone()),
        _ => None,
    })
}

fn buffer(h: u64) -> Result<MlxBuffer> {
    lookup(h, "buffer", |o| match o {
        Object::Buffer(b) => Some(b.clone()),
        _ => None,
    })
}

fn encoder(h: u64) -> Result<Arc<EncoderCtx>> {
    lookup(h, "encoder", |o| match o {
        Object::Encoder(e) => Some(e.clone()),
        _ => None,
    })
}

fn plan(h: u64) -> Result<Arc<PlanCtx>> {
    lookup(h, "prefill plan", |o| match o {
        Object::Plan(p) => Some(p.clone()),
        _ => None,
    })
}

/// The buffer of an optional handle (0: none).
fn optional_buffer(h: u64) -> Result<Option<MlxBuffer>> {
    if h == 0 {
        Ok(None)
    } else {
        buffer(h).map(Some)
    }
}

fn release(h: u64, want: &str, is_kind: fn(&Object) -> bool) -> Result<()> {
    let mut table = lock(&HANDLES);
    match table.get(&h) {
        None if h == 0 => Err(MlxError::InvalidHandle(format!("null {want} handle"))),
        None => Err(MlxError::InvalidHandle(format!("{want} handle {h} is closed or was never issued"))),
        Some(o) if !is_kind(o) => Err(MlxError::InvalidHandle(format!("handle {h} is a {}, not a {want}", o.kind()))),
        Some(_) => {
            // Drop outside the lock: dropping an encoder or buffer may free memory.
            let obj = table.remove(&h);
            drop(table);
            drop(obj);
            Ok(())
        }
    }
}

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".into()
    }
}

/// Run `f`, turning its error or panic into a status code and the thread's last error.
fn guard(f: impl FnOnce() -> Result<()>) -> i32 {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            set_last_error(e.to_string());
            e.code()
        }
        Err(p) => {
            let e = MlxError::Internal(format!("panic: {}", panic_message(p.as_ref())));
            set_last_error(e.to_string());
            e.code()
        }
    }
}

fn out_ptr<T>(p: *mut T, what: &str) -> Result<*mut T> {
    if p.is_null() {
        Err(MlxError::InvalidArgument(format!("{what} is a null pointer")))
    } else {
        Ok(p)
    }
}

unsafe fn c_str<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(MlxError::InvalidArgument(format!("{what} is a null pointer")));
    }
    CStr::from_ptr(p).to_str().map_err(|_| MlxError::InvalidArgument(format!("{what} is not UTF-8")))
}

unsafe fn shape_arg(shape: *const u64, ndim: usize) -> Result<Vec<usize>> {
    if ndim > MLXN_MAX_DIMS {
        return Err(MlxError::InvalidArgument(format!("{ndim} dimensions, at most {MLXN_MAX_DIMS}")));
    }
    if ndim > 0 && shape.is_null() {
        return Err(MlxError::InvalidArgument("shape is a null pointer".into()));
    }
    (0..ndim)
        .map(|i| {
            usize::try_from(*shape.add(i))
                .map_err(|_| MlxError::InvalidArgument("a dimension exceeds the address space".into()))
        })
        .collect()
}

/// A plan's run options, as the C ABI passes them (`mlxn_prefill_plan_new`,
/// `mlxn_encoder_set_options`). Each left unset (`has_kv_splits` 0, a null name) is the
/// library's own choice, which the environment may override (the README's table); a value given wins.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MlxnRunOptions {
    /// CUDA, with `has_kv_splits` 1: 0 or 1 never split the walk over the cache; 2, 4, 8
    /// or 16: that many parts, where the launch can take them. With 0 the shape decides.
    pub kv_splits: i64,
    pub has_kv_splits: i32,
    /// CUDA (Hopper form): null, `auto` (head pairs where the group of query heads splits
    /// in two, else query pairs), `off` (the one-CTA forms) or `queries` (query pairs only).
    pub cta_pairs: *const c_char,
    /// CUDA: null, `auto` (the device's own form) or `portable` (the mma.sync form, built
    /// for the device's plain architecture).
    pub cuda_form: *const c_char,
    /// CPU: null or an instruction set of `mlxn_cpu_info`'s `detected`, or `amx-emulated`.
    pub cpu_isa: *const c_char,
}

/// FP8 K/V's descale factors (SPEC 11, FlashAttention-3's `k_descale`, `v_descale`), as the
/// plan calls take them: each a null pointer with length 0 (every factor 1), one value (for
/// every KV head) or `n_kv_heads` values (one per KV head). The value of an element `x` of K
/// is `k[g] * float(x)`. Only with FP8 K/V (`kv_dtype` 7 or 8).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MlxnKvDescale {
    pub k: *const f32,
    pub k_len: u32,
    pub v: *const f32,
    pub v_len: u32,
}

/// K's and V's descale factors, each absent or a slice.
type DescalePair<'a> = (Option<&'a [f32]>, Option<&'a [f32]>);

/// The factors `d` points to (null: none), as slices.
///
/// # Safety
/// `d` null or valid, its pointers null or holding their lengths.
unsafe fn descale_args<'a>(d: *const MlxnKvDescale) -> Result<DescalePair<'a>> {
    if d.is_null() {
        return Ok((None, None));
    }
    let d = *d;
    let slice = |ptr: *const f32, n: u32, name: &str| -> Result<Option<&'a [f32]>> {
        match (ptr.is_null(), n) {
            (true, 0) => Ok(None),
            (true, _) => Err(MlxError::InvalidArgument(format!("flash_attn_prefill: {name} is a null pointer"))),
            (false, 0) => Err(MlxError::InvalidArgument(format!(
                "flash_attn_prefill: {name} has no values; give one, n_kv_heads, or a null pointer (every factor 1)"
            ))),
            (false, n) => Ok(Some(std::slice::from_raw_parts(ptr, n as usize))),
        }
    };
    Ok((slice(d.k, d.k_len, "k_descale")?, slice(d.v, d.v_len, "v_descale")?))
}

/// The options `o` points to (null: the defaults), each checked: a value not understood
/// is an error that names the option and what it takes.
unsafe fn run_options(o: *const MlxnRunOptions) -> Result<RunOptions> {
    if o.is_null() {
        return Ok(RunOptions::default());
    }
    let o = *o;
    let bad = |what: String| Err(MlxError::InvalidArgument(what));
    let text = |p: *const c_char, name: &str| if p.is_null() { Ok(None) } else { c_str(p, name).map(Some) };
    let kv_splits = match (o.has_kv_splits, o.kv_splits) {
        (0, _) => None,
        (1, n) if (0..=i64::from(crate::options::MAX_KV_SPLITS)).contains(&n) && kv_splits_ok(n as u32) => {
            Some(n as u32)
        }
        (1, n) => {
            return bad(format!(
                "kv_splits={n} is not 0, 1, 2, 4, 8 or 16: pass one of them, or None to let the shape decide"
            ))
        }
        (h, _) => return bad(format!("has_kv_splits must be 0 or 1, got {h}")),
    };
    let cta_pairs = match text(o.cta_pairs, "cta_pairs")? {
        None => None,
        Some(s) => match CtaPairs::parse(s) {
            Some(p) => Some(p),
            None => return bad(format!("cta_pairs={s:?} is not {}: pass one of them, or None", CtaPairs::NAMES)),
        },
    };
    let cuda_form = match text(o.cuda_form, "cuda_form")? {
        None => None,
        Some(s) => match CudaForm::parse(s) {
            Some(f) => Some(f),
            None => return bad(format!("cuda_form={s:?} is not {}: pass one of them, or None", CudaForm::NAMES)),
        },
    };
    let cpu_isa = match text(o.cpu_isa, "cpu_isa")? {
        None => None,
        Some(s) => match crate::backend::cpu::simd::isa_named(s) {
            Some(i) => Some(i),
            None => {
                return bad(format!(
                    "cpu_isa={s:?} is not an instruction set of this CPU: pass one of {}, or None for the best",
                    crate::backend::cpu::simd::forceable_isas().join(", ")
                ))
            }
        },
    };
    Ok(RunOptions { kv_splits, cta_pairs, cuda_form, cpu_isa })
}

fn dtype_arg(code: u32) -> Result<DType> {
    DType::from_code(code).ok_or_else(|| MlxError::UnsupportedDtype(format!("no dtype has code {code}")))
}

/// Copy `s` (NUL-terminated) into `buf` of `cap` bytes, truncating; `needed` gets the full
/// size including the NUL. `buf` may be null to ask for the size.
unsafe fn write_string(s: &str, buf: *mut c_char, cap: usize, needed: *mut usize) -> Result<()> {
    if !needed.is_null() {
        *needed = s.len() + 1;
    }
    if !buf.is_null() && cap > 0 {
        let n = s.len().min(cap - 1);
        std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    Ok(())
}

fn backend_code(kind: BackendKind) -> u32 {
    match kind {
        BackendKind::Cpu => 0,
        BackendKind::Cuda => 1,
        BackendKind::Metal => 2,
    }
}

// ---------------------------------------------------------------- library

/// The library version, a static NUL-terminated string.
#[no_mangle]
pub extern "C" fn mlxn_version() -> *const c_char {
    static V: LazyLock<CString> = LazyLock::new(|| CString::new(crate::VERSION).unwrap_or_default());
    V.as_ptr()
}

/// The message of the last failed call on this thread (empty if none). Valid until the
/// next failing call on this thread.
#[no_mangle]
pub extern "C" fn mlxn_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Comma-separated names of the backends that can open a device here, best first.
///
/// # Safety
/// `buf` must hold `cap` bytes (or be null); `needed` must be null or valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_backends(buf: *mut c_char, cap: usize, needed: *mut usize) -> i32 {
    guard(|| write_string(&crate::backend::available_backends().join(","), buf, cap, needed))
}

/// The CPU backend's facts: `isa=<in use>;detected=<a,b,..>;threads=<n>;memory=<bytes>;
/// runtime=<rayon | openmp (path)>` (memory: the most a buffer may take, RAM plus swap within
/// the cgroup limit, 0 unknown; runtime: what runs the kernels' parallel jobs).
///
/// # Safety
/// As for [`mlxn_backends`].
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_info(buf: *mut c_char, cap: usize, needed: *mut usize) -> i32 {
    guard(|| {
        use crate::backend::cpu::simd;
        let s = format!(
            "isa={};detected={};threads={};memory={};runtime={}",
            simd::selected_isa(),
            simd::detected_isas().join(","),
            crate::backend::cpu::threads(),
            crate::backend::cpu::memory_limit().unwrap_or(0),
            crate::backend::cpu::pool::runtime()
        );
        write_string(&s, buf, cap, needed)
    })
}

/// Make the CPU kernels use one instruction set (`amx`, `avx512`, `avx2+fma+f16c`,
/// `portable`, or `amx-emulated`: the AMX kernels on software tiles, on any CPU), or the best
/// available with null, `""` or `auto`. Process-wide; for tests and benchmarks.
///
/// # Safety
/// `name` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_force_isa(name: *const c_char) -> i32 {
    guard(|| {
        let name = if name.is_null() { None } else { Some(c_str(name, "name")?) };
        crate::backend::cpu::simd::force_isa(name)
    })
}

/// Make the CPU kernels run on `threads` threads from the next run on (0: back to the
/// default: `RAYON_NUM_THREADS`, else every core the process may use). Process-wide.
#[no_mangle]
pub extern "C" fn mlxn_cpu_set_threads(threads: u32) -> i32 {
    guard(|| crate::backend::cpu::pool::set_threads(threads as usize))
}

/// Run the CPU kernels' parallel jobs on the OpenMP runtime already loaded in this process
/// (PyTorch's libgomp; `on` 1), or on the library's own pool (`on` 0). `found` (may be null)
/// gets 1 where such a runtime was found and is used now. Process-wide.
///
/// # Safety
/// `found` must be null or valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_use_openmp(on: i32, found: *mut i32) -> i32 {
    guard(|| {
        let f = crate::backend::cpu::pool::use_openmp(on != 0);
        if !found.is_null() {
            *found = f as i32;
        }
        Ok(())
    })
}

/// Make every CUDA launch use the CTA-pair choice `mode` (`"0"`: the one-CTA forms,
/// `"queries"`: query pairs only, `"1"`: head pairs where they fit), or go back to
/// `MLX_NATIVE_CUDA_PAIR`'s with null or `""`. Process-wide; for tests and benchmarks.
///
/// # Safety
/// `mode` must be null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cuda_force_pair(mode: *const c_char) -> i32 {
    guard(|| {
        let mode = if mode.is_null() { "" } else { c_str(mode, "mode")? };
        let pair = match mode {
            "" => None,
            _ => Some(CtaPairs::parse(mode).ok_or_else(|| {
                MlxError::InvalidArgument(format!(
                    "CTA-pair mode {mode:?} is not one of \"0\", \"queries\", \"1\" (or \"\" for the default)"
                ))
            })?),
        };
        crate::backend::cuda::flash_attn_prefill::force_pair(pair);
        Ok(())
    })
}

/// The settings read from the environment (each once, the first time any is asked for:
/// this call reads them) whose values were not understood and were ignored: one message a
/// line, each naming the variable and its value; empty when there are none.
///
/// # Safety
/// As for [`mlxn_backends`].
#[no_mangle]
pub unsafe extern "C" fn mlxn_settings_report(buf: *mut c_char, cap: usize, needed: *mut usize) -> i32 {
    guard(|| {
        // The CPU's instruction set is checked against the CPU where it is first chosen.
        crate::backend::cpu::simd::default_isa();
        write_string(&crate::settings::complaints().join("\n"), buf, cap, needed)
    })
}

/// The measured FMA peak of the CPU in GFLOP/s (f32, an FMA counting 2 FLOP per lane) on
/// `threads` threads (0: all the threads the kernels use), with the instruction set the
/// kernels use now. Runs a calibrated register-only loop for about a quarter of a second.
///
/// # Safety
/// `out_gflops` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_fma_peak(threads: u32, out_gflops: *mut f64) -> i32 {
    guard(|| {
        let out = out_ptr(out_gflops, "out_gflops")?;
        *out = crate::backend::cpu::peak::fma_peak_gflops(threads as usize)?;
        Ok(())
    })
}

/// The measured AMX-BF16 peak of the CPU in GFLOP/s (TDPBF16PS on tile registers, a
/// multiply-add counting 2 FLOP) on `threads` threads (0: all the threads the kernels use),
/// as [`mlxn_cpu_fma_peak`] measures the FMA peak. Status `BackendUnavailable` where the CPU
/// or its OS offers no AMX tiles.
///
/// # Safety
/// `out_gflops` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_amx_peak(threads: u32, out_gflops: *mut f64) -> i32 {
    guard(|| {
        let out = out_ptr(out_gflops, "out_gflops")?;
        *out = crate::backend::cpu::peak::amx_peak_gflops(threads as usize)?;
        Ok(())
    })
}

/// Whether `kv_dtype` (a `DType` code: 1 F16, 2 BF16) names BF16 K/V, for the AMX settings.
fn amx_kv_bf16(kv_dtype: i32) -> Result<bool> {
    match kv_dtype {
        1 => Ok(false),
        2 => Ok(true),
        d => Err(MlxError::InvalidArgument(format!("kv_dtype must be 1 (F16) or 2 (BF16), got {d}"))),
    }
}

/// The bf16 products the CPU's AMX kernels sum for each product of the attention with K/V of
/// `kv_dtype` (1 F16, 2 BF16): `qk` for Q.K^T and `pv` for P.V, each 1 to 4 (1 or 2 with
/// BF16), or 0 and 0 for the default (see docs/spec.md, "AMX"). Process-wide; for
/// measurements and tests that compare the splits.
///
/// # Safety
/// None beyond the call itself.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_set_amx_products(kv_dtype: i32, qk: u32, pv: u32) -> i32 {
    guard(|| {
        use crate::backend::cpu::amx;
        let bf16 = amx_kv_bf16(kv_dtype)?;
        let p = match (qk, pv) {
            (0, 0) => None,
            _ => Some(amx::Products { qk: qk.min(255) as u8, pv: pv.min(255) as u8 }),
        };
        amx::set_products(bf16, p)
    })
}

/// The bf16 products the AMX kernels use now with K/V of `kv_dtype` (1 F16, 2 BF16).
///
/// # Safety
/// `qk` and `pv` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_cpu_amx_products(kv_dtype: i32, qk: *mut u32, pv: *mut u32) -> i32 {
    guard(|| {
        let (qk, pv) = (out_ptr(qk, "qk")?, out_ptr(pv, "pv")?);
        let p = crate::backend::cpu::amx::products(amx_kv_bf16(kv_dtype)?);
        (*qk, *pv) = (p.qk as u32, p.pv as u32);
        Ok(())
    })
}

/// Handles (devices, buffers, encoders) open now, process-wide; for leak checks.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_handle_count(out: *mut u64) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = lock(&HANDLES).len() as u64;
        Ok(())
    })
}

// ---------------------------------------------------------------- devices

/// Open a device: `auto`, `cpu`, `cuda`, `cuda:N`, `metal`.
///
/// # Safety
/// `backend` must be a NUL-terminated string; `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_device_open(backend: *const c_char, out: *mut u64) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let name = c_str(backend, "backend")?;
        let device = MlxDevice::new(name)?;
        let ctx = DeviceCtx { device, registry: Mutex::new(crate::default_registry()) };
        *out = insert(Object::Device(Arc::new(ctx)));
        Ok(())
    })
}

/// Close a device handle. Buffers and encoders made from it stay usable until they are
/// freed; the device itself goes when the last of them does.
#[no_mangle]
pub extern "C" fn mlxn_device_close(dev: u64) -> i32 {
    guard(|| release(dev, "device", |o| matches!(o, Object::Device(_))))
}

/// A one-line description of the device and its backend code (0 CPU, 1 CUDA, 2 Metal).
///
/// # Safety
/// As for [`mlxn_backends`]; `backend` must be null or valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_device_info(
    dev: u64,
    backend: *mut u32,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard(|| {
        let d = device(dev)?;
        if !backend.is_null() {
            *backend = backend_code(d.device.backend_kind());
        }
        write_string(&d.device.description(), buf, cap, needed)
    })
}

/// Whether the tensor flash-attention pipeline for `head_dim` builds on the device
/// (`*out` = 1 or 0). An unsupported head dim is an error.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_flash_attn_prefill_tensor_available(dev: u64, head_dim: u32, out: *mut i32) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let d = device(dev)?;
        let ok = fa::flash_attn_prefill_tensor_available(&mut lock(&d.registry), &d.device, head_dim)?;
        *out = ok as i32;
        Ok(())
    })
}

// ---------------------------------------------------------------- buffers

/// A new zero-filled buffer of `shape` (`ndim` dims) elements of `dtype` on the device.
///
/// # Safety
/// `shape` must hold `ndim` values; `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_new(dev: u64, dtype: u32, shape: *const u64, ndim: usize, out: *mut u64) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let d = device(dev)?;
        let dtype = dtype_arg(dtype)?;
        let shape = shape_arg(shape, ndim)?;
        let b = d.device.alloc_buffer(dtype, &shape)?;
        *out = insert(Object::Buffer(b));
        Ok(())
    })
}

/// A buffer over `nbytes` bytes of host memory at `ptr`, used in place (no copy) where the
/// backend can (the CPU); the caller keeps the memory alive until the buffer is freed.
///
/// # Safety
/// `ptr` must point to `nbytes` bytes that stay valid until the buffer handle is freed and
/// no dispatch that uses it is pending; `shape` must hold `ndim` values; `out` valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_wrap_host(
    dev: u64,
    ptr: *mut c_void,
    nbytes: usize,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    out: *mut u64,
) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let d = device(dev)?;
        let dtype = dtype_arg(dtype)?;
        let shape = shape_arg(shape, ndim)?;
        let b = d.device.wrap_host(ptr as *mut u8, nbytes, dtype, &shape)?;
        *out = insert(Object::Buffer(b));
        Ok(())
    })
}

/// A buffer over `nbytes` bytes of device memory at address `addr` (a CUDA tensor of
/// PyTorch or CuPy), used in place; the device must be a CUDA device and the address
/// memory of that device. The caller keeps the memory alive until the buffer is freed.
///
/// # Safety
/// `addr` must stay allocated until the buffer handle is freed and no dispatch that uses
/// it is pending; `shape` must hold `ndim` values; `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_wrap_device(
    dev: u64,
    addr: u64,
    nbytes: usize,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    out: *mut u64,
) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let d = device(dev)?;
        let dtype = dtype_arg(dtype)?;
        let shape = shape_arg(shape, ndim)?;
        let b = d.device.wrap_device(addr, nbytes, dtype, &shape)?;
        *out = insert(Object::Buffer(b));
        Ok(())
    })
}

/// Wait for the work queued on another library's CUDA stream (`stream`, as the CUDA
/// Array Interface gives it: a `cudaStream_t`, or 1 / 2 for the default streams) before
/// the device uses memory that work writes. An error on devices without streams.
#[no_mangle]
pub extern "C" fn mlxn_device_wait_stream(dev: u64, stream: u64) -> i32 {
    guard(|| device(dev)?.device.backend().wait_stream(stream))
}

/// Compile every CUDA kernel source of the library with NVRTC for `arch` (`sm_90a`,
/// `sm_80`, ...), without a GPU; the string is ptxas's report (registers, spills per
/// entry point). `BackendUnavailable` when NVRTC cannot be loaded, `ShaderCompilationError`
/// with the compiler's log when a source does not compile.
///
/// # Safety
/// `arch` must be a NUL-terminated string; otherwise as for [`mlxn_backends`].
#[no_mangle]
pub unsafe extern "C" fn mlxn_cuda_compile_check(
    arch: *const c_char,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard(|| {
        let arch = c_str(arch, "arch")?;
        if arch.is_empty() || !arch.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(MlxError::InvalidArgument(format!("bad CUDA architecture {arch:?} (sm_90a, sm_80, ...)")));
        }
        let report = crate::backend::cuda::compile_check(arch, &crate::default_registry().cuda_sources())?;
        write_string(&report, buf, cap, needed)
    })
}

/// Describe a buffer.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_info(buf: u64, out: *mut MlxnBufferInfo) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let b = buffer(buf)?;
        let mut shape = [0u64; MLXN_MAX_DIMS];
        for (s, &d) in shape.iter_mut().zip(b.shape()) {
            *s = d as u64;
        }
        let backend = lookup_backend_of(&b);
        *out = MlxnBufferInfo {
            dtype: b.dtype() as u32,
            ndim: b.shape().len() as u32,
            shape,
            byte_len: b.data_byte_len() as u64,
            host_ptr: b.host_ptr().map_or(std::ptr::null_mut(), |p| p as *mut c_void),
            backend,
        };
        Ok(())
    })
}

fn lookup_backend_of(b: &MlxBuffer) -> u32 {
    let table = lock(&HANDLES);
    table
        .values()
        .find_map(|o| match o {
            Object::Device(d) if d.device.registry_id() == b.device_id() => Some(backend_code(d.device.backend_kind())),
            _ => None,
        })
        .unwrap_or_else(|| if b.host_ptr().is_some() { 0 } else { 1 })
}

/// Copy `n` bytes at byte `offset` of the buffer into `dst`.
///
/// # Safety
/// `dst` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_read(buf: u64, offset: usize, dst: *mut c_void, n: usize) -> i32 {
    guard(|| {
        let b = buffer(buf)?;
        if n == 0 {
            return Ok(());
        }
        let dst = out_ptr(dst, "dst")?;
        b.read_bytes(offset, std::slice::from_raw_parts_mut(dst as *mut u8, n))
    })
}

/// Copy `n` bytes from `src` into the buffer at byte `offset`.
///
/// # Safety
/// `src` must hold `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_write(buf: u64, offset: usize, src: *const c_void, n: usize) -> i32 {
    guard(|| {
        let b = buffer(buf)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(MlxError::InvalidArgument("src is a null pointer".into()));
        }
        b.write_bytes(offset, std::slice::from_raw_parts(src as *const u8, n))
    })
}

/// A new buffer handle over `byte_len` bytes at `byte_offset` of `buf`, as `dtype` with
/// `shape` (`ndim` dims, 0 for flat): the same memory, no copy; it keeps the memory alive
/// after `buf` is freed. The offset must be aligned to `dtype`.
///
/// # Safety
/// `shape` must hold `ndim` values; `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_buffer_view(
    buf: u64,
    byte_offset: usize,
    byte_len: usize,
    dtype: u32,
    shape: *const u64,
    ndim: usize,
    out: *mut u64,
) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let b = buffer(buf)?;
        let dtype = dtype_arg(dtype)?;
        let shape = shape_arg(shape, ndim)?;
        let view = b.view(byte_offset, byte_len, dtype, shape)?;
        *out = insert(Object::Buffer(view));
        Ok(())
    })
}

/// Free a buffer handle. Memory a pending dispatch still uses stays until it is done.
#[no_mangle]
pub extern "C" fn mlxn_buffer_free(buf: u64) -> i32 {
    guard(|| release(buf, "buffer", |o| matches!(o, Object::Buffer(_))))
}

// ---------------------------------------------------------------- encoders

/// A new command encoder on the device.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_encoder_new(dev: u64, out: *mut u64) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let ctx = device(dev)?;
        let encoder = Mutex::new(ctx.device.command_encoder());
        *out = insert(Object::Encoder(Arc::new(EncoderCtx { ctx, encoder })));
        Ok(())
    })
}

/// Record the encoder's next dispatches with the run options `options` (null: the
/// defaults), checked as `mlxn_prefill_plan_new` checks them.
///
/// # Safety
/// `options` must be null or valid, its strings null or NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn mlxn_encoder_set_options(enc: u64, options: *const MlxnRunOptions) -> i32 {
    guard(|| {
        let o = run_options(options)?;
        lock(&encoder(enc)?.encoder).set_options(o);
        Ok(())
    })
}

/// Dispatches recorded and not yet committed.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_encoder_pending(enc: u64, out: *mut u64) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let e = encoder(enc)?;
        *out = lock(&e.encoder).pending().len() as u64;
        Ok(())
    })
}

/// Run every recorded dispatch and wait for them to finish.
#[no_mangle]
pub extern "C" fn mlxn_encoder_commit_and_wait(enc: u64) -> i32 {
    guard(|| {
        let e = encoder(enc)?;
        let mut guard = lock(&e.encoder);
        guard.commit_and_wait()
    })
}

/// Run every recorded dispatch on the caller's CUDA stream (a `cudaStream_t`) and return
/// without waiting (CUDA devices); devices without streams run them now and wait.
#[no_mangle]
pub extern "C" fn mlxn_encoder_commit_on_stream(enc: u64, stream: u64) -> i32 {
    guard(|| {
        let e = encoder(enc)?;
        let mut guard = lock(&e.encoder);
        guard.commit_on_stream(stream)
    })
}

/// Free an encoder; dispatches it recorded and never committed are dropped unrun.
#[no_mangle]
pub extern "C" fn mlxn_encoder_free(enc: u64) -> i32 {
    guard(|| release(enc, "encoder", |o| matches!(o, Object::Encoder(_))))
}

// ---------------------------------------------------------------- ops

/// `dispatch_flash_attn_prefill_tensor_f16`: record one flash-attention dispatch.
///
/// # Safety
/// `params` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_dispatch_flash_attn_prefill_tensor_f16(
    enc: u64,
    q: u64,
    k: u64,
    v: u64,
    mask: u64,
    blk: u64,
    out: u64,
    params: *const FlashAttnPrefillTensorParams,
) -> i32 {
    guard(|| {
        if params.is_null() {
            return Err(MlxError::InvalidArgument("params is a null pointer".into()));
        }
        let p = *params;
        let e = encoder(enc)?;
        let (q, k, v, mask, blk, out) = (buffer(q)?, buffer(k)?, buffer(v)?, buffer(mask)?, buffer(blk)?, buffer(out)?);
        let mut encoder = lock(&e.encoder);
        let mut registry = lock(&e.ctx.registry);
        fa::dispatch_flash_attn_prefill_tensor_f16(
            &mut encoder,
            &mut registry,
            &e.ctx.device,
            &q,
            &k,
            &v,
            &mask,
            &blk,
            &out,
            &p,
        )
    })
}

/// `dispatch_flash_attn_prefill_blk`: record one mask classification.
#[no_mangle]
pub extern "C" fn mlxn_dispatch_flash_attn_prefill_blk(
    enc: u64,
    mask: u64,
    blk: u64,
    rows: u32,
    kv_pad: u32,
    bq: u32,
    bk: u32,
) -> i32 {
    guard(|| {
        let e = encoder(enc)?;
        let (mask, blk) = (buffer(mask)?, buffer(blk)?);
        let p = FlashAttnPrefillBlkParams { rows, kv_pad, bq, bk };
        let mut encoder = lock(&e.encoder);
        let mut registry = lock(&e.ctx.registry);
        flash_attn_prefill_blk::dispatch_flash_attn_prefill_blk(
            &mut encoder,
            &mut registry,
            &e.ctx.device,
            &mask,
            &blk,
            &p,
        )
    })
}

/// Queries per threadgroup (the blk `bq`) at `head_dim`.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_queries_per_threadgroup(head_dim: u32, out: *mut u32) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = fa::queries_per_threadgroup(head_dim)?;
        Ok(())
    })
}

/// Whether this build has a prefill kernel for Q/K head dim `head_dim`, V head dim
/// `head_dim_v` (0: the same) and K/V dtype code `kv_dtype`: 0, or the error that names the
/// head dims it takes.
#[no_mangle]
pub extern "C" fn mlxn_flash_attn_prefill_supports(head_dim: u32, head_dim_v: u32, kv_dtype: u32) -> i32 {
    guard(|| {
        let dv = if head_dim_v == 0 { head_dim } else { head_dim_v };
        prefill::kernel_name(head_dim, dv, dtype_arg(kv_dtype)?).map(|_| ())
    })
}

/// Threadgroup memory of one dispatch of the Metal kernel at `head_dim`.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_threadgroup_memory_bytes(head_dim: u32, out: *mut u64) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        *out = fa::threadgroup_memory_bytes(head_dim)?;
        Ok(())
    })
}

/// `kv_len` rounded up to a multiple of the cache step.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_kv_pad(kv_len: u32, out: *mut u32) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        if kv_len > u32::MAX - (fa::CACHE_ROWS_PER_STEP - 1) {
            return Err(MlxError::InvalidArgument(format!("kv_len {kv_len} cannot be padded in 32 bits")));
        }
        *out = fa::kv_pad(kv_len);
        Ok(())
    })
}

/// Cache rows per step (the blk `bk`).
#[no_mangle]
pub extern "C" fn mlxn_cache_rows_per_step() -> u32 {
    fa::CACHE_ROWS_PER_STEP
}

// ---------------------------------------------------------------- the front door's op

/// `dispatch_flash_attn_prefill`: record one prefill over a batch (SPEC 6-10). `mask`,
/// `blk`, `cu_seqlens_q`, `cu_seqlens_k`, `lse`, `sinks`, `alibi_slopes` and `workspace` are
/// optional: 0 for none (`alibi_slopes`: F32 `[n_heads]` or `[batch, n_heads]`, as
/// `params->alibi_slopes` says). `workspace`: scratch for this dispatch alone, of at least the bytes a plan of
/// the same prefill reports (`MlxnPrefillExtents::workspace`), with which the CUDA
/// attention may split its walk over the cache; without one it does not.
///
/// # Safety
/// `params` must be valid.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mlxn_dispatch_flash_attn_prefill(
    enc: u64,
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    mask: u64,
    blk: u64,
    cu_seqlens_q: u64,
    cu_seqlens_k: u64,
    lse: u64,
    sinks: u64,
    alibi_slopes: u64,
    workspace: u64,
    params: *const FlashAttnPrefillParams,
) -> i32 {
    guard(|| {
        if params.is_null() {
            return Err(MlxError::InvalidArgument("params is a null pointer".into()));
        }
        let p = *params;
        let e = encoder(enc)?;
        let (q, k, v, out) = (buffer(q)?, buffer(k)?, buffer(v)?, buffer(out)?);
        let (mask, blk, lse) = (optional_buffer(mask)?, optional_buffer(blk)?, optional_buffer(lse)?);
        let (sinks, workspace) = (optional_buffer(sinks)?, optional_buffer(workspace)?);
        let alibi_slopes = optional_buffer(alibi_slopes)?;
        let (cu_q, cu_k) = (optional_buffer(cu_seqlens_q)?, optional_buffer(cu_seqlens_k)?);
        let b = FlashAttnPrefillBuffers {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            mask: mask.as_ref(),
            blk: blk.as_ref(),
            cu_seqlens_q: cu_q.as_ref(),
            cu_seqlens_k: cu_k.as_ref(),
            lse: lse.as_ref(),
            sinks: sinks.as_ref(),
            alibi_slopes: alibi_slopes.as_ref(),
            workspace: workspace.as_ref(),
        };
        let mut encoder = lock(&e.encoder);
        let mut registry = lock(&e.ctx.registry);
        prefill::dispatch_flash_attn_prefill(&mut encoder, &mut registry, &e.ctx.device, &b, &p)
    })
}

/// `dispatch_flash_attn_prefill_mask_blk`: record the classification of an explicit mask
/// (`params`' shapes and mask strides) into its tile table.
///
/// # Safety
/// `params` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_dispatch_flash_attn_prefill_mask_blk(
    enc: u64,
    mask: u64,
    blk: u64,
    params: *const FlashAttnPrefillParams,
) -> i32 {
    guard(|| {
        if params.is_null() {
            return Err(MlxError::InvalidArgument("params is a null pointer".into()));
        }
        let p = *params;
        let e = encoder(enc)?;
        let (mask, blk) = (buffer(mask)?, buffer(blk)?);
        let mut encoder = lock(&e.encoder);
        let mut registry = lock(&e.ctx.registry);
        prefill::dispatch_flash_attn_prefill_mask_blk(&mut encoder, &mut registry, &e.ctx.device, &mask, &blk, &p)
    })
}

/// Bytes of the explicit mask's tile table of a prefill.
///
/// # Safety
/// `params` and `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_flash_attn_prefill_mask_table_bytes(
    params: *const FlashAttnPrefillParams,
    out: *mut u64,
) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        if params.is_null() {
            return Err(MlxError::InvalidArgument("params is a null pointer".into()));
        }
        *out = prefill::mask_table_bytes(&*params)?;
        Ok(())
    })
}

/// Elements each operand of a prefill plan must hold (bytes for `blk`, which the plan owns,
/// and for `workspace`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MlxnPrefillExtents {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub mask: u64,
    pub blk: u64,
    pub lse: u64,
    pub sinks: u64,
    /// F32 ALiBi slopes (`[n_heads]` or `[batch, n_heads]`; 0 without).
    pub alibi_slopes: u64,
    /// Bytes of scratch a run can use to go faster (0: none helps): the CUDA attention
    /// splits its walk over the cache when the shape leaves the GPU idle. Pass a buffer
    /// of this size to each run (one per run in flight), or 0 to run unsplit.
    pub workspace: u64,
}

/// Plan a prefill on its shapes (FlashInfer's `plan`): checks `params` with the operands'
/// dtypes (`DType` codes of q, of k and v, of out) and which optional operands there are
/// (`has_mask`, `has_lse`, `has_sinks`: 0 or 1). For a variable-length batch `cu_seqlens_q` and
/// `cu_seqlens_k` point to `batch + 1` int32 in host memory each (checked here and copied
/// to the device); null for fixed length. Quantised K/V (SPEC 11, the CPU and CUDA backends): `kv_dtype`
/// 7 (FP8 E4M3), 8 (FP8 E5M2) or 9 (Q8_0 blocks, K/V strides in bytes); `descale`: FP8's
/// factors ([`MlxnKvDescale`]), null for none. `options`: the run options (null: the defaults),
/// each checked here; `mlxn_prefill_plan_choices` says what the backend chose under them.
///
/// # Safety
/// `params` and `out` must be valid; the cu_seqlens pointers null or `batch + 1` values;
/// `options` null or valid.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mlxn_prefill_plan_new(
    dev: u64,
    params: *const FlashAttnPrefillParams,
    q_dtype: u32,
    kv_dtype: u32,
    out_dtype: u32,
    has_mask: i32,
    has_lse: i32,
    has_sinks: i32,
    cu_seqlens_q: *const i32,
    cu_seqlens_k: *const i32,
    descale: *const MlxnKvDescale,
    options: *const MlxnRunOptions,
    out: *mut u64,
) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let options = run_options(options)?;
        let (k_descale, v_descale) = descale_args(descale)?;
        let (p, ctx, operands) =
            prefill_plan_args(params, dev, [q_dtype, kv_dtype, out_dtype], [has_mask, has_lse, has_sinks])?;
        let n = p.batch as usize + 1;
        let cu = match (cu_seqlens_q.is_null(), cu_seqlens_k.is_null()) {
            (true, true) => None,
            (false, false) => {
                Some((std::slice::from_raw_parts(cu_seqlens_q, n), std::slice::from_raw_parts(cu_seqlens_k, n)))
            }
            _ => {
                return Err(MlxError::InvalidArgument(
                    "flash_attn_prefill: cu_seqlens_q and cu_seqlens_k go together: give both or neither".into(),
                ))
            }
        };
        let plan = FlashAttnPrefillPlan::with_options(&ctx.device, &p, &operands, cu, options)?
            .with_descale(k_descale, v_descale)?;
        *out = insert(Object::Plan(Arc::new(PlanCtx { ctx, plan })));
        Ok(())
    })
}

/// A prefill plan's params, device and operands as both plan calls (`mlxn_prefill_plan_new`,
/// `mlxn_prefill_plan_new_paged`) take them, checked in this order: `params` read (null
/// refused), the device handle, the dtype codes (q, K/V, out) and the 0/1 flags (mask, lse,
/// sinks).
///
/// # Safety
/// `params` must be null or valid.
unsafe fn prefill_plan_args(
    params: *const FlashAttnPrefillParams,
    dev: u64,
    [q_dtype, kv_dtype, out_dtype]: [u32; 3],
    [has_mask, has_lse, has_sinks]: [i32; 3],
) -> Result<(FlashAttnPrefillParams, Arc<DeviceCtx>, PrefillOperands)> {
    if params.is_null() {
        return Err(MlxError::InvalidArgument("params is a null pointer".into()));
    }
    let p = *params;
    let ctx = device(dev)?;
    let flag = |x: i32, name: &str| match x {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(MlxError::InvalidArgument(format!("{name} must be 0 or 1, got {x}"))),
    };
    let operands = PrefillOperands {
        q_dtype: dtype_arg(q_dtype)?,
        kv_dtype: dtype_arg(kv_dtype)?,
        out_dtype: dtype_arg(out_dtype)?,
        mask: flag(has_mask, "has_mask")?,
        lse: flag(has_lse, "has_lse")?,
        sinks: flag(has_sinks, "has_sinks")?,
        alibi_slopes: p.alibi_slopes != 0,
    };
    Ok((p, ctx, operands))
}

/// Plan a prefill on paged K/V (SPEC 11), as [`mlxn_prefill_plan_new`] does otherwise: `k`
/// and `v` are the caches `[num_blocks, block_size, n_kv_heads, head_dim]`, whose (block,
/// row, head) strides are `params.k_strides` / `v_strides` (`params.kv_len` is not read);
/// `block_table` points to `batch * max_blocks` int32 in host memory (row-major), `seqused_k`
/// to `batch` int32 (each sequence's cache length); both are checked here (an entry a
/// sequence reads outside `[0, num_blocks)`, a length below 0 or beyond its table row) and
/// copied for the plan's runs. `cu_seqlens_q`: `batch + 1` int32 offsets of the queries
/// (variable length), or null for `params.rows` query rows per sequence. `options`: the run
/// options (null: the defaults). Runs on the CPU backend; elsewhere an `InvalidArgument`
/// naming `block_table`.
///
/// # Safety
/// `params` and `out` must be valid; the pointers hold the counts above (`cu_seqlens_q`
/// may be null); `options` null or valid.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mlxn_prefill_plan_new_paged(
    dev: u64,
    params: *const FlashAttnPrefillParams,
    q_dtype: u32,
    kv_dtype: u32,
    out_dtype: u32,
    has_mask: i32,
    has_lse: i32,
    has_sinks: i32,
    cu_seqlens_q: *const i32,
    block_table: *const i32,
    max_blocks: u32,
    seqused_k: *const i32,
    num_blocks: u32,
    block_size: u32,
    descale: *const MlxnKvDescale,
    options: *const MlxnRunOptions,
    out: *mut u64,
) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let options = run_options(options)?;
        let (k_descale, v_descale) = descale_args(descale)?;
        let (p, ctx, operands) =
            prefill_plan_args(params, dev, [q_dtype, kv_dtype, out_dtype], [has_mask, has_lse, has_sinks])?;
        let batch = p.batch as usize;
        let entries = batch.checked_mul(max_blocks as usize).ok_or_else(|| {
            MlxError::InvalidArgument(format!("flash_attn_prefill: a block table of {batch} x {max_blocks} entries"))
        })?;
        let slice = |ptr: *const i32, n: usize, name: &str| -> Result<&[i32]> {
            match (ptr.is_null(), n) {
                (_, 0) => Ok(&[]),
                (true, _) => Err(MlxError::InvalidArgument(format!("flash_attn_prefill: {name} is a null pointer"))),
                (false, n) => Ok(std::slice::from_raw_parts(ptr, n)),
            }
        };
        let paged = PagedKv {
            block_table: slice(block_table, entries, "block_table")?,
            max_blocks,
            seqused_k: slice(seqused_k, batch, "seqused_k")?,
            num_blocks,
            block_size,
        };
        let cq = if cu_seqlens_q.is_null() { None } else { Some(std::slice::from_raw_parts(cu_seqlens_q, batch + 1)) };
        let plan = FlashAttnPrefillPlan::new_paged(&ctx.device, &p, &operands, cq, &paged, options)?
            .with_descale(k_descale, v_descale)?;
        *out = insert(Object::Plan(Arc::new(PlanCtx { ctx, plan })));
        Ok(())
    })
}

/// What each operand of a plan must hold.
///
/// # Safety
/// `out` must be valid.
#[no_mangle]
pub unsafe extern "C" fn mlxn_prefill_plan_extents(plan_handle: u64, out: *mut MlxnPrefillExtents) -> i32 {
    guard(|| {
        let out = out_ptr(out, "out")?;
        let pc = plan(plan_handle)?;
        let e = pc.plan.extents();
        *out = MlxnPrefillExtents {
            q: e.q,
            k: e.k,
            v: e.v,
            out: e.out,
            mask: e.mask,
            blk: e.blk,
            lse: e.lse,
            sinks: e.sinks,
            alibi_slopes: e.alibi_slopes,
            workspace: pc.plan.workspace_bytes(),
        };
        Ok(())
    })
}

/// What the plan's backend chose under its options, as `name=value` pairs separated by
/// `;`: `form` (`cpu`, `hopper`, `portable`, `metal`), and where they apply `arch` (the
/// CUDA target), `pairs` (the CTA-pair forms allowed), `splits` (the parts of a run given
/// its workspace; 1: none) and `isa` (the CPU's instruction set). As for [`mlxn_backends`].
///
/// # Safety
/// As for [`mlxn_backends`].
#[no_mangle]
pub unsafe extern "C" fn mlxn_prefill_plan_choices(
    plan_handle: u64,
    buf: *mut c_char,
    cap: usize,
    needed: *mut usize,
) -> i32 {
    guard(|| {
        let pc = plan(plan_handle)?;
        let report = pc.plan.choices().report.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";");
        write_string(&report, buf, cap, needed)
    })
}

/// Run a plan on data (FlashInfer's `run`): each operand by address (a host pointer on the
/// CPU and Metal, a device address on CUDA), holding what [`mlxn_prefill_plan_extents`]
/// says; `mask`, `lse`, `sinks` and `alibi_slopes` 0 when the plan has none. `workspace`: 0, or scratch of
/// the extents' `workspace` bytes for this run alone (it may then run faster). `stream`: 0
/// runs on the library's stream and waits; a CUDA stream (`cudaStream_t`) enqueues the run
/// on it and returns at once (CUDA devices; elsewhere the run happens now).
///
/// # Safety
/// Every address must point to memory of the plan's device holding its operand's extent,
/// valid until the run is complete; outputs must not be read or written meanwhile.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mlxn_prefill_plan_run(
    plan_handle: u64,
    q: u64,
    k: u64,
    v: u64,
    mask: u64,
    out: u64,
    lse: u64,
    sinks: u64,
    alibi_slopes: u64,
    workspace: u64,
    stream: u64,
) -> i32 {
    guard(|| {
        let pc = plan(plan_handle)?;
        let (p, e, o) = (&pc.plan, *pc.plan.extents(), *pc.plan.operands());
        let qb = p.wrap("q", q, e.q, o.q_dtype)?;
        let kb = p.wrap("k", k, e.k, o.kv_dtype)?;
        let vb = p.wrap("v", v, e.v, o.kv_dtype)?;
        let ob = p.wrap("out", out, e.out, o.out_dtype)?;
        let optional = |name: &str, addr: u64, present: bool, elems: u64, dtype: DType| -> Result<Option<MlxBuffer>> {
            match (addr, present) {
                (0, false) => Ok(None),
                (0, true) => Err(MlxError::InvalidArgument(format!("flash_attn_prefill: this plan needs {name}"))),
                (_, false) => {
                    Err(MlxError::InvalidArgument(format!("flash_attn_prefill: this plan has no {name}: pass 0")))
                }
                (a, true) => p.wrap(name, a, elems, dtype).map(Some),
            }
        };
        let mb = optional("mask", mask, o.mask, e.mask, DType::F16)?;
        let lb = optional("lse", lse, o.lse, e.lse, DType::F32)?;
        let sb = optional("sinks", sinks, o.sinks, e.sinks, DType::F32)?;
        let ab = optional("alibi_slopes", alibi_slopes, o.alibi_slopes, e.alibi_slopes, DType::F32)?;
        let ws = p.workspace_bytes();
        let wb = match workspace {
            0 => None,
            _ if ws == 0 => None, // nothing to split: the scratch goes unused
            a => Some(p.wrap("workspace", a, ws, DType::U8)?),
        };
        let b = PrefillRunBuffers {
            q: &qb,
            k: &kb,
            v: &vb,
            out: &ob,
            mask: mb.as_ref(),
            lse: lb.as_ref(),
            sinks: sb.as_ref(),
            alibi_slopes: ab.as_ref(),
            workspace: wb.as_ref(),
        };
        let mut registry = lock(&pc.ctx.registry);
        p.run(&mut registry, &b, if stream == 0 { None } else { Some(stream) })
    })
}

/// Record a run of a plan on an encoder (FlashInfer's `run`, deferred to the encoder's
/// commit), each operand as a buffer handle of the plan's device holding what
/// [`mlxn_prefill_plan_extents`] says; `mask`, `lse`, `sinks`, `alibi_slopes` and
/// `workspace` 0 as for [`mlxn_prefill_plan_run`]. The mask's classification is recorded
/// first when the plan has one. The plan's own operands go with it: its sequence offsets and,
/// for a paged plan (SPEC 11), its block table and lengths, which the buffer-level
/// [`mlxn_dispatch_flash_attn_prefill`] cannot take. `enc` must be an encoder of the plan's
/// device (the device handle the plan was made on), as the buffers must be. Nothing is
/// recorded if an argument is wrong.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn mlxn_prefill_plan_encode(
    plan_handle: u64,
    enc: u64,
    q: u64,
    k: u64,
    v: u64,
    mask: u64,
    out: u64,
    lse: u64,
    sinks: u64,
    alibi_slopes: u64,
    workspace: u64,
) -> i32 {
    guard(|| {
        let pc = plan(plan_handle)?;
        let e = encoder(enc)?;
        let (pd, ed) = (&pc.ctx.device, &e.ctx.device);
        if pd.registry_id() != ed.registry_id() {
            return Err(MlxError::InvalidArgument(format!(
                "flash_attn_prefill: the encoder is of device {} ({}), the plan of device {} ({}): record on an \
                 encoder of the plan's device",
                ed.registry_id(),
                ed.description(),
                pd.registry_id(),
                pd.description()
            )));
        }
        let (q, k, v, out) = (buffer(q)?, buffer(k)?, buffer(v)?, buffer(out)?);
        let (mask, lse) = (optional_buffer(mask)?, optional_buffer(lse)?);
        let (sinks, alibi_slopes, workspace) =
            (optional_buffer(sinks)?, optional_buffer(alibi_slopes)?, optional_buffer(workspace)?);
        let b = PrefillRunBuffers {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            mask: mask.as_ref(),
            lse: lse.as_ref(),
            sinks: sinks.as_ref(),
            alibi_slopes: alibi_slopes.as_ref(),
            workspace: workspace.as_ref(),
        };
        let mut encoder = lock(&e.encoder);
        let mut registry = lock(&pc.ctx.registry);
        pc.plan.encode(&mut encoder, &mut registry, &b)
    })
}

/// Free a prefill plan.
#[no_mangle]
pub extern "C" fn mlxn_prefill_plan_free(plan_handle: u64) -> i32 {
    guard(|| release(plan_handle, "prefill plan", |o| matches!(o, Object::Plan(_))))
}
