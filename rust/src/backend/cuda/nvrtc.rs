//! NVRTC, the CUDA run-time compiler, loaded at run time, and the cubins it makes: cached
//! in memory for the process and on disk across processes.
//!
//! Where NVRTC is looked for, in order: the file `MLX_NATIVE_NVRTC` names (the Python
//! package points it at the `nvidia-cuda-nvrtc` wheel when one is installed); the
//! `lib64` folders of `CUDA_HOME`, `CUDA_PATH` and `/usr/local/cuda`; the loader's search
//! path. NVRTC opens its companion `libnvrtc-builtins` by name, so the one beside the
//! chosen library is loaded first.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use libloading::Library;

use crate::error::{MlxError, Result};

type NvrtcResult = c_int;
type Program = *mut c_void;
const NVRTC_SUCCESS: NvrtcResult = 0;

macro_rules! nvrtc_api {
    ($($name:ident : fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// Entry points of NVRTC.
        #[allow(non_snake_case)]
        pub struct Nvrtc {
            _builtins: Vec<Library>,
            _lib: Library,
            /// Where it was loaded from (a path, or the name the loader resolved).
            pub origin: String,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl Nvrtc {
            #[allow(non_snake_case)]
            fn load(lib: Library, builtins: Vec<Library>, origin: String) -> std::result::Result<Self, String> {
                // SAFETY: each symbol is looked up by its documented name and given the
                // signature of nvrtc.h; the library outlives the pointers (held in `_lib`).
                unsafe {
                    $(
                        let $name = *lib
                            .get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|e| format!("{origin} lacks {}: {e}", stringify!($name)))?;
                    )*
                    Ok(Nvrtc { _builtins: builtins, _lib: lib, origin, $($name,)* })
                }
            }
        }
    };
}

nvrtc_api! {
    nvrtcVersion: fn(*mut c_int, *mut c_int) -> NvrtcResult;
    nvrtcGetErrorString: fn(NvrtcResult) -> *const c_char;
    nvrtcCreateProgram: fn(
        *mut Program, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char
    ) -> NvrtcResult;
    nvrtcDestroyProgram: fn(*mut Program) -> NvrtcResult;
    nvrtcCompileProgram: fn(Program, c_int, *const *const c_char) -> NvrtcResult;
    nvrtcGetProgramLogSize: fn(Program, *mut usize) -> NvrtcResult;
    nvrtcGetProgramLog: fn(Program, *mut c_char) -> NvrtcResult;
    nvrtcGetCUBINSize: fn(Program, *mut usize) -> NvrtcResult;
    nvrtcGetCUBIN: fn(Program, *mut c_char) -> NvrtcResult;
}

// SAFETY: NVRTC's API is thread-safe for distinct programs; only function pointers here.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

const FILE_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

/// Environment variable naming the NVRTC library file to use.
pub const NVRTC_ENV: &str = "MLX_NATIVE_NVRTC";
/// Environment variable naming the cubin cache folder (`0` or `off`: no disk cache).
pub const CACHE_ENV: &str = "MLX_NATIVE_CUDA_CACHE";
/// Extra `-D` options for NVRTC (development: timing variants of a kernel).
pub const DEFINES_ENV: &str = "MLX_NATIVE_CUDA_DEFINES";

static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();

/// NVRTC, loaded once; `BackendUnavailable` with every place tried when it is missing.
pub fn nvrtc() -> Result<&'static Nvrtc> {
    NVRTC.get_or_init(load).as_ref().map_err(|e| MlxError::BackendUnavailable(e.clone()))
}

fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(NVRTC_ENV).filter(|p| !p.is_empty()) {
        out.push(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(|p| PathBuf::from(p).join("lib64")))
        .collect();
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    for d in dirs {
        for f in FILE_NAMES {
            let p = d.join(f);
            if p.exists() {
                out.push(p);
            }
        }
    }
    out
}

/// `libnvrtc-builtins*` beside `lib` (not the `.alt` variant), to be loaded first.
fn builtins_beside(lib: &Path) -> Vec<Library> {
    let Some(dir) = lib.parent() else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with("libnvrtc-builtins") && n.contains(".so") && !n.contains(".alt.")
            })
        })
        .collect();
    names.sort();
    // SAFETY: loading the builtins library runs no code with preconditions.
    names.into_iter().filter_map(|p| unsafe { Library::new(&p) }.ok()).collect()
}

