//! The engram metadata of a GGUF file (`{arch}.engram.*`, SPEC section 3) and
//! each engram layer's tensors, completed from a config.json + tokenizer.json
//! where the file lacks the hash constants.

use super::parser::{
    fmt_err, vt_name, Gguf, TensorInfo, Value, VT_BOOL, VT_I16, VT_I32, VT_I64, VT_I8, VT_U16,
    VT_U32, VT_U64, VT_U8,
};
use crate::error::{bail, Result};
use crate::hash::{derive_offsets, HashTablesIn};
use crate::tables::EngramTables;

/// The hash-constant keys (after the `{arch}.engram.` prefix) that published
/// files have been seen without.
const HASH_KEYS: [&str; 5] = ["multipliers", "primes", "offsets", "token_map", "pad_id"];

/// One engram layer's tensors in a GGUF file.
#[derive(Clone, Debug)]
pub struct EngramTensors {
    pub layer_id: u32,
    pub embd: TensorInfo,
    pub wkv: TensorInfo,
    pub q: TensorInfo,
    pub k: TensorInfo,
}

/// Everything a context needs from a GGUF file (and a companion config +
/// tokenizer where the file lacks the hash constants).
#[derive(Clone, Debug)]
pub struct EngramModel {
    pub prefix: String,
    pub d: usize,
    pub hc: usize,
    pub hd: usize,
    pub layer_ids: Vec<u32>,
    pub max_ngram: usize,
    pub n_heads: usize,
    pub token_map: Vec<i32>,
    pub pad_id: i64,
    pub multipliers: Vec<u64>,
    pub primes: Vec<u64>,
    pub offsets: Vec<u64>,
    /// Where the hash constants came from: `"gguf"` or `"config+tokenizer"`.
    pub hash_source: &'static str,
    pub layers: Vec<EngramTensors>,
}

fn ints(g: &Gguf, key: &str, allowed: &[u32]) -> Result<Option<Vec<i128>>> {
    let Some(kv) = g.get(key) else {
        return Ok(None);
    };
    let names = || {
        allowed
            .iter()
            .map(|&t| vt_name(t))
            .collect::<Vec<_>>()
            .join(", ")
    };
    match &kv.value {
        Value::Array(et, items) if allowed.contains(et) => Ok(Some(
            items
                .iter()
                .map(|v| match v {
                    Value::Int(x) => *x,
                    _ => unreachable!("integer element types hold integers"),
                })
                .collect(),
        )),
        Value::Array(et, _) => bail!(
            ErrFormat,
            "{key} is an array of {}, expected one of {}",
            vt_name(*et),
            names()
        ),
        _ => bail!(
            ErrFormat,
            "{key} is a {}, expected an array of {}",
            vt_name(kv.ty),
            names()
        ),
    }
}

fn uint(g: &Gguf, key: &str) -> Result<Option<u64>> {
    let Some(kv) = g.get(key) else {
        return Ok(None);
    };
    match kv.value {
        Value::Int(x) if (0..=u32::MAX as i128 * 4).contains(&x) && kv.ty != VT_BOOL => {
            Ok(Some(x as u64))
        }
        _ => bail!(
            ErrFormat,
            "{key} is {:?} ({}), expected a non-negative integer",
            kv.value,
            vt_name(kv.ty)
        ),
    }
}

const INT_TYPES: [u32; 8] = [VT_U8, VT_I8, VT_U16, VT_I16, VT_U32, VT_I32, VT_U64, VT_I64];

