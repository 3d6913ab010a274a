//! The C ABI. It converts and checks arguments and forwards to [`Context`];
//! it holds no engram logic. Every exported body runs inside [`guard`], one
//! panic boundary that turns a panic into `ENGRAM_ERR_INTERNAL`.

use crate::context::{Context, ContextConfig, Geometry, Highway, LayerIn, TableIn};
use crate::error::{bail, EngramStatus, Error, Result};
use crate::formats::{EngramType, RowFormat, WeightDtype, WeightFormat, Weights};
use crate::hash::{HashTablesIn, Limits};
use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Opaque engram context. Create with `engram_create`, release with `engram_free`.
pub struct EngramContext {
    inner: Context<'static>,
    /// What `inner` borrows when the library loaded it (a mapped GGUF file);
    /// dropped after `inner`.
    _owner: Option<Box<crate::gguf::GgufModel>>,
}

/// Configuration for `engram_create`. Fill it with `engram_config_init`, which
/// sets `struct_size` and the defaults, then set the fields. Every pointer is
/// read during `engram_create` only: the tables are copied (validated and
/// widened), so the caller may free them afterwards.
#[repr(C)]
pub struct EngramConfig {
    /// `sizeof(engram_config)`; checked, so that a header and library of
    /// different versions are caught instead of misread.
    pub struct_size: usize,
    /// `ENGRAM_BACKEND_CPU`, or `ENGRAM_BACKEND_CUDA`: `engram_apply` then
    /// runs on the device, on the caller's device pointers and CUDA stream (see
    /// `engram_set_layer`, `engram_apply`, `engram_apply_device_ids`,
    /// `engram_check`). `engram_create` with CUDA loads the driver (a machine
    /// without one gets `ENGRAM_STATUS_ERR_DEVICE`), compiles the kernels with
    /// NVRTC for the device (libnvrtc and libcublas must be loadable) and
    /// allocates every device workspace for `max_tokens`.
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
    /// RMS epsilon of the gate.
    pub eps: f32,
    /// Model layer ids of the engram layers, `[n_layers]`; row ids come out in this order.
    pub layer_ids: *const u32,
    pub n_layers: u32,
    /// Raw token id -> compressed id (`-1`: the token is dead), `[token_map_len]`.
    pub token_map: *const i32,
    pub token_map_len: usize,
    /// The pad token's compressed id (`token_map[pad_token_id]`, as GGUF stores it).
    pub pad_id: i64,
    /// `[n_layers * max_ngram]`, i64 values as u64 bits.
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
    /// Threads the CPU backend may use in one call (0 or 1: the calling thread only).
    pub n_threads: u32,
}

/// One engram layer's weights for `engram_set_layer`. All pointers are
/// borrowed: they must stay valid and unchanged until the layer is set again
/// or the context is freed. Nothing is copied except `q * k` (`hc * D` floats).
/// With the CUDA backend every pointer is device memory of the context's
/// device (`wkv` bf16 or f32; any table format).
#[repr(C)]
pub struct EngramLayerWeights {
    /// `sizeof(engram_layer_weights)`.
    pub struct_size: usize,
    /// Model layer id (one of the config's `layer_ids`).
    pub layer_id: u32,
    /// Format of the table rows (`ENGRAM_TYPE_*`).
    pub table_type: u32,
    /// The table: `table_rows` rows of `Hd` values in `table_type`.
    pub table: *const c_void,
    pub table_rows: u64,
    /// `[D*(hc+1), C*Hd]` row-major; `wkv_type` f32, bf16, or a GGUF block
    /// format (`ENGRAM_TYPE_Q8_0`, `Q4_0`, `Q2_K` ... `Q6_K`, each row whole
    /// blocks), read in place and dequantised on the fly.
    pub wkv: *const c_void,
    pub wkv_type: u32,
    /// `q` and `k` norm weights, `[hc, D]` each, `qk_type` f32 or bf16.
    pub q: *const c_void,
    pub k: *const c_void,
    pub qk_type: u32,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

/// The panic boundary: run `f`, record a failure's message for
/// `engram_last_error`, and return its status.
fn guard(f: impl FnOnce() -> Result<()>) -> EngramStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => EngramStatus::Ok,
        Ok(Err(e)) => {
            set_last_error(&e.message);
            e.status
        }
        Err(p) => {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!(
                "internal error (panic caught at the C boundary): {what}"
            ));
            EngramStatus::ErrInternal
        }
    }
}

