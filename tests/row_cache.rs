//! The host row cache (docs/row-cache.md) in front of a GGUF file's tables:
//! every apply equals a resident (memory) table's, bit for bit, with random
//! ids (repeats included), budgets from none to every row (tiny ones evict
//! all the time), 1 to 4 threads, prefetched or not; the statistics add up;
//! a file cut short under the cache is `ErrIo`.

mod common;

use common::*;
use engram::gguf::{GgufModel, GgufOptions, LoadOptions};
use engram::rowcache::{PolicyKind, Tier};
use engram::{EngramStatus, Highway};

fn open_pread(path: &std::path::Path) -> GgufModel {
    GgufModel::open(path, &LoadOptions::default()).unwrap()
}

fn options(tiny: &Tiny, threads: usize, budget: u64) -> GgufOptions {
    GgufOptions {
        n_threads: threads,
        row_cache_bytes: budget,
        ..cpu_gguf_options(tiny.eps)
    }
}

/// `n` tokens of random row ids (each layer's below its table's rows), hot
/// ids and repeats within a step included.
fn random_ids(tiny: &Tiny, per: usize, n: usize, seed: &mut u64) -> Vec<i64> {
    let cols = per / tiny.layers.len();
    (0..n * per)
        .map(|i| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            let rows = tiny.layers[(i / cols) % tiny.layers.len()].rows;
            // A third of the ids from the first 8 rows: repeats and hits.
            let r = if (*seed).is_multiple_of(3) {
                8.min(rows)
            } else {
                rows
            };
            ((*seed >> 8) % r) as i64
        })
        .collect()
}

fn apply(ctx: &engram::Context, tiny: &Tiny, lid: u32, ids: &[i64], n: usize) -> Vec<f32> {
    let mut h = values("rc.h", n * tiny.hc * tiny.d, 1.0, 0.0);
    ctx.apply(lid, ids, n, Highway::F32(&mut h)).unwrap();
    h
}

/// Steps of random ids through `ctx` (prefetched every other step, the
/// next step prefetched ahead on some) against the resident `want`.
fn check_steps(tiny: &Tiny, ctx: &engram::Context, want: &engram::Context, what: &str) {
    let per = ctx.ids_per_token();
    let mut seed = 0x5EED_0000_0001 ^ what.len() as u64;
    let steps: Vec<(Vec<i64>, usize)> = [1usize, 3, 8, 1, 16, 2, 5, 12, 1, 7]
        .iter()
        .map(|&n| (random_ids(tiny, per, n, &mut seed), n))
        .collect();
    for (i, (ids, n)) in steps.iter().enumerate() {
        for &lid in &tiny.layer_ids {
            if i % 2 == 0 {
                ctx.prefetch(lid, ids, *n).unwrap();
                if let Some((next, nn)) = steps.get(i + 1).filter(|_| i % 4 == 0) {
                    ctx.prefetch(lid, next, *nn).unwrap();
                }
            }
            let got = apply(ctx, tiny, lid, ids, *n);
            assert_eq!(
                got,
                apply(want, tiny, lid, ids, *n),
                "{what}: step {i} layer {lid}"
            );
        }
    }
}

#[test]
fn applies_through_the_cache_equal_a_resident_tables() {
    let tiny = Tiny::load();
    let m = open_pread(&golden_dir().join("tiny.gguf"));
    let want = tiny.context();
    let nl = tiny.layers.len() as u64;
    let rb_max = 4 * tiny.hd as u64; // at most f32 rows
    for budget in [0, 1, 2 * rb_max * nl, 8 * rb_max * nl, 1 << 24] {
        for threads in 1..=4 {
            let ctx = m.context(&options(&tiny, threads, budget)).unwrap();
            check_steps(
                &tiny,
                &ctx,
                &want,
                &format!("budget {budget}, {threads} threads"),
            );
            for li in 0..tiny.layers.len() {
                let s = ctx.cache_stats(li, Tier::Host).unwrap();
                if budget < 64 {
                    assert_eq!(
                        (s.policy, s.lookups, s.capacity_rows),
                        (None, 0, 0),
                        "{s:?}"
                    );
                    continue;
                }
                assert_eq!(s.policy, Some(engram::rowcache::DEFAULT_POLICY));
                assert_eq!(s.budget, budget / nl);
                assert!(s.capacity_rows * s.row_bytes <= s.budget);
                assert!(s.lookups > 0 && s.hits + s.misses == s.lookups, "{s:?}");
                assert!(s.reads <= s.misses && s.bytes_read == s.reads * s.row_bytes);
                assert!(s.rows_held <= s.capacity_rows && s.insertions >= s.rows_held);
                if budget == 1 << 24 {
                    assert!(s.hits > 0 && s.evictions == 0, "{s:?}");
                } else {
                    assert!(s.evictions > 0, "a tiny cache evicts: {s:?}");
                }
            }
        }
    }
}

