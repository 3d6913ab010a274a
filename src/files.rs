//! Opening the files a loader reads (GGUF shards, safetensors shards,
//! `config.json`, `tokenizer.json`, `model.safetensors.index.json`), the one
//! way every loader does it.
//!
//! A path names whatever its user (or a hostile file's metadata) says: a FIFO,
//! a character device, a directory. Opening a FIFO for reading blocks until a
//! writer appears, so [`open_regular`] opens with `O_NONBLOCK` (no effect on a
//! regular file), asks `fstat` what it opened, and refuses anything but a
//! regular file before a single byte is read. Whole-file reads
//! ([`read_small`]) are bounded and allocate fallibly; reads of a range
//! ([`read_range`]) go through `pread`, so a file cut short after it was
//! opened is an `ErrIo` status, never a signal.

use crate::error::{bail, Error, Result};
use crate::EngramStatus;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Open `path` for reading, refusing anything but a regular file (named
/// `what` in messages). Returns the file and its length at open time.
pub fn open_regular(path: &Path, what: &str) -> Result<(File, u64)> {
    let io = |e: std::io::Error| {
        Error::new(
            EngramStatus::ErrIo,
            format!("{what} {}: {e}", path.display()),
        )
    };
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Never block in open() on a FIFO without a writer.
        o.custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC);
    }
    let file = o.open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        let kind = file_kind(&meta);
        bail!(
            ErrIo,
            "{what} {}: not a regular file ({kind}); a model file must be a regular file",
            path.display()
        );
    }
    Ok((file, meta.len()))
}

