//! A bounds-checked GGUF header parser over a byte slice.
//!
//! The parser never reads past the slice and never allocates more than the
//! slice could describe (every count is checked against the bytes left before
//! anything is reserved), so a truncated, corrupt or hostile file gives an
//! error status, not a crash: `ErrFormat` for a file that is not valid GGUF
//! (wrong magic, truncated, tensors outside the file or overlapping, sizes
//! that overflow, metadata of the wrong type), `ErrUnsupported` for a valid
//! file this build cannot use (GGUF version other than 2 or 3, big-endian).
//!
//! Metadata arrays are not copied: an [`ArrayRef`] is the element type, the
//! count and the byte range of the elements in the header, read on demand
//! (a tokenizer's 20 MB array costs 32 bytes here, not a `Vec` of values).
//! Every size computed from the file uses checked arithmetic.

use crate::error::{bail, Error, Result};
use crate::EngramStatus;
use std::collections::HashMap;

/// `"GGUF"` as a little-endian u32.
const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub(crate) const DEFAULT_ALIGNMENT: u64 = 32;
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

/// Bytes of one element of a fixed-size value type (`None` for strings and arrays).
fn fixed_size(t: u32) -> Option<usize> {
    match t {
        VT_U8 | VT_I8 | VT_BOOL => Some(1),
        VT_U16 | VT_I16 => Some(2),
        VT_U32 | VT_I32 | VT_F32 => Some(4),
        VT_U64 | VT_I64 | VT_F64 => Some(8),
        _ => None,
    }
}

/// Whether `t` is an integer type.
pub fn is_int_type(t: u32) -> bool {
    matches!(
        t,
        VT_U8 | VT_I8 | VT_U16 | VT_I16 | VT_U32 | VT_I32 | VT_U64 | VT_I64
    )
}

/// The value of one little-endian integer of type `t` (an integer type).
fn int_at(s: &[u8], t: u32) -> i128 {
    let mut b = [0u8; 16];
    b[..s.len()].copy_from_slice(s);
    let signed = matches!(t, VT_I8 | VT_I16 | VT_I32 | VT_I64);
    if signed && s[s.len() - 1] & 0x80 != 0 {
        b[s.len()..].fill(0xFF);
    }
    i128::from_le_bytes(b)
}

/// A metadata value. Integers of every width are held as `i128`; the GGUF
/// type is kept beside them ([`Kv::ty`]). Arrays stay in the header bytes.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(ArrayRef),
}

/// An array in the header: its element type, count and the byte range of its
/// elements (`start..end` in the bytes the header was parsed from). The
/// parser checked every element (strings' lengths and UTF-8, nested arrays).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArrayRef {
    pub et: u32,
    pub len: u64,
    pub start: usize,
    pub end: usize,
}

impl ArrayRef {
    /// The elements as integers (an integer element type), from the header
    /// bytes `b` the array was parsed from.
    pub fn ints<'b>(&self, b: &'b [u8]) -> Option<impl Iterator<Item = i128> + 'b> {
        let sz = fixed_size(self.et).filter(|_| is_int_type(self.et))?;
        let et = self.et;
        Some(
            b.get(self.start..self.end)?
                .chunks_exact(sz)
                .map(move |c| int_at(c, et)),
        )
    }

    /// The elements as strings (a string element type).
    pub fn strs<'b>(&self, b: &'b [u8]) -> Option<impl Iterator<Item = &'b str> + 'b> {
        if self.et != VT_STRING {
            return None;
        }
        let mut s = b.get(self.start..self.end)?;
        // The parser checked every string of the array in these bytes; other
        // bytes end the iteration early instead of panicking.
        Some(std::iter::from_fn(move || {
            let n = u64::from_le_bytes(s.get(..8)?.try_into().ok()?);
            let end = usize::try_from(n).ok()?.checked_add(8)?;
            let v = std::str::from_utf8(s.get(8..end)?).ok()?;
            s = &s[end..];
            Some(v)
        }))
    }
}

/// One metadata entry.
#[derive(Clone, Debug, PartialEq)]
pub struct Kv {
    pub key: String,
    pub ty: u32,
    pub value: Value,
    /// Offset of the entry's type field in the header (for tools and tests).
    pub type_at: usize,
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
    /// Offset of the entry's dimension count in the header (for tools and tests).
    pub entry_at: usize,
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
    /// Bytes of the header proper (before the padding to `data_offset`).
    pub header_len: usize,
    index: HashMap<String, usize>,
    keys: HashMap<String, usize>,
}

