//! The command line.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

pub const USAGE: &str = "usage: engram-replay [options] [PATH ...]
  Replays real text through the DeepSeek-V4.1 tokenizer and the library's engram
  hash into row-id streams, and prints, per layer and in total, the hit rate of
  the library's row-cache policies (lru, clock, s3fifo) by cache size, the bytes
  read from storage per token against an mmap page cache of the same RAM, and
  the dedup gain of decode batches and prefill chunks.
  PATH: a text file, or a directory (its files, recursively, in name order);
  '-' or none reads one text from stdin. Each file is one text (one request).
options:
  --config FILE        config.json (default tests/golden/data/v41_config.json)
  --tokenizer FILE     tokenizer.json (default tests/golden/data/deepseek_v4_tokenizer.json)
  --format NAME        row format: fp8 (264-byte rows, default), q2_K (84), q4_K,
                       q8_0, bf16 ... (the library's format names)
  --row-bytes N        bytes a row (overrides --format)
  --sizes LIST         cache sizes, RAM for the whole table set (split evenly over
                       the layers' row caches; one page cache for all the files),
                       e.g. 64M,256M,1G,4G,16G (the default)
  --policies LIST      lru,clock,s3fifo (the default: all)
  --seqs S             sequences of the server mix (default 32)
  --chunk N            prefill chunk in tokens (default 4096)
  --readahead-kib K    mmap readahead window on a fault (default 0: off, as a
                       table mapped MADV_RANDOM; the kernel's default is 128)
  --max-tokens N       stop after N tokens of text (the last text cut short)
  --request-tokens N   cut each text into requests of at most N tokens (each its
                       own sequence; default 0: a text is one request)
  --round-robin        take one text of each PATH in turn (a mix of the inputs)
  --inputs-only        stop after hashing: print what was kept of each PATH
                       (tokens, requests, how many of its files)
  --threads N          simulation threads (default: the CPUs)
  --check-lru          also replay the tool's own exact LRU and fail if the
                       library's LRU counts different hits
  --json FILE          write the figures as JSON ('-': stdout, the table to stderr)";

#[derive(Clone, Debug)]
pub struct Opts {
    pub config: PathBuf,
    pub tokenizer: PathBuf,
    pub format: String,
    pub row_bytes: Option<u64>,
    pub sizes: Vec<u64>,
    pub policies: Vec<String>,
    pub seqs: usize,
    pub chunk: usize,
    pub readahead_kib: u64,
    pub max_tokens: Option<usize>,
    pub round_robin: bool,
    pub request_tokens: usize,
    pub threads: usize,
    pub check_lru: bool,
    pub inputs_only: bool,
    pub json: Option<String>,
    pub inputs: Vec<String>,
}

/// `64M`, `1G`, `512K`, `1048576` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        Some('T' | 't') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let v: u64 = num.parse().with_context(|| format!("size {s:?}"))?;
    v.checked_mul(mult)
        .with_context(|| format!("size {s:?} overflows"))
}

fn list<T>(s: &str, f: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    s.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(f)
        .collect()
}

/// The arguments; `None` for `--help`.
pub fn parse(mut args: impl Iterator<Item = String>) -> Result<Option<Opts>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut o = Opts {
        config: "tests/golden/data/v41_config.json".into(),
        tokenizer: "tests/golden/data/deepseek_v4_tokenizer.json".into(),
        format: "fp8".into(),
        row_bytes: None,
        sizes: list("64M,256M,1G,4G,16G", parse_size)?,
        policies: vec!["lru".into(), "clock".into(), "s3fifo".into()],
        seqs: 32,
        chunk: 4096,
        readahead_kib: 0,
        max_tokens: None,
        round_robin: false,
        request_tokens: 0,
        threads,
        check_lru: false,
        inputs_only: false,
        json: None,
        inputs: Vec::new(),
    };
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        let num = |v: String| -> Result<u64> { v.parse().with_context(|| format!("{a} {v:?}")) };
        match a.as_str() {
            "--config" => o.config = val()?.into(),
            "--tokenizer" => o.tokenizer = val()?.into(),
            "--format" => o.format = val()?,
            "--row-bytes" => o.row_bytes = Some(num(val()?)?),
            "--sizes" => o.sizes = list(&val()?, parse_size)?,
            "--policies" => o.policies = list(&val()?, |s| Ok(s.trim().to_string()))?,
            "--seqs" => o.seqs = num(val()?)? as usize,
            "--chunk" => o.chunk = num(val()?)? as usize,
            "--readahead-kib" => o.readahead_kib = num(val()?)?,
            "--max-tokens" => o.max_tokens = Some(num(val()?)? as usize),
            "--threads" => o.threads = num(val()?)?.max(1) as usize,
            "--check-lru" => o.check_lru = true,
            "--inputs-only" => o.inputs_only = true,
            "--round-robin" => o.round_robin = true,
            "--request-tokens" => o.request_tokens = num(val()?)? as usize,
            "--json" => o.json = Some(val()?),
            "-h" | "--help" => return Ok(None),
            s if s.starts_with("--") => bail!("unknown option {s}"),
            _ => o.inputs.push(a),
        }
    }
    if o.sizes.is_empty() || o.policies.is_empty() || o.seqs == 0 || o.chunk == 0 {
        bail!("--sizes, --policies, --seqs and --chunk must not be empty or 0");
    }
    if o.row_bytes == Some(0) {
        bail!("--row-bytes must be positive");
    }
    Ok(Some(o))
}
