//! The AVX-512 kernels of the projection: f32 FMA tiles, bf16 and fp8 weights
//! widened in registers, and the f32 loops that dequantise q8_0 and q2_K rows
//! (the quantised formats the AVX2 kernel decodes in registers go to it:
//! `super::quant_in_avx2`). Chosen at run time (see `super::Kernel::detect`).

use super::{pair_offset, KBC, TOKEN_BLOCK};
use std::arch::x86_64::*;

/// Weight rows per micro-kernel call, tokens per micro-kernel call.
const R: usize = 4;
const T: usize = 4;

fn f16(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// q8_0 blocks (f16 `d`, 32 i8) to f32: `q * d`, exact in f32.
///
/// # Safety
/// The CPU must have avx512f; `data` is whole 34-byte blocks, `out` 32
/// values per block.
#[target_feature(enable = "avx512f")]
pub unsafe fn dequant_q8_0(data: &[u8], out: &mut [f32]) {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        assert_eq!(data.len() / 34 * 32, out.len());
        for (b, o) in data.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
            let d = _mm512_set1_ps(f16(b[0], b[1]));
            let q0 = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
            let q1 = _mm_loadu_si128(b.as_ptr().add(18) as *const __m128i);
            let f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
            let f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(f0, d));
            _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_mul_ps(f1, d));
        }
    }
}

/// q2_K super-blocks (`scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`) to f32
/// in ggml's order: for each half of 128 values and each 2-bit shift, 16
/// values from `qs[0..16]` then 16 from `qs[16..32]`, each group with its
/// own 4-bit scale and min: `d*sc * q - dmin*m`. `d*sc`, `dmin*m` and their
/// product with `q` are exact in f32, so the fused subtract rounds once,
/// exactly as ggml's separate operations do.
///
/// # Safety
/// The CPU must have avx512f; `data` is whole 84-byte blocks, `out` 256
/// values per block.
#[target_feature(enable = "avx512f")]
pub unsafe fn dequant_q2_k(data: &[u8], out: &mut [f32]) {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        assert_eq!(data.len() / 84 * 256, out.len());
        let three = _mm512_set1_epi32(3);
        for (b, o) in data.chunks_exact(84).zip(out.chunks_exact_mut(256)) {
            let (scales, qs) = (&b[..16], &b[16..80]);
            let (d, dmin) = (f16(b[80], b[81]), f16(b[82], b[83]));
            let mut y = 0;
            let mut is = 0;
            for half in 0..2 {
                let q = &qs[32 * half..32 * half + 32];
                let qa = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.as_ptr() as *const __m128i));
                let qb =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(q.as_ptr().add(16) as *const __m128i));
                for shift in [0u32, 2, 4, 6] {
                    let sh = _mm_cvtsi32_si128(shift as i32);
                    for qv in [qa, qb] {
                        let sc = scales[is];
                        is += 1;
                        let dl = _mm512_set1_ps(d * (sc & 0xF) as f32);
                        let ml = _mm512_set1_ps(dmin * (sc >> 4) as f32);
                        let v =
                            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(qv, sh), three));
                        _mm512_storeu_ps(o.as_mut_ptr().add(y), _mm512_fmsub_ps(dl, v, ml));
                        y += 16;
                    }
                }
            }
        }
    }
}

