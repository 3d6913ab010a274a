//! engram-tables: derive the engram hash tables from a model's `config.json`
//! and `tokenizer.json` (SPEC section 3) and write them out.
//!
//!     engram-tables --config config.json --tokenizer tokenizer.json --out DIR
//!
//! writes `DIR/engram_tables.json` (layer ids, N, H, pad ids, multipliers,
//! primes, offsets, rows per layer, compressed vocabulary, how the map was
//! built) and `DIR/token_map.i32` (little-endian i32 per raw token id, -1 for
//! an id without a token), and prints the figures and timings. The arrays are
//! in the GGUF flat layout `engram_config` takes.

use engram::tables::{tokenizer, EngramConfig, EngramTables};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

const USAGE: &str =
    "usage: engram-tables --config config.json --tokenizer tokenizer.json [--out DIR]
  Derives token_map, multipliers, primes and offsets (DeepSeek-V4.1 engram hash)
  and writes DIR/engram_tables.json and DIR/token_map.i32 (DIR defaults to .).";

fn main() -> ExitCode {
    let mut config = None;
    let mut tok = None;
    let mut out = PathBuf::from(".");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let r = match a.as_str() {
            "--config" => val("--config").map(|v| config = Some(PathBuf::from(v))),
            "--tokenizer" => val("--tokenizer").map(|v| tok = Some(PathBuf::from(v))),
            "--out" => val("--out").map(|v| out = PathBuf::from(v)),
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => Err(format!("unknown argument {other}")),
        };
        if let Err(e) = r {
            eprintln!("engram-tables: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    let (Some(config), Some(tok)) = (config, tok) else {
        eprintln!("engram-tables: --config and --tokenizer are required\n{USAGE}");
        return ExitCode::from(2);
    };
    match run(&config, &tok, &out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("engram-tables: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(
    config: &std::path::Path,
    tok: &std::path::Path,
    out: &std::path::Path,
) -> Result<(), String> {
    let t0 = Instant::now();
    let cfg = EngramConfig::from_file(config).map_err(|e| e.to_string())?;
    let t1 = Instant::now();
    let tk = tokenizer::load(tok).map_err(|e| e.to_string())?;
    let t2 = Instant::now();
    let tm = tokenizer::token_map(&tk).map_err(|e| e.to_string())?;
    let t3 = Instant::now();
    let t = EngramTables::derive(cfg, tm).map_err(|e| e.to_string())?;
    let t4 = Instant::now();
    let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
    let doc = json!({
        "config": config.display().to_string(),
        "tokenizer": tok.display().to_string(),
        "layer_ids": t.config.layer_ids,
        "max_ngram": t.config.max_ngram,
        "n_heads": t.config.n_heads,
        "head_dim": t.config.head_dim,
        "hidden_size": t.config.hidden_size,
        "hc": t.config.hc,
        "vocab_per_ngram": t.config.vocab_per_ngram,
        "seed": t.config.seed,
        "vocab_size": t.token_map.len(),
        "compressed_vocab": t.compressed_vocab,
        "token_map_stats": {
            "fffd_raw": t.stats.fffd_raw,
            "empty_norm": t.stats.empty_norm,
            "no_token": t.stats.no_token,
        },
        "pad_token_id": t.config.pad_token_id,
        "pad_id": t.pad_id,
        "multipliers": t.multipliers,
        "primes": t.primes,
        "offsets": t.offsets,
        "rows": t.rows,
    });
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let jp = out.join("engram_tables.json");
    let text = serde_json::to_string_pretty(&doc).expect("json") + "\n";
    std::fs::write(&jp, text).map_err(|e| format!("{}: {e}", jp.display()))?;
    let mp = out.join("token_map.i32");
    let bytes: Vec<u8> = t.token_map.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&mp, bytes).map_err(|e| format!("{}: {e}", mp.display()))?;
    println!(
        "{} token ids -> {} compressed ids (pad {} -> {}); layers {:?}, rows {:?}",
        t.token_map.len(),
        t.compressed_vocab,
        t.config.pad_token_id,
        t.pad_id,
        t.config.layer_ids,
        t.rows
    );
    println!(
        "config {:.1} ms, tokenizer load {:.1} ms, token map {:.1} ms, multipliers+primes {:.1} ms",
        ms(t0, t1),
        ms(t1, t2),
        ms(t2, t3),
        ms(t3, t4)
    );
    println!("wrote {} and {}", jp.display(), mp.display());
    Ok(())
}
