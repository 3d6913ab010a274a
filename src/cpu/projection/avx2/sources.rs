//! The weight formats as the AVX2 kernels read them: each chunk of 16 values
//! as its odd-element and even-element f32 vectors (see the order in
//! `mod.rs`), dequantised in registers with the block's scales hoisted.

use super::*;
use crate::formats::ggml::K_SCALE_SIZE;
use crate::formats::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0, GgmlBlock,
};

/// How a row of weights is read: units of `UNIT` chunks sharing their scales
/// (one block of a ggml format, one chunk for dense rows); each chunk as the
/// odd-element and even-element vectors of the order above.
pub trait Src: Copy {
    /// Chunks per unit.
    const UNIT: usize;
    /// What a unit's chunks share (its scales), set up once per unit.
    type St: Copy;
    /// # Safety
    /// The CPU has avx2, fma and f16c; `row` is a whole row of this format
    /// and `u` one of its units (a whole block of a GGUF format).
    unsafe fn setup(self, row: *const u8, u: usize) -> Self::St;
    /// # Safety
    /// As `setup` (the features; `u` a unit of the whole row `row`), and
    /// `j < UNIT`.
    unsafe fn chunk(self, st: &Self::St, row: *const u8, u: usize, j: usize) -> (__m256, __m256);
}

/// bf16 rows of `chunks * 16` values: a mask keeps the odd elements (the high
/// half of each 32-bit pair), a shift moves up the even ones.
#[derive(Clone, Copy)]
pub struct Bf16 {
    pub kp: usize,
}

impl Src for Bf16 {
    const UNIT: usize = 1;
    type St = ();
    #[inline(always)]
    unsafe fn setup(self, _: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn chunk(self, _: &(), row: *const u8, u: usize, _: usize) -> (__m256, __m256) {
        // SAFETY: unit `u` of a bf16 row is one chunk, 16 values or 32 bytes
        // at `u * 32`, inside the row since `u` is one of its units
        // (`chunk`'s contract, which also promises avx2).
        unsafe {
            let v = _mm256_loadu_si256(row.add(u * 32) as *const __m256i);
            let hi = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            (
                _mm256_castsi256_ps(_mm256_and_si256(v, hi)),
                _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            )
        }
    }
}

/// f32 rows of `chunks * 16` values (f32 `wkv`, and rows of any other format
/// dequantised into a scratch buffer by the reference code).
#[derive(Clone, Copy)]
pub struct F32 {
    pub kp: usize,
}

impl Src for F32 {
    const UNIT: usize = 1;
    type St = ();
    #[inline(always)]
    unsafe fn setup(self, _: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn chunk(self, _: &(), row: *const u8, u: usize, _: usize) -> (__m256, __m256) {
        // SAFETY: unit `u` of an f32 row is one chunk, 16 values or 64 bytes
        // at `u * 64` (two 8-lane loads), inside the row since `u` is one of
        // its units (`chunk`'s contract, which also promises avx2).
        unsafe {
            let p = row.add(u * 64) as *const f32;
            let (a, b) = (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
            // [a1 a3 b1 b3 | a5 a7 b5 b7] -> 64-bit pairs in order 0 2 1 3.
            let odd = _mm256_shuffle_ps(a, b, 0b11_01_11_01);
            let even = _mm256_shuffle_ps(a, b, 0b10_00_10_00);
            (
                _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0b11_01_10_00)),
                _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0b11_01_10_00)),
            )
        }
    }
}

/// An f16 at `p` in all 8 lanes.
///
/// # Safety
/// Two readable bytes at `p`; the CPU has f16c.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    // SAFETY: the unaligned read takes just the two bytes at `p`, readable
    // by this function's contract, which also promises the f16c that
    // `vcvtph2ps` needs.
    unsafe { _mm256_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned())) }
}

/// An f16 at `p` as f32.
///
/// # Safety
/// As [`f16x8`].
#[inline(always)]
unsafe fn f16(p: *const u8) -> f32 {
    // SAFETY: this function's contract is `f16x8`'s (two readable bytes at
    // `p`, f16c).
    unsafe { _mm256_cvtss_f32(f16x8(p)) }
}

/// 16 bytes at `p` as 8 dwords, byte `2l` in the low half of dword `l` and
/// byte `2l + 1` in the high half.
///
/// # Safety
/// 16 readable bytes at `p`; the CPU has avx2.
#[inline(always)]
unsafe fn pairs16(p: *const u8) -> __m256i {
    // SAFETY: the unaligned 16-byte load reads exactly the bytes this
    // function's contract makes readable; the widening needs avx2, which it
    // promises too.
    unsafe { _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i)) }
}

