//! What a context says about itself, its gate weights, and its thread count
//! at run time.

use super::boundary::{read_options, slice_mut, write_options, Options};
use super::context::{ctx, EngramContext};
use crate::error::{bail, EngramStatus};

/// Written as a layer's `table_types`, `wkv_types` and `qk_types` entry
/// while its weights were never set (its `table_rows` entry is then 0).
pub const INFO_NO_TYPE: u32 = 0xFFFF_FFFF;

/// What `engram_context_info` reports. Fill it with `engram_info_init`, which
/// sets `struct_size` and leaves every array NULL; to read the layers too, set
/// the arrays you want (each `layers_cap` elements, or NULL to skip it) and
/// `layers_cap`. Every other field is written by the call. A struct from an
/// older header (a smaller `struct_size`) is read and written only as far as
/// it goes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramInfo {
    /// `sizeof(engram_info)` of the caller's header (set by `engram_info_init`).
    pub struct_size: usize,
    /// In: per engram layer, in row-id order: the model layer id.
    pub layer_ids: *mut u32,
    /// In: the table's `ENGRAM_TYPE_*` (`ENGRAM_INFO_NO_TYPE`: weights never set).
    pub table_types: *mut u32,
    /// In: the table's rows as set (0: weights never set).
    pub table_rows: *mut u64,
    /// In: the rows the layer's hash reaches (the largest `offset + prime`):
    /// the smallest table `engram_set_layer` accepts.
    pub rows_needed: *mut u64,
    /// In: `wkv`'s `ENGRAM_TYPE_*` (`ENGRAM_INFO_NO_TYPE`: never set).
    pub wkv_types: *mut u32,
    /// In: `q` and `k`'s `ENGRAM_TYPE_*` (`ENGRAM_INFO_NO_TYPE`: never set).
    pub qk_types: *mut u32,
    /// In: the elements each non-NULL array above holds; below `n_layers` is
    /// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` (nothing written).
    pub layers_cap: u32,
    /// `ENGRAM_BACKEND_CPU` or `ENGRAM_BACKEND_CUDA`.
    pub backend: u32,
    /// Hidden size `D`.
    pub hidden_size: u32,
    /// Hyper-connection streams `hc`.
    pub hc: u32,
    /// Row width `Hd`.
    pub head_dim: u32,
    /// Hash heads per n-gram size `H`.
    pub n_heads: u32,
    /// Max n-gram size `N`.
    pub max_ngram: u32,
    /// Row ids per token per layer, `C = (N-1)*H`.
    pub cols: u32,
    /// Engram layers.
    pub n_layers: u32,
    /// RMS epsilon of the gate, as the context uses it.
    pub eps: f32,
    /// Most tokens in one call.
    pub max_tokens: u32,
    /// Sequence ids run over `[0, max_seqs)`.
    pub max_seqs: u32,
    /// Positions run over `[0, max_positions)`.
    pub max_positions: u32,
    /// Threads the backend uses for one call (`engram_set_threads`).
    pub n_threads: u32,
    /// Entries of the token map (the vocabulary the hash accepts).
    pub token_map_len: usize,
    /// The pad token's compressed id.
    pub pad_id: i64,
    /// Row ids per token, `n_layers * C` (`engram_row_ids_per_token`).
    pub row_ids_per_token: usize,
    /// The fingerprint of the hash tables that a saved sequence state carries
    /// (`engram_seq_state_write`): equal for contexts of the same model.
    pub table_fingerprint: u64,
    /// CPU backend: the kernel computing the projection, as
    /// `ENGRAM_CPU_KERNEL` names it (`"portable"`, `"avx2"`, `"avx512"`,
    /// `"avx512bf16"` or `"amx"`); NULL on CUDA. A static string (never
    /// freed).
    pub cpu_kernel: *const std::ffi::c_char,
    /// CPU backend: why the `amx` kernel cannot run in this process (for
    /// example `"amx: the CPU has no AMX-TILE and AMX-BF16"` or `"amx: Linux
    /// refused the tile data (arch_prctl: ...)"`: the context then uses the
    /// best other kernel, never an error), or `""` where it can; NULL on
    /// CUDA. A static string.
    pub cpu_kernel_note: *const std::ffi::c_char,
}

