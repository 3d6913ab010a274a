//! f32, f16 and the GGUF block formats in the AVX-512 kernel's order,
//! dequantised in registers.
//!
//! A row is read a block at a time ([`QSrc`]): the block's scales are set up
//! once, then each chunk of 32 values comes out as its 16 odd-indexed and 16
//! even-indexed values as f32, the order of [`super::range_bf16`] (lane `j`
//! of a sum takes element `2j + 1`, then `2j`, of every chunk, one FMA each,
//! chunk after chunk; the 16 lanes are then added by [`super::hsum`]).
//!
//! The values are those of `formats::dequant_row_f32` bit for bit: every
//! ggml dequantisation is a product that is exact in f32 followed by at
//! most one rounded operation, and each source here rounds that same exact
//! value once. So a quantised `wkv` gives the bits of an f32 `wkv` holding
//! its dequantised values, and an f32 `wkv` holding bf16 values the bits of
//! the bf16 `wkv`.
//!
//! **Lookups.** A sub-block's codes take few values (16 for a 4-bit code, 4
//! for `Q2_K`, 8 for `Q3_K`, 32 for `Q5_K`), so its values `dl * q - ml` for every
//! code are one FMA (a table in one or two registers) and 16 weights one
//! `vpermps` (`vpermt2ps` for 32 entries), indexed by the code bits where
//! they lie in the block: the permute reads only the low 4 (5) bits of each
//! index, so a shift is usually all a code needs. `Q8_0` and `Q6_K` (256 and 64
//! codes) are converted and multiplied.
//!
//! **Two forms, the same sums.** For a few tokens ([`dot_range`]) the chunks
//! are decoded in registers and multiplied straight into each token's
//! accumulators. For batches ([`panel_range`]) a row tile's k block is
//! decoded once into a small f32 panel (L1) and the bf16 kernel's tiles
//! ([`super::pairs`]) run over it for every token of the block.

use super::{hsum, pair_offset, pairs, PairW, KBC, RB, T, TB};
use crate::cpu::projection::avx2::sources::unpack_scales_k4;
use crate::error::Result;
use crate::formats::ggml::K_SCALE_SIZE;
use crate::formats::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0, GgmlBlock,
};
use std::arch::x86_64::*;

/// How a weight row is read: blocks of `BV` values in `BB` bytes; each
/// block's chunks of 32 values as (odd elements, even elements).
pub(super) trait QSrc: Copy {
    /// Values per block (a multiple of 32).
    const BV: usize;
    /// Bytes per block.
    const BB: usize;
    /// What a block's chunks share (its scales), set up once per block.
    type St: Copy;
    /// # Safety
    /// avx512f, avx512bw, f16c; `blk` points at a whole block.
    unsafe fn setup(blk: *const u8) -> Self::St;
    /// Chunk `c` (`c < BV / 32`) of the block at `blk`.
    ///
    /// # Safety
    /// As `setup`, with `st` the block's own state.
    unsafe fn chunk(blk: *const u8, st: &Self::St, c: usize) -> (__m512, __m512);
    /// Chunks `c` and `c + 1` (`c` even, `c + 1 < BV / 32`), for formats
    /// whose neighbouring chunks share their code bytes.
    ///
    /// # Safety
    /// As `chunk`.
    #[inline(always)]
    unsafe fn chunk2(blk: *const u8, st: &Self::St, c: usize) -> [(__m512, __m512); 2] {
        // SAFETY: `c` and `c + 1` are both chunks of the block (`c + 1 <
        // BV / 32`, this function's contract), and the rest of `chunk`'s
        // contract (the features, the whole block, its state) is this one's.
        unsafe { [Self::chunk(blk, st, c), Self::chunk(blk, st, c + 1)] }
    }
}

/// 32 bytes at `p` as 16 dwords: dword `j` holds byte `2j` in bits 0..8 and
/// byte `2j + 1` in bits 8..16.
///
/// # Safety
/// 32 readable bytes at `p`; the CPU has avx512f.
#[inline(always)]
unsafe fn words(p: *const u8) -> __m512i {
    // SAFETY: the unaligned 32-byte load reads exactly the bytes this
    // function's contract makes readable; the widening needs avx512f, which
    // it promises too.
    unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)) }
}

/// The f16 at `p` in all 16 lanes, exactly.
///
/// # Safety
/// Two readable bytes at `p`; the CPU has avx512f.
#[inline(always)]
unsafe fn f16x16(p: *const u8) -> __m512 {
    // SAFETY: the unaligned read takes just the two bytes at `p`, readable
    // by this function's contract, which also promises the avx512f that the
    // 16-lane conversion needs.
    unsafe { _mm512_cvtph_ps(_mm256_set1_epi16((p as *const i16).read_unaligned())) }
}

/// The odd elements' indices in 32 values `[a | b]`.
#[inline(always)]
unsafe fn odd_idx() -> __m512i {
    // SAFETY: register constants only.
    unsafe { _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31) }
}

/// The even elements' indices in 32 values `[a | b]`.
#[inline(always)]
unsafe fn even_idx() -> __m512i {
    // SAFETY: register constants only.
    unsafe { _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) }
}

/// `0, 1, .. 15` as f32.
#[inline(always)]
unsafe fn iota16() -> __m512 {
    // SAFETY: register constants only.
    unsafe {
        _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        )
    }
}

