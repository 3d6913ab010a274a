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

// The crate's surface. The product is the C ABI (`include/engram.h`, the
// `#[no_mangle]` exports of `ffi`); its Rust form is `ffi` and the
// re-exports below. The modules only the crate uses are private, so that
// rustc reports what nothing calls. The others are `#[doc(hidden)] pub`
// because the tests, tools, benches or examples named beside each reach
// into them (no stability promise): keep that list current when a module's
// last outside user goes.

/// Tests: cuda_decode, cuda_host_tables (`TableIn`, `TableSource`, `DecodeStats`).
#[doc(hidden)]
pub mod backend;
/// Tests: properties (`Limits`).
#[doc(hidden)]
pub mod batch;
/// Tests: cuda_golden, device_hash; benches/gpu (`DeviceHashIn`, `DeviceSeqOp`).
#[doc(hidden)]
pub mod call;
mod context;
/// Tests: golden, gather, fp8_wkv, cpu_kernel_env, tests/common; benches/cpu
/// (`projection`, `stager`, `CpuTuning`).
#[doc(hidden)]
pub mod cpu;
/// cbindgen:ignore
/// Tests: cuda_*, device, device_hash, fp8_split, gguf_dialects,
/// simt_selftest, process_device; benches/gpu (the backend over the SIMT
/// emulator); tools: engram-emu (`set_process_device`, `emu`).
#[doc(hidden)]
pub mod cuda;
/// Tools: engram-inspect (`escape_text`).
#[doc(hidden)]
pub mod error;
mod fallible;
/// The C ABI in Rust form: every export, and the structs it takes.
pub mod ffi;
/// Tests: path_rule (`force_walk`, the fallback walk forced on one thread).
#[doc(hidden)]
pub mod files;
/// Tests and benches throughout (conversions, dequantisation, `Fp8Blocks`).
#[doc(hidden)]
pub mod formats;
mod fpmode;
/// Tests: gguf_*, file_memory, file_safety, hostile; tools: engram-inspect.
#[doc(hidden)]
pub mod gguf;
/// Tests: v41_hash, cpu_kernel_env, cuda_*; benches; examples/hash_profile.
#[doc(hidden)]
pub mod hash;
/// Tests: cuda_fp8_wkv, cuda_host_tables, cuda_streams (`Region`).
#[doc(hidden)]
pub mod memory;
/// cbindgen:ignore
/// Tests: row_cache; tools: engram-replay (the policies, `policy`).
#[doc(hidden)]
pub mod rowcache;
/// cbindgen:ignore
/// Tests: rowio; benches/disk (`RowReader`, `probe`).
#[doc(hidden)]
pub mod rowio;
/// Tests: file_memory, hostile, json_peak (`parse_header`, `read`).
#[doc(hidden)]
pub mod safetensors;
/// Tests: tables_*, gguf_*, file_memory, json_peak; tools: engram-tables.
#[doc(hidden)]
pub mod tables;

pub use batch::{Geometry, Limits};
pub use call::{
    DeviceCacheStats, EngramBackend, Highway, HighwayType, LayerIn, ReadBack, RowIds, TableIn,
    TableSource,
};
pub use context::{Context, ContextConfig, ShardSpec, SplitIn, SplitOut, Tuning};
pub use error::{EngramStatus, Error, Result};
pub use formats::{EngramType, WeightDtype, Weights};
pub use hash::{HashTables, HashTablesIn, ROW_ID_DEAD, TOKEN_DEAD};
pub use memory::{Region, RegionMut};
