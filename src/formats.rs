//! Table-row and weight formats, and their dequantisation on the CPU.
//!
//! This module is the bit-exact reference that every backend is compared with.
//! Rows are always dequantised to bf16 (SPEC section 1, step 4); bf16 values are
//! handled as their `u16` bit patterns.
//!
//! GGUF block formats (`q8_0`, `q4_0`, `q2_K` ... `q6_K`) dequantise first to
//! ggml's f32 values ([`dequant_row_f32`]), then to bf16 by round-to-nearest-even.
//! Those f32 values do not depend on operation order or FMA contraction: every
//! product is exact in f32 (an f16 `d` has 11 significant bits, the scale at most
//! 7 and the quant at most 5), so only the final `- dmin * m` of q2_K/q4_K/q5_K
//! rounds, once. A GPU kernel reproduces them with plain f32 arithmetic.

use crate::error::{bail, Result};
use std::sync::OnceLock;

/// Element or row formats. The numbers equal `ggml_type` where ggml has the
/// format, so a GGUF tensor's type can be passed through unchanged; the fp8
/// checkpoint format, which ggml lacks, has its own number.
#[repr(u32)]
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngramType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q8_0 = 8,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Bf16 = 30,
    /// DeepSeek's released checkpoint: per row, `Hd` fp8 e4m3 codes followed by
    /// `Hd / 32` e8m0 scale codes (one per 32 values); 264 bytes for `Hd = 256`.
    Fp8E4m3E8m0 = 1000,
}

impl EngramType {
    pub(crate) const ALL: [EngramType; 11] = [
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
    ];

    pub fn from_u32(v: u32) -> Option<EngramType> {
        Self::ALL.iter().copied().find(|t| *t as u32 == v)
    }

    pub fn name(self) -> &'static str {
        use EngramType::*;
        match self {
            F32 => "f32",
            F16 => "f16",
            Q4_0 => "q4_0",
            Q8_0 => "q8_0",
            Q2_K => "q2_K",
            Q3_K => "q3_K",
            Q4_K => "q4_K",
            Q5_K => "q5_K",
            Q6_K => "q6_K",
            Bf16 => "bf16",
            Fp8E4m3E8m0 => "fp8_e4m3_e8m0",
        }
    }
}

/// Values per e8m0 scale in the fp8 row format.
pub const FP8_SCALE_BLOCK: usize = 32;

/// Values in one ggml K-quant super-block.
const QK_K: usize = 256;
/// Values in one `q8_0` / `q4_0` block.
const QK_32: usize = 32;

/// A table-row (or weight-row) format this build can dequantise.
///
/// The GGUF block formats (`Q8_0` ... `Q6_K`) store a row as whole ggml blocks
/// laid out exactly as ggml's `block_*` structs (little-endian, no padding), so
/// a row of `Hd` values is `Hd / block_len` consecutive blocks. They
/// dequantise to the f32 values ggml's `dequantize_row_*` gives, bit for bit
/// (see [`dequant_row_f32`]).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowFormat {
    F32,
    F16,
    Bf16,
    Fp8E4m3E8m0,
    /// `block_q8_0`: f16 `d`, 32 i8 `qs`; `x = qs * d`. 34 bytes per 32 values.
    Q8_0,
    /// `block_q4_0`: f16 `d`, 16 bytes of nibbles (low nibbles are values
    /// 0..15, high nibbles 16..31); `x = (q - 8) * d`. 18 bytes per 32 values.
    Q4_0,
    /// `block_q2_K`: `scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`. 84 bytes per 256.
    Q2_K,
    /// `block_q3_K`: `hmask[32]`, `qs[64]`, `scales[12]`, f16 `d`. 110 bytes per 256.
    Q3_K,
    /// `block_q4_K`: f16 `d`, f16 `dmin`, `scales[12]`, `qs[128]`. 144 bytes per 256.
    Q4_K,
    /// `block_q5_K`: f16 `d`, f16 `dmin`, `scales[12]`, `qh[32]`, `qs[128]`. 176 bytes per 256.
    Q5_K,
    /// `block_q6_K`: `ql[128]`, `qh[64]`, i8 `scales[16]`, f16 `d`. 210 bytes per 256.
    Q6_K,
}

