//! The kernels in `kernels/`, compiled with NVRTC (loaded at run time by
//! [`super::sys`]) once per process and architecture: to the device's own
//! SASS (a cubin) when this NVRTC supports the device's architecture
//! (`nvrtcGetSupportedArchs`), else to PTX for the newest virtual
//! architecture it supports below the device's (`compute_XY`), which the
//! driver compiles for the device when the module is loaded (a GPU newer
//! than the NVRTC, e.g. sm_120 with NVRTC 12.4).

use super::sys::{self, NvrtcApi};
use crate::error::{bail, EngramStatus, Error, Result};
use std::collections::HashMap;
use std::ffi::{c_char, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// Every kernel source, as NVRTC sees it: `(include name, text)`.
pub const SOURCES: [(&str, &str); 11] = [
    (
        "engram_common.cuh",
        include_str!("../../kernels/engram_common.cuh"),
    ),
    ("latch.cuh", include_str!("../../kernels/latch.cuh")),
    ("grid_sync.cuh", include_str!("../../kernels/grid_sync.cuh")),
    ("gather.cuh", include_str!("../../kernels/gather.cuh")),
    ("gate.cuh", include_str!("../../kernels/gate.cuh")),
    ("gather.cu", include_str!("../../kernels/gather.cu")),
    ("gate.cu", include_str!("../../kernels/gate.cu")),
    ("gemv.cu", include_str!("../../kernels/gemv.cu")),
    ("gemv_q.cu", include_str!("../../kernels/gemv_q.cu")),
    ("hash.cu", include_str!("../../kernels/hash.cu")),
    ("decode.cu", include_str!("../../kernels/decode.cu")),
];

/// Every kernel in one translation unit (the NVRTC check compiles it; the
/// SIMT build checks its include order against tests/simt/kernels_host.cpp).
pub const MODULE_MAIN: &str =
    "#include \"gather.cu\"\n#include \"gate.cu\"\n#include \"gemv.cu\"\n#include \"hash.cu\"\n#include \"gemv_q.cu\"\n#include \"decode.cu\"\n";

/// The modules the backend loads, `(name, translation unit)`: the one every
/// context needs; the quantised-`wkv` kernels, compiled and loaded the first
/// time a layer with such a `wkv` is set (they take as long to compile as
/// the rest together); and the decode kernels, the first time a layer with a
/// bf16 or block-scaled fp8 `wkv` is set where the decode kernel is on
/// (about 5 s with NVRTC 12.9 for sm_90 on this project's build machine,
/// the first module about 4 s). Together they are the whole of the main
/// unit above.
pub const MODULES: [(&str, &str); 3] = [
    (
        "engram_kernels.cu",
        "#include \"gather.cu\"\n#include \"gate.cu\"\n#include \"gemv.cu\"\n#include \"hash.cu\"\n",
    ),
    ("engram_quant.cu", "#include \"gemv_q.cu\"\n"),
    ("engram_decode.cu", "#include \"decode.cu\"\n"),
];

/// The byte offset of every field of the GGUF blocks, from their one
/// definition (`crate::formats::ggml`), as `-DENG_<FORMAT>_<FIELD>=N`: the
/// kernels address a block's fields by these names only.
fn block_field_defines() -> Vec<String> {
    use crate::formats::ggml::{
        BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ5K, BlockQ6K, BlockQ8_0,
    };
    use std::mem::offset_of;
    // `eng_k4_scale` reads Q5_K's scales through Q4_K's names: the same bytes.
    const _: () = assert!(
        offset_of!(BlockQ5K, d) == offset_of!(BlockQ4K, d)
            && offset_of!(BlockQ5K, dmin) == offset_of!(BlockQ4K, dmin)
            && offset_of!(BlockQ5K, scales) == offset_of!(BlockQ4K, scales)
    );
    let fields = [
        ("Q8_0_D", offset_of!(BlockQ8_0, d)),
        ("Q8_0_QS", offset_of!(BlockQ8_0, qs)),
        ("Q4_0_D", offset_of!(BlockQ4_0, d)),
        ("Q4_0_QS", offset_of!(BlockQ4_0, qs)),
        ("Q2_K_SCALES", offset_of!(BlockQ2K, scales)),
        ("Q2_K_QS", offset_of!(BlockQ2K, qs)),
        ("Q2_K_D", offset_of!(BlockQ2K, d)),
        ("Q2_K_DMIN", offset_of!(BlockQ2K, dmin)),
        ("Q3_K_HMASK", offset_of!(BlockQ3K, hmask)),
        ("Q3_K_QS", offset_of!(BlockQ3K, qs)),
        ("Q3_K_SCALES", offset_of!(BlockQ3K, scales)),
        ("Q3_K_D", offset_of!(BlockQ3K, d)),
        ("Q4_K_D", offset_of!(BlockQ4K, d)),
        ("Q4_K_DMIN", offset_of!(BlockQ4K, dmin)),
        ("Q4_K_SCALES", offset_of!(BlockQ4K, scales)),
        ("Q4_K_QS", offset_of!(BlockQ4K, qs)),
        ("Q5_K_QH", offset_of!(BlockQ5K, qh)),
        ("Q5_K_QS", offset_of!(BlockQ5K, qs)),
        ("Q6_K_QL", offset_of!(BlockQ6K, ql)),
        ("Q6_K_QH", offset_of!(BlockQ6K, qh)),
        ("Q6_K_SCALES", offset_of!(BlockQ6K, scales)),
        ("Q6_K_D", offset_of!(BlockQ6K, d)),
    ];
    fields
        .iter()
        .map(|(name, off)| format!("-DENG_{name}={off}u"))
        .collect()
}

/// The options every compile uses besides the architecture and [`defines`].
/// No `--use_fast_math` and no `--ftz`: f32 subnormals and IEEE division and
/// square root, so the dequantisation is exact and the gate matches the CPU's
/// formula.
pub const OPTIONS: [&str; 3] = ["--std=c++17", "--fmad=true", "-lineinfo"];

/// The constants the kernels share with Rust, as `-D` options: the type
/// numbers, block sizes and block field offsets ([`crate::formats`]), the error-latch codes
/// ([`super::latch`]), and the launch shapes below. The kernel sources define
/// none of them, so a build without these options fails to compile.
pub fn defines() -> Vec<String> {
    use crate::formats::{EngramType, FP8_SCALE_BLOCK};
    let mut v = Vec::new();
    for t in EngramType::ALL {
        let name = t.name().to_uppercase();
        v.push(format!("-DENG_{name}={}u", t as u32));
        if let Some((values, bytes)) = t.block() {
            v.push(format!("-DENG_{name}_BLOCK={values}u"));
            v.push(format!("-DENG_{name}_BLOCK_BYTES={bytes}u"));
        }
    }
    v.push(format!("-DENG_FP8_SCALE_BLOCK={FP8_SCALE_BLOCK}u"));
    v.extend(block_field_defines());
    v.extend(super::latch::LatchCode::defines());
    v.push(format!("-DENG_GATHER_THREADS={GATHER_THREADS}"));
    v.push(format!("-DENG_GATE_THREADS={GATE_THREADS}"));
    v.push(format!("-DENG_GEMV_THREADS={GEMV_THREADS}"));
    v.push(format!("-DENG_GEMV_ROWS={GEMV_ROWS_PER_WARP}"));
    v.push(format!("-DENG_GEMV_MAX={GEMV_MAX}"));
    v.push(format!("-DENG_DEQUANT_THREADS={DEQUANT_THREADS}"));
    v.push(format!("-DENG_DECODE_THREADS={DECODE_THREADS}"));
    v.push(format!("-DENG_DECODE_TILE={DECODE_TILE}"));
    v.push(format!("-DENG_DECODE_PREFETCH={DECODE_PREFETCH}"));
    v.push(format!("-DENG_DECODE_MIN_BLOCKS={DECODE_BLOCKS_PER_SM}"));
    v
}

/// What NVRTC produced: the cubin (or PTX) and its log.
pub struct Compiled {
    pub image: Vec<u8>,
    pub log: String,
}

/// NVRTC's functions, or `ErrDevice` saying why there are none.
pub fn api() -> Result<&'static NvrtcApi> {
    sys::nvrtc().map(|l| &l.api).map_err(|e| {
        Error::new(
            EngramStatus::ErrDevice,
            format!(
                "NVRTC cannot be loaded: {e}; the CUDA backend compiles its kernels at run time \
                 (the CUDA toolkit's libnvrtc, or the nvidia-cuda-nvrtc wheel's, on the loader path \
                 or in ENGRAM_CUDA_LIB_DIR)"
            ),
        )
    })
}

