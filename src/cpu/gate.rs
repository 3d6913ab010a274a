//! The gate (SPEC section 1, step 6) and the update of the highway, on the CPU.

use crate::batch::Geometry;
use crate::formats::{bf16_to_f32, f32_to_bf16};

/// The smallest `x.x`, `key.key` and `|x.qk.key|` the f32 sums are trusted
/// at: 2^-60. Below it a term of the sum may have fallen to a subnormal (or
/// zero) and lost its precision; above it, with at most 2^20 terms, what
/// underflowed is below the f32 rounding of the sum. kernels/gate.cu uses the
/// same value.
pub const SAFE_SUM_MIN: f32 = f32::from_bits(0x2180_0000);

/// Whether the f32 gate of a stream is as accurate as the f32 arithmetic
/// allows: its three sums are finite (nothing overflowed) and at least
/// [`SAFE_SUM_MIN`] (nothing underflowed that matters), and the dot they give
/// is finite and not zero (its products neither overflowed nor underflowed).
/// A NaN anywhere fails it.
#[inline]
pub fn f32_sums_hold(hh: f32, kk: f32, dt: f32, dot: f32) -> bool {
    let ok = |v: f32| (SAFE_SUM_MIN..=f32::MAX).contains(&v);
    ok(hh) && ok(kk) && ok(dt.abs()) && dot.is_finite() && dot != 0.0
}

/// The dot of one stream from f64 sums (the path taken when
/// [`f32_sums_hold`] fails). f64 holds every sum of up to 2^20 products of
/// finite f32 values without overflow or underflow (at most 2^20 * 2^384 and
/// at least 2^-447 per term), so this is accurate for every finite input;
/// the result is rounded to f32 once (an infinity only where the true dot is
/// beyond f32, which needs `qk` beyond 2^118: the gate is then 0 or 1).
pub fn dot_wide(x: &[f32], key: &[f32], q: &[f32], d: usize, eps: f32) -> f32 {
    let (mut hh, mut kk, mut dt) = (0f64, 0f64, 0f64);
    for j in 0..d {
        let (xv, kv, qv) = (x[j] as f64, key[j] as f64, q[j] as f64);
        hh += xv * xv;
        kk += kv * kv;
        dt += xv * qv * kv;
    }
    let n = d as f64;
    let rx = 1.0 / (hh / n + eps as f64).sqrt();
    let rk = 1.0 / (kk / n + eps as f64).sqrt();
    (dt * rx * rk / n.sqrt()) as f32
}

/// The gate for one token's `hc` streams: `x` is `[hc, d]` (f32 values), `kv`
/// is `[(hc+1) * d]`, `qk` is `[hc, d]` (the product `q * k`). Writes the
/// `hc` gates into `out`.
///
/// The sums run in f32; where they cannot be trusted ([`f32_sums_hold`]:
/// an overflow, values so small they underflow, or a NaN or infinity) the
/// stream's dot is recomputed in f64 ([`dot_wide`]). Normal-range streams
/// take only the f32 path, bit for bit as before. docs/numerics.md.
pub fn gates(x: &[f32], kv: &[f32], qk: &[f32], hc: usize, d: usize, eps: f32, out: &mut [f32]) {
    let inv_sqrt_d = 1.0 / (d as f32).sqrt();
    for s in 0..hc {
        let xs = &x[s * d..(s + 1) * d];
        let key = &kv[s * d..(s + 1) * d];
        let q = &qk[s * d..(s + 1) * d];
        let (mut hh, mut kk, mut dt) = (0f32, 0f32, 0f32);
        for j in 0..d {
            hh += xs[j] * xs[j];
            kk += key[j] * key[j];
            dt += xs[j] * q[j] * key[j];
        }
        let rstd_x = 1.0 / (hh / d as f32 + eps).sqrt();
        let rstd_k = 1.0 / (kk / d as f32 + eps).sqrt();
        let mut dotv = dt * rstd_x * rstd_k * inv_sqrt_d;
        if !f32_sums_hold(hh, kk, dt, dotv) {
            dotv = dot_wide(xs, key, q, d, eps);
        }
        out[s] = gate_of(dotv);
    }
}

