//! The Metal backend's logic against the recording fake: what the ops encode (argument
//! indices, constant blocks, threadgroup memory, grid and threadgroup sizes), compilation and
//! its cache, the tensor-API probe, memory, checks and error mapping.

use std::alloc::Layout;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::backend::{MetalBackend, MetalMemory, Storage};
use super::fake::{FakeMetal, FillOnRun, Recorded};
use crate::backend::cpu::HostMemory;
use crate::backend::{Backend, BackendKind};
use crate::encoder::{GridSize, KernelArg};
use crate::kernel_registry::{KernelRegistry, KernelSource};
use crate::ops::flash_attn_prefill_blk::{dispatch_flash_attn_prefill_blk, FlashAttnPrefillBlkParams, K_BLK_F16};
use crate::ops::flash_attn_prefill_tensor::{
    dispatch_flash_attn_prefill_tensor_f16, flash_attn_prefill_tensor_available, threadgroup_memory_bytes,
    FlashAttnPrefillTensorParams, K_TENSOR_F16_D256, K_TENSOR_F16_D512,
};
use crate::{default_registry, DType, MlxBuffer, MlxDevice, MlxError};

fn fake_device(api: FakeMetal) -> (MlxDevice, Arc<MetalBackend<FakeMetal>>) {
    let backend = Arc::new(MetalBackend::new(api));
    (MlxDevice::from_backend(backend.clone()), backend)
}

fn buffer_id(b: &MlxBuffer) -> usize {
    b.memory().as_any().downcast_ref::<MetalMemory<FakeMetal>>().expect("Metal memory").buffer().id
}

struct Attention {
    q: MlxBuffer,
    k: MlxBuffer,
    v: MlxBuffer,
    mask: MlxBuffer,
    blk: MlxBuffer,
    out: MlxBuffer,
    p: FlashAttnPrefillTensorParams,
}

/// The constant bytes a recorded run set at argument `index` (the first such), if any.
fn bytes_at(rec: &[Recorded], index: u64) -> Option<Vec<u8>> {
    rec.iter().find_map(|r| match r {
        Recorded::SetBytes { index: i, bytes } if *i == index => Some(bytes.clone()),
        _ => None,
    })
}

/// The buffer (the fake's id) a recorded run bound at argument `index` (the first such), if any.
fn buffer_at(rec: &[Recorded], index: u64) -> Option<usize> {
    rec.iter().find_map(|r| match r {
        Recorded::SetBuffer { index: i, buffer, .. } if *i == index => Some(*buffer),
        _ => None,
    })
}

/// The contents of the fake's buffer `id` as `T`s (the plan that owns it alive).
fn contents_of<T: bytemuck::Pod>(be: &MetalBackend<FakeMetal>, id: usize) -> Vec<T> {
    let (ptr, len) = be.api().buffers.lock().unwrap()[&id];
    // SAFETY: the fake's buffer of `len` bytes at `ptr`, alive with the plan; Pod reads any bits.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
    bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
}

fn attention(dev: &MlxDevice, head_dim: u32) -> Attention {
    let (rows, nh, nkv, kv_pad) = (45u32, 4u32, 2u32, 192u32);
    let bq = if head_dim == 256 { 32 } else { 16 };
    let n = |x: u32| x as usize;
    let p = FlashAttnPrefillTensorParams {
        rows,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim,
        kv_pad,
        q_row_stride: nh * head_dim,
        q_head_stride: head_dim,
        k_row_stride: nkv * head_dim,
        k_head_stride: head_dim,
        v_row_stride: nkv * head_dim,
        v_head_stride: head_dim,
        scale: 0.5,
    };
    Attention {
        q: dev.alloc_buffer(DType::F32, &[n(rows * nh * head_dim)]).unwrap(),
        k: dev.alloc_buffer(DType::F16, &[n(kv_pad * nkv * head_dim)]).unwrap(),
        v: dev.alloc_buffer(DType::F16, &[n(kv_pad * nkv * head_dim)]).unwrap(),
        mask: dev.alloc_buffer(DType::F16, &[n(rows * kv_pad)]).unwrap(),
        blk: dev.alloc_buffer(DType::U8, &[n(rows.div_ceil(bq) * kv_pad / 64)]).unwrap(),
        out: dev.alloc_buffer(DType::F32, &[n(rows * nh * head_dim)]).unwrap(),
        p,
    }
}

fn dispatch(dev: &MlxDevice, reg: &mut KernelRegistry, a: &Attention) -> crate::Result<()> {
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill_tensor_f16(&mut enc, reg, dev, &a.q, &a.k, &a.v, &a.mask, &a.blk, &a.out, &a.p)?;
    enc.commit_and_wait()
}

fn words(ints: &[i32], scale: f32) -> Vec<u8> {
    let mut v: Vec<u8> = ints.iter().flat_map(|x| x.to_le_bytes()).collect();
    v.extend_from_slice(&scale.to_le_bytes());
    v
}

#[test]
fn attention_binds_what_the_kernel_declares_at_256_and_512() {
    for (head_dim, name, q_tiles) in [(256u32, K_TENSOR_F16_D256, 2u64), (512, K_TENSOR_F16_D512, 3)] {
        let (dev, be) = fake_device(FakeMetal::new());
        let mut reg = default_registry();
        let a = attention(&dev, head_dim);
        dispatch(&dev, &mut reg, &a).unwrap();
        let hd = head_dim as i32;
        let params = words(&[45, 4, 2, 192, 4 * hd, hd, 2 * hd, hd, 2 * hd, hd, 192], 0.5);
        assert_eq!(params.len(), 48);
        let buf = |index, b: &MlxBuffer| Recorded::SetBuffer { index, buffer: buffer_id(b), offset: 0 };
        assert_eq!(
            be.api().last_run(),
            vec![
                Recorded::SetPipeline(name.into()),
                Recorded::SetBytes { index: 0, bytes: params },
                buf(1, &a.q),
                buf(2, &a.k),
                buf(3, &a.v),
                buf(4, &a.mask),
                buf(5, &a.blk),
                buf(6, &a.out),
                Recorded::SetThreadgroupMemoryLength { index: 0, bytes: threadgroup_memory_bytes(head_dim).unwrap() },
                Recorded::DispatchThreadgroups {
                    grid: GridSize::new(q_tiles, 4, 1),
                    threadgroup: GridSize::new(32, 8, 1)
                },
            ],
            "head dim {head_dim}"
        );
    }
}

