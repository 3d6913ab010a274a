//! The projection `kv = rows @ wkv^T` on the CPU: bf16 rows, f32 accumulate,
//! bf16 result (held as f32). A portable kernel, and SIMD kernels chosen at
//! run time by the CPU's features ([`Kernel::detect`]): AVX2 + FMA (see
//! `avx2/`: dot products for a few tokens, a packed GEMM for batches, both
//! in one summation order) and AVX-512 (FMA tiles, every format decoded in
//! registers in one order, see `avx512/`). Work is
//! split over output rows on the context's own thread pool.
//!
//! The kernels sum the `K` products of an output in f32, in different orders;
//! the tests hold each to the same bound (see `tests/golden.rs`). Within one
//! kernel, each output's order is fixed whatever the weight format, the batch
//! size, the thread count or the code path: a token's `kv` does not depend on
//! the batch it came in (engines can check a batched run against a straight
//! one bit for bit), and quantised weights give the bits of f32 weights
//! holding their dequantised values.
//!
//! bf16 and fp8 `wkv` by `vdpbf16ps` (`Kernel::Avx512Bf16`) or f32 FMA: the
//! two give the same bits (but for subnormals), and which is faster depends
//! on the core. On a Sapphire Rapids guest the BF16 dot product issued on
//! one port and FMA on two (96 against 183 GFLOP/s on one core); on a Zen 4
//! guest `vdpbf16ps` ran 135 GFLOP/s against FMA's 87 (bench/probes), and
//! the bf16 GEMM 118-146 against 72-78. So `detect` picks it first on AMD
//! CPUs only; elsewhere it is chosen by name.
//!
//! On CPUs with AMX (and a Linux that grants the tile data) `detect` picks
//! `Kernel::Amx`: bf16 and fp8 `wkv` by `tdpbf16ps` tiles in their own
//! order, the same at every batch size (see `amx/` and docs/cpu.md); its
//! tile instructions can be emulated in software, so its tests run here.
//!
//! No packed copy of `wkv` is kept: the GEMM packs 16 rows at a time into a
//! per-task panel (`V * K` floats, 393 KB at the V4.1 geometry) during the call.
//!
//! The checkpoint's block-scaled fp8 `wkv` (`Weights::Fp8Block`) is read in
//! place by every kernel: its values are exact in bf16 (`set_layer` refuses
//! any other), and each kernel converts codes and scales in registers (AVX2,
//! AVX-512) or into a row buffer (portable) and keeps its bf16 order, so
//! `kv` is bit-identical to the bf16 path on the widened weights
//! (`tests/fp8_wkv.rs`; docs/fp8-wkv.md).

use crate::batch::try_vec;
use crate::error::Result;
use crate::formats::{bf16_to_f32, f32_to_bf16, Weights};
// The tests (`tests.rs`, through `super::*`) name formats.
#[cfg(test)]
use crate::formats::EngramType;

/// Which kernel computes the dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, f32 arithmetic (vectorised by the compiler).
    Portable,
    /// AVX2 + FMA + F16C: dot products from `wkv` in place for a few tokens,
    /// a packed GEMM for batches, one summation order (see `avx2/`).
    Avx2,
    /// AVX-512 f32 FMA tiles (CPUs with avx512f, avx512bw, AVX2, FMA and
    /// F16C): every `wkv` format read in place and widened or dequantised in
    /// registers (GGUF blocks by table look-ups), one summation order.
    Avx512,
    /// `Avx512` with bf16 and block-scaled fp8 `wkv` multiplied by
    /// `vdpbf16ps` (CPUs with avx512bf16): the same order and roundings, so
    /// the same bits, except that subnormal inputs and partial sums are
    /// taken as zero (the instruction's DAZ/FTZ); twice the FMA tiles'
    /// multiply-adds an instruction.
    Avx512Bf16,
    /// AMX tiles (`tdpbf16ps`) for bf16 and block-scaled fp8 `wkv` (CPUs
    /// with AMX-TILE and AMX-BF16, AVX-512, and Linux granting the tile
    /// data): each output summed chunk of 32 after chunk in the
    /// instruction's order (see `amx/`), inputs and partial sums DAZ/FTZ;
    /// other formats run as `Avx512`.
    Amx,
}

