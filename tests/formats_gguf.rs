//! GGUF block formats against the oracle `tests/golden/data/gguf_blocks.json`
//! (gguf-py's numpy dequantisers, cross-checked there against a transcription
//! of ggml's C loops; written by `tests/golden/gen_formats.py`).
//!
//! Every stored block is dequantised alone and as part of wider rows; f32
//! values must equal the oracle bit for bit (any NaN equals any NaN) and bf16
//! values must be the round-to-nearest-even of the oracle's f32, computed here
//! independently of the library.

use engram::formats::{
    dequant_row_bf16, dequant_row_f32, EngramType, RowDataError, WeightDtype, WeightFormat, Weights,
};
use engram::EngramStatus;
use serde_json::Value;

const FORMATS: [(&str, EngramType); 7] = [
    ("q8_0", EngramType::Q8_0),
    ("q4_0", EngramType::Q4_0),
    ("q2_K", EngramType::Q2_K),
    ("q3_K", EngramType::Q3_K),
    ("q4_K", EngramType::Q4_K),
    ("q5_K", EngramType::Q5_K),
    ("q6_K", EngramType::Q6_K),
];

/// One oracle block: its label, bytes and f32 bit patterns.
struct Block {
    label: String,
    bytes: Vec<u8>,
    f32: Vec<u32>,
}

struct Oracle {
    ty: EngramType,
    values: usize,
    bytes: usize,
    blocks: Vec<Block>,
}

fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2));
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn load() -> Vec<(&'static str, Oracle)> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/data/gguf_blocks.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let doc: Value = serde_json::from_str(&text).unwrap();
    FORMATS
        .iter()
        .map(|&(name, ty)| {
            let f = &doc["formats"][name];
            assert_eq!(f["ggml_type"].as_u64(), Some(ty as u64), "{name}");
            let values = f["block_values"].as_u64().unwrap() as usize;
            let bytes = f["block_bytes"].as_u64().unwrap() as usize;
            let blocks = f["blocks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    let raw = unhex(b["bytes"].as_str().unwrap());
                    let fb = unhex(b["f32"].as_str().unwrap());
                    assert_eq!(raw.len(), bytes);
                    assert_eq!(fb.len(), 4 * values);
                    Block {
                        label: b["label"].as_str().unwrap().to_string(),
                        bytes: raw,
                        f32: fb
                            .chunks_exact(4)
                            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
                            .collect(),
                    }
                })
                .collect();
            (
                name,
                Oracle {
                    ty,
                    values,
                    bytes,
                    blocks,
                },
            )
        })
        .collect()
}

fn is_nan(b: u32) -> bool {
    b & 0x7fff_ffff > 0x7f80_0000
}

/// bf16 round to nearest, ties to even, of f32 bits (NaN stays a NaN).
fn rne_bf16(b: u32) -> u16 {
    if is_nan(b) {
        return 0x7fc0;
    }
    ((b as u64 + 0x7fff + ((b >> 16) & 1) as u64) >> 16) as u16
}

/// Compare a row's f32 and bf16 results with the oracle's f32 bits.
fn check(what: &str, want: &[u32], got_f32: &[f32], got_bf16: &[u16]) {
    for (i, ((&w, &g), &gb)) in want.iter().zip(got_f32).zip(got_bf16).enumerate() {
        let gbits = g.to_bits();
        if is_nan(w) {
            assert!(
                g.is_nan(),
                "{what}: value {i}: want NaN, got {g:e} ({gbits:#010x})"
            );
            assert!(
                gb & 0x7fff > 0x7f80,
                "{what}: value {i}: want bf16 NaN, got {gb:#06x}"
            );
        } else {
            assert_eq!(
                gbits,
                w,
                "{what}: value {i}: want {:e}, got {g:e}",
                f32::from_bits(w)
            );
            assert_eq!(gb, rne_bf16(w), "{what}: value {i}: bf16");
        }
    }
}

