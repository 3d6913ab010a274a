//! The CUDA backend: `apply` on the engine's own device memory and stream.
//!
//! - [`driver`]: the driver loaded at run time (presence checks first, so a
//!   machine without it gets a status, not a panic), the device's primary
//!   context, owned buffers.
//! - [`kernels`]: `kernels/*.cu` compiled with NVRTC for the device's compute
//!   capability at context creation, loaded once per context.
//! - [`blas`]: the projection through cuBLAS (and the GEMV kernel for a few tokens).
//!
//! Everything `apply` needs is allocated in [`Backend::new`] (for the context's
//! `max_tokens`); `apply` only queues work on the caller's stream: an H2D copy
//! of the staged row ids (host ids only), the gather, the projection and the
//! gate. It neither synchronises nor allocates, so a call with device row ids
//! can be captured in a CUDA graph.
//!
//! Errors found on the device (a row id out of range or a partly dead token
//! among device ids, NaN codes in an fp8 row) cannot stop a call that is
//! already queued: the token concerned is left untouched, the first such error
//! is recorded, and it is reported by the next call on the context or by
//! [`Backend::check`].

pub mod blas;
pub mod driver;
pub mod kernels;

use crate::error::{bail, EngramStatus, Error, Result};
use crate::formats::{bf16_to_f32, f32_to_bf16, EngramType, RowFormat, WeightDtype};
use crate::hash::HashTables;
use crate::Geometry;
use cudarc::driver::sys;
use driver::{check, DevBuf, Device, Event, PinnedBuf};
use kernels::{args, launch, Module};
use std::ffi::c_void;
use std::sync::Mutex;

pub use driver::probe;

/// Host row-id staging slots (pinned). A slot is reused only after the copy
/// that last read it has run, so the host waits only when the stream is this
/// many host-id calls behind.
pub const STAGING_SLOTS: usize = 4;

/// Tokens up to which the bf16 projection uses the GEMV kernel instead of cuBLAS
/// (when `wkv` is 16-byte aligned and `C*Hd` a multiple of 8).
pub const DEFAULT_GEMV_MAX_TOKENS: usize = 8;

/// One layer's weights on the device, as the engine hands them over (borrowed
/// device pointers).
#[derive(Clone, Copy, Debug)]
pub struct DeviceLayerIn {
    pub layer_id: u32,
    pub table: u64,
    pub table_rows: u64,
    pub table_type: u32,
    pub wkv: u64,
    pub wkv_type: u32,
    pub q: u64,
    pub k: u64,
    pub qk_type: u32,
}

/// Where `apply`'s row ids are.
#[derive(Clone, Copy, Debug)]
pub enum RowIds<'a> {
    /// Host memory, `[n, n_layers, C]`: checked on the host, then staged
    /// through pinned memory and copied on the stream.
    Host(&'a [i64]),
    /// Device memory, `[n, n_layers, C]` int64 (the engine copied them there):
    /// checked on the device.
    Device(u64),
}

#[derive(Clone, Copy)]
struct DevLayer {
    layer_id: u32,
    table: u64,
    rows: u64,
    format: RowFormat,
    wkv: u64,
    wkv_f32: bool,
}

/// Everything `apply` writes, behind the backend's lock.
struct State {
    blas: blas::Blas,
    rows: DevBuf,
    kv: DevBuf,
    /// f32 rows and kv, for layers with an f32 `wkv` (allocated by the first
    /// such `set_layer`).
    rows32: Option<DevBuf>,
    kv32: Option<DevBuf>,
    ids: DevBuf,
    flags: DevBuf,
    latch: DevBuf,
    staging: Vec<(PinnedBuf, Event, bool)>,
    next_slot: usize,
    layers: Vec<Option<DevLayer>>,
    serial: u32,
    gemv_max: usize,
}

