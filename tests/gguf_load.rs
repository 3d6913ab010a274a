//! Contexts created straight from GGUF files written by gguf-py
//! (`tests/golden/gen_gguf.py`): the golden's hash ids exactly, and apply
//! results bit-identical to the Rust API context over the same weights.

mod common;

use common::*;
use engram::gguf::{Gguf, GgufModel, GgufOptions, LoadOptions};
use engram::tables::EngramTables;
use engram::{Context, EngramStatus, Highway, Limits};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    golden_dir().join(name)
}

fn options() -> GgufOptions {
    cpu_gguf_options(f32::from_bits(0x358637bd)) // f32(1e-6), as the golden
}

/// Open a fixture (pread mode), with config + tokenizer tables if given.
fn open(path: &std::path::Path, companion: Option<&EngramTables>) -> engram::Result<GgufModel> {
    GgufModel::open(
        path,
        &LoadOptions {
            companion,
            ..LoadOptions::default()
        },
    )
}

/// A model from a GGUF file's bytes.
fn from_bytes(b: Vec<u8>) -> engram::Result<GgufModel> {
    GgufModel::from_memory(vec![("m.gguf".into(), b)], &LoadOptions::default())
}

/// One call: `(tokens, seq_ids, pos, highway_name, row ids)`.
type Call = (Vec<i32>, Vec<i32>, Vec<i32>, String, Vec<i64>);

/// Every call of every regime, by regime name.
fn all_calls(tiny: &Tiny) -> Vec<(String, Vec<Call>)> {
    let regs = tiny.golden["regimes"].as_object().unwrap();
    regs.keys()
        .map(|name| {
            let calls = golden_calls(tiny, name)
                .into_iter()
                .map(|c| (c.tokens, c.seq_ids, c.pos, c.highway, c.ids))
                .collect();
            (name.clone(), calls)
        })
        .collect()
}

/// Run every regime on `a` and `b` (fresh contexts per regime are made by the
/// closures), checking `a`'s ids against the golden and its highways against `b`'s.
fn compare(
    tiny: &Tiny,
    mk_a: &dyn Fn() -> Context<'static>,
    mk_b: &dyn Fn() -> Context<'static>,
    check_ids: bool,
) {
    let (hc, d) = (tiny.hc, tiny.d);
    for (regime, calls) in all_calls(tiny) {
        let (a, b) = (mk_a(), mk_b());
        for (ci, (tokens, seqs, pos, hw, want_ids)) in calls.iter().enumerate() {
            let n = tokens.len();
            let per = a.ids_per_token();
            let mut ids = vec![0i64; n * per];
            let mut ids_b = vec![0i64; n * per];
            a.hash(tokens, seqs, pos, &mut ids).unwrap();
            b.hash(tokens, seqs, pos, &mut ids_b).unwrap();
            if check_ids {
                assert_eq!(&ids, want_ids, "{regime} call {ci}: hash ids");
            }
            assert_eq!(ids, ids_b, "{regime} call {ci}");
            for &lid in &tiny.layer_ids {
                let x = values(hw, n * hc * d, 1.0, 0.0);
                let (mut ha, mut hb) = (x.clone(), x.clone());
                a.apply(lid, &ids, n, Highway::F32(&mut ha)).unwrap();
                b.apply(lid, &ids, n, Highway::F32(&mut hb)).unwrap();
                let same = ha.iter().zip(&hb).all(|(p, q)| p.to_bits() == q.to_bits());
                assert!(same, "{regime} call {ci} layer {lid}: f32 highway differs");
                let xb: Vec<u16> = x.iter().map(|&v| engram::formats::f32_to_bf16(v)).collect();
                let (mut ba, mut bb) = (xb.clone(), xb);
                a.apply(lid, &ids, n, Highway::Bf16(&mut ba)).unwrap();
                b.apply(lid, &ids, n, Highway::Bf16(&mut bb)).unwrap();
                assert_eq!(
                    ba, bb,
                    "{regime} call {ci} layer {lid}: bf16 highway differs"
                );
            }
        }
    }
}

fn leak<T>(x: T) -> &'static T {
    Box::leak(Box::new(x))
}

