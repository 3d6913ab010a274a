//! GGUF blocks: one home per block format. Each format has here, and nowhere
//! else, its typed block (a `#[repr(C)]` struct laid out as ggml's C struct,
//! its size checked at compile time), its values and bytes per block
//! ([`GgmlBlock`]), the byte offsets of its fields (for the SIMD readers,
//! which address a block by pointer), and its reference dequantisation.
//!
//! Each `dequant` reads one block and writes its values in ggml's element
//! order. The arithmetic is f32 with one rounding per operation, in ggml's
//! order (`dequantize_row_*` in ggml-quants.c); Rust never fuses a multiply
//! and an add, so these are the values of an unfused ggml build (and of
//! gguf-py's numpy dequantisers).
//!
//! Names: a format is ggml's name (`Q4_K`) as an [`EngramType`] variant and
//! in prose; its block type is `Block` + that name in CamelCase
//! (`BlockQ4K`), and a function about it uses it in snake case (`q4_k`).

use super::EngramType;
use std::mem::{align_of, offset_of, size_of};

// The constants below are `pub(crate)`: cbindgen renders every `pub` const
// into the C header, and these are no part of the C API.

/// Values per block of the 32-value formats (ggml's `QK4_0`, `QK8_0`).
pub(crate) const QK: usize = 32;
/// Values per block of the K-quants (ggml's `QK_K`).
pub(crate) const QK_K: usize = 256;
/// Bytes of the packed 6-bit scales of `Q3_K`, `Q4_K` and `Q5_K` (ggml's
/// `K_SCALE_SIZE`).
pub(crate) const K_SCALE_SIZE: usize = 12;

/// One block of a GGUF block format, as its bytes lie in a row.
///
/// Implemented only in this module (the trait is sealed), and only for
/// `#[repr(C)]` structs of byte arrays, each asserted at compile time to
/// have alignment 1 and the size ggml gives the format: so any
/// [`Self::BYTES`] readable bytes, at any address, are a valid `Self`.
pub trait GgmlBlock: Copy + sealed::Sealed {
    /// The format.
    const TYPE: EngramType;
    /// Values per block.
    const VALUES: usize;
    /// Bytes per block (the struct's size: no padding).
    const BYTES: usize = size_of::<Self>();

    /// The block that is exactly the bytes `b` (panics if `b` is not
    /// [`Self::BYTES`] long).
    #[inline]
    fn view(b: &[u8]) -> &Self {
        assert_eq!(b.len(), Self::BYTES, "{} block", Self::TYPE.name());
        // SAFETY: `b` is `BYTES = size_of::<Self>()` bytes (checked just
        // above); `Self` has alignment 1 and only byte-array fields (both
        // asserted where the sealed trait is implemented), so every address
        // is aligned for it and every bit pattern is a valid value.
        unsafe { &*(b.as_ptr() as *const Self) }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Implements [`GgmlBlock`] for `$t` (format `$ty`, `$values` values) and
/// checks at compile time that it has alignment 1 and is `$bytes` bytes,
/// the size of ggml's struct.
macro_rules! ggml_block {
    ($t:ty, $ty:ident, $values:expr, $bytes:literal) => {
        impl sealed::Sealed for $t {}
        impl GgmlBlock for $t {
            const TYPE: EngramType = EngramType::$ty;
            const VALUES: usize = $values;
        }
        const _: () = assert!(size_of::<$t>() == $bytes && align_of::<$t>() == 1);
    };
}

/// An f16 stored little-endian, widened exactly.
#[inline]
fn f16_le(b: [u8; 2]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

/// `Q8_0`: `y = qs * d`. 34 bytes per 32 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; QK],
}
ggml_block!(BlockQ8_0, Q8_0, QK, 34);

impl BlockQ8_0 {
    /// Byte offset of `qs` (`d` is at 0).
    pub const QS: usize = offset_of!(Self, qs);

    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK]) {
        let d = f16_le(self.d);
        for (o, &q) in y.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

/// `Q4_0`: `y = (q - 8) * d`; byte `j` of `qs` holds value `j` (low nibble)
/// and `j + 16` (high). 18 bytes per 32 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}
ggml_block!(BlockQ4_0, Q4_0, QK, 18);

impl BlockQ4_0 {
    /// Byte offset of `qs` (`d` is at 0).
    pub const QS: usize = offset_of!(Self, qs);

    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK]) {
        let d = f16_le(self.d);
        let (lo, hi) = y.split_at_mut(QK / 2);
        for (j, &q) in self.qs.iter().enumerate() {
            lo[j] = ((q & 0xF) as i32 - 8) as f32 * d;
            hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// `Q2_K`: 16 sub-blocks of 16 values, 2-bit codes. 84 bytes per 256 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ2K {
    /// Sub-block `s`'s scale (low nibble) and min (high nibble).
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}
ggml_block!(BlockQ2K, Q2_K, QK_K, 84);

impl BlockQ2K {
    /// Byte offsets of the fields (`scales` is at 0).
    pub const QS: usize = offset_of!(Self, qs);
    pub const D: usize = offset_of!(Self, d);
    pub const DMIN: usize = offset_of!(Self, dmin);

    /// Each half (128 values) reads 32 bytes of `qs`; its four groups of 32
    /// take the 2-bit fields at shifts 0, 2, 4, 6. Sub-block `s` (16 values)
    /// has the scale byte `scales[s]`: low nibble times `d`, high nibble
    /// times `dmin`; `y = (d * sc) * q - (dmin * m)`.
    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK_K]) {
        let d = f16_le(self.d);
        let dmin = f16_le(self.dmin);
        for (s, ys) in y.chunks_exact_mut(16).enumerate() {
            let sc = self.scales[s];
            let dl = d * (sc & 0xF) as f32;
            let ml = dmin * (sc >> 4) as f32;
            let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
            let q = &self.qs[32 * half + 16 * part..][..16];
            for (o, &qb) in ys.iter_mut().zip(q) {
                *o = dl * ((qb >> (2 * group)) & 3) as f32 - ml;
            }
        }
    }
}

