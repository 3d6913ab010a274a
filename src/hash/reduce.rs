//! The modulo of the hash without a division: a floating-point quotient and
//! an exact correction, in scalar form ([`rem_fast`]), AVX-512 form ([`simd`],
//! 8 heads at a time, the correction in 64-bit integers) and AVX2 form for
//! primes below 2^31 ([`narrow`], 4 heads at a time, the correction in 32-bit
//! integers: no 64-bit multiply, which AVX2 lacks and AVX-512 issues slowly).

/// `x.rem_euclid(p)` without a division, for `p` in `[2^14, 2^62)` and
/// `inv = 1.0 / p as f64`.
///
/// `x as f64` is within 2^9 of `x` and the product carries two more roundings
/// of 2^-53, so the quotient estimate is within `(2^9 + 2^11) / p < 0.16` of
/// `x / p`; truncated, it is within 1.16 of `x / p`. The remainder from it,
/// computed in wrapping i64 (exact, as the true value is small), lies in
/// `(-1.16 p, 1.16 p)`: at most two additions of `p` or one subtraction make it
/// exact. (Truncation, not `floor`, because `floor` is a library call on
/// baseline x86-64.)
#[inline(always)]
pub fn rem_fast(x: i64, p: i64, inv: f64) -> i64 {
    let q = (x as f64 * inv) as i64;
    let mut r = x.wrapping_sub(q.wrapping_mul(p));
    if r < 0 {
        r += p;
    }
    if r < 0 {
        r += p;
    }
    if r >= p {
        r -= p;
    }
    r
}

/// A run of a batch's tokens for [`crate::hash::HashTables::hash_runs`]:
/// `len` tokens whose look-back windows slide over `xs[x..x + len + N - 1]`
/// (token `j`'s window, look-backs `0..N`, is `xs[x + j + N - 1]`,
/// `xs[x + j + N - 2]`, ..., `xs[x + j]`), or, with `x == Run::DEAD`, `len`
/// dead tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub x: usize,
    pub len: usize,
}

impl Run {
    /// `x` of a run of dead tokens.
    pub(crate) const DEAD: usize = usize::MAX;
}

/// Walk `runs`: fill each dead run's rows of `out` with `dead`; for every
/// other token, layer `l` and look-back `k` in `1..N`, call
/// `cols(rolling, c, row, H)` with the rolling hash of look-backs `0..=k`,
/// the first column `c = l*C + (k-1)*H` of the `H` columns it reduces into,
/// and the token's row of `out`. The reductions below run this inside their own
/// target-feature functions, so that it and `cols` inline there.
///
/// `NN`, `H` and `NL`, when not 0, are `nn`, `h` and the number of layers
/// known at compile time (the loops over layers, look-backs and heads
/// unrolled, `c` a constant in each call of `cols`); 0 reads them from `nn`,
/// `h` and `multipliers`.
///
/// # Safety
/// `multipliers` holds `L*N` values, `N >= 2`; `out` holds `sum(len) * L*C`
/// ids with `C = (N-1)*H`; every run that is not dead has
/// `x + len + N - 1 <= xs.len()` ([`crate::hash::HashTables::hash_runs`]
/// checks all of it). `cols` writes at most the row's `L*C` ids.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn slide<const NN: usize, const H: usize, const NL: usize>(
    xs: &[i64],
    runs: &[Run],
    nn: usize,
    h: usize,
    multipliers: &[i64],
    dead: i64,
    out: &mut [i64],
    mut cols: impl FnMut(i64, usize, *mut i64, usize),
) {
    let nn = if NN > 0 { NN } else { nn };
    let h = if H > 0 { H } else { h };
    let nl = if NL > 0 { NL } else { multipliers.len() / nn };
    let row = nl * (nn - 1) * h;
    let mut dst = out.as_mut_ptr();
    // SAFETY: the contract above: each run's rows follow the previous run's
    // inside `out`, and its windows lie inside `xs`.
    unsafe {
        for r in runs {
            if r.x == Run::DEAD {
                std::slice::from_raw_parts_mut(dst, r.len * row).fill(dead);
                dst = dst.add(r.len * row);
                continue;
            }
            let mut w0 = xs.as_ptr().add(r.x + nn - 1);
            let end = w0.add(r.len);
            while w0 < end {
                let mut c = 0;
                let mut m = multipliers.as_ptr();
                for _ in 0..nl {
                    let mut rolling = (*w0).wrapping_mul(*m);
                    for k in 1..nn {
                        rolling ^= (*w0.sub(k)).wrapping_mul(*m.add(k));
                        cols(rolling, c, dst, h);
                        c += h;
                    }
                    m = m.add(nn);
                }
                w0 = w0.add(1);
                dst = dst.add(row);
            }
        }
    }
}

