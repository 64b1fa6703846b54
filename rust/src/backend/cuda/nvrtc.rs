//! NVRTC, the CUDA run-time compiler, loaded at run time, and the cubins it makes: cached
//! in memory for the process and on disk across processes. A cubin read from disk runs as
//! GPU code in this process, so the disk cache uses only a folder and files that no other
//! user could have written ([`DiskCache`] states the rule).
//!
//! Where NVRTC is looked for, in order: the file `MLX_NATIVE_NVRTC` names (the Python
//! package points it at the `nvidia-cuda-nvrtc` wheel when one is installed); the
//! `lib64` folders of `CUDA_HOME`, `CUDA_PATH` and `/usr/local/cuda`; the loader's search
//! path. NVRTC opens its companion `libnvrtc-builtins` by name, so the one beside the
//! chosen library is loaded first.

use std::collections::{HashMap, HashSet};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use libloading::Library;

use super::launch::ModuleKind;
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

static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();

/// NVRTC, loaded once; `BackendUnavailable` with every place tried when it is missing.
pub fn nvrtc() -> Result<&'static Nvrtc> {
    NVRTC.get_or_init(load).as_ref().map_err(|e| MlxError::BackendUnavailable(e.clone()))
}

fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let settings = crate::settings::get();
    if let Some(p) = &settings.nvrtc {
        out.push(p.clone());
    }
    let mut dirs: Vec<PathBuf> = settings.cuda_lib_dirs.clone();
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
    let Some(dir) = lib.parent() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins") && n.contains(".so") && !n.contains(".alt."))
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
         wheel or the CUDA toolkit, or set {} to libnvrtc.so's path (tried {})",
        crate::settings::NVRTC,
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

/// The options a kernel is compiled with for `arch` (`sm_90a`, `sm_80`, ...): those of the
/// module every call loads ([`module_options`] of the contiguous module).
pub fn options(arch: &str) -> Vec<String> {
    module_options(arch, ModuleKind::CONTIGUOUS)
}

/// The options of a module for `arch`; `module`: which entry points of the source it holds
/// ([`ModuleKind`]): the paged K/V ones (SPEC 11), `-DMLXN_PAGED_ENTRIES=1`, and the
/// quantised K/V ones, `-DMLXN_QUANT_ENTRIES=1` (`shaders/flash_attn_prefill/entry.cuh`),
/// which the backend compiles only for a paged or quantised launch: in the module every call
/// loads they would add to the compile a user's first call waits for, whatever its K/V. The
/// options are part of the cache key ([`cubin`]), so the modules of a source are cached
/// apart. `MLX_NATIVE_CUDA_DEFINES` adds `-D` options (a development knob, for timing
/// variants of a kernel; anything else in it is ignored).
pub fn module_options(arch: &str, module: ModuleKind) -> Vec<String> {
    let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into(), "-lineinfo".into()];
    if super::attention_geometry::WIDE_LAUNCHED {
        o.push("-DMLXN_WS_WIDE_ENTRIES=1".into()); // the d128 file's wide entry points (tiles_sm90.cuh)
    }
    o.extend(module.defines().into_iter().map(String::from));
    o.extend(crate::settings::get().cuda_defines.iter().cloned());
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

/// The disk cache's folder: `MLX_NATIVE_CUDA_CACHE` (`0` or `off`: none), else
/// `$XDG_CACHE_HOME/mlx_native/cuda`, else `~/.cache/mlx_native/cuda`. None off Unix, where
/// the ownership checks of [`DiskCache`] cannot be made.
fn cache_dir() -> Option<PathBuf> {
    if !cfg!(unix) {
        return None;
    }
    match &crate::settings::get().cuda_cache {
        crate::settings::CudaCache::Off => None,
        crate::settings::CudaCache::Folder(p) => Some(p.clone()),
        crate::settings::CudaCache::Default(p) => p.clone(),
    }
}

/// What a compile depends on: the library's and NVRTC's versions, the options, the source.
fn cache_key(nv: &Nvrtc, opts: &[String], source: &str) -> u64 {
    let (maj, min) = nv.version();
    let ver = format!("{}|nvrtc {maj}.{min}", env!("CARGO_PKG_VERSION"));
    fnv1a(&[ver.as_bytes(), opts.join(" ").as_bytes(), source.as_bytes()])
}

fn file_name(file: &str, arch: &str, key: u64) -> String {
    format!("{}-{arch}-{key:016x}.cubin", file.trim_end_matches(".cu"))
}