/// `Q8_0`: `q * d`, exact in f32. A unit is one block (two chunks).
#[derive(Clone, Copy)]
pub struct Q8_0;

impl Src for Q8_0 {
    const UNIT: usize = BlockQ8_0::VALUES / CH;
    type St = __m256;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> __m256 {
        // SAFETY: `u` is a block of the row (`setup`'s contract), so its f16
        // `d` (its first two bytes, at `u * BYTES`) is readable; f16c by the
        // same contract.
        unsafe { f16x8(row.add(u * BlockQ8_0::BYTES)) }
    }
    #[inline(always)]
    unsafe fn chunk(self, d: &__m256, row: *const u8, u: usize, j: usize) -> (__m256, __m256) {
        // SAFETY: chunk `j < 2` reads the 16 codes at `QS + 16 * j`, ending
        // by `QS + 32 = BYTES`: inside block `u`, a block of the row
        // (`chunk`'s contract, which also promises avx2).
        unsafe {
            let q = _mm256_cvtepi8_epi16(_mm_loadu_si128(
                row.add(u * BlockQ8_0::BYTES + BlockQ8_0::QS + 16 * j) as *const _,
            ));
            let odd = _mm256_srai_epi32(q, 16);
            // The low word of each pair times 1 plus the high word times 0.
            let even = _mm256_madd_epi16(q, _mm256_set1_epi32(1));
            (
                _mm256_mul_ps(_mm256_cvtepi32_ps(odd), *d),
                _mm256_mul_ps(_mm256_cvtepi32_ps(even), *d),
            )
        }
    }
}

/// `Q4_0`: `(q - 8) * d`; chunk 0 is the low nibbles, chunk 1 the high.
#[derive(Clone, Copy)]
pub struct Q4_0;

impl Src for Q4_0 {
    const UNIT: usize = BlockQ4_0::VALUES / CH;
    type St = __m256;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> __m256 {
        // SAFETY: `u` is a block of the row (`setup`'s contract), so its f16
        // `d` (its first two bytes, at `u * BYTES`) is readable; f16c by the
        // same contract.
        unsafe { f16x8(row.add(u * BlockQ4_0::BYTES)) }
    }
    #[inline(always)]
    unsafe fn chunk(self, d: &__m256, row: *const u8, u: usize, j: usize) -> (__m256, __m256) {
        // SAFETY: both chunks read the 16 code bytes at `QS` (`j` picks the
        // nibble), ending at `BYTES`: inside block `u`, a block of the row
        // (`chunk`'s contract, which also promises avx2).
        unsafe {
            let v = pairs16(row.add(u * BlockQ4_0::BYTES + BlockQ4_0::QS));
            let m = _mm256_set1_epi32(15);
            let eight = _mm256_set1_epi32(8);
            let odd = _mm256_sub_epi32(
                _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(16 + 4 * j as i32)), m),
                eight,
            );
            let even = _mm256_sub_epi32(
                _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(4 * j as i32)), m),
                eight,
            );
            (
                _mm256_mul_ps(_mm256_cvtepi32_ps(odd), *d),
                _mm256_mul_ps(_mm256_cvtepi32_ps(even), *d),
            )
        }
    }
}

/// `Q2_K` (256 values, 16 groups of 16: one chunk a group).
/// The unit's 16 `d * sc` and `dmin * m` are formed once; each group's four
/// possible values `dl * q - ml` (q = 0..3) are one `fmsub`, and its 16
/// weights two table look-ups within each 128-bit half (`vpermilps` reads the
/// low 2 bits of each index, the 2-bit field; the table is in both halves).
#[derive(Clone, Copy)]
pub struct Q2K;

#[derive(Clone, Copy)]
pub struct Q2KSt {
    dl: [f32; 16],
    ml: [f32; 16],
}

