//! Building `libengram_simt.so` (the kernels of `kernels/` as host C++ with
//! the SIMT shim of `tests/simt`) for the tree at `root`, once per source
//! state, into `base/simt-<hash>/`: a hash of the kernels, the shim and the
//! `-D` options, so every test binary of a run (and `tools/engram-emu`,
//! which includes this file) shares one build, made under a file lock.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fnv(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x100000001b3);
    }
}

/// `base/simt-<hash>/libengram_simt.so` for the tree at `root` (built if
/// needed); `Ok(None)` without a C++ compiler (`CXX`, default g++).
pub fn build(root: &Path, base: &Path) -> Result<Option<PathBuf>, String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    if Command::new(&cxx).arg("--version").output().is_err() {
        return Ok(None);
    }
    let fmad = if cfg!(target_arch = "x86_64") && std::arch::is_x86_feature_detected!("fma") {
        "1"
    } else {
        "0"
    };
    let defines = engram::cuda::kernels::defines();
    let mut h = 0xcbf29ce484222325u64;
    for dir in ["kernels", "tests/simt"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .map_err(|e| format!("{dir}: {e}"))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for f in files {
            fnv(&mut h, f.file_name().unwrap().to_string_lossy().as_bytes());
            fnv(
                &mut h,
                &std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?,
            );
        }
    }
    fnv(&mut h, defines.join(" ").as_bytes());
    fnv(&mut h, engram::cuda::kernels::OPTIONS.join(" ").as_bytes());
    fnv(&mut h, fmad.as_bytes());
    let dir = base.join(format!("simt-{h:016x}"));
    let lib = dir.join("libengram_simt.so");
    if lib.exists() {
        return Ok(Some(lib));
    }
    std::fs::create_dir_all(base).map_err(|e| e.to_string())?;
    // One build at a time across the test binaries of a run.
    let lock = std::fs::File::create(base.join("simt.lock")).map_err(|e| e.to_string())?;
    {
        use std::os::unix::io::AsRawFd;
        // SAFETY: flock on a descriptor we own; released when it closes.
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    }
    if lib.exists() {
        return Ok(Some(lib));
    }
    let tmp = base.join(format!("simt-{h:016x}.tmp"));
    let _ = std::fs::remove_dir_all(&tmp);
    let t0 = std::time::Instant::now();
    let out = Command::new("bash")
        .arg(root.join("tests/simt/build.sh"))
        .arg(&tmp)
        .args(&defines)
        .env("FMAD", fmad)
        .output()
        .map_err(|e| format!("running tests/simt/build.sh: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "tests/simt/build.sh failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    std::fs::write(tmp.join("defines.txt"), defines.join(" ")).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, &dir).map_err(|e| e.to_string())?;
    eprintln!(
        "built the SIMT emulation in {:.1} s: {}",
        t0.elapsed().as_secs_f64(),
        lib.display()
    );
    Ok(Some(lib))
}