/// NVRTC's version `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    api()?;
    let v = sys::nvrtc().map(|l| l.version).unwrap_or_default();
    Ok((v.0, v.1))
}

/// The real architectures this NVRTC compiles for (`90` for sm_90, ...).
pub fn supported_archs() -> Result<Vec<i32>> {
    let nv = api()?;
    let mut n = 0;
    // SAFETY: locals as out-pointers; the array holds `n` entries.
    unsafe {
        nv_check(
            (nv.nvrtcGetNumSupportedArchs)(&mut n),
            "nvrtcGetNumSupportedArchs",
        )?;
        let mut v = vec![0i32; n.max(0) as usize];
        nv_check(
            (nv.nvrtcGetSupportedArchs)(v.as_mut_ptr()),
            "nvrtcGetSupportedArchs",
        )?;
        v.sort_unstable();
        Ok(v)
    }
}

/// What to compile for a device of compute capability `cc` with an NVRTC
/// that supports `supported`: `sm_XY` (a cubin) when it is listed, else
/// `compute_XY` (PTX) for the newest listed architecture below the device's;
/// an error when every listed one is newer than the device.
pub fn choose_arch(cc: (i32, i32), supported: &[i32]) -> Result<String> {
    let want = cc.0 * 10 + cc.1;
    if supported.contains(&want) {
        return Ok(format!("sm_{want}"));
    }
    match supported.iter().copied().filter(|&a| a <= want).max() {
        Some(a) => Ok(format!("compute_{a}")),
        None => bail!(
            ErrDevice,
            "this NVRTC compiles for sm_{} and newer; the device is sm_{want} (use an older CUDA \
             toolkit's libnvrtc)",
            supported.first().copied().unwrap_or(0)
        ),
    }
}