/// Index of sub-block `a` in lanes 0..8 and `a + 1` in lanes 8..16 (for the
/// formats whose 16-value sub-blocks split a chunk in two).
#[inline(always)]
unsafe fn pair_lanes(a: usize) -> __m512i {
    // SAFETY: register arithmetic only.
    unsafe {
        _mm512_add_epi32(
            _mm512_set1_epi32(a as i32),
            _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        )
    }
}

/// `(c ? b : a)` bit by bit (`vpternlogd` 0xD8).
const MUX: i32 = 0xD8;
/// `(a & b) | c` bit by bit (`vpternlogd` 0xEA).
const AND_OR: i32 = 0xEA;

/// f32 rows (an f32 `wkv`, or rows of any other format dequantised into a
/// buffer by the reference code).
#[derive(Clone, Copy)]
pub(super) struct F32;

impl QSrc for F32 {
    const BV: usize = 32;
    const BB: usize = 32 * size_of::<f32>();
    type St = ();
    #[inline(always)]
    unsafe fn setup(_: *const u8) {}
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, _: &(), _: usize) -> (__m512, __m512) {
        // SAFETY: an f32 "block" is one chunk, 32 values (`BB` = 128 bytes)
        // at `blk`, readable by `chunk`'s contract (a whole block): two
        // 16-lane loads; avx512f by the same contract.
        unsafe {
            let p = blk as *const f32;
            let (a, b) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
            (
                _mm512_permutex2var_ps(a, odd_idx(), b),
                _mm512_permutex2var_ps(a, even_idx(), b),
            )
        }
    }
}

/// f16 rows (ds4's GGUFs carry `wkv` so): widened exactly.
#[derive(Clone, Copy)]
pub(super) struct F16;

impl QSrc for F16 {
    const BV: usize = 32;
    const BB: usize = 32 * size_of::<half::f16>();
    type St = ();
    #[inline(always)]
    unsafe fn setup(_: *const u8) {}
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, _: &(), _: usize) -> (__m512, __m512) {
        // SAFETY: an f16 "block" is one chunk, 32 values (`BB` = 64 bytes)
        // at `blk`, readable by `chunk`'s contract (a whole block): one
        // 64-byte load; avx512f and f16c by the same contract.
        unsafe {
            let v = _mm512_loadu_si512(blk as *const _);
            (
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v))),
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)),
            )
        }
    }
}

/// `Q8_0`: `q * d`.
#[derive(Clone, Copy)]
pub(super) struct Q8_0;

impl QSrc for Q8_0 {
    const BV: usize = BlockQ8_0::VALUES;
    const BB: usize = BlockQ8_0::BYTES;
    type St = __m512;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> __m512 {
        // SAFETY: the block's f16 `d` is its first two bytes.
        unsafe { f16x16(blk) }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, d: &__m512, _: usize) -> (__m512, __m512) {
        // SAFETY: the 32 codes at `QS` end at `BYTES`, inside the whole
        // block at `blk` (`chunk`'s contract).
        unsafe {
            // Each dword: code 2j sign-extended with code 2j + 1 above it.
            let w =
                _mm512_cvtepi16_epi32(_mm256_loadu_si256(blk.add(BlockQ8_0::QS) as *const __m256i));
            let odd = _mm512_srai_epi32::<8>(w);
            let even = _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(w));
            (
                _mm512_mul_ps(_mm512_cvtepi32_ps(odd), *d),
                _mm512_mul_ps(_mm512_cvtepi32_ps(even), *d),
            )
        }
    }
}

/// `Q4_0`: `(q - 8) * d`; byte `j` holds value `j` (low nibble) and
/// `j + 16` (high). The block's 16 values are one table.
#[derive(Clone, Copy)]
pub(super) struct Q4_0;

impl QSrc for Q4_0 {
    const BV: usize = BlockQ4_0::VALUES;
    const BB: usize = BlockQ4_0::BYTES;
    type St = __m512;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> __m512 {
        // SAFETY: the block's f16 `d` is its first two bytes.
        unsafe { _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(8.0)), f16x16(blk)) }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, table: &__m512, _: usize) -> (__m512, __m512) {
        // SAFETY: the 16 code bytes at `QS` end at `BYTES`, inside the whole
        // block at `blk` (`chunk`'s contract).
        unsafe {
            // Words 0..8 (bytes 0..16) in dwords 0..8 and again in 8..16.
            let q = _mm_loadu_si128(blk.add(BlockQ4_0::QS) as *const __m128i);
            let w = _mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(q));
            // Odd element 2j + 1: byte 2j + 1's low nibble (j < 8) or, for
            // 17..32, byte 2(j - 8) + 1's high nibble; even likewise.
            let so = _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12);
            let se = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
            (
                _mm512_permutexvar_ps(_mm512_srlv_epi32(w, so), *table),
                _mm512_permutexvar_ps(_mm512_srlv_epi32(w, se), *table),
            )
        }
    }
}

/// The 8 `d * sc` and `dmin * m` of a `Q4_K` block (and of a `Q5_K` block,
/// whose `d`, `dmin` and scales lie where `Q4_K`'s do).
#[derive(Clone, Copy)]
pub(super) struct Q4KSt {
    d1: [f32; 8],
    m1: [f32; 8],
}

