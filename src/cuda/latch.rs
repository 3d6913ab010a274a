//! The error latch: how errors the kernels find reach the host.
//!
//! The gather kernel records the first error of a call in a small device
//! buffer (the latch: a code and where); the gate kernel of the same call
//! moves it to a host-mapped mirror (when the mirror is free) and clears the
//! latch. The host reads the mirror at the next call or at `engram_check` and
//! reports the error once, with the message the CPU backend gives for the
//! same input (see [`crate::batch`]). A read-back (no gate) reads and clears
//! the latch itself.
//!
//! "First" is the CPU backend's order, whatever order the blocks ran in:
//! row-id errors (partly dead, out of range, not staged) before row-data
//! errors, then by token, then by column. The latch keeps an order key that
//! every erroring block lowers atomically; the details are written under a
//! lock by a block whose key is still the latch's (see `kernels/latch.cuh`).
//!
//! While the mirror holds an error the host has not reported, the errors of
//! later calls are dropped: what is reported is the first error since the
//! last report.
//!
//! The codes are passed to the kernels as defines ([`LatchCode::defines`]),
//! so the two sides cannot drift apart.

use crate::batch::{invalid_row, partly_dead, row_out_of_range};
use crate::error::{Error, Result};
use crate::formats::RowDataError;
use crate::EngramStatus;

/// Words of the latch and of its mirror: `[code, token, column, where,
/// row low, row high, layer id, serial, order key low, order key high, lock,
/// unused]` (the mirror gets the first eight).
pub const LATCH_WORDS: usize = 12;
/// Where the order key (u64, 8-byte aligned) and the lock are.
pub const LATCH_KEY: usize = 8;
pub const LATCH_LOCK: usize = 10;

/// The error codes the kernels write.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LatchCode {
    /// A row id outside `[0, rows)` (or negative, not -1).
    RowRange = 1,
    /// Some columns -1, others not.
    PartlyDead = 2,
    /// An e8m0 scale code 255.
    NanScale = 3,
    /// An e4m3 NaN code.
    NanCode = 4,
    /// A value that is not finite once dequantised.
    NonFinite = 5,
    /// A host table's row was not staged for that position (a replayed
    /// graph without `engram_stage` of its step).
    NotStaged = 6,
    /// The device hash (`kernels/hash.cu`): a sequence id outside
    /// `[0, max_seqs)`.
    HashSeq = 7,
    /// The device hash: a position outside `[0, max_positions)`.
    HashPos = 8,
    /// The device hash: a token id outside the token map.
    HashToken = 9,
    /// The device hash: a sequence in two runs of one call.
    HashRuns = 10,
    /// The device hash: a look-back the device history cannot answer.
    HashMissing = 11,
    /// `engram_seq_add_device`: a position that would move to
    /// `max_positions` or beyond (nothing moved).
    HashShift = 12,
}

