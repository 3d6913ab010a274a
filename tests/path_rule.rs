//! The path rule under races and in the Hugging Face hub cache layout (issue
//! 34, F1 and F2): a file the loaders read from a directory is opened
//! relative to that directory's descriptor, so a writer who swaps a file or a
//! directory for a link between a check and an open never makes the library
//! read outside the model; a hub snapshot's links into its repository's
//! `blobs` are followed, and no other link out. Every test runs both ways of
//! opening (`openat2`, and the component-by-component walk that stands in
//! where the kernel lacks it).

mod common;

use common::*;
use engram::files::{force_walk, ModelDir};
use engram::gguf::{GgufModel, LoadOptions};
use engram::EngramStatus;
use std::io::Read;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A fresh scratch directory.
fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("egpr-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Each way of opening, `f` run with it on this thread.
fn both_ways(mut f: impl FnMut(&str)) {
    for (walk, name) in [(false, "openat2"), (true, "walk")] {
        let before = force_walk(walk);
        f(name);
        force_walk(before);
    }
}

/// What `recorded` opens to under `dir`: its content, `None` when absent, or
/// the refusal.
fn content(dir: &ModelDir, recorded: &str) -> engram::Result<Option<Vec<u8>>> {
    Ok(dir.open_recorded(recorded, "key")?.map(|mut o| {
        let mut v = Vec::new();
        o.file.read_to_end(&mut v).unwrap();
        v
    }))
}

fn refused(r: engram::Result<Option<Vec<u8>>>, status: EngramStatus, words: &[&str], how: &str) {
    let e = match r {
        Err(e) => e,
        Ok(v) => panic!("{how}: not refused: {v:?}"),
    };
    assert_eq!(e.status, status, "{how}: {}", e.message);
    for w in words {
        assert!(e.message.contains(w), "{how}: no {w:?} in {}", e.message);
    }
}

/// `renameat2(RENAME_EXCHANGE)`: `a` and `b` swap, atomically.
fn exchange(a: &Path, b: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let ca = std::ffi::CString::new(a.as_os_str().as_bytes()).unwrap();
    let cb = std::ffi::CString::new(b.as_os_str().as_bytes()).unwrap();
    // SAFETY: two NUL-terminated paths that outlive the call, which only reads them.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
}

/// A thread swaps `t.bin` for a link to an outside file, and the directory
/// `sub` for a link to an outside directory, as fast as it can, while this
/// one opens both through the rule: the outside content never comes back,
/// and both an open and a refusal are seen (the race was run).
#[test]
fn a_file_swapped_for_a_link_is_never_read_outside() {
    let s = scratch("race");
    let (model, out) = (s.join("model"), s.join("outside"));
    std::fs::create_dir_all(model.join("sub")).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("t.bin"), b"SECRET").unwrap();
    std::fs::write(model.join("t.bin"), b"INSIDE").unwrap();
    std::fs::write(model.join("sub/t.bin"), b"INSIDE").unwrap();
    symlink(out.join("t.bin"), model.join("alt.bin")).unwrap();
    symlink(&out, model.join("altdir")).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (stop, model) = (stop.clone(), model.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                exchange(&model.join("t.bin"), &model.join("alt.bin"));
                exchange(&model.join("sub"), &model.join("altdir"));
            }
        })
    };
    let dir = ModelDir::open(&model).unwrap().unwrap();
    both_ways(|how| {
        for rec in ["t.bin", "sub/t.bin"] {
            let (mut ok, mut no, mut n) = (0u64, 0u64, 0u64);
            let start = Instant::now();
            while (ok == 0 || no == 0 || n < 2000) && start.elapsed() < Duration::from_secs(60) {
                n += 1;
                match content(&dir, rec) {
                    Ok(Some(v)) => {
                        assert_eq!(v, b"INSIDE", "{how}: {rec} read outside after {n} opens");
                        ok += 1;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        assert_eq!(e.status, EngramStatus::ErrFormat, "{how}: {}", e.message);
                        assert!(e.message.contains("outside"), "{how}: {}", e.message);
                        no += 1;
                    }
                }
            }
            eprintln!("{how} {rec}: {n} opens, {ok} inside, {no} refused");
            assert!(ok > 0 && no > 0, "{how} {rec}: the race was not run");
        }
    });
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    std::fs::remove_dir_all(&s).unwrap();
}

