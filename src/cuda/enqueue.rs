//! The work one `apply` queues on the caller's stream: the staged copy of
//! host row ids (and of a host table's rows), then the decode kernel
//! (gather, projection and gate in one launch, or its phase A and the gate
//! kernel) where it applies, else the gather, the projection
//! (a GEMV kernel, cuBLAS, or dequantised tiles and cuBLAS) and the gate.
//! Nothing here allocates; the host waits only for a staging slot's previous
//! copy.

use super::gpu::{args, Arg, Gemm, Kernel};
use super::kernels;
use super::{CudaBackend, DevLayer, State, TableLoc, WkvKind, STAGING_SLOTS};
use crate::backend::{Ids, Stream};
use crate::batch::Shape;
use crate::batch::{HighwayType, LiveIds};
use crate::cpu::stager::InPlace;
use crate::error::{bail, Result};
use std::sync::Arc;

/// One call through a device cache ([`CudaBackend::queue_cached`]): the
/// layer's device rows and staged ids, the call's ids and live tokens.
struct CachedCall<'a> {
    cache: &'a super::DevCache,
    dev: (u64, u64),
    all: &'a [i64],
    n: usize,
    li: usize,
    live: &'a LiveIds,
    rb: usize,
    stream: Stream,
}

/// How the decode kernel runs one call (docs/cuda.md "The decode kernel").
#[derive(Clone, Copy, Debug)]
struct DecodePlan {
    /// A block-scaled fp8 `wkv` (its scales and block shape), else bf16.
    fp8: bool,
    wscales: u64,
    br: u32,
    bc: u32,
    /// Tokens a block gathers into shared memory at once, and the bytes.
    tile: u32,
    shared: u32,
    /// Blocks: `kernels::decode_grid` for the kernel's occupancy.
    grid: u32,
}

/// Where one call's row ids are for the kernels: the address, the stride
/// between tokens and the offset of this layer's columns (in entries), and a
/// host table's staged rows, ids and (with a device cache) row indices (0:
/// none).
#[derive(Clone, Copy, Debug)]
struct IdsAt {
    ptr: u64,
    stride: u32,
    offset: u32,
    staged: Option<(u64, u64, u64)>,
}

impl CudaBackend {
    /// The decode kernel's plan for `n` tokens of `layer`, or `None` where
    /// the path before it runs: a batch over the decode limit, a `wkv` that
    /// is neither bf16 nor block-scaled fp8, `C*Hd` not a multiple of 8, a
    /// `wkv` off the alignment of its 16-byte (bf16) or 8-byte (fp8) loads,
    /// or a row of `C*Hd` bf16 values that does not fit in shared memory
    /// (or a block of the kernel on a multiprocessor).
    fn decode_plan(
        &self,
        st: &mut State,
        layer: &DevLayer,
        n: usize,
    ) -> Result<Option<DecodePlan>> {
        let k_in = self.shape.k_in;
        if n == 0 || n > st.decode_max || !k_in.is_multiple_of(8) {
            return Ok(None);
        }
        let (fp8, wscales, br, bc) = match layer.wkv_kind {
            WkvKind::Bf16 if layer.wkv.is_multiple_of(16) => (false, 0, 0, 0),
            WkvKind::Fp8Block { scales, br, bc } if layer.wkv.is_multiple_of(8) => {
                (true, scales, br, bc)
            }
            _ => return Ok(None),
        };
        let tile = kernels::decode_tile(n, k_in, self.limits.max_shared as usize);
        if tile == 0 {
            return Ok(None);
        }
        let mut plan = DecodePlan {
            fp8,
            wscales,
            br,
            bc,
            tile: tile as u32,
            shared: (tile * k_in * 2) as u32,
            grid: 0,
        };
        // The occupancy (blocks per multiprocessor, 0: not even one fits),
        // asked once per format and tile.
        let cached = &mut st.decode_occupancy[fp8 as usize][tile];
        if *cached == u32::MAX {
            *cached =
                self.gpu
                    .occupancy(Kernel::Decode { fp8 }, kernels::DECODE_THREADS, plan.shared)?;
        }
        if *cached == 0 {
            return Ok(None);
        }
        plan.grid = kernels::decode_grid(self.shape.k_out, self.limits.sms, *cached);
        Ok(Some(plan))
    }

    /// Whether `apply` of `n` tokens of `layer` runs the decode kernel (its
    /// sums are the GEMV kernels', per token).
    pub(super) fn runs_decode(&self, st: &mut State, layer: &DevLayer, n: usize) -> Result<bool> {
        Ok(self.decode_plan(st, layer, n)?.is_some())
    }

