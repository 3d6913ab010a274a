//! The split fp8 row format (`ENGRAM_TYPE_FP8_E4M3_E8M0_SPLIT`: e4m3 codes and
//! e8m0 scales in two arrays, as the released checkpoint stores them) against
//! the packed 264-byte format: bit for bit on random rows (errors included),
//! through a CPU context (tables in memory, in files read with `pread`,
//! prefetched or not), in the CUDA kernels' dequantisation compiled as host
//! C++ (`kernels/engram_common.cuh`, the way `tests/cuda_kernels_host.rs`
//! checks it), and every bad input of `set_layer` for it.

mod common;

use common::*;
use engram::formats::{dequant_row_bf16, fp8_split_bf16, RowDataError};
use engram::{EngramStatus, EngramType, Highway, LayerIn, Region, TableSource};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

/// Split packed fp8 rows of width `hd` into (codes, scales).
fn split(packed: &[u8], hd: usize) -> (Vec<u8>, Vec<u8>) {
    let rb = hd + hd / 32;
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for row in packed.chunks_exact(rb) {
        c.extend_from_slice(&row[..hd]);
        s.extend_from_slice(&row[hd..]);
    }
    (c, s)
}

/// Random packed rows: every code (NaN codes included) and scale (255 and
/// the overflowing ones included).
fn random_rows(rows: usize, hd: usize, seed: &str) -> Vec<u8> {
    let f = Filler::new(seed);
    (0..rows * (hd + hd / 32))
        .map(|i| f.bits(i as u64) as u8)
        .collect()
}

#[test]
fn split_rows_dequantise_as_the_packed_rows() {
    let hd = 256;
    let packed = random_rows(4096, hd, "fp8-split-random");
    let (codes, scales) = split(&packed, hd);
    let (mut a, mut b) = (vec![0u16; hd], vec![0u16; hd]);
    let mut errors = [0usize; 3];
    for r in 0..4096 {
        let pr = dequant_row_bf16(
            EngramType::Fp8E4m3E8m0,
            &packed[r * 264..(r + 1) * 264],
            &mut a,
        );
        let sr = fp8_split_bf16(
            &codes[r * hd..(r + 1) * hd],
            &scales[r * 8..(r + 1) * 8],
            &mut b,
        );
        assert_eq!(pr, sr, "row {r}");
        match pr {
            Ok(()) => assert_eq!(a, b, "row {r}"),
            Err(RowDataError::NanScale(_)) => errors[0] += 1,
            Err(RowDataError::NanCode(_)) => errors[1] += 1,
            Err(RowDataError::NonFinite(_)) => errors[2] += 1,
        }
        // The split format's own number dequantises a packed row the same way.
        let mut c = vec![0u16; hd];
        let qr = dequant_row_bf16(
            EngramType::Fp8E4m3E8m0Split,
            &packed[r * 264..(r + 1) * 264],
            &mut c,
        );
        assert_eq!(qr, pr, "row {r}");
    }
    assert!(
        errors.iter().all(|&e| e > 0),
        "random rows reach every error: {errors:?}"
    );
    assert_eq!(EngramType::Fp8E4m3E8m0Split.planes(256), (256, Some(8)));
    assert_eq!(EngramType::Fp8E4m3E8m0Split.row_bytes(256), 264);
    assert_eq!(EngramType::Fp8E4m3E8m0Split as u32, 1001);
}

/// A context of the tiny model whose fp8 layer (1) is given as two arrays.
fn split_context<'a>(
    tiny: &'a Tiny,
    codes: TableSource<'a>,
    scales: TableSource<'a>,
) -> engram::Context<'a> {
    let ctx = engram::Context::new(&tiny.config(Tiny::limits())).unwrap();
    for l in &tiny.layers {
        let mut w = LayerIn::host(
            l.layer_id,
            &l.table,
            EngramType::row_format(l.format as u32, tiny.hd).unwrap(),
            l.rows,
            l.wkv.weights(),
            l.q.weights(),
            l.k.weights(),
        );
        if l.layer_id == 1 {
            w.table.source = codes.clone();
            w.table.scales = Some(scales.clone());
            w.table.ty = EngramType::Fp8E4m3E8m0Split as u32;
        }
        ctx.set_layer(w).unwrap();
    }
    ctx
}

