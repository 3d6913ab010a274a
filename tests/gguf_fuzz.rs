//! A bounded fuzz of the GGUF header parser: the gguf-py fixtures mutated by a
//! seeded generator (truncations, byte flips, huge counts and lengths, spliced
//! and dropped bytes), parsed from a byte slice. The parser must never panic
//! (safe Rust turns any out-of-bounds read into a panic, so no panic means no
//! read outside the slice) and must return a status for every input; whatever
//! parses is also handed to the engram-model reader.
//!
//! `ENGRAM_FUZZ_ITERS` sets the iterations per fixture (default 4000, about a
//! second); `ENGRAM_FUZZ_SEED` the seed.

mod common;

use common::*;
use engram::gguf::{EngramModel, Gguf};
use std::panic::{catch_unwind, AssertUnwindSafe};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        mix64(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Bytes of the header (everything before the tensor data): mutations there matter.
fn header_len(b: &[u8]) -> usize {
    Gguf::parse(b).unwrap().data_offset as usize
}

fn mutate(r: &mut Rng, good: &[u8], hdr: usize) -> Vec<u8> {
    let mut b = good.to_vec();
    let rounds = 1 + r.below(4);
    for _ in 0..rounds {
        let at = r.below(hdr.min(b.len()).max(1));
        match r.below(7) {
            0 => b.truncate(r.below(b.len() + 1)),
            1 => {
                for _ in 0..1 + r.below(8) {
                    let i = r.below(hdr.min(b.len()).max(1));
                    if i < b.len() {
                        b[i] ^= 1 << r.below(8);
                    }
                }
            }
            2 | 3 => {
                // A huge or boundary value over a count, length, dimension or offset.
                let vals = [
                    u64::MAX,
                    u64::MAX / 2,
                    1 << 32,
                    (1 << 32) - 1,
                    1 << 62,
                    b.len() as u64,
                    b.len() as u64 + 1,
                    0,
                    1,
                    5,
                    13,
                ];
                let v = vals[r.below(vals.len())];
                let w = if r.below(2) == 0 { 8 } else { 4 };
                if at + w <= b.len() {
                    b[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
                }
            }
            4 => {
                let n = 1 + r.below(16);
                let end = (at + n).min(b.len());
                b.drain(at.min(b.len())..end);
            }
            5 => {
                let n = 1 + r.below(16);
                let ins: Vec<u8> = (0..n).map(|_| r.next() as u8).collect();
                let at = at.min(b.len());
                b.splice(at..at, ins);
            }
            _ => {
                // Copy a slice of the header elsewhere (keys over types, names over dims).
                let n = 1 + r.below(24);
                let src = r.below(hdr.max(1));
                if src + n <= b.len() && at + n <= b.len() {
                    let s = b[src..src + n].to_vec();
                    b[at..at + n].copy_from_slice(&s);
                }
            }
        }
    }
    b
}

#[test]
fn header_parser_never_panics_on_mutated_files() {
    let iters: usize = std::env::var("ENGRAM_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let seed: u64 = std::env::var("ENGRAM_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_e9a3);
    let start = std::time::Instant::now();
    let mut stats = std::collections::BTreeMap::<String, usize>::new();
    for name in ["tiny.gguf", "tiny_u32.gguf", "tiny_noconst.gguf"] {
        let good = std::fs::read(golden_dir().join(name)).unwrap();
        let hdr = header_len(&good);
        let mut r = Rng(seed ^ fnv1a64(name.as_bytes()));
        for i in 0..iters {
            let b = mutate(&mut r, &good, hdr);
            let res = catch_unwind(AssertUnwindSafe(|| {
                let g = Gguf::parse(&b)?;
                // Whatever parses stays inside the buffer it came from.
                for t in &g.tensors {
                    assert!(
                        t.offset <= b.len() as u64,
                        "{name} #{i}: {} offset outside",
                        t.name
                    );
                    if let Some(n) = t.bytes {
                        assert!(
                            t.offset + n <= b.len() as u64,
                            "{name} #{i}: {} data outside",
                            t.name
                        );
                    }
                }
                EngramModel::from_gguf(&g, None).map(|_| ())
            }));
            match res {
                Ok(Ok(())) => *stats.entry("ok".into()).or_default() += 1,
                Ok(Err(e)) => *stats.entry(format!("{:?}", e.status)).or_default() += 1,
                Err(p) => {
                    let what = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    panic!("{name}, mutation {i} (seed {seed:#x}) panicked: {what}");
                }
            }
        }
    }
    eprintln!(
        "{} mutated files in {:.2} s: {stats:?}",
        3 * iters,
        start.elapsed().as_secs_f64()
    );
    assert!(stats.get("ErrFormat").copied().unwrap_or(0) > 0);
}
