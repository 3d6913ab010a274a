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

fn layer_ids(m: &Meta<'_>, key: &str) -> Result<Named<Vec<u32>>> {
    let v = m
        .ints(key, to_u32, "a layer id (u32)")?
        .ok_or_else(|| fmt_err(format!("{key} is missing")))?;
    if v.value.is_empty() {
        bail!(ErrFormat, "{key} is empty: no engram layers");
    }
    Ok(v)
}

fn weight(m: &Meta<'_>, name: &str, what: &str) -> Result<WeightBlob> {
    let t = m.tensor_req(name, what)?;
    let blob = m.blob(t)?;
    let source = if t.1.ty == GGML_F16 {
        WeightSource::F16
    } else {
        WeightSource::Direct(t.1.ty)
    };
    Ok(WeightBlob { blob, source })
}

/// A table in a ggml row format (vcruz305): `[Hd, rows]`.
fn gguf_table(m: &Meta<'_>, name: &str, lid: u32) -> Result<TableBlobs> {
    let t = m.tensor_req(name, &format!("for engram layer {lid}"))?;
    let blob = m.blob(t)?;
    let ty = t.1.ty;
    let format = match EngramType::from_u32(ty) {
        Some(f)
            if ty != EngramType::Fp8E4m3E8m0 as u32
                && ty != EngramType::Fp8E4m3E8m0Split as u32 =>
        {
            f
        }
        _ => bail!(
            ErrUnsupported,
            "tensor {} has ggml type {ty}, which this library does not take as table rows \
             (f32, f16, bf16, q8_0, q4_0, q2_K .. q6_K)",
            t.1.name
        ),
    };
    Ok(TableBlobs {
        format,
        rows: dim(&blob, 1),
        codes: blob,
        scales: None,
    })
}

/// A split fp8 table (tarruda, JigSawPT): codes `I8 [Hd, rows]`, scales
/// `I8 [Hd/32, rows]`.
fn split_table(m: &Meta<'_>, codes: &str, scales: &str, lid: u32) -> Result<TableBlobs> {
    let c = m.tensor_req(codes, &format!("for engram layer {lid}"))?;
    let s = m.tensor_req(
        scales,
        &format!("for engram layer {lid} (its table's e8m0 scales)"),
    )?;
    for t in [c, s] {
        if t.1.ty != GGML_I8 {
            bail!(
                ErrFormat,
                "tensor {} has ggml type {}, expected i8 (fp8 {} bytes)",
                t.1.name,
                t.1.ty,
                if t.0 == c.0 && t.1.name == c.1.name {
                    "e4m3 code"
                } else {
                    "e8m0 scale"
                }
            );
        }
    }
    let (cb, sb) = (m.blob(c)?, m.blob(s)?);
    let (hd, rows) = (dim(&cb, 0), dim(&cb, 1));
    if !hd.is_multiple_of(FP8_SCALE_BLOCK as u64) || hd == 0 {
        bail!(
            ErrFormat,
            "tensor {} has rows of {hd} fp8 codes, not a positive multiple of {FP8_SCALE_BLOCK}",
            cb.name
        );
    }
    if cb.dims.len() > 2 || sb.dims.len() > 2 || dim(&sb, 0) != hd / 32 || dim(&sb, 1) != rows {
        bail!(
            ErrFormat,
            "tensor {} has shape {:?}, expected [{}, {rows}] (one e8m0 scale per {FP8_SCALE_BLOCK} of the {hd} codes \
             of each of the {rows} rows of {})",
            sb.name,
            sb.dims,
            hd / 32,
            cb.name
        );
    }
    Ok(TableBlobs {
        format: EngramType::Fp8E4m3E8m0Split,
        rows,
        codes: cb,
        scales: Some(sb),
    })
}

fn dim(b: &Blob, i: usize) -> u64 {
    b.dims.get(i).copied().unwrap_or(1)
}

fn named<T>(key: &str, value: T) -> Named<T> {
    Named {
        key: key.to_string(),
        value,
    }
}

fn keys5(p: &str, names: [&str; 5]) -> [String; 5] {
    names.map(|n| format!("{p}{n}"))
}

