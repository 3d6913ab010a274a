//! The CUDA backend inside an engine's streams (docs/cuda-streams.md):
//!
//! - `read_back` and `set_layer` order after the work of the context's last
//!   call on the engine's (non-blocking) stream, and neither waits for the
//!   whole context nor uses the legacy stream: checked on the emulation with
//!   deferred streams (work runs only when something waits for it, the
//!   legacy stream first at a context-wide wait), where a missing wait shows
//!   as wrong values and a context-wide wait is counted;
//! - the library's own copies (the device hash at create, a block fp8 `wkv`
//!   in host memory at `set_layer`, `gate_weights`' read) wait for its own
//!   stream, not the whole context;
//! - misaligned device pointers (row ids, highway) are refused with a status
//!   before anything is queued;
//! - batch invariance: a token's rows and `kv` are the same bits in every
//!   batch of 1 to `GEMV_MAX` tokens (data chosen so that another summation
//!   order gives other bits);
//! - on a GPU: a graph captured before `set_layer` is re-captured after it
//!   and then gives the new weights' bits.
//!
//! The emulated tests each load their own emulator (deferral is per
//! emulator; the tests of this binary run in parallel).

mod common;

use common::device::{dev_model, device, own_device, own_emulator, Dev, DevWeights};
use common::*;
use engram::cuda::sys;
use engram::formats::{bf16_to_f32, f32_to_bf16};
use engram::memory::Region;
use engram::{Context, ContextConfig, EngramBackend, EngramStatus, EngramType, LayerIn, RowIds};
use std::ffi::c_void;

/// An emulated stream handle (never dereferenced by the emulation).
fn fake_stream(i: usize) -> *mut c_void {
    (0x1000 * i) as *mut c_void
}

/// The tiny model's configuration on the CUDA backend of `dev`.
fn cuda_config<'a>(dev: &Dev, tiny: &'a Tiny) -> ContextConfig<'a> {
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    cfg
}

fn cuda_context<'a>(dev: &Dev, tiny: &'a Tiny, m: &[DevWeights]) -> Context<'a> {
    let ctx = Context::new(&cuda_config(dev, tiny)).expect("create a CUDA context");
    for (l, w) in tiny.layers.iter().zip(m) {
        ctx.set_layer_device(&w.layer_in(l))
            .expect("set_layer_device");
    }
    ctx
}

/// The prefill's row ids (all layers) and token count, and the same tokens'
/// ids in reverse token order (other rows at every position).
fn prefill(tiny: &Tiny) -> (Vec<i64>, Vec<i64>, usize) {
    let c = &tiny.golden["regimes"]["prefill"]["calls"][0];
    let (tokens, seq_ids, pos) = (i32s(&c["tokens"]), i32s(&c["seq_ids"]), i32s(&c["pos"]));
    let ctx = tiny.context();
    let n = tokens.len();
    let per = ctx.ids_per_token();
    let mut ids = vec![0i64; n * per];
    ctx.hash(&tokens, &seq_ids, &pos, &mut ids).unwrap();
    let rev: Vec<i64> = (0..n)
        .rev()
        .flat_map(|t| ids[t * per..(t + 1) * per].to_vec())
        .collect();
    (ids, rev, n)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `read_back` after an apply still queued on a non-blocking stream: the
/// read-back's work waits for the apply's (its rows and kv are its own ids',
/// the apply's highway is right), and nothing waits for the whole context.
#[test]
fn read_back_orders_after_an_apply_on_the_engines_stream() {
    let Some((dev, emu)) = own_emulator() else {
        return;
    };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m);
    let (ids, rev, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let s = fake_stream(1);
    for l in &tiny.layers {
        let lid = l.layer_id;
        // References, nothing deferred.
        let want_rb = ctx.stages_device(lid, RowIds::Host(&rev), n).unwrap();
        let hw_in = values("streams.read_back", n * hc * d, 1.0, 0.0);
        let hw_ref = dev.upload(&hw_in);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw_ref.ptr, 0, s)
            .unwrap();
        ctx.check_device(s).unwrap();
        let want_hw = bits(&hw_ref.read::<f32>(n * hc * d).unwrap());
        let hw = dev.upload(&hw_in);
        // The apply is queued and does not run until something waits for it.
        let syncs = emu.context_syncs();
        emu.set_deferred(true);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw.ptr, 0, s)
            .unwrap();
        assert!(emu.pending() > 0, "the apply's work is queued, not run");
        let got_rb = ctx.stages_device(lid, RowIds::Host(&rev), n).unwrap();
        let syncs_after = emu.context_syncs();
        ctx.check_device(s).unwrap();
        emu.set_deferred(false);
        assert!(
            got_rb == want_rb,
            "layer {lid}: read_back ran before the apply queued on the engine's stream had finished"
        );
        assert_eq!(
            syncs_after, syncs,
            "layer {lid}: read_back waited for the whole context"
        );
        assert!(
            bits(&hw.read::<f32>(n * hc * d).unwrap()) == want_hw,
            "layer {lid}: the apply's highway was changed by the read-back's work"
        );
    }
}

