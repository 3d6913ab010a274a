//! An exact LRU over u64 keys: the page cache's model (the kernel's page
//! cache as an exact LRU over 4 KiB pages) and the tool's own reference for
//! the library's LRU (the replay checks that both count the same hits).
//!
//! A slab of nodes in a doubly linked list, most recent at the head, and a
//! map from key to node.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A hasher for keys that are already well spread (row ids are hashes
/// reduced modulo primes; page numbers are not, hence the mixing).
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        let x = self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^ (x >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | b as u64).wrapping_mul(0x100_0000_01B3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

pub type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

const NIL: u32 = u32::MAX;

pub struct Lru {
    cap: usize,
    map: KeyMap<u32>,
    key: Vec<u64>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
}

impl Lru {
    /// An LRU of `cap` keys (at least one). Nothing is reserved beyond what
    /// is inserted.
    pub fn new(cap: usize) -> Lru {
        Lru {
            cap: cap.max(1),
            map: KeyMap::default(),
            key: Vec::new(),
            prev: Vec::new(),
            next: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }

    fn unlink(&mut self, n: u32) {
        let (p, x) = (self.prev[n as usize], self.next[n as usize]);
        if p == NIL {
            self.head = x;
        } else {
            self.next[p as usize] = x;
        }
        if x == NIL {
            self.tail = p;
        } else {
            self.prev[x as usize] = p;
        }
    }

    fn push_head(&mut self, n: u32) {
        self.prev[n as usize] = NIL;
        self.next[n as usize] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = n;
        }
        self.head = n;
        if self.tail == NIL {
            self.tail = n;
        }
    }

    /// Whether `k` is held, without touching the order.
    pub fn contains(&self, k: u64) -> bool {
        self.map.contains_key(&k)
    }

    /// Look `k` up: a hit moves it to the head; a miss inserts it there,
    /// evicting the least recent key when full. Returns whether it hit.
    pub fn access(&mut self, k: u64) -> bool {
        if let Some(&n) = self.map.get(&k) {
            if self.head != n {
                self.unlink(n);
                self.push_head(n);
            }
            return true;
        }
        let n = if self.map.len() < self.cap {
            self.key.push(k);
            self.prev.push(NIL);
            self.next.push(NIL);
            (self.key.len() - 1) as u32
        } else {
            let t = self.tail;
            self.unlink(t);
            self.map.remove(&self.key[t as usize]);
            self.key[t as usize] = k;
            t
        };
        self.map.insert(k, n);
        self.push_head(n);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Capacity 3 over a b c a d b e a (by hand: a b c miss, a hits, d
    /// evicts b, b misses and evicts c, e evicts a, a misses): 1 hit.
    #[test]
    fn lru_counts_a_hand_computed_stream() {
        let mut l = Lru::new(3);
        let s = [1u64, 2, 3, 1, 4, 2, 5, 1];
        let hits: Vec<bool> = s.iter().map(|&k| l.access(k)).collect();
        let want = [false, false, false, true, false, false, false, false];
        assert_eq!(hits, want);
        assert_eq!(l.len(), 3);
        // Now held: 1 (most recent), 5, 2.
        assert!(l.contains(1) && l.contains(5) && l.contains(2) && !l.contains(4));
        // 2 hits, 4 misses and evicts the least recent (5).
        assert!(l.access(2));
        assert!(!l.access(4));
        assert!(!l.contains(5) && l.contains(1));
    }
}