// `k4_setup` reads a `Q5_K` block's `d`, `dmin` and scales where `Q4_K` has them.
const _: () = assert!(BlockQ5K::DMIN == BlockQ4K::DMIN && BlockQ5K::SCALES == BlockQ4K::SCALES);

/// # Safety
/// avx512f (so avx2); `blk` is a whole `Q4_K` or `Q5_K` block.
#[inline(always)]
unsafe fn k4_setup(blk: *const u8) -> Q4KSt {
    // SAFETY: `d`, `dmin` and the 12 scale bytes (at 0, `DMIN`, `SCALES`)
    // are the first 16 bytes of the whole block at `blk` (this function's
    // contract), and `[u8; K_SCALE_SIZE]` has alignment 1.
    unsafe {
        let d = _mm256_set1_ps(_mm512_cvtss_f32(f16x16(blk)));
        let dmin = _mm256_set1_ps(_mm512_cvtss_f32(f16x16(blk.add(BlockQ4K::DMIN))));
        let sm = unpack_scales_k4(&*(blk.add(BlockQ4K::SCALES) as *const [u8; K_SCALE_SIZE]));
        let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            sm.as_ptr() as *const _
        )));
        let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
            sm.as_ptr().add(8) as *const _
        )));
        let mut st = Q4KSt {
            d1: [0.0; 8],
            m1: [0.0; 8],
        };
        _mm256_storeu_ps(st.d1.as_mut_ptr(), _mm256_mul_ps(d, sc));
        _mm256_storeu_ps(st.m1.as_mut_ptr(), _mm256_mul_ps(dmin, mn));
        st
    }
}

/// `Q4_K`: sub-block `s` (32 values, chunk `s`) takes the
/// low (even `s`) or high nibbles of `qs[32 * (s / 2)..][..32]`; its table is
/// `d1 * q - m1` for q = 0..16 (one rounding, as the reference's).
#[derive(Clone, Copy)]
pub(super) struct Q4K;

impl QSrc for Q4K {
    const BV: usize = BlockQ4K::VALUES;
    const BB: usize = BlockQ4K::BYTES;
    type St = Q4KSt;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> Q4KSt {
        // SAFETY: `k4_setup`'s contract is `setup`'s (the features, a whole
        // `Q4_K` or `Q5_K` block at `blk`).
        unsafe { k4_setup(blk) }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, st: &Q4KSt, c: usize) -> (__m512, __m512) {
        // SAFETY: sub-block `c`'s codes lie in the block.
        unsafe {
            let w = words(blk.add(BlockQ4K::QS + 32 * (c / 2)));
            let t = _mm512_fmsub_ps(_mm512_set1_ps(st.d1[c]), iota16(), _mm512_set1_ps(st.m1[c]));
            let (io, ie) = if c.is_multiple_of(2) {
                (_mm512_srli_epi32::<8>(w), w)
            } else {
                (_mm512_srli_epi32::<12>(w), _mm512_srli_epi32::<4>(w))
            };
            (_mm512_permutexvar_ps(io, t), _mm512_permutexvar_ps(ie, t))
        }
    }
    #[inline(always)]
    unsafe fn chunk2(blk: *const u8, st: &Q4KSt, c: usize) -> [(__m512, __m512); 2] {
        // SAFETY: sub-blocks `c`, `c + 1` share their 32 code bytes.
        unsafe {
            let w = words(blk.add(BlockQ4K::QS + 16 * c));
            let t = |s: usize| {
                _mm512_fmsub_ps(_mm512_set1_ps(st.d1[s]), iota16(), _mm512_set1_ps(st.m1[s]))
            };
            let (t0, t1) = (t(c), t(c + 1));
            [
                (
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(w), t0),
                    _mm512_permutexvar_ps(w, t0),
                ),
                (
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(w), t1),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(w), t1),
                ),
            ]
        }
    }
}

/// `Q5_K`: `Q4_K`'s nibbles plus bit `s` of `qh[l]` as the
/// fifth bit; the table has 32 entries in two registers.
#[derive(Clone, Copy)]
pub(super) struct Q5K;

