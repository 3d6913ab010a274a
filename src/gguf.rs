//! GGUF files: a bounds-checked header parser over a byte slice, the
//! `deepseek41.engram.*` metadata (SPEC section 3) and the engram layers'
//! tensors, and a context created straight from a mapped file.
//!
//! The parser never reads past the slice and never allocates more than the
//! slice could describe (every count is checked against the bytes left before
//! anything is reserved), so a truncated, corrupt or hostile file gives an
//! error status, not a crash: `ErrFormat` for a file that is not valid GGUF
//! (wrong magic, truncated, tensors outside the file or overlapping, metadata
//! of the wrong type), `ErrUnsupported` for a valid file this build cannot use
//! (GGUF version other than 2 or 3, big-endian, a tensor type unknown to it).

use crate::context::{Context, ContextConfig, Geometry, LayerIn, TableIn};
use crate::error::{bail, Error, Result};
use crate::formats::{RowFormat, WeightFormat, Weights};
use crate::hash::{derive_offsets, HashTablesIn, Limits};
use crate::tables::EngramTables;
use crate::EngramStatus;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// `"GGUF"` as a little-endian u32.
const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
/// Nesting depth accepted for arrays of arrays.
const MAX_ARRAY_DEPTH: usize = 4;

// GGUF metadata value types.
const VT_U8: u32 = 0;
const VT_I8: u32 = 1;
const VT_U16: u32 = 2;
const VT_I16: u32 = 3;
const VT_U32: u32 = 4;
const VT_I32: u32 = 5;
const VT_F32: u32 = 6;
const VT_BOOL: u32 = 7;
const VT_STRING: u32 = 8;
const VT_ARRAY: u32 = 9;
const VT_U64: u32 = 10;
const VT_I64: u32 = 11;
const VT_F64: u32 = 12;

/// Name of a metadata value type.
pub fn vt_name(t: u32) -> &'static str {
    match t {
        VT_U8 => "u8",
        VT_I8 => "i8",
        VT_U16 => "u16",
        VT_I16 => "i16",
        VT_U32 => "u32",
        VT_I32 => "i32",
        VT_F32 => "f32",
        VT_BOOL => "bool",
        VT_STRING => "string",
        VT_ARRAY => "array",
        VT_U64 => "u64",
        VT_I64 => "i64",
        VT_F64 => "f64",
        _ => "unknown",
    }
}

/// A metadata value. Integers of every width are held as `i128`; the GGUF
/// type is kept beside them.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    /// Element type and items.
    Array(u32, Vec<Value>),
}

/// One metadata entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Kv {
    pub key: String,
    pub ty: u32,
    pub value: Value,
}

/// One tensor's header entry, checked against the file.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (innermost).
    pub dims: Vec<u64>,
    /// `ggml_type`.
    pub ty: u32,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Bytes of data, `None` for a type this build does not know (then only
    /// its offset is checked).
    pub bytes: Option<u64>,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF header.
#[derive(Clone, Debug)]
pub struct Gguf {
    pub version: u32,
    pub kvs: Vec<Kv>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
    index: HashMap<String, usize>,
}

/// `(values per block, bytes per block)` of every `ggml_type` this build knows
/// (ggml's type traits; removed type numbers are absent).
pub fn ggml_type_size(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),      // f32
        1 => (1, 2),      // f16
        2 => (32, 18),    // q4_0
        3 => (32, 20),    // q4_1
        6 => (32, 22),    // q5_0
        7 => (32, 24),    // q5_1
        8 => (32, 34),    // q8_0
        9 => (32, 36),    // q8_1
        10 => (256, 84),  // q2_K
        11 => (256, 110), // q3_K
        12 => (256, 144), // q4_K
        13 => (256, 176), // q5_K
        14 => (256, 210), // q6_K
        15 => (256, 292), // q8_K
        16 => (256, 66),  // iq2_xxs
        17 => (256, 74),  // iq2_xs
        18 => (256, 98),  // iq3_xxs
        19 => (256, 50),  // iq1_s
        20 => (32, 18),   // iq4_nl
        21 => (256, 110), // iq3_s
        22 => (256, 82),  // iq2_s
        23 => (256, 136), // iq4_xs
        24 => (1, 1),     // i8
        25 => (1, 2),     // i16
        26 => (1, 4),     // i32
        27 => (1, 8),     // i64
        28 => (1, 8),     // f64
        29 => (256, 56),  // iq1_m
        30 => (1, 2),     // bf16
        34 => (256, 54),  // tq1_0
        35 => (256, 66),  // tq2_0
        39 => (32, 17),   // mxfp4
        _ => return None,
    })
}

