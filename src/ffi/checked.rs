//! The checked forms of the step's calls: every buffer comes with its
//! length, and the highway with its type and token stride, so that a
//! mismatch is refused before anything is read or written. The unchecked
//! calls (`engram_apply`, `engram_apply_device_ids`, `engram_read_back`)
//! stay for engines that already use them.

use super::boundary::{read_options, slice, slice_mut, write_options, Options};
use super::context::{ctx, highway, EngramContext};
use crate::backend::{DeviceHashIn, RowIds};
use crate::batch::HighwayType;
use crate::context::Context;
use crate::error::{bail, EngramStatus, Result};
use std::ffi::c_void;

/// The arguments of `engram_apply_checked` and
/// `engram_apply_device_ids_checked`. Fill it with `engram_apply_args_init`,
/// which sets `struct_size` and zeroes the rest, then set every field: each
/// length is checked against what the call will read or write, and a
/// mismatch is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` naming the field, what
/// the call expected and what was given, before anything is touched. The
/// struct is read during the call only; its pointers are borrowed as the
/// unchecked calls borrow them.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramApplyArgs {
    /// `sizeof(engram_apply_args)` of the caller's header (set by `engram_apply_args_init`).
    pub struct_size: usize,
    /// The engram layer to apply (one of the config's `layer_ids`).
    pub layer_id: u32,
    /// Tokens in the step.
    pub n_tokens: u32,
    /// The step's row ids, `[n_tokens, n_layers, C]` int64 as `engram_hash`
    /// wrote them: host memory for `engram_apply_checked`, device memory for
    /// `engram_apply_device_ids_checked`.
    pub row_ids: *const i64,
    /// Elements `row_ids` holds: must equal
    /// `n_tokens * engram_row_ids_per_token(ctx)`.
    pub row_ids_len: usize,
    /// The highway, `[n_tokens, hc, D]` of `highway_type`, updated in place
    /// (memory of the context's backend, as for `engram_apply`).
    pub highway: *mut c_void,
    /// Bytes the highway buffer holds: must equal
    /// `n_tokens * highway_token_stride` (a larger buffer is refused too: it
    /// means a token count or a type other than the caller meant).
    pub highway_bytes: usize,
    /// Bytes from one token's `hc * D` values to the next token's: must equal
    /// `hc * D * sizeof(element)` (the highway is dense).
    pub highway_token_stride: usize,
    /// `ENGRAM_TYPE_F32` or `ENGRAM_TYPE_BF16` (any other type is
    /// `ENGRAM_STATUS_ERR_UNSUPPORTED`).
    pub highway_type: u32,
    /// The CUDA stream (ignored by the CPU backend), as for `engram_apply`.
    pub stream: *mut c_void,
}

impl Options for EngramApplyArgs {
    const INIT: &'static str = "engram_apply_args_init";
}

impl Default for EngramApplyArgs {
    fn default() -> Self {
        EngramApplyArgs {
            struct_size: size_of::<EngramApplyArgs>(),
            layer_id: 0,
            n_tokens: 0,
            row_ids: std::ptr::null(),
            row_ids_len: 0,
            highway: std::ptr::null_mut(),
            highway_bytes: 0,
            highway_token_stride: 0,
            highway_type: 0,
            stream: std::ptr::null_mut(),
        }
    }
}

/// The arguments of `engram_read_back_checked`. Fill it with
/// `engram_read_back_args_init`, then set every field; each length must
/// equal what the call reads or writes (else
/// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`, naming the field, expected and
/// given, and nothing is written). Read during the call only; every
/// pointer is host memory borrowed for the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramReadBackArgs {
    /// `sizeof(engram_read_back_args)` of the caller's header (set by `engram_read_back_args_init`).
    pub struct_size: usize,
    /// The engram layer to read back.
    pub layer_id: u32,
    /// Tokens.
    pub n_tokens: u32,
    /// Host row ids, `[n_tokens, n_layers, C]`.
    pub row_ids: *const i64,
    /// Elements `row_ids` holds: `n_tokens * engram_row_ids_per_token(ctx)`.
    pub row_ids_len: usize,
    /// Out: the gathered rows as bf16, `[n_tokens, C*Hd]`.
    pub rows: *mut u16,
    /// Elements `rows` holds: `n_tokens * C * Hd`.
    pub rows_len: usize,
    /// Out: the projection `kv` as bf16, `[n_tokens, D*(hc+1)]`.
    pub kv: *mut u16,
    /// Elements `kv` holds: `n_tokens * D * (hc + 1)`.
    pub kv_len: usize,
}

