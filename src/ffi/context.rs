//! Contexts, layers, hashing, apply and read-back.

use super::boundary::{
    give_object, non_null, object, read_options, slice, slice_mut, take_object, write_options,
    Options,
};
use crate::backend::{DeviceHashIn, EngramBackend, Highway, LayerIn, RowIds, TableIn, TableSource};
use crate::batch::{Geometry, HighwayType, Limits};
use crate::context::{Context, ContextConfig, Tuning};
use crate::error::{bail, EngramStatus, Result};
use crate::hash::HashTablesIn;
use crate::memory::{Region, RegionMut};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Opaque engram context. Create with `engram_create`, release with `engram_free`.
pub struct EngramContext {
    inner: Context<'static>,
    /// What `inner` borrows when the library loaded it (a GGUF file or a
    /// safetensors checkpoint: mappings, files, owned weights); dropped after `inner`.
    owner: Option<Box<crate::gguf::LoadedModel>>,
    /// Calls in flight on this handle: every export that takes a context
    /// enters through [`ctx`] and leaves when its guard drops.
    calls: AtomicUsize,
    /// Set by `engram_free`: a call that starts afterwards is refused, and
    /// the free waits for `calls` to drain before it frees anything.
    freeing: AtomicBool,
}

impl EngramContext {
    /// A handle over `inner` (and what it borrows, for a loaded model).
    pub(crate) fn new(
        inner: Context<'static>,
        owner: Option<Box<crate::gguf::LoadedModel>>,
    ) -> EngramContext {
        EngramContext {
            inner,
            owner,
            calls: AtomicUsize::new(0),
            freeing: AtomicBool::new(false),
        }
    }
}

/// A call entered on a context: derefs to it, and counts as in flight (so
/// `engram_free` waits for it) until dropped.
pub(crate) struct Entered<'a> {
    handle: &'a EngramContext,
}

impl Entered<'_> {
    /// Host bytes the loader that made this context read or converted into
    /// memory the context owns (0 for a context over the engine's arrays).
    pub(crate) fn loaded_bytes(&self) -> usize {
        self.handle.owner.as_ref().map_or(0, |m| m.owned_bytes())
    }
}

