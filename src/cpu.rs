//! The CPU backend's arithmetic: gather + dequantise, projection, gate.
//! Plain safe Rust over host slices.

use crate::formats::{
    bf16_to_f32, dequant_row_bf16, f32_to_bf16, RowDataError, RowFormat, Weights,
};

/// `kv[t][o] = bf16(sum_i rows[t][i] * w[o][i])` with an f32 accumulator:
/// `rows` is `[n, k]` (bf16 values held as f32), `w` is `[n_out, k]`, `kv` is
/// `[n, n_out]` and receives bf16-rounded values held as f32. Output rows of
/// `w` are split over `threads` scoped threads.
pub fn project(
    rows: &[f32],
    n: usize,
    k: usize,
    w: Weights<'_>,
    n_out: usize,
    kv: &mut [f32],
    threads: usize,
) {
    debug_assert_eq!(rows.len(), n * k);
    debug_assert_eq!(w.len(), n_out * k);
    debug_assert_eq!(kv.len(), n * n_out);
    if n == 0 {
        return;
    }
    let threads = threads.clamp(1, n_out.max(1));
    // Each thread owns a contiguous range of outputs and writes them through a
    // transposed scratch `[range, n]`, copied into `kv` afterwards.
    let chunk = n_out.div_ceil(threads);
    let mut parts: Vec<Vec<f32>> = Vec::with_capacity(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|ti| {
                let lo = (ti * chunk).min(n_out);
                let hi = ((ti + 1) * chunk).min(n_out);
                s.spawn(move || project_range(rows, n, k, w, lo, hi))
            })
            .collect();
        for h in handles {
            parts.push(h.join().expect("projection worker panicked"));
        }
    });
    for (ti, part) in parts.iter().enumerate() {
        let lo = (ti * chunk).min(n_out);
        let width = part.len() / n.max(1);
        for j in 0..width {
            for t in 0..n {
                kv[t * n_out + lo + j] = part[j * n + t];
            }
        }
    }
}

fn project_range(
    rows: &[f32],
    n: usize,
    k: usize,
    w: Weights<'_>,
    lo: usize,
    hi: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; (hi - lo) * n];
    let mut wrow = vec![0f32; k];
    for o in lo..hi {
        w.to_f32(o * k, &mut wrow);
        for t in 0..n {
            let acc = dot(&rows[t * k..(t + 1) * k], &wrow);
            out[(o - lo) * n + t] = bf16_to_f32(f32_to_bf16(acc));
        }
    }
    out
}

/// An f32 dot product with eight independent partial sums (so the compiler
/// can keep them in vector registers), summed pairwise at the end.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Gather rows by id and dequantise them to bf16 values held as f32.
/// `ids` are already checked to lie inside the table. On bad data the error
/// names the position in `ids` and what was wrong.
pub fn gather_rows(
    table: &[u8],
    fmt: RowFormat,
    width: usize,
    ids: &[i64],
    out: &mut [f32],
) -> Result<(), (usize, RowDataError)> {
    let rb = fmt.row_bytes(width);
    let mut tmp = vec![0u16; width];
    for (j, (&id, o)) in ids.iter().zip(out.chunks_exact_mut(width)).enumerate() {
        let r = id as usize;
        dequant_row_bf16(fmt, &table[r * rb..(r + 1) * rb], &mut tmp).map_err(|e| (j, e))?;
        for (v, &b) in o.iter_mut().zip(&tmp) {
            *v = bf16_to_f32(b);
        }
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