#[test]
fn blk_binds_what_the_kernel_declares() {
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = default_registry();
    let mask = dev.alloc_buffer(DType::F16, &[45 * 192]).unwrap();
    let blk = dev.alloc_buffer(DType::U8, &[2 * 3]).unwrap();
    let mut enc = dev.command_encoder();
    let p = FlashAttnPrefillBlkParams { rows: 45, kv_pad: 192, bq: 32, bk: 64 };
    dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &mask, &blk, &p).unwrap();
    enc.commit_and_wait().unwrap();
    let params: Vec<u8> = [45i32, 192, 32, 64].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(
        be.api().last_run(),
        vec![
            Recorded::SetPipeline(K_BLK_F16.into()),
            Recorded::SetBytes { index: 0, bytes: params },
            Recorded::SetBuffer { index: 1, buffer: buffer_id(&mask), offset: 0 },
            Recorded::SetBuffer { index: 2, buffer: buffer_id(&blk), offset: 0 },
            Recorded::DispatchThreadgroups { grid: GridSize::new(3, 2, 1), threadgroup: GridSize::new(32, 1, 1) },
        ]
    );
}

#[test]
fn a_view_is_bound_at_its_byte_offset() {
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = default_registry();
    let mut a = attention(&dev, 256);
    let big = dev.alloc_buffer(DType::F32, &[a.q.element_count() + 64]).unwrap();
    a.q = big.view(256, a.q.data_byte_len(), DType::F32, vec![]).unwrap();
    dispatch(&dev, &mut reg, &a).unwrap();
    assert!(be.api().last_run().contains(&Recorded::SetBuffer { index: 1, buffer: buffer_id(&big), offset: 256 }));
}

#[test]
fn one_compilation_per_source_and_one_pipeline_per_kernel_and_device() {
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = default_registry();
    let (a256, a512) = (attention(&dev, 256), attention(&dev, 512));
    dispatch(&dev, &mut reg, &a256).unwrap();
    dispatch(&dev, &mut reg, &a512).unwrap();
    dispatch(&dev, &mut reg, &a256).unwrap();
    // Both entry points come from one .metal file: one library, two pipelines.
    assert_eq!(be.api().compiles.load(Ordering::Relaxed), 1);
    assert_eq!(be.api().pipelines.load(Ordering::Relaxed), 2);
    assert_eq!(be.api().runs.lock().unwrap().len(), 3);
    // Another device compiles for itself.
    let (dev2, be2) = fake_device(FakeMetal::new());
    let b = attention(&dev2, 256);
    dispatch(&dev2, &mut reg, &b).unwrap();
    assert_eq!(be2.api().compiles.load(Ordering::Relaxed), 1);
    assert_eq!(be.api().compiles.load(Ordering::Relaxed), 1);
}

