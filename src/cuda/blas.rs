//! The projection through cuBLAS (loaded at run time by [`super::sys`]):
//! `kv = rows @ wkv^T`, bf16 in, f32 accumulate, bf16 out; or, for an f32
//! `wkv`, f32 in and out with pedantic f32 math (no TF32). One handle per
//! context, with a workspace allocated at create time, bound to the caller's
//! stream for each call.
//!
//! The math mode disallows reduced-precision reductions
//! (`CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION`): when cuBLAS splits
//! the k dimension, its partial sums stay f32 instead of being rounded to
//! bf16, so every output is one f32 sum of exact products rounded once to
//! bf16, within the bound the golden tests state (`tests/common/bounds.rs`).

use super::gpu::{Blas, Gemm, Stream};
use super::status::{self, check};
use super::sys::{self, CUcontext, CublasApi};
use crate::error::{EngramStatus, Error, Result};
use std::ffi::{c_int, c_void};

/// cuBLAS's workspace: NVIDIA recommends 32 MiB on Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// cuBLAS's functions, or `ErrDevice` saying why there are none.
pub fn api() -> Result<&'static CublasApi> {
    sys::cublas().map(|l| &l.api).map_err(|e| {
        Error::new(
            EngramStatus::ErrDevice,
            format!(
                "cuBLAS cannot be loaded: {e}; the CUDA backend projects through cuBLAS (the CUDA \
                 toolkit's libcublas, or the nvidia-cublas wheel's, on the loader path or in \
                 ENGRAM_CUDA_LIB_DIR)"
            ),
        )
    })
}

fn status_text(s: sys::cublasStatus_t) -> String {
    match api() {
        // SAFETY: a static string (or NULL) from cuBLAS.
        Ok(b) => unsafe {
            let p = (b.cublasGetStatusString)(s);
            if p.is_null() {
                format!("cuBLAS status {s}")
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        },
        Err(_) => format!("cuBLAS status {s}"),
    }
}

fn bcheck(s: sys::cublasStatus_t, what: &str) -> Result<()> {
    if s == sys::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(
            EngramStatus::ErrDevice,
            format!("{what}: {}", status_text(s)),
        ))
    }
}

/// A cuBLAS handle with its own workspace, in one context.
///
/// cuBLAS 13.1 on an H200 (driver 580) fails to launch its cluster GEMM
/// kernels on the legacy default stream (`NULL`) of a context made current
/// through the driver API ("the function failed to launch on the GPU"),
/// while the same GEMM on any created stream runs. A call on `NULL` therefore
/// runs the GEMM on `legacy`, a blocking stream of this context: the legacy
/// stream and every blocking stream order against each other implicitly, so
/// the GEMM still runs after the work queued before it on `NULL` and before
/// the work queued after it, exactly as on `NULL` itself.
pub struct RealBlas {
    handle: sys::cublasHandle_t,
    workspace: u64,
    legacy: sys::CUstream,
    ctx: CUcontext,
}

// SAFETY: a cuBLAS handle used by one context at a time (behind the
// backend's state lock), from any thread with the context current.
unsafe impl Send for RealBlas {}

