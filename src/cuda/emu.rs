//! An emulated device for machines without a GPU (tests): the CUDA backend's
//! own code runs unchanged on it, and the kernels it launches are the files
//! of `kernels/`, compiled unmodified as host C++ with the SIMT shim of
//! `tests/simt` into `libengram_simt.so`, which this module loads.
//!
//! - device memory is host memory (allocations are registered, so the
//!   backend's pointer checks see device memory where a GPU would; fresh
//!   allocations are filled with 0xFF bytes, a NaN in bf16 and f32, so a
//!   kernel that reads memory nobody wrote shows it; allocations of 1 MiB
//!   and more are mapped lazily, so a table of the real row count can be
//!   reserved without being touched);
//! - copies are copies, done when they are queued; events and streams are
//!   trivial (nothing is ever in flight); no stream is ever capturing;
//! - a launch is `simt_launch` on the same argument array the backend built,
//!   after checking the argument sizes against the kernel's parameters;
//! - the GEMM is a host loop: f32 sums in k order of exact products (bf16 x
//!   bf16, or f32 x f32 rounded once), rounded once to the output type: an
//!   f32 sum in some order, as cuBLAS's is, within the same bound
//!   (`tests/common/bounds.rs` `kv_bound`).

use super::gpu::{
    Arg, Blas, DevPtr, Gemm, Gpu, Guard, Kernel, MemKind, PtrInfo, Stream, KERNEL_NAMES,
};
use crate::error::{bail, EngramStatus, Error, Result};
use crate::formats::{bf16_to_f32, f32_to_bf16};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

type LaunchFn = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut *mut c_void,
    u64,
) -> c_int;
type ParamsFn = unsafe extern "C" fn(*const c_char, *mut c_uint, c_uint) -> c_int;
type StrFn = unsafe extern "C" fn() -> *const c_char;
type WorkersFn = unsafe extern "C" fn(c_uint);

/// Allocations at least this large are mapped lazily (never touched by the
/// emulation itself).
const LAZY_BYTES: usize = 1 << 20;

#[derive(Clone, Copy, Debug)]
struct Alloc {
    size: usize,
    kind: MemKind,
    /// Mapped with mmap (else posix_memalign): how to free it.
    mapped: bool,
    piece: Piece,
}

/// How an allocation relates to [`Emulator::alloc_pieces`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Piece {
    /// A plain allocation.
    Whole,
    /// The first piece: frees the whole mapping, `(base, bytes)`.
    First(u64, usize),
    /// A later piece (freed with the first).
    Later,
}

/// `libengram_simt.so` and the emulated device's memory.
pub struct Emulator {
    path: String,
    launch_fn: LaunchFn,
    params_fn: ParamsFn,
    last_error_fn: StrFn,
    build_info: String,
    set_workers_fn: WorkersFn,
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    seed: AtomicU64,
    events: AtomicUsize,
    /// Launches so far, by kernel (tests check which kernels ran).
    launches: Mutex<BTreeMap<&'static str, u64>>,
}

// SAFETY: function pointers into a library that stays loaded, and state
// behind locks and atomics.
unsafe impl Send for Emulator {}
// SAFETY: as above; the SIMT library serialises launches itself.
unsafe impl Sync for Emulator {}

impl std::fmt::Debug for Emulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Emulator({})", self.path)
    }
}

fn sym(h: *mut c_void, name: &str, path: &str) -> Result<*mut c_void> {
    let c = CString::new(name).expect("no NUL");
    // SAFETY: a live handle and a NUL-terminated name.
    let p = unsafe { libc::dlsym(h, c.as_ptr()) };
    if p.is_null() {
        bail!(ErrDevice, "{path} lacks {name}: not a libengram_simt.so");
    }
    Ok(p)
}

