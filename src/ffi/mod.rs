//! The C ABI (`include/engram.h`). It converts and checks pointers and
//! forwards to [`crate::Context`]; it holds no engram logic and does not know
//! which backend runs.
//!
//! The header is laid out by concept, not by file: `build.rs`'s `SECTIONS`
//! is its table of contents (version and statuses, types, creating a
//! context, the step, the history, information and threads, teardown), and
//! an export it does not place fails the build. The files below follow the
//! same concepts.
//!
//! - [`boundary`]: the one panic boundary every export's body runs in
//!   ([`ffi_boundary!`]), the calling thread's last error message, and the
//!   small helpers that turn C pointers into Rust values (the only `unsafe`
//!   of the ABI).
//! - [`context`]: contexts, layers, hashing, apply, read-back.
//! - [`checked`]: the step's calls with every buffer's length checked
//!   (`engram_apply_checked`, `_device_ids_checked`, `engram_read_back_checked`).
//! - [`history`]: the KV cache's history operations, sequence states, and
//!   the deprecated whole-sequence aliases (`engram_seq_copy`, `_drop`).
//! - [`info`]: what a context says about itself; threads at run time.
//! - [`cache`]: table tiers and their statistics (the host row cache).
//! - [`tables`]: hash tables from `config.json` + `tokenizer.json`.
//! - [`gguf`]: a context straight from a GGUF file (any dialect, split sets).
//! - [`safetensors`]: a context straight from the released checkpoint.

// Private: the exports and their structs are re-exported below, the rest
// is the boundary's own.
#[macro_use]
mod boundary;
mod cache;
mod checked;
mod context;
mod gguf;
mod history;
mod info;
mod safetensors;
mod tables;

pub use boundary::{engram_last_error, engram_status_str, engram_version};
pub use cache::*;
pub use checked::*;
pub use context::*;
pub use gguf::*;
pub use history::*;
pub use info::*;
pub use safetensors::*;
pub use tables::*;
