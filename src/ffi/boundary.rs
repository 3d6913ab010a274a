//! The panic boundary, the last error, and pointer conversion.
//!
//! Every exported function's body runs in [`ffi_boundary!`]: a panic becomes
//! `ENGRAM_STATUS_ERR_INTERNAL` (or the function's neutral value: 0, NULL,
//! nothing), a failed call records its message for `engram_last_error`, and
//! all of that, including the recording, happens inside `catch_unwind`. The
//! message lives in a thread-local byte buffer with no destructor and no heap
//! memory, so it works at every point of a thread's or the process's
//! teardown (`atexit` handlers, C++ static destructors, pthread-key
//! destructors, which run after the thread's destructible thread-locals are
//! gone): a thread-local with a destructor would be gone there (or, touched
//! for the first time there, leak), and the standard library's `with` panics
//! on a destroyed one.
//!
//! The helpers below are where C pointers become Rust references. Each relies
//! on the contract the header states for its argument (a pointer the C caller
//! promises is valid for the stated size and lifetime); they check what can be
//! checked (NULL, alignment, sizes that overflow) and say why the rest is sound.

use crate::error::{bail, EngramStatus, Error, Result};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The longest message kept, its NUL included (bytes); a longer one is cut
/// at a character boundary.
pub(crate) const LAST_ERROR_BYTES: usize = 2048;

thread_local! {
    /// The last message, NUL-terminated. Plain bytes, `const`-initialised:
    /// no destructor is registered, so it never goes away before its thread.
    static LAST_ERROR: RefCell<[u8; LAST_ERROR_BYTES]> =
        const { RefCell::new([0; LAST_ERROR_BYTES]) };
}

/// Record `msg` as the calling thread's last error (NULs become spaces).
/// Allocates nothing; `try_with` and `try_borrow_mut` make it a no-op
/// rather than a panic should the storage be unavailable.
pub(crate) fn set_last_error(msg: &str) {
    let _ = LAST_ERROR.try_with(|e| {
        if let Ok(mut buf) = e.try_borrow_mut() {
            let mut n = msg.len().min(LAST_ERROR_BYTES - 1);
            while !msg.is_char_boundary(n) {
                n -= 1;
            }
            for (d, &b) in buf.iter_mut().zip(&msg.as_bytes()[..n]) {
                *d = if b == 0 { b' ' } else { b };
            }
            buf[n] = 0;
        }
    });
}

/// What an export returns when its body panicked.
pub trait FfiReturn: Sized {
    const PANICKED: Self;
}

impl FfiReturn for EngramStatus {
    const PANICKED: Self = EngramStatus::ErrInternal;
}
impl FfiReturn for usize {
    const PANICKED: Self = 0;
}
impl FfiReturn for u64 {
    const PANICKED: Self = 0;
}
impl FfiReturn for () {
    const PANICKED: Self = ();
}
impl FfiReturn for *const c_char {
    const PANICKED: Self = c"".as_ptr();
}

/// An export body's value as the C return value: a `Result<()>` becomes a
/// status (recording the error's message), anything else passes through.
pub trait IntoFfi<R> {
    fn into_ffi(self) -> R;
}

impl IntoFfi<EngramStatus> for Result<()> {
    fn into_ffi(self) -> EngramStatus {
        match self {
            Ok(()) => EngramStatus::Ok,
            Err(e) => {
                set_last_error(&e.message);
                e.status
            }
        }
    }
}

impl<T: FfiReturn> IntoFfi<T> for T {
    fn into_ffi(self) -> T {
        self
    }
}

/// Run `f` (an export's body) inside the panic boundary.
pub fn run<R: FfiReturn>(f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            // Describing and dropping the payload run inside a boundary too.
            let _ = catch_unwind(AssertUnwindSafe(move || {
                let what = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                set_last_error(&format!(
                    "internal error (panic caught at the C boundary): {what}"
                ));
                drop(payload);
            }));
            R::PANICKED
        }
    }
}

/// The body of every exported function: `ffi_boundary!({ ... })`. The block's
/// value is a `Result<()>` (the export returns `engram_status`) or the
/// export's own return type; a panic returns that type's neutral value.
macro_rules! ffi_boundary {
    ($body:block) => {
        $crate::ffi::boundary::run(move || {
            // The library's FP mode for the body, the caller's back after.
            let _fp = $crate::fpmode::FpMode::enter();
            // The inner closure lets the body use `?`.
            #[allow(clippy::redundant_closure_call)]
            let r = (move || $body)();
            $crate::ffi::boundary::IntoFfi::into_ffi(r)
        })
    };
}

