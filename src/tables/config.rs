//! The engram fields of a model's `config.json`, under the names the released
//! DeepSeek-V4.1 config uses (in `text_config` or at the top level) and the
//! names of DeepSeek's Engram demo (`EngramConfig`). The first name found
//! wins; docs/loading.md lists them.

use crate::error::{bail, Error, Result};
use crate::EngramStatus;
use serde_json::Value;

/// The engram hash parameters of a model config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngramConfig {
    /// Model layer ids of the engram layers.
    pub layer_ids: Vec<u32>,
    /// Max n-gram size `N`.
    pub max_ngram: usize,
    /// Hash heads per n-gram size `H`.
    pub n_heads: usize,
    /// Table size per n-gram size (`N - 1` entries; the prime search starts
    /// above `size - 1`).
    pub vocab_per_ngram: Vec<u64>,
    /// The raw pad token id (mapped through the token map for the hash).
    pub pad_token_id: u32,
    /// The multiplier seed (`seed + 10007 * layer_id`); 0 unless the config sets it.
    pub seed: u64,
    /// Row width `Hd`, where the config gives it.
    pub head_dim: Option<usize>,
    /// Hidden size `D`, where the config gives it.
    pub hidden_size: Option<usize>,
    /// Hyper-connection streams `hc`, where the config gives it.
    pub hc: Option<usize>,
    /// Rows per layer the config states (V4.1's `engram_num_embeddings`): checked.
    pub num_embeddings: Option<Vec<u64>>,
    /// Compressed vocabulary the config states: checked against the tokenizer.
    pub compressed_vocab: Option<u64>,
    /// `quantization_config.weight_block_size` (the checkpoint's fp8 weight
    /// blocks, `[rows, columns]`), where the config gives it.
    pub weight_block_size: Option<[u64; 2]>,
}

/// Largest `config.json` read (the released one is a few KB).
pub(crate) const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Peak memory of parsing a `config.json` into JSON values, per byte of
/// text, with margin over the worst shape measured (docs/file-safety.md).
pub(crate) const CONFIG_PEAK_PER_BYTE: usize = 64;

/// Accepted names, first match wins: `(field, [V4.1 name, Engram demo name, ...])`.
pub const FIELD_NAMES: &[(&str, &[&str])] = &[
    ("layer ids", &["engram_layer_ids", "layer_ids"]),
    (
        "max n-gram size",
        &["engram_max_ngram_size", "max_ngram_size"],
    ),
    (
        "heads per n-gram",
        &["engram_n_heads", "n_head_per_ngram", "engram_num_heads"],
    ),
    (
        "table size per n-gram",
        &["engram_vocab_size", "engram_table_size"],
    ),
    (
        "pad token id",
        &["engram_pad_token_id", "pad_id", "engram_pad_id"],
    ),
    ("seed", &["engram_seed", "seed"]),
    ("head dim", &["engram_head_dim"]),
    (
        "embedding per n-gram (demo: head dim * heads)",
        &["n_embed_per_ngram"],
    ),
    ("hidden size", &["hidden_size", "dim"]),
    ("hyper-connection streams", &["hc_mult"]),
    ("rows per layer (checked)", &["engram_num_embeddings"]),
    (
        "compressed vocabulary (checked)",
        &["engram_compressed_vocab_size"],
    ),
];

fn names(field: &str) -> &'static [&'static str] {
    FIELD_NAMES
        .iter()
        .find(|(f, _)| *f == field)
        .map(|(_, n)| *n)
        .expect("known field")
}

fn bad(msg: String) -> Error {
    Error::new(EngramStatus::ErrInvalidConfig, msg)
}

/// The objects searched, in order: `text_config`, the top level, then an
/// `engram_config` or `engram` object inside either.
fn scopes(root: &Value) -> Vec<&Value> {
    let mut cand = vec![root.get("text_config"), Some(root)];
    for base in [root.get("text_config"), Some(root)].into_iter().flatten() {
        cand.push(base.get("engram_config"));
        cand.push(base.get("engram"));
    }
    cand.into_iter()
        .flatten()
        .filter(|v| v.is_object())
        .collect()
}

struct Lookup<'a> {
    scopes: Vec<&'a Value>,
}

impl<'a> Lookup<'a> {
    /// The first value under any of `field`'s names, with the name found.
    fn get(&self, field: &str) -> Option<(&'static str, &'a Value)> {
        for s in &self.scopes {
            for &n in names(field) {
                if let Some(v) = s.get(n).filter(|v| !v.is_null()) {
                    return Some((n, v));
                }
            }
        }
        None
    }

