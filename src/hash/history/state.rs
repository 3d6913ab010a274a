//! One sequence's history as bytes (`engram_seq_state_*`): a prompt cache
//! saves it, and restores it later into any sequence slot of a context of
//! the same model.
//!
//! Format, version 1, every integer little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `ENGRAMSQ` |
//! | 8 | 4 | version (1) |
//! | 12 | 4 | runs: maximal spans of consecutive written positions |
//! | 16 | 8 | the context's hash-table fingerprint ([`fingerprint`]) |
//! | 24 | 8 | positions written (the sum of the runs' lengths) |
//! | 32 | ... | each run: start `u32`, length `u32`, then `length` entries `i32` |
//! | end - 8 | 8 | FNV-1a 64 of every byte before it |
//!
//! Runs are in increasing order, non-empty, separated by at least one
//! position never written, inside `[0, max_positions)`; entries are
//! compressed ids the token map produces, or `-1` (a dead token). Anything
//! else is `ERR_FORMAT`, checked in full before the sequence changes.

use super::{History, SeqHistory};
use crate::error::{bail, Result};

const MAGIC: &[u8; 8] = b"ENGRAMSQ";
const VERSION: u32 = 1;
const HEADER: usize = 32;
const TRAILER: usize = 8;

/// FNV-1a 64 over `bytes`, continuing from `h`. A single changed byte always
/// changes the result (each step is a bijection of the state).
pub fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// The hash tables' fingerprint: FNV-1a 64 over everything the row ids
/// depend on (layer ids, `N`, `H`, the token map, the pad id, the
/// multipliers, primes and offsets), each length-prefixed.
pub fn fingerprint(t: &crate::hash::HashTables) -> u64 {
    let mut h = FNV_BASIS;
    let mut put = |v: u64| h = fnv1a(h, &v.to_le_bytes());
    put(t.layer_ids.len() as u64);
    t.layer_ids.iter().for_each(|&v| put(v as u64));
    put(t.max_ngram as u64);
    put(t.n_heads as u64);
    put(t.token_map.len() as u64);
    t.token_map.iter().for_each(|&v| put(v as i64 as u64));
    put(t.pad_id as u64);
    for a in [&t.multipliers, &t.primes, &t.offsets] {
        put(a.len() as u64);
        a.iter().for_each(|&v| put(v as u64));
    }
    h
}

/// What a state is checked against: the fingerprint and the compressed ids
/// of this model (the values its token map holds).
#[derive(Clone, Debug)]
pub struct StateKey {
    pub fingerprint: u64,
    ids: ValidIds,
}

/// The compressed ids some token maps to: a bitmap over `[0, max id]`, or,
/// where that would be larger than the token map itself (a map with a few
/// large ids), the ids sorted.
#[derive(Clone, Debug)]
enum ValidIds {
    Bits(Vec<u64>),
    Sorted(Vec<i32>),
}

impl ValidIds {
    /// The set of the values of `map` other than -1, allocated fallibly.
    fn of(map: &[i32]) -> Result<ValidIds> {
        let max = map.iter().copied().max().unwrap_or(-1);
        let words = (max as i64 + 1).max(0) as usize / 64 + 1;
        if words <= map.len().div_ceil(2) {
            let mut bits = crate::fallible::try_vec(words, 0u64, "the valid compressed ids")?;
            for &v in map.iter().filter(|&&v| v >= 0) {
                bits[v as usize / 64] |= 1 << (v % 64);
            }
            return Ok(ValidIds::Bits(bits));
        }
        let mut ids = crate::fallible::try_room(map.len(), "the valid compressed ids")?;
        ids.extend(map.iter().copied().filter(|&v| v >= 0));
        ids.sort_unstable();
        ids.dedup();
        Ok(ValidIds::Sorted(ids))
    }

    fn contains(&self, v: i32) -> bool {
        match self {
            _ if v < 0 => false,
            ValidIds::Bits(b) => b
                .get(v as usize / 64)
                .is_some_and(|w| (w >> (v % 64)) & 1 == 1),
            ValidIds::Sorted(ids) => ids.binary_search(&v).is_ok(),
        }
    }
}