/// [`slide`] with DeepSeek-V4.1's geometry (`N` 4, `H` 8) known at compile
/// time when the tables have it.
macro_rules! slide_fixed {
    ($xs:expr, $runs:expr, $nn:expr, $h:expr, $m:expr, $dead:expr, $out:expr, $cols:expr) => {
        if ($nn, $h) == (4, 8) {
            super::slide::<4, 8, 0>($xs, $runs, $nn, $h, $m, $dead, $out, $cols)
        } else {
            super::slide::<0, 0, 0>($xs, $runs, $nn, $h, $m, $dead, $out, $cols)
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    use super::Run;
    use std::arch::x86_64::*;

    /// `h` columns from column pointers, 8 heads at a time, with the same
    /// reduction as [`super::rem_fast`] in AVX-512 (DQ for the 64-bit
    /// conversions and multiply).
    ///
    /// # Safety
    /// avx512f and avx512dq; `h` a multiple of 8; each pointer has `h` values.
    #[inline(always)]
    unsafe fn cols(
        rolling: i64,
        pp: *const i64,
        ip: *const f64,
        op: *const i64,
        dst: *mut i64,
        h: usize,
    ) {
        // SAFETY: the caller has avx512f and avx512dq, which every intrinsic here needs;
        // `h` is a multiple of 8, so each 8-lane load at `pp`, `ip`, `op`
        // `+ j` and store at `dst + j` (`j + 8 <= h`) stays inside the `h`
        // values each pointer has.
        unsafe {
            let x = _mm512_set1_epi64(rolling);
            let xf = _mm512_cvtepi64_pd(x);
            let zero = _mm512_setzero_si512();
            for j in (0..h).step_by(8) {
                let p = _mm512_loadu_si512(pp.add(j) as *const _);
                let iv = _mm512_loadu_pd(ip.add(j));
                let o = _mm512_loadu_si512(op.add(j) as *const _);
                let q = _mm512_cvttpd_epi64(_mm512_mul_pd(xf, iv));
                let mut r = _mm512_sub_epi64(x, _mm512_mullo_epi64(q, p));
                let m = _mm512_cmplt_epi64_mask(r, zero);
                r = _mm512_mask_add_epi64(r, m, r, p);
                let m = _mm512_cmplt_epi64_mask(r, zero);
                r = _mm512_mask_add_epi64(r, m, r, p);
                let m = _mm512_cmpge_epi64_mask(r, p);
                r = _mm512_mask_sub_epi64(r, m, r, p);
                _mm512_storeu_si512(dst.add(j) as *mut _, _mm512_add_epi64(r, o));
            }
        }
    }

    /// Row ids of every run (see [`super::slide`]).
    ///
    /// # Safety
    /// As [`super::slide`] and [`cols`]; the column arrays hold `L*C`.
    #[target_feature(enable = "avx512f,avx512dq")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn runs(
        xs: &[i64],
        runs: &[Run],
        nn: usize,
        h: usize,
        multipliers: &[i64],
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        dead: i64,
        out: &mut [i64],
    ) {
        let (pp, ip, op) = (primes.as_ptr(), inv.as_ptr(), offsets.as_ptr());
        // SAFETY: the contract above; column `c` and its `h` successors lie
        // in the tables and in the token's row.
        unsafe {
            slide_fixed!(xs, runs, nn, h, multipliers, dead, out, |r, c, row, h| {
                cols(r, pp.add(c), ip.add(c), op.add(c), row.add(c), h)
            })
        }
    }

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }
}

/// Primes the 32-bit reductions ([`narrow`], [`wide`]) take: `[2^14, 2^31)`.
pub const NARROW_PRIMES: std::ops::Range<u64> = 1 << 14..1 << 31;

/// `1.5 * 2^52`: added to a double of magnitude below 2^51, it leaves the
/// nearest integer in the low bits of the mantissa (two's complement).
#[cfg(target_arch = "x86_64")]
const MAGIC: f64 = 6_755_399_441_055_744.0;

#[cfg(target_arch = "x86_64")]
pub(crate) mod narrow {
    use super::{Run, MAGIC};
    use std::arch::x86_64::*;