/// A context's direct calls on two streams are ordered on the device: the
/// call on another stream than the last call's waits there for the last
/// call's work (the workspaces, the decode kernel's count of blocks done and
/// the error latch are the context's, one call at a time). With deferred
/// work, waiting for the second stream alone runs the first stream's apply
/// too, and both highways get the bits of an apply alone; no context-wide
/// wait.
#[test]
fn a_call_on_another_stream_waits_for_the_last_calls_work() {
    let Some((dev, emu)) = own_emulator() else {
        return;
    };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m);
    let (ids, _, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let lid = tiny.layers[0].layer_id;
    let (a, b) = (fake_stream(1), fake_stream(2));
    let hw_in = values("streams.two_streams", n * hc * d, 1.0, 0.0);
    let hw_ref = dev.upload(&hw_in);
    ctx.apply_device(lid, RowIds::Host(&ids), n, hw_ref.ptr, 0, a)
        .unwrap();
    ctx.check_device(a).unwrap();
    let want = bits(&hw_ref.read::<f32>(n * hc * d).unwrap());
    let (hw_a, hw_b) = (dev.upload(&hw_in), dev.upload(&hw_in));
    let syncs = emu.context_syncs();
    emu.set_deferred(true);
    ctx.apply_device(lid, RowIds::Host(&ids), n, hw_a.ptr, 0, a)
        .unwrap();
    ctx.apply_device(lid, RowIds::Host(&ids), n, hw_b.ptr, 0, b)
        .unwrap();
    assert!(emu.pending() > 0, "the applies' work is queued, not run");
    dev.gpu.stream_synchronize(b).unwrap();
    let left = emu.pending();
    let syncs_after = emu.context_syncs();
    emu.set_deferred(false);
    assert_eq!(
        left, 0,
        "waiting for the second stream left the first stream's apply queued: the calls were not ordered"
    );
    assert_eq!(syncs_after, syncs, "a context-wide wait");
    for (hw, s) in [(&hw_a, "first"), (&hw_b, "second")] {
        assert!(
            bits(&hw.read::<f32>(n * hc * d).unwrap()) == want,
            "the {s} stream's highway differs from an apply alone"
        );
    }
}

