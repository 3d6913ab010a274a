//! Each policy against a naive model of itself (queues of ids, linear
//! searches) on random streams, and the invariants every policy keeps.

use super::{new_policy, Policy, PolicyKind, NO_ID};
use std::collections::VecDeque;

/// xorshift64*: a reproducible stream without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Skewed ids in `0..n`: small ids far more often (hot rows).
    fn skewed(&mut self, n: u64) -> u64 {
        let a = self.next() % n;
        let b = self.next() % n;
        let c = self.next() % n;
        a.min(b).min(c)
    }
}

/// What a naive model says of one access: hit, or the id a miss evicted.
#[derive(Debug, PartialEq)]
enum Seen {
    Hit,
    Miss(Option<u64>),
}

trait Model {
    fn access(&mut self, id: u64) -> Seen;
}

/// Exact LRU as a deque of ids, most recent at the front.
struct NaiveLru(VecDeque<u64>, usize);
impl Model for NaiveLru {
    fn access(&mut self, id: u64) -> Seen {
        if let Some(p) = self.0.iter().position(|&x| x == id) {
            self.0.remove(p);
            self.0.push_front(id);
            return Seen::Hit;
        }
        let ev = (self.0.len() == self.1).then(|| self.0.pop_back().unwrap());
        self.0.push_front(id);
        Seen::Miss(ev)
    }
}

/// CLOCK as a circular array of (id, referenced) and a hand.
struct NaiveClock {
    slots: Vec<(u64, bool)>,
    cap: usize,
    hand: usize,
}
impl Model for NaiveClock {
    fn access(&mut self, id: u64) -> Seen {
        if let Some(e) = self.slots.iter_mut().find(|e| e.0 == id) {
            e.1 = true;
            return Seen::Hit;
        }
        if self.slots.len() < self.cap {
            self.slots.push((id, false));
            return Seen::Miss(None);
        }
        while self.slots[self.hand].1 {
            self.slots[self.hand].1 = false;
            self.hand = (self.hand + 1) % self.cap;
        }
        let old = self.slots[self.hand].0;
        self.slots[self.hand] = (id, false);
        self.hand = (self.hand + 1) % self.cap;
        Seen::Miss(Some(old))
    }
}

/// S3-FIFO with deques of (id, freq), and the ghost as the ids of the last
/// `ghost_cap` evictions from the small queue (a ghost hit removes its id).
struct NaiveS3 {
    small: VecDeque<(u64, u8)>,
    main: VecDeque<(u64, u8)>,
    ghost: VecDeque<Option<u64>>,
    cap: usize,
    small_cap: usize,
    ghost_cap: usize,
}
impl NaiveS3 {
    fn new(cap: usize) -> NaiveS3 {
        let small_cap = (cap / 10).max(1).min(cap);
        NaiveS3 {
            small: VecDeque::new(),
            main: VecDeque::new(),
            ghost: VecDeque::new(),
            cap,
            small_cap,
            ghost_cap: (cap - small_cap).max(1),
        }
    }
    fn evict(&mut self) -> u64 {
        loop {
            if self.small.len() >= self.small_cap || self.main.is_empty() {
                let (id, f) = self.small.pop_front().unwrap();
                if f > 0 {
                    self.main.push_back((id, 0));
                    continue;
                }
                if self.ghost.len() == self.ghost_cap {
                    self.ghost.pop_front();
                }
                self.ghost.push_back(Some(id));
                return id;
            }
            let (id, f) = self.main.pop_front().unwrap();
            if f > 0 {
                self.main.push_back((id, f - 1));
                continue;
            }
            return id;
        }
    }
}
impl Model for NaiveS3 {
    fn access(&mut self, id: u64) -> Seen {
        let hit = self.small.iter_mut().chain(self.main.iter_mut());
        if let Some(e) = hit.into_iter().find(|e| e.0 == id) {
            e.1 = (e.1 + 1).min(3);
            return Seen::Hit;
        }
        let ev = (self.small.len() + self.main.len() == self.cap).then(|| self.evict());
        match self.ghost.iter().position(|&g| g == Some(id)) {
            Some(p) => {
                self.ghost[p] = None;
                self.main.push_back((id, 0));
            }
            None => self.small.push_back((id, 0)),
        }
        Seen::Miss(ev)
    }
}

/// Drive `p` and `m` with the same stream; every answer must agree, every
/// slot must hold the id the policy says, and capacity is never exceeded.
fn agree(p: &mut dyn Policy, m: &mut dyn Model, stream: &[u64]) -> (usize, usize) {
    let cap = p.capacity();
    let mut slots = vec![NO_ID; cap];
    let mut hits = 0;
    for (t, &id) in stream.iter().enumerate() {
        let seen = match p.lookup(id) {
            Some(s) => {
                assert_eq!(slots[s as usize], id, "slot {s} at access {t}");
                hits += 1;
                Seen::Hit
            }
            None => {
                let (s, old) = p.admit(id).expect("a policy of capacity > 0 admits");
                assert!((s as usize) < cap);
                let was = std::mem::replace(&mut slots[s as usize], id);
                assert_eq!(old, (was != NO_ID).then_some(was), "eviction at access {t}");
                Seen::Miss(old)
            }
        };
        assert_eq!(seen, m.access(id), "access {t} (id {id}) of {:?}", p.kind());
        assert!(p.len() <= cap);
        assert_eq!(p.len(), slots.iter().filter(|&&x| x != NO_ID).count());
    }
    (hits, stream.len() - hits)
}

