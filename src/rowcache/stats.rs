//! A tier's statistics: relaxed atomic counters and a log2 histogram of
//! read latencies, bumped by the threads that read rows (no lock) and read
//! by a poller at any time.

use super::PolicyKind;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Latency buckets: bucket 0 holds reads under 1 us, bucket `b` those of
/// `[2^(b-1), 2^b)` us; the last one everything longer.
pub const LATENCY_BUCKETS: usize = 40;

/// One tier's counters (see [`Snapshot`] for what each means).
pub struct TierStats {
    lookups: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    reads: AtomicU64,
    evictions: AtomicU64,
    insertions: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
    /// The configuration: budget, rows it can hold, row bytes, bytes it
    /// allocated, and the policy (0: no cache, else 1 + its index in
    /// [`PolicyKind::ALL`]).
    budget: AtomicU64,
    capacity_rows: AtomicU64,
    row_bytes: AtomicU64,
    memory_bytes: AtomicU64,
    policy: AtomicU64,
    /// Rows held (insertions that evicted nothing since configured).
    held: AtomicU64,
}

/// What a poller reads: counters since the last reset, and the tier's
/// configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Rows looked up in the cache, and how many were there or not.
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Bytes read from the tier below (storage), and the reads issued
    /// (after deduplication: a row missed twice in one read is read once).
    pub bytes_read: u64,
    pub reads: u64,
    /// Rows the cache dropped to make room, and rows it took in.
    pub evictions: u64,
    pub insertions: u64,
    /// Read latency quantiles in microseconds (the upper bound of the log2
    /// bucket the quantile falls in: within 2x above); 0 with no read.
    pub read_p50_us: u64,
    pub read_p90_us: u64,
    pub read_p99_us: u64,
    /// The cache's budget (bytes of rows), the rows it can hold, the bytes
    /// of a row, the bytes it allocated (rows and bookkeeping); all 0 when
    /// there is no cache.
    pub budget: u64,
    pub capacity_rows: u64,
    /// Rows it holds now.
    pub rows_held: u64,
    pub row_bytes: u64,
    pub memory_bytes: u64,
    /// The replacement policy (`None`: no cache).
    pub policy: Option<PolicyKind>,
}

impl Default for TierStats {
    fn default() -> Self {
        let z = || AtomicU64::new(0);
        TierStats {
            lookups: z(),
            hits: z(),
            misses: z(),
            bytes_read: z(),
            reads: z(),
            evictions: z(),
            insertions: z(),
            latency: std::array::from_fn(|_| z()),
            budget: z(),
            capacity_rows: z(),
            row_bytes: z(),
            memory_bytes: z(),
            policy: z(),
            held: z(),
        }
    }
}

/// A tier of a table: where its rows may be found, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// The device cache (CUDA; not kept yet).
    Device,
    /// The host row cache.
    Host,
    /// The file itself (not kept apart yet: the host tier counts its reads).
    Storage,
}

