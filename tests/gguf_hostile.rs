//! Hostile files against the loaders (issue 14 items 5, 8 and 12):
//!
//! - a model file truncated after it was opened, with `pread` tables (the
//!   default): `apply` returns `ErrIo` and leaves the highway untouched; no
//!   SIGBUS, because nothing the context reads later comes from a mapping;
//! - FIFOs (and other non-regular files) where a GGUF, safetensors shard,
//!   config.json or tokenizer.json is expected: refused at once, never a
//!   blocked `open`;
//!
//! (Item 12, metadata memory, is `tests/gguf_memory.rs`: it needs a test
//! binary of its own for its counting allocator.)

mod common;

use common::*;
use engram::gguf::{GgufModel, GgufOptions, GgufSet, LoadOptions};
use engram::{EngramStatus, Highway};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn scratch(tag: &str) -> PathBuf {
    scratch_dir("engram-hostile", tag)
}

fn options() -> GgufOptions {
    cpu_gguf_options(1e-6)
}

/// Hash a few tokens on `ctx`, apply every layer, cut `file` to `keep`
/// bytes, and apply again (prefetched and not): the layers in `intact` (whose
/// table lies before the cut) give the same bits as before, since nothing
/// else is read from the file after load; the others are an `ErrIo` with the
/// highway untouched.
fn apply_after_cut(
    ctx: &engram::Context<'_>,
    layers: &[u32],
    intact: &[u32],
    file: &Path,
    keep: u64,
) {
    let n = 6;
    let tokens: Vec<i32> = (0..n as i32).map(|i| i * 5 % 40).collect();
    let pos: Vec<i32> = (0..n as i32).collect();
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
    let hw = ctx.shape().hw_per_token();
    let x = values("hostile.h", n * hw, 1.0, 0.0);
    let before: Vec<Vec<f32>> = layers
        .iter()
        .map(|&lid| {
            let mut h = x.clone();
            ctx.apply(lid, &ids, n, Highway::F32(&mut h)).unwrap();
            h
        })
        .collect();
    std::fs::OpenOptions::new()
        .write(true)
        .open(file)
        .unwrap()
        .set_len(keep)
        .unwrap();
    for (&lid, want) in layers.iter().zip(&before) {
        for prefetch in [false, true] {
            if prefetch {
                ctx.prefetch(lid, &ids, n).unwrap();
            }
            let mut h = x.clone();
            let r = ctx.apply(lid, &ids, n, Highway::F32(&mut h));
            if intact.contains(&lid) {
                r.unwrap_or_else(|e| panic!("layer {lid}: {}", e.message));
                assert!(h == *want, "layer {lid}: different results after the cut");
            } else {
                let e = r.unwrap_err();
                assert_eq!(e.status, EngramStatus::ErrIo, "layer {lid}: {}", e.message);
                assert!(h == x, "layer {lid}: the highway changed");
            }
        }
    }
}

/// Issue 14 item 5: with pread tables nothing is read from a mapping after
/// load, so a file cut short under a context is a status, not SIGBUS (which
/// would kill this test process).
#[test]
fn a_model_file_cut_short_after_open_is_an_io_status() {
    // A GGUF (bf16 tables, bf16 and f32 wkv), cut right after layer 1's
    // table: layer 1's wkv, q and k (after the cut) were read at load, so it
    // still applies; layer 3's table is gone. (Before the fix its wkv was
    // read from the mapping here: SIGBUS.)
    let d = scratch("cut-gguf");
    let p = d.join("tiny.gguf");
    std::fs::copy(golden_dir().join("tiny.gguf"), &p).unwrap();
    let m = GgufModel::open(&p, &LoadOptions::default()).unwrap();
    let t = m
        .gguf
        .as_ref()
        .unwrap()
        .header()
        .tensor("blk.1.engram_embd")
        .unwrap();
    let cut = t.offset + t.bytes.unwrap();
    let ctx = m.context(&options()).unwrap();
    apply_after_cut(&ctx, &[1, 3], &[1], &p, cut);
    drop(ctx);
    // A split fp8 table (tarruda: tables first, then wkv, q, k), cut inside
    // layer 3's codes.
    let p = d.join("tarruda.gguf");
    std::fs::copy(golden_dir().join("dialects/tarruda.gguf"), &p).unwrap();
    let m = GgufModel::open(&p, &LoadOptions::default()).unwrap();
    let t = m
        .gguf
        .as_ref()
        .unwrap()
        .header()
        .tensor("blk.3.engram_embd.weight")
        .unwrap();
    let ctx = m.context(&options()).unwrap();
    apply_after_cut(&ctx, &[1, 3], &[1], &p, t.offset + 64);
    drop(ctx);
    // The checkpoint: its table shard cut short.
    let ck = d.join("checkpoint");
    std::fs::create_dir_all(&ck).unwrap();
    for e in std::fs::read_dir(golden_dir().join("dialects/checkpoint")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ck.join(e.file_name())).unwrap();
    }
    let m = GgufModel::open_checkpoint(
        &ck,
        Some(&golden_dir().join("deepseek_v4_tokenizer.json")),
        &LoadOptions::default(),
    )
    .unwrap();
    let ctx = m.context(&options()).unwrap();
    // The weights shard too: q, k and wkv were read at load.
    std::fs::OpenOptions::new()
        .write(true)
        .open(ck.join("model-00001-of-00002.safetensors"))
        .unwrap()
        .set_len(100)
        .unwrap();
    apply_after_cut(
        &ctx,
        &[1, 3],
        &[],
        &ck.join("model-00002-of-00002.safetensors"),
        1000,
    );
    drop(ctx);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Run `f` on another thread and wait at most `secs` for it (a blocked
/// `open` on a FIFO would never return).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("{what}: still blocked after {secs} s"))
}

