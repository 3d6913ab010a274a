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
