//! Every public DeepSeek-V4.1 engram file dialect (`tests/golden/DIALECTS.md`),
//! from the independent fixtures in `tests/golden/data/dialects/` and their
//! `expected.json`: each fixture opens (or is refused as described), reports
//! its dialect, has the expected hash constants, hashes to the golden ids,
//! gathers the golden rows bit for bit, and gives kv and the highway within
//! the bounds of `tests/common/bounds.rs`, read with `pread` and mapped. Every
//! bad-input mutation of `expected.json` gets its status and a message naming
//! its keys or tensors.

mod common;

use common::bounds::*;
use common::*;
use engram::formats::bf16_to_f32;
use engram::gguf::{Dialect, Gguf, GgufModel, GgufOptions, LoadOptions, Value as GValue};
use engram::tables::{tokenizer, EngramTables, TokenMap};
use engram::{EngramStatus, EngramType, Highway, Weights};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn dir() -> PathBuf {
    golden_dir().join("dialects")
}

fn expected() -> &'static Value {
    static E: OnceLock<Value> = OnceLock::new();
    E.get_or_init(|| load_json("dialects/expected.json"))
}

/// The DeepSeek tokenizer's token map, computed once.
fn deepseek_map() -> &'static TokenMap {
    static M: OnceLock<TokenMap> = OnceLock::new();
    M.get_or_init(|| {
        let t = tokenizer::load(&golden_dir().join("deepseek_v4_tokenizer.json")).unwrap();
        tokenizer::token_map(&t).unwrap()
    })
}

fn eps() -> f32 {
    f32::from_bits(expected()["eps_f32"].as_u64().unwrap() as u32)
}

fn options() -> GgufOptions {
    cpu_gguf_options(eps())
}

/// The name `expected.json` gives each dialect.
fn dialect_name(d: Dialect) -> &'static str {
    match d {
        Dialect::Vcruz305 | Dialect::Vcruz305Prefix => "vcruz305",
        Dialect::Ds4 => "ds4",
        Dialect::Tarruda => "tarruda",
        Dialect::JigSawPT => "jigsawpt",
        Dialect::Deepstrix => "deepstrix",
        Dialect::Ds4gw => "ds4gw",
        Dialect::Checkpoint => "safetensors_checkpoint",
    }
}

/// Open fixture `fx` of `expected.json` from directory `base` (its files
/// there), with what it needs besides the file.
fn open_fixture(fx: &str, base: &Path, mmap: bool) -> engram::Result<GgufModel> {
    let f = &expected()["fixtures"][fx];
    let ckpt = base.join("checkpoint");
    let o = LoadOptions {
        mmap,
        tables_dir: f["companions"]["checkpoint_dir"]
            .as_str()
            .map(|_| ckpt.as_path()),
        tokenizer: (f["hash"] == "derived").then(deepseek_map),
        ..LoadOptions::default()
    };
    if fx == "checkpoint" {
        return GgufModel::open_checkpoint(&ckpt, None, &o);
    }
    let first = f["open"]
        .as_str()
        .unwrap_or_else(|| f["files"][0].as_str().unwrap());
    GgufModel::open(&base.join(first), &o)
}

/// The check call of effective model `name` (following `same_outputs_as`).
fn check_call(name: &str) -> &'static Value {
    let em = &expected()["effective_models"][name];
    match em["same_outputs_as"].as_str() {
        Some(other) => check_call(other),
        None => &em["check"],
    }
}

/// A layer's wkv values and `q * k`, as the loaded model holds them.
fn layer_values(m: &GgufModel, li: usize) -> (Vec<f32>, Vec<f32>) {
    let [(wt, wb), (qt, qb), (_, kb)] = m.layer_weights(li).unwrap();
    let em = &m.model;
    let k_in = em.cols() * em.hd;
    let vals = |t: u32, b: &[u8], row: usize| -> Vec<f32> {
        match EngramType::from_u32(t).unwrap() {
            EngramType::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            EngramType::Bf16 => b
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            EngramType::Fp8E4m3E8m0Block => {
                let w = m.layer_wkv(li).unwrap();
                let mut out = vec![0f32; w.len()];
                w.to_f32(0, &mut out);
                out
            }
            f => {
                let w = Weights::quant(f, b, row).unwrap();
                let mut out = vec![0f32; w.len()];
                w.to_f32(0, &mut out);
                out
            }
        }
    };
    let wkv = vals(wt, wb, k_in);
    let q = vals(qt, qb, em.d);
    let k = vals(qt, kb, em.d);
    (wkv, q.iter().zip(&k).map(|(a, b)| a * b).collect())
}

/// One layer's expected values: layer id, rows and kv (bf16 bits), the f32
/// highway out.
type LayerOut = (u32, Vec<u16>, Vec<u16>, Vec<f32>);

/// One call's expected values.
struct Call {
    tokens: Vec<i32>,
    seq_ids: Vec<i32>,
    pos: Vec<i32>,
    highway: String,
    ids: Vec<i64>,
    /// Per layer id: rows, kv (bf16 bits), f32 highway out.
    layers: Vec<LayerOut>,
}

