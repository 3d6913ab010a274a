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
//! index. The ids mapped are those below the tokenizer's length as
//! `transformers` counts it (`len(tokenizer)`), as the reference, vLLM and
//! SGLang map them: an id there without a token (a hole) decodes to the
//! empty string and is keyed like any other id; an id at or beyond the
//! length is refused. docs/tokenizers.md states the rule.

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
    /// Ids below the tokenizer's length with no token (keyed on their
    /// empty decode, as the reference keys them).
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

/// Largest `tokenizer.json` read (the DeepSeek one is about 8 MB; the
/// largest public ones about 35 MB).
pub(crate) const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// Peak memory of the `tokenizers` library's parse, per byte of
/// `tokenizer.json`, with margin over the worst shape measured
/// (docs/file-safety.md).
pub(crate) const TOKENIZER_PEAK_PER_BYTE: usize = 48;

/// Load a `tokenizer.json` (at most [`MAX_TOKENIZER_BYTES`], read into a
/// fallibly reserved buffer; a FIFO or device is refused before any read).
/// The parse is the `tokenizers` library's, which allocates infallibly:
/// its worst case ([`TOKENIZER_PEAK_PER_BYTE`] per byte) is reserved
/// fallibly first, so a file too big for the memory left is `ErrCapacity`.
pub fn load(path: &std::path::Path) -> Result<Tokenizer> {
    let bytes = crate::files::read_small(path, "tokenizer", MAX_TOKENIZER_BYTES)?;
    parse(&bytes, path)
}

/// [`load`] of a `tokenizer.json` a loader opened from a model's directory
/// ([`crate::files::ModelDir`]).
pub fn load_opened(f: &crate::files::Opened) -> Result<Tokenizer> {
    let bytes =
        crate::files::read_whole(&f.file, f.len, &f.path, "tokenizer", MAX_TOKENIZER_BYTES)?;
    parse(&bytes, &f.path)
}

/// Parse the bytes of a `tokenizer.json` read from `path`.
fn parse(bytes: &[u8], path: &std::path::Path) -> Result<Tokenizer> {
    crate::files::parse_headroom(
        bytes.len(),
        TOKENIZER_PEAK_PER_BYTE,
        &format!("tokenizer {}", path.display()),
    )?;
    Tokenizer::from_bytes(bytes).map_err(|e| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!(
                "tokenizer {}: not a tokenizers JSON file: {e}",
                path.display()
            ),
        )
    })
}

/// Most ids a token map spans (the tokenizer's length): 2^24 = 16,777,216
/// ids, a 64 MiB map, 130 times DeepSeek-V4.1's 129,280.
pub(crate) const MAX_TOKEN_IDS: usize = 1 << 24;

/// Most ids below the tokenizer's length without a token (holes, decoded
/// and keyed like any other id): as many as it holds, plus this many.
pub(crate) const MAX_EXTRA_HOLES: usize = 1 << 16;

/// The tokenizer's length as `transformers` counts it (`len(tokenizer)`, the
/// count the reference, vLLM and SGLang derive the map over): the model's
/// vocabulary plus the added tokens whose content is not in it
/// (`tokenizers`' `get_vocab_size(true)`).
pub fn reference_len(tok: &Tokenizer) -> usize {
    tok.get_vocab_size(true)
}

