//! The validated hash tables of all engram layers and the hash of look-back
//! windows (SPEC section 1, step 3).

#[cfg(target_arch = "x86_64")]
use super::reduce::{narrow, simd, wide};
use super::reduce::{rem_fast, slide, Run, NARROW_PRIMES};
use super::{ROW_ID_DEAD, TOKEN_DEAD};
use crate::error::{bail, Result};
use crate::fallible::{try_map, try_vec, vec_bytes};

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
    /// Which form of the reduction runs.
    path: HashPath,
}

/// How the hash's modulo runs (all give the same row ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashPath {
    /// `rem_euclid` (a division): primes outside `[2^14, 2^62)`.
    Division,
    /// [`rem_fast`], one column at a time.
    Scalar,
    /// AVX-512: 8 heads at a time, the correction in 64-bit integers.
    Avx512,
    /// AVX2: 4 heads at a time, the correction in 32-bit integers (every
    /// prime below 2^31, as the released model's are).
    Avx2Narrow,
    /// AVX-512: 8 heads at a time, the correction of `Avx2Narrow`.
    Avx512Narrow,
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

/// At least one layer, and no layer id twice.
fn check_layer_ids(layer_ids: &[u32]) -> Result<()> {
    if layer_ids.is_empty() {
        bail!(ErrInvalidConfig, "no engram layers (n_layers = 0)");
    }
    // Sorted, so that a caller's long list costs n log n, not n^2.
    let mut sorted = try_map(layer_ids, |&a| a, "layer_ids")?;
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        bail!(
            ErrInvalidConfig,
            "engram layer id {} appears twice in layer_ids",
            w[0]
        );
    }
    Ok(())
}

/// N in 2..=64 and H in 1..=1024.
fn check_geometry(t: &HashTablesIn<'_>) -> Result<()> {
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
    Ok(())
}

/// A token map of compressed ids or -1, and a compressed pad.
fn check_token_map(t: &HashTablesIn<'_>) -> Result<()> {
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
    Ok(())
}

/// The constants hold one entry per layer and look-back (multipliers) or
/// column (primes, offsets).
fn check_lengths(t: &HashTablesIn<'_>) -> Result<()> {
    let nl = t.layer_ids.len();
    let cols = (t.max_ngram - 1) * t.n_heads;
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
    check_len("offsets", t.offsets.len(), nl * cols)
}

/// SPEC section 1: the multipliers are odd (`draw * 2 + 1`); an even one
/// (zero included) discards the high bits of the n-gram mix.
fn check_multipliers(t: &HashTablesIn<'_>) -> Result<()> {
    if let Some(i) = t.multipliers.iter().position(|&m| m % 2 == 0) {
        bail!(
            ErrInvalidConfig,
            "multipliers[{i}] (layer {}, look-back {}) = {} is even; the multipliers are odd",
            t.layer_ids[i / t.max_ngram],
            i % t.max_ngram,
            t.multipliers[i] as i64
        );
    }
    Ok(())
}

/// Rows each layer's table needs (the largest `offset + prime` of its
/// columns); every prime a positive i64 and no end past i64.
fn rows_needed(t: &HashTablesIn<'_>) -> Result<Vec<u64>> {
    let cols = (t.max_ngram - 1) * t.n_heads;
    let mut rows_needed = try_vec(t.layer_ids.len(), 0u64, "layer_ids")?;
    for (l, need_out) in rows_needed.iter_mut().enumerate() {
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
        *need_out = need;
    }
    Ok(rows_needed)
}

impl HashTables {
    pub fn new(t: &HashTablesIn<'_>) -> Result<HashTables> {
        check_layer_ids(t.layer_ids)?;
        check_geometry(t)?;
        check_token_map(t)?;
        check_lengths(t)?;
        check_multipliers(t)?;
        let rows_needed = rows_needed(t)?;
        // Every copy is as long as a caller or a file said: allocated fallibly.
        let inv_primes = if t.primes.iter().all(|&p| (1 << 14..1 << 62).contains(&p)) {
            Some(try_map(t.primes, |&p| 1.0 / p as f64, "primes")?)
        } else {
            None
        };
        Ok(HashTables {
            layer_ids: try_map(t.layer_ids, |&a| a, "layer_ids")?,
            max_ngram: t.max_ngram,
            n_heads: t.n_heads,
            token_map: try_map(t.token_map, |&m| m, "token_map")?,
            pad_id: t.pad_id,
            // The multipliers are i64 values (GGUF stores them as u64 bits).
            multipliers: try_map(t.multipliers, |&m| m as i64, "multipliers")?,
            primes: try_map(t.primes, |&p| p as i64, "primes")?,
            offsets: try_map(t.offsets, |&o| o as i64, "offsets")?,
            rows_needed,
            path: HashPath::Division,
            inv_primes,
        }
        .with_best_path())
    }