impl Emulator {
    /// Load `libengram_simt.so` (built by `tests/simt/build.sh` with the
    /// `-D` options of [`super::kernels::defines`]) and check that it has
    /// every kernel the backend launches.
    pub fn load(path: &Path) -> Result<Arc<Emulator>> {
        let p = path.to_string_lossy().into_owned();
        let c = CString::new(p.clone())
            .map_err(|_| Error::new(EngramStatus::ErrInvalidArgument, "a path with a NUL"))?;
        // SAFETY: plain dlopen of a NUL-terminated path; never closed.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            // SAFETY: dlerror's string, or NULL.
            let e = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    "unknown error".into()
                } else {
                    CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            bail!(ErrDevice, "cannot load the SIMT emulation {p}: {e}");
        }
        // SAFETY: the symbols are the C functions of simt_abi.h with these
        // signatures.
        let emu = unsafe {
            Emulator {
                launch_fn: std::mem::transmute::<*mut c_void, LaunchFn>(sym(h, "simt_launch", &p)?),
                params_fn: std::mem::transmute::<*mut c_void, ParamsFn>(sym(
                    h,
                    "simt_kernel_params",
                    &p,
                )?),
                last_error_fn: std::mem::transmute::<*mut c_void, StrFn>(sym(
                    h,
                    "simt_last_error",
                    &p,
                )?),
                set_workers_fn: std::mem::transmute::<*mut c_void, WorkersFn>(sym(
                    h,
                    "simt_set_workers",
                    &p,
                )?),
                build_info: {
                    let f =
                        std::mem::transmute::<*mut c_void, StrFn>(sym(h, "simt_build_info", &p)?);
                    CStr::from_ptr(f()).to_string_lossy().into_owned()
                },
                path: p,
                allocs: Mutex::new(BTreeMap::new()),
                seed: AtomicU64::new(0x5eed),
                events: AtomicUsize::new(1),
                launches: Mutex::new(BTreeMap::new()),
            }
        };
        for name in KERNEL_NAMES {
            if emu.params(name).is_none() {
                bail!(
                    ErrDevice,
                    "{} has no kernel {name}: rebuild it from this tree's kernels/",
                    emu.path
                );
            }
        }
        Ok(Arc::new(emu))
    }

    /// How the SIMT library was built (`simt_build_info`).
    pub fn build_info(&self) -> &str {
        &self.build_info
    }

    /// Host threads that run blocks (0: the library's default).
    pub fn set_workers(&self, n: u32) {
        // SAFETY: a plain setter of the library.
        unsafe { (self.set_workers_fn)(n) }
    }

    /// Launches of each kernel so far.
    pub fn launches(&self) -> BTreeMap<&'static str, u64> {
        self.launches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The parameter sizes of kernel `name`.
    fn params(&self, name: &str) -> Option<Vec<usize>> {
        let c = CString::new(name).ok()?;
        let mut sizes = [0 as c_uint; 64];
        // SAFETY: a NUL-terminated name and an array of 64 entries.
        let n = unsafe { (self.params_fn)(c.as_ptr(), sizes.as_mut_ptr(), 64) };
        (n >= 0).then(|| {
            sizes[..(n as usize).min(64)]
                .iter()
                .map(|&s| s as usize)
                .collect()
        })
    }

    fn last_error(&self) -> String {
        // SAFETY: the library's per-thread message, NUL-terminated.
        unsafe {
            let p = (self.last_error_fn)();
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    fn allocs(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Alloc>> {
        self.allocs.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn raw_alloc(bytes: usize, what: &str) -> Result<(u64, bool)> {
        let bytes = bytes.max(1);
        if bytes >= LAZY_BYTES {
            // SAFETY: an anonymous private mapping we own; pages are
            // allocated when first touched (MAP_NORESERVE: no commit up front).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                bail!(
                    ErrDevice,
                    "allocating {bytes} bytes of (emulated) device memory for {what}: {}",
                    std::io::Error::last_os_error()
                );
            }
            return Ok((p as u64, true));
        }
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign with a power-of-two alignment; on success
        // `p` holds `bytes` bytes we own, filled here.
        unsafe {
            if libc::posix_memalign(&mut p, 256, bytes) != 0 {
                bail!(
                    ErrDevice,
                    "allocating {bytes} bytes of (emulated) device memory for {what}"
                );
            }
            std::ptr::write_bytes(p as *mut u8, 0xFF, bytes);
        }
        Ok((p as u64, false))
    }

    fn raw_free(p: u64, a: &Alloc) {
        // SAFETY: `p` came from raw_alloc with these properties, freed once.
        unsafe {
            if a.mapped {
                libc::munmap(p as *mut c_void, a.size.max(1));
            } else {
                libc::free(p as *mut c_void);
            }
        }
    }

    /// Emulated device memory in `sizes.len()` separate allocations that
    /// follow each other in the address space (as PyTorch's expandable
    /// segments map memory): the address of the first. Freed with
    /// [`Gpu::free`] of that address.
    pub fn alloc_pieces(&self, sizes: &[usize]) -> Result<DevPtr> {
        let total: usize = sizes.iter().sum();
        let (base, _) = Self::raw_alloc(total.max(LAZY_BYTES), "pieces")?;
        let mut m = self.allocs();
        let mut at = base;
        for (i, &s) in sizes.iter().enumerate() {
            m.insert(
                at,
                Alloc {
                    size: s,
                    kind: MemKind::Device,
                    mapped: true,
                    piece: if i == 0 {
                        Piece::First(base, total.max(LAZY_BYTES))
                    } else {
                        Piece::Later
                    },
                },
            );
            at += s as u64;
        }
        Ok(base)
    }

    /// Forget the piece of a pieced allocation that starts at `p` (not the
    /// first): a hole in the address space between its neighbours, as when
    /// one piece of an expandable segment is unmapped.
    pub fn unmap_piece(&self, p: DevPtr) {
        let mut m = self.allocs();
        if m.get(&p).is_some_and(|a| a.piece == Piece::Later) {
            m.remove(&p);
        }
    }

    fn find(&self, p: u64) -> Option<(u64, Alloc)> {
        let m = self.allocs();
        let (&base, &a) = m.range(..=p).next_back()?;
        (p < base + a.size.max(1) as u64).then_some((base, a))
    }
}

impl Gpu for Emulator {
    fn describe(&self) -> String {
        format!(
            "SIMT emulation of the CUDA kernels ({}; {}), host GEMM",
            self.path, self.build_info
        )
    }

    fn ordinal(&self) -> i32 {
        0
    }

    fn enter(&self) -> Result<Guard> {
        Ok(Guard::none())
    }

    fn alloc(&self, bytes: usize, what: &str) -> Result<DevPtr> {
        let (p, mapped) = Self::raw_alloc(bytes, what)?;
        self.allocs().insert(
            p,
            Alloc {
                size: bytes,
                kind: MemKind::Device,
                mapped,
                piece: Piece::Whole,
            },
        );
        Ok(p)
    }

    unsafe fn free(&self, p: DevPtr) {
        let mut m = self.allocs();
        match m.get(&p).copied() {
            Some(
                a @ Alloc {
                    piece: Piece::Whole,
                    ..
                },
            ) => {
                m.remove(&p);
                Self::raw_free(p, &a);
            }
            Some(
                a @ Alloc {
                    piece: Piece::First(base, total),
                    ..
                },
            ) => {
                let keys: Vec<u64> = m
                    .range(base..base + total as u64)
                    .map(|(&k, _)| k)
                    .collect();
                for k in keys {
                    m.remove(&k);
                }
                Self::raw_free(base, &Alloc { size: total, ..a });
            }
            _ => {}
        }
    }

    fn host_alloc(&self, bytes: usize, _mapped: bool, what: &str) -> Result<(*mut u8, DevPtr)> {
        let (p, mapped) = Self::raw_alloc(bytes, what)?;
        if !mapped {
            // SAFETY: our new allocation of `bytes` (pinned memory is zeroed).
            unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes.max(1)) };
        }
        self.allocs().insert(
            p,
            Alloc {
                size: bytes,
                kind: MemKind::Host,
                mapped,
                piece: Piece::Whole,
            },
        );
        Ok((p as *mut u8, p))
    }

    unsafe fn host_free(&self, p: *mut u8) {
        // SAFETY: as `free`.
        unsafe { self.free(p as u64) }
    }

    unsafe fn memset(&self, p: DevPtr, v: u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract (emulated device memory is host memory).
        unsafe { std::ptr::write_bytes(p as *mut u8, v, bytes) };
        Ok(())
    }

    unsafe fn upload(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(src, dst as *mut u8, bytes) };
        Ok(())
    }

    unsafe fn download(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(src as *const u8, dst, bytes) };
        Ok(())
    }

    unsafe fn upload_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        _stream: Stream,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.upload(dst, src, bytes) }
    }

    fn event_new(&self) -> Result<usize> {
        Ok(self.events.fetch_add(1, Ordering::Relaxed))
    }

    unsafe fn event_free(&self, _ev: usize) {}

    unsafe fn event_record(&self, _ev: usize, _stream: Stream) -> Result<()> {
        Ok(())
    }

    unsafe fn event_wait(&self, _ev: usize) -> Result<()> {
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        Ok(())
    }

    fn stream_synchronize(&self, _stream: Stream) -> Result<()> {
        Ok(())
    }

    fn stream_capturing(&self, _stream: Stream) -> Result<bool> {
        Ok(false)
    }

    fn pointer(&self, p: u64) -> Option<PtrInfo> {
        let (base, a) = self.find(p)?;
        Some(PtrInfo {
            kind: a.kind,
            ordinal: 0,
            range: Some((base, a.size)),
            mapped: true,
        })
    }

    unsafe fn launch(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        _stream: Stream,
        args: &[Arg],
    ) -> Result<()> {
        let name = k.name();
        let want = self.params(name).unwrap_or_default();
        let got: Vec<usize> = args.iter().map(|a| a.size).collect();
        if want != got {
            bail!(
                ErrInternal,
                "launching {name}: argument sizes {got:?}, the kernel's parameters are {want:?}"
            );
        }
        *self
            .launches
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name)
            .or_default() += 1;
        if grid == 0 {
            return Ok(());
        }
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|a| a.ptr).collect();
        let c = CString::new(name).expect("no NUL");
        let seed = self.seed.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract; the sizes were checked above.
        let r = unsafe {
            (self.launch_fn)(
                c.as_ptr(),
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                ptrs.as_mut_ptr(),
                seed,
            )
        };
        if r != 0 {
            bail!(
                ErrDevice,
                "launching {name} in the SIMT emulation: error {r}: {}",
                self.last_error()
            );
        }
        Ok(())
    }

    fn new_blas(&self) -> Result<Box<dyn Blas>> {
        Ok(Box::new(HostBlas))
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let m = std::mem::take(&mut *self.allocs());
        for (p, a) in m {
            match a.piece {
                Piece::Whole => Self::raw_free(p, &a),
                Piece::First(base, total) => Self::raw_free(base, &Alloc { size: total, ..a }),
                Piece::Later => {}
            }
        }
    }
}

