//! Every format on the CUDA backend against the CPU backend:
//!
//! - table rows: fp8 e4m3 + e8m0, bf16, f16, f32 and the GGUF blocks Q8_0,
//!   Q4_0, Q2_K .. Q6_K (rows built from the gguf-py oracle blocks of
//!   `tests/golden/data/gguf_blocks.json`, edge cases included) gathered and
//!   dequantised to the same bf16 bits; rows that are not finite refused
//!   alike;
//! - `wkv`: f16 and the GGUF blocks read in place, through the fused GEMV
//!   (up to 8 tokens) and through bf16 tiles and cuBLAS (more), each within
//!   a stated bound of the CPU backend's quantised path.
//!
//! On the GPU when there is one, else on the emulation (see
//! `tests/common/device.rs`); `ENGRAM_REQUIRE_GPU=1` requires the GPU.

mod common;

use common::bounds::{ulp_bf16, U};
use common::device::{device, Dev};
use common::*;
use engram::cuda::gpu::DevBuf;
use engram::formats::{bf16_to_f32, dequant_row_f32, f32_to_bf16};
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{
    Context, ContextConfig, EngramBackend, EngramType, Geometry, HashTablesIn, LayerIn, Limits,
    Weights,
};
use engram::{EngramStatus, RowIds};

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
        EngramType::Fp8E4m3E8m0Block => unreachable!("a wkv format only: tests/cuda_fp8_wkv.rs"),
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
    let blocks = oracle_blocks(name);
    let rb = EngramType::row_format(fmt as u32, HD)
        .unwrap()
        .row_bytes(HD);
    let per_row = rb / blocks[0].len();
    (0..rows * per_row)
        .flat_map(|i| blocks[i % blocks.len()].clone())
        .collect()
}