/// The `engram_info` layouts this library reads: 0.3's (up to
/// `table_fingerprint`) and this one (with `cpu_kernel`).
const INFO_LAYOUTS: &[usize] = &[
    std::mem::offset_of!(EngramInfo, cpu_kernel),
    size_of::<EngramInfo>(),
];

impl Options for EngramInfo {
    const INIT: &'static str = "engram_info_init";
}

impl Default for EngramInfo {
    fn default() -> Self {
        EngramInfo {
            struct_size: size_of::<EngramInfo>(),
            layer_ids: std::ptr::null_mut(),
            table_types: std::ptr::null_mut(),
            table_rows: std::ptr::null_mut(),
            rows_needed: std::ptr::null_mut(),
            wkv_types: std::ptr::null_mut(),
            qk_types: std::ptr::null_mut(),
            layers_cap: 0,
            backend: 0,
            hidden_size: 0,
            hc: 0,
            head_dim: 0,
            n_heads: 0,
            max_ngram: 0,
            cols: 0,
            n_layers: 0,
            eps: 0.0,
            max_tokens: 0,
            max_seqs: 0,
            max_positions: 0,
            n_threads: 0,
            token_map_len: 0,
            pad_id: 0,
            row_ids_per_token: 0,
            table_fingerprint: 0,
            cpu_kernel: std::ptr::null(),
            cpu_kernel_note: std::ptr::null(),
        }
    }
}

/// Fill `info`'s first `struct_size` bytes with the defaults (NULL arrays,
/// `struct_size` set). NULL is ignored. Call it through the header's
/// `engram_info_init(info)`.
#[no_mangle]
pub extern "C" fn engram_info_init_sized(info: *mut EngramInfo, struct_size: usize) {
    ffi_boundary!({ write_options(info, EngramInfo::default(), struct_size) })
}

/// Describe the context: its geometry, engram layers (ids, table and weight
/// types, rows), limits, token map, `eps`, backend and thread count, into
/// `*info` (see `engram_info`), for an engine that opened it from a file and
/// must size its buffers. On error nothing is written.
///
/// `ctx` as in `engram_free`; `info` NULL or an `engram_info` whose non-NULL
/// arrays hold `layers_cap` elements.
#[no_mangle]
pub extern "C" fn engram_context_info(
    ctx: *const EngramContext,
    info: *mut EngramInfo,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let mut i = read_options(info, EngramInfo::default(), INFO_LAYOUTS, "info")?;
        let size = i.struct_size;
        let t = c.tables();
        let nl = t.n_layers();
        let arrays = [
            i.layer_ids.is_null(),
            i.table_types.is_null(),
            i.table_rows.is_null(),
            i.rows_needed.is_null(),
            i.wkv_types.is_null(),
            i.qk_types.is_null(),
        ];
        if arrays.iter().any(|null| !null) && (i.layers_cap as usize) < nl {
            bail!(
                ErrInvalidArgument,
                "info.layers_cap is {}, the context has {nl} engram layers",
                i.layers_cap
            );
        }
        let ids = array(i.layer_ids, nl, "info.layer_ids")?;
        let tt = array(i.table_types, nl, "info.table_types")?;
        let tr = array(i.table_rows, nl, "info.table_rows")?;
        let rn = array(i.rows_needed, nl, "info.rows_needed")?;
        let wt = array(i.wkv_types, nl, "info.wkv_types")?;
        let qt = array(i.qk_types, nl, "info.qk_types")?;
        for li in 0..nl {
            let l = c.layer_info(li);
            let ty = |f: fn(&crate::context::LayerInfo) -> crate::formats::EngramType| {
                l.as_ref().map_or(INFO_NO_TYPE, |l| f(l) as u32)
            };
            if let Some(v) = ids.get_mut(li) {
                *v = t.layer_ids[li];
            }
            if let Some(v) = tt.get_mut(li) {
                *v = ty(|l| l.table_type);
            }
            if let Some(v) = tr.get_mut(li) {
                *v = l.map_or(0, |l| l.rows);
            }
            if let Some(v) = rn.get_mut(li) {
                *v = t.rows_needed[li];
            }
            if let Some(v) = wt.get_mut(li) {
                *v = ty(|l| l.wkv_type);
            }
            if let Some(v) = qt.get_mut(li) {
                *v = ty(|l| l.qk_type);
            }
        }
        let g = c.geometry();
        let lim = c.limits();
        let backend = c.info();
        i.backend = backend.kind as u32;
        i.hidden_size = g.d as u32;
        i.hc = g.hc as u32;
        i.head_dim = g.hd as u32;
        i.n_heads = t.n_heads as u32;
        i.max_ngram = t.max_ngram as u32;
        i.cols = t.cols() as u32;
        i.n_layers = nl as u32;
        i.eps = g.eps;
        i.max_tokens = lim.max_tokens as u32;
        i.max_seqs = lim.max_seqs as u32;
        i.max_positions = lim.max_positions as u32;
        i.n_threads = c.n_threads() as u32;
        i.token_map_len = t.token_map.len();
        i.pad_id = t.pad_id;
        i.row_ids_per_token = c.ids_per_token();
        i.table_fingerprint = c.table_fingerprint();
        if backend.kind == crate::call::EngramBackend::Cpu {
            use crate::cpu::projection::{amx_note, Kernel};
            let k = Kernel::from_name(&backend.kernel);
            i.cpu_kernel = k.map_or(std::ptr::null(), |k| k.c_name().as_ptr());
            i.cpu_kernel_note = amx_note().as_ptr();
        }
        write_options(info, i, size);
        Ok(())
    })
}

