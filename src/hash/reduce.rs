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

#[cfg(target_arch = "x86_64")]
pub(crate) mod simd {
    use std::arch::x86_64::*;

    /// The columns of one look-back `k` of one layer, 8 heads at a time, with
    /// the same reduction as [`super::rem_fast`] in AVX-512 (DQ for the 64-bit
    /// conversions and multiply).
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512dq; the slices hold a multiple of 8.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn columns(
        rolling: i64,
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        out: &mut [i64],
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract
        // (the CPU features it is compiled for, and the sizes it reads and writes).
        unsafe {
            let x = _mm512_set1_epi64(rolling);
            let xf = _mm512_cvtepi64_pd(x);
            let zero = _mm512_setzero_si512();
            for j in (0..out.len()).step_by(8) {
                let p = _mm512_loadu_si512(primes.as_ptr().add(j) as *const _);
                let iv = _mm512_loadu_pd(inv.as_ptr().add(j));
                let o = _mm512_loadu_si512(offsets.as_ptr().add(j) as *const _);
                let q = _mm512_cvttpd_epi64(_mm512_mul_pd(xf, iv));
                let mut r = _mm512_sub_epi64(x, _mm512_mullo_epi64(q, p));
                let m = _mm512_cmplt_epi64_mask(r, zero);
                r = _mm512_mask_add_epi64(r, m, r, p);
                let m = _mm512_cmplt_epi64_mask(r, zero);
                r = _mm512_mask_add_epi64(r, m, r, p);
                let m = _mm512_cmpge_epi64_mask(r, p);
                r = _mm512_mask_sub_epi64(r, m, r, p);
                _mm512_storeu_si512(out.as_mut_ptr().add(j) as *mut _, _mm512_add_epi64(r, o));
            }
        }
    }

    /// Row ids of every window: `windows` is `[n, N]` (a dead window has
    /// `w[0] == -1`), `out` is `[n, L*C]`, through [`columns`]; the batch loop
    /// lives inside a target-feature function so that `columns` inlines.
    ///
    /// # Safety
    /// As [`columns`]; `multipliers` is `[L*N]`, the column arrays `[L*C]` with
    /// `C = (N-1)*H`, `H` a multiple of 8.
    #[target_feature(enable = "avx512f,avx512dq")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn windows(
        windows: &[i64],
        nn: usize,
        h: usize,
        multipliers: &[i64],
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        dead: i64,
        out: &mut [i64],
    ) {
        // SAFETY: the caller upholds this function's `# Safety` contract
        // (the CPU features it is compiled for, and the sizes it reads and writes).
        unsafe {
            let cols = (nn - 1) * h;
            let nl = multipliers.len() / nn;
            let row = nl * cols;
            for (w, o) in windows.chunks_exact(nn).zip(out.chunks_exact_mut(row)) {
                if w[0] == -1 {
                    o.fill(dead);
                    continue;
                }
                for l in 0..nl {
                    let m = &multipliers[l * nn..(l + 1) * nn];
                    let mut rolling = w[0].wrapping_mul(m[0]);
                    for k in 1..nn {
                        rolling ^= w[k].wrapping_mul(m[k]);
                        let c = l * cols + (k - 1) * h..l * cols + k * h;
                        columns(
                            rolling,
                            &primes[c.clone()],
                            &inv[c.clone()],
                            &offsets[c.clone()],
                            &mut o[c],
                        );
                    }
                }
            }
        }
    }

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }
}

/// Primes the [`narrow`] reduction takes: `[2^14, 2^31)`.
pub const NARROW_PRIMES: std::ops::Range<u64> = 1 << 14..1 << 31;

#[cfg(target_arch = "x86_64")]
pub(crate) mod narrow {
    use std::arch::x86_64::*;

    /// `1.5 * 2^52`: added to a double of magnitude below 2^51, it leaves the
    /// nearest integer in the low bits of the mantissa (two's complement).
    const MAGIC: f64 = 6_755_399_441_055_744.0;