fn check_ptr(p: *const c_void, n: usize, size: usize, align: usize, what: &str) -> Result<()> {
    if p.is_null() {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    if !(p as usize).is_multiple_of(align) {
        bail!(ErrInvalidArgument, "{what} is not aligned to {align} bytes");
    }
    if n.checked_mul(size).is_none_or(|b| b > isize::MAX as usize) {
        bail!(ErrInvalidArgument, "{what}: {n} elements is too large");
    }
    Ok(())
}

pub(crate) fn non_null<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    Ok(())
}

/// A borrowed slice from a C pointer and element count. NULL is accepted only
/// for an empty slice; misaligned or oversized pointers are refused. The
/// header requires `p` to point to `n` readable `T`s for the call (or, for
/// the layer weights, while the layer is set).
pub(crate) fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    check_ptr(p.cast(), n, size_of::<T>(), align_of::<T>(), what)?;
    // SAFETY: non-null, aligned, and the size fits isize (checked above); the
    // C caller promises `n` readable `T`s (the header's contract for `what`).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// As [`slice`], for memory the call writes and nothing else accesses meanwhile.
pub(crate) fn slice_mut<'a, T>(p: *mut T, n: usize, what: &str) -> Result<&'a mut [T]> {
    if n == 0 {
        return Ok(&mut []);
    }
    check_ptr(
        p.cast_const().cast(),
        n,
        size_of::<T>(),
        align_of::<T>(),
        what,
    )?;
    // SAFETY: as `slice`; the C caller promises exclusive, writable memory.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// A reference to an object the library handed out (a context, tables).
pub(crate) fn object<'a, T>(p: *const T, what: &str) -> Result<&'a T> {
    non_null(p, what)?;
    // SAFETY: the header requires `p` to be NULL (refused above) or an object
    // this library created whose free has not returned; a context's free
    // waits for the calls entered on it before it frees the memory.
    Ok(unsafe { &*p })
}

/// Take back ownership of an object the library handed out (NULL: `None`).
pub(crate) fn take_object<T>(p: *mut T) -> Option<Box<T>> {
    // SAFETY: the header requires `p` to be NULL or an object from
    // `Box::into_raw` in this library, not yet freed, with no call on it in
    // flight (for a context, `engram_free` has waited for its calls).
    (!p.is_null()).then(|| unsafe { Box::from_raw(p) })
}

/// Hand an object to the caller through `out` (checked non-NULL).
pub(crate) fn give_object<T>(out: *mut *mut T, obj: T) {
    // SAFETY: the callers checked `out` with `non_null`; the header requires
    // it to be writable.
    unsafe { *out = Box::into_raw(Box::new(obj)) };
}

/// An options struct the caller fills (it starts with `struct_size`): the
/// header's `_init` call that fills it, named when its `struct_size` looks
/// uninitialised.
pub(crate) trait Options: Copy {
    const INIT: &'static str;
}

/// The largest `struct_size` a header of ours could state: every options
/// struct is a few hundred bytes, and a newer header adds a few fields at a
/// time. A larger size is not a newer header but an uninitialised struct.
pub(crate) const STRUCT_SIZE_SANE: usize = 4096;

/// Read an options struct that starts with `struct_size`: `struct_size` bytes
/// over `defaults`, so that a caller built against an older, smaller header
/// keeps working. `layouts` are the sizes of every layout this library reads,
/// oldest first, the last one `sizeof(T)`: each ends on a field boundary, so
/// a field is read whole or not at all. A `struct_size` larger than this
/// library's struct (a newer header) is `ErrStructSize` naming both sizes; any
/// other size that is not a layout's (one that would cut a field, say half a
/// pointer) is `ErrStructSize` naming the layouts. A size no header of ours
/// could have had (0, below the oldest layout, above [`STRUCT_SIZE_SANE`],
/// or larger than ours and not a multiple of the struct's alignment) is
/// `ErrStructSize` saying the struct looks uninitialised and naming its
/// `_init` call.
pub(crate) fn read_options<T: Options>(
    p: *const T,
    defaults: T,
    layouts: &[usize],
    name: &str,
) -> Result<T> {
    debug_assert!(
        layouts.windows(2).all(|w| w[0] < w[1]) && layouts.last() == Some(&size_of::<T>())
    );
    non_null(p, name)?;
    // SAFETY: every options struct starts with a `size_t struct_size`, which
    // the caller's struct of any version holds; read unaligned in case the
    // caller packed it oddly.
    let size = unsafe { std::ptr::read_unaligned(p.cast::<usize>()) };
    let ours = size_of::<T>();
    let garbage = size < layouts[0]
        || size > STRUCT_SIZE_SANE
        || (size > ours && !size.is_multiple_of(align_of::<T>()));
    if garbage {
        bail!(
            ErrStructSize,
            "{name}.struct_size is {size}, a size no header of this library had (this library's is {ours} bytes): the struct looks uninitialised; fill it with {}() before setting its fields",
            T::INIT
        );
    }
    if size > ours {
        bail!(
            ErrStructSize,
            "{name}.struct_size is {size}, larger than this library's {ours} (v{}): the header is newer than the library",
            env!("CARGO_PKG_VERSION")
        );
    }
    if !layouts.contains(&size) {
        let known: Vec<String> = layouts.iter().map(usize::to_string).collect();
        bail!(
            ErrStructSize,
            "{name}.struct_size is {size}, not the size of any layout this library (v{}) reads ({} bytes)",
            env!("CARGO_PKG_VERSION"),
            known.join(" or ")
        );
    }
    let mut out = defaults;
    // SAFETY: the caller's struct holds `size` bytes (it says so in
    // `struct_size`); `out` holds `ours >= size`; `T` is plain data (integers,
    // floats, pointers), for which any bytes are a valid value.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut out).cast::<u8>(), size) };
    Ok(out)
}

/// Write the first `min(size, sizeof(T))` bytes of `value` to `p` (an `*_init`
/// call from a caller whose struct is `size` bytes), with `struct_size` set to
/// what was written.
pub(crate) fn write_options<T: Copy>(p: *mut T, value: T, size: usize) {
    if p.is_null() {
        return;
    }
    let n = size.min(size_of::<T>());
    if n < size_of::<usize>() {
        return;
    }
    // SAFETY: the caller's struct is `size >= n` writable bytes (the header's
    // inline init passes `sizeof *p`); `value` is plain data of `sizeof(T) >= n` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping((&raw const value).cast::<u8>(), p.cast::<u8>(), n);
        std::ptr::write_unaligned(p.cast::<usize>(), n);
    }
}