/// Hash and apply the tiny.json prefill call on `a` and `b` (prefetching on
/// `a` first when `prefetch`): the same ids, rows, kv and highway bits.
fn same_outputs(tiny: &Tiny, a: &engram::Context, b: &engram::Context, prefetch: bool) {
    let c = &tiny.golden["regimes"]["prefill"]["calls"][0];
    let (tokens, seqs, pos) = (i32s(&c["tokens"]), i32s(&c["seq_ids"]), i32s(&c["pos"]));
    let n = tokens.len();
    let mut ids = vec![0i64; n * a.ids_per_token()];
    a.hash(&tokens, &seqs, &pos, &mut ids).unwrap();
    b.hash(&tokens, &seqs, &pos, &mut vec![0; ids.len()])
        .unwrap();
    if prefetch {
        a.prefetch(1, &ids, n).unwrap();
    }
    let x = values("fp8.split.h", n * tiny.hc * tiny.d, 1.0, 0.0);
    let (mut ha, mut hb) = (x.clone(), x);
    a.apply(1, &ids, n, Highway::F32(&mut ha)).unwrap();
    b.apply(1, &ids, n, Highway::F32(&mut hb)).unwrap();
    assert!(ha.iter().zip(&hb).all(|(p, q)| p.to_bits() == q.to_bits()));
    let ra = a.read_back(1, engram::RowIds::Host(&ids), n).unwrap();
    let rb = b.read_back(1, engram::RowIds::Host(&ids), n).unwrap();
    assert_eq!(ra, rb);
    // And the golden's rows.
    let want = u16s(&c["layers"][0]["rows_bf16"]);
    assert_eq!(ra.rows, want);
}

