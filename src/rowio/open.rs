//! The direct-I/O twin of a file the library opened, and its block size.
//!
//! The loaders open every file themselves ([`crate::files`]) without
//! `O_DIRECT`, and the page-cache readers keep using that descriptor, so
//! `O_DIRECT` cannot be switched on it with `fcntl(F_SETFL)`: the flag
//! belongs to the open file description, which a `dup` shares. Instead the
//! same file is opened a second time through `/proc/self/fd/N`: on Linux
//! that link opens the very inode the descriptor holds (even if the path it
//! was opened by was renamed or removed since), never a path looked up
//! again, and `fstat` confirms it (same device and inode) before it is used.

use super::buf::AlignedBuf;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};

/// A direct-I/O descriptor of a file and the alignment its reads need.
pub struct Direct {
    pub file: File,
    /// Offsets and lengths of direct reads are multiples of this.
    pub block: u64,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const RAMFS_MAGIC: i64 = 0x8584_58f6;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// The name of a file system whose files live in memory, if `file` is on one.
fn in_memory_fs(file: &File) -> Option<&'static str> {
    // SAFETY: `statfs` is plain data; zero is a valid value of it.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open for the duration of the call and `s` is a valid,
    // writable `statfs`.
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut s) } != 0 {
        return None;
    }
    match s.f_type as i64 {
        TMPFS_MAGIC => Some("tmpfs"),
        RAMFS_MAGIC => Some("ramfs"),
        HUGETLBFS_MAGIC => Some("hugetlbfs"),
        _ => None,
    }
}

/// The direct-I/O offset alignment `statx` reports (`STATX_DIOALIGN`, Linux
/// 6.1+): `Some(0)` when the kernel says the file offers no direct I/O,
/// `None` when it does not say.
fn statx_dio_align(file: &File) -> Option<u32> {
    // SAFETY: `statx` is plain data; zero is a valid value of it.
    let mut sx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty path with `AT_EMPTY_PATH` names `fd` itself; `sx` is
    // a valid, writable `statx`.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut sx,
        )
    };
    (r == 0 && sx.stx_mask & libc::STATX_DIOALIGN != 0).then_some(sx.stx_dio_offset_align)
}

/// The logical block size of the block device holding `file`
/// (`BLKSSZGET` on `/dev/block/MAJOR:MINOR`), if that device can be opened.
fn device_block(file: &File) -> Option<u64> {
    let dev = file.metadata().ok()?.dev();
    let path = format!("/dev/block/{}:{}", libc::major(dev), libc::minor(dev));
    let d = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let mut n: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int through the pointer, a valid `c_int`.
    let r = unsafe { libc::ioctl(d.as_raw_fd(), libc::BLKSSZGET, &mut n) };
    (r == 0 && n > 0).then_some(n as u64)
}

/// The block direct reads of `file` are aligned to, and where it came from.
fn block_size(file: &File) -> Result<(u64, &'static str), String> {
    match statx_dio_align(file) {
        Some(0) => Err("the file system offers no direct I/O for this file (statx)".into()),
        Some(n) => Ok((u64::from(n), "statx")),
        None => Ok(device_block(file).map_or((512, "default"), |b| (b, "BLKSSZGET"))),
    }
}

/// Open the direct-I/O twin of `file` and check that a direct read of the
/// table's first block works. `Err` is the reason, as a sentence, to report
/// with the buffered fallback.
pub fn open_direct(file: &File, table_offset: u64, table_len: u64) -> Result<Direct, String> {
    if let Some(fs) = in_memory_fs(file) {
        return Err(format!(
            "the file is on {fs}: its pages are memory already, a direct read would only add a copy"
        ));
    }
    let (block, _from) = block_size(file)?;
    if !block.is_power_of_two() || block > super::buf::BUF_ALIGN as u64 {
        return Err(format!(
            "an unusable direct-I/O block size of {block} bytes"
        ));
    }
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    let twin = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EINVAL) => "the file system refused O_DIRECT (EINVAL)".to_string(),
            _ => format!("reopening the file for direct reads through {path}: {e}"),
        })?;
    let (a, b) = (file.metadata(), twin.metadata());
    let same = matches!((&a, &b), (Ok(a), Ok(b)) if a.dev() == b.dev() && a.ino() == b.ino());
    if !same {
        return Err(format!("{path} did not reopen the same file"));
    }
    if table_len > 0 {
        trial_read(&twin, table_offset & !(block - 1), block)?;
    }
    Ok(Direct { file: twin, block })
}

/// One direct read of `block` bytes at `at`: some file systems accept
/// `O_DIRECT` at open and refuse the reads (`EINVAL`).
fn trial_read(twin: &File, at: u64, block: u64) -> Result<(), String> {
    let mut buf = AlignedBuf::empty();
    buf.ensure(block as usize).map_err(|e| e.message)?;
    loop {
        // SAFETY: the buffer holds at least `block` writable bytes, aligned
        // to a page, owned by this function.
        let r = unsafe {
            libc::pread(
                twin.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                block as usize,
                at as libc::off_t,
            )
        };
        if r >= 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
            Some(libc::EINVAL) => {
                return Err(format!(
                    "direct reads of {block}-byte blocks were refused (EINVAL)"
                ))
            }
            _ => return Err(format!("a direct read failed: {e}")),
        }
    }
}