    /// `h` columns from column pointers, 4 heads at a time:
    /// `rem_euclid(x, p) + offset` for `p` in [`super::NARROW_PRIMES`] and
    /// `inv = 1/p`.
    ///
    /// The quotient `q = round(fl(x) * inv)` comes from one FMA with `MAGIC`
    /// (the exact product, rounded once to an integer). `fl(x)` is within 2^10
    /// of `x` and `inv` within 2^-53 of `1/p`, so `fl(x) * inv` is within
    /// `2^11 / p <= 1/8` of `x / p` and `|q - x/p| <= 5/8`: the remainder
    /// `x - q p` lies in `[-5/8 p, 5/8 p]`, inside the i32 range for
    /// `p < 2^31`. So it is computed exactly in wrapping 32-bit arithmetic from
    /// the low 32 bits of `x`, `q` and `p` (`vpmuludq`, `vpsubd`), and one
    /// conditional addition of `p` (an unsigned minimum) makes it the
    /// Euclidean remainder. `x as f64` is converted into a zeroed register
    /// (no false dependency chaining one conversion to the previous one's).
    ///
    /// # Safety
    /// avx2 and fma; `h` a multiple of 4; each pointer has `h` values; every
    /// prime lies in [`super::NARROW_PRIMES`].
    #[inline(always)]
    unsafe fn cols(
        rolling: i64,
        pp: *const i64,
        ip: *const f64,
        op: *const i64,
        dst: *mut i64,
        h: usize,
    ) {
        // SAFETY: the caller has avx2 and fma, which every intrinsic here needs;
        // `h` is a multiple of 4, so each 4-lane load at `pp`, `ip`, `op`
        // `+ j` and store at `dst + j` (`j + 4 <= h`) stays inside the `h`
        // values each pointer has.
        unsafe {
            let xf = _mm256_broadcastsd_pd(_mm_cvtsi64_sd(_mm_setzero_pd(), rolling));
            let x = _mm256_set1_epi64x(rolling);
            let magic = _mm256_set1_pd(MAGIC);
            let zero = _mm256_setzero_si256();
            for j in (0..h).step_by(4) {
                let p = _mm256_loadu_si256(pp.add(j) as *const _);
                let iv = _mm256_loadu_pd(ip.add(j));
                let q = _mm256_castpd_si256(_mm256_fmadd_pd(xf, iv, magic));
                let r = _mm256_sub_epi32(x, _mm256_mul_epu32(q, p));
                // r in [0, p) stays below r + p < 2^32; r in [-p, 0) is
                // 2^32 + r as unsigned, and r + p wraps to [0, p): the
                // unsigned minimum is the Euclidean remainder either way.
                let r = _mm256_min_epu32(r, _mm256_add_epi32(r, p));
                let o = _mm256_loadu_si256(op.add(j) as *const _);
                _mm256_storeu_si256(
                    dst.add(j) as *mut _,
                    _mm256_add_epi64(_mm256_blend_epi32::<0b1010_1010>(r, zero), o),
                );
            }
        }
    }

    /// The columns of one look-back of one layer (see [`cols`]), for the
    /// tests.
    ///
    /// # Safety
    /// The CPU must have avx2 and fma; `out` holds a multiple of 4 values and
    /// the other slices at least as many; every prime lies in
    /// [`super::NARROW_PRIMES`].
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn columns(
        rolling: i64,
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        out: &mut [i64],
    ) {
        // SAFETY: `cols` needs avx2 and fma (this function's target features,
        // which the caller's CPU has) and `h = out.len()` a multiple of 4; it
        // reads `h` values from each of `primes`, `inv` and `offsets`, which the
        // caller makes as long as `out`, and writes `h` into `out`.
        unsafe {
            let (pp, ip, op) = (primes.as_ptr(), inv.as_ptr(), offsets.as_ptr());
            cols(rolling, pp, ip, op, out.as_mut_ptr(), out.len());
        }
    }

    /// Row ids of every run (see [`super::slide`]).
    ///
    /// # Safety
    /// As [`super::slide`] and [`cols`]; the column arrays hold `L*C`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn runs(
        xs: &[i64],
        runs: &[Run],
        nn: usize,
        h: usize,
        multipliers: &[i64],
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        dead: i64,
        out: &mut [i64],
    ) {
        let (pp, ip, op) = (primes.as_ptr(), inv.as_ptr(), offsets.as_ptr());
        // SAFETY: the contract above; column `c` and its `h` successors lie
        // in the tables and in the token's row.
        unsafe {
            slide_fixed!(xs, runs, nn, h, multipliers, dead, out, |r, c, row, h| {
                cols(r, pp.add(c), ip.add(c), op.add(c), row.add(c), h)
            })
        }
    }

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
}

