//! The gate (SPEC section 1, step 6) and the update of the highway, on the CPU.

use crate::batch::Geometry;
use crate::formats::{bf16_to_f32, f32_to_bf16};

/// The gate for one token's `hc` streams: `x` is `[hc, d]` (f32 values), `kv`
/// is `[(hc+1) * d]`, `qk` is `[hc, d]` (the product `q * k`). Writes the
/// `hc` gates into `out`.
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
        let dotv = dt * rstd_x * rstd_k * inv_sqrt_d;
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
