//! The split points on the CUDA backend (docs/sharding.md): shard contexts
//! of the golden's tiny model on the device, the engine's device buffers,
//! worlds 1..5, each layout (row ranges summed in rank order, heads joined,
//! `wkv` output ranges joined), each projection path (the decode kernel,
//! the GEMV kernels, cuBLAS), a dead token in the step: the gathered rows
//! are the CPU backend's split calls' bits, `kv` and the highway the CUDA
//! backend's whole-layer `read_back` and `apply` bits; and bad input is
//! refused with nothing queued.
//!
//! On the GPU when there is one, else on the emulation (see
//! `tests/common/device.rs`); `ENGRAM_REQUIRE_GPU=1` requires the GPU.

mod common;

use common::device::{dev_model, device, Dev, DevWeights};
use common::*;
use engram::backend::DevValues;
use engram::cuda::gpu::DevBuf;
use engram::{Context, EngramBackend, EngramStatus, HighwayType, ShardSpec, SplitOut};

/// A CUDA context of the tiny model with both layers in device memory
/// (`bufs`), the projection chosen by `(gemv, decode)` limits.
fn cuda_ctx<'a>(
    dev: &Dev,
    tiny: &'a Tiny,
    bufs: &[DevWeights],
    lim: (Option<usize>, Option<usize>),
) -> Context<'a> {
    let mut cfg = tiny.config(Tiny::limits());
    cfg.backend = EngramBackend::Cuda as u32;
    (
        cfg.tuning.cuda.gemv_max_tokens,
        cfg.tuning.cuda.decode_max_tokens,
    ) = lim;
    cfg.tuning.cuda.device = Some(dev.gpu.clone());
    let ctx = Context::new(&cfg).expect("a CUDA context");
    for (l, w) in tiny.layers.iter().zip(bufs) {
        ctx.set_layer_device(&w.layer_in(l))
            .expect("set_layer_device");
    }
    ctx
}