impl std::ops::Deref for Entered<'_> {
    type Target = Context<'static>;
    fn deref(&self) -> &Context<'static> {
        &self.handle.inner
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.handle.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Configuration for `engram_create`. Fill it with `engram_config_init`, which
/// sets `struct_size` and the defaults, then set the fields. Every pointer is
/// read during `engram_create` only: the tables are copied (validated and
/// widened), so the caller may free them afterwards. Every field is plain
/// data; a struct from an older header (a smaller `struct_size`) is read as
/// far as it goes, the rest taking the defaults.
///
/// Layouts accepted (`struct_size`): the 0.1 layout, which ends after
/// `n_threads` (unchanged through 0.2; `device_history` reads as 0), the
/// 0.3 layout, which ends after `device_history` (`device_cache_bytes` reads
/// as 0), and the layout of this header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramConfig {
    /// `sizeof(engram_config)` of the caller's header (set by `engram_config_init`).
    pub struct_size: usize,
    /// `ENGRAM_BACKEND_CPU`, or `ENGRAM_BACKEND_CUDA`: `engram_apply` then
    /// runs on the device, on the caller's device pointers and CUDA stream (see
    /// `engram_set_layer`, `engram_apply`, `engram_apply_device_ids`,
    /// `engram_check`). `engram_create` with CUDA loads the driver (a machine
    /// without one gets `ENGRAM_STATUS_ERR_DEVICE`), loads NVRTC and cuBLAS of
    /// CUDA 13 or 12 (whichever is there, never newer than the driver; see
    /// docs/cuda.md, "Libraries", for where they are looked for), compiles the kernels for the
    /// device and allocates every device workspace for `max_tokens`.
    pub backend: u32,
    /// CUDA device ordinal (ignored by the CPU backend). The context uses that
    /// device's primary context, the one the CUDA runtime and PyTorch use.
    pub device: i32,
    /// Hidden size `D`.
    pub hidden_size: u32,
    /// Hyper-connection streams `hc`.
    pub hc: u32,
    /// Row width `Hd` (head_dim).
    pub head_dim: u32,
    /// Hash heads per n-gram size `H`.
    pub n_heads: u32,
    /// Max n-gram size `N`; `C = (N-1)*H` row ids per token per layer.
    pub max_ngram: u32,
    /// RMS epsilon of the gate: finite and > 0 (0, a negative value, an
    /// infinity or a NaN is `ENGRAM_STATUS_ERR_INVALID_CONFIG`).
    pub eps: f32,
    /// Model layer ids of the engram layers, `[n_layers]`; row ids come out in this order.
    pub layer_ids: *const u32,
    pub n_layers: u32,
    /// Raw token id -> compressed id (`-1`: the token is dead), `[token_map_len]`.
    pub token_map: *const i32,
    pub token_map_len: usize,
    /// The pad token's compressed id (`token_map[pad_token_id]`, as GGUF stores it).
    pub pad_id: i64,
    /// `[n_layers * max_ngram]`, i64 values as u64 bits; each odd, as the
    /// spec derives them (an even one is `ENGRAM_STATUS_ERR_INVALID_CONFIG`).
    pub multipliers: *const u64,
    pub n_multipliers: usize,
    /// `[n_layers * C]`, column `(k-1)*H + h`.
    pub primes: *const u64,
    pub n_primes: usize,
    /// `[n_layers * C]`.
    pub offsets: *const u64,
    pub n_offsets: usize,
    /// Most tokens in one `engram_hash` or `engram_apply` call.
    pub max_tokens: u32,
    /// Sequence ids run over `[0, max_seqs)`.
    pub max_seqs: u32,
    /// Positions run over `[0, max_positions)`.
    pub max_positions: u32,
    /// Threads the CPU backend may use in one call (0 or 1: the calling thread
    /// only). At most 1024 (more is `ENGRAM_STATUS_ERR_INVALID_CONFIG` at create);
    /// threads that cannot be started are `ENGRAM_STATUS_ERR_CAPACITY`, as in
    /// `engram_set_threads`.
    pub n_threads: u32,
    /// 0 (the default): the history is on the host (`engram_hash`). Else the
    /// context's history is on the device (CUDA backend only; the CPU backend
    /// returns `ENGRAM_STATUS_ERR_UNSUPPORTED`), keeping this many positions
    /// per sequence, at least `max_ngram - 1` plus the longest draft the
    /// engine rolls back (at most 2^20; `max_seqs * device_history * 8` bytes
    /// of device memory, plus `device_history * 8` for a shift): hash with
    /// `engram_hash_device`, edit with the `engram_seq_*_device` calls (copy,
    /// drop, rm, cp, keep, add, state); `engram_hash` and the host history
    /// calls (`engram_seq_copy`, `engram_seq_rm`, the states, ...) then return
    /// `ENGRAM_STATUS_ERR_UNSUPPORTED` (see docs/device-hash.md).
    pub device_history: u32,
    /// 0 (the default): a table in host memory or a file has every row a
    /// call needs copied to the device for that call. Else (CUDA backend)
    /// each layer whose table is on the host keeps up to this many bytes of
    /// its rows (`device_cache_bytes / row_bytes` rows) in device memory,
    /// and a call copies only the rows it does not hold (an LRU slot map on
    /// the host; docs/row-cache.md, "Device tier"). Per layer: a context with
    /// two host-table layers takes twice this, allocated at
    /// `engram_set_layer`, plus `max_tokens * C * 12` bytes per layer and of
    /// each pinned staging buffer for the per-call slot arrays. A budget the
    /// device cannot give is `ENGRAM_STATUS_ERR_CAPACITY` at
    /// `engram_set_layer`, nothing kept. The CPU backend ignores it (it reads
    /// host tables in place).
    pub device_cache_bytes: u64,
    /// 0 (the default): the CPU backend may multiply a `Q4_K` `wkv` by
    /// integer dot products (AVX512-VNNI) on each token's row
    /// quantised to int8, within the bound docs/numerics.md derives
    /// ("Integer dot products") of the f32 twin (an f32 `wkv` holding the
    /// dequantised values); a token's `kv` is still the same bits whatever
    /// its batch, the thread count or the path. 1: every GGUF-block `wkv`
    /// gives the twin's bits exactly (f32 FMA on the dequantised values, as
    /// before this field). Other values are `ENGRAM_STATUS_ERR_INVALID_CONFIG`.
    /// The CUDA backend ignores it. (A struct from an older header reads it
    /// as 0.)
    pub exact_quant_wkv: u32,
}

/// The `engram_config` layouts this library reads: its 0.1 layout (up to
/// `n_threads`, unchanged through 0.2), the 0.3 one (with `device_history`),
/// the one with `device_cache_bytes`, and this one (with `exact_quant_wkv`).
const CONFIG_LAYOUTS: &[usize] = &[
    std::mem::offset_of!(EngramConfig, device_history),
    std::mem::offset_of!(EngramConfig, device_cache_bytes),
    std::mem::offset_of!(EngramConfig, exact_quant_wkv),
    size_of::<EngramConfig>(),
];

impl Options for EngramConfig {
    const INIT: &'static str = "engram_config_init";
}

impl Default for EngramConfig {
    fn default() -> Self {
        EngramConfig {
            struct_size: size_of::<EngramConfig>(),
            backend: EngramBackend::Cpu as u32,
            device: 0,
            hidden_size: 0,
            hc: 0,
            head_dim: 0,
            n_heads: 0,
            max_ngram: 0,
            eps: 1e-6,
            layer_ids: std::ptr::null(),
            n_layers: 0,
            token_map: std::ptr::null(),
            token_map_len: 0,
            pad_id: 0,
            multipliers: std::ptr::null(),
            n_multipliers: 0,
            primes: std::ptr::null(),
            n_primes: 0,
            offsets: std::ptr::null(),
            n_offsets: 0,
            max_tokens: 0,
            max_seqs: 0,
            max_positions: 0,
            n_threads: 1,
            device_history: 0,
            device_cache_bytes: 0,
            exact_quant_wkv: 0,
        }
    }
}

impl EngramConfig {
    /// Read the caller's config (any supported `struct_size`).
    pub(crate) fn read(p: *const EngramConfig) -> Result<EngramConfig> {
        read_options(p, EngramConfig::default(), CONFIG_LAYOUTS, "config")
    }
}

