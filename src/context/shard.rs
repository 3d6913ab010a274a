//! Shards and the split points (docs/sharding.md): a context that holds a
//! part of each layer (a range of its table's rows, a range of `wkv`'s
//! outputs), and the calls that take the layer apart where the engines shard
//! it: the rows a shard owns (`gather_rows`, zeros elsewhere, so that the
//! engine's all-reduce sums to the whole rows exactly), `kv` for a range of
//! outputs (`kv_columns`, for an all-gather), the gate from an assembled `kv`
//! (`gate_from_kv`) and the whole projection and gate from assembled rows
//! (`apply_rows`). Each runs the same code on the same values as
//! [`Context::apply`], so every layout gives the same bits.

use super::{Context, LayerInfo};
use crate::batch::{layer_index, live_ids, HighwayType, Shape};
use crate::call::{CheckedLayer, Highway, RowIds, TableSource};
use crate::error::{bail, Result};
use crate::fallible::try_vec;
use crate::formats::{bf16_to_f32, f32_to_bf16, EngramType};

/// `-0.0` as bf16 bits: what a shard writes for the rows it does not own.
/// `x + (-0) = x` for every `x` (`+0` and NaN included), so summing the
/// shards' outputs in any order gives the owner's bits exactly.
const NEG_ZERO_BF16: u16 = 0x8000;

/// Which part of every layer a context holds: part `rank` of `world` of the
/// table's rows and of `wkv`'s outputs (each `(rank, world)`; `(0, 1)` is
/// the whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    pub table: (u32, u32),
    pub wkv: (u32, u32),
}

impl ShardSpec {
    /// The whole layer.
    pub const WHOLE: ShardSpec = ShardSpec {
        table: (0, 1),
        wkv: (0, 1),
    };

    /// A spec, checked: each world at least 1, each rank below its world.
    pub fn new(table: (u32, u32), wkv: (u32, u32)) -> Result<ShardSpec> {
        for (what, (rank, world)) in [("table", table), ("wkv", wkv)] {
            if world == 0 || rank >= world {
                bail!(
                    ErrInvalidArgument,
                    "{what} shard: rank {rank} of world {world} (the world is at least 1 and \
                     the rank below it)"
                );
            }
        }
        Ok(ShardSpec { table, wkv })
    }
}

impl Default for ShardSpec {
    fn default() -> Self {
        ShardSpec::WHOLE
    }
}

/// Part `rank` of `world` of `0..total`: `[rank*total/world,
/// (rank+1)*total/world)`, rounded down; the parts of `0..world` tile
/// `0..total` in order (any world, whether it divides `total` or not).
pub fn part(total: u64, rank: u32, world: u32) -> (u64, u64) {
    let at = |r: u32| ((total as u128 * r as u128) / world as u128) as u64;
    (at(rank), at(rank + 1))
}

/// A range `[lo, hi)` of a region (a table's rows in bytes).
fn sub_source<'w>(src: &TableSource<'w>, start: u64, bytes: u64) -> Result<TableSource<'w>> {
    Ok(match src {
        TableSource::Memory(r) => TableSource::Memory(r.sub(start as usize, bytes as usize)?),
        TableSource::File { file, offset } => TableSource::File {
            file: file.clone(),
            offset: offset + start,
        },
    })
}

/// The outputs of `wkv` that part `rank` of `world` holds: whole scale
/// blocks of a block-scaled fp8 `wkv` (so each part reads its own scales),
/// single outputs otherwise.
fn held_outs(shape: &Shape, l: &CheckedLayer<'_>, rw: (u32, u32)) -> (usize, usize) {
    let block = match l.wkv_type {
        EngramType::Fp8E4m3E8m0Block => Some(l.wkv_block.0),
        _ => None,
    };
    wkv_part(shape.k_out, block, rw)
}