/// `set_layer` while an apply using the old weights is still queued: it
/// waits for that apply (the engine frees the old weights when it returns),
/// with an event, not a context-wide wait.
#[test]
fn set_layer_waits_for_the_last_apply_not_for_the_context() {
    let Some((dev, emu)) = own_emulator() else {
        return;
    };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m);
    let (ids, _, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let s = fake_stream(2);
    let hw_in = values("streams.set_layer", n * hc * d, 1.0, 0.0);
    for li in 0..tiny.layers.len() {
        let lid = tiny.layers[li].layer_id;
        let hw_ref = dev.upload(&hw_in);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw_ref.ptr, 0, s)
            .unwrap();
        ctx.check_device(s).unwrap();
        let want = bits(&hw_ref.read::<f32>(n * hc * d).unwrap());
        // A second copy of the same weights, to switch to.
        let copy = dev_model(&dev, &tiny);
        let hw = dev.upload(&hw_in);
        let syncs = emu.context_syncs();
        emu.set_deferred(true);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw.ptr, 0, s)
            .unwrap();
        ctx.set_layer_device(&copy[li].layer_in(&tiny.layers[li]))
            .unwrap();
        // The engine may free the old weights now: poison them.
        let old = &m[li];
        for b in [&old.table, &old.wkv, &old.q, &old.k] {
            // SAFETY: emulated device memory is host memory of `b.bytes`.
            unsafe { std::ptr::write_bytes(b.ptr as *mut u8, 0xFF, b.bytes) };
        }
        assert_eq!(
            emu.context_syncs(),
            syncs,
            "layer {lid}: set_layer waited for the whole context (cuCtxSynchronize)"
        );
        ctx.check_device(s).unwrap();
        emu.set_deferred(false);
        assert!(
            bits(&hw.read::<f32>(n * hc * d).unwrap()) == want,
            "layer {lid}: the apply queued before set_layer read the replaced weights"
        );
        // And the new weights give the same bits.
        let hw2 = dev.upload(&hw_in);
        ctx.apply_device(lid, RowIds::Host(&ids), n, hw2.ptr, 0, s)
            .unwrap();
        ctx.check_device(s).unwrap();
        assert!(bits(&hw2.read::<f32>(n * hc * d).unwrap()) == want);
        // Keep the copy alive as the layer's weights from here on.
        std::mem::forget(copy);
    }
}

/// Misaligned device pointers are refused before anything is queued: the
/// row ids (int64: 8 bytes) and the highway (its element size).
#[test]
fn misaligned_device_pointers_are_refused_and_nothing_is_queued() {
    // A device of its own: the launches counted are this test's.
    let Some(dev) = own_device() else { return };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m);
    let (ids, _, n) = prefill(&tiny);
    let (hc, d) = (tiny.hc, tiny.d);
    let lid = tiny.layers[0].layer_id;
    let null = std::ptr::null_mut();
    // Room for the misaligned views: one more token's worth of ids and highway.
    let per = ctx.ids_per_token();
    let mut padded = ids.clone();
    padded.extend(std::iter::repeat_n(0i64, per));
    let d_ids = dev.upload(&padded);
    let hw_in = values("streams.align", (n + 1) * hc * d, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    let before = dev.emu.as_ref().map(|e| e.launches());
    for off in [1u64, 2, 4] {
        let e = ctx
            .apply_device(lid, RowIds::Device(d_ids.ptr + off), n, hw.ptr, 0, null)
            .unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
        assert!(e.message.contains("aligned"), "{}", e.message);
        let e = ctx
            .stages_device(lid, RowIds::Device(d_ids.ptr + off), n)
            .unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    }
    for (off, ty) in [(2u64, EngramType::F32), (1, EngramType::Bf16)] {
        let ty = ty as u32;
        let e = ctx
            .apply_device(lid, RowIds::Device(d_ids.ptr), n, hw.ptr + off, ty, null)
            .unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
        assert!(e.message.contains("aligned"), "{}", e.message);
    }
    if let (Some(b), Some(e)) = (before, dev.emu.as_ref()) {
        assert_eq!(b, e.launches(), "a refused call queued a kernel");
    }
    ctx.check_device(null).unwrap();
    assert!(
        bits(&hw.read::<f32>((n + 1) * hc * d).unwrap()) == bits(&hw_in),
        "a refused call changed the highway"
    );
    // Aligned, the same buffers work.
    ctx.apply_device(lid, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, null)
        .unwrap();
    ctx.check_device(null).unwrap();
}

