//! Reading a table's rows: the kernel hints that start the reads early, and
//! the copies (from memory, or with `pread` from a file).

use super::Source;
use crate::error::{Error, Result};
use crate::rowcache::{Miss, TierStats};
use crate::EngramStatus;

/// Tell the kernel which pages the rows live on, so that it starts reading
/// them in (asynchronously) before the copies fault on them.
pub(super) fn hint(src: &Source, rb: usize, ids: &[i64]) {
    #[cfg(unix)]
    {
        let page = page_size();
        match src {
            Source::Memory { ptr, len } => {
                // The advice costs a system call a row, more than copying a
                // resident row (a 4096-token step of 98,304 rows: 68-110 ms
                // of madvise against 20-24 ms of copies, measured on the CI
                // machine; on the H200's host it made prefetched steps 2.5x
                // slower than unprefetched ones). A big job therefore looks
                // first at 64 rows spread over it: when every one is resident
                // (an anonymous table, a warm mapping) the copies will not
                // wait for I/O and the advice is skipped. A small job (a
                // decode step) is always advised: its cost is bounded, and
                // in a partly resident table (Zipf ids: the hot rows cached,
                // the rest not) a sample of a few rows misses the cold ones
                // (cold decode one step ahead waited 10x longer when small
                // jobs were sampled too; BENCHMARKS.md, gathering from disk).
                if ids.len() > ALWAYS_ADVISED_ROWS && sampled_resident(*ptr, *len, rb, ids, page) {
                    return;
                }
                for &id in ids {
                    let a = id as usize * rb;
                    if a + rb > *len {
                        continue;
                    }
                    let start = (*ptr as usize + a) & !(page - 1);
                    let end = *ptr as usize + a + rb;
                    // SAFETY: advice only; the range lies in the table's pages.
                    unsafe {
                        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_WILLNEED);
                    }
                }
            }
            Source::Split { codes, scales, crb } => {
                hint(codes, *crb, ids);
                hint(scales, rb - crb, ids);
            }
            Source::File { file, offset, len } => {
                use std::os::unix::io::AsRawFd;
                // As for memory: a big job whose sampled rows are all in the
                // page cache (a warm file) is not advised; the advice would
                // double the system calls of the preads that follow.
                if ids.len() > ALWAYS_ADVISED_ROWS && sampled_cached(file, *offset, *len, rb, ids) {
                    return;
                }
                for &id in ids {
                    let a = *offset + id as u64 * rb as u64;
                    // SAFETY: advice on an open descriptor; no memory is touched.
                    unsafe {
                        libc::posix_fadvise(
                            file.as_raw_fd(),
                            a as libc::off_t,
                            rb as libc::off_t,
                            libc::POSIX_FADV_WILLNEED,
                        );
                    }
                }
            }
            // The hits need no advice; the misses are advised when read
            // (`read_misses`).
            Source::Cached { .. } => {}
            #[cfg(all(test, feature = "loom-model"))]
            Source::Model(_) => {}
        }
    }
}

/// Jobs of up to this many rows are always advised (see `hint`).
#[cfg(unix)]
const ALWAYS_ADVISED_ROWS: usize = 512;

/// The byte offsets (in the table) of up to 64 rows of `ids`, spread evenly
/// over them; ids outside a table of `len` bytes are left out.
#[cfg(unix)]
fn sampled_rows(ids: &[i64], rb: usize, len: u64) -> impl Iterator<Item = u64> + '_ {
    const SAMPLES: usize = 64;
    let m = ids.len().min(SAMPLES);
    (0..m).filter_map(move |k| {
        let a = u64::try_from(ids[k * ids.len() / m])
            .ok()?
            .checked_mul(rb as u64)?;
        (a.checked_add(rb as u64)? <= len).then_some(a)
    })
}

/// Whether the pages of the sampled rows of `ids` ([`sampled_rows`]) are all
/// resident (`mincore`). Any error counts as not resident.
#[cfg(unix)]
fn sampled_resident(ptr: *const u8, len: usize, rb: usize, ids: &[i64], page: usize) -> bool {
    sampled_rows(ids, rb, len as u64).all(|a| {
        // In the table, so it fits a usize.
        let a = a as usize;
        let start = (ptr as usize + a) & !(page - 1);
        let end = ptr as usize + a + rb;
        // At most 8 pages of the row (rows are a few hundred bytes).
        let bytes = (end - start).min(8 * page);
        let mut vec = [0u8; 8];
        // SAFETY: `vec` holds one byte for each of the at most 8 pages of the
        // range; the range lies in the table's pages, and mincore only reads
        // the page tables (an unmapped range is an error, not a fault).
        let r = unsafe { libc::mincore(start as _, bytes, vec.as_mut_ptr().cast()) };
        r == 0 && vec[..bytes.div_ceil(page)].iter().all(|v| v & 1 == 1)
    })
}

