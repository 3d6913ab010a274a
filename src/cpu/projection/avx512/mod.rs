//! The AVX-512 kernels of the projection: f32 FMA tiles in one summation
//! order for every weight format, each read in place and widened or
//! dequantised in registers: bf16 and the checkpoint's fp8 here, f32, f16
//! and the GGUF block formats in `quant`. Chosen at run time (see
//! `super::Kernel::detect`).

use crate::batch::try_vec;
use crate::error::Result;
use crate::formats::bf16_to_f32;
use std::arch::x86_64::*;

mod dp;
mod qdot;
mod quant;
pub(super) use dp::pack_bf16;
pub(super) use qdot::{block_scale, range_q4_k_int, range_q8_0_int, QTokens, QB};
use quant::{F16, F32, Q2K, Q3K, Q4K, Q4_0, Q5K, Q6K, Q8_0};

macro_rules! entry {
    ($name:ident, $src:ty) => {
        /// `quant::range` for this source: rows `lo..hi` (row `o` at
        /// `base + o * rb`) against all `n` tokens (`xs` in [`pair_split`]
        /// layout) into `out` (`[hi - lo, n]`, f32 sums: the caller rounds
        /// them).
        ///
        /// # Safety
        /// The CPU has avx512f, avx512bw, avx2, fma and f16c; `k` is a
        /// multiple of the source's block, rows `lo..hi` are whole rows.
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn $name(
            base: *const u8,
            rb: usize,
            xs: &[f32],
            n: usize,
            k: usize,
            lo: usize,
            hi: usize,
            out: &mut [f32],
        ) -> Result<()> {
            // SAFETY: this entry's contract is `quant::range`'s, and it
            // enables the features `quant::range` needs.
            unsafe { quant::range::<$src>(base, rb, xs, n, k, lo, hi, out) }
        }
    };
}

entry!(range_f32, F32);
entry!(range_f16, F16);
entry!(range_q8_0, Q8_0);
entry!(range_q4_0, Q4_0);
entry!(range_q2_k, Q2K);
entry!(range_q3_k, Q3K);
entry!(range_q4_k, Q4K);
entry!(range_q5_k, Q5K);
entry!(range_q6_k, Q6K);

/// 32-value chunks per k block of the bf16 kernel (6 weight rows x 1024 bf16
/// = 12 KB stay in L1 while the block's token vectors stream past).
const KBC: usize = 32;

/// Token rows (bf16 bits, `[n, k]`) as f32 in this kernel's layout: k
/// blocks of `KBC` chunks of 32 values, each block holding every token's
/// chunks contiguously (`[block][token][chunk][32]`), and within a chunk the
/// 16 odd-indexed values then the 16 even-indexed ones; zero past `k`.
pub(super) fn pair_split(rows: &[u16], n: usize, k: usize) -> Result<Vec<f32>> {
    let chunks = k.div_ceil(32);
    let mut xs = try_vec(n * chunks * 32, 0f32, "the token rows")?;
    for (t, r) in rows.chunks_exact(k).enumerate() {
        for c in 0..chunks {
            let x = &mut xs[pair_offset(n, chunks, t, c)..][..32];
            let src = &r[c * 32..(c * 32 + 32).min(k)];
            for (j, &b) in src.iter().enumerate() {
                x[if j % 2 == 1 { j / 2 } else { 16 + j / 2 }] = bf16_to_f32(b);
            }
        }
    }
    Ok(xs)
}

/// Where token `t`'s chunk `c` starts in [`pair_split`]'s layout.
#[inline]
fn pair_offset(n: usize, chunks: usize, t: usize, c: usize) -> usize {
    let (b, within) = (c / KBC, c % KBC);
    let in_block = KBC.min(chunks - b * KBC);
    (b * KBC * n + t * in_block + within) * 32
}

/// Tokens per micro-kernel call.
const T: usize = 4;

/// The 16 lanes of a sum added by one fixed tree (halves, then halves of
/// those): every form of the kernel ends each output's sum with it.
#[inline(always)]
unsafe fn hsum(v: __m512) -> f32 {
    // SAFETY: register arithmetic only (avx512f, which implies avx).
    unsafe {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
        let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
        _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
    }
}

/// Weight rows per bf16 tile.
const RB: usize = 6;
/// Tokens per bf16 token block (their accumulators wait in a small buffer
/// while the weight panel of one k block is reused across them).
const TB: usize = 32;

