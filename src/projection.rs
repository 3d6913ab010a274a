//! The projection `kv = rows @ wkv^T` on the CPU: bf16 rows, f32 accumulate,
//! bf16 result (held as f32). One portable kernel, and AVX-512 FMA tiles
//! chosen at run time where the CPU has them. Work is split over output rows
//! on the context's own thread pool.
//!
//! Both kernels sum the `K` products of an output in f32, in different orders;
//! the tests hold both to the same bound (see `tests/golden.rs`). Within one
//! kernel and weight type, each output's order is fixed: a token's `kv` does
//! not depend on the batch it came in (engines can check a batched run against
//! a straight one bit for bit).
//!
//! f32 FMA rather than `vdpbf16ps`: on the AVX-512 machines measured here the
//! BF16 dot product issues on one port and FMA on two (96 against 183 GFLOP/s
//! on one core), and widening bf16 to f32 is a shift or a mask.

use crate::formats::{bf16_to_f32, f32_to_bf16, Weights};
use rayon::prelude::*;

/// Which kernel computes the dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, f32 arithmetic (vectorised by the compiler).
    Portable,
    /// AVX-512 f32 FMA tiles: bf16 weights widened in registers, f32 and
    /// (dequantised per task) quantised weights as they are.
    Avx512,
}

impl Kernel {
    /// The best kernel this CPU runs.
    pub fn detect() -> Kernel {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
            {
                return Kernel::Avx512;
            }
        }
        Kernel::Portable
    }
}

/// Up to this many tokens, q8_0 and q2_K weights are dequantised in registers
/// inside the FMA tiles rather than through a per-task f32 buffer.
const FUSED_MAX_TOKENS: usize = 4;

/// Output rows of `wkv` per task handed to a worker.
const CHUNK: usize = 64;
/// Tokens whose rows are kept hot in cache while a chunk of weights is reused.
const TOKEN_BLOCK: usize = 64;

/// The projection with its thread pool.
pub struct Projection {
    pool: Option<rayon::ThreadPool>,
    threads: usize,
    kernel: Kernel,
}

