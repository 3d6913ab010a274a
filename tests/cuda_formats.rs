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
use engram::RowIds;
use engram::{
    Context, ContextConfig, EngramBackend, EngramType, Geometry, HashTablesIn, LayerIn, Limits,
    Weights,
};
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
/// blocks, the others come from the golden filler (no NaN codes).
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
    let blocks: Vec<Vec<u8>> = g["formats"][name]["blocks"]
        .as_array()
        .unwrap()
        .iter()
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
