//! The decode kernel (`kernels/decode.cu`; docs/cuda.md "The decode
//! kernel"), through the real CUDA backend:
//!
//! - `kv` is, bit for bit, the sum in the order docs/cuda.md writes down
//!   (recomputed here on the host), for batches of 1 to 64 tokens, so for
//!   several tiles of tokens;
//! - a token's `kv` and its updated highway are the same bits in every batch
//!   of 1 to 64 tokens;
//! - for 1 to 8 tokens they are the bits of the GEMV kernels (the path
//!   before the decode kernel);
//! - the kernel with its gate is one ordinary launch (no cooperative launch,
//!   in a capture too), and where the driver refuses it with an error that
//!   leaves the context usable, the split path (phase A, then the gate
//!   kernel) gives the same bits (emulation only: its hooks);
//! - a batch over the decode limit takes the path before it.
//!
//! The data make the order of the sums matter: rows and weights span
//! 2^-8 .. 2^8, and the test checks that a sum in `k` order gives other bits
//! for some outputs, so a kernel that summed in another order would fail.
//! On the GPU when there is one (the order is IEEE fma and add, so the host
//! recomputation holds there too), else on the emulation.

mod common;

use common::device::{device, own_device, own_emulator, Dev};
use common::*;
use engram::cuda::gpu::{DevBuf, Gpu};
use engram::formats::{bf16_to_f32, f32_to_bf16};
use engram::hash::{derive_offsets, derive_primes_uniform};
use engram::{
    Context, ContextConfig, EngramBackend, EngramType, Geometry, HashTablesIn, Limits, RowIds,
};
use std::sync::Arc;

const HD: usize = 256;
const MAX_N: usize = 64;

/// A layer whose `kv` depends on the order of its sums, on a device, and the
/// row ids of 64 tokens.
struct Model {
    dev: Dev,
    d: usize,
    hc: usize,
    k_in: usize,
    k_out: usize,
    rows: u64,
    primes: Vec<u64>,
    offsets: Vec<u64>,
    mult: Vec<u64>,
    token_map: Vec<i32>,
    wkv: Vec<u16>,
    d_table: DevBuf,
    d_wkv: DevBuf,
    d_qk: DevBuf,
    /// Host row ids of MAX_N tokens (one layer, id 1).
    ids: Vec<i64>,
    per: usize,
}

