//! The CUDA backend on a GPU: every golden regime (rows bit-identical to the
//! CPU backend, kv and highway within the bounds of `tests/golden.rs`), device
//! row ids, a CUDA graph replay, two contexts on two streams at once, errors
//! found on the device, and the argument checks that need a driver.
//!
//! Without a CUDA driver (or device) every test prints why and passes;
//! `ENGRAM_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`) makes that a failure.
//! Run with `--test-threads=1` where other work shares the GPU: one test
//! captures a CUDA graph (in thread-local capture mode).

mod common;

use common::bounds::*;
use common::*;
use cudarc::driver::sys;
use engram::cuda::driver::{DevBuf, Device, Scope};
use engram::formats::{bf16_to_f32, f32_to_bf16};
use engram::RowIds;
use engram::{Context, EngramBackend, EngramStatus, EngramType};
use std::ffi::c_void;

// ---- the GPU harness ----

/// The device, or `None` (having said why) when there is none.
fn gpu() -> Option<Device> {
    match engram::cuda::probe() {
        Ok(desc) => {
            println!("{desc}");
            Some(Device::open(0).expect("open device 0"))
        }
        Err(why) => {
            if std::env::var("ENGRAM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("ENGRAM_REQUIRE_GPU=1 but: {why}");
            }
            // Straight to stderr (not captured by the test harness), once per run.
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "SKIP: the CUDA GPU tests: {why}");
            });
            None
        }
    }
}

fn dcheck(r: sys::CUresult, what: &str) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

fn upload<T: Copy>(dev: &Device, data: &[T]) -> DevBuf {
    let bytes = std::mem::size_of_val(data);
    let b = DevBuf::new(dev.ctx, bytes, "test data").expect("cuMemAlloc");
    if bytes > 0 {
        // SAFETY: `b` holds `bytes`; the context is current (the caller's scope).
        unsafe {
            dcheck(
                sys::cuMemcpyHtoD_v2(b.ptr, data.as_ptr() as *const c_void, bytes),
                "upload",
            )
        };
    }
    b
}

fn download<T: Copy + Default>(b: &DevBuf, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    // SAFETY: `b` holds at least n T (the caller's sizes).
    unsafe {
        dcheck(sys::cuCtxSynchronize(), "sync");
        dcheck(
            sys::cuMemcpyDtoH_v2(
                v.as_mut_ptr() as *mut c_void,
                b.ptr,
                n * std::mem::size_of::<T>(),
            ),
            "download",
        );
    }
    v
}

fn overwrite<T: Copy>(b: &DevBuf, data: &[T]) {
    // SAFETY: as `upload`.
    unsafe {
        dcheck(sys::cuCtxSynchronize(), "sync");
        dcheck(
            sys::cuMemcpyHtoD_v2(
                b.ptr,
                data.as_ptr() as *const c_void,
                std::mem::size_of_val(data),
            ),
            "overwrite",
        );
    }
}

fn new_stream() -> sys::CUstream {
    let mut s = std::ptr::null_mut();
    // SAFETY: the context is current.
    unsafe {
        dcheck(
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
            "cuStreamCreate",
        )
    };
    s
}

fn sync(s: sys::CUstream) {
    // SAFETY: a live stream.
    unsafe { dcheck(sys::cuStreamSynchronize(s), "cuStreamSynchronize") };
}

/// The tiny model's weights on the device.
struct DevModel {
    layers: Vec<(DevBuf, DevBuf, DevBuf, DevBuf)>,
}

fn dense_bytes(d: &Dense) -> Vec<u8> {
    match d {
        Dense::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dense::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn dense_type(d: &Dense) -> u32 {
    match d {
        Dense::F32(_) => EngramType::F32 as u32,
        Dense::Bf16(_) => EngramType::Bf16 as u32,
    }
}

fn dev_model(dev: &Device, tiny: &Tiny) -> DevModel {
    DevModel {
        layers: tiny
            .layers
            .iter()
            .map(|l| {
                (
                    upload(dev, &l.table),
                    upload(dev, &dense_bytes(&l.wkv)),
                    upload(dev, &dense_bytes(&l.q)),
                    upload(dev, &dense_bytes(&l.k)),
                )
            })
            .collect(),
    }
}

/// A CUDA context of the tiny model with both layers set.
fn cuda_context<'a>(tiny: &'a Tiny, m: &DevModel) -> Context<'a> {
    cuda_context_with(tiny, m, None)
}

