//! Exhausted memory: each allocation of `apply`, `prefetch`, `read_back`,
//! `seq_copy` and `create` whose size a caller chooses (tokens, ids, the
//! geometry, the history's pages, `max_seqs`, the token map) is made to fail, one at a
//! time, by this binary's global allocator. Each must become
//! `ErrCapacity` naming what it could not allocate, with nothing changed
//! (the highway, the history), and the next call must work. An allocation
//! made with `Vec::with_capacity`, `vec!` or `clone` instead aborts the
//! process (`handle_alloc_error`), which fails this test.
//!
//! The allocator fails the n-th allocation of an exact size while armed;
//! every case checks that it fired, so a case whose allocation moved or
//! changed size fails rather than passing without testing anything.

mod common;

use common::*;
use engram::{EngramStatus, Highway, Limits, RowIds};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

struct Failing;

/// The size to fail (0: disarmed), and how many allocations of that size to
/// let through first.
static SIZE: AtomicUsize = AtomicUsize::new(0);
static SKIP: AtomicUsize = AtomicUsize::new(0);
static FIRED: AtomicBool = AtomicBool::new(false);

fn fail_this(size: usize) -> bool {
    if size == 0 || SIZE.load(SeqCst) != size {
        return false;
    }
    if SKIP
        .fetch_update(SeqCst, SeqCst, |s| s.checked_sub(1))
        .is_ok()
    {
        return false;
    }
    // This one fails; later ones of the size go through.
    SIZE.store(0, SeqCst);
    FIRED.store(true, SeqCst);
    true
}