impl Src for Q2K {
    const UNIT: usize = BlockQ2K::VALUES / CH;
    type St = Q2KSt;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> Q2KSt {
        // SAFETY: `u` is a block of the row (`setup`'s contract); the reads
        // are its `d` and `dmin` (at `D`, `DMIN`) and its 16 scale bytes (at
        // 0, two 8-byte loads), all inside its `BYTES`.
        unsafe {
            let b = row.add(u * BlockQ2K::BYTES);
            let (d, dmin) = (
                _mm256_set1_ps(f16(b.add(BlockQ2K::D))),
                _mm256_set1_ps(f16(b.add(BlockQ2K::DMIN))),
            );
            let mut st = Q2KSt {
                dl: [0.0; 16],
                ml: [0.0; 16],
            };
            for h in 0..2 {
                let sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(8 * h) as *const _));
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15)));
                let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4));
                _mm256_storeu_ps(st.dl.as_mut_ptr().add(8 * h), _mm256_mul_ps(d, lo));
                _mm256_storeu_ps(st.ml.as_mut_ptr().add(8 * h), _mm256_mul_ps(dmin, hi));
            }
            st
        }
    }
    #[inline(always)]
    unsafe fn chunk(self, st: &Q2KSt, row: *const u8, u: usize, g: usize) -> (__m256, __m256) {
        // SAFETY: group `g < 16` reads 16 bytes at `QS + 32 * (g / 8) +
        // 16 * (g % 2)`, ending by `QS + 64`, the end of `qs`: inside block
        // `u`, a block of the row (`chunk`'s contract; avx2 and fma too).
        unsafe {
            let b = row.add(u * BlockQ2K::BYTES);
            let q = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0);
            let table = _mm256_fmsub_ps(
                _mm256_broadcast_ss(&st.dl[g]),
                q,
                _mm256_broadcast_ss(&st.ml[g]),
            );
            let v = pairs16(b.add(BlockQ2K::QS + 32 * (g / 8) + 16 * (g % 2)));
            let sh = (2 * ((g % 8) / 2)) as i32;
            (
                _mm256_permutevar_ps(table, _mm256_srl_epi32(v, _mm_cvtsi32_si128(16 + sh))),
                _mm256_permutevar_ps(table, _mm256_srl_epi32(v, _mm_cvtsi32_si128(sh))),
            )
        }
    }
}

/// `Q4_K` (256 values, 8 sub-blocks of 32 with 6-bit scales
/// and mins): `(d * sc) * q - dmin * m`; chunk `j` is half of sub-block
/// `j / 2`.
///
/// The nibbles are not shifted down: a mask leaves `q << s` (`s` = 0, 4, 16
/// or 20 by the nibble's place in its dword), converted exactly, and the
/// `fmsub` takes `(d * sc) * 2^-s` instead of `d * sc`. Both products are
/// exact (`d * sc` has at most 17 significant bits, `q` 4, and `2^-s` keeps
/// every f16 scale a normal f32), so `fmsub` rounds the same value once, as
/// the reference does. The unit's 8 scale pairs are unpacked with 32-bit
/// masks and converted 8 at a time.
#[derive(Clone, Copy)]
pub struct Q4K;

#[derive(Clone, Copy)]
pub struct Q4KSt {
    /// `d * sc * 2^-s` for the odd (high-word) elements of sub-block `sb`.
    d_odd: [f32; 8],
    /// The same for the even (low-word) elements.
    d_even: [f32; 8],
    m1: [f32; 8],
}

/// The 8 six-bit scales (bytes 0..8) and mins (bytes 8..16) of a `Q4_K` /
/// `Q5_K` block's 12 packed scale bytes, unpacked a 32-bit word at a time (the
/// layout `formats::ggml::scale_min_k4` reads one at a time).
#[inline(always)]
pub(crate) fn unpack_scales_k4(sc: &[u8; K_SCALE_SIZE]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]]);
    let (w0, w1, w2) = (w(0), w(1), w(2));
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    // Scales 0..4: low 6 bits of bytes 0..4; 4..8: low nibbles of bytes
    // 8..12 with the top 2 bits of bytes 0..4 above them. Mins likewise from
    // bytes 4..8 and the high nibbles of bytes 8..12.
    let s_lo = w0 & LOW6;
    let s_hi = (w2 & LOW4) | (((w0 >> 6) & LOW2) << 4);
    let m_lo = w1 & LOW6;
    let m_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & LOW2) << 4);
    let mut out = [0u8; 16];
    out[0..4].copy_from_slice(&s_lo.to_le_bytes());
    out[4..8].copy_from_slice(&s_hi.to_le_bytes());
    out[8..12].copy_from_slice(&m_lo.to_le_bytes());
    out[12..16].copy_from_slice(&m_hi.to_le_bytes());
    out
}