/// The gguf-py oracle's blocks of format `name` whose values are finite in bf16.
fn oracle_blocks(name: &str) -> Vec<Vec<u8>> {
    let g = load_json("gguf_blocks.json");
    // "f32": each value's bit pattern as 8 hex digits.
    let finite = |b: &serde_json::Value| {
        let h = b["f32"].as_str().unwrap();
        (0..h.len() / 8).all(|i| {
            u32::from_str_radix(&h[8 * i..8 * i + 8], 16).unwrap() & 0x7fff_ffff < 0x7f7f_8000
        })
    };
    g["formats"][name]["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| finite(b))
        .map(|b| unhex(b["bytes"].as_str().unwrap()))
        .collect()
}

fn upload(dev: &Dev, data: &[u8]) -> DevBuf {
    dev.upload(data)
}

#[test]
fn every_row_format_dequantises_to_the_cpu_bits_on_the_device() {
    let Some(dev) = device() else { return };
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
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                device: Some(dev.gpu.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
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
        let n = tokens.len();
        let mut ids = vec![0i64; n * cpu.ids_per_token()];
        cpu.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
        let (rows_cpu, _) = cpu.stages(1, &ids, n).unwrap();
        // The table at its allocation's start (every row 16-byte aligned
        // for bf16, f16, f32, 8-byte for fp8: the gather's vector loads),
        // and 2 bytes past it (no row aligned: a value per lane at a time).
        for off in [0usize, 2] {
            let mut padded = vec![0xEEu8; off];
            padded.extend_from_slice(&t);
            let d_table = upload(&dev, &padded);
            let gpu_ctx = Context::new(&cfg(EngramBackend::Cuda)).expect("a CUDA context");
            gpu_ctx
                .set_layer_device(&DeviceLayerIn {
                    layer_id: 1,
                    table: d_table.ptr + off as u64,
                    table_rows: rows,
                    table_type: fmt as u32,
                    wkv: d_wkv.ptr,
                    wkv_type: EngramType::Bf16 as u32,
                    q: d_q.ptr,
                    k: d_k.ptr,
                    qk_type: EngramType::F32 as u32,
                })
                .unwrap();
            let (rows_gpu, _) = gpu_ctx.stages_device(1, RowIds::Host(&ids), n).unwrap();
            assert_eq!(rows_cpu.len(), rows_gpu.len(), "{fmt:?}");
            for (i, (a, b)) in rows_cpu.iter().zip(&rows_gpu).enumerate() {
                assert_eq!(
                    a,
                    b,
                    "{fmt:?}, table at +{off}: value {i} (token {}, column {}): CPU {a:#06x}, GPU {b:#06x}",
                    i / (cols * HD),
                    i / HD % cols
                );
            }
            println!(
                "{fmt:?}, table at +{off}: {} row values bit-identical on the {}",
                rows_gpu.len(),
                if dev.is_real() { "GPU" } else { "emulation" }
            );
        }
    }
}

/// A row whose values are not finite (a NaN or infinite GGUF scale, an fp8
/// scale that overflows) is refused by both backends with the same status
/// and message, naming the same element.
#[test]
fn non_finite_rows_are_refused_alike() {
    let Some(dev) = device() else { return };
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
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                device: Some(dev.gpu.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
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
        let ids = [0i64, row];
        let e_cpu = cpu.stages_device(1, RowIds::Host(&ids), 1).unwrap_err();
        assert_eq!(
            e_cpu.status,
            EngramStatus::ErrInvalidData,
            "{}",
            e_cpu.message
        );
        // Row 7 of the fp8 table is 8-byte aligned (the gather's vector
        // loads) at offset 0, not at offset 2.
        for off in [0usize, 2] {
            let mut padded = vec![0u8; off];
            padded.extend_from_slice(&t);
            let d_table = upload(&dev, &padded);
            let gpu_ctx = Context::new(&cfg(EngramBackend::Cuda)).expect("a CUDA context");
            gpu_ctx
                .set_layer_device(&DeviceLayerIn {
                    layer_id: 1,
                    table: d_table.ptr + off as u64,
                    table_rows: rows,
                    table_type: fmt as u32,
                    wkv: d_wkv.ptr,
                    wkv_type: EngramType::Bf16 as u32,
                    q: d_qk.ptr,
                    k: d_qk.ptr,
                    qk_type: EngramType::F32 as u32,
                })
                .unwrap();
            let e_gpu = gpu_ctx.stages_device(1, RowIds::Host(&ids), 1).unwrap_err();
            assert_eq!(
                e_gpu.status, e_cpu.status,
                "{fmt:?} at +{off}: {}",
                e_gpu.message
            );
            assert!(
                e_gpu.message.starts_with(&e_cpu.message),
                "{fmt:?} at +{off}: CPU '{}', GPU '{}'",
                e_cpu.message,
                e_gpu.message
            );
        }
    }
}

/// A `wkv` of `n_out` rows of `k` values in `fmt`: Q8_0 and Q4_0 quantised
/// from the filler, f16 from the filler, the K-quants built from the
/// oracle's finite blocks (each row different: blocks in a rotating order).
fn wkv_bytes(fmt: EngramType, n_out: usize, k: usize) -> Vec<u8> {
    let vals = values("cuda.formats.wkvq", n_out * k, 0.0625, 0.0);
    match fmt {
        EngramType::Q8_0 => q8_0(&vals),
        EngramType::Q4_0 => q4_0(&vals),
        EngramType::F16 => vals
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        f => {
            let blocks = oracle_blocks(match f {
                EngramType::Q2_K => "q2_K",
                EngramType::Q3_K => "q3_K",
                EngramType::Q4_K => "q4_K",
                EngramType::Q5_K => "q5_K",
                EngramType::Q6_K => "q6_K",
                f => panic!("{f:?}"),
            });
            let per_row = k / 256;
            (0..n_out * per_row)
                .flat_map(|i| blocks[(i * 7 + i / per_row) % blocks.len()].clone())
                .collect()
        }
    }
}

/// The fused quantised GEMV's sum of `w . x` (`x` bf16 bits) in its order
/// (see `the_fused_gemv_sums_in_its_documented_order`).
fn kernel_order_sum(w: &[f32], x: &[u16], fma: bool) -> f32 {
    let units = w.len() / 32;
    let mut lane: [f32; 32] = std::array::from_fn(|l| {
        let mut a = 0f32;
        for u in (l..units).step_by(32) {
            for e in 32 * u..32 * u + 32 {
                let xv = bf16_to_f32(x[e]);
                a = if fma {
                    w[e].mul_add(xv, a)
                } else {
                    a + w[e] * xv
                };
            }
        }
        a
    });
    for o in [16, 8, 4, 2, 1] {
        lane = std::array::from_fn(|l| lane[l] + lane[l ^ o]);
    }
    lane[0]
}

/// `wkv` in f16 and every GGUF block format, read in place: the fused GEMV
/// for up to 8 tokens and bf16 tiles + cuBLAS beyond, against the CPU
/// backend's quantised path (which equals its f32 path on the same
/// dequantised values, `tests/quant_wkv.rs`). Both sides sum exact-value
/// products in f32, each within `(K+1) u S` of the exact sum (`S = sum |r w|`
/// over the dequantised values) and round once to bf16, so the fused GEMV is
/// within `2 (K+2) u S` plus one bf16 ulp of the CPU; the tiles round the
/// weights to bf16 first (relative error at most 2^-9), which adds `2^-9 S`.
#[test]
fn every_wkv_format_projects_within_the_bound_of_the_cpu() {
    let Some(dev) = device() else { return };
    wkv_formats_against_the_cpu(&dev, 2, 3, false);
}

/// The fused GEMV's sums in the order its kernel documents, bit for bit:
/// lane `l` of a warp adds the products of the 32-value units `l, l + 32,
/// ...` of a weight row, each unit's in order (a multiply-add each where the
/// kernels are built with FMAs, as NVRTC's `--fmad=true` contracts them), the
/// 32 lanes are then summed by an xor butterfly (16, 8, 4, 2, 1 apart) and
/// rounded once to bf16. So how the kernel loads and decodes the blocks
/// cannot change a bit, and a token's sums do not depend on its batch. On the
/// emulation only (its build says whether it contracts; NVVM is expected,
/// not known, to contract the same way). `C*Hd` = 1280: 40 units, so a lane
/// takes one or two, the second span of 32 units partly filled; and 2048,
/// where the q3_K and q6_K rows are whole 16-byte words (880 and 1680 bytes)
/// but their first span of 32 units is not (440 and 840). The rounding
/// to bf16 hides most differences in the f32 sums, so the rows span 2^-8 ..
/// 2^8 to make them show: swapping two products of the kernel's sums changes
/// two of these outputs (Q8_0), which fails the test.
#[test]
fn the_fused_gemv_sums_in_its_documented_order() {
    let Some(dev) = common::device::emulated() else {
        return;
    };
    wkv_formats_against_the_cpu(&dev, 5, 2, true);
    wkv_formats_against_the_cpu(&dev, 8, 2, true);
}

/// The CPU and CUDA backends (fused GEMV up to 8 tokens, tiles beyond) on
/// every quantised `wkv` format for `heads` heads and n-grams up to `ngram`
/// (`C*Hd = (ngram - 1) * heads * 256`), within the bounds above; with
/// `order`, the fused GEMV's `kv` also bit for bit against its documented
/// order (emulation only).
fn wkv_formats_against_the_cpu(dev: &Dev, heads: usize, ngram: usize, order: bool) {
    let fma = dev
        .emu
        .as_ref()
        .is_some_and(|e| e.build_info().contains("fmad=1"));
    let cols = (ngram - 1) * heads;
    let (d, hc) = (64usize, 4usize);
    let (k_in, k_out) = (cols * HD, d * (hc + 1));
    let primes = derive_primes_uniform(1, ngram, heads, 100).unwrap();
    let offsets = derive_offsets(&primes, cols);
    let rows: u64 = primes.iter().sum();
    let mult: Vec<u64> = (0..ngram as u64)
        .map(|i| bits("cuda.wkvq.mult", i) | 1)
        .collect();
    let token_map: Vec<i32> = (0..48).collect();
    let cfg = |backend: EngramBackend, gemv: Option<usize>| ContextConfig {
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
            max_tokens: 16,
            max_seqs: 1,
            max_positions: 64,
        },
        n_threads: 1,
        backend: backend as u32,
        device: 0,
        tuning: engram::Tuning {
            cuda: engram::cuda::CudaTuning {
                gemv_max_tokens: gemv,
                device: Some(dev.gpu.clone()),
                ..Default::default()
            },
            ..Default::default()
        },
    };
    let table = if order {
        // Values over 2^-8 .. 2^8, so that another order of the sums gives
        // other bits.
        let f = Filler::new("cuda.wkvq.wide");
        (0..rows as usize * HD)
            .flat_map(|i| {
                let v = f.value(i as u64, 1.0, 0.0) * 2f32.powi((i * 7 % 17) as i32 - 8);
                f32_to_bf16(v).to_le_bytes()
            })
            .collect()
    } else {
        table_bytes("cuda.wkvq.table", "bf16", rows as usize, HD, false)
    };
    let qk: Vec<f32> = values("cuda.wkvq.qk", hc * d, 0.125, 1.0);
    let d_table = dev.upload(&table);
    let d_qk = dev.upload(&qk);
    let tokens: Vec<i32> = (0..12)
        .map(|i| (bits("cuda.wkvq.tokens", i) % 48) as i32)
        .collect();
    let pos: Vec<i32> = (0..12).collect();
    let mut report = Vec::new();
    for fmt in [
        EngramType::F16,
        EngramType::Q8_0,
        EngramType::Q4_0,
        EngramType::Q2_K,
        EngramType::Q3_K,
        EngramType::Q4_K,
        EngramType::Q5_K,
        EngramType::Q6_K,
    ] {
        let w = wkv_bytes(fmt, k_out, k_in);
        let rb = fmt.row_bytes(k_in);
        assert_eq!(w.len(), rb * k_out, "{fmt:?}");
        let mut deq = vec![0f32; k_out * k_in];
        for (o, row) in deq.chunks_mut(k_in).enumerate() {
            let _ = dequant_row_f32(fmt, &w[o * rb..(o + 1) * rb], row);
        }
        // The CPU reference sums the f32 twin (its exact option): the bound
        // below is between two f32 sums of the same values.
        let cpu = Context::new(&cfg(EngramBackend::Cpu, None))
            .unwrap()
            .with_exact_quant(true);
        cpu.set_layer(LayerIn::host(
            1,
            &table,
            EngramType::Bf16,
            rows,
            Weights::quant(fmt, &w, k_in).unwrap(),
            Weights::F32(&qk),
            Weights::F32(&qk),
        ))
        .unwrap();
        let mut worst = [0f64; 2];
        // With `order`, the fused GEMV also on the wkv at an address off
        // 16-byte alignment (its element's for f16, any for the blocks): its
        // narrower loads.
        let runs = if order {
            let odd = if fmt == EngramType::F16 { 2 } else { 1 };
            vec![(Some(8), 0), (Some(8), odd), (Some(0), 0)]
        } else {
            vec![(Some(8), 0), (Some(0), 0)]
        };
        for (gemv, off) in runs {
            let mut padded = vec![0u8; off];
            padded.extend_from_slice(&w);
            let d_w = dev.upload(&padded);
            let ctx = Context::new(&cfg(EngramBackend::Cuda, gemv)).expect("a CUDA context");
            ctx.set_layer_device(&DeviceLayerIn {
                layer_id: 1,
                table: d_table.ptr,
                table_rows: rows,
                table_type: EngramType::Bf16 as u32,
                wkv: d_w.ptr + off as u64,
                wkv_type: fmt as u32,
                q: d_qk.ptr,
                k: d_qk.ptr,
                qk_type: EngramType::F32 as u32,
            })
            .unwrap();
            for n in [1usize, 5, 8, 12] {
                let mut ids = vec![0i64; n * cpu.ids_per_token()];
                cpu.hash(&tokens[..n], &vec![0; n], &pos[..n], &mut ids)
                    .unwrap();
                let (rows_cpu, kv_cpu) = cpu.stages(1, &ids, n).unwrap();
                let (rows_gpu, kv_gpu) = ctx.stages(1, &ids, n).unwrap();
                assert_eq!(rows_cpu, rows_gpu, "{fmt:?}: rows");
                let tiles = gemv == Some(0) || n > 8;
                if order && !tiles {
                    for t in 0..kv_cpu.len() / k_out {
                        let x = &rows_gpu[t * k_in..(t + 1) * k_in];
                        for o in 0..k_out {
                            let want = kernel_order_sum(&deq[o * k_in..(o + 1) * k_in], x, fma);
                            let got = kv_gpu[t * k_out + o];
                            assert_eq!(
                                got,
                                f32_to_bf16(want),
                                "{fmt:?} at +{off}, {n} tokens: token {t} kv[{o}] is not the kernel-order sum"
                            );
                        }
                    }
                }
                let path = if tiles {
                    "tiles + cuBLAS"
                } else {
                    "fused GEMV"
                };
                for t in 0..kv_cpu.len() / k_out {
                    let r: Vec<f64> = rows_cpu[t * k_in..(t + 1) * k_in]
                        .iter()
                        .map(|&b| bf16_to_f32(b) as f64)
                        .collect();
                    for o in 0..k_out {
                        let (a, b) = (
                            bf16_to_f32(kv_gpu[t * k_out + o]) as f64,
                            bf16_to_f32(kv_cpu[t * k_out + o]) as f64,
                        );
                        let s: f64 = r
                            .iter()
                            .zip(&deq[o * k_in..(o + 1) * k_in])
                            .map(|(x, &w)| (x * w as f64).abs())
                            .sum();
                        let bound = s
                            * (2.0 * (k_in as f64 + 2.0) * U
                                + if tiles { 2f64.powi(-9) } else { 0.0 })
                            + ulp_bf16(a.abs().max(b.abs()));
                        assert!(
                            (a - b).abs() <= bound,
                            "{fmt:?} {path}, {n} tokens: token {t} kv[{o}] {a} vs CPU {b}, bound {bound}"
                        );
                        if bound > 0.0 {
                            let i = tiles as usize;
                            worst[i] = worst[i].max((a - b).abs() / bound);
                        }
                    }
                }
            }
        }
        report.push(format!(
            "{fmt:?}: fused GEMV {:.3}, tiles {:.3} of the bound",
            worst[0], worst[1]
        ));
    }
    if let Some(e) = &dev.emu {
        let l = e.launches();
        for f in engram::cuda::gpu::GEMV_Q_FORMATS {
            let name = engram::cuda::gpu::Kernel::GemvQ(f).name();
            assert!(l.contains_key(name), "{name} ran");
        }
        assert!(l.contains_key("engram_dequant_bf16"), "the tiles ran");
    }
    println!(
        "wkv formats, largest error against the CPU: {}",
        report.join("; ")
    );
}

