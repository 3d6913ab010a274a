//! The tool's own checks: its id stream against the golden generator's ids
//! and the library's hash in one call; the LRU and the page-cache model on
//! hand-counted streams.

use crate::ids::{Hasher, TextIds, HASH_CHUNK};
use crate::run::Library;
use crate::sim::{replay_cache, replay_pages, Layout, RowPolicy};
use crate::stream::{accesses, Accesses, Schedule, Shape};
use engram::rowcache::{new_policy, PolicyKind};
use std::path::PathBuf;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/golden/data")
        .join(name)
}

fn hasher() -> Hasher {
    Hasher::load(
        &golden("v41_config.json"),
        &golden("deepseek_v4_tokenizer.json"),
    )
    .unwrap()
}

fn nums(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// The golden generator (Python, the reference's tokenizer and hash) gives
/// each fixed text's tokens and 48 ids a token; the tool's path (tokenize,
/// hash in chunks as one sequence) gives the same, and the one-stream
/// schedule replays them token by token, each token's ids sorted.
#[test]
fn id_stream_equals_the_golden_ids() {
    let h = hasher();
    let g: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden("v41_hash.json")).unwrap()).unwrap();
    let ctx = h.context().unwrap();
    let texts: Vec<&serde_json::Value> = g["texts"].as_array().unwrap().iter().collect();
    let bodies: Vec<String> = texts
        .iter()
        .map(|t| t["text"].as_str().unwrap().to_string())
        .collect();
    let toks = h.tokenize(&bodies).unwrap();
    let mut all = Vec::new();
    for (t, tk) in texts.iter().zip(&toks) {
        assert_eq!(
            tk.iter().map(|&x| x as i64).collect::<Vec<_>>(),
            nums(&t["tokens"])
        );
        let ids = h.hash_text(&ctx, tk).unwrap();
        let want: Vec<u32> = nums(&t["ids"]).iter().map(|&x| x as u32).collect();
        assert_eq!(ids.ids, want, "{:?}", t["text"]);
        all.push(ids);
    }
    let shape = Shape {
        layers: 2,
        cols: 24,
    };
    let acc = accesses(&all, shape, Schedule::Stream, true);
    let mut runs = Vec::new();
    acc.for_each_run(|l, ids| runs.push((l, ids.to_vec())));
    let mut k = 0;
    for t in &all {
        for tok in 0..t.tokens {
            for l in 0..2 {
                let base = (tok * 2 + l) * 24;
                let mut want = t.ids[base..base + 24].to_vec();
                want.sort_unstable();
                want.dedup();
                assert_eq!(runs[k], (l, want));
                k += 1;
            }
        }
    }
    assert_eq!(k, runs.len());
}

/// A text longer than a hash call (chunks of 4096 tokens, the history
/// carried between calls) hashes as one call of all its tokens does.
#[test]
fn chunked_hash_equals_one_call() {
    let h = hasher();
    let readme = std::fs::read_to_string(golden("../../../README.md")).unwrap();
    let tk = h.tokenize(&[readme.repeat(3)]).unwrap().remove(0);
    assert!(tk.len() > HASH_CHUNK + 10, "{} tokens", tk.len());
    let got = h.hash_text(&h.context().unwrap(), &tk).unwrap();
    let cfg = engram::ContextConfig {
        geometry: engram::Geometry {
            d: 8,
            hc: 1,
            hd: 32,
            eps: 1e-6,
        },
        tables: h.tables.as_input(),
        limits: engram::Limits {
            max_tokens: tk.len(),
            max_seqs: 1,
            max_positions: tk.len(),
        },
        n_threads: 1,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    };
    let one = engram::Context::new(&cfg).unwrap();
    let n = tk.len();
    let mut out = vec![0i64; n * 48];
    let pos: Vec<i32> = (0..n as i32).collect();
    one.hash(&tk, &vec![0; n], &pos, &mut out).unwrap();
    assert_eq!(got.ids, out.iter().map(|&v| v as u32).collect::<Vec<_>>());
}

/// Accesses of one layer from hand-written steps (each step's ids sorted
/// and distinct, as `accesses` makes them).
fn hand(steps: &[&[u32]]) -> Accesses {
    Accesses {
        shape: Shape { layers: 1, cols: 1 },
        tokens: steps.len() as u64,
        steps: steps.len() as u64,
        ids: steps.iter().flat_map(|s| s.iter().copied()).collect(),
        lens: steps.iter().map(|s| s.len() as u32).collect(),
        lookups: vec![steps.iter().map(|s| s.len() as u64).sum()],
        distinct: vec![steps.iter().map(|s| s.len() as u64).sum()],
    }
}