fn vcruz305(m: &Meta<'_>, dialect: Dialect) -> Result<Partial> {
    let arch = architecture(m.set)?;
    let own = format!("{arch}.engram.");
    // The prefix variant's keys are spelled deepseek4.engram.*; a key present
    // under both spellings is refused.
    let key = |k: &str| -> Result<String> {
        let a = format!("{own}{k}");
        if dialect == Dialect::Vcruz305 {
            return Ok(a);
        }
        let b = format!("deepseek4.engram.{k}");
        match (m.has(&a), m.has(&b)) {
            (true, true) if a != b => bail!(ErrFormat, "{a} and {b} are both present"),
            (true, _) => Ok(a),
            _ => Ok(b),
        }
    };
    let p = if dialect == Dialect::Vcruz305 {
        own.clone()
    } else {
        "deepseek4.engram.".to_string()
    };
    let layer_ids = layer_ids(m, &key("layer_ids")?)?;
    let pad = m.uint(&key("pad_id")?)?.map(|v| {
        // The early prefix converter's pad key shares its name with
        // deepstrix's raw pad: where the two readings differ, refuse.
        let r = if dialect == Dialect::Vcruz305 {
            PadReading::Compressed
        } else {
            PadReading::Ambiguous
        };
        (v, r)
    });
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |n: &str| format!("blk.{lid}.{n}");
        let w = |n: &str| weight(m, &t(n), &format!("for engram layer {lid}"));
        layers.push(PartialLayer {
            layer_id: lid,
            table: TableSpec::InFile(gguf_table(m, &t("engram_embd"), lid)?),
            wkv: w("engram_wkv")?,
            q: w("engram_q")?,
            k: w("engram_k")?,
        });
    }
    Ok(Partial {
        dialect,
        n_heads: m.uint(&key("head_count")?)?,
        max_ngram: m.uint(&key("max_ngram_size")?)?,
        hd: m.uint(&key("key_length")?)?,
        multipliers: m.ints(
            &key("multipliers")?,
            to_pos_i64,
            "a multiplier (a positive i64)",
        )?,
        primes: m.ints(&key("primes")?, to_pos_i64, "a prime (a positive i64)")?,
        offsets: m.ints(
            &key("offsets")?,
            to_pos_i64,
            "an offset (a non-negative i64)",
        )?,
        token_map: m.ints(&key("token_map")?, to_token, "a compressed id or -1")?,
        pad,
        rows: None,
        compressed_vocab: None,
        engram_vocab: None,
        d_key: None,
        hc_key: None,
        const_keys: keys5(
            &p,
            ["multipliers", "primes", "offsets", "token_map", "pad_id"],
        ),
        const_source: "gguf",
        layer_ids,
        layers,
    })
}

fn ds4(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek41.engram.";
    let k = |s: &str| format!("{p}{s}");
    if let Some(st) = m.string(&k("storage"))? {
        if st == "external" {
            bail!(
                ErrUnsupported,
                "{} is \"external\": this ds4 file keeps its tables in sidecar files ({}, at {}), \
                 in an encoding this library does not read; open the original checkpoint with \
                 engram_create_from_safetensors instead",
                k("storage"),
                k("external_paths"),
                k("external_offsets")
            );
        }
    }
    let enc_key = k("encoding");
    let enc = m.string(&enc_key)?.expect("detected by it");
    let row_bytes = enc
        .strip_prefix("e4m3_e8m0_32_row")
        .and_then(|b| b.parse::<u64>().ok())
        .ok_or_else(|| {
            Error::new(
                EngramStatus::ErrUnsupported,
                format!(
                    "{enc_key} is {enc:?}; this library reads ds4's e4m3_e8m0_32_row<B> encoding (B bytes a row: \
                     Hd e4m3 codes, then Hd/32 e8m0 scales)"
                ),
            )
        })?;
    let layer_ids = layer_ids(m, &k("layer_ids"))?;
    if row_bytes == 0 || !row_bytes.is_multiple_of(33) {
        let first = format!("blk.{}.engram_embd.weight", layer_ids.value[0]);
        let table = m
            .tensor(&first)
            .map_or(format!("{first} is missing"), |(_, t)| {
                format!("{} has rows of {} bytes", t.name, t.dims[0])
            });
        bail!(
            ErrFormat,
            "{enc_key} = {enc}: {row_bytes} bytes a row is not Hd + Hd/32 for any Hd ({table})"
        );
    }
    let hd = row_bytes / 33 * 32;
    let nl = layer_ids.value.len();
    let multipliers = m
        .ints(
            &k("multipliers"),
            to_pos_i64,
            "a multiplier (a positive i64)",
        )?
        .ok_or_else(|| fmt_err(format!("{} is missing", k("multipliers"))))?;
    let primes = m
        .ints(&k("primes"), to_pos_i64, "a prime (a positive i64)")?
        .ok_or_else(|| fmt_err(format!("{} is missing", k("primes"))))?;
    // N and H from the array lengths.
    let nm = multipliers.value.len();
    if nm == 0 || !nm.is_multiple_of(nl) || nm / nl < 2 {
        bail!(
            ErrFormat,
            "{} has {nm} entries: not a whole number (at least 2) of multipliers for each of the {nl} layers of {}",
            multipliers.key,
            layer_ids.key
        );
    }
    let n = nm / nl;
    let np = primes.value.len();
    if np == 0 || !np.is_multiple_of(nl * (n - 1)) {
        bail!(
            ErrFormat,
            "{} has {np} entries: not whole layers of (N-1) x H for {nl} layers and N = {n} (from {})",
            primes.key,
            multipliers.key
        );
    }
    let h = np / (nl * (n - 1));
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let what = format!("for engram layer {lid}");
        let e = m.tensor_req(&t("engram_embd"), &what)?;
        let blob = m.blob(e)?;
        if e.1.ty != GGML_I8 || blob.dims.len() > 2 || dim(&blob, 0) != row_bytes {
            bail!(
                ErrFormat,
                "tensor {} is {} {:?}, but {enc_key} = {enc} says rows of {row_bytes} bytes (i8 [{row_bytes}, rows])",
                blob.name,
                crate::formats::GGML_BLOCKS
                    .iter()
                    .find(|x| x.0 == e.1.ty)
                    .map_or("unknown", |x| x.1),
                blob.dims
            );
        }
        layers.push(PartialLayer {
            layer_id: lid,
            table: TableSpec::InFile(TableBlobs {
                format: EngramType::Fp8E4m3E8m0,
                rows: dim(&blob, 1),
                codes: blob,
                scales: None,
            }),
            wkv: weight(m, &t("engram_kv"), &what)?,
            q: weight(m, &t("engram_q_norm"), &what)?,
            k: weight(m, &t("engram_k_norm"), &what)?,
        });
    }
    Ok(Partial {
        dialect: Dialect::Ds4,
        n_heads: Some(named(&format!("{} (length)", primes.key), h as u64)),
        max_ngram: Some(named(&format!("{} (length)", multipliers.key), n as u64)),
        hd: Some(named(&enc_key, hd)),
        offsets: None,
        token_map: m.ints(&k("token_map"), to_token, "a compressed id or -1")?,
        pad: m.uint(&k("pad_id"))?.map(|v| (v, PadReading::Compressed)),
        rows: m.ints(&k("rows"), to_pos_i64, "a row count")?,
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: None,
        d_key: m.uint("deepseek41.hidden_size")?,
        hc_key: m.uint("deepseek41.hc_mult")?,
        const_keys: keys5(
            p,
            ["multipliers", "primes", "offsets", "token_map", "pad_id"],
        ),
        const_source: "gguf",
        multipliers: Some(multipliers),
        primes: Some(primes),
        layer_ids,
        layers,
    })
}

