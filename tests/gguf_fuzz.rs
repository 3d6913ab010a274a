//! A bounded fuzz of the GGUF header parser: the gguf-py fixtures mutated by a
//! seeded generator (truncations, byte flips, huge counts and lengths, spliced
//! and dropped bytes), parsed from a byte slice. The parser must never panic
//! (safe Rust turns any out-of-bounds read into a panic, so no panic means no
//! read outside the slice) and must return a status for every input; whatever
//! parses is also handed to the engram-model reader.
//!
//! `ENGRAM_FUZZ_ITERS` sets the iterations per fixture (default 4000, about a
//! second); `ENGRAM_FUZZ_SEED` the seed.
//!
//! A second, structure-aware pass takes a valid file of every dialect
//! (`tests/golden/data/dialects/`, the split set as a set) and changes one
//! field of its header at a time (a key's type, a scalar, an array's element
//! type, count or one element, a string's length, a tensor's dimension count,
//! a dimension, its type or offset) to boundary values, and loads the result
//! through the whole dialect reader and loader: never a panic, always a status.

mod common;

use common::*;
use engram::gguf::{Gguf, GgufModel, LoadOptions, Value};
use engram::EngramStatus;
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

/// The message a caught panic carries (empty if it is not a string).
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
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
                GgufModel::from_memory(vec![(name.into(), b.clone())], &LoadOptions::default())
                    .map(|_| ())
            }));
            match res {
                Ok(Ok(())) => *stats.entry("ok".into()).or_default() += 1,
                Ok(Err(e)) => *stats.entry(format!("{:?}", e.status)).or_default() += 1,
                Err(p) => {
                    let what = panic_text(&*p);
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

/// One header field to change: where, how wide, and the values to put there.
struct Field {
    what: String,
    at: usize,
    width: usize,
    values: Vec<u64>,
}

/// Every field of a file's header worth changing, with boundary values.
fn fields(b: &[u8]) -> Vec<Field> {
    let g = Gguf::parse(b).unwrap();
    let mut out = Vec::new();
    let huge = [0u64, 1, 2, u32::MAX as u64, 1 << 32, 1 << 61, u64::MAX];
    for kv in &g.kvs {
        let k = &kv.key;
        out.push(Field {
            what: format!("{k}: type"),
            at: kv.type_at,
            width: 4,
            values: vec![0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 99],
        });
        let v = kv.type_at + 4;
        match &kv.value {
            Value::Int(_) => out.push(Field {
                what: format!("{k}: value"),
                at: v,
                width: match kv.ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    _ => 8,
                },
                values: vec![0, 1, 2, 7, 40, 0x7F, 0xFF, 0xFFFF, 0x7FFF_FFFF, u64::MAX],
            }),
            Value::Str(_) => out.push(Field {
                what: format!("{k}: string length"),
                at: v,
                width: 8,
                values: huge.to_vec(),
            }),
            Value::Array(a) => {
                out.push(Field {
                    what: format!("{k}: element type"),
                    at: v,
                    width: 4,
                    values: vec![0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
                });
                out.push(Field {
                    what: format!("{k}: count"),
                    at: v + 4,
                    width: 8,
                    values: [a.len.saturating_sub(1), a.len + 1]
                        .into_iter()
                        .chain(huge)
                        .collect(),
                });
                let size = match a.et {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    10..=12 => 8,
                    _ => 0,
                };
                if size > 0 {
                    let n = a.len as usize;
                    for i in [0, 1, n / 2, n.saturating_sub(1)] {
                        if i < n {
                            out.push(Field {
                                what: format!("{k}[{i}]"),
                                at: a.start + i * size,
                                width: size,
                                values: vec![0, 1, 2, 3, 40, 48, 0x7FFF_FFFF, u64::MAX],
                            });
                        }
                    }
                }
            }
            _ => {}
        }
    }
    for t in &g.tensors {
        let e = t.entry_at;
        out.push(Field {
            what: format!("{}: dimension count", t.name),
            at: e,
            width: 4,
            values: vec![0, 1, 2, 3, 5],
        });
        for d in 0..t.dims.len() {
            let cur = t.dims[d];
            out.push(Field {
                what: format!("{}: dimension {d}", t.name),
                at: e + 4 + 8 * d,
                width: 8,
                values: [cur.saturating_sub(1), cur + 1, cur * 2]
                    .into_iter()
                    .chain(huge)
                    .collect(),
            });
        }
        let ty_at = e + 4 + 8 * t.dims.len();
        out.push(Field {
            what: format!("{}: type", t.name),
            at: ty_at,
            width: 4,
            values: vec![0, 1, 2, 8, 10, 12, 14, 24, 26, 27, 28, 30, 44, 1000, 1001],
        });
        out.push(Field {
            what: format!("{}: offset", t.name),
            at: ty_at + 4,
            width: 8,
            values: vec![0, 32, 16384, 1 << 40, u64::MAX],
        });
    }
    out
}

/// The dialect fixtures: (the files of one model, the file whose fields change).
fn dialect_sets() -> Vec<Vec<(String, Vec<u8>)>> {
    let d = golden_dir().join("dialects");
    let read = |n: &str| (n.to_string(), std::fs::read(d.join(n)).unwrap());
    let mut sets: Vec<Vec<(String, Vec<u8>)>> = [
        "ds4.gguf",
        "tarruda.gguf",
        "jigsawpt.gguf",
        "vcruz305_deepseek4_prefix.gguf",
        "deepstrix-00001-of-00001.gguf",
        "ds4gw_style.gguf",
    ]
    .iter()
    .map(|n| vec![read(n)])
    .collect();
    let split: Vec<_> = (1..=3)
        .map(|k| read(&format!("vcruz305_split-{k:05}-of-00003.gguf")))
        .collect();
    // Each shard of the split set in turn is the one changed (the first one opened).
    for k in 0..3 {
        let mut s = split.clone();
        s.swap(0, k);
        sets.push(s);
    }
    sets
}

#[test]
fn every_dialect_survives_one_changed_field_at_a_time() {
    let start = std::time::Instant::now();
    let ckpt = golden_dir().join("dialects").join("checkpoint");
    let tok =
        engram::tables::tokenizer::load(&golden_dir().join("deepseek_v4_tokenizer.json")).unwrap();
    let tm = engram::tables::tokenizer::token_map(&tok).unwrap();
    let mut stats = std::collections::BTreeMap::<String, usize>::new();
    let mut n_loads = 0usize;
    for set in dialect_sets() {
        let name = set[0].0.clone();
        let opts = LoadOptions {
            tables_dir: Some(&ckpt),
            tokenizer: name.starts_with("deepstrix").then_some(&tm),
            ..LoadOptions::default()
        };
        // The unchanged set loads.
        let m = GgufModel::from_memory(set.clone(), &opts)
            .unwrap_or_else(|e| panic!("{name} unchanged: {}", e.message));
        drop(m);
        for f in fields(&set[0].1) {
            for &v in &f.values {
                let mut s = set.clone();
                let b = &mut s[0].1;
                if f.at + f.width > b.len() {
                    continue;
                }
                b[f.at..f.at + f.width].copy_from_slice(&v.to_le_bytes()[..f.width]);
                n_loads += 1;
                let r = catch_unwind(AssertUnwindSafe(|| {
                    GgufModel::from_memory(s, &opts).map(|_| ())
                }));
                match r {
                    Ok(Ok(())) => *stats.entry("ok".into()).or_default() += 1,
                    Ok(Err(e)) => {
                        assert!(
                            !e.message.is_empty(),
                            "{name}, {} = {v:#x}: empty message",
                            f.what
                        );
                        *stats.entry(format!("{:?}", e.status)).or_default() += 1
                    }
                    Err(p) => {
                        let what = panic_text(&*p);
                        panic!("{name}, {} = {v:#x} panicked: {what}", f.what);
                    }
                }
            }
        }
    }
    eprintln!(
        "{n_loads} dialect files with one field changed, in {:.2} s: {stats:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(stats.get("ErrFormat").copied().unwrap_or(0) > 0);
}

/// A tensor of 2^61 elements of an 8-byte type is 2^64 bytes: a format error
/// in every build (release used to wrap the size to 0, debug to panic).
#[test]
fn a_tensor_size_that_overflows_is_a_format_error() {
    let d = golden_dir().join("dialects");
    let b = std::fs::read(d.join("jigsawpt.gguf")).unwrap();
    let g = Gguf::parse(&b).unwrap();
    // engram_primes.weight is I64 [4, 2]: make it [2^31, 2^30].
    let t = g.tensor("engram_primes.weight").unwrap();
    let mut m = b.clone();
    m[t.entry_at + 4..t.entry_at + 12].copy_from_slice(&(1u64 << 31).to_le_bytes());
    m[t.entry_at + 12..t.entry_at + 20].copy_from_slice(&(1u64 << 30).to_le_bytes());
    let e = Gguf::parse(&m).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrFormat, "{}", e.message);
    assert!(
        e.message.contains("engram_primes.weight") && e.message.contains("overflow"),
        "{}",
        e.message
    );
    let e = GgufModel::from_memory(vec![("j.gguf".into(), m)], &LoadOptions::default())
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrFormat, "{}", e.message);
}
