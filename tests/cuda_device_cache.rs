//! The device row cache of host tables on the CUDA backend
//! (`device_cache_bytes`, docs/row-cache.md "Device tier"): hot rows stay
//! in device memory and a call copies only the misses. Checked here:
//!
//! - the rows and `kv` (read back) and the highway are the bits of the same
//!   table in device memory and of the uncached host table, over many steps
//!   with repeats, dead tokens, in-step duplicates and evictions, for every
//!   policy and for caches of 1, 3 and 40 rows (which evict on nearly every
//!   call) and one that holds everything, tables in host memory and in a
//!   file, prefetched or not;
//! - the counts (lookups, hits, misses, evictions, bytes copied) equal what
//!   the policy predicts for a hand-made id sequence;
//! - `engram_stage` then device row ids (a graph replay) read hits from the
//!   cache, and a row neither cached nor staged is reported;
//! - a budget the device cannot give is `ERR_CAPACITY` at set_layer, with
//!   nothing kept.
//!
//! On the GPU when there is one, else on the emulation (`tests/common/device.rs`).

mod common;

use common::device::{dev_model, device, skip, Dev, DevWeights};
use common::*;
use engram::backend::{TableIn, TableSource};
use engram::cuda::gpu::DevBuf;
use engram::memory::Region;
use engram::rowcache::policy::{new_policy, PolicyKind};
use engram::{Context, DeviceCacheStats, EngramBackend, EngramStatus, LayerIn, RowIds};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// A CUDA context of the tiny model on `dev` with `cache` bytes of device
/// cache a layer (0: none), no layers set.
fn cuda_context<'a>(dev: &Dev, tiny: &'a Tiny, cache: u64, policy: PolicyKind) -> Context<'a> {
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    Context::new(&cfg)
        .and_then(|c| c.with_device_cache_policy(cache, policy))
        .expect("create a CUDA context")
}

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

fn device_source(w: &DevWeights) -> TableSource<'static> {
    // SAFETY: a device buffer of the table's size, alive for the test.
    TableSource::Memory(unsafe { Region::from_raw(w.table.ptr as usize, None) })
}

/// Steps of row ids `[n, n_layers, C]` for the tiny model: ids drawn from a
/// skewed set (a few hot rows, many cold ones), some repeated within a token
/// and across tokens, every seventh token dead, `n` from 1 to 40.
fn skewed_steps(tiny: &Tiny, count: usize, seed: &str) -> Vec<(Vec<i64>, usize)> {
    let f = Filler::new(seed);
    let (cols, nl) = (tiny.cols(), tiny.layers.len());
    let mut k = 0u64;
    let mut next = || {
        k += 1;
        f.bits(k)
    };
    (0..count)
        .map(|s| {
            let n = [1usize, 3, 8, 40, 2, 16][s % 6];
            let mut ids = vec![0i64; n * nl * cols];
            for t in 0..n {
                for (li, l) in tiny.layers.iter().enumerate() {
                    for c in 0..cols {
                        let r = next();
                        let id = match r % 8 {
                            0..=4 => r / 8 % 6,  // hot
                            5 | 6 => r / 8 % 60, // warm
                            _ => r / 8 % l.rows, // cold
                        };
                        let dead = (s * 40 + t) % 7 == 6;
                        ids[(t * nl + li) * cols + c] = if dead { -1 } else { id as i64 };
                    }
                }
            }
            (ids, n)
        })
        .collect()
}

