//! The kernels in `kernels/`, compiled with NVRTC (loaded at run time) to the
//! device's own SASS (a cubin), once per process and architecture, and loaded
//! once per context.

use super::driver::{self, check};
use crate::error::{bail, EngramStatus, Error, Result};
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nv;
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// Every kernel source, as NVRTC sees it: `(include name, text)`.
pub const SOURCES: [(&str, &str); 4] = [
    (
        "engram_common.cuh",
        include_str!("../../kernels/engram_common.cuh"),
    ),
    ("gather.cu", include_str!("../../kernels/gather.cu")),
    ("gate.cu", include_str!("../../kernels/gate.cu")),
    ("gemv.cu", include_str!("../../kernels/gemv.cu")),
];

/// The translation unit of the module the backend loads.
pub const MODULE_MAIN: &str =
    "#include \"gather.cu\"\n#include \"gate.cu\"\n#include \"gemv.cu\"\n";

/// The options every compile uses besides the architecture and [`defines`].
/// No `--use_fast_math` and no `--ftz`: f32 subnormals and IEEE division and
/// square root, so the dequantisation is exact and the gate matches the CPU's
/// formula.
pub const OPTIONS: [&str; 3] = ["--std=c++17", "--fmad=true", "-lineinfo"];

/// The constants the kernels share with Rust, as `-D` options: the type
/// numbers and block sizes ([`crate::formats`]), the error-latch codes
/// ([`super::latch`]), and the launch shapes below. The kernel sources define
/// none of them, so a build without these options fails to compile.
pub fn defines() -> Vec<String> {
    use crate::formats::{EngramType, FP8_SCALE_BLOCK};
    let mut v = Vec::new();
    for t in EngramType::ALL {
        let name = t.name().to_uppercase();
        v.push(format!("-DENG_{name}={}u", t as u32));
        if let Some((values, bytes)) = t.block() {
            v.push(format!("-DENG_{name}_BLOCK={values}u"));
            v.push(format!("-DENG_{name}_BLOCK_BYTES={bytes}u"));
        }
    }
    v.push(format!("-DENG_FP8_SCALE_BLOCK={FP8_SCALE_BLOCK}u"));
    v.extend(super::latch::LatchCode::defines());
    v.push(format!("-DENG_GATHER_THREADS={GATHER_THREADS}"));
    v.push(format!("-DENG_GATE_THREADS={GATE_THREADS}"));
    v.push(format!("-DENG_GEMV_THREADS={GEMV_THREADS}"));
    v.push(format!("-DENG_GEMV_ROWS={GEMV_ROWS_PER_WARP}"));
    v.push(format!("-DENG_GEMV_MAX={GEMV_MAX}"));
    v
}

/// What NVRTC produced: the cubin (or PTX) and its log.
pub struct Compiled {
    pub image: Vec<u8>,
    pub log: String,
}

/// Check that NVRTC can be loaded (cudarc panics otherwise).
pub fn check_nvrtc_library() -> Result<String> {
    driver::find_library("nvrtc").map_err(|e| {
        Error::new(
            EngramStatus::ErrDevice,
            format!(
                "NVRTC (libnvrtc) cannot be loaded: {e}; the CUDA backend compiles its kernels at run time \
                 (install the CUDA toolkit's libnvrtc, or the nvidia-cuda-nvrtc-cu12 wheel's lib/ on the loader path)"
            ),
        )
    })
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    check_nvrtc_library()?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: libnvrtc loads (checked); locals as out-pointers.
    let r = unsafe { nv::nvrtcVersion(&mut a, &mut b) };
    nv_check(r, "nvrtcVersion")?;
    Ok((a, b))
}

