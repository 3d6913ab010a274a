//! Every table-row format gathered and dequantised on the GPU gives the same
//! bf16 bits as the CPU backend: fp8 e4m3 + e8m0, bf16, f16, f32 and the GGUF
//! blocks Q8_0, Q4_0, Q2_K .. Q6_K (rows built from the gguf-py oracle blocks
//! of `tests/golden/data/gguf_blocks.json`, edge cases included).
//!
//! Without a CUDA driver the test prints why and passes; `ENGRAM_REQUIRE_GPU=1`
//! (set by `scripts/gpu-check.sh`) makes that a failure.

mod common;

use common::*;
use cudarc::driver::sys;
use engram::cuda::driver::{DevBuf, Device};
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{
    Context, ContextConfig, EngramBackend, EngramType, Geometry, HashTablesIn, LayerIn, Limits,
    Weights,
};
use engram::{EngramStatus, RowIds};
use std::ffi::c_void;

const D: usize = 64;
const HC: usize = 4;
const HD: usize = 256;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

/// `rows` rows of `fmt` (Hd = 256): GGUF formats cycle through the oracle's
/// blocks whose values are finite in bf16 (the others are invalid data, see
/// `non_finite_rows_are_refused_alike`), the other formats come from the
/// golden filler (no NaN codes).
fn table(fmt: EngramType, rows: usize) -> Vec<u8> {
    let name = match fmt {
        EngramType::Q8_0 => "q8_0",
        EngramType::Q4_0 => "q4_0",
        EngramType::Q2_K => "q2_K",
        EngramType::Q3_K => "q3_K",
        EngramType::Q4_K => "q4_K",
        EngramType::Q5_K => "q5_K",
        EngramType::Q6_K => "q6_K",
        EngramType::Fp8E4m3E8m0 => return table_bytes("cuda.formats.fp8", "fp8", rows, HD, true),
        // Two arrays: tests/fp8_split.rs checks it on the GPU.
        EngramType::Fp8E4m3E8m0Split => unreachable!("the split fp8 format has its own test"),
        EngramType::Bf16 => return table_bytes("cuda.formats.bf16", "bf16", rows, HD, false),
        EngramType::F32 => return table_bytes("cuda.formats.f32", "f32", rows, HD, false),
        EngramType::F16 => {
            let f = Filler::new("cuda.formats.f16");
            return (0..(rows * HD) as u64)
                .flat_map(|i| {
                    half::f16::from_f32(f.value(i, 4.0, 0.0))
                        .to_bits()
                        .to_le_bytes()
                })
                .collect();
        }
    };
    let g = load_json("gguf_blocks.json");
    let finite = |b: &serde_json::Value| {
        b["f32"]
            .as_array()
            .unwrap()
            .iter()
            .all(|v| v.as_u64().unwrap() as u32 & 0x7fff_ffff < 0x7f7f_8000)
    };
    let blocks: Vec<Vec<u8>> = g["formats"][name]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| finite(b))
        .map(|b| unhex(b["bytes"].as_str().unwrap()))
        .collect();
    let rb = EngramType::row_format(fmt as u32, HD)
        .unwrap()
        .row_bytes(HD);
    let per_row = rb / blocks[0].len();
    (0..rows * per_row)
        .flat_map(|i| blocks[i % blocks.len()].clone())
        .collect()
}

fn gpu() -> Option<Device> {
    match engram::cuda::probe() {
        Ok(desc) => {
            println!("{desc}");
            Some(Device::open(0).expect("open device 0"))
        }
        Err(why) => {
            assert!(
                !std::env::var("ENGRAM_REQUIRE_GPU").is_ok_and(|v| v == "1"),
                "ENGRAM_REQUIRE_GPU=1 but: {why}"
            );
            eprintln!("SKIP: the CUDA format test: {why}");
            None
        }
    }
}

fn upload(dev: &Device, data: &[u8]) -> DevBuf {
    let b = DevBuf::new(dev.ctx, data.len(), "test data").expect("cuMemAlloc");
    // SAFETY: `b` holds `data.len()` bytes; the device's context is current.
    let r = unsafe { sys::cuMemcpyHtoD_v2(b.ptr, data.as_ptr() as *const c_void, data.len()) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "upload");
    b
}