/// `Q3_K`: 16 sub-blocks of 16 values, 2-bit codes with a third bit in
/// `hmask`, 6-bit scales. 110 bytes per 256 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; K_SCALE_SIZE],
    pub d: [u8; 2],
}
ggml_block!(BlockQ3K, Q3_K, QK_K, 110);

impl BlockQ3K {
    /// Byte offsets of the fields (`hmask` is at 0).
    pub const QS: usize = offset_of!(Self, qs);
    pub const SCALES: usize = offset_of!(Self, scales);
    pub const D: usize = offset_of!(Self, d);

    /// Like `Q2_K` for the low 2 bits; `hmask[l]` bit `4 * half + group` set
    /// means no offset, clear means `-4`; `y = (d * (sc - 32)) * q`.
    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK_K]) {
        let d = f16_le(self.d);
        for (s, ys) in y.chunks_exact_mut(16).enumerate() {
            let dl = d * q3_k_scale(&self.scales, s) as f32;
            let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
            let q = &self.qs[32 * half + 16 * part..][..16];
            let h = &self.hmask[16 * part..][..16];
            let bit = 1u8 << (4 * half + group);
            for ((o, &qb), &hb) in ys.iter_mut().zip(q).zip(h) {
                let v = ((qb >> (2 * group)) & 3) as i32 - if hb & bit != 0 { 0 } else { 4 };
                *o = dl * v as f32;
            }
        }
    }
}

/// The 6-bit scales of `Q3_K`: value `s` has its low 4 bits in `scales[s]`
/// (s < 8, low nibble) or `scales[s - 8]` (high nibble) and its high 2 bits in
/// `scales[8 + s % 4]` at bit `2 * (s / 4)`; the scale is that minus 32.
#[inline]
fn q3_k_scale(sc: &[u8], s: usize) -> i32 {
    let lo = if s < 8 { sc[s] & 0xF } else { sc[s - 8] >> 4 };
    let hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

/// `Q4_K`: 8 sub-blocks of 32 values, 4-bit codes, 6-bit scales and mins.
/// 144 bytes per 256 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// Packed as [`scale_min_k4`] reads them.
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
ggml_block!(BlockQ4K, Q4_K, QK_K, 144);

impl BlockQ4K {
    /// Byte offsets of the fields (`d` is at 0).
    pub const DMIN: usize = offset_of!(Self, dmin);
    pub const SCALES: usize = offset_of!(Self, scales);
    pub const QS: usize = offset_of!(Self, qs);

    /// Sub-block `s` (32 values) reads `qs[32 * (s / 2)..][..32]`, low
    /// nibbles for even `s`, high for odd; `y = (d * sc) * q - (dmin * m)`.
    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK_K]) {
        let d = f16_le(self.d);
        let dmin = f16_le(self.dmin);
        for (s, ys) in y.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(&self.scales, s);
            let d1 = d * sc as f32;
            let m1 = dmin * m as f32;
            let q = &self.qs[32 * (s / 2)..][..32];
            let shift = 4 * (s % 2);
            for (o, &qb) in ys.iter_mut().zip(q) {
                *o = d1 * ((qb >> shift) & 0xF) as f32 - m1;
            }
        }
    }
}

