//! The split points on the CUDA backend (docs/sharding.md): the engine's
//! device buffers and stream, the apply's kernels. The rows a shard owns
//! (`engram_gather_shard`: the gather's cell code, `-0.0` elsewhere), the
//! projection for a range of `wkv`'s outputs (the apply's projection on that
//! range, in the apply's order of sums: the GEMV's where the apply runs the
//! decode kernel, whose sums are the GEMV's), and the gate from an assembled
//! `kv` or rows (the apply's gate kernel). Values come in and go out through
//! `engram_convert_values` (f32 rounded to bf16 as the CPU backend rounds
//! them). Host ids and flags go to the device through the staging slots, as
//! an apply's host ids do.

use super::gpu::{args, check_device_range, Kernel};
use super::kernels;
use super::{CudaBackend, DevLayer, Staging, State, TableLoc, WkvKind, STAGING_SLOTS};
use crate::backend::{DevValues, Stream};
use crate::batch::{try_vec, HighwayType};
use crate::error::{bail, Result};
use std::sync::atomic::Ordering;

impl Staging {
    /// Queue on `stream` the copy of `data` (written at the start of the
    /// memory, over the ids' space) to `dst`, then record the event (also
    /// when queueing failed: whatever was queued is covered).
    ///
    /// # Safety
    /// `dst` holds `data.len()` bytes on the device; the caller holds the
    /// memory (no copy reads it: `wait_idle`) until it returns.
    unsafe fn queue_head(&self, dst: u64, data: &[u8], stream: Stream) -> Result<()> {
        if data.len() > self.ids_bytes {
            bail!(
                ErrInternal,
                "{} bytes for a staging slot of {}",
                data.len(),
                self.ids_bytes
            );
        }
        // SAFETY: the memory holds ids_bytes >= data.len() bytes and is ours
        // (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.buf.ptr, data.len()) };
        // SAFETY: the caller's contract; pinned memory not written again
        // before the event recorded below says the copy has run.
        let r = unsafe { self.gpu.upload_async(dst, self.buf.ptr, data.len(), stream) };
        // SAFETY: a live event; the stream was checked by the caller.
        match unsafe { self.gpu.event_record(self.ev.ev, stream) } {
            Ok(()) => {
                self.copies.store(super::COPIES_EVENT, Ordering::Release);
                r
            }
            Err(e) => {
                self.copies
                    .store(super::COPIES_UNTRACKED, Ordering::Release);
                r.and(Err(e))
            }
        }
    }
}

impl CudaBackend {
    /// Refuse values that are not device memory of their length, or are
    /// not aligned to their element (a misaligned load is a fault that ends
    /// the CUDA context): nothing is queued.
    fn check_values(&self, v: DevValues, what: &str) -> Result<()> {
        if v.len == 0 {
            return Ok(());
        }
        if !v.ptr.is_multiple_of(v.ty.size() as u64) {
            bail!(
                ErrInvalidArgument,
                "{what} ({:#x}) is not aligned to its {}-byte values",
                v.ptr,
                v.ty.size()
            );
        }
        check_device_range(&*self.gpu, v.ptr, v.len * v.ty.size(), what)
    }

    /// Copy `data` to the device at `dst` on `stream` through the next
    /// staging slot (once no copy reads it).
    fn upload_small(&self, st: &mut State, dst: u64, data: &[u8], stream: Stream) -> Result<()> {
        let i = st.next_slot;
        st.next_slot = (i + 1) % STAGING_SLOTS;
        st.slots[i].wait_idle()?;
        // SAFETY: `dst` is one of the context's buffers, which the callers
        // size for `data` (max_tokens * C ids or flags); the slot is ours.
        unsafe { st.slots[i].queue_head(dst, data, stream) }
    }

    /// Queue `engram_convert_values`: `n_rows` rows of `width` values from
    /// `src` (address, f32?, row stride) to `dst` (the same).
    fn queue_convert(
        &self,
        src: (u64, bool, usize),
        dst: (u64, bool, usize),
        n_rows: usize,
        width: usize,
        stream: Stream,
    ) -> Result<()> {
        let total = (n_rows * width) as u64;
        if total == 0 {
            return Ok(());
        }
        let blocks = total
            .div_ceil(kernels::GATHER_THREADS as u64)
            .clamp(1, kernels::GATHER_BLOCKS as u64) as u32;
        let (s, sf, sld) = (src.0, src.1 as u32, src.2 as u64);
        let (d, df, dld) = (dst.0, dst.1 as u32, dst.2 as u64);
        let (rows, w) = (n_rows as u64, width as u64);
        let a = args![s, sf, sld, d, df, dld, rows, w];
        // SAFETY: arguments match engram_convert_values; the callers checked
        // or allocated both buffers for these rows and strides.
        unsafe {
            self.gpu
                .launch(Kernel::Convert, blocks, kernels::GATHER_THREADS, stream, &a)
        }
    }

