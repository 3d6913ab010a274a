//! Generates the C header from `src/ffi/` with cbindgen, then lays it out in
//! the order an engine meets it (the table of contents below).
//!
//! The header is written to `$OUT_DIR/engram.h` on every build; the committed
//! `include/engram.h` is rewritten only when `ENGRAM_UPDATE_HEADER=1` is set (or
//! when it does not exist yet). The test `header_is_current` fails when the two
//! differ, so a change to the ABI that is not committed in the header is caught.
//!
//! cbindgen writes constants, then types, then functions, each in source
//! order. The header instead reads by concept, as wasmtime's C API does: each
//! item of cbindgen's output is moved under its section's heading by
//! [`SECTIONS`]. An exported item that no section names, a name that is not
//! exported, or a C-visible name without the `ENGRAM_`/`engram_` prefix fails
//! the build, so a new export must be placed and named on purpose.

use std::env;
use std::path::PathBuf;

/// The header's table of contents: each section's heading, one line on what
/// it is for, and its items (constants, types and functions) in order.
const SECTIONS: &[(&str, &str, &[&str])] = &[
    (
        "Version and statuses",
        "Which library this is, and what every call that can fail returns.",
        &[
            "ENGRAM_VERSION_MAJOR",
            "engram_status",
            "engram_version",
            "engram_status_str",
            "engram_last_error",
        ],
    ),
    (
        "Types",
        "Value formats, backends, the special ids, and the two opaque handles.",
        &[
            "engram_type",
            "ENGRAM_FP8_SCALE_BLOCK",
            "engram_backend",
            "ENGRAM_TOKEN_DEAD",
            "ENGRAM_ROW_ID_DEAD",
            "engram_context",
            "engram_tables",
        ],
    ),
    (
        "Creating a context",
        "From the engine's own tables and weights (a config, then each layer's \
weights), from a GGUF file, from the safetensors checkpoint; hash tables \
from config.json + tokenizer.json.",
        &[
            "engram_config",
            "engram_config_init_sized",
            "engram_create",
            "engram_layer_weights",
            "engram_layer_weights_init_sized",
            "engram_set_layer",
            "engram_gguf_options",
            "engram_gguf_options_init_sized",
            "engram_create_from_gguf",
            "engram_safetensors_options",
            "engram_safetensors_options_init_sized",
            "engram_create_from_safetensors",
            "engram_tables_from_files",
            "engram_tables_fill_config",
            "engram_tables_layer_rows",
            "engram_tables_compressed_vocab",
        ],
    ),
    (
        "The step",
        "Once per batch: hash the tokens, then in each engram layer apply (after \
an optional prefetch or stage); read back and check to validate an \
integration. The checked forms (engram_apply_checked, ...) take every \
buffer's length and refuse a mismatch: use them; the unchecked ones stay \
for engines that already call them.",
        &[
            "engram_row_ids_per_token",
            "engram_hash",
            "engram_hash_device_checked",
            "engram_hash_device",
            "engram_apply_args",
            "engram_apply_args_init_sized",
            "engram_apply_checked",
            "engram_apply_device_ids_checked",
            "engram_apply",
            "engram_apply_device_ids",
            "engram_prefetch",
            "engram_stage",
            "engram_read_back_args",
            "engram_read_back_args_init_sized",
            "engram_read_back_checked",
            "engram_read_back",
            "engram_check",
        ],
    ),
    (
        "Shards and split points",
        "For engines that shard a layer across ranks (docs/sharding.md): a context \
that holds a part of each layer, and the calls that take the layer apart where \
the engine's collectives join it again (row ranges + all-reduce, heads or wkv \
outputs + all-gather), each giving engram_apply's bits. Both backends (on CUDA, device buffers on the engine's stream).",
        &[
            "engram_context_set_shard",
            "engram_shard_held",
            "engram_shard_bytes",
            "engram_context_memory",
            "engram_gather_rows",
            "engram_apply_rows",
            "engram_kv_columns",
            "engram_gate_from_kv",
        ],
    ),
    (
        "The history",
        "What the engine's KV cache does to a sequence, done to its hash history \
(llama_memory_seq_*); a sequence's saved state; the same on a device history.",
        &[
            "engram_seq_rm",
            "engram_seq_cp",
            "engram_seq_keep",
            "engram_seq_add",
            "engram_seq_div",
            "engram_seq_state_size",
            "engram_seq_state_write",
            "engram_seq_state_read",
            "engram_seq_rm_device",
            "engram_seq_cp_device",
            "engram_seq_keep_device",
            "engram_seq_add_device",
            "engram_seq_state_size_device",
            "engram_seq_state_write_device",
            "engram_seq_state_read_device",
            "engram_seq_copy",
            "engram_seq_drop",
            "engram_seq_copy_device",
            "engram_seq_drop_device",
        ],
    ),
    (
        "Information and threads",
        "What a context says about itself (to size buffers, to check a loaded \
model); its thread count at run time.",
        &[
            "engram_info",
            "ENGRAM_INFO_NO_TYPE",
            "engram_info_init_sized",
            "engram_context_info",
            "engram_layer_gate_weights",
            "engram_set_threads",
        ],
    ),
    (
        "Table tiers and their statistics",
        "Where a table's rows are found (a host row cache in front of a table \
read from a file, sized by the loaders' row_cache_bytes), and what each \
layer's tiers hold and cost: poll it every step from any thread, reset it.",
        &[
            "engram_cache_tier",
            "engram_cache_policy",
            "engram_read_mode",
            "engram_cache_stats",
            "engram_cache_stats_init_sized",
            "engram_cache_stats_read",
            "engram_cache_stats_reset",
        ],
    ),
    (
        "Teardown",
        "Freeing what the library handed out.",
        &["engram_free", "engram_tables_free"],
    ),
];

