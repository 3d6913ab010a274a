//! The thread pools, joined when they are dropped.
//!
//! [`Workers`] is the projection's pool (the context's threads,
//! `engram_create` and `engram_set_threads`). Starting it can fail only as a
//! status, never as an abort, even when the address space runs short: its
//! memory (the shared state and the threads' handles) is reserved fallibly
//! before any thread starts, its threads are started with `pthread_create`
//! (whose stack and thread data are the only memory a start takes, and whose
//! failure is an error code), and they run no code that allocates or needs
//! a thread-local destructor to wait for work or to exit: a mutex, a
//! condition variable and the tasks. (rayon's registry allocates each
//! thread's deque infallibly, and `std::thread::spawn` allocates the
//! thread's handle and registers a thread-local destructor in the new
//! thread, which aborts the process when memory is short.) Its threads run
//! every task in the library's floating-point mode ([`crate::fpmode`]).
//!
//! [`Pool`] is a rayon pool for the tokenizer's one-off parallel pass at
//! load (not the context's threads): a `rayon::ThreadPool` only asks its
//! threads to stop when dropped, so this one spawns them itself
//! (`spawn_handler`), keeps their handles, and joins them in `Drop`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// A rayon pool whose threads are joined when it is dropped.
pub struct Pool {
    /// `Some` until `Drop` takes it (dropping it tells the threads to stop).
    pool: Option<rayon::ThreadPool>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool of `n` threads named `engram-{i}`. A thread that cannot be
    /// started is an error; the ones already started are joined.
    pub fn new(n: usize) -> std::io::Result<Pool> {
        let handles = std::sync::Mutex::new(Vec::with_capacity(n));
        let built = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .spawn_handler(|t| {
                let h = std::thread::Builder::new()
                    .name(format!("engram-{}", t.index()))
                    .spawn(move || t.run())?;
                handles.lock().unwrap_or_else(|p| p.into_inner()).push(h);
                Ok(())
            })
            .build();
        let threads = handles.into_inner().unwrap_or_else(|p| p.into_inner());
        match built {
            Ok(pool) => Ok(Pool {
                pool: Some(pool),
                threads,
            }),
            Err(e) => {
                // rayon has let go of the threads it started: they see the
                // registry terminate and exit.
                for h in threads {
                    let _ = h.join();
                }
                Err(std::io::Error::other(e))
            }
        }
    }

    /// Run `f` in the pool (see `rayon::ThreadPool::install`).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool
            .as_ref()
            .expect("the pool is alive until Drop")
            .install(f)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Dropping the pool terminates its registry; each thread then leaves
        // its loop, and the joins wait for that.
        drop(self.pool.take());
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// Stack of each worker: the standard library's default for a spawned
/// thread (what the kernels ran on under rayon).
const STACK_BYTES: usize = 2 << 20;

/// Address space a new pool must leave free: the threads' stacks are most
/// of what a pool takes, and a pool that started every thread with nothing
/// left would leave the rest of its call (the context's other parts, the
/// error message) to fail an allocation that cannot fail as a status.
const SPARE_BYTES: usize = 1 << 20;

/// Whether [`SPARE_BYTES`] of address space can still be mapped (only a
/// limit such as `ulimit -v` makes it fail).
fn spare_room() -> bool {
    // SAFETY: an anonymous, inaccessible mapping that nothing reads or
    // writes, unmapped at once; it changes no other mapping.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            SPARE_BYTES,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return false;
        }
        libc::munmap(p, SPARE_BYTES);
    }
    true
}

/// One parallel loop in flight: tasks `0..n`, cut into one contiguous block
/// a worker (`parts` blocks). Each worker claims the tasks of its own block in
/// order, one at a time, then helps with the other blocks' remaining tasks.
/// Each worker thus streams one contiguous range of the weights, as rayon's
/// halving split did (claiming tasks alternately from one counter made 1-token
/// K-quant projections 10-24% slower on two threads: BENCHMARKS.md). Lives on
/// the stack of the call that runs it, which waits until no worker uses it
/// any more.
struct Job<'a> {
    /// Runs task `i`; false stops the loop (an error was recorded).
    task: &'a (dyn Fn(usize) -> bool + Sync),
    n: usize,
    /// Block `b`'s next task (starting at [`Job::start`]`(b)`), `parts` of them.
    next: &'a [Padded],
    /// Counts the workers that joined, so that each starts in its own block.
    joined: AtomicUsize,
    /// A task returned false or panicked: claim no more.
    stop: AtomicBool,
    panicked: AtomicBool,
}

/// A counter on a cache line of its own (workers claim from different blocks
/// at once).
#[repr(align(64))]
struct Padded(AtomicUsize);

