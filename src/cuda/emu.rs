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
//!   trivial (nothing is ever in flight); no stream is ever capturing (but
//!   for [`Emulator::set_capturing`], a test hook);
//!   unless the emulation defers ([`Emulator::set_deferred`]): then work
//!   queued on a stream runs only when something waits for it (an event or
//!   stream synchronisation, a stream waiting on an event, a context-wide
//!   wait, which runs the legacy stream first), every non-NULL stream as a
//!   non-blocking one, so that work the backend fails to order shows; the
//!   waiting thread runs it (any thread: the stager's gather threads wait
//!   for copies' events), one thread at a time, so a wait returns once
//!   every op up to its mark has finished;
//! - a launch is `simt_launch` on the same argument array the backend built,
//!   after checking the argument sizes against the kernel's parameters, on a
//!   device of `simt_sm_count()` multiprocessors; a launch with a fallback
//!   ([`Gpu::try_launch_shared`]) is counted apart, and a test hook refuses
//!   it as a driver would ([`Emulator::set_refuse_fused`]);
//! - the GEMM is a host loop: f32 sums in k order of exact products (bf16 x
//!   bf16, or f32 x f32 rounded once), rounded once to the output type: an
//!   f32 sum in some order, as cuBLAS's is, within the same bound
//!   (`tests/common/bounds.rs` `kv_bound`).

use super::gpu::{
    Arg, Blas, DevPtr, DeviceLimits, Gemm, Gpu, Guard, Kernel, MemKind, PtrInfo, Stream,
    KERNEL_NAMES,
};
use crate::error::{bail, EngramStatus, Error, Result};
use crate::formats::{bf16_to_f32, f32_to_bf16};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
type CountFn = unsafe extern "C" fn() -> c_uint;
type OccupancyFn = unsafe extern "C" fn(c_uint, c_uint) -> c_uint;
type SetSharedFn = unsafe extern "C" fn(*const c_char, c_uint) -> c_int;

/// Most dynamic shared memory an emulated block can have once its kernel
/// opts in (`SIMT_MAX_SHARED_OPTIN` of `tests/simt/simt_abi.h`: an sm_90's).
pub const MAX_SHARED_OPTIN: u32 = 227 << 10;

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

/// Work queued on an emulated stream while the emulation defers.
struct Op {
    id: u64,
    run: Box<dyn FnOnce() -> Result<()> + Send>,
}

/// The emulated streams' queues (see [`Emulator::set_deferred`]).
#[derive(Default)]
struct Queues {
    /// By stream handle (0: the legacy stream).
    queues: BTreeMap<usize, VecDeque<Op>>,
    /// Each event's last record: its stream and the id of the marker op.
    events: HashMap<usize, (usize, u64)>,
    next_id: u64,
    /// The first error a deferred op met, reported by the next wait.
    error: Option<Error>,
}

/// Deferred execution, shared with the emulated GEMM.
#[derive(Default)]
struct Deferral {
    on: std::sync::atomic::AtomicBool,
    q: Mutex<Queues>,
    /// Context-wide waits (`synchronize`, and the legacy-stream `memset`,
    /// `upload`, `download`, which wait for the whole context on a GPU).
    ctx_syncs: AtomicU64,
    /// The thread running queued work and how deeply (an op may wait for
    /// another stream's work: `stream_wait_event`). Queued work runs on one
    /// thread at a time, in order, so that a wait on another thread (the
    /// stager's gather threads wait for a copy's event) returns only once
    /// every op up to its mark has finished, not just been taken off its
    /// queue.
    runner: Mutex<Option<(std::thread::ThreadId, usize)>>,
    runner_free: std::sync::Condvar,
}

/// Holds [`Deferral::runner`] for the current thread (reentrant).
struct Running<'a>(&'a Deferral);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut r = self.0.runner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, depth)) = r.as_mut() {
            *depth -= 1;
            if *depth == 0 {
                *r = None;
                self.0.runner_free.notify_all();
            }
        }
    }
}