fn load() -> std::result::Result<Nvrtc, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        let builtins = builtins_beside(&path);
        // SAFETY: as above.
        match unsafe { Library::new(&path) } {
            Ok(lib) => return Nvrtc::load(lib, builtins, path.display().to_string()),
            Err(e) => tried.push(format!("{}: {e}", path.display())),
        }
    }
    for name in FILE_NAMES {
        // SAFETY: as above.
        match unsafe { Library::new(name) } {
            Ok(lib) => return Nvrtc::load(lib, Vec::new(), (*name).to_string()),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "NVRTC (the CUDA run-time compiler) could not be loaded; install the nvidia-cuda-nvrtc \
         wheel or the CUDA toolkit, or set {NVRTC_ENV} to libnvrtc.so's path (tried {})",
        tried.join("; ")
    ))
}

impl Nvrtc {
    /// `(major, minor)` of this NVRTC.
    pub fn version(&self) -> (i32, i32) {
        let (mut a, mut b) = (0, 0);
        // SAFETY: two valid out pointers.
        unsafe { (self.nvrtcVersion)(&mut a, &mut b) };
        (a, b)
    }

    fn error_text(&self, r: NvrtcResult) -> String {
        // SAFETY: returns a static NUL-terminated string.
        let p = unsafe { (self.nvrtcGetErrorString)(r) };
        if p.is_null() {
            format!("NVRTC error {r}")
        } else {
            // SAFETY: non-null static string.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    }

    /// Compile `source` (named `file` in messages) with `options`: the cubin and the log.
    /// A failure is `ShaderCompilationError` carrying the compiler's log.
    pub fn compile(&self, file: &str, source: &str, options: &[String]) -> Result<(Vec<u8>, String)> {
        let fail = |message: String| MlxError::ShaderCompilationError { name: file.to_string(), message };
        let src = CString::new(source).map_err(|_| fail("the source contains a NUL byte".into()))?;
        let name = CString::new(file).map_err(|_| fail("the file name contains a NUL byte".into()))?;
        let opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| fail("an option contains a NUL byte".into()))?;
        let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings; no headers.
        let r = unsafe {
            (self.nvrtcCreateProgram)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
        };
        if r != NVRTC_SUCCESS {
            return Err(fail(format!("nvrtcCreateProgram: {}", self.error_text(r))));
        }
        let result = (|| {
            // SAFETY: `prog` is a live program; the option array holds `len` pointers.
            let r = unsafe { (self.nvrtcCompileProgram)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr()) };
            let log = self.program_log(prog);
            if r != NVRTC_SUCCESS {
                return Err(fail(format!("{} ({}):\n{log}", self.error_text(r), options.join(" "))));
            }
            let mut size = 0usize;
            // SAFETY: valid program and out pointer.
            let r = unsafe { (self.nvrtcGetCUBINSize)(prog, &mut size) };
            if r != NVRTC_SUCCESS || size == 0 {
                return Err(fail(format!("no cubin: {} (options {})", self.error_text(r), options.join(" "))));
            }
            let mut cubin = vec![0u8; size];
            // SAFETY: the buffer holds `size` bytes, as NVRTC asked for.
            let r = unsafe { (self.nvrtcGetCUBIN)(prog, cubin.as_mut_ptr() as *mut c_char) };
            if r != NVRTC_SUCCESS {
                return Err(fail(format!("nvrtcGetCUBIN: {}", self.error_text(r))));
            }
            Ok((cubin, log))
        })();
        // SAFETY: destroys the program created above, once.
        unsafe { (self.nvrtcDestroyProgram)(&mut prog) };
        result
    }

    fn program_log(&self, prog: Program) -> String {
        let mut size = 0usize;
        // SAFETY: valid program and out pointer.
        if unsafe { (self.nvrtcGetProgramLogSize)(prog, &mut size) } != NVRTC_SUCCESS || size == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; size];
        // SAFETY: the buffer holds `size` bytes.
        if unsafe { (self.nvrtcGetProgramLog)(prog, buf.as_mut_ptr() as *mut c_char) } != NVRTC_SUCCESS {
            return String::new();
        }
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).trim_end().to_string()
    }
}

