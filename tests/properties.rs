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
    // buffers kept after a call (80 + 8 * N bytes per token of the largest
    // call, and a bit per sequence) on top of the history page the call
    // wrote.
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
    let scratch = k * (80 + 8 * n) + 8 * Tiny::limits().max_seqs.div_ceil(64);
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

/// The history of each sequence as the engine meant it: position -> raw token.
type Model = Vec<std::collections::BTreeMap<usize, i32>>;

/// A context without weights (the hash needs none) on one thread.
fn hash_context(tiny: &Tiny, max_seqs: usize, max_positions: usize) -> engram::Context<'_> {
    let mut cfg = tiny.config(engram::batch::Limits {
        max_tokens: 64,
        max_seqs,
        max_positions,
    });
    cfg.n_threads = 1;
    engram::Context::new(&cfg).unwrap()
}

fn compressed(tiny: &Tiny, t: i32) -> i32 {
    if t < 0 {
        -1
    } else {
        tiny.token_map[t as usize]
    }
}

/// The row ids of `tok` at position `q` of a sequence whose history is `m`,
/// from a fresh context fed that history in order: the look-back window
/// (oldest first, ending where the sequence starts, at a dead token or after
/// `N - 1` tokens) then `tok`, in one batch. `None`: the window reaches a
/// position never hashed (`ERR_MISSING_HISTORY`).
fn fresh_ids(
    tiny: &Tiny,
    m: &std::collections::BTreeMap<usize, i32>,
    q: usize,
    tok: i32,
) -> Option<Vec<i64>> {
    let mut window = Vec::new();
    if compressed(tiny, tok) != -1 {
        for j in 1..tiny.ngram {
            if j > q {
                break;
            }
            let &t = m.get(&(q - j))?;
            window.push(t);
            if compressed(tiny, t) == -1 {
                break;
            }
        }
    }
    window.reverse();
    window.push(tok);
    let n = window.len();
    let ctx = hash_context(tiny, 1, 64);
    let per = ctx.ids_per_token();
    let mut out = vec![0i64; n * per];
    let pos: Vec<i32> = (0..n as i32).collect();
    ctx.hash(&window, &vec![0; n], &pos, &mut out).unwrap();
    Some(out[(n - 1) * per..].to_vec())
}

/// llama.cpp's range conventions: `p0 < 0` is 0, `p1 < 0` the end; `None`
/// for a range the history refuses.
fn model_range(p0: i32, p1: i32, max: usize) -> Option<(usize, usize)> {
    let lo = p0.max(0) as usize;
    let hi = if p1 < 0 { max } else { p1 as usize };
    (lo <= max && hi <= max && lo <= hi).then_some((lo, hi))
}