/// `(values per block, bytes per block)` of ggml type `t` ([`crate::formats::GGML_BLOCKS`]).
pub fn ggml_type_size(t: u32) -> Option<(u64, u64)> {
    crate::formats::ggml_block(t).map(|(v, b)| (v as u64, b as u64))
}

/// Bytes of a tensor of `dims` (ggml order) of ggml type `ty`: `None` for a
/// type this build does not know; an `ErrFormat` error for a row that is not
/// whole blocks or a size that overflows.
pub fn tensor_bytes(name: &str, dims: &[u64], ty: u32) -> Result<Option<u64>> {
    let n = dims
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .filter(|&n| n < 1 << 62)
        .ok_or_else(|| fmt_err(format!("tensor {name}: dimensions {dims:?} overflow")))?;
    let Some((bl, bb)) = ggml_type_size(ty) else {
        return Ok(None);
    };
    if dims.first().is_some_and(|d| d % bl != 0) {
        bail!(
            ErrFormat,
            "tensor {name}: a row of {} values is not whole blocks of {bl} (type {ty})",
            dims[0]
        );
    }
    match (n / bl).checked_mul(bb) {
        Some(b) => Ok(Some(b)),
        None => bail!(
            ErrFormat,
            "tensor {name}: {n} elements of type {ty} ({bb} bytes per {bl}) overflow a 64-bit size"
        ),
    }
}

/// Entries reserved before any is parsed: the rest grow as they are parsed.
const FIRST_RESERVE: u64 = 1024;

fn oom(what: &str) -> Error {
    Error::new(
        EngramStatus::ErrCapacity,
        format!("out of memory for the GGUF header's {what}"),
    )
}

/// An empty vector with room for the first entries of a count (fallible).
fn room<T>(n: u64, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n.min(FIRST_RESERVE) as usize)
        .map_err(|_| oom(what))?;
    Ok(v)
}

fn map_room<V>(n: u64, what: &str) -> Result<HashMap<String, V>> {
    let mut m = HashMap::new();
    m.try_reserve(n.min(FIRST_RESERVE) as usize)
        .map_err(|_| oom(what))?;
    Ok(m)
}

/// Room for one more entry, fallibly (amortised doubling).
fn grow<T>(v: &mut Vec<T>, what: &str) -> Result<()> {
    v.try_reserve(1).map_err(|_| oom(what))
}

fn grow_map<V>(m: &mut HashMap<String, V>, what: &str) -> Result<()> {
    m.try_reserve(1).map_err(|_| oom(what))
}

/// A string read from the file, copied fallibly.
fn try_clone(s: &str) -> Result<String> {
    let mut o = String::new();
    o.try_reserve_exact(s.len()).map_err(|_| oom("strings"))?;
    o.push_str(s);
    Ok(o)
}

pub(crate) fn fmt_err(msg: String) -> Error {
    Error::new(EngramStatus::ErrFormat, msg)
}

/// A cursor over the header bytes; every read is checked. `truncated` is
/// set when a read needed bytes past the slice (more of the file may hold them).
struct Cur<'a> {
    b: &'a [u8],
    pos: usize,
    truncated: bool,
}

