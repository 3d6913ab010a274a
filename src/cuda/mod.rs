//! The CUDA backend: `apply` on the engine's own device memory and stream.
//!
//! - [`driver`]: the driver loaded at run time (presence checks first, so a
//!   machine without it gets a status, not a panic), the device's primary
//!   context, owned buffers.
//! - [`kernels`]: `kernels/*.cu` compiled with NVRTC for the device's compute
//!   capability at context creation, loaded once per context; the constants
//!   they share with Rust are passed as defines.
//! - [`blas`]: the projection through cuBLAS (the GEMV kernel for a few tokens).
//! - [`enqueue`]: the work one `apply` queues on the caller's stream.
//! - [`latch`]: errors the kernels find, reported at the next call.
//!
//! Everything `apply` needs is allocated in [`CudaBackend::new`] (for the
//! context's `max_tokens`); `apply` only queues work on the caller's stream:
//! an H2D copy of the staged row ids (host ids only), the gather, the
//! projection and the gate. It neither synchronises nor allocates, so a call
//! with device row ids can be captured in a CUDA graph.
//!
//! Errors found on the device (a row id out of range or a partly dead token
//! among device ids, NaN codes in an fp8 row) cannot stop a call that is
//! already queued: the token concerned is left untouched, the first such error
//! is recorded, and it is reported by the next call on the context or by
//! `check`.

pub mod blas;
pub mod driver;
mod enqueue;
pub mod kernels;
pub mod latch;

use crate::backend::{
    ApplyIn, Backend, BackendInfo, CheckedLayer, EngramBackend, Ids, ReadBack, StageStats, Stream,
    TableSource,
};
use crate::batch::{HighwayType, LiveIds, Shape};
use crate::error::{bail, EngramStatus, Error, Result};
use crate::formats::{bf16_to_f32, EngramType};
use cudarc::driver::sys;
use driver::{check, DevBuf, Device, Event, PinnedBuf};
use kernels::Module;
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