fn main() {
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    // Any source file can add or change an exported item.
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=ENGRAM_UPDATE_HEADER");

    let version = env::var("CARGO_PKG_VERSION").unwrap();
    let major = env::var("CARGO_PKG_VERSION_MAJOR").unwrap();
    let minor = env::var("CARGO_PKG_VERSION_MINOR").unwrap();
    let patch = env::var("CARGO_PKG_VERSION_PATCH").unwrap();
    let mut config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    // cbindgen.toml's own text (the conventions, the deprecation macro), then
    // the version macros, which open the first section.
    config.after_includes = Some(format!(
        "{}\n#define ENGRAM_VERSION_MAJOR {major}\n#define ENGRAM_VERSION_MINOR {minor}\n#define ENGRAM_VERSION_PATCH {patch}\n#define ENGRAM_VERSION_STRING \"{version}\"\n",
        config.after_includes.clone().unwrap_or_default()
    ));
    let bindings = match cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(b) => b,
        Err(e) => panic!("cbindgen failed: {e}"),
    };
    let mut raw = Vec::new();
    bindings.write(&mut raw);
    let header = arrange(&String::from_utf8(raw).expect("cbindgen writes UTF-8"));
    let generated = out_dir.join("engram.h");
    std::fs::write(&generated, header).unwrap();
    let committed = crate_dir.join("include").join("engram.h");
    if env::var("ENGRAM_UPDATE_HEADER").is_ok_and(|v| v == "1") || !committed.exists() {
        std::fs::create_dir_all(crate_dir.join("include")).unwrap();
        std::fs::copy(&generated, &committed).unwrap();
    }
}

/// cbindgen's output split at its top-level blank lines (a blank line inside
/// a comment does not split), each piece with its lines.
fn chunks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_comment = false;
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() && !in_comment {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            continue;
        }
        if t.starts_with("/*") && !t.contains("*/") {
            in_comment = true;
        } else if in_comment && t.ends_with("*/") {
            in_comment = false;
        }
        cur.push_str(line);
        cur.push('\n');
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// The code lines of a chunk (its doc comment left out).
fn code_lines(chunk: &str) -> Vec<&str> {
    let mut in_comment = false;
    let mut out = Vec::new();
    for line in chunk.lines() {
        let t = line.trim();
        if in_comment {
            in_comment = !t.ends_with("*/");
        } else if t.starts_with("/*") {
            in_comment = !t.contains("*/");
        } else {
            out.push(line);
        }
    }
    out
}

