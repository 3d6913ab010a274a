//! Model files under a memory limit (issue 21.2, 21.3): this binary's global
//! allocator refuses any allocation that would take the live heap past a
//! limit, as `RLIMIT_AS` would. Under a limit at which the normal files open
//! (the tiny checkpoint with the real V4.1 tokenizer), a file whose counts or
//! JSON would need more must give a status; an allocation that cannot fail
//! aborts the process instead, which fails this test.
//!
//! The tests share the allocator's limit, so they run one at a time.

mod common;

use common::*;
use engram::gguf::{GgufModel, LoadOptions};
use engram::EngramStatus;
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex;

struct Limited;

/// Live heap bytes, and the limit (0: none).
static LIVE: AtomicUsize = AtomicUsize::new(0);
static LIMIT: AtomicUsize = AtomicUsize::new(0);

fn admit(size: usize) -> bool {
    let limit = LIMIT.load(SeqCst);
    let live = LIVE.fetch_add(size, SeqCst);
    if limit != 0 && live.saturating_add(size) > limit {
        LIVE.fetch_sub(size, SeqCst);
        return false;
    }
    true
}

// SAFETY: forwards to the system allocator, or returns null (an allocation
// failure, which every caller must handle) without touching memory; the
// counter follows the sizes the callers pass.
unsafe impl GlobalAlloc for Limited {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if !admit(l.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: the caller's layout, passed on.
        let p = unsafe { System.alloc(l) };
        if p.is_null() {
            LIVE.fetch_sub(l.size(), SeqCst);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if !admit(l.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(l) };
        if p.is_null() {
            LIVE.fetch_sub(l.size(), SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), SeqCst);
        // SAFETY: `p` came from `System` with this layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > l.size() && !admit(new - l.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: as `dealloc`, with the caller's new size.
        let q = unsafe { System.realloc(p, l, new) };
        if q.is_null() {
            if new > l.size() {
                LIVE.fetch_sub(new - l.size(), SeqCst);
            }
        } else if new < l.size() {
            LIVE.fetch_sub(l.size() - new, SeqCst);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Limited = Limited;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Run `f` with at most `limit` more heap bytes than are live now.
fn limited<T>(limit: usize, f: impl FnOnce() -> T) -> T {
    LIMIT.store(LIVE.load(SeqCst) + limit, SeqCst);
    let r = f();
    LIMIT.store(0, SeqCst);
    r
}

const MIB: usize = 1 << 20;

fn scratch(tag: &str) -> PathBuf {
    scratch_dir("egfm", tag)
}

/// A copy of the tiny checkpoint with the real V4.1 tokenizer (6 MB).
fn checkpoint(d: &Path) -> PathBuf {
    let ck = d.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    for e in std::fs::read_dir(golden_dir().join("dialects/checkpoint")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
    }
    std::fs::copy(
        golden_dir().join("deepseek_v4_tokenizer.json"),
        ck.join("tokenizer.json"),
    )
    .unwrap();
    ck
}

/// The limit of these tests: the normal files open under it.
const LIMIT_MIB: usize = 400;

#[test]
fn the_normal_files_open_under_the_limit() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let d = scratch("normal");
    let ck = checkpoint(&d);
    limited(LIMIT_MIB * MIB, || {
        GgufModel::open_checkpoint(&ck, None, &LoadOptions::default()).unwrap();
    });
    std::fs::remove_dir_all(&d).unwrap();
}

/// A 30 MB safetensors header of minimal tensor entries: a tree of JSON
/// values for it took about 27 bytes per byte (810 MB, past the limit: the
/// process aborted); the streaming parse keeps about 7.
#[test]
fn a_big_safetensors_header_is_a_status() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let d = scratch("st");
    let p = d.join("big.safetensors");
    {
        let mut j = String::from("{");
        let mut i = 0u64;
        while j.len() < 30 * MIB {
            j.push_str(&format!(
                "\"{i:x}\":{{\"dtype\":\"U8\",\"shape\":[],\"data_offsets\":[0,1]}},"
            ));
            i += 1;
        }
        j.pop();
        j.push('}');
        let mut b = (j.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(j.as_bytes());
        b.push(0);
        std::fs::write(&p, b).unwrap();
    }
    let f = std::fs::File::open(&p).unwrap();
    let len = f.metadata().unwrap().len();
    let r = limited(LIMIT_MIB * MIB, || {
        engram::safetensors::parse_header(&f, len, "big.safetensors").map(|h| h.tensors.len())
    });
    match r {
        Ok(n) => assert!(n > 500_000, "{n} tensors"),
        Err(e) => assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message),
    }
    // Under a limit that cannot hold them: a status naming what ran out.
    let e = limited(64 * MIB, || {
        engram::safetensors::parse_header(&f, len, "big.safetensors")
            .err()
            .unwrap()
    });
    assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A 40 MB tokenizer.json (the V4.1 one with its vocabulary grown): the
/// tokenizers library's parse takes about 15 bytes per byte of it (600 MB,
/// past the limit: it aborted); its worst case is now reserved fallibly
/// first, and the file is a status.
#[test]
fn a_big_tokenizer_json_is_a_status() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let d = scratch("tok");
    let p = d.join("tokenizer.json");
    {
        let t = std::fs::read_to_string(golden_dir().join("deepseek_v4_tokenizer.json")).unwrap();
        let v = t.find("\"vocab\"").unwrap();
        let at = v + t[v..].find('{').unwrap() + 1;
        let mut extra = String::new();
        let mut id = 129_280u64;
        while extra.len() < 36 * MIB {
            extra.push_str(&format!("\"zz{id}\":{id},"));
            id += 1;
        }
        let mut out = String::with_capacity(t.len() + extra.len());
        out.push_str(&t[..at]);
        out.push_str(&extra);
        out.push_str(&t[at..]);
        std::fs::write(&p, out).unwrap();
    }
    let e = limited(LIMIT_MIB * MIB, || {
        engram::tables::tokenizer::load(&p).err().unwrap()
    });
    assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message);
    assert!(e.message.contains("tokenizer"), "{}", e.message);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A 15 MB config.json (a long array beside the engram fields): as JSON
/// values about 16 bytes per byte (250 MB, past a 64 MiB limit: it aborted).
/// Now: more than the 1 MiB read, or, under that, its worst case reserved
/// fallibly first.
#[test]
fn a_big_config_json_is_a_status() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let d = scratch("cfg");
    let base = std::fs::read_to_string(golden_dir().join("v41_config.json")).unwrap();
    let with_junk = |n: usize| {
        let zeros = vec!["0"; n].join(",");
        format!("{{\"junk\":[{zeros}],{}", &base.trim_start()[1..])
    };
    let p = d.join("config.json");
    std::fs::write(&p, with_junk(7_500_000)).unwrap();
    let e = limited(64 * MIB, || {
        engram::tables::EngramConfig::from_file(&p).err().unwrap()
    });
    assert!(
        matches!(e.status, EngramStatus::ErrIo | EngramStatus::ErrCapacity),
        "{:?}: {}",
        e.status,
        e.message
    );
    // Under the cap, with too little memory for its worst case.
    std::fs::write(&p, with_junk(500_000)).unwrap();
    let e = limited(32 * MIB, || {
        engram::tables::EngramConfig::from_file(&p).err().unwrap()
    });
    assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message);
    // The real one opens under it.
    limited(32 * MIB, || {
        engram::tables::EngramConfig::from_file(&golden_dir().join("v41_config.json")).unwrap()
    });
    std::fs::remove_dir_all(&d).unwrap();
}

/// A 128 MiB sparse GGUF whose header counts are as many as its bytes hold
/// at their smallest, read with `pread`: the parser reserved room for every
/// entry (about 1 GB, past the limit: it aborted); now a status.
#[test]
fn huge_header_counts_in_pread_mode_are_a_status() {
    let _g = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let d = scratch("gguf");
    let p = d.join("sparse.gguf");
    let len = 128u64 << 20;
    let left = len - 24;
    let mut h = b"GGUF".to_vec();
    h.extend_from_slice(&3u32.to_le_bytes());
    h.extend_from_slice(&(left / 32).to_le_bytes());
    h.extend_from_slice(&(left / 13).to_le_bytes());
    std::fs::write(&p, &h).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len)
        .unwrap();
    for mmap in [false, true] {
        let e = limited(LIMIT_MIB * MIB, || {
            GgufModel::open(
                &p,
                &LoadOptions {
                    mmap,
                    ..LoadOptions::default()
                },
            )
            .err()
            .unwrap()
        });
        assert!(
            matches!(
                e.status,
                EngramStatus::ErrFormat | EngramStatus::ErrCapacity
            ),
            "{:?}: {}",
            e.status,
            e.message
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}
