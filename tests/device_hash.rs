//! The hash on the device (`engram_hash_device`, `kernels/hash.cu`) against
//! the host hash, on the emulated device (or the GPU when there is one): the
//! golden regimes, the real V4.1 tables and texts, dead tokens and sticky
//! blocking across the prefill/decode split, many sequences in one batch,
//! positions near `max_positions`, the errors found on the device, and a
//! property test of random step sequences (prefill, decode, drafts rolled
//! back, forks, drops). See docs/device-hash.md.

mod common;

use common::device::{device, own_device, Dev};
use common::*;
use engram::call::{DeviceHashIn, DeviceSeqOp};
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
/// `engram_hash_device`'s arrays are checked before anything is queued: a
/// misaligned one, host memory the device cannot address, and an array too
/// small for `n` tokens are each `ERR_INVALID_ARGUMENT` naming the array,
/// with no launch; the history is untouched (the next call equals the host
/// hash).
#[test]
fn device_pointers_are_checked_before_anything_is_queued() {
    // A device of its own: the launches counted are this test's.
    let Some(dev) = own_device() else { return };
    let tiny = Tiny::load();
    let limits = Tiny::limits();
    let host = Context::new(&tiny.config(limits)).unwrap();
    let ctx = device_context(tiny.config(limits), &dev, 4);
    let per = ctx.ids_per_token();
    let (tokens, seqs, pos) = ([3i32, 4, 5], [0i32, 1, 2], [0i32, 0, 0]);
    let n = tokens.len();
    let (t, sq, p) = (dev.upload(&tokens), dev.upload(&seqs), dev.upload(&pos));
    let out = dev.alloc(n * per * 8);
    let short = dev.alloc(n * per * 8 - 8);
    let on_host = vec![0i32; 64];
    let good = DeviceHashIn {
        tokens: t.ptr,
        seq_ids: sq.ptr,
        pos: p.ptr,
        n,
        row_ids: out.ptr,
        stream: std::ptr::null_mut(),
    };
    let launches = || {
        dev.emu.as_ref().map_or(0, |e| {
            e.launches().get("engram_hash_runs").copied().unwrap_or(0)
        })
    };
    let before = launches();
    let bad = [
        (
            "tokens",
            DeviceHashIn {
                tokens: t.ptr + 2,
                ..good
            },
            "aligned",
        ),
        (
            "pos",
            DeviceHashIn {
                pos: p.ptr + 1,
                ..good
            },
            "aligned",
        ),
        (
            "row_ids",
            DeviceHashIn {
                row_ids: out.ptr + 4,
                ..good
            },
            "aligned",
        ),
        (
            "seq_ids",
            DeviceHashIn {
                seq_ids: on_host.as_ptr() as u64,
                ..good
            },
            "not memory the CUDA driver knows",
        ),
        (
            "row_ids",
            DeviceHashIn {
                row_ids: short.ptr,
                ..good
            },
            "do not fit",
        ),
        ("tokens", DeviceHashIn { n: n + 1, ..good }, "do not fit"),
    ];
    for (what, call, why) in bad {
        let e = ctx.hash_device(&call).expect_err(what);
        assert_eq!(
            e.status,
            EngramStatus::ErrInvalidArgument,
            "{what}: {}",
            e.message
        );
        assert!(
            e.message.contains(what) && e.message.contains(why),
            "{what}: {}",
            e.message
        );
    }
    assert_eq!(launches(), before, "a refused call queued nothing");
    ctx.hash_device(&good).expect("queued");
    ctx.check(std::ptr::null_mut()).expect("no device error");
    let got: Vec<i64> = out.read(n * per).unwrap();
    assert_eq!(
        got,
        hash_host(&host, &tokens, &seqs, &pos),
        "the history was untouched"
    );
}

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