/// The 32-bit reduction of [`narrow`] in AVX-512: 8 heads at a time.
#[cfg(target_arch = "x86_64")]
pub(crate) mod wide {
    use super::{Run, MAGIC};
    use std::arch::x86_64::*;

    /// `h` columns from column pointers, 8 heads at a time, with the
    /// reduction of [`super::narrow`] (the same FMA quotient and 32-bit
    /// correction, so the same bound). The unsigned minimum zeroes each
    /// lane's high half under a mask, which also widens it to 64 bits.
    ///
    /// # Safety
    /// avx512f and avx512dq; `h` a multiple of 8; each pointer has `h`
    /// values; every prime lies in [`super::NARROW_PRIMES`].
    #[inline(always)]
    unsafe fn cols(
        rolling: i64,
        pp: *const i64,
        ip: *const f64,
        op: *const i64,
        dst: *mut i64,
        h: usize,
    ) {
        // SAFETY: the caller has avx512f and avx512dq, which every intrinsic here needs;
        // `h` is a multiple of 8, so each 8-lane load at `pp`, `ip`, `op`
        // `+ j` and store at `dst + j` (`j + 8 <= h`) stays inside the `h`
        // values each pointer has.
        unsafe {
            for j in (0..h).step_by(8) {
                let p = _mm512_loadu_si512(pp.add(j) as *const _);
                let iv = _mm512_loadu_pd(ip.add(j));
                let o = _mm512_loadu_si512(op.add(j) as *const _);
                _mm512_storeu_si512(dst.add(j) as *mut _, col8(rolling, p, iv, o));
            }
        }
    }

    /// 8 columns: `rem_euclid(x, p) + o` in 64-bit lanes (see [`cols`]).
    ///
    /// # Safety
    /// avx512f and avx512dq; every prime in [`super::NARROW_PRIMES`].
    #[inline(always)]
    unsafe fn col8(rolling: i64, p: __m512i, iv: __m512d, o: __m512i) -> __m512i {
        // SAFETY: register arithmetic on the arguments only, no memory read
        // or written; the AVX-512 F and DQ instructions it uses are the
        // features this function's caller has (its contract).
        unsafe {
            let x = _mm512_set1_epi64(rolling);
            // The same round-to-nearest conversion as `rolling as f64`.
            let xf = _mm512_cvtepi64_pd(x);
            let q = _mm512_castpd_si512(_mm512_fmadd_pd(xf, iv, _mm512_set1_pd(MAGIC)));
            let r = _mm512_sub_epi32(x, _mm512_mul_epu32(q, p));
            let r = _mm512_maskz_min_epu32(0x5555, r, _mm512_add_epi32(r, p));
            _mm512_add_epi64(r, o)
        }
    }

    /// The columns of one look-back of one layer (see [`cols`]), for the
    /// tests.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512dq; `out` holds a multiple of 8
    /// values and the other slices at least as many; every prime lies in
    /// [`super::NARROW_PRIMES`].
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn columns(
        rolling: i64,
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        out: &mut [i64],
    ) {
        // SAFETY: `cols` needs avx512f and avx512dq (this function's target features,
        // which the caller's CPU has) and `h = out.len()` a multiple of 8; it
        // reads `h` values from each of `primes`, `inv` and `offsets`, which the
        // caller makes as long as `out`, and writes `h` into `out`.
        unsafe {
            let (pp, ip, op) = (primes.as_ptr(), inv.as_ptr(), offsets.as_ptr());
            cols(rolling, pp, ip, op, out.as_mut_ptr(), out.len());
        }
    }