fn fmt_err(msg: String) -> Error {
    Error::new(EngramStatus::ErrFormat, msg)
}

/// A cursor over the header bytes; every read is checked.
struct Cur<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Cur<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            return Err(fmt_err(format!(
                "truncated GGUF header: {} needs {n} bytes at offset {}, the file has {} left",
                what(),
                self.pos,
                self.left()
            )));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes(s.try_into().unwrap()))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().unwrap()))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.u64(what)?;
        if n > self.left() as u64 {
            return Err(fmt_err(format!(
                "truncated GGUF header: {} is a string of {n} bytes at offset {}, the file has {} left",
                what(),
                self.pos,
                self.left()
            )));
        }
        let s = self.take(n as usize, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| fmt_err(format!("{} is not valid UTF-8", what())))
    }

    /// Smallest encoding of one value of type `t` (to bound array counts).
    fn min_size(t: u32) -> usize {
        match t {
            VT_U8 | VT_I8 | VT_BOOL => 1,
            VT_U16 | VT_I16 => 2,
            VT_U32 | VT_I32 | VT_F32 => 4,
            VT_U64 | VT_I64 | VT_F64 | VT_STRING => 8,
            _ => 12, // array: element type + count
        }
    }

    fn value(&mut self, t: u32, depth: usize, what: &dyn Fn() -> String) -> Result<Value> {
        let int = |s: &[u8], signed: bool| -> i128 {
            let mut b = [0u8; 16];
            b[..s.len()].copy_from_slice(s);
            if signed && s[s.len() - 1] & 0x80 != 0 {
                b[s.len()..].fill(0xFF);
            }
            i128::from_le_bytes(b)
        };
        Ok(match t {
            VT_U8 | VT_I8 => Value::Int(int(self.take(1, what)?, t == VT_I8)),
            VT_U16 | VT_I16 => Value::Int(int(self.take(2, what)?, t == VT_I16)),
            VT_U32 | VT_I32 => Value::Int(int(self.take(4, what)?, t == VT_I32)),
            VT_U64 | VT_I64 => Value::Int(int(self.take(8, what)?, t == VT_I64)),
            VT_F32 => {
                Value::Float(f32::from_le_bytes(self.take(4, what)?.try_into().unwrap()) as f64)
            }
            VT_F64 => Value::Float(f64::from_le_bytes(self.take(8, what)?.try_into().unwrap())),
            VT_BOOL => match self.take(1, what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(fmt_err(format!("{}: bool value {b}", what()))),
            },
            VT_STRING => Value::Str(self.string(what)?),
            VT_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(fmt_err(format!(
                        "{}: arrays nested deeper than {MAX_ARRAY_DEPTH}",
                        what()
                    )));
                }
                let et = self.u32(what)?;
                if et > VT_F64 {
                    return Err(fmt_err(format!(
                        "{}: unknown array element type {et}",
                        what()
                    )));
                }
                let n = self.u64(what)?;
                if n > (self.left() / Self::min_size(et)) as u64 {
                    return Err(fmt_err(format!(
                        "truncated GGUF header: {} is an array of {n} {} at offset {}, the file has {} bytes left",
                        what(),
                        vt_name(et),
                        self.pos,
                        self.left()
                    )));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(et, depth + 1, what)?);
                }
                Value::Array(et, items)
            }
            _ => return Err(fmt_err(format!("{}: unknown value type {t}", what()))),
        })
    }
}

