//! The token map of a tokenizer with holes (ids without a token), as the
//! reference derives it (DeepSeek's Engram demo, vLLM and SGLang alike):
//!
//! ```text
//! for id in range(len(tokenizer)):        # transformers' count: the model's
//!                                         # tokens + added tokens not among them
//!     text = tokenizer.decode([id], skip_special_tokens=False)
//!     key = convert_ids_to_tokens(id) if "\ufffd" in text
//!           else (normalise(text) or text)
//!     map[id] = first-seen index of key
//! ```
//!
//! An id without a token decodes to "" and takes the index of the key ""
//! like any other id, and counts in the compressed vocabulary (which sets
//! the multipliers). An id at or beyond `len(tokenizer)` that the tokenizer
//! names is outside that map: refused, naming the id.

use engram::tables::{multipliers, tokenizer, EngramTables};
use engram::EngramStatus;
use std::path::PathBuf;

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("engram-holes-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A WordLevel `tokenizer.json` (no normaliser, no decoder: a lone token
/// decodes to itself) with `vocab` and the added tokens `added`.
fn tokenizer_json(vocab: &str, added: &[&str]) -> String {
    let added: Vec<String> = added
        .iter()
        .enumerate()
        .map(|(i, c)| {
            format!(
                r#"{{"id": {}, "content": "{c}", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}}"#,
                1000 + i
            )
        })
        .collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [{}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {vocab}, "unk_token": "<pad>"}}}}"#,
        added.join(", ")
    )
}

/// Model tokens at ids 0, 1, 2, 4 and 5 (five tokens, no id 3), and two
/// added tokens, which `tokenizers` numbers from the model's size on (5, 6:
/// the ids the file writes are not used), so `<s>` takes id 5 over `wörld`.
/// `len(tokenizer)` = 5 + 2 = 7; id 3 is a hole below it.
const HOLED_VOCAB: &str = r#"{"<pad>": 0, "Hello": 1, "hello": 2, "World": 4, "wörld": 5}"#;
const HOLED_ADDED: &[&str] = &["<s>", "</s>"];

fn write_holed(tag: &str, config: &str) -> (PathBuf, PathBuf) {
    let d = temp_dir(tag);
    let t = d.join("tokenizer.json");
    std::fs::write(&t, tokenizer_json(HOLED_VOCAB, HOLED_ADDED)).unwrap();
    let c = d.join("config.json");
    std::fs::write(&c, config).unwrap();
    (c, t)
}

const CONFIG: &str = r#"{"engram_layer_ids": [1, 14], "engram_max_ngram_size": 3, "engram_n_heads": 2,
    "engram_vocab_size": 1000, "engram_pad_token_id": 3, "hidden_size": 64, "hc_mult": 2, "engram_head_dim": 8}"#;

#[test]
fn holes_below_the_length_key_on_the_empty_decode() {
    let (c, t) = write_holed("map", CONFIG);
    let tok = tokenizer::load(&t).unwrap();
    assert_eq!(tokenizer::reference_len(&tok), 7, "len(tokenizer)");
    let tm = tokenizer::token_map(&tok).unwrap();
    // The rule by hand: id 0 "<pad>" -> key "<pad>" (0); 1 "Hello" and
    // 2 "hello" -> "hello" (1); 3 (no token) decodes to "" -> key "" (2);
    // 4 "World" -> "world" (3); 5 "<s>" (4); 6 "</s>" (5). Before the fix
    // id 3 was -1 and the vocabulary 5.
    assert_eq!(tm.map, vec![0, 1, 1, 2, 3, 4, 5]);
    assert_eq!(tm.compressed, 6);
    assert_eq!(tm.stats.no_token, 1);
    // The same rule computed with the library's decode and normaliser.
    let norm = tokenizer::normalizer().unwrap();
    let mut keys: Vec<String> = Vec::new();
    let mut want = Vec::new();
    for id in 0..7u32 {
        let text = tok.decode(&[id], false).unwrap();
        assert!(!text.contains('\u{FFFD}'));
        let mut s = tokenizers::NormalizedString::from(text.as_str());
        tokenizers::Normalizer::normalize(&norm, &mut s).unwrap();
        let key = if s.get().is_empty() {
            text
        } else {
            s.get().to_owned()
        };
        let i = keys.iter().position(|k| *k == key).unwrap_or_else(|| {
            keys.push(key);
            keys.len() - 1
        });
        want.push(i as i32);
    }
    assert_eq!(tm.map, want);
    // The compressed vocabulary (holes counted) sets the multipliers, and the
    // pad token id 3 (a hole) maps like any id.
    let tables = EngramTables::from_files(&c, &t).unwrap();
    assert_eq!(tables.compressed_vocab, 6);
    assert_eq!(tables.pad_id, 2);
    assert_eq!(tables.token_map, want);
    assert_eq!(tables.multipliers, multipliers(&[1, 14], 3, 6, 0).unwrap());
    assert_ne!(tables.multipliers, multipliers(&[1, 14], 3, 5, 0).unwrap());
}

#[test]
fn an_id_at_or_beyond_the_length_is_refused_naming_it() {
    // Three model tokens, ids 0, 1 and 5: len(tokenizer) = 3, id 5 is
    // outside the reference's map (before the fix: mapped, holes 2-4 dead).
    let d = temp_dir("beyond");
    let t = d.join("tokenizer.json");
    std::fs::write(&t, tokenizer_json(r#"{"<pad>": 0, "a": 1, "c": 5}"#, &[])).unwrap();
    let tok = tokenizer::load(&t).unwrap();
    let e = tokenizer::token_map(&tok).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
    assert!(
        e.message.contains("token id 5") && e.message.contains("length 3"),
        "{}",
        e.message
    );
    // Through the C ABI: a status, `*out` untouched.
    let c = d.join("config.json");
    std::fs::write(
        &c,
        CONFIG.replace("\"engram_pad_token_id\": 3", "\"engram_pad_token_id\": 0"),
    )
    .unwrap();
    let cs = |p: &PathBuf| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    let (cc, tc) = (cs(&c), cs(&t));
    let mut out: *mut engram::ffi::EngramTablesHandle = std::ptr::null_mut();
    let st = engram::ffi::engram_tables_from_files(cc.as_ptr(), tc.as_ptr(), &mut out);
    assert_eq!(st, EngramStatus::ErrInvalidConfig);
    assert!(out.is_null());
    // SAFETY: engram_last_error returns a NUL-terminated string.
    let msg = unsafe { std::ffi::CStr::from_ptr(engram::ffi::engram_last_error()) };
    assert!(msg.to_str().unwrap().contains("token id 5"), "{msg:?}");
}
