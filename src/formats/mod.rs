//! Table-row and weight formats, and their dequantisation on the CPU.
//!
//! This module is the bit-exact reference that every backend is compared with.
//! Rows are always dequantised to bf16 (SPEC section 1, step 4); bf16 values are
//! handled as their `u16` bit patterns.
//!
//! - [`EngramType`]: the one list of formats, numbered as the C ABI numbers them
//!   (`ggml_type` where ggml has the format), with the one table of block sizes
//!   ([`GGML_BLOCKS`]) that the GGUF reader and the CUDA kernels also use.
//! - [`fp8`]: the released checkpoint's e4m3 codes with e8m0 scales.
//! - [`ggml`]: ggml's block formats (`Q8_0`, `Q4_0`, `Q2_K` ... `Q6_K`), one
//!   home each: the typed block ([`BlockQ4K`] ...), its sizes ([`GgmlBlock`])
//!   and field offsets, which every CPU path and the CUDA kernels' defines
//!   take; they dequantise first to ggml's f32 values, then to bf16 by round-to-nearest-even.
//!   Those f32 values do not depend on operation order or FMA contraction: every
//!   product is exact in f32 (an f16 `d` has 11 significant bits, the scale at
//!   most 7 and the quant at most 5), so only the final `- dmin * m` of
//!   `Q2_K`/`Q4_K`/`Q5_K` rounds, once. A GPU kernel reproduces them with plain f32
//!   arithmetic.
//! - [`weights`]: how `wkv`, `q` and `k` are held (dense or quantised rows).
//!
//! A row that dequantises to a value that is not finite is invalid data
//! ([`RowDataError`]), like an fp8 NaN code: an e8m0 scale so large that the
//! row overflows, a NaN or infinite f16 scale in a GGUF block, a NaN or
//! infinity stored in an f16, bf16 or f32 row. No backend turns such a row
//! into numbers: the token is refused (its streams untouched) and the call
//! reports `ENGRAM_STATUS_ERR_INVALID_DATA` naming the row and element. Rows
//! are checked in element order, so both backends name the same element.
//! (This is also why the backends agree on every bit they produce: GPU and
//! CPU differ only in the payloads of NaNs, and no NaN gets out.)

pub mod fp8;
pub mod fp8_block;
pub mod ggml;
pub mod weights;

pub use fp8::{e4m3_to_f32, e8m0_to_f32, FP8_SCALE_BLOCK};
pub use fp8_block::Fp8Blocks;
pub use ggml::{
    dequant_block_f32, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0,
    GgmlBlock,
};
pub use weights::{WeightDtype, WeightFormat, Weights};

use crate::error::{bail, Result};