/// One engram layer's weights for `engram_set_layer`. All pointers are
/// borrowed: they must stay valid and unchanged until the layer is set again
/// or the context is freed. Nothing is copied except `q * k` (`hc * D` floats).
/// With the CUDA backend `table` is device memory of the context's device, or
/// host memory (the rows a call needs are then gathered on the host and
/// copied to the device: see `engram_prefetch` and `engram_stage`); `wkv` is
/// device memory, or host memory that is copied to the device once, here (any
/// `wkv_type`); `q` and `k` are device or host memory, read here. Every field
/// is plain data.
///
/// Layouts accepted (`struct_size`): the 0.2 layout, which ends after
/// `qk_type` (the fields after it read as NULL / 0); an early 0.3 layout,
/// which ends after `table_scales` (no block-scaled `wkv`: `wkv_scales`,
/// `wkv_block_rows`, `wkv_block_cols` read as NULL / 0); and the 0.3 layout
/// of this header.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramLayerWeights {
    /// `sizeof(engram_layer_weights)` of the caller's header (set by `engram_layer_weights_init`).
    pub struct_size: usize,
    /// Model layer id (one of the config's `layer_ids`).
    pub layer_id: u32,
    /// Format of the table rows (`ENGRAM_TYPE_*`).
    pub table_type: u32,
    /// The table: `table_rows` rows of `Hd` values in `table_type`.
    pub table: *const c_void,
    pub table_rows: u64,
    /// `[D*(hc+1), C*Hd]` row-major; `wkv_type` f32, bf16, a GGUF block
    /// format (`ENGRAM_TYPE_Q8_0`, `Q4_0`, `Q2_K` ... `Q6_K`, each row whole
    /// blocks), or `ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK` (one e4m3 code byte a
    /// value, its scales in `wkv_scales`), read in place and dequantised on
    /// the fly.
    pub wkv: *const c_void,
    pub wkv_type: u32,
    /// `q` and `k` norm weights, `[hc, D]` each, `qk_type` f32 or bf16.
    pub q: *const c_void,
    pub k: *const c_void,
    pub qk_type: u32,
    /// With `table_type = ENGRAM_TYPE_FP8_E4M3_E8M0_SPLIT` (codes and scales
    /// in two arrays, as the released checkpoint's `embed.weight` and
    /// `embed.scale`): the e8m0 scales, `table_rows` rows of `Hd / 32` bytes,
    /// while `table` holds the e4m3 codes, `table_rows` rows of `Hd` bytes.
    /// NULL for every other table type (their scales, if any, are in the
    /// rows). Borrowed like `table`. (A struct from a 0.2 header, which ends
    /// before this field, is read with it NULL.)
    pub table_scales: *const c_void,
    /// With `wkv_type = ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK` (the released
    /// checkpoint's `wkv.weight` and `wkv.scale` as stored): the e8m0 scales,
    /// one byte per block of `wkv_block_rows x wkv_block_cols` values,
    /// `[ceil(D*(hc+1) / wkv_block_rows), ceil(C*Hd / wkv_block_cols)]`
    /// row-major (edge blocks may be partial); `wkv` holds the e4m3 codes.
    /// Both block sizes must be positive (the checkpoint's are its
    /// `quantization_config.weight_block_size`, 128 x 128). NULL and 0 for
    /// every other `wkv_type`. Borrowed like `wkv`.
    ///
    /// `engram_set_layer` checks every code and scale before it changes
    /// anything: one pass over `wkv` and its scales on the calling thread (a
    /// byte maximum per block; 0.18 s for a 157 MB layer of the released
    /// model measured on a heavily loaded 2-core machine); with the CUDA
    /// backend and `wkv` in device memory it is copied to the host 16 MB at
    /// a time for the check. An e4m3 NaN code, the e8m0 NaN scale 255, a value
    /// that overflows (an e4m3 value times its scale beyond f32's range) or
    /// one that is not exact in bf16 (below `2^-133` precision, only
    /// possible with scales below `2^-124`) is `ENGRAM_STATUS_ERR_INVALID_DATA`
    /// naming the first bad block (in row-major block order), its rows and
    /// columns and the element, and the layer is left as it was. So every
    /// value is exact in f32 and bf16, and `kv` equals, bit for bit, that of
    /// the same weights widened to bf16 and given as `ENGRAM_TYPE_BF16`.
    /// (A struct from a header that ends before these fields reads them as
    /// NULL and 0.)
    pub wkv_scales: *const c_void,
    pub wkv_block_rows: u32,
    pub wkv_block_cols: u32,
}

/// The `engram_layer_weights` layouts this library reads: the 0.2 one, which
/// ends before `table_scales`; the first 0.3 one, which ends before
/// `wkv_scales` (before the block-scaled fp8 `wkv`); and today's (0.3).
const LAYER_WEIGHTS_LAYOUTS: &[usize] = &[
    std::mem::offset_of!(EngramLayerWeights, table_scales),
    std::mem::offset_of!(EngramLayerWeights, wkv_scales),
    size_of::<EngramLayerWeights>(),
];

impl Options for EngramLayerWeights {
    const INIT: &'static str = "engram_layer_weights_init";
}

