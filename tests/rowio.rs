//! The direct, batched row reader (`engram::rowio`): every mode gives the
//! bytes a plain `read_exact_at` gives, for random row sets with duplicates,
//! rows sharing and straddling blocks, the first and the last row, a table
//! at an unaligned offset in a file that ends inside a block; a file on
//! tmpfs is read buffered, reported; a file cut short after open is
//! `ErrIo` naming the row; many threads read at once.

use engram::rowio::probe::Rng;
use engram::rowio::{Force, ReadMode, ReaderOptions, RowRead, RowReader};
use engram::EngramStatus;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

/// A file of random bytes under the target directory (a real disk file
/// system, where direct I/O is possible), removed when dropped.
struct TempFile {
    path: PathBuf,
    file: Arc<File>,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn temp_file(dir: PathBuf, name: &str, len: u64, seed: u64) -> TempFile {
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("rowio-{name}-{}", std::process::id()));
    let mut rng = Rng(seed);
    let bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let file = Arc::new(File::open(&path).unwrap());
    TempFile { path, file }
}

fn disk_dir() -> PathBuf {
    let t = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"),
        PathBuf::from,
    );
    t.join("rowio-tests")
}

/// Table geometry: 264-byte rows from byte 300 of the file, and a file that
/// ends 100 bytes after the last row (inside a 512-byte block).
const RB: usize = 264;
const BASE: u64 = 300;
const ROWS: u64 = 5000;

fn disk_table(name: &str) -> TempFile {
    temp_file(disk_dir(), name, BASE + ROWS * RB as u64 + 100, 7)
}

fn opts(force: Force) -> ReaderOptions {
    ReaderOptions {
        force,
        depth: 8,
        threads: 4,
    }
}

/// A reader in `force`'s mode, or `None` (with the reason printed) when this
/// machine does not allow it.
fn reader(t: &TempFile, force: Force) -> Option<RowReader> {
    let r = RowReader::open_with(&t.file, BASE, ROWS * RB as u64, opts(force)).unwrap();
    let ok = matches!(
        (force, r.mode()),
        (Force::Uring, ReadMode::IoUring { .. })
            | (Force::Pool, ReadMode::PreadvPool { .. })
            | (Force::Buffered, ReadMode::Buffered { .. })
    );
    if !ok {
        println!("skipping {force:?} here: the reader chose {}", r.mode());
        return None;
    }
    Some(r)
}

/// Row indices: random ones, duplicates, neighbours (sharing a block),
/// the first and the last row.
fn row_set(rng: &mut Rng, n: usize) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).map(|_| rng.below(ROWS)).collect();
    if n >= 4 {
        v[0] = 0;
        v[1] = ROWS - 1;
        v[2] = v[3];
        v.push((v[3] + 1).min(ROWS - 1));
    }
    v
}

/// Read `rows` through `r` and compare with `read_exact_at`.
fn check_rows(r: &RowReader, file: &File, rows: &[u64]) {
    let mut got = vec![0xAAu8; rows.len() * RB];
    let mut reqs: Vec<RowRead<'_>> = rows
        .iter()
        .zip(got.chunks_mut(RB))
        .map(|(&i, dst)| RowRead {
            offset: i * RB as u64,
            dst,
        })
        .collect();
    let c = r.read(&mut reqs).unwrap();
    assert_eq!(c.rows, rows.len() as u64);
    assert!(c.reads_issued >= 1 && c.reads_issued <= rows.len() as u64 + 1);
    assert_eq!(c.latency.count(), c.reads_issued);
    drop(reqs);
    let mut want = vec![0u8; RB];
    for (k, &i) in rows.iter().enumerate() {
        file.read_exact_at(&mut want, BASE + i * RB as u64).unwrap();
        assert!(
            got[k * RB..(k + 1) * RB] == want[..],
            "row {i} ({} of {} in the call) differs in mode {}",
            k,
            rows.len(),
            r.mode()
        );
    }
}

fn every_row_set_reads_back(force: Force) {
    let t = disk_table(&format!("{force:?}"));
    let Some(r) = reader(&t, force) else { return };
    println!("mode: {}", r.mode());
    let mut rng = Rng(11);
    for n in [1, 2, 3, 24, 48, 192, 1536] {
        for _ in 0..3 {
            check_rows(&r, &t.file, &row_set(&mut rng, n));
        }
    }
    // Every row once, in order: rows merged into reads of many blocks.
    let all: Vec<u64> = (0..ROWS).collect();
    check_rows(&r, &t.file, &all);
}

#[test]
fn io_uring_reads_the_rows_read_exact_at_reads() {
    every_row_set_reads_back(Force::Uring);
}

#[test]
fn the_pread_pool_reads_the_rows_read_exact_at_reads() {
    every_row_set_reads_back(Force::Pool);
}

#[test]
fn buffered_reads_read_the_rows_read_exact_at_reads() {
    every_row_set_reads_back(Force::Buffered);
}