impl Src for Q4K {
    const UNIT: usize = BlockQ4K::VALUES / CH;
    type St = Q4KSt;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> Q4KSt {
        // SAFETY: `u` is a block of the row (`setup`'s contract); the reads
        // are its `d` and `dmin` (at 0 and `DMIN`) and its 12 scale bytes
        // (at `SCALES`, as an array of alignment 1), its first 16 bytes.
        unsafe {
            let b = row.add(u * BlockQ4K::BYTES);
            let (d, dmin) = (f16x8(b), f16x8(b.add(BlockQ4K::DMIN)));
            let sm = unpack_scales_k4(&*(b.add(BlockQ4K::SCALES) as *const [u8; K_SCALE_SIZE]));
            let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                sm.as_ptr() as *const _
            )));
            let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                sm.as_ptr().add(8) as *const _
            )));
            // Sub-block sb's nibbles: odd elements at bit 16 + 4 (sb % 2),
            // even ones at bit 4 (sb % 2).
            const P16: f32 = 1.0 / 65536.0;
            const P20: f32 = 1.0 / 1_048_576.0;
            const P4: f32 = 1.0 / 16.0;
            let d1 = _mm256_mul_ps(d, sc);
            let mut st = Q4KSt {
                d_odd: [0.0; 8],
                d_even: [0.0; 8],
                m1: [0.0; 8],
            };
            let po = _mm256_setr_ps(P16, P20, P16, P20, P16, P20, P16, P20);
            let pe = _mm256_setr_ps(1.0, P4, 1.0, P4, 1.0, P4, 1.0, P4);
            _mm256_storeu_ps(st.d_odd.as_mut_ptr(), _mm256_mul_ps(d1, po));
            _mm256_storeu_ps(st.d_even.as_mut_ptr(), _mm256_mul_ps(d1, pe));
            _mm256_storeu_ps(st.m1.as_mut_ptr(), _mm256_mul_ps(dmin, mn));
            st
        }
    }
    #[inline(always)]
    unsafe fn chunk(self, st: &Q4KSt, row: *const u8, u: usize, j: usize) -> (__m256, __m256) {
        // SAFETY: chunk `j < 16` reads 16 bytes at `QS + 32 * (j / 4) +
        // 16 * (j % 2)`, ending by `QS + 128`, the end of `qs`: inside block
        // `u`, a block of the row (`chunk`'s contract; avx2 and fma too).
        unsafe {
            let sb = j / 2;
            let v =
                pairs16(row.add(u * BlockQ4K::BYTES + BlockQ4K::QS + 32 * (sb / 2) + 16 * (j % 2)));
            let sh = 4 * (sb % 2) as u32;
            let odd = _mm256_and_si256(v, _mm256_set1_epi32((0xF_0000u32 << sh) as i32));
            let even = _mm256_and_si256(v, _mm256_set1_epi32((0xFu32 << sh) as i32));
            let m1 = _mm256_broadcast_ss(&st.m1[sb]);
            (
                _mm256_fmsub_ps(
                    _mm256_broadcast_ss(&st.d_odd[sb]),
                    _mm256_cvtepi32_ps(odd),
                    m1,
                ),
                _mm256_fmsub_ps(
                    _mm256_broadcast_ss(&st.d_even[sb]),
                    _mm256_cvtepi32_ps(even),
                    m1,
                ),
            )
        }
    }
}

/// The checkpoint's block-scaled fp8 (`Fp8E4m3E8m0Block`), rows of one
/// row of blocks (`srow`: their scales; a block is `1 << shift` columns, a
/// multiple of 16, so a chunk lies in one block). Each code becomes the f16
/// bit pattern `s 0 eeee mmm 0000000` (two shifts and a mask on the byte
/// pairs), whose value is the e4m3 value times `2^-8` exactly (e4m3
/// subnormals land on f16 subnormals), widened by F16C (which reads f16
/// subnormals whatever the MXCSR says), then multiplied by `2^8` and by the
/// block's scale: both exact (see `formats::fp8_block`), so the weights are
/// the very f32 values of the bf16 path on the widened matrix.
#[derive(Clone, Copy)]
pub struct Fp8 {
    pub srow: *const u8,
    pub shift: u32,
}

