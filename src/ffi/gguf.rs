//! A context straight from a GGUF file.

use super::boundary::{give_object, non_null, path_arg, read_options, write_options};
use super::context::EngramContext;
use crate::backend::EngramBackend;
use crate::batch::Limits;
use crate::error::{bail, EngramStatus};
use std::ffi::c_char;

/// Options of `engram_create_from_gguf`. Fill with `engram_gguf_options_init`.
/// Every field is plain data.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramGgufOptions {
    /// `sizeof(engram_gguf_options)` of the caller's header (set by `engram_gguf_options_init`).
    pub struct_size: usize,
    /// `ENGRAM_BACKEND_CPU`, or `ENGRAM_BACKEND_CUDA`: the tables stay in the
    /// file (rows read on the host and copied to the device per call, see
    /// `engram_prefetch`), `wkv` is copied to the device at create.
    pub backend: u32,
    /// CUDA device ordinal (ignored by the CPU backend).
    pub device: i32,
    /// RMS epsilon of the gate (default 1e-6).
    pub eps: f32,
    /// As in `engram_config`.
    pub max_tokens: u32,
    pub max_seqs: u32,
    pub max_positions: u32,
    /// Threads of one call; the prefetch gathers use `max(2, n_threads)`.
    pub n_threads: u32,
    /// For a file without the hash constants: the model's `config.json` and
    /// `tokenizer.json` to derive them from (NULL otherwise). When given, they
    /// must agree with any constants the file has.
    pub config_json: *const c_char,
    pub tokenizer_json: *const c_char,
    /// 0 (default): table rows are read with `pread` on the file, so an I/O
    /// error is `ENGRAM_STATUS_ERR_IO`; 1: read from the mapping (a file
    /// truncated while mapped then raises SIGBUS).
    pub mmap_tables: u32,
}

/// The smallest `engram_gguf_options` this library reads (its 0.1 layout).
const GGUF_OPTIONS_MIN_SIZE: usize = size_of::<EngramGgufOptions>();

impl Default for EngramGgufOptions {
    fn default() -> Self {
        EngramGgufOptions {
            struct_size: size_of::<EngramGgufOptions>(),
            backend: EngramBackend::Cpu as u32,
            device: 0,
            eps: 1e-6,
            max_tokens: 4096,
            max_seqs: 64,
            max_positions: 131072,
            n_threads: 1,
            config_json: std::ptr::null(),
            tokenizer_json: std::ptr::null(),
            mmap_tables: 0,
        }
    }
}

/// Fill `o`'s first `struct_size` bytes with the defaults: the CPU backend,
/// `eps = 1e-6`, `max_tokens = 4096`, `max_seqs = 64`, `max_positions =
/// 131072`, one thread, no config/tokenizer, `pread` tables. NULL is ignored.
/// Call it through the header's `engram_gguf_options_init(o)`.
#[no_mangle]
pub extern "C" fn engram_gguf_options_init_sized(o: *mut EngramGgufOptions, struct_size: usize) {
    ffi_boundary!({ write_options(o, EngramGgufOptions::default(), struct_size) })
}

/// Create a context straight from a GGUF file: the `deepseek41.engram.*`
/// metadata (hash constants in any of the integer widths seen in the wild;
/// offsets may be absent) and each engram layer's `blk.{i}.engram_embd`,
/// `engram_wkv`, `engram_q`, `engram_k` tensors, set as the layers' weights.
/// The file is mapped for the context's life (freed by `engram_free`). A file
/// without the hash constants needs `options.config_json` and
/// `options.tokenizer_json`; without them the call fails naming the missing
/// keys. Statuses: `ERR_IO` (cannot open or map), `ERR_FORMAT` (not GGUF,
/// truncated, tensor sizes that disagree with their shapes, missing tensors),
/// `ERR_UNSUPPORTED` (GGUF version, unknown tensor type), `ERR_INVALID_CONFIG`
/// (missing or inconsistent hash constants). On failure `*out` is left as it was.
///
/// `path` must be NULL or a NUL-terminated path; `options` NULL or filled by
/// `engram_gguf_options_init`; `out` NULL or writable.
#[no_mangle]
pub extern "C" fn engram_create_from_gguf(
    path: *const c_char,
    options: *const EngramGgufOptions,
    out: *mut *mut EngramContext,
) -> EngramStatus {
    ffi_boundary!({
        let p = path_arg(path, "path")?;
        let o = read_options(
            options,
            EngramGgufOptions::default(),
            GGUF_OPTIONS_MIN_SIZE,
            "options",
        )?;
        non_null(out, "out")?;
        if o.backend != EngramBackend::Cpu as u32 && o.backend != EngramBackend::Cuda as u32 {
            bail!(ErrUnsupported, "unknown backend {}", o.backend);
        }
        let companion = match (o.config_json.is_null(), o.tokenizer_json.is_null()) {
            (true, true) => None,
            (false, false) => Some(crate::tables::EngramTables::from_files(
                path_arg(o.config_json, "options.config_json")?,
                path_arg(o.tokenizer_json, "options.tokenizer_json")?,
            )?),
            _ => bail!(
                ErrInvalidArgument,
                "options.config_json and options.tokenizer_json go together: set both or neither"
            ),
        };
        let model = Box::new(crate::gguf::GgufModel::open(p, companion.as_ref())?);
        let opts = crate::gguf::GgufOptions {
            limits: Limits {
                max_tokens: o.max_tokens as usize,
                max_seqs: o.max_seqs as usize,
                max_positions: o.max_positions as usize,
            },
            n_threads: o.n_threads as usize,
            backend: o.backend,
            device: o.device,
            eps: o.eps,
            mmap_tables: o.mmap_tables != 0,
        };
        // SAFETY: the context borrows the mapping inside `model`, a heap
        // allocation that does not move when the box does; the EngramContext
        // owns the box and drops it after the context (field order).
        let m: &'static crate::gguf::GgufModel = unsafe { &*(model.as_ref() as *const _) };
        let inner = m.context(&opts)?;
        give_object(
            out,
            EngramContext {
                inner,
                _owner: Some(model),
            },
        );
        Ok(())
    })
}
