//! The AVX2 + FMA kernels of the projection (x86-64 CPUs without AVX-512, and
//! the forced fallback on those with it): one summation order, two ways of
//! computing it.
//!
//! **The order.** Each output `kv[t][o] = sum_i x[t][i] * w[o][i]` is summed in
//! 8 lanes. K is cut into chunks of 16 values; in chunk `c`, lane `l` takes the
//! product of element `16c + 2l + 1` (step `2c`) and then of element `16c + 2l`
//! (step `2c + 1`), each by one FMA into the lane's running sum, chunk after
//! chunk. The 8 lanes are then added by the tree
//! `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` and the sum rounded to
//! bf16. Elements past K are zero on both sides and leave every sum as it is.
//!
//! **Few tokens** ([`dot_range`]): dot products straight from `wkv`'s rows as
//! they are in memory (no copy): 16 weights are loaded, split into the odd and
//! even elements as f32 in registers (bf16: a mask and a shift; quantised
//! formats: dequantised in registers, scales hoisted per block), and multiplied
//! into each token's lanes.
//!
//! **Batches** ([`gemm_range`]): the same sums as 8 independent GEMMs, one per
//! lane. For 16 output rows at a time the weights are packed once per call
//! into a panel `[lane][step][16]` of f32 (transposed 8 x 8 in registers), the
//! tokens into tiles `[lane][step][6]`, and a 16 x 6 register tile of each
//! lane's sums is accumulated by broadcasting each token value against 16
//! outputs (12 FMAs per 2 loads and 6 broadcasts). Each lane's sum still takes
//! its steps in order, one FMA each, so the lanes hold the very values the dot
//! products hold, and the same tree gives the same bits: a token's `kv` does
//! not depend on the batch it is in, nor on which of the two forms ran.
//!
//! Quantised weights enter both forms as their exact f32 values (`formats`:
//! every product in a ggml dequantisation is exact, and `dl * q - ml` rounds
//! once, as one `fmsub` does), so they give the bits of f32 weights holding
//! the dequantised values. The block-scaled fp8 `wkv` ([`Fp8`]) is exact in
//! bf16 too, so it gives the bits of the bf16 path on the widened weights.

use std::arch::x86_64::*;

pub(crate) mod sources;
pub use sources::{Bf16, Fp8, Src, F32, Q2K, Q3K, Q4K, Q4_0, Q5K, Q6K, Q8_0};

/// Lanes of a sum.
pub(crate) const V: usize = 8;
/// Values per chunk (two steps of 8 lanes).
pub(crate) const CH: usize = 16;
/// Output rows per GEMM panel.
pub(crate) const MR: usize = 16;
/// Tokens per GEMM tile.
pub(crate) const NR: usize = 6;

/// Whether this CPU runs these kernels.
pub fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Token rows (bf16 bits, `[n, k]`) in the dot-product layout: per token
/// `chunks * 16` f32, chunk `c` holding elements `16c + 2l + 1` (l = 0..8)
/// then `16c + 2l`; zero past `k`. `out` is `[n, chunks * 16]`.
pub fn split_tokens(rows: &[u16], n: usize, k: usize, out: &mut [f32]) {
    let kp = k.div_ceil(CH) * CH;
    assert!(rows.len() == n * k && out.len() == n * kp);
    for (r, o) in rows.chunks_exact(k).zip(out.chunks_exact_mut(kp)) {
        o.fill(0.0);
        for (i, &b) in r.iter().enumerate() {
            let (c, e) = (i / CH, i % CH);
            let at = c * CH + if e % 2 == 1 { e / 2 } else { V + e / 2 };
            o[at] = crate::formats::bf16_to_f32(b);
        }
    }
}

/// Tokens in [`split_tokens`] layout (`xs`, `[n, kp]`) packed for the GEMM:
/// tiles of [`NR`] tokens (zero past `n`), each `[lane][step][NR]`. `out` is
/// `[ceil(n / NR), kp * NR]`.
pub fn pack_tokens(xs: &[f32], n: usize, kp: usize, out: &mut [f32]) {
    let steps = kp / V;
    let tiles = n.div_ceil(NR);
    assert!(xs.len() == n * kp && out.len() == tiles * kp * NR);
    for (tile, o) in out.chunks_exact_mut(kp * NR).enumerate() {
        for l in 0..V {
            for s in 0..steps {
                let at = (s / 2) * CH + (s % 2) * V + l;
                for j in 0..NR {
                    let t = tile * NR + j;
                    o[(l * steps + s) * NR + j] = if t < n { xs[t * kp + at] } else { 0.0 };
                }
            }
        }
    }
}