impl RowFormat {
    /// The row format for `ty`, or an `ErrUnsupported` error. `width` is the row
    /// width (`Hd`); formats with blocks need it to be a whole number of blocks.
    pub fn new(ty: u32, width: usize) -> Result<RowFormat> {
        let Some(t) = EngramType::from_u32(ty) else {
            bail!(ErrUnsupported, "unknown table format {ty}");
        };
        let f = match t {
            EngramType::F32 => RowFormat::F32,
            EngramType::F16 => RowFormat::F16,
            EngramType::Bf16 => RowFormat::Bf16,
            EngramType::Fp8E4m3E8m0 => RowFormat::Fp8E4m3E8m0,
            EngramType::Q8_0 => RowFormat::Q8_0,
            EngramType::Q4_0 => RowFormat::Q4_0,
            EngramType::Q2_K => RowFormat::Q2_K,
            EngramType::Q3_K => RowFormat::Q3_K,
            EngramType::Q4_K => RowFormat::Q4_K,
            EngramType::Q5_K => RowFormat::Q5_K,
            EngramType::Q6_K => RowFormat::Q6_K,
        };
        if f == RowFormat::Fp8E4m3E8m0 && width % FP8_SCALE_BLOCK != 0 {
            bail!(
                ErrUnsupported,
                "fp8 rows need a width that is a multiple of {FP8_SCALE_BLOCK}, got {width}"
            );
        }
        if let Some((bl, bb)) = f.block() {
            if width % bl != 0 {
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
            RowFormat::F32 | RowFormat::F16 | RowFormat::Bf16 | RowFormat::Fp8E4m3E8m0 => None,
            RowFormat::Q8_0 => Some((QK_32, 34)),
            RowFormat::Q4_0 => Some((QK_32, 18)),
            RowFormat::Q2_K => Some((QK_K, 84)),
            RowFormat::Q3_K => Some((QK_K, 110)),
            RowFormat::Q4_K => Some((QK_K, 144)),
            RowFormat::Q5_K => Some((QK_K, 176)),
            RowFormat::Q6_K => Some((QK_K, 210)),
        }
    }

    /// Whether this is one of ggml's block formats (`q8_0`, `q4_0`, K-quants).
    pub fn is_gguf_block(self) -> bool {
        self.block().is_some()
    }

    /// Bytes of one row of `width` values (for block formats `width` must be a
    /// whole number of blocks, as [`RowFormat::new`] checks).
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            RowFormat::F32 => 4 * width,
            RowFormat::F16 | RowFormat::Bf16 => 2 * width,
            RowFormat::Fp8E4m3E8m0 => width + width / FP8_SCALE_BLOCK,
            _ => {
                let (bl, bb) = self.block().expect("block format");
                width / bl * bb
            }
        }
    }

    /// The type number (`ggml_type` where ggml has the format).
    pub fn engram_type(self) -> EngramType {
        match self {
            RowFormat::F32 => EngramType::F32,
            RowFormat::F16 => EngramType::F16,
            RowFormat::Bf16 => EngramType::Bf16,
            RowFormat::Fp8E4m3E8m0 => EngramType::Fp8E4m3E8m0,
            RowFormat::Q8_0 => EngramType::Q8_0,
            RowFormat::Q4_0 => EngramType::Q4_0,
            RowFormat::Q2_K => EngramType::Q2_K,
            RowFormat::Q3_K => EngramType::Q3_K,
            RowFormat::Q4_K => EngramType::Q4_K,
            RowFormat::Q5_K => EngramType::Q5_K,
            RowFormat::Q6_K => EngramType::Q6_K,
        }
    }

    pub fn name(self) -> &'static str {
        self.engram_type().name()
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

/// The value of an fp8 e4m3 ("fn": no infinities, `S.1111.111` is NaN) code.
pub fn e4m3_to_f32(code: u8) -> f32 {
    e4m3_table()[code as usize]
}

fn e4m3_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = [0f32; 256];
        for (c, v) in t.iter_mut().enumerate() {
            let sign = if c & 0x80 != 0 { -1.0f32 } else { 1.0 };
            let exp = ((c >> 3) & 0xF) as i32;
            let man = (c & 7) as f32;
            *v = if exp == 15 && c & 7 == 7 {
                f32::NAN
            } else if exp == 0 {
                sign * man * 2f32.powi(-9)
            } else {
                sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
            };
        }
        t
    })
}

