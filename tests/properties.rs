//! Property tests of the hash over many seeded random cases: a sequence hashed
//! in one call equals the same sequence hashed in any split; batch order does
//! not matter; rollback then re-hash equals the straight run; a failing call
//! changes nothing.

mod common;

use common::*;

/// A small deterministic generator for the cases (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(1);
        mix64(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// A token id, dead now and then (the map's -1 entries and the explicit marker).
    fn token(&mut self, vocab: usize) -> i32 {
        if self.below(16) == 0 {
            -1
        } else {
            self.below(vocab) as i32
        }
    }
}

fn straight(tiny: &Tiny, tokens: &[i32]) -> Vec<i64> {
    let ctx = tiny.context();
    let n = tokens.len();
    let mut out = vec![0i64; n * ctx.ids_per_token()];
    let pos: Vec<i32> = (0..n as i32).collect();
    ctx.hash(tokens, &vec![0; n], &pos, &mut out).unwrap();
    out
}

#[test]
fn any_split_equals_one_call() {
    let tiny = Tiny::load();
    let vocab = tiny.token_map.len();
    let mut rng = Rng(1);
    for case in 0..200 {
        let n = 1 + rng.below(40);
        let tokens: Vec<i32> = (0..n).map(|_| rng.token(vocab)).collect();
        let want = straight(&tiny, &tokens);
        let ctx = tiny.context();
        let per = ctx.ids_per_token();
        let mut got = Vec::new();
        let mut p = 0;
        while p < n {
            let len = 1 + rng.below(n - p);
            let pos: Vec<i32> = (p as i32..(p + len) as i32).collect();
            let mut out = vec![0i64; len * per];
            ctx.hash(&tokens[p..p + len], &vec![0; len], &pos, &mut out)
                .unwrap();
            got.extend(out);
            p += len;
        }
        assert_eq!(got, want, "case {case}: {tokens:?}");
    }
}

#[test]
fn interleaved_and_shuffled_batches_equal_separate_runs() {
    let tiny = Tiny::load();
    let vocab = tiny.token_map.len();
    let mut rng = Rng(2);
    for case in 0..100 {
        // Up to 4 sequences of random lengths, all tokens in one shuffled batch.
        let nseq = 1 + rng.below(4);
        let seqs: Vec<Vec<i32>> = (0..nseq)
            .map(|_| (0..1 + rng.below(12)).map(|_| rng.token(vocab)).collect())
            .collect();
        let mut batch: Vec<(i32, i32, i32)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(s, t)| {
                t.iter()
                    .enumerate()
                    .map(move |(p, &x)| (s as i32, p as i32, x))
            })
            .collect();
        for i in (1..batch.len()).rev() {
            batch.swap(i, rng.below(i + 1));
        }
        let ctx = tiny.context();
        let per = ctx.ids_per_token();
        let tokens: Vec<i32> = batch.iter().map(|b| b.2).collect();
        let seq_ids: Vec<i32> = batch.iter().map(|b| b.0).collect();
        let pos: Vec<i32> = batch.iter().map(|b| b.1).collect();
        let mut out = vec![0i64; batch.len() * per];
        ctx.hash(&tokens, &seq_ids, &pos, &mut out).unwrap();
        let alone: Vec<Vec<i64>> = seqs.iter().map(|t| straight(&tiny, t)).collect();
        for (i, &(s, p, _)) in batch.iter().enumerate() {
            let w = &alone[s as usize][p as usize * per..(p as usize + 1) * per];
            assert_eq!(
                &out[i * per..(i + 1) * per],
                w,
                "case {case} seq {s} pos {p}"
            );
        }
    }
}

#[test]
fn rollback_then_rehash_equals_straight() {
    let tiny = Tiny::load();
    let vocab = tiny.token_map.len();
    let mut rng = Rng(3);
    for case in 0..200 {
        let n = 2 + rng.below(30);
        let tokens: Vec<i32> = (0..n).map(|_| rng.token(vocab)).collect();
        let want = straight(&tiny, &tokens);
        let ctx = tiny.context();
        let per = ctx.ids_per_token();
        // Accept a prefix, then a draft that goes wrong from `cut` on ...
        let cut = 1 + rng.below(n - 1);
        let draft = cut + 1 + rng.below(n - cut);
        let pos: Vec<i32> = (0..draft as i32).collect();
        let mut t: Vec<i32> = tokens[..draft].to_vec();
        for x in &mut t[cut..] {
            *x = rng.token(vocab);
        }
        let mut out = vec![0i64; draft * per];
        ctx.hash(&t, &vec![0; draft], &pos, &mut out).unwrap();
        // ... then roll back to `cut` by re-hashing the true tokens from there.
        let pos: Vec<i32> = (cut as i32..n as i32).collect();
        let mut out = vec![0i64; (n - cut) * per];
        ctx.hash(&tokens[cut..], &vec![0; n - cut], &pos, &mut out)
            .unwrap();
        assert_eq!(out[..], want[cut * per..], "case {case}");
    }
}