fn streams() -> Vec<(usize, Vec<u64>)> {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let mut v = Vec::new();
    for &(cap, universe, n) in &[
        (1, 4, 500),
        (2, 5, 500),
        (7, 20, 3000),
        (10, 11, 2000),
        (64, 300, 20000),
        (200, 2000, 20000),
    ] {
        let s: Vec<u64> = (0..n).map(|_| rng.skewed(universe)).collect();
        v.push((cap, s));
    }
    // Ids whose hashes collide in the index's high bits (long probe runs).
    v.push((50, (0..5000).map(|_| rng.skewed(120) << 40).collect()));
    v
}

#[test]
fn lru_matches_a_naive_lru() {
    for (cap, s) in streams() {
        let mut p = new_policy(PolicyKind::Lru, cap).unwrap();
        let (hits, misses) = agree(&mut *p, &mut NaiveLru(VecDeque::new(), cap), &s);
        assert!(
            hits > 0 && misses > 0,
            "cap {cap}: {hits} hits, {misses} misses"
        );
    }
}

#[test]
fn clock_matches_a_naive_clock() {
    for (cap, s) in streams() {
        let mut p = new_policy(PolicyKind::Clock, cap).unwrap();
        let mut m = NaiveClock {
            slots: Vec::new(),
            cap,
            hand: 0,
        };
        let (hits, misses) = agree(&mut *p, &mut m, &s);
        assert!(
            hits > 0 && misses > 0,
            "cap {cap}: {hits} hits, {misses} misses"
        );
    }
}

#[test]
fn s3fifo_matches_a_naive_s3fifo() {
    for (cap, s) in streams() {
        let mut p = new_policy(PolicyKind::S3Fifo, cap).unwrap();
        let (hits, misses) = agree(&mut *p, &mut NaiveS3::new(cap), &s);
        assert!(
            hits > 0 && misses > 0,
            "cap {cap}: {hits} hits, {misses} misses"
        );
    }
}

#[test]
fn s3fifo_keeps_hot_rows_through_a_scan() {
    // 90 hot ids seen often, then a scan of 10,000 ids seen once: the hot
    // ones (in the main queue) survive; an LRU of the same size loses them.
    let cap = 100;
    let hot: Vec<u64> = (0..90).collect();
    let mut s3 = new_policy(PolicyKind::S3Fifo, cap).unwrap();
    let mut lru = new_policy(PolicyKind::Lru, cap).unwrap();
    for p in [&mut s3, &mut lru] {
        for _ in 0..3 {
            for &id in &hot {
                if p.lookup(id).is_none() {
                    p.admit(id);
                }
            }
        }
        for id in 1000..11_000 {
            if p.lookup(id).is_none() {
                p.admit(id);
            }
        }
    }
    let kept = |p: &mut Box<dyn Policy>| hot.iter().filter(|&&id| p.lookup(id).is_some()).count();
    assert_eq!(kept(&mut s3), 90);
    assert_eq!(kept(&mut lru), 0);
}

#[test]
fn zero_capacity_admits_nothing_and_no_id_is_refused() {
    for k in PolicyKind::ALL {
        let mut p = new_policy(k, 0).unwrap();
        assert_eq!(p.admit(5), None);
        assert_eq!(p.lookup(5), None);
        assert!(p.is_empty());
        let mut p = new_policy(k, 4).unwrap();
        assert_eq!(p.admit(NO_ID), None);
        assert_eq!(p.lookup(NO_ID), None);
        assert_eq!(p.kind(), k);
        assert_eq!(PolicyKind::parse(k.name()), Some(k));
        assert!(p.overhead_bytes() > 0);
    }
    assert_eq!(PolicyKind::parse(" S3FIFO"), Some(PolicyKind::S3Fifo));
    assert_eq!(PolicyKind::parse("arc"), None);
}

#[test]
fn a_capacity_that_cannot_be_had_is_err_capacity() {
    for k in PolicyKind::ALL {
        let e = new_policy(k, usize::MAX).err().expect("refused");
        assert_eq!(e.status, crate::EngramStatus::ErrCapacity);
        // Within the slot numbers but not in memory.
        let e = new_policy(k, super::MAX_CAPACITY).err();
        if let Some(e) = e {
            assert_eq!(e.status, crate::EngramStatus::ErrCapacity);
        }
    }
}

#[test]
fn overhead_per_row_is_bounded() {
    // The bound docs/row-cache.md states: at most 64 bytes of bookkeeping
    // a row, plus a constant, for every policy.
    for k in PolicyKind::ALL {
        for cap in [1usize, 3, 100, 1000, 4097, 65_536] {
            let p = new_policy(k, cap).unwrap();
            assert!(
                p.overhead_bytes() <= super::OVERHEAD_PER_ROW * cap + super::OVERHEAD_FIXED,
                "{k:?} of {cap} rows: {} bytes",
                p.overhead_bytes()
            );
        }
    }
}