/// A host state of `seq` and the device state of `seq`, byte for byte (the
/// same format: equal bytes mean equal histories).
fn assert_same_state(host: &Context<'_>, ctx: &Context<'_>, seq: i32, what: &str) {
    let null = std::ptr::null_mut();
    let n = host.seq_state_size(seq).unwrap();
    assert_eq!(
        ctx.seq_state_size_device(seq, null).unwrap(),
        n,
        "{what}: state size of sequence {seq}"
    );
    let (mut a, mut b) = (vec![0u8; n], vec![0u8; n]);
    host.seq_state_write(seq, &mut a).unwrap();
    ctx.seq_state_write_device(seq, &mut b, null).unwrap();
    assert_eq!(a, b, "{what}: history of sequence {seq}");
}

/// The range operations (rm, cp, keep, add) and the states on the device
/// equal the host's, step by step, on random sequences of engine steps: a
/// ring that holds every position (`device_history = max_positions`) keeps
/// exactly what the host keeps, so the ids, the errors and the saved states
/// agree byte for byte.
#[test]
fn range_operations_and_states_equal_the_host_history() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let limits = Limits {
        max_tokens: 48,
        max_seqs: 5,
        max_positions: 160,
    };
    let null = std::ptr::null_mut();
    let mp = limits.max_positions as i32;
    for seed in 0..5u64 {
        let host = Context::new(&tiny.config(limits)).unwrap();
        let ctx = device_context(tiny.config(limits), &dev, limits.max_positions);
        let mut f = Rng(7000 + seed);
        let mut len = [0i32; 5];
        let tok = |f: &mut Rng| match f.next() % 12 {
            0 => engram::TOKEN_DEAD,
            _ => (f.next() % tiny.token_map.len() as u64) as i32,
        };
        // A position in [-1, max_positions], -1 now and then.
        let at = |f: &mut Rng| match f.next() % 8 {
            0 => -1,
            _ => (f.next() % (mp as u64 + 1)) as i32,
        };
        for step in 0..150 {
            let what = format!("seed {seed} step {step}");
            let s = (f.next() % 5) as i32;
            match f.next() % 12 {
                // rm: a rollback to the end, a middle range, or every sequence.
                0 | 1 => {
                    let (seq, p0, p1) = match f.next() % 3 {
                        0 => (s, (f.next() % (len[s as usize] as u64 + 1)) as i32, -1),
                        1 => (s, at(&mut f), at(&mut f)),
                        _ => (-1, at(&mut f), -1),
                    };
                    let hr = host.seq_rm(seq, p0, p1);
                    let dr = ctx.seq_op_device(DeviceSeqOp::Rm { seq, p0, p1 }, null);
                    assert_eq!(hr.is_ok(), dr.is_ok(), "{what}: rm({seq}, {p0}, {p1})");
                    if let (Err(h), Err(d)) = (&hr, &dr) {
                        assert_eq!((h.status, &h.message), (d.status, &d.message), "{what}");
                    }
                    if hr.is_ok() {
                        for (i, l) in len.iter_mut().enumerate() {
                            if seq == -1 || seq == i as i32 {
                                *l = host.seq_len(i as i32).unwrap() as i32;
                            }
                        }
                    }
                }
                // cp of a range (or all) into another sequence.
                2 => {
                    let d = (f.next() % 5) as i32;
                    let (p0, p1) = (at(&mut f), at(&mut f));
                    let hr = host.seq_cp(s, d, p0, p1);
                    let dr = ctx.seq_op_device(
                        DeviceSeqOp::Cp {
                            src: s,
                            dst: d,
                            p0,
                            p1,
                        },
                        null,
                    );
                    assert_eq!(hr.is_ok(), dr.is_ok(), "{what}: cp({s}, {d}, {p0}, {p1})");
                    len[d as usize] = host.seq_len(d).unwrap() as i32;
                }
                // keep one sequence (rarely).
                3 if f.next().is_multiple_of(4) => {
                    host.seq_keep(s).unwrap();
                    ctx.seq_op_device(DeviceSeqOp::Keep { seq: s }, null)
                        .unwrap();
                    for (i, l) in len.iter_mut().enumerate() {
                        *l = host.seq_len(i as i32).unwrap() as i32;
                    }
                }
                // add: a context shift (rm [k, k + n), then move [k + n, -1)
                // by -n), or a random move that may land outside.
                4 | 5 => {
                    let (p0, p1, delta) = if f.next().is_multiple_of(2) && len[s as usize] > 4 {
                        let l = len[s as usize];
                        let k = (f.next() % (l as u64 / 2)) as i32;
                        let n = 1 + (f.next() % ((l - k) as u64 - 1)) as i32;
                        host.seq_rm(s, k, k + n).unwrap();
                        ctx.seq_op_device(
                            DeviceSeqOp::Rm {
                                seq: s,
                                p0: k,
                                p1: k + n,
                            },
                            null,
                        )
                        .unwrap();
                        (k + n, -1, -n)
                    } else {
                        (at(&mut f), at(&mut f), (f.next() % 41) as i32 - 20)
                    };
                    let op = DeviceSeqOp::Add {
                        seq: s,
                        p0,
                        p1,
                        delta,
                    };
                    let hr = host.seq_add(s, p0, p1, delta);
                    let dr = ctx.seq_op_device(op, null);
                    // A move that lands outside is found on the device and
                    // reported by the next check; other errors at the call.
                    let dr = dr.and_then(|_| ctx.check(null));
                    match (&hr, &dr) {
                        (Ok(()), Ok(())) => {}
                        (Err(h), Err(d)) => {
                            assert_eq!(h.status, d.status, "{what}");
                            assert!(
                                d.message.starts_with(&h.message),
                                "{what}: {}\nhost: {}",
                                d.message,
                                h.message
                            );
                        }
                        _ => panic!(
                            "{what}: add({s}, {p0}, {p1}, {delta}): host {hr:?}, device {dr:?}"
                        ),
                    }
                    len[s as usize] = host.seq_len(s).unwrap() as i32;
                }
                // Save a sequence's state and restore it into another (on
                // both), or the host's state into the device.
                6 => {
                    let d = (f.next() % 5) as i32;
                    let n = ctx.seq_state_size_device(s, null).unwrap();
                    let mut b = vec![0u8; n];
                    assert_eq!(ctx.seq_state_write_device(s, &mut b, null).unwrap(), n);
                    host.seq_state_read(d, &b).unwrap();
                    if f.next().is_multiple_of(2) {
                        ctx.seq_state_read_device(d, &b, null).unwrap();
                    } else {
                        let mut hb = vec![0u8; host.seq_state_size(d).unwrap()];
                        host.seq_state_write(d, &mut hb).unwrap();
                        ctx.seq_state_read_device(d, &hb, null).unwrap();
                    }
                    len[d as usize] = len[s as usize];
                }
                // Hash: a prefill chunk or draft of one sequence, or a decode
                // step of several, continuing where each one ends.
                _ => {
                    let (mut tokens, mut seqs, mut pos) = (vec![], vec![], vec![]);
                    let m = 1 + f.next() % 5;
                    let mut order: Vec<i32> = (0..5).collect();
                    for i in (1..5).rev() {
                        order.swap(i, (f.next() % (i as u64 + 1)) as usize);
                    }
                    for &q in order.iter().take(m as usize) {
                        let k = 1 + f.next() % 8;
                        for j in 0..k as i32 {
                            let p = len[q as usize] + j;
                            if tokens.len() < 48 && p < mp {
                                tokens.push(tok(&mut f));
                                seqs.push(q);
                                pos.push(p);
                            }
                        }
                    }
                    if tokens.is_empty() {
                        continue;
                    }
                    let mut want = vec![0i64; tokens.len() * ctx.ids_per_token()];
                    let hr = host.hash(&tokens, &seqs, &pos, &mut want);
                    let (got, dr) = hash_dev(&ctx, &dev, &tokens, &seqs, &pos);
                    match hr {
                        Ok(()) => {
                            dr.unwrap_or_else(|e| panic!("{what}: {}", e.message));
                            assert_eq!(got, want, "{what}: {tokens:?} {seqs:?} {pos:?}");
                            for (&q, &p) in seqs.iter().zip(&pos) {
                                len[q as usize] = len[q as usize].max(p + 1);
                            }
                        }
                        Err(h) => {
                            // A look-back into a removed range: the same
                            // error; the host recorded nothing, the device
                            // the tokens without an error, so the test
                            // restores the host's histories on the device.
                            let d = dr.expect_err(&what);
                            assert_eq!(h.status, d.status, "{what}: {}\n{}", h.message, d.message);
                            for &q in &seqs {
                                let mut hb = vec![0u8; host.seq_state_size(q).unwrap()];
                                host.seq_state_write(q, &mut hb).unwrap();
                                ctx.seq_state_read_device(q, &hb, null).unwrap();
                            }
                        }
                    }
                }
            }
            for (i, l) in len.iter_mut().enumerate() {
                *l = host.seq_len(i as i32).unwrap() as i32;
            }
            if step % 10 == 9 {
                for q in 0..5 {
                    assert_same_state(&host, &ctx, q, &what);
                }
            }
        }
        for q in 0..5 {
            assert_same_state(&host, &ctx, q, &format!("seed {seed} end"));
        }
    }
}

