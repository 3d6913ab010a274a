//! Host tables and the prefetching gather (`engram_prefetch`).
//!
//! The real tables (~101 GB per layer as fp8) live in host memory or on disk.
//! The row ids of a step are known right after hashing, before the step runs,
//! so the engine can start the gather then: [`Stager::prefetch`] checks the
//! ids, hints the kernel (`madvise(MADV_WILLNEED)` on the pages of a mapped
//! table, `posix_fadvise(POSIX_FADV_WILLNEED)` on a file) and copies the raw
//! rows into a staging buffer on worker threads, and returns at once.
//! `apply` for the same ids waits only for that stage and dequantises from
//! it; `apply` for ids nobody staged reads the table directly.
//!
//! Each layer has two staging slots (double buffering): the next step's
//! prefetch fills one while this step's apply reads the other. A third
//! prefetch before either was applied reuses the older slot (after its gather
//! has finished).
//!
//! Table sources:
//! - memory: the engine's pointer (its own mmap, or the GGUF mapping); reads are
//!   plain copies. A mapped file that shrinks underneath raises SIGBUS: keep
//!   model files immutable while mapped, as every mmap-based engine does.
//! - file: a file descriptor and the table's offset in it (the GGUF loader's
//!   default): reads are `pread`, so an I/O error or a file cut short is a
//!   status (`ErrIo`), never a signal; `apply` without a prefetch preads too.
//!
//! The staging buffers are plain host memory; the CUDA backend's half (pinned
//! staging, the copy to the device on the caller's stream, dequantisation
//! there) builds on the same slots.

use crate::error::{bail, Error, Result};
use crate::formats::{dequant_row_bf16, RowDataError, RowFormat};
use crate::hash::{HashTables, Limits, ROW_ID_DEAD};
use crate::EngramStatus;
use std::collections::VecDeque;
use std::fs::File;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Staging slots per layer.
const SLOTS: usize = 2;
/// Fewest rows one worker job reads.
const MIN_ROWS_PER_JOB: usize = 16;

/// Where a layer's table rows are read from.
#[derive(Clone)]
enum Source {
    /// `len` bytes at `ptr`, borrowed by the context for its lifetime.
    Memory { ptr: *const u8, len: usize },
    /// The table starts at `offset` in `file` and is `len` bytes long.
    File {
        file: Arc<File>,
        offset: u64,
        len: u64,
    },
}

// SAFETY: `Memory` points at a table the context borrows for its whole
// lifetime (`'w`); the stager reads it only while the context lives (jobs
// are finished before a layer is replaced and before the stager drops).
unsafe impl Send for Source {}
unsafe impl Sync for Source {}

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
    buf: Vec<u8>,
    pending: usize,
    err: Option<Error>,
    gen: u64,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            st: St::Free,
            ids: Vec::new(),
            buf: Vec::new(),
            pending: 0,
            err: None,
            gen: 0,
        }
    }
}

struct LayerStage {
    source: Option<Source>,
    format: Option<RowFormat>,
    rows: u64,
    /// Bytes per row.
    rb: usize,
    slots: Vec<Slot>,
}

struct Job {
    layer: usize,
    slot: usize,
    src: Source,
    rb: usize,
    /// Row ids of this job (pointer into the slot's `ids`, stable while gathering).
    ids: *const i64,
    n: usize,
    /// Destination (pointer into the slot's `buf`, stable while gathering).
    dst: *mut u8,
}

// SAFETY: `ids` and `dst` point into a slot's vectors, which are neither
// resized nor dropped while the slot is `Gathering` (until every job of it
// has reported back); each job writes its own disjoint range of `dst`.
unsafe impl Send for Job {}

struct State {
    layers: Vec<LayerStage>,
    queue: VecDeque<Job>,
    shutdown: bool,
    gen: u64,
}

struct Shared {
    state: Mutex<State>,
    /// Slot state changes (a gather finished, a slot was released).
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

/// How `apply`'s gathers were served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Prefetches started.
    pub prefetched: u64,
    /// Gathers served from a staged prefetch.
    pub staged: u64,
    /// Gathers read directly (no prefetch of those ids).
    pub direct: u64,
}

