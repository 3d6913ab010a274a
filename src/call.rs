//! The plain data a call is made of: what the engine hands over (a layer's
//! weights, row ids, a highway, a stream) and what a backend is given once
//! the context has checked it ([`crate::batch`]), and what a backend reports.
//! Data only: nothing here knows a backend, the context or the hash, so
//! every module can name these types.
//!
//! What a backend is given is the engine's memory as [`Region`]s: the CPU
//! backend reads them as host memory; the CUDA backend as device memory (or,
//! for a table in host memory, stages its rows).

use crate::error::{bail, Result};
use crate::formats::{EngramType, Weights};
use crate::memory::{Region, RegionMut};
use std::ffi::c_void;
use std::fs::File;
use std::sync::Arc;

/// Row id written for every column of a dead token. `apply` leaves such
/// tokens untouched.
pub const ROW_ID_DEAD: i64 = -1;

/// Where `apply` runs.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngramBackend {
    /// Host memory, host threads.
    Cpu = 1,
    /// Caller-owned device memory and CUDA stream (`crate::cuda`).
    Cuda = 2,
}

/// A `CUstream` / `cudaStream_t` of the engine's (NULL: the legacy default
/// stream); ignored by the CPU backend.
pub type Stream = *mut c_void;

/// Where a layer's table rows are.
#[derive(Clone, Debug)]
pub enum TableSource<'w> {
    /// The engine's memory (host or device), borrowed for `'w`.
    Memory(Region<'w>),
    /// `bytes` at `offset` in `file`, read with `pread` (so an I/O error or a
    /// file cut short is a status, never a signal).
    File { file: Arc<File>, offset: u64 },
}

/// One layer's table: `rows` rows of `ty`.
#[derive(Clone, Debug)]
pub struct TableIn<'w> {
    pub source: TableSource<'w>,
    /// The scale array of a table in the split fp8 format
    /// (`EngramType::Fp8E4m3E8m0Split`: `source` holds the codes, `Hd` bytes a
    /// row, this the e8m0 scales, `Hd / 32` bytes a row); `None` for every
    /// other format.
    pub scales: Option<TableSource<'w>>,
    /// `ENGRAM_TYPE_*`
    pub ty: u32,
    pub rows: u64,
}

/// One layer's weights as the engine hands them over (borrowed for `'w`).
#[derive(Clone, Debug)]
pub struct LayerIn<'w> {
    pub layer_id: u32,
    pub table: TableIn<'w>,
    /// `[D*(hc+1), C*Hd]` row-major, `wkv_type`.
    pub wkv: Region<'w>,
    pub wkv_type: u32,
    /// With `wkv_type` `Fp8E4m3E8m0Block`: the e8m0 block scales
    /// (`[ceil(rows / br), ceil(C*Hd / bc)]`) and the block shape `(br, bc)`;
    /// `None` and `(0, 0)` for every other format.
    pub wkv_scales: Option<Region<'w>>,
    pub wkv_block: (u32, u32),
    /// `[hc, D]` each, `qk_type` (f32 or bf16).
    pub q: Region<'w>,
    pub k: Region<'w>,
    pub qk_type: u32,
}

/// Host weights as a [`Region`] and its type.
fn weight_region<'w>(w: Weights<'w>) -> (Region<'w>, u32) {
    match w {
        Weights::F32(v) => (Region::of(v), EngramType::F32 as u32),
        Weights::Bf16(v) => (Region::of(v), EngramType::Bf16 as u32),
        Weights::Quant { format, data, .. } => (Region::of(data), format as u32),
        Weights::Fp8Block(b) => (Region::of(b.codes), EngramType::Fp8E4m3E8m0Block as u32),
    }
}

