//! A context straight from a GGUF file (any dialect, split sets).

use super::boundary::{give_object, non_null, path_arg, read_options, write_options, Options};
use super::context::EngramContext;
use crate::backend::EngramBackend;
use crate::batch::Limits;
use crate::context::ShardSpec;
use crate::error::{bail, EngramStatus, Result};
use crate::gguf::{GgufOptions, LoadOptions, LoadedModel};
use crate::tables::{EngramTables, TokenMap};
use std::ffi::c_char;

/// Options of `engram_create_from_gguf`. Fill with `engram_gguf_options_init`.
/// Every field is plain data.
///
/// Layouts accepted (`struct_size`): the 0.2 layout, which ends after
/// `mmap_tables` (`tables_dir` reads as NULL), the 0.3 layout, which ends
/// after `tables_dir` (`row_cache_bytes` and `device_cache_bytes` read as 0), the
/// layout that ends after `device_cache_bytes` (the shard fields read as the
/// whole layer, `exact_quant_wkv` as 0), and the layout of this header.
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
    /// RMS epsilon of the gate. 0 (the default): the file's, else 1e-6
    /// (GGUF, any dialect: `{general.architecture}.attention.layer_norm_rms_epsilon`,
    /// that is `deepseek41.` or `deepseek4.`; the checkpoint:
    /// `config.json`'s `rms_norm_eps`, in `text_config` or at the top level).
    /// Any other value must be finite and > 0, as in `engram_config`.
    /// `engram_context_info` reports the value in use.
    pub eps: f32,
    /// As in `engram_config`.
    pub max_tokens: u32,
    pub max_seqs: u32,
    pub max_positions: u32,
    /// Threads of one call; the prefetch gathers use `max(2, n_threads)`.
    /// At most 1024 (more is `ENGRAM_STATUS_ERR_INVALID_CONFIG` at create).
    pub n_threads: u32,
    /// For a file without the hash constants: the model's `config.json` and
    /// `tokenizer.json` to derive them from (NULL otherwise). When given, they
    /// must agree with any constants the file has. `tokenizer_json` may come
    /// alone for a file that carries the engram config keys but no constants
    /// (deepstrix); `config_json` never comes alone.
    pub config_json: *const c_char,
    pub tokenizer_json: *const c_char,
    /// 0 (default): nothing is mapped: the headers, `wkv`, `q` and `k` are
    /// read with `pread` into memory the context owns (the bytes of every
    /// layer's `wkv`, `q` and `k` as stored: 315 MB per layer for the released
    /// model in bf16), and table rows are read with `pread` when gathered, so
    /// a file cut short is `ENGRAM_STATUS_ERR_IO`, never a signal. 1: the files
    /// are mapped and read in place (no copy; a file truncated while mapped
    /// raises SIGBUS).
    pub mmap_tables: u32,
    /// For a file whose tables live outside it (deepstrix's
    /// `deepseek4.engram.table_shards`, a shard path and offsets): the
    /// directory holding the checkpoint's safetensors shards (the recorded
    /// file names are kept; a `tokenizer.json` there also completes a file
    /// without hash constants). NULL: the recorded path, then the GGUF file's
    /// directory. (A struct from a 0.2 header ends before this field.)
    pub tables_dir: *const c_char,
    /// Bytes of the host row cache in front of the tables read from files
    /// (docs/row-cache.md; `mmap_tables = 0`: a mapped table is the page
    /// cache's), the context's total, each engram layer an equal share; 0
    /// (the default): no cache. A budget whose memory cannot be had is
    /// `ENGRAM_STATUS_ERR_CAPACITY` at create. `engram_cache_stats_read` reports
    /// what each layer holds. (A struct from an older header ends before
    /// this field: no cache.)
    pub row_cache_bytes: u64,
    /// As in `engram_config`: bytes of device row cache for each layer
    /// whose table stays in the file (CUDA backend; 0, the default: none;
    /// ignored by the CPU backend). (A struct from a 0.3 header ends before
    /// this field.)
    pub device_cache_bytes: u64,
    /// A shard context (docs/sharding.md "Shard contexts"): the context
    /// holds part `shard_table_rank` of `shard_table_world` of every layer's
    /// table rows and part `shard_wkv_rank` of `shard_wkv_world` of `wkv`'s
    /// outputs, as `engram_context_set_shard` makes it, and the loader reads
    /// (and converts) only that part of `wkv` and its scales, so a rank's
    /// memory for `wkv` is its share (`engram_context_memory`); table rows
    /// are read only when gathered, only the rank's. A later
    /// `engram_context_set_shard` may narrow the part but not leave it.
    /// `(0, 1, 0, 1)` (the default): the whole layer. A world of 0 or a rank
    /// not below its world is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` at create.
    /// (A struct from an older header ends before these fields: the whole
    /// layer.)
    pub shard_table_rank: u32,
    pub shard_table_world: u32,
    pub shard_wkv_rank: u32,
    pub shard_wkv_world: u32,
    /// As in `engram_config`: 0 (the default), a `Q4_K` `wkv` may be
    /// multiplied by integer dot products within docs/numerics.md's bound
    /// of its f32 twin; 1, every GGUF-block `wkv` gives the twin's bits.
    /// Other values are `ENGRAM_STATUS_ERR_INVALID_CONFIG`. (A struct from an
    /// older header ends before this field: 0.)
    pub exact_quant_wkv: u32,
}