/// The name under which the disk cache keeps the cubin of `source` for `arch` (its hash
/// file is this name followed by `.sha256`).
pub fn cache_file_name(file: &str, source: &str, arch: &str) -> Result<String> {
    let nv = nvrtc()?;
    Ok(file_name(file, arch, cache_key(nv, &options(arch), source)))
}

type CubinKey = (u64, String);
static CUBINS: OnceLock<Mutex<HashMap<CubinKey, Arc<Vec<u8>>>>> = OnceLock::new();

/// The cubin of `source` for `arch` (`module`: which of its entry points,
/// [`module_options`]): from this process's cache, else the disk cache, else compiled with
/// NVRTC (and then cached in both). A disk cache folder or file that fails the checks of
/// [`DiskCache`] is not used (warned once on stderr); that is never an error.
pub fn cubin(file: &str, source: &str, arch: &str, module: ModuleKind) -> Result<Arc<Vec<u8>>> {
    let nv = nvrtc()?;
    let opts = module_options(arch, module);
    let key = cache_key(nv, &opts, source);
    let cache = CUBINS.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(c) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&(key, arch.to_string())) {
        return Ok(c.clone());
    }
    let fetched = fetch(nv, file, source, &opts, &file_name(file, arch, key), cache_dir().as_deref())?;
    let bytes = Arc::new(fetched.bytes);
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert((key, arch.to_string()), bytes.clone());
    Ok(bytes)
}

/// A cubin and where it came from.
#[derive(Debug)]
pub struct Fetched {
    pub bytes: Vec<u8>,
    /// Read from the disk cache (else compiled just now).
    pub from_disk: bool,
    /// Why the cache folder, or the cached file, was not used (also warned once on stderr).
    pub refused: Option<String>,
}

/// The cubin of `source` for `arch` through the disk cache in `dir` (none: compile), as
/// [`cubin`] does without its in-process cache: a fresh [`DiskCache`] on every call.
pub fn cubin_with_cache(dir: Option<&Path>, file: &str, source: &str, arch: &str) -> Result<Fetched> {
    let nv = nvrtc()?;
    let opts = options(arch);
    let name = file_name(file, arch, cache_key(nv, &opts, source));
    fetch(nv, file, source, &opts, &name, dir)
}

fn fetch(nv: &Nvrtc, file: &str, source: &str, opts: &[String], name: &str, dir: Option<&Path>) -> Result<Fetched> {
    let mut refused = None;
    let disk = dir.and_then(|d| match DiskCache::open(d) {
        Ok(c) => Some(c),
        Err(why) => {
            warn_once(d, &format!("not using the CUDA cubin cache folder {}: {why}; compiling in memory", d.display()));
            refused = Some(why);
            None
        }
    });
    if let Some(c) = &disk {
        match c.load(name) {
            Ok(Some(bytes)) => return Ok(Fetched { bytes, from_disk: true, refused: None }),
            Ok(None) => {}
            Err(why) => {
                let path = c.dir().join(name);
                warn_once(&path, &format!("not using the cached cubin {}: {why}; compiling it afresh", path.display()));
                refused = Some(why);
            }
        }
    }
    let (bytes, _log) = nv.compile(file, source, opts)?;
    if let Some(c) = &disk {
        // Replaces a refused file too (the folder is ours), so the warning is not repeated.
        c.store(name, &bytes);
    }
    Ok(Fetched { bytes, from_disk: false, refused })
}

/// Forget a cubin that the driver refused (a damaged cache file): the next call compiles.
/// Removes it from this process's cache, and it and its hash file from the disk cache.
pub fn forget(file: &str, source: &str, arch: &str, module: ModuleKind) {
    if let Ok(nv) = nvrtc() {
        let key = cache_key(nv, &module_options(arch, module), source);
        if let Some(c) = CUBINS.get() {
            c.lock().unwrap_or_else(|e| e.into_inner()).remove(&(key, arch.to_string()));
        }
        // A folder that fails the checks was not used, so there is nothing of ours to remove.
        if let Some(c) = cache_dir().and_then(|d| DiskCache::open(&d).ok()) {
            c.remove(&file_name(file, arch, key));
        }
    }
}

