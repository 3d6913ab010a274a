//! The block-scaled fp8 `wkv` (`ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK`, the
//! checkpoint's `wkv.weight` + `wkv.scale` as stored), read in place by the
//! CPU kernels: `kv` is bit for bit that of the same weights widened to bf16
//! and given as `ENGRAM_TYPE_BF16`, for every kernel this CPU runs, 1 and 2
//! threads and 1 ... 512 tokens, on block shapes that take the kernels'
//! in-register paths and shapes that take their fallbacks. And what
//! `set_layer` refuses (every bad value names its block; nothing changes).

mod common;

use common::*;
use engram::cpu::projection::{Kernel, Projection};
use engram::formats::{f32_to_bf16, Fp8Blocks};
use engram::{EngramStatus, EngramType, LayerIn, Weights};

/// A `[rows, k]` block-scaled fp8 matrix: random codes (every code but the
/// NaN ones: zeros and subnormals included) and scales around 1.
fn matrix(rows: usize, k: usize, br: usize, bc: usize, seed: &str) -> (Vec<u8>, Vec<u8>) {
    let f = Filler::new(seed);
    let codes: Vec<u8> = (0..rows * k)
        .map(|i| {
            let c = f.bits(i as u64) as u8;
            if c & 0x7F == 0x7F {
                c ^ 1
            } else {
                c
            }
        })
        .collect();
    let n = rows.div_ceil(br) * k.div_ceil(bc);
    let g = Filler::new(&format!("{seed}-scales"));
    let scales: Vec<u8> = (0..n)
        .map(|i| 118 + (g.bits(i as u64) % 12) as u8)
        .collect();
    (codes, scales)
}

/// The matrix widened to bf16 bit patterns (exact: `Fp8Blocks::check` holds).
fn widened(w: &Fp8Blocks<'_>) -> Vec<u16> {
    let mut v = vec![0f32; w.codes.len()];
    w.to_f32(0, &mut v);
    v.iter()
        .map(|&x| {
            let b = f32_to_bf16(x);
            assert_eq!(engram::formats::bf16_to_f32(b), x, "not exact in bf16");
            b
        })
        .collect()
}

fn kernels() -> Vec<Kernel> {
    [
        Kernel::Portable,
        Kernel::Avx2,
        Kernel::Avx512,
        Kernel::Avx512Bf16,
        Kernel::Amx,
    ]
    .into_iter()
    .filter(|k| k.supported())
    .collect()
}

#[test]
fn fp8_wkv_is_bit_identical_to_the_bf16_path() {
    // (k, rows, block rows, block cols): the checkpoint's 128 x 128 blocks
    // (every in-register path), blocks of 16 x 32 and 32 x 16, and shapes
    // that take the fallbacks (blocks not a power of two, partial edge
    // blocks, K not a multiple of 32).
    let shapes = [
        (512, 272, 128, 128),
        (512, 96, 16, 32),
        (256, 80, 32, 16),
        (528, 70, 7, 48),
        (200, 40, 3, 5),
    ];
    let ks = kernels();
    println!("kernels: {ks:?}");
    for &(k, rows, br, bc) in &shapes {
        let (codes, scales) = matrix(rows, k, br, bc, &format!("fp8-wkv-{k}-{br}x{bc}"));
        let w = Fp8Blocks::new(&codes, &scales, k, br, bc).unwrap();
        w.check().unwrap();
        let wb = widened(&w);
        let max_n = 512;
        let xs: Vec<u16> = values(&format!("fp8-wkv-x-{k}"), max_n * k, 2.0, -1.0)
            .iter()
            .map(|&x| f32_to_bf16(x))
            .collect();
        for &kernel in &ks {
            for threads in [1, 2] {
                let mut p = Projection::new(threads).unwrap();
                p.set_kernel(kernel);
                assert_eq!(p.kernel(), kernel);
                // The f32 sums before their bf16 rounding: any change of
                // operand or order shows.
                p.set_raw_sums(true);
                for n in [1, 2, 7, 8, 48, 64, 512] {
                    let x = &xs[..n * k];
                    let mut a = vec![0f32; n * rows];
                    let mut b = vec![0f32; n * rows];
                    p.run(x, n, k, Weights::Fp8Block(w), rows, &mut a).unwrap();
                    p.run(x, n, k, Weights::Bf16(&wb), rows, &mut b).unwrap();
                    let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{kernel:?}, {threads} threads, {n} tokens, k {k}, blocks {br} x {bc}: \
                         fp8 sums differ from the bf16 path's"
                    );
                }
            }
        }
    }
}

/// Every e4m3 code and every valid scale through the in-register
/// conversions (one row of 256 codes a scale): the same sums as bf16.
#[test]
fn every_code_and_scale_converts_exactly() {
    let k = 256;
    for &kernel in &kernels() {
        let mut p = Projection::new(1).unwrap();
        p.set_kernel(kernel);
        p.set_raw_sums(true);
        for s in 0..255u8 {
            // 16 rows (one GEMM panel, one block row), each every code.
            let codes: Vec<u8> = (0..16 * 256)
                .map(|i| (i % 256) as u8)
                .map(|c| if c & 0x7F == 0x7F { 0 } else { c })
                .collect();
            let scales = [s; 2];
            let w = Fp8Blocks::new(&codes, &scales, k, 16, 128).unwrap();
            if w.check().is_err() {
                continue; // refused at set_layer (overflow, or not exact in bf16)
            }
            let wb = widened(&w);
            // One-hot tokens pick each weight out exactly: kv[t] = w[t].
            let n = 64;
            let mut x = vec![0u16; n * k];
            let mut ok = true;
            for start in (0..k).step_by(n) {
                for t in 0..n {
                    x[t * k..(t + 1) * k].fill(0);
                    x[t * k + start + t] = 0x3F80; // 1.0
                }
                let (mut a, mut b) = (vec![0f32; n * 16], vec![0f32; n * 16]);
                p.run(&x, n, k, Weights::Fp8Block(w), 16, &mut a).unwrap();
                p.run(&x, n, k, Weights::Bf16(&wb), 16, &mut b).unwrap();
                ok &= a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            }
            assert!(ok, "{kernel:?}: scale {s}");
        }
    }
}