/// A ring shorter than the history: a context shift, a rollback with
/// `engram_seq_rm_device`, and a long host state restored into the ring
/// give the host's ids wherever the ring holds the look-back, and
/// `ERR_MISSING_HISTORY` (never another id) where it does not; a move past
/// `max_positions` is reported by the next check, and nothing moved.
#[test]
fn a_short_ring_after_shifts_rollbacks_and_states() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let limits = Limits {
        max_tokens: 64,
        max_seqs: 2,
        max_positions: 200,
    };
    let null = std::ptr::null_mut();
    let host = Context::new(&tiny.config(limits)).unwrap();
    let ring = tiny.ngram - 1 + 3;
    let ctx = device_context(tiny.config(limits), &dev, ring);
    let live: Vec<i32> = (0..tiny.token_map.len() as i32)
        .filter(|&t| tiny.token_map[t as usize] >= 0)
        .collect();
    let text: Vec<i32> = (0..120).map(|i| live[(i * 7 + 3) % live.len()]).collect();
    // Prefill 60 positions on both.
    let pos: Vec<i32> = (0..60).collect();
    let want = hash_host(&host, &text[..60], &[0; 60], &pos);
    let (got, r) = hash_dev(&ctx, &dev, &text[..60], &[0; 60], &pos);
    r.unwrap();
    assert_eq!(got, want);
    // Context shift: drop [4, 25), move [25, end) by -21 (not a multiple of
    // the ring); decode goes on at 39.
    host.seq_rm(0, 4, 25).unwrap();
    host.seq_add(0, 25, -1, -21).unwrap();
    ctx.seq_op_device(
        DeviceSeqOp::Rm {
            seq: 0,
            p0: 4,
            p1: 25,
        },
        null,
    )
    .unwrap();
    ctx.seq_op_device(
        DeviceSeqOp::Add {
            seq: 0,
            p0: 25,
            p1: -1,
            delta: -21,
        },
        null,
    )
    .unwrap();
    for p in 39..50 {
        let t = [text[p as usize + 21]];
        let want = hash_host(&host, &t, &[0], &[p]);
        let (got, r) = hash_dev(&ctx, &dev, &t, &[0], &[p]);
        r.unwrap_or_else(|e| panic!("decode at {p} after the shift: {}", e.message));
        assert_eq!(got, want, "decode at {p} after the shift");
    }
    // A draft of 3 at 50..53, 2 rejected: rm [51, -1), re-hash 51.
    let d = [text[1], text[2], text[3]];
    assert_eq!(
        hash_dev(&ctx, &dev, &d, &[0; 3], &[50, 51, 52]).0,
        hash_host(&host, &d, &[0; 3], &[50, 51, 52])
    );
    host.seq_rm(0, 51, -1).unwrap();
    ctx.seq_op_device(
        DeviceSeqOp::Rm {
            seq: 0,
            p0: 51,
            p1: -1,
        },
        null,
    )
    .unwrap();
    let (got, r) = hash_dev(&ctx, &dev, &[text[9]], &[0], &[51]);
    r.unwrap();
    assert_eq!(got, hash_host(&host, &[text[9]], &[0], &[51]));
    // A look-back into the removed 52: missing on both.
    let (got, r) = hash_dev(&ctx, &dev, &[text[9]], &[0], &[53]);
    assert_eq!(r.unwrap_err().status, EngramStatus::ErrMissingHistory);
    assert!(got.iter().all(|&x| x == -1));
    // A look-back the ring no longer holds (position 30, evicted): missing,
    // where the host answers.
    let (_, r) = hash_dev(&ctx, &dev, &[text[9]], &[0], &[31]);
    assert_eq!(r.unwrap_err().status, EngramStatus::ErrMissingHistory);
    // The host's long state into slot 1's ring: decode continues as on the host.
    let mut b = vec![0u8; host.seq_state_size(0).unwrap()];
    host.seq_state_write(0, &mut b).unwrap();
    host.seq_state_read(1, &b).unwrap();
    ctx.seq_state_read_device(1, &b, null).unwrap();
    let (got, r) = hash_dev(&ctx, &dev, &[text[11]], &[1], &[52]);
    r.unwrap();
    assert_eq!(got, hash_host(&host, &[text[11]], &[1], &[52]));
    // Slot 1's device state is the ring's part of the host's: its last
    // `ring` positions.
    let n = ctx.seq_state_size_device(1, null).unwrap();
    let mut db = vec![0u8; n];
    ctx.seq_state_write_device(1, &mut db, null).unwrap();
    let probe = Context::new(&tiny.config(limits)).unwrap();
    probe.seq_state_read(0, &db).unwrap();
    let full = host.seq_entries(1).unwrap();
    assert_eq!(probe.seq_entries(0).unwrap(), full[full.len() - ring..]);
    // A move past max_positions: reported by the next check, nothing moved.
    let before = db.clone();
    ctx.seq_op_device(
        DeviceSeqOp::Add {
            seq: 1,
            p0: 0,
            p1: -1,
            delta: 150,
        },
        null,
    )
    .unwrap();
    let e = ctx.check(null).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidSequence);
    assert!(
        e.message.starts_with(
            "sequence 1: position 52 moved by 150 lands outside [0, max_positions = 200)"
        ),
        "{}",
        e.message
    );
    assert!(e.message.contains("engram_seq_add_device"), "{}", e.message);
    ctx.check(null).unwrap();
    let mut after = vec![0u8; n];
    ctx.seq_state_write_device(1, &mut after, null).unwrap();
    assert_eq!(after, before, "nothing moved");
    // Arguments checked at the call, nothing queued.
    for (op, status) in [
        (
            DeviceSeqOp::Rm {
                seq: 2,
                p0: 0,
                p1: -1,
            },
            EngramStatus::ErrInvalidSequence,
        ),
        (
            DeviceSeqOp::Rm {
                seq: 0,
                p0: 5,
                p1: 4,
            },
            EngramStatus::ErrInvalidSequence,
        ),
        (
            DeviceSeqOp::Rm {
                seq: 0,
                p0: 0,
                p1: 201,
            },
            EngramStatus::ErrInvalidSequence,
        ),
        (
            DeviceSeqOp::Cp {
                src: 0,
                dst: -1,
                p0: 0,
                p1: -1,
            },
            EngramStatus::ErrInvalidSequence,
        ),
        (
            DeviceSeqOp::Keep { seq: 5 },
            EngramStatus::ErrInvalidSequence,
        ),
        (
            DeviceSeqOp::Add {
                seq: -1,
                p0: 0,
                p1: -1,
                delta: 1,
            },
            EngramStatus::ErrInvalidSequence,
        ),
    ] {
        assert_eq!(
            ctx.seq_op_device(op, null).unwrap_err().status,
            status,
            "{op:?}"
        );
    }
    assert_eq!(
        ctx.seq_state_read_device(0, &b[..b.len() - 1], null)
            .unwrap_err()
            .status,
        EngramStatus::ErrFormat
    );
    // Host history calls on a device context, device calls on a host one.
    assert_eq!(
        ctx.seq_rm(0, 0, -1).unwrap_err().status,
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        ctx.seq_state_size(0).unwrap_err().status,
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        host.seq_op_device(DeviceSeqOp::Keep { seq: 0 }, null)
            .unwrap_err()
            .status,
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        host.seq_state_read_device(0, &b, null).unwrap_err().status,
        EngramStatus::ErrUnsupported
    );
}
