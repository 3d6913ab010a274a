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
    let root: serde_json::Value = serde_json::from_slice(json).map_err(|e| {
        fmt(format!(
            "{name}: the safetensors header is not valid JSON: {e}"
        ))
    })?;
    let obj = root.as_object().ok_or_else(|| {
        fmt(format!(
            "{name}: the safetensors header is not a JSON object"
        ))
    })?;
    let data_len = len - data_offset;
    let mut tensors = HashMap::with_capacity(obj.len());
    for (k, v) in obj {
        if k == "__metadata__" {
            continue;
        }
        let bad = |what: &str| fmt(format!("{name}: tensor {k}: {what}"));
        let dtype = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("no dtype"))?
            .to_string();
        let shape: Vec<u64> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| bad("a shape entry is not a non-negative integer"))
            })
            .collect::<Result<_>>()?;
        let offs = v
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| bad("no data_offsets [begin, end]"))?;
        let (b, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
            (Some(b), Some(e)) if b <= e => (b, e),
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
        tensors.insert(
            k.clone(),
            StTensor {
                name: k.clone(),
                dtype,
                shape,
                offset: data_offset + b,
                bytes: e - b,
            },
        );
    }
    Ok(StHeader {
        tensors,
        data_offset,
    })
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
    let cfg_path = dir.join("config.json");
    let cfg = EngramConfig::from_file(&cfg_path)?;
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
    let weight_map: Option<HashMap<String, String>> = if index_path.exists() {
        let bytes = files::read_small(&index_path, "safetensors index", MAX_INDEX_BYTES)?;
        let v: serde_json::Value = serde_json::from_slice(&bytes)
            .map_err(|e| fmt(format!("{}: not valid JSON: {e}", index_path.display())))?;
        let wm = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| fmt(format!("{}: no weight_map object", index_path.display())))?;
        let mut out = HashMap::with_capacity(wm.len());
        for (k, f) in wm {
            let f = f.as_str().ok_or_else(|| {
                fmt(format!(
                    "{}: weight_map[{k}] is not a file name",
                    index_path.display()
                ))
            })?;
            out.insert(k.clone(), f.to_string());
        }
        Some(out)
    } else {
        None
    };
    let shard_of = |name: &str| -> Result<String> {
        let f = match &weight_map {
            Some(m) => m.get(name).cloned().ok_or_else(|| {
                fmt(format!(
                    "{} has no entry for tensor {name}",
                    index_path.display()
                ))
            })?,
            None => "model.safetensors".to_string(),
        };
        // A shard is a file of the directory, nothing else.
        if f.is_empty() || f.contains('/') || f.contains('\\') || f == "." || f == ".." {
            bail!(
                ErrFormat,
                "{}: tensor {name} is in {f:?}, not a file name in the checkpoint directory",
                index_path.display()
            );
        }
        Ok(f)
    };
    let mut shards: Vec<StFile> = Vec::new();
    let open_shard = |f: &str, shards: &mut Vec<StFile>| -> Result<usize> {
        if let Some(i) = shards.iter().position(|s| s.name == f) {
            return Ok(i);
        }
        let s = StFile::open(&dir.join(f)).map_err(|e| {
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
            let f = shard_of(name)?;
            let i = open_shard(&f, shards)?;
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
            let p = tokenizer_json.map_or_else(|| dir.join("tokenizer.json"), Path::to_path_buf);
            if tokenizer_json.is_none() && !p.exists() {
                bail!(
                    ErrInvalidConfig,
                    "{} has no tokenizer.json: the hash constants need the model's tokenizer; pass its path \
                     (engram_safetensors_options.tokenizer_json)",
                    dir.display()
                );
            }
            let tok = crate::tables::tokenizer::load(&p)?;
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
    })
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
