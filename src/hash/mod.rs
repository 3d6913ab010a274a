//! The n-gram hash (SPEC section 1, steps 1-3): the tables, the per-sequence
//! history, the division-free modulo, and the primes. Pure integer code with
//! no backend knowledge.

pub mod history;
pub mod primes;
pub mod reduce;
pub mod tables;

pub use crate::call::ROW_ID_DEAD;
pub use history::History;
pub use primes::{derive_offsets, derive_primes, derive_primes_uniform, is_prime};
pub use reduce::{rem_fast, Run};
pub use tables::{HashTables, HashTablesIn};

/// Token id that marks a dead position explicitly (a position fed by an
/// embedding instead of a token id, an image token, ...). It hashes like a
/// token whose `token_map` entry is `-1`.
pub const TOKEN_DEAD: i32 = -1;

/// History entry for a position that was never hashed.
const UNSET: i32 = i32::MIN;
