//! `prefetch`: rows gathered on worker threads ahead of `apply`, double
//! buffered, from memory tables and from files (`pread`); apply results equal
//! to the direct gather; bad ids and I/O errors are statuses.

mod common;

use common::*;
use engram::gguf::{GgufModel, GgufOptions, LoadOptions};
use engram::{EngramStatus, Highway};
use std::sync::Arc;

/// One call: `(tokens, seq_ids, pos, highway name)`.
type Call = (Vec<i32>, Vec<i32>, Vec<i32>, String);

/// Every call of the `prefill`, `decode`, `interleaved` and `dead` regimes.
fn calls(tiny: &Tiny) -> Vec<Vec<Call>> {
    ["prefill", "decode", "interleaved", "dead"]
        .iter()
        .map(|r| {
            golden_calls(tiny, r)
                .into_iter()
                .map(|c| (c.tokens, c.seq_ids, c.pos, c.highway))
                .collect()
        })
        .collect()
}

fn apply(
    ctx: &engram::Context,
    lid: u32,
    ids: &[i64],
    n: usize,
    hw: &str,
    hc: usize,
    d: usize,
) -> Vec<f32> {
    let mut h = values(hw, n * hc * d, 1.0, 0.0);
    ctx.apply(lid, ids, n, Highway::F32(&mut h)).unwrap();
    h
}

/// Prefetch every step before applying it (and, in `ahead` mode, the next
/// step too before applying the current one: both slots in use), and compare
/// with a context that never prefetches.
fn check_against_direct(tiny: &Tiny, a: &engram::Context, b: &engram::Context, ahead: bool) {
    let (hc, d) = (tiny.hc, tiny.d);
    for regime in calls(tiny) {
        // Hash the whole regime first on both contexts (fresh sequences per regime).
        let mut steps = Vec::new();
        for (tokens, seqs, pos, hw) in &regime {
            let n = tokens.len();
            let mut ids = vec![0i64; n * a.ids_per_token()];
            a.hash(tokens, seqs, pos, &mut ids).unwrap();
            let mut ids_b = ids.clone();
            b.hash(tokens, seqs, pos, &mut ids_b).unwrap();
            assert_eq!(ids, ids_b);
            steps.push((ids, n, hw.clone()));
        }
        if ahead {
            for (ids, n, _) in &steps {
                for &lid in &tiny.layer_ids {
                    a.prefetch(lid, ids, *n).unwrap();
                }
            }
        }
        for (i, (ids, n, hw)) in steps.iter().enumerate() {
            for &lid in &tiny.layer_ids {
                if !ahead {
                    a.prefetch(lid, ids, *n).unwrap();
                    if let Some((next, nn, _)) = steps.get(i + 1) {
                        a.prefetch(lid, next, *nn).unwrap();
                    }
                }
                let got = apply(a, lid, ids, *n, hw, hc, d);
                let want = apply(b, lid, ids, *n, hw, hc, d);
                assert_eq!(got, want, "step {i} layer {lid}");
            }
        }
        for s in 0..4 {
            a.seq_drop(s).unwrap();
            b.seq_drop(s).unwrap();
        }
    }
}

#[test]
fn prefetched_memory_tables_give_the_direct_results() {
    let tiny = Tiny::load();
    let (a, b) = (tiny.context(), tiny.context());
    check_against_direct(&tiny, &a, &b, false);
    let s = a.info().stage;
    // Each apply found its stage; the look-ahead prefetches left stages behind
    // that were overwritten (or applied later) but never served wrong rows.
    assert!(s.staged > 0 && s.prefetched >= s.staged, "{s:?}");
    assert_eq!(s.direct, 0, "every apply found its prefetch: {s:?}");
    check_against_direct(&tiny, &a, &b, true);
    let s2 = a.info().stage;
    assert!(s2.staged > s.staged, "{s2:?}");
    assert!(
        s2.direct > 0,
        "look-ahead past two slots: the oldest stages were reused"
    );
    assert_eq!(b.info().stage.staged, 0);
}

