//! The benchmark's hash workloads (benches/cpu.rs `bench_hash`: DeepSeek-V4.1's
//! tables, 4096 random tokens of one sequence; 64 sequences decoding one
//! token a step) in a process of their own, to profile or count one piece at
//! a time:
//!
//!     cargo build --release --example hash_profile
//!     valgrind --tool=callgrind target/release/examples/hash_profile prefill avx2 10
//!
//! Arguments: the workload (`prefill`: `History::hash` of the 4096 tokens;
//! `windows`: only `HashTables::hash_runs` on the same tokens' look-back
//! entries, laid out once; `decode`: 259 steps of 64 sequences), the path
//! (`best`, `avx512n` (the 32-bit correction), `avx512`, `avx2`, `scalar`,
//! `division`) and the repetitions.
//! Prints the median seconds of one repetition and a checksum of the ids.

use engram::hash::tables::HashPath;
use engram::hash::{HashTables, History, Run};
use engram::{HashTablesIn, Limits};
use serde_json::Value;
use std::time::Instant;

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("an array")
        .iter()
        .map(|x| x.as_u64().expect("a u64"))
        .collect()
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let usage = "usage: hash_profile prefill|windows|decode|decode-runs [best|avx512n|avx512|avx2|scalar|division] [reps]";
    let Some(work) = a.get(1) else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let path = a.get(2).map_or("best", String::as_str);
    let reps: usize = a.get(3).and_then(|r| r.parse().ok()).unwrap_or(20);
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let data = root.join("tests/golden/data");
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(data.join("v41_hash.json")).expect("golden v41_hash.json"),
    )
    .expect("JSON");
    let map: Vec<i32> = std::fs::read(data.join("v41_token_map.i32"))
        .expect("golden v41_token_map.i32")
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let (mult, primes, offsets) = (
        u64s(&g["multipliers"]),
        u64s(&g["primes"]),
        u64s(&g["offsets"]),
    );
    let t = HashTables::new(&HashTablesIn {
        layer_ids: &[1, 14],
        max_ngram: 4,
        n_heads: 8,
        token_map: &map,
        pad_id: map[2] as i64,
        multipliers: &mult,
        primes: &primes,
        offsets: &offsets,
    })
    .expect("the V4.1 tables");
    let want = match path {
        "best" => t.path(),
        "avx512n" => HashPath::Avx512Narrow,
        "avx512" => HashPath::Avx512,
        "avx2" => HashPath::Avx2Narrow,
        "scalar" => HashPath::Scalar,
        "division" => HashPath::Division,
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let Some(t) = t.with_path(want) else {
        eprintln!("path {want:?}: not on this CPU");
        std::process::exit(1);
    };
    let (prefill_n, seqs, steps) = (4096usize, 64usize, 256usize);
    let limits = Limits {
        max_tokens: prefill_n,
        max_seqs: seqs,
        max_positions: prefill_n + steps + 8,
    };
    let per = t.n_layers() * t.cols();
    // The benchmark's generator and seed, so the tokens are its tokens.
    let mut z = 42u64;
    let mut below = |n: u64| {
        z = z.wrapping_add(0x9e3779b97f4a7c15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
        (x ^ (x >> 31)) % n
    };
    let vocab = map.len() as u64;
    let prefill: Vec<i32> = (0..prefill_n).map(|_| below(vocab) as i32).collect();
    let pos: Vec<i32> = (0..prefill_n as i32).collect();
    let zeros = vec![0i32; prefill_n];
    let mut h = History::new(limits).expect("a history");
    let mut times = Vec::new();
    let mut sum = 0i64;
    match work.as_str() {
        "prefill" => {
            let mut out = vec![0i64; prefill_n * per];
            for _ in 0..reps {
                let s = Instant::now();
                h.hash(&t, &prefill, &zeros, &pos, &mut out).expect("hash");
                times.push(s.elapsed().as_secs_f64());
            }
            sum = out.iter().sum();
        }
        "windows" => {
            // One run over the whole sequence: the pad look-back of position
            // 0, then the compressed tokens.
            let xs: Vec<i64> = std::iter::repeat_n(t.pad_id, t.max_ngram - 1)
                .chain(prefill.iter().map(|&x| map[x as usize] as i64))
                .collect();
            let runs = [Run {
                x: 0,
                len: prefill_n,
            }];
            let mut out = vec![0i64; prefill_n * per];
            for _ in 0..reps {
                let s = Instant::now();
                t.hash_runs(&xs, &runs, &mut out);
                times.push(s.elapsed().as_secs_f64());
            }
            sum = out.iter().sum();
        }
        "decode-runs" => {
            // The kernel alone on a decode step's shape: 64 runs of one
            // token, each after its own look-back.
            let xs: Vec<i64> = (0..seqs * t.max_ngram)
                .map(|i| map[prefill[i] as usize] as i64)
                .collect();
            let runs: Vec<Run> = (0..seqs)
                .map(|s| Run {
                    x: s * t.max_ngram,
                    len: 1,
                })
                .collect();
            let mut dout = vec![0i64; seqs * per];
            for _ in 0..reps {
                let s = Instant::now();
                for _ in 0..steps + 3 {
                    t.hash_runs(&xs, &runs, &mut dout);
                    sum = sum.wrapping_add(dout[0]);
                }
                times.push(s.elapsed().as_secs_f64() / (steps + 3) as f64);
            }
        }
        "decode" => {
            let stream: Vec<Vec<i32>> = (0..steps + 3)
                .map(|_| (0..seqs).map(|_| below(vocab) as i32).collect())
                .collect();
            let seq_ids: Vec<i32> = (0..seqs as i32).collect();
            let step_pos: Vec<Vec<i32>> = (0..steps + 3).map(|s| vec![s as i32; seqs]).collect();
            let mut dout = vec![0i64; seqs * per];
            for _ in 0..reps {
                let s = Instant::now();
                for (toks, p) in stream.iter().zip(&step_pos) {
                    h.hash(&t, toks, &seq_ids, p, &mut dout).expect("hash");
                    sum = sum.wrapping_add(dout.iter().sum::<i64>());
                }
                times.push(s.elapsed().as_secs_f64() / (steps + 3) as f64);
            }
        }
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{work} on {:?}: median {:.3} us of {reps} (min {:.3}); checksum {sum}",
        t.path(),
        times[times.len() / 2] * 1e6,
        times[0] * 1e6
    );
}