/// The emulated GEMM (see the module documentation).
struct HostBlas;

impl Blas for HostBlas {
    unsafe fn gemm(&mut self, _stream: Stream, g: &Gemm) -> Result<()> {
        for t in 0..g.n {
            for o in 0..g.m {
                let mut acc = 0f32;
                // SAFETY: the caller's contract: the pointers hold the
                // matrices of `g`'s sizes (host memory in the emulation).
                unsafe {
                    if g.f32 {
                        let w = (g.w as *const f32).add(o * g.ldw);
                        let r = (g.rows as *const f32).add(t * g.ldr);
                        for i in 0..g.k {
                            acc += *w.add(i) * *r.add(i);
                        }
                        *(g.kv as *mut f32).add(t * g.ldc + o) = acc;
                    } else {
                        let w = (g.w as *const u16).add(o * g.ldw);
                        let r = (g.rows as *const u16).add(t * g.ldr);
                        for i in 0..g.k {
                            acc += bf16_to_f32(*w.add(i)) * bf16_to_f32(*r.add(i));
                        }
                        *(g.kv as *mut u16).add(t * g.ldc + o) = f32_to_bf16(acc);
                    }
                }
            }
        }
        Ok(())
    }

    fn device_bytes(&self) -> usize {
        0
    }
}
