//! Tables in host memory or in a file on the CUDA backend: the rows a call
//! needs are gathered on the host (by `engram_prefetch`'s workers ahead of
//! time, or by the apply), copied through pinned staging to the device, and
//! read by the same kernels: the results are the bits of the same table in
//! device memory. Also: the prefetch counts, `engram_stage` for calls with
//! device row ids (graph replays), rows that were not staged, I/O errors, and
//! replacing a host table with a device one; many prefetches and applies
//! interleaved with their copies deferred (on the emulation): a prefetch
//! writes its rows once, into pinned memory that no queued copy still reads.
//!
//! On the GPU when there is one, else on the emulation (see
//! `tests/common/device.rs`); `ENGRAM_REQUIRE_GPU=1` requires the GPU.

mod common;

use common::device::{device, emulated, real, simt_library, Dev};
use common::*;
use engram::backend::{TableIn, TableSource};
use engram::cuda::emu::Emulator;
use engram::cuda::gpu::DevBuf;
use engram::cuda::gpu::Gpu;
use engram::memory::Region;
use engram::{Context, EngramBackend, EngramStatus, LayerIn, RowIds};
use std::ffi::c_void;
use std::sync::Arc;

/// A CUDA context of the tiny model on `dev`, no layers set.
fn cuda_context<'a>(dev: &Dev, tiny: &'a Tiny) -> Context<'a> {
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    Context::new(&cfg).expect("create a CUDA context")
}

/// One layer's device copies of wkv, q, k.
struct DevWeights {
    table: DevBuf,
    wkv: DevBuf,
    q: DevBuf,
    k: DevBuf,
}

fn dev_weights(dev: &Dev, l: &LayerData) -> DevWeights {
    DevWeights {
        table: dev.upload(&l.table),
        wkv: dev.upload(&dense_bytes(&l.wkv)),
        q: dev.upload(&dense_bytes(&l.q)),
        k: dev.upload(&dense_bytes(&l.k)),
    }
}

/// Layer `l` with its table at `source` and wkv, q, k on the device.
fn layer_with<'w>(l: &LayerData, source: TableSource<'w>, w: &DevWeights) -> LayerIn<'w> {
    // SAFETY: device buffers of the sizes the geometry implies, alive for the test.
    let r = |a: u64| unsafe { Region::from_raw(a as usize, None) };
    LayerIn {
        layer_id: l.layer_id,
        table: TableIn {
            source,
            scales: None,
            ty: l.format as u32,
            rows: l.rows,
        },
        wkv: r(w.wkv.ptr),
        wkv_type: dense_type(&l.wkv),
        wkv_scales: None,
        wkv_block: (0, 0),
        q: r(w.q.ptr),
        k: r(w.k.ptr),
        qk_type: dense_type(&l.q),
    }
}

/// The calls of the `chunked` regime (three calls, one sequence) and their ids.
fn steps(tiny: &Tiny) -> Vec<(Vec<i64>, usize)> {
    let ctx = tiny.context();
    tiny.golden["regimes"]["interleaved"]["calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let (tok, seq, pos) = (i32s(&c["tokens"]), i32s(&c["seq_ids"]), i32s(&c["pos"]));
            let n = tok.len();
            let mut ids = vec![0i64; n * ctx.ids_per_token()];
            ctx.hash(&tok, &seq, &pos, &mut ids).unwrap();
            (ids, n)
        })
        .collect()
}

