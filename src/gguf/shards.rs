//! A GGUF file, or a split set of them (`PREFIX-0000k-of-0000n.gguf`, as
//! llama.cpp's gguf-split and gguf-py write them), opened as one: every shard
//! opened and parsed, tensors looked up across shards.
//!
//! Split rules (llama.cpp's loader and gguf-py's writer): every shard carries
//! `split.no` (0-based) and `split.count`; all other metadata is in the first
//! shard; a tensor lies whole in one shard; `split.tensors.count` in the first
//! shard is the total number of tensors (a negative value, the placeholder
//! one writer leaves, is not checked). A missing shard, a shard whose
//! `split.no` is not its position, a `split.count` that disagrees with the
//! file name, or a tensor in two shards is refused, naming the shard.
//!
//! Two ways to hold a shard: mapped (`mmap = true`: the header is parsed from
//! the mapping and tensors can be read in place; a file truncated while mapped
//! raises SIGBUS), or read (`mmap = false`: only the header is read, with
//! `pread`, into owned memory, and tensor data is read with `pread` when it is
//! needed; nothing is mapped, so a truncated file is an `ErrIo` status).

use super::parser::{fmt_err, Gguf, HeaderError, Kv, TensorInfo, Value};
use crate::error::{bail, Error, Result};
use crate::files::{self, AlignedBuf};
use crate::EngramStatus;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The first read of a header in `pread` mode, and the most it grows to.
const FIRST_HEADER_READ: u64 = 1 << 20;
/// Largest header read in `pread` mode (a tokenizer's arrays are ~20 MB).
pub(crate) const MAX_HEADER_BYTES: u64 = 256 << 20;

enum Data {
    /// The whole file, mapped.
    Mapped(memmap2::Mmap),
    /// The header only, read with `pread` (tensor data is read on demand).
    Header(Vec<u8>),
    /// The whole file, in memory (tests and fuzzing).
    Memory(Vec<u8>),
}

/// One GGUF file of a set.
pub struct Shard {
    pub path: PathBuf,
    /// The file name, for messages.
    pub name: String,
    /// The open file (`None` for a file given in memory).
    pub file: Option<Arc<File>>,
    /// Bytes of the file when it was opened.
    pub len: u64,
    data: Data,
    pub header: Gguf,
}

impl Shard {
    /// Open and parse `path` (mapped when `mmap`, else its header read with `pread`).
    pub fn open(path: &Path, mmap: bool) -> Result<Shard> {
        let (file, len) = files::open_regular(path, "GGUF file")?;
        Self::from_file(file, len, path, mmap)
    }

    /// Shard `name` of a set, opened from the set's directory by the rule for
    /// every file a loader reads there ([`files::ModelDir`]).
    fn open_in(dir: Option<&files::ModelDir>, name: &str, mmap: bool) -> Result<Shard> {
        match dir
            .map(|d| d.open_name(name, "GGUF file"))
            .transpose()?
            .flatten()
        {
            Some(o) => Self::from_file(o.file, o.len, &o.path, mmap),
            None => bail!(
                ErrIo,
                "GGUF file {}: no such file",
                dir.map_or_else(|| name.into(), |d| d.display(Path::new(name)))
                    .display()
            ),
        }
    }

    fn from_file(file: File, len: u64, path: &Path, mmap: bool) -> Result<Shard> {
        let at = |e: Error| Error::new(e.status, format!("{}: {}", path.display(), e.message));
        if len == 0 {
            bail!(ErrFormat, "{}: empty file, not GGUF", path.display());
        }
        let (data, header) = if mmap {
            let map = files::map(&file, len, path, "GGUF file")?;
            let header = Gguf::parse_header(&map, len)
                .map_err(HeaderError::into_error)
                .map_err(at)?;
            (Data::Mapped(map), header)
        } else {
            let (bytes, header) = read_header(&file, len).map_err(at)?;
            (Data::Header(bytes), header)
        };
        Ok(Shard {
            path: path.to_path_buf(),
            name: file_name(path),
            file: Some(Arc::new(file)),
            len,
            data,
            header,
        })
    }

