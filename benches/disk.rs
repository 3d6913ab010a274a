//! The disk probe and the row reader's microbenchmark (issue 35 item 2).
//!
//! Probe: a file of random content (8 GiB, or `ENGRAM_PROBE_BYTES`) in
//! `ENGRAM_PROBE_DIR` (default: the cargo target directory), flushed and
//! dropped from the page cache, then random reads of 512 and 4096 bytes at
//! 1, 2, 4, ..., 128 in flight for `ENGRAM_PROBE_SECS` (default 1) each:
//! through the row reader's io_uring and pread-pool modes (direct I/O) and
//! through plain buffered `pread` threads (page cache dropped first), each
//! `ENGRAM_PROBE_RUNS` times (default 3); the table gives medians.
//!
//! Rows: 264-byte rows (V4.1's fp8 row) at random ids of the same file read
//! as one table: 1 to 98304 rows a call through the reader (io_uring; the
//! pool; the pool with no threads, i.e. every read on the calling thread) against today's path (one `pread` a row on
//! the calling thread), cold (page cache dropped) and warm (the same rows
//! read just before), medians of the runs, and the ratio pread / reader.
//!
//!     cargo bench --bench disk
//!     ENGRAM_PROBE_BYTES=$((1<<30)) ENGRAM_PROBE_PART=rows cargo bench --bench disk
//!
//! The file is deleted at the end (and on a panic).

use engram::rowio::probe::{self, drop_cache, Method, ProbeRow, Rng};
use engram::rowio::{Force, ReaderOptions, RowRead, RowReader};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

const DEPTHS: [u32; 8] = [1, 2, 4, 8, 16, 32, 64, 128];
const RB: usize = 264;

