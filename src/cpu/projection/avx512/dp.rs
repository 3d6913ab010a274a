//! bf16 and block-scaled fp8 weights by `vdpbf16ps` (the `avx512bf16`
//! kernel): the loops and order of [`super::range_bf16`], one instruction a
//! 32-value chunk instead of two FMAs and the widening.
//!
//! `vdpbf16ps` does, in each of its 16 lanes `j`, an FMA of the products of
//! elements `2j + 1` and then `2j` of its two bf16 operands into the f32
//! accumulator, each rounded to nearest even: the order of the FMA kernel,
//! with the same roundings. So it gives the FMA kernel's bits for every
//! input except where a value is subnormal: the instruction reads subnormal
//! bf16 inputs as zero and flushes a subnormal f32 result to zero (it
//! ignores MXCSR). Those differences are below `2^-126` a step, far under
//! the bf16 rounding of `kv` (docs/cpu.md). `tests` checks the equality on
//! this CPU; a CPU whose instruction rounded otherwise would fail it.
//!
//! Tokens are the bf16 rows as they are ([`pack_bf16`], in the FMA
//! kernel's block layout); bf16 weights are read as they are, the fp8 ones
//! converted to the same bf16 values in registers (exact, see
//! `formats::fp8_block`).

use super::{pair_offset, Micro, RB, T};
use crate::batch::try_vec;
use crate::error::Result;
use std::arch::x86_64::*;

/// How the `vdpbf16ps` tiles read a weight row: 32 values as bf16 pairs.
pub(super) trait DpW: Copy {
    type Row: Copy;
    fn row(self, o: usize) -> Self::Row;
    /// The bytes of row `o`'s chunks `c0..c1` (start, length), to prefetch.
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize);
    /// # Safety
    /// avx512f, avx512bw, avx512bf16, f16c; the chunk at `kk` lies in the
    /// row (a tail past `k` only for formats that mask it).
    unsafe fn chunk(row: Self::Row, kk: usize, k: usize) -> __m512bh;
    /// [`DpW::chunk`] for a tile of one token, where the widening is most of
    /// the work: the same bf16 values, so the same bits, possibly built
    /// another way.
    ///
    /// # Safety
    /// As [`DpW::chunk`].
    #[inline(always)]
    unsafe fn chunk_one(row: Self::Row, kk: usize, k: usize) -> __m512bh {
        // SAFETY: `chunk`'s contract is this function's.
        unsafe { Self::chunk(row, kk, k) }
    }
}

/// bf16 rows, loaded as they are.
#[derive(Clone, Copy)]
pub(super) struct Bf16D {
    pub w: *const u16,
    pub k: usize,
}

impl DpW for Bf16D {
    type Row = *const u16;
    #[inline(always)]
    fn row(self, o: usize) -> *const u16 {
        self.w.wrapping_add(o * self.k)
    }
    #[inline(always)]
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize) {
        let end = (c1 * 32).min(self.k);
        (
            self.row(o).wrapping_add(c0 * 32) as *const u8,
            2 * (end - c0 * 32),
        )
    }
    #[inline(always)]
    unsafe fn chunk(row: *const u16, kk: usize, k: usize) -> __m512bh {
        // SAFETY: `chunk`'s contract puts the chunk at `kk` in the row; a
        // chunk that runs past `k` (the last) is read with a masked load.
        unsafe {
            let v = if kk + 32 <= k {
                _mm512_loadu_si512(row.add(kk) as *const _)
            } else {
                let m: __mmask32 = ((1u64 << (k - kk)) - 1) as u32;
                _mm512_maskz_loadu_epi16(m, row.add(kk) as *const i16)
            };
            std::mem::transmute::<__m512i, __m512bh>(v)
        }
    }
}

/// Block-scaled fp8 rows as bf16 (exact: every value is a bf16), through
/// f32 ([`fp8_chunk_f32`]); for one token in integers ([`fp8_chunk_int`])
/// where the block's scale keeps every value normal.
#[derive(Clone, Copy)]
pub(super) struct Fp8D {
    pub codes: *const u8,
    pub scales: *const u8,
    pub k: usize,
    pub br: usize,
    pub nbc: usize,
    pub shift: u32,
}

