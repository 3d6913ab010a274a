//! The one description of an engram model that every loader fills
//! ([`EngramModel`]): the dialect it was read from, the geometry, the hash
//! constants (with the name of the key or tensor each came from), the pad and
//! how it was read, and where each layer's table, `wkv`, `q` and `k` are
//! ([`Blob`]s in the loader's files). [`validate`] checks the hash layout
//! against itself and the tables; the loaders refuse a model that fails a
//! check, and `engram-inspect` prints every check.

use crate::error::{Error, Result};
use crate::formats::EngramType;
use crate::hash::{is_prime, HashTablesIn};
use crate::EngramStatus;

/// The file dialects this library reads (`tests/golden/DIALECTS.md`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// llama.cpp PR 28696 / ik_llama.cpp (`{arch}.engram.{layer_ids, head_count, key_length, ...}`).
    Vcruz305,
    /// The same keys spelled `deepseek4.engram.*` on a `deepseek41` file (early converter).
    Vcruz305Prefix,
    /// antirez/ds4 (`deepseek41.engram.encoding`, 264-byte fp8 rows).
    Ds4,
    /// tarruda/llama.cpp (`deepseek41.engram.layers`, codes + scale tensors).
    Tarruda,
    /// JigSawPT/llama.cpp (flat `deepseek41.engram_*` keys, constants as tensors).
    JigSawPT,
    /// XMPPwocky/deepstrix (arch `deepseek4`, tables in the checkpoint's shards).
    Deepstrix,
    /// Shard path + byte offsets (`deepseek4.engram.{i}.table_path`), as read
    /// by JLFN/ds4-dfm-rs; no writer found (unverified).
    Ds4gw,
    /// The released safetensors checkpoint (a directory).
    Checkpoint,
}

impl Dialect {
    pub fn name(self) -> &'static str {
        match self {
            Dialect::Vcruz305 => "vcruz305",
            Dialect::Vcruz305Prefix => "vcruz305 (deepseek4. key prefix)",
            Dialect::Ds4 => "ds4",
            Dialect::Tarruda => "tarruda",
            Dialect::JigSawPT => "jigsawpt",
            Dialect::Deepstrix => "deepstrix",
            Dialect::Ds4gw => "ds4gw",
            Dialect::Checkpoint => "safetensors checkpoint",
        }
    }
}

/// How a dialect's pad key is to be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadReading {
    /// Already a compressed id.
    Compressed,
    /// A raw token id, mapped through the token map.
    Raw,
    /// The dialect does not say: used only where both readings agree, or a
    /// config + tokenizer decide.
    Ambiguous,
}

/// The pad as the model's source stores it, and what it came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PadInfo {
    /// The key it was read from.
    pub key: String,
    pub stored: u64,
    pub reading: PadReading,
    /// The compressed pad the hash uses.
    pub compressed: i64,
    /// How the reading was settled, for a report.
    pub how: String,
}

/// A run of bytes in one of the loader's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blob {
    /// The tensor's name (or the key that located it).
    pub name: String,
    /// Index of the file in the loader's file list.
    pub file: usize,
    /// Absolute byte offset in that file.
    pub offset: u64,
    pub bytes: u64,
    /// Shape, innermost first (ggml order).
    pub dims: Vec<u64>,
}

/// A layer's table: `rows` rows of `format`; `scales` for the split fp8 format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableBlobs {
    pub format: EngramType,
    pub rows: u64,
    pub codes: Blob,
    pub scales: Option<Blob>,
}

/// How a weight is stored in its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WeightSource {
    /// A type the context reads as is (`EngramType` number: f32, bf16, or a
    /// GGUF block format for `wkv`).
    Direct(u32),
    /// f16 values: converted at load to bf16 where every value is exact in
    /// bf16, else to f32 (the context has no f16 weight format).
    F16,
    /// fp8 e4m3 codes with one e8m0 scale per `block` (rows, columns) block
    /// in `scale` (the checkpoint's `wkv.weight` + `wkv.scale`): converted at
    /// load to bf16 (exact for every finite code and scale the checkpoint uses).
    Fp8Block { scale: Blob, block: (usize, usize) },
}

/// A weight matrix `[rows, cols]` (row-major; `cols` contiguous).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightBlob {
    pub blob: Blob,
    pub source: WeightSource,
}

/// One engram layer's data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngramTensors {
    pub layer_id: u32,
    pub table: TableBlobs,
    pub wkv: WeightBlob,
    pub q: WeightBlob,
    pub k: WeightBlob,
}