impl Default for EngramLayerWeights {
    fn default() -> Self {
        EngramLayerWeights {
            struct_size: size_of::<EngramLayerWeights>(),
            layer_id: 0,
            table_type: 0,
            table: std::ptr::null(),
            table_rows: 0,
            wkv: std::ptr::null(),
            wkv_type: 0,
            q: std::ptr::null(),
            k: std::ptr::null(),
            qk_type: 0,
            table_scales: std::ptr::null(),
            wkv_scales: std::ptr::null(),
            wkv_block_rows: 0,
            wkv_block_cols: 0,
        }
    }
}

/// Fill `cfg`'s first `struct_size` bytes with the defaults (zero everywhere,
/// `struct_size` set, the CPU backend, `eps = 1e-6`, one thread). NULL is
/// ignored. Call it through the header's `engram_config_init(cfg)`, which
/// passes `sizeof *cfg`, so a library newer than the header never writes
/// past the caller's struct.
#[no_mangle]
pub extern "C" fn engram_config_init_sized(cfg: *mut EngramConfig, struct_size: usize) {
    ffi_boundary!({ write_options(cfg, EngramConfig::default(), struct_size) })
}

/// As `engram_config_init_sized`, for `engram_layer_weights` (everything zero
/// but `struct_size`); call it through `engram_layer_weights_init(w)`.
#[no_mangle]
pub extern "C" fn engram_layer_weights_init_sized(w: *mut EngramLayerWeights, struct_size: usize) {
    ffi_boundary!({ write_options(w, EngramLayerWeights::default(), struct_size) })
}

/// Enter a call on the context behind a handle: refused once `engram_free`
/// has begun on it; else counted in flight until the guard drops.
pub(crate) fn ctx<'a>(p: *const EngramContext) -> Result<Entered<'a>> {
    let handle = object(p, "ctx")?;
    // SeqCst on both sides: either `engram_free` sees this call counted, or
    // this call sees the free's flag (and leaves at once).
    handle.calls.fetch_add(1, Ordering::SeqCst);
    let entered = Entered { handle };
    if handle.freeing.load(Ordering::SeqCst) {
        bail!(
            ErrInvalidArgument,
            "ctx is being freed (engram_free on another thread): no call may start on it"
        );
    }
    Ok(entered)
}

/// Create a context. On success `*out` receives it; on failure `*out` is left
/// as it was and `engram_last_error()` says why.
///
/// `cfg` must be NULL or a valid `engram_config` whose pointers hold the
/// counts it states; `out` must be NULL or writable.
#[no_mangle]
pub extern "C" fn engram_create(
    cfg: *const EngramConfig,
    out: *mut *mut EngramContext,
) -> EngramStatus {
    ffi_boundary!({
        let c = EngramConfig::read(cfg)?;
        non_null(out, "out")?;
        let n_layers = c.n_layers as usize;
        let cc = ContextConfig {
            geometry: Geometry {
                d: c.hidden_size as usize,
                hc: c.hc as usize,
                hd: c.head_dim as usize,
                eps: c.eps,
            },
            tables: HashTablesIn {
                layer_ids: slice(c.layer_ids, n_layers, "config.layer_ids")?,
                max_ngram: c.max_ngram as usize,
                n_heads: c.n_heads as usize,
                token_map: slice(c.token_map, c.token_map_len, "config.token_map")?,
                pad_id: c.pad_id,
                multipliers: slice(c.multipliers, c.n_multipliers, "config.multipliers")?,
                primes: slice(c.primes, c.n_primes, "config.primes")?,
                offsets: slice(c.offsets, c.n_offsets, "config.offsets")?,
            },
            limits: Limits {
                max_tokens: c.max_tokens as usize,
                max_seqs: c.max_seqs as usize,
                max_positions: c.max_positions as usize,
            },
            n_threads: c.n_threads as usize,
            backend: c.backend,
            device: c.device,
            tuning: Tuning::default(),
        };
        if c.exact_quant_wkv > 1 {
            bail!(
                ErrInvalidConfig,
                "exact_quant_wkv = {}: 0 or 1",
                c.exact_quant_wkv
            );
        }
        let mut inner = Context::new(&cc)?.with_exact_quant(c.exact_quant_wkv == 1);
        if c.device_history > 0 {
            inner = inner.with_device_history(c.device_history as usize)?;
        }
        if c.device_cache_bytes > 0 {
            inner = inner.with_device_cache(c.device_cache_bytes)?;
        }
        give_object(out, EngramContext::new(inner, None));
        Ok(())
    })
}

