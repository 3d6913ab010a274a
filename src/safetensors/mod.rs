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

/// Streaming JSON readers for the safetensors header and the index: one
/// bounded map reader (name to entry, every entry checked as it comes, the
/// map and every string kept grown fallibly) over one loose value reader
/// that keeps only the shapes the loader uses. No tree of JSON values is
/// built. A failure of our own is kept beside the parse (serde's error type
/// carries only text) and returned as it is.
pub(crate) mod json {
    use super::{dtype_size, fmt, StTensor};
    use crate::error::{Error, Result};
    use crate::EngramStatus;
    use serde::de::{
        self, Deserialize, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor,
    };
    use std::borrow::Cow;
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::marker::PhantomData;

    thread_local! {
        /// Our error, when the parse running on this thread failed for a
        /// reason of ours: set by [`fail`], taken by [`run`].
        static SLOT: RefCell<Option<Error>> = const { RefCell::new(None) };
    }

    fn fail<E: de::Error>(e: Error) -> E {
        let m = E::custom(&e.message);
        SLOT.with(|s| *s.borrow_mut() = Some(e));
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

    /// A JSON value, keeping only what the readers use: a string (borrowed
    /// from the input when it has no escapes, else copied fallibly), a
    /// non-negative integer, an array of them (grown fallibly). Anything
    /// else is skipped as `Other`; `Missing` is a key that was not there.
    #[derive(Default)]
    enum Loose<'a> {
        Str(Cow<'a, str>),
        Uint(u64),
        Uints(Vec<u64>),
        Other,
        #[default]
        Missing,
    }

    impl<'de> Deserialize<'de> for Loose<'de> {
        fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            d.deserialize_any(LooseVisitor)
        }
    }

    struct LooseVisitor;

    impl<'de> Visitor<'de> for LooseVisitor {
        type Value = Loose<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_borrowed_str<E: de::Error>(
            self,
            v: &'de str,
        ) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Str(Cow::Borrowed(v)))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Str(Cow::Owned(
                owned(v, "a JSON string").map_err(fail)?,
            )))
        }
        fn visit_u64<E>(self, v: u64) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Uint(v))
        }
        fn visit_i64<E>(self, _: i64) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Other)
        }
        fn visit_f64<E>(self, _: f64) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Other)
        }
        fn visit_bool<E>(self, _: bool) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Other)
        }
        fn visit_unit<E>(self) -> std::result::Result<Loose<'de>, E> {
            Ok(Loose::Other)
        }
        fn visit_seq<A: SeqAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Loose<'de>, A::Error> {
            let mut v = Some(Vec::new());
            while let Some(x) = a.next_element::<Loose>()? {
                match (x, &mut v) {
                    (Loose::Uint(n), Some(v)) => {
                        v.try_reserve(1).map_err(|_| fail(oom("a JSON array")))?;
                        v.push(n);
                    }
                    _ => v = None,
                }
            }
            Ok(v.map_or(Loose::Other, Loose::Uints))
        }
        fn visit_map<A: MapAccess<'de>>(
            self,
            mut a: A,
        ) -> std::result::Result<Loose<'de>, A::Error> {
            while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(Loose::Other)
        }
    }

    /// A JSON object read as a map from name to entry, grown fallibly:
    /// `seed(name)` reads the value of a name (`None`: skipped), `keep(name,
    /// value)` checks it into the entry kept (the last of a name twice wins).
    struct Map<F, G> {
        seed: F,
        keep: G,
        /// What the map is, for "out of memory for ...".
        what: &'static str,
    }

    impl<'de, S, V, F, G> DeserializeSeed<'de> for Map<F, G>
    where
        S: DeserializeSeed<'de>,
        F: FnMut(&str) -> Option<S>,
        G: FnMut(&str, S::Value) -> Result<V>,
    {
        type Value = HashMap<String, V>;
        fn deserialize<D: de::Deserializer<'de>>(
            self,
            d: D,
        ) -> std::result::Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    impl<'de, S, V, F, G> Visitor<'de> for Map<F, G>
    where
        S: DeserializeSeed<'de>,
        F: FnMut(&str) -> Option<S>,
        G: FnMut(&str, S::Value) -> Result<V>,
    {
        type Value = HashMap<String, V>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "a JSON object ({})", self.what)
        }
        fn visit_map<A: MapAccess<'de>>(
            mut self,
            mut m: A,
        ) -> std::result::Result<Self::Value, A::Error> {
            let mut out = HashMap::new();
            while let Some(k) = m.next_key::<Loose>()? {
                let Loose::Str(k) = k else {
                    return Err(de::Error::custom("a key that is not a string"));
                };
                let Some(seed) = (self.seed)(&k) else {
                    m.next_value::<IgnoredAny>()?;
                    continue;
                };
                let v = (self.keep)(&k, m.next_value_seed(seed)?).map_err(fail)?;
                out.try_reserve(1).map_err(|_| fail(oom(self.what)))?;
                out.insert(owned(&k, "a name").map_err(fail)?, v);
            }
            Ok(out)
        }
    }

    /// A tensor entry's fields as read, before they are checked.
    #[derive(Default)]
    struct RawEntry<'a> {
        dtype: Loose<'a>,
        shape: Loose<'a>,
        offsets: Loose<'a>,
    }

    impl<'de> Deserialize<'de> for RawEntry<'de> {
        fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = RawEntry<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a tensor entry {dtype, shape, data_offsets}")
                }
                fn visit_map<A: MapAccess<'de>>(
                    self,
                    mut m: A,
                ) -> std::result::Result<Self::Value, A::Error> {
                    let mut e = RawEntry::default();
                    while let Some(k) = m.next_key::<Loose>()? {
                        let field = match &k {
                            Loose::Str(k) if k == "dtype" => &mut e.dtype,
                            Loose::Str(k) if k == "shape" => &mut e.shape,
                            Loose::Str(k) if k == "data_offsets" => &mut e.offsets,
                            _ => {
                                m.next_value::<IgnoredAny>()?;
                                continue;
                            }
                        };
                        *field = m.next_value()?;
                    }
                    Ok(e)
                }
            }
            d.deserialize_map(V)
        }
    }

    /// Tensor `name`'s entry `e`, checked against the data section of
    /// `data_len` bytes at `data_offset` of `file`.
    fn tensor(
        e: RawEntry,
        name: &str,
        file: &str,
        data_offset: u64,
        data_len: u64,
    ) -> Result<StTensor> {
        let bad = |what: &str| fmt(format!("{file}: tensor {name}: {what}"));
        let Loose::Str(dtype) = e.dtype else {
            return Err(bad("no dtype"));
        };
        let Loose::Uints(shape) = e.shape else {
            return Err(bad("no shape (an array of non-negative integers)"));
        };
        let (b, e) = match e.offsets {
            Loose::Missing => return Err(bad("no data_offsets [begin, end]")),
            Loose::Uints(o) if o.len() == 2 && o[0] <= o[1] => (o[0], o[1]),
            _ => return Err(bad("data_offsets are not [begin, end] with begin <= end")),
        };
        if e > data_len {
            return Err(bad(&format!(
                "data_offsets [{b}, {e}] run past the data section ({data_len} bytes): truncated?"
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
            name: owned(name, "a tensor name")?,
            dtype: owned(&dtype, "a dtype")?,
            shape,
            offset: data_offset + b,
            bytes: e - b,
        })
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

    /// Parse `json` with `seed`; our error when the parse set one, else the
    /// JSON error in `what`'s words.
    fn run<'de, S: DeserializeSeed<'de>>(
        json: &'de [u8],
        seed: S,
        what: &dyn Fn(&serde_json::Error) -> Error,
    ) -> Result<S::Value> {
        SLOT.with(|s| s.borrow_mut().take());
        let mut d = serde_json::Deserializer::from_slice(json);
        let r = seed.deserialize(&mut d).and_then(|v| d.end().map(|_| v));
        r.map_err(|e| {
            SLOT.with(|s| s.borrow_mut().take())
                .unwrap_or_else(|| what(&e))
        })
    }

    /// The tensors of a safetensors header `json` (of file `file`, whose data
    /// section is `data_len` bytes at `data_offset`); `__metadata__` skipped.
    pub(crate) fn header(
        json: &[u8],
        file: &str,
        data_offset: u64,
        data_len: u64,
    ) -> Result<HashMap<String, StTensor>> {
        if json
            .iter()
            .find(|b| !b.is_ascii_whitespace())
            .is_some_and(|&b| b != b'{')
        {
            return Err(fmt(format!(
                "{file}: the safetensors header is not a JSON object"
            )));
        }
        let entries = Map {
            seed: |k: &str| (k != "__metadata__").then_some(PhantomData::<RawEntry>),
            keep: |k: &str, e| tensor(e, k, file, data_offset, data_len),
            what: "the safetensors header's tensors",
        };
        run(json, entries, &|e| {
            fmt(format!(
                "{file}: the safetensors header is not valid JSON: {e}"
            ))
        })
    }

    /// The `weight_map` of an index file's `json` (named `file`): tensor name
    /// to shard.
    pub(crate) fn index(json: &[u8], file: &str) -> Result<HashMap<String, String>> {
        utf8(json, file, "the index")?;
        let weight_map = || Map {
            seed: |_: &str| Some(PhantomData::<Loose>),
            keep: |k: &str, v| match v {
                Loose::Str(f) => owned(&f, "a shard name"),
                _ => Err(fmt(format!("{file}: weight_map[{k}] is not a file name"))),
            },
            what: "the index's weight_map",
        };
        let top = Map {
            seed: |k: &str| (k == "weight_map").then(weight_map),
            keep: |_: &str, m| Ok(m),
            what: "the index",
        };
        let mut m = run(json, top, &|e| fmt(format!("{file}: not valid JSON: {e}")))?;
        m.remove("weight_map")
            .ok_or_else(|| fmt(format!("{file}: no weight_map object")))
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
///
/// The steps: open the directory; read `config.json` (the geometry); read
/// the index; per engram layer, find each tensor in the shard the index
/// names (opening each shard once) and check its shape; derive the hash
/// constants from the config and the tokenizer.
pub fn read(
    dir: &Path,
    tokenizer_json: Option<&Path>,
    token_map: Option<&TokenMap>,
) -> Result<Checkpoint> {
    let mdir = open_dir(dir)?;
    let cfg_path = dir.join("config.json");
    let (cfg, eps) = read_config(&mdir, &cfg_path)?;
    let dims = Dims::of(&cfg, &cfg_path)?;
    let mut shards = Shards::open(&mdir, dir)?;
    let mut layers = Vec::new();
    for (li, &lid) in cfg.layer_ids.iter().enumerate() {
        layers.push(read_layer(&mut shards, &cfg, &dims, li, lid)?);
    }
    let tm = match token_map {
        Some(t) => t.clone(),
        None => read_token_map(&mdir, dir, tokenizer_json)?,
    };
    let model = checkpoint_model(cfg, tm, &dims, layers)?;
    Ok(Checkpoint {
        model,
        files: shards.files,
        eps,
    })
}

/// The checkpoint directory, opened (the caller's path, used as given).
fn open_dir(dir: &Path) -> Result<files::ModelDir> {
    let io = |e: std::io::Error| Error::new(EngramStatus::ErrIo, format!("{}: {e}", dir.display()));
    let meta = std::fs::metadata(dir).map_err(io)?;
    let opened = if meta.is_dir() {
        files::ModelDir::open(dir)?
    } else {
        None
    };
    match opened {
        Some(d) => Ok(d),
        None => bail!(
            ErrIo,
            "{}: not a directory (engram_create_from_safetensors takes the checkpoint's directory, with \
             config.json and its safetensors shards)",
            dir.display()
        ),
    }
}

/// The geometry the checkpoint's tensors are checked against.
struct Dims {
    d: u64,
    hc: u64,
    hd: u64,
    /// `C`: the n-gram heads a row of `wkv` reads, `(max_ngram - 1) * n_heads`.
    cols: u64,
}

impl Dims {
    fn of(cfg: &EngramConfig, cfg_path: &Path) -> Result<Dims> {
        let (Some(d), Some(hc), Some(hd)) = (cfg.hidden_size, cfg.hc, cfg.head_dim) else {
            bail!(
                ErrInvalidConfig,
                "{}: the config needs hidden_size, hc_mult and engram_head_dim (text_config) to read the checkpoint",
                cfg_path.display()
            );
        };
        Ok(Dims {
            d: d as u64,
            hc: hc as u64,
            hd: hd as u64,
            cols: ((cfg.max_ngram - 1) * cfg.n_heads) as u64,
        })
    }
}

/// The checkpoint's shards: which holds each tensor (the index's
/// `weight_map`, else the one `model.safetensors`), each opened once by the
/// rule for paths from a model file.
struct Shards<'d> {
    dir: &'d files::ModelDir,
    index_path: PathBuf,
    weight_map: Option<HashMap<String, String>>,
    files: Vec<StFile>,
}

impl<'d> Shards<'d> {
    fn open(mdir: &'d files::ModelDir, dir: &Path) -> Result<Shards<'d>> {
        let index_path = dir.join("model.safetensors.index.json");
        let weight_map =
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
        Ok(Shards {
            dir: mdir,
            index_path,
            weight_map,
            files: Vec::new(),
        })
    }

    /// Tensor `name`: the shard that holds it (its index in `files`) and its
    /// header entry.
    fn get(&mut self, name: &str) -> Result<(usize, StTensor)> {
        let ix = self.index_path.display();
        let f = match &self.weight_map {
            Some(m) => m
                .get(name)
                .cloned()
                .ok_or_else(|| fmt(format!("{ix} has no entry for tensor {name}")))?,
            None => "model.safetensors".to_string(),
        };
        // A shard lies inside the checkpoint directory, by the one rule for
        // paths from a model file, and is opened as it is checked.
        let key = format!("{ix}: weight_map[{name}]");
        let Some(o) = self.dir.open_recorded(&f, &key)? else {
            bail!(
                ErrIo,
                "checkpoint shard {f} (named in {ix} for tensor {name}): {}: no such file",
                self.dir
                    .display(&files::confined_candidate(&f, &key)?)
                    .display()
            );
        };
        let i = match self.files.iter().position(|s| s.path == o.path) {
            Some(i) => i,
            None => {
                let s = StFile::from_opened(o).map_err(|e| {
                    Error::new(
                        e.status,
                        format!("checkpoint shard {f} (named in {ix}): {}", e.message),
                    )
                })?;
                self.files.push(s);
                self.files.len() - 1
            }
        };
        let t = self.files[i].header.tensors.get(name).cloned();
        let t = t.ok_or_else(|| {
            fmt(format!(
                "{ix} names {f} for tensor {name}, but {f} has no such tensor"
            ))
        })?;
        Ok((i, t))
    }
}

/// Engram layer `lid` (the `li`-th): its table, `q`, `k` and `wkv`, each
/// found in its shard and checked against the config.
fn read_layer(
    shards: &mut Shards,
    cfg: &EngramConfig,
    dims: &Dims,
    li: usize,
    lid: u32,
) -> Result<EngramTensors> {
    let n = |s: &str| format!("layers.{lid}.engram.{s}");
    // The table: codes and scales (each in the shard the index names).
    let (wf, w) = shards.get(&n("embed.weight"))?;
    let (sf, s) = shards.get(&n("embed.scale"))?;
    let mut h = StHeader::default();
    h.tensors.insert(w.name.clone(), w.clone());
    h.tensors.insert(s.name.clone(), s);
    let mut table = embed_table(&h, &shards.files[wf].name, lid, Some(dims.hd), wf)?;
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
    let mut qk = |s: &str| -> Result<WeightBlob> {
        let (f, t) = shards.get(&n(s))?;
        if t.shape != [dims.hc, dims.d] {
            bail!(
                ErrFormat,
                "{} is {:?}, expected [hc, D] = [{}, {}]",
                t.name,
                t.shape,
                dims.hc,
                dims.d
            );
        }
        Ok(WeightBlob {
            blob: t.blob(f),
            source: dense_source(&t)?,
        })
    };
    let q = qk("q_weight")?;
    let k = qk("k_weight")?;
    let wkv = read_wkv(shards, cfg, dims, &n)?;
    Ok(EngramTensors {
        layer_id: lid,
        table,
        wkv,
        q,
        k,
    })
}

/// A layer's `wkv` (`[(hc+1)*D, C*Hd]`): dense, or fp8 e4m3 with its e8m0
/// block scales (`quantization_config.weight_block_size`), kept as stored.
fn read_wkv(
    shards: &mut Shards,
    cfg: &EngramConfig,
    dims: &Dims,
    n: &dyn Fn(&str) -> String,
) -> Result<WeightBlob> {
    let (wf, wt) = shards.get(&n("wkv.weight"))?;
    let (rows_out, cols_in) = ((dims.hc + 1) * dims.d, dims.cols * dims.hd);
    if wt.shape != [rows_out, cols_in] {
        bail!(
            ErrFormat,
            "{} is {:?}, expected [D*(hc+1), C*Hd] = [{rows_out}, {cols_in}]",
            wt.name,
            wt.shape
        );
    }
    if wt.dtype != "F8_E4M3" {
        return Ok(WeightBlob {
            blob: wt.blob(wf),
            source: dense_source(&wt)?,
        });
    }
    let [br, bc] = cfg.weight_block_size.unwrap_or([32, 32]);
    let (sf, st) = shards.get(&n("wkv.scale"))?;
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
    Ok(WeightBlob {
        blob: wt.blob(wf),
        source: WeightSource::Fp8Block {
            scale: st.blob(sf),
            block: (br as usize, bc as usize),
        },
    })
}

/// The tokenizer's token map: from `tokenizer_json` when given, else the
/// directory's `tokenizer.json` (opened by the directory's rule).
fn read_token_map(
    mdir: &files::ModelDir,
    dir: &Path,
    tokenizer_json: Option<&Path>,
) -> Result<TokenMap> {
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
    crate::tables::tokenizer::token_map(&tok)
}

/// The model: the layers read, the hash constants derived from the config
/// and the token map.
fn checkpoint_model(
    cfg: EngramConfig,
    tm: TokenMap,
    dims: &Dims,
    layers: Vec<EngramTensors>,
) -> Result<EngramModel> {
    let pad_raw = cfg.pad_token_id;
    let cv = cfg.compressed_vocab;
    let ne = cfg.num_embeddings.clone();
    let t = EngramTables::derive(cfg, tm)?;
    let k = |s: &str| format!("config.json text_config.{s}");
    Ok(EngramModel {
        dialect: Dialect::Checkpoint,
        d: dims.d as usize,
        hc: dims.hc as usize,
        hd: dims.hd as usize,
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
