//! Integer dot products for `Q8_0` and `Q4_K` `wkv` (AVX512-VNNI): the
//! default for `Q4_K` unless the engine asks for the exact twin; `Q8_0`'s
//! measured slower than the exact path, so it runs only when asked for
//! (`Projection::set_int_dot_q8_0`; docs/numerics.md, "Integer dot
//! products").
//!
//! **Tokens.** Each token's row is quantised once per call ([`QTokens`]):
//! every block of [`QB`] values gets a power-of-two scale `dx = 2^(E - 6)`,
//! `E` the exponent of the block's largest magnitude (at least `2^-149`),
//! and each value `x` becomes `p = round_half_even(x / dx)`, clamped to
//! `+-127` (the division is exact, and a bf16 `x` has `|x / dx| <= 127.5`,
//! so `|x - dx p| <= dx / 2`). A block holding an infinity or a NaN gets
//! `dx = NaN` (every output of that token is then NaN). Per 32 values the
//! sum of the `p` times `dx` is kept as f32 (exact) for the `Q4_K` mins.
//!
//! **Order.** Integer sums are exact, so only the f32 steps have an order;
//! each output's is fixed whatever the batch, the tile or the thread count:
//! - `Q8_0`, per 256 values `u` and lane `l` (16 lanes; lanes 0..8 take block
//!   `2a`, lanes 8..16 block `2a + 1` of pair `a = 0..4`): `P = d_{2a|2a+1} *
//!   I_a` (`I_a` the lane's 4-product integer sum), then `P = fma(d, I, P)`
//!   for pairs 1..4, then `A = fma(dx_u, P, A)`; the output is `hsum(A)`.
//! - `Q4_K`, per 256 values `u`: an integer sum per lane `I = sum_a
//!   sum(sc * q * p)` (sub-block scales applied in 16-bit), then
//!   `A = fma(d * dx_u, I, A)` (16 lanes), and `M = fma(dmin * m_s, dx_u
//!   * sum_s(p), M)` (8 lanes, one per sub-block `s`); the output is
//!   `hsum(A) - hsum8(M)`.

use crate::batch::try_vec;
use crate::error::Result;
use crate::formats::{BlockQ4K, BlockQ8_0, GgmlBlock};
use std::arch::x86_64::*;

/// Values per token block (one scale each).
pub(crate) const QB: usize = 256;
/// Values per sub-block (one sum of codes each, for the `Q4_K` mins).
const SB: usize = 32;

/// The largest magnitude of a token block's value to its scale `dx`:
/// `2^(E - 6)` for `2^E <= amax < 2^(E + 1)`, at least `2^-149`; 1 for an
/// all-zero block, NaN for a non-finite one.
pub(crate) fn block_scale(amax: f32) -> f32 {
    if !amax.is_finite() {
        return f32::NAN;
    }
    if amax == 0.0 {
        return 1.0;
    }
    let bits = amax.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32;
    let e = if exp == 0 {
        // Subnormal: the exponent of its leading bit.
        -149 + (31 - bits.leading_zeros() as i32)
    } else {
        exp - 127
    };
    pow2((e - 6).max(-149))
}

/// `2^e` for `-149 <= e <= 127`, exactly.
fn pow2(e: i32) -> f32 {
    if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (e + 149))
    }
}

/// A call's tokens quantised for the integer dot products.
pub(crate) struct QTokens {
    /// `[n, k]` codes.
    pub q: Vec<i8>,
    /// `[n, k / QB]` block scales.
    pub dx: Vec<f32>,
    /// `[n, k / SB]`: each sub-block's sum of codes times its block's scale.
    pub bsx: Vec<f32>,
}

