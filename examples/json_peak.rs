//! Parse one JSON input the way the loaders do, for measuring its peak
//! memory (docs/file-safety.md):
//!
//!     /usr/bin/time -v target/release/examples/json_peak KIND FILE
//!
//! KIND: `safetensors` (a shard's header), `tokenizer` (tokenizer.json),
//! `config` (config.json) or `index` (model.safetensors.index.json, read
//! from a checkpoint directory FILE with no shards: the parse runs, the load
//! then stops). Prints the status and what was parsed.

use std::path::Path;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    let (Some(kind), Some(file)) = (a.get(1), a.get(2)) else {
        eprintln!("usage: json_peak safetensors|tokenizer|config|index FILE");
        std::process::exit(2);
    };
    let p = Path::new(file);
    let r: Result<String, engram::Error> = match kind.as_str() {
        "safetensors" => std::fs::File::open(p)
            .map_err(|e| engram::Error::new(engram::EngramStatus::ErrIo, e.to_string()))
            .and_then(|f| {
                let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                engram::safetensors::parse_header(&f, len, file)
            })
            .map(|h| format!("{} tensors", h.tensors.len())),
        "tokenizer" => {
            engram::tables::tokenizer::load(p).map(|t| format!("{} tokens", t.get_vocab_size(true)))
        }
        "config" => engram::tables::EngramConfig::from_file(p)
            .map(|c| format!("{} engram layers", c.layer_ids.len())),
        "index" => engram::safetensors::read(p, None, None).map(|_| "read".to_string()),
        k => {
            eprintln!("unknown kind {k}");
            std::process::exit(2);
        }
    };
    match r {
        Ok(s) => println!("ok: {s}"),
        Err(e) => println!("{:?}: {}", e.status, e.message),
    }
}
