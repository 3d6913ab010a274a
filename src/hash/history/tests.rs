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

/// `run_end` (eight tokens at a time, then one) ends every run where the
/// token-by-token rule does: a different sequence, a position that is not
/// the next, or the limit, at any offset inside a group of eight.
#[test]
fn run_end_equals_the_token_by_token_rule() {
    let mut z = 11u64;
    let mut next = move |n: u64| {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (z >> 33) % n
    };
    for _ in 0..2000 {
        let n = 1 + next(40) as usize;
        let (mut seq_ids, mut pos) = (vec![0i32; n], vec![0i32; n]);
        for k in 0..n {
            // Mostly continuing, now and then another sequence or a jump.
            let (sq, p) = if k == 0 {
                (0, next(100) as i32)
            } else {
                (seq_ids[k - 1], pos[k - 1] + 1)
            };
            (seq_ids[k], pos[k]) = match next(12) {
                0 => (sq + 1, p),
                1 => (sq, p + 1),
                2 => (sq, p - 2),
                _ => (sq, p),
            };
        }
        let i = next(n as u64) as usize;
        let limit = i + 1 + next((n - i) as u64) as usize;
        let mut want = i + 1;
        while want < limit && seq_ids[want] == seq_ids[i] && pos[want] == pos[want - 1] + 1 {
            want += 1;
        }
        assert_eq!(
            run_end(&seq_ids, &pos, i, limit),
            want,
            "{seq_ids:?} {pos:?} from {i} to {limit}"
        );
    }
}