    pub(super) fn layer(&self, st: &State, li: usize) -> Result<Arc<DevLayer>> {
        match &st.layers[li] {
            Some(l) => Ok(l.clone()),
            None => bail!(
                ErrNoWeights,
                "layer {}: weights were never set",
                self.layer_ids[li]
            ),
        }
    }

    /// `engram_stage`: copy the rows (and ids) of `n` tokens with host row
    /// ids `all` (`live`: their checked live tokens) of layer `li` to the
    /// layer's device staging buffer on `stream`, for a later call with
    /// device row ids (a graph replay) to read. A no-op for a device table.
    pub(super) fn stage_rows(
        &self,
        li: usize,
        all: &[i64],
        live: &LiveIds,
        n: usize,
        stream: Stream,
    ) -> Result<()> {
        let mut st = self.state();
        let layer = self.layer(&st, li)?;
        if matches!(layer.table, TableLoc::Device { .. }) {
            return Ok(());
        }
        if self.gpu.stream_capturing(stream)? {
            bail!(
                ErrInvalidArgument,
                "the stream is capturing a CUDA graph: engram_stage gathers rows on the host now, so \
                 it cannot be captured; call it before launching the graph, on the graph's stream"
            );
        }
        if n == 0 {
            return Ok(());
        }
        self.order_after_last(&st, stream)?;
        let r = self.stage_host(&mut st, &layer, li, all, live, n, stream);
        let rec = self.record_last(&mut st, stream);
        r.and(rec)
    }

    /// Order a call's work on `stream` (outside a capture) after the
    /// context's last call's: where that was queued on another stream, this
    /// stream waits on the device for its event (`cuStreamWaitEvent`), so
    /// the context's workspaces, its decode kernel's count of blocks done and
    /// its error latch are used by one call at a time whatever streams the
    /// engine calls it on (docs/cuda-streams.md). Nothing when the stream is
    /// the last call's (the engine's usual one stream).
    pub(super) fn order_after_last(&self, st: &State, stream: Stream) -> Result<()> {
        if st.last_used && st.last_stream != stream as usize {
            // SAFETY: a live event of this device, recorded on the last
            // call's stream; `stream` was checked by the caller
            // (stream_capturing).
            unsafe { self.gpu.stream_wait_event(stream, st.last.ev)? };
        }
        Ok(())
    }

    /// Record the context's last-work event on `stream` after the work just
    /// queued there (see [`super::State::last`]).
    pub(super) fn record_last(&self, st: &mut State, stream: Stream) -> Result<()> {
        // SAFETY: a live event of this device; the stream was checked by the
        // caller (stream_capturing).
        unsafe { self.gpu.event_record(st.last.ev, stream)? };
        st.last_used = true;
        st.last_stream = stream as usize;
        Ok(())
    }

    /// Queue on `stream` the copy of the `[n, C]` host ids of layer `li`
    /// (and, for a host table, of the live tokens' rows at their positions)
    /// from pinned memory to the device: the ids to the layer's staged ids
    /// (host table) or the context's id buffer (device table). A host table's
    /// rows that a prefetch of the same ids gathered into the layer's pinned
    /// prefetch memory are copied from there; any other rows, and the ids of
    /// a device table, are written into the next staging slot (after the
    /// copy that last read it has run) and copied from it.
    #[allow(clippy::too_many_arguments)]
    fn stage_host(
        &self,
        st: &mut State,
        layer: &DevLayer,
        li: usize,
        all: &[i64],
        live: &LiveIds,
        n: usize,
        stream: Stream,
    ) -> Result<()> {
        let s = self.shape;
        let cells = n * s.cols;
        let next_slot = Self::next_slot;
        match &layer.table {
            TableLoc::Device { .. } => {
                let i = next_slot(st)?;
                let slot = &st.slots[i];
                slot.write_ids(&s, all, n, li);
                // SAFETY: the context's id buffer holds max_tokens * C ids;
                // the slot is ours until the call returns.
                unsafe { slot.queue_copies(st.ids.ptr, cells, None, stream) }
            }
            TableLoc::Host {
                gen,
                rows,
                ids,
                prefetch,
                cache: Some(cache),
            } => {
                let call = CachedCall {
                    cache,
                    dev: (rows.ptr, ids.ptr),
                    all,
                    n,
                    li,
                    live,
                    rb: layer.row_bytes,
                    stream,
                };
                self.stage_host_cached(st, *gen, prefetch, &call)
            }
            TableLoc::Host {
                gen,
                rows,
                ids,
                prefetch,
                cache: None,
            } => {
                let rb = layer.row_bytes;
                let (rows_dev, ids_dev) = (rows.ptr, ids.ptr);
                self.stager.serve_in_place(
                    li,
                    *gen,
                    &live.ids,
                    &live.tokens,
                    s.cols,
                    |si| {
                        // The rows are in the prefetch memory of slot `si`,
                        // which the stager holds for this call.
                        let b = &prefetch[si];
                        b.write_ids(&s, all, n, li);
                        // SAFETY: the layer's staging buffers hold max_tokens
                        // * C ids and rows; the stager's slot is ours until
                        // this returns, and its next gather waits for the
                        // event recorded here (`InPlace::wait_idle`).
                        unsafe {
                            b.queue_copies(ids_dev, cells, Some((rows_dev, cells * rb)), stream)
                        }
                    },
                    |read| {
                        let i = next_slot(st)?;
                        let slot = &st.slots[i];
                        slot.write_ids(&s, all, n, li);
                        let (p, len) = InPlace::rows(slot);
                        // SAFETY: the rows part of the slot, which holds
                        // max_tokens * C rows of `slot_row_bytes` >= rb
                        // (grown by set_layer); no copy reads it (waited
                        // above) and it is ours until the call returns.
                        let dst = unsafe { std::slice::from_raw_parts_mut(p, len) };
                        read(&mut dst[..cells * rb])?;
                        // SAFETY: as above; the device buffers hold max_tokens
                        // * C ids and rows.
                        unsafe {
                            slot.queue_copies(ids_dev, cells, Some((rows_dev, cells * rb)), stream)
                        }
                    },
                )
            }
        }
    }

