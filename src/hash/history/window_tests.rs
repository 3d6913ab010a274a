use super::*;
use crate::hash::{derive_offsets, derive_primes_uniform, HashTablesIn, TOKEN_DEAD};

/// A batch of consecutive positions (whose windows are the previous
/// token's, shifted) gives the ids of the same tokens hashed one call at a
/// time (windows read from the history), with dead tokens (explicit, and
/// mapped to -1) blocking the look-back, runs starting mid-sequence, and
/// two sequences interleaved.
#[test]
fn shifted_windows_equal_history_windows() {
    let primes = derive_primes_uniform(2, 4, 8, 20_000).unwrap();
    let offsets = derive_offsets(&primes, 24);
    let map: Vec<i32> = (0..50)
        .map(|i| if i % 7 == 3 { -1 } else { i * 3 })
        .collect();
    let t = HashTables::new(&HashTablesIn {
        layer_ids: &[1, 2],
        max_ngram: 4,
        n_heads: 8,
        token_map: &map,
        pad_id: 5,
        multipliers: &[3, 5, 7, 9, 11, 13, 15, 17],
        primes: &primes,
        offsets: &offsets,
    })
    .unwrap();
    let limits = Limits {
        max_tokens: 600,
        max_seqs: 2,
        max_positions: 1000,
    };
    let row = t.n_layers() * t.cols();
    let mut z = 9u64;
    let mut next = move || {
        z = z
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (z >> 33) as i32
    };
    for round in 0..20 {
        // Sequence 0: positions 0..a in one call, then a..300 in a second;
        // sequence 1: 0..300 interleaved in the second call.
        let a = 1 + (next() % 200) as usize;
        let tok = |next: &mut dyn FnMut() -> i32| {
            let r = next() % 60;
            if r >= 50 {
                TOKEN_DEAD
            } else {
                r
            }
        };
        let toks0: Vec<i32> = (0..300).map(|_| tok(&mut next)).collect();
        let toks1: Vec<i32> = (0..300).map(|_| tok(&mut next)).collect();
        let mut batched = History::new(limits).unwrap();
        let mut out = vec![0i64; a * row];
        let pos: Vec<i32> = (0..a as i32).collect();
        batched
            .hash(&t, &toks0[..a], &vec![0; a], &pos, &mut out)
            .unwrap();
        let mut got0 = out.clone();
        // The rest of sequence 0 and all of sequence 1, in runs of 1..8
        // tokens alternating between the two.
        let (mut i0, mut i1) = (a, 0usize);
        let (mut tokens, mut seqs, mut poss) = (vec![], vec![], vec![]);
        while i0 < 300 || i1 < 300 {
            let run = 1 + (next() % 8) as usize;
            for _ in 0..run {
                if i0 < 300 {
                    tokens.push(toks0[i0]);
                    seqs.push(0);
                    poss.push(i0 as i32);
                    i0 += 1;
                }
            }
            for _ in 0..run {
                if i1 < 300 {
                    tokens.push(toks1[i1]);
                    seqs.push(1);
                    poss.push(i1 as i32);
                    i1 += 1;
                }
            }
        }
        let mut out = vec![0i64; tokens.len() * row];
        batched.hash(&t, &tokens, &seqs, &poss, &mut out).unwrap();
        let mut got1 = vec![];
        for (j, s) in seqs.iter().enumerate() {
            let ids = &out[j * row..(j + 1) * row];
            if *s == 0 {
                got0.extend_from_slice(ids);
            } else {
                got1.extend_from_slice(ids);
            }
        }
        // One token a call.
        let mut single = History::new(limits).unwrap();
        let mut one = vec![0i64; row];
        for (s, toks, got) in [(0, &toks0, &got0), (1, &toks1, &got1)] {
            for (p, &tk) in toks.iter().enumerate() {
                single.hash(&t, &[tk], &[s], &[p as i32], &mut one).unwrap();
                assert_eq!(
                    one[..],
                    got[p * row..(p + 1) * row],
                    "round {round}: sequence {s} position {p}"
                );
            }
        }
    }
}