/// Apply both layers to a fresh f32 highway of `n` tokens; return its bits.
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
fn cached_rows_are_the_device_tables_and_the_uncached_tables_bits() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w = dev_model(&dev, &tiny);
    let dir = std::env::temp_dir().join(format!("engram-devcache-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tables.bin");
    let mut bytes = vec![0x5Au8; 7];
    let mut at = Vec::new();
    for l in &tiny.layers {
        at.push(bytes.len() as u64);
        bytes.extend_from_slice(&l.table);
    }
    std::fs::write(&path, &bytes).unwrap();
    let file = Arc::new(std::fs::File::open(&path).unwrap());
    let on_device = cuda_context(&dev, &tiny, 0, PolicyKind::Lru);
    let uncached = cuda_context(&dev, &tiny, 0, PolicyKind::Lru);
    for (i, l) in tiny.layers.iter().enumerate() {
        on_device
            .set_layer(layer_with(l, device_source(&w[i]), &w[i]))
            .unwrap();
        uncached
            .set_layer(layer_with(
                l,
                TableSource::Memory(Region::of(&l.table)),
                &w[i],
            ))
            .unwrap();
    }
    // Caches of 1, 3 and 40 rows of the larger row (bf16: 128 bytes), and
    // one that holds both tables whole; each policy; memory and file.
    let rb_max = 2 * tiny.hd as u64;
    let mut cached = Vec::new();
    for (ci, rows) in [1u64, 3, 40, 600].into_iter().enumerate() {
        let policy = PolicyKind::ALL[ci % 3];
        for in_file in [false, true] {
            let ctx = cuda_context(&dev, &tiny, rows * rb_max, policy);
            for (i, l) in tiny.layers.iter().enumerate() {
                let src = if in_file {
                    TableSource::File {
                        file: file.clone(),
                        offset: at[i],
                    }
                } else {
                    TableSource::Memory(Region::of(&l.table))
                };
                ctx.set_layer(layer_with(l, src, &w[i])).unwrap();
            }
            cached.push((
                ctx,
                format!("{rows} rows, {}, file {in_file}", policy.name()),
            ));
        }
    }
    for (si, (ids, n)) in skewed_steps(&tiny, 24, "devcache.bits").iter().enumerate() {
        let name = format!("devcache.step{si}");
        let want = run_step(&dev, &on_device, &tiny, RowIds::Host(ids), *n, &name);
        assert!(
            run_step(&dev, &uncached, &tiny, RowIds::Host(ids), *n, &name) == want,
            "step {si}: the uncached host table"
        );
        for (ctx, what) in &cached {
            if si % 3 == 0 {
                for l in &tiny.layers {
                    ctx.prefetch(l.layer_id, ids, *n).unwrap();
                }
            }
            let got = run_step(&dev, ctx, &tiny, RowIds::Host(ids), *n, &name);
            assert!(got == want, "step {si}: the highway, cache of {what}");
            if si % 4 == 1 {
                for l in &tiny.layers {
                    assert_eq!(
                        ctx.stages_device(l.layer_id, RowIds::Host(ids), *n)
                            .unwrap(),
                        on_device
                            .stages_device(l.layer_id, RowIds::Host(ids), *n)
                            .unwrap(),
                        "step {si} layer {}: rows and kv, cache of {what}",
                        l.layer_id
                    );
                }
            }
        }
    }
    for (ctx, what) in &cached {
        for l in &tiny.layers {
            let s = ctx
                .device_cache_stats(l.layer_id)
                .unwrap()
                .expect("a device cache");
            assert!(s.hits > 0 && s.misses > 0, "{what}: {s:?}");
            assert_eq!(s.lookups, s.hits + s.misses, "{what}");
            if s.capacity_rows < 100 {
                assert!(s.evictions > 0, "{what}: a small cache evicts: {s:?}");
            } else {
                assert_eq!(
                    s.evictions, 0,
                    "{what}: a cache larger than the table: {s:?}"
                );
            }
        }
        assert!(ctx.info().stage.staged > 0, "{what}: prefetches served");
    }
    assert_eq!(
        uncached.device_cache_stats(tiny.layer_ids[0]).unwrap(),
        None
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// What the cache should count for `steps` (ids of layer `li`, `cols` a
/// token, `per` a token in all), replaying the policy as the backend uses
/// it: per call, each distinct live id once, in order of first appearance;
/// a hit whose slot a later miss of the call takes over is copied too.
fn predict(
    kind: PolicyKind,
    cap: usize,
    steps: &[(Vec<i64>, usize)],
    li: usize,
    cols: usize,
    per: usize,
    rb: u64,
) -> DeviceCacheStats {
    let mut p = new_policy(kind, cap).unwrap();
    let mut s = DeviceCacheStats {
        policy: kind,
        capacity_rows: cap as u64,
        ..Default::default()
    };
    for (ids, n) in steps {
        let mut seen: HashMap<u64, bool> = HashMap::new(); // id -> hit in this call
        for t in 0..*n {
            let tid = &ids[t * per + li * cols..t * per + (li + 1) * cols];
            if tid.iter().all(|&x| x == -1) {
                continue;
            }
            for &id in tid {
                let id = id as u64;
                if seen.contains_key(&id) {
                    continue;
                }
                s.lookups += 1;
                if p.lookup(id).is_some() {
                    s.hits += 1;
                    seen.insert(id, true);
                    continue;
                }
                s.misses += 1;
                s.bytes_h2d += rb;
                seen.insert(id, false);
                if let Some((_, Some(old))) = p.admit(id) {
                    s.evictions += 1;
                    if seen.get(&old) == Some(&true) {
                        seen.insert(old, false);
                        s.bytes_h2d += rb;
                    }
                }
            }
        }
    }
    s
}

#[test]
fn hits_and_misses_are_what_the_policy_predicts() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w = dev_model(&dev, &tiny);
    let (cols, per) = (tiny.cols(), tiny.cols() * tiny.layers.len());
    // A hand-made sequence: a hot row in every call, rows coming back after
    // being evicted, duplicates within a call, a dead token.
    // A row that hits and is then evicted by a miss of the same call (5 in
    // the second and third calls with 1 slot) is copied like a miss.
    let rows: [&[i64]; 11] = [
        &[5, 5, 5, 5],
        &[5, 30, 31, 32],
        &[31, 5, 40, 41, 42, 43, 44, 45],
        &[1, 2, 3, 4, 1, 2, 5, 6],
        &[1, 7, 8, 9, -1, -1, -1, -1],
        &[2, 3, 4, 5, 1, 1, 1, 1],
        &[10, 11, 12, 13, 14, 15, 16, 1],
        &[2, 3, 4, 5, 6, 7, 8, 9],
        &[1, 2, 1, 2, 1, 2, 1, 2],
        &[20, 21, 22, 23, 3, 4, 5, 6],
        &[9, 8, 7, 6, 5, 4, 3, 2],
    ];
    let steps: Vec<(Vec<i64>, usize)> = rows
        .iter()
        .map(|r| {
            let n = r.len() / cols;
            let mut ids = vec![0i64; n * per];
            for t in 0..n {
                for li in 0..tiny.layers.len() {
                    for c in 0..cols {
                        ids[t * per + li * cols + c] = r[t * cols + c];
                    }
                }
            }
            (ids, n)
        })
        .collect();
    let mut taken_over = 0;
    for kind in PolicyKind::ALL {
        for cap in [1usize, 3, 5, 8, 64] {
            let l = &tiny.layers[1]; // bf16 rows of 2 * Hd bytes
            let rb = 2 * tiny.hd;
            let ctx = cuda_context(&dev, &tiny, (cap * rb) as u64 + 1, kind);
            for (i, l) in tiny.layers.iter().enumerate() {
                ctx.set_layer(layer_with(
                    l,
                    TableSource::Memory(Region::of(&l.table)),
                    &w[i],
                ))
                .unwrap();
            }
            let hw_in = values("devcache.counts", 2 * tiny.hc * tiny.d, 1.0, 0.0);
            let hw = dev.upload(&hw_in);
            for (ids, n) in &steps {
                ctx.apply_device(
                    l.layer_id,
                    RowIds::Host(ids),
                    *n,
                    hw.ptr,
                    0,
                    std::ptr::null_mut(),
                )
                .unwrap();
            }
            ctx.check_device(std::ptr::null_mut()).unwrap();
            let got = ctx.device_cache_stats(l.layer_id).unwrap().unwrap();
            let want = predict(kind, cap, &steps, 1, cols, per, rb as u64);
            assert_eq!(got, want, "{} over {cap} rows", kind.name());
            // The same counts as the C ABI's device tier, and reset there.
            let li = tiny.layers.iter().position(|x| x.layer_id == l.layer_id);
            let tier = |ctx: &engram::Context| {
                ctx.cache_stats(li.unwrap(), engram::rowcache::Tier::Device)
                    .unwrap()
            };
            let t = tier(&ctx);
            assert_eq!(
                (t.lookups, t.hits, t.misses, t.bytes_read, t.evictions),
                (
                    got.lookups,
                    got.hits,
                    got.misses,
                    got.bytes_h2d,
                    got.evictions
                )
            );
            assert_eq!((t.capacity_rows, t.policy), (got.capacity_rows, Some(kind)));
            ctx.cache_stats_reset();
            assert_eq!(
                (tier(&ctx).lookups, tier(&ctx).capacity_rows),
                (0, got.capacity_rows)
            );
            taken_over += (got.bytes_h2d > got.misses * rb as u64) as usize;
            // The other layer was never applied.
            let other = ctx
                .device_cache_stats(tiny.layers[0].layer_id)
                .unwrap()
                .unwrap();
            assert_eq!(other.lookups, 0);
        }
    }
    assert!(
        taken_over > 0,
        "some call's hit was taken over by its own miss"
    );
}

#[test]
fn staged_device_ids_read_hits_from_the_cache_and_unstaged_rows_are_reported() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w = dev_model(&dev, &tiny);
    let on_device = cuda_context(&dev, &tiny, 0, PolicyKind::Lru);
    let host = cuda_context(&dev, &tiny, 5 * 2 * tiny.hd as u64, PolicyKind::S3Fifo);
    for (i, l) in tiny.layers.iter().enumerate() {
        on_device
            .set_layer(layer_with(l, device_source(&w[i]), &w[i]))
            .unwrap();
        host.set_layer(layer_with(
            l,
            TableSource::Memory(Region::of(&l.table)),
            &w[i],
        ))
        .unwrap();
    }
    let null: *mut c_void = std::ptr::null_mut();
    let steps = skewed_steps(&tiny, 24, "devcache.staged");
    // One device buffer of ids, as a captured graph reads: rewritten per step.
    let d_ids = dev.alloc(40 * tiny.cols() * tiny.layers.len() * 8);
    for (si, (ids, n)) in steps.iter().enumerate() {
        d_ids.write(ids).unwrap();
        for l in &tiny.layers {
            host.stage(l.layer_id, ids, *n, null).unwrap();
        }
        let name = format!("devcache.staged{si}");
        let got = run_step(&dev, &host, &tiny, RowIds::Device(d_ids.ptr), *n, &name);
        let want = run_step(
            &dev,
            &on_device,
            &tiny,
            RowIds::Device(d_ids.ptr),
            *n,
            &name,
        );
        assert!(
            got == want,
            "step {si}: staged through the cache, the device table's bits"
        );
    }
    let s = host
        .device_cache_stats(tiny.layers[1].layer_id)
        .unwrap()
        .unwrap();
    assert!(s.hits > 0 && s.evictions > 0, "{s:?}");
    assert!(
        s.bytes_h2d < s.lookups * 2 * tiny.hd as u64,
        "hits are not copied: {s:?}"
    );
    // The next step's ids without engram_stage: the rows it did not stage
    // (cached or not) are reported, the highway left alone.
    let (ids, n) = &skewed_steps(&tiny, 40, "devcache.unstaged")[39];
    d_ids.write(ids).unwrap();
    let hw_in = values("devcache.unstaged", n * tiny.hc * tiny.d, 1.0, 0.0);
    let hw = dev.upload(&hw_in);
    let lid = tiny.layers[1].layer_id;
    host.apply_device(lid, RowIds::Device(d_ids.ptr), *n, hw.ptr, 0, null)
        .expect("queued");
    let e = host.check_device(null).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("not staged"), "{}", e.message);
}