fn tarruda(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek41.engram.";
    let k = |s: &str| format!("{p}{s}");
    let layer_ids = layer_ids(m, &k("layers"))?;
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let what = format!("for engram layer {lid}");
        layers.push(PartialLayer {
            layer_id: lid,
            table: TableSpec::InFile(split_table(
                m,
                &t("engram_embd"),
                &t("engram_embd_scale"),
                lid,
            )?),
            wkv: weight(m, &t("engram_kv"), &what)?,
            q: weight(m, &t("engram_q_weight"), &what)?,
            k: weight(m, &t("engram_k_weight"), &what)?,
        });
    }
    Ok(Partial {
        dialect: Dialect::Tarruda,
        n_heads: Some(m.uint_req(&k("head_count"))?),
        max_ngram: Some(m.uint_req(&k("ngram_size"))?),
        hd: Some(m.uint_req(&k("head_dim"))?),
        multipliers: m.ints(
            &k("multipliers"),
            to_pos_i64,
            "a multiplier (a positive i64)",
        )?,
        primes: m.ints(
            &k("head_bucket_sizes"),
            to_pos_i64,
            "a prime (a positive i64)",
        )?,
        // tarruda's loader requires the offsets (exact prefix sums).
        offsets: Some(
            m.ints(
                &k("head_offsets"),
                to_pos_i64,
                "an offset (a non-negative i64)",
            )?
            .ok_or_else(|| fmt_err(format!("{} is missing", k("head_offsets"))))?,
        ),
        token_map: m.ints(&k("token_map"), to_token, "a compressed id or -1")?,
        pad: m.uint(&k("pad_token_id"))?.map(|v| (v, PadReading::Raw)),
        rows: m.ints(&k("embedding_counts"), to_pos_i64, "a row count")?,
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: None,
        d_key: m.uint("deepseek41.embedding_length")?,
        hc_key: m.uint("deepseek41.hyper_connection.count")?,
        const_keys: keys5(
            p,
            [
                "multipliers",
                "head_bucket_sizes",
                "head_offsets",
                "token_map",
                "pad_token_id",
            ],
        ),
        const_source: "gguf",
        layer_ids,
        layers,
    })
}