impl Options for EngramReadBackArgs {
    const INIT: &'static str = "engram_read_back_args_init";
}

impl Default for EngramReadBackArgs {
    fn default() -> Self {
        EngramReadBackArgs {
            struct_size: size_of::<EngramReadBackArgs>(),
            layer_id: 0,
            n_tokens: 0,
            row_ids: std::ptr::null(),
            row_ids_len: 0,
            rows: std::ptr::null_mut(),
            rows_len: 0,
            kv: std::ptr::null_mut(),
            kv_len: 0,
        }
    }
}

/// Refuse `given` unless it is `expected` (one field of a checked call).
fn expect(field: &str, given: usize, expected: usize, why: impl FnOnce() -> String) -> Result<()> {
    if given != expected {
        bail!(
            ErrInvalidArgument,
            "{field} is {given}, expected {expected} ({})",
            why()
        );
    }
    Ok(())
}

/// The row ids' length of a step of `n` tokens.
fn check_row_ids(c: &Context<'static>, field: &str, given: usize, n: usize) -> Result<()> {
    let per = c.ids_per_token();
    expect(field, given, n * per, || {
        format!("{n} tokens x {per} row ids per token")
    })
}

/// Every length of an apply's arguments against the context's geometry.
fn check_apply(c: &Context<'static>, a: &EngramApplyArgs) -> Result<HighwayType> {
    let n = a.n_tokens as usize;
    check_row_ids(c, "args.row_ids_len", a.row_ids_len, n)?;
    let ty = HighwayType::new(a.highway_type)?;
    let g = c.geometry();
    let name = if ty == HighwayType::F32 {
        "f32"
    } else {
        "bf16"
    };
    let stride = g.hc * g.d * ty.size();
    expect(
        "args.highway_token_stride",
        a.highway_token_stride,
        stride,
        || format!("hc {} x D {} {name} values, dense", g.hc, g.d),
    )?;
    expect("args.highway_bytes", a.highway_bytes, n * stride, || {
        format!("{n} tokens x [hc {}, D {}] {name}", g.hc, g.d)
    })?;
    Ok(ty)
}

/// Fill `args`' first `struct_size` bytes with the defaults (`struct_size`
/// set, everything else zero or NULL). NULL is ignored. Call it through the
/// header's `engram_apply_args_init(args)`, which passes `sizeof *args`.
#[no_mangle]
pub extern "C" fn engram_apply_args_init_sized(args: *mut EngramApplyArgs, struct_size: usize) {
    ffi_boundary!({ write_options(args, EngramApplyArgs::default(), struct_size) })
}

/// As `engram_apply_args_init_sized`, for `engram_read_back_args`; call it
/// through `engram_read_back_args_init(args)`.
#[no_mangle]
pub extern "C" fn engram_read_back_args_init_sized(
    args: *mut EngramReadBackArgs,
    struct_size: usize,
) {
    ffi_boundary!({ write_options(args, EngramReadBackArgs::default(), struct_size) })
}

/// `engram_apply` with every length checked: the checked form, for every
/// engine. `args` (see `engram_apply_args`) gives the layer, the host row
/// ids and their length, the highway with its type, its length in bytes and
/// its token stride, and the stream. A length that differs from what the
/// call reads or writes (row ids for another token count or model, a
/// highway that overflows or is shorter, a strided highway, a bf16 buffer
/// labelled f32 or the reverse) is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`
/// naming the field, the expected and the given value, and nothing is read
/// or written. Then it is `engram_apply` in every respect (checks, result,
/// streams, errors).
///
/// `ctx` as in `engram_free`; `args` read during the call only.
#[no_mangle]
pub extern "C" fn engram_apply_checked(
    ctx: *mut EngramContext,
    args: *const EngramApplyArgs,
) -> EngramStatus {
    ffi_boundary!({
        let a = read_options(args, EngramApplyArgs::default(), LAYOUT_APPLY, "args")?;
        let c = self::ctx(ctx)?;
        check_apply(&c, &a)?;
        let ids = slice(a.row_ids, a.row_ids_len, "args.row_ids")?;
        let hw = highway(a.highway, a.highway_type)?;
        c.apply_on(
            a.layer_id,
            RowIds::Host(ids),
            a.n_tokens as usize,
            hw,
            a.stream,
        )
    })
}

