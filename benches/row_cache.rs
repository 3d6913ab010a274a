//! Row cache benchmark: the cost of a decode step's gather (48 rows a token:
//! 2 layers x 24, fp8 rows of 264 bytes, dequantised to bf16) through the host
//! row cache, against the same table resident in memory (a warm mapping, the
//! floor) and read with `pread` from a warm page cache, in one run, methods
//! alternated, the median of several rounds.
//!
//! - `memory`: the table mapped, every page resident (the floor);
//! - `pread`: one `pread` a row from the warm page cache (today's file path);
//! - `cache all`: the file behind a cache that holds every row, warmed up
//!   (every lookup a hit: the hit path's cost);
//! - `cache 1/8`: a cache of an eighth of the table (Zipf ids: hits and
//!   misses, the misses read with `pread` from the warm page cache).
//!
//! Run:
//!
//!     cargo bench --bench row_cache
//!     ENGRAM_BENCH_MB=256 ENGRAM_BENCH_ROUNDS=5 ENGRAM_BENCH_STEPS=200
//!
//! Without `--bench` (`cargo test --all-targets`): a smoke run checking that
//! every method gives the same rows.

use engram::cpu::stager::{Source, Stager};
use engram::formats::EngramType;
use engram::rowcache::PolicyKind;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

const HD: usize = 256;
const RB: usize = HD + HD / 32; // fp8 e4m3 codes + e8m0 scales
const COLS: usize = 24;
const LAYERS: usize = 2;

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

/// `k` row ids with Zipf(1) ranks scattered over `rows` by a hash.
fn zipf_ids(k: usize, rows: u64, seed: u64) -> Vec<i64> {
    let ln = (rows as f64).ln();
    (0..k)
        .map(|i| {
            let u = (mix64(seed ^ i as u64) >> 11) as f64 / (1u64 << 53) as f64;
            (mix64((u * ln).exp() as u64 ^ 0x5eed) % rows) as i64
        })
        .collect()
}

fn make_table(path: &std::path::Path, rows: u64) -> File {
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
    let f = File::open(path).unwrap();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0;
    while let Ok(n @ 1..) = f.read_at(&mut buf, off) {
        off += n as u64; // the page cache warm
    }
    f
}

/// A stager over the file (`Some(budget)`: behind a cache of `budget` bytes
/// a layer) or over the mapping (`None`).
fn stager(file: &Arc<File>, map: &[u8], rows: u64, cache: Option<u64>) -> Stager {
    let s = Stager::new(LAYERS, 2).expect("a stager");
    s.set_row_cache(cache.unwrap_or(0), PolicyKind::S3Fifo);
    for li in 0..LAYERS {
        let src = match cache {
            Some(_) => Source::File {
                file: file.clone(),
                offset: 0,
                len: rows * RB as u64,
            },
            None => Source::memory(map),
        };
        s.set_source(li, src, EngramType::Fp8E4m3E8m0, RB).unwrap();
    }
    s
}

/// Gather `ids` (`n` tokens of both layers, layer-major) on the calling
/// thread, as an apply of unstaged ids does. Returns seconds.
fn gather(s: &Stager, ids: &[i64], out: &mut [u16]) -> f64 {
    let t = Instant::now();
    let half = ids.len() / LAYERS;
    for li in 0..LAYERS {
        s.gather(
            li,
            1,
            HD,
            &ids[li * half..(li + 1) * half],
            &mut out[li * half * HD..(li + 1) * half * HD],
        )
        .unwrap()
        .unwrap();
    }
    t.elapsed().as_secs_f64()
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let mb: u64 = env("ENGRAM_BENCH_MB", if full { 256 } else { 4 });
    let rounds: usize = env("ENGRAM_BENCH_ROUNDS", if full { 5 } else { 1 });
    let steps: usize = env("ENGRAM_BENCH_STEPS", if full { 200 } else { 4 });
    let dir = std::path::PathBuf::from("target/bench-row-cache");
    std::fs::create_dir_all(&dir).unwrap();
    let rows = mb * 1_000_000 / RB as u64;
    let path = dir.join(format!("table_{rows}.bin"));
    let file = Arc::new(make_table(&path, rows));
    // SAFETY: the bench's own file, not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&*file) }.unwrap();
    let table = rows * RB as u64;
    let methods: [(&str, Option<u64>); 4] = [
        ("memory", None),
        ("pread", Some(0)),
        ("cache all", Some(table)),
        ("cache 1/8", Some(table / 8)),
    ];
    let st: Vec<Stager> = methods
        .iter()
        .map(|m| stager(&file, &map, rows, m.1))
        .collect();
    // `cache all` takes in every row (both layers) before anything is timed.
    let all: Vec<i64> = (0..rows as i64).collect();
    let mut buf = vec![0u16; 2 * 4096 * HD];
    for c in all.chunks(4096) {
        let both: Vec<i64> = c.iter().chain(c).copied().collect();
        gather(&st[2], &both, &mut buf[..both.len() * HD]);
    }
    println!(
        "Table {:.0} MB ({rows} rows of {RB} B, fp8), Zipf(1) ids, {} rows a token, S3-FIFO, {steps} steps a round, {rounds} rounds (median), methods alternated.\n",
        table as f64 / 1e6,
        LAYERS * COLS
    );
    println!("| tokens a step | method | us a step | x memory | host hit rate |\n|---:|---|---:|---:|---:|");
    for n in [1usize, 8, 64] {
        let k = n * COLS * LAYERS;
        let mut out = vec![0u16; k * HD];
        let mut want = vec![0u16; k * HD];
        // Warm-up: every cache sees the ids of a round once (and `cache all`
        // every row it will be asked for), outside the timing.
        for s in 0..steps {
            let ids = zipf_ids(k, rows, (n * 1000 + s) as u64);
            gather(&st[0], &ids, &mut want);
            for m in &st[1..] {
                gather(m, &ids, &mut out);
                assert!(out == want, "every method gives the memory table's rows");
            }
        }
        for m in &st {
            for li in 0..LAYERS {
                if let Some(c) = m.cache_stats(li) {
                    c.reset();
                }
            }
        }
        let mut times = vec![Vec::new(); methods.len()];
        for r in 0..rounds {
            for (mi, m) in st.iter().enumerate() {
                let mut secs = 0.0;
                for s in 0..steps {
                    let ids = zipf_ids(k, rows, (n * 1000 + s) as u64 ^ (r as u64 + 1) << 40);
                    secs += gather(m, &ids, &mut out);
                }
                times[mi].push(secs / steps as f64);
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let floor = med(&mut times[0]);
        for (mi, (name, _)) in methods.iter().enumerate() {
            let t = med(&mut times[mi]);
            let c = st[mi]
                .cache_stats(0)
                .map(|c| c.snapshot())
                .unwrap_or_default();
            let hit = if c.lookups > 0 {
                format!("{:.1}%", 100.0 * c.hits as f64 / c.lookups as f64)
            } else {
                "-".into()
            };
            println!(
                "| {n} | {name} | {:.1} | {:.2} | {hit} |",
                t * 1e6,
                t / floor
            );
        }
    }
    drop(map);
    let _ = std::fs::remove_file(&path);
}