/// A token's rows and kv are the same bits in every batch of 1 to GEMV_MAX
/// tokens (bf16 `wkv`, the default projection). The data make the order of
/// the sums matter: every table row starts with 2^25 and is 1 elsewhere,
/// `wkv` is 1 but -1 at every other column's first element, so that adding
/// the ones before or after a large term gives another f32 sum.
#[test]
fn a_token_gets_the_same_bits_in_every_batch_up_to_the_gemv_bound() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let (hd, cols) = (tiny.hd, tiny.cols());
    let (k_in, k_out) = (cols * hd, tiny.d * (tiny.hc + 1));
    let mut m = dev_model(&dev, &tiny);
    // Layer 1 (index 1) has a bf16 table: give it the rows above and a bf16 wkv.
    let li = 1;
    assert_eq!(tiny.layers[li].format, EngramType::Bf16);
    let rows = tiny.layers[li].rows as usize;
    let mut row = vec![f32_to_bf16(1.0); hd];
    row[0] = f32_to_bf16(33554432.0);
    let table: Vec<u16> = (0..rows).flat_map(|_| row.clone()).collect();
    let wkv: Vec<u16> = (0..k_out * k_in)
        .map(|i| {
            let k = i % k_in;
            let sign = if k % hd == 0 && (k / hd) % 2 == 1 {
                -1.0
            } else {
                1.0
            };
            // A little variety between outputs (exact in bf16).
            f32_to_bf16(sign * (1.0 + ((i / k_in) % 4) as f32 / 4.0))
        })
        .collect();
    m[li].table = dev.upload(&table);
    m[li].wkv = dev.upload(&wkv);
    let qk: Vec<u16> = (0..tiny.hc * tiny.d).map(|_| f32_to_bf16(1.0)).collect();
    m[li].q = dev.upload(&qk);
    m[li].k = dev.upload(&qk);
    let cfg = cuda_config(&dev, &tiny);
    let ctx = Context::new(&cfg).expect("create a CUDA context");
    let mut l = m[li].layer_in(&tiny.layers[li]);
    l.wkv_type = EngramType::Bf16 as u32;
    l.qk_type = EngramType::Bf16 as u32;
    ctx.set_layer_device(&l).unwrap();
    let lid = l.layer_id;
    let (ids, _, n_all) = prefill(&tiny);
    let per = ctx.ids_per_token();
    let max = engram::cuda::kernels::GEMV_MAX.min(n_all);
    let (rows1, kv1) = ctx
        .stages_device(lid, RowIds::Host(&ids[..per]), 1)
        .unwrap();
    // The order matters for these data (or the test could not fail): a sum
    // in k order and one in 32 strided partial sums (a warp's) differ.
    let prod = |o: usize, k: usize| bf16_to_f32(rows1[k]) * bf16_to_f32(wkv[o * k_in + k]);
    let differ = (0..k_out).any(|o| {
        let in_order = (0..k_in).fold(0f32, |a, k| a + prod(o, k));
        let mut lanes = [0f32; 32];
        for k in 0..k_in {
            lanes[(k / 8) % 32] += prod(o, k);
        }
        let mut w = 32;
        while w > 1 {
            w /= 2;
            for i in 0..w {
                lanes[i] += lanes[i + w];
            }
        }
        f32_to_bf16(in_order) != f32_to_bf16(lanes[0])
    });
    assert!(differ, "the test data do not depend on the summation order");
    for n in 1..=max {
        let (r, kv) = ctx
            .stages_device(lid, RowIds::Host(&ids[..n * per]), n)
            .unwrap();
        // Token 0 in a batch of n, against token 0 alone.
        assert!(r[..k_in] == rows1[..], "{n} tokens: token 0's rows differ");
        assert!(
            kv[..k_out] == kv1[..],
            "{n} tokens: token 0's kv differs from a batch of one"
        );
        // Every token of the batch, against itself alone.
        for t in 1..n {
            let (_, kv_t) = ctx
                .stages_device(lid, RowIds::Host(&ids[t * per..(t + 1) * per]), 1)
                .unwrap();
            assert!(
                kv[t * k_out..(t + 1) * k_out] == kv_t[..],
                "{n} tokens: token {t}'s kv differs from a batch of one"
            );
        }
    }
    ctx.check_device(std::ptr::null_mut()).unwrap();
}

