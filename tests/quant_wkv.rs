//! A quantised `wkv` (GGUF Q8_0, Q4_0, Q4_K) is read in place and dequantised
//! on the fly. Its `kv` equals, bit for bit, the f32 path on the same
//! dequantised weights, and stays within a stated bound of the bf16 path on
//! those weights rounded to bf16.

mod common;

use common::*;
use engram::formats::{bf16_to_f32, dequant_row_f32, f32_to_bf16};
use engram::{EngramType, Weights};

#[test]
fn quantised_wkv_matches_the_dense_paths() {
    let tiny = Tiny::load();
    let (d, hc, hd, cols) = (tiny.d, tiny.hc, tiny.hd, tiny.cols());
    let (k_in, k_out) = (cols * hd, d * (hc + 1));
    let layer = &tiny.layers[0];
    let vals = layer.wkv.f32();
    for (name, ty, bytes) in [
        ("q8_0", engram::EngramType::Q8_0, q8_0(&vals)),
        ("q4_0", engram::EngramType::Q4_0, q4_0(&vals)),
    ] {
        let fmt = EngramType::row_format(ty as u32, k_in).unwrap();
        let mut deq = vec![0f32; vals.len()];
        for (o, row) in deq.chunks_mut(k_in).enumerate() {
            let rb = fmt.row_bytes(k_in);
            dequant_row_f32(fmt, &bytes[o * rb..(o + 1) * rb], row).unwrap();
        }
        let deq_bf16: Vec<u16> = deq.iter().map(|&v| f32_to_bf16(v)).collect();
        // The twin's bits need the exact option (tests/int_dot.rs: the default).
        let run = |wkv: Weights<'_>| tiny.stages_with_wkv(wkv, true);
        let (rows, kv_q) = run(Weights::quant(fmt, &bytes, k_in).unwrap());
        let (_, kv_f32) = run(Weights::F32(&deq));
        let (_, kv_bf16) = run(Weights::Bf16(&deq_bf16));
        assert_eq!(
            kv_q, kv_f32,
            "{name}: the quantised path must equal the f32 path on the same values"
        );
        // Against the bf16 path: the weights differ by their bf16 rounding
        // (|dw| <= 2^-9 |w|), so sums differ by at most 2^-9 sum|r w| on top of
        // the two f32 summation errors ((K+2) u sum|r w|) and one bf16 ulp.
        let n_live = rows.len() / k_in;
        let mut differ = 0;
        for t in 0..n_live {
            let r: Vec<f64> = rows[t * k_in..(t + 1) * k_in]
                .iter()
                .map(|&b| bf16_to_f32(b) as f64)
                .collect();
            for o in 0..k_out {
                let (a, b) = (
                    bf16_to_f32(kv_q[t * k_out + o]) as f64,
                    bf16_to_f32(kv_bf16[t * k_out + o]) as f64,
                );
                let s: f64 = r
                    .iter()
                    .zip(&deq[o * k_in..(o + 1) * k_in])
                    .map(|(x, &w)| (x * w as f64).abs())
                    .sum();
                let ulp = 2f64.powi(a.abs().max(b.abs()).max(1e-30).log2().floor() as i32 - 7);
                let bound = s * (2f64.powi(-9) + (k_in as f64 + 2.0) * 2f64.powi(-24)) + ulp;
                assert!(
                    (a - b).abs() <= bound,
                    "{name}: token {t} kv[{o}] {a} vs bf16 path {b}, bound {bound}"
                );
                differ += (a != b) as usize;
            }
        }
        println!(
            "{name}: {differ} of {} kv values differ from the bf16 path, all within bound",
            n_live * k_out
        );
    }
}
