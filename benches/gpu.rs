//! GPU benchmark: `engram_apply` on the CUDA backend at the DeepSeek-V4.1
//! geometry (D 5120, hc 4, C 24, Hd 256; bf16 `wkv` [25600 x 6144]; fp8 table
//! on the device; random data) for 1, 8, 64, 512 and 4096 tokens, against
//! PyTorch eager computing the same forward on the same GPU, and against the
//! roofline, all measured in this one run:
//!
//! - roofline(n) = max(bytes(n) / device copy bandwidth, FLOPs(n) / GEMM
//!   rate), where bytes(n) = the `wkv` + the gathered rows (n * C * row
//!   bytes) + the row ids (n * C * 8) + the f32 highway read and written
//!   (2 * n * hc * D * 4), FLOPs(n) = 2 * n * C*Hd * D*(hc+1); the bandwidth
//!   from a large device-to-device copy (read + write bytes over time), the
//!   rate from cuBLAS's bf16 GEMM at the projection's own shape ([4096 x
//!   6144] x [6144 x 25600]) on random data (the benchmark's `wkv` and random
//!   rows), both timed here;
//! - the kernels' times: a separate pass (not the timed one) runs each row's
//!   call once more with timing events recorded around every launch, GEMM
//!   and host-to-device copy (a wrapper of the device, `Prof`), and prints
//!   each kernel's milliseconds next to the row;
//! - torch eager: `bench/gpu_peer.py` (run with `$ENGRAM_TORCH_PYTHON`, default
//!   `python3`), the same gather, fp8 dequantisation, `F.linear` and gate.
//!
//! ```text
//! cargo bench --bench gpu                    # everything
//! cargo bench --bench gpu -- --decode-only   # the decode kernel's rows alone
//! cargo bench --bench gpu -- --no-decode     # everything else
//! ```
//!
//! Each row is printed as it is measured, each table's heading first, so a
//! run cut short keeps what it measured; the decode rows come first and torch
//! eager (a Python process) last, in a table of its own.
//!
//! Without a CUDA driver it says so and exits 0 (1 with `ENGRAM_REQUIRE_GPU=1`);
//! without torch it skips the peer.

use engram::cuda::gpu::{Arg, Blas, DevBuf, DevPtr, Gemm, Gpu, Guard, Kernel, PtrInfo, Stream};
use engram::cuda::sys;
use engram::formats::f32_to_bf16;
use engram::hash::derive_primes_uniform;
use engram::{Context, ContextConfig, EngramBackend, EngramType, Geometry, HashTablesIn, Limits};
use engram::{Highway, HighwayType, LayerIn, RowIds};
use serde_json::{json, Value};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const D: usize = 5120;
const HC: usize = 4;
const HD: usize = 256;
const H: usize = 8;
const N: usize = 4;
const C: usize = (N - 1) * H;
const K_IN: usize = C * HD;
const K_OUT: usize = D * (HC + 1);
const TOKENS: [usize; 5] = [1, 8, 64, 512, 4096];
const ROW_BYTES: usize = HD + HD / 32;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn ok(r: sys::CUresult, what: &str) {
    assert_eq!(
        r,
        sys::CUDA_SUCCESS,
        "{what}: {}",
        engram::cuda::driver::error_text(r)
    );
}

fn drv() -> &'static sys::DriverApi {
    &sys::driver().expect("the driver").api
}

fn upload<T: Copy>(gpu: &Arc<dyn Gpu>, data: &[T]) -> DevBuf {
    DevBuf::from_slice(gpu, data, "bench data").unwrap()
}

/// Milliseconds per call of `f` on `stream`, timed with CUDA events over
/// `reps` back-to-back calls after a warm-up (the median of 3 such runs).
fn time_ms(stream: sys::CUstream, reps: usize, mut f: impl FnMut()) -> f64 {
    let d = drv();
    let mut e0 = std::ptr::null_mut();
    let mut e1 = std::ptr::null_mut();
    // SAFETY: out-pointers are locals; the context is current.
    unsafe {
        ok((d.cuEventCreate)(&mut e0, sys::CU_EVENT_DEFAULT), "event");
        ok((d.cuEventCreate)(&mut e1, sys::CU_EVENT_DEFAULT), "event");
    }
    for _ in 0..3 {
        f();
    }
    // SAFETY: a live stream of the current context.
    unsafe { ok((d.cuStreamSynchronize)(stream), "sync") };
    let mut runs = Vec::new();
    for _ in 0..3 {
        // SAFETY: a live event and stream.
        unsafe { ok((d.cuEventRecord)(e0, stream), "record") };
        for _ in 0..reps {
            f();
        }
        let mut ms = 0f32;
        // SAFETY: live events recorded on a live stream; `ms` is a local.
        unsafe {
            ok((d.cuEventRecord)(e1, stream), "record");
            ok((d.cuEventSynchronize)(e1), "event sync");
            ok(
                d.cuEventElapsedTime.expect("cuEventElapsedTime")(&mut ms, e0, e1),
                "elapsed",
            );
        }
        runs.push(ms as f64 / reps as f64);
    }
    // SAFETY: the events were created above and are destroyed once.
    unsafe {
        (d.cuEventDestroy_v2)(e0);
        (d.cuEventDestroy_v2)(e1);
    }
    runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    runs[1]
}

/// Milliseconds per step of `f` by the wall clock (host work included),
/// waiting for `stream` at the end: median of 3 runs of `reps` steps.
fn wall_ms(stream: sys::CUstream, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    let d = drv();
    for i in 0..2 {
        f(i);
    }
    // SAFETY: a live stream of the current context.
    unsafe { ok((d.cuStreamSynchronize)(stream), "sync") };
    let mut runs = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        for i in 0..reps {
            f(i);
        }
        // SAFETY: as above.
        unsafe { ok((d.cuStreamSynchronize)(stream), "sync") };
        runs.push(t.elapsed().as_secs_f64() * 1e3 / reps as f64);
    }
    runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    runs[1]
}

