//! The cache against the rows it was given: every row read through it is
//! the row's own bytes, under every policy, budget and thread count.

use super::{RowCache, TierStats};
use crate::rowcache::PolicyKind;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Row `id`'s bytes (distinct for every id and position).
fn row_of(id: u64, rb: usize) -> Vec<u8> {
    (0..rb)
        .map(|i| (id.wrapping_mul(2654435761).wrapping_add(i as u64 * 97) >> 3) as u8)
        .collect()
}

fn cache(budget: u64, rb: usize, kind: PolicyKind) -> RowCache {
    RowCache::new(budget, rb, kind, Arc::new(TierStats::default()))
        .unwrap()
        .expect("a budget of at least one row")
}

#[test]
fn rows_read_through_are_their_own_bytes_on_every_policy_budget_and_thread_count() {
    let rb = 80;
    for kind in PolicyKind::ALL {
        for rows in [1u64, 3, 64, 1000, 20_000] {
            for threads in 1..=4u64 {
                let c = cache(rows * rb as u64 + 5, rb, kind);
                assert_eq!(c.capacity_rows() as u64, rows);
                let reads = AtomicU64::new(0);
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let (c, reads) = (&c, &reads);
                        s.spawn(move || {
                            let mut x = 0x9E37_79B9u64 ^ (t << 20) ^ rows;
                            for _ in 0..40 {
                                let ids: Vec<u64> = (0..37)
                                    .map(|_| {
                                        x ^= x << 13;
                                        x ^= x >> 7;
                                        x ^= x << 17;
                                        (x % 3000).min(x % 3001) // repeats and hot ids
                                    })
                                    .collect();
                                let mut dst = vec![0u8; ids.len() * rb];
                                c.read_through(&ids, &mut dst, |misses| {
                                    // Unique and sorted.
                                    assert!(misses.windows(2).all(|w| w[0].0 < w[1].0));
                                    for (id, d) in misses.iter_mut() {
                                        d.copy_from_slice(&row_of(*id, rb));
                                        reads.fetch_add(1, Relaxed);
                                    }
                                    Ok(())
                                })
                                .unwrap();
                                for (id, d) in ids.iter().zip(dst.chunks_exact(rb)) {
                                    assert_eq!(d, &row_of(*id, rb)[..], "{kind:?} {rows} rows");
                                }
                            }
                        });
                    }
                });
                let v = c.stats().snapshot();
                assert_eq!(v.lookups, threads * 40 * 37);
                assert_eq!(v.hits + v.misses, v.lookups);
                assert!(reads.load(Relaxed) <= v.misses);
                assert!(v.insertions <= reads.load(Relaxed));
                assert!(v.insertions - v.evictions <= rows);
                if rows >= 1000 {
                    assert!(v.hits > 0, "{kind:?} {rows}: {v:?}");
                }
            }
        }
    }
}

#[test]
fn a_step_reads_each_missed_row_once() {
    let rb = 16;
    let c = cache(1 << 20, rb, PolicyKind::S3Fifo);
    let ids = [5u64, 9, 5, 5, 2, 9, 7];
    let mut dst = vec![0u8; ids.len() * rb];
    let mut seen = Vec::new();
    c.read_through(&ids, &mut dst, |m| {
        for (id, d) in m.iter_mut() {
            seen.push(*id);
            d.copy_from_slice(&row_of(*id, rb));
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(seen, [2, 5, 7, 9]);
    for (id, d) in ids.iter().zip(dst.chunks_exact(rb)) {
        assert_eq!(d, &row_of(*id, rb)[..]);
    }
    // Now all held: no read.
    c.read_through(&ids, &mut dst, |_| panic!("nothing to read"))
        .unwrap();
    let v = c.stats().snapshot();
    assert_eq!((v.lookups, v.hits, v.misses, v.insertions), (14, 7, 7, 4));
    // A read that fails is the error, and nothing is taken in.
    let e = c
        .read_through(&[100, 101], &mut vec![0u8; 2 * rb], |_| {
            crate::error::bail!(ErrIo, "cut short")
        })
        .unwrap_err();
    assert_eq!(e.status, crate::EngramStatus::ErrIo);
    assert!(!c.get(100, &mut [0u8; 16]));
}

#[test]
fn memory_stays_within_the_budget_and_the_stated_overhead() {
    for kind in PolicyKind::ALL {
        for (budget, rb) in [
            (264u64, 264usize),
            (1000, 264),
            (1 << 20, 80),
            (64 << 20, 264),
        ] {
            let c = cache(budget, rb, kind);
            let rows = c.capacity_rows();
            assert!((rows * rb) as u64 <= budget);
            assert!((budget - (rows * rb) as u64) < rb as u64);
            assert!(
                c.memory_bytes() <= RowCache::memory_bound(rows, rb),
                "{kind:?} {budget}"
            );
            assert_eq!(c.stats().snapshot().memory_bytes, c.memory_bytes() as u64);
        }
    }
}

#[test]
fn a_budget_of_no_row_is_no_cache_and_one_out_of_reach_is_err_capacity() {
    let st = Arc::new(TierStats::default());
    assert!(RowCache::new(263, 264, PolicyKind::Lru, st.clone())
        .unwrap()
        .is_none());
    assert_eq!(st.snapshot().policy, None);
    for budget in [u64::MAX, u64::MAX / 2, 1 << 62] {
        let e = RowCache::new(budget, 264, PolicyKind::S3Fifo, st.clone()).err();
        assert_eq!(e.expect("refused").status, crate::EngramStatus::ErrCapacity);
    }
    // Just more than the machine's memory: refused before any allocation.
    let ram = super::physical_memory().expect("Linux says");
    let e = RowCache::new(ram + 4096, 4096, PolicyKind::Lru, st.clone()).err();
    let e = e.expect("refused");
    assert_eq!(e.status, crate::EngramStatus::ErrCapacity);
    assert!(e.message.contains("machine's memory"), "{}", e.message);
}