impl QTokens {
    /// Quantise `rows` (`[n, k]` bf16 bits, `k` a multiple of [`QB`]) with
    /// `scale` (the block scale of a block's largest magnitude:
    /// [`block_scale`], or another in tests).
    pub(crate) fn new(rows: &[u16], n: usize, k: usize, scale: fn(f32) -> f32) -> Result<QTokens> {
        assert!(k.is_multiple_of(QB) && rows.len() == n * k);
        let mut q = try_vec(n * k, 0i8, "the quantised token rows")?;
        let mut dx = try_vec(n * k / QB, 0f32, "the token block scales")?;
        let mut bsx = try_vec(n * k / SB, 0f32, "the token sub-block sums")?;
        for (b, (src, dst)) in rows
            .chunks_exact(QB)
            .zip(q.chunks_exact_mut(QB))
            .enumerate()
        {
            let x = |i: usize| crate::formats::bf16_to_f32(src[i]);
            let amax = (0..QB).fold(0f32, |m, i| {
                let a = x(i).abs();
                if a > m || a.is_nan() {
                    a
                } else {
                    m
                }
            });
            let d = scale(amax);
            dx[b] = d;
            for (s, sub) in dst.chunks_exact_mut(SB).enumerate() {
                let mut sum = 0i32;
                for (j, p) in sub.iter_mut().enumerate() {
                    let v = if d.is_finite() {
                        (x(s * SB + j) / d).round_ties_even().clamp(-127.0, 127.0)
                    } else {
                        0.0
                    };
                    *p = v as i8;
                    sum += v as i32;
                }
                bsx[b * (QB / SB) + s] = sum as f32 * d;
            }
        }
        Ok(QTokens { q, dx, bsx })
    }
}

/// The 16 lanes of `v` by [`super::hsum`]'s tree.
#[inline(always)]
unsafe fn hsum16(v: __m512) -> f32 {
    // SAFETY: register arithmetic only (the callers' avx512f).
    unsafe { super::hsum(v) }
}

/// The 8 lanes of `v` added by one fixed tree (halves, then halves).
#[inline(always)]
unsafe fn hsum8(v: __m256) -> f32 {
    // SAFETY: register arithmetic only (avx).
    unsafe {
        let b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
        _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps::<1>(c, c)))
    }
}

/// The f16 at `p` as f32.
///
/// # Safety
/// Two readable bytes at `p`; f16c.
#[inline(always)]
unsafe fn f16(p: *const u8) -> f32 {
    // SAFETY: the two bytes are readable (the contract), and the
    // conversion is f16c's.
    unsafe {
        let h = _mm_cvtsi32_si128((p as *const u16).read_unaligned() as i32);
        _mm_cvtss_f32(_mm_cvtph_ps(h))
    }
}

/// The 8 scales then the 8 mins of a `Q4_K` block (6 bits each, packed in
/// the 12 bytes at `p`), as `unpack_scales_k4` gives them, in one register.
///
/// # Safety
/// 16 readable bytes at `p` (the scales and the first codes of a whole
/// block); avx2.
#[inline(always)]
unsafe fn scales_k4(p: *const u8) -> __m128i {
    // SAFETY: the 16-byte load is readable (the contract); the rest is
    // register arithmetic.
    unsafe {
        // Dwords w0, w1, w2 (the fourth is codes, unused).
        let v = _mm_loadu_si128(p as *const __m128i);
        let low6 = _mm_set1_epi32(0x3f3f_3f3f);
        let low4 = _mm_set1_epi32(0x0f0f_0f0f);
        let low2 = _mm_set1_epi32(0x0303_0303);
        // Lane 0: scales 0..4 (w0's low 6 bits), lane 1: mins 0..4 (w1's).
        let lo = _mm_and_si128(v, low6);
        // Lane 0: scales 4..8 (w2's low nibbles, w0's top 2 bits above
        // them), lane 1: mins 4..8 (w2's high nibbles, w1's top bits).
        let w2 = _mm_shuffle_epi32::<0b1010_1010>(v);
        let nib = _mm_and_si128(_mm_srlv_epi32(w2, _mm_setr_epi32(0, 4, 0, 0)), low4);
        let top = _mm_slli_epi32::<4>(_mm_and_si128(_mm_srli_epi32::<6>(v), low2));
        let hi = _mm_or_si128(nib, top);
        // Bytes: scales 0..4, 4..8, then mins 0..4, 4..8.
        _mm_unpacklo_epi32(lo, hi)
    }
}

