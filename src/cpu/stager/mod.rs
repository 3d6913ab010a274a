//! Host tables and the prefetching gather (`engram_prefetch`).
//!
//! The real tables (~101 GB per layer as fp8) live in host memory or on disk.
//! The row ids of a step are known right after hashing, before the step runs,
//! so the engine can start the gather then: [`Stager::stage`] hints the
//! kernel (`madvise(MADV_WILLNEED)` on the pages of a table in memory,
//! `posix_fadvise(POSIX_FADV_WILLNEED)` on a file) and copies the raw rows on
//! worker threads, and returns at once. `apply` for the same ids waits only
//! for that stage and dequantises from it; `apply` for ids nobody staged
//! reads the table directly.
//!
//! Each layer has two staging slots (double buffering): the next step's
//! prefetch fills one while this step's apply reads the other. A third
//! prefetch before either was applied reuses the older slot (after its gather
//! has finished).
//!
//! Table sources:
//! - memory: the engine's pointer (its own mmap, or a mapped file); reads are
//!   plain copies. A mapped file that shrinks underneath raises SIGBUS: keep
//!   model files immutable while mapped, as every mmap-based engine does.
//! - file: a file and the table's offset in it (the GGUF loader's default):
//!   reads are `pread`, so an I/O error or a file cut short is a status
//!   (`ErrIo`), never a signal; `apply` without a prefetch preads too.
//! - split: a split fp8 table's codes and scales, each from a memory or file
//!   source of its own; a row read from it is its codes then its scales, the
//!   packed fp8 row, which is what the staging slots hold and dequantise.
//!
//! Each job owns what it reads into and hands it back to its slot, unless the
//! backend gave the layer memory to gather into in place ([`InPlace`], one
//! per slot: the CUDA backend's pinned staging buffers, which its device
//! copies read): then each job writes its rows straight there, at the cells
//! of their tokens, after waiting until no device copy queued from that
//! memory by an earlier apply still reads it ([`InPlace::wait_idle`]), and a
//! prefetched row is written once on the host. Replacing
//! a layer's table ([`Stager::set_source`]) drops the jobs still queued for
//! the old one and waits for those already running, so no thread reads the
//! old table once it returns; a slot remembers the generation of the table
//! it was filled from and serves only an apply of that generation.
//!
//! The workers are threads of their own, not the projection's pool: their
//! reads block in page faults and `pread` on a cold disk, which would stall
//! the projection's compute threads.

mod read;

use read::{hint, read_rows};
// std's primitives, or loom's when the model check below runs.
use super::sync::{thread, Arc, Condvar, Mutex, MutexGuard};
use crate::backend::StageStats;
use crate::batch::try_vec_with;
use crate::error::{Error, Result};
use crate::formats::{dequant_row_bf16, EngramType, RowDataError};
use crate::rowcache::{PolicyKind, RowCache, TierStats};
use crate::EngramStatus;
use std::collections::VecDeque;
use std::fs::File;

/// Staging slots per layer (and in-place memories a backend gives a layer).
pub const SLOTS: usize = 2;
/// Fewest rows one worker job reads.
const MIN_ROWS_PER_JOB: usize = 16;

/// Where a layer's table rows are read from.
pub enum Source {
    /// `len` bytes at `ptr`: the engine's table, borrowed by the context.
    Memory { ptr: *const u8, len: usize },
    /// The table starts at `offset` in `file` and is `len` bytes long.
    File {
        file: std::sync::Arc<File>,
        offset: u64,
        len: u64,
    },
    /// The model check's table (see `model`): reads and frees are tracked.
    #[cfg(all(test, feature = "loom-model"))]
    Model(std::sync::Arc<model::Table>),
    /// A split fp8 table: its codes (`crb` bytes a row) and its scales (the
    /// rest of a row), each read from its own source; a row read from it is
    /// its codes then its scales (the packed fp8 row).
    Split {
        codes: Box<Source>,
        scales: Box<Source>,
        crb: usize,
    },
    /// A file-backed table (a file, or a split table with a file part)
    /// behind the layer's host row cache (docs/row-cache.md): rows are read
    /// through the cache, its misses from `inner`.
    Cached {
        inner: Box<Source>,
        cache: std::sync::Arc<RowCache>,
    },
}

// SAFETY: `Memory` points at a table the context borrows for as long as the
// layer is set; every reader holds an `Arc<Source>`, and `set_source` (and
// `Drop`) wait until no reader but the stager holds the old one, so no thread
// reads the table after its layer was replaced or the context freed.
unsafe impl Send for Source {}
// SAFETY: sharing a `Source` between threads only reads it: a borrowed
// table stays valid while any `Arc<Source>` lives (the `Send` argument
// above), a file is read with positioned reads (`pread`), and a split
// table's two parts are sources of their own.
unsafe impl Sync for Source {}