/// A borrowed slice from a C pointer and element count. NULL is accepted only
/// for an empty slice; misaligned or oversized pointers are refused.
///
/// # Safety
/// When non-null, `p` must point to `n` readable `T`s that outlive `'a`.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    check_ptr(
        p as *const c_void,
        n,
        std::mem::size_of::<T>(),
        std::mem::align_of::<T>(),
        what,
    )?;
    Ok(std::slice::from_raw_parts(p, n))
}

/// # Safety
/// As [`slice`], for writable memory that no other reference aliases.
unsafe fn slice_mut<'a, T>(p: *mut T, n: usize, what: &str) -> Result<&'a mut [T]> {
    if n == 0 {
        return Ok(&mut []);
    }
    check_ptr(
        p as *const c_void,
        n,
        std::mem::size_of::<T>(),
        std::mem::align_of::<T>(),
        what,
    )?;
    Ok(std::slice::from_raw_parts_mut(p, n))
}

fn check_ptr(p: *const c_void, n: usize, size: usize, align: usize, what: &str) -> Result<()> {
    if p.is_null() {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    if (p as usize) % align != 0 {
        bail!(ErrInvalidArgument, "{what} is not aligned to {align} bytes");
    }
    if n.checked_mul(size).is_none_or(|b| b > isize::MAX as usize) {
        bail!(ErrInvalidArgument, "{what}: {n} elements is too large");
    }
    Ok(())
}

fn non_null<T>(p: *const T, what: &str) -> Result<()> {
    if p.is_null() {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    Ok(())
}

/// # Safety
/// `p` must be NULL or point to a live context.
unsafe fn ctx<'a>(p: *const EngramContext) -> Result<&'a Context<'static>> {
    non_null(p, "ctx")?;
    Ok(&(*p).inner)
}

/// Read `struct_size` (the first field) before touching the rest of a struct.
///
/// # Safety
/// `p` must be NULL or point to at least a `usize`.
unsafe fn check_struct_size<T>(p: *const T, name: &str) -> Result<()> {
    non_null(p, name)?;
    let got = std::ptr::read(p as *const usize);
    let want = std::mem::size_of::<T>();
    if got != want {
        bail!(
            ErrStructSize,
            "{name}.struct_size is {got}, this library (v{}) expects {want}",
            env!("CARGO_PKG_VERSION")
        );
    }
    Ok(())
}

/// Fill `cfg` with defaults: zero everywhere, `struct_size` set, the CPU
/// backend, `eps = 1e-6`, one thread. NULL is ignored.
///
/// # Safety
/// `cfg` must be NULL or point to writable memory of `sizeof(engram_config)`.
#[no_mangle]
pub unsafe extern "C" fn engram_config_init(cfg: *mut EngramConfig) {
    if cfg.is_null() {
        return;
    }
    std::ptr::write(
        cfg,
        EngramConfig {
            struct_size: std::mem::size_of::<EngramConfig>(),
            backend: crate::EngramBackend::Cpu as u32,
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
        },
    );
}

/// Fill `w` with `struct_size` set and everything else zero. NULL is ignored.
///
/// # Safety
/// `w` must be NULL or point to writable memory of `sizeof(engram_layer_weights)`.
#[no_mangle]
pub unsafe extern "C" fn engram_layer_weights_init(w: *mut EngramLayerWeights) {
    if w.is_null() {
        return;
    }
    std::ptr::write(
        w,
        EngramLayerWeights {
            struct_size: std::mem::size_of::<EngramLayerWeights>(),
            layer_id: 0,
            table_type: 0,
            table: std::ptr::null(),
            table_rows: 0,
            wkv: std::ptr::null(),
            wkv_type: 0,
            q: std::ptr::null(),
            k: std::ptr::null(),
            qk_type: 0,
        },
    );
}

/// Create a context. On success `*out` receives it; on failure `*out` is left
/// as it was and `engram_last_error()` says why.
///
/// # Safety
/// `cfg` must be NULL or a valid `engram_config` whose pointers hold the counts
/// it states; `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn engram_create(
    cfg: *const EngramConfig,
    out: *mut *mut EngramContext,
) -> EngramStatus {
    guard(|| {
        check_struct_size(cfg, "config")?;
        non_null(out, "out")?;
        let c = &*cfg;
        let n_layers = c.n_layers as usize;
        let layer_ids = slice(c.layer_ids, n_layers, "config.layer_ids")?;
        let token_map = slice(c.token_map, c.token_map_len, "config.token_map")?;
        let multipliers = slice(c.multipliers, c.n_multipliers, "config.multipliers")?;
        let primes = slice(c.primes, c.n_primes, "config.primes")?;
        let offsets = slice(c.offsets, c.n_offsets, "config.offsets")?;
        let cc = ContextConfig {
            geometry: Geometry {
                d: c.hidden_size as usize,
                hc: c.hc as usize,
                hd: c.head_dim as usize,
                eps: c.eps,
            },
            tables: HashTablesIn {
                layer_ids,
                max_ngram: c.max_ngram as usize,
                n_heads: c.n_heads as usize,
                token_map,
                pad_id: c.pad_id,
                multipliers,
                primes,
                offsets,
            },
            limits: Limits {
                max_tokens: c.max_tokens as usize,
                max_seqs: c.max_seqs as usize,
                max_positions: c.max_positions as usize,
            },
            n_threads: c.n_threads as usize,
            backend: c.backend,
        };
        let inner = Context::with_device(&cc, c.device)?;
        *out = Box::into_raw(Box::new(EngramContext {
            inner,
            _owner: None,
        }));
        Ok(())
    })
}