/// Outputs `lo..hi` of bf16 weights `w` for all `n` tokens (in
/// [`pair_split`] layout) into `out` (`[hi-lo, n]`) (f32 sums; the caller rounds them).
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
    // SAFETY: the features are enabled here; `range_pairs` reads rows
    // `lo..hi` of `Bf16W`, inside `w` by the assert below, tokens of `xs`
    // and writes `out`, both sized by this function's contract.
    unsafe {
        assert!(w.len() >= hi * k);
        range_pairs(Fma(Bf16W { w: w.as_ptr(), k }), xs, n, k, lo, hi, out)
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
    // SAFETY: the features are enabled here; the asserts below check the
    // shape `Fp8W` relies on (whole chunks, a chunk in one block) and that
    // rows `lo..hi` are in the matrix (`Fp8Blocks` checked its codes and
    // scales hold every row); `xs` and `out` are sized by the contract.
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
        range_pairs(Fma(src), xs, n, k, lo, hi, out)
    }
}

/// [`range_bf16`] by `vdpbf16ps` (the same order and roundings; subnormals
/// read and written as zero, see `dp`), tokens in [`dp::pack_bf16`] layout.
///
/// # Safety
/// As [`range_bf16`], and the CPU has avx512bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub unsafe fn range_bf16_dp(
    xs: &[u16],
    n: usize,
    k: usize,
    w: &[u16],
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> crate::error::Result<()> {
    // SAFETY: as in `range_bf16` (rows inside `w` by the assert below, `xs`
    // and `out` sized by the contract), with avx512bf16 enabled here for
    // `vdpbf16ps`.
    unsafe {
        assert!(w.len() >= hi * k);
        range_pairs(
            dp::Dp(dp::Bf16D { w: w.as_ptr(), k }),
            xs,
            n,
            k,
            lo,
            hi,
            out,
        )
    }
}

/// [`range_fp8`] by `vdpbf16ps` (the bits of [`range_bf16_dp`] on the
/// weights widened to bf16).
///
/// # Safety
/// As [`range_fp8`], and the CPU has avx512bf16.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx2,fma,f16c")]
pub unsafe fn range_fp8_dp(
    xs: &[u16],
    n: usize,
    k: usize,
    w: &crate::formats::Fp8Blocks<'_>,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> crate::error::Result<()> {
    // SAFETY: as in `range_fp8` (the shape and rows asserted below, `xs`
    // and `out` sized by the contract), with avx512bf16 enabled here; the
    // widened rows are written to `wb`, sized for them.
    unsafe {
        assert!(w.k == k && k.is_multiple_of(32) && w.bc.is_power_of_two() && w.bc >= 32);
        assert!(w.rows() >= hi);
        let src = dp::Fp8D {
            codes: w.codes.as_ptr(),
            scales: w.scales.as_ptr(),
            k,
            br: w.br,
            nbc: w.block_cols(),
            shift: w.bc.trailing_zeros(),
        };
        if n <= FP8_IN_TILE_TOKENS {
            return range_pairs(dp::Dp(src), xs, n, k, lo, hi, out);
        }
        // Batches: each group of rows widened to bf16 once (the tiles would
        // convert every chunk again for each 4 tokens), then the bf16 tiles:
        // the same values, so the same bits.
        let rows = FP8_WIDEN_ROWS.min(hi - lo);
        let mut wb = try_vec(rows * k, 0u16, "the widened weight rows")?;
        let mut a = lo;
        while a < hi {
            let e = (a + rows).min(hi);
            dp::widen_fp8(src, a, e, &mut wb[..(e - a) * k]);
            let bf = dp::Bf16D { w: wb.as_ptr(), k };
            range_pairs(
                dp::Dp(bf),
                xs,
                n,
                k,
                0,
                e - a,
                &mut out[(a - lo) * n..(e - lo) * n],
            )?;
            a = e;
        }
        Ok(())
    }
}

/// Tokens up to which [`range_fp8_dp`] converts fp8 chunks inside the tiles.
const FP8_IN_TILE_TOKENS: usize = 4;
/// Rows [`range_fp8_dp`] widens at a time for batches (288 KB of bf16 at the
/// V4.1 geometry: they stay in L2 while the tokens pass).
const FP8_WIDEN_ROWS: usize = 24;

