//! Which public converter wrote a GGUF file, and reading each one's keys and
//! tensors into one [`Partial`] model (`tests/golden/DIALECTS.md` describes
//! every dialect and where it was read).
//!
//! The dialect is settled first, from the keys that identify it
//! ([`detect`], DIALECTS.md section 8), because several key names mean
//! different things in different dialects (`...engram.pad_id` is a
//! compressed id in vcruz305 and ds4, a raw token id in deepstrix; the token
//! map is `i32[]` in one and `u32[]` in others). Then:
//!
//! - integer keys and arrays are accepted in any integer width whose value
//!   fits where it goes; a value that does not fit is refused, naming the key;
//! - hash constants come from metadata (vcruz305, ds4, tarruda), tensors
//!   (JigSawPT, "ds4gw"), or nowhere (deepstrix, early vcruz305 files: a
//!   tokenizer and config derive them);
//! - the pad is read as the dialect stores it ([`PadReading`]);
//! - tables are in the file (one array, or codes + scale tensors), or
//!   elsewhere ([`TableSpec::External`]: the loader resolves them).
//!
//! [`Partial::finish`] completes the model with the companion files (if any),
//! settles the pad and checks the geometry and every tensor's shape.

use super::meta::{
    Blob, Dialect, EngramModel, EngramTensors, Keys, PadInfo, PadReading, TableBlobs, WeightBlob,
    WeightSource,
};
use super::parser::{
    fmt_err, is_int_type, vt_name, Kv, TensorInfo, Value, VT_U16, VT_U32, VT_U64, VT_U8,
};
use super::shards::GgufSet;
use crate::error::{bail, Error, Result};
use crate::formats::{EngramType, FP8_SCALE_BLOCK};
use crate::hash::derive_offsets;
use crate::tables::{EngramConfig, EngramTables, TokenMap};
use crate::EngramStatus;

mod finish;
mod readers;
use readers::{deepstrix, ds4, ds4gw, jigsawpt, tarruda, vcruz305};

// ggml's integer tensor types.
const GGML_I8: u32 = 24;
const GGML_I16: u32 = 25;
const GGML_I32: u32 = 26;
const GGML_I64: u32 = 27;
const GGML_F16: u32 = 1;

/// What else the caller gave besides the file.
#[derive(Clone, Copy, Default)]
pub struct Companions<'a> {
    /// Hash tables derived from a `config.json` + `tokenizer.json`.
    pub tables: Option<&'a EngramTables>,
    /// A tokenizer's token map alone (derive the constants from the file's
    /// own config keys, or check the file's token map against it).
    pub token_map: Option<&'a TokenMap>,
}

/// Where a layer's table is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TableSpec {
    /// In the GGUF set.
    InFile(TableBlobs),
    /// Elsewhere: the loader resolves it into [`TableBlobs`].
    External(External),
}

/// A table outside the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum External {
    /// A checkpoint shard holding `layers.{L}.engram.embed.weight` and
    /// `.scale` (deepstrix's `table_shards`).
    Shard {
        key: String,
        recorded: String,
        layer_id: u32,
    },
    /// A shard and the byte offsets of the code and scale planes ("ds4gw").
    Offsets {
        path_key: String,
        recorded: String,
        layer_id: u32,
        weight_key: String,
        weight_offset: u64,
        scale_key: String,
        scale_offset: u64,
        rows: u64,
    },
}

impl External {
    pub fn recorded(&self) -> &str {
        match self {
            External::Shard { recorded, .. } | External::Offsets { recorded, .. } => recorded,
        }
    }
    pub fn key(&self) -> &str {
        match self {
            External::Shard { key, .. } => key,
            External::Offsets { path_key, .. } => path_key,
        }
    }
}

/// One layer as read from the file.
#[derive(Clone, Debug)]
pub struct PartialLayer {
    pub layer_id: u32,
    pub table: TableSpec,
    pub wkv: WeightBlob,
    pub q: WeightBlob,
    pub k: WeightBlob,
}

/// A key's value and its name.
#[derive(Clone, Debug)]
pub struct Named<T> {
    pub key: String,
    pub value: T,
}

