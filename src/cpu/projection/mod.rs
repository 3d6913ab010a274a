//! The projection `kv = rows @ wkv^T` on the CPU: bf16 rows, f32 accumulate,
//! bf16 result (held as f32). One portable kernel, and AVX-512 FMA tiles
//! chosen at run time where the CPU has them. Work is split over output rows
//! on the context's own thread pool.
//!
//! Both kernels sum the `K` products of an output in f32, in different orders;
//! the tests hold both to the same bound (see `tests/golden.rs`). Within one
//! kernel and weight type, each output's order is fixed: a token's `kv` does
//! not depend on the batch it came in (engines can check a batched run against
//! a straight one bit for bit).
//!
//! f32 FMA rather than `vdpbf16ps`: on the AVX-512 machines measured here the
//! BF16 dot product issues on one port and FMA on two (96 against 183 GFLOP/s
//! on one core), and widening bf16 to f32 is a shift or a mask.

use crate::formats::{bf16_to_f32, f32_to_bf16, EngramType, Weights};
use rayon::prelude::*;

/// Which kernel computes the dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, f32 arithmetic (vectorised by the compiler).
    Portable,
    /// AVX-512 f32 FMA tiles: bf16 weights widened in registers, f32 and
    /// (dequantised per task) quantised weights as they are.
    Avx512,
}

impl Kernel {
    /// The best kernel this CPU runs.
    pub fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                return Kernel::Avx512;
            }
        }
        Kernel::Portable
    }
}

/// Up to this many tokens, q8_0 and q2_K weights are dequantised in registers
/// inside the FMA tiles rather than through a per-task f32 buffer.
const FUSED_MAX_TOKENS: usize = 4;

/// Output rows of `wkv` per task handed to a worker.
const CHUNK: usize = 64;
/// Tokens whose rows are kept hot in cache while a chunk of weights is reused.
const TOKEN_BLOCK: usize = 64;

/// The projection with its thread pool.
pub struct Projection {
    /// Joined when dropped (`engram_free` returns with no thread left).
    pool: Option<crate::cpu::pool::Pool>,
    kernel: Kernel,
}