/// Free a context. NULL is a no-op. With the CUDA backend it first waits for
/// the work of the context's last call (an event recorded after it on its
/// stream), so that nothing queued still reads the workspaces it frees, and
/// then, before it unloads its kernels, for the device (`cuCtxSynchronize`):
/// not during another thread's graph capture in global mode. Replays of
/// captured graphs are not tracked: they must have finished (synchronise
/// their stream first).
///
/// Calls on the context in flight on other threads when `engram_free`
/// begins are waited for: it frees nothing until each has returned (so
/// freeing a context that another thread is still using is predictable,
/// not a crash). A call that starts on the context while the free waits is
/// refused (`ENGRAM_STATUS_ERR_INVALID_ARGUMENT`, nothing done). A call that
/// starts after `engram_free` returned is a use after free, as for any freed
/// memory; so is a second `engram_free` of the same context.
///
/// `ctx` must be NULL or a context from `engram_create` (or a loader) not
/// yet freed.
#[no_mangle]
pub extern "C" fn engram_free(ctx: *mut EngramContext) {
    ffi_boundary!({
        if let Ok(handle) = object(ctx.cast_const(), "ctx") {
            handle.freeing.store(true, Ordering::SeqCst);
            // Free is rare and the calls it waits for are short: poll.
            while handle.calls.load(Ordering::SeqCst) != 0 {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
        // Dropping frees only what the context allocated; borrowed weights are untouched.
        drop(take_object(ctx))
    })
}

/// Register (or replace) the weights of one engram layer. The pointers are
/// borrowed (see `engram_layer_weights`).
///
/// CUDA backend: before it replaces anything it waits on the host for the
/// work of the context's last call queued outside a graph capture (an event
/// recorded on that call's stream; not `cuCtxSynchronize`, so it neither
/// waits for the engine's other work nor breaks a capture another thread
/// makes); its copies run on the context's own stream. When it returns,
/// nothing the library queued reads the replaced weights, so the engine may
/// free them. It does not wait for the engine's streams: `q` and `k`, read
/// during the call, must already hold their values (written by a finished
/// copy). A graph captured before the call holds the old weights' and
/// staging buffers' addresses: its replays must have finished before the
/// call, and it must be captured again after it (never replayed again).
///
/// `ctx` as in `engram_free`; `w` must be NULL or a valid struct whose
/// pointers hold the sizes the geometry implies and outlive their use by the
/// context.
#[no_mangle]
pub extern "C" fn engram_set_layer(
    ctx: *mut EngramContext,
    w: *const EngramLayerWeights,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let w = read_options(
            w,
            EngramLayerWeights::default(),
            LAYER_WEIGHTS_LAYOUTS,
            "layer weights",
        )?;
        let region = |p: *const c_void| {
            // SAFETY: the header requires the weights to be memory of the
            // context's backend holding the sizes the geometry implies, valid
            // and unchanged while the layer is set (`'static` here: the
            // context borrows them until `engram_free` or the next set).
            unsafe { Region::from_raw(p as usize, None) }
        };
        // The scale array: for the split fp8 format (NULL refused there), or
        // set where no format takes one (refused, naming it).
        let split = w.table_type == crate::formats::EngramType::Fp8E4m3E8m0Split as u32;
        let scales = (split || !w.table_scales.is_null())
            .then(|| TableSource::Memory(region(w.table_scales)));
        c.set_layer(LayerIn {
            layer_id: w.layer_id,
            table: TableIn {
                source: TableSource::Memory(region(w.table)),
                scales,
                ty: w.table_type,
                rows: w.table_rows,
            },
            wkv: region(w.wkv),
            wkv_type: w.wkv_type,
            wkv_scales: (!w.wkv_scales.is_null()
                || w.wkv_type == crate::formats::EngramType::Fp8E4m3E8m0Block as u32)
                .then(|| region(w.wkv_scales)),
            wkv_block: (w.wkv_block_rows, w.wkv_block_cols),
            q: region(w.q),
            k: region(w.k),
            qk_type: w.qk_type,
        })
    })
}

/// Row ids each token produces: `n_layers * C`. The output of `engram_hash` is
/// `[n_tokens, n_layers, C]`. NULL `ctx` gives 0.
#[no_mangle]
pub extern "C" fn engram_row_ids_per_token(ctx: *const EngramContext) -> usize {
    ffi_boundary!({ self::ctx(ctx).map_or(0, |c| c.ids_per_token()) })
}

/// Hash a batch of `n_tokens` tokens. Token `i` is at absolute position
/// `pos[i]` of sequence `seq_ids[i]`; `tokens[i]` is a raw token id or
/// `ENGRAM_TOKEN_DEAD`. Writes `[n_tokens, n_layers, C]` row ids into
/// `row_ids` (capacity `row_ids_cap` elements); a dead token gets
/// `ENGRAM_ROW_ID_DEAD` in every column. Each position is recorded in its
/// sequence's history (hashing a position again overwrites it: rollback is
/// re-hashing). On error nothing is written and the history is unchanged.
///
/// `ctx` as in `engram_free`; the arrays must hold `n_tokens` elements and
/// `row_ids` `row_ids_cap`.
#[no_mangle]
pub extern "C" fn engram_hash(
    ctx: *mut EngramContext,
    tokens: *const i32,
    seq_ids: *const i32,
    pos: *const i32,
    n_tokens: u32,
    row_ids: *mut i64,
    row_ids_cap: usize,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let tokens = slice(tokens, n, "tokens")?;
        let seq_ids = slice(seq_ids, n, "seq_ids")?;
        let pos = slice(pos, n, "pos")?;
        let need = n * c.ids_per_token();
        if row_ids_cap < need {
            bail!(
                ErrInvalidArgument,
                "row_ids holds {row_ids_cap} elements, {n} tokens need {need}"
            );
        }
        let out = slice_mut(row_ids, need, "row_ids")?;
        c.hash(tokens, seq_ids, pos, out)
    })
}