impl Model {
    fn new(dev: Dev) -> Model {
        let (heads, ngram) = (2usize, 3usize);
        let cols = (ngram - 1) * heads;
        let (d, hc) = (64usize, 4usize);
        let (k_in, k_out) = (cols * HD, d * (hc + 1));
        let primes = derive_primes_uniform(1, ngram, heads, 100).unwrap();
        let offsets = derive_offsets(&primes, cols);
        let rows: u64 = primes.iter().sum();
        let mult: Vec<u64> = (0..ngram as u64)
            .map(|i| bits("cuda.decode.mult", i) | 1)
            .collect();
        let token_map: Vec<i32> = (0..48).collect();
        // Sums whose bits depend on their order: every table row holds
        // 2^25 at values 0 and 128 (in lanes 0 and 16 of a warp: a lane
        // takes 8 values of each 256 in turn) and small values elsewhere;
        // each weight row picks +2^25 from columns 0 and 2 and -2^25 from
        // column 1's value 128 and column 3's value 0, so that lane 0's sum
        // swings between 0 and 2^25 (small products added at 2^25 lose
        // bits) and lanes 0 and 16 cancel only if they meet first in the
        // butterfly.
        let small = |f: &Filler, i: usize| {
            let u = f.value(i as u64, 1.0, 0.0);
            f32_to_bf16(u.signum() * (0.5 + u.abs()))
        };
        let ft = Filler::new("cuda.decode.table");
        let table: Vec<u16> = (0..rows as usize * HD)
            .map(|i| match i % HD {
                0 | 128 => f32_to_bf16(33554432.0),
                _ => small(&ft, i),
            })
            .collect();
        let fw = Filler::new("cuda.decode.wkv");
        let wkv: Vec<u16> = (0..k_out * k_in)
            .map(|i| match ((i % k_in) / HD, i % HD) {
                (0, 0) | (2, 0) => f32_to_bf16(1.0),
                (1, 128) | (3, 0) => f32_to_bf16(-1.0),
                (_, 0) | (_, 128) => 0,
                _ => small(&fw, i),
            })
            .collect();
        let qk: Vec<f32> = values("cuda.decode.qk", hc * d, 0.125, 1.0);
        let (d_table, d_wkv, d_qk) = (dev.upload(&table), dev.upload(&wkv), dev.upload(&qk));
        let mut m = Model {
            dev,
            d,
            hc,
            k_in,
            k_out,
            rows,
            primes,
            offsets,
            mult,
            token_map,
            wkv,
            d_table,
            d_wkv,
            d_qk,
            ids: Vec::new(),
            per: 0,
        };
        let (per, ids) = {
            let ctx = m.context(Some(0), Some(0));
            let per = ctx.ids_per_token();
            let tokens: Vec<i32> = (0..MAX_N as u64)
                .map(|i| (bits("cuda.decode.tokens", i) % 48) as i32)
                .collect();
            let pos: Vec<i32> = (0..MAX_N as i32).collect();
            let mut ids = vec![0i64; MAX_N * per];
            ctx.hash(&tokens, &[0; MAX_N], &pos, &mut ids).unwrap();
            (per, ids)
        };
        m.per = per;
        m.ids = ids;
        m
    }

