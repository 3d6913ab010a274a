//! Gather benchmark: table rows read from a file of a few GB with Zipf-distributed
//! row ids, decode (48 rows a token: 2 layers x 24) and prefill (4096 tokens),
//! page cache warm and cold, in one run:
//!
//! - `pread loop`: a plain single-threaded loop, one `pread` per row, then
//!   dequantise (the baseline);
//! - `mmap loop`: the same loop copying from a mapping of the file;
//! - `prefetch pread`: `engram_prefetch`'s gather (crate::prefetch::Stager) on
//!   worker threads, `posix_fadvise(WILLNEED)` then `pread`, and the apply-side
//!   wait + dequantise;
//! - `prefetch mmap`: the same over the mapping with `madvise(WILLNEED)`.
//!
//! Decode also reports the time `apply` is blocked when the prefetch was
//! issued one step earlier with 1 ms of other work in between (an engine's
//! step), which is the point of prefetching.
//!
//! Cold runs evict the file's pages first (`posix_fadvise(POSIX_FADV_DONTNEED)`,
//! checked with `mincore`), so nothing but this file is dropped.
//!
//!     cargo bench --bench gather
//!     ENGRAM_BENCH_GB=4 ENGRAM_BENCH_WORKERS=8 ENGRAM_BENCH_DIR=target/bench-gather
//!
//! Prints a Markdown table (and writes it to target/bench-gather.md).