impl Kernel {
    /// The best kernel this CPU runs: `Amx` where the process may use the
    /// tiles ([`amx_status`]), then `Avx512Bf16` only on AMD CPUs, where it
    /// was measured faster than `Avx512` (see the module's notes).
    pub fn detect() -> Kernel {
        [
            Kernel::Amx,
            Kernel::Avx512Bf16,
            Kernel::Avx512,
            Kernel::Avx2,
        ]
        .into_iter()
        .filter(|&k| k != Kernel::Avx512Bf16 || cpu_is_amd())
        .find(|k| k.supported())
        .unwrap_or(Kernel::Portable)
    }

    /// Whether this CPU runs `self`.
    pub fn supported(self) -> bool {
        match self {
            Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => avx2::available(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => {
                std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && avx2::available()
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => {
                Kernel::Avx512.supported() && std::arch::is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => Kernel::Avx512.supported() && amx::status().is_ok(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// A kernel by its name ([`Kernel::c_name`], any case), as
    /// `ENGRAM_CPU_KERNEL`, benchmarks and tests name them.
    pub fn from_name(name: &str) -> Option<Kernel> {
        [
            Kernel::Portable,
            Kernel::Avx2,
            Kernel::Avx512,
            Kernel::Avx512Bf16,
            Kernel::Amx,
        ]
        .into_iter()
        .find(|k| k.c_name().to_bytes().eq_ignore_ascii_case(name.as_bytes()))
    }

    /// The kernel's name (`portable`, `avx2`, `avx512`, `avx512bf16`, `amx`),
    /// NUL-terminated (`engram_context_info`'s `cpu_kernel`).
    pub fn c_name(self) -> &'static std::ffi::CStr {
        match self {
            Kernel::Portable => c"portable",
            Kernel::Avx2 => c"avx2",
            Kernel::Avx512 => c"avx512",
            Kernel::Avx512Bf16 => c"avx512bf16",
            Kernel::Amx => c"amx",
        }
    }
}

/// Whether this process runs the `amx` kernel's tiles: `Ok`, or why not
/// (no AMX on the CPU, the OS does not enable its state, or Linux refused
/// the tile data). Asked once a process.
pub fn amx_status() -> std::result::Result<(), String> {
    #[cfg(target_arch = "x86_64")]
    {
        amx::status().clone()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Err("not x86-64".to_string())
    }
}

/// Why the `amx` kernel does not run here ([`amx_status`]) as a
/// NUL-terminated string, or "" where it does (`engram_context_info`'s
/// `cpu_kernel_note`); kept for the process.
pub fn amx_note() -> &'static std::ffi::CStr {
    static NOTE: std::sync::OnceLock<std::ffi::CString> = std::sync::OnceLock::new();
    NOTE.get_or_init(|| {
        let text = amx_status()
            .err()
            .map_or(String::new(), |why| format!("amx: {why}"));
        // The reasons are ours, without NUL bytes; one would only shorten it.
        let text = text.replace('\0', " ");
        std::ffi::CString::new(text).unwrap_or_default()
    })
}

/// Whether CPUID names AMD as the vendor.
fn cpu_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0 exists on every x86-64 CPU (the intrinsic is safe).
        let r = std::arch::x86_64::__cpuid(0);
        let v = [r.ebx, r.edx, r.ecx];
        let bytes: Vec<u8> = v.iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The CPU features the kernels look at, as `name+` / `name-` words (for
/// benchmark headers and reports).
pub fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! feats {
            ($($f:tt),*) => {
                [$((stringify!($f), std::arch::is_x86_feature_detected!($f))),*]
            };
        }
        let f = feats!(
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512dq",
            "avx512vl",
            "avx512bf16",
            "avx512vnni",
            "avx512ifma"
        );
        f.iter()
            .map(|(n, on)| format!("{}{}", n.trim_matches('"'), if *on { "+" } else { "-" }))
            // AMX as the kernel sees it: the CPU's tiles and Linux's grant.
            .chain(std::iter::once(
                if amx_status().is_ok() { "amx+" } else { "amx-" }.to_string(),
            ))
            .collect::<Vec<_>>()
            .join(" ")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        "not x86-64".to_string()
    }
}

/// From this many tokens on, the AVX2 kernel runs the packed GEMM (below it,
/// dot products from `wkv` in place); both give the same bits.
pub(crate) const GEMM_MIN_TOKENS: usize = 48;

/// Output rows of `wkv` per task handed to a worker, at least.
const CHUNK: usize = 64;

/// The projection with its thread pool.
pub struct Projection {
    /// Joined when dropped (`engram_free` returns with no thread left).
    /// Held for reading by every run, for writing by [`Projection::set_threads`]:
    /// a pool is never replaced under a run that uses it.
    pool: std::sync::RwLock<Option<crate::cpu::pool::Workers>>,
    kernel: Kernel,
    /// Leave the f32 sums unrounded (tests: the bf16 rounding would hide most
    /// changes of summation order).
    raw_sums: bool,
    /// Run `Kernel::Amx`'s tiles in software (tests on CPUs without AMX).
    amx_emulated: bool,
    /// Keep a GGUF-block `wkv` bit-identical to its f32 twin (f32 FMA on the
    /// dequantised values) instead of the integer dot products
    /// ([`Projection::set_exact_quant`]).
    exact_quant: bool,
    /// The integer path's token block scale from a block's largest
    /// magnitude (`avx512::block_scale`; tests swap in a wrong one).
    #[cfg(target_arch = "x86_64")]
    token_scale: fn(f32) -> f32,
    /// Integer dot products for `Q8_0` too (tests, benchmarks: measured
    /// slower than the exact path on Zen 4, so not a default).
    int_q8_0: bool,
}

impl Projection {
    /// A projection using at most `threads` threads (the caller's thread
    /// included: a pool of `threads` workers runs the work while the caller
    /// waits). `threads <= 1` runs everything on the calling thread.
    pub fn new(threads: usize) -> std::io::Result<Projection> {
        Ok(Projection {
            pool: std::sync::RwLock::new(Self::pool(threads)?),
            kernel: Kernel::detect(),
            raw_sums: false,
            amx_emulated: false,
            exact_quant: false,
            #[cfg(target_arch = "x86_64")]
            token_scale: avx512::block_scale,
            int_q8_0: false,
        })
    }

    fn pool(threads: usize) -> std::io::Result<Option<crate::cpu::pool::Workers>> {
        Ok(if threads > 1 {
            Some(crate::cpu::pool::Workers::new(threads)?)
        } else {
            None
        })
    }

    /// Threads a run uses (1: the calling thread only).
    pub fn threads(&self) -> usize {
        let pool = self.pool.read().unwrap_or_else(|p| p.into_inner());
        pool.as_ref().map_or(1, |p| p.current_num_threads())
    }

    /// Use at most `threads` threads from now on: waits for the runs in
    /// flight to finish, joins the old pool's threads and starts the new
    /// pool's. A thread that cannot be started is an error and the old pool
    /// stays in use (the new one is built before the old one is dropped).
    pub fn set_threads(&self, threads: usize) -> std::io::Result<()> {
        if threads.max(1) == self.threads() {
            return Ok(());
        }
        let new = Self::pool(threads)?;
        let mut pool = self.pool.write().unwrap_or_else(|p| p.into_inner());
        // Dropping the old pool joins its threads.
        drop(std::mem::replace(&mut *pool, new));
        Ok(())
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Use `kernel` from now on (for tests and benchmarks comparing kernels).
    /// Asking for a kernel the CPU lacks keeps the portable one.
    pub fn set_kernel(&mut self, kernel: Kernel) {
        self.kernel = if kernel.supported() {
            kernel
        } else {
            Kernel::Portable
        };
        self.amx_emulated = false;
    }

    /// For tests on CPUs without AMX: `Kernel::Amx` with its tile
    /// instructions emulated in software (the SDM's pseudocode), the
    /// blocking, packing and order unchanged. Needs AVX-512 (the formats
    /// AMX does not take run as `Avx512`); false (nothing changed) without.
    #[doc(hidden)]
    pub fn set_amx_emulated(&mut self) -> bool {
        if !Kernel::Avx512.supported() {
            return false;
        }
        self.kernel = Kernel::Amx;
        self.amx_emulated = true;
        true
    }

    /// For tests: return each output's f32 sum as it is, not rounded to bf16.
    #[doc(hidden)]
    pub fn set_raw_sums(&mut self, raw: bool) {
        self.raw_sums = raw;
    }

    /// `exact`: every GGUF-block `wkv` gives the bits of an f32 `wkv`
    /// holding its dequantised values (its f32 twin), on every kernel. Not
    /// exact (the default): the AVX-512 kernels on a CPU with AVX512-VNNI
    /// multiply the formats of [`int_dot_format`] by integer dot products
    /// on the tokens quantised to int8, within the bound of docs/numerics.md
    /// ("Integer dot products") of the twin; a token's `kv` is still the
    /// same bits whatever the batch, thread count or path.
    pub fn set_exact_quant(&mut self, exact: bool) {
        self.exact_quant = exact;
    }

    pub fn exact_quant(&self) -> bool {
        self.exact_quant
    }

    /// For tests and benchmarks: multiply `Q8_0` by integer dot products
    /// too when not exact (not a default: slower than the exact path where
    /// measured, docs/numerics.md).
    #[doc(hidden)]
    pub fn set_int_dot_q8_0(&mut self, on: bool) {
        self.int_q8_0 = on;
    }

    /// For tests: quantise the integer path's tokens with `scale` (a token
    /// block's scale from its largest magnitude) instead of the documented
    /// one, to check that the tests' bound catches a wrong quantisation.
    #[doc(hidden)]
    #[cfg(target_arch = "x86_64")]
    pub fn set_token_scale(&mut self, scale: fn(f32) -> f32) {
        self.token_scale = scale;
    }

    /// Whether a run of `w` (`k` values a row) takes the integer dot
    /// products: not exact, an AVX-512 kernel, AVX512-VNNI, a format of
    /// [`int_dot_format`], and `k` whole token blocks.
    pub fn int_dot(&self, w: Weights<'_>, k: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let fmt = match w {
                Weights::Quant {
                    format, row_len, ..
                } if row_len == k => format,
                _ => return false,
            };
            !self.exact_quant
                && matches!(self.kernel, Kernel::Avx512 | Kernel::Avx512Bf16)
                && std::arch::is_x86_feature_detected!("avx512vnni")
                && (int_dot_format(fmt)
                    || (self.int_q8_0 && fmt == crate::formats::EngramType::Q8_0))
                && k.is_multiple_of(avx512::QB)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, k);
            false
        }
    }

    /// `kv[t][o] = bf16(sum_i rows[t][i] * w[o][i])` for `rows` `[n, k]` (bf16
    /// bits) and `w` `[n_out, k]`; `kv` is `[n, n_out]` and receives the bf16
    /// values as f32. Every buffer sized by the call is allocated fallibly:
    /// running out of memory is `ERR_CAPACITY` (and `kv` is then unspecified).
    pub fn run(
        &self,
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        n_out: usize,
        kv: &mut [f32],
    ) -> Result<()> {
        assert_eq!(rows.len(), n * k);
        assert_eq!(w.len(), n_out * k);
        assert_eq!(kv.len(), n * n_out);
        if n == 0 || n_out == 0 {
            return Ok(());
        }
        // Outputs are computed o-major (`[n_out, n]`) so that each task owns a
        // contiguous slice; each task then writes its columns of `kv`.
        let mut kvt = try_vec(n_out * n, 0f32, "the projection's outputs")?;
        let sink = Sink {
            kv: kv.as_mut_ptr(),
            n_out,
            raw: self.raw_sums,
        };
        match self.kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => self.run_avx2(rows, n, k, w, &mut kvt, &sink)?,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 | Kernel::Avx512Bf16 => {
                self.run_avx512(rows, n, k, w, &mut kvt, &sink)?
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => self.run_amx(rows, n, k, w, &mut kvt, &sink)?,
            _ => {
                let mut xs = try_vec(n * k, 0f32, "the token rows")?;
                for (x, &b) in xs.iter_mut().zip(rows) {
                    *x = bf16_to_f32(b);
                }
                self.tasks(n, &mut kvt, &sink, |lo, hi, out| {
                    portable_range(&xs, n, k, w, lo, hi, out)
                })?
            }
        }
        Ok(())
    }

    /// Run `body(lo, hi, out)` for every chunk of output rows (`out` is
    /// `[hi - lo, n]` of `kvt`), then `sink.store` it, on the pool when there
    /// is more than one.
    fn tasks(
        &self,
        n: usize,
        kvt: &mut [f32],
        sink: &Sink,
        body: impl Fn(usize, usize, &mut [f32]) -> Result<()> + Sync,
    ) -> Result<()> {
        let n_out = kvt.len() / n;
        // About 8 tasks a thread (fewer hand-offs than one per CHUNK rows, and
        // still some balance when a core is busy with something else), in
        // whole GEMM panels.
        let pool = self.pool.read().unwrap_or_else(|p| p.into_inner());
        let threads = pool.as_ref().map_or(1, |p| p.current_num_threads());
        let chunk = (n_out / (8 * threads)).max(CHUNK).next_multiple_of(16);
        let f = |(ci, out): (usize, &mut [f32])| {
            let (lo, hi) = (ci * chunk, (ci * chunk + chunk).min(n_out));
            body(lo, hi, out)?;
            // SAFETY: tasks own disjoint output rows `lo..hi`, so their
            // columns of `kv` never overlap, and `kv` outlives the tasks.
            unsafe { sink.store(lo, hi, n, out) };
            Ok(())
        };
        match &*pool {
            Some(p) if n_out > chunk => p.for_each_chunk(kvt, chunk * n, f),
            _ => kvt.chunks_mut(chunk * n).enumerate().try_for_each(f),
        }
    }

    /// The AVX2 kernels (`Kernel::Avx2`): the tokens split (and packed for a
    /// batch) once, then each task's rows by the source of `w`'s format.
    #[cfg(target_arch = "x86_64")]
    fn run_avx2(
        &self,
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        kvt: &mut [f32],
        sink: &Sink,
    ) -> Result<()> {
        let run = x86::Avx2Run::new(rows, n, k)?;
        self.tasks(n, kvt, sink, |lo, hi, out| run.task(w, lo, hi, out))
    }

    /// The AVX-512 kernels (`Kernel::Avx512`, `Kernel::Avx512Bf16`): the
    /// tokens laid out once, then each task's rows by the entry of `w`'s
    /// format.
    #[cfg(target_arch = "x86_64")]
    fn run_avx512(
        &self,
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        kvt: &mut [f32],
        sink: &Sink,
    ) -> Result<()> {
        let bf16_dot = self.kernel == Kernel::Avx512Bf16;
        let run = x86::Avx512Run::new(
            rows,
            n,
            k,
            w,
            bf16_dot,
            self.int_dot(w, k).then_some(self.token_scale),
        )?;
        self.tasks(n, kvt, sink, |lo, hi, out| run.task(w, lo, hi, out))
    }
}

impl Projection {
    /// The AMX kernel (`Kernel::Amx`): bf16 and fp8 `wkv` on tiles (the
    /// tokens packed once, each task configuring its thread's tiles), any
    /// other format as `Kernel::Avx512`.
    #[cfg(target_arch = "x86_64")]
    fn run_amx(
        &self,
        rows: &[u16],
        n: usize,
        k: usize,
        w: Weights<'_>,
        kvt: &mut [f32],
        sink: &Sink,
    ) -> Result<()> {
        let src = match w {
            Weights::Bf16(v) => amx::Src::Bf16(v),
            Weights::Fp8Block(b) => amx::Src::Fp8(b),
            _ => return self.run_avx512(rows, n, k, w, kvt, sink),
        };
        let x = amx::Packed::new(rows, n, k)?;
        let emulated = self.amx_emulated;
        self.tasks(n, kvt, sink, |lo, hi, out| {
            if emulated {
                // SAFETY: the emulation runs anywhere; `run` asserted that
                // `w` holds `n_out >= hi` rows of `k`.
                unsafe { amx::task(&mut amx::Emu::default(), src, &x, lo, hi, out) }
            } else {
                // SAFETY: `Kernel::Amx` is set only where `supported` (the
                // CPU has AMX and Linux granted the tile data); the rows as
                // above.
                unsafe { amx::task(&mut amx::Hw, src, &x, lo, hi, out) }
            }
        })
    }
}

/// The GGUF block formats the AVX-512 kernels multiply by integer dot
/// products unless the engine asks for the exact twin (the decision and its
/// measurements: docs/numerics.md, "Integer dot products").
pub fn int_dot_format(format: crate::formats::EngramType) -> bool {
    use crate::formats::EngramType;
    // Q8_0 has an integer path too (`Projection::set_int_dot_q8_0`), but it
    // measured slower than the exact one (docs/numerics.md).
    matches!(format, EngramType::Q4_K)
}

/// Where the tasks write `kv` (`[n, n_out]`): each its own output columns,
/// rounded to bf16 unless `raw`.
struct Sink {
    kv: *mut f32,
    n_out: usize,
    raw: bool,
}

// SAFETY: the tasks write disjoint columns of `kv` (`Sink::store`'s
// contract) while `Projection::run` holds `kv` borrowed mutably.
unsafe impl Sync for Sink {}

impl Sink {
    /// Outputs `lo..hi` of every token (`out`: `[hi - lo, n]`) into `kv`.
    ///
    /// # Safety
    /// `lo..hi` is within `n_out` and no other thread stores those outputs
    /// while this runs; `kv` is `[n, n_out]` and alive.
    unsafe fn store(&self, lo: usize, hi: usize, n: usize, out: &[f32]) {
        for t in 0..n {
            for o in lo..hi {
                let x = out[(o - lo) * n + t];
                // SAFETY: `t < n`, `o < n_out` (the contract).
                unsafe {
                    *self.kv.add(t * self.n_out + o) = if self.raw { x } else { to_bf16_value(x) };
                }
            }
        }
    }
}

/// Round an f32 sum to bf16, held as f32.
#[inline]
fn to_bf16_value(x: f32) -> f32 {
    bf16_to_f32(f32_to_bf16(x))
}

/// Rows `lo..hi` against every token (`xs`: `[n, k]` f32), plain Rust.
fn portable_range(
    xs: &[f32],
    n: usize,
    k: usize,
    w: Weights<'_>,
    lo: usize,
    hi: usize,
    out: &mut [f32],
) -> Result<()> {
    let mut wrow = try_vec(k, 0f32, "a weight row")?;
    for o in lo..hi {
        w.to_f32(o * k, &mut wrow);
        for t in 0..n {
            out[(o - lo) * n + t] = dot(&xs[t * k..(t + 1) * k], &wrow);
        }
    }
    Ok(())
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
mod amx;
#[cfg(target_arch = "x86_64")]
pub mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