impl Projection {
    /// A projection using at most `threads` threads (the caller's thread
    /// included: a pool of `threads` workers runs the work while the caller
    /// waits). `threads <= 1` runs everything on the calling thread.
    pub fn new(threads: usize) -> std::io::Result<Projection> {
        let pool = if threads > 1 {
            Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(|i| format!("engram-{i}"))
                    .build()
                    .map_err(std::io::Error::other)?,
            )
        } else {
            None
        };
        Ok(Projection {
            pool,
            threads: threads.max(1),
            kernel: Kernel::detect(),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Use `kernel` from now on (for tests and benchmarks comparing kernels).
    /// Asking for a kernel the CPU lacks keeps the portable one.
    pub fn set_kernel(&mut self, kernel: Kernel) {
        self.kernel = if kernel == Kernel::Portable || Kernel::detect() == kernel {
            kernel
        } else {
            Kernel::Portable
        };
    }

    /// `kv[t][o] = bf16(sum_i rows[t][i] * w[o][i])` for `rows` `[n, k]` (bf16
    /// bits) and `w` `[n_out, k]`; `kv` is `[n, n_out]` and receives the bf16
    /// values as f32.
    pub fn run(
        &self,
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        n_out: usize,
        kv: &mut [f32],
    ) {
        assert_eq!(rows.len(), n * k);
        assert_eq!(w.len(), n_out * k);
        assert_eq!(kv.len(), n * n_out);
        if n == 0 || n_out == 0 {
            return;
        }
        let kernel = self.kernel;
        // The AVX-512 bf16 kernel reads tokens as f32 split into odd and even
        // elements of each 32-value chunk; the other kernels as plain f32 rows.
        let bf16_pairs = kernel == Kernel::Avx512 && matches!(w, Weights::Bf16(_));
        let xs: Vec<f32> = if bf16_pairs {
            pair_split(rows, n, k)
        } else {
            rows.iter().map(|&b| bf16_to_f32(b)).collect()
        };
        #[cfg(target_arch = "x86_64")]
        let fused_ok = std::arch::is_x86_feature_detected!("f16c");
        // Outputs are computed o-major (`[n_out, n]`) so that each task owns a
        // contiguous slice, then transposed into `kv`.
        let mut kvt = vec![0f32; n_out * n];
        let body = |(ci, out): (usize, &mut [f32])| {
            let lo = ci * CHUNK;
            let hi = (lo + CHUNK).min(n_out);
            match (kernel, w) {
                #[cfg(target_arch = "x86_64")]
                (Kernel::Avx512, Weights::Bf16(wb)) => {
                    // SAFETY: `Kernel::Avx512` is only selected when the CPU
                    // has avx512f and avx512bw; sizes are asserted above.
                    unsafe { avx512::range_bf16(&xs, n, k, wb, lo, hi, out) }
                }
                #[cfg(target_arch = "x86_64")]
                (
                    Kernel::Avx512,
                    Weights::Quant {
                        format: f @ (crate::RowFormat::Q8_0 | crate::RowFormat::Q2_K),
                        data,
                        row_len,
                    },
                ) if n <= FUSED_MAX_TOKENS && row_len == k && fused_ok => {
                    // Few tokens: dequantise in registers as the FMAs need the
                    // values, instead of through a buffer (same values, same order).
                    let rb = f.row_bytes(k);
                    // SAFETY: the CPU has avx512f, avx512bw and f16c (`fused_ok`);
                    // the rows are whole blocks of `f`.
                    unsafe {
                        avx512::range_quant(
                            &xs,
                            n,
                            k,
                            &data[lo * rb..hi * rb],
                            rb,
                            f == crate::RowFormat::Q2_K,
                            hi - lo,
                            out,
                        )
                    }
                }
                #[cfg(target_arch = "x86_64")]
                (Kernel::Avx512, _) => {
                    // f32 or quantised weights: dequantise this task's rows to
                    // f32 once, then f32 FMA tiles against every token.
                    let mut wf = vec![0f32; (hi - lo) * k];
                    dequant_rows(w, lo, hi, k, &mut wf);
                    // SAFETY: as above.
                    unsafe { avx512::range_f32(&xs, n, k, &wf, hi - lo, out) }
                }
                _ => portable_range(&xs, n, k, w, lo, hi, out),
            }
        };
        match &self.pool {
            Some(p) if n_out > CHUNK => {
                p.install(|| kvt.par_chunks_mut(CHUNK * n).enumerate().for_each(body))
            }
            _ => kvt.chunks_mut(CHUNK * n).enumerate().for_each(body),
        }
        for o in 0..n_out {
            for t in 0..n {
                kv[t * n_out + o] = kvt[o * n + t];
            }
        }
    }
}

/// Rows `lo..hi` of `w` (rows of `k` values) as f32 into `out`: the exact
/// values `formats::dequant_row_f32` gives, with AVX-512 loops for the
/// formats a decode step reads most (q8_0, q2_K) where the CPU has them.
pub fn dequant_rows(w: Weights<'_>, lo: usize, hi: usize, k: usize, out: &mut [f32]) {
    assert_eq!(out.len(), (hi - lo) * k);
    #[cfg(target_arch = "x86_64")]
    if let Weights::Quant {
        format,
        data,
        row_len,
    } = w
    {
        if row_len == k && std::arch::is_x86_feature_detected!("avx512f") {
            let rb = format.row_bytes(k);
            let bytes = &data[lo * rb..hi * rb];
            match format {
                // SAFETY: the CPU has avx512f; whole blocks in and out.
                crate::RowFormat::Q8_0 => return unsafe { avx512::dequant_q8_0(bytes, out) },
                crate::RowFormat::Q2_K => return unsafe { avx512::dequant_q2_k(bytes, out) },
                _ => {}
            }
        }
    }
    w.to_f32(lo * k, out);
}

/// 32-value chunks per k block of the bf16 kernel (6 weight rows x 1024 bf16
/// = 12 KB stay in L1 while the block's token vectors stream past).
const KBC: usize = 32;

/// Token rows (bf16 bits, `[n, k]`) as f32 in the bf16 kernel's layout: k
/// blocks of `KBC` chunks of 32 values, each block holding every token's
/// chunks contiguously (`[block][token][chunk][32]`), and within a chunk the
/// 16 odd-indexed values then the 16 even-indexed ones; zero past `k`.
fn pair_split(rows: &[u16], n: usize, k: usize) -> Vec<f32> {
    let chunks = k.div_ceil(32);
    let mut xs = vec![0f32; n * chunks * 32];
    for (t, r) in rows.chunks_exact(k).enumerate() {
        for c in 0..chunks {
            let x = &mut xs[pair_offset(n, chunks, t, c)..][..32];
            let src = &r[c * 32..(c * 32 + 32).min(k)];
            for (j, &b) in src.iter().enumerate() {
                x[if j % 2 == 1 { j / 2 } else { 16 + j / 2 }] = bf16_to_f32(b);
            }
        }
    }
    xs
}

/// Where token `t`'s chunk `c` starts in [`pair_split`]'s layout.
#[inline]
fn pair_offset(n: usize, chunks: usize, t: usize, c: usize) -> usize {
    let (b, within) = (c / KBC, c % KBC);
    let in_block = KBC.min(chunks - b * KBC);
    (b * KBC * n + t * in_block + within) * 32
}

/// Round an f32 sum to bf16, held as f32.
#[inline]
fn to_bf16_value(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

fn portable_range(
    rows: &[f32],
    n: usize,
    k: usize,
    w: Weights<'_>,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) {
    let mut wrow = vec![0f32; k];
    for o in lo..hi {
        w.to_f32(o * k, &mut wrow);
        for t in 0..n {
            out[(o - lo) * n + t] = to_bf16_value(dot(&rows[t * k..(t + 1) * k], &wrow));
        }
    }
}

/// An f32 dot product with eight independent partial sums (so the compiler
/// can keep them in vector registers), summed pairwise at the end.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{pair_offset, to_bf16_value, KBC, TOKEN_BLOCK};
    use std::arch::x86_64::*;

    /// Weight rows per micro-kernel call, tokens per micro-kernel call.
    const R: usize = 4;
    const T: usize = 4;

    fn f16(lo: u8, hi: u8) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
    }

    /// q8_0 blocks (f16 `d`, 32 i8) to f32: `q * d`, exact in f32.
    ///
    /// # Safety
    /// The CPU must have avx512f; `data` is whole 34-byte blocks, `out` 32
    /// values per block.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dequant_q8_0(data: &[u8], out: &mut [f32]) {
        assert_eq!(data.len() / 34 * 32, out.len());
        for (b, o) in data.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
            let d = _mm512_set1_ps(f16(b[0], b[1]));
            let q0 = _mm_loadu_si128(b.as_ptr().add(2) as *const __m128i);
            let q1 = _mm_loadu_si128(b.as_ptr().add(18) as *const __m128i);
            let f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0));
            let f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1));
            _mm512_storeu_ps(o.as_mut_ptr(), _mm512_mul_ps(f0, d));
            _mm512_storeu_ps(o.as_mut_ptr().add(16), _mm512_mul_ps(f1, d));
        }
    }

    /// q2_K super-blocks (`scales[16]`, `qs[64]`, f16 `d`, f16 `dmin`) to f32
    /// in ggml's order: for each half of 128 values and each 2-bit shift, 16
    /// values from `qs[0..16]` then 16 from `qs[16..32]`, each group with its
    /// own 4-bit scale and min: `d*sc * q - dmin*m`. `d*sc`, `dmin*m` and their
    /// product with `q` are exact in f32, so the fused subtract rounds once,
    /// exactly as ggml's separate operations do.
    ///
    /// # Safety
    /// The CPU must have avx512f; `data` is whole 84-byte blocks, `out` 256
    /// values per block.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dequant_q2_k(data: &[u8], out: &mut [f32]) {
        assert_eq!(data.len() / 84 * 256, out.len());
        let three = _mm512_set1_epi32(3);
        for (b, o) in data.chunks_exact(84).zip(out.chunks_exact_mut(256)) {
            let (scales, qs) = (&b[..16], &b[16..80]);
            let (d, dmin) = (f16(b[80], b[81]), f16(b[82], b[83]));
            let mut y = 0;
            let mut is = 0;
            for half in 0..2 {
                let q = &qs[32 * half..32 * half + 32];
                let qa = _mm512_cvtepu8_epi32(_mm_loadu_si128(q.as_ptr() as *const __m128i));
                let qb =
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(q.as_ptr().add(16) as *const __m128i));
                for shift in [0u32, 2, 4, 6] {
                    let sh = _mm_cvtsi32_si128(shift as i32);
                    for qv in [qa, qb] {
                        let sc = scales[is];
                        is += 1;
                        let dl = _mm512_set1_ps(d * (sc & 0xF) as f32);
                        let ml = _mm512_set1_ps(dmin * (sc >> 4) as f32);
                        let v =
                            _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(qv, sh), three));
                        _mm512_storeu_ps(o.as_mut_ptr().add(y), _mm512_fmsub_ps(dl, v, ml));
                        y += 16;
                    }
                }
            }
        }
    }

    /// All `m` rows of `w` (`[m, k]` f32) against all `n` f32 token rows into
    /// `out` (`[m, n]`), f32 FMA in tiles of 4 x 4, bf16-rounded.
    ///
    /// # Safety
    /// The CPU must have avx512f; sizes as stated.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn range_f32(
        rows: &[f32],
        n: usize,
        k: usize,
        w: &[f32],
        m: usize,
        out: &mut [f32],
    ) {
        debug_assert!(w.len() == m * k && rows.len() == n * k && out.len() == m * n);
        let mut tb = 0;
        while tb < n {
            let te = (tb + TOKEN_BLOCK).min(n);
            let mut o = 0;
            while o < m {
                let r = (m - o).min(R);
                let mut t = tb;
                while t < te {
                    let tt = (te - t).min(T);
                    let mut wp = [w.as_ptr(); R];
                    for (i, p) in wp.iter_mut().enumerate().take(r) {
                        *p = w.as_ptr().add((o + i) * k);
                    }
                    let mut xp = [rows.as_ptr(); T];
                    for (j, p) in xp.iter_mut().enumerate().take(tt) {
                        *p = rows.as_ptr().add((t + j) * k);
                    }
                    let s = match (r, tt) {
                        (4, 4) => fma::<4, 4>(&wp, &xp, k),
                        (4, 1) => fma::<4, 1>(&wp, &xp, k),
                        _ => fma_any(&wp, &xp, r, tt, k),
                    };
                    for i in 0..r {
                        for j in 0..tt {
                            out[(o + i) * n + t + j] = to_bf16_value(s[i][j]);
                        }
                    }
                    t += tt;
                }
                o += r;
            }
            tb = te;
        }
    }

    /// As [`range_f32`] for q8_0 (`q2k == false`) or q2_K weight rows `data`
    /// (`m` rows of `rb` bytes), dequantised 16 values at a time in registers:
    /// the same values (see `dequant_q8_0`, `dequant_q2_k`) in the same order,
    /// so the same bits as the buffered path.
    ///
    /// # Safety
    /// The CPU must have avx512f, avx512bw and f16c; `k` is whole blocks.
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn range_quant(
        rows: &[f32],
        n: usize,
        k: usize,
        data: &[u8],
        rb: usize,
        q2k: bool,
        m: usize,
        out: &mut [f32],
    ) {
        assert!(data.len() == m * rb && rows.len() == n * k && out.len() == m * n);
        assert!(k % if q2k { 256 } else { 32 } == 0);
        let mut o = 0;
        while o < m {
            let r = (m - o).min(R);
            let mut t = 0;
            while t < n {
                let tt = (n - t).min(T);
                let mut wp = [data.as_ptr(); R];
                for (i, p) in wp.iter_mut().enumerate().take(r) {
                    *p = data.as_ptr().add((o + i) * rb);
                }
                let mut xp = [rows.as_ptr(); T];
                for (j, p) in xp.iter_mut().enumerate().take(tt) {
                    *p = rows.as_ptr().add((t + j) * k);
                }
                macro_rules! tile {
                    ($($rr:literal, $t:literal);*) => {
                        match (r, tt) {
                            $(($rr, $t) => fma_quant::<$rr, $t>(q2k, &wp, &xp, k),)*
                            _ => unreachable!("tiles are at most {R} x {T}"),
                        }
                    };
                }
                let s = tile!(4, 4; 4, 3; 4, 2; 4, 1; 3, 4; 3, 3; 3, 2; 3, 1; 2, 4; 2, 3; 2, 2; 2, 1; 1, 4; 1, 3; 1, 2; 1, 1);
                for i in 0..r {
                    for j in 0..tt {
                        out[(o + i) * n + t + j] = to_bf16_value(s[i][j]);
                    }
                }
                t += tt;
            }
            o += r;
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn f16c(p: *const u8) -> f32 {
        let bits = u16::from_le_bytes([*p, *p.add(1)]);
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 16 weights starting at `kk` of a q8_0 row.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn q8_0_vec(row: *const u8, kk: usize) -> __m512 {
        let b = row.add(kk / 32 * 34);
        let q = _mm_loadu_si128(b.add(2 + (kk % 32)) as *const __m128i);
        _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
            _mm512_set1_ps(f16c(b)),
        )
    }

    /// 16 weights starting at `kk` (a multiple of 16) of a q2_K row: group `g`
    /// of its super-block uses scale byte `g`, the 16 bytes of `qs` at
    /// `32*(g/8) + 16*(g%2)`, shifted by `2*((g%8)/2)`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn q2_k_vec(row: *const u8, kk: usize) -> __m512 {
        let b = row.add(kk / 256 * 84);
        let g = (kk % 256) / 16;
        let sc = *b.add(g);
        let (d, dmin) = (f16c(b.add(80)), f16c(b.add(82)));
        let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(
            b.add(16 + 32 * (g / 8) + 16 * (g % 2)) as *const __m128i
        ));
        let shift = _mm_cvtsi32_si128((2 * ((g % 8) / 2)) as i32);
        let v = _mm512_cvtepi32_ps(_mm512_and_si512(
            _mm512_srl_epi32(q, shift),
            _mm512_set1_epi32(3),
        ));
        _mm512_fmsub_ps(
            _mm512_set1_ps(d * (sc & 0xF) as f32),
            v,
            _mm512_set1_ps(dmin * (sc >> 4) as f32),
        )
    }

    /// An `RR x TT` tile like [`fma`], weights dequantised in registers.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,f16c")]
    unsafe fn fma_quant<const RR: usize, const TT: usize>(
        q2k: bool,
        wp: &[*const u8; R],
        xp: &[*const f32; T],
        k: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm512_setzero_ps(); TT]; RR];
        let mut kk = 0;
        while kk < k {
            let mut wv = [_mm512_setzero_ps(); RR];
            for i in 0..RR {
                wv[i] = if q2k {
                    q2_k_vec(wp[i], kk)
                } else {
                    q8_0_vec(wp[i], kk)
                };
            }
            for j in 0..TT {
                let x = _mm512_loadu_ps(xp[j].add(kk));
                for i in 0..RR {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], x, acc[i][j]);
                }
            }
            kk += 16;
        }
        let mut s = [[0f32; T]; R];
        for i in 0..RR {
            for j in 0..TT {
                s[i][j] = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
        s
    }

    /// An `RR x TT` tile of f32 dot products with FMA, 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma<const RR: usize, const TT: usize>(
        wp: &[*const f32; R],
        xp: &[*const f32; T],
        k: usize,
    ) -> [[f32; T]; R] {
        let mut acc = [[_mm512_setzero_ps(); TT]; RR];
        let mut kk = 0;
        while kk + 16 <= k {
            let mut wv = [_mm512_loadu_ps(wp[0].add(kk)); RR];
            for i in 1..RR {
                wv[i] = _mm512_loadu_ps(wp[i].add(kk));
            }
            for j in 0..TT {
                let x = _mm512_loadu_ps(xp[j].add(kk));
                for i in 0..RR {
                    acc[i][j] = _mm512_fmadd_ps(wv[i], x, acc[i][j]);
                }
            }
            kk += 16;
        }
        if kk < k {
            let m: __mmask16 = (1u32 << (k - kk)) as u16 - 1;
            for i in 0..RR {
                let wv = _mm512_maskz_loadu_ps(m, wp[i].add(kk));
                for j in 0..TT {
                    acc[i][j] =
                        _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, xp[j].add(kk)), acc[i][j]);
                }
            }
        }
        let mut s = [[0f32; T]; R];
        for i in 0..RR {
            for j in 0..TT {
                s[i][j] = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
        s
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fma_any(
        wp: &[*const f32; R],
        xp: &[*const f32; T],
        r: usize,
        tt: usize,
        k: usize,
    ) -> [[f32; T]; R] {
        macro_rules! tile {
            ($($rr:literal, $t:literal);*) => {
                match (r, tt) {
                    $(($rr, $t) => fma::<$rr, $t>(wp, xp, k),)*
                    _ => unreachable!("tiles are at most {R} x {T}"),
                }
            };
        }
        tile!(1, 1; 1, 2; 1, 3; 1, 4; 2, 1; 2, 2; 2, 3; 2, 4; 3, 1; 3, 2; 3, 3; 3, 4; 4, 1; 4, 2; 4, 3; 4, 4)
    }

    /// Weight rows per bf16 tile.
    const RB: usize = 6;
    /// Tokens per bf16 token block (their accumulators wait in a small buffer
    /// while the weight panel of one k block is reused across them).
    const TB: usize = 32;

    /// Outputs `lo..hi` of bf16 weights `w` for all `n` tokens (in
    /// [`super::pair_split`] layout) into `out` (`[hi-lo, n]`), bf16-rounded.
    ///
    /// Each output's sum has one fixed order, whatever `n`, the tile or the k
    /// blocking: lane `j` of its accumulator takes, chunk after chunk of 32
    /// values, the product of element `2j+1` then of element `2j` by FMA (a
    /// bf16 product is exact in f32, so each step rounds once), and the 16
    /// lanes are added by a fixed tree. So a token's `kv` does not depend on
    /// what else is in its batch.
    ///
    /// # Safety
    /// The CPU must have avx512f and avx512bw; `xs` is `[n, ceil(k/32)*32]`,
    /// `w` is `[_, k]` with at least `hi` rows, `out` is `[hi-lo, n]`.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn range_bf16(
        xs: &[f32],
        n: usize,
        k: usize,
        w: &[u16],
        lo: usize,
        hi: usize,
        out: &mut [f32],
    ) {
        let chunks = k.div_ceil(32);
        assert!(w.len() >= hi * k && xs.len() == n * chunks * 32 && out.len() == (hi - lo) * n);
        // Accumulators of one row tile against one token block: [row][token][16].
        let mut accs = vec![_mm512_setzero_ps(); RB * TB];
        let mut tb = 0;
        while tb < n {
            let te = (tb + TB).min(n);
            let mut o = lo;
            while o < hi {
                let r = (hi - o).min(RB);
                for a in accs.iter_mut() {
                    *a = _mm512_setzero_ps();
                }
                let mut wp = [w.as_ptr(); RB];
                for (i, p) in wp.iter_mut().enumerate().take(r) {
                    *p = w.as_ptr().add((o + i) * k);
                }
                let mut c0 = 0;
                while c0 < chunks {
                    let c1 = (c0 + KBC).min(chunks);
                    let mut t = tb;
                    while t < te {
                        let tt = (te - t).min(T);
                        let mut xp = [xs.as_ptr(); T];
                        for (j, p) in xp.iter_mut().enumerate().take(tt) {
                            *p = xs.as_ptr().add(pair_offset(n, chunks, t + j, c0));
                        }
                        let acc = accs.as_mut_ptr().add((t - tb) * RB);
                        macro_rules! tile {
                            ($($rr:literal);*) => {
                                match (r, tt) {
                                    $(($rr, 4) => pairs::<$rr, 4>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 3) => pairs::<$rr, 3>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 2) => pairs::<$rr, 2>(&wp, &xp, k, c0, c1, acc),
                                      ($rr, 1) => pairs::<$rr, 1>(&wp, &xp, k, c0, c1, acc),)*
                                    _ => unreachable!("tiles are at most {RB} x {T}"),
                                }
                            };
                        }
                        tile!(6; 5; 4; 3; 2; 1);
                        t += tt;
                    }
                    c0 = c1;
                }
                for t in tb..te {
                    for i in 0..r {
                        let v = accs[(t - tb) * RB + i];
                        out[(o + i - lo) * n + t] = to_bf16_value(_mm512_reduce_add_ps(v));
                    }
                }
                o += r;
            }
            tb = te;
        }
    }

    /// Chunks `c0..c1` of an `RR x TT` tile of bf16-weight dot products (see
    /// [`range_bf16`]); the accumulators live at `acc` as `[TT][RB]`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn pairs<const RR: usize, const TT: usize>(
        wp: &[*const u16; RB],
        xp: &[*const f32; T],
        k: usize,
        c0: usize,
        c1: usize,
        acc: *mut __m512,
    ) {
        let hi_mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let mut a = [[_mm512_setzero_ps(); TT]; RR];
        for i in 0..RR {
            for j in 0..TT {
                a[i][j] = *acc.add(j * RB + i);
            }
        }
        for c in c0..c1 {
            let kk = c * 32;
            // Odd elements of every row, then even ones: each accumulator still
            // takes its chunk's odd product before its even product, and only
            // one half of the token vectors is live at a time (24 accumulators
            // + 4 token vectors + 2 temporaries fit the 32 registers).
            for half in 0..2 {
                let mut x = [_mm512_setzero_ps(); TT];
                for j in 0..TT {
                    x[j] = _mm512_loadu_ps(xp[j].add((c - c0) * 32 + 16 * half));
                }
                for i in 0..RR {
                    // 32 bf16 as 16 words: element 2j in the low half, 2j+1 in the high.
                    let v = if kk + 32 <= k {
                        _mm512_loadu_si512(wp[i].add(kk) as *const _)
                    } else {
                        let m: __mmask32 = ((1u64 << (k - kk)) - 1) as u32;
                        _mm512_maskz_loadu_epi16(m, wp[i].add(kk) as *const i16)
                    };
                    let wv = if half == 0 {
                        _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask))
                    } else {
                        _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))
                    };
                    for j in 0..TT {
                        a[i][j] = _mm512_fmadd_ps(wv, x[j], a[i][j]);
                    }
                }
            }
        }
        for i in 0..RR {
            for j in 0..TT {
                *acc.add(j * RB + i) = a[i][j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A token's kv does not depend on its batch: every kernel and weight
    /// type gives the same bits for a token projected alone, in a small batch
    /// and in a large one, with one thread or two.
    #[test]
    fn results_do_not_depend_on_the_batch() {
        let (n, k, n_out) = (37, 1100, 70);
        let (rows, w) = data(n, k, n_out);
        let wf: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
        for kernel in [Kernel::Portable, Kernel::Avx512] {
            for dense_f32 in [false, true] {
                let weights = if dense_f32 {
                    Weights::F32(&wf)
                } else {
                    Weights::Bf16(&w)
                };
                let run = |threads: usize, lo: usize, hi: usize| {
                    let mut p = Projection::new(threads).unwrap();
                    p.set_kernel(kernel);
                    let mut kv = vec![0f32; (hi - lo) * n_out];
                    p.run(&rows[lo * k..hi * k], hi - lo, k, weights, n_out, &mut kv);
                    kv
                };
                let all = run(2, 0, n);
                for (lo, hi, threads) in [(0, 1, 1), (5, 8, 1), (10, 30, 2), (36, 37, 2)] {
                    assert_eq!(
                        run(threads, lo, hi)[..],
                        all[lo * n_out..hi * n_out],
                        "{kernel:?} f32 {dense_f32} {lo}..{hi}"
                    );
                }
            }
        }
    }

    /// q8_0 and q2_K weights: the fused path (few tokens) and the buffered
    /// path (more) give the same bits as f32 weights holding the dequantised
    /// values, for every batch size.
    #[test]
    fn quantised_weights_match_their_f32_values_at_every_batch_size() {
        use crate::formats::{dequant_row_f32, RowFormat};
        let (k, n_out, n) = (512usize, 70usize, 9usize);
        let (rows, _) = data(n, k, 1);
        for ty in [crate::EngramType::Q8_0, crate::EngramType::Q2_K] {
            let f = RowFormat::new(ty as u32, k).unwrap();
            let data = random_blocks(f, n_out * f.row_bytes(k), 11);
            let mut deq = vec![0f32; n_out * k];
            for (o, r) in deq.chunks_mut(k).enumerate() {
                dequant_row_f32(f, &data[o * f.row_bytes(k)..(o + 1) * f.row_bytes(k)], r).unwrap();
            }
            for kernel in [Kernel::Portable, Kernel::Avx512] {
                let mut p = Projection::new(2).unwrap();
                p.set_kernel(kernel);
                for (lo, hi) in [(0, 1), (2, 5), (1, 4), (0, n)] {
                    let mut a = vec![0f32; (hi - lo) * n_out];
                    let mut b = a.clone();
                    p.run(
                        &rows[lo * k..hi * k],
                        hi - lo,
                        k,
                        Weights::quant(f, &data, k).unwrap(),
                        n_out,
                        &mut a,
                    );
                    p.run(
                        &rows[lo * k..hi * k],
                        hi - lo,
                        k,
                        Weights::F32(&deq),
                        n_out,
                        &mut b,
                    );
                    assert_eq!(a, b, "{ty:?} {kernel:?} tokens {lo}..{hi}");
                }
            }
        }
    }

    /// Random blocks of `f` with finite f16 scales of all magnitudes.
    fn random_blocks(f: crate::formats::RowFormat, len: usize, seed: u64) -> Vec<u8> {
        let mut z = seed;
        let mut data: Vec<u8> = (0..len)
            .map(|_| {
                z = z
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (z >> 56) as u8
            })
            .collect();
        let (_, bb) = f.block().unwrap();
        let at: &[usize] = if f == crate::formats::RowFormat::Q8_0 {
            &[1]
        } else {
            &[81, 83]
        };
        for blk in data.chunks_mut(bb) {
            for &i in at {
                if blk[i] & 0x7C == 0x7C {
                    blk[i] ^= 0x04;
                }
            }
        }
        data
    }

    /// The AVX-512 dequantisers equal `formats::dequant_row_f32` bit for bit on
    /// random blocks (finite scales; the GGUF oracle tests cover the edges of
    /// the scalar path).
    #[test]
    fn fast_dequant_equals_the_reference() {
        use crate::formats::{dequant_row_f32, RowFormat};
        let mut z = 3u64;
        let mut byte = move || {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 56) as u8
        };
        for (ty, k) in [
            (crate::EngramType::Q8_0, 256usize),
            (crate::EngramType::Q2_K, 512),
        ] {
            let f = RowFormat::new(ty as u32, k).unwrap();
            let (_, bb) = f.block().unwrap();
            let rows = 7;
            let mut data: Vec<u8> = (0..rows * f.row_bytes(k)).map(|_| byte()).collect();
            // Finite f16 scales of all magnitudes (exponent field below 31).
            for blk in data.chunks_mut(bb) {
                let at: &[usize] = if ty == crate::EngramType::Q8_0 {
                    &[1]
                } else {
                    &[81, 83]
                };
                for &i in at {
                    blk[i] &= 0xF7 | (blk[i] & 0x80);
                    if blk[i] & 0x7C == 0x7C {
                        blk[i] ^= 0x04;
                    }
                }
            }
            let w = Weights::quant(f, &data, k).unwrap();
            let mut fast = vec![0f32; (rows - 2) * k];
            dequant_rows(w, 1, rows - 1, k, &mut fast);
            let mut want = vec![0f32; (rows - 2) * k];
            for (r, o) in want.chunks_mut(k).enumerate() {
                let rb = f.row_bytes(k);
                dequant_row_f32(f, &data[(r + 1) * rb..(r + 2) * rb], o).unwrap();
            }
            for (i, (a, b)) in fast.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} value {i}: {a} vs {b}");
            }
        }
    }

    fn data(n: usize, k: usize, n_out: usize) -> (Vec<u16>, Vec<u16>) {
        let f = |i: usize, s: u64| {
            let z = crate::hash::is_prime(i as u64 + s) as i32 as f32;
            f32_to_bf16(((i as f32 * 0.37 + s as f32).sin() + z) * 0.5)
        };
        (
            (0..n * k).map(|i| f(i, 1)).collect(),
            (0..n_out * k).map(|i| f(i, 2)).collect(),
        )
    }

    /// Every kernel, every tile shape and K tail, against an f64 reference
    /// within (K+2) u sum|a b| + 1 bf16 ulp (see tests/golden.rs).
    #[test]
    fn kernels_agree_with_f64_on_all_tile_shapes() {
        for &(n, k, n_out) in &[
            (1, 64, 9),
            (3, 100, 7),
            (5, 256, 130),
            (70, 40, 5),
            (4, 33, 4),
        ] {
            let (rows, w) = data(n, k, n_out);
            let wf: Vec<f32> = w.iter().map(|&b| bf16_to_f32(b)).collect();
            for (kernel, dense_f32) in [
                (Kernel::Portable, false),
                (Kernel::Avx512, false),
                (Kernel::Portable, true),
                (Kernel::Avx512, true),
            ] {
                for threads in [1, 2] {
                    let mut p = Projection::new(threads).unwrap();
                    p.set_kernel(kernel);
                    let mut kv = vec![0f32; n * n_out];
                    let weights = if dense_f32 {
                        Weights::F32(&wf)
                    } else {
                        Weights::Bf16(&w)
                    };
                    p.run(&rows, n, k, weights, n_out, &mut kv);
                    for t in 0..n {
                        for o in 0..n_out {
                            let (mut s, mut a) = (0f64, 0f64);
                            for i in 0..k {
                                let x = bf16_to_f32(rows[t * k + i]) as f64
                                    * bf16_to_f32(w[o * k + i]) as f64;
                                s += x;
                                a += x.abs();
                            }
                            let got = kv[t * n_out + o] as f64;
                            let ulp = 2f64.powi(
                                (s.abs().max(got.abs()).max(1e-30)).log2().floor() as i32 - 7,
                            );
                            let bound = (k as f64 + 2.0) * a / (1u64 << 24) as f64 + ulp;
                            assert!(
                                (got - s).abs() <= bound,
                                "{kernel:?} n{n} k{k} t{t} o{o}: {got} vs {s}"
                            );
                        }
                    }
                }
            }
        }
    }
}
