//! The CUDA backend against the golden data: every golden regime (rows
//! bit-identical to the CPU backend, kv and highway within the bounds of
//! `tests/golden.rs`), f32 and bf16 highways, host and device row ids, with
//! the decode kernel (the default for few tokens), the GEMV kernels and
//! cuBLAS; the GEMV kernel at every size it takes, errors found on the
//! device (through the decode kernel), the
//! argument checks, allocations mapped in pieces, 64-bit offsets into a
//! table of the real row count; on a GPU also a CUDA graph replay and two
//! contexts on two streams at once.
//!
//! Runs on the GPU when there is one, else on the emulation (the real
//! `CudaBackend` over the kernels compiled as host C++; see
//! `tests/common/device.rs`). `ENGRAM_REQUIRE_GPU=1` (set by
//! `scripts/gpu-check.sh`) requires the GPU. Run with `--test-threads=1`
//! where other work shares the GPU: one test captures a CUDA graph (in
//! thread-local capture mode).

mod common;

use common::bounds::*;
use common::device::{dev_model, device, emulated, Dev, DevWeights};
use common::golden_calls as calls;
use common::*;
use engram::cuda::gpu::DevBuf;
use engram::cuda::sys;
use engram::formats::{bf16_to_f32, f32_to_bf16};
use engram::RowIds;
use engram::{Context, EngramBackend, EngramStatus, EngramType};
use std::ffi::c_void;

fn dcheck(r: sys::CUresult, what: &str) {
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

fn new_stream(dev: &Dev) -> sys::CUstream {
    let _g = dev.gpu.enter().unwrap();
    let mut s = std::ptr::null_mut();
    // SAFETY: the device's context is current.
    unsafe {
        dcheck(
            (drv().cuStreamCreate)(&mut s, sys::CU_STREAM_NON_BLOCKING),
            "cuStreamCreate",
        )
    };
    s
}

fn sync(dev: &Dev, s: sys::CUstream) {
    dev.gpu.stream_synchronize(s as *mut c_void).unwrap();
}

/// The projection a test context uses for few tokens: the defaults (the
/// decode kernel up to `DEFAULT_DECODE_MAX_TOKENS`), or with the decode
/// kernel off, the GEMV kernels up to 8 tokens or cuBLAS for every call.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Proj {
    Default,
    Gemv,
    Blas,
}

/// A CUDA context of the tiny model on `dev` with both layers set, its
/// projection `proj`.
fn cuda_context<'a>(dev: &Dev, tiny: &'a Tiny, m: &[DevWeights], proj: Proj) -> Context<'a> {
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    (
        cfg.tuning.cuda.gemv_max_tokens,
        cfg.tuning.cuda.decode_max_tokens,
    ) = match proj {
        Proj::Default => (None, None),
        Proj::Gemv => (Some(engram::cuda::kernels::GEMV_MAX), Some(0)),
        Proj::Blas => (Some(0), Some(0)),
    };
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    let ctx = Context::new(&cfg).expect("create a CUDA context");
    for (l, w) in tiny.layers.iter().zip(m) {
        ctx.set_layer_device(&w.layer_in(l))
            .expect("set_layer_device");
    }
    ctx
}

/// Check `kv` (`[n, k_out]` bf16 of every token) of the live tokens against
/// `want` (the golden's or the CPU backend's), each value within `kv_bound`.
/// Returns (values that differ, values compared).
#[allow(clippy::too_many_arguments)]
fn check_kv(
    kv: &[u16],
    want: &[u16],
    rows: &[u16],
    wkv: &[f32],
    live: &[usize],
    k_in: usize,
    k_out: usize,
    at: &dyn Fn(usize) -> String,
) -> (usize, usize) {
    let (mut diff, mut vals) = (0, 0);
    for &t in live {
        let r: Vec<f64> = rows[t * k_in..(t + 1) * k_in]
            .iter()
            .map(|&b| bf16_to_f32(b) as f64)
            .collect();
        for o in 0..k_out {
            let got = bf16_to_f32(kv[t * k_out + o]) as f64;
            let w = bf16_to_f32(want[t * k_out + o]) as f64;
            vals += 1;
            if got != w {
                diff += 1;
                let s_abs: f64 = r
                    .iter()
                    .zip(&wkv[o * k_in..(o + 1) * k_in])
                    .map(|(a, &b)| (a * b as f64).abs())
                    .sum();
                let b = kv_bound(s_abs, w.abs().max(got.abs()), k_in);
                assert!(
                    (got - w).abs() <= b,
                    "{}: kv[{o}] {got} vs {w}, bound {b}",
                    at(t)
                );
            }
        }
    }
    (diff, vals)
}

