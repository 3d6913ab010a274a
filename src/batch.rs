//! Geometry, limits, and every check on a call's inputs, each written once:
//! the context runs them before any backend sees a call, the hash checks its
//! sequence ids and positions with them, and each backend that must repeat
//! one (the CUDA kernels check device row ids on the device) reports it with
//! the same message. What they check is the data of [`crate::call`].

use crate::call::{CheckedLayer, LayerIn, TableSource, ROW_ID_DEAD};
pub use crate::call::{HighwayType, LayerBytes, LiveIds};
use crate::error::{bail, EngramStatus, Error, Result};
pub use crate::fallible::{try_map, try_room, try_vec, try_vec_with, vec_bytes};
use crate::formats::{EngramType, WeightDtype, WeightFormat};
use crate::memory::Region;

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

impl Geometry {
    /// The create-time checks: positive, small enough that every buffer size
    /// stays well inside `usize` and `i32` element counts, `eps` finite.
    pub fn check(&self) -> Result<()> {
        let g = self;
        if g.d == 0 || g.hc == 0 || g.hd == 0 {
            bail!(
                ErrInvalidConfig,
                "geometry D = {}, hc = {}, Hd = {}: each must be positive",
                g.d,
                g.hc,
                g.hd
            );
        }
        if g.d > 1 << 20 || g.hc > 64 || g.hd > 1 << 16 {
            bail!(
                ErrInvalidConfig,
                "geometry D = {}, hc = {}, Hd = {} out of range (at most 2^20, 64, 2^16)",
                g.d,
                g.hc,
                g.hd
            );
        }
        // eps = 0 would make a zero stream's gate 0/0 (NaN in all D values).
        if !(g.eps.is_finite() && g.eps > 0.0) {
            bail!(
                ErrInvalidConfig,
                "eps = {} must be finite and > 0 (docs/numerics.md)",
                g.eps
            );
        }
        Ok(())
    }
}

/// Capacity limits fixed at create time.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_positions: usize,
}

impl Limits {
    /// The create-time checks.
    pub fn check(&self) -> Result<()> {
        if self.max_tokens == 0 || self.max_seqs == 0 || self.max_positions == 0 {
            bail!(
                ErrInvalidConfig,
                "capacities max_tokens = {}, max_seqs = {}, max_positions = {}: each must be positive",
                self.max_tokens,
                self.max_seqs,
                self.max_positions
            );
        }
        if self.max_positions > i32::MAX as usize
            || self.max_seqs > 1 << 24
            || self.max_tokens > 1 << 24
        {
            bail!(
                ErrInvalidConfig,
                "capacities out of range (max_positions <= 2^31-1, max_seqs and max_tokens <= 2^24)"
            );
        }
        Ok(())
    }

    /// `n` tokens in one call.
    pub fn tokens(&self, n: usize) -> Result<()> {
        if n > self.max_tokens {
            bail!(
                ErrCapacity,
                "{n} tokens in one call, the context was created for at most {}",
                self.max_tokens
            );
        }
        Ok(())
    }

    /// A sequence id, as an index.
    pub fn seq(&self, seq: i32) -> Result<usize> {
        match usize::try_from(seq) {
            Ok(s) if s < self.max_seqs => Ok(s),
            _ => bail!(
                ErrInvalidSequence,
                "sequence id {seq} outside [0, max_seqs = {})",
                self.max_seqs
            ),
        }
    }

    /// Token `i`'s position, as an index.
    pub fn pos(&self, i: usize, pos: i32) -> Result<usize> {
        match usize::try_from(pos) {
            Ok(p) if p < self.max_positions => Ok(p),
            _ => bail!(
                ErrInvalidSequence,
                "token {i}: position {pos} outside [0, max_positions = {})",
                self.max_positions
            ),
        }
    }
}

/// The sizes of one context's calls, derived from its geometry and tables.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub geo: Geometry,
    /// `C = (N-1)*H` columns per token per layer.
    pub cols: usize,
    pub n_layers: usize,
    /// Row ids per token, `n_layers * C`.
    pub per: usize,
    /// Inputs of the projection per token, `C * Hd`.
    pub k_in: usize,
    /// Outputs of the projection per token, `D * (hc + 1)`.
    pub k_out: usize,
}

impl Shape {
    /// The sizes for `n_layers` engram layers of `cols` columns each (the
    /// hash tables': [`crate::hash::HashTables::cols`], `n_layers`).
    pub fn new(geo: Geometry, cols: usize, n_layers: usize) -> Shape {
        Shape {
            geo,
            cols,
            n_layers,
            per: cols * n_layers,
            k_in: cols * geo.hd,
            k_out: geo.d * (geo.hc + 1),
        }
    }

