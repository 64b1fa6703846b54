//! The library's environment variables, read here and nowhere else, each once: the first
//! time any setting is asked for (the Python package asks when it loads, before its own
//! threads run). Reading them at each call raced with other threads' `setenv` (glibc's
//! environment is not thread-safe: a Python thread writing `os.environ` while a call read
//! `MLX_NATIVE_CPU_ISA` with the GIL released crashed the process).
//!
//! A value that is not understood is ignored, and says so: [`complaints`] lists each with
//! the variable's name and what it takes (the Python package turns them into warnings; the
//! C ABI gives them through `mlxn_settings_report`). Every variable is an override for
//! tests, benchmarks and development; the README's table of them is the user's view.
//!
//! Four of them override the defaults of a plan's options ([`crate::options`]), which a
//! caller's explicit option beats: `MLX_NATIVE_CPU_ISA`, `MLX_NATIVE_CUDA_ARCH`,
//! `MLX_NATIVE_CUDA_PAIR` and `MLX_NATIVE_CUDA_KV_SPLITS`.
//!
//! This is a leaf: it imports only the options' parsers, and the layers that use a setting
//! (the backends) interpret it.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// `MLX_NATIVE_CPU_ISA`: the CPU kernels' instruction set (a name of `mn.cpu_info()`'s
/// `detected`), checked against the CPU by the CPU backend.
pub const CPU_ISA: &str = "MLX_NATIVE_CPU_ISA";
/// `RAYON_NUM_THREADS`: the CPU kernels' threads (a positive integer), unless the caller
/// sets a number (`mlxn_cpu_set_threads`).
pub const CPU_THREADS: &str = "RAYON_NUM_THREADS";
/// `MLX_NATIVE_CUDA_ARCH`: the NVRTC target instead of the device's own (`sm_90` on a
/// Hopper GPU runs the portable mma.sync form).
pub const CUDA_ARCH: &str = "MLX_NATIVE_CUDA_ARCH";
/// `MLX_NATIVE_CUDA_PAIR`: `0` (or `off`) keeps the one-CTA forms, `queries` query pairs
/// only, `1` (or `auto`, or unset) head pairs where the group splits in two, else query
/// pairs (the `cta_pairs` option's default).
pub const CUDA_PAIR: &str = "MLX_NATIVE_CUDA_PAIR";
/// `MLX_NATIVE_CUDA_KV_SPLITS`: force every prefill to split its walk into this many parts
/// (a power of two up to 16; `0` or `1`: never).
pub const CUDA_KV_SPLITS: &str = "MLX_NATIVE_CUDA_KV_SPLITS";
/// `MLX_NATIVE_CUDA_DEFINES`: `-D` options added to every CUDA compile (timing variants).
pub const CUDA_DEFINES: &str = "MLX_NATIVE_CUDA_DEFINES";
/// `MLX_NATIVE_CUDA_SOURCE_DIR`: a folder whose files replace the built-in CUDA sources.
pub const CUDA_SOURCE_DIR: &str = "MLX_NATIVE_CUDA_SOURCE_DIR";
/// `MLX_NATIVE_CUDA_TRACE`: `1` prints each launch to stderr.
pub const CUDA_TRACE: &str = "MLX_NATIVE_CUDA_TRACE";
/// `MLX_NATIVE_NVRTC`: the path of libnvrtc to load first.
pub const NVRTC: &str = "MLX_NATIVE_NVRTC";
/// `MLX_NATIVE_CUDA_CACHE`: the compiled kernels' disk cache folder (`0` or `off`: none).
pub const CUDA_CACHE: &str = "MLX_NATIVE_CUDA_CACHE";
/// `MLX_NATIVE_CUDA_CUBIN_DIR`: where `cuda_compile_check` also writes each cubin.
pub const CUDA_CUBIN_DIR: &str = "MLX_NATIVE_CUDA_CUBIN_DIR";

/// Every variable above, for the report and the tests.
pub const ALL: &[&str] = &[
    CPU_ISA,
    CPU_THREADS,
    CUDA_ARCH,
    CUDA_PAIR,
    CUDA_KV_SPLITS,
    CUDA_DEFINES,
    CUDA_SOURCE_DIR,
    CUDA_TRACE,
    NVRTC,
    CUDA_CACHE,
    CUDA_CUBIN_DIR,
];