#[test]
fn gguf_tables_read_with_pread_or_the_mapping_agree() {
    let tiny = Tiny::load();
    let path = golden_dir().join("tiny.gguf");
    let m = GgufModel::open(&path, &LoadOptions::default()).unwrap();
    let mm = GgufModel::open(
        &path,
        &LoadOptions {
            mmap: true,
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let o = GgufOptions {
        limits: Tiny::limits(),
        n_threads: 3,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        eps: tiny.eps,
        tuning: Default::default(),
        row_cache_bytes: 0,
    };
    let pread = m.context(&o).unwrap();
    let mapped = mm.context(&o).unwrap();
    check_against_direct(&tiny, &pread, &mapped, false);
    // And without prefetch: the pread path of apply itself.
    let direct = tiny.context();
    check_against_direct(&tiny, &mapped, &direct, true);
}

#[test]
fn bad_ids_are_refused_by_prefetch() {
    let tiny = Tiny::load();
    let ctx = tiny.context();
    let n = 2;
    let per = ctx.ids_per_token();
    let mut ids = vec![0i64; n * per];
    ctx.hash(&[3, 4], &[0, 0], &[0, 1], &mut ids).unwrap();
    let st = |r: engram::Result<()>| r.unwrap_err().status;
    assert_eq!(st(ctx.prefetch(2, &ids, n)), EngramStatus::ErrUnknownLayer);
    assert_eq!(
        st(ctx.prefetch(1, &ids[..per], n)),
        EngramStatus::ErrInvalidArgument
    );
    assert_eq!(
        st(ctx.prefetch(1, &vec![0; 65 * per], 65)),
        EngramStatus::ErrCapacity
    );
    let mut bad = ids.clone();
    bad[0] = 1 << 40;
    assert_eq!(st(ctx.prefetch(1, &bad, n)), EngramStatus::ErrInvalidRowId);
    bad[0] = -1;
    assert_eq!(st(ctx.prefetch(1, &bad, n)), EngramStatus::ErrInvalidRowId);
    // A context whose layer was never set.
    let bare = engram::Context::new(&tiny.config(Tiny::limits())).unwrap();
    assert_eq!(st(bare.prefetch(1, &ids, n)), EngramStatus::ErrNoWeights);
    // The good ids still work after the refusals.
    ctx.prefetch(1, &ids, n).unwrap();
    let mut h = values("p.h", n * tiny.hc * tiny.d, 1.0, 0.0);
    ctx.apply(1, &ids, n, Highway::F32(&mut h)).unwrap();
}

#[test]
fn a_failing_file_read_is_an_io_status() {
    let tiny = Tiny::load();
    let ctx = tiny.context();
    // Layer 3's table (bf16) also written to a file, which apply then reads.
    let l = &tiny.layers[1];
    assert_eq!(l.layer_id, 3);
    let dir = std::env::temp_dir().join(format!("engram-prefetch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("table.bin");
    let mut bytes = vec![0xEEu8; 100]; // the table starts at offset 100
    bytes.extend_from_slice(&l.table);
    std::fs::write(&path, &bytes).unwrap();
    let file = Arc::new(
        std::fs::File::options()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap(),
    );
    let mut w = engram::LayerIn::host(
        3,
        &l.table,
        engram::EngramType::row_format(l.format as u32, tiny.hd).unwrap(),
        l.rows,
        l.wkv.weights(),
        l.q.weights(),
        l.k.weights(),
    );
    w.table.source = engram::TableSource::File {
        file: file.clone(),
        offset: 100,
    };
    ctx.set_layer(w).unwrap();
    let n = 12;
    let tokens: Vec<i32> = (0..n as i32).map(|i| (i * 7) % 48).collect();
    let pos: Vec<i32> = (0..n as i32).collect();
    let mut ids = vec![0i64; n * ctx.ids_per_token()];
    ctx.hash(&tokens, &vec![0; n], &pos, &mut ids).unwrap();
    let direct = tiny.context();
    direct
        .hash(&tokens, &vec![0; n], &pos, &mut vec![0; ids.len()])
        .unwrap();
    let want = apply(&direct, 3, &ids, n, "io.h", tiny.hc, tiny.d);
    assert_eq!(
        apply(&ctx, 3, &ids, n, "io.h", tiny.hc, tiny.d),
        want,
        "pread, no prefetch"
    );
    let before = ctx.info().stage;
    ctx.prefetch(3, &ids, n).unwrap();
    assert_eq!(
        apply(&ctx, 3, &ids, n, "io.h", tiny.hc, tiny.d),
        want,
        "pread, prefetched"
    );
    assert_eq!(ctx.info().stage.staged, before.staged + 1);
    // The file is cut short underneath: both paths report ErrIo, the highway is untouched.
    file.set_len(150).unwrap();
    let x = values("io.h", n * tiny.hc * tiny.d, 1.0, 0.0);
    let mut h = x.clone();
    let e = ctx.apply(3, &ids, n, Highway::F32(&mut h)).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    assert_eq!(h, x);
    ctx.prefetch(3, &ids, n).unwrap();
    let e = ctx.apply(3, &ids, n, Highway::F32(&mut h)).unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrIo, "{}", e.message);
    assert!(e.message.contains("reading table row"), "{}", e.message);
    assert_eq!(h, x);
    // Layer 1 (memory) is unaffected.
    let mut h1 = x.clone();
    ctx.apply(1, &ids, n, Highway::F32(&mut h1)).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