#[test]
fn every_row_format_dequantises_to_the_cpu_bits_on_the_gpu() {
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let (heads, ngram) = (2usize, 3usize);
    let cols = (ngram - 1) * heads;
    let layer_ids = [1u32];
    let primes = derive_primes_uniform(1, ngram, heads, 100).unwrap();
    let offsets = derive_offsets(&primes, cols);
    let rows: u64 = primes.iter().sum();
    let mult: Vec<u64> = (0..ngram as u64)
        .map(|i| bits("cuda.formats.mult", i) | 1)
        .collect();
    let token_map: Vec<i32> = (0..48).collect();
    let cfg = |backend: EngramBackend| ContextConfig {
        geometry: Geometry {
            d: D,
            hc: HC,
            hd: HD,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: ngram,
            n_heads: heads,
            token_map: &token_map,
            pad_id: 2,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 64,
            max_seqs: 1,
            max_positions: 64,
        },
        n_threads: 1,
        backend: backend as u32,
        device: 0,
        tuning: Default::default(),
    };
    let wkv: Vec<u16> = values("cuda.formats.wkv", D * (HC + 1) * cols * HD, 0.0625, 0.0)
        .iter()
        .map(|&v| engram::formats::f32_to_bf16(v))
        .collect();
    let qk: Vec<f32> = values("cuda.formats.qk", HC * D, 0.125, 1.0);
    let wkv_bytes: Vec<u8> = wkv.iter().flat_map(|x| x.to_le_bytes()).collect();
    let qk_bytes: Vec<u8> = qk.iter().flat_map(|x| x.to_le_bytes()).collect();
    let (d_wkv, d_q, d_k) = (
        upload(&dev, &wkv_bytes),
        upload(&dev, &qk_bytes),
        upload(&dev, &qk_bytes),
    );
    let tokens: Vec<i32> = (0..40)
        .map(|i| (bits("cuda.formats.tokens", i) % 48) as i32)
        .collect();
    let pos: Vec<i32> = (0..40).collect();
    for fmt in [
        EngramType::Fp8E4m3E8m0,
        EngramType::Bf16,
        EngramType::F16,
        EngramType::F32,
        EngramType::Q8_0,
        EngramType::Q4_0,
        EngramType::Q2_K,
        EngramType::Q3_K,
        EngramType::Q4_K,
        EngramType::Q5_K,
        EngramType::Q6_K,
    ] {
        let t = table(fmt, rows as usize);
        let cpu = Context::new(&cfg(EngramBackend::Cpu)).unwrap();
        cpu.set_layer(LayerIn::host(
            1,
            &t,
            EngramType::row_format(fmt as u32, HD).unwrap(),
            rows,
            Weights::Bf16(&wkv),
            Weights::F32(&qk),
            Weights::F32(&qk),
        ))
        .unwrap();
        let d_table = upload(&dev, &t);
        let gpu_ctx = Context::new(&cfg(EngramBackend::Cuda)).expect("a CUDA context");
        gpu_ctx
            .set_layer_device(&DeviceLayerIn {
                layer_id: 1,
                table: d_table.ptr,
                table_rows: rows,
                table_type: fmt as u32,
                wkv: d_wkv.ptr,
                wkv_type: EngramType::Bf16 as u32,
                q: d_q.ptr,
                k: d_k.ptr,
                qk_type: EngramType::F32 as u32,
            })
            .unwrap();
        let n = tokens.len();
        let mut ids = vec![0i64; n * cpu.ids_per_token()];
        cpu.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
        let (rows_cpu, _) = cpu.stages(1, &ids, n).unwrap();
        let (rows_gpu, _) = gpu_ctx.stages_device(1, RowIds::Host(&ids), n).unwrap();
        assert_eq!(rows_cpu.len(), rows_gpu.len(), "{fmt:?}");
        for (i, (a, b)) in rows_cpu.iter().zip(&rows_gpu).enumerate() {
            assert_eq!(
                a,
                b,
                "{fmt:?}: value {i} (token {}, column {}): CPU {a:#06x}, GPU {b:#06x}",
                i / (cols * HD),
                i / HD % cols
            );
        }
        println!(
            "{fmt:?}: {} row values bit-identical on the GPU",
            rows_gpu.len()
        );
    }
}