/// Where each hash constant came from (key or tensor names), for messages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keys {
    pub layer_ids: String,
    pub multipliers: String,
    pub primes: String,
    pub offsets: String,
    pub token_map: String,
    /// The key of the rows per layer, where the source states them.
    pub rows: Option<String>,
    pub compressed_vocab: Option<String>,
}

/// Everything a context needs from a model's files.
#[derive(Clone, Debug)]
pub struct EngramModel {
    pub dialect: Dialect,
    pub d: usize,
    pub hc: usize,
    pub hd: usize,
    pub layer_ids: Vec<u32>,
    pub max_ngram: usize,
    pub n_heads: usize,
    pub token_map: Vec<i32>,
    /// The compressed pad (`pad.compressed`).
    pub pad_id: i64,
    pub pad: PadInfo,
    pub multipliers: Vec<u64>,
    pub primes: Vec<u64>,
    pub offsets: Vec<u64>,
    /// Whether the offsets were stored (`false`: derived as prefix sums).
    pub offsets_stored: bool,
    /// Rows per layer the source states (checked against the primes and tables).
    pub stated_rows: Option<Vec<u64>>,
    /// The compressed vocabulary the source states (checked against the map).
    pub compressed_vocab: Option<u64>,
    /// Where the hash constants came from: `"gguf"`, `"gguf tensors"`,
    /// `"config+tokenizer"`, ...
    pub hash_source: &'static str,
    pub keys: Keys,
    pub layers: Vec<EngramTensors>,
}

/// One check of [`validate`]: what was checked, the keys involved, and the
/// problem found (`None`: it holds).
#[derive(Clone, Debug)]
pub struct Check {
    pub what: &'static str,
    pub problem: Option<String>,
}

impl EngramModel {
    pub fn tables_in(&self) -> HashTablesIn<'_> {
        HashTablesIn {
            layer_ids: &self.layer_ids,
            max_ngram: self.max_ngram,
            n_heads: self.n_heads,
            token_map: &self.token_map,
            pad_id: self.pad_id,
            multipliers: &self.multipliers,
            primes: &self.primes,
            offsets: &self.offsets,
        }
    }

    /// Hash columns per token per layer, `C = (N-1)*H`.
    pub fn cols(&self) -> usize {
        (self.max_ngram - 1) * self.n_heads
    }

    /// Rows each layer's hash can address: the sum of its primes.
    pub fn prime_rows(&self) -> Vec<u64> {
        self.primes
            .chunks(self.cols().max(1))
            .map(|c| c.iter().fold(0u64, |a, &p| a.saturating_add(p)))
            .collect()
    }

    /// The first failed check, as an error (`ErrFormat`), or `Ok`.
    pub fn check(&self) -> Result<()> {
        match validate(self).into_iter().find_map(|c| c.problem) {
            None => Ok(()),
            Some(p) => Err(Error::new(EngramStatus::ErrFormat, p)),
        }
    }
}

/// Every check of the hash layout against itself and the tables, in the
/// order the loaders apply them (the first failure is what they report).
/// The lengths of the constants were checked when the model was read.
pub fn validate(m: &EngramModel) -> Vec<Check> {
    let sums = m.prime_rows();
    let check = |what: &'static str, problem: Option<String>| Check { what, problem };
    vec![
        check(
            "every hash bucket lies inside its table",
            bucket_outside_table(m),
        ),
        check(
            "offsets are the prefix sums of the primes",
            offsets_not_prefix_sums(m),
        ),
        check(
            "rows per layer equal the sums of the primes",
            stated_rows_differ(m, &sums),
        ),
        check(
            "each table has its layer's rows",
            table_rows_short(m, &sums),
        ),
        check("primes are distinct and prime", bad_prime(m)),
        check("multipliers are odd", bad_multiplier(m)),
        check(
            "the token map stays inside the compressed vocabulary",
            token_map_outside_vocab(m),
        ),
        check("the pad is a compressed id", pad_outside_vocab(m)),
    ]
}

/// Every column's bucket lies inside its layer's table.
fn bucket_outside_table(m: &EngramModel) -> Option<String> {
    let cols = m.cols();
    let k = &m.keys;
    for (li, l) in m.layers.iter().enumerate() {
        for c in 0..cols {
            let i = li * cols + c;
            let (o, pr) = (m.offsets[i], m.primes[i]);
            let end = o.checked_add(pr);
            if end.is_none_or(|e| e > l.table.rows) {
                return Some(format!(
                    "{}: layer {}'s column {c} covers rows [{o}, {}) of {} (its prime {pr} from {}), \
                     past the {} rows of {}",
                    k.offsets,
                    l.layer_id,
                    end.map_or("overflow".into(), |e| e.to_string()),
                    k.offsets,
                    k.primes,
                    l.table.rows,
                    l.table.codes.name
                ));
            }
        }
    }
    None
}