fn file_kind(m: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = m.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if m.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Where a path recorded in a model file (`what`, the key that holds it,
/// named in messages) lies: always inside `base` (the model's own directory
/// or `tables_dir`), never where the file says if that is elsewhere.
///
/// The rule (one for every loader and for `engram-inspect`):
/// - an absolute path keeps only its file name: its directory is the one on
///   the machine that wrote the file (the deepstrix and "ds4gw" converters
///   record the checkpoint's absolute path there), and is never opened;
/// - a relative path is taken under `base`, and may hold only plain names
///   (no `..`, no root, no `\\`, not empty);
/// - the result is resolved, symlinks included, and must stay inside the
///   resolved `base`: a link that points elsewhere is refused.
///
/// `Ok(Some(path))`: the resolved file; `Ok(None)`: nothing is there (the
/// caller says what it looked for, [`confined_candidate`]); `ErrFormat`
/// naming the key and the path for a path the rule refuses.
pub fn confine(base: &Path, recorded: &str, what: &str) -> Result<Option<PathBuf>> {
    let rel = confined_candidate(recorded, what)?;
    let base = if base.as_os_str().is_empty() {
        Path::new(".")
    } else {
        base
    };
    let Ok(root) = base.canonicalize() else {
        return Ok(None);
    };
    let Ok(p) = base.join(&rel).canonicalize() else {
        return Ok(None);
    };
    if !p.starts_with(&root) {
        bail!(
            ErrFormat,
            "{what} is {recorded:?}: {} resolves to {}, outside {} (a path from a model file must stay \
             inside the model's directory or tables_dir)",
            base.join(&rel).display(),
            p.display(),
            root.display()
        );
    }
    Ok(Some(p))
}

/// The relative path [`confine`] looks for under its base, for `recorded`
/// (the value of key `what`), or `ErrFormat` naming both when the rule
/// refuses it.
pub fn confined_candidate(recorded: &str, what: &str) -> Result<PathBuf> {
    use std::path::Component;
    let refuse = |why: &str| -> Result<PathBuf> {
        bail!(
            ErrFormat,
            "{what} is {recorded:?}: {why}; a path from a model file must be a file name or a relative \
             path without \"..\" inside the model's directory or tables_dir"
        )
    };
    if recorded.is_empty() {
        return refuse("empty");
    }
    if recorded.contains('\\') || recorded.contains('\0') {
        return refuse("it holds a backslash or a NUL");
    }
    let p = Path::new(recorded);
    if p.is_absolute() {
        return match p.file_name() {
            Some(n) => Ok(PathBuf::from(n)),
            None => refuse("an absolute path that names no file"),
        };
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir => return refuse("it climbs out with \"..\""),
            Component::RootDir | Component::Prefix(_) => return refuse("not a relative path"),
        }
    }
    if out.as_os_str().is_empty() {
        return refuse("it names no file");
    }
    Ok(out)
}

/// The whole of a small file (JSON): at most `max` bytes, allocated fallibly.
pub fn read_small(path: &Path, what: &str, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let (file, len) = open_regular(path, what)?;
    if len > max {
        bail!(
            ErrIo,
            "{what} {}: {len} bytes, more than the {max} this library reads for it",
            path.display()
        );
    }
    let mut v = Vec::new();
    if v.try_reserve_exact(len as usize).is_err() {
        bail!(
            ErrCapacity,
            "{what} {}: out of memory for its {len} bytes",
            path.display()
        );
    }
    // The file may have grown since fstat: read at most `max + 1` bytes.
    file.take(max + 1).read_to_end(&mut v).map_err(|e| {
        Error::new(
            EngramStatus::ErrIo,
            format!("{what} {}: {e}", path.display()),
        )
    })?;
    if v.len() as u64 > max {
        bail!(
            ErrIo,
            "{what} {}: more than the {max} bytes this library reads for it",
            path.display()
        );
    }
    Ok(v)
}

/// Make sure a parse whose peak is at most `per_byte` bytes of memory per
/// byte of its `len`-byte input can run: that much is reserved, fallibly, and
/// given back before the parse (which allocates infallibly, inside a library
/// that is not ours). `ErrCapacity` naming `what` when it is not there, so a
/// file too big for the memory left is a status, not an abort.
pub fn parse_headroom(len: usize, per_byte: usize, what: &str) -> Result<()> {
    let n = len.saturating_mul(per_byte);
    let mut v: Vec<u8> = Vec::new();
    if v.try_reserve_exact(n).is_err() {
        bail!(
            ErrCapacity,
            "{what}: parsing its {len} bytes takes up to {n} bytes of memory ({per_byte} per byte), \
             which cannot be had"
        );
    }
    drop(v);
    Ok(())
}

/// Bytes held in 16-byte aligned memory (so that any element type of a
/// weight can be read from it in place), allocated fallibly.
pub struct AlignedBuf {
    words: Vec<u128>,
    len: usize,
}

impl AlignedBuf {
    /// `len` zero bytes; `ErrCapacity` naming `what` when memory is short.
    pub fn zeroed(len: usize, what: &str) -> Result<AlignedBuf> {
        let words = crate::fallible::try_vec(len.div_ceil(16), 0u128, what)?;
        Ok(AlignedBuf { words, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialised bytes (u128s, any
        // bit pattern of which is a valid run of u8s); the borrow is tied to `self`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, borrowed mutably from `self`.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// Bytes of owned memory this buffer holds.
    pub fn capacity_bytes(&self) -> usize {
        self.words.len() * 16
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// `len` bytes at `offset` of `file` (named `what`), read with `pread` into
/// owned aligned memory: a file cut short is `ErrIo`, never a signal.
pub fn read_range(file: &File, offset: u64, len: u64, what: &str) -> Result<AlignedBuf> {
    let n = usize::try_from(len)
        .ok()
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| Error::new(EngramStatus::ErrFormat, format!("{what}: {len} bytes")))?;
    let mut buf = AlignedBuf::zeroed(n, what)?;
    read_exact_at(file, buf.as_mut_slice(), offset, what)?;
    Ok(buf)
}

/// Fill `dst` from `file` at `offset` with `pread`.
pub fn read_exact_at(file: &File, dst: &mut [u8], offset: u64, what: &str) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(dst, offset).map_err(|e| {
            Error::new(
                EngramStatus::ErrIo,
                format!(
                    "{what}: reading {} bytes at offset {offset}: {e}",
                    dst.len()
                ),
            )
        })
    }
    #[cfg(not(unix))]
    {
        let _ = (file, dst, offset);
        bail!(ErrUnsupported, "{what}: reading files needs a unix system")
    }
}

/// Map `file` (of `len` bytes) read-only. Reading a mapping whose file was cut
/// short raises SIGBUS: the callers say when they use one.
pub fn map(file: &File, len: u64, path: &Path, what: &str) -> Result<memmap2::Mmap> {
    if len == 0 {
        bail!(ErrFormat, "{what} {}: empty file", path.display());
    }
    // SAFETY: a private read-only mapping of a regular file; the file must not
    // be truncated while mapped (the loaders document this for mmap mode).
    unsafe { memmap2::MmapOptions::new().map(file) }.map_err(|e| {
        Error::new(
            EngramStatus::ErrIo,
            format!("{what} {}: cannot map: {e}", path.display()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_refused_before_any_read() {
        let e = open_regular(Path::new("/"), "model").unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrIo);
        assert!(e.message.contains("a directory"), "{}", e.message);
        let e = read_small(Path::new("/nonexistent/engram"), "config", 10).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrIo);
    }

    #[test]
    fn aligned_buffers_are_aligned() {
        let b = AlignedBuf::zeroed(37, "x").unwrap();
        assert_eq!(b.as_slice().len(), 37);
        assert_eq!(b.as_slice().as_ptr() as usize % 16, 0);
        assert!(AlignedBuf::zeroed(0, "x").unwrap().is_empty());
    }
}
