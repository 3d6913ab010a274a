//! The AMX kernel (`Kernel::Amx`): bf16 and block-scaled fp8 `wkv` by
//! `tdpbf16ps` on tiles, `kv^T` a block at a time.
//!
//! - tile A: 16 output rows of `wkv` x 32 bf16 of K, loaded straight from
//!   row-major `wkv` (stride `2 K`) where a whole tile lies inside it, else
//!   widened (fp8, the last rows, a K that is not whole 32-value chunks)
//!   into a zero-padded scratch tile or, for batches, a panel of 32 rows;
//! - tile B: 32 K values x 16 tokens in the instruction's pair layout
//!   (`B[k/2][2 t + k%2]`), packed once a call ([`Packed`]);
//! - tile C: 16 outputs x up to 16 tokens, f32.
//!
//! Each C tile takes every 32-value chunk of K in order, so every output
//! sums in one order whatever the batch: per chunk, the instruction's
//! partial sums (see [`emu`]) added to the running sum, chunk after chunk.
//! A token's column of C never depends on the other columns, so a 1-token
//! call (a 1-column B tile) gives the bits of a 600-token one.
//!
//! The driver ([`task`]) is generic over [`Tiles`]: [`Hw`] runs the
//! instructions, [`Emu`] models them in software (palette 1, the SDM's
//! pseudocode), so the blocking, packing and edges are tested on CPUs
//! without AMX.

use crate::batch::try_vec;
use crate::error::Result;
use crate::formats::Fp8Blocks;

mod emu;
mod hw;
pub(crate) use emu::Emu;
pub(crate) use hw::{status, Hw};

/// Rows of a tile (palette 1's most).
pub(crate) const ROWS: usize = 16;
/// Bytes of a tile row (palette 1's most).
pub(crate) const ROW_BYTES: usize = 64;
/// K values an A tile row holds (32 bf16), and B tile rows (pairs) times 2.
pub(crate) const KC: usize = 32;
/// Tokens a B tile holds.
pub(crate) const TN: usize = 16;

/// The tile registers: C tiles for (A tile, B tile) pairs, A tiles (weight
/// rows), B tiles (tokens).
const C: [[u8; 2]; 2] = [[0, 1], [2, 3]];
const A: [u8; 2] = [4, 5];
const B: [u8; 2] = [6, 7];

/// The tile instructions the driver uses.
pub(crate) trait Tiles {
    /// `ldtilecfg`.
    ///
    /// # Safety
    /// The CPU runs the instructions and the process may use tile data.
    unsafe fn configure(&mut self, cfg: &Config);
    /// `tilezero`.
    ///
    /// # Safety
    /// A configuration is loaded; `t` is a configured tile.
    unsafe fn zero(&mut self, t: u8);
    /// `tileloadd`: the tile's rows from `p`, one every `stride` bytes.
    ///
    /// # Safety
    /// As `zero`, and `p` holds the configured rows x bytes at `stride`.
    unsafe fn load(&mut self, t: u8, p: *const u8, stride: usize);
    /// `tdpbf16ps c, a, b`.
    ///
    /// # Safety
    /// As `zero`, with shapes that the instruction accepts.
    unsafe fn dp(&mut self, c: u8, a: u8, b: u8);
    /// `tilestored`: the tile's rows to `p`, one every `stride` bytes.
    ///
    /// # Safety
    /// As `zero`, and `p` has room for the configured rows x bytes.
    unsafe fn store(&mut self, t: u8, p: *mut u8, stride: usize);
    /// `tilerelease`.
    ///
    /// # Safety
    /// The CPU runs the instruction.
    unsafe fn release(&mut self);
}

/// A tile configuration (`ldtilecfg`'s 64-byte operand), palette 1.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Config {
    pub palette: u8,
    pub start_row: u8,
    pub reserved: [u8; 14],
    /// Bytes a row, per tile.
    pub colsb: [u16; 16],
    pub reserved2: [u8; 16],
    /// Rows, per tile.
    pub rows: [u8; 16],
}

impl Config {
    /// The driver's tiles for `nb` tokens a B tile (`1..=16`): C tiles 16 x
    /// `nb` f32, A tiles 16 x 32 bf16, B tiles 16 pairs x `nb` tokens.
    pub(crate) fn for_tokens(nb: usize) -> Config {
        assert!((1..=TN).contains(&nb));
        let mut c = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            reserved2: [0; 16],
            rows: [0; 16],
        };
        for t in C.iter().flatten().chain(&B) {
            c.colsb[*t as usize] = (4 * nb) as u16;
            c.rows[*t as usize] = ROWS as u8;
        }
        for t in A {
            c.colsb[t as usize] = ROW_BYTES as u16;
            c.rows[t as usize] = ROWS as u8;
        }
        c
    }
}