impl QSrc for Q5K {
    const BV: usize = BlockQ5K::VALUES;
    const BB: usize = BlockQ5K::BYTES;
    type St = Q4KSt;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> Q4KSt {
        // SAFETY: `k4_setup`'s contract is `setup`'s (the features, a whole
        // `Q4_K` or `Q5_K` block at `blk`).
        unsafe { k4_setup(blk) }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, st: &Q4KSt, c: usize) -> (__m512, __m512) {
        // SAFETY: `qh` (32 bytes at `QH`) and sub-block `c`'s 32 code bytes
        // (at `QS + 32 * (c / 2)`, ending by `QS + 128`) lie in the block.
        unsafe {
            let wq = words(blk.add(BlockQ5K::QS + 32 * (c / 2)));
            let wh = words(blk.add(BlockQ5K::QH));
            let (d1, m1) = (_mm512_set1_ps(st.d1[c]), _mm512_set1_ps(st.m1[c]));
            let lo = _mm512_fmsub_ps(d1, iota16(), m1);
            let hi = _mm512_fmsub_ps(d1, _mm512_add_ps(iota16(), _mm512_set1_ps(16.0)), m1);
            let s = 4 * (c % 2) as u32;
            // Bit 4 of each index from `qh`: bit c of byte 2j + 1 sits at
            // 8 + c, of byte 2j at c.
            let bit4 = _mm512_set1_epi32(0x10);
            let io = _mm512_ternarylogic_epi32::<MUX>(
                _mm512_srl_epi32(wq, _mm_cvtsi32_si128(8 + s as i32)),
                _mm512_srl_epi32(wh, _mm_cvtsi32_si128(4 + c as i32)),
                bit4,
            );
            let ie = _mm512_ternarylogic_epi32::<MUX>(
                _mm512_srl_epi32(wq, _mm_cvtsi32_si128(s as i32)),
                _mm512_rolv_epi32(wh, _mm512_set1_epi32((4 - c as i32) & 31)),
                bit4,
            );
            (
                _mm512_permutex2var_ps(lo, io, hi),
                _mm512_permutex2var_ps(lo, ie, hi),
            )
        }
    }
}

/// `Q2_K`'s 16 `d * sc` and `dmin * m`.
#[derive(Clone, Copy)]
pub(super) struct Q2KSt {
    dl: __m512,
    ml: __m512,
}

/// `Q2_K`: chunk `c` (half `c / 4`, 2-bit field `c % 4`)
/// reads `qs[32 * (c / 4)..][..32]`; its two 16-value sub-blocks `2c`,
/// `2c + 1` are entries 0..4 and 4..8 of one table, picked by lane.
#[derive(Clone, Copy)]
pub(super) struct Q2K;

impl QSrc for Q2K {
    const BV: usize = BlockQ2K::VALUES;
    const BB: usize = BlockQ2K::BYTES;
    type St = Q2KSt;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> Q2KSt {
        // SAFETY: the 16 scale bytes open the block; `d`, `dmin` at `D`,
        // `DMIN`, its last 4 bytes.
        unsafe {
            let sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk as *const __m128i));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15)));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sc));
            Q2KSt {
                dl: _mm512_mul_ps(f16x16(blk.add(BlockQ2K::D)), lo),
                ml: _mm512_mul_ps(f16x16(blk.add(BlockQ2K::DMIN)), hi),
            }
        }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, st: &Q2KSt, c: usize) -> (__m512, __m512) {
        // SAFETY: chunk `c`'s code bytes lie in the block.
        unsafe {
            let w = words(blk.add(BlockQ2K::QS + 32 * (c / 4)));
            let sel = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
            let sel = _mm512_add_epi32(sel, _mm512_set1_epi32(2 * c as i32));
            let q = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            );
            let t = _mm512_fmsub_ps(
                _mm512_permutexvar_ps(sel, st.dl),
                q,
                _mm512_permutexvar_ps(sel, st.ml),
            );
            let off = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
            let three = _mm512_set1_epi32(3);
            let g = 2 * (c % 4) as i32;
            let io = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_srl_epi32(w, _mm_cvtsi32_si128(8 + g)),
                three,
                off,
            );
            let ie = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_srl_epi32(w, _mm_cvtsi32_si128(g)),
                three,
                off,
            );
            (_mm512_permutexvar_ps(io, t), _mm512_permutexvar_ps(ie, t))
        }
    }
    #[inline(always)]
    unsafe fn chunk2(blk: *const u8, st: &Q2KSt, c: usize) -> [(__m512, __m512); 2] {
        // SAFETY: chunks `c`, `c + 1` (same half) read the same 32 code bytes.
        unsafe {
            let w = words(blk.add(BlockQ2K::QS + 32 * (c / 4)));
            // One table for both chunks: sub-blocks 2c .. 2c + 4, four
            // entries each.
            let sel = _mm512_add_epi32(
                _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                _mm512_set1_epi32(2 * c as i32),
            );
            let q = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0,
            );
            let t = _mm512_fmsub_ps(
                _mm512_permutexvar_ps(sel, st.dl),
                q,
                _mm512_permutexvar_ps(sel, st.ml),
            );
            let three = _mm512_set1_epi32(3);
            let off0 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
            let off1 = _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12);
            let g = 2 * (c % 4) as i32;
            let i0o = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_srl_epi32(w, _mm_cvtsi32_si128(8 + g)),
                three,
                off0,
            );
            let i0e = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_srl_epi32(w, _mm_cvtsi32_si128(g)),
                three,
                off0,
            );
            let i1o = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_srl_epi32(w, _mm_cvtsi32_si128(10 + g)),
                three,
                off1,
            );
            let i1e = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_srl_epi32(w, _mm_cvtsi32_si128(2 + g)),
                three,
                off1,
            );
            [
                (_mm512_permutexvar_ps(i0o, t), _mm512_permutexvar_ps(i0e, t)),
                (_mm512_permutexvar_ps(i1o, t), _mm512_permutexvar_ps(i1e, t)),
            ]
        }
    }
}

/// `Q3_K`: `Q2_K`'s 2-bit fields, minus 4 where the `hmask`
/// bit is clear; `y = (d * (sc - 32)) * v`. Each 16-value sub-block's 8
/// values are one half of a table, picked by lane; an index is the field
/// (bits 0..2), the inverted mask bit (bit 2) and the lane's half (bit 3).
#[derive(Clone, Copy)]
pub(super) struct Q3K;