/// A C path argument as a `Path`.
pub(crate) fn path_arg<'a>(p: *const c_char, what: &str) -> Result<&'a std::path::Path> {
    non_null(p, what)?;
    // SAFETY: the header requires a NUL-terminated string (non-NULL, checked).
    let s = unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| {
        Error::new(
            EngramStatus::ErrInvalidArgument,
            format!("{what} is not UTF-8"),
        )
    })?;
    if s.is_empty() {
        bail!(ErrInvalidArgument, "{what} is empty");
    }
    Ok(std::path::Path::new(s))
}

/// The library version, `"MAJOR.MINOR.PATCH"` (equal to the header's
/// `ENGRAM_VERSION_STRING` when header and library match).
#[no_mangle]
pub extern "C" fn engram_version() -> *const c_char {
    ffi_boundary!({
        static V: &CStr =
            match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
                Ok(v) => v,
                Err(_) => panic!("version string"),
            };
        V.as_ptr()
    })
}

/// A static description of a status code (unknown codes included).
#[no_mangle]
pub extern "C" fn engram_status_str(status: i32) -> *const c_char {
    ffi_boundary!({
        let s: &'static CStr = match EngramStatus::from_i32(status) {
            Some(st) => status_cstr(st),
            None => c"unknown status",
        };
        s.as_ptr()
    })
}

/// `EngramStatus::as_str` as C strings, built once.
fn status_cstr(s: EngramStatus) -> &'static CStr {
    static T: std::sync::OnceLock<Vec<CString>> = std::sync::OnceLock::new();
    let t = T.get_or_init(|| {
        EngramStatus::ALL
            .iter()
            .map(|s| CString::new(s.as_str()).expect("no NUL in status text"))
            .collect()
    });
    let i = EngramStatus::ALL
        .iter()
        .position(|x| *x == s)
        .expect("every status is in ALL");
    &t[i]
}