fn nv_check(r: nv::nvrtcResult, what: &str) -> Result<()> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: libnvrtc is loaded; the string is static.
    let s = unsafe {
        let p = nv::nvrtcGetErrorString(r);
        if p.is_null() {
            format!("{r:?}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    Err(Error::new(EngramStatus::ErrDevice, format!("{what}: {s}")))
}

/// Compile `main` (with every file of [`SOURCES`] available to `#include`) for
/// `arch` (`"sm_90"`: a cubin; `"compute_90"`: PTX). A compile error is
/// `ErrDevice` with NVRTC's log; warnings come back in [`Compiled::log`].
pub fn compile_source(main: &str, name: &str, arch: &str) -> Result<Compiled> {
    check_nvrtc_library()?;
    let src = CString::new(main).expect("no NUL in kernel source");
    let cname = CString::new(name).expect("no NUL in name");
    let hdr_src: Vec<CString> = SOURCES
        .iter()
        .map(|(_, s)| CString::new(*s).expect("no NUL"))
        .collect();
    let hdr_name: Vec<CString> = SOURCES
        .iter()
        .map(|(n, _)| CString::new(*n).expect("no NUL"))
        .collect();
    let hs: Vec<*const c_char> = hdr_src.iter().map(|s| s.as_ptr()).collect();
    let hn: Vec<*const c_char> = hdr_name.iter().map(|s| s.as_ptr()).collect();
    let mut opts: Vec<CString> = vec![CString::new(format!("--gpu-architecture={arch}")).unwrap()];
    opts.extend(OPTIONS.iter().map(|o| CString::new(*o).unwrap()));
    opts.extend(defines().into_iter().map(|o| CString::new(o).unwrap()));
    let op: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: every pointer is a live CString for the duration of the calls;
    // the program is destroyed on every path.
    unsafe {
        let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
        nv_check(
            nv::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                hs.len() as i32,
                hs.as_ptr(),
                hn.as_ptr(),
            ),
            "nvrtcCreateProgram",
        )?;
        let res = (|| {
            let rc = nv::nvrtcCompileProgram(prog, op.len() as i32, op.as_ptr());
            let mut n = 0usize;
            nv_check(
                nv::nvrtcGetProgramLogSize(prog, &mut n),
                "nvrtcGetProgramLogSize",
            )?;
            let mut log = vec![0 as c_char; n.max(1)];
            nv_check(
                nv::nvrtcGetProgramLog(prog, log.as_mut_ptr()),
                "nvrtcGetProgramLog",
            )?;
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            if rc != nv::nvrtcResult::NVRTC_SUCCESS {
                bail!(
                    ErrDevice,
                    "NVRTC could not compile the engram kernels for {arch}: {rc:?}\n{log}"
                );
            }
            let image = if arch.starts_with("sm_") {
                let mut n = 0usize;
                nv_check(nv::nvrtcGetCUBINSize(prog, &mut n), "nvrtcGetCUBINSize")?;
                let mut v = vec![0u8; n];
                nv_check(
                    nv::nvrtcGetCUBIN(prog, v.as_mut_ptr() as *mut c_char),
                    "nvrtcGetCUBIN",
                )?;
                v
            } else {
                let mut n = 0usize;
                nv_check(nv::nvrtcGetPTXSize(prog, &mut n), "nvrtcGetPTXSize")?;
                let mut v = vec![0u8; n];
                nv_check(
                    nv::nvrtcGetPTX(prog, v.as_mut_ptr() as *mut c_char),
                    "nvrtcGetPTX",
                )?;
                v
            };
            Ok(Compiled { image, log })
        })();
        let _ = nv::nvrtcDestroyProgram(&mut prog);
        res
    }
}

/// The backend's module for `arch`, compiled once per process.
pub fn module_image(arch: &str) -> Result<Arc<Vec<u8>>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Vec<u8>>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(img) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(arch) {
        return Ok(img.clone());
    }
    let c = compile_source(MODULE_MAIN, "engram_kernels.cu", arch)?;
    let img = Arc::new(c.image);
    cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(arch.to_string(), img.clone());
    Ok(img)
}