/// `sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))` with `sign(0) = 0`
/// (torch semantics: a zero dot gives 0.5). A NaN dot gives a NaN gate.
#[inline]
pub fn gate_of(dot: f32) -> f32 {
    let sign = if dot > 0.0 {
        1.0
    } else if dot < 0.0 {
        -1.0
    } else if dot == 0.0 {
        0.0
    } else {
        f32::NAN
    };
    let g = sign * dot.abs().max(1e-6).sqrt();
    1.0 / (1.0 + (-g).exp())
}

/// A host highway `[n, hc, D]`.
pub enum HostHighway<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

/// One token's working values for [`update`], allocated (fallibly) before
/// an apply changes anything.
pub struct Scratch {
    /// The token's streams `[hc, D]` in f32.
    x: Vec<f32>,
    /// Its `hc` gates.
    gate: Vec<f32>,
}

impl Scratch {
    pub fn new(geo: Geometry) -> crate::error::Result<Scratch> {
        Ok(Scratch {
            x: crate::batch::try_vec(geo.hc * geo.d, 0f32, "the gate's streams")?,
            gate: crate::batch::try_vec(geo.hc, 0f32, "the gates")?,
        })
    }
}

/// `highway[t] += gate * value` for each live token `tokens[j]`, whose `kv`
/// is `kv[j]` (`[D*(hc+1)]`, bf16 values held as f32): the gate and the sum in
/// f32; a bf16 highway is widened, updated and rounded once (nearest even).
pub fn update(
    geo: Geometry,
    tokens: &[usize],
    kv: &[f32],
    qk: &[f32],
    highway: HostHighway<'_>,
    scratch: &mut Scratch,
) {
    let (hc, d) = (geo.hc, geo.d);
    let k_out = d * (hc + 1);
    let Scratch { x, gate } = scratch;
    let mut highway = highway;
    for (j, &t) in tokens.iter().enumerate() {
        let kvt = &kv[j * k_out..(j + 1) * k_out];
        let value = &kvt[hc * d..];
        let span = t * hc * d..(t + 1) * hc * d;
        match &mut highway {
            HostHighway::F32(h) => x.copy_from_slice(&h[span.clone()]),
            HostHighway::Bf16(h) => {
                for (xv, &b) in x.iter_mut().zip(&h[span.clone()]) {
                    *xv = bf16_to_f32(b);
                }
            }
        }
        gates(x, kvt, qk, hc, d, geo.eps, gate);
        for s in 0..hc {
            for (xv, &v) in x[s * d..(s + 1) * d].iter_mut().zip(value) {
                *xv += gate[s] * v;
            }
        }
        match &mut highway {
            HostHighway::F32(h) => h[span].copy_from_slice(x),
            HostHighway::Bf16(h) => {
                for (hv, &xv) in h[span].iter_mut().zip(x.iter()) {
                    *hv = f32_to_bf16(xv);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gate of one stream in f64 throughout (the reference).
    fn gate_f64(x: &[f32], key: &[f32], q: &[f32], eps: f32) -> f64 {
        let d = x.len() as f64;
        let (mut hh, mut kk, mut dt) = (0f64, 0f64, 0f64);
        for j in 0..x.len() {
            let (a, b, c) = (x[j] as f64, key[j] as f64, q[j] as f64);
            hh += a * a;
            kk += b * b;
            dt += a * c * b;
        }
        let dot = dt / (hh / d + eps as f64).sqrt() / (kk / d + eps as f64).sqrt() / d.sqrt();
        let sign = if dot > 0.0 {
            1.0
        } else if dot < 0.0 {
            -1.0
        } else {
            0.0
        };
        1.0 / (1.0 + (-sign * dot.abs().max(1e-6).sqrt()).exp())
    }

    fn stream(d: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..d)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    fn gate1(x: &[f32], key: &[f32], q: &[f32], eps: f32) -> f32 {
        let d = x.len();
        let mut kv = key.to_vec();
        kv.extend(std::iter::repeat_n(0.0, d)); // the value (unused by the gate)
        let mut out = [0f32];
        gates(x, &kv, q, 1, d, eps, &mut out);
        out[0]
    }

    /// Streams at the edges (tolerance: 1e-6 absolute of the f64 gate; the
    /// f64 path rounds the dot to f32 once, then the f32 gate formula): +-1e20
    /// (x.x overflows; the f32 path gave 0.5), one bf16-exact +-3e38 pair (NaN
    /// before), tiny values (x.x underflows), a tiny eps with a zero stream,
    /// and huge keys.
    #[test]
    fn edge_streams_match_the_f64_gate() {
        let d = 64;
        let key = stream(d, 1);
        let q = stream(d, 2);
        let normal = stream(d, 3);
        let signs: Vec<f32> = (0..d)
            .map(|j| if j % 3 == 0 { 1e20 } else { -1e20 })
            .collect();
        let mut pair = normal.clone();
        pair[5] = 3.0e38f32;
        pair[9] = -3.0e38f32;
        let tiny: Vec<f32> = normal.iter().map(|v| v * 1e-30).collect();
        let zero = vec![0f32; d];
        let huge_key: Vec<f32> = key.iter().map(|v| v * 1e25).collect();
        let cases: [(&str, &[f32], &[f32], f32); 6] = [
            ("+-1e20", &signs, &key, 1e-6),
            ("+-3e38 pair", &pair, &key, 1e-6),
            ("values near 1e-30", &tiny, &key, 1e-6),
            ("values near 1e-30, eps 1e-40", &tiny, &key, 1e-40),
            (
                "a zero stream, the smallest eps",
                &zero,
                &key,
                f32::from_bits(1),
            ),
            ("keys near 1e25", &normal, &huge_key, 1e-6),
        ];
        for (what, x, k, eps) in cases {
            let got = gate1(x, k, &q, eps) as f64;
            let want = gate_f64(x, k, &q, eps);
            assert!((got - want).abs() <= 1e-6, "{what}: gate {got}, f64 {want}");
        }
        // The case: far from the 0.5 the overflowing f32 sums gave.
        let want = gate_f64(&signs, &key, &q, 1e-6);
        assert!((want - 0.5).abs() > 0.05, "{want}");
    }

    /// A NaN or an infinity in a stream makes its gate NaN (documented).
    #[test]
    fn nan_or_infinity_in_a_stream_gives_a_nan_gate() {
        let d = 16;
        let (key, q) = (stream(d, 4), stream(d, 5));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = stream(d, 6);
            x[3] = bad;
            assert!(gate1(&x, &key, &q, 1e-6).is_nan(), "{bad}");
        }
    }

    /// Normal-range streams take the f32 path: bit for bit the gate of the
    /// f32 formula alone (what the golden tests were written against).
    #[test]
    fn normal_streams_keep_the_f32_bits() {
        for seed in 0..200u32 {
            let d = 8 + (seed as usize % 5) * 61;
            let (x, key, q) = (
                stream(d, 3 * seed),
                stream(d, 3 * seed + 1),
                stream(d, 3 * seed + 2),
            );
            let (mut hh, mut kk, mut dt) = (0f32, 0f32, 0f32);
            for j in 0..d {
                hh += x[j] * x[j];
                kk += key[j] * key[j];
                dt += x[j] * q[j] * key[j];
            }
            let eps = 1e-6f32;
            let rx = 1.0 / (hh / d as f32 + eps).sqrt();
            let rk = 1.0 / (kk / d as f32 + eps).sqrt();
            let dot = dt * rx * rk * (1.0 / (d as f32).sqrt());
            assert!(f32_sums_hold(hh, kk, dt, dot), "seed {seed}");
            assert_eq!(
                gate1(&x, &key, &q, eps).to_bits(),
                gate_of(dot).to_bits(),
                "seed {seed}"
            );
        }
    }
}
