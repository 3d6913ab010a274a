//! A context straight from the released safetensors checkpoint.

use super::boundary::{non_null, path_arg, read_options, write_options, Options};
use super::context::EngramContext;
use super::gguf::{context_options, give_context};
use crate::backend::EngramBackend;
use crate::context::ShardSpec;
use crate::error::EngramStatus;
use crate::gguf::{LoadOptions, LoadedModel};
use std::ffi::c_char;

/// Options of `engram_create_from_safetensors`. Fill with
/// `engram_safetensors_options_init`. Every field is plain data.
///
/// Layouts accepted (`struct_size`): the 0.3 layout (the struct is new in
/// 0.3), which ends after `mmap_tables` (`row_cache_bytes` and
/// `device_cache_bytes` read as 0), the layout that ends after
/// `device_cache_bytes` (the shard fields read as the whole layer), and the
/// layout of this header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramSafetensorsOptions {
    /// `sizeof(engram_safetensors_options)` of the caller's header (set by
    /// `engram_safetensors_options_init`).
    pub struct_size: usize,
    /// `ENGRAM_BACKEND_CPU` or `ENGRAM_BACKEND_CUDA` (the checkpoint's
    /// tables stay in host memory or the files either way; on CUDA their rows
    /// are gathered on the host and copied to the device, the weights are
    /// copied to device memory the context owns).
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
    /// The model's `tokenizer.json` (NULL: `tokenizer.json` in the checkpoint
    /// directory). The hash constants are derived from it and `config.json`.
    pub tokenizer_json: *const c_char,
    /// 0 (default): nothing is mapped: table rows are read with `pread` when
    /// gathered, `q`, `k` and `wkv` are read as stored into memory the context
    /// owns (an fp8 `wkv`: its codes and block scales, 1 byte a weight, 157 MB
    /// per layer of the released model); 1: the shards are mapped and
    /// everything is read in place (a file truncated while mapped raises
    /// SIGBUS).
    pub mmap_tables: u32,
    /// Bytes of the host row cache in front of the tables read from files
    /// (docs/row-cache.md; `mmap_tables = 0`: a mapped table is the page
    /// cache's), the context's total, each engram layer an equal share; 0
    /// (the default): no cache. A budget whose memory cannot be had is
    /// `ENGRAM_STATUS_ERR_CAPACITY` at create. `engram_cache_stats_read` reports
    /// what each layer holds. (A struct from an older header ends before
    /// this field: no cache.)
    pub row_cache_bytes: u64,
    /// As in `engram_config`: bytes of device row cache for each layer
    /// (the checkpoint's tables stay on the host; CUDA backend; 0, the
    /// default: none; ignored by the CPU backend). (A struct from a 0.3
    /// header ends before this field.)
    pub device_cache_bytes: u64,
    /// As in `engram_gguf_options`: a shard context (docs/sharding.md
    /// "Shard contexts") holding part `shard_table_rank` of
    /// `shard_table_world` of every layer's table rows and part
    /// `shard_wkv_rank` of `shard_wkv_world` of `wkv`'s outputs, the loader
    /// reading only that part of `wkv` and its scales. `(0, 1, 0, 1)` (the
    /// default): the whole layer. (A struct from an older header ends before
    /// these fields: the whole layer.)
    pub shard_table_rank: u32,
    pub shard_table_world: u32,
    pub shard_wkv_rank: u32,
    pub shard_wkv_world: u32,
}

/// The `engram_safetensors_options` layouts this library reads: the 0.3
/// one, which ends before `row_cache_bytes`, one that ends before
/// the shard fields, and today's.
const SAFETENSORS_OPTIONS_LAYOUTS: &[usize] = &[
    std::mem::offset_of!(EngramSafetensorsOptions, row_cache_bytes),
    std::mem::offset_of!(EngramSafetensorsOptions, shard_table_rank),
    size_of::<EngramSafetensorsOptions>(),
];

impl Options for EngramSafetensorsOptions {
    const INIT: &'static str = "engram_safetensors_options_init";
}