#[test]
fn every_golden_regime_on_the_device() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let (hc, d, hd) = (tiny.hc, tiny.d, tiny.hd);
    let k_in = tiny.cols() * hd;
    let k_out = d * (hc + 1);
    let mut worst = 0f64;
    let (mut kv_diff, mut kv_vals) = (0usize, 0usize);
    // The decode kernel for every call it takes (the default), the GEMV
    // kernels for every call they take, then cuBLAS for every call.
    for proj in [Proj::Default, Proj::Gemv, Proj::Blas] {
        for regime in REGIMES {
            let cpu = tiny.context();
            let gpu = cuda_context(&dev, &tiny, &m, proj);
            for (ci, c) in calls(&tiny, regime).iter().enumerate() {
                let n = c.tokens.len();
                let per = cpu.ids_per_token();
                let mut ids = vec![0i64; n * per];
                cpu.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids).unwrap();
                let mut ids2 = vec![0i64; n * per];
                gpu.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids2).unwrap();
                assert_eq!(ids, ids2, "{regime} call {ci}: hash on the CUDA context");
                let d_ids = dev.upload(&ids);
                let hw_in = values(&c.highway, n * hc * d, 1.0, 0.0);
                let hb_in: Vec<u16> = hw_in.iter().map(|&v| f32_to_bf16(v)).collect();
                let live: Vec<usize> = (0..n).filter(|&t| !c.dead[t]).collect();
                for (li, lg) in c.layers.iter().enumerate() {
                    let layer = &tiny.layers[li];
                    let lid = layer.layer_id;
                    let at =
                        |t: usize| format!("{regime} call {ci} layer {lid} token {t} ({proj:?})");
                    let gold_kv = u16s(&lg["kv_bf16"]);
                    let gold_f32 = f32_bits(&lg["highway_out_f32"]);
                    let gold_bf16 = u16s(&lg["highway_out_bf16"]);
                    // Rows: bit-identical to the CPU backend (and so to the golden).
                    let (cpu_rows, _) = cpu.stages(lid, &ids, n).unwrap();
                    let (rows, kv) = gpu.stages_device(lid, RowIds::Host(&ids), n).unwrap();
                    let (rows_d, kv_d) = gpu
                        .stages_device(lid, RowIds::Device(d_ids.ptr), n)
                        .unwrap();
                    assert!(
                        rows == rows_d && kv == kv_d,
                        "{regime} call {ci}: device ids differ"
                    );
                    for (j, &t) in live.iter().enumerate() {
                        assert!(
                            rows[t * k_in..(t + 1) * k_in] == cpu_rows[j * k_in..(j + 1) * k_in],
                            "{}: rows differ from the CPU backend",
                            at(t)
                        );
                    }
                    for t in (0..n).filter(|&t| c.dead[t]) {
                        assert!(rows[t * k_in..(t + 1) * k_in].iter().all(|&b| b == 0));
                    }
                    // kv within the bound of the golden.
                    let wkv = layer.wkv.f32();
                    let (df, vs) = check_kv(&kv, &gold_kv, &rows, &wkv, &live, k_in, k_out, &at);
                    kv_diff += df;
                    kv_vals += vs;
                    let kv_f: Vec<f32> = kv.iter().map(|&b| bf16_to_f32(b)).collect();
                    // The highway, f32 and bf16, in place on the device.
                    let qk: Vec<f32> = layer
                        .q
                        .f32()
                        .iter()
                        .zip(layer.k.f32())
                        .map(|(a, b)| a * b)
                        .collect();
                    let h32d = dev.upload(&hw_in);
                    let hbd = dev.upload(&hb_in);
                    let null = std::ptr::null_mut();
                    gpu.apply_device(lid, RowIds::Host(&ids), n, h32d.ptr, 0, null)
                        .unwrap();
                    gpu.apply_device(lid, RowIds::Device(d_ids.ptr), n, hbd.ptr, 30, null)
                        .unwrap();
                    gpu.check_device(null).unwrap();
                    let h32: Vec<f32> = h32d.read(n * hc * d).unwrap();
                    let hb: Vec<u16> = hbd.read(n * hc * d).unwrap();
                    for t in 0..n {
                        let sl = t * hc * d..(t + 1) * hc * d;
                        if c.dead[t] {
                            assert!(
                                h32[sl.clone()]
                                    .iter()
                                    .zip(&hw_in[sl.clone()])
                                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{}: dead token changed (f32)",
                                at(t)
                            );
                            assert_eq!(hb[sl.clone()], hb_in[sl.clone()], "{}: dead (bf16)", at(t));
                            continue;
                        }
                        let kvt = &kv_f[t * k_out..(t + 1) * k_out];
                        let same_kv = kvt
                            .iter()
                            .zip(&gold_kv[t * k_out..(t + 1) * k_out])
                            .all(|(a, &b)| f32_to_bf16(*a) == b);
                        let hb_f: Vec<f32> = hb_in.iter().map(|&b| bf16_to_f32(b)).collect();
                        for (hw, is_bf16) in [(&hw_in, false), (&hb_f, true)] {
                            let got: Vec<f64> = if is_bf16 {
                                hb[sl.clone()]
                                    .iter()
                                    .map(|&b| bf16_to_f32(b) as f64)
                                    .collect()
                            } else {
                                h32[sl.clone()].iter().map(|&v| v as f64).collect()
                            };
                            let golden: Option<Vec<f64>> = same_kv.then(|| {
                                if is_bf16 {
                                    gold_bf16[sl.clone()]
                                        .iter()
                                        .map(|&b| bf16_to_f32(b) as f64)
                                        .collect()
                                } else {
                                    gold_f32[sl.clone()].iter().map(|&v| v as f64).collect()
                                }
                            });
                            let w = check_highway(
                                &hw[sl.clone()],
                                kvt,
                                &qk,
                                hc,
                                d,
                                tiny.eps,
                                &got,
                                golden.as_deref(),
                                is_bf16,
                                &at(t),
                            );
                            worst = worst.max(w);
                        }
                    }
                }
            }
        }
    }
    println!(
        "{}: rows bit-identical to the CPU backend; kv: {kv_diff} of {kv_vals} values differ from the golden \
         (each within its bound); f32 highway: largest error {worst:.3} of its bound",
        if dev.is_real() { "GPU" } else { "emulation" }
    );
}