/// Each refusal, deterministically, both ways; and what stays inside opens.
#[test]
fn every_way_out_is_refused_and_every_way_inside_opens() {
    let s = scratch("rules");
    let (model, out) = (s.join("model"), s.join("outside"));
    std::fs::create_dir_all(model.join("sub/deep")).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("x.bin"), b"SECRET").unwrap();
    std::fs::write(model.join("sub/t.bin"), b"INSIDE").unwrap();
    let l = |target: &str, name: &str| symlink(target, model.join(name)).unwrap();
    l(out.join("x.bin").to_str().unwrap(), "abs.bin");
    l("../outside/x.bin", "rel.bin");
    l(out.to_str().unwrap(), "outdir");
    l("sub/t.bin", "in.bin");
    l("in.bin", "chain.bin");
    l("sub/deep/../t.bin", "updown.bin");
    l("/proc/self/root/etc/hostname", "magic.bin");
    l("loop1", "loop2");
    l("loop2", "loop1");
    symlink("../../../outside/x.bin", model.join("sub/deep/up.bin")).unwrap();
    symlink("../t.bin", model.join("sub/deep/back.bin")).unwrap();
    // A FIFO must be refused without blocking on open.
    let fifo = std::ffi::CString::new(model.join("fifo").to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let dir = ModelDir::open(&model).unwrap().unwrap();
    both_ways(|how| {
        let out_ = EngramStatus::ErrFormat;
        for rec in [
            "abs.bin",
            "rel.bin",
            "outdir/x.bin",
            "magic.bin",
            "sub/deep/up.bin",
        ] {
            refused(
                content(&dir, rec),
                out_,
                &["outside", rec, "key"],
                &format!("{how} {rec}"),
            );
        }
        refused(content(&dir, "../outside/x.bin"), out_, &["\"..\""], how);
        refused(
            content(&dir, "sub/../../outside/x.bin"),
            out_,
            &["\"..\""],
            how,
        );
        refused(content(&dir, "loop1"), EngramStatus::ErrIo, &["loop1"], how);
        refused(content(&dir, "fifo"), EngramStatus::ErrIo, &["a FIFO"], how);
        refused(
            content(&dir, "sub"),
            EngramStatus::ErrIo,
            &["a directory"],
            how,
        );
        for rec in [
            "sub/t.bin",
            "in.bin",
            "chain.bin",
            "updown.bin",
            "sub/deep/back.bin",
            "./sub/./t.bin",
        ] {
            let v = content(&dir, rec).unwrap_or_else(|e| panic!("{how} {rec}: {}", e.message));
            assert_eq!(v.as_deref(), Some(&b"INSIDE"[..]), "{how} {rec}");
        }
        // An absolute path keeps its file name: in.bin under the directory.
        let abs = format!("{}/in.bin", out.display());
        assert_eq!(
            content(&dir, &abs).unwrap().as_deref(),
            Some(&b"INSIDE"[..])
        );
        assert!(content(&dir, "none.bin").unwrap().is_none(), "{how}");
        assert!(content(&dir, "sub/t.bin/x").unwrap().is_none(), "{how}");
    });
    std::fs::remove_dir_all(&s).unwrap();
}

fn dialects() -> PathBuf {
    golden_dir().join("dialects")
}

/// `files` (name, source) stored as the hub does: each in `blobs/<hash>`,
/// linked from `snapshots/<rev>/<name>` by `../../blobs/<hash>` (a name in
/// a subdirectory climbs one more). Returns the snapshot directory.
fn hub(repo: &Path, files: &[(&str, PathBuf)]) -> PathBuf {
    let snap = repo.join("snapshots").join("0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for (i, (name, src)) in files.iter().enumerate() {
        let hash = format!("{:040x}", fnv1a64(name.as_bytes()) ^ i as u64);
        std::fs::copy(src, repo.join("blobs").join(&hash)).unwrap();
        let up = "../".repeat(name.matches('/').count() + 2);
        let link = snap.join(name);
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        symlink(format!("{up}blobs/{hash}"), link).unwrap();
    }
    snap
}

