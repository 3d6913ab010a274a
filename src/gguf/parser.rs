//! A bounds-checked GGUF header parser over a byte slice.
//!
//! The parser never reads past the slice and never allocates more than the
//! slice could describe (every count is checked against the bytes left before
//! anything is reserved), so a truncated, corrupt or hostile file gives an
//! error status, not a crash: `ErrFormat` for a file that is not valid GGUF
//! (wrong magic, truncated, tensors outside the file or overlapping, metadata
//! of the wrong type), `ErrUnsupported` for a valid file this build cannot use
//! (GGUF version other than 2 or 3, big-endian, a tensor type unknown to it).

use crate::error::{bail, Error, Result};
use crate::EngramStatus;
use std::collections::HashMap;

/// `"GGUF"` as a little-endian u32.
const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: usize = 4;
/// Nesting depth accepted for arrays of arrays.
const MAX_ARRAY_DEPTH: usize = 4;

// GGUF metadata value types.
pub(crate) const VT_U8: u32 = 0;
pub(crate) const VT_I8: u32 = 1;
pub(crate) const VT_U16: u32 = 2;
pub(crate) const VT_I16: u32 = 3;
pub(crate) const VT_U32: u32 = 4;
pub(crate) const VT_I32: u32 = 5;
pub(crate) const VT_F32: u32 = 6;
pub(crate) const VT_BOOL: u32 = 7;
pub(crate) const VT_STRING: u32 = 8;
pub(crate) const VT_ARRAY: u32 = 9;
pub(crate) const VT_U64: u32 = 10;
pub(crate) const VT_I64: u32 = 11;
pub(crate) const VT_F64: u32 = 12;

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

/// `(values per block, bytes per block)` of ggml type `t` ([`crate::formats::GGML_BLOCKS`]).
pub fn ggml_type_size(t: u32) -> Option<(u64, u64)> {
    crate::formats::ggml_block(t).map(|(v, b)| (v as u64, b as u64))
}

pub(crate) fn fmt_err(msg: String) -> Error {
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