/// The value of an e8m0 scale code (`2^(code-127)`); `None` for the NaN code 255.
#[inline]
pub fn e8m0_to_f32(code: u8) -> Option<f32> {
    if code == 255 {
        None
    } else if code == 0 {
        Some(f32::from_bits(0x0040_0000)) // 2^-127, an f32 subnormal
    } else {
        Some(f32::from_bits((code as u32) << 23))
    }
}

/// Why a row could not be dequantised: the offending element or scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowDataError {
    /// e8m0 scale code 255 (NaN) at this scale index.
    NanScale(usize),
    /// e4m3 NaN code at this element index.
    NanCode(usize),
}

/// Dequantise one row of `out.len()` values to f32: for the GGUF block formats
/// exactly the values ggml's `dequantize_row_*` computes (see the block
/// functions below for the operation order); f16, bf16 and f32 exactly; fp8 as
/// `e4m3 * 2^(scale - 127)` (exact), with the same NaN checks as
/// [`dequant_row_bf16`]. `row` must be exactly `fmt.row_bytes(out.len())` bytes
/// and, for block formats, `out.len()` a whole number of blocks (panics
/// otherwise). GGUF blocks never fail: a NaN or infinite f16 `d` propagates
/// into the values as it does in ggml.
pub fn dequant_row_f32(
    fmt: RowFormat,
    row: &[u8],
    out: &mut [f32],
) -> std::result::Result<(), RowDataError> {
    let w = out.len();
    check_row(fmt, row, w);
    match fmt {
        RowFormat::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        RowFormat::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        RowFormat::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        RowFormat::Fp8E4m3E8m0 => fp8_row(row, out, |x| x)?,
        _ => {
            let (bl, bb) = fmt.block().expect("block format");
            for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
                dequant_block_f32(fmt, blk, o);
            }
        }
    }
    Ok(())
}

/// Dequantise one row of `out.len()` values to bf16 bit patterns: the
/// round-to-nearest-even of [`dequant_row_f32`]'s values (bf16 rows are copied
/// as they are). `row` must be exactly `fmt.row_bytes(out.len())` bytes.
pub fn dequant_row_bf16(
    fmt: RowFormat,
    row: &[u8],
    out: &mut [u16],
) -> std::result::Result<(), RowDataError> {
    let w = out.len();
    check_row(fmt, row, w);
    match fmt {
        RowFormat::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = u16::from_le_bytes([b[0], b[1]]);
            }
        }
        RowFormat::F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f32_to_bf16(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
            }
        }
        RowFormat::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32_to_bf16(f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        // e4m3 times a power of two: exact in f32; the bf16 rounding only
        // matters where the product leaves bf16's normal range.
        RowFormat::Fp8E4m3E8m0 => fp8_row(row, out, f32_to_bf16)?,
        _ => {
            let (bl, bb) = fmt.block().expect("block format");
            let mut tmp = [0f32; QK_K];
            for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(bl)) {
                dequant_block_f32(fmt, blk, &mut tmp[..bl]);
                for (o, &v) in o.iter_mut().zip(&tmp[..bl]) {
                    *o = f32_to_bf16(v);
                }
            }
        }
    }
    Ok(())
}

