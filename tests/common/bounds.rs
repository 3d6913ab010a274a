//! The error bounds the golden tests hold the library to, derived from f32
//! and bf16 rounding (shared by the CPU and the GPU golden tests).

/// Unit roundoff of f32.
pub const U: f64 = 1.0 / (1u64 << 24) as f64;

/// One bf16 ulp at magnitude `x` (the spacing of bf16 values around it).
pub fn ulp_bf16(x: f64) -> f64 {
    let x = x.abs().max(f32::MIN_POSITIVE as f64);
    2f64.powi(x.log2().floor() as i32 - 7)
}

/// Bound on |kv_lib - kv_golden| for one output.
///
/// Both sides round one real sum `s = sum_i r_i w_i` (K = C*Hd terms; rows are
/// bf16, so with bf16 `wkv` each product is exact in f32, with f32 `wkv` it is
/// rounded once). The library accumulates in f32 in some order: error at most
/// `(K+1) u S` with `S = sum |r_i w_i|`. The golden sums in f64 and rounds to
/// f32: error at most `u |s| <= u S`. Both then round to bf16, which can move
/// two nearby f32 values to neighbouring bf16 values: one more bf16 ulp.
pub fn kv_bound(s_abs: f64, kv: f64, k: usize) -> f64 {
    (k as f64 + 2.0) * U * s_abs + ulp_bf16(kv)
}

/// The gate and highway update in f64 from given inputs (the reference the
/// library's f32 arithmetic is held to), with a bound on the library's
/// f32 error. Returns (out values, bound per value) for one token.
///
/// The library computes three sums of D terms in f32 (`x.x`, `key.key`,
/// `x.qk.key`, each term with up to 3 roundings): `|d dot| <= (2D + 16) u A`
/// with `A = sum|x qk key| rstd_x rstd_k / sqrt(D)` (the sums' relative errors,
/// the rstd square roots and the final products). Through the gate:
/// `g = sign(dot) sqrt(max(|dot|, 1e-6))` moves by at most
/// `d_dot / (2 sqrt(max(|dot| - d_dot, 1e-6)))`, or by `2 sqrt(|dot| + d_dot)`
/// when `|dot| <= d_dot` (the sign may flip); the sigmoid's slope is at most
/// 1/4, and sqrt/exp/divide add a few f32 roundings (8u). Then
/// `out = x + gate * value` in f32 on both sides (the golden rounds its f64
/// gate to f32 first): `|d out| <= |value| (d_gate + u) + 4u (|x| + |value|)`.
pub fn gate_reference(
    x: &[f32],
    kv: &[f32],
    qk: &[f32],
    hc: usize,
    d: usize,
    eps: f32,
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0f64; hc * d];
    let mut bound = vec![0f64; hc * d];
    let value = &kv[hc * d..];
    for s in 0..hc {
        let xs = &x[s * d..(s + 1) * d];
        let key = &kv[s * d..(s + 1) * d];
        let q = &qk[s * d..(s + 1) * d];
        let (mut hh, mut kk, mut dt, mut a) = (0f64, 0f64, 0f64, 0f64);
        for j in 0..d {
            let (xv, kv, qv) = (xs[j] as f64, key[j] as f64, q[j] as f64);
            hh += xv * xv;
            kk += kv * kv;
            dt += xv * qv * kv;
            a += (xv * qv * kv).abs();
        }
        let rx = 1.0 / (hh / d as f64 + eps as f64).sqrt();
        let rk = 1.0 / (kk / d as f64 + eps as f64).sqrt();
        let scale = rx * rk / (d as f64).sqrt();
        let dot = dt * scale;
        let ddot = (2.0 * d as f64 + 16.0) * U * a * scale;
        let sign = if dot > 0.0 {
            1.0
        } else if dot < 0.0 {
            -1.0
        } else {
            0.0
        };
        let g = sign * dot.abs().max(1e-6).sqrt();
        let gate = 1.0 / (1.0 + (-g).exp());
        let dg = if dot.abs() <= ddot {
            2.0 * (dot.abs() + ddot).max(1e-6).sqrt()
        } else {
            ddot / (2.0 * (dot.abs() - ddot).max(1e-6).sqrt())
        };
        let dgate = dg / 4.0 + 8.0 * U;
        for j in 0..d {
            let (xv, v) = (xs[j] as f64, value[j] as f64);
            out[s * d + j] = xv + gate * v;
            bound[s * d + j] = v.abs() * (dgate + U) + 4.0 * U * (xv.abs() + v.abs());
        }
    }
    (out, bound)
}

