//! The two storage models a schedule's accesses are replayed through:
//! - a row cache (a policy over row ids, `capacity = bytes / row_bytes`
//!   rows a layer); a missing row is read directly, costing each 512-byte
//!   block it touches once per step (a step's missing rows are sorted, so
//!   two rows in one block share its read);
//! - an `mmap` of the table under the kernel's page cache, modelled as an
//!   exact LRU over 4 KiB pages of all the layers' files together (the page
//!   cache is the machine's, not a file's); a row costs each page it touches
//!   that is not cached. Readahead: off by default (a table read at random
//!   is mapped `MADV_RANDOM`, or the kernel's read-around would read
//!   `ra` pages a fault); with `readahead_pages > 1` a fault reads the
//!   window of that many pages centred on it, each page not cached costing
//!   its 4 KiB.
//!
//! The tables are laid out as one file a layer, row `i` at byte
//! `i * row_bytes` (a table's data starts block- and page-aligned).

use crate::lru::Lru;
use crate::stream::Accesses;

/// A page of the page cache.
pub const PAGE: u64 = 4096;
/// The direct-read unit: the device's logical block.
pub const BLOCK: u64 = 512;

/// A row cache's policy as the replay drives it: a lookup that, on a miss,
/// admits the row (the row read from storage enters the cache).
pub trait RowPolicy {
    /// Whether `id` hit. A miss admits it.
    fn access(&mut self, id: u64) -> bool;
}

impl RowPolicy for Lru {
    fn access(&mut self, id: u64) -> bool {
        Lru::access(self, id)
    }
}

/// The table layout the replay reads.
#[derive(Clone, Debug)]
pub struct Layout {
    pub row_bytes: u64,
    /// Rows per layer.
    pub rows: Vec<u64>,
}

impl Layout {
    /// The first and last `unit`-sized piece row `id` touches.
    pub fn span(&self, id: u64, unit: u64) -> (u64, u64) {
        let o = id * self.row_bytes;
        (o / unit, (o + self.row_bytes - 1) / unit)
    }
}

/// A row cache's replay, per layer.
#[derive(Clone, Debug, Default)]
pub struct CacheCounts {
    pub hits: Vec<u64>,
    pub misses: Vec<u64>,
    /// Blocks read for the misses.
    pub blocks: Vec<u64>,
}

/// Replay `acc` through one row cache a layer (`policies[l]`).
pub fn replay_cache(
    acc: &Accesses,
    lay: &Layout,
    policies: &mut [Box<dyn RowPolicy + '_>],
) -> CacheCounts {
    let nl = acc.shape.layers;
    let mut c = CacheCounts {
        hits: vec![0; nl],
        misses: vec![0; nl],
        blocks: vec![0; nl],
    };
    acc.for_each_run(|l, ids| {
        let p = &mut policies[l];
        // The last block read in this run: sorted rows share blocks.
        let mut last: Option<u64> = None;
        for &id in ids {
            if p.access(id as u64) {
                c.hits[l] += 1;
                continue;
            }
            c.misses[l] += 1;
            let (b0, b1) = lay.span(id as u64, BLOCK);
            let from = match last {
                Some(x) if x >= b0 => x + 1,
                _ => b0,
            };
            c.blocks[l] += (b1 + 1).saturating_sub(from);
            last = Some(b1);
        }
    });
    c
}

/// A page-cache replay, per layer.
#[derive(Clone, Debug, Default)]
pub struct PageCounts {
    /// Page touches (a row touches one page or two).
    pub touches: Vec<u64>,
    /// Page touches that missed (faults).
    pub faults: Vec<u64>,
    /// Pages read (faults, plus readahead's pages).
    pub reads: Vec<u64>,
}

/// Replay `acc` through an exact-LRU page cache of `cap_pages` pages shared
/// by the layers' files.
pub fn replay_pages(
    acc: &Accesses,
    lay: &Layout,
    cap_pages: u64,
    readahead_pages: u64,
) -> PageCounts {
    let nl = acc.shape.layers;
    let mut c = PageCounts {
        touches: vec![0; nl],
        faults: vec![0; nl],
        reads: vec![0; nl],
    };
    let mut lru = Lru::new(cap_pages as usize);
    let key = |l: usize, p: u64| (l as u64) << 44 | p;
    acc.for_each_run(|l, ids| {
        let file_pages = (lay.rows[l] * lay.row_bytes).div_ceil(PAGE);
        for &id in ids {
            let (p0, p1) = lay.span(id as u64, PAGE);
            for p in p0..=p1 {
                c.touches[l] += 1;
                if lru.access(key(l, p)) {
                    continue;
                }
                c.faults[l] += 1;
                c.reads[l] += 1;
                if readahead_pages > 1 {
                    let w = readahead_pages.min(file_pages);
                    let start = p.saturating_sub(w / 2).min(file_pages - w);
                    for q in (start..start + w).filter(|&q| q != p) {
                        if !lru.contains(key(l, q)) {
                            lru.access(key(l, q));
                            c.reads[l] += 1;
                        }
                    }
                }
            }
        }
    });
    c
}