impl QSrc for Q3K {
    const BV: usize = BlockQ3K::VALUES;
    const BB: usize = BlockQ3K::BYTES;
    /// The 16 `d * (sc - 32)`.
    type St = __m512;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> __m512 {
        // SAFETY: the 12 scale bytes at `SCALES` (an 8-byte and a 4-byte
        // read) and `d` at `D` lie in the block.
        unsafe {
            let sc = blk.add(BlockQ3K::SCALES);
            // Low 4 bits: low nibbles of bytes 0..8, then their high nibbles.
            let b = _mm_loadl_epi64(sc as *const __m128i);
            let nib = _mm_set1_epi8(15);
            let lo = _mm_unpacklo_epi64(
                _mm_and_si128(b, nib),
                _mm_and_si128(_mm_srli_epi16::<4>(b), nib),
            );
            // High 2 bits: byte 8 + s % 4 at bit 2 * (s / 4).
            let h = _mm_set1_epi32((sc.add(8) as *const i32).read_unaligned());
            let hs = _mm512_srlv_epi32(
                _mm512_cvtepu8_epi32(h),
                _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6),
            );
            let s = _mm512_or_si512(
                _mm512_cvtepu8_epi32(lo),
                _mm512_slli_epi32::<4>(_mm512_and_si512(hs, _mm512_set1_epi32(3))),
            );
            let s = _mm512_sub_epi32(s, _mm512_set1_epi32(32));
            _mm512_mul_ps(f16x16(blk.add(BlockQ3K::D)), _mm512_cvtepi32_ps(s))
        }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, dl: &__m512, c: usize) -> (__m512, __m512) {
        // SAFETY: `hmask` (32 bytes at 0) and chunk `c`'s code bytes lie in the block.
        unsafe {
            let (half, g) = ((c / 4) as i32, (c % 4) as i32);
            let wq = words(blk.add(BlockQ3K::QS + 32 * (c / 4)));
            let wh = words(blk);
            let v = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, -4.0, -3.0, -2.0,
                -1.0,
            );
            let t = _mm512_mul_ps(_mm512_permutexvar_ps(pair_lanes(2 * c), *dl), v);
            let three = _mm512_set1_epi32(3);
            let seven = _mm512_set1_epi32(7);
            let off = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
            // The mask bit 4 * half + g of byte 2j + 1 sits at 8 + that, of
            // byte 2j at that; bit 2 of the index is its complement.
            let b = 4 * half + g;
            let ho = _mm512_srl_epi32(wh, _mm_cvtsi32_si128(6 + b));
            let he = _mm512_rolv_epi32(wh, _mm512_set1_epi32((2 - b) & 31));
            let qo = _mm512_srl_epi32(wq, _mm_cvtsi32_si128(8 + 2 * g));
            let qe = _mm512_srl_epi32(wq, _mm_cvtsi32_si128(2 * g));
            // (field where `three` is set, else the inverted mask), then
            // bits 0..3 of that and the lane's half.
            let io = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_ternarylogic_epi32::<MUX>(_mm512_xor_si512(ho, seven), qo, three),
                seven,
                off,
            );
            let ie = _mm512_ternarylogic_epi32::<AND_OR>(
                _mm512_ternarylogic_epi32::<MUX>(_mm512_xor_si512(he, seven), qe, three),
                seven,
                off,
            );
            (_mm512_permutexvar_ps(io, t), _mm512_permutexvar_ps(ie, t))
        }
    }
}

/// `Q6_K`'s 16 `d * sc`.
#[derive(Clone, Copy)]
pub(super) struct Q6KSt {
    sd: __m512,
}

/// `Q6_K`: chunk `c` (half `c / 4`, group `c % 4`) takes
/// the low (groups 0, 1) or high nibbles of `ql[64 * half + 32 * (g % 2)..]`
/// and the 2 bits of `qh[32 * half..]` at `2g`: `q` is 0..64 and
/// `y = sd * (q - 32)`, one rounding. (Not `sd * q - 32 sd` by one FMA: the
/// same value, but `+0` where the reference gives `-0` for `q = 32` and a
/// negative scale.)
#[derive(Clone, Copy)]
pub(super) struct Q6K;

