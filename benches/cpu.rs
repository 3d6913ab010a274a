//! CPU benchmark: hash throughput against DeepSeek's numpy approach, and
//! `apply` at the DeepSeek-V4.1 geometry against PyTorch on the CPU and
//! against the roofline, all measured in this one run.
//!
//!     bash bench/setup.sh            # once: numpy + torch in bench/.venv
//!     cargo bench --bench cpu        # ENGRAM_BENCH_THREADS=N to pick threads
//!
//! Without bench/.venv the Python peers are skipped and said to be.

use engram::formats::f32_to_bf16;
use engram::hash::derive_primes;
use engram::projection::{Kernel, Projection};
use engram::{
    Context, ContextConfig, EngramType, Geometry, HashTablesIn, Highway, LayerIn, Limits,
    RowFormat, TableIn, Weights,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Median seconds of `f`, at least `reps` runs and at least `min_s` seconds.
fn median(reps: usize, min_s: f64, mut f: impl FnMut()) -> f64 {
    let mut t = Vec::new();
    let start = Instant::now();
    while t.len() < reps || (start.elapsed().as_secs_f64() < min_s && t.len() < 10 * reps) {
        let s = Instant::now();
        f();
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[t.len() / 2]
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn python() -> Option<PathBuf> {
    let p = root().join("bench/.venv/bin/python");
    p.exists().then_some(p)
}

fn run_peer(mode: &str, spec: &Value) -> Option<Value> {
    let py = python()?;
    let path =
        std::env::temp_dir().join(format!("engram-bench-{mode}-{}.json", std::process::id()));
    std::fs::write(&path, spec.to_string()).unwrap();
    let out = std::process::Command::new(py)
        .arg(root().join("bench/peers.py"))
        .arg(mode)
        .arg(&path)
        .output()
        .expect("run bench/peers.py");
    let _ = std::fs::remove_file(&path);
    if !out.status.success() {
        eprintln!(
            "peer {mode} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    serde_json::from_str(&line).ok()
}

fn load(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Read bandwidth of main memory with `threads` threads: best of 3 passes
/// over a 2 GiB buffer (far larger than the last-level cache).
fn memory_bandwidth(threads: usize) -> f64 {
    let n = (2usize << 30) / 8;
    let buf: Vec<u64> = (0..n as u64).collect();
    let chunk = n.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..3 {
        let s = Instant::now();
        let total: u64 = std::thread::scope(|sc| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|c| {
                    sc.spawn(move || {
                        let mut acc = [0u64; 8];
                        for b in c.chunks_exact(8) {
                            for j in 0..8 {
                                acc[j] = acc[j].wrapping_add(b[j]);
                            }
                        }
                        acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .fold(0u64, |a, b| a.wrapping_add(b))
        });
        std::hint::black_box(total);
        best = best.max((n * 8) as f64 / s.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let threads: usize = std::env::var("ENGRAM_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
    println!(
        "engram CPU benchmark: {threads} threads, projection kernel {:?}",
        Kernel::detect()
    );
    if python().is_none() {
        println!("(bench/.venv missing: run `bash bench/setup.sh` for the numpy and PyTorch peers; skipping them)");
    }
    let only = std::env::var("ENGRAM_BENCH_ONLY").unwrap_or_default();
    if only.is_empty() || only == "hash" {
        bench_hash();
    }
    if only.is_empty() || only == "apply" {
        bench_apply(threads);
    }
}

fn bench_hash() {
    let g = load(&root().join("tests/golden/data/v41_hash.json"));
    let map_path = root().join("tests/golden/data/v41_token_map.i32");
    let map: Vec<i32> = std::fs::read(&map_path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let layer_ids: Vec<u32> = [1, 14].into();
    let (mult, primes, offsets) = (
        u64s(&g["multipliers"]),
        u64s(&g["primes"]),
        u64s(&g["offsets"]),
    );
    let pad_id = map[2] as i64;
    let (prefill_n, seqs, steps) = (4096usize, 64usize, 256usize);
    let cfg = ContextConfig {
        geometry: Geometry {
            d: 5120,
            hc: 4,
            hd: 256,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: 4,
            n_heads: 8,
            token_map: &map,
            pad_id,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: prefill_n,
            max_seqs: seqs,
            max_positions: prefill_n + steps + 8,
        },
        n_threads: 1,
        backend: engram::EngramBackend::Cpu as u32,
    };
    let ctx = Context::new(&cfg).unwrap();
    let per = ctx.ids_per_token();
    let mut rng = Rng(42);
    let vocab = map.len() as u64;
    let prefill: Vec<i32> = (0..prefill_n).map(|_| rng.below(vocab) as i32).collect();
    let pos: Vec<i32> = (0..prefill_n as i32).collect();
    let zeros = vec![0i32; prefill_n];
    let mut out = vec![0i64; prefill_n * per];
    ctx.hash(&prefill, &zeros, &pos, &mut out).unwrap();
    let prefill_sum: i64 = out.iter().sum();
    let t_prefill = median(20, 0.5, || {
        ctx.hash(&prefill, &zeros, &pos, &mut out).unwrap()
    });

    // Decode: 64 sequences, each first given its 3-token look-back, then one
    // token per sequence per step.
    let stream: Vec<Vec<i32>> = (0..steps + 3)
        .map(|_| (0..seqs).map(|_| rng.below(vocab) as i32).collect())
        .collect();
    let seq_ids: Vec<i32> = (0..seqs as i32).collect();
    let mut dout = vec![0i64; seqs * per];
    let run_decode = |sum: &mut i64, dout: &mut [i64]| {
        for (s, toks) in stream.iter().enumerate() {
            ctx.hash(toks, &seq_ids, &vec![s as i32; seqs], dout)
                .unwrap();
            if s >= 3 {
                *sum += dout.iter().sum::<i64>();
            }
        }
    };
    let mut decode_sum = 0i64;
    run_decode(&mut decode_sum, &mut dout);
    let t_decode = median(5, 0.5, || {
        let mut s = 0;
        run_decode(&mut s, &mut dout);
    }) / (steps + 3) as f64;

    println!("\n## hash (DeepSeek-V4.1 tables, 2 layers x 24 ids per token, one thread)");
    println!(
        "prefill {prefill_n} tokens: {:.3} ms ({:.1} M tokens/s)",
        t_prefill * 1e3,
        prefill_n as f64 / t_prefill / 1e6
    );
    println!(
        "decode step of {seqs} sequences: {:.2} us ({:.1} M tokens/s)",
        t_decode * 1e6,
        seqs as f64 / t_decode / 1e6
    );
    let spec = json!({
        "token_map": map_path, "n_layers": 2, "max_ngram": 4, "heads": 8,
        "multipliers": mult.iter().map(|&m| m as i64).collect::<Vec<_>>(), "primes": primes, "offsets": offsets,
        "pad_id": pad_id, "prefill": prefill, "decode": stream,
    });
    if let Some(p) = run_peer("hash", &spec) {
        let (np_prefill, np_decode) = (
            p["prefill_s"].as_f64().unwrap(),
            p["decode_step_s"].as_f64().unwrap(),
        );
        assert_eq!(
            p["prefill_sum"].as_i64().unwrap(),
            prefill_sum,
            "numpy and engram disagree on the prefill ids"
        );
        assert_eq!(
            p["decode_sum"].as_i64().unwrap(),
            decode_sum,
            "numpy and engram disagree on the decode ids"
        );
        println!(
            "numpy approach: prefill {:.3} ms, decode step {:.1} us; ids identical (checksums)",
            np_prefill * 1e3,
            np_decode * 1e6
        );
        println!(
            "ratio (numpy time / engram time): prefill {:.1}x (target >= 10x), decode {:.1}x (target >= 100x)",
            np_prefill / t_prefill,
            np_decode / t_decode
        );
    }
}

fn bench_apply(threads: usize) {
    // V4.1 geometry; the table is smaller than the real 384M rows (the gather
    // reads 48 rows a token either way), the hash tables are sized to it.
    let (d, hc, hd, heads, ngram) = (5120usize, 4usize, 256usize, 8usize, 4usize);
    let cols = (ngram - 1) * heads;
    let (k_in, k_out) = (cols * hd, d * (hc + 1));
    let nl = 4usize;
    let primes = derive_primes(nl, ngram, heads, 40_000);
    let offsets = engram::hash::derive_offsets(&primes, cols);
    let rows: u64 = primes
        .chunks(cols)
        .map(|c| c.iter().sum::<u64>())
        .max()
        .unwrap();
    let mult: Vec<u64> = (0..(nl * ngram) as u64).map(|i| 2 * i + 1).collect();
    let token_map: Vec<i32> = (0..1000).collect();
    // Four layers' weights (1.26 GB of wkv), visited in turn, so that wkv is
    // read from memory as in a model, not from the last-level cache.
    let layer_ids = [1u32, 14, 27, 40];
    let ns = [1usize, 8, 64, 512];
    let cfg = ContextConfig {
        geometry: Geometry {
            d,
            hc,
            hd,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: ngram,
            n_heads: heads,
            token_map: &token_map,
            pad_id: 0,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 512,
            max_seqs: 1,
            max_positions: 1,
        },
        n_threads: threads,
        backend: engram::EngramBackend::Cpu as u32,
    };
    let mut rng = Rng(7);
    let rb = RowFormat::new(EngramType::Fp8E4m3E8m0 as u32, hd)
        .unwrap()
        .row_bytes(hd);
    println!("\n## apply at the V4.1 geometry (D 5120, hc 4, C 24, Hd 256; bf16 wkv [{k_out} x {k_in}], fp8 rows; {rows} table rows)");
    let data: Vec<(Vec<u8>, Vec<u16>, Vec<f32>, Vec<f32>)> = (0..nl)
        .map(|_| {
            let table: Vec<u8> = (0..rows as usize * rb)
                .map(|i| {
                    if i % rb >= hd {
                        120 + rng.below(10) as u8
                    } else {
                        let c = rng.next() as u8;
                        if c & 0x7F == 0x7F {
                            0
                        } else {
                            c
                        }
                    }
                })
                .collect();
            let wkv: Vec<u16> = (0..k_in * k_out)
                .map(|_| f32_to_bf16(rng.f32() / 32.0))
                .collect();
            let q: Vec<f32> = (0..hc * d).map(|_| 1.0 + rng.f32() / 8.0).collect();
            let k: Vec<f32> = (0..hc * d).map(|_| 1.0 + rng.f32() / 8.0).collect();
            (table, wkv, q, k)
        })
        .collect();
    let ctx = Context::new(&cfg).unwrap();
    for (li, (table, wkv, q, k)) in data.iter().enumerate() {
        ctx.set_layer(LayerIn {
            layer_id: layer_ids[li],
            table: TableIn {
                data: table,
                format: RowFormat::new(EngramType::Fp8E4m3E8m0 as u32, hd).unwrap(),
                rows,
            },
            wkv: Weights::Bf16(wkv),
            q: Weights::F32(q),
            k: Weights::F32(k),
        })
        .unwrap();
    }
    let per = ctx.ids_per_token();
    let bw = memory_bandwidth(threads);
    // Our kernel's GEMM rate on a large problem.
    let gemm_ours = {
        let p = Projection::new(threads).unwrap();
        let (n, o) = (512usize, 2048usize);
        let x: Vec<u16> = (0..n * k_in).map(|_| f32_to_bf16(rng.f32())).collect();
        let mut kv = vec![0f32; n * o];
        let w = &data[0].1[..o * k_in];
        let t = median(3, 0.5, || p.run(&x, n, k_in, Weights::Bf16(w), o, &mut kv));
        2.0 * (n * o * k_in) as f64 / t
    };
    let mut ours = Vec::new();
    for &n in &ns {
        let ids: Vec<i64> = (0..n * per)
            .map(|i| {
                let l = (i / cols) % nl;
                offsets[l * cols + i % cols] as i64 + rng.below(primes[l * cols + i % cols]) as i64
            })
            .collect();
        let mut hw: Vec<f32> = (0..n * hc * d).map(|_| rng.f32()).collect();
        let mut layer = 0usize;
        let t = median(if n <= 64 { 12 } else { 4 }, 1.0, || {
            layer = (layer + 1) % nl;
            ctx.apply(layer_ids[layer], &ids, n, Highway::F32(&mut hw))
                .unwrap();
        });
        ours.push(t);
    }
    let spec = json!({"threads": threads, "D": d, "hc": hc, "Hd": hd, "C": cols, "table_rows": rows, "ns": ns});
    let peer = run_peer("apply", &spec);
    let gemm_torch = peer.as_ref().and_then(|p| p["gemm_flops"].as_f64());
    let best_gemm = gemm_ours.max(gemm_torch.unwrap_or(0.0));
    let wkv_bytes = (k_in * k_out * 2) as f64;
    println!(
        "memory read bandwidth {:.1} GB/s; bf16 GEMM rate: engram {:.1} GFLOP/s{}",
        bw / 1e9,
        gemm_ours / 1e9,
        gemm_torch
            .map(|g| format!(", torch {:.1} GFLOP/s", g / 1e9))
            .unwrap_or_default()
    );
    println!("| tokens | engram ms | torch ms | torch/engram | roofline ms | engram/roofline |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (i, &n) in ns.iter().enumerate() {
        let flops = 2.0 * (n * k_in * k_out) as f64;
        let roof = (wkv_bytes / bw).max(flops / best_gemm);
        let torch = peer.as_ref().and_then(|p| p[n.to_string()].as_f64());
        println!(
            "| {n} | {:.2} | {} | {} | {:.2} | {:.2} |",
            ours[i] * 1e3,
            torch
                .map(|t| format!("{:.2}", t * 1e3))
                .unwrap_or("-".into()),
            torch
                .map(|t| format!("{:.2}x", t / ours[i]))
                .unwrap_or("-".into()),
            roof * 1e3,
            ours[i] / roof
        );
    }
    let hist_formula = |positions: usize, seqs: usize| positions * seqs * 4;
    println!(
        "\ncontext memory: measured {} bytes (hash tables {} + q*k {} + history {} by the README's formula)",
        ctx.memory_bytes(),
        token_map.len() * 4 + (mult.len() + primes.len() + offsets.len()) * 8,
        nl * hc * d * 4,
        hist_formula(0, 1)
    );
}
