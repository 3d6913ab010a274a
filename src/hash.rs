//! The n-gram hash: tables, per-sequence history, and the hash itself
//! (SPEC section 1, steps 1-3). Pure integer code with no backend knowledge.

use crate::error::{bail, Error, Result};

/// Token id that marks a dead position explicitly (a position fed by an
/// embedding instead of a token id, an image token, ...). It hashes like a
/// token whose `token_map` entry is `-1`.
pub const TOKEN_DEAD: i32 = -1;

/// Row id written for every column of a dead token. `apply` leaves such
/// tokens untouched.
pub const ROW_ID_DEAD: i64 = -1;

/// History entry for a position that was never hashed.
const UNSET: i32 = i32::MIN;

/// The validated hash tables of all engram layers, in the GGUF flat layout.
#[derive(Clone, Debug)]
pub struct HashTables {
    /// Model layer ids of the engram layers, in hash-output order.
    pub layer_ids: Vec<u32>,
    /// Max n-gram size `N` (look-backs `0..N`).
    pub max_ngram: usize,
    /// Hash heads per n-gram size `H`.
    pub n_heads: usize,
    /// Raw token id -> compressed id, `-1` for a token the map leaves out.
    pub token_map: Vec<i32>,
    /// The pad in the compressed space (`token_map[pad_token_id]`).
    pub pad_id: i64,
    /// `[layers * N]`
    pub multipliers: Vec<i64>,
    /// `[layers * C]`, column `(k-1)*H + h`
    pub primes: Vec<i64>,
    /// `[layers * C]`
    pub offsets: Vec<i64>,
    /// Rows each layer's table needs: the largest `offset + prime` of its columns.
    pub rows_needed: Vec<u64>,
    /// `1/prime` per column, when every prime allows the floating-point
    /// reduction of [`rem_fast`] (all of them in `[2^14, 2^62)`).
    inv_primes: Option<Vec<f64>>,
    /// Whether the AVX-512 form of that reduction runs (8 heads at a time).
    simd: bool,
}