fn root() -> PathBuf {
    // ENGRAM_SOURCE_ROOT: the tree this binary was carried to (scripts/gpu-check.sh).
    std::env::var_os("ENGRAM_SOURCE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

fn write<T: Copy>(path: &PathBuf, data: &[T]) {
    // SAFETY: any initialised `T: Copy` is readable as its bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
    };
    std::fs::write(path, bytes).unwrap();
}

/// Q8_0 blocks of `vals` (llama.cpp's reference quantiser).
fn q8_0(vals: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(vals.len() / 32 * 34);
    for b in vals.chunks(32) {
        let amax = b.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        out.extend(b.iter().map(|&x| (x * id).round() as i8 as u8));
    }
    out
}

/// Random Q4_K blocks with small finite scales (timing only).
fn q4_k_random(rng: &mut Rng, blocks: usize) -> Vec<u8> {
    let mut out = vec![0u8; blocks * 144];
    for b in out.chunks_exact_mut(144) {
        for x in b.iter_mut() {
            *x = rng.next() as u8;
        }
        b[0..2].copy_from_slice(&half::f16::from_f32(1.0 / 4096.0).to_bits().to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(1.0 / 8192.0).to_bits().to_le_bytes());
    }
    out
}

/// What [`Prof`] records while it is on: a name and the timing events
/// recorded before and after it on its stream.
#[derive(Default)]
struct ProfState {
    on: AtomicBool,
    marks: Mutex<Vec<(String, usize, usize)>>,
    /// Refuse every cooperative launch as the driver refuses a grid too
    /// large (the decode kernel's split path, for its row of the bench).
    refuse_fused: AtomicBool,
}

impl ProfState {
    /// Run `f` between two timing events on `stream` when on.
    fn around<T>(&self, name: &str, stream: Stream, f: impl FnOnce() -> T) -> T {
        if !self.on.load(Ordering::Relaxed) {
            return f();
        }
        let d = drv();
        let (mut e0, mut e1) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: out-pointers are locals; the device's context is current
        // (the bench enters it for its whole run); a live stream.
        unsafe {
            ok((d.cuEventCreate)(&mut e0, sys::CU_EVENT_DEFAULT), "event");
            ok((d.cuEventCreate)(&mut e1, sys::CU_EVENT_DEFAULT), "event");
            ok((d.cuEventRecord)(e0, stream as sys::CUstream), "record");
        }
        let r = f();
        // SAFETY: as above.
        unsafe { ok((d.cuEventRecord)(e1, stream as sys::CUstream), "record") };
        self.marks
            .lock()
            .unwrap()
            .push((name.to_string(), e0 as usize, e1 as usize));
        r
    }
}

/// The device, with every launch, GEMM and host-to-device copy timed by
/// events around it while its [`ProfState`] is on (the breakdown pass);
/// everything else is the real device's.
struct Prof {
    inner: Arc<dyn Gpu>,
    st: Arc<ProfState>,
}

struct ProfBlas {
    inner: Box<dyn Blas>,
    st: Arc<ProfState>,
}

impl Blas for ProfBlas {
    unsafe fn gemm(&mut self, stream: Stream, g: &Gemm) -> engram::Result<()> {
        let inner = &mut self.inner;
        // SAFETY: the caller's contract, passed on.
        self.st
            .around("cuBLAS GEMM", stream, || unsafe { inner.gemm(stream, g) })
    }
    fn device_bytes(&self) -> usize {
        self.inner.device_bytes()
    }
}

impl Gpu for Prof {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn ordinal(&self) -> i32 {
        self.inner.ordinal()
    }
    fn enter(&self) -> engram::Result<Guard> {
        self.inner.enter()
    }
    fn alloc(&self, bytes: usize, what: &str) -> engram::Result<DevPtr> {
        self.inner.alloc(bytes, what)
    }
    unsafe fn free(&self, p: DevPtr) {
        // SAFETY: passed on.
        unsafe { self.inner.free(p) }
    }
    fn host_alloc(
        &self,
        bytes: usize,
        mapped: bool,
        what: &str,
    ) -> engram::Result<(*mut u8, DevPtr)> {
        self.inner.host_alloc(bytes, mapped, what)
    }
    unsafe fn host_free(&self, p: *mut u8) {
        // SAFETY: passed on.
        unsafe { self.inner.host_free(p) }
    }
    unsafe fn memset(&self, p: DevPtr, v: u8, bytes: usize) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.memset(p, v, bytes) }
    }
    unsafe fn upload(&self, dst: DevPtr, src: *const u8, bytes: usize) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.upload(dst, src, bytes) }
    }
    unsafe fn download(&self, dst: *mut u8, src: DevPtr, bytes: usize) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.download(dst, src, bytes) }
    }
    unsafe fn upload_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        stream: Stream,
    ) -> engram::Result<()> {
        // SAFETY: passed on.
        self.st.around("H2D copy", stream, || unsafe {
            self.inner.upload_async(dst, src, bytes, stream)
        })
    }
    unsafe fn download_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        stream: Stream,
    ) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.download_async(dst, src, bytes, stream) }
    }
    unsafe fn memset_async(
        &self,
        p: DevPtr,
        v: u8,
        bytes: usize,
        stream: Stream,
    ) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.memset_async(p, v, bytes, stream) }
    }
    fn stream_new(&self) -> engram::Result<Stream> {
        self.inner.stream_new()
    }
    unsafe fn stream_free(&self, stream: Stream) {
        // SAFETY: passed on.
        unsafe { self.inner.stream_free(stream) }
    }
    unsafe fn stream_wait_event(&self, stream: Stream, ev: usize) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.stream_wait_event(stream, ev) }
    }
    fn event_new(&self) -> engram::Result<usize> {
        self.inner.event_new()
    }
    unsafe fn event_free(&self, ev: usize) {
        // SAFETY: passed on.
        unsafe { self.inner.event_free(ev) }
    }
    unsafe fn event_record(&self, ev: usize, stream: Stream) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.event_record(ev, stream) }
    }
    unsafe fn event_wait(&self, ev: usize) -> engram::Result<()> {
        // SAFETY: passed on.
        unsafe { self.inner.event_wait(ev) }
    }
    fn synchronize(&self) -> engram::Result<()> {
        self.inner.synchronize()
    }
    fn stream_synchronize(&self, stream: Stream) -> engram::Result<()> {
        self.inner.stream_synchronize(stream)
    }
    fn stream_capturing(&self, stream: Stream) -> engram::Result<bool> {
        self.inner.stream_capturing(stream)
    }
    fn pointer(&self, p: u64) -> Option<PtrInfo> {
        self.inner.pointer(p)
    }
    unsafe fn launch(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        stream: Stream,
        args: &[Arg],
    ) -> engram::Result<()> {
        // SAFETY: passed on.
        self.st.around(k.name(), stream, || unsafe {
            self.inner.launch(k, grid, block, stream, args)
        })
    }
    unsafe fn launch_shared(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        stream: Stream,
        args: &[Arg],
    ) -> engram::Result<()> {
        // SAFETY: passed on.
        self.st.around(k.name(), stream, || unsafe {
            self.inner
                .launch_shared(k, grid, block, shared, stream, args)
        })
    }
    unsafe fn try_launch_shared(
        &self,
        k: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        stream: Stream,
        args: &[Arg],
    ) -> engram::Result<bool> {
        if self.st.refuse_fused.load(Ordering::Relaxed) {
            return Ok(false);
        }
        // SAFETY: passed on.
        self.st.around(k.name(), stream, || unsafe {
            self.inner
                .try_launch_shared(k, grid, block, shared, stream, args)
        })
    }
    fn device_limits(&self) -> engram::Result<engram::cuda::gpu::DeviceLimits> {
        self.inner.device_limits()
    }
    fn occupancy(&self, k: Kernel, block: u32, shared: u32) -> engram::Result<u32> {
        self.inner.occupancy(k, block, shared)
    }
    fn new_blas(&self) -> engram::Result<Box<dyn Blas>> {
        Ok(Box::new(ProfBlas {
            inner: self.inner.new_blas()?,
            st: self.st.clone(),
        }))
    }
    fn preload(&self, k: Kernel) -> engram::Result<()> {
        self.inner.preload(k)
    }
}

