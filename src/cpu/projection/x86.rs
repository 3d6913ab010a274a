//! The SIMD kernels' side of a run ([`super::Projection::run`]): the token
//! buffers each kernel needs, built once per run, and for each task the
//! kernel entry that reads its weight format in place (or, where none
//! does, the rows' exact f32 values through the f32 entry).

use super::{avx2, avx512, GEMM_MIN_TOKENS};
use crate::batch::try_vec;
use crate::error::Result;
use crate::formats::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0, EngramType, Fp8Blocks,
    GgmlBlock, Weights,
};
use avx2::{Bf16, Fp8, CH, F32, MR, NR, Q2K, Q3K, Q4K, Q4_0, Q5K, Q6K, Q8_0};

/// An AVX2 dot-product entry (`avx2::dot_*`).
type Dot<S> = unsafe fn(S, *const u8, usize, usize, &[f32], usize, usize, usize, &mut [f32]);
/// An AVX2 GEMM entry (`avx2::gemm_*`).
type Gemm<S> = unsafe fn(
    S,
    *const u8,
    usize,
    usize,
    &[f32],
    usize,
    usize,
    usize,
    &mut [f32],
    &mut [f32],
    &mut [f32],
);

/// Weight rows as an AVX2 source reads them: `units` whole units of the
/// source from `base`, one row every `rb` bytes.
#[derive(Clone, Copy)]
struct Rows {
    base: *const u8,
    rb: usize,
    units: usize,
}

/// One run of the AVX2 kernels (built only for `Kernel::Avx2`, so the CPU
/// has avx2, fma and f16c): `n` tokens of `k` values, split for the dot
/// products (`xs`) and, from [`GEMM_MIN_TOKENS`] tokens on, packed for the
/// GEMM (`xt`).
pub(super) struct Avx2Run {
    n: usize,
    k: usize,
    /// `k` rounded up to whole chunks (`CH` values).
    kp: usize,
    xs: Vec<f32>,
    xt: Vec<f32>,
    gemm: bool,
    panel_len: usize,
    sums_len: usize,
}

impl Avx2Run {
    /// The token buffers for `rows` (`[n, k]` bf16 bits). Call it only for
    /// `Kernel::Avx2` (the tasks rely on its CPU features).
    pub(super) fn new(rows: &[u16], n: usize, k: usize) -> Result<Avx2Run> {
        let kp = k.div_ceil(CH) * CH;
        let mut xs = try_vec(n * kp, 0f32, "the token rows")?;
        avx2::split_tokens(rows, n, k, &mut xs);
        let gemm = n >= GEMM_MIN_TOKENS;
        let xt = if gemm {
            let mut xt = try_vec(n.div_ceil(NR) * kp * NR, 0f32, "the packed token rows")?;
            avx2::pack_tokens(&xs, n, kp, &mut xt);
            xt
        } else {
            Vec::new()
        };
        let (panel_len, sums_len) = avx2::gemm_scratch_len(n, kp);
        Ok(Avx2Run {
            n,
            k,
            kp,
            xs,
            xt,
            gemm,
            panel_len,
            sums_len,
        })
    }

    /// One task: output rows `lo..hi` of `w` into `out` (`[hi - lo, n]`).
    pub(super) fn task(&self, w: Weights<'_>, lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (k, kp) = (self.k, self.kp);
        let fast = k.is_multiple_of(CH);
        match w {
            Weights::Bf16(v) if fast => {
                let rows = Rows {
                    base: v.as_ptr() as *const u8,
                    rb: 2 * k,
                    units: k / CH,
                };
                // SAFETY: `v` holds rows `lo..hi` of `k` bf16 values (`run`
                // asserts its length), `k / CH` whole chunks (`fast`).
                unsafe {
                    self.rows(
                        avx2::dot_bf16,
                        avx2::gemm_bf16,
                        Bf16 { kp },
                        rows,
                        lo,
                        hi,
                        out,
                    )
                }
            }
            Weights::F32(v) if fast => {
                let rows = Rows {
                    base: v.as_ptr() as *const u8,
                    rb: 4 * k,
                    units: k / CH,
                };
                // SAFETY: as the bf16 arm, with f32 values.
                unsafe { self.rows(avx2::dot_f32, avx2::gemm_f32, F32 { kp }, rows, lo, hi, out) }
            }
            Weights::Fp8Block(b) if fast && b.bc.is_power_of_two() && b.bc >= CH && b.br >= MR => {
                self.fp8(&b, lo, hi, out)
            }
            Weights::Quant {
                format,
                data,
                row_len,
            } if row_len == k && format.is_gguf_block() => self.quant(format, data, lo, hi, out),
            _ => self.dense(w, lo, hi, out),
        }
    }

