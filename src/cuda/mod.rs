//! The CUDA backend: `apply` on the engine's own device memory and stream.
//!
//! - [`sys`]: the driver, NVRTC and cuBLAS of CUDA 12 or 13, loaded at run
//!   time (a machine without them gets a status, never a panic).
//! - [`gpu`]: the one interface to a device ([`gpu::Gpu`]), with a real
//!   implementation ([`driver`], [`blas`]) and an emulated one ([`emu`]:
//!   the kernels' own source on the CPU, for tests without a GPU).
//! - [`kernels`]: `kernels/*.cu` compiled with NVRTC for the device (its SASS,
//!   or PTX for a device newer than the NVRTC); the constants they share with
//!   Rust are passed as defines.
//! - `enqueue`: the work one `apply` queues on the caller's stream.
//! - [`latch`]: errors the kernels find, reported at the next call.
//!
//! Everything `apply` needs is allocated in [`CudaBackend::new`] (for the
//! context's `max_tokens`) or in `set_layer`; `apply` only queues work on the
//! caller's stream: the staged copy of host row ids (and, for a host table,
//! of the rows), the gather, the projection and the gate. It neither
//! synchronises nor allocates, so a call with device row ids can be captured
//! in a CUDA graph.
//!
//! Tables: a layer's table may be device memory (read in place by the gather
//! kernel) or host memory or a file (`TableSource::File`): then the rows a
//! call needs are gathered on the host into pinned memory (by
//! `engram_prefetch`'s worker threads ahead of time straight into one of the
//! layer's two prefetch buffers, see [`crate::cpu::stager`], or at the call
//! into a staging slot), and queued as one host-to-device copy into the
//! layer's device staging buffer, which the gather kernel reads. Pinned
//! memory is written again only after an event says its last copy has run.
//!
//! Errors found on the device (a row id out of range or a partly dead token
//! among device ids, invalid row data) cannot stop a call that is already
//! queued: the token concerned is left untouched, the first such error is
//! recorded, and it is reported by the next call on the context or by
//! `check`.

pub mod blas;
pub mod devcache;
pub mod driver;
pub mod emu;
mod enqueue;
pub mod gpu;
mod hash;
pub mod kernels;
pub mod latch;
mod split;
mod status;
pub mod sys;

use crate::backend::{
    ApplyIn, Backend, BackendInfo, CheckedLayer, DevValues, EngramBackend, Ids, ReadBack, Stream,
    TableSource,
};
use crate::batch::{try_map, try_room, try_vec_with, LiveIds, Shape};
use crate::cpu::stager::{InPlace, Source, Stager};
use crate::error::{bail, EngramStatus, Error, Result};
use crate::formats::{bf16_to_f32, EngramType, Fp8Blocks};
use crate::rowcache::policy::PolicyKind;
use gpu::{DevBuf, DeviceLimits, Event, Gpu, MemKind, PinnedBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

pub use crate::call::{DeviceHashIn, DeviceSeqOp};
pub use driver::probe;
pub use hash::MAX_RING;

/// The CUDA backend's choices that tests and benchmarks make (its part of
/// [`crate::Tuning`]); engines keep the defaults.
#[derive(Clone, Default)]
pub struct CudaTuning {
    /// Tokens up to which the GEMV kernels are used, for every `wkv` format
    /// (`None`: the defaults, which differ by format), where the decode
    /// kernel is not.
    pub gemv_max_tokens: Option<usize>,
    /// Tokens up to which a bf16 or block-scaled fp8 `wkv` goes through the
    /// decode kernel (`None`: [`DEFAULT_DECODE_MAX_TOKENS`]; 0: never; at
    /// most [`kernels::DECODE_MAX`]).
    pub decode_max_tokens: Option<usize>,
    /// The device to run on instead of opening the context's device ordinal:
    /// a device object shared with the caller, or the emulation of [`emu`]
    /// (tests without a GPU). `None`: the process device if one is set
    /// ([`set_process_device`]), else the driver's device of that ordinal.
    pub device: Option<Arc<dyn Gpu>>,
}

impl std::fmt::Debug for CudaTuning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTuning")
            .field("gemv_max_tokens", &self.gemv_max_tokens)
            .field("decode_max_tokens", &self.decode_max_tokens)
            .field("device", &self.device.as_ref().map(|d| d.describe()))
            .finish()
    }
}

/// The process device ([`set_process_device`]).
static PROCESS_DEVICE: std::sync::RwLock<Option<Arc<dyn Gpu>>> = std::sync::RwLock::new(None);

/// Make every CUDA context created from now on in this process whose
/// [`CudaTuning::device`] is `None` (every context made through the C ABI:
/// `engram_create`, the GGUF and safetensors loaders) run on `device`
/// instead of opening its device ordinal, which must be `device`'s; `None`
/// goes back to opening the driver's devices. Returns the one it replaces.
///
/// This is the SIMT emulation's entry point for programs that reach the
/// library only through its C ABI: the test-only `tools/engram-emu`
/// library (the C ABI plus `engram_emu_*` calls that load the emulation and
/// manage its memory) installs an [`emu::Emulator`] here, so that the
/// Python distributed test runs the CUDA backend on it. Rust API only; no C
/// export reaches it, and an engine never calls it. Contexts already made
/// keep their device.
pub fn set_process_device(device: Option<Arc<dyn Gpu>>) -> Option<Arc<dyn Gpu>> {
    let mut d = PROCESS_DEVICE.write().unwrap_or_else(|p| p.into_inner());
    std::mem::replace(&mut *d, device)
}

/// The device [`set_process_device`] installed, if any.
pub fn process_device() -> Option<Arc<dyn Gpu>> {
    PROCESS_DEVICE
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
}

/// Host staging slots (pinned): row ids, and a host table's rows that no
/// prefetch gathered. A slot is reused only after the copy that last read it
/// has run, so the host waits only when the stream is this many host-id calls
/// behind.
pub const STAGING_SLOTS: usize = 4;

/// Tokens up to which a bf16 `wkv` is projected by the GEMV kernel instead
/// of cuBLAS (when it is 16-byte aligned and `C*Hd` a multiple of 8): every
/// size the kernel takes, so that a token's `kv` is the same bits in every
/// batch of 1 to [`kernels::GEMV_MAX`] tokens (the kernels sum each token in
/// one order whatever the batch; cuBLAS picks its algorithm by size). This
/// costs speed at 2 to 8 tokens: on an H200 cuBLAS was 4%, 15% and 56%
/// faster at 2, 4 and 8 tokens (BENCHMARKS.md, commit f1b2b5f), the GEMV
/// faster at 1.
pub const DEFAULT_GEMV_MAX_TOKENS_BF16: usize = kernels::GEMV_MAX;

/// Tokens up to which a quantised `wkv` is projected by the fused GEMV,
/// which reads the blocks in place (when `C*Hd` is a multiple of 32), instead
/// of dequantising bf16 tiles for cuBLAS, which reads the weight once and
/// writes and reads twice its bf16 size.
pub const DEFAULT_GEMV_MAX_TOKENS_QUANT: usize = 8;

/// Tokens up to which a bf16 or block-scaled fp8 `wkv` goes through the
/// decode kernel (docs/cuda.md "The decode kernel"): a token's `kv` is then
/// the same bits in every batch of 1 to this many tokens, and for 1 to
/// [`kernels::GEMV_MAX`] tokens the bits the GEMV kernels give. 16: one tile
/// of V4.1's `C*Hd` on an H100 or H200, so `wkv` is read once; from there
/// every 16 more tokens read it again and the CUDA cores' multiply-adds
/// bound the kernel (untimed: a GPU run must compare it with cuBLAS from 9
/// to 64 tokens before this moves).
pub const DEFAULT_DECODE_MAX_TOKENS: usize = kernels::DECODE_TILE;