/// `x.rem_euclid(p)` without a division, for `p` in `[2^14, 2^62)` and
/// `inv = 1.0 / p as f64`.
///
/// `x as f64` is within 2^9 of `x` and the product carries two more roundings
/// of 2^-53, so the quotient estimate is within `(2^9 + 2^11) / p < 0.16` of
/// `x / p`; truncated, it is within 1.16 of `x / p`. The remainder from it,
/// computed in wrapping i64 (exact, as the true value is small), lies in
/// `(-1.16 p, 1.16 p)`: at most two additions of `p` or one subtraction make it
/// exact. (Truncation, not `floor`, because `floor` is a library call on
/// baseline x86-64.)
#[inline(always)]
pub fn rem_fast(x: i64, p: i64, inv: f64) -> i64 {
    let q = (x as f64 * inv) as i64;
    let mut r = x.wrapping_sub(q.wrapping_mul(p));
    if r < 0 {
        r += p;
    }
    if r < 0 {
        r += p;
    }
    if r >= p {
        r -= p;
    }
    r
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// The columns of one look-back `k` of one layer, 8 heads at a time, with
    /// the same reduction as [`super::rem_fast`] in AVX-512 (DQ for the 64-bit
    /// conversions and multiply).
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512dq; the slices hold a multiple of 8.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn columns(
        rolling: i64,
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        out: &mut [i64],
    ) {
        let x = _mm512_set1_epi64(rolling);
        let xf = _mm512_cvtepi64_pd(x);
        let zero = _mm512_setzero_si512();
        for j in (0..out.len()).step_by(8) {
            let p = _mm512_loadu_si512(primes.as_ptr().add(j) as *const _);
            let iv = _mm512_loadu_pd(inv.as_ptr().add(j));
            let o = _mm512_loadu_si512(offsets.as_ptr().add(j) as *const _);
            let q = _mm512_cvttpd_epi64(_mm512_mul_pd(xf, iv));
            let mut r = _mm512_sub_epi64(x, _mm512_mullo_epi64(q, p));
            let m = _mm512_cmplt_epi64_mask(r, zero);
            r = _mm512_mask_add_epi64(r, m, r, p);
            let m = _mm512_cmplt_epi64_mask(r, zero);
            r = _mm512_mask_add_epi64(r, m, r, p);
            let m = _mm512_cmpge_epi64_mask(r, p);
            r = _mm512_mask_sub_epi64(r, m, r, p);
            _mm512_storeu_si512(out.as_mut_ptr().add(j) as *mut _, _mm512_add_epi64(r, o));
        }
    }

    /// Row ids of every window: `windows` is `[n, N]` (a dead window has
    /// `w[0] == -1`), `out` is `[n, L*C]`, through [`columns`]; the batch loop
    /// lives inside a target-feature function so that `columns` inlines.
    ///
    /// # Safety
    /// As [`columns`]; `multipliers` is `[L*N]`, the column arrays `[L*C]` with
    /// `C = (N-1)*H`, `H` a multiple of 8.
    #[target_feature(enable = "avx512f,avx512dq")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn windows(
        windows: &[i64],
        nn: usize,
        h: usize,
        multipliers: &[i64],
        primes: &[i64],
        inv: &[f64],
        offsets: &[i64],
        dead: i64,
        out: &mut [i64],
    ) {
        let cols = (nn - 1) * h;
        let nl = multipliers.len() / nn;
        let row = nl * cols;
        for (w, o) in windows.chunks_exact(nn).zip(out.chunks_exact_mut(row)) {
            if w[0] == -1 {
                o.fill(dead);
                continue;
            }
            for l in 0..nl {
                let m = &multipliers[l * nn..(l + 1) * nn];
                let mut rolling = w[0].wrapping_mul(m[0]);
                for k in 1..nn {
                    rolling ^= w[k].wrapping_mul(m[k]);
                    let c = l * cols + (k - 1) * h..l * cols + k * h;
                    columns(
                        rolling,
                        &primes[c.clone()],
                        &inv[c.clone()],
                        &offsets[c.clone()],
                        &mut o[c],
                    );
                }
            }
        }
    }

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }
}

/// The raw tables as an engine hands them over (GGUF widths).
pub struct HashTablesIn<'a> {
    pub layer_ids: &'a [u32],
    pub max_ngram: usize,
    pub n_heads: usize,
    pub token_map: &'a [i32],
    pub pad_id: i64,
    pub multipliers: &'a [u64],
    pub primes: &'a [u64],
    pub offsets: &'a [u64],
}

