//! GPU benchmark: `engram_apply` on the CUDA backend at the DeepSeek-V4.1
//! geometry (D 5120, hc 4, C 24, Hd 256; bf16 `wkv` [25600 x 6144]; fp8 table
//! on the device; random data) for 1, 8, 64, 512 and 4096 tokens, against
//! PyTorch eager computing the same forward on the same GPU, and against the
//! roofline, all measured in this one run:
//!
//! - roofline = max(wkv bytes / device copy bandwidth, GEMM FLOPs / cuBLAS bf16
//!   rate), the bandwidth from a large device-to-device copy (read + write
//!   bytes over time) and the rate from an 8192^3 bf16 cuBLAS GEMM, both timed here;
//! - torch eager: `bench/gpu_peer.py` (run with `$ENGRAM_TORCH_PYTHON`, default
//!   `python3`), the same gather, fp8 dequantisation, `F.linear` and gate.
//!
//!     cargo bench --bench gpu
//!
//! Without a CUDA driver it says so and exits 0 (1 with `ENGRAM_REQUIRE_GPU=1`);
//! without torch it skips the peer.

use cudarc::driver::sys;
use engram::cuda::driver::{DevBuf, Device};
use engram::formats::f32_to_bf16;
use engram::hash::derive_primes_uniform;
use engram::{Context, ContextConfig, EngramBackend, Geometry, HashTablesIn, Limits};
use engram::{Highway, HighwayType, LayerIn, RowIds};
use serde_json::{json, Value};
use std::ffi::c_void;
use std::path::PathBuf;
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
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn upload<T: Copy>(dev: &Device, data: &[T]) -> DevBuf {
    let bytes = std::mem::size_of_val(data);
    let b = DevBuf::new(dev.ctx, bytes, "bench data").unwrap();
    // SAFETY: `b` holds `bytes` bytes of device memory; the context is current.
    unsafe {
        ok(
            sys::cuMemcpyHtoD_v2(b.ptr, data.as_ptr() as *const c_void, bytes),
            "upload",
        )
    };
    b
}

