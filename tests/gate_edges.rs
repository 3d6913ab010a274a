//! The gate at numeric edges on the CPU backend (docs/numerics.md); the CUDA
//! kernel gets the same highway in tests/cuda_golden.rs.
//!
//! Tolerance: each updated value within `gate_reference`'s bound of the f64
//! reference (tests/common/bounds.rs: the f32 error of the three sums, the
//! gate and the update), computed on the library's own kv. Before the fix a
//! stream whose x.x overflowed f32 got the gate 0.5 (rstd 0, dot 0) and one
//! with +-3e38 a NaN gate, both far outside that bound on the stream's
//! normal values.

mod common;

use common::bounds::*;
use common::*;
use engram::formats::{bf16_to_f32, f32_to_bf16};
use engram::{Context, EngramStatus, Highway};

#[test]
fn edge_streams_on_the_cpu_within_the_f64_bound() {
    let tiny = Tiny::load();
    let ctx = tiny.context();
    let (hc, d) = (tiny.hc, tiny.d);
    let k_out = d * (hc + 1);
    let call = &tiny.golden["regimes"]["prefill"]["calls"][0];
    let (tokens, seq, pos) = (
        i32s(&call["tokens"]),
        i32s(&call["seq_ids"]),
        i32s(&call["pos"]),
    );
    let n = tokens.len();
    let per = ctx.ids_per_token();
    let mut ids = vec![0i64; n * per];
    ctx.hash(&tokens, &seq, &pos, &mut ids).unwrap();
    let live: Vec<usize> = (0..n)
        .filter(|&t| ids[t * per] != engram::ROW_ID_DEAD)
        .collect();
    assert!(live.len() * hc >= 12, "every edge kind on a live token");
    let hw_in = edge_highway(n, hc, d);
    let mut kinds_seen = [0usize; 6];
    for layer in &tiny.layers {
        let lid = layer.layer_id;
        let (_, kv) = ctx.stages(lid, &ids, n).unwrap();
        let kv_f: Vec<f32> = kv.iter().map(|&b| bf16_to_f32(b)).collect();
        let qk: Vec<f32> = layer
            .q
            .f32()
            .iter()
            .zip(layer.k.f32())
            .map(|(a, b)| a * b)
            .collect();
        let mut h32 = hw_in.clone();
        ctx.apply(lid, &ids, n, Highway::F32(&mut h32)).unwrap();
        let hb_in: Vec<u16> = hw_in.iter().map(|&v| f32_to_bf16(v)).collect();
        let hb_f: Vec<f32> = hb_in.iter().map(|&b| bf16_to_f32(b)).collect();
        let mut hb = hb_in.clone();
        ctx.apply(lid, &ids, n, Highway::Bf16(&mut hb)).unwrap();
        for (j, &t) in live.iter().enumerate() {
            let sl = t * hc * d..(t + 1) * hc * d;
            let kvt = &kv_f[j * k_out..(j + 1) * k_out];
            for s in 0..hc {
                kinds_seen[(t * hc + s) % 6] += 1;
            }
            let at = format!(
                "layer {lid} token {t} (streams: {})",
                (0..hc)
                    .map(|s| EDGE_KINDS[(t * hc + s) % 6])
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            let got: Vec<f64> = h32[sl.clone()].iter().map(|&v| v as f64).collect();
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{at}: a non-finite value"
            );
            check_highway(
                &hw_in[sl.clone()],
                kvt,
                &qk,
                hc,
                d,
                tiny.eps,
                &got,
                None,
                false,
                &at,
            );
            let got: Vec<f64> = hb[sl.clone()]
                .iter()
                .map(|&b| bf16_to_f32(b) as f64)
                .collect();
            check_highway(
                &hb_f[sl.clone()],
                kvt,
                &qk,
                hc,
                d,
                tiny.eps,
                &got,
                None,
                true,
                &at,
            );
        }
    }
    assert!(kinds_seen.iter().all(|&k| k > 0), "{kinds_seen:?}");
}

/// `eps = 0` made a zero stream's gate 0/0 (NaN in all D values) with status
/// OK; it is refused at create, as a negative, infinite or NaN one is.
#[test]
fn eps_zero_is_refused_at_create() {
    let tiny = Tiny::load();
    for eps in [0.0f32, -0.0, -1e-6, f32::NAN, f32::INFINITY] {
        let mut cfg = tiny.config(Tiny::limits());
        cfg.geometry.eps = eps;
        let e = Context::new(&cfg).err().expect("created with a bad eps");
        assert_eq!(e.status, EngramStatus::ErrInvalidConfig, "eps {eps}");
        assert!(e.message.contains("eps"), "{}", e.message);
    }
    // The smallest positive eps is accepted, and a zero stream stays finite.
    let mut cfg = tiny.config(Tiny::limits());
    cfg.geometry.eps = f32::from_bits(1);
    assert!(Context::new(&cfg).is_ok());
}