    /// Row ids of every run (see [`super::slide`]).
    ///
    /// # Safety
    /// As [`super::slide`] and [`cols`]; the column arrays hold `L*C`.
    #[target_feature(enable = "avx512f,avx512dq")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn runs(
        xs: &[i64],
        runs: &[Run],
        nn: usize,
        h: usize,
        multipliers: &[i64],
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        dead: i64,
        out: &mut [i64],
    ) {
        let (pp, ip, op) = (primes.as_ptr(), inv.as_ptr(), offsets.as_ptr());
        // SAFETY: the contract above; column `c` and its `h` successors lie
        // in the tables and in the token's row.
        unsafe {
            if (nn, h, multipliers.len()) == (4, 8, 8) {
                // DeepSeek-V4.1: two layers of 3 look-backs of 8 heads, 6
                // vectors whose primes, inverses and offsets stay in 18
                // registers across the batch.
                let p: [__m512i; 6] =
                    std::array::from_fn(|v| _mm512_loadu_si512(pp.add(8 * v) as *const _));
                let iv: [__m512d; 6] = std::array::from_fn(|v| _mm512_loadu_pd(ip.add(8 * v)));
                let o: [__m512i; 6] =
                    std::array::from_fn(|v| _mm512_loadu_si512(op.add(8 * v) as *const _));
                super::slide::<4, 8, 2>(xs, runs, nn, h, multipliers, dead, out, |r, c, row, _| {
                    let v = c / 8;
                    _mm512_storeu_si512(row.add(c) as *mut _, col8(r, p[v], iv[v], o[v]))
                })
            } else {
                slide_fixed!(xs, runs, nn, h, multipliers, dead, out, |r, c, row, h| {
                    cols(r, pp.add(c), ip.add(c), op.add(c), row.add(c), h)
                })
            }
        }
    }

    pub fn available() -> bool {
        super::simd::available()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rem_fast_equals_rem_euclid() {
        let mut z = 1u64;
        let mut next = || {
            z = z.wrapping_add(0x9e3779b97f4a7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
            x ^ (x >> 31)
        };
        let primes = [
            1i64 << 14,
            16_000_057,
            16_777_259,
            (1 << 31) - 1,
            (1 << 61) - 1,
            (1 << 62) - 57,
        ];
        let edges = [0i64, 1, -1, i64::MAX, i64::MIN, i64::MIN + 1, i64::MAX - 1];
        for &p in &primes {
            let inv = 1.0 / p as f64;
            for &x in &edges {
                assert_eq!(rem_fast(x, p, inv), x.rem_euclid(p), "{x} mod {p}");
            }
            for m in [-2i64, -1, 1, 2, 1 << 20] {
                for d in -3..=3 {
                    let x = (p.wrapping_mul(m)).wrapping_add(d);
                    assert_eq!(rem_fast(x, p, inv), x.rem_euclid(p), "{x} mod {p}");
                }
            }
            for _ in 0..200_000 {
                let x = next() as i64;
                assert_eq!(rem_fast(x, p, inv), x.rem_euclid(p), "{x} mod {p}");
            }
        }
    }

    /// The 32-bit corrections (AVX2 and AVX-512) equal `rem_euclid` at the
    /// edges of the i64 range, at and around multiples of each prime
    /// (negative ones too), for the smallest and largest primes they take,
    /// and on random values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn narrow_equals_rem_euclid() {
        type Columns = unsafe fn(i64, &[i64], &[f64], &[i64], &mut [i64]);
        let forms: Vec<(&str, Columns)> = [
            ("avx2", narrow::available(), narrow::columns as _),
            ("avx512", wide::available(), wide::columns as _),
        ]
        .into_iter()
        .filter(|&(name, ok, _)| {
            if !ok {
                eprintln!("{name}: not on this CPU, not tested");
            }
            ok
        })
        .map(|(name, _, f)| (name, f))
        .collect();
        let mut z = 5u64;
        let mut next = || {
            z = z.wrapping_add(0x9e3779b97f4a7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            x ^ (x >> 31)
        };
        let primes: [i64; 8] = [
            16_411, // the first prime above 2^14
            16_000_057,
            16_000_889,
            (1 << 30) - 35,
            (1 << 30) + 3,
            (1 << 31) - 1, // the largest prime below 2^31
            2_147_483_629,
            1_000_000_007,
        ];
        let inv: Vec<f64> = primes.iter().map(|&p| 1.0 / p as f64).collect();
        let offsets: Vec<i64> = (0..8).map(|i| i * 1_000_000_000_000).collect();
        let mut xs: Vec<i64> = vec![0, 1, -1, i64::MAX, i64::MIN, i64::MIN + 1, i64::MAX - 1];
        for &p in &primes {
            for m in [
                -(1i64 << 40),
                -3,
                -2,
                -1,
                1,
                2,
                1 << 20,
                1 << 32,
                i64::MAX / p,
            ] {
                for d in -3..=3 {
                    xs.push(p.wrapping_mul(m).wrapping_add(d));
                }
            }
        }
        xs.extend((0..200_000).map(|_| next() as i64));
        let mut out = [0i64; 8];
        for (name, columns) in &forms {
            for &x in &xs {
                // SAFETY: the form's CPU features checked above; 8 columns;
                // primes in NARROW_PRIMES.
                unsafe { columns(x, &primes, &inv, &offsets, &mut out) };
                for c in 0..8 {
                    assert_eq!(
                        out[c],
                        x.rem_euclid(primes[c]) + offsets[c],
                        "{name}: {x} mod {}",
                        primes[c]
                    );
                }
            }
        }
    }
}
