//! The cache: rows of `rb` bytes in one arena, in shards by row id (each a
//! mutex around its policy and its part of the arena), so that threads
//! reading different rows rarely wait on each other and no lock spans the
//! whole cache.

use super::policy::{new_policy, Policy, PolicyKind, OVERHEAD_FIXED, OVERHEAD_PER_ROW};
use super::stats::TierStats;
use crate::error::{bail, Result};
use crate::fallible::try_room;
use std::sync::{Arc, Mutex};

/// Most shards a cache has.
pub const MAX_SHARDS: usize = 32;
/// Fewest rows a shard holds (a smaller cache has fewer shards).
const MIN_SHARD_ROWS: usize = 256;
/// Bytes a cache allocates besides its rows and its policies' bookkeeping
/// ([`OVERHEAD_PER_ROW`] a row): the cache and its shards.
pub const CACHE_FIXED_BYTES: usize = 4096;

/// Zeroed memory allocated fallibly and lazily (the pages are the kernel's
/// zero page until a row is written there).
struct Arena {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the arena is plain bytes; which thread touches which byte is the
// cache's business (each shard's range only under that shard's mutex).
unsafe impl Send for Arena {}
// SAFETY: as for `Send`: shared access goes through the shards' mutexes.
unsafe impl Sync for Arena {}

impl Arena {
    fn new(len: usize) -> Result<Arena> {
        let layout = std::alloc::Layout::array::<u8>(len.max(1));
        let Ok(layout) = layout else {
            bail!(ErrCapacity, "a row cache of {len} bytes");
        };
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        match std::ptr::NonNull::new(p) {
            Some(ptr) => Ok(Arena { ptr, len }),
            None => bail!(ErrCapacity, "out of memory for a row cache of {len} bytes"),
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let layout = std::alloc::Layout::array::<u8>(self.len.max(1)).expect("made in new");
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// The machine's physical memory in bytes, where the system says.
fn physical_memory() -> Option<u64> {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no memory-safety preconditions.
        let (pages, page) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        (pages > 0 && page > 0).then(|| (pages as u64).saturating_mul(page as u64))
    }
    #[cfg(not(unix))]
    {
        None
    }
}

struct Shard {
    policy: Mutex<Box<dyn Policy>>,
    /// Its first slot in the arena.
    base: usize,
}

/// A row cache of rows of `rb` bytes (see the module).
pub struct RowCache {
    rb: usize,
    shards: Vec<Shard>,
    arena: Arena,
    rows: usize,
    kind: PolicyKind,
    stats: Arc<TierStats>,
    memory: usize,
}

impl RowCache {
    /// A cache of as many rows of `rb` bytes as `budget` bytes hold, under
    /// `kind`, counting into `stats` (its configuration set here). `None`
    /// when the budget holds no row. `ErrCapacity` when the memory cannot be
    /// had: more rows than the machine's physical memory holds, or an
    /// allocation refused. (The arena's pages are taken as rows arrive.)
    pub fn new(
        budget: u64,
        rb: usize,
        kind: PolicyKind,
        stats: Arc<TierStats>,
    ) -> Result<Option<RowCache>> {
        let rows = if rb == 0 { 0 } else { budget / rb as u64 };
        if rows == 0 {
            stats.configure(budget, 0, rb as u64, 0, None);
            return Ok(None);
        }
        let Some(rows) = usize::try_from(rows)
            .ok()
            .filter(|r| r.checked_mul(rb).is_some())
        else {
            bail!(
                ErrCapacity,
                "a row cache of {budget} bytes does not fit this machine's addresses"
            );
        };
        if let Some(ram) = physical_memory().filter(|&m| (rows * rb) as u64 > m) {
            bail!(
                ErrCapacity,
                "a row cache of {} bytes of rows is more than this machine's memory ({ram} bytes)",
                rows * rb
            );
        }
        let n = (rows / MIN_SHARD_ROWS).clamp(1, MAX_SHARDS);
        let arena = Arena::new(rows * rb)?;
        let mut shards = try_room(n, "the row cache's shards")?;
        let mut base = 0;
        for i in 0..n {
            let cap = rows / n + usize::from(i < rows % n);
            shards.push(Shard {
                policy: Mutex::new(new_policy(kind, cap)?),
                base,
            });
            base += cap;
        }
        let overhead: usize = shards
            .iter()
            .map(|s| s.policy.lock().map_or(0, |p| p.overhead_bytes()))
            .sum();
        let memory = rows * rb + overhead + CACHE_FIXED_BYTES;
        stats.configure(budget, rows as u64, rb as u64, memory as u64, Some(kind));
        Ok(Some(RowCache {
            rb,
            shards,
            arena,
            rows,
            kind,
            stats,
            memory,
        }))
    }

    /// Rows it can hold.
    pub fn capacity_rows(&self) -> usize {
        self.rows
    }
    /// Bytes a row.
    pub fn row_bytes(&self) -> usize {
        self.rb
    }
    /// Its policy.
    pub fn policy(&self) -> PolicyKind {
        self.kind
    }
    /// Its statistics.
    pub fn stats(&self) -> &TierStats {
        &self.stats
    }
    /// Bytes it allocated: its rows, its policies' bookkeeping, and at most
    /// [`CACHE_FIXED_BYTES`] besides (an upper bound on the last).
    pub fn memory_bytes(&self) -> usize {
        self.memory
    }
    /// The most [`RowCache::memory_bytes`] may be for `rows` rows of `rb`.
    pub fn memory_bound(rows: usize, rb: usize) -> usize {
        rows * (rb + OVERHEAD_PER_ROW) + MAX_SHARDS * OVERHEAD_FIXED + CACHE_FIXED_BYTES
    }

    fn shard(&self, id: u64) -> &Shard {
        let h = id.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> 32;
        &self.shards[(h % self.shards.len() as u64) as usize]
    }

    /// The row of slot `s` of `shard`, which the caller holds the lock of.
    fn row(&self, shard: &Shard, s: u32) -> *mut u8 {
        let slot = shard.base + s as usize;
        debug_assert!(slot < self.rows);
        // SAFETY: a shard's slots are `base..base + cap` with `cap` its
        // policy's capacity, inside the arena's `rows * rb` bytes.
        unsafe { self.arena.ptr.as_ptr().add(slot * self.rb) }
    }

    /// Copy row `id` into `dst` (`rb` bytes) if it is held (the access is
    /// recorded); whether it was.
    pub fn get(&self, id: u64, dst: &mut [u8]) -> bool {
        assert_eq!(dst.len(), self.rb, "a row's bytes");
        let sh = self.shard(id);
        let mut p = sh.policy.lock().unwrap_or_else(|e| e.into_inner());
        let Some(s) = p.lookup(id) else { return false };
        // SAFETY: the slot's row lies in the shard's part of the arena, which
        // only this shard's lock holder touches; `dst` is a distinct buffer
        // of `rb` bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.row(sh, s), dst.as_mut_ptr(), self.rb) };
        drop(p);
        true
    }

    /// Take row `id` (`src`, `rb` bytes) in, evicting another if the policy
    /// says so. A row already held (another thread read it meanwhile) is
    /// left as it is: the bytes are the same.
    pub fn insert(&self, id: u64, src: &[u8]) {
        assert_eq!(src.len(), self.rb, "a row's bytes");
        let sh = self.shard(id);
        let mut p = sh.policy.lock().unwrap_or_else(|e| e.into_inner());
        if p.lookup(id).is_some() {
            return;
        }
        let Some((s, old)) = p.admit(id) else { return };
        // SAFETY: as in `get`; the slot was just handed out for `id` under
        // the shard's lock, and `src` is a distinct buffer of `rb` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.row(sh, s), self.rb) };
        drop(p);
        self.stats.record_insertion(old.is_some());
    }
}

/// A miss to read: its row id, and where its bytes go (`rb` of them).
pub type Miss<'a> = (u64, &'a mut [u8]);

impl RowCache {
    /// Rows `ids` into `dst` (`rb` bytes each, back to back): hits copied
    /// from the cache; the misses deduplicated (an id missed twice is read
    /// once), sorted by id, read by `read` in one call, taken in, and copied
    /// to their duplicates. Counts the lookups.
    pub fn read_through(
        &self,
        ids: &[u64],
        dst: &mut [u8],
        read: impl FnOnce(&mut [Miss<'_>]) -> Result<()>,
    ) -> Result<()> {
        let rb = self.rb;
        if dst.len() != ids.len() * rb {
            bail!(
                ErrInternal,
                "{} rows read into {} bytes",
                ids.len(),
                dst.len()
            );
        }
        // (id, position) of each miss.
        let mut missed: Vec<(u64, usize)> = try_room(ids.len(), "the row cache's misses")?;
        for (j, (&id, d)) in ids.iter().zip(dst.chunks_exact_mut(rb)).enumerate() {
            if !self.get(id, d) {
                missed.push((id, j));
            }
        }
        let hits = (ids.len() - missed.len()) as u64;
        self.stats.record_lookups(ids.len() as u64, hits);
        if missed.is_empty() {
            return Ok(());
        }
        missed.sort_unstable();
        let mut rows: Vec<Option<&mut [u8]>> = try_room(ids.len(), "the row cache's misses")?;
        rows.extend(dst.chunks_exact_mut(rb).map(Some));
        let mut first: Vec<Miss<'_>> = try_room(missed.len(), "the row cache's misses")?;
        for (k, &(id, j)) in missed.iter().enumerate() {
            if k == 0 || missed[k - 1].0 != id {
                first.push((id, rows[j].take().expect("each position once")));
            }
        }
        read(&mut first)?;
        for (id, row) in first.iter() {
            self.insert(*id, row);
        }
        // Duplicates: copied from their first reading (sorted, so it is the
        // latest entry of `first` with the same id).
        let mut f = 0;
        for &(id, j) in &missed {
            while first[f].0 != id {
                f += 1;
            }
            if let Some(d) = rows[j].take() {
                d.copy_from_slice(first[f].1);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
