//! Threads that cannot start. Each case runs in a child process (this test
//! binary again, its ignored `child` test) under `ulimit -v`, so that the
//! address space, not this process's, runs short; the parent checks that
//! the child exited with a status (never a signal: an abort is SIGABRT) and
//! what the calls returned.
//!
//! - A create or a `set_threads` whose threads cannot start is
//!   `ErrCapacity`, the same status from both (issue 34, F4).
//! - A sweep of limits around the point where threads stop starting: every
//!   run ends with statuses only, and after a refused `set_threads` the old
//!   pool still computes the same bits (issue 34, F3).

mod common;

use common::*;
use engram::{Context, EngramStatus, Highway};
use std::process::Command;

/// Run the child case `case` under `ulimit -v kib`; its exit status and
/// standard output.
fn run_child(case: &str, kib: u64) -> (std::process::ExitStatus, String) {
    let exe = std::env::current_exe().expect("this test binary");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(exe)
        .args([
            "--ignored",
            "--exact",
            "child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ENGRAM_THREADS_CHILD", case)
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code().is_some(),
        "{case} under ulimit -v {kib}: killed by a signal ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    (out.status, stdout)
}

/// The statuses the child printed for `what` (words `what=<number>`).
fn statuses(out: &str, what: &str) -> Vec<u32> {
    let key = format!("{what}=");
    // (libtest prints `test child ... ` before the first one, on its line.)
    out.split_whitespace()
        .filter_map(|w| w.strip_prefix(&key))
        .map(|v| v.trim().parse().expect("a status"))
        .collect()
}

fn status_of(r: &engram::Result<impl Sized>) -> u32 {
    match r {
        Ok(_) => EngramStatus::Ok as u32,
        Err(e) => e.status as u32,
    }
}

/// The child: `ENGRAM_THREADS_CHILD` names the case.
#[test]
#[ignore = "run by the other tests, in a child process under a memory limit"]
fn child() {
    let case = std::env::var("ENGRAM_THREADS_CHILD").expect("ENGRAM_THREADS_CHILD");
    let m = Tiny::load();
    match case.as_str() {
        "create" => {
            let mut cfg = m.config(Tiny::limits());
            cfg.n_threads = 1024;
            println!("create={}", status_of(&Context::new(&cfg)));
        }
        "set_threads" => {
            let ctx = m.context();
            println!("set_threads={}", status_of(&ctx.set_threads(1024)));
            println!("threads_after={}", ctx.n_threads());
        }
        "sweep" => sweep(&m),
        other => panic!("unknown case {other}"),
    }
}

/// 1024 threads' stacks (2 MiB each) do not fit in 1 GiB of address space.
const GIB: u64 = 1 << 20;

#[test]
fn threads_that_cannot_start_are_err_capacity_at_create() {
    let (st, out) = run_child("create", GIB);
    assert!(st.success(), "{out}");
    assert_eq!(
        statuses(&out, "create"),
        [EngramStatus::ErrCapacity as u32],
        "{out}"
    );
}

#[test]
fn threads_that_cannot_start_are_err_capacity_at_set_threads() {
    let (st, out) = run_child("set_threads", GIB);
    assert!(st.success(), "{out}");
    assert_eq!(
        statuses(&out, "set_threads"),
        [EngramStatus::ErrCapacity as u32],
        "{out}"
    );
    assert_eq!(statuses(&out, "threads_after"), [2], "{out}");
}

/// One step of the tiny model's first layer on a fixed batch of 48 tokens
/// (enough output rows for the pool to split the projection), its inputs
/// and outputs allocated up front: under the limit the test allocates
/// nothing (an abort there would be the test's, not the library's).
struct Step {
    tokens: Vec<i32>,
    seqs: Vec<i32>,
    pos: Vec<i32>,
    ids: Vec<i64>,
    start: Vec<f32>,
    hw: Vec<f32>,
}

impl Step {
    fn new(m: &Tiny) -> Step {
        let n = 48;
        Step {
            tokens: (0..n)
                .map(|i| ((i * 7 + 3) % m.token_map.len()) as i32)
                .collect(),
            seqs: vec![0; n],
            pos: (0..n as i32).collect(),
            ids: vec![0; n * m.cols() * m.layer_ids.len()],
            start: values("thread_limits.highway", n * m.hc * m.d, 1.0, 0.0),
            hw: vec![0.0; n * m.hc * m.d],
        }
    }

    /// The highway after the step (in `self.hw`), or the failing status.
    fn run(&mut self, m: &Tiny, ctx: &Context<'_>) -> Result<(), u32> {
        let _ = ctx.seq_drop(0);
        ctx.hash(&self.tokens, &self.seqs, &self.pos, &mut self.ids)
            .map_err(|e| e.status as u32)?;
        self.hw.copy_from_slice(&self.start);
        let n = self.tokens.len();
        ctx.apply(m.layer_ids[0], &self.ids, n, Highway::F32(&mut self.hw))
            .map_err(|e| e.status as u32)
    }
}

/// The tiny model's layers into `ctx`.
fn set_layers<'m>(m: &'m Tiny, ctx: &Context<'m>) -> engram::Result<()> {
    for l in &m.layers {
        ctx.set_layer(engram::LayerIn::host(
            l.layer_id,
            &l.table,
            engram::EngramType::row_format(l.format as u32, m.hd).unwrap(),
            l.rows,
            l.wkv.weights(),
            l.q.weights(),
            l.k.weights(),
        ))?;
    }
    Ok(())
}

