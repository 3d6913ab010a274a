//! The checkpoint's block-scaled fp8 weight format
//! (`ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK`): a `[rows, k]` matrix of e4m3 ("fn")
//! codes, row-major, and one e8m0 scale per `br x bc` block of it, the
//! scales `[ceil(rows / br), ceil(k / bc)]` row-major (the released
//! DeepSeek-V4.1 checkpoint's `wkv.weight` and `wkv.scale`, with its
//! `quantization_config.weight_block_size` as the block shape).
//!
//! Element `(o, i)` is `e4m3(codes[o][i]) * 2^(scales[o / br][i / bc] - 127)`,
//! computed exactly in f32 (an e4m3 value has 4 significant bits and its
//! lowest bit is at least `2^-9`, so any product with a power of two from
//! `2^-127` up is exact unless it overflows). [`Fp8Blocks::check`] accepts a
//! matrix only when every such value is also exact in bf16: then the kernels
//! that convert codes and scales in registers hold the very operands the
//! bf16 path holds for the same weights widened to bf16, and give its bits.

use super::fp8::e4m3_table;
use super::{e8m0_to_f32, EngramType};
use crate::error::{bail, Error, Result};
use crate::EngramStatus;

/// A borrowed block-scaled fp8 matrix (see the module documentation), its
/// sizes checked by [`Fp8Blocks::new`].
#[derive(Clone, Copy, Debug)]
pub struct Fp8Blocks<'a> {
    /// `[rows, k]` e4m3 codes.
    pub codes: &'a [u8],
    /// `[ceil(rows / br), ceil(k / bc)]` e8m0 codes.
    pub scales: &'a [u8],
    /// Values per row.
    pub k: usize,
    /// The block shape: rows, columns.
    pub br: usize,
    pub bc: usize,
}

/// Scale bytes of a `[rows, k]` matrix in blocks of `br x bc`, or `None` on
/// overflow or a zero block side.
pub fn fp8_block_scale_len(rows: usize, k: usize, br: usize, bc: usize) -> Option<usize> {
    if br == 0 || bc == 0 {
        return None;
    }
    rows.div_ceil(br).checked_mul(k.div_ceil(bc))
}

/// What is wrong with one block (see [`Fp8Blocks::check`]); element
/// positions are within the whole matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFault {
    /// The block's scale is the e8m0 NaN code 255.
    NanScale,
    /// The e4m3 NaN code at `(row, col)`.
    NanCode(usize, usize),
    /// The value at `(row, col)` overflows f32 (and bf16).
    Overflow(usize, usize),
    /// The value at `(row, col)` is too small to be exact in bf16 (its
    /// lowest bit is below bf16's smallest subnormal, `2^-133`).
    Inexact(usize, usize),
}

/// The first bad block of a matrix: its block row and column, and the fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BadBlock {
    pub block_row: usize,
    pub block_col: usize,
    pub fault: BlockFault,
}