impl Source {
    /// A table in memory.
    pub fn memory(table: &[u8]) -> Source {
        Source::Memory {
            ptr: table.as_ptr(),
            len: table.len(),
        }
    }

    /// Layer `layer_id`'s table of `len` bytes at `offset` in `file`, after
    /// checking that the file holds them (`ErrIo` otherwise).
    pub fn file(
        file: std::sync::Arc<File>,
        offset: u64,
        len: u64,
        layer_id: u32,
        what: &str,
    ) -> Result<Source> {
        let size = file
            .metadata()
            .map_err(|e| Error::new(EngramStatus::ErrIo, format!("the {what}'s file: {e}")))?
            .len();
        if offset.checked_add(len).is_none_or(|end| end > size) {
            crate::error::bail!(
                ErrIo,
                "layer {layer_id}: the {what}'s {len} bytes at offset {offset} pass the end of its file ({size} bytes)"
            );
        }
        Ok(Source::File { file, offset, len })
    }

    /// Whether any of its rows come from a file (what a row cache fronts).
    fn file_backed(&self) -> bool {
        match self {
            Source::File { .. } => true,
            Source::Split { codes, scales, .. } => codes.file_backed() || scales.file_backed(),
            _ => false,
        }
    }
}

/// Memory a layer's staging slot gathers into in place, given by the backend
/// at [`Stager::set_source`] (one per slot): the CUDA backend's pinned
/// staging buffers, from which its host-to-device copies read, so that a
/// prefetched row is written once on the host.
///
/// # Safety
/// [`InPlace::rows`] is `len` bytes of memory that stay valid and writable
/// for as long as the object lives, and that nothing else writes or reads
/// while the stager holds the slot, except a read queued before the stager
/// last let go of the slot that [`InPlace::wait_idle`] waits for.
pub unsafe trait InPlace: Send + Sync {
    /// Where the rows go: `len` bytes at the pointer; the row of cell `p`
    /// (token `t`, column `c`: `p = t * cols + c`) at `p * row_bytes`. The
    /// stager asks for it only when it is about to write or read the rows.
    fn rows(&self) -> (*mut u8, usize);
    /// `rows().1`, without touching the memory.
    fn rows_len(&self) -> usize;
    /// Wait until nothing queued while an apply held the slot still reads the
    /// memory (the device copy of the last apply served from it). Every
    /// gather into the memory calls it before it writes.
    fn wait_idle(&self) -> Result<()>;
}

/// Where a staged row goes: its cell (`tokens[j / cols] * cols + j % cols`
/// for the `j`-th id; `j` itself when `tokens` is empty).
#[derive(Clone)]
struct Cells {
    tokens: std::sync::Arc<Vec<usize>>,
    cols: usize,
}

impl Cells {
    fn dense() -> Cells {
        Cells {
            tokens: std::sync::Arc::new(Vec::new()),
            cols: 1,
        }
    }

    fn of(&self, j: usize) -> usize {
        if self.tokens.is_empty() {
            j
        } else {
            self.tokens[j / self.cols] * self.cols + j % self.cols
        }
    }

    /// One past the largest cell of `k` ids.
    fn end(&self, k: usize) -> usize {
        if self.tokens.is_empty() {
            k
        } else {
            self.tokens.iter().max().map_or(0, |&t| (t + 1) * self.cols)
        }
    }
}

/// Copy rows `ids` (checked against the table) from `src` into `dst` at their
/// cells (`cells.of(first + j)` for the `j`-th), each run of consecutive cells
/// with one read.
fn read_cells(
    src: &Source,
    rb: usize,
    ids: &[i64],
    cells: &Cells,
    first: usize,
    dst: &mut [u8],
) -> Result<()> {
    let mut j = 0;
    while j < ids.len() {
        let c0 = cells.of(first + j);
        let mut e = j + 1;
        while e < ids.len() && cells.of(first + e) == c0 + (e - j) {
            e += 1;
        }
        let Some(d) = dst.get_mut(c0 * rb..(c0 + e - j) * rb) else {
            crate::error::bail!(
                ErrInternal,
                "staged rows past their memory ({} bytes)",
                dst.len()
            );
        };
        read_rows(src, rb, &ids[j..e], d)?;
        j = e;
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Free,
    Gathering,
    Ready,
    /// An `apply` is reading it.
    Taken,
}

struct Slot {
    st: St,
    ids: Vec<i64>,
    /// Where its rows go in the layer's in-place memory (and what an apply
    /// must ask for to be served from it besides the ids).
    cells: Cells,
    /// The jobs' rows, in order (a layer without in-place memory).
    parts: Vec<Vec<u8>>,
    pending: usize,
    err: Option<Error>,
    /// Which prefetch filled it (newer prefetches have larger numbers).
    seq: u64,
    /// The generation of the layer's table it was filled from.
    gen: u64,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            st: St::Free,
            ids: Vec::new(),
            cells: Cells::dense(),
            parts: Vec::new(),
            pending: 0,
            err: None,
            seq: 0,
            gen: 0,
        }
    }

    fn clear(&mut self) {
        self.st = St::Free;
        self.err = None;
        self.ids = Vec::new();
        self.cells = Cells::dense();
        self.parts = Vec::new();
    }
}

