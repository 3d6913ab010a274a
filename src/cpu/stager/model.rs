//! The stager's protocol under loom (`cargo test --lib --features
//! loom-model cpu::stager::model`): the real `Stager` on loom's mutexes,
//! condition variables, `Arc`s and threads (`super::sync`), over a table
//! whose reads and whose freeing loom tracks as accesses to one cell, so a
//! read that is not ordered before the engine frees the table is a causality
//! violation, in every interleaving loom explores.

use super::*;
use loom::cell::UnsafeCell;

/// bf16 rows of one value each (`Hd = 1`).
pub struct Table {
    rows: UnsafeCell<Vec<u16>>,
}

// SAFETY: shared across the model's threads on purpose: every access goes
// through loom's cell, which reports any that are not ordered.
unsafe impl Sync for Table {}

impl Table {
    pub fn new(rows: usize, value: u16) -> std::sync::Arc<Table> {
        std::sync::Arc::new(Table {
            rows: UnsafeCell::new(vec![value; rows]),
        })
    }

    /// Copy rows `ids` into `dst` (rows of `rb` = 2 bytes).
    pub fn read(&self, rb: usize, ids: &[i64], dst: &mut [u8]) {
        self.rows.with(|p| {
            // SAFETY: loom checks that no `free` runs concurrently.
            let rows = unsafe { &*p };
            for (&id, d) in ids.iter().zip(dst.chunks_exact_mut(rb)) {
                d.copy_from_slice(&rows[id as usize].to_le_bytes());
            }
        })
    }

    /// The engine frees the table (and the memory is reused).
    pub fn free(&self) {
        // SAFETY: loom checks that no read runs concurrently.
        self.rows.with_mut(|p| unsafe { (*p).fill(FREED) })
    }
}

const ROWS: usize = 4;
/// bf16 1.0 and 2.0: every row of table A, of table B.
const A: u16 = 0x3F80;
const B: u16 = 0x4000;
/// What a freed table holds.
const FREED: u16 = 0x7F80;

fn set(s: &Stager, t: &std::sync::Arc<Table>) -> u64 {
    s.set_source(0, Source::Model(t.clone()), EngramType::Bf16, 2)
        .expect("no cache for a model table")
}

fn gather(s: &Stager, gen: u64, ids: &[i64]) -> Vec<u16> {
    let mut out = vec![0u16; ids.len()];
    s.gather(0, gen, 1, ids, &mut out)
        .expect("no I/O error")
        .expect("valid rows");
    out
}

fn check(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    // Every interleaving with up to three preemptions (the bugs this
    // protocol had need one or two).
    b.preemption_bound = Some(3);
    b.check(f);
}

/// The stager on its own (no context lock around it): a prefetch and an
/// apply of table A race `set_source(B)`, after which the engine frees A
/// and applies B. No read of A may follow `set_source`'s return; every
/// gather sees one table whole; the apply after it sees B.
#[test]
fn set_source_waits_for_every_reader_of_the_old_table() {
    check(|| {
        let (a, b) = (Table::new(ROWS, A), Table::new(ROWS, B));
        let s = Arc::new(Stager::new(1, 1).unwrap());
        let gen_a = set(&s, &a);
        let s1 = s.clone();
        let t = thread::spawn(move || {
            let ids = [1i64, 3];
            s1.stage(0, &ids).unwrap();
            let got = gather(&s1, gen_a, &ids);
            assert!(
                got == [A, A] || got == [B, B],
                "mixed or freed rows: {got:x?}"
            );
        });
        let gen_b = set(&s, &b);
        a.free();
        assert_eq!(gather(&s, gen_b, &[0, 2]), [B, B]);
        t.join().unwrap();
    });
}

/// An apply without a prefetch reads the table directly; racing
/// `set_source(B)` (no context lock around them), it reads one table
/// whole and lets go of A before `set_source` returns.
#[test]
fn a_direct_gather_races_set_source() {
    check(|| {
        let (a, b) = (Table::new(ROWS, A), Table::new(ROWS, B));
        let s = Arc::new(Stager::new(1, 1).unwrap());
        let gen_a = set(&s, &a);
        let s1 = s.clone();
        let t = thread::spawn(move || {
            let got = gather(&s1, gen_a, &[3, 1]);
            assert!(
                got == [A, A] || got == [B, B],
                "mixed or freed rows: {got:x?}"
            );
        });
        set(&s, &b);
        a.free();
        t.join().unwrap();
    });
}

/// As the context runs it: `prefetch` and `apply` hold the layer lock
/// for reading (the apply reads its generation under it), `set_layer`
/// for writing. An apply sees exactly the table of the generation it
/// read, whether its rows came from the prefetch or not.
#[test]
fn an_apply_uses_the_rows_of_its_generation() {
    check(|| {
        let (a, b) = (Table::new(ROWS, A), Table::new(ROWS, B));
        let s = Arc::new(Stager::new(1, 1).unwrap());
        let gen_a = set(&s, &a);
        let layer = Arc::new(loom::sync::RwLock::new((gen_a, A)));
        let (s1, l1) = (s.clone(), layer.clone());
        let t = thread::spawn(move || {
            let ids = [2i64, 0];
            {
                let _g = l1.read().unwrap();
                s1.stage(0, &ids).unwrap();
            }
            let g = l1.read().unwrap();
            let (gen, v) = *g;
            assert_eq!(gather(&s1, gen, &ids), [v, v]);
        });
        {
            let mut g = layer.write().unwrap();
            *g = (set(&s, &b), B);
        }
        a.free();
        t.join().unwrap();
    });
}

