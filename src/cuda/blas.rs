//! The projection through cuBLAS (loaded at run time): `kv = rows @ wkv^T`,
//! bf16 in, f32 accumulate, bf16 out; or, for an f32 `wkv`, f32 in and out with
//! pedantic f32 math (no TF32). One handle per context, with a workspace
//! allocated at create time, bound to the caller's stream for each call.

use super::driver::{self, DevBuf};
use crate::error::{EngramStatus, Error, Result};
use cudarc::cublas::sys as cb;
use cudarc::driver::sys;
use std::ffi::c_void;

/// cuBLAS's workspace: NVIDIA recommends 32 MiB on Hopper.
pub const WORKSPACE_BYTES: usize = 32 << 20;

pub struct Blas {
    handle: cb::cublasHandle_t,
    workspace: DevBuf,
    ctx: sys::CUcontext,
}

// SAFETY: a cuBLAS handle used only behind the backend's state lock (one
// call at a time), from any thread with the context current.
unsafe impl Send for Blas {}
// SAFETY: as above.
unsafe impl Sync for Blas {}

fn status_text(s: cb::cublasStatus_t) -> String {
    // SAFETY: libcublas is loaded (the status came from it); static string.
    unsafe {
        let p = cb::cublasGetStatusString(s);
        if p.is_null() {
            format!("{s:?}")
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

fn bcheck(s: cb::cublasStatus_t, what: &str) -> Result<()> {
    if s == cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(
            EngramStatus::ErrDevice,
            format!("{what}: {}", status_text(s)),
        ))
    }
}

/// Check that cuBLAS can be loaded (cudarc panics otherwise).
pub fn check_cublas_library() -> Result<String> {
    driver::find_library("cublas").map_err(|e| {
        Error::new(
            EngramStatus::ErrDevice,
            format!("cuBLAS (libcublas) cannot be loaded: {e}; the CUDA backend projects through cuBLAS"),
        )
    })
}

impl Blas {
    /// A handle for the current context `ctx`, with its own workspace.
    pub fn new(ctx: sys::CUcontext) -> Result<Blas> {
        check_cublas_library()?;
        let workspace = DevBuf::new(ctx, WORKSPACE_BYTES, "the cuBLAS workspace")?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: libcublas loads (checked); `ctx` is current.
        unsafe {
            bcheck(cb::cublasCreate_v2(&mut handle), "cublasCreate")?;
        }
        let b = Blas {
            handle,
            workspace,
            ctx,
        };
        // SAFETY: a live handle.
        unsafe {
            bcheck(
                cb::cublasSetMathMode(b.handle, cb::cublasMath_t::CUBLAS_DEFAULT_MATH),
                "cublasSetMathMode",
            )?;
        }
        Ok(b)
    }

    /// Bind the handle to `stream` and to our workspace (cublasSetStream resets
    /// the workspace, so both are set each time).
    fn bind(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: a live handle; the stream is the caller's, the workspace ours.
        unsafe {
            bcheck(
                cb::cublasSetStream_v2(self.handle, stream as cb::cudaStream_t),
                "cublasSetStream",
            )?;
            bcheck(
                cb::cublasSetWorkspace_v2(
                    self.handle,
                    self.workspace.ptr as *mut c_void,
                    self.workspace.bytes,
                ),
                "cublasSetWorkspace",
            )?;
        }
        Ok(())
    }

    /// `kv[n, n_out] = rows[n, k] @ w[n_out, k]^T` (all row-major) on `stream`:
    /// bf16 in and out with f32 accumulation (`f32 == false`), or f32 in and
    /// out with pedantic f32 math (`f32 == true`).
    ///
    /// # Safety
    /// The pointers must hold the sizes above on the context's device.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm(
        &self,
        stream: sys::CUstream,
        f32: bool,
        w: u64,
        rows: u64,
        kv: u64,
        n_out: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        let _ = self.ctx;
        self.bind(stream)?;
        let (alpha, beta) = (1f32, 0f32);
        let (ty, compute) = if f32 {
            (
                cb::cudaDataType::CUDA_R_32F,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
            )
        } else {
            (
                cb::cudaDataType::CUDA_R_16BF,
                cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        // Column-major view: kv^T (n_out x n) = W (k x n_out)^T * rows^T (k x n).
        // SAFETY: the caller's contract (the sizes above on the context's
        // device); alpha and beta live for the call.
        bcheck(
            unsafe {
                cb::cublasGemmEx(
                    self.handle,
                    cb::cublasOperation_t::CUBLAS_OP_T,
                    cb::cublasOperation_t::CUBLAS_OP_N,
                    n_out as i32,
                    n as i32,
                    k as i32,
                    &alpha as *const f32 as *const c_void,
                    w as *const c_void,
                    ty,
                    k as i32,
                    rows as *const c_void,
                    ty,
                    k as i32,
                    &beta as *const f32 as *const c_void,
                    kv as *mut c_void,
                    ty,
                    n_out as i32,
                    compute,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            },
            "cublasGemmEx (the projection)",
        )
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the context this value was created in, which outlives it.
        if let Ok(_s) = unsafe { driver::Scope::enter(self.ctx) } {
            // SAFETY: created once, destroyed once.
            unsafe {
                let _ = cb::cublasDestroy_v2(self.handle);
            }
        }
    }
}
