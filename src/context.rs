//! The engram context: validated configuration, per-sequence history, the
//! registered layer weights, and the `hash` / `apply` entry points that the C
//! ABI forwards to. Safe Rust; the Rust tests drive it directly.

use crate::cpu;
use crate::error::{bail, Error, Result};
use crate::formats::{bf16_to_f32, f32_to_bf16, RowDataError, RowFormat, Weights};
use crate::hash::{HashTables, HashTablesIn, History, Limits, ROW_ID_DEAD};
use crate::projection::{Kernel, Projection};
use std::sync::{Mutex, RwLock};

/// Where `apply` runs.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngramBackend {
    /// Host memory, host threads.
    Cpu = 1,
    /// Caller-owned device memory and CUDA stream (`crate::cuda`).
    Cuda = 2,
}

/// Model geometry (SPEC section 1 symbols).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Geometry {
    /// Hidden size `D`.
    pub d: usize,
    /// Hyper-connection streams `hc`.
    pub hc: usize,
    /// Row width `Hd`.
    pub hd: usize,
    /// RMS epsilon of the gate.
    pub eps: f32,
}

/// Everything `Context::new` needs.
pub struct ContextConfig<'a> {
    pub geometry: Geometry,
    pub tables: HashTablesIn<'a>,
    pub limits: Limits,
    /// Threads the CPU backend may use for one call (0 means 1).
    pub n_threads: usize,
    pub backend: u32,
}

/// One layer's table as the engine hands it over: `rows` rows of `format`,
/// `data` exactly `rows * row_bytes` long.
pub struct TableIn<'w> {
    pub data: &'w [u8],
    pub format: RowFormat,
    pub rows: u64,
}

/// One layer's weights, borrowed for the context's lifetime `'w`.
pub struct LayerIn<'w> {
    pub layer_id: u32,
    pub table: TableIn<'w>,
    /// `[D*(hc+1), C*Hd]`
    pub wkv: Weights<'w>,
    /// `[hc, D]`
    pub q: Weights<'w>,
    /// `[hc, D]`
    pub k: Weights<'w>,
}

struct Layer<'w> {
    table: &'w [u8],
    format: RowFormat,
    rows: u64,
    wkv: Weights<'w>,
    /// `q * k` in f32 (`[hc, D]`): the two norm weights enter only as their
    /// product, so it is formed once here (a copy of `hc*D` floats).
    qk: Vec<f32>,
}

/// A highway `[n_tokens, hc, D]` updated in place.
pub enum Highway<'a> {
    F32(&'a mut [f32]),
    /// bf16 bit patterns; each updated value is rounded to nearest-even.
    Bf16(&'a mut [u16]),
}

impl Highway<'_> {
    fn len(&self) -> usize {
        match self {
            Highway::F32(v) => v.len(),
            Highway::Bf16(v) => v.len(),
        }
    }
}

/// Check one token's row ids for one layer (`tid`, its `C` columns): `true`
/// for a live token whose ids all lie in `[0, rows)`, `false` for a dead one
/// (every column `ROW_ID_DEAD`), an `ErrInvalidRowId` naming the token and
/// column otherwise. Shared by the backends so they refuse the same ids with
/// the same messages.
pub(crate) fn check_token_ids(tid: &[i64], t: usize, layer_id: u32, rows: u64) -> Result<bool> {
    if tid.iter().all(|&r| r == ROW_ID_DEAD) {
        return Ok(false);
    }
    if let Some(c) = tid.iter().position(|&r| r == ROW_ID_DEAD) {
        bail!(
            ErrInvalidRowId,
            "token {t}, layer {layer_id}: column {c} is ENGRAM_ROW_ID_DEAD (-1) but other columns are not; \
             a dead token has -1 in every column"
        );
    }
    for (c, &r) in tid.iter().enumerate() {
        if r < 0 || r as u64 >= rows {
            bail!(
                ErrInvalidRowId,
                "token {t}, layer {layer_id}, column {c}: row id {r} outside the table [0, {rows})"
            );
        }
    }
    Ok(true)
}

pub struct Context<'w> {
    geo: Geometry,
    tables: HashTables,
    limits: Limits,
    projection: Projection,
    history: Mutex<History>,
    layers: RwLock<Vec<Option<Layer<'w>>>>,
    /// Host tables' sources and the rows staged by `prefetch` (crate::prefetch).
    stage: crate::prefetch::Stager,
    /// The CUDA backend, when the context was created for it.
    cuda: Option<crate::cuda::Backend>,
}