fn nv_check(r: sys::nvrtcResult, what: &str) -> Result<()> {
    if r == sys::NVRTC_SUCCESS {
        return Ok(());
    }
    let text = match api() {
        // SAFETY: a static string (or NULL) from NVRTC.
        Ok(nv) => unsafe {
            let p = (nv.nvrtcGetErrorString)(r);
            if p.is_null() {
                format!("NVRTC error {r}")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        },
        Err(_) => format!("NVRTC error {r}"),
    };
    Err(Error::new(
        EngramStatus::ErrDevice,
        format!("{what}: {text}"),
    ))
}

/// Compile `main` (with every file of [`SOURCES`] available to `#include`) for
/// `arch` (`"sm_90"`: a cubin; `"compute_90"`: PTX). A compile error is
/// `ErrDevice` with NVRTC's log; warnings come back in [`Compiled::log`].
pub fn compile_source(main: &str, name: &str, arch: &str) -> Result<Compiled> {
    let nv = api()?;
    let src = CString::new(main).expect("no NUL in kernel source");
    let cname = CString::new(name).expect("no NUL in name");
    let hdr_src: Vec<CString> = SOURCES
        .iter()
        .map(|(_, s)| CString::new(*s).expect("no NUL"))
        .collect();
    let hdr_name: Vec<CString> = SOURCES
        .iter()
        .map(|(n, _)| CString::new(*n).expect("no NUL"))
        .collect();
    let hs: Vec<*const c_char> = hdr_src.iter().map(|s| s.as_ptr()).collect();
    let hn: Vec<*const c_char> = hdr_name.iter().map(|s| s.as_ptr()).collect();
    let mut opts: Vec<CString> = vec![CString::new(format!("--gpu-architecture={arch}")).unwrap()];
    opts.extend(OPTIONS.iter().map(|o| CString::new(*o).unwrap()));
    opts.extend(defines().into_iter().map(|o| CString::new(o).unwrap()));
    let op: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: every pointer is a live CString for the duration of the calls;
    // the program is destroyed on every path.
    unsafe {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        nv_check(
            (nv.nvrtcCreateProgram)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                hs.len() as i32,
                hs.as_ptr(),
                hn.as_ptr(),
            ),
            "nvrtcCreateProgram",
        )?;
        let res = (|| {
            let rc = (nv.nvrtcCompileProgram)(prog, op.len() as i32, op.as_ptr());
            let mut n = 0usize;
            nv_check(
                (nv.nvrtcGetProgramLogSize)(prog, &mut n),
                "nvrtcGetProgramLogSize",
            )?;
            let mut log = vec![0 as c_char; n.max(1)];
            nv_check(
                (nv.nvrtcGetProgramLog)(prog, log.as_mut_ptr()),
                "nvrtcGetProgramLog",
            )?;
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            if rc != sys::NVRTC_SUCCESS {
                bail!(
                    ErrDevice,
                    "NVRTC could not compile the engram kernels for {arch} (error {rc})\n{log}"
                );
            }
            let image = if arch.starts_with("sm_") {
                let mut n = 0usize;
                nv_check((nv.nvrtcGetCUBINSize)(prog, &mut n), "nvrtcGetCUBINSize")?;
                let mut v = vec![0u8; n];
                nv_check(
                    (nv.nvrtcGetCUBIN)(prog, v.as_mut_ptr() as *mut c_char),
                    "nvrtcGetCUBIN",
                )?;
                v
            } else {
                let mut n = 0usize;
                nv_check((nv.nvrtcGetPTXSize)(prog, &mut n), "nvrtcGetPTXSize")?;
                let mut v = vec![0u8; n];
                nv_check(
                    (nv.nvrtcGetPTX)(prog, v.as_mut_ptr() as *mut c_char),
                    "nvrtcGetPTX",
                )?;
                v
            };
            Ok(Compiled { image, log })
        })();
        let _ = (nv.nvrtcDestroyProgram)(&mut prog);
        res
    }
}