    /// Highway values per token, `hc * D`.
    pub fn hw_per_token(&self) -> usize {
        self.geo.hc * self.geo.d
    }

    /// `len` row ids for `n` tokens (`[n, n_layers, C]`).
    pub fn check_row_ids(&self, len: usize, n: usize) -> Result<()> {
        if Some(len) != n.checked_mul(self.per) {
            bail!(
                ErrInvalidArgument,
                "{len} row ids for {n} tokens, expected {} ([n, n_layers, C])",
                n.saturating_mul(self.per)
            );
        }
        Ok(())
    }

    /// A highway of `len` values for `n` tokens (`[n, hc, D]`).
    pub fn check_highway(&self, len: usize, n: usize) -> Result<()> {
        if Some(len) != n.checked_mul(self.hw_per_token()) {
            bail!(
                ErrInvalidArgument,
                "highway holds {len} values for {n} tokens, expected {}",
                n.saturating_mul(self.hw_per_token())
            );
        }
        Ok(())
    }

    /// Token `t`'s row ids for layer index `li`.
    #[inline]
    pub fn token_ids<'a>(&self, row_ids: &'a [i64], t: usize, li: usize) -> &'a [i64] {
        let at = t * self.per + li * self.cols;
        &row_ids[at..at + self.cols]
    }
}

/// Index of model layer `layer_id` among the engram layers (`layer_ids`,
/// the hash tables' [`crate::hash::HashTables::layer_ids`]).
pub fn layer_index(layer_ids: &[u32], layer_id: u32) -> Result<usize> {
    match layer_ids.iter().position(|&l| l == layer_id) {
        Some(li) => Ok(li),
        None => bail!(
            ErrUnknownLayer,
            "layer {layer_id} is not an engram layer (engram layers: {layer_ids:?})"
        ),
    }
}

/// The error of a token whose row ids are only partly `ENGRAM_ROW_ID_DEAD`
/// (`c` the first dead column), as every backend reports it.
pub fn partly_dead(t: usize, layer_id: u32, c: usize) -> Error {
    Error::new(
        EngramStatus::ErrInvalidRowId,
        format!(
            "token {t}, layer {layer_id}: column {c} is ENGRAM_ROW_ID_DEAD (-1) but other columns are not; \
             a dead token has -1 in every column"
        ),
    )
}

/// The error of a row id outside the table, as every backend reports it.
pub fn row_out_of_range(t: usize, layer_id: u32, c: usize, r: i64, rows: u64) -> Error {
    Error::new(
        EngramStatus::ErrInvalidRowId,
        format!(
            "token {t}, layer {layer_id}, column {c}: row id {r} outside the table [0, {rows})"
        ),
    )
}

/// The error of a row that holds invalid data, as every backend reports it.
pub fn invalid_row(layer_id: u32, row: i64, t: usize, c: usize, what: &str) -> Error {
    Error::new(
        EngramStatus::ErrInvalidData,
        format!("layer {layer_id}, row {row} (token {t}, column {c}): {what}"),
    )
}

/// Check one token's row ids for one layer (`tid`, its `C` columns): `true`
/// for a live token whose ids all lie in `[0, rows)`, `false` for a dead one
/// (every column `ROW_ID_DEAD`), an `ErrInvalidRowId` naming the token and
/// column otherwise.
pub fn check_token_ids(tid: &[i64], t: usize, layer_id: u32, rows: u64) -> Result<bool> {
    if tid.iter().all(|&r| r == ROW_ID_DEAD) {
        return Ok(false);
    }
    if let Some(c) = tid.iter().position(|&r| r == ROW_ID_DEAD) {
        return Err(partly_dead(t, layer_id, c));
    }
    for (c, &r) in tid.iter().enumerate() {
        if r < 0 || r as u64 >= rows {
            return Err(row_out_of_range(t, layer_id, c, r, rows));
        }
    }
    Ok(true)
}

/// Check every token's row ids for layer `li` (`[n, n_layers, C]` host ids,
/// their length already checked) and collect the live ones.
pub fn live_ids(
    shape: &Shape,
    row_ids: &[i64],
    n: usize,
    li: usize,
    layer_id: u32,
    rows: u64,
) -> Result<LiveIds> {
    let mut tokens = Vec::new();
    let mut ids = Vec::new();
    if tokens.try_reserve_exact(n).is_err() || ids.try_reserve_exact(n * shape.cols).is_err() {
        bail!(ErrCapacity, "out of memory for the row ids of {n} tokens");
    }
    for t in 0..n {
        let tid = shape.token_ids(row_ids, t, li);
        if check_token_ids(tid, t, layer_id, rows)? {
            tokens.push(t);
            ids.extend_from_slice(tid);
        }
    }
    Ok(LiveIds { tokens, ids })
}