/// Element, row and weight formats. The numbers equal `ggml_type` where ggml
/// has the format, so a GGUF tensor's type can be passed through unchanged;
/// the fp8 checkpoint format, which ggml lacks, has its own number.
///
/// As a row format, the GGUF block formats (`Q8_0` ... `Q6_K`) store a row as
/// whole ggml blocks laid out exactly as ggml's `block_*` structs
/// (little-endian, no padding), so a row of `Hd` values is `Hd / block_len`
/// consecutive blocks; they dequantise to the f32 values ggml's
/// `dequantize_row_*` gives, bit for bit.
#[repr(u32)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngramType {
    F32 = 0,
    F16 = 1,
    /// `Q4_0` (ggml's `block_q4_0`): f16 `d`, 16 bytes of nibbles (low nibbles are values
    /// 0..15, high nibbles 16..31); `x = (q - 8) * d`. 18 bytes per 32 values.
    Q4_0 = 2,
    /// `Q8_0` (ggml's `block_q8_0`): f16 `d`, 32 i8 `qs`; `x = qs * d`. 34 bytes per 32 values.
    Q8_0 = 8,
    /// `Q2_K` (ggml's `block_q2_K`): `scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`. 84 bytes per 256.
    Q2_K = 10,
    /// `Q3_K` (ggml's `block_q3_K`): `hmask[32]`, `qs[64]`, `scales[12]`, f16 `d`. 110 bytes per 256.
    Q3_K = 11,
    /// `Q4_K` (ggml's `block_q4_K`): f16 `d`, f16 `dmin`, `scales[12]`, `qs[128]`. 144 bytes per 256.
    Q4_K = 12,
    /// `Q5_K` (ggml's `block_q5_K`): f16 `d`, f16 `dmin`, `scales[12]`, `qh[32]`, `qs[128]`. 176 bytes per 256.
    Q5_K = 13,
    /// `Q6_K` (ggml's `block_q6_K`): `ql[128]`, `qh[64]`, i8 `scales[16]`, f16 `d`. 210 bytes per 256.
    Q6_K = 14,
    Bf16 = 30,
    /// DeepSeek's released checkpoint: per row, `Hd` fp8 e4m3 codes followed by
    /// `Hd / 32` e8m0 scale codes (one per 32 values); 264 bytes for `Hd = 256`.
    Fp8E4m3E8m0 = 1000,
    /// The same values with codes and scales in two arrays, as the released
    /// checkpoint stores them (`embed.weight` `[rows, Hd]` e4m3 and
    /// `embed.scale` `[rows, Hd/32]` e8m0): the table holds `Hd` code bytes
    /// per row, `table_scales` `Hd / 32` scale bytes per row. Dequantises bit
    /// for bit as the packed format (`ENGRAM_TYPE_FP8_E4M3_E8M0`).
    Fp8E4m3E8m0Split = 1001,
    /// A weight format (`wkv` only, not a table format): the released
    /// checkpoint's `wkv.weight` as it is stored, `[rows, K]` e4m3 codes
    /// row-major (one byte a value), with one e8m0 scale per block of
    /// `block_rows x block_cols` values in a second array
    /// (`[ceil(rows / block_rows), ceil(K / block_cols)]` row-major, the
    /// checkpoint's `wkv.scale`). Value `(o, i)` is
    /// `e4m3(code) * 2^(scale - 127)`, exact in f32 and bf16.
    Fp8E4m3E8m0Block = 1002,
}

/// `(ggml_type, name, values per block, bytes per block)` of every ggml type
/// (ggml's type traits; removed type numbers are absent). The one table of
/// block sizes: [`EngramType::block`], the GGUF reader's tensor sizes and the
/// CUDA kernels' row sizes (passed to NVRTC as defines) all read it. The
/// formats engram reads take their entries from their typed blocks
/// ([`GgmlBlock`]); the names are ggml's type names (`ggml_type_name`).
pub const GGML_BLOCKS: [(u32, &str, usize, usize); 32] = [
    (0, "f32", 1, 4),
    (1, "f16", 1, 2),
    (2, "q4_0", BlockQ4_0::VALUES, BlockQ4_0::BYTES),
    (3, "q4_1", 32, 20),
    (6, "q5_0", 32, 22),
    (7, "q5_1", 32, 24),
    (8, "q8_0", BlockQ8_0::VALUES, BlockQ8_0::BYTES),
    (9, "q8_1", 32, 36),
    (10, "q2_K", BlockQ2K::VALUES, BlockQ2K::BYTES),
    (11, "q3_K", BlockQ3K::VALUES, BlockQ3K::BYTES),
    (12, "q4_K", BlockQ4K::VALUES, BlockQ4K::BYTES),
    (13, "q5_K", BlockQ5K::VALUES, BlockQ5K::BYTES),
    (14, "q6_K", BlockQ6K::VALUES, BlockQ6K::BYTES),
    (15, "q8_K", 256, 292),
    (16, "iq2_xxs", 256, 66),
    (17, "iq2_xs", 256, 74),
    (18, "iq3_xxs", 256, 98),
    (19, "iq1_s", 256, 50),
    (20, "iq4_nl", 32, 18),
    (21, "iq3_s", 256, 110),
    (22, "iq2_s", 256, 82),
    (23, "iq4_xs", 256, 136),
    (24, "i8", 1, 1),
    (25, "i16", 1, 2),
    (26, "i32", 1, 4),
    (27, "i64", 1, 8),
    (28, "f64", 1, 8),
    (29, "iq1_m", 256, 56),
    (30, "bf16", 1, 2),
    (34, "tq1_0", 256, 54),
    (35, "tq2_0", 256, 66),
    (39, "mxfp4", 32, 17),
];

