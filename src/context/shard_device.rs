//! The split points on device memory (the CUDA backend, docs/sharding.md):
//! the same checks as the host calls of [`super::shard`], then the work
//! queued on the engine's stream. The row ids stay host memory (checked
//! here, as `engram_apply` checks them); the values are device buffers.

use super::shard::{check_range, expect_len, held_info};
use super::Context;
use crate::backend::{DevValues, Stream};
use crate::batch::{layer_index, live_ids, HighwayType};
use crate::call::RowIds;
use crate::error::{bail, Result};
use crate::fallible::try_vec;

impl<'w> Context<'w> {
    /// Whether the split calls take device memory (the CUDA backend) rather
    /// than host memory.
    pub fn splits_on_device(&self) -> bool {
        self.kind == crate::call::EngramBackend::Cuda
    }

    /// [`Context::gather_rows`] into `out`, device memory (`[n, N-1, h1-h0,
    /// Hd]` values of `out.ty`), queued on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows_device(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        (r0, r1): (u64, u64),
        (h0, h1): (usize, usize),
        out: DevValues,
        stream: Stream,
    ) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let (nh, n1) = (self.tables.n_heads, self.tables.max_ngram - 1);
        if h0 >= h1 || h1 > nh {
            bail!(
                ErrInvalidArgument,
                "heads [{h0}, {h1}) are not a non-empty range of the {nh} heads"
            );
        }
        check_range("rows", layer_id, (r0, r1), info.rows, info.held_rows)?;
        let per = n1 * (h1 - h0);
        expect_len(
            "out",
            out.len,
            n * per * self.shape.geo.hd,
            "tokens x (N-1) x heads x Hd",
        )?;
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, info.rows)?;
        // Each output cell's local row id, -1 (written as -0.0) where the
        // shard does not own it, the head is not asked for or the token is
        // dead.
        let mut cells = try_vec(n * per, -1i64, "the cells' row ids")?;
        let cols = self.shape.cols;
        for (j, &t) in live.tokens.iter().enumerate() {
            for k in 0..n1 {
                for h in h0..h1 {
                    let r = live.ids[j * cols + k * nh + h] as u64;
                    if (r0..r1).contains(&r) {
                        cells[(t * n1 + k) * (h1 - h0) + h - h0] = (r - info.held_rows.0) as i64;
                    }
                }
            }
        }
        self.backend.gather_device(li, &cells, out, stream)
    }

    /// [`Context::kv_columns`] from and into device memory, queued on
    /// `stream`.
    pub fn kv_columns_device(
        &self,
        layer_id: u32,
        n: usize,
        rows: DevValues,
        (o0, o1): (usize, usize),
        kv: DevValues,
        stream: Stream,
    ) -> Result<()> {
        let li = layer_index(&self.tables.layer_ids, layer_id)?;
        self.limits.tokens(n)?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
        let held = (info.held_outs.0 as u64, info.held_outs.1 as u64);
        let range = (o0 as u64, o1 as u64);
        check_range("wkv outputs", layer_id, range, k_out as u64, held)?;
        expect_len("rows", rows.len, n * k_in, "tokens x C*Hd")?;
        expect_len("kv", kv.len, n * (o1 - o0), "tokens x outputs")?;
        let h0 = info.held_outs.0;
        self.backend
            .project_device(li, n, rows, (o0 - h0, o1 - h0), kv, stream)
    }

    /// [`Context::gate_from_kv`] (`from_rows == false`: `values` is `kv`,
    /// `[n, D*(hc+1)]`) or [`Context::apply_rows`] (`values` are the rows,
    /// `[n, C*Hd]`) on device memory: the highway (`hw`, of type `ty`) is
    /// updated in place on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub fn gate_device(
        &self,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
        values: DevValues,
        from_rows: bool,
        (hw, ty): (u64, HighwayType),
        stream: Stream,
    ) -> Result<()> {
        let li = self.call_layer(layer_id, n, RowIds::Host(row_ids))?;
        let layers = self.layers();
        let info = held_info(&layers, li, layer_id)?;
        let (k_in, k_out) = (self.shape.k_in, self.shape.k_out);
        if from_rows {
            if info.held_outs != (0, k_out) {
                bail!(
                    ErrInvalidArgument,
                    "layer {layer_id}: engram_apply_rows needs all {k_out} wkv outputs; this \
                     shard holds [{}, {}) (use engram_kv_columns, gather kv, then \
                     engram_gate_from_kv)",
                    info.held_outs.0,
                    info.held_outs.1
                );
            }
            expect_len("rows", values.len, n * k_in, "tokens x C*Hd")?;
        } else {
            expect_len("kv", values.len, n * k_out, "tokens x D*(hc+1)")?;
        }
        let live = live_ids(&self.shape, row_ids, n, li, layer_id, info.rows)?;
        self.backend
            .gate_device(li, n, &live.tokens, values, from_rows, (hw, ty), stream)
    }
}