impl EngramModel {
    /// Read the engram metadata and find each layer's tensors. `companion`
    /// (derived from a config.json + tokenizer.json) supplies the hash constants
    /// when the file lacks any of them, and must agree with those it has.
    pub fn from_gguf(g: &Gguf, companion: Option<&EngramTables>) -> Result<EngramModel> {
        let arch = g.architecture().unwrap_or("deepseek41").to_string();
        let p = format!("{arch}.engram.");
        let key = |k: &str| format!("{p}{k}");
        let cfg = companion.map(|c| &c.config);
        // Geometry keys: from the file, else from the companion config.
        let layer_ids: Vec<u32> = match ints(g, &key("layer_ids"), &INT_TYPES)? {
            Some(v) => v
                .iter()
                .map(|&x| {
                    u32::try_from(x)
                        .map_err(|_| fmt_err(format!("{}: layer id {x}", key("layer_ids"))))
                })
                .collect::<Result<_>>()?,
            None => match cfg {
                Some(c) => c.layer_ids.clone(),
                None => bail!(
                    ErrFormat,
                    "{} is missing: not an engram model file?",
                    key("layer_ids")
                ),
            },
        };
        let geo = |k: &str, from_cfg: Option<usize>| -> Result<Option<usize>> {
            Ok(uint(g, &key(k))?.map(|v| v as usize).or(from_cfg))
        };
        let n_heads = geo("head_count", cfg.map(|c| c.n_heads))?;
        let max_ngram = geo("max_ngram_size", cfg.map(|c| c.max_ngram))?;
        let key_length = geo("key_length", cfg.and_then(|c| c.head_dim))?;
        let (Some(n_heads), Some(max_ngram)) = (n_heads, max_ngram) else {
            let missing: Vec<String> = [("head_count", n_heads), ("max_ngram_size", max_ngram)]
                .iter()
                .filter(|(_, v)| v.is_none())
                .map(|(k, _)| key(k))
                .collect();
            bail!(
                ErrFormat,
                "the file lacks {} and no config.json was given",
                missing.join(", ")
            );
        };
        if !(2..=64).contains(&max_ngram) || !(1..=1024).contains(&n_heads) {
            bail!(
                ErrFormat,
                "{} = {max_ngram}, {} = {n_heads} out of range",
                key("max_ngram_size"),
                key("head_count")
            );
        }
        // The hash constants.
        let mult = ints(g, &key("multipliers"), &[VT_U64, VT_I64])?;
        let primes = ints(g, &key("primes"), &[VT_U32, VT_U64, VT_I32, VT_I64])?;
        let offsets = ints(g, &key("offsets"), &[VT_U32, VT_U64, VT_I32, VT_I64])?;
        let tmap = ints(g, &key("token_map"), &[VT_I32, VT_U32, VT_I64])?;
        let pad = match g.get(&key("pad_id")) {
            None => None,
            Some(kv) => match kv.value {
                Value::Int(x) if (0..=i32::MAX as i128).contains(&x) => Some(x as i64),
                _ => bail!(
                    ErrFormat,
                    "{} is {:?}, expected a compressed id",
                    key("pad_id"),
                    kv.value
                ),
            },
        };
        let cols = (max_ngram - 1) * n_heads;
        let from_file = mult.is_some() && primes.is_some() && tmap.is_some() && pad.is_some();
        let (token_map, pad_id, multipliers, primes_v, offsets_v, source);
        if from_file {
            let mult = mult.unwrap();
            let pr = primes.unwrap();
            if pr.iter().any(|&x| x <= 0 || x > i64::MAX as i128) {
                bail!(
                    ErrFormat,
                    "{} holds a value that is not a positive i64",
                    key("primes")
                );
            }
            multipliers = mult.iter().map(|&x| x as u64).collect::<Vec<u64>>();
            primes_v = pr.iter().map(|&x| x as u64).collect::<Vec<u64>>();
            offsets_v = match offsets {
                Some(o) => {
                    if o.iter().any(|&x| x < 0 || x > i64::MAX as i128) {
                        bail!(ErrFormat, "{} holds a negative value", key("offsets"));
                    }
                    o.iter().map(|&x| x as u64).collect()
                }
                None if primes_v.len() % cols == 0 => derive_offsets(&primes_v, cols),
                None => bail!(
                    ErrFormat,
                    "{} has {} entries, not whole layers of {cols}",
                    key("primes"),
                    primes_v.len()
                ),
            };
            // i32, u32 (0xFFFFFFFF is -1) or i64 entries.
            token_map = tmap
                .unwrap()
                .iter()
                .map(|&x| match x {
                    -1..=0x7FFF_FFFF => Ok(x as i32),
                    0xFFFF_FFFF => Ok(-1),
                    _ => Err(fmt_err(format!(
                        "{} holds {x}, not a compressed id or -1",
                        key("token_map")
                    ))),
                })
                .collect::<Result<Vec<i32>>>()?;
            pad_id = pad.unwrap();
            source = "gguf";
            // A config + tokenizer given alongside must describe the same hash.
            if let Some(c) = companion {
                let differs: Vec<&str> = [
                    ("layer_ids", c.config.layer_ids != layer_ids),
                    ("max_ngram_size", c.config.max_ngram != max_ngram),
                    ("head_count", c.config.n_heads != n_heads),
                    ("multipliers", c.multipliers != multipliers),
                    ("primes", c.primes != primes_v),
                    ("offsets", c.offsets != offsets_v),
                    ("token_map", c.token_map != token_map),
                    ("pad_id", c.pad_id != pad_id),
                ]
                .into_iter()
                .filter(|(_, d)| *d)
                .map(|(k, _)| k)
                .collect();
                if !differs.is_empty() {
                    bail!(
                        ErrInvalidConfig,
                        "the file's {} differ from those derived from the config.json + tokenizer.json given alongside",
                        differs
                            .iter()
                            .map(|k| key(k))
                            .collect::<Vec<_>>()
                            .join(", ")
                    );
                }
            }
        } else {
            let missing: Vec<String> = HASH_KEYS
                .iter()
                .zip([
                    mult.is_none(),
                    primes.is_none(),
                    offsets.is_none(),
                    tmap.is_none(),
                    pad.is_none(),
                ])
                .filter(|(_, m)| *m)
                .map(|(k, _)| key(k))
                .collect();
            let Some(c) = companion else {
                bail!(
                    ErrInvalidConfig,
                    "the file lacks the hash constants {}: pass the model's config.json and tokenizer.json to derive them",
                    missing.join(", ")
                );
            };
            // The companion must describe the same hash as the file.
            if c.config.layer_ids != layer_ids
                || c.config.max_ngram != max_ngram
                || c.config.n_heads != n_heads
            {
                bail!(
                    ErrInvalidConfig,
                    "config.json describes layers {:?}, N = {}, H = {}; the file has {layer_ids:?}, N = {max_ngram}, H = {n_heads}",
                    c.config.layer_ids, c.config.max_ngram, c.config.n_heads
                );
            }
            let check = |name: &str, file: &Option<Vec<i128>>, derived: &[u64]| -> Result<()> {
                if let Some(f) = file {
                    if f.len() != derived.len()
                        || f.iter().zip(derived).any(|(&a, &b)| a as u64 != b)
                    {
                        bail!(ErrInvalidConfig, "{} in the file differs from the one derived from config.json + tokenizer.json", key(name));
                    }
                }
                Ok(())
            };
            check("multipliers", &mult, &c.multipliers)?;
            check("primes", &primes, &c.primes)?;
            check("offsets", &offsets, &c.offsets)?;
            token_map = c.token_map.clone();
            pad_id = c.pad_id;
            multipliers = c.multipliers.clone();
            primes_v = c.primes.clone();
            offsets_v = c.offsets.clone();
            source = "config+tokenizer";
        }
        // The tensors.
        let find = |lid: u32, what: &str| -> Result<TensorInfo> {
            let base = format!("blk.{lid}.{what}");
            g.tensor(&base)
                .or_else(|| g.tensor(&format!("{base}.weight")))
                .cloned()
                .ok_or_else(|| {
                    fmt_err(format!(
                        "the file has no tensor {base} (or {base}.weight) for engram layer {lid}"
                    ))
                })
        };
        let mut layers = Vec::new();
        for &lid in &layer_ids {
            layers.push(EngramTensors {
                layer_id: lid,
                embd: find(lid, "engram_embd")?,
                wkv: find(lid, "engram_wkv")?,
                q: find(lid, "engram_q")?,
                k: find(lid, "engram_k")?,
            });
        }
        let first = layers
            .first()
            .ok_or_else(|| fmt_err(format!("{} is empty", key("layer_ids"))))?;
        let dims2 = |t: &TensorInfo| -> Result<(u64, u64)> {
            if t.dims.iter().skip(2).any(|&d| d != 1) {
                bail!(
                    ErrFormat,
                    "tensor {} has shape {:?}, expected two dimensions",
                    t.name,
                    t.dims
                );
            }
            Ok((t.dims[0], t.dims.get(1).copied().unwrap_or(1)))
        };
        let (d, hc) = dims2(&first.q)?;
        let hd = match key_length {
            Some(h) => h as u64,
            None => dims2(&first.embd)?.0,
        };
        let (d, hc, hd) = (d as usize, hc as usize, hd as usize);
        for l in &layers {
            for t in [&l.embd, &l.wkv, &l.q, &l.k] {
                if t.bytes.is_none() {
                    bail!(
                        ErrUnsupported,
                        "tensor {} has type {}, unknown to this build",
                        t.name,
                        t.ty
                    );
                }
            }
            let want = [
                (&l.embd, None, Some(hd as u64)),
                (
                    &l.wkv,
                    Some((d * (hc + 1)) as u64),
                    Some((cols * hd) as u64),
                ),
                (&l.q, Some(hc as u64), Some(d as u64)),
                (&l.k, Some(hc as u64), Some(d as u64)),
            ];
            for (t, rows, row_len) in want {
                let (ne0, ne1) = dims2(t)?;
                if row_len.is_some_and(|r| r != ne0) || rows.is_some_and(|r| r != ne1) {
                    bail!(
                        ErrFormat,
                        "tensor {} has shape {:?}, expected [{}, {}] (ggml order) for D = {d}, hc = {hc}, Hd = {hd}, C = {cols}",
                        t.name,
                        t.dims,
                        row_len.map_or("rows".into(), |r| r.to_string()),
                        rows.map_or("rows".into(), |r| r.to_string())
                    );
                }
            }
            if l.q.ty != l.k.ty {
                bail!(
                    ErrFormat,
                    "{} and {} have different types ({} and {})",
                    l.q.name,
                    l.k.name,
                    l.q.ty,
                    l.k.ty
                );
            }
        }
        Ok(EngramModel {
            prefix: p,
            d,
            hc,
            hd,
            layer_ids,
            max_ngram,
            n_heads,
            token_map,
            pad_id,
            multipliers,
            primes: primes_v,
            offsets: offsets_v,
            hash_source: source,
            layers,
        })
    }

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
}
