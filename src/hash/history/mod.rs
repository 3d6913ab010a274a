//! Per-sequence history of compressed token ids by absolute position, and the
//! batch hash over it (SPEC section 1, steps 1-2: compress, window with sticky
//! blocking).

use super::tables::HashTables;
use super::UNSET;
use crate::batch::Limits;
use crate::error::{bail, Error, Result};
use crate::fallible::vec_bytes;

/// Positions per history page.
const PAGE: usize = 4096;

/// One sequence's compressed ids by absolute position, in pages of `PAGE`
/// positions allocated on first write: memory follows the positions actually
/// hashed, so a dead token far out (which needs no look-back) costs one page.
#[derive(Clone, Debug, Default)]
struct SeqHistory {
    pages: Vec<Option<Box<[i32]>>>,
}

impl SeqHistory {
    #[inline]
    fn get(&self, pos: usize) -> i32 {
        match self.pages.get(pos / PAGE) {
            Some(Some(p)) => p[pos % PAGE],
            _ => UNSET,
        }
    }

    /// Make `pos` writable, allocating fallibly: an allocation failure is an
    /// error status, not an abort. Adds only pages of unset entries, which
    /// `get` cannot tell from no page. Returns what it changed, for
    /// [`SeqHistory::unreserve`].
    fn reserve(&mut self, pos: usize) -> Result<Reserved> {
        let pi = pos / PAGE;
        let oom = || {
            Error::new(
                crate::EngramStatus::ErrCapacity,
                format!("out of memory for the history at position {pos}"),
            )
        };
        let r = Reserved {
            page: pi,
            old_len: self.pages.len(),
            old_cap: self.pages.capacity(),
        };
        if self.pages.len() <= pi {
            self.pages
                .try_reserve(pi + 1 - self.pages.len())
                .map_err(|_| oom())?;
            self.pages.resize_with(pi + 1, || None);
        }
        if self.pages[pi].is_none() {
            let mut v: Vec<i32> = Vec::new();
            if v.try_reserve_exact(PAGE).is_err() {
                self.unreserve(&r);
                return Err(oom());
            }
            v.resize(PAGE, UNSET);
            self.pages[pi] = Some(v.into_boxed_slice());
        }
        Ok(r)
    }

    /// Undo a [`SeqHistory::reserve`] whose page holds nothing but unset
    /// entries again: free the page, and give back the page table's growth.
    fn unreserve(&mut self, r: &Reserved) {
        if let Some(p) = self.pages.get_mut(r.page) {
            *p = None;
        }
        if self.pages.len() > r.old_len {
            self.pages.truncate(r.old_len);
        }
        if self.pages.capacity() > r.old_cap {
            // Moved into an allocation of the old size (fallibly: should even
            // that fail, the larger table stays, holding nothing extra).
            let mut v = Vec::new();
            if v.try_reserve_exact(r.old_cap).is_ok() {
                v.append(&mut self.pages);
                self.pages = v;
            }
        }
    }

    /// Reserve `pos`, write `v` there and return what it held, and what the
    /// reservation changed when it had to allocate.
    #[inline]
    fn claim(&mut self, pos: usize, v: i32) -> Result<(i32, Option<Reserved>)> {
        let pi = pos / PAGE;
        let mut r = None;
        if !matches!(self.pages.get(pi), Some(Some(_))) {
            r = Some(self.reserve(pos)?);
        }
        let page = self.pages[pi].as_mut().expect("reserved above");
        Ok((std::mem::replace(&mut page[pos % PAGE], v), r))
    }

    /// Write a reserved position.
    fn set(&mut self, pos: usize, v: i32) {
        let page = self.pages[pos / PAGE]
            .as_mut()
            .expect("reserved before set");
        page[pos % PAGE] = v;
    }

    /// One past the highest position written (0 for none).
    fn len(&self) -> usize {
        for (pi, page) in self.pages.iter().enumerate().rev() {
            if let Some(page) = page {
                if let Some(j) = page.iter().rposition(|&v| v != UNSET) {
                    return pi * PAGE + j + 1;
                }
            }
        }
        0
    }

