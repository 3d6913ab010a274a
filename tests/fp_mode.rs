//! The caller's floating-point mode changes nothing (issue 34, F6).
//!
//! An engine may call with its thread in flush-to-zero / denormals-are-zero
//! mode (MXCSR bits 15 and 6: `torch.set_flush_denormal(True)`, a
//! `-ffast-math` binary's start-up). Through the C ABI, on every CPU kernel
//! this CPU runs, on the calling thread (1 thread) and on the pool (3
//! threads), with a bf16 `wkv` of subnormal and near-subnormal values and
//! an fp8 block `wkv` whose e8m0 scales are 2^-127 and 2^-126, `kv` (read
//! back) and the highway after an apply are the bits of the normal mode,
//! and every call leaves the caller's MXCSR as it found it. One test in its
//! own binary: `ENGRAM_CPU_KERNEL` is process-wide.
#![cfg(target_arch = "x86_64")]

use engram::cpu::projection::Kernel;
use engram::ffi::{self, EngramConfig, EngramContext, EngramLayerWeights};
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{EngramStatus, EngramType};
use std::ffi::c_void;

const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
const NORMAL: u32 = 0x1F80;

fn mxcsr() -> u32 {
    let mut v = 0u32;
    // SAFETY: `stmxcsr` stores 4 bytes into `v`, a live local.
    unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut v, options(nostack)) };
    v
}

fn set_mxcsr(v: u32) {
    // SAFETY: `ldmxcsr` reads 4 bytes from `v`; the values set are the
    // reset value with or without FTZ and DAZ (no reserved bit).
    unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &v, options(nostack, readonly)) };
}

/// The model: D = 64, hc = 1, Hd = 32, N = 2, H = 2 (C = 2), one layer.
const D: usize = 64;
const HC: usize = 1;
const HD: usize = 32;
const C: usize = 2;
const OUT: usize = D * (HC + 1);
const IN: usize = C * HD;
const VOCAB: usize = 48;

/// One `wkv` as the C ABI takes it.
struct Wkv {
    ty: EngramType,
    bytes: Vec<u8>,
    scales: Vec<u8>,
    block: u32,
}

/// bf16 values of magnitude 2^-133 to 2^-125: half subnormal (exponent
/// field 0), half in the lowest normal binades; signs mixed.
fn bf16_tiny() -> Wkv {
    let bits: Vec<u16> = (0..OUT * IN)
        .map(|i| {
            let sign = ((i % 3 == 0) as u16) << 15;
            let exp = (i % 4) as u16 / 2; // 0 (subnormal) or 1
            let mant = ((i * 37 + 11) % 127 + 1) as u16;
            sign | (exp << 7) | mant
        })
        .collect();
    Wkv {
        ty: EngramType::Bf16,
        bytes: bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
        scales: Vec::new(),
        block: 0,
    }
}

/// e4m3 codes of magnitude 0.125 to 448 (exact in bf16 at these scales) in
/// 32 x 32 blocks whose e8m0 scales are 0 (2^-127) and 1 (2^-126).
fn fp8_tiny() -> Wkv {
    let codes: Vec<u8> = (0..OUT * IN)
        .map(|i| {
            let exp = 4 + (i * 7 % 12) as u8;
            let mut mant = (i * 3 % 8) as u8;
            if exp == 15 && mant == 7 {
                mant = 6; // 0x7F is NaN
            }
            (((i % 2) as u8) << 7) | (exp << 3) | mant
        })
        .collect();
    let blocks = (OUT / 32) * (IN / 32);
    Wkv {
        ty: EngramType::Fp8E4m3E8m0Block,
        bytes: codes,
        scales: (0..blocks).map(|b| (b % 2) as u8).collect(),
        block: 32,
    }
}