    /// Bytes held by the copied tables (for memory reporting).
    pub fn bytes(&self) -> usize {
        vec_bytes(&self.layer_ids)
            + vec_bytes(&self.token_map)
            + vec_bytes(&self.multipliers)
            + vec_bytes(&self.primes)
            + vec_bytes(&self.offsets)
            + vec_bytes(&self.rows_needed)
            + self.inv_primes.as_ref().map_or(0, vec_bytes)
    }

    /// The fastest path this CPU and these tables allow: the 32-bit
    /// correction in AVX-512, else in AVX2, else the 64-bit one in AVX-512,
    /// else scalar, else the division.
    pub fn with_best_path(self) -> HashTables {
        let p = [
            HashPath::Avx512Narrow,
            HashPath::Avx2Narrow,
            HashPath::Avx512,
            HashPath::Scalar,
        ]
        .into_iter()
        .find(|&p| self.allows(p))
        .unwrap_or(HashPath::Division);
        self.with_path(p).expect("an allowed path")
    }

    /// Whether this CPU and these tables allow `path`.
    pub fn allows(&self, path: HashPath) -> bool {
        let inv = self.inv_primes.is_some();
        match path {
            HashPath::Division => true,
            HashPath::Scalar => inv,
            #[cfg(target_arch = "x86_64")]
            HashPath::Avx512 => inv && self.n_heads.is_multiple_of(8) && simd::available(),
            #[cfg(target_arch = "x86_64")]
            HashPath::Avx2Narrow => {
                inv && self.n_heads.is_multiple_of(4) && self.narrow_primes() && narrow::available()
            }
            #[cfg(target_arch = "x86_64")]
            HashPath::Avx512Narrow => {
                inv && self.n_heads.is_multiple_of(8) && self.narrow_primes() && wide::available()
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Every prime lies in [`NARROW_PRIMES`] (the 32-bit corrections).
    fn narrow_primes(&self) -> bool {
        self.primes
            .iter()
            .all(|&p| NARROW_PRIMES.contains(&(p as u64)))
    }

    /// Use `path` (tests and benchmarks compare them); `None` if this CPU or
    /// these tables do not allow it.
    pub fn with_path(mut self, path: HashPath) -> Option<HashTables> {
        self.allows(path).then(|| {
            self.path = path;
            self
        })
    }

    /// The path in use.
    pub fn path(&self) -> HashPath {
        self.path
    }

    /// Hash columns per token per layer, `C = (N-1)*H`.
    pub fn cols(&self) -> usize {
        (self.max_ngram - 1) * self.n_heads
    }

    pub fn n_layers(&self) -> usize {
        self.layer_ids.len()
    }

    /// The compressed id of raw token `tok` (`-1` for a dead one), or an error.
    pub(crate) fn compress(&self, i: usize, tok: i32) -> Result<i32> {
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

    /// Every run that is not dead reads inside `xs`, and `out` holds a row
    /// of `n_layers * C` ids for each of the runs' tokens; panics otherwise
    /// (what [`Self::hash_runs`]'s unsafe kernels rely on).
    fn check_runs(&self, xs: &[i64], runs: &[Run], out: &[i64]) {
        let nn = self.max_ngram;
        let row = self.n_layers() * self.cols();
        let mut tokens = 0usize;
        for r in runs {
            assert!(
                r.x == Run::DEAD
                    || r.x
                        .checked_add(r.len + nn - 1)
                        .is_some_and(|e| e <= xs.len()),
                "run {r:?} reads past the {} look-back entries",
                xs.len()
            );
            tokens += r.len;
        }
        assert_eq!(
            out.len(),
            tokens * row,
            "output rows against the runs' tokens"
        );
    }

    /// Row ids of every layer for the tokens of `runs` (see [`Run`]), in
    /// order, into `out` (`[sum(len), n_layers * C]`): a dead run's rows are
    /// all [`ROW_ID_DEAD`]. Panics if `out` or `xs` is not as long as the
    /// runs say.
    pub fn hash_runs(&self, xs: &[i64], runs: &[Run], out: &mut [i64]) {
        self.check_runs(xs, runs, out);
        let nn = self.max_ngram;
        let (h, m, pr, of) = (
            self.n_heads,
            &self.multipliers[..],
            &self.primes[..],
            &self.offsets[..],
        );
        match (&self.inv_primes, self.path) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `path` is Avx512Narrow only when `allows` found avx512f
            // and avx512dq, `n_heads` a multiple of 8 and every prime in
            // NARROW_PRIMES; `check_runs` checked the runs and `out`; the
            // tables hold L*N multipliers and L*C columns (`new`).
            (Some(inv), HashPath::Avx512Narrow) => unsafe {
                wide::runs(xs, runs, nn, h, m, pr, inv, of, ROW_ID_DEAD, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `path` is Avx2Narrow only when `allows` found avx2 and
            // fma, `n_heads` a multiple of 4 and every prime in
            // NARROW_PRIMES (the 32-bit correction is exact for them);
            // `check_runs` checked the runs and `out`; the tables hold L*N
            // multipliers and L*C columns (`new`).
            (Some(inv), HashPath::Avx2Narrow) => unsafe {
                narrow::runs(xs, runs, nn, h, m, pr, inv, of, ROW_ID_DEAD, out)
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `path` is Avx512 only when `allows` found avx512f and
            // avx512dq and `n_heads` a multiple of 8 (the 64-bit correction
            // takes any prime in [2^14, 2^62), which `inv` being `Some`
            // guarantees); `check_runs` checked the runs and `out`; the
            // tables hold L*N multipliers and L*C columns (`new`).
            (Some(inv), HashPath::Avx512) => unsafe {
                simd::runs(xs, runs, nn, h, m, pr, inv, of, ROW_ID_DEAD, out)
            },
            // SAFETY: `slide` needs no CPU feature; `check_runs` checked the
            // runs and `out`, and the tables hold L*N multipliers (`new`); the
            // closure writes columns `c..c + H` of the row, inside its `L*C`,
            // and `pr`, `inv` and `of` hold L*C entries, so `j` stays in them.
            (Some(inv), HashPath::Scalar) => unsafe {
                slide::<0, 0, 0>(xs, runs, nn, h, m, ROW_ID_DEAD, out, |x, c, row, h| {
                    for j in c..c + h {
                        *row.add(j) = rem_fast(x, pr[j], inv[j]) + of[j];
                    }
                })
            },
            // SAFETY: `slide` needs no CPU feature; `check_runs` checked the
            // runs and `out`, and the tables hold L*N multipliers (`new`); the
            // closure writes columns `c..c + H` of the row, inside its `L*C`,
            // and `pr` and `of` hold L*C entries, so `j` stays in them.
            _ => unsafe {
                slide::<0, 0, 0>(xs, runs, nn, h, m, ROW_ID_DEAD, out, |x, c, row, h| {
                    for j in c..c + h {
                        *row.add(j) = x.rem_euclid(pr[j]) + of[j];
                    }
                })
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{derive_offsets, derive_primes_uniform};

    /// SPEC section 1, step 3 for one window, written out with `rem_euclid`.
    fn reference(t: &HashTables, w: &[i64]) -> Vec<i64> {
        let (nn, h, cols) = (t.max_ngram, t.n_heads, t.cols());
        let mut o = vec![0i64; t.n_layers() * cols];
        for l in 0..t.n_layers() {
            let m = &t.multipliers[l * nn..(l + 1) * nn];
            let mut rolling = w[0].wrapping_mul(m[0]);
            for k in 1..nn {
                rolling ^= w[k].wrapping_mul(m[k]);
                for hh in 0..h {
                    let c = l * cols + (k - 1) * h + hh;
                    o[c] = rolling.rem_euclid(t.primes[c]) + t.offsets[c];
                }
            }
        }
        o
    }

    /// Every path this CPU runs (AVX-512 and AVX2 32-bit, AVX-512 64-bit,
    /// scalar float, division) gives the `rem_euclid` row ids of SPEC
    /// section 1, on random runs (dead ones among them, windows overlapping
    /// and sliding) over entries with negative values (rolling values of
    /// either sign), at the edge primes of each path (just above 2^14, just
    /// below 2^31, and primes above 2^31 that only the 64-bit paths take),
    /// with 4, 8 and 16 heads and n-grams of 2 to 5 tokens.
    #[test]
    fn hash_run_paths_agree() {
        let mut z = 7u64;
        let mut next = move || {
            z = z.wrapping_add(0x9e3779b97f4a7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
            x ^ (x >> 29)
        };
        let all = [
            HashPath::Division,
            HashPath::Scalar,
            HashPath::Avx512,
            HashPath::Avx2Narrow,
            HashPath::Avx512Narrow,
        ];
        for (size, heads, nn) in [
            (16_000_000u64, 8usize, 4usize),
            (16_385, 4, 4),
            ((1 << 31) - 3000, 8, 4),
            (1 << 40, 8, 4),
            (16_000_000, 16, 3),
            (1 << 20, 8, 2),
            (1 << 20, 4, 5),
        ] {
            let cols = (nn - 1) * heads;
            let primes = derive_primes_uniform(2, nn, heads, size).unwrap();
            let offsets = derive_offsets(&primes, cols);
            let multipliers: Vec<u64> = (0..2 * nn).map(|_| next() | 1).collect();
            let map = vec![0i32; 4];
            let input = HashTablesIn {
                layer_ids: &[1, 14],
                max_ngram: nn,
                n_heads: heads,
                token_map: &map,
                pad_id: 2,
                multipliers: &multipliers,
                primes: &primes,
                offsets: &offsets,
            };
            let paths: Vec<HashTables> = all
                .into_iter()
                .filter_map(|p| HashTables::new(&input).unwrap().with_path(p))
                .collect();
            let narrow_ok = primes.iter().all(|&p| p < 1 << 31);
            assert_eq!(
                narrow_ok,
                size < 1 << 31,
                "the edge case is not at the edge"
            );
            let t0 = &paths[0];
            assert_eq!(t0.path(), HashPath::Division);
            #[cfg(target_arch = "x86_64")]
            {
                assert_eq!(
                    t0.allows(HashPath::Avx2Narrow),
                    narrow_ok && narrow::available(),
                    "size {size}"
                );
                assert_eq!(
                    t0.allows(HashPath::Avx512Narrow),
                    narrow_ok && heads % 8 == 0 && wide::available(),
                    "size {size}"
                );
            }
            eprintln!(
                "size {size}, {heads} heads, N {nn}: paths {:?}",
                paths.iter().map(|p| p.path()).collect::<Vec<_>>()
            );
            let xs: Vec<i64> = (0..3000)
                .map(|i| (next() % 200_000) as i64 - (i % 2) as i64 * 100)
                .collect();
            let mut runs = Vec::new();
            let mut want = Vec::new();
            for _ in 0..400 {
                let len = 1 + (next() % 9) as usize;
                if next() % 7 == 0 {
                    runs.push(Run { x: Run::DEAD, len });
                    want.extend(std::iter::repeat_n(ROW_ID_DEAD, len * 2 * cols));
                    continue;
                }
                let x = (next() % (xs.len() - len - nn + 2) as u64) as usize;
                runs.push(Run { x, len });
                for j in 0..len {
                    let w: Vec<i64> = (0..nn).map(|k| xs[x + j + nn - 1 - k]).collect();
                    want.extend(reference(t0, &w));
                }
            }
            for t in &paths {
                let mut got = vec![0i64; want.len()];
                t.hash_runs(&xs, &runs, &mut got);
                assert_eq!(got, want, "{:?}, size {size}", t.path());
            }
        }
    }

    /// Runs that read past the entries, or rows that do not match the runs'
    /// tokens, are refused before anything is read or written.
    #[test]
    #[should_panic(expected = "reads past")]
    fn hash_runs_checks_the_runs() {
        let primes = derive_primes_uniform(1, 3, 4, 20_000).unwrap();
        let offsets = derive_offsets(&primes, 8);
        let t = HashTables::new(&HashTablesIn {
            layer_ids: &[3],
            max_ngram: 3,
            n_heads: 4,
            token_map: &[0],
            pad_id: 0,
            multipliers: &[3, 5, 7],
            primes: &primes,
            offsets: &offsets,
        })
        .unwrap();
        let mut out = vec![0i64; 2 * 8];
        t.hash_runs(&[1, 2, 3], &[Run { x: 0, len: 2 }], &mut out);
    }
}
