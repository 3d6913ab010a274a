//! The hash on the device over a device-resident history (`kernels/hash.cu`,
//! docs/device-hash.md): the tables copied to the device, a ring of
//! `(position, compressed id)` entries per sequence slot, and the three
//! launches of one call. Nothing is read back: a call only queues work, so
//! it can be captured in a CUDA graph; errors go to the hash's latch, which
//! the commit kernel moves to the context's host-mapped mirror.

use super::gpu::{self, args, DevBuf, Gpu, Kernel};
use super::{latch, CudaBackend};
use crate::batch::Limits;
use crate::call::{DeviceHashIn, DeviceSeqOp, Stream};
use crate::error::{bail, EngramStatus, Error, Result};
use crate::fallible::{try_room, try_vec};
use crate::hash::history::Range;
use crate::hash::HashTables;
use std::sync::Arc;

/// Most positions a ring may keep per sequence.
pub const MAX_RING: usize = 1 << 20;

/// Threads of an `engram_hash_ids` block (each computes columns of one token).
const IDS_THREADS: u32 = 128;
/// Threads of the range operations' blocks (`engram_hash_seq_edit`, the
/// shift's kernels).
const EDIT_THREADS: u32 = 256;
/// Most blocks of a range operation (they loop over the entries).
const EDIT_BLOCKS: u32 = 1024;

/// The device hash's tables and history.
pub(super) struct DeviceHash {
    limits: Limits,
    ring_len: usize,
    map_len: u32,
    pad_id: i64,
    n_layers: u32,
    max_ngram: u32,
    n_heads: u32,
    token_map: DevBuf,
    multipliers: DevBuf,
    primes: DevBuf,
    offsets: DevBuf,
    /// `[max_seqs, ring_len]` u64 entries.
    ring: DevBuf,
    /// Per slot: the (serial, first token) tag of its last run, and the
    /// serial of the last call that gave it two runs.
    tags: DevBuf,
    conflicts: DevBuf,
    /// The call counter (u64), advanced by the commit kernel.
    serial: DevBuf,
    /// Per token of the call: valid (0) or not, for the commit.
    status: DevBuf,
    /// The hash's own error latch (`LATCH_WORDS` u32).
    latch: DevBuf,
    /// The shift's copy of one slot (`ring_len` u64) and its flag (u32, 0
    /// between calls).
    shift_scratch: DevBuf,
    shift_flag: DevBuf,
}

impl DeviceHash {
    pub(super) fn new(
        gpu: &Arc<dyn Gpu>,
        t: &HashTables,
        limits: Limits,
        ring_len: usize,
    ) -> Result<DeviceHash> {
        if ring_len < t.max_ngram.saturating_sub(1).max(1) || ring_len > MAX_RING {
            bail!(
                ErrInvalidConfig,
                "device_history = {ring_len}: the device ring needs at least max_ngram - 1 = {} \
                 positions (plus the longest draft rolled back), and at most {MAX_RING}",
                t.max_ngram.saturating_sub(1).max(1)
            );
        }
        let Ok(map_len) = u32::try_from(t.token_map.len()) else {
            bail!(
                ErrInvalidConfig,
                "token_map of {} entries is too large for the device hash",
                t.token_map.len()
            );
        };
        let seqs = limits.max_seqs;
        let ring_bytes = seqs
            .checked_mul(ring_len)
            .and_then(|x| x.checked_mul(8))
            .ok_or_else(|| {
                crate::error::Error::new(
                    crate::EngramStatus::ErrInvalidConfig,
                    format!("max_seqs {seqs} x device_history {ring_len} is too large"),
                )
            })?;
        let h = DeviceHash {
            limits,
            ring_len,
            map_len,
            pad_id: t.pad_id,
            n_layers: t.n_layers() as u32,
            max_ngram: t.max_ngram as u32,
            n_heads: t.n_heads as u32,
            token_map: DevBuf::sized_as(gpu, &t.token_map, "the device hash's token map")?,
            multipliers: DevBuf::sized_as(gpu, &t.multipliers, "the device hash's multipliers")?,
            primes: DevBuf::sized_as(gpu, &t.primes, "the device hash's primes")?,
            offsets: DevBuf::sized_as(gpu, &t.offsets, "the device hash's offsets")?,
            ring: DevBuf::new(gpu, ring_bytes, "the device history")?,
            tags: DevBuf::new(gpu, seqs * 8, "the device history's run tags")?,
            conflicts: DevBuf::new(gpu, seqs * 8, "the device history's run tags")?,
            serial: DevBuf::new(gpu, 8, "the device hash's call counter")?,
            status: DevBuf::new(gpu, limits.max_tokens * 4, "the device hash's token status")?,
            latch: DevBuf::new(gpu, latch::LATCH_WORDS * 4, "the device hash's error latch")?,
            shift_scratch: DevBuf::new(gpu, ring_len * 8, "the device history's shift scratch")?,
            shift_flag: DevBuf::new(gpu, 4, "the device history's shift flag")?,
        };
        Ok(h)
    }