/// `kv` (read back, bf16 bits) and the highway after one apply of `n`
/// tokens with `threads` threads, every call made with the caller's MXCSR
/// at `mode` and checked to leave it there.
fn run(wkv: &Wkv, threads: u32, n: usize, mode: u32) -> (Vec<u16>, Vec<u32>) {
    let primes = derive_primes_uniform(1, 2, 2, 100).unwrap();
    let offsets = derive_offsets(&primes, C);
    let rows = (offsets[C - 1] + primes[C - 1]) as usize;
    let token_map: Vec<i32> = (0..VOCAB as i32).collect();
    let mult = [1u64, 3];
    let layer_ids = [1u32];
    let mut cfg = EngramConfig {
        hidden_size: D as u32,
        hc: HC as u32,
        head_dim: HD as u32,
        n_heads: 2,
        max_ngram: 2,
        layer_ids: layer_ids.as_ptr(),
        n_layers: 1,
        token_map: token_map.as_ptr(),
        token_map_len: VOCAB,
        multipliers: mult.as_ptr(),
        n_multipliers: mult.len(),
        primes: primes.as_ptr(),
        n_primes: primes.len(),
        offsets: offsets.as_ptr(),
        n_offsets: offsets.len(),
        max_tokens: 64,
        max_seqs: 1,
        max_positions: 64,
        ..Default::default()
    };
    cfg.n_threads = threads;
    let table: Vec<u16> = (0..rows * HD)
        .map(|i| engram::formats::f32_to_bf16((0.5 + ((i * 29) % 97) as f32 / 64.0) / 1024.0))
        .collect();
    let qk: Vec<f32> = (0..HC * D).map(|i| 1.0 + (i % 5) as f32 / 8.0).collect();
    let w = EngramLayerWeights {
        layer_id: 1,
        table_type: EngramType::Bf16 as u32,
        table: table.as_ptr() as *const c_void,
        table_rows: rows as u64,
        wkv: wkv.bytes.as_ptr() as *const c_void,
        wkv_type: wkv.ty as u32,
        q: qk.as_ptr() as *const c_void,
        k: qk.as_ptr() as *const c_void,
        qk_type: EngramType::F32 as u32,
        wkv_scales: if wkv.scales.is_empty() {
            std::ptr::null()
        } else {
            wkv.scales.as_ptr() as *const c_void
        },
        wkv_block_rows: wkv.block,
        wkv_block_cols: wkv.block,
        ..Default::default()
    };
    let tokens: Vec<i32> = (0..n).map(|i| ((i * 5 + 1) % VOCAB) as i32).collect();
    let (seqs, pos) = (vec![0i32; n], (0..n as i32).collect::<Vec<_>>());
    let mut ids = vec![0i64; n * C];
    let mut kv = vec![0u16; n * OUT];
    let mut rows_out = vec![0u16; n * IN];
    let mut hw: Vec<f32> = (0..n * HC * D)
        .map(|i| (i % 13) as f32 / 4.0 - 1.5)
        .collect();
    set_mxcsr(mode);
    let mut ctx: *mut EngramContext = std::ptr::null_mut();
    let mut statuses = vec![ffi::engram_create(&cfg, &mut ctx)];
    let after_create = mxcsr();
    statuses.push(ffi::engram_set_layer(ctx, &w));
    let p = ids.as_mut_ptr();
    statuses.push(ffi::engram_hash(
        ctx,
        tokens.as_ptr(),
        seqs.as_ptr(),
        pos.as_ptr(),
        n as u32,
        p,
        ids.len(),
    ));
    statuses.push(ffi::engram_read_back(
        ctx,
        1,
        ids.as_ptr(),
        n as u32,
        rows_out.as_mut_ptr(),
        rows_out.len(),
        kv.as_mut_ptr(),
        kv.len(),
    ));
    let hwp = hw.as_mut_ptr() as *mut c_void;
    let f32_type = EngramType::F32 as u32;
    let null = std::ptr::null_mut();
    statuses.push(ffi::engram_apply(
        ctx,
        1,
        ids.as_ptr(),
        n as u32,
        hwp,
        f32_type,
        null,
    ));
    let after = mxcsr();
    ffi::engram_free(ctx);
    let after_free = mxcsr();
    set_mxcsr(NORMAL);
    assert!(
        statuses.iter().all(|&s| s == EngramStatus::Ok),
        "{statuses:?}"
    );
    for (when, got) in [
        ("create", after_create),
        ("apply", after),
        ("free", after_free),
    ] {
        // (The exception flags, bits 0-5, are status, not mode.)
        assert_eq!(
            got & !0x3F,
            mode,
            "MXCSR after {when}: {got:#x}, the caller's was {mode:#x}"
        );
    }
    (kv, hw.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn the_callers_ftz_daz_changes_no_bit_on_any_kernel() {
    let before = mxcsr();
    let kernels = [
        Kernel::Portable,
        Kernel::Avx2,
        Kernel::Avx512,
        Kernel::Avx512Bf16,
        Kernel::Amx,
    ];
    for k in kernels.into_iter().filter(|k| k.supported()) {
        let name = format!("{k:?}").to_lowercase();
        std::env::set_var("ENGRAM_CPU_KERNEL", &name);
        for (what, wkv) in [
            ("bf16 subnormal", bf16_tiny()),
            ("fp8 block, scale 2^-127", fp8_tiny()),
        ] {
            // 5 tokens (one at a time) and 48 (the batched path).
            for n in [5, 48] {
                let want = run(&wkv, 1, n, NORMAL);
                // The case matters: some kv is subnormal in bf16 (but on
                // avx512bf16 and amx, whose dot products read subnormals as
                // zero in every mode, docs/cpu.md).
                let subnormal = want
                    .0
                    .iter()
                    .filter(|&&b| b & 0x7F80 == 0 && b & 0x7F != 0)
                    .count();
                assert!(
                    subnormal > 0 || matches!(k, Kernel::Avx512Bf16 | Kernel::Amx),
                    "{name}, {what}: no subnormal kv"
                );
                for threads in [1, 3] {
                    for mode in [NORMAL, NORMAL | FTZ_DAZ] {
                        let got = run(&wkv, threads, n, mode);
                        let case = format!(
                            "{name}, {what}, {n} tokens, {threads} threads, MXCSR {mode:#x}"
                        );
                        let diff = got.0.iter().zip(&want.0).filter(|(a, b)| a != b).count();
                        assert_eq!(
                            diff,
                            0,
                            "{case}: {diff} of {} kv values differ",
                            want.0.len()
                        );
                        assert!(got.1 == want.1, "{case}: the highway differs");
                    }
                }
            }
        }
    }
    std::env::remove_var("ENGRAM_CPU_KERNEL");
    assert_eq!(mxcsr(), before);
}
