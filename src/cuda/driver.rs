//! The CUDA driver, loaded at run time: presence checks that never panic, the
//! device and its primary context, context scopes, and owned device and
//! pinned buffers.
//!
//! cudarc (dynamic loading) panics when it cannot load a library or a symbol,
//! so every library is looked for with `dlopen` first, under the names cudarc
//! will try ([`cudarc::get_lib_name_candidates`]); the panic boundary in `ffi`
//! stays as the backstop.

use crate::error::{bail, EngramStatus, Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_void, CStr, CString};

/// The oldest driver (as `cuDriverGetVersion` reports it) the backend accepts:
/// CUDA 12.0. Kernels are compiled to the device's own SASS, which any 12.x
/// driver loads whatever NVRTC 12.x built it.
pub const MIN_DRIVER_VERSION: i32 = 12000;

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

/// Whether `name` can be loaded with `dlopen`; the error text otherwise. The
/// handle is closed again (the library stays loaded if something else holds it).
pub fn dl_present(name: &str) -> std::result::Result<(), String> {
    let c = CString::new(name).map_err(|_| format!("{name}: bad name"))?;
    // SAFETY: plain dlopen/dlclose on a NUL-terminated name.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
        if h.is_null() {
            return Err(dl_error());
        }
        libc::dlclose(h);
    }
    Ok(())
}

/// The first of cudarc's candidate names for library `lib` ("cuda", "nvrtc",
/// "cublas") that loads, or every name tried and the last error.
pub fn find_library(lib: &str) -> std::result::Result<String, String> {
    let mut last = String::new();
    let names = cudarc::get_lib_name_candidates(lib);
    for n in &names {
        match dl_present(n) {
            Ok(()) => return Ok(n.clone()),
            Err(e) => last = e,
        }
    }
    Err(format!(
        "none of {} could be loaded (last error: {last})",
        names.join(", ")
    ))
}

/// Check that the driver library is there before any cudarc call touches it.
pub fn check_driver_library() -> Result<()> {
    if let Err(e) = dl_present("libcuda.so.1") {
        bail!(
            ErrDevice,
            "no CUDA driver: libcuda.so.1 cannot be loaded ({e}); the CUDA backend needs the NVIDIA driver"
        );
    }
    if let Err(e) = find_library("cuda") {
        bail!(ErrDevice, "no CUDA driver: {e}");
    }
    Ok(())
}

/// The text of a driver error code.
pub fn error_text(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver library is loaded (every caller got `r` from it); the
    // strings it returns are static.
    unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
        let n = if name.is_null() {
            format!("{r:?}")
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
pub fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(
            EngramStatus::ErrDevice,
            format!("{what}: {}", error_text(r)),
        ))
    }
}

/// What the driver says about the machine, for tests and benchmarks: `Ok` with
/// a description when a device can be used, `Err` with the reason otherwise.
/// Never panics.
pub fn probe() -> std::result::Result<String, String> {
    std::panic::catch_unwind(|| -> std::result::Result<String, String> {
        check_driver_library().map_err(|e| e.message)?;
        // SAFETY: the driver library loads (checked above).
        unsafe {
            check(sys::cuInit(0), "cuInit").map_err(|e| e.message)?;
            let mut v = 0;
            check(sys::cuDriverGetVersion(&mut v), "cuDriverGetVersion").map_err(|e| e.message)?;
            let mut n = 0;
            check(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount").map_err(|e| e.message)?;
            if n < 1 {
                return Err("the CUDA driver reports no device".into());
            }
            Ok(format!(
                "CUDA driver {}.{}, {n} device(s)",
                v / 1000,
                (v % 1000) / 10
            ))
        }
    })
    .unwrap_or_else(|_| Err("the CUDA driver panicked while loading".into()))
}

/// A device and its retained primary context (the one cudart and PyTorch use).
pub struct Device {
    pub ordinal: i32,
    pub cu_device: sys::CUdevice,
    pub ctx: sys::CUcontext,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub name: String,
    pub driver_version: i32,
}

// SAFETY: a CUcontext may be used from any thread (made current there first,
// which every user of `ctx` does through `Scope`).
unsafe impl Send for Device {}
// SAFETY: as above; the handle itself is never mutated after `open`.
unsafe impl Sync for Device {}

impl Device {
    /// Load the driver, check its version, and retain device `ordinal`'s
    /// primary context. Every failure is `ErrDevice` with the reason.
    pub fn open(ordinal: i32) -> Result<Device> {
        check_driver_library()?;
        // SAFETY: the driver library loads; every out-pointer is a local.
        unsafe {
            check(sys::cuInit(0), "cuInit")?;
            let mut v = 0;
            check(sys::cuDriverGetVersion(&mut v), "cuDriverGetVersion")?;
            if v < MIN_DRIVER_VERSION {
                bail!(
                    ErrDevice,
                    "the CUDA driver supports CUDA {}.{}; the CUDA backend needs 12.0 or later",
                    v / 1000,
                    (v % 1000) / 10
                );
            }
            let mut n = 0;
            check(sys::cuDeviceGetCount(&mut n), "cuDeviceGetCount")?;
            if ordinal < 0 || ordinal >= n {
                bail!(
                    ErrDevice,
                    "device ordinal {ordinal} does not exist ({n} CUDA device(s): 0..{})",
                    n
                );
            }
            let mut dev = 0;
            check(sys::cuDeviceGet(&mut dev, ordinal), "cuDeviceGet")?;
            let attr = |a| {
                let mut x = 0;
                check(
                    sys::cuDeviceGetAttribute(&mut x, a, dev),
                    "cuDeviceGetAttribute",
                )
                .map(|_| x)
            };
            use sys::CUdevice_attribute::*;
            let cc = (
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            );
            let mut name = [0 as std::ffi::c_char; 256];
            check(
                sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev),
                "cuDeviceGetName",
            )?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let mut ctx = std::ptr::null_mut();
            check(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            Ok(Device {
                ordinal,
                cu_device: dev,
                ctx,
                cc,
                name,
                driver_version: v,
            })
        }
    }

    /// Make the primary context current on this thread until the scope ends.
    pub fn scope(&self) -> Result<Scope> {
        // SAFETY: the primary context this device retained and holds.
        unsafe { Scope::enter(self.ctx) }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: retained in `open`; released once.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxRelease_v2(self.cu_device);
        }
    }
}