#[test]
fn the_probe_reads_a_missing_tensor_header_as_unavailable() {
    let missing = "program_source:21:10: fatal error: 'metal_tensor' file not found";
    let api = FakeMetal::new();
    *api.compile_error.lock().unwrap() = Some(("<metal_tensor>".into(), missing.into()));
    let (dev, _) = fake_device(api);
    let mut reg = default_registry();
    assert!(!flash_attn_prefill_tensor_available(&mut reg, &dev, 256).unwrap());
    assert!(!flash_attn_prefill_tensor_available(&mut reg, &dev, 512).unwrap());
    // The tile-skip kernel does not need the tensor API and still builds.
    assert!(reg.get_pipeline(K_BLK_F16, &dev).is_ok());
    // Dispatching anyway is the compile error, by name.
    let a = attention(&dev, 256);
    match dispatch(&dev, &mut reg, &a) {
        Err(MlxError::ShaderCompilationError { name, message }) => {
            assert_eq!(name, K_TENSOR_F16_D256);
            assert_eq!(message, missing);
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn the_probe_reports_other_compile_errors_as_errors_and_success_as_available() {
    let api = FakeMetal::new();
    *api.compile_error.lock().unwrap() =
        Some(("<metal_tensor>".into(), "program_source:90:5: error: use of undeclared identifier 'qh'".into()));
    let (dev, _) = fake_device(api);
    let mut reg = default_registry();
    match flash_attn_prefill_tensor_available(&mut reg, &dev, 256) {
        Err(MlxError::ShaderCompilationError { name, message }) => {
            assert_eq!(name, K_TENSOR_F16_D256);
            assert!(message.contains("undeclared identifier"));
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
    let (dev, _) = fake_device(FakeMetal::new());
    assert!(flash_attn_prefill_tensor_available(&mut reg, &dev, 256).unwrap());
    assert!(flash_attn_prefill_tensor_available(&mut reg, &dev, 512).unwrap());
}

/// The origin op's limit on a pipeline's threads: 8 simdgroups of 32. One thread short is
/// refused before anything runs; exactly 256 runs.
#[test]
fn a_pipeline_too_narrow_for_eight_simdgroups_is_refused_before_anything_runs() {
    for (max_threads, refused) in [(128u64, true), (255, true), (256, false)] {
        let mut api = FakeMetal::new();
        api.max_threads = max_threads;
        let (dev, be) = fake_device(api);
        let mut reg = default_registry();
        let a = attention(&dev, 256);
        match dispatch(&dev, &mut reg, &a) {
            Err(MlxError::InvalidArgument(m)) if refused => {
                assert!(m.contains(&format!("allows {max_threads} threads per threadgroup, needs 256")), "{m}")
            }
            Ok(()) if !refused => {}
            other => panic!(
                "{max_threads} threads: expected {}, got {other:?}",
                if refused { "InvalidArgument" } else { "a run" }
            ),
        }
        assert_eq!(be.api().runs.lock().unwrap().is_empty(), refused, "{max_threads} threads");
    }
}

/// Encode the blk kernel with the given sizes and arguments by hand and commit.
fn raw_blk(
    dev: &MlxDevice,
    args: &[(u64, KernelArg<'_>)],
    shared: &[(u64, u64)],
    threadgroup: GridSize,
) -> crate::Result<()> {
    let mut reg = default_registry();
    let pipeline = reg.get_pipeline(K_BLK_F16, dev)?.clone();
    let mut enc = dev.command_encoder();
    enc.encode_threadgroups_with_args_and_shared(&pipeline, args, shared, GridSize::new(1, 1, 1), threadgroup)?;
    enc.commit_and_wait()
}

#[test]
fn dispatches_metal_cannot_run_are_refused_before_anything_runs() {
    let (dev, be) = fake_device(FakeMetal::new());
    let out = dev.alloc_buffer(DType::U8, &[64]).unwrap();
    let small = [1u8; 16];
    let big = vec![0u8; 4097];
    let ok_args = [(0, KernelArg::Bytes(&small)), (2, KernelArg::Buffer(&out))];
    type Case<'a> = (&'a str, Vec<(u64, KernelArg<'a>)>, Vec<(u64, u64)>, GridSize, &'a str);
    let cases: Vec<Case<'_>> = vec![
        ("too many threads", ok_args.to_vec(), vec![], GridSize::new(1025, 1, 1), "the pipeline allows 1 to 1024"),
        ("no threads", ok_args.to_vec(), vec![], GridSize::new(0, 1, 1), "the pipeline allows"),
        (
            "threadgroup memory",
            ok_args.to_vec(),
            vec![(0, 32768), (1, 16)],
            GridSize::new(32, 1, 1),
            "exceed the device's 32768",
        ),
        ("odd threadgroup memory", ok_args.to_vec(), vec![(0, 20)], GridSize::new(32, 1, 1), "multiple of 16"),
        ("bytes too big", vec![(0, KernelArg::Bytes(&big))], vec![], GridSize::new(32, 1, 1), "4096"),
        ("index 31", vec![(31, KernelArg::Buffer(&out))], vec![], GridSize::new(32, 1, 1), "index 31"),
    ];
    for (what, args, shared, tg, needle) in cases {
        match raw_blk(&dev, &args, &shared, tg) {
            Err(MlxError::InvalidArgument(m)) => assert!(m.contains(needle), "{what}: {m}"),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(be.api().runs.lock().unwrap().is_empty());
    raw_blk(&dev, &ok_args, &[(0, 32768)], GridSize::new(1024, 1, 1)).unwrap();
    assert_eq!(be.api().runs.lock().unwrap().len(), 1);
}

#[test]
fn memory_of_another_backend_is_refused() {
    let (dev, be) = fake_device(FakeMetal::new());
    // A buffer of this device's id over CPU memory (the public API cannot make one).
    let cpu = MlxBuffer::new(Arc::new(HostMemory::zeroed(64).unwrap()), dev.registry_id(), DType::U8, vec![]).unwrap();
    match raw_blk(&dev, &[(2, KernelArg::Buffer(&cpu))], &[], GridSize::new(32, 1, 1)) {
        Err(MlxError::InvalidArgument(m)) => assert!(m.contains("index 2 is not memory of the Metal backend"), "{m}"),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(be.api().runs.lock().unwrap().is_empty());
}

#[test]
fn a_failed_command_buffer_is_a_command_error_with_metal_s_message() {
    let api = FakeMetal::new();
    *api.fail_run.lock().unwrap() =
        Some("Caused GPU Timeout Error (00000002:kIOGPUCommandBufferCallbackErrorTimeout)".into());
    let (dev, _) = fake_device(api);
    let mut reg = default_registry();
    let a = attention(&dev, 512);
    match dispatch(&dev, &mut reg, &a) {
        Err(MlxError::CommandBufferError(m)) => {
            assert!(m.starts_with(K_TENSOR_F16_D512), "{m}");
            assert!(m.contains("kIOGPUCommandBufferCallbackErrorTimeout"), "{m}");
        }
        other => panic!("expected CommandBufferError, got {other:?}"),
    }
}

#[test]
fn allocations_are_zeroed_shared_buffers_and_failures_are_allocation_errors() {
    let (dev, be) = fake_device(FakeMetal::new());
    assert_eq!(be.kind(), BackendKind::Metal);
    assert_eq!(be.description(), "metal (Fake GPU)");
    let b = dev.alloc_buffer(DType::F32, &[1000]).unwrap();
    let mut bytes = vec![1u8; 4000];
    b.read_bytes(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&x| x == 0), "the fake fills new buffers with 0xA5");
    let mem = b.memory().as_any().downcast_ref::<MetalMemory<FakeMetal>>().unwrap();
    assert_eq!(mem.storage(), Storage::Owned);
    assert_eq!(dev.alloc_buffer(DType::F32, &[0]).unwrap().data_byte_len(), 0);
    *be.api().fail_alloc.lock().unwrap() = true;
    assert_eq!(dev.alloc_buffer(DType::U8, &[77]).unwrap_err(), MlxError::BufferAllocationError { bytes: 77 });
}

/// Page-aligned host memory (16 KiB pages, the fake's).
struct Pages {
    ptr: *mut u8,
    layout: Layout,
}
impl Pages {
    fn new(bytes: usize) -> Self {
        let layout = Layout::from_size_align(bytes, 16384).unwrap();
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        Pages { ptr, layout }
    }
}
impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

#[test]
fn page_aligned_host_memory_is_used_in_place() {
    let (dev, be) = fake_device(FakeMetal::new());
    let pages = Pages::new(32768);
    // SAFETY: `pages` outlives the buffer.
    let blk = unsafe { dev.wrap_host(pages.ptr, 20000, DType::U8, &[20000]) }.unwrap();
    let mem = blk.memory().as_any().downcast_ref::<MetalMemory<FakeMetal>>().unwrap();
    assert_eq!(mem.storage(), Storage::NoCopy);
    assert!(mem.buffer().no_copy);
    assert_eq!(blk.host_ptr(), Some(pages.ptr));
    let (contents, len) = be.api().buffers.lock().unwrap()[&mem.buffer().id];
    assert_eq!((contents, len), (pages.ptr as usize, 32768), "whole pages, no copy");
    // What the kernel writes is in the host memory, with no copy back.
    *be.api().fill_on_run.lock().unwrap() = Some(FillOnRun { index: 2, byte: 7 });
    let mask = dev.alloc_buffer(DType::F16, &[64 * 64]).unwrap();
    let mut reg = default_registry();
    let mut enc = dev.command_encoder();
    let p = FlashAttnPrefillBlkParams { rows: 64, kv_pad: 64, bq: 32, bk: 64 };
    dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &mask, &blk, &p).unwrap();
    enc.commit_and_wait().unwrap();
    // SAFETY: 20000 bytes of `pages`.
    assert!(unsafe { std::slice::from_raw_parts(pages.ptr, 20000) }.iter().all(|&x| x == 7));
}

#[test]
fn unaligned_host_memory_is_staged_around_each_command_buffer() {
    let (dev, be) = fake_device(FakeMetal::new());
    let pages = Pages::new(65536);
    // SAFETY: 16 bytes into `pages`: unaligned, in bounds; `pages` outlives the buffers.
    let (mask_ptr, blk_ptr) = unsafe { (pages.ptr.add(16), pages.ptr.add(40000)) };
    let mask = unsafe { dev.wrap_host(mask_ptr, 64 * 64 * 2, DType::F16, &[64 * 64]) }.unwrap();
    let blk = unsafe { dev.wrap_host(blk_ptr, 2, DType::U8, &[2]) }.unwrap();
    for b in [&mask, &blk] {
        let mem = b.memory().as_any().downcast_ref::<MetalMemory<FakeMetal>>().unwrap();
        assert_eq!(mem.storage(), Storage::Staged);
    }
    mask.write_bytes(0, &[3u8; 64 * 64 * 2]).unwrap();
    *be.api().fill_on_run.lock().unwrap() = Some(FillOnRun { index: 2, byte: 9 });
    let mut reg = default_registry();
    let mut enc = dev.command_encoder();
    let p = FlashAttnPrefillBlkParams { rows: 64, kv_pad: 64, bq: 32, bk: 64 };
    dispatch_flash_attn_prefill_blk(&mut enc, &mut reg, &dev, &mask, &blk, &p).unwrap();
    enc.commit_and_wait().unwrap();
    // The kernel saw the host's mask, and its output came back to the host.
    let mask_mem = mask.memory().as_any().downcast_ref::<MetalMemory<FakeMetal>>().unwrap();
    let (contents, _) = be.api().buffers.lock().unwrap()[&mask_mem.buffer().id];
    // SAFETY: the fake's buffer holds the mask's bytes.
    assert!(unsafe { std::slice::from_raw_parts(contents as *const u8, 64 * 64 * 2) }.iter().all(|&x| x == 3));
    // SAFETY: two bytes at blk_ptr.
    assert_eq!(unsafe { std::slice::from_raw_parts(blk_ptr, 2) }, &[9, 9]);
}

#[test]
fn a_kernel_without_a_metal_form_or_function_is_not_found() {
    let (dev, _) = fake_device(FakeMetal::new());
    let mut reg = KernelRegistry::new();
    reg.register_source("cpu_only", KernelSource { metal: None, cuda: None });
    assert!(matches!(reg.get_pipeline("cpu_only", &dev), Err(MlxError::KernelNotFound(_))));
    reg.register_source("no_such_kernel", crate::ops::flash_attn_prefill_blk::FLASH_ATTN_PREFILL_BLK_SHADER_SOURCE);
    match reg.get_pipeline("no_such_kernel", &dev) {
        Err(MlxError::KernelNotFound(m)) => assert!(m.contains("no function"), "{m}"),
        other => panic!("expected KernelNotFound, got {other:?}"),
    }
}

#[test]
fn the_ops_name_the_metal_entry_points_of_their_sources() {
    let (dev, _) = fake_device(FakeMetal::new());
    let mut reg = default_registry();
    for name in [K_TENSOR_F16_D256, K_TENSOR_F16_D512, K_BLK_F16] {
        reg.get_pipeline(name, &dev).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[cfg(not(target_os = "macos"))]
#[test]
fn off_macos_metal_is_unavailable_and_auto_is_the_cpu() {
    assert!(matches!(crate::backend::open("metal"), Err(MlxError::BackendUnavailable(_))));
    assert!(!crate::backend::available_backends().contains(&"metal"));
    assert_eq!(crate::backend::open("auto").unwrap().kind(), BackendKind::Cpu);
}

// -- flash_attn_prefill (SPEC 6-9) ------------------------------------------------------------

use crate::ops::flash_attn_prefill::{
    dispatch_flash_attn_prefill, dispatch_flash_attn_prefill_mask_blk, mask_blk_params, validate,
    FlashAttnPrefillBuffers, FlashAttnPrefillParams, PrefillOperands, HEAD_DIMS, K_PREFILL_D256, K_PREFILL_D512,
    K_PREFILL_MASK_BLK, PAGED_KERNELS, QUANT_KV_KERNELS,
};
use crate::ops::flash_attn_prefill_paged::PagedKv;
use crate::ops::flash_attn_prefill_plan::{FlashAttnPrefillPlan, PrefillRunBuffers};
use crate::options::RunOptions;
use crate::params::{FlashAttnPrefillParamsGpu, PagedKvParamsGpu, PREFILL_PAGED};

fn prefill_registry() -> KernelRegistry {
    let mut reg = default_registry();
    crate::ops::flash_attn_prefill::register(&mut reg);
    reg
}

/// A fixed-length batch of 3 sequences of 45 rows over caches of 130 rows, contiguous.
fn prefill_params(head_dim: u32) -> FlashAttnPrefillParams {
    let (rows, kv, nh, nkv, hd) = (45u64, 130u64, 4u64, 2u64, head_dim as u64);
    FlashAttnPrefillParams {
        q_strides: [rows * nh * hd, nh * hd, hd],
        k_strides: [kv * nkv * hd, nkv * hd, hd],
        v_strides: [kv * nkv * hd, nkv * hd, hd],
        out_strides: [rows * nh * hd, nh * hd, hd],
        mask_strides: [0, kv],
        lse_strides: [nh * rows, rows],
        batch: 3,
        rows: 45,
        kv_len: 130,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim,
        causal: 1,
        window: 0,
        scale: 0.5,
        offset: 0,
        has_offset: 0,
        ..Default::default()
    }
}

#[test]
fn prefill_binds_what_the_kernel_declares_at_256_and_512() {
    for (head_dim, name, q_tiles) in [(256u32, K_PREFILL_D256, 2u64), (512, K_PREFILL_D512, 3)] {
        let (dev, be) = fake_device(FakeMetal::new());
        let mut reg = prefill_registry();
        let p = prefill_params(head_dim);
        let n = |x: u64| x as usize;
        let (hd, b) = (head_dim as u64, 3u64);
        let q = dev.alloc_buffer(DType::BF16, &[n(b * 45 * 4 * hd)]).unwrap();
        let k = dev.alloc_buffer(DType::F16, &[n(b * 130 * 2 * hd)]).unwrap();
        let v = dev.alloc_buffer(DType::F16, &[n(b * 130 * 2 * hd)]).unwrap();
        let out = dev.alloc_buffer(DType::F16, &[n(b * 45 * 4 * hd)]).unwrap();
        let mask = dev.alloc_buffer(DType::F16, &[45 * 130]).unwrap();
        // One table for every sequence (mask batch stride 0): q_tiles x ceil(130 / 64) bytes.
        let blk = dev.alloc_buffer(DType::U8, &[n(q_tiles * 3)]).unwrap();
        let lse = dev.alloc_buffer(DType::F32, &[n(b * 4 * 45)]).unwrap();
        let bufs = FlashAttnPrefillBuffers {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            mask: Some(&mask),
            blk: Some(&blk),
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            lse: Some(&lse),
            sinks: None,
            alibi_slopes: None,
            workspace: None,
        };
        let gpu = validate(&bufs, &p).unwrap().gpu;
        let mut enc = dev.command_encoder();
        dispatch_flash_attn_prefill(&mut enc, &mut reg, &dev, &bufs, &p).unwrap();
        enc.commit_and_wait().unwrap();
        let buf = |index, b: &MlxBuffer| Recorded::SetBuffer { index, buffer: buffer_id(b), offset: 0 };
        assert_eq!(
            be.api().last_run(),
            vec![
                Recorded::SetPipeline(name.into()),
                Recorded::SetBytes { index: 0, bytes: crate::as_bytes(&gpu).to_vec() },
                buf(1, &q),
                buf(2, &k),
                buf(3, &v),
                buf(4, &mask),
                buf(5, &blk),
                buf(6, &out),
                buf(7, &lse),
                buf(8, &q),
                buf(9, &q),
                buf(10, &q),
                buf(12, &q),
                Recorded::SetThreadgroupMemoryLength { index: 0, bytes: threadgroup_memory_bytes(head_dim).unwrap() },
                Recorded::DispatchThreadgroups {
                    grid: GridSize::new(q_tiles, 4, 3),
                    threadgroup: GridSize::new(32, 8, 1)
                },
            ],
            "head dim {head_dim}"
        );
        // The block as the kernel's struct reads it (shaders/flash_attn_prefill_tensor.metal).
        assert_eq!(std::mem::size_of_val(&gpu), 224);
        assert_eq!((gpu.flags, gpu.q_dtype, gpu.o_dtype), (1 | 2 | 8, 2, 1));
    }
}

/// The prefill's limit on a pipeline's threads: 8 simdgroups of 32. One thread short is
/// refused before anything runs (nothing recorded); exactly 256 runs.
#[test]
fn a_prefill_pipeline_too_narrow_for_eight_simdgroups_is_refused_before_anything_runs() {
    for (max_threads, refused) in [(128u64, true), (255, true), (256, false)] {
        let mut api = FakeMetal::new();
        api.max_threads = max_threads;
        let (dev, be) = fake_device(api);
        let mut reg = prefill_registry();
        let p = FlashAttnPrefillParams { mask_strides: [0, 0], lse_strides: [0, 0], ..prefill_params(256) };
        let n = |x: u64| x as usize;
        let q = dev.alloc_buffer(DType::F32, &[n(3 * 45 * 4 * 256)]).unwrap();
        let k = dev.alloc_buffer(DType::F16, &[n(3 * 130 * 2 * 256)]).unwrap();
        let v = dev.alloc_buffer(DType::F16, &[n(3 * 130 * 2 * 256)]).unwrap();
        let out = dev.alloc_buffer(DType::F32, &[n(3 * 45 * 4 * 256)]).unwrap();
        let bufs = FlashAttnPrefillBuffers {
            q: &q,
            k: &k,
            v: &v,
            out: &out,
            mask: None,
            blk: None,
            cu_seqlens_q: None,
            cu_seqlens_k: None,
            lse: None,
            sinks: None,
            alibi_slopes: None,
            workspace: None,
        };
        let mut enc = dev.command_encoder();
        let r = dispatch_flash_attn_prefill(&mut enc, &mut reg, &dev, &bufs, &p);
        if refused {
            match r {
                Err(MlxError::InvalidArgument(m)) => {
                    assert!(m.contains(&format!("allows {max_threads} threads per threadgroup, needs 256")), "{m}")
                }
                other => panic!("{max_threads} threads: expected InvalidArgument, got {other:?}"),
            }
            assert!(enc.pending().is_empty(), "{max_threads} threads: something was encoded");
        } else {
            r.unwrap();
            enc.commit_and_wait().unwrap();
        }
        assert_eq!(be.api().runs.lock().unwrap().is_empty(), refused, "{max_threads} threads");
    }
}

#[test]
fn prefill_of_variable_length_binds_the_cu_seqlens_and_covers_the_longest_sequence() {
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = prefill_registry();
    let (total_q, total_k, hd) = (50usize, 90usize, 512usize);
    let q = dev.alloc_buffer(DType::F32, &[total_q * 2 * hd]).unwrap();
    let k = dev.alloc_buffer(DType::F16, &[total_k * hd]).unwrap();
    let v = dev.alloc_buffer(DType::F16, &[total_k * hd]).unwrap();
    let out = dev.alloc_buffer(DType::F32, &[total_q * 2 * hd]).unwrap();
    let cu_q = dev.alloc_buffer(DType::I32, &[4]).unwrap();
    let cu_k = dev.alloc_buffer(DType::I32, &[4]).unwrap();
    let words = |x: [i32; 4]| x.iter().flat_map(|w| w.to_ne_bytes()).collect::<Vec<u8>>();
    cu_q.write_bytes(0, &words([0, 17, 17, 50])).unwrap();
    cu_k.write_bytes(0, &words([0, 40, 41, 90])).unwrap();
    let p = FlashAttnPrefillParams {
        q_strides: [0, 2 * hd as u64, hd as u64],
        k_strides: [0, hd as u64, hd as u64],
        v_strides: [0, hd as u64, hd as u64],
        out_strides: [0, 2 * hd as u64, hd as u64],
        mask_strides: [0, 0],
        lse_strides: [0, 0],
        batch: 3,
        rows: total_q as u32,
        kv_len: total_k as u32,
        n_heads: 2,
        n_kv_heads: 1,
        head_dim: hd as u32,
        causal: 1,
        window: 8,
        scale: 1.0,
        offset: 0,
        has_offset: 0,
        ..Default::default()
    };
    let bufs = FlashAttnPrefillBuffers {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        mask: None,
        blk: None,
        cu_seqlens_q: Some(&cu_q),
        cu_seqlens_k: Some(&cu_k),
        lse: None,
        sinks: None,
        alibi_slopes: None,
        workspace: None,
    };
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill(&mut enc, &mut reg, &dev, &bufs, &p).unwrap();
    enc.commit_and_wait().unwrap();
    let run = be.api().last_run();
    let buf = |index, b: &MlxBuffer| Recorded::SetBuffer { index, buffer: buffer_id(b), offset: 0 };
    for (index, b) in [(4, &q), (5, &q), (7, &q), (8, &cu_q), (9, &cu_k), (10, &q)] {
        assert!(run.contains(&buf(index, b)), "index {index}");
    }
    // The longest sequence has 33 rows: 3 tiles of 16 at head dim 512.
    assert_eq!(
        run.last(),
        Some(&Recorded::DispatchThreadgroups { grid: GridSize::new(3, 2, 3), threadgroup: GridSize::new(32, 8, 1) })
    );
}

#[test]
fn prefill_mask_blk_covers_every_table() {
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = prefill_registry();
    let mut p = prefill_params(256);
    p.mask_strides = [45 * 130, 130];
    let mask = dev.alloc_buffer(DType::F16, &[3 * 45 * 130]).unwrap();
    let blk = dev.alloc_buffer(DType::U8, &[3 * 2 * 3]).unwrap();
    let mut enc = dev.command_encoder();
    dispatch_flash_attn_prefill_mask_blk(&mut enc, &mut reg, &dev, &mask, &blk, &p).unwrap();
    enc.commit_and_wait().unwrap();
    let g = mask_blk_params(&p).unwrap();
    assert_eq!(std::mem::size_of_val(&g), 40);
    assert_eq!(
        be.api().last_run(),
        vec![
            Recorded::SetPipeline(K_PREFILL_MASK_BLK.into()),
            Recorded::SetBytes { index: 0, bytes: crate::as_bytes(&g).to_vec() },
            Recorded::SetBuffer { index: 1, buffer: buffer_id(&mask), offset: 0 },
            Recorded::SetBuffer { index: 2, buffer: buffer_id(&blk), offset: 0 },
            Recorded::DispatchThreadgroups { grid: GridSize::new(3, 2, 3), threadgroup: GridSize::new(32, 1, 1) },
        ]
    );
}

#[test]
fn the_prefill_op_names_metal_entry_points_of_its_sources() {
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = prefill_registry();
    // Every head dim's kernels, F16 and BF16 K/V (entry points of the source's
    // instantiation macro), and the classifier.
    let prefill: Vec<&str> =
        HEAD_DIMS.iter().flat_map(|(_, f16, bf16)| [*f16, *bf16]).chain([K_PREFILL_MASK_BLK]).collect();
    for name in &prefill {
        assert_eq!(super::function_of(name), *name);
        reg.get_pipeline(name, &dev).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    // The origin's kernels are entry points of the same two files.
    for name in [K_TENSOR_F16_D256, K_TENSOR_F16_D512, K_BLK_F16] {
        reg.get_pipeline(name, &dev).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    // The quantised K/V entry points, one per head dim pair.
    for (_, name) in QUANT_KV_KERNELS {
        assert_eq!(super::function_of(name), name);
        reg.get_pipeline(name, &dev).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    // The paged entry points, one for each kernel of both dtypes and each quantised one.
    let plain: Vec<&str> = HEAD_DIMS
        .iter()
        .flat_map(|(_, f16, bf16)| [*f16, *bf16])
        .chain(QUANT_KV_KERNELS.iter().map(|(_, n)| *n))
        .collect();
    assert_eq!(PAGED_KERNELS.iter().map(|(k, _)| *k).collect::<Vec<_>>(), plain);
    for (_, name) in PAGED_KERNELS {
        assert_eq!(super::function_of(name), name);
        reg.get_pipeline(name, &dev).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    assert_eq!(
        be.api().pipelines.load(Ordering::Relaxed),
        prefill.len() + 3 + QUANT_KV_KERNELS.len() + PAGED_KERNELS.len()
    );
}

#[test]
fn a_paged_plan_runs_the_paged_entry_point_with_its_table_and_lengths() {
    // Two sequences of 20 query rows over caches of 40 and 33 rows in blocks of 16 (SPEC 11):
    // the plan's run binds what the contiguous prefill binds, with K/V strides 0 in its block,
    // the paged block at 13, the table at 14 and the lengths at 15, and runs the paged entry
    // point of its head dim (the contiguous kernel's name would read K/V in place).
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = prefill_registry();
    let (blocks, bs, nkv, hd) = (8u64, 16u64, 2u64, 128u64);
    let p = FlashAttnPrefillParams {
        q_strides: [20 * 4 * hd, 4 * hd, hd],
        k_strides: [bs * nkv * hd, nkv * hd, hd],
        v_strides: [bs * nkv * hd, nkv * hd, hd],
        out_strides: [20 * 4 * hd, 4 * hd, hd],
        mask_strides: [0, 0],
        lse_strides: [0, 0],
        batch: 2,
        rows: 20,
        n_heads: 4,
        n_kv_heads: 2,
        head_dim: hd as u32,
        causal: 1,
        scale: 0.5,
        ..Default::default()
    };
    let operands = PrefillOperands {
        q_dtype: DType::F32,
        kv_dtype: DType::BF16,
        out_dtype: DType::F32,
        mask: false,
        lse: false,
        sinks: false,
        alibi_slopes: false,
    };
    let (table, used) = ([5, 2, 7, -1, 3, 6, 0, -9], [40, 33]);
    let paged =
        PagedKv { block_table: &table, max_blocks: 4, seqused_k: &used, num_blocks: blocks as u32, block_size: 16 };
    let plan = FlashAttnPrefillPlan::new_paged(&dev, &p, &operands, None, &paged, RunOptions::default()).unwrap();
    let q = dev.alloc_buffer(DType::F32, &[2 * 20 * 4 * hd as usize]).unwrap();
    let k = dev.alloc_buffer(DType::BF16, &[(blocks * bs * nkv * hd) as usize]).unwrap();
    let v = dev.alloc_buffer(DType::BF16, &[(blocks * bs * nkv * hd) as usize]).unwrap();
    let out = dev.alloc_buffer(DType::F32, &[2 * 20 * 4 * hd as usize]).unwrap();
    let run = PrefillRunBuffers {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        mask: None,
        lse: None,
        sinks: None,
        alibi_slopes: None,
        workspace: None,
    };
    plan.run(&mut reg, &run, None).unwrap();
    let rec = be.api().last_run();
    assert_eq!(rec[0], Recorded::SetPipeline("flash_attn_prefill_paged_d128_bf16".into()));
    let block: FlashAttnPrefillParamsGpu = bytemuck::pod_read_unaligned(&bytes_at(&rec, 0).unwrap());
    assert_eq!((block.k_row_stride, block.k_head_stride, block.v_batch_stride), (0, 0, 0));
    assert_eq!((block.kv_len, block.flags & PREFILL_PAGED), (40, PREFILL_PAGED));
    let pg: PagedKvParamsGpu = bytemuck::pod_read_unaligned(&bytes_at(&rec, 13).unwrap());
    assert_eq!(
        (pg.k_block_stride, pg.k_row_stride, pg.k_head_stride),
        ((bs * nkv * hd) as i64, (nkv * hd) as i64, hd as i64)
    );
    assert_eq!((pg.num_blocks, pg.block_size, pg.max_blocks, pg.batch), (8, 16, 4, 2));
    assert_eq!((buffer_at(&rec, 2), buffer_at(&rec, 3)), (Some(buffer_id(&k)), Some(buffer_id(&v))));
    assert_eq!(contents_of::<i32>(&be, buffer_at(&rec, 14).unwrap())[..8], table);
    assert_eq!(contents_of::<i32>(&be, buffer_at(&rec, 15).unwrap())[..2], used);
    assert_eq!(
        rec.last(),
        Some(&Recorded::DispatchThreadgroups { grid: GridSize::new(1, 4, 2), threadgroup: GridSize::new(32, 8, 1) })
    );
}

#[test]
fn the_fake_library_lists_declared_and_macro_instantiated_entry_points() {
    let source = "// kernel void in_a_comment(\n\
                  kernel void plain(device float * x [[buffer(0)]]) {}\n\
                  #define MAKE(NAME, T) \\\n    kernel void pre_##NAME(device T * x [[buffer(0)]]) {}\n\
                  MAKE(a, half)\n\
                  MAKE(b_bf16, bfloat)\n";
    assert_eq!(super::fake::entry_points(source), ["plain", "pre_a", "pre_b_bf16"]);
}

#[test]
fn a_quantised_plan_runs_the_kvq_entry_points_with_its_descale_factors() {
    // FP8 E5M2 K/V at (576, 512) with factors per KV head, contiguous then paged (SPEC 11): the
    // plan's run names the `_kvq` entry point (paged: its `_paged_` one), binds the factors
    // (K's, then V's) at 16, gives the kernel the quantised walk's threadgroup memory (longer
    // than the 16-bit kernel's at 576) and its format in the block's kv_dtype; without factors
    // Q is bound at 16, unread.
    use crate::ops::flash_attn_prefill::{quant_threadgroup_memory_bytes, threadgroup_memory_bytes};
    use crate::params::PREFILL_DESCALE;
    let (dev, be) = fake_device(FakeMetal::new());
    let mut reg = prefill_registry();
    let (rows, kv, nh, nkv, hd, hdv) = (20u64, 48u64, 4u64, 2u64, 576u64, 512u64);
    let p = FlashAttnPrefillParams {
        q_strides: [rows * nh * hd, nh * hd, hd],
        k_strides: [kv * nkv * hd, nkv * hd, hd],
        v_strides: [kv * nkv * hd, nkv * hd, hd],
        out_strides: [rows * nh * hdv, nh * hdv, hdv],
        batch: 1,
        rows: rows as u32,
        kv_len: kv as u32,
        n_heads: nh as u32,
        n_kv_heads: nkv as u32,
        head_dim: hd as u32,
        head_dim_v: hdv as u32,
        causal: 1,
        scale: 0.5,
        ..Default::default()
    };
    let operands = PrefillOperands {
        q_dtype: DType::F32,
        kv_dtype: DType::F8E5M2,
        out_dtype: DType::F32,
        mask: false,
        lse: false,
        sinks: false,
        alibi_slopes: false,
    };
    let q = dev.alloc_buffer(DType::F32, &[(rows * nh * hd) as usize]).unwrap();
    let k = dev.alloc_buffer(DType::F8E5M2, &[(kv * nkv * hd) as usize]).unwrap();
    let v = dev.alloc_buffer(DType::F8E5M2, &[(kv * nkv * hd) as usize]).unwrap();
    let out = dev.alloc_buffer(DType::F32, &[(rows * nh * hdv) as usize]).unwrap();
    let run = PrefillRunBuffers {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        mask: None,
        lse: None,
        sinks: None,
        alibi_slopes: None,
        workspace: None,
    };
    let recorded = |be: &MetalBackend<FakeMetal>| be.api().last_run();
    let block_of =
        |rec: &[Recorded]| -> FlashAttnPrefillParamsGpu { bytemuck::pod_read_unaligned(&bytes_at(rec, 0).unwrap()) };
    let smem = quant_threadgroup_memory_bytes(hd as u32).unwrap();
    assert!(smem > threadgroup_memory_bytes(hd as u32).unwrap() && smem <= 32 * 1024);

    let plan = FlashAttnPrefillPlan::new(&dev, &p, &operands, None)
        .unwrap()
        .with_descale(Some(&[0.5, 2.0]), Some(&[3.0]))
        .unwrap();
    plan.run(&mut reg, &run, None).unwrap();
    let rec = recorded(&be);
    assert_eq!(rec[0], Recorded::SetPipeline("flash_attn_prefill_d576_512_kvq".into()));
    let block = block_of(&rec);
    assert_eq!((block.kv_dtype, block.flags & PREFILL_DESCALE), (DType::F8E5M2 as i32, PREFILL_DESCALE));
    let factors = buffer_at(&rec, 16).expect("descale factors at 16");
    assert_eq!(contents_of::<f32>(&be, factors)[..4], [0.5, 2.0, 3.0, 3.0]);
    assert!(rec.contains(&Recorded::SetThreadgroupMemoryLength { index: 0, bytes: smem }));

    // Paged, without factors: the paged quantised entry point, Q at 16.
    let (table, used) = ([2, 0, 1], [kv as i32]);
    let paged = PagedKv { block_table: &table, max_blocks: 3, seqused_k: &used, num_blocks: 3, block_size: 16 };
    let mut pp = p;
    pp.k_strides = [16 * nkv * hd, nkv * hd, hd];
    pp.v_strides = pp.k_strides;
    let plan = FlashAttnPrefillPlan::new_paged(&dev, &pp, &operands, None, &paged, RunOptions::default()).unwrap();
    plan.run(&mut reg, &run, None).unwrap();
    let rec = recorded(&be);
    assert_eq!(rec[0], Recorded::SetPipeline("flash_attn_prefill_paged_d576_512_kvq".into()));
    assert_eq!(block_of(&rec).flags & (PREFILL_DESCALE | PREFILL_PAGED), PREFILL_PAGED);
    assert_eq!(buffer_at(&rec, 16), Some(buffer_id(&q)));
    assert!(rec.contains(&Recorded::SetThreadgroupMemoryLength { index: 0, bytes: smem }));
}