impl<'a> Fp8Blocks<'a> {
    /// The matrix over `codes` (whole rows of `k`) and `scales`, checked for
    /// size only: `k`, `br` and `bc` positive, `scales` exactly the bytes the
    /// block shape implies. Values are checked by [`Fp8Blocks::check`].
    pub fn new(
        codes: &'a [u8],
        scales: &'a [u8],
        k: usize,
        br: usize,
        bc: usize,
    ) -> Result<Fp8Blocks<'a>> {
        if br == 0 || bc == 0 {
            bail!(
                ErrInvalidArgument,
                "a {} weight needs a block shape of positive sizes, got {br} x {bc}",
                EngramType::Fp8E4m3E8m0Block.name()
            );
        }
        if k == 0 || !codes.len().is_multiple_of(k) {
            bail!(
                ErrInvalidArgument,
                "{} codes of {} bytes are not whole rows of {k}",
                EngramType::Fp8E4m3E8m0Block.name(),
                codes.len()
            );
        }
        let rows = codes.len() / k;
        let need = fp8_block_scale_len(rows, k, br, bc).ok_or_else(|| {
            Error::new(
                EngramStatus::ErrInvalidArgument,
                "the fp8 block scales are too large".to_string(),
            )
        })?;
        if scales.len() != need {
            bail!(
                ErrInvalidArgument,
                "{rows} x {k} fp8 codes in blocks of {br} x {bc} need {need} scale bytes, got {}",
                scales.len()
            );
        }
        Ok(Fp8Blocks {
            codes,
            scales,
            k,
            br,
            bc,
        })
    }

    pub fn rows(&self) -> usize {
        self.codes.len() / self.k
    }

    /// Blocks per row of blocks.
    pub fn block_cols(&self) -> usize {
        self.k.div_ceil(self.bc)
    }

    /// The scales of row `o`'s blocks (`ceil(k / bc)` bytes).
    #[inline]
    pub fn scale_row(&self, o: usize) -> &'a [u8] {
        let n = self.block_cols();
        &self.scales[(o / self.br) * n..][..n]
    }

    /// Element `(o, i)` as f32 (exact; NaN for a NaN code or scale).
    #[inline]
    pub fn value(&self, o: usize, i: usize) -> f32 {
        let s = self.scale_row(o)[i / self.bc];
        value_of(self.codes[o * self.k + i], s)
    }

    /// Values `start..start + out.len()` (row-major over the matrix) as f32.
    pub fn to_f32(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        assert!(
            start <= self.codes.len() && n <= self.codes.len() - start,
            "values {start}..{} of a weight of {}",
            start + n,
            self.codes.len()
        );
        let table = e4m3_table();
        let (mut pos, mut o) = (start, 0);
        while o < n {
            let (row, col) = (pos / self.k, pos % self.k);
            let take = (self.k - col).min(n - o);
            let sr = self.scale_row(row);
            let codes = &self.codes[pos..pos + take];
            for (j, (v, &c)) in out[o..o + take].iter_mut().zip(codes).enumerate() {
                *v = table[c as usize] * scale_of(sr[(col + j) / self.bc]);
            }
            pos += take;
            o += take;
        }
    }

    /// Whether every value is finite and exact in bf16: the first block (in
    /// block row-major order) that is not, and its first bad element (in
    /// row-major order within the block; a NaN scale before any element).
    /// One pass over the codes (a byte max per block) and the scales;
    /// only blocks with a scale below `2^-124` look at each value.
    pub fn check(&self) -> std::result::Result<(), BadBlock> {
        let (rows, k, br, bc) = (self.rows(), self.k, self.br, self.bc);
        let nbc = self.block_cols();
        for bi in 0..rows.div_ceil(br) {
            let (r0, r1) = (bi * br, ((bi + 1) * br).min(rows));
            for bj in 0..nbc {
                let (c0, c1) = (bj * bc, ((bj + 1) * bc).min(k));
                let m = (r0..r1).fold(0u8, |m, r| {
                    self.codes[r * k + c0..r * k + c1]
                        .iter()
                        .fold(m, |a, &c| a.max(c & 0x7F))
                });
                let s = self.scales[bi * nbc + bj];
                let suspect = s == 255
                    || m == 0x7F
                    || !(e4m3_table()[m as usize] * scale_of(s)).is_finite()
                    || s < 3;
                if suspect {
                    if let Some(fault) = self.block_fault(bi, bj) {
                        return Err(BadBlock {
                            block_row: bi,
                            block_col: bj,
                            fault,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The first fault of block `(bi, bj)`, element by element.
    fn block_fault(&self, bi: usize, bj: usize) -> Option<BlockFault> {
        let s = self.scales[bi * self.block_cols() + bj];
        if s == 255 {
            return Some(BlockFault::NanScale);
        }
        let rows = self.rows();
        let (r0, r1) = (bi * self.br, ((bi + 1) * self.br).min(rows));
        let (c0, c1) = (bj * self.bc, ((bj + 1) * self.bc).min(self.k));
        for r in r0..r1 {
            for c in c0..c1 {
                let code = self.codes[r * self.k + c];
                if code & 0x7F == 0x7F {
                    return Some(BlockFault::NanCode(r, c));
                }
                let v = value_of(code, s);
                if !v.is_finite() {
                    return Some(BlockFault::Overflow(r, c));
                }
                if v.to_bits() & 0xFFFF != 0 {
                    return Some(BlockFault::Inexact(r, c));
                }
            }
        }
        None
    }

    /// [`Fp8Blocks::check`] as the library's error: `ERR_INVALID_DATA`
    /// naming `what`, the block (its rows and columns) and the element.
    pub fn check_err(&self, what: &str) -> Result<()> {
        self.check_err_from(0, what)
    }

    /// As [`Fp8Blocks::check_err`] for a band of a larger matrix that starts
    /// at its row `row0` (a multiple of `br`): blocks and elements are named
    /// by their place in the whole matrix.
    pub fn check_err_from(&self, row0: usize, what: &str) -> Result<()> {
        let Err(b) = self.check() else {
            return Ok(());
        };
        let (br, bc) = (self.br, self.bc);
        let s = self.scales[b.block_row * self.block_cols() + b.block_col];
        let (r0, c0) = (row0 + b.block_row * br, b.block_col * bc);
        let (r1, c1) = ((r0 + br).min(row0 + self.rows()), (c0 + bc).min(self.k));
        let code = |r: usize, c: usize| self.codes[(r - row0) * self.k + c];
        let b = BadBlock {
            block_row: b.block_row + row0 / br,
            fault: match b.fault {
                BlockFault::NanCode(r, c) => BlockFault::NanCode(r + row0, c),
                BlockFault::Overflow(r, c) => BlockFault::Overflow(r + row0, c),
                BlockFault::Inexact(r, c) => BlockFault::Inexact(r + row0, c),
                f => f,
            },
            ..b
        };
        let detail = match b.fault {
            BlockFault::NanScale => "its e8m0 scale is the NaN code 255".to_string(),
            BlockFault::NanCode(r, c) => format!("element ({r}, {c}) is an e4m3 NaN code"),
            BlockFault::Overflow(r, c) => format!(
                "element ({r}, {c}) (e4m3 code {:#04x} times 2^{}) overflows f32 and bf16",
                code(r, c),
                s as i32 - 127
            ),
            BlockFault::Inexact(r, c) => format!(
                "element ({r}, {c}) (e4m3 code {:#04x} times 2^{}) is below bf16's precision \
                 (not exactly representable in bf16)",
                code(r, c),
                s as i32 - 127
            ),
        };
        bail!(
            ErrInvalidData,
            "{what}: fp8 block ({}, {}) (rows {r0}..{r1}, columns {c0}..{c1}): {detail}",
            b.block_row,
            b.block_col
        )
    }
}

/// An e8m0 scale as f32 (NaN for the NaN code).
#[inline]
fn scale_of(s: u8) -> f32 {
    e8m0_to_f32(s).unwrap_or(f32::NAN)
}

/// `e4m3(code) * 2^(s - 127)` in f32 (exact unless it overflows).
#[inline]
pub fn value_of(code: u8, s: u8) -> f32 {
    e4m3_table()[code as usize] * scale_of(s)
}

/// An e8m0 scale code (not the NaN code 255: `set_layer` refuses it) as
/// f32, for the CPU kernels that convert block-scaled fp8 in registers.
#[inline(always)]
pub(crate) fn e8m0_scale(c: u8) -> f32 {
    f32::from_bits(if c == 0 {
        0x0040_0000
    } else {
        (c as u32) << 23
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m<'a>(codes: &'a [u8], scales: &'a [u8], k: usize, br: usize, bc: usize) -> Fp8Blocks<'a> {
        Fp8Blocks::new(codes, scales, k, br, bc).unwrap()
    }

    #[test]
    fn sizes_are_checked() {
        let codes = [0x38u8; 5 * 7];
        assert!(Fp8Blocks::new(&codes, &[127; 9], 7, 2, 3).is_ok()); // 3 x 3 blocks
        assert!(Fp8Blocks::new(&codes, &[127; 6], 7, 2, 3).is_err());
        assert!(Fp8Blocks::new(&codes, &[127; 9], 7, 0, 3).is_err());
        assert!(Fp8Blocks::new(&codes, &[127; 9], 7, 2, 0).is_err());
        assert!(Fp8Blocks::new(&codes, &[127; 9], 6, 2, 3).is_err());
        assert_eq!(fp8_block_scale_len(5, 7, 2, 3), Some(9));
    }

    #[test]
    fn values_are_code_times_the_block_scale() {
        // 3 rows of 5, blocks of 2 x 2: scales [2, 3].
        let codes: Vec<u8> = (0..15).map(|i| 0x30 + i as u8).collect();
        let scales = [120u8, 121, 122, 123, 124, 125];
        let w = m(&codes, &scales, 5, 2, 2);
        for o in 0..3 {
            for i in 0..5 {
                let s = scales[(o / 2) * 3 + i / 2];
                let want =
                    crate::formats::e4m3_to_f32(codes[o * 5 + i]) * 2f32.powi(s as i32 - 127);
                assert_eq!(w.value(o, i), want);
            }
        }
        let mut all = vec![0f32; 15];
        w.to_f32(0, &mut all);
        let mut part = vec![0f32; 9];
        w.to_f32(3, &mut part);
        assert_eq!(&all[3..12], &part[..]);
        assert_eq!(all[7], w.value(1, 2));
        assert!(w.check().is_ok());
    }

    #[test]
    fn the_first_bad_block_is_named() {
        // 4 rows of 4, blocks of 2 x 2.
        let mut codes = vec![0x38u8; 16];
        let mut scales = vec![127u8; 4];
        assert!(m(&codes, &scales, 4, 2, 2).check().is_ok());
        codes[3 * 4 + 1] = 0xFF; // block (1, 0)
        codes[2 * 4 + 3] = 0x7F; // block (1, 1)
        let e = m(&codes, &scales, 4, 2, 2).check().unwrap_err();
        assert_eq!(
            (e.block_row, e.block_col, e.fault),
            (1, 0, BlockFault::NanCode(3, 1))
        );
        scales[1] = 255; // block (0, 1) comes first
        let e = m(&codes, &scales, 4, 2, 2).check().unwrap_err();
        assert_eq!(
            (e.block_row, e.block_col, e.fault),
            (0, 1, BlockFault::NanScale)
        );
        // 448 * 2^127 overflows; 1.0 * 2^127 does not.
        let (mut codes, mut scales) = (vec![0x38u8; 16], vec![127u8; 4]);
        scales[2] = 254;
        assert!(m(&codes, &scales, 4, 2, 2).check().is_ok());
        codes[2 * 4 + 1] = 0x40; // 2.0 * 2^127
        let e = m(&codes, &scales, 4, 2, 2).check().unwrap_err();
        assert_eq!(
            (e.block_row, e.block_col, e.fault),
            (1, 0, BlockFault::Overflow(2, 1))
        );
        let msg = m(&codes, &scales, 4, 2, 2)
            .check_err("weights.wkv")
            .unwrap_err();
        assert_eq!(msg.status, EngramStatus::ErrInvalidData);
        assert!(
            msg.message
                .contains("block (1, 0) (rows 2..4, columns 0..2)"),
            "{}",
            msg.message
        );
        // Scale 2^-127: the e4m3 subnormal 2^-9 gives 2^-136, exact in f32 but
        // not in bf16; 1.0 gives 2^-127, exact in both; zero codes are fine.
        let (mut codes, mut scales) = (vec![0u8; 16], vec![127u8; 4]);
        scales[3] = 0;
        assert!(m(&codes, &scales, 4, 2, 2).check().is_ok());
        codes[2 * 4 + 2] = 0x38;
        assert!(m(&codes, &scales, 4, 2, 2).check().is_ok());
        codes[3 * 4 + 3] = 0x01;
        let e = m(&codes, &scales, 4, 2, 2).check().unwrap_err();
        assert_eq!(
            (e.block_row, e.block_col, e.fault),
            (1, 1, BlockFault::Inexact(3, 3))
        );
    }

    /// A band of a larger matrix names blocks and elements as the whole does.
    #[test]
    fn bands_name_blocks_in_the_whole_matrix() {
        // 8 rows of 4, blocks of 2 x 2; a NaN code at (5, 3): block (2, 1).
        let mut codes = vec![0x38u8; 32];
        codes[5 * 4 + 3] = 0x7F;
        let scales = vec![127u8; 8];
        let whole = m(&codes, &scales, 4, 2, 2).check_err("w").unwrap_err();
        let band = m(&codes[16..], &scales[4..], 4, 2, 2)
            .check_err_from(4, "w")
            .unwrap_err();
        assert_eq!(whole.message, band.message);
        assert!(whole
            .message
            .contains("block (2, 1) (rows 4..6, columns 2..4): element (5, 3)"));
    }

    /// The exactness claim: every code with every scale is exact in f32 (or
    /// overflows), and exact in bf16 unless `check` refuses it.
    #[test]
    fn every_code_and_scale() {
        for s in 0..255u8 {
            for c in 0..=255u8 {
                if c & 0x7F == 0x7F {
                    continue;
                }
                let v = value_of(c, s);
                let exact = crate::formats::e4m3_to_f32(c) as f64 * 2f64.powi(s as i32 - 127);
                if v.is_finite() {
                    assert_eq!(v as f64, exact, "code {c:#x} scale {s}");
                } else {
                    assert!(exact.abs() > f32::MAX as f64);
                }
                let codes = [c];
                let ok = m(&codes, &[s], 1, 1, 1).check().is_ok();
                let bf = crate::formats::bf16_to_f32(crate::formats::f32_to_bf16(v));
                assert_eq!(ok, v.is_finite() && bf == v, "code {c:#x} scale {s}");
            }
        }
    }
}
