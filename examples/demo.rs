//! The main job on a built-in tiny model: two sequences share a batch, one
//! prefilling while the other decodes; the hash turns tokens into row ids,
//! `apply` adds the engram term into each token's hyper-connection streams.
//! Then the golden check: the test model's GGUF file, its rows read from the
//! file, against the independent Python reference; the last line is the
//! verdict (and the exit status: 1 if anything differs).
//!
//!     cargo run --release --example demo

use std::path::Path;
use std::time::Instant;

use engram::formats::{bf16_to_f32, f32_to_bf16};
use engram::gguf::{GgufOptions, LoadOptions, LoadedModel};
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{
    Context, ContextConfig, EngramType, Geometry, HashTablesIn, Highway, LayerIn, Limits, RowIds,
    Weights,
};

/// A tiny deterministic generator for the demo's weights.
fn noise(seed: u64, i: u64) -> f32 {
    let mut z = seed.wrapping_mul(0x9e3779b97f4a7c15) ^ i.wrapping_add(0x632be59bd9b4e019);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^= z >> 31;
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("engram demo: DeepSeek-V4.1's engram layer (hash -> rows -> projection -> gate) on a built-in tiny model:");
    println!("two sequences hashed in shared batches (prefill, decode, a rollback, a dead image token, a bad call), then checked against the golden.\n");
    let start = Instant::now();
    built_in_model()?;
    let golden = golden_check()?;
    println!(
        "\nverdict: {}; {:.0} ms in all; rows from the demo's bf16 tables in host memory, and for the golden {}",
        golden.summary(),
        start.elapsed().as_secs_f64() * 1e3,
        golden.rows_from
    );
    if !golden.exact() {
        std::process::exit(1);
    }
    Ok(())
}

