//! engram-inspect: open a DeepSeek-V4.1 engram model the way the library
//! does (a GGUF file of any public dialect, a split set from any of its
//! shards, or the safetensors checkpoint's directory) and report what it
//! found: the dialect, the geometry, each table's format and size, where the
//! hash constants came from, how the pad was read, and every check of the
//! hash layout (primes distinct and prime, rows per layer equal to the sums of
//! the primes and to the tables, offsets equal to the prefix sums, odd
//! multipliers, the token map inside the compressed vocabulary, the pad).
//! With `--text` and a tokenizer it hashes a sample and prints the row ids.
//!
//!     engram-inspect MODEL [--tokenizer tokenizer.json] [--config config.json]
//!                          [--tables-dir DIR] [--text TEXT]
//!
//! Exit status: 0 when everything checks, 1 when a check fails (each failure
//! names its keys), 2 for bad usage or a file that cannot be read at all.

use anyhow::{bail, Context, Result};
use engram::error::escape_text;
use engram::gguf::{LoadOptions, LoadedModel, PadReading};
use engram::tables::{tokenizer, EngramTables, TokenMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str =
    "usage: engram-inspect MODEL [--tokenizer tokenizer.json] [--config config.json]
                      [--tables-dir DIR] [--text TEXT]
  MODEL: a GGUF file (any dialect; any shard of a split set) or a checkpoint directory.
  --tokenizer, --config: complete a file without hash constants, or check those it has.
  --tables-dir: the checkpoint directory, for files whose tables live there.
  --text: hash TEXT (needs a tokenizer) and print its row ids.
  Exit status 1 when any check of the hash layout fails.";

struct Args {
    model: PathBuf,
    tokenizer: Option<PathBuf>,
    config: Option<PathBuf>,
    tables_dir: Option<PathBuf>,
    text: Option<String>,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Option<Args>> {
    let mut a = Args {
        model: PathBuf::new(),
        tokenizer: None,
        config: None,
        tables_dir: None,
        text: None,
    };
    let mut model = None;
    while let Some(x) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match x.as_str() {
            "-h" | "--help" => return Ok(None),
            "--tokenizer" => a.tokenizer = Some(val("--tokenizer")?.into()),
            "--config" => a.config = Some(val("--config")?.into()),
            "--tables-dir" => a.tables_dir = Some(val("--tables-dir")?.into()),
            "--text" => a.text = Some(val("--text")?),
            s if s.starts_with('-') => bail!("unknown option {s}"),
            s => {
                if model.replace(PathBuf::from(s)).is_some() {
                    bail!("one model at a time");
                }
            }
        }
    }
    a.model = model.context("no model given")?;
    if a.config.is_some() && a.tokenizer.is_none() {
        bail!("--config needs --tokenizer");
    }
    if a.text.is_some() && a.tokenizer.is_none() {
        bail!("--text needs --tokenizer");
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    match parse(std::env::args().skip(1)) {
        Ok(None) => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        Ok(Some(a)) => match run(&a) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(1),
            Err(e) => {
                eprintln!("engram-inspect: {}", escape_text(&format!("{e:#}")));
                ExitCode::from(2)
            }
        },
        Err(e) => {
            eprintln!(
                "engram-inspect: {}\n{USAGE}",
                escape_text(&format!("{e:#}"))
            );
            ExitCode::from(2)
        }
    }
}

fn short(p: &Path) -> String {
    p.file_name().map_or_else(
        || p.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

fn mb(b: u64) -> String {
    if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else if b >= 1 << 20 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{b} bytes")
    }
}

/// Inspect; `Ok(true)` when every check passes.
/// `println!` with every control character of the line escaped: the line
/// carries text from the model's files (key and tensor names, paths), which
/// must not move the cursor or fake lines on a terminal.
macro_rules! say {
    ($($arg:tt)*) => {
        println!("{}", escape_text(&format!($($arg)*)))
    };
}

fn run(a: &Args) -> Result<bool> {
    // The companion files, if given.
    let (mut companion, mut tm): (Option<EngramTables>, Option<TokenMap>) = (None, None);
    if let Some(t) = &a.tokenizer {
        match &a.config {
            Some(c) => companion = Some(EngramTables::from_files(c, t).map_err(lib)?),
            None => {
                let tok = tokenizer::load(t).map_err(lib)?;
                tm = Some(tokenizer::token_map(&tok).map_err(lib)?);
            }
        }
    }
    let o = LoadOptions {
        mmap: true,
        companion: companion.as_ref(),
        tokenizer: tm.as_ref(),
        tables_dir: a.tables_dir.as_deref(),
        shard: Default::default(),
    };
    let tok_path = if a.model.is_dir() {
        a.tokenizer.as_deref()
    } else {
        None
    };
    let mut ins = LoadedModel::inspect(&a.model, tok_path, &o)
        .map_err(lib)
        .with_context(|| format!("reading {}", a.model.display()))?;
    let checks = ins.checks();
    let m = ins.model();
    say!("model:    {}", a.model.display());
    say!("dialect:  {}", m.dialect.name());
    if ins.shards > 1 {
        say!(
            "files:    split set of {} shards: {}",
            ins.shards,
            ins.files[..ins.shards]
                .iter()
                .map(|p| short(p))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if ins.files.len() > ins.shards && ins.shards > 0 {
        say!(
            "external: {}",
            ins.files[ins.shards..]
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    say!(
        "geometry: D = {}, hc = {}, Hd = {}, H = {}, N = {}, C = {}, engram layers {:?}",
        m.d,
        m.hc,
        m.hd,
        m.n_heads,
        m.max_ngram,
        m.cols(),
        m.layer_ids
    );
    say!(
        "hash:     constants from {} ({}, {}, {}, {})",
        m.hash_source,
        m.keys.multipliers,
        m.keys.primes,
        m.keys.offsets,
        m.keys.token_map
    );
    let dead = m.token_map.iter().filter(|&&x| x < 0).count();
    let distinct = {
        let mut v: Vec<i32> = m.token_map.iter().copied().filter(|&x| x >= 0).collect();
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    say!(
        "tokens:   {} raw ids -> {distinct} compressed ids ({dead} dead){}",
        m.token_map.len(),
        m.compressed_vocab
            .map_or(String::new(), |c| format!("; the file states {c}"))
    );
    let reading = match m.pad.reading {
        PadReading::Compressed => "compressed",
        PadReading::Raw => "raw",
        PadReading::Ambiguous => "ambiguous",
    };
    say!(
        "pad:      {} = {} ({reading}) -> compressed pad {}: {}",
        m.pad.key,
        m.pad.stored,
        m.pad_id,
        m.pad.how
    );
    for l in &m.layers {
        let t = &l.table;
        let file = |f: usize| ins.files.get(f).map_or("?".into(), |p| short(p));
        let (rb, srb) = t.format.planes(m.hd);
        let bytes = t.rows * (rb as u64 + srb.unwrap_or(0) as u64);
        let scales = t.scales.as_ref().map_or(String::new(), |s| {
            format!(" + {} ({})", s.name, file(s.file))
        });
        say!(
            "layer {}:  table {} x {} {} ({}), {} ({}){scales}; wkv {} ({}), q/k {}",
            l.layer_id,
            t.rows,
            m.hd,
            t.format.name(),
            mb(bytes),
            t.codes.name,
            file(t.codes.file),
            l.wkv.blob.name,
            weight(&l.wkv.source),
            weight(&l.q.source)
        );
    }
    let mut ok = true;
    say!("checks:");
    for c in checks {
        match &c.problem {
            None => say!("  ok    {}", c.what),
            Some(p) => {
                ok = false;
                say!("  FAIL  {}: {p}", c.what);
            }
        }
    }
    if let Some(text) = &a.text {
        hash_text(m, a.tokenizer.as_deref().expect("checked"), text)?;
    }
    Ok(ok)
}

fn weight(s: &engram::gguf::meta::WeightSource) -> String {
    use engram::gguf::meta::WeightSource;
    match s {
        WeightSource::Direct(t) => engram::EngramType::from_u32(*t)
            .map_or_else(|| format!("type {t}"), |x| x.name().to_string()),
        WeightSource::F16 => "f16 (converted at load)".into(),
        WeightSource::Fp8Block { block, .. } => {
            format!(
                "fp8_e4m3_e8m0_block: e4m3 codes with one e8m0 scale per {}x{} block (read as stored)",
                block.0, block.1
            )
        }
    }
}

/// Hash `text` (one sequence from position 0) and print each token's row ids.
fn hash_text(m: &engram::gguf::EngramModel, tok_path: &Path, text: &str) -> Result<()> {
    let tok = tokenizers::Tokenizer::from_file(tok_path)
        .map_err(|e| anyhow::anyhow!("{}: {e}", tok_path.display()))?;
    let enc = tok
        .encode(text, false)
        .map_err(|e| anyhow::anyhow!("encoding the text: {e}"))?;
    let ids: Vec<i32> = enc.get_ids().iter().map(|&i| i as i32).collect();
    let n = ids.len();
    if n == 0 {
        bail!("the text has no tokens");
    }
    let cfg = engram::ContextConfig {
        geometry: engram::Geometry {
            d: m.d,
            hc: m.hc,
            hd: m.hd,
            eps: 1e-6,
        },
        tables: m.tables_in(),
        limits: engram::Limits {
            max_tokens: n,
            max_seqs: 1,
            max_positions: n,
        },
        n_threads: 1,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    };
    let ctx = engram::Context::new(&cfg).map_err(lib)?;
    let mut out = vec![0i64; n * ctx.ids_per_token()];
    let pos: Vec<i32> = (0..n as i32).collect();
    ctx.hash(&ids, &vec![0; n], &pos, &mut out).map_err(lib)?;
    say!(
        "text:     {n} tokens; row ids per token, per layer ({} columns):",
        m.cols()
    );
    let per = ctx.ids_per_token();
    for (t, &id) in ids.iter().enumerate() {
        let piece = tok.id_to_token(id as u32).unwrap_or_default();
        let c = m.token_map.get(id as usize).copied().unwrap_or(-1);
        let rows: Vec<String> = m
            .layer_ids
            .iter()
            .enumerate()
            .map(|(li, lid)| {
                let s = &out[t * per + li * m.cols()..t * per + (li + 1) * m.cols()];
                format!("L{lid} {s:?}")
            })
            .collect();
        say!("  {t:>3} {id:>6} {piece:?} -> {c}: {}", rows.join("  "));
    }
    Ok(())
}

/// A library error as an anyhow error (status and message).
fn lib(e: engram::Error) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", e.status, e.message)
}