/// The outputs `[o0, o1)` of a `wkv` with `k_out` outputs that part `rank`
/// of `world` holds: whole blocks of `block_rows` outputs for a block-scaled
/// fp8 `wkv` (`Some`), single outputs otherwise (`None`). What a loader
/// reads of `wkv` for a shard, and what the context then holds.
pub fn wkv_part(
    k_out: usize,
    block_rows: Option<usize>,
    (rank, world): (u32, u32),
) -> (usize, usize) {
    let unit = block_rows.unwrap_or(1).max(1);
    let blocks = k_out.div_ceil(unit) as u64;
    let (b0, b1) = part(blocks, rank, world);
    let o = |b: u64| (b as usize * unit).min(k_out);
    (o(b0), o(b1))
}

/// The bytes of a layer's table arrays and of its `wkv` arrays.
fn held_bytes(l: &CheckedLayer<'_>) -> (u64, u64) {
    let b = &l.bytes;
    (b.table + b.scales, (b.wkv + b.wkv_scales) as u64)
}

/// Layer `whole` cut to what `spec` holds, and what the context then knows
/// of it.
pub fn cut<'w>(
    shape: &Shape,
    whole: &CheckedLayer<'w>,
    spec: ShardSpec,
) -> Result<(CheckedLayer<'w>, LayerInfo)> {
    let (r0, r1) = part(whole.rows, spec.table.0, spec.table.1);
    let (o0, o1) = held_outs(shape, whole, spec.wkv);
    let mut info = LayerInfo {
        rows: whole.rows,
        table_type: whole.format,
        wkv_type: whole.wkv_type,
        qk_type: whole.qk_type,
        held_rows: (r0, r1),
        held_outs: (o0, o1),
        held_bytes: held_bytes(whole),
    };
    if spec == ShardSpec::WHOLE && whole.wkv_outs == (0, shape.k_out) {
        return Ok((whole.clone(), info));
    }
    let mut held = whole.clone();
    let (rb, srb) = whole.format.planes(shape.geo.hd);
    let (rb, n) = (rb as u64, r1 - r0);
    held.source = sub_source(&whole.source, r0 * rb, n * rb)?;
    held.bytes.table = n * rb;
    if let (Some(sc), Some(srb)) = (&whole.scales, srb) {
        held.scales = Some(sub_source(sc, r0 * srb as u64, n * srb as u64)?);
        held.bytes.scales = n * srb as u64;
    }
    held.rows = n;
    let base = whole.wkv_outs;
    if o0 < base.0 || o1 > base.1 {
        bail!(
            ErrInvalidArgument,
            "layer {}: the shard holds wkv outputs [{o0}, {o1}), but this context was given \
             only outputs [{}, {}) of {} (a loader's shard spec: open the model again for \
             another part)",
            whole.layer_id,
            base.0,
            base.1,
            shape.k_out
        );
    }
    let per_out = whole.bytes.wkv / (base.1 - base.0).max(1);
    held.wkv = whole
        .wkv
        .sub((o0 - base.0) * per_out, (o1 - o0) * per_out)?;
    held.bytes.wkv = (o1 - o0) * per_out;
    held.wkv_outs = (o0, o1);
    if let Some(sc) = whole.wkv_scales {
        let (br, bc) = whole.wkv_block;
        let cols = shape.k_in.div_ceil(bc);
        let (b0, b1) = (o0 / br - base.0 / br, o1.div_ceil(br) - base.0 / br);
        held.wkv_scales = Some(sc.sub(b0 * cols, (b1 - b0) * cols)?);
        held.bytes.wkv_scales = (b1 - b0) * cols;
    }
    info.held_bytes = held_bytes(&held);
    Ok((held, info))
}

/// A split call's values in: f32 or bf16 bits.
#[derive(Clone, Copy, Debug)]
pub enum SplitIn<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// A split call's values out: f32 or bf16 bits.
#[derive(Debug)]
pub enum SplitOut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [u16]),
}

impl SplitIn<'_> {
    fn len(&self) -> usize {
        match self {
            SplitIn::F32(v) => v.len(),
            SplitIn::Bf16(v) => v.len(),
        }
    }

    /// Value `i` as bf16 (f32 values rounded to nearest-even: bf16 values,
    /// as the split calls write them, pass unchanged).
    fn bf16(&self, i: usize) -> u16 {
        match self {
            SplitIn::F32(v) => f32_to_bf16(v[i]),
            SplitIn::Bf16(v) => v[i],
        }
    }
}