impl HashTables {
    pub fn new(t: &HashTablesIn<'_>) -> Result<HashTables> {
        let nl = t.layer_ids.len();
        if nl == 0 {
            bail!(ErrInvalidConfig, "no engram layers (n_layers = 0)");
        }
        for (i, a) in t.layer_ids.iter().enumerate() {
            if t.layer_ids[..i].contains(a) {
                bail!(
                    ErrInvalidConfig,
                    "engram layer id {a} appears twice in layer_ids"
                );
            }
        }
        if t.max_ngram < 2 {
            bail!(
                ErrInvalidConfig,
                "max_ngram is {}, must be at least 2",
                t.max_ngram
            );
        }
        if t.n_heads == 0 {
            bail!(ErrInvalidConfig, "n_heads is 0");
        }
        if t.max_ngram > 64 || t.n_heads > 1024 {
            bail!(
                ErrInvalidConfig,
                "max_ngram {} / n_heads {} out of range (at most 64 / 1024)",
                t.max_ngram,
                t.n_heads
            );
        }
        let cols = (t.max_ngram - 1) * t.n_heads;
        if t.token_map.is_empty() {
            bail!(ErrInvalidConfig, "token_map is empty");
        }
        if let Some(i) = t.token_map.iter().position(|&m| m < -1) {
            bail!(
                ErrInvalidConfig,
                "token_map[{i}] = {} (entries are compressed ids >= 0, or -1)",
                t.token_map[i]
            );
        }
        if t.pad_id < 0 || t.pad_id > i32::MAX as i64 {
            bail!(
                ErrInvalidConfig,
                "pad_id {} is not a compressed id",
                t.pad_id
            );
        }
        let check_len = |name: &str, got: usize, want: usize| -> Result<()> {
            if got != want {
                bail!(
                    ErrInvalidConfig,
                    "{name} has {got} entries, expected {want} (n_layers {nl} x {})",
                    if name == "multipliers" {
                        "max_ngram"
                    } else {
                        "C"
                    }
                );
            }
            Ok(())
        };
        check_len("multipliers", t.multipliers.len(), nl * t.max_ngram)?;
        check_len("primes", t.primes.len(), nl * cols)?;
        check_len("offsets", t.offsets.len(), nl * cols)?;
        let mut rows_needed = Vec::with_capacity(nl);
        for l in 0..nl {
            let mut need = 0u64;
            for c in 0..cols {
                let i = l * cols + c;
                let (p, o) = (t.primes[i], t.offsets[i]);
                if p == 0 || p > i64::MAX as u64 {
                    bail!(
                        ErrInvalidConfig,
                        "primes[{i}] (layer {}, column {c}) = {p} is not a positive i64",
                        t.layer_ids[l]
                    );
                }
                let end = o.checked_add(p).filter(|&e| e <= i64::MAX as u64);
                let Some(end) = end else {
                    bail!(
                        ErrInvalidConfig,
                        "offsets[{i}] + primes[{i}] overflows i64 (layer {}, column {c})",
                        t.layer_ids[l]
                    );
                };
                need = need.max(end);
            }
            rows_needed.push(need);
        }
        Ok(HashTables {
            layer_ids: t.layer_ids.to_vec(),
            max_ngram: t.max_ngram,
            n_heads: t.n_heads,
            token_map: t.token_map.to_vec(),
            pad_id: t.pad_id,
            // The multipliers are i64 values (GGUF stores them as u64 bits).
            multipliers: t.multipliers.iter().map(|&m| m as i64).collect(),
            primes: t.primes.iter().map(|&p| p as i64).collect(),
            offsets: t.offsets.iter().map(|&o| o as i64).collect(),
            rows_needed,
            simd: false,
            inv_primes: t
                .primes
                .iter()
                .all(|&p| (1 << 14..1 << 62).contains(&p))
                .then(|| t.primes.iter().map(|&p| 1.0 / p as f64).collect()),
        }
        .with_simd(true))
    }

    /// Use the AVX-512 reduction where the CPU and the tables allow it
    /// (`want = false` keeps the scalar one, for tests comparing the two).
    pub fn with_simd(mut self, want: bool) -> HashTables {
        #[cfg(target_arch = "x86_64")]
        {
            self.simd =
                want && self.inv_primes.is_some() && self.n_heads % 8 == 0 && simd::available();
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self.simd = false && want;
        }
        self
    }

    /// Whether the AVX-512 reduction is in use.
    pub fn simd(&self) -> bool {
        self.simd
    }

    /// Hash columns per token per layer, `C = (N-1)*H`.
    pub fn cols(&self) -> usize {
        (self.max_ngram - 1) * self.n_heads
    }

    pub fn n_layers(&self) -> usize {
        self.layer_ids.len()
    }

    /// Index of model layer `layer_id` among the engram layers.
    pub fn layer_index(&self, layer_id: u32) -> Option<usize> {
        self.layer_ids.iter().position(|&l| l == layer_id)
    }

    /// Number of distinct compressed ids the map produces.
    pub fn compressed_vocab(&self) -> usize {
        self.token_map
            .iter()
            .map(|&m| m as i64 + 1)
            .max()
            .unwrap_or(0) as usize
    }

