//! The CUDA libraries, loaded at run time with `dlopen` / `dlsym`: the driver
//! (`libcuda.so.1`), NVRTC and cuBLAS, of CUDA 12 or 13, whichever is there.
//!
//! Nothing here panics: a library that cannot be found, or that lacks one of
//! the functions the backend calls, is an error naming the library, the path
//! it was loaded from and the missing symbol. Only functions that both CUDA
//! 12 and CUDA 13 export under the same name and signature are declared (the
//! driver keeps every older entry point for compatibility; none of the
//! NVRTC and cuBLAS calls here changed between 12 and 13).
//!
//! Where a library is looked for, in order (first match wins; for NVRTC and
//! cuBLAS per major version, newest major first, and never a major newer
//! than the driver's). The driver (`libcuda.so.1`) is looked for the same
//! way:
//!
//! 1. the directories in `ENGRAM_CUDA_LIB_DIR` (colon-separated);
//! 2. a copy the process has already loaded (PyTorch's, the engine's own);
//! 3. the dynamic loader's search path (`LD_LIBRARY_PATH`, the ldconfig cache);
//! 4. NVIDIA's pip wheels: `nvidia/cu13/lib` (CUDA 13), `nvidia/cuda_nvrtc/lib`
//!    and `nvidia/cublas/lib` (CUDA 12) under every `site-packages` directory
//!    of an object the process has loaded (torch, ...), of `$VIRTUAL_ENV` and
//!    of `$CONDA_PREFIX`, and `$CONDA_PREFIX/lib`;
//! 5. `$CUDA_HOME`, `$CUDA_PATH`, `/usr/local/cuda`: `lib64` and
//!    `targets/x86_64-linux/lib`.
//!
//! Then the unversioned `libnvrtc.so` / `libcublas.so` the same way; its
//! version is read with `nvrtcVersion` / `cublasGetProperty`.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::PathBuf;
use std::sync::OnceLock;

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
/// The driver's stream object (opaque).
#[repr(C)]
pub struct CUstream_st {
    _opaque: [u8; 0],
}
pub type CUstream = *mut CUstream_st;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUgraph = *mut c_void;
pub type CUgraphExec = *mut c_void;
pub type nvrtcResult = c_int;
pub type nvrtcProgram = *mut c_void;
pub type cublasStatus_t = c_int;
pub type cublasHandle_t = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const NVRTC_SUCCESS: nvrtcResult = 0;
pub const CUBLAS_STATUS_SUCCESS: cublasStatus_t = 0;

pub const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: CUresult = 720;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NO_BINARY_FOR_GPU: CUresult = 209;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const CUDA_ERROR_LAUNCH_FAILED: CUresult = 719;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: c_int = 95;
pub const CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
pub const CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
pub const CU_MEMORYTYPE_HOST: u32 = 1;
pub const CU_MEMORYTYPE_DEVICE: u32 = 2;
pub const CU_MEMORYTYPE_ARRAY: u32 = 3;
pub const CU_MEMORYTYPE_UNIFIED: u32 = 4;
pub const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 2;
pub const CU_EVENT_DEFAULT: c_uint = 0;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
pub const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_GLOBAL: c_int = 0;
pub const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;

pub const CUBLAS_OP_N: c_int = 0;
pub const CUBLAS_OP_T: c_int = 1;
pub const CUDA_R_32F: c_int = 0;
pub const CUDA_R_16BF: c_int = 14;
pub const CUBLAS_COMPUTE_32F: c_int = 68;
pub const CUBLAS_COMPUTE_32F_PEDANTIC: c_int = 69;
pub const CUBLAS_GEMM_DEFAULT: c_int = -1;
pub const CUBLAS_DEFAULT_MATH: c_int = 0;
/// Split-K partial sums stay f32 (not rounded to the output type).
pub const CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION: c_int = 16;
/// `libraryPropertyType`: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL.
pub const MAJOR_VERSION: c_int = 0;
pub const MINOR_VERSION: c_int = 1;
pub const PATCH_LEVEL: c_int = 2;