/// A model as one dialect's file describes it, before the companion files
/// complete it and the checks run.
#[derive(Clone, Debug)]
pub struct Partial {
    pub dialect: Dialect,
    pub layer_ids: Named<Vec<u32>>,
    pub n_heads: Option<Named<u64>>,
    pub max_ngram: Option<Named<u64>>,
    /// Row width, from a key (or the encoding); else from the tables.
    pub hd: Option<Named<u64>>,
    pub multipliers: Option<Named<Vec<u64>>>,
    pub primes: Option<Named<Vec<u64>>>,
    pub offsets: Option<Named<Vec<u64>>>,
    pub token_map: Option<Named<Vec<i32>>>,
    pub pad: Option<(Named<u64>, PadReading)>,
    pub rows: Option<Named<Vec<u64>>>,
    pub compressed_vocab: Option<Named<u64>>,
    /// The per-n-gram table size the primes start from (deepstrix, JigSawPT).
    pub engram_vocab: Option<Named<u64>>,
    /// Hidden size and streams stated by keys (checked against the tensors).
    pub d_key: Option<Named<u64>>,
    pub hc_key: Option<Named<u64>>,
    /// The names of the keys a complete file of this dialect has for each
    /// constant (for messages when some are missing).
    pub const_keys: [String; 5],
    /// `"gguf"` or `"gguf tensors"`.
    pub const_source: &'static str,
    pub layers: Vec<PartialLayer>,
}

/// Typed access to a GGUF set's metadata, with messages naming the key.
pub struct Meta<'a> {
    pub set: &'a GgufSet,
}

fn type_err(kv: &Kv, want: &str) -> Error {
    let got = match &kv.value {
        Value::Array(a) => format!("an array of {}", vt_name(a.et)),
        _ => format!("a {}", vt_name(kv.ty)),
    };
    fmt_err(format!("{} is {got}, expected {want}", kv.key))
}

/// The largest value of an unsigned integer type (the "-1" of writers that
/// store a signed -1 in an unsigned array).
fn unsigned_all_ones(et: u32) -> Option<i128> {
    match et {
        VT_U8 => Some(u8::MAX as i128),
        VT_U16 => Some(u16::MAX as i128),
        VT_U32 => Some(u32::MAX as i128),
        VT_U64 => Some(u64::MAX as i128),
        _ => None,
    }
}

/// Conversions of stored integers, `None` when the value does not fit.
pub fn to_u32(v: i128, _et: u32) -> Option<u32> {
    u32::try_from(v).ok()
}
/// A non-negative i64 (primes, offsets, rows, multipliers) as u64.
pub fn to_pos_i64(v: i128, _et: u32) -> Option<u64> {
    (0..=i64::MAX as i128).contains(&v).then_some(v as u64)
}
/// A token map entry: a compressed id, or -1 (also stored as the all-ones
/// value of an unsigned type).
pub fn to_token(v: i128, et: u32) -> Option<i32> {
    if (-1..=i32::MAX as i128).contains(&v) {
        Some(v as i32)
    } else if unsigned_all_ones(et) == Some(v) {
        Some(-1)
    } else {
        None
    }
}

