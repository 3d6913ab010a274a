//! The device the CUDA tests run on: the GPU when there is one, else the
//! emulation (`engram::cuda::emu`: the kernels of `kernels/` compiled as host
//! C++ with the SIMT shim of `tests/simt`, under the real `CudaBackend`).
//!
//! - `ENGRAM_REQUIRE_GPU=1` (set by `scripts/gpu-check.sh`): the GPU or a
//!   failure.
//! - `ENGRAM_TEST_DEVICE=emulated`: the emulation even where there is a GPU.
//! - `ENGRAM_REQUIRE_EMULATION=1` (set by `scripts/test.sh` and the bundle's
//!   smoke run in `scripts/gpu-prebuild.sh`, which promise to run them): the
//!   emulation or a failure where there is no GPU.
//! - Otherwise, without a GPU and without g++, each test that checks nothing
//!   says so with [`skip`]: its name and why, past the harness's capture,
//!   counted per test binary.
//!
//! The SIMT library (and its self-test, run by `tests/simt_selftest.rs`) is
//! built once per source state (a hash of the kernels, the shim and the `-D`
//! options) into `target/tmp/simt-<hash>/`, under a file lock, so every test
//! binary of a run shares one build (~20 s). The build itself is
//! `simt_build.rs`, which `tools/engram-emu` shares.

use super::{dense_bytes, dense_type, DeviceLayerIn, LayerData, Tiny};
use engram::cuda::emu::Emulator;
use engram::cuda::gpu::{DevBuf, Gpu};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

#[path = "simt_build.rs"]
mod simt_build;

/// A device for the tests.
#[derive(Clone)]
pub struct Dev {
    pub gpu: Arc<dyn Gpu>,
    /// The emulation, when that is what `gpu` is.
    pub emu: Option<Arc<Emulator>>,
}

impl Dev {
    pub fn is_real(&self) -> bool {
        self.emu.is_none()
    }

    pub fn upload<T: Copy>(&self, data: &[T]) -> DevBuf {
        DevBuf::from_slice(&self.gpu, data, "test data").expect("upload")
    }

    pub fn alloc(&self, bytes: usize) -> DevBuf {
        DevBuf::new(&self.gpu, bytes, "test data").expect("alloc")
    }
}

/// A layer of the tiny model on a device: its table, `wkv`, `q` and `k` as
/// the golden holds them.
pub struct DevWeights {
    pub table: DevBuf,
    pub wkv: DevBuf,
    pub q: DevBuf,
    pub k: DevBuf,
}

impl DevWeights {
    pub fn upload(dev: &Dev, l: &LayerData) -> Self {
        DevWeights {
            table: dev.upload(&l.table),
            wkv: dev.upload(&dense_bytes(&l.wkv)),
            q: dev.upload(&dense_bytes(&l.q)),
            k: dev.upload(&dense_bytes(&l.k)),
        }
    }

    /// Layer `l`'s `set_layer_device` input over these buffers.
    pub fn layer_in(&self, l: &LayerData) -> DeviceLayerIn {
        DeviceLayerIn {
            layer_id: l.layer_id,
            table: self.table.ptr,
            table_rows: l.rows,
            table_type: l.format as u32,
            wkv: self.wkv.ptr,
            wkv_type: dense_type(&l.wkv),
            q: self.q.ptr,
            k: self.k.ptr,
            qk_type: dense_type(&l.q),
        }
    }
}

/// Every layer of the tiny model on `dev`.
pub fn dev_model(dev: &Dev, tiny: &Tiny) -> Vec<DevWeights> {
    tiny.layers
        .iter()
        .map(|l| DevWeights::upload(dev, l))
        .collect()
}

/// Say that the calling test checks nothing in this configuration, and why:
/// one line naming the test, straight to stderr (the test harness captures
/// `println!`), with the count of such skips in this test binary so far.
pub fn skip(why: &str) {
    use std::io::Write;
    use std::sync::atomic::{AtomicUsize, Ordering};
    static SKIPPED: AtomicUsize = AtomicUsize::new(0);
    let k = SKIPPED.fetch_add(1, Ordering::Relaxed) + 1;
    let name = std::thread::current().name().unwrap_or("?").to_string();
    let _ = writeln!(
        std::io::stderr(),
        "SKIP {name}: {why} (skip {k} of this test binary)"
    );
}