#[test]
fn a_failing_hash_changes_nothing() {
    let tiny = Tiny::load();
    let ctx = tiny.context();
    let per = ctx.ids_per_token();
    let mut out = vec![0i64; 3 * per];
    ctx.hash(&[1, 2, 3], &[0, 0, 0], &[0, 1, 2], &mut out)
        .unwrap();
    // A batch whose last token is bad: its first two tokens are not recorded.
    let mut bad = vec![7i64; 3 * per];
    let e = ctx
        .hash(&[4, 6, 99], &[0, 0, 0], &[3, 4, 5], &mut bad)
        .unwrap_err();
    assert_eq!(e.status, engram::EngramStatus::ErrInvalidToken);
    assert!(bad.iter().all(|&x| x == 7), "output untouched");
    assert_eq!(ctx.seq_len(0).unwrap(), 3, "history untouched");
    // A look-back to a position never written names the sequence and position.
    let e = ctx.hash(&[4], &[1], &[5], &mut bad[..per]).unwrap_err();
    assert_eq!(e.status, engram::EngramStatus::ErrMissingHistory);
    assert!(
        e.message.contains("sequence 1") && e.message.contains("position 4"),
        "{}",
        e.message
    );
    // The history continues exactly as if the bad calls never happened.
    let mut next = vec![0i64; per];
    ctx.hash(&[4], &[0], &[3], &mut next).unwrap();
    assert_eq!(next[..], straight(&tiny, &[1, 2, 3, 4])[3 * per..]);
}

#[test]
fn copy_and_drop_sequences() {
    let tiny = Tiny::load();
    let ctx = tiny.context();
    let per = ctx.ids_per_token();
    let mut out = vec![0i64; 4 * per];
    ctx.hash(&[1, 2, 3, 4], &[0; 4], &[0, 1, 2, 3], &mut out)
        .unwrap();
    ctx.seq_copy(0, 2).unwrap();
    let mut a = vec![0i64; per];
    ctx.hash(&[9], &[2], &[4], &mut a).unwrap();
    assert_eq!(
        a[..],
        straight(&tiny, &[1, 2, 3, 4, 9])[4 * per..],
        "fork continues the copied history"
    );
    ctx.seq_drop(2).unwrap();
    assert_eq!(ctx.seq_len(2).unwrap(), 0);
    let e = ctx.hash(&[9], &[2], &[4], &mut a).unwrap_err();
    assert_eq!(e.status, engram::EngramStatus::ErrMissingHistory);
    assert!(ctx.seq_copy(0, 99).is_err() && ctx.seq_drop(-1).is_err());
}

#[test]
fn memory_counts_the_tables_and_the_hash_scratch() {
    // The formulas of docs/memory.md: the copied tables, and the hash's working
    // buffers kept after a call (60 + 8 * N bytes per token of the largest
    // call) on top of the history page the call wrote.
    let tiny = Tiny::load();
    let ctx = engram::Context::new(&tiny.config(Tiny::limits())).unwrap();
    let (nl, n, c) = (tiny.layer_ids.len(), tiny.ngram, tiny.cols());
    let inv = if tiny.primes.iter().all(|&p| p >= 1 << 14) {
        8
    } else {
        0
    };
    let tables = 4 * tiny.token_map.len() + nl * (12 + 8 * n + (16 + inv) * c);
    let base = ctx.memory_bytes();
    assert!(base >= tables, "{base} bytes, below the tables' {tables}");
    let vocab = tiny.token_map.len() as i32;
    let tokens: Vec<i32> = (0..vocab)
        .filter(|&t| tiny.token_map[t as usize] >= 0)
        .take(40)
        .collect();
    let k = tokens.len();
    let mut out = vec![0i64; k * ctx.ids_per_token()];
    ctx.hash(
        &tokens,
        &vec![0; k],
        &(0..k as i32).collect::<Vec<_>>(),
        &mut out,
    )
    .unwrap();
    let grown = ctx.memory_bytes() - base;
    let page = 4096 * 4;
    let scratch = k * (60 + 8 * n);
    assert!(
        grown >= page + scratch && grown < page + 2 * scratch + 4096,
        "hashing {k} tokens grew the memory by {grown} bytes, not a page ({page}) and the scratch ({scratch})"
    );
}

#[test]
fn history_memory_follows_the_positions_written() {
    // A dead token needs no look-back, so it may sit far out; it must cost a
    // page, not a history filled up to its position.
    let tiny = Tiny::load();
    let mut cfg = tiny.config(Tiny::limits());
    cfg.limits.max_positions = i32::MAX as usize;
    let ctx = engram::Context::new(&cfg).unwrap();
    let before = ctx.memory_bytes();
    let per = ctx.ids_per_token();
    let mut out = vec![0i64; 2 * per];
    let p = 1 << 30;
    ctx.hash(&[-1, 4], &[0, 0], &[p, p + 1], &mut out).unwrap();
    assert!(out[..per].iter().all(|&r| r == -1));
    let grown = ctx.memory_bytes() - before;
    assert!(
        grown < 8 << 20,
        "history grew by {grown} bytes for two positions"
    );
    assert_eq!(ctx.seq_len(0).unwrap(), p as usize + 2);
}