/// Free a context. NULL is a no-op. With the CUDA backend it first waits for
/// the device to finish the work queued so far (`cuCtxSynchronize`), so that
/// nothing queued still reads the workspaces it frees.
///
/// # Safety
/// `ctx` must be NULL or a context from `engram_create` not yet freed, with no
/// call on it in flight.
#[no_mangle]
pub unsafe extern "C" fn engram_free(ctx: *mut EngramContext) {
    if ctx.is_null() {
        return;
    }
    // Dropping frees only what the context allocated; borrowed weights are untouched.
    let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(ctx))));
}

/// A borrowed weight of `n` values in rows of `row_len`: f32, bf16, or (where
/// `quant_ok`) a GGUF block format read in place.
fn weights(
    p: *const c_void,
    n: usize,
    row_len: usize,
    ty: u32,
    quant_ok: bool,
    what: &str,
) -> Result<Weights<'static>> {
    let fmt = if quant_ok {
        WeightFormat::new(ty, row_len, what)?
    } else {
        WeightFormat::Dense(WeightDtype::new(ty, what)?)
    };
    // SAFETY: the caller promises `p` holds `n` values of `ty` for the context's life.
    unsafe {
        Ok(match fmt {
            WeightFormat::Dense(WeightDtype::F32) => Weights::F32(slice(p as *const f32, n, what)?),
            WeightFormat::Dense(WeightDtype::Bf16) => {
                Weights::Bf16(slice(p as *const u16, n, what)?)
            }
            WeightFormat::Quant(f) => {
                let bytes = fmt.bytes(n / row_len, row_len).ok_or_else(|| {
                    Error::new(
                        EngramStatus::ErrInvalidArgument,
                        format!("{what}: {n} values is too large"),
                    )
                })?;
                Weights::quant(f, slice(p as *const u8, bytes, what)?, row_len)?
            }
        })
    }
}