/// All `m` rows of `w` (`[m, k]` f32) against all `n` f32 token rows into
/// `out` (`[m, n]`), f32 FMA in tiles of 4 x 4 (f32 sums; the caller rounds them).
///
/// # Safety
/// The CPU must have avx512f; sizes as stated.
#[target_feature(enable = "avx512f")]
pub unsafe fn range_f32(rows: &[f32], n: usize, k: usize, w: &[f32], m: usize, out: &mut [f32]) {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        debug_assert!(w.len() == m * k && rows.len() == n * k && out.len() == m * n);
        let mut tb = 0;
        while tb < n {
            let te = (tb + TOKEN_BLOCK).min(n);
            let mut o = 0;
            while o < m {
                let r = (m - o).min(R);
                let mut t = tb;
                while t < te {
                    let tt = (te - t).min(T);
                    let mut wp = [w.as_ptr(); R];
                    for (i, p) in wp.iter_mut().enumerate().take(r) {
                        *p = w.as_ptr().add((o + i) * k);
                    }
                    let mut xp = [rows.as_ptr(); T];
                    for (j, p) in xp.iter_mut().enumerate().take(tt) {
                        *p = rows.as_ptr().add((t + j) * k);
                    }
                    let s = match (r, tt) {
                        (4, 4) => fma::<4, 4>(&wp, &xp, k),
                        (4, 1) => fma::<4, 1>(&wp, &xp, k),
                        _ => fma_any(&wp, &xp, r, tt, k),
                    };
                    for i in 0..r {
                        for j in 0..tt {
                            out[(o + i) * n + t + j] = s[i][j];
                        }
                    }
                    t += tt;
                }
                o += r;
            }
            tb = te;
        }
    }
}

/// An `RR x TT` tile of f32 dot products with FMA, 16 lanes at a time.
#[inline]
#[target_feature(enable = "avx512f")]
#[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
unsafe fn fma<const RR: usize, const TT: usize>(
    wp: &[*const f32; R],
    xp: &[*const f32; T],
    k: usize,
) -> [[f32; T]; R] {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); TT]; RR];
        let mut kk = 0;
        while kk + 16 <= k {
            let mut wv = [_mm512_loadu_ps(wp[0].add(kk)); RR];
            for i in 1..RR {
                wv[i] = _mm512_loadu_ps(wp[i].add(kk));
            }
            for j in 0..TT {
                let x = _mm512_loadu_ps(xp[j].add(kk));
                for i in 0..RR {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], x, acc[i][j]);
                }
            }
            kk += 16;
        }
        if kk < k {
            let m: __mmask16 = (1u32 << (k - kk)) as u16 - 1;
            for i in 0..RR {
                let wv = _mm512_maskz_loadu_ps(m, wp[i].add(kk));
                for j in 0..TT {
                    acc[i][j] =
                        _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, xp[j].add(kk)), acc[i][j]);
                }
            }
        }
        let mut s = [[0f32; T]; R];
        for i in 0..RR {
            for j in 0..TT {
                s[i][j] = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
        s
    }
}

#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fma_any(
    wp: &[*const f32; R],
    xp: &[*const f32; T],
    r: usize,
    tt: usize,
    k: usize,
) -> [[f32; T]; R] {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        macro_rules! tile {
            ($($rr:literal, $t:literal);*) => {
                match (r, tt) {
                    $(($rr, $t) => fma::<$rr, $t>(wp, xp, k),)*
                    _ => unreachable!("tiles are at most {R} x {T}"),
                }
            };
        }
        tile!(1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 2, 3; 2, 4; 3, 1; 3, 2; 3, 3; 3, 4; 4, 1; 4, 2; 4, 3; 4, 4)
    }
}

/// Weight rows per bf16 tile.
const RB: usize = 6;
/// Tokens per bf16 token block (their accumulators wait in a small buffer
/// while the weight panel of one k block is reused across them).
const TB: usize = 32;

/// Outputs `lo..hi` of bf16 weights `w` for all `n` tokens (in
/// [`super::pair_split`] layout) into `out` (`[hi-lo, n]`) (f32 sums; the caller rounds them).
///
/// Each output's sum has one fixed order, whatever `n`, the tile or the k
/// blocking: lane `j` of its accumulator takes, chunk after chunk of 32
/// values, the product of element `2j+1` then of element `2j` by FMA (a
/// bf16 product is exact in f32, so each step rounds once), and the 16
/// lanes are added by a fixed tree. So a token's `kv` does not depend on
/// what else is in its batch.
///
/// # Safety
/// The CPU must have avx512f and avx512bw; `xs` is `[n, ceil(k/32)*32]`,
/// `w` is `[_, k]` with at least `hi` rows, `out` is `[hi-lo, n]`.
#[target_feature(enable = "avx512f,avx512bw")]
pub unsafe fn range_bf16(
    xs: &[f32],
    n: usize,
    k: usize,
    w: &[u16],
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> crate::error::Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        assert!(w.len() >= hi * k);
        range_pairs(Bf16W { w: w.as_ptr(), k }, xs, n, k, lo, hi, out)
    }
}