#[test]
fn history_operations_equal_a_fresh_context_fed_the_resulting_history() {
    use engram::EngramStatus as S;
    use std::collections::BTreeMap;
    let tiny = Tiny::load();
    let vocab = tiny.token_map.len();
    let (max_seqs, max_pos) = (3usize, 40usize);
    let mut rng = Rng(23);
    let mut mix: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    let mut count = |name: &'static str, ok: bool| {
        let e = mix.entry(name).or_default();
        if ok {
            e.0 += 1;
        } else {
            e.1 += 1;
        }
    };
    for case in 0..150 {
        let ctx = hash_context(&tiny, max_seqs, max_pos);
        let per = ctx.ids_per_token();
        let mut model: Model = vec![BTreeMap::new(); max_seqs];
        let mut log: Vec<String> = Vec::new();
        for step in 0..60 {
            // A sequence id, now and then a bad one.
            let seq = |rng: &mut Rng| -> i32 {
                match rng.below(20) {
                    0 => max_seqs as i32,
                    1 => -2,
                    _ => rng.below(max_seqs) as i32,
                }
            };
            // A range: to the end now and then, else mostly in order and
            // inside [0, max_positions], sometimes not.
            let range = |rng: &mut Rng| -> (i32, i32) {
                let p0 = rng.below(max_pos + 6) as i32 - 3;
                let lo = p0.clamp(0, max_pos as i32);
                let p1 = match rng.below(8) {
                    0 | 1 => -1,
                    2 => rng.below(max_pos + 3) as i32,
                    _ => lo + rng.below(max_pos + 1 - lo as usize) as i32,
                };
                (p0, p1)
            };
            let valid = |s: i32| (0..max_seqs as i32).contains(&s);
            let before: Model = model.clone();
            let op = rng.below(100);
            let what;
            let result: engram::Result<()>;
            let mut expect: Result<(), engram::EngramStatus> = Ok(());
            if op < 35 {
                // Hash a batch at consecutive positions of one sequence: most
                // often the next ones, else anywhere.
                let s = rng.below(max_seqs);
                let len = model[s].keys().next_back().map_or(0, |&p| p + 1);
                let q = if rng.below(3) > 0 && len < max_pos {
                    len
                } else {
                    rng.below(max_pos)
                };
                let k = 1 + rng.below((max_pos - q).min(6));
                let toks: Vec<i32> = (0..k).map(|_| rng.token(vocab)).collect();
                let mut m = model[s].clone();
                let mut want = Vec::new();
                let mut missing = false;
                for (j, &t) in toks.iter().enumerate() {
                    match fresh_ids(&tiny, &m, q + j, t) {
                        Some(ids) => want.extend(ids),
                        None => missing = true,
                    }
                    m.insert(q + j, t);
                }
                let mut out = vec![0i64; k * per];
                let p: Vec<i32> = (q as i32..(q + k) as i32).collect();
                result = ctx.hash(&toks, &vec![s as i32; k], &p, &mut out);
                what = format!("hash seq {s} at {q}: {toks:?}");
                if missing {
                    expect = Err(S::ErrMissingHistory);
                } else {
                    model[s] = m;
                    if result.is_ok() {
                        assert_eq!(out, want, "case {case} step {step}: {what}\n{log:#?}");
                    }
                }
                count("hash", !missing);
            } else if op < 50 {
                let s = if rng.below(8) == 0 { -1 } else { seq(&mut rng) };
                let (p0, p1) = range(&mut rng);
                result = ctx.seq_rm(s, p0, p1);
                what = format!("seq_rm({s}, {p0}, {p1})");
                match model_range(p0, p1, max_pos) {
                    Some((lo, hi)) if s == -1 || valid(s) => {
                        for (i, m) in model.iter_mut().enumerate() {
                            if s == -1 || s == i as i32 {
                                m.retain(|&p, _| !(lo..hi).contains(&p));
                            }
                        }
                    }
                    _ => expect = Err(S::ErrInvalidSequence),
                }
                count("seq_rm", expect.is_ok());
            } else if op < 60 {
                let (a, b) = (seq(&mut rng), seq(&mut rng));
                let (p0, p1) = range(&mut rng);
                result = ctx.seq_cp(a, b, p0, p1);
                what = format!("seq_cp({a}, {b}, {p0}, {p1})");
                match model_range(p0, p1, max_pos) {
                    Some((lo, hi)) if valid(a) && valid(b) => {
                        let src: Vec<(usize, i32)> = model[a as usize]
                            .range(lo..hi)
                            .map(|(&p, &t)| (p, t))
                            .collect();
                        let d = &mut model[b as usize];
                        d.retain(|&p, _| !(lo..hi).contains(&p));
                        d.extend(src);
                    }
                    _ => expect = Err(S::ErrInvalidSequence),
                }
                count("seq_cp", expect.is_ok());
            } else if op < 63 {
                let s = seq(&mut rng);
                result = ctx.seq_keep(s);
                what = format!("seq_keep({s})");
                if valid(s) {
                    for (i, m) in model.iter_mut().enumerate() {
                        if i as i32 != s {
                            m.clear();
                        }
                    }
                } else {
                    expect = Err(S::ErrInvalidSequence);
                }
                count("seq_keep", expect.is_ok());
            } else if op < 80 {
                let s = seq(&mut rng);
                let (p0, p1) = range(&mut rng);
                let delta = rng.below(21) as i32 - 12;
                result = ctx.seq_add(s, p0, p1, delta);
                what = format!("seq_add({s}, {p0}, {p1}, {delta})");
                match model_range(p0, p1, max_pos) {
                    Some((lo, hi)) if valid(s) => {
                        let m = &mut model[s as usize];
                        let moved: Vec<(usize, i32)> =
                            m.range(lo..hi).map(|(&p, &t)| (p, t)).collect();
                        let over = moved
                            .last()
                            .is_some_and(|&(p, _)| p as i64 + delta as i64 >= max_pos as i64);
                        if over && delta != 0 {
                            expect = Err(S::ErrInvalidSequence);
                        } else if delta != 0 {
                            m.retain(|&p, _| !(lo..hi).contains(&p));
                            for (p, t) in moved {
                                let to = p as i64 + delta as i64;
                                if to >= 0 {
                                    m.insert(to as usize, t);
                                }
                            }
                        }
                    }
                    _ => expect = Err(S::ErrInvalidSequence),
                }
                count("seq_add", expect.is_ok());
            } else if op < 84 {
                let s = seq(&mut rng);
                let (p0, p1) = range(&mut rng);
                let d = rng.below(4) as i32 - 1;
                result = ctx.seq_div(s, p0, p1, d);
                what = format!("seq_div({s}, {p0}, {p1}, {d})");
                expect = match (valid(s), model_range(p0, p1, max_pos), d) {
                    (true, Some(_), 1) => Ok(()),
                    (true, Some(_), d) if d < 1 => Err(S::ErrInvalidArgument),
                    (true, Some(_), _) => Err(S::ErrUnsupported),
                    _ => Err(S::ErrInvalidSequence),
                };
                count("seq_div", expect.is_ok());
            } else if op < 88 {
                let (a, b) = (seq(&mut rng), seq(&mut rng));
                result = if rng.below(2) == 0 {
                    what = format!("seq_copy({a}, {b})");
                    ctx.seq_copy(a, b)
                } else {
                    what = format!("seq_drop({a})");
                    ctx.seq_drop(a)
                };
                if what.starts_with("seq_copy") && valid(a) && valid(b) {
                    model[b as usize] = model[a as usize].clone();
                } else if what.starts_with("seq_drop") && valid(a) {
                    model[a as usize].clear();
                } else {
                    expect = Err(S::ErrInvalidSequence);
                }
                count("seq_copy/drop", expect.is_ok());
            } else {
                // Save a sequence, restore it into another slot.
                let (a, b) = (rng.below(max_seqs) as i32, rng.below(max_seqs) as i32);
                let mut buf = vec![0u8; ctx.seq_state_size(a).unwrap()];
                assert_eq!(ctx.seq_state_write(a, &mut buf).unwrap(), buf.len());
                result = ctx.seq_state_read(b, &buf);
                what = format!("state of {a} into {b}");
                model[b as usize] = model[a as usize].clone();
                count("state save/restore", true);
            }
            assert_eq!(
                result.as_ref().map_err(|e| e.status).err(),
                expect.err(),
                "case {case} step {step}: {what} gave {result:?}\n{log:#?}"
            );
            if expect.is_err() {
                assert_eq!(model, before);
            }
            log.push(what);
            // The whole history, position by position.
            for (s, m) in model.iter().enumerate() {
                let want: Vec<(usize, i32)> =
                    m.iter().map(|(&p, &t)| (p, compressed(&tiny, t))).collect();
                assert_eq!(
                    ctx.seq_entries(s as i32).unwrap(),
                    want,
                    "case {case} step {step}, sequence {s}\n{log:#?}"
                );
            }
        }
    }
    eprintln!("operation mix (accepted, refused): {mix:?}");
}