impl Src for Fp8 {
    const UNIT: usize = 1;
    type St = __m256;
    #[inline(always)]
    unsafe fn setup(self, _: *const u8, u: usize) -> __m256 {
        // SAFETY: `srow` is the scale row of the rows being read, one byte
        // per block of `1 << shift` columns (how the AVX2 run builds an
        // `Fp8`); unit `u` is a chunk of the row (`setup`'s contract), so
        // its first column `u * CH` is in the row and its block's byte
        // `(u * CH) >> shift` in `srow`.
        unsafe {
            _mm256_set1_ps(crate::formats::fp8_block::e8m0_scale(
                *self.srow.add((u * CH) >> self.shift),
            ))
        }
    }
    #[inline(always)]
    unsafe fn chunk(self, s: &__m256, row: *const u8, u: usize, _: usize) -> (__m256, __m256) {
        // SAFETY: unit `u` of an fp8 row is one chunk of 16 one-byte codes
        // at `u * CH`, inside the row since `u` is one of its units
        // (`chunk`'s contract, which also promises f16c).
        unsafe {
            // 16-bit lane l: code 2l in the low byte, code 2l + 1 in the high.
            let x = _mm_loadu_si128(row.add(u * CH) as *const __m128i);
            let m = _mm_set1_epi16(0xBF80u16 as i16);
            let odd = _mm_and_si128(_mm_srai_epi16(x, 1), m);
            let even = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(x, 8), 1), m);
            let k = _mm256_set1_ps(256.0);
            (
                _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(odd), k), *s),
                _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(even), k), *s),
            )
        }
    }
}

/// `Q5_K`: `Q4_K`'s nibbles plus bit `s` of `qh[l]` as the
/// fifth bit of sub-block `s`; `(d * sc) * q - dmin * m` by one `fmsub`
/// (`d * sc * q` is exact: 17 + 5 significant bits). Chunk `j` is half
/// `j % 2` of sub-block `j / 2`.
#[derive(Clone, Copy)]
pub struct Q5K;

/// The 8 `d * sc` and `dmin * m` of a `Q5_K` block.
#[derive(Clone, Copy)]
pub struct Q5KSt {
    d1: [f32; 8],
    m1: [f32; 8],
}

impl Src for Q5K {
    const UNIT: usize = BlockQ5K::VALUES / CH;
    type St = Q5KSt;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> Q5KSt {
        // SAFETY: `u` is a block of the row (`setup`'s contract); the reads
        // are its `d` and `dmin` (at 0 and `DMIN`) and its 12 scale bytes
        // (at `SCALES`, as an array of alignment 1), its first 16 bytes.
        unsafe {
            let b = row.add(u * BlockQ5K::BYTES);
            let (d, dmin) = (f16x8(b), f16x8(b.add(BlockQ5K::DMIN)));
            let sm = unpack_scales_k4(&*(b.add(BlockQ5K::SCALES) as *const [u8; K_SCALE_SIZE]));
            let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                sm.as_ptr() as *const _
            )));
            let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                sm.as_ptr().add(8) as *const _
            )));
            let mut st = Q5KSt {
                d1: [0.0; 8],
                m1: [0.0; 8],
            };
            _mm256_storeu_ps(st.d1.as_mut_ptr(), _mm256_mul_ps(d, sc));
            _mm256_storeu_ps(st.m1.as_mut_ptr(), _mm256_mul_ps(dmin, mn));
            st
        }
    }
    #[inline(always)]
    unsafe fn chunk(self, st: &Q5KSt, row: *const u8, u: usize, j: usize) -> (__m256, __m256) {
        // SAFETY: chunk `j < 16` reads 16 bytes of `qs` at `QS + 32 * (j / 4)
        // + 16 * (j % 2)` (ending by `QS + 128`, its end) and 16 of `qh` at
        // `QH + 16 * (j % 2)` (ending by `QH + 32`, its end): inside block
        // `u`, a block of the row (`chunk`'s contract; avx2 and fma too).
        unsafe {
            let b = row.add(u * BlockQ5K::BYTES);
            let sb = j / 2;
            let l0 = 16 * (j % 2);
            let v = pairs16(b.add(BlockQ5K::QS + 32 * (sb / 2) + l0));
            let h = pairs16(b.add(BlockQ5K::QH + l0));
            let s = 4 * (sb % 2) as i32;
            let nib = _mm256_set1_epi32(15);
            let sixteen = _mm256_set1_epi32(16);
            // Byte 2l + 1 in bits 16..24 of lane l, byte 2l in bits 0..8; the
            // `qh` bit goes to bit 4.
            let qo = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(16 + s)), nib),
                _mm256_and_si256(
                    _mm256_srl_epi32(h, _mm_cvtsi32_si128(12 + sb as i32)),
                    sixteen,
                ),
            );
            let qe = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(s)), nib),
                _mm256_and_si256(
                    _mm256_sllv_epi32(
                        _mm256_srl_epi32(h, _mm_cvtsi32_si128(sb as i32)),
                        _mm256_set1_epi32(4),
                    ),
                    sixteen,
                ),
            );
            let (d1, m1) = (
                _mm256_broadcast_ss(&st.d1[sb]),
                _mm256_broadcast_ss(&st.m1[sb]),
            );
            (
                _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(qo), m1),
                _mm256_fmsub_ps(d1, _mm256_cvtepi32_ps(qe), m1),
            )
        }
    }
}