/// The packed 6-bit (scale, min) pair `j` of `Q4_K` / `Q5_K` (ggml's
/// `get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        (
            (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
        )
    }
}

/// `Q5_K`: `Q4_K` plus a fifth bit per value in `qh`. 176 bytes per 256
/// values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    /// Packed as [`scale_min_k4`] reads them.
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
ggml_block!(BlockQ5K, Q5_K, QK_K, 176);

impl BlockQ5K {
    /// Byte offsets of the fields (`d` is at 0).
    pub const DMIN: usize = offset_of!(Self, dmin);
    pub const SCALES: usize = offset_of!(Self, scales);
    pub const QH: usize = offset_of!(Self, qh);
    pub const QS: usize = offset_of!(Self, qs);

    /// As `Q4_K`, plus the fifth bit: bit `s` of `qh[l]` adds 16.
    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK_K]) {
        let d = f16_le(self.d);
        let dmin = f16_le(self.dmin);
        for (s, ys) in y.chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(&self.scales, s);
            let d1 = d * sc as f32;
            let m1 = dmin * m as f32;
            let q = &self.qs[32 * (s / 2)..][..32];
            let shift = 4 * (s % 2);
            for ((o, &qb), &hb) in ys.iter_mut().zip(q).zip(&self.qh) {
                let v = ((qb >> shift) & 0xF) as u32 + if hb & (1 << s) != 0 { 16 } else { 0 };
                *o = d1 * v as f32 - m1;
            }
        }
    }
}

/// `Q6_K`: 16 sub-blocks of 16 values, 6-bit codes (4 in `ql`, 2 in `qh`),
/// signed 8-bit scales. 210 bytes per 256 values.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: [u8; 2],
}
ggml_block!(BlockQ6K, Q6_K, QK_K, 210);

impl BlockQ6K {
    /// Byte offsets of the fields (`ql` is at 0).
    pub const QH: usize = offset_of!(Self, qh);
    pub const SCALES: usize = offset_of!(Self, scales);
    pub const D: usize = offset_of!(Self, d);

    /// Each half (128 values) reads `ql[64 * half..][..64]` and
    /// `qh[32 * half..][..32]`; its group `g` of 32 values takes the low
    /// (g = 0, 1) or high (g = 2, 3) nibbles of `ql[32 * (g % 2)..][..32]`
    /// and the 2 bits of `qh` at shift `2 * g`; `q` is that 6-bit value minus
    /// 32 and `y = (d * sc) * q` with the signed scale `scales[s]` of
    /// sub-block `s` (16 values).
    #[inline]
    pub fn dequant(&self, y: &mut [f32; QK_K]) {
        let d = f16_le(self.d);
        for (s, ys) in y.chunks_exact_mut(16).enumerate() {
            let sd = d * self.scales[s] as f32;
            let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
            let l0 = 16 * part;
            let lq = &self.ql[64 * half + 32 * (group % 2) + l0..][..16];
            let hq = &self.qh[32 * half + l0..][..16];
            let shift = 4 * (group / 2);
            for ((o, &lb), &hb) in ys.iter_mut().zip(lq).zip(hq) {
                let v = (((lb >> shift) & 0xF) | (((hb >> (2 * group)) & 3) << 4)) as i32 - 32;
                *o = sd * v as f32;
            }
        }
    }
}

/// Dequantise one block of a GGUF block format (`blk` is its bytes, `out` its
/// `block().0` values).
pub fn dequant_block_f32(fmt: EngramType, blk: &[u8], out: &mut [f32]) {
    match fmt {
        EngramType::Q8_0 => BlockQ8_0::view(blk).dequant(out.try_into().unwrap()),
        EngramType::Q4_0 => BlockQ4_0::view(blk).dequant(out.try_into().unwrap()),
        EngramType::Q2_K => BlockQ2K::view(blk).dequant(out.try_into().unwrap()),
        EngramType::Q3_K => BlockQ3K::view(blk).dequant(out.try_into().unwrap()),
        EngramType::Q4_K => BlockQ4K::view(blk).dequant(out.try_into().unwrap()),
        EngramType::Q5_K => BlockQ5K::view(blk).dequant(out.try_into().unwrap()),
        EngramType::Q6_K => BlockQ6K::view(blk).dequant(out.try_into().unwrap()),
        other => panic!("{} is not a block format", other.name()),
    }
}