/// The options a kernel is compiled with for `arch` (`sm_90a`, `sm_80`, ...).
/// `MLX_NATIVE_CUDA_DEFINES` adds `-D` options (a development knob, for timing variants of
/// a kernel; anything else in it is ignored).
pub fn options(arch: &str) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into(), "-lineinfo".into()];
    if let Ok(extra) = std::env::var(DEFINES_ENV) {
        o.extend(extra.split_whitespace().filter(|d| d.starts_with("-D") && d.len() > 2).map(String::from));
    }
    o
}

/// 64-bit FNV-1a: a hash that stays the same across builds, for cache file names.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os(CACHE_ENV) {
        Some(v) if v == "0" || v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(base.join("mlx_native").join("cuda"))
        }
    }
}

type CubinKey = (u64, String);
static CUBINS: OnceLock<Mutex<HashMap<CubinKey, Arc<Vec<u8>>>>> = OnceLock::new();

/// The cubin of `source` for `arch`: from this process's cache, else the disk cache, else
/// compiled with NVRTC (and then cached in both).
pub fn cubin(file: &str, source: &str, arch: &str) -> Result<Arc<Vec<u8>>> {
    let nv = nvrtc()?;
    let opts = options(arch);
    let (maj, min) = nv.version();
    let ver = format!("{}|nvrtc {maj}.{min}", crate::VERSION);
    let key = fnv1a(&[ver.as_bytes(), opts.join(" ").as_bytes(), source.as_bytes()]);
    let cache = CUBINS.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(c) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&(key, arch.to_string())) {
        return Ok(c.clone());
    }
    let stem = file.trim_end_matches(".cu");
    let disk = cache_dir().map(|d| d.join(format!("{stem}-{arch}-{key:016x}.cubin")));
    let from_disk = disk.as_ref().and_then(|p| std::fs::read(p).ok()).filter(|b| is_elf(b));
    let bytes = match from_disk {
        Some(b) => b,
        None => {
            let (b, _log) = nv.compile(file, source, &opts)?;
            if let Some(p) = &disk {
                store(p, &b);
            }
            b
        }
    };
    let bytes = Arc::new(bytes);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert((key, arch.to_string()), bytes.clone());
    Ok(bytes)
}

/// Forget a cubin that the driver refused (a damaged cache file): the next call compiles.
pub fn forget(file: &str, source: &str, arch: &str) {
    if let Ok(nv) = nvrtc() {
        let (maj, min) = nv.version();
        let ver = format!("{}|nvrtc {maj}.{min}", crate::VERSION);
        let key = fnv1a(&[ver.as_bytes(), options(arch).join(" ").as_bytes(), source.as_bytes()]);
        if let Some(c) = CUBINS.get() {
            c.lock().unwrap_or_else(|e| e.into_inner()).remove(&(key, arch.to_string()));
        }
        if let Some(d) = cache_dir() {
            let _ = std::fs::remove_file(d.join(format!("{}-{arch}-{key:016x}.cubin", file.trim_end_matches(".cu"))));
        }
    }
}

fn is_elf(b: &[u8]) -> bool {
    b.len() > 4 && &b[..4] == b"\x7fELF"
}

/// Write `bytes` to `path` through a temporary file and a rename, so a reader never sees
/// half a cubin. Failures only mean no disk cache.
fn store(path: &Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Compile `source` for `arch` without a device, with ptxas's resource report: the log.
pub fn compile_report(file: &str, source: &str, arch: &str) -> Result<String> {
    let nv = nvrtc()?;
    let mut opts = options(arch);
    opts.push("--ptxas-options=-v".into());
    let (cubin, log) = nv.compile(file, source, &opts)?;
    let (maj, min) = nv.version();
    let mut report = format!("nvrtc {maj}.{min} ({})\n", nv.origin);
    for name in entry_points(&cubin) {
        report.push_str(&format!("entry point {name}\n"));
    }
    report.push_str(&log);
    Ok(report)
}

/// Names of the kernels in a cubin: its `.text.<name>` sections.
pub fn entry_points(cubin: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    for part in cubin.split(|&b| b == 0) {
        if let Some(name) = part.strip_prefix(b".text.") {
            if let Ok(n) = std::str::from_utf8(name) {
                if !n.is_empty() && !out.iter().any(|o: &String| o == n) {
                    out.push(n.to_string());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_is_stable_and_separates_parts() {
        assert_eq!(fnv1a(&[b"a"]), fnv1a(&[b"a"]));
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }

    #[test]
    fn options_name_the_architecture() {
        assert_eq!(options("sm_90a")[0], "--gpu-architecture=sm_90a");
    }
}
