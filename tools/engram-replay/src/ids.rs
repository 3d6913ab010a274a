//! Text -> V4.1 tokens -> row ids, through the library's own hash.
//!
//! The tables are derived from `config.json` and `tokenizer.json` exactly as
//! `engram-tables` derives them ([`EngramTables::from_files`]); a hash-only
//! CPU context (no layer registered) hashes each text as its own sequence,
//! from position 0, in calls of at most [`HASH_CHUNK`] tokens, the way an
//! engine hashes a request's prefill: each text is one request.

use anyhow::{bail, Context as _, Result};
use engram::tables::{EngramConfig, EngramTables};
use engram::{Context, ContextConfig, EngramBackend, Geometry, Limits};
use std::path::Path;

/// Tokens per hash call (the prefill chunk of the replay as well).
pub const HASH_CHUNK: usize = 4096;

/// Most positions one text may have (the history is paged: nothing is
/// reserved for positions a text does not reach).
const MAX_POSITIONS: usize = 1 << 28;

/// The hash's view of the model: its tables and a context that hashes.
pub struct Hasher {
    pub tables: EngramTables,
    pub tokenizer: tokenizers::Tokenizer,
}

/// The row ids of one text: `ids[(t * layers + l) * cols + c]`, each below
/// its layer's row count (which fits in u32 for V4.1: 384M rows).
pub struct TextIds {
    pub tokens: usize,
    pub ids: Vec<u32>,
}

impl Hasher {
    pub fn load(config: &Path, tokenizer: &Path) -> Result<Hasher> {
        let what = || format!("{} + {}", config.display(), tokenizer.display());
        let cfg = EngramConfig::from_file(config).with_context(what)?;
        let tokenizer = engram::tables::tokenizer::load(tokenizer).with_context(what)?;
        let tm = engram::tables::tokenizer::token_map(&tokenizer).with_context(what)?;
        let tables = EngramTables::derive(cfg, tm).with_context(what)?;
        if let Some(&r) = tables.rows.iter().find(|&&r| r > u32::MAX as u64) {
            bail!("a layer has {r} rows: more than a u32 row id holds");
        }
        Ok(Hasher { tables, tokenizer })
    }

    pub fn layers(&self) -> usize {
        self.tables.config.layer_ids.len()
    }

    pub fn cols(&self) -> usize {
        (self.tables.config.max_ngram - 1) * self.tables.config.n_heads
    }

    /// A hash-only context over the tables (CPU backend, no layer: the
    /// geometry is never used by `hash`).
    pub fn context(&self) -> Result<Context<'static>> {
        let cfg = ContextConfig {
            geometry: Geometry {
                d: 8,
                hc: 1,
                hd: 32,
                eps: 1e-6,
            },
            tables: self.tables.as_input(),
            limits: Limits {
                max_tokens: HASH_CHUNK,
                max_seqs: 1,
                max_positions: MAX_POSITIONS,
            },
            n_threads: 1,
            backend: EngramBackend::Cpu as u32,
            device: 0,
            tuning: Default::default(),
        };
        Ok(Context::new(&cfg)?)
    }

    /// The V4.1 tokens of each text (the tokenizer's special tokens added,
    /// as a request's prompt has them).
    pub fn tokenize(&self, texts: &[String]) -> Result<Vec<Vec<i32>>> {
        let enc = self
            .tokenizer
            .encode_batch(texts.to_vec(), true)
            .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?;
        Ok(enc
            .iter()
            .map(|e| e.get_ids().iter().map(|&t| t as i32).collect())
            .collect())
    }

    /// Hash one text's tokens as sequence 0 from position 0, then drop the
    /// sequence.
    pub fn hash_text(&self, ctx: &Context, tokens: &[i32]) -> Result<TextIds> {
        let per = self.layers() * self.cols();
        let mut ids = Vec::new();
        ids.try_reserve_exact(tokens.len() * per)?;
        let mut out = vec![0i64; HASH_CHUNK * per];
        for (ci, chunk) in tokens.chunks(HASH_CHUNK).enumerate() {
            let n = chunk.len();
            let p0 = (ci * HASH_CHUNK) as i32;
            let pos: Vec<i32> = (p0..p0 + n as i32).collect();
            ctx.hash(chunk, &vec![0; n], &pos, &mut out[..n * per])?;
            ids.extend(out[..n * per].iter().map(|&v| v as u32));
        }
        ctx.seq_drop(0)?;
        Ok(TextIds {
            tokens: tokens.len(),
            ids,
        })
    }
}
