//! Direct, batched reads of table rows from a file (issue 35 item 2): the
//! reads behind a row cache's misses.
//!
//! A call gives rows as (byte offset in the table, destination); the reader
//! sorts them, merges the rows that share (or whose blocks touch) a block
//! into one read ([`plan`]), reads whole blocks of the device's logical
//! block size (a 264-byte row is one or two 512-byte blocks, not a 4 KB
//! page) into aligned bounce buffers with many reads in flight, and copies
//! each row out. How ([`ReadMode`]) is chosen when the reader is opened and
//! reported, never an error: io_uring ([`uring`]) where the kernel and the
//! sandbox allow it, else a pool of `pread` threads ([`pool`]), and
//! buffered reads on the calling thread when direct I/O is refused or
//! pointless (tmpfs). `ENGRAM_ROW_IO=uring|pool|buffered` forces one (a
//! forced mode that cannot be had still falls back, reported).
//! docs/row-cache.md, "Reading the misses", says the rest.
//!
//! Reads are bounded and checked like every file read of the library: a
//! file cut short after it was opened is `ErrIo` naming the row, never a
//! signal (nothing is mapped).

mod buf;
mod open;
mod plan;
mod pool;
pub mod probe;
mod req;
mod sync;
mod uring;

pub use buf::Latency;
pub use plan::MAX_EXTENT;
pub use pool::INLINE_EXTENTS;
pub use req::{ReadCounts, RowRead};

use crate::error::{bail, Error, Result};
use crate::EngramStatus;
use buf::AlignedBuf;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

/// How a reader reads, as chosen at open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadMode {
    /// io_uring, `depth` reads in flight a call, `O_DIRECT` reads of
    /// `block`-byte blocks.
    IoUring { depth: u32, block: u64 },
    /// `threads` reader threads with `pread` (plus the calling thread: up to
    /// `depth` = threads + 1 reads in flight), `O_DIRECT` reads of
    /// `block`-byte blocks; `why`: why not io_uring.
    PreadvPool {
        threads: u32,
        depth: u32,
        block: u64,
        why: String,
    },
    /// Buffered `pread` of the rows' own bytes, on the calling thread; `why`:
    /// why not direct reads.
    Buffered { why: String },
}

impl std::fmt::Display for ReadMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadMode::IoUring { depth, block } => {
                write!(f, "io_uring (depth {depth}, O_DIRECT, {block}-byte blocks)")
            }
            ReadMode::PreadvPool {
                threads,
                depth,
                block,
                why,
            } => write!(
                f,
                "pread pool ({threads} threads, depth {depth}, O_DIRECT, {block}-byte blocks; \
                 not io_uring: {why})"
            ),
            ReadMode::Buffered { why } => write!(f, "buffered pread (not direct: {why})"),
        }
    }
}

/// Which mode to use: the best the system allows, or a forced one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Force {
    Auto,
    Uring,
    Pool,
    Buffered,
}

/// How to open a reader.
#[derive(Clone, Copy, Debug)]
pub struct ReaderOptions {
    pub force: Force,
    /// io_uring: reads in flight a call.
    pub depth: u32,
    /// Pool: reader threads.
    pub threads: u32,
}

impl Default for ReaderOptions {
    fn default() -> Self {
        ReaderOptions {
            force: Force::Auto,
            depth: 64,
            threads: 16,
        }
    }
}

impl ReaderOptions {
    /// The defaults, with `ENGRAM_ROW_IO` (`uring`, `pool`, `buffered`;
    /// unset or empty: the best available) forcing a mode; another value is
    /// `ErrInvalidConfig`.
    pub fn from_env() -> Result<ReaderOptions> {
        let force = match std::env::var("ENGRAM_ROW_IO").as_deref() {
            Err(_) | Ok("") | Ok("auto") => Force::Auto,
            Ok("uring") => Force::Uring,
            Ok("pool") => Force::Pool,
            Ok("buffered") => Force::Buffered,
            Ok(v) => bail!(
                ErrInvalidConfig,
                "ENGRAM_ROW_IO={v:?}: expected uring, pool or buffered"
            ),
        };
        Ok(ReaderOptions {
            force,
            ..ReaderOptions::default()
        })
    }
}

enum Engine {
    Uring(uring::Uring),
    Pool(pool::Pool),
    /// Buffered reads; spare bounce buffers of the calls.
    Buffered(Mutex<Vec<AlignedBuf>>),
}

/// Reads rows of one table in a file (see the module's documentation).
/// Safe to share between threads; each call is independent.
pub struct RowReader {
    /// The file as the library opened it (buffered reads use it).
    file: Arc<File>,
    /// Its direct-I/O twin, for the direct modes.
    direct: Option<File>,
    base: u64,
    len: u64,
    /// Alignment of reads (1 when buffered).
    block: u64,
    mode: ReadMode,
    engine: Engine,
}

