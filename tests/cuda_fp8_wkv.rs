//! The block-scaled fp8 `wkv` (`ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK`) on the CUDA
//! backend: `kv` bit for bit that of the same weights widened to bf16 and
//! given as `ENGRAM_TYPE_BF16`, for 1 ... 512 tokens, with the decode kernel
//! where the bf16 path runs it (by default up to 16 tokens; 64 with
//! `decode_max_tokens = 64`), and with it off the GEMV where the bf16 path
//! runs its GEMV (8 tokens with `gemv_max_tokens = 8`) and bf16 tiles +
//! cuBLAS elsewhere; codes and scales in device memory or host memory
//! (copied at `set_layer`); and `set_layer`'s refusal of a bad block, naming
//! it, with the layer left as it was.
//!
//! On the GPU when there is one, else on the emulation (see
//! `tests/common/device.rs`); `ENGRAM_REQUIRE_GPU=1` requires the GPU.

mod common;

use common::device::device;
use common::*;
use engram::formats::{f32_to_bf16, Fp8Blocks};
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::memory::Region;
use engram::{
    Context, ContextConfig, EngramBackend, EngramStatus, EngramType, Geometry, HashTablesIn,
    LayerIn, Limits, RowIds,
};

const HD: usize = 256;

#[test]
fn fp8_wkv_on_the_device_is_bit_identical_to_bf16() {
    let Some(dev) = device() else { return };
    let (heads, ngram) = (2usize, 3usize);
    let cols = (ngram - 1) * heads;
    let (d, hc) = (64usize, 4usize);
    let (k_in, k_out) = (cols * HD, d * (hc + 1));
    let primes = derive_primes_uniform(1, ngram, heads, 100).unwrap();
    let offsets = derive_offsets(&primes, cols);
    let rows: u64 = primes.iter().sum();
    let mult: Vec<u64> = (0..ngram as u64)
        .map(|i| bits("cuda.fp8wkv.mult", i) | 1)
        .collect();
    let token_map: Vec<i32> = (0..48).collect();
    let max_n = 512;
    let cfg = |gemv: Option<usize>, decode: Option<usize>| ContextConfig {
        geometry: Geometry {
            d,
            hc,
            hd: HD,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &[1],
            max_ngram: ngram,
            n_heads: heads,
            token_map: &token_map,
            pad_id: 2,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: max_n,
            max_seqs: 1,
            max_positions: max_n,
        },
        n_threads: 1,
        backend: EngramBackend::Cuda as u32,
        device: 0,
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                gemv_max_tokens: gemv,
                decode_max_tokens: decode,
                device: Some(dev.gpu.clone()),
            },
            ..Default::default()
        },
    };
    let table = table_bytes("cuda.fp8wkv.table", "bf16", rows as usize, HD, false);
    let qk: Vec<f32> = values("cuda.fp8wkv.qk", hc * d, 0.125, 1.0);
    // Codes: every e4m3 code but the NaN ones; scales around 1; the
    // checkpoint's 128 x 128 blocks, and blocks that are not whole chunks.
    let f = Filler::new("cuda.fp8wkv.codes");
    let codes: Vec<u8> = (0..k_out * k_in)
        .map(|i| f.bits(i as u64) as u8)
        .map(|c| if c & 0x7F == 0x7F { c ^ 1 } else { c })
        .collect();
    let (d_table, d_qk, d_codes) = (dev.upload(&table), dev.upload(&qk), dev.upload(&codes));
    let tokens: Vec<i32> = (0..max_n as u64)
        .map(|i| (bits("cuda.fp8wkv.tokens", i) % 48) as i32)
        .collect();
    let pos: Vec<i32> = (0..max_n as i32).collect();
    for (br, bc) in [(128usize, 128usize), (7, 20)] {
        let g = Filler::new(&format!("cuda.fp8wkv.scales.{br}x{bc}"));
        let scales: Vec<u8> = (0..k_out.div_ceil(br) * k_in.div_ceil(bc))
            .map(|i| 118 + (g.bits(i as u64) % 12) as u8)
            .collect();
        let w = Fp8Blocks::new(&codes, &scales, k_in, br, bc).unwrap();
        w.check().unwrap();
        let mut vals = vec![0f32; codes.len()];
        w.to_f32(0, &mut vals);
        let widened: Vec<u16> = vals.iter().map(|&x| f32_to_bf16(x)).collect();
        let (d_wide, d_scales) = (dev.upload(&widened), dev.upload(&scales));
        for (gemv, decode) in [
            (None, Some(0)),
            (Some(8), Some(0)),
            (None, None),
            (None, Some(64)),
        ] {
            let layer = |wkv: u64, ty: EngramType| {
                // SAFETY: device buffers of the sizes the geometry implies,
                // alive for the test.
                let r = |a: u64| unsafe { Region::from_raw(a as usize, None) };
                // SAFETY: as above.
                let mut l = unsafe {
                    LayerIn::raw(
                        1,
                        d_table.ptr,
                        EngramType::Bf16 as u32,
                        rows,
                        wkv,
                        ty as u32,
                        d_qk.ptr,
                        d_qk.ptr,
                        EngramType::F32 as u32,
                    )
                };
                if ty == EngramType::Fp8E4m3E8m0Block {
                    l.wkv_scales = Some(r(d_scales.ptr));
                    l.wkv_block = (br as u32, bc as u32);
                }
                l
            };
            let bf16 = Context::new(&cfg(gemv, decode)).expect("a CUDA context");
            bf16.set_layer(layer(d_wide.ptr, EngramType::Bf16)).unwrap();
            let fp8 = Context::new(&cfg(gemv, decode)).expect("a CUDA context");
            fp8.set_layer(layer(d_codes.ptr, EngramType::Fp8E4m3E8m0Block))
                .unwrap();
            // Codes and scales in host memory: copied to the device.
            let host = Context::new(&cfg(gemv, decode)).expect("a CUDA context");
            let mut hl = layer(d_codes.ptr, EngramType::Fp8E4m3E8m0Block);
            hl.wkv = Region::of(&codes[..]);
            hl.wkv_scales = Some(Region::of(&scales[..]));
            host.set_layer(hl).unwrap();
            for n in [1usize, 2, 7, 8, 48, 64, 512] {
                let mut ids = vec![0i64; n * bf16.ids_per_token()];
                bf16.hash(&tokens[..n], &vec![0; n], &pos[..n], &mut ids)
                    .unwrap();
                let (rows_a, kv_a) = bf16.stages(1, &ids, n).unwrap();
                let (rows_b, kv_b) = fp8.stages(1, &ids, n).unwrap();
                let (_, kv_c) = host.stages(1, &ids, n).unwrap();
                assert_eq!(rows_a, rows_b);
                let path = match (gemv, decode) {
                    (_, None) if n <= engram::cuda::DEFAULT_DECODE_MAX_TOKENS => "decode",
                    (_, Some(d)) if n <= d => "decode",
                    (Some(g), _) if n <= g => "GEMV",
                    (None, _) if n <= engram::cuda::DEFAULT_GEMV_MAX_TOKENS_BF16 => "GEMV",
                    _ => "tiles + cuBLAS",
                };
                assert!(
                    kv_a == kv_b && kv_a == kv_c,
                    "blocks {br} x {bc}, {n} tokens ({path}): fp8 kv differs from the bf16 path's"
                );
                // The whole apply (the decode kernel's gate too): the same
                // highway bits.
                let hw_in = values("cuda.fp8wkv.highway", n * hc * d, 1.0, 0.0);
                let (hw_a, hw_b) = (dev.upload(&hw_in), dev.upload(&hw_in));
                let null = std::ptr::null_mut();
                bf16.apply_device(1, RowIds::Host(&ids), n, hw_a.ptr, 0, null)
                    .unwrap();
                fp8.apply_device(1, RowIds::Host(&ids), n, hw_b.ptr, 0, null)
                    .unwrap();
                bf16.check_device(null).unwrap();
                fp8.check_device(null).unwrap();
                let bits = |b: &engram::cuda::gpu::DevBuf| -> Vec<u32> {
                    b.read::<f32>(n * hc * d)
                        .unwrap()
                        .iter()
                        .map(|x| x.to_bits())
                        .collect()
                };
                assert!(
                    bits(&hw_a) == bits(&hw_b),
                    "blocks {br} x {bc}, {n} tokens ({path}): the fp8 apply's highway differs from the bf16 one's"
                );
            }
        }
    }
    if let Some(e) = &dev.emu {
        let l = e.launches();
        for k in [
            "engram_gemv_fp8_block",
            "engram_dequant_fp8_block",
            "engram_decode_fp8",
        ] {
            assert!(l.contains_key(k), "{k} ran");
        }
    }
    // A NaN code in block (1, 2) and an overflowing block (2, 0) after it:
    // refused naming the first, nothing changes.
    let (br, bc) = (128usize, 128usize);
    let scales = vec![127u8; k_out.div_ceil(br) * k_in.div_ceil(bc)];
    let mut bad = codes.clone();
    bad[(br + 5) * k_in + 2 * bc + 9] = 0xFF;
    let mut bad_scales = scales.clone();
    bad_scales[2 * k_in.div_ceil(bc)] = 254;
    let (d_bad, d_bad_scales, d_scales) = (
        dev.upload(&bad),
        dev.upload(&bad_scales),
        dev.upload(&scales),
    );
    let ctx = Context::new(&cfg(None, None)).expect("a CUDA context");
    // SAFETY: as above.
    let r = |a: u64| unsafe { Region::from_raw(a as usize, None) };
    let mk = |codes: u64, scales: u64| {
        // SAFETY: as above.
        let mut l = unsafe {
            LayerIn::raw(
                1,
                d_table.ptr,
                EngramType::Bf16 as u32,
                rows,
                codes,
                EngramType::Fp8E4m3E8m0Block as u32,
                d_qk.ptr,
                d_qk.ptr,
                EngramType::F32 as u32,
            )
        };
        l.wkv_scales = Some(r(scales));
        l.wkv_block = (br as u32, bc as u32);
        l
    };
    ctx.set_layer(mk(d_codes.ptr, d_scales.ptr)).unwrap();
    let n = 4;
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&tokens[..n], &[0; 4], &pos[..n], &mut ids)
        .unwrap();
    let before = ctx.stages(1, &ids, n).unwrap();
    let e = ctx.set_layer(mk(d_bad.ptr, d_bad_scales.ptr)).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
    assert!(
        e.message
            .contains("fp8 block (1, 2) (rows 128..256, columns 256..384)")
            && e.message.contains(&format!(
                "element ({}, {}) is an e4m3 NaN code",
                br + 5,
                2 * bc + 9
            )),
        "{}",
        e.message
    );
    let e = ctx
        .set_layer(mk(d_codes.ptr, d_bad_scales.ptr))
        .unwrap_err();
    assert!(
        e.message.contains("fp8 block (2, 0)") && e.message.contains("overflows"),
        "{}",
        e.message
    );
    assert_eq!(
        ctx.stages(1, &ids, n).unwrap(),
        before,
        "a refused set_layer changes nothing"
    );
}
