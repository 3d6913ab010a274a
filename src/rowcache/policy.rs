//! Replacement policies as pure id -> slot logic: which slot of a cache of
//! `capacity` rows holds a row id, and which row a miss evicts. No row data:
//! the cache ([`super::RowCache`]) keeps the rows in the slots a policy
//! hands out, and the replay tool simulates with the same code.
//!
//! - [`PolicyKind::Lru`]: exact least recently used (a doubly linked list
//!   over the slots).
//! - [`PolicyKind::Clock`]: one reference bit a slot and a sweeping hand.
//! - [`PolicyKind::S3Fifo`]: a small FIFO (10% of the slots) that new rows
//!   enter, a main FIFO with a 2-bit frequency a row (a row seen again while
//!   in the small queue moves to the main one, one seen in neither goes to a
//!   ghost queue of ids), and the ghost (the ids of the last evictions from
//!   the small queue, as many as the main queue holds rows): a miss whose id
//!   is a ghost enters the main queue directly (Yang et al., SOSP 2023).
//!
//! Every structure is allocated once at [`new_policy`], fallibly; nothing
//! allocates afterwards. Row ids are any `u64` but [`NO_ID`].

use crate::error::{bail, Result};
use crate::fallible::{try_vec, vec_bytes};

/// The one id no policy admits (it marks an empty slot).
pub const NO_ID: u64 = u64::MAX;

/// Which replacement policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PolicyKind {
    Lru,
    Clock,
    S3Fifo,
}

impl PolicyKind {
    /// Every policy, in the order the C ABI numbers them (0, 1, 2).
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Lru, PolicyKind::Clock, PolicyKind::S3Fifo];

    /// Its name: `lru`, `clock`, `s3fifo`.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Clock => "clock",
            PolicyKind::S3Fifo => "s3fifo",
        }
    }

    /// The policy named `s` (as [`PolicyKind::name`] spells it, any case).
    pub fn parse(s: &str) -> Option<PolicyKind> {
        Self::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s.trim()))
    }
}

/// A replacement policy over `capacity` slots.
pub trait Policy: Send {
    /// A hit: the slot holding `id` (the access is recorded); `None` on a miss.
    fn lookup(&mut self, id: u64) -> Option<u32>;
    /// After a miss for `id` (not held): the slot to fill with it and the id
    /// evicted from that slot, or `None` if the policy does not admit it
    /// (`NO_ID`, a policy of capacity 0).
    fn admit(&mut self, id: u64) -> Option<(u32, Option<u64>)>;
    /// Rows held.
    fn len(&self) -> usize;
    /// Rows it can hold.
    fn capacity(&self) -> usize;
    /// Which policy it is.
    fn kind(&self) -> PolicyKind;
    /// Bytes of bookkeeping it allocated (for the cache's memory accounting).
    fn overhead_bytes(&self) -> usize;
    /// Whether it holds no row.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bytes of bookkeeping a policy allocates for each row it can hold, at
/// most (with [`OVERHEAD_FIXED`] besides): the id index (8 bytes an id and a
/// table of 4-byte slot numbers at most half full: under 24 bytes a row),
/// and LRU's links (8), CLOCK's bit (1), or S3-FIFO's frequency (1), two
/// queues (8) and its ghost (an index of up to as many ids: under 24).
pub const OVERHEAD_PER_ROW: usize = 64;
/// Bytes of bookkeeping a policy allocates besides [`OVERHEAD_PER_ROW`].
pub const OVERHEAD_FIXED: usize = 64;

/// Most slots a policy manages (slot numbers are `u32`, one value reserved).
pub const MAX_CAPACITY: usize = (u32::MAX - 1) as usize;

/// A policy of `kind` over `capacity` slots, its bookkeeping allocated
/// fallibly (`ErrCapacity` when it cannot be had).
pub fn new_policy(kind: PolicyKind, capacity: usize) -> Result<Box<dyn Policy>> {
    if capacity > MAX_CAPACITY {
        bail!(
            ErrCapacity,
            "a row cache of {capacity} rows (at most {MAX_CAPACITY} a shard)"
        );
    }
    Ok(match kind {
        PolicyKind::Lru => Box::new(Lru::new(capacity)?),
        PolicyKind::Clock => Box::new(Clock::new(capacity)?),
        PolicyKind::S3Fifo => Box::new(S3Fifo::new(capacity)?),
    })
}

const NIL: u32 = u32::MAX;

/// Id -> slot: each slot's id, and an open-addressed table (linear probing,
/// at most half full) of slot numbers keyed by their ids.
struct Index {
    ids: Vec<u64>,
    table: Vec<u32>,
    shift: u32,
}

impl Index {
    fn new(slots: usize, what: &str) -> Result<Index> {
        // A power of two, at least twice the slots (and at least 2).
        let size = (slots.max(1) * 2).next_power_of_two();
        Ok(Index {
            ids: try_vec(slots, NO_ID, what)?,
            table: try_vec(size, NIL, what)?,
            shift: 64 - size.trailing_zeros(),
        })
    }