impl Gguf {
    /// Parse the header of a whole GGUF file held in `b`, and check every
    /// tensor's data against the file: inside it, aligned, and not
    /// overlapping the next tensor (so a shape that disagrees with the data
    /// written is caught).
    pub fn parse(b: &[u8]) -> Result<Gguf> {
        let mut c = Cur { b, pos: 0 };
        let magic = c.take(4, &|| "the magic".into()).map_err(|_| {
            fmt_err(format!(
                "not a GGUF file: {} bytes, too short for the magic",
                b.len()
            ))
        })?;
        if magic != GGUF_MAGIC {
            bail!(
                ErrFormat,
                "not a GGUF file: the magic is {:02x?}, expected \"GGUF\"",
                magic
            );
        }
        let version = c.u32(&|| "the version".into())?;
        if version != 2 && version != 3 {
            if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
                bail!(
                    ErrUnsupported,
                    "big-endian GGUF (version {}) is not supported",
                    version.swap_bytes()
                );
            }
            bail!(
                ErrUnsupported,
                "GGUF version {version} is not supported (this library reads versions 2 and 3)"
            );
        }
        let n_tensors = c.u64(&|| "the tensor count".into())?;
        let n_kv = c.u64(&|| "the metadata count".into())?;
        // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes, a
        // tensor entry 8 + 4 + 4 + 8.
        if n_kv > (c.left() / 13) as u64 {
            bail!(
                ErrFormat,
                "truncated GGUF header: {n_kv} metadata entries cannot fit in the {} bytes left",
                c.left()
            );
        }
        if n_tensors > (c.left() / 24) as u64 {
            bail!(
                ErrFormat,
                "truncated GGUF header: {n_tensors} tensors cannot fit in the {} bytes left",
                c.left()
            );
        }
        let mut kvs = Vec::with_capacity(n_kv as usize);
        let mut keys = std::collections::HashSet::new();
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata entry {i}'s key"))?;
            let ty = c.u32(&|| format!("metadata {key}'s type"))?;
            let value = c.value(ty, 0, &|| format!("metadata {key}"))?;
            if !keys.insert(key.clone()) {
                bail!(ErrFormat, "metadata key {key} appears twice");
            }
            kvs.push(Kv { key, ty, value });
        }
        let mut alignment = DEFAULT_ALIGNMENT;
        if let Some(kv) = kvs.iter().find(|k| k.key == "general.alignment") {
            match kv.value {
                Value::Int(a) if a > 0 && a <= 1 << 30 && (a as u64).is_power_of_two() => {
                    alignment = a as u64
                }
                ref v => bail!(ErrFormat, "general.alignment is {v:?}, not a power of two"),
            }
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut index = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor {i}'s name"))?;
            let nd = c.u32(&|| format!("tensor {name}'s dimension count"))? as usize;
            if nd == 0 || nd > MAX_DIMS {
                bail!(
                    ErrFormat,
                    "tensor {name} has {nd} dimensions (1 to {MAX_DIMS})"
                );
            }
            let mut dims = Vec::with_capacity(nd);
            for d in 0..nd {
                dims.push(c.u64(&|| format!("tensor {name}'s dimension {d}"))?);
            }
            let ty = c.u32(&|| format!("tensor {name}'s type"))?;
            let offset = c.u64(&|| format!("tensor {name}'s offset"))?;
            if index.insert(name.clone(), tensors.len()).is_some() {
                bail!(ErrFormat, "tensor {name} appears twice");
            }
            let n = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n < 1 << 62)
                .ok_or_else(|| fmt_err(format!("tensor {name}: dimensions {dims:?} overflow")))?;
            let bytes = match ggml_type_size(ty) {
                Some((bl, bb)) => {
                    if dims[0] % bl != 0 {
                        bail!(ErrFormat, "tensor {name}: a row of {} values is not whole blocks of {bl} (type {ty})", dims[0]);
                    }
                    Some(n / bl * bb)
                }
                None => None,
            };
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                bytes,
            });
        }
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        let len = b.len() as u64;
        for t in &mut tensors {
            if t.offset % alignment != 0 {
                bail!(
                    ErrFormat,
                    "tensor {}: data offset {} is not a multiple of the alignment {alignment}",
                    t.name,
                    t.offset
                );
            }
            let start = data_offset.checked_add(t.offset).filter(|&s| s <= len).ok_or_else(|| {
                fmt_err(format!(
                    "truncated GGUF file: tensor {}'s data starts at {} + {}, past the end of the file ({len} bytes)",
                    t.name, data_offset, t.offset
                ))
            })?;
            if let Some(n) = t.bytes {
                if start.checked_add(n).is_none_or(|e| e > len) {
                    bail!(
                        ErrFormat,
                        "truncated GGUF file: tensor {} ({:?} of type {}) needs {n} bytes at {start}, the file has {len}",
                        t.name, t.dims, t.ty
                    );
                }
            }
            t.offset = start;
        }
        // Sizes against the data written: no tensor may run into the next one.
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if let Some(n) = a.bytes {
                if a.offset + n > b.offset {
                    bail!(
                        ErrFormat,
                        "tensor {} ({:?}, type {}, {n} bytes at {}) overlaps tensor {} at {}: its shape disagrees with the data written",
                        a.name, a.dims, a.ty, a.offset, b.name, b.offset
                    );
                }
            }
        }
        Ok(Gguf {
            version,
            kvs,
            tensors,
            alignment,
            data_offset,
            index,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Kv> {
        self.kvs.iter().find(|k| k.key == key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// `general.architecture`, if present and a string.
    pub fn architecture(&self) -> Option<&str> {
        match self.get("general.architecture").map(|k| &k.value) {
            Some(Value::Str(s)) => Some(s),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------
// The engram metadata and tensors.
// ---------------------------------------------------------------------------

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

/// Options of [`GgufModel::context`] (the C options struct carries the same).
#[derive(Clone, Debug)]
pub struct GgufOptions {
    pub limits: Limits,
    pub n_threads: usize,
    pub backend: u32,
    pub eps: f32,
    /// Read table rows from the mapping (`true`) instead of with `pread` on
    /// the file (`false`, the default: I/O errors become `ErrIo`, never SIGBUS).
    pub mmap_tables: bool,
}

/// A GGUF file mapped into memory, its header, and its engram model. The
/// mapping is read-only and private; a context created from it borrows it.
///
/// Reading a mapped file that shrinks underneath (another process truncates
/// it) raises SIGBUS in the reading thread: keep model files immutable while
/// they are in use, as every mmap-based engine does. Table rows gathered
/// through `engram_prefetch` on a file-backed table use `pread` and report
/// `ErrIo` instead.
pub struct GgufModel {
    pub path: PathBuf,
    pub file: std::sync::Arc<std::fs::File>,
    map: memmap2::Mmap,
    pub header: Gguf,
    pub model: EngramModel,
}

impl GgufModel {
    /// Open, map and parse `path`; `companion` completes missing hash constants.
    pub fn open(path: &Path, companion: Option<&EngramTables>) -> Result<GgufModel> {
        let io =
            |e: std::io::Error| Error::new(EngramStatus::ErrIo, format!("{}: {e}", path.display()));
        let file = std::fs::File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            bail!(ErrIo, "{}: not a regular file", path.display());
        }
        if meta.len() == 0 {
            bail!(ErrFormat, "{}: empty file, not GGUF", path.display());
        }
        // SAFETY: a private read-only mapping; the file must not be truncated
        // while mapped (documented above).
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(io)?;
        let at = |e: Error| Error::new(e.status, format!("{}: {}", path.display(), e.message));
        let header = Gguf::parse(&map).map_err(at)?;
        let model = EngramModel::from_gguf(&header, companion).map_err(at)?;
        Ok(GgufModel {
            path: path.to_path_buf(),
            file: std::sync::Arc::new(file),
            map,
            header,
            model,
        })
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// A tensor's data.
    pub fn data(&self, t: &TensorInfo) -> &[u8] {
        let n = t.bytes.expect("sized tensor") as usize;
        &self.map[t.offset as usize..t.offset as usize + n]
    }

    /// A context over this file's engram layers (weights borrowed from the mapping).
    pub fn context(&self, o: &GgufOptions) -> Result<Context<'_>> {
        let m = &self.model;
        let cfg = ContextConfig {
            geometry: Geometry {
                d: m.d,
                hc: m.hc,
                hd: m.hd,
                eps: o.eps,
            },
            tables: m.tables_in(),
            limits: o.limits,
            n_threads: o.n_threads,
            backend: o.backend,
        };
        let ctx = Context::new(&cfg)?;
        for l in &m.layers {
            let at = |e: Error| {
                Error::new(
                    e.status,
                    format!(
                        "{}: layer {}: {}",
                        self.path.display(),
                        l.layer_id,
                        e.message
                    ),
                )
            };
            let format = RowFormat::new(l.embd.ty, m.hd).map_err(|e| {
                at(Error::new(
                    e.status,
                    format!("{}: {}", l.embd.name, e.message),
                ))
            })?;
            let rows = l.embd.dims.get(1).copied().unwrap_or(1);
            let kv_in = m.hd * (m.max_ngram - 1) * m.n_heads;
            let wkv = weights(self.data(&l.wkv), l.wkv.ty, kv_in, true, &l.wkv.name).map_err(at)?;
            let q = weights(self.data(&l.q), l.q.ty, m.d, false, &l.q.name).map_err(at)?;
            let k = weights(self.data(&l.k), l.k.ty, m.d, false, &l.k.name).map_err(at)?;
            ctx.set_layer(LayerIn {
                layer_id: l.layer_id,
                table: TableIn {
                    data: self.data(&l.embd),
                    format,
                    rows,
                },
                wkv,
                q,
                k,
            })
            .map_err(at)?;
            if !o.mmap_tables {
                ctx.set_table_file(l.layer_id, self.file.clone(), l.embd.offset)
                    .map_err(at)?;
            }
        }
        Ok(ctx)
    }
}

/// A weight tensor's bytes as [`Weights`] (f32, bf16, or GGUF blocks where allowed).
fn weights<'a>(
    data: &'a [u8],
    ty: u32,
    row_len: usize,
    quant_ok: bool,
    name: &str,
) -> Result<Weights<'a>> {
    let fmt = if quant_ok {
        WeightFormat::new(ty, row_len, name)?
    } else {
        WeightFormat::Dense(crate::formats::WeightDtype::new(ty, name)?)
    };
    let misaligned = |a: usize| fmt_err(format!("tensor {name}: data not aligned to {a} bytes"));
    Ok(match fmt {
        WeightFormat::Dense(crate::formats::WeightDtype::F32) => {
            // SAFETY-free reinterpretation through align_to: f32 from any bytes is fine.
            let (pre, mid, post) = unsafe { data.align_to::<f32>() };
            if !pre.is_empty() || !post.is_empty() {
                return Err(misaligned(4));
            }
            Weights::F32(mid)
        }
        WeightFormat::Dense(crate::formats::WeightDtype::Bf16) => {
            let (pre, mid, post) = unsafe { data.align_to::<u16>() };
            if !pre.is_empty() || !post.is_empty() {
                return Err(misaligned(2));
            }
            Weights::Bf16(mid)
        }
        WeightFormat::Quant(f) => Weights::quant(f, data, row_len)?,
    })
}