    /// A copy, allocated fallibly (`None`: out of memory).
    fn try_clone(&self) -> Option<SeqHistory> {
        let mut pages = Vec::new();
        pages.try_reserve_exact(self.pages.len()).ok()?;
        for p in &self.pages {
            pages.push(match p {
                None => None,
                Some(p) => {
                    let mut v = Vec::new();
                    v.try_reserve_exact(p.len()).ok()?;
                    v.extend_from_slice(p);
                    Some(v.into_boxed_slice())
                }
            });
        }
        Some(SeqHistory { pages })
    }

    fn bytes(&self) -> usize {
        self.pages.capacity() * std::mem::size_of::<Option<Box<[i32]>>>()
            + self.pages.iter().flatten().count() * PAGE * 4
    }
}

/// What one [`SeqHistory::reserve`] allocated: the page, and the page
/// table's length and capacity before it.
#[derive(Clone, Copy, Debug)]
struct Reserved {
    page: usize,
    old_len: usize,
    old_cap: usize,
}

/// Per-sequence history of compressed ids by absolute position.
#[derive(Clone, Debug)]
pub struct History {
    limits: Limits,
    seqs: Vec<SeqHistory>,
    /// Per-call scratch, kept to avoid allocating on every call.
    scratch: Scratch,
}

#[derive(Clone, Debug, Default)]
struct Scratch {
    /// (sequence, position, compressed id) of each token of the batch.
    batch: Vec<(usize, usize, i32)>,
    /// What each batch position held before the call, to restore on error.
    saved: Vec<i32>,
    /// (sequence, reservation) of every page this call allocated, to free on
    /// error: a failed call leaves the history's memory as it found it.
    reserved: Vec<(usize, Reserved)>,
    /// Look-back windows `[n, N]`.
    windows: Vec<i64>,
}

/// A placeholder written while a batch is laid into the history: it names the
/// batch token that claimed the position, so a second claim is caught.
/// Real entries are `>= -1` or `UNSET`, so markers never collide with them.
const MARK_BASE: i32 = i32::MIN + 1;

impl History {
    /// Empty histories for `limits.max_seqs` sequences (24 bytes each),
    /// allocated fallibly.
    pub fn new(limits: Limits) -> Result<History> {
        let mut seqs = Vec::new();
        if seqs.try_reserve_exact(limits.max_seqs).is_err() {
            bail!(
                ErrCapacity,
                "out of memory for the history of max_seqs = {} sequences",
                limits.max_seqs
            );
        }
        seqs.resize_with(limits.max_seqs, SeqHistory::default);
        Ok(History {
            limits,
            seqs,
            scratch: Scratch::default(),
        })
    }

    /// Bytes held by the histories (for memory reporting).
    pub fn bytes(&self) -> usize {
        self.seqs.iter().map(SeqHistory::bytes).sum::<usize>() + vec_bytes(&self.seqs)
    }

    /// Bytes of the per-call scratch kept between calls (for memory
    /// reporting): it grows to the largest call and stays.
    pub fn scratch_bytes(&self) -> usize {
        let sc = &self.scratch;
        vec_bytes(&sc.batch)
            + vec_bytes(&sc.saved)
            + vec_bytes(&sc.reserved)
            + vec_bytes(&sc.windows)
    }

    /// Positions hashed so far in `seq` (one past the highest written).
    pub fn len(&self, seq: usize) -> usize {
        self.seqs[seq].len()
    }

    /// A sequence id, as an index ([`Limits::seq`]).
    pub fn check_seq(&self, seq: i32) -> Result<usize> {
        self.limits.seq(seq)
    }

    /// Make `dst` an exact copy of `src`'s history (a fork or a shared prefix).
    pub fn copy(&mut self, src: i32, dst: i32) -> Result<()> {
        let (s, d) = (self.check_seq(src)?, self.check_seq(dst)?);
        if s != d {
            let Some(v) = self.seqs[s].try_clone() else {
                bail!(
                    ErrCapacity,
                    "out of memory to copy sequence {src}'s history ({} bytes) to sequence {dst}",
                    self.seqs[s].bytes()
                );
            };
            self.seqs[d] = v;
        }
        Ok(())
    }

