//! The released DeepSeek-V4.1 checkpoint, read in place: `config.json`,
//! `model.safetensors.index.json` and the safetensors shards that hold the
//! engram tensors (`tests/golden/DIALECTS.md` section 7).
//!
//! A safetensors file is an 8-byte little-endian header length `N`, `N`
//! bytes of JSON (`{"name": {"dtype", "shape", "data_offsets": [begin,
//! end]}, "__metadata__": {...}}`), then the data; offsets are relative to
//! the data. [`parse_header`] reads that header with `pread`, bounded, and
//! checks every tensor against the file (dtype size times shape equal to its
//! byte range, the range inside the file) with checked arithmetic. (The
//! format is small enough that this is simpler than a dependency, and it
//! keeps every size check and message in this library's own terms.)
//!
//! Per engram layer `L` the checkpoint has `layers.{L}.engram.embed.weight`
//! (F8_E4M3 `[rows, Hd]`) and `.embed.scale` (F8_E8M0 `[rows, Hd/32]`): the
//! table in the split fp8 format, read in place; `wkv.weight` (F8_E4M3
//! `[(hc+1)*D, C*Hd]` with `wkv.scale` F8_E8M0, one scale per block of
//! `quantization_config.weight_block_size`, or BF16/F32/F16): an fp8 one is
//! kept as stored (`ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK`, read in place by the
//! kernels); `q_weight` and `k_weight` (BF16 `[hc, D]`).

use crate::error::{bail, Error, Result};
use crate::files;
use crate::formats::{EngramType, FP8_SCALE_BLOCK};
use crate::gguf::meta::{
    Blob, Dialect, EngramModel, EngramTensors, Keys, PadInfo, PadReading, TableBlobs, WeightBlob,
    WeightSource,
};
use crate::tables::{EngramConfig, EngramTables, TokenMap};
use crate::EngramStatus;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Largest safetensors header read (the released shards' are a few KB).
pub(crate) const MAX_HEADER_BYTES: u64 = 100 << 20;
/// Largest `model.safetensors.index.json` read.
pub(crate) const MAX_INDEX_BYTES: u64 = 64 << 20;

/// One tensor of a safetensors file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StTensor {
    pub name: String,
    pub dtype: String,
    /// Row-major (the last dimension contiguous).
    pub shape: Vec<u64>,
    /// Absolute offset in the file.
    pub offset: u64,
    pub bytes: u64,
}

impl StTensor {
    /// The shape innermost first (ggml order), as [`Blob`]s hold it.
    pub fn ggml_dims(&self) -> Vec<u64> {
        self.shape.iter().rev().copied().collect()
    }

    pub fn blob(&self, file: usize) -> Blob {
        Blob {
            name: self.name.clone(),
            file,
            offset: self.offset,
            bytes: self.bytes,
            dims: self.ggml_dims(),
        }
    }
}

/// A safetensors file's header.
#[derive(Clone, Debug, Default)]
pub struct StHeader {
    pub tensors: HashMap<String, StTensor>,
    /// Absolute offset of the data section (`8 + N`).
    pub data_offset: u64,
}

/// Bytes of one element of a safetensors dtype (`None`: unknown here).
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

fn fmt(msg: String) -> Error {
    Error::new(EngramStatus::ErrFormat, msg)
}

/// Parse the header of a safetensors file (`len` bytes, named `name`) from
/// its bytes `head` (at least the 8-byte length and the JSON).
///
/// The JSON is parsed in one streaming pass ([`json`]) that keeps only each
/// tensor's dtype, shape and range, checked as it is read, and allocates
/// fallibly: a header costs about its tensors' entries in memory, not a
/// tree of JSON values (docs/file-safety.md gives the figures).
pub fn parse_header_bytes(head: &[u8], len: u64, name: &str) -> Result<StHeader> {
    if len < 8 || head.len() < 8 {
        bail!(
            ErrFormat,
            "{name}: {len} bytes, too short for a safetensors header"
        );
    }
    let n = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    let data_offset = n
        .checked_add(8)
        .filter(|&d| d <= len)
        .ok_or_else(|| fmt(format!("{name}: the header length {n} runs past the file ({len} bytes): not safetensors, or truncated")))?;
    let json = head
        .get(8..data_offset as usize)
        .ok_or_else(|| fmt(format!("{name}: the header was not read whole")))?;
    // JSON is UTF-8: checked over every byte here, since the streaming parse
    // skips what it does not keep (`__metadata__`, unknown keys) unchecked.
    json::utf8(json, name, "the safetensors header")?;
    let tensors = json::header(json, name, data_offset, len - data_offset)?;
    Ok(StHeader {
        tensors,
        data_offset,
    })
}