impl<'a> Meta<'a> {
    pub fn kv(&self, key: &str) -> Option<&'a Kv> {
        self.set.get(key)
    }

    pub fn has(&self, key: &str) -> bool {
        self.kv(key).is_some()
    }

    /// An integer key as u64 (any integer type; negative refused).
    pub fn uint(&self, key: &str) -> Result<Option<Named<u64>>> {
        let Some(kv) = self.kv(key) else {
            return Ok(None);
        };
        match kv.value {
            Value::Int(x) if is_int_type(kv.ty) => match u64::try_from(x) {
                Ok(v) => Ok(Some(Named {
                    key: key.to_string(),
                    value: v,
                })),
                Err(_) => bail!(ErrFormat, "{key} = {x} does not fit an unsigned integer"),
            },
            _ => Err(type_err(kv, "an integer")),
        }
    }

    pub fn uint_req(&self, key: &str) -> Result<Named<u64>> {
        self.uint(key)?
            .ok_or_else(|| fmt_err(format!("{key} is missing")))
    }

    pub fn string(&self, key: &str) -> Result<Option<String>> {
        match self.kv(key) {
            None => Ok(None),
            Some(Kv {
                value: Value::Str(s),
                ..
            }) => Ok(Some(s.clone())),
            Some(kv) => Err(type_err(kv, "a string")),
        }
    }

    pub fn boolean(&self, key: &str) -> Result<Option<bool>> {
        match self.kv(key) {
            None => Ok(None),
            Some(Kv {
                value: Value::Bool(b),
                ..
            }) => Ok(Some(*b)),
            Some(kv) => Err(type_err(kv, "a bool")),
        }
    }

    pub fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some(kv) = self.kv(key) else {
            return Ok(None);
        };
        match &kv.value {
            Value::Array(a) => match a.strs(self.set.header_bytes()) {
                Some(it) => Ok(Some(it.map(str::to_string).collect())),
                None => Err(type_err(kv, "an array of strings")),
            },
            _ => Err(type_err(kv, "an array of strings")),
        }
    }

    /// An integer array (any integer element type), each value converted by
    /// `conv` (`what` says what it must fit), allocated fallibly.
    pub fn ints<T>(
        &self,
        key: &str,
        conv: impl Fn(i128, u32) -> Option<T>,
        what: &str,
    ) -> Result<Option<Named<Vec<T>>>> {
        let Some(kv) = self.kv(key) else {
            return Ok(None);
        };
        let Value::Array(a) = &kv.value else {
            return Err(type_err(kv, "an array of integers"));
        };
        let Some(it) = a.ints(self.set.header_bytes()) else {
            return Err(type_err(kv, "an array of integers"));
        };
        let mut out = Vec::new();
        if out.try_reserve_exact(a.len as usize).is_err() {
            bail!(ErrCapacity, "{key}: out of memory for {} entries", a.len);
        }
        for (i, v) in it.enumerate() {
            match conv(v, a.et) {
                Some(x) => out.push(x),
                None => bail!(
                    ErrFormat,
                    "{key}[{i}] = {v} does not fit {what} (stored as {})",
                    vt_name(a.et)
                ),
            }
        }
        Ok(Some(Named {
            key: key.to_string(),
            value: out,
        }))
    }

    /// A tensor by name, also without its `.weight` suffix (or with it).
    pub fn tensor(&self, name: &str) -> Option<(usize, &'a TensorInfo)> {
        self.set
            .tensor(name)
            .or_else(|| match name.strip_suffix(".weight") {
                Some(bare) => self.set.tensor(bare),
                None => self.set.tensor(&format!("{name}.weight")),
            })
    }

    /// As [`Meta::tensor`], an error naming it when it is missing.
    pub fn tensor_req(&self, name: &str, what: &str) -> Result<(usize, &'a TensorInfo)> {
        self.tensor(name).ok_or_else(|| {
            let alt = match name.strip_suffix(".weight") {
                Some(b) => b.to_string(),
                None => format!("{name}.weight"),
            };
            fmt_err(format!("the file has no tensor {name} (or {alt}) {what}"))
        })
    }

    /// A tensor's data as a blob (its size checked by the parser).
    pub fn blob(&self, (shard, t): (usize, &TensorInfo)) -> Result<Blob> {
        let bytes = t.bytes.ok_or_else(|| {
            Error::new(
                EngramStatus::ErrUnsupported,
                format!("tensor {} has type {}, unknown to this build", t.name, t.ty),
            )
        })?;
        Ok(Blob {
            name: t.name.clone(),
            file: shard,
            offset: t.offset,
            bytes,
            dims: t.dims.clone(),
        })
    }

    /// An integer tensor (ggml i8 .. i64) of hash constants, converted by
    /// `conv`; `None` when absent.
    pub fn tensor_ints<T>(
        &self,
        name: &str,
        conv: impl Fn(i128, u32) -> Option<T>,
        what: &str,
    ) -> Result<Option<Named<Vec<T>>>> {
        let Some((shard, t)) = self.tensor(name) else {
            return Ok(None);
        };
        let size = match t.ty {
            GGML_I8 => 1,
            GGML_I16 => 2,
            GGML_I32 => 4,
            GGML_I64 => 8,
            ty => bail!(
                ErrFormat,
                "tensor {} has type {} ({ty}), expected an integer type (i8, i16, i32 or i64)",
                t.name,
                crate::formats::GGML_BLOCKS
                    .iter()
                    .find(|e| e.0 == ty)
                    .map_or("unknown", |e| e.1)
            ),
        };
        let bytes = t.bytes.expect("integer types have sizes");
        let data = self.set.shards[shard].read(t.offset, bytes, &t.name)?;
        let mut out = Vec::new();
        if out.try_reserve_exact(data.len() / size).is_err() {
            bail!(ErrCapacity, "{}: out of memory", t.name);
        }
        for (i, c) in data.as_slice().chunks_exact(size).enumerate() {
            let mut b = [0u8; 16];
            b[..size].copy_from_slice(c);
            if c[size - 1] & 0x80 != 0 {
                b[size..].fill(0xFF);
            }
            let v = i128::from_le_bytes(b);
            match conv(v, super::parser::VT_I64) {
                Some(x) => out.push(x),
                None => bail!(ErrFormat, "{}[{i}] = {v} does not fit {what}", t.name),
            }
        }
        Ok(Some(Named {
            key: t.name.clone(),
            value: out,
        }))
    }
}