/// Both dequantisations of a row; a row holding a value that is not finite
/// must be refused, naming the first such element, with every value still
/// written (the bits are checked all the same).
fn dequant_both(f: EngramType, row: &[u8], width: usize) -> (Vec<f32>, Vec<u16>) {
    let mut o32 = vec![0f32; width];
    let mut o16 = vec![0u16; width];
    let r32 = dequant_row_f32(f, row, &mut o32);
    let r16 = dequant_row_bf16(f, row, &mut o16);
    let bad32 = o32.iter().position(|v| !v.is_finite());
    let bad16 = o16.iter().position(|&b| b & 0x7f80 == 0x7f80);
    assert_eq!(
        r32,
        bad32.map_or(Ok(()), |i| Err(RowDataError::NonFinite(i)))
    );
    assert_eq!(
        r16,
        bad16.map_or(Ok(()), |i| Err(RowDataError::NonFinite(i)))
    );
    (o32, o16)
}

#[test]
fn every_oracle_block_dequantises_bit_exactly() {
    let mut total = 0;
    for (name, o) in load() {
        let f = EngramType::row_format(o.ty as u32, o.values).unwrap();
        assert_eq!(f.name(), name);
        assert_eq!(f.block(), Some((o.values, o.bytes)), "{name}");
        assert_eq!(f.row_bytes(o.values), o.bytes, "{name}");
        for b in &o.blocks {
            let (g32, g16) = dequant_both(f, &b.bytes, o.values);
            check(&format!("{name} {}", b.label), &b.f32, &g32, &g16);
        }
        assert!(o.blocks.len() >= 80, "{name}: {} blocks", o.blocks.len());
        total += o.blocks.len();
    }
    assert!(total >= 1000, "{total} blocks");
}

#[test]
fn the_oracle_covers_the_edge_cases() {
    for (name, o) in load() {
        let labels: Vec<&str> = o.blocks.iter().map(|b| b.label.as_str()).collect();
        for must in [
            "d = +0",
            "d = -max normal",
            "d = min normal",
            "d = min subnormal",
            "d = nan",
            "d = +inf",
            "quant bits all set",
            "quant bits all clear",
        ] {
            assert!(labels.contains(&must), "{name} lacks {must}");
        }
        let nan = o.blocks.iter().filter(|b| b.f32.iter().any(|&v| is_nan(v)));
        assert!(nan.count() >= 2, "{name}: NaN blocks");
        if name != "q8_0" && name != "q4_0" {
            assert!(labels.contains(&"scale bits all set"), "{name}");
        }
        if matches!(name, "q2_K" | "q4_K" | "q5_K") {
            assert!(labels.contains(&"d = dmin = 0"), "{name}");
            assert!(labels.contains(&"dmin = -inf"), "{name}");
        }
    }
}

#[test]
fn wide_rows_are_consecutive_blocks() {
    for (name, o) in load() {
        for per_row in [2usize, 3, 8] {
            let width = per_row * o.values;
            let f = EngramType::row_format(o.ty as u32, width).unwrap();
            assert_eq!(f.row_bytes(width), per_row * o.bytes);
            for (ri, chunk) in o.blocks.chunks_exact(per_row).enumerate() {
                let row: Vec<u8> = chunk.iter().flat_map(|b| b.bytes.clone()).collect();
                let want: Vec<u32> = chunk.iter().flat_map(|b| b.f32.clone()).collect();
                let (g32, g16) = dequant_both(f, &row, width);
                check(&format!("{name} width {width} row {ri}"), &want, &g32, &g16);
            }
        }
    }
}