/// Register (or replace) the weights of one engram layer. The pointers are
/// borrowed (see `engram_layer_weights`).
///
/// # Safety
/// `ctx` as in `engram_free`; `w` must be NULL or a valid struct whose pointers
/// hold the sizes the geometry implies and outlive their use by the context.
#[no_mangle]
pub unsafe extern "C" fn engram_set_layer(
    ctx: *mut EngramContext,
    w: *const EngramLayerWeights,
) -> EngramStatus {
    guard(|| {
        let c = self::ctx(ctx)?;
        check_struct_size(w, "layer weights")?;
        let w = &*w;
        let g = c.geometry();
        if c.tables().layer_index(w.layer_id).is_none() {
            bail!(
                ErrUnknownLayer,
                "layer {} is not an engram layer (engram layers: {:?})",
                w.layer_id,
                c.tables().layer_ids
            );
        }
        if c.cuda().is_some() {
            // Device pointers: checked against the driver's view of them, never read here.
            return c.set_layer_device(&crate::cuda::DeviceLayerIn {
                layer_id: w.layer_id,
                table: w.table as u64,
                table_rows: w.table_rows,
                table_type: w.table_type,
                wkv: w.wkv as u64,
                wkv_type: w.wkv_type,
                q: w.q as u64,
                k: w.k as u64,
                qk_type: w.qk_type,
            });
        }
        let format = RowFormat::new(w.table_type, g.hd)?;
        non_null(w.table, "weights.table")?;
        let rb = format.row_bytes(g.hd) as u64;
        let bytes = w
            .table_rows
            .checked_mul(rb)
            .filter(|&b| b <= isize::MAX as u64)
            .ok_or_else(|| {
                Error::new(
                    EngramStatus::ErrInvalidArgument,
                    format!("table of {} rows of {rb} bytes is too large", w.table_rows),
                )
            })?;
        let table = slice(w.table as *const u8, bytes as usize, "weights.table")?;
        let n_wkv = c.kv_in() * c.kv_out();
        let n_qk = g.hc * g.d;
        let layer = LayerIn {
            layer_id: w.layer_id,
            table: TableIn {
                data: table,
                format,
                rows: w.table_rows,
            },
            wkv: weights(w.wkv, n_wkv, c.kv_in(), w.wkv_type, true, "weights.wkv")?,
            q: weights(w.q, n_qk, g.d, w.qk_type, false, "weights.q")?,
            k: weights(w.k, n_qk, g.d, w.qk_type, false, "weights.k")?,
        };
        c.set_layer(layer)
    })
}

/// Row ids each token produces: `n_layers * C`. The output of `engram_hash` is
/// `[n_tokens, n_layers, C]`. NULL `ctx` gives 0.
///
/// # Safety
/// `ctx` must be NULL or a live context.
#[no_mangle]
pub unsafe extern "C" fn engram_row_ids_per_token(ctx: *const EngramContext) -> usize {
    catch_unwind(AssertUnwindSafe(|| {
        self::ctx(ctx).map(|c| c.ids_per_token()).unwrap_or(0)
    }))
    .unwrap_or(0)
}

