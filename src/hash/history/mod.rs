//! Per-sequence history of compressed token ids by absolute position, and the
//! batch hash over it (SPEC section 1, steps 1-2: compress, window with sticky
//! blocking).

use super::reduce::Run;
use super::tables::HashTables;
use super::{TOKEN_DEAD, UNSET};
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

    /// The page holding `pos`, allocated (fallibly) if it is not yet, and
    /// what the allocation changed.
    #[inline]
    fn page_mut(&mut self, pos: usize) -> Result<(&mut [i32], Option<Reserved>)> {
        let pi = pos / PAGE;
        let mut r = None;
        if !matches!(self.pages.get(pi), Some(Some(_))) {
            r = Some(self.reserve(pos)?);
        }
        Ok((self.pages[pi].as_deref_mut().expect("reserved above"), r))
    }

    /// [`History::step`] off its common case: the look-back of `p` into
    /// `ctx` (for a live token) across a page edge, then `p`'s page
    /// allocated if it is not and `c` written at `p`. `None`: the look-back
    /// was never hashed or the page cannot be had (the two passes report
    /// which), nothing changed; else what `p` held and what the allocation
    /// changed.
    #[inline(never)]
    fn step_cold(
        &mut self,
        p: usize,
        c: i32,
        pad: i64,
        ctx: Option<&mut [i64]>,
    ) -> Option<(i32, Option<Reserved>)> {
        if let Some(ctx) = ctx {
            // No marker is left between calls: `cs` is never read.
            self.lookback(p, pad, ctx, &[]).ok()?;
        }
        let (page, r) = self.page_mut(p).ok()?;
        Some((std::mem::replace(&mut page[p % PAGE], c), r))
    }

    /// The look-back entries of position `p` (SPEC section 1, step 2) into
    /// `ctx`, the `N-1` entries before the position's own in a sliding
    /// buffer: `ctx[N-1-k]` is the compressed id at `p - k`, or the pad once
    /// the look-back is blocked (before position 0, at a dead token and
    /// beyond it). A batch's marker reads as its token's id in `cs`.
    /// `Err(q)`: position `q`, which the look-back needs, was never hashed.
    #[inline]
    fn lookback(
        &self,
        p: usize,
        pad: i64,
        ctx: &mut [i64],
        cs: &[i32],
    ) -> std::result::Result<(), usize> {
        let back = ctx.len();
        // The common case: the whole look-back in the position's own page.
        let page = match self.pages.get(p / PAGE) {
            Some(Some(page)) if p % PAGE >= back => Some(&page[p % PAGE - back..p % PAGE]),
            _ => None,
        };
        for k in 1..=back {
            let mut v = match page {
                Some(before) => before[back - k],
                None if k > p => -1,
                None => self.get(p - k),
            };
            if v < -1 && v != UNSET {
                v = cs[v.wrapping_sub(MARK_BASE) as usize];
            }
            match v {
                UNSET => return Err(p - k),
                -1 => {
                    ctx[..=back - k].fill(pad);
                    return Ok(());
                }
                v => ctx[back - k] = v as i64,
            }
        }
        Ok(())
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

/// The per-call working buffers. All but `reserved` only grow (to the
/// largest call's need) and are written by index; `reserved` is refilled by
/// each call.
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// The compressed id of each token of the batch.
    cs: Vec<i32>,
    /// What each claimed token's position held before the call, by token, to
    /// restore on error.
    saved: Vec<i32>,
    /// The positions claimed, in token order from token 0: runs of
    /// consecutive batch tokens on consecutive positions of one sequence
    /// inside one page; the first `n_claims` are this call's.
    claims: Vec<Claim>,
    n_claims: usize,
    /// (sequence, reservation) of every page this call allocated, to free on
    /// error: a failed call leaves the history's memory as it found it.
    reserved: Vec<(usize, Reserved)>,
    /// The look-back entries and the batch's compressed ids that the runs'
    /// windows slide over, and the runs ([`HashTables::hash_runs`]).
    xs: Vec<i64>,
    runs: Vec<Run>,
    /// One bit per sequence, set while a decode step ([`History::step`])
    /// has a token of it; all clear between calls.
    seen: Vec<u64>,
}

/// Grow `v` to at least `len` entries (fallibly; never shrinks).
fn grow<T: Copy>(
    v: &mut Vec<T>,
    len: usize,
    fill: T,
) -> std::result::Result<(), std::collections::TryReserveError> {
    if v.len() < len {
        v.try_reserve_exact(len - v.len())?;
        v.resize(len, fill);
    }
    Ok(())
}

