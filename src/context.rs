//! The engram context: the validated hash tables, the per-sequence history,
//! and a backend, which it chooses and constructs ([`open`]). Every call is
//! checked here ([`crate::batch`]) before the backend sees it, so both
//! backends refuse the same inputs with the same messages. Safe Rust; the
//! Rust tests drive it directly.

use crate::backend::Backend;
use crate::batch::{check_layer, layer_index, live_ids, Geometry, Limits, Shape};
use crate::call::{
    ApplyIn, BackendInfo, CheckedLayer, DeviceHashIn, DeviceSeqOp, EngramBackend, Highway, Ids,
    LayerIn, ReadBack, RowIds, Stream,
};
use crate::cpu::{CpuBackend, CpuTuning};
use crate::cuda::{CudaBackend, CudaTuning};
use crate::error::{bail, Result};
use crate::fallible::try_vec_with;
use crate::hash::history::StateKey;
use crate::hash::{HashTables, HashTablesIn, History};
use crate::rowcache::{Snapshot, Tier};
use std::sync::{Mutex, RwLock};

mod shard;
mod shard_device;
pub use shard::{split_type, wkv_part, ShardSpec, SplitIn, SplitOut};

/// Choices that tests and benchmarks make; engines keep the defaults. Each
/// backend owns its part; the context hands it over unread.
#[derive(Clone, Debug, Default)]
pub struct Tuning {
    /// The CPU backend's ([`CpuTuning`]: its projection kernel).
    pub cpu: CpuTuning,
    /// The CUDA backend's ([`CudaTuning`]: its GEMV threshold, the device
    /// object to run on).
    pub cuda: CudaTuning,
}

/// Everything `Context::new` needs.
pub struct ContextConfig<'a> {
    pub geometry: Geometry,
    pub tables: HashTablesIn<'a>,
    pub limits: Limits,
    /// Threads the CPU backend may use for one call (0 means 1).
    pub n_threads: usize,
    /// `EngramBackend` as its C number.
    pub backend: u32,
    /// The CUDA device ordinal (ignored by the CPU backend).
    pub device: i32,
    pub tuning: Tuning,
}

/// What the context knows of a registered layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    /// Rows of the layer's table.
    pub rows: u64,
    pub table_type: crate::formats::EngramType,
    pub wkv_type: crate::formats::EngramType,
    pub qk_type: crate::formats::EngramType,
    /// The table rows this context holds, `[begin, end)` of `rows`
    /// (`[0, rows)` unless it is a shard: [`Context::set_shard`]).
    pub held_rows: (u64, u64),
    /// The `wkv` outputs it holds, `[begin, end)` of `D*(hc+1)`.
    pub held_outs: (usize, usize),
    /// Bytes of the held rows of the table (codes and, split fp8, scales)
    /// and of the held outputs of `wkv` (and its block scales).
    pub held_bytes: (u64, u64),
}

pub struct Context<'w> {
    shape: Shape,
    tables: HashTables,
    limits: Limits,
    history: Mutex<History>,
    /// Held for reading by `apply`, `prefetch` and `read_back`, for writing
    /// by `set_layer`: a layer is never replaced under a call that uses it.
    layers: RwLock<Vec<Option<LayerInfo>>>,
    backend: Box<dyn Backend<'w> + 'w>,
    /// What a sequence state is checked against (the tables' fingerprint).
    state_key: StateKey,
    /// Threads the backend uses for one call, as last set.
    n_threads: Mutex<usize>,
    /// The history is on the device (`with_device_history`): the host hash
    /// and its sequence operations are refused.
    device_history: bool,
    /// The backend's kind (the split calls take host or device memory by it).
    kind: EngramBackend,
    /// Each set layer as the engine gave it, whole (a shard holds a part of
    /// it: [`Context::set_shard`] cuts it again). Guarded by `layers`' lock.
    whole: Mutex<Vec<Option<CheckedLayer<'w>>>>,
    /// Which part of every layer this context holds.
    shard: Mutex<shard::ShardSpec>,
}

