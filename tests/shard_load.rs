//! Shard contexts straight from a model's files (`LoadOptions::shard`, the
//! C options' `shard_*` fields): the loader reads and converts only the
//! rank's part of `wkv`, so the memory it owns is the whole model's less the
//! `wkv` bytes other ranks hold, and the parts of ranks `0..world` (worlds
//! 1..5) tile the layer and give the unsharded context's bits through the
//! split calls. Three files, each a different `wkv`: the golden's
//! `tiny.gguf` (bf16, read with `pread` or mapped in place), ds4's GGUF (f16,
//! converted at load) and the safetensors checkpoint (block fp8 with its
//! scales, cut at whole scale blocks).

mod common;

use common::*;
use engram::gguf::{GgufModel, LoadOptions};
use engram::tables::{tokenizer, TokenMap};
use engram::{EngramStatus, Highway, ShardSpec, SplitIn, SplitOut};
use std::sync::OnceLock;

fn deepseek_map() -> &'static TokenMap {
    static M: OnceLock<TokenMap> = OnceLock::new();
    M.get_or_init(|| {
        let t = tokenizer::load(&golden_dir().join("deepseek_v4_tokenizer.json")).unwrap();
        tokenizer::token_map(&t).unwrap()
    })
}

/// The three models: (name, opener).
fn open(which: &str, mmap: bool, shard: ShardSpec) -> engram::Result<GgufModel> {
    let d = golden_dir();
    let o = LoadOptions {
        mmap,
        shard,
        ..LoadOptions::default()
    };
    match which {
        "tiny.gguf" => GgufModel::open(&d.join("tiny.gguf"), &o),
        "ds4.gguf" => GgufModel::open(&d.join("dialects/ds4.gguf"), &o),
        "checkpoint" => GgufModel::open_checkpoint(
            &d.join("dialects/checkpoint"),
            None,
            &LoadOptions {
                tokenizer: Some(deepseek_map()),
                ..o
            },
        ),
        _ => unreachable!(),
    }
}

const MODELS: [&str; 3] = ["tiny.gguf", "ds4.gguf", "checkpoint"];

/// A step: 7 tokens of one sequence, one of them dead.
fn step(ctx: &engram::Context<'_>) -> (Vec<i64>, usize) {
    let n = 7;
    let tokens: Vec<i32> = (0..n as i32)
        .map(|i| if i == 3 { -1 } else { i * 5 % 40 + 1 })
        .collect();
    let pos: Vec<i32> = (0..n as i32).collect();
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
    (ids, n)
}

/// Every layer's held `wkv` bytes in `m`'s context, summed.
fn wkv_held(ctx: &engram::Context<'_>) -> u64 {
    let ids = ctx.tables().layer_ids.clone();
    ids.iter()
        .map(|&l| ctx.layer_held(l).unwrap().held_bytes.1)
        .sum()
}

#[test]
fn shard_contexts_from_files_hold_their_share_and_give_the_whole_bits() {
    for which in MODELS {
        for mmap in [false, true] {
            check_model(which, mmap);
        }
    }
}

fn check_model(which: &str, mmap: bool) {
    let whole_m = open(which, mmap, ShardSpec::WHOLE).unwrap();
    let opts = cpu_gguf_options(0.0);
    let whole = whole_m.context(&opts).unwrap();
    let (ids, n) = step(&whole);
    let g = whole.geometry();
    let (k_in, k_out) = (whole.kv_in(), whole.kv_out());
    let x = values("shard_load highway", n * g.hc * g.d, 1.0, 0.0);
    let layers = whole.tables().layer_ids.clone();
    let mut want = x.clone();
    for &l in &layers {
        whole.apply(l, &ids, n, Highway::F32(&mut want)).unwrap();
    }
    let whole_wkv = wkv_held(&whole);
    let converted = which == "ds4.gguf"; // f16 wkv: converted whatever the mode
    for world in 1..=5u32 {
        // Row ranges + all-reduce and output ranges + all-gather, both at once.
        let models: Vec<GgufModel> = (0..world)
            .map(|r| open(which, mmap, ShardSpec::new((r, world), (r, world)).unwrap()).unwrap())
            .collect();
        let ctxs: Vec<_> = models.iter().map(|m| m.context(&opts).unwrap()).collect();
        let at = format!("{which} mmap {mmap} world {world}");
        let mut held_sum = 0;
        for (m, c) in models.iter().zip(&ctxs) {
            let held = wkv_held(c);
            held_sum += held;
            let saved = whole_m.owned_bytes() as i64 - m.owned_bytes() as i64;
            let expect = if mmap && !converted {
                0
            } else {
                (whole_wkv - held) as i64
            };
            // Owned arrays are whole 16-byte words: up to 16 bytes per
            // array (codes, scales) per layer either way.
            let slack = 32 * layers.len() as i64;
            assert!(
                (saved - expect).abs() <= slack,
                "{at}: the shard's loader owns {saved} bytes less than the whole's, expected \
                 {expect} (the wkv other ranks hold)"
            );
        }
        assert_eq!(held_sum, whole_wkv, "{at}: the ranks' wkv parts tile it");
        let mut hw = x.clone();
        for &l in &layers {
            let mut rows = vec![-0f32; n * k_in];
            for c in &ctxs {
                let held = c.layer_held(l).unwrap();
                let mut part = vec![0f32; n * k_in];
                let heads = (0, whole.tables().n_heads);
                c.gather_rows(l, &ids, n, held.held_rows, heads, SplitOut::F32(&mut part))
                    .unwrap();
                for (a, b) in rows.iter_mut().zip(&part) {
                    *a += *b;
                }
            }
            let mut kv = vec![0f32; n * k_out];
            for c in &ctxs {
                let (o0, o1) = c.layer_held(l).unwrap().held_outs;
                if o0 == o1 {
                    continue; // more ranks than block-fp8 scale blocks
                }
                let mut mine = vec![0f32; n * (o1 - o0)];
                c.kv_columns(
                    l,
                    n,
                    SplitIn::F32(&rows),
                    (o0, o1),
                    SplitOut::F32(&mut mine),
                )
                .unwrap();
                join_columns(&mut kv, k_out, (o0, o1), &mine);
            }
            let last = &ctxs[ctxs.len() - 1];
            last.gate_from_kv(l, &ids, n, SplitIn::F32(&kv), Highway::F32(&mut hw))
                .unwrap();
        }
        let differ = hw
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{at}: highway values that differ from the whole layer's"
        );
    }
}