impl QSrc for Q6K {
    const BV: usize = BlockQ6K::VALUES;
    const BB: usize = BlockQ6K::BYTES;
    type St = Q6KSt;
    #[inline(always)]
    unsafe fn setup(blk: *const u8) -> Q6KSt {
        // SAFETY: the 16 signed scales at `SCALES` and `d` at `D` lie in the
        // block.
        unsafe {
            let sc =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(blk.add(BlockQ6K::SCALES) as *const __m128i));
            Q6KSt {
                sd: _mm512_mul_ps(f16x16(blk.add(BlockQ6K::D)), _mm512_cvtepi32_ps(sc)),
            }
        }
    }
    #[inline(always)]
    unsafe fn chunk(blk: *const u8, st: &Q6KSt, c: usize) -> (__m512, __m512) {
        // SAFETY: chunk `c`'s `ql` and `qh` bytes lie in the block.
        unsafe {
            let (half, g) = (c / 4, c % 4);
            let wl = words(blk.add(64 * half + 32 * (g % 2)));
            let wh = words(blk.add(BlockQ6K::QH + 32 * half));
            let sd = _mm512_permutexvar_ps(pair_lanes(2 * c), st.sd);
            let nib = _mm512_set1_epi32(0x0F);
            let six = _mm512_set1_epi32(0x3F);
            let s = 4 * (g / 2) as i32;
            let h = 2 * g as i32;
            // The nibble in bits 0..4, the two high bits in 4..6: byte 2j + 1's
            // at 8 + s and 8 + h, byte 2j's at s and h.
            let qo = _mm512_and_si512(
                _mm512_ternarylogic_epi32::<MUX>(
                    _mm512_srl_epi32(wh, _mm_cvtsi32_si128(4 + h)),
                    _mm512_srl_epi32(wl, _mm_cvtsi32_si128(8 + s)),
                    nib,
                ),
                six,
            );
            let qe = _mm512_and_si512(
                _mm512_ternarylogic_epi32::<MUX>(
                    _mm512_rolv_epi32(wh, _mm512_set1_epi32((4 - h) & 31)),
                    _mm512_srl_epi32(wl, _mm_cvtsi32_si128(s)),
                    nib,
                ),
                six,
            );
            let b32 = _mm512_set1_epi32(32);
            (
                _mm512_mul_ps(sd, _mm512_cvtepi32_ps(_mm512_sub_epi32(qo, b32))),
                _mm512_mul_ps(sd, _mm512_cvtepi32_ps(_mm512_sub_epi32(qe, b32))),
            )
        }
    }
}

/// Tokens decoded straight into their accumulators (below: a panel).
const DOT_MAX_TOKENS: usize = 4;
/// Chunks of a panel's k block (256 values: one K-quant block, eight of
/// the 32-value formats; divides [`KBC`], so a block's token chunks are
/// contiguous in [`super::pair_split`]'s layout).
const KQ: usize = 8;
const _: () = assert!(KBC.is_multiple_of(KQ) && (KQ * 32).is_multiple_of(256));

/// Rows `lo..hi` (row `o` at `base + o * rb`, `k` values each, `k` a
/// multiple of `S::BV`) against all `n` tokens (`xs` in `pair_split`
/// layout) into `out` (`[hi - lo, n]`, f32 sums: the caller rounds them).
///
/// # Safety
/// avx512f, avx512bw, f16c; rows `lo..hi` are whole rows of `S`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn range<S: QSrc>(
    base: *const u8,
    rb: usize,
    xs: &[f32],
    n: usize,
    k: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> Result<()> {
    // SAFETY: `dot_range` and `panel_range` have this function's contract
    // (the features; rows `lo..hi` whole rows of `S`), and the sizes they
    // rely on are asserted here.
    unsafe {
        assert!(k.is_multiple_of(S::BV) && rb >= k / S::BV * S::BB);
        assert!(xs.len() == n * k && out.len() == (hi - lo) * n);
        if n <= DOT_MAX_TOKENS {
            dot_range::<S>(base, rb, xs, n, k, lo, hi, out);
            Ok(())
        } else {
            panel_range::<S>(base, rb, xs, n, k, lo, hi, out)
        }
    }
}

/// `R` rows against tokens `t0..t0 + TT`, every chunk decoded in registers.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
unsafe fn dot_tile<S: QSrc, const R: usize, const TT: usize>(
    rows: &[*const u8; R],
    xs: &[f32],
    n: usize,
    chunks: usize,
    t0: usize,
) -> [[__m512; TT]; R] {
    // SAFETY: `dot_range` passes `R` pointers to whole rows of `chunks / cpb`
    // blocks of `S` and tokens `t0..t0 + TT` of `xs` (`pair_split` layout of
    // `n` tokens of `chunks` chunks), so every block and token chunk read
    // here is inside them; the features are `range`'s.
    unsafe {
        let cpb = S::BV / 32;
        let mut acc = [[_mm512_setzero_ps(); TT]; R];
        for u in 0..chunks / cpb {
            // Plain loops, not `array::from_fn`: a closure is not compiled
            // with this function's target features and was called out of line.
            let mut blk = [rows[0]; R];
            for i in 0..R {
                blk[i] = rows[i].add(u * S::BB);
            }
            let mut st = [S::setup(blk[0]); R];
            for i in 1..R {
                st[i] = S::setup(blk[i]);
            }
            // Chunks two at a time where a block has an even number of them.
            let step = if cpb.is_multiple_of(2) { 2 } else { 1 };
            let mut cc = 0;
            while cc < cpb {
                let c = u * cpb + cc;
                let mut x = [[[_mm512_setzero_ps(); 2]; TT]; 2];
                for (h, xh) in x.iter_mut().enumerate().take(step) {
                    for (j, xj) in xh.iter_mut().enumerate() {
                        let p = xs.as_ptr().add(pair_offset(n, chunks, t0 + j, c + h));
                        *xj = [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))];
                    }
                }
                for i in 0..R {
                    let w = if step == 2 {
                        S::chunk2(blk[i], &st[i], cc)
                    } else {
                        [S::chunk(blk[i], &st[i], cc); 2]
                    };
                    for h in 0..step {
                        for j in 0..TT {
                            acc[i][j] = _mm512_fmadd_ps(w[h].0, x[h][j][0], acc[i][j]);
                            acc[i][j] = _mm512_fmadd_ps(w[h].1, x[h][j][1], acc[i][j]);
                        }
                    }
                }
                cc += step;
            }
        }
        acc
    }
}