/// Makes a context current and restores the thread's previous one on drop, so
/// the engine's own notion of the current context is left as it was.
pub struct Scope {
    prev: sys::CUcontext,
    changed: bool,
}

impl Scope {
    ///
    /// # Safety
    /// `ctx` must be a live CUDA context (or NULL).
    pub unsafe fn enter(ctx: sys::CUcontext) -> Result<Scope> {
        let mut prev = std::ptr::null_mut();
        // SAFETY: plain driver calls with a local out-pointer.
        unsafe {
            check(sys::cuCtxGetCurrent(&mut prev), "cuCtxGetCurrent")?;
            if prev == ctx {
                return Ok(Scope {
                    prev,
                    changed: false,
                });
            }
            check(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
        }
        Ok(Scope {
            prev,
            changed: true,
        })
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restores what cuCtxGetCurrent returned (possibly NULL).
            unsafe {
                let _ = sys::cuCtxSetCurrent(self.prev);
            }
        }
    }
}

/// Device memory we allocated (`cuMemAlloc`), freed on drop.
pub struct DevBuf {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    ctx: sys::CUcontext,
}

// SAFETY: a device address and its context handle, usable from any thread
// once the context is made current (`Scope`); never mutated after creation.
unsafe impl Send for DevBuf {}
// SAFETY: as above.
unsafe impl Sync for DevBuf {}