fn jigsawpt(m: &Meta<'_>) -> Result<Partial> {
    if m.boolean("deepseek41.engram.present")? == Some(false) {
        bail!(
            ErrFormat,
            "deepseek41.engram.present is false: the converter ran without its engram option, so the \
             file has no engram tables; convert again with them, or open the checkpoint with \
             engram_create_from_safetensors"
        );
    }
    let f = |s: &str| format!("deepseek41.engram_{s}");
    let layer_ids = layer_ids(m, "deepseek41.engram.layer_ids")?;
    let mut layers = Vec::new();
    for &lid in &layer_ids.value {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let what = format!("for engram layer {lid}");
        layers.push(PartialLayer {
            layer_id: lid,
            table: TableSpec::InFile(split_table(
                m,
                &t("engram_embd"),
                &t("engram_embd_scale"),
                lid,
            )?),
            wkv: weight(m, &t("engram_wkv"), &what)?,
            q: weight(m, &t("engram_q"), &what)?,
            k: weight(m, &t("engram_k"), &what)?,
        });
    }
    let cname = |s: &str| {
        // The constants are tensors, with or without `.weight`.
        let w = format!("engram_{s}.weight");
        if m.tensor(&w).is_some() {
            w
        } else {
            format!("engram_{s}")
        }
    };
    let req = |s: &str| -> Result<String> {
        let n = cname(s);
        m.tensor_req(&n, "(a hash constant of this dialect)")?;
        Ok(n)
    };
    Ok(Partial {
        dialect: Dialect::JigSawPT,
        n_heads: Some(m.uint_req(&f("n_heads"))?),
        max_ngram: Some(m.uint_req(&f("max_ngram_size"))?),
        hd: Some(m.uint_req(&f("head_dim"))?),
        multipliers: m.tensor_ints(&req("multipliers")?, to_pos_i64, "a positive i64")?,
        primes: m.tensor_ints(&req("primes")?, to_pos_i64, "a positive i64")?,
        offsets: m.tensor_ints(&req("offsets")?, to_pos_i64, "a non-negative i64")?,
        token_map: m.tensor_ints(&req("token_map")?, to_token, "a compressed id or -1")?,
        pad: Some((m.uint_req(&f("pad_token_id"))?, PadReading::Raw)),
        rows: m.ints(
            "deepseek41.engram.num_embeddings",
            to_pos_i64,
            "a row count",
        )?,
        compressed_vocab: m.uint(&f("compressed_vocab_size"))?,
        engram_vocab: m.uint(&f("vocab_size"))?,
        d_key: None,
        hc_key: None,
        const_keys: [
            cname("multipliers"),
            cname("primes"),
            cname("offsets"),
            cname("token_map"),
            f("pad_token_id"),
        ],
        const_source: "gguf tensors",
        layer_ids,
        layers,
    })
}

fn deepstrix(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek4.engram.";
    let k = |s: &str| format!("{p}{s}");
    let layer_ids = layer_ids(m, &k("layer_ids"))?;
    let shards_key = k("table_shards");
    let shards = m.strings(&shards_key)?.expect("detected by it");
    if shards.len() != layer_ids.value.len() {
        bail!(
            ErrFormat,
            "{shards_key} has {} paths for the {} engram layers of {}",
            shards.len(),
            layer_ids.value.len(),
            layer_ids.key
        );
    }
    let mut layers = Vec::new();
    for (&lid, recorded) in layer_ids.value.iter().zip(shards) {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let what = format!("for engram layer {lid}");
        layers.push(PartialLayer {
            layer_id: lid,
            table: TableSpec::External(External::Shard {
                key: shards_key.clone(),
                recorded,
                layer_id: lid,
            }),
            wkv: weight(m, &t("engram_wkv"), &what)?,
            q: weight(m, &t("engram_q"), &what)?,
            k: weight(m, &t("engram_k"), &what)?,
        });
    }
    Ok(Partial {
        dialect: Dialect::Deepstrix,
        n_heads: Some(m.uint_req(&k("head_count"))?),
        max_ngram: Some(m.uint_req(&k("max_ngram_size"))?),
        hd: Some(m.uint_req(&k("head_dim"))?),
        multipliers: None,
        primes: None,
        offsets: None,
        token_map: None,
        pad: Some((m.uint_req(&k("pad_id"))?, PadReading::Raw)),
        rows: m.ints(&k("num_embeddings"), to_pos_i64, "a row count")?,
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: Some(m.uint_req(&k("vocab_size"))?),
        d_key: m.uint("deepseek4.embedding_length")?,
        hc_key: m.uint("deepseek4.hyper_connection.count")?,
        const_keys: [
            "multipliers".into(),
            "primes".into(),
            "offsets".into(),
            "token_map".into(),
            k("pad_id"),
        ],
        const_source: "gguf",
        layer_ids,
        layers,
    })
}

fn ds4gw(m: &Meta<'_>) -> Result<Partial> {
    let p = "deepseek4.engram.";
    let k = |s: &str| format!("{p}{s}");
    let layer_ids = layer_ids(m, &k("layer_ids"))?;
    let rows = m
        .ints(&k("num_embeddings"), to_pos_i64, "a row count")?
        .ok_or_else(|| fmt_err(format!("{} is missing", k("num_embeddings"))))?;
    if rows.value.len() != layer_ids.value.len() {
        bail!(
            ErrFormat,
            "{} has {} entries for the {} engram layers of {}",
            rows.key,
            rows.value.len(),
            layer_ids.value.len(),
            layer_ids.key
        );
    }
    let mut layers = Vec::new();
    for (i, &lid) in layer_ids.value.iter().enumerate() {
        let t = |s: &str| format!("blk.{lid}.{s}.weight");
        let what = format!("for engram layer {lid}");
        let path_key = k(&format!("{i}.table_path"));
        let weight_key = k(&format!("{i}.weight_offset"));
        let scale_key = k(&format!("{i}.scale_offset"));
        let recorded = m
            .string(&path_key)?
            .ok_or_else(|| fmt_err(format!("{path_key} is missing")))?;
        layers.push(PartialLayer {
            layer_id: lid,
            table: TableSpec::External(External::Offsets {
                recorded,
                layer_id: lid,
                weight_offset: m.uint_req(&weight_key)?.value,
                scale_offset: m.uint_req(&scale_key)?.value,
                rows: rows.value[i],
                path_key,
                weight_key,
                scale_key,
            }),
            wkv: weight(m, &t("engram_wkv"), &what)?,
            q: weight(m, &t("engram_q"), &what)?,
            k: weight(m, &t("engram_k"), &what)?,
        });
    }
    let c = |s: &str| format!("engram.{s}");
    let req = |s: &str| -> Result<String> {
        m.tensor_req(&c(s), "(a hash constant of this dialect)")?;
        Ok(c(s))
    };
    Ok(Partial {
        dialect: Dialect::Ds4gw,
        n_heads: Some(m.uint_req(&k("head_count"))?),
        max_ngram: Some(m.uint_req(&k("max_ngram_size"))?),
        hd: Some(m.uint_req(&k("head_dim"))?),
        multipliers: m.tensor_ints(&req("multipliers")?, to_pos_i64, "a positive i64")?,
        primes: m.tensor_ints(&req("primes")?, to_pos_i64, "a positive i64")?,
        offsets: m.tensor_ints(&req("offsets")?, to_pos_i64, "a non-negative i64")?,
        token_map: m.tensor_ints(&req("token_map")?, to_token, "a compressed id or -1")?,
        pad: Some((m.uint_req(&k("pad_id_compressed"))?, PadReading::Compressed)),
        rows: Some(rows),
        compressed_vocab: m.uint(&k("compressed_vocab_size"))?,
        engram_vocab: None,
        d_key: None,
        hc_key: None,
        const_keys: [
            c("multipliers"),
            c("primes"),
            c("offsets"),
            c("token_map"),
            k("pad_id_compressed"),
        ],
        const_source: "gguf tensors",
        layer_ids,
        layers,
    })
}