impl DpW for Fp8D {
    /// The row's codes, its blocks' scales and the block shift.
    type Row = (*const u8, *const u8, u32);
    #[inline(always)]
    fn row(self, o: usize) -> Self::Row {
        (
            self.codes.wrapping_add(o * self.k),
            self.scales.wrapping_add((o / self.br) * self.nbc),
            self.shift,
        )
    }
    #[inline(always)]
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize) {
        let end = (c1 * 32).min(self.k);
        (self.codes.wrapping_add(o * self.k + c0 * 32), end - c0 * 32)
    }
    #[inline(always)]
    unsafe fn chunk(row: Self::Row, kk: usize, _k: usize) -> __m512bh {
        // SAFETY: the caller's contract: `kk + 32 <= k`, the row and its
        // scale row are in the matrix.
        unsafe {
            let (codes, srow, shift) = row;
            fp8_chunk_f32(codes.add(kk), *srow.add(kk >> shift))
        }
    }
    /// One token: the integer widening where the block's scale allows it
    /// (measured on a Zen 4 core with `wkv` in L2: 1.25x the f32 widening's
    /// rate at one token, 0.94x at four, where the `vdpbf16ps` of the four
    /// tokens share the vector ports with its integer operations).
    #[inline(always)]
    unsafe fn chunk_one(row: Self::Row, kk: usize, _k: usize) -> __m512bh {
        // SAFETY: as in `chunk`.
        unsafe {
            let (codes, srow, shift) = row;
            let scale = *srow.add(kk >> shift);
            if FP8_INT_SCALES.contains(&scale) {
                fp8_chunk_int(codes.add(kk), scale)
            } else {
                fp8_chunk_f32(codes.add(kk), scale)
            }
        }
    }
}

/// The e8m0 scales for which [`fp8_chunk_int`] builds the bf16 values in
/// integers: every nonzero code times `2^(scale - 127)` is a normal bf16
/// (the smallest, `2^-9`, stays at or above `2^-126` from 10 on; the
/// largest, `448`, below `2^128` up to 246). The checkpoint's are 2^-16..2^-9
/// (111..118). Others take [`fp8_chunk_f32`].
const FP8_INT_SCALES: std::ops::RangeInclusive<u8> = 10..=246;

/// 32 block-scaled fp8 codes at `codes` as bf16, built in 16-bit integer
/// lanes: a normal code `s eeee mmm` is the bf16 `s, e + scale - 7, mmm0000`
/// (the exponent moved to bf16's bias and the scale's added), a subnormal
/// one (`e = 0`) the bf16 of `m * 2^-9` from a table with the scale added to
/// its exponent, a zero stays a (signed) zero. The same bits as
/// [`fp8_chunk_f32`] for scales in [`FP8_INT_SCALES`] (both exact; the
/// unit test compares every code at every such scale), in about two thirds
/// of its instructions and none on the FP multiply ports.
///
/// # Safety
/// avx512f, avx512bw; 32 bytes at `codes`; `scale` in [`FP8_INT_SCALES`].
#[inline(always)]
unsafe fn fp8_chunk_int(codes: *const u8, scale: u8) -> __m512bh {
    // SAFETY: the 32-byte load is this function's contract.
    unsafe {
        let x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(codes as *const __m256i));
        // bf16 of a normal magnitude, unscaled: (|code| << 4) + (120 << 7).
        let mag = _mm512_and_si512(_mm512_slli_epi16::<4>(x), _mm512_set1_epi16(0x7F0));
        let normal = _mm512_add_epi16(mag, _mm512_set1_epi16(120 << 7));
        // bf16 of m * 2^-9 for the subnormal codes, indexed by m (the code's
        // low 5 bits, whose exponent bits are zero there).
        let sub_bits = _mm512_set_epi16(
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, //
            0, 0, 0, 0, 0, 0, 0, 0, //
            0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0,
        );
        let sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));
        let unscaled = _mm512_mask_permutexvar_epi16(normal, sub, x, sub_bits);
        // The scale into the exponent of every nonzero value; zeros stay 0.
        let nonzero = _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x7F));
        let es = _mm512_set1_epi16(((scale as i16) - 127) << 7);
        let scaled = _mm512_maskz_add_epi16(nonzero, unscaled, es);
        // The sign: bit 15 from the code's bit 7 (0xD8: c ? b : a, bitwise).
        let sign = _mm512_slli_epi16::<8>(x);
        let v =
            _mm512_ternarylogic_epi32::<0xD8>(scaled, sign, _mm512_set1_epi16(0x8000u16 as i16));
        std::mem::transmute::<__m512i, __m512bh>(v)
    }
}