struct LayerStage {
    source: Option<Arc<Source>>,
    format: EngramType,
    /// Bytes per row.
    rb: usize,
    /// Incremented by every `set_source`.
    gen: u64,
    slots: Vec<Slot>,
    /// The memory each slot gathers into in place (empty: the jobs' own
    /// buffers).
    mem: Vec<std::sync::Arc<dyn InPlace>>,
}

struct Job {
    layer: usize,
    slot: usize,
    /// The slot's `seq` when queued (a reused slot drops late reports).
    seq: u64,
    part: usize,
    src: Arc<Source>,
    rb: usize,
    ids: Vec<i64>,
    /// In-place memory, where the rows go in it, and the index of the job's
    /// first id among the slot's; `None`: into a buffer of its own.
    place: Option<(std::sync::Arc<dyn InPlace>, Cells, usize)>,
}

struct State {
    layers: Vec<LayerStage>,
    queue: VecDeque<Job>,
    shutdown: bool,
    seq: u64,
    stats: StageStats,
}

struct Shared {
    state: Mutex<State>,
    /// Slot state changes (a gather finished, a slot was released, a job ended).
    cv: Condvar,
    /// Jobs queued (the workers wait here).
    work: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.cv.wait(g).unwrap_or_else(|p| p.into_inner())
    }
}

/// The error of a stage that could not allocate what its jobs own.
fn stage_oom(k: usize) -> Error {
    Error::new(
        EngramStatus::ErrCapacity,
        format!("out of memory to stage {k} rows"),
    )
}

/// Everything one stage's jobs own, allocated (fallibly) before any state
/// changes: the slot's ids, cells and row buffers, and each job's ids.
struct Staged {
    ids: Vec<i64>,
    cells: Cells,
    /// One (empty) buffer per job, for a layer without in-place memory.
    parts: Vec<Vec<u8>>,
    /// Each job's ids: `per` of them (the last job's may be fewer).
    jobs: Vec<Vec<i64>>,
    per: usize,
}

impl Staged {
    /// Row ids `ids`, `cols` per token of `tokens` (empty: back to back),
    /// in jobs of `per` ids (at least one job).
    fn alloc(ids: &[i64], tokens: &[usize], cols: usize, per: usize) -> Result<Staged> {
        let k = ids.len();
        let n_jobs = k.div_ceil(per).max(1);
        let oom = |_| stage_oom(k);
        let mut owned_ids = Vec::new();
        owned_ids.try_reserve_exact(k).map_err(oom)?;
        owned_ids.extend_from_slice(ids);
        let mut parts = Vec::new();
        parts.try_reserve_exact(n_jobs).map_err(oom)?;
        parts.resize_with(n_jobs, Vec::new);
        let mut owned_tokens = Vec::new();
        owned_tokens.try_reserve_exact(tokens.len()).map_err(oom)?;
        owned_tokens.extend_from_slice(tokens);
        let cells = Cells {
            tokens: std::sync::Arc::new(owned_tokens),
            cols: cols.max(1),
        };
        let mut jobs = Vec::new();
        jobs.try_reserve_exact(n_jobs).map_err(oom)?;
        for j in 0..n_jobs {
            let (a, b) = ((j * per).min(k), ((j + 1) * per).min(k));
            let mut v = Vec::new();
            v.try_reserve_exact(b - a).map_err(oom)?;
            v.extend_from_slice(&ids[a..b]);
            jobs.push(v);
        }
        Ok(Staged {
            ids: owned_ids,
            cells,
            parts,
            jobs,
            per,
        })
    }
}

/// What a stage's jobs read and where they write: the layer's table (as
/// the lock that queues them sees it), its row bytes and generation, and
/// the slot's in-place memory if the layer has one.
struct Target {
    src: Arc<Source>,
    rb: usize,
    gen: u64,
    mem: Option<std::sync::Arc<dyn InPlace>>,
}