/// The checks of `set_layer`, in the order a C caller meets them: the
/// table's format, its pointer and size; `wkv`'s type, pointer, alignment and
/// size; the same for `q` and `k`; then that the table covers every row the
/// hash can produce. Returns the layer with its regions sized. `wkv_outs`:
/// the outputs `[o0, o1)` that `w.wkv` and its scales hold (`(0, k_out)`:
/// the whole `wkv`; a part is what a loader read for a shard).
pub fn check_layer<'w>(
    shape: &Shape,
    rows_needed: u64,
    w: LayerIn<'w>,
    wkv_outs: (usize, usize),
) -> Result<CheckedLayer<'w>> {
    let g = shape.geo;
    let layer_id = w.layer_id;
    let rows = w.table.rows;
    let format = EngramType::row_format(w.table.ty, g.hd)?;
    // The arrays' bytes per row: one array, or codes and scales (split fp8).
    let (rb, scale_rb) = format.planes(g.hd);
    let sizes = TableSizes { layer_id, rows };
    let (source, table) = table_codes(w.table.source, &sizes, rb)?;
    let (scales, scales_bytes) = table_scales(w.table.scales, &sizes, format, scale_rb)?;
    let (o0, o1) = wkv_outs;
    if o0 > o1 || o1 > shape.k_out {
        bail!(
            ErrInvalidArgument,
            "layer {layer_id}: wkv outputs [{o0}, {o1}) are not a range of [0, {})",
            shape.k_out
        );
    }
    let (wkv_type, wkv_bytes, wkv) = weight(
        layer_id,
        w.wkv,
        w.wkv_type,
        (o1 - o0, shape.k_in),
        true,
        "weights.wkv",
    )?;
    let (wkv_scales, wkv_block, wkv_scales_bytes) =
        wkv_scales(wkv_type, w.wkv_scales, w.wkv_block, shape, wkv_outs)?;
    let (qk_type, qk_bytes, q) = weight(layer_id, w.q, w.qk_type, (g.hc, g.d), false, "weights.q")?;
    let (_, _, k) = weight(layer_id, w.k, w.qk_type, (g.hc, g.d), false, "weights.k")?;
    if rows < rows_needed {
        bail!(
            ErrInvalidConfig,
            "layer {layer_id}: the hash offsets and primes reach row {} but the table has {rows} rows",
            rows_needed - 1
        );
    }
    Ok(CheckedLayer {
        layer_id,
        source,
        scales,
        format,
        rows,
        wkv,
        wkv_type,
        wkv_scales,
        wkv_block,
        wkv_outs,
        q,
        k,
        qk_type,
        bytes: LayerBytes {
            table,
            scales: scales_bytes,
            wkv: wkv_bytes,
            wkv_scales: wkv_scales_bytes,
            qk: qk_bytes,
        },
    })
}

/// `layer {layer_id}: {what} is too large`.
fn too_large(layer_id: u32, what: &str) -> Error {
    Error::new(
        EngramStatus::ErrInvalidArgument,
        format!("layer {layer_id}: {what} is too large"),
    )
}

/// A layer's table: its id and rows, for sizing its arrays.
struct TableSizes {
    layer_id: u32,
    rows: u64,
}

impl TableSizes {
    /// The bytes of an array of `per_row` bytes a row (at most `isize::MAX`).
    fn bytes(&self, per_row: usize, what: &str) -> Result<u64> {
        let rows = self.rows;
        rows.checked_mul(per_row as u64)
            .filter(|&b| b <= isize::MAX as u64)
            .ok_or_else(|| {
                too_large(
                    self.layer_id,
                    &format!("{what}: {rows} rows of {per_row} bytes"),
                )
            })
    }
}

/// The table's codes (or its whole rows): non-NULL and sized in memory, or
/// a file. Returns the source and its bytes.
fn table_codes<'w>(
    source: TableSource<'w>,
    sizes: &TableSizes,
    rb: usize,
) -> Result<(TableSource<'w>, u64)> {
    if let TableSource::Memory(r) = &source {
        if r.is_null() {
            bail!(ErrNullArgument, "weights.table is NULL");
        }
    }
    let table = sizes.bytes(rb, "the table")?;
    let source = match source {
        TableSource::Memory(r) => {
            TableSource::Memory(r.sized(table as usize, 1, "weights.table")?)
        }
        f => f,
    };
    Ok((source, table))
}