impl DevBuf {
    /// `bytes` of device memory (at least 1 byte is allocated); the context
    /// must be current.
    pub fn new(ctx: sys::CUcontext, bytes: usize, what: &str) -> Result<DevBuf> {
        let mut ptr = 0;
        // SAFETY: the caller made `ctx` current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) };
        check(
            r,
            &format!("allocating {bytes} bytes of device memory for {what}"),
        )?;
        Ok(DevBuf { ptr, bytes, ctx })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: the context this value was created in, which outlives it.
        if let Ok(_s) = unsafe { Scope::enter(self.ctx) } {
            // SAFETY: allocated by cuMemAlloc in this context, freed once.
            unsafe {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`), mapped into the device's
/// address space when asked; freed on drop.
pub struct PinnedBuf {
    pub ptr: *mut c_void,
    pub bytes: usize,
    /// The device address of a mapped buffer (0 if not mapped).
    pub dev_ptr: sys::CUdeviceptr,
    ctx: sys::CUcontext,
}

// SAFETY: pinned host memory owned by this value, and its context handle;
// the owner decides who writes it (behind the backend's lock, or the device).
unsafe impl Send for PinnedBuf {}
// SAFETY: as above.
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn new(ctx: sys::CUcontext, bytes: usize, mapped: bool, what: &str) -> Result<PinnedBuf> {
        let mut ptr = std::ptr::null_mut();
        let flags = if mapped {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            0
        };
        // SAFETY: the caller made `ctx` current.
        unsafe {
            check(
                sys::cuMemHostAlloc(&mut ptr, bytes.max(1), flags),
                &format!("allocating {bytes} bytes of pinned host memory for {what}"),
            )?;
            std::ptr::write_bytes(ptr as *mut u8, 0, bytes.max(1));
            let mut b = PinnedBuf {
                ptr,
                bytes,
                dev_ptr: 0,
                ctx,
            };
            if mapped {
                check(
                    sys::cuMemHostGetDevicePointer_v2(&mut b.dev_ptr, ptr, 0),
                    "cuMemHostGetDevicePointer",
                )?;
            }
            Ok(b)
        }
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: the context this value was created in, which outlives it.
        if let Ok(_s) = unsafe { Scope::enter(self.ctx) } {
            // SAFETY: allocated by cuMemHostAlloc, freed once.
            unsafe {
                let _ = sys::cuMemFreeHost(self.ptr);
            }
        }
    }
}

/// An event without timing, for ordering the host against staged copies.
pub struct Event {
    pub ev: sys::CUevent,
    ctx: sys::CUcontext,
}

// SAFETY: an event handle, usable from any thread with its context current.
unsafe impl Send for Event {}
// SAFETY: as above; the driver synchronises operations on one event.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: sys::CUcontext) -> Result<Event> {
        let mut ev = std::ptr::null_mut();
        // SAFETY: the caller made `ctx` current.
        unsafe {
            check(
                sys::cuEventCreate(&mut ev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
                "cuEventCreate",
            )?;
        }
        Ok(Event { ev, ctx })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the context this value was created in, which outlives it.
        if let Ok(_s) = unsafe { Scope::enter(self.ctx) } {
            // SAFETY: created by cuEventCreate, destroyed once.
            unsafe {
                let _ = sys::cuEventDestroy_v2(self.ev);
            }
        }
    }
}

/// Where a pointer handed to us lives, as the driver sees it.
pub struct PtrInfo {
    /// `CU_MEMORYTYPE_*` (1 host, 2 device, 3 array, 4 unified).
    pub memory_type: u32,
    /// The device of device memory (-1 when the driver does not say).
    pub ordinal: i32,
    /// The allocation holding it, `(base, bytes)`, when the driver knows it.
    pub range: Option<(u64, usize)>,
}

/// Ask the driver about `ptr` (a plain host call, legal during stream capture).
/// `None` when the driver does not know the pointer (ordinary host memory, or garbage).
pub fn pointer_info(ptr: u64) -> Option<PtrInfo> {
    use sys::CUpointer_attribute::*;
    // SAFETY: out-pointers are locals of the sizes the attributes write.
    unsafe {
        let mut mt: u32 = 0;
        let r = sys::cuPointerGetAttribute(
            &mut mt as *mut u32 as *mut c_void,
            CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr,
        );
        if r != sys::CUresult::CUDA_SUCCESS || mt == 0 {
            return None;
        }
        let mut ord: i32 = -1;
        if sys::cuPointerGetAttribute(
            &mut ord as *mut i32 as *mut c_void,
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        ) != sys::CUresult::CUDA_SUCCESS
        {
            ord = -1;
        }
        let (mut base, mut size) = (0u64, 0usize);
        let range = (sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
            == sys::CUresult::CUDA_SUCCESS)
            .then_some((base, size));
        Some(PtrInfo {
            memory_type: mt,
            ordinal: ord,
            range,
        })
    }
}

/// Check that `bytes` bytes at `ptr` are memory the device `ordinal` can
/// address: device memory of that device, unified (managed) memory, or pinned
/// host memory from `cuMemHostAlloc` / `cudaHostAlloc` (mapped); and, where
/// the driver knows the allocation, that they lie inside it. Pageable host
/// memory is refused. `what` names the argument in the message.
pub fn check_device_range(ptr: u64, bytes: usize, ordinal: i32, what: &str) -> Result<()> {
    if ptr == 0 {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    let Some(info) = pointer_info(ptr) else {
        bail!(
            ErrInvalidArgument,
            "{what} ({ptr:#x}) is not memory the CUDA driver knows; the CUDA backend takes device pointers"
        );
    };
    if info.memory_type == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
        // Only pinned memory from cuMemHostAlloc / cudaHostAlloc (mapped into
        // the device's address space); not pageable memory, even where the
        // driver could reach it.
        let mut flags = 0u32;
        // SAFETY: a query with a local out-pointer.
        let r = unsafe { sys::cuMemHostGetFlags(&mut flags, ptr as *mut c_void) };
        if r != sys::CUresult::CUDA_SUCCESS {
            bail!(
                ErrInvalidArgument,
                "{what} ({ptr:#x}) is host memory that was not allocated pinned (cudaHostAlloc); \
                 the CUDA backend takes device pointers"
            );
        }
    }
    if info.memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
        && info.ordinal >= 0
        && info.ordinal != ordinal
    {
        bail!(
            ErrInvalidArgument,
            "{what} ({ptr:#x}) is memory of device {}, the context uses device {ordinal}",
            info.ordinal
        );
    }
    if let Some((base, size)) = info.range {
        if ptr < base || (ptr - base) as u128 + bytes as u128 > size as u128 {
            bail!(
                ErrInvalidArgument,
                "{what}: {bytes} bytes at {ptr:#x} do not fit in its allocation ({size} bytes at {base:#x})"
            );
        }
    }
    Ok(())
}