/// The size checks shared by the row dequantisers (cheap next to a row's work;
/// a short row must not leave part of `out` unwritten).
#[inline]
fn check_row(fmt: RowFormat, row: &[u8], w: usize) {
    if let Some((bl, _)) = fmt.block() {
        assert!(
            w % bl == 0,
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

/// The fp8 row: codes then one e8m0 scale per 32 values; `conv` turns each
/// exact f32 value into the output element.
#[inline]
fn fp8_row<T>(
    row: &[u8],
    out: &mut [T],
    conv: impl Fn(f32) -> T,
) -> std::result::Result<(), RowDataError> {
    let (codes, scales) = row.split_at(out.len());
    let table = e4m3_table();
    for (bi, (&sc, (ob, cb))) in scales
        .iter()
        .zip(
            out.chunks_exact_mut(FP8_SCALE_BLOCK)
                .zip(codes.chunks_exact(FP8_SCALE_BLOCK)),
        )
        .enumerate()
    {
        let s = e8m0_to_f32(sc).ok_or(RowDataError::NanScale(bi))?;
        for (j, (o, &c)) in ob.iter_mut().zip(cb).enumerate() {
            if c & 0x7F == 0x7F {
                return Err(RowDataError::NanCode(bi * FP8_SCALE_BLOCK + j));
            }
            *o = conv(table[c as usize] * s);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// GGUF blocks. Each function reads one block (exactly the block's bytes) and
// writes its values in ggml's element order. The arithmetic is f32 with one
// rounding per operation, in ggml's order (`dequantize_row_*` in
// ggml-quants.c); Rust never fuses a multiply and an add, so these are the
// values of an unfused ggml build (and of gguf-py's numpy dequantisers).
// ---------------------------------------------------------------------------

/// Dequantise one block of a GGUF block format (`blk` is its bytes, `out` its
/// `block().0` values).
pub fn dequant_block_f32(fmt: RowFormat, blk: &[u8], out: &mut [f32]) {
    match fmt {
        RowFormat::Q8_0 => q8_0(blk.try_into().unwrap(), out.try_into().unwrap()),
        RowFormat::Q4_0 => q4_0(blk.try_into().unwrap(), out.try_into().unwrap()),
        RowFormat::Q2_K => q2_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        RowFormat::Q3_K => q3_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        RowFormat::Q4_K => q4_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        RowFormat::Q5_K => q5_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        RowFormat::Q6_K => q6_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        other => panic!("{} is not a block format", other.name()),
    }
}

/// An f16 stored little-endian at `b[at..at + 2]`, widened exactly.
#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// `y = q * d`, `q` the signed byte.
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[2..]) {
        *o = (q as i8) as f32 * d;
    }
}

/// `y = (q - 8) * d`; byte `j` holds value `j` (low nibble) and `j + 16` (high).
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..].iter().enumerate() {
        lo[j] = ((q & 0xF) as i32 - 8) as f32 * d;
        hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Each half (128 values) reads 32 bytes of `qs`; its four groups of 32 take
/// the 2-bit fields at shifts 0, 2, 4, 6. Sub-block `s` (16 values) has the
/// scale byte `scales[s]`: low nibble times `d`, high nibble times `dmin`;
/// `y = (d * sc) * q - (dmin * m)`.
fn q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for (s, ys) in y.chunks_exact_mut(16).enumerate() {
        let sc = scales[s];
        let dl = d * (sc & 0xF) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
        let q = &qs[32 * half + 16 * part..][..16];
        for (o, &qb) in ys.iter_mut().zip(q) {
            *o = dl * ((qb >> (2 * group)) & 3) as f32 - ml;
        }
    }
}

/// The 6-bit scales of `q3_K`: value `s` has its low 4 bits in `scales[s]`
/// (s < 8, low nibble) or `scales[s - 8]` (high nibble) and its high 2 bits in
/// `scales[8 + s % 4]` at bit `2 * (s / 4)`; the scale is that minus 32.
#[inline]
fn q3_k_scale(sc: &[u8], s: usize) -> i32 {
    let lo = if s < 8 { sc[s] & 0xF } else { sc[s - 8] >> 4 };
    let hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

/// Like `q2_K` for the low 2 bits; `hmask[l]` bit `4 * half + group` set means
/// no offset, clear means `-4`; `y = (d * (sc - 32)) * q`.
fn q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (s, ys) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * q3_k_scale(scales, s) as f32;
        let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
        let q = &qs[32 * half + 16 * part..][..16];
        let h = &hmask[16 * part..][..16];
        let bit = 1u8 << (4 * half + group);
        for ((o, &qb), &hb) in ys.iter_mut().zip(q).zip(h) {
            let v = ((qb >> (2 * group)) & 3) as i32 - if hb & bit != 0 { 0 } else { 4 };
            *o = dl * v as f32;
        }
    }
}

/// The packed 6-bit (scale, min) pair `j` of `q4_K` / `q5_K` (ggml's
/// `get_scale_min_k4`).
#[inline]
fn scale_min_k4(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        (
            (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
        )
    }
}

/// Sub-block `s` (32 values) reads `qs[32 * (s / 2)..][..32]`, low nibbles for
/// even `s`, high for odd; `y = (d * sc) * q - (dmin * m)`.
fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (s, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, s);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let q = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        for (o, &qb) in ys.iter_mut().zip(q) {
            *o = d1 * ((qb >> shift) & 0xF) as f32 - m1;
        }
    }
}

