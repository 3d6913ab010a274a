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

/// What a state is checked against: the fingerprint and the largest
/// compressed id of the context's tables.
#[derive(Clone, Copy, Debug)]
pub struct StateKey {
    pub fingerprint: u64,
    pub max_id: i32,
}

impl StateKey {
    pub fn of(t: &crate::hash::HashTables) -> StateKey {
        StateKey {
            fingerprint: fingerprint(t),
            max_id: t.token_map.iter().copied().max().unwrap_or(-1),
        }
    }
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
pub fn encode<I>(entries: impl Fn() -> I, seq: i32, key: StateKey, buf: &mut [u8]) -> Result<usize>
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
    key: StateKey,
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
            if v < -1 || v > key.max_id {
                bail!(
                    ErrFormat,
                    "sequence state position {}: entry {v} is not a compressed id of this model",
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
    pub fn state_write(&self, seq: i32, key: StateKey, buf: &mut [u8]) -> Result<usize> {
        let s = self.check_seq(seq)?;
        encode(|| self.seqs[s].entries(0, usize::MAX), seq, key, buf)
    }

    /// Replace `seq`'s history with the state in `buf` (from
    /// [`History::state_write`] of this model, any sequence). Every check
    /// runs before `seq` changes; a bad buffer is `ERR_FORMAT`.
    pub fn state_read(&mut self, seq: i32, key: StateKey, buf: &[u8]) -> Result<()> {
        let s = self.check_seq(seq)?;
        let mut new = SeqHistory::default();
        decode(key, self.limits.max_positions, buf, |p, v| {
            let total = buf.len();
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

    const KEY: StateKey = StateKey {
        fingerprint: 0x1234_5678_9abc_def0,
        max_id: 500,
    };

    #[test]
    fn round_trip_into_another_slot_and_every_bad_buffer_is_refused() {
        let mut h = history();
        for p in (0..30).chain(4095..4100).chain([9000]) {
            h.seqs[0].put(p, (p % 7) as i32 - 1).unwrap();
        }
        let size = h.state_size(0).unwrap();
        assert_eq!(size, HEADER + 3 * 8 + 36 * 4 + TRAILER);
        let mut buf = vec![0u8; size];
        assert_eq!(
            h.state_write(0, KEY, &mut buf[..size - 1])
                .unwrap_err()
                .status,
            crate::EngramStatus::ErrInvalidArgument
        );
        assert_eq!(h.state_write(0, KEY, &mut buf).unwrap(), size);
        h.seqs[1].put(3, 3).unwrap();
        let before = h.entries(1).unwrap();
        for cut in 0..size {
            let e = h.state_read(1, KEY, &buf[..cut]).unwrap_err();
            assert_eq!(e.status, crate::EngramStatus::ErrFormat, "cut {cut}");
        }
        for i in 0..size {
            for bit in [0x01u8, 0x80] {
                let mut m = buf.clone();
                m[i] ^= bit;
                let e = h.state_read(1, KEY, &m).unwrap_err();
                assert_eq!(e.status, crate::EngramStatus::ErrFormat, "byte {i}");
            }
        }
        let other = StateKey {
            fingerprint: KEY.fingerprint ^ 1,
            ..KEY
        };
        assert!(h
            .state_read(1, other, &buf)
            .unwrap_err()
            .message
            .contains("another model"));
        assert_eq!(h.entries(1).unwrap(), before, "nothing changed");
        h.state_read(1, KEY, &buf).unwrap();
        assert_eq!(h.entries(1).unwrap(), h.entries(0).unwrap());
        // An empty sequence's state empties a sequence.
        h.seq_rm(1, 0, -1).unwrap();
        let mut e = vec![0u8; h.state_size(1).unwrap()];
        h.state_write(1, KEY, &mut e).unwrap();
        h.state_read(0, KEY, &e).unwrap();
        assert!(h.entries(0).unwrap().is_empty());
    }
}
