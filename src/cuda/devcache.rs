//! The device row cache of a layer whose table is on the host (docs/row-cache.md
//! "Device tier"): hot rows stay in device memory, in slots after the layer's
//! device staging area, and a call copies only the rows no slot holds.
//!
//! The host keeps the slot map: a replacement policy of
//! [`crate::rowcache::policy`] (row id -> slot, and which row a miss evicts)
//! behind the layer's lock. For each call it writes into pinned memory:
//!
//! - the misses' rows, compacted to the start of the call's pinned rows (the
//!   only rows the call copies to the device, into the staging area);
//! - `slots[p]` for every cell `p` of the call: the index, in the layer's
//!   device rows buffer, of the row the kernels read for it (a staging row
//!   `j < base`, or cache slot `s` at `base + s`);
//! - the admissions: `(j, base + s)` pairs for `engram_cache_fill`, which
//!   copies the missed rows into their slots on the device, on the same stream,
//!   before the gather.
//!
//! Why the bits are the uncached path's: a cell reads either the row the host
//! read for this call (a miss, or a hit whose slot a later miss of the same
//! call takes over: it is copied like a miss) or a slot whose content was
//! copied from such a row by an earlier fill and not overwritten since (the
//! policy hands a slot to a new id only by evicting the old one). Within a
//! call no fill writes a slot a cell of the call reads (see [`Plan::plan`]),
//! and across calls the fill of a later call is queued after the kernels of
//! the earlier one on the context's ordered stream (docs/row-cache.md).

use crate::error::{bail, Error, Result};
use crate::fallible::try_vec;
use crate::rowcache::policy::{new_policy, Policy, PolicyKind};
use std::sync::atomic::{AtomicU64, Ordering};

pub use crate::call::DeviceCacheStats;

/// The policy a device cache uses unless the tuning names another.
pub const DEFAULT_POLICY: PolicyKind = PolicyKind::Lru;

/// A location in the step map: a cache slot, or (with this bit) the cell
/// whose host row is staged for the call.
const STAGED: u32 = 1 << 31;
const EMPTY: u64 = u64::MAX;
const NOT_STAGED: u32 = u32::MAX;

/// The counters of one layer's device cache: relaxed atomics, read without a
/// lock (`Context::device_cache_stats`).
#[derive(Default, Debug)]
pub struct Counters {
    lookups: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_h2d: AtomicU64,
    evictions: AtomicU64,
}

impl Counters {
    /// The counts so far.
    pub fn snapshot(&self, capacity: u64, policy: PolicyKind) -> DeviceCacheStats {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceCacheStats {
            policy,
            capacity_rows: capacity,
            lookups: r(&self.lookups),
            hits: r(&self.hits),
            misses: r(&self.misses),
            bytes_h2d: r(&self.bytes_h2d),
            evictions: r(&self.evictions),
        }
    }

    /// Zero the counts (`engram_cache_stats_reset`); counts made while it
    /// runs may land on either side.
    pub fn reset(&self) {
        for a in [
            &self.lookups,
            &self.hits,
            &self.misses,
            &self.bytes_h2d,
            &self.evictions,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }

    fn add(&self, a: &AtomicU64, v: u64) {
        a.fetch_add(v, Ordering::Relaxed);
    }
}

/// What one call copies: rows staged (compacted at the start of the pinned
/// rows) and admissions (pairs at the start of the fill array).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    pub staged: usize,
    pub fills: usize,
}

/// The host side of a device cache: the policy and the scratch a call's
/// plan uses (allocated once, for the context's `max_tokens * C` cells).
pub struct Plan {
    kind: PolicyKind,
    capacity: usize,
    /// `None` after a failed call whose policy could not be rebuilt: every
    /// row is then a miss and nothing is admitted (still exact).
    policy: Option<Box<dyn Policy>>,
    /// The call's distinct ids: open addressing, `(id, location, first cell)`.
    map: Vec<(u64, u32, u32)>,
    used: Vec<u32>,
    /// Each id's position in the map (`[ids]`).
    at: Vec<u32>,
    /// Per cell: [`NOT_STAGED`], or its row in the staging area (0 while
    /// marked during the pass, numbered after it).
    row_of: Vec<u32>,
    /// Admissions `(slot, order, cell)`.
    fills: Vec<(u32, u32, u32)>,
}

impl Plan {
    /// A plan for calls of up to `cells` cells over `capacity` slots.
    pub fn new(kind: PolicyKind, capacity: usize, cells: usize) -> Result<Plan> {
        let table = (2 * cells).next_power_of_two().max(2);
        Ok(Plan {
            kind,
            capacity,
            policy: Some(new_policy(kind, capacity)?),
            map: try_vec(table, (EMPTY, 0, 0), "the device cache's step map")?,
            used: crate::fallible::try_room(cells, "the device cache's step map")?,
            at: crate::fallible::try_room(cells, "the device cache's step map")?,
            row_of: crate::fallible::try_room(cells, "the device cache's staged rows")?,
            fills: crate::fallible::try_room(cells, "the device cache's admissions")?,
        })
    }

    /// Forget every cached row (after a call whose copies may not have been
    /// queued: the policy's state no longer says what the slots hold).
    pub fn reset(&mut self) {
        self.policy = new_policy(self.kind, self.capacity).ok();
    }

    fn find(&self, id: u64) -> (usize, bool) {
        let mask = self.map.len() - 1;
        let mut h = (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) as usize & mask;
        loop {
            match self.map[h].0 {
                EMPTY => return (h, false),
                x if x == id => return (h, true),
                _ => h = (h + 1) & mask,
            }
        }
    }

