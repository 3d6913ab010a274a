use super::*;
use crate::hash::{derive_offsets, derive_primes_uniform, HashTablesIn};
use crate::EngramStatus;

/// A bad token inside a run of consecutive positions (claimed by the fast
/// path) fails the call with the message the general path gives, naming
/// that token, and leaves the history as it was: its bytes, and the ids a
/// later good call gets, equal those of a history that never saw the call.
#[test]
fn a_bad_token_inside_a_run_changes_nothing() {
    let primes = derive_primes_uniform(1, 3, 4, 20_000).unwrap();
    let offsets = derive_offsets(&primes, 8);
    let map: Vec<i32> = (0..100).collect();
    let t = HashTables::new(&HashTablesIn {
        layer_ids: &[3],
        max_ngram: 3,
        n_heads: 4,
        token_map: &map,
        pad_id: 0,
        multipliers: &[3, 5, 7],
        primes: &primes,
        offsets: &offsets,
    })
    .unwrap();
    let limits = Limits {
        max_tokens: 5000,
        max_seqs: 2,
        max_positions: 4098,
    };
    let row = t.cols();
    let prefix: Vec<i32> = (0..4090).map(|i| i % 97).collect();
    let ppos: Vec<i32> = (0..4090).collect();
    let mut out = vec![0i64; 4090 * row];
    let mut h = History::new(limits).unwrap();
    let mut fresh = History::new(limits).unwrap();
    for hist in [&mut h, &mut fresh] {
        hist.hash(&t, &prefix, &vec![0; 4090], &ppos, &mut out)
            .unwrap();
    }
    let run: Vec<i32> = (4090..4100).collect();
    let toks = vec![5i32; 10];
    let cases: Vec<(Vec<i32>, Vec<i32>, EngramStatus, &str)> = vec![
        // A token the map refuses, mid-run (past the page edge at 4096).
        (
            {
                let mut t = toks[..8].to_vec();
                t[7] = 1000;
                t
            },
            run[..8].to_vec(),
            EngramStatus::ErrInvalidToken,
            "token 7:",
        ),
        // The run passes max_positions (4098) at its 9th token.
        (
            toks.clone(),
            run.clone(),
            EngramStatus::ErrInvalidSequence,
            "token 8:",
        ),
        // A position claimed twice: 4090..4096 then 4093 again.
        (
            toks[..8].to_vec(),
            vec![4090, 4091, 4092, 4093, 4094, 4095, 4093, 4094],
            EngramStatus::ErrInvalidSequence,
            "tokens 3 and 6:",
        ),
    ];
    for (tokens, pos, status, msg) in cases {
        let n = tokens.len();
        let mut out = vec![0i64; n * row];
        let e = h
            .hash(&t, &tokens, &vec![0; n], &pos, &mut out)
            .unwrap_err();
        assert_eq!(e.status, status, "{}", e.message);
        assert!(e.message.starts_with(msg), "{}", e.message);
        assert_eq!(h.bytes(), fresh.bytes());
        assert_eq!(h.len(0), 4090);
    }
    let (mut a, mut b) = (vec![0i64; 8 * row], vec![0i64; 8 * row]);
    h.hash(&t, &toks[..8], &[0; 8], &run[..8], &mut a).unwrap();
    fresh
        .hash(&t, &toks[..8], &[0; 8], &run[..8], &mut b)
        .unwrap();
    assert_eq!(a, b);
}

/// The tables of [`a_bad_token_inside_a_decode_step_changes_nothing`]: 2
/// layers, `N = 4`, 8 heads, 100 tokens.
fn decode_step_tables() -> HashTables {
    let primes = derive_primes_uniform(2, 4, 8, 20_000).unwrap();
    let offsets = derive_offsets(&primes, 24);
    let map: Vec<i32> = (0..100).collect();
    HashTables::new(&HashTablesIn {
        layer_ids: &[3, 5],
        max_ngram: 4,
        n_heads: 8,
        token_map: &map,
        pad_id: 0,
        multipliers: &[3, 5, 7, 9, 11, 13, 15, 17],
        primes: &primes,
        offsets: &offsets,
    })
    .unwrap()
}

