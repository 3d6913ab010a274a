//! The figures: a readable table per schedule, and JSON (`--json`).

use crate::ids::Hasher;
use crate::opts::Opts;
use crate::sim::{CacheCounts, PageCounts, BLOCK, PAGE};
use crate::stream::{Accesses, Schedule};
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// One simulation's counts, per layer.
#[derive(Clone, Debug)]
pub struct CacheRow {
    pub size: usize,
    pub bytes: u64,
    /// Rows a layer's cache holds (`None`: the page cache).
    pub cap_rows: Option<usize>,
    /// `lru`, `clock`, `s3fifo`, `tool-lru`, or `mmap`.
    pub policy: String,
    pub hits: Vec<u64>,
    pub lookups: Vec<u64>,
    /// Bytes read from storage.
    pub read: Vec<u64>,
    pub seconds: f64,
}

impl CacheRow {
    pub fn cache(size: usize, bytes: u64, cap: usize, name: &str, c: CacheCounts) -> Self {
        let lookups = c.hits.iter().zip(&c.misses).map(|(h, m)| h + m).collect();
        CacheRow {
            size,
            bytes,
            cap_rows: Some(cap),
            policy: name.to_string(),
            hits: c.hits,
            lookups,
            read: c.blocks.iter().map(|b| b * BLOCK).collect(),
            seconds: 0.0,
        }
    }

    pub fn pages(size: usize, bytes: u64, c: PageCounts) -> Self {
        let hits = c
            .touches
            .iter()
            .zip(&c.faults)
            .map(|(t, f)| t - f)
            .collect();
        CacheRow {
            size,
            bytes,
            cap_rows: None,
            policy: "mmap".into(),
            hits,
            lookups: c.touches,
            read: c.reads.iter().map(|r| r * PAGE).collect(),
            seconds: 0.0,
        }
    }

    fn rate(h: u64, n: u64) -> f64 {
        if n == 0 {
            0.0
        } else {
            h as f64 / n as f64
        }
    }

    /// Hit rate per layer, then over all layers.
    pub fn hit_rates(&self) -> Vec<f64> {
        let mut v: Vec<f64> = (0..self.hits.len())
            .map(|l| Self::rate(self.hits[l], self.lookups[l]))
            .collect();
        v.push(Self::rate(
            self.hits.iter().sum(),
            self.lookups.iter().sum(),
        ));
        v
    }
}

/// One schedule's replays.
pub struct SchedReport {
    pub sched: Schedule,
    pub tokens: u64,
    pub steps: u64,
    pub lookups: Vec<u64>,
    pub distinct: Vec<u64>,
    pub rows: Vec<CacheRow>,
}

impl SchedReport {
    pub fn new(sched: Schedule, acc: &Accesses, rows: Vec<CacheRow>) -> Self {
        SchedReport {
            sched,
            tokens: acc.tokens,
            steps: acc.steps,
            lookups: acc.lookups.clone(),
            distinct: acc.distinct.clone(),
            rows,
        }
    }

    fn at(&self, size: usize, policy: &str) -> Option<&CacheRow> {
        self.rows
            .iter()
            .find(|r| r.size == size && r.policy == policy)
    }

    /// Bytes read per token.
    fn per_token(&self, r: &CacheRow) -> f64 {
        r.read.iter().sum::<u64>() as f64 / self.tokens.max(1) as f64
    }

    /// Where `policy` hit less than the library's LRU: (size, layer or
    /// `None` for all layers).
    fn below_lru(&self, policy: &str, sizes: usize) -> Vec<(usize, Option<usize>)> {
        let mut v = Vec::new();
        for s in 0..sizes {
            let (Some(p), Some(l)) = (self.at(s, policy), self.at(s, "lru")) else {
                continue;
            };
            for layer in 0..p.hits.len() {
                if p.hits[layer] < l.hits[layer] {
                    v.push((s, Some(layer)));
                }
            }
            if p.hits.iter().sum::<u64>() < l.hits.iter().sum::<u64>() {
                v.push((s, None));
            }
        }
        v
    }
}