    /// The next staging slot, once no copy reads it.
    fn next_slot(st: &mut State) -> Result<usize> {
        let i = st.next_slot;
        st.next_slot = (i + 1) % STAGING_SLOTS;
        st.slots[i].wait_idle()?;
        Ok(i)
    }

    /// [`CudaBackend::stage_host`] for a layer with a device cache: the
    /// call's rows from the prefetch that gathered them into the layer's
    /// pinned memory, else read into the next staging slot; then
    /// [`CudaBackend::queue_cached`] from there.
    fn stage_host_cached(
        &self,
        st: &mut State,
        gen: u64,
        prefetch: &[Arc<super::Staging>],
        call: &CachedCall<'_>,
    ) -> Result<()> {
        let (cols, rb) = (self.shape.cols, call.rb);
        let cells = call.n * cols;
        self.stager.serve_in_place(
            call.li,
            gen,
            &call.live.ids,
            &call.live.tokens,
            cols,
            |si| {
                // SAFETY: the stager holds the prefetch memory of slot `si`
                // for this call (its rows gathered, the aux part there as the
                // layer has a cache), and its next gather waits for the event
                // queue_cached records.
                unsafe { self.queue_cached(&prefetch[si], call) }
            },
            |read| {
                let i = Self::next_slot(st)?;
                let slot = &st.slots[i];
                let (p, len) = InPlace::rows(slot);
                // SAFETY: the rows part of the slot (max_tokens * C rows of
                // slot_row_bytes >= rb, grown by set_layer), ours until the
                // call returns.
                let dst = unsafe { std::slice::from_raw_parts_mut(p, len) };
                read(&mut dst[..cells * rb])?;
                // SAFETY: as above; the slots have the aux part (grown by
                // set_layer for a cached layer) and this one is ours once
                // `next_slot` waited for its copies.
                unsafe { self.queue_cached(slot, call) }
            },
        )
    }