    /// The compressed id of raw token `tok` (`-1` for a dead one), or an error.
    fn compress(&self, i: usize, tok: i32) -> Result<i32> {
        if tok == TOKEN_DEAD {
            return Ok(-1);
        }
        match usize::try_from(tok).ok().and_then(|t| self.token_map.get(t)) {
            Some(&m) => Ok(m),
            None => bail!(
                ErrInvalidToken,
                "token {i}: id {tok} is outside token_map [0, {}) (use {TOKEN_DEAD} to mark a dead position)",
                self.token_map.len()
            ),
        }
    }

    /// Row ids of every layer for a batch of look-back windows (`[n, N]`, a
    /// dead one starting with -1) into `out` (`[n, n_layers * C]`).
    pub fn hash_windows(&self, windows: &[i64], out: &mut [i64]) {
        #[cfg(target_arch = "x86_64")]
        if let (true, Some(inv)) = (self.simd, &self.inv_primes) {
            // SAFETY: `simd` is set only when the CPU has avx512f and avx512dq
            // and `n_heads` is a multiple of 8; the sizes are the tables'.
            unsafe {
                simd::windows(
                    windows,
                    self.max_ngram,
                    self.n_heads,
                    &self.multipliers,
                    &self.primes,
                    inv,
                    &self.offsets,
                    ROW_ID_DEAD,
                    out,
                )
            };
            return;
        }
        let row = self.n_layers() * self.cols();
        for (w, o) in windows
            .chunks_exact(self.max_ngram)
            .zip(out.chunks_exact_mut(row))
        {
            if w[0] == -1 {
                o.fill(ROW_ID_DEAD);
            } else {
                self.hash_window(w, o);
            }
        }
    }

    /// Row ids of every layer for one position whose look-back window (compressed
    /// ids, `w[0]` the position itself) is `w`; `out` is `[n_layers * C]`.
    #[inline]
    pub fn hash_window(&self, w: &[i64], out: &mut [i64]) {
        let (n, h, cols) = (self.max_ngram, self.n_heads, self.cols());
        for l in 0..self.n_layers() {
            let m = &self.multipliers[l * n..(l + 1) * n];
            let primes = &self.primes[l * cols..(l + 1) * cols];
            let offsets = &self.offsets[l * cols..(l + 1) * cols];
            let o = &mut out[l * cols..(l + 1) * cols];
            let mut rolling = w[0].wrapping_mul(m[0]);
            match &self.inv_primes {
                #[cfg(target_arch = "x86_64")]
                Some(inv) if self.simd => {
                    let inv = &inv[l * cols..(l + 1) * cols];
                    for k in 1..n {
                        rolling ^= w[k].wrapping_mul(m[k]);
                        let c = (k - 1) * h..k * h;
                        // SAFETY: `simd` is set only when the CPU has avx512f and
                        // avx512dq and `h` is a multiple of 8.
                        unsafe {
                            simd::columns(
                                rolling,
                                &primes[c.clone()],
                                &inv[c.clone()],
                                &offsets[c.clone()],
                                &mut o[c],
                            )
                        };
                    }
                }
                Some(inv) => {
                    let inv = &inv[l * cols..(l + 1) * cols];
                    for k in 1..n {
                        rolling ^= w[k].wrapping_mul(m[k]);
                        for hh in 0..h {
                            let c = (k - 1) * h + hh;
                            o[c] = rem_fast(rolling, primes[c], inv[c]) + offsets[c];
                        }
                    }
                }
                None => {
                    for k in 1..n {
                        rolling ^= w[k].wrapping_mul(m[k]);
                        for hh in 0..h {
                            let c = (k - 1) * h + hh;
                            o[c] = rolling.rem_euclid(primes[c]) + offsets[c];
                        }
                    }
                }
            }
        }
    }
}

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

    fn bytes(&self) -> usize {
        self.pages.capacity() * std::mem::size_of::<Option<Box<[i32]>>>()
            + self.pages.iter().flatten().count() * PAGE * 4
    }
}