/// As [`range_bf16`] for block-scaled fp8 weights `w` (`Fp8E4m3E8m0Block`)
/// converted in registers: the same values (exact in bf16 and f32, see
/// `formats::fp8_block`) in the same order, so the same bits as
/// [`range_bf16`] on the weights widened to bf16.
///
/// # Safety
/// The CPU must have avx512f, avx512bw and f16c; `k` is a multiple of 32,
/// `w.bc` a power of two of at least 32, `w.k == k`; `xs` and `out` as
/// for [`range_bf16`], `w` has at least `hi` rows.
#[target_feature(enable = "avx512f,avx512bw,f16c")]
pub unsafe fn range_fp8(
    xs: &[f32],
    n: usize,
    k: usize,
    w: &crate::formats::Fp8Blocks<'_>,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> crate::error::Result<()> {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        assert!(w.k == k && k.is_multiple_of(32) && w.bc.is_power_of_two() && w.bc >= 32);
        assert!(w.rows() >= hi);
        let src = Fp8W {
            codes: w.codes.as_ptr(),
            scales: w.scales.as_ptr(),
            k,
            br: w.br,
            nbc: w.block_cols(),
            shift: w.bc.trailing_zeros(),
        };
        range_pairs(src, xs, n, k, lo, hi, out)
    }
}

/// How [`pairs`] reads a weight row: per chunk of 32 values, its 16 odd
/// elements (`half == 0`) or its 16 even ones, as f32.
trait PairW: Copy {
    /// What a row tile keeps of row `o`.
    type Row: Copy;
    fn row(self, o: usize) -> Self::Row;
    /// # Safety
    /// avx512f, avx512bw, f16c; the chunk at `kk` lies in the row (a tail
    /// past `k` only for formats that mask it).
    unsafe fn half(row: Self::Row, kk: usize, k: usize, half: usize) -> __m512;
}

/// bf16 rows: a mask keeps the odd elements, a shift moves up the even ones.
#[derive(Clone, Copy)]
struct Bf16W {
    w: *const u16,
    k: usize,
}

impl PairW for Bf16W {
    type Row = *const u16;
    #[inline(always)]
    fn row(self, o: usize) -> *const u16 {
        self.w.wrapping_add(o * self.k)
    }
    #[inline(always)]
    unsafe fn half(row: *const u16, kk: usize, k: usize, half: usize) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            // 32 bf16 as 16 words: element 2j in the low half, 2j+1 in the high.
            let v = if kk + 32 <= k {
                _mm512_loadu_si512(row.add(kk) as *const _)
            } else {
                let m: __mmask32 = ((1u64 << (k - kk)) - 1) as u32;
                _mm512_maskz_loadu_epi16(m, row.add(kk) as *const i16)
            };
            if half == 0 {
                _mm512_castsi512_ps(_mm512_and_si512(
                    v,
                    _mm512_set1_epi32(0xFFFF_0000u32 as i32),
                ))
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
            }
        }
    }
}

/// Block-scaled fp8 rows, converted as the AVX2 kernel's `Fp8` source does:
/// the codes as f16 bit patterns (the value times `2^-8`), widened by F16C,
/// times `2^8` and the block's scale (exact).
#[derive(Clone, Copy)]
struct Fp8W {
    codes: *const u8,
    scales: *const u8,
    k: usize,
    br: usize,
    nbc: usize,
    shift: u32,
}