/// Where a tile's tokens are: codes, block scales and sub-block sums of
/// token `t0 + j` for `j < TT`.
struct Toks<const TT: usize> {
    q: [*const i8; TT],
    dx: [*const f32; TT],
    bsx: [*const f32; TT],
}

/// A tile of `R` `Q8_0` rows against `TT` tokens over all `k` values.
///
/// # Safety
/// avx512f, avx512bw, avx512vnni, f16c; the rows are whole rows of `k /
/// 32` blocks; the tokens hold `k` codes and `k / QB` scales.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
unsafe fn tile_q8_0<const R: usize, const TT: usize>(
    rows: &[*const u8; R],
    x: &Toks<TT>,
    k: usize,
) -> [[f32; TT]; R] {
    // SAFETY: every load is inside a row's blocks or a token's codes and
    // scales (the contract); the rest is register arithmetic.
    unsafe {
        let zi = _mm512_setzero_si512();
        let mut a = [[_mm512_setzero_ps(); TT]; R];
        let mut p = [[_mm512_setzero_ps(); TT]; R];
        let bb = BlockQ8_0::BYTES;
        for u in 0..k / QB {
            for pr in 0..QB / 64 {
                let b = u * (QB / 32) + 2 * pr;
                let mut wa = [zi; R];
                let mut wm = [0u64; R];
                let mut dw = [_mm512_setzero_ps(); R];
                for i in 0..R {
                    let blk = rows[i].add(b * bb);
                    let lo = _mm256_loadu_si256(blk.add(BlockQ8_0::QS) as *const __m256i);
                    let hi = _mm256_loadu_si256(blk.add(bb + BlockQ8_0::QS) as *const __m256i);
                    let w = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                    wa[i] = _mm512_abs_epi8(w);
                    wm[i] = _mm512_movepi8_mask(w);
                    let d0 = _mm256_set1_ps(f16(blk));
                    let d1 = _mm256_set1_ps(f16(blk.add(bb)));
                    dw[i] = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(d0), d1);
                }
                for j in 0..TT {
                    let xv = _mm512_loadu_si512(x.q[j].add(u * QB + 64 * pr) as *const _);
                    for i in 0..R {
                        // |w| times p with w's sign: w * p, 4 to a lane.
                        let xs = _mm512_mask_sub_epi8(xv, wm[i], zi, xv);
                        let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zi, wa[i], xs));
                        p[i][j] = if pr == 0 {
                            _mm512_mul_ps(dw[i], s)
                        } else {
                            _mm512_fmadd_ps(dw[i], s, p[i][j])
                        };
                    }
                }
            }
            for j in 0..TT {
                let d = _mm512_set1_ps(*x.dx[j].add(u));
                for i in 0..R {
                    a[i][j] = _mm512_fmadd_ps(d, p[i][j], a[i][j]);
                }
            }
        }
        let mut out = [[0f32; TT]; R];
        for i in 0..R {
            for j in 0..TT {
                out[i][j] = hsum16(a[i][j]);
            }
        }
        out
    }
}

