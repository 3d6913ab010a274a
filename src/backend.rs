//! The one interface both backends implement, over inputs the context has
//! already validated ([`crate::batch`]): register a layer's weights, stage a
//! step's rows ahead of time, apply a layer, read back a layer's intermediate
//! results, and report errors found asynchronously. The trait alone: the
//! data it passes are in [`crate::call`] (re-exported here), and choosing
//! and constructing a backend is the context's ([`crate::context`]).

use crate::call::LiveIds;
pub use crate::call::{
    ApplyIn, BackendInfo, CheckedLayer, DecodeStats, DevValues, DeviceCacheStats, DeviceHashIn,
    DeviceSeqOp, EngramBackend, Highway, Ids, LayerIn, ReadBack, RowIds, StageStats, Stream,
    TableIn, TableSource,
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

    /// Keep up to `bytes` of each host-table layer's rows in device memory
    /// (`device_cache_bytes`, set before any layer), replaced by `policy`.
    /// The CPU backend ignores it (its tables are read in place).
    fn set_device_cache(&mut self, bytes: u64, policy: PolicyKind) -> Result<()> {
        let _ = (bytes, policy);
        Ok(())
    }

    /// `exact`: a GGUF-block `wkv` gives the bits of its f32 twin (an f32
    /// `wkv` holding its dequantised values); otherwise the CPU backend may
    /// use integer dot products within docs/numerics.md's bound ("Integer
    /// dot products"). The CUDA backend ignores it (its quantised paths are
    /// held to their own bound, docs/testing.md).
    fn set_exact_quant(&mut self, exact: bool) {
        let _ = exact;
    }

    /// Layer `li`'s device row cache counts, where it has one.
    fn device_cache_stats(&self, li: usize) -> Option<DeviceCacheStats> {
        let _ = li;
        None
    }

    /// Zero every layer's device row cache counts.
    fn device_cache_stats_reset(&self) {}

    /// Apply layer `li` (whose weights are set).
    fn apply(&self, li: usize, call: ApplyIn<'_>) -> Result<()>;

    /// Layer `li`'s rows and `kv` for a call's tokens (slow; synchronous).
    fn read_back(&self, li: usize, ids: Ids<'_>, n: usize) -> Result<ReadBack>;

    /// The split points (docs/sharding.md): rows `ids` of layer `li`'s table
    /// as this backend holds it (a shard's ids are local to its part),
    /// dequantised to bf16, `[ids.len(), Hd]`. `Err((j, e))` inside: id `j`
    /// failed to dequantise. The CPU backend only.
    fn gather_held(&self, li: usize, ids: &[i64]) -> Result<Vec<u16>> {
        let _ = (li, ids);
        bail!(
            ErrUnsupported,
            "the split calls (engram_gather_rows, engram_kv_columns, engram_gate_from_kv, \
             engram_apply_rows) run on the CPU backend only"
        )
    }

    /// `kv` (bf16 values held as f32, `[n, hi - lo]`) for outputs `[lo, hi)`
    /// of layer `li`'s `wkv` as this backend holds it, from `rows` (`[n,
    /// C*Hd]` bf16). The CPU backend only.
    fn project_held(
        &self,
        li: usize,
        rows: &[u16],
        n: usize,
        lo: usize,
        hi: usize,
    ) -> Result<Vec<f32>> {
        let _ = (li, rows, n, lo, hi);
        bail!(
            ErrUnsupported,
            "the split calls run on the CPU backend only"
        )
    }

    /// The gate and the highway update of layer `li` from `kv` (`[tokens.len(),
    /// D*(hc+1)]`, bf16 values held as f32) for the live `tokens`. The CPU
    /// backend only.
    fn gate_held(
        &self,
        li: usize,
        tokens: &[usize],
        kv: &[f32],
        highway: crate::memory::RegionMut<'_>,
        ty: crate::batch::HighwayType,
    ) -> Result<()> {
        let _ = (li, tokens, kv, highway, ty);
        bail!(
            ErrUnsupported,
            "the split calls run on the CPU backend only"
        )
    }

    /// The split points on device memory (the CUDA backend), queued on
    /// `stream`: cell `j` of `out` (`[cells.len(), Hd]`) is the row of local
    /// id `cells[j]` of layer `li`'s held table, or `-0.0` where it is -1.
    fn gather_device(
        &self,
        li: usize,
        cells: &[i64],
        out: DevValues,
        stream: Stream,
    ) -> Result<()> {
        let _ = (li, cells, out, stream);
        bail!(
            ErrUnsupported,
            "the split calls on device memory need the CUDA backend"
        )
    }

    /// `kv` outputs `[lo, hi)` of the `wkv` layer `li` holds (`kv`: `[n, hi -
    /// lo]`) from `n` tokens' `rows` (`[n, C*Hd]`), on device memory.
    fn project_device(
        &self,
        li: usize,
        n: usize,
        rows: DevValues,
        lohi: (usize, usize),
        kv: DevValues,
        stream: Stream,
    ) -> Result<()> {
        let _ = (li, n, rows, lohi, kv, stream);
        bail!(
            ErrUnsupported,
            "the split calls on device memory need the CUDA backend"
        )
    }

    /// The gate and the highway update (`highway`: a device address and its
    /// type) of layer `li` for the `live` of `n` tokens: from an assembled
    /// `kv` (`[n, D*(hc+1)]`, `from_rows == false`) or from assembled rows
    /// (`[n, C*Hd]`, projected through the whole `wkv` first), on device
    /// memory.
    #[allow(clippy::too_many_arguments)]
    fn gate_device(
        &self,
        li: usize,
        n: usize,
        live: &[usize],
        values: DevValues,
        from_rows: bool,
        highway: (u64, crate::batch::HighwayType),
        stream: Stream,
    ) -> Result<()> {
        let _ = (li, n, live, values, from_rows, highway, stream);
        bail!(
            ErrUnsupported,
            "the split calls on device memory need the CUDA backend"
        )
    }

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