/// The gate at numeric edges on the device (docs/numerics.md; the CPU side
/// is tests/gate_edges.rs): streams whose f32 sums overflow (+-1e20, +-3e38)
/// or underflow (1e-30), a zero stream and normal ones, f32 and bf16
/// highways, each value within `gate_reference`'s bound of the f64 reference
/// on the device's own kv (before the fix: 0.5 or NaN gates), and equal to
/// the CPU backend's within the same bound.
#[test]
fn the_gate_at_numeric_edges_on_the_device() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let (ids, n) = prefill(&tiny);
    let gpu = cuda_context(&dev, &tiny, &m, Proj::Default);
    let (hc, d) = (tiny.hc, tiny.d);
    let k_out = d * (hc + 1);
    let per = gpu.ids_per_token();
    let live: Vec<usize> = (0..n)
        .filter(|&t| ids[t * per] != engram::ROW_ID_DEAD)
        .collect();
    assert!(live.len() * hc >= 12, "every edge kind on a live token");
    let hw_in = edge_highway(n, hc, d);
    let hb_in: Vec<u16> = hw_in.iter().map(|&v| f32_to_bf16(v)).collect();
    let hb_f: Vec<f32> = hb_in.iter().map(|&b| bf16_to_f32(b)).collect();
    for layer in &tiny.layers {
        let lid = layer.layer_id;
        let (_, kv) = gpu.stages_device(lid, RowIds::Host(&ids), n).unwrap();
        let kv_f: Vec<f32> = kv.iter().map(|&b| bf16_to_f32(b)).collect();
        let qk: Vec<f32> = layer
            .q
            .f32()
            .iter()
            .zip(layer.k.f32())
            .map(|(a, b)| a * b)
            .collect();
        let h32d = dev.upload(&hw_in);
        let hbd = dev.upload(&hb_in);
        let null = std::ptr::null_mut();
        gpu.apply_device(lid, RowIds::Host(&ids), n, h32d.ptr, 0, null)
            .unwrap();
        gpu.apply_device(lid, RowIds::Host(&ids), n, hbd.ptr, 30, null)
            .unwrap();
        gpu.check_device(null).unwrap();
        let h32: Vec<f32> = h32d.read(n * hc * d).unwrap();
        let hb: Vec<u16> = hbd.read(n * hc * d).unwrap();
        for &t in &live {
            let sl = t * hc * d..(t + 1) * hc * d;
            let kvt = &kv_f[t * k_out..(t + 1) * k_out];
            let at = format!(
                "{} layer {lid} token {t} (streams: {})",
                if dev.is_real() { "GPU" } else { "emulation" },
                (0..hc)
                    .map(|s| EDGE_KINDS[(t * hc + s) % 6])
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            let got: Vec<f64> = h32[sl.clone()].iter().map(|&v| v as f64).collect();
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{at}: a non-finite value"
            );
            check_highway(
                &hw_in[sl.clone()],
                kvt,
                &qk,
                hc,
                d,
                tiny.eps,
                &got,
                None,
                false,
                &at,
            );
            let got: Vec<f64> = hb[sl.clone()]
                .iter()
                .map(|&b| bf16_to_f32(b) as f64)
                .collect();
            check_highway(
                &hb_f[sl.clone()],
                kvt,
                &qk,
                hc,
                d,
                tiny.eps,
                &got,
                None,
                true,
                &at,
            );
        }
    }
}

/// A prefill call and its row ids, for the tests below.
fn prefill(tiny: &Tiny) -> (Vec<i64>, usize) {
    let c = &calls(tiny, "prefill")[0];
    let ctx = tiny.context();
    let n = c.tokens.len();
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids).unwrap();
    (ids, n)
}

/// The bf16 GEMV kernel at each size it is compiled for (1..=8 tokens)
/// against the CPU backend's kv, within the golden bound, and the cuBLAS path
/// for the same tokens.
#[test]
fn the_gemv_kernel_at_every_size() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let (ids, n_all) = prefill(&tiny);
    let cpu = tiny.context();
    let gemv = cuda_context(&dev, &tiny, &m, Proj::Gemv);
    let blas = cuda_context(&dev, &tiny, &m, Proj::Blas);
    let per = cpu.ids_per_token();
    let (k_in, k_out) = (tiny.cols() * tiny.hd, tiny.d * (tiny.hc + 1));
    let layer = &tiny.layers[0];
    assert_eq!(
        dense_type(&layer.wkv),
        EngramType::Bf16 as u32,
        "layer 0 has a bf16 wkv"
    );
    let before = dev.emu.as_ref().map(|e| e.launches());
    for n in 1..=8.min(n_all) {
        let ids = &ids[..n * per];
        let live: Vec<usize> = (0..n)
            .filter(|&t| ids[t * per] != engram::ROW_ID_DEAD)
            .collect();
        let (cpu_rows, cpu_kv) = cpu.stages(layer.layer_id, ids, n).unwrap();
        for (ctx, name) in [(&gemv, "GEMV"), (&blas, "cuBLAS")] {
            let (rows, kv) = ctx
                .stages_device(layer.layer_id, RowIds::Host(ids), n)
                .unwrap();
            // The CPU's values are for live tokens only: spread them out.
            let mut want = vec![0u16; n * k_out];
            for (j, &t) in live.iter().enumerate() {
                want[t * k_out..(t + 1) * k_out]
                    .copy_from_slice(&cpu_kv[j * k_out..(j + 1) * k_out]);
                assert_eq!(
                    rows[t * k_in..(t + 1) * k_in],
                    cpu_rows[j * k_in..(j + 1) * k_in]
                );
            }
            let at = |t: usize| format!("{name}, {n} tokens, token {t}");
            check_kv(&kv, &want, &rows, &layer.wkv.f32(), &live, k_in, k_out, &at);
        }
    }
    if let (Some(b), Some(e)) = (before, dev.emu.as_ref()) {
        let after = e.launches();
        for n in 1..=8.min(n_all) {
            let name = format!("engram_gemv_bf16_{n}");
            let ran = after.get(name.as_str()).copied().unwrap_or(0)
                - b.get(name.as_str()).copied().unwrap_or(0);
            assert!(ran > 0, "{name} never ran");
        }
    }
}