/// An f16 `wkv` (ds4's GGUFs carry it so) is read in place by the CPU
/// backend too: its `kv` equals, bit for bit, the f32 path on the same
/// (f16-exact) values.
#[test]
fn an_f16_wkv_equals_the_f32_path_on_the_cpu() {
    let tiny = Tiny::load();
    let l = &tiny.layers[0];
    let k_in = tiny.cols() * tiny.hd;
    let halves: Vec<half::f16> = l
        .wkv
        .f32()
        .iter()
        .map(|&v| half::f16::from_f32(v))
        .collect();
    let w: Vec<u8> = halves
        .iter()
        .flat_map(|h| h.to_bits().to_le_bytes())
        .collect();
    let wf: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
    let run = |wkv: Weights<'_>| {
        let ctx = Context::new(&tiny.config(Tiny::limits())).unwrap();
        ctx.set_layer(LayerIn::host(
            l.layer_id,
            &l.table,
            l.format,
            l.rows,
            wkv,
            l.q.weights(),
            l.k.weights(),
        ))
        .expect("set_layer");
        let (ids, n) = {
            let tokens: Vec<i32> = (0..6).collect();
            let pos: Vec<i32> = (0..6).collect();
            let mut ids = vec![0i64; 6 * ctx.ids_per_token()];
            ctx.hash(&tokens, &[0; 6], &pos, &mut ids).unwrap();
            (ids, 6)
        };
        ctx.stages(l.layer_id, &ids, n).unwrap().1
    };
    let a = run(Weights::quant(EngramType::F16, &w, k_in).unwrap());
    let b = run(Weights::F32(&wf));
    assert_eq!(a, b, "f16 wkv vs f32 wkv of the same values");
    let _ = f32_to_bf16(0.0);
}
