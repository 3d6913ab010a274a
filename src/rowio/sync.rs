//! Reads on the calling thread: one `pread` an extent (continued when
//! short, retried on `EINTR`/`EAGAIN`), used by the buffered mode, by the
//! pool's threads and by a call too small to be worth a hand-off.

use super::plan::{copy_out, cut_short, rows_of, Extent};
use super::req::{ReadCounts, RowRead};
use crate::error::Result;
use std::os::fd::RawFd;
use std::time::Instant;

/// How one extent's read ended, before it is turned into an error naming
/// its row.
pub enum Short {
    /// End of file (a read returned 0, or stopped inside a block) after `got`.
    Eof { got: u64 },
    /// The read failed with `errno` after `got` bytes.
    Errno { got: u64, errno: i32 },
}

/// Read `ext` into `buf` (at least `ext.len` bytes, aligned for direct I/O
/// when `block` > 1) with `pread` on `fd`: a short read is continued from
/// where it stopped while that is a block boundary; counts go to `counts`.
pub fn pread_extent(
    fd: RawFd,
    buf: *mut u8,
    ext: &Extent,
    block: u64,
    counts: &mut ReadCounts,
) -> std::result::Result<(), Short> {
    let mut got = 0u64;
    while got < u64::from(ext.need) {
        let t0 = Instant::now();
        // SAFETY: `buf` holds at least `ext.len` writable bytes that nothing
        // else touches during the call (the caller's bounce buffer), and
        // `got < need <= len`, so the destination range is inside it.
        let r = unsafe {
            libc::pread(
                fd,
                buf.add(got as usize).cast(),
                (u64::from(ext.len) - got) as usize,
                (ext.start + got) as libc::off_t,
            )
        };
        counts.reads_issued += 1;
        counts.latency.record(t0.elapsed().as_nanos() as u64);
        if r < 0 {
            let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
            if errno == libc::EINTR || errno == libc::EAGAIN {
                continue;
            }
            return Err(Short::Errno { got, errno });
        }
        if r == 0 {
            return Err(Short::Eof { got });
        }
        got += r as u64;
        counts.bytes_read += r as u64;
        if got < u64::from(ext.need) && !got.is_multiple_of(block) {
            // Stopped inside a block: the file ends there.
            return Err(Short::Eof { got });
        }
    }
    Ok(())
}

/// The error for `short` on `ext` (its requests: `rows`).
pub fn short_error(rows: &[RowRead<'_>], ext: &Extent, short: Short, base: u64) -> crate::Error {
    match short {
        Short::Eof { got } => cut_short(rows, ext, got, base, "end of file"),
        Short::Errno { got, errno } => {
            let e = std::io::Error::from_raw_os_error(errno);
            cut_short(rows, ext, got, base, &e.to_string())
        }
    }
}

/// Read every extent of `exts` in turn on this thread into `buf` and copy
/// the rows out.
pub fn read_all(
    fd: RawFd,
    reqs: &mut [RowRead<'_>],
    exts: &[Extent],
    base: u64,
    block: u64,
    buf: &mut super::buf::AlignedBuf,
) -> Result<ReadCounts> {
    let mut counts = ReadCounts::default();
    let most = exts.iter().map(|e| e.len as usize).max().unwrap_or(0);
    buf.ensure(most)?;
    let p = buf.as_mut_ptr();
    for ext in exts {
        if let Err(s) = pread_extent(fd, p, ext, block, &mut counts) {
            return Err(short_error(rows_of(reqs, ext), ext, s, base));
        }
        // SAFETY: `pread_extent` wrote (and the buffer holds) at least
        // `ext.need` bytes at `p`; the slice ends before `buf` is used again.
        let bytes = unsafe { std::slice::from_raw_parts(p, ext.need as usize) };
        copy_out(rows_of(reqs, ext), ext, bytes, base);
    }
    counts.rows = reqs.len() as u64;
    Ok(counts)
}
