//! The hash on the device (`engram_hash_device`, `kernels/hash.cu`) against
//! the host hash, on the emulated device (or the GPU when there is one): the
//! golden regimes, the real V4.1 tables and texts, dead tokens and sticky
//! blocking across the prefill/decode split, many sequences in one batch,
//! positions near `max_positions`, the errors found on the device, and a
//! property test of random step sequences (prefill, decode, drafts rolled
//! back, forks, drops). See docs/device-hash.md.

mod common;

use common::device::{device, Dev};
use common::*;
use engram::call::DeviceHashIn;
use engram::cuda::gpu::DevBuf;
use engram::{Context, ContextConfig, EngramStatus, Limits};

/// A small deterministic generator (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        mix64(self.0)
    }
}

/// A context with a device history of `ring` positions on `dev`.
fn device_context<'a>(mut cfg: ContextConfig<'_>, dev: &Dev, ring: usize) -> Context<'a> {
    cfg.backend = engram::EngramBackend::Cuda as u32;
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    Context::new(&cfg)
        .expect("create")
        .with_device_history(ring)
        .expect("device history")
}

/// One device hash: its ids, and what `check` then reports.
fn hash_dev(
    ctx: &Context<'_>,
    dev: &Dev,
    tokens: &[i32],
    seqs: &[i32],
    pos: &[i32],
) -> (Vec<i64>, Result<(), engram::Error>) {
    let n = tokens.len();
    let per = ctx.ids_per_token();
    let (t, s, p) = (dev.upload(tokens), dev.upload(seqs), dev.upload(pos));
    let out: DevBuf = dev.alloc((n * per).max(1) * 8);
    let call = DeviceHashIn {
        tokens: t.ptr,
        seq_ids: s.ptr,
        pos: p.ptr,
        n,
        row_ids: out.ptr,
        stream: std::ptr::null_mut(),
    };
    ctx.hash_device(&call).expect("queued");
    let r = ctx.check(std::ptr::null_mut());
    (out.read::<i64>(n * per).expect("read"), r)
}

fn hash_host(ctx: &Context<'_>, tokens: &[i32], seqs: &[i32], pos: &[i32]) -> Vec<i64> {
    let mut out = vec![0i64; tokens.len() * ctx.ids_per_token()];
    ctx.hash(tokens, seqs, pos, &mut out).expect("host hash");
    out
}

#[test]
fn golden_regimes_on_the_device() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    for (regime, v) in tiny.golden["regimes"].as_object().unwrap() {
        let ctx = device_context(tiny.config(Tiny::limits()), &dev, 8);
        let per = ctx.ids_per_token();
        for (ci, c) in v["calls"].as_array().unwrap().iter().enumerate() {
            let (tokens, seqs, pos, want) = (
                i32s(&c["tokens"]),
                i32s(&c["seq_ids"]),
                i32s(&c["pos"]),
                ints(&c["ids"]),
            );
            // The device takes each sequence as one run: the engine's order
            // of an interleaved batch is grouped by sequence (stable).
            let mut order: Vec<usize> = (0..tokens.len()).collect();
            order.sort_by_key(|&i| seqs[i]);
            let pick = |v: &[i32]| order.iter().map(|&i| v[i]).collect::<Vec<_>>();
            let (got, r) = hash_dev(&ctx, &dev, &pick(&tokens), &pick(&seqs), &pick(&pos));
            r.unwrap_or_else(|e| panic!("{regime} call {ci}: {}", e.message));
            for (j, &i) in order.iter().enumerate() {
                assert_eq!(
                    got[j * per..(j + 1) * per],
                    want[i * per..(i + 1) * per],
                    "{regime} call {ci} token {i}"
                );
            }
        }
    }
}

#[test]
fn an_interleaved_batch_is_refused_not_misread() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let ctx = device_context(tiny.config(Tiny::limits()), &dev, 8);
    let c = &tiny.golden["regimes"]["interleaved"]["calls"][0];
    let (tokens, seqs, pos) = (i32s(&c["tokens"]), i32s(&c["seq_ids"]), i32s(&c["pos"]));
    let (got, r) = hash_dev(&ctx, &dev, &tokens, &seqs, &pos);
    let e = r.expect_err("two runs of a sequence");
    assert_eq!(e.status, EngramStatus::ErrInvalidSequence);
    assert!(
        e.message.starts_with("token 0: sequence 0 is not one run"),
        "{}",
        e.message
    );
    assert!(
        got.iter().all(|&x| x == -1),
        "every token of both sequences dead"
    );
    // Nothing was recorded: position 0 of sequence 0 is still missing.
    let live = tiny.token_map.iter().position(|&m| m >= 0).unwrap() as i32;
    let (_, r) = hash_dev(&ctx, &dev, &[live], &[0], &[1]);
    assert_eq!(r.unwrap_err().status, EngramStatus::ErrMissingHistory);
}