/// The backend `kind` for a context of `shape`.
fn open<'w>(
    kind: EngramBackend,
    cfg: &ContextConfig<'_>,
    shape: Shape,
    tables: &HashTables,
) -> Result<Box<dyn Backend<'w> + 'w>> {
    Ok(match kind {
        EngramBackend::Cpu => Box::new(CpuBackend::new(shape, cfg.n_threads, &cfg.tuning.cpu)?),
        EngramBackend::Cuda => Box::new(CudaBackend::new(
            cfg.device,
            shape,
            &tables.layer_ids,
            cfg.limits.max_tokens,
            &cfg.tuning.cuda,
        )?),
    })
}

impl<'w> Context<'w> {
    pub fn new(cfg: &ContextConfig<'_>) -> Result<Context<'w>> {
        let g = cfg.geometry;
        g.check()?;
        let kind = match cfg.backend {
            b if b == EngramBackend::Cpu as u32 => EngramBackend::Cpu,
            b if b == EngramBackend::Cuda as u32 => EngramBackend::Cuda,
            b => bail!(ErrUnsupported, "unknown backend {b}"),
        };
        cfg.limits.check()?;
        let tables = HashTables::new(&cfg.tables)?;
        check_threads(cfg.n_threads, crate::EngramStatus::ErrInvalidConfig)?;
        let shape = Shape::new(g, tables.cols(), tables.n_layers());
        let backend = open(kind, cfg, shape, &tables)?;
        Ok(Context {
            shape,
            limits: cfg.limits,
            history: Mutex::new(History::new(cfg.limits)?),
            layers: RwLock::new(try_vec_with(shape.n_layers, || None, "engram layers")?),
            state_key: StateKey::of(&tables)?,
            tables,
            backend,
            n_threads: Mutex::new(cfg.n_threads.max(1)),
            device_history: false,
            whole: Mutex::new(try_vec_with(shape.n_layers, || None, "engram layers")?),
            shard: Mutex::new(shard::ShardSpec::WHOLE),
            kind,
        })
    }

    /// Keep this context's history on the device instead of the host,
    /// `ring_len` positions per sequence (docs/device-hash.md): the CUDA
    /// backend only, chosen at create (before any call).
    pub fn with_device_history(mut self, ring_len: usize) -> Result<Context<'w>> {
        self.backend
            .enable_device_hash(&self.tables, self.limits, ring_len)?;
        self.device_history = true;
        Ok(self)
    }