impl<'w> Context<'w> {
    pub fn new(cfg: &ContextConfig<'_>) -> Result<Context<'w>> {
        Self::with_device(cfg, 0)
    }

    /// As [`Context::new`]; `device` is the CUDA device ordinal for the CUDA
    /// backend (ignored by the CPU backend).
    pub fn with_device(cfg: &ContextConfig<'_>, device: i32) -> Result<Context<'w>> {
        let g = cfg.geometry;
        if g.d == 0 || g.hc == 0 || g.hd == 0 {
            bail!(
                ErrInvalidConfig,
                "geometry D = {}, hc = {}, Hd = {}: each must be positive",
                g.d,
                g.hc,
                g.hd
            );
        }
        // Keep every buffer size well inside usize and i32 element counts.
        if g.d > 1 << 20 || g.hc > 64 || g.hd > 1 << 16 {
            bail!(
                ErrInvalidConfig,
                "geometry D = {}, hc = {}, Hd = {} out of range (at most 2^20, 64, 2^16)",
                g.d,
                g.hc,
                g.hd
            );
        }
        if !(g.eps.is_finite() && g.eps >= 0.0) {
            bail!(ErrInvalidConfig, "eps = {} must be finite and >= 0", g.eps);
        }
        match cfg.backend {
            b if b == EngramBackend::Cpu as u32 || b == EngramBackend::Cuda as u32 => {}
            b => bail!(ErrUnsupported, "unknown backend {b}"),
        }
        let lim = cfg.limits;
        if lim.max_tokens == 0 || lim.max_seqs == 0 || lim.max_positions == 0 {
            bail!(
                ErrInvalidConfig,
                "capacities max_tokens = {}, max_seqs = {}, max_positions = {}: each must be positive",
                lim.max_tokens,
                lim.max_seqs,
                lim.max_positions
            );
        }
        if lim.max_positions > i32::MAX as usize
            || lim.max_seqs > 1 << 24
            || lim.max_tokens > 1 << 24
        {
            bail!(
                ErrInvalidConfig,
                "capacities out of range (max_positions <= 2^31-1, max_seqs and max_tokens <= 2^24)"
            );
        }
        let tables = HashTables::new(&cfg.tables)?;
        let n_layers = tables.n_layers();
        if cfg.n_threads > 1024 {
            bail!(
                ErrInvalidConfig,
                "n_threads = {} (at most 1024)",
                cfg.n_threads
            );
        }
        let projection = Projection::new(cfg.n_threads).map_err(|e| {
            Error::new(
                crate::EngramStatus::ErrInvalidConfig,
                format!("cannot start {} threads: {e}", cfg.n_threads),
            )
        })?;
        let cuda = if cfg.backend == EngramBackend::Cuda as u32 {
            Some(crate::cuda::Backend::new(
                device,
                g,
                &tables,
                lim.max_tokens,
            )?)
        } else {
            None
        };
        Ok(Context {
            geo: g,
            tables,
            limits: lim,
            projection,
            history: Mutex::new(History::new(lim.max_seqs)),
            layers: RwLock::new((0..n_layers).map(|_| None).collect()),
            stage: crate::prefetch::Stager::new(n_layers, cfg.n_threads.max(2)),
            cuda,
        })
    }

    /// The projection kernel in use.
    pub fn kernel(&self) -> Kernel {
        self.projection.kernel()
    }

    /// Use `kernel` for the projection (tests and benchmarks compare kernels;
    /// a kernel the CPU lacks falls back to the portable one).
    pub fn set_kernel(&mut self, kernel: Kernel) {
        self.projection.set_kernel(kernel);
    }

    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    pub fn tables(&self) -> &HashTables {
        &self.tables
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Row ids one token produces across all layers (`n_layers * C`).
    pub fn ids_per_token(&self) -> usize {
        self.tables.n_layers() * self.tables.cols()
    }

    /// Inputs of the projection per token, `C * Hd`.
    pub fn kv_in(&self) -> usize {
        self.tables.cols() * self.geo.hd
    }

    /// Outputs of the projection per token, `D * (hc + 1)`.
    pub fn kv_out(&self) -> usize {
        self.geo.d * (self.geo.hc + 1)
    }

    fn history(&self) -> std::sync::MutexGuard<'_, History> {
        // A panic while holding the lock cannot leave the history half-written
        // (hash commits only after every check), so a poisoned lock is safe to reuse.
        self.history.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hash a batch; see [`History::hash`].
    pub fn hash(
        &self,
        tokens: &[i32],
        seq_ids: &[i32],
        pos: &[i32],
        out: &mut [i64],
    ) -> Result<()> {
        self.history()
            .hash(&self.tables, &self.limits, tokens, seq_ids, pos, out)
    }

    pub fn seq_copy(&self, src: i32, dst: i32) -> Result<()> {
        self.history().copy(src, dst)
    }

    pub fn seq_drop(&self, seq: i32) -> Result<()> {
        self.history().drop_seq(seq)
    }

    /// Positions hashed so far in `seq` (one past the highest position written).
    pub fn seq_len(&self, seq: i32) -> Result<usize> {
        let h = self.history();
        let s = h.check_seq(seq)?;
        Ok(h.len(s))
    }

    /// Bytes this context holds beyond the borrowed weights.
    pub fn memory_bytes(&self) -> usize {
        let t = &self.tables;
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        std::mem::size_of::<Self>()
            + t.token_map.len() * 4
            + (t.multipliers.len() + t.primes.len() + t.offsets.len()) * 8
            + self.history().bytes()
            + layers
                .iter()
                .flatten()
                .map(|l| l.qk.len() * 4)
                .sum::<usize>()
    }

    /// Start gathering layer `layer_id`'s table rows for a step's `row_ids`
    /// (`[n, n_layers, C]`, the `hash` output) on worker threads and return;
    /// `apply` with the same ids then waits only for that gather
    /// (`engram_prefetch`, see `crate::prefetch`). Bad ids are reported here.
    pub fn prefetch(&self, layer_id: u32, row_ids: &[i64], n: usize) -> Result<()> {
        self.stage
            .prefetch(&self.tables, &self.limits, layer_id, row_ids, n)
    }

    /// How `apply`'s row gathers were served (staged by `prefetch` or direct).
    pub fn prefetch_stats(&self) -> crate::prefetch::Stats {
        self.stage.stats()
    }

    /// Read layer `layer_id`'s table rows with `pread` from `file`, where the
    /// table starts at `offset` (after `set_layer`; the GGUF loader does this).
    pub fn set_table_file(
        &self,
        layer_id: u32,
        file: std::sync::Arc<std::fs::File>,
        offset: u64,
    ) -> Result<()> {
        let Some(li) = self.tables.layer_index(layer_id) else {
            bail!(ErrUnknownLayer, "layer {layer_id} is not an engram layer");
        };
        self.stage.set_file(li, file, offset)
    }

    /// Register (or replace) one layer's weights.
    pub fn set_layer(&self, w: LayerIn<'w>) -> Result<()> {
        self.host_backend()?;
        let Some(li) = self.tables.layer_index(w.layer_id) else {
            bail!(
                ErrUnknownLayer,
                "layer {} is not an engram layer (engram layers: {:?})",
                w.layer_id,
                self.tables.layer_ids
            );
        };
        let g = self.geo;
        let rb = w.table.format.row_bytes(g.hd) as u64;
        let need = self.tables.rows_needed[li];
        if w.table.rows < need {
            bail!(
                ErrInvalidConfig,
                "layer {}: the hash offsets and primes reach row {} but the table has {} rows",
                w.layer_id,
                need - 1,
                w.table.rows
            );
        }
        if w.table.rows.checked_mul(rb) != Some(w.table.data.len() as u64) {
            bail!(
                ErrInvalidArgument,
                "layer {}: table of {} rows of {} bytes ({}) is {} bytes",
                w.layer_id,
                w.table.rows,
                rb,
                w.table.format.name(),
                w.table.data.len()
            );
        }
        let want = [
            ("wkv", w.wkv.len(), self.kv_out() * self.kv_in()),
            ("q", w.q.len(), g.hc * g.d),
            ("k", w.k.len(), g.hc * g.d),
        ];
        for (name, got, want) in want {
            if got != want {
                bail!(
                    ErrInvalidArgument,
                    "layer {}: {name} has {got} values, expected {want}",
                    w.layer_id
                );
            }
        }
        let qk = (0..g.hc * g.d).map(|i| w.q.get(i) * w.k.get(i)).collect();
        let layer = Layer {
            table: w.table.data,
            format: w.table.format,
            rows: w.table.rows,
            wkv: w.wkv,
            qk,
        };
        self.stage
            .set_memory(li, layer.table, layer.format, layer.rows);
        self.layers.write().unwrap_or_else(|p| p.into_inner())[li] = Some(layer);
        Ok(())
    }

    /// Checks shared by `apply` and `stages`, then gather + dequantise and the
    /// projection for the live tokens of `row_ids`: returns the live token
    /// indices, their rows `[n_live, C*Hd]` (bf16 bits) and `kv`
    /// `[n_live, D*(hc+1)]` (bf16 values held as f32).
    fn prepare(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        highway_len: Option<usize>,
    ) -> Result<Prepared> {
        self.host_backend()?;
        let Some(li) = self.tables.layer_index(layer_id) else {
            bail!(
                ErrUnknownLayer,
                "layer {layer_id} is not an engram layer (engram layers: {:?})",
                self.tables.layer_ids
            );
        };
        if n > self.limits.max_tokens {
            bail!(
                ErrCapacity,
                "{n} tokens in one call, the context was created for at most {}",
                self.limits.max_tokens
            );
        }
        let (g, cols, per) = (self.geo, self.tables.cols(), self.ids_per_token());
        if row_ids.len() != n * per {
            bail!(
                ErrInvalidArgument,
                "{} row ids for {n} tokens, expected {} ([n, n_layers, C])",
                row_ids.len(),
                n * per
            );
        }
        if let Some(len) = highway_len {
            if len != n * g.hc * g.d {
                bail!(
                    ErrInvalidArgument,
                    "highway holds {len} values for {n} tokens, expected {}",
                    n * g.hc * g.d
                );
            }
        }
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let Some(layer) = layers[li].as_ref() else {
            bail!(ErrNoWeights, "layer {layer_id}: weights were never set");
        };
        // Which tokens are live, and their ids for this layer.
        let mut live: Vec<usize> = Vec::with_capacity(n);
        let mut ids: Vec<i64> = Vec::with_capacity(n * cols);
        for t in 0..n {
            let tid = &row_ids[t * per + li * cols..t * per + (li + 1) * cols];
            if check_token_ids(tid, t, layer_id, layer.rows)? {
                live.push(t);
                ids.extend_from_slice(tid);
            }
        }
        let nl = live.len();
        let (k_in, k_out) = (self.kv_in(), self.kv_out());
        let mut rows = vec![0u16; nl * k_in];
        let gathered = self
            .stage
            .gather(li, layer.table, layer.format, g.hd, &ids, &mut rows)?;
        gathered.map_err(|(j, e)| {
            let (t, c, r) = (live[j / cols], j % cols, ids[j]);
            let what = match e {
                RowDataError::NanScale(b) => format!("e8m0 scale {b} is the NaN code 255"),
                RowDataError::NanCode(i) => format!("element {i} is an e4m3 NaN code"),
            };
            Error::new(
                crate::EngramStatus::ErrInvalidData,
                format!("layer {layer_id}, row {r} (token {t}, column {c}): {what}"),
            )
        })?;
        let mut kv = vec![0f32; nl * k_out];
        self.projection
            .run(&rows, nl, k_in, layer.wkv, k_out, &mut kv);
        Ok(Prepared {
            live,
            rows,
            kv,
            qk: layer.qk.clone(),
        })
    }

    /// Apply engram layer `layer_id` to `n` tokens. `row_ids` is the `hash`
    /// output for those tokens (`[n, n_layers, C]`); `highway` is `[n, hc, D]`
    /// and is updated in place, except for dead tokens. On error nothing is written.
    pub fn apply(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        mut highway: Highway<'_>,
    ) -> Result<()> {
        let p = self.prepare(layer_id, row_ids, n, Some(highway.len()))?;
        let (g, k_out) = (self.geo, self.kv_out());
        let (hc, d) = (g.hc, g.d);
        let mut x = vec![0f32; hc * d];
        let mut gate = vec![0f32; hc];
        for (j, &t) in p.live.iter().enumerate() {
            let kvt = &p.kv[j * k_out..(j + 1) * k_out];
            let value = &kvt[hc * d..];
            match &mut highway {
                Highway::F32(h) => x.copy_from_slice(&h[t * hc * d..(t + 1) * hc * d]),
                Highway::Bf16(h) => {
                    for (xv, &b) in x.iter_mut().zip(&h[t * hc * d..(t + 1) * hc * d]) {
                        *xv = bf16_to_f32(b);
                    }
                }
            }
            cpu::gates(&x, kvt, &p.qk, hc, d, g.eps, &mut gate);
            // out = x + gate * value in f32; the bf16 highway rounds once, here.
            for s in 0..hc {
                for (xv, &v) in x[s * d..(s + 1) * d].iter_mut().zip(value) {
                    *xv += gate[s] * v;
                }
            }
            match &mut highway {
                Highway::F32(h) => h[t * hc * d..(t + 1) * hc * d].copy_from_slice(&x),
                Highway::Bf16(h) => {
                    for (hv, &xv) in h[t * hc * d..(t + 1) * hc * d].iter_mut().zip(&x) {
                        *hv = f32_to_bf16(xv);
                    }
                }
            }
        }
        Ok(())
    }

    /// The pipeline's intermediate results for one layer, for tests and
    /// diagnostics: the dequantised rows `[n_live, C*Hd]` and `kv`
    /// `[n_live, D*(hc+1)]` of the live tokens, as bf16 bit patterns.
    pub fn stages(&self, layer_id: u32, row_ids: &[i64], n: usize) -> Result<(Vec<u16>, Vec<u16>)> {
        let p = self.prepare(layer_id, row_ids, n, None)?;
        Ok((p.rows, p.kv.iter().map(|&x| f32_to_bf16(x)).collect()))
    }
}

struct Prepared {
    live: Vec<usize>,
    rows: Vec<u16>,
    kv: Vec<f32>,
    qk: Vec<f32>,
}

/// The CUDA backend's entry points (device pointers, the caller's stream);
/// see `crate::cuda` and the C ABI's `engram_set_layer`, `engram_apply`,
/// `engram_apply_device_ids` and `engram_check`.
impl Context<'_> {
    /// Which backend `apply` runs on.
    pub fn backend(&self) -> EngramBackend {
        if self.cuda.is_some() {
            EngramBackend::Cuda
        } else {
            EngramBackend::Cpu
        }
    }

    /// The CUDA backend, for a context created with it.
    pub fn cuda(&self) -> Option<&crate::cuda::Backend> {
        self.cuda.as_ref()
    }

    fn host_backend(&self) -> Result<()> {
        if self.cuda.is_some() {
            bail!(
                ErrUnsupported,
                "this context uses the CUDA backend: its weights, row ids and highway are device memory"
            );
        }
        Ok(())
    }

    fn device_backend(&self, layer_id: u32) -> Result<(&crate::cuda::Backend, usize)> {
        let Some(cuda) = self.cuda.as_ref() else {
            bail!(
                ErrUnsupported,
                "this context uses the CPU backend; device pointers need ENGRAM_BACKEND_CUDA"
            );
        };
        let Some(li) = self.tables.layer_index(layer_id) else {
            bail!(
                ErrUnknownLayer,
                "layer {layer_id} is not an engram layer (engram layers: {:?})",
                self.tables.layer_ids
            );
        };
        Ok((cuda, li))
    }

    /// Register (or replace) one layer's device weights (CUDA backend).
    pub fn set_layer_device(&self, w: &crate::cuda::DeviceLayerIn) -> Result<()> {
        let (cuda, li) = self.device_backend(w.layer_id)?;
        cuda.set_layer(li, self.tables.rows_needed[li], w)
    }

    /// Queue layer `layer_id` for `n` tokens on `stream` (CUDA backend):
    /// `highway` is a device pointer to `[n, hc, D]` of `highway_type`.
    pub fn apply_device(
        &self,
        layer_id: u32,
        ids: crate::cuda::RowIds<'_>,
        n: usize,
        highway: u64,
        highway_type: u32,
        stream: *mut std::ffi::c_void,
    ) -> Result<()> {
        let (cuda, li) = self.device_backend(layer_id)?;
        cuda.apply(li, ids, n, highway, highway_type, stream)
    }

    /// Wait for `stream` and report asynchronous errors (CUDA backend; the
    /// CPU backend has none: `Ok`).
    pub fn check_device(&self, stream: *mut std::ffi::c_void) -> Result<()> {
        match self.cuda.as_ref() {
            Some(c) => c.check(stream),
            None => Ok(()),
        }
    }

    /// The CUDA backend's rows and kv for all `n` tokens (see
    /// `crate::cuda::Backend::stages`).
    pub fn stages_device(
        &self,
        layer_id: u32,
        ids: crate::cuda::RowIds<'_>,
        n: usize,
    ) -> Result<(Vec<u16>, Vec<u16>)> {
        let (cuda, li) = self.device_backend(layer_id)?;
        cuda.stages(li, ids, n)
    }
}