/// Print `message` on stderr the first time `key` (a folder or file) comes up in this
/// process; whether it printed.
fn warn_once(key: &Path, message: &str) -> bool {
    static WARNED: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    let first = WARNED
        .get_or_init(|| Mutex::new(HashSet::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key.to_path_buf());
    if first {
        eprintln!("mlx_native: warning: {message}");
    }
    first
}

#[cfg_attr(not(unix), allow(dead_code))]
fn is_elf(b: &[u8]) -> bool {
    b.len() > 4 && &b[..4] == b"\x7fELF"
}

#[cfg_attr(not(unix), allow(dead_code))]
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// The on-disk cubin cache: a folder that only its user can write, holding files that only
/// its user wrote, each beside the SHA-256 of its content.
///
/// The rule, checked by [`DiskCache::open`] for the folder and by [`DiskCache::load`] for
/// each file (`uid` is the process's effective user):
/// - Symbolic links in the folder's path are resolved once; the resolved path is what is
///   checked and what is used from then on, so a link changed later has no effect.
/// - The folder (made with mode 0700 when missing) must be a folder owned by `uid` and not
///   writable by group or others (`chmod 700` it otherwise).
/// - Every folder above it, up to `/`, must be owned by `uid` or root, and may be writable
///   by group or others only if it is sticky (as `/tmp` is): there nobody but its owner and
///   root can rename or remove what is ours, so the path cannot be swapped.
/// - A cached file, `<name>.cubin`, and its hash file, `<name>.cubin.sha256`, must each be a
///   regular file (not a symbolic link: opened with `O_NOFOLLOW`, and checked on the open
///   file), owned by `uid` and not writable by group or others; the cubin must be an ELF file
///   whose SHA-256 is the one in the hash file.
///
/// A folder that fails is not used at all (compiled in memory); a file that fails is
/// compiled afresh and replaced. The hash is not a signature: it catches a file damaged or
/// changed since it was written, while the ownership rules keep other users out (root
/// can always write anything).
///
/// Writes go to a temporary file made with mode 0600 and `O_EXCL` in the checked folder,
/// then renamed over the name, so a reader never sees half a file; the hash file is written
/// before the cubin.
#[derive(Debug)]
pub struct DiskCache {
    dir: PathBuf,
    #[cfg_attr(not(unix), allow(dead_code))]
    uid: u32,
}

impl DiskCache {
    /// The folder in use (resolved: no symbolic link in it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Who can write, by a mode's bits: `group`, `others`, `group and others`, or none.
#[cfg(unix)]
fn writable_by(mode: u32) -> Option<&'static str> {
    match (mode & 0o020 != 0, mode & 0o002 != 0) {
        (true, true) => Some("group and others"),
        (true, false) => Some("group"),
        (false, true) => Some("others"),
        (false, false) => None,
    }
}

#[cfg(unix)]
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Why a cached file with metadata `m` (taken from the open file) is not to be trusted by
/// user `uid`, or None: it must be a regular file owned by `uid`, not writable by group or
/// others.
#[cfg(unix)]
pub fn file_refusal(m: &std::fs::Metadata, uid: u32) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    if !m.file_type().is_file() {
        return Some("is not a regular file".into());
    }
    if m.uid() != uid {
        return Some(format!("is owned by uid {}, not by uid {uid}", m.uid()));
    }
    writable_by(m.mode()).map(|who| format!("is writable by {who} (mode {:04o})", m.mode() & 0o7777))
}

