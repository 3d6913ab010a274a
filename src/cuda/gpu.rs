//! The one interface between the CUDA backend and a device: memory, copies,
//! events, stream queries, kernel launches and the GEMM. Two implementations:
//! [`super::driver::RealGpu`] (the CUDA driver, NVRTC and cuBLAS) and
//! [`super::emu::EmuGpu`] (device memory is host memory, copies are copies,
//! events and streams are trivial, launches run the kernels' own source
//! through the SIMT shim of `tests/simt`, the GEMM is a host loop), so that
//! everything [`super::CudaBackend`] does runs unchanged on a machine without
//! a GPU.
//!
//! Every method makes the device's context current for its own duration
//! (and restores the caller's), so callers need no scope of their own.

use crate::error::{bail, EngramStatus, Error, Result};
use std::ffi::c_void;
use std::sync::Arc;

/// A device address.
pub type DevPtr = u64;
/// A `CUstream` (NULL: the legacy default stream).
pub type Stream = *mut c_void;

/// What kind of memory an address is, as the driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemKind {
    /// Device memory (`cuMemAlloc`, a pool, a VMM mapping).
    Device,
    /// Page-locked host memory the driver knows (`cuMemHostAlloc`,
    /// `cudaHostAlloc`, `cudaHostRegister`).
    Host,
    /// Managed memory (`cudaMallocManaged`).
    Unified,
}

/// What the driver knows of an address.
#[derive(Clone, Copy, Debug)]
pub struct PtrInfo {
    pub kind: MemKind,
    /// The device of device memory (-1 when the driver does not say).
    pub ordinal: i32,
    /// The allocation (or mapped piece) holding it, `(base, bytes)`, when the
    /// driver knows it.
    pub range: Option<(u64, usize)>,
    /// Host memory mapped into the device's address space (usable by kernels).
    pub mapped: bool,
}

/// One kernel argument: the address and size of its value (what
/// `cuLaunchKernel`'s `kernelParams` points to; the emulation also checks
/// the sizes against the kernel's parameters).
#[derive(Clone, Copy, Debug)]
pub struct Arg {
    pub ptr: *mut c_void,
    pub size: usize,
}

/// The argument array of a launch: `args![a, b, c]` takes each by reference.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$($crate::cuda::gpu::Arg { ptr: &$a as *const _ as *mut std::ffi::c_void, size: std::mem::size_of_val(&$a) }),*]
    };
}
pub(crate) use args;

/// The kernels of `kernels/`, as the backend launches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Gather,
    /// `engram_gather_split`: the gather of a device table in the split fp8
    /// format (codes and scales in two arrays; one more argument, `scales`).
    GatherSplit,
    /// `engram_gate_<highway>_<kv>`.
    Gate {
        hw_bf16: bool,
        kv_f32: bool,
    },
    /// `engram_gemv_bf16_<n>`, n in 1..=GEMV_MAX.
    Gemv(usize),
    /// `engram_gemv_q_<format>`: the fused dequantising GEMV of a `wkv` read
    /// in place (f16 or a GGUF block format), for up to GEMV_MAX tokens.
    GemvQ(crate::formats::EngramType),
    /// `engram_dequant_bf16`: rows of a quantised `wkv` to bf16 (a GEMM tile).
    Dequant,
    /// `engram_gemv_fp8_block`: the bf16 GEMV's sums over a block-scaled fp8
    /// `wkv` converted in registers, for up to GEMV_MAX tokens.
    GemvFp8,
    /// `engram_dequant_fp8_block`: rows of a block-scaled fp8 `wkv` to bf16.
    DequantFp8,
    /// The device hash (`kernels/hash.cu`): the run check, the ids, the
    /// commit to the ring, the range operations on the ring (copy, remove,
    /// keep: `HashSeqEdit`) and the shift of a range (three launches).
    HashRuns,
    HashIds,
    HashCommit,
    HashSeqEdit,
    HashShiftScan,
    HashShiftWrite,
    HashShiftDone,
    /// `engram_decode_<bf16|fp8>`: the decode kernel (docs/cuda.md): phase A
    /// (the gather into shared memory, the projection in the GEMV's order)
    /// or with a highway phase A and then the gate in the last block done
    /// (an ordinary launch: no block waits for another).
    Decode {
        fp8: bool,
    },
    /// `engram_gather_shard`: the rows a shard owns into the engine's buffer,
    /// `-0.0` elsewhere (the split points, docs/sharding.md).
    GatherShard,
    /// `engram_convert_values`: f32 or bf16 values between buffers (the
    /// split points' values in and out).
    Convert,
    /// `engram_cache_fill`: a call's admissions into a host table's device
    /// row cache (rows copied from the call's staging area into cache slots).
    CacheFill,
}

