//! Shard contexts cut a block-scaled fp8 `wkv` at whole scale blocks and a
//! table at row ranges, and the split points give `apply`'s bits with every
//! projection kernel this CPU runs (the C and Python tests use the detected
//! kernel and dense `wkv` only): the golden's tiny model, `wkv` replaced by
//! an fp8 one with 4-row blocks, worlds 1..5.

mod common;

use common::*;
use engram::cpu::projection::Kernel;
use engram::formats::Fp8Blocks;
use engram::{EngramType, Highway, LayerIn, ShardSpec, SplitIn, SplitOut, Weights};

/// `[rows, k]` fp8 codes (no NaN code) and scales around 1.
fn fp8(rows: usize, k: usize, br: usize, bc: usize) -> (Vec<u8>, Vec<u8>) {
    let f = Filler::new("shards-fp8");
    let codes = (0..rows * k)
        .map(|i| match f.bits(i as u64) as u8 {
            c if c & 0x7F == 0x7F => c ^ 1,
            c => c,
        })
        .collect();
    let scales = (0..rows.div_ceil(br) * k.div_ceil(bc))
        .map(|i| 120 + (i % 7) as u8)
        .collect();
    (codes, scales)
}

#[test]
fn fp8_wkv_and_table_shards_give_apply_bits_with_every_kernel() {
    let tiny = Tiny::load();
    let (hd, d, hc) = (tiny.hd, tiny.d, tiny.hc);
    let (k_in, k_out) = (tiny.cols() * hd, d * (hc + 1));
    let (br, bc) = (4, 32);
    let (codes, scales) = fp8(k_out, k_in, br, bc);
    let w = Fp8Blocks::new(&codes, &scales, k_in, br, bc).unwrap();
    let l = &tiny.layers[0];
    let fmt = EngramType::row_format(l.format as u32, hd).unwrap();
    let layer = || {
        LayerIn::host(
            l.layer_id,
            &l.table,
            fmt,
            l.rows,
            Weights::Fp8Block(w),
            l.q.weights(),
            l.k.weights(),
        )
    };
    let n = 9;
    let tokens: Vec<i32> = (0..n as i32)
        .map(|i| if i == 4 { -1 } else { i * 5 % 48 })
        .collect();
    let pos: Vec<i32> = (0..n as i32).collect();
    let x = values("shards.rs highway", n * hc * d, 1.0, 0.0);
    let kernels = [
        Kernel::Portable,
        Kernel::Avx2,
        Kernel::Avx512,
        Kernel::Avx512Bf16,
        Kernel::Amx,
    ];
    for kernel in kernels.into_iter().filter(|k| k.supported()) {
        let whole = tiny.context_with(kernel);
        whole.set_layer(layer()).unwrap();
        let mut ids = vec![0i64; n * whole.ids_per_token()];
        whole.hash(&tokens, &[0; 9], &pos, &mut ids).unwrap();
        let mut want = x.clone();
        whole
            .apply(l.layer_id, &ids, n, Highway::F32(&mut want))
            .unwrap();
        for world in 1..=5u32 {
            let mut rows = vec![-0f32; n * k_in]; // -0.0: the sum of the parts is exact
            let mut kv = vec![0f32; n * k_out];
            for rank in 0..world {
                let ctx = tiny.context_with(kernel);
                ctx.set_layer(layer()).unwrap();
                ctx.set_shard(ShardSpec::new((rank, world), (rank, world)).unwrap())
                    .unwrap();
                let held = ctx.layer_held(l.layer_id).unwrap();
                let (o0, o1) = held.held_outs;
                assert!(o0 % br == 0 && (o1 % br == 0 || o1 == k_out), "{o0}..{o1}");
                let mut part = vec![0f32; n * k_in];
                let (r0, r1) = held.held_rows;
                let h = (0, tiny.heads);
                ctx.gather_rows(l.layer_id, &ids, n, (r0, r1), h, SplitOut::F32(&mut part))
                    .unwrap();
                for (a, b) in rows.iter_mut().zip(&part) {
                    *a += *b;
                }
                // Each rank's outputs from the whole rows (read from the
                // whole context: this rank's table holds a part of them).
                let mut full = vec![0f32; n * k_in];
                let all = (0, l.rows);
                whole
                    .gather_rows(l.layer_id, &ids, n, all, h, SplitOut::F32(&mut full))
                    .unwrap();
                let mut mine = vec![0f32; n * (o1 - o0)];
                ctx.kv_columns(
                    l.layer_id,
                    n,
                    SplitIn::F32(&full),
                    (o0, o1),
                    SplitOut::F32(&mut mine),
                )
                .unwrap();
                join_columns(&mut kv, k_out, (o0, o1), &mine);
            }
            let mut a = x.clone();
            whole
                .apply_rows(
                    l.layer_id,
                    &ids,
                    n,
                    SplitIn::F32(&rows),
                    Highway::F32(&mut a),
                )
                .unwrap();
            let mut b = x.clone();
            whole
                .gate_from_kv(l.layer_id, &ids, n, SplitIn::F32(&kv), Highway::F32(&mut b))
                .unwrap();
            let differ = |v: &[f32]| {
                v.iter()
                    .zip(&want)
                    .filter(|(p, q)| p.to_bits() != q.to_bits())
                    .count()
            };
            let at = format!("{kernel:?} world {world}");
            assert_eq!(
                differ(&a),
                0,
                "{at}: rows summed + apply_rows: values that differ"
            );
            assert_eq!(
                differ(&b),
                0,
                "{at}: kv joined + gate_from_kv: values that differ"
            );
        }
    }
}
