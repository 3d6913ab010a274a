//! A model loaded from its files (a GGUF file or split set in any dialect, or
//! the safetensors checkpoint), and contexts over it.
//!
//! Two modes ([`LoadOptions::mmap`]):
//!
//! - `pread` (`mmap = false`, the C API's default): nothing is mapped. GGUF
//!   headers and safetensors headers are read with `pread`; `wkv`, `q` and
//!   `k` are read at load into memory the model owns (allocated fallibly);
//!   table rows are read with `pread` when they are gathered. A file cut
//!   short at any time is an `ErrIo` status, never SIGBUS. Cost: the bytes of
//!   every layer's `wkv`, `q` and `k` as stored (the released V4.1 model:
//!   315 MB per layer in bf16, 167 MB as q8_0), plus the headers.
//! - mapped (`mmap = true`): each file is mapped read-only; tables, `wkv`, `q`
//!   and `k` are read in place (no copy). A file truncated while mapped
//!   raises SIGBUS in the reading thread: keep model files immutable while
//!   they are in use, as every mmap-based engine does.
//!
//! In both modes a weight the context has no format for is converted once at
//! load into owned memory: f16 `wkv`/`q`/`k` (ds4) to bf16 where every value
//! is exact in bf16, else to f32. The checkpoint's fp8 `wkv` is kept as
//! stored (e4m3 codes and e8m0 block scales, `Fp8E4m3E8m0Block`: read in
//! place when mapped, else read into owned memory, 1 byte a weight). Owned
//! bytes are reported by [`LoadedModel::owned_bytes`].
//!
//! Tables that live outside the GGUF file (deepstrix's `table_shards`, the
//! "ds4gw" shard path and offsets) are looked for under
//! [`LoadOptions::tables_dir`] (the checkpoint directory: the recorded file
//! name is kept), else at the recorded path, else next to the GGUF file; when
//! none is there the load is refused, saying where the tables are and how to
//! open them.

use super::dialect::{self, Companions, External, TableSpec};
use super::meta::{Blob, EngramModel, TableBlobs, WeightBlob, WeightSource};
use super::shards::GgufSet;
use crate::backend::{LayerIn, TableIn, TableSource};
use crate::batch::{Geometry, Limits};
use crate::context::{wkv_part, Context, ContextConfig, ShardSpec, Tuning};
use crate::error::{bail, Error, Result};
use crate::files::{self, AlignedBuf};
use crate::formats::{bf16_to_f32, f32_to_bf16, EngramType};
use crate::memory::Region;
use crate::safetensors::StFile;
use crate::tables::{EngramTables, TokenMap};
use crate::EngramStatus;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod convert;
mod external;
use convert::convert_f16;
use external::{external_table, find_external};

/// Rows `[r0, r1)` of a weight blob of `rows` rows (`part`): the blob itself
/// when that is all of it; a blob whose bytes are not `rows` equal rows is
/// `ErrFormat`.
fn rows_of(b: &Blob, ((r0, r1), rows): ((usize, usize), usize)) -> Result<Blob> {
    if (r0, r1) == (0, rows) {
        return Ok(b.clone());
    }
    let per = b.bytes / rows.max(1) as u64;
    if per * rows as u64 != b.bytes || r0 > r1 || r1 > rows {
        bail!(
            ErrFormat,
            "{}: {} bytes are not {rows} equal rows to read rows [{r0}, {r1}) of",
            b.name,
            b.bytes
        );
    }
    Ok(Blob {
        offset: b.offset + r0 as u64 * per,
        bytes: (r1 - r0) as u64 * per,
        ..b.clone()
    })
}

/// Options of [`LoadedModel::context`] (the C options structs carry the same).
#[derive(Clone, Debug)]
pub struct GgufOptions {
    pub limits: Limits,
    pub n_threads: usize,
    pub backend: u32,
    pub device: i32,
    pub eps: f32,
    /// Tests' and benchmarks' choices (engines keep the default).
    pub tuning: Tuning,
    /// Bytes of the host row cache in front of the tables read from files
    /// (docs/row-cache.md), shared evenly among the layers; 0: none.
    pub row_cache_bytes: u64,
}

