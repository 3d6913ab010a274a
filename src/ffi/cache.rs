//! Table tiers and their statistics: what each layer's host row cache holds
//! and what reading the table cost (docs/row-cache.md).

use super::boundary::{read_options, write_options, Options};
use super::context::{ctx, EngramContext};
use crate::error::bail;
use crate::rowcache::{PolicyKind, Snapshot, Tier};
use std::ffi::c_char;

/// A tier of a table, fastest first: where its rows may be found.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngramCacheTier {
    /// The device cache of a host-backed table on CUDA (not kept yet:
    /// `ENGRAM_STATUS_ERR_UNSUPPORTED`).
    Device = 1,
    /// The host row cache in front of a table read from a file
    /// (`row_cache_bytes` in the loaders' options).
    Host = 2,
    /// The file itself (not kept apart yet: `ENGRAM_STATUS_ERR_UNSUPPORTED`;
    /// the host tier counts the reads it issues to the file).
    Storage = 3,
}

/// A row cache's replacement policy, as `engram_cache_stats` reports it.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngramCachePolicy {
    /// No cache (a budget of 0, a table in memory or mapped, a budget too
    /// small for one row).
    None = 0,
    /// Exact least recently used.
    Lru = 1,
    /// CLOCK (one reference bit a row).
    Clock = 2,
    /// S3-FIFO (small and main FIFOs and a ghost queue; the default).
    S3fifo = 3,
}

/// One layer's statistics of one tier (`engram_cache_stats_read`). Fill it with
/// `engram_cache_stats_init`, which sets `struct_size`; every other field is
/// written by the call. Counters run since the context was created or last
/// reset (`engram_cache_stats_reset`); the configuration fields are not
/// reset. Layouts accepted (`struct_size`): this header's.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EngramCacheStats {
    /// `sizeof(engram_cache_stats)` of the caller's header (set by `engram_cache_stats_init`).
    pub struct_size: usize,
    /// Rows looked up in the cache (one per row id a gather read, repeats
    /// included), and how many were held (`hits`) or not (`misses`).
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Bytes read from the tier below (the file), and the reads issued: a
    /// row missed twice in one gather is read once.
    pub bytes_read: u64,
    pub reads: u64,
    /// Rows the cache dropped to make room, and rows it took in.
    pub evictions: u64,
    pub insertions: u64,
    /// Read latency quantiles in microseconds, from a log2 histogram of
    /// every read's time: the upper bound of the bucket the quantile falls
    /// in (at most 2x the true value); 0 before any read.
    pub read_p50_us: u64,
    pub read_p90_us: u64,
    pub read_p99_us: u64,
    /// The layer's budget (bytes of rows), the rows it can hold, the rows it
    /// holds, the bytes of a row, and the bytes the cache allocated (its
    /// rows and bookkeeping: at most `capacity_rows * (row_bytes + 64)` plus
    /// 6 KiB). All 0 without a cache, except `row_bytes`.
    pub budget: u64,
    pub capacity_rows: u64,
    pub rows_held: u64,
    pub row_bytes: u64,
    pub memory_bytes: u64,
    /// `ENGRAM_CACHE_POLICY_*`, and its name (`"none"`, `"lru"`, `"clock"`,
    /// `"s3fifo"`: a static string the library owns).
    pub policy: u32,
    pub policy_name: *const c_char,
}

/// The `engram_cache_stats` layouts this library reads: only today's.
const CACHE_STATS_LAYOUTS: &[usize] = &[size_of::<EngramCacheStats>()];

impl Options for EngramCacheStats {
    const INIT: &'static str = "engram_cache_stats_init";
}

impl Default for EngramCacheStats {
    fn default() -> Self {
        EngramCacheStats {
            struct_size: size_of::<EngramCacheStats>(),
            lookups: 0,
            hits: 0,
            misses: 0,
            bytes_read: 0,
            reads: 0,
            evictions: 0,
            insertions: 0,
            read_p50_us: 0,
            read_p90_us: 0,
            read_p99_us: 0,
            budget: 0,
            capacity_rows: 0,
            rows_held: 0,
            row_bytes: 0,
            memory_bytes: 0,
            policy: EngramCachePolicy::None as u32,
            policy_name: c"none".as_ptr(),
        }
    }
}