/// Every kernel's name, in [`Kernel::index`] order.
pub const KERNEL_NAMES: [&str; 37] = [
    "engram_gather",
    "engram_gate_f32_bf16",
    "engram_gate_f32_f32",
    "engram_gate_bf16_bf16",
    "engram_gate_bf16_f32",
    "engram_gemv_bf16_1",
    "engram_gemv_bf16_2",
    "engram_gemv_bf16_3",
    "engram_gemv_bf16_4",
    "engram_gemv_bf16_5",
    "engram_gemv_bf16_6",
    "engram_gemv_bf16_7",
    "engram_gemv_bf16_8",
    "engram_gemv_q_f16",
    "engram_gemv_q_q8_0",
    "engram_gemv_q_q4_0",
    "engram_gemv_q_q2_k",
    "engram_gemv_q_q3_k",
    "engram_gemv_q_q4_k",
    "engram_gemv_q_q5_k",
    "engram_gemv_q_q6_k",
    "engram_dequant_bf16",
    "engram_gather_split",
    "engram_gemv_fp8_block",
    "engram_dequant_fp8_block",
    "engram_hash_runs",
    "engram_hash_ids",
    "engram_hash_commit",
    "engram_hash_seq_edit",
    "engram_hash_shift_scan",
    "engram_hash_shift_write",
    "engram_hash_shift_done",
    "engram_decode_bf16",
    "engram_decode_fp8",
    "engram_gather_shard",
    "engram_convert_values",
    "engram_cache_fill",
];

/// The `wkv` formats of [`Kernel::GemvQ`], in [`KERNEL_NAMES`] order.
pub const GEMV_Q_FORMATS: [crate::formats::EngramType; 8] = {
    use crate::formats::EngramType::*;
    [F16, Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K]
};

impl Kernel {
    /// Which of [`super::kernels::MODULES`] holds it.
    pub fn module(self) -> usize {
        match self {
            Kernel::GemvQ(_) | Kernel::Dequant | Kernel::GemvFp8 | Kernel::DequantFp8 => 1,
            Kernel::Decode { .. } => 2,
            _ => 0,
        }
    }

    /// Every kernel, in [`KERNEL_NAMES`] order.
    pub fn all() -> Vec<Kernel> {
        use super::kernels::GEMV_MAX;
        let mut v = vec![Kernel::Gather];
        for hw_bf16 in [false, true] {
            for kv_f32 in [false, true] {
                v.push(Kernel::Gate { hw_bf16, kv_f32 });
            }
        }
        v.extend((1..=GEMV_MAX).map(Kernel::Gemv));
        v.extend(GEMV_Q_FORMATS.map(Kernel::GemvQ));
        v.push(Kernel::Dequant);
        v.push(Kernel::GatherSplit);
        v.push(Kernel::GemvFp8);
        v.push(Kernel::DequantFp8);
        v.extend([
            Kernel::HashRuns,
            Kernel::HashIds,
            Kernel::HashCommit,
            Kernel::HashSeqEdit,
            Kernel::HashShiftScan,
            Kernel::HashShiftWrite,
            Kernel::HashShiftDone,
        ]);
        v.extend([false, true].map(|fp8| Kernel::Decode { fp8 }));
        v.extend([Kernel::GatherShard, Kernel::Convert, Kernel::CacheFill]);
        v
    }

    /// Whether its launches take more than 48 KiB of dynamic shared memory
    /// (the device's opt-in is set for it when its module is loaded).
    pub fn big_shared(self) -> bool {
        matches!(self, Kernel::Decode { .. })
    }