/// Hash a batch on the device, over the context's device history (a
/// context created with `device_history > 0`, CUDA backend): `tokens`,
/// `seq_ids` and `pos` are device pointers to `n_tokens` int32 each (raw
/// token ids or `ENGRAM_TOKEN_DEAD`, sequence ids, absolute positions), and
/// `row_ids` a device pointer to `[n_tokens, n_layers, C]` int64, which
/// `engram_apply_device_ids` reads. The row ids are those `engram_hash`
/// gives for the same history, bit for bit. Each sequence's tokens must be
/// one run: consecutive entries at consecutive positions.
///
/// The call queues three kernels on `stream` and returns: nothing is read on
/// the host and nothing is allocated, so it can be captured in a CUDA graph
/// with the applies (see docs/device-hash.md for the recipe). Errors found
/// on the device (a sequence id outside `[0, max_seqs)`, a position outside
/// `[0, max_positions)`, a token outside the token map, a sequence in two
/// runs, a look-back the device history does not hold:
/// `ENGRAM_STATUS_ERR_MISSING_HISTORY`) write that token's row ids
/// `ENGRAM_ROW_ID_DEAD` and leave its history entry unchanged; the first
/// one (token errors before look-back errors, then by token) is reported
/// once by the next `engram_hash_device` or `engram_apply*` on this context
/// (which then queues nothing) or by `engram_check`, like the kernels' other
/// errors. Checked here: `n_tokens <= max_tokens`, non-NULL pointers. The
/// CPU backend, or a context without a device history, returns
/// `ENGRAM_STATUS_ERR_UNSUPPORTED`.
///
/// `ctx` as in `engram_free`; the pointers device memory of the sizes above,
/// `stream` a stream of the context's device or NULL.
#[no_mangle]
pub extern "C" fn engram_hash_device(
    ctx: *mut EngramContext,
    tokens: *const i32,
    seq_ids: *const i32,
    pos: *const i32,
    n_tokens: u32,
    row_ids: *mut i64,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        c.hash_device(&DeviceHashIn {
            tokens: tokens as u64,
            seq_ids: seq_ids as u64,
            pos: pos as u64,
            n: n_tokens as usize,
            row_ids: row_ids as u64,
            stream,
        })
    })
}

/// The highway argument of `engram_apply*`: memory of the context's backend.
pub(super) fn highway<'a>(p: *mut c_void, ty: u32) -> Result<Highway<'a>> {
    let ty = HighwayType::new(ty)?;
    // SAFETY: the header requires `highway` to be memory of the context's
    // backend holding `[n_tokens, hc, D]` of `highway_type`, not accessed by
    // anything else during the call; the context sizes and checks it.
    Ok(Highway::Raw(
        unsafe { RegionMut::from_raw(p as usize, None) },
        ty,
    ))
}

/// Apply engram layer `layer_id` to `n_tokens` tokens: `row_ids` is the
/// `engram_hash` output for them (`[n_tokens, n_layers, C]`), `highway` is
/// `[n_tokens, hc, D]` of `highway_type` (`ENGRAM_TYPE_F32` or
/// `ENGRAM_TYPE_BF16`; any other type is `ENGRAM_STATUS_ERR_UNSUPPORTED`),
/// updated in place: `x += gate * value` per stream, computed in f32, rounded
/// once to nearest-even for bf16. Dead tokens are left untouched. `stream` is
/// ignored by the CPU backend. On error the highway is unchanged.
///
/// CUDA backend: `row_ids` is host memory, checked here as on the CPU, then
/// staged through pinned memory and copied on `stream` (with a host table,
/// the rows too: gathered here, or taken from an `engram_prefetch` of the same
/// ids); `highway` is device memory; `stream` is a `CUstream` /
/// `cudaStream_t` of the context's device. NULL is the legacy default
/// stream: an engine built with per-thread default streams
/// (`--default-stream per-thread`) must pass `cudaStreamPerThread` instead, and
/// a call on the legacy stream while another stream captures a graph in
/// global mode invalidates that capture. The call queues its work on `stream`
/// and returns without waiting for it (it waits only when `stream` is 4 or
/// more host-id calls behind, for the oldest staged copy) and allocates
/// nothing. Calls on one context share its workspaces: order them (one stream,
/// or streams the engine orders). Host row ids cannot be captured in a CUDA
/// graph (`ENGRAM_STATUS_ERR_INVALID_ARGUMENT` while `stream` is capturing):
/// use `engram_apply_device_ids`. An error the kernels find (invalid row data,
/// a bad device row id) leaves that token untouched; the first one of a call,
/// in the order the CPU backend checks (row ids before row data, then by
/// token, then by column), is reported, once, by a later `engram_apply` or
/// `engram_apply_device_ids` on this context when the device has run that
/// work (that later call then does nothing), and by `engram_check`; errors of
/// later calls before it is reported are dropped. A CUDA error (an illegal
/// address, ...) is reported as `ENGRAM_STATUS_ERR_DEVICE` by the next call
/// that reaches the driver.
///
/// Batch invariance on CUDA: a token's result is the same bits in every
/// batch of 1 to 8 tokens with a bf16, f16 or GGUF-block `wkv` (GEMV
/// kernels, each token summed in one order whatever the batch; they need
/// `C*Hd` a multiple of 8, and for bf16 a 16-byte aligned `wkv`, for the
/// others a multiple of 32, else every size is cuBLAS's). Batches of 9
/// or more tokens go through cuBLAS (a quantised `wkv` as bf16 tiles), whose
/// algorithm depends on the batch size: within the stated bound, not bit for
/// bit, of the same token in another batch; an f32 `wkv` always uses cuBLAS.
/// The CPU backend is batch invariant for every size.
///
/// `ctx` as in `engram_free`; `row_ids` and `highway` must hold the sizes above.
#[no_mangle]
pub extern "C" fn engram_apply(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
    highway: *mut c_void,
    highway_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let ids = slice(row_ids, n * c.ids_per_token(), "row_ids")?;
        let hw = self::highway(highway, highway_type)?;
        c.apply_on(layer_id, RowIds::Host(ids), n, hw, stream)
    })
}