#[test]
fn set_threads_while_applies_run_changes_no_bit() {
    // Applies on three threads while a fourth changes the thread count over
    // and over: each apply runs on the old pool or the new one, and every
    // one gives the bits of a one-thread context.
    let tiny = Tiny::load();
    let ctx = tiny.context();
    let per = ctx.ids_per_token();
    let n = 48;
    let vocab = tiny.token_map.len();
    let mut rng = Rng(31);
    let tokens: Vec<i32> = (0..n).map(|_| rng.token(vocab)).collect();
    let mut ids = vec![0i64; n * per];
    let pos: Vec<i32> = (0..n as i32).collect();
    ctx.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
    let hw0: Vec<f32> = values("threads.highway", n * tiny.hc * tiny.d, 1.0, 0.0);
    let layer = tiny.layer_ids[0];
    ctx.set_threads(1).unwrap();
    let mut want = hw0.clone();
    ctx.apply(layer, &ids, n, engram::Highway::F32(&mut want))
        .unwrap();
    assert_ne!(want, hw0);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..3)
            .map(|_| {
                s.spawn(|| {
                    let mut runs = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) || runs < 5 {
                        let mut hw = hw0.clone();
                        ctx.apply(layer, &ids, n, engram::Highway::F32(&mut hw))
                            .unwrap();
                        assert_eq!(hw, want, "run {runs}");
                        runs += 1;
                    }
                    runs
                })
            })
            .collect();
        for i in 0..40 {
            let t = [1, 4, 2, 3, 0][i % 5];
            ctx.set_threads(t).unwrap();
            assert_eq!(ctx.n_threads(), t.max(1));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for w in workers {
            assert!(w.join().unwrap() >= 5);
        }
    });
    ctx.set_threads(3).unwrap();
    let e = ctx.set_threads(1025).unwrap_err();
    assert_eq!(e.status, engram::EngramStatus::ErrInvalidArgument);
    assert_eq!(ctx.n_threads(), 3, "a refused count changes nothing");
}