/// Per-sequence history of compressed ids by absolute position.
#[derive(Clone, Debug, Default)]
pub struct History {
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

/// Capacity limits fixed at create time.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_positions: usize,
}

impl History {
    pub fn new(max_seqs: usize) -> History {
        History {
            seqs: vec![SeqHistory::default(); max_seqs],
            scratch: Scratch::default(),
        }
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

    pub fn check_seq(&self, seq: i32) -> Result<usize> {
        match usize::try_from(seq) {
            Ok(s) if s < self.seqs.len() => Ok(s),
            _ => bail!(
                ErrInvalidSequence,
                "sequence id {seq} outside [0, max_seqs = {})",
                self.seqs.len()
            ),
        }
    }

    /// Make `dst` an exact copy of `src`'s history (a fork or a shared prefix).
    pub fn copy(&mut self, src: i32, dst: i32) -> Result<()> {
        let (s, d) = (self.check_seq(src)?, self.check_seq(dst)?);
        if s != d {
            let v = self.seqs[s].clone();
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
        lim: &Limits,
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
        if n > lim.max_tokens {
            bail!(
                ErrCapacity,
                "{n} tokens in one call, the context was created for at most {}",
                lim.max_tokens
            );
        }
        let mut sc = std::mem::take(&mut self.scratch);
        let r = self.hash_with(t, lim, tokens, seq_ids, pos, out, &mut sc);
        self.scratch = sc;
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn hash_with(
        &mut self,
        t: &HashTables,
        lim: &Limits,
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
                let p = match usize::try_from(pos[i]) {
                    Ok(p) if p < lim.max_positions => p,
                    _ => bail!(
                        ErrInvalidSequence,
                        "token {i}: position {} outside [0, max_positions = {})",
                        pos[i],
                        lim.max_positions
                    ),
                };
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
        // 3. Lay the batch in, then read every look-back window.
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
        // 4. Hash; nothing below can fail.
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

/// The primes of SPEC section 3: for each layer, each n-gram size, each head,
/// the next prime above the current value (restarting at `vocab_size - 1` for
/// every n-gram size) that no earlier (layer, n-gram, head) took. Returns
/// `[n_layers * (max_ngram-1) * n_heads]`.
pub fn derive_primes(
    n_layers: usize,
    max_ngram: usize,
    n_heads: usize,
    vocab_size: u64,
) -> Vec<u64> {
    let mut taken = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(n_layers * (max_ngram - 1) * n_heads);
    for _ in 0..n_layers {
        for _ in 1..max_ngram {
            let mut cur = vocab_size.saturating_sub(1);
            for _ in 0..n_heads {
                let mut c = cur + 1;
                while !is_prime(c) || taken.contains(&c) {
                    c += 1;
                }
                taken.insert(c);
                out.push(c);
                cur = c;
            }
        }
    }
    out
}

/// Per-layer exclusive prefix sums of `primes` over each layer's `cols` columns.
pub fn derive_offsets(primes: &[u64], cols: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(primes.len());
    for layer in primes.chunks(cols) {
        let mut acc = 0u64;
        for &p in layer {
            out.push(acc);
            acc += p;
        }
    }
    out
}

/// Deterministic Miller-Rabin for all u64.
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    for p in [2u64, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        if n % p == 0 {
            return n == p;
        }
    }
    let (mut d, mut r) = (n - 1, 0);
    while d % 2 == 0 {
        d /= 2;
        r += 1;
    }
    let mul = |a: u64, b: u64| ((a as u128 * b as u128) % n as u128) as u64;
    let pow = |mut a: u64, mut e: u64| {
        let mut x = 1u64;
        while e > 0 {
            if e & 1 == 1 {
                x = mul(x, a);
            }
            a = mul(a, a);
            e >>= 1;
        }
        x
    };
    'witness: for a in [2u64, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37] {
        let mut x = pow(a, d);
        if x == 1 || x == n - 1 {
            continue;
        }
        for _ in 1..r {
            x = mul(x, x);
            if x == n - 1 {
                continue 'witness;
            }
        }
        return false;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn miller_rabin_agrees_with_trial_division() {
        for n in 0u64..5000 {
            let trial = n >= 2 && (2..n).take_while(|d| d * d <= n).all(|d| n % d != 0);
            assert_eq!(is_prime(n), trial, "{n}");
        }
        assert!(is_prime(18446744073709551557)); // largest u64 prime
        assert!(!is_prime(3215031751)); // strong pseudoprime to bases 2, 3, 5, 7
    }

    #[test]
    fn rem_fast_equals_rem_euclid() {
        let mut z = 1u64;
        let mut next = || {
            z = z.wrapping_add(0x9e3779b97f4a7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
            x ^ (x >> 31)
        };
        let primes = [
            1i64 << 14,
            16_000_057,
            16_777_259,
            (1 << 31) - 1,
            (1 << 61) - 1,
            (1 << 62) - 57,
        ];
        let edges = [0i64, 1, -1, i64::MAX, i64::MIN, i64::MIN + 1, i64::MAX - 1];
        for &p in &primes {
            let inv = 1.0 / p as f64;
            for &x in &edges {
                assert_eq!(rem_fast(x, p, inv), x.rem_euclid(p), "{x} mod {p}");
            }
            for m in [-2i64, -1, 1, 2, 1 << 20] {
                for d in -3..=3 {
                    let x = (p.wrapping_mul(m)).wrapping_add(d);
                    assert_eq!(rem_fast(x, p, inv), x.rem_euclid(p), "{x} mod {p}");
                }
            }
            for _ in 0..200_000 {
                let x = next() as i64;
                assert_eq!(rem_fast(x, p, inv), x.rem_euclid(p), "{x} mod {p}");
            }
        }
    }

    /// The AVX-512, scalar-float and `rem_euclid` reductions give the same row
    /// ids on windows of V4.1-like tables, negative rolling values included.
    #[test]
    fn hash_window_paths_agree() {
        let primes = derive_primes(2, 4, 8, 16_000_000);
        let offsets = derive_offsets(&primes, 24);
        let mut z = 7u64;
        let mut next = move || {
            z = z.wrapping_add(0x9e3779b97f4a7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            x ^ (x >> 29)
        };
        let multipliers: Vec<u64> = (0..8).map(|_| next() | 1).collect();
        let map = vec![0i32; 4];
        let input = HashTablesIn {
            layer_ids: &[1, 14],
            max_ngram: 4,
            n_heads: 8,
            token_map: &map,
            pad_id: 2,
            multipliers: &multipliers,
            primes: &primes,
            offsets: &offsets,
        };
        let fast = HashTables::new(&input).unwrap();
        let scalar = HashTables::new(&input).unwrap().with_simd(false);
        let mut reference = HashTables::new(&input).unwrap().with_simd(false);
        reference.inv_primes = None;
        assert!(fast.inv_primes.is_some() && !scalar.simd && !reference.simd);
        let (mut a, mut b, mut c) = (vec![0i64; 48], vec![0i64; 48], vec![0i64; 48]);
        for i in 0..20_000 {
            let w: Vec<i64> = (0..4)
                .map(|_| (next() % 200_000) as i64 - (i % 2) * 100)
                .collect();
            fast.hash_window(&w, &mut a);
            scalar.hash_window(&w, &mut b);
            reference.hash_window(&w, &mut c);
            assert_eq!(a, c, "{w:?}");
            assert_eq!(b, c, "{w:?}");
        }
    }

    #[test]
    fn primes_restart_per_ngram_and_never_repeat() {
        let p = derive_primes(2, 3, 2, 100);
        assert_eq!(p, vec![101, 103, 107, 109, 113, 127, 131, 137]);
        assert_eq!(
            derive_offsets(&p, 4),
            vec![0, 101, 204, 311, 0, 113, 240, 371]
        );
    }
}
