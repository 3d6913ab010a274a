//! The driver's results as the library's errors: the loaded driver or
//! `ErrDevice` saying why there is none, and a call's `CUresult` as a status
//! naming the call. Shared by the device ([`super::driver`]) and cuBLAS
//! ([`super::blas`]); re-exported by `driver`.

use super::sys::{self, CUresult, DriverApi, CUDA_SUCCESS};
use crate::error::{EngramStatus, Error, Result};
use std::ffi::CStr;

/// The driver's functions, or `ErrDevice` saying why there are none.
pub fn api() -> Result<&'static DriverApi> {
    sys::driver()
        .map(|d| &d.api)
        .map_err(|e| Error::new(EngramStatus::ErrDevice, e))
}

/// The text of a driver error code.
pub fn error_text(r: CUresult) -> String {
    let Ok(d) = api() else {
        return format!("CUDA error {r}");
    };
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the strings the driver returns are static.
    unsafe {
        let _ = (d.cuGetErrorName)(r, &mut name);
        let _ = (d.cuGetErrorString)(r, &mut text);
        let n = if name.is_null() {
            format!("CUDA error {r}")
        } else {
            CStr::from_ptr(name).to_string_lossy().into_owned()
        };
        if text.is_null() {
            n
        } else {
            format!("{n}: {}", CStr::from_ptr(text).to_string_lossy())
        }
    }
}

/// `Ok` for `CUDA_SUCCESS`, else `ErrDevice` naming `what`.
pub fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(
            EngramStatus::ErrDevice,
            format!("{what}: {}", error_text(r)),
        ))
    }
}