fn mkfifo(p: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path; mkfifo has no other preconditions.
    let r = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(r, 0, "mkfifo {}", p.display());
}

fn refused(r: engram::Result<()>, what: &str) {
    let e = r.expect_err(what);
    assert_eq!(e.status, EngramStatus::ErrIo, "{what}: {}", e.message);
    assert!(e.message.contains("FIFO"), "{what}: {}", e.message);
}

/// Issue 14 item 8: every loader refuses a FIFO at once.
#[test]
fn fifos_are_refused_without_blocking() {
    let d = scratch("fifo");
    let fifo = d.join("model.gguf");
    mkfifo(&fifo);
    let tok = golden_dir().join("deepseek_v4_tokenizer.json");
    let cfg = golden_dir().join("tiny_config.json");
    let f = fifo.clone();
    refused(
        within(30, "a GGUF FIFO (pread)", move || {
            GgufModel::open(&f, &LoadOptions::default()).map(|_| ())
        }),
        "a GGUF FIFO",
    );
    let f = fifo.clone();
    refused(
        within(30, "a GGUF FIFO (mmap)", move || {
            GgufSet::open(&f, true).map(|_| ())
        }),
        "a GGUF FIFO, mapped",
    );
    let (f, t) = (fifo.clone(), tok.clone());
    refused(
        within(30, "a config.json FIFO", move || {
            engram::tables::EngramTables::from_files(&f, &t).map(|_| ())
        }),
        "config.json",
    );
    let (f, c) = (fifo.clone(), cfg.clone());
    refused(
        within(30, "a tokenizer.json FIFO", move || {
            engram::tables::EngramTables::from_files(&c, &f).map(|_| ())
        }),
        "tokenizer.json",
    );
    // A split set whose second shard is a FIFO.
    let s1 = d.join("s-00001-of-00003.gguf");
    std::fs::copy(
        golden_dir().join("dialects/vcruz305_split-00001-of-00003.gguf"),
        &s1,
    )
    .unwrap();
    mkfifo(&d.join("s-00002-of-00003.gguf"));
    refused(
        within(30, "a FIFO shard", move || {
            GgufModel::open(&s1, &LoadOptions::default()).map(|_| ())
        }),
        "a FIFO shard",
    );
    // A checkpoint whose config.json, then whose shard, is a FIFO.
    let ck = d.join("ck");
    std::fs::create_dir_all(&ck).unwrap();
    mkfifo(&ck.join("config.json"));
    let (c2, t2) = (ck.clone(), tok.clone());
    refused(
        within(30, "a checkpoint config.json FIFO", move || {
            GgufModel::open_checkpoint(&c2, Some(&t2), &LoadOptions::default()).map(|_| ())
        }),
        "checkpoint config.json",
    );
    std::fs::remove_file(ck.join("config.json")).unwrap();
    for n in [
        "config.json",
        "model.safetensors.index.json",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::copy(golden_dir().join("dialects/checkpoint").join(n), ck.join(n)).unwrap();
    }
    mkfifo(&ck.join("model-00001-of-00002.safetensors"));
    refused(
        within(30, "a checkpoint shard FIFO", move || {
            GgufModel::open_checkpoint(&ck, Some(&tok), &LoadOptions::default()).map(|_| ())
        }),
        "checkpoint shard",
    );
    // A directory where a file is expected.
    let e = GgufModel::open(&d, &LoadOptions::default()).err().unwrap();
    assert_eq!(e.status, EngramStatus::ErrIo);
    assert!(e.message.contains("directory"), "{}", e.message);
    std::fs::remove_dir_all(&d).unwrap();
}