#[test]
fn a_cpu_context_reads_split_tables_from_memory_and_files() {
    let tiny = Tiny::load();
    let l = &tiny.layers[0];
    assert_eq!((l.layer_id, l.format), (1, EngramType::Fp8E4m3E8m0));
    let (codes, scales) = split(&l.table, tiny.hd);
    let packed = tiny.context();
    // In memory.
    let ctx = split_context(
        &tiny,
        TableSource::Memory(Region::of(&codes)),
        TableSource::Memory(Region::of(&scales)),
    );
    same_outputs(&tiny, &ctx, &packed, false);
    same_outputs(&tiny, &ctx, &packed, true);
    // Read with pread from two files (the scales at an offset).
    let dir = std::env::temp_dir().join(format!("engram-fp8-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cp, sp) = (dir.join("codes.bin"), dir.join("scales.bin"));
    std::fs::write(&cp, &codes).unwrap();
    let mut sb = vec![0x55u8; 40];
    sb.extend_from_slice(&scales);
    std::fs::write(&sp, &sb).unwrap();
    let cf = Arc::new(std::fs::File::open(&cp).unwrap());
    let sf = Arc::new(
        std::fs::File::options()
            .read(true)
            .write(true)
            .open(&sp)
            .unwrap(),
    );
    let ctx = split_context(
        &tiny,
        TableSource::File {
            file: cf.clone(),
            offset: 0,
        },
        TableSource::File {
            file: sf.clone(),
            offset: 40,
        },
    );
    same_outputs(&tiny, &ctx, &packed, false);
    same_outputs(&tiny, &ctx, &packed, true);
    // The scale file cut short: an I/O status, the highway untouched.
    sf.set_len(60).unwrap();
    let mut ids = vec![0i64; 3 * ctx.ids_per_token()];
    ctx.hash(&[1, 2, 3], &[1, 1, 1], &[0, 1, 2], &mut ids)
        .unwrap();
    let x = values("fp8.split.cut", 3 * tiny.hc * tiny.d, 1.0, 0.0);
    let mut h = x.clone();
    let e = ctx.apply(1, &ids, 3, Highway::F32(&mut h)).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    assert_eq!(h, x);
    // A file that is too short already at set_layer.
    let short = engram::Context::new(&tiny.config(Tiny::limits())).unwrap();
    let mut w = LayerIn::host(
        1,
        &codes,
        EngramType::Fp8E4m3E8m0Split,
        l.rows,
        l.wkv.weights(),
        l.q.weights(),
        l.k.weights(),
    );
    w.table.scales = Some(TableSource::File {
        file: sf.clone(),
        offset: 40,
    });
    let e = short.set_layer(w).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    assert!(e.message.contains("scales"), "{}", e.message);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn set_layer_refuses_bad_split_tables() {
    let tiny: &'static Tiny = Box::leak(Box::new(Tiny::load()));
    let l = &tiny.layers[0];
    let (codes, scales) = split(&l.table, tiny.hd);
    let ctx = engram::Context::new(&tiny.config(Tiny::limits())).unwrap();
    let base = |ty: EngramType, table: &'static [u8]| {
        LayerIn::host(
            1,
            table,
            ty,
            l.rows,
            l.wkv.weights(),
            l.q.weights(),
            l.k.weights(),
        )
    };
    let codes: &'static [u8] = Box::leak(codes.into_boxed_slice());
    let scales: &'static [u8] = Box::leak(scales.into_boxed_slice());
    let err = |w: LayerIn<'_>| {
        let c = engram::Context::new(&tiny.config(Tiny::limits())).unwrap();
        c.set_layer(w).unwrap_err()
    };
    // No scale array.
    let e = err(base(EngramType::Fp8E4m3E8m0Split, codes));
    assert_eq!(e.status, EngramStatus::ErrNullArgument, "{}", e.message);
    assert!(e.message.contains("table_scales"), "{}", e.message);
    // A NULL one.
    let mut w = base(EngramType::Fp8E4m3E8m0Split, codes);
    // SAFETY: a NULL region is never read (refused).
    w.table.scales = Some(TableSource::Memory(unsafe { Region::from_raw(0, None) }));
    let e = err(w);
    assert_eq!(e.status, EngramStatus::ErrNullArgument, "{}", e.message);
    // Scales of the wrong size.
    let mut w = base(EngramType::Fp8E4m3E8m0Split, codes);
    w.table.scales = Some(TableSource::Memory(Region::of(&scales[1..])));
    let e = err(w);
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("weights.table_scales"), "{}", e.message);
    // Codes of the packed size (the scales counted twice).
    let mut w = base(EngramType::Fp8E4m3E8m0Split, &l.table);
    w.table.scales = Some(TableSource::Memory(Region::of(scales)));
    let e = err(w);
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("weights.table"), "{}", e.message);
    // A scale array given with a format that keeps its scales in its rows.
    let mut w = base(EngramType::Fp8E4m3E8m0, &l.table);
    w.table.scales = Some(TableSource::Memory(Region::of(scales)));
    let e = err(w);
    assert_eq!(e.status, EngramStatus::ErrInvalidArgument, "{}", e.message);
    assert!(e.message.contains("table_scales"), "{}", e.message);
    // Nothing was set by the failures; the good layer sets.
    let mut w = base(EngramType::Fp8E4m3E8m0Split, codes);
    w.table.scales = Some(TableSource::Memory(Region::of(scales)));
    ctx.set_layer(w).unwrap();
}

// ---- the CUDA kernels' split dequantisation, compiled as host C++ ----

