//! io_uring: up to `depth` extent reads in flight from one thread, each into
//! its own slot of an aligned bounce buffer. Rings are kept in a free list,
//! one taken by each call in progress, so calls from many threads never
//! share a ring.

use super::buf::AlignedBuf;
use super::plan::{copy_out, rows_of, Extent};
use super::req::{ReadCounts, RowRead};
use super::sync::{short_error, Short};
use crate::error::{Error, Result};
use crate::fallible::try_vec;
use io_uring::{opcode, types, IoUring};
use std::os::fd::RawFd;
use std::sync::Mutex;
use std::time::Instant;

/// A ring and the bounce buffer its reads land in.
struct Ring {
    ring: IoUring,
    buf: AlignedBuf,
}

/// The io_uring engine: rings of `depth` entries, made when first needed.
pub struct Uring {
    depth: u32,
    free: Mutex<Vec<Ring>>,
}

/// A slot's read in flight.
#[derive(Clone, Copy, Default)]
struct Slot {
    ext: usize,
    got: u64,
    t0: Option<Instant>,
}

impl Uring {
    /// Set up a first ring of `depth` entries: a kernel without io_uring or
    /// a sandbox that refuses it fails here (the caller falls back).
    pub fn new(depth: u32) -> std::io::Result<Uring> {
        let ring = IoUring::new(depth)?;
        Ok(Uring {
            depth,
            free: Mutex::new(vec![Ring {
                ring,
                buf: AlignedBuf::empty(),
            }]),
        })
    }

    /// Read `exts` of `fd` and copy the rows out. Without a ring (none free
    /// and a new one refused, e.g. locked memory exhausted) the call reads
    /// on this thread with `pread` instead.
    pub fn read(
        &self,
        fd: RawFd,
        reqs: &mut [RowRead<'_>],
        exts: &[Extent],
        base: u64,
        block: u64,
    ) -> Result<ReadCounts> {
        let taken = self.free.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut ring = match taken {
            Some(r) => r,
            None => match IoUring::new(self.depth) {
                Ok(ring) => Ring {
                    ring,
                    buf: AlignedBuf::empty(),
                },
                Err(_) => {
                    let mut buf = AlignedBuf::empty();
                    return super::sync::read_all(fd, reqs, exts, base, block, &mut buf);
                }
            },
        };
        let mut poisoned = false;
        let r = run(
            &mut ring,
            self.depth,
            fd,
            reqs,
            exts,
            base,
            block,
            &mut poisoned,
        );
        if poisoned {
            // Reads may still land in its buffer: never free or reuse it.
            std::mem::forget(ring);
            return r;
        }
        // Every read was reaped (`run` drains before it returns), so the
        // ring and its buffer are free for the next call.
        self.free
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(ring);
        r
    }
}

/// Queue the read of the rest of `slot`'s extent; false when the
/// submission queue has no room even after submitting what it holds (the
/// read is then not in flight).
fn push(ring: &mut Ring, fd: RawFd, at: *mut u8, s: usize, slot: &Slot, ext: &Extent) -> bool {
    let left = u64::from(ext.len) - slot.got;
    // SAFETY: `at` is slot `s`'s region of the bounce buffer, `ext.len`
    // bytes long, and `slot.got < ext.len`, so the read's destination lies
    // inside it.
    let dst = unsafe { at.add(slot.got as usize) };
    let sqe = opcode::Read::new(types::Fd(fd), dst, left as u32)
        .offset(ext.start + slot.got)
        .build()
        .user_data(s as u64);
    for _ in 0..2 {
        // SAFETY: the destination stays valid and untouched until the read
        // completes: the buffer belongs to this ring, and `run` reaps every
        // read it submitted before it returns (on error too), or leaks the
        // ring and its buffer when it cannot (`poisoned`).
        if unsafe { ring.ring.submission().push(&sqe) }.is_ok() {
            return true;
        }
        // At most one entry a slot is queued and there are no more slots
        // than entries, so this is not expected; make room all the same.
        let _ = ring.ring.submit();
    }
    false
}

fn busy(got: u64) -> Short {
    Short::Errno {
        got,
        errno: libc::EBUSY,
    }
}

/// What became of a completed read of slot `s`.
enum Done {
    /// The extent is read: copy its rows out.
    Whole,
    /// Read the rest (short read, `EINTR`, `EAGAIN`).
    Again,
    Failed(Short),
}

fn complete(slot: &mut Slot, ext: &Extent, res: i32, block: u64, c: &mut ReadCounts) -> Done {
    if let Some(t0) = slot.t0.take() {
        c.latency.record(t0.elapsed().as_nanos() as u64);
    }
    let got = slot.got;
    if res < 0 {
        if -res == libc::EINTR || -res == libc::EAGAIN {
            return Done::Again;
        }
        return Done::Failed(Short::Errno { got, errno: -res });
    }
    if res == 0 {
        return Done::Failed(Short::Eof { got });
    }
    slot.got += res as u64;
    c.bytes_read += res as u64;
    if slot.got >= u64::from(ext.need) {
        Done::Whole
    } else if !slot.got.is_multiple_of(block) {
        Done::Failed(Short::Eof { got: slot.got })
    } else {
        Done::Again
    }
}

/// One call's reads on one ring.
struct Call<'c, 'b> {
    ring: &'c mut Ring,
    fd: RawFd,
    reqs: &'c mut [RowRead<'b>],
    exts: &'c [Extent],
    base: u64,
    block: u64,
    /// Bytes of the buffer a slot has, and the buffer's start.
    size: usize,
    buf: *mut u8,
    slots: Vec<Slot>,
    free: Vec<usize>,
    next: usize,
    inflight: usize,
    /// The failure of the first extent (in table order) that failed.
    err: Option<(usize, Error)>,
    c: ReadCounts,
}