    pub(super) fn device_bytes(&self) -> usize {
        [
            &self.token_map,
            &self.multipliers,
            &self.primes,
            &self.offsets,
            &self.ring,
            &self.tags,
            &self.conflicts,
            &self.serial,
            &self.status,
            &self.latch,
            &self.shift_scratch,
            &self.shift_flag,
        ]
        .iter()
        .map(|b| b.bytes)
        .sum()
    }
}

impl CudaBackend {
    /// Give this backend a device history of `ring_len` positions per
    /// sequence (at create, before any call).
    pub fn enable_device_hash(
        &mut self,
        t: &HashTables,
        limits: Limits,
        ring_len: usize,
    ) -> Result<()> {
        let h = DeviceHash::new(&self.gpu, t, limits, ring_len)?;
        self.fill_device_hash(&h, t)?;
        self.hash = Some(h);
        Ok(())
    }

    /// `h`'s tables copied in and its history emptied, on the context's own
    /// stream and waited for there (a context-wide wait would wait for the
    /// engine's unrelated work: docs/cuda-streams.md). Empty entries are all
    /// ones (position -1); tags and conflicts start at serial 0, which no
    /// call has (the counter starts at 1).
    fn fill_device_hash(&self, h: &DeviceHash, t: &HashTables) -> Result<()> {
        let one = [1u64];
        // SAFETY: `DeviceHash::new` sized each table's buffer as its source
        // slice and `serial` as one u64; the memsets cover whole buffers;
        // every copy is waited for before its source goes.
        unsafe {
            let sources: [(&DevBuf, *const u8); 5] = [
                (&h.token_map, t.token_map.as_ptr().cast()),
                (&h.multipliers, t.multipliers.as_ptr().cast()),
                (&h.primes, t.primes.as_ptr().cast()),
                (&h.offsets, t.offsets.as_ptr().cast()),
                (&h.serial, one.as_ptr().cast()),
            ];
            for (b, src) in sources {
                self.own_upload(b.ptr, src, b.bytes)?;
            }
            for (b, v) in [
                (&h.ring, 0xFF),
                (&h.tags, 0),
                (&h.conflicts, 0),
                (&h.latch, 0),
                (&h.shift_flag, 0),
            ] {
                self.own_memset(b.ptr, v, b.bytes)?;
            }
        }
        Ok(())
    }

    fn device_hash(&self) -> Result<&DeviceHash> {
        match &self.hash {
            Some(h) => Ok(h),
            None => bail!(
                ErrUnsupported,
                "this context has no device history (create it with device_history > 0 to hash on \
                 the device)"
            ),
        }
    }