    /// A shard held in memory under the file name `name`.
    pub fn from_memory(name: &str, bytes: Vec<u8>) -> Result<Shard> {
        let header = Gguf::parse(&bytes)
            .map_err(|e| Error::new(e.status, format!("{name}: {}", e.message)))?;
        Ok(Shard {
            path: PathBuf::from(name),
            name: name.to_string(),
            file: None,
            len: bytes.len() as u64,
            data: Data::Memory(bytes),
            header,
        })
    }

    /// The bytes the header was parsed from (metadata arrays point into them).
    pub fn header_bytes(&self) -> &[u8] {
        match &self.data {
            Data::Mapped(m) => m,
            Data::Header(v) | Data::Memory(v) => v,
        }
    }

    /// `len` bytes at `offset`, in place: the mapping or the in-memory file
    /// (`None` in `pread` mode). The range was checked against the file.
    pub fn in_place(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let b: &[u8] = match &self.data {
            Data::Mapped(m) => m,
            Data::Memory(v) => v,
            Data::Header(_) => return None,
        };
        let end = offset.checked_add(len)?;
        b.get(usize::try_from(offset).ok()?..usize::try_from(end).ok()?)
    }

    /// Whether tensor data is read in place (mapped or in memory).
    pub fn is_in_place(&self) -> bool {
        !matches!(self.data, Data::Header(_))
    }

    /// `len` bytes at `offset` copied into owned aligned memory (`pread` in
    /// `pread` mode), named `what`.
    pub fn read(&self, offset: u64, len: u64, what: &str) -> Result<AlignedBuf> {
        if let Some(b) = self.in_place(offset, len) {
            let mut buf = AlignedBuf::zeroed(b.len(), what)?;
            buf.as_mut_slice().copy_from_slice(b);
            return Ok(buf);
        }
        match &self.file {
            Some(f) => files::read_range(f, offset, len, &format!("{}: {what}", self.name)),
            None => Err(fmt_err(format!(
                "{}: {what}: {len} bytes at {offset} outside the file",
                self.name
            ))),
        }
    }

    /// Integer `split.*` key of this shard.
    fn split_key(&self, key: &str) -> Result<Option<i128>> {
        match self.header.get(key) {
            None => Ok(None),
            Some(Kv {
                value: Value::Int(v),
                ..
            }) => Ok(Some(*v)),
            Some(kv) => bail!(
                ErrFormat,
                "{}: {key} is a {}, expected an integer",
                self.name,
                super::parser::vt_name(kv.ty)
            ),
        }
    }
}