/// The token map of `tok` over ids `0..n`, `n` its length as the reference
/// counts it ([`reference_len`]).
///
/// Every id below `n` is decoded and keyed, an id without a token (a hole)
/// included: its decode is empty, so it takes the key of the empty string,
/// counts in the compressed vocabulary and shares its id with any token
/// whose decode is empty. An id at or beyond `n` that the tokenizer names is
/// outside the reference's map: `ErrInvalidConfig` naming the id.
///
/// The map is bounded by what the file holds: `n` may be at most
/// [`MAX_TOKEN_IDS`], and the holes at most as many as its tokens plus
/// [`MAX_EXTRA_HOLES`]. Every allocation is fallible (`ErrCapacity`).
pub fn token_map(tok: &Tokenizer) -> Result<TokenMap> {
    let vocab = tok.get_vocab(true);
    let mut held: Vec<u32> = Vec::new();
    held.try_reserve_exact(vocab.len())
        .map_err(|_| oom(vocab.len(), "token ids"))?;
    held.extend(vocab.values().copied());
    drop(vocab);
    held.sort_unstable();
    held.dedup();
    let n = reference_len(tok);
    if n == 0 {
        bail!(ErrInvalidConfig, "the tokenizer has no tokens");
    }
    if n > MAX_TOKEN_IDS {
        bail!(
            ErrInvalidConfig,
            "the tokenizer's length is {n} ids (at most {MAX_TOKEN_IDS}, 2^24)"
        );
    }
    if let Some(&id) = held.iter().find(|&&id| id as usize >= n) {
        bail!(
            ErrInvalidConfig,
            "the tokenizer names token id {id}, at or beyond its length {n} (the model's {} tokens \
             plus the added tokens not among them, as transformers' len(tokenizer) counts): \
             the reference's token map stops below {n} and cannot hash id {id}",
            tok.get_vocab_size(false)
        );
    }
    let holes = n - held.len();
    if holes > held.len() + MAX_EXTRA_HOLES {
        bail!(
            ErrInvalidConfig,
            "the tokenizer's length is {n} but it holds {} token ids: {holes} ids without a token \
             (at most as many as its tokens plus {MAX_EXTRA_HOLES})",
            held.len()
        );
    }
    let norm = normalizer()?;
    // Keys in parallel (decode + normalise is the cost), then interned in id
    // order. On a pool of this call's own, joined before it returns: no
    // thread outlives the call (rayon's global pool would stay for good).
    use rayon::prelude::*;
    let mut keyed: Vec<Result<Key>> = Vec::new();
    keyed
        .try_reserve_exact(n)
        .map_err(|_| oom(n, "token keys"))?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(64));
    let pool = crate::cpu::pool::Pool::new(threads).map_err(|e| {
        Error::new(
            EngramStatus::ErrCapacity,
            format!("tokenizer: cannot start {threads} threads: {e}"),
        )
    })?;
    // The capacity is reserved: `par_extend` of an exact-length iterator does not grow it.
    pool.install(|| {
        keyed.par_extend(
            (0..n as u32)
                .into_par_iter()
                .with_min_len(1024)
                .map(|id| key(tok, &norm, id)),
        )
    });
    drop(pool);
    let mut keys: HashMap<String, i32> = HashMap::new();
    keys.try_reserve(n)
        .map_err(|_| oom(n, "distinct token keys"))?;
    let mut map: Vec<i32> = Vec::new();
    map.try_reserve_exact(n)
        .map_err(|_| oom(n, "token map entries"))?;
    let mut stats = TokenMapStats::default();
    for k in keyed {
        let k = match k? {
            Key::NoToken(k) => {
                stats.no_token += 1;
                k
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

fn oom(n: usize, what: &str) -> Error {
    Error::new(
        EngramStatus::ErrCapacity,
        format!("tokenizer: out of memory for {n} {what}"),
    )
}

/// One id's key and how it was found.
enum Key {
    /// An id without a token: the key of its (empty) decode.
    NoToken(String),
    /// The raw token string (the decode held U+FFFD).
    Raw(String),
    /// The decode itself (its normalisation was empty).
    Decoded(String),
    Normalised(String),
}

/// The reference's key of one id: its decode (special tokens kept), the raw
/// token where that holds U+FFFD, else the normalised decode, or the decode
/// itself where that normalises to nothing. An id without a token decodes
/// like any other (to the empty string here) and is keyed the same way.
fn key(tok: &Tokenizer, norm: &Sequence, id: u32) -> Result<Key> {
    let raw = tok.id_to_token(id);
    let text = tok.decode(&[id], false).map_err(|e| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!("tokenizer: decoding id {id}: {e}"),
        )
    })?;
    if text.contains('\u{FFFD}') {
        if let Some(raw) = raw {
            return Ok(Key::Raw(raw));
        }
    }
    let mut s = NormalizedString::from(text.as_str());
    norm.normalize(&mut s).map_err(|e| {
        Error::new(
            EngramStatus::ErrInvalidConfig,
            format!("tokenizer: normalising id {id}: {e}"),
        )
    })?;
    Ok(if raw.is_none() && s.get().is_empty() {
        Key::NoToken(text)
    } else if s.get().is_empty() {
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
