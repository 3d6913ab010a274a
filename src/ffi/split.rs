//! The split points and shard contexts (docs/sharding.md): the calls that
//! take a layer apart where engines shard it, each giving the bits of
//! `engram_apply` once the engine's collectives have assembled the parts.

use super::boundary::{slice, slice_mut};
use super::context::{ctx, highway};
use crate::backend::DevValues;
use crate::batch::HighwayType;
use crate::context::{split_type, ShardSpec, SplitIn, SplitOut};
use crate::error::{EngramStatus, Result};
use std::ffi::c_void;

use super::context::EngramContext;

/// Values in of `ty` (`ENGRAM_TYPE_F32` or `ENGRAM_TYPE_BF16`), `len` of them.
fn values_in<'a>(p: *const c_void, len: usize, ty: u32, what: &str) -> Result<SplitIn<'a>> {
    Ok(match split_type(ty, what)? {
        HighwayType::F32 => SplitIn::F32(slice(p.cast::<f32>(), len, what)?),
        HighwayType::Bf16 => SplitIn::Bf16(slice(p.cast::<u16>(), len, what)?),
    })
}

/// Values out of `ty`, `len` of them.
fn values_out<'a>(p: *mut c_void, len: usize, ty: u32, what: &str) -> Result<SplitOut<'a>> {
    Ok(match split_type(ty, what)? {
        HighwayType::F32 => SplitOut::F32(slice_mut(p.cast::<f32>(), len, what)?),
        HighwayType::Bf16 => SplitOut::Bf16(slice_mut(p.cast::<u16>(), len, what)?),
    })
}

/// Values of `ty` in device memory at `p`, `len` of them (a CUDA context).
fn values_dev(p: *const c_void, len: usize, ty: u32, what: &str) -> Result<DevValues> {
    Ok(DevValues {
        ptr: p as u64,
        len,
        ty: split_type(ty, what)?,
    })
}

/// The highway's bytes against `n` tokens of its type.
fn check_highway(c: &crate::Context<'static>, n: usize, bytes: usize, ty: u32) -> Result<()> {
    let ty = HighwayType::new(ty)?;
    let g = c.geometry();
    let need = n * g.hc * g.d * ty.size();
    if bytes != need {
        crate::error::bail!(
            ErrInvalidArgument,
            "highway_bytes is {bytes}, expected {need} ({n} tokens x [hc {}, D {}] of {} bytes)",
            g.hc,
            g.d,
            ty.size()
        );
    }
    Ok(())
}

/// Make `ctx` a shard context: from now on it holds part `table_rank` of
/// `table_world` of every layer's table rows and part `wkv_rank` of
/// `wkv_world` of `wkv`'s outputs (`[r*T/w, (r+1)*T/w)` rounded down, so the
/// parts of ranks `0..w` tile the layer in order for every world size; a
/// block-scaled fp8 `wkv` is cut at whole scale blocks). Layers already set
/// are cut again from the arrays they were given, later ones as they are
/// set; the hash stays global. A rank reads only its part: with a table in
/// a file (mmap or `pread`) that is all the memory the table costs it.
/// `(0, 1, 0, 1)` is the whole layer. A world of 0 or a rank not below its
/// world is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`. A shard context refuses the whole-layer
/// calls (`engram_apply*`, `engram_read_back*`, `engram_prefetch`,
/// `engram_stage`) unless it holds the whole layer. On error nothing changes.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_context_set_shard(
    ctx: *mut EngramContext,
    table_rank: u32,
    table_world: u32,
    wkv_rank: u32,
    wkv_world: u32,
) -> EngramStatus {
    ffi_boundary!({
        let spec = ShardSpec::new((table_rank, table_world), (wkv_rank, wkv_world))?;
        self::ctx(ctx)?.set_shard(spec)
    })
}

/// What `ctx` holds of layer `layer_id`: table rows `[*row_begin, *row_end)`
/// and `wkv` outputs `[*out_begin, *out_end)` (the whole layer unless
/// `engram_context_set_shard` made it a shard). Each out pointer may be
/// NULL. A layer whose weights were never set is
/// `ENGRAM_STATUS_ERR_NO_WEIGHTS`; on error nothing is written.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_shard_held(
    ctx: *mut EngramContext,
    layer_id: u32,
    row_begin: *mut u64,
    row_end: *mut u64,
    out_begin: *mut u64,
    out_end: *mut u64,
) -> EngramStatus {
    ffi_boundary!({
        let info = self::ctx(ctx)?.layer_held(layer_id)?;
        let vals = [
            (row_begin, info.held_rows.0),
            (row_end, info.held_rows.1),
            (out_begin, info.held_outs.0 as u64),
            (out_end, info.held_outs.1 as u64),
        ];
        write_each(&vals)
    })
}