/// The CUDA backend of one context.
pub struct Backend {
    // Field order is drop order: buffers and the module before the device's
    // primary context is released.
    state: Mutex<State>,
    /// `q * k` per layer, `[hc, D]` f32.
    qk: Vec<DevBuf>,
    /// The error latch's host-mapped mirror (see kernels/gate.cu).
    mirror: PinnedBuf,
    module: Module,
    dev: Device,
    geo: Geometry,
    cols: usize,
    per: usize,
    max_tokens: usize,
    layer_ids: Vec<u32>,
}

// SAFETY: all mutable state is behind `state`'s mutex; the handles are used
// with the context made current on the calling thread.
unsafe impl Send for Backend {}
unsafe impl Sync for Backend {}

fn overflow(what: &str) -> Error {
    Error::new(
        EngramStatus::ErrInvalidConfig,
        format!("{what} is too large for the CUDA backend"),
    )
}

impl Backend {
    /// Open device `ordinal`, compile and load the kernels, and allocate every
    /// workspace for `max_tokens` tokens.
    pub fn new(
        ordinal: i32,
        geo: Geometry,
        tables: &HashTables,
        max_tokens: usize,
    ) -> Result<Backend> {
        let dev = Device::open(ordinal)?;
        kernels::check_nvrtc_library()?;
        blas::check_cublas_library()?;
        let _scope = dev.scope()?;
        let ctx = dev.ctx;
        let (cols, n_layers) = (tables.cols(), tables.n_layers());
        let k_in = cols * geo.hd;
        let k_out = geo.d * (geo.hc + 1);
        if k_in > i32::MAX as usize / 8 || k_out > i32::MAX as usize {
            return Err(overflow("C*Hd or D*(hc+1)"));
        }
        // One gather block per (token, column), one gate block per (token, stream).
        if max_tokens.saturating_mul(cols.max(geo.hc)) > i32::MAX as usize {
            return Err(overflow("max_tokens * C"));
        }
        let mul = |a: usize, b: usize, what: &str| a.checked_mul(b).ok_or_else(|| overflow(what));
        let module = Module::load(ctx, dev.cc)?;
        let state = State {
            blas: blas::Blas::new(ctx)?,
            rows: DevBuf::new(ctx, mul(mul(max_tokens, k_in, "rows")?, 2, "rows")?, "rows")?,
            kv: DevBuf::new(ctx, mul(mul(max_tokens, k_out, "kv")?, 2, "kv")?, "kv")?,
            rows32: None,
            kv32: None,
            ids: DevBuf::new(ctx, mul(max_tokens, cols * 8, "row ids")?, "row ids")?,
            flags: DevBuf::new(ctx, mul(max_tokens, cols * 4, "row flags")?, "row flags")?,
            latch: DevBuf::new(ctx, 32, "the error latch")?,
            staging: (0..STAGING_SLOTS)
                .map(|_| {
                    Ok((
                        PinnedBuf::new(ctx, max_tokens * cols * 8, false, "row id staging")?,
                        Event::new(ctx)?,
                        false,
                    ))
                })
                .collect::<Result<_>>()?,
            next_slot: 0,
            layers: vec![None; n_layers],
            serial: 0,
            gemv_max: DEFAULT_GEMV_MAX_TOKENS,
        };
        // SAFETY: our own allocation, current context.
        unsafe {
            check(
                sys::cuMemsetD8_v2(state.latch.ptr, 0, 32),
                "clearing the error latch",
            )?;
            // The memset runs on the legacy stream, which a non-blocking engine
            // stream does not wait for: finish it here.
            check(sys::cuCtxSynchronize(), "waiting for the device")?;
        }
        let qk = (0..n_layers)
            .map(|_| DevBuf::new(ctx, geo.hc * geo.d * 4, "q * k"))
            .collect::<Result<_>>()?;
        let mirror = PinnedBuf::new(ctx, 32, true, "the error latch mirror")?;
        Ok(Backend {
            state: Mutex::new(state),
            qk,
            mirror,
            module,
            dev,
            geo,
            cols,
            per: cols * n_layers,
            max_tokens,
            layer_ids: tables.layer_ids.clone(),
        })
    }

