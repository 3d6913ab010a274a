//! Threads that cannot start. Each case runs in a child process (this test
//! binary again, its ignored `child` test) under `ulimit -v`, so that the
//! address space, not this process's, runs short; the parent checks that
//! the child exited with a status (never a signal: an abort is SIGABRT) and
//! what the calls returned.
//!
//! - A create or a `set_threads` whose threads cannot start is
//!   `ErrCapacity`, the same status from both (issue 34, F4).

mod common;

use common::*;
use engram::{Context, EngramStatus};
use std::process::Command;

/// Run the child case `case` under `ulimit -v kib`; its exit status and
/// standard output.
fn run_child(case: &str, kib: u64) -> (std::process::ExitStatus, String) {
    let exe = std::env::current_exe().expect("this test binary");
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v {kib} && exec \"$0\" \"$@\""))
        .arg(exe)
        .args(["--ignored", "--exact", "child", "--nocapture", "--test-threads=1"])
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
        other => panic!("unknown case {other}"),
    }
}

/// 1024 threads' stacks (2 MiB each) do not fit in 1 GiB of address space.
const GIB: u64 = 1 << 20;

#[test]
fn threads_that_cannot_start_are_err_capacity_at_create() {
    let (st, out) = run_child("create", GIB);
    assert!(st.success(), "{out}");
    assert_eq!(statuses(&out, "create"), [EngramStatus::ErrCapacity as u32], "{out}");
}

#[test]
fn threads_that_cannot_start_are_err_capacity_at_set_threads() {
    let (st, out) = run_child("set_threads", GIB);
    assert!(st.success(), "{out}");
    assert_eq!(statuses(&out, "set_threads"), [EngramStatus::ErrCapacity as u32], "{out}");
    assert_eq!(statuses(&out, "threads_after"), [2], "{out}");
}