#[test]
fn a_budget_the_device_cannot_give_is_err_capacity_and_nothing_is_kept() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let w = dev_model(&dev, &tiny);
    for budget in [u64::MAX, 1u64 << 50] {
        let ctx = cuda_context(&dev, &tiny, budget, PolicyKind::Lru);
        let (dev_bytes, pinned) = (ctx.info().device_bytes, ctx.info().host_bytes);
        let l = &tiny.layers[0];
        let e = ctx
            .set_layer(layer_with(
                l,
                TableSource::Memory(Region::of(&l.table)),
                &w[0],
            ))
            .unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrCapacity, "{}", e.message);
        assert!(e.message.contains("device_cache_bytes"), "{}", e.message);
        assert_eq!(ctx.info().device_bytes, dev_bytes, "no device memory kept");
        assert_eq!(ctx.info().host_bytes, pinned, "no pinned memory kept");
        assert_eq!(ctx.device_cache_stats(l.layer_id).unwrap(), None);
        // A device table needs no cache: the budget is not used.
        ctx.set_layer(layer_with(l, device_source(&w[0]), &w[0]))
            .unwrap();
    }
    // Chosen at create only: not once a layer is set.
    let ctx = cuda_context(&dev, &tiny, 0, PolicyKind::Lru);
    let l = &tiny.layers[0];
    ctx.set_layer(layer_with(l, device_source(&w[0]), &w[0]))
        .unwrap();
    let e = ctx
        .with_device_cache(1 << 20)
        .err()
        .expect("refused after set_layer");
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
}

