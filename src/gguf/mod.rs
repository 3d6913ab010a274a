//! Loading models from files: a bounds-checked GGUF header parser
//! ([`parser`]), GGUF files and split sets ([`shards`]), the dialects of the
//! public converters ([`dialect`]), the one model description every loader
//! fills and its checks ([`meta`]), and the loaded model that contexts
//! borrow ([`loader`], also for the safetensors checkpoint of
//! [`crate::safetensors`]).

pub mod dialect;
pub mod loader;
pub mod meta;
pub mod parser;
pub mod shards;

pub use dialect::detect;
pub use loader::{GgufModel, GgufOptions, Inspected, LoadOptions, LoadedModel};
pub use meta::{validate, Check, Dialect, EngramModel, EngramTensors, PadReading};
pub use parser::{ggml_type_size, vt_name, ArrayRef, Gguf, Kv, TensorInfo, Value};
pub use shards::GgufSet;