/// `general.architecture` (absent: `deepseek41`).
pub fn architecture(set: &GgufSet) -> Result<String> {
    Ok(Meta { set }
        .string("general.architecture")?
        .unwrap_or_else(|| "deepseek41".into()))
}

/// The dialect of a GGUF set, from the keys that identify it (DIALECTS.md
/// section 8; the first match wins).
pub fn detect(set: &GgufSet) -> Result<Dialect> {
    let m = Meta { set };
    let arch = architecture(set)?;
    let has = |k: &str| m.has(k);
    if has("deepseek41.engram.encoding") {
        return Ok(Dialect::Ds4);
    }
    if ["layers", "head_bucket_sizes", "embedding_counts"]
        .iter()
        .any(|k| has(&format!("deepseek41.engram.{k}")))
    {
        return Ok(Dialect::Tarruda);
    }
    if has("deepseek41.engram.present")
        || set
            .header()
            .kvs
            .iter()
            .any(|k| k.key.starts_with("deepseek41.engram_"))
        || m.tensor("engram_token_map.weight").is_some()
    {
        return Ok(Dialect::JigSawPT);
    }
    if has("deepseek4.engram.table_shards") {
        return Ok(Dialect::Deepstrix);
    }
    if has("deepseek4.engram.0.table_path") || has("deepseek4.engram.pad_id_compressed") {
        return Ok(Dialect::Ds4gw);
    }
    if has(&format!("{arch}.engram.key_length")) || has(&format!("{arch}.engram.layer_ids")) {
        return Ok(Dialect::Vcruz305);
    }
    if arch != "deepseek4"
        && (has("deepseek4.engram.key_length") || has("deepseek4.engram.layer_ids"))
    {
        return Ok(Dialect::Vcruz305Prefix);
    }
    bail!(
        ErrFormat,
        "not an engram model file: general.architecture is {arch} and none of the keys that identify a \
         DeepSeek-V4.1 engram dialect is present ({arch}.engram.layer_ids or .key_length (vcruz305), \
         deepseek41.engram.encoding (ds4), deepseek41.engram.layers (tarruda), deepseek41.engram.present \
         (JigSawPT), deepseek4.engram.table_shards (deepstrix), deepseek4.engram.0.table_path)"
    )
}

/// Read a GGUF set in its dialect.
pub fn read(set: &GgufSet) -> Result<Partial> {
    let dialect = detect(set)?;
    let m = Meta { set };
    match dialect {
        Dialect::Vcruz305 | Dialect::Vcruz305Prefix => vcruz305(&m, dialect),
        Dialect::Ds4 => ds4(&m),
        Dialect::Tarruda => tarruda(&m),
        Dialect::JigSawPT => jigsawpt(&m),
        Dialect::Deepstrix => deepstrix(&m),
        Dialect::Ds4gw => ds4gw(&m),
        Dialect::Checkpoint => unreachable!("not a GGUF dialect"),
    }
}

fn dim(b: &Blob, i: usize) -> u64 {
    b.dims.get(i).copied().unwrap_or(1)
}