/// Read a header with `pread`, growing the read until the header fits.
fn read_header(file: &File, len: u64) -> Result<(Vec<u8>, Gguf)> {
    let mut n = len.min(FIRST_HEADER_READ);
    loop {
        let mut buf = crate::batch::try_vec(n as usize, 0u8, "the GGUF header")?;
        files::read_exact_at(file, &mut buf, 0, "the GGUF header")?;
        match Gguf::parse_header(&buf, len) {
            Ok(g) => {
                // Everything the header refers to lies before its end; keep
                // only that (a copy when the read overshot by more than 1/8).
                buf.truncate(g.header_len);
                if buf.capacity() - buf.len() > buf.len() / 8 {
                    buf.shrink_to_fit();
                }
                return Ok((buf, g));
            }
            Err(HeaderError::Truncated(e)) => {
                if n >= MAX_HEADER_BYTES {
                    bail!(
                        ErrFormat,
                        "the GGUF header is larger than the {MAX_HEADER_BYTES} bytes this library reads \
                         without mapping the file (or corrupt: {})",
                        e.message
                    );
                }
                n = n.saturating_mul(2).min(len).min(MAX_HEADER_BYTES);
            }
            Err(HeaderError::Bad(e)) => return Err(e),
        }
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

/// `(prefix, k, n)` of a split file name `PREFIX-0000k-of-0000n.gguf` (five
/// digits each, as llama.cpp's `llama_split_path` writes them).
pub fn split_name(name: &str) -> Option<(String, u32, u32)> {
    let stem = name.strip_suffix(".gguf")?;
    let (rest, n) = stem.rsplit_once("-of-")?;
    let (prefix, k) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|c| c.is_ascii_digit());
    if !digits(k) || !digits(n) || prefix.is_empty() {
        return None;
    }
    Some((prefix.to_string(), k.parse().ok()?, n.parse().ok()?))
}

/// The file name of shard `k` (1-based) of `n`.
pub fn shard_name(prefix: &str, k: u32, n: u32) -> String {
    format!("{prefix}-{k:05}-of-{n:05}.gguf")
}

/// One GGUF file or a whole split set.
pub struct GgufSet {
    /// In order; the first holds the metadata.
    pub shards: Vec<Shard>,
    tensors: HashMap<String, (usize, usize)>,
}

impl GgufSet {
    /// Open `path`, and, when it is one shard of a split set, every shard of
    /// the set (from the file name and `split.count`).
    pub fn open(path: &Path, mmap: bool) -> Result<GgufSet> {
        let first = Shard::open(path, mmap)?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let mut held: Option<Option<files::ModelDir>> = None;
        Self::assemble(first, |name| {
            if held.is_none() {
                held = Some(files::ModelDir::open(&dir)?);
            }
            Shard::open_in(held.as_ref().and_then(Option::as_ref), name, mmap)
        })
    }

    /// A set from files in memory, `(file name, bytes)`: the first is the one
    /// opened, the others are found by name (tests and fuzzing).
    pub fn from_memory(mut files: Vec<(String, Vec<u8>)>) -> Result<GgufSet> {
        if files.is_empty() {
            bail!(ErrInvalidArgument, "no GGUF file given");
        }
        let (name, bytes) = files.remove(0);
        let first = Shard::from_memory(&name, bytes)?;
        Self::assemble(first, |n| match files.iter().position(|(f, _)| f == n) {
            Some(i) => {
                let (f, b) = files.remove(i);
                Shard::from_memory(&f, b)
            }
            None => Err(Error::new(
                EngramStatus::ErrIo,
                format!("split GGUF: {n}: no such file"),
            )),
        })
    }

    fn assemble(first: Shard, open: impl FnMut(&str) -> Result<Shard>) -> Result<GgufSet> {
        let shards = match first.split_key("split.count")? {
            None | Some(1) => vec![Self::single(first)?],
            Some(n) if !(2..=99_999).contains(&n) => bail!(
                ErrFormat,
                "{}: split.count is {n} (a split set has 1 to 99999 shards)",
                first.name
            ),
            Some(n) => Self::open_split(first, n as u32, open)?,
        };
        let tensors = Self::index_tensors(&shards)?;
        Self::check_tensor_count(&shards, &tensors)?;
        Ok(GgufSet { shards, tensors })
    }

    /// A file that is not split: its split.no, if any, is 0.
    fn single(first: Shard) -> Result<Shard> {
        if let Some(no) = first.split_key("split.no")?.filter(|&n| n != 0) {
            bail!(
                ErrFormat,
                "{}: split.no is {no} but split.count is 1 (or absent)",
                first.name
            );
        }
        Ok(first)
    }

    /// Every shard of the set of `n` that `first` (found by its file name)
    /// belongs to, in order, the others opened by name.
    fn open_split(
        first: Shard,
        n: u32,
        mut open: impl FnMut(&str) -> Result<Shard>,
    ) -> Result<Vec<Shard>> {
        let Some((prefix, k, n_name)) = split_name(&first.name) else {
            bail!(
                ErrFormat,
                "{}: split.count is {n}, but the file name does not follow PREFIX-0000k-of-0000n.gguf, \
                 so the other shards cannot be found",
                first.name
            );
        };
        if n_name != n {
            bail!(
                ErrFormat,
                "{}: split.count is {n} but the file name says {n_name} shards",
                first.name
            );
        }
        if k == 0 || k > n {
            bail!(ErrFormat, "{}: shard {k} of {n} does not exist", first.name);
        }
        let mut first = Some((k, first));
        let mut shards = Vec::with_capacity(n as usize);
        for j in 1..=n {
            let s = match first.take() {
                Some((kk, s)) if kk == j => s,
                other => {
                    first = other;
                    let name = shard_name(&prefix, j, n);
                    open(&name).map_err(|e| {
                        Error::new(
                            e.status,
                            format!(
                                "split GGUF: shard {j} of {n} ({name}) cannot be used: {}",
                                e.message
                            ),
                        )
                    })?
                }
            };
            Self::check_split_keys(&s, j, n)?;
            shards.push(s);
        }
        Ok(shards)
    }

    /// Shard `j` of `n` by its name says so in its split keys.
    fn check_split_keys(s: &Shard, j: u32, n: u32) -> Result<()> {
        let no = s.split_key("split.no")?;
        if no != Some(j as i128 - 1) {
            bail!(
                ErrFormat,
                "split GGUF: {} is shard {j} of {n} by its name, but its split.no is {} (expected {})",
                s.name,
                no.map_or("absent".into(), |v| v.to_string()),
                j - 1
            );
        }
        let c = s.split_key("split.count")?;
        if c != Some(n as i128) {
            bail!(
                ErrFormat,
                "split GGUF: {}: split.count is {}, the set has {n} shards",
                s.name,
                c.map_or("absent".into(), |v| v.to_string())
            );
        }
        Ok(())
    }

    /// Where each tensor is (shard, entry); no tensor in two shards.
    fn index_tensors(shards: &[Shard]) -> Result<HashMap<String, (usize, usize)>> {
        let mut tensors = HashMap::new();
        for (si, s) in shards.iter().enumerate() {
            for (ti, t) in s.header.tensors.iter().enumerate() {
                if let Some((other, _)) = tensors.insert(t.name.clone(), (si, ti)) {
                    bail!(
                        ErrFormat,
                        "split GGUF: tensor {} is in both {} and {}",
                        t.name,
                        shards[other].name,
                        s.name
                    );
                }
            }
        }
        Ok(tensors)
    }

    /// A split set holds the tensors its first shard's
    /// split.tensors.count says (when stated and not negative).
    fn check_tensor_count(
        shards: &[Shard],
        tensors: &HashMap<String, (usize, usize)>,
    ) -> Result<()> {
        if shards.len() > 1 {
            if let Some(total) = shards[0].split_key("split.tensors.count")? {
                if total >= 0 && total != tensors.len() as i128 {
                    bail!(
                        ErrFormat,
                        "split GGUF: split.tensors.count in {} is {total}, the {} shards hold {} tensors",
                        shards[0].name,
                        shards.len(),
                        tensors.len()
                    );
                }
            }
        }
        Ok(())
    }

    /// The first shard's header (all metadata is there).
    pub fn header(&self) -> &Gguf {
        &self.shards[0].header
    }

    /// The bytes the first shard's header was parsed from.
    pub fn header_bytes(&self) -> &[u8] {
        self.shards[0].header_bytes()
    }

    pub fn get(&self, key: &str) -> Option<&Kv> {
        self.header().get(key)
    }

    /// Tensor `name` and the index of the shard that holds it.
    pub fn tensor(&self, name: &str) -> Option<(usize, &TensorInfo)> {
        self.tensors
            .get(name)
            .map(|&(s, t)| (s, &self.shards[s].header.tensors[t]))
    }

    /// Every tensor, with its shard.
    pub fn tensors(&self) -> impl Iterator<Item = (usize, &TensorInfo)> {
        self.shards
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.header.tensors.iter().map(move |t| (i, t)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        assert_eq!(
            split_name("m-00002-of-00011.gguf"),
            Some(("m".into(), 2, 11))
        );
        assert_eq!(shard_name("m", 2, 11), "m-00002-of-00011.gguf");
        assert_eq!(split_name("m.gguf"), None);
        assert_eq!(split_name("m-2-of-11.gguf"), None);
        assert_eq!(split_name("-00002-of-00011.gguf"), None);
    }
}