impl SplitOut<'_> {
    fn len(&self) -> usize {
        match self {
            SplitOut::F32(v) => v.len(),
            SplitOut::Bf16(v) => v.len(),
        }
    }

    /// Set every value to `-0.0`.
    fn fill_neg_zero(&mut self) {
        match self {
            SplitOut::F32(v) => v.fill(-0.0),
            SplitOut::Bf16(v) => v.fill(NEG_ZERO_BF16),
        }
    }

    /// Write bf16 `vals` at `at`.
    fn put(&mut self, at: usize, vals: &[u16]) {
        match self {
            SplitOut::F32(v) => {
                for (o, &b) in v[at..at + vals.len()].iter_mut().zip(vals) {
                    *o = bf16_to_f32(b);
                }
            }
            SplitOut::Bf16(v) => v[at..at + vals.len()].copy_from_slice(vals),
        }
    }

    /// Write f32 values that are bf16 values (the projection's `kv`) at `at`.
    fn put_f32(&mut self, at: usize, vals: &[f32]) {
        match self {
            SplitOut::F32(v) => v[at..at + vals.len()].copy_from_slice(vals),
            SplitOut::Bf16(v) => {
                for (o, &x) in v[at..at + vals.len()].iter_mut().zip(vals) {
                    *o = f32_to_bf16(x);
                }
            }
        }
    }
}

/// Refuse a buffer of `given` elements where `expected` are needed.
pub(super) fn expect_len(what: &str, given: usize, expected: usize, why: &str) -> Result<()> {
    if given != expected {
        bail!(
            ErrInvalidArgument,
            "{what} holds {given} values, expected {expected} ({why})"
        );
    }
    Ok(())
}

/// Refuse `[lo, hi)` unless it is a non-empty part of `[0, total)` inside
/// what the context holds, `held`.
pub(super) fn check_range(
    what: &str,
    layer_id: u32,
    (lo, hi): (u64, u64),
    total: u64,
    held: (u64, u64),
) -> Result<()> {
    if lo >= hi || hi > total {
        bail!(
            ErrInvalidArgument,
            "layer {layer_id}: {what} [{lo}, {hi}) is not a non-empty range of [0, {total})"
        );
    }
    if lo < held.0 || hi > held.1 {
        bail!(
            ErrInvalidArgument,
            "layer {layer_id}: {what} [{lo}, {hi}) asked of a shard context that holds [{}, {})",
            held.0,
            held.1
        );
    }
    Ok(())
}

impl<'w> Context<'w> {
    /// Hold part `spec` of every layer from now on:
    /// layers already set are cut again from the arrays they were given, and
    /// layers set later are cut as they are set. On error nothing changes.
    pub fn set_shard(&self, spec: ShardSpec) -> Result<()> {
        let mut layers = self.layers.write().unwrap_or_else(|p| p.into_inner());
        let whole = self.whole.lock().unwrap_or_else(|p| p.into_inner());
        let mut cuts = Vec::new();
        if cuts.try_reserve_exact(whole.len()).is_err() {
            bail!(ErrCapacity, "out of memory for the shard's layers");
        }
        for (li, w) in whole.iter().enumerate() {
            if let Some(w) = w {
                cuts.push((li, cut(&self.shape, w, spec)?));
            }
        }
        for (li, (held, info)) in cuts {
            self.backend.set_layer(li, held)?;
            layers[li] = Some(info);
        }
        *self.shard.lock().unwrap_or_else(|p| p.into_inner()) = spec;
        Ok(())
    }

