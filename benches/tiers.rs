//! End to end on a full-size V4.1 layer (issue 35 item 6): layer 1's table
//! (384,006,168 rows) as Q2_K rows of 84 bytes in one 32 GB file, which this
//! machine's RAM cannot hold, read by `apply` through each of today's paths
//! and through the row cache, cold and warm, against the same rows resident
//! in memory and against the disk's own floor, all measured in one run.
//!
//!     cargo bench --bench tiers               # measure (writes the file once)
//!     cargo bench --bench tiers -- --delete   # remove the file
//!
//! Environment: `ENGRAM_TIERS_FILE` (default `$CARGO_TARGET_DIR/tiers/q2k_layer.bin`),
//! `ENGRAM_TIERS_ROWS` (a smaller layer for development: the V4.1 tables with
//! each n-gram's vocabulary scaled down to about that many rows),
//! `ENGRAM_TIERS_TEXT` (a corpus directory as `tools/engram-replay/corpus.sh`
//! writes it; default `$CARGO_TARGET_DIR/tiers/corpus`; without it the ids are
//! a synthetic Zipf stream, labelled), `ENGRAM_TIERS_LAYER_US` (the time of one
//! model layer, for the lead time), `ENGRAM_TIERS_LAYERS_BEFORE` (the layers
//! before the engram layer whose time is the lead: default 1, layer 1; 13 for
//! V4.1's engram layer 14), `ENGRAM_TIERS_STEPS` (measured steps per
//! step size), `ENGRAM_TIERS_WARM` (warm-up tokens), `ENGRAM_TIERS_RUNS`
//! (cold prefill runs), `ENGRAM_TIERS_CACHE_MIB` (cache sizes, comma-separated),
//! `ENGRAM_TIERS_PROBE_S` (seconds a depth of the disk probe), and the row
//! cache's own `ENGRAM_ROW_CACHE_POLICY`.
//!
//! The file needs its size plus 4 GiB free (checked with `statvfs`; the bench
//! says what is missing and exits with status 2). Equal RAM for mmap's bytes
//! a token is an exact LRU model of 4 KiB pages (cgroups here are v1 and not
//! writable), without read-around, so it favours mmap.
//!
//! The projection is light on purpose (D = 16, hc = 1: a `[32, 6144]` bf16
//! wkv; V4.1's is `[25600, 6144]`): `apply` is timed whole, and its time here
//! is the row path (find, read, dequantise) plus a projection of ~0.2 MFLOP a token.

#[path = "tiers/file.rs"]
mod file;
#[path = "tiers/ids.rs"]
mod ids;

use engram::call::TableSource;
use engram::tables::{tokenizer, EngramConfig, EngramTables};
use engram::{Context, ContextConfig, EngramType, Geometry, Highway, LayerIn, Limits, Weights};
use file::{HEADER, RB};
use ids::C;
use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const LAYER: u32 = 1;
const D: usize = 16;
const HC: usize = 1;
const HD: usize = 256;
const PREFILL: usize = 4096;
const DECODE: [usize; 3] = [1, 8, 64];

fn env<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"))
}

struct Opts {
    path: PathBuf,
    text: PathBuf,
    layer_us: f64,
    layers_before: usize,
    steps: usize,
    warm: usize,
    runs: usize,
    caches: Vec<u64>,
}

fn opts() -> Opts {
    Opts {
        path: std::env::var_os("ENGRAM_TIERS_FILE")
            .map(PathBuf::from)
            .unwrap_or_else(|| target_dir().join("tiers/q2k_layer.bin")),
        text: std::env::var_os("ENGRAM_TIERS_TEXT")
            .map(PathBuf::from)
            .unwrap_or_else(|| target_dir().join("tiers/corpus")),
        layer_us: env("ENGRAM_TIERS_LAYER_US", 500.0),
        layers_before: env("ENGRAM_TIERS_LAYERS_BEFORE", LAYER as usize),
        steps: env("ENGRAM_TIERS_STEPS", 32),
        warm: env("ENGRAM_TIERS_WARM", 8192),
        runs: env("ENGRAM_TIERS_RUNS", 3),
        caches: std::env::var("ENGRAM_TIERS_CACHE_MIB")
            .unwrap_or_else(|_| "1024,4096".into())
            .split(',')
            .filter_map(|s| s.trim().parse::<u64>().ok())
            .map(|m| m << 20)
            .collect(),
    }
}

/// The V4.1 hash tables from the model's config and tokenizer (the golden
/// copies), each n-gram's vocabulary scaled to `rows` rows a layer if given.
fn tables(rows: Option<u64>) -> (EngramTables, tokenizers::Tokenizer) {
    let g = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden/data");
    let mut cfg = EngramConfig::from_file(&g.join("v41_config.json")).unwrap();
    let tok = tokenizer::load(&g.join("deepseek_v4_tokenizer.json")).unwrap();
    if let Some(r) = rows {
        let full: u64 = cfg.vocab_per_ngram.iter().sum::<u64>() * cfg.n_heads as u64;
        for v in cfg.vocab_per_ngram.iter_mut() {
            *v = (*v as u128 * r as u128 / full as u128) as u64;
        }
        cfg.num_embeddings = None;
    }
    let tm = tokenizer::token_map(&tok).unwrap();
    (EngramTables::derive(cfg, tm).unwrap(), tok)
}