    /// Its position in [`KERNEL_NAMES`].
    pub fn index(self) -> usize {
        use super::kernels::GEMV_MAX;
        match self {
            Kernel::Gather => 0,
            Kernel::Gate { hw_bf16, kv_f32 } => 1 + 2 * hw_bf16 as usize + kv_f32 as usize,
            Kernel::Gemv(n) => {
                assert!((1..=GEMV_MAX).contains(&n), "GEMV of {n} tokens");
                4 + n
            }
            Kernel::GemvQ(f) => {
                let i = GEMV_Q_FORMATS
                    .iter()
                    .position(|&x| x == f)
                    .unwrap_or_else(|| panic!("no fused GEMV for {f:?}"));
                5 + GEMV_MAX + i
            }
            Kernel::Dequant => 5 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::GatherSplit => 6 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::GemvFp8 => 7 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::DequantFp8 => 8 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashRuns => 9 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashIds => 10 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashCommit => 11 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashSeqEdit => 12 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashShiftScan => 13 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashShiftWrite => 14 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::HashShiftDone => 15 + GEMV_MAX + GEMV_Q_FORMATS.len(),
            Kernel::Decode { fp8 } => 16 + GEMV_MAX + GEMV_Q_FORMATS.len() + fp8 as usize,
            // After the two decode kernels.
            Kernel::GatherShard => Kernel::Decode { fp8: true }.index() + 1,
            Kernel::Convert => Kernel::Decode { fp8: true }.index() + 2,
            Kernel::CacheFill => Kernel::Decode { fp8: true }.index() + 3,
        }
    }

    pub fn name(self) -> &'static str {
        KERNEL_NAMES[self.index()]
    }
}

/// `kv[n, ldc] (columns 0..m of it) = rows[n, k] @ w[m, k]^T`, all row-major
/// with the leading dimensions given, on `stream`: bf16 in and out with f32
/// accumulation (`f32 == false`), or f32 in and out with f32 math
/// (`f32 == true`).
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub f32: bool,
    pub w: DevPtr,
    pub ldw: usize,
    pub rows: DevPtr,
    pub ldr: usize,
    pub kv: DevPtr,
    pub ldc: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// The projection's GEMM, one per context (a cuBLAS handle is not shared
/// between streams used at once).
pub trait Blas: Send {
    /// # Safety
    /// The pointers must hold the sizes [`Gemm`] describes on the device.
    unsafe fn gemm(&mut self, stream: Stream, g: &Gemm) -> Result<()>;
    /// Device bytes it holds (its workspace).
    fn device_bytes(&self) -> usize;
}

/// What the decode kernel needs to know of the device
/// ([`Gpu::device_limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Multiprocessors.
    pub sms: u32,
    /// Most dynamic shared memory a block can have (with the kernel's opt-in).
    pub max_shared: u32,
    /// Whether the device takes cooperative launches.
    pub cooperative: bool,
}

/// A device, as [`super::CudaBackend`] uses it.
pub trait Gpu: Send + Sync {
    /// The device and the libraries in use, for `BackendInfo`.
    fn describe(&self) -> String;
    /// The device's ordinal (for messages and pointer checks).
    fn ordinal(&self) -> i32;
    /// Make the device's context current on this thread until the guard drops
    /// (for callers that use the driver directly: tests, benchmarks).
    fn enter(&self) -> Result<Guard>;

    fn alloc(&self, bytes: usize, what: &str) -> Result<DevPtr>;
    /// # Safety
    /// `p` came from [`Gpu::alloc`] of this device and is freed once, with
    /// nothing queued that still uses it.
    unsafe fn free(&self, p: DevPtr);
    /// Page-locked host memory, zeroed; `mapped`: also its device address
    /// (else 0).
    fn host_alloc(&self, bytes: usize, mapped: bool, what: &str) -> Result<(*mut u8, DevPtr)>;
    /// # Safety
    /// As [`Gpu::free`], for [`Gpu::host_alloc`].
    unsafe fn host_free(&self, p: *mut u8);