/// Bytes of the bf16 tile a quantised `wkv` is dequantised into for cuBLAS.
pub const TILE_BYTES: usize = 32 << 20;

/// How a layer's `wkv` is projected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum WkvKind {
    Bf16,
    /// f32 rows and kv, pedantic f32 cuBLAS.
    F32,
    /// Read in place: the fused GEMV for few tokens, bf16 tiles + cuBLAS else.
    Quant(EngramType),
    /// Block-scaled fp8 read in place (`scales`: the device address of its
    /// e8m0 scales, blocks of `br x bc`): the bf16 path's algorithms (its
    /// GEMV up to the bf16 limit, else bf16 tiles + cuBLAS), so its bits.
    Fp8Block {
        scales: u64,
        br: u32,
        bc: u32,
    },
}

/// Where a layer's table rows are read.
enum TableLoc {
    /// Device memory at `table`; for a split fp8 table, its scales at
    /// `scales` (0 for every other format).
    Device { table: u64, scales: u64 },
    /// Host memory or a file, through the stager (`gen`: its generation of
    /// the layer's table); staged rows `[max_tokens, C]` of `row_bytes` and
    /// their ids go to these device buffers, from a staging slot or from the
    /// pinned memory a prefetch gathered into (`prefetch`, one per stager
    /// slot).
    ///
    /// With a device row cache (`cache`), `rows` holds the staging area's
    /// `max_tokens * C` rows and then the cache's slots.
    Host {
        gen: u64,
        rows: DevBuf,
        ids: DevBuf,
        prefetch: Vec<Arc<Staging>>,
        cache: Option<Box<DevCache>>,
    },
}

/// A host-table layer's device row cache (docs/row-cache.md "Device tier"):
/// its slots are rows `base ..` of the layer's device rows buffer.
struct DevCache {
    /// Slots, and the index of the first in the rows buffer.
    capacity: usize,
    base: u32,
    /// Per call: each cell's row index (`[max_tokens * C]` u32), and the
    /// admissions for `engram_cache_fill` (`(src, dst)` u32 pairs).
    slots: DevBuf,
    fill: DevBuf,
    plan: Mutex<devcache::Plan>,
    counters: devcache::Counters,
    /// Its policy (reported with the counts).
    kind: crate::rowcache::PolicyKind,
}

struct DevLayer {
    layer_id: u32,
    rows: u64,
    format: EngramType,
    row_bytes: usize,
    table: TableLoc,
    wkv: u64,
    wkv_kind: WkvKind,
    /// The device copy of a `wkv` given in host memory.
    wkv_copy: Option<DevBuf>,
    /// The device copy of a block-scaled fp8 `wkv`'s scales given in host
    /// memory.
    wkv_scales_copy: Option<DevBuf>,
}

impl DevLayer {
    /// Bytes of one output row of `wkv` (`k_in` inputs; a block-scaled fp8
    /// `wkv`'s codes).
    fn wkv_row_bytes(&self, k_in: usize) -> usize {
        match self.wkv_kind {
            WkvKind::Bf16 => 2 * k_in,
            WkvKind::F32 => 4 * k_in,
            WkvKind::Fp8Block { .. } => k_in,
            WkvKind::Quant(fmt) => fmt.row_bytes(k_in),
        }
    }

    /// The address of output row `lo` of the `wkv` the layer holds.
    fn wkv_at(&self, k_in: usize, lo: usize) -> u64 {
        self.wkv + (lo * self.wkv_row_bytes(k_in)) as u64
    }

    /// A block-scaled fp8 `wkv`'s scales from output row `lo` (a multiple of
    /// its block rows) on; 0 for other formats.
    fn wkv_scales_at(&self, k_in: usize, lo: usize) -> u64 {
        match self.wkv_kind {
            WkvKind::Fp8Block { scales, br, bc } => {
                scales + ((lo / br as usize) * k_in.div_ceil(bc as usize)) as u64
            }
            _ => 0,
        }
    }
}

/// Pinned staging memory: `[max_tokens, C]` row ids, then (for a host
/// table) as many rows, and the event recorded after the last device copy
/// queued from it. The context's [`STAGING_SLOTS`] slots are these, and so is
/// the memory a host-table layer's prefetches gather into in place (two per
/// layer, handed to the stager as [`InPlace`]).
struct Staging {
    gpu: Arc<dyn Gpu>,
    buf: PinnedBuf,
    ev: Event,
    /// Bytes of ids at the start; the rows follow.
    ids_bytes: usize,
    /// For a layer with a device cache: the cells the ids part also holds
    /// a call's row indices and admissions for (after the ids; 0: none).
    aux_cells: usize,
    /// What is known of the copies queued from it: [`COPIES_NONE`],
    /// [`COPIES_EVENT`] (`ev` was recorded after them) or
    /// [`COPIES_UNTRACKED`] (one may have been queued and recording `ev`
    /// after it failed: nothing says when it has run).
    copies: AtomicU8,
}

const COPIES_NONE: u8 = 0;
const COPIES_EVENT: u8 = 1;
const COPIES_UNTRACKED: u8 = 2;

impl Staging {
    /// `aux_cells` > 0 (a layer with a device cache): room after the ids
    /// for that many cells' u32 row indices and u32 pairs of admissions.
    fn new(
        gpu: &Arc<dyn Gpu>,
        ids: usize,
        row_bytes: usize,
        aux_cells: usize,
        what: &str,
    ) -> Result<Staging> {
        let ids_bytes = aux_cells
            .checked_mul(12)
            .and_then(|a| a.checked_add(ids))
            .ok_or_else(|| overflow(what))?;
        let bytes = ids_bytes
            .checked_add(row_bytes)
            .ok_or_else(|| overflow(what))?;
        Ok(Staging {
            gpu: gpu.clone(),
            buf: PinnedBuf::new(gpu, bytes, false, what)?,
            ev: Event::new(gpu)?,
            ids_bytes,
            aux_cells,
            copies: AtomicU8::new(COPIES_NONE),
        })
    }

    /// The row indices (`aux_cells` u32) and admissions (`2 * aux_cells`
    /// u32) parts, after the ids.
    ///
    /// # Safety
    /// The caller holds the memory (as for [`Staging::write_ids`]) and takes
    /// no other reference to these parts while the slices live.
    #[allow(clippy::mut_from_ref)]
    unsafe fn aux(&self) -> (&mut [u32], &mut [u32]) {
        let a = self.aux_cells;
        // SAFETY: `new` put 12 * aux_cells bytes after the 8 * aux_cells
        // bytes of ids (aux_cells = max_tokens * C), pinned memory is 4 KiB
        // aligned so both parts are u32-aligned; the caller's contract.
        unsafe {
            let p = self.buf.ptr.add(8 * a) as *mut u32;
            (
                std::slice::from_raw_parts_mut(p, a),
                std::slice::from_raw_parts_mut(p.add(a), 2 * a),
            )
        }
    }

    /// Queue on `stream` the copies `(device address, offset in this memory,
    /// bytes)` (empty ones skipped), then record the event, as
    /// [`Staging::queue_copies`] does.
    ///
    /// # Safety
    /// Each destination holds its bytes on the device and each offset range
    /// lies in this memory; the caller holds it until it returns.
    unsafe fn queue_uploads(&self, ups: &[(u64, usize, usize)], stream: Stream) -> Result<()> {
        let base = self.buf.ptr as *const u8;
        let mut r = Ok(());
        for &(dst, off, bytes) in ups.iter().filter(|u| u.2 > 0) {
            // SAFETY: the caller's contract; the memory is not written
            // again before the event recorded below says the copies ran.
            r = unsafe { self.gpu.upload_async(dst, base.add(off), bytes, stream) };
            if r.is_err() {
                break;
            }
        }
        // SAFETY: a live event; the stream was checked by the caller.
        match unsafe { self.gpu.event_record(self.ev.ev, stream) } {
            Ok(()) => {
                self.copies.store(COPIES_EVENT, Ordering::Release);
                r
            }
            Err(e) => {
                self.copies.store(COPIES_UNTRACKED, Ordering::Release);
                r.and(Err(e))
            }
        }
    }

