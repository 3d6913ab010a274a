//! Per-sequence history of compressed token ids by absolute position, and the
//! batch hash over it (SPEC section 1, steps 1-2: compress, window with sticky
//! blocking).

use super::tables::HashTables;
use super::UNSET;
use crate::batch::Limits;
use crate::error::{bail, Error, Result};

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
    /// `get` cannot tell from no page.
    fn reserve(&mut self, pos: usize) -> Result<()> {
        let pi = pos / PAGE;
        let oom = || {
            Error::new(
                crate::EngramStatus::ErrCapacity,
                format!("out of memory for the history at position {pos}"),
            )
        };
        if self.pages.len() <= pi {
            self.pages
                .try_reserve(pi + 1 - self.pages.len())
                .map_err(|_| oom())?;
            self.pages.resize_with(pi + 1, || None);
        }
        if self.pages[pi].is_none() {
            let mut v: Vec<i32> = Vec::new();
            v.try_reserve_exact(PAGE).map_err(|_| oom())?;
            v.resize(PAGE, UNSET);
            self.pages[pi] = Some(v.into_boxed_slice());
        }
        Ok(())
    }

    /// Reserve `pos`, write `v` there and return what it held.
    #[inline]
    fn claim(&mut self, pos: usize, v: i32) -> Result<i32> {
        let pi = pos / PAGE;
        if !matches!(self.pages.get(pi), Some(Some(_))) {
            self.reserve(pos)?;
        }
        let page = self.pages[pi].as_mut().expect("reserved above");
        Ok(std::mem::replace(&mut page[pos % PAGE], v))
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
        self.seqs.iter().map(SeqHistory::bytes).sum::<usize>()
            + self.seqs.capacity() * std::mem::size_of::<SeqHistory>()
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
        for i in 0..n {
            let claimed = (|| {
                let s = self.check_seq(seq_ids[i]).map_err(|e| at_token(i, e))?;
                let p = self.limits.pos(i, pos[i])?;
                let c = t.compress(i, tokens[i])?;
                let old = self.seqs[s].claim(p, MARK_BASE + i as i32)?;
                Ok((s, p, c, old))
            })();
            match claimed {
                Ok((s, p, c, old)) => {
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
            let w = &mut sc.windows[i * nn..(i + 1) * nn];
            if c == -1 {
                w[0] = -1;
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
    fn restore(&mut self, sc: &Scratch) {
        for (&(s, p, _), &old) in sc.batch.iter().zip(&sc.saved).rev() {
            let h = &mut self.seqs[s];
            if let Some(Some(page)) = h.pages.get_mut(p / PAGE) {
                page[p % PAGE] = old;
            }
        }
    }
}

fn at_token(i: usize, e: Error) -> Error {
    Error::new(e.status, format!("token {i}: {}", e.message))
}