    /// Rows `lo..hi` of `rows` (units of `src`) into `out`, by dot products
    /// or, for a batch, by the GEMM.
    ///
    /// # Safety
    /// Rows `lo..hi` of `rows` are readable, each `rows.units` whole units
    /// of `src`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows<S: avx2::Src>(
        &self,
        dot: Dot<S>,
        gemm: Gemm<S>,
        src: S,
        rows: Rows,
        lo: usize,
        hi: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let Rows { base, rb, units } = rows;
        if self.gemm {
            let mut panel = try_vec(self.panel_len, 0f32, "the packed weight panel")?;
            let mut sums = try_vec(self.sums_len, 0f32, "the GEMM's lane sums")?;
            // SAFETY: an `Avx2Run` exists only under `Kernel::Avx2`, which is
            // selected only where the CPU has avx2, fma and f16c; the rows
            // are this function's contract; `xt`, `panel` and `sums` were
            // sized by `new` and `gemm_scratch_len` for `n` tokens of `kp`.
            unsafe {
                gemm(
                    src, base, rb, units, &self.xt, self.n, lo, hi, out, &mut panel, &mut sums,
                )
            }
        } else {
            // SAFETY: the features and rows as for the GEMM; `xs` holds `n`
            // split tokens of `kp` values (`new`).
            unsafe { dot(src, base, rb, units, &self.xs, self.n, lo, hi, out) }
        }
        Ok(())
    }

    /// Block-scaled fp8 read in place: the rows of one row of blocks at a
    /// time (one scale row each; a block holds whole chunks).
    fn fp8(&self, b: &Fp8Blocks<'_>, lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (k, n) = (self.k, self.n);
        let shift = b.bc.trailing_zeros();
        let mut a = lo;
        while a < hi {
            let e = ((a / b.br + 1) * b.br).min(hi);
            let src = Fp8 {
                srow: b.scale_row(a).as_ptr(),
                shift,
            };
            let rows = Rows {
                base: b.codes.as_ptr(),
                rb: k,
                units: k / CH,
            };
            let sub = &mut out[(a - lo) * n..(e - lo) * n];
            // SAFETY: `codes` holds every row of `k` one-byte codes (checked
            // by `Fp8Blocks`), `k / CH` whole chunks (`task`'s guard); rows
            // `a..e` share the scale row `srow`, and a block of `bc >= CH`
            // columns (a power of two) holds whole chunks.
            unsafe { self.rows(avx2::dot_fp8, avx2::gemm_fp8, src, rows, a, e, sub)? };
            a = e;
        }
        Ok(())
    }

    /// A GGUF block format read in place (`data` is whole rows of `k`
    /// values, whole blocks each, as `Weights::quant` checked).
    fn quant(
        &self,
        format: EngramType,
        data: &[u8],
        lo: usize,
        hi: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let k = self.k;
        let rows = |values: usize| Rows {
            base: data.as_ptr(),
            rb: format.row_bytes(k),
            units: k / values,
        };
        // SAFETY: in every arm, `data` holds rows `lo..hi` of `row_bytes(k)`
        // bytes, each `k / VALUES` whole blocks of `format` (`Weights::quant`
        // checked both; `task` that the rows are `k` long), and each source
        // is the one of its format (a unit is a block).
        unsafe {
            match format {
                EngramType::Q8_0 => {
                    let r = rows(BlockQ8_0::VALUES);
                    self.rows(avx2::dot_q8_0, avx2::gemm_q8_0, Q8_0, r, lo, hi, out)
                }
                EngramType::Q4_0 => {
                    let r = rows(BlockQ4_0::VALUES);
                    self.rows(avx2::dot_q4_0, avx2::gemm_q4_0, Q4_0, r, lo, hi, out)
                }
                EngramType::Q2_K => {
                    let r = rows(BlockQ2K::VALUES);
                    self.rows(avx2::dot_q2_k, avx2::gemm_q2_k, Q2K, r, lo, hi, out)
                }
                EngramType::Q3_K => {
                    let r = rows(BlockQ3K::VALUES);
                    self.rows(avx2::dot_q3_k, avx2::gemm_q3_k, Q3K, r, lo, hi, out)
                }
                EngramType::Q4_K => {
                    let r = rows(BlockQ4K::VALUES);
                    self.rows(avx2::dot_q4_k, avx2::gemm_q4_k, Q4K, r, lo, hi, out)
                }
                EngramType::Q5_K => {
                    let r = rows(BlockQ5K::VALUES);
                    self.rows(avx2::dot_q5_k, avx2::gemm_q5_k, Q5K, r, lo, hi, out)
                }
                EngramType::Q6_K => {
                    let r = rows(BlockQ6K::VALUES);
                    self.rows(avx2::dot_q6_k, avx2::gemm_q6_k, Q6K, r, lo, hi, out)
                }
                _ => unreachable!("{} is not a GGUF block format", format.name()),
            }
        }
    }

    /// Any other format or K: the rows' exact f32 values (the reference
    /// dequantisation), zero-padded to whole chunks.
    fn dense(&self, w: Weights<'_>, lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (k, kp) = (self.k, self.kp);
        let mut wf = try_vec((hi - lo) * kp, 0f32, "the dequantised weight rows")?;
        for (r, row) in wf.chunks_exact_mut(kp).enumerate() {
            w.to_f32((lo + r) * k, &mut row[..k]);
        }
        let rows = Rows {
            base: wf.as_ptr() as *const u8,
            rb: 4 * kp,
            units: kp / CH,
        };
        // SAFETY: `wf` holds rows `0..hi - lo` of `kp` f32 values, `kp / CH`
        // whole chunks.
        unsafe {
            self.rows(
                avx2::dot_f32,
                avx2::gemm_f32,
                F32 { kp },
                rows,
                0,
                hi - lo,
                out,
            )
        }
    }
}