/// CUDA major versions whose NVRTC and cuBLAS the backend loads, newest first.
pub const MAJORS: [i32; 2] = [13, 12];

/// A table of function pointers read from one library: `required` functions
/// must all be there (else the load fails naming the first one missing),
/// `optional` ones may be absent (`None`).
macro_rules! api {
    (
        $(#[$m:meta])* $name:ident {
            required { $( $f:ident : fn($($a:ty),*) -> $r:ty ; )* }
            optional { $( $o:ident : fn($($oa:ty),*) -> $or:ty ; )* }
        }
    ) => {
        $(#[$m])*
        pub struct $name {
            $( pub $f: unsafe extern "C" fn($($a),*) -> $r, )*
            $( pub $o: Option<unsafe extern "C" fn($($oa),*) -> $or>, )*
        }

        impl $name {
            /// Read every symbol from `lib` (what's missing is named in the error).
            fn load(lib: &Lib) -> Result<$name, String> {
                Ok($name {
                    // SAFETY: each symbol is the C function of that name, whose
                    // signature is the one declared here (the CUDA headers').
                    $( $f: unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($a),*) -> $r>(lib.sym(stringify!($f))?) }, )*
                    $( $o: lib.sym_opt(stringify!($o)).map(|p| {
                        // SAFETY: as the required ones: the symbol is the C function of that name,
                        // with the signature declared here (the CUDA headers').
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($oa),*) -> $or>(p) }
                    }), )*
                })
            }
        }
    };
}

