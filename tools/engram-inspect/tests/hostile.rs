//! engram-inspect against hostile files (issue 21): it fails (exit 1) where
//! the loaders refuse a file's weights, it survives header counts that ask
//! for more memory than there is (exit 2, a message), and it never prints a
//! control character taken from a file.

use engram::gguf::{Gguf, GgufModel, LoadOptions};
use engram::EngramStatus;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/data")
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("egfs-inspect-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn inspect(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_engram-inspect"))
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Exit 1 with a FAIL line naming `names`.
fn fails(o: &Output, names: &[&str]) {
    let t = text(o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    let fail = t
        .lines()
        .find(|l| l.contains("FAIL"))
        .unwrap_or_else(|| panic!("{t}"));
    for n in names {
        assert!(fail.contains(n), "the FAIL line does not name {n}: {t}");
    }
}

/// A ds4 file with one f16 NaN in a layer's `engram_kv`: the loaders refuse
/// it (`ErrInvalidData`), and inspect fails with the same message.
#[test]
fn a_nan_in_an_f16_wkv_fails_inspect_as_it_fails_the_loader() {
    let d = scratch("ds4");
    let mut b = std::fs::read(golden().join("dialects/ds4.gguf")).unwrap();
    let g = Gguf::parse(&b).unwrap();
    let t = g
        .tensors
        .iter()
        .find(|t| t.name.ends_with("engram_kv.weight") && t.ty == 1)
        .expect("an f16 engram_kv in the ds4 fixture");
    let at = t.offset as usize + 2 * 5;
    b[at..at + 2].copy_from_slice(&0x7E00u16.to_le_bytes());
    let p = d.join("ds4.gguf");
    std::fs::write(&p, &b).unwrap();
    for mmap in [false, true] {
        let o = LoadOptions {
            mmap,
            ..LoadOptions::default()
        };
        let e = GgufModel::open(&p, &o).err().unwrap();
        assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
    }
    fails(&inspect(&[&p]), &["ErrInvalidData", &t.name, "element 5"]);
    std::fs::remove_dir_all(&d).unwrap();
}

/// A checkpoint with one e4m3 NaN code in its fp8 `wkv`.
#[test]
fn a_nan_code_in_an_fp8_wkv_fails_inspect_as_it_fails_the_loader() {
    let d = scratch("ckpt");
    let ck = d.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    for e in std::fs::read_dir(golden().join("dialects/checkpoint")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
    }
    std::fs::copy(
        golden().join("deepseek_v4_tokenizer.json"),
        ck.join("tokenizer.json"),
    )
    .unwrap();
    let name = "layers.3.engram.wkv.weight";
    let mut hit = false;
    for e in std::fs::read_dir(&ck).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let f = std::fs::File::open(&p).unwrap();
        let len = f.metadata().unwrap().len();
        let h = engram::safetensors::parse_header(&f, len, "shard").unwrap();
        if let Some(t) = h.tensors.get(name) {
            assert_eq!(t.dtype, "F8_E4M3");
            let mut b = std::fs::read(&p).unwrap();
            b[t.offset as usize + 3] = 0x7F;
            std::fs::write(&p, &b).unwrap();
            hit = true;
        }
    }
    assert!(hit, "{name} in the checkpoint fixture");
    // The fp8 wkv is kept as stored: the loader's context scans it when it
    // sets each layer (engram_create_from_safetensors fails there).
    let m = GgufModel::open_checkpoint(&ck, None, &LoadOptions::default()).unwrap();
    let e = m
        .context(&engram::gguf::GgufOptions {
            limits: engram::Limits {
                max_tokens: 1,
                max_seqs: 1,
                max_positions: 1,
            },
            n_threads: 1,
            backend: engram::EngramBackend::Cpu as u32,
            device: 0,
            eps: 0.0,
            tuning: engram::Tuning::default(),
            row_cache_bytes: 0,
        })
        .err()
        .unwrap();
    assert_eq!(e.status, EngramStatus::ErrInvalidData, "{}", e.message);
    fails(
        &inspect(&[&ck]),
        &["ErrInvalidData", "layer 3", "weights.wkv", "NaN code"],
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// A 24-byte GGUF header claiming as many entries as 16 GiB can hold at the
/// start of a sparse 16 GiB file: a message and exit 2, not an abort.
#[test]
fn huge_header_counts_in_a_sparse_file_are_a_message() {
    let d = scratch("sparse");
    let p = d.join("sparse.gguf");
    let mut h = b"GGUF".to_vec();
    h.extend_from_slice(&3u32.to_le_bytes());
    // As many entries as the bytes left hold at their smallest (32 bytes a
    // tensor entry, 13 a metadata entry).
    let left = (16u64 << 30) - 24;
    h.extend_from_slice(&(left / 32).to_le_bytes());
    h.extend_from_slice(&(left / 13).to_le_bytes());
    std::fs::write(&p, &h).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(16 << 30)
        .unwrap();
    let o = inspect(&[&p]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("ErrFormat"), "{t}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A metadata key holding CR and ESC (a fake "ok" line and a terminal
/// escape) reaches inspect's output escaped.
#[test]
fn control_characters_from_a_file_are_escaped_in_the_output() {
    let d = scratch("ctrl");
    let b = std::fs::read(golden().join("dialects/tarruda.gguf")).unwrap();
    let g = Gguf::parse(&b).unwrap();
    // Two keys of one length renamed to the same name with CR and ESC in it
    // (a fake "ok" line, a terminal escape): "appears twice" names it.
    let fake = "\r  ok    \x1b[2K";
    let (k0, k1) = g
        .kvs
        .iter()
        .enumerate()
        .find_map(|(i, a)| {
            g.kvs[i + 1..]
                .iter()
                .find(|b| b.key.len() == a.key.len() && a.key.len() >= fake.len())
                .map(|b| (a, b))
        })
        .expect("two keys of one length");
    let new: String = fake
        .chars()
        .chain(std::iter::repeat('x'))
        .take(k0.key.len())
        .collect();
    let mut b = b.clone();
    for k in [k0, k1] {
        b[k.type_at - k.key.len()..k.type_at].copy_from_slice(new.as_bytes());
    }
    let p = d.join("ctrl.gguf");
    std::fs::write(&p, &b).unwrap();
    let o = inspect(&[&p]);
    let t = text(&o);
    assert_ne!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("\\r  ok    \\u{1b}[2K"), "{t}");
    assert!(
        !t.chars().any(|c| c.is_control() && c != '\n'),
        "a control character in the output: {t:?}"
    );
    // The library's message, too.
    let e = GgufModel::open(&p, &LoadOptions::default()).err().unwrap();
    assert!(!e.message.chars().any(char::is_control), "{:?}", e.message);
    std::fs::remove_dir_all(&d).unwrap();
}