/// This process's address space in KiB (`VmSize` of /proc/self/status).
fn vm_size_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = s
        .lines()
        .find(|l| l.starts_with("VmSize:"))
        .expect("VmSize");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Set this process's address-space limit (the soft one; the hard one
/// stays unlimited, so that it can be raised again).
fn limit_address_space(bytes: u64) {
    let rl = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: `rl` is a valid rlimit for the call to read.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
}

/// The sweep's child: a context and its step's bits; then, for each
/// headroom from 0 to 256 MiB in 1 MiB steps, the address space limited to
/// what the process uses plus the headroom, and `set_threads` with more
/// and more threads (each new pool built while the old one still holds its
/// stacks), a step after each, and a `create` with as many threads: each
/// prints its status, and each step the same bits as before any limit (on
/// the new pool, or on the old one kept) or a status. Then the limit is
/// lifted and the context goes back to 2 threads.
fn sweep(m: &Tiny) {
    let range = |k: &str| -> u64 { std::env::var(k).unwrap().parse().unwrap() };
    let (from, to) = (
        range("ENGRAM_THREADS_FROM_MIB"),
        range("ENGRAM_THREADS_TO_MIB"),
    );
    let prefetch = std::env::var("ENGRAM_THREADS_PREFETCH").is_ok_and(|v| v == "1");
    // One malloc arena: glibc reserves 64 MiB of address space for the
    // arena of a thread's first allocation, and an arena that takes the last
    // of the room leaves none for anything (any call's error message is a
    // heap string), in whichever thread: not what starting threads can
    // control, and this process's own choice (as an engine's `mallopt`).
    // ENGRAM_THREADS_ARENAS=1 keeps glibc's default, to look.
    if std::env::var("ENGRAM_THREADS_ARENAS").is_err() {
        // SAFETY: sets one malloc parameter of this process, before this
        // child starts any thread of its own.
        assert_eq!(unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) }, 1);
    }
    let ctx = m.context();
    let mut step = Step::new(m);
    step.run(m, &ctx).expect("the step before the limit");
    let want = step.hw.clone();
    let mut cfg = m.config(Tiny::limits());
    for mib in from..=to {
        println!("headroom={mib}");
        limit_address_space((vm_size_kib() + mib * 1024) * 1024);
        for n in [3usize, 8, 32, 128, 512, 1024] {
            println!("set_threads={}", status_of(&ctx.set_threads(n)));
            match step.run(m, &ctx) {
                Ok(()) => println!("same={}", (step.hw == want) as u32),
                Err(st) => println!("step={st}"),
            }
            cfg.n_threads = n;
            match Context::new(&cfg) {
                // The gather threads (max(2, n)) start at the first
                // prefetch; they are std threads, outside this sweep
                // (ENGRAM_THREADS_PREFETCH=1 adds them, to look).
                Ok(c) if prefetch => {
                    println!("create=0");
                    println!("set_layer={}", status_of(&set_layers(m, &c)));
                    let r = c.prefetch(m.layer_ids[0], &step.ids, step.tokens.len());
                    println!("prefetch={}", status_of(&r));
                }
                r => println!("create={}", status_of(&r.map(drop))),
            }
        }
        limit_address_space(libc::RLIM_INFINITY);
        ctx.set_threads(2).expect("back to 2 threads");
    }
}

/// The sweep's smallest headroom. Below about 1 MiB the process has no room
/// for anything at all (the error messages are heap strings).
const FROM_MIB: u64 = 1;

/// F3: under address-space limits from 1 to 256 MiB above what the child
/// already uses, starting threads ends with statuses (never an abort), the
/// statuses are OK or ERR_CAPACITY, and a step after each `set_threads`
/// gives the same bits as before the limit whenever it runs. The sweep must
/// reach both regimes (some thread counts refused, some started).
#[test]
fn starting_threads_under_a_memory_limit_is_a_status_never_an_abort() {
    let (ok, cap) = (EngramStatus::Ok as u32, EngramStatus::ErrCapacity as u32);
    let exe = std::env::current_exe().expect("this test binary");
    let out = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            "child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("ENGRAM_THREADS_CHILD", "sweep")
        .env("ENGRAM_THREADS_FROM_MIB", FROM_MIB.to_string())
        .env("ENGRAM_THREADS_TO_MIB", "256")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = statuses(&stdout, "headroom").last().copied();
    assert!(
        out.status.success(),
        "{:?} at headroom {last:?} MiB\nstderr:\n{stderr}",
        out.status
    );
    assert_eq!(last, Some(256), "the sweep ran to its end");
    let (mut refused, mut started) = (0, 0);
    for what in ["set_threads", "create", "step", "set_layer", "prefetch"] {
        for st in statuses(&stdout, what) {
            assert!(st == ok || st == cap, "{what} = {st}");
            refused += (st == cap) as usize;
            started += (st == ok && (what == "set_threads" || what == "create")) as usize;
        }
    }
    let same = statuses(&stdout, "same");
    assert!(
        !same.is_empty() && same.iter().all(|&s| s == 1),
        "a step changed bits"
    );
    assert!(
        refused > 0 && started > 0,
        "refused {refused}, started {started}"
    );
}