    /// The projection of `n` tokens' bf16 rows in the rows workspace through
    /// outputs `[lo, hi)` of the `wkv` `layer` holds into the `kv` workspace
    /// (`[n, hi - lo]`), summed as `apply` sums them: where `apply` runs the
    /// decode kernel (whose sums are the GEMV's, per token), the GEMV
    /// kernels a chunk of tokens at a time; else `apply`'s projection.
    fn queue_split_projection(
        &self,
        st: &mut State,
        layer: &DevLayer,
        n: usize,
        (lo, hi): (usize, usize),
        stream: Stream,
    ) -> Result<()> {
        let bufs = (st.rows.ptr, st.kv.ptr);
        let decode = matches!(layer.wkv_kind, WkvKind::Bf16 | WkvKind::Fp8Block { .. })
            && self.runs_decode(st, layer, n)?;
        if !decode {
            return self.queue_projection(st, layer, n, bufs, (lo, hi), false, stream);
        }
        let (k_in, m) = (self.shape.k_in, hi - lo);
        let (w, k, n_out) = (layer.wkv_at(k_in, lo), k_in as u32, m as u32);
        let blocks = n_out.div_ceil(kernels::GEMV_ROWS_PER_WARP * (kernels::GEMV_THREADS / 32));
        for t0 in (0..n).step_by(kernels::GEMV_MAX) {
            let c = kernels::GEMV_MAX.min(n - t0);
            let rows = bufs.0 + (t0 * k_in * 2) as u64;
            let kv = bufs.1 + (t0 * m * 2) as u64;
            match layer.wkv_kind {
                WkvKind::Fp8Block { br, bc, .. } => {
                    let scales = layer.wkv_scales_at(k_in, lo);
                    let (nbc, nt) = ((k_in as u32).div_ceil(bc), c as u32);
                    let a = args![w, scales, br, bc, nbc, rows, kv, n_out, k, nt];
                    // SAFETY: arguments match engram_gemv_fp8_block (8-byte
                    // aligned codes and k % 8 == 0: the decode plan's
                    // conditions); `lo` is a multiple of `br`; the workspaces
                    // hold max_tokens >= n tokens of k_in and k_out values.
                    unsafe {
                        self.gpu.launch(
                            Kernel::GemvFp8,
                            blocks,
                            kernels::GEMV_THREADS,
                            stream,
                            &a,
                        )?
                    }
                }
                _ => {
                    let a = args![w, rows, kv, n_out, k];
                    // SAFETY: arguments match engram_gemv_bf16_<c> (16-byte
                    // aligned wkv, k % 8 == 0: the decode plan's conditions,
                    // kept by a row offset of 2 * k_in bytes); as above.
                    unsafe {
                        self.gpu.launch(
                            Kernel::Gemv(c),
                            blocks,
                            kernels::GEMV_THREADS,
                            stream,
                            &a,
                        )?
                    }
                }
            }
        }
        Ok(())
    }

    /// Layer `li` for a split call: its weights, a table in device memory,
    /// a `wkv` that is not f32; any error the device found reported first.
    fn split_layer(&self, st: &State, li: usize) -> Result<std::sync::Arc<DevLayer>> {
        let layer = self.layer(st, li)?;
        self.take_device_error(st)?;
        if !matches!(layer.table, TableLoc::Device { .. }) {
            bail!(
                ErrUnsupported,
                "layer {}: the split calls on the CUDA backend need the table in device memory \
                 (this layer's is in host memory or a file)",
                layer.layer_id
            );
        }
        if layer.wkv_kind == WkvKind::F32 {
            bail!(
                ErrUnsupported,
                "layer {}: the split calls on the CUDA backend take a bf16, fp8 or quantised wkv \
                 (this layer's is f32)",
                layer.layer_id
            );
        }
        Ok(layer)
    }

    /// Queue `work` on `stream` after the context's last call (outside a
    /// capture), then record the last-work event (also when queueing failed
    /// half way).
    fn queue_ordered(
        &self,
        st: &mut State,
        stream: Stream,
        work: impl FnOnce(&Self, &mut State) -> Result<()>,
    ) -> Result<()> {
        if self.gpu.stream_capturing(stream)? {
            bail!(
                ErrInvalidArgument,
                "the stream is capturing a CUDA graph: the split calls read host row ids or \
                 stage through host memory now, so they cannot be captured"
            );
        }
        self.order_after_last(st, stream)?;
        let r = work(self, st);
        let rec = self.record_last(st, stream);
        r.and(rec)
    }

