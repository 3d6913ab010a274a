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
    let len = check_regular(&file, path, what)?;
    Ok((file, len))
}

/// The length of `file` (opened from `path`, named `what`), or `ErrIo` when
/// it is not a regular file: asked of the file held, never of a path.
fn check_regular(file: &File, path: &Path, what: &str) -> Result<u64> {
    let meta = file.metadata().map_err(|e| {
        Error::new(
            EngramStatus::ErrIo,
            format!("{what} {}: {e}", path.display()),
        )
    })?;
    if !meta.is_file() {
        let kind = file_kind(&meta);
        bail!(
            ErrIo,
            "{what} {}: not a regular file ({kind}); a model file must be a regular file",
            path.display()
        );
    }
    Ok(meta.len())
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

/// A directory the loaders read files from (the model's directory, the
/// checkpoint directory or `tables_dir`), held open: every file under it is
/// opened relative to this descriptor, never again by a path that could
/// have changed since it was checked.
///
/// The rule (one for every loader and for `engram-inspect`; docs/file-safety.md):
/// a file opened through a `ModelDir` lies inside it (links followed only
/// while they stay inside), or, where the directory is a Hugging Face hub
/// snapshot (`<repo>/snapshots/<rev>`), is a link into that repository's
/// `<repo>/blobs`. Resolution is done by the kernel with `openat2(2)` and
/// `RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS` where it has it, else one
/// component at a time with `O_NOFOLLOW` from held directory descriptors
/// (links read with `readlinkat` and resolved by this code); neither can be
/// raced by a writer who swaps a file or a directory for a link.
pub struct ModelDir {
    dir: File,
    root: PathBuf,
    /// `Some` when the directory is `<repo>/snapshots/<rev>` and `<repo>/blobs` exists.
    hub: Option<Hub>,
}

struct Hub {
    /// `<repo>`, resolved (absolute link targets are compared with it).
    repo: PathBuf,
    /// `<rev>`: the snapshot's own name.
    rev: std::ffi::OsString,
    blobs: File,
}

/// A file opened through a [`ModelDir`]: checked to be a regular file.
#[derive(Debug)]
pub struct Opened {
    pub file: File,
    /// Its length when it was opened.
    pub len: u64,
    /// Where it was looked for (the directory joined with the path asked
    /// for), for messages: in a hub snapshot, the link's path, not the blob's.
    pub path: PathBuf,
}

/// Why a path could not be opened beneath a directory.
enum Miss {
    /// Nothing there (or a non-directory on the way).
    Absent,
    /// The path leads outside (a link, `..` from a link).
    Outside,
    Io(std::io::Error),
}

thread_local! {
    static FORCE_WALK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Set once `openat2` has answered `ENOSYS` or `EPERM` (an old kernel, or a
/// seccomp filter): every later open walks.
static NO_OPENAT2: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Tests: make this thread's opens through [`ModelDir`] use the
/// component-by-component walk instead of `openat2` (`true`), or the default
/// (`false`). Returns the previous setting.
#[doc(hidden)]
pub fn force_walk(on: bool) -> bool {
    FORCE_WALK.with(|f| f.replace(on))
}

/// The most links followed in one path (as the kernel's `MAXSYMLINKS`).
const MAX_LINKS: u32 = 40;

#[cfg(unix)]
fn cstr(p: &std::ffi::OsStr) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))
}