#[derive(Clone, Copy)]
struct DevLayer {
    layer_id: u32,
    table: u64,
    /// The scale array of a split fp8 table (0 for every other format).
    scales: u64,
    rows: u64,
    format: EngramType,
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
pub struct CudaBackend {
    // Field order is drop order: buffers and the module before the device's
    // primary context is released.
    state: Mutex<State>,
    /// `q * k` per layer, `[hc, D]` f32.
    qk: Vec<DevBuf>,
    /// The error latch's host-mapped mirror (see [`latch`]).
    mirror: PinnedBuf,
    module: Module,
    dev: Device,
    shape: Shape,
    max_tokens: usize,
    layer_ids: Vec<u32>,
}

// SAFETY: all mutable state is behind `state`'s mutex; the driver handles are
// used with the context made current on the calling thread (`Device::scope`).
unsafe impl Send for CudaBackend {}
// SAFETY: as above.
unsafe impl Sync for CudaBackend {}

fn overflow(what: &str) -> Error {
    Error::new(
        EngramStatus::ErrInvalidConfig,
        format!("{what} is too large for the CUDA backend"),
    )
}

impl CudaBackend {
    /// Open device `ordinal`, compile and load the kernels, and allocate every
    /// workspace for `max_tokens` tokens. `gemv_max` overrides
    /// [`DEFAULT_GEMV_MAX_TOKENS`] (0: always cuBLAS).
    pub fn new(
        ordinal: i32,
        shape: Shape,
        layer_ids: &[u32],
        max_tokens: usize,
        gemv_max: Option<usize>,
    ) -> Result<CudaBackend> {
        let dev = Device::open(ordinal)?;
        kernels::check_nvrtc_library()?;
        blas::check_cublas_library()?;
        let _scope = dev.scope()?;
        let ctx = dev.ctx;
        let (cols, n_layers, k_in, k_out) = (shape.cols, shape.n_layers, shape.k_in, shape.k_out);
        if k_in > i32::MAX as usize / 8 || k_out > i32::MAX as usize {
            return Err(overflow("C*Hd or D*(hc+1)"));
        }
        // One gather block per (token, column), one gate block per (token, stream).
        if max_tokens.saturating_mul(cols.max(shape.geo.hc)) > i32::MAX as usize {
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
            latch: DevBuf::new(ctx, latch::LATCH_WORDS * 4, "the error latch")?,
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
            gemv_max: gemv_max
                .unwrap_or(DEFAULT_GEMV_MAX_TOKENS)
                .min(kernels::GEMV_MAX),
        };
        // SAFETY: our own allocation, current context.
        unsafe {
            check(
                sys::cuMemsetD8_v2(state.latch.ptr, 0, latch::LATCH_WORDS * 4),
                "clearing the error latch",
            )?;
            // The memset runs on the legacy stream, which a non-blocking engine
            // stream does not wait for: finish it here.
            check(sys::cuCtxSynchronize(), "waiting for the device")?;
        }
        let qk = (0..n_layers)
            .map(|_| DevBuf::new(ctx, shape.hw_per_token() * 4, "q * k"))
            .collect::<Result<_>>()?;
        let mirror = PinnedBuf::new(ctx, latch::LATCH_WORDS * 4, true, "the error latch mirror")?;
        Ok(CudaBackend {
            state: Mutex::new(state),
            qk,
            mirror,
            module,
            dev,
            shape,
            max_tokens,
            layer_ids: layer_ids.to_vec(),
        })
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

    /// Report (and clear) an error the device recorded for an earlier call.
    fn take_device_error(&self, st: &State) -> Result<()> {
        let rows = |layer: u32| {
            st.layers
                .iter()
                .flatten()
                .find(|l| l.layer_id == layer)
                .map_or(0, |l| l.rows)
        };
        // SAFETY: the mirror is LATCH_WORDS u32 of pinned memory we own.
        unsafe { latch::take(self.mirror.ptr as *mut u32, rows) }
    }

    /// `n_qk` f32 values of `q * k` formed on the host from device `q` and `k`
    /// of `ty` (read synchronously), exactly as the CPU backend forms it.
    fn qk_on_host(&self, q: u64, k: u64, ty: EngramType) -> Result<Vec<f32>> {
        let n_qk = self.shape.hw_per_token();
        let read = |p: u64| -> Result<Vec<f32>> {
            let size = if ty == EngramType::F32 { 4 } else { 2 };
            let mut raw = crate::batch::try_vec(n_qk * size, 0u8, "q/k")?;
            // SAFETY: `p` holds that many bytes on our device (checked by the caller).
            unsafe {
                check(
                    sys::cuMemcpyDtoH_v2(raw.as_mut_ptr() as *mut c_void, p, raw.len()),
                    "reading weights.q/k",
                )?;
            }
            Ok(if ty == EngramType::F32 {
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            } else {
                raw.chunks_exact(2)
                    .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                    .collect()
            })
        };
        let (q, k) = (read(q)?, read(k)?);
        Ok(q.iter().zip(&k).map(|(a, b)| a * b).collect())
    }
}

impl<'w> Backend<'w> for CudaBackend {
    fn info(&self) -> BackendInfo {
        BackendInfo {
            kind: EngramBackend::Cuda,
            kernel: format!(
                "{} (sm_{}{}, driver {}.{})",
                self.dev.name,
                self.dev.cc.0,
                self.dev.cc.1,
                self.dev.driver_version / 1000,
                (self.dev.driver_version % 1000) / 10
            ),
            host_bytes: 0,
            device_bytes: self.device_bytes(),
            stage: StageStats::default(),
        }
    }

    fn takes_device_ids(&self) -> bool {
        true
    }

    /// Register (or replace) layer `li`'s device weights. Reads `q` and `k`
    /// from the device (synchronously) to form `q * k`; waits for the device
    /// to be idle before replacing anything a queued call may still read.
    fn set_layer(&self, li: usize, l: CheckedLayer<'w>) -> Result<()> {
        let wkv_f32 = match l.wkv_type {
            EngramType::Bf16 => false,
            EngramType::F32 => true,
            t => bail!(
                ErrUnsupported,
                "weights.wkv dtype {} ({}) is not supported by the CUDA backend in this build (bf16 or f32)",
                t.name(),
                t as u32
            ),
        };
        let TableSource::Memory(table) = l.source else {
            bail!(
                ErrUnsupported,
                "the CUDA backend in this build takes a table in device memory, not a file"
            );
        };
        let _scope = self.dev.scope()?;
        let ord = self.dev.ordinal;
        let table_bytes = l.bytes.table as usize;
        driver::check_device_range(table.addr() as u64, table_bytes, ord, "weights.table")?;
        let scales = match &l.scales {
            None => 0,
            Some(TableSource::Memory(r)) => {
                let n = l.bytes.scales as usize;
                driver::check_device_range(r.addr() as u64, n, ord, "weights.table_scales")?;
                r.addr() as u64
            }
            Some(TableSource::File { .. }) => bail!(
                ErrUnsupported,
                "the CUDA backend in this build takes a table in device memory, not a file"
            ),
        };
        driver::check_device_range(l.wkv.addr() as u64, l.bytes.wkv, ord, "weights.wkv")?;
        driver::check_device_range(l.q.addr() as u64, l.bytes.qk, ord, "weights.q")?;
        driver::check_device_range(l.k.addr() as u64, l.bytes.qk, ord, "weights.k")?;
        let mut st = self.state();
        let qk = self.qk_on_host(l.q.addr() as u64, l.k.addr() as u64, l.qk_type)?;
        if wkv_f32 && st.rows32.is_none() {
            let m = self.max_tokens;
            let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
            st.rows32 = Some(DevBuf::new(
                self.dev.ctx,
                m.checked_mul(k_in * 4)
                    .ok_or_else(|| overflow("f32 rows"))?,
                "f32 rows",
            )?);
            st.kv32 = Some(DevBuf::new(
                self.dev.ctx,
                m.checked_mul(k_out * 4).ok_or_else(|| overflow("f32 kv"))?,
                "f32 kv",
            )?);
        }
        // SAFETY: the context is current; `qk[li]` holds `qk.len()` floats.
        unsafe {
            check(sys::cuCtxSynchronize(), "waiting for the device")?;
            check(
                sys::cuMemcpyHtoD_v2(self.qk[li].ptr, qk.as_ptr() as *const c_void, qk.len() * 4),
                "uploading q * k",
            )?;
        }
        st.layers[li] = Some(DevLayer {
            layer_id: l.layer_id,
            table: table.addr() as u64,
            scales,
            rows: l.rows,
            format: l.format,
            wkv: l.wkv.addr() as u64,
            wkv_f32,
        });
        Ok(())
    }

