//! A pool of reader threads, each reading whole extents with blocking
//! `pread` into its own aligned buffer: as many reads in flight as threads
//! (plus the calling thread, which reads its share too). A call of
//! [`INLINE_EXTENTS`] reads or fewer is read on the calling thread alone:
//! handing one read to another thread costs a wake-up (measured in
//! BENCHMARKS.md) and buys no parallelism.

use super::buf::AlignedBuf;
use super::plan::{copy_out, Extent};
use super::req::{ReadCounts, RowRead};
use super::sync::{pread_extent, short_error};
use crate::error::{Error, Result};
use crate::EngramStatus;
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// Calls of at most this many reads stay on the calling thread.
pub const INLINE_EXTENTS: usize = 1;

/// One call's reads, shared with the workers while the call waits.
struct Batch {
    fd: RawFd,
    reqs: *mut RowRead<'static>,
    nreqs: usize,
    exts: *const Extent,
    n: usize,
    base: u64,
    block: u64,
    next: AtomicUsize,
    failed: AtomicBool,
    state: Mutex<State>,
    done: Condvar,
}

struct State {
    left: usize,
    counts: ReadCounts,
    /// The failure of the first extent (in table order) that failed.
    err: Option<(usize, Error)>,
}

// SAFETY: the raw pointers name the caller's requests and extents, which
// outlive every use: the call that made the batch waits until `left` is 0,
// i.e. until every claimed extent is finished, and an extent index is only
// dereferenced after a successful claim (`next` below `n`). Each extent's
// requests are its own (`first..last` ranges do not overlap), so two
// threads never write one destination.
unsafe impl Send for Batch {}
// SAFETY: as for `Send`; the rest is atomics and a mutex.
unsafe impl Sync for Batch {}

struct Queue {
    batches: VecDeque<Arc<Batch>>,
    stop: bool,
}

struct Shared {
    q: Mutex<Queue>,
    wake: Condvar,
}

/// The reader threads.
pub struct Pool {
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// Buffers for calling threads (one taken by each call in progress).
    bufs: Mutex<Vec<AlignedBuf>>,
}