#[test]
fn a_captured_graph_replays_the_same_bits() {
    let Some(dev) = device() else { return };
    if !dev.is_real() {
        common::device::skip(
            "graph capture needs a GPU (the emulation has none): scripts/gpu-check.sh runs it",
        );
        return;
    }
    let d = drv();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m, Proj::Default);
    let (ids, n_all) = prefill(&tiny);
    let per = ctx.ids_per_token();
    let (hc, dd) = (tiny.hc, tiny.d);
    // One token (GEMV) and the whole prefill (cuBLAS).
    for n in [1usize, n_all] {
        let ids = &ids[..n * per];
        let d_ids = dev.upload(ids);
        let hw_in = values("graph.highway", n * hc * dd, 1.0, 0.0);
        let stream = new_stream(&dev);
        let s = stream as *mut c_void;
        // Direct: both layers, in place.
        let direct = dev.upload(&hw_in);
        for l in &tiny.layers {
            ctx.apply_device(l.layer_id, RowIds::Device(d_ids.ptr), n, direct.ptr, 0, s)
                .unwrap();
        }
        sync(&dev, stream);
        let want: Vec<u32> = direct
            .read::<f32>(n * hc * dd)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        // Captured.
        let hw = dev.upload(&hw_in);
        let _g = dev.gpu.enter().unwrap();
        let mut graph = std::ptr::null_mut();
        // SAFETY: a live stream; thread-local capture mode.
        unsafe {
            dcheck(
                d.cuStreamBeginCapture_v2.unwrap()(
                    stream,
                    sys::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "begin capture",
            );
        }
        // Host row ids cannot be captured: refused before anything is queued.
        let e = ctx
            .apply_device(tiny.layers[0].layer_id, RowIds::Host(ids), n, hw.ptr, 0, s)
            .unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
        for l in &tiny.layers {
            ctx.apply_device(l.layer_id, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, s)
                .unwrap();
        }
        let mut exec = std::ptr::null_mut();
        // SAFETY: ends the capture begun above; instantiates and launches it.
        unsafe {
            dcheck(
                d.cuStreamEndCapture.unwrap()(stream, &mut graph),
                "end capture",
            );
            dcheck(
                d.cuGraphInstantiateWithFlags.unwrap()(&mut exec, graph, 0),
                "instantiate",
            );
            for replay in 0..3 {
                hw.write(&hw_in).unwrap();
                dcheck(d.cuGraphLaunch.unwrap()(exec, stream), "graph launch");
                sync(&dev, stream);
                let got: Vec<u32> = hw
                    .read::<f32>(n * hc * dd)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert!(
                    got == want,
                    "n = {n}: replay {replay} differs from the direct apply"
                );
            }
            dcheck(d.cuGraphExecDestroy.unwrap()(exec), "destroy exec");
            dcheck(d.cuGraphDestroy.unwrap()(graph), "destroy graph");
            dcheck((d.cuStreamDestroy_v2)(stream), "destroy stream");
        }
        ctx.check_device(std::ptr::null_mut()).unwrap();
        println!("n = {n}: 3 graph replays bit-identical to the direct apply");
    }
}

#[test]
fn two_contexts_on_two_streams_at_once_equal_one_after_the_other() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let (ids, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let inputs = [
        values("streams.a", n * hc * d, 1.0, 0.0),
        values("streams.b", n * hc * d, 1.0, 0.0),
    ];
    // One after the other, on one context and the legacy stream.
    let one = cuda_context(&dev, &tiny, &m, Proj::Default);
    let mut want = Vec::new();
    for hw_in in &inputs {
        let hw = dev.upload(hw_in);
        for _ in 0..3 {
            for l in &tiny.layers {
                one.apply_device(
                    l.layer_id,
                    RowIds::Host(&ids),
                    n,
                    hw.ptr,
                    0,
                    std::ptr::null_mut(),
                )
                .unwrap();
            }
        }
        want.push(hw.read::<f32>(n * hc * d).unwrap());
    }
    // At once: two contexts, two streams (the emulation: the legacy
    // stream), two host threads.
    let ctxs = [
        cuda_context(&dev, &tiny, &m, Proj::Default),
        cuda_context(&dev, &tiny, &m, Proj::Default),
    ];
    let bufs: Vec<DevBuf> = inputs.iter().map(|h| dev.upload(h)).collect();
    let streams = if dev.is_real() {
        [new_stream(&dev) as usize, new_stream(&dev) as usize]
    } else {
        [0, 0]
    };
    std::thread::scope(|sc| {
        for i in 0..2 {
            let (ctx, buf, stream, ids, tiny) = (&ctxs[i], &bufs[i], streams[i], &ids, &tiny);
            sc.spawn(move || {
                for _ in 0..3 {
                    for l in &tiny.layers {
                        ctx.apply_device(
                            l.layer_id,
                            RowIds::Host(ids),
                            n,
                            buf.ptr,
                            0,
                            stream as *mut c_void,
                        )
                        .unwrap();
                    }
                }
            });
        }
    });
    for (i, s) in streams.iter().enumerate() {
        sync(&dev, *s as sys::CUstream);
        ctxs[i].check_device(*s as *mut c_void).unwrap();
        let got = bufs[i].read::<f32>(n * hc * d).unwrap();
        assert!(
            got.iter()
                .zip(&want[i])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "context {i}: the concurrent result differs"
        );
    }
    println!("two contexts on two streams: bit-identical to one after the other");
}