/// The real V4.1 tables (129280-entry map, primes of the released model) and
/// the generator's texts, as one prefill each and as prefill + decode steps.
#[test]
fn real_v41_texts_on_the_device() {
    let Some(dev) = device() else { return };
    let g = load_json("v41_hash.json");
    let b = std::fs::read(golden_dir().join("v41_token_map.i32")).unwrap();
    let map: Vec<i32> = b
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let layer_ids: Vec<u32> = ints(&g["layer_ids"]).iter().map(|&l| l as u32).collect();
    let (multipliers, primes, offsets) = (
        u64s(&g["multipliers"]),
        u64s(&g["primes"]),
        u64s(&g["offsets"]),
    );
    let cfg = || ContextConfig {
        geometry: engram::Geometry {
            d: 64,
            hc: 4,
            hd: 32,
            eps: 1e-6,
        },
        tables: engram::HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: 4,
            n_heads: 8,
            token_map: &map,
            pad_id: g["pad_id"].as_i64().unwrap(),
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
    let ctx = device_context(cfg(), &dev, 16);
    let per = ctx.ids_per_token();
    for (si, t) in g["texts"].as_array().unwrap().iter().enumerate() {
        let tokens = i32s(&t["tokens"]);
        let want = ints(&t["ids"]);
        let n = tokens.len();
        let pos: Vec<i32> = (0..n as i32).collect();
        let (got, r) = hash_dev(&ctx, &dev, &tokens, &vec![si as i32; n], &pos);
        r.unwrap();
        assert_eq!(got, want, "text {si} as one prefill");
        // Again in slot si + 4: a prefill of half, then one token a step.
        let s = si as i32 + 4;
        let h = n / 2;
        let (got, r) = hash_dev(&ctx, &dev, &tokens[..h], &vec![s; h], &pos[..h]);
        r.unwrap();
        assert_eq!(got, want[..h * per], "text {si} prefill half");
        for i in h..n {
            let (got, r) = hash_dev(&ctx, &dev, &tokens[i..=i], &[s], &pos[i..=i]);
            r.unwrap();
            assert_eq!(got, want[i * per..(i + 1) * per], "text {si} decode {i}");
        }
    }
}

/// Dead tokens (by map and by ENGRAM_TOKEN_DEAD) block the look-back of the
/// tokens after them, also when the dead token came in the prefill and the
/// blocked ones in later decode steps; many sequences in one batch; positions
/// up to max_positions - 1.
#[test]
fn dead_tokens_many_sequences_and_the_last_positions() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let limits = Limits {
        max_tokens: 64,
        max_seqs: 32,
        max_positions: 40,
    };
    let host = Context::new(&tiny.config(limits)).unwrap();
    let ctx = device_context(tiny.config(limits), &dev, 4);
    let dead_by_map = tiny
        .token_map
        .iter()
        .position(|&m| m == -1)
        .map(|t| t as i32);
    let mut f = Rng(11);
    let mut len = [0i32; 32];
    for step in 0..40 {
        // Every sequence in the batch, in a shuffled order of runs: sequence
        // s prefills up to 3 tokens (or one in later steps).
        let mut order: Vec<i32> = (0..32).collect();
        for i in (1..32).rev() {
            order.swap(i, (f.next() % (i as u64 + 1)) as usize);
        }
        let (mut tokens, mut seqs, mut pos) = (vec![], vec![], vec![]);
        for &s in &order {
            let k = if step == 0 { 1 + (s % 3) } else { 1 };
            for _ in 0..k {
                if len[s as usize] >= limits.max_positions as i32 || tokens.len() == 64 {
                    break;
                }
                let r = f.next() % 10;
                tokens.push(match (r, dead_by_map) {
                    (0, _) => engram::TOKEN_DEAD,
                    (1, Some(t)) => t,
                    _ => (f.next() % tiny.token_map.len() as u64) as i32,
                });
                seqs.push(s);
                pos.push(len[s as usize]);
                len[s as usize] += 1;
            }
        }
        if tokens.is_empty() {
            break;
        }
        let want = hash_host(&host, &tokens, &seqs, &pos);
        let (got, r) = hash_dev(&ctx, &dev, &tokens, &seqs, &pos);
        r.unwrap_or_else(|e| panic!("step {step}: {}", e.message));
        assert_eq!(got, want, "step {step}");
    }
    assert!(
        len.iter().all(|&l| l == 40),
        "every sequence reached max_positions"
    );
    // One past the last position: refused on the device.
    let (got, r) = hash_dev(&ctx, &dev, &[1, 2], &[0, 1], &[39, 40]);
    let e = r.unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidSequence);
    assert!(
        e.message
            .starts_with("token 1: position 40 outside [0, max_positions = 40)"),
        "{}",
        e.message
    );
    let per = ctx.ids_per_token();
    assert_eq!(
        got[..per],
        hash_host(&host, &[1], &[0], &[39])[..],
        "token 0 hashed"
    );
    assert!(got[per..].iter().all(|&x| x == -1));
}