/// How to load a model.
#[derive(Clone, Copy, Default)]
pub struct LoadOptions<'a> {
    /// Map the files and read in place (`true`), or read with `pread` into
    /// owned memory and read table rows with `pread` (`false`).
    pub mmap: bool,
    /// Hash tables derived from the model's `config.json` + `tokenizer.json`:
    /// they complete a file without the hash constants and must agree with
    /// the constants it has.
    pub companion: Option<&'a EngramTables>,
    /// A tokenizer's token map alone: completes a file that carries the
    /// engram config keys but no constants (deepstrix), and must agree with a
    /// token map the file has.
    pub tokenizer: Option<&'a TokenMap>,
    /// Where tables outside the GGUF file are (the checkpoint directory).
    pub tables_dir: Option<&'a Path>,
    /// The part of every layer the contexts over this model hold
    /// (docs/sharding.md "Shard contexts"): `wkv` (and its scales) is read
    /// and converted only for the shard's outputs, and every context is a
    /// shard context of this spec. `ShardSpec::WHOLE` (the default): all.
    pub shard: ShardSpec,
}

/// A file the model's data is read from, besides the GGUF set.
struct ExtFile {
    path: PathBuf,
    file: Arc<File>,
    len: u64,
    map: Option<memmap2::Mmap>,
}

/// A weight the context reads: in place, or owned (read or converted).
#[derive(Debug)]
enum WeightData {
    InPlace {
        file: usize,
        offset: u64,
        bytes: u64,
    },
    Owned(AlignedBuf),
}

#[derive(Debug)]
struct LoadedWeight {
    data: WeightData,
    /// `EngramType` number of the data.
    ty: u32,
    /// A block-scaled fp8 weight's scales and block shape (read like the
    /// codes: in place when mapped, else into owned memory).
    scales: Option<(WeightData, (usize, usize))>,
}

struct LoadedLayer {
    /// The outputs `[o0, o1)` of `wkv` read (all but for a shard).
    wkv_outs: (usize, usize),
    wkv: LoadedWeight,
    q: LoadedWeight,
    k: LoadedWeight,
}

/// A model loaded from its files; contexts made by [`LoadedModel::context`]
/// borrow it.
pub struct LoadedModel {
    /// What was opened (the GGUF file given, or the checkpoint directory).
    pub path: PathBuf,
    pub mmap: bool,
    /// The GGUF set (files `0..n` of the model's blobs); `None` for a checkpoint.
    pub gguf: Option<GgufSet>,
    ext: Vec<ExtFile>,
    pub model: EngramModel,
    layers: Vec<LoadedLayer>,
    /// The RMS epsilon the files state ([`file_eps`]), if they do.
    pub eps: Option<f32>,
    /// The part of every layer read ([`LoadOptions::shard`]).
    pub shard: ShardSpec,
}

/// A model's files read but not checked ([`LoadedModel::inspect`]).
pub struct Inspected {
    /// The model as read, its files open, its weights not yet loaded.
    pub loaded: LoadedModel,
    /// The files the model's blobs point into (`Blob::file` indexes them).
    pub files: Vec<PathBuf>,
    /// How many of them are GGUF shards (0 for a checkpoint).
    pub shards: usize,
}

/// The epsilon of a model whose files do not state one.
pub(crate) const DEFAULT_EPS: f32 = 1e-6;

/// The GGUF key of the RMS epsilon: llama.cpp's
/// `{general.architecture}.attention.layer_norm_rms_epsilon` (`deepseek41.`
/// or `deepseek4.`), read the same way for every dialect.
pub fn eps_key(arch: &str) -> String {
    format!("{arch}.attention.layer_norm_rms_epsilon")
}

/// The RMS epsilon a GGUF set states (`None`: no architecture or no key);
/// a value that is not a finite number `>= 0` is `ERR_FORMAT` naming the key.
fn gguf_eps(set: &GgufSet) -> Result<Option<f32>> {
    let Some(arch) = set.header().architecture() else {
        return Ok(None);
    };
    let key = eps_key(arch);
    let v = match set.get(&key).map(|k| &k.value) {
        None => return Ok(None),
        Some(crate::gguf::parser::Value::Float(f)) => *f as f32,
        Some(other) => bail!(ErrFormat, "{key} is {other:?}, not a float"),
    };
    if !(v.is_finite() && v >= 0.0) {
        bail!(ErrFormat, "{key} = {v} is not a finite epsilon >= 0");
    }
    Ok(Some(v))
}