/// The demo proper: a model built here, two sequences, the step loop.
fn built_in_model() -> Result<(), engram::Error> {
    // Geometry: D = 128, hc = 4, Hd = 64, N = 3 (2-grams and 3-grams), H = 4 heads.
    let (d, hc, hd, heads, ngram) = (128usize, 4usize, 64usize, 4usize, 3usize);
    let cols = (ngram - 1) * heads;
    let layer_ids = [1u32, 14];
    // A 1000-token vocabulary compressed to 700 ids; tokens 990.. are "image" tokens (-1).
    let token_map: Vec<i32> = (0..1000)
        .map(|t| if t >= 990 { -1 } else { t % 700 })
        .collect();
    let primes = derive_primes_uniform(layer_ids.len(), ngram, heads, 2000).unwrap();
    let offsets = derive_offsets(&primes, cols);
    let multipliers: Vec<u64> = (0..layer_ids.len() * ngram)
        .map(|i| ((noise(7, i as u64).to_bits() as u64) << 20) * 2 + 1)
        .collect();
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
            pad_id: token_map[2] as i64,
            multipliers: &multipliers,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 64,
            max_seqs: 2,
            max_positions: 1024,
        },
        n_threads: 2,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    };

    // Per-layer weights the engine owns: a bf16 table, bf16 wkv, f32 q and k.
    type LayerWeights = (u64, Vec<u8>, Vec<u16>, Vec<f32>, Vec<f32>);
    let weights: Vec<LayerWeights> = (0..layer_ids.len())
        .map(|li| {
            let rows: u64 = primes[li * cols..(li + 1) * cols].iter().sum();
            let table = (0..rows * hd as u64)
                .flat_map(|i| f32_to_bf16(noise(100 + li as u64, i)).to_le_bytes())
                .collect();
            let n_wkv = d * (hc + 1) * cols * hd;
            let wkv = (0..n_wkv as u64)
                .map(|i| f32_to_bf16(noise(200 + li as u64, i) / 16.0))
                .collect();
            let q = (0..(hc * d) as u64)
                .map(|i| 1.0 + noise(300 + li as u64, i) / 8.0)
                .collect();
            let k = (0..(hc * d) as u64)
                .map(|i| 1.0 + noise(400 + li as u64, i) / 8.0)
                .collect();
            (rows, table, wkv, q, k)
        })
        .collect();

    let ctx = Context::new(&cfg)?;
    for (li, (rows, table, wkv, q, k)) in weights.iter().enumerate() {
        ctx.set_layer(LayerIn::host(
            layer_ids[li],
            table,
            EngramType::row_format(EngramType::Bf16 as u32, hd)?,
            *rows,
            Weights::Bf16(wkv),
            Weights::F32(q),
            Weights::F32(k),
        ))?;
        println!(
            "layer {:>2}: table {rows} rows x {hd} (bf16), wkv [{} x {}]",
            layer_ids[li],
            d * (hc + 1),
            cols * hd
        );
    }
    let per = ctx.ids_per_token();

    // Step 1: sequence 0 prefills 6 tokens.
    let step = |name: &str,
                tokens: &[i32],
                seqs: &[i32],
                pos: &[i32]|
     -> Result<(), engram::Error> {
        let n = tokens.len();
        let mut ids = vec![0i64; n * per];
        ctx.hash(tokens, seqs, pos, &mut ids)?;
        let mut highway: Vec<f32> = (0..n * hc * d).map(|i| noise(999, i as u64)).collect();
        let before = highway.clone();
        for &lid in &layer_ids {
            ctx.apply(lid, &ids, n, Highway::F32(&mut highway))?;
        }
        println!("\n{name}: {n} tokens");
        for t in 0..n {
            let sl = t * hc * d..(t + 1) * hc * d;
            let delta: f32 = highway[sl.clone()]
                .iter()
                .zip(&before[sl])
                .map(|(a, b)| (a - b).abs())
                .sum::<f32>()
                / (hc * d) as f32;
            let first = &ids[t * per..t * per + 4];
            println!(
                "  seq {} pos {:>2} token {:>4}: row ids (layer {}) {:?}...  mean |engram term| {:.4}{}",
                seqs[t],
                pos[t],
                tokens[t],
                layer_ids[0],
                first,
                delta,
                if delta == 0.0 { "  (dead: untouched)" } else { "" }
            );
        }
        Ok(())
    };
    step(
        "prefill seq 0",
        &[11, 25, 990, 4, 310, 42],
        &[0; 6],
        &[0, 1, 2, 3, 4, 5],
    )?;
    // Step 2: sequence 1 prefills while sequence 0 decodes, in one batch.
    step("mixed batch", &[7, 8, 9, 600], &[1, 1, 1, 0], &[0, 1, 2, 6])?;
    // Step 3: both decode; sequence 0's look-back reaches into step 2's token.
    step("decode both", &[55, 66], &[0, 1], &[7, 3])?;
    // Step 4: a speculative token for seq 0 is rejected: re-hash position 7.
    step("rollback seq 0 pos 7", &[56], &[0], &[7])?;
    // A bad call changes nothing and says why.
    let mut ids = vec![0i64; per];
    let err = ctx.hash(&[5], &[1], &[9], &mut ids).unwrap_err();
    println!("\nbad call (seq 1 pos 9, positions 4..8 never hashed): {err}");
    println!("context memory: {} bytes", ctx.memory_bytes());
    Ok(())
}

/// What the golden check found.
struct Golden {
    ids: (usize, usize),  // equal, compared
    rows: (usize, usize), // equal, compared
    kv: (usize, usize),   // equal, compared
    kv_max_ulps: u32,
    calls: usize,
    rows_from: String,
}

impl Golden {
    /// Row ids and rows are exact by contract; kv within the bound tests/golden.rs checks.
    fn exact(&self) -> bool {
        self.ids.0 == self.ids.1 && self.rows.0 == self.rows.1 && self.ids.1 > 0 && self.rows.1 > 0
    }

    fn summary(&self) -> String {
        format!(
            "{} against the Python golden (tests/golden/data/tiny.json, {} calls): row ids {}/{}, \
             row values {}/{} equal (kv {}/{} equal, the rest within {} bf16 ulp)",
            if self.exact() { "exact" } else { "NOT EXACT" },
            self.calls,
            self.ids.0,
            self.ids.1,
            self.rows.0,
            self.rows.1,
            self.kv.0,
            self.kv.1,
            self.kv_max_ulps
        )
    }
}