/// The tokens in B tiles: `[tile][chunk][pair row][token][2]` bf16, zero
/// past `n` tokens and past `k`.
pub(crate) struct Packed {
    pub n: usize,
    pub k: usize,
    pub chunks: usize,
    pub tiles: usize,
    data: Vec<u16>,
}

impl Packed {
    /// `rows` (`[n, k]` bf16 bits) packed.
    pub(crate) fn new(rows: &[u16], n: usize, k: usize) -> Result<Packed> {
        assert!(rows.len() == n * k);
        let (chunks, tiles) = (k.div_ceil(KC), n.div_ceil(TN));
        let mut data = try_vec(tiles * chunks * KC * TN, 0u16, "the packed token tiles")?;
        for (t, row) in rows.chunks_exact(k.max(1)).enumerate().take(n) {
            let (tile, j) = (t / TN, t % TN);
            for (kk, &v) in row.iter().enumerate() {
                let (c, r, e) = (kk / KC, (kk % KC) / 2, kk % 2);
                data[((tile * chunks + c) * ROWS + r) * 2 * TN + 2 * j + e] = v;
            }
        }
        Ok(Packed {
            n,
            k,
            chunks,
            tiles,
            data,
        })
    }

    /// B tile `tile`, chunk `c` (rows of 64 bytes).
    fn tile(&self, tile: usize, c: usize) -> *const u8 {
        self.data[(tile * self.chunks + c) * ROWS * 2 * TN..].as_ptr() as *const u8
    }
}

/// The weights as the kernel reads them (`[_, k]`, at least the task's rows).
#[derive(Clone, Copy)]
pub(crate) enum Src<'a> {
    Bf16(&'a [u16]),
    Fp8(Fp8Blocks<'a>),
}

impl Src<'_> {
    /// A tile of rows `o..o + 16`, chunk `c`, read in place (stride `2 k`),
    /// where bf16 rows hold all of it below `hi`.
    fn direct(&self, k: usize, o: usize, hi: usize, c: usize) -> Option<*const u8> {
        match self {
            Src::Bf16(w) if o + ROWS <= hi && (c + 1) * KC <= k => {
                Some(w[o * k + c * KC..].as_ptr() as *const u8)
            }
            _ => None,
        }
    }

    /// Rows `o..min(o + 16, hi)`, chunk `c` as bf16 into `dst` (row `r` at
    /// `r * stride`), zero past `k` and past `hi`; `f` is scratch.
    fn widen(&self, k: usize, o: usize, hi: usize, c: usize, dst: &mut [u16], stride: usize) {
        let (k0, k1) = (c * KC, ((c + 1) * KC).min(k));
        let mut f = [0f32; KC];
        for r in 0..ROWS {
            let d = &mut dst[r * stride..r * stride + KC];
            d.fill(0);
            if o + r >= hi {
                continue;
            }
            match self {
                Src::Bf16(w) => d[..k1 - k0].copy_from_slice(&w[(o + r) * k + k0..][..k1 - k0]),
                Src::Fp8(b) => {
                    // Exact in bf16 (`set_layer` refuses any other value).
                    b.to_f32((o + r) * k + k0, &mut f[..k1 - k0]);
                    for (d, v) in d.iter_mut().zip(&f[..k1 - k0]) {
                        *d = (v.to_bits() >> 16) as u16;
                    }
                }
            }
        }
    }
}

/// Where a task's A tiles come from: in place, the panel, or scratch tiles.
struct ATiles<'a> {
    src: Src<'a>,
    k: usize,
    hi: usize,
    /// Rows `o..o + 32` widened, `[32][chunks * 32]` (batches of fp8).
    panel: Vec<u16>,
    scratch: [[u16; ROWS * KC]; 2],
}