impl Projection {
    /// A projection using at most `threads` threads (the caller's thread
    /// included: a pool of `threads` workers runs the work while the caller
    /// waits). `threads <= 1` runs everything on the calling thread.
    pub fn new(threads: usize) -> std::io::Result<Projection> {
        let pool = if threads > 1 {
            Some(crate::cpu::pool::Pool::new(threads)?)
        } else {
            None
        };
        Ok(Projection {
            pool,
            kernel: Kernel::detect(),
        })
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Use `kernel` from now on (for tests and benchmarks comparing kernels).
    /// Asking for a kernel the CPU lacks keeps the portable one.
    pub fn set_kernel(&mut self, kernel: Kernel) {
        self.kernel = if kernel == Kernel::Portable || Kernel::detect() == kernel {
            kernel
        } else {
            Kernel::Portable
        };
    }

    /// `kv[t][o] = bf16(sum_i rows[t][i] * w[o][i])` for `rows` `[n, k]` (bf16
    /// bits) and `w` `[n_out, k]`; `kv` is `[n, n_out]` and receives the bf16
    /// values as f32.
    pub fn run(
        &self,
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        n_out: usize,
        kv: &mut [f32],
    ) {
        assert_eq!(rows.len(), n * k);
        assert_eq!(w.len(), n_out * k);
        assert_eq!(kv.len(), n * n_out);
        if n == 0 || n_out == 0 {
            return;
        }
        let kernel = self.kernel;
        // The AVX-512 bf16 kernel reads tokens as f32 split into odd and even
        // elements of each 32-value chunk; the other kernels as plain f32 rows.
        let bf16_pairs = kernel == Kernel::Avx512 && matches!(w, Weights::Bf16(_));
        let xs: Vec<f32> = if bf16_pairs {
            pair_split(rows, n, k)
        } else {
            rows.iter().map(|&b| bf16_to_f32(b)).collect()
        };
        #[cfg(target_arch = "x86_64")]
        let fused_ok = std::arch::is_x86_feature_detected!("f16c");
        // Outputs are computed o-major (`[n_out, n]`) so that each task owns a
        // contiguous slice, then transposed into `kv`.
        let mut kvt = vec![0f32; n_out * n];
        let body = |(ci, out): (usize, &mut [f32])| {
            let lo = ci * CHUNK;
            let hi = (lo + CHUNK).min(n_out);
            match (kernel, w) {
                #[cfg(target_arch = "x86_64")]
                (Kernel::Avx512, Weights::Bf16(wb)) => {
                    // SAFETY: `Kernel::Avx512` is only selected when the CPU
                    // has avx512f and avx512bw; sizes are asserted above.
                    unsafe { avx512::range_bf16(&xs, n, k, wb, lo, hi, out) }
                }
                #[cfg(target_arch = "x86_64")]
                (
                    Kernel::Avx512,
                    Weights::Quant {
                        format: f @ (EngramType::Q8_0 | EngramType::Q2_K),
                        data,
                        row_len,
                    },
                ) if n <= FUSED_MAX_TOKENS && row_len == k && fused_ok => {
                    // Few tokens: dequantise in registers as the FMAs need the
                    // values, instead of through a buffer (same values, same order).
                    let rb = f.row_bytes(k);
                    // SAFETY: the CPU has avx512f, avx512bw and f16c (`fused_ok`);
                    // the rows are whole blocks of `f`.
                    unsafe {
                        avx512::range_quant(
                            &xs,
                            n,
                            k,
                            &data[lo * rb..hi * rb],
                            rb,
                            f == EngramType::Q2_K,
                            hi - lo,
                            out,
                        )
                    }
                }
                #[cfg(target_arch = "x86_64")]
                (Kernel::Avx512, _) => {
                    // f32 or quantised weights: dequantise this task's rows to
                    // f32 once, then f32 FMA tiles against every token.
                    let mut wf = vec![0f32; (hi - lo) * k];
                    dequant_rows(w, lo, hi, k, &mut wf);
                    // SAFETY: as above.
                    unsafe { avx512::range_f32(&xs, n, k, &wf, hi - lo, out) }
                }
                _ => portable_range(&xs, n, k, w, lo, hi, out),
            }
        };
        match &self.pool {
            Some(p) if n_out > CHUNK => {
                p.install(|| kvt.par_chunks_mut(CHUNK * n).enumerate().for_each(body))
            }
            _ => kvt.chunks_mut(CHUNK * n).enumerate().for_each(body),
        }
        for o in 0..n_out {
            for t in 0..n {
                kv[t * n_out + o] = kvt[o * n + t];
            }
        }
    }
}

/// Rows `lo..hi` of `w` (rows of `k` values) as f32 into `out`: the exact
/// values `formats::dequant_row_f32` gives, with AVX-512 loops for the
/// formats a decode step reads most (q8_0, q2_K) where the CPU has them.
pub fn dequant_rows(w: Weights<'_>, lo: usize, hi: usize, k: usize, out: &mut [f32]) {
    assert_eq!(out.len(), (hi - lo) * k);
    #[cfg(target_arch = "x86_64")]
    if let Weights::Quant {
        format,
        data,
        row_len,
    } = w
    {
        if row_len == k && std::arch::is_x86_feature_detected!("avx512f") {
            let rb = format.row_bytes(k);
            let bytes = &data[lo * rb..hi * rb];
            match format {
                // SAFETY: the CPU has avx512f; whole blocks in and out.
                EngramType::Q8_0 => return unsafe { avx512::dequant_q8_0(bytes, out) },
                // SAFETY: as above.
                EngramType::Q2_K => return unsafe { avx512::dequant_q2_k(bytes, out) },
                _ => {}
            }
        }
    }
    w.to_f32(lo * k, out);
}

/// 32-value chunks per k block of the bf16 kernel (6 weight rows x 1024 bf16
/// = 12 KB stay in L1 while the block's token vectors stream past).
const KBC: usize = 32;

/// Token rows (bf16 bits, `[n, k]`) as f32 in the bf16 kernel's layout: k
/// blocks of `KBC` chunks of 32 values, each block holding every token's
/// chunks contiguously (`[block][token][chunk][32]`), and within a chunk the
/// 16 odd-indexed values then the 16 even-indexed ones; zero past `k`.
fn pair_split(rows: &[u16], n: usize, k: usize) -> Vec<f32> {
    let chunks = k.div_ceil(32);
    let mut xs = vec![0f32; n * chunks * 32];
    for (t, r) in rows.chunks_exact(k).enumerate() {
        for c in 0..chunks {
            let x = &mut xs[pair_offset(n, chunks, t, c)..][..32];
            let src = &r[c * 32..(c * 32 + 32).min(k)];
            for (j, &b) in src.iter().enumerate() {
                x[if j % 2 == 1 { j / 2 } else { 16 + j / 2 }] = bf16_to_f32(b);
            }
        }
    }
    xs
}

/// Where token `t`'s chunk `c` starts in [`pair_split`]'s layout.
#[inline]
fn pair_offset(n: usize, chunks: usize, t: usize, c: usize) -> usize {
    let (b, within) = (c / KBC, c % KBC);
    let in_block = KBC.min(chunks - b * KBC);
    (b * KBC * n + t * in_block + within) * 32
}

/// Round an f32 sum to bf16, held as f32.
#[inline]
fn to_bf16_value(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

fn portable_range(
    rows: &[f32],
    n: usize,
    k: usize,
    w: Weights<'_>,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) {
    let mut wrow = vec![0f32; k];
    for o in lo..hi {
        w.to_f32(o * k, &mut wrow);
        for t in 0..n {
            out[(o - lo) * n + t] = to_bf16_value(dot(&rows[t * k..(t + 1) * k], &wrow));
        }
    }
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

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests {
    use super::*;

    /// A token's kv does not depend on its batch: every kernel and weight
    /// type gives the same bits for a token projected alone, in a small batch
    /// and in a large one, with one thread or two.
    #[test]
    fn results_do_not_depend_on_the_batch() {
        let (n, k, n_out) = (37, 1100, 70);
        let (rows, w) = data(n, k, n_out);
        let wf: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
        for kernel in [Kernel::Portable, Kernel::Avx512] {
            for dense_f32 in [false, true] {
                let weights = if dense_f32 {
                    Weights::F32(&wf)
                } else {
                    Weights::Bf16(&w)
                };
                let run = |threads: usize, lo: usize, hi: usize| {
                    let mut p = Projection::new(threads).unwrap();
                    p.set_kernel(kernel);
                    let mut kv = vec![0f32; (hi - lo) * n_out];
                    p.run(&rows[lo * k..hi * k], hi - lo, k, weights, n_out, &mut kv);
                    kv
                };
                let all = run(2, 0, n);
                for (lo, hi, threads) in [(0, 1, 1), (5, 8, 1), (10, 30, 2), (36, 37, 2)] {
                    assert_eq!(
                        run(threads, lo, hi)[..],
                        all[lo * n_out..hi * n_out],
                        "{kernel:?} f32 {dense_f32} {lo}..{hi}"
                    );
                }
            }
        }
    }

    /// q8_0 and q2_K weights: the fused path (few tokens) and the buffered
    /// path (more) give the same bits as f32 weights holding the dequantised
    /// values, for every batch size.
    #[test]
    fn quantised_weights_match_their_f32_values_at_every_batch_size() {
        use crate::formats::{dequant_row_f32, EngramType};
        let (k, n_out, n) = (512usize, 70usize, 9usize);
        let (rows, _) = data(n, k, 1);
        for ty in [crate::EngramType::Q8_0, crate::EngramType::Q2_K] {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let data = random_blocks(f, n_out * f.row_bytes(k), 11);
            let mut deq = vec![0f32; n_out * k];
            for (o, r) in deq.chunks_mut(k).enumerate() {
                dequant_row_f32(f, &data[o * f.row_bytes(k)..(o + 1) * f.row_bytes(k)], r).unwrap();
            }
            for kernel in [Kernel::Portable, Kernel::Avx512] {
                let mut p = Projection::new(2).unwrap();
                p.set_kernel(kernel);
                for (lo, hi) in [(0, 1), (2, 5), (1, 4), (0, n)] {
                    let mut a = vec![0f32; (hi - lo) * n_out];
                    let mut b = a.clone();
                    p.run(
                        &rows[lo * k..hi * k],
                        hi - lo,
                        k,
                        Weights::quant(f, &data, k).unwrap(),
                        n_out,
                        &mut a,
                    );
                    p.run(
                        &rows[lo * k..hi * k],
                        hi - lo,
                        k,
                        Weights::F32(&deq),
                        n_out,
                        &mut b,
                    );
                    assert_eq!(a, b, "{ty:?} {kernel:?} tokens {lo}..{hi}");
                }
            }
        }
    }

    /// Random blocks of `f` with finite f16 scales of all magnitudes.
    fn random_blocks(f: crate::formats::EngramType, len: usize, seed: u64) -> Vec<u8> {
        let mut z = seed;
        let mut data: Vec<u8> = (0..len)
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (z >> 56) as u8
            })
            .collect();
        let (_, bb) = f.block().unwrap();
        let at: &[usize] = if f == crate::formats::EngramType::Q8_0 {
            &[1]
        } else {
            &[81, 83]
        };
        for blk in data.chunks_mut(bb) {
            for &i in at {
                if blk[i] & 0x7C == 0x7C {
                    blk[i] ^= 0x04;
                }
            }
        }
        data
    }

    /// The AVX-512 dequantisers equal `formats::dequant_row_f32` bit for bit on
    /// random blocks (finite scales; the GGUF oracle tests cover the edges of
    /// the scalar path).
    #[test]
    fn fast_dequant_equals_the_reference() {
        use crate::formats::{dequant_row_f32, EngramType};
        let mut z = 3u64;
        let mut byte = move || {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 56) as u8
        };
        for (ty, k) in [
            (crate::EngramType::Q8_0, 256usize),
            (crate::EngramType::Q2_K, 512),
        ] {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let (_, bb) = f.block().unwrap();
            let rows = 7;
            let mut data: Vec<u8> = (0..rows * f.row_bytes(k)).map(|_| byte()).collect();
            // Finite f16 scales of all magnitudes (exponent field below 31).
            for blk in data.chunks_mut(bb) {
                let at: &[usize] = if ty == crate::EngramType::Q8_0 {
                    &[1]
                } else {
                    &[81, 83]
                };
                for &i in at {
                    blk[i] &= 0xF7 | (blk[i] & 0x80);
                    if blk[i] & 0x7C == 0x7C {
                        blk[i] ^= 0x04;
                    }
                }
            }
            let w = Weights::quant(f, &data, k).unwrap();
            let mut fast = vec![0f32; (rows - 2) * k];
            dequant_rows(w, 1, rows - 1, k, &mut fast);
            let mut want = vec![0f32; (rows - 2) * k];
            for (r, o) in want.chunks_mut(k).enumerate() {
                let rb = f.row_bytes(k);
                dequant_row_f32(f, &data[(r + 1) * rb..(r + 2) * rb], o).unwrap();
            }
            for (i, (a, b)) in fast.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} value {i}: {a} vs {b}");
            }
        }
    }

    fn data(n: usize, k: usize, n_out: usize) -> (Vec<u16>, Vec<u16>) {
        let f = |i: usize, s: u64| {
            let z = crate::hash::is_prime(i as u64 + s) as i32 as f32;
            f32_to_bf16(((i as f32 * 0.37 + s as f32).sin() + z) * 0.5)
        };
        (
            (0..n * k).map(|i| f(i, 1)).collect(),
            (0..n_out * k).map(|i| f(i, 2)).collect(),
        )
    }

    /// Every kernel, every tile shape and K tail, against an f64 reference
    /// within (K+2) u sum|a b| + 1 bf16 ulp (see tests/golden.rs).
    #[test]
    fn kernels_agree_with_f64_on_all_tile_shapes() {
        for &(n, k, n_out) in &[
            (1, 64, 9),
            (3, 100, 7),
            (5, 256, 130),
            (70, 40, 5),
            (4, 33, 4),
        ] {
            let (rows, w) = data(n, k, n_out);
            let wf: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
            for (kernel, dense_f32) in [
                (Kernel::Portable, false),
                (Kernel::Avx512, false),
                (Kernel::Portable, true),
                (Kernel::Avx512, true),
            ] {
                for threads in [1, 2] {
                    let mut p = Projection::new(threads).unwrap();
                    p.set_kernel(kernel);
                    let mut kv = vec![0f32; n * n_out];
                    let weights = if dense_f32 {
                        Weights::F32(&wf)
                    } else {
                        Weights::Bf16(&w)
                    };
                    p.run(&rows, n, k, weights, n_out, &mut kv);
                    for t in 0..n {
                        for o in 0..n_out {
                            let (mut s, mut a) = (0f64, 0f64);
                            for i in 0..k {
                                let x = bf16_to_f32(rows[t * k + i]) as f64
                                    * bf16_to_f32(w[o * k + i]) as f64;
                                s += x;
                                a += x.abs();
                            }
                            let got = kv[t * n_out + o] as f64;
                            let ulp = 2f64.powi(
                                (s.abs().max(got.abs()).max(1e-30)).log2().floor() as i32 - 7,
                            );
                            let bound = (k as f64 + 2.0) * a / (1u64 << 24) as f64 + ulp;
                            assert!(
                                (got - s).abs() <= bound,
                                "{kernel:?} n{n} k{k} t{t} o{o}: {got} vs {s}"
                            );
                        }
                    }
                }
            }
        }
    }
}