/// Random rows of `f` (f16 or a GGUF block format), `len` bytes: every
/// code, and f16 values (an f16 row's values, a block's scales) finite, of
/// all magnitudes, subnormals included (tests of the kernels that decode
/// these formats against [`dequant_block_f32`]).
#[cfg(test)]
pub(crate) fn random_blocks(f: EngramType, len: usize, seed: u64) -> Vec<u8> {
    let mut z = seed;
    let mut data: Vec<u8> = (0..len)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 56) as u8
        })
        .collect();
    // Where each format keeps its f16 values: (bytes per unit, the f16s'
    // offsets); the high byte (sign, exponent) is the one made finite.
    let (bb, at): (usize, &[usize]) = match f {
        EngramType::F16 => (2, &[0]),
        EngramType::Q8_0 => (BlockQ8_0::BYTES, &[0]),
        EngramType::Q4_0 => (BlockQ4_0::BYTES, &[0]),
        EngramType::Q2_K => (BlockQ2K::BYTES, &[BlockQ2K::D, BlockQ2K::DMIN]),
        EngramType::Q3_K => (BlockQ3K::BYTES, &[BlockQ3K::D]),
        EngramType::Q4_K => (BlockQ4K::BYTES, &[0, BlockQ4K::DMIN]),
        EngramType::Q5_K => (BlockQ5K::BYTES, &[0, BlockQ5K::DMIN]),
        EngramType::Q6_K => (BlockQ6K::BYTES, &[BlockQ6K::D]),
        other => panic!("{} is not f16 or a block format", other.name()),
    };
    for blk in data.chunks_mut(bb) {
        for &i in at {
            if blk[i + 1] & 0x7C == 0x7C {
                blk[i + 1] ^= 0x04;
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::dequant_row_f32;

    /// Every block's size and field offsets are ggml's (`block_*` in
    /// ggml-common.h), and its values per block those of [`GGML_BLOCKS`].
    #[test]
    fn blocks_are_laid_out_as_ggml_lays_them_out() {
        fn sizes<B: GgmlBlock>() -> (usize, usize) {
            (B::VALUES, B::BYTES)
        }
        let all = [
            sizes::<BlockQ8_0>(),
            sizes::<BlockQ4_0>(),
            sizes::<BlockQ2K>(),
            sizes::<BlockQ3K>(),
            sizes::<BlockQ4K>(),
            sizes::<BlockQ5K>(),
            sizes::<BlockQ6K>(),
        ];
        let want = [
            (32, 34),
            (32, 18),
            (256, 84),
            (256, 110),
            (256, 144),
            (256, 176),
            (256, 210),
        ];
        assert_eq!(all, want);
        for (t, (v, b)) in [
            EngramType::Q8_0,
            EngramType::Q4_0,
            EngramType::Q2_K,
            EngramType::Q3_K,
            EngramType::Q4_K,
            EngramType::Q5_K,
            EngramType::Q6_K,
        ]
        .into_iter()
        .zip(want)
        {
            assert_eq!(
                crate::formats::ggml_block(t as u32),
                Some((v, b)),
                "{}",
                t.name()
            );
            assert_eq!(t.block(), Some((v, b)), "{}", t.name());
        }
        assert_eq!(BlockQ8_0::QS, 2);
        assert_eq!(BlockQ4_0::QS, 2);
        assert_eq!((BlockQ2K::QS, BlockQ2K::D, BlockQ2K::DMIN), (16, 80, 82));
        assert_eq!((BlockQ3K::QS, BlockQ3K::SCALES, BlockQ3K::D), (32, 96, 108));
        assert_eq!((BlockQ4K::DMIN, BlockQ4K::SCALES, BlockQ4K::QS), (2, 4, 16));
        let q5 = (BlockQ5K::DMIN, BlockQ5K::SCALES, BlockQ5K::QH, BlockQ5K::QS);
        assert_eq!(q5, (2, 4, 16, 48));
        assert_eq!(
            (BlockQ6K::QH, BlockQ6K::SCALES, BlockQ6K::D),
            (128, 192, 208)
        );
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
        dequant_row_f32(EngramType::Q4_0, &b, &mut y).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 8.0);
            assert_eq!(y[16 + j], 7.0 - j as f32);
        }
        let mut b = [0u8; 34];
        b[0..2].copy_from_slice(&0xc000u16.to_le_bytes()); // d = -2
        for j in 0..32 {
            b[2 + j] = (j as u8).wrapping_mul(8);
        }
        dequant_row_f32(EngramType::Q8_0, &b, &mut y).unwrap();
        for (j, &v) in y.iter().enumerate() {
            assert_eq!(v, -2.0 * ((j as u8).wrapping_mul(8) as i8) as f32);
        }
    }
}