/// `m` locked; a poisoned lock is taken as it is (its data are plain buffers
/// and counters that a panic leaves consistent).
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    /// Start `threads` readers. Fewer may start (the system refused more
    /// threads): [`Pool::threads`] says how many did; none is an error.
    pub fn new(threads: u32) -> Result<Pool> {
        let shared = Arc::new(Shared {
            q: Mutex::new(Queue {
                batches: VecDeque::new(),
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let mut handles = crate::fallible::try_room(threads as usize, "the row reader threads")?;
        for i in 0..threads {
            let s = Arc::clone(&shared);
            let h = std::thread::Builder::new()
                .name(format!("engram-rowio-{i}"))
                .stack_size(256 << 10)
                .spawn(move || worker(&s));
            match h {
                Ok(h) => handles.push(h),
                Err(_) => break,
            }
        }
        if handles.is_empty() && threads > 0 {
            crate::error::bail!(ErrCapacity, "no row reader thread could be started");
        }
        Ok(Pool {
            shared,
            handles,
            bufs: Mutex::new(Vec::new()),
        })
    }

    /// Reader threads running.
    pub fn threads(&self) -> u32 {
        self.handles.len() as u32
    }

    /// Read `exts` of `fd` and copy the rows out, on the readers and this
    /// thread.
    pub fn read(
        &self,
        fd: RawFd,
        reqs: &mut [RowRead<'_>],
        exts: &[Extent],
        base: u64,
        block: u64,
    ) -> Result<ReadCounts> {
        let mut buf = lock(&self.bufs).pop().unwrap_or(AlignedBuf::empty());
        let r = if exts.len() <= INLINE_EXTENTS || self.handles.is_empty() {
            super::sync::read_all(fd, reqs, exts, base, block, &mut buf)
        } else {
            self.share(fd, reqs, exts, base, block, &mut buf)
        };
        lock(&self.bufs).push(buf);
        r
    }

    fn share(
        &self,
        fd: RawFd,
        reqs: &mut [RowRead<'_>],
        exts: &[Extent],
        base: u64,
        block: u64,
        buf: &mut AlignedBuf,
    ) -> Result<ReadCounts> {
        let b = Arc::new(Batch {
            fd,
            reqs: reqs.as_mut_ptr().cast(),
            nreqs: reqs.len(),
            exts: exts.as_ptr(),
            n: exts.len(),
            base,
            block,
            next: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            state: Mutex::new(State {
                left: exts.len(),
                counts: ReadCounts::default(),
                err: None,
            }),
            done: Condvar::new(),
        });
        {
            let mut q = lock(&self.shared.q);
            if q.batches.try_reserve(1).is_err() {
                drop(q);
                return super::sync::read_all(fd, reqs, exts, base, block, buf);
            }
            q.batches.push_back(Arc::clone(&b));
        }
        self.shared.wake.notify_all();
        work(&b, buf);
        let mut st = lock(&b.state);
        while st.left > 0 {
            st = b.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        lock(&self.shared.q).batches.retain(|x| !Arc::ptr_eq(x, &b));
        match st.err.take() {
            Some((_, e)) => Err(e),
            None => {
                let mut c = std::mem::take(&mut st.counts);
                c.rows = reqs.len() as u64;
                Ok(c)
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.shared.q).stop = true;
        self.shared.wake.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

fn worker(s: &Shared) {
    let mut buf = AlignedBuf::empty();
    loop {
        let b = {
            let mut q = lock(&s.q);
            loop {
                if q.stop {
                    return;
                }
                if let Some(b) = q.batches.front() {
                    break Arc::clone(b);
                }
                q = s.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        work(&b, &mut buf);
        let mut q = lock(&s.q);
        if q.batches.front().is_some_and(|x| Arc::ptr_eq(x, &b)) {
            q.batches.pop_front();
        }
    }
}

/// Claim extents of `b` until none is left, reading each into `buf`.
fn work(b: &Batch, buf: &mut AlignedBuf) {
    loop {
        let i = b.next.fetch_add(1, Ordering::Relaxed);
        if i >= b.n {
            return;
        }
        let mut c = ReadCounts::default();
        let r = if b.failed.load(Ordering::Relaxed) {
            Ok(())
        } else {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| one(b, i, buf, &mut c)))
                .unwrap_or_else(|_| {
                    Err(Error::new(
                        EngramStatus::ErrInternal,
                        "a row reader thread panicked",
                    ))
                })
        };
        let mut st = lock(&b.state);
        st.counts.add(&c);
        if let Err(e) = r {
            b.failed.store(true, Ordering::Relaxed);
            if st.err.as_ref().is_none_or(|(j, _)| i < *j) {
                st.err = Some((i, e));
            }
        }
        st.left -= 1;
        if st.left == 0 {
            b.done.notify_all();
        }
    }
}

/// Read extent `i` of `b` (claimed by this thread) and copy its rows out.
fn one(b: &Batch, i: usize, buf: &mut AlignedBuf, c: &mut ReadCounts) -> Result<()> {
    // SAFETY: `i < n` was claimed by this thread alone, and the extents
    // outlive the batch's use (see `Batch`).
    let ext = unsafe { *b.exts.add(i) };
    debug_assert!(ext.first <= ext.last && ext.last as usize <= b.nreqs);
    // SAFETY: see `Batch`: the requests outlive this use, and extent `i`'s
    // requests (`first..last`, inside the call's `nreqs`) are touched by
    // this thread alone: extents' request ranges do not overlap.
    let rows = unsafe {
        std::slice::from_raw_parts_mut(
            b.reqs.add(ext.first as usize),
            (ext.last - ext.first) as usize,
        )
    };
    buf.ensure(ext.len as usize)?;
    let p = buf.as_mut_ptr();
    if let Err(s) = pread_extent(b.fd, p, &ext, b.block, c) {
        return Err(short_error(rows, &ext, s, b.base));
    }
    // SAFETY: `pread_extent` wrote at least `ext.need` bytes at `p`.
    let bytes = unsafe { std::slice::from_raw_parts(p, ext.need as usize) };
    copy_out(rows, &ext, bytes, b.base);
    Ok(())
}
