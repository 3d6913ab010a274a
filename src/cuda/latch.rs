//! The error latch: how errors the kernels find reach the host.
//!
//! The gather kernel records the first error of a call in a small device
//! buffer (the latch: a code and where); the gate kernel of the same call
//! moves it to a host-mapped mirror (when the mirror is free) and clears the
//! latch. The host reads the mirror at the next call or at `engram_check` and
//! reports the error once, with the message the CPU backend gives for the
//! same input (see [`crate::batch`]).
//!
//! The codes are passed to the kernels as defines ([`LatchCode::defines`]),
//! so the two sides cannot drift apart.

use crate::batch::{invalid_row, partly_dead, row_out_of_range};
use crate::error::{Error, Result};
use crate::formats::RowDataError;
use crate::EngramStatus;

/// Words of the latch and of its mirror: `[code, token, column, where,
/// row low, row high, layer id, serial]`.
pub const LATCH_WORDS: usize = 8;

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
}

impl LatchCode {
    const ALL: [(LatchCode, &'static str); 5] = [
        (LatchCode::RowRange, "ENG_ERR_ROW_RANGE"),
        (LatchCode::PartlyDead, "ENG_ERR_PARTLY_DEAD"),
        (LatchCode::NanScale, "ENG_ERR_NAN_SCALE"),
        (LatchCode::NanCode, "ENG_ERR_NAN_CODE"),
        (LatchCode::NonFinite, "ENG_ERR_NON_FINITE"),
    ];

    /// `-D` options for NVRTC (and the host build of the kernels).
    pub fn defines() -> Vec<String> {
        let mut v: Vec<String> = Self::ALL
            .iter()
            .map(|&(c, name)| format!("-D{name}={}u", c as u32))
            .collect();
        v.push(format!("-DENG_LATCH_WORDS={LATCH_WORDS}u"));
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
    // once they land.
    let rec: [u32; LATCH_WORDS] =
        std::array::from_fn(|i| unsafe { std::ptr::read_volatile(mirror.add(i)) });
    if rec[0] == 0 {
        return Ok(());
    }
    // SAFETY: as above; clearing frees the mirror for the next error.
    unsafe { std::ptr::write_volatile(mirror, 0) };
    Err(error_of(
        &rec,
        rows,
        "(found on the device by an earlier engram_apply on this context; that token's streams were left untouched)",
    ))
}
