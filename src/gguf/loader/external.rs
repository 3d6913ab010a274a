//! Tables outside the GGUF file: finding the checkpoint shard or table file
//! they live in, and reading their blobs from it.

use super::*;

impl ExtFile {
    /// A table file opened by [`find_external`].
    pub(super) fn open(f: files::Opened, mmap: bool) -> Result<ExtFile> {
        let map = if mmap {
            Some(files::map(&f.file, f.len, &f.path, "table file")?)
        } else {
            None
        };
        Ok(ExtFile {
            path: f.path,
            file: Arc::new(f.file),
            len: f.len,
            map,
        })
    }

    pub(super) fn from_st(f: StFile, mmap: bool) -> Result<ExtFile> {
        let map = if mmap {
            Some(files::map(&f.file, f.len, &f.path, "safetensors file")?)
        } else {
            None
        };
        Ok(ExtFile {
            path: f.path,
            file: Arc::new(f.file),
            len: f.len,
            map,
        })
    }
}

/// Where a table outside the GGUF file is: the recorded path under
/// `tables_dir` when given, else under the GGUF's own directory, by the one
/// rule for paths from a model file ([`files::ModelDir::open_recorded`]: an
/// absolute path keeps only its file name; `..` and links that lead outside
/// are refused), and opened: the file checked is the file read.
pub(super) fn find_external(
    x: &External,
    tables_dir: Option<&Path>,
    gguf_dir: &Path,
) -> Result<files::Opened> {
    let base = tables_dir.unwrap_or(gguf_dir);
    if let Some(dir) = files::ModelDir::open(base)? {
        if let Some(f) = dir.open_recorded(x.recorded(), x.key())? {
            return Ok(f);
        }
    }
    let looked = base.join(files::confined_candidate(x.recorded(), x.key())?);
    let lid = match x {
        External::Shard { layer_id, .. } | External::Offsets { layer_id, .. } => *layer_id,
    };
    bail!(
        ErrIo,
        "the engram tables live outside this file: {} names {} for layer {lid}, which is not there \
         (looked for {}). Set tables_dir (engram_gguf_options.tables_dir) to the directory that holds the \
         checkpoint's safetensors shards (the file names are kept), or open the checkpoint directory itself \
         with engram_create_from_safetensors",
        x.key(),
        x.recorded(),
        looked.display()
    )
}

/// A table outside the GGUF file, in file `fi` of the model.
pub(super) fn external_table(
    x: &External,
    f: &ExtFile,
    fi: usize,
    hd: Option<u64>,
) -> Result<TableBlobs> {
    match x {
        External::Shard { layer_id, key, .. } => {
            let h = crate::safetensors::parse_header(&f.file, f.len, &f.path.display().to_string())
                .map_err(|e| {
                    Error::new(
                        e.status,
                        format!("{key} names {}: {}", f.path.display(), e.message),
                    )
                })?;
            crate::safetensors::embed_table(&h, &f.path.display().to_string(), *layer_id, hd, fi)
        }
        External::Offsets {
            layer_id,
            weight_key,
            weight_offset,
            scale_key,
            scale_offset,
            rows,
            ..
        } => {
            let Some(hd) = hd else {
                bail!(ErrFormat, "no row width for the table of layer {layer_id}");
            };
            let plane = |key: &str, off: u64, per_row: u64| -> Result<Blob> {
                let bytes = rows.checked_mul(per_row).ok_or_else(|| {
                    Error::new(
                        EngramStatus::ErrFormat,
                        format!("{key}: {rows} rows overflow"),
                    )
                })?;
                if off.checked_add(bytes).is_none_or(|e| e > f.len) {
                    bail!(
                        ErrFormat,
                        "{key} = {off}: the {rows} rows of {per_row} bytes there ({bytes} bytes) pass the end of \
                         {} ({} bytes)",
                        f.path.display(),
                        f.len
                    );
                }
                Ok(Blob {
                    name: key.to_string(),
                    file: fi,
                    offset: off,
                    bytes,
                    dims: vec![per_row, *rows],
                })
            };
            Ok(TableBlobs {
                format: EngramType::Fp8E4m3E8m0Split,
                rows: *rows,
                codes: plane(weight_key, *weight_offset, hd)?,
                scales: Some(plane(scale_key, *scale_offset, hd / 32)?),
            })
        }
    }
}