    /// The call's admissions into `fill` as `(staging row, base + slot)`
    /// pairs, the last admission to each slot only (the rows numbered);
    /// returns how many.
    fn write_fills(&mut self, fill: &mut [u32], base: u32) -> usize {
        self.fills.sort_unstable();
        let mut n_fill = 0;
        for k in 0..self.fills.len() {
            let (s, _, cell) = self.fills[k];
            if self.fills.get(k + 1).is_some_and(|f| f.0 == s) {
                continue;
            }
            fill[2 * n_fill] = self.row_of[cell as usize];
            fill[2 * n_fill + 1] = base + s;
            n_fill += 1;
        }
        n_fill
    }

    /// Plan one call: `ids` of the live tokens `tokens` (`cols` a token),
    /// whose host rows (`rb` bytes) are at their cells in `rows`. Decides each
    /// distinct id's hit or miss in order of first appearance, compacts the
    /// staged rows to the start of `rows` (in increasing cell order, so a row
    /// moves down or stays: `copy_within` never overwrites one still to move),
    /// writes each cell's row index into `slots` (`base` + slot for a hit) and
    /// the admissions into `fill`.
    ///
    /// A miss is always read from its staged row; a hit whose slot a later
    /// miss of the same call takes over is staged too (its host row is here),
    /// so the call's fills never write a slot the call's cells read, and a
    /// slot taken over twice in one call is filled once, by the last.
    #[allow(clippy::too_many_arguments)]
    pub fn plan(
        &mut self,
        ids: &[i64],
        tokens: &[usize],
        cols: usize,
        rows: &mut [u8],
        rb: usize,
        base: u32,
        slots: &mut [u32],
        fill: &mut [u32],
        counters: &Counters,
    ) -> Result<Planned> {
        let cells = slots.len();
        if ids.len() > self.at.capacity() || cells > self.row_of.capacity() {
            bail!(ErrInternal, "a device cache plan past its cells");
        }
        for &h in &self.used {
            self.map[h as usize].0 = EMPTY;
        }
        self.used.clear();
        self.at.clear();
        self.fills.clear();
        self.row_of.clear();
        self.row_of.resize(cells, NOT_STAGED);
        let (mut lookups, mut hits, mut evictions, mut staged) = (0u64, 0u64, 0u64, 0usize);
        for (j, &id) in ids.iter().enumerate() {
            let cell = (tokens[j / cols] * cols + j % cols) as u32;
            let (h, found) = self.find(id as u64);
            self.at.push(h as u32);
            if found {
                continue;
            }
            lookups += 1;
            self.used.push(h as u32);
            let hit = self.policy.as_mut().and_then(|p| p.lookup(id as u64));
            if let Some(s) = hit {
                hits += 1;
                self.map[h] = (id as u64, s, cell);
                continue;
            }
            self.map[h] = (id as u64, STAGED | cell, cell);
            self.row_of[cell as usize] = 0;
            staged += 1;
            let Some((s, old)) = self.policy.as_mut().and_then(|p| p.admit(id as u64)) else {
                continue;
            };
            self.fills.push((s, self.fills.len() as u32, cell));
            if let Some(old) = old {
                evictions += 1;
                let (ho, held) = self.find(old);
                if held && self.map[ho].1 & STAGED == 0 {
                    // A hit of this call whose slot is taken over: staged.
                    let c = self.map[ho].2;
                    self.map[ho].1 = STAGED | c;
                    self.row_of[c as usize] = 0;
                    staged += 1;
                }
            }
        }
        // Staged rows in increasing cell order: row j of the staging area.
        let mut j = 0u32;
        for c in 0..cells {
            if self.row_of[c] == 0 {
                self.row_of[c] = j;
                rows.copy_within(c * rb..(c + 1) * rb, j as usize * rb);
                j += 1;
            }
        }
        let n_fill = self.write_fills(fill, base);
        slots.fill(0);
        for (j, &h) in self.at.iter().enumerate() {
            let cell = tokens[j / cols] * cols + j % cols;
            let loc = self.map[h as usize].1;
            slots[cell] = if loc & STAGED != 0 {
                self.row_of[(loc & !STAGED) as usize]
            } else {
                base + loc
            };
        }
        let c = counters;
        c.add(&c.lookups, lookups);
        c.add(&c.hits, hits);
        c.add(&c.misses, lookups - hits);
        c.add(&c.evictions, evictions);
        c.add(&c.bytes_h2d, (staged * rb) as u64);
        Ok(Planned {
            staged,
            fills: n_fill,
        })
    }
}

/// The slots a budget of `bytes` holds for rows of `rb` bytes after a staging
/// area of `cells` rows, or `ErrCapacity` when the slot numbers (u32 row
/// indices of the kernels) or the policy cannot cover them.
pub fn capacity_of(bytes: u64, rb: usize, cells: usize) -> Result<usize> {
    let cap = bytes / rb.max(1) as u64;
    let limit = (u32::MAX >> 1) as u64 - cells as u64;
    if cap > limit || cap > crate::rowcache::policy::MAX_CAPACITY as u64 {
        return Err(Error::new(
            crate::error::EngramStatus::ErrCapacity,
            format!(
                "device_cache_bytes = {bytes}: {cap} rows of {rb} bytes, more than a layer's \
                 device cache can number ({limit})"
            ),
        ));
    }
    Ok(cap as usize)
}
