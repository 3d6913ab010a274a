//! The hash's primes and offsets (SPEC section 3), derived once here for every
//! loader (config + tokenizer, GGUF files without offsets, tests).

use crate::error::{bail, Result};

/// The primes of SPEC section 3 with one table size per n-gram size
/// (`sizes[k-1]` for look-back `k`): for each layer, each n-gram size, each
/// head, the next prime above the current value (restarting at `size - 1` for
/// every n-gram size) that no earlier (layer, n-gram, head) took. Returns
/// `[n_layers * sizes.len() * n_heads]`, column `(k-1)*H + h` within a layer.
/// Each layer's rows (the sum of its primes) must stay an i64.
pub fn derive_primes(n_layers: usize, sizes: &[u64], n_heads: usize) -> Result<Vec<u64>> {
    let mut taken = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(n_layers * sizes.len() * n_heads);
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
