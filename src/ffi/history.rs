//! The history operations of an engine's KV cache (llama.cpp's
//! `llama_memory_seq_*`) and one sequence's saved state.

use super::boundary::{non_null, slice, slice_mut};
use super::context::{ctx, EngramContext};
use crate::call::DeviceSeqOp;
use crate::error::EngramStatus;
use std::ffi::c_void;

/// Forget the positions `[p0, p1)` of sequence `seq`, as
/// `llama_memory_seq_rm` removes them from the KV cache (a rejected draft, an
/// edited prompt): a later token whose look-back reaches one of them is
/// `ENGRAM_STATUS_ERR_MISSING_HISTORY` until it is hashed again. `seq = -1`:
/// every sequence. `p0 < 0` is 0, `p1 < 0` is the end. A sequence outside
/// `[0, max_seqs)` (other than -1), a range outside `[0, max_positions]` or
/// one with `p0 > p1` is `ENGRAM_STATUS_ERR_INVALID_SEQUENCE`, and nothing
/// changes. Serialised with `engram_hash` and the other `engram_seq_*` calls.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_seq_rm(
    ctx: *mut EngramContext,
    seq: i32,
    p0: i32,
    p1: i32,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_rm(seq, p0, p1) })
}

/// Copy sequence `src`'s positions `[p0, p1)` over `dst`'s, as
/// `llama_memory_seq_cp` (a shared prompt, a forked draft): afterwards `dst`
/// holds exactly what `src` holds in that range (a position `src` never
/// hashed is forgotten in `dst`); `dst`'s other positions stay. `p0 < 0` is 0,
/// `p1 < 0` the end; `src == dst` changes nothing. Checked as
/// `engram_seq_rm` (no -1 here); out of memory is
/// `ENGRAM_STATUS_ERR_CAPACITY`; on error nothing changes. The whole-sequence
/// `engram_seq_copy` is this call with `p0 = p1 = -1`.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_seq_cp(
    ctx: *mut EngramContext,
    src: i32,
    dst: i32,
    p0: i32,
    p1: i32,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_cp(src, dst, p0, p1) })
}

/// Forget every sequence but `seq`, as `llama_memory_seq_keep`. A sequence
/// outside `[0, max_seqs)` is `ENGRAM_STATUS_ERR_INVALID_SEQUENCE` (nothing
/// changes).
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_seq_keep(ctx: *mut EngramContext, seq: i32) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_keep(seq) })
}

/// Move sequence `seq`'s positions in `[p0, p1)` by `delta`, as
/// `llama_memory_seq_add` (the context shift: remove `[n_keep, n_keep + n)`
/// with `engram_seq_rm`, then move `[n_keep + n, -1)` by `-n`). The range
/// moves as a block: a position that lands below 0 is forgotten; a hashed
/// position that lands on a position outside the range replaces what that
/// position held (the moved token wins); positions of the range nothing
/// lands on are forgotten; positions outside the range nothing lands on
/// keep theirs. A hashed position that would land at `max_positions` or
/// beyond is `ENGRAM_STATUS_ERR_INVALID_SEQUENCE` and nothing moves. `p0 < 0`
/// is 0, `p1 < 0` the end; `delta = 0` or an empty range changes nothing.
/// Checked as `engram_seq_rm` (no -1 here); out of memory is
/// `ENGRAM_STATUS_ERR_CAPACITY`; on error nothing changes.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_seq_add(
    ctx: *mut EngramContext,
    seq: i32,
    p0: i32,
    p1: i32,
    delta: i32,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_add(seq, p0, p1, delta) })
}

