//! The host row cache in front of a file-backed table (docs/row-cache.md):
//! rows kept as stored (their own bytes), in slots a replacement policy
//! ([`policy`]) hands out, in shards by row id ([`cache`]), counted in
//! relaxed atomics a poller reads at any time ([`stats`]).

pub mod cache;
pub mod policy;
pub mod stats;

pub use cache::{Miss, RowCache};
pub use policy::{new_policy, Policy, PolicyKind};
pub use stats::{Snapshot, Tier, TierStats};

use crate::error::{bail, Result};

/// The policy a cache uses unless `ENGRAM_ROW_CACHE_POLICY` names another.
pub const DEFAULT_POLICY: PolicyKind = PolicyKind::S3Fifo;

/// The policy to use: `ENGRAM_ROW_CACHE_POLICY` (`lru`, `clock`, `s3fifo`)
/// when set, for measurement, else [`DEFAULT_POLICY`]. Another value is
/// `ErrInvalidConfig`.
pub fn policy_from_env() -> Result<PolicyKind> {
    match std::env::var("ENGRAM_ROW_CACHE_POLICY") {
        Err(_) => Ok(DEFAULT_POLICY),
        Ok(s) => match PolicyKind::parse(&s) {
            Some(k) => Ok(k),
            None => bail!(
                ErrInvalidConfig,
                "ENGRAM_ROW_CACHE_POLICY={:?}: not lru, clock or s3fifo",
                s
            ),
        },
    }
}