impl RealBlas {
    /// A handle for context `ctx`, which the caller made current.
    pub fn new(ctx: CUcontext) -> Result<RealBlas> {
        let b = api()?;
        let d = status::api()?;
        let mut workspace = 0;
        // SAFETY: the caller made `ctx` current; locals as out-pointers.
        unsafe {
            check(
                (d.cuMemAlloc_v2)(&mut workspace, WORKSPACE_BYTES),
                "allocating the cuBLAS workspace",
            )?;
        }
        let mut legacy = std::ptr::null_mut();
        // SAFETY: as above; flags 0: a blocking stream (see `RealBlas`).
        let r = unsafe { (d.cuStreamCreate)(&mut legacy, 0) };
        if let Err(e) = check(r, "cuStreamCreate") {
            // SAFETY: allocated above, freed once.
            unsafe {
                let _ = (d.cuMemFree_v2)(workspace);
            }
            return Err(e);
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: as cuMemAlloc above: `new`'s caller made `ctx` current; `handle`
        // is a local out-pointer.
        let r = unsafe { (b.cublasCreate_v2)(&mut handle) };
        if let Err(e) = bcheck(r, "cublasCreate") {
            // SAFETY: created above, released once.
            unsafe {
                let _ = (d.cuStreamDestroy_v2)(legacy);
                let _ = (d.cuMemFree_v2)(workspace);
            }
            return Err(e);
        }
        let blas = RealBlas {
            handle,
            workspace,
            legacy,
            ctx,
        };
        // SAFETY: a live handle.
        unsafe {
            bcheck(
                (b.cublasSetMathMode)(
                    blas.handle,
                    sys::CUBLAS_DEFAULT_MATH
                        | sys::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
                ),
                "cublasSetMathMode",
            )?;
        }
        Ok(blas)
    }
}

impl Blas for RealBlas {
    unsafe fn gemm(&mut self, stream: Stream, g: &Gemm) -> Result<()> {
        let b = api()?;
        let (alpha, beta) = (1f32, 0f32);
        let (ty, compute) = if g.f32 {
            (sys::CUDA_R_32F, sys::CUBLAS_COMPUTE_32F_PEDANTIC)
        } else {
            (sys::CUDA_R_16BF, sys::CUBLAS_COMPUTE_32F)
        };
        let i = |x: usize| x as c_int;
        // The legacy default stream's work goes through `legacy` (see `RealBlas`).
        let stream = if stream.is_null() {
            self.legacy as Stream
        } else {
            stream
        };
        // SAFETY: a live handle, our workspace and the caller's stream; the
        // caller's contract for the pointers. cublasSetStream resets the
        // workspace, so both are set each time. Column-major view:
        // kv^T (m x n, ld ldc) = W (k x m, ld ldw)^T * rows^T (k x n, ld ldr).
        unsafe {
            bcheck(
                (b.cublasSetStream_v2)(self.handle, stream as sys::CUstream),
                "cublasSetStream",
            )?;
            bcheck(
                (b.cublasSetWorkspace_v2)(
                    self.handle,
                    self.workspace as *mut c_void,
                    WORKSPACE_BYTES,
                ),
                "cublasSetWorkspace",
            )?;
            bcheck(
                (b.cublasGemmEx)(
                    self.handle,
                    sys::CUBLAS_OP_T,
                    sys::CUBLAS_OP_N,
                    i(g.m),
                    i(g.n),
                    i(g.k),
                    &alpha as *const f32 as *const c_void,
                    g.w as *const c_void,
                    ty,
                    i(g.ldw),
                    g.rows as *const c_void,
                    ty,
                    i(g.ldr),
                    &beta as *const f32 as *const c_void,
                    g.kv as *mut c_void,
                    ty,
                    i(g.ldc),
                    compute,
                    sys::CUBLAS_GEMM_DEFAULT,
                ),
                "cublasGemmEx (the projection)",
            )
        }
    }

    fn device_bytes(&self) -> usize {
        WORKSPACE_BYTES
    }
}

impl Drop for RealBlas {
    fn drop(&mut self) {
        let (Ok(b), Ok(d)) = (api(), status::api()) else {
            return;
        };
        let mut prev = std::ptr::null_mut();
        // SAFETY: made current for the teardown and restored after; the
        // handle and workspace were created once and are destroyed once.
        unsafe {
            let _ = (d.cuCtxGetCurrent)(&mut prev);
            let _ = (d.cuCtxSetCurrent)(self.ctx);
            let _ = (b.cublasDestroy_v2)(self.handle);
            let _ = (d.cuStreamDestroy_v2)(self.legacy);
            let _ = (d.cuMemFree_v2)(self.workspace);
            let _ = (d.cuCtxSetCurrent)(prev);
        }
    }
}