fn call_of(c: &Value) -> Call {
    Call {
        tokens: i32s(&c["tokens"]),
        seq_ids: i32s(&c["seq_ids"]),
        pos: i32s(&c["pos"]),
        highway: c["highway_name"].as_str().unwrap().to_string(),
        ids: ints(&c["ids"]),
        layers: c["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| {
                (
                    l["layer_id"].as_u64().unwrap() as u32,
                    u16s(&l["rows_bf16"]),
                    u16s(&l["kv_bf16"]),
                    f32_bits(&l["highway_out_f32"]),
                )
            })
            .collect(),
    }
}

/// Run `calls` (in order, one sequence history) on a context of `m` and check
/// ids exactly, rows bit for bit, kv and the f32 highway within their bounds,
/// for the layers in `only` (all when `None`).
fn run_calls(m: &GgufModel, o: &GgufOptions, calls: &[Call], only: Option<&[u32]>, at: &str) {
    let em = &m.model;
    let ctx = m.context(o).unwrap();
    let (hc, d) = (em.hc, em.d);
    let (k_in, k_out) = (em.cols() * em.hd, d * (hc + 1));
    for (ci, c) in calls.iter().enumerate() {
        let n = c.tokens.len();
        let mut ids = vec![0i64; n * ctx.ids_per_token()];
        ctx.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids).unwrap();
        assert_eq!(ids, c.ids, "{at}: call {ci}: hash ids");
        for (lid, rows, kv, out) in &c.layers {
            if only.is_some_and(|o| !o.contains(lid)) {
                continue;
            }
            let li = em.layer_ids.iter().position(|l| l == lid).unwrap();
            let at = format!("{at}: call {ci} layer {lid}");
            let rb = ctx.read_back(*lid, engram::RowIds::Host(&ids), n).unwrap();
            assert!(
                rb.rows == *rows,
                "{at}: dequantised rows differ from the golden"
            );
            let (wkv, qk) = layer_values(m, li);
            let x = values(&c.highway, n * hc * d, 1.0, 0.0);
            let h = match &o.tuning.cuda.device {
                None => {
                    let mut h = x.clone();
                    ctx.apply(*lid, &ids, n, Highway::F32(&mut h)).unwrap();
                    h
                }
                // The CUDA backend: the highway in device memory.
                Some(gpu) => {
                    let hd = engram::cuda::gpu::DevBuf::from_slice(gpu, &x, "highway").unwrap();
                    let null = std::ptr::null_mut();
                    ctx.apply_device(*lid, engram::RowIds::Host(&ids), n, hd.ptr, 0, null)
                        .unwrap();
                    ctx.check_device(null).unwrap();
                    hd.read::<f32>(x.len()).unwrap()
                }
            };
            for t in 0..n {
                let tr = &rb.rows[t * k_in..(t + 1) * k_in];
                let dead = ids[t * ctx.ids_per_token()] == -1;
                let sl = t * hc * d..(t + 1) * hc * d;
                if dead {
                    assert!(
                        h[sl.clone()]
                            .iter()
                            .zip(&x[sl])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{at}: dead token {t} changed"
                    );
                    continue;
                }
                let r: Vec<f64> = tr.iter().map(|&b| bf16_to_f32(b) as f64).collect();
                let mut same = true;
                for o in 0..k_out {
                    let got = bf16_to_f32(rb.kv[t * k_out + o]) as f64;
                    let want = bf16_to_f32(kv[t * k_out + o]) as f64;
                    if got != want {
                        same = false;
                        let w = &wkv[o * k_in..(o + 1) * k_in];
                        let s: f64 = r.iter().zip(w).map(|(a, &b)| (a * b as f64).abs()).sum();
                        let b = kv_bound(s, want.abs().max(got.abs()), k_in);
                        assert!(
                            (got - want).abs() <= b,
                            "{at} token {t}: kv[{o}] {got} vs {want}, bound {b}"
                        );
                    }
                }
                let kvt: Vec<f32> = rb.kv[t * k_out..(t + 1) * k_out]
                    .iter()
                    .map(|&b| bf16_to_f32(b))
                    .collect();
                let got: Vec<f64> = h[sl.clone()].iter().map(|&v| v as f64).collect();
                let golden: Option<Vec<f64>> =
                    same.then(|| out[sl.clone()].iter().map(|&v| v as f64).collect());
                check_highway(
                    &x[sl.clone()],
                    &kvt,
                    &qk,
                    hc,
                    d,
                    eps(),
                    &got,
                    golden.as_deref(),
                    false,
                    &format!("{at} token {t}"),
                );
            }
        }
    }
}

/// tiny.json's prefill and decode regimes, as calls.
fn tiny_calls(regime: &str) -> Vec<Call> {
    let t = load_json("tiny.json");
    t["regimes"][regime]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let mut call = call_of(c);
            // tiny.json's layers also carry bf16 outputs; only f32 is checked here.
            for (l, v) in call.layers.iter_mut().zip(c["layers"].as_array().unwrap()) {
                l.3 = f32_bits(&v["highway_out_f32"]);
            }
            call
        })
        .collect()
}

