//! The table file: one V4.1 layer's rows as Q2_K blocks, generated from a
//! seed (valid blocks: finite f16 scales), behind a 4 KiB header that names
//! the seed and the geometry; the page-cache controls (drop, residency, the
//! bytes this process read from storage). The disk probe is
//! `engram::rowio::probe`'s.

use engram::formats::ggml::BlockQ2K;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::time::Instant;

/// Bytes of a Q2_K row (one 256-value block).
pub const RB: usize = std::mem::size_of::<BlockQ2K>();
/// Where the table starts in the file (a header of this size before it).
pub const HEADER: u64 = 4096;
const MAGIC: &[u8; 16] = b"engram-tiers-q2k";
/// The content seed.
pub const SEED: u64 = 0x7e4a_11ce_0035_0006;

pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// Row `r`'s bytes: random scales and codes, `d` and `dmin` positive f16
/// below 2 (exponent field at most 15: finite, never NaN or infinite).
pub fn gen_row(r: u64, out: &mut [u8]) {
    let mut s = mix64(SEED ^ r.wrapping_mul(0x2545_f491_4f6c_dd1d));
    for c in out.chunks_mut(8) {
        s = mix64(s);
        c.copy_from_slice(&s.to_le_bytes()[..c.len()]);
    }
    for at in [BlockQ2K::D, BlockQ2K::DMIN] {
        let v = u16::from_le_bytes([out[at], out[at + 1]]) & 0x3fff;
        out[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }
}

fn header(rows: u64) -> Vec<u8> {
    let mut h = vec![0u8; HEADER as usize];
    h[..16].copy_from_slice(MAGIC);
    h[16..24].copy_from_slice(&SEED.to_le_bytes());
    h[24..32].copy_from_slice(&rows.to_le_bytes());
    h[32..40].copy_from_slice(&(RB as u64).to_le_bytes());
    h
}

pub fn file_len(rows: u64) -> u64 {
    HEADER + rows * RB as u64
}

/// The file if it is this table: its size, its header, and 256 rows spread
/// over it equal to the generator's.
fn check(path: &Path, rows: u64) -> Option<File> {
    let f = File::open(path).ok()?;
    if f.metadata().ok()?.len() != file_len(rows) {
        return None;
    }
    let mut h = vec![0u8; HEADER as usize];
    f.read_exact_at(&mut h, 0).ok()?;
    if h != header(rows) {
        return None;
    }
    let (mut got, mut want) = ([0u8; RB], [0u8; RB]);
    for i in 0..256u64 {
        let r = mix64(i) % rows;
        f.read_exact_at(&mut got, HEADER + r * RB as u64).ok()?;
        gen_row(r, &mut want);
        if got != want {
            return None;
        }
    }
    Some(f)
}

/// Free bytes on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: statvfs writes one struct into the zeroed value it is given; `c` is a valid C string.
    let st = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut st) != 0 {
            return 0;
        }
        st
    };
    st.f_bavail as u64 * st.f_frsize as u64
}

/// Open the table file, writing it first if it is absent or not this table.
/// Exits (status 2) when the disk lacks the file's size plus 4 GiB.
pub fn open_or_create(path: &Path, rows: u64) -> File {
    if let Some(f) = check(path, rows) {
        eprintln!(
            "reusing {} ({} rows, header and 256 rows checked)",
            path.display(),
            rows
        );
        return f;
    }
    let dir = path.parent().unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let _ = std::fs::remove_file(path);
    let need = file_len(rows) + (4u64 << 30);
    let free = free_bytes(dir);
    if free < need {
        eprintln!(
            "tiers: {} needs {:.2} GiB free (the file {:.2} GiB + 4 GiB); {:.2} GiB are: {:.2} GiB missing",
            dir.display(),
            need as f64 / (1u64 << 30) as f64,
            file_len(rows) as f64 / (1u64 << 30) as f64,
            free as f64 / (1u64 << 30) as f64,
            (need - free) as f64 / (1u64 << 30) as f64
        );
        std::process::exit(2);
    }
    write(path, rows);
    check(path, rows).expect("the table file just written reads back")
}

fn write(path: &Path, rows: u64) {
    eprintln!(
        "writing {} ({:.2} GB) ...",
        path.display(),
        file_len(rows) as f64 / 1e9
    );
    let t = Instant::now();
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap();
    f.set_len(file_len(rows)).unwrap();
    f.write_all_at(&header(rows), 0).unwrap();
    const CHUNK: u64 = 1 << 17; // rows a job
    let next = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut buf = vec![0u8; CHUNK as usize * RB];
                loop {
                    let r0 = next.fetch_add(CHUNK, std::sync::atomic::Ordering::Relaxed);
                    if r0 >= rows {
                        break;
                    }
                    let n = CHUNK.min(rows - r0) as usize;
                    for (i, row) in buf[..n * RB].chunks_exact_mut(RB).enumerate() {
                        gen_row(r0 + i as u64, row);
                    }
                    f.write_all_at(&buf[..n * RB], HEADER + r0 * RB as u64)
                        .unwrap();
                }
            });
        }
    });
    f.sync_all().unwrap();
    drop_cache(&f);
    eprintln!(
        "  {:.1} s ({:.2} GB/s)",
        t.elapsed().as_secs_f64(),
        file_len(rows) as f64 / 1e9 / t.elapsed().as_secs_f64()
    );
    let _ = std::io::stderr().flush();
}

/// Drop the file's pages from the page cache (a process that maps them
/// must unmap them first: [`drop_map`]).
pub fn drop_cache(f: &File) {
    // SAFETY: advice on an open descriptor; no memory is touched.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// Let go of this process's pages of the mapping `m` (so the page cache can drop them).
pub fn drop_map(m: &[u8]) {
    // SAFETY: advice on this process's own read-only file mapping; its pages read back from the file.
    unsafe {
        libc::madvise(
            m.as_ptr() as *mut libc::c_void,
            m.len(),
            libc::MADV_DONTNEED,
        );
    }
}

/// Fraction of the file's pages in the page cache (`mincore` over a fresh mapping).
pub fn cached_fraction(f: &File) -> f64 {
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: a read-only mapping of the bench's own file, only passed to mincore.
    let m = unsafe { memmap2::Mmap::map(f) }.unwrap();
    let n = len.div_ceil(4096);
    let mut v = vec![0u8; n];
    // SAFETY: mincore writes one byte per page of the mapping into `v`, which has that many.
    let r = unsafe { libc::mincore(m.as_ptr() as *mut libc::c_void, len, v.as_mut_ptr()) };
    assert_eq!(r, 0, "mincore");
    v.iter().filter(|&&b| b & 1 == 1).count() as f64 / n as f64
}

/// Bytes this process read from storage so far (`/proc/self/io` read_bytes).
pub fn read_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("read_bytes:"))
                .and_then(|l| l[11..].trim().parse().ok())
        })
        .unwrap_or(0)
}