#[test]
fn a_gguf_model_on_cuda_takes_the_budget_and_keeps_its_bits() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let path = golden_dir().join("tiny.gguf");
    let m = engram::gguf::GgufModel::open(&path, &engram::gguf::LoadOptions::default()).unwrap();
    let mut tuning = engram::Tuning::default();
    tuning.cuda.device = Some(dev.gpu.clone());
    let o = engram::gguf::GgufOptions {
        limits: Tiny::limits(),
        n_threads: 2,
        backend: EngramBackend::Cuda as u32,
        device: 0,
        eps: tiny.eps,
        tuning,
        row_cache_bytes: 0,
    };
    let plain = m.context(&o).unwrap();
    let cached = m.context_with_cache(&o, 4 * 2 * tiny.hd as u64).unwrap();
    for (si, (ids, n)) in skewed_steps(&tiny, 12, "devcache.gguf").iter().enumerate() {
        let name = format!("devcache.gguf{si}");
        let want = run_step(&dev, &plain, &tiny, RowIds::Host(ids), *n, &name);
        let got = run_step(&dev, &cached, &tiny, RowIds::Host(ids), *n, &name);
        assert!(
            got == want,
            "step {si}: the GGUF model's tables through a 4-row cache"
        );
    }
    for l in &tiny.layers {
        assert_eq!(plain.device_cache_stats(l.layer_id).unwrap(), None);
        let s = cached
            .device_cache_stats(l.layer_id)
            .unwrap()
            .expect("a cache");
        assert!(s.hits > 0 && s.evictions > 0, "layer {}: {s:?}", l.layer_id);
    }
}