/// Check fixture `fx` as `expected.json` describes it.
fn check_fixture(fx: &str, mmap: bool) {
    let f = &expected()["fixtures"][fx];
    let at = format!("{fx} ({})", if mmap { "mapped" } else { "pread" });
    let m = open_fixture(fx, &dir(), mmap)
        .unwrap_or_else(|e| panic!("{at}: {:?}: {}", e.status, e.message));
    let em = &m.model;
    assert_eq!(
        dialect_name(em.dialect),
        f["dialect"].as_str().unwrap(),
        "{at}"
    );
    if f["variant"] == "deepseek4_key_prefix" {
        assert_eq!(em.dialect, Dialect::Vcruz305Prefix, "{at}");
    }
    let g = &expected()["geometry"];
    assert_eq!(
        (em.d, em.hc, em.hd, em.n_heads, em.max_ngram),
        (
            g["D"].as_u64().unwrap() as usize,
            g["hc"].as_u64().unwrap() as usize,
            g["Hd"].as_u64().unwrap() as usize,
            g["H"].as_u64().unwrap() as usize,
            g["N"].as_u64().unwrap() as usize
        ),
        "{at}: geometry"
    );
    assert_eq!(em.layer_ids, [1, 3], "{at}");
    // The hash constants.
    let hash = f["hash"].as_str().unwrap();
    let c = &expected()["constants"][hash];
    assert_eq!(em.multipliers, u64s(&c["multipliers"]), "{at}: multipliers");
    assert_eq!(em.primes, u64s(&c["primes"]), "{at}: primes");
    assert_eq!(em.offsets, u64s(&c["offsets"]), "{at}: offsets");
    assert_eq!(em.pad_id, c["pad_id"].as_i64().unwrap(), "{at}: pad");
    if hash == "tiny" {
        assert_eq!(em.token_map, i32s(&c["token_map"]), "{at}: token map");
    } else {
        assert_eq!(em.token_map, deepseek_map().map, "{at}: token map");
    }
    if let Some(p) = f["pad_token_id_in_file"].as_u64() {
        assert_eq!(em.pad.stored, p, "{at}: the raw pad stored");
        assert_eq!(em.pad.reading, engram::gguf::PadReading::Raw, "{at}");
    }
    // Tables in the split fp8 format where the file keeps scales apart.
    let table_fmt = em.layers[0].table.format;
    match f["dialect"].as_str().unwrap() {
        "tarruda" | "jigsawpt" | "deepstrix" | "ds4gw" | "safetensors_checkpoint" => {
            assert_eq!(table_fmt, EngramType::Fp8E4m3E8m0Split, "{at}")
        }
        "ds4" => assert_eq!(table_fmt, EngramType::Fp8E4m3E8m0, "{at}"),
        _ => {}
    }
    check_outputs(&m, fx, &options(), &at);
}

/// Fixture `fx`'s model (`m`) against its expected outputs on a context
/// with options `o`: its check call, and tiny.json's regimes on the layers
/// that hold tiny.json's model.
fn check_outputs(m: &GgufModel, fx: &str, o: &GgufOptions, at: &str) {
    let f = &expected()["fixtures"][fx];
    let name = f["effective_model"].as_str().unwrap();
    let eff = &expected()["effective_models"][name];
    if name != "golden" {
        run_calls(
            m,
            o,
            &[call_of(check_call(name))],
            None,
            &format!("{at}: check call"),
        );
    }
    let tiny_layers: Vec<u32> = match name {
        "golden" => vec![1, 3],
        _ => eff["tiny_json_layers"].as_array().map_or(vec![], |a| {
            a.iter().map(|x| x.as_u64().unwrap() as u32).collect()
        }),
    };
    if !tiny_layers.is_empty() {
        assert_eq!(f["hash"], "tiny", "{at}");
        for regime in ["prefill", "decode", "dead"] {
            run_calls(
                m,
                o,
                &tiny_calls(regime),
                Some(&tiny_layers),
                &format!("{at}: tiny.json {regime}"),
            );
        }
    }
}