impl<'a> Cur<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }

    fn short(&mut self, msg: String) -> Error {
        self.truncated = true;
        fmt_err(msg)
    }

    fn take(&mut self, n: usize, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.left() {
            let msg = format!(
                "truncated GGUF header: {} needs {n} bytes at offset {}, the file has {} left",
                what(),
                self.pos,
                self.left()
            );
            return Err(self.short(msg));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes(s.try_into().expect("4 bytes")))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        let s = self.take(8, what)?;
        Ok(u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }

    /// A string's bytes, checked to be UTF-8.
    fn str_bytes(&mut self, what: &dyn Fn() -> String) -> Result<&'a str> {
        let n = self.u64(what)?;
        if n > self.left() as u64 {
            let msg = format!(
                "truncated GGUF header: {} is a string of {n} bytes at offset {}, the file has {} left",
                what(),
                self.pos,
                self.left()
            );
            return Err(self.short(msg));
        }
        let s = self.take(n as usize, what)?;
        std::str::from_utf8(s).map_err(|_| fmt_err(format!("{} is not valid UTF-8", what())))
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        try_clone(self.str_bytes(what)?)
    }

    /// Smallest encoding of one value of type `t` (to bound array counts).
    fn min_size(t: u32) -> usize {
        fixed_size(t).unwrap_or(match t {
            VT_STRING => 8,
            _ => 12, // array: element type + count
        })
    }

    /// Skip one element of type `t` (checking it).
    fn skip(&mut self, t: u32, depth: usize, what: &dyn Fn() -> String) -> Result<()> {
        match t {
            VT_STRING => {
                self.str_bytes(what)?;
            }
            VT_ARRAY => {
                self.array(depth, what)?;
            }
            VT_BOOL => {
                let b = self.take(1, what)?[0];
                if b > 1 {
                    bail!(ErrFormat, "{}: bool value {b}", what());
                }
            }
            t => {
                let n = fixed_size(t)
                    .ok_or_else(|| fmt_err(format!("{}: unknown value type {t}", what())))?;
                self.take(n, what)?;
            }
        }
        Ok(())
    }

    fn array(&mut self, depth: usize, what: &dyn Fn() -> String) -> Result<ArrayRef> {
        if depth >= MAX_ARRAY_DEPTH {
            bail!(
                ErrFormat,
                "{}: arrays nested deeper than {MAX_ARRAY_DEPTH}",
                what()
            );
        }
        let et = self.u32(what)?;
        if et > VT_F64 {
            bail!(ErrFormat, "{}: unknown array element type {et}", what());
        }
        let n = self.u64(what)?;
        if n > (self.left() / Self::min_size(et)) as u64 {
            let msg = format!(
                "truncated GGUF header: {} is an array of {n} {} at offset {}, the file has {} bytes left",
                what(),
                vt_name(et),
                self.pos,
                self.left()
            );
            return Err(self.short(msg));
        }
        let start = self.pos;
        match fixed_size(et) {
            Some(sz) if et != VT_BOOL => {
                self.take(n as usize * sz, what)?;
            }
            _ => {
                for _ in 0..n {
                    self.skip(et, depth + 1, what)?;
                }
            }
        }
        Ok(ArrayRef {
            et,
            len: n,
            start,
            end: self.pos,
        })
    }

    fn value(&mut self, t: u32, what: &dyn Fn() -> String) -> Result<Value> {
        Ok(match t {
            _ if is_int_type(t) => {
                let sz = fixed_size(t).expect("integer types are fixed-size");
                Value::Int(int_at(self.take(sz, what)?, t))
            }
            VT_F32 => Value::Float(f32::from_le_bytes(
                self.take(4, what)?.try_into().expect("4 bytes"),
            ) as f64),
            VT_F64 => Value::Float(f64::from_le_bytes(
                self.take(8, what)?.try_into().expect("8 bytes"),
            )),
            VT_BOOL => match self.take(1, what)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(fmt_err(format!("{}: bool value {b}", what()))),
            },
            VT_STRING => Value::Str(self.string(what)?),
            VT_ARRAY => Value::Array(self.array(0, what)?),
            _ => return Err(fmt_err(format!("{}: unknown value type {t}", what()))),
        })
    }
}

/// Why [`Gguf::parse_header`] failed.
#[derive(Debug)]
pub enum HeaderError {
    /// The header runs past the bytes given (more of the file may hold it).
    Truncated(Error),
    /// The file is bad.
    Bad(Error),
}

impl HeaderError {
    pub fn into_error(self) -> Error {
        match self {
            HeaderError::Truncated(e) | HeaderError::Bad(e) => e,
        }
    }
}

impl Gguf {
    /// Parse the header of a whole GGUF file held in `b`, and check every
    /// tensor's data against the file: inside it, aligned, and not
    /// overlapping the next tensor (so a shape that disagrees with the data
    /// written is caught).
    pub fn parse(b: &[u8]) -> Result<Gguf> {
        Self::parse_header(b, b.len() as u64).map_err(HeaderError::into_error)
    }

    /// Parse a header from `b`, the first bytes of a file of `file_len` bytes
    /// (`b` may stop anywhere after the header), checking the tensors against
    /// `file_len`. [`HeaderError::Truncated`] when the header needs more
    /// bytes than `b` holds.
    pub fn parse_header(b: &[u8], file_len: u64) -> std::result::Result<Gguf, HeaderError> {
        let mut c = Cur {
            b,
            pos: 0,
            truncated: false,
        };
        match Self::parse_impl(&mut c, file_len) {
            Ok(g) => Ok(g),
            Err(e) if c.truncated && (b.len() as u64) < file_len => Err(HeaderError::Truncated(e)),
            Err(e) => Err(HeaderError::Bad(e)),
        }
    }