/// A decode step (sequences 0..4 at position 10) made bad at token 2 in
/// one of five ways (`bad % 5`), with token 0 dead far out (a page the step
/// allocates) when `bad >= 5`: its tokens, sequences and positions, and
/// the status and message the call must return.
fn bad_decode_step(bad: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>, EngramStatus, String) {
    let (mut tk, mut sq, mut ps) = (vec![1, 2, 3, 4], vec![0, 1, 2, 3], vec![10; 4]);
    let (status, msg) = match bad % 5 {
        0 => {
            tk[2] = 1000;
            (
                EngramStatus::ErrInvalidToken,
                "token 2: id 1000 is outside token_map [0, 100) (use -1 to mark a dead position)",
            )
        }
        1 => {
            sq[2] = 9;
            (
                EngramStatus::ErrInvalidSequence,
                "token 2: sequence id 9 outside [0, max_seqs = 4)",
            )
        }
        2 => {
            ps[2] = 10_000;
            (
                EngramStatus::ErrInvalidSequence,
                "token 2: position 10000 outside [0, max_positions = 10000)",
            )
        }
        3 => {
            sq[2] = 1;
            (
                EngramStatus::ErrInvalidSequence,
                "tokens 1 and 2: sequence 1 position 10 appears twice in one batch",
            )
        }
        _ => {
            ps[2] = 50;
            (
                EngramStatus::ErrMissingHistory,
                "token 2: sequence 2 position 50 looks back to position 49, which was never hashed",
            )
        }
    };
    if bad >= 5 {
        // Token 0 dead, far out: the step allocates its page.
        tk[0] = crate::hash::TOKEN_DEAD;
        ps[0] = 9000;
    }
    (tk, sq, ps, status, msg.to_string())
}

/// A decode step (one token for each of several sequences, the shape
/// `History::step` takes in one pass) that fails at one token reports it as
/// the general checks word it, and leaves the history as it was: its bytes
/// (a page the step allocated for an earlier token is freed), its lengths,
/// and the ids a later good step gets equal those of a history that never
/// saw the failing step.
#[test]
fn a_bad_token_inside_a_decode_step_changes_nothing() {
    let t = decode_step_tables();
    let limits = Limits {
        max_tokens: 64,
        max_seqs: 4,
        max_positions: 10_000,
    };
    let row = t.n_layers() * t.cols();
    let (mut h, mut fresh) = (History::new(limits).unwrap(), History::new(limits).unwrap());
    // Sequences 0..4 at positions 0..10.
    for hist in [&mut h, &mut fresh] {
        for s in 0..4 {
            let toks: Vec<i32> = (0..10).map(|p| (p * 7 + s * 3) % 100).collect();
            let pos: Vec<i32> = (0..10).collect();
            let mut out = vec![0i64; 10 * row];
            hist.hash(&t, &toks, &[s; 10], &pos, &mut out).unwrap();
        }
    }
    for bad in 0..10 {
        let (tk, sq, ps, status, msg) = bad_decode_step(bad);
        let mut out = vec![7i64; 4 * row];
        let e = h.hash(&t, &tk, &sq, &ps, &mut out).unwrap_err();
        assert_eq!(
            (e.status, e.message.as_str()),
            (status, msg.as_str()),
            "case {bad}"
        );
        assert!(out.iter().all(|&r| r == 7), "case {bad}: out written");
        assert_eq!(h.bytes(), fresh.bytes(), "case {bad}");
        for s in 0..4 {
            assert_eq!(h.len(s), 10, "case {bad}: sequence {s}");
            assert_eq!(
                h.entries(s).unwrap(),
                fresh.entries(s).unwrap(),
                "case {bad}"
            );
        }
    }
    let (mut a, mut b) = (vec![0i64; 4 * row], vec![0i64; 4 * row]);
    let (tk, sq, ps) = (vec![1, 2, 3, 4], vec![0, 1, 2, 3], vec![10; 4]);
    h.hash(&t, &tk, &sq, &ps, &mut a).unwrap();
    fresh.hash(&t, &tk, &sq, &ps, &mut b).unwrap();
    assert_eq!(a, b);
}
