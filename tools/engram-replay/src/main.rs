//! engram-replay: real text -> DeepSeek-V4.1 tokens -> the library's engram
//! row ids -> decode-order replays through the library's row-cache policies
//! and an mmap page-cache model (issue 35 item 5). `--help` for the options;
//! BENCHMARKS.md records the runs.

mod ids;
mod lru;
mod opts;
mod report;
mod run;
mod sim;
mod stream;
#[cfg(test)]
mod tests;

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

fn main() -> ExitCode {
    match opts::parse(std::env::args().skip(1)) {
        Ok(None) => {
            println!("{}", opts::USAGE);
            ExitCode::SUCCESS
        }
        Ok(Some(o)) => match run::run(&o) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("engram-replay: {e:#}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("engram-replay: {e:#}\n{}", opts::USAGE);
            ExitCode::from(2)
        }
    }
}

/// The files under `p` (itself if a file), recursively, in name order.
fn files_under(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let md = std::fs::metadata(p).with_context(|| p.display().to_string())?;
    if md.is_file() {
        out.push(p.to_path_buf());
        return Ok(());
    }
    if !md.is_dir() {
        bail!("{}: neither a file nor a directory", p.display());
    }
    let mut ents: Vec<PathBuf> = std::fs::read_dir(p)
        .with_context(|| p.display().to_string())?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    ents.sort();
    for e in ents {
        files_under(&e, out)?;
    }
    Ok(())
}

/// One input text: which input (PATH argument) it came from, its file.
pub struct Text {
    pub input: usize,
    pub path: String,
    pub body: String,
}

/// The texts: each input file one text (invalid UTF-8 replaced), stdin one;
/// in argument order, or with `round_robin` one text of each input in turn
/// (a mix of the inputs whatever `--max-tokens` keeps).
pub fn read_texts(inputs: &[String], round_robin: bool) -> Result<Vec<Text>> {
    let mut per: Vec<Vec<Text>> = Vec::new();
    let stdin = [String::from("-")];
    let inputs = if inputs.is_empty() {
        &stdin[..]
    } else {
        inputs
    };
    for (k, i) in inputs.iter().enumerate() {
        let mut v = Vec::new();
        if i == "-" {
            let mut b = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut b).context("stdin")?;
            v.push((PathBuf::from("-"), b));
        } else {
            let mut files = Vec::new();
            files_under(Path::new(i), &mut files)?;
            for f in files {
                let b = std::fs::read(&f).with_context(|| f.display().to_string())?;
                v.push((f, b));
            }
        }
        per.push(
            v.into_iter()
                .map(|(f, b)| Text {
                    input: k,
                    path: f.display().to_string(),
                    body: String::from_utf8_lossy(&b).into_owned(),
                })
                .collect(),
        );
    }
    if !round_robin {
        return Ok(per.into_iter().flatten().collect());
    }
    let mut its: Vec<_> = per.into_iter().map(|v| v.into_iter()).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        out.extend(its.iter_mut().filter_map(|it| it.next()));
        if out.len() == before {
            return Ok(out);
        }
    }
}