    fn uint(&self, field: &str) -> Result<Option<u64>> {
        match self.get(field) {
            None => Ok(None),
            Some((n, v)) => v.as_u64().map(Some).ok_or_else(|| {
                bad(format!(
                    "config.json: {n} = {v} is not a non-negative integer"
                ))
            }),
        }
    }

    fn uints(&self, field: &str) -> Result<Option<Vec<u64>>> {
        match self.get(field) {
            None => Ok(None),
            Some((n, v)) => {
                let arr = v.as_array().ok_or_else(|| {
                    bad(format!("config.json: {n} = {v} is not a list of integers"))
                })?;
                arr.iter()
                    .map(|x| {
                        x.as_u64().ok_or_else(|| {
                            bad(format!(
                                "config.json: {n} holds {x}, not a non-negative integer"
                            ))
                        })
                    })
                    .collect::<Result<Vec<u64>>>()
                    .map(Some)
            }
        }
    }

    fn required<T>(&self, field: &str, v: Option<T>) -> Result<T> {
        v.ok_or_else(|| {
            bad(format!(
                "config.json has no {field} (looked for {})",
                names(field).join(", ")
            ))
        })
    }
}

/// The RMS epsilon a `config.json` text states: `rms_norm_eps`, in
/// `text_config` or at the top level (`None`: neither has it). A value that
/// is not a finite number `>= 0` is `ERR_INVALID_CONFIG`.
pub fn rms_norm_eps(text: &str) -> Result<Option<f32>> {
    let root: Value = serde_json::from_str(text)
        .map_err(|e| bad(format!("config.json is not valid JSON: {e}")))?;
    let found = [root.get("text_config"), Some(&root)]
        .into_iter()
        .flatten()
        .find_map(|s| s.get("rms_norm_eps").filter(|v| !v.is_null()));
    let Some(v) = found else {
        return Ok(None);
    };
    match v.as_f64().map(|x| x as f32) {
        Some(e) if e.is_finite() && e >= 0.0 => Ok(Some(e)),
        _ => bail!(
            ErrInvalidConfig,
            "config.json: rms_norm_eps = {v} is not a finite epsilon >= 0"
        ),
    }
}

impl EngramConfig {
    /// Parse the engram fields of a `config.json` text.
    pub fn from_json(text: &str) -> Result<EngramConfig> {
        // A tree of JSON values costs up to CONFIG_PEAK_PER_BYTE per byte of
        // text, infallibly: reserve that fallibly first.
        crate::files::parse_headroom(text.len(), CONFIG_PEAK_PER_BYTE, "config.json")?;
        let root: Value = serde_json::from_str(text)
            .map_err(|e| bad(format!("config.json is not valid JSON: {e}")))?;
        if !root.is_object() {
            bail!(ErrInvalidConfig, "config.json is not a JSON object");
        }
        let l = Lookup {
            scopes: scopes(&root),
        };
        let layer_ids = l.layer_ids()?;
        let max_ngram = l.max_ngram()?;
        let n_heads = l.n_heads()?;
        let vocab_per_ngram = l.vocab_per_ngram(max_ngram)?;
        let pad_token_id = l.pad_token_id()?;
        let seed = l.uint("seed")?.unwrap_or(0);
        let head_dim = match l.uint("head dim")? {
            Some(h) => Some(h as usize),
            None => l
                .uint("embedding per n-gram (demo: head dim * heads)")?
                .map(|e| e as usize / n_heads),
        };
        let hidden_size = l.uint("hidden size")?.map(|x| x as usize);
        let hc = l.uint("hyper-connection streams")?.map(|x| x as usize);
        let num_embeddings = l.num_embeddings(layer_ids.len())?;
        let weight_block_size = weight_block_size(&root)?;
        Ok(EngramConfig {
            weight_block_size,
            layer_ids,
            max_ngram,
            n_heads,
            vocab_per_ngram,
            pad_token_id,
            seed,
            head_dim,
            hidden_size,
            hc,
            num_embeddings,
            compressed_vocab: l.uint("compressed vocabulary (checked)")?,
        })
    }

    /// Read and parse a `config.json` file.
    pub fn from_file(path: &std::path::Path) -> Result<EngramConfig> {
        let bytes = crate::files::read_small(path, "config", MAX_CONFIG_BYTES)?;
        let text = String::from_utf8(bytes).map_err(|_| {
            Error::new(
                EngramStatus::ErrInvalidConfig,
                format!("config {}: not UTF-8 text", path.display()),
            )
        })?;
        EngramConfig::from_json(&text)
            .map_err(|e| Error::new(e.status, format!("{}: {}", path.display(), e.message)))
    }
}