    /// The device: `(ordinal, name, compute capability, driver version)`.
    pub fn device(&self) -> (i32, &str, (i32, i32), i32) {
        (
            self.dev.ordinal,
            &self.dev.name,
            self.dev.cc,
            self.dev.driver_version,
        )
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tokens up to which the bf16 projection uses the GEMV kernel (0: always cuBLAS).
    pub fn set_gemv_max_tokens(&self, n: usize) {
        self.state().gemv_max = n.min(kernels::GEMV_MAX);
    }

    /// Device bytes this backend allocated.
    pub fn device_bytes(&self) -> usize {
        let s = self.state();
        s.rows.bytes
            + s.kv.bytes
            + s.rows32.as_ref().map_or(0, |b| b.bytes)
            + s.kv32.as_ref().map_or(0, |b| b.bytes)
            + s.ids.bytes
            + s.flags.bytes
            + s.latch.bytes
            + blas::WORKSPACE_BYTES
            + self.qk.iter().map(|b| b.bytes).sum::<usize>()
    }

    /// Register (or replace) layer `li`'s device weights. Reads `q` and `k`
    /// from the device (synchronously) to form `q * k`; waits for the device
    /// to be idle before replacing anything a queued call may still read.
    pub fn set_layer(&self, li: usize, rows_needed: u64, w: &DeviceLayerIn) -> Result<()> {
        let g = self.geo;
        let format = RowFormat::new(w.table_type, g.hd)?;
        let rb = format.row_bytes(g.hd) as u64;
        if w.table_rows < rows_needed {
            bail!(
                ErrInvalidConfig,
                "layer {}: the hash offsets and primes reach row {} but the table has {} rows",
                w.layer_id,
                rows_needed - 1,
                w.table_rows
            );
        }
        let table_bytes = w
            .table_rows
            .checked_mul(rb)
            .filter(|&b| b <= isize::MAX as u64)
            .ok_or_else(|| {
                Error::new(
                    EngramStatus::ErrInvalidArgument,
                    format!("table of {} rows of {rb} bytes is too large", w.table_rows),
                )
            })?;
        let wkv_f32 = match EngramType::from_u32(w.wkv_type) {
            Some(EngramType::Bf16) => false,
            Some(EngramType::F32) => true,
            Some(t) => bail!(
                ErrUnsupported,
                "weights.wkv dtype {} ({}) is not supported by the CUDA backend in this build (bf16 or f32)",
                t.name(),
                w.wkv_type
            ),
            None => bail!(ErrUnsupported, "unknown weights.wkv dtype {}", w.wkv_type),
        };
        let qk_dt = WeightDtype::new(w.qk_type, "weights.q/k")?;
        let (k_in, k_out) = (self.cols * g.hd, g.d * (g.hc + 1));
        let wkv_bytes = k_in * k_out * if wkv_f32 { 4 } else { 2 };
        let n_qk = g.hc * g.d;
        let _scope = self.dev.scope()?;
        let ord = self.dev.ordinal;
        driver::check_device_range(w.table, table_bytes as usize, ord, "weights.table")?;
        driver::check_device_range(w.wkv, wkv_bytes, ord, "weights.wkv")?;
        driver::check_device_range(w.q, n_qk * qk_dt.size(), ord, "weights.q")?;
        driver::check_device_range(w.k, n_qk * qk_dt.size(), ord, "weights.k")?;
        let mut st = self.state();
        // q * k on the host, exactly as the CPU backend forms it.
        let read = |p: u64| -> Result<Vec<f32>> {
            let mut raw = vec![0u8; n_qk * qk_dt.size()];
            // SAFETY: `p` holds that many bytes on our device (checked above).
            unsafe {
                check(
                    sys::cuMemcpyDtoH_v2(raw.as_mut_ptr() as *mut c_void, p, raw.len()),
                    "reading weights.q/k",
                )?;
            }
            Ok(match qk_dt {
                WeightDtype::F32 => raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                WeightDtype::Bf16 => raw
                    .chunks_exact(2)
                    .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                    .collect(),
            })
        };
        let (q, k) = (read(w.q)?, read(w.k)?);
        let qk: Vec<f32> = q.iter().zip(&k).map(|(a, b)| a * b).collect();
        let (k_in_u, k_out_u) = (k_in, k_out);
        if wkv_f32 && st.rows32.is_none() {
            let m = self.max_tokens;
            st.rows32 = Some(DevBuf::new(
                self.dev.ctx,
                m.checked_mul(k_in_u * 4)
                    .ok_or_else(|| overflow("f32 rows"))?,
                "f32 rows",
            )?);
            st.kv32 = Some(DevBuf::new(
                self.dev.ctx,
                m.checked_mul(k_out_u * 4)
                    .ok_or_else(|| overflow("f32 kv"))?,
                "f32 kv",
            )?);
        }
        // SAFETY: the context is current; `qk[li]` holds n_qk floats.
        unsafe {
            check(sys::cuCtxSynchronize(), "waiting for the device")?;
            check(
                sys::cuMemcpyHtoD_v2(self.qk[li].ptr, qk.as_ptr() as *const c_void, n_qk * 4),
                "uploading q * k",
            )?;
        }
        st.layers[li] = Some(DevLayer {
            layer_id: w.layer_id,
            table: w.table,
            rows: w.table_rows,
            format,
            wkv: w.wkv,
            wkv_f32,
        });
        Ok(())
    }

    /// Report (and clear) an error the device recorded for an earlier call.
    fn take_device_error(&self, st: &State) -> Result<()> {
        let m = self.mirror.ptr as *mut u32;
        // SAFETY: the mirror is 8 u32 of pinned memory the gate kernel writes;
        // volatile reads see its writes once they land.
        let rec: [u32; 8] = unsafe { std::array::from_fn(|i| std::ptr::read_volatile(m.add(i))) };
        if rec[0] == 0 {
            return Ok(());
        }
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(m, 0) };
        let (t, c, at) = (rec[1], rec[2], rec[3]);
        let row = (rec[4] as u64 | ((rec[5] as u64) << 32)) as i64;
        let layer = rec[6];
        let rows = st
            .layers
            .iter()
            .flatten()
            .find(|l| l.layer_id == layer)
            .map_or(0, |l| l.rows);
        let tail = "(found on the device by an earlier engram_apply on this context; that token's streams were left untouched)";
        let (status, msg) = match rec[0] {
            1 => (
                EngramStatus::ErrInvalidRowId,
                format!("token {t}, layer {layer}, column {c}: row id {row} outside the table [0, {rows}) {tail}"),
            ),
            2 => (
                EngramStatus::ErrInvalidRowId,
                format!(
                    "token {t}, layer {layer}: column {c} is ENGRAM_ROW_ID_DEAD (-1) but other columns are not; \
                     a dead token has -1 in every column {tail}"
                ),
            ),
            3 => (
                EngramStatus::ErrInvalidData,
                format!("layer {layer}, row {row} (token {t}, column {c}): e8m0 scale {at} is the NaN code 255 {tail}"),
            ),
            4 => (
                EngramStatus::ErrInvalidData,
                format!("layer {layer}, row {row} (token {t}, column {c}): element {at} is an e4m3 NaN code {tail}"),
            ),
            x => (
                EngramStatus::ErrInternal,
                format!("unknown device error code {x} {tail}"),
            ),
        };
        Err(Error::new(status, msg))
    }