    /// The columns of one look-back of one layer, 4 heads at a time:
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
    /// Euclidean remainder.
    ///
    /// # Safety
    /// The CPU must have avx2 and fma; the slices hold a multiple of 4; every
    /// prime lies in [`super::NARROW_PRIMES`].
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn columns(
        rolling: i64,
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        out: &mut [i64],
    ) {
        // SAFETY: the contract above; every load and store is at `j..j + 4`
        // with `j + 4 <= out.len()`, and the other slices are as long.
        unsafe {
            let xf = _mm256_set1_pd(rolling as f64);
            let x = _mm256_set1_epi64x(rolling);
            let magic = _mm256_set1_pd(MAGIC);
            let zero = _mm256_setzero_si256();
            for j in (0..out.len()).step_by(4) {
                let p = _mm256_loadu_si256(primes.as_ptr().add(j) as *const _);
                let iv = _mm256_loadu_pd(inv.as_ptr().add(j));
                let o = _mm256_loadu_si256(offsets.as_ptr().add(j) as *const _);
                let q = _mm256_castpd_si256(_mm256_fmadd_pd(xf, iv, magic));
                let r = _mm256_sub_epi32(x, _mm256_mul_epu32(q, p));
                // r in [0, p) stays below r + p < 2^32; r in [-p, 0) is
                // 2^32 + r as unsigned, and r + p wraps to [0, p): the unsigned
                // minimum is the Euclidean remainder either way.
                let r = _mm256_min_epu32(r, _mm256_add_epi32(r, p));
                _mm256_storeu_si256(
                    out.as_mut_ptr().add(j) as *mut _,
                    _mm256_add_epi64(_mm256_blend_epi32::<0b1010_1010>(r, zero), o),
                );
            }
        }
    }

    /// Row ids of every window (as [`super::simd::windows`]), with the
    /// reduction of [`columns`] written out over each window's row: the
    /// columns of a row are contiguous in the tables as in `out`, so one
    /// running index walks both without slicing, and the `x as f64` of each
    /// rolling hash starts from a zeroed register (no false dependency
    /// chaining one look-back's conversion to the previous one's).
    ///
    /// # Safety
    /// As [`columns`]; `multipliers` is `[L*N]`, the column arrays `[L*C]` with
    /// `C = (N-1)*H`, `H` a multiple of 4; `windows` is `[n, N]` and `out`
    /// `[n, L*C]`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn windows(
        windows: &[i64],
        nn: usize,
        h: usize,
        multipliers: &[i64],
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        dead: i64,
        out: &mut [i64],
    ) {
        let cols = (nn - 1) * h;
        let nl = multipliers.len() / nn;
        let row = nl * cols;
        assert!(h.is_multiple_of(4) && nn >= 2);
        assert!(primes.len() == row && inv.len() == row && offsets.len() == row);
        assert!(windows.len() / nn * row == out.len());
        // SAFETY: the contract above and the lengths asserted here: column
        // `c` runs over `0..row` in steps of 4 inside each window's row of
        // `out` and inside the tables; `m` over the `L*N` multipliers.
        unsafe {
            let (pp, ip, op) = (primes.as_ptr(), inv.as_ptr(), offsets.as_ptr());
            let magic = _mm256_set1_pd(MAGIC);
            let zero = _mm256_setzero_si256();
            for (w, o) in windows.chunks_exact(nn).zip(out.chunks_exact_mut(row)) {
                if w[0] == -1 {
                    o.fill(dead);
                    continue;
                }
                let dst = o.as_mut_ptr();
                let mut c = 0usize;
                let mut m = multipliers.as_ptr();
                for _ in 0..nl {
                    let mut rolling = w[0].wrapping_mul(*m);
                    for &wk in &w[1..] {
                        m = m.add(1);
                        rolling ^= wk.wrapping_mul(*m);
                        let xf = _mm256_broadcastsd_pd(_mm_cvtsi64_sd(_mm_setzero_pd(), rolling));
                        let x = _mm256_set1_epi64x(rolling);
                        let end = c + h;
                        while c < end {
                            let p = _mm256_loadu_si256(pp.add(c) as *const _);
                            let iv = _mm256_loadu_pd(ip.add(c));
                            let q = _mm256_castpd_si256(_mm256_fmadd_pd(xf, iv, magic));
                            let r = _mm256_sub_epi32(x, _mm256_mul_epu32(q, p));
                            // As in `columns`: the unsigned minimum is the
                            // Euclidean remainder.
                            let r = _mm256_min_epu32(r, _mm256_add_epi32(r, p));
                            let off = _mm256_loadu_si256(op.add(c) as *const _);
                            _mm256_storeu_si256(
                                dst.add(c) as *mut _,
                                _mm256_add_epi64(_mm256_blend_epi32::<0b1010_1010>(r, zero), off),
                            );
                            c += 4;
                        }
                    }
                    m = m.add(1);
                }
            }
        }
    }

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
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

    /// The AVX2 32-bit correction equals `rem_euclid` at the edges of the i64
    /// range, at and around multiples of each prime (negative ones too), for
    /// the smallest and largest primes it takes, and on random values.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn narrow_equals_rem_euclid() {
        if !narrow::available() {
            eprintln!("skipped: no avx2/fma on this CPU");
            return;
        }
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
        for &x in &xs {
            // SAFETY: avx2 and fma checked above; 8 columns; primes in range.
            unsafe { narrow::columns(x, &primes, &inv, &offsets, &mut out) };
            for c in 0..8 {
                assert_eq!(
                    out[c],
                    x.rem_euclid(primes[c]) + offsets[c],
                    "{x} mod {}",
                    primes[c]
                );
            }
        }
    }
}