/// The same, with the GEMV kernel used up to `gemv_max` tokens (`None`: the default).
fn cuda_context_with<'a>(tiny: &'a Tiny, m: &DevModel, gemv_max: Option<usize>) -> Context<'a> {
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    cfg.tuning.gemv_max_tokens = gemv_max;
    let ctx = Context::new(&cfg).expect("create a CUDA context");
    for (l, (t, w, q, k)) in tiny.layers.iter().zip(&m.layers) {
        ctx.set_layer_device(&DeviceLayerIn {
            layer_id: l.layer_id,
            table: t.ptr,
            table_rows: l.rows,
            table_type: l.format as u32,
            wkv: w.ptr,
            wkv_type: dense_type(&l.wkv),
            q: q.ptr,
            k: k.ptr,
            qk_type: dense_type(&l.q),
        })
        .expect("set_layer_device");
    }
    ctx
}

struct Call {
    tokens: Vec<i32>,
    seq_ids: Vec<i32>,
    pos: Vec<i32>,
    dead: Vec<bool>,
    highway: String,
    layers: Vec<serde_json::Value>,
}

fn calls(tiny: &Tiny, regime: &str) -> Vec<Call> {
    tiny.golden["regimes"][regime]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Call {
            tokens: i32s(&c["tokens"]),
            seq_ids: i32s(&c["seq_ids"]),
            pos: i32s(&c["pos"]),
            dead: c["dead"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_bool().unwrap())
                .collect(),
            highway: c["highway_name"].as_str().unwrap().to_string(),
            layers: c["layers"].as_array().unwrap().clone(),
        })
        .collect()
}

const REGIMES: [&str; 6] = [
    "prefill",
    "decode",
    "chunked",
    "interleaved",
    "rollback",
    "dead",
];