#[test]
fn direct_modes_read_whole_blocks() {
    let t = disk_table("blocks");
    for force in [Force::Uring, Force::Pool] {
        let Some(r) = reader(&t, force) else { continue };
        assert!(
            r.block().is_power_of_two() && r.block() >= 512,
            "{}",
            r.block()
        );
        // Row 1 is bytes 564..828 of the file: one 512-byte block; row 0
        // (300..564) straddles two. Both: blocks 0..2, one read.
        let (mut a, mut b) = ([0u8; RB], [0u8; RB]);
        let mut reqs = [
            RowRead {
                offset: RB as u64,
                dst: &mut a,
            },
            RowRead {
                offset: 0,
                dst: &mut b,
            },
        ];
        let c = r.read(&mut reqs).unwrap();
        assert_eq!(c.reads_issued, 1, "{}", r.mode());
        assert_eq!(c.bytes_read % r.block(), 0);
        assert!(c.bytes_read <= 2 * r.block().max(512));
        // Rows 3 and 40 (file bytes 1092..1356 and 10860..11124) share no
        // block and their blocks do not touch: two reads.
        let mut reqs = [
            RowRead {
                offset: 40 * RB as u64,
                dst: &mut a,
            },
            RowRead {
                offset: 3 * RB as u64,
                dst: &mut b,
            },
        ];
        let c = r.read(&mut reqs).unwrap();
        assert_eq!(c.reads_issued, 2, "{}", r.mode());
    }
}

#[test]
fn a_file_on_tmpfs_is_read_buffered_and_says_so() {
    let shm = PathBuf::from("/dev/shm");
    if !shm.is_dir() {
        println!("skipping: no /dev/shm here");
        return;
    }
    let t = temp_file(shm, "tmpfs", BASE + ROWS * RB as u64 + 100, 9);
    for force in [Force::Auto, Force::Uring, Force::Pool] {
        let r = RowReader::open_with(&t.file, BASE, ROWS * RB as u64, opts(force)).unwrap();
        match r.mode() {
            ReadMode::Buffered { why } => assert!(why.contains("tmpfs"), "{why}"),
            m => panic!("a file on tmpfs read as {m}"),
        }
        assert!(r.mode().to_string().starts_with("buffered pread"));
        let mut rng = Rng(3);
        check_rows(&r, &t.file, &row_set(&mut rng, 100));
    }
}

#[test]
fn a_file_cut_short_after_open_is_err_io_naming_the_row() {
    for force in [Force::Uring, Force::Pool, Force::Buffered] {
        let t = disk_table(&format!("cut-{force:?}"));
        let Some(r) = reader(&t, force) else { continue };
        // Cut the file inside row 1000 (and inside a block).
        let cut = BASE + 1000 * RB as u64 + 100;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&t.path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let mut rng = Rng(5);
        check_rows(&r, &t.file, &(0..999).collect::<Vec<_>>());
        for rows in [
            vec![1000u64],
            vec![4000],
            vec![3, 1000, 2000],
            (990..1010).collect(),
        ] {
            let mut d = vec![0u8; rows.len() * RB];
            let mut reqs: Vec<RowRead<'_>> = rows
                .iter()
                .zip(d.chunks_mut(RB))
                .map(|(&i, dst)| RowRead {
                    offset: i * RB as u64,
                    dst,
                })
                .collect();
            let e = r.read(&mut reqs).unwrap_err();
            assert_eq!(e.status, EngramStatus::ErrIo, "{e}");
            let first_cut = rows.iter().copied().find(|&i| i >= 1000).unwrap();
            let named = format!("row at byte {} of the table", first_cut * RB as u64);
            assert!(e.message.contains(&named), "{} / {e}", r.mode());
        }
        // The reader still works for rows the file holds.
        check_rows(
            &r,
            &t.file,
            &row_set(&mut rng, 3)
                .iter()
                .map(|i| i % 999)
                .collect::<Vec<_>>(),
        );
    }
}

#[test]
fn many_threads_read_at_once() {
    let t = disk_table("threads");
    for force in [Force::Uring, Force::Pool, Force::Buffered] {
        let Some(r) = reader(&t, force) else { continue };
        std::thread::scope(|s| {
            for k in 0..8u64 {
                let (r, file) = (&r, &t.file);
                s.spawn(move || {
                    let mut rng = Rng(100 + k);
                    for i in 0..40 {
                        let n = [1, 24, 48, 300][i % 4];
                        check_rows(r, file, &row_set(&mut rng, n));
                    }
                });
            }
        });
    }
}

#[test]
fn rows_outside_the_table_are_refused_before_any_read() {
    let t = disk_table("outside");
    let r = RowReader::open_with(&t.file, BASE, ROWS * RB as u64, opts(Force::Auto)).unwrap();
    let mut d = [0u8; RB];
    let mut reqs = [RowRead {
        offset: (ROWS - 1) * RB as u64 + 1,
        dst: &mut d,
    }];
    let e = r.read(&mut reqs).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{e}");
    // A table the file does not hold is refused at open.
    let len = t.file.metadata().unwrap().len();
    let e = RowReader::open_with(&t.file, 1, len, opts(Force::Auto))
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrIo, "{e}");
    // No rows: nothing read.
    let c = r.read(&mut []).unwrap();
    assert_eq!((c.rows, c.reads_issued), (0, 0));
}

#[test]
fn engram_row_io_forces_a_mode() {
    // The only test that touches the variable (the others pass options).
    std::env::set_var("ENGRAM_ROW_IO", "bogus");
    let e = ReaderOptions::from_env().unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidConfig);
    for (v, f) in [
        ("uring", Force::Uring),
        ("pool", Force::Pool),
        ("buffered", Force::Buffered),
    ] {
        std::env::set_var("ENGRAM_ROW_IO", v);
        assert_eq!(ReaderOptions::from_env().unwrap().force, f);
    }
    let t = disk_table("env");
    std::env::set_var("ENGRAM_ROW_IO", "buffered");
    let r = RowReader::open(&t.file, BASE, ROWS * RB as u64).unwrap();
    assert!(
        matches!(r.mode(), ReadMode::Buffered { .. }),
        "{}",
        r.mode()
    );
    std::env::remove_var("ENGRAM_ROW_IO");
    assert_eq!(ReaderOptions::from_env().unwrap().force, Force::Auto);
}