/// Whether the sampled rows of `ids` ([`sampled_rows`]; a table of `len`
/// bytes at `offset` in `file`) are all in the page cache: each row's first
/// bytes are read with `RWF_NOWAIT`, which fails rather than wait for the
/// disk. Any error or short read (a kernel without `RWF_NOWAIT` for buffered
/// reads, a file cut short) counts as not cached.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn sampled_cached(file: &std::fs::File, offset: u64, len: u64, rb: usize, ids: &[i64]) -> bool {
    use std::os::unix::io::AsRawFd;
    let mut buf = [0u8; 512];
    let want = rb.min(buf.len());
    sampled_rows(ids, rb, len).all(|a| {
        let Some(at) = offset
            .checked_add(a)
            .and_then(|at| libc::off_t::try_from(at).ok())
        else {
            return false;
        };
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: want,
        };
        // SAFETY: one iovec over `buf`, which holds `want` writable bytes and
        // outlives the call; the descriptor is open (`file` is borrowed).
        let r = unsafe { libc::preadv2(file.as_raw_fd(), &iov, 1, at, libc::RWF_NOWAIT) };
        r == want as isize
    })
}

/// Elsewhere: never known to be cached, so always advised.
#[cfg(all(unix, not(all(target_os = "linux", target_env = "gnu"))))]
fn sampled_cached(_: &std::fs::File, _: u64, _: u64, _: usize, _: &[i64]) -> bool {
    false
}

#[cfg(unix)]
fn page_size() -> usize {
    static P: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 && (p as usize).is_power_of_two() {
            p as usize
        } else {
            4096
        }
    })
}

/// Copy rows `ids` (each `rb` bytes, checked against the table) from `src`
/// into `dst`, back to back.
pub(super) fn read_rows(src: &Source, rb: usize, ids: &[i64], dst: &mut [u8]) -> Result<()> {
    match src {
        Source::Split { codes, scales, crb } => {
            // Each row: its codes, then its scales (the packed fp8 row).
            for (id, d) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
                let (c, s) = d.split_at_mut(*crb);
                read_rows(codes, *crb, std::slice::from_ref(id), c)?;
                read_rows(scales, rb - crb, std::slice::from_ref(id), s)?;
            }
            Ok(())
        }
        Source::Memory { ptr, len } => {
            for (&id, d) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
                let a = id as usize * rb;
                assert!(a + rb <= *len, "row {id} checked against the table");
                // SAFETY: the row lies inside the borrowed table (asserted),
                // which is valid while `src` is held (see `Source`).
                unsafe { std::ptr::copy_nonoverlapping(ptr.add(a), d.as_mut_ptr(), rb) };
            }
            Ok(())
        }
        Source::File { file, offset, len } => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::FileExt;
                for (&id, d) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
                    let a = id as u64 * rb as u64;
                    debug_assert!(a + rb as u64 <= *len);
                    file.read_exact_at(d, offset + a).map_err(|e| {
                        Error::new(
                            EngramStatus::ErrIo,
                            format!(
                                "reading table row {id} ({rb} bytes at file offset {}): {e}",
                                offset + a
                            ),
                        )
                    })?;
                }
                Ok(())
            }
            #[cfg(not(unix))]
            {
                let _ = (file, offset, len, ids, dst);
                crate::error::bail!(ErrUnsupported, "file-backed tables need a unix system")
            }
        }
        Source::Cached { inner, cache } => {
            let mut uids = crate::batch::try_room(ids.len(), "row ids")?;
            uids.extend(ids.iter().map(|&id| id as u64));
            cache.read_through(&uids, dst, |misses| {
                read_misses(inner, rb, misses, cache.stats())
            })
        }
        #[cfg(all(test, feature = "loom-model"))]
        Source::Model(t) => {
            t.read(rb, ids, dst);
            Ok(())
        }
    }
}

