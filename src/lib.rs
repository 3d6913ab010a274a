//! engram: DeepSeek-V4.1's engram layer (n-gram hashed memory tables added
//! into the hyper-connection streams) for inference engines, behind a plain C
//! ABI (`include/engram.h`).
//!
//! The pipeline, one module a stage: [`hash`] (tables, per-sequence history,
//! the hash) -> rows ([`formats`]: row and weight formats, dequantisation) ->
//! projection -> gate, run by one of two [`backend`]s: [`cpu`] (host memory,
//! host threads) and [`cuda`] (the engine's device memory and stream).
//! [`batch`] holds every check on a call's inputs, [`context`] the object the
//! C ABI wraps, [`memory`] the engine's memory as the library receives it.
//! Loaders: [`tables`] (config.json + tokenizer.json), [`gguf`] (GGUF files
//! of every public dialect, split sets, and the loaded model contexts
//! borrow), [`safetensors`] (the released checkpoint); [`files`] opens every
//! file they read. [`ffi`] is the C boundary only.

pub mod backend;
pub mod batch;
pub mod context;
pub mod cpu;
/// cbindgen:ignore
pub mod cuda;
pub mod error;
pub mod ffi;
pub mod files;
pub mod formats;
pub mod gguf;
pub mod hash;
pub mod memory;
pub mod safetensors;
pub mod tables;

pub use backend::{EngramBackend, Highway, LayerIn, ReadBack, RowIds, TableIn, TableSource};
pub use batch::{Geometry, HighwayType, Limits};
pub use context::{Context, ContextConfig, Tuning};
pub use error::{EngramStatus, Error, Result};
pub use formats::{EngramType, WeightDtype, Weights};
pub use hash::{HashTables, HashTablesIn, ROW_ID_DEAD, TOKEN_DEAD};
pub use memory::{Region, RegionMut};