/// The `engram_gguf_options` layouts this library reads: the 0.2 one, which
/// ends before `tables_dir`, the 0.3 one, which ends before
/// `row_cache_bytes`, one that ends before the shard fields, and
/// today's.
const GGUF_OPTIONS_LAYOUTS: &[usize] = &[
    std::mem::offset_of!(EngramGgufOptions, tables_dir),
    std::mem::offset_of!(EngramGgufOptions, row_cache_bytes),
    std::mem::offset_of!(EngramGgufOptions, shard_table_rank),
    size_of::<EngramGgufOptions>(),
];

impl Options for EngramGgufOptions {
    const INIT: &'static str = "engram_gguf_options_init";
}

impl Default for EngramGgufOptions {
    fn default() -> Self {
        EngramGgufOptions {
            struct_size: size_of::<EngramGgufOptions>(),
            backend: EngramBackend::Cpu as u32,
            device: 0,
            eps: 0.0,
            max_tokens: 4096,
            max_seqs: 64,
            max_positions: 131072,
            n_threads: 1,
            config_json: std::ptr::null(),
            tokenizer_json: std::ptr::null(),
            mmap_tables: 0,
            tables_dir: std::ptr::null(),
            row_cache_bytes: 0,
            device_cache_bytes: 0,
            shard_table_rank: 0,
            shard_table_world: 1,
            shard_wkv_rank: 0,
            shard_wkv_world: 1,
            exact_quant_wkv: 0,
        }
    }
}

/// Fill `o`'s first `struct_size` bytes with the defaults: the CPU backend,
/// `eps = 0` (the file's), `max_tokens = 4096`, `max_seqs = 64`, `max_positions =
/// 131072`, one thread, no config/tokenizer, `pread` tables, no tables
/// directory. NULL is ignored.
/// Call it through the header's `engram_gguf_options_init(o)`.
#[no_mangle]
pub extern "C" fn engram_gguf_options_init_sized(o: *mut EngramGgufOptions, struct_size: usize) {
    ffi_boundary!({ write_options(o, EngramGgufOptions::default(), struct_size) })
}