impl EngramCacheStats {
    fn of(s: &Snapshot, struct_size: usize) -> EngramCacheStats {
        let (policy, name) = match s.policy {
            None => (EngramCachePolicy::None, c"none"),
            Some(PolicyKind::Lru) => (EngramCachePolicy::Lru, c"lru"),
            Some(PolicyKind::Clock) => (EngramCachePolicy::Clock, c"clock"),
            Some(PolicyKind::S3Fifo) => (EngramCachePolicy::S3fifo, c"s3fifo"),
        };
        EngramCacheStats {
            struct_size,
            lookups: s.lookups,
            hits: s.hits,
            misses: s.misses,
            bytes_read: s.bytes_read,
            reads: s.reads,
            evictions: s.evictions,
            insertions: s.insertions,
            read_p50_us: s.read_p50_us,
            read_p90_us: s.read_p90_us,
            read_p99_us: s.read_p99_us,
            budget: s.budget,
            capacity_rows: s.capacity_rows,
            rows_held: s.rows_held,
            row_bytes: s.row_bytes,
            memory_bytes: s.memory_bytes,
            policy: policy as u32,
            policy_name: name.as_ptr(),
        }
    }
}

/// Fill `stats`'s first `struct_size` bytes with the defaults (zeros, no
/// policy, `struct_size` set). NULL is ignored. Call it through the header's
/// `engram_cache_stats_init(stats)`.
#[no_mangle]
pub extern "C" fn engram_cache_stats_init_sized(stats: *mut EngramCacheStats, struct_size: usize) {
    ffi_boundary!({ write_options(stats, EngramCacheStats::default(), struct_size) })
}

/// Engram layer index `layer_index`'s (0 to `n_layers - 1`, as in
/// `engram_context_info`) statistics of tier `tier` (`ENGRAM_CACHE_TIER_*`)
/// into `*stats`. Safe to call at any time from any thread, also while
/// other threads apply and prefetch (every counter is read without a lock;
/// fields read while reads run may be a few counts apart). A layer without a
/// cache reports zeros and `ENGRAM_CACHE_POLICY_NONE`. Statuses:
/// `ERR_NULL_ARGUMENT` (`ctx` or `stats`), `ERR_STRUCT_SIZE`,
/// `ERR_INVALID_ARGUMENT` (a layer index out of range, an unknown tier),
/// `ERR_UNSUPPORTED` (a tier this library does not keep yet). On error
/// nothing is written.
#[no_mangle]
pub extern "C" fn engram_cache_stats_read(
    ctx: *const EngramContext,
    layer_index: u32,
    tier: u32,
    stats: *mut EngramCacheStats,
) -> crate::EngramStatus {
    ffi_boundary!({
        let c = self::ctx(ctx)?;
        let o = read_options(
            stats,
            EngramCacheStats::default(),
            CACHE_STATS_LAYOUTS,
            "stats",
        )?;
        let tier = match tier {
            t if t == EngramCacheTier::Device as u32 => Tier::Device,
            t if t == EngramCacheTier::Host as u32 => Tier::Host,
            t if t == EngramCacheTier::Storage as u32 => Tier::Storage,
            t => bail!(ErrInvalidArgument, "tier {t} (not an ENGRAM_CACHE_TIER_*)"),
        };
        let s = c.cache_stats(layer_index as usize, tier)?;
        write_options(
            stats,
            EngramCacheStats::of(&s, o.struct_size),
            o.struct_size,
        );
        Ok(())
    })
}

/// Zero every layer's and tier's counters (the configuration stays). Safe
/// to call while other threads apply, prefetch or poll (counts made
/// meanwhile may land on either side). `ERR_NULL_ARGUMENT` for a NULL `ctx`.
#[no_mangle]
pub extern "C" fn engram_cache_stats_reset(ctx: *const EngramContext) -> crate::EngramStatus {
    ffi_boundary!({
        self::ctx(ctx)?.cache_stats_reset();
        Ok(())
    })
}