impl Inspected {
    pub fn model(&self) -> &EngramModel {
        &self.loaded.model
    }

    /// Every check the loaders make, in their order: the hash layout's
    /// ([`super::meta::validate`]), then the weights loaded exactly as the
    /// loaders load them (a NaN or infinity in an f16 weight, an e4m3 NaN
    /// code or e8m0 NaN scale in an fp8 one), then a context given every
    /// layer (the geometry and the tables' sizes), each failure with the
    /// status and message `engram_create_*` would return. The later checks
    /// run only when the earlier ones pass, as in the loaders.
    pub fn checks(&mut self) -> Vec<super::meta::Check> {
        use super::meta::Check;
        let mut out = super::meta::validate(&self.loaded.model);
        if out.iter().any(|c| c.problem.is_some()) {
            return out;
        }
        let why = |e: Error| Some(format!("{:?}: {}", e.status, e.message));
        let w = self.loaded.load_weights();
        let loaded = w.is_ok();
        out.push(Check {
            what: "every layer's wkv, q and k load as the loaders load them (finite values; valid fp8 codes \
                   and scales)",
            problem: w.err().and_then(why),
        });
        if loaded {
            let c = self.loaded.context(&GgufOptions {
                limits: Limits {
                    max_tokens: 1,
                    max_seqs: 1,
                    max_positions: 1,
                },
                n_threads: 1,
                backend: crate::EngramBackend::Cpu as u32,
                device: 0,
                eps: 1e-6,
                tuning: Tuning::default(),
                row_cache_bytes: 0,
            });
            out.push(Check {
                what: "a CPU context takes every layer (geometry, table and weight sizes)",
                problem: c.err().and_then(why),
            });
        }
        out
    }
}

/// The tensor of layer `l` that a `set_layer` refusal (`msg`) is about,
/// with its format where it is the table: the field the message names first
/// (`weights.wkv`, `weights.q`, ...) mapped to the model's tensor, and a NaN
/// e8m0 scale of a block fp8 `wkv` to its scale tensor, which holds it. A
/// message that names no field is about the table.
fn refused_tensor(l: &super::meta::EngramTensors, msg: &str) -> String {
    let table = format!("{} ({})", l.table.codes.name, l.table.format.name());
    let wkv_scale = match &l.wkv.source {
        WeightSource::Fp8Block { scale, .. } => Some(scale.name.as_str()),
        _ => None,
    };
    let table_scales = l
        .table
        .scales
        .as_ref()
        .map_or(table.as_str(), |b| b.name.as_str());
    // Longer field names first: "weights.wkv" is a prefix of "weights.wkv_scales".
    let fields = [
        ("weights.wkv_scales", wkv_scale.unwrap_or(&l.wkv.blob.name)),
        ("weights.wkv", &l.wkv.blob.name),
        ("weights.q", &l.q.blob.name),
        ("weights.k", &l.k.blob.name),
        ("weights.table_scales", table_scales),
        ("weights.table", &table),
    ];
    let mut first: Option<(usize, &str, &str)> = None;
    for (field, name) in fields {
        if let Some(at) = msg.find(field) {
            let after = msg[at + field.len()..].chars().next();
            let whole = !after.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            if whole && first.is_none_or(|(a, _, _)| at < a) {
                first = Some((at, field, name));
            }
        }
    }
    match first {
        Some((_, "weights.wkv", name)) => match wkv_scale {
            Some(scale) if msg.contains("e8m0 scale is the NaN code") => scale.to_string(),
            _ => name.to_string(),
        },
        Some((_, _, name)) => name.to_string(),
        None => table,
    }
}

/// The name a loader's GGUF entry points use; the same type.
pub type GgufModel = LoadedModel;

impl LoadedModel {
    /// Open a GGUF file (or the split set it belongs to) in any dialect.
    pub fn open(path: &Path, o: &LoadOptions<'_>) -> Result<LoadedModel> {
        let set = GgufSet::open(path, o.mmap)?;
        let at = |e: Error| Error::new(e.status, format!("{}: {}", path.display(), e.message));
        Self::from_set(set, path, o).map_err(at)
    }