    /// Wait on the host until no copy queued from the memory still reads it.
    fn wait_idle(&self) -> Result<()> {
        match self.copies.load(Ordering::Acquire) {
            COPIES_NONE => Ok(()),
            // SAFETY: a live event of this device.
            COPIES_EVENT => unsafe { self.gpu.event_wait(self.ev.ev) },
            _ => bail!(
                ErrDevice,
                "a copy from pinned staging memory could not be followed by an event (an earlier                  CUDA error); the memory is not reused"
            ),
        }
    }

    /// Write the ids of `n` tokens (`all`, layer `li`) at the start.
    fn write_ids(&self, shape: &Shape, all: &[i64], n: usize, li: usize) {
        let cols = shape.cols;
        // SAFETY: the memory starts with `ids_bytes` = max_tokens * C * 8
        // bytes of ids (pinned memory is 4 KiB aligned) and n <= max_tokens;
        // the caller holds it (no copy reads it: `wait_idle`, or a slot the
        // stager gave this call).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.buf.ptr as *mut i64, n * cols) };
        for t in 0..n {
            dst[t * cols..(t + 1) * cols].copy_from_slice(shape.token_ids(all, t, li));
        }
    }

    /// Queue on `stream` the copies of `cells` ids to `ids_dev` and, with
    /// `rows = Some((dst, bytes))`, of the rows that follow them, then record
    /// the event (also when queueing failed half way: whatever was queued is
    /// covered).
    ///
    /// # Safety
    /// `ids_dev` holds `cells` ids and `rows`' destination its bytes on the
    /// device; the memory holds them; the caller holds it until it returns.
    unsafe fn queue_copies(
        &self,
        ids_dev: u64,
        cells: usize,
        rows: Option<(u64, usize)>,
        stream: Stream,
    ) -> Result<()> {
        let base = self.buf.ptr as *const u8;
        // SAFETY: the caller's contract; the memory is pinned and is not
        // written again before the event recorded below says these copies
        // have run (`wait_idle`).
        let r = unsafe {
            self.gpu
                .upload_async(ids_dev, base, cells * 8, stream)
                .and_then(|()| match rows {
                    Some((dst, bytes)) => {
                        self.gpu
                            .upload_async(dst, base.add(self.ids_bytes), bytes, stream)
                    }
                    None => Ok(()),
                })
        };
        // SAFETY: a live event; the stream was checked by the caller.
        match unsafe { self.gpu.event_record(self.ev.ev, stream) } {
            Ok(()) => {
                self.copies.store(COPIES_EVENT, Ordering::Release);
                r
            }
            Err(e) => {
                self.copies.store(COPIES_UNTRACKED, Ordering::Release);
                r.and(Err(e))
            }
        }
    }
}

// SAFETY: `rows` is the pinned memory after the ids, owned by this value
// (valid and writable while it lives); the CUDA backend writes it only
// through the stager's slots (a prefetch's gather, or an apply the stager
// serves from the slot), and `wait_idle` waits for the device copies such an
// apply queued from it (`queue_copies` records the event after them).
unsafe impl InPlace for Staging {
    fn rows(&self) -> (*mut u8, usize) {
        // SAFETY: `ids_bytes` <= the buffer's bytes (`new`).
        (unsafe { self.buf.ptr.add(self.ids_bytes) }, self.rows_len())
    }

    fn rows_len(&self) -> usize {
        self.buf.bytes - self.ids_bytes
    }

    fn wait_idle(&self) -> Result<()> {
        Staging::wait_idle(self)
    }
}

/// The backend's own stream (non-blocking), destroyed on drop.
struct OwnStream {
    gpu: Arc<dyn Gpu>,
    s: Stream,
}

impl OwnStream {
    fn new(gpu: &Arc<dyn Gpu>) -> Result<OwnStream> {
        Ok(OwnStream {
            gpu: gpu.clone(),
            s: gpu.stream_new()?,
        })
    }
}

impl Drop for OwnStream {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once; every use of it waits for
        // its work before returning.
        unsafe { self.gpu.stream_free(self.s) }
    }
}

/// Everything `apply` writes, behind the backend's lock.
struct State {
    blas: Box<dyn gpu::Blas>,
    rows: DevBuf,
    kv: DevBuf,
    /// f32 rows and kv, for layers with an f32 `wkv` (allocated by the first
    /// such `set_layer`).
    rows32: Option<DevBuf>,
    kv32: Option<DevBuf>,
    /// The bf16 tile of a quantised `wkv` and its rows (allocated by the
    /// first such `set_layer`).
    tile: Option<(DevBuf, usize)>,
    /// Host row ids of a device-table layer, staged.
    ids: DevBuf,
    flags: DevBuf,
    latch: DevBuf,
    slots: Vec<Staging>,
    /// Row bytes per (token, column) the slots hold besides the ids.
    slot_row_bytes: usize,
    /// Whether the slots have room for a device cache's per-call arrays.
    slot_aux: bool,
    /// `device_cache_bytes`: each host-table layer's device cache budget.
    cache_bytes: u64,
    next_slot: usize,
    layers: Vec<Option<Arc<DevLayer>>>,
    serial: u32,
    /// Recorded after the work of every call queued outside a graph capture
    /// (apply, stage, read_back), on its stream: the device work of one
    /// context's calls is ordered by the engine, so when the last call's
    /// work has run every earlier call's has. `set_layer` waits for it on
    /// the host, `read_back` on its own stream; neither waits for the whole
    /// context. Graph replays are not covered (see docs/cuda-streams.md).
    last: Event,
    /// Whether `last` was ever recorded.
    last_used: bool,
    /// The stream `last` was recorded on (its address).
    last_stream: usize,
    /// Tokens up to which the GEMV kernels project (bf16, quantised `wkv`).
    gemv_max_bf16: usize,
    gemv_max_quant: usize,
    /// Tokens up to which the decode kernel runs (0: never).
    decode_max: usize,
    /// The decode kernel's count of the blocks done (the last one runs the
    /// gate): one word, zero between launches (the last block puts it
    /// back). One per context, as the workspaces are: the context's calls
    /// are ordered on the device (docs/cuda-streams.md).
    done: DevBuf,
    /// The driver refused the decode kernel's launch with its gate (an error
    /// that leaves the context usable): its split path from then on.
    fused_refused: bool,
    /// How the decode kernel ran so far.
    decode_stats: crate::backend::DecodeStats,
    /// The occupancy of the decode kernel (`Decode { fp8 }` at `fp8`) per
    /// tile; `u32::MAX`: not asked yet.
    decode_occupancy: [[u32; kernels::DECODE_TILE + 1]; 2],
}

/// The CUDA backend of one context.
pub struct CudaBackend {
    // Field order is drop order: everything that holds device memory before
    // the device (`gpu`) goes.
    state: Mutex<State>,
    /// Where the backend's own copies, memsets and `read_back` run.
    own: OwnStream,
    /// `q * k` per layer, `[hc, D]` f32.
    qk: Vec<DevBuf>,
    /// The error latch's host-mapped mirror (see [`latch`]).
    mirror: PinnedBuf,
    stager: Stager,
    /// The device hash and history, for a context created with one.
    hash: Option<hash::DeviceHash>,
    gpu: Arc<dyn Gpu>,
    shape: Shape,
    max_tokens: usize,
    layer_ids: Vec<u32>,
    /// The device's multiprocessors, shared memory and cooperative launch.
    limits: DeviceLimits,
    /// The device row caches' policy (`set_device_cache`).
    cache_policy: PolicyKind,
}