/// `Q6_K`: chunk `j` is sub-block `j` (16 values, its
/// own signed scale): the nibble of `ql` and the 2 bits of `qh` where
/// `formats::ggml` reads them, `q - 32` converted and multiplied by
/// `d * sc` (one rounding, as the reference's).
#[derive(Clone, Copy)]
pub struct Q6K;

/// The 16 `d * sc` of a `Q6_K` block.
#[derive(Clone, Copy)]
pub struct Q6KSt {
    sd: [f32; 16],
}

impl Src for Q6K {
    const UNIT: usize = BlockQ6K::VALUES / CH;
    type St = Q6KSt;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> Q6KSt {
        // SAFETY: `u` is a block of the row (`setup`'s contract); the reads
        // are its `d` (at `D`) and its 16 scales (at `SCALES`, two 8-byte
        // loads, ending at `D`), all inside its `BYTES`.
        unsafe {
            let b = row.add(u * BlockQ6K::BYTES);
            let d = f16x8(b.add(BlockQ6K::D));
            let mut st = Q6KSt { sd: [0.0; 16] };
            for h in 0..2 {
                let sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    b.add(BlockQ6K::SCALES + 8 * h) as *const _
                ));
                _mm256_storeu_ps(
                    st.sd.as_mut_ptr().add(8 * h),
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)),
                );
            }
            st
        }
    }
    #[inline(always)]
    unsafe fn chunk(self, st: &Q6KSt, row: *const u8, u: usize, j: usize) -> (__m256, __m256) {
        // SAFETY: chunk `j < 16` reads 16 bytes of `ql` at `64 * (j / 8) +
        // 32 * (g % 2) + 16 * (j % 2)` (ending by 128, the end of `ql`) and
        // 16 of `qh` at `QH + 32 * (j / 8) + 16 * (j % 2)` (ending by
        // `QH + 64`, its end): inside block `u`, a block of the row
        // (`chunk`'s contract, which also promises avx2).
        unsafe {
            let b = row.add(u * BlockQ6K::BYTES);
            let (half, g, l0) = (j / 8, (j / 2) % 4, 16 * (j % 2));
            let v = pairs16(b.add(64 * half + 32 * (g % 2) + l0));
            let h = pairs16(b.add(BlockQ6K::QH + 32 * half + l0));
            let s = 4 * (g / 2) as i32;
            let hs = 2 * g as i32;
            let nib = _mm256_set1_epi32(15);
            let top = _mm256_set1_epi32(0x30);
            let b32 = _mm256_set1_epi32(32);
            // Lane l: byte 2l + 1 in bits 16..24, byte 2l in bits 0..8; the
            // two bits of `qh` go to bits 4..6.
            let qo = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(16 + s)), nib),
                _mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(12 + hs)), top),
            );
            let qe = _mm256_or_si256(
                _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(s)), nib),
                _mm256_and_si256(
                    _mm256_sllv_epi32(
                        _mm256_srl_epi32(h, _mm_cvtsi32_si128(hs)),
                        _mm256_set1_epi32(4),
                    ),
                    top,
                ),
            );
            let sd = _mm256_broadcast_ss(&st.sd[j]);
            (
                _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_sub_epi32(qo, b32))),
                _mm256_mul_ps(sd, _mm256_cvtepi32_ps(_mm256_sub_epi32(qe, b32))),
            )
        }
    }
}

/// `Q3_K`: chunk `j` is sub-block `j` (16 values): `Q2_K`'s
/// 2-bit field minus 4 where the `hmask` bit is clear, times
/// `d * (sc - 32)` (exact).
#[derive(Clone, Copy)]
pub struct Q3K;