/// The errors found on the device: that token dead, the others hashed, the
/// first error (token errors before look-back errors, then by token) with
/// the host's status and message, reported once, by the next call too.
#[test]
fn errors_on_the_device() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let limits = Tiny::limits();
    let host = Context::new(&tiny.config(limits)).unwrap();
    let ctx = device_context(tiny.config(limits), &dev, 4);
    let per = ctx.ids_per_token();
    let map_len = tiny.token_map.len() as i32;
    // A look-back never hashed (token 0) and a token outside the map (token
    // 2): the token error comes first, as on the host.
    let (got, r) = hash_dev(
        &ctx,
        &dev,
        &[3, 4, map_len, 6],
        &[0, 1, 2, 3],
        &[5, 0, 0, 0],
    );
    let e = r.unwrap_err();
    let mut host_out = vec![0i64; 4 * per];
    let he = host
        .hash(
            &[3, 4, map_len, 6],
            &[0, 1, 2, 3],
            &[5, 0, 0, 0],
            &mut host_out,
        )
        .unwrap_err();
    assert_eq!(
        (e.status, he.status),
        (EngramStatus::ErrInvalidToken, EngramStatus::ErrInvalidToken)
    );
    assert!(
        e.message.starts_with(&he.message),
        "device: {}\nhost: {}",
        e.message,
        he.message
    );
    assert!(got[..per].iter().all(|&x| x == -1), "missing history: dead");
    assert!(
        got[2 * per..3 * per].iter().all(|&x| x == -1),
        "bad token: dead"
    );
    assert_eq!(got[per..2 * per], hash_host(&host, &[4], &[1], &[0])[..]);
    assert_eq!(got[3 * per..], hash_host(&host, &[6], &[3], &[0])[..]);
    // Reported once: check is clean now.
    ctx.check(std::ptr::null_mut()).unwrap();
    // A sequence outside max_seqs, then the report by the next call.
    let (t, s, p) = (
        dev.upload(&[1i32]),
        dev.upload(&[limits.max_seqs as i32]),
        dev.upload(&[0i32]),
    );
    let out = dev.alloc(per * 8);
    let call = DeviceHashIn {
        tokens: t.ptr,
        seq_ids: s.ptr,
        pos: p.ptr,
        n: 1,
        row_ids: out.ptr,
        stream: std::ptr::null_mut(),
    };
    ctx.hash_device(&call).unwrap();
    dev.gpu.synchronize().unwrap();
    let e = ctx.hash_device(&call).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidSequence);
    assert!(
        e.message
            .starts_with("token 0: sequence id 4 outside [0, max_seqs = 4)"),
        "{}",
        e.message
    );
    assert!(e.message.contains("engram_hash_device"), "{}", e.message);
    ctx.check(std::ptr::null_mut()).unwrap();
    // A look-back evicted from the ring (4 positions kept, N = 3): refused,
    // where the host (which keeps everything) answers.
    let tokens: Vec<i32> = (0..10).collect();
    let pos: Vec<i32> = (0..10).collect();
    let (_, r) = hash_dev(&ctx, &dev, &tokens, &[0; 10], &pos);
    r.unwrap();
    let (got, r) = hash_dev(&ctx, &dev, &[7], &[0], &[3]);
    let e = r.unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrMissingHistory);
    assert!(
        e.message
            .starts_with("token 0: sequence 0 position 3 looks back to position 2"),
        "{}",
        e.message
    );
    assert!(got.iter().all(|&x| x == -1));
    // Host calls on a device-history context are refused.
    let e = ctx.hash(&[1], &[0], &[0], &mut vec![0; per]).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrUnsupported);
    assert_eq!(
        ctx.seq_copy(0, 1).unwrap_err().status,
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        ctx.seq_drop(0).unwrap_err().status,
        EngramStatus::ErrUnsupported
    );
    // Too many tokens: refused at the call, nothing queued.
    let call = DeviceHashIn {
        n: limits.max_tokens + 1,
        ..call
    };
    assert_eq!(
        ctx.hash_device(&call).unwrap_err().status,
        EngramStatus::ErrCapacity
    );
    // The CPU backend has no device history.
    let e = Context::new(&tiny.config(limits))
        .unwrap()
        .with_device_history(8)
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrUnsupported);
    assert_eq!(
        host.hash_device(&call).unwrap_err().status,
        EngramStatus::ErrUnsupported
    );
    // A ring shorter than the look-back.
    let mut cfg = tiny.config(limits);
    cfg.backend = engram::EngramBackend::Cuda as u32;
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    let e = Context::new(&cfg)
        .unwrap()
        .with_device_history(1)
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
}