// SAFETY: all mutable state is behind `state`'s mutex; the device is `Sync`.
unsafe impl Send for CudaBackend {}
// SAFETY: Sync for the reason Send is above: `&self` reaches mutable state
// only through `state`'s mutex, and the device (`Arc<dyn Gpu>`) is `Sync`.
unsafe impl Sync for CudaBackend {}

fn overflow(what: &str) -> Error {
    Error::new(
        EngramStatus::ErrInvalidConfig,
        format!("{what} is too large for the CUDA backend"),
    )
}

/// Where a region handed to the backend lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Memory a kernel can read: device, managed, or mapped pinned memory.
    Device,
    /// Host memory: pageable (the driver does not know it), or page-locked.
    Host,
}

impl CudaBackend {
    /// Open device `ordinal` (or use `device`: tests and benchmarks share one
    /// device object, or run on the emulation), and allocate every workspace
    /// for `max_tokens` tokens. `gemv_max` overrides both
    /// [`DEFAULT_GEMV_MAX_TOKENS_BF16`] and [`DEFAULT_GEMV_MAX_TOKENS_QUANT`]
    /// (0: always cuBLAS).
    pub fn new(
        ordinal: i32,
        shape: Shape,
        layer_ids: &[u32],
        max_tokens: usize,
        tuning: &CudaTuning,
    ) -> Result<CudaBackend> {
        let gemv_max = tuning.gemv_max_tokens;
        let gpu = match (tuning.device.clone(), process_device()) {
            (Some(g), _) => g,
            (None, Some(g)) if g.ordinal() == ordinal => g,
            (None, Some(g)) => bail!(
                ErrDevice,
                "device {ordinal}: this process runs its CUDA contexts on {} (device {})",
                g.describe(),
                g.ordinal()
            ),
            (None, None) => driver::RealGpu::open(ordinal)?,
        };
        let (cols, n_layers, k_in, k_out) = (shape.cols, shape.n_layers, shape.k_in, shape.k_out);
        if k_in > i32::MAX as usize / 8 || k_out > i32::MAX as usize {
            return Err(overflow("C*Hd or D*(hc+1)"));
        }
        // One gate block per (token, stream); the gather numbers tokens in 32 bits.
        if max_tokens.saturating_mul(cols.max(shape.geo.hc)) > i32::MAX as usize {
            return Err(overflow("max_tokens * C"));
        }
        let own = OwnStream::new(&gpu)?;
        let mul = |a: usize, b: usize, what: &str| a.checked_mul(b).ok_or_else(|| overflow(what));
        let buf = |bytes: usize, what: &str| DevBuf::new(&gpu, bytes, what);
        let state = State {
            blas: gpu.new_blas()?,
            rows: buf(mul(mul(max_tokens, k_in, "rows")?, 2, "rows")?, "rows")?,
            kv: buf(mul(mul(max_tokens, k_out, "kv")?, 2, "kv")?, "kv")?,
            rows32: None,
            kv32: None,
            tile: None,
            ids: buf(mul(max_tokens, cols * 8, "row ids")?, "row ids")?,
            flags: buf(mul(max_tokens, cols * 4, "row flags")?, "row flags")?,
            latch: buf(latch::LATCH_WORDS * 4, "the error latch")?,
            slots: Vec::new(),
            slot_row_bytes: 0,
            slot_aux: false,
            cache_bytes: 0,
            next_slot: 0,
            layers: try_vec_with(n_layers, || None, "engram layers")?,
            serial: 0,
            last: Event::new(&gpu)?,
            last_used: false,
            last_stream: 0,
            gemv_max_bf16: gemv_max
                .unwrap_or(DEFAULT_GEMV_MAX_TOKENS_BF16)
                .min(kernels::GEMV_MAX),
            gemv_max_quant: gemv_max
                .unwrap_or(DEFAULT_GEMV_MAX_TOKENS_QUANT)
                .min(kernels::GEMV_MAX),
            decode_max: tuning
                .decode_max_tokens
                .unwrap_or(DEFAULT_DECODE_MAX_TOKENS)
                .min(kernels::DECODE_MAX),
            done: buf(4, "the decode kernel's count of blocks done")?,
            fused_refused: false,
            decode_stats: Default::default(),
            decode_occupancy: [[u32::MAX; kernels::DECODE_TILE + 1]; 2],
        };
        let limits = gpu.device_limits()?;
        // SAFETY: our own allocations of LATCH_WORDS words and of one word.
        unsafe {
            gpu.memset_async(state.latch.ptr, 0, latch::LATCH_WORDS * 4, own.s)?;
            gpu.memset_async(state.done.ptr, 0, 4, own.s)?;
        }
        gpu.stream_synchronize(own.s)?;
        let mut qk = try_room(n_layers, "engram layers")?;
        for _ in 0..n_layers {
            qk.push(buf(shape.hw_per_token() * 4, "q * k")?);
        }
        let mirror = PinnedBuf::new(&gpu, latch::LATCH_WORDS * 4, true, "the error latch mirror")?;
        let mut b = CudaBackend {
            state: Mutex::new(state),
            own,
            qk,
            mirror,
            stager: Stager::new(n_layers, 2)?,
            hash: None,
            gpu,
            shape,
            max_tokens,
            layer_ids: try_map(layer_ids, |&a| a, "layer_ids")?,
            limits,
            cache_policy: devcache::DEFAULT_POLICY,
        };
        b.grow_slots(0, false)?;
        Ok(b)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copy host memory to the device on the backend's own stream and wait
    /// for that copy only (never the whole context, nor the legacy stream).
    ///
    /// # Safety
    /// As [`Gpu::upload`].
    unsafe fn own_upload(&self, dst: u64, src: *const u8, bytes: usize) -> Result<()> {
        // SAFETY: `Gpu::upload`'s contract (this function's `# Safety`): `dst` holds
        // `bytes`, `src` is readable; `own.s` is this device's live stream, and the wait
        // below ends the copy before `src` can change, as `upload_async` requires.
        unsafe { self.gpu.upload_async(dst, src, bytes, self.own.s)? };
        self.gpu.stream_synchronize(self.own.s)
    }

    /// As [`CudaBackend::own_upload`], from the device to the host.
    ///
    /// # Safety
    /// As [`Gpu::download`].
    unsafe fn own_download(&self, dst: *mut u8, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: `Gpu::download`'s contract (this function's `# Safety`): `src` holds
        // `bytes`, `dst` is writable; `own.s` is this device's live stream, and the wait
        // below ends the copy before this returns, as `download_async` requires.
        unsafe { self.gpu.download_async(dst, src, bytes, self.own.s)? };
        self.gpu.stream_synchronize(self.own.s)
    }

    /// As [`CudaBackend::own_upload`], a memset.
    ///
    /// # Safety
    /// As [`Gpu::memset`].
    unsafe fn own_memset(&self, p: u64, v: u8, bytes: usize) -> Result<()> {
        // SAFETY: `Gpu::memset`'s contract (this function's `# Safety`): `p` holds
        // `bytes` on the device; `own.s` is this device's live stream, waited for below.
        unsafe { self.gpu.memset_async(p, v, bytes, self.own.s)? };
        self.gpu.stream_synchronize(self.own.s)
    }

    /// Wait on the host until the work of this context's last call queued
    /// outside a capture has run (see [`State::last`]).
    fn wait_last(&self, st: &State) -> Result<()> {
        if st.last_used {
            // SAFETY: a live event of this device.
            unsafe { self.gpu.event_wait(st.last.ev)? };
        }
        Ok(())
    }

    /// The device this backend runs on.
    pub fn gpu(&self) -> &Arc<dyn Gpu> {
        &self.gpu
    }

