//! engram: DeepSeek-V4.1's engram layer (n-gram hashed memory tables added
//! into the hyper-connection streams) for inference engines, behind a plain C
//! ABI (`include/engram.h`).
//!
//! The core is plain safe Rust: [`hash`] (tables, per-sequence history, the
//! hash), [`formats`] (row and weight formats, dequantisation), [`cpu`]
//! (gather, gate), [`projection`] (the `wkv` GEMM/GEMV) and [`context`] (the object the C ABI wraps).
//! [`ffi`] is the C boundary only.

pub mod context;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod ffi;
pub mod formats;
pub mod gguf;
pub mod hash;
pub mod prefetch;
pub mod projection;
pub mod tables;

pub use context::{Context, ContextConfig, EngramBackend, Geometry, Highway, LayerIn, TableIn};
pub use error::{EngramStatus, Error, Result};
pub use formats::{EngramType, RowFormat, WeightDtype, Weights};
pub use hash::{HashTables, HashTablesIn, Limits, ROW_ID_DEAD, TOKEN_DEAD};
