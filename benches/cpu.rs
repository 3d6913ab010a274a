//! CPU benchmark: hash throughput against DeepSeek's numpy approach, and
//! `apply` at the DeepSeek-V4.1 geometry against PyTorch on the CPU, against
//! the roofline and against ggml's CPU backend (llama.cpp's engram op chain,
//! bench/ggml/ggml_peer.cpp), all measured in this one run.
//!
//!     bash bench/setup.sh            # once: numpy + torch in bench/.venv
//!     cargo bench --bench cpu        # builds the ggml peers itself (cached)
//!
//! Environment: `ENGRAM_BENCH_THREADS=N` (threads; default all),
//! `ENGRAM_CPU_KERNEL=portable|avx2|avx512|avx512bf16|amx` (force a
//! projection kernel, e.g. the AVX2 fallback on an AVX-512 machine; where
//! `amx` runs, the bf16 section also prints the `avx512` GEMM rate), `ENGRAM_BENCH_ONLY=hash|apply|formats|ggml`,
//! `ENGRAM_BENCH_REPS=N` (repetitions of each timing; the median is printed
//! with the spread min-max), `ENGRAM_BENCH_PYTHON` (a Python with numpy and
//! torch other than bench/.venv's), `ENGRAM_ROOT` (the source tree, for a
//! binary run away from it: scripts/cpu-kernels-check.sh).
//!
//! Without bench/.venv the Python peers are skipped and said to be. The ggml
//! peer is built by the bench (bench/ggml/build.sh: ggml for this CPU and
//! ggml's portable AVX2 build, each cached; `ENGRAM_BENCH_GGML=native|avx2`
//! runs one); a build that fails (no cmake, no network for its sources the
//! first time) is skipped and said to be.

