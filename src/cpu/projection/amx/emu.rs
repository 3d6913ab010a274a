//! The tile instructions in software, as the Intel SDM (Vol. 2, revision of
//! 2023 and later: "TDPBF16PS", Operation) describes them, for palette 1
//! (8 tiles of at most 16 rows x 64 bytes). What the hardware would fault
//! on (a shape the instruction refuses, no configuration) panics.
//!
//! `tdpbf16ps`, for each C element: two f32 partial sums start at zero; for
//! each bf16 pair of the A row (in order) the even products are added into
//! the first and the odd products into the second, each addition an FMA
//! rounded to nearest even; then the element takes `C + (even + odd)`.
//! Inputs that are subnormal are read as zero (DAZ) and subnormal results
//! are flushed to zero (FTZ); MXCSR plays no part. (Intel's intrinsics
//! guide still shows an older pseudocode, one running sum per element;
//! which of the two the silicon does is checked on an AMX machine by
//! `amx_hardware_matches_emulation`.)

use super::{Config, Tiles, ROWS, ROW_BYTES};

/// The tile registers and configuration of one thread.
pub(crate) struct Emu {
    cfg: Option<Config>,
    t: [[u8; ROWS * ROW_BYTES]; 8],
}

impl Default for Emu {
    fn default() -> Self {
        Emu {
            cfg: None,
            t: [[0; ROWS * ROW_BYTES]; 8],
        }
    }
}

/// An f32 read as the instruction reads its inputs: subnormals as zero.
pub(crate) fn daz(x: f32) -> f32 {
    if x.is_subnormal() {
        0f32.copysign(x)
    } else {
        x
    }
}

/// `a * b + c` rounded once to nearest even, inputs DAZ, result FTZ.
pub(crate) fn fma_daz_ftz(a: f32, b: f32, c: f32) -> f32 {
    daz(daz(a).mul_add(daz(b), daz(c)))
}

/// A bf16 as f32 (`make_fp32`).
fn bf(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

impl Emu {
    /// Tile `t`'s (rows, bytes a row); panics when it is not configured.
    fn shape(&self, t: u8) -> (usize, usize) {
        let c = self.cfg.as_ref().expect("no tile configuration (#UD)");
        let (r, b) = (c.rows[t as usize] as usize, c.colsb[t as usize] as usize);
        assert!(t < 8 && r > 0 && b > 0, "tile {t} is not configured (#UD)");
        (r, b)
    }

    fn word(&self, t: u8, r: usize, i: usize) -> u16 {
        let p = r * ROW_BYTES + 2 * i;
        u16::from_le_bytes([self.t[t as usize][p], self.t[t as usize][p + 1]])
    }

    fn f32_at(&self, t: u8, r: usize, i: usize) -> f32 {
        let p = r * ROW_BYTES + 4 * i;
        f32::from_le_bytes(self.t[t as usize][p..p + 4].try_into().unwrap())
    }
}

impl Tiles for Emu {
    unsafe fn configure(&mut self, cfg: &Config) {
        assert!(cfg.palette == 1 && cfg.start_row == 0, "palette 1 only");
        for t in 0..16 {
            let (r, b) = (cfg.rows[t] as usize, cfg.colsb[t] as usize);
            assert!(r <= ROWS && b <= ROW_BYTES, "tile {t}: {r} x {b} (#GP)");
            assert!(t < 8 || (r == 0 && b == 0), "palette 1 has 8 tiles");
            assert!((r == 0) == (b == 0), "tile {t}: {r} x {b} (#GP)");
        }
        self.cfg = Some(*cfg);
        self.t = [[0; ROWS * ROW_BYTES]; 8];
    }

    unsafe fn zero(&mut self, t: u8) {
        self.shape(t);
        self.t[t as usize] = [0; ROWS * ROW_BYTES];
    }

    unsafe fn load(&mut self, t: u8, p: *const u8, stride: usize) {
        let (rows, bytes) = self.shape(t);
        let mut tile = [0u8; ROWS * ROW_BYTES];
        for r in 0..rows {
            // SAFETY: `Tiles::load`'s contract: `p` holds the configured
            // rows x bytes at `stride`.
            let src = unsafe { std::slice::from_raw_parts(p.add(r * stride), bytes) };
            tile[r * ROW_BYTES..r * ROW_BYTES + bytes].copy_from_slice(src);
        }
        self.t[t as usize] = tile;
    }

    unsafe fn dp(&mut self, c: u8, a: u8, b: u8) {
        let ((cr, cb), (ar, ab), (br, bb)) = (self.shape(c), self.shape(a), self.shape(b));
        assert!(
            cr == ar && cb == bb && ab / 4 == br && c != a && c != b && a != b,
            "tdpbf16ps shapes C {cr}x{cb} A {ar}x{ab} B {br}x{bb} (#UD)"
        );
        let mut out = [0u8; ROWS * ROW_BYTES];
        for m in 0..cr {
            for n in 0..cb / 4 {
                let (mut even, mut odd) = (0f32, 0f32);
                for k in 0..ab / 4 {
                    let (a0, a1) = (bf(self.word(a, m, 2 * k)), bf(self.word(a, m, 2 * k + 1)));
                    let (b0, b1) = (bf(self.word(b, k, 2 * n)), bf(self.word(b, k, 2 * n + 1)));
                    even = fma_daz_ftz(a0, b0, even);
                    odd = fma_daz_ftz(a1, b1, odd);
                }
                let sum = daz(daz(even) + daz(odd));
                let v = daz(daz(self.f32_at(c, m, n)) + sum);
                out[m * ROW_BYTES + 4 * n..][..4].copy_from_slice(&v.to_le_bytes());
            }
        }
        self.t[c as usize] = out;
    }

    unsafe fn store(&mut self, t: u8, p: *mut u8, stride: usize) {
        let (rows, bytes) = self.shape(t);
        for r in 0..rows {
            // SAFETY: `Tiles::store`'s contract: `p` has room for the
            // configured rows x bytes at `stride`.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.add(r * stride), bytes) };
            dst.copy_from_slice(&self.t[t as usize][r * ROW_BYTES..][..bytes]);
        }
    }

    unsafe fn release(&mut self) {
        self.cfg = None;
        self.t = [[0; ROWS * ROW_BYTES]; 8];
    }
}
