//! The library against the independent Python golden (`tests/golden/`).
//!
//! Hash ids are compared exactly and dequantised rows bit for bit. `kv` and the
//! highway are compared within bounds derived below from f32/bf16 rounding;
//! each bound is stated where it is computed.

mod common;

use common::bounds::*;
use common::golden_calls as calls;
use common::*;
use engram::cpu::projection::Kernel;
use engram::formats::{bf16_to_f32, dequant_row_bf16, f32_to_bf16};
use engram::{EngramType, Highway};

#[test]
fn filler_matches_the_generator() {
    let g = load_json("tiny.json");
    let c = &g["filler_check"];
    let f = Filler::new("check");
    for i in 0..4u64 {
        assert_eq!(
            bits("check", i),
            c["bits"][i as usize].as_u64().unwrap(),
            "bits {i}"
        );
        assert_eq!(
            f.unit(i).to_bits() as u64,
            c["unit_f32"][i as usize].as_u64().unwrap(),
            "unit {i}"
        );
        assert_eq!(
            f.value(i, 0.125, 1.0).to_bits() as u64,
            c["value_f32"][i as usize].as_u64().unwrap(),
            "value {i}"
        );
    }
}

#[test]
fn formats_dequantise_bit_exactly() {
    let g = load_json("tiny.json");
    for fmt in ["fp8", "bf16", "f32"] {
        let f = &g["formats"][fmt];
        let (rows, hd) = (
            f["rows"].as_u64().unwrap() as usize,
            f["Hd"].as_u64().unwrap() as usize,
        );
        let name = f["name"].as_str().unwrap();
        let table = table_bytes(name, fmt, rows, hd, true);
        let rf = EngramType::row_format(engram_type(fmt) as u32, hd).unwrap();
        let rb = rf.row_bytes(hd);
        let want = u16s(&f["dequant_bf16"]);
        let mut got = vec![0u16; rows * hd];
        for r in 0..rows {
            dequant_row_bf16(
                rf,
                &table[r * rb..(r + 1) * rb],
                &mut got[r * hd..(r + 1) * hd],
            )
            .unwrap();
        }
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                a,
                b,
                "{fmt}: row {} value {}: {a:#06x} vs golden {b:#06x}",
                i / hd,
                i % hd
            );
        }
    }
}

#[test]
fn hash_ids_are_exact_in_every_regime() {
    let tiny = Tiny::load();
    for regime in REGIMES {
        let ctx = tiny.context();
        for (ci, c) in calls(&tiny, regime).iter().enumerate() {
            let mut out = vec![0i64; c.tokens.len() * ctx.ids_per_token()];
            ctx.hash(&c.tokens, &c.seq_ids, &c.pos, &mut out).unwrap();
            assert_eq!(out, c.ids, "{regime} call {ci}");
            for (t, &d) in c.dead.iter().enumerate() {
                let per = ctx.ids_per_token();
                assert_eq!(
                    out[t * per..(t + 1) * per].iter().all(|&r| r == -1),
                    d,
                    "{regime} call {ci} token {t}"
                );
            }
        }
    }
}

#[test]
fn rollback_then_rehash_equals_the_straight_run() {
    let tiny = Tiny::load();
    let r = &tiny.golden["regimes"]["rollback"];
    let straight_tokens = i32s(&r["straight_tokens"]);
    let straight_ids = ints(&r["straight_ids"]);
    let ctx = tiny.context();
    let per = ctx.ids_per_token();
    let n = straight_tokens.len();
    let mut out = vec![0i64; n * per];
    let pos: Vec<i32> = (0..n as i32).collect();
    ctx.hash(&straight_tokens, &vec![0; n], &pos, &mut out)
        .unwrap();
    assert_eq!(out, straight_ids, "the straight run itself");
    let cs = calls(&tiny, "rollback");
    let last = cs.last().unwrap();
    assert_eq!(last.ids[..], straight_ids[(n - last.tokens.len()) * per..]);
}

/// Per-layer data of a call, from the golden.
struct LayerGolden {
    rows: Vec<u16>,
    kv: Vec<u16>,
    out_f32: Vec<f32>,
    out_bf16: Vec<u16>,
}

fn layer_golden(v: &serde_json::Value) -> LayerGolden {
    LayerGolden {
        rows: u16s(&v["rows_bf16"]),
        kv: u16s(&v["kv_bf16"]),
        out_f32: f32_bits(&v["highway_out_f32"]),
        out_bf16: u16s(&v["highway_out_bf16"]),
    }
}

