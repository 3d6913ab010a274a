//! Hostile model files (issue 21): paths recorded in a file stay inside the
//! model's directory, header counts reserve nothing before they are parsed,
//! control characters never reach a message raw, and an early vcruz305 file
//! with the `deepseek4.` key prefix reads its pad as the compressed id.

mod common;

use common::*;
use engram::gguf::{Gguf, GgufModel, LoadOptions, Value as GValue};
use engram::EngramStatus;
use std::path::{Path, PathBuf};

fn dialects() -> PathBuf {
    golden_dir().join("dialects")
}

/// A fresh scratch directory (short: recorded paths are rewritten in place).
fn scratch(tag: &str) -> PathBuf {
    let d = PathBuf::from(format!("/tmp/egfs-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `path` made exactly `n` bytes long without changing what it names (extra
/// slashes after its first component, or a leading `./`).
fn pad_path(path: &str, n: usize) -> String {
    let mut p = path.to_string();
    if !p.contains('/') {
        p = format!("./{p}");
    }
    assert!(p.len() <= n, "{p} is longer than {n} bytes");
    let at = p.find('/').unwrap();
    p.insert_str(at, &"/".repeat(n - p.len()));
    p
}

/// `b` (a GGUF file) with the string value of `key` replaced by `new`, of the
/// same length (so that nothing else moves).
fn set_string(b: &mut [u8], key: &str, new: &str) {
    let g = Gguf::parse(b).unwrap();
    let kv = g.get(key).unwrap();
    let GValue::Str(old) = &kv.value else {
        panic!("{key} is not a string")
    };
    let new = pad_path(new, old.len());
    let at = kv.type_at + 4 + 8;
    b[at..at + new.len()].copy_from_slice(new.as_bytes());
}

const DS4GW_KEYS: [&str; 2] = [
    "deepseek4.engram.0.table_path",
    "deepseek4.engram.1.table_path",
];

/// The "ds4gw" fixture in `dir` with both layers' table paths set to `path`.
fn ds4gw_recording(dir: &Path, path: &str) -> PathBuf {
    let mut b = std::fs::read(dialects().join("ds4gw_style.gguf")).unwrap();
    for k in DS4GW_KEYS {
        set_string(&mut b, k, path);
    }
    let p = dir.join("m.gguf");
    std::fs::write(&p, b).unwrap();
    p
}

const SHARD: &str = "model-00002-of-00002.safetensors";

/// A copy of the shard that holds the tables, at `p` (outside or inside).
fn copy_shard(p: &Path) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::copy(dialects().join("checkpoint").join(SHARD), p).unwrap();
}

fn open(p: &Path, tables_dir: Option<&Path>) -> engram::Result<GgufModel> {
    GgufModel::open(
        p,
        &LoadOptions {
            tables_dir,
            ..LoadOptions::default()
        },
    )
}

fn refused(r: engram::Result<GgufModel>, status: EngramStatus, names: &[&str]) -> String {
    let e = r.err().expect("the file must be refused");
    assert_eq!(e.status, status, "{}", e.message);
    for n in names {
        assert!(
            e.message.contains(n),
            "the message does not name {n}: {}",
            e.message
        );
    }
    e.message
}

/// A table path that is absolute, climbs out with `..`, or passes through a
/// link that leads outside is never opened; one inside the model's directory
/// (a file name, a relative path, a link that stays inside) is.
#[test]
fn paths_from_a_model_file_stay_inside_the_model_directory() {
    let s = scratch("paths");
    let model = s.join("model");
    let private = s.join("private").join("p.safetensors");
    copy_shard(&private);
    std::fs::create_dir_all(&model).unwrap();

    // Absolute, naming a file elsewhere: only its file name is looked for,
    // in the model's directory, where there is none.
    let abs = private.to_str().unwrap().to_string();
    let m = ds4gw_recording(&model, &abs);
    let msg = refused(
        open(&m, None),
        EngramStatus::ErrIo,
        &[DS4GW_KEYS[0], "p.safetensors"],
    );
    assert!(
        msg.contains(&model.join("p.safetensors").display().to_string()),
        "{msg}"
    );
    // ... and under tables_dir the same.
    let td = s.join("td");
    std::fs::create_dir_all(&td).unwrap();
    refused(open(&m, Some(&td)), EngramStatus::ErrIo, &[DS4GW_KEYS[0]]);
    // The same absolute path whose file name is in the model's directory: that file.
    copy_shard(&model.join("p.safetensors"));
    let ok = open(&m, None).unwrap();
    assert_eq!(
        ok.file_path(1),
        model.join("p.safetensors").canonicalize().unwrap()
    );
    drop(ok);
    std::fs::remove_file(model.join("p.safetensors")).unwrap();

    // Relative with "..", even one that leads to the file from the working
    // directory or from the model's: refused naming the key and the path.
    let up = "../".repeat(std::env::current_dir().unwrap().components().count().max(1))
        + abs.trim_start_matches('/');
    let m = ds4gw_recording(&model, &up);
    refused(
        open(&m, None),
        EngramStatus::ErrFormat,
        &[DS4GW_KEYS[0], "\"..\""],
    );
    let m = ds4gw_recording(&model, "../private/p.safetensors");
    refused(
        open(&m, None),
        EngramStatus::ErrFormat,
        &[DS4GW_KEYS[0], "private/p.safetensors"],
    );
    refused(
        open(&m, Some(&td)),
        EngramStatus::ErrFormat,
        &[DS4GW_KEYS[0]],
    );

    // A link in the model's directory that points outside it.
    std::os::unix::fs::symlink(&private, model.join("link.safetensors")).unwrap();
    let m = ds4gw_recording(&model, "link.safetensors");
    refused(
        open(&m, None),
        EngramStatus::ErrFormat,
        &[DS4GW_KEYS[0], "link.safetensors", "outside"],
    );
    // A directory link that leads outside, with a good-looking relative path.
    std::os::unix::fs::symlink(private.parent().unwrap(), model.join("sub")).unwrap();
    let m = ds4gw_recording(&model, "sub/p.safetensors");
    refused(
        open(&m, None),
        EngramStatus::ErrFormat,
        &[DS4GW_KEYS[0], "outside"],
    );
    std::fs::remove_file(model.join("sub")).unwrap();

    // Good: a relative path inside, and a link that stays inside.
    copy_shard(&model.join("sub").join("t.safetensors"));
    let m = ds4gw_recording(&model, "sub/t.safetensors");
    let ok = open(&m, None).unwrap();
    assert_eq!(
        ok.file_path(1),
        model.join("sub/t.safetensors").canonicalize().unwrap()
    );
    drop(ok);
    std::os::unix::fs::symlink("sub/t.safetensors", model.join("in.safetensors")).unwrap();
    let m = ds4gw_recording(&model, "in.safetensors");
    open(&m, None).unwrap();
    // tables_dir: the same rule, under tables_dir.
    copy_shard(&td.join("sub").join("t.safetensors"));
    let m = ds4gw_recording(&model, "sub/t.safetensors");
    let ok = open(&m, Some(&td)).unwrap();
    assert_eq!(
        ok.file_path(1),
        td.join("sub/t.safetensors").canonicalize().unwrap()
    );
    drop(ok);
    std::fs::remove_dir_all(&s).unwrap();
}

/// The checkpoint's index follows the same rule: a shard that is a link to a
/// file outside the checkpoint directory, or a name with "..", is refused.
#[test]
fn checkpoint_index_names_follow_the_same_rule() {
    let s = scratch("ckpt");
    let ck = s.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    for e in std::fs::read_dir(dialects().join("checkpoint")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
    }
    std::fs::copy(
        golden_dir().join("deepseek_v4_tokenizer.json"),
        ck.join("tokenizer.json"),
    )
    .unwrap();
    let open = || GgufModel::open_checkpoint(&ck, None, &LoadOptions::default());
    open().unwrap();
    // The shard moved out, a link left in its place.
    let private = s.join("private").join(SHARD);
    std::fs::create_dir_all(private.parent().unwrap()).unwrap();
    std::fs::rename(ck.join(SHARD), &private).unwrap();
    std::os::unix::fs::symlink(&private, ck.join(SHARD)).unwrap();
    refused(
        open(),
        EngramStatus::ErrFormat,
        &["model.safetensors.index.json", SHARD, "outside"],
    );
    // An index naming it with "..".
    std::fs::remove_file(ck.join(SHARD)).unwrap();
    let ix = ck.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&ix).unwrap();
    std::fs::write(&ix, text.replace(SHARD, &format!("../private/{SHARD}"))).unwrap();
    refused(
        open(),
        EngramStatus::ErrFormat,
        &["weight_map", "../private", "\"..\""],
    );
    std::fs::remove_dir_all(&s).unwrap();
}

/// A 24-byte GGUF header claiming huge counts at the start of a sparse
/// 16 GiB file: a status in both modes, with nothing reserved for the counts
/// (before, the parser reserved room for every entry the bytes left could
/// hold at their smallest, 126 GB here, and aborted the process).
#[test]
fn huge_header_counts_reserve_nothing() {
    let s = scratch("sparse");
    // As many entries as the bytes left hold at the smallest encodings (13
    // bytes a metadata entry, 32 a tensor entry): the counts pass that bound.
    let left = (16u64 << 30) - 24;
    let (kv_max, t_max) = (left / 13, left / 32);
    for (n_tensors, n_kv) in [(t_max, kv_max), (1, kv_max), (t_max, 0)] {
        let p = s.join("sparse.gguf");
        let mut h = b"GGUF".to_vec();
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&n_tensors.to_le_bytes());
        h.extend_from_slice(&n_kv.to_le_bytes());
        std::fs::write(&p, &h).unwrap();
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_len(16 << 30).unwrap();
        for mmap in [true, false] {
            let o = LoadOptions {
                mmap,
                ..LoadOptions::default()
            };
            let e = GgufModel::open(&p, &o).err().unwrap();
            assert_eq!(e.status, EngramStatus::ErrFormat, "{}", e.message);
        }
        // In memory: a small file's counts (as many as its bytes allow).
        let mut b = h.clone();
        b.resize(1 << 20, 0);
        assert!(Gguf::parse(&b).is_err());
    }
    std::fs::remove_dir_all(&s).unwrap();
}

/// A metadata key with CR and ESC in it reaches the message escaped.
#[test]
fn control_characters_from_a_file_are_escaped_in_messages() {
    let b = std::fs::read(dialects().join("tarruda.gguf")).unwrap();
    let g = Gguf::parse(&b).unwrap();
    let fake = "\r\x1b[2Kok";
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
        .unwrap();
    let new: String = fake
        .chars()
        .chain(std::iter::repeat('x'))
        .take(k0.key.len())
        .collect();
    let mut m = b.clone();
    for k in [k0, k1] {
        m[k.type_at - k.key.len()..k.type_at].copy_from_slice(new.as_bytes());
    }
    let e = GgufModel::from_memory(vec![("c.gguf".into(), m)], &LoadOptions::default())
        .err()
        .unwrap();
    assert!(e.message.contains("\\r\\u{1b}[2Kok"), "{}", e.message);
    assert!(!e.message.chars().any(char::is_control), "{:?}", e.message);
}