    /// Keep up to `bytes` of each host-table layer's rows in device memory
    /// (`device_cache_bytes`, docs/row-cache.md "Device tier"): the CUDA
    /// backend; the CPU backend ignores it. Chosen at create, before any
    /// layer is set; 0 keeps every row staged per call.
    pub fn with_device_cache(self, bytes: u64) -> Result<Context<'w>> {
        self.with_device_cache_policy(bytes, crate::cuda::devcache::DEFAULT_POLICY)
    }

    /// [`Context::with_device_cache`] with the replacement policy chosen
    /// (tests, benchmarks; the C ABI takes the default, LRU).
    pub fn with_device_cache_policy(
        mut self,
        bytes: u64,
        policy: crate::rowcache::policy::PolicyKind,
    ) -> Result<Context<'w>> {
        self.backend.set_device_cache(bytes, policy)?;
        Ok(self)
    }

    /// `exact`: a GGUF-block `wkv` (`Q8_0`, `Q4_K`, ...) gives, bit for
    /// bit, the `kv` of an f32 `wkv` holding its dequantised values (its f32
    /// twin), as before 0.4. Not exact (the default): the CPU backend's
    /// AVX-512 kernels multiply a `Q4_K` `wkv` by integer dot products
    /// on the rows quantised to int8, within the bound of docs/numerics.md
    /// ("Integer dot products"); a token's `kv` is still the same bits
    /// whatever its batch, the thread count or the path. The CUDA backend
    /// ignores it.
    pub fn with_exact_quant(mut self, exact: bool) -> Context<'w> {
        self.backend.set_exact_quant(exact);
        self
    }

    /// Layer `layer_id`'s device row cache counts (relaxed atomics, no lock
    /// on the hot path), or `None` where it has none (CPU backend, a device
    /// table, `device_cache_bytes` 0, or a layer not set yet).
    pub fn device_cache_stats(
        &self,
        layer_id: u32,
    ) -> Result<Option<crate::call::DeviceCacheStats>> {
        let li = layer_index(&self.tables.layer_ids, layer_id)?;
        Ok(self.backend.device_cache_stats(li))
    }

    /// Whether the history is on the device.
    pub fn has_device_history(&self) -> bool {
        self.device_history
    }

    fn host_history_only(&self, what: &str) -> Result<()> {
        if self.device_history {
            bail!(
                ErrUnsupported,
                "{what}: this context's history is on the device (device_history > 0); use \
                 engram_hash_device and the engram_seq_*_device calls"
            );
        }
        Ok(())
    }

    /// Queue the hash of a batch in device memory (see `engram_hash_device`).
    pub fn hash_device(&self, call: &DeviceHashIn) -> Result<()> {
        self.backend.hash_device(call)
    }

    /// Queue a fork of the device history: `dst` becomes a copy of `src`.
    pub fn seq_copy_device(&self, src: i32, dst: i32, stream: Stream) -> Result<()> {
        self.seq_op_device(
            DeviceSeqOp::Cp {
                src,
                dst,
                p0: -1,
                p1: -1,
            },
            stream,
        )
    }

    /// Queue the drop of `seq`'s device history.
    pub fn seq_drop_device(&self, seq: i32, stream: Stream) -> Result<()> {
        if self.device_history {
            // One sequence (not -1, which engram_seq_rm_device takes as all).
            self.limits.seq(seq)?;
        }
        self.seq_op_device(
            DeviceSeqOp::Rm {
                seq,
                p0: -1,
                p1: -1,
            },
            stream,
        )
    }

    /// Queue a range operation on the device history (`engram_seq_rm_device`,
    /// `_cp_device`, `_keep_device`, `_add_device`).
    pub fn seq_op_device(&self, op: DeviceSeqOp, stream: Stream) -> Result<()> {
        self.backend.seq_op_device(op, stream)
    }

    /// Bytes of `seq`'s saved device state, once `stream`'s work has run.
    pub fn seq_state_size_device(&self, seq: i32, stream: Stream) -> Result<usize> {
        let e = self.backend.seq_entries_device(seq, stream)?;
        Ok(crate::hash::history::state::encoded_size(e.iter().copied()))
    }

    /// Save `seq`'s device history into `buf` (the host format), once
    /// `stream`'s work has run; returns the bytes written.
    pub fn seq_state_write_device(
        &self,
        seq: i32,
        buf: &mut [u8],
        stream: Stream,
    ) -> Result<usize> {
        let e = self.backend.seq_entries_device(seq, stream)?;
        crate::hash::history::state::encode(|| e.iter().copied(), seq, &self.state_key, buf)
    }

    /// Restore a saved state (of a host or a device history) into `seq`'s
    /// device history, once `stream`'s work has run.
    pub fn seq_state_read_device(&self, seq: i32, buf: &[u8], stream: Stream) -> Result<()> {
        if !self.device_history {
            bail!(
                ErrUnsupported,
                "engram_seq_state_read_device: this context has no device history (create it with \
                 device_history > 0, CUDA backend); use engram_seq_state_read"
            );
        }
        self.limits.seq(seq)?;
        let mut entries: Vec<(usize, i32)> = Vec::new();
        crate::hash::history::state::decode(
            &self.state_key,
            self.limits.max_positions,
            buf,
            |p, v| {
                entries.try_reserve(1).map_err(|_| {
                    crate::error::Error::new(
                        crate::EngramStatus::ErrCapacity,
                        format!(
                            "out of memory restoring a sequence state of {} bytes",
                            buf.len()
                        ),
                    )
                })?;
                entries.push((p, v));
                Ok(())
            },
        )?;
        self.backend.seq_load_device(seq, &entries, stream)
    }

    pub fn geometry(&self) -> Geometry {
        self.shape.geo
    }

    pub fn shape(&self) -> Shape {
        self.shape
    }

    pub fn tables(&self) -> &HashTables {
        &self.tables
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The backend, its kernels and its memory.
    pub fn info(&self) -> BackendInfo {
        self.backend.info()
    }

    /// Row ids one token produces across all layers (`n_layers * C`).
    pub fn ids_per_token(&self) -> usize {
        self.shape.per
    }

    /// Inputs of the projection per token, `C * Hd`.
    pub fn kv_in(&self) -> usize {
        self.shape.k_in
    }

    /// Outputs of the projection per token, `D * (hc + 1)`.
    pub fn kv_out(&self) -> usize {
        self.shape.k_out
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        // A panic while holding the lock cannot leave the history half-written
        // (hash commits only after every check), so a poisoned lock is safe to reuse.
        self.history.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn layers(&self) -> std::sync::RwLockReadGuard<'_, Vec<Option<LayerInfo>>> {
        self.layers.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Hash a batch; see [`History::hash`].
    pub fn hash(
        &self,
        tokens: &[i32],
        seq_ids: &[i32],
        pos: &[i32],
        out: &mut [i64],
    ) -> Result<()> {
        self.host_history_only("engram_hash")?;
        self.history().hash(&self.tables, tokens, seq_ids, pos, out)
    }

    pub fn seq_copy(&self, src: i32, dst: i32) -> Result<()> {
        self.host_history_only("engram_seq_copy")?;
        self.history().copy(src, dst)
    }

    pub fn seq_drop(&self, seq: i32) -> Result<()> {
        self.host_history_only("engram_seq_drop")?;
        self.history().drop_seq(seq)
    }

    /// See [`History::seq_rm`].
    pub fn seq_rm(&self, seq: i32, p0: i32, p1: i32) -> Result<()> {
        self.host_history_only("engram_seq_rm")?;
        self.history().seq_rm(seq, p0, p1)
    }

    /// See [`History::seq_cp`].
    pub fn seq_cp(&self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.host_history_only("engram_seq_cp")?;
        self.history().seq_cp(src, dst, p0, p1)
    }

    /// See [`History::seq_keep`].
    pub fn seq_keep(&self, seq: i32) -> Result<()> {
        self.host_history_only("engram_seq_keep")?;
        self.history().seq_keep(seq)
    }

    /// See [`History::seq_add`].
    pub fn seq_add(&self, seq: i32, p0: i32, p1: i32, delta: i32) -> Result<()> {
        self.host_history_only("engram_seq_add")?;
        self.history().seq_add(seq, p0, p1, delta)
    }

    /// See [`History::seq_div`].
    pub fn seq_div(&self, seq: i32, p0: i32, p1: i32, d: i32) -> Result<()> {
        self.host_history_only("engram_seq_div")?;
        self.history().seq_div(seq, p0, p1, d)
    }

    /// The written positions of `seq` and their compressed ids (for tests
    /// and tools).
    pub fn seq_entries(&self, seq: i32) -> Result<Vec<(usize, i32)>> {
        let h = self.history();
        let s = h.check_seq(seq)?;
        h.entries(s)
    }

    /// Bytes of `seq`'s saved state (see [`crate::hash::history::state`]).
    pub fn seq_state_size(&self, seq: i32) -> Result<usize> {
        self.host_history_only("engram_seq_state_size")?;
        self.history().state_size(seq)
    }

    /// Save `seq`'s state into `buf`; returns the bytes written.
    pub fn seq_state_write(&self, seq: i32, buf: &mut [u8]) -> Result<usize> {
        self.host_history_only("engram_seq_state_write")?;
        self.history().state_write(seq, &self.state_key, buf)
    }

    /// Restore a saved state into `seq` (any slot).
    pub fn seq_state_read(&self, seq: i32, buf: &[u8]) -> Result<()> {
        self.host_history_only("engram_seq_state_read")?;
        self.history().state_read(seq, &self.state_key, buf)
    }

    /// The hash tables' fingerprint, which a saved state carries.
    pub fn table_fingerprint(&self) -> u64 {
        self.state_key.fingerprint
    }

    /// Positions hashed so far in `seq` (one past the highest position written).
    pub fn seq_len(&self, seq: i32) -> Result<usize> {
        let h = self.history();
        let s = h.check_seq(seq)?;
        Ok(h.len(s))
    }

    /// Host bytes this context holds beyond the borrowed weights.
    pub fn memory_bytes(&self) -> usize {
        let history = {
            let h = self.history();
            h.bytes() + h.scratch_bytes()
        };
        std::mem::size_of::<Self>() + self.tables.bytes() + history + self.backend.info().host_bytes
    }

    /// Register (or replace) one layer's weights (borrowed for `'w`).
    pub fn set_layer(&self, w: LayerIn<'w>) -> Result<()> {
        self.set_layer_part(w, (0, self.shape.k_out))
    }

    /// [`Context::set_layer`] with a `wkv` (and its scales) that holds only
    /// outputs `wkv_outs` (`[o0, o1)`): what a loader read for a shard
    /// ([`Context::set_shard`] first). The context's shard must lie inside
    /// them, now and at any later `set_shard`.
    pub fn set_layer_part(&self, w: LayerIn<'w>, wkv_outs: (usize, usize)) -> Result<()> {
        let li = layer_index(&self.tables.layer_ids, w.layer_id)?;
        let checked = check_layer(&self.shape, self.tables.rows_needed[li], w, wkv_outs)?;
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        let spec = *self.shard.lock().unwrap_or_else(|p| p.into_inner());
        let (held, info) = shard::cut(&self.shape, &checked, spec)?;
        self.backend.set_layer(li, held)?;
        self.whole.lock().unwrap_or_else(|p| p.into_inner())[li] = Some(checked);
        layers[li] = Some(info);
        Ok(())
    }

    /// What is known of the layer at index `li` of the engram layers (`None`:
    /// its weights were never set).
    pub fn layer_info(&self, li: usize) -> Option<LayerInfo> {
        self.layers().get(li).copied().flatten()
    }

    /// Layer `layer_id`'s gate weights `q * k` (`[hc, D]` f32), as the
    /// backend keeps them.
    pub fn gate_weights(&self, layer_id: u32) -> Result<Vec<f32>> {
        let li = layer_index(&self.tables.layer_ids, layer_id)?;
        let layers = self.layers();
        Self::layer_rows(&layers, li, layer_id)?;
        self.backend.gate_weights(li)
    }

    /// Threads the backend uses for one call.
    pub fn n_threads(&self) -> usize {
        *self.n_threads.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Give every file-backed table set from now on a host row cache:
    /// `bytes` of rows for the context, each layer an equal share
    /// (docs/row-cache.md), under [`crate::rowcache::policy_from_env`]'s
    /// policy. 0: no cache.
    pub fn set_row_cache(&self, bytes: u64) -> Result<()> {
        let policy = crate::rowcache::policy_from_env()?;
        let per_layer = bytes / self.shape.n_layers.max(1) as u64;
        self.backend.set_row_cache(per_layer, policy)
    }

    /// Layer index `li`'s statistics of `tier` since the last reset.
    /// `ErrInvalidArgument` for a layer out of range; `ErrUnsupported` for a
    /// tier this library does not keep yet (the device and storage tiers).
    pub fn cache_stats(&self, li: usize, tier: Tier) -> Result<Snapshot> {
        if li >= self.shape.n_layers {
            bail!(
                ErrInvalidArgument,
                "layer index {li} (the context has {} engram layers)",
                self.shape.n_layers
            );
        }
        match (tier, self.backend.host_cache_stats(li)) {
            (Tier::Host, Some(s)) => Ok(s.snapshot()),
            (Tier::Host, None) => Ok(Snapshot::default()),
            (Tier::Device, _) => Ok(self
                .backend
                .device_cache_stats(li)
                .map_or_else(Snapshot::default, device_snapshot)),
            (t, _) => bail!(
                ErrUnsupported,
                "the {t:?} tier's statistics are not kept yet"
            ),
        }
    }

    /// Zero every layer's and tier's counters (not the configuration).
    pub fn cache_stats_reset(&self) {
        for li in 0..self.shape.n_layers {
            if let Some(s) = self.backend.host_cache_stats(li) {
                s.reset();
            }
        }
        self.backend.device_cache_stats_reset();
    }

    /// Use at most `n` threads for one call from now on (0 means 1; see
    /// [`Backend::set_threads`]).
    pub fn set_threads(&self, n: usize) -> Result<()> {
        check_threads(n, crate::EngramStatus::ErrInvalidArgument)?;
        let mut cur = self.n_threads.lock().unwrap_or_else(|p| p.into_inner());
        self.backend.set_threads(n.max(1))?;
        *cur = n.max(1);
        Ok(())
    }

    /// The checks every call on a layer's rows shares: the layer, the token
    /// count, the row ids' length, and that the layer's weights are set.
    fn call_layer(&self, layer_id: u32, n: usize, ids: RowIds<'_>) -> Result<usize> {
        if matches!(ids, RowIds::Device(_)) && !self.backend.takes_device_ids() {
            bail!(
                ErrUnsupported,
                "this context uses the CPU backend; device row ids need ENGRAM_BACKEND_CUDA"
            );
        }
        let li = layer_index(&self.tables.layer_ids, layer_id)?;
        self.limits.tokens(n)?;
        if let RowIds::Host(r) = ids {
            self.shape.check_row_ids(r.len(), n)?;
        }
        Ok(li)
    }

    fn layer_rows(layers: &[Option<LayerInfo>], li: usize, layer_id: u32) -> Result<u64> {
        match layers[li] {
            Some(l) => Ok(l.rows),
            None => bail!(ErrNoWeights, "layer {layer_id}: weights were never set"),
        }
    }

    /// [`Context::layer_rows`] for a whole-layer call: refused on a context
    /// that holds only part of the layer ([`Context::set_shard`]).
    fn whole_rows(&self, layers: &[Option<LayerInfo>], li: usize, layer_id: u32) -> Result<u64> {
        let rows = Self::layer_rows(layers, li, layer_id)?;
        if let Some(info) = &layers[li] {
            shard::whole_only(info, self.shape.k_out, layer_id)?;
        }
        Ok(rows)
    }

    /// Start gathering layer `layer_id`'s table rows for a step's `row_ids`
    /// (`[n, n_layers, C]`, the `hash` output) ahead of `apply`
    /// (`engram_prefetch`). Bad ids are reported here.
    pub fn prefetch(&self, layer_id: u32, row_ids: &[i64], n: usize) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let rows = self.whole_rows(&layers, li, layer_id)?;
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, rows)?;
        self.backend.stage(li, &live)
    }

    /// Put layer `layer_id`'s rows for a step's host `row_ids` (`[n, n_layers,
    /// C]`) where a later call with device row ids reads them, queued on
    /// `stream` (`engram_stage`; see [`Backend::stage_device`]). Bad ids are
    /// reported here.
    pub fn stage(&self, layer_id: u32, row_ids: &[i64], n: usize, stream: Stream) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let rows = self.whole_rows(&layers, li, layer_id)?;
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, rows)?;
        self.backend.stage_device(li, row_ids, &live, n, stream)
    }

    /// Apply engram layer `layer_id` to `n` tokens with host row ids (the
    /// `hash` output, `[n, n_layers, C]`) on the CPU backend's host highway
    /// `[n, hc, D]`, updated in place except for dead tokens. On error
    /// nothing is written.
    pub fn apply(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        highway: Highway<'_>,
    ) -> Result<()> {
        self.apply_on(
            layer_id,
            RowIds::Host(row_ids),
            n,
            highway,
            std::ptr::null_mut(),
        )
    }

    /// [`Context::apply`] on any backend: host or device row ids, the
    /// backend's highway memory, the engine's stream (CUDA).
    pub fn apply_on(
        &self,
        layer_id: u32,
        ids: RowIds<'_>,
        n: usize,
        highway: Highway<'_>,
        stream: Stream,
    ) -> Result<()> {
        let li = self.call_layer(layer_id, n, ids)?;
        let (region, highway_type) = highway.into_region();
        let s = &self.shape;
        let size = highway_type.size();
        let highway = region.sized(n * s.hw_per_token() * size, size, "highway")?;
        let layers = self.layers();
        let rows = self.whole_rows(&layers, li, layer_id)?;
        let live;
        let ids = match ids {
            RowIds::Host(all) => {
                live = live_ids(s, all, n, li, layer_id, rows)?;
                Ids::Host { all, live: &live }
            }
            RowIds::Device(p) => Ids::Device(p),
        };
        self.backend.apply(
            li,
            ApplyIn {
                n,
                ids,
                highway,
                highway_type,
                stream,
            },
        )
    }

    /// Layer `layer_id`'s gathered rows `[n, C*Hd]` and `kv` `[n, D*(hc+1)]`
    /// (bf16 bit patterns; zero for dead tokens) for `n` tokens: a slow,
    /// synchronous read-back for numerics checks (`engram_read_back`).
    pub fn read_back(&self, layer_id: u32, ids: RowIds<'_>, n: usize) -> Result<ReadBack> {
        let li = self.call_layer(layer_id, n, ids)?;
        let layers = self.layers();
        let rows = self.whole_rows(&layers, li, layer_id)?;
        let live;
        let ids = match ids {
            RowIds::Host(all) => {
                live = live_ids(&self.shape, all, n, li, layer_id, rows)?;
                Ids::Host { all, live: &live }
            }
            RowIds::Device(p) => Ids::Device(p),
        };
        self.backend.read_back(li, ids, n)
    }

    /// Wait for `stream` and report asynchronous errors (CUDA backend; the
    /// CPU backend has none: `Ok`).
    pub fn check(&self, stream: Stream) -> Result<()> {
        self.backend.check(stream)
    }
}

/// A thread count at create or at run time: at most 1024.
fn check_threads(n: usize, status: crate::EngramStatus) -> Result<()> {
    if n > 1024 {
        return Err(crate::error::Error::new(
            status,
            format!("n_threads = {n} (at most 1024)"),
        ));
    }
    Ok(())
}

/// A device row cache's counts as a tier's statistics: the bytes read from
/// the tier below are the row bytes copied from the host; each miss is one
/// admission.
fn device_snapshot(d: crate::call::DeviceCacheStats) -> Snapshot {
    Snapshot {
        lookups: d.lookups,
        hits: d.hits,
        misses: d.misses,
        bytes_read: d.bytes_h2d,
        evictions: d.evictions,
        insertions: d.misses,
        capacity_rows: d.capacity_rows,
        policy: Some(d.policy),
        ..Snapshot::default()
    }
}