#[test]
fn rows_kv_and_highway_match_the_golden_in_every_regime() {
    let tiny = Tiny::load();
    let (hc, d, cols, hd) = (tiny.hc, tiny.d, tiny.cols(), tiny.hd);
    let k_in = cols * hd;
    let k_out = d * (hc + 1);
    let mut kv_differences = 0usize;
    let mut kv_values = 0usize;
    let mut worst_f32 = 0f64; // largest |error| / bound seen
    let kernels = [Kernel::Portable, Kernel::detect()];
    for (regime, kernel) in REGIMES
        .iter()
        .flat_map(|r| kernels.iter().map(move |k| (*r, *k)))
    {
        let ctx = tiny.context_with(kernel);
        assert_eq!(ctx.info().kernel, format!("{kernel:?}").to_lowercase());
        for (ci, c) in calls(&tiny, regime).iter().enumerate() {
            let n = c.tokens.len();
            let mut ids = vec![0i64; n * ctx.ids_per_token()];
            ctx.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids).unwrap();
            let hw_in = values(&c.highway, n * hc * d, 1.0, 0.0);
            let live: Vec<usize> = (0..n).filter(|&t| !c.dead[t]).collect();
            for (li, lg) in c.layers.iter().enumerate() {
                let layer = &tiny.layers[li];
                let lid = layer.layer_id;
                assert_eq!(lg["layer_id"].as_u64().unwrap() as u32, lid);
                let gold = layer_golden(lg);
                let at =
                    |t: usize| format!("{regime} call {ci} layer {lid} token {t} ({kernel:?})");

                // Rows: bit-exact.
                let (rows, kv) = ctx.stages(lid, &ids, n).unwrap();
                assert_eq!(rows.len(), live.len() * k_in);
                for (j, &t) in live.iter().enumerate() {
                    let got = &rows[j * k_in..(j + 1) * k_in];
                    let want = &gold.rows[t * k_in..(t + 1) * k_in];
                    assert!(got == want, "{}: dequantised rows differ", at(t));
                }

                // kv: within kv_bound, computed from the regenerated weights.
                let wkv = layer.wkv.f32();
                let kv_f: Vec<f32> = kv.iter().map(|&b| bf16_to_f32(b)).collect();
                for (j, &t) in live.iter().enumerate() {
                    let r: Vec<f64> = rows[j * k_in..(j + 1) * k_in]
                        .iter()
                        .map(|&b| bf16_to_f32(b) as f64)
                        .collect();
                    for o in 0..k_out {
                        let got = kv_f[j * k_out + o] as f64;
                        let want = bf16_to_f32(gold.kv[t * k_out + o]) as f64;
                        kv_values += 1;
                        if got != want {
                            kv_differences += 1;
                            let w = &wkv[o * k_in..(o + 1) * k_in];
                            let s_abs: f64 =
                                r.iter().zip(w).map(|(a, &b)| (a * b as f64).abs()).sum();
                            let b = kv_bound(s_abs, want.abs().max(got.abs()), k_in);
                            assert!(
                                (got - want).abs() <= b,
                                "{}: kv[{o}] {got} vs golden {want}, bound {b}",
                                at(t)
                            );
                        }
                    }
                }

                // Highway, f32 and bf16.
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
                let mut hb = hb_in.clone();
                ctx.apply(lid, &ids, n, Highway::Bf16(&mut hb)).unwrap();
                for t in 0..n {
                    let sl = t * hc * d..(t + 1) * hc * d;
                    if c.dead[t] {
                        assert!(
                            h32[sl.clone()]
                                .iter()
                                .zip(&hw_in[sl.clone()])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{}: dead token changed (f32)",
                            at(t)
                        );
                        assert_eq!(
                            hb[sl.clone()],
                            hb_in[sl.clone()],
                            "{}: dead token changed (bf16)",
                            at(t)
                        );
                        assert!(
                            gold.out_f32[sl.clone()]
                                .iter()
                                .zip(&hw_in[sl.clone()])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{}: golden changed a dead token",
                            at(t)
                        );
                        continue;
                    }
                    let j = live.iter().position(|&x| x == t).unwrap();
                    let kvt = &kv_f[j * k_out..(j + 1) * k_out];
                    let same_kv = kvt
                        .iter()
                        .zip(&gold.kv[t * k_out..(t + 1) * k_out])
                        .all(|(a, &b)| f32_to_bf16(*a) == b);
                    // With the same kv the golden's highway is the reference;
                    // otherwise (kv within its bound, rarely one bf16 ulp apart) the
                    // f64 reference is recomputed on the library's own kv.
                    for (hw, is_bf16) in [
                        (&hw_in, false),
                        (
                            &hb_in.iter().map(|&b| bf16_to_f32(b)).collect::<Vec<f32>>(),
                            true,
                        ),
                    ] {
                        let sl_t = t * hc * d..(t + 1) * hc * d;
                        let got: Vec<f64> = if is_bf16 {
                            hb[sl_t.clone()]
                                .iter()
                                .map(|&b| bf16_to_f32(b) as f64)
                                .collect()
                        } else {
                            h32[sl_t.clone()].iter().map(|&v| v as f64).collect()
                        };
                        let golden: Option<Vec<f64>> = same_kv.then(|| {
                            if is_bf16 {
                                gold.out_bf16[sl_t.clone()]
                                    .iter()
                                    .map(|&b| bf16_to_f32(b) as f64)
                                    .collect()
                            } else {
                                gold.out_f32[sl_t.clone()]
                                    .iter()
                                    .map(|&v| v as f64)
                                    .collect()
                            }
                        });
                        let w = check_highway(
                            &hw[sl.clone()],
                            kvt,
                            &qk,
                            hc,
                            d,
                            tiny.eps,
                            &got,
                            golden.as_deref(),
                            is_bf16,
                            &at(t),
                        );
                        worst_f32 = worst_f32.max(w);
                    }
                }
            }
        }
    }
    println!(
        "kernels {kernels:?}: kv: {kv_differences} of {kv_values} values differ from the golden (each within its bound); \
         f32 highway: largest error is {:.3} of its bound",
        worst_f32
    );
}