#[test]
fn every_golden_regime_on_the_gpu() {
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let (hc, d, hd) = (tiny.hc, tiny.d, tiny.hd);
    let k_in = tiny.cols() * hd;
    let k_out = d * (hc + 1);
    let mut worst = 0f64;
    let mut kv_diff = 0usize;
    let mut kv_vals = 0usize;
    // GEMV for small calls (the default), then cuBLAS for every call.
    for gemv_max in [engram::cuda::DEFAULT_GEMV_MAX_TOKENS, 0] {
        for regime in REGIMES {
            let cpu = tiny.context();
            let gpu = cuda_context_with(&tiny, &m, Some(gemv_max));
            for (ci, c) in calls(&tiny, regime).iter().enumerate() {
                let n = c.tokens.len();
                let per = cpu.ids_per_token();
                let mut ids = vec![0i64; n * per];
                cpu.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids).unwrap();
                let mut ids2 = vec![0i64; n * per];
                gpu.hash(&c.tokens, &c.seq_ids, &c.pos, &mut ids2).unwrap();
                assert_eq!(ids, ids2, "{regime} call {ci}: hash on the CUDA context");
                let d_ids = upload(&dev, &ids);
                let hw_in = values(&c.highway, n * hc * d, 1.0, 0.0);
                let hb_in: Vec<u16> = hw_in.iter().map(|&v| f32_to_bf16(v)).collect();
                let live: Vec<usize> = (0..n).filter(|&t| !c.dead[t]).collect();
                for (li, lg) in c.layers.iter().enumerate() {
                    let layer = &tiny.layers[li];
                    let lid = layer.layer_id;
                    let at = |t: usize| {
                        format!("{regime} call {ci} layer {lid} token {t} (gemv_max {gemv_max})")
                    };
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
                    let kv_f: Vec<f32> = kv.iter().map(|&b| bf16_to_f32(b)).collect();
                    for &t in &live {
                        let r: Vec<f64> = rows[t * k_in..(t + 1) * k_in]
                            .iter()
                            .map(|&b| bf16_to_f32(b) as f64)
                            .collect();
                        for o in 0..k_out {
                            let got = kv_f[t * k_out + o] as f64;
                            let want = bf16_to_f32(gold_kv[t * k_out + o]) as f64;
                            kv_vals += 1;
                            if got != want {
                                kv_diff += 1;
                                let w = &wkv[o * k_in..(o + 1) * k_in];
                                let s_abs: f64 =
                                    r.iter().zip(w).map(|(a, &b)| (a * b as f64).abs()).sum();
                                let b = kv_bound(s_abs, want.abs().max(got.abs()), k_in);
                                assert!(
                                    (got - want).abs() <= b,
                                    "{}: kv[{o}] {got} vs golden {want}, bound {b}",
                                    at(t)
                                );
                            }
                        }
                    }
                    // The highway, f32 and bf16, in place on the device.
                    let qk: Vec<f32> = layer
                        .q
                        .f32()
                        .iter()
                        .zip(layer.k.f32())
                        .map(|(a, b)| a * b)
                        .collect();
                    let h32d = upload(&dev, &hw_in);
                    let hbd = upload(&dev, &hb_in);
                    let null = std::ptr::null_mut();
                    gpu.apply_device(lid, RowIds::Host(&ids), n, h32d.ptr, 0, null)
                        .unwrap();
                    gpu.apply_device(lid, RowIds::Device(d_ids.ptr), n, hbd.ptr, 30, null)
                        .unwrap();
                    gpu.check_device(null).unwrap();
                    let h32: Vec<f32> = download(&h32d, n * hc * d);
                    let hb: Vec<u16> = download(&hbd, n * hc * d);
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
                            let sl_t = t * hc * d..(t + 1) * hc * d;
                            let got: Vec<f64> = if is_bf16 {
                                hb[sl_t.clone()]
                                    .iter()
                                    .map(|&b| bf16_to_f32(b) as f64)
                                    .collect()
                            } else {
                                h32[sl_t.clone()].iter().map(|&v| v as f64).collect()
                            };
                            let golden: Option<Vec<f64>> = same_kv.then(|| {
                                if is_bf16 {
                                    gold_bf16[sl_t.clone()]
                                        .iter()
                                        .map(|&b| bf16_to_f32(b) as f64)
                                        .collect()
                                } else {
                                    gold_f32[sl_t.clone()].iter().map(|&v| v as f64).collect()
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
        "GPU: rows bit-identical to the CPU backend; kv: {kv_diff} of {kv_vals} values differ from the golden \
         (each within its bound); f32 highway: largest error {worst:.3} of its bound"
    );
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

#[test]
fn a_captured_graph_replays_the_same_bits() {
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&tiny, &m);
    let (ids, n_all) = prefill(&tiny);
    let per = ctx.ids_per_token();
    let (hc, d) = (tiny.hc, tiny.d);
    // One token (GEMV) and the whole prefill (cuBLAS).
    for n in [1usize, n_all] {
        let ids = &ids[..n * per];
        let d_ids = upload(&dev, ids);
        let hw_in = values("graph.highway", n * hc * d, 1.0, 0.0);
        let stream = new_stream();
        let s = stream as *mut c_void;
        // Direct: both layers, in place.
        let direct = upload(&dev, &hw_in);
        for l in &tiny.layers {
            ctx.apply_device(l.layer_id, RowIds::Device(d_ids.ptr), n, direct.ptr, 0, s)
                .unwrap();
        }
        sync(stream);
        let want: Vec<u32> = download::<f32>(&direct, n * hc * d)
            .iter()
            .map(|x| x.to_bits())
            .collect();
        // Captured.
        let hw = upload(&dev, &hw_in);
        let mut graph = std::ptr::null_mut();
        // SAFETY: a live stream; thread-local capture mode.
        unsafe {
            dcheck(
                sys::cuStreamBeginCapture_v2(
                    stream,
                    sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
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
            dcheck(sys::cuStreamEndCapture(stream, &mut graph), "end capture");
            dcheck(
                sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
                "instantiate",
            );
            for replay in 0..3 {
                overwrite(&hw, &hw_in);
                dcheck(sys::cuGraphLaunch(exec, stream), "graph launch");
                sync(stream);
                let got: Vec<u32> = download::<f32>(&hw, n * hc * d)
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert!(
                    got == want,
                    "n = {n}: replay {replay} differs from the direct apply"
                );
            }
            // Re-staged ids: change the device ids, replay, compare with direct.
            dcheck(sys::cuGraphExecDestroy(exec), "destroy exec");
            dcheck(sys::cuGraphDestroy(graph), "destroy graph");
            dcheck(sys::cuStreamDestroy_v2(stream), "destroy stream");
        }
        ctx.check_device(std::ptr::null_mut()).unwrap();
        println!("n = {n}: 3 graph replays bit-identical to the direct apply");
    }
}

#[test]
fn two_contexts_on_two_streams_at_once_equal_one_after_the_other() {
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let (ids, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let inputs = [
        values("streams.a", n * hc * d, 1.0, 0.0),
        values("streams.b", n * hc * d, 1.0, 0.0),
    ];
    // One after the other, on one context and the legacy stream.
    let one = cuda_context(&tiny, &m);
    let mut want = Vec::new();
    for hw_in in &inputs {
        let hw = upload(&dev, hw_in);
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
        want.push(download::<f32>(&hw, n * hc * d));
    }
    // At once: two contexts, two streams, two host threads.
    let ctxs = [cuda_context(&tiny, &m), cuda_context(&tiny, &m)];
    let bufs: Vec<DevBuf> = inputs.iter().map(|h| upload(&dev, h)).collect();
    let streams = [new_stream() as usize, new_stream() as usize];
    std::thread::scope(|sc| {
        for i in 0..2 {
            let (ctx, buf, stream, ids, tiny, devctx) = (
                &ctxs[i],
                &bufs[i],
                streams[i],
                &ids,
                &tiny,
                dev.ctx as usize,
            );
            sc.spawn(move || {
                // SAFETY: the device's primary context, retained by `dev` for the test.
                let _s = unsafe { Scope::enter(devctx as sys::CUcontext) }.unwrap();
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
        sync(*s as sys::CUstream);
        ctxs[i].check_device(*s as *mut c_void).unwrap();
        let got = download::<f32>(&bufs[i], n * hc * d);
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
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&tiny, &m);
    let (ids, n) = prefill(&tiny);
    let per = ctx.ids_per_token();
    let (hc, d, cols) = (tiny.hc, tiny.d, tiny.cols());
    let lid = tiny.layers[0].layer_id;
    let hw_in = values("errors.highway", n * hc * d, 1.0, 0.0);
    let null = std::ptr::null_mut();
    let clean = {
        let hw = upload(&dev, &hw_in);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw.ptr, 0, null)
            .unwrap();
        download::<f32>(&hw, n * hc * d)
    };
    let live = (0..n).find(|&t| ids[t * per] != -1).expect("a live token");
    for (case, want) in [
        ("out of range", EngramStatus::ErrInvalidRowId),
        ("partly dead", EngramStatus::ErrInvalidRowId),
    ] {
        let mut bad = ids.clone();
        bad[live * per + 1] = if case == "out of range" { 1 << 40 } else { -1 };
        // The host checks host ids before anything is queued.
        let hw = upload(&dev, &hw_in);
        let e = ctx
            .apply_device(lid, RowIds::Host(&bad), n, hw.ptr, 0, null)
            .unwrap_err();
        assert_eq!(e.status, want, "{case}, host ids: {}", e.message);
        // Device ids are checked on the device.
        let d_bad = upload(&dev, &bad);
        ctx.apply_device(lid, RowIds::Device(d_bad.ptr), n, hw.ptr, 0, null)
            .expect("queued");
        let e = ctx.check_device(null).unwrap_err();
        assert_eq!(e.status, want, "{case}: {}", e.message);
        assert!(
            e.message.contains(&format!("token {live}")),
            "{}",
            e.message
        );
        ctx.check_device(null).expect("reported once");
        let got = download::<f32>(&hw, n * hc * d);
        for t in 0..n {
            let sl = t * hc * d..(t + 1) * hc * d;
            if t == live {
                assert!(
                    got[sl.clone()] == hw_in[sl.clone()],
                    "{case}: the bad token changed"
                );
            } else {
                assert!(
                    got[sl.clone()] == clean[sl.clone()],
                    "{case}: token {t} differs"
                );
            }
        }
    }
    // A NaN code in an fp8 row (layer 0's table is fp8): found on the device,
    // reported by the next call.
    let li = tiny
        .layers
        .iter()
        .position(|l| l.format == EngramType::Fp8E4m3E8m0)
        .expect("an fp8 layer");
    let l = &tiny.layers[li];
    let row = ids[live * per + li * cols] as usize;
    let mut table = l.table.clone();
    let rb = tiny.hd + tiny.hd / 32;
    table[row * rb + 3] = 0x7F;
    overwrite(&m.layers[li].0, &table);
    let hw = upload(&dev, &hw_in);
    ctx.apply_device(l.layer_id, RowIds::Host(&ids), n, hw.ptr, 0, null)
        .expect("queued");
    sync(std::ptr::null_mut());
    let e = ctx
        .apply_device(l.layer_id, RowIds::Host(&ids), n, hw.ptr, 0, null)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
    assert!(e.message.contains("NaN"), "{}", e.message);
    ctx.check_device(null).expect("reported once");
    overwrite(&m.layers[li].0, &l.table);
}

#[test]
fn device_arguments_are_checked() {
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&tiny, &m);
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
    let short = upload(&dev, &vec![0f32; (n - 1) * hc * d]);
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
    let (t, w, q, k) = &m.layers[0];
    let e = ctx
        .set_layer_device(&DeviceLayerIn {
            layer_id: l.layer_id,
            table: t.ptr,
            table_rows: l.rows * 2,
            table_type: l.format as u32,
            wkv: w.ptr,
            wkv_type: dense_type(&l.wkv),
            q: q.ptr,
            k: k.ptr,
            qk_type: dense_type(&l.q),
        })
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    // A quantised wkv is not in this build's CUDA backend.
    let e = ctx
        .set_layer_device(&DeviceLayerIn {
            layer_id: l.layer_id,
            table: t.ptr,
            table_rows: l.rows,
            table_type: l.format as u32,
            wkv: w.ptr,
            wkv_type: EngramType::Q8_0 as u32,
            q: q.ptr,
            k: k.ptr,
            qk_type: dense_type(&l.q),
        })
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrUnsupported, "{}", e.message);
    // The read-back takes host ids on a CUDA context too (as on the CPU), and
    // gives what device ids give.
    let by_host = ctx.stages_device(lid, RowIds::Host(&ids), n).unwrap();
    let d_ids = upload(&dev, &ids);
    let by_device = ctx
        .stages_device(lid, RowIds::Device(d_ids.ptr), n)
        .unwrap();
    assert_eq!(by_host, by_device);
    // A bad ordinal.
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    cfg.device = 999;
    let e = match Context::new(&cfg) {
        Ok(_) => panic!("device 999 exists?"),
        Err(e) => e,
    };
    assert_eq!(e.status, EngramStatus::ErrDevice, "{}", e.message);
    // Still usable after all that.
    let hw = upload(&dev, &values("args.highway", n * hc * d, 1.0, 0.0));
    ctx.apply_device(lid, RowIds::Host(&ids), n, hw.ptr, 0, null)
        .unwrap();
    ctx.check_device(null).unwrap();
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