/// The message of the last failed call on the calling thread ("" if none).
/// A successful call does not clear it: read it right after the call that
/// failed. Valid until the next failing call on this thread. Messages are
/// kept in a fixed per-thread buffer (cut at 2047 bytes) that needs no
/// destructor, so failing calls and this one work in `atexit` handlers, C++
/// static destructors and thread-exit (pthread-key) destructors too.
#[no_mangle]
pub extern "C" fn engram_last_error() -> *const c_char {
    ffi_boundary!({
        LAST_ERROR
            .try_with(|e| e.try_borrow().map_or(c"".as_ptr(), |m| m.as_ptr().cast()))
            .unwrap_or(c"".as_ptr())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_strings_cover_every_status() {
        for s in EngramStatus::ALL {
            // SAFETY: engram_status_str returns a static C string.
            let c = unsafe { CStr::from_ptr(engram_status_str(s as i32)) };
            assert_eq!(c.to_str().unwrap(), s.as_str());
        }
        // SAFETY: as the loop's call: engram_status_str returns a static C string
        // for unknown codes too ("unknown status").
        let c = unsafe { CStr::from_ptr(engram_status_str(12345)) };
        assert_eq!(c.to_str().unwrap(), "unknown status");
    }

    #[test]
    fn panics_become_internal_errors() {
        let st: EngramStatus = ffi_boundary!({
            if true {
                panic!("boom");
            }
            Ok(())
        });
        assert_eq!(st, EngramStatus::ErrInternal);
        // SAFETY: engram_last_error returns a NUL-terminated string.
        let msg = unsafe { CStr::from_ptr(engram_last_error()) }
            .to_str()
            .unwrap();
        assert!(msg.contains("boom"), "{msg}");
        let n: usize = ffi_boundary!({
            if true {
                panic!("boom");
            }
            7usize
        });
        assert_eq!(n, 0);
    }

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        let last = || {
            // SAFETY: engram_last_error returns a NUL-terminated string.
            unsafe { CStr::from_ptr(engram_last_error()) }
                .to_str()
                .unwrap()
                .to_owned()
        };
        set_last_error(&"é".repeat(LAST_ERROR_BYTES));
        let m = last();
        assert_eq!(
            m.len(),
            LAST_ERROR_BYTES - 2,
            "cut before the last whole 'é'"
        );
        assert!(m.chars().all(|c| c == 'é'));
        set_last_error("a\0b");
        assert_eq!(last(), "a b");
    }

    #[test]
    fn options_of_every_size() {
        #[derive(Clone, Copy, Debug, PartialEq)]
        #[repr(C)]
        struct Opt {
            struct_size: usize,
            a: u32,
            b: u32,
        }
        impl Options for Opt {
            const INIT: &'static str = "opt_init";
        }
        let d = Opt {
            struct_size: 16,
            a: 1,
            b: 2,
        };
        // An older caller's 12-byte struct: `b` keeps its default.
        let old = Opt {
            struct_size: 12,
            a: 9,
            b: 77,
        };
        assert_eq!(
            read_options(&old, d, &[12, 16], "o").unwrap(),
            Opt {
                struct_size: 12,
                a: 9,
                b: 2
            }
        );
        let newer = Opt {
            struct_size: 24,
            ..d
        };
        let e = read_options(&newer, d, &[12, 16], "o").unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrStructSize);
        assert!(
            e.message.contains("24") && e.message.contains("16"),
            "{}",
            e.message
        );
        // Between the layouts: half of `b`, refused naming the layouts.
        let cut = Opt {
            struct_size: 14,
            ..d
        };
        let e = read_options(&cut, d, &[12, 16], "o").unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrStructSize);
        assert!(e.message.contains("12 or 16"), "{}", e.message);
        let tiny = Opt {
            struct_size: 8,
            ..d
        };
        assert_eq!(
            read_options(&tiny, d, &[12, 16], "o").unwrap_err().status,
            EngramStatus::ErrStructSize
        );
        // An uninitialised struct: a size no header had is told apart from a
        // newer header, naming the init call (below the oldest layout, 0,
        // absurdly large, or larger than ours and misaligned).
        for garbage in [8, 0, 0xDEAD_BEEF_DEAD_BEEF, STRUCT_SIZE_SANE + 8, 21] {
            let g = Opt {
                struct_size: garbage,
                ..d
            };
            let e = read_options(&g, d, &[12, 16], "o").unwrap_err();
            assert_eq!(e.status, EngramStatus::ErrStructSize);
            assert!(
                e.message.contains("uninitialised")
                    && e.message.contains("opt_init()")
                    && !e.message.contains("newer"),
                "{garbage}: {}",
                e.message
            );
        }
        // A plausible newer header (aligned, sane) still says so.
        let e = read_options(&newer, d, &[12, 16], "o").unwrap_err();
        assert!(e.message.contains("newer") && !e.message.contains("uninitialised"));
        let mut w = Opt {
            struct_size: 0,
            a: 0,
            b: 55,
        };
        write_options(&mut w, d, 12);
        assert_eq!(
            w,
            Opt {
                struct_size: 12,
                a: 1,
                b: 55
            }
        );
    }
}