/// As `q4_K`, plus the fifth bit: bit `s` of `qh[l]` adds 16.
fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (s, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, s);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let q = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        for ((o, &qb), &hb) in ys.iter_mut().zip(q).zip(qh) {
            let v = ((qb >> shift) & 0xF) as u32 + if hb & (1 << s) != 0 { 16 } else { 0 };
            *o = d1 * v as f32 - m1;
        }
    }
}

/// Each half (128 values) reads `ql[64 * half..][..64]` and `qh[32 * half..][..32]`;
/// its group `g` of 32 values takes the low (g = 0, 1) or high (g = 2, 3)
/// nibbles of `ql[32 * (g % 2)..][..32]` and the 2 bits of `qh` at shift
/// `2 * g`; `q` is that 6-bit value minus 32 and `y = (d * sc) * q` with the
/// signed scale `scales[s]` of sub-block `s` (16 values).
fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (s, ys) in y.chunks_exact_mut(16).enumerate() {
        let sd = d * (scales[s] as i8) as f32;
        let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
        let l0 = 16 * part;
        let lq = &ql[64 * half + 32 * (group % 2) + l0..][..16];
        let hq = &qh[32 * half + l0..][..16];
        let shift = 4 * (group / 2);
        for ((o, &lb), &hb) in ys.iter_mut().zip(lq).zip(hq) {
            let v = (((lb >> shift) & 0xF) | (((hb >> (2 * group)) & 3) << 4)) as i32 - 32;
            *o = sd * v as f32;
        }
    }
}

/// A weight dtype (`wkv`, `q`, `k`) this build reads as dense values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    /// f32 or bf16; any other type is `ErrUnsupported`. (Quantised weights are
    /// described by [`WeightFormat::new`], which also needs the row length.)
    pub fn new(ty: u32, what: &str) -> Result<WeightDtype> {
        match EngramType::from_u32(ty) {
            Some(EngramType::F32) => Ok(WeightDtype::F32),
            Some(EngramType::Bf16) => Ok(WeightDtype::Bf16),
            Some(t) => bail!(
                ErrUnsupported,
                "{what} dtype {} ({ty}) is not supported here (f32 or bf16)",
                t.name()
            ),
            None => bail!(ErrUnsupported, "unknown {what} dtype {ty}"),
        }
    }

    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }
}

/// How a weight matrix is stored: dense f32/bf16 values, or quantised rows
/// (ggml block formats; each row of `row_len` values is
/// `format.row_bytes(row_len)` bytes, rows back to back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Dense(WeightDtype),
    Quant(RowFormat),
}

impl WeightFormat {
    /// The format of a weight of type `ty` whose rows hold `row_len` values
    /// (for `wkv`, `[D*(hc+1), C*Hd]`, that is `C*Hd`): f32, bf16, or one of
    /// `q8_0`, `q4_0`, `q2_K` ... `q6_K` with `row_len` a whole number of
    /// blocks. Anything else is `ErrUnsupported`, naming `what`.
    pub fn new(ty: u32, row_len: usize, what: &str) -> Result<WeightFormat> {
        let Some(t) = EngramType::from_u32(ty) else {
            bail!(ErrUnsupported, "unknown {what} dtype {ty}");
        };
        match t {
            EngramType::F32 => Ok(WeightFormat::Dense(WeightDtype::F32)),
            EngramType::Bf16 => Ok(WeightFormat::Dense(WeightDtype::Bf16)),
            EngramType::Q8_0
            | EngramType::Q4_0
            | EngramType::Q2_K
            | EngramType::Q3_K
            | EngramType::Q4_K
            | EngramType::Q5_K
            | EngramType::Q6_K => {
                let f = RowFormat::new(ty, row_len).map_err(|e| {
                    crate::error::Error::new(e.status, format!("{what}: {}", e.message))
                })?;
                Ok(WeightFormat::Quant(f))
            }
            EngramType::F16 | EngramType::Fp8E4m3E8m0 => bail!(
                ErrUnsupported,
                "{what} dtype {} ({ty}) is not supported (f32, bf16, q8_0, q4_0 or q2_K..q6_K)",
                t.name()
            ),
        }
    }