    /// A model from GGUF files held in memory (`(file name, bytes)`, the first
    /// one opened): tests and fuzzing. Tables outside the file are found
    /// under `o.tables_dir` only.
    pub fn from_memory(files: Vec<(String, Vec<u8>)>, o: &LoadOptions<'_>) -> Result<LoadedModel> {
        let path = PathBuf::from(files.first().map_or("", |f| f.0.as_str()));
        let set = GgufSet::from_memory(files)?;
        Self::from_set(set, &path, o)
    }

    fn from_set(set: GgufSet, path: &Path, o: &LoadOptions<'_>) -> Result<LoadedModel> {
        let (set, ext, model) = Self::resolve(set, path, o)?;
        model.check()?;
        let eps = gguf_eps(&set)?;
        let mut m = LoadedModel {
            path: path.to_path_buf(),
            mmap: o.mmap,
            gguf: Some(set),
            ext,
            model,
            layers: Vec::new(),
            eps,
            shard: o.shard,
        };
        m.load_weights()?;
        Ok(m)
    }

    /// Read a model's files into an [`EngramModel`] without running its
    /// checks or loading its weights: what `engram-inspect` reports on (it
    /// prints every check, not only the first that fails). `path` is a GGUF
    /// file (or a shard of a set) or a checkpoint directory.
    pub fn inspect(
        path: &Path,
        tokenizer_json: Option<&Path>,
        o: &LoadOptions<'_>,
    ) -> Result<Inspected> {
        if path.is_dir() {
            let ck = crate::safetensors::read(path, tokenizer_json, o.tokenizer)?;
            let files = ck.files.iter().map(|f| f.path.clone()).collect();
            return Ok(Inspected {
                files,
                shards: 0,
                loaded: Self::from_checkpoint(path, ck, o)?,
            });
        }
        let set = GgufSet::open(path, o.mmap)?;
        let at = |e: Error| Error::new(e.status, format!("{}: {}", path.display(), e.message));
        let (set, ext, model) = Self::resolve(set, path, o).map_err(at)?;
        let eps = gguf_eps(&set).map_err(at)?;
        let mut files: Vec<PathBuf> = set.shards.iter().map(|s| s.path.clone()).collect();
        files.extend(ext.iter().map(|f| f.path.clone()));
        Ok(Inspected {
            shards: set.shards.len(),
            files,
            loaded: LoadedModel {
                path: path.to_path_buf(),
                mmap: o.mmap,
                gguf: Some(set),
                ext,
                model,
                layers: Vec::new(),
                eps,
                shard: o.shard,
            },
        })
    }

    /// A checkpoint read ([`crate::safetensors::read`]) with its files
    /// opened for loading, its weights not yet loaded.
    fn from_checkpoint(
        dir: &Path,
        ck: crate::safetensors::Checkpoint,
        o: &LoadOptions<'_>,
    ) -> Result<LoadedModel> {
        let mut ext = Vec::with_capacity(ck.files.len());
        for f in ck.files {
            ext.push(ExtFile::from_st(f, o.mmap)?);
        }
        Ok(LoadedModel {
            path: dir.to_path_buf(),
            mmap: o.mmap,
            gguf: None,
            ext,
            model: ck.model,
            layers: Vec::new(),
            eps: ck.eps,
            shard: o.shard,
        })
    }

    /// The dialect read, tables outside the file found, the model completed.
    fn resolve(
        set: GgufSet,
        path: &Path,
        o: &LoadOptions<'_>,
    ) -> Result<(GgufSet, Vec<ExtFile>, EngramModel)> {
        let partial = dialect::read(&set)?;
        let n_shards = set.shards.len();
        let mut ext: Vec<ExtFile> = Vec::new();
        let gguf_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        // Tables: in the file, or resolved outside it.
        let mut tables = Vec::with_capacity(partial.layers.len());
        for l in &partial.layers {
            tables.push(match &l.table {
                TableSpec::InFile(t) => t.clone(),
                TableSpec::External(x) => {
                    let f = find_external(x, o.tables_dir, &gguf_dir)?;
                    let fi = match ext.iter().position(|e| e.path == f.path) {
                        Some(i) => i,
                        None => {
                            ext.push(ExtFile::open(f, o.mmap)?);
                            ext.len() - 1
                        }
                    };
                    external_table(
                        x,
                        &ext[fi],
                        n_shards + fi,
                        partial.hd.as_ref().map(|h| h.value),
                    )?
                }
            });
        }
        // A file without constants: a tokenizer.json in tables_dir completes it.
        let mut local_tm = None;
        let has_consts = partial.multipliers.is_some() || partial.token_map.is_some();
        if !has_consts && o.companion.is_none() && o.tokenizer.is_none() {
            let opened = match o.tables_dir {
                Some(d) => match files::ModelDir::open(d)? {
                    Some(dir) => dir.open_name("tokenizer.json", "tokenizer")?,
                    None => None,
                },
                None => None,
            };
            if let Some(f) = opened {
                let tok = crate::tables::tokenizer::load_opened(&f)?;
                local_tm = Some(crate::tables::tokenizer::token_map(&tok)?);
            }
        }
        let comp = Companions {
            tables: o.companion,
            token_map: o.tokenizer.or(local_tm.as_ref()),
        };
        let model = partial.finish(tables, comp)?;
        Ok((set, ext, model))
    }

