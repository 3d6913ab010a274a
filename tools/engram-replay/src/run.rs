//! The run: texts -> ids -> each schedule's replays (in parallel jobs) ->
//! the report.

use crate::ids::{Hasher, TextIds};
use crate::lru::Lru;
use crate::opts::Opts;
use crate::report::{CacheRow, DedupRow, Report, SchedReport};
use crate::sim::{replay_cache, replay_pages, Layout, RowPolicy, PAGE};
use crate::stream::{accesses, Accesses, Schedule, Shape};
use crate::Text;
use anyhow::{bail, Context as _, Result};
use engram::rowcache::{new_policy, Policy, PolicyKind};
use engram::EngramType;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// The library's policy as the replay drives it: lookup, and admit on a miss.
pub struct Library(pub Box<dyn Policy>);

impl RowPolicy for Library {
    fn access(&mut self, id: u64) -> bool {
        if self.0.lookup(id).is_some() {
            return true;
        }
        self.0.admit(id);
        false
    }
}

/// Bytes of a row of `width` values in the format named `name` (the
/// library's names, any case; `fp8` is the packed fp8 rows).
pub fn row_bytes(name: &str, width: usize) -> Result<(String, u64)> {
    let want = if name.eq_ignore_ascii_case("fp8") {
        "fp8_e4m3_e8m0"
    } else {
        name
    };
    for v in (0..64).chain(1000..1003) {
        if let Some(t) = EngramType::from_u32(v) {
            if t.name().eq_ignore_ascii_case(want) {
                let t = EngramType::row_format(v, width)?;
                return Ok((t.name().to_string(), t.row_bytes(width) as u64));
            }
        }
    }
    bail!("unknown row format {name:?}")
}

/// What was kept of one input: tokens, requests, and its files (the
/// first `files` in name order, the last of them `last`).
#[derive(Clone, Debug, Default)]
pub struct PerInput {
    pub tokens: u64,
    pub requests: u64,
    pub files: u64,
    pub last: String,
}

/// Tokenize and hash the texts, at most `max` tokens in all, each text one
/// request or (`request` > 0) requests of at most `request` tokens; also
/// the tokens and requests kept of each input.
fn texts_ids(
    h: &Hasher,
    texts: &[Text],
    inputs: usize,
    (max, request): (usize, usize),
) -> Result<(Vec<TextIds>, Vec<PerInput>)> {
    let ctx = h.context()?;
    let mut out = Vec::new();
    let mut per = vec![PerInput::default(); inputs.max(1)];
    let mut total = 0usize;
    for group in texts.chunks(64) {
        let body: Vec<String> = group.iter().map(|t| t.body.clone()).collect();
        for (toks, t) in h.tokenize(&body)?.into_iter().zip(group) {
            // Each request: the whole text, or pieces of `request` tokens.
            for req in toks.chunks(request.max(1)) {
                let keep = req.len().min(max - total);
                if keep > 0 {
                    out.push(h.hash_text(&ctx, &req[..keep])?);
                    total += keep;
                    let p = &mut per[t.input];
                    p.tokens += keep as u64;
                    p.requests += 1;
                    if p.last != t.path {
                        p.files += 1;
                        p.last = t.path.clone();
                    }
                }
                if total >= max {
                    return Ok((out, per));
                }
            }
        }
    }
    Ok((out, per))
}

/// One simulation: a policy (or the tool's own LRU, `None`) or the page
/// cache (`page`), at a cache size.
#[derive(Clone, Debug)]
enum Job {
    Cache(usize, Option<PolicyKind>),
    Pages(usize),
}

/// Run `jobs` over the accesses on `threads` threads; results in job order.
fn run_jobs(acc: &Accesses, lay: &Layout, o: &Opts, jobs: &[Job]) -> Result<Vec<CacheRow>> {
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<CacheRow>>>> = Mutex::new(Vec::new());
    results.lock().unwrap().resize_with(jobs.len(), || None);
    let nl = lay.rows.len() as u64;
    std::thread::scope(|s| {
        for _ in 0..o.threads.min(jobs.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let r = run_job(acc, lay, o, job, nl);
                results.lock().unwrap()[i] = Some(r);
            });
        }
    });
    results
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

