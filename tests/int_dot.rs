//! The integer dot products of a `Q8_0` or `Q4_K` `wkv` (the default on
//! AVX-512 kernels with AVX512-VNNI): within the bound docs/numerics.md
//! derives of the f32 twin (an f32 `wkv` holding the dequantised values),
//! outside it with a deliberately wrong token quantisation, the same bits
//! whatever the batch (1 to 600 tokens) and the thread count, and the
//! twin's bits again when the engine asks for exactness (`exact_quant_wkv`).

mod common;

use common::bounds::{int_dot_bound, int_dot_scale};
use engram::cpu::projection::{Kernel, Projection};
use engram::formats::{bf16_to_f32, dequant_row_f32, f32_to_bf16};
use engram::{EngramType, Weights};

/// The kernels that take the integer path here, if this CPU has them.
fn int_kernels() -> Vec<Kernel> {
    if !std::arch::is_x86_feature_detected!("avx512vnni") {
        eprintln!("no AVX512-VNNI here: the integer dot products are not run");
        return Vec::new();
    }
    [Kernel::Avx512, Kernel::Avx512Bf16]
        .into_iter()
        .filter(|k| k.supported())
        .collect()
}

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[-1, 1)`.
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// `n` token rows of `k` bf16 values: normal-ish values, with blocks of
/// very different magnitudes, some outliers and some zeros.
fn tokens(n: usize, k: usize, seed: u64) -> Vec<u16> {
    let mut r = Rng(seed);
    (0..n * k)
        .map(|i| {
            let scale = 2f32.powi(((i / 256) % 7) as i32 * 3 - 10);
            let v = match r.next() % 50 {
                0 => 0.0,
                1 => r.unit() * 40.0,
                _ => r.unit(),
            };
            f32_to_bf16(v * scale)
        })
        .collect()
}

/// An f16 of about `2^e` (positive).
fn f16_about(e: i32, r: &mut Rng) -> [u8; 2] {
    let v = 2f32.powi(e) * (1.0 + r.unit().abs());
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// `rows` rows of `k` values of `ty` (`Q8_0` or `Q4_K`), random codes and
/// scales; `dmin_zero`: `Q4_K` mins of zero (every weight >= 0).
fn weights(ty: EngramType, rows: usize, k: usize, seed: u64, dmin_zero: bool) -> Vec<u8> {
    let mut r = Rng(seed);
    let f = EngramType::row_format(ty as u32, k).unwrap();
    let mut out = Vec::with_capacity(rows * f.row_bytes(k));
    for _ in 0..rows * k / f.block().unwrap().0 {
        match ty {
            EngramType::Q8_0 => {
                out.extend(f16_about(-8, &mut r));
                out.extend((0..32).map(|_| r.next() as u8));
            }
            _ => {
                out.extend(f16_about(-10, &mut r));
                if dmin_zero {
                    out.extend([0, 0]);
                } else {
                    out.extend(f16_about(-9, &mut r));
                }
                out.extend((0..12 + 128).map(|_| r.next() as u8));
            }
        }
    }
    out
}

/// The twin's weights (`[rows, k]` f32) and their magnitudes before the
/// dequantisation's rounding (`|d sc q| + |dmin m|`: the same block with `d`
/// made positive and `dmin` negative; `|w|` for `Q8_0`).
fn twin(ty: EngramType, data: &[u8], k: usize) -> (Vec<f32>, Vec<f32>) {
    let f = EngramType::row_format(ty as u32, k).unwrap();
    let rb = f.row_bytes(k);
    let rows = data.len() / rb;
    let mut w = vec![0f32; rows * k];
    let mut wm = vec![0f32; rows * k];
    let mut mag = data.to_vec();
    if ty == EngramType::Q4_K {
        for b in mag.chunks_exact_mut(f.block().unwrap().1) {
            b[1] &= 0x7F;
            b[3] |= 0x80;
        }
    }
    for o in 0..rows {
        let row = &data[o * rb..(o + 1) * rb];
        dequant_row_f32(f, row, &mut w[o * k..(o + 1) * k]).unwrap();
        dequant_row_f32(f, &mag[o * rb..(o + 1) * rb], &mut wm[o * k..(o + 1) * k]).unwrap();
    }
    for v in wm.iter_mut() {
        *v = v.abs();
    }
    (w, wm)
}

/// `kv` (`[n, n_out]`) of `rows` against `w` on `kernel` with `threads`.
#[allow(clippy::too_many_arguments)]
fn project(
    kernel: Kernel,
    threads: usize,
    exact: bool,
    raw: bool,
    rows: &[u16],
    k: usize,
    w: Weights<'_>,
    n_out: usize,
) -> Vec<f32> {
    let mut p = Projection::new(threads).unwrap();
    p.set_kernel(kernel);
    p.set_exact_quant(exact);
    p.set_raw_sums(raw);
    // Q8_0's integer path is not a default (slower where measured), but
    // held to the same contract.
    p.set_int_dot_q8_0(true);
    let n = rows.len() / k;
    let mut kv = vec![0f32; n * n_out];
    p.run(rows, n, k, w, n_out, &mut kv).unwrap();
    kv
}

/// How many outputs of `got` exceed the bound against the twin `want`
/// (`rounded`: both rounded to bf16), and how many differ from it at all
/// (the largest error over its bound is printed).
#[allow(clippy::too_many_arguments)]
fn check_bound(
    got: &[f32],
    want: &[f32],
    rows: &[u16],
    w: &[f32],
    wm: &[f32],
    k: usize,
    n_out: usize,
    rounded: bool,
) -> (usize, usize) {
    let (mut over, mut differ, mut worst) = (0, 0, 0f64);
    for t in 0..rows.len() / k {
        let x: Vec<f32> = rows[t * k..(t + 1) * k]
            .iter()
            .map(|&b| bf16_to_f32(b))
            .collect();
        for o in 0..n_out {
            let (a, b) = (got[t * n_out + o] as f64, want[t * n_out + o] as f64);
            let wr = &w[o * k..(o + 1) * k];
            let mr = &wm[o * k..(o + 1) * k];
            let bound = int_dot_bound(&x, wr, mr, rounded.then_some((a, b)));
            over += ((a - b).abs() > bound) as usize;
            worst = worst.max((a - b).abs() / bound);
            differ += (a != b) as usize;
        }
    }
    eprintln!("worst error / bound: {worst:.3}");
    (over, differ)
}

/// The default path is within the derived bound of the twin (raw f32 sums
/// and rounded `kv`), and is a different path (some outputs differ); the
/// exact option gives the twin's bits.
#[test]
fn integer_dots_stay_within_the_bound_and_exact_restores_the_twin() {
    let (k, n_out) = (1536usize, 21usize);
    for kernel in int_kernels() {
        for (s, ty) in [EngramType::Q8_0, EngramType::Q4_K].into_iter().enumerate() {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let data = weights(ty, n_out, k, 7 + s as u64, false);
            let (w, wm) = twin(ty, &data, k);
            let q = Weights::quant(f, &data, k).unwrap();
            for n in [1usize, 3, 8, 37] {
                let rows = tokens(n, k, 100 + n as u64);
                for raw in [true, false] {
                    let twin_kv = project(kernel, 2, true, raw, &rows, k, Weights::F32(&w), n_out);
                    let exact = project(kernel, 2, true, raw, &rows, k, q, n_out);
                    assert_eq!(
                        exact.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        twin_kv.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{kernel:?} {}: the exact option must give the twin's bits",
                        f.name()
                    );
                    let got = project(kernel, 2, false, raw, &rows, k, q, n_out);
                    let (over, differ) =
                        check_bound(&got, &twin_kv, &rows, &w, &wm, k, n_out, !raw);
                    assert_eq!(
                        over,
                        0,
                        "{kernel:?} {} n {n} raw {raw}: outside the bound",
                        f.name()
                    );
                    assert!(
                        differ > 0 || !raw,
                        "{kernel:?} {} n {n}: no output differs from the twin (integer path not taken?)",
                        f.name()
                    );
                }
            }
        }
    }
}

/// The bound is not vacuous: a token quantisation one bit coarser than the
/// documented one (scale `2 dx`) breaks it on tokens whose values sit where
/// that rounding errs by `dx` every time (`x / dx = 4 m + 1`), against
/// weights of one sign, while the documented quantisation is exact there.
#[test]
fn a_wrong_token_quantisation_breaks_the_bound() {
    let (k, n_out) = (512usize, 6usize);
    let x: Vec<u16> = (0..k)
        .map(|i| f32_to_bf16(((4 * (i % 32) + 1) as f32) * 2f32.powi(-12)))
        .collect();
    let xf: Vec<f32> = x.iter().map(|&b| bf16_to_f32(b)).collect();
    assert_eq!(int_dot_scale(&xf[..256]), 2f64.powi(-12));
    for kernel in int_kernels() {
        for ty in [EngramType::Q8_0, EngramType::Q4_K] {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let mut data = weights(ty, n_out, k, 3, true);
            if ty == EngramType::Q8_0 {
                // Codes of one sign.
                for b in data.chunks_exact_mut(f.block().unwrap().1) {
                    for c in &mut b[2..] {
                        *c &= 0x7F;
                    }
                }
            }
            let (w, wm) = twin(ty, &data, k);
            let q = Weights::quant(f, &data, k).unwrap();
            let want = project(kernel, 1, true, true, &x, k, Weights::F32(&w), n_out);
            let good = project(kernel, 1, false, true, &x, k, q, n_out);
            assert_eq!(check_bound(&good, &want, &x, &w, &wm, k, n_out, false).0, 0);
            let mut p = Projection::new(1).unwrap();
            p.set_kernel(kernel);
            p.set_raw_sums(true);
            p.set_int_dot_q8_0(true);
            p.set_token_scale(|amax| {
                let s = if amax == 0.0 {
                    1.0
                } else {
                    2f32.powi(amax.log2().floor() as i32 - 5)
                };
                if amax.is_finite() {
                    s
                } else {
                    f32::NAN
                }
            });
            let mut bad = vec![0f32; n_out];
            p.run(&x, 1, k, q, n_out, &mut bad).unwrap();
            let (over, _) = check_bound(&bad, &want, &x, &w, &wm, k, n_out, false);
            assert_eq!(
                over,
                n_out,
                "{kernel:?} {}: the wrong quantisation stayed within the bound",
                f.name()
            );
        }
    }
}

/// A token's `kv` does not depend on its batch: every batch size 1..600
/// (sizes and offsets spread over the 600 tokens), on 1, 2 and 3 threads,
/// gives each token the bits it gets in the whole batch.
#[test]
fn integer_dots_are_batch_and_thread_invariant_1_to_600_tokens() {
    let (k, n_out, n) = (256usize, 7usize, 600usize);
    let rows = tokens(n, k, 5);
    for kernel in int_kernels() {
        for ty in [EngramType::Q8_0, EngramType::Q4_K] {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let data = weights(ty, n_out, k, 9, false);
            let q = Weights::quant(f, &data, k).unwrap();
            let all = project(kernel, 2, false, true, &rows, k, q, n_out);
            let mut ps: Vec<Projection> = (1..=3)
                .map(|t| {
                    let mut p = Projection::new(t).unwrap();
                    p.set_kernel(kernel);
                    p.set_raw_sums(true);
                    p.set_int_dot_q8_0(true);
                    p
                })
                .collect();
            // Across thread counts with several tasks (131 outputs: tasks
            // of 64 rows, tiles of 2 and single rows at their ends).
            let wide = weights(ty, 131, k, 19, false);
            let qw = Weights::quant(f, &wide, k).unwrap();
            let sub = &rows[..65 * k];
            let whole = project(kernel, 2, false, true, sub, k, qw, 131);
            for (threads, size) in [(1, 65), (3, 65), (1, 1), (3, 2), (2, 5)] {
                let kv = project(kernel, threads, false, true, &sub[..size * k], k, qw, 131);
                assert!(
                    kv.iter()
                        .zip(&whole)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kernel:?} {}: {size} tokens on {threads} threads differ",
                    f.name()
                );
            }
            for size in 1..=n {
                let lo = (size * 7919) % (n - size + 1);
                let p = &mut ps[size % 3];
                let mut kv = vec![0f32; size * n_out];
                p.run(&rows[lo * k..(lo + size) * k], size, k, q, n_out, &mut kv)
                    .unwrap();
                let want = &all[lo * n_out..(lo + size) * n_out];
                assert!(
                    kv.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{kernel:?} {}: tokens {lo}..{} on {} threads differ from the whole batch",
                    f.name(),
                    lo + size,
                    size % 3 + 1
                );
            }
        }
    }
}

/// Through a context (what an engine gets): a `Q4_K` `wkv` by default
/// within the bound of its f32 twin, and with `with_exact_quant(true)`
/// (`engram_config.exact_quant_wkv = 1`) the twin's bits.
#[test]
fn a_context_takes_the_exact_option() {
    use common::Tiny;
    let tiny = Tiny::load();
    let (d, hc, hd, cols) = (tiny.d, tiny.hc, tiny.hd, tiny.cols());
    let (k, k_out) = (cols * hd, d * (hc + 1));
    if !k.is_multiple_of(256) {
        eprintln!("K = {k}: no whole token blocks, nothing to check");
        return;
    }
    let ty = EngramType::Q4_K;
    let f = EngramType::row_format(ty as u32, k).unwrap();
    let data = weights(ty, k_out, k, 77, false);
    let (w, wm) = twin(ty, &data, k);
    let run = |wkv: Weights<'_>, exact: bool| {
        let (rows, kv) = tiny.stages_with_wkv(wkv, exact);
        (
            rows,
            kv.iter().map(|&b| bf16_to_f32(b)).collect::<Vec<f32>>(),
        )
    };
    let q = Weights::quant(f, &data, k).unwrap();
    let (rows, twin_kv) = run(Weights::F32(&w), true);
    let (_, exact) = run(q, true);
    let (_, default) = run(q, false);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&exact), bits(&twin_kv), "exact: the twin's bits");
    let (over, _) = check_bound(&default, &twin_kv, &rows, &w, &wm, k, k_out, true);
    assert_eq!(over, 0, "the default is outside the bound of the twin");
    if !int_kernels().is_empty() && std::env::var_os("ENGRAM_CPU_KERNEL").is_none() {
        assert_ne!(
            bits(&default),
            bits(&exact),
            "the default took the exact path"
        );
    }
}

/// A shard's output range (`Weights::rows`, as `engram_kv_columns` takes
/// it) gives those outputs the bits of the whole layer's call on the
/// integer path.
#[test]
fn an_output_range_gives_the_whole_layers_bits() {
    let (k, n_out, n) = (512usize, 37usize, 9usize);
    let rows = tokens(n, k, 31);
    for kernel in int_kernels() {
        for ty in [EngramType::Q8_0, EngramType::Q4_K] {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let data = weights(ty, n_out, k, 41, false);
            let q = Weights::quant(f, &data, k).unwrap();
            let all = project(kernel, 2, false, true, &rows, k, q, n_out);
            for (lo, hi) in [(0, 1), (3, 10), (5, 37), (36, 37)] {
                let part = project(
                    kernel,
                    2,
                    false,
                    true,
                    &rows,
                    k,
                    q.rows(lo, hi, k).unwrap(),
                    hi - lo,
                );
                for t in 0..n {
                    for o in lo..hi {
                        assert_eq!(
                            part[t * (hi - lo) + o - lo].to_bits(),
                            all[t * n_out + o].to_bits(),
                            "{kernel:?} {}: outputs {lo}..{hi}, token {t}, output {o}",
                            f.name()
                        );
                    }
                }
            }
        }
    }
}

/// A token holding an infinity or a NaN gets NaN in every output on the
/// integer path (docs/numerics.md), and the other tokens of its batch keep
/// their bits.
#[test]
fn a_non_finite_token_gives_nan_and_leaves_the_others_alone() {
    let (k, n_out, n) = (512usize, 5usize, 4usize);
    let clean = tokens(n, k, 51);
    for kernel in int_kernels() {
        for ty in [EngramType::Q8_0, EngramType::Q4_K] {
            let f = EngramType::row_format(ty as u32, k).unwrap();
            let data = weights(ty, n_out, k, 61, false);
            let q = Weights::quant(f, &data, k).unwrap();
            let want = project(kernel, 1, false, true, &clean, k, q, n_out);
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut rows = clean.clone();
                rows[k + 300] = f32_to_bf16(bad);
                let got = project(kernel, 1, false, true, &rows, k, q, n_out);
                for t in 0..n {
                    for o in 0..n_out {
                        let (g, w) = (got[t * n_out + o], want[t * n_out + o]);
                        if t == 1 {
                            assert!(g.is_nan(), "{kernel:?} {}: {bad} gives {g}", f.name());
                        } else {
                            assert_eq!(
                                g.to_bits(),
                                w.to_bits(),
                                "{kernel:?} {}: token {t}",
                                f.name()
                            );
                        }
                    }
                }
            }
        }
    }
}