impl PairW for Fp8W {
    /// The row's codes and its blocks' scales, and the block shift.
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
    unsafe fn half(row: Self::Row, kk: usize, _k: usize, half: usize) -> __m512 {
        // SAFETY: the caller's contract: `kk + 32 <= k`, the row and its
        // scale row are in the matrix.
        unsafe {
            let (codes, srow, shift) = row;
            // 16-bit lane j: code 2j in the low byte, 2j + 1 in the high.
            let x = _mm256_loadu_si256(codes.add(kk) as *const __m256i);
            let m = _mm256_set1_epi16(0xBF80u16 as i16);
            let h = if half == 0 {
                _mm256_and_si256(_mm256_srai_epi16(x, 1), m)
            } else {
                _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1), m)
            };
            let s = _mm512_set1_ps(crate::formats::fp8_block::e8m0_scale(
                *srow.add(kk >> shift),
            ));
            _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0)), s)
        }
    }
}

/// [`range_bf16`]'s loops over any [`PairW`] weights.
#[inline(always)]
unsafe fn range_pairs<W: PairW>(
    w: W,
    xs: &[f32],
    n: usize,
    k: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> crate::error::Result<()> {
    // SAFETY: the callers' contracts (`range_bf16`, `range_fp8`).
    unsafe {
        let chunks = k.div_ceil(32);
        assert!(xs.len() == n * chunks * 32 && out.len() == (hi - lo) * n);
        // Accumulators of one row tile against one token block: [row][token][16].
        let mut accs = crate::batch::try_vec(RB * TB, _mm512_setzero_ps(), "accumulators")?;
        let mut tb = 0;
        while tb < n {
            let te = (tb + TB).min(n);
            let mut o = lo;
            while o < hi {
                let r = (hi - o).min(RB);
                for a in accs.iter_mut() {
                    *a = _mm512_setzero_ps();
                }
                let mut wp = [w.row(o); RB];
                for (i, p) in wp.iter_mut().enumerate().take(r) {
                    *p = w.row(o + i);
                }
                let mut c0 = 0;
                while c0 < chunks {
                    let c1 = (c0 + KBC).min(chunks);
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
                                    $(($rr, 4) => pairs::<W, $rr, 4>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 3) => pairs::<W, $rr, 3>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 2) => pairs::<W, $rr, 2>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 1) => pairs::<W, $rr, 1>(&wp, &xp, k, c0, c1, acc),)*
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
                        let v = accs[(t - tb) * RB + i];
                        out[(o + i - lo) * n + t] = _mm512_reduce_add_ps(v);
                    }
                }
                o += r;
            }
            tb = te;
        }
        Ok(())
    }
}

/// Chunks `c0..c1` of an `RR x TT` tile of dot products (see
/// [`range_bf16`]); the accumulators live at `acc` as `[TT][RB]`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
unsafe fn pairs<W: PairW, const RR: usize, const TT: usize>(
    wp: &[W::Row; RB],
    xp: &[*const f32; T],
    k: usize,
    c0: usize,
    c1: usize,
    acc: *mut __m512,
) {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); TT]; RR];
        for i in 0..RR {
            for j in 0..TT {
                a[i][j] = *acc.add(j * RB + i);
            }
        }
        for c in c0..c1 {
            let kk = c * 32;
            // Odd elements of every row, then even ones: each accumulator still
            // takes its chunk's odd product before its even product, and only
            // one half of the token vectors is live at a time (24 accumulators
            // + 4 token vectors + 2 temporaries fit the 32 registers).
            for half in 0..2 {
                let mut x = [_mm512_setzero_ps(); TT];
                for j in 0..TT {
                    x[j] = _mm512_loadu_ps(xp[j].add((c - c0) * 32 + 16 * half));
                }
                for i in 0..RR {
                    let wv = W::half(wp[i], kk, k, half);
                    for j in 0..TT {
                        a[i][j] = _mm512_fmadd_ps(wv, x[j], a[i][j]);
                    }
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