use engram::cpu::stager::{Source, Stager};
use engram::formats::{dequant_row_bf16, EngramType};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const HD: usize = 256;
const RB: usize = HD + HD / 32; // fp8 e4m3 + e8m0 scales: 264 bytes
const COLS: usize = 24;
const LAYERS: usize = 2;
const PER: usize = LAYERS * COLS; // 48 rows a token

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// Row ids `[n, 2, 24]` with Zipf(s = 1) ranks (continuous approximation:
/// rank = rows^u), scattered over the table by a hash.
fn zipf_ids(n: usize, rows: u64, seed: u64) -> Vec<i64> {
    let ln = (rows as f64).ln();
    (0..n * PER)
        .map(|i| {
            let u = (mix64(seed ^ i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            let rank = (u * ln).exp() as u64;
            (mix64(rank ^ 0x5eed) % rows) as i64
        })
        .collect()
}

fn make_table(path: &PathBuf, rows: u64) -> File {
    let want = rows * RB as u64;
    if std::fs::metadata(path)
        .map(|m| m.len() == want)
        .unwrap_or(false)
    {
        return File::open(path).unwrap();
    }
    eprintln!(
        "writing {} ({:.2} GB) ...",
        path.display(),
        want as f64 / 1e9
    );
    let t = Instant::now();
    let mut f = std::io::BufWriter::with_capacity(8 << 20, File::create(path).unwrap());
    let mut row = [0u8; RB];
    for r in 0..rows {
        for (j, b) in row[..HD].iter_mut().enumerate() {
            *b = ((r as usize * 7 + j) & 0x3F) as u8; // e4m3 codes, no NaN
        }
        row[HD..].fill(127); // e8m0 scale 1
        f.write_all(&row).unwrap();
    }
    f.into_inner().unwrap().sync_all().unwrap();
    eprintln!("  {:.1} s", t.elapsed().as_secs_f64());
    File::open(path).unwrap()
}

fn evict(f: &File, len: u64, map: &memmap2::Mmap) {
    // SAFETY: advice and unmapping on pages of this process's own mapping and file; nothing reads them meanwhile.
    unsafe {
        // Pages this process maps are not dropped: unmap ours first.
        libc::madvise(
            map.as_ptr() as *mut libc::c_void,
            map.len(),
            libc::MADV_DONTNEED,
        );
        libc::posix_fadvise(
            f.as_raw_fd(),
            0,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

/// Fraction of the mapping's pages resident in the page cache.
fn resident(map: &[u8]) -> f64 {
    let page = 4096usize;
    let n = map.len().div_ceil(page);
    let mut v = vec![0u8; n];
    // SAFETY: mincore writes one byte per page of the mapping into `v`, which has that many.
    let r = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), v.as_mut_ptr()) };
    if r != 0 {
        return f64::NAN;
    }
    v.iter().filter(|&&b| b & 1 == 1).count() as f64 / n as f64
}

fn warm(f: &File, len: u64) {
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while off < len {
        let n = f.read_at(&mut buf, off).unwrap();
        if n == 0 {
            break;
        }
        off += n as u64;
    }
}

struct Setup {
    file: Arc<File>,
    map: memmap2::Mmap,
    rows: u64,
    workers: usize,
}

impl Setup {
    /// A stager over the table file (read with `pread`) or its mapping; each
    /// layer's source is set once, so its generation is [`FIRST_GEN`].
    fn stager(&self, pread: bool) -> Stager {
        let s = Stager::new(LAYERS, self.workers).expect("a stager");
        let fmt = EngramType::Fp8E4m3E8m0;
        for li in 0..LAYERS {
            let src = if pread {
                Source::File {
                    file: self.file.clone(),
                    offset: 0,
                    len: self.rows * RB as u64,
                }
            } else {
                Source::memory(&self.map)
            };
            assert_eq!(s.set_source(li, src, fmt, RB).expect("set"), FIRST_GEN);
        }
        s
    }

    /// Start the gathers of `ids` `[n, 2, 24]` for every layer.
    fn prefetch(st: &Stager, ids: &[i64], n: usize) {
        for li in 0..LAYERS {
            st.stage(li, &Setup::layer_ids(ids, n, li)).unwrap();
        }
    }

    /// Per-layer live ids (as apply computes them) of `ids` `[n, 2, 24]`.
    fn layer_ids(ids: &[i64], n: usize, li: usize) -> Vec<i64> {
        (0..n)
            .flat_map(|t| {
                ids[t * PER + li * COLS..t * PER + (li + 1) * COLS]
                    .iter()
                    .copied()
            })
            .collect()
    }
}

/// The generation of a layer whose source was set once.
const FIRST_GEN: u64 = 1;

/// The baseline: one thread, one read per row, then dequantise. Returns seconds.
fn loop_read(s: &Setup, ids: &[i64], pread: bool, out: &mut [u16]) -> f64 {
    let t = Instant::now();
    let mut row = [0u8; RB];
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(HD)) {
        let off = id as u64 * RB as u64;
        if pread {
            s.file.read_exact_at(&mut row, off).unwrap();
        } else {
            row.copy_from_slice(&s.map[off as usize..off as usize + RB]);
        }
        dequant_row_bf16(EngramType::Fp8E4m3E8m0, &row, o).unwrap();
    }
    t.elapsed().as_secs_f64()
}

/// Prefetch then gather (wait + dequantise) `n` tokens' rows, both layers.
fn prefetch_gather(st: &Stager, ids: &[i64], n: usize, out: &mut [u16]) -> f64 {
    let t = Instant::now();
    Setup::prefetch(st, ids, n);
    gather_only(st, ids, n, out);
    t.elapsed().as_secs_f64()
}

fn gather_only(st: &Stager, ids: &[i64], n: usize, out: &mut [u16]) {
    let half = n * COLS * HD;
    for li in 0..LAYERS {
        let lids = Setup::layer_ids(ids, n, li);
        st.gather(
            li,
            FIRST_GEN,
            HD,
            &lids,
            &mut out[li * half..(li + 1) * half],
        )
        .unwrap()
        .unwrap();
    }
}

/// A 20 MB table, a few tokens: every method gives the same rows.
fn smoke() {
    let dir = PathBuf::from("target/bench-gather-smoke");
    std::fs::create_dir_all(&dir).unwrap();
    let rows = 20_000_000 / RB as u64;
    let file = make_table(&dir.join("table.bin"), rows);
    // SAFETY: the bench's own table file, not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let n = 64;
    let s = Setup {
        file: Arc::new(file),
        map,
        rows,
        workers: 3,
    };
    let ids = zipf_ids(n, rows, 7);
    // The loop reads rows in [n, 2, 24] order; the gather per layer. Compare per layer.
    let mut want = vec![0u16; n * PER * HD];
    loop_read(&s, &ids, true, &mut want);
    for pread in [true, false] {
        let st = s.stager(pread);
        let mut got = vec![0u16; n * PER * HD];
        prefetch_gather(&st, &ids, n, &mut got);
        for li in 0..LAYERS {
            for t in 0..n {
                for c in 0..COLS {
                    let w = &want[((t * PER) + li * COLS + c) * HD..][..HD];
                    let g = &got[(li * n * COLS + t * COLS + c) * HD..][..HD];
                    assert_eq!(w, g, "pread {pread}, layer {li}, token {t}, column {c}");
                }
            }
        }
        assert_eq!(st.stats().staged, LAYERS as u64);
    }
    println!("gather smoke: loop, prefetch pread and prefetch mmap agree on {} rows (cargo bench --bench gather for the benchmark)", n * PER);
}

struct Row {
    regime: String,
    cache: &'static str,
    method: String,
    rows: usize,
    secs: f64,
    tokens: usize,
    note: String,
}

fn main() {
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this too,
    // without it: then a small smoke run that checks the methods agree.
    let full = std::env::args().any(|a| a == "--bench");
    if !full {
        return smoke();
    }
    let gb: f64 = env("ENGRAM_BENCH_GB", 4.0);
    let workers: usize = env("ENGRAM_BENCH_WORKERS", 8);
    let decode_tokens: usize = env("ENGRAM_BENCH_DECODE_TOKENS", 2000);
    let cold_decode_tokens: usize = env("ENGRAM_BENCH_COLD_DECODE_TOKENS", 300);
    let prefill: usize = env("ENGRAM_BENCH_PREFILL", 4096);
    let dir = PathBuf::from(env("ENGRAM_BENCH_DIR", "target/bench-gather".to_string()));
    std::fs::create_dir_all(&dir).unwrap();
    let rows = (gb * 1e9 / RB as f64) as u64;
    let path = dir.join(format!("table_{rows}x{RB}.bin"));
    let file = make_table(&path, rows);
    let len = rows * RB as u64;
    // SAFETY: as above.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let s = Setup {
        file: Arc::new(file),
        map,
        rows,
        workers,
    };
    let mut out = vec![0u16; prefill.max(1) * PER * HD];
    let mut results: Vec<Row> = Vec::new();
    let methods = ["pread loop", "mmap loop", "prefetch pread", "prefetch mmap"];
    for cache in ["warm", "cold"] {
        if cache == "warm" {
            let t = Instant::now();
            warm(&s.file, len);
            eprintln!(
                "warmed the page cache in {:.1} s (resident {:.0}%)",
                t.elapsed().as_secs_f64(),
                100.0 * resident(&s.map)
            );
        }
        let dec_n = if cache == "warm" {
            decode_tokens
        } else {
            cold_decode_tokens
        };
        for (mi, m) in methods.iter().enumerate() {
            let seed = if cache == "warm" { 1 } else { 1000 + mi as u64 };
            // Decode: one token at a time.
            let ids = zipf_ids(dec_n, rows, seed);
            if cache == "cold" {
                evict(&s.file, len, &s.map);
            }
            let res0 = resident(&s.map);
            let pread = m.contains("pread");
            let st = s.stager(pread);
            let mut secs = 0.0;
            for t in 0..dec_n {
                let tid = &ids[t * PER..(t + 1) * PER];
                secs += if m.contains("loop") {
                    loop_read(&s, tid, pread, &mut out[..PER * HD])
                } else {
                    prefetch_gather(&st, tid, 1, &mut out[..PER * HD])
                };
            }
            results.push(Row {
                regime: "decode".into(),
                cache,
                method: m.to_string(),
                rows: dec_n * PER,
                secs,
                tokens: dec_n,
                note: format!("resident at start {:.0}%", 100.0 * res0),
            });
            // Decode, prefetched one step ahead with 1 ms of other work: time blocked in apply.
            if !m.contains("loop") {
                let ids = zipf_ids(dec_n, rows, seed + 77);
                if cache == "cold" {
                    evict(&s.file, len, &s.map);
                }
                let st = s.stager(pread);
                let n_ahead = dec_n.min(if cache == "warm" { 500 } else { 300 });
                let mut blocked = 0.0;
                Setup::prefetch(&st, &ids[..PER], 1);
                for t in 0..n_ahead {
                    std::thread::sleep(Duration::from_millis(1)); // the engine's step
                    let b = Instant::now();
                    gather_only(&st, &ids[t * PER..(t + 1) * PER], 1, &mut out[..PER * HD]);
                    blocked += b.elapsed().as_secs_f64();
                    if t + 1 < n_ahead {
                        Setup::prefetch(&st, &ids[(t + 1) * PER..(t + 2) * PER], 1);
                    }
                }
                eprintln!("{cache} {m} ahead: {:?}", st.stats());
                results.push(Row {
                    regime: "decode, 1 step ahead".into(),
                    cache,
                    method: m.to_string(),
                    rows: n_ahead * PER,
                    secs: blocked,
                    tokens: n_ahead,
                    note: "time apply waits; 1 ms step between".into(),
                });
            }
            // Prefill: one batch of `prefill` tokens.
            let ids = zipf_ids(prefill, rows, seed + 999);
            if cache == "cold" {
                evict(&s.file, len, &s.map);
            }
            let res0 = resident(&s.map);
            let st = s.stager(pread);
            let secs = if m.contains("loop") {
                loop_read(&s, &ids, pread, &mut out)
            } else {
                prefetch_gather(&st, &ids, prefill, &mut out)
            };
            results.push(Row {
                regime: format!("prefill {prefill}"),
                cache,
                method: m.to_string(),
                rows: prefill * PER,
                secs,
                tokens: prefill,
                note: format!("resident at start {:.0}%", 100.0 * res0),
            });
            eprintln!("{cache} {m}: done");
        }
    }
    let mut md = String::new();
    md += &format!(
        "Table file {:.2} GB ({rows} rows of {RB} B, fp8), Zipf(1) row ids, {PER} rows a token, {workers} gather threads, {} cores.\n\n",
        len as f64 / 1e9,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    md += "| regime | cache | method | rows | rows/s | us per token | note |\n|---|---|---|---:|---:|---:|---|\n";
    for r in &results {
        md += &format!(
            "| {} | {} | {} | {} | {:.3e} | {:.1} | {} |\n",
            r.regime,
            r.cache,
            r.method,
            r.rows,
            r.rows as f64 / r.secs,
            r.secs / r.tokens as f64 * 1e6,
            r.note
        );
    }
    println!("{md}");
    std::fs::write("target/bench-gather.md", &md).unwrap();
}
