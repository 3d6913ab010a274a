//! The CPU backend: host tables (in memory or read from a file), `wkv` in any
//! weight format read in place, the projection on the context's thread pool,
//! and the gate; the prefetching stager serves a step's rows ahead of time.
//!
//! - [`gather`]: rows by id, dequantised to bf16.
//! - [`projection`]: `kv = rows @ wkv^T` (portable and AVX-512 kernels).
//! - [`gate`]: the gate and the in-place update of the highway.
//! - [`stager`]: `engram_prefetch`'s worker threads and staging slots, and
//!   (`stager::read`) the row reads they run.

pub mod gate;
pub mod gather;
pub(crate) mod pool;
pub mod projection;
pub mod stager;
mod sync;

use crate::backend::{
    ApplyIn, Backend, BackendInfo, CheckedLayer, EngramBackend, Ids, ReadBack, Stream, TableSource,
};
use crate::batch::{invalid_row, try_vec, try_vec_with, HighwayType, LiveIds, Shape};
use crate::error::{bail, Error, Result};
use crate::formats::{f32_to_bf16, EngramType, Fp8Blocks, Weights};
use gate::HostHighway;
use projection::{Kernel, Projection};
use stager::{Source, Stager};
use std::sync::RwLock;

struct CpuLayer<'w> {
    layer_id: u32,
    wkv: Weights<'w>,
    /// `q * k` in f32 (`[hc, D]`): the two norm weights enter only as their
    /// product, so it is formed once here (a copy of `hc*D` floats).
    qk: Vec<f32>,
    /// The stager's generation of this layer's table.
    gen: u64,
}

/// The CPU backend of one context.
pub struct CpuBackend<'w> {
    shape: Shape,
    projection: Projection,
    layers: RwLock<Vec<Option<CpuLayer<'w>>>>,
    stager: Stager,
}

/// The CPU backend's choices that tests and benchmarks make (its part of
/// [`crate::Tuning`]); engines keep the defaults.
#[derive(Clone, Debug, Default)]
pub struct CpuTuning {
    /// The projection kernel (`None`: the best this CPU runs; a kernel the
    /// CPU lacks falls back to the portable one).
    pub kernel: Option<Kernel>,
}

impl CpuBackend<'_> {
    /// A backend using at most `n_threads` threads for one call (0 or 1: the
    /// calling thread only), tuned by `tuning`.
    pub fn new(shape: Shape, n_threads: usize, tuning: &CpuTuning) -> Result<Self> {
        let kernel = match tuning.kernel {
            Some(k) => Some(k),
            None => kernel_from_env()?,
        };
        let mut projection = Projection::new(n_threads).map_err(|e| {
            Error::new(
                crate::EngramStatus::ErrCapacity,
                format!("cannot start {n_threads} threads: {e}"),
            )
        })?;
        if let Some(k) = kernel {
            projection.set_kernel(k);
        }
        Ok(CpuBackend {
            shape,
            projection,
            layers: RwLock::new(try_vec_with(shape.n_layers, || None, "engram layers")?),
            stager: Stager::new(shape.n_layers, n_threads.max(2))?,
        })
    }

    /// The projection kernel in use.
    pub fn kernel(&self) -> Kernel {
        self.projection.kernel()
    }

    /// The live tokens' rows and `kv` (bf16 values held as f32) for layer
    /// `li`, whose weights are `layer` (read under the layers' lock, held
    /// by the caller until it is done with them).
    fn prepare(
        &self,
        li: usize,
        layer: &CpuLayer<'_>,
        live: &LiveIds,
    ) -> Result<(Vec<u16>, Vec<f32>)> {
        let s = &self.shape;
        let nl = live.tokens.len();
        let mut rows = try_vec(nl * s.k_in, 0u16, "the gathered rows")?;
        let mut kv = try_vec(nl * s.k_out, 0f32, "kv")?;
        let gathered = self
            .stager
            .gather(li, layer.gen, s.geo.hd, &live.ids, &mut rows)?;
        gathered.map_err(|(j, e)| {
            let (t, c) = (live.tokens[j / s.cols], j % s.cols);
            invalid_row(layer.layer_id, live.ids[j], t, c, &e.describe())
        })?;
        self.projection
            .run(&rows, nl, s.k_in, layer.wkv, s.k_out, &mut kv)?;
        Ok((rows, kv))
    }
}

