//! The CUDA backend where no GPU is needed: the kernel sources compile with NVRTC for the
//! architectures the backend targets, and a machine without a usable GPU gets clean
//! errors. (The kernels' results are checked on a GPU by the Python suite, which runs on
//! every backend `backends()` lists.)

use mlx_native::backend::{self, cuda, BackendKind};
use mlx_native::{MlxDevice, MlxError};

/// CI sets `MLX_NATIVE_REQUIRE_NVRTC=1` (and points `MLX_NATIVE_NVRTC` at the wheel's
/// library): there a missing NVRTC fails instead of passing with nothing checked.
fn nvrtc_required() -> bool {
    std::env::var("MLX_NATIVE_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

#[test]
fn kernel_sources_compile_with_nvrtc_for_hopper_and_ampere() {
    for arch in ["sm_90a", "sm_80"] {
        match cuda::compile_check(arch, &mlx_native::default_registry().cuda_sources()) {
            Ok(report) => {
                // Every entry point of every kernel the backend knows (two ops' kernels may
                // share one) with the variants of the form it runs: on Hopper the CTA-pair
                // forms, in the portable form the one with the score transforms.
                let mut entries: Vec<String> = Vec::new();
                for k in cuda::kernels() {
                    let variants =
                        if arch == "sm_90a" && k.hopper_form { k.hopper_variants } else { k.portable_variants };
                    // The split-KV merge, which every attention source holds.
                    let names = variants.iter().map(|v| v.entry(k.entry));
                    for e in std::iter::once(k.entry.to_string()).chain(names).chain(k.merge_entry.map(String::from)) {
                        if !entries.contains(&e) {
                            entries.push(e);
                        }
                    }
                }
                assert!(entries.len() >= 38, "{arch}: the kernels of every head dim and dtype: {entries:?}");
                for entry in &entries {
                    assert!(
                        report.contains(&format!("entry point {entry}")),
                        "{arch}: no entry point {entry} in\n{report}"
                    );
                }
                if !report.contains("ptxas info") && !nvrtc_required() {
                    return; // this NVRTC build returns no resource report
                }
                // The attention kernels keep O, S and P in registers: a spill is a bug.
                let spills = entry_spills(&report);
                // The merge is one entry point of each attention source (all but the
                // classifiers' file), listed once above.
                let merges = report.matches("entry point flash_attn_prefill_split_merge\n").count();
                let sources = mlx_native::default_registry().cuda_sources().len();
                assert_eq!(merges, sources - 1, "{arch}: a split-KV merge in every attention source");
                assert_eq!(
                    spills.len(),
                    entries.len() + merges - 1,
                    "{arch}: one resource line per entry point:\n{report}"
                );
                for (function, stores, line) in entry_spills(&report) {
                    // The portable form with the score transforms (`_xf`) may spill a
                    // little at the widest head dims, where the form without them fills
                    // the register file exactly; every other form spills nothing.
                    // The Hopper form at head dim 128 runs two CTAs an SM, within 128
                    // registers: ptxas spills a little there, and it is still the faster
                    // form (mainloop_sm90.cuh, HCfg).
                    let two_ctas = arch == "sm_90a"
                        && (function.starts_with("flash_attn_prefill_d128'")
                            || function.starts_with("flash_attn_prefill_d128_bf16'"));
                    // The warp-specialised pair forms at head dim 256: the consumers have
                    // 240 registers (the producer warpgroup releases the rest to them), and
                    // ptxas spills up to about 60 words there; measured faster than the
                    // form that spills nothing (docs/benchmarks.md, 2026-12-01 18:05).
                    let ws = arch == "sm_90a" && function.contains("d256") && function.contains("_pair_");
                    // The pair forms at head dim 64: three consumer warpgroups of 160
                    // registers leave the producer warpgroup 32, where its walk spills;
                    // measured 1.20x faster than two consumer warpgroups that spill
                    // nothing (docs/benchmarks.md, 2026-12-06).
                    let ws64 = arch == "sm_90a" && function.contains("_d64") && function.contains("_pair_");
                    // The wide d128 pair forms (192-row tiles, 24 / 240 registers): 408 / 684
                    // bytes (heads / queries) with NVRTC 13.0.
                    let wide = arch == "sm_90a" && function.contains("_wide'");
                    let allowed = if function.contains("_xf'") || two_ctas {
                        128
                    } else if wide {
                        768
                    } else if ws64 {
                        384
                    } else if ws {
                        256
                    } else {
                        0
                    };
                    assert!(stores <= allowed, "{arch}: {function} spills registers: {line}");
                }
            }
            Err(MlxError::BackendUnavailable(why)) if !nvrtc_required() => {
                eprintln!("NVRTC not found, compile check not run here: {why}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        }
    }
}

/// Each entry point's spill line of a ptxas report: the function's name (as ptxas quotes it,
/// with its closing quote), its bytes of spill stores (u32::MAX where the line does not parse)
/// and the line.
fn entry_spills(report: &str) -> Vec<(&str, u32, &str)> {
    let mut function = "";
    let mut out = Vec::new();
    for line in report.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            function = &line[i + "Compiling entry function '".len()..];
        }
        if line.contains("spill stores") {
            let stores = line
                .split(" bytes spill stores")
                .next()
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(u32::MAX);
            out.push((function, stores, line));
        }
    }
    out
}

/// The paged K/V modules (`-DMLXN_PAGED_ENTRIES=1`, compiled only for a paged launch): each
/// attention source's `_paged` entry points (and `_xf_paged` in the portable form) with the
/// split-KV merge, nothing else, and the contiguous modules none of them.
#[test]
fn paged_modules_compile_with_nvrtc_for_hopper_and_ampere() {
    // The attention sources (the classifiers' file has no paged form).
    let files: Vec<_> = mlx_native::default_registry()
        .cuda_sources()
        .into_iter()
        .filter(|f| f.headers.iter().any(|(name, _)| *name == "flash_attn_prefill/entry.cuh"))
        .collect();
    for arch in ["sm_90a", "sm_80"] {
        let report = match cuda::compile_check_paged(arch, &files) {
            Ok(r) => r,
            Err(MlxError::BackendUnavailable(why)) if !nvrtc_required() => {
                eprintln!("NVRTC not found, compile check not run here: {why}");
                return;
            }
            Err(e) => panic!("{arch}: {e}"),
        };
        let mut want: Vec<String> = Vec::new();
        for k in cuda::kernels() {
            let hopper = arch == "sm_90a" && k.hopper_form;
            for e in k.paged_variants(hopper).iter().map(|v| v.entry(k.entry)).chain(k.merge_entry.map(String::from)) {
                if !want.contains(&e) {
                    want.push(e);
                }
            }
        }
        let mut got: Vec<String> =
            report.lines().filter_map(|l| l.strip_prefix("entry point ")).map(String::from).collect();
        got.sort();
        got.dedup();
        want.sort();
        assert_eq!(got, want, "{arch}: the paged modules' entry points");
        assert!(want.len() >= 20, "{arch}: {want:?}");
        if !report.contains("ptxas info") && !nvrtc_required() {
            return;
        }
        let mut spilled = Vec::new();
        for (function, stores, line) in entry_spills(&report) {
            // As their contiguous siblings: the portable form with the score transforms
            // may spill a little, and the Hopper form at head dim 128 (two CTAs an SM
            // within 128 registers) does.
            let two_ctas = arch == "sm_90a"
                && (function.starts_with("flash_attn_prefill_d128_paged'")
                    || function.starts_with("flash_attn_prefill_d128_bf16_paged'"));
            // The pair forms' paged twins spill as their contiguous siblings do (head dim 256:
            // the consumers at 240 registers; 64: the producer warpgroup at 32), the producer
            // a little more for its boxes through the table: 230 / 168 bytes (d256 queries /
            // heads) and 436 / 342 (d64) with NVRTC 13.0.
            let pair = arch == "sm_90a" && function.contains("_pair_");
            let allowed = if function.contains("_xf_paged'") || two_ctas {
                128
            } else if pair && function.contains("_d64") {
                448
            } else if pair && function.contains("d256") {
                256
            } else {
                0
            };
            if stores > allowed {
                spilled.push(format!("{function}: {line}"));
            }
        }
        assert!(spilled.is_empty(), "{arch}: entry points that spill registers:\n{}", spilled.join("\n"));
    }
}

/// The quantised K/V modules (`-DMLXN_QUANT_ENTRIES=1`, with `-DMLXN_PAGED_ENTRIES=1` for
/// paged quantised K/V; compiled only for such a launch): each F16 attention source's `_kvq`
/// entry points (`_paged_kvq`; and `_xf_kvq` / `_xf_paged_kvq` in the portable form; and on
/// sm_90a at head dims 64, 128 and 256 the FP8 pair forms `_pair_heads_kvq` /
/// `_pair_queries_kvq`) with the split-KV merge, nothing else (no BF16 forms, no paged pair
/// forms), spilling no more than their F16 siblings allow.
#[test]
fn quant_modules_compile_with_nvrtc_for_hopper_and_ampere() {
    let quant_kernels: Vec<_> = cuda::kernels().filter(|k| k.quant).collect();
    assert_eq!(quant_kernels.len(), 14, "a quantised K/V kernel per head dim pair");
    // The sources of the quantised K/V kernels: the F16 attention files.
    let registry = mlx_native::default_registry();
    let files: Vec<_> = registry
        .cuda_sources()
        .into_iter()
        .filter(|f| quant_kernels.iter().any(|k| registry.cuda_source_of(k.name).is_some_and(|s| s.name == f.name)))
        .collect();
    assert_eq!(files.len(), 13, "one file per head dim pair (256 and 512 share the origin's)");
    // Each is its F16 kernel's file (the entry points it names are that kernel's), beside the
    // Metal file every head dim shares (its `_kvq` entry points).
    for (dims, name) in mlx_native::ops::flash_attn_prefill::QUANT_KV_KERNELS {
        let (_, f16, _) = mlx_native::ops::flash_attn_prefill::HEAD_DIMS.iter().find(|(d, _, _)| *d == dims).unwrap();
        let file = |n: &str| registry.cuda_source_of(n).map(|f| f.name);
        assert!(file(name).is_some() && file(name) == file(f16), "{name}: {:?}, {f16}: {:?}", file(name), file(f16));
        assert!(registry.has_metal_source(name), "{name}");
        let k = quant_kernels.iter().find(|k| k.name == name).expect("a CUDA kernel per quantised K/V kernel");
        assert_eq!(k.entry, cuda::kernel(f16).unwrap().entry);
    }
    for arch in ["sm_90a", "sm_80"] {
        for module in [cuda::ModuleKind::QUANT, cuda::ModuleKind::PAGED_QUANT] {
            let report = match cuda::compile_check_module(arch, &files, module) {
                Ok(r) => r,
                Err(MlxError::BackendUnavailable(why)) if !nvrtc_required() => {
                    eprintln!("NVRTC not found, compile check not run here: {why}");
                    return;
                }
                Err(e) => panic!("{arch} {module:?}: {e}"),
            };
            let mut want: Vec<String> = Vec::new();
            for k in &quant_kernels {
                let hopper = arch == "sm_90a" && k.hopper_form;
                let entries = k.quant_variants(hopper, module.paged).iter().map(|v| v.entry(k.entry));
                for e in entries.chain(k.merge_entry.map(String::from)) {
                    if !want.contains(&e) {
                        want.push(e);
                    }
                }
            }
            let mut got: Vec<String> =
                report.lines().filter_map(|l| l.strip_prefix("entry point ")).map(String::from).collect();
            got.sort();
            got.dedup();
            want.sort();
            assert_eq!(got, want, "{arch} {module:?}: the quant modules' entry points");
            assert!(want.len() >= 15, "{arch}: {want:?}");
            if !report.contains("ptxas info") && !nvrtc_required() {
                return;
            }
            for (function, stores, line) in entry_spills(&report) {
                // As their F16 siblings: the portable form with the score transforms may
                // spill a little, and the Hopper form at head dim 128 (two CTAs an SM
                // within 128 registers) does, a little more with the widening loader
                // (docs/spec.md 11b: 132 bytes, the F16 form 116).
                let two_ctas = arch == "sm_90a" && function.starts_with("flash_attn_prefill_d128_");
                // The FP8 pair forms (quant_pipe.cuh): head dim 64 as its F16 sibling (the
                // producer's 32 registers; measured 184 bytes), 256 as the F16 form in the
                // same pipeline (PIPE 2: 306 / 378 bytes there, 288 / 348 here), 128 a
                // few words (12 bytes at pair heads).
                let pair = arch == "sm_90a" && function.contains("_pair_");
                let allowed = if function.contains("_xf_") {
                    128
                } else if pair && (function.contains("_d64") || function.contains("d256")) {
                    384
                } else if two_ctas {
                    160
                } else {
                    0
                };
                assert!(stores <= allowed, "{arch} {module:?}: {function} spills registers: {line}");
            }
        }
    }
}

#[test]
fn a_compile_error_carries_the_compiler_log() {
    let Ok(nv) = cuda::nvrtc::nvrtc() else {
        assert!(!nvrtc_required(), "NVRTC is required here");
        return;
    };
    let err = nv
        .compile(
            "broken.cu",
            "extern \"C\" __global__ void k() { undeclared_name = 1; }",
            &cuda::nvrtc::options("sm_90a"),
        )
        .unwrap_err();
    match err {
        MlxError::ShaderCompilationError { name, message } => {
            assert_eq!(name, "broken.cu");
            assert!(message.contains("undeclared_name"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn without_a_usable_gpu_cuda_is_a_clean_error_and_auto_is_the_cpu() {
    if cuda::usable() {
        assert_eq!(backend::available_backends()[0], "cuda");
        assert_eq!(MlxDevice::new("auto").unwrap().backend_kind(), BackendKind::Cuda);
        assert!(matches!(MlxDevice::new("cuda:4096"), Err(MlxError::DeviceNotFound(_))));
        return;
    }
    assert_eq!(backend::available_backends(), vec!["cpu"]);
    assert_eq!(MlxDevice::new("auto").unwrap().backend_kind(), BackendKind::Cpu);
    for name in ["cuda", "cuda:0", "cuda:1"] {
        match MlxDevice::new(name) {
            Err(MlxError::BackendUnavailable(m)) => assert!(!m.is_empty()),
            Err(MlxError::DeviceNotFound(m)) => assert!(m.contains("cuda"), "{m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    assert!(matches!(MlxDevice::new("cuda:x"), Err(MlxError::DeviceNotFound(_))));
}

#[test]
fn the_cpu_backend_refuses_device_memory_and_streams() {
    let cpu = MlxDevice::cpu();
    // SAFETY: refused before the address is used.
    let e = unsafe { cpu.wrap_device(0x1000, 16, mlx_native::DType::F32, &[4]) }.unwrap_err();
    assert!(matches!(e, MlxError::InvalidArgument(_)), "{e:?}");
    assert!(matches!(cpu.backend().wait_stream(1), Err(MlxError::InvalidArgument(_))));
}