    /// `engram_gather_rows` on device memory: see [`Backend::gather_device`].
    pub(super) fn gather_on_device(
        &self,
        li: usize,
        cells: &[i64],
        out: DevValues,
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.state();
        let layer = self.split_layer(&st, li)?;
        let hd = self.shape.geo.hd;
        if out.len != cells.len() * hd || cells.len() > self.max_tokens * self.shape.cols {
            bail!(
                ErrInternal,
                "{} cells for {} values out",
                cells.len(),
                out.len
            );
        }
        self.check_values(out, "out")?;
        if cells.is_empty() {
            return Ok(());
        }
        let TableLoc::Device { table, scales } = layer.table else {
            unreachable!("split_layer")
        };
        let mut bytes = try_vec(cells.len() * 8, 0u8, "the cells' ids")?;
        for (b, c) in bytes.chunks_exact_mut(8).zip(cells) {
            b.copy_from_slice(&c.to_le_bytes());
        }
        self.queue_ordered(&mut st, stream, |b, st| {
            let ids = st.ids.ptr;
            b.upload_small(st, ids, &bytes, stream)?;
            st.serial = st.serial.wrapping_add(1);
            let (rows, fmt, hd32) = (layer.rows, layer.format as u32, hd as u32);
            let (rb, n_cells) = (layer.row_bytes as u32, cells.len() as u64);
            let (o, of32) = (out.ptr, (out.ty == HighwayType::F32) as u32);
            let (flags, latch, serial) = (st.flags.ptr, st.latch.ptr, st.serial);
            let lid = layer.layer_id;
            let a = args![
                table, scales, rows, fmt, hd32, rb, ids, n_cells, o, of32, flags, latch, lid,
                serial
            ];
            // SAFETY: arguments match engram_gather_shard; the ids buffer
            // holds max_tokens * C >= n_cells ids (just copied), the flags as
            // many; `out` was checked for n_cells * Hd values; the table at
            // set_layer.
            unsafe {
                b.gpu.launch(
                    Kernel::GatherShard,
                    kernels::gather_blocks(cells.len()),
                    kernels::GATHER_THREADS,
                    stream,
                    &a,
                )
            }
        })
    }

    /// `engram_kv_columns` on device memory: see [`Backend::project_device`].
    pub(super) fn project_on_device(
        &self,
        li: usize,
        n: usize,
        rows: DevValues,
        (lo, hi): (usize, usize),
        kv: DevValues,
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.state();
        let layer = self.split_layer(&st, li)?;
        let k_in = self.shape.k_in;
        self.check_values(rows, "rows")?;
        self.check_values(kv, "kv")?;
        if n == 0 {
            return Ok(());
        }
        // A block-scaled fp8 wkv is read from a whole block row on.
        let lo0 = match layer.wkv_kind {
            WkvKind::Fp8Block { br, .. } => lo / br as usize * br as usize,
            _ => lo,
        };
        let m = hi - lo0;
        self.queue_ordered(&mut st, stream, |b, st| {
            let f32s = |v: DevValues| v.ty == HighwayType::F32;
            let ws_rows = (st.rows.ptr, false, k_in);
            b.queue_convert((rows.ptr, f32s(rows), k_in), ws_rows, n, k_in, stream)?;
            b.queue_split_projection(st, &layer, n, (lo0, hi), stream)?;
            let from = (st.kv.ptr + ((lo - lo0) * 2) as u64, false, m);
            b.queue_convert(from, (kv.ptr, f32s(kv), hi - lo), n, hi - lo, stream)
        })
    }

    /// `engram_gate_from_kv` and `engram_apply_rows` on device memory: see
    /// [`Backend::gate_device`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gate_on_device(
        &self,
        li: usize,
        n: usize,
        live: &[usize],
        values: DevValues,
        from_rows: bool,
        (hw, ty): (u64, HighwayType),
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.state();
        let layer = self.split_layer(&st, li)?;
        let s = self.shape;
        self.check_values(values, if from_rows { "rows" } else { "kv" })?;
        let hw_values = DevValues {
            ptr: hw,
            len: n * s.hw_per_token(),
            ty,
        };
        self.check_values(hw_values, "highway")?;
        if n == 0 {
            return Ok(());
        }
        // The gate leaves a token alone unless its C flags are all LIVE.
        let mut flags = try_vec(n * s.cols * 4, 0u8, "the tokens' flags")?;
        let mut is_live = try_vec(n, false, "the live tokens")?;
        for &t in live {
            is_live[t] = true;
        }
        for (t, &l) in is_live.iter().enumerate() {
            let f: u32 = if l { 0 } else { 1 }; // ENG_TOKEN_LIVE, ENG_TOKEN_DEAD
            for c in 0..s.cols {
                flags[(t * s.cols + c) * 4..][..4].copy_from_slice(&f.to_le_bytes());
            }
        }
        self.queue_ordered(&mut st, stream, |b, st| {
            let fl = st.flags.ptr;
            b.upload_small(st, fl, &flags, stream)?;
            let f32s = values.ty == HighwayType::F32;
            if from_rows {
                let ws = (st.rows.ptr, false, s.k_in);
                b.queue_convert((values.ptr, f32s, s.k_in), ws, n, s.k_in, stream)?;
                b.queue_split_projection(st, &layer, n, (0, s.k_out), stream)?;
            } else {
                let ws = (st.kv.ptr, false, s.k_out);
                b.queue_convert((values.ptr, f32s, s.k_out), ws, n, s.k_out, stream)?;
            }
            let kv = st.kv.ptr;
            b.queue_gate(st, li, n, hw, ty, kv, false, stream)
        })
    }
}