/// `openat(dir, name, flags)`, the new descriptor owned.
#[cfg(unix)]
fn openat(dir: &File, name: &std::ffi::OsStr, flags: libc::c_int) -> std::io::Result<File> {
    use std::os::unix::io::{AsRawFd, FromRawFd};
    let c = cstr(name)?;
    // SAFETY: `dir` is an open descriptor for the duration of the call and
    // `c` a NUL-terminated string that outlives it; openat only reads them.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// The target of link `name` in `dir`.
#[cfg(unix)]
fn readlinkat(dir: &File, name: &std::ffi::OsStr) -> std::io::Result<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::AsRawFd;
    let c = cstr(name)?;
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: `buf` is writable for `buf.len()` bytes, `c` is NUL-terminated
    // and `dir` open for the call; readlinkat writes at most `buf.len()` bytes.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let n = n as usize;
    if n >= buf.len() {
        return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    buf.truncate(n);
    Ok(PathBuf::from(std::ffi::OsStr::from_bytes(&buf)))
}

/// Flags of the file a walk or `openat2` ends on: read-only, never blocking
/// on a FIFO.
#[cfg(unix)]
const FILE_FLAGS: libc::c_int = libc::O_RDONLY | libc::O_NONBLOCK;

impl ModelDir {
    /// Open the directory `base` (the caller's path, used as given, links
    /// included). `Ok(None)` when there is no directory there.
    pub fn open(base: &Path) -> Result<Option<ModelDir>> {
        let base = if base.as_os_str().is_empty() {
            Path::new(".")
        } else {
            base
        };
        let Ok(root) = base.canonicalize() else {
            return Ok(None);
        };
        let dir = match open_dir(&root) {
            Ok(d) => d,
            Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => return Ok(None),
            Err(e) => bail!(ErrIo, "{}: {e}", base.display()),
        };
        let hub = Self::hub(&root);
        Ok(Some(ModelDir { dir, root, hub }))
    }

    /// The hub layout: `root` is `<repo>/snapshots/<rev>` and `<repo>/blobs`
    /// is a directory.
    fn hub(root: &Path) -> Option<Hub> {
        let rev = root.file_name()?.to_os_string();
        let snapshots = root.parent()?;
        if snapshots.file_name()? != "snapshots" {
            return None;
        }
        let repo = snapshots.parent()?.to_path_buf();
        let repo_dir = open_dir(&repo).ok()?;
        let blobs = openat(
            &repo_dir,
            std::ffi::OsStr::new("blobs"),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        )
        .ok()?;
        Some(Hub { repo, rev, blobs })
    }

    /// The directory, resolved.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Open the file a model file records as `recorded` (the value of key
    /// `what`, named in messages). An absolute path keeps only its file name;
    /// a relative one may hold only plain names ([`confined_candidate`]).
    /// `Ok(None)`: nothing is there (the caller says what it looked for);
    /// `ErrFormat` naming the key and the path for a path the rule refuses
    /// or one that leads outside.
    pub fn open_recorded(&self, recorded: &str, what: &str) -> Result<Option<Opened>> {
        let rel = confined_candidate(recorded, what)?;
        self.open_rel(&rel, &format!("{what} is {recorded:?}:"))
    }

    /// Open the file `name` (a plain name the library chose: `config.json`,
    /// `tokenizer.json`, the index, a split shard), by the same rule.
    pub fn open_name(&self, name: &str, what: &str) -> Result<Option<Opened>> {
        self.open_rel(Path::new(name), what)
    }

    /// Where `rel` would be, for messages.
    pub fn display(&self, rel: &Path) -> PathBuf {
        self.root.join(rel)
    }

    /// `rel` opened by the rule; `label` starts every message.
    fn open_rel(&self, rel: &Path, label: &str) -> Result<Option<Opened>> {
        let shown = self.root.join(rel);
        let file = match self.resolve(rel) {
            Ok(f) => f,
            Err(Miss::Absent) => return Ok(None),
            Err(Miss::Outside) => bail!(
                ErrFormat,
                "{label} {} leads outside {} (a file the loaders read must stay inside the model's directory or \
                 tables_dir, or be a Hugging Face snapshot's link into its repository's blobs)",
                shown.display(),
                self.root.display()
            ),
            Err(Miss::Io(e)) => bail!(ErrIo, "{label} {}: {e}", shown.display()),
        };
        let len = check_regular(&file, &shown, label)?;
        Ok(Some(Opened {
            file,
            len,
            path: shown,
        }))
    }

    fn resolve(&self, rel: &Path) -> std::result::Result<File, Miss> {
        #[cfg(target_os = "linux")]
        {
            use std::sync::atomic::Ordering;
            if !FORCE_WALK.with(|f| f.get()) && !NO_OPENAT2.load(Ordering::Relaxed) {
                match self.beneath(rel) {
                    Ok(f) => return Ok(f),
                    Err(e) => match e.raw_os_error() {
                        Some(libc::ENOENT) | Some(libc::ENOTDIR) => return Err(Miss::Absent),
                        // Outside: only a hub snapshot's blob links may leave.
                        Some(libc::EXDEV) if self.hub.is_none() => return Err(Miss::Outside),
                        Some(libc::EXDEV) | Some(libc::EAGAIN) => {}
                        Some(libc::ENOSYS) | Some(libc::EPERM) => {
                            NO_OPENAT2.store(true, Ordering::Relaxed)
                        }
                        _ => return Err(Miss::Io(e)),
                    },
                }
            }
        }
        self.walk(rel)
    }

    /// `openat2(dir, rel, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`, retried
    /// while the kernel answers `EAGAIN` (a rename raced the lookup).
    #[cfg(target_os = "linux")]
    fn beneath(&self, rel: &Path) -> std::io::Result<File> {
        use std::os::unix::io::{AsRawFd, FromRawFd};
        #[repr(C)]
        struct OpenHow {
            flags: u64,
            mode: u64,
            resolve: u64,
        }
        let c = cstr(rel.as_os_str())?;
        let how = OpenHow {
            flags: (FILE_FLAGS | libc::O_CLOEXEC) as u64,
            mode: 0,
            resolve: libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
        };
        let mut last = std::io::Error::from_raw_os_error(libc::EAGAIN);
        for _ in 0..16 {
            // SAFETY: `how` is a `struct open_how` (three u64s, the layout of
            // linux/openat2.h) passed with its size; `c` is NUL-terminated and
            // `self.dir` open for the call; the kernel only reads them.
            let fd = unsafe {
                libc::syscall(
                    libc::SYS_openat2,
                    self.dir.as_raw_fd(),
                    c.as_ptr(),
                    &how as *const OpenHow,
                    std::mem::size_of::<OpenHow>(),
                )
            };
            if fd >= 0 {
                // SAFETY: the syscall returned a new descriptor, owned by nothing else.
                return Ok(unsafe { File::from_raw_fd(fd as libc::c_int) });
            }
            last = std::io::Error::last_os_error();
            if last.raw_os_error() != Some(libc::EAGAIN) {
                break;
            }
        }
        Err(last)
    }

    /// Resolve `rel` one component at a time from held directory
    /// descriptors, each opened with `O_NOFOLLOW`; a link met on the way is
    /// read (`readlinkat`) and its target resolved the same way, never left
    /// to the kernel. `..` steps back to a descriptor already held, and
    /// past the directory is outside.
    #[cfg(unix)]
    fn walk(&self, rel: &Path) -> std::result::Result<File, Miss> {
        use std::path::Component;
        let comps = |p: &Path, out: &mut Vec<std::ffi::OsString>| {
            for c in p.components().rev() {
                match c {
                    Component::Normal(n) => out.push(n.to_os_string()),
                    Component::ParentDir => out.push("..".into()),
                    _ => {}
                }
            }
        };
        // Still to resolve, the next one last.
        let mut todo = Vec::new();
        comps(rel, &mut todo);
        // The directories walked into below `self.dir`, with their names.
        let mut dirs: Vec<(File, std::ffi::OsString)> = Vec::new();
        let mut links = 0u32;
        while let Some(c) = todo.pop() {
            if c == ".." {
                if dirs.pop().is_none() {
                    return Err(Miss::Outside);
                }
                continue;
            }
            let last = todo.is_empty();
            let cur = dirs.last().map_or(&self.dir, |d| &d.0);
            let flags = libc::O_NOFOLLOW
                | if last {
                    FILE_FLAGS
                } else {
                    libc::O_RDONLY | libc::O_DIRECTORY
                };
            let err = match openat(cur, &c, flags) {
                Ok(f) if last => return Ok(f),
                Ok(f) => {
                    dirs.push((f, c));
                    continue;
                }
                Err(e) => e,
            };
            if err.raw_os_error() == Some(libc::ENOENT) {
                return Err(Miss::Absent);
            }
            // A link (ELOOP from O_NOFOLLOW; ENOTDIR from O_DIRECTORY on some
            // systems), or a file on the way (ENOTDIR).
            let target = match readlinkat(cur, &c) {
                Ok(t) => t,
                Err(_) if err.raw_os_error() == Some(libc::ENOTDIR) => return Err(Miss::Absent),
                Err(e)
                    if e.raw_os_error() == Some(libc::EINVAL)
                        && err.raw_os_error() == Some(libc::ELOOP)
                        && links < MAX_LINKS =>
                {
                    // A link when opened, no longer one: swapped back; look again.
                    links += 1;
                    todo.push(c);
                    continue;
                }
                Err(_) => return Err(Miss::Io(err)),
            };
            links += 1;
            if links > MAX_LINKS {
                return Err(Miss::Io(std::io::Error::from_raw_os_error(libc::ELOOP)));
            }
            if last {
                if let Some(blob) = self.hub_blob(&dirs, &target) {
                    let hub = self.hub.as_ref().expect("hub_blob found a hub");
                    return openat(&hub.blobs, &blob, FILE_FLAGS | libc::O_NOFOLLOW).map_err(|e| {
                        match e.raw_os_error() {
                            Some(libc::ENOENT) => Miss::Absent,
                            Some(libc::ELOOP) => Miss::Outside,
                            _ => Miss::Io(e),
                        }
                    });
                }
            }
            if target.is_absolute() {
                return Err(Miss::Outside);
            }
            comps(&target, &mut todo);
        }
        // `rel` named no file (only "." or links back to the directory).
        Err(Miss::Absent)
    }

    /// In a hub snapshot, the blob a link at `<rev>/<dirs>/` to `target`
    /// names, when `target` leads, read as written, to `<repo>/blobs/<name>`.
    #[cfg(unix)]
    fn hub_blob(
        &self,
        dirs: &[(File, std::ffi::OsString)],
        target: &Path,
    ) -> Option<std::ffi::OsString> {
        use std::path::Component;
        let hub = self.hub.as_ref()?;
        let mut at: Vec<std::ffi::OsString> = Vec::new();
        let rest = if target.is_absolute() {
            target.strip_prefix(&hub.repo).ok()?
        } else {
            at.push("snapshots".into());
            at.push(hub.rev.clone());
            at.extend(dirs.iter().map(|d| d.1.clone()));
            target
        };
        for c in rest.components() {
            match c {
                Component::Normal(n) => at.push(n.to_os_string()),
                Component::ParentDir => {
                    at.pop()?;
                }
                Component::CurDir => {}
                _ => return None,
            }
        }
        match &at[..] {
            [b, name] if b == "blobs" => Some(name.clone()),
            _ => None,
        }
    }
}

#[cfg(not(unix))]
impl ModelDir {
    fn walk(&self, _: &Path) -> std::result::Result<File, Miss> {
        Err(Miss::Io(std::io::Error::other(
            "opening model files needs a unix system",
        )))
    }
}

/// A directory opened read-only (following links: a path the caller gave).
fn open_dir(p: &Path) -> std::io::Result<File> {
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC);
    }
    o.open(p)
}

/// The relative path [`ModelDir::open_recorded`] looks for under its base, for `recorded`
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
    let (file, len) = open_regular(path, what)?;
    read_whole(&file, len, path, what, max)
}

/// The whole of an open small file (`len` bytes at open, from `path`): at
/// most `max` bytes, allocated fallibly.
pub fn read_whole(file: &File, len: u64, path: &Path, what: &str, max: u64) -> Result<Vec<u8>> {
    use std::io::Read;
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