    /// Open the released checkpoint's directory (`config.json`, the index and
    /// the shards with the engram tensors). The hash constants are derived
    /// from the config and `o.tokenizer` (else `tokenizer_json`, else the
    /// directory's `tokenizer.json`).
    pub fn open_checkpoint(
        dir: &Path,
        tokenizer_json: Option<&Path>,
        o: &LoadOptions<'_>,
    ) -> Result<LoadedModel> {
        let ck = crate::safetensors::open(dir, tokenizer_json, o.tokenizer)?;
        let mut m = Self::from_checkpoint(dir, ck, o)?;
        m.load_weights()?;
        Ok(m)
    }

    fn n_shards(&self) -> usize {
        self.gguf.as_ref().map_or(0, |g| g.shards.len())
    }

    /// The path of file `f` of the model's blobs.
    pub fn file_path(&self, f: usize) -> PathBuf {
        let n = self.n_shards();
        match &self.gguf {
            Some(g) if f < n => g.shards[f].path.clone(),
            _ => self.ext[f - n].path.clone(),
        }
    }

    /// `len` bytes at `offset` of file `f`, in place (mapped or in memory).
    fn in_place(&self, f: usize, offset: u64, len: u64) -> Option<&[u8]> {
        let n = self.n_shards();
        match &self.gguf {
            Some(g) if f < n => g.shards[f].in_place(offset, len),
            _ => {
                let x = &self.ext[f - n];
                let m = x.map.as_ref()?;
                m.get(offset as usize..offset.checked_add(len)? as usize)
            }
        }
    }

    /// The open file `f` (`None` for a GGUF held in memory).
    fn file(&self, f: usize) -> Option<Arc<File>> {
        let n = self.n_shards();
        match &self.gguf {
            Some(g) if f < n => g.shards[f].file.clone(),
            _ => Some(self.ext[f - n].file.clone()),
        }
    }

    /// A blob's bytes copied into owned memory (`pread`, or from the mapping).
    fn read_blob(&self, b: &Blob) -> Result<AlignedBuf> {
        if let Some(s) = self.in_place(b.file, b.offset, b.bytes) {
            let mut buf = AlignedBuf::zeroed(s.len(), &b.name)?;
            buf.as_mut_slice().copy_from_slice(s);
            return Ok(buf);
        }
        let n = self.n_shards();
        match &self.gguf {
            Some(g) if b.file < n => g.shards[b.file].read(b.offset, b.bytes, &b.name),
            _ => {
                let x = &self.ext[b.file - n];
                if b.offset.checked_add(b.bytes).is_none_or(|e| e > x.len) {
                    bail!(
                        ErrFormat,
                        "{}: {} bytes at {} pass the end of {} ({} bytes)",
                        b.name,
                        b.bytes,
                        b.offset,
                        x.path.display(),
                        x.len
                    );
                }
                files::read_range(&x.file, b.offset, b.bytes, &b.name)
            }
        }
    }