api! {
    /// The driver API (`libcuda.so.1`).
    DriverApi {
        required {
            cuInit: fn(c_uint) -> CUresult;
            cuDriverGetVersion: fn(*mut c_int) -> CUresult;
            cuDeviceGetCount: fn(*mut c_int) -> CUresult;
            cuDeviceGet: fn(*mut CUdevice, c_int) -> CUresult;
            cuDeviceGetAttribute: fn(*mut c_int, c_int, CUdevice) -> CUresult;
            cuDeviceGetName: fn(*mut c_char, c_int, CUdevice) -> CUresult;
            cuDevicePrimaryCtxRetain: fn(*mut CUcontext, CUdevice) -> CUresult;
            cuDevicePrimaryCtxRelease_v2: fn(CUdevice) -> CUresult;
            cuCtxGetCurrent: fn(*mut CUcontext) -> CUresult;
            cuCtxSetCurrent: fn(CUcontext) -> CUresult;
            cuCtxSynchronize: fn() -> CUresult;
            cuMemAlloc_v2: fn(*mut CUdeviceptr, usize) -> CUresult;
            cuMemFree_v2: fn(CUdeviceptr) -> CUresult;
            cuMemHostAlloc: fn(*mut *mut c_void, usize, c_uint) -> CUresult;
            cuMemFreeHost: fn(*mut c_void) -> CUresult;
            cuMemHostGetDevicePointer_v2: fn(*mut CUdeviceptr, *mut c_void, c_uint) -> CUresult;
            cuMemHostGetFlags: fn(*mut c_uint, *mut c_void) -> CUresult;
            cuMemsetD8_v2: fn(CUdeviceptr, u8, usize) -> CUresult;
            cuMemcpyHtoD_v2: fn(CUdeviceptr, *const c_void, usize) -> CUresult;
            cuMemcpyDtoH_v2: fn(*mut c_void, CUdeviceptr, usize) -> CUresult;
            cuMemcpyHtoDAsync_v2: fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult;
            cuMemcpyDtoDAsync_v2: fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult;
            cuEventCreate: fn(*mut CUevent, c_uint) -> CUresult;
            cuEventDestroy_v2: fn(CUevent) -> CUresult;
            cuEventRecord: fn(CUevent, CUstream) -> CUresult;
            cuEventSynchronize: fn(CUevent) -> CUresult;
            cuPointerGetAttribute: fn(*mut c_void, c_int, CUdeviceptr) -> CUresult;
            cuMemGetAddressRange_v2: fn(*mut CUdeviceptr, *mut usize, CUdeviceptr) -> CUresult;
            cuStreamIsCapturing: fn(CUstream, *mut c_int) -> CUresult;
            cuStreamGetCtx: fn(CUstream, *mut CUcontext) -> CUresult;
            cuStreamSynchronize: fn(CUstream) -> CUresult;
            cuModuleLoadData: fn(*mut CUmodule, *const c_void) -> CUresult;
            cuModuleUnload: fn(CUmodule) -> CUresult;
            cuModuleGetFunction: fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
            cuLaunchKernel: fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void) -> CUresult;
            // The decode kernel (docs/cuda.md): its shared memory opt-in, its
            // occupancy and its cooperative launch.
            cuFuncSetAttribute: fn(CUfunction, c_int, c_int) -> CUresult;
            cuOccupancyMaxActiveBlocksPerMultiprocessor: fn(*mut c_int, CUfunction, c_int, usize) -> CUresult;
            cuLaunchCooperativeKernel: fn(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void) -> CUresult;
            cuGetErrorName: fn(CUresult, *mut *const c_char) -> CUresult;
            cuGetErrorString: fn(CUresult, *mut *const c_char) -> CUresult;
            // The cuBLAS handle's own blocking stream (cuda::blas::RealBlas).
            cuStreamCreate: fn(*mut CUstream, c_uint) -> CUresult;
            cuStreamDestroy_v2: fn(CUstream) -> CUresult;
            // The backend's own stream (set_layer, read_back): no legacy
            // stream, no context-wide synchronisation.
            cuStreamWaitEvent: fn(CUstream, CUevent, c_uint) -> CUresult;
            cuMemsetD8Async: fn(CUdeviceptr, u8, usize, CUstream) -> CUresult;
            cuMemcpyDtoHAsync_v2: fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult;
        }
        optional {
            // CUDA 12.5+: the context of a stream of a green context too
            // (cuStreamGetCtx refuses those); second argument a CUgreenCtx.
            cuStreamGetCtx_v2: fn(CUstream, *mut CUcontext, *mut *mut c_void) -> CUresult;
            // Tests and benchmarks only.
            cuStreamBeginCapture_v2: fn(CUstream, c_int) -> CUresult;
            cuStreamEndCapture: fn(CUstream, *mut CUgraph) -> CUresult;
            cuGraphInstantiateWithFlags: fn(*mut CUgraphExec, CUgraph, u64) -> CUresult;
            cuGraphLaunch: fn(CUgraphExec, CUstream) -> CUresult;
            cuGraphExecDestroy: fn(CUgraphExec) -> CUresult;
            cuGraphDestroy: fn(CUgraph) -> CUresult;
            cuEventElapsedTime: fn(*mut f32, CUevent, CUevent) -> CUresult;
            cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> CUresult;
        }
    }
}

