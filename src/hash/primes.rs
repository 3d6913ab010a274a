//! The hash's primes and offsets (SPEC section 3), derived once here for every
//! loader (config + tokenizer, GGUF files without offsets, tests).

use crate::error::{bail, Result};

/// At most this many primes are derived for one model (`n_layers * C`):
/// 2^22 is 64 layers of the largest geometry [`crate::HashTables`] accepts
/// (`N = 64`, `H = 1024`), derived in well under a second.
pub(crate) const MAX_PRIMES: usize = 1 << 22;

/// The primes of SPEC section 3 with one table size per n-gram size
/// (`sizes[k-1]` for look-back `k`): for each layer, each n-gram size, each
/// head, the next prime above the current value (restarting at `size - 1` for
/// every n-gram size) that no earlier (layer, n-gram, head) took. Returns
/// `[n_layers * sizes.len() * n_heads]`, column `(k-1)*H + h` within a layer.
/// Each layer's rows (the sum of its primes) must stay an i64.
///
/// Near-linear: a run restarting at `size - 1` resumes where the last run
/// from the same start stopped (every prime between was taken, by that run or
/// skipped as taken), so no start rescans what it already passed, and the
/// candidates come from a segmented sieve ([`PrimeCursor`]).
pub fn derive_primes(n_layers: usize, sizes: &[u64], n_heads: usize) -> Result<Vec<u64>> {
    let total = n_layers
        .checked_mul(sizes.len())
        .and_then(|c| c.checked_mul(n_heads))
        .filter(|&t| t <= MAX_PRIMES);
    let Some(total) = total else {
        bail!(
            ErrInvalidConfig,
            "{n_layers} layers x {} n-gram sizes x {n_heads} heads is more than {MAX_PRIMES} hash columns",
            sizes.len()
        );
    };
    // Refuse from the geometry alone what cannot fit, before deriving a
    // prime: the primes for table size `s` are distinct and at least `s`, so
    // a layer has at least `H * sum(sizes)` rows (each layer, the same sizes).
    let floor = sizes
        .iter()
        .fold(0u128, |a, &s| a + s as u128 * n_heads as u128);
    if n_layers > 0 && floor > i64::MAX as u128 {
        bail!(
            ErrInvalidConfig,
            "the table sizes give a layer more than 2^63 rows: {n_heads} heads x table sizes summing to {} \
             is at least {floor} rows",
            sizes.iter().fold(0u128, |a, &s| a + s as u128)
        );
    }
    let mut out = Vec::new();
    if out.try_reserve_exact(total).is_err() {
        bail!(ErrCapacity, "out of memory for {total} primes");
    }
    let mut taken = std::collections::HashSet::new();
    if taken.try_reserve(total).is_err() {
        bail!(ErrCapacity, "out of memory for {total} primes");
    }
    // One cursor per distinct start, positioned past the last prime its
    // runs have passed.
    let mut cursors: Vec<(u64, PrimeCursor)> = Vec::new();
    for _ in 0..n_layers {
        for &size in sizes {
            let start = size.saturating_sub(1);
            let ci = match cursors.iter().position(|(s, _)| *s == start) {
                Some(ci) => ci,
                None => {
                    cursors.push((start, PrimeCursor::above(start)));
                    cursors.len() - 1
                }
            };
            let cur = &mut cursors[ci].1;
            for _ in 0..n_heads {
                let c = loop {
                    let Some(c) = cur.next() else {
                        bail!(
                            ErrInvalidConfig,
                            "no unused prime above {start} fits in 64 bits"
                        );
                    };
                    if !taken.contains(&c) {
                        break c;
                    }
                };
                taken.insert(c);
                out.push(c);
            }
        }
    }
    let cols = sizes.len() * n_heads;
    for l in out.chunks(cols.max(1)) {
        if l.iter()
            .try_fold(0u64, |a, &p| a.checked_add(p))
            .is_none_or(|s| s > i64::MAX as u64)
        {
            bail!(
                ErrInvalidConfig,
                "the table sizes give a layer more than 2^63 rows"
            );
        }
    }
    Ok(out)
}

/// Numbers per sieve segment (odd and even; only odd ones are sieved).
const SEGMENT: u64 = 1 << 16;

