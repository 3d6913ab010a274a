//! The real device: the CUDA driver (loaded by [`super::sys`]), the device's
//! primary context, the kernels compiled for it, and cuBLAS.

use super::blas::RealBlas;
use super::gpu::{
    Arg, Blas, DevPtr, DeviceLimits, Gpu, Guard, Kernel, MemKind, PtrInfo, Stream, KERNEL_NAMES,
};
use super::kernels;
pub use super::status::{api, check, error_text};
use super::sys::{self, CUcontext, CUdevice, DriverApi, CUDA_SUCCESS};
use crate::error::{bail, Result};
use std::ffi::{c_void, CStr, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The oldest driver (as `cuDriverGetVersion` reports it) the backend accepts:
/// CUDA 12.0.
pub const MIN_DRIVER_VERSION: i32 = 12000;

/// What the driver says about the machine, for tests and benchmarks: `Ok` with
/// a description when a device can be used, `Err` with the reason otherwise.
/// Never panics.
pub fn probe() -> std::result::Result<String, String> {
    let d = api().map_err(|e| e.message)?;
    // SAFETY: the driver is loaded; out-pointers are locals.
    unsafe {
        check((d.cuInit)(0), "cuInit").map_err(|e| e.message)?;
        let mut n = 0;
        check((d.cuDeviceGetCount)(&mut n), "cuDeviceGetCount").map_err(|e| e.message)?;
        if n < 1 {
            return Err("the CUDA driver reports no device".into());
        }
        Ok(format!("{n} device(s); {}", sys::describe()))
    }
}

/// A device's primary context made current on this thread until the guard
/// drops (the thread's previous context is restored then).
fn enter_ctx(ctx: CUcontext) -> Result<Guard> {
    let d = api()?;
    let mut prev: CUcontext = std::ptr::null_mut();
    // SAFETY: plain driver calls with a local out-pointer; `ctx` is a live
    // primary context its owner retains.
    unsafe {
        check((d.cuCtxGetCurrent)(&mut prev), "cuCtxGetCurrent")?;
        if prev == ctx {
            return Ok(Guard::none());
        }
        check((d.cuCtxSetCurrent)(ctx), "cuCtxSetCurrent")?;
    }
    let prev = prev as usize;
    Ok(Guard {
        restore: Some(Box::new(move || {
            // SAFETY: restores what cuCtxGetCurrent returned (possibly NULL).
            unsafe {
                let _ = (d.cuCtxSetCurrent)(prev as CUcontext);
            }
        })),
    })
}

/// The context `stream` belongs to: with `cuStreamGetCtx_v2` (CUDA 12.5+)
/// where the driver has it, which gives the device's primary context for a
/// stream of a green context (`cuStreamGetCtx` refuses those); else
/// `cuStreamGetCtx`.
fn stream_context(d: &DriverApi, stream: Stream) -> Result<CUcontext> {
    let mut sctx = std::ptr::null_mut();
    match d.cuStreamGetCtx_v2 {
        Some(v2) => {
            let mut green = std::ptr::null_mut();
            // SAFETY: a live stream or NULL (the contract of every `stream`
            // the library is given); locals as out-pointers.
            unsafe {
                check(
                    v2(stream as sys::CUstream, &mut sctx, &mut green),
                    "the stream (cuStreamGetCtx_v2)",
                )?
            };
        }
        // SAFETY: as the `_v2` arm: `stream` is live or NULL (the library's contract
        // for every `stream`); `sctx` is a local out-pointer.
        None => unsafe {
            check(
                (d.cuStreamGetCtx)(stream as sys::CUstream, &mut sctx),
                "the stream (cuStreamGetCtx)",
            )?
        },
    }
    Ok(sctx)
}

/// Whether a launch's error `r` is a refusal that queued nothing and left the
/// context usable, so that another way of doing the same work may follow:
/// invalid launch values or too much shared memory for this context, out of
/// memory or resources, no image for the device, a cooperative grid too
/// large, not permitted or not supported here (a green context, MPS, a
/// capture mode). The errors that poison a context (an illegal address, a
/// failed or timed-out launch, an unknown error, ...) and the capture errors
/// (which invalidate the capture) are not.
pub fn is_refusal(r: sys::CUresult) -> bool {
    matches!(
        r,
        sys::CUDA_ERROR_INVALID_VALUE
            | sys::CUDA_ERROR_OUT_OF_MEMORY
            | sys::CUDA_ERROR_NO_BINARY_FOR_GPU
            | sys::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
            | sys::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
            | sys::CUDA_ERROR_NOT_PERMITTED
            | sys::CUDA_ERROR_NOT_SUPPORTED
    )
}

/// A device with its retained primary context (the one cudart and PyTorch
/// use) and the kernels loaded into it.
pub struct RealGpu {
    pub ordinal: i32,
    pub dev: CUdevice,
    pub ctx: CUcontext,
    /// Compute capability (major, minor).
    pub cc: (i32, i32),
    pub name: String,
    /// What the kernels are compiled to (`"sm_90"` for a cubin, `"compute_90"` for PTX).
    pub arch: String,
    /// Multiprocessors, shared memory opt-in, cooperative launch.
    pub limits: DeviceLimits,
    /// The loaded modules of [`kernels::MODULES`] (0: not yet), behind the
    /// lock that loading holds.
    modules: Mutex<[usize; kernels::MODULES.len()]>,
    /// Every kernel's `CUfunction` (0 until its module is loaded).
    functions: Vec<AtomicUsize>,
}

// SAFETY: driver handles usable from any thread with the context current,
// which every method makes it; never mutated after `open`.
unsafe impl Send for RealGpu {}
// SAFETY: Sync for the reason Send is above: the handles are never mutated
// after `open` (modules behind their Mutex, functions atomic).
unsafe impl Sync for RealGpu {}

impl RealGpu {
    /// Load the driver, check its version, retain device `ordinal`'s primary
    /// context, compile (or reuse) and load the kernels. Every failure is
    /// `ErrDevice` with the reason.
    pub fn open(ordinal: i32) -> Result<Arc<dyn Gpu>> {
        let d = api()?;
        let v = sys::driver().map(|l| l.version).unwrap_or_default();
        // SAFETY: the driver is loaded; every out-pointer is a local.
        unsafe {
            check((d.cuInit)(0), "cuInit")?;
            if v.0 * 1000 + v.1 * 10 < MIN_DRIVER_VERSION {
                bail!(
                    ErrDevice,
                    "the CUDA driver supports CUDA {}.{}; the CUDA backend needs 12.0 or later",
                    v.0,
                    v.1
                );
            }
            let mut n = 0;
            check((d.cuDeviceGetCount)(&mut n), "cuDeviceGetCount")?;
            if ordinal < 0 || ordinal >= n {
                bail!(
                    ErrDevice,
                    "device ordinal {ordinal} does not exist ({n} CUDA device(s): 0..{n})"
                );
            }
            let mut dev = 0;
            check((d.cuDeviceGet)(&mut dev, ordinal), "cuDeviceGet")?;
            let attr = |a| {
                let mut x = 0;
                check(
                    (d.cuDeviceGetAttribute)(&mut x, a, dev),
                    "cuDeviceGetAttribute",
                )
                .map(|_| x)
            };
            let cc = (
                attr(sys::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            );
            let mut name = [0 as std::ffi::c_char; 256];
            check(
                (d.cuDeviceGetName)(name.as_mut_ptr(), name.len() as i32, dev),
                "cuDeviceGetName",
            )?;
            let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
            let limits = DeviceLimits {
                sms: attr(sys::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(0) as u32,
                max_shared: attr(sys::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0)
                    as u32,
                cooperative: attr(sys::CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH)? != 0,
            };
            let mut ctx = std::ptr::null_mut();
            check(
                (d.cuDevicePrimaryCtxRetain)(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            let g = RealGpu {
                ordinal,
                dev,
                ctx,
                cc,
                name,
                arch: String::new(),
                limits,
                modules: Mutex::new([0; kernels::MODULES.len()]),
                functions: KERNEL_NAMES.iter().map(|_| AtomicUsize::new(0)).collect(),
            };
            // From here on, Drop releases the context.
            let mut g = g;
            g.arch = kernels::arch_for(cc)?;
            g.load_module(0)?;
            Ok(Arc::new(g))
        }
    }

    /// Compile (or reuse) and load module `m` of [`kernels::MODULES`] and look
    /// up its kernels; a no-op once it is loaded.
    fn load_module(&self, m: usize) -> Result<()> {
        let mut loaded = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if loaded[m] != 0 {
            return Ok(());
        }
        let d = api()?;
        let _g = enter_ctx(self.ctx)?;
        let load = |img: &[u8]| {
            let mut module: sys::CUmodule = std::ptr::null_mut();
            // SAFETY: `img` is a whole cubin or PTX image that NVRTC made (here
            // or, from the module directory, on the build machine) and lives
            // for the call; `module` is a local out-pointer; the context is
            // current (the guard above).
            let r = unsafe { (d.cuModuleLoadData)(&mut module, img.as_ptr() as *const c_void) };
            check(
                r,
                &format!(
                    "loading the engram kernels ({}, {})",
                    kernels::MODULES[m].0,
                    self.arch
                ),
            )
            .map(|()| module)
        };
        // An image from the module directory that the driver refuses (made by
        // a newer toolkit than this driver, or damaged) is compiled here again.
        let module = match load(&kernels::module_image(m, &self.arch)?) {
            Ok(module) => module,
            Err(_) => load(&kernels::module_image_fresh(m, &self.arch)?)?,
        };
        for k in Kernel::all().into_iter().filter(|k| k.module() == m) {
            let c = CString::new(k.name()).expect("no NUL");
            let mut f = std::ptr::null_mut();
            // SAFETY: the module is loaded; the name is a live CString.
            let r = unsafe { (d.cuModuleGetFunction)(&mut f, module, c.as_ptr()) };
            // The decode kernels take more than 48 KiB of dynamic shared
            // memory: opt in to the device's most.
            let r = if r == CUDA_SUCCESS && k.big_shared() {
                // SAFETY: a function of the loaded module.
                unsafe {
                    (d.cuFuncSetAttribute)(
                        f,
                        sys::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        self.limits.max_shared.min(i32::MAX as u32) as i32,
                    )
                }
            } else {
                r
            };
            if let Err(e) = check(r, &format!("kernel {}", k.name())) {
                // SAFETY: loaded above, unloaded once.
                unsafe {
                    let _ = (d.cuModuleUnload)(module);
                }
                return Err(e);
            }
            self.functions[k.index()].store(f as usize, Ordering::Release);
        }
        loaded[m] = module as usize;
        Ok(())
    }

    /// What the kernels are compiled to, in words.
    fn target(&self) -> String {
        if self.arch.starts_with("sm_") {
            format!("{} cubin", self.arch)
        } else {
            format!(
                "{} PTX, compiled by the driver for sm_{}{}",
                self.arch, self.cc.0, self.cc.1
            )
        }
    }

    fn ctx_guard(&self) -> Result<Guard> {
        enter_ctx(self.ctx)
    }

    /// `k`'s function, its module loaded first if it is not yet.
    fn function(&self, k: Kernel) -> Result<sys::CUfunction> {
        let mut f = self.functions[k.index()].load(Ordering::Acquire);
        if f == 0 {
            self.load_module(k.module())?;
            f = self.functions[k.index()].load(Ordering::Acquire);
        }
        Ok(f as sys::CUfunction)
    }
}

impl Drop for RealGpu {
    fn drop(&mut self) {
        let Ok(d) = api() else { return };
        if let Ok(_g) = self.ctx_guard() {
            let loaded = *self.modules.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: each loaded once, unloaded once, after the device is idle.
            unsafe {
                let _ = (d.cuCtxSynchronize)();
                for m in loaded.into_iter().filter(|&m| m != 0) {
                    let _ = (d.cuModuleUnload)(m as sys::CUmodule);
                }
            }
        }
        // SAFETY: retained in `open`; released once.
        unsafe {
            let _ = (d.cuDevicePrimaryCtxRelease_v2)(self.dev);
        }
    }
}

impl Gpu for RealGpu {
    fn describe(&self) -> String {
        format!(
            "{} (sm_{}{}; kernels: {}; {})",
            self.name,
            self.cc.0,
            self.cc.1,
            self.target(),
            sys::describe()
        )
    }

    fn ordinal(&self) -> i32 {
        self.ordinal
    }

    fn enter(&self) -> Result<Guard> {
        self.ctx_guard()
    }

    fn alloc(&self, bytes: usize, what: &str) -> Result<DevPtr> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        let mut p = 0;
        // SAFETY: the context is current; `p` is a local.
        let r = unsafe { (d.cuMemAlloc_v2)(&mut p, bytes.max(1)) };
        check(
            r,
            &format!("allocating {bytes} bytes of device memory for {what}"),
        )?;
        Ok(p)
    }

    unsafe fn free(&self, p: DevPtr) {
        if let (Ok(d), Ok(_g)) = (api(), self.ctx_guard()) {
            // SAFETY: `p` came from this device's `alloc` (cuMemAlloc) and `Gpu::free`'s
            // contract says it is freed once, with no queued work still using it.
            unsafe {
                let _ = (d.cuMemFree_v2)(p);
            }
        }
    }

    fn host_alloc(&self, bytes: usize, mapped: bool, what: &str) -> Result<(*mut u8, DevPtr)> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        let flags = if mapped {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            0
        };
        // SAFETY: the context is current; out-pointers are locals; the new
        // allocation is ours to zero.
        unsafe {
            check(
                (d.cuMemHostAlloc)(&mut p, bytes.max(1), flags),
                &format!("allocating {bytes} bytes of pinned host memory for {what}"),
            )?;
            std::ptr::write_bytes(p as *mut u8, 0, bytes.max(1));
            let mut dp = 0;
            if mapped {
                let r = (d.cuMemHostGetDevicePointer_v2)(&mut dp, p, 0);
                if r != CUDA_SUCCESS {
                    let _ = (d.cuMemFreeHost)(p);
                    check(r, "cuMemHostGetDevicePointer")?;
                }
            }
            Ok((p as *mut u8, dp))
        }
    }

    unsafe fn host_free(&self, p: *mut u8) {
        if let (Ok(d), Ok(_g)) = (api(), self.ctx_guard()) {
            // SAFETY: `p` came from this device's `host_alloc` (cuMemHostAlloc) and
            // `Gpu::host_free`'s contract says it is freed once, with nothing queued using it.
            unsafe {
                let _ = (d.cuMemFreeHost)(p as *mut c_void);
            }
        }
    }

    unsafe fn memset(&self, p: DevPtr, v: u8, bytes: usize) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: the caller's contract; the memset runs on the legacy stream,
        // which a non-blocking stream does not wait for: finish it here.
        unsafe {
            check((d.cuMemsetD8_v2)(p, v, bytes), "cuMemsetD8")?;
            check((d.cuCtxSynchronize)(), "waiting for the device")
        }
    }

    unsafe fn upload(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::upload`'s contract: `dst` holds `bytes` on this device and
        // `src` is readable for `bytes`. A copy from pageable memory returns
        // once the source is consumed, possibly before the DMA to the device
        // has landed; the synchronisation makes it complete for every stream.
        unsafe {
            check(
                (d.cuMemcpyHtoD_v2)(dst, src as *const c_void, bytes),
                "copying to the device",
            )?;
            check((d.cuCtxSynchronize)(), "waiting for the device")
        }
    }

    unsafe fn download(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::download`'s contract: `src` holds `bytes` on this device and
        // `dst` is writable for `bytes`; the copy is complete when it returns.
        unsafe {
            check((d.cuCtxSynchronize)(), "waiting for the device")?;
            check(
                (d.cuMemcpyDtoH_v2)(dst as *mut c_void, src, bytes),
                "copying from the device",
            )
        }
    }

    unsafe fn upload_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::upload_async`'s contract: `dst` holds `bytes` on the device, `src`
        // is readable for `bytes` (page-locked: unchanged until the copy has run);
        // `stream` is live or NULL (the library's contract for every `stream`).
        unsafe {
            check(
                (d.cuMemcpyHtoDAsync_v2)(dst, src as *const c_void, bytes, stream as sys::CUstream),
                "queueing a copy to the device",
            )
        }
    }

    unsafe fn download_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::download_async`'s contract: `src` holds `bytes` on the device,
        // `dst` is writable for `bytes` and left alone until the copy has run;
        // `stream` is live or NULL (the library's contract for every `stream`).
        unsafe {
            check(
                (d.cuMemcpyDtoHAsync_v2)(dst as *mut c_void, src, bytes, stream as sys::CUstream),
                "queueing a copy from the device",
            )
        }
    }

    unsafe fn memset_async(&self, p: DevPtr, v: u8, bytes: usize, stream: Stream) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::memset_async`'s contract: `p` holds `bytes` on the device;
        // `stream` is live or NULL (the library's contract for every `stream`).
        unsafe {
            check(
                (d.cuMemsetD8Async)(p, v, bytes, stream as sys::CUstream),
                "queueing a memset (cuMemsetD8Async)",
            )
        }
    }

    fn stream_new(&self) -> Result<Stream> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the context is current; `s` is a local.
        unsafe {
            check(
                (d.cuStreamCreate)(&mut s, sys::CU_STREAM_NON_BLOCKING),
                "creating the context's own stream (cuStreamCreate)",
            )?;
        }
        Ok(s as Stream)
    }

    unsafe fn stream_free(&self, stream: Stream) {
        if let (Ok(d), Ok(_g)) = (api(), self.ctx_guard()) {
            // SAFETY: `Gpu::stream_free`'s contract: `stream` came from this device's
            // `stream_new`, has nothing still to run and is destroyed once.
            unsafe {
                let _ = (d.cuStreamDestroy_v2)(stream as sys::CUstream);
            }
        }
    }

    unsafe fn stream_wait_event(&self, stream: Stream, ev: usize) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::stream_wait_event`'s contract: `ev` is a live event from
        // this device's `event_new`, `stream` a stream of this device or NULL.
        unsafe {
            check(
                (d.cuStreamWaitEvent)(stream as sys::CUstream, ev as sys::CUevent, 0),
                "cuStreamWaitEvent",
            )
        }
    }

    fn event_new(&self) -> Result<usize> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        let mut ev = std::ptr::null_mut();
        // SAFETY: the context is current; `ev` is a local.
        unsafe {
            check(
                (d.cuEventCreate)(&mut ev, sys::CU_EVENT_DISABLE_TIMING),
                "cuEventCreate",
            )?;
        }
        Ok(ev as usize)
    }

    unsafe fn event_free(&self, ev: usize) {
        if let (Ok(d), Ok(_g)) = (api(), self.ctx_guard()) {
            // SAFETY: `Gpu::event_free`'s contract: `ev` came from this device's
            // `event_new` (cuEventCreate) and is destroyed once.
            unsafe {
                let _ = (d.cuEventDestroy_v2)(ev as sys::CUevent);
            }
        }
    }

    unsafe fn event_record(&self, ev: usize, stream: Stream) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::event_record`'s contract: `ev` is a live event of this device,
        // `stream` a stream of this device or NULL.
        unsafe {
            check(
                (d.cuEventRecord)(ev as sys::CUevent, stream as sys::CUstream),
                "cuEventRecord",
            )
        }
    }

    unsafe fn event_wait(&self, ev: usize) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: `Gpu::event_wait`'s contract: `ev` is a live event of this device
        // (from `event_new`, not yet freed).
        unsafe {
            check(
                (d.cuEventSynchronize)(ev as sys::CUevent),
                "waiting for an earlier copy (cuEventSynchronize)",
            )
        }
    }

    fn synchronize(&self) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: plain synchronisation of the current context.
        unsafe { check((d.cuCtxSynchronize)(), "waiting for the device") }
    }

    fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        // SAFETY: a live stream or NULL (the contract of every `stream` the
        // library is given).
        unsafe {
            check(
                (d.cuStreamSynchronize)(stream as sys::CUstream),
                "an earlier call's work on this stream failed (cuStreamSynchronize)",
            )
        }
    }

    fn stream_capturing(&self, stream: Stream) -> Result<bool> {
        let d = api()?;
        let _g = self.ctx_guard()?;
        let mut st = sys::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream or NULL (the contract of every `stream` the
        // library is given); locals as out-pointers.
        unsafe {
            check(
                (d.cuStreamIsCapturing)(stream as sys::CUstream, &mut st),
                "the stream (cuStreamIsCapturing)",
            )?;
        }
        if st != sys::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(true);
        }
        let sctx = stream_context(d, stream)?;
        if sctx != self.ctx {
            bail!(
                ErrInvalidArgument,
                "the stream belongs to another CUDA context than device {}'s primary context",
                self.ordinal
            );
        }
        Ok(false)
    }

    fn pointer(&self, p: u64) -> Option<PtrInfo> {
        let d = api().ok()?;
        let _g = self.ctx_guard().ok()?;
        // SAFETY: out-pointers are locals of the sizes the attributes write;
        // these queries are host calls, legal during stream capture.
        unsafe {
            let mut mt: u32 = 0;
            let r = (d.cuPointerGetAttribute)(
                &mut mt as *mut u32 as *mut c_void,
                sys::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                p,
            );
            if r != CUDA_SUCCESS || mt == 0 {
                return None;
            }
            let kind = match mt {
                sys::CU_MEMORYTYPE_HOST => MemKind::Host,
                sys::CU_MEMORYTYPE_UNIFIED => MemKind::Unified,
                _ => MemKind::Device,
            };
            let mut ord: i32 = -1;
            if (d.cuPointerGetAttribute)(
                &mut ord as *mut i32 as *mut c_void,
                sys::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                p,
            ) != CUDA_SUCCESS
            {
                ord = -1;
            }
            let (mut base, mut size) = (0u64, 0usize);
            let range = ((d.cuMemGetAddressRange_v2)(&mut base, &mut size, p) == CUDA_SUCCESS)
                .then_some((base, size));
            let mapped = kind != MemKind::Host || {
                let mut flags = 0u32;
                (d.cuMemHostGetFlags)(&mut flags, p as *mut c_void) == CUDA_SUCCESS
            };
            Some(PtrInfo {
                kind,
                ordinal: ord,
                range,
                mapped,
            })
        }
    }

    unsafe fn launch(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<()> {
        // SAFETY: `launch_shared`'s `# Safety` is `Gpu::launch`'s, which this
        // function's caller met (args match `k`, their pointers valid); no shared memory.
        unsafe { self.launch_shared(k, grid, block, 0, stream, args) }
    }

    unsafe fn launch_shared(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<()> {
        let d = api()?;
        let f = self.function(k)?;
        let _g = self.ctx_guard()?;
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.ptr).collect();
        // SAFETY: the caller's contract (arguments matching the kernel, valid
        // pointers); the argument array lives for the call.
        unsafe {
            check(
                (d.cuLaunchKernel)(
                    f,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    shared,
                    stream as sys::CUstream,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                ),
                &format!("launching {}", k.name()),
            )
        }
    }

    unsafe fn try_launch_shared(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<bool> {
        let d = api()?;
        let f = self.function(k)?;
        let _g = self.ctx_guard()?;
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.ptr).collect();
        // SAFETY: the caller's contract (arguments matching the kernel, valid
        // pointers); the argument array lives for the call.
        let r = unsafe {
            (d.cuLaunchKernel)(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                shared,
                stream as sys::CUstream,
                ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        if is_refusal(r) {
            return Ok(false);
        }
        check(r, &format!("launching {}", k.name()))?;
        Ok(true)
    }

    fn device_limits(&self) -> Result<DeviceLimits> {
        Ok(self.limits)
    }

    fn occupancy(&self, k: Kernel, block: u32, shared: u32) -> Result<u32> {
        let d = api()?;
        let f = self.function(k)?;
        let _g = self.ctx_guard()?;
        let mut n = 0;
        // SAFETY: a loaded function; `n` is a local.
        unsafe {
            check(
                (d.cuOccupancyMaxActiveBlocksPerMultiprocessor)(
                    &mut n,
                    f,
                    block as i32,
                    shared as usize,
                ),
                &format!("the occupancy of {}", k.name()),
            )?;
        }
        Ok(n.max(0) as u32)
    }

    fn new_blas(&self) -> Result<Box<dyn Blas>> {
        let _g = self.ctx_guard()?;
        Ok(Box::new(RealBlas::new(self.ctx)?))
    }

    fn preload(&self, k: Kernel) -> Result<()> {
        self.load_module(k.module())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_that_leave_the_context_usable_fall_back_and_no_other_error_does() {
        for r in [
            sys::CUDA_ERROR_INVALID_VALUE,
            sys::CUDA_ERROR_OUT_OF_MEMORY,
            sys::CUDA_ERROR_NO_BINARY_FOR_GPU,
            sys::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            sys::CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
            sys::CUDA_ERROR_NOT_PERMITTED,
            sys::CUDA_ERROR_NOT_SUPPORTED,
        ] {
            assert!(is_refusal(r), "{r}");
        }
        // Success, the errors that poison the context, and a capture's.
        for r in [
            CUDA_SUCCESS,
            sys::CUDA_ERROR_ILLEGAL_ADDRESS,
            sys::CUDA_ERROR_LAUNCH_FAILED,
            sys::CUDA_ERROR_UNKNOWN,
            sys::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        ] {
            assert!(!is_refusal(r), "{r}");
        }
    }
}