/// Streaming JSON readers for the safetensors header and the index: serde
/// visitors that keep only what the loader uses, check it as it comes, and
/// allocate fallibly. A failure of our own is kept beside the parse (serde's
/// error type carries only text) and returned as it is.
pub(crate) mod json {
    use super::{dtype_size, fmt, StTensor};
    use crate::error::{Error, Result};
    use crate::EngramStatus;
    use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// Our error, when the parse failed for a reason of ours.
    type Slot = RefCell<Option<Error>>;

    fn fail<E: de::Error>(slot: &Slot, e: Error) -> E {
        let m = E::custom(&e.message);
        *slot.borrow_mut() = Some(e);
        m
    }

    fn oom(what: &str) -> Error {
        Error::new(
            EngramStatus::ErrCapacity,
            format!("out of memory for {what}"),
        )
    }

    /// A copy of `s`, allocated fallibly.
    fn owned(s: &str, what: &str) -> Result<String> {
        let mut o = String::new();
        o.try_reserve_exact(s.len()).map_err(|_| oom(what))?;
        o.push_str(s);
        Ok(o)
    }

    /// A JSON string, borrowed from the input when it has no escapes.
    struct Str<'a>(std::borrow::Cow<'a, str>);

    struct StrSeed<'s>(&'s Slot);

    impl<'de> DeserializeSeed<'de> for StrSeed<'_> {
        type Value = Str<'de>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Str<'de>, D::Error> {
            struct V<'s>(&'s Slot);
            impl<'de> Visitor<'de> for V<'_> {
                type Value = Str<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a string")
                }
                fn visit_borrowed_str<E: de::Error>(
                    self,
                    v: &'de str,
                ) -> std::result::Result<Str<'de>, E> {
                    Ok(Str(std::borrow::Cow::Borrowed(v)))
                }
                fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Str<'de>, E> {
                    owned(v, "a JSON string")
                        .map(|s| Str(std::borrow::Cow::Owned(s)))
                        .map_err(|e| fail(self.0, e))
                }
            }
            d.deserialize_str(V(self.0))
        }
    }

    /// `ErrFormat` naming `file` and `what` unless `json` is UTF-8 text.
    pub(crate) fn utf8(json: &[u8], file: &str, what: &str) -> Result<()> {
        match std::str::from_utf8(json) {
            Ok(_) => Ok(()),
            Err(e) => Err(fmt(format!(
                "{file}: {what} is not UTF-8 text (byte {} of the JSON)",
                e.valid_up_to()
            ))),
        }
    }

    /// Parse `json` with `seed`; our error when the seed set one, else the
    /// JSON error in `what`'s words.
    fn run<'de, S: DeserializeSeed<'de>>(
        json: &'de [u8],
        seed: S,
        slot: &Slot,
        what: &dyn Fn(&serde_json::Error) -> Error,
    ) -> Result<S::Value> {
        let mut d = serde_json::Deserializer::from_slice(json);
        let r = seed.deserialize(&mut d).and_then(|v| d.end().map(|_| v));
        r.map_err(|e| slot.borrow_mut().take().unwrap_or_else(|| what(&e)))
    }

    /// One tensor entry, checked against the data section.
    struct Entry<'a> {
        slot: &'a Slot,
        file: &'a str,
        tensor: &'a str,
        data_offset: u64,
        data_len: u64,
    }

    impl<'de> DeserializeSeed<'de> for Entry<'_> {
        type Value = StTensor;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<StTensor, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for Entry<'_> {
        type Value = StTensor;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a tensor entry {dtype, shape, data_offsets}")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> std::result::Result<StTensor, A::Error> {
            let bad = |what: &str| fmt(format!("{}: tensor {}: {what}", self.file, self.tensor));
            let mut dtype: Option<String> = None;
            let mut shape: Option<Vec<u64>> = None;
            let mut offs: Option<Option<(u64, u64)>> = None;
            while let Some(k) = m.next_key_seed(StrSeed(self.slot))? {
                match &*k.0 {
                    "dtype" => {
                        let v = m.next_value_seed(MaybeStr(self.slot))?;
                        dtype = match v {
                            Some(v) => {
                                Some(owned(&v.0, "a dtype").map_err(|e| fail(self.slot, e))?)
                            }
                            None => None,
                        };
                    }
                    "shape" => shape = m.next_value_seed(Uints(self.slot))?,
                    "data_offsets" => {
                        offs = Some(m.next_value_seed(Uints(self.slot))?.and_then(
                            |o| match o[..] {
                                [b, e] if b <= e => Some((b, e)),
                                _ => None,
                            },
                        ))
                    }
                    _ => {
                        m.next_value::<IgnoredAny>()?;
                    }
                }
            }
            let out = (|| -> Result<StTensor> {
                let dtype = dtype.ok_or_else(|| bad("no dtype"))?;
                let shape =
                    shape.ok_or_else(|| bad("no shape (an array of non-negative integers)"))?;
                let (b, e) = match offs {
                    None => return Err(bad("no data_offsets [begin, end]")),
                    Some(None) => {
                        return Err(bad("data_offsets are not [begin, end] with begin <= end"))
                    }
                    Some(Some(o)) => o,
                };
                if e > self.data_len {
                    return Err(bad(&format!(
                        "data_offsets [{b}, {e}] run past the data section ({} bytes): truncated?",
                        self.data_len
                    )));
                }
                if let Some(sz) = dtype_size(&dtype) {
                    let want = shape
                        .iter()
                        .try_fold(sz, |a, &d| a.checked_mul(d))
                        .ok_or_else(|| {
                            bad(&format!(
                                "shape {shape:?} of {dtype} overflows a 64-bit size"
                            ))
                        })?;
                    if want != e - b {
                        return Err(bad(&format!(
                            "shape {shape:?} of {dtype} is {want} bytes, but data_offsets [{b}, {e}] hold {}",
                            e - b
                        )));
                    }
                }
                Ok(StTensor {
                    name: owned(self.tensor, "a tensor name")?,
                    dtype,
                    shape,
                    offset: self.data_offset + b,
                    bytes: e - b,
                })
            })();
            out.map_err(|e| fail(self.slot, e))
        }
    }

    /// A string, or `None` for any other JSON value (skipped).
    struct MaybeStr<'s>(&'s Slot);

    impl<'de> DeserializeSeed<'de> for MaybeStr<'_> {
        type Value = Option<Str<'de>>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for MaybeStr<'_> {
        type Value = Option<Str<'de>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a string")
        }
        fn visit_borrowed_str<E: de::Error>(
            self,
            v: &'de str,
        ) -> std::result::Result<Self::Value, E> {
            Ok(Some(Str(std::borrow::Cow::Borrowed(v))))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Self::Value, E> {
            owned(v, "a JSON string")
                .map(|s| Some(Str(std::borrow::Cow::Owned(s))))
                .map_err(|e| fail(self.0, e))
        }
        fn visit_bool<E>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            while a.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    }

    /// An array of non-negative integers (grown fallibly), or `None` for
    /// anything else (skipped).
    struct Uints<'s>(&'s Slot);

    impl<'de> DeserializeSeed<'de> for Uints<'_> {
        type Value = Option<Vec<u64>>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    /// One array element: `Some` for a non-negative integer.
    struct Uint(Option<u64>);

    impl<'de> de::Deserialize<'de> for Uint {
        fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Uint, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Uint;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a non-negative integer")
                }
                fn visit_u64<E>(self, v: u64) -> std::result::Result<Uint, E> {
                    Ok(Uint(Some(v)))
                }
                fn visit_i64<E>(self, _: i64) -> std::result::Result<Uint, E> {
                    Ok(Uint(None))
                }
                fn visit_f64<E>(self, _: f64) -> std::result::Result<Uint, E> {
                    Ok(Uint(None))
                }
                fn visit_bool<E>(self, _: bool) -> std::result::Result<Uint, E> {
                    Ok(Uint(None))
                }
                fn visit_str<E>(self, _: &str) -> std::result::Result<Uint, E> {
                    Ok(Uint(None))
                }
                fn visit_unit<E>(self) -> std::result::Result<Uint, E> {
                    Ok(Uint(None))
                }
                fn visit_seq<A: SeqAccess<'de>>(
                    self,
                    mut a: A,
                ) -> std::result::Result<Uint, A::Error> {
                    while a.next_element::<IgnoredAny>()?.is_some() {}
                    Ok(Uint(None))
                }
                fn visit_map<A: MapAccess<'de>>(
                    self,
                    mut a: A,
                ) -> std::result::Result<Uint, A::Error> {
                    while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                    Ok(Uint(None))
                }
            }
            d.deserialize_any(V)
        }
    }

    impl<'de> Visitor<'de> for Uints<'_> {
        type Value = Option<Vec<u64>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an array of non-negative integers")
        }
        fn visit_seq<A: SeqAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut v: Vec<u64> = Vec::new();
            let mut ok = true;
            while let Some(x) = a.next_element::<Uint>()? {
                match x.0 {
                    Some(x) if ok => {
                        v.try_reserve(1)
                            .map_err(|_| fail(self.0, oom("a JSON array")))?;
                        v.push(x);
                    }
                    _ => ok = false,
                }
            }
            Ok(ok.then_some(v))
        }
        fn visit_bool<E>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_str<E>(self, _: &str) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    }

    /// The header object: every tensor checked, `__metadata__` skipped.
    struct Header<'a> {
        slot: &'a Slot,
        file: &'a str,
        data_offset: u64,
        data_len: u64,
    }

    impl<'de> DeserializeSeed<'de> for Header<'_> {
        type Value = HashMap<String, StTensor>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Header<'_> {
        type Value = HashMap<String, StTensor>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut m: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out: HashMap<String, StTensor> = HashMap::new();
            while let Some(k) = m.next_key_seed(StrSeed(self.slot))? {
                if k.0 == "__metadata__" {
                    m.next_value::<IgnoredAny>()?;
                    continue;
                }
                let t = m.next_value_seed(Entry {
                    slot: self.slot,
                    file: self.file,
                    tensor: &k.0,
                    data_offset: self.data_offset,
                    data_len: self.data_len,
                })?;
                out.try_reserve(1)
                    .map_err(|_| fail(self.slot, oom("the safetensors header's tensors")))?;
                let key = owned(&k.0, "a tensor name").map_err(|e| fail(self.slot, e))?;
                out.insert(key, t);
            }
            Ok(out)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> std::result::Result<Self::Value, A::Error> {
            Err(self.not_object())
        }
        fn visit_str<E: de::Error>(self, _: &str) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
        fn visit_unit<E: de::Error>(self) -> std::result::Result<Self::Value, E> {
            Err(self.not_object())
        }
    }

    impl Header<'_> {
        fn not_object<E: de::Error>(&self) -> E {
            fail(
                self.slot,
                fmt(format!(
                    "{}: the safetensors header is not a JSON object",
                    self.file
                )),
            )
        }
    }

    /// The tensors of a safetensors header `json` (of file `file`, whose data
    /// section is `data_len` bytes at `data_offset`).
    pub(crate) fn header(
        json: &[u8],
        file: &str,
        data_offset: u64,
        data_len: u64,
    ) -> Result<HashMap<String, StTensor>> {
        let slot = Slot::default();
        let seed = Header {
            slot: &slot,
            file,
            data_offset,
            data_len,
        };
        run(json, seed, &slot, &|e| {
            fmt(format!(
                "{file}: the safetensors header is not valid JSON: {e}"
            ))
        })
    }

    /// `weight_map` of a `model.safetensors.index.json`: tensor name to shard.
    struct Index<'a> {
        slot: &'a Slot,
        file: &'a str,
    }

    impl<'de> DeserializeSeed<'de> for Index<'_> {
        type Value = Option<HashMap<String, String>>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for Index<'_> {
        type Value = Option<HashMap<String, String>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object with a weight_map")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut m: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = None;
            while let Some(k) = m.next_key_seed(StrSeed(self.slot))? {
                if k.0 == "weight_map" {
                    out = Some(m.next_value_seed(WeightMap {
                        slot: self.slot,
                        file: self.file,
                    })?);
                } else {
                    m.next_value::<IgnoredAny>()?;
                }
            }
            Ok(out)
        }
    }

    struct WeightMap<'a> {
        slot: &'a Slot,
        file: &'a str,
    }

    impl<'de> DeserializeSeed<'de> for WeightMap<'_> {
        type Value = HashMap<String, String>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de> Visitor<'de> for WeightMap<'_> {
        type Value = HashMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a weight_map object")
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut m: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out: HashMap<String, String> = HashMap::new();
            while let Some(k) = m.next_key_seed(StrSeed(self.slot))? {
                let Some(f) = m.next_value_seed(MaybeStr(self.slot))? else {
                    return Err(fail(
                        self.slot,
                        fmt(format!(
                            "{}: weight_map[{}] is not a file name",
                            self.file, k.0
                        )),
                    ));
                };
                out.try_reserve(1)
                    .map_err(|_| fail(self.slot, oom("the index's weight_map")))?;
                let key = owned(&k.0, "a tensor name").map_err(|e| fail(self.slot, e))?;
                let f = owned(&f.0, "a shard name").map_err(|e| fail(self.slot, e))?;
                out.insert(key, f);
            }
            Ok(out)
        }
    }

    /// The `weight_map` of an index file's `json` (named `file`).
    pub(crate) fn index(json: &[u8], file: &str) -> Result<HashMap<String, String>> {
        utf8(json, file, "the index")?;
        let slot = Slot::default();
        let m = run(json, Index { slot: &slot, file }, &slot, &|e| {
            fmt(format!("{file}: not valid JSON: {e}"))
        })?;
        m.ok_or_else(|| fmt(format!("{file}: no weight_map object")))
    }
}