/// The tiny model's layer 0 with its `wkv` as block-scaled fp8 (values made
/// from its own weights): through a context, the same rows and `kv` as the
/// widened bf16 `wkv`, and the bad inputs `set_layer` refuses.
#[test]
fn a_context_takes_fp8_wkv_and_refuses_bad_blocks() {
    let tiny = Tiny::load();
    let (hd, cols, d, hc) = (tiny.hd, tiny.cols(), tiny.d, tiny.hc);
    let (k_in, k_out) = (cols * hd, d * (hc + 1));
    let l = &tiny.layers[0];
    let (br, bc) = (4, 32);
    let (codes, scales) = matrix(k_out, k_in, br, bc, "fp8-wkv-tiny");
    let w = Fp8Blocks::new(&codes, &scales, k_in, br, bc).unwrap();
    let wb = widened(&w);
    fn layer<'a>(l: &'a LayerData, hd: usize, wkv: Weights<'a>) -> LayerIn<'a> {
        let mut li = LayerIn::host(
            l.layer_id,
            &l.table,
            EngramType::row_format(l.format as u32, hd).unwrap(),
            l.rows,
            l.wkv.weights(),
            l.q.weights(),
            l.k.weights(),
        );
        let w2 = LayerIn::host(
            l.layer_id,
            &l.table,
            EngramType::row_format(l.format as u32, hd).unwrap(),
            l.rows,
            wkv,
            l.q.weights(),
            l.k.weights(),
        );
        li.wkv = w2.wkv;
        li.wkv_type = w2.wkv_type;
        li.wkv_scales = w2.wkv_scales;
        li.wkv_block = w2.wkv_block;
        li
    }
    let layer = |wkv| layer(l, hd, wkv);
    let run = |ctx: &engram::Context<'_>| {
        let tokens: Vec<i32> = (0..16).map(|i| i * 7 % 48).collect();
        let pos: Vec<i32> = (0..16).collect();
        let mut ids = vec![0i64; 16 * ctx.ids_per_token()];
        ctx.hash(&tokens, &[0; 16], &pos, &mut ids).unwrap();
        ctx.stages(l.layer_id, &ids, 16).unwrap()
    };
    let (r, c) = (2 * br + 1, bc + 3);
    let mut bad_codes = codes.clone();
    bad_codes[r * k_in + c] = 0xFF;
    bad_codes[(3 * br) * k_in] = 0x7F; // block (3, 0): later in block order
    bad_codes[(2 * br + 2) * k_in + bc + 1] = 0x7F; // block (2, 1), a later element
    let bad = Fp8Blocks::new(&bad_codes, &scales, k_in, br, bc).unwrap();
    for kernel in kernels() {
        let a = tiny.context_with(kernel);
        a.set_layer(layer(Weights::Fp8Block(w))).unwrap();
        let b = tiny.context_with(kernel);
        b.set_layer(layer(Weights::Bf16(&wb))).unwrap();
        assert_eq!(run(&a), run(&b), "{kernel:?}");
        let before = run(&a);
        // A NaN code in block (2, 1): refused naming the block, the layer
        // stays as it was.
        let e = a.set_layer(layer(Weights::Fp8Block(bad))).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
        assert!(
            e.message.contains(&format!(
                "fp8 block (2, 1) (rows {}..{}, columns {bc}..{})",
                2 * br,
                3 * br,
                2 * bc
            )) && e
                .message
                .contains(&format!("element ({r}, {c}) is an e4m3 NaN code")),
            "{}",
            e.message
        );
        assert_eq!(run(&a), before, "a refused set_layer changes nothing");
    }
    // Sizes and shapes.
    let ctx = tiny.context();
    let ok = layer(Weights::Fp8Block(w));
    for (what, li, status) in [
        (
            "block rows 0",
            LayerIn {
                wkv_block: (0, bc as u32),
                ..ok.clone()
            },
            EngramStatus::ErrInvalidArgument,
        ),
        (
            "block cols 0",
            LayerIn {
                wkv_block: (br as u32, 0),
                ..ok.clone()
            },
            EngramStatus::ErrInvalidArgument,
        ),
        (
            "no scales",
            LayerIn {
                wkv_scales: None,
                ..ok.clone()
            },
            EngramStatus::ErrNullArgument,
        ),
        // Blocks of 4 x 16 need twice the scales given.
        (
            "other shape",
            LayerIn {
                wkv_block: (br as u32, 16),
                ..ok.clone()
            },
            EngramStatus::ErrInvalidArgument,
        ),
        (
            "scales for bf16",
            LayerIn {
                wkv_scales: ok.wkv_scales,
                ..layer(Weights::Bf16(&wb))
            },
            EngramStatus::ErrInvalidArgument,
        ),
    ] {
        let e = ctx.set_layer(li).unwrap_err();
        assert_eq!(e.status, status, "{what}: {}", e.message);
    }
    ctx.set_layer(ok).unwrap();
}
