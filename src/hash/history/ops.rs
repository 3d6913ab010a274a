//! The history operations an engine's KV cache performs on its sequences
//! (llama.cpp's `llama_memory_seq_*`): remove a range, copy a range, keep one
//! sequence, shift a range. Each validates every argument before it changes
//! anything, and builds the new history of the sequence it changes (fallibly)
//! before it replaces the old one: an error leaves every sequence as it was.

use super::{History, SeqHistory, PAGE};
use crate::error::{bail, Error, Result};
use crate::hash::UNSET;

/// A position range `[p0, p1)` as an engine passes it: `p0 < 0` is 0 and
/// `p1 < 0` is "to the end", as in llama.cpp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Range {
    pub p0: usize,
    pub p1: usize,
}

impl Range {
    /// `[p0, p1)` as an engine passes it (`p0 < 0` is 0, `p1 < 0` the end),
    /// checked against `[0, max]`: outside it, or ending before it starts, is
    /// `ERR_INVALID_SEQUENCE`.
    pub fn resolve(p0: i32, p1: i32, max: usize) -> Result<Range> {
        let lo = p0.max(0) as usize;
        let hi = if p1 < 0 { max } else { p1 as usize };
        if lo > max || hi > max {
            bail!(
                ErrInvalidSequence,
                "position range [{p0}, {p1}) outside [0, max_positions = {max}]"
            );
        }
        if lo > hi {
            bail!(
                ErrInvalidSequence,
                "position range [{p0}, {p1}) ends before it starts"
            );
        }
        Ok(Range { p0: lo, p1: hi })
    }
}

impl SeqHistory {
    /// The written positions in `[p0, p1)` and their entries, in order.
    pub(super) fn entries(&self, p0: usize, p1: usize) -> impl Iterator<Item = (usize, i32)> + '_ {
        let (first, last) = (p0 / PAGE, p1.div_ceil(PAGE).min(self.pages.len()));
        (first..last.max(first)).flat_map(move |pi| {
            let page = self.pages[pi].as_deref().unwrap_or(&[]);
            page.iter().enumerate().filter_map(move |(j, &v)| {
                let p = pi * PAGE + j;
                (v != UNSET && (p0..p1).contains(&p)).then_some((p, v))
            })
        })
    }

    /// Forget the positions in `[p0, p1)`, then free the pages left empty.
    pub(super) fn clear(&mut self, p0: usize, p1: usize) {
        let last = p1.div_ceil(PAGE).min(self.pages.len());
        for pi in p0 / PAGE..last {
            if let Some(page) = self.pages[pi].as_mut() {
                let lo = p0.max(pi * PAGE) - pi * PAGE;
                let hi = p1.min((pi + 1) * PAGE) - pi * PAGE;
                page[lo..hi].fill(UNSET);
            }
        }
        self.compact();
    }

    /// Free every page that holds nothing, and the page table's unused tail.
    pub(super) fn compact(&mut self) {
        for p in self.pages.iter_mut() {
            if p.as_ref().is_some_and(|pg| pg.iter().all(|&v| v == UNSET)) {
                *p = None;
            }
        }
        while matches!(self.pages.last(), Some(None)) {
            self.pages.pop();
        }
        if self.pages.is_empty() {
            self.pages = Vec::new();
        }
    }

    /// Write `v` at `pos`, allocating its page fallibly.
    pub(super) fn put(&mut self, pos: usize, v: i32) -> Result<()> {
        self.claim(pos, v).map(|_| ())
    }
}

fn oom(what: &str) -> Error {
    Error::new(
        crate::EngramStatus::ErrCapacity,
        format!("out of memory for {what}"),
    )
}

impl History {
    /// Check `[p0, p1)` (llama.cpp's conventions: `p0 < 0` is 0, `p1 < 0` the
    /// end) against `[0, max_positions]`.
    pub fn range(&self, p0: i32, p1: i32) -> Result<Range> {
        Range::resolve(p0, p1, self.limits.max_positions)
    }

    /// Every sequence (`seq == -1`), or one checked sequence.
    fn seqs_of(&self, seq: i32) -> Result<std::ops::Range<usize>> {
        if seq == -1 {
            return Ok(0..self.seqs.len());
        }
        let s = self.check_seq(seq)?;
        Ok(s..s + 1)
    }

    /// `llama_memory_seq_rm`: forget the positions in `[p0, p1)` of `seq`
    /// (`-1`: of every sequence). A later look-back into them is
    /// `ERR_MISSING_HISTORY`.
    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<()> {
        let seqs = self.seqs_of(seq)?;
        let r = self.range(p0, p1)?;
        for s in seqs {
            self.seqs[s].clear(r.p0, r.p1);
        }
        Ok(())
    }

