//! The library's module layering, measured from the code: no cycle among
//! the files of `src/`, and every import between two top-level modules runs
//! down the layering in [`LAYERS`] (so nothing at or below `backend` names
//! `cpu` or `cuda`).
//!
//! How it counts. A node is a file of `src/` (`src/cpu/mod.rs` is module
//! `cpu`, `src/cpu/read.rs` is `cpu::read`). An edge runs from a file to the
//! file that holds what a path names, for every path that starts with
//! `crate::`, `$crate::`, `super::`, `self::` or a child module's name, in a
//! `use` item or anywhere in the code (comments and string literals are
//! skipped); the path goes to the longest prefix of it that is a file.
//! `mod x;` declares a child, it imports nothing.
//!
//! - A name a file re-exports with `pub use` (any visibility) is followed to
//!   the file that defines it: `crate::Context` is an edge to `context.rs`, not
//!   to `lib.rs`, and `crate::backend::LayerIn` one to where `LayerIn` is
//!   defined. The `pub use` itself is a signpost, not a use by the file's
//!   code: it counts for the layering (a re-export may point down, never up)
//!   but not for cycles.
//! - A module and the files it is split over (`cpu` and `cpu::read`: a child's
//!   `super::`, the parent's `read::`) are one module: a cycle made only of
//!   such parent-child ties is allowed; any cycle with another import in it
//!   (between siblings, across modules) fails.
//! - Test code (`#[cfg(test)]` modules, items and files) counts like any other
//!   code: a unit test that needs a higher module belongs in `tests/`.
//!
//! `ENGRAM_IMPORTS_SRC=/path/to/src` checks another tree (e.g. an old
//! checkout); `ENGRAM_IMPORTS_PRINT=1` prints every edge.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The top-level modules from the bottom up. A file may import modules of
/// its own layer and of the layers below; a cycle within a layer is caught by
/// the cycle check. `""` is the crate root (`lib.rs`).
const LAYERS: &[&[&str]] = &[
    // What every module may use: errors; allocations sized by a caller or a
    // file; the engine's memory, the row and weight formats, opening files,
    // direct batched reads of table rows from a file.
    &["error", "fpmode"],
    &["fallible"],
    &["memory", "formats", "files", "rowcache", "rowio"],
    // The plain data a call is made of (what a backend is given).
    &["call"],
    // Every check on a call's inputs (and the geometry and limits).
    &["batch"],
    // The hash: its tables, the per-sequence history (checked by `batch`).
    &["hash"],
    // The backend interface.
    &["backend"],
    // Its implementations (the CUDA backend stages host tables through the
    // CPU backend's stager).
    &["cpu"],
    &["cuda"],
    // Choosing and constructing a backend; the object the C ABI wraps.
    &["context"],
    // The loaders (they build contexts over what they load).
    &["tables", "gguf", "safetensors"],
    // The C boundary, then the crate root's re-exports.
    &["ffi"],
    &[""],
];

type Module = Vec<String>;