impl<'w> LayerIn<'w> {
    /// A layer whose weights are host slices (the CPU backend's usual input).
    pub fn host(
        layer_id: u32,
        table: &'w [u8],
        table_type: EngramType,
        table_rows: u64,
        wkv: Weights<'w>,
        q: Weights<'w>,
        k: Weights<'w>,
    ) -> LayerIn<'w> {
        let (wkv_scales, wkv_block) = match wkv {
            Weights::Fp8Block(b) => (Some(Region::of(b.scales)), (b.br as u32, b.bc as u32)),
            _ => (None, (0, 0)),
        };
        let (wkv, wkv_type) = weight_region(wkv);
        let (q, qk_type) = weight_region(q);
        let (k, _) = weight_region(k);
        LayerIn {
            layer_id,
            table: TableIn {
                source: TableSource::Memory(Region::of(table)),
                scales: None,
                ty: table_type as u32,
                rows: table_rows,
            },
            wkv,
            wkv_type,
            wkv_scales,
            wkv_block,
            q,
            k,
            qk_type,
        }
    }
}

impl<'w> LayerIn<'w> {
    /// A layer whose weights are bare addresses (device pointers for the CUDA
    /// backend), their sizes following from the geometry.
    ///
    /// # Safety
    /// As [`Region::from_raw`] for each address.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn raw(
        layer_id: u32,
        table: u64,
        table_type: u32,
        table_rows: u64,
        wkv: u64,
        wkv_type: u32,
        q: u64,
        k: u64,
        qk_type: u32,
    ) -> LayerIn<'w> {
        // SAFETY: the caller's contract, for every region.
        let r = |a: u64| unsafe { Region::from_raw(a as usize, None) };
        LayerIn {
            layer_id,
            table: TableIn {
                source: TableSource::Memory(r(table)),
                scales: None,
                ty: table_type,
                rows: table_rows,
            },
            wkv: r(wkv),
            wkv_type,
            wkv_scales: None,
            wkv_block: (0, 0),
            q: r(q),
            k: r(k),
            qk_type,
        }
    }
}

/// A layer after the context's checks: its regions sized, its table's format
/// known.
#[derive(Clone, Debug)]
pub struct CheckedLayer<'w> {
    pub layer_id: u32,
    pub source: TableSource<'w>,
    /// The scale array of a split fp8 table (`format` is
    /// `Fp8E4m3E8m0Split`), sized; `None` otherwise.
    pub scales: Option<TableSource<'w>>,
    pub format: EngramType,
    pub rows: u64,
    pub wkv: Region<'w>,
    pub wkv_type: EngramType,
    /// A block-scaled fp8 `wkv`'s scales (sized) and block shape; `None`
    /// and `(0, 0)` otherwise. Their values are checked by the backend.
    pub wkv_scales: Option<Region<'w>>,
    pub wkv_block: (usize, usize),
    /// The outputs `[o0, o1)` of `D*(hc+1)` that `wkv` (and its scales)
    /// hold: all of them unless a loader read only a shard's part.
    pub wkv_outs: (usize, usize),
    pub q: Region<'w>,
    pub k: Region<'w>,
    pub qk_type: EngramType,
    pub bytes: LayerBytes,
}

/// Where `apply`'s row ids are.
#[derive(Clone, Copy, Debug)]
pub enum RowIds<'a> {
    /// Host memory, `[n, n_layers, C]`: checked on the host.
    Host(&'a [i64]),
    /// Device memory, `[n, n_layers, C]` int64 (the engine copied them there;
    /// CUDA backend): checked on the device.
    Device(u64),
}

/// A call's row ids after the context's checks.
#[derive(Clone, Copy, Debug)]
pub enum Ids<'a> {
    /// Host ids: all of them (`[n, n_layers, C]`) and the layer's live tokens.
    Host { all: &'a [i64], live: &'a LiveIds },
    /// A device pointer to `[n, n_layers, C]` int64, unchecked.
    Device(u64),
}