impl StateKey {
    /// The key of the tables `t` (allocates the set of valid ids: one bit
    /// per id up to the largest, fallibly).
    pub fn of(t: &crate::hash::HashTables) -> Result<StateKey> {
        Ok(StateKey {
            fingerprint: fingerprint(t),
            ids: ValidIds::of(&t.token_map)?,
        })
    }

    /// A key with `fingerprint` whose valid ids are the values of `map`
    /// (the unit tests).
    #[cfg(test)]
    pub(crate) fn with_map(fingerprint: u64, map: &[i32]) -> StateKey {
        StateKey {
            fingerprint,
            ids: ValidIds::of(map).expect("a small map"),
        }
    }

    /// Whether `v` may be a history entry: -1 (a dead token) or a
    /// compressed id some token maps to.
    fn entry_ok(&self, v: i32) -> bool {
        v == -1 || self.ids.contains(v)
    }
}

/// History pages a restore may allocate beyond what [`restore_bound`]
/// scales with the state: a few, so that any short state restores.
const RESTORE_SLACK_PAGES: usize = 4;

/// How many times its own size a restore may allocate in history pages.
const RESTORE_FACTOR: usize = 16;

/// Bytes of history pages a restore of a state of `len` bytes may allocate
/// (docs/history.md, "Saving and restoring"): `RESTORE_FACTOR * len` plus
/// `RESTORE_SLACK_PAGES` pages. A dense state needs about its own size
/// (4 bytes an entry, as in a page); only runs thousands of positions
/// apart, each paying a 16 KiB page for a few bytes, need more.
fn restore_bound(len: usize) -> usize {
    len.saturating_mul(RESTORE_FACTOR)
        .saturating_add(RESTORE_SLACK_PAGES * super::PAGE * 4)
}

/// Bytes the state of a sequence holding `entries` (written positions in
/// increasing order, with their entries) takes.
pub fn encoded_size(entries: impl Iterator<Item = (usize, i32)>) -> usize {
    let (mut n, mut runs) = (0usize, 0usize);
    let mut last: Option<usize> = None;
    for (p, _) in entries {
        if last.is_none_or(|l| l + 1 != p) {
            runs += 1;
        }
        last = Some(p);
        n += 1;
    }
    HEADER + runs * 8 + n * 4 + TRAILER
}