/// Milliseconds per call of `f` on `stream`, timed with CUDA events over
/// `reps` back-to-back calls after a warm-up (the median of 3 such runs).
fn time_ms(stream: sys::CUstream, reps: usize, mut f: impl FnMut()) -> f64 {
    let mut e0 = std::ptr::null_mut();
    let mut e1 = std::ptr::null_mut();
    // SAFETY: out-pointers are locals; the context is current.
    unsafe {
        ok(sys::cuEventCreate(&mut e0, 0), "event");
        ok(sys::cuEventCreate(&mut e1, 0), "event");
    }
    for _ in 0..3 {
        f();
    }
    // SAFETY: a live stream of the current context.
    unsafe { ok(sys::cuStreamSynchronize(stream), "sync") };
    let mut runs = Vec::new();
    for _ in 0..3 {
        // SAFETY: a live event and stream.
        unsafe { ok(sys::cuEventRecord(e0, stream), "record") };
        for _ in 0..reps {
            f();
        }
        let mut ms = 0f32;
        // SAFETY: live events recorded on a live stream; `ms` is a local.
        unsafe {
            ok(sys::cuEventRecord(e1, stream), "record");
            ok(sys::cuEventSynchronize(e1), "event sync");
            ok(sys::cuEventElapsedTime(&mut ms, e0, e1), "elapsed");
        }
        runs.push(ms as f64 / reps as f64);
    }
    // SAFETY: the events were created above and are destroyed once.
    unsafe {
        sys::cuEventDestroy_v2(e0);
        sys::cuEventDestroy_v2(e1);
    }
    runs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    runs[1]
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn write<T: Copy>(path: &PathBuf, data: &[T]) {
    // SAFETY: any initialised `T: Copy` is readable as its bytes.
    let bytes = unsafe {
        std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
    };
    std::fs::write(path, bytes).unwrap();
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
    let dev = Device::open(0).expect("device 0");
    let _scope = dev.scope().unwrap();
    println!(
        "engram GPU benchmark: {} (sm_{}{}), {desc}",
        dev.name, dev.cc.0, dev.cc.1
    );

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
    let cfg_for = |gemv: Option<usize>| ContextConfig {
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
        n_threads: 1,
        backend: EngramBackend::Cuda as u32,
        device: 0,
        tuning: engram::Tuning {
            gemv_max_tokens: gemv,
            ..Default::default()
        },
    };

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
    let wkv: Vec<u16> = (0..K_OUT * K_IN)
        .map(|_| f32_to_bf16(rng.unit() / 64.0))
        .collect();
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
    let hw: Vec<f32> = (0..max_n * HC * D).map(|_| rng.unit()).collect();
    let (d_table, d_wkv, d_q, d_k) = (
        upload(&dev, &table),
        upload(&dev, &wkv),
        upload(&dev, &q),
        upload(&dev, &k),
    );
    let d_ids = upload(&dev, &ids);
    let d_hw = upload(&dev, &hw);
    // Two contexts on the same weights: the default (GEMV up to
    // engram::cuda::DEFAULT_GEMV_MAX_TOKENS tokens) and cuBLAS only.
    let make = |gemv: Option<usize>| {
        let ctx = Context::new(&cfg_for(gemv)).expect("CUDA context");
        // SAFETY: device buffers of the sizes the geometry implies, alive for the bench.
        ctx.set_layer(unsafe {
            LayerIn::raw(
                1,
                d_table.ptr,
                engram::EngramType::Fp8E4m3E8m0 as u32,
                rows,
                d_wkv.ptr,
                engram::EngramType::Bf16 as u32,
                d_q.ptr,
                d_k.ptr,
                engram::EngramType::Bf16 as u32,
            )
        })
        .unwrap();
        ctx
    };
    let ctx = make(None);
    let ctx_cublas = make(Some(0));
    let mut stream = std::ptr::null_mut();
    // SAFETY: an out-pointer local; the context is current.
    unsafe {
        ok(
            sys::cuStreamCreate(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            ),
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

    // The two ceilings, measured here.
    let copy_bytes = 1usize << 30;
    let (src, dst) = (
        DevBuf::new(dev.ctx, copy_bytes, "copy").unwrap(),
        DevBuf::new(dev.ctx, copy_bytes, "copy").unwrap(),
    );
    // SAFETY: two device buffers of `copy_bytes` each, on a live stream.
    let t_copy = time_ms(stream, 10, || unsafe {
        ok(
            sys::cuMemcpyDtoDAsync_v2(dst.ptr, src.ptr, copy_bytes, stream),
            "copy",
        )
    });
    let bw = 2.0 * copy_bytes as f64 / (t_copy * 1e-3); // bytes/s, read + write
    drop((src, dst));
    let g = 8192usize;
    let blas = engram::cuda::blas::Blas::new(dev.ctx).unwrap();
    let (ga, gb, gc) = (
        DevBuf::new(dev.ctx, g * g * 2, "gemm").unwrap(),
        DevBuf::new(dev.ctx, g * g * 2, "gemm").unwrap(),
        DevBuf::new(dev.ctx, g * g * 2, "gemm").unwrap(),
    );
    // SAFETY: device buffers of g*g*2 bytes each.
    unsafe {
        ok(sys::cuMemsetD8_v2(ga.ptr, 0x3c, g * g * 2), "memset");
        ok(sys::cuMemsetD8_v2(gb.ptr, 0x3c, g * g * 2), "memset");
    }
    // SAFETY: the GEMM's buffers hold g*g bf16 each, on the current context.
    let t_gemm = time_ms(stream, 10, || unsafe {
        blas.gemm(stream, false, ga.ptr, gb.ptr, gc.ptr, g, g, g)
            .unwrap()
    });
    let rate = 2.0 * (g as f64).powi(3) / (t_gemm * 1e-3); // FLOP/s
    drop((ga, gb, gc, blas));
    let wkv_bytes = (K_IN * K_OUT * 2) as f64;
    println!(
        "device copy bandwidth {:.0} GB/s (read + write); cuBLAS bf16 GEMM {:.0} TFLOP/s (8192^3)",
        bw / 1e9,
        rate / 1e12
    );

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
    let reps = |n: usize| if n >= 512 { 20 } else { 50 };
    let mut results = Vec::new();
    for &n in &TOKENS {
        let host = time_ms(stream, reps(n), || apply(n, true));
        let device = time_ms(stream, reps(n), || apply(n, false));
        let flops = 2.0 * n as f64 * K_IN as f64 * K_OUT as f64;
        let roof = (wkv_bytes / bw).max(flops / rate) * 1e3;
        results.push((n, host, device, roof));
    }
    // GEMV kernel against cuBLAS for a few tokens (the default is the GEMV up to
    // engram::cuda::DEFAULT_GEMV_MAX_TOKENS tokens).
    let mut gemv_lines = Vec::new();
    for n in [1usize, 2, 4, 8] {
        let a = time_ms(stream, 50, || apply(n, false));
        let b = time_ms(stream, 50, || apply_with(&ctx_cublas, n, false));
        gemv_lines.push(format!(
            "| {n} | {a:.4} | {b:.4} | {} |",
            if a <= b { "GEMV" } else { "cuBLAS" }
        ));
    }
    ctx.check(s).unwrap();
    ctx_cublas.check(s).unwrap();
    drop(ctx_cublas);

    // The torch eager peer, on the same data.
    let peer = run_peer(&table, rows as usize, &wkv, &q, &k, &ids, &ctx, &dev, s);

    println!("\n## apply at the V4.1 geometry (D 5120, hc 4, C 24, Hd 256; bf16 wkv [25600 x 6144] on the device; fp8 table on the device; f32 highway)");
    println!("| tokens | engram ms (host ids) | engram ms (device ids) | torch eager ms | torch / engram | roofline ms | engram / roofline | targets |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---|");
    for &(n, host, device, roof) in &results {
        let torch = peer.as_ref().and_then(|p| p["ms"][n.to_string()].as_f64());
        let target = match n {
            1 => "torch/engram >= 2, engram/roofline <= 1.25",
            8 | 64 => "torch/engram >= 2",
            4096 => "engram/roofline <= 1.15",
            _ => "",
        };
        println!(
            "| {n} | {host:.4} | {device:.4} | {} | {} | {roof:.4} | {:.2} | {target} |",
            torch.map_or("-".into(), |t| format!("{t:.4}")),
            torch.map_or("-".into(), |t| format!("{:.2}", t / host)),
            host / roof
        );
    }
    println!(
        "\n## projection for a few tokens: GEMV kernel against cuBLAS (device ids, ms per apply)"
    );
    println!("| tokens | GEMV | cuBLAS | faster |\n|---:|---:|---:|---|");
    for l in gemv_lines {
        println!("{l}");
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
    println!("\ncommand: cargo bench --bench gpu");
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
    dev: &Device,
    s: *mut c_void,
) -> Option<Value> {
    let py = std::env::var("ENGRAM_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let dir = std::env::temp_dir().join(format!("engram-gpu-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The forward check: 8 tokens, engram's result next to the peer's.
    let n_check = 8;
    let mut rng = Rng(99);
    let hw: Vec<f32> = (0..n_check * HC * D).map(|_| rng.unit()).collect();
    let d_hw = upload(dev, &hw);
    // SAFETY: the device highway holds n_check tokens.
    let hwr = unsafe { Highway::raw(d_hw.ptr, HighwayType::F32) };
    ctx.apply_on(1, RowIds::Host(&ids[..n_check * C]), n_check, hwr, s)
        .unwrap();
    ctx.check(s).unwrap();
    let mut out = vec![0f32; hw.len()];
    // SAFETY: `out` holds the highway's bytes; the device buffer as many.
    unsafe {
        ok(
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr() as *mut c_void, d_hw.ptr, out.len() * 4),
            "download",
        )
    };
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