/// Stored offsets are the per-layer exclusive prefix sums of the primes.
fn offsets_not_prefix_sums(m: &EngramModel) -> Option<String> {
    if !m.offsets_stored {
        return None;
    }
    let cols = m.cols();
    let k = &m.keys;
    for (li, (pl, ol)) in m
        .primes
        .chunks(cols)
        .zip(m.offsets.chunks(cols))
        .enumerate()
    {
        let mut acc = 0u64;
        for (c, (&pr, &o)) in pl.iter().zip(ol).enumerate() {
            if o != acc {
                return Some(format!(
                    "{} and {} disagree: layer {}'s column {c} has offset {o}, but the primes before it sum to {acc} \
                     (offsets are the per-layer prefix sums of the primes)",
                    k.primes, k.offsets, m.layer_ids[li]
                ));
            }
            acc = acc.saturating_add(pr);
        }
    }
    None
}

/// The stated rows per layer equal the sums of the primes.
fn stated_rows_differ(m: &EngramModel, sums: &[u64]) -> Option<String> {
    let k = &m.keys;
    let (Some(rows), Some(key)) = (&m.stated_rows, &k.rows) else {
        return None;
    };
    let li = (0..rows.len()).find(|&i| rows[i] != sums[i])?;
    Some(format!(
        "{key} says layer {} has {} rows, but its primes in {} sum to {}",
        m.layer_ids[li], rows[li], k.primes, sums[li]
    ))
}

/// The tables hold those rows (exactly, when the rows are stated).
fn table_rows_short(m: &EngramModel, sums: &[u64]) -> Option<String> {
    let k = &m.keys;
    for (li, l) in m.layers.iter().enumerate() {
        let want = m.stated_rows.as_ref().map_or(sums[li], |r| r[li]);
        let exact = m.stated_rows.is_some();
        if (exact && l.table.rows != want) || l.table.rows < want {
            return Some(format!(
                "{} has {} rows, but {} says layer {} has {want}",
                l.table.codes.name,
                l.table.rows,
                k.rows.as_deref().unwrap_or(&k.primes),
                l.layer_id
            ));
        }
    }
    None
}

/// Primes: prime, and no two columns share one.
fn bad_prime(m: &EngramModel) -> Option<String> {
    let cols = m.cols();
    let k = &m.keys;
    let mut seen = std::collections::HashSet::new();
    for (i, &pr) in m.primes.iter().enumerate() {
        let (li, c) = (i / cols, i % cols);
        if !is_prime(pr) {
            return Some(format!(
                "{}: layer {}'s column {c} has {pr}, which is not prime",
                k.primes, m.layer_ids[li]
            ));
        }
        if !seen.insert(pr) {
            return Some(format!(
                "{}: {pr} appears twice (layer {}'s column {c} repeats an earlier prime; each column takes its own)",
                k.primes, m.layer_ids[li]
            ));
        }
    }
    None
}

/// Multipliers: odd, positive i64 values.
fn bad_multiplier(m: &EngramModel) -> Option<String> {
    m.multipliers
        .iter()
        .position(|&x| x % 2 == 0 || x > i64::MAX as u64)
        .map(|i| {
            format!(
                "{}: entry {i} (layer {}, look-back {}) is {}, not an odd positive i64",
                m.keys.multipliers,
                m.layer_ids[i / m.max_ngram],
                i % m.max_ngram,
                m.multipliers[i]
            )
        })
}

/// The token map's range against the compressed vocabulary.
fn token_map_outside_vocab(m: &EngramModel) -> Option<String> {
    let max = m.token_map.iter().copied().max().unwrap_or(-1);
    match (m.compressed_vocab, &m.keys.compressed_vocab) {
        (Some(cv), Some(key)) if max >= 0 && max as u64 >= cv => {
            let i = m.token_map.iter().position(|&x| x == max).unwrap_or(0);
            Some(format!(
                "{}[{i}] = {max}, outside the compressed vocabulary of {key} = {cv}",
                m.keys.token_map
            ))
        }
        _ => None,
    }
}

/// The pad against the compressed vocabulary.
fn pad_outside_vocab(m: &EngramModel) -> Option<String> {
    match (m.compressed_vocab, &m.keys.compressed_vocab) {
        (Some(cv), Some(key)) if m.pad_id as u64 >= cv => Some(format!(
            "{} = {} gives the compressed pad {}, outside the compressed vocabulary of {key} = {cv}",
            m.pad.key, m.pad.stored, m.pad_id
        )),
        _ => None,
    }
}