/// Every fixture on the CUDA backend (the GPU, else the emulation of its
/// kernels): the same expected outputs as on the CPU, with the tables left
/// in the file (`pread`) or its mapping, gathered on the host and copied to
/// the device, and the weights copied to the device at `set_layer`.
#[test]
fn every_fixture_on_the_cuda_backend() {
    let Some(dev) = common::device::device() else {
        return;
    };
    let o = GgufOptions {
        backend: engram::EngramBackend::Cuda as u32,
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                device: Some(dev.gpu.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
        ..options()
    };
    let fixtures = expected()["fixtures"].as_object().unwrap();
    assert!(fixtures.contains_key("checkpoint") && fixtures.len() >= 9);
    for fx in fixtures.keys() {
        for mmap in [false, true] {
            let at = format!("{fx} on CUDA ({})", if mmap { "mapped" } else { "pread" });
            let m = open_fixture(fx, &dir(), mmap)
                .unwrap_or_else(|e| panic!("{at}: {:?}: {}", e.status, e.message));
            check_outputs(&m, fx, &o, &at);
        }
    }
}

#[test]
fn vcruz305_split_set_opens_as_one_file() {
    check_fixture("vcruz305_split", false);
    check_fixture("vcruz305_split", true);
    // From any of its shards.
    let m = GgufModel::open(
        &dir().join("vcruz305_split-00002-of-00003.gguf"),
        &LoadOptions::default(),
    )
    .unwrap();
    assert_eq!(m.gguf.as_ref().unwrap().shards.len(), 3);
    assert_eq!(m.model.dialect, Dialect::Vcruz305);
}

#[test]
fn vcruz305_with_the_deepseek4_key_prefix() {
    check_fixture("vcruz305_deepseek4_prefix", false);
    check_fixture("vcruz305_single", true);
}

#[test]
fn ds4_264_byte_rows_and_f16_wkv() {
    check_fixture("ds4", false);
    check_fixture("ds4", true);
}

#[test]
fn tarruda_codes_and_scale_tensors_with_a_raw_pad() {
    check_fixture("tarruda", false);
    check_fixture("tarruda", true);
}

#[test]
fn jigsawpt_constants_as_tensors() {
    check_fixture("jigsawpt", false);
    check_fixture("jigsawpt", true);
}

#[test]
fn deepstrix_tables_from_the_checkpoint_shards() {
    check_fixture("deepstrix", false);
    check_fixture("deepstrix", true);
    // Without the checkpoint directory: refused, saying where the tables are.
    let f = &expected()["fixtures"]["deepstrix"];
    let e = GgufModel::open(
        &dir().join("deepstrix-00001-of-00001.gguf"),
        &LoadOptions {
            tokenizer: Some(deepseek_map()),
            ..LoadOptions::default()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    for n in f["refusal_names"].as_array().unwrap() {
        assert!(e.message.contains(n.as_str().unwrap()), "{}", e.message);
    }
    assert!(
        e.message.contains("tables_dir") && e.message.contains("engram_create_from_safetensors"),
        "{}",
        e.message
    );
    // Without a tokenizer: no hash constants to use.
    let e = GgufModel::open(
        &dir().join("deepstrix-00001-of-00001.gguf"),
        &LoadOptions {
            tables_dir: Some(&dir().join("checkpoint")),
            ..LoadOptions::default()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig, "{}", e.message);
    assert!(e.message.contains("tokenizer"), "{}", e.message);
}

#[test]
fn ds4gw_shard_path_and_offsets() {
    check_fixture("ds4gw_style", false);
    check_fixture("ds4gw_style", true);
    let f = &expected()["fixtures"]["ds4gw_style"];
    let e = GgufModel::open(&dir().join("ds4gw_style.gguf"), &LoadOptions::default())
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    assert!(
        e.message.contains(f["refusal_names"][0].as_str().unwrap()),
        "{}",
        e.message
    );
}

#[test]
fn the_safetensors_checkpoint_read_in_place() {
    check_fixture("checkpoint", false);
    check_fixture("checkpoint", true);
    // The same model as deepstrix's tables with the checkpoint's wkv: the
    // tables read through the deepstrix file are the same rows.
    let a = open_fixture("checkpoint", &dir(), false).unwrap();
    let b = open_fixture("deepstrix", &dir(), false).unwrap();
    for li in 0..2 {
        let ids: Vec<u64> = (0..a.model.layers[li].table.rows).step_by(7).collect();
        assert_eq!(
            a.table_rows(li, &ids).unwrap(),
            b.table_rows(li, &ids).unwrap()
        );
    }
    // The fp8 wkv (layer 3) is kept as stored, codes and 32x32 block scales:
    // read into owned memory without mmap (1 byte a weight and the scales,
    // half the bf16 figure), read in place from the mapped shard with it.
    let [(wt, wb), (_, qb), (_, kb)] = a.layer_weights(1).unwrap();
    assert_eq!(wt, EngramType::Fp8E4m3E8m0Block as u32);
    assert_eq!(wb.len(), 320 * 256);
    let Weights::Fp8Block(w) = a.layer_wkv(1).unwrap() else {
        panic!("an fp8 wkv")
    };
    assert_eq!((w.br, w.bc, w.scales.len()), (32, 32, 10 * 8));
    let [(_, wb0), (_, qb0), (_, kb0)] = a.layer_weights(0).unwrap();
    let weights = |w: &[u8], q: &[u8], k: &[u8]| w.len() + q.len() + k.len();
    let fp8 = weights(wb0, qb0, kb0) + weights(wb, qb, kb) + 10 * 8;
    let mapped = open_fixture("checkpoint", &dir(), true).unwrap();
    assert_eq!(
        a.owned_bytes() - mapped.owned_bytes(),
        fp8,
        "without mmap the weights are read as stored; mapped, in place"
    );
    // Its context keeps no widened copy: it holds what the same model's
    // context with the deepstrix file's wkv holds, byte for byte.
    let (ca, cb) = (
        a.context(&options()).unwrap(),
        b.context(&options()).unwrap(),
    );
    assert_eq!(ca.memory_bytes(), cb.memory_bytes());
}

// ---- bad input: expected.json's mutations ----

/// Copy what fixture `fx` needs into a fresh directory.
fn scratch(tag: &str, fx: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("engram-dialects-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("checkpoint")).unwrap();
    let f = &expected()["fixtures"][fx];
    for file in f["files"].as_array().unwrap() {
        let file = file.as_str().unwrap();
        if file.starts_with("..") {
            continue;
        }
        std::fs::copy(dir().join(file), d.join(file)).unwrap();
    }
    if f["companions"]["checkpoint_dir"].is_string() {
        for e in std::fs::read_dir(dir().join("checkpoint")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), d.join("checkpoint").join(e.file_name())).unwrap();
        }
    }
    d
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Apply one operation of a mutation in directory `d`.
fn apply_op(d: &Path, op: &Value) {
    let path = d.join(op["file"].as_str().unwrap());
    match op["op"].as_str().unwrap() {
        "patch" => {
            let mut b = std::fs::read(&path).unwrap();
            let at = op["offset"].as_u64().unwrap() as usize;
            let (old, new) = (
                unhex(op["old_hex"].as_str().unwrap()),
                unhex(op["new_hex"].as_str().unwrap()),
            );
            assert_eq!(&b[at..at + old.len()], old.as_slice(), "{op}: old bytes");
            b[at..at + new.len()].copy_from_slice(&new);
            std::fs::write(&path, b).unwrap();
        }
        "replace_text" => {
            let mut b = std::fs::read(&path).unwrap();
            let (old, new) = (
                op["old"].as_str().unwrap().as_bytes(),
                op["new"].as_str().unwrap().as_bytes(),
            );
            assert_eq!(old.len(), new.len());
            let at = b
                .windows(old.len())
                .position(|w| w == old)
                .unwrap_or_else(|| panic!("{op}: text not found"));
            b[at..at + new.len()].copy_from_slice(new);
            std::fs::write(&path, b).unwrap();
        }
        "delete_file" => std::fs::remove_file(&path).unwrap(),
        "rewrite_array" => {
            let b = std::fs::read(&path).unwrap();
            std::fs::write(
                &path,
                drop_last(
                    &b,
                    op["key"].as_str().unwrap(),
                    op["drop_last"].as_u64().unwrap() as usize,
                ),
            )
            .unwrap();
        }
        other => panic!("unknown op {other}"),
    }
}

/// The GGUF file `b` with the last `k` elements of array `key` dropped: the
/// count lowered, the elements removed, and as many zero bytes put back at
/// the end of the header (in its padding), so that the tensor data stays
/// where it was.
fn drop_last(b: &[u8], key: &str, k: usize) -> Vec<u8> {
    let g = Gguf::parse(b).unwrap();
    let kv = g.get(key).unwrap();
    let GValue::Array(a) = &kv.value else {
        panic!("{key} is not an array")
    };
    let size = (a.end - a.start) / a.len as usize;
    let cut = k * size;
    let mut out = b.to_vec();
    let count_at = a.start - 8;
    out[count_at..a.start].copy_from_slice(&(a.len - k as u64).to_le_bytes());
    out.drain(a.end - cut..a.end);
    let hdr = g.header_len - cut;
    out.splice(hdr..hdr, std::iter::repeat_n(0u8, cut));
    assert_eq!(out.len(), b.len());
    assert!(((hdr as u64).div_ceil(g.alignment) * g.alignment) == g.data_offset);
    out
}

fn status_of(s: &str) -> EngramStatus {
    match s {
        "ErrFormat" => EngramStatus::ErrFormat,
        "ErrIo" => EngramStatus::ErrIo,
        "ErrInvalidConfig" => EngramStatus::ErrInvalidConfig,
        "ErrUnsupported" => EngramStatus::ErrUnsupported,
        other => panic!("status {other}"),
    }
}

#[test]
fn every_mutation_is_refused_naming_its_keys() {
    let ms = expected()["mutations"].as_object().unwrap();
    let mut n = 0;
    for (fx, list) in ms {
        for (i, mu) in list.as_array().unwrap().iter().enumerate() {
            let name = mu["name"].as_str().unwrap();
            let d = scratch(&format!("{fx}-{i}"), fx);
            for op in mu["ops"].as_array().unwrap() {
                apply_op(&d, op);
            }
            for mmap in [false, true] {
                let at = format!("{fx}/{name} ({})", if mmap { "mapped" } else { "pread" });
                let e = match open_fixture(fx, &d, mmap) {
                    Ok(_) => panic!("{at}: opened"),
                    Err(e) => e,
                };
                assert_eq!(
                    e.status,
                    status_of(mu["status_suggested"].as_str().unwrap()),
                    "{at}: {}",
                    e.message
                );
                for k in mu["message_names"].as_array().unwrap() {
                    assert!(
                        e.message.contains(k.as_str().unwrap()),
                        "{at}: the message does not name {k}: {}",
                        e.message
                    );
                }
            }
            std::fs::remove_dir_all(&d).unwrap();
            n += 1;
        }
    }
    assert_eq!(n, 45, "every mutation of expected.json");
}

/// The early deepseek4.-prefix converter's pad key shares its name with
/// deepstrix's raw pad, but such a file carries its tables inside, which a
/// deepstrix file never does: its pad is the compressed id, even where the
/// two readings differ (issue 21.10; it was refused as ambiguous before).
#[test]
fn a_prefix_file_with_its_tables_inside_reads_a_compressed_pad() {
    let src = dir().join("vcruz305_deepseek4_prefix.gguf");
    let mut b = std::fs::read(&src).unwrap();
    let g = Gguf::parse(&b).unwrap();
    let kv = g.get("deepseek4.engram.pad_id").unwrap();
    // Raw token 7 maps to 2; as a compressed id it is 7.
    b[kv.type_at + 4..kv.type_at + 8].copy_from_slice(&7u32.to_le_bytes());
    let m = GgufModel::from_memory(vec![("p.gguf".into(), b.clone())], &LoadOptions::default())
        .unwrap();
    assert_eq!(m.model.pad_id, 7);
    assert_eq!(m.model.pad.reading, engram::gguf::PadReading::Compressed);
    assert!(
        m.model.pad.how.contains("compressed"),
        "{}",
        m.model.pad.how
    );
    // The fixture's stored 2 (both readings agree) opens as before.
    let m = GgufModel::open(&src, &LoadOptions::default()).unwrap();
    assert_eq!(m.model.pad_id, 2);
}

/// A config + tokenizer given with a file that has its own constants must
/// agree with them, pad included (tarruda's raw pad 7 is the compressed 2).
#[test]
fn companion_files_must_agree_with_the_file() {
    let t = EngramTables::from_files(
        &golden_dir().join("tiny_config.json"),
        &golden_dir().join("deepseek_v4_tokenizer.json"),
    )
    .unwrap();
    let e = GgufModel::open(
        &dir().join("tarruda.gguf"),
        &LoadOptions {
            companion: Some(&t),
            ..LoadOptions::default()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig, "{}", e.message);
    assert!(
        e.message.contains("deepseek41.engram.multipliers"),
        "{}",
        e.message
    );
    // A tokenizer alone whose map differs from the file's.
    let e = GgufModel::open(
        &dir().join("ds4.gguf"),
        &LoadOptions {
            tokenizer: Some(deepseek_map()),
            ..LoadOptions::default()
        },
    )
    .err()
    .unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig, "{}", e.message);
    assert!(
        e.message.contains("deepseek41.engram.token_map"),
        "{}",
        e.message
    );
}

/// Integer keys in any width that holds the value; one that does not fit is
/// refused naming the key.
#[test]
fn integer_widths_that_hold_the_value_are_accepted() {
    // tarruda's u32 primes rewritten as... the same values in the i32 type tag.
    let src = dir().join("tarruda.gguf");
    let b = std::fs::read(&src).unwrap();
    let g = Gguf::parse(&b).unwrap();
    let kv = g.get("deepseek41.engram.head_bucket_sizes").unwrap();
    let mut m = b.clone();
    m[kv.type_at + 4..kv.type_at + 8].copy_from_slice(&5u32.to_le_bytes()); // u32[] -> i32[]
    let x = GgufModel::from_memory(vec![("t.gguf".into(), m)], &LoadOptions::default()).unwrap();
    assert_eq!(
        x.model.primes,
        u64s(&expected()["constants"]["tiny"]["primes"])
    );
    // A layer id that does not fit a u32: the i32 -1 in JigSawPT's layer_ids.
    let src = dir().join("jigsawpt.gguf");
    let b = std::fs::read(&src).unwrap();
    let g = Gguf::parse(&b).unwrap();
    let GValue::Array(a) = &g.get("deepseek41.engram.layer_ids").unwrap().value else {
        panic!()
    };
    let mut m = b.clone();
    m[a.start..a.start + 4].copy_from_slice(&(-1i32).to_le_bytes());
    let e = GgufModel::from_memory(vec![("j.gguf".into(), m)], &LoadOptions::default())
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrFormat, "{}", e.message);
    assert!(
        e.message.contains("deepseek41.engram.layer_ids[0] = -1")
            && e.message.contains("does not fit"),
        "{}",
        e.message
    );
}

/// The two modes and the fp8 split tables agree bit for bit with a packed
/// copy of the same table (tarruda's split table vs ds4's 264-style rows).
#[test]
fn split_and_packed_fp8_tables_gather_the_same_rows() {
    let a = GgufModel::open(&dir().join("tarruda.gguf"), &LoadOptions::default()).unwrap();
    let b = GgufModel::open(&dir().join("ds4.gguf"), &LoadOptions::default()).unwrap();
    for li in 0..2 {
        let ids: Vec<u64> = (0..a.model.layers[li].table.rows).collect();
        assert_eq!(
            a.table_rows(li, &ids).unwrap(),
            b.table_rows(li, &ids).unwrap()
        );
    }
}

// ---- the C tests' copy of the mutations ----

/// `tests/golden/data/dialects/mutations_c.txt`: expected.json's fixtures and
/// mutations in a line format `c_tests/test_dialects.c` reads (CI has no
/// Python and C has no JSON parser). Same-length text edits become byte
/// patches; the one header rewrite (`rewrite_array`) is left to this test.
fn c_fixture_text() -> String {
    let e = expected();
    let mut out = String::from(
        "# Generated from expected.json by tests/gguf_dialects.rs; do not edit. Regenerate with\n\
         #   ENGRAM_UPDATE_C_FIXTURE=1 cargo test --test gguf_dialects c_fixture\n\
         # fixture NAME OPEN FILES FLAGS   (FILES comma-separated, relative to dialects/;\n\
         #   FLAGS: tables = tables_dir is the checkpoint copy, tokenizer = the DeepSeek tokenizer,\n\
         #   safetensors = open the directory with engram_create_from_safetensors; - for none)\n\
         # mutation FIXTURE NAME STATUS NAMES OPS   (STATUS the engram_status number; NAMES\n\
         #   comma-separated; OPS ';'-separated: patch,FILE,OFFSET,OLDHEX,NEWHEX or delete,FILE)\n",
    );
    let fx = e["fixtures"].as_object().unwrap();
    for (name, f) in fx {
        if name == "vcruz305_single" {
            continue; // tiny.gguf, outside dialects/
        }
        let files: Vec<&str> = f["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap())
            .collect();
        let open = f["open"].as_str().unwrap_or(files[0]);
        let mut flags = Vec::new();
        if f["companions"]["checkpoint_dir"].is_string() {
            flags.push("tables");
        }
        if f["hash"] == "derived" {
            flags.push("tokenizer");
        }
        if name == "checkpoint" {
            flags.push("safetensors");
        }
        out += &format!(
            "fixture {name} {open} {} {}\n",
            files.join(","),
            if flags.is_empty() {
                "-".to_string()
            } else {
                flags.join(",")
            }
        );
    }
    for (name, list) in e["mutations"].as_object().unwrap() {
        for m in list.as_array().unwrap() {
            let mut ops = Vec::new();
            let mut skip = false;
            for op in m["ops"].as_array().unwrap() {
                let file = op["file"].as_str().unwrap();
                match op["op"].as_str().unwrap() {
                    "patch" => ops.push(format!(
                        "patch,{file},{},{},{}",
                        op["offset"],
                        op["old_hex"].as_str().unwrap(),
                        op["new_hex"].as_str().unwrap()
                    )),
                    "replace_text" => {
                        let b = std::fs::read(dir().join(file)).unwrap();
                        let (old, new) = (
                            op["old"].as_str().unwrap().as_bytes(),
                            op["new"].as_str().unwrap().as_bytes(),
                        );
                        let at = b.windows(old.len()).position(|w| w == old).unwrap();
                        let hex =
                            |x: &[u8]| x.iter().map(|c| format!("{c:02x}")).collect::<String>();
                        ops.push(format!("patch,{file},{at},{},{}", hex(old), hex(new)));
                    }
                    "delete_file" => ops.push(format!("delete,{file}")),
                    _ => skip = true,
                }
            }
            if skip {
                continue;
            }
            let names: Vec<&str> = m["message_names"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_str().unwrap())
                .collect();
            out += &format!(
                "mutation {name} {} {} {} {}\n",
                m["name"].as_str().unwrap(),
                status_of(m["status_suggested"].as_str().unwrap()) as i32,
                names.join(","),
                ops.join(";")
            );
        }
    }
    out
}

#[test]
fn c_fixture_is_current() {
    let p = dir().join("mutations_c.txt");
    let want = c_fixture_text();
    if std::env::var("ENGRAM_UPDATE_C_FIXTURE").is_ok_and(|v| v == "1") {
        std::fs::write(&p, &want).unwrap();
    }
    let got = std::fs::read_to_string(&p).unwrap_or_default();
    assert!(
        got == want,
        "{} is stale: regenerate with ENGRAM_UPDATE_C_FIXTURE=1 cargo test --test gguf_dialects c_fixture",
        p.display()
    );
}

/// f16 weights (ds4 writes wkv as f16) are converted at load to a format the
/// context reads, values unchanged: wkv to bf16 where exact, q and k to one
/// shared type (f32). Here the prefix fixture's bf16 q and k are relabelled
/// f16 (same bytes, other values).
#[test]
fn f16_weights_are_converted_exactly() {
    let src = dir().join("vcruz305_deepseek4_prefix.gguf");
    let mut b = std::fs::read(&src).unwrap();
    let g = Gguf::parse(&b).unwrap();
    for n in ["blk.1.engram_q.weight", "blk.1.engram_k.weight"] {
        let t = g.tensor(n).unwrap();
        let at = t.entry_at + 4 + 8 * t.dims.len();
        b[at..at + 4].copy_from_slice(&1u32.to_le_bytes()); // BF16 -> F16
    }
    let m = GgufModel::from_memory(vec![("p.gguf".into(), b.clone())], &LoadOptions::default())
        .unwrap();
    let [_, (qt, qb), (kt, kb)] = m.layer_weights(0).unwrap();
    assert_eq!((qt, kt), (EngramType::F32 as u32, EngramType::F32 as u32));
    let t = g.tensor("blk.1.engram_q.weight").unwrap();
    let raw = &b[t.offset as usize..(t.offset + t.bytes.unwrap()) as usize];
    for (i, c) in raw.chunks_exact(2).enumerate() {
        let want = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
        let got = f32::from_le_bytes(qb[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!(got.to_bits(), want.to_bits(), "q[{i}]");
    }
    assert_eq!(kb.len(), qb.len());
    // It applies.
    let ctx = m.context(&options()).unwrap();
    let mut ids = vec![0i64; 3 * ctx.ids_per_token()];
    ctx.hash(&[1, 2, 3], &[0, 0, 0], &[0, 1, 2], &mut ids)
        .unwrap();
    let mut h = values("f16.h", 3 * 4 * 64, 1.0, 0.0);
    ctx.apply(1, &ids, 3, Highway::F32(&mut h)).unwrap();
    // ds4's f16 wkv became bf16 (every value exact in bf16).
    let d = GgufModel::open(&dir().join("ds4.gguf"), &LoadOptions::default()).unwrap();
    let [(wt, _), (qt, _), _] = d.layer_weights(0).unwrap();
    assert_eq!((wt, qt), (EngramType::Bf16 as u32, EngramType::F32 as u32));
}

/// A deepstrix file with only `tables_dir` given: the `tokenizer.json` there
/// completes its hash constants.
#[test]
fn a_tokenizer_json_in_tables_dir_completes_a_deepstrix_file() {
    let d = scratch("tables-tokenizer", "deepstrix");
    std::fs::copy(
        golden_dir().join("deepseek_v4_tokenizer.json"),
        d.join("checkpoint/tokenizer.json"),
    )
    .unwrap();
    let ck = d.join("checkpoint");
    let m = GgufModel::open(
        &d.join("deepstrix-00001-of-00001.gguf"),
        &LoadOptions {
            tables_dir: Some(&ck),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    assert_eq!(m.model.hash_source, "tokenizer+file keys");
    assert_eq!(m.model.token_map, deepseek_map().map);
    assert_eq!(
        m.model.multipliers,
        u64s(&expected()["constants"]["derived"]["multipliers"])
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// GGUF file `bytes` with the metadata `kvs` (key, GGUF type, value bytes)
/// added before its own: a filler key pads the added bytes to a multiple of
/// 256, so that the data section stays aligned (for any alignment up to 256).
fn with_kvs(bytes: &[u8], kvs: &[(&str, u32, Vec<u8>)]) -> Vec<u8> {
    let enc = |k: &str, t: u32, v: &[u8]| {
        let mut b = (k.len() as u64).to_le_bytes().to_vec();
        b.extend(k.as_bytes());
        b.extend(t.to_le_bytes());
        b.extend(v);
        b
    };
    let mut add: Vec<u8> = kvs.iter().flat_map(|(k, t, v)| enc(k, *t, v)).collect();
    let klen = 256 - (add.len() + 13) % 256; // a u8 kv takes 13 + key bytes
    add.extend(enc(&"f".repeat(klen), 0, &[0]));
    assert_eq!(add.len() % 256, 0);
    let n_kv = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) + kvs.len() as u64 + 1;
    let mut out = bytes[..16].to_vec();
    out.extend(n_kv.to_le_bytes());
    out.extend(add);
    out.extend(&bytes[24..]);
    out
}

#[test]
fn eps_comes_from_the_file_when_the_options_leave_it_zero() {
    let tiny = std::fs::read(golden_dir().join("tiny.gguf")).unwrap();
    let open =
        |b: Vec<u8>| GgufModel::from_memory(vec![("tiny.gguf".into(), b)], &LoadOptions::default());
    let key = "deepseek41.attention.layer_norm_rms_epsilon";
    let mut o = options();
    // The file's key, a value other than the default.
    let m = open(with_kvs(&tiny, &[(key, 6, 3e-5f32.to_le_bytes().to_vec())])).unwrap();
    assert_eq!(m.eps, Some(3e-5));
    o.eps = 0.0;
    assert_eq!(m.context(&o).unwrap().geometry().eps, 3e-5, "0: the file's");
    o.eps = 1e-4;
    assert_eq!(
        m.context(&o).unwrap().geometry().eps,
        1e-4,
        "an eps asked for wins"
    );
    // No key: the default.
    let m = open(tiny.clone()).unwrap();
    assert_eq!(m.eps, None);
    o.eps = 0.0;
    assert_eq!(m.context(&o).unwrap().geometry().eps, 1e-6);
    // A mistyped or non-finite key is a format error naming it.
    for (t, v) in [
        (4u32, 7u32.to_le_bytes().to_vec()),
        (6, f32::NAN.to_le_bytes().to_vec()),
    ] {
        let e = open(with_kvs(&tiny, &[(key, t, v)])).err().unwrap();
        assert_eq!(e.status, engram::EngramStatus::ErrFormat);
        assert!(e.message.contains(key), "{}", e.message);
    }
    // Another architecture's key is not this file's.
    let m = open(with_kvs(
        &tiny,
        &[(
            "llama.attention.layer_norm_rms_epsilon",
            6,
            3e-5f32.to_le_bytes().to_vec(),
        )],
    ))
    .unwrap();
    assert_eq!(m.eps, None);
}

#[test]
fn the_checkpoint_takes_eps_from_config_json() {
    let src = dir().join("checkpoint");
    let tmp = std::env::temp_dir().join(format!("engram_eps_ckpt_{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.join(e.file_name())).unwrap();
    }
    let o = LoadOptions {
        tokenizer: Some(deepseek_map()),
        ..LoadOptions::default()
    };
    let m = GgufModel::open_checkpoint(&tmp, None, &o).unwrap();
    assert_eq!(m.eps, None, "the fixture's config has no rms_norm_eps");
    let cfg_path = tmp.join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["text_config"]["rms_norm_eps"] = serde_json::json!(2e-5);
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let m = GgufModel::open_checkpoint(&tmp, None, &o).unwrap();
    assert_eq!(m.eps, Some(2e-5));
    let mut opts = options();
    opts.eps = 0.0;
    assert_eq!(m.context(&opts).unwrap().geometry().eps, 2e-5);
    cfg["text_config"]["rms_norm_eps"] = serde_json::json!("small");
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let e = GgufModel::open_checkpoint(&tmp, None, &o).err().unwrap();
    assert_eq!(e.status, engram::EngramStatus::ErrInvalidConfig);
    assert!(e.message.contains("rms_norm_eps"), "{}", e.message);
    std::fs::remove_dir_all(&tmp).unwrap();
}