    /// The part of every layer this context holds.
    pub fn shard(&self) -> ShardSpec {
        *self.shard.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the context knows of layer `layer_id` (its held ranges included).
    pub fn layer_held(&self, layer_id: u32) -> Result<LayerInfo> {
        let li = layer_index(&self.tables.layer_ids, layer_id)?;
        held_info(&self.layers(), li, layer_id)
    }

    /// The rows of layer `layer_id` that the host `row_ids` (`[n, n_layers,
    /// C]`) name for heads `[h0, h1)`, dequantised, into `out` (`[n, N-1,
    /// h1-h0, Hd]`, n-gram size slowest): rows outside `[r0, r1)` (which this
    /// context must hold) and every row of a dead token are `-0.0`, so the
    /// engine's sum of the shards' outputs is the whole rows, bit for bit.
    /// On error `out` is unchanged.
    pub fn gather_rows(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        (r0, r1): (u64, u64),
        (h0, h1): (usize, usize),
        mut out: SplitOut<'_>,
    ) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let (nh, n1, hd) = (
            self.tables.n_heads,
            self.tables.max_ngram - 1,
            self.shape.geo.hd,
        );
        if h0 >= h1 || h1 > nh {
            bail!(
                ErrInvalidArgument,
                "heads [{h0}, {h1}) are not a non-empty range of the {nh} heads"
            );
        }
        check_range("rows", layer_id, (r0, r1), info.rows, info.held_rows)?;
        let per = n1 * (h1 - h0) * hd;
        expect_len("out", out.len(), n * per, "tokens x (N-1) x heads x Hd")?;
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, info.rows)?;
        let cols = self.shape.cols;
        let (mut ids, mut at) = (Vec::new(), Vec::new());
        if ids.try_reserve_exact(live.ids.len()).is_err()
            || at.try_reserve_exact(live.ids.len()).is_err()
        {
            bail!(ErrCapacity, "out of memory for the row ids of {n} tokens");
        }
        for (j, &t) in live.tokens.iter().enumerate() {
            for k in 0..n1 {
                for h in h0..h1 {
                    let r = live.ids[j * cols + k * nh + h] as u64;
                    if (r0..r1).contains(&r) {
                        ids.push((r - info.held_rows.0) as i64);
                        at.push(((t * n1 + k) * (h1 - h0) + h - h0) * hd);
                    }
                }
            }
        }
        let rows = self.backend.gather_held(li, &ids)?;
        out.fill_neg_zero();
        for (j, &a) in at.iter().enumerate() {
            out.put(a, &rows[j * hd..(j + 1) * hd]);
        }
        Ok(())
    }

    /// `kv` outputs `[o0, o1)` (which this context must hold) of layer
    /// `layer_id` for `n` tokens' assembled rows (`[n, C*Hd]`), into `kv`
    /// (`[n, o1-o0]`; bf16 values, as f32 or bf16 bits).
    pub fn kv_columns(
        &self,
        layer_id: u32,
        n: usize,
        rows: SplitIn<'_>,
        (o0, o1): (usize, usize),
        mut kv: SplitOut<'_>,
    ) -> Result<()> {
        let li = layer_index(&self.tables.layer_ids, layer_id)?;
        self.limits.tokens(n)?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
        let held = (info.held_outs.0 as u64, info.held_outs.1 as u64);
        check_range(
            "wkv outputs",
            layer_id,
            (o0 as u64, o1 as u64),
            k_out as u64,
            held,
        )?;
        expect_len("rows", rows.len(), n * k_in, "tokens x C*Hd")?;
        expect_len("kv", kv.len(), n * (o1 - o0), "tokens x outputs")?;
        let mut r16 = try_vec(n * k_in, 0u16, "the rows as bf16")?;
        for (i, r) in r16.iter_mut().enumerate() {
            *r = rows.bf16(i);
        }
        let h0 = info.held_outs.0;
        let out = self.backend.project_held(li, &r16, n, o0 - h0, o1 - h0)?;
        kv.put_f32(0, &out);
        Ok(())
    }

    /// The gate and the highway update of layer `layer_id` from an assembled
    /// `kv` (`[n, D*(hc+1)]`, bf16 values as f32 or bf16 bits; f32 values are
    /// rounded to bf16 first, which leaves bf16 values as they are); the
    /// host `row_ids` say which tokens are dead (left untouched).
    pub fn gate_from_kv(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        kv: SplitIn<'_>,
        highway: Highway<'_>,
    ) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let k_out = self.shape.k_out;
        expect_len("kv", kv.len(), n * k_out, "tokens x D*(hc+1)")?;
        let (region, ty) = highway.into_region();
        let region = region.sized(
            n * self.shape.hw_per_token() * ty.size(),
            ty.size(),
            "highway",
        )?;
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, info.rows)?;
        let mut kvl = try_vec(live.tokens.len() * k_out, 0f32, "kv")?;
        for (j, &t) in live.tokens.iter().enumerate() {
            for o in 0..k_out {
                kvl[j * k_out + o] = bf16_to_f32(kv.bf16(t * k_out + o));
            }
        }
        self.backend.gate_held(li, &live.tokens, &kvl, region, ty)
    }

    /// Projection, gate and highway update of layer `layer_id` from the
    /// assembled rows (`[n, C*Hd]`, bf16 values as f32 or bf16 bits); needs
    /// all of `wkv`'s outputs. The host `row_ids` say which tokens are dead.
    pub fn apply_rows(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        rows: SplitIn<'_>,
        highway: Highway<'_>,
    ) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
        if info.held_outs != (0, k_out) {
            bail!(
                ErrInvalidArgument,
                "layer {layer_id}: engram_apply_rows needs all {k_out} wkv outputs; this shard \
                 holds [{}, {}) (use engram_kv_columns, gather kv, then engram_gate_from_kv)",
                info.held_outs.0,
                info.held_outs.1
            );
        }
        expect_len("rows", rows.len(), n * k_in, "tokens x C*Hd")?;
        let (region, ty) = highway.into_region();
        let region = region.sized(
            n * self.shape.hw_per_token() * ty.size(),
            ty.size(),
            "highway",
        )?;
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, info.rows)?;
        let nl = live.tokens.len();
        let mut r16 = try_vec(nl * k_in, 0u16, "the rows as bf16")?;
        for (j, &t) in live.tokens.iter().enumerate() {
            for i in 0..k_in {
                r16[j * k_in + i] = rows.bf16(t * k_in + i);
            }
        }
        let kv = self.backend.project_held(li, &r16, nl, 0, k_out)?;
        self.backend.gate_held(li, &live.tokens, &kv, region, ty)
    }
}