    /// (Re)allocate the pinned slots to hold, per (token, column), an id and
    /// `row_bytes` of row (the device must be idle: `set_layer` waited).
    fn grow_slots(&mut self, row_bytes: usize, aux: bool) -> Result<()> {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        Self::grow_slots_in(
            &self.gpu,
            st,
            self.max_tokens,
            self.shape.cols,
            row_bytes,
            aux,
        )
    }

    fn grow_slots_in(
        gpu: &Arc<dyn Gpu>,
        st: &mut State,
        max_tokens: usize,
        cols: usize,
        row_bytes: usize,
        aux: bool,
    ) -> Result<()> {
        if !st.slots.is_empty() && st.slot_row_bytes >= row_bytes && (st.slot_aux || !aux) {
            return Ok(());
        }
        let (row_bytes, aux) = (row_bytes.max(st.slot_row_bytes), aux || st.slot_aux);
        let (ids, rows) = Self::staging_bytes(max_tokens, cols, row_bytes)?;
        let aux_cells = if aux { max_tokens * cols } else { 0 };
        let slots = (0..STAGING_SLOTS)
            .map(|_| Staging::new(gpu, ids, rows, aux_cells, "the host staging slots"))
            .collect::<Result<Vec<_>>>()?;
        st.slots = slots;
        st.slot_row_bytes = row_bytes;
        st.slot_aux = aux;
        st.next_slot = 0;
        Ok(())
    }

    /// Bytes of the ids and of the rows of `row_bytes` in pinned staging
    /// memory for `max_tokens` tokens of `cols` columns.
    fn staging_bytes(max_tokens: usize, cols: usize, row_bytes: usize) -> Result<(usize, usize)> {
        let cells = max_tokens
            .checked_mul(cols)
            .ok_or_else(|| overflow("the staging slots"))?;
        Ok((
            cells
                .checked_mul(8)
                .ok_or_else(|| overflow("the staging slots"))?,
            cells
                .checked_mul(row_bytes)
                .ok_or_else(|| overflow("the staging slots"))?,
        ))
    }

    /// How layer `l`'s `wkv` is read (a block-scaled fp8 `wkv`'s scales
    /// address is filled in by [`CudaBackend::place_wkv`]).
    fn wkv_kind_of(l: &CheckedLayer<'_>) -> Result<WkvKind> {
        Ok(match l.wkv_type {
            EngramType::Bf16 => WkvKind::Bf16,
            EngramType::F32 => WkvKind::F32,
            EngramType::Fp8E4m3E8m0Block => WkvKind::Fp8Block {
                scales: 0,
                br: u32::try_from(l.wkv_block.0).map_err(|_| overflow("wkv_block_rows"))?,
                bc: u32::try_from(l.wkv_block.1).map_err(|_| overflow("wkv_block_cols"))?,
            },
            t => WkvKind::Quant(t),
        })
    }

    /// Layer `l`'s table (and, for a split fp8 table, its scales): `None`
    /// for device memory, else the host source the stager reads.
    fn host_table_source(&self, l: &CheckedLayer<'_>) -> Result<Option<Source>> {
        let hd = self.shape.geo.hd;
        Ok(match (
            self.table_source(&l.source, l.bytes.table, l.layer_id, "table")?,
            l.scales
                .as_ref()
                .map(|sc| self.table_source(sc, l.bytes.scales, l.layer_id, "table's scales"))
                .transpose()?,
        ) {
            (None, None | Some(None)) => None,
            (Some(codes), None) => Some(codes),
            // A split table in host memory or files: each staged row is its
            // codes then its scales, the packed row (which the split format
            // dequantises as).
            (Some(codes), Some(Some(scales))) => Some(Source::Split {
                codes: Box::new(codes),
                scales: Box::new(scales),
                crb: l.format.planes(hd).0,
            }),
            _ => bail!(
                ErrUnsupported,
                "layer {}: a split fp8 table's codes and scales must both be in device memory or both on the host",
                l.layer_id
            ),
        })
    }

    /// Layer `l`'s `wkv` (and a block-scaled fp8 `wkv`'s scales, written
    /// into `wkv_kind`): in place on the device, or copied there (the
    /// copies returned, to keep).
    #[allow(clippy::type_complexity)]
    fn place_wkv(
        &self,
        l: &CheckedLayer<'_>,
        wkv_kind: &mut WkvKind,
    ) -> Result<(u64, Option<DevBuf>, Option<DevBuf>)> {
        let (wkv, wkv_copy) = match self.place(l.wkv.addr()) {
            Place::Device => {
                gpu::check_device_range(
                    &*self.gpu,
                    l.wkv.addr() as u64,
                    l.bytes.wkv,
                    "weights.wkv",
                )?;
                (l.wkv.addr() as u64, None)
            }
            Place::Host => {
                let b = DevBuf::new(&self.gpu, l.bytes.wkv, "the device copy of weights.wkv")?;
                // SAFETY: host memory the context lends, sized by its checks;
                // `b` holds as many bytes.
                unsafe {
                    self.own_upload(b.ptr, l.wkv.host().as_ptr(), l.bytes.wkv)?;
                }
                (b.ptr, Some(b))
            }
        };
        // A block-scaled fp8 wkv's scales: in place, or copied there.
        let mut wkv_scales_copy = None;
        if let (WkvKind::Fp8Block { scales, .. }, Some(r)) = (wkv_kind, l.wkv_scales) {
            let n = l.bytes.wkv_scales;
            *scales = match self.place(r.addr()) {
                Place::Device => {
                    gpu::check_device_range(&*self.gpu, r.addr() as u64, n, "weights.wkv_scales")?;
                    r.addr() as u64
                }
                Place::Host => {
                    let b = DevBuf::new(&self.gpu, n, "the device copy of weights.wkv_scales")?;
                    // SAFETY: host memory the context lends, sized by its
                    // checks; `b` holds as many bytes. On the context's own
                    // stream: a context-wide wait would wait for the
                    // engine's unrelated work (docs/cuda-streams.md).
                    unsafe { self.own_upload(b.ptr, r.host().as_ptr(), n)? };
                    let p = b.ptr;
                    wkv_scales_copy = Some(b);
                    p
                }
            };
        }
        Ok((wkv, wkv_copy, wkv_scales_copy))
    }

    /// Compile the kernels a layer with `wkv_kind` needs now, not in the
    /// first apply: the quantised-`wkv` kernels, and the decode kernels where
    /// they may run.
    fn preload_for(&self, wkv_kind: WkvKind) -> Result<()> {
        match wkv_kind {
            WkvKind::Quant(f) => self.gpu.preload(gpu::Kernel::GemvQ(f))?,
            WkvKind::Fp8Block { .. } => self.gpu.preload(gpu::Kernel::GemvFp8)?,
            _ => {}
        }
        // And the decode kernels where they may run.
        if matches!(wkv_kind, WkvKind::Bf16 | WkvKind::Fp8Block { .. })
            && self.state().decode_max > 0
        {
            self.gpu.preload(gpu::Kernel::Decode { fp8: false })?;
        }
        Ok(())
    }

    /// The workspaces a layer with `wkv_kind` needs beyond the others: f32
    /// rows and `kv` (an f32 `wkv`), the dequantised tile (quantised and
    /// fp8-block `wkv`); allocated once per context.
    fn grow_workspaces(&self, st: &mut State, wkv_kind: WkvKind) -> Result<()> {
        let (m, k_in, k_out) = (self.max_tokens, self.shape.k_in, self.shape.k_out);
        if wkv_kind == WkvKind::F32 && st.rows32.is_none() {
            st.rows32 = Some(DevBuf::new(
                &self.gpu,
                m.checked_mul(k_in * 4)
                    .ok_or_else(|| overflow("f32 rows"))?,
                "f32 rows",
            )?);
            st.kv32 = Some(DevBuf::new(
                &self.gpu,
                m.checked_mul(k_out * 4).ok_or_else(|| overflow("f32 kv"))?,
                "f32 kv",
            )?);
        }
        if matches!(wkv_kind, WkvKind::Quant(_) | WkvKind::Fp8Block { .. }) && st.tile.is_none() {
            // A multiple of 8 rows, so that each tile's kv columns start
            // 16-byte aligned for cuBLAS.
            let rows = (TILE_BYTES / (2 * k_in) / 8 * 8).clamp(8.min(k_out), k_out);
            st.tile = Some((
                DevBuf::new(&self.gpu, rows * k_in * 2, "the dequantised wkv tile")?,
                rows,
            ));
        }
        Ok(())
    }