/// `(values per block, bytes per block)` of ggml type `t`, from [`GGML_BLOCKS`].
pub fn ggml_block(t: u32) -> Option<(usize, usize)> {
    GGML_BLOCKS
        .iter()
        .find(|e| e.0 == t)
        .map(|&(_, _, v, b)| (v, b))
}

impl EngramType {
    pub(crate) const ALL: [EngramType; 13] = [
        EngramType::F32,
        EngramType::F16,
        EngramType::Q4_0,
        EngramType::Q8_0,
        EngramType::Q2_K,
        EngramType::Q3_K,
        EngramType::Q4_K,
        EngramType::Q5_K,
        EngramType::Q6_K,
        EngramType::Bf16,
        EngramType::Fp8E4m3E8m0,
        EngramType::Fp8E4m3E8m0Split,
        EngramType::Fp8E4m3E8m0Block,
    ];

    pub fn from_u32(v: u32) -> Option<EngramType> {
        Self::ALL.iter().copied().find(|t| *t as u32 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            EngramType::Fp8E4m3E8m0 => "fp8_e4m3_e8m0",
            EngramType::Fp8E4m3E8m0Split => "fp8_e4m3_e8m0_split",
            EngramType::Fp8E4m3E8m0Block => "fp8_e4m3_e8m0_block",
            t => GGML_BLOCKS
                .iter()
                .find(|e| e.0 == t as u32)
                .map_or("?", |e| e.1),
        }
    }

    /// The type `ty` as a row format for rows of `width` values, or an
    /// `ErrUnsupported` error: formats with blocks (and fp8, whose scales
    /// cover 32 values) need `width` to be a whole number of blocks.
    pub fn row_format(ty: u32, width: usize) -> Result<EngramType> {
        let Some(f) = EngramType::from_u32(ty) else {
            bail!(ErrUnsupported, "unknown table format {ty}");
        };
        if f == EngramType::Fp8E4m3E8m0Block {
            bail!(
                ErrUnsupported,
                "{} is a weight format (wkv), not a table row format",
                f.name()
            );
        }
        if f.is_fp8() && !width.is_multiple_of(FP8_SCALE_BLOCK) {
            bail!(
                ErrUnsupported,
                "fp8 rows need a width that is a multiple of {FP8_SCALE_BLOCK}, got {width}"
            );
        }
        if let Some((bl, bb)) = f.block() {
            if !width.is_multiple_of(bl) {
                bail!(
                    ErrUnsupported,
                    "{} rows are whole blocks of {bl} values ({bb} bytes each), so the width \
                     must be a multiple of {bl}; got {width}",
                    f.name()
                );
            }
        }
        Ok(f)
    }

    /// `(values, bytes)` of one block of a GGUF block format; `None` for the
    /// element formats and for fp8 (whose scales follow the row's codes).
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            EngramType::Fp8E4m3E8m0 | EngramType::Fp8E4m3E8m0Split => None,
            EngramType::Fp8E4m3E8m0Block => None,
            t => ggml_block(t as u32).filter(|&(v, _)| v > 1),
        }
    }

    /// Whether this is one of the fp8 row formats (packed or split).
    pub fn is_fp8(self) -> bool {
        matches!(self, EngramType::Fp8E4m3E8m0 | EngramType::Fp8E4m3E8m0Split)
    }

    /// Bytes per row of a table's arrays: `(table, Some(table_scales))` for
    /// the split fp8 format (`Hd` code bytes, `Hd / 32` scale bytes), `(row
    /// bytes, None)` for every other format (one array).
    pub fn planes(self, width: usize) -> (usize, Option<usize>) {
        match self {
            EngramType::Fp8E4m3E8m0Split => (width, Some(width / FP8_SCALE_BLOCK)),
            t => (t.row_bytes(width), None),
        }
    }

    /// Whether this is one of ggml's block formats (`Q8_0`, `Q4_0`, K-quants).
    pub fn is_gguf_block(self) -> bool {
        self.block().is_some()
    }

    /// Bytes of one row of `width` values (for block formats `width` must be a
    /// whole number of blocks, as [`EngramType::row_format`] checks). For the
    /// split fp8 format, the bytes of a row once its codes and scales are put
    /// side by side (as the packed format holds them; [`EngramType::planes`]
    /// gives the two arrays' shares).
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            EngramType::Fp8E4m3E8m0 | EngramType::Fp8E4m3E8m0Split => {
                width + width / FP8_SCALE_BLOCK
            }
            // The codes; the block scales are a separate array.
            EngramType::Fp8E4m3E8m0Block => width,
            t => {
                let (bl, bb) = ggml_block(t as u32).expect("every EngramType is in GGML_BLOCKS");
                width / bl * bb
            }
        }
    }
}

