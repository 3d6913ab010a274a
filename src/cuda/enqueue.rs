//! The work one `apply` queues on the caller's stream: the staged copy of
//! host row ids, the gather, the projection (GEMV kernel or cuBLAS) and the
//! gate. Nothing here synchronises or allocates.

use super::driver::{self, check};
use super::kernels::{self, args, launch};
use super::{CudaBackend, STAGING_SLOTS};
use crate::backend::{Ids, Stream};
use crate::batch::HighwayType;
use crate::error::{bail, Result};
use cudarc::driver::sys;

impl CudaBackend {
    /// Queue layer `li` for `n` tokens on `stream`; with `highway == None` the
    /// gate is skipped (for `read_back`).
    pub(super) fn enqueue(
        &self,
        li: usize,
        ids: Ids<'_>,
        n: usize,
        highway: Option<(u64, HighwayType)>,
        stream: Stream,
    ) -> Result<()> {
        let s = self.shape;
        let layer_id = self.layer_ids[li];
        let mut st = self.state();
        let Some(layer) = st.layers[li] else {
            // The context checks a layer is set before it applies.
            bail!(
                ErrInternal,
                "layer {layer_id} reached the CUDA backend unset"
            );
        };
        let _scope = self.dev.scope()?;
        self.take_device_error(&st)?;
        let cs = stream as sys::CUstream;
        let mut capturing = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller's stream handle (NULL is the legacy default stream).
        unsafe {
            check(
                sys::cuStreamIsCapturing(cs, &mut capturing),
                "the stream (cuStreamIsCapturing)",
            )?;
        }
        let capturing = capturing != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        if !capturing {
            let mut sctx = std::ptr::null_mut();
            // SAFETY: as above.
            unsafe {
                check(
                    sys::cuStreamGetCtx(cs, &mut sctx),
                    "the stream (cuStreamGetCtx)",
                )?;
            }
            if sctx != self.dev.ctx {
                bail!(
                    ErrInvalidArgument,
                    "the stream belongs to another CUDA context than device {}'s primary context",
                    self.dev.ordinal
                );
            }
        }
        let ord = self.dev.ordinal;
        if let Some((hw, ty)) = highway {
            if n > 0 {
                let bytes = n * s.hw_per_token() * ty.size();
                driver::check_device_range(hw, bytes, ord, "highway")?;
            }
        }
        let (ids_ptr, id_stride, id_offset) = match ids {
            Ids::Host { .. } => {
                if capturing {
                    bail!(
                        ErrInvalidArgument,
                        "the stream is capturing a CUDA graph: host row ids would be read once, at capture; \
                         pass device row ids (engram_apply_device_ids) in a captured step"
                    );
                }
                (st.ids.ptr, s.cols as u32, 0u32)
            }
            Ids::Device(p) => {
                if n > 0 {
                    driver::check_device_range(p, n * s.per * 8, ord, "row_ids")?;
                }
                (p, s.per as u32, (li * s.cols) as u32)
            }
        };
        if n == 0 {
            return Ok(());
        }
        // Stage host ids: this layer's columns, [n, C], through a pinned slot.
        if let Ids::Host { all, .. } = ids {
            let slot = st.next_slot;
            st.next_slot = (slot + 1) % STAGING_SLOTS;
            let dst_dev = st.ids.ptr;
            let (buf, ev, used) = &mut st.staging[slot];
            // SAFETY: the event was recorded after the slot's last copy, so
            // once it has completed nothing reads the pinned slot; the slot
            // holds max_tokens * C ids and n <= max_tokens.
            unsafe {
                if *used {
                    check(sys::cuEventSynchronize(ev.ev), "waiting for a staged copy")?;
                }
                let dst = std::slice::from_raw_parts_mut(buf.ptr as *mut i64, n * s.cols);
                for t in 0..n {
                    dst[t * s.cols..(t + 1) * s.cols].copy_from_slice(s.token_ids(all, t, li));
                }
                check(
                    sys::cuMemcpyHtoDAsync_v2(dst_dev, buf.ptr, n * s.cols * 8, cs),
                    "copying row ids to the device",
                )?;
                check(sys::cuEventRecord(ev.ev, cs), "cuEventRecord")?;
            }
            *used = true;
        }
        st.serial = st.serial.wrapping_add(1);
        let (k_in, k_out) = (s.k_in, s.k_out);
        let f32_path = layer.wkv_f32;
        let (rows_buf, kv_buf) = if f32_path {
            (
                st.rows32.as_ref().expect("allocated by set_layer").ptr,
                st.kv32.as_ref().expect("allocated by set_layer").ptr,
            )
        } else {
            (st.rows.ptr, st.kv.ptr)
        };
        // Gather + dequantise.
        {
            let table = layer.table;
            let table_rows = layer.rows;
            let fmt = layer.format as u32;
            let hd = s.geo.hd as u32;
            let row_bytes = layer.format.row_bytes(s.geo.hd) as u32;
            let cols = s.cols as u32;
            let out_f32 = f32_path as u32;
            let flags = st.flags.ptr;
            let latch = st.latch.ptr;
            let lid = layer_id;
            let serial = st.serial;
            let scales = layer.scales;
            let mut a = args![
                table, table_rows, fmt, hd, row_bytes, ids_ptr, id_stride, id_offset, cols,
                rows_buf, out_f32, flags, latch, lid, serial, scales
            ];
            // A split fp8 table has its own kernel, which takes `scales` too.
            let (f, n_args) = if scales != 0 {
                (self.module.gather_split, a.len())
            } else {
                (self.module.gather, a.len() - 1)
            };
            // SAFETY: arguments match engram_gather's parameters (the first 15)
            // or engram_gather_split's (all 16); buffers hold max_tokens >= n
            // tokens; the table (and its scales) were checked at set_layer.
            unsafe {
                launch(
                    f,
                    ((n * s.cols) as u32, 1, 1),
                    kernels::GATHER_THREADS,
                    0,
                    cs,
                    &mut a[..n_args],
                    "the gather kernel",
                )?;
            }
        }
        // Projection.
        let use_gemv = !f32_path && n <= st.gemv_max && k_in % 8 == 0 && layer.wkv % 16 == 0;
        if use_gemv {
            let (w, rows, kv) = (layer.wkv, rows_buf, kv_buf);
            let (n_out, k) = (k_out as u32, k_in as u32);
            let mut a = args![w, rows, kv, n_out, k];
            let per_block = kernels::GEMV_ROWS_PER_WARP * (kernels::GEMV_THREADS / 32);
            let blocks = (k_out as u32).div_ceil(per_block);
            // SAFETY: arguments match engram_gemv_bf16_<n>; alignment checked above.
            unsafe {
                launch(
                    self.module.gemv[n - 1],
                    (blocks, 1, 1),
                    kernels::GEMV_THREADS,
                    0,
                    cs,
                    &mut a,
                    "the GEMV kernel",
                )?;
            }
        } else {
            // SAFETY: sizes as documented; wkv checked at set_layer.
            unsafe {
                st.blas
                    .gemm(cs, f32_path, layer.wkv, rows_buf, kv_buf, k_out, n, k_in)?;
            }
        }
        // Gate.
        if let Some((hw, ty)) = highway {
            let f = self.module.gate[Self::gate_index(ty)][f32_path as usize];
            let (kv, qk, flags) = (kv_buf, self.qk[li].ptr, st.flags.ptr);
            let (cols, hc, d) = (s.cols as u32, s.geo.hc as u32, s.geo.d as u32);
            let eps = s.geo.eps;
            let inv_sqrt_d = 1.0f32 / (s.geo.d as f32).sqrt();
            let (latch, mirror) = (st.latch.ptr, self.mirror.dev_ptr);
            let mut a = args![hw, kv, qk, flags, cols, hc, d, eps, inv_sqrt_d, latch, mirror];
            // SAFETY: arguments match engram_gate_*; the highway range was checked.
            unsafe {
                launch(
                    f,
                    ((n * s.geo.hc) as u32, 1, 1),
                    kernels::GATE_THREADS,
                    0,
                    cs,
                    &mut a,
                    "the gate kernel",
                )?;
            }
        }
        Ok(())
    }
}