    fn home(&self, id: u64) -> usize {
        (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    fn mask(&self) -> usize {
        self.table.len() - 1
    }

    fn find(&self, id: u64) -> Option<u32> {
        if id == NO_ID {
            return None;
        }
        let mut i = self.home(id);
        loop {
            let s = self.table[i];
            if s == NIL {
                return None;
            }
            if self.ids[s as usize] == id {
                return Some(s);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// `slot` (empty) now holds `id` (not held).
    fn insert(&mut self, id: u64, slot: u32) {
        debug_assert!(self.ids[slot as usize] == NO_ID && self.find(id).is_none());
        self.ids[slot as usize] = id;
        let mut i = self.home(id);
        while self.table[i] != NIL {
            i = (i + 1) & self.mask();
        }
        self.table[i] = slot;
    }

    /// Empty `slot` (holding an id); returns the id.
    fn remove(&mut self, slot: u32) -> u64 {
        let id = self.ids[slot as usize];
        debug_assert!(id != NO_ID);
        let mask = self.mask();
        let mut i = self.home(id);
        while self.table[i] != slot {
            i = (i + 1) & mask;
        }
        // Backward-shift deletion: pull later entries of the run whose home
        // is not in (i, j] into the hole.
        let mut j = i;
        loop {
            j = (j + 1) & mask;
            let s = self.table[j];
            if s == NIL {
                break;
            }
            let k = self.home(self.ids[s as usize]);
            let stays = if i <= j {
                i < k && k <= j
            } else {
                i < k || k <= j
            };
            if !stays {
                self.table[i] = s;
                i = j;
            }
        }
        self.table[i] = NIL;
        self.ids[slot as usize] = NO_ID;
        id
    }

    fn bytes(&self) -> usize {
        vec_bytes(&self.ids) + vec_bytes(&self.table)
    }
}

/// Exact LRU: a doubly linked list over the slots, most recent first.
struct Lru {
    index: Index,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    fn new(cap: usize) -> Result<Lru> {
        Ok(Lru {
            index: Index::new(cap, "the row cache's LRU index")?,
            prev: try_vec(cap, NIL, "the row cache's LRU list")?,
            next: try_vec(cap, NIL, "the row cache's LRU list")?,
            head: NIL,
            tail: NIL,
            len: 0,
        })
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
    }

    fn push_front(&mut self, s: u32) {
        self.prev[s as usize] = NIL;
        self.next[s as usize] = self.head;
        match self.head {
            NIL => self.tail = s,
            h => self.prev[h as usize] = s,
        }
        self.head = s;
    }
}

impl Policy for Lru {
    fn lookup(&mut self, id: u64) -> Option<u32> {
        let s = self.index.find(id)?;
        if self.head != s {
            self.unlink(s);
            self.push_front(s);
        }
        Some(s)
    }

    fn admit(&mut self, id: u64) -> Option<(u32, Option<u64>)> {
        if id == NO_ID || self.capacity() == 0 {
            return None;
        }
        let (s, old) = if self.len < self.capacity() {
            self.len += 1;
            ((self.len - 1) as u32, None)
        } else {
            let s = self.tail;
            self.unlink(s);
            (s, Some(self.index.remove(s)))
        };
        self.index.insert(id, s);
        self.push_front(s);
        Some((s, old))
    }

    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.prev.len()
    }
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }
    fn overhead_bytes(&self) -> usize {
        self.index.bytes() + vec_bytes(&self.prev) + vec_bytes(&self.next)
    }
}

/// CLOCK: a reference bit a slot, set by a hit; the hand clears set bits and
/// evicts the first clear one.
struct Clock {
    index: Index,
    referenced: Vec<bool>,
    hand: usize,
    len: usize,
}

impl Clock {
    fn new(cap: usize) -> Result<Clock> {
        Ok(Clock {
            index: Index::new(cap, "the row cache's CLOCK index")?,
            referenced: try_vec(cap, false, "the row cache's CLOCK bits")?,
            hand: 0,
            len: 0,
        })
    }
}

impl Policy for Clock {
    fn lookup(&mut self, id: u64) -> Option<u32> {
        let s = self.index.find(id)?;
        self.referenced[s as usize] = true;
        Some(s)
    }

    fn admit(&mut self, id: u64) -> Option<(u32, Option<u64>)> {
        let cap = self.capacity();
        if id == NO_ID || cap == 0 {
            return None;
        }
        let (s, old) = if self.len < cap {
            self.len += 1;
            ((self.len - 1) as u32, None)
        } else {
            while self.referenced[self.hand] {
                self.referenced[self.hand] = false;
                self.hand = (self.hand + 1) % cap;
            }
            let s = self.hand as u32;
            self.hand = (self.hand + 1) % cap;
            (s, Some(self.index.remove(s)))
        };
        self.index.insert(id, s);
        self.referenced[s as usize] = false;
        Some((s, old))
    }

    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.referenced.len()
    }
    fn kind(&self) -> PolicyKind {
        PolicyKind::Clock
    }
    fn overhead_bytes(&self) -> usize {
        self.index.bytes() + vec_bytes(&self.referenced)
    }
}

/// A fixed-capacity FIFO of slot numbers (allocated once).
struct Ring {
    buf: Vec<u32>,
    head: usize,
    len: usize,
}

impl Ring {
    fn new(cap: usize, what: &str) -> Result<Ring> {
        Ok(Ring {
            buf: try_vec(cap.max(1), NIL, what)?,
            head: 0,
            len: 0,
        })
    }
    fn push(&mut self, s: u32) {
        assert!(self.len < self.buf.len(), "a FIFO past its capacity");
        let i = (self.head + self.len) % self.buf.len();
        self.buf[i] = s;
        self.len += 1;
    }
    fn pop(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let s = self.buf[self.head];
        self.head = (self.head + 1) % self.buf.len();
        self.len -= 1;
        Some(s)
    }
}

/// S3-FIFO (see the module): small and main FIFOs over the slots, a 2-bit
/// frequency a slot, and a ghost FIFO of evicted ids.
struct S3Fifo {
    index: Index,
    freq: Vec<u8>,
    small: Ring,
    main: Ring,
    small_cap: usize,
    /// The ghost: a ring of ids (its slots are ring positions) and their index.
    ghost: Index,
    ghost_next: usize,
    /// Rows held; slots `len..capacity` were never used.
    len: usize,
}

impl S3Fifo {
    fn new(cap: usize) -> Result<S3Fifo> {
        let small_cap = (cap / 10).max(1).min(cap);
        let ghost_cap = cap - small_cap.min(cap);
        Ok(S3Fifo {
            index: Index::new(cap, "the row cache's S3-FIFO index")?,
            freq: try_vec(cap, 0u8, "the row cache's S3-FIFO frequencies")?,
            small: Ring::new(cap, "the row cache's S3-FIFO small queue")?,
            main: Ring::new(cap, "the row cache's S3-FIFO main queue")?,
            small_cap,
            ghost: Index::new(ghost_cap.max(1), "the row cache's S3-FIFO ghost")?,
            ghost_next: 0,
            len: 0,
        })
    }

    /// Remember an id evicted from the small queue in the ghost (the oldest
    /// ghost is forgotten when it is full).
    fn ghost_push(&mut self, id: u64) {
        let pos = self.ghost_next as u32;
        if self.ghost.ids[pos as usize] != NO_ID {
            self.ghost.remove(pos);
        }
        self.ghost.insert(id, pos);
        self.ghost_next = (self.ghost_next + 1) % self.ghost.ids.len();
    }

    /// Evict one row: from the small queue while it is over its share (or
    /// the main queue is empty), else from the main queue. Returns the freed
    /// slot and the id that held it.
    fn evict(&mut self) -> (u32, u64) {
        loop {
            if self.small.len >= self.small_cap || self.main.len == 0 {
                let s = self.small.pop().expect("a full cache has rows queued");
                if self.freq[s as usize] > 0 {
                    // Seen again while small: promoted, its count kept.
                    self.freq[s as usize] = 0;
                    self.main.push(s);
                    continue;
                }
                let id = self.index.remove(s);
                self.ghost_push(id);
                return (s, id);
            }
            let s = self.main.pop().expect("checked non-empty");
            if self.freq[s as usize] > 0 {
                self.freq[s as usize] -= 1;
                self.main.push(s);
                continue;
            }
            return (s, self.index.remove(s));
        }
    }
}

impl Policy for S3Fifo {
    fn lookup(&mut self, id: u64) -> Option<u32> {
        let s = self.index.find(id)?;
        let f = &mut self.freq[s as usize];
        *f = (*f + 1).min(3);
        Some(s)
    }

    fn admit(&mut self, id: u64) -> Option<(u32, Option<u64>)> {
        let cap = self.capacity();
        if id == NO_ID || cap == 0 {
            return None;
        }
        let (s, old) = if self.len < cap {
            self.len += 1;
            ((self.len - 1) as u32, None)
        } else {
            let (s, id) = self.evict();
            (s, Some(id))
        };
        self.freq[s as usize] = 0;
        self.index.insert(id, s);
        match self.ghost.find(id) {
            Some(g) => {
                self.ghost.remove(g);
                self.main.push(s);
            }
            None => self.small.push(s),
        }
        Some((s, old))
    }

    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.freq.len()
    }
    fn kind(&self) -> PolicyKind {
        PolicyKind::S3Fifo
    }
    fn overhead_bytes(&self) -> usize {
        self.index.bytes()
            + vec_bytes(&self.freq)
            + vec_bytes(&self.small.buf)
            + vec_bytes(&self.main.buf)
            + self.ghost.bytes()
    }
}

#[cfg(test)]
mod tests;