/// Random step sequences on 6 sequences: prefills (whole or chunked), decode
/// steps of several sequences, drafts rolled back and re-hashed, forks and
/// drops; the device ids equal the host's at every step.
#[test]
fn random_steps_equal_the_host_hash() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let limits = Limits {
        max_tokens: 64,
        max_seqs: 6,
        max_positions: 512,
    };
    const DRAFT: i32 = 5;
    let ring = tiny.ngram - 1 + DRAFT as usize;
    for seed in 0..6u64 {
        let host = Context::new(&tiny.config(limits)).unwrap();
        let ctx = device_context(tiny.config(limits), &dev, ring);
        let mut f = Rng(1000 + seed);
        let mut len = [0i32; 6];
        let tok = |f: &mut Rng| match f.next() % 16 {
            0 => engram::TOKEN_DEAD,
            _ => (f.next() % tiny.token_map.len() as u64) as i32,
        };
        for step in 0..120 {
            let kind = f.next() % 10;
            let (mut tokens, mut seqs, mut pos) = (vec![], vec![], vec![]);
            let mut rollback = None;
            match kind {
                // Fork one sequence into another.
                0 => {
                    let (a, b) = ((f.next() % 6) as i32, (f.next() % 6) as i32);
                    host.seq_copy(a, b).unwrap();
                    ctx.seq_copy_device(a, b, std::ptr::null_mut()).unwrap();
                    len[b as usize] = len[a as usize];
                    continue;
                }
                // Drop one.
                1 => {
                    let a = (f.next() % 6) as i32;
                    host.seq_drop(a).unwrap();
                    ctx.seq_drop_device(a, std::ptr::null_mut()).unwrap();
                    len[a as usize] = 0;
                    continue;
                }
                // A draft on one sequence, some of it rejected.
                2 | 3 => {
                    let s = (f.next() % 6) as i32;
                    let d = 1 + (f.next() % DRAFT as u64) as i32;
                    for j in 0..d {
                        tokens.push(tok(&mut f));
                        seqs.push(s);
                        pos.push(len[s as usize] + j);
                    }
                    let keep = (f.next() % d as u64) as i32;
                    rollback = Some((s, len[s as usize] + keep));
                }
                // A prefill chunk of a few sequences, or a decode step of
                // several (runs in any order of sequences).
                _ => {
                    let mut order: Vec<i32> = (0..6).collect();
                    for i in (1..6).rev() {
                        order.swap(i, (f.next() % (i as u64 + 1)) as usize);
                    }
                    let m = 1 + f.next() % 6;
                    for &s in order.iter().take(m as usize) {
                        let k = if kind < 6 { 1 + f.next() % 10 } else { 1 };
                        for j in 0..k as i32 {
                            if tokens.len() < 64
                                && len[s as usize] + j < limits.max_positions as i32
                            {
                                tokens.push(tok(&mut f));
                                seqs.push(s);
                                pos.push(len[s as usize] + j);
                            }
                        }
                    }
                }
            }
            if tokens.is_empty() {
                continue;
            }
            for (&s, &p) in seqs.iter().zip(&pos) {
                len[s as usize] = len[s as usize].max(p + 1);
            }
            let want = hash_host(&host, &tokens, &seqs, &pos);
            let (got, r) = hash_dev(&ctx, &dev, &tokens, &seqs, &pos);
            r.unwrap_or_else(|e| panic!("seed {seed} step {step}: {}", e.message));
            assert_eq!(
                got, want,
                "seed {seed} step {step} ({tokens:?} {seqs:?} {pos:?})"
            );
            // Roll back: the first rejected position is re-hashed with
            // another token (the accepted prefix stays).
            if let Some((s, at)) = rollback {
                let t = [tok(&mut f)];
                let want = hash_host(&host, &t, &[s], &[at]);
                let (got, r) = hash_dev(&ctx, &dev, &t, &[s], &[at]);
                r.unwrap_or_else(|e| panic!("seed {seed} step {step} rollback: {}", e.message));
                assert_eq!(got, want, "seed {seed} step {step} rollback at {at}");
                len[s as usize] = at + 1;
            }
        }
    }
}