    /// A call's copies through a host-table layer's device cache (see
    /// [`super::devcache`]): from `mem`, which holds the call's host rows at
    /// their cells, write the ids, plan the call (compacting the rows to
    /// copy), queue the copies of the ids, row indices, admissions and staged
    /// rows, record `mem`'s event, then queue `engram_cache_fill`. A failure
    /// after the plan forgets the cache's rows (the policy no longer says
    /// what the slots hold).
    ///
    /// # Safety
    /// `mem` has the aux part (`aux_cells` = max_tokens * C), holds the rows
    /// of `cells` cells of `rb` bytes, and is the caller's until it returns.
    unsafe fn queue_cached(&self, mem: &super::Staging, c: &CachedCall<'_>) -> Result<()> {
        let s = self.shape;
        let (cells, rb, cache) = (c.n * s.cols, c.rb, c.cache);
        mem.write_ids(&s, c.all, c.n, c.li);
        // SAFETY: the caller's contract; no other reference to these parts.
        let (slots, fill) = unsafe { mem.aux() };
        let (p, _) = InPlace::rows(mem);
        // SAFETY: the rows part holds `cells` rows of `rb` (the contract).
        let rows = unsafe { std::slice::from_raw_parts_mut(p, cells * rb) };
        let mut plan = cache.plan.lock().unwrap_or_else(|p| p.into_inner());
        let planned = plan.plan(
            &c.live.ids,
            &c.live.tokens,
            s.cols,
            rows,
            rb,
            cache.base,
            &mut slots[..cells],
            fill,
            &cache.counters,
        )?;
        let (rows_dev, ids_dev) = c.dev;
        let a = mem.aux_cells;
        let ups = [
            (ids_dev, 0, cells * 8),
            (cache.slots.ptr, 8 * a, cells * 4),
            (cache.fill.ptr, 12 * a, planned.fills * 8),
            (rows_dev, mem.ids_bytes, planned.staged * rb),
        ];
        // SAFETY: each device buffer holds max_tokens * C entries (ids, row
        // indices, admission pairs) or staging rows, at least these; each
        // range lies in `mem` (its aux part and rows); the caller holds it.
        let r = unsafe { mem.queue_uploads(&ups, c.stream) }.and_then(|()| {
            let (n_fill, rbu) = (planned.fills as u32, rb as u32);
            let (base_ptr, fill_ptr) = (rows_dev, cache.fill.ptr);
            if n_fill == 0 {
                return Ok(());
            }
            let a = args![base_ptr, fill_ptr, n_fill, rbu];
            // SAFETY: arguments match engram_cache_fill; every pair indexes
            // rows of the layer's buffer (staging rows < base, slots <
            // base + capacity), just copied on this stream.
            unsafe {
                self.gpu.launch(
                    Kernel::CacheFill,
                    kernels::gather_blocks(planned.fills),
                    kernels::GATHER_THREADS,
                    c.stream,
                    &a,
                )
            }
        });
        if r.is_err() {
            plan.reset();
        }
        r
    }

    /// Queue layer `li` for `n` tokens on `stream`; with `highway == None` the
    /// gate is skipped (for `read_back`). The steps: check the call (nothing
    /// queued on a refusal), stage a host table's rows, then the decode
    /// kernel where it applies, else gather, projection and gate.
    pub(super) fn enqueue(
        &self,
        st: &mut State,
        li: usize,
        ids: Ids<'_>,
        n: usize,
        highway: Option<(u64, HighwayType)>,
        stream: Stream,
    ) -> Result<()> {
        let layer = self.layer(st, li)?;
        self.take_device_error(st)?;
        let capturing = self.gpu.stream_capturing(stream)?;
        let at = self.ids_at(st, li, &layer, ids, n, highway, capturing)?;
        if n == 0 {
            return Ok(());
        }
        if !capturing {
            self.order_after_last(st, stream)?;
        }
        // Queue the work; then, outside a capture, record the event that
        // `set_layer` and `read_back` wait for (also when queueing failed
        // half way: whatever was queued is covered).
        let r = self.queue_layer(st, li, &layer, ids, at, n, highway, stream);
        let rec = if capturing {
            Ok(())
        } else {
            self.record_last(st, stream)
        };
        r.and(rec)
    }

    /// The checks of one call before anything is queued (the highway's and
    /// device row ids' ranges and alignment; no host ids in a capture), and
    /// where its row ids will be for the kernels.
    #[allow(clippy::too_many_arguments)]
    fn ids_at(
        &self,
        st: &State,
        li: usize,
        layer: &DevLayer,
        ids: Ids<'_>,
        n: usize,
        highway: Option<(u64, HighwayType)>,
        capturing: bool,
    ) -> Result<IdsAt> {
        let s = self.shape;
        if let Some((hw, ty)) = highway {
            if n > 0 {
                let bytes = n * s.hw_per_token() * ty.size();
                super::gpu::check_device_range(&*self.gpu, hw, bytes, "highway")?;
            }
        }
        let staged = match &layer.table {
            TableLoc::Device { .. } => None,
            TableLoc::Host {
                rows, ids, cache, ..
            } => Some((rows.ptr, ids.ptr, cache.as_ref().map_or(0, |c| c.slots.ptr))),
        };
        let (ptr, stride, offset) = match ids {
            Ids::Host { .. } => {
                if capturing {
                    bail!(
                        ErrInvalidArgument,
                        "the stream is capturing a CUDA graph: host row ids would be read once, at capture; \
                         pass device row ids (engram_apply_device_ids) in a captured step"
                    );
                }
                let dst = staged.map_or(st.ids.ptr, |(_, ids, _)| ids);
                (dst, s.cols as u32, 0u32)
            }
            Ids::Device(p) => {
                if n > 0 {
                    // A misaligned int64 load is a sticky fault that ends the
                    // whole CUDA context: refuse it here, nothing queued.
                    if p % 8 != 0 {
                        bail!(
                            ErrInvalidArgument,
                            "row_ids ({p:#x}) is not aligned to 8 bytes (int64 row ids)"
                        );
                    }
                    super::gpu::check_device_range(&*self.gpu, p, n * s.per * 8, "row_ids")?;
                }
                (p, s.per as u32, (li * s.cols) as u32)
            }
        };
        Ok(IdsAt {
            ptr,
            stride,
            offset,
            staged,
        })
    }