/// The highway `[n, hc, D]`, updated in place.
pub enum Highway<'a> {
    F32(&'a mut [f32]),
    /// bf16 bit patterns; each updated value is rounded to nearest-even.
    Bf16(&'a mut [u16]),
    /// The engine's memory (host for the CPU backend, device for CUDA) of
    /// `HighwayType`, its length following from the call's token count.
    Raw(RegionMut<'a>, HighwayType),
}

impl<'a> Highway<'a> {
    /// A highway at a bare address (device memory for the CUDA backend), its
    /// length following from the call's token count.
    ///
    /// # Safety
    /// As [`RegionMut::from_raw`].
    pub unsafe fn raw(addr: u64, ty: HighwayType) -> Highway<'a> {
        // SAFETY: `Highway::raw`'s `# Safety` is `RegionMut::from_raw`'s: `addr`, where
        // read as host memory, is writable for the highway's size and used by no one else.
        Highway::Raw(unsafe { RegionMut::from_raw(addr as usize, None) }, ty)
    }

    /// The highway as a region and its element type.
    pub fn into_region(self) -> (RegionMut<'a>, HighwayType) {
        match self {
            Highway::F32(v) => (RegionMut::of(v), HighwayType::F32),
            Highway::Bf16(v) => (RegionMut::of(v), HighwayType::Bf16),
            Highway::Raw(r, t) => (r, t),
        }
    }
}

/// One `apply` after the context's checks.
pub struct ApplyIn<'a> {
    pub n: usize,
    pub ids: Ids<'a>,
    /// Sized for `n` tokens.
    pub highway: RegionMut<'a>,
    pub highway_type: HighwayType,
    pub stream: Stream,
}

/// A layer's intermediate results for all `n` tokens of a call, for
/// numerics checks: the gathered rows `[n, C*Hd]` and `kv` `[n, D*(hc+1)]`,
/// as bf16 bit patterns (zero for a dead token).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadBack {
    pub rows: Vec<u16>,
    pub kv: Vec<u16>,
}

/// How the gathers of `apply` were served (host tables).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageStats {
    /// Prefetches started.
    pub prefetched: u64,
    /// Gathers served from a staged prefetch.
    pub staged: u64,
    /// Gathers read directly (no prefetch of those ids).
    pub direct: u64,
    /// Rows whose raw bytes were written into host staging memory, counted
    /// at each such copy: a prefetched row once (on CUDA straight into the
    /// pinned memory the device copy reads), a row read directly into
    /// staging once, a row the CPU backend dequantises straight from a table
    /// in memory not at all.
    pub row_copies: u64,
}

/// The counts of one layer's device row cache (CUDA backend, a table on
/// the host, `device_cache_bytes` > 0; docs/row-cache.md "Device tier"):
/// per call, each distinct live row id is one lookup, a hit or a miss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCacheStats {
    /// Its replacement policy.
    pub policy: crate::rowcache::PolicyKind,
    /// Rows the cache holds at most.
    pub capacity_rows: u64,
    pub lookups: u64,
    pub hits: u64,
    pub misses: u64,
    /// Row bytes copied from the host to the device (the misses', and those
    /// of hits whose slot a miss of the same call took over).
    pub bytes_h2d: u64,
    /// Rows a miss pushed out of the cache.
    pub evictions: u64,
}

/// What a backend reports about itself.
#[derive(Clone, Debug)]
pub struct BackendInfo {
    pub kind: EngramBackend,
    /// The kernels in use (`"avx512"`, `"portable"`; on CUDA the device, what
    /// its kernels were compiled to, and the driver, NVRTC and cuBLAS in use:
    /// their versions and paths).
    pub kernel: String,
    /// Host bytes the backend holds beyond the borrowed weights (on CUDA:
    /// its pinned staging memory).
    pub host_bytes: usize,
    /// Device bytes the backend allocated (0 on the CPU).
    pub device_bytes: usize,
    pub stage: StageStats,
    /// How the CUDA backend's decode kernel ran (zero on the CPU).
    pub decode: DecodeStats,
}