/// The environment variable naming a directory of compiled modules (see
/// [`module_image`]): `scripts/gpu-prebuild.sh` fills one with cubins made
/// by NVRTC on the build machine, and `scripts/gpu-check.sh` points every
/// process of a run at it, so a GPU run compiles nothing whose sources match.
pub const MODULE_DIR_ENV: &str = "ENGRAM_CUDA_MODULE_DIR";

/// A hash (64-bit FNV-1a) of everything that decides module `m`'s image for
/// `arch`: its translation unit, every file of [`SOURCES`], [`OPTIONS`],
/// [`defines`] and the architecture. NVRTC's own version is not in it: a
/// cubin from an older NVRTC loads on a newer driver, and one the driver
/// refuses is compiled again ([`module_image_fresh`]).
pub fn module_hash(m: usize, arch: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |b: &[u8]| {
        for &x in b.iter().chain(&[0xFFu8]) {
            h ^= x as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(MODULES[m].0.as_bytes());
    eat(MODULES[m].1.as_bytes());
    for (name, text) in SOURCES {
        eat(name.as_bytes());
        eat(text.as_bytes());
    }
    for o in OPTIONS {
        eat(o.as_bytes());
    }
    for d in defines() {
        eat(d.as_bytes());
    }
    eat(arch.as_bytes());
    h
}

/// The file module `m` for `arch` has in a module directory: its name, the
/// architecture and [`module_hash`], so a file made from other sources is
/// never found.
pub fn module_file_name(m: usize, arch: &str) -> String {
    let stem = MODULES[m].0.trim_end_matches(".cu");
    let ext = if arch.starts_with("sm_") {
        "cubin"
    } else {
        "ptx"
    };
    format!("{stem}-{arch}-{:016x}.{ext}", module_hash(m, arch))
}

/// NVRTC compiles this process has run for [`module_image`] (the tests
/// count them to see that a module directory is used).
pub fn module_compiles() -> u64 {
    COMPILES.load(std::sync::atomic::Ordering::Relaxed)
}
static COMPILES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

type Images = HashMap<(usize, String), Arc<Vec<u8>>>;
fn image_cache() -> &'static Mutex<Images> {
    static CACHE: OnceLock<Mutex<Images>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The module directory named by [`MODULE_DIR_ENV`], if any.
fn module_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(MODULE_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(Into::into)
}

/// Module `m`'s image from `dir`, if a file of its [`module_file_name`] is
/// there (a cubin whose sources match); a file that cannot be read is a
/// miss (NVRTC compiles the module again).
fn read_module(dir: &std::path::Path, m: usize, arch: &str) -> Option<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(dir.join(module_file_name(m, arch))).ok()?;
    let len = usize::try_from(f.metadata().ok()?.len()).ok()?;
    // A module is a few MB; the file sizes this buffer, so it is fallible.
    let mut v = crate::fallible::try_room::<u8>(len, "a cached CUDA module").ok()?;
    f.take(len as u64).read_to_end(&mut v).ok()?;
    (v.len() == len && len > 0).then_some(v)
}

/// Write module `m`'s `image` into `dir` under its [`module_file_name`]: to a
/// file of this process's own, renamed into place, so the processes of one
/// run that share the directory never read a partial file.
pub fn write_module(dir: &std::path::Path, m: usize, arch: &str, image: &[u8]) -> Result<()> {
    let name = module_file_name(m, arch);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let io = |e: std::io::Error| {
        Error::new(
            EngramStatus::ErrIo,
            format!("writing the CUDA module {name} into {}: {e}", dir.display()),
        )
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(&tmp, image).map_err(io)?;
    std::fs::rename(&tmp, dir.join(&name)).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

/// Compile module `m` for `arch` with NVRTC (counted by [`module_compiles`]).
pub fn compile_module(m: usize, arch: &str) -> Result<Vec<u8>> {
    let (name, main) = MODULES[m];
    COMPILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(compile_source(main, name, arch)?.image)
}

/// Module `m` of [`MODULES`] for `arch`, once per process: from the module
/// directory ([`MODULE_DIR_ENV`]) when it holds this module for these sources
/// and this architecture, else compiled by NVRTC (and then written there for
/// the run's other processes, when a directory is named; a failed write only
/// costs them the compile).
pub fn module_image(m: usize, arch: &str) -> Result<Arc<Vec<u8>>> {
    let key = (m, arch.to_string());
    if let Some(img) = image_cache()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&key)
    {
        return Ok(img.clone());
    }
    let img = module_image_from(module_dir().as_deref(), m, arch)?;
    let img = Arc::new(img);
    image_cache()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, img.clone());
    Ok(img)
}

/// Module `m` for `arch` from the module directory `dir` if it holds it for
/// these sources, else compiled by NVRTC and written there (a failed write
/// only costs the run's other processes the compile). No in-memory cache:
/// [`module_image`] is that.
pub fn module_image_from(dir: Option<&std::path::Path>, m: usize, arch: &str) -> Result<Vec<u8>> {
    if let Some(img) = dir.and_then(|d| read_module(d, m, arch)) {
        return Ok(img);
    }
    let img = compile_module(m, arch)?;
    if let Some(d) = dir {
        let _ = write_module(d, m, arch, &img);
    }
    Ok(img)
}

/// Module `m` for `arch` compiled by NVRTC whatever the caches hold (the
/// driver refused the cached image: from another toolkit, or damaged), and
/// put in place of the cached one (in memory and in the module directory).
pub fn module_image_fresh(m: usize, arch: &str) -> Result<Arc<Vec<u8>>> {
    let img = compile_module(m, arch)?;
    if let Some(d) = module_dir() {
        let _ = write_module(&d, m, arch, &img);
    }
    let img = Arc::new(img);
    image_cache()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert((m, arch.to_string()), img.clone());
    Ok(img)
}

/// The architecture to compile for on a device of compute capability `cc`
/// ([`choose_arch`] with this NVRTC's list).
pub fn arch_for(cc: (i32, i32)) -> Result<String> {
    choose_arch(cc, &supported_archs()?)
}

/// Most tokens the GEMV kernels take (`engram_gemv_bf16_1` ... `_8`,
/// `engram_gemv_q_1` ... `_8`).
pub const GEMV_MAX: usize = 8;
/// Threads of a gather / gate / GEMV / dequantise block, and output rows per
/// GEMV warp (passed to the kernels by [`defines`]).
pub const GATHER_THREADS: u32 = 256;
/// Most blocks of a gather launch. The gather is persistent: each warp takes
/// (token, column) cells in a grid-stride loop, so a 4096-token prefill of
/// V4.1 (98,304 cells) is this many blocks, not one block per cell. 1024
/// blocks of 8 warps is about what an H200 holds at once (132 SMs, 8 such
/// blocks each); untimed here: a GPU run must measure it.
pub const GATHER_BLOCKS: u32 = 1024;

/// The gather's grid for `cells` (token, column) cells: a warp per cell, at
/// most [`GATHER_BLOCKS`] blocks.
pub fn gather_blocks(cells: usize) -> u32 {
    cells
        .div_ceil((GATHER_THREADS / 32) as usize)
        .clamp(1, GATHER_BLOCKS as usize) as u32
}
pub const GATE_THREADS: u32 = 256;

/// The gate's grid for `streams` (token, stream) pairs: a warp each.
pub fn gate_blocks(streams: usize) -> u32 {
    streams.div_ceil((GATE_THREADS / 32) as usize).max(1) as u32
}
pub const GEMV_THREADS: u32 = 256;
pub const GEMV_ROWS_PER_WARP: u32 = 2;
pub const DEQUANT_THREADS: u32 = 256;

/// Threads of a decode block (`kernels/decode.cu`; docs/cuda.md "The decode
/// kernel").
pub const DECODE_THREADS: u32 = 256;
/// Most tokens a decode block holds in shared memory at once (a tile):
/// `wkv` is streamed once per tile. 16 tokens of V4.1's `C*Hd` = 6144 are
/// 192 KiB, within an H100's or H200's 227 KiB.
pub const DECODE_TILE: usize = 16;
/// Chunks (16 bytes of bf16 weights, 8 of fp8 codes) per row of its pair a
/// decode lane loads at a time, and keeps in flight while it sums the
/// previous ones: 2 rows x 2 x 16 bytes a lane, 16 KiB a block of 8 warps.
/// (4 added 2 s of NVRTC time for the same bytes per load; untimed on a
/// GPU, which must show whether more in flight pays.)
pub const DECODE_PREFETCH: u32 = 2;
/// Most tokens the decode kernel takes (the range issue 17 asks for).
pub const DECODE_MAX: usize = 64;
/// Most decode blocks per multiprocessor: more would only gather the same
/// rows more times (every block gathers the whole tile). Also the kernel's
/// `__launch_bounds__` minimum, so that its registers leave room for 2
/// (at most 128 a thread) where shared memory does.
pub const DECODE_BLOCKS_PER_SM: u32 = 2;

/// Output rows a decode warp sums together (`ENG_DECODE_ROWS`).
pub const DECODE_ROWS: usize = 2;

/// The tokens of a decode tile for `n` tokens of `k_in` = `C*Hd` values,
/// with `max_shared` bytes of dynamic shared memory per block: 0 when one
/// token's row does not fit.
pub fn decode_tile(n: usize, k_in: usize, max_shared: usize) -> usize {
    n.min(DECODE_TILE).min(max_shared / (2 * k_in).max(1))
}

/// The decode grid: `min(sms * min(blocks_per_sm, DECODE_BLOCKS_PER_SM),
/// ceil(pairs / warps))` blocks, at least 1, for `n_out` output rows.
pub fn decode_grid(n_out: usize, sms: u32, blocks_per_sm: u32) -> u32 {
    let pairs = n_out.div_ceil(DECODE_ROWS);
    let warps = (DECODE_THREADS / 32) as usize;
    let want = pairs.div_ceil(warps).clamp(1, u32::MAX as usize) as u32;
    let fit = sms
        .saturating_mul(blocks_per_sm.min(DECODE_BLOCKS_PER_SM))
        .max(1);
    want.min(fit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gather_and_gate_grids_are_a_warp_per_row_or_stream() {
        let warps = (GATHER_THREADS / 32) as usize;
        assert_eq!(gather_blocks(1), 1);
        assert_eq!(gather_blocks(warps), 1);
        assert_eq!(gather_blocks(warps + 1), 2);
        assert_eq!(gather_blocks(4096 * 24), GATHER_BLOCKS);
        assert_eq!(gather_blocks(usize::MAX / 2), GATHER_BLOCKS);
        assert_eq!(gate_blocks(1), 1);
        assert_eq!(gate_blocks(8), 1);
        assert_eq!(gate_blocks(9), 2);
        assert_eq!(gate_blocks(4096 * 4), 2048);
    }

    #[test]
    fn the_decode_tile_and_grid() {
        // V4.1: C*Hd = 6144, an H200's 227 KiB: 16 tokens a tile.
        assert_eq!(decode_tile(1, 6144, 227 << 10), 1);
        assert_eq!(decode_tile(64, 6144, 227 << 10), DECODE_TILE);
        // An A100's 163 KiB: 13 tokens.
        assert_eq!(decode_tile(64, 6144, 163 << 10), 13);
        // A row that does not fit: none.
        assert_eq!(decode_tile(1, 1 << 20, 227 << 10), 0);
        // 25600 outputs: 12800 pairs, 1600 blocks of 8 warps wanted; an
        // H200's 132 SMs hold 2 each.
        assert_eq!(decode_grid(25600, 132, 1), 132);
        assert_eq!(decode_grid(25600, 132, 8), 264);
        assert_eq!(decode_grid(320, 4, 8), 8);
        assert_eq!(decode_grid(3, 4, 8), 1);
        assert_eq!(decode_grid(320, 4, 0), 1);
    }

    #[test]
    fn a_module_directory_serves_the_image_of_these_sources_only() {
        let dir = std::env::temp_dir().join(format!("engram-modules-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // The name carries the sources' hash and the architecture.
        let name = module_file_name(1, "sm_90");
        assert!(
            name.starts_with("engram_quant-sm_90-") && name.ends_with(".cubin"),
            "{name}"
        );
        assert_ne!(name, module_file_name(1, "sm_100"));
        assert_ne!(module_hash(0, "sm_90"), module_hash(1, "sm_90"));
        assert!(module_file_name(2, "compute_90").ends_with(".ptx"));
        // A carried image is read, not compiled.
        let carried = b"a cubin made on the build machine".to_vec();
        write_module(&dir, 1, "sm_90", &carried).unwrap();
        let before = module_compiles();
        assert_eq!(module_image_from(Some(&dir), 1, "sm_90").unwrap(), carried);
        assert_eq!(
            module_compiles(),
            before,
            "no NVRTC compile for a matching image"
        );
        // An image made from other sources (another hash) is never found:
        // this module is compiled (or, without NVRTC here, its error).
        let stale = dir.join(module_file_name(1, "sm_90").replace("-sm_90-", "-sm_90-0"));
        std::fs::write(&stale, b"stale").unwrap();
        std::fs::remove_file(dir.join(module_file_name(1, "sm_90"))).unwrap();
        match module_image_from(Some(&dir), 1, "sm_90") {
            Ok(img) => {
                assert_ne!(img, b"stale".to_vec());
                // ... and written for the run's other processes.
                assert_eq!(std::fs::read(dir.join(&name)).unwrap(), img);
            }
            Err(e) => assert_eq!(e.status, EngramStatus::ErrDevice, "{}", e.message),
        }
        assert!(module_compiles() > before);
        // An empty file is a miss, not an image.
        write_module(&dir, 0, "sm_90", b"").unwrap();
        assert!(read_module(&dir, 0, "sm_90").is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_modules_make_up_the_main_unit() {
        let joined: String = MODULES.iter().map(|m| m.1).collect();
        assert_eq!(joined, MODULE_MAIN);
    }

    #[test]
    fn the_target_is_the_device_or_the_newest_older_virtual_arch() {
        let nvrtc12_4 = [50, 52, 53, 60, 61, 62, 70, 72, 75, 80, 86, 87, 89, 90];
        let nvrtc13 = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        assert_eq!(choose_arch((9, 0), &nvrtc12_4).unwrap(), "sm_90");
        assert_eq!(choose_arch((9, 0), &nvrtc13).unwrap(), "sm_90");
        // A device newer than the NVRTC: PTX the driver compiles.
        assert_eq!(choose_arch((12, 0), &nvrtc12_4).unwrap(), "compute_90");
        assert_eq!(choose_arch((10, 0), &nvrtc12_4).unwrap(), "compute_90");
        // A minor version the NVRTC lacks: the newest older one.
        assert_eq!(choose_arch((8, 9), &[80, 86, 90]).unwrap(), "compute_86");
        // An NVRTC that dropped the device.
        let e = choose_arch((7, 0), &nvrtc13).unwrap_err();
        assert_eq!(e.status, EngramStatus::ErrDevice);
        assert!(e.message.contains("sm_75"), "{}", e.message);
    }
}