impl Default for EngramSafetensorsOptions {
    fn default() -> Self {
        EngramSafetensorsOptions {
            struct_size: size_of::<EngramSafetensorsOptions>(),
            backend: EngramBackend::Cpu as u32,
            device: 0,
            eps: 0.0,
            max_tokens: 4096,
            max_seqs: 64,
            max_positions: 131072,
            n_threads: 1,
            tokenizer_json: std::ptr::null(),
            mmap_tables: 0,
            row_cache_bytes: 0,
            device_cache_bytes: 0,
            shard_table_rank: 0,
            shard_table_world: 1,
            shard_wkv_rank: 0,
            shard_wkv_world: 1,
        }
    }
}

/// Fill `o`'s first `struct_size` bytes with the defaults: the CPU backend,
/// `eps = 0` (the file's), `max_tokens = 4096`, `max_seqs = 64`, `max_positions =
/// 131072`, one thread, the directory's tokenizer.json, `pread` tables. NULL
/// is ignored. Call it through the header's `engram_safetensors_options_init(o)`.
#[no_mangle]
pub extern "C" fn engram_safetensors_options_init_sized(
    o: *mut EngramSafetensorsOptions,
    struct_size: usize,
) {
    ffi_boundary!({ write_options(o, EngramSafetensorsOptions::default(), struct_size) })
}

/// Create a context straight from the released DeepSeek-V4.1 checkpoint's
/// directory `model_dir`, without converting it: `config.json` (the engram
/// fields of `text_config`), `model.safetensors.index.json` (or a single
/// `model.safetensors`) and the shards that hold the engram tensors, each
/// opened once. Per engram layer: the table from `layers.{L}.engram.embed.weight`
/// (F8_E4M3) and `.embed.scale` (F8_E8M0) in place
/// (`ENGRAM_TYPE_FP8_E4M3_E8M0_SPLIT`); `q_weight`, `k_weight` (BF16); `wkv`
/// (F8_E4M3 `wkv.weight` with its F8_E8M0 `wkv.scale`, one scale per
/// `quantization_config.weight_block_size` block: kept as stored,
/// `ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK`, read in place by the kernels; or
/// BF16/F32). The hash constants are derived from the
/// config and the tokenizer, as docs/math.md states. Statuses: `ERR_IO` (the
/// directory, a file or a shard cannot be opened, or is not a regular file),
/// `ERR_FORMAT` (a safetensors header that is not valid or disagrees with its
/// file, a missing tensor, a tensor of the wrong dtype or shape, a config that
/// disagrees with the tensors), `ERR_INVALID_CONFIG` (missing config fields,
/// a tokenizer that does not fit the config), `ERR_UNSUPPORTED` (a dtype this
/// build does not read, an unknown backend), `ERR_DEVICE` (the CUDA backend
/// without a usable driver or device), `ERR_INVALID_DATA` (a NaN code or scale in the fp8 `wkv`, or a block
/// that overflows: see `engram_layer_weights.wkv_scales`). On
/// failure `*out` is left as it was.
///
/// `model_dir` must be NULL or a NUL-terminated path; `options` NULL or
/// filled by `engram_safetensors_options_init` (a NULL `options` is
/// `ERR_NULL_ARGUMENT`, not the defaults: the defaults are what `_init`
/// fills); `out` NULL or writable.
#[no_mangle]
pub extern "C" fn engram_create_from_safetensors(
    model_dir: *const c_char,
    options: *const EngramSafetensorsOptions,
    out: *mut *mut EngramContext,
) -> EngramStatus {
    ffi_boundary!({
        let dir = path_arg(model_dir, "model_dir")?;
        let o = read_options(
            options,
            EngramSafetensorsOptions::default(),
            SAFETENSORS_OPTIONS_LAYOUTS,
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
        let tok = if o.tokenizer_json.is_null() {
            None
        } else {
            Some(path_arg(o.tokenizer_json, "options.tokenizer_json")?)
        };
        let lo = LoadOptions {
            mmap: o.mmap_tables != 0,
            shard,
            ..LoadOptions::default()
        };
        let model = Box::new(LoadedModel::open_checkpoint(dir, tok, &lo)?);
        give_context(out, model, &opts, o.device_cache_bytes, false)
    })
}