/// `len` batch tokens, from the one after the previous claim's last, on
/// positions `p..p + len` of sequence `s`, inside one page.
#[derive(Clone, Copy, Debug, Default)]
struct Claim {
    s: usize,
    p: usize,
    len: usize,
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
        vec_bytes(&sc.cs)
            + vec_bytes(&sc.saved)
            + vec_bytes(&sc.claims)
            + vec_bytes(&sc.reserved)
            + vec_bytes(&sc.xs)
            + vec_bytes(&sc.runs)
            + vec_bytes(&sc.seen)
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

    /// [`History::hash`] with the call's working buffers. In two passes:
    /// claim every token's position (in token order, a run of consecutive
    /// positions a page at a time), then lay the batch's ids in and build
    /// each run's look-back; then hash. Every error is found in token order
    /// and reported as the first failing token's, and puts back what was
    /// claimed.
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
        sc.n_claims = 0;
        sc.reserved.clear();
        let cap = |e: std::collections::TryReserveError| {
            Error::new(
                crate::EngramStatus::ErrCapacity,
                format!("out of memory for the hash's working buffers ({n} tokens): {e}"),
            )
        };
        // Each run holds at least one token and `N-1` look-back entries.
        grow(&mut sc.cs, n, 0).map_err(cap)?;
        grow(&mut sc.saved, n, 0).map_err(cap)?;
        grow(&mut sc.claims, n, Claim::default()).map_err(cap)?;
        grow(&mut sc.xs, n * nn, 0).map_err(cap)?;
        grow(&mut sc.runs, n, Run { x: 0, len: 0 }).map_err(cap)?;
        sc.reserved.try_reserve_exact(n).map_err(cap)?;
        // V4.1's look-back (3) known at compile time.
        let step = if nn == 4 {
            self.step::<3>(t, tokens, seq_ids, pos, sc)
        } else {
            self.step::<0>(t, tokens, seq_ids, pos, sc)
        };
        if let Some((nx, nr)) = step {
            t.hash_runs(&sc.xs[..nx], &sc.runs[..nr], out);
            return Ok(());
        }
        if let Err(e) = self.claim_all(t, tokens, seq_ids, pos, sc) {
            self.restore(sc);
            return Err(e);
        }
        let built = if nn == 4 {
            self.build_runs::<3>(t, n, sc)
        } else {
            self.build_runs::<0>(t, n, sc)
        };
        match built {
            Ok((nx, nr)) => {
                // Nothing below can fail.
                t.hash_runs(&sc.xs[..nx], &sc.runs[..nr], out);
                Ok(())
            }
            Err(e) => {
                self.restore(sc);
                Err(e)
            }
        }
    }

    /// A decode step in one pass: when every token is the only one of its
    /// sequence in the batch, valid, and its look-back was hashed, no token
    /// can see or claim another's positions, so each is laid in and its run
    /// (its look-back, then itself) built as it is read. Returns the entries
    /// of `sc.xs` and the runs written; or, at the first token that is not
    /// such a token (or whose page cannot be allocated), `None`, having put
    /// back what it changed and freed what it allocated, for the two passes
    /// to take the call from the start (and report any error).
    fn step<const BACK: usize>(
        &mut self,
        t: &HashTables,
        tokens: &[i32],
        seq_ids: &[i32],
        pos: &[i32],
        sc: &mut Scratch,
    ) -> Option<(usize, usize)> {
        let n = tokens.len();
        let back = if BACK > 0 { BACK } else { t.max_ngram - 1 };
        let (pad, map, max_pos) = (t.pad_id, &t.token_map[..], self.limits.max_positions);
        // (Without memory for the bits, the two passes do it all.)
        grow(&mut sc.seen, self.seqs.len().div_ceil(64), 0).ok()?;
        let (saved, xs, runs) = (&mut sc.saved[..n], &mut sc.xs[..], &mut sc.runs[..n]);
        let seen = &mut sc.seen[..];
        let (mut nx, mut nr) = (0usize, 0usize);
        let mut i = 0;
        let batch = tokens.iter().zip(seq_ids).zip(pos).zip(saved.iter_mut());
        'tokens: for (((&tok, &sq), &ps), saved) in batch {
            let (Ok(s), Ok(p)) = (usize::try_from(sq), usize::try_from(ps)) else {
                break;
            };
            let Some(h) = self.seqs.get_mut(s).filter(|_| p < max_pos) else {
                break;
            };
            let Some(word) = seen.get_mut(s / 64) else {
                break;
            };
            let bit = 1u64 << (s % 64);
            if *word & bit != 0 {
                break;
            }
            // A decode step's tokens are each a random entry of the map,
            // which is larger than L2: ask for the entry a few tokens ahead
            // now (the prefill's loop does the same).
            prefetch_entry(map, tokens.get(i + 8));
            let Some(c) = compressed(map, tok).0 else {
                break;
            };
            let (pi, off) = (p / PAGE, p % PAGE);
            let Some(ctx) = xs.get_mut(nx..nx + back + 1) else {
                break;
            };
            *saved = match h.pages.get_mut(pi) {
                // The common case: the page exists and holds the look-back,
                // read as `lookback` reads it (no marker is left between
                // calls).
                Some(Some(page)) if off >= back => {
                    if c != -1 && !warm_lookback(&page[off - back..off], pad, ctx) {
                        break 'tokens;
                    }
                    std::mem::replace(&mut page[off], c)
                }
                _ => {
                    let live = (c != -1).then_some(&mut ctx[..back]);
                    match h.step_cold(p, c, pad, live) {
                        Some((old, r)) => {
                            if let Some(r) = r {
                                sc.reserved.push((s, r));
                            }
                            old
                        }
                        None => break,
                    }
                }
            };
            *word |= bit;
            if c == -1 {
                push_dead(runs, &mut nr);
            } else {
                ctx[back] = c as i64;
                runs[nr] = Run { x: nx, len: 1 };
                nr += 1;
                nx += back + 1;
            }
            i += 1;
        }
        // Tokens `0..i` were laid in (their sequences and positions valid).
        for &sq in &seq_ids[..i] {
            seen[sq as usize / 64] &= !(1u64 << (sq as usize % 64));
        }
        if i == n {
            return Some((nx, nr));
        }
        self.undo_step(&seq_ids[..i], &pos[..i], &saved[..i], &mut sc.reserved);
        None
    }

    /// Put back what [`History::step`] laid in for its first tokens
    /// (`saved`: what their positions held) and free the pages it allocated.
    fn undo_step(
        &mut self,
        seq_ids: &[i32],
        pos: &[i32],
        saved: &[i32],
        reserved: &mut Vec<(usize, Reserved)>,
    ) {
        for ((&sq, &ps), &old) in seq_ids.iter().zip(pos).zip(saved) {
            let (s, p) = (sq as usize, ps as usize);
            let page = self.seqs[s].pages[p / PAGE]
                .as_deref_mut()
                .expect("a page written above");
            page[p % PAGE] = old;
        }
        for (s, r) in reserved.iter().rev() {
            self.seqs[*s].unreserve(r);
        }
        reserved.clear();
    }

    /// Pass 1 of [`History::hash_with`]: validate each token and claim its
    /// (sequence, position) with a marker naming it, saving what was there,
    /// into `sc`; a position claimed twice is an error. The caller restores
    /// on error.
    fn claim_all(
        &mut self,
        t: &HashTables,
        tokens: &[i32],
        seq_ids: &[i32],
        pos: &[i32],
        sc: &mut Scratch,
    ) -> Result<()> {
        let n = tokens.len();
        let map = &t.token_map[..];
        let (cs, saved, claims) = (&mut sc.cs[..n], &mut sc.saved[..n], &mut sc.claims[..n]);
        let nc = &mut sc.n_claims;
        let (max_seqs, max_pos) = (self.limits.max_seqs, self.limits.max_positions);
        let mut i = 0;
        while i < n {
            let (s, p) = match (usize::try_from(seq_ids[i]), usize::try_from(pos[i])) {
                (Ok(s), Ok(p)) if s < max_seqs && p < max_pos => (s, p),
                // The checks word the error.
                _ => {
                    self.check_seq(seq_ids[i]).map_err(|e| at_token(i, e))?;
                    self.limits.pos(i, pos[i])?;
                    unreachable!("sequence {} position {} pass", seq_ids[i], pos[i])
                }
            };
            // The run of tokens on the next positions of the same sequence,
            // up to max_positions (a token past it starts the next run, whose
            // check fails).
            let e = run_end(seq_ids, pos, i, n.min(i + (max_pos - p)));
            // A page at a time: compress, allocate the page, claim.
            let mut a = i;
            while a < e {
                let pa = p + (a - i);
                let b = e.min(a + (PAGE - pa % PAGE));
                let mut f = b;
                for j in a..b {
                    // The token map is larger than L2 and read at random:
                    // ask for the entry a few tokens ahead now, so it is in
                    // cache when needed.
                    prefetch_entry(map, tokens.get(j + 16));
                    match compressed(map, tokens[j]).0 {
                        Some(c) => cs[j] = c,
                        None => {
                            f = j;
                            break;
                        }
                    }
                }
                if f > a {
                    let (page, r) = self.seqs[s].page_mut(pa)?;
                    if let Some(r) = r {
                        sc.reserved.push((s, r));
                    }
                    let slots = &mut page[pa % PAGE..pa % PAGE + (f - a)];
                    // A marker of this batch (`MARK_BASE + token`): the first
                    // one found is the position claimed twice (nothing of
                    // this page's tokens is claimed yet).
                    let marker = |v: i32| (v.wrapping_sub(MARK_BASE) as u32 as usize) < n;
                    if slots.iter().fold(false, |any, &v| any | marker(v)) {
                        let k = slots.iter().position(|&v| marker(v)).expect("a marker");
                        let (first, j, q) = ((slots[k] - MARK_BASE) as usize, a + k, pa + k);
                        bail!(
                            ErrInvalidSequence,
                            "tokens {first} and {j}: sequence {s} position {q} appears twice in one batch"
                        );
                    }
                    saved[a..f].copy_from_slice(slots);
                    for (slot, j) in slots.iter_mut().zip(a as i32..) {
                        *slot = MARK_BASE + j;
                    }
                    claims[*nc] = Claim {
                        s,
                        p: pa,
                        len: f - a,
                    };
                    *nc += 1;
                }
                if f < b {
                    // The general check words the error (token, id, map).
                    return Err(t
                        .compress(f, tokens[f])
                        .expect_err("a token `compressed` refuses"));
                }
                a = b;
            }
            i = e;
        }
        Ok(())
    }

    /// Pass 2 of [`History::hash_with`]: lay the batch in (each claim's
    /// markers become its ids) and build the runs, token by token, into
    /// `sc.xs` and `sc.runs`, returning how many entries of each it wrote. A
    /// claim that does not continue the previous one (same sequence, next
    /// position) starts a run from the history's look-back, which reads a
    /// marker still there as the id it stands for (the batch's tokens see
    /// each other whatever their order); a dead token ends the run (its rows
    /// are dead, consecutive dead tokens one run) and blocks the look-back of
    /// the tokens after it. `BACK`, when not 0, is `N - 1` known at compile
    /// time. The caller restores on error.
    fn build_runs<const BACK: usize>(
        &mut self,
        t: &HashTables,
        n: usize,
        sc: &mut Scratch,
    ) -> Result<(usize, usize)> {
        let back = if BACK > 0 { BACK } else { t.max_ngram - 1 };
        let pad = t.pad_id;
        let claims = &sc.claims[..sc.n_claims];
        let (xs, runs, cs) = (&mut sc.xs[..], &mut sc.runs[..], &sc.cs[..n]);
        let (mut nx, mut nr) = (0usize, 0usize);
        // The open run (none while `len` is 0).
        let mut cur = Run { x: 0, len: 0 };
        // The next position of the previous claim's sequence.
        let mut next: Option<(usize, usize)> = None;
        let mut i = 0;
        for &c in claims {
            let starts = next != Some((c.s, c.p));
            next = Some((c.s, c.p + c.len));
            let ids = &cs[i..i + c.len];
            let page = self.seqs[c.s].pages[c.p / PAGE]
                .as_deref_mut()
                .expect("a claimed page");
            let off = c.p % PAGE;
            if c.len == 1 {
                page[off] = ids[0]; // (no call to memcpy)
            } else {
                page[off..off + c.len].copy_from_slice(ids);
            }
            let mut j = 0;
            while j < ids.len() {
                if ids[j] == -1 {
                    if cur.x != Run::DEAD {
                        if cur.len > 0 {
                            runs[nr] = cur;
                            nr += 1;
                        }
                        cur = Run {
                            x: Run::DEAD,
                            len: 0,
                        };
                    }
                    cur.len += 1;
                    j += 1;
                    continue;
                }
                let first = starts && j == 0;
                if cur.x == Run::DEAD || cur.len == 0 || first {
                    if cur.len > 0 {
                        runs[nr] = cur;
                        nr += 1;
                    }
                    cur = Run { x: nx, len: 0 };
                    let ctx = &mut xs[nx..nx + back];
                    nx += back;
                    if !first {
                        ctx.fill(pad);
                    } else if let Err(q) = self.seqs[c.s].lookback(c.p, pad, ctx, cs) {
                        let (s, p) = (c.s, c.p);
                        bail!(
                            ErrMissingHistory,
                            "token {i}: sequence {s} position {p} looks back to position {q}, which was never hashed"
                        );
                    }
                }
                // The live tokens up to the next dead one join the run.
                let live = ids[j..]
                    .iter()
                    .position(|&v| v == -1)
                    .unwrap_or(ids.len() - j);
                for (x, &v) in xs[nx..nx + live].iter_mut().zip(&ids[j..j + live]) {
                    *x = v as i64;
                }
                nx += live;
                cur.len += live;
                j += live;
            }
            i += c.len;
        }
        if cur.len > 0 {
            runs[nr] = cur;
            nr += 1;
        }
        Ok((nx, nr))
    }

    /// Put back what the claimed positions held, newest first, then free the
    /// pages the call allocated, newest first (so each page table ends with
    /// the length and capacity it had before the call).
    fn restore(&mut self, sc: &Scratch) {
        let claims = &sc.claims[..sc.n_claims];
        let mut end: usize = claims.iter().map(|c| c.len).sum();
        for c in claims.iter().rev() {
            let old = &sc.saved[end - c.len..end];
            end -= c.len;
            if let Some(Some(page)) = self.seqs[c.s].pages.get_mut(c.p / PAGE) {
                page[c.p % PAGE..c.p % PAGE + c.len].copy_from_slice(old);
            }
        }
        for (s, r) in sc.reserved.iter().rev() {
            self.seqs[*s].unreserve(r);
        }
    }
}