/// The name a chunk declares: a macro's, a type's, or the function's.
fn item_name(chunk: &str) -> Option<String> {
    let first = code_lines(chunk).first()?.trim().to_string();
    let word = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for p in [
        "#define ",
        "typedef struct ",
        "typedef enum ",
        "enum ",
        "struct ",
    ] {
        // (A function returning `enum engram_status` is not an enum.)
        let function = first.contains('(') && !p.starts_with('#');
        if let Some(rest) = first.strip_prefix(p).filter(|_| !function) {
            return Some(word(rest));
        }
    }
    // A function: the identifier before the first `(` that is not the
    // deprecation macro's.
    let code = code_lines(chunk).join("\n");
    let code = match code.strip_prefix("ENGRAM_DEPRECATED(") {
        Some(rest) => &rest[rest.find(')')? + 1..],
        None => &code[..],
    };
    let open = code.find('(')?;
    let before = &code[..open];
    let start = before
        .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .map_or(0, |i| i + 1);
    Some(before[start..].to_string())
}

/// cbindgen's header laid out by [`SECTIONS`], everything inside one
/// `extern "C"` block (types too: the block changes only functions' linkage).
fn arrange(raw: &str) -> String {
    let all = chunks(raw);
    let items_at = all
        .iter()
        .position(|c| c.starts_with("#define ENGRAM_VERSION_MAJOR"))
        .expect("the version macros");
    let tail_at = all
        .iter()
        .position(|c| c.starts_with("#endif  /* ENGRAM_H */"))
        .expect("the include guard's end");
    let mut items = std::collections::BTreeMap::new();
    for c in &all[items_at..tail_at] {
        if c.contains("extern \"C\"") && code_lines(c).len() == 3 {
            continue; // cbindgen's own extern "C" open and close
        }
        let name = item_name(c).unwrap_or_else(|| panic!("no name in header chunk:\n{c}"));
        assert!(
            name.starts_with("ENGRAM_") || name.starts_with("engram_"),
            "`{name}` is C-visible without the ENGRAM_/engram_ prefix: rename it, \
             make it pub(crate), or exclude it in cbindgen.toml"
        );
        assert!(
            items.insert(name.clone(), c.clone()).is_none(),
            "`{name}` twice"
        );
    }
    let mut out = String::new();
    for c in &all[..items_at] {
        out.push_str(c);
        out.push('\n');
    }
    out.push_str("#ifdef __cplusplus\nextern \"C\" {\n#endif  // __cplusplus\n\n");
    for (title, what, names) in SECTIONS {
        out.push_str(&heading(title, what));
        for n in *names {
            let c = items.remove(*n).unwrap_or_else(|| {
                panic!("build.rs's SECTIONS names `{n}`, which the header does not declare")
            });
            out.push_str(&c);
            out.push('\n');
        }
    }
    let left: Vec<&String> = items.keys().collect();
    assert!(
        left.is_empty(),
        "exported but in no section of build.rs's SECTIONS: {left:?}"
    );
    out.push_str("#ifdef __cplusplus\n}  // extern \"C\"\n#endif  // __cplusplus\n\n");
    for c in &all[tail_at..] {
        out.push_str(c);
        out.push('\n');
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

/// A section heading: a rule, the title, one wrapped line on what it holds.
fn heading(title: &str, what: &str) -> String {
    let rule = "/* ".to_string() + &"=".repeat(74) + "\n";
    let mut s = rule.clone();
    s.push_str(&format!(" * {title}\n *\n"));
    let mut line = String::new();
    for w in what.split_whitespace() {
        if !line.is_empty() && line.len() + 1 + w.len() > 72 {
            s.push_str(&format!(" * {line}\n"));
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(w);
    }
    s.push_str(&format!(" * {line}\n"));
    s.push_str(&format!(" * {} */\n\n", "=".repeat(73)));
    s
}
