//! The kernels' dequantisation (`kernels/engram_common.cuh`), compiled as host
//! C++ with g++, against `src/formats.rs` bit for bit, for every row format, on
//! random rows and on the golden rows. This checks the kernel code's logic on a
//! machine without a GPU; `tests/cuda_golden.rs` checks the kernels themselves
//! on one. (The header is plain C++ on bit patterns and marks its roundings
//! explicitly, so host and device compute the same values; the one documented
//! exception is the payload of a NaN produced by arithmetic, which the random
//! rows here avoid for the GGUF formats.)
//!
//! Skips, saying so, when there is no g++.

mod common;

use common::*;
use engram::cuda::latch::LatchCode;
use engram::formats::dequant_row_bf16;
use engram::EngramType;
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;

/// A host program that reads `fmt hd n_rows` then the rows' bytes from a file,
/// and writes per row: the error code (u32), the error position (u32) and the
/// `hd` bf16 values (u16), as `eng_dequant_bf16` gives them.
const DRIVER: &str = r#"
#include "engram_common.cuh"
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char **argv) {
    if (argc != 3) return 2;
    FILE *in = std::fopen(argv[1], "rb");
    FILE *out = std::fopen(argv[2], "wb");
    if (!in || !out) return 3;
    eng_u32 hdr[3];
    if (std::fread(hdr, 4, 3, in) != 3) return 4;
    const eng_u32 fmt = hdr[0], hd = hdr[1], n = hdr[2];
    const eng_u32 rb = eng_row_bytes(fmt, hd);
    std::vector<eng_u8> row(rb);
    std::vector<eng_u16> vals(hd);
    for (eng_u32 r = 0; r < n; r++) {
        if (std::fread(row.data(), 1, rb, in) != rb) return 5;
        eng_u32 code = 0, where = 0;
        for (eng_u32 i = 0; i < hd; i++) {
            eng_u16 v = 0;
            eng_u32 w = 0;
            eng_u32 c = eng_dequant_bf16(fmt, row.data(), hd, i, &v, &w);
            // The first failing element in row order, scale before code within
            // a block (the CPU's order): the lowest (block, kind, index).
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

/// The driver, built once per test process (the tests run in parallel).
/// The host driver, built once per run; `None` (each calling test says it
/// checks nothing, tests/common/device.rs `skip`) without g++, a failure
/// instead where the test command promised the emulation
/// (`ENGRAM_REQUIRE_EMULATION=1`).
fn build_driver() -> Option<PathBuf> {
    static EXE: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    let exe = EXE.get_or_init(build_driver_once).clone();
    if exe.is_none() {
        assert!(
            !std::env::var("ENGRAM_REQUIRE_EMULATION").is_ok_and(|v| v == "1"),
            "ENGRAM_REQUIRE_EMULATION=1 but there is no g++ (CXX) to build the host driver"
        );
        common::device::skip(
            "no g++ (CXX): the kernels' dequantisation is not checked on the host",
        );
    }
    exe
}

fn build_driver_once() -> Option<PathBuf> {
    let gxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&gxx).arg("--version").output().is_err() {
        return None;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda_kernels_host");
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("driver.cpp");
    std::fs::write(&src, DRIVER).unwrap();
    let exe = dir.join("driver");
    let kernels = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let out = Command::new(&gxx)
        .args([
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-ffp-contract=off",
        ])
        // The constants the kernels share with Rust, as NVRTC gets them.
        .args(engram::cuda::kernels::defines())
        .arg("-I")
        .arg(&kernels)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run g++");
    assert!(
        out.status.success(),
        "g++ could not build the host driver of kernels/engram_common.cuh:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(exe)
}

/// Run the driver over `rows` rows of `fmt`; per row (code, where, values).
fn run(exe: &PathBuf, fmt: EngramType, hd: usize, table: &[u8]) -> Vec<(u32, u32, Vec<u16>)> {
    let rb = fmt.row_bytes(hd);
    assert_eq!(table.len() % rb, 0);
    let n = table.len() / rb;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cuda_kernels_host");
    let tag = format!("{}_{}_{n}", fmt.name(), std::process::id());
    let (inp, outp) = (
        dir.join(format!("{tag}.in")),
        dir.join(format!("{tag}.out")),
    );
    let mut f = std::fs::File::create(&inp).unwrap();
    for v in [fmt as u32, hd as u32, n as u32] {
        f.write_all(&v.to_le_bytes()).unwrap();
    }
    f.write_all(table).unwrap();
    drop(f);
    let st = Command::new(exe).arg(&inp).arg(&outp).status().unwrap();
    assert!(st.success(), "driver failed: {st}");
    let b = std::fs::read(&outp).unwrap();
    let _ = std::fs::remove_file(&inp);
    let _ = std::fs::remove_file(&outp);
    let per = 8 + 2 * hd;
    assert_eq!(b.len(), n * per);
    b.chunks_exact(per)
        .map(|c| {
            let code = u32::from_le_bytes(c[0..4].try_into().unwrap());
            let at = u32::from_le_bytes(c[4..8].try_into().unwrap());
            let v = c[8..]
                .chunks_exact(2)
                .map(|x| u16::from_le_bytes([x[0], x[1]]))
                .collect();
            (code, at, v)
        })
        .collect()
}

fn compare(exe: &PathBuf, fmt: EngramType, hd: usize, table: &[u8], what: &str) -> usize {
    let rb = fmt.row_bytes(hd);
    let got = run(exe, fmt, hd, table);
    let mut errors = 0;
    for (r, (code, at, vals)) in got.iter().enumerate() {
        let mut want = vec![0u16; hd];
        match dequant_row_bf16(fmt, &table[r * rb..(r + 1) * rb], &mut want) {
            Ok(()) => {
                assert_eq!(
                    *code, 0,
                    "{what}: row {r}: kernel code reports error {code} at {at}"
                );
                for i in 0..hd {
                    assert_eq!(
                        vals[i], want[i],
                        "{what}: row {r} value {i}: kernel code {:#06x}, formats.rs {:#06x}",
                        vals[i], want[i]
                    );
                }
            }
            Err(e) => {
                errors += 1;
                let expect = match e {
                    engram::formats::RowDataError::NanScale(b) => (LatchCode::NanScale, b),
                    engram::formats::RowDataError::NanCode(i) => (LatchCode::NanCode, i),
                    engram::formats::RowDataError::NonFinite(i) => (LatchCode::NonFinite, i),
                };
                let expect = (expect.0 as u32, expect.1 as u32);
                // The kernel reports the first failing element in element
                // order; a NaN scale is seen at its block's first element.
                assert_eq!((*code, *at), expect, "{what}: row {r}: error");
            }
        }
    }
    errors
}

/// Random bytes for `rows` rows of `fmt`, with the GGUF formats' f16 `d` and
/// `dmin` kept finite (the one place host and GPU NaN payloads could differ).
fn random_table(fmt: EngramType, hd: usize, rows: usize, seed: &str) -> Vec<u8> {
    let f = Filler::new(seed);
    let rb = fmt.row_bytes(hd);
    let mut t: Vec<u8> = (0..rows * rb).map(|i| f.bits(i as u64) as u8).collect();
    let finite = |t: &mut [u8], at: usize| {
        if t[at + 1] & 0x7C == 0x7C {
            t[at + 1] &= !0x40; // exponent 0b11xxx -> 0b10xxx: finite
        }
    };
    if let Some((bl, bb)) = fmt.block() {
        let f16_at: &[usize] = match fmt {
            EngramType::Q8_0 | EngramType::Q4_0 => &[0],
            EngramType::Q2_K => &[80, 82],
            EngramType::Q3_K => &[108],
            EngramType::Q4_K | EngramType::Q5_K => &[0, 2],
            EngramType::Q6_K => &[208],
            _ => &[],
        };
        for blk in 0..rows * hd / bl {
            for &o in f16_at {
                finite(&mut t, blk * bb + o);
            }
        }
    }
    t
}

#[test]
fn kernel_dequantisation_matches_formats_rs_on_random_rows() {
    let Some(exe) = build_driver() else { return };
    let types = [
        EngramType::F32,
        EngramType::F16,
        EngramType::Bf16,
        EngramType::Fp8E4m3E8m0,
        EngramType::Q8_0,
        EngramType::Q4_0,
        EngramType::Q2_K,
        EngramType::Q3_K,
        EngramType::Q4_K,
        EngramType::Q5_K,
        EngramType::Q6_K,
    ];
    for t in types {
        let hd = 256;
        let fmt = EngramType::row_format(t as u32, hd).unwrap();
        let table = random_table(fmt, hd, 64, &format!("cuda-host-{}", fmt.name()));
        let errors = compare(&exe, fmt, hd, &table, fmt.name());
        if fmt == EngramType::Fp8E4m3E8m0 {
            // Random fp8 rows hit NaN codes and scales: the error paths are compared too.
            assert!(errors > 0, "random fp8 rows should include NaN codes");
        }
        println!(
            "{}: 64 rows of {hd} identical ({errors} rows with a data error, same error)",
            fmt.name()
        );
    }
    // fp8 without NaN codes, with the whole scale range (subnormal results included).
    let fmt = EngramType::row_format(EngramType::Fp8E4m3E8m0 as u32, 64).unwrap();
    let f = Filler::new("cuda-host-fp8-clean");
    let mut table = Vec::new();
    for r in 0..512u64 {
        for i in 0..64u64 {
            let c = f.bits(r * 64 + i) as u8;
            table.push(if c & 0x7F == 0x7F { c ^ 1 } else { c });
        }
        table.push((r % 255) as u8);
        table.push((254 - r % 255) as u8);
    }
    // The rows whose largest scale makes some value overflow bf16 are invalid
    // data on both sides (|v| * 2^(s-127) rounds to infinity from
    // (2 - 2^-8) * 2^127 up); count them here, independently of the library.
    let e4m3 = |c: u8| -> f64 {
        let (e, m) = (((c >> 3) & 0xF) as i32, (c & 7) as f64);
        if e == 0 {
            m * 2f64.powi(-9)
        } else {
            (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    };
    let limit = (2.0 - 2f64.powi(-8)) * 2f64.powi(127);
    let overflowing = table
        .chunks_exact(66)
        .filter(|row| {
            (0..64).any(|i| e4m3(row[i] & 0x7F) * 2f64.powi(row[64 + i / 32] as i32 - 127) >= limit)
        })
        .count();
    assert!(overflowing > 0);
    assert_eq!(
        compare(&exe, fmt, 64, &table, "fp8 scales 0..254"),
        overflowing
    );
}

#[test]
fn kernel_dequantisation_matches_the_golden_rows() {
    let Some(exe) = build_driver() else { return };
    let g = load_json("tiny.json");
    for fmt in ["fp8", "bf16", "f32"] {
        let f = &g["formats"][fmt];
        let (rows, hd) = (
            f["rows"].as_u64().unwrap() as usize,
            f["Hd"].as_u64().unwrap() as usize,
        );
        let name = f["name"].as_str().unwrap();
        let table = table_bytes(name, fmt, rows, hd, true);
        let rf = EngramType::row_format(engram_type(fmt) as u32, hd).unwrap();
        let got = run(&exe, rf, hd, &table);
        let want = u16s(&f["dequant_bf16"]);
        for (r, (code, _, vals)) in got.iter().enumerate() {
            assert_eq!(*code, 0);
            assert_eq!(vals[..], want[r * hd..(r + 1) * hd], "{fmt} row {r}");
        }
    }
    // GGUF blocks: every block of the gguf-py oracle, as a row of one block.
    let g = load_json("gguf_blocks.json");
    for (name, v) in g["formats"].as_object().unwrap() {
        let t = EngramType::from_u32(v["ggml_type"].as_u64().unwrap() as u32).unwrap();
        let bl = v["block_values"].as_u64().unwrap() as usize;
        let fmt = EngramType::row_format(t as u32, bl).unwrap();
        let table: Vec<u8> = v["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|b| hex(b["bytes"].as_str().unwrap()))
            .collect();
        let n = table.len() / fmt.row_bytes(bl);
        compare(&exe, fmt, bl, &table, name);
        println!("{name}: {n} oracle blocks identical");
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}