/// The kernel `ENGRAM_CPU_KERNEL` names (`portable`, `avx2`, `avx512`, `amx`,
/// `avx512bf16`), read
/// when a context is created: `None` when it is unset or empty (the best
/// kernel this CPU runs). The kernels sum in different orders, so their bits
/// differ in the last places; a fleet of mixed CPUs that wants one result
/// everywhere names the kernel all of them run. A name that is not a kernel,
/// or one this CPU lacks, is `ERR_INVALID_CONFIG` (never a silent fallback).
fn kernel_from_env() -> Result<Option<Kernel>> {
    let Some(v) = std::env::var_os("ENGRAM_CPU_KERNEL") else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    if v.is_empty() {
        return Ok(None);
    }
    match Kernel::from_name(&v) {
        Some(k) if k.supported() => Ok(Some(k)),
        Some(k) => bail!(
            ErrInvalidConfig,
            "ENGRAM_CPU_KERNEL={}: this CPU lacks that kernel's instructions ({}){}",
            crate::error::escape_text(&v),
            projection::cpu_features(),
            match (k, projection::amx_status()) {
                (Kernel::Amx, Err(why)) => format!("; amx: {why}"),
                _ => String::new(),
            }
        ),
        None => bail!(
            ErrInvalidConfig,
            "ENGRAM_CPU_KERNEL={}: not a kernel (portable, avx2, avx512, avx512bf16 or amx)",
            crate::error::escape_text(&v)
        ),
    }
}

/// Layer `li` of `layers` (the context checks a layer is set before it
/// applies: an unset one here is a bug).
fn layer_of<'a, 'w>(layers: &'a [Option<CpuLayer<'w>>], li: usize) -> Result<&'a CpuLayer<'w>> {
    match layers[li].as_ref() {
        Some(l) => Ok(l),
        None => bail!(ErrInternal, "layer {li} reached the CPU backend unset"),
    }
}

/// Host row ids (the context refuses device ids for a CPU context).
fn host_live<'a>(ids: Ids<'a>) -> Result<&'a LiveIds> {
    match ids {
        Ids::Host { live, .. } => Ok(live),
        Ids::Device(_) => bail!(ErrInternal, "device row ids reached the CPU backend"),
    }
}

/// Host weights of `ty` over `region`'s bytes (`n` values in rows of `row_len`).
fn host_weights<'w>(
    region: crate::memory::Region<'w>,
    ty: EngramType,
    row_len: usize,
) -> Result<Weights<'w>> {
    // SAFETY: a CPU context's regions are host memory (`Region::from_raw`'s
    // contract), sized and aligned by the context's checks.
    Ok(unsafe {
        match ty {
            EngramType::F32 => Weights::F32(region.host_as::<f32>()),
            EngramType::Bf16 => Weights::Bf16(region.host_as::<u16>()),
            f => Weights::quant(f, region.host(), row_len)?,
        }
    })
}

/// A table array (`bytes` long) as the stager reads it: host memory, or a
/// file range checked against the file's length now.
fn host_source(src: TableSource<'_>, bytes: u64, layer_id: u32, what: &str) -> Result<Source> {
    Ok(match src {
        // SAFETY: `Region::host` needs host memory: a CPU context's regions
        // are (`Region::from_raw`), and the context sized this one as the
        // table's `bytes`.
        TableSource::Memory(r) => Source::memory(unsafe { r.host() }),
        TableSource::File { file, offset } => Source::file(file, offset, bytes, layer_id, what)?,
    })
}

