//! engram-tables: derive the engram hash tables from a model's `config.json`
//! and `tokenizer.json` (SPEC section 3) and write them out.
//!
//!     engram-tables --config config.json --tokenizer tokenizer.json --out DIR
//!
//! writes `DIR/engram_tables.json` (layer ids, N, H, pad ids, multipliers,
//! primes, offsets, rows per layer, compressed vocabulary, how the map was
//! built) and `DIR/token_map.i32` (little-endian i32 per raw token id below
//! the tokenizer's length, `len(tokenizer)`; an id without a token has the
//! compressed id of the empty key, as in the reference), and prints the
//! figures and timings. The arrays are in the GGUF flat layout
//! `engram_config` takes.

use anyhow::{bail, Context, Result};
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
    match parse(std::env::args().skip(1)) {
        Ok(None) => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Some((config, tok, out))) => match run(&config, &tok, &out) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("engram-tables: {e:#}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("engram-tables: {e:#}\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// The arguments: `None` for `--help`.
fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<(PathBuf, PathBuf, PathBuf)>> {
    let (mut config, mut tok, mut out) = (None, None, PathBuf::from("."));
    while let Some(a) = args.next() {
        let mut val = |name: &str| args.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--config" => config = Some(PathBuf::from(val("--config")?)),
            "--tokenizer" => tok = Some(PathBuf::from(val("--tokenizer")?)),
            "--out" => out = PathBuf::from(val("--out")?),
            "-h" | "--help" => return Ok(None),
            other => bail!("unknown argument {other}"),
        }
    }
    let (Some(config), Some(tok)) = (config, tok) else {
        bail!("--config and --tokenizer are required");
    };
    Ok(Some((config, tok, out)))
}

fn run(config: &std::path::Path, tok: &std::path::Path, out: &std::path::Path) -> Result<()> {
    let t0 = Instant::now();
    let cfg = EngramConfig::from_file(config)?;
    let t1 = Instant::now();
    let tk = tokenizer::load(tok)?;
    let t2 = Instant::now();
    let tm = tokenizer::token_map(&tk)?;
    let t3 = Instant::now();
    let t = EngramTables::derive(cfg, tm)?;
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
    std::fs::create_dir_all(out).with_context(|| out.display().to_string())?;
    let jp = out.join("engram_tables.json");
    let text = serde_json::to_string_pretty(&doc)? + "\n";
    std::fs::write(&jp, text).with_context(|| jp.display().to_string())?;
    let mp = out.join("token_map.i32");
    let bytes: Vec<u8> = t.token_map.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&mp, bytes).with_context(|| mp.display().to_string())?;
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