pub use crate::options::CtaPairs;

/// `MLX_NATIVE_CUDA_CACHE`'s choice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CudaCache {
    Off,
    Folder(PathBuf),
    /// `$XDG_CACHE_HOME/mlx_native/cuda`, else `~/.cache/mlx_native/cuda` (None: neither set).
    Default(Option<PathBuf>),
}

/// Every setting, as read once.
#[derive(Debug)]
pub struct Settings {
    pub cpu_isa: Option<String>,
    pub cpu_threads: Option<usize>,
    pub cuda_arch: Option<String>,
    pub cuda_pair: CtaPairs,
    pub cuda_kv_splits: Option<u32>,
    pub cuda_defines: Vec<String>,
    pub cuda_source_dir: Option<PathBuf>,
    pub cuda_trace: bool,
    pub nvrtc: Option<PathBuf>,
    /// `$CUDA_HOME/lib64` and `$CUDA_PATH/lib64`, where set: more places to find NVRTC.
    pub cuda_lib_dirs: Vec<PathBuf>,
    pub cuda_cache: CudaCache,
    pub cuda_cubin_dir: Option<PathBuf>,
}

/// The settings, read from the environment the first time this is called.
pub fn get() -> &'static Settings {
    static SETTINGS: OnceLock<Settings> = OnceLock::new();
    SETTINGS.get_or_init(|| read(&|name| std::env::var_os(name).filter(|v| !v.is_empty())))
}

static COMPLAINTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Record that a setting's value was not understood (and what was done instead). Each
/// message is kept once.
pub fn complain(message: String) {
    let mut c = COMPLAINTS.lock().unwrap_or_else(|e| e.into_inner());
    if !c.contains(&message) {
        c.push(message);
    }
}