    /// Queue the hash of one batch on `call.stream` (see `engram_hash_device`).
    pub(crate) fn hash_on_device(&self, call: &DeviceHashIn) -> Result<()> {
        let h = self.device_hash()?;
        h.limits.tokens(call.n)?;
        for (what, p) in [
            ("tokens", call.tokens),
            ("seq_ids", call.seq_ids),
            ("pos", call.pos),
            ("row_ids", call.row_ids),
        ] {
            if p == 0 {
                bail!(ErrNullArgument, "{what} is NULL");
            }
        }
        let st = self.state();
        self.take_device_error(&st)?;
        if call.n == 0 {
            return Ok(());
        }
        Self::check_hash_pointers(&*self.gpu, h, call)?;
        let n = call.n as u32;
        let (tokens, seq_ids, pos, row_ids) = (call.tokens, call.seq_ids, call.pos, call.row_ids);
        let max_seqs = h.limits.max_seqs as u32;
        let max_positions = h.limits.max_positions as u32;
        let ring_len = h.ring_len as u32;
        let (tags, conflicts, serial) = (h.tags.ptr, h.conflicts.ptr, h.serial.ptr);
        let (ring, status, hlatch, mirror) =
            (h.ring.ptr, h.status.ptr, h.latch.ptr, self.mirror.dev_ptr);
        let a = args![seq_ids, pos, max_seqs, tags, conflicts, serial];
        // SAFETY: arguments match engram_hash_runs; the caller's arrays hold
        // `n` entries (the header's contract), our buffers max_seqs slots.
        unsafe { self.gpu.launch(Kernel::HashRuns, n, 32, call.stream, &a)? };
        let (map, map_len, pad) = (h.token_map.ptr, h.map_len, h.pad_id);
        let (mul, pr, off) = (h.multipliers.ptr, h.primes.ptr, h.offsets.ptr);
        let (nl, nn, nh) = (h.n_layers, h.max_ngram, h.n_heads);
        let a = args![
            tokens,
            seq_ids,
            pos,
            map,
            map_len,
            pad,
            mul,
            pr,
            off,
            nl,
            nn,
            nh,
            max_seqs,
            max_positions,
            ring,
            ring_len,
            conflicts,
            serial,
            row_ids,
            status,
            hlatch
        ];
        // SAFETY: arguments match engram_hash_ids; the tables are the sizes
        // their geometry says; `row_ids` holds `n * n_layers * C` (contract);
        // `status` holds max_tokens >= n.
        unsafe {
            self.gpu
                .launch(Kernel::HashIds, n, IDS_THREADS, call.stream, &a)?
        };
        let a = args![tokens, seq_ids, pos, map, n, ring, ring_len, status, serial, hlatch, mirror];
        // SAFETY: arguments match engram_hash_commit; as above; the mirror
        // is LATCH_WORDS of mapped pinned memory.
        unsafe { self.gpu.launch(Kernel::HashCommit, n, 32, call.stream, &a) }
    }

    /// `engram_hash_device`'s arrays, before anything is queued: each
    /// aligned to its element (a misaligned load is a sticky fault that ends
    /// the whole CUDA context), memory the context's device can address
    /// (device memory of that device, managed, or mapped pinned host memory:
    /// [`gpu::check_device_range`], which asks the driver with
    /// `cuPointerGetAttribute`), with room for `n` tokens' entries.
    fn check_hash_pointers(gpu: &dyn Gpu, h: &DeviceHash, call: &DeviceHashIn) -> Result<()> {
        let n = call.n;
        let per_token =
            (h.max_ngram as usize).saturating_sub(1) * h.n_heads as usize * h.n_layers as usize;
        for (what, p, elem, count) in [
            ("tokens", call.tokens, 4, n),
            ("seq_ids", call.seq_ids, 4, n),
            ("pos", call.pos, 4, n),
            ("row_ids", call.row_ids, 8, n.saturating_mul(per_token)),
        ] {
            if p % elem != 0 {
                bail!(
                    ErrInvalidArgument,
                    "{what} ({p:#x}) is not aligned to {elem} bytes (its elements' size)"
                );
            }
            let bytes = count.checked_mul(elem as usize).ok_or_else(|| {
                Error::new(
                    EngramStatus::ErrInvalidArgument,
                    format!("{what}: {count} entries overflow the address space"),
                )
            })?;
            gpu::check_device_range(gpu, p, bytes, what)?;
        }
        Ok(())
    }