/// Check one live token's highway after `apply` (`got`, `[hc, d]`, as f64)
/// against the golden's (`golden`, given when the library's kv equals the
/// golden's) or else the f64 reference recomputed on the library's own kv,
/// within `gate_reference`'s bound; a bf16 highway gets one more bf16 ulp,
/// since both sides round an f32 within that bound of each other and the
/// roundings can land one ulp apart. `x` is the highway before apply (as
/// f32), `kv` the library's `[(hc+1)*d]` for the token. Returns the largest
/// error / bound seen (for an f32 highway; 0 for bf16).
#[allow(clippy::too_many_arguments)]
pub fn check_highway(
    x: &[f32],
    kv: &[f32],
    qk: &[f32],
    hc: usize,
    d: usize,
    eps: f32,
    got: &[f64],
    golden: Option<&[f64]>,
    is_bf16: bool,
    at: &str,
) -> f64 {
    let (reference, bound) = gate_reference(x, kv, qk, hc, d, eps);
    let mut worst = 0f64;
    for i in 0..hc * d {
        let want = golden.map_or(reference[i], |g| g[i]);
        let b = bound[i]
            + if is_bf16 {
                ulp_bf16(want.abs().max(got[i].abs()))
            } else {
                0.0
            };
        let err = (got[i] - want).abs();
        assert!(
            err <= b,
            "{at}: highway{} [{i}] {} vs {want}, bound {b}",
            if is_bf16 { " bf16" } else { "" },
            got[i]
        );
        if !is_bf16 && b > 0.0 {
            worst = worst.max(err / b);
        }
    }
    worst
}

/// The stream kinds of [`edge_highway`], by `(t * hc + s) % 6`.
pub const EDGE_KINDS: [&str; 6] = [
    "a zero stream",
    "every fourth value +-1e20 (x.x overflows f32)",
    "one value +3e38 and one -3e38, bf16-exact (x.x and x.qk.key overflow)",
    "values near 1e-30 (x.x underflows f32)",
    "normal values",
    "every value +-1e20",
];

/// A highway `[n, hc, d]` whose streams sit at the numeric edges of the gate
/// (kind `(t * hc + s) % 6`, [`EDGE_KINDS`]): each stream with huge values
/// keeps normal values beside them, whose update shows the gate.
pub fn edge_highway(n: usize, hc: usize, d: usize) -> Vec<f32> {
    let normal = super::values("edge.highway", n * hc * d, 1.0, 0.0);
    let big = f32::from_bits((3.0e38f32.to_bits() + 0x8000) & 0xFFFF_0000);
    let mut out = vec![0f32; n * hc * d];
    for t in 0..n {
        for s in 0..hc {
            let o = (t * hc + s) * d;
            for j in 0..d {
                let v = normal[o + j];
                let sign = if j % 2 == 0 { 1.0 } else { -1.0 };
                out[o + j] = match (t * hc + s) % 6 {
                    0 => 0.0,
                    1 if j % 4 == 0 => sign * 1e20,
                    2 if j == 1 => big,
                    2 if j == 2 => -big,
                    3 => v * 1e-30,
                    5 => sign * 1e20,
                    _ => v,
                };
            }
        }
    }
    out
}

/// The integer dot products' token block scale (docs/numerics.md, "Integer
/// dot products"), computed here from its definition: `2^(E - 6)` for the
/// block's largest magnitude `amax` in `[2^E, 2^(E+1))`, at least `2^-149`
/// (1 for an all-zero block).
pub fn int_dot_scale(block: &[f32]) -> f64 {
    let amax = block.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    if amax == 0.0 {
        return 1.0;
    }
    let e = ((amax.to_bits() >> 52) & 0x7FF) as i32 - 1023;
    2f64.powi((e - 6).max(-149))
}

/// Bound on `|kv_int - kv_twin|` for one output of the integer dot
/// products against the f32 twin (docs/numerics.md derives it): `x` the
/// token's values, `w` the twin's weights (the dequantised values), `wm`
/// their magnitudes before the dequantisation's rounding (`|d sc q| +
/// |dmin m|` for the K-quants, `|w|` for `Q8_0`), `QB = 256` values a token
/// block with scale `dx_u`:
///
///   Q   = sum_u dx_u / 2 * sum_{i in u} |w_i|          (the tokens' int8 rounding)
///   F   = g_D * sum_i wm_i (|x_i| + dx_u / 2),  g_D = D u / (1 - D u), D = K/256 + 8
///   T   = u * sum_i wm_i |x_i|                      (the twin's rounding of d1 q - m1)
///   E   = (K + 2) u sum_i |w_i x_i|                 (the twin's own f32 sum)
///   A   = K 2^-130                                  (roundings below f32's normal range)
///
/// plus, where both sides are rounded to bf16 (`rounded`), one bf16 ulp of
/// the larger.
pub fn int_dot_bound(x: &[f32], w: &[f32], wm: &[f32], kv: Option<(f64, f64)>) -> f64 {
    const QB: usize = 256;
    let k = x.len();
    let d = (k / QB) as f64 + 8.0;
    let g = d * U / (1.0 - d * U);
    let (mut q, mut f, mut t, mut e) = (0f64, 0f64, 0f64, 0f64);
    for u in 0..k / QB {
        let r = u * QB..(u + 1) * QB;
        let dx = int_dot_scale(&x[r.clone()]);
        for i in r {
            let (xi, wi, mi) = ((x[i] as f64).abs(), (w[i] as f64).abs(), wm[i] as f64);
            q += dx / 2.0 * wi;
            f += mi * (xi + dx / 2.0);
            t += mi * xi;
            e += wi * xi;
        }
    }
    let mut b = q + g * f + U * t + (k as f64 + 2.0) * U * e + k as f64 * 2f64.powi(-130);
    if let Some((a, c)) = kv {
        b += ulp_bf16(a.abs().max(c.abs()));
    }
    b
}