    /// A CUDA context with the layer set: the GEMV kernels up to `gemv`
    /// tokens and the decode kernel up to `decode` (`None`: the defaults).
    fn context(&self, gemv: Option<usize>, decode: Option<usize>) -> Context<'_> {
        self.context_on(&self.dev.gpu, gemv, decode)
    }

    fn context_on(
        &self,
        gpu: &Arc<dyn Gpu>,
        gemv: Option<usize>,
        decode: Option<usize>,
    ) -> Context<'_> {
        let cfg = ContextConfig {
            geometry: Geometry {
                d: self.d,
                hc: self.hc,
                hd: HD,
                eps: 1e-6,
            },
            tables: HashTablesIn {
                layer_ids: &[1],
                max_ngram: 3,
                n_heads: 2,
                token_map: &self.token_map,
                pad_id: 2,
                multipliers: &self.mult,
                primes: &self.primes,
                offsets: &self.offsets,
            },
            limits: Limits {
                max_tokens: MAX_N,
                max_seqs: 1,
                max_positions: MAX_N,
            },
            n_threads: 1,
            backend: EngramBackend::Cuda as u32,
            device: 0,
            tuning: engram::Tuning {
                cuda: engram::cuda::CudaTuning {
                    gemv_max_tokens: gemv,
                    decode_max_tokens: decode,
                    device: Some(gpu.clone()),
                },
                ..Default::default()
            },
        };
        let ctx = Context::new(&cfg).expect("a CUDA context");
        ctx.set_layer_device(&DeviceLayerIn {
            layer_id: 1,
            table: self.d_table.ptr,
            table_rows: self.rows,
            table_type: EngramType::Bf16 as u32,
            wkv: self.d_wkv.ptr,
            wkv_type: EngramType::Bf16 as u32,
            q: self.d_qk.ptr,
            k: self.d_qk.ptr,
            qk_type: EngramType::F32 as u32,
        })
        .unwrap();
        ctx
    }

    /// The row ids of tokens `t0 .. t0 + n`.
    fn ids(&self, t0: usize, n: usize) -> &[i64] {
        &self.ids[t0 * self.per..(t0 + n) * self.per]
    }

    /// Rows and kv of tokens `t0 .. t0 + n` in one batch (read back).
    fn stages(&self, ctx: &Context<'_>, t0: usize, n: usize) -> (Vec<u16>, Vec<u16>) {
        ctx.stages_device(1, RowIds::Host(self.ids(t0, n)), n)
            .unwrap()
    }

    /// The f32 highway of tokens `t0 .. t0 + n` after one apply, as bits.
    fn apply(&self, ctx: &Context<'_>, t0: usize, n: usize, ids: RowIds<'_>) -> Vec<u32> {
        let per_token = self.hc * self.d;
        let all = values("cuda.decode.highway", MAX_N * per_token, 1.0, 0.0);
        let hw = self.dev.upload(&all[t0 * per_token..(t0 + n) * per_token]);
        let null = std::ptr::null_mut();
        ctx.apply_device(1, ids, n, hw.ptr, 0, null).unwrap();
        ctx.check_device(null).unwrap();
        hw.read::<f32>(n * per_token)
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// kv[o] of a token whose gathered row is `x`, in the documented order
    /// (docs/cuda.md): lane l adds chunks of 8 products l, l + 32, ... with an
    /// fma each, the lanes are summed by an xor butterfly, rounded to bf16.
    fn documented(&self, o: usize, x: &[u16]) -> u16 {
        let w = &self.wkv[o * self.k_in..(o + 1) * self.k_in];
        let k8 = self.k_in / 8;
        let mut lane: [f32; 32] = std::array::from_fn(|l| {
            let mut s = 0f32;
            for c in (l..k8).step_by(32) {
                for e in 8 * c..8 * c + 8 {
                    s = bf16_to_f32(w[e]).mul_add(bf16_to_f32(x[e]), s);
                }
            }
            s
        });
        for m in [16, 8, 4, 2, 1] {
            lane = std::array::from_fn(|l| lane[l] + lane[l ^ m]);
        }
        f32_to_bf16(lane[0])
    }

    /// The same products summed in `k` order, or in the documented order
    /// with each lane's chunks taken last first, or with the butterfly's
    /// steps 1, 2, 4, 8, 16 apart: orders that must give other bits for
    /// some outputs, or the tests could not tell them from the kernel's.
    fn other_orders(&self, o: usize, x: &[u16]) -> [u16; 3] {
        let w = &self.wkv[o * self.k_in..(o + 1) * self.k_in];
        let p = |e: usize, s: f32| bf16_to_f32(w[e]).mul_add(bf16_to_f32(x[e]), s);
        let in_k = (0..self.k_in).fold(0f32, |s, e| p(e, s));
        let k8 = self.k_in / 8;
        let lanes = |rev: bool| -> [f32; 32] {
            std::array::from_fn(|l| {
                let mut cs: Vec<usize> = (l..k8).step_by(32).collect();
                if rev {
                    cs.reverse();
                }
                cs.iter()
                    .fold(0f32, |s, &c| (8 * c..8 * c + 8).fold(s, |s, e| p(e, s)))
            })
        };
        let fly = |mut lane: [f32; 32], steps: [usize; 5]| {
            for m in steps {
                lane = std::array::from_fn(|l| lane[l] + lane[l ^ m]);
            }
            lane[0]
        };
        [
            f32_to_bf16(in_k),
            f32_to_bf16(fly(lanes(true), [16, 8, 4, 2, 1])),
            f32_to_bf16(fly(lanes(false), [1, 2, 4, 8, 16])),
        ]
    }
}

fn launches(dev: &Dev, name: &str) -> u64 {
    dev.emu
        .as_ref()
        .map_or(0, |e| e.launches().get(name).copied().unwrap_or(0))
}

/// The fused launches among them (phase A and the gate in one launch).
fn fused_launches(dev: &Dev, name: &str) -> u64 {
    dev.emu
        .as_ref()
        .map_or(0, |e| e.fused_launches().get(name).copied().unwrap_or(0))
}