    /// A host table's prefetch memory: pinned memory of the layer's own
    /// (one per stager slot), which the prefetches gather into and from
    /// which the applies copy the rows to the device.
    fn prefetch_staging(&self, rb: usize, aux: bool) -> Result<Vec<Arc<Staging>>> {
        let (ids, rows) = Self::staging_bytes(self.max_tokens, self.shape.cols, rb)?;
        let aux_cells = if aux {
            self.max_tokens * self.shape.cols
        } else {
            0
        };
        (0..crate::cpu::stager::SLOTS)
            .map(|_| {
                Staging::new(
                    &self.gpu,
                    ids,
                    rows,
                    aux_cells,
                    "the prefetch staging memory",
                )
                .map(Arc::new)
            })
            .collect()
    }

    /// A device row cache of `capacity` slots of `rb` bytes for a host-table
    /// layer: its per-call arrays and host plan (the slots themselves are
    /// allocated with the layer's staging rows).
    fn new_cache(&self, capacity: usize) -> Result<DevCache> {
        let cells = self.max_tokens * self.shape.cols;
        let kind = self.cache_policy;
        Ok(DevCache {
            capacity,
            base: cells as u32,
            slots: DevBuf::new(&self.gpu, cells * 4, "the device cache's row indices")?,
            fill: DevBuf::new(&self.gpu, cells * 8, "the device cache's admissions")?,
            plan: Mutex::new(devcache::Plan::new(kind, capacity, cells)?),
            counters: Default::default(),
            kind,
        })
    }

    /// The device rows of a cached host-table layer: the staging area's
    /// `cells` rows and the cache's `capacity` slots, `rb` bytes each. A
    /// budget the device cannot give is `ErrCapacity`.
    fn cache_rows(&self, budget: u64, cells: usize, capacity: usize, rb: usize) -> Result<DevBuf> {
        let bytes = cells.checked_add(capacity).and_then(|r| r.checked_mul(rb));
        let refuse = |why: String| {
            Error::new(
                EngramStatus::ErrCapacity,
                format!("device_cache_bytes = {budget}: the device cannot hold the cache: {why}"),
            )
        };
        let bytes = bytes.ok_or_else(|| refuse("too many bytes".into()))?;
        DevBuf::new(&self.gpu, bytes, "the staged rows and the device row cache")
            .map_err(|e| refuse(e.message))
    }