/// How [`pairs`] reads a weight row: per chunk of 32 values, its 16 odd
/// elements (`half == 0`) or its 16 even ones, as f32.
trait PairW: Copy {
    /// What a row tile keeps of row `o`.
    type Row: Copy;
    fn row(self, o: usize) -> Self::Row;
    /// The bytes of row `o`'s chunks `c0..c1` (start, length), to prefetch.
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize);
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
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize) {
        let end = (c1 * 32).min(self.k);
        (
            self.row(o).wrapping_add(c0 * 32) as *const u8,
            2 * (end - c0 * 32),
        )
    }
    #[inline(always)]
    unsafe fn half(row: *const u16, kk: usize, k: usize, half: usize) -> __m512 {
        // SAFETY: `half`'s contract puts the chunk at `kk` in the row; a
        // chunk that runs past `k` (the last) is read with a masked load.
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
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize) {
        let end = (c1 * 32).min(self.k);
        (self.codes.wrapping_add(o * self.k + c0 * 32), end - c0 * 32)
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

/// A micro-kernel [`range_pairs`]'s loops drive: how a row tile names its
/// rows, and how an `RR x TT` tile accumulates chunks `c0..c1` (the
/// accumulators at `acc` as `[TT][RB]`), each output in the order of
/// [`range_bf16`].
trait Micro: Copy {
    /// A token value as the tiles read it (f32 split into odd and even
    /// elements, or bf16 pairs).
    type X: Copy;
    /// What a row tile keeps of row `o`.
    type Row: Copy;
    fn row(self, o: usize) -> Self::Row;
    /// The bytes of row `o`'s chunks `c0..c1` (start, length), to prefetch.
    fn span(self, o: usize, c0: usize, c1: usize) -> (*const u8, usize);
    /// # Safety
    /// The CPU features of the weights' kernel; rows and tokens hold chunks
    /// `c0..c1`, `acc` holds `T * RB` accumulators.
    unsafe fn tile<const RR: usize, const TT: usize>(
        wp: &[Self::Row; RB],
        xp: &[*const Self::X; T],
        k: usize,
        c0: usize,
        c1: usize,
        acc: *mut __m512,
    );
}

/// [`pairs`]: weights widened or decoded to f32 by `W`, one FMA a product.
#[derive(Clone, Copy)]
struct Fma<W>(W);

impl<W: PairW> Micro for Fma<W> {
    type X = f32;
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
    unsafe fn tile<const RR: usize, const TT: usize>(
        wp: &[W::Row; RB],
        xp: &[*const f32; T],
        k: usize,
        c0: usize,
        c1: usize,
        acc: *mut __m512,
    ) {
        // SAFETY: `Micro::tile`'s contract (the rows and tokens hold chunks
        // `c0..c1`, `acc` the tile's accumulators) is `pairs`'s.
        unsafe { pairs::<W, RR, TT>(wp, xp, k, c0, c1, acc) }
    }
}

/// Ask for `len` bytes from `p` in the caches (a hint: no access is made).
#[inline(always)]
fn prefetch(p: *const u8, len: usize) {
    let mut at = 0;
    while at < len {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(at) as *const i8) };
        at += 64;
    }
}

/// [`range_bf16`]'s loops over any [`Micro`] kernel.
#[inline(always)]
unsafe fn range_pairs<M: Micro>(
    w: M,
    xs: &[M::X],
    n: usize,
    k: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> crate::error::Result<()> {
    // SAFETY: every caller (`range_bf16`, `range_fp8` and their `dp` forms)
    // enables the features of `M` and has checked that rows `lo..hi` of `w`
    // are in the matrix; the tiles read only those rows (`o + i < hi`) and
    // the chunks `0..chunks` of `xs`, whose length is asserted below, and
    // write the accumulators `accs`, sized `RB * TB`.
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
                    // The next row tile's part of this k block, ahead of its
                    // turn (this tile's weights came from memory the same way),
                    // a share of it before each token tile: asked for all at
                    // once, the lines queue up behind the misses and stall the
                    // tiles' loads.
                    let next = (o + r)..(o + 2 * r).min(hi);
                    let tiles = (te - tb).div_ceil(T);
                    let mut t = tb;
                    while t < te {
                        let tt = (te - t).min(T);
                        let share = (t - tb) / T;
                        for q in next.clone() {
                            let (p, len) = w.span(q, c0, c1);
                            let lines = len.div_ceil(64);
                            let (a, b) = (lines * share / tiles, lines * (share + 1) / tiles);
                            prefetch(p.wrapping_add(a * 64), (b - a) * 64);
                        }
                        let mut xp = [xs.as_ptr(); T];
                        for (j, p) in xp.iter_mut().enumerate().take(tt) {
                            *p = xs.as_ptr().add(pair_offset(n, chunks, t + j, c0));
                        }
                        let acc = accs.as_mut_ptr().add((t - tb) * RB);
                        macro_rules! tile {
                            ($($rr:literal);*) => {
                                match (r, tt) {
                                    $(($rr, 4) => M::tile::<$rr, 4>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 3) => M::tile::<$rr, 3>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 2) => M::tile::<$rr, 2>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 1) => M::tile::<$rr, 1>(&wp, &xp, k, c0, c1, acc),)*
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
                        out[(o + i - lo) * n + t] = hsum(v);
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
    // SAFETY: the loads are chunks `c0..c1` of the `RR` rows (through
    // `W::half`, whose contract the rows' span meets) and of the `TT` token
    // rows, and the accumulators `TT * RB` vectors at `acc`: all inside what
    // this function's contract says the pointers hold.
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