/// What `ctx` holds of layer `layer_id`, in bytes: `*table_bytes`, the
/// table rows it holds (`engram_shard_held`'s `[row_begin, row_end)`: their
/// codes and, for the split fp8 format, their scales) and `*wkv_bytes`, the
/// `wkv` outputs it holds (with a block fp8 `wkv`'s scales for them): a
/// rank's share of the layer. These bytes are read from wherever the
/// arrays are (the engine's memory, a mapped file, or a file with `pread`
/// row by row); what the context itself allocated is `engram_context_memory`.
/// Each out pointer may be NULL. A layer whose weights were never set is
/// `ENGRAM_STATUS_ERR_NO_WEIGHTS`; on error nothing is written.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_shard_bytes(
    ctx: *mut EngramContext,
    layer_id: u32,
    table_bytes: *mut u64,
    wkv_bytes: *mut u64,
) -> EngramStatus {
    ffi_boundary!({
        let info = self::ctx(ctx)?.layer_held(layer_id)?;
        write_each(&[
            (table_bytes, info.held_bytes.0),
            (wkv_bytes, info.held_bytes.1),
        ])
    })
}

/// Host memory `ctx` owns, in bytes: `*loaded_bytes`, what the loader
/// (`engram_create_from_gguf`, `engram_create_from_safetensors`) read or
/// converted into memory the context owns (with `mmap_tables = 0`: every
/// layer's `wkv` as the context holds it (a shard context's part only),
/// `q` and `k`; with `mmap_tables = 1` only weights converted at load; plus
/// the headers and the token map; 0 for `engram_create`), and
/// `*context_bytes`, the context's own structures (the hash tables, the
/// history and its scratch, the backend's host copies such as `q * k`).
/// Neither counts table rows, which stay in their file or the engine's
/// memory, nor a row cache (`engram_cache_stats_read`). Each out pointer may
/// be NULL.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_context_memory(
    ctx: *mut EngramContext,
    loaded_bytes: *mut u64,
    context_bytes: *mut u64,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let vals = [
            (loaded_bytes, c.loaded_bytes() as u64),
            (context_bytes, c.memory_bytes() as u64),
        ];
        write_each(&vals)
    })
}

/// Write each value to its pointer, skipping NULL ones.
fn write_each(vals: &[(*mut u64, u64)]) -> Result<()> {
    for &(p, v) in vals {
        if !p.is_null() {
            slice_mut(p, 1, "out")?[0] = v;
        }
    }
    Ok(())
}

/// The rows a shard owns: for the host `row_ids` of `n_tokens` tokens
/// (`[n_tokens, n_layers, C]`, `row_ids_len` elements, as `engram_hash`
/// wrote them), the rows of layer `layer_id` whose ids lie in `[row_begin,
/// row_end)`, for heads `[head_begin, head_end)`, dequantised, into `out`
/// (`[n_tokens, N-1, head_end - head_begin, Hd]`, n-gram size slowest,
/// `out_len` values of `out_type`: `ENGRAM_TYPE_F32` (bf16 values widened)
/// or `ENGRAM_TYPE_BF16`). Every other value, and every row of a dead token,
/// is written as -0.0: since `x + (-0) = x` for every `x`, the engine's
/// all-reduce (sum) of every rank's `out` over ranges that tile the table is
/// the whole rows bit for bit, in any order of summation. All heads and
/// `[0, rows)` give `engram_read_back`'s rows. `[row_begin, row_end)` must be
/// a non-empty range of the table, held by `ctx`
/// (`engram_context_set_shard`); `[head_begin, head_end)` a non-empty range
/// of the `H` heads. Bad ranges, lengths or ids are statuses
/// (`ENGRAM_STATUS_ERR_INVALID_ARGUMENT`, `_ERR_INVALID_ROW_ID`, as for
/// `engram_apply`); on error `out` is unchanged.
///
/// On the CPU backend `out` is host memory, written before the call returns,
/// and `stream` is ignored. On the CUDA backend `out` is device memory
/// (aligned to its values) and the work is queued on `stream` (a stream of
/// the context's device, or NULL), as `engram_apply` queues it: `row_ids`
/// stay host memory, checked on the host; the table must be in device
/// memory (else `ENGRAM_STATUS_ERR_UNSUPPORTED`); invalid row data found by
/// the kernel (an fp8 NaN) is reported as the kernels' errors are (by a
/// later call that runs the gate, or `engram_check` after one), naming the
/// output cell as its token. Not in a graph capture (host ids).
///
/// `ctx` as in `engram_free`; `row_ids` host memory for the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn engram_gather_rows(
    ctx: *mut EngramContext,
    layer_id: u32,
    n_tokens: u32,
    row_ids: *const i64,
    row_ids_len: usize,
    row_begin: u64,
    row_end: u64,
    head_begin: u32,
    head_end: u32,
    out: *mut c_void,
    out_len: usize,
    out_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let ids = slice(row_ids, row_ids_len, "row_ids")?;
        let (n, rows) = (n_tokens as usize, (row_begin, row_end));
        let heads = (head_begin as usize, head_end as usize);
        if c.splits_on_device() {
            let out = values_dev(out, out_len, out_type, "out")?;
            return c.gather_rows_device(layer_id, ids, n, rows, heads, out, stream);
        }
        let out = values_out(out, out_len, out_type, "out")?;
        c.gather_rows(layer_id, ids, n, rows, heads, out)
    })
}