    /// Queue a range operation on the device history on `stream` (see
    /// `engram_seq_rm_device` and the others). Every argument is checked
    /// here, as the host history checks it, before anything is queued.
    pub(crate) fn seq_op_on_device(&self, op: DeviceSeqOp, stream: Stream) -> Result<()> {
        let h = self.device_hash()?;
        let max = h.limits.max_positions;
        let slots = h.limits.max_seqs as u32;
        let seq = |s: i32| h.limits.seq(s).map(|s| s as i32);
        // (src, dst, keep, range) of one engram_hash_seq_edit, or a shift.
        let edit = match op {
            DeviceSeqOp::Rm { seq: s, p0, p1 } => {
                let d = if s == -1 { -1 } else { seq(s)? };
                (-1, d, -1, Range::resolve(p0, p1, max)?)
            }
            DeviceSeqOp::Cp { src, dst, p0, p1 } => {
                let (s, d) = (seq(src)?, seq(dst)?);
                let r = Range::resolve(p0, p1, max)?;
                if s == d {
                    return Ok(());
                }
                (s, d, -1, r)
            }
            DeviceSeqOp::Keep { seq: s } => (-1, -1, seq(s)?, Range { p0: 0, p1: max }),
            DeviceSeqOp::Add {
                seq: s,
                p0,
                p1,
                delta,
            } => {
                let s = seq(s)?;
                let r = Range::resolve(p0, p1, max)?;
                if delta == 0 || r.p0 == r.p1 {
                    return Ok(());
                }
                return self.shift_on_device(h, s, r, delta, stream);
            }
        };
        let (src, dst, keep, r) = edit;
        if r.p0 == r.p1 {
            return Ok(());
        }
        let _st = self.state();
        let (ring, ring_len) = (h.ring.ptr, h.ring_len as u32);
        // Positions fit an i32: max_positions does (Limits).
        let (p0, p1) = (r.p0 as i32, r.p1 as i32);
        let a = args![ring, ring_len, slots, src, dst, keep, p0, p1];
        let entries = if dst >= 0 {
            h.ring_len
        } else {
            h.ring_len * h.limits.max_seqs
        };
        let blocks =
            (entries.div_ceil(EDIT_THREADS as usize) as u64).min(EDIT_BLOCKS as u64) as u32;
        // SAFETY: arguments match engram_hash_seq_edit; every slot named is
        // below max_seqs, the ring's slot count.
        unsafe {
            self.gpu
                .launch(Kernel::HashSeqEdit, blocks, EDIT_THREADS, stream, &a)
        }
    }

    fn shift_on_device(
        &self,
        h: &DeviceHash,
        seq: i32,
        r: Range,
        delta: i32,
        stream: Stream,
    ) -> Result<()> {
        let _st = self.state();
        let (ring, ring_len) = (h.ring.ptr, h.ring_len as u32);
        let (p0, p1) = (r.p0 as i32, r.p1 as i32);
        let max_positions = h.limits.max_positions as u32;
        let (scratch, flag) = (h.shift_scratch.ptr, h.shift_flag.ptr);
        let (hlatch, mirror) = (h.latch.ptr, self.mirror.dev_ptr);
        let blocks = ring_len.div_ceil(EDIT_THREADS).min(EDIT_BLOCKS);
        let a = args![
            ring,
            ring_len,
            seq,
            p0,
            p1,
            delta,
            max_positions,
            scratch,
            flag
        ];
        // SAFETY: arguments match engram_hash_shift_scan; `seq` is below
        // max_seqs; the scratch holds ring_len entries.
        unsafe {
            self.gpu
                .launch(Kernel::HashShiftScan, blocks, EDIT_THREADS, stream, &a)?
        };
        let a = args![ring, ring_len, seq, p0, p1, delta, scratch, flag];
        // SAFETY: arguments match engram_hash_shift_write; as above.
        unsafe {
            self.gpu
                .launch(Kernel::HashShiftWrite, blocks, EDIT_THREADS, stream, &a)?
        };
        let a = args![seq, delta, max_positions, flag, hlatch, mirror];
        // SAFETY: arguments match engram_hash_shift_done; the latch and the
        // mirror are LATCH_WORDS u32 each.
        unsafe { self.gpu.launch(Kernel::HashShiftDone, 1, 32, stream, &a) }
    }