/// Apply both layers to a fresh f32 highway of `n` tokens; return it.
fn run_step(
    dev: &Dev,
    ctx: &Context<'_>,
    tiny: &Tiny,
    ids: RowIds<'_>,
    n: usize,
    name: &str,
) -> Vec<u32> {
    let hw_in = values(name, n * tiny.hc * tiny.d, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    for l in &tiny.layers {
        ctx.apply_device(l.layer_id, ids, n, hw.ptr, 0, std::ptr::null_mut())
            .unwrap_or_else(|e| panic!("apply layer {}: {}", l.layer_id, e.message));
    }
    ctx.check_device(std::ptr::null_mut()).unwrap();
    hw.read::<f32>(n * tiny.hc * tiny.d)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn host_and_file_tables_give_the_device_tables_bits() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w: Vec<DevWeights> = tiny.layers.iter().map(|l| dev_weights(&dev, l)).collect();
    // The same tables in a file, at an odd offset.
    let dir = std::env::temp_dir().join(format!("engram-cuda-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tables.bin");
    let mut bytes = vec![0xA5u8; 13];
    let mut at = Vec::new();
    for l in &tiny.layers {
        at.push(bytes.len() as u64);
        bytes.extend_from_slice(&l.table);
    }
    std::fs::write(&path, &bytes).unwrap();
    let file = Arc::new(std::fs::File::open(&path).unwrap());

    let on_device = cuda_context(&dev, &tiny);
    let in_memory = cuda_context(&dev, &tiny);
    let in_file = cuda_context(&dev, &tiny);
    // The file behind a host row cache of a few rows a layer (it evicts on
    // every step; docs/row-cache.md).
    let cached = cuda_context(&dev, &tiny);
    cached.set_row_cache(3000).unwrap();
    for (i, l) in tiny.layers.iter().enumerate() {
        cached
            .set_layer(layer_with(
                l,
                TableSource::File {
                    file: file.clone(),
                    offset: at[i],
                },
                &w[i],
            ))
            .unwrap();
        on_device
            .set_layer(layer_with(
                l,
                // SAFETY: a device buffer of the table's size.
                TableSource::Memory(unsafe { Region::from_raw(w[i].table.ptr as usize, None) }),
                &w[i],
            ))
            .unwrap();
        in_memory
            .set_layer(layer_with(
                l,
                TableSource::Memory(Region::of(&l.table)),
                &w[i],
            ))
            .unwrap();
        in_file
            .set_layer(layer_with(
                l,
                TableSource::File {
                    file: file.clone(),
                    offset: at[i],
                },
                &w[i],
            ))
            .unwrap();
    }
    for (si, (ids, n)) in steps(&tiny).iter().enumerate() {
        let name = format!("host.step{si}");
        let want = run_step(&dev, &on_device, &tiny, RowIds::Host(ids), *n, &name);
        for (ctx, what) in [
            (&in_memory, "host memory"),
            (&in_file, "a file"),
            (&cached, "a file behind a row cache"),
        ] {
            for l in &tiny.layers {
                assert_eq!(
                    ctx.stages_device(l.layer_id, RowIds::Host(ids), *n)
                        .unwrap(),
                    on_device
                        .stages_device(l.layer_id, RowIds::Host(ids), *n)
                        .unwrap(),
                    "step {si} layer {}: rows and kv, table in {what}",
                    l.layer_id
                );
            }
            // Half the steps prefetched first.
            if si % 2 == 0 {
                for l in &tiny.layers {
                    ctx.prefetch(l.layer_id, ids, *n).unwrap();
                }
            }
            let got = run_step(&dev, ctx, &tiny, RowIds::Host(ids), *n, &name);
            assert!(got == want, "step {si}: the highway, table in {what}");
        }
    }
    let s = in_file.info().stage;
    assert!(s.prefetched > 0 && s.staged > 0 && s.direct > 0, "{s:?}");
    for li in 0..tiny.layers.len() {
        let c = cached
            .cache_stats(li, engram::rowcache::Tier::Host)
            .unwrap();
        assert!(
            c.hits > 0 && c.evictions > 0 && c.reads <= c.misses,
            "{c:?}"
        );
    }
    assert_eq!(on_device.info().stage.prefetched, 0);
    assert!(
        in_memory.info().host_bytes > 0,
        "pinned staging is reported"
    );
    println!(
        "tables in host memory and in a file: the device table's bits; stage counts {s:?}; {}",
        in_memory.info().kernel
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn staged_rows_serve_device_row_ids_and_unstaged_rows_are_reported() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w: Vec<DevWeights> = tiny.layers.iter().map(|l| dev_weights(&dev, l)).collect();
    let host = cuda_context(&dev, &tiny);
    let on_device = cuda_context(&dev, &tiny);
    for (i, l) in tiny.layers.iter().enumerate() {
        host.set_layer(layer_with(
            l,
            TableSource::Memory(Region::of(&l.table)),
            &w[i],
        ))
        .unwrap();
        on_device
            .set_layer(layer_with(
                l,
                // SAFETY: a device buffer of the table's size.
                TableSource::Memory(unsafe { Region::from_raw(w[i].table.ptr as usize, None) }),
                &w[i],
            ))
            .unwrap();
    }
    let null: *mut c_void = std::ptr::null_mut();
    let all = steps(&tiny);
    let (ids, n) = (&all[0].0, all[0].1);
    let d_ids = dev.upload(ids);
    // Nothing staged yet: every live row is reported as not staged.
    let hw_in = values("staged.highway", n * tiny.hc * tiny.d, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    let lid = tiny.layers[0].layer_id;
    host.apply_device(lid, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, null)
        .expect("queued");
    let e = host.check_device(null).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("not staged"), "{}", e.message);
    assert_eq!(
        hw.read::<f32>(hw_in.len()).unwrap(),
        hw_in,
        "nothing applied"
    );
    // Staged: device ids give the device table's bits.
    for l in &tiny.layers {
        host.stage(l.layer_id, ids, n, null).unwrap();
    }
    let got = run_step(&dev, &host, &tiny, RowIds::Device(d_ids.ptr), n, "staged.a");
    let want = run_step(
        &dev,
        &on_device,
        &tiny,
        RowIds::Device(d_ids.ptr),
        n,
        "staged.a",
    );
    assert!(got == want, "staged rows: the device table's bits");
    // A later step staged, the earlier ids replayed: positions whose id
    // changed are reported; the first by token and column.
    let (ids2, n2) = (&all[1].0, all[1].1);
    for l in &tiny.layers {
        host.stage(l.layer_id, ids2, n2, null).unwrap();
    }
    let per = host.ids_per_token();
    let first = (0..n.min(n2))
        .flat_map(|t| (0..tiny.cols()).map(move |c| (t, c)))
        .find(|&(t, c)| ids[t * per + c] != ids2[t * per + c] && ids[t * per + c] != -1)
        .expect("a position whose id changed");
    let hw = dev.upload(&hw_in);
    host.apply_device(lid, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, null)
        .unwrap();
    let e = host.check_device(null).unwrap_err();
    assert!(
        e.message.starts_with(&format!(
            "token {}, layer {lid}, column {}:",
            first.0, first.1
        )),
        "{}",
        e.message
    );
    // engram_stage on a device table: nothing to do.
    on_device.stage(lid, ids, n, null).unwrap();
    // Bad ids are refused by engram_stage itself.
    let mut bad = ids.clone();
    bad[1] = 1 << 40;
    let e = host.stage(lid, &bad, n, null).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidRowId, "{}", e.message);
}

#[test]
fn a_file_cut_short_is_an_io_error_and_nothing_is_queued() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let l = &tiny.layers[0];
    let w = dev_weights(&dev, l);
    let dir = std::env::temp_dir().join(format!("engram-cuda-cut-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("table.bin");
    std::fs::write(&path, &l.table).unwrap();
    let file = Arc::new(std::fs::File::open(&path).unwrap());
    let ctx = cuda_context(&dev, &tiny);
    ctx.set_layer(layer_with(
        l,
        TableSource::File {
            file: file.clone(),
            offset: 0,
        },
        &w,
    ))
    .unwrap();
    // A file shorter than the table is refused at set_layer.
    let e = ctx
        .set_layer(layer_with(l, TableSource::File { file, offset: 1 }, &w))
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    // Cut short after set_layer: the read fails, the highway is untouched.
    let all = steps(&tiny);
    let (ids, n) = (&all[0].0, all[0].1);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(10)
        .unwrap();
    let hw_in = values("cut.highway", n * tiny.hc * tiny.d, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    let e = ctx
        .apply_device(
            l.layer_id,
            RowIds::Host(ids),
            n,
            hw.ptr,
            0,
            std::ptr::null_mut(),
        )
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    ctx.check_device(std::ptr::null_mut()).unwrap();
    assert_eq!(hw.read::<f32>(hw_in.len()).unwrap(), hw_in);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_layer_moves_between_host_and_device_tables() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w: Vec<DevWeights> = tiny.layers.iter().map(|l| dev_weights(&dev, l)).collect();
    let ctx = cuda_context(&dev, &tiny);
    let reference = cuda_context(&dev, &tiny);
    let dev_src = |i: usize| {
        // SAFETY: a device buffer of the table's size.
        TableSource::Memory(unsafe { Region::from_raw(w[i].table.ptr as usize, None) })
    };
    for (i, l) in tiny.layers.iter().enumerate() {
        reference
            .set_layer(layer_with(l, dev_src(i), &w[i]))
            .unwrap();
    }
    let all = steps(&tiny);
    let (ids, n) = (&all[0].0, all[0].1);
    let want = run_step(&dev, &reference, &tiny, RowIds::Host(ids), n, "move");
    for round in 0..3 {
        for (i, l) in tiny.layers.iter().enumerate() {
            let src = if (round + i) % 2 == 0 {
                TableSource::Memory(Region::of(&l.table))
            } else {
                dev_src(i)
            };
            ctx.set_layer(layer_with(l, src, &w[i])).unwrap();
            ctx.prefetch(l.layer_id, ids, n).unwrap();
        }
        let got = run_step(&dev, &ctx, &tiny, RowIds::Host(ids), n, "move");
        assert!(got == want, "round {round}");
    }
    // wkv, q and k in host memory too (wkv is copied to the device).
    let host_all = cuda_context(&dev, &tiny);
    for l in &tiny.layers {
        host_all
            .set_layer(LayerIn::host(
                l.layer_id,
                &l.table,
                l.format,
                l.rows,
                l.wkv.weights(),
                l.q.weights(),
                l.k.weights(),
            ))
            .unwrap();
    }
    let got = run_step(&dev, &host_all, &tiny, RowIds::Host(ids), n, "move");
    assert!(got == want, "everything in host memory");
}

#[test]
fn gate_weights_and_threads_on_the_cuda_backend() {
    // engram_layer_gate_weights reads q * k back from the device: the CPU
    // backend's values; engram_set_threads is recorded and changes nothing.
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let ctx = cuda_context(&dev, &tiny);
    let cpu = tiny.context();
    let l = &tiny.layers[0];
    let e = ctx.gate_weights(l.layer_id).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrNoWeights);
    let w = dev_weights(&dev, l);
    ctx.set_layer(layer_with(
        l,
        TableSource::Memory(
            // SAFETY: a device buffer of the table's size, alive for the test.
            unsafe { Region::from_raw(w.table.ptr as usize, None) },
        ),
        &w,
    ))
    .unwrap();
    let got = ctx.gate_weights(l.layer_id).unwrap();
    assert_eq!(got, cpu.gate_weights(l.layer_id).unwrap());
    assert_eq!(got.len(), tiny.hc * tiny.d);
    ctx.set_threads(4).unwrap();
    assert_eq!(ctx.n_threads(), 4);
}

/// The calls of every golden regime (fresh sequences for each), hashed:
/// `(row ids, tokens)`. The `dead` regime has tokens whose ids are all dead,
/// so the live tokens' rows sit at positions with holes between them.
fn all_regime_steps(tiny: &Tiny) -> Vec<(Vec<i64>, usize)> {
    let ctx = tiny.context();
    let mut v = Vec::new();
    for r in ["prefill", "decode", "interleaved", "dead"] {
        for c in tiny.golden["regimes"][r]["calls"].as_array().unwrap() {
            let (tok, seq, pos) = (i32s(&c["tokens"]), i32s(&c["seq_ids"]), i32s(&c["pos"]));
            let n = tok.len();
            let mut ids = vec![0i64; n * ctx.ids_per_token()];
            ctx.hash(&tok, &seq, &pos, &mut ids).unwrap();
            v.push((ids, n));
        }
        for s in 0..4 {
            ctx.seq_drop(s).unwrap();
        }
    }
    v
}

/// Live rows of layer `li` in a step's ids.
fn live_rows(ctx: &Context<'_>, ids: &[i64], n: usize, li: usize, cols: usize) -> u64 {
    let per = ctx.ids_per_token();
    (0..n)
        .filter(|&t| ids[t * per + li * cols] != engram::ROW_ID_DEAD)
        .count() as u64
        * cols as u64
}

/// A prefetch gathers its rows straight into pinned memory that the apply's
/// device copy reads (each prefetched row is copied once on the host), and
/// that memory is not written again while a copy queued from it may still
/// read it; rows read directly (no prefetch) go through the staging slots
/// under the same rule. Every golden regime's calls, each layer prefetched
/// two steps ahead of its apply, all applies queued on one non-blocking
/// stream with nothing waited for until the end: on the emulation with
/// deferred streams, queued copies run only when something waits for them,
/// so a prefetch that wrote into memory whose copy had not run yet would
/// give that step another step's rows. Each step's highway must be the bits
/// of the same step on a device table.
/// `engram_stage` gathers on the host from host row ids, so it cannot be
/// captured (docs/device-hash.md "In a graph", docs/cuda-streams.md): on a
/// capturing stream it is `ERR_INVALID_ARGUMENT` and stages nothing (an
/// apply with device ids then reports the rows as not staged). Emulation
/// only (an emulator of its own, whose streams say they capture).
#[test]
fn engram_stage_on_a_capturing_stream_is_refused_and_stages_nothing() {
    if emulated().is_none() {
        return;
    }
    let p = simt_library().expect("the SIMT library").expect("built");
    let emu = Emulator::load(&p).expect("load the SIMT library");
    let gpu: Arc<dyn Gpu> = emu.clone();
    let dev = Dev {
        gpu,
        emu: Some(emu.clone()),
    };
    let tiny = Tiny::load();
    let l = &tiny.layers[0];
    let w = dev_weights(&dev, l);
    let host = cuda_context(&dev, &tiny);
    host.set_layer(layer_with(l, TableSource::Memory(Region::of(&l.table)), &w))
        .unwrap();
    let null: *mut c_void = std::ptr::null_mut();
    let all = steps(&tiny);
    let (ids, n) = (&all[0].0, all[0].1);
    emu.set_capturing(true);
    let e = host.stage(l.layer_id, ids, n, null).unwrap_err();
    emu.set_capturing(false);
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("capturing"), "{}", e.message);
    let d_ids = dev.upload(ids);
    let hw_in = values("staged.capture", n * tiny.hc * tiny.d, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    host.apply_device(l.layer_id, RowIds::Device(d_ids.ptr), n, hw.ptr, 0, null)
        .expect("queued");
    let e = host.check_device(null).unwrap_err();
    assert!(e.message.contains("not staged"), "{}", e.message);
}

#[test]
fn prefetches_write_each_row_once_into_memory_no_queued_copy_reads() {
    let (dev, emu) = match real() {
        Some(d) => (d, None),
        None => {
            if emulated().is_none() {
                return;
            }
            // An emulator of its own: deferral is per emulator, and this
            // binary's tests run in parallel.
            let p = simt_library().expect("the SIMT library").expect("built");
            let emu = Emulator::load(&p).expect("load the SIMT library");
            let gpu: Arc<dyn Gpu> = emu.clone();
            (
                Dev {
                    gpu,
                    emu: Some(emu.clone()),
                },
                Some(emu),
            )
        }
    };
    let tiny = Tiny::load();
    let (hc, d, cols) = (tiny.hc, tiny.d, tiny.cols());
    let w: Vec<DevWeights> = tiny.layers.iter().map(|l| dev_weights(&dev, l)).collect();
    let host = cuda_context(&dev, &tiny);
    let on_device = cuda_context(&dev, &tiny);
    for (i, l) in tiny.layers.iter().enumerate() {
        host.set_layer(layer_with(
            l,
            TableSource::Memory(Region::of(&l.table)),
            &w[i],
        ))
        .unwrap();
        on_device
            .set_layer(layer_with(
                l,
                // SAFETY: a device buffer of the table's size.
                TableSource::Memory(unsafe { Region::from_raw(w[i].table.ptr as usize, None) }),
                &w[i],
            ))
            .unwrap();
    }
    let steps = all_regime_steps(&tiny);
    assert!(steps.len() > 2 * engram::cuda::STAGING_SLOTS);
    let dead_steps = steps
        .iter()
        .filter(|(ids, n)| {
            let per = host.ids_per_token();
            (0..*n).any(|t| ids[t * per] == engram::ROW_ID_DEAD)
        })
        .count();
    assert!(dead_steps > 0, "a step with dead tokens");
    let hw_in: Vec<Vec<f32>> = (0..steps.len())
        .map(|i| values(&format!("host.once.{i}"), steps[i].1 * hc * d, 1.0, 0.0))
        .collect();
    let stream = 0x7000 as *mut c_void; // a non-blocking stream of the emulation
    let stream = if dev.is_real() {
        std::ptr::null_mut()
    } else {
        stream
    };
    // The device table's bits, step by step, nothing deferred.
    let want: Vec<Vec<u32>> = steps
        .iter()
        .enumerate()
        .map(|(i, (ids, n))| {
            let hw = dev.upload(&hw_in[i]);
            for l in &tiny.layers {
                on_device
                    .apply_device(l.layer_id, RowIds::Host(ids), *n, hw.ptr, 0, stream)
                    .unwrap();
            }
            on_device.check_device(stream).unwrap();
            let v = hw.read::<f32>(hw_in[i].len()).unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        })
        .collect();
    for prefetched in [true, false] {
        let before = host.info().stage;
        let mut rows_prefetched = 0u64;
        let mut prefetch = |i: usize| {
            if let Some((ids, n)) = steps.get(i) {
                for (li, l) in tiny.layers.iter().enumerate() {
                    host.prefetch(l.layer_id, ids, *n).unwrap();
                    rows_prefetched += live_rows(&host, ids, *n, li, cols);
                }
            }
        };
        if let Some(e) = &emu {
            e.set_deferred(true);
        }
        if prefetched {
            prefetch(0);
            prefetch(1);
        }
        let hws: Vec<DevBuf> = hw_in.iter().map(|h| dev.upload(h)).collect();
        let mut rows_direct = 0u64;
        for (i, (ids, n)) in steps.iter().enumerate() {
            for (li, l) in tiny.layers.iter().enumerate() {
                host.apply_device(l.layer_id, RowIds::Host(ids), *n, hws[i].ptr, 0, stream)
                    .unwrap();
                rows_direct += live_rows(&host, ids, *n, li, cols);
            }
            if prefetched {
                // Into the memory the apply just queued a copy from.
                prefetch(i + 2);
            }
        }
        if let Some(e) = &emu {
            assert!(e.pending() > 0, "the applies' work is queued, not run");
        }
        host.check_device(stream).unwrap();
        if let Some(e) = &emu {
            e.set_deferred(false);
        }
        for (i, hw) in hws.iter().enumerate() {
            let got: Vec<u32> = hw
                .read::<f32>(hw_in[i].len())
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert!(
                got == want[i],
                "step {i} (prefetched: {prefetched}): the highway is not the device table's: \
                 pinned staging memory was overwritten before its copy ran, or wrong rows staged"
            );
        }
        let s = host.info().stage;
        let applies = (steps.len() * tiny.layers.len()) as u64;
        if prefetched {
            assert_eq!(s.staged - before.staged, applies, "{s:?}");
            assert_eq!(s.direct, before.direct, "{s:?}");
            assert_eq!(
                s.row_copies - before.row_copies,
                rows_prefetched,
                "each prefetched row is copied once on the host, by its gather: {s:?}"
            );
        } else {
            assert_eq!(s.direct - before.direct, applies, "{s:?}");
            assert_eq!(
                s.row_copies - before.row_copies,
                rows_direct,
                "each row read directly is copied once on the host: {s:?}"
            );
        }
    }
}