    /// Bytes of `rows` rows of `row_len` values, or `None` on overflow.
    pub fn bytes(self, rows: usize, row_len: usize) -> Option<usize> {
        let per_row = match self {
            WeightFormat::Dense(d) => d.size().checked_mul(row_len)?,
            WeightFormat::Quant(f) => f.row_bytes(row_len),
        };
        rows.checked_mul(per_row)
    }
}

/// A borrowed weight matrix: dense f32 values or bf16 bit patterns, or
/// quantised rows.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    /// Rows of `row_len` values, each `format.row_bytes(row_len)` bytes, back
    /// to back in `data` (a GGUF tensor's data as it is in the file). Build it
    /// with [`Weights::quant`], which checks the sizes. Values are read with
    /// [`Weights::to_f32`] (any range; whole rows are the fast path) or
    /// [`Weights::get`] (dequantises the containing block each call: slow).
    Quant {
        format: RowFormat,
        data: &'a [u8],
        row_len: usize,
    },
}

impl<'a> Weights<'a> {
    /// A quantised weight over `data`, checked: `format` is a GGUF block format,
    /// `row_len` a positive whole number of its blocks and `data` whole rows.
    pub fn quant(format: RowFormat, data: &'a [u8], row_len: usize) -> Result<Weights<'a>> {
        let Some((bl, _)) = format.block() else {
            bail!(
                ErrUnsupported,
                "quantised weights are GGUF block formats, not {}",
                format.name()
            );
        };
        if row_len == 0 || row_len % bl != 0 {
            bail!(
                ErrUnsupported,
                "{} weight rows are whole blocks of {bl} values; got rows of {row_len}",
                format.name()
            );
        }
        let rb = format.row_bytes(row_len);
        if data.len() % rb != 0 {
            bail!(
                ErrInvalidArgument,
                "{} weight data of {} bytes is not whole rows of {rb} bytes",
                format.name(),
                data.len()
            );
        }
        Ok(Weights::Quant {
            format,
            data,
            row_len,
        })
    }

    /// Total values.
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(v) => v.len(),
            Weights::Bf16(v) => v.len(),
            Weights::Quant {
                format,
                data,
                row_len,
            } => {
                let rb = format.row_bytes(*row_len);
                if rb == 0 {
                    0
                } else {
                    data.len() / rb * row_len
                }
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `i` as f32. For `Quant` this dequantises the block (or, for a
    /// non-block format, the row) holding `i`: fine for a few values, slow for
    /// many (use [`Weights::to_f32`]).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Weights::F32(v) => v[i],
            Weights::Bf16(v) => bf16_to_f32(v[i]),
            Weights::Quant { .. } => {
                let mut x = [0f32];
                self.to_f32(i, &mut x);
                x[0]
            }
        }
    }

    /// Values `start..start + out.len()` converted to f32 into `out` (panics if
    /// the range passes the end). For `Quant` any range works; ranges of whole
    /// rows (or whole blocks) are dequantised straight into `out`, partial
    /// blocks through a scratch block. Quantised values are exactly
    /// [`dequant_row_f32`]'s; a row that fails to dequantise (fp8 NaN codes, the
    /// only format that can) reads as NaN.
    pub fn to_f32(&self, start: usize, out: &mut [f32]) {
        match *self {
            Weights::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Weights::Bf16(v) => {
                let n = out.len();
                for (o, &b) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = bf16_to_f32(b);
                }
            }
            Weights::Quant {
                format,
                data,
                row_len,
            } => quant_to_f32(format, data, row_len, start, out, self.len()),
        }
    }
}