impl Target {
    /// Layer `li`'s table and slot `si`'s memory, which must hold the rows
    /// of `k` ids at `cells`. Read under the same hold of the lock that
    /// queues the jobs: waiting for a slot released it, and a `set_source`
    /// may have run meanwhile.
    fn of(st: &State, li: usize, si: usize, cells: &Cells, k: usize) -> Result<Target> {
        let l = &st.layers[li];
        let Some(src) = &l.source else {
            crate::error::bail!(ErrInternal, "staging layer {li}, whose table was never set");
        };
        let mem = l.mem.get(si).cloned();
        if let Some(m) = &mem {
            let need = cells.end(k).checked_mul(l.rb);
            if need.is_none_or(|b| b > m.rows_len()) {
                crate::error::bail!(
                    ErrInternal,
                    "staging {k} rows of {} bytes past the layer's in-place memory ({} bytes)",
                    l.rb,
                    m.rows_len()
                );
            }
        }
        Ok(Target {
            src: src.clone(),
            rb: l.rb,
            gen: l.gen,
            mem,
        })
    }
}

/// The staging area and worker threads of one context.
pub struct Stager {
    shared: Arc<Shared>,
    workers: Mutex<Vec<thread::JoinHandle<()>>>,
    n_workers: usize,
    /// Each layer's host row cache statistics (read by pollers, no lock).
    cache_stats: Vec<std::sync::Arc<TierStats>>,
    /// The row cache each file-backed layer gets: its budget (bytes of rows
    /// a layer) and policy; a budget of 0: none.
    cache_cfg: std::sync::Mutex<(u64, PolicyKind)>,
}

/// The result of a gather: the outer error is the read's (I/O); the inner
/// one names the position in the ids of a row that holds invalid data.
pub type Gathered = Result<std::result::Result<(), (usize, RowDataError)>>;

