//! `engram_tables_fill_config` on sizes the `engram_config` fields cannot hold.

use engram::EngramStatus;
use std::path::PathBuf;

/// A WordLevel `tokenizer.json` of three tokens.
const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
    "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
    "model": {"type": "WordLevel", "vocab": {"<pad>": 0, "a": 1, "b": 2}, "unk_token": "<pad>"}}"#;

const CONFIG: &str = r#"{"engram_layer_ids": [1, 14], "engram_max_ngram_size": 3, "engram_n_heads": 2,
    "engram_vocab_size": 1000, "engram_pad_token_id": 0, "hidden_size": 64, "hc_mult": 2, "engram_head_dim": 8}"#;

fn write_files(tag: &str, config: &str) -> (PathBuf, PathBuf) {
    let d = std::env::temp_dir().join(format!("engram-fill-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let t = d.join("tokenizer.json");
    std::fs::write(&t, TOKENIZER).unwrap();
    let c = d.join("config.json");
    std::fs::write(&c, config).unwrap();
    (c, t)
}

/// `engram_tables_fill_config` refuses a `hidden_size` the 32-bit field
/// cannot hold (it was skipped silently) and leaves the struct unchanged.
#[test]
fn fill_config_refuses_a_hidden_size_above_u32() {
    for (field, value) in [
        ("hidden_size", 1u64 << 32),
        ("hc_mult", 1 << 33),
        ("engram_head_dim", u64::MAX),
    ] {
        let cfg = CONFIG.replace(
            &format!("\"{field}\": "),
            &format!("\"{field}\": {value}, \"unused_{field}\": "),
        );
        let (c, t) = write_files(&format!("fill-{field}"), &cfg);
        let cs = |p: &PathBuf| std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        let (cc, tc) = (cs(&c), cs(&t));
        let mut tables: *mut engram::ffi::EngramTablesHandle = std::ptr::null_mut();
        let st = engram::ffi::engram_tables_from_files(cc.as_ptr(), tc.as_ptr(), &mut tables);
        assert_eq!(st, EngramStatus::Ok, "{field}");
        let mut conf = std::mem::MaybeUninit::<engram::ffi::EngramConfig>::zeroed();
        engram::ffi::engram_config_init_sized(
            conf.as_mut_ptr(),
            std::mem::size_of::<engram::ffi::EngramConfig>(),
        );
        // SAFETY: initialised by engram_config_init_sized.
        let mut conf = unsafe { conf.assume_init() };
        conf.hidden_size = 7;
        let before = (
            conf.hidden_size,
            conf.hc,
            conf.head_dim,
            conf.n_heads,
            conf.token_map,
        );
        let st = engram::ffi::engram_tables_fill_config(tables, &mut conf);
        assert_eq!(st, EngramStatus::ErrInvalidConfig, "{field} = {value}");
        // SAFETY: engram_last_error returns a NUL-terminated string.
        let msg = unsafe { std::ffi::CStr::from_ptr(engram::ffi::engram_last_error()) };
        assert!(
            msg.to_str().unwrap().contains(&value.to_string()),
            "{msg:?}"
        );
        assert_eq!(
            before,
            (
                conf.hidden_size,
                conf.hc,
                conf.head_dim,
                conf.n_heads,
                conf.token_map
            ),
            "the config changed on a refusal"
        );
        engram::ffi::engram_tables_free(tables);
    }
}