    fn stage(&self, _li: usize, _live: &LiveIds) -> Result<()> {
        // Device tables need no staging: the gather kernel reads them.
        Ok(())
    }

    fn apply(&self, li: usize, call: ApplyIn<'_>) -> Result<()> {
        let hw = (call.highway.addr() as u64, call.highway_type);
        self.enqueue(li, call.ids, call.n, Some(hw), call.stream)
    }

    /// The pipeline's intermediate results for all `n` tokens: runs on the
    /// legacy default stream and waits.
    fn read_back(&self, li: usize, ids: Ids<'_>, n: usize) -> Result<ReadBack> {
        self.enqueue(li, ids, n, None, std::ptr::null_mut())?;
        let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
        let st = self.state();
        let _scope = self.dev.scope()?;
        let f32_path = st.layers[li].is_some_and(|l| l.wkv_f32);
        let get = |p: u64, bytes: usize| -> Result<Vec<u8>> {
            let mut v = crate::batch::try_vec(bytes, 0u8, "the values read back")?;
            // SAFETY: our buffers hold at least `bytes` (max_tokens >= n).
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
                        crate::formats::f32_to_bf16(x)
                    }
                })
                .collect()
        };
        let out = if f32_path {
            let r = get(st.rows32.as_ref().expect("f32 layer").ptr, n * k_in * 4)?;
            let k = get(st.kv32.as_ref().expect("f32 layer").ptr, n * k_out * 4)?;
            ReadBack {
                rows: f32s_to_bf16(r, true),
                kv: f32s_to_bf16(k, false),
            }
        } else {
            ReadBack {
                rows: u16s(get(st.rows.ptr, n * k_in * 2)?),
                kv: u16s(get(st.kv.ptr, n * k_out * 2)?),
            }
        };
        // This call's gather recorded any error in the latch (no gate ran to
        // move it to the mirror): report it now, and clear it.
        let raw = get(st.latch.ptr, latch::LATCH_WORDS * 4)?;
        let rec: [u32; latch::LATCH_WORDS] = std::array::from_fn(|i| {
            u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]])
        });
        if rec[0] != 0 {
            // SAFETY: our own allocation, current context.
            unsafe {
                check(
                    sys::cuMemsetD8_v2(st.latch.ptr, 0, latch::LATCH_WORDS * 4),
                    "clearing the error latch",
                )?;
                check(sys::cuCtxSynchronize(), "waiting for the device")?;
            }
            let rows = |layer: u32| {
                st.layers
                    .iter()
                    .flatten()
                    .find(|l| l.layer_id == layer)
                    .map_or(0, |l| l.rows)
            };
            return Err(latch::error_of(&rec, rows, ""));
        }
        Ok(out)
    }

    /// Wait for `stream`, then report any asynchronous CUDA error and any error
    /// the device recorded for this context's calls.
    fn check(&self, stream: Stream) -> Result<()> {
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
}

impl CudaBackend {
    /// The highway's element type as the gate kernels are named.
    fn gate_index(t: HighwayType) -> usize {
        match t {
            HighwayType::F32 => 0,
            HighwayType::Bf16 => 1,
        }
    }
}

impl Drop for CudaBackend {
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