    fn parse_impl(c: &mut Cur<'_>, len: u64) -> Result<Gguf> {
        let version = Self::magic_and_version(c)?;
        let (n_tensors, n_kv) = Self::counts(c)?;
        let (kvs, keys) = Self::metadata(c, n_kv)?;
        let alignment = Self::alignment(&kvs, &keys)?;
        let (mut tensors, index) = Self::tensor_infos(c, n_tensors)?;
        let header_len = c.pos;
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        Self::place_tensors(&mut tensors, data_offset, alignment, len)?;
        Self::check_no_overlap(&tensors)?;
        Ok(Gguf {
            version,
            kvs,
            tensors,
            alignment,
            data_offset,
            header_len,
            index,
            keys,
        })
    }

    /// The magic, and a version this library reads (2 or 3, little-endian).
    fn magic_and_version(c: &mut Cur<'_>) -> Result<u32> {
        let magic = c.take(4, &|| "the magic".into()).map_err(|_| {
            fmt_err(format!(
                "not a GGUF file: {} bytes, too short for the magic",
                c.b.len()
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
        Ok(version)
    }

    /// The tensor and metadata counts, each bounded by the bytes left.
    fn counts(c: &mut Cur<'_>) -> Result<(u64, u64)> {
        let n_tensors = c.u64(&|| "the tensor count".into())?;
        let n_kv = c.u64(&|| "the metadata count".into())?;
        // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes, a
        // tensor entry 8 + 4 + 8 + 4 + 8.
        if n_kv > (c.left() / 13) as u64 {
            let msg = format!(
                "truncated GGUF header: {n_kv} metadata entries cannot fit in the {} bytes left",
                c.left()
            );
            return Err(c.short(msg));
        }
        if n_tensors > (c.left() / 32) as u64 {
            let msg = format!(
                "truncated GGUF header: {n_tensors} tensors cannot fit in the {} bytes left",
                c.left()
            );
            return Err(c.short(msg));
        }
        Ok((n_tensors, n_kv))
    }

    /// The metadata entries and their index by key (no key twice).
    fn metadata(c: &mut Cur<'_>, n_kv: u64) -> Result<(Vec<Kv>, HashMap<String, usize>)> {
        // The counts bound the entries by the bytes left, but an entry held in
        // memory is larger than its smallest encoding: reserve a little up
        // front and grow, fallibly, as entries are parsed (so memory follows
        // the bytes actually parsed, never a count).
        let mut kvs: Vec<Kv> = room(n_kv, "metadata entries")?;
        let mut keys: HashMap<String, usize> = map_room(n_kv, "metadata keys")?;
        for i in 0..n_kv {
            let key = c.string(&|| format!("metadata entry {i}'s key"))?;
            let type_at = c.pos;
            let ty = c.u32(&|| format!("metadata {key}'s type"))?;
            let value = c.value(ty, &|| format!("metadata {key}"))?;
            grow(&mut kvs, "metadata entries")?;
            grow_map(&mut keys, "metadata keys")?;
            if keys.insert(try_clone(&key)?, kvs.len()).is_some() {
                bail!(ErrFormat, "metadata key {key} appears twice");
            }
            kvs.push(Kv {
                key,
                ty,
                value,
                type_at,
            });
        }
        Ok((kvs, keys))
    }

    /// `general.alignment` (a power of two up to 2^30), else the default.
    fn alignment(kvs: &[Kv], keys: &HashMap<String, usize>) -> Result<u64> {
        let Some(&i) = keys.get("general.alignment") else {
            return Ok(DEFAULT_ALIGNMENT);
        };
        let kv: &Kv = &kvs[i];
        match kv.value {
            Value::Int(a) if a > 0 && a <= 1 << 30 && (a as u64).is_power_of_two() => Ok(a as u64),
            Value::Int(a) if a > 0 && a <= u64::MAX as i128 && (a as u64).is_power_of_two() => {
                bail!(
                    ErrFormat,
                    "general.alignment is {a}, a power of two above the largest accepted (2^30)"
                )
            }
            ref v => bail!(
                ErrFormat,
                "general.alignment is {v:?}, not a positive power of two"
            ),
        }
    }

    /// The tensor entries (offsets still relative to the data) and their
    /// index by name (no name twice).
    fn tensor_infos(
        c: &mut Cur<'_>,
        n_tensors: u64,
    ) -> Result<(Vec<TensorInfo>, HashMap<String, usize>)> {
        let mut tensors: Vec<TensorInfo> = room(n_tensors, "tensor entries")?;
        let mut index: HashMap<String, usize> = map_room(n_tensors, "tensor names")?;
        for i in 0..n_tensors {
            let name = c.string(&|| format!("tensor {i}'s name"))?;
            let entry_at = c.pos;
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
            grow(&mut tensors, "tensor entries")?;
            grow_map(&mut index, "tensor names")?;
            if index.insert(try_clone(&name)?, tensors.len()).is_some() {
                bail!(ErrFormat, "tensor {name} appears twice");
            }
            let bytes = tensor_bytes(&name, &dims, ty)?;
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                bytes,
                entry_at,
            });
        }
        Ok((tensors, index))
    }

    /// Each tensor's offset made absolute: aligned, and its data inside the
    /// file of `len` bytes.
    fn place_tensors(
        tensors: &mut [TensorInfo],
        data_offset: u64,
        alignment: u64,
        len: u64,
    ) -> Result<()> {
        for t in tensors {
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
        Ok(())
    }

    /// Sizes against the data written: no tensor may run into the next one.
    fn check_no_overlap(tensors: &[TensorInfo]) -> Result<()> {
        let mut order: Vec<usize> = (0..tensors.len()).collect();
        order.sort_by_key(|&i| tensors[i].offset);
        for w in order.windows(2) {
            let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
            if let Some(n) = a.bytes {
                // Both inside the file (checked above): no overflow.
                if a.offset + n > b.offset {
                    bail!(
                        ErrFormat,
                        "tensor {} ({:?}, type {}, {n} bytes at {}) overlaps tensor {} at {}: its shape disagrees with the data written",
                        a.name, a.dims, a.ty, a.offset, b.name, b.offset
                    );
                }
            }
        }
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&Kv> {
        self.keys.get(key).map(|&i| &self.kvs[i])
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

    /// Heap bytes this header holds (keys, names, strings, the indexes):
    /// independent of the size of the metadata arrays.
    pub fn heap_bytes(&self) -> usize {
        let kv: usize = self
            .kvs
            .iter()
            .map(|k| {
                std::mem::size_of::<Kv>()
                    + 2 * k.key.capacity()
                    + match &k.value {
                        Value::Str(s) => s.capacity(),
                        _ => 0,
                    }
            })
            .sum();
        let t: usize = self
            .tensors
            .iter()
            .map(|t| {
                std::mem::size_of::<TensorInfo>() + 2 * t.name.capacity() + t.dims.capacity() * 8
            })
            .sum();
        kv + t + (self.kvs.len() + self.tensors.len()) * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_that_overflow_are_format_errors() {
        // 2^61 elements of an 8-byte type: 2^64 bytes (wrapped to 0 before).
        let e = tensor_bytes("t", &[1 << 31, 1 << 30], 27).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrFormat);
        assert!(e.message.contains("overflow"), "{}", e.message);
        assert_eq!(tensor_bytes("t", &[4, 2], 27).unwrap(), Some(64));
        assert_eq!(tensor_bytes("t", &[4, 2], 9999).unwrap(), None);
        assert!(tensor_bytes("t", &[u64::MAX, 2], 0).is_err());
    }

    /// A GGUF v3 header with no tensors and one u64 `general.alignment`.
    fn with_alignment(a: u64) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        let key = b"general.alignment";
        b.extend((key.len() as u64).to_le_bytes());
        b.extend(key);
        b.extend(10u32.to_le_bytes()); // UINT64
        b.extend(a.to_le_bytes());
        b
    }

    /// A power of two above 2^30 is refused as too large, not as "not a
    /// power of two" (2^31 was); a non-power is still named as one.
    #[test]
    fn alignment_messages_say_what_is_wrong() {
        assert_eq!(Gguf::parse(&with_alignment(64)).unwrap().alignment, 64);
        assert_eq!(
            Gguf::parse(&with_alignment(1 << 30)).unwrap().alignment,
            1 << 30
        );
        for big in [1u64 << 31, 1 << 63] {
            let e = Gguf::parse(&with_alignment(big)).unwrap_err();
            assert_eq!(e.status, EngramStatus::ErrFormat);
            assert!(
                e.message.contains("above the largest accepted (2^30)")
                    && !e.message.contains("not a"),
                "{}",
                e.message
            );
        }
        for bad in [0u64, 3, 96, u64::MAX] {
            let e = Gguf::parse(&with_alignment(bad)).unwrap_err();
            assert_eq!(e.status, EngramStatus::ErrFormat);
            assert!(
                e.message.contains("not a positive power of two"),
                "{}",
                e.message
            );
        }
    }
}