/// `Weights::Quant`'s `to_f32`. The matrix is a run of units: blocks for block
/// formats (rows are whole blocks, so the rows' blocks are one stream), rows
/// otherwise.
fn quant_to_f32(
    format: RowFormat,
    data: &[u8],
    row_len: usize,
    start: usize,
    out: &mut [f32],
    len: usize,
) {
    let n = out.len();
    assert!(
        start <= len && n <= len - start,
        "values {start}..{} of a weight of {len}",
        start + n
    );
    let (ul, ub) = format
        .block()
        .unwrap_or((row_len, format.row_bytes(row_len)));
    // Dequantise whole units `u0..u0 + k` into `o` (k * ul values).
    let units = |u0: usize, k: usize, o: &mut [f32]| {
        let bytes = &data[u0 * ub..(u0 + k) * ub];
        if format.is_gguf_block() {
            let _ = dequant_row_f32(format, bytes, o);
        } else {
            for (b, o) in bytes.chunks_exact(ub).zip(o.chunks_exact_mut(ul)) {
                if dequant_row_f32(format, b, o).is_err() {
                    o.fill(f32::NAN);
                }
            }
        }
    };
    let mut scratch = Vec::new();
    let (mut pos, mut o) = (start, 0);
    while o < n {
        let (u, off) = (pos / ul, pos % ul);
        let whole = if off == 0 { (n - o) / ul } else { 0 };
        if whole > 0 {
            units(u, whole, &mut out[o..o + whole * ul]);
            pos += whole * ul;
            o += whole * ul;
        } else {
            scratch.resize(ul, 0f32);
            units(u, 1, &mut scratch);
            let take = (ul - off).min(n - o);
            out[o..o + take].copy_from_slice(&scratch[off..off + take]);
            pos += take;
            o += take;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_cover_the_format() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(e4m3_to_f32(0x7E), 448.0); // largest
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert!(e4m3_to_f32(0x7F).is_nan() && e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn e8m0_is_a_power_of_two_or_nan() {
        assert_eq!(e8m0_to_f32(127), Some(1.0));
        assert_eq!(e8m0_to_f32(0), Some(2f32.powi(-127)));
        assert_eq!(e8m0_to_f32(254), Some(2f32.powi(127)));
        assert_eq!(e8m0_to_f32(255), None);
    }

    #[test]
    fn fp8_rows_reject_nan_scales_and_codes() {
        let f = RowFormat::new(EngramType::Fp8E4m3E8m0 as u32, 32).unwrap();
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
        let e = RowFormat::new(EngramType::Q2_K as u32, 200).unwrap_err();
        assert_eq!(e.status, crate::EngramStatus::ErrUnsupported);
        assert!(e.message.contains("multiple of 256"), "{}", e.message);
        assert!(RowFormat::new(EngramType::Q8_0 as u32, 48).is_err());
        assert!(RowFormat::new(12345, 256).is_err());
        assert!(RowFormat::new(EngramType::Fp8E4m3E8m0 as u32, 48).is_err());
    }

    #[test]
    fn every_type_has_a_row_format() {
        for t in EngramType::ALL {
            let f = RowFormat::new(t as u32, 256).unwrap();
            assert_eq!(f.engram_type(), t);
            assert_eq!(f.name(), t.name());
        }
    }

    /// The K-quant scale unpacking against hand-packed codes.
    #[test]
    fn packed_scales_unpack() {
        // q4_K/q5_K: scale j and min j for j = 0..8.
        let (sc, mn) = (
            [1u8, 2, 3, 63, 40, 17, 0, 63],
            [5u8, 0, 63, 9, 33, 48, 62, 1],
        );
        let mut b = [0u8; 12];
        for j in 0..4 {
            b[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            b[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            b[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(&b, j), (sc[j], mn[j]), "{j}");
        }
        // q3_K: 16 six-bit codes, scale = code - 32.
        let codes: Vec<u8> = (0..16).map(|j| (j * 7 + 3) % 64).collect();
        let mut b = [0u8; 12];
        for (j, &c) in codes.iter().enumerate() {
            if j < 8 {
                b[j] |= c & 0xF;
            } else {
                b[j - 8] |= (c & 0xF) << 4;
            }
            b[8 + j % 4] |= (c >> 4) << (2 * (j / 4));
        }
        for (j, &c) in codes.iter().enumerate() {
            assert_eq!(q3_k_scale(&b, j), c as i32 - 32, "{j}");
        }
    }

    #[test]
    fn q4_0_nibbles_and_q8_0_signs() {
        let mut b = [0u8; 18];
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequant_row_f32(RowFormat::Q4_0, &b, &mut y).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 8.0);
            assert_eq!(y[16 + j], 7.0 - j as f32);
        }
        let mut b = [0u8; 34];
        b[0..2].copy_from_slice(&0xc000u16.to_le_bytes()); // d = -2
        for j in 0..32 {
            b[2 + j] = (j as u8).wrapping_mul(8);
        }
        dequant_row_f32(RowFormat::Q8_0, &b, &mut y).unwrap();
        for j in 0..32 {
            assert_eq!(y[j], -2.0 * ((j as u8).wrapping_mul(8) as i8) as f32);
        }
    }
}
