//! Table-row and weight formats, and their dequantisation on the CPU.
//!
//! This module is the bit-exact reference that every backend is compared with.
//! Rows are always dequantised to bf16 (SPEC section 1, step 4); bf16 values are
//! handled as their `u16` bit patterns.

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

/// A table-row format this build can dequantise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowFormat {
    F32,
    F16,
    Bf16,
    Fp8E4m3E8m0,
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
            other => bail!(
                ErrUnsupported,
                "table format {} ({}) is not supported by this build",
                other.name(),
                other as u32
            ),
        };
        if f == RowFormat::Fp8E4m3E8m0 && width % FP8_SCALE_BLOCK != 0 {
            bail!(
                ErrUnsupported,
                "fp8 rows need a width that is a multiple of {FP8_SCALE_BLOCK}, got {width}"
            );
        }
        Ok(f)
    }

    /// Bytes of one row of `width` values.
    pub fn row_bytes(self, width: usize) -> usize {
        match self {
            RowFormat::F32 => 4 * width,
            RowFormat::F16 | RowFormat::Bf16 => 2 * width,
            RowFormat::Fp8E4m3E8m0 => width + width / FP8_SCALE_BLOCK,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            RowFormat::F32 => "f32",
            RowFormat::F16 => "f16",
            RowFormat::Bf16 => "bf16",
            RowFormat::Fp8E4m3E8m0 => "fp8_e4m3_e8m0",
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

/// Dequantise one row of `out.len()` values to bf16 bit patterns.
/// `row` must be exactly `fmt.row_bytes(out.len())` bytes.
pub fn dequant_row_bf16(
    fmt: RowFormat,
    row: &[u8],
    out: &mut [u16],
) -> std::result::Result<(), RowDataError> {
    let w = out.len();
    debug_assert_eq!(row.len(), fmt.row_bytes(w));
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
        RowFormat::Fp8E4m3E8m0 => {
            let (codes, scales) = row.split_at(w);
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
                    // e4m3 times a power of two: exact in f32; the bf16 rounding
                    // only matters where the product leaves bf16's normal range.
                    *o = f32_to_bf16(table[c as usize] * s);
                }
            }
        }
    }
    Ok(())
}

/// A weight dtype (`wkv`, `q`, `k`) this build reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    pub fn new(ty: u32, what: &str) -> Result<WeightDtype> {
        match EngramType::from_u32(ty) {
            Some(EngramType::F32) => Ok(WeightDtype::F32),
            Some(EngramType::Bf16) => Ok(WeightDtype::Bf16),
            Some(t) => bail!(
                ErrUnsupported,
                "{what} dtype {} ({ty}) is not supported by this build (f32 or bf16)",
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

/// A borrowed dense weight: f32 values or bf16 bit patterns.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl Weights<'_> {
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(v) => v.len(),
            Weights::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Weights::F32(v) => v[i],
            Weights::Bf16(v) => bf16_to_f32(v[i]),
        }
    }

    /// Values `start..start + out.len()` converted to f32 into `out`.
    pub fn to_f32(&self, start: usize, out: &mut [f32]) {
        match self {
            Weights::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Weights::Bf16(v) => {
                let n = out.len();
                for (o, &b) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = bf16_to_f32(b);
                }
            }
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
        let e = RowFormat::new(EngramType::Q2_K as u32, 256).unwrap_err();
        assert_eq!(e.status, crate::EngramStatus::ErrUnsupported);
        assert!(RowFormat::new(12345, 256).is_err());
        assert!(RowFormat::new(EngramType::Fp8E4m3E8m0 as u32, 48).is_err());
    }
}