/// A tile of `R` `Q4_K` rows against `TT` tokens over all `k` values.
///
/// # Safety
/// As [`tile_q8_0`], with whole `Q4_K` rows and the tokens' `k / SB` sums.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // register tiles indexed as in the math
unsafe fn tile_q4_k<const R: usize, const TT: usize>(
    rows: &[*const u8; R],
    x: &Toks<TT>,
    k: usize,
) -> [[f32; TT]; R] {
    // SAFETY: every load is inside a row's blocks or a token's codes, scales
    // and sums (the contract); the rest is register arithmetic.
    unsafe {
        let zi = _mm512_setzero_si512();
        let nib = _mm512_set1_epi8(0x0F);
        let mut a = [[_mm512_setzero_ps(); TT]; R];
        let mut m = [[_mm256_setzero_ps(); TT]; R];
        // Words 0..16 from sub-block 2a's scale, 16..32 from 2a + 1's.
        let idx = |s: i16| _mm512_inserti64x4::<1>(_mm512_set1_epi16(s), _mm256_set1_epi16(s + 1));
        let sidx = [idx(0), idx(2), idx(4), idx(6)];
        for u in 0..k / QB {
            for i in 0..R {
                let blk = rows[i].add(u * BlockQ4K::BYTES);
                let sm = scales_k4(blk.add(BlockQ4K::SCALES));
                let sc = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(sm));
                let mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(sm, sm)));
                let mf = _mm256_mul_ps(_mm256_set1_ps(f16(blk.add(BlockQ4K::DMIN))), mn);
                let d = f16(blk);
                let mut qv = [zi; 4];
                let mut sv = [zi; 4];
                for pr in 0..4 {
                    let raw = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                        blk.add(BlockQ4K::QS + 32 * pr) as *const __m256i,
                    ));
                    // Low nibbles (sub-block 2a) in bytes 0..32, high ones
                    // (2a + 1) in 32..64.
                    let sh = _mm512_mask_srli_epi16(raw, 0xFFFF_0000, raw, 4);
                    qv[pr] = _mm512_and_si512(sh, nib);
                    sv[pr] = _mm512_permutexvar_epi16(sidx[pr], sc);
                }
                for j in 0..TT {
                    let xq = x.q[j].add(u * QB);
                    let mut is = zi;
                    for pr in 0..4 {
                        let xv = _mm512_loadu_si512(xq.add(64 * pr) as *const _);
                        let t = _mm512_maddubs_epi16(qv[pr], xv);
                        is = _mm512_dpwssd_epi32(is, t, sv[pr]);
                    }
                    let dd = _mm512_set1_ps(d * *x.dx[j].add(u));
                    a[i][j] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(is), a[i][j]);
                    let bs = _mm256_loadu_ps(x.bsx[j].add(u * (QB / SB)));
                    m[i][j] = _mm256_fmadd_ps(mf, bs, m[i][j]);
                }
            }
        }
        let mut out = [[0f32; TT]; R];
        for i in 0..R {
            for j in 0..TT {
                out[i][j] = hsum16(a[i][j]) - hsum8(m[i][j]);
            }
        }
        out
    }
}

/// Tokens per token block: their codes (`TBQ * k` bytes, 384 KB at the
/// V4.1 geometry) stay in L2 while every row tile of a task passes over
/// them, each tile summing all of `k` in registers.
const TBQ: usize = 64;