/// The 16 `d * (sc - 32)` of a `Q3_K` block.
#[derive(Clone, Copy)]
pub struct Q3KSt {
    dl: [f32; 16],
}

impl Src for Q3K {
    const UNIT: usize = BlockQ3K::VALUES / CH;
    type St = Q3KSt;
    #[inline(always)]
    unsafe fn setup(self, row: *const u8, u: usize) -> Q3KSt {
        // SAFETY: `u` is a block of the row (`setup`'s contract); the reads
        // are its `d` (at `D`), 8 scale bytes at `SCALES` and 4 at
        // `SCALES + 8` (ending at `D`), all inside its `BYTES`.
        unsafe {
            let b = row.add(u * BlockQ3K::BYTES);
            let d = f16x8(b.add(BlockQ3K::D));
            let sc = b.add(BlockQ3K::SCALES);
            // Scale s: low 4 bits the low (s < 8) or high nibble of byte
            // s % 8, high 2 bits those of byte 8 + s % 4 at bit 2 * (s / 4);
            // minus 32. Eight at a time.
            let bytes = _mm_loadl_epi64(sc as *const __m128i);
            let nib = _mm_set1_epi8(15);
            let lo = [
                _mm_and_si128(bytes, nib),
                _mm_and_si128(_mm_srli_epi16::<4>(bytes), nib),
            ];
            let h =
                _mm256_cvtepu8_epi32(_mm_set1_epi32((sc.add(8) as *const i32).read_unaligned()));
            let mut st = Q3KSt { dl: [0.0; 16] };
            for (half, lo) in lo.into_iter().enumerate() {
                let sh = if half == 0 {
                    _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)
                } else {
                    _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6)
                };
                let hi = _mm256_and_si256(_mm256_srlv_epi32(h, sh), _mm256_set1_epi32(3));
                let v = _mm256_sub_epi32(
                    _mm256_or_si256(_mm256_cvtepu8_epi32(lo), _mm256_slli_epi32::<4>(hi)),
                    _mm256_set1_epi32(32),
                );
                _mm256_storeu_ps(
                    st.dl.as_mut_ptr().add(8 * half),
                    _mm256_mul_ps(d, _mm256_cvtepi32_ps(v)),
                );
            }
            st
        }
    }
    #[inline(always)]
    unsafe fn chunk(self, st: &Q3KSt, row: *const u8, u: usize, j: usize) -> (__m256, __m256) {
        // SAFETY: chunk `j < 16` reads 16 bytes of `qs` at `QS + 32 * (j / 8)
        // + 16 * (j % 2)` (ending by `QS + 64`, its end) and 16 of `hmask`
        // at `16 * (j % 2)` (ending by 32, its end): inside block `u`, a
        // block of the row (`chunk`'s contract, which also promises avx2).
        unsafe {
            let b = row.add(u * BlockQ3K::BYTES);
            let (half, g, l0) = (j / 8, (j / 2) % 4, 16 * (j % 2));
            let v = pairs16(b.add(BlockQ3K::QS + 32 * half + l0));
            let h = pairs16(b.add(l0));
            let bit = (4 * half + g) as i32;
            let three = _mm256_set1_epi32(3);
            let four = _mm256_set1_epi32(4);
            // The field minus 4 where the mask bit (moved to bit 2) is clear.
            let fo = _mm256_srl_epi32(v, _mm_cvtsi32_si128(16 + 2 * g as i32));
            let fe = _mm256_srl_epi32(v, _mm_cvtsi32_si128(2 * g as i32));
            let mo = _mm256_srl_epi32(h, _mm_cvtsi32_si128(14 + bit));
            let me = _mm256_sllv_epi32(
                _mm256_srl_epi32(h, _mm_cvtsi32_si128(bit)),
                _mm256_set1_epi32(2),
            );
            let qo = _mm256_sub_epi32(_mm256_and_si256(fo, three), _mm256_andnot_si256(mo, four));
            let qe = _mm256_sub_epi32(_mm256_and_si256(fe, three), _mm256_andnot_si256(me, four));
            let dl = _mm256_broadcast_ss(&st.dl[j]);
            (
                _mm256_mul_ps(dl, _mm256_cvtepi32_ps(qo)),
                _mm256_mul_ps(dl, _mm256_cvtepi32_ps(qe)),
            )
        }
    }
}
