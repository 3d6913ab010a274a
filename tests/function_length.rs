//! No function in `src/` is over [`MAX_LINES`] lines: a long one is split into
//! named steps that read top-down (issue 33). `ENGRAM_FN_LEN_SRC=/path/to/src`
//! checks another tree.
//!
//! How it counts. A function starts at a line whose code (comments cut off)
//! begins with `fn`, after any of `pub`/`pub(...)`, `const`, `unsafe`,
//! `extern "C"`, and ends at the line where its braces close (a declaration
//! ending in `;` is no body); string and character literals are skipped.

use std::path::{Path, PathBuf};

const MAX_LINES: usize = 100;

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `line`'s code: without its `//` comment and with string and character
/// literals emptied (so their braces do not count).
fn code(line: &str) -> String {
    let mut out = String::new();
    let mut it = line.chars().peekable();
    while let Some(c) = it.next() {
        match c {
            '/' if it.peek() == Some(&'/') => break,
            '"' => {
                while let Some(d) = it.next() {
                    match d {
                        '\\' => {
                            it.next();
                        }
                        '"' => break,
                        _ => {}
                    }
                }
                out.push_str("\"\"");
            }
            // A character literal ('{', '\n'), not a lifetime ('a).
            '\'' => {
                let rest: String = it.clone().take(4).collect();
                let close = if rest.starts_with('\\') {
                    rest.chars().skip(2).position(|c| c == '\'').map(|i| i + 3)
                } else {
                    (rest.chars().nth(1) == Some('\'')).then_some(2)
                };
                match close {
                    Some(n) => {
                        for _ in 0..n {
                            it.next();
                        }
                        out.push_str("''");
                    }
                    None => out.push('\''),
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// The name of the function that starts on this line of code, if one does.
fn fn_name(code: &str) -> Option<&str> {
    let mut s = code.trim_start();
    if let Some(r) = s.strip_prefix("pub") {
        s = match r.strip_prefix('(') {
            Some(r) => r.split_once(')')?.1,
            None => r,
        }
        .trim_start();
    }
    for kw in ["const ", "unsafe ", "extern \"\" "] {
        if let Some(r) = s.strip_prefix(kw) {
            s = r.trim_start();
        }
    }
    let r = s.strip_prefix("fn ")?;
    let end = r
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(r.len());
    (end > 0).then(|| &r[..end])
}

/// `(lines, first line, name)` of every function in `text`.
fn functions(text: &str) -> Vec<(usize, usize, String)> {
    let lines: Vec<String> = text.lines().map(code).collect();
    let mut found = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(name) = fn_name(l) else { continue };
        let (mut depth, mut started, mut j) = (0i64, false, i);
        while j < lines.len() {
            for c in lines[j].chars() {
                match c {
                    '{' => {
                        depth += 1;
                        started = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if (started && depth <= 0) || (!started && lines[j].trim_end().ends_with(';')) {
                break;
            }
            j += 1;
        }
        found.push((j - i + 1, i + 1, name.to_string()));
    }
    found
}

#[test]
fn the_count_sees_what_it_is_meant_to_see() {
    let text = "pub(crate) unsafe fn a(x: &str) -> char {\n    let b = \"}}\"; // }\n    let c = '{';\n    let d: &'static str = \"\";\n    c\n}\nfn decl();\nfn e() {}\n";
    let f = functions(text);
    assert_eq!(
        f,
        [
            (6, 1, "a".to_string()),
            (1, 7, "decl".to_string()),
            (1, 8, "e".to_string())
        ]
    );
}

#[test]
fn no_function_in_src_is_over_100_lines() {
    let src = std::env::var_os("ENGRAM_FN_LEN_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    assert!(files.len() > 50, "no sources under {}", src.display());
    let mut long = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line, name) in functions(&text) {
            if n > MAX_LINES {
                long.push(format!("{}:{line}: `{name}` is {n} lines", f.display()));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_LINES} lines (split them into named steps):\n{}",
        long.join("\n")
    );
}