/// `llama_memory_seq_div` (self-extend) has no meaning for an n-gram history
/// and is refused: `d > 1` is `ENGRAM_STATUS_ERR_UNSUPPORTED`. Dividing
/// positions puts `d` tokens on each position, while the history holds one
/// token per position and a later token's n-gram is over the tokens that
/// precede it in the text. An engine using self-extend keeps passing
/// `engram_hash` each token's undivided position (its index in the
/// sequence), which needs no division. `d = 1` changes nothing
/// (`ENGRAM_STATUS_OK`); `d < 1` is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`;
/// `seq` and the range are checked first, as `engram_seq_add`. Nothing ever
/// changes.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
pub extern "C" fn engram_seq_div(
    ctx: *mut EngramContext,
    seq: i32,
    p0: i32,
    p1: i32,
    d: i32,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_div(seq, p0, p1, d) })
}

/// The pointer handling of the state calls, host and device: `*size` (or
/// `*written` and `buf`) written only after `f` succeeds.
fn put_size(
    size: *mut usize,
    f: impl FnOnce() -> crate::error::Result<usize>,
) -> crate::error::Result<()> {
    non_null(size, "size")?;
    let n = f()?;
    slice_mut(size, 1, "size")?[0] = n;
    Ok(())
}

fn write_state(
    buf: *mut c_void,
    cap: usize,
    written: *mut usize,
    f: impl FnOnce(&mut [u8]) -> crate::error::Result<usize>,
) -> crate::error::Result<()> {
    non_null(buf, "buf")?;
    non_null(written, "written")?;
    let w = slice_mut(written, 1, "written")?;
    let out = slice_mut(buf.cast::<u8>(), cap, "buf")?;
    w[0] = f(out)?;
    Ok(())
}

fn read_state(
    buf: *const c_void,
    len: usize,
    f: impl FnOnce(&[u8]) -> crate::error::Result<()>,
) -> crate::error::Result<()> {
    non_null(buf, "buf")?;
    f(slice(buf.cast::<u8>(), len, "buf")?)
}

/// Bytes `engram_seq_state_write` writes for sequence `seq` now, into
/// `*size` (left as it was on error).
///
/// `ctx` as in `engram_free`; `size` writable or NULL.
#[no_mangle]
pub extern "C" fn engram_seq_state_size(
    ctx: *mut EngramContext,
    seq: i32,
    size: *mut usize,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        put_size(size, || c.seq_state_size(seq))
    })
}

/// Save sequence `seq`'s history into `buf` (`cap` bytes) and the bytes
/// written into `*written`: a prompt cache keeps it and restores it later,
/// into any sequence of a context of the same model, with
/// `engram_seq_state_read`. The format is versioned and checks itself (see
/// docs/history.md): a magic, a version, the fingerprint of the context's
/// hash tables, the lengths, the positions hashed and a checksum. A `cap`
/// below `engram_seq_state_size` is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT` and
/// nothing is written. Serialised with `engram_hash`.
///
/// `ctx` as in `engram_free`; `buf` must hold `cap` bytes; `written`
/// writable or NULL.
#[no_mangle]
pub extern "C" fn engram_seq_state_write(
    ctx: *mut EngramContext,
    seq: i32,
    buf: *mut c_void,
    cap: usize,
    written: *mut usize,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        write_state(buf, cap, written, |out| c.seq_state_write(seq, out))
    })
}

/// Replace sequence `seq`'s history with a state `engram_seq_state_write`
/// saved (`len` bytes at `buf`), from any sequence of a context of the same
/// model. A truncated, corrupted or foreign buffer (another model's: its hash
/// tables' fingerprint differs) is `ENGRAM_STATUS_ERR_FORMAT`, and so is a
/// state holding a position outside `[0, max_positions)` or an id no token
/// maps to. A state whose positions are so sparse that its history pages
/// would take more than 16 times its size plus 64 KiB is
/// `ENGRAM_STATUS_ERR_CAPACITY` (docs/history.md). Everything is checked
/// before `seq` changes (and before any page is allocated), and on error
/// nothing changes. Serialised with `engram_hash`.
///
/// `ctx` as in `engram_free`; `buf` must hold `len` bytes.
#[no_mangle]
pub extern "C" fn engram_seq_state_read(
    ctx: *mut EngramContext,
    seq: i32,
    buf: *const c_void,
    len: usize,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        read_state(buf, len, |b| c.seq_state_read(seq, b))
    })
}