/// kv is the documented sum, bit for bit, for every token of batches of 1 to
/// 64 tokens (1 to 4 tiles of 16), and the rows are the table's rows.
#[test]
fn kv_is_the_documented_sum_in_batches_of_1_to_64() {
    let Some(dev) = device() else { return };
    let m = Model::new(dev.clone());
    let ctx = m.context(None, Some(MAX_N));
    let (k_in, k_out) = (m.k_in, m.k_out);
    let before = launches(&dev, "engram_decode_bf16");
    let mut order_matters = [0usize; 3];
    for (t0, n) in [
        (0, 1),
        (5, 1),
        (0, 2),
        (3, 7),
        (0, 8),
        (1, 9),
        (0, 16),
        (0, 17),
        (7, 33),
        (0, 64),
    ] {
        let (rows, kv) = m.stages(&ctx, t0, n);
        for t in 0..n {
            let x = &rows[t * k_in..(t + 1) * k_in];
            for o in 0..k_out {
                let want = m.documented(o, x);
                assert_eq!(
                    kv[t * k_out + o],
                    want,
                    "{n} tokens from {t0}: token {t} kv[{o}] is not the documented sum"
                );
                for (i, other) in m.other_orders(o, x).iter().enumerate() {
                    order_matters[i] += (*other != want) as usize;
                }
            }
        }
    }
    assert!(
        order_matters.iter().all(|&c| c > 0),
        "the data do not tell every other order from the documented one ({order_matters:?}): \
         the test could not fail"
    );
    if dev.emu.is_some() {
        assert!(
            launches(&dev, "engram_decode_bf16") > before,
            "the decode kernel ran"
        );
    }
    println!(
        "kv: the documented sum for every token; outputs with other bits in k order, with the \
         chunks reversed, with the butterfly reversed: {order_matters:?}"
    );
}

/// `applies` applies ran the decode kernel with one launch each (phase A and
/// the gate in the last block done): the driver took them. Under MPS
/// (`ENGRAM_MPS_CHECK=1`, set by `scripts/gpu-check.sh`'s MPS step) the
/// driver may refuse the launch for the client's share of the device: then
/// every apply from the first refusal on took the split path, and the test
/// says so.
fn fused_or_refused(stats: &engram::backend::DecodeStats, applies: u64) {
    assert_eq!(
        stats.cooperative + stats.split,
        applies,
        "every apply ran the decode kernel: {stats:?}"
    );
    if std::env::var("ENGRAM_MPS_CHECK").is_ok_and(|v| v == "1") && stats.refused {
        println!(
            "under MPS the driver refused the fused launch after {} applies: the split path ran {}",
            stats.cooperative, stats.split
        );
        return;
    }
    assert!(
        !stats.refused && stats.split == 0,
        "every apply was one launch (on a GPU: the driver took them): {stats:?}"
    );
    println!("{} applies, each one launch", stats.cooperative);
}

/// A token's kv (read back) and its updated highway (a whole apply: the
/// decode kernel with its gate in the last block done) are the same bits in every batch
/// of 1 to 64 tokens as in a batch of its own.
#[test]
fn a_token_gets_the_same_bits_in_every_batch_of_1_to_64() {
    let Some(dev) = device() else { return };
    let m = Model::new(dev.clone());
    let ctx = m.context(None, Some(MAX_N));
    let k_out = m.k_out;
    let per_token = m.hc * m.d;
    let alone: Vec<(Vec<u16>, Vec<u32>)> = (0..MAX_N)
        .map(|t| {
            // The apply first: its gate must read this call's kv, not what
            // the call before left in the workspace.
            let hw = m.apply(&ctx, t, 1, RowIds::Host(m.ids(t, 1)));
            (m.stages(&ctx, t, 1).1, hw)
        })
        .collect();
    let fused = fused_launches(&dev, "engram_decode_bf16");
    let stats = ctx.info().decode;
    fused_or_refused(&stats, MAX_N as u64);
    for n in 2..=MAX_N {
        let hw = m.apply(&ctx, 0, n, RowIds::Host(m.ids(0, n)));
        let (_, kv) = m.stages(&ctx, 0, n);
        for (t, (kv1, hw1)) in alone.iter().enumerate().take(n) {
            assert!(
                kv[t * k_out..(t + 1) * k_out] == kv1[..],
                "{n} tokens: token {t}'s kv differs from a batch of its own"
            );
            assert!(
                hw[t * per_token..(t + 1) * per_token] == hw1[..],
                "{n} tokens: token {t}'s highway differs from a batch of its own"
            );
        }
    }
    let stats = ctx.info().decode;
    fused_or_refused(&stats, 2 * MAX_N as u64 - 1);
    assert_eq!(
        stats.read_back,
        2 * MAX_N as u64 - 1,
        "every read-back ran phase A alone"
    );
    if dev.emu.is_some() {
        assert!(
            fused_launches(&dev, "engram_decode_bf16") >= fused + (MAX_N as u64 - 1),
            "the emulation ran the fused launches"
        );
    }
}