    /// `bytes` of `v` at `p`, complete on the device when it returns: on the
    /// legacy stream, then a wait for the whole context. For tests and
    /// benchmarks; the backend queues [`Gpu::memset_async`] on its own stream.
    ///
    /// # Safety
    /// `p` holds `bytes` on the device.
    unsafe fn memset(&self, p: DevPtr, v: u8, bytes: usize) -> Result<()>;
    /// Copy host memory to the device, complete when it returns (the legacy
    /// stream, then a wait for the whole context; tests and benchmarks).
    ///
    /// # Safety
    /// `dst` holds `bytes` on the device; `src` is readable for `bytes`.
    unsafe fn upload(&self, dst: DevPtr, src: *const u8, bytes: usize) -> Result<()>;
    /// Wait for the whole context, then copy device memory to the host
    /// (tests and benchmarks).
    ///
    /// # Safety
    /// `src` holds `bytes` on the device; `dst` is writable for `bytes`.
    unsafe fn download(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> Result<()>;
    /// Queue a copy from host memory on `stream`. From pageable memory the
    /// source is consumed when it returns; from page-locked memory it is
    /// read when the copy runs.
    ///
    /// # Safety
    /// As [`Gpu::upload`]; page-locked `src` (from [`Gpu::host_alloc`]) is
    /// left unchanged until the copy has run.
    unsafe fn upload_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Queue a copy from the device to host memory on `stream`; `dst` holds
    /// the bytes once the stream is synchronised.
    ///
    /// # Safety
    /// As [`Gpu::download`], with `dst` left alone until the copy has run.
    unsafe fn download_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        stream: Stream,
    ) -> Result<()>;
    /// Queue `bytes` of `v` at `p` on `stream`.
    ///
    /// # Safety
    /// `p` holds `bytes` on the device.
    unsafe fn memset_async(&self, p: DevPtr, v: u8, bytes: usize, stream: Stream) -> Result<()>;

    /// A new stream of the device's context that does not synchronise with
    /// the legacy stream (`CU_STREAM_NON_BLOCKING`): the backend's own work
    /// (`set_layer`'s copies, `read_back`) runs there, so it neither waits
    /// for the engine's unrelated work nor touches a capture in progress.
    fn stream_new(&self) -> Result<Stream>;
    /// # Safety
    /// A stream from [`Gpu::stream_new`] of this device, with nothing queued
    /// on it still to run, destroyed once.
    unsafe fn stream_free(&self, stream: Stream);
    /// Make later work on `stream` wait (on the device) for the work queued
    /// before the event's last record.
    ///
    /// # Safety
    /// A live event; `stream` a stream of this device or NULL.
    unsafe fn stream_wait_event(&self, stream: Stream, ev: usize) -> Result<()>;

    fn event_new(&self) -> Result<usize>;
    /// # Safety
    /// An event of this device, destroyed once.
    unsafe fn event_free(&self, ev: usize);
    /// # Safety
    /// A live event; `stream` a stream of this device or NULL.
    unsafe fn event_record(&self, ev: usize, stream: Stream) -> Result<()>;
    /// Wait on the host until the work before the event's last record has run.
    ///
    /// # Safety
    /// A live event.
    unsafe fn event_wait(&self, ev: usize) -> Result<()>;

    /// Wait for all work on the device's context.
    fn synchronize(&self) -> Result<()>;
    /// Wait for `stream`. The handle goes to the driver as it is: it must be
    /// a live stream or NULL (the C ABI's contract for every `stream`).
    fn stream_synchronize(&self, stream: Stream) -> Result<()>;
    /// Whether `stream` is capturing a graph; when it is not, also that it
    /// belongs to this device's context (`ErrInvalidArgument` otherwise).
    /// The handle's contract is [`Gpu::stream_synchronize`]'s.
    fn stream_capturing(&self, stream: Stream) -> Result<bool>;

    /// What the driver knows of `p` (`None`: nothing: pageable host memory,
    /// or not memory at all).
    fn pointer(&self, p: u64) -> Option<PtrInfo>;