/// The primes above a start, in increasing order: a segmented sieve of
/// Eratosthenes by the primes below 2^16 (exact below 2^32), with
/// Miller-Rabin ([`is_prime`]) deciding the survivors from 2^32 on.
pub struct PrimeCursor {
    /// The next number to consider.
    next: u64,
    /// The current segment `[lo, lo + SEGMENT)`: `composite[i]` for `lo + i`.
    lo: u64,
    composite: Vec<bool>,
    /// Whether the current segment is sieved (false before the first).
    ready: bool,
    exhausted: bool,
}

#[cfg(test)]
thread_local! {
    /// Prime cursors started on this thread (tests check that a refused
    /// geometry derived nothing).
    static CURSORS_STARTED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The primes below 2^16.
fn small_primes() -> &'static [u32] {
    static P: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        let n = 1usize << 16;
        let mut comp = vec![false; n];
        let mut out = Vec::new();
        for i in 2..n {
            if !comp[i] {
                out.push(i as u32);
                for j in (i * i..n).step_by(i) {
                    comp[j] = true;
                }
            }
        }
        out
    })
}

impl PrimeCursor {
    /// The primes greater than `x`.
    pub fn above(x: u64) -> PrimeCursor {
        #[cfg(test)]
        CURSORS_STARTED.with(|c| c.set(c.get() + 1));
        PrimeCursor {
            next: x.saturating_add(1),
            lo: 0,
            composite: vec![false; SEGMENT as usize],
            ready: false,
            exhausted: x == u64::MAX,
        }
    }

    fn sieve(&mut self, lo: u64) {
        self.lo = lo;
        self.ready = true;
        self.composite.fill(false);
        let hi = lo.saturating_add(SEGMENT);
        for &p in small_primes() {
            let p = p as u64;
            if p.saturating_mul(p) >= hi {
                break;
            }
            // The first multiple of p in the segment, at least p*p.
            let first = (lo.div_ceil(p) * p).max(p * p);
            let mut m = first;
            while m < hi {
                self.composite[(m - lo) as usize] = true;
                let Some(n) = m.checked_add(p) else { break };
                m = n;
            }
        }
    }
}

impl Iterator for PrimeCursor {
    type Item = u64;

    /// The next prime, or `None` past the largest u64 prime.
    fn next(&mut self) -> Option<u64> {
        while !self.exhausted {
            let x = self.next;
            if !self.ready || x < self.lo || x - self.lo >= SEGMENT {
                self.sieve(x - x % SEGMENT);
            }
            let end = self.lo.saturating_add(SEGMENT);
            let mut y = x;
            while y < end {
                if y >= 2 && !self.composite[(y - self.lo) as usize] && (y < 1 << 32 || is_prime(y))
                {
                    self.next = y.saturating_add(1);
                    if y == u64::MAX - 58 {
                        // 2^64 - 59, the largest u64 prime.
                        self.exhausted = true;
                    }
                    return Some(y);
                }
                y += 1;
            }
            if end == u64::MAX || self.lo.checked_add(SEGMENT).is_none() {
                self.exhausted = true;
            } else {
                self.next = end;
            }
        }
        None
    }
}

