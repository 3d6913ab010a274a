use super::*;
use crate::formats::ggml::random_blocks;

/// Every weight format the kernels read fast, and one they read through
/// the reference dequantisation (q6_K), as `(name, weights)` over `k`
/// values a row (`k` a multiple of 256 for the quantised ones).
fn formats_for(k: usize, n_out: usize, w: &[u16], wf: &[f32]) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = vec![
        (
            "bf16".into(),
            w.iter().flat_map(|b| b.to_le_bytes()).collect(),
        ),
        (
            "f32".into(),
            wf.iter().flat_map(|b| b.to_le_bytes()).collect(),
        ),
    ];
    if k.is_multiple_of(256) {
        for (i, ty) in QUANT.iter().enumerate() {
            let f = EngramType::row_format(*ty as u32, k).unwrap();
            out.push((
                f.name().to_string(),
                random_blocks(f, n_out * f.row_bytes(k), 11 + i as u64),
            ));
        }
    }
    out
}

/// A kernel as the tests run it: one by name (one this CPU lacks runs as
/// the portable one), or the AMX kernel on emulated tiles.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Run {
    Named(Kernel),
    AmxEmulated,
}

/// Every kernel, and the AMX kernel's driver on emulated tiles.
const KERNELS: [Run; 6] = [
    Run::Named(Kernel::Portable),
    Run::Named(Kernel::Avx2),
    Run::Named(Kernel::Avx512),
    Run::Named(Kernel::Avx512Bf16),
    Run::Named(Kernel::Amx),
    Run::AmxEmulated,
];

/// A projection on `threads` threads running `kernel`.
fn projection(threads: usize, kernel: Run) -> Projection {
    let mut p = Projection::new(threads).unwrap();
    match kernel {
        Run::Named(k) => p.set_kernel(k),
        // Without AVX-512 it stays on the detected kernel.
        Run::AmxEmulated => _ = p.set_amx_emulated(),
    }
    p
}

const QUANT: [EngramType; 7] = [
    EngramType::Q8_0,
    EngramType::Q4_0,
    EngramType::Q2_K,
    EngramType::Q3_K,
    EngramType::Q4_K,
    EngramType::Q5_K,
    EngramType::Q6_K,
];

fn weights_of<'a>(name: &str, bytes: &'a [u8], k: usize) -> Weights<'a> {
    // SAFETY (of the casts): the byte vectors come from `Vec<u8>`s built
    // from whole little-endian u16 / f32 values; they are re-aligned below.
    match name {
        "bf16" => Weights::Bf16(aligned::<u16>(bytes)),
        "f32" => Weights::F32(aligned::<f32>(bytes)),
        _ => {
            let ty = QUANT.iter().find(|t| t.name() == name).unwrap();
            let f = EngramType::row_format(*ty as u32, k).unwrap();
            Weights::quant(f, bytes, k).unwrap()
        }
    }
}

/// `bytes` as a slice of `T` (leaked into an aligned copy: test only).
fn aligned<T: Copy + Default + 'static>(bytes: &[u8]) -> &'static [T] {
    let n = bytes.len() / std::mem::size_of::<T>();
    let mut v = vec![T::default(); n];
    // SAFETY: `v` holds `n * size_of::<T>()` bytes; T is a plain number
    // type (u16 or f32) for which any bit pattern is valid.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len())
    };
    Vec::leak(v)
}

/// A token's kv does not depend on its batch: every kernel and weight
/// format gives (compared before the bf16 rounding, which would hide
/// most changes of order) the same bits for a token projected alone, in small
/// batches (the AVX2 kernel's dot products) and in large ones (its packed
/// GEMM), with one thread or two, with K a whole number of chunks (the
/// formats read in place) or not (rows dequantised through a buffer).
#[test]
fn results_do_not_depend_on_the_batch() {
    for (n, k, n_out) in [(37, 1100, 70), (29, 512, 100)] {
        let (rows, w) = data(n, k, n_out);
        let wf: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
        for (name, bytes) in formats_for(k, n_out, &w, &wf) {
            let weights = weights_of(&name, &bytes, k);
            for kernel in KERNELS {
                let run = |threads: usize, lo: usize, hi: usize| {
                    let mut p = projection(threads, kernel);
                    p.set_raw_sums(true);
                    let mut kv = vec![0f32; (hi - lo) * n_out];
                    p.run(&rows[lo * k..hi * k], hi - lo, k, weights, n_out, &mut kv)
                        .unwrap();
                    kv
                };
                let all = run(2, 0, n);
                for (lo, hi, threads) in [
                    (0, 1, 1),
                    (5, 8, 1),
                    (3, 7, 2),
                    (10, 25, 2),
                    (2, 29, 1),
                    (n - 1, n, 2),
                ] {
                    assert_eq!(
                        run(threads, lo, hi)[..],
                        all[lo * n_out..hi * n_out],
                        "{kernel:?} {name} k {k}: tokens {lo}..{hi}, {threads} threads"
                    );
                }
            }
        }
    }
}