/// How the CUDA backend's decode kernel ran (docs/cuda.md "The decode
/// kernel"), counted per call since the context was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Applies whose gather, projection and gate ran in one launch (the
    /// gate in the last block done; the name is from the cooperative launch
    /// it was before issue 38).
    pub cooperative: u64,
    /// Applies that ran its phase A and then the gate kernel (after the
    /// driver refused the one launch).
    pub split: u64,
    /// Read-backs (phase A alone).
    pub read_back: u64,
    /// The driver refused the one launch with an error that leaves the
    /// context usable (too many resources for a green context, say); the
    /// context has used the split path since.
    pub refused: bool,
}

/// A split call's values in device memory (the CUDA backend): `len`
/// values of `ty` (f32 or bf16) at `ptr`, on the engine's device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevValues {
    pub ptr: u64,
    pub len: usize,
    pub ty: HighwayType,
}

/// The highway's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HighwayType {
    F32,
    /// bf16 bit patterns; each updated value is rounded to nearest-even.
    Bf16,
}

impl HighwayType {
    /// `ENGRAM_TYPE_F32` or `ENGRAM_TYPE_BF16`; anything else is `ErrUnsupported`.
    pub fn new(ty: u32) -> Result<HighwayType> {
        match EngramType::from_u32(ty) {
            Some(EngramType::F32) => Ok(HighwayType::F32),
            Some(EngramType::Bf16) => Ok(HighwayType::Bf16),
            _ => bail!(
                ErrUnsupported,
                "highway type {ty} is not supported (ENGRAM_TYPE_F32 or ENGRAM_TYPE_BF16)"
            ),
        }
    }

    pub fn engram_type(self) -> EngramType {
        match self {
            HighwayType::F32 => EngramType::F32,
            HighwayType::Bf16 => EngramType::Bf16,
        }
    }

    pub fn size(self) -> usize {
        match self {
            HighwayType::F32 => 4,
            HighwayType::Bf16 => 2,
        }
    }
}

/// The live tokens of one call for one layer, after [`live_ids`]' checks.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LiveIds {
    /// Indices (in the call) of the live tokens.
    pub tokens: Vec<usize>,
    /// Their row ids for the layer, `[tokens.len(), C]`.
    pub ids: Vec<i64>,
}

/// Byte sizes of one layer's weights (see [`check_layer`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerBytes {
    /// The table (for the split fp8 format: its code array).
    pub table: u64,
    /// The split fp8 format's scale array (0 for every other format).
    pub scales: u64,
    pub wkv: usize,
    /// A block-scaled fp8 `wkv`'s scale array (0 for every other format).
    pub wkv_scales: usize,
    /// Each of `q` and `k`.
    pub qk: usize,
}

/// One `engram_hash_device` call: device addresses of `n` tokens, sequence
/// ids and positions (int32) and of `[n, n_layers, C]` row ids (int64).
#[derive(Clone, Copy, Debug)]
pub struct DeviceHashIn {
    pub tokens: u64,
    pub seq_ids: u64,
    pub pos: u64,
    pub n: usize,
    pub row_ids: u64,
    pub stream: Stream,
}

/// A range operation on the device history (`engram_seq_*_device`), queued
/// on a stream. Positions are as the engine passes them (`p0 < 0` is 0,
/// `p1 < 0` the end), checked against the limits before anything is queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSeqOp {
    /// Forget `[p0, p1)` of `seq` (-1: of every sequence).
    Rm { seq: i32, p0: i32, p1: i32 },
    /// `dst`'s `[p0, p1)` becomes exactly `src`'s there.
    Cp {
        src: i32,
        dst: i32,
        p0: i32,
        p1: i32,
    },
    /// Forget every sequence but `seq`.
    Keep { seq: i32 },
    /// Move `seq`'s `[p0, p1)` by `delta`.
    Add {
        seq: i32,
        p0: i32,
        p1: i32,
        delta: i32,
    },
}