#[test]
fn widths_must_be_whole_blocks() {
    for (name, ty) in FORMATS {
        let bl = if name.ends_with("_K") { 256 } else { 32 };
        for w in [bl, 2 * bl, 20 * bl] {
            assert!(EngramType::row_format(ty as u32, w).is_ok(), "{name} {w}");
        }
        for w in [1, bl / 2, bl - 1, bl + 1, bl + 16, 3 * bl / 2] {
            let e = EngramType::row_format(ty as u32, w).unwrap_err();
            assert_eq!(e.status, EngramStatus::ErrUnsupported, "{name} {w}");
            assert!(
                e.message.contains(name) && e.message.contains(&format!("multiple of {bl}")),
                "{name} {w}: {}",
                e.message
            );
        }
    }
    // q8_0 / q4_0 blocks are 32 wide: 96 is fine for them, not for K-quants.
    assert!(EngramType::row_format(EngramType::Q8_0 as u32, 96).is_ok());
    assert!(EngramType::row_format(EngramType::Q4_K as u32, 96).is_err());
}

#[test]
fn row_bytes_for_hd_256() {
    let want = [
        (EngramType::Q8_0, 272),
        (EngramType::Q4_0, 144),
        (EngramType::Q2_K, 84),
        (EngramType::Q3_K, 110),
        (EngramType::Q4_K, 144),
        (EngramType::Q5_K, 176),
        (EngramType::Q6_K, 210),
        (EngramType::Fp8E4m3E8m0, 264),
        (EngramType::Bf16, 512),
        (EngramType::F16, 512),
        (EngramType::F32, 1024),
    ];
    for (ty, bytes) in want {
        let f = EngramType::row_format(ty as u32, 256).unwrap();
        assert_eq!(f.row_bytes(256), bytes, "{}", ty.name());
        assert_eq!(f, ty);
        assert_eq!(f.row_bytes(1024), 4 * bytes, "{}", ty.name());
    }
}

#[test]
#[should_panic]
fn a_short_row_is_refused() {
    let f = EngramType::row_format(EngramType::Q4_K as u32, 256).unwrap();
    let mut out = [0f32; 256];
    let _ = dequant_row_f32(f, &[0u8; 143], &mut out);
}

#[test]
fn quantised_weights_read_as_the_oracle() {
    for (name, o) in load() {
        // Rows of 4 blocks (K-quants: 1024 values; q8_0 / q4_0: 128).
        let row_len = 4 * o.values;
        let n_rows = o.blocks.len() / 4;
        let blocks = &o.blocks[..4 * n_rows];
        let data: Vec<u8> = blocks.iter().flat_map(|b| b.bytes.clone()).collect();
        let want: Vec<u32> = blocks.iter().flat_map(|b| b.f32.clone()).collect();
        let f = EngramType::row_format(o.ty as u32, row_len).unwrap();
        let w = Weights::quant(f, &data, row_len).unwrap();
        assert_eq!(w.len(), n_rows * row_len, "{name}");
        let same = |i: usize, g: f32| {
            if is_nan(want[i]) {
                g.is_nan()
            } else {
                g.to_bits() == want[i]
            }
        };
        // Whole rows (the projection's use).
        let mut row = vec![0f32; row_len];
        for r in 0..n_rows {
            w.to_f32(r * row_len, &mut row);
            for (j, &g) in row.iter().enumerate() {
                assert!(same(r * row_len + j, g), "{name} row {r} value {j}");
            }
        }
        // Ranges that start and end inside blocks, and spans of several rows.
        let len = w.len();
        for (start, n) in [
            (0, len),
            (1, 5),
            (o.values - 3, 7),
            (o.values / 2, 3 * o.values),
            (row_len + 17, 2 * row_len),
            (len - 9, 9),
            (len - 1, 1),
            (len, 0),
        ] {
            let mut out = vec![0f32; n];
            w.to_f32(start, &mut out);
            for (j, &g) in out.iter().enumerate() {
                assert!(same(start + j, g), "{name} to_f32({start}, {n}) value {j}");
            }
        }
        for i in (0..len).step_by(97).chain([len - 1]) {
            assert!(same(i, w.get(i)), "{name} get({i})");
        }
    }
}

