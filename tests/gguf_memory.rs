//! GGUF metadata memory (issue 14 item 12): arrays are ranges into the
//! header, not vectors of values, so a 20 MB u8 array (which used to peak at
//! 646 MB) costs nothing to parse and its bytes once to hold. Measured with a
//! counting allocator, in a test binary of its own (one test, so that no
//! other test's allocations are counted).

use engram::gguf::{Gguf, GgufSet};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Counts the bytes allocated now and the peak since the last reset.
struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let n = NOW.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(n, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) };
        NOW.fetch_sub(l.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static A: Counting = Counting;

/// `f`'s value, the peak allocation above the level before it while it ran,
/// and what it left allocated.
fn measure<T>(f: impl FnOnce() -> T) -> (T, usize, usize) {
    let base = NOW.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let r = f();
    let now = NOW.load(Ordering::Relaxed);
    (
        r,
        PEAK.load(Ordering::Relaxed) - base,
        now.saturating_sub(base),
    )
}

/// A GGUF with one big u8 array and one big i32 array in its metadata and a
/// tiny tensor.
fn big_metadata_gguf(n_u8: usize, n_i32: usize) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&1u64.to_le_bytes()); // tensors
    b.extend_from_slice(&2u64.to_le_bytes()); // kvs
    let key = |b: &mut Vec<u8>, k: &str| {
        b.extend_from_slice(&(k.len() as u64).to_le_bytes());
        b.extend_from_slice(k.as_bytes());
    };
    key(&mut b, "tokenizer.ggml.token_type");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // u8
    b.extend_from_slice(&(n_u8 as u64).to_le_bytes());
    b.extend(std::iter::repeat_n(1u8, n_u8));
    key(&mut b, "tokenizer.ggml.scores_as_ints");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&5u32.to_le_bytes()); // i32
    b.extend_from_slice(&(n_i32 as u64).to_le_bytes());
    b.extend(std::iter::repeat_n(7u8, n_i32 * 4));
    key(&mut b, "t");
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&4u64.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes()); // f32
    b.extend_from_slice(&0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    b.extend_from_slice(&[0u8; 16]);
    b
}

/// Issue 14 item 12: metadata arrays are ranges into the header, not vectors
/// of values (a 20 MB u8 array used to peak at 646 MB).
#[test]
fn metadata_arrays_cost_no_memory_per_element() {
    let (n_u8, n_i32) = (20 << 20, 2 << 20);
    let b = big_metadata_gguf(n_u8, n_i32);
    let (g, peak, _) = measure(|| Gguf::parse(&b).unwrap());
    assert_eq!(g.kvs.len(), 2);
    let engram::gguf::Value::Array(a) = &g.get("tokenizer.ggml.token_type").unwrap().value else {
        panic!()
    };
    assert_eq!(a.len, n_u8 as u64);
    assert!(a.ints(&b).unwrap().all(|v| v == 1));
    assert!(
        peak < 64 << 10,
        "parsing {} MB of metadata arrays allocated {peak} bytes at the peak",
        b.len() >> 20
    );
    assert!(g.heap_bytes() < 4096, "{}", g.heap_bytes());
    // Opened from a file: mapped, nothing but the header's entries; read with
    // pread, the header bytes once (about the file's size here) and no more.
    let d = std::env::temp_dir().join(format!("engram-memory-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("big.gguf");
    std::fs::write(&p, &b).unwrap();
    let (s, peak, _) = measure(|| GgufSet::open(&p, true).unwrap());
    assert!(peak < 64 << 10, "mapped: peak {peak} bytes");
    drop(s);
    // With pread the header is read into memory the set owns: its bytes once
    // (at most twice, briefly, while the read is trimmed to the header).
    let (s, peak, kept) = measure(|| GgufSet::open(&p, false).unwrap());
    let h = b.len();
    assert!(
        kept < h + h / 8 + (64 << 10),
        "pread: {kept} bytes kept for a {h}-byte header"
    );
    assert!(
        peak < 2 * h + (1 << 20),
        "pread: peak {peak} bytes for a {h}-byte header"
    );
    drop(s);
    std::fs::remove_dir_all(&d).unwrap();
}