/// `engram_apply` with the row ids already in device memory (CUDA backend):
/// `row_ids` is a device pointer to `[n_tokens, n_layers, C]` int64, the
/// `engram_hash` output copied to the device by the engine (for example with
/// `cudaMemcpyAsync` on `stream`, ahead of the call). Nothing is read on the
/// host, so the call can be captured in a CUDA graph and replayed after the
/// engine re-fills the same buffer. The ids are checked on the device: a token
/// with a row id outside the table or only partly `ENGRAM_ROW_ID_DEAD` is left
/// untouched and the first such error is reported as `engram_apply` reports
/// errors the kernels find (`ENGRAM_STATUS_ERR_INVALID_ROW_ID`). With a table
/// in host memory the rows are read from the layer's device staging buffer,
/// which `engram_stage` fills for the same ids before the call (or replay).
/// `row_ids` must be 8-byte aligned and `highway` aligned to its element
/// (4 bytes f32, 2 bf16): a misaligned pointer is
/// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` and nothing is queued (on a GPU it
/// would be a fault that ends the whole CUDA context). A captured graph is
/// bound to the weights and staging buffers of the layers at capture: after
/// `engram_set_layer` of one of them, capture it again.
/// The CPU backend returns `ENGRAM_STATUS_ERR_UNSUPPORTED`.
///
/// `ctx` as in `engram_free`; `row_ids` and `highway` must be device memory of
/// the sizes above, `stream` a stream of the context's device or NULL.
#[no_mangle]
pub extern "C" fn engram_apply_device_ids(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
    highway: *mut c_void,
    highway_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let hw = self::highway(highway, highway_type)?;
        let ids = RowIds::Device(row_ids as u64);
        c.apply_on(layer_id, ids, n_tokens as usize, hw, stream)
    })
}

/// Read back what `engram_apply` computes for layer `layer_id` and
/// `n_tokens` tokens (host `row_ids`, `[n_tokens, n_layers, C]`), for an
/// engine validating its integration: the gathered rows dequantised to bf16,
/// `[n_tokens, C*Hd]` into `rows` (capacity `rows_cap` values), and the
/// projection `kv` rounded to bf16, `[n_tokens, D*(hc+1)]` into `kv`
/// (capacity `kv_cap`); a dead token's values are zero. Host buffers, on every
/// backend. Slow (it allocates and waits): not for the step loop. The
/// highway is not touched. On error nothing is written. On CUDA it runs on
/// the context's own stream, after the work of the context's last call on
/// the engine's stream (it waits for that call's event; replays of captured
/// graphs must have finished), and waits for its own stream only, never the
/// whole device or the legacy stream; it replaces what `engram_stage` staged
/// for a host-table layer (stage again before a replay).
///
/// `ctx` as in `engram_free`; the buffers must hold the capacities given.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn engram_read_back(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
    rows: *mut u16,
    rows_cap: usize,
    kv: *mut u16,
    kv_cap: usize,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let ids = slice(row_ids, n * c.ids_per_token(), "row_ids")?;
        let (need_rows, need_kv) = (n * c.kv_in(), n * c.kv_out());
        for (what, cap, need) in [("rows", rows_cap, need_rows), ("kv", kv_cap, need_kv)] {
            if cap < need {
                bail!(
                    ErrInvalidArgument,
                    "{what} holds {cap} values, {n} tokens need {need}"
                );
            }
        }
        let rows = slice_mut(rows, need_rows, "rows")?;
        let kv = slice_mut(kv, need_kv, "kv")?;
        let r = c.read_back(layer_id, RowIds::Host(ids), n)?;
        rows.copy_from_slice(&r.rows);
        kv.copy_from_slice(&r.kv);
        Ok(())
    })
}

/// Wait for `stream` (CUDA backend; NULL: the legacy default stream) and report
/// what went wrong in the work this context queued: an asynchronous CUDA error
/// (`ENGRAM_STATUS_ERR_DEVICE`) or an error the kernels found in the row ids or
/// rows (`ENGRAM_STATUS_ERR_INVALID_ROW_ID`, `ENGRAM_STATUS_ERR_INVALID_DATA`,
/// or `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` for a host table's row that
/// `engram_stage` did not stage; reported once). `ENGRAM_STATUS_OK` when all is well, and always on the CPU
/// backend. It synchronises, so it is not for a captured step.
///
/// `ctx` as in `engram_free`; `stream` a stream of the context's device or NULL.
#[no_mangle]
pub extern "C" fn engram_check(ctx: *mut EngramContext, stream: *mut c_void) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.check(stream) })
}