fn run_job(acc: &Accesses, lay: &Layout, o: &Opts, job: &Job, nl: u64) -> Result<CacheRow> {
    let t0 = Instant::now();
    let mut row = match *job {
        Job::Cache(si, kind) => {
            let bytes = o.sizes[si];
            let cap = (bytes / nl / lay.row_bytes) as usize;
            let mut pols: Vec<Box<dyn RowPolicy>> = Vec::new();
            for _ in 0..nl {
                pols.push(match kind {
                    Some(k) => Box::new(Library(
                        new_policy(k, cap)
                            .with_context(|| format!("{} of {cap} rows", k.name()))?,
                    )),
                    None => Box::new(Lru::new(cap)),
                });
            }
            let c = replay_cache(acc, lay, &mut pols);
            let name = kind.map_or("tool-lru", |k| k.name());
            CacheRow::cache(si, bytes, cap, name, c)
        }
        Job::Pages(si) => {
            let bytes = o.sizes[si];
            let ra = (o.readahead_kib * 1024 / PAGE).max(1);
            let c = replay_pages(acc, lay, bytes / PAGE, ra);
            CacheRow::pages(si, bytes, c)
        }
    };
    row.seconds = t0.elapsed().as_secs_f64();
    Ok(row)
}

/// The jobs of one schedule: every policy and the page cache at every size.
fn jobs(o: &Opts, kinds: &[PolicyKind]) -> Vec<Job> {
    let mut v = Vec::new();
    for si in 0..o.sizes.len() {
        v.push(Job::Pages(si));
        for &k in kinds {
            v.push(Job::Cache(si, Some(k)));
        }
        if o.check_lru {
            v.push(Job::Cache(si, None));
        }
    }
    v
}

pub fn run(o: &Opts) -> Result<()> {
    let t0 = Instant::now();
    let h = Hasher::load(&o.config, &o.tokenizer)?;
    let shape = Shape {
        layers: h.layers(),
        cols: h.cols(),
    };
    let width = h.tables.config.head_dim.unwrap_or(256);
    let (fmt, rb) = match o.row_bytes {
        Some(b) => (format!("{b}-byte rows"), b),
        None => row_bytes(&o.format, width)?,
    };
    let kinds: Vec<PolicyKind> = o
        .policies
        .iter()
        .map(|p| PolicyKind::parse(p).with_context(|| format!("unknown policy {p:?}")))
        .collect::<Result<_>>()?;
    let lay = Layout {
        row_bytes: rb,
        rows: h.tables.rows.clone(),
    };
    let texts = crate::read_texts(&o.inputs, o.round_robin)?;
    let max = o.max_tokens.unwrap_or(usize::MAX);
    let request = if o.request_tokens == 0 {
        usize::MAX
    } else {
        o.request_tokens
    };
    let (ids, per_input) = texts_ids(&h, &texts, o.inputs.len(), (max, request))?;
    let tokens: usize = ids.iter().map(|t| t.tokens).sum();
    eprintln!(
        "{} texts, {tokens} tokens tokenized and hashed in {:.1} s",
        ids.len(),
        t0.elapsed().as_secs_f64()
    );
    if o.inputs_only {
        for (p, k) in o.inputs.iter().zip(&per_input) {
            println!(
                "{p}: {} tokens, {} requests, its first {} files (the last {})",
                k.tokens, k.requests, k.files, k.last
            );
        }
        return Ok(());
    }
    let mut rep = Report::new(o, &h, (&fmt, rb), (ids.len(), tokens), &per_input);
    let scheds = [
        Schedule::Stream,
        Schedule::Mix(o.seqs),
        Schedule::Prefill(o.chunk),
    ];
    for sched in scheds {
        let t1 = Instant::now();
        let acc = accesses(&ids, shape, sched, true);
        let rows = run_jobs(&acc, &lay, o, &jobs(o, &kinds))?;
        eprintln!(
            "{}: replayed in {:.1} s",
            sched.name(),
            t1.elapsed().as_secs_f64()
        );
        rep.scheds.push(SchedReport::new(sched, &acc, rows));
    }
    for sched in [1, 8, 64]
        .map(Schedule::Mix)
        .into_iter()
        .chain([Schedule::Prefill(o.chunk)])
    {
        rep.dedup
            .push(DedupRow::new(sched, &accesses(&ids, shape, sched, false)));
    }
    rep.finish(o)
}