/// On the emulation with every copy and kernel deferred until something
/// waits (`Emulator::set_deferred`), calls alternating between two
/// non-blocking streams, prefetched or not, checked only at the end: a
/// call's fills must wait for the earlier calls' kernels (the context orders
/// its calls across streams) and its pinned slot indices and admissions must
/// not be rewritten before their copies ran, or a highway differs from the
/// device table's.
#[test]
fn deferred_work_on_two_streams_keeps_the_bits() {
    let Some(dev) = device() else { return };
    let Some(emu) = dev.emu.clone() else {
        skip("the deferral is the emulation's (a GPU runs the other tests)");
        return;
    };
    let tiny = Tiny::load();
    let w = dev_model(&dev, &tiny);
    let on_device = cuda_context(&dev, &tiny, 0, PolicyKind::Lru);
    let host = cuda_context(&dev, &tiny, 3 * 2 * tiny.hd as u64, PolicyKind::Clock);
    for (i, l) in tiny.layers.iter().enumerate() {
        on_device
            .set_layer(layer_with(l, device_source(&w[i]), &w[i]))
            .unwrap();
        host.set_layer(layer_with(
            l,
            TableSource::Memory(Region::of(&l.table)),
            &w[i],
        ))
        .unwrap();
    }
    let steps = skewed_steps(&tiny, 14, "devcache.deferred");
    let hw_in: Vec<Vec<f32>> = steps
        .iter()
        .enumerate()
        .map(|(i, (_, n))| {
            values(
                &format!("devcache.deferred{i}"),
                n * tiny.hc * tiny.d,
                1.0,
                0.0,
            )
        })
        .collect();
    let want: Vec<Vec<u32>> = steps
        .iter()
        .enumerate()
        .map(|(i, (ids, n))| {
            let hw = dev.upload(&hw_in[i]);
            for l in &tiny.layers {
                on_device
                    .apply_device(
                        l.layer_id,
                        RowIds::Host(ids),
                        *n,
                        hw.ptr,
                        0,
                        std::ptr::null_mut(),
                    )
                    .unwrap();
            }
            on_device.check_device(std::ptr::null_mut()).unwrap();
            hw.read::<f32>(hw_in[i].len())
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        })
        .collect();
    let streams = [0x7100 as *mut c_void, 0x7200 as *mut c_void];
    let hws: Vec<DevBuf> = hw_in.iter().map(|h| dev.upload(h)).collect();
    emu.set_deferred(true);
    for (i, (ids, n)) in steps.iter().enumerate() {
        if i % 2 == 0 {
            for l in &tiny.layers {
                host.prefetch(l.layer_id, ids, *n).unwrap();
            }
        }
        for l in &tiny.layers {
            host.apply_device(
                l.layer_id,
                RowIds::Host(ids),
                *n,
                hws[i].ptr,
                0,
                streams[i % 2],
            )
            .unwrap();
        }
    }
    host.check_device(streams[(steps.len() - 1) % 2]).unwrap();
    host.check_device(streams[steps.len() % 2]).unwrap();
    emu.set_deferred(false);
    for (i, hw) in hws.iter().enumerate() {
        let got: Vec<u32> = hw
            .read::<f32>(hw_in[i].len())
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert!(
            got == want[i],
            "step {i}: deferred, two streams, through a 3-row cache"
        );
    }
    let s = host
        .device_cache_stats(tiny.layers[1].layer_id)
        .unwrap()
        .unwrap();
    assert!(s.hits > 0 && s.evictions > 0, "{s:?}");
}
