//! The CPU backend's gather + dequantise and gate (the projection is in
//! `projection`). Plain safe Rust over host slices.

use crate::formats::{dequant_row_bf16, RowDataError, RowFormat};

/// Gather rows by id and dequantise them to bf16 (bit patterns).
/// `ids` are already checked to lie inside the table. On bad data the error
/// names the position in `ids` and what was wrong.
pub fn gather_rows(
    table: &[u8],
    fmt: RowFormat,
    width: usize,
    ids: &[i64],
    out: &mut [u16],
) -> Result<(), (usize, RowDataError)> {
    let rb = fmt.row_bytes(width);
    for (j, (&id, o)) in ids.iter().zip(out.chunks_exact_mut(width)).enumerate() {
        let r = id as usize;
        dequant_row_bf16(fmt, &table[r * rb..(r + 1) * rb], o).map_err(|e| (j, e))?;
    }
    Ok(())
}

/// The gate for one token's `hc` streams, SPEC section 1 step 6.
/// `x` is `[hc, d]` (f32 values), `kv` is `[(hc+1) * d]`, `qk` is `[hc, d]`
/// (the product `q * k`). Returns the `hc` gates.
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
