//! `ENGRAM_CUDA_LIB_DIR` is searched for the driver (`libcuda.so.1`) first,
//! as for NVRTC and cuBLAS. Without a GPU: a directory holding a loadable
//! library named `libcuda.so.1` that is not the driver (a copy of libm)
//! must be the one opened, so the error names that path and the missing
//! driver function. (Before the fix the driver was opened by its bare
//! name only: "cannot be loaded" on a machine without a driver, the real
//! driver on one with a GPU, never the directory's file.)
//!
//! One test in its own binary: the driver is loaded once per process.

use std::ffi::{c_void, CStr, CString};
use std::path::PathBuf;

/// Where this process's libm was loaded from.
fn libm_path() -> PathBuf {
    let name = CString::new("libm.so.6").unwrap();
    // SAFETY: dlopen of a system library by a NUL-terminated name.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "libm.so.6 cannot be opened");
    #[repr(C)]
    struct LinkMap {
        l_addr: usize,
        l_name: *const std::ffi::c_char,
    }
    let mut map: *mut LinkMap = std::ptr::null_mut();
    // SAFETY: RTLD_DI_LINKMAP writes a `struct link_map *` for a live
    // handle; its first two fields are `l_addr` and `l_name` on glibc.
    let r = unsafe {
        libc::dlinfo(
            h,
            libc::RTLD_DI_LINKMAP,
            &mut map as *mut *mut LinkMap as *mut c_void,
        )
    };
    assert!(r == 0 && !map.is_null());
    // SAFETY: the loader's NUL-terminated name of a loaded object.
    let p = unsafe { CStr::from_ptr((*map).l_name) };
    PathBuf::from(p.to_str().unwrap())
}

#[test]
fn the_driver_is_looked_for_in_engram_cuda_lib_dir_first() {
    let dir = std::env::temp_dir().join(format!("engram-cuda-lib-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("libcuda.so.1");
    std::fs::copy(libm_path(), &fake).unwrap();
    // An empty entry and a directory without the library come first: skipped.
    let missing = dir.join("nothing-here");
    let v = format!("{}::{}", missing.display(), dir.display());
    // Set before any thread of this binary
    // reads the environment; this is the binary's only test.
    std::env::set_var("ENGRAM_CUDA_LIB_DIR", v);
    let e = match engram::cuda::sys::driver() {
        Ok(d) => panic!("the driver loaded from {} instead of the fake one", d.path),
        Err(e) => e,
    };
    assert!(
        e.contains(&fake.display().to_string()) && e.contains("lacks the function cu"),
        "{e}"
    );
    // Through the library's status: ERR_DEVICE with the same message.
    let e = engram::cuda::driver::api().err().expect("no driver API");
    assert_eq!(e.status, engram::EngramStatus::ErrDevice);
    assert!(
        e.message.contains(&fake.display().to_string()),
        "{}",
        e.message
    );
    std::fs::remove_dir_all(&dir).ok();
}