/// The breakdown pass: run `f` once with [`Prof`] timing every launch, GEMM
/// and copy it queues, wait for `stream`, and give each kernel's
/// milliseconds (summed over its launches, `xN` when it ran N times), in the
/// order they first ran, and their sum.
fn breakdown(st: &ProfState, stream: sys::CUstream, f: impl FnOnce()) -> String {
    st.marks.lock().unwrap().clear();
    st.on.store(true, Ordering::Relaxed);
    f();
    st.on.store(false, Ordering::Relaxed);
    let d = drv();
    // SAFETY: a live stream of the current context.
    unsafe { ok((d.cuStreamSynchronize)(stream), "sync") };
    let marks = std::mem::take(&mut *st.marks.lock().unwrap());
    let mut by: Vec<(String, f64, usize)> = Vec::new();
    let mut total = 0f64;
    for (name, e0, e1) in marks {
        let mut ms = 0f32;
        // SAFETY: events created and recorded by `around`, both complete
        // (the stream was synchronised); destroyed once, here.
        unsafe {
            ok(
                d.cuEventElapsedTime.expect("cuEventElapsedTime")(
                    &mut ms,
                    e0 as sys::CUevent,
                    e1 as sys::CUevent,
                ),
                "elapsed",
            );
            (d.cuEventDestroy_v2)(e0 as sys::CUevent);
            (d.cuEventDestroy_v2)(e1 as sys::CUevent);
        }
        let short = name.strip_prefix("engram_").unwrap_or(&name).to_string();
        total += ms as f64;
        match by.iter_mut().find(|b| b.0 == short) {
            Some(b) => {
                b.1 += ms as f64;
                b.2 += 1;
            }
            None => by.push((short, ms as f64, 1)),
        }
    }
    let parts: Vec<String> = by
        .iter()
        .map(|(n, ms, c)| {
            if *c > 1 {
                format!("{n} x{c} {ms:.4}")
            } else {
                format!("{n} {ms:.4}")
            }
        })
        .collect();
    format!("{} (sum {total:.4})", parts.join(" + "))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let desc = match engram::cuda::probe() {
        Ok(d) => d,
        Err(why) => {
            println!("SKIP: GPU benchmark: {why}");
            if std::env::var("ENGRAM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("ENGRAM_REQUIRE_GPU=1: a skip is a failure");
                std::process::exit(1);
            }
            return;
        }
    };
    let t_setup = Instant::now();
    let real = engram::cuda::driver::RealGpu::open(0).expect("device 0");
    let _g = real.enter().unwrap();
    let prof = Arc::new(ProfState::default());
    let gpu: Arc<dyn Gpu> = Arc::new(Prof {
        inner: real,
        st: prof.clone(),
    });
    println!("engram GPU benchmark: {}\n{desc}", gpu.describe());

    // The hash configuration only sizes the table: row ids are drawn directly.
    let layer_ids = [1u32];
    let primes = derive_primes_uniform(1, N, H, 40_000).unwrap();
    let mut offsets = vec![0u64; C];
    for c in 1..C {
        offsets[c] = offsets[c - 1] + primes[c - 1];
    }
    let rows = offsets[C - 1] + primes[C - 1];
    let token_map: Vec<i32> = (0..1000).collect();
    let mult: Vec<u64> = (0..N as u64).map(|i| 2 * i + 1).collect();
    let cfg_with = |gemv: Option<usize>, decode: Option<usize>| ContextConfig {
        geometry: Geometry {
            d: D,
            hc: HC,
            hd: HD,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: N,
            n_heads: H,
            token_map: &token_map,
            pad_id: 2,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 4096,
            max_seqs: 1,
            max_positions: 16,
        },
        n_threads: 2,
        backend: EngramBackend::Cuda as u32,
        device: 0,
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                gemv_max_tokens: gemv,
                decode_max_tokens: decode,
                device: Some(gpu.clone()),
            },
            ..Default::default()
        },
    };
    // The defaults but for the GEMV limit (with Some: the decode kernel
    // off, so that the rows below time the paths they name).
    let cfg_for = |gemv: Option<usize>| cfg_with(gemv, gemv.map(|_| 0));

    // Random data: fp8 rows (no NaN codes, scales near 1), bf16 wkv, q, k.
    let mut rng = Rng(7);
    let mut table = vec![0u8; rows as usize * ROW_BYTES];
    for r in table.chunks_exact_mut(ROW_BYTES) {
        for (i, b) in r.iter_mut().enumerate() {
            *b = if i < HD {
                let c = rng.next() as u8;
                if c & 0x7F == 0x7F {
                    c ^ 1
                } else {
                    c
                }
            } else {
                120 + (rng.next() % 8) as u8
            };
        }
    }
    let wkv_f: Vec<f32> = (0..K_OUT * K_IN).map(|_| rng.unit() / 64.0).collect();
    let wkv: Vec<u16> = wkv_f.iter().map(|&v| f32_to_bf16(v)).collect();
    let q: Vec<u16> = (0..HC * D)
        .map(|_| f32_to_bf16(1.0 + rng.unit() / 8.0))
        .collect();
    let k: Vec<u16> = (0..HC * D)
        .map(|_| f32_to_bf16(1.0 + rng.unit() / 8.0))
        .collect();
    let max_n = *TOKENS.last().unwrap();
    let ids: Vec<i64> = (0..max_n * C)
        .map(|i| (offsets[i % C] + rng.next() % primes[i % C]) as i64)
        .collect();
    // A second step's ids, for the prefetch pipeline.
    let ids_b: Vec<i64> = (0..max_n * C)
        .map(|i| (offsets[i % C] + rng.next() % primes[i % C]) as i64)
        .collect();
    let hw: Vec<f32> = (0..max_n * HC * D).map(|_| rng.unit()).collect();
    let (d_table, d_wkv, d_q, d_k) = (
        upload(&gpu, &table),
        upload(&gpu, &wkv),
        upload(&gpu, &q),
        upload(&gpu, &k),
    );
    let d_ids = upload(&gpu, &ids);
    let d_hw = upload(&gpu, &hw);
    let set = |ctx: &Context<'_>, table: u64, wkv: u64, wkv_type: EngramType| {
        // SAFETY: device (or host) buffers of the sizes the geometry implies,
        // alive for the bench.
        ctx.set_layer(unsafe {
            LayerIn::raw(
                1,
                table,
                EngramType::Fp8E4m3E8m0 as u32,
                rows,
                wkv,
                wkv_type as u32,
                d_q.ptr,
                d_k.ptr,
                EngramType::Bf16 as u32,
            )
        })
        .unwrap();
    };
    // Three contexts on the same weights: the defaults (the decode kernel up
    // to engram::cuda::DEFAULT_DECODE_MAX_TOKENS tokens, cuBLAS beyond), and
    // with the decode kernel off the GEMV for every count it takes, and
    // cuBLAS only.
    let make = |gemv: Option<usize>| {
        let ctx = Context::new(&cfg_for(gemv)).expect("CUDA context");
        set(&ctx, d_table.ptr, d_wkv.ptr, EngramType::Bf16);
        ctx
    };
    let ctx = make(None);
    let ctx_cublas = make(Some(0));
    let ctx_gemv = make(Some(engram::cuda::kernels::GEMV_MAX));
    let mut stream = std::ptr::null_mut();
    // SAFETY: an out-pointer local; the context is current.
    unsafe {
        ok(
            (drv().cuStreamCreate)(&mut stream, sys::CU_STREAM_NON_BLOCKING),
            "stream",
        )
    };
    let s = stream as *mut c_void;
    println!(
        "setup {:.1} s: table {} rows ({:.0} MB fp8), wkv {:.0} MB bf16, device memory of the context {:.0} MB",
        t_setup.elapsed().as_secs_f64(),
        rows,
        table.len() as f64 / 1e6,
        wkv.len() as f64 * 2.0 / 1e6,
        ctx.info().device_bytes as f64 / 1e6
    );

    // The ceilings, measured here.
    let copy_bytes = 1usize << 30;
    let (src, dst) = (
        DevBuf::new(&gpu, copy_bytes, "copy").unwrap(),
        DevBuf::new(&gpu, copy_bytes, "copy").unwrap(),
    );
    // SAFETY: two device buffers of `copy_bytes` each, on a live stream.
    let t_copy = time_ms(stream, 10, || unsafe {
        ok(
            (drv().cuMemcpyDtoDAsync_v2)(dst.ptr, src.ptr, copy_bytes, stream),
            "copy",
        )
    });
    let bw = 2.0 * copy_bytes as f64 / (t_copy * 1e-3); // bytes/s, read + write
    drop((src, dst));
    // Pinned host to device.
    let h2d_bytes = 256usize << 20;
    let pinned = engram::cuda::gpu::PinnedBuf::new(&gpu, h2d_bytes, false, "h2d").unwrap();
    let h2d_dst = DevBuf::new(&gpu, h2d_bytes, "h2d").unwrap();
    // SAFETY: pinned memory and a device buffer of h2d_bytes each.
    let t_h2d = time_ms(stream, 5, || unsafe {
        gpu.upload_async(h2d_dst.ptr, pinned.ptr, h2d_bytes, s)
            .unwrap()
    });
    let h2d_bw = h2d_bytes as f64 / (t_h2d * 1e-3);
    drop((pinned, h2d_dst));
    // The GEMM rate at the projection's own shape, on random data: the
    // benchmark's wkv and random bf16 rows for the most tokens.
    let mut blas = gpu.new_blas().unwrap();
    let probe_rows: Vec<u16> = (0..max_n * K_IN).map(|_| f32_to_bf16(rng.unit())).collect();
    let (gr, gc) = (
        upload(&gpu, &probe_rows),
        DevBuf::new(&gpu, max_n * K_OUT * 2, "gemm").unwrap(),
    );
    drop(probe_rows);
    let gemm = Gemm {
        f32: false,
        w: d_wkv.ptr,
        ldw: K_IN,
        rows: gr.ptr,
        ldr: K_IN,
        kv: gc.ptr,
        ldc: K_OUT,
        m: K_OUT,
        n: max_n,
        k: K_IN,
    };
    // SAFETY: wkv [K_OUT, K_IN], rows [max_n, K_IN], kv [max_n, K_OUT] bf16.
    let t_gemm = time_ms(stream, 10, || unsafe { blas.gemm(s, &gemm).unwrap() });
    let rate = 2.0 * (max_n * K_IN * K_OUT) as f64 / (t_gemm * 1e-3); // FLOP/s
    drop((gr, gc, blas));
    let wkv_bytes = (K_IN * K_OUT * 2) as f64;
    println!(
        "device copy bandwidth {:.0} GB/s (read + write); cuBLAS bf16 GEMM {:.0} TFLOP/s \
         ([{max_n} x {K_IN}] x [{K_IN} x {K_OUT}], random data); pinned host-to-device {:.1} GB/s",
        bw / 1e9,
        rate / 1e12,
        h2d_bw / 1e9
    );
    // The bytes an apply must move at the least: wkv, the gathered rows and
    // their ids, the f32 highway read and written.
    let bytes_of = |n: usize| wkv_bytes + (n * C * (ROW_BYTES + 8) + 2 * n * HC * D * 4) as f64;

    // engram: host row ids (engram_apply), device row ids (engram_apply_device_ids).
    let apply_with = |ctx: &Context<'_>, n: usize, host: bool| {
        let r = if host {
            RowIds::Host(&ids[..n * C])
        } else {
            RowIds::Device(d_ids.ptr)
        };
        // SAFETY: the device highway holds max_n tokens.
        let hw = unsafe { Highway::raw(d_hw.ptr, HighwayType::F32) };
        ctx.apply_on(1, r, n, hw, s).unwrap();
    };
    let apply = |n: usize, host: bool| apply_with(&ctx, n, host);
    // --decode-only: the decode kernel's rows alone (the GPU check's early
    // step); --no-decode: everything but them (its last step). Every row is
    // printed as it is measured (stdout is line-buffered), so a run cut short
    // keeps the rows it got.
    let args: Vec<String> = std::env::args().collect();
    let decode_only = args.iter().any(|a| a == "--decode-only");
    let no_decode = args.iter().any(|a| a == "--no-decode");
    let roof_of = |n: usize| {
        let flops = 2.0 * n as f64 * K_IN as f64 * K_OUT as f64;
        (bytes_of(n) / bw).max(flops / rate) * 1e3
    };
    println!(
        "roofline: max(bytes / {:.0} GB/s, FLOPs / {:.0} TFLOP/s), bytes = wkv + n*C*(row bytes + 8) + 2*n*hc*D*4 (highway read and written), \
         the rate cuBLAS's at this GEMM's shape on random data; kernels: ms per launch from events around each, in a separate pass (device ids)",
        bw / 1e9,
        rate / 1e12
    );

    // The checkpoint's block-scaled fp8 wkv (codes + 128 x 128 e8m0 scales),
    // read in place by the decode kernel and, below, by its GEMV and tiles.
    let (br, bc) = (128usize, 128usize);
    let codes: Vec<u8> = (0..K_OUT * K_IN)
        .map(|_| {
            let c = rng.next() as u8;
            if c & 0x7F == 0x7F {
                c ^ 1
            } else {
                c
            }
        })
        .collect();
    let scales: Vec<u8> = (0..K_OUT.div_ceil(br) * K_IN.div_ceil(bc))
        .map(|_| 111 + (rng.next() % 8) as u8)
        .collect();
    let (d_codes, d_scales) = (upload(&gpu, &codes), upload(&gpu, &scales));
    let set_fp8 = |ctx: &Context<'_>| {
        // SAFETY: device buffers of the sizes the geometry implies.
        let mut l = unsafe {
            LayerIn::raw(
                1,
                d_table.ptr,
                EngramType::Fp8E4m3E8m0 as u32,
                rows,
                d_codes.ptr,
                EngramType::Fp8E4m3E8m0Block as u32,
                d_q.ptr,
                d_k.ptr,
                EngramType::Bf16 as u32,
            )
        };
        // SAFETY: as above.
        l.wkv_scales = Some(unsafe { engram::Region::from_raw(d_scales.ptr as usize, None) });
        l.wkv_block = (br as u32, bc as u32);
        ctx.set_layer(l).unwrap();
    };
    let fp8_roof =
        |n: usize| ((codes.len() + scales.len()) as f64 + bytes_of(n) - wkv_bytes) / bw * 1e3;

    if !no_decode {
        // The decode kernel (issue 17) against the path before it, bf16 wkv:
        // one launch (gather, projection, and the gate in the last block
        // done), its split path (phase A, then the gate kernel), the GEMV
        // kernels (up to 8 tokens) and cuBLAS, 1 to 64 tokens, each against
        // the roofline of its bytes.
        let ctx_decode = {
            let c = Context::new(&cfg_with(None, Some(engram::cuda::kernels::DECODE_MAX)))
                .expect("CUDA context");
            set(&c, d_table.ptr, d_wkv.ptr, EngramType::Bf16);
            c
        };
        prof.refuse_fused.store(true, Ordering::Relaxed);
        let ctx_split = {
            let c = Context::new(&cfg_with(None, Some(engram::cuda::kernels::DECODE_MAX)))
                .expect("CUDA context");
            set(&c, d_table.ptr, d_wkv.ptr, EngramType::Bf16);
            c
        };
        // Refused once, the context keeps to the split path.
        apply_with(&ctx_split, 1, false);
        prof.refuse_fused.store(false, Ordering::Relaxed);
        // The grid the decode kernel gets here, per tile.
        let limits = gpu.device_limits().unwrap();
        let mut grids = Vec::new();
        for tile in [1usize, 8, 16] {
            let shared = (tile * K_IN * 2) as u32;
            let occ = gpu
                .occupancy(
                    engram::cuda::gpu::Kernel::Decode { fp8: false },
                    engram::cuda::kernels::DECODE_THREADS,
                    shared,
                )
                .unwrap();
            grids.push(format!(
                "tile {tile}: {} KiB shared, {occ} block(s)/SM, grid {}",
                shared >> 10,
                engram::cuda::kernels::decode_grid(K_OUT, limits.sms, occ)
            ));
        }
        println!("\n## the decode kernel (issue 17), bf16 wkv: one launch against its split path and the path before it (device ids, ms per apply)");
        println!("{}; roofline as above.", grids.join("; "));
        println!("| tokens | decode, one launch | / roofline | decode, split | GEMV (decode off) | cuBLAS (decode off) | roofline | kernels, one launch (ms) | kernels, split (ms) |");
        println!("|---:|---:|---:|---:|---:|---:|---:|---|---|");
        for n in [1usize, 2, 4, 8, 16, 32, 64] {
            let roof = roof_of(n);
            let t_one = time_ms(stream, 50, || apply_with(&ctx_decode, n, false));
            let t_split = time_ms(stream, 50, || apply_with(&ctx_split, n, false));
            let t_gemv = (n <= engram::cuda::kernels::GEMV_MAX)
                .then(|| time_ms(stream, 50, || apply_with(&ctx_gemv, n, false)));
            let t_blas = time_ms(stream, 50, || apply_with(&ctx_cublas, n, false));
            let k_one = breakdown(&prof, stream, || apply_with(&ctx_decode, n, false));
            let k_split = breakdown(&prof, stream, || apply_with(&ctx_split, n, false));
            println!(
                "| {n} | {t_one:.4} | {:.2} | {t_split:.4} | {} | {t_blas:.4} | {roof:.4} | {k_one} | {k_split} |",
                t_one / roof,
                t_gemv.map_or("-".into(), |t| format!("{t:.4}")),
            );
        }
        let dstats = (ctx_decode.info().decode, ctx_split.info().decode);
        println!(
            "\nDecode applies here: one launch {}, split {} (the split context: one launch {}, split {}, refused {})",
            dstats.0.cooperative,
            dstats.0.split,
            dstats.1.cooperative,
            dstats.1.split,
            dstats.1.refused
        );
        ctx_decode.check(s).unwrap();
        ctx_split.check(s).unwrap();
        drop(ctx_decode);
        drop(ctx_split);

        // The decode kernel on the fp8 codes, 1 to 64 tokens, against the
        // fp8 GEMV (the decode kernel off) at 1 and 8 tokens.
        println!("\n## the decode kernel on the checkpoint's fp8 wkv (codes + 128 x 128 scales read in place; roofline: their bytes plus the tokens' rows, ids and highway)");
        println!("| tokens | decode, one launch | roofline | ratio | fp8 GEMV (decode off) | kernels (ms) |");
        println!("|---:|---:|---:|---:|---:|---|");
        let gctx = Context::new(&cfg_for(Some(8))).expect("CUDA context");
        set_fp8(&gctx);
        let dctx = Context::new(&cfg_with(None, Some(engram::cuda::kernels::DECODE_MAX)))
            .expect("CUDA context");
        set_fp8(&dctx);
        for n in [1usize, 8, 16, 64] {
            let t = time_ms(stream, 50, || apply_with(&dctx, n, false));
            let roof = fp8_roof(n);
            let k = breakdown(&prof, stream, || apply_with(&dctx, n, false));
            let gemv =
                (n == 1 || n == 8).then(|| time_ms(stream, 50, || apply_with(&gctx, n, false)));
            println!(
                "| {n} | {t:.4} | {roof:.4} | {:.2} | {} | {k} |",
                t / roof,
                gemv.map_or("-".into(), |t| format!("{t:.4}"))
            );
        }
        dctx.check(s).unwrap();
        gctx.check(s).unwrap();
    }
    if decode_only {
        ctx.check(s).unwrap();
        println!("\ncommand: cargo bench --bench gpu -- --decode-only (or bash scripts/gpu-check.sh OUTDIR)");
        return;
    }

    println!("\n## apply at the V4.1 geometry (D 5120, hc 4, C 24, Hd 256; bf16 wkv [25600 x 6144] on the device; fp8 table on the device; f32 highway)");
    println!("roofline as above; torch eager: its own table below (it runs last)");
    println!("| tokens | engram ms (host ids) | engram ms (device ids) | roofline ms | engram / roofline | targets | kernels (ms) |");
    println!("|---:|---:|---:|---:|---:|---|---|");
    let reps = |n: usize| if n >= 512 { 20 } else { 50 };
    let mut results = Vec::new();
    for &n in &TOKENS {
        let host = time_ms(stream, reps(n), || apply(n, true));
        let device = time_ms(stream, reps(n), || apply(n, false));
        let roof = roof_of(n);
        // The kernels' times, in a pass of their own.
        let kernels = breakdown(&prof, stream, || apply(n, false));
        let best = host.min(device);
        // Issue 17's targets.
        let target = match n {
            1 => Some(1.10),
            8 | 64 => Some(1.15),
            4096 => Some(1.25),
            _ => None,
        };
        let t = target.map_or(String::new(), |r| {
            if best / roof <= r {
                format!("engram/roofline <= {r}: met")
            } else {
                format!("engram/roofline <= {r}: MISSED ({:.2})", best / roof)
            }
        });
        println!(
            "| {n} | {host:.4} | {device:.4} | {roof:.4} | {:.2} | {t} | {kernels} |",
            best / roof
        );
        results.push((n, best));
    }

    // GEMV kernel against cuBLAS for a few tokens.
    println!(
        "\n## projection for a few tokens: GEMV kernel against cuBLAS (device ids, ms per apply)"
    );
    println!("| tokens | GEMV | cuBLAS | faster | kernels, GEMV (ms) | kernels, cuBLAS (ms) |\n|---:|---:|---:|---|---|---|");
    for n in [1usize, 2, 4, 8] {
        let a = time_ms(stream, 50, || apply_with(&ctx_gemv, n, false));
        let b = time_ms(stream, 50, || apply_with(&ctx_cublas, n, false));
        let ka = breakdown(&prof, stream, || apply_with(&ctx_gemv, n, false));
        let kb = breakdown(&prof, stream, || apply_with(&ctx_cublas, n, false));
        println!(
            "| {n} | {a:.4} | {b:.4} | {} | {ka} | {kb} |",
            if a <= b { "GEMV" } else { "cuBLAS" }
        );
    }
    ctx_cublas.check(s).unwrap();
    ctx_gemv.check(s).unwrap();
    drop(ctx_cublas);
    drop(ctx_gemv);

    // Quantised wkv, read in place: the fused GEMV (1 and 8 tokens) and the
    // bf16 tiles + cuBLAS (512 tokens), against each format's own roofline
    // (its bytes over the copy bandwidth) at 1 token.
    println!("\n## quantised wkv read in place (device ids, ms per apply; roofline: the format's bytes plus one token's rows, ids and highway, over the copy bandwidth)");
    println!("| wkv | MB | 1 token (fused GEMV) | roofline | ratio | 8 tokens (fused GEMV) | 8 tokens (bf16 tiles + cuBLAS) | 512 tokens (bf16 tiles + cuBLAS) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut quant_kernels = Vec::new();
    {
        let q8 = q8_0(&wkv_f);
        let q4k = q4_k_random(&mut rng, K_OUT * K_IN / 256);
        for (name, ty, bytes) in [
            ("q8_0", EngramType::Q8_0, &q8),
            ("q4_K", EngramType::Q4_K, &q4k),
        ] {
            let d_w = upload(&gpu, bytes);
            let qctx = Context::new(&cfg_for(None)).expect("CUDA context");
            set(&qctx, d_table.ptr, d_w.ptr, ty);
            let t1 = time_ms(stream, 50, || apply_with(&qctx, 1, false));
            let t8 = time_ms(stream, 50, || apply_with(&qctx, 8, false));
            let t512 = time_ms(stream, 10, || apply_with(&qctx, 512, false));
            let k1 = breakdown(&prof, stream, || apply_with(&qctx, 1, false));
            let k8 = breakdown(&prof, stream, || apply_with(&qctx, 8, false));
            let k512 = breakdown(&prof, stream, || apply_with(&qctx, 512, false));
            qctx.check(s).unwrap();
            drop(qctx);
            // The same 8 tokens through the bf16 tiles and cuBLAS.
            let tctx = Context::new(&cfg_for(Some(0))).expect("CUDA context");
            set(&tctx, d_table.ptr, d_w.ptr, ty);
            let t8_tiles = time_ms(stream, 50, || apply_with(&tctx, 8, false));
            let k8_tiles = breakdown(&prof, stream, || apply_with(&tctx, 8, false));
            tctx.check(s).unwrap();
            let roof1 = (bytes.len() as f64 + bytes_of(1) - wkv_bytes) / bw * 1e3;
            println!(
                "| {name} | {:.0} | {t1:.4} | {roof1:.4} | {:.2} | {t8:.4} | {t8_tiles:.4} | {t512:.4} |",
                bytes.len() as f64 / 1e6,
                t1 / roof1
            );
            quant_kernels.push(format!("| {name} | {k1} | {k8} | {k8_tiles} | {k512} |"));
        }
    }
    // The checkpoint's fp8 wkv: its GEMV at 1 token (and at 8 with the GEMV
    // limit raised), exact bf16 tiles + cuBLAS beyond, against its own
    // roofline; 4096 tokens against the bf16 wkv's apply of this run.
    {
        // The GEMV at 1 token, the tiles from 2 (the decode kernel off).
        let fctx = Context::new(&cfg_for(Some(1))).expect("CUDA context");
        set_fp8(&fctx);
        let t1 = time_ms(stream, 50, || apply_with(&fctx, 1, false));
        let t8_tiles = time_ms(stream, 50, || apply_with(&fctx, 8, false));
        let t512 = time_ms(stream, 10, || apply_with(&fctx, 512, false));
        let t4096 = time_ms(stream, 5, || apply_with(&fctx, 4096, false));
        fctx.check(s).unwrap();
        drop(fctx);
        let gctx = Context::new(&cfg_for(Some(8))).expect("CUDA context");
        set_fp8(&gctx);
        let t8 = time_ms(stream, 50, || apply_with(&gctx, 8, false));
        gctx.check(s).unwrap();
        drop(gctx);
        let bytes = (codes.len() + scales.len()) as f64;
        let roof1 = bytes / bw * 1e3;
        println!(
            "| fp8 (checkpoint) | {:.0} | {t1:.4} | {roof1:.4} | {:.2} | {t8:.4} | {t8_tiles:.4} | {t512:.4} |",
            bytes / 1e6,
            t1 / roof1
        );
        let bf16_4096 = results.iter().find(|r| r.0 == 4096).map(|r| r.1);
        println!(
            "\nfp8 (checkpoint) at 4096 tokens: {t4096:.3} ms; bf16 wkv: {} ms",
            bf16_4096.map_or("-".into(), |t| format!("{t:.3}"))
        );
    }
    println!("\nkernels (ms, events around each launch, separate pass):\n");
    println!(
        "| wkv | 1 token | 8 tokens (fused GEMV) | 8 tokens (bf16 tiles + cuBLAS) | 512 tokens |"
    );
    println!("|---|---|---|---|---|");
    for l in quant_kernels {
        println!("{l}");
    }

    // Host tables: the same fp8 table in pageable host memory; rows gathered
    // on the host (prefetch worker threads, or the apply), copied through
    // pinned staging to the device, then the same kernels.
    println!("\n## host table (the fp8 table in pageable host memory; ms per step by the wall clock, host gather included)");
    println!("| tokens | H2D bytes / step | H2D ms at the pinned rate | apply, no prefetch | apply + next step's prefetch | device-table apply | pipelined / device table | kernels of a prefetched apply (ms) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---|");
    {
        let hctx = Context::new(&cfg_for(None)).expect("CUDA context");
        set(&hctx, table.as_ptr() as u64, d_wkv.ptr, EngramType::Bf16);
        let per_token = C * (ROW_BYTES + 8);
        for &n in &[1usize, 64, 512, 4096] {
            let steps = [&ids[..n * C], &ids_b[..n * C]];
            let hwr = || {
                // SAFETY: the device highway holds max_n tokens.
                unsafe { Highway::raw(d_hw.ptr, HighwayType::F32) }
            };
            let r = if n >= 512 { 5 } else { 20 };
            // No prefetch: the apply gathers on its own thread.
            let direct = wall_ms(stream, r, |i| {
                hctx.apply_on(1, RowIds::Host(steps[i % 2]), n, hwr(), s)
                    .unwrap()
            });
            // The engine's pipeline: the next step's prefetch starts right
            // after this step's apply is queued.
            hctx.prefetch(1, steps[0], n).unwrap();
            let piped = wall_ms(stream, r, |i| {
                hctx.apply_on(1, RowIds::Host(steps[i % 2]), n, hwr(), s)
                    .unwrap();
                hctx.prefetch(1, steps[(i + 1) % 2], n).unwrap();
            });
            // The device-table apply of the same step, for comparison.
            let dev_ms = time_ms(stream, r, || apply(n, true));
            let h2d_ms = (n * per_token) as f64 / h2d_bw * 1e3;
            // The device side of a prefetched host-table apply, in a pass of its own.
            hctx.prefetch(1, steps[0], n).unwrap();
            let kernels = breakdown(&prof, stream, || {
                hctx.apply_on(1, RowIds::Host(steps[0]), n, hwr(), s)
                    .unwrap()
            });
            println!(
                "| {n} | {} | {h2d_ms:.4} | {direct:.4} | {piped:.4} | {dev_ms:.4} | {:.2} | {kernels} |",
                n * per_token,
                piped / dev_ms
            );
        }
        hctx.check(s).unwrap();
        let st = hctx.info().stage;
        println!(
            "\nprefetches {}, applies served from a prefetch {}, read at the apply {}; pinned staging {:.0} MB",
            st.prefetched,
            st.staged,
            st.direct,
            hctx.info().host_bytes as f64 / 1e6
        );
    }

    // The torch eager peer, on the same data (last: a Python process of its
    // own; the probe at the GPU check's start says whether it can run).
    let peer = run_peer(&table, rows as usize, &wkv, &q, &k, &ids, &ctx, &gpu, s);
    println!("\n## torch eager against engram (the same forward on the same data, f32 highway; ms per apply, engram's best of host and device ids from the apply table)");
    println!("| tokens | engram ms | torch eager ms | torch / engram | target |");
    println!("|---:|---:|---:|---:|---|");
    for &(n, best) in &results {
        let torch = peer.as_ref().and_then(|p| p["ms"][n.to_string()].as_f64());
        let target = if n > 64 {
            String::new()
        } else {
            match torch {
                Some(x) if x / best >= 2.0 => "torch/engram >= 2: met".to_string(),
                Some(x) => format!("torch/engram >= 2: MISSED ({:.2})", x / best),
                None => "torch/engram >= 2: no peer".into(),
            }
        };
        println!(
            "| {n} | {best:.4} | {} | {} | {target} |",
            torch.map_or("-".into(), |t| format!("{t:.4}")),
            torch.map_or("-".into(), |t| format!("{:.2}", t / best)),
        );
    }
    if let Some(p) = &peer {
        println!(
            "\ntorch {} on {}; same forward check (8 tokens, f32 highway): max |engram - torch| = {:.3e}, max |update| = {:.3e}",
            p["torch"].as_str().unwrap_or("?"),
            p["device"].as_str().unwrap_or("?"),
            p["check_max_abs_diff"].as_f64().unwrap_or(f64::NAN),
            p["check_max_abs_update"].as_f64().unwrap_or(f64::NAN)
        );
    }
    ctx.check(s).unwrap();
    device_hash_rows(&gpu, stream, &|ctx| {
        set(ctx, d_table.ptr, d_wkv.ptr, EngramType::Bf16)
    });
    println!("\ncommand: cargo bench --bench gpu (or bash scripts/gpu-check.sh OUTDIR)");
}