    /// Refuse a call that reads or writes the history synchronously on a
    /// stream being captured.
    fn not_capturing(&self, stream: Stream, what: &str) -> Result<()> {
        if self.gpu.stream_capturing(stream)? {
            bail!(
                ErrInvalidArgument,
                "{what} waits for the stream and copies the history on the host, which a stream \
                 being captured cannot do; call it outside the capture"
            );
        }
        Ok(())
    }

    /// The written positions of `seq`'s device history and their entries, in
    /// increasing order, once the work queued on `stream` has run (not
    /// capturable; for `engram_seq_state_*_device`).
    pub(crate) fn seq_entries_on_device(
        &self,
        seq: i32,
        stream: Stream,
    ) -> Result<Vec<(usize, i32)>> {
        let h = self.device_hash()?;
        let s = h.limits.seq(seq)?;
        self.not_capturing(stream, "saving a device history's state")?;
        let _st = self.state();
        let mut raw = try_vec(h.ring_len, 0u64, "a host copy of a device history slot")?;
        self.gpu.stream_synchronize(stream)?;
        // SAFETY: slot `s` of the ring is ring_len u64 at this offset; `raw`
        // holds as many.
        unsafe {
            self.own_download(
                raw.as_mut_ptr().cast(),
                h.ring.ptr + (s * h.ring_len * 8) as u64,
                h.ring_len * 8,
            )?
        };
        // An entry's position is its low half: -1 (empty) or a position.
        let live = |e: &&u64| (**e as u32 as i32) >= 0;
        let mut v = try_room(
            raw.iter().filter(live).count(),
            "the entries of a device history slot",
        )?;
        v.extend(
            raw.iter()
                .filter(live)
                .map(|&e| (e as u32 as usize, (e >> 32) as u32 as i32)),
        );
        v.sort_unstable_by_key(|&(p, _)| p);
        Ok(v)
    }

    /// Replace `seq`'s device history with `entries` (increasing positions
    /// below max_positions, checked by the caller), once the work queued on
    /// `stream` has run. Where two positions share a ring entry the later
    /// one is kept, as hashing them in order would keep it (not capturable).
    pub(crate) fn seq_load_on_device(
        &self,
        seq: i32,
        entries: &[(usize, i32)],
        stream: Stream,
    ) -> Result<()> {
        let h = self.device_hash()?;
        let s = h.limits.seq(seq)?;
        self.not_capturing(stream, "restoring a device history's state")?;
        let mut raw = try_vec(h.ring_len, !0u64, "a host image of a device history slot")?;
        for &(p, v) in entries {
            raw[p % h.ring_len] = ((v as u32 as u64) << 32) | p as u32 as u64;
        }
        let _st = self.state();
        self.gpu.stream_synchronize(stream)?;
        // SAFETY: as in seq_entries_on_device, the other way.
        unsafe {
            self.own_upload(
                h.ring.ptr + (s * h.ring_len * 8) as u64,
                raw.as_ptr().cast(),
                h.ring_len * 8,
            )
        }
    }
}
