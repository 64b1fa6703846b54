//! The CUDA driver API (`libcuda.so.1`), loaded at run time: the few entry points the
//! backend uses, resolved once per process. Nothing here links against CUDA, so the
//! library builds and runs on machines without it.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use libloading::Library;

use crate::error::{MlxError, Result};

pub type CuResult = c_int;
pub type CuDevice = c_int;
pub type CuContext = *mut c_void;
pub type CuModule = *mut c_void;
pub type CuFunction = *mut c_void;
pub type CuStream = *mut c_void;
pub type CuDevicePtr = u64;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_NOT_FOUND: CuResult = 500;

// CUdevice_attribute
pub const ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
pub const ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const ATTR_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
// CUfunction_attribute
pub const FUNC_MAX_THREADS_PER_BLOCK: c_int = 0;
pub const FUNC_LOCAL_SIZE_BYTES: c_int = 3;
pub const FUNC_NUM_REGS: c_int = 4;
pub const FUNC_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
// CUpointer_attribute
pub const POINTER_MEMORY_TYPE: c_int = 2;
pub const POINTER_DEVICE_ORDINAL: c_int = 9;
pub const POINTER_RANGE_START_ADDR: c_int = 11;
pub const POINTER_RANGE_SIZE: c_int = 12;
// CUmemorytype
pub const MEMORYTYPE_DEVICE: c_uint = 2;
pub const MEMORYTYPE_UNIFIED: c_uint = 4;
/// `CU_STREAM_NON_BLOCKING`: no implicit ordering with the legacy default stream.
pub const STREAM_NON_BLOCKING: c_uint = 1;

/// A `CUtensorMap`: 128 opaque bytes, 64-byte aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TensorMap(pub [u64; 16]);

/// `cuTensorMapEncodeTiled(map, dtype, rank, address, dims, strides, box, element strides,
/// interleave, swizzle, L2 promotion, out-of-bounds fill)`.
pub type TensorMapEncodeTiled = unsafe extern "C" fn(
    *mut TensorMap,
    c_int,
    u32,
    *mut c_void,
    *const u64,
    *const u64,
    *const u32,
    *const u32,
    c_int,
    c_int,
    c_int,
    c_int,
) -> CuResult;
// CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion
pub const TENSOR_MAP_FLOAT16: c_int = 6;
pub const TENSOR_MAP_SWIZZLE_64B: c_int = 2;
pub const TENSOR_MAP_SWIZZLE_128B: c_int = 3;
pub const TENSOR_MAP_L2_256B: c_int = 3;

macro_rules! driver_api {
    ($($name:ident : fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// Entry points of the driver, resolved from `libcuda.so.1`.
        #[allow(non_snake_case)]
        pub struct Driver {
            _lib: Library,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            /// `cuTensorMapEncodeTiled` (CUDA 12 and later drivers), if this one has it.
            pub cuTensorMapEncodeTiled: Option<TensorMapEncodeTiled>,
        }

        impl Driver {
            #[allow(non_snake_case)]
            fn load(lib: Library) -> std::result::Result<Self, String> {
                // SAFETY: each symbol is looked up by its documented name and given the
                // signature of the CUDA driver API (cuda.h); the library stays loaded in
                // `_lib` for as long as the pointers live.
                unsafe {
                    $(
                        let $name = *lib
                            .get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!(stringify!($name), "\0").as_bytes(),
                            )
                            .map_err(|e| format!("{}: {e}", stringify!($name)))?;
                    )*
                    let cuTensorMapEncodeTiled =
                        lib.get::<TensorMapEncodeTiled>(b"cuTensorMapEncodeTiled\0").ok().map(|f| *f);
                    Ok(Driver { _lib: lib, $($name,)* cuTensorMapEncodeTiled })
                }
            }
        }
    };
}