/// 32 block-scaled fp8 codes at `codes` as bf16, through f32: widened as
/// the FMA kernel's `Fp8W` does (f16 bit patterns, F16C, times `2^8` and
/// the block's scale: exact), then narrowed by `vcvtne2ps2bf16` (exact:
/// every value is a bf16; a subnormal one, only at scales below
/// [`FP8_INT_SCALES`], flushed to zero as `vdpbf16ps` would read it).
///
/// # Safety
/// avx512f, avx512bw, avx512bf16, f16c; 32 bytes at `codes`.
#[inline(always)]
unsafe fn fp8_chunk_f32(codes: *const u8, scale: u8) -> __m512bh {
    // SAFETY: the two 16-byte loads are this function's contract.
    unsafe {
        let s = _mm512_mul_ps(
            _mm512_set1_ps(crate::formats::fp8_block::e8m0_scale(scale)),
            _mm512_set1_ps(256.0),
        );
        // Codes 0..16 and 16..32, each byte into the top of a word, then
        // the f16 pattern `s 0 eeee mmm 0000000` (value times 2^-8).
        let m = _mm256_set1_epi16(0xBF80u16 as i16);
        let w0 = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(
            codes as *const __m128i,
        )));
        let w1 = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(
            codes.add(16) as *const __m128i
        )));
        let lo = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16::<1>(w0), m)),
            s,
        );
        let hi = _mm512_mul_ps(
            _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16::<1>(w1), m)),
            s,
        );
        _mm512_cvtne2ps_pbh(hi, lo)
    }
}

/// Rows `lo..hi` of `w` widened to their bf16 values (exact) into `out`
/// (`[hi - lo, k]`), converted as [`Fp8D::chunk`] converts them.
///
/// # Safety
/// avx512f, avx512bw, avx512bf16, f16c; `k` a multiple of 32; rows
/// `lo..hi` in the matrix.
#[inline(always)]
pub(super) unsafe fn widen_fp8(w: Fp8D, lo: usize, hi: usize, out: &mut [u16]) {
    // SAFETY: the features and rows `lo..hi` are this function's contract;
    // each store is one row of `out`, whose length is asserted below.
    unsafe {
        assert!(out.len() == (hi - lo) * w.k && w.k.is_multiple_of(32));
        for o in lo..hi {
            let row = w.row(o);
            let dst = out.as_mut_ptr().add((o - lo) * w.k);
            let mut kk = 0;
            while kk < w.k {
                let v = Fp8D::chunk(row, kk, w.k);
                _mm512_storeu_si512(
                    dst.add(kk) as *mut _,
                    std::mem::transmute::<__m512bh, __m512i>(v),
                );
                kk += 32;
            }
        }
    }
}

/// The `vdpbf16ps` tile of [`super::Micro`].
#[derive(Clone, Copy)]
pub(super) struct Dp<W>(pub W);

