//! Reading a table's rows: the kernel hints that start the reads early, and
//! the copies (from memory, or with `pread` from a file).

use super::stager::Source;
use crate::error::{Error, Result};
use crate::EngramStatus;

/// Tell the kernel which pages the rows live on, so that it starts reading
/// them in (asynchronously) before the copies fault on them.
pub(super) fn hint(src: &Source, rb: usize, ids: &[i64]) {
    #[cfg(unix)]
    {
        let page = page_size();
        match src {
            Source::Memory { ptr, len } => {
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
            Source::File { file, offset, .. } => {
                use std::os::unix::io::AsRawFd;
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
            #[cfg(all(test, feature = "loom-model"))]
            Source::Model(_) => {}
        }
    }
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
        #[cfg(all(test, feature = "loom-model"))]
        Source::Model(t) => {
            t.read(rb, ids, dst);
            Ok(())
        }
    }
}