api! {
    /// NVRTC (`libnvrtc.so.12` / `.13`).
    NvrtcApi {
        required {
            nvrtcVersion: fn(*mut c_int, *mut c_int) -> nvrtcResult;
            nvrtcGetErrorString: fn(nvrtcResult) -> *const c_char;
            nvrtcCreateProgram: fn(*mut nvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> nvrtcResult;
            nvrtcCompileProgram: fn(nvrtcProgram, c_int, *const *const c_char) -> nvrtcResult;
            nvrtcDestroyProgram: fn(*mut nvrtcProgram) -> nvrtcResult;
            nvrtcGetProgramLogSize: fn(nvrtcProgram, *mut usize) -> nvrtcResult;
            nvrtcGetProgramLog: fn(nvrtcProgram, *mut c_char) -> nvrtcResult;
            nvrtcGetPTXSize: fn(nvrtcProgram, *mut usize) -> nvrtcResult;
            nvrtcGetPTX: fn(nvrtcProgram, *mut c_char) -> nvrtcResult;
            nvrtcGetCUBINSize: fn(nvrtcProgram, *mut usize) -> nvrtcResult;
            nvrtcGetCUBIN: fn(nvrtcProgram, *mut c_char) -> nvrtcResult;
            nvrtcGetNumSupportedArchs: fn(*mut c_int) -> nvrtcResult;
            nvrtcGetSupportedArchs: fn(*mut c_int) -> nvrtcResult;
        }
        optional {}
    }
}

api! {
    /// cuBLAS (`libcublas.so.12` / `.13`).
    CublasApi {
        required {
            cublasCreate_v2: fn(*mut cublasHandle_t) -> cublasStatus_t;
            cublasDestroy_v2: fn(cublasHandle_t) -> cublasStatus_t;
            cublasSetStream_v2: fn(cublasHandle_t, CUstream) -> cublasStatus_t;
            cublasSetWorkspace_v2: fn(cublasHandle_t, *mut c_void, usize) -> cublasStatus_t;
            cublasSetMathMode: fn(cublasHandle_t, c_int) -> cublasStatus_t;
            cublasGetProperty: fn(c_int, *mut c_int) -> cublasStatus_t;
            cublasGetStatusString: fn(cublasStatus_t) -> *const c_char;
            cublasGemmEx: fn(cublasHandle_t, c_int, c_int, c_int, c_int, c_int, *const c_void, *const c_void, c_int, c_int, *const c_void, c_int, c_int, *const c_void, *mut c_void, c_int, c_int, c_int, c_int) -> cublasStatus_t;
        }
        optional {}
    }
}

/// A library opened with `dlopen` (never closed: its functions stay valid for
/// the process).
struct Lib {
    handle: *mut c_void,
    /// Where it was loaded from.
    path: String,
}

impl Lib {
    fn sym_opt(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    fn sym(&self, name: &str) -> Result<*mut c_void, String> {
        self.sym_opt(name)
            .ok_or_else(|| format!("{} lacks the function {name}", self.path))
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string owned by libc.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".into()
        } else {
            CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// The path a loaded library's handle came from (its `l_name`).
fn handle_path(handle: *mut c_void, fallback: &str) -> String {
    #[repr(C)]
    struct LinkMap {
        l_addr: usize,
        l_name: *const c_char,
    }
    let mut map: *mut LinkMap = std::ptr::null_mut();
    // SAFETY: RTLD_DI_LINKMAP writes a `struct link_map *` for a live handle;
    // its first two fields are `l_addr` and `l_name` on every glibc.
    let r = unsafe {
        libc::dlinfo(
            handle,
            libc::RTLD_DI_LINKMAP,
            &mut map as *mut *mut LinkMap as *mut c_void,
        )
    };
    if r != 0 || map.is_null() {
        return fallback.to_string();
    }
    // SAFETY: glibc's link map entry, alive while the library is loaded.
    let name = unsafe { (*map).l_name };
    if name.is_null() {
        return fallback.to_string();
    }
    // SAFETY: a NUL-terminated string owned by the dynamic loader.
    let s = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    if s.is_empty() {
        fallback.to_string()
    } else {
        s
    }
}

fn dlopen(name: &str, flags: c_int) -> Result<Lib, String> {
    let c = CString::new(name).map_err(|_| format!("{name}: bad name"))?;
    // SAFETY: plain dlopen on a NUL-terminated name.
    let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
    if h.is_null() {
        return Err(dl_error());
    }
    Ok(Lib {
        handle: h,
        path: handle_path(h, name),
    })
}

/// Directories of NVIDIA's pip wheels and toolkits worth trying (see the
/// module documentation), existing ones only, without duplicates.
fn candidate_dirs() -> Vec<PathBuf> {
    let env = |v: &str| std::env::var_os(v).map(PathBuf::from);
    let homes: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| env(v))
        .collect();
    search_dirs(
        &loaded_object_paths(),
        env("VIRTUAL_ENV").as_deref(),
        env("CONDA_PREFIX").as_deref(),
        &homes,
    )
}

/// [`candidate_dirs`] from its inputs: the paths of the loaded objects, the
/// virtual environment and conda prefix, and the toolkit homes (before
/// `/usr/local/cuda`).
pub fn search_dirs(
    loaded: &[String],
    virtual_env: Option<&std::path::Path>,
    conda_prefix: Option<&std::path::Path>,
    cuda_homes: &[PathBuf],
) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let mut site = Vec::new();
    for p in loaded {
        if let Some(i) = p.find("/site-packages/") {
            site.push(PathBuf::from(&p[..i + "/site-packages".len()]));
        }
    }
    for (prefix, conda) in [(virtual_env, false), (conda_prefix, true)] {
        let Some(prefix) = prefix else { continue };
        let lib = prefix.join("lib");
        if let Ok(rd) = std::fs::read_dir(&lib) {
            let mut pys: Vec<PathBuf> = rd
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
                .map(|e| e.path().join("site-packages"))
                .collect();
            pys.sort();
            site.extend(pys);
        }
        if conda {
            dirs.push(lib);
        }
    }
    for s in site {
        for sub in [
            "nvidia/cu13/lib",
            "nvidia/cuda_nvrtc/lib",
            "nvidia/cublas/lib",
        ] {
            dirs.push(s.join(sub));
        }
    }
    let mut homes = cuda_homes.to_vec();
    homes.push(PathBuf::from("/usr/local/cuda"));
    for h in homes {
        dirs.push(h.join("lib64"));
        dirs.push(h.join("targets/x86_64-linux/lib"));
    }
    let mut out: Vec<PathBuf> = Vec::new();
    for d in dirs {
        if d.is_dir() && !out.contains(&d) {
            out.push(d);
        }
    }
    out
}

/// Paths of every object loaded in the process.
fn loaded_object_paths() -> Vec<String> {
    unsafe extern "C" fn cb(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the Vec passed below; `info` is the loader's
        // entry, valid during the callback.
        unsafe {
            let v = &mut *(data as *mut Vec<String>);
            let name = (*info).dlpi_name;
            if !name.is_null() {
                let s = CStr::from_ptr(name).to_string_lossy().into_owned();
                if !s.is_empty() {
                    v.push(s);
                }
            }
        }
        0
    }
    let mut v: Vec<String> = Vec::new();
    // SAFETY: the callback only reads the entries and appends to `v`.
    unsafe { libc::dl_iterate_phdr(Some(cb), &mut v as *mut Vec<String> as *mut c_void) };
    v
}

/// Open the first loadable of `names`, trying the places in the module
/// documentation in order. Returns the library or every place tried.
fn find(names: &[String]) -> Result<Lib, String> {
    let mut tried = Vec::new();
    let env_dirs: Vec<PathBuf> = std::env::var_os("ENGRAM_CUDA_LIB_DIR")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    let flags = libc::RTLD_NOW | libc::RTLD_LOCAL;
    for name in names {
        for d in &env_dirs {
            let p = d.join(name);
            if p.exists() {
                match dlopen(&p.to_string_lossy(), flags) {
                    Ok(l) => return Ok(l),
                    Err(e) => tried.push(e),
                }
            }
        }
        if let Ok(l) = dlopen(name, flags | libc::RTLD_NOLOAD) {
            return Ok(l);
        }
        match dlopen(name, flags) {
            Ok(l) => return Ok(l),
            Err(e) => tried.push(e),
        }
        for d in candidate_dirs() {
            let p = d.join(name);
            if p.exists() {
                match dlopen(&p.to_string_lossy(), flags) {
                    Ok(l) => return Ok(l),
                    Err(e) => tried.push(e),
                }
            }
        }
    }
    Err(format!(
        "none of {} could be loaded ({})",
        names.join(", "),
        if tried.is_empty() {
            "not found".to_string()
        } else {
            tried.join("; ")
        }
    ))
}

/// `(major, minor, patch)`.
pub type Version = (i32, i32, i32);

/// A loaded library: its functions, where it came from, its version.
pub struct Loaded<T> {
    pub api: T,
    pub path: String,
    /// `(major, minor, patch)` as the library reports it.
    pub version: (i32, i32, i32),
}

// SAFETY: function pointers into a library that stays loaded; no state.
unsafe impl<T> Send for Loaded<T> {}
// SAFETY: Sync for the reason Send is above: only function pointers into a
// library that stays loaded and fields never mutated after the load.
unsafe impl<T> Sync for Loaded<T> {}

/// The driver API, loaded once per process.
pub fn driver() -> Result<&'static Loaded<DriverApi>, String> {
    static D: OnceLock<Result<Loaded<DriverApi>, String>> = OnceLock::new();
    D.get_or_init(|| {
        // Looked for like the toolkit libraries (ENGRAM_CUDA_LIB_DIR first);
        // a library found there that lacks a driver function is an error
        // naming its path, not a silent fall back to another driver.
        let lib = find(&["libcuda.so.1".to_string()]).map_err(|e| {
            format!("no CUDA driver: {e}; the CUDA backend needs the NVIDIA driver")
        })?;
        let mut api = DriverApi::load(&lib)?;
        if api.cuEventElapsedTime.is_none() {
            // CUDA 12.8 added a _v2 of the same signature; a driver could
            // drop the old name one day (benchmarks only).
            api.cuEventElapsedTime = lib.sym_opt("cuEventElapsedTime_v2").map(|p| {
                // SAFETY: cuEventElapsedTime_v2(float *ms, CUevent start, CUevent end).
                unsafe {
                    std::mem::transmute::<
                        *mut c_void,
                        unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult,
                    >(p)
                }
            });
        }
        let mut v = 0;
        // SAFETY: cuDriverGetVersion needs no initialisation; `v` is a local.
        let r = unsafe { (api.cuDriverGetVersion)(&mut v) };
        if r != CUDA_SUCCESS {
            return Err(format!("cuDriverGetVersion failed ({r})"));
        }
        Ok(Loaded {
            api,
            path: lib.path,
            version: (v / 1000, (v % 1000) / 10, 0),
        })
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// The newest CUDA major the loaded driver supports, if there is a driver.
fn driver_major() -> Option<i32> {
    driver().ok().map(|d| d.version.0)
}

/// Load one of a toolkit library's versions: `lib` ("nvrtc", "cublas") of
/// the newest major in [`MAJORS`] that the driver supports (any without a
/// driver), then the unversioned name; `version` reads the loaded version.
fn toolkit<T>(
    lib: &str,
    load: fn(&Lib) -> Result<T, String>,
    version: fn(&T) -> Result<Version, String>,
) -> Result<Loaded<T>, String> {
    let max = driver_major();
    let majors: Vec<i32> = MAJORS
        .iter()
        .copied()
        .filter(|m| max.is_none_or(|d| *m <= d))
        .collect();
    let mut names: Vec<String> = majors.iter().map(|m| format!("lib{lib}.so.{m}")).collect();
    names.push(format!("lib{lib}.so"));
    let mut errors = Vec::new();
    for name in &names {
        let l = match find(std::slice::from_ref(name)) {
            Ok(l) => l,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let api = match load(&l) {
            Ok(a) => a,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let v = match version(&api) {
            Ok(v) => v,
            Err(e) => {
                errors.push(format!("{}: {e}", l.path));
                continue;
            }
        };
        if let Some(d) = max {
            if v.0 > d {
                errors.push(format!(
                    "{} is CUDA {}.{}, newer than the driver's CUDA {d}",
                    l.path, v.0, v.1
                ));
                continue;
            }
        }
        return Ok(Loaded {
            api,
            path: l.path,
            version: v,
        });
    }
    Err(errors.join("; "))
}

/// NVRTC, loaded once per process (see the module documentation).
pub fn nvrtc() -> Result<&'static Loaded<NvrtcApi>, String> {
    static N: OnceLock<Result<Loaded<NvrtcApi>, String>> = OnceLock::new();
    N.get_or_init(|| {
        toolkit("nvrtc", NvrtcApi::load, |a| {
            let (mut x, mut y) = (0, 0);
            // SAFETY: locals as out-pointers.
            let r = unsafe { (a.nvrtcVersion)(&mut x, &mut y) };
            if r != NVRTC_SUCCESS {
                return Err(format!("nvrtcVersion failed ({r})"));
            }
            Ok((x, y, 0))
        })
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// cuBLAS, loaded once per process (see the module documentation).
pub fn cublas() -> Result<&'static Loaded<CublasApi>, String> {
    static B: OnceLock<Result<Loaded<CublasApi>, String>> = OnceLock::new();
    B.get_or_init(|| {
        toolkit("cublas", CublasApi::load, |a| {
            let mut v = [0; 3];
            for (i, p) in [MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL]
                .iter()
                .enumerate()
            {
                // SAFETY: a local as the out-pointer; no handle needed.
                let r = unsafe { (a.cublasGetProperty)(*p, &mut v[i]) };
                if r != CUBLAS_STATUS_SUCCESS {
                    return Err(format!("cublasGetProperty failed ({r})"));
                }
            }
            Ok((v[0], v[1], v[2]))
        })
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// Where the loaded libraries are, for messages: `"driver 13.0 (path), NVRTC
/// 13.0 (path), cuBLAS 13.0.2 (path)"`, each as far as it loaded.
pub fn describe() -> String {
    let mut parts = Vec::new();
    match driver() {
        Ok(d) => parts.push(format!(
            "driver CUDA {}.{} ({})",
            d.version.0, d.version.1, d.path
        )),
        Err(e) => parts.push(e),
    }
    if let Ok(n) = nvrtc() {
        parts.push(format!(
            "NVRTC {}.{} ({})",
            n.version.0, n.version.1, n.path
        ));
    }
    if let Ok(b) = cublas() {
        parts.push(format!(
            "cuBLAS {}.{}.{} ({})",
            b.version.0, b.version.1, b.version.2, b.path
        ));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pip_wheels_are_found_from_a_venv_and_from_loaded_objects() {
        let root = std::env::temp_dir().join(format!("engram-sys-{}", std::process::id()));
        let venv = root.join("venv");
        let sp = venv.join("lib/python3.12/site-packages");
        for d in ["nvidia/cu13/lib", "nvidia/cublas/lib", "torch/lib"] {
            std::fs::create_dir_all(sp.join(d)).unwrap();
        }
        let other = root.join("other/lib/python3.11/site-packages/nvidia/cuda_nvrtc/lib");
        std::fs::create_dir_all(&other).unwrap();
        let home = root.join("cuda");
        std::fs::create_dir_all(home.join("targets/x86_64-linux/lib")).unwrap();
        let loaded = vec![format!(
            "{}/torch/lib/libtorch_cuda.so",
            root.join("other/lib/python3.11/site-packages").display()
        )];
        let dirs = search_dirs(&loaded, Some(&venv), None, std::slice::from_ref(&home));
        let want = [
            other.clone(),
            sp.join("nvidia/cu13/lib"),
            sp.join("nvidia/cublas/lib"),
            home.join("targets/x86_64-linux/lib"),
        ];
        let found: Vec<&PathBuf> = dirs.iter().filter(|d| d.starts_with(&root)).collect();
        assert_eq!(found, want.iter().collect::<Vec<_>>(), "{dirs:?}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn a_missing_library_is_an_error_that_names_what_was_tried() {
        let e = match find(&["libengram_no_such_cuda_lib.so.13".to_string()]) {
            Ok(_) => panic!("loaded a library that does not exist"),
            Err(e) => e,
        };
        assert!(e.contains("libengram_no_such_cuda_lib.so.13"), "{e}");
    }

    #[test]
    fn a_library_without_a_symbol_is_an_error_naming_it() {
        // libc is loaded in every process and lacks cuInit.
        let lib = dlopen("libc.so.6", libc::RTLD_NOW | libc::RTLD_LOCAL).unwrap();
        let e = match DriverApi::load(&lib) {
            Ok(_) => panic!("libc has the driver API?"),
            Err(e) => e,
        };
        assert!(e.contains("lacks the function cuInit"), "{e}");
        assert!(e.contains("libc"), "{e}");
    }
}