/// The state of sequence `seq` holding what `entries` yields (each time
/// the same, as [`encoded_size`] takes them) into
/// `buf`; returns the bytes written. A `buf` shorter than the state is
/// `ERR_INVALID_ARGUMENT` (nothing written).
pub fn encode<I>(entries: impl Fn() -> I, seq: i32, key: &StateKey, buf: &mut [u8]) -> Result<usize>
where
    I: Iterator<Item = (usize, i32)>,
{
    let need = encoded_size(entries());
    if buf.len() < need {
        bail!(
            ErrInvalidArgument,
            "the buffer holds {} bytes, sequence {seq}'s state needs {need}",
            buf.len()
        );
    }
    let out = &mut buf[..need];
    out[0..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[16..24].copy_from_slice(&key.fingerprint.to_le_bytes());
    // The runs, written as the entries come (no copy of the history):
    // each run's length is filled in when the run ends.
    let (mut o, mut runs, mut n) = (HEADER, 0u32, 0u64);
    let mut run: Option<(usize, usize, usize)> = None; // (header offset, start, length)
    let close = |out: &mut [u8], run: Option<(usize, usize, usize)>| {
        if let Some((at, _, len)) = run {
            out[at + 4..at + 8].copy_from_slice(&(len as u32).to_le_bytes());
        }
    };
    for (p, v) in entries() {
        match &mut run {
            Some((_, start, len)) if *start + *len == p => *len += 1,
            _ => {
                close(out, run);
                out[o..o + 4].copy_from_slice(&(p as u32).to_le_bytes());
                run = Some((o, p, 1));
                runs += 1;
                o += 8;
            }
        }
        out[o..o + 4].copy_from_slice(&v.to_le_bytes());
        o += 4;
        n += 1;
    }
    close(out, run);
    out[12..16].copy_from_slice(&runs.to_le_bytes());
    out[24..32].copy_from_slice(&n.to_le_bytes());
    let sum = fnv1a(FNV_BASIS, &out[..o]);
    out[o..o + 8].copy_from_slice(&sum.to_le_bytes());
    Ok(need)
}

/// Check the state in `b` in full against `key` and `[0, max)` positions,
/// handing each of its entries to `put` in increasing position order (an
/// error of `put` stops and is returned). A bad buffer is `ERR_FORMAT`;
/// nothing is handed to `put` before the header and checksum are checked,
/// so a caller that builds its new history from `put` and installs it only
/// on success changes nothing on error.
pub fn decode(
    key: &StateKey,
    max: usize,
    b: &[u8],
    mut put: impl FnMut(usize, i32) -> Result<()>,
) -> Result<()> {
    let len = b.len();
    if len < HEADER + TRAILER {
        bail!(
            ErrFormat,
            "sequence state of {len} bytes: shorter than its header and checksum ({} bytes)",
            HEADER + TRAILER
        );
    }
    if &b[0..8] != MAGIC {
        bail!(ErrFormat, "not an engram sequence state (wrong magic)");
    }
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version != VERSION {
        bail!(
            ErrFormat,
            "sequence state version {version}, this library reads version {VERSION}"
        );
    }
    let (n_runs, n) = (u32_at(12) as u64, u64_at(24));
    let want = (HEADER as u64)
        .checked_add(n_runs.saturating_mul(8))
        .and_then(|v| v.checked_add(n.checked_mul(4)?))
        .and_then(|v| v.checked_add(TRAILER as u64));
    if want != Some(len as u64) {
        bail!(
            ErrFormat,
            "sequence state of {len} bytes, its header says {n_runs} runs and {n} positions (truncated or corrupt)"
        );
    }
    let body = len - TRAILER;
    let sum = fnv1a(FNV_BASIS, &b[..body]);
    if sum != u64_at(body) {
        bail!(ErrFormat, "sequence state checksum mismatch (corrupt)");
    }
    if u64_at(16) != key.fingerprint {
        bail!(
            ErrFormat,
            "sequence state of another model: hash-table fingerprint {:#018x}, this context's is {:#018x}",
            u64_at(16),
            key.fingerprint
        );
    }
    let max = max as u64;
    let (mut o, mut next_free, mut total) = (HEADER, 0u64, 0u64);
    for r in 0..n_runs {
        if o + 8 > body {
            bail!(ErrFormat, "sequence state run {r} lies past the end");
        }
        let (start, rl) = (u32_at(o) as u64, u32_at(o + 4) as u64);
        o += 8;
        if rl == 0 || start < next_free || start + rl > max {
            bail!(
                ErrFormat,
                "sequence state run {r} (positions [{start}, {})) is empty, out of order, touches the previous run, or lies outside [0, max_positions = {max})",
                start + rl
            );
        }
        if (o as u64) + rl * 4 > body as u64 {
            bail!(ErrFormat, "sequence state run {r} lies past the end");
        }
        for j in 0..rl {
            let v = i32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
            o += 4;
            if !key.entry_ok(v) {
                bail!(
                    ErrFormat,
                    "sequence state position {}: entry {v} is neither -1 nor a compressed id of this model (no token maps to it)",
                    start + j
                );
            }
            put((start + j) as usize, v)?;
        }
        next_free = start + rl + 1;
        total += rl;
    }
    if o != body || total != n {
        bail!(
            ErrFormat,
            "sequence state holds {total} positions in its runs, its header says {n}"
        );
    }
    Ok(())
}

impl History {
    /// Bytes `seq`'s state takes.
    pub fn state_size(&self, seq: i32) -> Result<usize> {
        let s = self.check_seq(seq)?;
        Ok(encoded_size(self.seqs[s].entries(0, usize::MAX)))
    }

    /// `seq`'s state into `buf`; returns the bytes written. A `buf` shorter
    /// than [`History::state_size`] is `ERR_INVALID_ARGUMENT` (nothing written).
    pub fn state_write(&self, seq: i32, key: &StateKey, buf: &mut [u8]) -> Result<usize> {
        let s = self.check_seq(seq)?;
        encode(|| self.seqs[s].entries(0, usize::MAX), seq, key, buf)
    }

    /// Replace `seq`'s history with the state in `buf` (from
    /// [`History::state_write`] of this model, any sequence). Every check
    /// runs before `seq` changes; a bad buffer is `ERR_FORMAT`, a state
    /// whose pages would take more than [`restore_bound`] is `ERR_CAPACITY`
    /// (checked before any page is allocated).
    pub fn state_read(&mut self, seq: i32, key: &StateKey, buf: &[u8]) -> Result<()> {
        let s = self.check_seq(seq)?;
        let max = self.limits.max_positions;
        let total = buf.len();
        // First pass: check everything, count the pages the entries touch.
        let (mut pages, mut last) = (0usize, None);
        decode(key, max, buf, |p, _| {
            if last != Some(p / super::PAGE) {
                pages += 1;
                last = Some(p / super::PAGE);
            }
            Ok(())
        })?;
        let need = pages.saturating_mul(super::PAGE * 4);
        if need > restore_bound(total) {
            bail!(
                ErrCapacity,
                "a sequence state of {total} bytes would take {pages} history pages ({need} bytes); \
                 a restore allocates at most {RESTORE_FACTOR} times the state's size plus \
                 {RESTORE_SLACK_PAGES} pages ({} bytes): its positions are too sparse",
                restore_bound(total)
            );
        }
        let mut new = SeqHistory::default();
        decode(key, max, buf, |p, v| {
            new.put(p, v).map_err(|_| {
                crate::error::Error::new(
                    crate::EngramStatus::ErrCapacity,
                    format!("out of memory restoring a sequence state of {total} bytes"),
                )
            })
        })?;
        self.seqs[s] = new;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::Limits;

    fn history() -> History {
        History::new(Limits {
            max_tokens: 64,
            max_seqs: 2,
            max_positions: 10_000,
        })
        .unwrap()
    }

    /// A key whose model maps tokens to the ids 0 to 500.
    fn test_key() -> StateKey {
        let map: Vec<i32> = (0..=500).collect();
        StateKey::with_map(0x1234_5678_9abc_def0, &map)
    }

    #[test]
    fn round_trip_into_another_slot_and_every_bad_buffer_is_refused() {
        let key = test_key();
        let mut h = history();
        for p in (0..30).chain(4095..4100).chain([9000]) {
            h.seqs[0].put(p, (p % 7) as i32 - 1).unwrap();
        }
        let size = h.state_size(0).unwrap();
        assert_eq!(size, HEADER + 3 * 8 + 36 * 4 + TRAILER);
        let mut buf = vec![0u8; size];
        assert_eq!(
            h.state_write(0, &key, &mut buf[..size - 1])
                .unwrap_err()
                .status,
            crate::EngramStatus::ErrInvalidArgument
        );
        assert_eq!(h.state_write(0, &key, &mut buf).unwrap(), size);
        h.seqs[1].put(3, 3).unwrap();
        let before = h.entries(1).unwrap();
        for cut in 0..size {
            let e = h.state_read(1, &key, &buf[..cut]).unwrap_err();
            assert_eq!(e.status, crate::EngramStatus::ErrFormat, "cut {cut}");
        }
        for i in 0..size {
            for bit in [0x01u8, 0x80] {
                let mut m = buf.clone();
                m[i] ^= bit;
                let e = h.state_read(1, &key, &m).unwrap_err();
                assert_eq!(e.status, crate::EngramStatus::ErrFormat, "byte {i}");
            }
        }
        let other = StateKey {
            fingerprint: key.fingerprint ^ 1,
            ..key.clone()
        };
        assert!(h
            .state_read(1, &other, &buf)
            .unwrap_err()
            .message
            .contains("another model"));
        assert_eq!(h.entries(1).unwrap(), before, "nothing changed");
        h.state_read(1, &key, &buf).unwrap();
        assert_eq!(h.entries(1).unwrap(), h.entries(0).unwrap());
        // An empty sequence's state empties a sequence.
        h.seq_rm(1, 0, -1).unwrap();
        let mut e = vec![0u8; h.state_size(1).unwrap()];
        h.state_write(1, &key, &mut e).unwrap();
        h.state_read(0, &key, &e).unwrap();
        assert!(h.entries(0).unwrap().is_empty());
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;
    use crate::batch::Limits;

    /// A state of `entries` (positions in increasing order), sealed.
    fn state_of(entries: &[(usize, i32)], key: &StateKey) -> Vec<u8> {
        let mut buf = vec![0u8; encoded_size(entries.iter().copied())];
        encode(|| entries.iter().copied(), 0, key, &mut buf).unwrap();
        buf
    }

    /// Issue 34, F7: 65,536 one-position runs 4,096 positions apart, a
    /// checksum-valid state of 786,472 bytes, asked one 16 KiB page per run
    /// (1 GiB). The restore refuses it with ERR_CAPACITY before allocating
    /// anything; the same entries dense, or a few runs a page apart each,
    /// restore.
    #[test]
    fn a_restore_allocates_at_most_a_bounded_multiple_of_the_state() {
        let key = StateKey::with_map(7, &[0, 1, 2]);
        let mut h = History::new(Limits {
            max_tokens: 64,
            max_seqs: 2,
            max_positions: 1 << 29,
        })
        .unwrap();
        h.seqs[1].put(3, 2).unwrap();
        let (bytes, before) = (h.bytes(), h.entries(1).unwrap());
        let sparse: Vec<(usize, i32)> = (0..65_536).map(|r| (r * PAGE_POSITIONS, 1)).collect();
        let buf = state_of(&sparse, &key);
        assert_eq!(buf.len(), 786_472);
        let e = h.state_read(1, &key, &buf).unwrap_err();
        assert_eq!(e.status, crate::EngramStatus::ErrCapacity, "{}", e.message);
        assert!(e.message.contains("65536 history pages"), "{}", e.message);
        assert_eq!(h.bytes(), bytes, "nothing allocated");
        assert_eq!(h.entries(1).unwrap(), before, "nothing changed");
        // The bound: 16 times the state plus 4 pages.
        assert_eq!(
            restore_bound(buf.len()),
            16 * 786_472 + 4 * PAGE_POSITIONS * 4
        );
        // Dense, the same entries restore (16 pages).
        let dense: Vec<(usize, i32)> = (0..65_536).map(|p| (p, 1)).collect();
        h.state_read(1, &key, &state_of(&dense, &key)).unwrap();
        assert_eq!(h.len(1), 65_536);
        // A few one-position runs, a page apart each (the slack), restore.
        let few: Vec<(usize, i32)> = (0..4).map(|r| (r * PAGE_POSITIONS, 0)).collect();
        h.state_read(1, &key, &state_of(&few, &key)).unwrap();
        assert_eq!(h.entries(1).unwrap(), few);
    }

    const PAGE_POSITIONS: usize = super::super::PAGE;

    /// Issue 34, F8: an entry is valid if some token maps to it, not merely
    /// if it lies in `[-1, max id]`: with no token mapping to 15, a state
    /// holding 15 is ERR_FORMAT; -1 and the ids that are used restore. The
    /// same with ids too sparse for a bitmap.
    #[test]
    fn a_state_entry_must_be_an_id_some_token_maps_to() {
        let mut h = History::new(Limits {
            max_tokens: 64,
            max_seqs: 1,
            max_positions: 100,
        })
        .unwrap();
        let dense: Vec<i32> = (0..100).filter(|&v| v != 15).chain([-1]).collect();
        let sparse = [-1, 5, 1 << 30];
        for (map, used, unused) in [(&dense[..], 99, 15), (&sparse[..], 1 << 30, 6)] {
            let key = StateKey::with_map(9, map);
            let good = [(0, -1), (1, used), (2, map[0])];
            h.state_read(0, &key, &state_of(&good, &key)).unwrap();
            assert_eq!(h.entries(0).unwrap(), good);
            for bad in [unused, -2, i32::MAX] {
                let e = h
                    .state_read(0, &key, &state_of(&[(0, 1), (1, bad)], &key))
                    .unwrap_err();
                assert_eq!(e.status, crate::EngramStatus::ErrFormat, "{bad}");
                assert!(e.message.contains("no token maps to it"), "{}", e.message);
                assert_eq!(h.entries(0).unwrap(), good, "nothing changed");
            }
        }
    }
}