#[test]
#[should_panic]
fn quantised_weights_refuse_reads_past_the_end() {
    let data = [0u8; 2 * 34];
    let w = Weights::quant(EngramType::Q8_0, &data, 32).unwrap();
    let mut out = [0f32; 2];
    w.to_f32(63, &mut out);
}

#[test]
fn quantised_weights_check_their_sizes() {
    let data = vec![0u8; 3 * 144];
    assert!(Weights::quant(EngramType::Q4_K, &data, 256).is_ok());
    assert_eq!(
        Weights::quant(EngramType::Q4_K, &data, 128)
            .unwrap_err()
            .status,
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        Weights::quant(EngramType::Q4_K, &data, 0)
            .unwrap_err()
            .status,
        EngramStatus::ErrUnsupported
    );
    assert_eq!(
        Weights::quant(EngramType::Q4_K, &data, 512)
            .unwrap_err()
            .status,
        EngramStatus::ErrInvalidArgument
    );
    assert!(Weights::quant(EngramType::Bf16, &data, 256).is_err());
    assert!(Weights::quant(EngramType::Fp8E4m3E8m0, &data, 256).is_err());
}

#[test]
fn weight_formats_describe_dense_and_quantised_weights() {
    let k = 24 * 256; // wkv's row length for V4.1 (C * Hd)
    assert_eq!(
        WeightFormat::new(EngramType::F32 as u32, k, "wkv").unwrap(),
        WeightFormat::Dense(WeightDtype::F32)
    );
    assert_eq!(
        WeightFormat::new(EngramType::Bf16 as u32, k, "wkv").unwrap(),
        WeightFormat::Dense(WeightDtype::Bf16)
    );
    for (name, ty) in FORMATS {
        let wf = WeightFormat::new(ty as u32, k, "wkv").unwrap();
        let f = EngramType::row_format(ty as u32, k).unwrap();
        assert_eq!(wf, WeightFormat::Quant(f), "{name}");
        assert_eq!(wf.bytes(10, k), Some(10 * f.row_bytes(k)), "{name}");
        let e = WeightFormat::new(ty as u32, k + 16, "wkv").unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrUnsupported);
        assert!(e.message.starts_with("wkv: "), "{}", e.message);
    }
    assert_eq!(WeightFormat::Dense(WeightDtype::Bf16).bytes(3, 5), Some(30));
    assert_eq!(
        WeightFormat::Dense(WeightDtype::F32).bytes(usize::MAX, 2),
        None
    );
    // f16 is read in place like the block formats (ds4's GGUFs carry wkv so).
    assert_eq!(
        WeightFormat::new(EngramType::F16 as u32, k, "wkv").unwrap(),
        WeightFormat::Quant(EngramType::F16)
    );
    for ty in [EngramType::Fp8E4m3E8m0 as u32, 77] {
        let e = WeightFormat::new(ty, k, "wkv").unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrUnsupported);
        assert!(e.message.contains("wkv"), "{}", e.message);
    }
    // q / k stay dense: WeightDtype still refuses quantised types.
    assert!(WeightDtype::new(EngramType::Q8_0 as u32, "q").is_err());
}

#[test]
fn a_nan_or_infinite_d_is_invalid_data() {
    // q8_0 with d = +inf: code 0 gives NaN (inf * 0), others +-inf: the values
    // ggml computes, and the row is refused from its first element.
    let mut b = [0u8; 34];
    b[0..2].copy_from_slice(&0x7c00u16.to_le_bytes());
    b[3] = 1;
    b[4] = 0xff; // -1
    let f = EngramType::Q8_0;
    let (g32, g16) = dequant_both(f, &b, 32);
    assert!(g32[0].is_nan() && g32[1] == f32::INFINITY && g32[2] == f32::NEG_INFINITY);
    assert!(g16[0] & 0x7fff > 0x7f80 && g16[1] == 0x7f80 && g16[2] == 0xff80);
    let mut o = vec![0u16; 32];
    assert_eq!(
        dequant_row_bf16(f, &b, &mut o),
        Err(RowDataError::NonFinite(0))
    );
}