#[cfg(unix)]
impl DiskCache {
    /// Open the cache folder `dir`, made (mode 0700, as any folder made on the way) if it is
    /// missing; or why it must not be used (see [`DiskCache`] for the rule).
    pub fn open(dir: &Path) -> std::result::Result<DiskCache, String> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let dir = if dir.is_absolute() {
            dir.to_path_buf()
        } else {
            std::env::current_dir().map_err(|e| format!("the working folder is unknown ({e})"))?.join(dir)
        };
        if std::fs::symlink_metadata(&dir).is_err() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
                .map_err(|e| format!("it cannot be made ({e})"))?;
        }
        let real = std::fs::canonicalize(&dir).map_err(|e| format!("it cannot be resolved ({e})"))?;
        let uid = euid();
        let it = if real == dir { "it".to_string() } else { format!("it (resolved: {})", real.display()) };
        let m = std::fs::symlink_metadata(&real).map_err(|e| format!("{it} cannot be examined ({e})"))?;
        if !m.is_dir() {
            return Err(format!("{it} is not a folder"));
        }
        if m.uid() != uid {
            return Err(format!("{it} is owned by uid {}, not by uid {uid}", m.uid()));
        }
        if let Some(who) = writable_by(m.mode()) {
            return Err(format!("{it} is writable by {who} (mode {:04o})", m.mode() & 0o7777));
        }
        for a in real.ancestors().skip(1) {
            let m = std::fs::symlink_metadata(a).map_err(|e| format!("{} cannot be examined ({e})", a.display()))?;
            if m.file_type().is_symlink() {
                return Err(format!("{} above it was changed into a symbolic link", a.display()));
            }
            if m.uid() != uid && m.uid() != 0 {
                return Err(format!(
                    "{} above it is owned by uid {}, neither uid {uid} nor root",
                    a.display(),
                    m.uid()
                ));
            }
            if let Some(who) = writable_by(m.mode()).filter(|_| m.mode() & 0o1000 == 0) {
                return Err(format!(
                    "{} above it is writable by {who} and not sticky (mode {:04o})",
                    a.display(),
                    m.mode() & 0o7777
                ));
            }
        }
        Ok(DiskCache { dir: real, uid })
    }

    /// The cubin kept under `name`, checked: `Ok(None)` when there is none, `Err` with the
    /// reason when there is one that must not be used.
    pub fn load(&self, name: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        let Some(bytes) = self.read(name).map_err(|why| format!("it {why}"))? else {
            return Ok(None);
        };
        if !is_elf(&bytes) {
            return Err("it is not an ELF file".into());
        }
        let hash_name = format!("{name}.sha256");
        let kept = match self.read(&hash_name) {
            Ok(Some(h)) => h,
            Ok(None) => return Err(format!("it has no hash file ({hash_name})")),
            Err(why) => return Err(format!("its hash file {hash_name} {why}")),
        };
        if kept.trim_ascii() != sha256_hex(&bytes).as_bytes() {
            return Err(format!("its content does not match the SHA-256 in {hash_name}"));
        }
        Ok(Some(bytes))
    }

    /// The content of the file `name` if it passes [`file_refusal`]; `Ok(None)` if missing.
    fn read(&self, name: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.dir.join(name);
        match std::fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot be examined ({e})")),
            Ok(m) if m.file_type().is_symlink() => return Err("is a symbolic link".into()),
            Ok(_) => {}
        }
        // O_NOFOLLOW: a link swapped in since is refused, not followed; O_NONBLOCK: a FIFO
        // cannot block the open. What is checked below is the file that was opened.
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|e| format!("cannot be opened ({e})"))?;
        let m = f.metadata().map_err(|e| format!("cannot be examined ({e})"))?;
        if let Some(why) = file_refusal(&m, self.uid) {
            return Err(why);
        }
        let mut bytes = Vec::with_capacity(m.len() as usize);
        f.read_to_end(&mut bytes).map_err(|e| format!("cannot be read ({e})"))?;
        Ok(Some(bytes))
    }

    /// Keep `bytes` under `name`, its SHA-256 under `name.sha256`. Failures only mean no
    /// disk cache.
    pub fn store(&self, name: &str, bytes: &[u8]) {
        let _ = self.write(&format!("{name}.sha256"), format!("{}\n", sha256_hex(bytes)).as_bytes())
            && self.write(name, bytes);
    }

    /// Remove the cubin kept under `name` and its hash file.
    pub fn remove(&self, name: &str) {
        let _ = std::fs::remove_file(self.dir.join(name));
        let _ = std::fs::remove_file(self.dir.join(format!("{name}.sha256")));
    }

    /// Write `data` to `name` through a new temporary file (0600, `O_EXCL`) and a rename.
    fn write(&self, name: &str, data: &[u8]) -> bool {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        use std::sync::atomic::{AtomicU64, Ordering};
        static SERIAL: AtomicU64 = AtomicU64::new(0);
        let tmp =
            self.dir.join(format!(".{name}.{}.{}.tmp", std::process::id(), SERIAL.fetch_add(1, Ordering::Relaxed)));
        let Ok(mut f) = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
        else {
            return false;
        };
        let ok = f.write_all(data).is_ok();
        drop(f);
        if ok && std::fs::rename(&tmp, self.dir.join(name)).is_ok() {
            return true;
        }
        let _ = std::fs::remove_file(&tmp);
        false
    }
}

#[cfg(not(unix))]
impl DiskCache {
    /// Off Unix there is no disk cache: ownership cannot be checked the same way.
    pub fn open(_dir: &Path) -> std::result::Result<DiskCache, String> {
        Err("the cubin cache needs Unix file ownership checks".into())
    }

    /// Nothing is kept off Unix.
    pub fn load(&self, _name: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        Ok(None)
    }

    /// Nothing is kept off Unix.
    pub fn store(&self, _name: &str, _bytes: &[u8]) {}

    /// Nothing is kept off Unix.
    pub fn remove(&self, _name: &str) {}
}