impl Deferral {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queues> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Become the thread that runs queued work (waiting for another one to
    /// finish; again on the same thread, one level deeper).
    fn run_alone(&self) -> Running<'_> {
        let me = std::thread::current().id();
        let mut r = self.runner.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match r.as_mut() {
                None => {
                    *r = Some((me, 1));
                    break;
                }
                Some((t, depth)) if *t == me => {
                    *depth += 1;
                    break;
                }
                Some(_) => r = self.runner_free.wait(r).unwrap_or_else(|p| p.into_inner()),
            }
        }
        Running(self)
    }

    fn deferred(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// Run `f` now, or queue it on `stream` when deferring.
    fn submit(&self, stream: Stream, f: Box<dyn FnOnce() -> Result<()> + Send>) -> Result<()> {
        if !self.deferred() {
            return f();
        }
        let mut q = self.lock();
        q.next_id += 1;
        let id = q.next_id;
        q.queues
            .entry(stream as usize)
            .or_default()
            .push_back(Op { id, run: f });
        Ok(())
    }

    /// Run `stream`'s queued work up to and including op `upto`.
    fn run_until(&self, stream: usize, upto: u64) {
        let _alone = self.run_alone();
        loop {
            let op = {
                let mut q = self.lock();
                match q.queues.get_mut(&stream) {
                    Some(v) if v.front().is_some_and(|o| o.id <= upto) => v.pop_front(),
                    _ => None,
                }
            };
            let Some(op) = op else { return };
            if let Err(e) = (op.run)() {
                let mut q = self.lock();
                if q.error.is_none() {
                    q.error = Some(e);
                }
            }
        }
    }

    fn take_error(&self) -> Result<()> {
        match self.lock().error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Everything queued: the legacy stream first, then the others.
    fn run_all(&self) {
        let _alone = self.run_alone();
        loop {
            let streams: Vec<usize> = self
                .lock()
                .queues
                .iter()
                .filter(|(_, v)| !v.is_empty())
                .map(|(&k, _)| k)
                .collect();
            if streams.is_empty() {
                return;
            }
            for s in streams {
                self.run_until(s, u64::MAX);
            }
        }
    }

    fn record(&self, ev: usize, stream: Stream) {
        if !self.deferred() {
            return;
        }
        let mut q = self.lock();
        q.next_id += 1;
        let id = q.next_id;
        let s = stream as usize;
        q.queues.entry(s).or_default().push_back(Op {
            id,
            run: Box::new(|| Ok(())),
        });
        q.events.insert(ev, (s, id));
    }

    fn event_target(&self, ev: usize) -> Option<(usize, u64)> {
        self.lock().events.get(&ev).copied()
    }
}

/// `libengram_simt.so` and the emulated device's memory.
pub struct Emulator {
    path: String,
    launch_fn: LaunchFn,
    params_fn: ParamsFn,
    last_error_fn: StrFn,
    build_info: String,
    set_workers_fn: WorkersFn,
    sm_count_fn: CountFn,
    occupancy_fn: OccupancyFn,
    /// Test hooks: the device takes cooperative launches (its attribute),
    /// the "driver" refuses launches with a fallback (as it refuses one
    /// with too many resources for a green context or an MPS client),
    /// streams say they are capturing.
    cooperative: AtomicBool,
    refuse_fused: AtomicBool,
    capturing: AtomicBool,
    /// Launches with a fallback refused so far.
    refused: AtomicU64,
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    seed: AtomicU64,
    events: AtomicUsize,
    /// Launches so far, by kernel (tests check which kernels ran), and the
    /// launches with a fallback among them (the decode kernel with its gate).
    launches: Mutex<BTreeMap<&'static str, u64>>,
    fused_launches: Mutex<BTreeMap<&'static str, u64>>,
    deferral: Arc<Deferral>,
    streams: AtomicUsize,
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

/// The SIMT library's per-thread message of its last failure.
fn last_error_of(f: StrFn) -> String {
    // SAFETY: the library's per-thread message, NUL-terminated.
    unsafe {
        let p = f();
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
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
        let h = Self::open_library(&p)?;
        let emu = Self::bind(h, p)?;
        emu.check_kernels()?;
        emu.opt_in_shared(h)?;
        Ok(Arc::new(emu))
    }

    /// `dlopen` the library at `p` (never closed).
    fn open_library(p: &str) -> Result<*mut c_void> {
        let c = CString::new(p)
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
        Ok(h)
    }

    /// The emulator over the library `h` (at `p`): its C functions bound.
    fn bind(h: *mut c_void, p: String) -> Result<Emulator> {
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
                sm_count_fn: std::mem::transmute::<*mut c_void, CountFn>(sym(
                    h,
                    "simt_sm_count",
                    &p,
                )?),
                occupancy_fn: std::mem::transmute::<*mut c_void, OccupancyFn>(sym(
                    h,
                    "simt_max_active_blocks",
                    &p,
                )?),
                cooperative: AtomicBool::new(true),
                refuse_fused: AtomicBool::new(false),
                capturing: AtomicBool::new(false),
                refused: AtomicU64::new(0),
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
                fused_launches: Mutex::new(BTreeMap::new()),
                deferral: Arc::new(Deferral::default()),
                streams: AtomicUsize::new(1),
            }
        };
        Ok(emu)
    }

    /// Every kernel the backend launches is in the library.
    fn check_kernels(&self) -> Result<()> {
        for name in KERNEL_NAMES {
            if self.params(name).is_none() {
                bail!(
                    ErrDevice,
                    "{} has no kernel {name}: rebuild it from this tree's kernels/",
                    self.path
                );
            }
        }
        Ok(())
    }

    /// The decode kernels' shared memory opt-in, as the real device sets it
    /// when it loads them (cuFuncSetAttribute).
    fn opt_in_shared(&self, h: *mut c_void) -> Result<()> {
        // SAFETY: the C function of simt_abi.h with this signature.
        let set_shared = unsafe {
            std::mem::transmute::<*mut c_void, SetSharedFn>(sym(
                h,
                "simt_set_max_dynamic_shared",
                &self.path,
            )?)
        };
        for k in Kernel::all().into_iter().filter(|k| k.big_shared()) {
            let c = CString::new(k.name()).expect("no NUL");
            // SAFETY: a NUL-terminated name.
            if unsafe { set_shared(c.as_ptr(), MAX_SHARED_OPTIN) } != 0 {
                bail!(
                    ErrDevice,
                    "{}: the shared memory opt-in of {}: {}",
                    self.path,
                    k.name(),
                    last_error_of(self.last_error_fn)
                );
            }
        }
        Ok(())
    }

    /// Test hook: whether the emulated device says it takes cooperative
    /// launches (`CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH`; yes by default).
    /// No kernel of the backend needs them.
    pub fn set_cooperative(&self, on: bool) {
        self.cooperative.store(on, Ordering::SeqCst);
    }

    /// Test hook: refuse every launch with a fallback
    /// ([`Gpu::try_launch_shared`]) as the driver refuses one that does not
    /// fit this context (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES` in a green
    /// context, say): `Ok(false)`, nothing queued.
    pub fn set_refuse_fused(&self, on: bool) {
        self.refuse_fused.store(on, Ordering::SeqCst);
    }

    /// Launches with a fallback refused so far (each returned `Ok(false)`
    /// with nothing queued).
    pub fn fused_refusals(&self) -> u64 {
        self.refused.load(Ordering::SeqCst)
    }

    /// Test hook: every stream says it is capturing a graph (the work still
    /// runs: the emulation has no graphs), so that the backend takes the
    /// paths it takes during a capture.
    pub fn set_capturing(&self, on: bool) {
        self.capturing.store(on, Ordering::SeqCst);
    }

    /// Queue launch of `k` on `stream` (`fused`: a launch with a fallback,
    /// counted apart).
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn submit_launch(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        fused: bool,
        stream: Stream,
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
        if fused {
            *self
                .fused_launches
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(name)
                .or_default() += 1;
        }
        if grid == 0 {
            return Ok(());
        }
        // The argument values, copied now (the caller's array may be gone
        // when deferred work runs, as with cuLaunchKernel).
        let mut values: Vec<Vec<u8>> = args
            .iter()
            // SAFETY: each argument points to `size` readable bytes (the
            // caller's contract).
            .map(|a| unsafe { std::slice::from_raw_parts(a.ptr as *const u8, a.size) }.to_vec())
            .collect();
        let seed = self.seed.fetch_add(1, Ordering::Relaxed);
        let launch_fn = self.launch_fn;
        let last_error_fn = self.last_error_fn;
        self.deferral.submit(
            stream,
            Box::new(move || {
                let mut ptrs: Vec<*mut c_void> = values
                    .iter_mut()
                    .map(|v| v.as_mut_ptr() as *mut c_void)
                    .collect();
                let c = CString::new(name).expect("no NUL");
                // SAFETY: the caller's contract; the sizes were checked above.
                let r = unsafe {
                    launch_fn(
                        c.as_ptr(),
                        grid,
                        1,
                        1,
                        block,
                        1,
                        1,
                        shared,
                        ptrs.as_mut_ptr(),
                        seed,
                    )
                };
                if r != 0 {
                    bail!(
                        ErrDevice,
                        "launching {name} in the SIMT emulation: error {r}: {}",
                        last_error_of(last_error_fn)
                    );
                }
                Ok(())
            }),
        )
    }

    /// Defer the work queued on streams until something waits for it (see
    /// the module documentation), or (`false`) run everything still queued
    /// and go back to running work when it is queued.
    pub fn set_deferred(&self, on: bool) {
        self.deferral.on.store(on, Ordering::SeqCst);
        if !on {
            self.deferral.run_all();
        }
    }

    /// Work queued and not run yet (deferred), over all streams.
    pub fn pending(&self) -> usize {
        self.deferral.lock().queues.values().map(|v| v.len()).sum()
    }

    /// Context-wide waits so far: `synchronize` and the legacy-stream
    /// `memset`, `upload` and `download` (each waits for the whole context
    /// on a GPU, and invalidates a capture another thread makes in global
    /// mode).
    pub fn context_syncs(&self) -> u64 {
        self.deferral.ctx_syncs.load(Ordering::SeqCst)
    }

    fn ctx_sync(&self) -> Result<()> {
        self.deferral.ctx_syncs.fetch_add(1, Ordering::SeqCst);
        self.deferral.run_all();
        self.deferral.take_error()
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

    /// Launches with a fallback of each kernel so far (also in
    /// [`Self::launches`]).
    pub fn fused_launches(&self) -> BTreeMap<&'static str, u64> {
        self.fused_launches
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
        unsafe { self.memset_async(p, v, bytes, std::ptr::null_mut())? };
        self.ctx_sync()
    }

    unsafe fn upload(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<()> {
        // On the legacy stream, then a wait for the context; the source is
        // read before this returns (pageable memory).
        // SAFETY: `Gpu::upload`'s contract: `dst` holds `bytes` (emulated device
        // memory is host memory from `alloc`), `src` is readable for `bytes`.
        unsafe { std::ptr::copy(src, dst as *mut u8, bytes) };
        self.ctx_sync()
    }

    unsafe fn download(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<()> {
        self.ctx_sync()?;
        // SAFETY: `Gpu::download`'s contract: `src` holds `bytes` (host memory behind
        // the emulated address), `dst` is writable for `bytes`.
        unsafe { std::ptr::copy(src as *const u8, dst, bytes) };
        Ok(())
    }

    unsafe fn upload_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let (src, dst) = (src as usize, dst as usize);
        self.deferral.submit(
            stream,
            Box::new(move || {
                // SAFETY: the caller's contract: both stay valid until the
                // copy has run.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }),
        )
    }

    unsafe fn download_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()> {
        let (src, dst) = (src as usize, dst as usize);
        self.deferral.submit(
            stream,
            Box::new(move || {
                // SAFETY: as upload_async.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
                Ok(())
            }),
        )
    }

    unsafe fn memset_async(&self, p: DevPtr, v: u8, bytes: usize, stream: Stream) -> Result<()> {
        let p = p as usize;
        self.deferral.submit(
            stream,
            Box::new(move || {
                // SAFETY: `Gpu::memset_async`'s contract: `p` holds `bytes` (host memory from
                // `alloc`); `Gpu::free`'s contract (nothing queued uses it) keeps it live here.
                unsafe { std::ptr::write_bytes(p as *mut u8, v, bytes) };
                Ok(())
            }),
        )
    }

    fn stream_new(&self) -> Result<Stream> {
        // A handle no real pointer has: distinct, never dereferenced.
        let n = self.streams.fetch_add(1, Ordering::Relaxed);
        Ok((0x5700_0000usize + 16 * n) as Stream)
    }

    unsafe fn stream_free(&self, stream: Stream) {
        self.deferral.run_until(stream as usize, u64::MAX);
    }

    unsafe fn stream_wait_event(&self, stream: Stream, ev: usize) -> Result<()> {
        // The event's last record as of now (cuStreamWaitEvent's rule).
        let Some((s, id)) = self.deferral.event_target(ev) else {
            return Ok(());
        };
        let d = self.deferral.clone();
        self.deferral.submit(
            stream,
            Box::new(move || {
                d.run_until(s, id);
                Ok(())
            }),
        )
    }

    fn event_new(&self) -> Result<usize> {
        Ok(self.events.fetch_add(1, Ordering::Relaxed))
    }

    unsafe fn event_free(&self, _ev: usize) {}

    unsafe fn event_record(&self, ev: usize, stream: Stream) -> Result<()> {
        self.deferral.record(ev, stream);
        Ok(())
    }

    unsafe fn event_wait(&self, ev: usize) -> Result<()> {
        if let Some((s, id)) = self.deferral.event_target(ev) {
            self.deferral.run_until(s, id);
        }
        self.deferral.take_error()
    }

    fn synchronize(&self) -> Result<()> {
        self.ctx_sync()
    }

    fn stream_synchronize(&self, stream: Stream) -> Result<()> {
        self.deferral.run_until(stream as usize, u64::MAX);
        self.deferral.take_error()
    }

    fn stream_capturing(&self, _stream: Stream) -> Result<bool> {
        Ok(self.capturing.load(Ordering::SeqCst))
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
        stream: Stream,
        args: &[Arg],
    ) -> Result<()> {
        // SAFETY: `submit_launch`'s `# Safety` is `Gpu::launch`'s, which this
        // function's caller met (args match `k`, their pointers valid); no shared memory.
        unsafe { self.submit_launch(k, grid, block, 0, false, stream, args) }
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
        // SAFETY: `submit_launch`'s `# Safety` is `Gpu::launch`'s, which
        // `Gpu::launch_shared`'s caller met (args match `k`, their pointers valid).
        unsafe { self.submit_launch(k, grid, block, shared, false, stream, args) }
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
        // The driver checks a launch when it is queued: refused whole,
        // nothing queued.
        if self.refuse_fused.load(Ordering::SeqCst) {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Ok(false);
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.submit_launch(k, grid, block, shared, true, stream, args)? };
        Ok(true)
    }

    fn device_limits(&self) -> Result<DeviceLimits> {
        // SAFETY: a plain getter of the library.
        let sms = unsafe { (self.sm_count_fn)() };
        Ok(DeviceLimits {
            sms,
            max_shared: MAX_SHARED_OPTIN,
            cooperative: self.cooperative.load(Ordering::SeqCst),
        })
    }

    fn occupancy(&self, _k: Kernel, block: u32, shared: u32) -> Result<u32> {
        // SAFETY: a plain function of the library.
        Ok(unsafe { (self.occupancy_fn)(block, shared) })
    }

    fn new_blas(&self) -> Result<Box<dyn Blas>> {
        Ok(Box::new(HostBlas {
            deferral: self.deferral.clone(),
        }))
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

/// The emulated GEMM (see the module documentation), queued like a kernel.
struct HostBlas {
    deferral: Arc<Deferral>,
}

impl Blas for HostBlas {
    unsafe fn gemm(&mut self, stream: Stream, g: &Gemm) -> Result<()> {
        let g = *g;
        self.deferral.submit(
            stream,
            Box::new(move || {
                // SAFETY: the caller's contract, until the GEMM has run.
                unsafe { host_gemm(&g) };
                Ok(())
            }),
        )
    }

    fn device_bytes(&self) -> usize {
        0
    }
}

/// `g` as the module documentation says, on the host.
///
/// # Safety
/// The pointers hold the matrices of `g`'s sizes (host memory in the emulation).
unsafe fn host_gemm(g: &Gemm) {
    {
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
    }
}
