//! engram: DeepSeek-V4.1's engram layer (n-gram hashed memory tables added
//! into the hyper-connection streams) for inference engines, behind a plain C
//! ABI (`include/engram.h`).
//!
//! The pipeline, one module a stage: [`hash`] (tables, per-sequence history,
//! the hash) -> rows ([`formats`]: row and weight formats, dequantisation) ->
//! projection -> gate, run by one of two [`backend`]s: [`cpu`] (host memory,
//! host threads) and [`cuda`] (the engine's device memory and stream).
//! [`call`] holds the plain data a call is made of, [`batch`] every check on
//! it, [`context`] the object the C ABI wraps (it chooses the backend),
//! [`memory`] the engine's memory as the library receives it, [`fallible`]
//! the allocations sized by a caller or a file. `tests/imports.rs` keeps
//! the modules layered: no import cycle, nothing below [`backend`] naming a
//! backend.
//! Loaders: [`tables`] (config.json + tokenizer.json), [`gguf`] (GGUF files
//! of every public dialect, split sets, and the loaded model contexts
//! borrow), [`safetensors`] (the released checkpoint); [`files`] opens every
//! file they read. [`ffi`] is the C boundary only.

pub mod backend;
pub mod batch;
pub mod call;
pub mod context;
pub mod cpu;
/// cbindgen:ignore
pub mod cuda;
pub mod error;
pub mod fallible;
pub mod ffi;
pub mod files;
pub mod formats;
pub(crate) mod fpmode;
pub mod gguf;
pub mod hash;
pub mod memory;
pub mod safetensors;
pub mod tables;

pub use batch::{Geometry, Limits};
pub use call::{
    EngramBackend, Highway, HighwayType, LayerIn, ReadBack, RowIds, TableIn, TableSource,
};
pub use context::{Context, ContextConfig, Tuning};
pub use error::{EngramStatus, Error, Result};
pub use formats::{EngramType, WeightDtype, Weights};
pub use hash::{HashTables, HashTablesIn, ROW_ID_DEAD, TOKEN_DEAD};
pub use memory::{Region, RegionMut};