driver_api! {
    cuInit: fn(c_uint) -> CuResult;
    cuDriverGetVersion: fn(*mut c_int) -> CuResult;
    cuDeviceGetCount: fn(*mut c_int) -> CuResult;
    cuDeviceGet: fn(*mut CuDevice, c_int) -> CuResult;
    cuDeviceGetName: fn(*mut c_char, c_int, CuDevice) -> CuResult;
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CuDevice) -> CuResult;
    cuDevicePrimaryCtxRetain: fn(*mut CuContext, CuDevice) -> CuResult;
    cuCtxSetCurrent: fn(CuContext) -> CuResult;
    cuStreamCreate: fn(*mut CuStream, c_uint) -> CuResult;
    cuStreamSynchronize: fn(CuStream) -> CuResult;
    cuMemAlloc_v2: fn(*mut CuDevicePtr, usize) -> CuResult;
    cuMemFree_v2: fn(CuDevicePtr) -> CuResult;
    cuMemcpyHtoDAsync_v2: fn(CuDevicePtr, *const c_void, usize, CuStream) -> CuResult;
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, CuDevicePtr, usize, CuStream) -> CuResult;
    cuMemsetD8Async: fn(CuDevicePtr, u8, usize, CuStream) -> CuResult;
    cuModuleLoadData: fn(*mut CuModule, *const c_void) -> CuResult;
    cuModuleGetFunction: fn(*mut CuFunction, CuModule, *const c_char) -> CuResult;
    cuFuncSetAttribute: fn(CuFunction, c_int, c_int) -> CuResult;
    cuFuncGetAttribute: fn(*mut c_int, c_int, CuFunction) -> CuResult;
    cuLaunchKernel: fn(
        CuFunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CuStream,
        *mut *mut c_void, *mut *mut c_void
    ) -> CuResult;
    cuPointerGetAttribute: fn(*mut c_void, c_int, CuDevicePtr) -> CuResult;
    cuGetErrorName: fn(CuResult, *mut *const c_char) -> CuResult;
    cuGetErrorString: fn(CuResult, *mut *const c_char) -> CuResult;
}

// SAFETY: the driver API is thread-safe; the struct holds only function pointers and the
// library handle.
unsafe impl Send for Driver {}
unsafe impl Sync for Driver {}

/// Names tried, in order.
const LIBRARY_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so", "nvcuda.dll"];

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
/// The process that initialised the driver.
static INIT_PID: OnceLock<u32> = OnceLock::new();

/// The driver, loaded and initialised (`cuInit`) once; `BackendUnavailable` with the
/// reason when this machine has none, or when this process is a `fork()` child of the one
/// that initialised it (CUDA's rule: a child cannot use its parent's CUDA state, and calls
/// into it fail or hang).
pub fn driver() -> Result<&'static Driver> {
    if INIT_PID.get().is_some_and(|&pid| pid != std::process::id()) {
        return Err(MlxError::BackendUnavailable(
            "CUDA was initialised in this process's parent before it forked, and a forked child cannot use \
             CUDA: start worker processes with the 'spawn' method (multiprocessing.set_start_method('spawn'), \
             or torch.multiprocessing), or use the CPU backend (device='cpu') in the child"
                .into(),
        ));
    }
    DRIVER
        .get_or_init(|| {
            let mut tried = Vec::new();
            for name in LIBRARY_NAMES {
                // SAFETY: loading the CUDA driver runs its initialisers, which have no
                // preconditions.
                match unsafe { Library::new(name) } {
                    Ok(lib) => {
                        let d = Driver::load(lib).map_err(|e| format!("the CUDA driver {name} lacks {e}"))?;
                        // SAFETY: cuInit takes flags 0.
                        let r = unsafe { (d.cuInit)(0) };
                        if r != CUDA_SUCCESS {
                            return Err(format!("cuInit failed: {}", d.error_text(r)));
                        }
                        let _ = INIT_PID.set(std::process::id());
                        return Ok(d);
                    }
                    Err(e) => tried.push(format!("{name}: {e}")),
                }
            }
            Err(format!("no CUDA driver could be loaded ({})", tried.join("; ")))
        })
        .as_ref()
        .map_err(|e| MlxError::BackendUnavailable(e.clone()))
}

impl Driver {
    /// `CUDA_ERROR_NAME: description` of a driver status.
    pub fn error_text(&self, r: CuResult) -> String {
        let mut name: *const c_char = std::ptr::null();
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: both calls write a pointer to a static string (or leave it null).
        unsafe {
            (self.cuGetErrorName)(r, &mut name);
            (self.cuGetErrorString)(r, &mut text);
        }
        let s = |p: *const c_char| {
            if p.is_null() {
                None
            } else {
                // SAFETY: the driver returns NUL-terminated static strings.
                Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            }
        };
        match (s(name), s(text)) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            (Some(n), None) => n,
            _ => format!("CUDA error {r}"),
        }
    }

    /// `Ok` on success, else the error `wrap` makes of "`what`: <driver text>".
    pub fn check(&self, r: CuResult, what: &str, wrap: fn(String) -> MlxError) -> Result<()> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(wrap(format!("{what}: {}", self.error_text(r))))
        }
    }
}