/// Round an f32 to bf16 (round to nearest, ties to even; NaN stays NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Why a row could not be dequantised: the offending element or scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowDataError {
    /// e8m0 scale code 255 (NaN) at this scale index.
    NanScale(usize),
    /// e4m3 NaN code at this element index.
    NanCode(usize),
    /// The value at this element index is not finite (infinite or NaN) once
    /// dequantised (to bf16 for a bf16 row): an e8m0 scale that overflows the
    /// row, a NaN or infinite f16 scale of a GGUF block, a NaN or infinity
    /// stored in an f16, bf16 or f32 row.
    NonFinite(usize),
}

impl RowDataError {
    /// What was wrong, for a message.
    pub fn describe(self) -> String {
        match self {
            RowDataError::NanScale(b) => format!("e8m0 scale {b} is the NaN code 255"),
            RowDataError::NanCode(i) => format!("element {i} is an e4m3 NaN code"),
            RowDataError::NonFinite(i) => format!(
                "element {i} dequantises to a value that is not finite (an overflowing or NaN scale, or a stored NaN or infinity)"
            ),
        }
    }
}

/// The first element of `out` that is not finite.
#[inline]
fn first_non_finite_f32(out: &[f32]) -> std::result::Result<(), RowDataError> {
    match out.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => Err(RowDataError::NonFinite(i)),
    }
}

/// The first bf16 value of `out` that is not finite (exponent all ones).
#[inline]
fn first_non_finite_bf16(out: &[u16]) -> std::result::Result<(), RowDataError> {
    match out.iter().position(|&b| b & 0x7F80 == 0x7F80) {
        None => Ok(()),
        Some(i) => Err(RowDataError::NonFinite(i)),
    }
}

/// Dequantise one row of `out.len()` values to f32: for the GGUF block formats
/// exactly the values ggml's `dequantize_row_*` computes (see [`ggml`] for the
/// operation order); f16, bf16 and f32 exactly; fp8 as `e4m3 * 2^(scale - 127)`
/// (exact). `row` must be exactly `fmt.row_bytes(out.len())` bytes and, for
/// block formats, `out.len()` a whole number of blocks (panics otherwise).
/// A value that is not finite is an error (the module documentation says
/// why); for every format but fp8 `out` is still written in full.
pub fn dequant_row_f32(
    fmt: EngramType,
    row: &[u8],
    out: &mut [f32],
) -> std::result::Result<(), RowDataError> {
    let w = out.len();
    check_row(fmt, row, w);
    match fmt {
        EngramType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        EngramType::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        EngramType::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        EngramType::Fp8E4m3E8m0 | EngramType::Fp8E4m3E8m0Split => {
            let (codes, scales) = row.split_at(w);
            return fp8::row(codes, scales, out, |x| x, |x| x.is_finite());
        }
        EngramType::Fp8E4m3E8m0Block => panic!("block-scaled fp8 has no rows of its own"),
        _ => {
            let (bl, bb) = fmt.block().expect("block format");
            for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
                dequant_block_f32(fmt, blk, o);
            }
        }
    }
    first_non_finite_f32(out)
}

/// Dequantise one row of `out.len()` values to bf16 bit patterns: the
/// round-to-nearest-even of [`dequant_row_f32`]'s values (bf16 rows are copied
/// as they are). `row` must be exactly `fmt.row_bytes(out.len())` bytes. A
/// value that is not finite in bf16 is an error, as for [`dequant_row_f32`].
pub fn dequant_row_bf16(
    fmt: EngramType,
    row: &[u8],
    out: &mut [u16],
) -> std::result::Result<(), RowDataError> {
    let w = out.len();
    check_row(fmt, row, w);
    match fmt {
        EngramType::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        EngramType::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f32_to_bf16(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
            }
        }
        EngramType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32_to_bf16(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        // e4m3 times a power of two: exact in f32; the bf16 rounding only
        // matters where the product leaves bf16's normal range.
        EngramType::Fp8E4m3E8m0 | EngramType::Fp8E4m3E8m0Split => {
            let (codes, scales) = row.split_at(w);
            return fp8_split_bf16(codes, scales, out);
        }
        EngramType::Fp8E4m3E8m0Block => panic!("block-scaled fp8 has no rows of its own"),
        _ => {
            let (bl, bb) = fmt.block().expect("block format");
            let mut tmp = [0f32; ggml::QK_K];
            for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
                dequant_block_f32(fmt, blk, &mut tmp[..bl]);
                for (o, &v) in o.iter_mut().zip(&tmp[..bl]) {
                    *o = f32_to_bf16(v);
                }
            }
        }
    }
    first_non_finite_bf16(out)
}