/// On a GPU: a graph captured before `set_layer` must be re-captured after
/// it (it holds the old weights' addresses); re-captured, its replays give
/// the new weights' bits, equal to a direct apply.
#[test]
fn a_graph_recaptured_after_set_layer_uses_the_new_weights() {
    let Some(dev) = device() else { return };
    if !dev.is_real() {
        common::device::skip(
            "graph capture needs a GPU (the emulation has none): scripts/gpu-check.sh runs it",
        );
        return;
    }
    let d = &sys::driver().expect("the driver").api;
    let ok = |r: sys::CUresult, what: &str| {
        assert_eq!(
            r,
            sys::CUDA_SUCCESS,
            "{what}: {}",
            engram::cuda::driver::error_text(r)
        )
    };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let ctx = cuda_context(&dev, &tiny, &m);
    let (ids, _, n) = prefill(&tiny);
    let (hc, dd) = (tiny.hc, tiny.d);
    let d_ids = dev.upload(&ids);
    let hw_in = values("streams.graph", n * hc * dd, 1.0, 0.0);
    let _g = dev.gpu.enter().unwrap();
    let mut stream = std::ptr::null_mut();
    // SAFETY: the device's context is current; a local out-pointer.
    unsafe {
        ok(
            (d.cuStreamCreate)(&mut stream, sys::CU_STREAM_NON_BLOCKING),
            "stream",
        )
    };
    let s = stream as *mut c_void;
    let li = 0;
    let lid = tiny.layers[li].layer_id;
    // The new weights: wkv scaled by 2 (exact in bf16).
    let wkv2: Vec<u16> = match &tiny.layers[li].wkv {
        Dense::Bf16(v) => v
            .iter()
            .map(|&x| f32_to_bf16(2.0 * bf16_to_f32(x)))
            .collect(),
        Dense::F32(_) => panic!("layer 0 has a bf16 wkv"),
    };
    let w2 = dev.upload(&wkv2);
    let capture_and_replay = |want: &[u32]| {
        let hw = dev.upload(&hw_in);
        let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: a live stream; thread-local capture; the graph is
        // instantiated, launched and destroyed here.
        unsafe {
            ok(
                d.cuStreamBeginCapture_v2.unwrap()(
                    stream,
                    sys::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                ),
                "begin capture",
            );
            ctx.apply_device(lid, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, s)
                .unwrap();
            ok(
                d.cuStreamEndCapture.unwrap()(stream, &mut graph),
                "end capture",
            );
            ok(
                d.cuGraphInstantiateWithFlags.unwrap()(&mut exec, graph, 0),
                "instantiate",
            );
            ok(d.cuGraphLaunch.unwrap()(exec, stream), "launch");
            ok((d.cuStreamSynchronize)(stream), "sync");
            ok(d.cuGraphExecDestroy.unwrap()(exec), "destroy exec");
            ok(d.cuGraphDestroy.unwrap()(graph), "destroy graph");
        }
        assert!(bits(&hw.read::<f32>(n * hc * dd).unwrap()) == want);
    };
    let direct = |ctx: &Context<'_>| {
        let hw = dev.upload(&hw_in);
        ctx.apply_device(lid, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, s)
            .unwrap();
        ctx.check_device(s).unwrap();
        bits(&hw.read::<f32>(n * hc * dd).unwrap())
    };
    let want_old = direct(&ctx);
    capture_and_replay(&want_old);
    let mut l = m[li].layer_in(&tiny.layers[li]);
    l.wkv = w2.ptr;
    ctx.set_layer_device(&l).unwrap();
    let want_new = direct(&ctx);
    assert!(want_new != want_old, "the new weights change the result");
    capture_and_replay(&want_new);
    ctx.check_device(s).unwrap();
    // SAFETY: created above, idle.
    unsafe { ok((d.cuStreamDestroy_v2)(stream), "destroy stream") };
}