/// A row whose values are not finite (a NaN or infinite GGUF scale, an fp8
/// scale that overflows) is refused by both backends with the same status
/// and message, naming the same element.
#[test]
fn non_finite_rows_are_refused_alike() {
    let Some(dev) = gpu() else { return };
    let _scope = dev.scope().unwrap();
    let (ngram, heads) = (2usize, 2usize);
    let cols = (ngram - 1) * heads;
    let primes = derive_primes_uniform(1, ngram, heads, 100).unwrap();
    let offsets = derive_offsets(&primes, cols);
    let rows: u64 = primes.iter().sum();
    let token_map: Vec<i32> = (0..48).collect();
    let mult = [1u64, 3];
    let cfg = |backend: EngramBackend| ContextConfig {
        geometry: Geometry {
            d: 64,
            hc: 1,
            hd: HD,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &[1],
            max_ngram: ngram,
            n_heads: heads,
            token_map: &token_map,
            pad_id: 0,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: 4,
            max_seqs: 1,
            max_positions: 8,
        },
        n_threads: 1,
        backend: backend as u32,
        device: 0,
        tuning: Default::default(),
    };
    let k_in = cols * HD;
    let wkv = vec![0u16; 2 * 64 * k_in];
    let qk = vec![1f32; 64];
    let bytes_of = |v: &[u8]| upload(&dev, v);
    let wkv_bytes: Vec<u8> = wkv.iter().flat_map(|x| x.to_le_bytes()).collect();
    let qk_bytes: Vec<u8> = qk.iter().flat_map(|x| x.to_le_bytes()).collect();
    let (d_wkv, d_qk) = (bytes_of(&wkv_bytes), bytes_of(&qk_bytes));
    // q8_0 rows of d = NaN at block 2 of row 5, and fp8 rows whose second
    // block's scale overflows at element 40 of row 7.
    let mut q8 = vec![0u8; rows as usize * 272];
    q8[5 * 272 + 2 * 34..][..2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let mut fp8 = vec![0x38u8; rows as usize * 264];
    for r in 0..rows as usize {
        fp8[r * 264 + 256..r * 264 + 264].fill(127);
    }
    fp8[7 * 264 + 256 + 1] = 254;
    fp8[7 * 264 + 40] = 0x48;
    for (fmt, t, row) in [
        (EngramType::Q8_0, q8, 5i64),
        (EngramType::Fp8E4m3E8m0, fp8, 7),
    ] {
        let cpu = Context::new(&cfg(EngramBackend::Cpu)).unwrap();
        cpu.set_layer(LayerIn::host(
            1,
            &t,
            fmt,
            rows,
            Weights::Bf16(&wkv),
            Weights::F32(&qk),
            Weights::F32(&qk),
        ))
        .unwrap();
        let d_table = upload(&dev, &t);
        let gpu_ctx = Context::new(&cfg(EngramBackend::Cuda)).expect("a CUDA context");
        gpu_ctx
            .set_layer_device(&DeviceLayerIn {
                layer_id: 1,
                table: d_table.ptr,
                table_rows: rows,
                table_type: fmt as u32,
                wkv: d_wkv.ptr,
                wkv_type: EngramType::Bf16 as u32,
                q: d_qk.ptr,
                k: d_qk.ptr,
                qk_type: EngramType::F32 as u32,
            })
            .unwrap();
        let ids = [0i64, row];
        let e_cpu = cpu.stages_device(1, RowIds::Host(&ids), 1).unwrap_err();
        let e_gpu = gpu_ctx.stages_device(1, RowIds::Host(&ids), 1).unwrap_err();
        assert_eq!(
            e_cpu.status,
            EngramStatus::ErrInvalidData,
            "{}",
            e_cpu.message
        );
        assert_eq!(e_gpu.status, e_cpu.status, "{fmt:?}: {}", e_gpu.message);
        assert!(
            e_gpu.message.starts_with(&e_cpu.message),
            "{fmt:?}: CPU '{}', GPU '{}'",
            e_cpu.message,
            e_gpu.message
        );
    }
}