/// Two prefetches in flight on one layer's two slots, applied in either
/// order while the worker gathers: each apply gets its own rows.
#[test]
fn two_prefetches_share_the_slots() {
    check(|| {
        let t = Table::new(ROWS, A);
        t.rows.with_mut(|p| {
            // SAFETY: no other thread exists yet.
            let rows = unsafe { &mut *p };
            for (i, r) in rows.iter_mut().enumerate() {
                *r = A + i as u16;
            }
        });
        let s = Arc::new(Stager::new(1, 1).unwrap());
        let gen = set(&s, &t);
        let s1 = s.clone();
        let th = thread::spawn(move || {
            s1.stage(0, &[3]).unwrap();
            assert_eq!(gather(&s1, gen, &[3]), [A + 3]);
        });
        s.stage(0, &[1]).unwrap();
        assert_eq!(gather(&s, gen, &[1]), [A + 1]);
        th.join().unwrap();
    });
}

/// Freeing the context (dropping the stager) with a gather queued or
/// running: the drop joins the workers, so the engine may free the table
/// once it returns.
#[test]
fn drop_joins_the_workers_before_the_table_is_freed() {
    check(|| {
        let a = Table::new(ROWS, A);
        let s = Stager::new(1, 1).unwrap();
        set(&s, &a);
        s.stage(0, &[0, 1, 2, 3]).unwrap();
        drop(s);
        a.free();
    });
}

/// In-place memory of the model (rows of 2 bytes) whose accesses loom
/// tracks: the stager's writes (marked when it asks for the rows) and the
/// "device copy" an apply queues from it (a thread of its own), which sets
/// the fence that `wait_idle` waits for when it has run.
struct ModelMem {
    bytes: std::cell::UnsafeCell<[u8; 2 * ROWS]>,
    /// One access per use: the stager's writes, the copy's read.
    track: UnsafeCell<()>,
    /// Whether no copy from it is still to run.
    idle: loom::sync::Mutex<bool>,
    idle_cv: loom::sync::Condvar,
}

// SAFETY: loom runs one thread at a time and checks, through `track`, that
// the stager's writes and the copy's reads are ordered.
unsafe impl Sync for ModelMem {}
// SAFETY: sending it moves only what it owns: its bytes, the loom cell that
// tracks accesses to them, loom's mutex and condvar; no pointer into another
// thread's data. Accesses from several threads are ordered as for `Sync`.
unsafe impl Send for ModelMem {}

// SAFETY: `bytes` lives as long as the value; `track` makes loom report a
// write that is not ordered after the last copy's read.
unsafe impl InPlace for ModelMem {
    fn rows(&self) -> (*mut u8, usize) {
        // The caller writes the rows now.
        self.track.with_mut(|_| ());
        (self.bytes.get() as *mut u8, 2 * ROWS)
    }

    fn rows_len(&self) -> usize {
        2 * ROWS
    }

    fn wait_idle(&self) -> Result<()> {
        let mut g = self.idle.lock().unwrap();
        while !*g {
            g = self.idle_cv.wait(g).unwrap();
        }
        Ok(())
    }
}

impl ModelMem {
    fn new() -> std::sync::Arc<ModelMem> {
        std::sync::Arc::new(ModelMem {
            bytes: std::cell::UnsafeCell::new([0; 2 * ROWS]),
            track: UnsafeCell::new(()),
            idle: loom::sync::Mutex::new(true),
            idle_cv: loom::sync::Condvar::new(),
        })
    }

    /// Queue the "device copy" of the row at cell `c`: a thread that reads
    /// it, then marks the memory idle. Returns the thread (its value: the row).
    fn copy_later(self: &std::sync::Arc<Self>, c: usize) -> thread::JoinHandle<u16> {
        *self.idle.lock().unwrap() = false;
        let m = self.clone();
        thread::spawn(move || {
            let v = m.track.with(|_| {
                // SAFETY: loom checks (through `track`) that no write is
                // concurrent with this read.
                let b = unsafe { &*m.bytes.get() };
                u16::from_le_bytes([b[2 * c], b[2 * c + 1]])
            });
            *m.idle.lock().unwrap() = true;
            m.idle_cv.notify_all();
            v
        })
    }
}

/// A layer with in-place memory (the CUDA backend's pinned staging): an
/// apply served from a slot queues a copy from its memory and returns; the
/// next prefetch into that slot must not write before the copy has read it
/// (its gather waits for the fence), and the copy reads the apply's rows.
#[test]
fn a_gather_in_place_waits_for_the_copy_queued_from_its_memory() {
    check(|| {
        let t = Table::new(ROWS, A);
        t.rows.with_mut(|p| {
            // SAFETY: no other thread exists yet.
            let rows = unsafe { &mut *p };
            for (i, r) in rows.iter_mut().enumerate() {
                *r = A + i as u16;
            }
        });
        let mem = [ModelMem::new(), ModelMem::new()];
        let s = Stager::new(1, 1).unwrap();
        let gen = s
            .set_source_in_place(
                0,
                Source::Model(t.clone()),
                EngramType::Bf16,
                2,
                mem.iter()
                    .map(|m| m.clone() as std::sync::Arc<dyn InPlace>)
                    .collect(),
            )
            .unwrap();
        let serve = |ids: &[i64]| {
            s.serve_in_place(
                0,
                gen,
                ids,
                &[0],
                1,
                |si| Ok(mem[si].copy_later(0)),
                |_| panic!("not served from the prefetch"),
            )
            .unwrap()
        };
        s.stage_at(0, &[1], &[0], 1).unwrap();
        let first = serve(&[1]);
        // The same slot (both are free; the first is taken), written while
        // the first copy may not have run yet.
        s.stage_at(0, &[2], &[0], 1).unwrap();
        let second = serve(&[2]);
        assert_eq!(first.join().unwrap(), A + 1);
        assert_eq!(second.join().unwrap(), A + 2);
    });
}