/// Read and parse the header of an open safetensors file with `pread`.
pub fn parse_header(file: &File, len: u64, name: &str) -> Result<StHeader> {
    if len < 8 {
        bail!(
            ErrFormat,
            "{name}: {len} bytes, too short for a safetensors header"
        );
    }
    let mut n8 = [0u8; 8];
    files::read_exact_at(file, &mut n8, 0, name)?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER_BYTES || n > len - 8 {
        bail!(
            ErrFormat,
            "{name}: a safetensors header of {n} bytes (the file has {len}; this library reads headers up to \
             {MAX_HEADER_BYTES}): not safetensors, or corrupt"
        );
    }
    let mut head = crate::batch::try_vec(8 + n as usize, 0u8, "a safetensors header")?;
    files::read_exact_at(file, &mut head, 0, name)?;
    parse_header_bytes(&head, len, name)
}

/// A safetensors shard opened for the loader.
pub struct StFile {
    pub path: PathBuf,
    pub name: String,
    pub file: File,
    pub len: u64,
    pub header: StHeader,
}

impl StFile {
    pub fn open(path: &Path) -> Result<StFile> {
        let (file, len) = files::open_regular(path, "safetensors file")?;
        Self::from_file(file, len, path)
    }

    /// A shard a loader opened from the checkpoint's directory.
    pub fn from_opened(o: files::Opened) -> Result<StFile> {
        Self::from_file(o.file, o.len, &o.path)
    }