impl Stager {
    /// A stager for `n_layers` layers whose gathers use `n_workers` threads
    /// (started on the first prefetch).
    pub fn new(n_layers: usize, n_workers: usize) -> Result<Stager> {
        let layers = try_vec_with(
            n_layers,
            || LayerStage {
                source: None,
                format: EngramType::Bf16,
                rb: 0,
                gen: 0,
                slots: (0..SLOTS).map(|_| Slot::new()).collect(),
                mem: Vec::new(),
            },
            "engram layers",
        )?;
        let cache_stats = try_vec_with(n_layers, Default::default, "row cache statistics")?;
        Ok(Stager {
            cache_stats,
            cache_cfg: std::sync::Mutex::new((0, crate::rowcache::DEFAULT_POLICY)),
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    layers,
                    queue: VecDeque::new(),
                    shutdown: false,
                    seq: 0,
                    stats: StageStats::default(),
                }),
                cv: Condvar::new(),
                work: Condvar::new(),
            }),
            workers: Mutex::new(Vec::new()),
            n_workers: n_workers.clamp(1, 64),
        })
    }

    /// Layer `li`'s table is now `src`, rows of `rb` bytes in `format`:
    /// drops the jobs queued for the old table, waits for the ones running
    /// and for applies reading a slot, and empties the layer's slots. When it
    /// returns no thread reads the old table or writes the old in-place
    /// memory. Returns the new generation. A file-backed table gets the
    /// layer's row cache ([`Stager::set_row_cache`]); `ErrCapacity` when its
    /// memory cannot be had (nothing changed then).
    pub fn set_source(&self, li: usize, src: Source, format: EngramType, rb: usize) -> Result<u64> {
        self.set_source_in_place(li, src, format, rb, Vec::new())
    }

    /// Every file-backed layer set from now on gets a row cache of
    /// `per_layer` bytes of rows (0: none) under `policy`.
    pub fn set_row_cache(&self, per_layer: u64, policy: PolicyKind) {
        *self.cache_cfg.lock().unwrap_or_else(|p| p.into_inner()) = (per_layer, policy);
    }

    /// Layer `li`'s host row cache statistics.
    pub fn cache_stats(&self, li: usize) -> Option<&TierStats> {
        self.cache_stats.get(li).map(|s| &**s)
    }

    /// `src` behind a new row cache for layer `li` (rows of `rb` bytes) when
    /// it is file-backed and the stager has a cache budget; as it is
    /// otherwise (the layer's statistics then say there is no cache).
    fn with_cache(&self, li: usize, src: Source, rb: usize) -> Result<Source> {
        let (budget, policy) = *self.cache_cfg.lock().unwrap_or_else(|p| p.into_inner());
        let stats = &self.cache_stats[li];
        if budget == 0 || !src.file_backed() {
            stats.configure(0, 0, rb as u64, 0, None);
            return Ok(src);
        }
        Ok(match RowCache::new(budget, rb, policy, stats.clone())? {
            Some(cache) => Source::Cached {
                inner: Box::new(src),
                cache: std::sync::Arc::new(cache),
            },
            None => src,
        })
    }

    /// [`Stager::set_source`], with memory for each of the layer's [`SLOTS`]
    /// slots to gather into in place (or none: `mem` empty). Each must hold
    /// rows of `rb` bytes for every cell a [`Stager::stage_at`] of the layer
    /// names (checked there).
    pub fn set_source_in_place(
        &self,
        li: usize,
        src: Source,
        format: EngramType,
        rb: usize,
        mem: Vec<std::sync::Arc<dyn InPlace>>,
    ) -> Result<u64> {
        if !mem.is_empty() && mem.len() != SLOTS {
            crate::error::bail!(
                ErrInternal,
                "{} in-place staging memories for {SLOTS} slots",
                mem.len()
            );
        }
        let src = self.with_cache(li, src, rb)?;
        let mut st = self.shared.lock();
        // Drop the queued jobs of the layer; their slots stop waiting for them.
        let queue = std::mem::take(&mut st.queue);
        let mut kept = VecDeque::with_capacity(queue.len());
        for j in queue {
            if j.layer != li {
                kept.push_back(j);
                continue;
            }
            let s = &mut st.layers[li].slots[j.slot];
            if s.seq == j.seq && s.st == St::Gathering {
                s.pending -= 1;
            }
        }
        st.queue = kept;
        // Wait for the jobs already running and any apply reading a slot.
        while st.layers[li]
            .slots
            .iter()
            .any(|s| (s.st == St::Gathering && s.pending > 0) || s.st == St::Taken)
        {
            st = self.shared.wait(st);
        }
        // Every reader of the old table lets go of its source before it reports.
        if let Some(old) = st.layers[li].source.take() {
            while Arc::strong_count(&old) > 1 {
                st = self.shared.wait(st);
            }
        }
        let l = &mut st.layers[li];
        for s in &mut l.slots {
            s.clear();
        }
        l.source = Some(Arc::new(src));
        l.format = format;
        l.rb = rb;
        l.mem = mem;
        l.gen += 1;
        Ok(l.gen)
    }

    /// Start gathering the raw rows `ids` (already checked against the
    /// table) of layer `li` on the workers, back to back. Returns once the
    /// jobs are queued.
    pub fn stage(&self, li: usize, ids: &[i64]) -> Result<()> {
        self.stage_at(li, ids, &[], 1)
    }

    /// [`Stager::stage`], each `cols` ids being those of token `tokens[i]`
    /// (empty: back to back): in a layer's in-place memory the row of the
    /// `j`-th id goes to cell `tokens[j / cols] * cols + j % cols`. An apply
    /// is served from it only if it asks for the same ids and tokens.
    pub fn stage_at(&self, li: usize, ids: &[i64], tokens: &[usize], cols: usize) -> Result<()> {
        let k = ids.len();
        if !tokens.is_empty() && tokens.len().checked_mul(cols) != Some(k) {
            crate::error::bail!(
                ErrInternal,
                "staging {k} row ids as {} tokens of {cols}",
                tokens.len()
            );
        }
        self.start_workers()?;
        let per = k.div_ceil(self.n_workers).max(MIN_ROWS_PER_JOB);
        let staged = Staged::alloc(ids, tokens, cols, per)?;
        let mut st = self.shared.lock();
        if st.layers[li].source.is_none() {
            // The context checks a layer is set before it stages.
            crate::error::bail!(ErrInternal, "staging layer {li}, whose table was never set");
        }
        st.queue
            .try_reserve(staged.jobs.len())
            .map_err(|_| stage_oom(k))?;
        let (st, si) = self.claim_slot(st, li);
        let target = Target::of(&st, li, si, &staged.cells, k)?;
        self.queue_jobs(st, li, si, staged, target);
        Ok(())
    }

    /// A slot of layer `li` to stage into: a free one, else the oldest that
    /// no apply holds, once its gather is done. Waits (releasing the lock)
    /// while there is none.
    fn claim_slot<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        li: usize,
    ) -> (MutexGuard<'a, State>, usize) {
        loop {
            let slots = &st.layers[li].slots;
            if let Some(i) = slots.iter().position(|s| s.st == St::Free) {
                return (st, i);
            }
            let oldest = (0..SLOTS)
                .filter(|&i| slots[i].st != St::Taken)
                .min_by_key(|&i| slots[i].seq);
            match oldest {
                Some(i) if slots[i].st == St::Ready => return (st, i),
                _ => st = self.shared.wait(st),
            }
        }
    }

    /// Slot `si` of layer `li` takes `staged`'s ids and cells and its jobs
    /// are queued (the lock held throughout); then the workers are woken.
    fn queue_jobs(
        &self,
        mut st: MutexGuard<'_, State>,
        li: usize,
        si: usize,
        staged: Staged,
        target: Target,
    ) {
        st.seq += 1;
        let seq = st.seq;
        let n_jobs = staged.jobs.len();
        let slot = &mut st.layers[li].slots[si];
        slot.clear();
        slot.ids = staged.ids;
        slot.cells = staged.cells.clone();
        slot.parts = staged.parts;
        slot.seq = seq;
        slot.gen = target.gen;
        slot.pending = n_jobs;
        slot.st = St::Gathering;
        let (per, cells) = (staged.per, staged.cells);
        st.queue
            .extend(staged.jobs.into_iter().enumerate().map(|(j, ids)| Job {
                layer: li,
                slot: si,
                seq,
                part: j,
                src: target.src.clone(),
                rb: target.rb,
                ids,
                place: target.mem.clone().map(|m| (m, cells.clone(), j * per)),
            }));
        // The table and memory are let go of before the lock: a
        // `set_source` waiting for the old table's last reader counts them.
        drop(target);
        st.stats.prefetched += 1;
        drop(st);
        for _ in 0..n_jobs.min(self.n_workers) {
            self.shared.work.notify_one();
        }
    }

    /// How the gathers so far were served.
    pub fn stats(&self) -> StageStats {
        self.shared.lock().stats
    }

    fn start_workers(&self) -> Result<()> {
        let mut w = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        while w.len() < self.n_workers {
            let sh = self.shared.clone();
            let h = thread::Builder::new()
                .name(format!("engram-gather-{}", w.len()))
                .spawn(move || worker(sh))
                .map_err(|e| {
                    Error::new(
                        EngramStatus::ErrCapacity,
                        format!("cannot start a gather thread: {e}"),
                    )
                })?;
            w.push(h);
        }
        Ok(())
    }

    /// Gather and dequantise the rows `ids` of layer `li` (generation `gen`)
    /// into `out` (bf16): from a staged prefetch of exactly these ids if there
    /// is one (waiting for it), else straight from the layer's source.
    pub fn gather(
        &self,
        li: usize,
        gen: u64,
        width: usize,
        ids: &[i64],
        out: &mut [u16],
    ) -> Gathered {
        self.serve(li, gen, ids, &[], |fmt, rows| match rows {
            Served::Staged(parts, _) => Ok(dequant_parts(parts, fmt, width, out)),
            Served::InPlace { mem, cells, .. } => {
                // (A backend that gives in-place memory copies from it
                // instead; this serves such a stage too.)
                let (p, len) = mem.rows();
                let rb = fmt.row_bytes(width);
                // SAFETY: the slot is taken by this call (see `InPlace`): its
                // gather has finished and nothing writes the memory.
                let rows = unsafe { std::slice::from_raw_parts(p, len) };
                for (j, o) in out.chunks_exact_mut(width).take(ids.len()).enumerate() {
                    let c = cells.of(j);
                    if let Err(e) = dequant_row_bf16(fmt, &rows[c * rb..(c + 1) * rb], o) {
                        return Ok(Err((j, e)));
                    }
                }
                Ok(Ok(()))
            }
            Served::Source(src, rb) => match &**src {
                Source::Memory { .. } => Ok(super::gather::gather_rows(
                    memory_table(src),
                    fmt,
                    width,
                    ids,
                    out,
                )),
                // A file, a split table (its rows assembled from two
                // sources), the model check's table: read as a job reads.
                _ => {
                    let mut buf =
                        crate::batch::try_vec(ids.len() * rb, 0u8, "rows read from the file")?;
                    read_rows(src, rb, ids, &mut buf)?;
                    self.count_copies(ids.len());
                    Ok(dequant_parts(&[buf], fmt, width, out))
                }
            },
        })
    }

    /// The raw rows `ids` of layer `li` (generation `gen`), each `cols` of
    /// them those of token `tokens[i]`, for a backend that copies them from
    /// pinned memory to a device (the CUDA backend), so that each row is
    /// written once on the host:
    ///
    /// - a prefetch of exactly these ids and tokens ([`Stager::stage_at`])
    ///   gathered them into the layer's in-place memory of slot `s`: waits
    ///   for it and returns `staged(s)`, called while this call holds the
    ///   slot (the backend queues its copies from that memory there and
    ///   arranges for [`InPlace::wait_idle`] to wait for them);
    /// - else returns `direct(read)`, where `read(dst)` reads the rows into
    ///   `dst` at their cells (the row of cell `p` at `p * row_bytes`), from
    ///   a prefetch that gathered them into buffers of its own if there is
    ///   one (a layer without in-place memory), else from the layer's source.
    #[allow(clippy::too_many_arguments)]
    pub fn serve_in_place<R>(
        &self,
        li: usize,
        gen: u64,
        ids: &[i64],
        tokens: &[usize],
        cols: usize,
        staged: impl FnOnce(usize) -> Result<R>,
        direct: impl FnOnce(&mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<R>,
    ) -> Result<R> {
        // The cells of this call's rows (the slot's own when it is served
        // from one: the same tokens).
        let call_cells = |tokens: &[usize]| -> Result<Cells> {
            let mut v = Vec::new();
            v.try_reserve_exact(tokens.len()).map_err(|_| {
                Error::new(
                    EngramStatus::ErrCapacity,
                    format!("out of memory for the tokens of {} rows", ids.len()),
                )
            })?;
            v.extend_from_slice(tokens);
            Ok(Cells {
                tokens: std::sync::Arc::new(v),
                cols: cols.max(1),
            })
        };
        self.serve(li, gen, ids, tokens, |_, rows| match rows {
            Served::InPlace { slot, .. } => staged(slot),
            Served::Staged(parts, rb) => {
                let cells = call_cells(tokens)?;
                let r = direct(&mut |dst: &mut [u8]| {
                    let rows = parts.iter().flat_map(|p| p.chunks_exact(rb));
                    for (j, row) in rows.enumerate() {
                        let c = cells.of(j);
                        let Some(d) = dst.get_mut(c * rb..(c + 1) * rb) else {
                            crate::error::bail!(ErrInternal, "staged rows past their memory");
                        };
                        d.copy_from_slice(row);
                    }
                    Ok(())
                });
                self.count_copies(ids.len());
                r
            }
            Served::Source(src, rb) => {
                let cells = call_cells(tokens)?;
                let r = direct(&mut |dst: &mut [u8]| read_cells(src, rb, ids, &cells, 0, dst));
                self.count_copies(ids.len());
                r
            }
        })
    }

    fn count_copies(&self, rows: usize) {
        self.shared.lock().stats.row_copies += rows as u64;
    }

    /// Find the rows `ids` (of tokens `tokens`, see [`Stager::stage_at`]) of
    /// layer `li` (generation `gen`): a staged prefetch of exactly these ids
    /// and tokens (waited for, counted as staged), else the layer's source
    /// (counted as direct); `f` reads them.
    fn serve<R>(
        &self,
        li: usize,
        gen: u64,
        ids: &[i64],
        tokens: &[usize],
        f: impl FnOnce(EngramType, Served<'_>) -> Result<R>,
    ) -> Result<R> {
        let mut st = self.shared.lock();
        loop {
            let found = {
                let slots = &st.layers[li].slots;
                (0..SLOTS)
                    .filter(|&i| {
                        let s = &slots[i];
                        matches!(s.st, St::Gathering | St::Ready)
                            && s.gen == gen
                            && s.ids[..] == *ids
                            && s.cells.tokens[..] == *tokens
                    })
                    .min_by_key(|&i| slots[i].seq)
            };
            let Some(si) = found else { break };
            let seq = st.layers[li].slots[si].seq;
            // Jobs of this stage that no worker has started yet run here
            // (no waiting for a thread to wake up), then wait for the rest.
            while let Some(q) = st.queue.iter().position(|j| j.layer == li && j.seq == seq) {
                let job = st.queue.remove(q).expect("position is in range");
                drop(st);
                run_job(&self.shared, job, false);
                st = self.shared.lock();
            }
            while st.layers[li].slots[si].st == St::Gathering && st.layers[li].slots[si].seq == seq
            {
                st = self.shared.wait(st);
            }
            let (fmt, rb) = (st.layers[li].format, st.layers[li].rb);
            let mem = st.layers[li].mem.get(si).cloned();
            let slot = &mut st.layers[li].slots[si];
            if slot.seq != seq || slot.st != St::Ready {
                continue; // reused by a newer prefetch meanwhile: look again
            }
            if let Some(e) = slot.err.take() {
                slot.clear();
                drop(st);
                self.shared.cv.notify_all();
                return Err(e);
            }
            slot.st = St::Taken;
            let parts = std::mem::take(&mut slot.parts);
            let cells = slot.cells.clone();
            st.stats.staged += 1;
            drop(st);
            let r = match &mem {
                Some(m) => f(
                    fmt,
                    Served::InPlace {
                        slot: si,
                        mem: &**m,
                        cells: &cells,
                    },
                ),
                None => f(fmt, Served::Staged(&parts, rb)),
            };
            let mut st = self.shared.lock();
            drop(mem);
            let slot = &mut st.layers[li].slots[si];
            if slot.seq == seq {
                slot.clear();
            }
            drop(st);
            self.shared.cv.notify_all();
            return r;
        }
        let (src, fmt, rb) = {
            let l = &st.layers[li];
            (l.source.clone(), l.format, l.rb)
        };
        drop(st);
        let Some(src) = src else {
            // The context checks a layer is set before it applies.
            crate::error::bail!(
                ErrInternal,
                "gathering layer {li}, whose table was never set"
            );
        };
        let r = f(fmt, Served::Source(&src, rb));
        // Let go of the source under the lock, as a job does (`run_job`): a
        // `set_source` waiting for the last reader checks the count under the
        // lock, so the release and the wake-up cannot fall between its check
        // and its wait.
        let mut st = self.shared.lock();
        drop(src);
        st.stats.direct += 1;
        drop(st);
        self.shared.cv.notify_all();
        r
    }
}

/// Where [`Stager::serve`] found a gather's rows.
enum Served<'a> {
    /// A prefetch's rows, in parts, in order, and the row bytes.
    Staged(&'a [Vec<u8>], usize),
    /// A prefetch's rows in the layer's in-place memory of slot `slot`, at
    /// their cells.
    InPlace {
        slot: usize,
        mem: &'a dyn InPlace,
        cells: &'a Cells,
    },
    /// The layer's source and its row bytes.
    Source(&'a Arc<Source>, usize),
}

/// The table of a memory source.
fn memory_table(src: &Arc<Source>) -> &[u8] {
    match **src {
        // SAFETY: see `Source`: the table stays valid while an Arc of the
        // source is held, which outlives the returned borrow.
        Source::Memory { ptr, len } => unsafe { std::slice::from_raw_parts(ptr, len) },
        _ => &[],
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
            st.queue.clear();
        }
        self.shared.work.notify_all();
        self.shared.cv.notify_all();
        let ws = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in ws {
            let _ = w.join();
        }
    }
}

/// Dequantise staged raw rows (in parts, in order) into `out`.
fn dequant_parts(
    parts: &[Vec<u8>],
    fmt: EngramType,
    width: usize,
    out: &mut [u16],
) -> std::result::Result<(), (usize, RowDataError)> {
    let rb = fmt.row_bytes(width);
    let rows = parts.iter().flat_map(|p| p.chunks_exact(rb));
    for (j, (row, o)) in rows.zip(out.chunks_exact_mut(width)).enumerate() {
        dequant_row_bf16(fmt, row, o).map_err(|e| (j, e))?;
    }
    Ok(())
}

fn worker(sh: Arc<Shared>) {
    loop {
        let job = {
            let mut st = sh.lock();
            loop {
                if st.shutdown {
                    break None;
                }
                if let Some(j) = st.queue.pop_front() {
                    break Some(j);
                }
                st = sh.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(job) = job else { return };
        run_job(&sh, job, true);
    }
}

/// Read one job's rows (after the kernel hints, when `hint_first`) and hand
/// them to its slot. The job's source is released under the lock, before the
/// slot hears of it, so a waiting `set_source` sees the last reader go.
fn run_job(sh: &Shared, job: Job, hint_first: bool) {
    let Job {
        layer,
        slot,
        seq,
        part,
        src,
        rb,
        ids,
        place,
    } = job;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> Result<Vec<u8>> {
        if hint_first {
            hint(&src, rb, &ids);
        }
        match &place {
            // Straight into the layer's in-place memory, once no device copy
            // queued from it by an earlier apply still reads it.
            Some((mem, cells, first)) => {
                mem.wait_idle()?;
                let (p, len) = mem.rows();
                // SAFETY: `InPlace`'s contract: `len` writable bytes, which
                // no one else touches while this stage holds the slot (the
                // earlier copies were waited for above); the slot's jobs
                // write disjoint cells (each its own ids'); the job holds
                // the memory's Arc.
                let dst = unsafe { std::slice::from_raw_parts_mut(p, len) };
                read_cells(&src, rb, &ids, cells, *first, dst)?;
                Ok(Vec::new())
            }
            None => {
                let mut buf = crate::batch::try_vec(ids.len() * rb, 0u8, "staged rows")?;
                read_rows(&src, rb, &ids, &mut buf)?;
                Ok(buf)
            }
        }
    }))
    .unwrap_or_else(|_| {
        Err(Error::new(
            EngramStatus::ErrInternal,
            "a gather thread panicked",
        ))
    });
    let mut st = sh.lock();
    drop(src);
    drop(place);
    let s = &mut st.layers[layer].slots[slot];
    let mut copied = 0;
    if s.seq == seq && s.st == St::Gathering {
        match r {
            Ok(buf) => {
                s.parts[part] = buf;
                copied = ids.len();
            }
            Err(e) => {
                s.err.get_or_insert(e);
            }
        }
        s.pending -= 1;
        if s.pending == 0 {
            s.st = St::Ready;
        }
    }
    st.stats.row_copies += copied as u64;
    drop(st);
    sh.cv.notify_all();
}

/// The stager's protocol under loom (see the module).
#[cfg(all(test, feature = "loom-model"))]
mod model;