use engram::cpu::projection::{Kernel, Projection};
use engram::formats::f32_to_bf16;
use engram::hash::derive_primes_uniform;
use engram::{
    Context, ContextConfig, EngramType, Geometry, HashTablesIn, Highway, LayerIn, Limits, Weights,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The source tree (golden data, bench/peers.py): `ENGRAM_ROOT`, else the
/// one this was built from (a prebuilt binary run elsewhere sets it).
fn root() -> PathBuf {
    std::env::var_os("ENGRAM_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Median seconds of `f`, at least `reps` runs and at least `min_s` seconds.
fn median(reps: usize, min_s: f64, f: impl FnMut()) -> f64 {
    stats(reps, min_s, f).med
}

/// Median, fastest and slowest of the runs.
#[derive(Clone, Copy)]
struct Stat {
    med: f64,
    min: f64,
    max: f64,
}

impl Stat {
    /// `med ms (min-max)`.
    fn ms(&self) -> String {
        format!(
            "{:.2} ({:.2}-{:.2})",
            self.med * 1e3,
            self.min * 1e3,
            self.max * 1e3
        )
    }
}

fn stats(reps: usize, min_s: f64, f: impl FnMut()) -> Stat {
    stats_by(reps, min_s, f, || {
        Instant::now().duration_since(*EPOCH).as_secs_f64()
    })
}

/// [`stats`] in process CPU seconds (all threads): on a shared machine, wall
/// time also counts the time other processes took the cores.
fn cpu_stats(reps: usize, min_s: f64, f: impl FnMut()) -> Stat {
    stats_by(reps, min_s, f, cpu_seconds)
}

static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

fn stats_by(reps: usize, min_s: f64, mut f: impl FnMut(), clock: impl Fn() -> f64) -> Stat {
    let reps = reps.max(reps_env());
    let mut t = Vec::new();
    let start = Instant::now();
    while t.len() < reps || (start.elapsed().as_secs_f64() < min_s && t.len() < 10 * reps) {
        let s = clock();
        f();
        t.push(clock() - s);
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Stat {
        med: t[t.len() / 2],
        min: t[0],
        max: t[t.len() - 1],
    }
}

/// The nominal clock in GHz (/proc/cpuinfo's first "cpu MHz"; 0 unknown).
fn nominal_ghz() -> f64 {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("cpu MHz"))
                .and_then(|l| l.split(':').nth(1)?.trim().parse::<f64>().ok())
        })
        .map_or(0.0, |m| m / 1e3)
}

/// CPU seconds of this process so far (all threads).
fn cpu_seconds() -> f64 {
    // SAFETY: clock_gettime writes one `timespec` into the zeroed value it is given.
    let ts = unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts);
        ts
    };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn reps_env() -> usize {
    std::env::var("ENGRAM_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The projection kernel forced by `ENGRAM_CPU_KERNEL`, if any.
fn kernel_env() -> Option<Kernel> {
    let v = std::env::var("ENGRAM_CPU_KERNEL")
        .ok()
        .filter(|v| !v.is_empty())?;
    let k = Kernel::from_name(&v).unwrap_or_else(|| panic!("ENGRAM_CPU_KERNEL={v}: not a kernel"));
    assert!(k.supported(), "ENGRAM_CPU_KERNEL={v}: this CPU lacks it");
    Some(k)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// The Python with numpy and torch: `ENGRAM_BENCH_PYTHON`, else bench/.venv's.
fn python() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("ENGRAM_BENCH_PYTHON") {
        return Some(PathBuf::from(p));
    }
    let p = root().join("bench/.venv/bin/python");
    p.exists().then_some(p)
}

fn run_peer(mode: &str, spec: &Value) -> Option<Value> {
    let py = python()?;
    let path =
        std::env::temp_dir().join(format!("engram-bench-{mode}-{}.json", std::process::id()));
    std::fs::write(&path, spec.to_string()).unwrap();
    let out = std::process::Command::new(&py)
        .arg(root().join("bench/peers.py"))
        .arg(mode)
        .arg(&path)
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => {
            eprintln!("peer {mode}: cannot run {}: {e}", py.display());
            let _ = std::fs::remove_file(&path);
            return None;
        }
    };
    let _ = std::fs::remove_file(&path);
    if !out.status.success() {
        eprintln!(
            "peer {mode} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or("")
        .to_string();
    serde_json::from_str(&line).ok()
}

fn load(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Read bandwidth of main memory with `threads` threads: best of 3 passes
/// over a 2 GiB buffer (far larger than the last-level cache), each thread
/// summing its half with wide loads and eight independent accumulators.
fn memory_bandwidth(threads: usize) -> f64 {
    let n = (2usize << 30) / 4;
    let buf: Vec<f32> = (0..n).map(|i| (i & 0xff) as f32).collect();
    let chunk = n.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..3 {
        let s = Instant::now();
        let total: f32 = std::thread::scope(|sc| {
            let hs: Vec<_> = buf
                .chunks(chunk)
                .map(|c| sc.spawn(move || read_sum(c)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        std::hint::black_box(total);
        best = best.max((n * 4) as f64 / s.elapsed().as_secs_f64());
    }
    best
}

fn read_sum(c: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has avx512f.
        return unsafe { read_sum_avx512(c) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has avx2.
        return unsafe { read_sum_avx2(c) };
    }
    let mut acc = [0f32; 16];
    for b in c.chunks_exact(16) {
        for j in 0..16 {
            acc[j] += b[j];
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn read_sum_avx2(c: &[f32]) -> f32 {
    // SAFETY: the CPU has avx2 (the caller checked); loads stay inside `c`.
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        while i + 64 <= c.len() {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_loadu_ps(c.as_ptr().add(i + 8 * j)));
            }
            i += 64;
        }
        let mut s = c[i..].iter().sum::<f32>();
        let mut lanes = [0f32; 8];
        for a in acc {
            _mm256_storeu_ps(lanes.as_mut_ptr(), a);
            s += lanes.iter().sum::<f32>();
        }
        s
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_sum_avx512(c: &[f32]) -> f32 {
    // SAFETY: the caller upholds this function's `# Safety` contract
    // (the CPU features it is compiled for, and the sizes it reads and writes).
    unsafe {
        use std::arch::x86_64::*;
        let mut acc = [_mm512_setzero_ps(); 8];
        let mut i = 0;
        while i + 128 <= c.len() {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_add_ps(*a, _mm512_loadu_ps(c.as_ptr().add(i + 16 * j)));
            }
            i += 128;
        }
        let mut s = c[i..].iter().sum::<f32>();
        for a in acc {
            s += _mm512_reduce_add_ps(a);
        }
        s
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    // `cargo test --all-targets` runs this file without `--bench`: the full
    // benchmark (minutes, 2.5 GB of weights) is only for `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("cpu benchmark: not run under cargo test (cargo bench --bench cpu runs it)");
        return;
    }
    let threads: usize = std::env::var("ENGRAM_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
    println!(
        "engram CPU benchmark: {threads} threads, projection kernel {:?} ({}; detected {:?})",
        kernel_env().unwrap_or(Kernel::detect()),
        if kernel_env().is_some() {
            "forced by ENGRAM_CPU_KERNEL"
        } else {
            "chosen at run time"
        },
        Kernel::detect()
    );
    println!("CPU features: {}", engram::cpu::projection::cpu_features());
    println!("CPU: {}; AVX-512/AMX flags: {}", cpu_model(), simd_flags());
    if python().is_none() {
        println!("(bench/.venv missing: run `bash bench/setup.sh` for the numpy and PyTorch peers; skipping them)");
    }
    let only = std::env::var("ENGRAM_BENCH_ONLY").unwrap_or_default();
    if only.is_empty() || only == "hash" {
        bench_hash();
    }
    if only == "projection" {
        bench_projection(threads);
    }
    if only.is_empty() || only == "apply" || only == "formats" {
        bench_apply(threads, only != "formats");
    }
    if only.is_empty() || only == "ggml" {
        bench_ggml(threads);
    }
}

/// The ggml peer: llama.cpp's DeepSeek-V4.1 engram op chain on ggml's CPU
/// backend against `engram_apply`, same weights, row ids and threads, in one
/// C++ process (bench/ggml/ggml_peer.cpp) per ggml build: ggml built for this
/// CPU (`GGML_NATIVE=ON`, as a user's build is; its AMX-INT8 path where the
/// CPU has AMX), the main peer, and the portable AVX2 build. Each driver is
/// built (cached) by bench/ggml/build.sh against the libengram this bench was
/// built with (the `libengram.so` beside this binary).
/// `ENGRAM_BENCH_GGML=native,avx2` picks the builds, `ENGRAM_BENCH_NS`,
/// `ENGRAM_BENCH_FORMATS` (bf16,fp8,q8_0,q4_K,q2_K) and
/// `ENGRAM_BENCH_TABLES` (q8_0,fp8) narrow the cells; `ENGRAM_BENCH_REPS`
/// sets the repetitions.
fn bench_ggml(threads: usize) {
    let want = std::env::var("ENGRAM_BENCH_GGML").unwrap_or("native,avx2".into());
    let mut runs: Vec<GgmlRun> = Vec::new();
    for (name, native) in [("native", "1"), ("avx2", "0")] {
        if !want.split(',').any(|w| w == name) {
            continue;
        }
        let Some(driver) = build_ggml_peer(native) else {
            println!("\n(ggml peer, {name} build: could not be built, see above; skipping it)");
            continue;
        };
        let version = std::fs::read_to_string(driver.with_file_name("GGML_VERSION"))
            .unwrap_or_default()
            .trim()
            .to_string();
        println!("\n## ggml peer, {name} build: {version}");
        let cells = run_ggml_peer(&driver, threads);
        runs.push(GgmlRun { name, cells });
    }
    print_ggml_table(threads, &runs);
}

/// One cell of a ggml driver's run (its `result` line).
struct GgmlCell {
    key: String,
    ggml_ms: f64,
    engram_ms: f64,
    reps: u32,
    weights: String,
}

struct GgmlRun {
    name: &'static str,
    cells: Vec<GgmlCell>,
}

/// Builds (or finds up to date) the driver for one ggml build: its path.
fn build_ggml_peer(native: &str) -> Option<PathBuf> {
    // This binary is target/<profile>/deps/cpu-*; the libengram.so cargo
    // built it with sits beside it, and the target directory two levels up.
    // A binary run from elsewhere names them: ENGRAM_LIB_DIR, CARGO_TARGET_DIR.
    let exe = std::env::current_exe().ok()?;
    let lib_dir = std::env::var_os("ENGRAM_LIB_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| exe.parent().unwrap_or(Path::new(".")).to_path_buf());
    if !lib_dir.join("libengram.so").exists() {
        println!(
            "(no libengram.so in {}: set ENGRAM_LIB_DIR for the ggml peer)",
            lib_dir.display()
        );
        return None;
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .or_else(|| Some(lib_dir.parent()?.parent()?.to_path_buf()))
        .unwrap_or_else(|| root().join("target"));
    let out = std::process::Command::new("bash")
        .arg(root().join("bench/ggml/build.sh"))
        .env("ENGRAM_GGML_NATIVE", native)
        .env("ENGRAM_LIB_DIR", &lib_dir)
        .env("CARGO_TARGET_DIR", target)
        .stderr(std::process::Stdio::inherit())
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()?
        .to_string();
    (out.status.success() && Path::new(&path).exists()).then(|| PathBuf::from(path))
}

/// Runs one driver, its lines shown as they come, and returns its cells.
fn run_ggml_peer(driver: &Path, threads: usize) -> Vec<GgmlCell> {
    use std::io::BufRead;
    let mut cmd = std::process::Command::new(driver);
    cmd.arg(threads.to_string());
    if let Ok(r) = std::env::var("ENGRAM_BENCH_REPS") {
        cmd.arg(r);
    }
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("ggml peer {}: {e}", driver.display()));
    let mut cells = Vec::new();
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        match line.strip_prefix("result ") {
            Some(r) => cells.push(parse_ggml_result(r)),
            None => println!("{line}"),
        }
    }
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "ggml peer failed ({status}): its results disagree with libengram's or it could not run"
    );
    cells
}

/// `wkv=.. table=.. n=.. ggml_ms=.. engram_ms=.. reps=.. agree=.. weights=..`.
fn parse_ggml_result(r: &str) -> GgmlCell {
    let field = |k: &str| {
        r.split(' ')
            .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("ggml peer result without {k}: {r}"))
    };
    let num = |k: &str| field(k).parse::<f64>().unwrap();
    GgmlCell {
        key: format!("{} | {} | {}", field("wkv"), field("table"), field("n")),
        ggml_ms: num("ggml_ms"),
        engram_ms: num("engram_ms"),
        reps: num("reps") as u32,
        weights: field("weights").to_string(),
    }
}

/// The CPU's AVX-512 and AMX flags as /proc/cpuinfo (lscpu) names them.
fn simd_flags() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let flags: Vec<&str> = info
        .lines()
        .find(|l| l.starts_with("flags"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("")
        .split_whitespace()
        .filter(|f| f.starts_with("avx512") || f.starts_with("amx") || *f == "avx_vnni")
        .collect();
    let amx = if flags.iter().any(|f| f.starts_with("amx")) {
        ""
    } else {
        " (no AMX)"
    };
    format!("{}{amx}", flags.join(" "))
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|m| {
            let l = m.lines().find(|l| l.starts_with("model name"))?;
            Some(l.split(':').nth(1)?.trim().to_string())
        })
        .unwrap_or("unknown".into())
}

/// Both builds side by side: each ratio is ggml's time over libengram's
/// measured in the same driver run (alternating), so each build's column
/// has its own libengram time.
fn print_ggml_table(threads: usize, runs: &[GgmlRun]) {
    let Some(first) = runs.first() else { return };
    println!(
        "\n## libengram against ggml, {} (ggml time / libengram time, each pair alternated in one process; > 1: libengram faster), {threads} threads",
        runs.iter()
            .map(|r| format!("ggml {}", r.name))
            .collect::<Vec<_>>()
            .join(" and ")
    );
    println!("CPU: {}; {}", cpu_model(), simd_flags());
    let mut head = "| wkv | table rows | tokens |".to_string();
    let mut rule = "|---|---|---:|".to_string();
    for r in runs {
        let n = r.name;
        head += &format!(" libengram ms | ggml {n} ms | ggml {n} weights | ggml {n} / libengram |");
        rule += "---:|---:|---|---:|";
    }
    println!("{head}\n{rule}");
    for c in &first.cells {
        let mut line = format!("| {} |", c.key);
        for r in runs {
            match r.cells.iter().find(|o| o.key == c.key) {
                Some(o) => {
                    line += &format!(
                        " {:.2} | {:.2} | {} | {:.2} |",
                        o.engram_ms,
                        o.ggml_ms,
                        o.weights,
                        o.ggml_ms / o.engram_ms
                    )
                }
                None => line += " - | - | - | - |",
            }
        }
        println!("{line}");
    }
    let reps: Vec<String> = runs
        .iter()
        .flat_map(|r| r.cells.iter().map(|c| c.reps.to_string()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    println!(
        "(medians of {} repetitions a cell; every cell agreed within the driver's bounds)",
        reps.join("/")
    );
}

fn bench_hash() {
    let g = load(&root().join("tests/golden/data/v41_hash.json"));
    let map_path = root().join("tests/golden/data/v41_token_map.i32");
    let map: Vec<i32> = std::fs::read(&map_path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let layer_ids: Vec<u32> = [1, 14].into();
    let (mult, primes, offsets) = (
        u64s(&g["multipliers"]),
        u64s(&g["primes"]),
        u64s(&g["offsets"]),
    );
    let pad_id = map[2] as i64;
    let (prefill_n, seqs, steps) = (4096usize, 64usize, 256usize);
    let cfg = ContextConfig {
        geometry: Geometry {
            d: 5120,
            hc: 4,
            hd: 256,
            eps: 1e-6,
        },
        tables: HashTablesIn {
            layer_ids: &layer_ids,
            max_ngram: 4,
            n_heads: 8,
            token_map: &map,
            pad_id,
            multipliers: &mult,
            primes: &primes,
            offsets: &offsets,
        },
        limits: Limits {
            max_tokens: prefill_n,
            max_seqs: seqs,
            max_positions: prefill_n + steps + 8,
        },
        n_threads: 1,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        tuning: Default::default(),
    };
    let ctx = Context::new(&cfg).unwrap();
    let per = ctx.ids_per_token();
    let mut rng = Rng(42);
    let vocab = map.len() as u64;
    let prefill: Vec<i32> = (0..prefill_n).map(|_| rng.below(vocab) as i32).collect();
    let pos: Vec<i32> = (0..prefill_n as i32).collect();
    let zeros = vec![0i32; prefill_n];
    let mut out = vec![0i64; prefill_n * per];
    ctx.hash(&prefill, &zeros, &pos, &mut out).unwrap();
    let prefill_sum: i64 = out.iter().sum();
    let decode_only = std::env::var("ENGRAM_BENCH_HASH").as_deref() == Ok("decode");
    let t_prefill = median(if decode_only { 1 } else { 20 }, 0.5, || {
        ctx.hash(&prefill, &zeros, &pos, &mut out).unwrap()
    });
    let c_prefill = cpu_stats(if decode_only { 1 } else { 20 }, 0.5, || {
        ctx.hash(&prefill, &zeros, &pos, &mut out).unwrap()
    })
    .med;

    // Decode: 64 sequences, each first given its 3-token look-back, then one
    // token per sequence per step.
    let stream: Vec<Vec<i32>> = (0..steps + 3)
        .map(|_| (0..seqs).map(|_| rng.below(vocab) as i32).collect())
        .collect();
    let seq_ids: Vec<i32> = (0..seqs as i32).collect();
    let mut dout = vec![0i64; seqs * per];
    let run_decode = |sum: &mut i64, dout: &mut [i64]| {
        for (s, toks) in stream.iter().enumerate() {
            ctx.hash(toks, &seq_ids, &vec![s as i32; seqs], dout)
                .unwrap();
            if s >= 3 {
                *sum += dout.iter().sum::<i64>();
            }
        }
    };
    let mut decode_sum = 0i64;
    run_decode(&mut decode_sum, &mut dout);
    let t_decode = median(if decode_only { 200 } else { 5 }, 0.5, || {
        let mut s = 0;
        run_decode(&mut s, &mut dout);
    }) / (steps + 3) as f64;
    let c_decode = cpu_stats(if decode_only { 200 } else { 5 }, 0.5, || {
        let mut s = 0;
        run_decode(&mut s, &mut dout);
    })
    .med / (steps + 3) as f64;

    println!("\n## hash (DeepSeek-V4.1 tables, 2 layers x 24 ids per token, one thread)");
    println!(
        "prefill {prefill_n} tokens: {:.3} ms ({:.1} M tokens/s)",
        t_prefill * 1e3,
        prefill_n as f64 / t_prefill / 1e6
    );
    println!(
        "decode step of {seqs} sequences: {:.2} us ({:.1} M tokens/s)",
        t_decode * 1e6,
        seqs as f64 / t_decode / 1e6
    );
    let spec = json!({
        "token_map": map_path, "n_layers": 2, "max_ngram": 4, "heads": 8,
        "multipliers": mult.iter().map(|&m| m as i64).collect::<Vec<_>>(), "primes": primes, "offsets": offsets,
        "pad_id": pad_id, "prefill": prefill, "decode": stream,
    });
    if let Some(p) = run_peer("hash", &spec) {
        let (np_prefill, np_decode) = (
            p["prefill_s"].as_f64().unwrap(),
            p["decode_step_s"].as_f64().unwrap(),
        );
        assert_eq!(
            p["prefill_sum"].as_i64().unwrap(),
            prefill_sum,
            "numpy and engram disagree on the prefill ids"
        );
        assert_eq!(
            p["decode_sum"].as_i64().unwrap(),
            decode_sum,
            "numpy and engram disagree on the decode ids"
        );
        println!(
            "numpy approach: prefill {:.3} ms, decode step {:.1} us; ids identical (checksums)",
            np_prefill * 1e3,
            np_decode * 1e6
        );
        println!(
            "ratio (numpy time / engram time): prefill {:.1}x (target >= 10x), decode {:.1}x (target >= 100x)",
            np_prefill / t_prefill,
            np_decode / t_decode
        );
        let (cp, cd) = (
            p["prefill_cpu_s"].as_f64().unwrap(),
            p["decode_step_cpu_s"].as_f64().unwrap(),
        );
        println!(
            "in CPU time (what the shared machine's load does not inflate): engram prefill {:.3} ms ({:.0} ns, about {:.0} cycles at the nominal {:.2} GHz, a token), decode step {:.2} us; numpy prefill {:.3} ms, decode step {:.1} us; ratio prefill {:.1}x, decode {:.1}x",
            c_prefill * 1e3,
            c_prefill / prefill_n as f64 * 1e9,
            c_prefill / prefill_n as f64 * nominal_ghz() * 1e9,
            nominal_ghz(),
            c_decode * 1e6,
            cp * 1e3,
            cd * 1e6,
            cp / c_prefill,
            cd / c_decode
        );
    }
}

/// A V4.1-shaped model with `nl` engram layers sharing one fp8 table and one
/// `q`/`k` (the gather reads 48 rows a token whatever the table's size, so the
/// table is far smaller than the real 384M rows; the hash tables fit it).
struct Model {
    layer_ids: Vec<u32>,
    primes: Vec<u64>,
    offsets: Vec<u64>,
    mult: Vec<u64>,
    token_map: Vec<i32>,
    rows: u64,
    table: Vec<u8>,
    q: Vec<f32>,
    k: Vec<f32>,
}

const D: usize = 5120;
const HC: usize = 4;
const HD: usize = 256;
const HEADS: usize = 8;
const NGRAM: usize = 4;
const COLS: usize = (NGRAM - 1) * HEADS;
const K_IN: usize = COLS * HD;
const K_OUT: usize = D * (HC + 1);

impl Model {
    fn new(nl: usize, rng: &mut Rng) -> Model {
        let primes = derive_primes_uniform(nl, NGRAM, HEADS, 4_000).unwrap();
        let offsets = engram::hash::derive_offsets(&primes, COLS);
        let rows = primes
            .chunks(COLS)
            .map(|c| c.iter().sum::<u64>())
            .max()
            .unwrap();
        let rb = HD + HD / 32;
        let table = (0..rows as usize * rb)
            .map(|i| {
                if i % rb >= HD {
                    120 + rng.below(10) as u8
                } else {
                    let c = rng.next() as u8;
                    if c & 0x7F == 0x7F {
                        0
                    } else {
                        c
                    }
                }
            })
            .collect();
        Model {
            layer_ids: (0..nl as u32).map(|l| 1 + 13 * l).collect(),
            mult: (0..(nl * NGRAM) as u64).map(|i| 2 * i + 1).collect(),
            token_map: (0..1000).collect(),
            q: (0..HC * D).map(|_| 1.0 + rng.f32() / 8.0).collect(),
            k: (0..HC * D).map(|_| 1.0 + rng.f32() / 8.0).collect(),
            primes,
            offsets,
            rows,
            table,
        }
    }

    fn context<'a>(&'a self, threads: usize, wkv: &[Weights<'a>]) -> Context<'a> {
        let cfg = ContextConfig {
            geometry: Geometry {
                d: D,
                hc: HC,
                hd: HD,
                eps: 1e-6,
            },
            tables: HashTablesIn {
                layer_ids: &self.layer_ids,
                max_ngram: NGRAM,
                n_heads: HEADS,
                token_map: &self.token_map,
                pad_id: 0,
                multipliers: &self.mult,
                primes: &self.primes,
                offsets: &self.offsets,
            },
            limits: Limits {
                max_tokens: 512,
                max_seqs: 1,
                max_positions: 1,
            },
            n_threads: threads,
            backend: engram::EngramBackend::Cpu as u32,
            device: 0,
            tuning: engram::Tuning {
                cpu: engram::cpu::CpuTuning {
                    kernel: kernel_env(),
                },
                ..Default::default()
            },
        };
        let ctx = Context::new(&cfg).unwrap();
        for (li, w) in wkv.iter().enumerate() {
            ctx.set_layer(LayerIn::host(
                self.layer_ids[li],
                &self.table,
                EngramType::row_format(EngramType::Fp8E4m3E8m0 as u32, HD).unwrap(),
                self.rows,
                *w,
                Weights::F32(&self.q),
                Weights::F32(&self.k),
            ))
            .unwrap();
        }
        ctx
    }

    /// Median seconds of one `apply` of `n` tokens, visiting the layers in turn
    /// (as a model does) so that wkv comes from memory, not the cache.
    fn time_apply(&self, ctx: &Context<'_>, n: usize, rng: &mut Rng) -> Stat {
        let nl = self.layer_ids.len();
        let ids: Vec<i64> = (0..n * nl * COLS)
            .map(|i| {
                let c = i % (nl * COLS);
                self.offsets[c] as i64 + rng.below(self.primes[c]) as i64
            })
            .collect();
        let mut hw: Vec<f32> = (0..n * HC * D).map(|_| rng.f32()).collect();
        let mut layer = 0usize;
        stats(if n <= 64 { 12 } else { 4 }, 1.0, || {
            layer = (layer + 1) % nl;
            ctx.apply(self.layer_ids[layer], &ids, n, Highway::F32(&mut hw))
                .unwrap();
        })
    }
}

/// Enough layers of `bytes_per_layer` that together they exceed 2.4 GB, about
/// nine times the last-level cache this machine reports (260 MB), so that
/// visiting them in turn reads `wkv` from memory.
fn layers_for(bytes_per_layer: usize) -> usize {
    (2_400_000_000usize).div_ceil(bytes_per_layer).max(2)
}

fn bench_apply(threads: usize, main: bool) {
    let mut rng = Rng(7);
    let bw = memory_bandwidth(threads);
    println!(
        "\nmemory read bandwidth ({threads} threads, best of 3 passes over 2 GiB): {:.1} GB/s",
        bw / 1e9
    );
    if main {
        bench_bf16(threads, bw, &mut rng);
    }
    bench_wkv_formats(threads, bw, &mut rng);
}

/// Random `wkv` bytes of `layers` V4.1 layers in `ty`, each block's f16
/// scales finite and small.
/// `rows` rows of `K_IN` weights of format `ty`, random with finite scales.
fn wkv_rows(ty: EngramType, rows: usize, rng: &mut Rng) -> Vec<u8> {
    if ty == EngramType::Fp8E4m3E8m0Block {
        // The checkpoint's fp8: codes (no NaN), then 128 x 128 block scales
        // 2^-16..2^-9 (as the checkpoint's).
        let n_codes = rows * K_IN;
        let n_scales = rows.div_ceil(128) * K_IN.div_ceil(128);
        return (0..n_codes + n_scales)
            .map(|i| match rng.next() as u8 {
                b if i >= n_codes => 111 + b % 8,
                b if b & 0x7F == 0x7F => b ^ 1,
                b => b,
            })
            .collect();
    }
    let fmt = EngramType::row_format(ty as u32, K_IN).unwrap();
    let mut data = vec![0u8; fmt.row_bytes(K_IN) * rows];
    let bb = fmt.block().map_or(2, |(_, bytes)| bytes);
    for (i, b) in data.iter_mut().enumerate() {
        *b = rng.next() as u8;
        let at = i % bb;
        match ty {
            EngramType::Q8_0 if at < 2 => *b = [0x00, 0x1c][at],
            EngramType::Q2_K if at >= 80 => *b = [0x00, 0x1c, 0x00, 0x18][at - 80],
            EngramType::Q4_K | EngramType::Q5_K if at < 4 => *b = [0x00, 0x1c, 0x00, 0x18][at],
            EngramType::Q4_0 if at < 2 => *b = [0x00, 0x1c][at],
            EngramType::Q3_K if at >= 108 => *b = [0x00, 0x1c][at - 108],
            EngramType::Q6_K if at >= 208 => *b = [0x00, 0x1c][at - 208],
            EngramType::Bf16 if at == 1 => *b = 0x3c + (*b & 1),
            _ => {}
        }
    }
    data
}

fn weights_of(ty: EngramType, layer: &[u8], rows: usize) -> Weights<'_> {
    match ty {
        EngramType::Bf16 => Weights::Bf16(bytemuck_u16(layer)),
        EngramType::Fp8E4m3E8m0Block => {
            let (codes, scales) = layer.split_at(rows * K_IN);
            Weights::Fp8Block(
                engram::formats::Fp8Blocks::new(codes, scales, K_IN, 128, 128).unwrap(),
            )
        }
        _ => Weights::quant(
            EngramType::row_format(ty as u32, K_IN).unwrap(),
            layer,
            K_IN,
        )
        .unwrap(),
    }
}

/// The projection alone (one V4.1 layer's wkv, bf16 and GGUF formats), for
/// kernel work: `ENGRAM_BENCH_ONLY=projection` (`ENGRAM_BENCH_NS=1,8,...`,
/// `ENGRAM_BENCH_FORMATS=bf16,fp8,q8_0,q4_0,q2_K..q6_K` (fp8: the checkpoint's block-scaled), `ENGRAM_BENCH_ROWS=N`: output rows,
/// default the layer's; a few hundred keep `wkv` in L2, which measures the
/// kernel's decoding rate without the memory's). Rates per CPU-second too:
/// the machine is shared, and CPU time leaves out the time others took.
fn bench_projection(threads: usize) {
    let mut rng = Rng(3);
    let mut p = Projection::new(threads).unwrap();
    if let Some(k) = kernel_env() {
        p.set_kernel(k);
    }
    let ns: Vec<usize> = std::env::var("ENGRAM_BENCH_NS")
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect())
        .unwrap_or(vec![1, 8, 64, 512]);
    let formats = std::env::var("ENGRAM_BENCH_FORMATS").unwrap_or("bf16".into());
    let rows: usize = std::env::var("ENGRAM_BENCH_ROWS").map_or(K_OUT, |v| v.parse().unwrap());
    for name in formats.split(',') {
        let ty = match name {
            "bf16" => EngramType::Bf16,
            "fp8" => EngramType::Fp8E4m3E8m0Block,
            "q8_0" => EngramType::Q8_0,
            "q4_K" => EngramType::Q4_K,
            "q2_K" => EngramType::Q2_K,
            "q4_0" => EngramType::Q4_0,
            "q3_K" => EngramType::Q3_K,
            "q5_K" => EngramType::Q5_K,
            "q6_K" => EngramType::Q6_K,
            _ => panic!("format {name}?"),
        };
        let data = wkv_rows(ty, rows, &mut rng);
        let w = weights_of(ty, &data, rows);
        for &n in &ns {
            let x: Vec<u16> = (0..n * K_IN).map(|_| f32_to_bf16(rng.f32())).collect();
            let mut kv = vec![0f32; n * rows];
            // Formats with integer dot products (Q8_0's forced: not a
            // default): the exact f32-twin path first, then the integer
            // one, in the same run.
            p.set_int_dot_q8_0(true);
            let int = p.int_dot(w, K_IN);
            let mut meds = Vec::new();
            for exact in if int { vec![true, false] } else { vec![false] } {
                p.set_exact_quant(exact);
                let (mut calls, c0) = (0usize, cpu_seconds());
                let t = stats(3, 1.0, || {
                    calls += 1;
                    p.run(&x, n, K_IN, w, rows, &mut kv).unwrap()
                });
                let cpu = (cpu_seconds() - c0) / calls as f64;
                let flop = 2.0 * (n * K_IN * rows) as f64;
                let path = match (int, exact) {
                    (false, _) => "",
                    (true, true) => " exact (f32 twin)",
                    (true, false) => " integer dots",
                };
                println!(
                    "projection {name}{path} {n} tokens: {} ms, {:.1} GFLOP/s, {:.2} GB/s of wkv; per CPU-second {:.1} GFLOP, {:.2} GB",
                    t.ms(),
                    flop / t.med / 1e9,
                    data.len() as f64 / t.med / 1e9,
                    flop / cpu / 1e9,
                    data.len() as f64 / cpu / 1e9
                );
                meds.push(t.med);
            }
            p.set_exact_quant(false);
            if int {
                println!(
                    "projection {name} {n} tokens: exact time / integer time {:.2}x",
                    meds[0] / meds[1]
                );
            }
        }
    }
}

fn bench_bf16(threads: usize, bw: f64, rng: &mut Rng) {
    let wkv_bytes = (K_IN * K_OUT * 2) as f64;
    let nl = layers_for(K_IN * K_OUT * 2);
    let model = Model::new(nl, rng);
    println!(
        "\n## apply at the V4.1 geometry (D {D}, hc {HC}, C {COLS}, Hd {HD}; bf16 wkv [{K_OUT} x {K_IN}], fp8 rows; {nl} layers visited in turn)"
    );
    let wkv: Vec<u16> = (0..nl * K_IN * K_OUT)
        .map(|_| f32_to_bf16(rng.f32() / 32.0))
        .collect();
    let ws: Vec<Weights<'_>> = wkv.chunks(K_IN * K_OUT).map(Weights::Bf16).collect();
    let ctx = model.context(threads, &ws);
    // A kernel's GEMM rate on a large problem (the projection alone); `None`:
    // the kernel this run uses.
    let mut gemm_rate = |kernel: Option<Kernel>| {
        let mut p = Projection::new(threads).unwrap();
        if let Some(k) = kernel {
            p.set_kernel(k);
        }
        let (n, o) = (512usize, 2048usize);
        let x: Vec<u16> = (0..n * K_IN).map(|_| f32_to_bf16(rng.f32())).collect();
        let mut kv = vec![0f32; n * o];
        let t = median(3, 0.5, || {
            p.run(&x, n, K_IN, Weights::Bf16(&wkv[..o * K_IN]), o, &mut kv)
                .unwrap()
        });
        2.0 * (n * o * K_IN) as f64 / t
    };
    let gemm_ours = gemm_rate(kernel_env());
    // Where the amx kernel runs, the avx512 kernel's rate in the same run
    // (its floor: what the machine gave before AMX).
    let uses_amx = kernel_env().unwrap_or(Kernel::detect()) == Kernel::Amx;
    if uses_amx {
        let g = gemm_rate(Some(Kernel::Avx512));
        println!(
            "GEMM rate (512 x 2048 x {K_IN}): amx {:.1} GFLOP/s, avx512 {:.1} GFLOP/s (amx/avx512 {:.2}x)",
            gemm_ours / 1e9,
            g / 1e9,
            gemm_ours / g
        );
    }
    let ns = [1usize, 8, 64, 512];
    let ours: Vec<Stat> = ns.iter().map(|&n| model.time_apply(&ctx, n, rng)).collect();
    let mem = ctx.memory_bytes();
    drop(ctx);
    drop(ws);
    drop(wkv);
    // The bandwidth again, right after our timings: on a shared machine the
    // first probe may have met other work; the roofline takes the better one.
    let bw2 = memory_bandwidth(threads);
    println!(
        "memory read bandwidth probed again after the apply timings: {:.1} GB/s (the roofline uses the larger)",
        bw2 / 1e9
    );
    let bw = bw.max(bw2);
    let spec = json!({"threads": threads, "D": D, "hc": HC, "Hd": HD, "C": COLS, "table_rows": model.rows, "ns": ns});
    let peer = run_peer("apply", &spec);
    let pf = |key: &str| peer.as_ref().and_then(|p| p[key].as_f64());
    let (gemm_bf16, gemm_f32) = (pf("gemm_bf16_flops"), pf("gemm_f32_flops"));
    let best_gemm = gemm_ours
        .max(gemm_bf16.unwrap_or(0.0))
        .max(gemm_f32.unwrap_or(0.0));
    println!(
        "GEMM rate (512 x 2048 x {K_IN}): engram bf16 {:.1} GFLOP/s; torch bf16 {}, torch f32 {} GFLOP/s (1024 x 4096 x {K_IN})",
        gemm_ours / 1e9,
        gemm_bf16.map_or("-".into(), |g| format!("{:.1}", g / 1e9)),
        gemm_f32.map_or("-".into(), |g| format!("{:.1}", g / 1e9)),
    );
    println!("| tokens | engram ms (min-max) | torch bf16 ms | torch f32 ms | torch bf16/engram | torch f32/engram | roofline ms | engram/roofline |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, &n) in ns.iter().enumerate() {
        let flops = 2.0 * (n * K_IN * K_OUT) as f64;
        let roof = (wkv_bytes / bw).max(flops / best_gemm);
        let tb = pf(&format!("bf16_{n}"));
        let tf = pf(&format!("f32_{n}"));
        let f = |t: Option<f64>| t.map_or("-".into(), |t| format!("{:.2}", t * 1e3));
        let r = |t: Option<f64>| t.map_or("-".into(), |t| format!("{:.2}x", t / ours[i].med));
        println!(
            "| {n} | {} | {} | {} | {} | {} | {:.2} | {:.2} |",
            ours[i].ms(),
            f(tb),
            f(tf),
            r(tb),
            r(tf),
            roof * 1e3,
            ours[i].med / roof
        );
    }
    // The formula of docs/memory.md: token map; per layer the layer id and rows
    // needed (12), multipliers (8 N), primes, offsets and their inverses (24 C).
    let tables =
        model.token_map.len() * 4 + model.mult.len() * 8 + model.primes.len() * 24 + nl * 12;
    let qk = nl * HC * D * 4;
    println!(
        "\ncontext memory: measured {mem} bytes; docs/memory.md formula: hash tables {tables} + q*k {qk} = {} (+ history: none hashed here)",
        tables + qk
    );
}

/// `wkv` in bf16, the checkpoint's block-scaled fp8 (codes + 128 x 128
/// e8m0 scales, read in place) and GGUF Q8_0, Q4_K and Q2_K: decode (one token) time and
/// bytes read against the memory roofline (the bandwidth probed again after
/// each format's decode timing, the larger figure kept), and 64 and 512 tokens.
fn bench_wkv_formats(threads: usize, bw: f64, rng: &mut Rng) {
    println!("\n## apply by wkv format (V4.1 geometry; decode against each format's bytes over the bandwidth)");
    println!("| wkv | bytes per token | 1 token ms (min-max) | GB/s | roofline ms | engram/roofline | 64 tokens ms | 512 tokens ms |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    // `ENGRAM_BENCH_WKV=bf16,fp8,...`: only those rows (default: all).
    let only_wkv = std::env::var("ENGRAM_BENCH_WKV").unwrap_or_default();
    for (name, ty) in [
        ("bf16", EngramType::Bf16),
        ("fp8 (checkpoint)", EngramType::Fp8E4m3E8m0Block),
        ("q8_0", EngramType::Q8_0),
        ("q4_K", EngramType::Q4_K),
        ("q2_K", EngramType::Q2_K),
    ] {
        let short = name.split(' ').next().unwrap();
        if !only_wkv.is_empty() && !only_wkv.split(',').any(|w| w == short) {
            continue;
        }
        let fp8 = ty == EngramType::Fp8E4m3E8m0Block;
        // The checkpoint's fp8 wkv: codes, then its 128 x 128 block scales.
        let (br, bc) = (128, 128);
        let n_codes = K_OUT * K_IN;
        let n_scales = K_OUT.div_ceil(br) * K_IN.div_ceil(bc);
        let fmt = if fp8 {
            ty
        } else {
            EngramType::row_format(ty as u32, K_IN).unwrap()
        };
        let layer_bytes = if fp8 {
            n_codes + n_scales
        } else {
            fmt.row_bytes(K_IN) * K_OUT
        };
        let nl = layers_for(layer_bytes);
        let model = Model::new(nl, rng);
        let mut data = vec![0u8; nl * layer_bytes];
        let bb = fmt.block().map_or(2, |(_, bytes)| bytes);
        for (i, b) in data.iter_mut().enumerate() {
            *b = rng.next() as u8;
            // Keep each block's f16 scales finite and small.
            let at = i % bb;
            match ty {
                EngramType::Q8_0 if at < 2 => *b = [0x00, 0x1c][at],
                EngramType::Q2_K if at >= 80 => *b = [0x00, 0x1c, 0x00, 0x18][at - 80],
                EngramType::Q4_K | EngramType::Q5_K if at < 4 => *b = [0x00, 0x1c, 0x00, 0x18][at],
                EngramType::Q4_0 if at < 2 => *b = [0x00, 0x1c][at],
                EngramType::Q3_K if at >= 108 => *b = [0x00, 0x1c][at - 108],
                EngramType::Q6_K if at >= 208 => *b = [0x00, 0x1c][at - 208],
                EngramType::Bf16 if at == 1 => *b = 0x3c + (*b & 1),
                // No NaN codes; scales 2^-16 .. 2^-9 (as the checkpoint's).
                EngramType::Fp8E4m3E8m0Block => {
                    if i % layer_bytes >= n_codes {
                        *b = 111 + *b % 8;
                    } else if *b & 0x7F == 0x7F {
                        *b ^= 1;
                    }
                }
                _ => {}
            }
        }
        let ws: Vec<Weights<'_>> = data
            .chunks(layer_bytes)
            .map(|c| match ty {
                EngramType::Bf16 => Weights::Bf16(bytemuck_u16(c)),
                EngramType::Fp8E4m3E8m0Block => Weights::Fp8Block(
                    engram::formats::Fp8Blocks::new(&c[..n_codes], &c[n_codes..], K_IN, br, bc)
                        .unwrap(),
                ),
                _ => Weights::quant(fmt, c, K_IN).unwrap(),
            })
            .collect();
        let t0 = Instant::now();
        let ctx = model.context(threads, &ws);
        if fp8 {
            // set_layer's check of every code and scale, per layer.
            let s = t0.elapsed().as_secs_f64() / nl as f64;
            println!(
                "(fp8 set_layer, its check of every code and scale included: {:.1} ms a layer, {:.1} GB/s)",
                s * 1e3,
                layer_bytes as f64 / s / 1e9
            );
        }
        let t = model.time_apply(&ctx, 1, rng);
        let bw = bw.max(memory_bandwidth(threads));
        let t64 = model.time_apply(&ctx, 64, rng);
        let t512 = model.time_apply(&ctx, 512, rng);
        let bytes = layer_bytes as f64 + (COLS * (HD + HD / 32)) as f64;
        let roof = bytes / bw;
        println!(
            "| {name} | {:.1} MB | {} | {:.1} | {:.2} | {:.2} | {} | {} |",
            bytes / 1e6,
            t.ms(),
            bytes / t.med / 1e9,
            roof * 1e3,
            t.med / roof,
            t64.ms(),
            t512.ms()
        );
    }
}

/// View little-endian bytes as u16s (the buffer is 2-aligned: it comes from a
/// `Vec<u8>` whose allocation is at least 8-aligned).
fn bytemuck_u16(b: &[u8]) -> &[u16] {
    assert!((b.as_ptr() as usize).is_multiple_of(2) && b.len().is_multiple_of(2));
    // SAFETY: aligned, in bounds, any bit pattern is a valid u16.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u16, b.len() / 2) }
}