#[test]
fn errors_found_on_the_device_leave_the_token_and_are_reported_once() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m, Proj::Default);
    let (ids, n) = prefill(&tiny);
    let per = ctx.ids_per_token();
    let (hc, d, cols) = (tiny.hc, tiny.d, tiny.cols());
    let lid = tiny.layers[0].layer_id;
    let hw_in = values("errors.highway", n * hc * d, 1.0, 0.0);
    let null = std::ptr::null_mut();
    let clean = {
        let hw = dev.upload(&hw_in);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw.ptr, 0, null)
            .unwrap();
        hw.read::<f32>(n * hc * d).unwrap()
    };
    let live: Vec<usize> = (0..n).filter(|&t| ids[t * per] != -1).collect();
    assert!(live.len() >= 3, "three live tokens");
    let unchanged = |got: &[f32], bad: &[usize], case: &str| {
        for t in 0..n {
            let sl = t * hc * d..(t + 1) * hc * d;
            if bad.contains(&t) {
                assert!(
                    got[sl.clone()] == hw_in[sl.clone()],
                    "{case}: bad token {t} changed"
                );
            } else {
                assert!(
                    got[sl.clone()] == clean[sl.clone()],
                    "{case}: token {t} differs"
                );
            }
        }
    };
    for (case, want) in [
        ("out of range", EngramStatus::ErrInvalidRowId),
        ("partly dead", EngramStatus::ErrInvalidRowId),
    ] {
        // Two bad tokens: the later one in a column before the earlier
        // one's. The first by token is reported, as the CPU reports it,
        // whatever order the blocks ran in.
        let (t1, t2) = (live[1], live[2]);
        let mut bad = ids.clone();
        let v = if case == "out of range" { 1 << 40 } else { -1 };
        bad[t1 * per + 1] = v;
        bad[t2 * per] = v;
        // The host checks host ids before anything is queued.
        let hw = dev.upload(&hw_in);
        let e_host = ctx
            .apply_device(lid, RowIds::Host(&bad), n, hw.ptr, 0, null)
            .unwrap_err();
        assert_eq!(e_host.status, want, "{case}, host ids: {}", e_host.message);
        // Device ids are checked on the device, with the same message.
        let d_bad = dev.upload(&bad);
        ctx.apply_device(lid, RowIds::Device(d_bad.ptr), n, hw.ptr, 0, null)
            .expect("queued");
        let e = ctx.check_device(null).unwrap_err();
        assert_eq!(e.status, want, "{case}: {}", e.message);
        assert!(
            e.message.starts_with(&e_host.message),
            "{case}: device '{}', host '{}'",
            e.message,
            e_host.message
        );
        ctx.check_device(null).expect("reported once");
        unchanged(&hw.read::<f32>(n * hc * d).unwrap(), &[t1, t2], case);
        // The read-back reports it too (the latch, without a gate).
        let e = ctx
            .stages_device(lid, RowIds::Device(d_bad.ptr), n)
            .unwrap_err();
        assert!(e.message.starts_with(&e_host.message), "{}", e.message);
    }
    // A NaN code in an fp8 row (layer 0's table is fp8): found on the device,
    // reported by the next call (which then does nothing).
    let li = tiny
        .layers
        .iter()
        .position(|l| l.format == EngramType::Fp8E4m3E8m0)
        .expect("an fp8 layer");
    let l = &tiny.layers[li];
    let t = live[0];
    let row = ids[t * per + li * cols] as usize;
    let mut table = l.table.clone();
    let rb = tiny.hd + tiny.hd / 32;
    table[row * rb + 3] = 0x7F;
    m[li].table.write(&table).unwrap();
    let hw = dev.upload(&hw_in);
    ctx.apply_device(l.layer_id, RowIds::Host(&ids), n, hw.ptr, 0, null)
        .expect("queued");
    sync(&dev, std::ptr::null_mut());
    let e = ctx
        .apply_device(l.layer_id, RowIds::Host(&ids), n, hw.ptr, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
    assert!(e.message.contains("NaN"), "{}", e.message);
    assert!(e.message.contains(&format!("token {t}")), "{}", e.message);
    ctx.check_device(null).expect("reported once");
    // Every token that reads that row is left alone (a repeated n-gram reads it again).
    let readers: Vec<usize> = (0..n)
        .filter(|&u| ids[u * per + li * cols..u * per + (li + 1) * cols].contains(&(row as i64)))
        .collect();
    unchanged(&hw.read::<f32>(n * hc * d).unwrap(), &readers, "NaN code");
    // A NaN scale, then a scale that overflows (non-finite values).
    for (what, at, code, status_word) in [
        ("NaN scale", row * rb + tiny.hd + 1, 255u8, "e8m0 scale 1"),
        ("non-finite", row * rb + tiny.hd, 254u8, "not finite"),
    ] {
        let mut table = l.table.clone();
        table[at] = code;
        if what == "non-finite" {
            table[row * rb] = 0x7E; // 448 * 2^127 overflows
        }
        m[li].table.write(&table).unwrap();
        let e = ctx
            .stages_device(l.layer_id, RowIds::Host(&ids), n)
            .unwrap_err();
        assert_eq!(
            e.status,
            EngramStatus::ErrInvalidData,
            "{what}: {}",
            e.message
        );
        assert!(e.message.contains(status_word), "{what}: {}", e.message);
    }
    m[li].table.write(&l.table).unwrap();
}