/// One of `engram_info`'s arrays: `n` elements, or none when NULL.
fn array<'a, T>(p: *mut T, n: usize, what: &str) -> crate::error::Result<&'a mut [T]> {
    slice_mut(p, if p.is_null() { 0 } else { n }, what)
}

/// Layer `layer_id`'s gate weights, the product `q * k` (`[hc, D]` f32, the
/// only form of them the context keeps), into `out` (capacity `cap` floats):
/// with `engram_read_back`'s `kv`, an engine can recompute a whole gate. A
/// `cap` below `hc * D` is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`; an unknown
/// layer `ENGRAM_STATUS_ERR_UNKNOWN_LAYER`; a layer never set
/// `ENGRAM_STATUS_ERR_NO_WEIGHTS`. On error nothing is written. CUDA backend:
/// copied back from the device (synchronously).
///
/// `ctx` as in `engram_free`; `out` must hold `cap` floats.
#[no_mangle]
pub extern "C" fn engram_layer_gate_weights(
    ctx: *mut EngramContext,
    layer_id: u32,
    out: *mut f32,
    cap: usize,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let need = c.shape().hw_per_token();
        if out.is_null() {
            bail!(ErrNullArgument, "out is NULL");
        }
        if cap < need {
            bail!(
                ErrInvalidArgument,
                "out holds {cap} floats, the gate weights are hc * D = {need}"
            );
        }
        let o = slice_mut(out, need, "out")?;
        let qk = c.gate_weights(layer_id)?;
        o.copy_from_slice(&qk);
        Ok(())
    })
}

/// Use at most `n_threads` threads for each later call (0 or 1: the calling
/// thread only; at most 1024), as `llama_set_n_threads` changes an engine's.
/// CPU backend: the projection's worker pool is replaced; the call waits for
/// the projections in flight on other threads (they finish on the old
/// pool), then joins the old pool's threads before it returns, and the calls
/// after it use the new pool. A thread that cannot be started is
/// `ENGRAM_STATUS_ERR_CAPACITY` and the old pool stays in use. The prefetch
/// workers (`engram_prefetch`) keep the count the context was created with.
/// CUDA backend: the work runs on the device; the count is recorded (and
/// reported by `engram_context_info`) and changes nothing. More than 1024 is
/// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_set_threads(ctx: *mut EngramContext, n_threads: u32) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.set_threads(n_threads as usize) })
}