/// The dot-product form (`n <= DOT_MAX_TOKENS`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_range<S: QSrc>(
    base: *const u8,
    rb: usize,
    xs: &[f32],
    n: usize,
    k: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) {
    // SAFETY: the tiles read rows `o..o + $r` with `o + $r <= hi`, whole
    // rows of `S` by `range`'s contract, and tokens `t0..t0 + $t` with
    // `t0 + $t <= n` of `xs`, whose length `range` asserted; `out` is
    // indexed with bounds checks.
    unsafe {
        let chunks = k / 32;
        macro_rules! tile {
            ($r:literal, $t:literal, $o:expr, $t0:expr) => {{
                let (o, t0) = ($o, $t0);
                let mut rows = [base; $r];
                for (i, r) in rows.iter_mut().enumerate() {
                    *r = base.add((o + i) * rb);
                }
                let acc = dot_tile::<S, $r, $t>(&rows, xs, n, chunks, t0);
                for i in 0..$r {
                    for j in 0..$t {
                        out[(o + i - lo) * n + t0 + j] = hsum(acc[i][j]);
                    }
                }
            }};
        }
        // Tiles of `$r` rows (then single rows) against tokens `t0..t0 + $t`.
        macro_rules! rows {
            ($r:literal, $t:literal, $t0:expr) => {{
                let mut o = lo;
                while o + $r <= hi {
                    tile!($r, $t, o, $t0);
                    o += $r;
                }
                while o < hi {
                    tile!(1, $t, o, $t0);
                    o += 1;
                }
            }};
        }
        let mut t0 = 0;
        while t0 < n {
            match n - t0 {
                1 => rows!(4, 1, t0),
                2 => rows!(4, 2, t0),
                3 => rows!(2, 3, t0),
                _ => rows!(2, 4, t0),
            }
            t0 += (n - t0).min(4);
        }
    }
}

/// A panel's rows as [`PairW`] weights: chunk `c` of row `i` at
/// `row + 32 c` (the row pointer is offset back by the k block's first chunk).
#[derive(Clone, Copy)]
struct PanelW;

impl PairW for PanelW {
    type Row = *const f32;
    #[inline(always)]
    fn row(self, _: usize) -> *const f32 {
        std::ptr::null()
    }
    #[inline(always)]
    fn span(self, _: usize, _: usize, _: usize) -> (*const u8, usize) {
        (std::ptr::null(), 0)
    }
    #[inline(always)]
    unsafe fn half(row: *const f32, kk: usize, _k: usize, half: usize) -> __m512 {
        // SAFETY: `row` was offset back by the k block's first value, and
        // `kk` lies in the k block (the caller's contract), so the address
        // is inside the panel.
        unsafe { _mm512_loadu_ps(row.wrapping_add(kk + 16 * half)) }
    }
}

/// The panel form: the loops of `super::range_pairs`, with each row tile's
/// k block of [`KQ`] chunks decoded once per token block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn panel_range<S: QSrc>(
    base: *const u8,
    rb: usize,
    xs: &[f32],
    n: usize,
    k: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> Result<()> {
    // SAFETY: the caller's contract (`range`); the panel holds `RB` rows of
    // `KQ` chunks and every write below stays in it.
    unsafe {
        let chunks = k / 32;
        let cpb = S::BV / 32;
        let mut accs = crate::batch::try_vec(RB * TB, _mm512_setzero_ps(), "accumulators")?;
        let mut panel = crate::batch::try_vec(RB * KQ * 32, 0f32, "the decoded weight panel")?;
        let mut tb = 0;
        while tb < n {
            let te = (tb + TB).min(n);
            let mut o = lo;
            while o < hi {
                let r = (hi - o).min(RB);
                for a in accs.iter_mut() {
                    *a = _mm512_setzero_ps();
                }
                let mut c0 = 0;
                while c0 < chunks {
                    let c1 = (c0 + KQ).min(chunks);
                    // The next row tile's blocks of this k block, ahead of
                    // their turn.
                    let (b0, b1) = (c0 / cpb * S::BB, c1 / cpb * S::BB);
                    for q in o + r..(o + 2 * r).min(hi) {
                        super::prefetch(base.wrapping_add(q * rb + b0), b1 - b0);
                    }
                    for i in 0..r {
                        let row = base.add((o + i) * rb);
                        let p = panel.as_mut_ptr().add(i * KQ * 32);
                        for u in c0 / cpb..c1 / cpb {
                            let blk = row.add(u * S::BB);
                            let st = S::setup(blk);
                            for cc in 0..cpb {
                                let (wo, we) = S::chunk(blk, &st, cc);
                                let at = p.add((u * cpb + cc - c0) * 32);
                                _mm512_storeu_ps(at, wo);
                                _mm512_storeu_ps(at.add(16), we);
                            }
                        }
                    }
                    let mut wp = [panel.as_ptr(); RB];
                    for (i, p) in wp.iter_mut().enumerate() {
                        *p = panel.as_ptr().add(i * KQ * 32).wrapping_sub(c0 * 32);
                    }
                    let mut t = tb;
                    while t < te {
                        let tt = (te - t).min(T);
                        let mut xp = [xs.as_ptr(); T];
                        for (j, p) in xp.iter_mut().enumerate().take(tt) {
                            *p = xs.as_ptr().add(pair_offset(n, chunks, t + j, c0));
                        }
                        let acc = accs.as_mut_ptr().add((t - tb) * RB);
                        macro_rules! tile {
                            ($($rr:literal);*) => {
                                match (r, tt) {
                                    $(($rr, 4) => pairs::<PanelW, $rr, 4>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 3) => pairs::<PanelW, $rr, 3>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 2) => pairs::<PanelW, $rr, 2>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 1) => pairs::<PanelW, $rr, 1>(&wp, &xp, k, c0, c1, acc),)*
                                    _ => unreachable!("tiles are at most {RB} x {T}"),
                                }
                            };
                        }
                        tile!(6; 5; 4; 3; 2; 1);
                        t += tt;
                    }
                    c0 = c1;
                }
                for t in tb..te {
                    for i in 0..r {
                        out[(o + i - lo) * n + t] = hsum(accs[(t - tb) * RB + i]);
                    }
                }
                o += r;
            }
            tb = te;
        }
        Ok(())
    }
}