/// The 8 lanes of `v` added by the fixed tree of the order above.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: register arithmetic only (avx).
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
    }
}

/// `R` rows against `T` tokens over `units` units of `src`: each (row,
/// token) pair's 8 lane sums.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
unsafe fn dot_tile<S: Src, const R: usize, const T: usize>(
    src: S,
    rows: &[*const u8; R],
    xs: &[*const f32; T],
    units: usize,
) -> [[__m256; T]; R] {
    // SAFETY: the caller's contract (`dot_range`): whole rows, `units` units,
    // token rows of `units * UNIT` chunks.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for u in 0..units {
            let mut st = [src.setup(rows[0], u); R];
            for r in 1..R {
                st[r] = src.setup(rows[r], u);
            }
            for j in 0..S::UNIT {
                let c = u * S::UNIT + j;
                let mut w = [(_mm256_setzero_ps(), _mm256_setzero_ps()); R];
                for r in 0..R {
                    w[r] = src.chunk(&st[r], rows[r], u, j);
                }
                for t in 0..T {
                    let xo = _mm256_loadu_ps(xs[t].add(c * CH));
                    let xe = _mm256_loadu_ps(xs[t].add(c * CH + V));
                    for r in 0..R {
                        acc[r][t] = _mm256_fmadd_ps(w[r].0, xo, acc[r][t]);
                        acc[r][t] = _mm256_fmadd_ps(w[r].1, xe, acc[r][t]);
                    }
                }
            }
        }
        acc
    }
}

/// Rows `lo..hi` (row `o` at `base + o * rb`) against all `n` tokens (`xs` in
/// [`split_tokens`] layout, `[n, units * UNIT * 16]`) by dot products; `out`
/// is `[hi - lo, n]` (f32 sums; the caller rounds them).
///
/// # Safety
/// avx2, fma and f16c; rows `lo..hi` of `rb` bytes hold `units` whole units.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn dot_range<S: Src>(
    src: S,
    base: *const u8,
    rb: usize,
    units: usize,
    xs: &[f32],
    n: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) {
    // SAFETY: the contract above; every pointer formed is a row in `lo..hi`
    // or a token row of `xs`.
    unsafe {
        let kp = units * S::UNIT * CH;
        assert!(xs.len() == n * kp && out.len() == (hi - lo) * n);
        let xp = |t: usize| xs.as_ptr().add(t * kp);
        let row = |o: usize| base.add(o * rb);
        macro_rules! tile {
            ($r:literal, $t:literal, $o:expr, $t0:expr) => {{
                let (o, t0) = ($o, $t0);
                let rows: [*const u8; $r] = std::array::from_fn(|i| row(o + i));
                let x: [*const f32; $t] = std::array::from_fn(|j| xp(t0 + j));
                let acc = dot_tile::<S, $r, $t>(src, &rows, &x, units);
                for i in 0..$r {
                    for j in 0..$t {
                        out[(o + i - lo) * n + t0 + j] = hsum(acc[i][j]);
                    }
                }
            }};
        }
        if n == 1 {
            let mut o = lo;
            while o + 4 <= hi {
                tile!(4, 1, o, 0);
                o += 4;
            }
            while o < hi {
                tile!(1, 1, o, 0);
                o += 1;
            }
            return;
        }
        let mut o = lo;
        while o < hi {
            let two = o + 2 <= hi;
            let mut t = 0;
            while t < n {
                match (two, n - t) {
                    (true, 4..) => tile!(2, 4, o, t),
                    (true, 3) => tile!(2, 3, o, t),
                    (true, 2) => tile!(2, 2, o, t),
                    (true, _) => tile!(2, 1, o, t),
                    (false, 4..) => tile!(1, 4, o, t),
                    (false, 3) => tile!(1, 3, o, t),
                    (false, 2) => tile!(1, 2, o, t),
                    (false, _) => tile!(1, 1, o, t),
                }
                t += (n - t).min(4);
            }
            o += if two { 2 } else { 1 };
        }
    }
}

/// 8 x 8 transpose: `r[i]` lane `l` goes to `out[l]` lane `i`.
#[inline(always)]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: register shuffles only (avx).
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps(t0, t2, 0x44);
        let u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
        let u2 = _mm256_shuffle_ps(t1, t3, 0x44);
        let u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
        let u4 = _mm256_shuffle_ps(t4, t6, 0x44);
        let u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
        let u6 = _mm256_shuffle_ps(t5, t7, 0x44);
        let u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
        [
            _mm256_permute2f128_ps(u0, u4, 0x20),
            _mm256_permute2f128_ps(u1, u5, 0x20),
            _mm256_permute2f128_ps(u2, u6, 0x20),
            _mm256_permute2f128_ps(u3, u7, 0x20),
            _mm256_permute2f128_ps(u0, u4, 0x31),
            _mm256_permute2f128_ps(u1, u5, 0x31),
            _mm256_permute2f128_ps(u2, u6, 0x31),
            _mm256_permute2f128_ps(u3, u7, 0x31),
        ]
    }
}

