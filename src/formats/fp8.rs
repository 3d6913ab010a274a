//! The released checkpoint's rows: `Hd` fp8 e4m3 ("fn") codes followed by
//! `Hd / 32` e8m0 scale codes, one per 32 values.

use super::RowDataError;
use std::sync::OnceLock;

/// Values per e8m0 scale in the fp8 row format.
pub const FP8_SCALE_BLOCK: usize = 32;

/// The value of an fp8 e4m3 ("fn": no infinities, `S.1111.111` is NaN) code.
pub fn e4m3_to_f32(code: u8) -> f32 {
    e4m3_table()[code as usize]
}

pub(super) fn e4m3_table() -> &'static [f32; 256] {
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

/// One fp8 row: `codes`, and one e8m0 scale per 32 values in `scales` (the
/// packed format's row split after its codes, or the split format's two
/// arrays); `conv` turns each exact f32 value into the output element,
/// `finite` says whether an output element is a finite number. Errors come
/// in element order: a NaN scale at its block's first element, then per
/// element a NaN code or a value that is not finite.
#[inline]
pub(super) fn row<T: Copy>(
    codes: &[u8],
    scales: &[u8],
    out: &mut [T],
    conv: impl Fn(f32) -> T,
    finite: impl Fn(T) -> bool,
) -> std::result::Result<(), RowDataError> {
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
            let v = conv(table[c as usize] * s);
            if !finite(v) {
                return Err(RowDataError::NonFinite(bi * FP8_SCALE_BLOCK + j));
            }
            *o = v;
        }
    }
    Ok(())
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

    /// A scale code large enough to overflow the row is invalid data, in
    /// element order with NaN codes.
    #[test]
    fn overflowing_scales_are_invalid_data() {
        use crate::formats::{dequant_row_bf16, dequant_row_f32, EngramType};
        let mut row = vec![0x38u8; 64 + 2]; // 1.0 everywhere
        row[64] = 127;
        row[65] = 254; // 2^127: 1.0 * 2^127 is finite
        let (mut o16, mut o32) = ([0u16; 64], [0f32; 64]);
        dequant_row_bf16(EngramType::Fp8E4m3E8m0, &row, &mut o16).unwrap();
        row[32 + 5] = 0x48; // 2.0 * 2^127 overflows f32 and bf16
        let e = Err(RowDataError::NonFinite(37));
        assert_eq!(dequant_row_bf16(EngramType::Fp8E4m3E8m0, &row, &mut o16), e);
        assert_eq!(dequant_row_f32(EngramType::Fp8E4m3E8m0, &row, &mut o32), e);
        row[40] = 0x7F; // a NaN code after it: the overflow comes first
        assert_eq!(dequant_row_bf16(EngramType::Fp8E4m3E8m0, &row, &mut o16), e);
        row[3] = 0xFF; // a NaN code before it
        assert_eq!(
            dequant_row_bf16(EngramType::Fp8E4m3E8m0, &row, &mut o16),
            Err(RowDataError::NanCode(3))
        );
    }
}