/// Hash a batch of `n_tokens` tokens. Token `i` is at absolute position
/// `pos[i]` of sequence `seq_ids[i]`; `tokens[i]` is a raw token id or
/// `ENGRAM_TOKEN_DEAD`. Writes `[n_tokens, n_layers, C]` row ids into
/// `row_ids` (capacity `row_ids_cap` elements); a dead token gets
/// `ENGRAM_ROW_ID_DEAD` in every column. Each position is recorded in its
/// sequence's history (hashing a position again overwrites it: rollback is
/// re-hashing). On error nothing is written and the history is unchanged.
///
/// # Safety
/// `ctx` as in `engram_free`; the arrays must hold `n_tokens` elements and
/// `row_ids` `row_ids_cap`.
#[no_mangle]
pub unsafe extern "C" fn engram_hash(
    ctx: *mut EngramContext,
    tokens: *const i32,
    seq_ids: *const i32,
    pos: *const i32,
    n_tokens: u32,
    row_ids: *mut i64,
    row_ids_cap: usize,
) -> EngramStatus {
    guard(|| {
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

/// Make sequence `dst`'s history an exact copy of `src`'s (fork, shared prefix).
///
/// # Safety
/// `ctx` as in `engram_free`.
#[no_mangle]
pub unsafe extern "C" fn engram_seq_copy(
    ctx: *mut EngramContext,
    src: i32,
    dst: i32,
) -> EngramStatus {
    guard(|| self::ctx(ctx)?.seq_copy(src, dst))
}

/// Forget every position of sequence `seq`.
///
/// # Safety
/// `ctx` as in `engram_free`.
#[no_mangle]
pub unsafe extern "C" fn engram_seq_drop(ctx: *mut EngramContext, seq: i32) -> EngramStatus {
    guard(|| self::ctx(ctx)?.seq_drop(seq))
}

/// Apply engram layer `layer_id` to `n_tokens` tokens: `row_ids` is the
/// `engram_hash` output for them (`[n_tokens, n_layers, C]`), `highway` is
/// `[n_tokens, hc, D]` of `highway_type` (`ENGRAM_TYPE_F32` or
/// `ENGRAM_TYPE_BF16`), updated in place: `x += gate * value` per stream,
/// computed in f32, rounded once to nearest-even for bf16. Dead tokens are
/// left untouched. `stream` is ignored by the CPU backend. On error the
/// highway is unchanged.
///
/// CUDA backend: `row_ids` is host memory, checked here as on the CPU, then
/// staged through pinned memory and copied on `stream`; `highway` is device
/// memory; `stream` is a `CUstream` / `cudaStream_t` of the context's device
/// (NULL: the legacy default stream). The call queues its work on `stream` and
/// returns without waiting for it (it waits only when `stream` is 4 or more
/// host-id calls behind, for the oldest staged copy) and allocates nothing.
/// Calls on one context share its workspaces: order them (one stream, or
/// streams the engine orders). Host row ids cannot be captured in a CUDA graph
/// (`ENGRAM_STATUS_ERR_INVALID_ARGUMENT` while `stream` is capturing): use
/// `engram_apply_device_ids`. An error the kernels find (a NaN code in an fp8
/// row) leaves that token untouched; it is reported, once, by a later
/// `engram_apply` or `engram_apply_device_ids` on this context when the device
/// has run that work (that later call then does nothing), and by
/// `engram_check`. A CUDA error (an illegal address, ...) is reported as
/// `ENGRAM_STATUS_ERR_DEVICE` by the next call that reaches the driver.
///
/// # Safety
/// `ctx` as in `engram_free`; `row_ids` and `highway` must hold the sizes above.
#[no_mangle]
pub unsafe extern "C" fn engram_apply(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
    highway: *mut c_void,
    highway_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    guard(|| {
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let g = c.geometry();
        let ids = slice(row_ids, n * c.ids_per_token(), "row_ids")?;
        if c.cuda().is_some() {
            let ids = crate::cuda::RowIds::Host(ids);
            return c.apply_device(layer_id, ids, n, highway as u64, highway_type, stream);
        }
        let len = n * g.hc * g.d;
        let hw = match EngramType::from_u32(highway_type) {
            Some(EngramType::F32) => Highway::F32(slice_mut(highway as *mut f32, len, "highway")?),
            Some(EngramType::Bf16) => {
                Highway::Bf16(slice_mut(highway as *mut u16, len, "highway")?)
            }
            _ => bail!(
                ErrUnsupported,
                "highway type {highway_type} is not supported (ENGRAM_TYPE_F32 or ENGRAM_TYPE_BF16)"
            ),
        };
        c.apply(layer_id, ids, n, hw)
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
/// errors the kernels find (`ENGRAM_STATUS_ERR_INVALID_ROW_ID`). The CPU
/// backend returns `ENGRAM_STATUS_ERR_UNSUPPORTED`.
///
/// # Safety
/// `ctx` as in `engram_free`; `row_ids` and `highway` must be device memory of
/// the sizes above, `stream` a stream of the context's device or NULL.
#[no_mangle]
pub unsafe extern "C" fn engram_apply_device_ids(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
    highway: *mut c_void,
    highway_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    guard(|| {
        let c = self::ctx(ctx)?;
        let ids = crate::cuda::RowIds::Device(row_ids as u64);
        c.apply_device(
            layer_id,
            ids,
            n_tokens as usize,
            highway as u64,
            highway_type,
            stream,
        )
    })
}

/// Wait for `stream` (CUDA backend; NULL: the legacy default stream) and report
/// what went wrong in the work this context queued: an asynchronous CUDA error
/// (`ENGRAM_STATUS_ERR_DEVICE`) or an error the kernels found in the row ids or
/// rows (`ENGRAM_STATUS_ERR_INVALID_ROW_ID`, `ENGRAM_STATUS_ERR_INVALID_DATA`;
/// reported once). `ENGRAM_STATUS_OK` when all is well, and always on the CPU
/// backend. It synchronises, so it is not for a captured step.
///
/// # Safety
/// `ctx` as in `engram_free`; `stream` a stream of the context's device or NULL.
#[no_mangle]
pub unsafe extern "C" fn engram_check(
    ctx: *mut EngramContext,
    stream: *mut c_void,
) -> EngramStatus {
    guard(|| self::ctx(ctx)?.check_device(stream))
}

/// The library version, `"MAJOR.MINOR.PATCH"` (equal to the header's
/// `ENGRAM_VERSION_STRING` when header and library match).
#[no_mangle]
pub extern "C" fn engram_version() -> *const c_char {
    static V: &CStr =
        match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => panic!("version string"),
        };
    V.as_ptr()
}

/// A static description of a status code (unknown codes included).
#[no_mangle]
pub extern "C" fn engram_status_str(status: i32) -> *const c_char {
    let s: &'static CStr = match EngramStatus::from_i32(status) {
        Some(st) => status_cstr(st),
        None => c"unknown status",
    };
    s.as_ptr()
}

/// `EngramStatus::as_str` as C strings, built once.
fn status_cstr(s: EngramStatus) -> &'static CStr {
    static T: std::sync::OnceLock<Vec<CString>> = std::sync::OnceLock::new();
    let t = T.get_or_init(|| {
        EngramStatus::ALL
            .iter()
            .map(|s| CString::new(s.as_str()).expect("no NUL in status text"))
            .collect()
    });
    let i = EngramStatus::ALL
        .iter()
        .position(|x| *x == s)
        .expect("every status is in ALL");
    &t[i]
}

/// The message of the last failed call on the calling thread ("" if none).
/// Valid until the next failing call on this thread.
#[no_mangle]
pub extern "C" fn engram_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_strings_cover_every_status() {
        for s in EngramStatus::ALL {
            let c = unsafe { CStr::from_ptr(engram_status_str(s as i32)) };
            assert_eq!(c.to_str().unwrap(), s.as_str());
        }
        let c = unsafe { CStr::from_ptr(engram_status_str(12345)) };
        assert_eq!(c.to_str().unwrap(), "unknown status");
    }

    #[test]
    fn panics_become_internal_errors() {
        let st = guard(|| panic!("boom"));
        assert_eq!(st, EngramStatus::ErrInternal);
        let msg = unsafe { CStr::from_ptr(engram_last_error()) }
            .to_str()
            .unwrap();
        assert!(msg.contains("boom"), "{msg}");
    }
}
// ---------------------------------------------------------------------------
// Loading the real model: hash tables from config.json + tokenizer.json, a
// context straight from a GGUF file, and the prefetching gather.
// ---------------------------------------------------------------------------

/// Hash tables derived from a model's `config.json` and `tokenizer.json`
/// (`engram_tables_from_files`). Free with `engram_tables_free`.
pub struct EngramTablesHandle {
    inner: crate::tables::EngramTables,
}

/// A C path argument as a `Path`.
///
/// # Safety
/// `p` must be NULL or a NUL-terminated string.
unsafe fn path_arg<'a>(p: *const c_char, what: &str) -> Result<&'a std::path::Path> {
    non_null(p, what)?;
    let s = CStr::from_ptr(p).to_str().map_err(|_| {
        Error::new(
            EngramStatus::ErrInvalidArgument,
            format!("{what} is not UTF-8"),
        )
    })?;
    if s.is_empty() {
        bail!(ErrInvalidArgument, "{what} is empty");
    }
    Ok(std::path::Path::new(s))
}

/// Derive the hash tables (token map, multipliers, primes, offsets) from a
/// model's `config.json` (its engram fields; the README lists the names
/// accepted) and its Hugging Face `tokenizer.json`, as SPEC section 3 states.
/// On success `*out` receives an object to pass to `engram_tables_fill_config`
/// and to free with `engram_tables_free`; on failure `*out` is left as it was
/// (`ENGRAM_STATUS_ERR_IO` for a file that cannot be read,
/// `ENGRAM_STATUS_ERR_INVALID_CONFIG` for missing or inconsistent fields).
///
/// # Safety
/// `config_json` and `tokenizer_json` must be NULL or NUL-terminated paths;
/// `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn engram_tables_from_files(
    config_json: *const c_char,
    tokenizer_json: *const c_char,
    out: *mut *mut EngramTablesHandle,
) -> EngramStatus {
    guard(|| {
        let c = path_arg(config_json, "config_json")?;
        let t = path_arg(tokenizer_json, "tokenizer_json")?;
        non_null(out, "out")?;
        let inner = crate::tables::EngramTables::from_files(c, t)?;
        *out = Box::into_raw(Box::new(EngramTablesHandle { inner }));
        Ok(())
    })
}

/// Point `cfg`'s hash fields at the tables (`n_heads`, `max_ngram`,
/// `layer_ids`/`n_layers`, `token_map`/`token_map_len`, `pad_id`,
/// `multipliers`, `primes`, `offsets` and their counts) and set
/// `hidden_size`, `hc` and `head_dim` where the config.json gave them (the
/// other fields are left as they are). The pointers stay valid until
/// `engram_tables_free`; `engram_create` copies them, so the tables may be
/// freed once the context exists.
///
/// # Safety
/// `tables` must be NULL or from `engram_tables_from_files`; `cfg` NULL or a
/// struct filled by `engram_config_init`.
#[no_mangle]
pub unsafe extern "C" fn engram_tables_fill_config(
    tables: *const EngramTablesHandle,
    cfg: *mut EngramConfig,
) -> EngramStatus {
    guard(|| {
        non_null(tables, "tables")?;
        check_struct_size(cfg as *const EngramConfig, "config")?;
        let t = &(*tables).inner;
        let c = &mut *cfg;
        c.n_heads = t.config.n_heads as u32;
        c.max_ngram = t.config.max_ngram as u32;
        c.layer_ids = t.config.layer_ids.as_ptr();
        c.n_layers = t.config.layer_ids.len() as u32;
        c.token_map = t.token_map.as_ptr();
        c.token_map_len = t.token_map.len();
        c.pad_id = t.pad_id;
        c.multipliers = t.multipliers.as_ptr();
        c.n_multipliers = t.multipliers.len();
        c.primes = t.primes.as_ptr();
        c.n_primes = t.primes.len();
        c.offsets = t.offsets.as_ptr();
        c.n_offsets = t.offsets.len();
        let small = |v: Option<usize>| v.and_then(|x| u32::try_from(x).ok());
        if let Some(d) = small(t.config.hidden_size) {
            c.hidden_size = d;
        }
        if let Some(h) = small(t.config.hc) {
            c.hc = h;
        }
        if let Some(h) = small(t.config.head_dim) {
            c.head_dim = h;
        }
        Ok(())
    })
}

/// Rows the table of engram layer `layer_id` has (the sum of its primes), or 0
/// when `tables` is NULL or the layer is not an engram layer.
///
/// # Safety
/// `tables` must be NULL or from `engram_tables_from_files`.
#[no_mangle]
pub unsafe extern "C" fn engram_tables_layer_rows(
    tables: *const EngramTablesHandle,
    layer_id: u32,
) -> u64 {
    if tables.is_null() {
        return 0;
    }
    let t = &(*tables).inner;
    t.config
        .layer_ids
        .iter()
        .position(|&l| l == layer_id)
        .map_or(0, |i| t.rows[i])
}

/// Distinct compressed token ids of the tables' token map (0 for NULL).
///
/// # Safety
/// `tables` must be NULL or from `engram_tables_from_files`.
#[no_mangle]
pub unsafe extern "C" fn engram_tables_compressed_vocab(
    tables: *const EngramTablesHandle,
) -> usize {
    if tables.is_null() {
        return 0;
    }
    (*tables).inner.compressed_vocab
}

/// Free tables from `engram_tables_from_files`. NULL is a no-op.
///
/// # Safety
/// `tables` must be NULL or from `engram_tables_from_files`, not yet freed.
#[no_mangle]
pub unsafe extern "C" fn engram_tables_free(tables: *mut EngramTablesHandle) {
    if !tables.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| drop(Box::from_raw(tables))));
    }
}