/// Pack rows `o..o + m` (`m <= MR`; missing rows are zero) into `panel`
/// (`[lane][step][MR]`, `steps = units * UNIT * 2`).
#[inline(always)]
unsafe fn pack_panel<S: Src>(
    src: S,
    rows: &[*const u8; MR],
    m: usize,
    units: usize,
    panel: &mut [f32],
) {
    // SAFETY: the caller's contract (`gemm_range`): rows `0..m` are whole rows.
    unsafe {
        let steps = units * S::UNIT * 2;
        assert!(panel.len() == V * steps * MR);
        let p = panel.as_mut_ptr();
        let zero = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for u in 0..units {
            let mut st = [src.setup(rows[0], u); MR];
            for (r, s) in st.iter_mut().enumerate().take(m).skip(1) {
                *s = src.setup(rows[r], u);
            }
            for j in 0..S::UNIT {
                let c = u * S::UNIT + j;
                for half in 0..2 {
                    let mut w = [zero; 8];
                    for (i, wi) in w.iter_mut().enumerate() {
                        let r = half * 8 + i;
                        if r < m {
                            *wi = src.chunk(&st[r], rows[r], u, j);
                        }
                    }
                    let odd = transpose8(std::array::from_fn(|i| w[i].0));
                    let even = transpose8(std::array::from_fn(|i| w[i].1));
                    for l in 0..V {
                        let at = (l * steps + 2 * c) * MR + half * 8;
                        _mm256_storeu_ps(p.add(at), odd[l]);
                        _mm256_storeu_ps(p.add(at + MR), even[l]);
                    }
                }
            }
        }
    }
}

/// One lane of a 16 x 6 tile: `steps` steps of the panel's lane `l` against a
/// token tile's lane `l`, added to the sums at `acc` (`[NR][MR]`; zero
/// instead when `first`): each lane sum goes on from where the previous block
/// of steps left it, so the blocking does not change the order.
#[inline(always)]
unsafe fn lane_tile(w: *const f32, x: *const f32, steps: usize, acc: *mut f32, first: bool) {
    // SAFETY: the caller's contract: `steps * MR` values at `w`, `steps * NR`
    // at `x`, `NR * MR` readable and writable at `acc`.
    unsafe {
        let mut a = [[_mm256_setzero_ps(); 2]; NR];
        if !first {
            for (j, aj) in a.iter_mut().enumerate() {
                aj[0] = _mm256_loadu_ps(acc.add(j * MR));
                aj[1] = _mm256_loadu_ps(acc.add(j * MR + 8));
            }
        }
        for s in 0..steps {
            let w0 = _mm256_loadu_ps(w.add(s * MR));
            let w1 = _mm256_loadu_ps(w.add(s * MR + 8));
            for (j, aj) in a.iter_mut().enumerate() {
                let b = _mm256_broadcast_ss(&*x.add(s * NR + j));
                aj[0] = _mm256_fmadd_ps(w0, b, aj[0]);
                aj[1] = _mm256_fmadd_ps(w1, b, aj[1]);
            }
        }
        for (j, aj) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.add(j * MR), aj[0]);
            _mm256_storeu_ps(acc.add(j * MR + 8), aj[1]);
        }
    }
}

/// Steps per block of the GEMM: a block of one lane's panel (`KC * MR` f32,
/// 16 KB) stays in L1 while every token tile's block streams past.
const KC: usize = 256;

/// Scratch of one GEMM task: the packed panel and the lane sums of every
/// token tile.
pub fn gemm_scratch_len(n: usize, kp: usize) -> (usize, usize) {
    (V * (kp / V) * MR, n.div_ceil(NR) * V * NR * MR)
}