    /// Prepare every layer's `wkv` (the shard's outputs only), `q` and `k`
    /// for the context.
    fn load_weights(&mut self) -> Result<()> {
        let m = &self.model;
        let k_out = m.d * (m.hc + 1);
        let mut layers = Vec::with_capacity(m.layers.len());
        for l in &m.layers {
            let at =
                |e: Error| Error::new(e.status, format!("layer {}: {}", l.layer_id, e.message));
            let block = match &l.wkv.source {
                WeightSource::Fp8Block { block, .. } => Some(block.0),
                _ => None,
            };
            let outs = wkv_part(k_out, block, self.shard.wkv);
            layers.push(LoadedLayer {
                wkv_outs: outs,
                wkv: self.load_weight(&l.wkv, false, (outs, k_out)).map_err(at)?,
                // q and k share one type: f16 ones become f32 (both exact).
                q: self
                    .load_weight(&l.q, true, ((0, m.hc), m.hc))
                    .map_err(at)?,
                k: self
                    .load_weight(&l.k, true, ((0, m.hc), m.hc))
                    .map_err(at)?,
            });
        }
        self.layers = layers;
        Ok(())
    }

    /// One weight as the context reads it, rows `[r0, r1)` of its `rows`
    /// (`part`); `f16_to_f32`: an f16 weight becomes f32 even where bf16
    /// would hold it (q and k, which must share one type). A part of an f16
    /// weight takes the whole weight's choice (bf16 only where every value
    /// of the whole is exact in bf16), so every shard reads the values in the
    /// format the unsharded context does.
    fn load_weight(
        &self,
        w: &WeightBlob,
        f16_to_f32: bool,
        part: ((usize, usize), usize),
    ) -> Result<LoadedWeight> {
        let b = &w.blob;
        let held = rows_of(b, part)?;
        match &w.source {
            WeightSource::Direct(ty) => {
                let align = match EngramType::from_u32(*ty) {
                    Some(EngramType::F32) => 4,
                    Some(EngramType::Bf16) => 2,
                    _ => 1,
                };
                Ok(LoadedWeight {
                    data: self.place(&held, align)?,
                    ty: *ty,
                    scales: None,
                })
            }
            WeightSource::F16 => {
                // A part takes the whole weight's choice of format.
                let whole_exact = if held.bytes == b.bytes {
                    None
                } else {
                    Some(self.f16_exact(b, f16_to_f32)?)
                };
                let raw = self.read_blob(&held)?;
                let (data, ty) = convert_f16(raw.as_slice(), &b.name, f16_to_f32, whole_exact)?;
                Ok(LoadedWeight {
                    data: WeightData::Owned(data),
                    ty,
                    scales: None,
                })
            }
            // The checkpoint's fp8 wkv as stored: codes and block scales,
            // read in place by the kernels (its values are checked by
            // `set_layer`); a shard's part is whole scale blocks.
            WeightSource::Fp8Block { scale, block } => {
                let ((o0, o1), rows) = part;
                let sb = ((o0 / block.0, o1.div_ceil(block.0)), rows.div_ceil(block.0));
                Ok(LoadedWeight {
                    data: self.place(&held, 1)?,
                    ty: EngramType::Fp8E4m3E8m0Block as u32,
                    scales: Some((self.place(&rows_of(scale, sb)?, 1)?, *block)),
                })
            }
        }
    }

    /// Whether every value of the f16 weight `b` is exact in bf16 (and
    /// `!always_f32`), read in pieces of at most 16 MiB; a NaN or infinity
    /// anywhere is `ErrInvalidData`, as for the whole weight.
    fn f16_exact(&self, b: &Blob, always_f32: bool) -> Result<bool> {
        const PIECE: u64 = 16 << 20;
        let mut exact = !always_f32;
        let mut at = 0u64;
        while at < b.bytes {
            let n = PIECE.min(b.bytes - at);
            let piece = self.read_blob(&Blob {
                offset: b.offset + at,
                bytes: n,
                ..b.clone()
            })?;
            let first = (at / 2) as usize;
            exact &= convert::f16_scan(piece.as_slice(), &b.name, first)?;
            at += n;
        }
        Ok(exact)
    }

    /// A blob as a weight reads it: in place when mapped (or in memory) and
    /// aligned to `align`, else read into owned memory.
    fn place(&self, b: &Blob, align: usize) -> Result<WeightData> {
        if self.mmap || self.file(b.file).is_none() {
            if let Some(s) = self.in_place(b.file, b.offset, b.bytes) {
                if (s.as_ptr() as usize).is_multiple_of(align) {
                    return Ok(WeightData::InPlace {
                        file: b.file,
                        offset: b.offset,
                        bytes: b.bytes,
                    });
                }
            }
        }
        Ok(WeightData::Owned(self.read_blob(b)?))
    }