impl<'w> Backend<'w> for CpuBackend<'w> {
    fn set_exact_quant(&mut self, exact: bool) {
        self.projection.set_exact_quant(exact);
    }

    fn info(&self) -> BackendInfo {
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        BackendInfo {
            kind: EngramBackend::Cpu,
            kernel: self.kernel().c_name().to_string_lossy().into_owned(),
            host_bytes: layers.iter().flatten().map(|l| l.qk.len() * 4).sum(),
            device_bytes: 0,
            stage: self.stager.stats(),
            decode: Default::default(),
        }
    }

    fn set_layer(&self, li: usize, l: CheckedLayer<'w>) -> Result<()> {
        let s = &self.shape;
        let wkv = match (l.wkv_type, l.wkv_scales) {
            (EngramType::Fp8E4m3E8m0Block, Some(sc)) => {
                // SAFETY: `Region::host` needs host memory: a CPU context's
                // regions are (`Region::from_raw`), the context sized both.
                let (codes, scales) = unsafe { (l.wkv.host(), sc.host()) };
                let (br, bc) = l.wkv_block;
                let b = Fp8Blocks::new(codes, scales, s.k_in, br, bc)?;
                // Every code and scale, before anything changes.
                b.check_err(&format!("layer {}: weights.wkv", l.layer_id))?;
                Weights::Fp8Block(b)
            }
            (t, _) => host_weights(l.wkv, t, s.k_in)?,
        };
        let q = host_weights(l.q, l.qk_type, s.geo.d)?;
        let k = host_weights(l.k, l.qk_type, s.geo.d)?;
        let n_qk = s.hw_per_token();
        let mut qk = try_vec(n_qk, 0f32, "q * k")?;
        for (i, v) in qk.iter_mut().enumerate() {
            *v = q.get(i) * k.get(i);
        }
        let codes = host_source(l.source, l.bytes.table, l.layer_id, "table")?;
        let source = match l.scales {
            None => codes,
            // A split fp8 table: each staged row is its codes then its scales,
            // the packed format's row (which the split format dequantises as).
            Some(sc) => Source::Split {
                codes: Box::new(codes),
                scales: Box::new(host_source(
                    sc,
                    l.bytes.scales,
                    l.layer_id,
                    "table's scales",
                )?),
                crb: l.format.planes(s.geo.hd).0,
            },
        };
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        let gen = self
            .stager
            .set_source(li, source, l.format, l.format.row_bytes(s.geo.hd))?;
        layers[li] = Some(CpuLayer {
            layer_id: l.layer_id,
            wkv,
            qk,
            gen,
        });
        Ok(())
    }

    fn stage(&self, li: usize, live: &LiveIds) -> Result<()> {
        self.stager.stage(li, &live.ids)
    }

    fn apply(&self, li: usize, call: ApplyIn<'_>) -> Result<()> {
        let live = host_live(call.ids)?;
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let layer = layer_of(&layers, li)?;
        let mut scratch = gate::Scratch::new(self.shape.geo)?;
        let (_, kv) = self.prepare(li, layer, live)?;
        let mut hw = call.highway;
        // SAFETY: a CPU context's highway is host memory the caller lends for
        // this call only (`RegionMut::from_raw`), sized and aligned by the context.
        let host = unsafe {
            match call.highway_type {
                HighwayType::F32 => HostHighway::F32(hw.host_as_mut::<f32>()),
                HighwayType::Bf16 => HostHighway::Bf16(hw.host_as_mut::<u16>()),
            }
        };
        gate::update(
            self.shape.geo,
            &live.tokens,
            &kv,
            &layer.qk,
            host,
            &mut scratch,
        );
        Ok(())
    }

    fn read_back(&self, li: usize, ids: Ids<'_>, n: usize) -> Result<ReadBack> {
        let live = host_live(ids)?;
        let s = &self.shape;
        let mut out = ReadBack {
            rows: try_vec(n * s.k_in, 0u16, "the rows read back")?,
            kv: try_vec(n * s.k_out, 0u16, "the kv read back")?,
        };
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let (rows, kv) = self.prepare(li, layer_of(&layers, li)?, live)?;
        drop(layers);
        for (j, &t) in live.tokens.iter().enumerate() {
            out.rows[t * s.k_in..(t + 1) * s.k_in]
                .copy_from_slice(&rows[j * s.k_in..(j + 1) * s.k_in]);
            for (o, &v) in out.kv[t * s.k_out..(t + 1) * s.k_out]
                .iter_mut()
                .zip(&kv[j * s.k_out..(j + 1) * s.k_out])
            {
                *o = f32_to_bf16(v);
            }
        }
        Ok(out)
    }

    fn gather_held(&self, li: usize, ids: &[i64]) -> Result<Vec<u16>> {
        let hd = self.shape.geo.hd;
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let layer = layer_of(&layers, li)?;
        let mut rows = try_vec(ids.len() * hd, 0u16, "the gathered rows")?;
        let gathered = self.stager.gather(li, layer.gen, hd, ids, &mut rows)?;
        gathered.map_err(|(j, e)| {
            Error::new(
                crate::EngramStatus::ErrInvalidRowId,
                format!(
                    "layer {}: held row {} cannot be read: {}",
                    layer.layer_id,
                    ids[j],
                    e.describe()
                ),
            )
        })?;
        Ok(rows)
    }

    fn project_held(
        &self,
        li: usize,
        rows: &[u16],
        n: usize,
        lo: usize,
        hi: usize,
    ) -> Result<Vec<f32>> {
        let k_in = self.shape.k_in;
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let w = layer_of(&layers, li)?.wkv.rows(lo, hi, k_in)?;
        let mut kv = try_vec(n * (hi - lo), 0f32, "kv")?;
        self.projection.run(rows, n, k_in, w, hi - lo, &mut kv)?;
        Ok(kv)
    }

    fn gate_held(
        &self,
        li: usize,
        tokens: &[usize],
        kv: &[f32],
        highway: crate::memory::RegionMut<'_>,
        ty: HighwayType,
    ) -> Result<()> {
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let layer = layer_of(&layers, li)?;
        let mut scratch = gate::Scratch::new(self.shape.geo)?;
        let mut hw = highway;
        // SAFETY: a CPU context's highway is host memory the caller lends for
        // this call only (`RegionMut::from_raw`), sized and aligned by the context.
        let host = unsafe {
            match ty {
                HighwayType::F32 => HostHighway::F32(hw.host_as_mut::<f32>()),
                HighwayType::Bf16 => HostHighway::Bf16(hw.host_as_mut::<u16>()),
            }
        };
        gate::update(self.shape.geo, tokens, kv, &layer.qk, host, &mut scratch);
        Ok(())
    }

    fn check(&self, _stream: Stream) -> Result<()> {
        Ok(())
    }

    fn gate_weights(&self, li: usize) -> Result<Vec<f32>> {
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let qk = &layer_of(&layers, li)?.qk;
        let mut out = try_vec(qk.len(), 0f32, "q * k")?;
        out.copy_from_slice(qk);
        Ok(out)
    }

    fn set_row_cache(&self, per_layer: u64, policy: crate::rowcache::PolicyKind) -> Result<()> {
        self.stager.set_row_cache(per_layer, policy);
        Ok(())
    }

    fn host_cache_stats(&self, li: usize) -> Option<&crate::rowcache::TierStats> {
        self.stager.cache_stats(li)
    }

    /// Replaces the projection's pool (waiting for the projections in flight;
    /// see [`Projection::set_threads`]). The prefetch workers keep the count
    /// they were created with.
    fn set_threads(&self, n: usize) -> Result<()> {
        self.projection.set_threads(n).map_err(|e| {
            Error::new(
                crate::EngramStatus::ErrCapacity,
                format!("cannot start {n} threads: {e}"),
            )
        })
    }
}
