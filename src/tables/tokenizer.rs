//! The compressed token map of SPEC section 3, from a Hugging Face
//! `tokenizer.json`, with the `tokenizers` library's own normalisers and
//! decoder (the reference uses the same library from Python).
//!
//! Each token id is decoded alone (special tokens kept) and keyed:
//! - a decode containing U+FFFD (a partial UTF-8 sequence) keys on the raw
//!   token string (`id_to_token`);
//! - otherwise on the decode normalised by NFKC, NFD, strip accents,
//!   lowercase, runs of `[ \t\r\n]` to one space, a lone space protected by a
//!   sentinel through strip; an empty normalisation keys on the decode itself.
//!
//! Keys are interned in first-seen order: the map sends each id to its key's
//! index. An id the tokenizer has no token for (a gap in the vocabulary) maps
//! to `-1` (dead).

use crate::error::{bail, Error, Result};
use crate::EngramStatus;
use std::collections::HashMap;
use tokenizers::normalizers::{Lowercase, Replace, Sequence, Strip, StripAccents, NFD, NFKC};
use tokenizers::{NormalizedString, Normalizer, NormalizerWrapper, Tokenizer};

/// Private-use character that stands in for a lone space through `Strip`.
const SENTINEL: &str = "\u{E000}";

/// How the keys of a token map were found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TokenMapStats {
    /// Ids whose decode held U+FFFD, keyed on the raw token string.
    pub fffd_raw: usize,
    /// Ids whose normalisation was empty, keyed on the decode.
    pub empty_norm: usize,
    /// Ids with no token in the tokenizer (mapped to -1).
    pub no_token: usize,
}

/// A token map and the number of distinct compressed ids it uses.
#[derive(Clone, Debug)]
pub struct TokenMap {
    pub map: Vec<i32>,
    pub compressed: usize,
    pub stats: TokenMapStats,
}

/// The reference's normaliser chain.
pub fn normalizer() -> Result<Sequence> {
    let rep = |pat: tokenizers::normalizers::replace::ReplacePattern, to: &str| {
        Replace::new(pat, to).map_err(|e| {
            Error::new(
                EngramStatus::ErrInternal,
                format!("building the normaliser: {e}"),
            )
        })
    };
    use tokenizers::normalizers::replace::ReplacePattern::{Regex, String as Plain};
    let chain: Vec<NormalizerWrapper> = vec![
        NFKC.into(),
        NFD.into(),
        StripAccents.into(),
        Lowercase.into(),
        rep(Regex("[ \t\r\n]+".into()), " ")?.into(),
        rep(Regex("^ $".into()), SENTINEL)?.into(),
        Strip::new(true, true).into(),
        rep(Plain(SENTINEL.into()), " ")?.into(),
    ];
    Ok(Sequence::new(chain))
}

/// Largest `tokenizer.json` read (the DeepSeek one is about 8 MB).
pub(crate) const MAX_TOKENIZER_BYTES: u64 = 512 << 20;

/// Load a `tokenizer.json`.
pub fn load(path: &std::path::Path) -> Result<Tokenizer> {
    // A FIFO or device is refused before any read (crate::files).
    let bytes = crate::files::read_small(path, "tokenizer", MAX_TOKENIZER_BYTES)?;
    Tokenizer::from_bytes(&bytes).map_err(|e| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!(
                "tokenizer {}: not a tokenizers JSON file: {e}",
                path.display()
            ),
        )
    })
}

/// The token map of `tok` over ids `0..n` with `n` one past its largest id.
pub fn token_map(tok: &Tokenizer) -> Result<TokenMap> {
    let n = tok
        .get_vocab(true)
        .values()
        .map(|&i| i as usize + 1)
        .max()
        .unwrap_or(0)
        .max(tok.get_vocab_size(true));
    if n == 0 {
        bail!(ErrInvalidConfig, "the tokenizer has no tokens");
    }
    if n > i32::MAX as usize {
        bail!(
            ErrInvalidConfig,
            "the tokenizer has {n} ids (at most 2^31-1)"
        );
    }
    let norm = normalizer()?;
    // Keys in parallel (decode + normalise is the cost), then interned in id order.
    use rayon::prelude::*;
    let keyed: Vec<Result<Key>> = (0..n as u32)
        .into_par_iter()
        .with_min_len(1024)
        .map(|id| key(tok, &norm, id))
        .collect();
    let mut keys: HashMap<String, i32> = HashMap::with_capacity(n);
    let mut map = Vec::with_capacity(n);
    let mut stats = TokenMapStats::default();
    for k in keyed {
        let k = match k? {
            Key::NoToken => {
                stats.no_token += 1;
                map.push(-1);
                continue;
            }
            Key::Raw(k) => {
                stats.fffd_raw += 1;
                k
            }
            Key::Decoded(k) => {
                stats.empty_norm += 1;
                k
            }
            Key::Normalised(k) => k,
        };
        let next = keys.len() as i32;
        map.push(*keys.entry(k).or_insert(next));
    }
    Ok(TokenMap {
        compressed: keys.len(),
        map,
        stats,
    })
}

/// One id's key and how it was found.
enum Key {
    NoToken,
    /// The raw token string (the decode held U+FFFD).
    Raw(String),
    /// The decode itself (its normalisation was empty).
    Decoded(String),
    Normalised(String),
}

fn key(tok: &Tokenizer, norm: &Sequence, id: u32) -> Result<Key> {
    let Some(raw) = tok.id_to_token(id) else {
        return Ok(Key::NoToken);
    };
    let text = tok.decode(&[id], false).map_err(|e| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!("tokenizer: decoding id {id}: {e}"),
        )
    })?;
    if text.contains('\u{FFFD}') {
        return Ok(Key::Raw(raw));
    }
    let mut s = NormalizedString::from(text.as_str());
    norm.normalize(&mut s).map_err(|e| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!("tokenizer: normalising id {id}: {e}"),
        )
    })?;
    Ok(if s.get().is_empty() {
        Key::Decoded(text)
    } else {
        Key::Normalised(s.get().to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        let n = normalizer().unwrap();
        let mut x = NormalizedString::from(s);
        n.normalize(&mut x).unwrap();
        x.get().to_owned()
    }

    #[test]
    fn normaliser_chain() {
        assert_eq!(norm(" "), " ", "a lone space survives strip");
        assert_eq!(norm("\t\n"), " ");
        assert_eq!(norm("  Élodie  "), "elodie");
        assert_eq!(norm("ﬁ"), "fi", "NFKC");
        assert_eq!(norm("A \t B"), "a b");
        assert_eq!(norm(""), "");
    }
}
