//! A call's rows as reads: requests sorted by offset, merged into aligned
//! extents (requests sharing a block, or whose blocks touch, become one
//! read), and the copy of each row out of a read's bytes.

use super::req::RowRead;
use crate::error::{bail, Error, Result};
use crate::fallible::try_room;
use crate::EngramStatus;

/// Most bytes one merged read covers (a read of rows that are alone in
/// their blocks is one or two blocks; merging stops here so that a dense
/// run of rows is several reads in flight, not one long one).
pub const MAX_EXTENT: u64 = 128 << 10;
/// Most bytes one row may be (the extents' lengths are `u32`).
pub const MAX_ROW: usize = 1 << 30;

/// One read: `len` bytes at `start` in the file (both multiples of the
/// block), of which the first `need` must be read (up to the end of its last
/// row); it serves requests `first..last` of the sorted requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub start: u64,
    pub len: u32,
    pub need: u32,
    pub first: u32,
    pub last: u32,
}

/// Check every request against the table (`table_len` bytes), then sort
/// them by offset.
pub fn check_and_sort(reqs: &mut [RowRead<'_>], table_len: u64) -> Result<()> {
    if reqs.len() > u32::MAX as usize {
        bail!(ErrInvalidArgument, "{} row reads in one call", reqs.len());
    }
    for r in reqs.iter() {
        let n = r.dst.len();
        if n > MAX_ROW || r.offset.checked_add(n as u64).is_none_or(|e| e > table_len) {
            bail!(
                ErrInvalidArgument,
                "a row read of {n} bytes at byte {} of a {table_len}-byte table",
                r.offset
            );
        }
    }
    reqs.sort_unstable_by_key(|r| r.offset);
    Ok(())
}

/// The extents of sorted `reqs` (table at `base` in the file, reads aligned
/// to `block`, a power of two, or 1 for buffered reads). Empty rows are
/// skipped.
pub fn extents(reqs: &[RowRead<'_>], base: u64, block: u64) -> Result<Vec<Extent>> {
    let mut out: Vec<Extent> = try_room(reqs.len(), "a row read's plan")?;
    for (i, r) in reqs.iter().enumerate() {
        if r.dst.is_empty() {
            continue;
        }
        let a = base + r.offset;
        let end = a + r.dst.len() as u64;
        let s = a & !(block - 1);
        let e = end.next_multiple_of(block);
        if let Some(x) = out.last_mut() {
            let xe = x.start + u64::from(x.len);
            if s <= xe && e.max(xe) - x.start <= MAX_EXTENT {
                x.len = (e.max(xe) - x.start) as u32;
                x.need = x.need.max((end - x.start) as u32);
                x.last = i as u32 + 1;
                continue;
            }
        }
        out.push(Extent {
            start: s,
            len: (e - s) as u32,
            need: (end - s) as u32,
            first: i as u32,
            last: i as u32 + 1,
        });
    }
    Ok(out)
}

/// The requests `ext` serves, of all the call's sorted `reqs`.
pub fn rows_of<'a, 'b>(reqs: &'a mut [RowRead<'b>], ext: &Extent) -> &'a mut [RowRead<'b>] {
    &mut reqs[ext.first as usize..ext.last as usize]
}

/// Copy the rows of `ext` (its requests: `rows`) out of `bytes` (the read
/// of `ext`: its first `ext.need` bytes at least).
pub fn copy_out(rows: &mut [RowRead<'_>], ext: &Extent, bytes: &[u8], base: u64) {
    for r in rows {
        let at = (base + r.offset - ext.start) as usize;
        let n = r.dst.len();
        r.dst.copy_from_slice(&bytes[at..at + n]);
    }
}

/// The error for a read of `ext` (its requests: `rows`) that ended after
/// `got` bytes: it names the first row it could not give (`base` is the
/// table's offset in the file).
pub fn cut_short(rows: &[RowRead<'_>], ext: &Extent, got: u64, base: u64, why: &str) -> Error {
    let reached = ext.start + got;
    let row = rows
        .iter()
        .find(|r| base + r.offset + r.dst.len() as u64 > reached)
        .map_or(ext.start.saturating_sub(base), |r| r.offset);
    Error::new(
        EngramStatus::ErrIo,
        format!(
            "reading the table row at byte {row} of the table (file bytes {}..{}): {why} \
             after {got} bytes; the file was cut short or could not be read",
            ext.start,
            ext.start + u64::from(ext.len)
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(offsets: &[u64], rb: usize, base: u64, block: u64) -> Vec<Extent> {
        let mut bufs: Vec<Vec<u8>> = offsets.iter().map(|_| vec![0; rb]).collect();
        let mut reqs: Vec<RowRead<'_>> = offsets
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&offset, d)| RowRead { offset, dst: d })
            .collect();
        check_and_sort(&mut reqs, 1 << 40).unwrap();
        extents(&reqs, base, block).unwrap()
    }

    #[test]
    fn rows_sharing_or_touching_blocks_are_one_read() {
        // Rows of 264 bytes: row 0 is block 0, row 1 blocks 0..2 (it
        // straddles), row 10 blocks 5..6; a duplicate of row 1.
        let x = plan(&[264, 0, 2640, 264], 264, 0, 512);
        assert_eq!(x.len(), 2, "{x:?}");
        assert_eq!((x[0].start, x[0].len, x[0].need), (0, 1024, 528));
        assert_eq!((x[0].first, x[0].last), (0, 3));
        assert_eq!((x[1].start, x[1].len, x[1].need), (2560, 512, 344));
        // A table at an unaligned offset moves every block.
        let x = plan(&[0], 264, 300, 512);
        assert_eq!((x[0].start, x[0].len, x[0].need), (0, 1024, 564));
        // Buffered: exact bytes, adjacent rows merged.
        let x = plan(&[0, 264, 1000], 264, 7, 1);
        assert_eq!(x.len(), 2);
        assert_eq!((x[0].start, x[0].len, x[0].need), (7, 528, 528));
    }

    #[test]
    fn merging_stops_at_the_extent_limit() {
        let offs: Vec<u64> = (0..1000).map(|i| i * 264).collect();
        let x = plan(&offs, 264, 0, 512);
        assert!(x.len() > 1);
        assert!(x.iter().all(|e| u64::from(e.len) <= MAX_EXTENT));
        assert_eq!(x.last().unwrap().last, 1000);
    }

    #[test]
    fn rows_outside_the_table_are_refused() {
        let mut d = [0u8; 8];
        let mut r = [RowRead {
            offset: 100,
            dst: &mut d,
        }];
        let e = check_and_sort(&mut r, 107).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument);
        assert!(check_and_sort(&mut r, 108).is_ok());
        r[0].offset = u64::MAX;
        assert!(check_and_sort(&mut r, u64::MAX).is_err());
    }
}