fn show(m: &[String]) -> String {
    if m.is_empty() {
        "crate".to_string()
    } else {
        m.join("::")
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// The tokens of a Rust source with their lines; comments, string, char and
/// number literals and lifetimes are dropped.
fn tokens(src: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    // Skip to past the closing quote of a string whose body starts at `i`.
    let skip_str = |mut i: usize, line: &mut usize| {
        while i < c.len() && c[i] != '"' {
            if c[i] == '\\' {
                i += 1;
            }
            if at(i) == '\n' {
                *line += 1;
            }
            i += 1;
        }
        i + 1
    };
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if ch == '"' {
            i = skip_str(i + 1, &mut line);
        } else if ch == '\'' {
            if at(i + 1) == '\\' {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label.
                i += 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
            }
        } else if ch.is_ascii_digit() {
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let s = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            let word: String = c[s..i].iter().collect();
            let raw_str = matches!(word.as_str(), "r" | "br" | "cr")
                && (at(i) == '"' || (at(i) == '#' && matches!(at(i + 1), '"' | '#')));
            if raw_str {
                let mut hashes = 0;
                while at(i) == '#' {
                    hashes += 1;
                    i += 1;
                }
                i += 1; // the opening quote
                loop {
                    if i >= c.len() {
                        break;
                    }
                    if c[i] == '"' && (1..=hashes).all(|h| at(i + h) == '#') {
                        i += 1 + hashes;
                        break;
                    }
                    if c[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            } else if matches!(word.as_str(), "b" | "c") && at(i) == '"' {
                i = skip_str(i + 1, &mut line);
            } else if word == "b" && at(i) == '\'' {
                // A byte literal: the char rule above reads it.
                continue;
            } else if word == "r" && at(i) == '#' {
                // A raw identifier `r#name`.
                i += 1;
                let s = i;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
                out.push((Tok::Ident(c[s..i].iter().collect()), line));
            } else {
                out.push((Tok::Ident(word), line));
            }
        } else if ch == ':' && at(i + 1) == ':' {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// One path a file names: its segments as written, its line, whether it is
/// test code, and, for a leaf of a `pub use`, the name it is exported as.
#[derive(Debug)]
struct Named {
    scope: Module,
    segs: Vec<String>,
    line: usize,
    test: bool,
    export: Option<String>,
}

#[derive(Debug, Default)]
struct Parsed {
    named: Vec<Named>,
    /// `mod x;` declarations and whether they are `#[cfg(test)]`.
    children: Vec<(String, bool)>,
    /// `#![cfg(test)]` at the top of the file.
    inner_test: bool,
}

fn ident(t: Option<&(Tok, usize)>) -> Option<&str> {
    match t {
        Some((Tok::Ident(s), _)) => Some(s),
        _ => None,
    }
}

fn is_punct(t: Option<&(Tok, usize)>, p: char) -> bool {
    matches!(t, Some((Tok::Punct(q), _)) if *q == p)
}

/// A `use` tree at `toks[*i]`: its leaves (full segments, and the alias or
/// `None` for a glob) appended to `out`.
fn use_tree(
    toks: &[(Tok, usize)],
    i: &mut usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, Option<String>)>,
) {
    let mut segs = prefix.to_vec();
    if matches!(toks.get(*i), Some((Tok::Path, _))) {
        *i += 1; // a leading `::`
    }
    loop {
        match toks.get(*i) {
            Some((Tok::Ident(s), _)) if s != "as" => {
                segs.push(s.clone());
                *i += 1;
            }
            Some((Tok::Punct('$'), _)) => *i += 1,
            Some((Tok::Punct('*'), _)) => {
                *i += 1;
                out.push((segs, None));
                return;
            }
            Some((Tok::Punct('{'), _)) => {
                *i += 1;
                loop {
                    match toks.get(*i) {
                        None => return,
                        Some((Tok::Punct('}'), _)) => {
                            *i += 1;
                            return;
                        }
                        Some((Tok::Punct(','), _)) => *i += 1,
                        _ => use_tree(toks, i, &segs, out),
                    }
                }
            }
            _ => break,
        }
        if matches!(toks.get(*i), Some((Tok::Path, _))) {
            *i += 1;
        } else {
            break;
        }
    }
    let mut name = segs.last().cloned();
    if segs.last().map(String::as_str) == Some("self") {
        segs.pop();
        name = segs.last().cloned();
    }
    if ident(toks.get(*i)) == Some("as") {
        name = ident(toks.get(*i + 1)).map(str::to_string);
        *i += 2;
    }
    out.push((segs, name));
}

/// Whether an attribute's tokens (between its brackets) are a `cfg` that
/// holds only under test.
fn cfg_test(attr: &[(Tok, usize)]) -> bool {
    let words: Vec<&str> = attr.iter().filter_map(|t| ident(Some(t))).collect();
    words.first() == Some(&"cfg") && words.contains(&"test") && !words.contains(&"not")
}

/// An open brace: whether it opened an inline module (`mod x { .. }`), and
/// whether its contents are test code.
struct Brace {
    module: Option<String>,
    test: bool,
}

fn parse(module: &[String], src: &str) -> Parsed {
    let toks = tokens(src);
    let mut p = Parsed::default();
    let mut braces: Vec<Brace> = Vec::new();
    // `#[cfg(test)]` seen, waiting for its item.
    let mut pending_test = false;
    // The item a `#[cfg(test)]` applies to: the brace depth where it began.
    let mut test_item: Option<usize> = None;
    let mut i = 0;
    while i < toks.len() {
        let scope: Module = module
            .iter()
            .cloned()
            .chain(braces.iter().filter_map(|b| b.module.clone()))
            .collect();
        let in_test = braces.iter().any(|b| b.test) || test_item.is_some();
        let tok = &toks[i];
        match &tok.0 {
            Tok::Punct('#') => {
                let inner = is_punct(toks.get(i + 1), '!');
                let open = if inner { i + 2 } else { i + 1 };
                if is_punct(toks.get(open), '[') {
                    let mut depth = 0;
                    let mut j = open;
                    while j < toks.len() {
                        match toks[j].0 {
                            Tok::Punct('[') => depth += 1,
                            Tok::Punct(']') => {
                                depth -= 1;
                                if depth == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        j += 1;
                    }
                    if cfg_test(&toks[open + 1..j.min(toks.len())]) {
                        if inner && braces.is_empty() {
                            p.inner_test = true;
                        } else {
                            pending_test = true;
                        }
                    }
                    i = j + 1;
                    continue;
                }
                i += 1;
            }
            Tok::Punct('{') => {
                let mut b = Brace {
                    module: None,
                    test: false,
                };
                // `mod name {`
                if i >= 2 && ident(toks.get(i - 2)) == Some("mod") {
                    b.module = ident(toks.get(i - 1)).map(str::to_string);
                }
                if test_item == Some(braces.len()) {
                    b.test = true;
                    test_item = None;
                }
                braces.push(b);
                i += 1;
            }
            Tok::Punct('}') => {
                braces.pop();
                i += 1;
            }
            Tok::Punct(';') => {
                if test_item == Some(braces.len()) {
                    test_item = None;
                }
                i += 1;
            }
            Tok::Ident(w) if w == "mod" => {
                if let (Some(name), true) = (ident(toks.get(i + 1)), is_punct(toks.get(i + 2), ';'))
                {
                    if braces.is_empty() {
                        p.children.push((name.to_string(), pending_test || in_test));
                    }
                }
                if pending_test {
                    test_item = Some(braces.len());
                    pending_test = false;
                }
                i += 1;
            }
            Tok::Ident(w) if w == "use" => {
                let public = i >= 1
                    && (ident(toks.get(i - 1)) == Some("pub") || is_punct(toks.get(i - 1), ')'));
                let test = pending_test || in_test;
                pending_test = false;
                let line = tok.1;
                i += 1;
                let mut leaves = Vec::new();
                use_tree(&toks, &mut i, &[], &mut leaves);
                for (segs, name) in leaves {
                    p.named.push(Named {
                        scope: scope.clone(),
                        segs,
                        line,
                        test,
                        export: if public {
                            name.or(Some("*".into()))
                        } else {
                            None
                        },
                    });
                }
            }
            Tok::Ident(w) => {
                // A path in the code: `crate::a::b`, `super::x`, `child::f`.
                let starts = !matches!(toks.get(i.wrapping_sub(1)), Some((Tok::Path, _)))
                    && matches!(toks.get(i + 1), Some((Tok::Path, _)));
                if starts && w != "Self" {
                    let mut segs = vec![w.clone()];
                    let mut j = i + 1;
                    while matches!(toks.get(j), Some((Tok::Path, _))) {
                        match ident(toks.get(j + 1)) {
                            Some(s) => segs.push(s.to_string()),
                            None => break,
                        }
                        j += 2;
                    }
                    p.named.push(Named {
                        scope: scope.clone(),
                        segs,
                        line: tok.1,
                        test: pending_test || in_test,
                        export: None,
                    });
                    i = j;
                } else {
                    if pending_test
                        && !matches!(w.as_str(), "pub" | "crate" | "super" | "in" | "self")
                    {
                        test_item = Some(braces.len());
                        pending_test = false;
                    }
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    p
}

struct File {
    path: PathBuf,
    parsed: Parsed,
}

struct Edge {
    from: Module,
    to: Module,
    line: usize,
    path: String,
    test: bool,
    /// A `pub use`: a signpost, not a use of the item by the file's code.
    reexport: bool,
}

struct Graph {
    files: BTreeMap<Module, File>,
    edges: Vec<Edge>,
}

fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap();
    let mut m: Module = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(m.last().map(String::as_str), Some("mod" | "lib")) {
        m.pop();
    }
    m
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

impl Graph {
    fn read(src: &Path) -> Graph {
        let mut paths = Vec::new();
        walk(src, &mut paths);
        let mut files = BTreeMap::new();
        for path in paths {
            let m = module_of(src, &path);
            let text = std::fs::read_to_string(&path).unwrap();
            let parsed = parse(&m, &text);
            files.insert(m, File { path, parsed });
        }
        let mut g = Graph {
            files,
            edges: Vec::new(),
        };
        g.link();
        g
    }

    /// A path as written in `scope` made absolute; `None` for an outside crate
    /// (or a local name).
    fn absolute(&self, scope: &[String], segs: &[String]) -> Option<Vec<String>> {
        let first = segs.first()?;
        let mut abs: Vec<String> = match first.as_str() {
            "crate" => Vec::new(),
            "self" => scope.to_vec(),
            "super" => {
                let mut s = scope.to_vec();
                let mut k = 0;
                while segs.get(k).map(String::as_str) == Some("super") {
                    s.pop()?;
                    k += 1;
                }
                s.extend(segs[k..].iter().cloned());
                return Some(s);
            }
            _ => {
                let mut child = scope.to_vec();
                child.push(first.clone());
                if self.files.contains_key(&child) {
                    return Some(child.into_iter().chain(segs[1..].iter().cloned()).collect());
                }
                return None;
            }
        };
        abs.extend(segs[1..].iter().cloned());
        Some(abs)
    }

    /// The file holding what absolute path `abs` names: its longest prefix
    /// that is a file, through that file's re-exports.
    fn resolve(&self, abs: &[String], hops: usize) -> Module {
        let k = (0..=abs.len())
            .rev()
            .find(|&k| self.files.contains_key(&abs[..k]))
            .unwrap_or(0);
        let file = abs[..k].to_vec();
        if let (Some(name), true) = (abs.get(k), hops < 16) {
            for n in &self.files[&file].parsed.named {
                if n.export.as_deref() == Some(name.as_str()) {
                    if let Some(target) = self.absolute(&n.scope, &n.segs) {
                        let rest = target.into_iter().chain(abs[k + 1..].iter().cloned());
                        return self.resolve(&rest.collect::<Vec<_>>(), hops + 1);
                    }
                }
            }
        }
        file
    }

    fn link(&mut self) {
        // A file is test code when its `mod` is `#[cfg(test)]` (or a test
        // file's) or it says `#![cfg(test)]`.
        let mut test_files = BTreeSet::new();
        for (m, f) in &self.files {
            if f.parsed.inner_test {
                test_files.insert(m.clone());
            }
        }
        let mut changed = true;
        while changed {
            changed = false;
            for (m, f) in &self.files {
                for (child, test) in &f.parsed.children {
                    let mut c = m.clone();
                    c.push(child.clone());
                    if (*test || test_files.contains(m)) && test_files.insert(c) {
                        changed = true;
                    }
                }
            }
        }
        let mut edges = Vec::new();
        for (m, f) in &self.files {
            for n in &f.parsed.named {
                let Some(abs) = self.absolute(&n.scope, &n.segs) else {
                    continue;
                };
                let to = self.resolve(&abs, 0);
                if &to != m {
                    edges.push(Edge {
                        from: m.clone(),
                        to,
                        line: n.line,
                        path: n.segs.join("::"),
                        test: n.test || test_files.contains(m),
                        reexport: n.export.is_some(),
                    });
                }
            }
        }
        self.edges = edges;
    }

    fn rel(&self, m: &Module) -> String {
        self.files[m].path.display().to_string()
    }

    /// The strongly connected components of more than one file (Tarjan).
    fn cycles(&self) -> Vec<Vec<Module>> {
        let nodes: Vec<&Module> = self.files.keys().collect();
        let index_of: BTreeMap<&Module, usize> =
            nodes.iter().enumerate().map(|(i, m)| (*m, i)).collect();
        let mut adj = vec![BTreeSet::new(); nodes.len()];
        for e in self.edges.iter().filter(|e| !e.reexport) {
            adj[index_of[&e.from]].insert(index_of[&e.to]);
        }
        struct T<'a> {
            adj: &'a [BTreeSet<usize>],
            index: Vec<Option<usize>>,
            low: Vec<usize>,
            on: Vec<bool>,
            stack: Vec<usize>,
            next: usize,
            out: Vec<Vec<usize>>,
        }
        fn visit(t: &mut T<'_>, v: usize) {
            t.index[v] = Some(t.next);
            t.low[v] = t.next;
            t.next += 1;
            t.stack.push(v);
            t.on[v] = true;
            for &w in t.adj[v].iter() {
                match t.index[w] {
                    None => {
                        visit(t, w);
                        t.low[v] = t.low[v].min(t.low[w]);
                    }
                    Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                    _ => {}
                }
            }
            if Some(t.low[v]) == t.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = t.stack.pop().unwrap();
                    t.on[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    t.out.push(comp);
                }
            }
        }
        let n = nodes.len();
        let mut t = T {
            adj: &adj,
            index: vec![None; n],
            low: vec![0; n],
            on: vec![false; n],
            stack: Vec::new(),
            next: 0,
            out: Vec::new(),
        };
        for v in 0..n {
            if t.index[v].is_none() {
                visit(&mut t, v);
            }
        }
        t.out
            .into_iter()
            .map(|c| {
                let mut c: Vec<Module> = c.into_iter().map(|i| nodes[i].clone()).collect();
                c.sort();
                c
            })
            // A module and the files it is split over may use each other.
            .filter(|c| {
                self.edges.iter().any(|e| {
                    !e.reexport
                        && c.contains(&e.from)
                        && c.contains(&e.to)
                        && !family(&e.from, &e.to)
                })
            })
            .collect()
    }
}

/// Whether one of `a`, `b` is a module and the other a file directly inside
/// it (`cpu` and `cpu::read`; not the crate root and a top-level module).
fn family(a: &Module, b: &Module) -> bool {
    let inside =
        |p: &Module, c: &Module| !p.is_empty() && c.len() == p.len() + 1 && c.starts_with(p);
    inside(a, b) || inside(b, a)
}

fn layer(top: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&top))
}

fn top(m: &Module) -> &str {
    m.first().map(String::as_str).unwrap_or("")
}

/// Every breach of the rules in the tree at `src`, described.
fn breaches(src: &Path) -> Vec<String> {
    let g = Graph::read(src);
    let mut out = Vec::new();
    if std::env::var_os("ENGRAM_IMPORTS_PRINT").is_some() {
        for e in &g.edges {
            println!(
                "{} -> {} ({}:{}: {}{})",
                show(&e.from),
                show(&e.to),
                g.rel(&e.from),
                e.line,
                e.path,
                if e.test { ", test" } else { "" }
            );
        }
    }
    for m in g.files.keys() {
        if layer(top(m)).is_none() {
            out.push(format!(
                "{} ({}) is in no layer: add `{}` to LAYERS in tests/imports.rs",
                show(m),
                g.rel(m),
                top(m)
            ));
        }
    }
    for comp in g.cycles() {
        let mut s = format!(
            "a cycle of {} files: {}\n  its imports:",
            comp.len(),
            comp.iter().map(|m| g.rel(m)).collect::<Vec<_>>().join(", ")
        );
        let mut seen = BTreeSet::new();
        for e in &g.edges {
            if !e.reexport
                && comp.contains(&e.from)
                && comp.contains(&e.to)
                && seen.insert((&e.from, &e.to))
            {
                let _ = write!(
                    s,
                    "\n    {} -> {} ({}:{}: {})",
                    show(&e.from),
                    show(&e.to),
                    g.rel(&e.from),
                    e.line,
                    e.path
                );
            }
        }
        out.push(s);
    }
    let mut seen = BTreeSet::new();
    for e in &g.edges {
        let (from, to) = (top(&e.from), top(&e.to));
        if let (Some(lf), Some(lt)) = (layer(from), layer(to)) {
            if lt > lf && seen.insert((&e.from, &e.to)) {
                out.push(format!(
                    "{}:{}: `{}` imports `{}` ({}), a layer above it{}",
                    g.rel(&e.from),
                    e.line,
                    show(&e.from),
                    e.path,
                    show(&e.to),
                    if matches!(to, "cpu" | "cuda") && lf <= layer("backend").unwrap() {
                        ": a module at or below `backend` never names a backend"
                    } else {
                        ""
                    }
                ));
            }
        }
    }
    out
}

#[test]
fn no_import_cycle_and_imports_run_down_the_layers() {
    let src = std::env::var_os("ENGRAM_IMPORTS_SRC")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let b = breaches(&src);
    assert!(
        b.is_empty(),
        "the module layering of {} is broken ({} findings):\n{}",
        src.display(),
        b.len(),
        b.join("\n")
    );
}

// ---- the checker's own tests, on small trees ----

fn tree(files: &[(&str, &str)]) -> tempdir::Dir {
    let d = tempdir::Dir::new();
    for (path, text) in files {
        let p = d.0.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    d
}

mod tempdir {
    pub struct Dir(pub std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "engram-imports-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

#[test]
fn a_cycle_through_nested_use_trees_is_found() {
    let d = tree(&[
        ("lib.rs", "pub mod batch; pub mod backend;"),
        (
            "batch.rs",
            "use crate::{error::Result, backend::{self, Layer}};",
        ),
        (
            "backend.rs",
            "pub fn f() -> crate::batch::Shape { todo!() }",
        ),
    ]);
    let b = breaches(&d.0);
    assert!(b.iter().any(|s| s.contains("a cycle of 2 files")), "{b:?}");
    // batch sits below backend: the import is also against the layering.
    assert!(
        b.iter().any(|s| s.contains("imports `crate::backend`")),
        "{b:?}"
    );
}

#[test]
fn naming_a_backend_below_backend_is_found() {
    let d = tree(&[
        ("lib.rs", "pub mod batch; pub mod cuda;"),
        ("batch.rs", "fn f(_: &dyn crate::cuda::gpu::Gpu) {}"),
        ("cuda/mod.rs", "pub mod gpu;"),
        ("cuda/gpu.rs", "pub trait Gpu {}"),
    ]);
    let b = breaches(&d.0);
    assert!(
        b.iter().any(|s| s.contains("batch.rs:1")
            && s.contains("crate::cuda::gpu::Gpu")
            && s.contains("never names a backend")),
        "{b:?}"
    );
}

#[test]
fn re_exports_lead_to_the_origin_and_comments_and_strings_do_not_count() {
    let d = tree(&[
        (
            "lib.rs",
            "pub mod error; pub mod call; pub mod backend;\npub use backend::Layer;\npub use error::Status;",
        ),
        ("error.rs", "pub enum Status {}"),
        ("call.rs", "pub struct Layer; fn f() -> crate::Status { todo!() }"),
        (
            "backend.rs",
            "pub use crate::call::Layer;\n// crate::cpu::X\n/* crate::cuda::Y */\nconst S: &str = \"crate::cpu\";\nconst R: &str = r#\"crate::cuda\"#;",
        ),
    ]);
    let b = breaches(&d.0);
    assert!(b.is_empty(), "{b:?}");
}

#[test]
fn super_and_child_paths_and_test_modules_count() {
    let d = tree(&[
        ("lib.rs", "pub mod cpu; pub mod context;"),
        ("context.rs", "pub struct Context;"),
        ("cpu/mod.rs", "mod read;\npub fn f() { read::g() }"),
        (
            "cpu/read.rs",
            "pub fn g() {}\n#[cfg(test)]\nmod tests {\n    use super::super::f;\n}",
        ),
    ]);
    let g = Graph::read(&d.0);
    let edges: Vec<String> = g
        .edges
        .iter()
        .map(|e| format!("{} -> {} {} {}", show(&e.from), show(&e.to), e.line, e.test))
        .collect();
    // `read::g` from the parent, and `super::super::f` from the test module
    // inside `cpu::read`, which is `cpu` again.
    assert_eq!(
        edges,
        ["cpu -> cpu::read 2 false", "cpu::read -> cpu 4 true"]
    );
    // A parent and its child may use each other.
    let b = breaches(&d.0);
    assert!(b.is_empty(), "{b:?}");
    // Two siblings that use each other (through their parent) are a cycle.
    let d = tree(&[
        ("lib.rs", "pub mod cpu;"),
        ("cpu/mod.rs", "mod read; mod stager;"),
        ("cpu/read.rs", "use super::stager::Source;"),
        (
            "cpu/stager.rs",
            "pub struct Source; fn f() { super::read::g() }",
        ),
    ]);
    let b = breaches(&d.0);
    assert!(
        b.iter().any(|s| s.contains("a cycle of 2 files")
            && s.contains("cpu::read -> cpu::stager")
            && s.contains("cpu::stager -> cpu::read")),
        "{b:?}"
    );
    // A test that reaches above its layer is counted too.
    let d = tree(&[
        ("lib.rs", "pub mod cpu; pub mod context;"),
        ("context.rs", "pub struct Context;"),
        (
            "cpu/mod.rs",
            "#[cfg(test)]\nfn t(c: crate::context::Context) { let _ = c; }",
        ),
    ]);
    let b = breaches(&d.0);
    assert!(
        b.iter()
            .any(|s| s.contains("cpu/mod.rs:2") && s.contains("a layer above it")),
        "{b:?}"
    );
}
