//! `libengram_emu.so`: test only, never installed or shipped. The whole
//! engram C ABI (this library links the `engram` crate, whose `#[no_mangle]`
//! exports it re-exports unchanged), plus a few `engram_emu_*` calls that
//! put the CUDA backend on the SIMT emulation (`engram::cuda::emu`: the
//! kernels of `kernels/` compiled as host C++ with the shim of
//! `tests/simt`) and give a caller emulated device memory:
//!
//! - `engram_emu_load(dir)`: build `libengram_simt.so` for this checkout
//!   into `dir` (shared with the Rust tests' build of the same sources:
//!   `tests/common/simt_build.rs`; `ENGRAM_SIMT_LIB` names a prebuilt one),
//!   load it, and make it the process device
//!   (`engram::cuda::set_process_device`), so every CUDA context created
//!   afterwards through `engram_create` (device 0) runs on it;
//!   `ENGRAM_STATUS_ERR_UNSUPPORTED` where there is no C++ compiler;
//! - `engram_emu_alloc`, `_free`, `_upload`, `_download`: emulated device
//!   memory (what the backend's pointer checks see as device memory) and
//!   copies to and from it;
//! - `engram_emu_launches(kernel)`: the launches of a kernel so far (a test
//!   shows the CUDA backend's kernels ran);
//! - `engram_emu_last_error()`: the calling thread's message of its last
//!   failed `engram_emu_*` call.
//!
//! Nothing here is in `include/engram.h` or in `libengram.so`: the
//! production C ABI has no door to the emulation. `python/test.sh` builds
//! this library and runs `python/tests/test_distributed_cuda.py` with
//! `ENGRAM_LIBRARY` naming it.

use engram::cuda::emu::Emulator;
use engram::cuda::gpu::{Gpu, MemKind};
use engram::{EngramStatus, Error, Result};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

// The engram C ABI, exported from this library as from libengram.so.
pub use engram::ffi::*;

#[path = "../../../tests/common/simt_build.rs"]
mod simt_build;

/// The loaded emulation (one per process; never unloaded).
static EMU: Mutex<Option<Arc<Emulator>>> = Mutex::new(None);

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn fail(status: EngramStatus, message: String) -> Error {
    Error::new(status, message)
}

/// Run an export's body: a panic is `ERR_INTERNAL`, an error's message is
/// kept for `engram_emu_last_error`.
fn boundary(f: impl FnOnce() -> Result<()>) -> EngramStatus {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        Err(fail(
            EngramStatus::ErrInternal,
            "engram-emu: a panic (see stderr)".into(),
        ))
    });
    match r {
        Ok(()) => EngramStatus::Ok,
        Err(e) => {
            let msg = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
            LAST_ERROR.with(|l| *l.borrow_mut() = msg);
            e.status
        }
    }
}

fn emulator() -> Result<Arc<Emulator>> {
    EMU.lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .ok_or_else(|| {
            fail(
                EngramStatus::ErrDevice,
                "engram-emu: the emulation is not loaded (engram_emu_load)".into(),
            )
        })
}

