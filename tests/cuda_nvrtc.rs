//! Every CUDA kernel compiles with NVRTC for sm_80 and sm_90 without an error
//! or a warning, and as PTX for the architecture a device newer than this
//! NVRTC gets. Needs libnvrtc only (no GPU, no driver, no CUDA toolkit):
//! `scripts/nvrtc-check.sh` installs it from the nvidia-cuda-nvrtc-cu12 wheel
//! and runs this test with `ENGRAM_REQUIRE_NVRTC=1`, which turns the skip
//! (libnvrtc missing) into a failure; `scripts/gpu-check.sh` runs it with the
//! GPU machine's NVRTC (CUDA 13 there).

mod common;

use engram::cuda::kernels::{
    choose_arch, compile_source, nvrtc_version, supported_archs, MODULE_MAIN, SOURCES,
};

const ARCHS: [&str; 2] = ["sm_80", "sm_90"];

fn nvrtc_or_skip() -> bool {
    match nvrtc_version() {
        Ok((a, b)) => {
            println!("NVRTC {a}.{b}");
            true
        }
        Err(e) => {
            if std::env::var("ENGRAM_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("ENGRAM_REQUIRE_NVRTC=1 but {}", e.message);
            }
            // Each test, named and counted, straight to stderr (not captured
            // by the test harness).
            common::device::skip(&format!(
                "no NVRTC: {} (scripts/nvrtc-check.sh installs libnvrtc and runs it)",
                e.message
            ));
            false
        }
    }
}

/// NVRTC has no -Werror: a clean compile has a log without any warning.
fn assert_clean(what: &str, arch: &str, log: &str) {
    assert!(
        !log.to_lowercase().contains("warning"),
        "{what} for {arch}: NVRTC warned:\n{log}"
    );
}

#[test]
fn every_kernel_file_compiles_cleanly_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    for arch in ARCHS {
        // The module the backend loads, and each .cu file on its own.
        let c = compile_source(MODULE_MAIN, "engram_kernels.cu", arch)
            .unwrap_or_else(|e| panic!("the module for {arch}: {}", e.message));
        assert_clean("the module", arch, &c.log);
        assert!(c.image.len() > 1000, "a cubin for {arch}");
        for (name, _) in SOURCES.iter().filter(|(n, _)| n.ends_with(".cu")) {
            let main = format!("#include \"{name}\"\n");
            let c = compile_source(&main, &format!("only_{name}"), arch)
                .unwrap_or_else(|e| panic!("{name} for {arch}: {}", e.message));
            assert_clean(name, arch, &c.log);
            println!(
                "{name}: {arch} cubin of {} bytes, no warnings",
                c.image.len()
            );
        }
        // PTX for the virtual architecture too (what a newer device would JIT).
        let virt = arch.replace("sm_", "compute_");
        let c = compile_source(MODULE_MAIN, "engram_kernels.cu", &virt)
            .unwrap_or_else(|e| panic!("the module for {virt}: {}", e.message));
        assert_clean("the module", &virt, &c.log);
    }
}

#[test]
fn a_device_newer_than_this_nvrtc_gets_ptx_that_compiles() {
    if !nvrtc_or_skip() {
        return;
    }
    let archs = supported_archs().expect("nvrtcGetSupportedArchs");
    println!("{}: sm_{archs:?}", engram::cuda::sys::describe());
    assert!(archs.contains(&80) && archs.contains(&90), "{archs:?}");
    let newest = *archs.last().unwrap();
    let future = (newest / 10 + 1, 0);
    let arch = choose_arch(future, &archs).unwrap();
    assert_eq!(arch, format!("compute_{newest}"));
    let c = compile_source(MODULE_MAIN, "engram_kernels.cu", &arch)
        .unwrap_or_else(|e| panic!("PTX for {arch}: {}", e.message));
    assert_clean("the module", &arch, &c.log);
    assert!(
        engram::cuda::gpu::KERNEL_NAMES
            .iter()
            .all(|k| String::from_utf8_lossy(&c.image).contains(&format!(".entry {k}("))),
        "PTX with every entry"
    );
    println!(
        "sm_{}.{} would get {arch} PTX ({} bytes)",
        future.0,
        future.1,
        c.image.len()
    );
}

#[test]
fn the_warning_check_sees_warnings() {
    if !nvrtc_or_skip() {
        return;
    }
    // A variable that is never used must produce a warning in the log, or the
    // check above would pass vacuously.
    let src = "extern \"C\" __global__ void probe(int *p) { int unused = 3; p[0] = 1; }\n";
    let c = compile_source(src, "probe.cu", "sm_90").expect("compiles");
    assert!(
        c.log.to_lowercase().contains("warning"),
        "no warning in: {}",
        c.log
    );
}

#[test]
fn compile_errors_are_statuses_with_the_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let e = match compile_source("this is not C++;\n", "bad.cu", "sm_90") {
        Ok(_) => panic!("compiled garbage"),
        Err(e) => e,
    };
    assert_eq!(e.status, engram::EngramStatus::ErrDevice);
    assert!(e.message.contains("bad.cu"), "{}", e.message);
}

/// Not a check: `scripts/gpu-prebuild.sh` runs it (`--ignored --exact`) to
/// compile every module with this machine's NVRTC for each architecture of
/// `ENGRAM_PREBUILD_ARCHS` (`sm_90,sm_100`) into the directory
/// `ENGRAM_CUDA_MODULE_DIR` names, which the GPU check carries; each image is
/// read back through the loader's own lookup, so a bundle whose modules the
/// library would not find fails here.
#[test]
#[ignore = "scripts/gpu-prebuild.sh's step, not a check"]
fn prebuild_the_modules() {
    use engram::cuda::kernels::{
        module_file_name, module_image_from, write_module, MODULES, MODULE_DIR_ENV,
    };
    let dir = std::env::var_os(MODULE_DIR_ENV).expect("ENGRAM_CUDA_MODULE_DIR names the directory");
    let dir = std::path::PathBuf::from(dir);
    let archs = std::env::var("ENGRAM_PREBUILD_ARCHS").unwrap_or_else(|_| "sm_90".into());
    let (a, b) = nvrtc_version().unwrap_or_else(|e| panic!("{}", e.message));
    let supported = supported_archs().expect("nvrtcGetSupportedArchs");
    for arch in archs.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let n: i32 = arch.trim_start_matches("sm_").parse().expect("sm_XY");
        assert!(
            supported.contains(&n),
            "NVRTC {a}.{b} cannot compile for {arch}: {supported:?}"
        );
        for (m, (name, main)) in MODULES.iter().enumerate() {
            let t = std::time::Instant::now();
            let c = compile_source(main, name, arch)
                .unwrap_or_else(|e| panic!("{name} for {arch}: {}", e.message));
            assert_clean(name, arch, &c.log);
            write_module(&dir, m, arch, &c.image).unwrap_or_else(|e| panic!("{}", e.message));
            let back = module_image_from(Some(&dir), m, arch).unwrap();
            assert_eq!(back, c.image, "{name} for {arch} read back");
            println!(
                "{}: {} bytes, NVRTC {a}.{b}, {:.1} s",
                module_file_name(m, arch),
                c.image.len(),
                t.elapsed().as_secs_f64()
            );
        }
    }
}