/// Read the rows a cache missed (unique, sorted by id) from `src`, each read
/// timed into `stats`. A file's rows go through [`read_file_rows`] (the one
/// place a file's misses are read: the batched reader's seam); a split
/// table's row by row.
fn read_misses(src: &Source, rb: usize, misses: &mut [Miss<'_>], stats: &TierStats) -> Result<()> {
    match src {
        Source::File { file, offset, .. } => read_file_rows(file, *offset, rb, misses, stats),
        _ => {
            for (id, d) in misses.iter_mut() {
                let t = std::time::Instant::now();
                read_rows(src, rb, &[*id as i64], d)?;
                stats.record_read(rb as u64, t.elapsed().as_micros() as u64);
            }
            Ok(())
        }
    }
}

/// Read rows `misses` (unique, sorted by id; `rb` bytes each) of the table at
/// `offset` in `file`: the kernel is told of them all first (when there are
/// several, so that its reads overlap), then one `pread` a row, each timed
/// into `stats`. A file cut short or an I/O error is `ErrIo`.
fn read_file_rows(
    file: &std::fs::File,
    offset: u64,
    rb: usize,
    misses: &mut [Miss<'_>],
    stats: &TierStats,
) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        use std::os::unix::io::AsRawFd;
        if misses.len() > 1 {
            for (id, _) in misses.iter() {
                // SAFETY: advice on an open descriptor; no memory is touched.
                unsafe {
                    libc::posix_fadvise(
                        file.as_raw_fd(),
                        (offset + id * rb as u64) as libc::off_t,
                        rb as libc::off_t,
                        libc::POSIX_FADV_WILLNEED,
                    );
                }
            }
        }
        for (id, d) in misses.iter_mut() {
            let at = offset + *id * rb as u64;
            let t = std::time::Instant::now();
            file.read_exact_at(d, at).map_err(|e| {
                Error::new(
                    EngramStatus::ErrIo,
                    format!("reading table row {id} ({rb} bytes at file offset {at}): {e}"),
                )
            })?;
            stats.record_read(rb as u64, t.elapsed().as_micros() as u64);
        }
        Ok(())
    }
    #[cfg(not(unix))]
    {
        let _ = (file, offset, rb, misses, stats);
        crate::error::bail!(ErrUnsupported, "file-backed tables need a unix system")
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::{page_size, sampled_cached, sampled_resident};

    #[test]
    fn rows_in_the_page_cache_are_cached_and_evicted_ones_are_not() {
        use std::io::Write;
        use std::os::unix::io::AsRawFd;
        let rb = 264;
        let rows = 40_000u64;
        let ids: Vec<i64> = (0..1000).map(|i| i * 37).collect();
        let path = std::env::temp_dir().join(format!("engram-cached-{}.bin", std::process::id()));
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; rows as usize * rb]).unwrap();
        f.sync_all().unwrap();
        let f = std::fs::File::open(&path).unwrap();
        let len = rows * rb as u64;
        // Just written: cached (unless this kernel lacks RWF_NOWAIT for
        // buffered reads, where nothing is ever known to be cached).
        let supported = sampled_cached(&f, 0, len, rb, &ids);
        if !supported {
            eprintln!("SKIP: RWF_NOWAIT buffered reads are not supported here");
        } else {
            // A table at an offset, ids past it skipped.
            assert!(sampled_cached(
                &f,
                rb as u64,
                len - rb as u64,
                rb,
                &[0, 5, 1 << 40, -1]
            ));
            // Evicted (written back above): not cached. Whether the kernel
            // dropped the pages (a tmpfs cannot) is checked with mincore on
            // a mapping of the file.
            // SAFETY: advice on an open descriptor; no memory is touched.
            let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            assert_eq!(r, 0);
            // SAFETY: a read-only shared mapping of the whole file, which no
            // one truncates, unmapped below; only mincore looks at it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len as usize,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    f.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            let page = page_size();
            let evicted = (0..ids.len())
                .all(|i| !sampled_resident(p as *const u8, len as usize, rb, &ids[i..=i], page));
            // SAFETY: the mapping made above, of `len` bytes.
            unsafe { libc::munmap(p, len as usize) };
            if evicted {
                assert!(!sampled_cached(&f, 0, len, rb, &ids));
            } else {
                eprintln!("SKIP: this file system keeps the pages after DONTNEED (tmpfs?)");
            }
        }
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn touched_rows_are_resident_and_untouched_pages_are_not() {
        let page = page_size();
        let rb = 264;
        let ids: Vec<i64> = (0..100).map(|i| i * 37).collect();
        // Written memory: resident.
        let table = vec![1u8; 4000 * rb];
        assert!(sampled_resident(
            table.as_ptr(),
            table.len(),
            rb,
            &ids,
            page
        ));
        // A fresh anonymous mapping never written: no page is resident.
        let len = 4000 * rb;
        // SAFETY: a new private anonymous mapping, unmapped below; nothing
        // reads or writes it.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert!(!sampled_resident(p as *const u8, len, rb, &ids, page));
        // Ids past the table are skipped, not read.
        assert!(sampled_resident(
            table.as_ptr(),
            table.len(),
            rb,
            &[1 << 40, -1],
            page
        ));
        // SAFETY: the mapping made above, of `len` bytes.
        unsafe { libc::munmap(p, len) };
    }
}