/// `libengram_simt.so` for this checkout: `ENGRAM_SIMT_LIB`, else built
/// into (or found in) `dir`.
fn simt_library(dir: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("ENGRAM_SIMT_LIB") {
        return Ok(PathBuf::from(p));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    match simt_build::build(&root, dir) {
        Ok(Some(p)) => Ok(p),
        Ok(None) => Err(fail(
            EngramStatus::ErrUnsupported,
            "engram-emu: no C++ compiler (CXX, default g++) to build the SIMT emulation".into(),
        )),
        Err(e) => Err(fail(EngramStatus::ErrDevice, e)),
    }
}

/// Load the emulation (built into `dir` if needed) and make it the process
/// device; a second call keeps the first one.
///
/// # Safety
/// `dir` is a NUL-terminated path.
#[no_mangle]
pub unsafe extern "C" fn engram_emu_load(dir: *const c_char) -> EngramStatus {
    boundary(|| {
        let mut emu = EMU.lock().unwrap_or_else(|p| p.into_inner());
        if emu.is_some() {
            return Ok(());
        }
        if dir.is_null() {
            return Err(fail(EngramStatus::ErrNullArgument, "dir is NULL".into()));
        }
        // SAFETY: the caller's contract: a NUL-terminated path.
        let dir = unsafe { CStr::from_ptr(dir) }
            .to_string_lossy()
            .into_owned();
        let lib = simt_library(Path::new(&dir))?;
        let e = Emulator::load(&lib)?;
        let gpu: Arc<dyn Gpu> = e.clone();
        engram::cuda::set_process_device(Some(gpu));
        *emu = Some(e);
        Ok(())
    })
}

/// The calling thread's message of its last failed `engram_emu_*` call.
#[no_mangle]
pub extern "C" fn engram_emu_last_error() -> *const c_char {
    // The thread's own buffer: valid until its next failed call.
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// `bytes` of emulated device memory (0xFF-filled) at `*out`.
///
/// # Safety
/// `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn engram_emu_alloc(bytes: usize, out: *mut u64) -> EngramStatus {
    boundary(|| {
        if out.is_null() {
            return Err(fail(EngramStatus::ErrNullArgument, "out is NULL".into()));
        }
        let p = emulator()?.alloc(bytes, "engram_emu_alloc")?;
        // SAFETY: the caller's contract: `out` is writable.
        unsafe { *out = p };
        Ok(())
    })
}

/// Free what `engram_emu_alloc` returned (0: nothing).
///
/// # Safety
/// No queued work uses it (the emulation runs work when it is queued).
#[no_mangle]
pub unsafe extern "C" fn engram_emu_free(p: u64) -> EngramStatus {
    boundary(|| {
        if p != 0 {
            // SAFETY: the caller's contract: nothing uses it any more.
            unsafe { emulator()?.free(p) };
        }
        Ok(())
    })
}

/// `[p, p + bytes)` lies in one emulated device allocation.
fn check_range(emu: &Emulator, p: u64, bytes: usize) -> Result<()> {
    let inside = emu.pointer(p).is_some_and(|i| {
        i.kind == MemKind::Device
            && i.range
                .is_some_and(|(base, size)| p + bytes as u64 <= base + size as u64)
    });
    if !inside {
        return Err(fail(
            EngramStatus::ErrInvalidArgument,
            format!(
                "engram-emu: {bytes} bytes at {p:#x} are not in one emulated device allocation"
            ),
        ));
    }
    Ok(())
}

/// Copy `bytes` from host memory `src` to emulated device memory `dst`.
///
/// # Safety
/// `src` is readable for `bytes`.
#[no_mangle]
pub unsafe extern "C" fn engram_emu_upload(
    dst: u64,
    src: *const c_void,
    bytes: usize,
) -> EngramStatus {
    boundary(|| {
        let emu = emulator()?;
        check_range(&emu, dst, bytes)?;
        if bytes > 0 && src.is_null() {
            return Err(fail(EngramStatus::ErrNullArgument, "src is NULL".into()));
        }
        // SAFETY: `dst` holds `bytes` (checked), `src` is readable (the caller's contract).
        unsafe { emu.upload(dst, src.cast(), bytes) }
    })
}

/// Copy `bytes` from emulated device memory `src` to host memory `dst`,
/// after the work queued before it.
///
/// # Safety
/// `dst` is writable for `bytes`.
#[no_mangle]
pub unsafe extern "C" fn engram_emu_download(
    dst: *mut c_void,
    src: u64,
    bytes: usize,
) -> EngramStatus {
    boundary(|| {
        let emu = emulator()?;
        check_range(&emu, src, bytes)?;
        if bytes > 0 && dst.is_null() {
            return Err(fail(EngramStatus::ErrNullArgument, "dst is NULL".into()));
        }
        // SAFETY: `src` holds `bytes` (checked), `dst` is writable (the caller's contract).
        unsafe { emu.download(dst.cast(), src, bytes) }
    })
}

/// Launches of kernel `name` on the emulation so far (0 when not loaded).
///
/// # Safety
/// `name` is a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn engram_emu_launches(name: *const c_char) -> u64 {
    catch_unwind(AssertUnwindSafe(|| {
        let Ok(emu) = emulator() else { return 0 };
        if name.is_null() {
            return 0;
        }
        // SAFETY: the caller's contract: NUL-terminated.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        emu.launches().get(name.as_ref()).copied().unwrap_or(0)
    }))
    .unwrap_or(0)
}