/// The table's separate scale array: required (non-NULL, sized) for the
/// split fp8 format, refused for every other. Returns it and its bytes.
fn table_scales<'w>(
    scales: Option<TableSource<'w>>,
    sizes: &TableSizes,
    format: EngramType,
    scale_rb: Option<usize>,
) -> Result<(Option<TableSource<'w>>, u64)> {
    Ok(match (scale_rb, scales) {
        (None, None) => (None, 0),
        (None, Some(_)) => bail!(
            ErrInvalidArgument,
            "weights.table_scales is set, but a {} table keeps its scales in its rows \
             (only ENGRAM_TYPE_FP8_E4M3_E8M0_SPLIT takes a separate scale array)",
            format.name()
        ),
        (Some(_), None) => bail!(
            ErrNullArgument,
            "weights.table_scales is NULL: a {} table needs its e8m0 scale array",
            format.name()
        ),
        (Some(srb), Some(src)) => {
            let n = sizes.bytes(srb, "the table's scales")?;
            let src = match src {
                TableSource::Memory(r) => {
                    if r.is_null() {
                        bail!(
                            ErrNullArgument,
                            "weights.table_scales is NULL: a {} table needs its e8m0 scale array",
                            format.name()
                        );
                    }
                    TableSource::Memory(r.sized(n as usize, 1, "weights.table_scales")?)
                }
                f => f,
            };
            (Some(src), n)
        }
    })
}

/// A weight's type, then its region, `[rows, row_len]`: `(type, bytes,
/// region)`. `quant_ok`: the GGUF block formats are accepted (else only
/// the dense ones).
fn weight<'w>(
    layer_id: u32,
    r: Region<'w>,
    ty: u32,
    (rows, row_len): (usize, usize),
    quant_ok: bool,
    what: &str,
) -> Result<(EngramType, usize, Region<'w>)> {
    let f = if quant_ok {
        WeightFormat::new(ty, row_len, what)?
    } else {
        WeightFormat::Dense(WeightDtype::new(ty, what)?)
    };
    let bytes = f
        .bytes(rows, row_len)
        .ok_or_else(|| too_large(layer_id, what))?;
    let align = match f {
        WeightFormat::Dense(d) => d.size(),
        WeightFormat::Quant(_) | WeightFormat::Fp8Block => 1,
    };
    let t = EngramType::from_u32(ty).expect("a weight format is a type");
    Ok((t, bytes, r.sized(bytes, align, what)?))
}

/// `wkv`'s block scales: required (non-NULL, a positive block shape, sized)
/// for a block-scaled fp8 `wkv`, refused for every other format. Returns
/// the sized region, the block shape and the scales' bytes.
fn wkv_scales<'w>(
    ty: EngramType,
    scales: Option<Region<'w>>,
    (br, bc): (u32, u32),
    shape: &Shape,
    (o0, o1): (usize, usize),
) -> Result<(Option<Region<'w>>, (usize, usize), usize)> {
    let fp8 = EngramType::Fp8E4m3E8m0Block;
    if ty != fp8 {
        if scales.is_some_and(|r| !r.is_null()) || br != 0 || bc != 0 {
            bail!(
                ErrInvalidArgument,
                "weights.wkv_scales / wkv_block_rows / wkv_block_cols are set, but a {} wkv \
                 takes no block scales (only {} does)",
                ty.name(),
                fp8.name()
            );
        }
        return Ok((None, (0, 0), 0));
    }
    let (br, bc) = (br as usize, bc as usize);
    if br == 0 || bc == 0 {
        bail!(
            ErrInvalidArgument,
            "weights.wkv_block_rows and wkv_block_cols must be positive for a {} wkv, got {br} x {bc}",
            fp8.name()
        );
    }
    let r = match scales {
        Some(r) if !r.is_null() => r,
        _ => bail!(
            ErrNullArgument,
            "weights.wkv_scales is NULL: a {} wkv needs its e8m0 block scales",
            fp8.name()
        ),
    };
    if o0 % br != 0 || (o1 % br != 0 && o1 != shape.k_out) {
        bail!(
            ErrInvalidArgument,
            "wkv outputs [{o0}, {o1}) do not start and end at whole {br}-row scale blocks"
        );
    }
    let n = crate::formats::fp8_block::fp8_block_scale_len(o1 - o0, shape.k_in, br, bc)
        .ok_or_else(|| {
            Error::new(
                EngramStatus::ErrInvalidArgument,
                "weights.wkv_scales is too large".to_string(),
            )
        })?;
    Ok((Some(r.sized(n, 1, "weights.wkv_scales")?), (br, bc), n))
}