    /// Wait for `stream`, then report any asynchronous CUDA error and any error
    /// the device recorded for this context's calls.
    pub fn check(&self, stream: *mut c_void) -> Result<()> {
        let st = self.state();
        let _scope = self.dev.scope()?;
        // SAFETY: the caller's stream (or NULL: the legacy default stream).
        unsafe {
            check(
                sys::cuStreamSynchronize(stream as sys::CUstream),
                "an earlier call's work on this stream failed (cuStreamSynchronize)",
            )?;
        }
        self.take_device_error(&st)
    }

    /// The host-side checks of host row ids, the CPU backend's checks and messages.
    fn check_host_ids(&self, layer: &DevLayer, li: usize, row_ids: &[i64], n: usize) -> Result<()> {
        let (cols, per) = (self.cols, self.per);
        let layer_id = layer.layer_id;
        for t in 0..n {
            let tid = &row_ids[t * per + li * cols..t * per + (li + 1) * cols];
            crate::context::check_token_ids(tid, t, layer_id, layer.rows)?;
        }
        Ok(())
    }

    /// Queue layer `li`'s apply on `stream`: see the module documentation.
    /// `highway` is a device pointer to `[n, hc, D]` of `highway_type` (f32 or
    /// bf16); with `gate == false` the gate is skipped (for [`Backend::stages`]).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        li: usize,
        ids: RowIds<'_>,
        n: usize,
        highway: u64,
        highway_type: u32,
        stream: *mut c_void,
    ) -> Result<()> {
        self.enqueue(li, ids, n, Some((highway, highway_type)), stream)
    }

    fn enqueue(
        &self,
        li: usize,
        ids: RowIds<'_>,
        n: usize,
        highway: Option<(u64, u32)>,
        stream: *mut c_void,
    ) -> Result<()> {
        let g = self.geo;
        let layer_id = self.layer_ids[li];
        if n > self.max_tokens {
            bail!(
                ErrCapacity,
                "{n} tokens in one call, the context was created for at most {}",
                self.max_tokens
            );
        }
        let hw_bf16 = match highway.map(|h| EngramType::from_u32(h.1)) {
            None | Some(Some(EngramType::F32)) => false,
            Some(Some(EngramType::Bf16)) => true,
            Some(_) => bail!(
                ErrUnsupported,
                "highway type {} is not supported (ENGRAM_TYPE_F32 or ENGRAM_TYPE_BF16)",
                highway.map_or(0, |h| h.1)
            ),
        };
        if let RowIds::Host(r) = ids {
            if r.len() != n * self.per {
                bail!(
                    ErrInvalidArgument,
                    "{} row ids for {n} tokens, expected {} ([n, n_layers, C])",
                    r.len(),
                    n * self.per
                );
            }
        }
        let mut st = self.state();
        let Some(layer) = st.layers[li] else {
            bail!(ErrNoWeights, "layer {layer_id}: weights were never set");
        };
        let _scope = self.dev.scope()?;
        self.take_device_error(&st)?;
        let cs = stream as sys::CUstream;
        let mut capturing = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller's stream handle (NULL is the legacy default stream).
        unsafe {
            check(
                sys::cuStreamIsCapturing(cs, &mut capturing),
                "the stream (cuStreamIsCapturing)",
            )?;
        }
        let capturing = capturing != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if !capturing {
            let mut sctx = std::ptr::null_mut();
            // SAFETY: as above.
            unsafe {
                check(
                    sys::cuStreamGetCtx(cs, &mut sctx),
                    "the stream (cuStreamGetCtx)",
                )?;
            }
            if sctx != self.dev.ctx {
                bail!(
                    ErrInvalidArgument,
                    "the stream belongs to another CUDA context than device {}'s primary context",
                    self.dev.ordinal
                );
            }
        }
        let ord = self.dev.ordinal;
        if let Some((hw, _)) = highway {
            if n > 0 {
                let bytes = n * g.hc * g.d * if hw_bf16 { 2 } else { 4 };
                driver::check_device_range(hw, bytes, ord, "highway")?;
            }
        }
        let (ids_ptr, id_stride, id_offset) = match ids {
            RowIds::Host(r) => {
                if capturing {
                    bail!(
                        ErrInvalidArgument,
                        "the stream is capturing a CUDA graph: host row ids would be read once, at capture; \
                         pass device row ids (engram_apply_device_ids) in a captured step"
                    );
                }
                self.check_host_ids(&layer, li, r, n)?;
                (st.ids.ptr, self.cols as u32, 0u32)
            }
            RowIds::Device(p) => {
                if n > 0 {
                    driver::check_device_range(p, n * self.per * 8, ord, "row_ids")?;
                }
                (p, self.per as u32, (li * self.cols) as u32)
            }
        };
        if n == 0 {
            return Ok(());
        }
        // Stage host ids: this layer's columns, [n, C], through a pinned slot.
        if let RowIds::Host(r) = ids {
            let slot = st.next_slot;
            st.next_slot = (slot + 1) % STAGING_SLOTS;
            let cols = self.cols;
            let dst_dev = st.ids.ptr;
            let (buf, ev, used) = &mut st.staging[slot];
            // SAFETY: the event was recorded after the slot's last copy.
            unsafe {
                if *used {
                    check(sys::cuEventSynchronize(ev.ev), "waiting for a staged copy")?;
                }
                let dst = std::slice::from_raw_parts_mut(buf.ptr as *mut i64, n * cols);
                for t in 0..n {
                    let src = &r[t * self.per + li * cols..t * self.per + (li + 1) * cols];
                    dst[t * cols..(t + 1) * cols].copy_from_slice(src);
                }
                check(
                    sys::cuMemcpyHtoDAsync_v2(dst_dev, buf.ptr, n * cols * 8, cs),
                    "copying row ids to the device",
                )?;
                check(sys::cuEventRecord(ev.ev, cs), "cuEventRecord")?;
            }
            *used = true;
        }
        st.serial = st.serial.wrapping_add(1);
        let (k_in, k_out) = (self.cols * g.hd, g.d * (g.hc + 1));
        let f32_path = layer.wkv_f32;
        let (rows_buf, kv_buf) = if f32_path {
            (
                st.rows32.as_ref().expect("allocated by set_layer").ptr,
                st.kv32.as_ref().expect("allocated by set_layer").ptr,
            )
        } else {
            (st.rows.ptr, st.kv.ptr)
        };
        // Gather + dequantise.
        {
            let table = layer.table;
            let table_rows = layer.rows;
            let fmt = layer.format.engram_type() as u32;
            let hd = g.hd as u32;
            let row_bytes = layer.format.row_bytes(g.hd) as u32;
            let cols = self.cols as u32;
            let out_f32 = f32_path as u32;
            let flags = st.flags.ptr;
            let latch = st.latch.ptr;
            let lid = layer_id;
            let serial = st.serial;
            let mut a = args![
                table, table_rows, fmt, hd, row_bytes, ids_ptr, id_stride, id_offset, cols,
                rows_buf, out_f32, flags, latch, lid, serial
            ];
            // SAFETY: arguments match engram_gather's parameters; buffers hold
            // max_tokens >= n tokens; the table was checked at set_layer.
            unsafe {
                launch(
                    self.module.gather,
                    ((n * self.cols) as u32, 1, 1),
                    kernels::GATHER_THREADS,
                    0,
                    cs,
                    &mut a,
                    "the gather kernel",
                )?;
            }
        }
        // Projection.
        let use_gemv = !f32_path && n <= st.gemv_max && k_in % 8 == 0 && layer.wkv % 16 == 0;
        if use_gemv {
            let (w, rows, kv) = (layer.wkv, rows_buf, kv_buf);
            let (n_out, k) = (k_out as u32, k_in as u32);
            let mut a = args![w, rows, kv, n_out, k];
            let per_block = kernels::GEMV_ROWS_PER_WARP * (kernels::GEMV_THREADS / 32);
            let blocks = (k_out as u32).div_ceil(per_block);
            // SAFETY: arguments match engram_gemv_bf16_<n>; alignment checked above.
            unsafe {
                launch(
                    self.module.gemv[n - 1],
                    (blocks, 1, 1),
                    kernels::GEMV_THREADS,
                    0,
                    cs,
                    &mut a,
                    "the GEMV kernel",
                )?;
            }
        } else {
            // SAFETY: sizes as documented; wkv checked at set_layer.
            unsafe {
                st.blas
                    .gemm(cs, f32_path, layer.wkv, rows_buf, kv_buf, k_out, n, k_in)?;
            }
        }
        // Gate.
        if let Some((hw, _)) = highway {
            let f = self.module.gate[hw_bf16 as usize][f32_path as usize];
            let (kv, qk, flags) = (kv_buf, self.qk[li].ptr, st.flags.ptr);
            let (cols, hc, d) = (self.cols as u32, g.hc as u32, g.d as u32);
            let eps = g.eps;
            let inv_sqrt_d = 1.0f32 / (g.d as f32).sqrt();
            let (latch, mirror) = (st.latch.ptr, self.mirror.dev_ptr);
            let mut a = args![hw, kv, qk, flags, cols, hc, d, eps, inv_sqrt_d, latch, mirror];
            // SAFETY: arguments match engram_gate_*; the highway range was checked.
            unsafe {
                launch(
                    f,
                    ((n * g.hc) as u32, 1, 1),
                    kernels::GATE_THREADS,
                    0,
                    cs,
                    &mut a,
                    "the gate kernel",
                )?;
            }
        }
        Ok(())
    }

    /// The pipeline's intermediate results for all `n` tokens (tests and
    /// diagnostics): rows `[n, C*Hd]` and kv `[n, D*(hc+1)]` as bf16 bits
    /// (zero for dead tokens). Runs on the legacy default stream and waits.
    pub fn stages(&self, li: usize, ids: RowIds<'_>, n: usize) -> Result<(Vec<u16>, Vec<u16>)> {
        let stream = std::ptr::null_mut();
        self.enqueue(li, ids, n, None, stream)?;
        let g = self.geo;
        let (k_in, k_out) = (self.cols * g.hd, g.d * (g.hc + 1));
        let st = self.state();
        let _scope = self.dev.scope()?;
        let f32_path = st.layers[li].is_some_and(|l| l.wkv_f32);
        let get = |p: u64, bytes: usize| -> Result<Vec<u8>> {
            let mut v = vec![0u8; bytes];
            // SAFETY: our buffers hold at least `bytes`.
            unsafe {
                check(sys::cuCtxSynchronize(), "waiting for the device")?;
                check(
                    sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut c_void, p, bytes),
                    "reading back",
                )?;
            }
            Ok(v)
        };
        let u16s = |v: Vec<u8>| -> Vec<u16> {
            v.chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect()
        };
        let f32s_to_bf16 = |v: Vec<u8>, exact: bool| -> Vec<u16> {
            v.chunks_exact(4)
                .map(|b| {
                    let x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    if exact {
                        (x.to_bits() >> 16) as u16
                    } else {
                        f32_to_bf16(x)
                    }
                })
                .collect()
        };
        if f32_path {
            let r = get(st.rows32.as_ref().unwrap().ptr, n * k_in * 4)?;
            let k = get(st.kv32.as_ref().unwrap().ptr, n * k_out * 4)?;
            Ok((f32s_to_bf16(r, true), f32s_to_bf16(k, false)))
        } else {
            let r = get(st.rows.ptr, n * k_in * 2)?;
            let k = get(st.kv.ptr, n * k_out * 2)?;
            Ok((u16s(r), u16s(k)))
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        // Work queued by this context may still read its buffers: wait for the
        // device before they are freed (the fields drop after this).
        if let Ok(_s) = self.dev.scope() {
            // SAFETY: plain synchronisation of the current context.
            unsafe {
                let _ = sys::cuCtxSynchronize();
            }
        }
    }
}