/// Layer `li`'s info, or `ErrNoWeights`.
pub(super) fn held_info(
    layers: &[Option<LayerInfo>],
    li: usize,
    layer_id: u32,
) -> Result<LayerInfo> {
    match layers[li] {
        Some(l) => Ok(l),
        None => bail!(ErrNoWeights, "layer {layer_id}: weights were never set"),
    }
}

/// Refuse a whole-layer call (`apply`, `read_back`, `prefetch`, `stage`)
/// on a context that holds only part of the layer.
pub(super) fn whole_only(info: &LayerInfo, k_out: usize, layer_id: u32) -> Result<()> {
    if info.held_rows != (0, info.rows) || info.held_outs != (0, k_out) {
        bail!(
            ErrInvalidArgument,
            "layer {layer_id}: this shard context holds rows [{}, {}) of {} and wkv outputs \
             [{}, {}) of {k_out}: the whole-layer calls need all of it (use the split calls: \
             engram_gather_rows, engram_apply_rows, engram_kv_columns, engram_gate_from_kv)",
            info.held_rows.0,
            info.held_rows.1,
            info.rows,
            info.held_outs.0,
            info.held_outs.1
        );
    }
    Ok(())
}

/// `ErrInvalidArgument` unless `ty` is f32 or bf16 (a split call's values).
pub fn split_type(ty: u32, what: &str) -> Result<HighwayType> {
    HighwayType::new(ty).map_err(|_| {
        crate::error::Error::new(
            crate::EngramStatus::ErrUnsupported,
            format!("{what} type {ty} is not supported (ENGRAM_TYPE_F32 or ENGRAM_TYPE_BF16)"),
        )
    })
}