impl Call<'_, '_> {
    /// Slot `s`'s region of the buffer.
    fn at(&self, s: usize) -> *mut u8 {
        // SAFETY: `s` < the number of slots, and the buffer holds that
        // many `size`-byte regions (`run`).
        unsafe { self.buf.add(s * self.size) }
    }

    /// Record that extent `i`'s read ended as `short`, and free its slot.
    fn fail(&mut self, s: usize, i: usize, short: Short) {
        // Keep the failure of the first row in table order, whichever read
        // failed first.
        if self.err.as_ref().is_none_or(|(j, _)| i < *j) {
            let ext = &self.exts[i];
            let e = short_error(rows_of(self.reqs, ext), ext, short, self.base);
            self.err = Some((i, e));
        }
        self.free.push(s);
        self.inflight -= 1;
    }

    /// Queue reads of the next extents into the free slots.
    fn start(&mut self) {
        while self.err.is_none() && self.next < self.exts.len() {
            let Some(s) = self.free.pop() else { break };
            let i = self.next;
            self.slots[s] = Slot {
                ext: i,
                got: 0,
                t0: Some(Instant::now()),
            };
            let at = self.at(s);
            self.next += 1;
            self.inflight += 1;
            if !push(self.ring, self.fd, at, s, &self.slots[s], &self.exts[i]) {
                self.fail(s, i, busy(0));
                break;
            }
            self.c.reads_issued += 1;
        }
    }

    /// Take the completion of slot `s`'s read (`res`).
    fn reap(&mut self, s: usize, res: i32) {
        let i = self.slots[s].ext;
        let ext = self.exts[i];
        let at = self.at(s);
        match complete(&mut self.slots[s], &ext, res, self.block, &mut self.c) {
            Done::Whole => {
                // SAFETY: the kernel wrote `got >= need` bytes at `at` and no
                // read into this slot is in flight now.
                let bytes = unsafe { std::slice::from_raw_parts(at, ext.need as usize) };
                copy_out(rows_of(self.reqs, &ext), &ext, bytes, self.base);
                self.free.push(s);
                self.inflight -= 1;
            }
            Done::Again if self.err.is_none() => {
                self.slots[s].t0 = Some(Instant::now());
                if push(self.ring, self.fd, at, s, &self.slots[s], &ext) {
                    self.c.reads_issued += 1;
                } else {
                    self.fail(s, i, busy(self.slots[s].got));
                }
            }
            Done::Again => {
                self.free.push(s);
                self.inflight -= 1;
            }
            Done::Failed(short) => self.fail(s, i, short),
        }
    }
}

/// The reads of one call on one ring: keep up to `depth` in flight, copy
/// each extent's rows out as it completes, reap everything before returning.
#[allow(clippy::too_many_arguments)]
fn run(
    ring: &mut Ring,
    depth: u32,
    fd: RawFd,
    reqs: &mut [RowRead<'_>],
    exts: &[Extent],
    base: u64,
    block: u64,
    poisoned: &mut bool,
) -> Result<ReadCounts> {
    let nslots = exts.len().min(depth as usize);
    let size = exts.iter().map(|e| e.len as usize).max().unwrap_or(0);
    let size = size.next_multiple_of(super::buf::BUF_ALIGN);
    ring.buf.ensure(nslots.saturating_mul(size))?;
    let mut free: Vec<usize> = crate::fallible::try_room(nslots, "a row read's slots")?;
    free.extend((0..nslots).rev());
    let buf = ring.buf.as_mut_ptr();
    let mut k = Call {
        ring,
        fd,
        reqs,
        exts,
        base,
        block,
        size,
        buf,
        slots: try_vec(nslots, Slot::default(), "a row read's slots")?,
        free,
        next: 0,
        inflight: 0,
        err: None,
        c: ReadCounts::default(),
    };
    loop {
        k.start();
        if k.inflight == 0 {
            break;
        }
        if let Err(e) = k.ring.ring.submit_and_wait(1) {
            let again = [libc::EINTR, libc::EBUSY, libc::EAGAIN];
            if !e.raw_os_error().is_some_and(|n| again.contains(&n)) {
                // The ring is unusable and reads may still be in flight
                // into its buffer: the caller must leak it (`poisoned`).
                *poisoned = true;
                return Err(Error::new(
                    crate::EngramStatus::ErrIo,
                    format!("io_uring submit: {e}"),
                ));
            }
        }
        loop {
            let next_cqe = k.ring.ring.completion().next();
            let Some(cqe) = next_cqe else { break };
            k.reap(cqe.user_data() as usize, cqe.result());
        }
    }
    match k.err {
        Some((_, e)) => Err(e),
        None => {
            k.c.rows = k.reqs.len() as u64;
            Ok(k.c)
        }
    }
}
