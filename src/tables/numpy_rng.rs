//! numpy's `np.random.default_rng(seed).integers(low, high, size, dtype=np.int64)`,
//! reproduced bit for bit: `SeedSequence` (entropy pool mixing and
//! `generate_state`), the `PCG64` bit generator (a 128-bit LCG with the XSL-RR
//! output function, seeded through `SeedSequence.generate_state(4, uint64)`),
//! and the bounded-integer method numpy's `Generator` uses for int64 (Lemire's
//! nearly-divisionless rejection, 64-bit draws for a range above 2^32, buffered
//! 32-bit draws below).
//!
//! The V4.1 hash multipliers come from this generator (SPEC section 3), so any
//! difference is a different model. `tests/tables_numpy.rs` compares it with
//! values numpy computed (captured by the golden generator).

/// SeedSequence constants (numpy `bit_generator.pyx`, after O'Neill's seed_seq).
const POOL_SIZE: usize = 4;
const INIT_A: u32 = 0x43b0_d7e5;
const MULT_A: u32 = 0x931e_8875;
const INIT_B: u32 = 0x8b51_f9dd;
const MULT_B: u32 = 0x58f3_8ded;
const MIX_MULT_L: u32 = 0xca01_f9dd;
const MIX_MULT_R: u32 = 0x4973_f715;
const XSHIFT: u32 = 16;

/// numpy's `SeedSequence(entropy)` for a non-negative integer seed (no spawn key,
/// the default pool of four 32-bit words).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedSequence {
    pool: [u32; POOL_SIZE],
}

impl SeedSequence {
    /// The sequence for integer entropy `seed` (numpy splits an integer into
    /// 32-bit words, lowest first; zero is one word).
    pub fn new(seed: u128) -> SeedSequence {
        let mut words = Vec::new();
        let mut n = seed;
        loop {
            words.push(n as u32);
            n >>= 32;
            if n == 0 {
                break;
            }
        }
        SeedSequence::from_words(&words)
    }

    /// The sequence for an entropy array of 32-bit words.
    pub fn from_words(entropy: &[u32]) -> SeedSequence {
        let mut hash_const = INIT_A;
        let mut hashmix = |value: u32| -> u32 {
            let mut v = value ^ hash_const;
            hash_const = hash_const.wrapping_mul(MULT_A);
            v = v.wrapping_mul(hash_const);
            v ^ (v >> XSHIFT)
        };
        let mix = |x: u32, y: u32| -> u32 {
            let r = MIX_MULT_L
                .wrapping_mul(x)
                .wrapping_sub(MIX_MULT_R.wrapping_mul(y));
            r ^ (r >> XSHIFT)
        };
        let mut pool = [0u32; POOL_SIZE];
        for (i, p) in pool.iter_mut().enumerate() {
            *p = hashmix(entropy.get(i).copied().unwrap_or(0));
        }
        for src in 0..POOL_SIZE {
            for dst in 0..POOL_SIZE {
                if src != dst {
                    let h = hashmix(pool[src]);
                    pool[dst] = mix(pool[dst], h);
                }
            }
        }
        for &e in entropy.iter().skip(POOL_SIZE) {
            for p in pool.iter_mut() {
                let h = hashmix(e);
                *p = mix(*p, h);
            }
        }
        SeedSequence { pool }
    }

    /// `generate_state(n_words, np.uint32)`.
    pub fn generate_state_u32(&self, n_words: usize) -> Vec<u32> {
        let mut hash_const = INIT_B;
        (0..n_words)
            .map(|i| {
                let mut v = self.pool[i % POOL_SIZE] ^ hash_const;
                hash_const = hash_const.wrapping_mul(MULT_B);
                v = v.wrapping_mul(hash_const);
                v ^ (v >> XSHIFT)
            })
            .collect()
    }

    /// `generate_state(n_words, np.uint64)`: twice as many 32-bit words, paired
    /// little-endian (low word first), as numpy's view does on a little-endian host.
    pub fn generate_state_u64(&self, n_words: usize) -> Vec<u64> {
        self.generate_state_u32(2 * n_words)
            .chunks_exact(2)
            .map(|w| w[0] as u64 | (w[1] as u64) << 32)
            .collect()
    }
}

/// PCG's default 128-bit LCG multiplier.
const PCG_MULT: u128 = (2_549_297_995_355_413_924u128 << 64) | 4_865_540_595_714_422_341u128;

/// numpy's `PCG64` (PCG XSL-RR 128/64) with its buffered 32-bit output.
#[derive(Clone, Debug)]
pub struct Pcg64 {
    state: u128,
    inc: u128,
    /// The high half of the last 64-bit draw, owed to the next 32-bit draw.
    pending_u32: Option<u32>,
}