/// The device hash (`engram_hash_device`, issue 18): its time for 1 to 4096
/// tokens over 1 to 256 sequences (V4.1-sized tables: 4 look-backs, 8 heads,
/// two layers, primes near 16M, a 129280-entry map), and one decode step of
/// 1 token (device hash + two applies) captured in a CUDA graph against the
/// same step with the host hash, the ids copied from the host and a sync.
fn device_hash_rows(gpu: &Arc<dyn Gpu>, stream: sys::CUstream, set: &dyn Fn(&Context<'_>)) {
    let s = stream as *mut c_void;
    let layer_ids = [1u32, 2];
    let primes = derive_primes_uniform(2, N, H, 16_000_000).unwrap();
    let mut offsets = vec![0u64; 2 * C];
    for l in 0..2 {
        for c in 1..C {
            offsets[l * C + c] = offsets[l * C + c - 1] + primes[l * C + c - 1];
        }
    }
    let mut rng = Rng(99);
    let token_map: Vec<i32> = (0..129_280).map(|i| i % 100_000).collect();
    let mult: Vec<u64> = (0..2 * N).map(|_| rng.next() | 1).collect();
    let max_seqs = 256;
    let cfg = ContextConfig {
        geometry: Geometry {
            d: D,
            hc: HC,
            hd: HD,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: N,
            n_heads: H,
            token_map: &token_map,
            pad_id: 2,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 4096,
            max_seqs,
            max_positions: 1 << 20,
        },
        n_threads: 2,
        backend: EngramBackend::Cuda as u32,
        device: 0,
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                gemv_max_tokens: None,
                device: Some(gpu.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
    };
    let ctx = Context::new(&cfg)
        .expect("CUDA context")
        .with_device_history(64)
        .expect("device history");
    let per = ctx.ids_per_token();
    let d_ids = DevBuf::new(gpu, 4096 * per * 8, "bench ids").unwrap();
    println!("\n## device hash (engram_hash_device, ms per call, CUDA events, median of 3 runs)");
    println!("| tokens | sequences | ms | ns per token |\n|---:|---:|---:|---:|");
    let hash = |tokens: &[i32], sq: &[i32], ps: &[i32], reps: usize| -> f64 {
        let (t, q, p) = (upload(gpu, tokens), upload(gpu, sq), upload(gpu, ps));
        let call = engram::call::DeviceHashIn {
            tokens: t.ptr,
            seq_ids: q.ptr,
            pos: p.ptr,
            n: tokens.len(),
            row_ids: d_ids.ptr,
            stream: s,
        };
        let ms = time_ms(stream, reps, || ctx.hash_device(&call).unwrap());
        ctx.check(s).unwrap();
        ms
    };
    // Positions 0..8 of every sequence, so that a run from position 8 looks
    // back into the ring (a run of up to 56 tokens re-hashed at every rep
    // leaves positions 5..7 in it); longer runs start at 0.
    let warm: Vec<i32> = (0..max_seqs * 8).map(|i| (i % 1000) as i32).collect();
    let warm_s: Vec<i32> = (0..max_seqs * 8).map(|i| (i / 8) as i32).collect();
    let warm_p: Vec<i32> = (0..max_seqs * 8).map(|i| (i % 8) as i32).collect();
    hash(&warm, &warm_s, &warm_p, 1);
    for (n, seqs) in [
        (1usize, 1usize),
        (64, 1),
        (4096, 1),
        (64, 64),
        (256, 256),
        (4096, 256),
    ] {
        // `seqs` runs of n / seqs tokens each.
        let k = n / seqs;
        let start = if k <= 56 { 8 } else { 0 };
        let mut tokens = Vec::with_capacity(n);
        let (mut sq, mut ps) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for q in 0..seqs {
            for j in 0..k {
                tokens.push((rng.next() % 129_280) as i32);
                sq.push(q as i32);
                ps.push(start + j as i32);
            }
        }
        let ms = hash(&tokens, &sq, &ps, 20);
        println!("| {n} | {seqs} | {ms:.4} | {:.1} |", ms * 1e6 / n as f64);
    }
    // One decode step: captured (hash + 2 applies) against the host path.
    let layer_ctx = |device_history: bool| {
        let mut c = cfg_clone(&cfg);
        c.tables.layer_ids = &layer_ids[..1];
        c.tables.multipliers = &mult[..N];
        c.tables.primes = &primes[..C];
        c.tables.offsets = &offsets[..C];
        let ctx = Context::new(&c).expect("CUDA context");
        let ctx = if device_history {
            ctx.with_device_history(64).expect("device history")
        } else {
            ctx
        };
        set(&ctx);
        ctx
    };
    let dev_ctx = layer_ctx(true);
    let host_ctx = layer_ctx(false);
    let mut cpu_cfg = cfg_clone(&cfg);
    cpu_cfg.backend = EngramBackend::Cpu as u32;
    cpu_cfg.tables.layer_ids = &layer_ids[..1];
    cpu_cfg.tables.multipliers = &mult[..N];
    cpu_cfg.tables.primes = &primes[..C];
    cpu_cfg.tables.offsets = &offsets[..C];
    let cpu = Context::new(&cpu_cfg).expect("CPU context for the host hash");
    let per1 = dev_ctx.ids_per_token();
    let (tok, sq, ps) = (
        upload(gpu, &[5i32]),
        upload(gpu, &[0i32]),
        upload(gpu, &[0i32]),
    );
    let ids1 = DevBuf::new(gpu, per1 * 8, "bench step ids").unwrap();
    let hw = upload(gpu, &vec![0.5f32; HC * D]);
    // SAFETY: the device highway holds one token.
    let hwr = || unsafe { Highway::raw(hw.ptr, HighwayType::F32) };
    let d = drv();
    let mut graph = std::ptr::null_mut();
    let mut exec = std::ptr::null_mut();
    // SAFETY: a live stream of the current context; the capture ends below.
    unsafe {
        ok(
            d.cuStreamBeginCapture_v2.unwrap()(stream, sys::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "begin capture",
        )
    };
    dev_ctx
        .hash_device(&engram::call::DeviceHashIn {
            tokens: tok.ptr,
            seq_ids: sq.ptr,
            pos: ps.ptr,
            n: 1,
            row_ids: ids1.ptr,
            stream: s,
        })
        .unwrap();
    for _ in 0..2 {
        dev_ctx
            .apply_on(1, RowIds::Device(ids1.ptr), 1, hwr(), s)
            .unwrap();
    }
    // SAFETY: ends the capture begun above and instantiates it.
    unsafe {
        ok(
            d.cuStreamEndCapture.unwrap()(stream, &mut graph),
            "end capture",
        );
        ok(
            d.cuGraphInstantiateWithFlags.unwrap()(&mut exec, graph, 0),
            "instantiate",
        );
    }
    let captured = wall_ms(stream, 200, |_| {
        // SAFETY: the instantiated graph on its stream.
        unsafe { ok(d.cuGraphLaunch.unwrap()(exec, stream), "graph launch") };
        // SAFETY: a live stream (the step's sync, as the host path has).
        unsafe { ok((d.cuStreamSynchronize)(stream), "sync") };
    });
    let mut host_ids = vec![0i64; per1];
    let host = wall_ms(stream, 200, |i| {
        // The token comes from the device: copy it back and wait, hash on
        // the host, apply with host ids (staged and copied by the call).
        let t = tok.read::<i32>(1).unwrap();
        cpu.hash(&t, &[0], &[(i % 1000) as i32], &mut host_ids)
            .unwrap();
        for _ in 0..2 {
            host_ctx
                .apply_on(1, RowIds::Host(&host_ids), 1, hwr(), s)
                .unwrap();
        }
        // SAFETY: a live stream.
        unsafe { ok((d.cuStreamSynchronize)(stream), "sync") };
    });
    // SAFETY: the graph made above, idle after the last sync.
    unsafe {
        ok(d.cuGraphExecDestroy.unwrap()(exec), "destroy exec");
        ok(d.cuGraphDestroy.unwrap()(graph), "destroy graph");
    }
    println!("\n## one decode step, 1 token: device hash + 2 applies in one CUDA graph, against the host hash (ms per step by the wall clock, median of 3 runs of 200)");
    println!("| captured graph (hash on the device) | token read back + host hash + 2 applies with host ids + sync | host / graph |\n|---:|---:|---:|");
    println!("| {captured:.4} | {host:.4} | {:.2} |", host / captured);
}

/// A copy of a context configuration (it borrows the same tables).
fn cfg_clone<'a>(c: &ContextConfig<'a>) -> ContextConfig<'a> {
    ContextConfig {
        geometry: c.geometry,
        tables: HashTablesIn {
            layer_ids: c.tables.layer_ids,
            max_ngram: c.tables.max_ngram,
            n_heads: c.tables.n_heads,
            token_map: c.tables.token_map,
            pad_id: c.tables.pad_id,
            multipliers: c.tables.multipliers,
            primes: c.tables.primes,
            offsets: c.tables.offsets,
        },
        limits: c.limits,
        n_threads: c.n_threads,
        backend: c.backend,
        device: c.device,
        tuning: c.tuning.clone(),
    }
}

/// Run bench/gpu_peer.py on the same data; `None` (said why) without torch.
#[allow(clippy::too_many_arguments)]
fn run_peer(
    table: &[u8],
    rows: usize,
    wkv: &[u16],
    q: &[u16],
    k: &[u16],
    ids: &[i64],
    ctx: &Context<'_>,
    gpu: &Arc<dyn Gpu>,
    s: *mut c_void,
) -> Option<Value> {
    let py = std::env::var("ENGRAM_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let dir = std::env::temp_dir().join(format!("engram-gpu-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The forward check: 8 tokens, engram's result next to the peer's.
    let n_check = 8;
    let mut rng = Rng(99);
    let hw: Vec<f32> = (0..n_check * HC * D).map(|_| rng.unit()).collect();
    let d_hw = upload(gpu, &hw);
    // SAFETY: the device highway holds n_check tokens.
    let hwr = unsafe { Highway::raw(d_hw.ptr, HighwayType::F32) };
    ctx.apply_on(1, RowIds::Host(&ids[..n_check * C]), n_check, hwr, s)
        .unwrap();
    ctx.check(s).unwrap();
    let out: Vec<f32> = d_hw.read(hw.len()).unwrap();
    let p = |name: &str| dir.join(name);
    write(&p("table.u8"), table);
    write(&p("wkv.bf16"), wkv);
    write(&p("q.bf16"), q);
    write(&p("k.bf16"), k);
    write(&p("ids.i64"), ids);
    write(&p("check_in.f32"), &hw);
    write(&p("check_engram.f32"), &out);
    let spec = json!({
        "dir": dir, "rows": rows, "row_bytes": ROW_BYTES, "D": D, "hc": HC, "Hd": HD, "C": C,
        "eps": 1e-6, "tokens": TOKENS, "n_check": n_check,
    });
    std::fs::write(p("spec.json"), spec.to_string()).unwrap();
    let res = std::process::Command::new(&py)
        .arg(root().join("bench/gpu_peer.py"))
        .arg(p("spec.json"))
        .output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = match res {
        Ok(o) => o,
        Err(e) => {
            println!("(torch peer skipped: cannot run {py}: {e})");
            return None;
        }
    };
    if !out.status.success() {
        println!(
            "(torch peer failed or unavailable: {})",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    serde_json::from_str(&line).ok()
}