/// Create a context straight from a GGUF file, in the dialect of any public
/// DeepSeek-V4.1 converter (the table in docs/loading.md): llama.cpp's
/// `deepseek41.engram.*` keys (also spelled `deepseek4.engram.*`), ds4,
/// tarruda, JigSawPT, deepstrix and shard-path-plus-offsets files. The
/// dialect is recognised from the keys that identify it; hash constants in
/// any integer width that holds them (a value that does not fit is refused
/// naming the key), from metadata or tensors; the pad read as the dialect
/// stores it (a compressed or a raw id; where a key's reading is ambiguous
/// and the two readings differ, the call is refused naming both values);
/// tables as ggml rows, 264-byte fp8 rows, or fp8 codes and scales in two
/// tensors (`ENGRAM_TYPE_FP8_E4M3_E8M0_SPLIT`), read in place. A split set
/// (`PREFIX-0000k-of-0000n.gguf`) is opened from any of its shards; every
/// shard is opened. Tables outside the file are read from the checkpoint's
/// shards (`options.tables_dir`) or the call says where they are. Every
/// layer's tensors and the hash layout are checked against each other
/// (`engram-inspect` prints the same checks). The context owns what it
/// opened (freed by `engram_free`). Statuses: `ERR_IO` (a file cannot be
/// opened or read, is not a regular file, a shard is missing),
/// `ERR_FORMAT` (not GGUF, truncated, sizes that overflow, a missing or
/// mistyped key or tensor, constants that disagree with each other or with
/// the tables), `ERR_UNSUPPORTED` (GGUF version, a tensor type this build
/// does not read, an unknown backend), `ERR_DEVICE` (the CUDA backend without
/// a usable driver or device), `ERR_INVALID_CONFIG` (missing hash constants without
/// config + tokenizer, companion files that disagree, an ambiguous pad),
/// `ERR_INVALID_DATA` (an fp8 or f16 weight holding NaN). On failure `*out`
/// is left as it was.
///
/// `path` must be NULL or a NUL-terminated path; `options` NULL or filled by
/// `engram_gguf_options_init` (a NULL `options` is `ERR_NULL_ARGUMENT`, not
/// the defaults: the defaults are what `_init` fills); `out` NULL or writable.
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
            GGUF_OPTIONS_LAYOUTS,
            "options",
        )?;
        non_null(out, "out")?;
        let shard = ShardSpec::new(
            (o.shard_table_rank, o.shard_table_world),
            (o.shard_wkv_rank, o.shard_wkv_world),
        )?;
        let mut opts = context_options(
            o.backend,
            o.device,
            o.eps,
            (o.max_tokens, o.max_seqs, o.max_positions),
            o.n_threads,
        )?;
        opts.row_cache_bytes = o.row_cache_bytes;
        let (companion, tokenizer) = companions(o.config_json, o.tokenizer_json)?;
        let tables_dir = if o.tables_dir.is_null() {
            None
        } else {
            Some(path_arg(o.tables_dir, "options.tables_dir")?)
        };
        let lo = LoadOptions {
            mmap: o.mmap_tables != 0,
            companion: companion.as_ref(),
            tokenizer: tokenizer.as_ref(),
            tables_dir,
            shard,
        };
        if o.exact_quant_wkv > 1 {
            bail!(
                ErrInvalidConfig,
                "exact_quant_wkv = {}: 0 or 1",
                o.exact_quant_wkv
            );
        }
        let model = Box::new(LoadedModel::open(p, &lo)?);
        give_context(
            out,
            model,
            &opts,
            o.device_cache_bytes,
            o.exact_quant_wkv == 1,
        )
    })
}

/// The companion files of a loader: config + tokenizer (both), a tokenizer
/// alone, or neither.
pub(crate) fn companions(
    config_json: *const c_char,
    tokenizer_json: *const c_char,
) -> Result<(Option<EngramTables>, Option<TokenMap>)> {
    match (config_json.is_null(), tokenizer_json.is_null()) {
        (true, true) => Ok((None, None)),
        (false, false) => Ok((
            Some(EngramTables::from_files(
                path_arg(config_json, "options.config_json")?,
                path_arg(tokenizer_json, "options.tokenizer_json")?,
            )?),
            None,
        )),
        (true, false) => {
            let tok = crate::tables::tokenizer::load(path_arg(
                tokenizer_json,
                "options.tokenizer_json",
            )?)?;
            Ok((None, Some(crate::tables::tokenizer::token_map(&tok)?)))
        }
        (false, true) => bail!(
            ErrInvalidArgument,
            "options.config_json needs options.tokenizer_json (the token map comes from the tokenizer): set both, \
             the tokenizer alone, or neither"
        ),
    }
}

/// The options of a context over a loaded model, from the fields both
/// loaders' C options carry: (`max_tokens`, `max_seqs`, `max_positions`) in
/// `max`. An unknown backend is refused here, before anything is loaded.
pub(crate) fn context_options(
    backend: u32,
    device: i32,
    eps: f32,
    max: (u32, u32, u32),
    n_threads: u32,
) -> Result<GgufOptions> {
    if backend != EngramBackend::Cpu as u32 && backend != EngramBackend::Cuda as u32 {
        bail!(ErrUnsupported, "unknown backend {backend}");
    }
    Ok(GgufOptions {
        limits: Limits {
            max_tokens: max.0 as usize,
            max_seqs: max.1 as usize,
            max_positions: max.2 as usize,
        },
        n_threads: n_threads as usize,
        backend,
        device,
        eps,
        tuning: Default::default(),
        row_cache_bytes: 0,
    })
}

/// A context over `model` (owned by the context from now on) into `*out`.
pub(crate) fn give_context(
    out: *mut *mut EngramContext,
    model: Box<LoadedModel>,
    opts: &GgufOptions,
    device_cache_bytes: u64,
    exact_quant: bool,
) -> Result<()> {
    // SAFETY: the context borrows the model inside `model`, a heap allocation
    // that does not move when the box does; the EngramContext owns the box and
    // drops it after the context (field order).
    let m: &'static LoadedModel = unsafe { &*(model.as_ref() as *const _) };
    let inner = m
        .context_with_cache(opts, device_cache_bytes)?
        .with_exact_quant(exact_quant);
    give_object(out, EngramContext::new(inner, Some(model)));
    Ok(())
}