/// How one schedule's steps deduplicate.
pub struct DedupRow {
    pub sched: Schedule,
    pub tokens: u64,
    pub steps: u64,
    pub lookups: Vec<u64>,
    pub distinct: Vec<u64>,
}

impl DedupRow {
    pub fn new(sched: Schedule, acc: &Accesses) -> Self {
        DedupRow {
            sched,
            tokens: acc.tokens,
            steps: acc.steps,
            lookups: acc.lookups.clone(),
            distinct: acc.distinct.clone(),
        }
    }

    /// Distinct ids / lookups per layer, then over all layers.
    fn ratios(&self) -> Vec<f64> {
        let mut v: Vec<f64> = (0..self.lookups.len())
            .map(|l| CacheRow::rate(self.distinct[l], self.lookups[l]))
            .collect();
        let (d, n) = (self.distinct.iter().sum(), self.lookups.iter().sum());
        v.push(CacheRow::rate(d, n));
        v
    }
}

pub struct Report {
    pub head: Value,
    pub layer_ids: Vec<u32>,
    pub sizes: Vec<u64>,
    pub scheds: Vec<SchedReport>,
    pub dedup: Vec<DedupRow>,
}

/// `64 MiB`, `4 GiB`.
pub fn show_size(b: u64) -> String {
    match b {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn pct(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{:>7.2}%", x * 100.0))
        .collect::<Vec<_>>()
        .join(" ")
}

impl Report {
    /// `format`: name and row bytes; `kept`: texts and tokens replayed;
    /// `per_input`: tokens and texts kept of each input.
    pub fn new(
        o: &Opts,
        h: &Hasher,
        (fmt, row_bytes): (&str, u64),
        (n_texts, tokens): (usize, usize),
        per_input: &[crate::run::PerInput],
    ) -> Report {
        let inputs: Vec<Value> = o
            .inputs
            .iter()
            .zip(per_input)
            .map(|(p, k)| {
                json!({"path": p, "tokens": k.tokens, "requests": k.requests,
                       "files": k.files, "last_file": k.last})
            })
            .collect();
        let head = json!({
            "tool": "engram-replay",
            "inputs": inputs,
            "round_robin": o.round_robin,
            "request_tokens": o.request_tokens,
            "requests": n_texts,
            "tokens": tokens,
            "max_tokens": o.max_tokens,
            "format": fmt,
            "row_bytes": row_bytes,
            "layer_ids": h.tables.config.layer_ids,
            "rows": h.tables.rows,
            "ids_per_token_per_layer": h.cols(),
            "sizes": o.sizes,
            "seqs": o.seqs,
            "chunk": o.chunk,
            "readahead_kib": o.readahead_kib,
            "page_bytes": PAGE,
            "block_bytes": BLOCK,
        });
        Report {
            head,
            layer_ids: h.tables.config.layer_ids.clone(),
            sizes: o.sizes.clone(),
            scheds: Vec::new(),
            dedup: Vec::new(),
        }
    }

    fn layer_heads(&self, what: &str) -> String {
        let mut s: Vec<String> = self
            .layer_ids
            .iter()
            .map(|l| format!("{what} L{l:<2}"))
            .collect();
        s.push(format!("{what} all"));
        s.iter()
            .map(|x| format!("{x:>8}"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// One schedule's table.
    fn sched_table(&self, r: &SchedReport, out: &mut String) {
        let per_tok = |v: &[u64]| v.iter().sum::<u64>() as f64 / r.tokens.max(1) as f64;
        let _ = writeln!(
            out,
            "\n== {}: {} tokens, {} steps; ids a token a layer after the step's dedup: {:.2} of {:.0}",
            r.sched.name(),
            r.tokens,
            r.steps,
            per_tok(&r.distinct) / r.lookups.len() as f64,
            per_tok(&r.lookups) / r.lookups.len() as f64,
        );
        let _ = writeln!(
            out,
            "{:>8}  {:<8} {:>10} {}  {:>12} {:>8}",
            "RAM",
            "policy",
            "rows/layer",
            self.layer_heads("hit"),
            "read B/token",
            "vs mmap"
        );
        for s in 0..self.sizes.len() {
            let mmap = r.at(s, "mmap").map(|m| r.per_token(m));
            for row in r.rows.iter().filter(|x| x.size == s) {
                let bt = r.per_token(row);
                let _ = writeln!(
                    out,
                    "{:>8}  {:<8} {:>10} {}  {:>12.1} {:>8}",
                    show_size(row.bytes),
                    row.policy,
                    row.cap_rows.map_or("pages".into(), |c| c.to_string()),
                    pct(&row.hit_rates()),
                    bt,
                    mmap.map_or("-".into(), |m| format!("{:.3}", bt / m.max(1e-9))),
                );
            }
        }
    }

    /// The verdicts: each policy against LRU, and the bytes target.
    fn verdicts(&self) -> (Vec<String>, Value) {
        let mut lines = Vec::new();
        let mut js = serde_json::Map::new();
        let pols: Vec<String> = self.scheds[0]
            .rows
            .iter()
            .map(|r| r.policy.clone())
            .filter(|p| p != "mmap" && p != "tool-lru")
            .fold(Vec::new(), |mut v, p| {
                if !v.contains(&p) {
                    v.push(p);
                }
                v
            });
        for p in &pols {
            let mut below = Vec::new();
            let mut worst = f64::INFINITY;
            for r in &self.scheds {
                for (s, l) in r.below_lru(p, self.sizes.len()) {
                    let layer = l.map_or("all".into(), |l| format!("L{}", self.layer_ids[l]));
                    below.push(format!(
                        "{} {} {}",
                        r.sched.key(),
                        show_size(self.sizes[s]),
                        layer
                    ));
                }
                for s in 0..self.sizes.len() {
                    if let (Some(x), Some(m)) = (r.at(s, p), r.at(s, "mmap")) {
                        if [1u64 << 30, 4 << 30].contains(&self.sizes[s]) {
                            worst = worst.min(r.per_token(m) / r.per_token(x).max(1e-9));
                        }
                    }
                }
            }
            let bytes = if worst.is_finite() {
                format!(
                    "at 1 and 4 GiB it reads at least {worst:.1}x fewer bytes than mmap (target 5x: {})",
                    if worst >= 5.0 { "met" } else { "NOT met" }
                )
            } else {
                "no 1 or 4 GiB size replayed (the bytes target's sizes)".to_string()
            };
            let vs_lru = if below.is_empty() {
                "at least LRU's hits at every size, layer and schedule".to_string()
            } else {
                format!("BELOW LRU at {}", below.join(", "))
            };
            lines.push(format!("{p}: {vs_lru}; {bytes}"));
            js.insert(p.clone(), json!({"below_lru": below, "min_mmap_over_cache_at_1_4_gib": if worst.is_finite() { json!(worst) } else { Value::Null }}));
        }
        (lines, Value::Object(js))
    }

    /// The dedup table.
    fn dedup_table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\n== dedup gain: distinct ids / ids looked up, per step (decode batches are the server mix's steps)"
        );
        let _ = writeln!(
            out,
            "{:<30} {:>10} {}",
            "steps",
            "steps",
            self.layer_heads("dist")
        );
        for d in &self.dedup {
            let _ = writeln!(
                out,
                "{:<30} {:>10} {}",
                d.sched.name(),
                d.steps,
                pct(&d.ratios())
            );
        }
    }

    fn to_json(&self, verdict: Value) -> Value {
        let scheds: Vec<Value> = self
            .scheds
            .iter()
            .map(|r| {
                let rows: Vec<Value> = r
                    .rows
                    .iter()
                    .map(|x| {
                        json!({
                            "bytes": x.bytes, "policy": x.policy, "rows_per_layer": x.cap_rows,
                            "hits": x.hits, "lookups": x.lookups, "read_bytes": x.read,
                            "hit_rate": x.hit_rates(), "read_bytes_per_token": r.per_token(x),
                            "seconds": x.seconds,
                        })
                    })
                    .collect();
                json!({
                    "schedule": r.sched.key(), "name": r.sched.name(), "tokens": r.tokens,
                    "steps": r.steps, "lookups": r.lookups, "distinct": r.distinct, "caches": rows,
                })
            })
            .collect();
        let dedup: Vec<Value> = self
            .dedup
            .iter()
            .map(|d| {
                json!({
                    "schedule": d.sched.key(), "tokens": d.tokens, "steps": d.steps,
                    "lookups": d.lookups, "distinct": d.distinct, "distinct_over_lookups": d.ratios(),
                })
            })
            .collect();
        let mut v = self.head.clone();
        v["schedules"] = json!(scheds);
        v["dedup"] = json!(dedup);
        v["verdict"] = verdict;
        v
    }

    /// Where the library's LRU and the tool's own differ (`--check-lru`).
    fn lru_mismatch(&self) -> Vec<String> {
        let mut bad = Vec::new();
        for r in &self.scheds {
            for s in 0..self.sizes.len() {
                if let (Some(a), Some(b)) = (r.at(s, "lru"), r.at(s, "tool-lru")) {
                    if a.hits != b.hits || a.read != b.read {
                        bad.push(format!(
                            "{} {}: library lru {:?} hits, the tool's {:?}",
                            r.sched.key(),
                            show_size(self.sizes[s]),
                            a.hits,
                            b.hits
                        ));
                    }
                }
            }
        }
        bad
    }

    /// Print the tables (stdout, or stderr when the JSON goes to stdout),
    /// write the JSON, and fail if `--check-lru` found a difference.
    pub fn finish(&self, o: &Opts) -> Result<()> {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "engram-replay: {} tokens of {} requests; {} rows of {} bytes; RAM split evenly over the {} layers' row caches, \
             one exact-LRU page cache of 4 KiB pages for all the files (readahead {}); hit rates over the step-deduplicated lookups",
            self.head["tokens"], self.head["requests"], self.head["format"].as_str().unwrap_or("?"),
            self.head["row_bytes"], self.layer_ids.len(),
            if o.readahead_kib == 0 { "off".to_string() } else { format!("{} KiB", o.readahead_kib) },
        );
        for i in self.head["inputs"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  input {}: {} tokens, {} requests, its first {} files (the last {})",
                i["path"], i["tokens"], i["requests"], i["files"], i["last_file"]
            );
        }
        for r in &self.scheds {
            self.sched_table(r, &mut out);
        }
        self.dedup_table(&mut out);
        let (lines, verdict) = self.verdicts();
        let _ = writeln!(
            out,
            "\n== policies against exact LRU (the library's) and mmap"
        );
        for l in &lines {
            let _ = writeln!(out, "{l}");
        }
        let bad = self.lru_mismatch();
        if o.check_lru && bad.is_empty() {
            let _ = writeln!(out, "check-lru: the library's LRU and the tool's own count the same hits and bytes at every size");
        }
        match o.json.as_deref() {
            Some("-") => {
                eprint!("{out}");
                println!("{}", serde_json::to_string_pretty(&self.to_json(verdict))?);
            }
            Some(path) => {
                print!("{out}");
                std::fs::write(
                    path,
                    serde_json::to_string_pretty(&self.to_json(verdict))? + "\n",
                )?;
            }
            None => print!("{out}"),
        }
        if !bad.is_empty() {
            bail!(
                "the library's LRU differs from the tool's: {}",
                bad.join("; ")
            );
        }
        Ok(())
    }
}