struct Remove(PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn probe_part(path: &std::path::Path, runs: usize, secs: f64) {
    let methods = [
        Method::Reader(Force::Uring),
        Method::Reader(Force::Pool),
        Method::BufferedPread,
    ];
    println!("\n## Random reads (medians of {runs} runs, {secs} s a depth)\n");
    println!("| method | block | depth | reads/s | MB/s | p50 us | p99 us |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    for block in [512u64, 4096] {
        for m in methods {
            let rs: Vec<Vec<ProbeRow>> = (0..runs)
                .map(|_| probe::random_read_rate_with(path, block, &DEPTHS, m, secs).unwrap())
                .collect();
            for (i, d) in DEPTHS.iter().enumerate() {
                let col = |f: fn(&ProbeRow) -> f64| median(rs.iter().map(|r| f(&r[i])).collect());
                println!(
                    "| {} | {block} | {d} | {:.0} | {:.1} | {:.0} | {:.0} |",
                    rs[0][i].method,
                    col(|r| r.reads_per_s),
                    col(|r| r.mb_per_s),
                    col(|r| r.p50_us),
                    col(|r| r.p99_us),
                );
            }
        }
    }
}

/// Seconds to read `ids` one `pread` a row (today's path).
fn per_row_pread(f: &File, ids: &[u64], dst: &mut [u8]) -> f64 {
    let t = Instant::now();
    for (i, d) in ids.iter().zip(dst.chunks_mut(RB)) {
        f.read_exact_at(d, i * RB as u64).unwrap();
    }
    t.elapsed().as_secs_f64()
}

/// Seconds to read `ids` through `r`.
fn through(r: &RowReader, ids: &[u64], dst: &mut [u8]) -> f64 {
    let mut reqs: Vec<RowRead<'_>> = ids
        .iter()
        .zip(dst.chunks_mut(RB))
        .map(|(&i, d)| RowRead {
            offset: i * RB as u64,
            dst: d,
        })
        .collect();
    let t = Instant::now();
    r.read(&mut reqs).unwrap();
    t.elapsed().as_secs_f64()
}

/// One run of `n` rows: seconds of [pread, each reader] cold, then the
/// same warm.
fn rows_run(f: &Arc<File>, rs: &[RowReader], n: usize, seed: u64) -> Vec<f64> {
    let rows = f.metadata().unwrap().len() / RB as u64;
    let mut rng = Rng(seed);
    let mut dst = vec![0u8; n * RB];
    let mut ids = || (0..n).map(|_| rng.below(rows)).collect::<Vec<u64>>();
    let mut out = Vec::new();
    // Cold: fresh rows for each, the page cache dropped before each.
    let a = ids();
    drop_cache(f).unwrap();
    out.push(per_row_pread(f, &a, &mut dst));
    for r in rs {
        let b = ids();
        drop_cache(f).unwrap();
        out.push(through(r, &b, &mut dst));
    }
    // Warm: the same rows read just before.
    per_row_pread(f, &a, &mut dst);
    out.push(per_row_pread(f, &a, &mut dst));
    for r in rs {
        through(r, &a, &mut dst);
        out.push(through(r, &a, &mut dst));
    }
    out
}

fn rows_part(f: &Arc<File>, runs: usize) {
    let len = f.metadata().unwrap().len() / RB as u64 * RB as u64;
    let open = |force, depth, threads| {
        RowReader::open_with(
            f,
            0,
            len,
            ReaderOptions {
                force,
                depth,
                threads,
            },
        )
        .unwrap()
    };
    // The pool with no threads reads every call on the calling thread: the
    // measure of what a hand-off to the pool costs for small calls.
    let rs = [
        open(Force::Uring, 64, 0),
        open(Force::Pool, 0, 31),
        open(Force::Pool, 0, 0),
    ];
    for r in &rs {
        println!("reader: {}", r.mode());
    }
    let k = rs.len() + 1;
    println!("\n## {RB}-byte rows a call (medians of {runs} runs; ratio = pread / reader)\n");
    println!("| rows | state | pread ms | io_uring ms | pool ms | inline ms | pread/io_uring | pread/pool | pread/inline |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for n in [1usize, 2, 4, 8, 24, 192, 1536, 98304] {
        let rs_: Vec<Vec<f64>> = (0..runs)
            .map(|j| rows_run(f, &rs, n, 1000 * n as u64 + j as u64))
            .collect();
        let col = |i: usize| median(rs_.iter().map(|r| r[i]).collect());
        let rat = |i: usize, j: usize| median(rs_.iter().map(|r| r[i] / r[j]).collect());
        for (state, o) in [("cold", 0), ("warm", k)] {
            println!(
                "| {n} | {state} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} |",
                col(o) * 1e3,
                col(o + 1) * 1e3,
                col(o + 2) * 1e3,
                col(o + 3) * 1e3,
                rat(o, o + 1),
                rat(o, o + 2),
                rat(o, o + 3)
            );
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let bytes: u64 = env("ENGRAM_PROBE_BYTES", 8u64 << 30);
    let secs: f64 = env("ENGRAM_PROBE_SECS", 1.0);
    let runs: usize = env("ENGRAM_PROBE_RUNS", 3).max(1);
    let part: String = env("ENGRAM_PROBE_PART", "all".to_string());
    let dir = std::env::var_os("ENGRAM_PROBE_DIR")
        .or_else(|| std::env::var_os("CARGO_TARGET_DIR"))
        .map_or_else(|| PathBuf::from("target"), PathBuf::from);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("engram-disk-probe-{}", std::process::id()));
    let _rm = Remove(path.clone());
    let t = Instant::now();
    let f = Arc::new(probe::make_file(&path, bytes).unwrap());
    println!(
        "# Disk probe: {} ({bytes} bytes, written and flushed in {:.1} s)",
        path.display(),
        t.elapsed().as_secs_f64()
    );
    if part == "all" || part == "probe" {
        probe_part(&path, runs, secs);
    }
    if part == "all" || part == "rows" {
        rows_part(&f, runs);
    }
}