// The same operations on a device history (a context created with
// `device_history > 0`, CUDA backend; any other context is
// `ENGRAM_STATUS_ERR_UNSUPPORTED`): see docs/device-hash.md.

/// `engram_seq_rm` on the device history, queued on `stream` (capturable):
/// the entries of positions `[p0, p1)` of `seq` (`-1`: every sequence) are
/// emptied. The sequence and the range are checked here as `engram_seq_rm`
/// checks them (`ENGRAM_STATUS_ERR_INVALID_SEQUENCE`, nothing queued).
///
/// `ctx` as in `engram_free`; `stream` a stream of the context's device or
/// NULL.
#[no_mangle]
pub extern "C" fn engram_seq_rm_device(
    ctx: *mut EngramContext,
    seq: i32,
    p0: i32,
    p1: i32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_op_device(DeviceSeqOp::Rm { seq, p0, p1 }, stream) })
}

/// `engram_seq_cp` on the device history, queued on `stream` (capturable):
/// `dst`'s positions in `[p0, p1)` become exactly `src`'s. Checked here as
/// `engram_seq_cp`. The whole-sequence `engram_seq_copy_device` is this
/// call with `p0 = p1 = -1`.
///
/// `ctx` as in `engram_free`; `stream` as in `engram_seq_rm_device`.
#[no_mangle]
pub extern "C" fn engram_seq_cp_device(
    ctx: *mut EngramContext,
    src: i32,
    dst: i32,
    p0: i32,
    p1: i32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_op_device(DeviceSeqOp::Cp { src, dst, p0, p1 }, stream) })
}

/// `engram_seq_keep` on the device history, queued on `stream`
/// (capturable): every sequence but `seq` is emptied.
///
/// `ctx` as in `engram_free`; `stream` as in `engram_seq_rm_device`.
#[no_mangle]
pub extern "C" fn engram_seq_keep_device(
    ctx: *mut EngramContext,
    seq: i32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_op_device(DeviceSeqOp::Keep { seq }, stream) })
}

/// `engram_seq_add` on the device history, queued on `stream` (capturable):
/// `seq`'s entries in `[p0, p1)` move by `delta`, with `engram_seq_add`'s
/// rules; where a moved entry and a kept one share a ring entry, the moved
/// one wins and a later look-back to the other is
/// `ENGRAM_STATUS_ERR_MISSING_HISTORY`. The arguments are checked here as
/// `engram_seq_add` checks them. A hashed position that would land at
/// `max_positions` or beyond is found on the device: nothing moves, and
/// `ENGRAM_STATUS_ERR_INVALID_SEQUENCE` is reported by the next call that
/// reports device errors (`engram_hash_device`, `engram_apply*`,
/// `engram_check`).
///
/// `ctx` as in `engram_free`; `stream` as in `engram_seq_rm_device`.
#[no_mangle]
pub extern "C" fn engram_seq_add_device(
    ctx: *mut EngramContext,
    seq: i32,
    p0: i32,
    p1: i32,
    delta: i32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        self::ctx(ctx)?.seq_op_device(DeviceSeqOp::Add { seq, p0, p1, delta }, stream)
    })
}

/// `engram_seq_state_size` for a device history: waits for the work queued
/// on `stream`, then reads sequence `seq`'s ring. Not capturable (a stream
/// being captured is `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`).
///
/// `ctx` as in `engram_free`; `size` writable or NULL; `stream` as in
/// `engram_seq_rm_device`.
#[no_mangle]
pub extern "C" fn engram_seq_state_size_device(
    ctx: *mut EngramContext,
    seq: i32,
    size: *mut usize,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        put_size(size, || c.seq_state_size_device(seq, stream))
    })
}

