//! The SIMT shim's own self-test (`tests/simt/selftest.cpp`): barriers, warp
//! shuffles and votes, atomics, the GPU's NaN rules, shared memory per block,
//! deadlock and divergence detection, and smoke tests of every engram kernel
//! with independent references; and every kernel the CUDA backend launches
//! (`KERNEL_NAMES`) is registered. Everything the emulated CUDA tests prove
//! rests on this. Built with the kernels' `-D` options (`tests/common/device.rs`);
//! skips, saying so, without g++.

mod common;

use std::process::Command;

#[test]
fn the_simt_shim_passes_its_self_test() {
    if std::env::var("ENGRAM_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        common::device::skip("the GPU check does not run the CPU emulation's self-test");
        return;
    }
    let lib = match common::device::simt_library() {
        Ok(Some(p)) => p,
        Ok(None) => {
            assert!(
                !std::env::var("ENGRAM_REQUIRE_EMULATION").is_ok_and(|v| v == "1"),
                "ENGRAM_REQUIRE_EMULATION=1 but there is no g++ (CXX) to build the SIMT emulation"
            );
            common::device::skip("no g++ (CXX) to build the SIMT emulation and its self-test");
            return;
        }
        Err(e) => panic!("the SIMT emulation could not be built: {e}"),
    };
    let selftest = lib.with_file_name("selftest");
    assert!(selftest.exists(), "{} was not built", selftest.display());
    let mut cmd = Command::new(&selftest);
    // Its rpath names the directory it was built in, renamed since.
    cmd.env("LD_LIBRARY_PATH", lib.parent().unwrap());
    for n in engram::cuda::gpu::KERNEL_NAMES {
        cmd.arg("--expect").arg(n);
    }
    let out = cmd.output().expect("run the self-test");
    let text = String::from_utf8_lossy(&out.stdout);
    let tail: Vec<&str> = text.lines().rev().take(5).collect();
    println!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    assert!(
        out.status.success(),
        "selftest failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
