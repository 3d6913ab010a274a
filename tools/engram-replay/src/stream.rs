//! The decode-order access streams an engine's steps make of the texts' ids.
//!
//! A step is a set of tokens the engine runs together; its ids are
//! deduplicated and sorted by row (the order the reads for a step are issued
//! in: by offset), per layer. Three schedules:
//! - [`Schedule::Stream`]: one text after another, one token a step;
//! - [`Schedule::Mix`]`(s)`: a server's batch of `s` sequences, one token of
//!   each a step; a sequence whose text ends takes the next text;
//! - [`Schedule::Prefill`]`(n)`: each text in chunks of `n` tokens, a chunk a
//!   step.

use crate::ids::TextIds;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    Stream,
    Mix(usize),
    Prefill(usize),
}

impl Schedule {
    pub fn name(&self) -> String {
        match self {
            Schedule::Stream => "one stream".into(),
            Schedule::Mix(s) => format!("server mix of {s} sequences"),
            Schedule::Prefill(n) => format!("prefill in {n}-token chunks"),
        }
    }

    pub fn key(&self) -> String {
        match self {
            Schedule::Stream => "stream".into(),
            Schedule::Mix(s) => format!("mix{s}"),
            Schedule::Prefill(n) => format!("prefill{n}"),
        }
    }
}

/// The shape of the ids: layers, ids a token has in each.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub layers: usize,
    pub cols: usize,
}

/// Call `f` with each step's tokens as (text, token) pairs, in order.
pub fn for_each_step(texts: &[TextIds], sched: Schedule, mut f: impl FnMut(&[(u32, u32)])) {
    let mut step: Vec<(u32, u32)> = Vec::new();
    match sched {
        Schedule::Stream => {
            for (ti, t) in texts.iter().enumerate() {
                for k in 0..t.tokens {
                    f(&[(ti as u32, k as u32)]);
                }
            }
        }
        Schedule::Prefill(n) => {
            for (ti, t) in texts.iter().enumerate() {
                for c in (0..t.tokens).step_by(n.max(1)) {
                    step.clear();
                    step.extend((c..t.tokens.min(c + n)).map(|k| (ti as u32, k as u32)));
                    f(&step);
                }
            }
        }
        Schedule::Mix(s) => {
            // Each slot: (text, next token); `next` is the next text to start.
            let mut slots: Vec<(usize, usize)> = Vec::new();
            let mut next = 0;
            loop {
                slots.retain(|&(ti, k)| k < texts[ti].tokens);
                while slots.len() < s.max(1) && next < texts.len() {
                    if texts[next].tokens > 0 {
                        slots.push((next, 0));
                    }
                    next += 1;
                }
                if slots.is_empty() {
                    break;
                }
                step.clear();
                for sl in slots.iter_mut() {
                    step.push((sl.0 as u32, sl.1 as u32));
                    sl.1 += 1;
                }
                f(&step);
            }
        }
    }
}

/// A schedule's accesses: per step and layer the step's distinct ids,
/// sorted. `ids` holds them step after step, layer after layer inside a
/// step; `lens[step * layers + l]` counts each run.
pub struct Accesses {
    pub shape: Shape,
    pub tokens: u64,
    pub steps: u64,
    pub ids: Vec<u32>,
    pub lens: Vec<u32>,
    /// Per layer: ids looked up before deduplication.
    pub lookups: Vec<u64>,
    /// Per layer: each step's distinct ids, summed over the steps (the
    /// lookups after deduplication).
    pub distinct: Vec<u64>,
}

impl Accesses {
    /// Call `f(layer, ids)` for each step and layer in order.
    pub fn for_each_run(&self, mut f: impl FnMut(usize, &[u32])) {
        let mut at = 0usize;
        for (i, &n) in self.lens.iter().enumerate() {
            let n = n as usize;
            f(i % self.shape.layers, &self.ids[at..at + n]);
            at += n;
        }
    }
}

/// Build a schedule's accesses; with `keep` false only the counts are kept
/// (the dedup figures of schedules that are not replayed).
pub fn accesses(texts: &[TextIds], shape: Shape, sched: Schedule, keep: bool) -> Accesses {
    let per = shape.layers * shape.cols;
    let mut a = Accesses {
        shape,
        tokens: 0,
        steps: 0,
        ids: Vec::new(),
        lens: Vec::new(),
        lookups: vec![0; shape.layers],
        distinct: vec![0; shape.layers],
    };
    let mut buf: Vec<u32> = Vec::new();
    for_each_step(texts, sched, |step| {
        a.steps += 1;
        a.tokens += step.len() as u64;
        for l in 0..shape.layers {
            buf.clear();
            for &(ti, k) in step {
                let base = k as usize * per + l * shape.cols;
                buf.extend_from_slice(&texts[ti as usize].ids[base..base + shape.cols]);
            }
            a.lookups[l] += buf.len() as u64;
            buf.sort_unstable();
            buf.dedup();
            a.distinct[l] += buf.len() as u64;
            if keep {
                a.ids.extend_from_slice(&buf);
                a.lens.push(buf.len() as u32);
            }
        }
    });
    a
}