    /// Forget every position of `seq`.
    pub fn drop_seq(&mut self, seq: i32) -> Result<()> {
        let s = self.check_seq(seq)?;
        self.seqs[s] = SeqHistory::default();
        Ok(())
    }

    /// Hash a batch. Each token `i` sits at absolute position `pos[i]` of sequence
    /// `seq_ids[i]`; the batch's own tokens are visible to each other's look-back,
    /// whatever their order in the batch. Writes `[n, n_layers, C]` row ids into
    /// `out` and records the batch in the history. On any error nothing is
    /// written to `out` and the history is as it was.
    pub fn hash(
        &mut self,
        t: &HashTables,
        tokens: &[i32],
        seq_ids: &[i32],
        pos: &[i32],
        out: &mut [i64],
    ) -> Result<()> {
        let n = tokens.len();
        let row = t.n_layers() * t.cols();
        if seq_ids.len() != n || pos.len() != n {
            bail!(
                ErrInvalidArgument,
                "tokens, seq_ids and pos have {n}, {} and {} entries",
                seq_ids.len(),
                pos.len()
            );
        }
        if out.len() != n * row {
            bail!(
                ErrInvalidArgument,
                "output holds {} row ids, {n} tokens need {}",
                out.len(),
                n * row
            );
        }
        self.limits.tokens(n)?;
        let mut sc = std::mem::take(&mut self.scratch);
        let r = self.hash_with(t, tokens, seq_ids, pos, out, &mut sc);
        self.scratch = sc;
        r
    }