    /// Launch `k` on a 1-D grid of `grid` blocks of `block` threads.
    ///
    /// # Safety
    /// `args` match the kernel's parameters and every pointer among them is
    /// valid for what the kernel does with it.
    unsafe fn launch(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<()>;

    /// As [`Gpu::launch`], with `shared` bytes of dynamic shared memory
    /// (more than 48 KiB only for kernels whose [`Kernel::big_shared`] says so).
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_shared(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<()>;

    /// As [`Gpu::launch_shared`], for a launch with a fallback: `Ok(false)`
    /// when the driver refuses the launch with an error that queues nothing
    /// and leaves the context usable (too many resources or too much shared
    /// memory for this context, no image for the device, not permitted or
    /// not supported here: [`super::driver::is_refusal`]); every other error
    /// is `Err`.
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn try_launch_shared(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        stream: Stream,
        args: &[Arg],
    ) -> Result<bool>;

    /// The device's multiprocessors, shared memory and cooperative launch.
    fn device_limits(&self) -> Result<DeviceLimits>;

    /// Blocks of `k` of `block` threads with `shared` bytes of dynamic shared
    /// memory one multiprocessor holds at once
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
    fn occupancy(&self, k: Kernel, block: u32, shared: u32) -> Result<u32>;

    /// A GEMM for one context.
    fn new_blas(&self) -> Result<Box<dyn Blas>>;

    /// Make sure `k` can be launched (the real device compiles and loads the
    /// module holding it the first time; a launch does so too, but a caller
    /// that can wait now, `set_layer`, calls this so the first apply does not).
    fn preload(&self, k: Kernel) -> Result<()> {
        let _ = k;
        Ok(())
    }
}

/// The caller's context, restored on drop (see [`Gpu::enter`]).
pub struct Guard {
    pub(crate) restore: Option<Box<dyn FnOnce() + Send>>,
}

impl Guard {
    pub fn none() -> Guard {
        Guard { restore: None }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(f) = self.restore.take() {
            f();
        }
    }
}

/// Device memory owned by the backend (or a test), freed on drop.
pub struct DevBuf {
    gpu: Arc<dyn Gpu>,
    pub ptr: DevPtr,
    pub bytes: usize,
}

impl DevBuf {
    pub fn new(gpu: &Arc<dyn Gpu>, bytes: usize, what: &str) -> Result<DevBuf> {
        let ptr = gpu.alloc(bytes, what)?;
        Ok(DevBuf {
            gpu: gpu.clone(),
            ptr,
            bytes,
        })
    }

    /// A buffer as large as `data` (its content not set).
    pub fn sized_as<T>(gpu: &Arc<dyn Gpu>, data: &[T], what: &str) -> Result<DevBuf> {
        DevBuf::new(gpu, std::mem::size_of_val(data), what)
    }

    /// A buffer holding `data` (uploaded, complete when it returns).
    pub fn from_slice<T: Copy>(gpu: &Arc<dyn Gpu>, data: &[T], what: &str) -> Result<DevBuf> {
        let b = DevBuf::sized_as(gpu, data, what)?;
        b.write(data)?;
        Ok(b)
    }

    /// Overwrite the start of the buffer with `data` (complete when it returns).
    pub fn write<T: Copy>(&self, data: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(data);
        if bytes > self.bytes {
            bail!(
                ErrInvalidArgument,
                "{bytes} bytes into a buffer of {}",
                self.bytes
            );
        }
        // SAFETY: the buffer holds at least `bytes`; `data` is that many bytes.
        unsafe { self.gpu.upload(self.ptr, data.as_ptr() as *const u8, bytes) }
    }

    /// The first `n` values (after the device has finished its work).
    pub fn read<T: Copy + Default>(&self, n: usize) -> Result<Vec<T>> {
        let bytes = n * std::mem::size_of::<T>();
        if bytes > self.bytes {
            bail!(
                ErrInvalidArgument,
                "{bytes} bytes from a buffer of {}",
                self.bytes
            );
        }
        let mut v = crate::batch::try_vec(n, T::default(), "a device read")?;
        // SAFETY: as `write`, the other way.
        unsafe {
            self.gpu
                .download(v.as_mut_ptr() as *mut u8, self.ptr, bytes)?
        };
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by this device in `new`, freed once; its owner
        // waits for queued work before dropping it (the backend's Drop).
        unsafe { self.gpu.free(self.ptr) }
    }
}

/// Page-locked host memory (optionally mapped into the device), freed on drop.
pub struct PinnedBuf {
    gpu: Arc<dyn Gpu>,
    pub ptr: *mut u8,
    pub bytes: usize,
    /// Its device address when mapped (0 otherwise).
    pub dev_ptr: DevPtr,
}

// SAFETY: memory owned by this value; its owner decides who writes it (behind
// the backend's lock, or the device).
unsafe impl Send for PinnedBuf {}
// SAFETY: Sync for the reason Send is above: `&PinnedBuf` gives only the
// addresses; who writes the memory is decided by its owner (lock or device).
unsafe impl Sync for PinnedBuf {}

impl PinnedBuf {
    pub fn new(gpu: &Arc<dyn Gpu>, bytes: usize, mapped: bool, what: &str) -> Result<PinnedBuf> {
        let (ptr, dev_ptr) = gpu.host_alloc(bytes, mapped, what)?;
        Ok(PinnedBuf {
            gpu: gpu.clone(),
            ptr,
            bytes,
            dev_ptr,
        })
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once.
        unsafe { self.gpu.host_free(self.ptr) }
    }
}

/// An event (no timing), destroyed on drop.
pub struct Event {
    gpu: Arc<dyn Gpu>,
    pub ev: usize,
}

impl Event {
    pub fn new(gpu: &Arc<dyn Gpu>) -> Result<Event> {
        Ok(Event {
            gpu: gpu.clone(),
            ev: gpu.event_new()?,
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe { self.gpu.event_free(self.ev) }
    }
}

/// Most pieces [`check_device_range`] walks before it gives up.
pub const MAX_PIECES: usize = 1 << 16;

/// Check that `bytes` bytes at `ptr` are memory device `gpu` can address:
/// device memory of that device, managed memory, or page-locked host memory
/// mapped into the device; and, where the driver knows the allocation, that
/// they lie inside it, or inside a run of allocations that follow each
/// other in the address space (PyTorch's expandable segments, UCX and
/// libfabric map memory in pieces), each of the same kind and device.
/// Pageable host memory is refused. `what` names the argument.
pub fn check_device_range(gpu: &dyn Gpu, ptr: u64, bytes: usize, what: &str) -> Result<()> {
    let ordinal = gpu.ordinal();
    if ptr == 0 {
        bail!(ErrNullArgument, "{what} is NULL");
    }
    let Some(info) = gpu.pointer(ptr) else {
        bail!(
            ErrInvalidArgument,
            "{what} ({ptr:#x}) is not memory the CUDA driver knows; the CUDA backend takes device pointers"
        );
    };
    if info.kind == MemKind::Host && !info.mapped {
        bail!(
            ErrInvalidArgument,
            "{what} ({ptr:#x}) is host memory that is not mapped into the device (cudaHostAlloc with \
             cudaHostAllocMapped); the CUDA backend takes device pointers"
        );
    }
    let same_device =
        |i: &PtrInfo| !(i.kind == MemKind::Device && i.ordinal >= 0 && i.ordinal != ordinal);
    if !same_device(&info) {
        bail!(
            ErrInvalidArgument,
            "{what} ({ptr:#x}) is memory of device {}, the context uses device {ordinal}",
            info.ordinal
        );
    }
    let Some(end) = ptr.checked_add(bytes as u64) else {
        bail!(
            ErrInvalidArgument,
            "{what}: {bytes} bytes at {ptr:#x} pass the end of the address space"
        );
    };
    let mut at = info;
    let first = info.range;
    for _ in 0..MAX_PIECES {
        let Some((base, size)) = at.range else {
            return Ok(()); // the driver does not say where the allocation ends
        };
        let piece_end = base.saturating_add(size as u64);
        if piece_end >= end {
            return Ok(());
        }
        match gpu.pointer(piece_end) {
            Some(next)
                if next.kind == info.kind
                    && same_device(&next)
                    && next.range.is_some_and(|r| r.0 == piece_end) =>
            {
                at = next
            }
            _ => break,
        }
    }
    let (base, size) = first.unwrap_or((ptr, 0));
    Err(Error::new(
        EngramStatus::ErrInvalidArgument,
        format!(
            "{what}: {bytes} bytes at {ptr:#x} do not fit in its allocation ({size} bytes at {base:#x}, \
             with any allocations mapped right after it)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_has_its_name_and_index() {
        let all = Kernel::all();
        assert_eq!(all.len(), KERNEL_NAMES.len());
        for (i, k) in all.iter().enumerate() {
            assert_eq!(k.index(), i, "{k:?}");
            assert_eq!(k.big_shared(), k.name().starts_with("engram_decode_"));
            let quant = k.name().starts_with("engram_gemv_q_")
                || k.name().ends_with("fp8_block")
                || k.name() == "engram_dequant_bf16";
            let decode = k.name().starts_with("engram_decode_");
            assert_eq!(k.module(), quant as usize + 2 * decode as usize, "{k:?}");
        }
    }
}