/// The staging area and worker threads of one context.
pub struct Stager {
    stats: Mutex<Stats>,
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    n_workers: usize,
}

impl Stager {
    /// A stager for `n_layers` layers whose gathers use `n_workers` threads
    /// (started on the first prefetch).
    pub fn new(n_layers: usize, n_workers: usize) -> Stager {
        Stager {
            stats: Mutex::new(Stats::default()),
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    layers: (0..n_layers)
                        .map(|_| LayerStage {
                            source: None,
                            format: None,
                            rows: 0,
                            rb: 0,
                            slots: (0..SLOTS).map(|_| Slot::new()).collect(),
                        })
                        .collect(),
                    queue: VecDeque::new(),
                    shutdown: false,
                    gen: 0,
                }),
                cv: Condvar::new(),
                work: Condvar::new(),
            }),
            workers: Mutex::new(Vec::new()),
            n_workers: n_workers.clamp(1, 64),
        }
    }

    /// Wait until no gather or apply uses layer `li`'s slots, then drop its
    /// stages (the layer's table is being replaced).
    fn quiesce<'a>(&'a self, mut st: MutexGuard<'a, State>, li: usize) -> MutexGuard<'a, State> {
        while st.layers[li]
            .slots
            .iter()
            .any(|s| matches!(s.st, St::Gathering | St::Taken))
        {
            st = self.shared.wait(st);
        }
        for s in &mut st.layers[li].slots {
            s.st = St::Free;
            s.err = None;
            s.ids = Vec::new();
        }
        st
    }

    /// Layer `li`'s table is `table` (borrowed by the context for its
    /// lifetime). Drops the layer's stages and any file source.
    pub fn set_memory(&self, li: usize, table: &[u8], format: RowFormat, rows: u64) {
        let st = self.shared.lock();
        let mut st = self.quiesce(st, li);
        let l = &mut st.layers[li];
        l.source = Some(Source::Memory {
            ptr: table.as_ptr(),
            len: table.len(),
        });
        l.format = Some(format);
        l.rows = rows;
        l.rb = table.len() / rows.max(1) as usize;
    }

    /// Read layer `li`'s rows from `file` at `offset` with `pread` (instead of
    /// the memory given to [`Stager::set_memory`], which must be set first).
    pub fn set_file(&self, li: usize, file: Arc<File>, offset: u64) -> Result<()> {
        let st = self.shared.lock();
        let mut st = self.quiesce(st, li);
        let l = &mut st.layers[li];
        let Some(Source::Memory { len, .. }) = l.source else {
            bail!(
                ErrNoWeights,
                "the layer's table must be set before its file"
            );
        };
        l.source = Some(Source::File {
            file,
            offset,
            len: len as u64,
        });
        Ok(())
    }

    /// Whether layer `li` reads its rows from a file.
    pub fn is_file(&self, li: usize) -> bool {
        matches!(
            self.shared.lock().layers[li].source,
            Some(Source::File { .. })
        )
    }

    /// Check a step's row ids for layer `li` as `apply` does and start
    /// gathering their raw rows on the workers. Returns once the jobs are
    /// queued; errors (unknown layer, bad ids, no weights) change nothing.
    pub fn prefetch(
        &self,
        tables: &HashTables,
        limits: &Limits,
        layer_id: u32,
        row_ids: &[i64],
        n: usize,
    ) -> Result<()> {
        let Some(li) = tables.layer_index(layer_id) else {
            bail!(
                ErrUnknownLayer,
                "layer {layer_id} is not an engram layer (engram layers: {:?})",
                tables.layer_ids
            );
        };
        let (src, rows, rb) = {
            let st = self.shared.lock();
            let l = &st.layers[li];
            match (&l.source, l.format) {
                (Some(s), Some(_)) => (s.clone(), l.rows, l.rb),
                _ => bail!(
                    ErrNoWeights,
                    "layer {layer_id}: weights were never set (or are device memory)"
                ),
            }
        };
        let ids = live_ids(tables, limits, li, layer_id, rows, row_ids, n)?;
        let k = ids.len();
        let bytes = k
            .checked_mul(rb)
            .ok_or_else(|| Error::new(EngramStatus::ErrCapacity, "staging size overflows"))?;
        self.start_workers()?;
        let mut st = self.shared.lock();
        // A slot: a free one, else the oldest that no apply holds (after its gather).
        let si = loop {
            let slots = &st.layers[li].slots;
            if let Some(i) = slots.iter().position(|s| s.st == St::Free) {
                break i;
            }
            let oldest = (0..SLOTS)
                .filter(|&i| slots[i].st != St::Taken)
                .min_by_key(|&i| slots[i].gen);
            match oldest {
                Some(i) if slots[i].st == St::Ready => break i,
                _ => st = self.shared.wait(st),
            }
        };
        st.gen += 1;
        let gen = st.gen;
        let slot = &mut st.layers[li].slots[si];
        slot.buf.clear();
        if slot.buf.try_reserve_exact(bytes).is_err() {
            slot.st = St::Free;
            bail!(
                ErrCapacity,
                "out of memory for {bytes} bytes of staged rows"
            );
        }
        slot.buf.resize(bytes, 0);
        slot.ids = ids;
        slot.err = None;
        slot.gen = gen;
        slot.st = St::Gathering;
        let per = k.div_ceil(self.n_workers).max(MIN_ROWS_PER_JOB);
        let n_jobs = k.div_ceil(per).max(1);
        slot.pending = n_jobs;
        let (ids_ptr, dst) = (slot.ids.as_ptr(), slot.buf.as_mut_ptr());
        for j in 0..n_jobs {
            let a = (j * per).min(k);
            let b = ((j + 1) * per).min(k);
            st.queue.push_back(Job {
                layer: li,
                slot: si,
                src: src.clone(),
                rb,
                // SAFETY: a..b lies inside the slot's ids and buf (k ids, k*rb bytes).
                ids: unsafe { ids_ptr.add(a) },
                n: b - a,
                dst: unsafe { dst.add(a * rb) },
            });
        }
        drop(st);
        for _ in 0..n_jobs.min(self.n_workers) {
            self.shared.work.notify_one();
        }
        self.count(|s| s.prefetched += 1);
        Ok(())
    }

    fn count(&self, f: impl FnOnce(&mut Stats)) {
        f(&mut self.stats.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// How the gathers so far were served.
    pub fn stats(&self) -> Stats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn start_workers(&self) -> Result<()> {
        let mut w = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        while w.len() < self.n_workers {
            let sh = self.shared.clone();
            let h = std::thread::Builder::new()
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

    /// Gather and dequantise the rows `ids` of layer `li` into `out` (bf16):
    /// from a staged prefetch of exactly these ids if there is one (waiting
    /// for it), else from the file source with `pread`, else from `table`
    /// directly. The outer error is the gather's (I/O); the inner one names
    /// the position in `ids` of a row that holds NaN data.
    pub fn gather(
        &self,
        li: usize,
        table: &[u8],
        fmt: RowFormat,
        width: usize,
        ids: &[i64],
        out: &mut [u16],
    ) -> Result<std::result::Result<(), (usize, RowDataError)>> {
        let rb = fmt.row_bytes(width);
        let mut st = self.shared.lock();
        loop {
            let found = {
                let slots = &st.layers[li].slots;
                (0..SLOTS)
                    .filter(|&i| {
                        matches!(slots[i].st, St::Gathering | St::Ready) && slots[i].ids[..] == *ids
                    })
                    .min_by_key(|&i| slots[i].gen)
            };
            let Some(si) = found else { break };
            let gen = st.layers[li].slots[si].gen;
            // Jobs of this stage that no worker has started yet run here
            // (no waiting for a thread to wake up), then wait for the rest.
            while let Some(q) = st.queue.iter().position(|j| j.layer == li && j.slot == si) {
                let job = st.queue.remove(q).expect("position is in range");
                drop(st);
                run_job(&self.shared, job, true);
                st = self.shared.lock();
            }
            while st.layers[li].slots[si].st == St::Gathering && st.layers[li].slots[si].gen == gen
            {
                st = self.shared.wait(st);
            }
            let slot = &mut st.layers[li].slots[si];
            if slot.gen != gen || slot.st != St::Ready {
                continue; // reused by a newer prefetch meanwhile: look again
            }
            if let Some(e) = slot.err.take() {
                slot.st = St::Free;
                drop(st);
                self.shared.cv.notify_all();
                return Err(e);
            }
            slot.st = St::Taken;
            let buf = std::mem::take(&mut slot.buf);
            drop(st);
            self.count(|s| s.staged += 1);
            let r = dequant_rows(&buf, fmt, rb, out);
            let mut st = self.shared.lock();
            let slot = &mut st.layers[li].slots[si];
            slot.buf = buf;
            slot.st = St::Free;
            drop(st);
            self.shared.cv.notify_all();
            return Ok(r);
        }
        let src = st.layers[li].source.clone();
        drop(st);
        self.count(|s| s.direct += 1);
        if let Some(src @ Source::File { .. }) = src {
            let mut buf = vec![0u8; ids.len() * rb];
            read_rows(&src, rb, ids, &mut buf)?;
            return Ok(dequant_rows(&buf, fmt, rb, out));
        }
        Ok(crate::cpu::gather_rows(table, fmt, width, ids, out))
    }
}

impl Drop for Stager {
    fn drop(&mut self) {
        {
            let mut st = self.shared.lock();
            st.shutdown = true;
        }
        self.shared.work.notify_all();
        self.shared.cv.notify_all();
        let ws = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in ws {
            let _ = w.join();
        }
    }
}

fn dequant_rows(
    buf: &[u8],
    fmt: RowFormat,
    rb: usize,
    out: &mut [u16],
) -> std::result::Result<(), (usize, RowDataError)> {
    let width = out.len() / (buf.len() / rb).max(1);
    for (j, (row, o)) in buf
        .chunks_exact(rb)
        .zip(out.chunks_exact_mut(width.max(1)))
        .enumerate()
    {
        dequant_row_bf16(fmt, row, o).map_err(|e| (j, e))?;
    }
    Ok(())
}

fn worker(sh: Arc<Shared>) {
    loop {
        let job = {
            let mut st = sh.lock();
            loop {
                if let Some(j) = st.queue.pop_front() {
                    break Some(j);
                }
                if st.shutdown {
                    break None;
                }
                st = sh.work.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(job) = job else { return };
        run_job(&sh, job, true);
    }
}

/// Read one job's rows (after the kernel hints, when `hint`) and report to its slot.
fn run_job(sh: &Shared, job: Job, hint_first: bool) {
    // SAFETY: see `Job`: the slot stays `Gathering` until this job reports.
    let ids = unsafe { std::slice::from_raw_parts(job.ids, job.n) };
    let dst = unsafe { std::slice::from_raw_parts_mut(job.dst, job.n * job.rb) };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if hint_first {
            hint(&job.src, job.rb, ids);
        }
        read_rows(&job.src, job.rb, ids, dst)
    }))
    .unwrap_or_else(|_| {
        Err(Error::new(
            EngramStatus::ErrInternal,
            "a gather thread panicked",
        ))
    });
    let mut st = sh.lock();
    let slot = &mut st.layers[job.layer].slots[job.slot];
    if let Err(e) = r {
        slot.err.get_or_insert(e);
    }
    slot.pending -= 1;
    if slot.pending == 0 {
        slot.st = St::Ready;
    }
    drop(st);
    sh.cv.notify_all();
}

/// Tell the kernel which pages the rows live on, so that it starts reading
/// them in (asynchronously) before the copies fault on them.
fn hint(src: &Source, rb: usize, ids: &[i64]) {
    #[cfg(unix)]
    {
        let page = page_size();
        match src {
            Source::Memory { ptr, len } => {
                for &id in ids {
                    let a = id as usize * rb;
                    if a + rb > *len {
                        continue;
                    }
                    let start = (*ptr as usize + a) & !(page - 1);
                    let end = *ptr as usize + a + rb;
                    // SAFETY: advice only; the range lies in the table's pages.
                    unsafe {
                        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_WILLNEED);
                    }
                }
            }
            Source::File { file, offset, .. } => {
                use std::os::unix::io::AsRawFd;
                for &id in ids {
                    let a = *offset + id as u64 * rb as u64;
                    unsafe {
                        libc::posix_fadvise(
                            file.as_raw_fd(),
                            a as libc::off_t,
                            rb as libc::off_t,
                            libc::POSIX_FADV_WILLNEED,
                        );
                    }
                }
            }
        }
    }
}

#[cfg(unix)]
fn page_size() -> usize {
    static P: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *P.get_or_init(|| {
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 && (p as usize).is_power_of_two() {
            p as usize
        } else {
            4096
        }
    })
}

/// Copy rows `ids` (each `rb` bytes) from `src` into `dst`, back to back.
fn read_rows(src: &Source, rb: usize, ids: &[i64], dst: &mut [u8]) -> Result<()> {
    match src {
        Source::Memory { ptr, len } => {
            for (&id, d) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
                let a = id as usize * rb;
                assert!(a + rb <= *len, "row {id} checked against the table");
                // SAFETY: the row lies inside the borrowed table.
                unsafe { std::ptr::copy_nonoverlapping(ptr.add(a), d.as_mut_ptr(), rb) };
            }
            Ok(())
        }
        Source::File { file, offset, len } => {
            #[cfg(unix)]
            {
                use std::os::unix::fs::FileExt;
                for (&id, d) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
                    let a = id as u64 * rb as u64;
                    debug_assert!(a + rb as u64 <= *len);
                    file.read_exact_at(d, offset + a).map_err(|e| {
                        Error::new(
                            EngramStatus::ErrIo,
                            format!(
                                "reading table row {id} ({rb} bytes at file offset {}): {e}",
                                offset + a
                            ),
                        )
                    })?;
                }
                Ok(())
            }
            #[cfg(not(unix))]
            {
                let _ = (file, offset, len, ids, dst);
                bail!(ErrUnsupported, "file-backed tables need a unix system")
            }
        }
    }
}