const DRIVER: &str = r#"
#include "engram_common.cuh"
#include <cstdio>
#include <vector>
// Reads `hd n` then n rows of hd codes, then n rows of hd/32 scales; writes
// per row the first error (code, where) in element order and the hd values,
// as eng_dequant_fp8_split_bf16 gives them.
int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *in = std::fopen(argv[1], "rb");
    FILE *out = std::fopen(argv[2], "wb");
    if (!in || !out) return 3;
    eng_u32 hdr[2];
    if (std::fread(hdr, 4, 2, in) != 2) return 4;
    const eng_u32 hd = hdr[0], n = hdr[1], nb = hd / ENG_FP8_SCALE_BLOCK;
    std::vector<eng_u8> codes((size_t)hd * n), scales((size_t)nb * n);
    if (std::fread(codes.data(), 1, codes.size(), in) != codes.size()) return 5;
    if (std::fread(scales.data(), 1, scales.size(), in) != scales.size()) return 6;
    std::vector<eng_u16> vals(hd);
    for (eng_u32 r = 0; r < n; r++) {
        eng_u32 code = 0, where = 0;
        for (eng_u32 i = 0; i < hd; i++) {
            eng_u16 v = 0;
            eng_u32 w = 0;
            eng_u32 c = eng_dequant_fp8_split_bf16(&codes[(size_t)r * hd], &scales[(size_t)r * nb], i, &v, &w);
            if (c != 0 && code == 0) { code = c; where = w; }
            vals[i] = v;
        }
        std::fwrite(&code, 4, 1, out);
        std::fwrite(&where, 4, 1, out);
        std::fwrite(vals.data(), 2, hd, out);
    }
    std::fclose(out);
    return 0;
}
"#;

#[test]
fn the_kernels_split_dequantisation_matches_formats_rs() {
    let gxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&gxx).arg("--version").output().is_err() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIP: no {gxx}: the kernels' split fp8 dequantisation is not checked on the host"
        );
        return;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("fp8_split_host");
    std::fs::create_dir_all(&dir).unwrap();
    let (src, exe) = (dir.join("driver.cpp"), dir.join("driver"));
    std::fs::write(&src, DRIVER).unwrap();
    let out = Command::new(&gxx)
        .args([
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-ffp-contract=off",
        ])
        .args(engram::cuda::kernels::defines())
        .arg("-I")
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ could not build the host driver:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (hd, n) = (256usize, 2048usize);
    let mut packed = random_rows(n, hd, "fp8-split-kernel");
    // The second half without NaN codes, scales over a wide finite range.
    for row in packed[n / 2 * 264..].chunks_exact_mut(264) {
        for c in &mut row[..hd] {
            if *c & 0x7F == 0x7F {
                *c ^= 1;
            }
        }
        for s in &mut row[hd..] {
            *s = 60 + *s % 130;
        }
    }
    let (codes, scales) = split(&packed, hd);
    let (inp, outp) = (dir.join("rows.in"), dir.join("rows.out"));
    let mut f = std::fs::File::create(&inp).unwrap();
    f.write_all(&(hd as u32).to_le_bytes()).unwrap();
    f.write_all(&(n as u32).to_le_bytes()).unwrap();
    f.write_all(&codes).unwrap();
    f.write_all(&scales).unwrap();
    drop(f);
    assert!(Command::new(&exe)
        .arg(&inp)
        .arg(&outp)
        .status()
        .unwrap()
        .success());
    let b = std::fs::read(&outp).unwrap();
    let per = 8 + 2 * hd;
    assert_eq!(b.len(), n * per);
    let mut errors = 0;
    for r in 0..n {
        let c = &b[r * per..(r + 1) * per];
        let code = u32::from_le_bytes(c[0..4].try_into().unwrap());
        let at = u32::from_le_bytes(c[4..8].try_into().unwrap());
        let mut want = vec![0u16; hd];
        match dequant_row_bf16(
            EngramType::Fp8E4m3E8m0,
            &packed[r * 264..(r + 1) * 264],
            &mut want,
        ) {
            Ok(()) => {
                assert_eq!(code, 0, "row {r}: kernel error {code} at {at}");
                let got: Vec<u16> = c[8..]
                    .chunks_exact(2)
                    .map(|x| u16::from_le_bytes([x[0], x[1]]))
                    .collect();
                assert_eq!(got, want, "row {r}");
            }
            Err(e) => {
                errors += 1;
                use engram::cuda::latch::LatchCode;
                let (k, w) = match e {
                    RowDataError::NanScale(b) => (LatchCode::NanScale, b),
                    RowDataError::NanCode(i) => (LatchCode::NanCode, i),
                    RowDataError::NonFinite(i) => (LatchCode::NonFinite, i),
                };
                assert_eq!((code, at), (k as u32, w as u32), "row {r}: error");
            }
        }
    }
    assert!(
        errors > 0 && errors < n / 2 + n / 8,
        "{errors} rows with errors"
    );
    println!(
        "{n} split rows of {hd}: kernel code identical to formats.rs ({errors} with a data error)"
    );
}