/// The fields of [`EngramConfig`] that take more than a lookup: required,
/// converted and range-checked.
impl Lookup<'_> {
    /// The engram layer ids: present, not empty, each a u32.
    fn layer_ids(&self) -> Result<Vec<u32>> {
        let layer_ids = self.uints("layer ids")?;
        let layer_ids = self.required("layer ids", layer_ids)?;
        let layer_ids = layer_ids
            .iter()
            .map(|&x| {
                u32::try_from(x).map_err(|_| bad(format!("config.json: layer id {x} is too large")))
            })
            .collect::<Result<Vec<u32>>>()?;
        if layer_ids.is_empty() {
            bail!(
                ErrInvalidConfig,
                "config.json: the engram layer id list is empty"
            );
        }
        Ok(layer_ids)
    }

    /// N: present, 2 to 64.
    fn max_ngram(&self) -> Result<usize> {
        let max_ngram = self.uint("max n-gram size")?;
        let max_ngram = self.required("max n-gram size", max_ngram)? as usize;
        if !(2..=64).contains(&max_ngram) {
            bail!(
                ErrInvalidConfig,
                "config.json: max n-gram size {max_ngram} (2 to 64)"
            );
        }
        Ok(max_ngram)
    }

    /// H: present, 1 to 1024.
    fn n_heads(&self) -> Result<usize> {
        let n_heads = self.uint("heads per n-gram")?;
        let n_heads = self.required("heads per n-gram", n_heads)? as usize;
        if !(1..=1024).contains(&n_heads) {
            bail!(
                ErrInvalidConfig,
                "config.json: {n_heads} heads per n-gram (1 to 1024)"
            );
        }
        Ok(n_heads)
    }

    /// The table size per n-gram size: one integer for all, or one per
    /// n-gram size 2..=N, each 1 to 2^62.
    fn vocab_per_ngram(&self, max_ngram: usize) -> Result<Vec<u64>> {
        let Some((n, v)) = self.get("table size per n-gram") else {
            return self.required("table size per n-gram", None);
        };
        let sizes = if let Some(x) = v.as_u64() {
            vec![x; max_ngram - 1]
        } else {
            self.uints("table size per n-gram")?.unwrap_or_default()
        };
        if sizes.len() != max_ngram - 1 {
            bail!(
                ErrInvalidConfig,
                "config.json: {n} has {} sizes, max n-gram size {max_ngram} needs {} (one per n-gram size 2..={max_ngram}) or one integer",
                sizes.len(),
                max_ngram - 1
            );
        }
        if let Some(&s) = sizes.iter().find(|&&s| s == 0 || s > 1 << 62) {
            bail!(ErrInvalidConfig, "config.json: {n} holds {s} (1 to 2^62)");
        }
        Ok(sizes)
    }

    /// The raw pad token id: present, a u32.
    fn pad_token_id(&self) -> Result<u32> {
        let pad = self.uint("pad token id")?;
        let pad_token_id = self.required("pad token id", pad)?;
        u32::try_from(pad_token_id).map_err(|_| {
            bad(format!(
                "config.json: pad token id {pad_token_id} is too large"
            ))
        })
    }

    /// The rows per layer, when stated: one per engram layer.
    fn num_embeddings(&self, n_layers: usize) -> Result<Option<Vec<u64>>> {
        let num_embeddings = self.uints("rows per layer (checked)")?;
        if let Some(ne) = &num_embeddings {
            if ne.len() != n_layers {
                bail!(
                    ErrInvalidConfig,
                    "config.json: engram_num_embeddings has {} entries for {} engram layers",
                    ne.len(),
                    n_layers
                );
            }
        }
        Ok(num_embeddings)
    }
}

/// `quantization_config.weight_block_size`, when given: two block sizes,
/// each 1 to 2^16.
fn weight_block_size(root: &Value) -> Result<Option<[u64; 2]>> {
    let Some(v) = root
        .get("quantization_config")
        .and_then(|q| q.get("weight_block_size"))
    else {
        return Ok(None);
    };
    match v
        .as_array()
        .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
    {
        Some(a)
            if a.len() == 2
                && a.iter()
                    .all(|x| x.is_some_and(|x| (1..=1 << 16).contains(&x))) =>
        {
            Ok(Some([a[0].unwrap_or(1), a[1].unwrap_or(1)]))
        }
        _ => bail!(
            ErrInvalidConfig,
            "config.json: quantization_config.weight_block_size = {v} is not two block sizes"
        ),
    }
}