/// One run of the AVX-512 kernels (built only for `Kernel::Avx512` or
/// `Kernel::Avx512Bf16`, so the CPU has avx512f, avx512bw, avx2, fma and
/// f16c, and avx512bf16 for the latter): every format in one order (see
/// `avx512/`), the tokens as f32 with each 32-value chunk split into its
/// odd and even elements (`xs`), or, for `vdpbf16ps` (`dot`: bf16 and fp8
/// weights under `Kernel::Avx512Bf16`), as bf16 pairs (`xb`).
pub(super) struct Avx512Run {
    n: usize,
    k: usize,
    dot: bool,
    xs: Vec<f32>,
    xb: Vec<u16>,
    /// The tokens quantised for the integer dot products (`Q8_0`, `Q4_K`
    /// when the projection asks for them).
    xq: Option<avx512::QTokens>,
}

impl Avx512Run {
    /// The token buffers for `rows` (`[n, k]` bf16 bits) against `w`. Call
    /// it only for `Kernel::Avx512` or (`bf16_dot`) `Kernel::Avx512Bf16`
    /// (the tasks rely on their CPU features), and `int_dot` (the token
    /// block scale of the integer dot products) only where
    /// `Projection::int_dot` holds.
    pub(super) fn new(
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        bf16_dot: bool,
        int_dot: Option<fn(f32) -> f32>,
    ) -> Result<Avx512Run> {
        if let Some(scale) = int_dot {
            let xq = avx512::QTokens::new(rows, n, k, scale)?;
            return Ok(Avx512Run {
                n,
                k,
                dot: false,
                xs: Vec::new(),
                xb: Vec::new(),
                xq: Some(xq),
            });
        }
        let dot = bf16_dot && matches!(w, Weights::Bf16(_) | Weights::Fp8Block(_));
        let (xs, xb) = if dot {
            (Vec::new(), avx512::pack_bf16(rows, n, k)?)
        } else {
            (avx512::pair_split(rows, n, k)?, Vec::new())
        };
        Ok(Avx512Run {
            n,
            k,
            dot,
            xs,
            xb,
            xq: None,
        })
    }