// ---- on a GPU: the split gather kernel against the CPU bits ----

/// The split table on the CUDA backend (`engram_gather_split`) gives the CPU
/// backend's rows bit for bit, and a NaN scale in a used row is refused by
/// both with the same status and message. On the GPU, or on the emulation
/// (the kernel itself on the CPU) where there is none; `ENGRAM_REQUIRE_GPU=1`
/// (scripts/gpu-check.sh) requires the GPU.
#[test]
fn split_tables_on_the_gpu_give_the_cpu_bits() {
    use engram::RowIds;
    // The GPU, or the emulation where there is none (tests/common/device.rs).
    let Some(dev) = common::device::device() else {
        return;
    };
    let upload = |data: &[u8]| dev.upload(data);
    let tiny = Tiny::load();
    let l = &tiny.layers[0];
    let (codes, mut scales) = split(&l.table, tiny.hd);
    let bytes = |d: &Dense| -> Vec<u8> {
        match d {
            Dense::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Dense::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    };
    let ty = |d: &Dense| match d {
        Dense::F32(_) => EngramType::F32 as u32,
        Dense::Bf16(_) => EngramType::Bf16 as u32,
    };
    let (d_wkv, d_q, d_k) = (
        upload(&bytes(&l.wkv)),
        upload(&bytes(&l.q)),
        upload(&bytes(&l.k)),
    );
    let c = &tiny.golden["regimes"]["prefill"]["calls"][0];
    let (tokens, seqs, pos) = (i32s(&c["tokens"]), i32s(&c["seq_ids"]), i32s(&c["pos"]));
    let n = tokens.len();
    let cpu = tiny.context();
    let mut ids = vec![0i64; n * cpu.ids_per_token()];
    cpu.hash(&tokens, &seqs, &pos, &mut ids).unwrap();
    for round in 0..2 {
        if round == 1 {
            // A NaN scale in the first used row of layer 1's first live token.
            let per = cpu.ids_per_token();
            let r = (0..n).map(|t| ids[t * per]).find(|&x| x >= 0).unwrap() as usize;
            scales[r * 2] = 255;
        }
        let (d_codes, d_scales) = (upload(&codes), upload(&scales));
        let mut cfg = tiny.config(Tiny::limits());
        cfg.backend = engram::EngramBackend::Cuda as u32;
        cfg.tuning.cuda.device = Some(dev.gpu.clone());
        let gpu_ctx = engram::Context::new(&cfg).expect("a CUDA context");
        // SAFETY: device pointers of the sizes the geometry implies, alive here.
        let mut w = unsafe {
            LayerIn::raw(
                1,
                d_codes.ptr,
                EngramType::Fp8E4m3E8m0Split as u32,
                l.rows,
                d_wkv.ptr,
                ty(&l.wkv),
                d_q.ptr,
                d_k.ptr,
                ty(&l.q),
            )
        };
        // SAFETY: as above.
        w.table.scales = Some(TableSource::Memory(unsafe {
            Region::from_raw(d_scales.ptr as usize, None)
        }));
        gpu_ctx
            .set_layer(w)
            .expect("set_layer with a split table on the GPU");
        let cpu_split = split_context(
            &tiny,
            TableSource::Memory(Region::of(&codes)),
            TableSource::Memory(Region::of(&scales)),
        );
        let got = gpu_ctx.stages_device(1, RowIds::Host(&ids), n);
        let want = cpu_split.stages(1, &ids, n);
        match (got, want) {
            (Ok((g, _)), Ok((w, _))) => {
                assert_eq!(round, 0);
                // stages_device gives every token's rows, stages the live ones'.
                let live: Vec<u16> = g
                    .chunks_exact(cpu.kv_in())
                    .enumerate()
                    .filter(|(t, _)| ids[t * cpu.ids_per_token()] != -1)
                    .flat_map(|(_, r)| r.to_vec())
                    .collect();
                assert_eq!(live, w, "split rows: GPU and CPU");
                println!(
                    "{} split-table row values bit-identical on the GPU",
                    w.len()
                );
            }
            (Err(g), Err(w)) => {
                assert_eq!(round, 1);
                assert_eq!((g.status, &g.message), (w.status, &w.message));
                assert_eq!(g.status, EngramStatus::ErrInvalidData);
            }
            (g, w) => panic!("round {round}: GPU {:?}, CPU {:?}", g.err(), w.err()),
        }
    }
}

// ---- the checkpoint: a bad value named by the tensor that holds it ----

/// A NaN e8m0 scale in the checkpoint's `layers.3.engram.wkv.scale`, or an
/// e4m3 NaN code in its `wkv.weight`, is refused (`ErrInvalidData`) naming
/// that tensor, not the layer's table (issue 34 F9: the message blamed
/// `layers.3.engram.embed.weight (fp8_e4m3_e8m0_split)`).
#[test]
fn a_bad_wkv_value_in_the_checkpoint_names_its_tensor() {
    use engram::gguf::{GgufModel, GgufOptions, LoadOptions};
    let src = golden_dir().join("dialects").join("checkpoint");
    let shard = "model-00001-of-00002.safetensors";
    for (tensor, byte) in [
        ("layers.3.engram.wkv.scale", 255u8),
        ("layers.3.engram.wkv.weight", 0x7F),
    ] {
        let ck = std::env::temp_dir().join(format!("egf9-{}-{tensor}", std::process::id()));
        let _ = std::fs::remove_dir_all(&ck);
        std::fs::create_dir_all(&ck).unwrap();
        for e in std::fs::read_dir(&src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
        }
        std::fs::copy(
            golden_dir().join("deepseek_v4_tokenizer.json"),
            ck.join("tokenizer.json"),
        )
        .unwrap();
        let f = std::fs::File::open(ck.join(shard)).unwrap();
        let len = f.metadata().unwrap().len();
        let h = engram::safetensors::parse_header(&f, len, shard).unwrap();
        let at = h.tensors[tensor].offset as usize + 3;
        drop(f);
        let mut b = std::fs::read(ck.join(shard)).unwrap();
        b[at] = byte;
        std::fs::write(ck.join(shard), b).unwrap();
        let m = GgufModel::open_checkpoint(&ck, None, &LoadOptions::default()).unwrap();
        let e = m
            .context(&GgufOptions {
                limits: Tiny::limits(),
                n_threads: 1,
                backend: engram::EngramBackend::Cpu as u32,
                device: 0,
                eps: 0.0,
                tuning: Default::default(),
                row_cache_bytes: 0,
            })
            .err()
            .unwrap_or_else(|| panic!("a bad value in {tensor} was accepted"));
        assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
        assert!(e.message.contains(tensor), "{tensor}: {}", e.message);
        assert!(!e.message.contains("embed"), "{tensor}: {}", e.message);
        std::fs::remove_dir_all(&ck).unwrap();
    }
}