impl RowReader {
    /// A reader of the table of `table_len` bytes at `table_offset` in
    /// `file`, in the mode the system allows (or `ENGRAM_ROW_IO` forces).
    /// The file must hold the table (`ErrIo` otherwise). Opens the file's
    /// direct-I/O twin (`/proc/self/fd/N` with `O_DIRECT`: see `open.rs`),
    /// takes the block size from `statx` (`STATX_DIOALIGN`), else
    /// `BLKSSZGET` on the file's block device, else 512, and tries io_uring,
    /// then the pool; every refusal is a fallback reported by [`Self::mode`].
    pub fn open(file: &Arc<File>, table_offset: u64, table_len: u64) -> Result<RowReader> {
        Self::open_with(file, table_offset, table_len, ReaderOptions::from_env()?)
    }

    /// [`Self::open`] with explicit options (the environment is not read).
    pub fn open_with(
        file: &Arc<File>,
        table_offset: u64,
        table_len: u64,
        o: ReaderOptions,
    ) -> Result<RowReader> {
        let size = file
            .metadata()
            .map_err(|e| Error::new(EngramStatus::ErrIo, format!("the table's file: {e}")))?
            .len();
        if table_offset.checked_add(table_len).is_none_or(|e| e > size) {
            bail!(
                ErrIo,
                "a table of {table_len} bytes at byte {table_offset} of a file of {size} bytes"
            );
        }
        let mut r = RowReader {
            file: Arc::clone(file),
            direct: None,
            base: table_offset,
            len: table_len,
            block: 1,
            mode: ReadMode::Buffered {
                why: "forced (ENGRAM_ROW_IO=buffered or the options)".into(),
            },
            engine: Engine::Buffered(Mutex::new(Vec::new())),
        };
        if o.force == Force::Buffered {
            return Ok(r);
        }
        match open::open_direct(file, table_offset, table_len) {
            Ok(d) => {
                r.block = d.block;
                r.direct = Some(d.file);
            }
            Err(why) => {
                r.mode = ReadMode::Buffered { why };
                return Ok(r);
            }
        }
        r.choose_direct(o)?;
        Ok(r)
    }

    /// io_uring (tried with one real read of the table) or else the pool.
    fn choose_direct(&mut self, o: ReaderOptions) -> Result<()> {
        let why = if o.force == Force::Pool {
            "forced (ENGRAM_ROW_IO=pool or the options)".to_string()
        } else {
            match uring::Uring::new(o.depth.max(1)) {
                Ok(u) => {
                    self.engine = Engine::Uring(u);
                    self.mode = ReadMode::IoUring {
                        depth: o.depth.max(1),
                        block: self.block,
                    };
                    match self.trial() {
                        Ok(()) => return Ok(()),
                        Err(e) => format!("a first read through it failed ({})", e.message),
                    }
                }
                Err(e) => format!("setting it up was refused ({e})"),
            }
        };
        let p = pool::Pool::new(o.threads)?;
        let threads = p.threads();
        self.engine = Engine::Pool(p);
        self.mode = ReadMode::PreadvPool {
            threads,
            depth: threads + 1,
            block: self.block,
            why,
        };
        Ok(())
    }

    /// Read the table's first byte.
    fn trial(&self) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        let mut b = [0u8; 1];
        self.read(&mut [RowRead {
            offset: 0,
            dst: &mut b,
        }])
        .map(|_| ())
    }

    /// How this reader reads (its `Display` is the report).
    pub fn mode(&self) -> &ReadMode {
        &self.mode
    }

    /// The alignment of its reads in bytes (1 when buffered).
    pub fn block(&self) -> u64 {
        self.block
    }

    /// Read rows: each request is (byte offset in the table, destination of
    /// the row's bytes). The requests are sorted by offset (their order in
    /// `reqs` changes); rows sharing a block, or whose blocks touch, are one
    /// read (at most [`MAX_EXTENT`] bytes); up to the mode's depth of reads
    /// are in flight. Safe to call from many threads at once.
    ///
    /// Errors: a row outside the table is `ErrInvalidArgument` (nothing
    /// read); a file cut short or failing is `ErrIo` naming the row (the
    /// destinations of other rows may have been written); out of memory for
    /// the bounce buffers or the plan is `ErrCapacity`.
    pub fn read(&self, reqs: &mut [RowRead<'_>]) -> Result<ReadCounts> {
        plan::check_and_sort(reqs, self.len)?;
        let exts = plan::extents(reqs, self.base, self.block)?;
        if exts.is_empty() {
            return Ok(ReadCounts {
                rows: reqs.len() as u64,
                ..ReadCounts::default()
            });
        }
        let direct = self.direct.as_ref().map(|f| f.as_raw_fd());
        let fd = direct.unwrap_or(self.file.as_raw_fd());
        let (base, block) = (self.base, self.block);
        match &self.engine {
            Engine::Uring(u) => u.read(fd, reqs, &exts, base, block),
            Engine::Pool(p) => p.read(fd, reqs, &exts, base, block),
            Engine::Buffered(bufs) => {
                use pool::lock;
                let mut buf = lock(bufs).pop().unwrap_or(AlignedBuf::empty());
                let r = sync::read_all(fd, reqs, &exts, base, block, &mut buf);
                lock(bufs).push(buf);
                r
            }
        }
    }
}