/// The loaded module and its functions.
pub struct Module {
    module: sys::CUmodule,
    ctx: sys::CUcontext,
    pub gather: sys::CUfunction,
    /// `engram_gather_split`: the gather of a split fp8 table (codes and scales
    /// in two arrays).
    pub gather_split: sys::CUfunction,
    /// `[highway f32/bf16][kv bf16/f32]`: gate_f32_bf16, gate_f32_f32, gate_bf16_bf16, gate_bf16_f32.
    pub gate: [[sys::CUfunction; 2]; 2],
    /// `gemv[n - 1]` for n = 1..=GEMV_MAX tokens.
    pub gemv: [sys::CUfunction; GEMV_MAX],
}

/// Most tokens the GEMV kernels take (`engram_gemv_bf16_1` ... `_8`).
pub const GEMV_MAX: usize = 8;
/// Threads of a gather / gate / GEMV block, and output rows per GEMV warp
/// (passed to the kernels by [`defines`]).
pub const GATHER_THREADS: u32 = 256;
pub const GATE_THREADS: u32 = 256;
pub const GEMV_THREADS: u32 = 256;
pub const GEMV_ROWS_PER_WARP: u32 = 2;

// SAFETY: a loaded module and function handles, usable from any thread with
// the context current; never mutated after `load`.
unsafe impl Send for Module {}
// SAFETY: as above.
unsafe impl Sync for Module {}

impl Module {
    /// Compile (or reuse) the image for device `cc` and load it into `ctx`
    /// (which must be current).
    pub fn load(ctx: sys::CUcontext, cc: (i32, i32)) -> Result<Module> {
        let arch = format!("sm_{}{}", cc.0, cc.1);
        let img = module_image(&arch)?;
        let mut module = std::ptr::null_mut();
        // SAFETY: the image is a complete cubin; the context is current.
        unsafe {
            check(
                sys::cuModuleLoadData(&mut module, img.as_ptr() as *const _),
                &format!("loading the engram kernels ({arch})"),
            )?;
        }
        let mut m = Module {
            module,
            ctx,
            gather: std::ptr::null_mut(),
            gather_split: std::ptr::null_mut(),
            gate: [[std::ptr::null_mut(); 2]; 2],
            gemv: [std::ptr::null_mut(); GEMV_MAX],
        };
        m.gather = m.function("engram_gather")?;
        m.gather_split = m.function("engram_gather_split")?;
        m.gate = [
            [
                m.function("engram_gate_f32_bf16")?,
                m.function("engram_gate_f32_f32")?,
            ],
            [
                m.function("engram_gate_bf16_bf16")?,
                m.function("engram_gate_bf16_f32")?,
            ],
        ];
        for i in 0..GEMV_MAX {
            m.gemv[i] = m.function(&format!("engram_gemv_bf16_{}", i + 1))?;
        }
        Ok(m)
    }

    fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let c = CString::new(name).unwrap();
        let mut f = std::ptr::null_mut();
        // SAFETY: the module is loaded; the name is a live CString.
        unsafe {
            check(
                sys::cuModuleGetFunction(&mut f, self.module, c.as_ptr()),
                &format!("kernel {name}"),
            )?;
        }
        Ok(f)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: the context this value was created in, which outlives it.
        if let Ok(_s) = unsafe { driver::Scope::enter(self.ctx) } {
            // SAFETY: loaded once, unloaded once.
            unsafe {
                let _ = sys::cuModuleUnload(self.module);
            }
        }
    }
}

/// Launch `f` on `stream` with `args` (pointers to each argument's value).
///
/// # Safety
/// `args` must match the kernel's parameters in number, order and size, and
/// every pointer argument must be valid for what the kernel does with it.
pub unsafe fn launch(
    f: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    shared: u32,
    stream: sys::CUstream,
    args: &mut [*mut std::ffi::c_void],
    what: &str,
) -> Result<()> {
    // SAFETY: the caller's contract (arguments matching the kernel, valid
    // pointers); the argument array lives for the call.
    check(
        unsafe {
            sys::cuLaunchKernel(
                f,
                grid.0,
                grid.1,
                grid.2,
                block,
                1,
                1,
                shared,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        &format!("launching {what}"),
    )
}

/// The argument array for [`launch`]: `args![a, b, c]` takes each by reference.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$(&$a as *const _ as *mut std::ffi::c_void),*]
    };
}
pub(crate) use args;