/// [`derive_primes`] with one table size `vocab_size` for each of the `N-1`
/// n-gram sizes (the released model's rule).
pub fn derive_primes_uniform(
    n_layers: usize,
    max_ngram: usize,
    n_heads: usize,
    vocab_size: u64,
) -> Result<Vec<u64>> {
    derive_primes(
        n_layers,
        &vec![vocab_size; max_ngram.saturating_sub(1)],
        n_heads,
    )
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
        if n.is_multiple_of(p) {
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

    /// The sieve cursor gives exactly the primes Miller-Rabin finds, from
    /// small starts, across segment edges, around 2^32 and at the top of u64.
    #[test]
    fn prime_cursor_equals_miller_rabin() {
        for start in [
            0u64,
            1,
            2,
            65_530,
            16_000_000,
            (1 << 32) - 300,
            u64::MAX - 2000,
        ] {
            let mut cur = PrimeCursor::above(start);
            let mut x = start;
            for _ in 0..40 {
                let want = loop {
                    if x == u64::MAX {
                        break None;
                    }
                    x += 1;
                    if is_prime(x) {
                        break Some(x);
                    }
                };
                assert_eq!(cur.next(), want, "after {start}");
                if want.is_none() {
                    break;
                }
            }
        }
    }

    /// The old rescanning derivation, kept as the oracle.
    fn derive_slow(n_layers: usize, sizes: &[u64], n_heads: usize) -> Vec<u64> {
        let mut taken = std::collections::HashSet::new();
        let mut out = Vec::new();
        for _ in 0..n_layers {
            for &size in sizes {
                let mut cur = size.saturating_sub(1);
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

    #[test]
    fn derivation_equals_the_rescanning_one() {
        for (nl, sizes, h) in [
            (2usize, vec![100u64, 100, 100], 8usize),
            (3, vec![1000, 50, 1000, 7], 5),
            (2, vec![16_000_000; 3], 8),
            (4, vec![5_000_000_000, 4_999_999_000], 16),
            (1, vec![2, 3, 4], 3),
        ] {
            assert_eq!(
                derive_primes(nl, &sizes, h).unwrap(),
                derive_slow(nl, &sizes, h),
                "{nl} layers, sizes {sizes:?}, {h} heads"
            );
        }
    }

    /// The largest geometry the tables accept (N = 64, H = 1024) derives in
    /// well under a second per layer (the rescanning derivation took 15 s for
    /// one layer, 70 s for two); more columns than MAX_PRIMES are refused.
    #[test]
    fn a_large_geometry_derives_fast() {
        let t = std::time::Instant::now();
        let p = derive_primes_uniform(2, 64, 1024, 16_000_000).unwrap();
        let took = t.elapsed();
        assert_eq!(p.len(), 2 * 63 * 1024);
        let mut sorted = p.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), p.len(), "a prime taken twice");
        // Debug builds included; the old derivation took minutes here.
        assert!(took.as_secs_f64() < 2.0, "took {took:?}");
        let err = derive_primes_uniform(MAX_PRIMES / 63 + 1, 64, 64, 100).unwrap_err();
        assert_eq!(err.status, crate::EngramStatus::ErrInvalidConfig);
    }

    /// A geometry whose layer cannot have fewer than 2^63 rows (table size
    /// 2^62, N = 64, H = 1024: 64,512 primes above 2^62 per layer, about a
    /// second each layer) is refused before a single prime is searched: no
    /// prime cursor starts. One that fits only just is still derived.
    #[test]
    fn an_unfittable_geometry_is_refused_before_any_prime() {
        let started = || CURSORS_STARTED.with(|c| c.get());
        let before = started();
        // Two sizes whose sum alone passes 2^63 with one head (checked
        // first: before the fix this one derived two primes, then refused).
        let err = derive_primes(1, &[1 << 62, 1 << 62], 1).unwrap_err();
        assert_eq!(err.status, crate::EngramStatus::ErrInvalidConfig);
        assert_eq!(
            started(),
            before,
            "a prime cursor started for a refused geometry"
        );
        let err = derive_primes_uniform(64, 64, 1024, 1 << 62).unwrap_err();
        assert_eq!(err.status, crate::EngramStatus::ErrInvalidConfig);
        assert!(err.message.contains("2^63 rows"), "{}", err.message);
        assert_eq!(
            started(),
            before,
            "a prime cursor started for a refused geometry"
        );
        // The floor is only a floor: 2 heads of size 2^61 - 1 still derive
        // (primes just above 2^61, the sum below 2^63).
        let p = derive_primes(1, &[(1 << 61) - 1], 2).unwrap();
        assert!(p.iter().all(|&x| x >= (1 << 61) - 1));
        assert!(started() > before);
    }

    #[test]
    fn primes_restart_per_ngram_and_never_repeat() {
        let p = derive_primes_uniform(2, 3, 2, 100).unwrap();
        assert_eq!(p, vec![101, 103, 107, 109, 113, 127, 131, 137]);
        assert_eq!(
            derive_offsets(&p, 4),
            vec![0, 101, 204, 311, 0, 113, 240, 371]
        );
    }
}