    /// One task: output rows `lo..hi` of `w` into `out` (`[hi - lo, n]`).
    pub(super) fn task(&self, w: Weights<'_>, lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.n, self.k);
        match w {
            Weights::Bf16(wb) => self.bf16(wb, lo, hi, out),
            Weights::Fp8Block(b) => self.fp8(&b, lo, hi, out),
            Weights::F32(v) if k.is_multiple_of(32) => {
                // SAFETY: the features of `Kernel::Avx512` (this run's
                // kernel); `v` holds rows `lo..hi` of `k` f32 values, whole
                // 32-value blocks of the f32 source; `xs` is `[n, k]` in
                // `pair_split` layout.
                unsafe {
                    avx512::range_f32(v.as_ptr() as *const u8, 4 * k, &self.xs, n, k, lo, hi, out)
                }
            }
            Weights::Quant {
                format,
                data,
                row_len,
            } if row_len == k && k.is_multiple_of(32) => self.quant(w, format, data, lo, hi, out),
            _ => self.dense(w, lo, hi, out),
        }
    }

    /// bf16 rows `lo..hi` of `wb` (`[_, k]`, at least `hi` rows), by
    /// `vdpbf16ps` where `dot`, else by f32 FMA: the same bits.
    fn bf16(&self, wb: &[u16], lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.n, self.k);
        if self.dot {
            // SAFETY: `dot` is set only under `Kernel::Avx512Bf16`, selected
            // only where the CPU has avx512f, avx512bw and avx512bf16; `xb`
            // is `pack_bf16`'s layout of `n` tokens of `k`; `range_bf16_dp`
            // asserts that `wb` holds `hi` rows.
            unsafe { avx512::range_bf16_dp(&self.xb, n, k, wb, lo, hi, out) }
        } else {
            // SAFETY: avx512f and avx512bw (`Kernel::Avx512`, the features
            // every AVX-512 run has); `xs` is `pair_split`'s layout of `n`
            // tokens of `k`; `range_bf16` asserts that `wb` holds `hi` rows.
            unsafe { avx512::range_bf16(&self.xs, n, k, wb, lo, hi, out) }
        }
    }

    /// Block-scaled fp8 rows `lo..hi`: converted in registers where the
    /// block shape allows (`k` and the block width multiples of 32, the
    /// width a power of two), else widened to bf16 (exact) and run through
    /// the bf16 kernel: the same order, so the same bits.
    fn fp8(&self, b: &Fp8Blocks<'_>, lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.n, self.k);
        let in_registers = k.is_multiple_of(32) && b.bc.is_power_of_two() && b.bc >= 32;
        if in_registers && self.dot {
            // SAFETY: `dot` as in `bf16`; the shape conditions of
            // `range_fp8_dp` are `in_registers`, and it asserts the rows.
            return unsafe { avx512::range_fp8_dp(&self.xb, n, k, b, lo, hi, out) };
        }
        if in_registers {
            // SAFETY: avx512f, avx512bw and f16c (every AVX-512 run); the
            // shape conditions of `range_fp8` are `in_registers`, and it
            // asserts the rows.
            return unsafe { avx512::range_fp8(&self.xs, n, k, b, lo, hi, out) };
        }
        let mut wb = try_vec((hi - lo) * k, 0u16, "the widened weight rows")?;
        let mut row = try_vec(k, 0f32, "a weight row")?;
        for (r, o) in wb.chunks_exact_mut(k).enumerate() {
            b.to_f32((lo + r) * k, &mut row);
            for (o, &v) in o.iter_mut().zip(&row) {
                *o = (v.to_bits() >> 16) as u16;
            }
        }
        self.bf16(&wb, 0, hi - lo, out)
    }

    /// f16 or a GGUF block format read in place (`data` is whole rows of
    /// `k` values, whole blocks each, as `Weights::quant` checked).
    fn quant(
        &self,
        w: Weights<'_>,
        format: EngramType,
        data: &[u8],
        lo: usize,
        hi: usize,
        out: &mut [f32],
    ) -> Result<()> {
        let (n, k, xs) = (self.n, self.k, &self.xs);
        let (p, rb) = (data.as_ptr(), format.row_bytes(k));
        if let Some(xq) = &self.xq {
            // SAFETY: `xq` is built only when the projection's `int_dot`
            // held: an AVX-512 kernel (avx512f, avx512bw, avx2, fma, f16c)
            // on a CPU with avx512vnni, `k` a multiple of `QB`, and the
            // format `Q8_0` or `Q4_K`; `data` holds rows `lo..hi` of `rb`
            // bytes, whole blocks (`Weights::quant` checked).
            return unsafe {
                match format {
                    EngramType::Q8_0 => avx512::range_q8_0_int(p, rb, xq, n, k, lo, hi, out),
                    EngramType::Q4_K => avx512::range_q4_k_int(p, rb, xq, n, k, lo, hi, out),
                    _ => unreachable!("{} has no integer dot products", format.name()),
                }
            };
        }
        // SAFETY: in every arm, the features of every AVX-512 run (avx512f,
        // avx512bw, avx2, fma, f16c); `data` holds rows `lo..hi` of `rb`
        // bytes, each `k / VALUES` whole blocks of `format` (`Weights::quant`
        // checked the sizes, `task`'s guard the row length), and each entry
        // is the one of its format; `xs` is `pair_split`'s layout.
        unsafe {
            match format {
                EngramType::F16 => avx512::range_f16(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q8_0 => avx512::range_q8_0(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q4_0 => avx512::range_q4_0(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q2_K => avx512::range_q2_k(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q3_K => avx512::range_q3_k(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q4_K => avx512::range_q4_k(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q5_K => avx512::range_q5_k(p, rb, xs, n, k, lo, hi, out),
                EngramType::Q6_K => avx512::range_q6_k(p, rb, xs, n, k, lo, hi, out),
                _ => self.dense(w, lo, hi, out),
            }
        }
    }

    /// Rows `lo..hi` of any weights not read in place (K not a multiple of
    /// 32): their exact f32 values (the reference dequantisation),
    /// zero-padded to whole chunks, through the f32 source.
    fn dense(&self, w: Weights<'_>, lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
        let (n, k) = (self.n, self.k);
        let kp = k.div_ceil(32) * 32;
        let mut wf = try_vec((hi - lo) * kp, 0f32, "the dequantised weight rows")?;
        for (r, row) in wf.chunks_exact_mut(kp).enumerate() {
            w.to_f32((lo + r) * k, &mut row[..k]);
        }
        // SAFETY: the features of every AVX-512 run; `wf` holds rows
        // `0..hi - lo` of `kp` f32 values, whole blocks of the f32 source;
        // `xs` is `[n, kp]` in `pair_split` layout.
        unsafe {
            avx512::range_f32(
                wf.as_ptr() as *const u8,
                4 * kp,
                &self.xs,
                n,
                kp,
                0,
                hi - lo,
                out,
            )
        }
    }
}