    /// The work of one checked call, in stream order.
    #[allow(clippy::too_many_arguments)]
    fn queue_layer(
        &self,
        st: &mut State,
        li: usize,
        layer: &DevLayer,
        ids: Ids<'_>,
        at: IdsAt,
        n: usize,
        highway: Option<(u64, HighwayType)>,
        stream: Stream,
    ) -> Result<()> {
        if let Ids::Host { all, live } = ids {
            self.stage_host(st, layer, li, all, live, n, stream)?;
        }
        st.serial = st.serial.wrapping_add(1);
        let f32_path = layer.wkv_kind == WkvKind::F32;
        let (rows_buf, kv_buf) = if f32_path {
            (
                st.rows32.as_ref().expect("allocated by set_layer").ptr,
                st.kv32.as_ref().expect("allocated by set_layer").ptr,
            )
        } else {
            (st.rows.ptr, st.kv.ptr)
        };
        // The decode kernel, where it applies: the gather, the projection
        // and (with a highway) the gate.
        if !f32_path {
            if let Some(plan) = self.decode_plan(st, layer, n)? {
                return self.queue_decode(st, li, layer, &plan, at, n, highway, stream);
            }
        }
        self.queue_gather(st, li, layer, at, n, rows_buf, f32_path, stream)?;
        let bufs = (rows_buf, kv_buf);
        let outs = (0, self.shape.k_out);
        self.queue_projection(st, layer, n, bufs, outs, f32_path, stream)?;
        if let Some((hw, ty)) = highway {
            self.queue_gate(st, li, n, hw, ty, kv_buf, f32_path, stream)?;
        }
        Ok(())
    }

    /// The gather (and dequantisation) of `n` tokens' rows into `rows_buf`
    /// (f32 rows for an f32 `wkv`, else bf16).
    #[allow(clippy::too_many_arguments)]
    fn queue_gather(
        &self,
        st: &State,
        li: usize,
        layer: &DevLayer,
        at: IdsAt,
        n: usize,
        rows_buf: u64,
        f32_path: bool,
        stream: Stream,
    ) -> Result<()> {
        let s = self.shape;
        let (table, scales) = match layer.table {
            TableLoc::Device { table, scales } => (table, scales),
            TableLoc::Host { .. } => (0u64, 0u64),
        };
        let (staged_rows, staged_ids, staged_slots) = at.staged.unwrap_or((0, 0, 0));
        let (ids_ptr, id_stride, id_offset) = (at.ptr, at.stride, at.offset);
        let table_rows = layer.rows;
        let fmt = layer.format as u32;
        let hd = s.geo.hd as u32;
        let row_bytes = layer.row_bytes as u32;
        let cols = s.cols as u32;
        let n_cells = (n * s.cols) as u64;
        let out_f32 = f32_path as u32;
        let (flags, latch, serial) = (st.flags.ptr, st.latch.ptr, st.serial);
        let layer_id = self.layer_ids[li];
        let a = args![
            table,
            table_rows,
            fmt,
            hd,
            row_bytes,
            ids_ptr,
            id_stride,
            id_offset,
            cols,
            n_cells,
            staged_rows,
            staged_ids,
            staged_slots,
            rows_buf,
            out_f32,
            flags,
            latch,
            layer_id,
            serial,
            scales
        ];
        // A split fp8 table in device memory has its own kernel, which
        // takes `scales` too (the last argument).
        let (kernel, a) = if scales != 0 {
            (Kernel::GatherSplit, &a[..])
        } else {
            (Kernel::Gather, &a[..a.len() - 1])
        };
        // SAFETY: arguments match engram_gather's parameters (the first 19)
        // or engram_gather_split's (all 20); buffers hold max_tokens >= n
        // tokens; the table (and its scales) were checked at set_layer.
        unsafe {
            self.gpu.launch(
                kernel,
                kernels::gather_blocks(n * s.cols),
                kernels::GATHER_THREADS,
                stream,
                a,
            )
        }
    }