impl Partial {
    /// Complete the model: geometry (keys, else the companion config), hash
    /// constants (the file's, the companion's, or derived from the file's
    /// config keys and a tokenizer), the pad, and every tensor's shape.
    /// `tables` holds each layer's table (the file's, or an external one the
    /// loader resolved), in layer order. Runs no cross-checks of the hash
    /// layout: [`EngramModel::check`] does.
    pub fn finish(self, tables: Vec<TableBlobs>, comp: Companions<'_>) -> Result<EngramModel> {
        let nl = self.layer_ids.value.len();
        let cfg = comp.tables.map(|t| &t.config);
        // Geometry keys: the file's, else the companion config's.
        let geo = |v: &Option<Named<u64>>, from_cfg: Option<usize>| {
            v.as_ref().map(|n| n.value).or(from_cfg.map(|x| x as u64))
        };
        let (n_heads, max_ngram) = match (
            geo(&self.n_heads, cfg.map(|c| c.n_heads)),
            geo(&self.max_ngram, cfg.map(|c| c.max_ngram)),
        ) {
            (Some(h), Some(n)) => (h, n),
            (h, n) => {
                let p = match self.dialect {
                    Dialect::Vcruz305Prefix => "deepseek4.engram.".to_string(),
                    _ => self
                        .layer_ids
                        .key
                        .rsplit_once('.')
                        .map_or(String::new(), |x| format!("{}.", x.0)),
                };
                let missing: Vec<String> = [("head_count", h), ("max_ngram_size", n)]
                    .iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(k, _)| format!("{p}{k}"))
                    .collect();
                bail!(
                    ErrFormat,
                    "the file lacks {} and no config.json was given",
                    missing.join(", ")
                );
            }
        };
        let name = |v: &Option<Named<u64>>, dflt: &str| {
            v.as_ref().map_or(dflt.to_string(), |n| n.key.clone())
        };
        if !(2..=64).contains(&max_ngram) || !(1..=1024).contains(&n_heads) {
            bail!(
                ErrFormat,
                "{} = {max_ngram}, {} = {n_heads}: out of range (N 2 to 64, H 1 to 1024)",
                name(&self.max_ngram, "max n-gram size"),
                name(&self.n_heads, "head count")
            );
        }
        let (n, h) = (max_ngram as usize, n_heads as usize);
        let cols = (n - 1) * h;
        let len_check = |v: &Option<Named<Vec<u64>>>, want: usize, what: &str| -> Result<()> {
            if let Some(x) = v {
                if x.value.len() != want {
                    bail!(
                        ErrFormat,
                        "{} has {} entries, expected {want} ({what})",
                        x.key,
                        x.value.len()
                    );
                }
            }
            Ok(())
        };
        len_check(&self.multipliers, nl * n, &format!("{nl} layers x N = {n}"))?;
        len_check(
            &self.primes,
            nl * cols,
            &format!("{nl} layers x C = {cols}"),
        )?;
        len_check(
            &self.offsets,
            nl * cols,
            &format!("{nl} layers x C = {cols}"),
        )?;
        len_check(
            &self.rows,
            nl,
            &format!("one per engram layer of {}", self.layer_ids.key),
        )?;
        if let Some(t) = &self.token_map {
            if t.value.is_empty() {
                bail!(ErrFormat, "{} is empty", t.key);
            }
        }

        // The hash constants.
        let consts = self.constants(comp, n, h)?;