/// What the library copies to or from the device outside `engram_free` waits
/// for its own stream, never the whole context (docs/cuda-streams.md): the
/// device hash's tables and ring at create, a block fp8 `wkv` given in host
/// memory (codes and scales) at `set_layer`, the check of one given in device
/// memory (read back at `set_layer`), and `gate_weights`' read of
/// q * k. Each counted on an emulator of the test's own; the copies' content
/// checked (the layer's kv against the same codes on the device, q * k
/// against the CPU backend's).
#[test]
fn host_copies_wait_for_the_own_stream_not_the_context() {
    let Some((dev, emu)) = own_emulator() else {
        return;
    };
    let tiny = Tiny::load();
    let m = dev_model(&dev, &tiny);
    let l0 = &tiny.layers[0];
    let cols = (tiny.ngram - 1) * tiny.heads;
    let (k_in, k_out) = (cols * tiny.hd, tiny.d * (tiny.hc + 1));
    let f = Filler::new("streams.fp8.codes");
    let codes: Vec<u8> = (0..k_in * k_out)
        .map(|i| f.bits(i as u64) as u8)
        .map(|c| if c & 0x7F == 0x7F { c ^ 1 } else { c })
        .collect();
    let g = Filler::new("streams.fp8.scales");
    let scales: Vec<u8> = (0..k_out.div_ceil(128) * k_in.div_ceil(128))
        .map(|i| 118 + (g.bits(i as u64) % 12) as u8)
        .collect();
    let (d_codes, d_scales) = (dev.upload(&codes), dev.upload(&scales));
    let cfg = cuda_config(&dev, &tiny);
    let layer = |codes, scales| fp8_layer(l0, &m[0], codes, scales);
    // SAFETY: device addresses (the emulation's), alive for the test.
    let on_dev = |a: u64| unsafe { Region::from_raw(a as usize, None) };
    let reference = Context::new(&cfg).expect("a CUDA context");
    reference
        .set_layer(layer(on_dev(d_codes.ptr), on_dev(d_scales.ptr)))
        .unwrap();

    let syncs = emu.context_syncs();
    let ctx = Context::new(&cfg)
        .expect("a CUDA context")
        .with_device_history(8)
        .expect("a device history");
    assert_eq!(
        emu.context_syncs(),
        syncs,
        "create with a device history waited for the whole context"
    );
    ctx.set_layer(layer(Region::of(&codes[..]), Region::of(&scales[..])))
        .unwrap();
    assert_eq!(
        emu.context_syncs(),
        syncs,
        "set_layer of a block fp8 wkv in host memory waited for the whole context"
    );
    let qk = ctx.gate_weights(l0.layer_id).unwrap();
    assert_eq!(
        emu.context_syncs(),
        syncs,
        "gate_weights waited for the whole context"
    );
    // The same codes and scales in device memory: read back for the check
    // on the own stream.
    let dctx = Context::new(&cfg).expect("a CUDA context");
    let syncs = emu.context_syncs();
    dctx.set_layer(layer(on_dev(d_codes.ptr), on_dev(d_scales.ptr)))
        .unwrap();
    assert_eq!(
        emu.context_syncs(),
        syncs,
        "set_layer of a block fp8 wkv in device memory waited for the whole context"
    );
    let cpu = tiny.context();
    assert_eq!(
        bits(&qk),
        bits(&cpu.gate_weights(l0.layer_id).unwrap()),
        "q * k read back on the own stream"
    );
    let (ids, _, n) = prefill(&tiny);
    let want = reference.stages(l0.layer_id, &ids, n).unwrap();
    let got = ctx.stages(l0.layer_id, &ids, n).unwrap();
    assert!(
        got == want,
        "the host codes and scales copied on the own stream give the device ones' rows and kv"
    );
}

/// Layer `l`'s table, q and k on the device (`w`), with a block fp8 `wkv` of
/// `codes` and `scales` in 128 x 128 blocks.
fn fp8_layer<'a>(
    l: &LayerData,
    w: &DevWeights,
    codes: Region<'a>,
    scales: Region<'a>,
) -> LayerIn<'a> {
    // SAFETY: device buffers of the sizes the geometry implies (the tiny
    // model's table, q and k), alive for the test.
    let mut li = unsafe {
        LayerIn::raw(
            l.layer_id,
            w.table.ptr,
            l.format as u32,
            l.rows,
            0,
            EngramType::Fp8E4m3E8m0Block as u32,
            w.q.ptr,
            w.k.ptr,
            dense_type(&l.q),
        )
    };
    li.wkv = codes;
    li.wkv_scales = Some(scales);
    li.wkv_block = (128, 128);
    li
}
