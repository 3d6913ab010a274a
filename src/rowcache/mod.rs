//! The host row cache in front of a file-backed table: rows kept as stored
//! (their own bytes), in slots a replacement policy ([`policy`]) hands out.

pub mod policy;

pub use policy::{new_policy, Policy, PolicyKind};
