//! GGUF files: a bounds-checked header parser ([`parser`]), the engram
//! metadata and tensors ([`meta`]), and a context straight from a mapped file
//! ([`loader`]).

pub mod loader;
pub mod meta;
pub mod parser;

pub use loader::{GgufModel, GgufOptions};
pub use meta::{EngramModel, EngramTensors};
pub use parser::{ggml_type_size, vt_name, Gguf, Kv, TensorInfo, Value};