fn context<'w>(t: &EngramTables) -> Context<'w> {
    Context::new(&ContextConfig {
        geometry: Geometry {
            d: D,
            hc: HC,
            hd: HD,
            eps: 1e-6,
        },
        tables: t.as_input(),
        limits: Limits {
            max_tokens: PREFILL,
            max_seqs: 64,
            max_positions: 1 << 20,
        },
        n_threads: 2,
        backend: engram::call::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    })
    .unwrap()
}

/// The light projection's weights (seeded, finite).
struct Weights0 {
    wkv: Vec<u16>,
    q: Vec<f32>,
    k: Vec<f32>,
}

impl Weights0 {
    fn new() -> Weights0 {
        let wkv = (0..D * (HC + 1) * C * HD)
            .map(|i| {
                engram::formats::f32_to_bf16(
                    ((file::mix64(i as u64) >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05,
                )
            })
            .collect();
        Weights0 {
            wkv,
            q: vec![1.0; HC * D],
            k: vec![1.0; HC * D],
        }
    }

    fn layer<'w>(&'w self, table: &'w [u8], rows: u64, file: Option<Arc<File>>) -> LayerIn<'w> {
        let mut l = LayerIn::host(
            LAYER,
            table,
            EngramType::Q2_K,
            rows,
            Weights::Bf16(&self.wkv),
            Weights::F32(&self.q),
            Weights::F32(&self.k),
        );
        if let Some(f) = file {
            l.table.source = TableSource::File {
                file: f,
                offset: HEADER,
            };
        }
        l
    }
}

/// An anonymous `MAP_NORESERVE` mapping the size of the table: only the
/// pages written use memory.
struct Anon {
    p: *mut u8,
    len: usize,
}

impl Anon {
    fn new(len: usize) -> Anon {
        // SAFETY: a fresh private anonymous mapping; checked below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "anonymous mapping of {len} bytes");
        Anon {
            p: p as *mut u8,
            len,
        }
    }

    /// Fill the table pages holding `ids`' rows from the file (4 KiB reads at
    /// the page's own offset: the header is one page, so pages line up).
    fn fill(&mut self, f: &File, ids: &[i64]) -> usize {
        use std::os::unix::fs::FileExt;
        let mut pages: Vec<usize> = ids
            .iter()
            .flat_map(|&id| {
                let a = id as usize * RB;
                a / 4096..=(a + RB - 1) / 4096
            })
            .collect();
        pages.sort_unstable();
        pages.dedup();
        let t = self.slice_mut();
        for &p in &pages {
            let end = ((p + 1) * 4096).min(t.len());
            f.read_exact_at(&mut t[p * 4096..end], HEADER + (p * 4096) as u64)
                .unwrap();
        }
        pages.len()
    }

    fn slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `len` bytes, readable and writable, owned by `self`.
        unsafe { std::slice::from_raw_parts_mut(self.p, self.len) }
    }

    fn slice(&self) -> &[u8] {
        // SAFETY: as in `slice_mut`, read only.
        unsafe { std::slice::from_raw_parts(self.p, self.len) }
    }
}

impl Drop for Anon {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.p as *mut libc::c_void, self.len) };
    }
}

#[path = "tiers/run.rs"]
mod run;

fn main() {
    // `cargo bench` passes --bench. `cargo test --all-targets` runs this file
    // without it: then a smoke run of every path on a small scaled layer
    // (synthetic ids, a few steps; the bit checks between paths still hold),
    // its file deleted after.
    if !std::env::args().any(|a| a == "--bench") {
        return smoke();
    }
    run::main();
}

/// The whole benchmark at a size `cargo test` can afford.
fn smoke() {
    let dir = target_dir().join("tiers-smoke");
    let file = dir.join("layer.bin");
    for (k, v) in [
        (
            "ENGRAM_TIERS_FILE",
            file.to_str().expect("a UTF-8 target path"),
        ),
        ("ENGRAM_TIERS_ROWS", "200000"),
        ("ENGRAM_TIERS_TEXT", "/nonexistent: synthetic ids"),
        ("ENGRAM_TIERS_STEPS", "2"),
        ("ENGRAM_TIERS_WARM", "64"),
        ("ENGRAM_TIERS_RUNS", "1"),
        ("ENGRAM_TIERS_CACHE_MIB", "1"),
        ("ENGRAM_TIERS_PROBE_S", "0.02"),
    ] {
        std::env::set_var(k, v);
    }
    run::main();
    let _ = std::fs::remove_dir_all(&dir);
}