impl ATiles<'_> {
    /// Widen rows `o..o + 32` into the panel, if there is one.
    fn fill_panel(&mut self, o: usize, chunks: usize) {
        if self.panel.is_empty() {
            return;
        }
        let stride = chunks * KC;
        for h in 0..2 {
            for c in 0..chunks {
                let dst = &mut self.panel[h * ROWS * stride + c * KC..];
                self.src
                    .widen(self.k, o + h * ROWS, self.hi, c, dst, stride);
            }
        }
    }

    /// A tile `h` of rows `o + 16 h..`, chunk `c`: its address and stride.
    fn get(&mut self, o: usize, h: usize, c: usize, chunks: usize) -> (*const u8, usize) {
        let o = o + h * ROWS;
        if !self.panel.is_empty() {
            let stride = chunks * KC;
            return (
                self.panel[h * ROWS * stride + c * KC..].as_ptr() as _,
                2 * stride,
            );
        }
        if let Some(p) = self.src.direct(self.k, o, self.hi, c) {
            return (p, 2 * self.k);
        }
        self.src
            .widen(self.k, o, self.hi, c, &mut self.scratch[h], KC);
        (self.scratch[h].as_ptr() as _, ROW_BYTES)
    }
}

/// One task: outputs `lo..hi` of `w` against the packed tokens `x` into
/// `out` (`[hi - lo, n]`, each output's f32 sum), on `tiles`: configured at
/// the start, released at the end.
///
/// # Safety
/// `tiles` can run (for [`Hw`]: the CPU has AMX-TILE and AMX-BF16 and the
/// process was granted tile data, [`status`]); `w` holds rows `lo..hi` of
/// `x.k` values.
pub(crate) unsafe fn task<T: Tiles>(
    tiles: &mut T,
    w: Src<'_>,
    x: &Packed,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> Result<()> {
    let (n, k, chunks) = (x.n, x.k, x.chunks);
    assert!(out.len() == (hi - lo) * n && hi >= lo);
    if let Src::Bf16(v) = w {
        assert!(v.len() >= hi * k);
    }
    let panel = matches!(w, Src::Fp8(_)) && x.tiles > 2;
    let panel_len = if panel { 2 * ROWS * chunks * KC } else { 0 };
    let mut a = ATiles {
        src: w,
        k,
        hi,
        panel: try_vec(panel_len, 0u16, "the widened weight panel")?,
        scratch: [[0; ROWS * KC]; 2],
    };
    // SAFETY: this function's contract.
    unsafe { tiles.configure(&Config::for_tokens(n.min(TN))) };
    let mut o = lo;
    while o < hi {
        a.fill_panel(o, chunks);
        let mut t = 0;
        while t < x.tiles {
            // SAFETY: the configuration above; `a` and `x` hand out tiles
            // inside their buffers or rows `lo..hi` of `w`.
            unsafe { block(tiles, &mut a, x, o, t, lo, out) };
            t += 2;
        }
        o += 2 * ROWS;
    }
    // SAFETY: as `configure`.
    unsafe { tiles.release() };
    Ok(())
}

/// Outputs `o..o + 32` (those below `a.hi`) against token tiles `t, t + 1`
/// (those there are): C tiles zeroed, every chunk of K in order, stored.
///
/// # Safety
/// As [`task`], configured by it.
#[allow(clippy::needless_range_loop)] // C[h][b] = A[h] x B[b], as in the math
unsafe fn block<T: Tiles>(
    tiles: &mut T,
    a: &mut ATiles<'_>,
    x: &Packed,
    o: usize,
    t: usize,
    lo: usize,
    out: &mut [f32],
) {
    let hs = if o + ROWS < a.hi { 2 } else { 1 };
    let bs = if t + 1 < x.tiles { 2 } else { 1 };
    // SAFETY: the configured tiles; every load reads a whole tile from a
    // buffer that holds it (`ATiles::get`, `Packed::tile`), every store
    // writes 16 rows of at most 64 bytes into `cbuf`.
    unsafe {
        for h in 0..hs {
            for b in 0..bs {
                tiles.zero(C[h][b]);
            }
        }
        for c in 0..x.chunks {
            for (h, &at) in A.iter().enumerate().take(hs) {
                let (p, stride) = a.get(o, h, c, x.chunks);
                tiles.load(at, p, stride);
            }
            for (b, &bt) in B.iter().enumerate().take(bs) {
                tiles.load(bt, x.tile(t + b, c), ROW_BYTES);
            }
            for h in 0..hs {
                for b in 0..bs {
                    tiles.dp(C[h][b], A[h], B[b]);
                }
            }
        }
        let n = x.n;
        let mut cbuf = [0f32; ROWS * TN];
        for h in 0..hs {
            for b in 0..bs {
                tiles.store(C[h][b], cbuf.as_mut_ptr() as *mut u8, ROW_BYTES);
                let (o0, t0) = (o + h * ROWS, (t + b) * TN);
                for i in 0..ROWS.min(a.hi - o0) {
                    for j in 0..TN.min(n - t0) {
                        out[(o0 + i - lo) * n + t0 + j] = cbuf[i * TN + j];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