impl<W: DpW> Micro for Dp<W> {
    type X = u16;
    type Row = W::Row;
    #[inline(always)]
    fn row(self, o: usize) -> W::Row {
        self.0.row(o)
    }
    #[inline(always)]
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize) {
        self.0.span(o, c0, c1)
    }
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
    unsafe fn tile<const RR: usize, const TT: usize>(
        wp: &[W::Row; RB],
        xp: &[*const u16; T],
        k: usize,
        c0: usize,
        c1: usize,
        acc: *mut __m512,
    ) {
        // SAFETY: the caller's contract (`super::range_pairs`): rows and
        // tokens hold chunks `c0..c1`, `acc` holds the tile's accumulators.
        unsafe {
            let mut a = [[_mm512_setzero_ps(); TT]; RR];
            for i in 0..RR {
                for j in 0..TT {
                    a[i][j] = *acc.add(j * RB + i);
                }
            }
            for c in c0..c1 {
                let kk = c * 32;
                let mut x = [_mm512_setzero_ps(); TT];
                for j in 0..TT {
                    x[j] = _mm512_loadu_ps(xp[j].add((c - c0) * 32) as *const f32);
                }
                for i in 0..RR {
                    let wv = if TT == 1 {
                        W::chunk_one(wp[i], kk, k)
                    } else {
                        W::chunk(wp[i], kk, k)
                    };
                    for j in 0..TT {
                        let xj = std::mem::transmute::<__m512, __m512bh>(x[j]);
                        a[i][j] = _mm512_dpbf16_ps(a[i][j], wv, xj);
                    }
                }
            }
            for i in 0..RR {
                for j in 0..TT {
                    *acc.add(j * RB + i) = a[i][j];
                }
            }
        }
    }
}

/// Token rows (bf16 bits, `[n, k]`) in the block layout of
/// [`super::pair_split`], values in their own order (bf16 pairs as
/// `vdpbf16ps` reads them); zero past `k`.
pub(crate) fn pack_bf16(rows: &[u16], n: usize, k: usize) -> Result<Vec<u16>> {
    let chunks = k.div_ceil(32);
    let mut xs = try_vec(n * chunks * 32, 0u16, "the token rows")?;
    for (t, r) in rows.chunks_exact(k).enumerate() {
        for c in 0..chunks {
            let src = &r[c * 32..(c * 32 + 32).min(k)];
            xs[pair_offset(n, chunks, t, c)..][..src.len()].copy_from_slice(src);
        }
    }
    Ok(xs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code but the NaNs, at every scale the integer widening takes,
    /// gives the f32 widening's bf16 bits; a scale outside that range is
    /// kept out of it (the f32 path flushes what would be subnormal).
    #[test]
    fn the_integer_fp8_widening_gives_the_f32_widenings_bits() {
        if !(is_x86_feature_detected!("avx512bf16")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("f16c"))
        {
            eprintln!("no avx512bf16 here: skipped");
            return;
        }
        let codes: Vec<u8> = (0..=255u8).filter(|c| c & 0x7F != 0x7F).collect();
        let mut checked = 0;
        for scale in FP8_INT_SCALES {
            for chunk in codes.chunks(32) {
                let mut c = [0u8; 32];
                c[..chunk.len()].copy_from_slice(chunk);
                // SAFETY: this CPU has avx512bf16, avx512bw and f16c
                // (checked above; avx512bw implies avx512f); 32 bytes at `c`.
                let (a, b) = unsafe {
                    (
                        fp8_chunk_int(c.as_ptr(), scale),
                        fp8_chunk_f32(c.as_ptr(), scale),
                    )
                };
                // SAFETY: both are 32 bf16 bit patterns.
                let (a, b) = unsafe {
                    (
                        std::mem::transmute::<__m512bh, [u16; 32]>(a),
                        std::mem::transmute::<__m512bh, [u16; 32]>(b),
                    )
                };
                assert_eq!(a, b, "scale {scale} codes {c:?}");
                checked += chunk.len();
            }
        }
        assert_eq!(checked, 254 * FP8_INT_SCALES.count());
        // The range is the widest where every nonzero value is a normal bf16:
        // the smallest, 2^-9 times the scale, and the largest, 448 times it.
        let (lo, hi) = (
            *FP8_INT_SCALES.start() as i32 - 127,
            *FP8_INT_SCALES.end() as i32 - 127,
        );
        assert!(lo - 9 >= -126 && lo - 1 - 9 < -126);
        let max = |e: i32| 448.0 * 2f64.powi(e);
        assert!(max(hi) < 2f64.powi(128) && max(hi + 1) >= 2f64.powi(128));
    }
}