        // Geometry from the tensors.
        let first = self.layers.first().expect("at least one layer");
        let (d, hc) = (dim(&first.q.blob, 0), dim(&first.q.blob, 1));
        let hd = match &self.hd {
            Some(x) => x.value,
            None => match (cfg.and_then(|c| c.head_dim), tables.first()) {
                (Some(x), _) => x as u64,
                (None, Some(t)) => dim(&t.codes, 0),
                (None, None) => bail!(ErrFormat, "no table to take the row width from"),
            },
        };
        for (v, what, got) in [(&self.d_key, "D", d), (&self.hc_key, "hc", hc)] {
            if let Some(k) = v {
                if k.value != got {
                    bail!(
                        ErrFormat,
                        "{} = {}, but tensor {} has shape {:?} ([D, hc]: {what} = {got})",
                        k.key,
                        k.value,
                        first.q.blob.name,
                        first.q.blob.dims
                    );
                }
            }
        }
        if d == 0 || hc == 0 || hd == 0 || d > 1 << 20 || hc > 64 || hd > 1 << 16 {
            bail!(
                ErrFormat,
                "geometry D = {d}, hc = {hc} (from {}) and Hd = {hd} (from {}) out of range",
                first.q.blob.name,
                name(&self.hd, "the tables")
            );
        }
        let (d, hc, hd) = (d as usize, hc as usize, hd as usize);
        // Shapes of every layer's tensors.
        let two = |b: &Blob, ne0: u64, ne1: Option<u64>, what: &str| -> Result<()> {
            if b.dims.iter().skip(2).any(|&x| x != 1)
                || dim(b, 0) != ne0
                || ne1.is_some_and(|r| dim(b, 1) != r)
            {
                bail!(
                    ErrFormat,
                    "tensor {} has shape {:?}, expected [{ne0}, {}] (ggml order; {what}) for D = {d}, hc = {hc}, \
                     Hd = {hd}, C = {cols}",
                    b.name,
                    b.dims,
                    ne1.map_or("rows".into(), |r| r.to_string())
                );
            }
            Ok(())
        };
        let mut out_layers = Vec::with_capacity(nl);
        if tables.len() != nl {
            bail!(ErrInternal, "{} tables for {nl} layers", tables.len());
        }
        for (l, table) in self.layers.into_iter().zip(tables) {
            two(&l.q.blob, d as u64, Some(hc as u64), "q [hc, D]")?;
            two(&l.k.blob, d as u64, Some(hc as u64), "k [hc, D]")?;
            two(
                &l.wkv.blob,
                (cols * hd) as u64,
                Some(((hc + 1) * d) as u64),
                "wkv [D*(hc+1), C*Hd]",
            )?;
            let ne0 = match table.format {
                EngramType::Fp8E4m3E8m0 => (hd + hd / FP8_SCALE_BLOCK) as u64,
                _ => hd as u64,
            };
            two(&table.codes, ne0, Some(table.rows), "table [Hd, rows]").map_err(|e| {
                // Name the key the row width came from.
                Error::new(
                    e.status,
                    format!("{} (Hd from {})", e.message, name(&self.hd, "the tables")),
                )
            })?;
            EngramType::row_format(table.format as u32, hd).map_err(|e| {
                Error::new(e.status, format!("{}: {}", table.codes.name, e.message))
            })?;
            if l.q.source != l.k.source {
                bail!(
                    ErrFormat,
                    "{} and {} have different types",
                    l.q.blob.name,
                    l.k.blob.name
                );
            }
            out_layers.push(EngramTensors {
                layer_id: l.layer_id,
                table,
                wkv: l.wkv,
                q: l.q,
                k: l.k,
            });
        }
        let Consts {
            token_map,
            pad,
            multipliers,
            primes,
            offsets,
            offsets_stored,
            source,
            keys,
        } = consts;
        Ok(EngramModel {
            dialect: self.dialect,
            d,
            hc,
            hd,
            layer_ids: self.layer_ids.value,
            max_ngram: n,
            n_heads: h,
            token_map,
            pad_id: pad.compressed,
            pad,
            multipliers,
            primes,
            offsets,
            offsets_stored,
            stated_rows: self.rows.map(|r| r.value),
            compressed_vocab: self.compressed_vocab.map(|c| c.value),
            hash_source: source,
            keys,
            layers: out_layers,
        })
    }

    /// The hash constants, from the file, the companion files, or derived.
    fn constants(&self, comp: Companions<'_>, n: usize, h: usize) -> Result<Consts> {
        let cols = (n - 1) * h;
        let ck = &self.const_keys;
        let have = [
            self.multipliers.is_some(),
            self.primes.is_some(),
            self.offsets.is_some(),
            self.token_map.is_some(),
            self.pad.is_some(),
        ];
        // Offsets may be absent (prefix sums); the other four make the hash.
        let complete = have[0] && have[1] && have[3] && have[4];
        let any = have[0] || have[1] || have[2] || have[3];
        let mut keys = Keys {
            layer_ids: self.layer_ids.key.clone(),
            multipliers: ck[0].clone(),
            primes: ck[1].clone(),
            offsets: ck[2].clone(),
            token_map: ck[3].clone(),
            rows: self.rows.as_ref().map(|r| r.key.clone()),
            compressed_vocab: self.compressed_vocab.as_ref().map(|c| c.key.clone()),
        };
        // What a config + tokenizer (or a tokenizer and the file's own config
        // keys) derive, when given.
        let derived: Option<std::borrow::Cow<'_, EngramTables>> =
            match (comp.tables, comp.token_map) {
                (Some(t), _) => Some(std::borrow::Cow::Borrowed(t)),
                (None, Some(tm)) if !complete => {
                    Some(std::borrow::Cow::Owned(self.derive(tm, n, h)?))
                }
                _ => None,
            };
        if let (Some(d), true) = (&derived, comp.tables.is_some()) {
            // A config.json given alongside must describe the same geometry.
            let c = &d.config;
            if c.layer_ids != self.layer_ids.value || c.max_ngram != n || c.n_heads != h {
                bail!(
                    ErrInvalidConfig,
                    "config.json describes layers {:?}, N = {}, H = {}; the file has {:?}, N = {n}, H = {h}",
                    c.layer_ids,
                    c.max_ngram,
                    c.n_heads,
                    self.layer_ids.value
                );
            }
        }
        if let Some(tm) = comp.token_map {
            if let Some(f) = &self.token_map {
                if f.value != tm.map {
                    bail!(
                        ErrInvalidConfig,
                        "{} differs from the token map of the tokenizer.json given",
                        f.key
                    );
                }
            }
        }
        let (token_map, multipliers, primes, offsets, offsets_stored, source, pad_from_derived);
        if complete {
            let mult = self.multipliers.as_ref().expect("complete").value.clone();
            let pr = self.primes.as_ref().expect("complete").value.clone();
            let (offs, stored) = match &self.offsets {
                Some(o) => (o.value.clone(), true),
                None => (derive_offsets(&pr, cols), false),
            };
            let tm = self.token_map.as_ref().expect("complete").value.clone();
            if let Some(d) = &derived {
                let differs: Vec<&str> = [
                    (ck[0].as_str(), d.multipliers != mult),
                    (ck[1].as_str(), d.primes != pr),
                    (ck[2].as_str(), stored && d.offsets != offs),
                    (ck[3].as_str(), d.token_map != tm),
                ]
                .into_iter()
                .filter(|(_, x)| *x)
                .map(|(k, _)| k)
                .collect();
                if !differs.is_empty() {
                    bail!(
                        ErrInvalidConfig,
                        "the file's {} differ from those derived from the config.json + tokenizer.json given alongside",
                        differs.join(", ")
                    );
                }
            }
            token_map = tm;
            multipliers = mult;
            primes = pr;
            offsets = offs;
            offsets_stored = stored;
            source = self.const_source;
            pad_from_derived = derived.as_ref().map(|d| d.pad_id);
        } else {
            let missing: Vec<&str> = ck
                .iter()
                .zip(have)
                .filter(|(_, h)| !h)
                .map(|(k, _)| k.as_str())
                .collect();
            let Some(d) = derived else {
                if any {
                    bail!(
                        ErrFormat,
                        "the file has some hash constants but lacks {}; pass the model's config.json and \
                         tokenizer.json to derive them",
                        missing.join(", ")
                    );
                }
                if self.dialect == Dialect::Deepstrix {
                    bail!(
                        ErrInvalidConfig,
                        "a deepstrix file carries no hash constants (no token map, multipliers, primes or offsets): \
                         pass the model's tokenizer.json (engram_gguf_options.tokenizer_json, or a tokenizer.json \
                         in tables_dir) to derive them from the file's {} keys",
                        self.layer_ids.key.trim_end_matches("layer_ids")
                    );
                }
                bail!(
                    ErrInvalidConfig,
                    "the file lacks the hash constants {}: pass the model's config.json and tokenizer.json to derive them",
                    missing.join(", ")
                );
            };
            // The constants the file has must agree with the derived ones.
            let check = |v: &Option<Named<Vec<u64>>>, want: &[u64]| -> Result<()> {
                if let Some(x) = v {
                    if x.value != want {
                        bail!(
                            ErrInvalidConfig,
                            "{} in the file differs from the one derived from config.json + tokenizer.json",
                            x.key
                        );
                    }
                }
                Ok(())
            };
            check(&self.multipliers, &d.multipliers)?;
            check(&self.primes, &d.primes)?;
            check(&self.offsets, &d.offsets)?;
            token_map = d.token_map.clone();
            multipliers = d.multipliers.clone();
            primes = d.primes.clone();
            offsets = d.offsets.clone();
            offsets_stored = false;
            source = if comp.tables.is_some() {
                "config+tokenizer"
            } else {
                "tokenizer+file keys"
            };
            keys.multipliers = format!("multipliers (derived, {source})");
            keys.primes = format!("primes (derived, {source})");
            keys.offsets = format!("offsets (derived, {source})");
            keys.token_map = format!("token_map (derived, {source})");
            pad_from_derived = Some(d.pad_id);
        }
        let pad = self.pad(&token_map, pad_from_derived)?;
        Ok(Consts {
            token_map,
            pad,
            multipliers,
            primes,
            offsets,
            offsets_stored,
            source,
            keys,
        })
    }

    /// Hash tables from a tokenizer's map and the file's own config keys.
    fn derive(&self, tm: &TokenMap, n: usize, h: usize) -> Result<EngramTables> {
        let Some(ev) = &self.engram_vocab else {
            bail!(
                ErrInvalidConfig,
                "a tokenizer alone cannot complete this file: it has no engram vocabulary size key to derive \
                 the primes from; pass its config.json too"
            );
        };
        let Some((pad, reading)) = &self.pad else {
            bail!(ErrFormat, "the file has no pad key");
        };
        if *reading != PadReading::Raw {
            bail!(
                ErrInvalidConfig,
                "a tokenizer alone cannot complete this file: pass its config.json too"
            );
        }
        let config = EngramConfig {
            layer_ids: self.layer_ids.value.clone(),
            max_ngram: n,
            n_heads: h,
            vocab_per_ngram: vec![ev.value; n - 1],
            pad_token_id: u32::try_from(pad.value).map_err(|_| {
                fmt_err(format!(
                    "{} = {} does not fit a token id",
                    pad.key, pad.value
                ))
            })?,
            seed: 0,
            head_dim: self.hd.as_ref().map(|x| x.value as usize),
            hidden_size: self.d_key.as_ref().map(|x| x.value as usize),
            hc: self.hc_key.as_ref().map(|x| x.value as usize),
            num_embeddings: None,
            compressed_vocab: None,
            weight_block_size: None,
        };
        if let Some(cv) = &self.compressed_vocab {
            if cv.value != tm.compressed as u64 {
                bail!(
                    ErrInvalidConfig,
                    "{} = {}, but the tokenizer.json given compresses to {} ids: a different tokenizer than the model's?",
                    cv.key,
                    cv.value,
                    tm.compressed
                );
            }
        }
        EngramTables::derive(config, tm.clone())
    }

    /// The compressed pad, read as the dialect stores it; `from_companion`
    /// is the pad the companion files give, which it must equal.
    fn pad(&self, token_map: &[i32], from_companion: Option<i64>) -> Result<PadInfo> {
        let Some((p, reading)) = &self.pad else {
            // No pad key (derived constants only): the companion's.
            let c = from_companion.ok_or_else(|| fmt_err("no pad key and no config".into()))?;
            return Ok(PadInfo {
                key: "pad (derived)".into(),
                stored: c as u64,
                reading: PadReading::Compressed,
                compressed: c,
                how: "from the config.json + tokenizer.json given".into(),
            });
        };
        let v = p.value;
        let as_raw = || -> Result<i64> {
            let Some(&c) = usize::try_from(v).ok().and_then(|i| token_map.get(i)) else {
                bail!(
                    ErrFormat,
                    "{} = {v} is a raw token id outside the token map's {} tokens",
                    p.key,
                    token_map.len()
                );
            };
            if c < 0 {
                bail!(
                    ErrFormat,
                    "{} = {v} is a raw token id that the token map leaves out (-1)",
                    p.key
                );
            }
            Ok(c as i64)
        };
        let as_compressed = || -> Result<i64> {
            i64::try_from(v)
                .ok()
                .filter(|&c| c <= i32::MAX as i64)
                .ok_or_else(|| fmt_err(format!("{} = {v} is not a compressed id", p.key)))
        };
        let (compressed, how) = match reading {
            PadReading::Compressed => (
                as_compressed()?,
                "a compressed id in this dialect".to_string(),
            ),
            PadReading::Raw => (
                as_raw()?,
                format!("a raw token id in this dialect: token_map[{v}]"),
            ),
            PadReading::Ambiguous => {
                let c = as_compressed()?;
                let r = as_raw().ok();
                match (r, from_companion) {
                    (Some(r), _) if r == c => (
                        c,
                        format!("ambiguous in this dialect; both readings give {c} (token_map[{v}] = {v})"),
                    ),
                    (_, Some(x)) if x == c => (c, "ambiguous in this dialect; the config + tokenizer say compressed".into()),
                    (Some(r), Some(x)) if x == r => (r, format!("ambiguous in this dialect; the config + tokenizer say raw: token_map[{v}]")),
                    (r, _) => bail!(
                        ErrInvalidConfig,
                        "{} = {v} is ambiguous in this dialect (the same key holds a compressed id in vcruz305's files \
                         and a raw token id in deepstrix's): read as a compressed id the pad is {c}, read as a raw \
                         token id it is {}; the two differ, so the loader will not guess: pass the model's \
                         config.json and tokenizer.json to decide",
                        p.key,
                        r.map_or("outside the token map".into(), |r| format!("token_map[{v}] = {r}"))
                    ),
                }
            }
        };
        if let Some(x) = from_companion {
            if x != compressed {
                bail!(
                    ErrInvalidConfig,
                    "{} = {v} gives the compressed pad {compressed} ({how}), but the config.json + tokenizer.json \
                     given give {x}",
                    p.key
                );
            }
        }
        Ok(PadInfo {
            key: p.key.clone(),
            stored: v,
            reading: *reading,
            compressed,
            how,
        })
    }
}

struct Consts {
    token_map: Vec<i32>,
    pad: PadInfo,
    multipliers: Vec<u64>,
    primes: Vec<u64>,
    offsets: Vec<u64>,
    offsets_stored: bool,
    source: &'static str,
    keys: Keys,
}