/// The bucket of a read of `us` microseconds.
fn bucket(us: u64) -> usize {
    ((64 - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

impl TierStats {
    /// Rows looked up: `hits` of `lookups` were held.
    pub fn record_lookups(&self, lookups: u64, hits: u64) {
        self.lookups.fetch_add(lookups, Relaxed);
        self.hits.fetch_add(hits, Relaxed);
        self.misses.fetch_add(lookups - hits, Relaxed);
    }

    /// One read of `bytes` from storage that took `us` microseconds.
    pub fn record_read(&self, bytes: u64, us: u64) {
        self.reads.fetch_add(1, Relaxed);
        self.bytes_read.fetch_add(bytes, Relaxed);
        self.latency[bucket(us)].fetch_add(1, Relaxed);
    }

    /// A row taken in, which evicted another when `evicted`.
    pub fn record_insertion(&self, evicted: bool) {
        self.insertions.fetch_add(1, Relaxed);
        if evicted {
            self.evictions.fetch_add(1, Relaxed);
        } else {
            self.held.fetch_add(1, Relaxed);
        }
    }

    /// The tier's configuration (a cache of `capacity_rows` rows of
    /// `row_bytes` under `budget`, `memory_bytes` allocated; `policy` `None`
    /// and zeros: no cache).
    pub fn configure(
        &self,
        budget: u64,
        capacity_rows: u64,
        row_bytes: u64,
        memory_bytes: u64,
        policy: Option<PolicyKind>,
    ) {
        self.budget.store(budget, Relaxed);
        self.capacity_rows.store(capacity_rows, Relaxed);
        self.row_bytes.store(row_bytes, Relaxed);
        self.memory_bytes.store(memory_bytes, Relaxed);
        self.held.store(0, Relaxed);
        let p = policy.map_or(0, |k| {
            1 + PolicyKind::ALL.iter().position(|&x| x == k).unwrap_or(0) as u64
        });
        self.policy.store(p, Relaxed);
    }

    /// Zero the counters (not the configuration). Counts made while it runs
    /// may land on either side.
    pub fn reset(&self) {
        for c in [
            &self.lookups,
            &self.hits,
            &self.misses,
            &self.bytes_read,
            &self.reads,
            &self.evictions,
            &self.insertions,
        ] {
            c.store(0, Relaxed);
        }
        for b in &self.latency {
            b.store(0, Relaxed);
        }
    }

    /// The counters and configuration now (each read relaxed: a snapshot
    /// taken while reads run may be a few counts apart between fields).
    pub fn snapshot(&self) -> Snapshot {
        let hist: [u64; LATENCY_BUCKETS] = std::array::from_fn(|b| self.latency[b].load(Relaxed));
        let q = |f: f64| quantile(&hist, f);
        let policy = match self.policy.load(Relaxed) {
            0 => None,
            p => PolicyKind::ALL.get(p as usize - 1).copied(),
        };
        Snapshot {
            lookups: self.lookups.load(Relaxed),
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            reads: self.reads.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            insertions: self.insertions.load(Relaxed),
            read_p50_us: q(0.50),
            read_p90_us: q(0.90),
            read_p99_us: q(0.99),
            budget: self.budget.load(Relaxed),
            capacity_rows: self.capacity_rows.load(Relaxed),
            rows_held: self.held.load(Relaxed),
            row_bytes: self.row_bytes.load(Relaxed),
            memory_bytes: self.memory_bytes.load(Relaxed),
            policy,
        }
    }
}

/// The upper bound (us) of the bucket holding quantile `f` of `hist`; 0 for
/// an empty histogram.
fn quantile(hist: &[u64; LATENCY_BUCKETS], f: f64) -> u64 {
    let n: u64 = hist.iter().sum();
    if n == 0 {
        return 0;
    }
    // The rank of the quantile: at least 1, at most n.
    let rank = ((n as f64 * f).ceil() as u64).clamp(1, n);
    let mut seen = 0;
    for (b, &c) in hist.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return 1u64 << b;
        }
    }
    1u64 << (LATENCY_BUCKETS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_from_the_log2_buckets() {
        let s = TierStats::default();
        assert_eq!(s.snapshot().read_p50_us, 0);
        // 90 reads of 3 us (bucket [2, 4)), 9 of 100 us ([64, 128)), one of
        // 5000 us ([4096, 8192)).
        for _ in 0..90 {
            s.record_read(264, 3);
        }
        for _ in 0..9 {
            s.record_read(264, 100);
        }
        s.record_read(264, 5000);
        let v = s.snapshot();
        assert_eq!((v.read_p50_us, v.read_p90_us, v.read_p99_us), (4, 4, 128));
        s.record_read(264, 5000);
        assert_eq!(s.snapshot().read_p99_us, 8192);
        assert_eq!((v.reads, v.bytes_read), (100, 26_400));
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(1), 1);
        assert_eq!(bucket(u64::MAX), LATENCY_BUCKETS - 1);
        s.record_lookups(10, 7);
        s.record_insertion(true);
        s.configure(1000, 3, 264, 900, Some(PolicyKind::Clock));
        let v = s.snapshot();
        assert_eq!((v.lookups, v.hits, v.misses), (10, 7, 3));
        assert_eq!((v.insertions, v.evictions), (1, 1));
        assert_eq!(v.policy, Some(PolicyKind::Clock));
        s.reset();
        let v = s.snapshot();
        assert_eq!(
            (v.lookups, v.reads, v.read_p99_us, v.insertions),
            (0, 0, 0, 0)
        );
        assert_eq!((v.budget, v.capacity_rows), (1000, 3));
    }
}