impl LatchCode {
    const ALL: [(LatchCode, &'static str); 12] = [
        (LatchCode::RowRange, "ENG_ERR_ROW_RANGE"),
        (LatchCode::PartlyDead, "ENG_ERR_PARTLY_DEAD"),
        (LatchCode::NanScale, "ENG_ERR_NAN_SCALE"),
        (LatchCode::NanCode, "ENG_ERR_NAN_CODE"),
        (LatchCode::NonFinite, "ENG_ERR_NON_FINITE"),
        (LatchCode::NotStaged, "ENG_ERR_NOT_STAGED"),
        (LatchCode::HashSeq, "ENG_ERR_HASH_SEQ"),
        (LatchCode::HashPos, "ENG_ERR_HASH_POS"),
        (LatchCode::HashToken, "ENG_ERR_HASH_TOKEN"),
        (LatchCode::HashRuns, "ENG_ERR_HASH_RUNS"),
        (LatchCode::HashMissing, "ENG_ERR_HASH_MISSING"),
        (LatchCode::HashShift, "ENG_ERR_HASH_SHIFT"),
    ];

    /// Whether `code` is one the device hash records.
    pub fn is_hash(code: u32) -> bool {
        (LatchCode::HashSeq as u32..=LatchCode::HashShift as u32).contains(&code)
    }

    /// `-D` options for NVRTC (and the host build of the kernels).
    pub fn defines() -> Vec<String> {
        let mut v: Vec<String> = Self::ALL
            .iter()
            .map(|&(c, name)| format!("-D{name}={}u", c as u32))
            .collect();
        v.push(format!("-DENG_LATCH_WORDS={LATCH_WORDS}u"));
        v.push(format!("-DENG_LATCH_KEY={LATCH_KEY}u"));
        v.push(format!("-DENG_LATCH_LOCK={LATCH_LOCK}u"));
        v
    }
}

/// The error a latch record describes, with `tail` (when the error is
/// reported) after the message the CPU backend gives. `rows(layer_id)` gives
/// the table rows of a layer (for the message).
pub fn error_of(rec: &[u32; LATCH_WORDS], rows: impl Fn(u32) -> u64, tail: &str) -> Error {
    let (t, c, at) = (rec[1] as usize, rec[2] as usize, rec[3] as usize);
    let row = (rec[4] as u64 | ((rec[5] as u64) << 32)) as i64;
    let layer = rec[6];
    let e = match rec[0] {
        x if x == LatchCode::RowRange as u32 => row_out_of_range(t, layer, c, row, rows(layer)),
        x if x == LatchCode::PartlyDead as u32 => partly_dead(t, layer, c),
        x if x == LatchCode::NanScale as u32 => {
            invalid_row(layer, row, t, c, &RowDataError::NanScale(at).describe())
        }
        x if x == LatchCode::NanCode as u32 => {
            invalid_row(layer, row, t, c, &RowDataError::NanCode(at).describe())
        }
        x if x == LatchCode::NonFinite as u32 => {
            invalid_row(layer, row, t, c, &RowDataError::NonFinite(at).describe())
        }
        x if x == LatchCode::NotStaged as u32 => Error::new(
            EngramStatus::ErrInvalidArgument,
            format!(
                "token {t}, layer {layer}, column {c}: row {row} of the host table was not staged for \
                 this position; stage each step's rows with engram_stage before a call (or a graph \
                 replay) that reads device row ids"
            ),
        ),
        // The device hash's (kernels/hash.cu): word 2 a limit (or the
        // position), words 4-5 the value, word 6 a sequence id; the messages
        // are the host hash's.
        x if x == LatchCode::HashSeq as u32 => Error::new(
            EngramStatus::ErrInvalidSequence,
            format!("token {t}: sequence id {row} outside [0, max_seqs = {c})"),
        ),
        x if x == LatchCode::HashPos as u32 => Error::new(
            EngramStatus::ErrInvalidSequence,
            format!("token {t}: position {row} outside [0, max_positions = {c})"),
        ),
        x if x == LatchCode::HashToken as u32 => Error::new(
            EngramStatus::ErrInvalidToken,
            format!(
                "token {t}: id {row} is outside token_map [0, {c}) (use {} to mark a dead position)",
                crate::hash::TOKEN_DEAD
            ),
        ),
        x if x == LatchCode::HashRuns as u32 => Error::new(
            EngramStatus::ErrInvalidSequence,
            format!(
                "token {t}: sequence {row} is not one run of consecutive positions in this batch \
                 (the device hash takes each sequence's tokens as consecutive entries at consecutive \
                 positions)"
            ),
        ),
        x if x == LatchCode::HashMissing as u32 => Error::new(
            EngramStatus::ErrMissingHistory,
            format!(
                "token {t}: sequence {layer} position {c} looks back to position {row}, which the \
                 device history does not hold (never hashed, evicted from the ring, or a token of \
                 this call with an error)"
            ),
        ),
        // Word 3 the position, 4-5 the delta, 6 the sequence, 2 the limit.
        x if x == LatchCode::HashShift as u32 => Error::new(
            EngramStatus::ErrInvalidSequence,
            format!(
                "sequence {layer}: position {at} moved by {row} lands outside [0, max_positions = {c})"
            ),
        ),
        x => Error::new(
            EngramStatus::ErrInternal,
            format!("unknown device error code {x}"),
        ),
    };
    if tail.is_empty() {
        e
    } else {
        Error::new(e.status, format!("{} {tail}", e.message))
    }
}

/// Report (and clear) an error the device recorded in the host-mapped
/// `mirror` (`LATCH_WORDS` u32 of pinned memory the gate kernel writes).
///
/// # Safety
/// `mirror` must point to `LATCH_WORDS` u32 of live pinned memory.
pub unsafe fn take(mirror: *mut u32, rows: impl Fn(u32) -> u64) -> Result<()> {
    // SAFETY: the caller's contract; volatile reads see the device's writes
    // once they land. The device writes the code last (after a system-wide
    // fence), so the details read after it are complete.
    let code = unsafe { std::ptr::read_volatile(mirror) };
    if code == 0 {
        return Ok(());
    }
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    // SAFETY: `take`'s contract: `mirror` holds `LATCH_WORDS` live u32, and the
    // reads below stay in it (word i < LATCH_WORDS).
    let rec: [u32; LATCH_WORDS] = std::array::from_fn(|i| {
        if i == 0 {
            code
        } else {
            // SAFETY: as above: word i < LATCH_WORDS of the mirror.
            unsafe { std::ptr::read_volatile(mirror.add(i)) }
        }
    });
    // SAFETY: as above; clearing frees the mirror for the next error.
    unsafe { std::ptr::write_volatile(mirror, 0) };
    let tail = if code == LatchCode::HashShift as u32 {
        "(found on the device by an earlier engram_seq_add_device on this context; nothing moved)"
    } else if LatchCode::is_hash(code) {
        "(found on the device by an earlier engram_hash_device on this context; that token's row ids \
         were written dead and it was not recorded)"
    } else {
        "(found on the device by an earlier engram_apply on this context; that token's streams were left untouched)"
    };
    Err(error_of(&rec, rows, tail))
}