    /// Host bytes the model owns beyond its files (weights read or
    /// converted at load, headers read with `pread`).
    pub fn owned_bytes(&self) -> usize {
        let w: usize = self
            .layers
            .iter()
            .flat_map(|l| [&l.wkv, &l.q, &l.k])
            .flat_map(|w| [Some(&w.data), w.scales.as_ref().map(|s| &s.0)])
            .flatten()
            .map(|d| match d {
                WeightData::Owned(b) => b.capacity_bytes(),
                WeightData::InPlace { .. } => 0,
            })
            .sum();
        let h: usize = self.gguf.as_ref().map_or(0, |g| {
            g.shards
                .iter()
                .filter(|s| !s.is_in_place())
                .map(|s| s.header_bytes().len() + s.header.heap_bytes())
                .sum()
        });
        w + h + self.model.token_map.len() * 4
    }

    fn weight_region<'a>(&'a self, w: &'a LoadedWeight) -> Result<Region<'a>> {
        self.data_region(&w.data)
    }

    fn data_region<'a>(&'a self, d: &'a WeightData) -> Result<Region<'a>> {
        Ok(match d {
            WeightData::Owned(b) => Region::of(b.as_slice()),
            WeightData::InPlace {
                file,
                offset,
                bytes,
            } => Region::of(self.in_place(*file, *offset, *bytes).ok_or_else(|| {
                Error::new(
                    EngramStatus::ErrInternal,
                    "a weight read in place is not mapped",
                )
            })?),
        })
    }

