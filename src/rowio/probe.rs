//! The disk probe: random direct reads of one block size at a range of
//! depths (reads in flight), through the reader's modes and through plain
//! buffered `pread` threads, on a file dropped from the page cache. Issue
//! 35's targets divide a cold step's distinct reads by "the disk's best
//! random-read rate, which the benchmark probes itself": this is that probe
//! (`benches/disk.rs` prints it; the end-to-end benchmark calls it).

use super::{Force, ReadCounts, ReaderOptions, RowRead, RowReader};
use crate::error::{Error, Result};
use crate::EngramStatus;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the probe reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// A [`RowReader`] in the mode `Force` asks (its report is kept).
    Reader(Force),
    /// `depth` threads each doing one buffered `pread` at a time.
    BufferedPread,
}

/// One depth's measurement.
#[derive(Clone, Debug)]
pub struct ProbeRow {
    /// The method as measured (a reader's mode report, or "buffered pread").
    pub method: String,
    pub block: u64,
    pub depth: u32,
    pub reads: u64,
    pub secs: f64,
    pub reads_per_s: f64,
    pub mb_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
}

/// A small, fast generator (splitmix64) for offsets and file content.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the bias of a modulo of 2^64 is negligible here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::new(EngramStatus::ErrIo, format!("{what}: {e}"))
}

/// Write `bytes` of random content to a new file at `path` (replacing one
/// there), flush it to the disk and drop it from the page cache.
pub fn make_file(path: &Path, bytes: u64) -> Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| io(&format!("creating {}", path.display()), e))?;
    let chunk = 8usize << 20;
    let mut buf = crate::fallible::try_vec(chunk, 0u8, "the probe file's write buffer")?;
    let mut rng = Rng(0x5eed ^ bytes);
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(chunk as u64) as usize;
        for w in buf[..n].chunks_mut(8) {
            let v = rng.next_u64().to_le_bytes();
            w.copy_from_slice(&v[..w.len()]);
        }
        f.write_all_at(&buf[..n], at)
            .map_err(|e| io(&format!("writing {}", path.display()), e))?;
        at += n as u64;
    }
    drop_cache(&f)?;
    Ok(f)
}

/// Flush `f` and drop its pages from the page cache (`fdatasync`, then
/// `posix_fadvise(POSIX_FADV_DONTNEED)`), so that reads go to the disk.
pub fn drop_cache(f: &File) -> Result<()> {
    f.sync_data().map_err(|e| io("fdatasync", e))?;
    // SAFETY: a plain system call on an open descriptor.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(io("posix_fadvise", std::io::Error::from_raw_os_error(r)));
    }
    Ok(())
}

fn row(method: String, block: u64, depth: u32, c: &ReadCounts, t: Duration) -> ProbeRow {
    let secs = t.as_secs_f64().max(1e-9);
    ProbeRow {
        method,
        block,
        depth,
        reads: c.reads_issued,
        secs,
        reads_per_s: c.reads_issued as f64 / secs,
        mb_per_s: c.bytes_read as f64 / secs / 1e6,
        p50_us: c.latency.quantile(0.5) as f64 / 1e3,
        p99_us: c.latency.quantile(0.99) as f64 / 1e3,
    }
}

/// Random `block`-byte reads of `file` (of `size` bytes) through a reader at
/// `depth`, for about `secs`.
fn reader_at(
    file: &Arc<File>,
    size: u64,
    block: u64,
    depth: u32,
    force: Force,
    secs: f64,
) -> Result<ProbeRow> {
    let o = ReaderOptions {
        force,
        depth,
        threads: depth.saturating_sub(1),
    };
    let r = RowReader::open_with(file, 0, size, o)?;
    let batch = (32 * depth as usize).max(256);
    let mut dst = crate::fallible::try_vec(batch * block as usize, 0u8, "the probe's rows")?;
    let mut rng = Rng(u64::from(depth) * 7919 + block);
    let blocks = size / block;
    let mut c = ReadCounts::default();
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        let mut reqs = crate::fallible::try_room(batch, "the probe's requests")?;
        for d in dst.chunks_mut(block as usize) {
            reqs.push(RowRead {
                offset: rng.below(blocks) * block,
                dst: d,
            });
        }
        c.add(&r.read(&mut reqs)?);
    }
    Ok(row(r.mode().to_string(), block, depth, &c, t0.elapsed()))
}

/// `depth` threads of random buffered `pread`s of `block` bytes, for `secs`.
fn pread_at(file: &File, size: u64, block: u64, depth: u32, secs: f64) -> Result<ProbeRow> {
    drop_cache(file)?;
    let blocks = size / block;
    let t0 = Instant::now();
    let parts: Vec<Result<ReadCounts>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..depth)
            .map(|t| {
                s.spawn(move || {
                    let mut c = ReadCounts::default();
                    let mut rng = Rng(u64::from(t) * 104_729 + block);
                    let mut b = crate::fallible::try_vec(block as usize, 0u8, "a probe read")?;
                    while t0.elapsed().as_secs_f64() < secs {
                        let t = Instant::now();
                        file.read_exact_at(&mut b, rng.below(blocks) * block)
                            .map_err(|e| io("probe pread", e))?;
                        c.latency.record(t.elapsed().as_nanos() as u64);
                        c.reads_issued += 1;
                        c.bytes_read += block;
                    }
                    Ok(c)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a probe thread panicked"))
            .collect()
    });
    let t = t0.elapsed();
    let mut c = ReadCounts::default();
    for p in parts {
        c.add(&p?);
    }
    Ok(row("buffered pread".into(), block, depth, &c, t))
}

/// Measure `method` on the file at `path` (made by [`make_file`], or any
/// file at least a few blocks long) for each depth, about `secs` a depth.
pub fn random_read_rate_with(
    path: &Path,
    block: u64,
    depths: &[u32],
    method: Method,
    secs: f64,
) -> Result<Vec<ProbeRow>> {
    let (f, size) = crate::files::open_regular(path, "the probe file")?;
    if block == 0 || size < block {
        crate::error::bail!(
            ErrInvalidArgument,
            "a probe of {block}-byte reads of a {size}-byte file"
        );
    }
    let f = Arc::new(f);
    let mut out = crate::fallible::try_room(depths.len(), "the probe's rows")?;
    for &d in depths {
        let d = d.max(1);
        out.push(match method {
            Method::Reader(force) => reader_at(&f, size, block, d, force, secs)?,
            Method::BufferedPread => pread_at(&f, size, block, d, secs)?,
        });
    }
    Ok(out)
}

/// The reader's best mode (as `RowReader::open` would choose) on the file
/// at `path`, `block`-byte random reads at each of `depths` in flight, one
/// second each: the disk's random-read rate is the best `reads_per_s`.
pub fn random_read_rate(path: &Path, block: u64, depths: &[u32]) -> Result<Vec<ProbeRow>> {
    random_read_rate_with(path, block, depths, Method::Reader(Force::Auto), 1.0)
}