/// `kv` outputs `[out_begin, out_end)` of layer `layer_id` (its `wkv` rows
/// in that range, which `ctx` must hold) for `n_tokens` tokens' assembled
/// rows (`rows`: `[n_tokens, C*Hd]`, `rows_len` values of `rows_type`, f32
/// values rounded to bf16 first: bf16 values pass unchanged), into `kv`
/// (`[n_tokens, out_end - out_begin]`, `kv_len` values of `kv_type`; bf16
/// values). Each output is the same sum in the same order as in
/// `engram_apply`, so the engine's all-gather of the ranks' `kv` (in rank
/// order) is `engram_read_back`'s `kv`. `rows` and `kv` are host memory on
/// the CPU backend (`stream` ignored), device memory on the CUDA backend
/// (the work queued on `stream`, summed as `engram_apply` on CUDA sums it;
/// an f32 `wkv` is `ENGRAM_STATUS_ERR_UNSUPPORTED` there), as for
/// `engram_gather_rows`.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn engram_kv_columns(
    ctx: *mut EngramContext,
    layer_id: u32,
    n_tokens: u32,
    rows: *const c_void,
    rows_len: usize,
    rows_type: u32,
    out_begin: u64,
    out_end: u64,
    kv: *mut c_void,
    kv_len: usize,
    kv_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let r = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let (n, outs) = (n_tokens as usize, (r(out_begin), r(out_end)));
        if c.splits_on_device() {
            let rows = values_dev(rows, rows_len, rows_type, "rows")?;
            let kv = values_dev(kv, kv_len, kv_type, "kv")?;
            return c.kv_columns_device(layer_id, n, rows, outs, kv, stream);
        }
        let rows = values_in(rows, rows_len, rows_type, "rows")?;
        let kv = values_out(kv, kv_len, kv_type, "kv")?;
        c.kv_columns(layer_id, n, rows, outs, kv)
    })
}

/// The gate and the highway update of layer `layer_id` from an assembled
/// `kv` (`[n_tokens, D*(hc+1)]`, `kv_len` values of `kv_type`, f32 values
/// rounded to bf16 first): `highway` (`[n_tokens, hc, D]` host memory of
/// `highway_type`, `highway_bytes` bytes) is updated in place as
/// `engram_apply` updates it; the host `row_ids` (`row_ids_len` elements)
/// say which tokens are dead (left untouched) and are checked as
/// `engram_apply` checks them. On error the highway is unchanged. On the
/// CPU backend `kv` and `highway` are host memory (`stream` ignored); on the
/// CUDA backend device memory (aligned to their values), the work queued on
/// `stream` as `engram_apply` queues it, `row_ids` host memory.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn engram_gate_from_kv(
    ctx: *mut EngramContext,
    layer_id: u32,
    n_tokens: u32,
    row_ids: *const i64,
    row_ids_len: usize,
    kv: *const c_void,
    kv_len: usize,
    kv_type: u32,
    highway: *mut c_void,
    highway_bytes: usize,
    highway_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        check_highway(&c, n, highway_bytes, highway_type)?;
        let ids = slice(row_ids, row_ids_len, "row_ids")?;
        if c.splits_on_device() {
            let kv = values_dev(kv, kv_len, kv_type, "kv")?;
            let hw = (highway as u64, HighwayType::new(highway_type)?);
            return c.gate_device(layer_id, ids, n, kv, false, hw, stream);
        }
        let kv = values_in(kv, kv_len, kv_type, "kv")?;
        let hw = self::highway(highway, highway_type)?;
        c.gate_from_kv(layer_id, ids, n, kv, hw)
    })
}

/// Projection, gate and highway update of layer `layer_id` from assembled
/// rows (`rows`: `[n_tokens, C*Hd]`, `rows_len` values of `rows_type`, as
/// the all-reduce of `engram_gather_rows` gives them): the highway as
/// `engram_gate_from_kv` takes it, the result `engram_apply`'s bit for bit.
/// Needs all of `wkv`'s outputs (a shard holding a part is
/// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`). Memory and `stream` as for
/// `engram_gate_from_kv`.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn engram_apply_rows(
    ctx: *mut EngramContext,
    layer_id: u32,
    n_tokens: u32,
    row_ids: *const i64,
    row_ids_len: usize,
    rows: *const c_void,
    rows_len: usize,
    rows_type: u32,
    highway: *mut c_void,
    highway_bytes: usize,
    highway_type: u32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        check_highway(&c, n, highway_bytes, highway_type)?;
        let ids = slice(row_ids, row_ids_len, "row_ids")?;
        if c.splits_on_device() {
            let rows = values_dev(rows, rows_len, rows_type, "rows")?;
            let hw = (highway as u64, HighwayType::new(highway_type)?);
            return c.gate_device(layer_id, ids, n, rows, true, hw, stream);
        }
        let rows = values_in(rows, rows_len, rows_type, "rows")?;
        let hw = self::highway(highway, highway_type)?;
        c.apply_rows(layer_id, ids, n, rows, hw)
    })
}