/// The golden's tiny model from its GGUF file (table rows read from the file
/// with `pread` when gathered), through every call of the golden's regimes:
/// the row ids and the gathered rows (`read_back`) compared value for value
/// with the independent Python reference's, the projection `kv` counted.
fn golden_check() -> Result<Golden, Box<dyn std::error::Error>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/data");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tiny.json"))?)?;
    let gguf = dir.join("tiny.gguf");
    let model = LoadedModel::open(&gguf, &LoadOptions::default())?;
    let opts = GgufOptions {
        limits: Limits {
            max_tokens: 64,
            max_seqs: 4,
            max_positions: 1024,
        },
        n_threads: 2,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        eps: 0.0,
        tuning: Default::default(),
        row_cache_bytes: 0,
    };
    let as_vec = |v: &serde_json::Value| -> Vec<i64> {
        v.as_array()
            .map(|a| a.iter().filter_map(|x| x.as_i64()).collect())
            .unwrap_or_default()
    };
    let mut g = Golden {
        ids: (0, 0),
        rows: (0, 0),
        kv: (0, 0),
        kv_max_ulps: 0,
        calls: 0,
        rows_from: String::new(),
    };
    for regime in [
        "prefill",
        "decode",
        "chunked",
        "interleaved",
        "rollback",
        "dead",
    ] {
        let ctx = model.context(&opts)?;
        let per = ctx.ids_per_token();
        let (k_in, k_out) = (ctx.kv_in(), ctx.kv_out());
        if g.rows_from.is_empty() {
            let table = ctx
                .layer_info(0)
                .map(|l| format!("{:?}", l.table_type).to_lowercase());
            g.rows_from = format!(
                "read from tests/golden/data/{} with pread ({} table)",
                gguf.file_name().unwrap_or_default().to_string_lossy(),
                table.unwrap_or_default()
            );
        }
        for call in json["regimes"][regime]["calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let i32s = |k: &str| {
                as_vec(&call[k])
                    .iter()
                    .map(|&v| v as i32)
                    .collect::<Vec<_>>()
            };
            let (tokens, seqs, pos) = (i32s("tokens"), i32s("seq_ids"), i32s("pos"));
            let n = tokens.len();
            let mut ids = vec![0i64; n * per];
            ctx.hash(&tokens, &seqs, &pos, &mut ids)?;
            let want = as_vec(&call["ids"]);
            g.ids.0 += ids.iter().zip(&want).filter(|(a, b)| a == b).count();
            g.ids.1 += ids.len().max(want.len());
            g.calls += 1;
            let dead: Vec<bool> = (0..n)
                .map(|t| call["dead"][t].as_bool() == Some(true))
                .collect();
            for layer in call["layers"].as_array().into_iter().flatten() {
                let lid = layer["layer_id"].as_u64().unwrap_or(u64::MAX) as u32;
                let got = ctx.read_back(lid, RowIds::Host(&ids), n)?;
                let (want_rows, want_kv) = (as_vec(&layer["rows_bf16"]), as_vec(&layer["kv_bf16"]));
                for t in (0..n).filter(|&t| !dead[t]) {
                    for i in t * k_in..(t + 1) * k_in {
                        g.rows.1 += 1;
                        g.rows.0 += (want_rows.get(i) == Some(&(got.rows[i] as i64))) as usize;
                    }
                    for i in t * k_out..(t + 1) * k_out {
                        let w = want_kv.get(i).map_or(f32::NAN, |&b| bf16_to_f32(b as u16));
                        let a = bf16_to_f32(got.kv[i]);
                        g.kv.1 += 1;
                        g.kv.0 += (a == w) as usize;
                        if a != w {
                            let ulps =
                                (f32_to_bf16(a) as i32 - f32_to_bf16(w) as i32).unsigned_abs();
                            g.kv_max_ulps = g.kv_max_ulps.max(ulps);
                        }
                    }
                }
            }
        }
    }
    Ok(g)
}
