//! The host cost of the CUDA backend's device row cache (docs/row-cache.md
//! "Device tier"): `devcache::Plan::plan` for one call of V4.1's geometry
//! (C = 24 ids a token, packed fp8 rows of 264 bytes) against its peer
//! measured in the same run, the host work every call does anyway: copying
//! the call's rows from a table in host memory into the staging buffer.
//! Also the row bytes the call copies to the device, cached against
//! uncached. No GPU: the kernels' and the copies' time is for a GPU run.
//!
//! The ids are synthetic (not real token traffic): per token 24 ids, each
//! hot (one of 2,000 rows) with probability 1/2, else uniform over the
//! table, a fresh draw per call; the cache holds 64 Ki rows (16.5 MiB) of a
//! table of 1 Mi rows. Prints the median of 9 runs per size.
//!
//!     cargo bench --bench devcache

use engram::cuda::devcache::{Counters, Plan};
use engram::rowcache::policy::PolicyKind;
use std::time::Instant;

const C: usize = 24;
const RB: usize = 264;
const TABLE_ROWS: usize = 1 << 20;
const CACHE_ROWS: usize = 1 << 16;

fn ids_for(n: usize, seed: u64) -> Vec<i64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n * C)
        .map(|_| {
            let r = next();
            if r & 1 == 0 {
                ((r >> 1) % 2000) as i64
            } else {
                ((r >> 1) % TABLE_ROWS as u64) as i64
            }
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let table: Vec<u8> = (0..TABLE_ROWS * RB).map(|i| (i * 31 % 251) as u8).collect();
    println!(
        "## Device row cache: host cost of a call's plan (V4.1 geometry, C = {C}, {RB}-byte rows)"
    );
    println!();
    println!(
        "| tokens | plan (us) | gather rows to staging (us, peer) | plan / gather | H2D bytes cached / uncached (warm) |"
    );
    println!("|---|---|---|---|---|");
    for n in [1usize, 8, 64, 512, 4096] {
        let cells = n * C;
        let tokens: Vec<usize> = (0..n).collect();
        let mut rows = vec![0u8; cells * RB];
        let mut slots = vec![0u32; cells];
        let mut fill = vec![0u32; 2 * cells];
        let mut plan = Plan::new(PolicyKind::Lru, CACHE_ROWS, cells).unwrap();
        let counters = Counters::default();
        // Warm the cache with 200 calls.
        for s in 0..200 {
            let ids = ids_for(n, s);
            plan.plan(
                &ids,
                &tokens,
                C,
                &mut rows,
                RB,
                cells as u32,
                &mut slots,
                &mut fill,
                &counters,
            )
            .unwrap();
        }
        let before = counters.snapshot(CACHE_ROWS as u64, PolicyKind::Lru);
        let (mut t_plan, mut t_gather) = (Vec::new(), Vec::new());
        let mut uncached = 0u64;
        for run in 0..9u64 {
            let ids = ids_for(n, 1000 + run);
            let t0 = Instant::now();
            for (j, &id) in ids.iter().enumerate() {
                let at = id as usize * RB;
                rows[j * RB..(j + 1) * RB].copy_from_slice(&table[at..at + RB]);
            }
            t_gather.push(t0.elapsed().as_secs_f64() * 1e6);
            uncached += (cells * RB) as u64;
            let t1 = Instant::now();
            plan.plan(
                &ids,
                &tokens,
                C,
                &mut rows,
                RB,
                cells as u32,
                &mut slots,
                &mut fill,
                &counters,
            )
            .unwrap();
            t_plan.push(t1.elapsed().as_secs_f64() * 1e6);
        }
        let after = counters.snapshot(CACHE_ROWS as u64, PolicyKind::Lru);
        let (p, g) = (median(t_plan), median(t_gather));
        println!(
            "| {n} | {p:.1} | {g:.1} | {:.2}x | {:.2} |",
            p / g,
            (after.bytes_h2d - before.bytes_h2d) as f64 / uncached as f64
        );
    }
}