    /// Where layer `li`'s table is for the kernels: a device table's
    /// addresses (the stager forgets a host table the layer had), or a host
    /// table's staging buffers on the device (and a device cache of
    /// `capacity` rows, 0: none), with the stager reading `host_source` into
    /// `prefetch`.
    #[allow(clippy::too_many_arguments)]
    fn table_loc(
        &self,
        st: &mut State,
        li: usize,
        l: &CheckedLayer<'_>,
        host_source: Option<Source>,
        prefetch: Vec<Arc<Staging>>,
        rb: usize,
        capacity: usize,
    ) -> Result<TableLoc> {
        let (m, s) = (self.max_tokens, self.shape);
        Ok(match host_source {
            None => {
                // The stager forgets a host table this layer had (and waits
                // for any gather still reading it).
                self.stager
                    .set_source(li, Source::memory(&[]), l.format, rb)?;
                let addr = |src: &TableSource<'_>| match src {
                    TableSource::Memory(r) => r.addr() as u64,
                    TableSource::File { .. } => unreachable!("a file is a host table"),
                };
                TableLoc::Device {
                    table: addr(&l.source),
                    scales: l.scales.as_ref().map_or(0, addr),
                }
            }
            Some(src) => {
                let cells = m.checked_mul(s.cols).ok_or_else(|| overflow("staging"))?;
                let cache = match capacity {
                    0 => None,
                    c => Some(Box::new(self.new_cache(c)?)),
                };
                let rows = match cache {
                    None => DevBuf::new(
                        &self.gpu,
                        cells.checked_mul(rb).ok_or_else(|| overflow("staging"))?,
                        "the staged table rows",
                    )?,
                    Some(_) => self.cache_rows(st.cache_bytes, cells, capacity, rb)?,
                };
                let ids = DevBuf::new(&self.gpu, cells * 8, "the staged row ids")?;
                // No position is staged yet: an id no row has.
                // SAFETY: our own allocation of `cells` ids.
                unsafe { self.own_memset(ids.ptr, 0x80, cells * 8)? };
                Self::grow_slots_in(&self.gpu, st, m, s.cols, rb, cache.is_some())?;
                let mem = prefetch
                    .iter()
                    .map(|b| b.clone() as Arc<dyn InPlace>)
                    .collect();
                let gen = self
                    .stager
                    .set_source_in_place(li, src, l.format, rb, mem)?;
                TableLoc::Host {
                    gen,
                    rows,
                    ids,
                    prefetch,
                    cache,
                }
            }
        })
    }

    /// `set_layer`'s check of a block-scaled fp8 `wkv`'s codes and scales
    /// ([`Fp8Blocks::check`]): host arrays in place; device arrays copied to
    /// the host on the context's own stream (waiting for it alone, never the
    /// whole context), the scales whole and the codes 16 MB at a time (whole
    /// rows of blocks).
    fn check_fp8_wkv(&self, l: &CheckedLayer<'_>) -> Result<()> {
        // The outputs the layer holds (a shard context's part of them).
        let k = self.shape.k_in;
        let rows = l.bytes.wkv / l.wkv_type.row_bytes(k).max(1);
        let (br, bc) = l.wkv_block;
        let what = format!("layer {}: weights.wkv", l.layer_id);
        let Some(sr) = l.wkv_scales else {
            bail!(
                ErrInternal,
                "a block-scaled fp8 wkv reached the backend without scales"
            );
        };
        let get = |addr: usize, bytes: usize, what: &str| -> Result<Vec<u8>> {
            let mut v = crate::batch::try_vec(bytes, 0u8, what)?;
            // SAFETY: device memory of the context's device holding `bytes`
            // (check_device_range below, before each call); `v` holds as
            // many and outlives the wait (own_download waits for the copy).
            unsafe { self.own_download(v.as_mut_ptr(), addr as u64, bytes)? };
            Ok(v)
        };
        let owned;
        let scales: &[u8] = match self.place(sr.addr()) {
            // SAFETY: host memory the context lends, sized by its checks.
            Place::Host => unsafe { sr.host() },
            Place::Device => {
                let n = l.bytes.wkv_scales;
                gpu::check_device_range(&*self.gpu, sr.addr() as u64, n, "weights.wkv_scales")?;
                owned = get(sr.addr(), n, "the copy of weights.wkv_scales checked")?;
                &owned
            }
        };
        match self.place(l.wkv.addr()) {
            Place::Host => {
                // SAFETY: as the scales: `place` found `l.wkv` to be host memory (what
                // `Region::host` requires), sized by the context's checks.
                let codes = unsafe { l.wkv.host() };
                Fp8Blocks::new(codes, scales, k, br, bc)?.check_err(&what)
            }
            Place::Device => {
                gpu::check_device_range(
                    &*self.gpu,
                    l.wkv.addr() as u64,
                    l.bytes.wkv,
                    "weights.wkv",
                )?;
                let nbc = k.div_ceil(bc);
                let band = ((16usize << 20) / k.max(1) / br).max(1) * br;
                let mut r0 = 0;
                while r0 < rows {
                    let r1 = (r0 + band).min(rows);
                    let codes = get(
                        l.wkv.addr() + r0 * k,
                        (r1 - r0) * k,
                        "the wkv codes checked",
                    )?;
                    let sc = &scales[(r0 / br) * nbc..r1.div_ceil(br) * nbc];
                    Fp8Blocks::new(&codes, sc, k, br, bc)?.check_err_from(r0, &what)?;
                    r0 = r1;
                }
                Ok(())
            }
        }
    }

    /// Device bytes this backend allocated.
    pub fn device_bytes(&self) -> usize {
        let s = self.state();
        let opt = |b: &Option<DevBuf>| b.as_ref().map_or(0, |b| b.bytes);
        let layers: usize = s
            .layers
            .iter()
            .flatten()
            .map(|l| {
                l.wkv_copy.as_ref().map_or(0, |b| b.bytes)
                    + l.wkv_scales_copy.as_ref().map_or(0, |b| b.bytes)
                    + match &l.table {
                        TableLoc::Host {
                            rows, ids, cache, ..
                        } => {
                            rows.bytes
                                + ids.bytes
                                + cache.as_ref().map_or(0, |c| c.slots.bytes + c.fill.bytes)
                        }
                        TableLoc::Device { .. } => 0,
                    }
            })
            .sum();
        s.rows.bytes
            + s.kv.bytes
            + opt(&s.rows32)
            + opt(&s.kv32)
            + s.tile.as_ref().map_or(0, |t| t.0.bytes)
            + s.ids.bytes
            + s.flags.bytes
            + s.latch.bytes
            + s.done.bytes
            + s.blas.device_bytes()
            + self.qk.iter().map(|b| b.bytes).sum::<usize>()
            + self.hash.as_ref().map_or(0, |h| h.device_bytes())
            + layers
    }

    /// Pinned host bytes this backend allocated (staging slots, mirror).
    pub fn pinned_bytes(&self) -> usize {
        let s = self.state();
        let prefetch: usize = s
            .layers
            .iter()
            .flatten()
            .map(|l| match &l.table {
                TableLoc::Host { prefetch, .. } => prefetch.iter().map(|b| b.buf.bytes).sum(),
                TableLoc::Device { .. } => 0,
            })
            .sum();
        s.slots.iter().map(|x| x.buf.bytes).sum::<usize>() + prefetch + self.mirror.bytes
    }

    /// The table rows of a layer, by id, for error messages.
    fn rows_of(st: &State, layer: u32) -> u64 {
        st.layers
            .iter()
            .flatten()
            .find(|l| l.layer_id == layer)
            .map_or(0, |l| l.rows)
    }

    /// Report (and clear) an error the device recorded for an earlier call.
    fn take_device_error(&self, st: &State) -> Result<()> {
        // SAFETY: the mirror is LATCH_WORDS u32 of pinned memory we own.
        unsafe { latch::take(self.mirror.ptr as *mut u32, |l| Self::rows_of(st, l)) }
    }

    /// Where `addr` lives, as the driver sees it.
    /// A table's source: `None` for device memory (its range checked, as
    /// `weights.<what>`), else what the stager reads (host memory or a file).
    fn table_source(
        &self,
        src: &TableSource<'_>,
        bytes: u64,
        layer_id: u32,
        what: &str,
    ) -> Result<Option<Source>> {
        Ok(match src {
            TableSource::Memory(r) => match self.place(r.addr()) {
                Place::Device => {
                    let name =
                        format!("weights.{}", what.replace("table's scales", "table_scales"));
                    gpu::check_device_range(&*self.gpu, r.addr() as u64, bytes as usize, &name)?;
                    None
                }
                // SAFETY: host memory the context lends for `'w`, sized by
                // the context's checks (`Region::from_raw`'s contract).
                Place::Host => Some(Source::memory(unsafe { r.host() })),
            },
            TableSource::File { file, offset } => {
                Some(Source::file(file.clone(), *offset, bytes, layer_id, what)?)
            }
        })
    }

    fn place(&self, addr: usize) -> Place {
        match self.gpu.pointer(addr as u64) {
            None => Place::Host,
            Some(i) if i.kind == MemKind::Host => Place::Host,
            Some(_) => Place::Device,
        }
    }

    /// The bytes of a region: read from the device, or the host memory itself.
    fn region_bytes(
        &self,
        r: &crate::memory::Region<'_>,
        bytes: usize,
        what: &str,
    ) -> Result<Vec<u8>> {
        let mut v = crate::batch::try_vec(bytes, 0u8, what)?;
        match self.place(r.addr()) {
            Place::Device => {
                gpu::check_device_range(&*self.gpu, r.addr() as u64, bytes, what)?;
                // SAFETY: checked above: `bytes` of device memory.
                unsafe { self.own_download(v.as_mut_ptr(), r.addr() as u64, bytes)? };
            }
            Place::Host => {
                // SAFETY: host memory the context lends (`Region::from_raw`'s
                // contract), sized by the context's checks.
                v.copy_from_slice(unsafe { &r.host()[..bytes] });
            }
        }
        Ok(v)
    }

    /// `q * k` (`hc * D` f32) formed on the host exactly as the CPU backend
    /// forms it, from `q` and `k` of type `ty` wherever they are.
    fn qk_of(&self, l: &CheckedLayer<'_>) -> Result<Vec<f32>> {
        let read = |r: &crate::memory::Region<'_>, what: &str| -> Result<Vec<f32>> {
            let raw = self.region_bytes(r, l.bytes.qk, what)?;
            Ok(if l.qk_type == EngramType::F32 {
                raw.chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            } else {
                raw.chunks_exact(2)
                    .map(|b| bf16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                    .collect()
            })
        };
        let (q, k) = (read(&l.q, "weights.q")?, read(&l.k, "weights.k")?);
        Ok(q.iter().zip(&k).map(|(a, b)| a * b).collect())
    }
}

impl<'w> Backend<'w> for CudaBackend {
    fn set_row_cache(&self, per_layer: u64, policy: crate::rowcache::PolicyKind) -> Result<()> {
        self.stager.set_row_cache(per_layer, policy);
        Ok(())
    }

    fn host_cache_stats(&self, li: usize) -> Option<&crate::rowcache::TierStats> {
        self.stager.cache_stats(li)
    }

    fn enable_device_hash(
        &mut self,
        tables: &crate::hash::HashTables,
        limits: crate::batch::Limits,
        ring_len: usize,
    ) -> Result<()> {
        CudaBackend::enable_device_hash(self, tables, limits, ring_len)
    }

    fn hash_device(&self, call: &DeviceHashIn) -> Result<()> {
        self.hash_on_device(call)
    }

    fn seq_op_device(&self, op: DeviceSeqOp, stream: Stream) -> Result<()> {
        self.seq_op_on_device(op, stream)
    }

    fn seq_entries_device(&self, seq: i32, stream: Stream) -> Result<Vec<(usize, i32)>> {
        self.seq_entries_on_device(seq, stream)
    }

    fn seq_load_device(&self, seq: i32, entries: &[(usize, i32)], stream: Stream) -> Result<()> {
        self.seq_load_on_device(seq, entries, stream)
    }

    fn info(&self) -> BackendInfo {
        BackendInfo {
            kind: EngramBackend::Cuda,
            kernel: self.gpu.describe(),
            host_bytes: self.pinned_bytes(),
            device_bytes: self.device_bytes(),
            stage: self.stager.stats(),
            decode: self.state().decode_stats,
        }
    }

    fn takes_device_ids(&self) -> bool {
        true
    }