    fn from_file(file: File, len: u64, path: &Path) -> Result<StFile> {
        let name = path.file_name().map_or_else(
            || path.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let header = parse_header(&file, len, &path.display().to_string())?;
        Ok(StFile {
            path: path.to_path_buf(),
            name,
            file,
            len,
            header,
        })
    }
}

/// A split fp8 table from a checkpoint shard: `layers.{L}.engram.embed.weight`
/// (F8_E4M3 `[rows, Hd]`) and `.scale` (F8_E8M0 `[rows, Hd/32]`), as a table
/// in file `file`. `hd` is the expected row width when known.
pub fn embed_table(
    h: &StHeader,
    shard: &str,
    lid: u32,
    hd: Option<u64>,
    file: usize,
) -> Result<TableBlobs> {
    let wn = format!("layers.{lid}.engram.embed.weight");
    let sn = format!("layers.{lid}.engram.embed.scale");
    let get = |n: &str| {
        h.tensors
            .get(n)
            .ok_or_else(|| fmt(format!("{shard} has no tensor {n}")))
    };
    let (w, s) = (get(&wn)?, get(&sn)?);
    if w.dtype != "F8_E4M3" || w.shape.len() != 2 {
        bail!(
            ErrFormat,
            "{wn} in {shard} is {} {:?}, expected F8_E4M3 [rows, Hd]",
            w.dtype,
            w.shape
        );
    }
    let (rows, width) = (w.shape[0], w.shape[1]);
    if hd.is_some_and(|h| h != width) || width == 0 || !width.is_multiple_of(FP8_SCALE_BLOCK as u64)
    {
        bail!(
            ErrFormat,
            "{wn} in {shard} has rows of {width} values, expected {}",
            hd.map_or("a positive multiple of 32".into(), |h| h.to_string())
        );
    }
    if s.dtype != "F8_E8M0" || s.shape != [rows, width / FP8_SCALE_BLOCK as u64] {
        bail!(
            ErrFormat,
            "{sn} in {shard} is {} {:?}, expected F8_E8M0 [{rows}, {}] (one e8m0 scale per {FP8_SCALE_BLOCK} values of each row of {wn})",
            s.dtype,
            s.shape,
            width / FP8_SCALE_BLOCK as u64
        );
    }
    Ok(TableBlobs {
        format: EngramType::Fp8E4m3E8m0Split,
        rows,
        codes: w.blob(file),
        scales: Some(s.blob(file)),
    })
}

/// What the checkpoint loader found: the model and the shards it uses (in
/// the model's file order).
pub struct Checkpoint {
    pub model: EngramModel,
    pub files: Vec<StFile>,
    /// `config.json`'s `rms_norm_eps` (in `text_config` or at the top
    /// level), if it has one.
    pub eps: Option<f32>,
}

/// Read a checkpoint directory's engram part and check it ([`read`], then
/// [`EngramModel::check`]).
pub fn open(
    dir: &Path,
    tokenizer_json: Option<&Path>,
    token_map: Option<&TokenMap>,
) -> Result<Checkpoint> {
    let ck = read(dir, tokenizer_json, token_map)?;
    ck.model.check()?;
    Ok(ck)
}

/// Read a checkpoint directory's engram part, without the hash layout's
/// checks. `token_map`: the tokenizer's map, when the caller already has it
/// (else `tokenizer_json`, or the directory's `tokenizer.json`, is read).
pub fn read(
    dir: &Path,
    tokenizer_json: Option<&Path>,
    token_map: Option<&TokenMap>,
) -> Result<Checkpoint> {
    let io = |e: std::io::Error| Error::new(EngramStatus::ErrIo, format!("{}: {e}", dir.display()));
    let meta = std::fs::metadata(dir).map_err(io)?;
    if !meta.is_dir() {
        bail!(
            ErrIo,
            "{}: not a directory (engram_create_from_safetensors takes the checkpoint's directory, with \
             config.json and its safetensors shards)",
            dir.display()
        );
    }
    let Some(mdir) = files::ModelDir::open(dir)? else {
        bail!(ErrIo, "{}: not a directory", dir.display());
    };
    let cfg_path = dir.join("config.json");
    let (cfg, eps) = read_config(&mdir, &cfg_path)?;
    let (Some(d), Some(hc), Some(hd)) = (cfg.hidden_size, cfg.hc, cfg.head_dim) else {
        bail!(
            ErrInvalidConfig,
            "{}: the config needs hidden_size, hc_mult and engram_head_dim (text_config) to read the checkpoint",
            cfg_path.display()
        );
    };
    let (d, hc, hd) = (d as u64, hc as u64, hd as u64);
    // Which shard holds each tensor.
    let index_path = dir.join("model.safetensors.index.json");
    let weight_map: Option<HashMap<String, String>> =
        match mdir.open_name("model.safetensors.index.json", "safetensors index")? {
            Some(f) => {
                let bytes = files::read_whole(
                    &f.file,
                    f.len,
                    &index_path,
                    "safetensors index",
                    MAX_INDEX_BYTES,
                )?;
                Some(json::index(&bytes, &index_path.display().to_string())?)
            }
            None => None,
        };
    let shard_of = |name: &str| -> Result<(String, files::Opened)> {
        let f = match &weight_map {
            Some(m) => m.get(name).cloned().ok_or_else(|| {
                fmt(format!(
                    "{} has no entry for tensor {name}",
                    index_path.display()
                ))
            })?,
            None => "model.safetensors".to_string(),
        };
        // A shard lies inside the checkpoint directory, by the one rule for
        // paths from a model file, and is opened as it is checked.
        let key = format!("{}: weight_map[{name}]", index_path.display());
        match mdir.open_recorded(&f, &key)? {
            Some(o) => Ok((f, o)),
            None => bail!(
                ErrIo,
                "checkpoint shard {f} (named in {} for tensor {name}): {}: no such file",
                index_path.display(),
                mdir.display(&files::confined_candidate(&f, &key)?)
                    .display()
            ),
        }
    };
    let mut shards: Vec<StFile> = Vec::new();
    let open_shard = |(f, o): (String, files::Opened), shards: &mut Vec<StFile>| -> Result<usize> {
        if let Some(i) = shards.iter().position(|s| s.path == o.path) {
            return Ok(i);
        }
        let s = StFile::from_opened(o).map_err(|e| {
            Error::new(
                e.status,
                format!(
                    "checkpoint shard {f} (named in {}): {}",
                    index_path.display(),
                    e.message
                ),
            )
        })?;
        shards.push(s);
        Ok(shards.len() - 1)
    };
    let cols = (cfg.max_ngram - 1) * cfg.n_heads;
    let mut layers = Vec::new();
    for (li, &lid) in cfg.layer_ids.iter().enumerate() {
        let n = |s: &str| format!("layers.{lid}.engram.{s}");
        // A tensor: its shard (opened once) and its header entry.
        let get = |name: &str, shards: &mut Vec<StFile>| -> Result<(usize, StTensor)> {
            let fp = shard_of(name)?;
            let f = fp.0.clone();
            let i = open_shard(fp, shards)?;
            let t = shards[i].header.tensors.get(name).cloned().ok_or_else(|| {
                fmt(format!(
                    "{} names {f} for tensor {name}, but {f} has no such tensor",
                    index_path.display()
                ))
            })?;
            Ok((i, t))
        };
        // The table: codes and scales (each in the shard the index names).
        let (wf, w) = get(&n("embed.weight"), &mut shards)?;
        let (sf, s) = get(&n("embed.scale"), &mut shards)?;
        let mut h = StHeader::default();
        h.tensors.insert(w.name.clone(), w.clone());
        h.tensors.insert(s.name.clone(), s.clone());
        let mut table = embed_table(&h, &shards[wf].name, lid, Some(hd), wf)?;
        if let Some(sc) = &mut table.scales {
            sc.file = sf;
        }
        if let Some(ne) = &cfg.num_embeddings {
            if ne[li] != table.rows {
                bail!(
                    ErrFormat,
                    "{} has {} rows, but config.json's text_config.engram_num_embeddings says {} for layer {lid}",
                    w.name,
                    table.rows,
                    ne[li]
                );
            }
        }
        // q and k: [hc, D], BF16 or F32 (F16 converted).
        let qk = |s: &str, shards: &mut Vec<StFile>| -> Result<WeightBlob> {
            let (f, t) = get(&n(s), shards)?;
            if t.shape != [hc, d] {
                bail!(
                    ErrFormat,
                    "{} is {:?}, expected [hc, D] = [{hc}, {d}]",
                    t.name,
                    t.shape
                );
            }
            Ok(WeightBlob {
                blob: t.blob(f),
                source: dense_source(&t)?,
            })
        };
        let q = qk("q_weight", &mut shards)?;
        let k = qk("k_weight", &mut shards)?;
        // wkv: [(hc+1)*D, C*Hd].
        let (wf, wt) = get(&n("wkv.weight"), &mut shards)?;
        let (rows_out, cols_in) = ((hc + 1) * d, cols as u64 * hd);
        if wt.shape != [rows_out, cols_in] {
            bail!(
                ErrFormat,
                "{} is {:?}, expected [D*(hc+1), C*Hd] = [{rows_out}, {cols_in}]",
                wt.name,
                wt.shape
            );
        }
        let wkv = if wt.dtype == "F8_E4M3" {
            let [br, bc] = cfg.weight_block_size.unwrap_or([32, 32]);
            let (sf, st) = get(&n("wkv.scale"), &mut shards)?;
            let want = [rows_out.div_ceil(br), cols_in.div_ceil(bc)];
            if st.dtype != "F8_E8M0" || st.shape != want {
                bail!(
                    ErrFormat,
                    "{} is {} {:?}, expected F8_E8M0 {want:?} (one e8m0 scale per {br}x{bc} block of {}, \
                     quantization_config.weight_block_size)",
                    st.name,
                    st.dtype,
                    st.shape,
                    wt.name
                );
            }
            WeightBlob {
                blob: wt.blob(wf),
                source: WeightSource::Fp8Block {
                    scale: st.blob(sf),
                    block: (br as usize, bc as usize),
                },
            }
        } else {
            WeightBlob {
                blob: wt.blob(wf),
                source: dense_source(&wt)?,
            }
        };
        layers.push(EngramTensors {
            layer_id: lid,
            table,
            wkv,
            q,
            k,
        });
    }
    // The hash constants: derived from the config and the tokenizer.
    let tm = match token_map {
        Some(t) => t.clone(),
        None => {
            let tok = match tokenizer_json {
                Some(p) => crate::tables::tokenizer::load(p)?,
                None => match mdir.open_name("tokenizer.json", "tokenizer")? {
                    Some(f) => crate::tables::tokenizer::load_opened(&f)?,
                    None => bail!(
                        ErrInvalidConfig,
                        "{} has no tokenizer.json: the hash constants need the model's tokenizer; pass its \
                         path (engram_safetensors_options.tokenizer_json)",
                        dir.display()
                    ),
                },
            };
            crate::tables::tokenizer::token_map(&tok)?
        }
    };
    let pad_raw = cfg.pad_token_id;
    let cv = cfg.compressed_vocab;
    let ne = cfg.num_embeddings.clone();
    let t = EngramTables::derive(cfg, tm)?;
    let k = |s: &str| format!("config.json text_config.{s}");
    let model = EngramModel {
        dialect: Dialect::Checkpoint,
        d: d as usize,
        hc: hc as usize,
        hd: hd as usize,
        layer_ids: t.config.layer_ids.clone(),
        max_ngram: t.config.max_ngram,
        n_heads: t.config.n_heads,
        pad_id: t.pad_id,
        pad: PadInfo {
            key: k("engram_pad_token_id"),
            stored: pad_raw as u64,
            reading: PadReading::Raw,
            compressed: t.pad_id,
            how: format!("a raw token id in the checkpoint's config: token_map[{pad_raw}]"),
        },
        token_map: t.token_map,
        multipliers: t.multipliers,
        primes: t.primes,
        offsets: t.offsets,
        offsets_stored: false,
        stated_rows: ne,
        compressed_vocab: cv,
        hash_source: "config+tokenizer",
        keys: Keys {
            layer_ids: k("engram_layer_ids"),
            multipliers: "multipliers (derived: config + tokenizer)".into(),
            primes: "primes (derived from text_config.engram_vocab_size)".into(),
            offsets: "offsets (derived: prefix sums of the primes)".into(),
            token_map: "token_map (derived from the tokenizer)".into(),
            rows: Some(k("engram_num_embeddings")),
            compressed_vocab: Some(k("engram_compressed_vocab_size")),
        },
        layers,
    };
    Ok(Checkpoint {
        model,
        files: shards,
        eps,
    })
}

/// `config.json` of the checkpoint (opened from `dir`, shown as `path`):
/// the engram config and `rms_norm_eps`, from one read.
fn read_config(dir: &files::ModelDir, path: &Path) -> Result<(EngramConfig, Option<f32>)> {
    use crate::tables::config::{rms_norm_eps, MAX_CONFIG_BYTES};
    let Some(f) = dir.open_name("config.json", "config")? else {
        bail!(ErrIo, "config {}: no such file", path.display());
    };
    let bytes = files::read_whole(&f.file, f.len, path, "config", MAX_CONFIG_BYTES)?;
    let at = |e: Error| Error::new(e.status, format!("{}: {}", path.display(), e.message));
    let text = String::from_utf8(bytes).map_err(|_| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!("config {}: not UTF-8 text", path.display()),
        )
    })?;
    let cfg = EngramConfig::from_json(&text).map_err(at)?;
    let eps = rms_norm_eps(&text).map_err(at)?;
    Ok((cfg, eps))
}

/// How a dense checkpoint weight (q, k, a bf16 wkv) is read.
fn dense_source(t: &StTensor) -> Result<WeightSource> {
    Ok(match t.dtype.as_str() {
        "BF16" => WeightSource::Direct(EngramType::Bf16 as u32),
        "F32" => WeightSource::Direct(EngramType::F32 as u32),
        "F16" => WeightSource::F16,
        other => bail!(
            ErrUnsupported,
            "{} is {other}; this library reads BF16, F32 or F16 here (F8_E4M3 only for wkv, with its scale)",
            t.name
        ),
    })
}