    /// A table array as the context reads it: in place when mapped (or in
    /// memory), else from its file with `pread`.
    fn table_source(&self, b: &Blob) -> Result<TableSource<'_>> {
        if self.mmap || self.file(b.file).is_none() {
            if let Some(s) = self.in_place(b.file, b.offset, b.bytes) {
                return Ok(TableSource::Memory(Region::of(s)));
            }
        }
        match self.file(b.file) {
            Some(file) => Ok(TableSource::File {
                file,
                offset: b.offset,
            }),
            None => bail!(ErrInternal, "{}: no file to read the table from", b.name),
        }
    }

    /// The epsilon a context uses: `asked` unless it is 0, else the files'
    /// ([`LoadedModel::eps`]), else [`DEFAULT_EPS`].
    pub fn eps_for(&self, asked: f32) -> f32 {
        if asked != 0.0 {
            asked
        } else {
            self.eps.unwrap_or(DEFAULT_EPS)
        }
    }

    /// A context over this model's engram layers (weights borrowed from the
    /// model).
    pub fn context(&self, o: &GgufOptions) -> Result<Context<'_>> {
        self.context_with_cache(o, 0)
    }

    /// [`LoadedModel::context`] with `device_cache_bytes` of device row
    /// cache per host-table layer (CUDA; 0: none; docs/row-cache.md).
    pub fn context_with_cache(
        &self,
        o: &GgufOptions,
        device_cache_bytes: u64,
    ) -> Result<Context<'_>> {
        let m = &self.model;
        let cfg = ContextConfig {
            geometry: Geometry {
                d: m.d,
                hc: m.hc,
                hd: m.hd,
                eps: self.eps_for(o.eps),
            },
            tables: m.tables_in(),
            limits: o.limits,
            n_threads: o.n_threads,
            backend: o.backend,
            device: o.device,
            tuning: o.tuning.clone(),
        };
        let mut ctx = Context::new(&cfg)?;
        if device_cache_bytes > 0 {
            ctx = ctx.with_device_cache(device_cache_bytes)?;
        }
        if o.row_cache_bytes > 0 {
            ctx.set_row_cache(o.row_cache_bytes)?;
        }
        ctx.set_shard(self.shard)?;
        for (l, w) in m.layers.iter().zip(&self.layers) {
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
            let t = &l.table;
            let source = self.table_source(&t.codes).map_err(at)?;
            let scales = match &t.scales {
                Some(s) => Some(self.table_source(s).map_err(at)?),
                None => None,
            };
            let layer = LayerIn {
                layer_id: l.layer_id,
                table: TableIn {
                    source,
                    scales,
                    ty: t.format as u32,
                    rows: t.rows,
                },
                wkv: self.weight_region(&w.wkv).map_err(at)?,
                wkv_type: w.wkv.ty,
                wkv_scales: match &w.wkv.scales {
                    Some((d, _)) => Some(self.data_region(d).map_err(at)?),
                    None => None,
                },
                wkv_block: w.wkv.scales.as_ref().map_or((0, 0), |&(_, (br, bc))| {
                    // A side past u32 reads as 0: refused by set_layer.
                    (
                        u32::try_from(br).unwrap_or(0),
                        u32::try_from(bc).unwrap_or(0),
                    )
                }),
                q: self.weight_region(&w.q).map_err(at)?,
                k: self.weight_region(&w.k).map_err(at)?,
                qk_type: w.q.ty,
            };
            ctx.set_layer_part(layer, w.wkv_outs).map_err(|e| {
                at(Error::new(
                    e.status,
                    format!("{}: {}", refused_tensor(l, &e.message), e.message),
                ))
            })?;
        }
        Ok(ctx)
    }

    /// Layer `li`'s `wkv`, `q` and `k` as the context gets them (type, bytes):
    /// for tests and tools.
    pub fn layer_weights(&self, li: usize) -> Result<[(u32, &[u8]); 3]> {
        let l = &self.layers[li];
        let mut out = [(0u32, &[][..]); 3];
        for (o, w) in out.iter_mut().zip([&l.wkv, &l.q, &l.k]) {
            // SAFETY: a region made from a host slice of this model.
            *o = (w.ty, unsafe { self.weight_region(w)?.host() });
        }
        Ok(out)
    }

    /// Layer `li`'s `wkv` as the context reads it when it is quantised or
    /// block-scaled fp8 (with its scales): for tools and tests.
    pub fn layer_wkv(&self, li: usize) -> Result<crate::formats::Weights<'_>> {
        use crate::formats::{Fp8Blocks, Weights};
        let w = &self.layers[li].wkv;
        let k = self.model.cols() * self.model.hd;
        // SAFETY: regions made from host slices of this model.
        let bytes = unsafe { self.weight_region(w)?.host() };
        Ok(match (EngramType::from_u32(w.ty), &w.scales) {
            (Some(EngramType::Fp8E4m3E8m0Block), Some((d, (br, bc)))) => {
                // SAFETY: as `bytes`: `data_region` makes the scales' region with
                // `Region::of` from a host slice of this model (owned or its mapped file).
                let sc = unsafe { self.data_region(d)?.host() };
                Weights::Fp8Block(Fp8Blocks::new(bytes, sc, k, *br, *bc)?)
            }
            (Some(EngramType::F32), _) | (Some(EngramType::Bf16), _) => bail!(
                ErrUnsupported,
                "layer_wkv: a dense wkv is read with layer_weights"
            ),
            (Some(f), _) => Weights::quant(f, bytes, k)?,
            (None, _) => bail!(ErrInternal, "unknown wkv type {}", w.ty),
        })
    }

    /// Layer `li`'s table rows `ids`, as the context would gather them
    /// (bf16): for tools and tests.
    pub fn table_rows(&self, li: usize, ids: &[u64]) -> Result<Vec<u16>> {
        let t = &self.model.layers[li].table;
        let hd = self.model.hd;
        let (rb, srb) = t.format.planes(hd);
        let mut out = crate::batch::try_vec(ids.len() * hd, 0u16, "rows")?;
        for (&id, o) in ids.iter().zip(out.chunks_exact_mut(hd)) {
            if id >= t.rows {
                bail!(
                    ErrInvalidRowId,
                    "row {id} outside the table's {} rows",
                    t.rows
                );
            }
            let read = |b: &Blob, n: usize| -> Result<AlignedBuf> {
                self.read_blob(&Blob {
                    offset: b.offset + id * n as u64,
                    bytes: n as u64,
                    ..b.clone()
                })
            };
            let mut row = read(&t.codes, rb)?.as_slice().to_vec();
            if let (Some(s), Some(n)) = (&t.scales, srb) {
                row.extend_from_slice(read(s, n)?.as_slice());
            }
            crate::formats::dequant_row_bf16(t.format, &row, o).map_err(|e| {
                Error::new(
                    EngramStatus::ErrInvalidData,
                    format!("{} row {id}: {}", t.codes.name, e.describe()),
                )
            })?;
        }
        Ok(out)
    }
}