/// Start gathering the table rows of engram layer `layer_id` for a step on
/// the context's worker threads, right after `engram_hash` gave `row_ids`
/// (`[n_tokens, n_layers, C]`), and return without waiting: hints the kernel
/// about the pages (`madvise`/`posix_fadvise` WILLNEED) and copies the raw
/// rows into one of the layer's two staging buffers. `engram_apply` with the
/// same `row_ids` then waits only for that gather; an apply for ids nobody
/// prefetched reads the table itself. The ids are checked here as
/// `engram_apply` checks them (nothing changes on error); a read that fails
/// later (an I/O error on a file-backed table) is returned by that apply as
/// `ENGRAM_STATUS_ERR_IO`. Host tables only, on either backend (a no-op for a
/// table in device memory on CUDA). On CUDA the layer's two staging buffers
/// are pinned memory, which the apply copies to the device from (each row is
/// copied once on the host); a gather into a buffer first waits, on the
/// worker thread, for the device copy an earlier apply queued from it.
///
/// `ctx` as in `engram_free`; `row_ids` must hold
/// `n_tokens * engram_row_ids_per_token(ctx)` elements.
#[no_mangle]
pub extern "C" fn engram_prefetch(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let ids = slice(row_ids, n * c.ids_per_token(), "row_ids")?;
        c.prefetch(layer_id, ids, n)
    })
}

/// Stage the table rows of engram layer `layer_id` for a step's `row_ids`
/// (host memory, `[n_tokens, n_layers, C]`, as `engram_hash` wrote them) where
/// a later `engram_apply_device_ids` on `stream` reads them: the step of a
/// CUDA graph whose layer's table is in host memory or a file. The CUDA
/// backend gathers the rows on the host now (waiting for an
/// `engram_prefetch` of the same ids if there was one), and queues their copy
/// into the layer's device staging buffer (a fixed device address, captured
/// into the graph) on `stream`; call it before each replay, on the graph's
/// stream (or one the engine orders before it). The graph's kernels check
/// each position's staged id against the device row ids they are given: a
/// row that was not staged is reported as `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`
/// (found on the device). Not while `stream` is capturing. For a table in
/// device memory, nothing needs staging (`ENGRAM_STATUS_OK`); on the CPU
/// backend it starts the gather as `engram_prefetch` does. The ids are
/// checked here as `engram_apply` checks them.
///
/// `ctx` as in `engram_free`; `row_ids` must hold
/// `n_tokens * engram_row_ids_per_token(ctx)` elements; `stream` a stream of
/// the context's device or NULL.
#[no_mangle]
pub extern "C" fn engram_stage(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let ids = slice(row_ids, n * c.ids_per_token(), "row_ids")?;
        c.stage(layer_id, ids, n, stream)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    /// A one-layer context of the smallest geometry (as c_tests' LSan probe).
    fn tiny() -> *mut EngramContext {
        static LAYERS: [u32; 1] = [0];
        static TOKEN_MAP: [i32; 1] = [0];
        static MULT: [u64; 2] = [1, 1];
        static PRIMES: [u64; 1] = [2];
        static OFFSETS: [u64; 1] = [0];
        let cfg = EngramConfig {
            hidden_size: 1,
            hc: 1,
            head_dim: 1,
            n_heads: 1,
            max_ngram: 2,
            layer_ids: LAYERS.as_ptr(),
            n_layers: 1,
            token_map: TOKEN_MAP.as_ptr(),
            token_map_len: 1,
            multipliers: MULT.as_ptr(),
            n_multipliers: 2,
            primes: PRIMES.as_ptr(),
            n_primes: 1,
            offsets: OFFSETS.as_ptr(),
            n_offsets: 1,
            max_tokens: 1,
            max_seqs: 1,
            max_positions: 1,
            ..EngramConfig::default()
        };
        let mut out = std::ptr::null_mut();
        assert_eq!(engram_create(&cfg, &mut out), EngramStatus::Ok);
        out
    }

    #[test]
    fn free_waits_for_a_call_in_flight() {
        let p = tiny() as usize;
        let (entered, go) = mpsc::channel();
        let t = std::thread::spawn(move || {
            let call = ctx(p as *const EngramContext).unwrap();
            entered.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            drop(call);
        });
        go.recv().unwrap();
        let t0 = Instant::now();
        engram_free(p as *mut EngramContext);
        let waited = t0.elapsed();
        t.join().unwrap();
        assert!(
            waited >= Duration::from_millis(50),
            "engram_free returned after {waited:?}, under the call's 100 ms"
        );
    }

    #[test]
    fn a_call_that_starts_while_the_free_waits_is_refused() {
        let p = tiny();
        // SAFETY: `p` is a live context no other thread uses; the flag is
        // what engram_free sets before it waits.
        unsafe { (*p).freeing.store(true, Ordering::SeqCst) };
        assert_eq!(engram_row_ids_per_token(p), 0);
        let e = ctx(p).err().unwrap();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument);
        assert!(e.message.contains("being freed"), "{}", e.message);
        // The refused calls left the in-flight count as it was.
        // SAFETY: `p` is still the live context from `tiny()` (engram_free comes
        // after) and no other thread uses it.
        assert_eq!(unsafe { (*p).calls.load(Ordering::SeqCst) }, 0);
        engram_free(p);
    }
}
