//! Hash tables from the model's own files (SPEC section 3): the token map from
//! `tokenizer.json`, the multipliers from numpy's generator, the primes and
//! offsets from the config's table sizes. The result feeds `engram_create`
//! (or a GGUF file that lacks the constants).

pub mod config;
pub mod numpy_rng;
pub mod tokenizer;

use crate::error::{bail, Result};
use crate::hash::{derive_primes, HashTablesIn};
pub use config::EngramConfig;
pub use tokenizer::{TokenMap, TokenMapStats};

/// The multiplier seed's per-layer step (the reference's `PRIME_1`).
const LAYER_SEED_STEP: u64 = 10007;

/// Everything the hash needs, derived from a config and a tokenizer, in the
/// GGUF flat layout that `engram_config` takes.
#[derive(Clone, Debug)]
pub struct EngramTables {
    pub config: EngramConfig,
    /// Raw token id -> compressed id, over the ids below the tokenizer's
    /// length (an id without a token has the compressed id of the empty key).
    pub token_map: Vec<i32>,
    /// Distinct compressed ids.
    pub compressed_vocab: usize,
    pub stats: TokenMapStats,
    /// `token_map[pad_token_id]`.
    pub pad_id: i64,
    /// `[layers * N]`, odd, i64 values as u64 bits.
    pub multipliers: Vec<u64>,
    /// `[layers * C]`, column `(k-1)*H + h`.
    pub primes: Vec<u64>,
    /// `[layers * C]`, per-layer exclusive prefix sums of `primes`.
    pub offsets: Vec<u64>,
    /// Rows each layer's table has: the sum of its primes.
    pub rows: Vec<u64>,
}

impl EngramTables {
    /// Derive from a parsed config and a token map.
    pub fn derive(config: EngramConfig, tm: TokenMap) -> Result<EngramTables> {
        let k = tm.compressed;
        if k == 0 {
            bail!(ErrInvalidConfig, "the token map has no compressed ids");
        }
        if let Some(want) = config.compressed_vocab {
            if want != k as u64 {
                bail!(
                    ErrInvalidConfig,
                    "the tokenizer compresses to {k} ids but config.json says engram_compressed_vocab_size = {want}: \
                     a different tokenizer than the model's?"
                );
            }
        }
        let pad = config.pad_token_id as usize;
        let pad_id = match tm.map.get(pad) {
            Some(&p) if p >= 0 => p as i64,
            Some(_) => bail!(
                ErrInvalidConfig,
                "pad token id {pad} has no token in the tokenizer"
            ),
            None => bail!(
                ErrInvalidConfig,
                "pad token id {pad} is outside the tokenizer's {} ids",
                tm.map.len()
            ),
        };
        let multipliers = multipliers(&config.layer_ids, config.max_ngram, k as u64, config.seed)?;
        let primes = derive_primes(
            config.layer_ids.len(),
            &config.vocab_per_ngram,
            config.n_heads,
        )?;
        let cols = (config.max_ngram - 1) * config.n_heads;
        let offsets = crate::hash::derive_offsets(&primes, cols);
        let rows: Vec<u64> = primes.chunks(cols).map(|c| c.iter().sum()).collect();
        if let Some(ne) = &config.num_embeddings {
            if *ne != rows {
                bail!(
                    ErrInvalidConfig,
                    "the derived tables have {rows:?} rows per layer but config.json says engram_num_embeddings = {ne:?}"
                );
            }
        }
        Ok(EngramTables {
            config,
            token_map: tm.map,
            compressed_vocab: k,
            stats: tm.stats,
            pad_id,
            multipliers,
            primes,
            offsets,
            rows,
        })
    }

    /// Read `config.json` and `tokenizer.json` and derive.
    pub fn from_files(
        config: &std::path::Path,
        tokenizer: &std::path::Path,
    ) -> Result<EngramTables> {
        let cfg = EngramConfig::from_file(config)?;
        let tok = tokenizer::load(tokenizer)?;
        let tm = tokenizer::token_map(&tok)?;
        EngramTables::derive(cfg, tm)
    }

    /// The tables as `engram_create` takes them.
    pub fn as_input(&self) -> HashTablesIn<'_> {
        HashTablesIn {
            layer_ids: &self.config.layer_ids,
            max_ngram: self.config.max_ngram,
            n_heads: self.config.n_heads,
            token_map: &self.token_map,
            pad_id: self.pad_id,
            multipliers: &self.multipliers,
            primes: &self.primes,
            offsets: &self.offsets,
        }
    }
}

/// The bound of the multiplier draw: `max(1, (2^63-1) // compressed // 2)`.
pub fn multiplier_half(compressed: u64) -> i64 {
    ((i64::MAX as u64 / compressed.max(1)) / 2).max(1) as i64
}

/// `default_rng(seed + 10007 * layer_id).integers(0, half, size=N, dtype=int64) * 2 + 1`
/// for each layer, flat `[layers * N]`.
pub fn multipliers(layer_ids: &[u32], n: usize, compressed: u64, seed: u64) -> Result<Vec<u64>> {
    let half = multiplier_half(compressed);
    let mut out = Vec::with_capacity(layer_ids.len() * n);
    for &lid in layer_ids {
        let s = seed as u128 + LAYER_SEED_STEP as u128 * lid as u128;
        let r = numpy_rng::default_rng(s)
            .integers_i64(0, half, n)
            .expect("half >= 1");
        out.extend(r.iter().map(|&v| (v * 2 + 1) as u64));
    }
    Ok(out)
}