/// For 1 to 8 tokens the decode kernel gives the GEMV kernels' bits: kv and
/// the updated highway equal those of a context with the decode kernel off.
#[test]
fn for_1_to_8_tokens_the_bits_are_the_gemv_kernels() {
    let Some(dev) = device() else { return };
    let m = Model::new(dev.clone());
    let decode = m.context(None, None);
    let gemv = m.context(Some(engram::cuda::kernels::GEMV_MAX), Some(0));
    let before = launches(&dev, "engram_gemv_bf16_8");
    for n in 1..=engram::cuda::kernels::GEMV_MAX {
        let (rows_a, kv_a) = m.stages(&decode, 3, n);
        let (rows_b, kv_b) = m.stages(&gemv, 3, n);
        assert!(rows_a == rows_b, "{n} tokens: rows differ");
        assert!(kv_a == kv_b, "{n} tokens: kv differs from the GEMV's");
        let ids = RowIds::Host(m.ids(3, n));
        assert!(
            m.apply(&decode, 3, n, ids) == m.apply(&gemv, 3, n, ids),
            "{n} tokens: the highway differs from the GEMV path's"
        );
    }
    if dev.emu.is_some() {
        assert!(
            launches(&dev, "engram_gemv_bf16_8") > before,
            "the GEMV ran"
        );
    }
}

/// A batch over the decode limit takes the path before the decode kernel
/// (the gather kernel, then cuBLAS for 9 tokens), and its kv stays within the
/// bound of the documented sum (both are f32 sums of the same exact
/// products).
#[test]
fn a_batch_over_the_decode_limit_takes_the_path_before() {
    // An emulated device of its own: the launches counted are this test's.
    let Some(dev) = own_device() else { return };
    let m = Model::new(dev.clone());
    let ctx = m.context(None, Some(4));
    let (gather, decode) = (
        launches(&dev, "engram_gather"),
        launches(&dev, "engram_decode_bf16"),
    );
    let (rows, kv) = m.stages(&ctx, 0, 9);
    if dev.emu.is_some() {
        assert!(
            launches(&dev, "engram_gather") > gather,
            "the gather kernel ran"
        );
        assert_eq!(launches(&dev, "engram_decode_bf16"), decode);
    }
    let (k_in, k_out) = (m.k_in, m.k_out);
    for t in 0..9 {
        let x = &rows[t * k_in..(t + 1) * k_in];
        for o in 0..k_out {
            let w = &m.wkv[o * k_in..(o + 1) * k_in];
            let s: f64 = (0..k_in)
                .map(|e| (bf16_to_f32(w[e]) as f64 * bf16_to_f32(x[e]) as f64).abs())
                .sum();
            let (a, b) = (
                bf16_to_f32(kv[t * k_out + o]) as f64,
                bf16_to_f32(m.documented(o, x)) as f64,
            );
            let ulp = 2f64.powi(a.abs().max(b.abs()).max(1e-30).log2().floor() as i32 - 7);
            assert!(
                (a - b).abs() <= 2.0 * (k_in as f64 + 2.0) * 2f64.powi(-24) * s + ulp,
                "token {t} kv[{o}]: {a} against {b}"
            );
        }
    }
}