/// The library's LRU of 3 rows over steps [1 2 3] [1 4] [2 5] [1 3]: 1 hits
/// (held: 1 3 2, most recent first), 4 evicts 2, 2 misses and evicts 3, 5
/// evicts 1, 1 misses and evicts 4, 3 misses: 1 hit of 9. Rows of 264
/// bytes: each miss's blocks by hand (row 1: bytes 264..527, blocks 0-1;
/// row 2: 528..791, 1; row 3: 792..1055, 1-2; 4: 1056..1319, 2; 5:
/// 1320..1583, 2-3), a block shared inside a step read once: step 1 reads
/// blocks 0,1,2 (3); step 2 row 4: block 2 (1); step 3 rows 2, 5: 1, 2, 3
/// (3); step 4 rows 1, 3: 0, 1, 2 (3). 10 blocks.
#[test]
fn lru_and_blocks_match_a_hand_count() {
    let acc = hand(&[&[1, 2, 3], &[1, 4], &[2, 5], &[1, 3]]);
    let lay = Layout {
        row_bytes: 264,
        rows: vec![100],
    };
    let mut pols: Vec<Box<dyn RowPolicy>> =
        vec![Box::new(Library(new_policy(PolicyKind::Lru, 3).unwrap()))];
    let c = replay_cache(&acc, &lay, &mut pols);
    assert_eq!((c.hits[0], c.misses[0], c.blocks[0]), (1, 8, 10));
    let mut own: Vec<Box<dyn RowPolicy>> = vec![Box::new(crate::lru::Lru::new(3))];
    let d = replay_cache(&acc, &lay, &mut own);
    assert_eq!((d.hits, d.misses, d.blocks), (c.hits, c.misses, c.blocks));
}

/// Rows of 264 bytes: row 15 spans pages 0-1 (3960..4223), row 16 page 1,
/// row 31 pages 1-2 (8184..8447), row 40 page 2, row 0 page 0. A page cache
/// of 2 pages over steps [15] [16] [31] [0] [40]: 0 1 miss; 1 hits; 1 hits, 2
/// misses and evicts 0; 0 misses and evicts 1; 2 hits. 4 faults of 7
/// touches. With a readahead of 4 pages (the window centred on the fault:
/// pages p-2..p+1, clipped to the file's 10 pages) and a cache of 8: page
/// 0 reads 0-3 (4 pages), then every page hits: 4 reads, 1 fault.
#[test]
fn page_cache_matches_a_hand_count() {
    let acc = hand(&[&[15], &[16], &[31], &[0], &[40]]);
    let lay = Layout {
        row_bytes: 264,
        rows: vec![150],
    };
    let c = replay_pages(&acc, &lay, 2, 1);
    assert_eq!((c.touches[0], c.faults[0], c.reads[0]), (7, 4, 4));
    let r = replay_pages(&acc, &lay, 8, 4);
    assert_eq!((r.touches[0], r.faults[0], r.reads[0]), (7, 1, 4));
}

#[test]
fn schedules_visit_every_token_once() {
    let t = |n: usize| TextIds {
        tokens: n,
        ids: vec![0; n * 2],
    };
    let texts = [t(5), t(0), t(3), t(9)];
    for sched in [
        Schedule::Stream,
        Schedule::Mix(2),
        Schedule::Mix(8),
        Schedule::Prefill(4),
    ] {
        let mut seen = Vec::new();
        let mut steps = 0;
        crate::stream::for_each_step(&texts, sched, |s| {
            steps += 1;
            seen.extend_from_slice(s);
        });
        seen.sort_unstable();
        let want: Vec<(u32, u32)> = texts
            .iter()
            .enumerate()
            .flat_map(|(i, x)| (0..x.tokens as u32).map(move |k| (i as u32, k)))
            .collect();
        assert_eq!(seen, want, "{sched:?}");
        let want_steps = match sched {
            Schedule::Stream => 17,
            // Two slots: texts 0 and 2 (5 and 3 tokens), 3 joins at step 4.
            Schedule::Mix(2) => 12,
            Schedule::Mix(_) => 9,
            Schedule::Prefill(_) => 2 + 1 + 3,
        };
        assert_eq!(steps, want_steps, "{sched:?}");
    }
}