/// Quantised weights give the same bits as f32 weights holding their
/// dequantised values, in every kernel, for every batch size (each
/// kernel's dot products and its GEMM or panel form).
#[test]
fn quantised_weights_match_their_f32_values_at_every_batch_size() {
    use crate::formats::dequant_row_f32;
    let (k, n_out, n) = (512usize, 70usize, 13usize);
    let (rows, _) = data(n, k, 1);
    for (i, ty) in QUANT.iter().enumerate() {
        let f = EngramType::row_format(*ty as u32, k).unwrap();
        let data = random_blocks(f, n_out * f.row_bytes(k), 11 + i as u64);
        let mut deq = vec![0f32; n_out * k];
        for (o, r) in deq.chunks_mut(k).enumerate() {
            dequant_row_f32(f, &data[o * f.row_bytes(k)..(o + 1) * f.row_bytes(k)], r).unwrap();
        }
        for kernel in KERNELS {
            let mut p = projection(2, kernel);
            p.set_raw_sums(true);
            // The twin's bits need the exact option (the default may take
            // integer dot products: tests/int_dot.rs).
            p.set_exact_quant(true);
            let mut p32 = projection(2, kernel);
            p32.set_raw_sums(true);
            for (lo, hi) in [(0, 1), (2, 5), (1, 4), (0, 8), (0, n)] {
                let mut a = vec![0f32; (hi - lo) * n_out];
                let mut b = a.clone();
                p.run(
                    &rows[lo * k..hi * k],
                    hi - lo,
                    k,
                    Weights::quant(f, &data, k).unwrap(),
                    n_out,
                    &mut a,
                )
                .unwrap();
                p32.run(
                    &rows[lo * k..hi * k],
                    hi - lo,
                    k,
                    Weights::F32(&deq),
                    n_out,
                    &mut b,
                )
                .unwrap();
                let name = f.name();
                assert_eq!(a, b, "{name} {kernel:?} tokens {lo}..{hi}");
            }
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
        (20, 160, 37),
        (9, 16, 17),
    ] {
        let (rows, w) = data(n, k, n_out);
        let wf: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
        let all = KERNELS.iter().flat_map(|&k| [(k, false), (k, true)]);
        for (kernel, dense_f32) in all {
            for threads in [1, 2] {
                let p = projection(threads, kernel);
                let mut kv = vec![0f32; n * n_out];
                let weights = if dense_f32 {
                    Weights::F32(&wf)
                } else {
                    Weights::Bf16(&w)
                };
                p.run(&rows, n, k, weights, n_out, &mut kv).unwrap();
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
                        let ulp = 2f64
                            .powi((s.abs().max(got.abs()).max(1e-30)).log2().floor() as i32 - 7);
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

/// Decode-sized batches (1 to 8 tokens) and odd output counts (the dot
/// products' row tiles of 4, 2 and 1, and their remainders), over 3 blocks of
/// 256 values a row: each kernel gives quantised weights the bits of f32
/// weights holding their dequantised values, and stays within the f64 bound
/// of `kernels_agree_with_f64_on_all_tile_shapes` of the exact sum (as the
/// portable kernel does).
#[test]
fn quantised_decode_matches_f32_for_1_to_8_tokens_and_odd_sizes() {
    use crate::formats::dequant_row_f32;
    let k = 768usize;
    let (rows, _) = data(8, k, 1);
    for (i, ty) in QUANT.iter().enumerate() {
        let f = EngramType::row_format(*ty as u32, k).unwrap();
        for n_out in [1usize, 3, 5, 6, 9, 67] {
            let data = random_blocks(f, n_out * f.row_bytes(k), 101 + i as u64);
            let mut deq = vec![0f32; n_out * k];
            for (o, r) in deq.chunks_mut(k).enumerate() {
                dequant_row_f32(f, &data[o * f.row_bytes(k)..(o + 1) * f.row_bytes(k)], r).unwrap();
            }
            for kernel in KERNELS {
                let mut p = projection(1, kernel);
                p.set_raw_sums(true);
                p.set_exact_quant(true);
                let mut p32 = projection(1, kernel);
                p32.set_raw_sums(true);
                for n in 1..=8usize {
                    let x = &rows[..n * k];
                    let mut a = vec![0f32; n * n_out];
                    let mut b = a.clone();
                    let w = Weights::quant(f, &data, k).unwrap();
                    p.run(x, n, k, w, n_out, &mut a).unwrap();
                    p32.run(x, n, k, Weights::F32(&deq), n_out, &mut b).unwrap();
                    let name = f.name();
                    for (j, (ga, gb)) in a.iter().zip(&b).enumerate() {
                        assert_eq!(
                            ga.to_bits(),
                            gb.to_bits(),
                            "{name} {kernel:?} n {n} n_out {n_out} output {j}"
                        );
                    }
                    for t in 0..n {
                        for o in 0..n_out {
                            let (mut s, mut abs) = (0f64, 0f64);
                            for e in 0..k {
                                let v = bf16_to_f32(x[t * k + e]) as f64 * deq[o * k + e] as f64;
                                s += v;
                                abs += v.abs();
                            }
                            let got = a[t * n_out + o] as f64;
                            let bound = (k as f64 + 2.0) * abs / (1u64 << 24) as f64;
                            assert!(
                                (got - s).abs() <= bound,
                                "{name} {kernel:?} n {n} t {t} o {o}: {got} vs {s}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The AVX2 kernel's word-at-a-time unpacking of q4_K / q5_K's 6-bit scales
/// and mins equals the reference one (`formats::ggml::scale_min_k4`) on
/// every byte value in every position.
#[cfg(target_arch = "x86_64")]
#[test]
fn packed_k4_scales_unpack_as_the_reference() {
    let mut z = 7u64;
    for case in 0..4096u32 {
        let mut sc = [0u8; 12];
        for (i, b) in sc.iter_mut().enumerate() {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Cases 0..256 put every byte value in every position.
            *b = if case < 256 {
                (case as u8).rotate_left(i as u32)
            } else {
                (z >> 56) as u8
            };
        }
        let got = avx2::sources::unpack_scales_k4(&sc);
        for j in 0..8 {
            let (s, m) = crate::formats::ggml::scale_min_k4(&sc, j);
            assert_eq!((got[j], got[8 + j]), (s, m), "case {case} {sc:?} pair {j}");
        }
    }
}

/// The `vdpbf16ps` kernel gives the FMA kernel's bits (each lane: the odd
/// element's product, then the even one's, each rounded once) on bf16 and
/// block-scaled fp8 weights without subnormals, for decode sizes and
/// batches; a CPU whose instruction summed otherwise fails here.
#[test]
fn the_bf16_dot_kernel_gives_the_fma_kernels_bits() {
    if !Kernel::Avx512Bf16.supported() {
        eprintln!("no avx512bf16 here: skipped");
        return;
    }
    let (k, n_out) = (1024usize, 77usize);
    let (rows, w) = data(70, k, n_out);
    // Block-scaled fp8 with every code but NaN and scales 2^-3..2^0 (every
    // value a normal bf16).
    let mut z = 7u64;
    let mut byte = || {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (z >> 56) as u8
    };
    let codes: Vec<u8> = (0..n_out * k)
        .map(|_| match byte() {
            c if c & 0x7f == 0x7f => c ^ 1,
            c => c,
        })
        .collect();
    let n_scales = crate::formats::fp8_block::fp8_block_scale_len(n_out, k, 128, 128).unwrap();
    let scales: Vec<u8> = (0..n_scales).map(|_| 124 + byte() % 4).collect();
    let fp8 = crate::formats::Fp8Blocks::new(&codes, &scales, k, 128, 128).unwrap();
    for n in [1usize, 2, 3, 4, 5, 8, 33, 70] {
        for weights in [Weights::Bf16(&w), Weights::Fp8Block(fp8)] {
            let run = |kernel: Kernel| {
                let mut p = Projection::new(2).unwrap();
                p.set_kernel(kernel);
                p.set_raw_sums(true);
                let mut kv = vec![0f32; n * n_out];
                p.run(&rows[..n * k], n, k, weights, n_out, &mut kv)
                    .unwrap();
                kv
            };
            let (a, b) = (run(Kernel::Avx512), run(Kernel::Avx512Bf16));
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_eq!(
                    x.to_bits(),
                    y.to_bits(),
                    "n {n} output {i}: {x} vs {y} ({weights:?})"
                );
            }
        }
    }
}

/// The AMX kernel keeps a token's bits whatever its batch (1 to 600
/// tokens, at the start, middle or end of the batch: whole B tiles, a
/// 1-column tile, partial tiles) and thread count (1 to 4), for bf16 and
/// block-scaled fp8 `wkv`, with outputs off whole tiles and K off whole
/// chunks; emulated here, and on the instructions where the CPU has AMX.
#[test]
fn amx_tokens_keep_their_bits_across_batches_and_threads() {
    let (n_all, n_out) = (600usize, 53usize);
    for k in [128usize, 100] {
        let (rows, w) = data(n_all, k, n_out);
        let codes: Vec<u8> = (0..n_out * k)
            .map(|i| (i * 37 % 251) as u8 & 0x7E)
            .collect();
        let n_sc = crate::formats::fp8_block::fp8_block_scale_len(n_out, k, 16, 32).unwrap();
        let scales: Vec<u8> = (0..n_sc).map(|i| 122 + (i % 7) as u8).collect();
        let fp8 = crate::formats::Fp8Blocks::new(&codes, &scales, k, 16, 32).unwrap();
        let mut kernels = vec![Run::AmxEmulated];
        if Kernel::Amx.supported() {
            kernels.push(Run::Named(Kernel::Amx));
        } else {
            eprintln!("no AMX here: the instructions are not run");
        }
        for weights in [Weights::Bf16(&w), Weights::Fp8Block(fp8)] {
            for &kernel in &kernels {
                let run = |threads: usize, lo: usize, hi: usize| {
                    let mut p = projection(threads, kernel);
                    assert_eq!(p.kernel(), Kernel::Amx);
                    p.set_raw_sums(true);
                    let mut kv = vec![0f32; (hi - lo) * n_out];
                    let x = &rows[lo * k..hi * k];
                    p.run(x, hi - lo, k, weights, n_out, &mut kv).unwrap();
                    kv
                };
                let all = run(1, 0, n_all);
                for n in [1usize, 2, 15, 16, 17, 31, 33, 64, 255, 600] {
                    for (threads, lo) in [(1, 0), (2, n_all - n), (3, (n_all - n) / 2), (4, 0)] {
                        let got = run(threads, lo, lo + n);
                        let want = &all[lo * n_out..(lo + n) * n_out];
                        let same = got
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{kernel:?} k {k} tokens {lo}..{}, {threads} threads",
                            lo + n
                        );
                    }
                }
            }
        }
    }
}

/// The AMX kernel's f32 sums (before the bf16 rounding) hold the bound
/// docs/numerics.md derives for its order: a term passes through at most
/// 16 roundings in its chunk's partial sum, 1 adding the two partial sums
/// and one for each chunk added after it, so `|sum - exact| <= (ceil(K/32)
/// + 17) u sum|x w|` with `u = 2^-24` (no subnormal value here), far inside
/// the `(K + 2) u` every kernel is held to.
#[test]
fn amx_sums_hold_their_derived_bound() {
    for &(n, k, n_out) in &[(3, 100, 7), (20, 1536, 37), (17, 64, 33), (1, 6144, 5)] {
        let (rows, w) = data(n, k, n_out);
        let mut p = projection(2, Run::AmxEmulated);
        assert_eq!(p.kernel(), Kernel::Amx);
        p.set_raw_sums(true);
        let mut kv = vec![0f32; n * n_out];
        p.run(&rows, n, k, Weights::Bf16(&w), n_out, &mut kv)
            .unwrap();
        let depth = (k.div_ceil(32) + 17) as f64;
        for t in 0..n {
            for o in 0..n_out {
                let (mut s, mut a) = (0f64, 0f64);
                for i in 0..k {
                    let x = bf16_to_f32(rows[t * k + i]) as f64 * bf16_to_f32(w[o * k + i]) as f64;
                    s += x;
                    a += x.abs();
                }
                let got = kv[t * n_out + o] as f64;
                let bound = depth * a / (1u64 << 24) as f64;
                assert!(
                    (got - s).abs() <= bound,
                    "n {n} k {k} t {t} o {o}: {got} vs {s} (bound {bound})"
                );
            }
        }
    }
}