/// A live token's look-back `before` (the `back` entries before it, in its
/// own page) into `ctx[..back]`, as `lookback` reads it: a dead entry pads
/// everything before it. False if an entry was never hashed (the two passes
/// then report it).
#[inline(always)]
fn warm_lookback(before: &[i32], pad: i64, ctx: &mut [i64]) -> bool {
    let mut k = before.len();
    while k > 0 {
        match before[k - 1] {
            UNSET => return false,
            -1 => {
                ctx[..k].fill(pad);
                return true;
            }
            v => {
                ctx[k - 1] = v as i64;
                k -= 1;
            }
        }
    }
    true
}

/// A dead token's run: it extends the last run if that is dead too.
#[inline(always)]
fn push_dead(runs: &mut [Run], nr: &mut usize) {
    match nr.checked_sub(1).map(|r| &mut runs[r]) {
        Some(r) if r.x == Run::DEAD => r.len += 1,
        _ => {
            runs[*nr] = Run {
                x: Run::DEAD,
                len: 1,
            };
            *nr += 1;
        }
    }
}

/// One past the last token of the run starting at token `i`: the tokens
/// after it on the next positions of its sequence, up to token `limit`.
/// Eight at a time while whole groups continue it (a prefill's run is
/// thousands of tokens). Positions are in `[0, 2^31)`, so their difference
/// is exact in wrapping i32 arithmetic, as is `e - i < 2^24`.
#[inline]
fn run_end(seq_ids: &[i32], pos: &[i32], i: usize, limit: usize) -> usize {
    let (sq, p) = (seq_ids[i], pos[i]);
    let (seq_ids, pos) = (&seq_ids[..limit], &pos[..limit]);
    let follows =
        |e: usize, sq_e: i32, p_e: i32| (sq_e == sq) & (p_e.wrapping_sub(p) == (e - i) as i32);
    let mut e = i + 1;
    while e + 8 <= limit {
        let (s8, p8): (&[i32; 8], &[i32; 8]) = (
            seq_ids[e..e + 8].try_into().expect("8"),
            pos[e..e + 8].try_into().expect("8"),
        );
        let mut all = true;
        for k in 0..8 {
            all &= follows(e + k, s8[k], p8[k]);
        }
        if !all {
            break;
        }
        e += 8;
    }
    while e < limit && follows(e, seq_ids[e], pos[e]) {
        e += 1;
    }
    e
}

/// Ask for the cache line of raw token `tok`'s entry in `map`, if it has
/// one (a hint: nothing is read).
#[inline(always)]
fn prefetch_entry(map: &[i32], tok: Option<&i32>) {
    if let Some(e) = tok.and_then(|&t| compressed(map, t).1) {
        prefetch(e);
    }
}

/// Ask for the cache line holding `r` (a hint: nothing is read).
#[inline(always)]
fn prefetch<T>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch hint of the address of a live reference; it reads
    // nothing and cannot fault.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            r as *const T as *const i8,
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}

/// Raw token `tok`'s compressed id (`-1` for a dead one), or `None` for an
/// id outside `map` ([`HashTables::compress`] words the error); and, for
/// prefetching, the map entry read.
#[inline(always)]
fn compressed(map: &[i32], tok: i32) -> (Option<i32>, Option<&i32>) {
    if tok == TOKEN_DEAD {
        return (Some(-1), None);
    }
    let e = usize::try_from(tok).ok().and_then(|t| map.get(t));
    (e.copied(), e)
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