    fn set_device_cache(&mut self, bytes: u64, policy: PolicyKind) -> Result<()> {
        self.cache_policy = policy;
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if st.layers.iter().any(|l| l.is_some()) {
            bail!(
                ErrInvalidArgument,
                "device_cache_bytes is chosen at create, before any layer is set"
            );
        }
        st.cache_bytes = bytes;
        Ok(())
    }

    fn device_cache_stats(&self, li: usize) -> Option<crate::call::DeviceCacheStats> {
        let st = self.state();
        match st.layers.get(li)?.as_deref()? {
            DevLayer {
                table: TableLoc::Host { cache: Some(c), .. },
                ..
            } => Some(c.counters.snapshot(c.capacity as u64, c.kind)),
            _ => None,
        }
    }

    fn device_cache_stats_reset(&self) {
        let st = self.state();
        for l in st.layers.iter().flatten() {
            if let TableLoc::Host { cache: Some(c), .. } = &l.table {
                c.counters.reset();
            }
        }
    }

    /// Register (or replace) layer `li`'s weights: the table in device
    /// memory, host memory or a file; `wkv` in device memory or (copied once
    /// to the device) host memory; `q` and `k` anywhere (read now to form
    /// `q * k`). Waits for the device to be idle before replacing anything a
    /// queued call may still read.
    fn set_layer(&self, li: usize, l: CheckedLayer<'w>) -> Result<()> {
        let rb = l.format.row_bytes(self.shape.geo.hd);
        let mut wkv_kind = Self::wkv_kind_of(&l)?;
        if matches!(wkv_kind, WkvKind::Fp8Block { .. }) {
            // Every code and scale, before anything changes.
            self.check_fp8_wkv(&l)?;
        }
        let host_source = self.host_table_source(&l)?;
        let (wkv, wkv_copy, wkv_scales_copy) = self.place_wkv(&l, &mut wkv_kind)?;
        let qk = self.qk_of(&l)?;
        self.preload_for(wkv_kind)?;
        let mut st = self.state();
        self.grow_workspaces(&mut st, wkv_kind)?;
        let capacity = match (&host_source, st.cache_bytes) {
            (Some(_), b) if b > 0 => {
                devcache::capacity_of(b, rb, self.max_tokens * self.shape.cols)?
            }
            _ => 0,
        };
        let prefetch = match host_source {
            Some(_) => self.prefetch_staging(rb, capacity > 0)?,
            None => Vec::new(),
        };
        // Nothing queued may read what is replaced below: wait for this
        // context's last call (not for the whole context, which would wait
        // for the engine's unrelated work and break another thread's capture).
        self.wait_last(&st)?;
        let table = self.table_loc(&mut st, li, &l, host_source, prefetch, rb, capacity)?;
        // SAFETY: `qk[li]` holds `qk.len()` floats.
        unsafe {
            self.own_upload(self.qk[li].ptr, qk.as_ptr() as *const u8, qk.len() * 4)?;
        }
        st.layers[li] = Some(Arc::new(DevLayer {
            layer_id: l.layer_id,
            rows: l.rows,
            format: l.format,
            row_bytes: rb,
            table,
            wkv,
            wkv_kind,
            wkv_copy,
            wkv_scales_copy,
        }));
        Ok(())
    }

    fn stage(&self, li: usize, live: &LiveIds) -> Result<()> {
        let st = self.state();
        match st.layers[li].as_deref() {
            Some(DevLayer {
                table: TableLoc::Host { .. },
                ..
            }) => {
                drop(st);
                self.stager
                    .stage_at(li, &live.ids, &live.tokens, self.shape.cols)
            }
            // Device tables need no staging: the gather kernel reads them.
            _ => Ok(()),
        }
    }

    fn stage_device(
        &self,
        li: usize,
        all: &[i64],
        live: &LiveIds,
        n: usize,
        stream: Stream,
    ) -> Result<()> {
        self.stage_rows(li, all, live, n, stream)
    }

    fn apply(&self, li: usize, call: ApplyIn<'_>) -> Result<()> {
        let hw = (call.highway.addr() as u64, call.highway_type);
        let mut st = self.state();
        self.enqueue(&mut st, li, call.ids, call.n, Some(hw), call.stream)
    }

    /// The pipeline's intermediate results for all `n` tokens: runs on the
    /// backend's own stream, after the work of the context's last call (the
    /// stream waits for its event), and waits for that stream only.
    fn read_back(&self, li: usize, ids: Ids<'_>, n: usize) -> Result<ReadBack> {
        let mut st = self.state();
        let own = self.own.s;
        if st.last_used {
            // SAFETY: a live event; our own stream.
            unsafe { self.gpu.stream_wait_event(own, st.last.ev)? };
        }
        self.enqueue(&mut st, li, ids, n, None, own)?;
        let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
        let f32_path = st.layers[li]
            .as_ref()
            .is_some_and(|l| l.wkv_kind == WkvKind::F32);
        let get = |p: u64, bytes: usize| -> Result<Vec<u8>> {
            let mut v = crate::batch::try_vec(bytes, 0u8, "the values read back")?;
            // SAFETY: our buffers hold at least `bytes` (max_tokens >= n);
            // the copy follows this call's work on our stream.
            unsafe { self.own_download(v.as_mut_ptr(), p, bytes)? };
            Ok(v)
        };
        // This call's gather recorded any error in the latch (no gate ran to
        // move it to the mirror): report it now, and clear it.
        let raw = get(st.latch.ptr, latch::LATCH_WORDS * 4)?;
        let rec: [u32; latch::LATCH_WORDS] = std::array::from_fn(|i| {
            u32::from_le_bytes([raw[4 * i], raw[4 * i + 1], raw[4 * i + 2], raw[4 * i + 3]])
        });
        if rec[0] != 0 {
            // SAFETY: our own allocation.
            unsafe { self.own_memset(st.latch.ptr, 0, latch::LATCH_WORDS * 4)? };
            return Err(latch::error_of(&rec, |l| Self::rows_of(&st, l), ""));
        }
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
        Ok(if f32_path {
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
        })
    }

    fn gather_device(
        &self,
        li: usize,
        cells: &[i64],
        out: DevValues,
        stream: Stream,
    ) -> Result<()> {
        self.gather_on_device(li, cells, out, stream)
    }

    fn project_device(
        &self,
        li: usize,
        n: usize,
        rows: DevValues,
        lohi: (usize, usize),
        kv: DevValues,
        stream: Stream,
    ) -> Result<()> {
        self.project_on_device(li, n, rows, lohi, kv, stream)
    }

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
        self.gate_on_device(li, n, live, values, from_rows, highway, stream)
    }

    /// Wait for `stream`, then report any asynchronous CUDA error and any error
    /// the device recorded for this context's calls.
    fn check(&self, stream: Stream) -> Result<()> {
        let st = self.state();
        self.gpu.stream_synchronize(stream)?;
        self.take_device_error(&st)
    }

    /// Copied back from the device buffer `set_layer` filled (synchronously),
    /// on the context's own stream (not a context-wide wait).
    fn gate_weights(&self, li: usize) -> Result<Vec<f32>> {
        let _st = self.state();
        let n = self.shape.hw_per_token();
        let mut v = crate::batch::try_vec(n, 0f32, "the layer's q * k")?;
        // SAFETY: `qk[li]` holds `n` f32 values (allocated so at create),
        // `v` as many.
        unsafe { self.own_download(v.as_mut_ptr().cast(), self.qk[li].ptr, n * 4)? };
        Ok(v)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Work queued by this context may still read its buffers: wait for
        // its last call's work (and our own stream) before they are freed
        // (the fields drop after this). engram_free's contract leaves no
        // graph replay queued.
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if st.last_used {
            // SAFETY: a live event of this device.
            let _ = unsafe { self.gpu.event_wait(st.last.ev) };
        }
        let _ = self.gpu.stream_synchronize(self.own.s);
    }
}
