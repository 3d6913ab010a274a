//! io_uring: up to `depth` extent reads in flight from one thread, each into
//! its own slot of an aligned bounce buffer. Rings are kept in a free list,
//! one taken by each call in progress, so calls from many threads never
//! share a ring.

use super::buf::AlignedBuf;
use super::plan::{copy_out, rows_of, Extent};
use super::sync::{short_error, Short};
use super::{ReadCounts, RowRead};
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

/// Push the read of the rest of `slot`'s extent into the submission queue.
fn push(ring: &mut Ring, fd: RawFd, at: *mut u8, s: usize, slot: &Slot, ext: &Extent) {
    let left = u64::from(ext.len) - slot.got;
    // SAFETY: `at` is slot `s`'s region of the bounce buffer, `ext.len`
    // bytes long, and `slot.got < ext.len`, so the read's destination lies
    // inside it.
    let dst = unsafe { at.add(slot.got as usize) };
    let sqe = opcode::Read::new(types::Fd(fd), dst, left as u32)
        .offset(ext.start + slot.got)
        .build()
        .user_data(s as u64);
    // SAFETY: the destination stays valid and untouched until the read
    // completes: the buffer belongs to this ring, and `run` reaps every
    // read it submitted before it returns (on error too). At most one entry
    // a slot is queued, and there are no more slots than ring entries, so
    // the queue has room.
    let pushed = unsafe { ring.ring.submission().push(&sqe) };
    debug_assert!(pushed.is_ok());
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
    let mut c = ReadCounts::default();
    let nslots = exts.len().min(depth as usize);
    let size = exts.iter().map(|e| e.len as usize).max().unwrap_or(0);
    let size = size.next_multiple_of(super::buf::BUF_ALIGN);
    ring.buf.ensure(nslots.saturating_mul(size))?;
    let mut slots = try_vec(nslots, Slot::default(), "a row read's slots")?;
    let mut free: Vec<usize> = crate::fallible::try_room(nslots, "a row read's slots")?;
    free.extend((0..nslots).rev());
    let base_ptr = ring.buf.as_mut_ptr();
    let (mut next, mut inflight) = (0usize, 0usize);
    let mut err: Option<(usize, Error)> = None;
    loop {
        while err.is_none() && next < exts.len() {
            let Some(s) = free.pop() else { break };
            slots[s] = Slot {
                ext: next,
                got: 0,
                t0: Some(Instant::now()),
            };
            // SAFETY: slot `s` < nslots, and the buffer holds nslots * size.
            let at = unsafe { base_ptr.add(s * size) };
            push(ring, fd, at, s, &slots[s], &exts[next]);
            c.reads_issued += 1;
            (next, inflight) = (next + 1, inflight + 1);
        }
        if inflight == 0 {
            break;
        }
        if let Err(e) = ring.ring.submit_and_wait(1) {
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
            let next_cqe = ring.ring.completion().next();
            let Some(cqe) = next_cqe else { break };
            let s = cqe.user_data() as usize;
            let ext = exts[slots[s].ext];
            // SAFETY: as above, slot `s`'s region of the buffer.
            let at = unsafe { base_ptr.add(s * size) };
            match complete(&mut slots[s], &ext, cqe.result(), block, &mut c) {
                Done::Whole => {
                    // SAFETY: the kernel wrote `got >= need` bytes at `at`
                    // and no read into this slot is in flight now.
                    let bytes = unsafe { std::slice::from_raw_parts(at, ext.need as usize) };
                    copy_out(rows_of(reqs, &ext), &ext, bytes, base);
                    free.push(s);
                    inflight -= 1;
                }
                Done::Again if err.is_none() => {
                    slots[s].t0 = Some(Instant::now());
                    push(ring, fd, at, s, &slots[s], &ext);
                    c.reads_issued += 1;
                }
                Done::Again => {
                    free.push(s);
                    inflight -= 1;
                }
                Done::Failed(short) => {
                    // Keep the failure of the first row in table order,
                    // whichever read failed first.
                    if err.as_ref().is_none_or(|(i, _)| slots[s].ext < *i) {
                        let e = short_error(rows_of(reqs, &ext), &ext, short, base);
                        err = Some((slots[s].ext, e));
                    }
                    free.push(s);
                    inflight -= 1;
                }
            }
        }
    }
    match err {
        Some((_, e)) => Err(e),
        None => {
            c.rows = reqs.len() as u64;
            Ok(c)
        }
    }
}