/// The complaints recorded so far, oldest first.
pub fn complaints() -> Vec<String> {
    get();
    COMPLAINTS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The settings of an environment given as a look-up (the tests give their own).
pub fn read(var: &dyn Fn(&str) -> Option<std::ffi::OsString>) -> Settings {
    let text = |name: &str| -> Option<String> {
        let v = var(name)?;
        match v.into_string() {
            Ok(s) => Some(s.trim().to_string()).filter(|s| !s.is_empty()),
            Err(_) => {
                complain(format!("{name} is not valid UTF-8: ignored"));
                None
            }
        }
    };
    let path = |name: &str| var(name).map(PathBuf::from);

    let cpu_threads = text(CPU_THREADS).and_then(|v| match v.parse::<usize>() {
        Ok(n) if n >= 1 => Some(n),
        _ => {
            complain(format!(
                "{CPU_THREADS}={v:?} is not a positive integer: ignored (the CPU kernels use every core)"
            ));
            None
        }
    });
    let cuda_arch = text(CUDA_ARCH).and_then(|v| {
        if v.starts_with("sm_") && v.len() > 3 && v.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            Some(v)
        } else {
            complain(format!("{CUDA_ARCH}={v:?} is not a CUDA target such as sm_90 or sm_90a: ignored"));
            None
        }
    });
    let cuda_pair = match text(CUDA_PAIR) {
        None => CtaPairs::Auto,
        Some(v) => CtaPairs::parse(&v).unwrap_or_else(|| {
            complain(format!("{CUDA_PAIR}={v:?} is not 0, queries or 1: ignored (head pairs where they fit)"));
            CtaPairs::Auto
        }),
    };
    let cuda_kv_splits = text(CUDA_KV_SPLITS).and_then(|v| match v.parse::<u32>() {
        Ok(n) if crate::options::kv_splits_ok(n) => Some(n),
        _ => {
            complain(format!(
                "{CUDA_KV_SPLITS}={v:?} is not 0, 1 or a power of two up to 16: ignored (the shape decides)"
            ));
            None
        }
    });
    let mut cuda_defines = Vec::new();
    for d in text(CUDA_DEFINES).unwrap_or_default().split_whitespace() {
        if d.starts_with("-D") && d.len() > 2 {
            cuda_defines.push(d.to_string());
        } else {
            complain(format!("{CUDA_DEFINES}: {d:?} is not a -DNAME or -DNAME=VALUE option: ignored"));
        }
    }
    let cuda_trace = match text(CUDA_TRACE).as_deref() {
        None | Some("0") => false,
        Some("1") => true,
        Some(v) => {
            complain(format!("{CUDA_TRACE}={v:?} is not 0 or 1: ignored (no trace)"));
            false
        }
    };
    let cuda_cache = match var(CUDA_CACHE) {
        Some(v) if v == "0" || v == "off" => CudaCache::Off,
        Some(v) => CudaCache::Folder(PathBuf::from(v)),
        None => CudaCache::Default(
            path("XDG_CACHE_HOME")
                .or_else(|| path("HOME").map(|h| h.join(".cache")))
                .map(|b| b.join("mlx_native").join("cuda")),
        ),
    };
    Settings {
        cpu_isa: text(CPU_ISA),
        cpu_threads,
        cuda_arch,
        cuda_pair,
        cuda_kv_splits,
        cuda_defines,
        cuda_source_dir: path(CUDA_SOURCE_DIR),
        cuda_trace,
        nvrtc: path(NVRTC),
        cuda_lib_dirs: ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(|v| path(v).map(|p| p.join("lib64"))).collect(),
        cuda_cache,
        cuda_cubin_dir: path(CUDA_CUBIN_DIR),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn settings_of(vars: &[(&str, &str)]) -> Settings {
        let env: HashMap<String, OsString> = vars.iter().map(|(k, v)| (k.to_string(), OsString::from(v))).collect();
        read(&move |name| env.get(name).cloned().filter(|v| !v.is_empty()))
    }

    /// Values that are understood are taken; the rest are ignored with a complaint that
    /// names the variable and the value.
    #[test]
    fn each_variable_is_parsed_and_a_value_not_understood_is_named() {
        let s = settings_of(&[
            (CPU_ISA, "avx2+fma+f16c"),
            (CPU_THREADS, "3"),
            (CUDA_ARCH, "sm_90"),
            (CUDA_PAIR, "queries"),
            (CUDA_KV_SPLITS, "4"),
            (CUDA_DEFINES, "-DA=1 -DB"),
            (CUDA_TRACE, "1"),
            (CUDA_CACHE, "off"),
        ]);
        assert_eq!(s.cpu_isa.as_deref(), Some("avx2+fma+f16c"));
        assert_eq!(s.cpu_threads, Some(3));
        assert_eq!(s.cuda_arch.as_deref(), Some("sm_90"));
        assert_eq!(s.cuda_pair, CtaPairs::Queries);
        assert_eq!(s.cuda_kv_splits, Some(4));
        assert_eq!(s.cuda_defines, vec!["-DA=1", "-DB"]);
        assert!(s.cuda_trace);
        assert_eq!(s.cuda_cache, CudaCache::Off);

        let bad = settings_of(&[
            (CPU_THREADS, "0"),
            (CUDA_ARCH, "hopper"),
            (CUDA_PAIR, "yes"),
            (CUDA_KV_SPLITS, "3"),
            (CUDA_DEFINES, "-O3"),
            (CUDA_TRACE, "on"),
        ]);
        assert_eq!(bad.cpu_threads, None);
        assert_eq!(bad.cuda_arch, None);
        assert_eq!(bad.cuda_pair, CtaPairs::Auto);
        assert_eq!(bad.cuda_kv_splits, None);
        assert!(bad.cuda_defines.is_empty());
        assert!(!bad.cuda_trace);
        let c = complaints();
        for (name, value) in [
            (CPU_THREADS, "\"0\""),
            (CUDA_ARCH, "\"hopper\""),
            (CUDA_PAIR, "\"yes\""),
            (CUDA_KV_SPLITS, "\"3\""),
            (CUDA_DEFINES, "\"-O3\""),
            (CUDA_TRACE, "\"on\""),
        ] {
            assert!(c.iter().any(|m| m.contains(name) && m.contains(value)), "no complaint of {name}={value}: {c:?}");
        }
    }

    /// Unset and empty are the same: the defaults, and no complaint.
    #[test]
    fn an_empty_environment_gives_the_defaults() {
        let s = settings_of(&[(CPU_ISA, ""), (CUDA_PAIR, "")]);
        assert_eq!(s.cpu_isa, None);
        assert_eq!(s.cuda_pair, CtaPairs::Auto);
        assert_eq!(s.cuda_kv_splits, None);
        assert_eq!(s.cpu_threads, None);
        assert!(matches!(s.cuda_cache, CudaCache::Default(_)));
    }
}