// SAFETY: forwards to the system allocator, or returns null (an allocation
// failure, which every caller must handle) without touching memory.
unsafe impl GlobalAlloc for Failing {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if fail_this(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if fail_this(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if fail_this(new_size) {
            return std::ptr::null_mut();
        }
        // SAFETY: as `dealloc`, with the caller's new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Failing = Failing;

/// Run `f` with the `nth` (1-based) allocation of `size` bytes failing;
/// returns its result and whether the failure was injected.
fn failing<T>(size: usize, nth: usize, f: impl FnOnce() -> T) -> (T, bool) {
    FIRED.store(false, SeqCst);
    SKIP.store(nth - 1, SeqCst);
    SIZE.store(size, SeqCst);
    let r = f();
    SIZE.store(0, SeqCst);
    (r, FIRED.swap(false, SeqCst))
}

fn expect_capacity(case: &str, r: engram::Result<()>, fired: bool, what: &str) {
    assert!(
        fired,
        "{case}: no allocation of that size was made (did it move?)"
    );
    let e = r.expect_err(case);
    assert_eq!(e.status, EngramStatus::ErrCapacity, "{case}: {}", e.message);
    assert!(
        e.message.contains(what),
        "{case}: the message names {what:?}: {}",
        e.message
    );
}

#[test]
fn every_caller_sized_allocation_fails_with_a_status() {
    let tiny = Tiny::load();
    let limits = Limits {
        max_tokens: 64,
        max_seqs: 4,
        max_positions: 3 * 4096,
    };
    let ctx = {
        let mut cfg = tiny.config(limits);
        cfg.n_threads = 2;
        let ctx = engram::Context::new(&cfg).expect("create");
        for l in &tiny.layers {
            ctx.set_layer(engram::LayerIn::host(
                l.layer_id,
                &l.table,
                engram::EngramType::row_format(l.format as u32, tiny.hd).unwrap(),
                l.rows,
                l.wkv.weights(),
                l.q.weights(),
                l.k.weights(),
            ))
            .expect("set_layer");
        }
        ctx
    };
    let (d, hc, hd, c) = (tiny.d, tiny.hc, tiny.hd, tiny.cols());
    let (k_in, k_out) = (c * hd, d * (hc + 1));
    let per = ctx.ids_per_token();
    let layer = tiny.layer_ids[0];

    // Twelve live tokens in sequence 0.
    let n = 12;
    let vocab = tiny.token_map.len();
    let tokens: Vec<i32> = (0..vocab as i32)
        .filter(|&t| tiny.token_map[t as usize] >= 0)
        .take(n)
        .collect();
    let (seq0, pos): (Vec<i32>, Vec<i32>) = (vec![0; n], (0..n as i32).collect());
    let mut ids = vec![0i64; n * per];
    ctx.hash(&tokens, &seq0, &pos, &mut ids).unwrap();

    let hw_in = values("alloc_failure.highway", n * hc * d, 1.0, 0.0);
    let apply = |hw: &mut [f32]| ctx.apply(layer, &ids, n, Highway::F32(hw));
    let mut reference = hw_in.clone();
    apply(&mut reference).unwrap();

    // engram_apply: the live ids, the gate's working values, the rows, kv.
    let apply_cases: [(&str, usize, usize, &str); 5] = [
        ("apply: live tokens", n * 8, 1, "row ids of"),
        ("apply: live row ids", n * c * 8, 1, "row ids of"),
        (
            "apply: the gate's streams",
            hc * d * 4,
            1,
            "the gate's streams",
        ),
        ("apply: gathered rows", n * k_in * 2, 1, "the gathered rows"),
        ("apply: kv", n * k_out * 4, 1, "kv"),
    ];
    for (case, size, nth, what) in apply_cases {
        let mut hw = hw_in.clone();
        let (r, fired) = failing(size, nth, || apply(&mut hw));
        expect_capacity(case, r, fired, what);
        assert!(hw == hw_in, "{case}: the highway is untouched");
        let mut hw = hw_in.clone();
        apply(&mut hw).unwrap();
        assert!(hw == reference, "{case}: the next apply is exact");
    }

    // engram_prefetch: the staged ids and each job's ids (two workers: two
    // jobs of half the ids each); the worker's buffer for the rows, whose
    // failure the apply that uses the stage reports.
    let k = n * c;
    let job = k.div_ceil(2).max(16).min(k);
    let rb = engram::EngramType::row_format(tiny.layers[0].format as u32, hd)
        .unwrap()
        .row_bytes(hd);
    let prefetch_cases: [(&str, usize, usize, &str); 2] = [
        ("prefetch: the staged ids", k * 8, 2, "to stage"),
        ("prefetch: a job's ids", job * 8, 1, "to stage"),
    ];
    for (case, size, nth, what) in prefetch_cases {
        let (r, fired) = failing(size, nth, || ctx.prefetch(layer, &ids, n));
        expect_capacity(case, r, fired, what);
        let mut hw = hw_in.clone();
        apply(&mut hw).unwrap();
        assert!(hw == reference, "{case}: the next apply is exact");
    }
    let mut hw = hw_in.clone();
    let (r, fired) = failing(job * rb, 1, || {
        ctx.prefetch(layer, &ids, n).unwrap();
        apply(&mut hw)
    });
    expect_capacity("prefetch: a worker's rows", r, fired, "staged rows");
    assert!(
        hw == hw_in,
        "prefetch: a worker's rows: the highway is untouched"
    );
    let mut hw = hw_in.clone();
    ctx.prefetch(layer, &ids, n).unwrap();
    apply(&mut hw).unwrap();
    assert!(
        hw == reference,
        "after a failed stage, prefetch + apply is exact"
    );

    // engram_read_back: its two outputs.
    let back = ctx.read_back(layer, RowIds::Host(&ids), n).unwrap();
    for (case, size, what) in [
        ("read_back: rows", n * k_in * 2, "the rows read back"),
        ("read_back: kv", n * k_out * 2, "the kv read back"),
    ] {
        let (r, fired) = failing(size, 1, || {
            ctx.read_back(layer, RowIds::Host(&ids), n).map(|_| ())
        });
        expect_capacity(case, r, fired, what);
        assert_eq!(ctx.read_back(layer, RowIds::Host(&ids), n).unwrap(), back);
    }

    // engram_seq_copy: sequence 1 holds positions on two history pages
    // (16 KB each); sequence 2 holds other tokens. Failing either page's copy
    // leaves sequence 2 as it was.
    let mut scratch = vec![0i64; n * per];
    ctx.hash(&tokens, &vec![1; n], &pos, &mut scratch).unwrap();
    // A dead token needs no look-back: position 5000 alone, on the second page.
    ctx.hash(&[engram::TOKEN_DEAD], &[1], &[5000], &mut scratch[..per])
        .unwrap();
    let other: Vec<i32> = tokens.iter().rev().copied().collect();
    ctx.hash(&other, &vec![2; n], &pos, &mut scratch).unwrap();
    // The next position of sequence 2 after its own history.
    let probe = |ctx: &engram::Context<'_>| {
        let mut out = vec![0i64; per];
        ctx.hash(&[tokens[0]], &[2], &[n as i32], &mut out).unwrap();
        out
    };
    // (The probe writes position n of sequence 2, the same each time.)
    let before = probe(&ctx);
    let len = ctx.seq_len(2).unwrap();
    for nth in [1, 2] {
        let case = format!("seq_copy: history page {nth}");
        let (r, fired) = failing(4096 * 4, nth, || ctx.seq_copy(1, 2));
        expect_capacity(&case, r, fired, "history");
        assert_eq!(
            ctx.seq_len(2).unwrap(),
            len,
            "{case}: sequence 2 keeps its length"
        );
        assert_eq!(probe(&ctx), before, "{case}: sequence 2 keeps its history");
    }
    ctx.seq_copy(1, 2).unwrap();
    assert_eq!(ctx.seq_len(2).unwrap(), 5001);

    // engram_create: the histories of max_seqs sequences (24 bytes each).
    let mut cfg = tiny.config(Limits {
        max_seqs: 1000,
        ..limits
    });
    cfg.n_threads = 2;
    let (r, fired) = failing(1000 * 24, 1, || engram::Context::new(&cfg).map(drop));
    expect_capacity("create: max_seqs histories", r, fired, "max_seqs");
    engram::Context::new(&cfg).expect("create after the failure");

    // engram_create: the copy of a caller's token map (a size of its own:
    // 1,000,003 entries of 4 bytes).
    let big_map: Vec<i32> = (0..1_000_003).map(|t| tiny.token_map[t % vocab]).collect();
    let mut cfg = tiny.config(limits);
    cfg.tables.token_map = &big_map;
    let (r, fired) = failing(big_map.len() * 4, 1, || {
        engram::Context::new(&cfg).map(drop)
    });
    expect_capacity("create: the token map", r, fired, "token_map");
    engram::Context::new(&cfg).expect("create after the failure");
}