/// Rows `lo..hi` against all `n` tokens (`xt`: [`pack_tokens`] tiles) by the
/// packed GEMM; `out` is `[hi - lo, n]` (f32 sums; the caller rounds them);
/// `panel` and `sums` are scratch of the lengths [`gemm_scratch_len`] gives.
///
/// # Safety
/// As [`dot_range`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_range<S: Src>(
    src: S,
    base: *const u8,
    rb: usize,
    units: usize,
    xt: &[f32],
    n: usize,
    lo: usize,
    hi: usize,
    out: &mut [f32],
    panel: &mut [f32],
    sums: &mut [f32],
) {
    // SAFETY: the contract above; pointers are rows in `lo..hi`, the token
    // tiles, the panel and the sums, each within the lengths asserted here.
    unsafe {
        let steps = units * S::UNIT * 2;
        let kp = steps * V;
        let tiles = n.div_ceil(NR);
        assert!(xt.len() == tiles * kp * NR && out.len() == (hi - lo) * n);
        assert!((panel.len(), sums.len()) == gemm_scratch_len(n, kp));
        let mut o = lo;
        while o < hi {
            let m = (hi - o).min(MR);
            let rows: [*const u8; MR] = std::array::from_fn(|i| base.add((o + i.min(m - 1)) * rb));
            pack_panel(src, &rows, m, units, panel);
            for l in 0..V {
                let w = panel.as_ptr().add(l * steps * MR);
                let mut s0 = 0;
                while s0 < steps {
                    let len = (steps - s0).min(KC);
                    for tile in 0..tiles {
                        let x = xt.as_ptr().add(tile * kp * NR + l * steps * NR + s0 * NR);
                        let acc = sums.as_mut_ptr().add((tile * V + l) * NR * MR);
                        lane_tile(w.add(s0 * MR), x, len, acc, s0 == 0);
                    }
                    s0 += len;
                }
            }
            // The tree over the lanes, 8 outputs at a time.
            for tile in 0..tiles {
                let lane = |l: usize, j: usize, h: usize| {
                    _mm256_loadu_ps(sums.as_ptr().add(((tile * V + l) * NR + j) * MR + 8 * h))
                };
                let tn = (n - tile * NR).min(NR);
                for j in 0..tn {
                    for h in 0..2 {
                        let a0 = _mm256_add_ps(lane(0, j, h), lane(4, j, h));
                        let a1 = _mm256_add_ps(lane(1, j, h), lane(5, j, h));
                        let a2 = _mm256_add_ps(lane(2, j, h), lane(6, j, h));
                        let a3 = _mm256_add_ps(lane(3, j, h), lane(7, j, h));
                        let s = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
                        let mut v = [0f32; 8];
                        _mm256_storeu_ps(v.as_mut_ptr(), s);
                        for (i, &x) in v.iter().enumerate() {
                            let r = 8 * h + i;
                            if r < m {
                                out[(o + r - lo) * n + tile * NR + j] = x;
                            }
                        }
                    }
                }
            }
            o += m;
        }
    }
}

macro_rules! entry {
    ($dot:ident, $gemm:ident, $src:ty) => {
        /// [`dot_range`] for this source.
        ///
        /// # Safety
        /// As [`dot_range`].
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $dot(
            src: $src,
            base: *const u8,
            rb: usize,
            units: usize,
            xs: &[f32],
            n: usize,
            lo: usize,
            hi: usize,
            out: &mut [f32],
        ) {
            // SAFETY: this entry's contract is `dot_range`'s, and it enables
            // the features `dot_range` needs.
            unsafe { dot_range(src, base, rb, units, xs, n, lo, hi, out) }
        }

        /// [`gemm_range`] for this source.
        ///
        /// # Safety
        /// As [`gemm_range`].
        #[target_feature(enable = "avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $gemm(
            src: $src,
            base: *const u8,
            rb: usize,
            units: usize,
            xt: &[f32],
            n: usize,
            lo: usize,
            hi: usize,
            out: &mut [f32],
            panel: &mut [f32],
            sums: &mut [f32],
        ) {
            // SAFETY: this entry's contract is `gemm_range`'s, and it enables
            // the features `gemm_range` needs.
            unsafe { gemm_range(src, base, rb, units, xt, n, lo, hi, out, panel, sums) }
        }
    };
}

entry!(dot_bf16, gemm_bf16, Bf16);
entry!(dot_f32, gemm_f32, F32);
entry!(dot_q8_0, gemm_q8_0, Q8_0);
entry!(dot_q4_0, gemm_q4_0, Q4_0);
entry!(dot_q2_k, gemm_q2_k, Q2K);
entry!(dot_q4_k, gemm_q4_k, Q4K);
entry!(dot_q3_k, gemm_q3_k, Q3K);
entry!(dot_q5_k, gemm_q5_k, Q5K);
entry!(dot_q6_k, gemm_q6_k, Q6K);
entry!(dot_fp8, gemm_fp8, Fp8);