fn vals(b: &DevBuf, len: usize, ty: HighwayType) -> DevValues {
    DevValues {
        ptr: b.ptr,
        len,
        ty,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const NULL: *mut std::ffi::c_void = std::ptr::null_mut();

#[test]
fn split_calls_on_the_device_give_the_whole_layers_bits() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let bufs = dev_model(&dev, &tiny);
    let (hd, heads, n1) = (tiny.hd, tiny.heads, tiny.ngram - 1);
    let (k_in, k_out) = (tiny.cols() * hd, tiny.d * (tiny.hc + 1));
    let lid = tiny.layers[0].layer_id;
    let nrows = tiny.layers[0].rows;
    let cpu = tiny.context();
    // The decode kernel (default), the GEMV kernels, cuBLAS.
    for lim in [(None, None), (Some(8), Some(0)), (Some(0), Some(0))] {
        let whole = cuda_ctx(&dev, &tiny, &bufs, lim);
        for n in [1usize, 5, 12] {
            let tokens: Vec<i32> = (0..n as i32)
                .map(|i| if i == 2 { -1 } else { i * 7 % 48 })
                .collect();
            let pos: Vec<i32> = (0..n as i32).collect();
            let mut ids = vec![0i64; n * whole.ids_per_token()];
            whole.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
            let x = values("cuda_shards highway", n * tiny.hc * tiny.d, 1.0, 0.0);
            let hw = dev.upload(&x);
            let r = engram::RowIds::Host(&ids);
            whole.apply_device(lid, r, n, hw.ptr, 0, NULL).unwrap();
            whole.check_device(NULL).unwrap();
            let want = bits(&hw.read::<f32>(x.len()).unwrap());
            let want_kv = whole.read_back(lid, r, n).unwrap().kv;
            let at = |what: &str, w: u32| format!("{lim:?}, {n} tokens, world {w}: {what}");
            for world in 1..=5u32 {
                let mut rows = vec![-0f32; n * k_in];
                let mut kv = vec![0u16; n * k_out];
                let mut by_heads = vec![vec![]; n];
                for rank in 0..world {
                    let ctx = cuda_ctx(&dev, &tiny, &bufs, lim);
                    ctx.set_shard(ShardSpec::new((rank, world), (rank, world)).unwrap())
                        .unwrap();
                    let held = ctx.layer_held(lid).unwrap();
                    let (r0, r1) = held.held_rows;
                    // Row ranges: the device part equals the CPU's.
                    let out = dev.alloc(n * k_in * 4);
                    let all_h = (0, heads);
                    let ov = vals(&out, n * k_in, HighwayType::F32);
                    ctx.gather_rows_device(lid, &ids, n, (r0, r1), all_h, ov, NULL)
                        .unwrap();
                    ctx.check_device(NULL).unwrap();
                    let part = out.read::<f32>(n * k_in).unwrap();
                    let mut cpu_part = vec![0f32; n * k_in];
                    let co = SplitOut::F32(&mut cpu_part);
                    cpu.gather_rows(lid, &ids, n, (r0, r1), all_h, co).unwrap();
                    assert_eq!(bits(&part), bits(&cpu_part), "{}", at("rows", world));
                    for (a, b) in rows.iter_mut().zip(&part) {
                        *a += *b;
                    }
                    // Heads: part `rank` of the heads, compacted, in bf16.
                    let (h0, h1) = engram_part(heads, rank, world);
                    if h0 < h1 {
                        let per = n1 * (h1 - h0) * hd;
                        let out = dev.alloc(n * per * 2);
                        let ov = vals(&out, n * per, HighwayType::Bf16);
                        whole
                            .gather_rows_device(lid, &ids, n, (0, nrows), (h0, h1), ov, NULL)
                            .unwrap();
                        let p = out.read::<u16>(n * per).unwrap();
                        for (t, v) in by_heads.iter_mut().enumerate() {
                            v.push((h0, h1, p[t * per..(t + 1) * per].to_vec()));
                        }
                    }
                    // wkv output ranges, from the whole rows (bf16 in, bf16 out).
                    let (o0, o1) = held.held_outs;
                    let full = dev.alloc(n * k_in * 2);
                    let fv = vals(&full, n * k_in, HighwayType::Bf16);
                    whole
                        .gather_rows_device(lid, &ids, n, (0, nrows), all_h, fv, NULL)
                        .unwrap();
                    let mine = dev.alloc(n * (o1 - o0) * 2 + 2);
                    let mv = vals(&mine, n * (o1 - o0), HighwayType::Bf16);
                    ctx.kv_columns_device(lid, n, fv, (o0, o1), mv, NULL)
                        .unwrap();
                    let m = mine.read::<u16>(n * (o1 - o0)).unwrap();
                    join_columns(&mut kv, k_out, (o0, o1), &m);
                }
                // The joined kv of the live tokens is read_back's.
                for t in (0..n).filter(|&t| t != 2) {
                    let s = t * k_out..(t + 1) * k_out;
                    assert_eq!(kv[s.clone()], want_kv[s], "{} token {t}", at("kv", world));
                }
                // Heads joined in head order are the whole rows.
                for (t, parts) in by_heads.iter().enumerate() {
                    for k in 0..n1 {
                        for (h0, h1, p) in parts {
                            let w = (h1 - h0) * hd;
                            let got = &p[k * w..(k + 1) * w];
                            let at_r = (t * n1 + k) * heads * hd + h0 * hd;
                            let r16: Vec<u16> = rows[at_r..at_r + w]
                                .iter()
                                .map(|v| (v.to_bits() >> 16) as u16)
                                .collect();
                            assert_eq!(got, &r16[..], "{} token {t}", at("heads", world));
                        }
                    }
                }
                let d_rows = dev.upload(&rows);
                let h1 = dev.upload(&x);
                let rv = vals(&d_rows, n * k_in, HighwayType::F32);
                whole
                    .gate_device(lid, &ids, n, rv, true, (h1.ptr, HighwayType::F32), NULL)
                    .unwrap();
                let d_kv = dev.upload(&kv);
                let h2 = dev.upload(&x);
                let kvv = vals(&d_kv, n * k_out, HighwayType::Bf16);
                whole
                    .gate_device(lid, &ids, n, kvv, false, (h2.ptr, HighwayType::F32), NULL)
                    .unwrap();
                whole.check_device(NULL).unwrap();
                let got = |b: &DevBuf| bits(&b.read::<f32>(x.len()).unwrap());
                assert_eq!(got(&h1), want, "{}", at("rows summed + apply_rows", world));
                assert_eq!(got(&h2), want, "{}", at("kv joined + gate_from_kv", world));
            }
        }
    }
}

/// Part `rank` of `world` of `0..total` (the library's rule).
fn engram_part(total: usize, rank: u32, world: u32) -> (usize, usize) {
    let at = |r: u32| total * r as usize / world as usize;
    (at(rank), at(rank + 1))
}

#[test]
fn bad_device_arguments_are_refused_with_nothing_queued() {
    let Some(dev) = device() else { return };
    let tiny = Tiny::load();
    let bufs = dev_model(&dev, &tiny);
    let (hd, heads) = (tiny.hd, tiny.heads);
    let k_in = tiny.cols() * hd;
    let lid = tiny.layers[0].layer_id;
    let ctx = cuda_ctx(&dev, &tiny, &bufs, (None, None));
    let n = 3;
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&[1, 2, 3], &[0; 3], &[0, 1, 2], &mut ids).unwrap();
    let out = dev.alloc(n * k_in * 4 + 4);
    let sentinel = vec![7u8; n * k_in * 4 + 4];
    out.write(&sentinel).unwrap();
    let all = (0, tiny.layers[0].rows);
    let status = |p: u64, len: usize, rows: (u64, u64)| {
        let v = DevValues {
            ptr: p,
            len,
            ty: HighwayType::F32,
        };
        ctx.gather_rows_device(lid, &ids, n, rows, (0, heads), v, NULL)
            .unwrap_err()
            .status
    };
    let len = n * k_in;
    // Misaligned, past the allocation, host memory, a wrong length, a range
    // out of the table.
    assert_eq!(
        status(out.ptr + 2, len, all),
        EngramStatus::ErrInvalidArgument
    );
    assert_ne!(status(out.ptr + 8, len, all), EngramStatus::Ok);
    let host = vec![0f32; len];
    assert_ne!(status(host.as_ptr() as u64, len, all), EngramStatus::Ok);
    assert_eq!(
        status(out.ptr, len - 1, all),
        EngramStatus::ErrInvalidArgument
    );
    assert_eq!(
        status(out.ptr, len, (0, all.1 + 1)),
        EngramStatus::ErrInvalidArgument
    );
    // A shard asked for rows or outputs it does not hold.
    let sh = cuda_ctx(&dev, &tiny, &bufs, (None, None));
    sh.set_shard(ShardSpec::new((1, 2), (1, 2)).unwrap())
        .unwrap();
    let v = vals(&out, len, HighwayType::F32);
    let e = sh
        .gather_rows_device(lid, &ids, n, all, (0, heads), v, NULL)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    let e = sh
        .kv_columns_device(lid, n, v, (0, 8), vals(&out, n * 8, HighwayType::F32), NULL)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    let e = sh
        .gate_device(lid, &ids, n, v, true, (out.ptr, HighwayType::F32), NULL)
        .unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    ctx.check_device(NULL).unwrap();
    assert_eq!(
        out.read::<u8>(sentinel.len()).unwrap(),
        sentinel,
        "nothing written"
    );
}