impl Pcg64 {
    /// Seeded as numpy does: `generate_state(4, uint64)` gives `[s_hi, s_lo,
    /// i_hi, i_lo]`; `inc = (i << 1) | 1`; step; `state += s`; step.
    pub fn from_seed_sequence(ss: &SeedSequence) -> Pcg64 {
        let v = ss.generate_state_u64(4);
        let s = (v[0] as u128) << 64 | v[1] as u128;
        let i = (v[2] as u128) << 64 | v[3] as u128;
        let mut g = Pcg64 {
            state: 0,
            inc: (i << 1) | 1,
            pending_u32: None,
        };
        g.step();
        g.state = g.state.wrapping_add(s);
        g.step();
        g
    }

    #[inline]
    fn step(&mut self) {
        self.state = self.state.wrapping_mul(PCG_MULT).wrapping_add(self.inc);
    }

    /// The next 64-bit output: step, then XSL-RR of the new state.
    pub fn next_u64(&mut self) -> u64 {
        self.step();
        let s = self.state;
        let xored = ((s >> 64) as u64) ^ (s as u64);
        xored.rotate_right((s >> 122) as u32)
    }

    /// The next 32-bit output: the low half of a fresh 64-bit draw, then its
    /// high half on the following call.
    pub fn next_u32(&mut self) -> u32 {
        if let Some(v) = self.pending_u32.take() {
            return v;
        }
        let x = self.next_u64();
        self.pending_u32 = Some((x >> 32) as u32);
        x as u32
    }
}

/// numpy's `Generator` over `PCG64`, as far as `integers` with `dtype=int64` goes.
#[derive(Clone, Debug)]
pub struct Generator {
    bits: Pcg64,
}

/// `np.random.default_rng(seed)` for a non-negative integer seed.
pub fn default_rng(seed: u128) -> Generator {
    Generator {
        bits: Pcg64::from_seed_sequence(&SeedSequence::new(seed)),
    }
}

impl Generator {
    /// `integers(low, high, size=n, dtype=np.int64)` (`high` exclusive), or
    /// `None` when `low >= high` (numpy raises `ValueError`).
    pub fn integers_i64(&mut self, low: i64, high: i64, n: usize) -> Option<Vec<i64>> {
        if low >= high {
            return None;
        }
        // numpy: rng = (high - 1) - low as u64, off = low as u64; values off + draw, wrapping.
        let rng = (high - 1).wrapping_sub(low) as u64;
        let off = low as u64;
        let g = &mut self.bits;
        let out = (0..n).map(|_| {
            let draw = if rng == 0 {
                0
            } else if rng < 0xFFFF_FFFF {
                lemire_u32(g, rng as u32) as u64
            } else if rng == 0xFFFF_FFFF {
                g.next_u32() as u64
            } else if rng == u64::MAX {
                g.next_u64()
            } else {
                lemire_u64(g, rng)
            };
            off.wrapping_add(draw) as i64
        });
        Some(out.collect())
    }
}

/// Lemire's method on 64-bit draws: a uniform value in `[0, rng]`.
fn lemire_u64(g: &mut Pcg64, rng: u64) -> u64 {
    let excl = rng + 1;
    let mut m = g.next_u64() as u128 * excl as u128;
    let mut leftover = m as u64;
    if leftover < excl {
        let threshold = (u64::MAX - rng) % excl;
        while leftover < threshold {
            m = g.next_u64() as u128 * excl as u128;
            leftover = m as u64;
        }
    }
    (m >> 64) as u64
}

/// Lemire's method on buffered 32-bit draws: a uniform value in `[0, rng]`.
fn lemire_u32(g: &mut Pcg64, rng: u32) -> u32 {
    let excl = rng + 1;
    let mut m = g.next_u32() as u64 * excl as u64;
    let mut leftover = m as u32;
    if leftover < excl {
        let threshold = (u32::MAX - rng) % excl;
        while leftover < threshold {
            m = g.next_u32() as u64 * excl as u64;
            leftover = m as u32;
        }
    }
    (m >> 32) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_words_split_lowest_first() {
        assert_eq!(SeedSequence::new(0), SeedSequence::from_words(&[0]));
        assert_eq!(
            SeedSequence::new((7u128 << 32) | 5),
            SeedSequence::from_words(&[5, 7])
        );
    }

    #[test]
    fn empty_range_is_refused() {
        assert!(default_rng(1).integers_i64(5, 5, 1).is_none());
        assert_eq!(default_rng(1).integers_i64(5, 6, 3), Some(vec![5, 5, 5]));
    }
}