impl Job<'_> {
    /// The first task of block `b`.
    fn start(&self, b: usize) -> usize {
        b * self.n / self.next.len()
    }

    /// Whether every task has been claimed.
    fn all_claimed(&self) -> bool {
        (0..self.next.len()).all(|b| self.next[b].0.load(Ordering::Relaxed) >= self.start(b + 1))
    }

    /// Claim and run tasks, own block first, until none is left (or the
    /// loop stopped).
    fn work(&self) {
        crate::fpmode::FpMode::set_for_thread();
        let parts = self.next.len();
        let first = self.joined.fetch_add(1, Ordering::Relaxed) % parts;
        for b in (first..parts).chain(0..first) {
            let end = self.start(b + 1);
            while !self.stop.load(Ordering::Relaxed) {
                let i = self.next[b].0.fetch_add(1, Ordering::Relaxed);
                if i >= end {
                    break;
                }
                if !self.run_task(i) {
                    return;
                }
            }
        }
    }

    /// Run task `i`; false when the loop must stop (an error or a panic).
    fn run_task(&self, i: usize) -> bool {
        match catch_unwind(AssertUnwindSafe(|| (self.task)(i))) {
            Ok(true) => true,
            Ok(false) => {
                self.stop.store(true, Ordering::Relaxed);
                false
            }
            Err(_) => {
                self.panicked.store(true, Ordering::Relaxed);
                self.stop.store(true, Ordering::Relaxed);
                false
            }
        }
    }
}

/// What the workers and the callers share, under [`Shared::state`].
struct State {
    /// The job to work on (its lifetime erased: the caller that set it
    /// clears it and waits for `active == 0` before the job goes away).
    job: Option<*const Job<'static>>,
    /// Counts the jobs set, so that a worker joins each job at most once.
    epoch: u64,
    /// Workers inside the current job.
    active: usize,
    /// The pool is being dropped: every worker returns.
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    /// Signalled when a job is set or `stop` is.
    work: Condvar,
    /// Signalled when the last worker leaves a job.
    idle: Condvar,
    /// Held by the caller whose job is in flight: one job at a time (the
    /// next caller waits, as rayon's `install` queues).
    turn: Mutex<()>,
}