/// Compile `source` for `arch` without a device, with ptxas's resource report: the log
/// (`module`: which of its entry points, [`module_options`]).
pub fn compile_report(file: &str, source: &str, arch: &str, module: ModuleKind) -> Result<String> {
    let nv = nvrtc()?;
    let mut opts = module_options(arch, module);
    opts.push("--ptxas-options=-v".into());
    let (cubin, log) = nv.compile(file, source, &opts)?;
    let (maj, min) = nv.version();
    let mut report = format!("nvrtc {maj}.{min} ({})\n", nv.origin);
    // A developer reading the machine code (nvdisasm) asks for the cubin itself.
    if let Some(dir) = &crate::settings::get().cuda_cubin_dir {
        let path = Path::new(dir).join(format!("{}.{arch}.cubin", file.replace('/', "_")));
        std::fs::write(&path, &cubin)
            .map_err(|e| MlxError::Internal(format!("cannot write {}: {e}", path.display())))?;
        report.push_str(&format!("cubin {}\n", path.display()));
    }
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
    fn a_warning_is_printed_once_per_folder() {
        let key = Path::new("/nonexistent/mlx_native-warn-once-test");
        assert!(warn_once(key, "first (expected in this test)"));
        assert!(!warn_once(key, "second: must not be printed"));
    }

    #[test]
    fn sha256_is_the_standard_one() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    #[cfg(unix)]
    #[test]
    fn the_file_rule_names_what_fails() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        assert_eq!(writable_by(0o700), None);
        assert_eq!(writable_by(0o1777), Some("group and others"));
        assert_eq!(writable_by(0o620), Some("group"));
        assert_eq!(writable_by(0o602), Some("others"));
        let dir = std::env::temp_dir().join(format!("mlx_native-file-rule-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x");
        std::fs::write(&f, b"x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let m = std::fs::metadata(&f).unwrap();
        assert_eq!(file_refusal(&m, m.uid()), None);
        // Another user's file, whoever runs the test: the same file judged for another uid.
        let other = m.uid().wrapping_add(1);
        assert_eq!(file_refusal(&m, other), Some(format!("is owned by uid {}, not by uid {other}", m.uid())));
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(file_refusal(&std::fs::metadata(&f).unwrap(), m.uid()), None);
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o622)).unwrap();
        let why = file_refusal(&std::fs::metadata(&f).unwrap(), m.uid()).unwrap();
        assert_eq!(why, "is writable by group and others (mode 0622)");
        assert_eq!(file_refusal(&std::fs::metadata(&dir).unwrap(), m.uid()).unwrap(), "is not a regular file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn options_name_the_architecture() {
        assert_eq!(options("sm_90a")[0], "--gpu-architecture=sm_90a");
    }

    /// The paged K/V entry points are a module of their own, under its own cache key; the
    /// module every call loads is built without the define.
    #[test]
    fn only_the_paged_module_defines_its_entries() {
        let define = "-DMLXN_PAGED_ENTRIES=1".to_string();
        assert!(!options("sm_90a").contains(&define));
        assert_eq!(options("sm_80"), module_options("sm_80", ModuleKind::CONTIGUOUS));
        let paged = module_options("sm_90a", ModuleKind::PAGED);
        assert!(paged.contains(&define));
        assert_eq!(paged.iter().filter(|o| **o != define).cloned().collect::<Vec<_>>(), options("sm_90a"));
    }

    /// The quantised K/V entry points are modules of their own (contiguous and paged), each
    /// under its own cache key; no other module has the define, and the four modules' options
    /// differ only by their defines.
    #[test]
    fn only_the_quant_modules_define_their_entries() {
        let quant = "-DMLXN_QUANT_ENTRIES=1".to_string();
        let paged = "-DMLXN_PAGED_ENTRIES=1".to_string();
        for arch in ["sm_90a", "sm_80"] {
            let base = options(arch);
            assert!(!base.contains(&quant));
            assert!(!module_options(arch, ModuleKind::PAGED).contains(&quant));
            let q = module_options(arch, ModuleKind::QUANT);
            assert!(q.contains(&quant) && !q.contains(&paged));
            assert_eq!(q.iter().filter(|o| **o != quant).cloned().collect::<Vec<_>>(), base);
            let pq = module_options(arch, ModuleKind::PAGED_QUANT);
            assert!(pq.contains(&quant) && pq.contains(&paged));
            assert_eq!(pq.iter().filter(|o| **o != quant && **o != paged).cloned().collect::<Vec<_>>(), base);
            let all = [ModuleKind::CONTIGUOUS, ModuleKind::PAGED, ModuleKind::QUANT, ModuleKind::PAGED_QUANT];
            let distinct: std::collections::HashSet<Vec<String>> =
                all.iter().map(|&m| module_options(arch, m)).collect();
            assert_eq!(distinct.len(), 4, "each module its own options, so its own cache key");
        }
    }
}