/// `engram_seq_state_write` for a device history, in the same format: the
/// state restores into a host or a device history of the same model.
/// Waits for the work queued on `stream`, then reads the ring (not
/// capturable, as `engram_seq_state_size_device`).
///
/// `ctx` as in `engram_free`; `buf` must hold `cap` bytes; `written`
/// writable or NULL; `stream` as in `engram_seq_rm_device`.
#[no_mangle]
pub extern "C" fn engram_seq_state_write_device(
    ctx: *mut EngramContext,
    seq: i32,
    buf: *mut c_void,
    cap: usize,
    written: *mut usize,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        write_state(buf, cap, written, |out| {
            c.seq_state_write_device(seq, out, stream)
        })
    })
}

/// `engram_seq_state_read` into a device history: the state (saved from a
/// host or a device history of the same model) is checked in full as
/// `engram_seq_state_read` checks it, then, once the work queued on
/// `stream` has run, replaces sequence `seq`'s ring. Where the state holds
/// more positions than the ring, the ring keeps what hashing them in order
/// would leave (the latest of each entry). Not capturable, as
/// `engram_seq_state_size_device`; on error nothing changes.
///
/// `ctx` as in `engram_free`; `buf` must hold `len` bytes; `stream` as in
/// `engram_seq_rm_device`.
#[no_mangle]
pub extern "C" fn engram_seq_state_read_device(
    ctx: *mut EngramContext,
    seq: i32,
    buf: *const c_void,
    len: usize,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        read_state(buf, len, |b| c.seq_state_read_device(seq, b, stream))
    })
}

// Second names of `engram_seq_cp` / `engram_seq_rm` over a whole sequence,
// kept working for engines that call them; the header marks them
// `ENGRAM_DEPRECATED`.

/// Deprecated: use `engram_seq_cp(ctx, src, dst, -1, -1)`, which does the
/// same. Makes sequence `dst`'s history an exact copy of `src`'s (fork,
/// shared prefix).
///
/// `ctx` as in `engram_free`.
#[no_mangle]
#[deprecated(note = "use engram_seq_cp with p0 = p1 = -1")]
pub extern "C" fn engram_seq_copy(ctx: *mut EngramContext, src: i32, dst: i32) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_copy(src, dst) })
}

/// Deprecated: use `engram_seq_rm(ctx, seq, -1, -1)`, which does the same.
/// Forgets every position of sequence `seq`.
///
/// `ctx` as in `engram_free`.
#[no_mangle]
#[deprecated(note = "use engram_seq_rm with p0 = p1 = -1")]
pub extern "C" fn engram_seq_drop(ctx: *mut EngramContext, seq: i32) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_drop(seq) })
}

/// Deprecated: use `engram_seq_cp_device(ctx, src, dst, -1, -1, stream)`,
/// which does the same. Makes sequence `dst`'s device history a copy of
/// `src`'s (a fork or a shared prefix), queued on `stream` (capturable). A
/// context with a device history only (else
/// `ENGRAM_STATUS_ERR_UNSUPPORTED`); the ids are checked here.
///
/// `ctx` as in `engram_free`; `stream` as in `engram_seq_rm_device`.
#[no_mangle]
#[deprecated(note = "use engram_seq_cp_device with p0 = p1 = -1")]
pub extern "C" fn engram_seq_copy_device(
    ctx: *mut EngramContext,
    src: i32,
    dst: i32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_copy_device(src, dst, stream) })
}

/// Deprecated: use `engram_seq_rm_device(ctx, seq, -1, -1, stream)`, which
/// does the same. Forgets every position of sequence `seq`'s device history,
/// queued on `stream` (capturable). As `engram_seq_copy_device`.
///
/// `ctx` as in `engram_free`; `stream` as in `engram_seq_rm_device`.
#[no_mangle]
#[deprecated(note = "use engram_seq_rm_device with p0 = p1 = -1")]
pub extern "C" fn engram_seq_drop_device(
    ctx: *mut EngramContext,
    seq: i32,
    stream: *mut c_void,
) -> EngramStatus {
    ffi_boundary!({ self::ctx(ctx)?.seq_drop_device(seq, stream) })
}