#[test]
fn device_arguments_are_checked() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m, Proj::Default);
    let (ids, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let lid = tiny.layers[0].layer_id;
    let null = std::ptr::null_mut();
    // A host pointer as the highway.
    let mut host = vec![0f32; n * hc * d];
    let e = ctx
        .apply_device(
            lid,
            RowIds::Host(&ids),
            n,
            host.as_mut_ptr() as u64,
            0,
            null,
        )
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    // A device highway one token too short.
    let short = dev.upload(&vec![0f32; (n - 1) * hc * d]);
    let e = ctx
        .apply_device(lid, RowIds::Host(&ids), n, short.ptr, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    // Too many tokens.
    let e = ctx
        .apply_device(lid, RowIds::Host(&ids), 1000, short.ptr, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message);
    // A table shorter than it claims.
    let l = &tiny.layers[0];
    let good = m[0].layer_in(l);
    let e = ctx
        .set_layer_device(&DeviceLayerIn {
            table_rows: l.rows * 2,
            ..good
        })
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    // A wkv shorter than a quantised type's size says so.
    let e = ctx
        .set_layer_device(&DeviceLayerIn {
            wkv: good.table,
            wkv_type: EngramType::Q8_0 as u32,
            ..good
        })
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    // The read-back takes host ids on a CUDA context too (as on the CPU), and
    // gives what device ids give.
    let by_host = ctx.stages_device(lid, RowIds::Host(&ids), n).unwrap();
    let d_ids = dev.upload(&ids);
    let by_device = ctx
        .stages_device(lid, RowIds::Device(d_ids.ptr), n)
        .unwrap();
    assert_eq!(by_host, by_device);
    // Device row ids one token short.
    let e = ctx
        .apply_device(lid, RowIds::Device(d_ids.ptr), n + 1, short.ptr, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    if dev.is_real() {
        // A bad ordinal.
        let mut cfg = tiny.config(Tiny::limits());
        cfg.backend = EngramBackend::Cuda as u32;
        cfg.device = 999;
        let e = match Context::new(&cfg) {
            Ok(_) => panic!("device 999 exists?"),
            Err(e) => e,
        };
        assert_eq!(e.status, EngramStatus::ErrDevice, "{}", e.message);
    }
    // Still usable after all that.
    let hw = dev.upload(&values("args.highway", n * hc * d, 1.0, 0.0));
    ctx.apply_device(lid, RowIds::Host(&ids), n, hw.ptr, 0, null)
        .unwrap();
    ctx.check_device(null).unwrap();
}

/// Memory mapped in pieces (PyTorch's expandable segments): a highway and a
/// wkv spanning several allocations that follow each other are accepted; a
/// range that runs past the last piece, or into a gap, is refused.
#[test]
fn allocations_mapped_in_pieces_are_walked() {
    let Some(dev) = emulated() else { return };
    let emu = dev.emu.clone().unwrap();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m, Proj::Default);
    let (ids, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let bytes = n * hc * d * 4;
    let lid = tiny.layers[0].layer_id;
    let null = std::ptr::null_mut();
    let hw_in = values("pieces.highway", n * hc * d, 1.0, 0.0);
    // The same apply in one allocation and in three pieces.
    let whole = dev.upload(&hw_in);
    ctx.apply_device(lid, RowIds::Host(&ids), n, whole.ptr, 0, null)
        .unwrap();
    let third = (bytes / 3) & !255;
    let p = emu
        .alloc_pieces(&[third, third, bytes - 2 * third])
        .unwrap();
    // SAFETY: `p` holds `bytes` of emulated device (host) memory.
    unsafe {
        std::ptr::copy_nonoverlapping(hw_in.as_ptr() as *const u8, p as *mut u8, bytes);
    }
    ctx.apply_device(lid, RowIds::Host(&ids), n, p, 0, null)
        .expect("a highway in three pieces");
    // SAFETY: as above.
    let got = unsafe { std::slice::from_raw_parts(p as *const f32, n * hc * d) };
    assert_eq!(got, &whole.read::<f32>(n * hc * d).unwrap()[..]);
    // One token more than the pieces hold.
    let e = ctx
        .apply_device(lid, RowIds::Host(&ids), n, p + 4, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("do not fit"), "{}", e.message);
    // A hole: the middle piece unmapped.
    emu.unmap_piece(p + third as u64);
    let e = ctx
        .apply_device(lid, RowIds::Host(&ids), n, p, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    // SAFETY: from alloc_pieces, freed once.
    unsafe { dev.gpu.free(p) };
    println!("a highway in three pieces: accepted, same bits; one past the end: refused");
}

/// A table of the real model's row count (384 million fp8 rows, 101 GB):
/// reserved, never touched but for a few rows near its end, gathered by
/// device row ids whose byte offsets pass 2^32 and 2^36, bit-identical to
/// the CPU backend reading the same rows.
#[test]
fn sixty_four_bit_offsets_into_a_table_of_the_real_row_count() {
    let Some(dev) = device() else { return };
    const ROWS: u64 = 384_000_000;
    let hd = 256usize;
    let rb = hd + hd / 32;
    let bytes = ROWS as usize * rb;
    let table = match engram::cuda::gpu::DevBuf::new(&dev.gpu, bytes, "a table of 384M rows") {
        Ok(b) => b,
        Err(e) => {
            println!("SKIP: cannot reserve {bytes} bytes: {}", e.message);
            return;
        }
    };
    let (ngram, heads) = (2usize, 1usize);
    let primes = engram::hash::derive_primes_uniform(1, ngram, heads, 100).unwrap();
    let offsets = engram::hash::derive_offsets(&primes, 1);
    let token_map: Vec<i32> = (0..16).collect();
    let mult = [1u64, 3];
    let cfg = |backend: EngramBackend| engram::ContextConfig {
        geometry: engram::Geometry {
            d: 32,
            hc: 1,
            hd,
            eps: 1e-6,
        },
        tables: engram::HashTablesIn {
            layer_ids: &[1],
            max_ngram: ngram,
            n_heads: heads,
            token_map: &token_map,
            pad_id: 0,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: engram::Limits {
            max_tokens: 8,
            max_seqs: 1,
            max_positions: 8,
        },
        n_threads: 1,
        backend: backend as u32,
        device: 0,
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                device: Some(dev.gpu.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
    };
    // Rows whose byte offsets pass 2^32, 2^36 and the end of the table.
    let picks: Vec<i64> = vec![
        ((1u64 << 32) / rb as u64 + 1) as i64,
        ((1u64 << 36) / rb as u64 + 7) as i64,
        ROWS as i64 - 1,
        ROWS as i64 - 2,
        3,
    ];
    let mut host_rows = Vec::new();
    for (i, &r) in picks.iter().enumerate() {
        let row: Vec<u8> = (0..rb)
            .map(|j| {
                if j < hd {
                    let c = (bits("sparse.table", (i * rb + j) as u64) & 0xFF) as u8;
                    if c & 0x7F == 0x7F {
                        c ^ 1
                    } else {
                        c
                    }
                } else {
                    120 + (j % 8) as u8
                }
            })
            .collect();
        // SAFETY: row `r` lies inside the table's `bytes`.
        unsafe {
            dev.gpu
                .upload(table.ptr + r as u64 * rb as u64, row.as_ptr(), rb)
                .unwrap();
        }
        host_rows.push(row);
    }
    let wkv = vec![f32_to_bf16(0.01); 2 * 32 * hd];
    let d_wkv = dev.upload(&wkv);
    let qk = vec![1f32; 32];
    let d_qk = dev.upload(&qk);
    let ctx = Context::new(&cfg(EngramBackend::Cuda)).expect("a CUDA context");
    ctx.set_layer_device(&DeviceLayerIn {
        layer_id: 1,
        table: table.ptr,
        table_rows: ROWS,
        table_type: EngramType::Fp8E4m3E8m0 as u32,
        wkv: d_wkv.ptr,
        wkv_type: EngramType::Bf16 as u32,
        q: d_qk.ptr,
        k: d_qk.ptr,
        qk_type: EngramType::F32 as u32,
    })
    .unwrap();
    let n = picks.len();
    let d_ids = dev.upload(&picks);
    let (rows, _) = ctx.stages_device(1, RowIds::Device(d_ids.ptr), n).unwrap();
    // The CPU reference: the same rows, dequantised on the host.
    for (i, r) in host_rows.iter().enumerate() {
        let mut want = vec![0u16; hd];
        engram::formats::dequant_row_bf16(EngramType::Fp8E4m3E8m0, r, &mut want).unwrap();
        assert_eq!(rows[i * hd..(i + 1) * hd], want[..], "row {}", picks[i]);
    }
    // Out of range by one.
    let bad = dev.upload(&[ROWS as i64, 0, 0, 0, 0]);
    let e = ctx
        .stages_device(1, RowIds::Device(bad.ptr), n)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidRowId, "{}", e.message);
    assert!(
        e.message.contains(&format!("row id {ROWS}")),
        "{}",
        e.message
    );
    println!("rows at byte offsets past 2^32 and 2^36 of a 101 GB table: bit-identical");
}

#[test]
fn without_a_driver_create_says_so() {
    if engram::cuda::probe().is_ok() {
        println!("a CUDA driver is present: the no-driver path is not exercised here");
        return;
    }
    let tiny = Tiny::load();
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    let e = match Context::new(&cfg) {
        Ok(_) => panic!("created a CUDA context without a driver"),
        Err(e) => e,
    };
    assert_eq!(e.status, EngramStatus::ErrDevice);
    assert!(
        e.message.contains("CUDA driver") || e.message.contains("libcuda"),
        "{}",
        e.message
    );
    println!("no driver: {}", e.message);
}

/// The whole decode step on the device (issue 18, docs/device-hash.md): the
/// device hash over the device history plus the apply of both layers,
/// captured in one CUDA graph and replayed for 64 decode steps, each step's
/// token and position written into the graph's device buffers before its
/// replay (as an engine's sampler would), against the host path (the host
/// hash, a copy of its ids, the same applies) step by step: the same row ids
/// and the same highway bits.
#[test]
fn a_captured_device_hash_and_apply_replays_64_decode_steps() {
    let Some(dev) = device() else { return };
    if !dev.is_real() {
        common::device::skip(
            "graph capture needs a GPU (the emulation has none): scripts/gpu-check.sh runs it",
        );
        return;
    }
    let d = drv();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let graph_ctx = cuda_context(&dev, &tiny, &m, Proj::Default)
        .with_device_history(8)
        .expect("a device history");
    let host_ctx = cuda_context(&dev, &tiny, &m, Proj::Default);
    let cpu = tiny.context();
    let per = graph_ctx.ids_per_token();
    let (hc, dd) = (tiny.hc, tiny.d);
    let c = &calls(&tiny, "prefill")[0];
    let n0 = c.tokens.len();
    let stream = new_stream(&dev);
    let s = stream as *mut c_void;
    // The prefill, hashed on the device (not captured) and on the host.
    let (t0, q0, p0) = (
        dev.upload(&c.tokens),
        dev.upload(&c.seq_ids),
        dev.upload(&c.pos),
    );
    let ids0 = dev.alloc(n0 * per * 8);
    graph_ctx
        .hash_device(&engram::call::DeviceHashIn {
            tokens: t0.ptr,
            seq_ids: q0.ptr,
            pos: p0.ptr,
            n: n0,
            row_ids: ids0.ptr,
            stream: s,
        })
        .unwrap();
    let mut want_ids = vec![0i64; n0 * per];
    cpu.hash(&c.tokens, &c.seq_ids, &c.pos, &mut want_ids)
        .unwrap();
    sync(&dev, stream);
    assert_eq!(
        ids0.read::<i64>(n0 * per).unwrap(),
        want_ids,
        "the prefill's ids"
    );
    // The step's buffers and the captured graph.
    let (tok, seq, pos) = (
        dev.upload(&[0i32]),
        dev.upload(&[0i32]),
        dev.upload(&[0i32]),
    );
    let ids = dev.alloc(per * 8);
    let hw_in = values("graph.decode.highway", hc * dd, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    let _g = dev.gpu.enter().unwrap();
    let mut graph = std::ptr::null_mut();
    let mut exec = std::ptr::null_mut();
    // SAFETY: a live stream; thread-local capture mode; the capture ends below.
    unsafe {
        dcheck(
            d.cuStreamBeginCapture_v2.unwrap()(stream, sys::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "begin capture",
        );
    }
    graph_ctx
        .hash_device(&engram::call::DeviceHashIn {
            tokens: tok.ptr,
            seq_ids: seq.ptr,
            pos: pos.ptr,
            n: 1,
            row_ids: ids.ptr,
            stream: s,
        })
        .unwrap();
    for l in &tiny.layers {
        graph_ctx
            .apply_device(l.layer_id, RowIds::Device(ids.ptr), 1, hw.ptr, 0, s)
            .unwrap();
    }
    // SAFETY: ends the capture begun above and instantiates it.
    unsafe {
        dcheck(
            d.cuStreamEndCapture.unwrap()(stream, &mut graph),
            "end capture",
        );
        dcheck(
            d.cuGraphInstantiateWithFlags.unwrap()(&mut exec, graph, 0),
            "instantiate",
        );
    }
    let host_hw = dev.alloc(hc * dd * 4);
    let mut z = 0x5eedu64;
    for step in 0..64 {
        z = mix64(z);
        let t = if z.is_multiple_of(13) {
            engram::TOKEN_DEAD
        } else {
            (z % tiny.token_map.len() as u64) as i32
        };
        let p = (n0 + step) as i32;
        tok.write(&[t]).unwrap();
        pos.write(&[p]).unwrap();
        hw.write(&hw_in).unwrap();
        // SAFETY: the instantiated graph on its stream.
        unsafe { dcheck(d.cuGraphLaunch.unwrap()(exec, stream), "graph launch") };
        sync(&dev, stream);
        let mut want = vec![0i64; per];
        cpu.hash(&[t], &[0], &[p], &mut want).unwrap();
        assert_eq!(ids.read::<i64>(per).unwrap(), want, "step {step}: row ids");
        host_hw.write(&hw_in).unwrap();
        for l in &tiny.layers {
            host_ctx
                .apply_device(l.layer_id, RowIds::Host(&want), 1, host_hw.ptr, 0, s)
                .unwrap();
        }
        sync(&dev, stream);
        let bits = |b: &DevBuf| -> Vec<u32> {
            b.read::<f32>(hc * dd)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        assert!(
            bits(&hw) == bits(&host_hw),
            "step {step}: the highway differs from the host path"
        );
    }
    // SAFETY: the graph and stream made above, idle after the last sync.
    unsafe {
        dcheck(d.cuGraphExecDestroy.unwrap()(exec), "destroy exec");
        dcheck(d.cuGraphDestroy.unwrap()(graph), "destroy graph");
        dcheck((d.cuStreamDestroy_v2)(stream), "destroy stream");
    }
    graph_ctx.check_device(std::ptr::null_mut()).unwrap();
    println!("64 replays of the captured hash + 2 applies equal the host path");
}