/// The decode kernel with its gate needs no cooperative launch and no
/// co-residency (the last block done runs the gate): one ordinary launch on
/// a device without cooperative launches and during a capture. Where the
/// driver refuses that launch with an error that leaves the context usable
/// (too many resources for a green context, say), the split path (phase A,
/// then the gate kernel) gives the same bits, and the context stops asking.
/// The count of blocks done is zero again after every launch (else a later
/// apply's gate would not run, and its highway would differ from the
/// reference's). Emulation only (its hooks).
#[test]
fn the_fused_launch_needs_no_cooperative_launch_and_a_refusal_falls_back() {
    let Some((dev, emu)) = own_emulator() else {
        return;
    };
    let m = Model::new(dev.clone());
    let n = 12;
    let count = |name: &str| emu.launches().get(name).copied().unwrap_or(0);
    let fused_all = || {
        emu.fused_launches()
            .get("engram_decode_bf16")
            .copied()
            .unwrap_or(0)
    };
    // Fused launches, and the others (phase A alone), since `k`.
    let fused = |k| fused_all() - k;
    let split = |k| count("engram_decode_bf16") - fused_all() - k;
    // The fused kernel, as a reference.
    let (f0, s0) = (fused(0), split(0));
    let want = m.apply(&m.context(None, None), 0, n, RowIds::Host(m.ids(0, n)));
    assert_eq!((fused(f0), split(s0)), (1, 0), "the fused kernel ran");
    // A device without cooperative launches: the same one launch.
    emu.set_cooperative(false);
    let ctx = m.context(None, None);
    let (f0, s0, g0) = (fused(0), split(0), count("engram_gate_f32_bf16"));
    assert!(
        m.apply(&ctx, 0, n, RowIds::Host(m.ids(0, n))) == want,
        "no cooperative launch: the fused kernel's bits differ"
    );
    assert_eq!((fused(f0), split(s0)), (1, 0));
    assert_eq!(count("engram_gate_f32_bf16"), g0, "no gate kernel");
    drop(ctx);
    emu.set_cooperative(true);
    // The driver refuses the launch: refused once, then not asked again.
    emu.set_refuse_fused(true);
    let ctx = m.context(None, None);
    let (r0, g0) = (emu.fused_refusals(), count("engram_gate_f32_bf16"));
    for _ in 0..2 {
        let (f0, s0) = (fused(0), split(0));
        assert!(
            m.apply(&ctx, 0, n, RowIds::Host(m.ids(0, n))) == want,
            "a refused launch: the split path's bits differ"
        );
        assert_eq!((fused(f0), split(s0)), (0, 1));
    }
    assert_eq!(count("engram_gate_f32_bf16"), g0 + 2, "the gate kernel ran");
    assert_eq!(emu.fused_refusals(), r0 + 1, "the context remembers");
    let stats = ctx.info().decode;
    assert_eq!(
        (stats.cooperative, stats.split, stats.refused),
        (0, 2, true),
        "the context reports the refusal and the split path"
    );
    emu.set_refuse_fused(false);
    drop(ctx);
    // A capture (device ids; the emulation runs the work anyway): the same
    // one launch, replayable.
    let ctx = m.context(None, None);
    let d_ids = dev.upload(m.ids(0, n));
    emu.set_capturing(true);
    let (f0, s0) = (fused(0), split(0));
    let got = m.apply(&ctx, 0, n, RowIds::Device(d_ids.ptr));
    emu.set_capturing(false);
    assert!(
        got == want,
        "during a capture: the fused kernel's bits differ"
    );
    assert_eq!((fused(f0), split(s0)), (1, 0));
}
