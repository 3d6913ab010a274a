//! Each GGUF block format has one home, `src/formats/ggml.rs`: its typed
//! block, its values and bytes per block, its field offsets. Code elsewhere
//! in `src/` takes them from there (`BlockQ4K::BYTES`, `BlockQ4K::QS`), so
//! no block's byte size is written as a number outside `src/formats/`.
//!
//! How it looks. In every `.rs` file of `src/` outside `src/formats/`, with
//! `//` comments cut off, a number equal to a block's bytes (18, 34, 84,
//! 110, 144, 176, 210) is a block size when it is multiplied or added
//! (`*` or `+` next to it: `row.add(u * 144)`) or is a whole constant
//! (`const BB: usize = 144;`). Other uses of those numbers (a lane index in
//! a vector constant, an array's length) are not block sizes.
//! `ENGRAM_LITERALS_SRC=/path/to/src` checks another tree.

use std::path::{Path, PathBuf};

/// Bytes per block of `Q4_0`, `Q8_0`, `Q2_K`, `Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`.
const BLOCK_BYTES: [u64; 7] = [18, 34, 84, 110, 144, 176, 210];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "formats") && p.parent() == Some(dir) {
                continue;
            }
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn is_word(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'.'
}

/// The block sizes written as numbers in one line of code.
fn block_size_literals(code: &str) -> Vec<u64> {
    let b = code.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if !b[i].is_ascii_digit() || (i > 0 && is_word(b[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = &code[start..i];
        for suffix in ["usize", "u32", "u64", "i32"] {
            if code[i..].starts_with(suffix) {
                i += suffix.len();
                break;
            }
        }
        if i < b.len() && is_word(b[i]) {
            continue;
        }
        let Ok(v) = digits.parse::<u64>() else {
            continue;
        };
        if !BLOCK_BYTES.contains(&v) {
            continue;
        }
        let before = code[..start].trim_end().bytes().last();
        let after = code[i..].trim_start().bytes().next();
        let arithmetic = matches!(before, Some(b'*' | b'+')) || matches!(after, Some(b'*' | b'+'));
        let constant = before == Some(b'=') && after == Some(b';');
        if arithmetic || constant {
            found.push(v);
        }
    }
    found
}

#[test]
fn the_scan_finds_what_it_is_meant_to_find() {
    assert_eq!(block_size_literals("let b = row.add(u * 144);"), [144]);
    assert_eq!(block_size_literals("    const BB: usize = 210;"), [210]);
    assert_eq!(block_size_literals("p.add(110 + 32 * half)"), [110]);
    assert_eq!(block_size_literals("x.add(34usize * u)"), [34]);
    assert!(block_size_literals("_mm512_setr_epi32(0, 2, 16, 18, 20)").is_empty());
    assert!(block_size_literals("const N: [&str; 34] = [];").is_empty());
    assert!(block_size_literals("let v = x1144 * 2 + 1.84;").is_empty());
    assert!(block_size_literals("row.add(u * BlockQ4K::BYTES)").is_empty());
}

#[test]
fn no_block_size_is_written_outside_the_formats_home() {
    let src = std::env::var_os("ENGRAM_LITERALS_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    assert!(files.len() > 10, "no sources under {}", src.display());
    let mut bad = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for v in block_size_literals(code) {
                bad.push(format!(
                    "{}:{}: {v} in `{}`",
                    f.display(),
                    n + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "block sizes written as numbers outside src/formats/ (take them from \
         formats::ggml's blocks):\n{}",
        bad.join("\n")
    );
}

/// The kernels address a GGUF block's fields by the offsets `src/cuda/kernels.rs`
/// passes from the same home (`ENG_Q4_K_QS`, `ENG_Q6_K_D`, ...): a block
/// pointer (`b`, the name every block accessor gives it) is never indexed or
/// advanced by a number (`b[2u + e]`, `b + 208`).
#[test]
fn the_kernels_take_block_field_offsets_from_the_formats() {
    let dir = std::env::var_os("ENGRAM_LITERALS_KERNELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels"));
    let mut found = Vec::new();
    let mut n_files = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let ext = p.extension().and_then(|x| x.to_str()).unwrap_or("");
        if ext != "cu" && ext != "cuh" {
            continue;
        }
        n_files += 1;
        let text = std::fs::read_to_string(&p).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").as_bytes();
            for (j, _) in code.iter().enumerate().filter(|&(_, &c)| c == b'b') {
                if j > 0 && is_word(code[j - 1]) || code.get(j + 1).is_some_and(|&c| is_word(c)) {
                    continue;
                }
                let rest = std::str::from_utf8(&code[j + 1..])
                    .unwrap_or("")
                    .trim_start();
                let after = rest
                    .strip_prefix('[')
                    .or_else(|| rest.strip_prefix('+'))
                    .map(str::trim_start);
                if after.is_some_and(|a| a.starts_with(|c: char| c.is_ascii_digit())) {
                    found.push(format!("{}:{}: {}", p.display(), i + 1, line.trim()));
                }
            }
        }
    }
    assert!(n_files >= 5, "no kernel sources under {}", dir.display());
    assert!(
        found.is_empty(),
        "block fields addressed by number (use the ENG_<FORMAT>_<FIELD> offsets):\n{}",
        found.join("\n")
    );
}
