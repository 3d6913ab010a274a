//! The one interface both backends implement, over inputs the context has
//! already validated ([`crate::batch`]): register a layer's weights, stage a
//! step's rows ahead of time, apply a layer, read back a layer's intermediate
//! results, and report errors found asynchronously. The trait alone: the
//! data it passes are in [`crate::call`] (re-exported here), and choosing
//! and constructing a backend is the context's ([`crate::context`]).

use crate::call::LiveIds;
pub use crate::call::{
    ApplyIn, BackendInfo, CheckedLayer, DecodeStats, DeviceHashIn, DeviceSeqOp, EngramBackend,
    Highway, Ids, LayerIn, ReadBack, RowIds, StageStats, Stream, TableIn, TableSource,
};
use crate::error::{bail, Result};
use crate::rowcache::{PolicyKind, TierStats};

/// A backend: where `apply` runs. Every method gets inputs the context has
/// checked; layers are numbered by their index among the engram layers.
pub trait Backend<'w>: Send + Sync {
    fn info(&self) -> BackendInfo;

    /// Whether `apply` takes row ids in device memory ([`Ids::Device`]).
    fn takes_device_ids(&self) -> bool {
        false
    }

    /// Register (or replace) layer `li`'s weights. Called with no `apply`
    /// of the context in flight on the host (the context's layer lock).
    fn set_layer(&self, li: usize, layer: CheckedLayer<'w>) -> Result<()>;

    /// Start gathering the rows of a step's live tokens of layer `li`
    /// (`engram_prefetch`); `apply` with the same ids then waits only for it.
    fn stage(&self, li: usize, live: &LiveIds) -> Result<()>;

    /// Put the rows of a step's tokens (host ids `all`, `[n, n_layers, C]`,
    /// `live` their checked live tokens) where a call with device row ids
    /// reads them, queued on `stream` (`engram_stage`: the CUDA backend copies
    /// a host table's rows to the device, for a captured graph to replay).
    /// Backends that read the table in place need nothing: by default it
    /// starts the gather as [`Backend::stage`] does.
    fn stage_device(
        &self,
        li: usize,
        all: &[i64],
        live: &LiveIds,
        n: usize,
        stream: Stream,
    ) -> Result<()> {
        let _ = (all, n, stream);
        self.stage(li, live)
    }

    /// Apply layer `li` (whose weights are set).
    fn apply(&self, li: usize, call: ApplyIn<'_>) -> Result<()>;

    /// Layer `li`'s rows and `kv` for a call's tokens (slow; synchronous).
    fn read_back(&self, li: usize, ids: Ids<'_>, n: usize) -> Result<ReadBack>;

    /// Wait for `stream` and report errors found asynchronously (CUDA).
    fn check(&self, stream: Stream) -> Result<()>;

    /// Layer `li`'s `q * k` (`[hc, D]` f32; its weights are set).
    fn gate_weights(&self, li: usize) -> Result<Vec<f32>>;

    /// Every file-backed table set from now on gets a host row cache of
    /// `per_layer` bytes of rows (0: none) under `policy`
    /// (docs/row-cache.md). By default: refused, the backend reads no file.
    fn set_row_cache(&self, per_layer: u64, policy: PolicyKind) -> Result<()> {
        let _ = (per_layer, policy);
        bail!(ErrUnsupported, "this backend keeps no row cache")
    }

    /// Layer `li`'s host row cache statistics (`None`: a backend without).
    fn host_cache_stats(&self, li: usize) -> Option<&TierStats> {
        let _ = li;
        None
    }

    /// Use at most `n >= 1` threads for one call from now on. A backend whose
    /// work runs elsewhere (the CUDA device) records nothing: by default `Ok`.
    fn set_threads(&self, n: usize) -> Result<()> {
        let _ = n;
        Ok(())
    }

    /// Keep the context's history on the device, `ring_len` positions per
    /// sequence (docs/device-hash.md); called once, at create.
    fn enable_device_hash(
        &mut self,
        tables: &crate::hash::HashTables,
        limits: crate::batch::Limits,
        ring_len: usize,
    ) -> Result<()> {
        let _ = (tables, limits, ring_len);
        bail!(
            ErrUnsupported,
            "a device history needs the CUDA backend (device_history = {ring_len})"
        )
    }

    /// Queue the hash of a batch in device memory over the device history.
    fn hash_device(&self, call: &DeviceHashIn) -> Result<()> {
        let _ = call;
        bail!(
            ErrUnsupported,
            "engram_hash_device needs the CUDA backend and a context created with device_history > 0"
        )
    }

    /// Queue a range operation on the device history.
    fn seq_op_device(&self, op: DeviceSeqOp, stream: Stream) -> Result<()> {
        let _ = (op, stream);
        bail!(
            ErrUnsupported,
            "the engram_seq_*_device calls need the CUDA backend and a context created with \
             device_history > 0"
        )
    }

    /// The written positions of `seq`'s device history and their entries,
    /// once `stream`'s queued work has run.
    fn seq_entries_device(&self, seq: i32, stream: Stream) -> Result<Vec<(usize, i32)>> {
        let _ = (seq, stream);
        bail!(
            ErrUnsupported,
            "engram_seq_state_*_device need the CUDA backend and a context created with \
             device_history > 0"
        )
    }

    /// Replace `seq`'s device history with `entries`, once `stream`'s
    /// queued work has run.
    fn seq_load_device(&self, seq: i32, entries: &[(usize, i32)], stream: Stream) -> Result<()> {
        let _ = (seq, entries, stream);
        bail!(
            ErrUnsupported,
            "engram_seq_state_read_device needs the CUDA backend and a context created with \
             device_history > 0"
        )
    }
}