/// Rows of `S` decoded to f32 in ggml's element order, chunk by chunk or
/// (`pairs`, blocks of an even number of chunks) two chunks at a time
/// (tests: the sources against `formats::dequant_row_f32`).
///
/// # Safety
/// avx512f, avx512bw, f16c; `row` is whole blocks of `S` holding `out.len()` values.
#[cfg(test)]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
unsafe fn decode_row<S: QSrc>(row: &[u8], out: &mut [f32], pairs: bool) {
    // SAFETY: the features are enabled on this function; every block read
    // is inside `row`, which the assert below checks holds `out.len() / BV`
    // of them.
    unsafe {
        assert!(out.len().is_multiple_of(S::BV) && row.len() >= out.len() / S::BV * S::BB);
        let mut v = [0f32; 32];
        let cpb = S::BV / 32;
        for u in 0..out.len() / S::BV {
            let blk = row.as_ptr().add(u * S::BB);
            let st = S::setup(blk);
            for c in 0..cpb {
                let (o, e) = if pairs {
                    S::chunk2(blk, &st, c & !1)[c % 2]
                } else {
                    S::chunk(blk, &st, c)
                };
                _mm512_storeu_ps(v.as_mut_ptr(), o);
                _mm512_storeu_ps(v.as_mut_ptr().add(16), e);
                let y = &mut out[u * S::BV + 32 * c..][..32];
                for j in 0..16 {
                    y[2 * j + 1] = v[j];
                    y[2 * j] = v[16 + j];
                }
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::formats::{dequant_row_f32, EngramType};

    /// Every source decodes random blocks (finite f16 scales of all
    /// magnitudes, every code) to the reference's values bit for bit.
    #[test]
    fn sources_decode_to_the_reference_bits() {
        if !(std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("f16c"))
        {
            eprintln!("no AVX-512 here: skipped");
            return;
        }
        let k = 1024usize;
        for (i, ty) in [
            EngramType::F16,
            EngramType::Q8_0,
            EngramType::Q4_0,
            EngramType::Q2_K,
            EngramType::Q3_K,
            EngramType::Q4_K,
            EngramType::Q5_K,
            EngramType::Q6_K,
        ]
        .into_iter()
        .enumerate()
        {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let rows = 9;
            let len = rows * f.row_bytes(k);
            let data = crate::formats::ggml::random_blocks(f, len, 40 + i as u64);
            for r in 0..rows {
                let row = &data[r * f.row_bytes(k)..(r + 1) * f.row_bytes(k)];
                let mut want = vec![0f32; k];
                dequant_row_f32(f, row, &mut want).unwrap();
                let check = |got: &[f32], pairs: bool| {
                    for (e, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                            "{} row {r} value {e} (chunks in pairs: {pairs}): {a} ({:#x}) vs {b} ({:#x})",
                            f.name(),
                            a.to_bits(),
                            b.to_bits()
                        );
                    }
                };
                for pairs in [false, true] {
                    let mut got = vec![0f32; k];
                    // SAFETY: the features were checked above; whole blocks.
                    unsafe {
                        match ty {
                            EngramType::F16 => decode_row::<F16>(row, &mut got, false),
                            EngramType::Q8_0 => decode_row::<Q8_0>(row, &mut got, false),
                            EngramType::Q4_0 => decode_row::<Q4_0>(row, &mut got, false),
                            EngramType::Q2_K => decode_row::<Q2K>(row, &mut got, pairs),
                            EngramType::Q3_K => decode_row::<Q3K>(row, &mut got, pairs),
                            EngramType::Q4_K => decode_row::<Q4K>(row, &mut got, pairs),
                            EngramType::Q5_K => decode_row::<Q5K>(row, &mut got, pairs),
                            _ => decode_row::<Q6K>(row, &mut got, pairs),
                        }
                    }
                    check(&got, pairs);
                }
            }
        }
    }
}