fn require_emulation() -> bool {
    std::env::var("ENGRAM_REQUIRE_EMULATION").is_ok_and(|v| v == "1")
}

fn require_gpu() -> bool {
    std::env::var("ENGRAM_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The GPU, if there is one (and the tests may use it).
pub fn real() -> Option<Dev> {
    static REAL: OnceLock<Option<Dev>> = OnceLock::new();
    REAL.get_or_init(|| {
        if std::env::var("ENGRAM_TEST_DEVICE").is_ok_and(|v| v == "emulated") && !require_gpu() {
            return None;
        }
        match engram::cuda::probe() {
            Ok(desc) => {
                let gpu = engram::cuda::driver::RealGpu::open(0).expect("open device 0");
                println!("GPU: {desc}; {}", gpu.describe());
                Some(Dev { gpu, emu: None })
            }
            Err(why) => {
                assert!(!require_gpu(), "ENGRAM_REQUIRE_GPU=1 but: {why}");
                None
            }
        }
    })
    .clone()
}

/// The GPU if there is one, else the emulation; `None` (having said why)
/// when neither can be had.
pub fn device() -> Option<Dev> {
    if let Some(d) = real() {
        return Some(d);
    }
    emulated()
}

/// The emulation (never the GPU); not in the GPU check (`ENGRAM_REQUIRE_GPU=1`),
/// whose time is the GPU's.
pub fn emulated() -> Option<Dev> {
    static EMU: OnceLock<Option<Dev>> = OnceLock::new();
    if require_gpu() {
        skip("emulation-only, and this is the GPU check (ENGRAM_REQUIRE_GPU=1)");
        return None;
    }
    let emu = EMU
        .get_or_init(|| match simt_library() {
            Err(e) => panic!("the SIMT emulation could not be built: {e}"),
            Ok(Some(p)) => {
                let emu = Emulator::load(&p).unwrap_or_else(|e| panic!("{}", e.message));
                let gpu: Arc<dyn Gpu> = emu.clone();
                Some(Dev {
                    gpu,
                    emu: Some(emu),
                })
            }
            Ok(None) => {
                assert!(
                !require_emulation(),
                "ENGRAM_REQUIRE_EMULATION=1 but there is no g++ (CXX) to build the SIMT emulation"
            );
                None
            }
        })
        .clone();
    if emu.is_none() {
        skip("no GPU, and no g++ (CXX) to build the SIMT emulation");
    }
    emu
}

/// A fresh emulated device of its own, with its own launch counts and
/// deferral (`None` where the emulation cannot be had, having said why). The
/// tests of a binary run in parallel on the shared [`emulated`] device, so a
/// test that asserts a count of launches, or defers streams, takes this one.
pub fn own_emulator() -> Option<(Dev, Arc<Emulator>)> {
    emulated()?;
    let p = simt_library().expect("the SIMT library").expect("built");
    let emu = Emulator::load(&p).expect("load the SIMT library");
    let gpu: Arc<dyn Gpu> = emu.clone();
    Some((
        Dev {
            gpu,
            emu: Some(emu.clone()),
        },
        emu,
    ))
}

/// The GPU if there is one, else [`own_emulator`]'s device: for a test that
/// counts launches on the emulation and runs on the GPU as well.
pub fn own_device() -> Option<Dev> {
    real().or_else(|| own_emulator().map(|(d, _)| d))
}

/// `libengram_simt.so` for this tree's kernels, built if needed
/// (`ENGRAM_SIMT_LIB` names a prebuilt one); `Ok(None)` without a compiler.
pub fn simt_library() -> Result<Option<PathBuf>, String> {
    static LIB: OnceLock<Result<Option<PathBuf>, String>> = OnceLock::new();
    LIB.get_or_init(build_simt).clone()
}

fn build_simt() -> Result<Option<PathBuf>, String> {
    if let Some(p) = std::env::var_os("ENGRAM_SIMT_LIB") {
        return Ok(Some(PathBuf::from(p)));
    }
    simt_build::build(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        Path::new(env!("CARGO_TARGET_TMPDIR")),
    )
}