/// `engram_apply_device_ids` with every length checked, as
/// `engram_apply_checked` checks them: `args.row_ids` is device memory
/// (only its stated length can be checked here; its ids are checked on the
/// device as `engram_apply_device_ids` checks them). On a mismatch nothing is
/// queued. Then it is `engram_apply_device_ids` in every respect (capturable
/// in a CUDA graph; the CPU backend returns `ENGRAM_STATUS_ERR_UNSUPPORTED`).
///
/// `ctx` as in `engram_free`; `args` read during the call only.
#[no_mangle]
pub extern "C" fn engram_apply_device_ids_checked(
    ctx: *mut EngramContext,
    args: *const EngramApplyArgs,
) -> EngramStatus {
    ffi_boundary!({
        let a = read_options(args, EngramApplyArgs::default(), LAYOUT_APPLY, "args")?;
        let c = self::ctx(ctx)?;
        check_apply(&c, &a)?;
        let hw = highway(a.highway, a.highway_type)?;
        let ids = RowIds::Device(a.row_ids as u64);
        c.apply_on(a.layer_id, ids, a.n_tokens as usize, hw, a.stream)
    })
}

/// `engram_read_back` with every length checked: `args` (see
/// `engram_read_back_args`) gives the row ids with their length and the two
/// outputs with theirs; each must equal what the call reads or writes, else
/// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` naming the field, expected and
/// given, and nothing is written. Then it is `engram_read_back`.
///
/// `ctx` as in `engram_free`; `args` read during the call only.
#[no_mangle]
pub extern "C" fn engram_read_back_checked(
    ctx: *mut EngramContext,
    args: *const EngramReadBackArgs,
) -> EngramStatus {
    ffi_boundary!({
        let a = read_options(
            args,
            EngramReadBackArgs::default(),
            LAYOUT_READ_BACK,
            "args",
        )?;
        let c = self::ctx(ctx)?;
        let n = a.n_tokens as usize;
        check_row_ids(&c, "args.row_ids_len", a.row_ids_len, n)?;
        let (k_in, k_out) = (c.kv_in(), c.kv_out());
        expect("args.rows_len", a.rows_len, n * k_in, || {
            format!("{n} tokens x C*Hd {k_in}")
        })?;
        expect("args.kv_len", a.kv_len, n * k_out, || {
            format!("{n} tokens x D*(hc+1) {k_out}")
        })?;
        let ids = slice(a.row_ids, a.row_ids_len, "args.row_ids")?;
        let rows = slice_mut(a.rows, a.rows_len, "args.rows")?;
        let kv = slice_mut(a.kv, a.kv_len, "args.kv")?;
        let r = c.read_back(a.layer_id, RowIds::Host(ids), n)?;
        rows.copy_from_slice(&r.rows);
        kv.copy_from_slice(&r.kv);
        Ok(())
    })
}

/// `engram_hash_device` with its output's capacity, as `engram_hash` takes
/// one: `row_ids_cap` is the elements the device buffer `row_ids` holds; below
/// `n_tokens * engram_row_ids_per_token(ctx)` it is
/// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` naming expected and given, and
/// nothing is queued (checked before anything else, on every backend).
/// Then it is `engram_hash_device` in every respect.
///
/// `ctx` as in `engram_free`; the pointers device memory as for
/// `engram_hash_device`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn engram_hash_device_checked(
    ctx: *mut EngramContext,
    tokens: *const i32,
    seq_ids: *const i32,
    pos: *const i32,
    n_tokens: u32,
    row_ids: *mut i64,
    row_ids_cap: usize,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let n = n_tokens as usize;
        let need = n * c.ids_per_token();
        if row_ids_cap < need {
            bail!(
                ErrInvalidArgument,
                "row_ids_cap is {row_ids_cap}, expected at least {need} ({n} tokens x {} row ids per token)",
                c.ids_per_token()
            );
        }
        c.hash_device(&DeviceHashIn {
            tokens: tokens as u64,
            seq_ids: seq_ids as u64,
            pos: pos as u64,
            n,
            row_ids: row_ids as u64,
            stream,
        })
    })
}

/// The `engram_apply_args` and `engram_read_back_args` layouts this library
/// reads: only today's (both are new in 0.3).
const LAYOUT_APPLY: &[usize] = &[size_of::<EngramApplyArgs>()];
const LAYOUT_READ_BACK: &[usize] = &[size_of::<EngramReadBackArgs>()];