fn checkpoint_files() -> Vec<(&'static str, PathBuf)> {
    let ck = dialects().join("checkpoint");
    vec![
        ("config.json", ck.join("config.json")),
        (
            "model.safetensors.index.json",
            ck.join("model.safetensors.index.json"),
        ),
        (
            "model-00001-of-00002.safetensors",
            ck.join("model-00001-of-00002.safetensors"),
        ),
        (
            "model-00002-of-00002.safetensors",
            ck.join("model-00002-of-00002.safetensors"),
        ),
        (
            "tokenizer.json",
            golden_dir().join("deepseek_v4_tokenizer.json"),
        ),
    ]
}

/// The hub layout opens: a checkpoint snapshot (config, index, shards and
/// tokenizer all links into blobs), a split GGUF set whose shards are links,
/// and a snapshot given as `tables_dir`. The same links in a directory that
/// is not a snapshot, and links from a snapshot that leave both it and its
/// repository's blobs, are refused.
#[test]
fn the_hub_cache_layout_opens_and_links_that_leave_it_do_not() {
    let s = scratch("hub");
    let repo = s.join("models--deepseek-ai--V4.1");
    let snap = hub(&repo, &checkpoint_files());
    both_ways(|how| {
        let m = GgufModel::open_checkpoint(&snap, None, &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{how}: {}", e.message));
        // Named by the snapshot's path (the blob's is a hash).
        let p = m.file_path(0);
        assert!(
            p.starts_with(snap.canonicalize().unwrap()),
            "{how}: {}",
            p.display()
        );
    });
    // A split set in the hub layout: the first shard opened by its link.
    let names = [
        "vcruz305_split-00001-of-00003.gguf",
        "vcruz305_split-00002-of-00003.gguf",
        "vcruz305_split-00003-of-00003.gguf",
    ];
    let split: Vec<_> = names.iter().map(|n| (*n, dialects().join(n))).collect();
    let srepo = s.join("models--split");
    let ssnap = hub(&srepo, &split);
    both_ways(|how| {
        GgufModel::open(&ssnap.join(names[0]), &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{how}: {}", e.message));
    });
    // A snapshot as tables_dir of a file that names its shard.
    let ds4gw = std::fs::read(dialects().join("ds4gw_style.gguf")).unwrap();
    let gdir = s.join("gguf");
    std::fs::create_dir_all(&gdir).unwrap();
    std::fs::write(gdir.join("m.gguf"), &ds4gw).unwrap();
    let open_td = |td: &Path| {
        GgufModel::open(
            &gdir.join("m.gguf"),
            &LoadOptions {
                tables_dir: Some(td),
                ..LoadOptions::default()
            },
        )
    };
    // The fixture records /models/DeepSeek-V4.1-tiny/<this name>.
    let ds4gw_shard = "model-00002-of-00002.safetensors".to_string();
    let trepo = s.join("models--tables");
    let tsnap = hub(
        &trepo,
        &[(
            ds4gw_shard.as_str(),
            dialects().join("checkpoint").join(&ds4gw_shard),
        )],
    );
    both_ways(|how| {
        open_td(&tsnap).unwrap_or_else(|e| panic!("{how}: {}", e.message));
    });

    // The same links, from a directory that is not a snapshot: refused.
    let plain = repo.join("notsnap").join("0123abcd");
    std::fs::create_dir_all(&plain).unwrap();
    for e in std::fs::read_dir(&snap).unwrap() {
        let e = e.unwrap();
        let t = std::fs::read_link(e.path()).unwrap();
        symlink(t, plain.join(e.file_name())).unwrap();
    }
    both_ways(|how| {
        let e = GgufModel::open_checkpoint(&plain, None, &LoadOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{how}: opened"));
        assert_eq!(e.status, EngramStatus::ErrFormat, "{how}: {}", e.message);
        assert!(e.message.contains("outside"), "{how}: {}", e.message);
    });

    // Links from a snapshot that leave it and its blobs.
    std::fs::write(s.join("secret.bin"), b"SECRET").unwrap();
    std::fs::write(repo.join("other.bin"), b"SECRET").unwrap();
    std::fs::create_dir_all(repo.join("snapshots/other")).unwrap();
    std::fs::write(repo.join("snapshots/other/o.bin"), b"SECRET").unwrap();
    symlink(s.join("secret.bin"), repo.join("blobs/linked")).unwrap();
    let bad = [
        ("a.bin", "../../other.bin".to_string()),
        ("b.bin", "../../blobs/../other.bin".to_string()),
        ("c.bin", "../other/o.bin".to_string()),
        ("d.bin", "../../../secret.bin".to_string()),
        ("e.bin", s.join("secret.bin").display().to_string()),
        ("f.bin", "../../blobs/linked".to_string()),
        ("g.bin", "../../blobs".to_string()),
    ];
    for (name, target) in &bad {
        symlink(target, snap.join(name)).unwrap();
    }
    std::fs::create_dir_all(snap.join("sub")).unwrap();
    // One level down, "../../blobs" stays in snapshots/: not a blob.
    symlink("../../blobs/linked", snap.join("sub/h.bin")).unwrap();
    let dir = ModelDir::open(&snap).unwrap().unwrap();
    both_ways(|how| {
        for (name, _) in bad
            .iter()
            .map(|(n, t)| (*n, t))
            .chain([("sub/h.bin", &String::new())])
        {
            let r = content(&dir, name);
            match name {
                // A link to the blobs directory itself is inside nothing it may open.
                "g.bin" => assert!(r.is_err(), "{how} {name}: {r:?}"),
                _ => refused(
                    r,
                    EngramStatus::ErrFormat,
                    &["outside"],
                    &format!("{how} {name}"),
                ),
            }
        }
        // A good blob link, for contrast.
        assert!(content(&dir, "config.json").unwrap().is_some(), "{how}");
    });
    std::fs::remove_dir_all(&s).unwrap();
}

/// The other shards of a GGUF split set are opened by the same rule: a
/// shard that is a link to a file outside the set's directory is refused,
/// one that is a link inside opens.
#[test]
fn split_shards_follow_the_rule() {
    let s = scratch("split");
    let (dir, out) = (s.join("m"), s.join("outside"));
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let n = |k: u32| format!("vcruz305_split-0000{k}-of-00003.gguf");
    std::fs::copy(dialects().join(n(1)), dir.join(n(1))).unwrap();
    std::fs::copy(dialects().join(n(2)), out.join(n(2))).unwrap();
    std::fs::copy(dialects().join(n(3)), dir.join("sub").join(n(3))).unwrap();
    symlink(out.join(n(2)), dir.join(n(2))).unwrap();
    symlink(format!("sub/{}", n(3)), dir.join(n(3))).unwrap();
    both_ways(|how| {
        let e = GgufModel::open(&dir.join(n(1)), &LoadOptions::default())
            .err()
            .unwrap_or_else(|| panic!("{how}: opened"));
        assert_eq!(e.status, EngramStatus::ErrFormat, "{how}: {}", e.message);
        assert!(
            e.message.contains("outside") && e.message.contains(&n(2)),
            "{how}: {}",
            e.message
        );
    });
    std::fs::remove_file(dir.join(n(2))).unwrap();
    std::fs::rename(out.join(n(2)), dir.join(n(2))).unwrap();
    both_ways(|how| {
        GgufModel::open(&dir.join(n(1)), &LoadOptions::default())
            .unwrap_or_else(|e| panic!("{how}: {}", e.message));
    });
    std::fs::remove_dir_all(&s).unwrap();
}