/// Dequantise one fp8 row held in two arrays (`out.len()` e4m3 codes, one
/// e8m0 scale per 32 of them) to bf16 bit patterns: bit for bit what
/// [`dequant_row_bf16`] gives for the packed row `codes ++ scales`, errors
/// included (in element order).
pub fn fp8_split_bf16(
    codes: &[u8],
    scales: &[u8],
    out: &mut [u16],
) -> std::result::Result<(), RowDataError> {
    assert!(
        codes.len() == out.len()
            && out.len().is_multiple_of(FP8_SCALE_BLOCK)
            && scales.len() == out.len() / FP8_SCALE_BLOCK,
        "fp8 row of {} values: {} codes, {} scales",
        out.len(),
        codes.len(),
        scales.len()
    );
    fp8::row(codes, scales, out, f32_to_bf16, |b| b & 0x7F80 != 0x7F80)
}

/// The size checks shared by the row dequantisers (cheap next to a row's work;
/// a short row must not leave part of `out` unwritten).
#[inline]
fn check_row(fmt: EngramType, row: &[u8], w: usize) {
    if let Some((bl, _)) = fmt.block() {
        assert!(
            w.is_multiple_of(bl),
            "{} row of {w} values is not whole blocks",
            fmt.name()
        );
    }
    assert_eq!(
        row.len(),
        fmt.row_bytes(w),
        "{} row of {w} values",
        fmt.name()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_rows_reject_nan_scales_and_codes() {
        let f = EngramType::row_format(EngramType::Fp8E4m3E8m0 as u32, 32).unwrap();
        let mut row = vec![0x38u8; 33];
        row[32] = 128;
        let mut out = [0u16; 32];
        dequant_row_bf16(f, &row, &mut out).unwrap();
        assert!(out.iter().all(|&b| bf16_to_f32(b) == 2.0));
        row[32] = 255;
        assert_eq!(
            dequant_row_bf16(f, &row, &mut out),
            Err(RowDataError::NanScale(0))
        );
        row[32] = 127;
        row[5] = 0xFF;
        assert_eq!(
            dequant_row_bf16(f, &row, &mut out),
            Err(RowDataError::NanCode(5))
        );
    }

    #[test]
    fn unsupported_formats_say_so() {
        let e = EngramType::row_format(EngramType::Q2_K as u32, 200).unwrap_err();
        assert_eq!(e.status, crate::EngramStatus::ErrUnsupported);
        assert!(e.message.contains("multiple of 256"), "{}", e.message);
        assert!(EngramType::row_format(EngramType::Q8_0 as u32, 48).is_err());
        assert!(EngramType::row_format(12345, 256).is_err());
        assert!(EngramType::row_format(EngramType::Fp8E4m3E8m0 as u32, 48).is_err());
    }

    #[test]
    fn every_type_is_a_row_format_with_a_name() {
        for t in EngramType::ALL {
            if t == EngramType::Fp8E4m3E8m0Block {
                // A weight format only.
                assert!(EngramType::row_format(t as u32, 256).is_err());
                continue;
            }
            let f = EngramType::row_format(t as u32, 256).unwrap();
            assert_eq!(f, t);
            assert_ne!(f.name(), "?");
        }
        assert_eq!(EngramType::Q2_K.name(), "q2_K");
        assert_eq!(EngramType::Q2_K.row_bytes(512), 168);
        assert_eq!(EngramType::Fp8E4m3E8m0.row_bytes(256), 264);
        assert_eq!(EngramType::Bf16.block(), None);
    }
}