    /// `llama_memory_seq_cp`: `dst`'s positions in `[p0, p1)` become exactly
    /// `src`'s there (written where `src` is written, forgotten where it is
    /// not); `dst`'s other positions stay.
    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        let (s, d) = (self.check_seq(src)?, self.check_seq(dst)?);
        let r = self.range(p0, p1)?;
        if s == d {
            return Ok(());
        }
        let what = || format!("copying sequence {src}'s positions [{p0}, {p1}) to sequence {dst}");
        let mut new = self.seqs[d].try_clone().ok_or_else(|| oom(&what()))?;
        new.clear(r.p0, r.p1);
        for (p, v) in self.seqs[s].entries(r.p0, r.p1) {
            new.put(p, v).map_err(|_| oom(&what()))?;
        }
        new.compact();
        self.seqs[d] = new;
        Ok(())
    }

    /// `llama_memory_seq_keep`: forget every sequence but `seq`.
    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        let k = self.check_seq(seq)?;
        for (s, h) in self.seqs.iter_mut().enumerate() {
            if s != k {
                *h = SeqHistory::default();
            }
        }
        Ok(())
    }

    /// `llama_memory_seq_add`: move `seq`'s written positions in `[p0, p1)`
    /// by `delta`. An entry that lands below 0 is forgotten; one that would
    /// land at `max_positions` or beyond is `ERR_INVALID_SEQUENCE` (nothing
    /// moves). The range moves as a whole: its positions that no entry lands
    /// on are forgotten, and an entry that lands on a position outside the
    /// range replaces what that position held; outside positions no entry
    /// lands on keep theirs.
    pub fn seq_add(&mut self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        let s = self.check_seq(seq)?;
        let r = self.range(p0, p1)?;
        if delta == 0 || r.p0 == r.p1 {
            return Ok(());
        }
        let max = self.limits.max_positions;
        if delta > 0 {
            if let Some((last, _)) = self.seqs[s].entries(r.p0, r.p1).last() {
                if last as i64 + delta as i64 >= max as i64 {
                    bail!(
                        ErrInvalidSequence,
                        "sequence {seq}: position {last} moved by {delta} lands outside [0, max_positions = {max})"
                    );
                }
            }
        }
        let what = || format!("moving sequence {seq}'s positions [{p0}, {p1}) by {delta}");
        let mut new = self.seqs[s].try_clone().ok_or_else(|| oom(&what()))?;
        new.clear(r.p0, r.p1);
        for (p, v) in self.seqs[s].entries(r.p0, r.p1) {
            let to = p as i64 + delta as i64;
            if to >= 0 {
                new.put(to as usize, v).map_err(|_| oom(&what()))?;
            }
        }
        new.compact();
        self.seqs[s] = new;
        Ok(())
    }

    /// `llama_memory_seq_div`: `d == 1` changes nothing; `d < 1` is
    /// `ERR_INVALID_ARGUMENT`; any other `d` is `ERR_UNSUPPORTED`. Dividing
    /// positions puts `d` tokens on one position; a history holds one token
    /// per position, and the n-gram of a later token is over the tokens
    /// themselves, which a divided position no longer orders.
    pub fn seq_div(&mut self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        self.check_seq(seq)?;
        self.range(p0, p1)?;
        match d {
            1 => Ok(()),
            d if d < 1 => bail!(ErrInvalidArgument, "seq_div by {d} (the divisor must be >= 1)"),
            d => bail!(
                ErrUnsupported,
                "seq_div by {d}: positions divided by {d} would hold {d} tokens each, and an n-gram history holds one token per position; give engram_hash each token's undivided position instead"
            ),
        }
    }

    /// The written positions of `seq` and their entries (compressed ids,
    /// `-1` for a dead token), in order (for tests and tools; allocated
    /// fallibly).
    pub fn entries(&self, seq: usize) -> Result<Vec<(usize, i32)>> {
        let h = &self.seqs[seq];
        let mut v = Vec::new();
        v.try_reserve_exact(h.entries(0, usize::MAX).count())
            .map_err(|_| oom("a copy of the history"))?;
        v.extend(h.entries(0, usize::MAX));
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Limits;

    fn history(max_positions: usize) -> History {
        History::new(Limits {
            max_tokens: 64,
            max_seqs: 3,
            max_positions,
        })
        .unwrap()
    }

    fn fill(h: &mut History, s: usize, ps: impl IntoIterator<Item = usize>) {
        for p in ps {
            h.seqs[s].put(p, p as i32 + 100).unwrap();
        }
    }

    fn ent(h: &History, s: usize) -> Vec<(usize, i32)> {
        h.entries(s).unwrap()
    }

    fn all(h: &History) -> Vec<Vec<(usize, i32)>> {
        (0..h.seqs.len()).map(|s| ent(h, s)).collect()
    }

    #[test]
    fn rm_forgets_a_range_and_frees_pages() {
        let mut h = history(3 * PAGE);
        fill(&mut h, 0, 0..2 * PAGE + 10);
        h.seq_rm(0, PAGE as i32, -1).unwrap();
        assert_eq!(
            ent(&h, 0),
            (0..PAGE).map(|p| (p, p as i32 + 100)).collect::<Vec<_>>()
        );
        assert_eq!(h.seqs[0].pages.len(), 1, "the emptied pages are freed");
        h.seq_rm(-1, -5, 3).unwrap();
        assert_eq!(ent(&h, 0)[0].0, 3);
    }

    #[test]
    fn bad_arguments_change_nothing() {
        let mut h = history(64);
        fill(&mut h, 0, 0..20);
        fill(&mut h, 1, 5..9);
        let before = all(&h);
        use crate::EngramStatus::*;
        let st = |r: Result<()>| r.unwrap_err().status;
        assert_eq!(st(h.seq_rm(3, 0, 1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_rm(-2, 0, 1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_rm(0, 5, 4)), ErrInvalidSequence);
        assert_eq!(st(h.seq_rm(0, 0, 65)), ErrInvalidSequence);
        assert_eq!(st(h.seq_cp(0, 3, 0, -1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_cp(-1, 1, 0, -1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_cp(0, 1, 70, -1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_keep(-1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_add(0, 0, -1, 45)), ErrInvalidSequence);
        assert_eq!(st(h.seq_add(0, 9, 2, -1)), ErrInvalidSequence);
        assert_eq!(st(h.seq_div(0, 0, -1, 0)), ErrInvalidArgument);
        assert_eq!(st(h.seq_div(0, 0, -1, 2)), ErrUnsupported);
        assert_eq!(st(h.seq_div(5, 0, -1, 1)), ErrInvalidSequence);
        assert_eq!(all(&h), before);
        h.seq_div(0, 0, -1, 1).unwrap();
        h.seq_add(0, 0, -1, 44).unwrap(); // 19 + 44 = 63 still fits
        assert_eq!(ent(&h, 0).last().unwrap().0, 63);
    }

    #[test]
    fn add_replaces_what_it_lands_on_and_drops_below_zero() {
        let mut h = history(64);
        fill(&mut h, 0, 0..10);
        // [0, 5) moves up 3: 0..5 land on 3..8, replacing 5, 6 and 7; 0..3
        // are forgotten; 8 and 9 stay.
        h.seq_add(0, 0, 5, 3).unwrap();
        let want: Vec<(usize, i32)> = (3..8)
            .map(|p| (p, p as i32 - 3 + 100))
            .chain([(8, 108), (9, 109)])
            .collect();
        assert_eq!(ent(&h, 0), want);
        // A hole of the moving range does not clear where it lands.
        let mut h = history(64);
        fill(&mut h, 0, [0, 2, 3, 4]);
        h.seq_add(0, 0, 2, 2).unwrap();
        assert_eq!(ent(&h, 0), vec![(2, 100), (3, 103), (4, 104)]);
        // Context shift: what falls below 0 is dropped.
        let mut h = history(64);
        fill(&mut h, 0, 0..10);
        h.seq_add(0, 2, -1, -4).unwrap();
        assert_eq!(
            ent(&h, 0),
            vec![(0, 104), (1, 105), (2, 106), (3, 107), (4, 108), (5, 109)]
        );
    }

    #[test]
    fn cp_copies_holes_too_and_keep_forgets_the_rest() {
        let mut h = history(64);
        fill(&mut h, 0, [1, 2, 5]);
        fill(&mut h, 1, 0..8);
        h.seq_cp(0, 1, 2, 6).unwrap();
        assert_eq!(
            ent(&h, 1),
            vec![(0, 100), (1, 101), (2, 102), (5, 105), (6, 106), (7, 107)]
        );
        fill(&mut h, 2, [9]);
        h.seq_keep(1).unwrap();
        assert!(ent(&h, 0).is_empty() && ent(&h, 2).is_empty());
        assert_eq!(ent(&h, 1).len(), 6);
    }
}