/// The live tokens' row ids of layer `li` (as `apply` computes them), checked.
pub fn live_ids(
    tables: &HashTables,
    limits: &Limits,
    li: usize,
    layer_id: u32,
    rows: u64,
    row_ids: &[i64],
    n: usize,
) -> Result<Vec<i64>> {
    if n > limits.max_tokens {
        bail!(
            ErrCapacity,
            "{n} tokens in one call, the context was created for at most {}",
            limits.max_tokens
        );
    }
    let (cols, per) = (tables.cols(), tables.n_layers() * tables.cols());
    if row_ids.len() != n * per {
        bail!(
            ErrInvalidArgument,
            "{} row ids for {n} tokens, expected {} ([n, n_layers, C])",
            row_ids.len(),
            n * per
        );
    }
    let mut ids = Vec::with_capacity(n * cols);
    for t in 0..n {
        let tid = &row_ids[t * per + li * cols..t * per + (li + 1) * cols];
        if tid.iter().all(|&r| r == ROW_ID_DEAD) {
            continue;
        }
        for (c, &r) in tid.iter().enumerate() {
            if r == ROW_ID_DEAD {
                bail!(
                    ErrInvalidRowId,
                    "token {t}, layer {layer_id}: column {c} is ENGRAM_ROW_ID_DEAD (-1) but other columns are not; \
                     a dead token has -1 in every column"
                );
            }
            if r < 0 || r as u64 >= rows {
                bail!(
                    ErrInvalidRowId,
                    "token {t}, layer {layer_id}, column {c}: row id {r} outside the table [0, {rows})"
                );
            }
        }
        ids.extend_from_slice(tid);
    }
    Ok(ids)
}
