use super::*;
use crate::hash::{derive_offsets, derive_primes_uniform, HashTablesIn};

fn tables() -> HashTables {
    let primes = derive_primes_uniform(1, 3, 8, 20_000).unwrap();
    let offsets = derive_offsets(&primes, 16);
    let map: Vec<i32> = (0..100).collect();
    HashTables::new(&HashTablesIn {
        layer_ids: &[3],
        max_ngram: 3,
        n_heads: 8,
        token_map: &map,
        pad_id: 0,
        multipliers: &[3, 5, 7],
        primes: &primes,
        offsets: &offsets,
    })
    .unwrap()
}

/// A failing call leaves the history's memory as it found it: the pages
/// (and page-table growth) it reserved before reaching the bad token are
/// released, over many failed calls and over one call across thousands of
/// sequences, whichever check fails.
#[test]
fn failed_calls_release_what_they_reserved() {
    let t = tables();
    let seqs = 4096;
    let mut h = History::new(Limits {
        max_tokens: seqs + 1,
        max_seqs: seqs,
        max_positions: 1 << 24,
    })
    .unwrap();
    let row = t.n_layers() * t.cols();
    // Some history to keep: sequence 0 has positions 0..10.
    let mut out = vec![0i64; 10 * row];
    let toks: Vec<i32> = (0..10).collect();
    h.hash(&t, &toks, &[0; 10], &toks, &mut out).unwrap();
    let before = h.bytes();
    let mut out = vec![0i64; (seqs + 1) * row];
    // One call over every sequence, far out (a dead token needs no
    // look-back, so each claims a fresh page and page-table entries),
    // failing at its last token.
    let far = 64 * PAGE as i32;
    for bad in 0..4 {
        let mut tokens = vec![crate::hash::TOKEN_DEAD; seqs + 1];
        let mut seq_ids: Vec<i32> = (0..seqs as i32).collect();
        seq_ids.push(0);
        let mut pos: Vec<i32> = (0..seqs as i32).map(|s| far + s).collect();
        pos.push(far + 7);
        match bad {
            0 => tokens[seqs] = 1000,       // outside token_map
            1 => seq_ids[seqs] = -2,        // no such sequence
            2 => pos[seqs] = 1 << 25,       // past max_positions
            _ => pos[seqs] = pos[seqs - 1], // a position twice
        }
        // The dead tokens and the bad one: sequence 0 sees two tokens.
        if bad == 3 {
            seq_ids[seqs] = seq_ids[seqs - 1];
        }
        assert!(h.hash(&t, &tokens, &seq_ids, &pos, &mut out).is_err());
        assert_eq!(
            h.bytes(),
            before,
            "case {bad}: memory kept by a failed call"
        );
    }
    // Many failed calls on one sequence, each reaching further out, the
    // last token needing history that was never written.
    let mut out = vec![0i64; 2 * row];
    for i in 0..64 {
        let p = (i + 2) * 8 * PAGE as i32;
        let r = h.hash(
            &t,
            &[crate::hash::TOKEN_DEAD, 5],
            &[1, 1],
            &[p, p + 9],
            &mut out,
        );
        assert_eq!(
            r.unwrap_err().status,
            crate::EngramStatus::ErrMissingHistory
        );
        assert_eq!(h.bytes(), before, "call {i}: memory kept by a failed call");
    }
    // What was there is untouched, and a good call still works.
    assert_eq!(h.len(0), 10);
    let mut out = vec![0i64; row];
    h.hash(&t, &[4], &[0], &[10], &mut out).unwrap();
    assert_eq!(h.len(0), 11);
}