    #[allow(clippy::needless_range_loop)] // look-back k indexes the window and the position
    fn hash_with(
        &mut self,
        t: &HashTables,
        tokens: &[i32],
        seq_ids: &[i32],
        pos: &[i32],
        out: &mut [i64],
        sc: &mut Scratch,
    ) -> Result<()> {
        let n = tokens.len();
        let nn = t.max_ngram;
        // 1. Validate each token and claim its (sequence, position) with a
        //    marker, saving what was there; a position claimed twice is an
        //    error. Any error puts back what was claimed.
        sc.batch.clear();
        sc.saved.clear();
        sc.reserved.clear();
        let cap = |e: std::collections::TryReserveError| {
            Error::new(
                crate::EngramStatus::ErrCapacity,
                format!("out of memory for the hash's working buffers ({n} tokens): {e}"),
            )
        };
        sc.batch.try_reserve(n).map_err(cap)?;
        sc.saved.try_reserve(n).map_err(cap)?;
        sc.reserved.try_reserve(n).map_err(cap)?;
        sc.windows.try_reserve(n * nn).map_err(cap)?;
        for i in 0..n {
            // The token map is larger than L2 and read at random: ask for the
            // entry a few tokens ahead now, so it is in cache when needed.
            #[cfg(target_arch = "x86_64")]
            if let Some(&ahead) = tokens.get(i + 16) {
                if let Some(e) = usize::try_from(ahead).ok().and_then(|a| t.token_map.get(a)) {
                    // SAFETY: a prefetch hint of an address inside `token_map`;
                    // it reads nothing and cannot fault.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            e as *const i32 as *const i8,
                        )
                    };
                }
            }
            // The common case of a prefill: the next position of the previous
            // token's sequence, in the same page. Claimed without the general
            // checks (the sequence was checked, the position is in range, its
            // page exists); anything else (a token the map refuses, a position
            // claimed twice, a page or range edge) takes the general path
            // below, which reports it exactly as for any token.
            if let Some(&(s, lp, _)) = sc.batch.last() {
                let p = lp + 1;
                if seq_ids[i] == seq_ids[i - 1]
                    && pos[i] as i64 == pos[i - 1] as i64 + 1
                    && !p.is_multiple_of(PAGE)
                    && p < self.limits.max_positions
                {
                    if let Ok(c) = t.compress(i, tokens[i]) {
                        let page = self.seqs[s].pages[p / PAGE]
                            .as_mut()
                            .expect("the previous position's page");
                        let slot = &mut page[p % PAGE];
                        if !(MARK_BASE..MARK_BASE + n as i32).contains(slot) {
                            let old = std::mem::replace(slot, MARK_BASE + i as i32);
                            sc.batch.push((s, p, c));
                            sc.saved.push(old);
                            continue;
                        }
                    }
                }
            }
            let claimed = (|| {
                let s = self.check_seq(seq_ids[i]).map_err(|e| at_token(i, e))?;
                let p = self.limits.pos(i, pos[i])?;
                let c = t.compress(i, tokens[i])?;
                let (old, r) = self.seqs[s].claim(p, MARK_BASE + i as i32)?;
                Ok((s, p, c, old, r))
            })();
            match claimed {
                Ok((s, p, c, old, r)) => {
                    // (Each push fits the capacity reserved above.)
                    if let Some(r) = r {
                        sc.reserved.push((s, r));
                    }
                    sc.batch.push((s, p, c));
                    sc.saved.push(old);
                    if (MARK_BASE..MARK_BASE + n as i32).contains(&old) {
                        let first = (old - MARK_BASE) as usize;
                        self.restore(sc);
                        bail!(
                            ErrInvalidSequence,
                            "tokens {first} and {i}: sequence {s} position {p} appears twice in one batch"
                        );
                    }
                }
                Err(e) => {
                    self.restore(sc);
                    return Err(e);
                }
            }
        }
        // 2. Lay the batch in, then read every look-back window.
        for &(s, p, c) in &sc.batch {
            self.seqs[s].set(p, c);
        }
        sc.windows.clear();
        sc.windows.resize(n * nn, 0);
        for (i, &(s, p, c)) in sc.batch.iter().enumerate() {
            let (done, rest) = sc.windows.split_at_mut(i * nn);
            let w = &mut rest[..nn];
            if c == -1 {
                w[0] = -1;
                continue;
            }
            // The common case of a prefill: the previous token of the batch
            // is this sequence's previous position. Its window, shifted by
            // one, is this one's look-back (blocked where it was blocked, or
            // entirely if that token is dead), so no history is read.
            if i > 0 && sc.batch[i - 1].0 == s && sc.batch[i - 1].1 + 1 == p {
                let prev = &done[(i - 1) * nn..];
                w[0] = c as i64;
                if prev[0] == -1 {
                    w[1..].fill(t.pad_id);
                } else {
                    w[1..].copy_from_slice(&prev[..nn - 1]);
                }
                continue;
            }
            let h = &self.seqs[s];
            w[0] = c as i64;
            let mut blocked = false;
            for k in 1..nn {
                if !blocked {
                    if k > p {
                        blocked = true;
                    } else {
                        let src = h.get(p - k);
                        if src == UNSET {
                            let q = p - k;
                            self.restore(sc);
                            bail!(
                                ErrMissingHistory,
                                "token {i}: sequence {s} position {p} looks back to position {q}, which was never hashed"
                            );
                        }
                        blocked = src == -1;
                        w[k] = src as i64;
                    }
                }
                if blocked {
                    w[k] = t.pad_id;
                }
            }
        }
        // 3. Hash; nothing below can fail.
        t.hash_windows(&sc.windows, out);
        Ok(())
    }

    /// Put back what the positions claimed so far held, newest first (so a
    /// position claimed twice ends with its original value).
    /// Then free the pages the call allocated, newest first (so each page
    /// table ends with the length and capacity it had before the call).
    fn restore(&mut self, sc: &Scratch) {
        for (&(s, p, _), &old) in sc.batch.iter().zip(&sc.saved).rev() {
            let h = &mut self.seqs[s];
            if let Some(Some(page)) = h.pages.get_mut(p / PAGE) {
                page[p % PAGE] = old;
            }
        }
        for (s, r) in sc.reserved.iter().rev() {
            self.seqs[*s].unreserve(r);
        }
    }
}

fn at_token(i: usize, e: Error) -> Error {
    Error::new(e.status, format!("token {i}: {}", e.message))
}

mod ops;
pub mod state;
pub use ops::Range;
pub use state::StateKey;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod window_tests;

#[cfg(test)]
mod run_tests;