    /// The projection of `n` gathered rows (`bufs.0`) through outputs
    /// `[lo, hi)` of the `wkv` the layer holds into `kv` (`bufs.1`, `[n, hi -
    /// lo]`; `apply` projects all of them): a GEMV kernel for few tokens
    /// (bf16, quantised, fp8 blocks), else bf16 tiles and cuBLAS (quantised,
    /// fp8 blocks), else cuBLAS on `wkv` itself (bf16, f32). A block-scaled
    /// fp8 `wkv`'s `lo` is a multiple of its block rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue_projection(
        &self,
        st: &mut State,
        layer: &DevLayer,
        n: usize,
        bufs: (u64, u64),
        (lo, hi): (usize, usize),
        f32_path: bool,
        stream: Stream,
    ) -> Result<()> {
        let (k_in, k_out) = (self.shape.k_in, hi - lo);
        let (w, rows, kv) = (layer.wkv_at(k_in, lo), bufs.0, bufs.1);
        let (n_out, k, nt) = (k_out as u32, k_in as u32, n as u32);
        let gemv = |kernel: Kernel, a: &[Arg]| {
            let blocks =
                (k_out as u32).div_ceil(kernels::GEMV_ROWS_PER_WARP * (kernels::GEMV_THREADS / 32));
            // SAFETY: the caller's arguments match `kernel` (each arm below
            // says why); `rows` and `kv` are our workspaces for n tokens.
            unsafe {
                self.gpu
                    .launch(kernel, blocks, kernels::GEMV_THREADS, stream, a)
            }
        };
        match layer.wkv_kind {
            WkvKind::Bf16 if n <= st.gemv_max_bf16 && k_in % 8 == 0 && w % 16 == 0 => {
                // engram_gemv_bf16_<n>: 16-byte aligned wkv, k % 8 == 0.
                gemv(Kernel::Gemv(n), &args![w, rows, kv, n_out, k])
            }
            WkvKind::Quant(fmt) if n <= st.gemv_max_quant && k_in % 32 == 0 => {
                // engram_gemv_q_<format>: k % 32 == 0, n <= GEMV_MAX.
                let rb = fmt.row_bytes(k_in) as u32;
                gemv(Kernel::GemvQ(fmt), &args![w, rb, rows, kv, n_out, k, nt])
            }
            WkvKind::Fp8Block { br, bc, .. }
                if n <= st.gemv_max_bf16 && k_in % 8 == 0 && w % 8 == 0 =>
            {
                let scales = layer.wkv_scales_at(k_in, lo);
                // engram_gemv_fp8_block, where the bf16 path runs its GEMV
                // (the same sums): 8-byte aligned codes, k % 8 == 0; codes
                // and scales sized at set_layer.
                let nbc = (k_in as u32).div_ceil(bc);
                let a = args![w, scales, br, bc, nbc, rows, kv, n_out, k, nt];
                gemv(Kernel::GemvFp8, &a)
            }
            WkvKind::Fp8Block { br, bc, .. } => {
                // bf16 tiles (exact) and cuBLAS, as the bf16 path's GEMM.
                let scales = layer.wkv_scales_at(k_in, lo);
                let nbc = (k_in as u32).div_ceil(bc);
                self.queue_tiles(st, n, bufs, k_out, stream, |tile, row0, n_rows, blocks| {
                    let a = args![w, scales, br, bc, nbc, k, row0, n_rows, tile];
                    // SAFETY: arguments match engram_dequant_fp8_block; the
                    // tile holds n_rows rows of k_in bf16; wkv has k_out rows.
                    unsafe {
                        self.gpu.launch(
                            Kernel::DequantFp8,
                            blocks,
                            kernels::DEQUANT_THREADS,
                            stream,
                            &a,
                        )
                    }
                })
            }
            WkvKind::Quant(fmt) => {
                let (f, rb) = (fmt as u32, fmt.row_bytes(k_in) as u32);
                self.queue_tiles(st, n, bufs, k_out, stream, |tile, row0, n_rows, blocks| {
                    let a = args![w, f, rb, k, row0, n_rows, tile];
                    // SAFETY: arguments match engram_dequant_bf16; the tile
                    // holds n_rows rows of k_in bf16; wkv has k_out rows.
                    unsafe {
                        self.gpu.launch(
                            Kernel::Dequant,
                            blocks,
                            kernels::DEQUANT_THREADS,
                            stream,
                            &a,
                        )
                    }
                })
            }
            _ => {
                let g = Gemm {
                    f32: f32_path,
                    w,
                    ldw: k_in,
                    rows,
                    ldr: k_in,
                    kv,
                    ldc: k_out,
                    m: k_out,
                    n,
                    k: k_in,
                };
                // SAFETY: sizes as documented; wkv checked at set_layer.
                unsafe { st.blas.gemm(stream, &g) }
            }
        }
    }

    /// A quantised or fp8-block `wkv` through bf16 tiles: for each tile of
    /// the `k_out` output rows, `dequant(tile, first row, rows, blocks)`
    /// queues the tile's dequantisation, then cuBLAS multiplies it with the
    /// `n` gathered rows (`bufs.0`) into its columns of `kv` (`bufs.1`,
    /// `[n, k_out]`).
    fn queue_tiles(
        &self,
        st: &mut State,
        n: usize,
        bufs: (u64, u64),
        k_out: usize,
        stream: Stream,
        dequant: impl Fn(u64, u32, u32, u32) -> Result<()>,
    ) -> Result<()> {
        let k_in = self.shape.k_in;
        let (tile, tile_rows) = {
            let t = st.tile.as_ref().expect("allocated by set_layer");
            (t.0.ptr, t.1)
        };
        let mut o0 = 0usize;
        while o0 < k_out {
            let m = tile_rows.min(k_out - o0);
            let blocks = ((m * k_in) as u64).div_ceil(kernels::DEQUANT_THREADS as u64);
            dequant(tile, o0 as u32, m as u32, blocks as u32)?;
            let g = Gemm {
                f32: false,
                w: tile,
                ldw: k_in,
                rows: bufs.0,
                ldr: k_in,
                kv: bufs.1 + (o0 * 2) as u64,
                ldc: k_out,
                m,
                n,
                k: k_in,
            };
            // SAFETY: the tile holds m rows of k_in bf16 (just queued on
            // `stream`), the rows workspace n tokens of k_in, kv n tokens of
            // k_out; these m columns start at o0.
            unsafe { st.blas.gemm(stream, &g)? };
            o0 += m;
        }
        Ok(())
    }

    /// Queue the gate kernel for `n` tokens of layer `li` on the highway `hw`
    /// of type `ty`, reading `kv` (f32 for an f32 `wkv`, else bf16).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue_gate(
        &self,
        st: &State,
        li: usize,
        n: usize,
        hw: u64,
        ty: HighwayType,
        kv: u64,
        kv_f32: bool,
        stream: Stream,
    ) -> Result<()> {
        let s = self.shape;
        let (qk, flags) = (self.qk[li].ptr, st.flags.ptr);
        let (cols, hc, d) = (s.cols as u32, s.geo.hc as u32, s.geo.d as u32);
        let eps = s.geo.eps;
        let inv_sqrt_d = 1.0f32 / (s.geo.d as f32).sqrt();
        let (latch, mirror) = (st.latch.ptr, self.mirror.dev_ptr);
        let n_streams = (n * s.geo.hc) as u32;
        let a = args![hw, kv, qk, flags, cols, hc, d, eps, inv_sqrt_d, latch, mirror, n_streams];
        // SAFETY: arguments match engram_gate_*; the highway range was checked
        // by the caller; the context's buffers hold max_tokens >= n tokens.
        unsafe {
            self.gpu.launch(
                Kernel::Gate {
                    hw_bf16: ty == HighwayType::Bf16,
                    kv_f32,
                },
                kernels::gate_blocks(n * s.geo.hc),
                kernels::GATE_THREADS,
                stream,
                &a,
            )
        }
    }

    /// Queue the decode kernel for `n` tokens of layer `li` (docs/cuda.md
    /// "The decode kernel"): with a highway, phase A and the gate (in the
    /// last block done) in one ordinary launch, in a capture too; where the
    /// driver refuses that launch with an error that leaves the context
    /// usable ([`super::driver::is_refusal`]: too many resources for a green
    /// context, say), which the context then remembers, phase A alone and
    /// the gate kernel after it: the same bits.
    #[allow(clippy::too_many_arguments)]
    fn queue_decode(
        &self,
        st: &mut State,
        li: usize,
        layer: &DevLayer,
        plan: &DecodePlan,
        at: IdsAt,
        n: usize,
        highway: Option<(u64, HighwayType)>,
        stream: Stream,
    ) -> Result<()> {
        let launch = |st: &State, hw: u64, hw_bf16: u32, fused: bool| {
            self.launch_decode(st, li, layer, plan, at, n, (hw, hw_bf16), fused, stream)
        };
        if let Some((hw, ty)) = highway {
            if !st.fused_refused {
                if launch(st, hw, (ty == HighwayType::Bf16) as u32, true)? {
                    st.decode_stats.cooperative += 1;
                    return Ok(());
                }
                // Refused, nothing queued, the context usable: the split
                // path, now and from now on.
                st.fused_refused = true;
                st.decode_stats.refused = true;
            }
        }
        launch(st, 0, 0, false)?;
        if highway.is_some() {
            st.decode_stats.split += 1;
        } else {
            st.decode_stats.read_back += 1;
        }
        if let Some((hw, ty)) = highway {
            let kv = st.kv.ptr;
            self.queue_gate(st, li, n, hw, ty, kv, false, stream)?;
        }
        Ok(())
    }

    /// Launch the decode kernel for `n` tokens of layer `li` with highway
    /// `hw` (`(0, 0)`: phase A alone; else its address and whether it is
    /// bf16): with `fused`, a launch with a fallback (`Ok(false)`: refused,
    /// nothing queued), else an ordinary one (`Ok(true)`).
    #[allow(clippy::too_many_arguments)]
    fn launch_decode(
        &self,
        st: &State,
        li: usize,
        layer: &DevLayer,
        plan: &DecodePlan,
        at: IdsAt,
        n: usize,
        (hw, hw_bf16): (u64, u32),
        fused: bool,
        stream: Stream,
    ) -> Result<bool> {
        let s: Shape = self.shape;
        let (table, table_scales) = match layer.table {
            TableLoc::Device { table, scales } => (table, scales),
            TableLoc::Host { .. } => (0u64, 0u64),
        };
        let (staged_rows, staged_ids, staged_slots) = at.staged.unwrap_or((0, 0, 0));
        let (ids, id_stride, id_offset) = (at.ptr, at.stride, at.offset);
        let table_rows = layer.rows;
        let fmt = layer.format as u32;
        let hd = s.geo.hd as u32;
        let row_bytes = layer.row_bytes as u32;
        let cols = s.cols as u32;
        let (rows_out, flags, latch) = (st.rows.ptr, st.flags.ptr, st.latch.ptr);
        let (layer_id, serial) = (layer.layer_id, st.serial);
        let (w, wscales, br, bc) = (layer.wkv, plan.wscales, plan.br, plan.bc);
        let nbc = if plan.fp8 {
            (s.k_in as u32).div_ceil(bc)
        } else {
            0
        };
        let kv = st.kv.ptr;
        let (n_out, k, nt, tile) = (s.k_out as u32, s.k_in as u32, n as u32, plan.tile);
        let (qk, hc, d) = (self.qk[li].ptr, s.geo.hc as u32, s.geo.d as u32);
        let eps = s.geo.eps;
        let inv_sqrt_d = 1.0f32 / (s.geo.d as f32).sqrt();
        let (mirror, done) = (self.mirror.dev_ptr, st.done.ptr);
        let kernel = Kernel::Decode { fp8: plan.fp8 };
        let a = args![
            table,
            table_rows,
            fmt,
            hd,
            row_bytes,
            ids,
            id_stride,
            id_offset,
            cols,
            staged_rows,
            staged_ids,
            staged_slots,
            table_scales,
            rows_out,
            flags,
            latch,
            layer_id,
            serial,
            w,
            wscales,
            br,
            bc,
            nbc,
            kv,
            n_out,
            k,
            nt,
            tile,
            hw,
            hw_bf16,
            qk,
            hc,
            d,
            eps,
            inv_sqrt_d,
            mirror,
            done
        ];
        // SAFETY: arguments match engram_decode_<w>; the buffers hold
        // max_tokens >= n tokens; the table, wkv (and its scales) were
        // checked at set_layer, wkv's alignment by decode_plan, the
        // highway's range by the caller; `shared` is within the device's
        // opt-in (decode_tile); `done` is the context's word, zero
        // between launches (the last block puts it back), used by one
        // launch at a time (the context's calls are ordered on the
        // device: docs/cuda-streams.md).
        unsafe {
            let (grid, threads, shared) = (plan.grid, kernels::DECODE_THREADS, plan.shared);
            if fused {
                self.gpu
                    .try_launch_shared(kernel, grid, threads, shared, stream, &a)
            } else {
                self.gpu
                    .launch_shared(kernel, grid, threads, shared, stream, &a)
                    .map(|()| true)
            }
        }
    }
}