macro_rules! range_int {
    ($name:ident, $tile:ident, $rmax:literal, $wide:literal) => {
        /// Rows `lo..hi` (row `o` at `base + o * rb`) against all `n` tokens of
        /// `x` into `out` (`[hi - lo, n]`, f32 sums: the caller rounds them),
        /// by integer dot products (see the module's notes for the order).
        ///
        /// # Safety
        /// The CPU has avx512f, avx512bw, avx512vnni, avx2, fma and f16c;
        /// `k` is a multiple of `QB`; rows `lo..hi` are whole rows of the format.
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
        #[allow(clippy::too_many_arguments)]
        pub(crate) unsafe fn $name(
            base: *const u8,
            rb: usize,
            x: &QTokens,
            n: usize,
            k: usize,
            lo: usize,
            hi: usize,
            out: &mut [f32],
        ) -> Result<()> {
            assert!(k.is_multiple_of(QB) && out.len() == (hi - lo) * n);
            assert!(x.q.len() == n * k && x.dx.len() * QB == n * k && x.bsx.len() * SB == n * k);
            let toks = |t0: usize| {
                let mut tk = Toks {
                    q: [x.q.as_ptr(); 8],
                    dx: [x.dx.as_ptr(); 8],
                    bsx: [x.bsx.as_ptr(); 8],
                };
                for j in 0..8.min(n - t0) {
                    tk.q[j] = x.q.as_ptr().wrapping_add((t0 + j) * k);
                    tk.dx[j] = x.dx.as_ptr().wrapping_add((t0 + j) * k / QB);
                    tk.bsx[j] = x.bsx.as_ptr().wrapping_add((t0 + j) * k / SB);
                }
                tk
            };
            // SAFETY: the tiles read rows `o..o + r <= hi` (whole rows by the
            // contract) and tokens `t..t + tt <= n` (the asserts above size
            // them); `out` is indexed with bounds checks.
            unsafe {
                macro_rules! tile {
                    ($r:literal, $t:literal, $o:expr, $t0:expr) => {{
                        let (o, t0): (usize, usize) = ($o, $t0);
                        let mut rows = [base; $r];
                        for (i, r) in rows.iter_mut().enumerate() {
                            *r = base.add((o + i) * rb);
                        }
                        let tk = toks(t0);
                        let xt = Toks::<$t> {
                            q: std::array::from_fn(|j| tk.q[j]),
                            dx: std::array::from_fn(|j| tk.dx[j]),
                            bsx: std::array::from_fn(|j| tk.bsx[j]),
                        };
                        let s = $tile::<$r, $t>(&rows, &xt, k);
                        for i in 0..$r {
                            for j in 0..$t {
                                out[(o + i - lo) * n + t0 + j] = s[i][j];
                            }
                        }
                    }};
                }
                macro_rules! tokens {
                    ($r:literal, $o:expr, $t0:expr, $tt:expr) => {
                        match $tt {
                            1 => tile!($r, 1, $o, $t0),
                            2 => tile!($r, 2, $o, $t0),
                            3 => tile!($r, 3, $o, $t0),
                            _ => tile!($r, 4, $o, $t0),
                        }
                    };
                }
                let mut tb = 0;
                while tb < n {
                    let te = (tb + TBQ).min(n);
                    let mut o = lo;
                    while o < hi {
                        // Decode: 4 rows a tile (one token's registers
                        // leave room); the tile shape never changes a sum.
                        let rmax = if n == 1 { 4 } else { $rmax };
                        let r = (hi - o).min(rmax);
                        let mut t = tb;
                        while t < te {
                            if $wide && te - t >= 8 {
                                // 8 tokens a row: each row's decoded codes
                                // and scales serve twice as many tokens.
                                for q in o..o + r {
                                    tile!(1, 8, q, t);
                                }
                                t += 8;
                                continue;
                            }
                            let tt = (te - t).min(4);
                            if r == 4 && n == 1 {
                                tile!(4, 1, o, t);
                            } else if r == $rmax {
                                tokens!($rmax, o, t, tt);
                            } else {
                                for q in o..o + r {
                                    tokens!(1, q, t, tt);
                                }
                            }
                            t += tt;
                        }
                        o += r;
                    }
                    tb = te;
                }
            }
            Ok(())
        }
    };
}

range_int!(range_q8_0_int, tile_q8_0, 2, false);
range_int!(range_q4_k_int, tile_q4_k, 2, true);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::projection::avx2::sources::unpack_scales_k4;

    /// `scales_k4` unpacks as the reference `unpack_scales_k4` on every
    /// byte value in every position (and random blocks).
    #[test]
    fn packed_scales_unpack_as_the_reference() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        let mut cases: Vec<[u8; 16]> = Vec::new();
        for pos in 0..12 {
            for v in 0..=255u8 {
                let mut b = [0x5Au8; 16];
                b[pos] = v;
                cases.push(b);
            }
        }
        let mut z = 0x1234_5678_9ABC_DEF0u64;
        for _ in 0..4096 {
            let mut b = [0u8; 16];
            for x in b.iter_mut() {
                z ^= z << 13;
                z ^= z >> 7;
                z ^= z << 17;
                *x = z as u8;
            }
            cases.push(b);
        }
        for b in cases {
            let want = unpack_scales_k4(b[..12].try_into().unwrap());
            let mut got = [0u8; 16];
            // SAFETY: 16 readable bytes; avx2 checked above (srlv).
            unsafe {
                _mm_storeu_si128(got.as_mut_ptr() as *mut __m128i, scales_k4(b.as_ptr()));
            }
            assert_eq!(got, want, "scales {:x?}", &b[..12]);
        }
    }
}