#[test]
fn a_shard_loaded_from_files_cannot_be_widened_but_rows_can_move() {
    let m = open("checkpoint", false, ShardSpec::new((0, 2), (1, 3)).unwrap()).unwrap();
    let ctx = m.context(&cpu_gguf_options(0.0)).unwrap();
    let l = ctx.tables().layer_ids[0];
    let before = ctx.layer_held(l).unwrap();
    for spec in [
        ShardSpec::WHOLE,
        ShardSpec::new((0, 2), (0, 3)).unwrap(),
        ShardSpec::new((0, 2), (1, 2)).unwrap(),
    ] {
        let e = ctx.set_shard(spec).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{spec:?}");
        assert!(
            e.message.contains("was given only outputs"),
            "{}",
            e.message
        );
        assert_eq!(
            ctx.layer_held(l).unwrap(),
            before,
            "a refused spec changes nothing"
        );
    }
    // The table is read from the file row by row: any row range can be held.
    ctx.set_shard(ShardSpec::new((1, 2), (1, 3)).unwrap())
        .unwrap();
    let after = ctx.layer_held(l).unwrap();
    assert_eq!(after.held_outs, before.held_outs);
    assert_eq!(after.held_rows.1, after.rows);
}

/// On the CUDA backend (the SIMT emulation here, the GPU where there is
/// one) a loader's `wkv` is copied to the device at create: a shard context
/// copies its part only. Device memory of a `wkv` shard against the whole
/// context's, both from `tiny.gguf` (layers' `wkv` bf16 and f32), worlds
/// 1..5: the whole's less the other ranks' `wkv` bytes (up to 256 bytes of
/// allocation rounding per array).
#[test]
fn a_cuda_shard_context_copies_only_its_wkv_part_to_the_device() {
    let Some(dev) = common::device::device() else {
        return;
    };
    let mut o = cpu_gguf_options(0.0);
    o.backend = engram::EngramBackend::Cuda as u32;
    o.tuning.cuda.device = Some(dev.gpu.clone());
    let whole_m = open("tiny.gguf", false, ShardSpec::WHOLE).unwrap();
    let whole = whole_m.context(&o).unwrap();
    let whole_dev = whole.info().device_bytes as i64;
    let layers = whole.tables().layer_ids.clone();
    let k_out = whole.kv_out() as i64;
    // The wkv bytes of the outputs a context holds, from its held ranges and
    // the whole layer's bytes per output (not from the shard's own count).
    let part_bytes = |c: &engram::Context<'_>| -> i64 {
        let per_out = |l: u32| whole.layer_held(l).unwrap().held_bytes.1 as i64 / k_out;
        layers
            .iter()
            .map(|&l| {
                let (o0, o1) = c.layer_held(l).unwrap().held_outs;
                per_out(l) * (o1 - o0) as i64
            })
            .sum()
    };
    let whole_wkv = part_bytes(&whole);
    for world in 1..=5u32 {
        for rank in 0..world {
            let spec = ShardSpec::new((0, 1), (rank, world)).unwrap();
            let m = open("tiny.gguf", false, spec).unwrap();
            // Opened as a shard, and a whole model's context cut by set_shard.
            let loaded = m.context(&o).unwrap();
            let cut = whole_m.context(&o).unwrap();
            cut.set_shard(spec).unwrap();
            for (how, c) in [("loaded", &loaded), ("set_shard", &cut)] {
                let saved = whole_dev - c.info().device_bytes as i64;
                let expect = whole_wkv - part_bytes(c);
                assert!(world == 1 || expect > 0);
                assert!(
                    (saved - expect).abs() <= 512,
                    "{how}, world {world} rank {rank}: the device holds {saved} bytes less than \
                     the whole context's, expected {expect} (the other ranks' wkv)"
                );
            }
        }
    }
}