/// Options of `engram_create_from_gguf`. Fill with `engram_gguf_options_init`.
#[repr(C)]
pub struct EngramGgufOptions {
    /// `sizeof(engram_gguf_options)`.
    pub struct_size: usize,
    /// `ENGRAM_BACKEND_CPU` (the GGUF loader serves host tables to the CPU backend).
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

/// Fill `o` with defaults: `struct_size`, the CPU backend, `eps = 1e-6`,
/// `max_tokens = 4096`, `max_seqs = 64`, `max_positions = 131072`, one thread,
/// no config/tokenizer, `pread` tables. NULL is ignored.
///
/// # Safety
/// `o` must be NULL or point to writable memory of `sizeof(engram_gguf_options)`.
#[no_mangle]
pub unsafe extern "C" fn engram_gguf_options_init(o: *mut EngramGgufOptions) {
    if o.is_null() {
        return;
    }
    std::ptr::write(
        o,
        EngramGgufOptions {
            struct_size: std::mem::size_of::<EngramGgufOptions>(),
            backend: crate::EngramBackend::Cpu as u32,
            device: 0,
            eps: 1e-6,
            max_tokens: 4096,
            max_seqs: 64,
            max_positions: 131072,
            n_threads: 1,
            config_json: std::ptr::null(),
            tokenizer_json: std::ptr::null(),
            mmap_tables: 0,
        },
    );
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
/// # Safety
/// `path` must be NULL or a NUL-terminated path; `options` NULL or filled by
/// `engram_gguf_options_init`; `out` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn engram_create_from_gguf(
    path: *const c_char,
    options: *const EngramGgufOptions,
    out: *mut *mut EngramContext,
) -> EngramStatus {
    guard(|| {
        let p = path_arg(path, "path")?;
        check_struct_size(options, "options")?;
        non_null(out, "out")?;
        let o = &*options;
        if o.backend != crate::EngramBackend::Cpu as u32 {
            bail!(
                ErrUnsupported,
                "engram_create_from_gguf serves host tables to the CPU backend; backend {} is not supported here",
                o.backend
            );
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
            eps: o.eps,
            mmap_tables: o.mmap_tables != 0,
        };
        // SAFETY: the context borrows the mapping inside `model`, which the
        // EngramContext owns and drops after the context (field order).
        let m: &'static crate::gguf::GgufModel =
            &*(model.as_ref() as *const crate::gguf::GgufModel);
        let inner = m.context(&opts)?;
        *out = Box::into_raw(Box::new(EngramContext {
            inner,
            _owner: Some(model),
        }));
        Ok(())
    })
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
/// `ENGRAM_STATUS_ERR_IO`. Host tables only (CPU backend).
///
/// # Safety
/// `ctx` as in `engram_free`; `row_ids` must hold
/// `n_tokens * engram_row_ids_per_token(ctx)` elements.
#[no_mangle]
pub unsafe extern "C" fn engram_prefetch(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_ids: *const i64,
    n_tokens: u32,
) -> EngramStatus {
    guard(|| {
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let ids = slice(row_ids, n * c.ids_per_token(), "row_ids")?;
        c.prefetch(layer_id, ids, n)
    })
}