// SAFETY: the raw job pointer in `State` is only dereferenced by workers
// while the caller that published it keeps the job alive (it waits, under
// the state mutex, for `active` to reach 0 after clearing it), and `Job`
// itself is `Sync` (atomics and a `Sync` closure).
unsafe impl Send for Shared {}
// SAFETY: as above; every other field is a lock or a condition variable.
unsafe impl Sync for Shared {}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A worker's life: wait for a job not yet joined, work on it, repeat,
    /// until `stop`. Allocates nothing.
    fn worker(&self) {
        crate::fpmode::FpMode::set_for_thread();
        let mut seen = 0u64;
        let mut st = self.lock();
        loop {
            if st.stop {
                return;
            }
            match st.job {
                Some(job) if st.epoch != seen => {
                    seen = st.epoch;
                    st.active += 1;
                    drop(st);
                    // SAFETY: the job was set under the lock and this worker
                    // counted itself in `active` before unlocking; its caller
                    // keeps it alive until `active` is back to 0.
                    unsafe { &*job }.work();
                    st = self.lock();
                    st.active -= 1;
                    if st.active == 0 {
                        self.idle.notify_all();
                    }
                }
                _ => st = self.work.wait(st).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }
}

/// The body of each worker thread (`pthread_create`'s start routine).
extern "C" fn worker_main(arg: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: `arg` is the `Shared` of the `Workers` that started this
    // thread, boxed (a stable address) and freed only after this thread is
    // joined.
    let shared = unsafe { &*(arg as *const Shared) };
    // A panic must not unwind out of an `extern "C"` function; the loop
    // itself does not panic (tasks' panics are caught in `Job::work`).
    let _ = catch_unwind(AssertUnwindSafe(|| shared.worker()));
    std::ptr::null_mut()
}

/// The projection's pool: `n` threads started with `pthread_create`, joined
/// when dropped, that run [`Workers::for_each_chunk`] loops while their
/// caller waits.
pub struct Workers {
    /// One element (a stable address the threads hold), allocated fallibly.
    shared: Box<[Shared]>,
    threads: Vec<libc::pthread_t>,
    /// The blocks' counters of the job in flight, one a thread (see [`Job`]).
    next: Box<[Padded]>,
}

impl Workers {
    /// A pool of `n` threads. A thread that cannot be started (or memory
    /// for the pool that cannot be had) is an error, after the threads
    /// already started are joined; nothing here aborts for want of memory.
    pub fn new(n: usize) -> std::io::Result<Workers> {
        let oom = || std::io::Error::from_raw_os_error(libc::ENOMEM);
        let mut shared = Vec::new();
        shared.try_reserve_exact(1).map_err(|_| oom())?;
        shared.push(Shared {
            state: Mutex::new(State {
                job: None,
                epoch: 0,
                active: 0,
                stop: false,
            }),
            work: Condvar::new(),
            idle: Condvar::new(),
            turn: Mutex::new(()),
        });
        let mut threads = Vec::new();
        threads.try_reserve_exact(n).map_err(|_| oom())?;
        let mut next = Vec::new();
        next.try_reserve_exact(n.max(1)).map_err(|_| oom())?;
        next.extend((0..n.max(1)).map(|_| Padded(AtomicUsize::new(0))));
        let mut pool = Workers {
            shared: shared.into_boxed_slice(),
            threads,
            next: next.into_boxed_slice(),
        };
        for i in 0..n {
            // On error, dropping `pool` stops and joins the threads started.
            let t = pool.start()?;
            name_thread(t, i);
            pool.threads.push(t);
        }
        if !spare_room() {
            return Err(oom());
        }
        Ok(pool)
    }

    /// Start one worker thread.
    fn start(&self) -> std::io::Result<libc::pthread_t> {
        let arg = &self.shared[0] as *const Shared as *mut libc::c_void;
        // SAFETY: `attr` is initialised by `pthread_attr_init` before use
        // and destroyed after `pthread_create`, which copies what it needs;
        // `t` is written by `pthread_create` on success only, and read only
        // then; `arg` outlives the thread (see `worker_main`).
        unsafe {
            let mut attr: libc::pthread_attr_t = std::mem::zeroed();
            let rc = libc::pthread_attr_init(&mut attr);
            if rc != 0 {
                return Err(std::io::Error::from_raw_os_error(rc));
            }
            let mut rc = libc::pthread_attr_setstacksize(&mut attr, STACK_BYTES);
            let mut t: libc::pthread_t = std::mem::zeroed();
            if rc == 0 {
                rc = libc::pthread_create(&mut t, &attr, worker_main, arg);
            }
            libc::pthread_attr_destroy(&mut attr);
            if rc != 0 {
                return Err(std::io::Error::from_raw_os_error(rc));
            }
            Ok(t)
        }
    }

    /// The pool's threads.
    pub fn current_num_threads(&self) -> usize {
        self.threads.len()
    }

    /// `f((i, chunk))` for every `chunk`-element chunk of `data` (the last
    /// may be shorter), on the pool's threads while the caller waits; the
    /// first error stops the loop (chunks not yet started are skipped) and
    /// is returned. A panic in `f` is resumed on the caller once no thread
    /// uses the loop any more.
    pub fn for_each_chunk<T: Send, E: Send>(
        &self,
        data: &mut [T],
        chunk: usize,
        f: impl Fn((usize, &mut [T])) -> Result<(), E> + Sync,
    ) -> Result<(), E> {
        let chunk = chunk.max(1);
        let (len, base) = (data.len(), SendPtr(data.as_mut_ptr()));
        let error: Mutex<Option<E>> = Mutex::new(None);
        let task = |i: usize| {
            let lo = i * chunk;
            let hi = (lo + chunk).min(len);
            // SAFETY: each task index is claimed once (`Job::work`), so the
            // chunks `lo..hi` handed out are disjoint parts of `data`, which
            // the caller borrows mutably until every task is done.
            let part = unsafe { std::slice::from_raw_parts_mut(base.get().add(lo), hi - lo) };
            match f((i, part)) {
                Ok(()) => true,
                Err(e) => {
                    let mut slot = error.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                    false
                }
            }
        };
        if self.run(&task, len.div_ceil(chunk)) {
            panic!("a task of the projection's thread pool panicked");
        }
        match error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Run tasks `0..n` of `task` on the workers (see [`Job`]): publish the
    /// job, wait until it is done and no worker uses it. True if a task
    /// panicked.
    fn run(&self, task: &(dyn Fn(usize) -> bool + Sync), n: usize) -> bool {
        let sh = &self.shared[0];
        let _turn = sh.turn.lock().unwrap_or_else(|p| p.into_inner());
        // The counters are this job's alone while `turn` is held.
        let job = Job {
            task,
            n,
            next: &self.next,
            joined: AtomicUsize::new(0),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        };
        for (b, c) in job.next.iter().enumerate() {
            c.0.store(job.start(b), Ordering::Relaxed);
        }
        let mut st = sh.lock();
        // SAFETY (lifetime erasure): the pointer is cleared below, and this
        // call returns only once `active` is 0, so no worker dereferences
        // it after `job` goes away.
        st.job = Some(std::ptr::from_ref(&job).cast());
        st.epoch += 1;
        sh.work.notify_all();
        // Wait until every task is claimed and finished: all claimed once
        // each block's counter passed its end (or stopped), all finished
        // once no worker is inside.
        while !(job.stop.load(Ordering::Relaxed) || job.all_claimed()) || st.active > 0 {
            st = sh.idle.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.job = None;
        job.panicked.load(Ordering::Relaxed)
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        let sh = &self.shared[0];
        sh.lock().stop = true;
        sh.work.notify_all();
        for &t in &self.threads {
            // SAFETY: `t` was started by `Workers::start` and is joined
            // once, here; it returns after seeing `stop`.
            unsafe { libc::pthread_join(t, std::ptr::null_mut()) };
        }
    }
}

/// `engram-{i}` as the thread's name (seen in `top -H`, debuggers), written
/// on the stack (no allocation). Best effort.
#[cfg(target_os = "linux")]
fn name_thread(t: libc::pthread_t, i: usize) {
    // "engram-" and up to 8 digits: 15 bytes and the NUL, Linux's limit.
    let mut name = *b"engram-\0\0\0\0\0\0\0\0\0";
    let (mut digits, mut n, mut v) = ([0u8; 20], 0, i);
    loop {
        digits[n] = b'0' + (v % 10) as u8;
        n += 1;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    digits[..n].reverse();
    let n = n.min(8);
    name[7..7 + n].copy_from_slice(&digits[..n]);
    // SAFETY: `name` is NUL-terminated (at most 15 bytes before the NUL)
    // and `t` a live thread of this pool.
    unsafe { libc::pthread_setname_np(t, name.as_ptr() as *const libc::c_char) };
}

#[cfg(not(target_os = "linux"))]
fn name_thread(_: libc::pthread_t, _: usize) {}

/// A raw pointer the tasks share (each uses a disjoint part).
struct SendPtr<T>(*mut T);

// (Not derived: a derive would ask `T: Copy`.)
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointer is only used for the disjoint chunks each task
// claims once; `T: Send` lets a chunk move to another thread.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above: no two threads touch the same element.
unsafe impl<T: Send> Sync for SendPtr<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every chunk is handed out once, whole; the first error stops the loop
    /// and comes back; a panicking task panics the caller; the pool keeps
    /// working after each; callers on several threads share it.
    #[test]
    fn chunks_once_errors_and_panics_come_back() {
        let pool = Workers::new(3).unwrap();
        assert_eq!(pool.current_num_threads(), 3);
        let mut data: Vec<u32> = (0..1000).collect();
        pool.for_each_chunk(&mut data, 64, |(i, c): (usize, &mut [u32])| {
            assert_eq!(c[0] as usize, i * 64);
            c.iter_mut().for_each(|v| *v += 1);
            Ok::<(), ()>(())
        })
        .unwrap();
        assert!(data.iter().enumerate().all(|(i, &v)| v as usize == i + 1));
        let r = pool.for_each_chunk(&mut data, 10, |(i, _)| if i == 7 { Err(i) } else { Ok(()) });
        assert_eq!(r, Err(7));
        let p = catch_unwind(AssertUnwindSafe(|| {
            pool.for_each_chunk(&mut data, 10, |(i, _)| {
                assert_ne!(i, 3, "task 3");
                Ok::<(), ()>(())
            })
        }));
        assert!(p.is_err());
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let pool = &pool;
                s.spawn(move || {
                    let mut d = vec![t; 500];
                    for _ in 0..50 {
                        pool.for_each_chunk(&mut d, 7, |(_, c)| {
                            c.iter_mut().for_each(|v| *v += 1);
                            Ok::<(), ()>(())
                        })
                        .unwrap();
                    }
                    assert!(d.iter().all(|&v| v == t + 50));
                });
            }
        });
    }

    /// The workers compute in the library's FP mode whatever the mode of
    /// the thread that started them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn workers_run_in_the_library_mode() {
        let caller = crate::fpmode::FpMode::enter();
        let ftz = LIBRARY_FTZ_DAZ;
        set_mxcsr(ftz);
        let pool = Workers::new(2);
        set_mxcsr(0x1F80);
        let pool = pool.unwrap();
        let mut out = vec![0f32; 64];
        pool.for_each_chunk(&mut out, 8, |(_, c)| {
            let tiny = std::hint::black_box(f32::MIN_POSITIVE);
            c.iter_mut()
                .for_each(|v| *v = std::hint::black_box(tiny) * 0.5);
            Ok::<(), ()>(())
        })
        .unwrap();
        assert!(out.iter().all(|&v| v == f32::MIN_POSITIVE * 0.5));
        drop(caller);
    }

    #[cfg(target_arch = "x86_64")]
    const LIBRARY_FTZ_DAZ: u32 = 0x1F80 | (1 << 15) | (1 << 6);

    #[cfg(target_arch = "x86_64")]
    fn set_mxcsr(v: u32) {
        // SAFETY: `ldmxcsr` reads 4 bytes from `v`; the values set are the
        // reset value with or without FTZ and DAZ (no reserved bit).
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, readonly)) };
    }
}
