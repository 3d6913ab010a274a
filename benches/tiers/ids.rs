//! Row-id streams: real text through the V4.1 tokenizer and the library's
//! hash (the replay tool's corpus, `tools/engram-replay/corpus.sh`), or, when
//! no text is there, a synthetic Zipf stream (development only, labelled).

use super::file::mix64;
use engram::Context;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Layer 1's ids per token.
pub const C: usize = 24;

/// Token streams ("lanes"): each a concatenation of whole texts, so that
/// lane `i` is one sequence an engine decodes; `labels` says where they came from.
pub struct Lanes {
    pub tokens: Vec<Vec<i32>>,
    pub label: String,
}

fn files_under(p: &Path, out: &mut Vec<PathBuf>) {
    if p.is_file() {
        out.push(p.to_path_buf());
        return;
    }
    let Ok(rd) = std::fs::read_dir(p) else { return };
    let mut e: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    e.sort();
    for x in e {
        files_under(&x, out);
    }
}

/// `n` lanes of at least `len` tokens from the texts under `dir` (its
/// subdirectories, the corpus's classes, taken in turn so that every lane
/// mixes prose, code and languages); `None` if there is too little text.
pub fn text_lanes(
    dir: &Path,
    tok: &tokenizers::Tokenizer,
    n: usize,
    long: usize,
    short: usize,
) -> Option<Lanes> {
    let len = |i: usize| if i == 0 { long } else { short };
    let mut classes: Vec<Vec<PathBuf>> = Vec::new();
    let mut subs: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    subs.sort();
    for s in subs.iter().filter(|s| s.is_dir()) {
        let mut v = Vec::new();
        files_under(s, &mut v);
        if !v.is_empty() {
            classes.push(v);
        }
    }
    if classes.is_empty() {
        return None;
    }
    let names: Vec<String> = subs
        .iter()
        .filter(|s| s.is_dir())
        .map(|s| s.file_name().unwrap().to_string_lossy().into())
        .collect();
    let mut lanes = vec![Vec::new(); n];
    let mut next = vec![0usize; classes.len()];
    let (mut files, mut c) = (0usize, 0usize);
    while let Some(li) = (0..n).find(|&i| lanes[i].len() < len(i)) {
        let cl = c % classes.len();
        c += 1;
        let Some(p) = classes[cl].get(next[cl]) else {
            if next.iter().zip(&classes).all(|(k, v)| *k >= v.len()) {
                return None;
            }
            continue;
        };
        next[cl] += 1;
        let text = String::from_utf8_lossy(&std::fs::read(p).ok()?).into_owned();
        let enc = tok.encode(text.as_str(), false).ok()?;
        lanes[li].extend(enc.get_ids().iter().map(|&t| t as i32));
        files += 1;
    }
    Some(Lanes {
        tokens: lanes,
        label: format!(
            "real text: {files} files of {} ({}) through the V4.1 tokenizer and hash",
            dir.display(),
            names.join(", ")
        ),
    })
}

/// Each lane's row ids, `[tokens, per]` (both layers): the lane hashed as one
/// sequence (decode order gives the same ids: the hash depends on the history only).
pub fn hash_lanes(ctx: &Context, lanes: &Lanes, chunk: usize) -> Vec<Vec<i64>> {
    let per = ctx.ids_per_token();
    lanes
        .tokens
        .iter()
        .enumerate()
        .map(|(s, t)| {
            let mut ids = Vec::with_capacity(t.len() * per);
            let mut out = vec![0i64; chunk * per];
            for (ci, part) in t.chunks(chunk).enumerate() {
                let pos: Vec<i32> = (0..part.len()).map(|i| (ci * chunk + i) as i32).collect();
                let o = &mut out[..part.len() * per];
                ctx.hash(part, &vec![s as i32; part.len()], &pos, o)
                    .unwrap();
                ids.extend_from_slice(o);
            }
            ids
        })
        .collect()
}

/// Synthetic ids (development only): Zipf(s = 1) ranks scattered over the
/// table by a hash, `[len, per]` per lane (every layer's ids below `rows`).
pub fn zipf_lanes(n: usize, len: usize, rows: u64, per: usize) -> Vec<Vec<i64>> {
    let ln = (rows as f64).ln();
    (0..n)
        .map(|l| {
            (0..len * per)
                .map(|i| {
                    let u = (mix64((l as u64) << 40 ^ i as u64) >> 11) as f64 / (1u64 << 53) as f64;
                    (mix64((u * ln).exp() as u64 ^ 0x5eed) % rows) as i64
                })
                .collect()
        })
        .collect()
}

/// What a step must read from storage at least: its distinct rows, the
/// distinct 512-byte blocks they span, and the reads when each maximal run
/// of adjacent needed blocks is one read.
pub fn distinct(ids: &[i64], rb: u64, header: u64) -> (usize, usize, usize) {
    let mut r: Vec<i64> = ids.to_vec();
    r.sort_unstable();
    r.dedup();
    let mut blocks: Vec<u64> = Vec::with_capacity(r.len() * 2);
    for &id in &r {
        let a = header + id as u64 * rb;
        for b in a / 512..=(a + rb - 1) / 512 {
            blocks.push(b);
        }
    }
    blocks.sort_unstable();
    blocks.dedup();
    let runs = 1 + blocks.windows(2).filter(|w| w[1] != w[0] + 1).count();
    (
        r.len(),
        blocks.len(),
        if blocks.is_empty() { 0 } else { runs },
    )
}

/// An exact LRU of 4 KiB pages holding `budget` bytes: the page cache an
/// `mmap` of the file gets with that much RAM, without read-around (so a
/// lower bound on what mmap reads). Counts the pages read in.
pub struct PageLru {
    cap: usize,
    tick: u64,
    at: HashMap<u64, u64>,
    order: std::collections::BTreeMap<u64, u64>,
    pub misses: u64,
}

impl PageLru {
    pub fn new(budget: u64) -> PageLru {
        PageLru {
            cap: (budget / 4096) as usize,
            tick: 0,
            at: HashMap::new(),
            order: Default::default(),
            misses: 0,
        }
    }

    pub fn touch(&mut self, ids: &[i64], rb: u64, header: u64) {
        for &id in ids {
            let a = header + id as u64 * rb;
            for p in a / 4096..=(a + rb - 1) / 4096 {
                self.tick += 1;
                if let Some(old) = self.at.insert(p, self.tick) {
                    self.order.remove(&old);
                } else {
                    self.misses += 1;
                    if self.at.len() > self.cap {
                        let (_, victim) = self.order.pop_first().unwrap();
                        self.at.remove(&victim);
                    }
                }
                self.order.insert(self.tick, p);
            }
        }
    }
}