#[test]
fn tiny_gguf_gives_the_golden() {
    let tiny: &'static Tiny = leak(Tiny::load());
    let m: &'static GgufModel = leak(open(&fixture("tiny.gguf"), None).unwrap());
    let em = &m.model;
    assert_eq!(em.hash_source, "gguf");
    assert_eq!((em.d, em.hc, em.hd), (tiny.d, tiny.hc, tiny.hd));
    assert_eq!(em.layer_ids, tiny.layer_ids);
    assert_eq!(em.token_map, tiny.token_map);
    assert_eq!(em.multipliers, tiny.multipliers);
    assert_eq!(em.primes, tiny.primes);
    assert_eq!(em.offsets, tiny.offsets);
    assert_eq!(em.pad_id, tiny.pad_id);
    assert_eq!(m.gguf.as_ref().unwrap().header().version, 3);
    // The unrelated tensors were sized: f32 [48, 32] and q4_1 [2, 64].
    assert_eq!(
        m.gguf
            .as_ref()
            .unwrap()
            .header()
            .tensor("token_embd.weight")
            .unwrap()
            .bytes,
        Some(48 * 32 * 4)
    );
    assert_eq!(
        m.gguf
            .as_ref()
            .unwrap()
            .header()
            .tensor("output.weight")
            .unwrap()
            .bytes,
        Some(2 * 2 * 20)
    );
    // Layer 1's bf16 table holds the fp8 table's dequantised values, so the
    // GGUF context reproduces the golden model exactly.
    compare(
        tiny,
        &|| m.context(&options()).unwrap(),
        &|| tiny.context(),
        true,
    );
    // And through the host row cache (docs/row-cache.md): one that holds
    // every row, and one of 3 rows a layer that evicts all the time.
    for budget in [1 << 20, 2 * 3 * 4 * tiny.hd as u64] {
        let o = GgufOptions {
            row_cache_bytes: budget,
            ..options()
        };
        compare(tiny, &|| m.context(&o).unwrap(), &|| tiny.context(), true);
    }
}

#[test]
fn other_integer_widths_and_derived_offsets() {
    let tiny: &'static Tiny = leak(Tiny::load());
    let m: &'static GgufModel = leak(open(&fixture("tiny_u32.gguf"), None).unwrap());
    let em = &m.model;
    assert_eq!(
        em.token_map, tiny.token_map,
        "u32 token map, 0xFFFFFFFF read as -1"
    );
    assert_eq!(em.multipliers, tiny.multipliers, "i64 multipliers");
    assert_eq!(em.primes, tiny.primes, "u32 primes");
    assert_eq!(em.offsets, tiny.offsets, "offsets absent: prefix sums");
    assert_eq!(em.pad_id, tiny.pad_id);
    assert_eq!(
        m.gguf
            .as_ref()
            .unwrap()
            .header()
            .tensor("blk.3.engram_embd")
            .unwrap()
            .ty,
        8,
        "q8_0 table"
    );
    // Hash ids exactly; apply equal to tiny.gguf's where the weights agree (layer 1).
    let main: &'static GgufModel = leak(open(&fixture("tiny.gguf"), None).unwrap());
    let ctx = m.context(&options()).unwrap();
    let ctx_main = main.context(&options()).unwrap();
    for (_, calls) in all_calls(tiny) {
        let (a, b) = (
            m.context(&options()).unwrap(),
            main.context(&options()).unwrap(),
        );
        for (tokens, seqs, pos, hw, want) in calls {
            let n = tokens.len();
            let mut ids = vec![0i64; n * a.ids_per_token()];
            a.hash(&tokens, &seqs, &pos, &mut ids).unwrap();
            b.hash(&tokens, &seqs, &pos, &mut vec![0i64; ids.len()])
                .unwrap();
            assert_eq!(ids, want);
            let x = values(&hw, n * tiny.hc * tiny.d, 1.0, 0.0);
            let (mut ha, mut hb) = (x.clone(), x);
            a.apply(1, &ids, n, Highway::F32(&mut ha)).unwrap();
            b.apply(1, &ids, n, Highway::F32(&mut hb)).unwrap();
            assert_eq!(ha, hb, "layer 1 (same bf16 weights in both files)");
        }
    }
    drop((ctx, ctx_main));
}

#[test]
fn missing_hash_constants_name_the_keys_or_come_from_config_and_tokenizer() {
    let e = open(&fixture("tiny_noconst.gguf"), None).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
    for k in ["multipliers", "primes", "offsets", "token_map", "pad_id"] {
        assert!(
            e.message.contains(&format!("deepseek41.engram.{k}")),
            "{}",
            e.message
        );
    }
    let tables = EngramTables::from_files(
        &fixture("tiny_config.json"),
        &fixture("deepseek_v4_tokenizer.json"),
    )
    .unwrap();
    let exp = load_json("gguf_expected.json");
    assert_eq!(tables.multipliers, u64s(&exp["multipliers"]));
    assert_eq!(tables.primes, u64s(&exp["primes"]));
    let m: &'static GgufModel = leak(open(&fixture("tiny_noconst.gguf"), Some(&tables)).unwrap());
    assert_eq!(m.model.hash_source, "config+tokenizer");
    let with: &'static GgufModel = leak(open(&fixture("tiny_u32.gguf"), None).unwrap());
    let opts = GgufOptions {
        limits: Limits {
            max_tokens: 64,
            max_seqs: 4,
            max_positions: 256,
        },
        ..options()
    };
    let a = m.context(&opts).unwrap();
    let b = with.context(&opts).unwrap();
    for (si, t) in exp["texts"].as_array().unwrap().iter().enumerate() {
        let tokens = i32s(&t["tokens"]);
        let n = tokens.len();
        let pos: Vec<i32> = (0..n as i32).collect();
        let mut ids = vec![0i64; n * a.ids_per_token()];
        a.hash(&tokens, &vec![si as i32; n], &pos, &mut ids)
            .unwrap();
        assert_eq!(
            ids,
            ints(&t["ids"]),
            "text {si}: hash ids of the Python reference"
        );
        // Same tensors as tiny_u32.gguf: the same rows and results for these ids.
        for lid in [1u32, 3] {
            let x = values("gguf.text.highway", n * 4 * 64, 1.0, 0.0);
            let (mut ha, mut hb) = (x.clone(), x);
            a.apply(lid, &ids, n, Highway::F32(&mut ha)).unwrap();
            b.apply(lid, &ids, n, Highway::F32(&mut hb)).unwrap();
            assert_eq!(ha, hb, "text {si} layer {lid}");
        }
    }
    // A file with its own constants and a companion that derives others: refused.
    let e = open(&fixture("tiny.gguf"), Some(&tables)).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
    assert!(
        e.message.contains("deepseek41.engram.multipliers")
            && e.message.contains("deepseek41.engram.token_map")
            && !e.message.contains("primes"),
        "{}",
        e.message
    );
    // A companion that disagrees with the file's geometry is refused.
    let mut other = tables.clone();
    other.config.n_heads = 3;
    let e = open(&fixture("tiny_noconst.gguf"), Some(&other))
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
    assert!(e.message.contains("H = 3"), "{}", e.message);
}

