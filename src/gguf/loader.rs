//! A context straight from a mapped GGUF file.

use super::meta::EngramModel;
use super::parser::{fmt_err, Gguf, TensorInfo};
use crate::backend::{LayerIn, TableIn, TableSource};
use crate::batch::{Geometry, Limits};
use crate::context::{Context, ContextConfig, Tuning};
use crate::error::{bail, Error, Result};
use crate::formats::{EngramType, WeightDtype, WeightFormat};
use crate::memory::Region;
use crate::tables::EngramTables;
use crate::EngramStatus;
use std::path::{Path, PathBuf};

/// Options of [`GgufModel::context`] (the C options struct carries the same).
#[derive(Clone, Debug)]
pub struct GgufOptions {
    pub limits: Limits,
    pub n_threads: usize,
    pub backend: u32,
    pub device: i32,
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
            device: o.device,
            tuning: Tuning::default(),
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
            EngramType::row_format(l.embd.ty, m.hd).map_err(|e| {
                at(Error::new(
                    e.status,
                    format!("{}: {}", l.embd.name, e.message),
                ))
            })?;
            let rows = l.embd.dims.get(1).copied().unwrap_or(1);
            let kv_in = m.hd * (m.max_ngram - 1) * m.n_heads;
            let wkv = self.weight(&l.wkv, kv_in, true).map_err(at)?;
            let q = self.weight(&l.q, m.d, false).map_err(at)?;
            let k = self.weight(&l.k, m.d, false).map_err(at)?;
            let source = if o.mmap_tables {
                TableSource::Memory(Region::of(self.data(&l.embd)))
            } else {
                TableSource::File {
                    file: self.file.clone(),
                    offset: l.embd.offset,
                }
            };
            ctx.set_layer(LayerIn {
                layer_id: l.layer_id,
                table: TableIn {
                    source,
                    ty: l.embd.ty,
                    rows,
                },
                wkv,
                wkv_type: l.wkv.ty,
                q,
                k,
                qk_type: l.q.ty,
            })
            .map_err(at)?;
        }
        Ok(ctx)
    }

    /// A weight tensor's data as a region, after the checks that name the
    /// tensor: its type (f32, bf16, or GGUF blocks where `quant_ok`) and the
    /// alignment its element type needs.
    fn weight(&self, t: &TensorInfo, row_len: usize, quant_ok: bool) -> Result<Region<'_>> {
        let fmt = if quant_ok {
            WeightFormat::new(t.ty, row_len, &t.name)?
        } else {
            WeightFormat::Dense(WeightDtype::new(t.ty, &t.name)?)
        };
        let data = self.data(t);
        let align = match fmt {
            WeightFormat::Dense(d) => d.size(),
            WeightFormat::Quant(_) => 1,
        };
        if !(data.as_ptr() as usize).is_multiple_of(align) {
            return Err(fmt_err(format!(
                "tensor {}: data not aligned to {align} bytes",
                t.name
            )));
        }
        Ok(Region::of(data))
    }
}