#[test]
fn every_policy_gives_the_same_rows() {
    // The policy is chosen when the layers are set (ENGRAM_ROW_CACHE_POLICY,
    // read by this test's process only).
    let tiny = Tiny::load();
    let m = open_pread(&golden_dir().join("tiny.gguf"));
    let want = tiny.context();
    for k in PolicyKind::ALL {
        std::env::set_var("ENGRAM_ROW_CACHE_POLICY", k.name());
        let ctx = m.context(&options(&tiny, 2, 3000)).unwrap();
        std::env::remove_var("ENGRAM_ROW_CACHE_POLICY");
        check_steps(&tiny, &ctx, &want, k.name());
        let s = ctx.cache_stats(0, Tier::Host).unwrap();
        assert_eq!(s.policy, Some(k));
        assert!(s.evictions > 0 && s.hits > 0, "{k:?}: {s:?}");
        // Reset: counters zero, configuration kept.
        ctx.cache_stats_reset();
        let r = ctx.cache_stats(0, Tier::Host).unwrap();
        assert_eq!((r.lookups, r.reads, r.read_p99_us), (0, 0, 0));
        assert_eq!(
            (r.budget, r.capacity_rows, r.policy),
            (s.budget, s.capacity_rows, s.policy)
        );
    }
    std::env::set_var("ENGRAM_ROW_CACHE_POLICY", "arc");
    let e = m.context(&options(&tiny, 2, 3000)).err().unwrap();
    std::env::remove_var("ENGRAM_ROW_CACHE_POLICY");
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
}

#[test]
fn bad_layers_tiers_and_budgets() {
    let tiny = Tiny::load();
    let m = open_pread(&golden_dir().join("tiny.gguf"));
    let ctx = m.context(&options(&tiny, 1, 1 << 20)).unwrap();
    let st = |r: engram::Result<engram::rowcache::Snapshot>| r.unwrap_err().status;
    assert_eq!(
        st(ctx.cache_stats(tiny.layers.len(), Tier::Host)),
        EngramStatus::ErrInvalidArgument
    );
    assert_eq!(
        st(ctx.cache_stats(0, Tier::Device)),
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        st(ctx.cache_stats(0, Tier::Storage)),
        EngramStatus::ErrUnsupported
    );
    // A budget that cannot be had: ErrCapacity at create.
    for budget in [u64::MAX, 1 << 62] {
        let e = m.context(&options(&tiny, 1, budget)).err().unwrap();
        assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message);
    }
    // A mapped table is the page cache's: no row cache.
    let mm = GgufModel::open(
        &golden_dir().join("tiny.gguf"),
        &LoadOptions {
            mmap: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let ctx = mm.context(&options(&tiny, 1, 1 << 20)).unwrap();
    assert_eq!(ctx.cache_stats(0, Tier::Host).unwrap().policy, None);
}

#[test]
fn a_file_cut_short_under_the_cache_is_an_io_status() {
    let tiny = Tiny::load();
    let dir = std::env::temp_dir().join(format!("engram-rowcache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tiny.gguf");
    std::fs::copy(golden_dir().join("tiny.gguf"), &path).unwrap();
    let m = open_pread(&path);
    let ctx = m.context(&options(&tiny, 2, 1 << 20)).unwrap();
    let per = ctx.ids_per_token();
    let n = 4;
    // Rows 0..10, then rows 20..30 (never read before the cut).
    let ids: Vec<i64> = (0..n * per).map(|j| (j % 10) as i64).collect();
    let lid = tiny.layer_ids[0];
    // Read once: held now.
    let want = apply(&ctx, &tiny, lid, &ids, n);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(64)
        .unwrap();
    // The held rows still serve; a step with rows not held is ErrIo.
    assert_eq!(apply(&ctx, &tiny, lid, &ids, n), want);
    let other: Vec<i64> = ids.iter().map(|&i| i + 20).collect();
    for prefetch in [false, true] {
        if prefetch {
            ctx.prefetch(lid, &other, n).unwrap();
        }
        let x = values("rc.h", n * tiny.hc * tiny.d, 1.0, 0.0);
        let mut h = x.clone();
        let e = ctx.apply(lid, &other, n, Highway::F32(&mut h)).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
        assert_eq!(h, x);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