fn parse_err(b: &[u8]) -> engram::Error {
    Gguf::parse(b).expect_err("parse must fail")
}

/// Offset of tensor `name`'s header entry fields (after its name).
fn tensor_entry(b: &[u8], name: &str) -> usize {
    let mut pat = (name.len() as u64).to_le_bytes().to_vec();
    pat.extend_from_slice(name.as_bytes());
    let i = b
        .windows(pat.len())
        .position(|w| w == pat.as_slice())
        .unwrap();
    i + pat.len()
}

#[test]
fn bad_files_get_their_own_status() {
    let good = std::fs::read(fixture("tiny.gguf")).unwrap();
    assert!(Gguf::parse(&good).is_ok());
    // Wrong magic.
    let mut b = good.clone();
    b[0] = b'X';
    let e = parse_err(&b);
    assert_eq!(e.status, EngramStatus::ErrFormat);
    assert!(e.message.contains("not a GGUF file"), "{}", e.message);
    // Versions.
    for (v, what) in [
        (1u32, "version 1"),
        (4, "version 4"),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut b = good.clone();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let e = parse_err(&b);
        assert_eq!(e.status, EngramStatus::ErrUnsupported, "{what}");
        assert!(e.message.contains(what), "{}", e.message);
    }
    // Truncated anywhere: in the header, or in the tensor data.
    let last = Gguf::parse(&good)
        .unwrap()
        .tensor("output.weight")
        .unwrap()
        .offset as usize;
    for cut in [0, 3, 7, 20, 100, 1000, 1500, good.len() / 2, last + 40] {
        let e = parse_err(&good[..cut]);
        assert_eq!(e.status, EngramStatus::ErrFormat, "cut at {cut}");
        assert!(
            e.message.contains("truncated") || e.message.contains("too short"),
            "cut {cut}: {}",
            e.message
        );
    }
    // A tensor whose shape says more data than was written: it runs into the next.
    let mut b = good.clone();
    let at = tensor_entry(&b, "blk.1.engram_q");
    // n_dims u32, then dims: make [64, 4] into [64, 5].
    b[at + 12..at + 20].copy_from_slice(&5u64.to_le_bytes());
    let e = parse_err(&b);
    assert_eq!(e.status, EngramStatus::ErrFormat);
    assert!(
        e.message.contains("overlaps") && e.message.contains("blk.1.engram_q"),
        "{}",
        e.message
    );
    // An engram tensor of a type unknown to ggml: the file parses, the model does not.
    let mut b = good.clone();
    let at = tensor_entry(&b, "blk.3.engram_q");
    b[at + 20..at + 24].copy_from_slice(&99u32.to_le_bytes());
    let g = Gguf::parse(&b).unwrap();
    assert_eq!(g.tensor("blk.3.engram_q").unwrap().bytes, None);
    let e = from_bytes(b).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrUnsupported);
    assert!(
        e.message.contains("blk.3.engram_q") && e.message.contains("99"),
        "{}",
        e.message
    );
    // A ggml type the engram path does not take as table rows (q4_1): unsupported.
    let mut b = good.clone();
    let at = tensor_entry(&b, "blk.1.engram_embd");
    b[at + 20..at + 24].copy_from_slice(&3u32.to_le_bytes()); // q4_1: fewer bytes, still inside
    let e = from_bytes(b).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrUnsupported, "{}", e.message);
    assert!(e.message.contains("blk.1.engram_embd"), "{}", e.message);
    // Files: missing, and not a file.
    let e = open(&fixture("no_such.gguf"), None).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrIo);
    let e = open(&golden_dir(), None).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrIo);
}
