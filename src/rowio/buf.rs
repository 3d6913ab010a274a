//! Aligned bounce buffers (direct I/O needs the memory aligned too) and the
//! read latency histogram.

use crate::error::{bail, Result};
use std::alloc::Layout;

/// Alignment of every bounce buffer: a page, which covers any direct-I/O
/// memory alignment a Linux block device asks for (`stx_dio_mem_align` is at
/// most the logical block size, at most a page).
pub const BUF_ALIGN: usize = 4096;

/// A zeroed, page-aligned byte buffer, allocated fallibly, grown on demand.
pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer owns its allocation alone (no aliasing pointer is kept
// elsewhere); moving it to another thread moves that sole ownership.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer (no allocation).
    pub const fn empty() -> AlignedBuf {
        AlignedBuf {
            ptr: std::ptr::null_mut(),
            len: 0,
        }
    }

    /// Bytes the buffer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Make the buffer at least `n` bytes (rounded up to [`BUF_ALIGN`]);
    /// running out of memory is `ErrCapacity`, the old buffer kept.
    pub fn ensure(&mut self, n: usize) -> Result<()> {
        if n <= self.len() {
            return Ok(());
        }
        let Some(size) = n.checked_next_multiple_of(BUF_ALIGN) else {
            bail!(ErrCapacity, "a row read's bounce buffer of {n} bytes");
        };
        let Ok(layout) = Layout::from_size_align(size, BUF_ALIGN) else {
            bail!(ErrCapacity, "a row read's bounce buffer of {n} bytes");
        };
        // SAFETY: `layout` has a nonzero size (n > self.len >= 0, rounded up).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            bail!(
                ErrCapacity,
                "out of memory for a row read's bounce buffer ({size} bytes)"
            );
        }
        self.free();
        self.ptr = p;
        self.len = size;
        Ok(())
    }

    /// The buffer's start (null when empty).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    fn free(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: `ptr` came from `alloc_zeroed` with this size and
            // alignment (`ensure`), and is freed once (then nulled).
            unsafe {
                std::alloc::dealloc(
                    self.ptr,
                    Layout::from_size_align_unchecked(self.len, BUF_ALIGN),
                )
            };
            self.ptr = std::ptr::null_mut();
            self.len = 0;
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

/// Sub-buckets per power of two in [`Latency`]: quantiles within 1/8 (12.5%).
const SUB: u32 = 8;
/// Buckets: linear below 8 ns, then 8 a power of two up to 2^40 ns.
const BUCKETS: usize = 320;

/// A log-linear histogram of read latencies in nanoseconds (each bucket
/// 1/8 of its power of two wide), for quantiles without keeping every read.
#[derive(Clone)]
pub struct Latency {
    counts: [u32; BUCKETS],
}

impl Default for Latency {
    fn default() -> Self {
        Latency {
            counts: [0; BUCKETS],
        }
    }
}

impl std::fmt::Debug for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Latency {{ n: {}, p50: {} ns, p99: {} ns }}",
            self.count(),
            self.quantile(0.5),
            self.quantile(0.99)
        )
    }
}

fn bucket(ns: u64) -> usize {
    let v = ns.clamp(1, (1 << 40) - 1);
    let e = 63 - v.leading_zeros();
    if e < 3 {
        return v as usize;
    }
    let sub = (v >> (e - 3)) & u64::from(SUB - 1);
    (SUB * (e - 2)) as usize + sub as usize
}

/// The middle of bucket `b` in nanoseconds.
fn bucket_mid(b: usize) -> u64 {
    if b < SUB as usize {
        return b as u64;
    }
    let e = b as u32 / SUB + 2;
    let sub = b as u64 % u64::from(SUB);
    let lo = (u64::from(SUB) + sub) << (e - 3);
    lo + (1u64 << (e - 3)) / 2
}

impl Latency {
    /// Count one read of `ns` nanoseconds.
    pub fn record(&mut self, ns: u64) {
        let b = bucket(ns);
        self.counts[b] = self.counts[b].saturating_add(1);
    }

    /// Add `other`'s reads.
    pub fn merge(&mut self, other: &Latency) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a = a.saturating_add(*b);
        }
    }

    /// Reads counted.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|&c| u64::from(c)).sum()
    }

    /// The `q` quantile (0..=1) in nanoseconds (within 1/16 of the true
    /// value: the middle of its bucket), 0 when nothing was counted.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).clamp(1, n);
        let mut seen = 0u64;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += u64::from(c);
            if seen >= rank {
                return bucket_mid(b);
            }
        }
        bucket_mid(BUCKETS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_sixteenth() {
        for ns in [1u64, 5, 9, 70_000, 123_456, 1_000_000_007] {
            let mut l = Latency::default();
            l.record(ns);
            let q = l.quantile(0.5);
            let err = (q as f64 - ns as f64).abs() / ns as f64;
            assert!(err <= 1.0 / 16.0 + 1e-9, "{ns} -> {q}");
        }
        let mut l = Latency::default();
        for i in 1..=100u64 {
            l.record(i * 1000);
        }
        let p99 = l.quantile(0.99) as f64;
        assert!((p99 - 99_000.0).abs() / 99_000.0 <= 1.0 / 16.0, "{p99}");
    }

    #[test]
    fn buffers_are_aligned_and_grow() {
        let mut b = AlignedBuf::empty();
        b.ensure(100).unwrap();
        assert_eq!(b.len(), BUF_ALIGN);
        assert_eq!(b.as_mut_ptr() as usize % BUF_ALIGN, 0);
        b.ensure(BUF_ALIGN + 1).unwrap();
        assert_eq!(b.len(), 2 * BUF_ALIGN);
        let e = b.ensure(usize::MAX - 10).unwrap_err();
        assert_eq!(e.status, crate::EngramStatus::ErrCapacity);
        // A size the allocator refuses (2^62 bytes): null, not an abort.
        let e = b.ensure(1 << 62).unwrap_err();
        assert_eq!(e.status, crate::EngramStatus::ErrCapacity);
        assert_eq!(b.len(), 2 * BUF_ALIGN, "the old buffer is kept");
    }
}
