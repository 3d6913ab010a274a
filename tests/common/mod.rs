//! Shared by the Rust tests: the golden's deterministic filler (see
//! `tests/golden/README.md`), the tiny model rebuilt from it, the golden
//! data loaded from `tests/golden/data/` (its regimes' calls among them),
//! Q8_0 and Q4_0 blocks quantised as llama.cpp does, the GGUF options and
//! scratch directories the loader tests use.
#![allow(dead_code)]

pub mod bounds;
pub mod device;

use engram::formats::f32_to_bf16;
use engram::{
    Context, ContextConfig, EngramType, Geometry, HashTablesIn, Highway, HighwayType, LayerIn,
    Limits, RowIds, Weights,
};
use serde_json::Value;
use std::path::PathBuf;

// ---- the filler ----

pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

pub fn mix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

pub fn bits(name: &str, i: u64) -> u64 {
    let salted = format!("engram-golden-v1:{name}");
    mix64(fnv1a64(salted.as_bytes()) ^ mix64(i))
}

/// A name's salt, computed once for a run of indices.
pub struct Filler(u64);

impl Filler {
    pub fn new(name: &str) -> Filler {
        Filler(fnv1a64(format!("engram-golden-v1:{name}").as_bytes()))
    }
    pub fn bits(&self, i: u64) -> u64 {
        mix64(self.0 ^ mix64(i))
    }
    pub fn unit(&self, i: u64) -> f32 {
        ((self.bits(i) >> 40) as i64 - (1 << 23)) as f32 / (1u32 << 23) as f32
    }
    pub fn value(&self, i: u64, scale: f32, offset: f32) -> f32 {
        offset + scale * self.unit(i)
    }
}

pub fn values(name: &str, n: usize, scale: f32, offset: f32) -> Vec<f32> {
    let f = Filler::new(name);
    (0..n as u64).map(|i| f.value(i, scale, offset)).collect()
}

// ---- the golden files ----

/// The source tree: `ENGRAM_SOURCE_ROOT` when set (a test binary carried to
/// another machine, `scripts/gpu-check.sh`), else where it was compiled.
pub fn source_root() -> PathBuf {
    std::env::var_os("ENGRAM_SOURCE_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

pub fn golden_dir() -> PathBuf {
    source_root().join("tests/golden/data")
}

pub fn load_json(name: &str) -> Value {
    let p = golden_dir().join(name);
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

pub fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| {
            x.as_i64()
                .or_else(|| x.as_u64().map(|u| u as i64))
                .expect("integer")
        })
        .collect()
}

pub fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| {
            x.as_u64()
                .or_else(|| x.as_i64().map(|i| i as u64))
                .expect("integer")
        })
        .collect()
}

pub fn i32s(v: &Value) -> Vec<i32> {
    ints(v).into_iter().map(|x| x as i32).collect()
}

pub fn u16s(v: &Value) -> Vec<u16> {
    ints(v).into_iter().map(|x| x as u16).collect()
}

pub fn f32_bits(v: &Value) -> Vec<f32> {
    ints(v)
        .into_iter()
        .map(|x| f32::from_bits(x as u32))
        .collect()
}

/// Put one rank's `kv` columns `[o0, o1)` (`part`: `[n, o1 - o0]`) into the
/// joined `kv` (`[n, k_out]`), as an engine's all-gather joins them.
pub fn join_columns<T: Copy>(kv: &mut [T], k_out: usize, (o0, o1): (usize, usize), part: &[T]) {
    if o1 == o0 {
        return;
    }
    for (row, p) in kv.chunks_exact_mut(k_out).zip(part.chunks_exact(o1 - o0)) {
        row[o0..o1].copy_from_slice(p);
    }
}

// ---- the tiny model ----

/// A layer's weights, owned; borrowed by the context.
pub struct LayerData {
    pub layer_id: u32,
    pub table: Vec<u8>,
    pub format: EngramType,
    pub rows: u64,
    pub wkv: Dense,
    pub q: Dense,
    pub k: Dense,
}

pub enum Dense {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Dense {
    pub fn new(vals: Vec<f32>, dtype: &str) -> Dense {
        match dtype {
            "f32" => Dense::F32(vals),
            "bf16" => Dense::Bf16(vals.iter().map(|&v| f32_to_bf16(v)).collect()),
            d => panic!("dtype {d}"),
        }
    }
    pub fn weights(&self) -> Weights<'_> {
        match self {
            Dense::F32(v) => Weights::F32(v),
            Dense::Bf16(v) => Weights::Bf16(v),
        }
    }
    pub fn f32(&self) -> Vec<f32> {
        match self {
            Dense::F32(v) => v.clone(),
            Dense::Bf16(v) => v.iter().map(|&b| engram::formats::bf16_to_f32(b)).collect(),
        }
    }
}

/// A dense weight's bytes, little-endian (as a device copy holds them).
pub fn dense_bytes(d: &Dense) -> Vec<u8> {
    match d {
        Dense::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dense::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// A dense weight's `ENGRAM_TYPE_*`.
pub fn dense_type(d: &Dense) -> u32 {
    match d {
        Dense::F32(_) => EngramType::F32 as u32,
        Dense::Bf16(_) => EngramType::Bf16 as u32,
    }
}

/// Build a table of `rows` rows of `hd` values in `fmt` from the filler,
/// following the golden README's rule. `full_fp8_range` selects the `formats`
/// section's rule (all codes but NaN, wide scales) instead of the model's.
pub fn table_bytes(name: &str, fmt: &str, rows: usize, hd: usize, full_fp8_range: bool) -> Vec<u8> {
    let n = rows * hd;
    match fmt {
        "fp8" => {
            let f = Filler::new(name);
            let fs = Filler::new(&format!("{name}.scale"));
            let nb = hd / 32;
            let mut out = Vec::with_capacity(rows * (hd + nb));
            for r in 0..rows {
                for d in 0..hd {
                    let b = f.bits((r * hd + d) as u64);
                    let code = if full_fp8_range {
                        let c = (b & 0xFF) as u8;
                        if c & 0x7F == 0x7F {
                            c ^ 1
                        } else {
                            c
                        }
                    } else {
                        (b & 0xBF) as u8
                    };
                    out.push(code);
                }
                for blk in 0..nb {
                    let b = fs.bits((r * nb + blk) as u64);
                    out.push(if full_fp8_range {
                        117 + (b % 21) as u8
                    } else {
                        125 + (b % 5) as u8
                    });
                }
            }
            out
        }
        "bf16" => values(name, n, 1.0, 0.0)
            .iter()
            .flat_map(|&v| f32_to_bf16(v).to_le_bytes())
            .collect(),
        "f32" => values(name, n, 1.0, 0.0)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        f => panic!("format {f}"),
    }
}

pub fn engram_type(fmt: &str) -> EngramType {
    match fmt {
        "fp8" => EngramType::Fp8E4m3E8m0,
        "bf16" => EngramType::Bf16,
        "f32" => EngramType::F32,
        "f16" => EngramType::F16,
        f => panic!("format {f}"),
    }
}

pub struct Tiny {
    pub golden: Value,
    pub d: usize,
    pub hc: usize,
    pub hd: usize,
    pub heads: usize,
    pub ngram: usize,
    pub eps: f32,
    pub layer_ids: Vec<u32>,
    pub token_map: Vec<i32>,
    pub pad_id: i64,
    pub multipliers: Vec<u64>,
    pub primes: Vec<u64>,
    pub offsets: Vec<u64>,
    pub layers: Vec<LayerData>,
}

impl Tiny {
    pub fn load() -> Tiny {
        let golden = load_json("tiny.json");
        let m = &golden["model"];
        let u = |k: &str| m[k].as_u64().unwrap_or_else(|| panic!("model.{k}")) as usize;
        let (d, hc, hd, heads, ngram) = (u("D"), u("hc"), u("Hd"), u("H"), u("N"));
        let cols = (ngram - 1) * heads;
        let layer_ids: Vec<u32> = ints(&m["layer_ids"]).iter().map(|&l| l as u32).collect();
        let rows = ints(&m["rows"]);
        let layers = layer_ids
            .iter()
            .enumerate()
            .map(|(li, &lid)| {
                let fmt = m["table_format"][li].as_str().unwrap();
                let wdt = m["wkv_dtype"][li].as_str().unwrap();
                let qdt = m["qk_dtype"][li].as_str().unwrap();
                let p = format!("layers.{lid}.engram");
                LayerData {
                    layer_id: lid,
                    table: table_bytes(&format!("{p}.table"), fmt, rows[li] as usize, hd, false),
                    format: engram_type(fmt),
                    rows: rows[li] as u64,
                    wkv: Dense::new(
                        values(&format!("{p}.wkv"), d * (hc + 1) * cols * hd, 0.0625, 0.0),
                        wdt,
                    ),
                    q: Dense::new(values(&format!("{p}.q"), hc * d, 0.125, 1.0), qdt),
                    k: Dense::new(values(&format!("{p}.k"), hc * d, 0.125, 1.0), qdt),
                }
            })
            .collect();
        Tiny {
            d,
            hc,
            hd,
            heads,
            ngram,
            eps: f32::from_bits(m["eps_f32"].as_u64().unwrap() as u32),
            layer_ids,
            token_map: i32s(&m["token_map"]),
            pad_id: m["pad_id"].as_i64().unwrap(),
            multipliers: u64s(&m["multipliers"]),
            primes: u64s(&m["primes"]),
            offsets: u64s(&m["offsets"]),
            layers,
            golden,
        }
    }

    pub fn cols(&self) -> usize {
        (self.ngram - 1) * self.heads
    }

    pub fn config(&self, limits: Limits) -> ContextConfig<'_> {
        ContextConfig {
            geometry: Geometry {
                d: self.d,
                hc: self.hc,
                hd: self.hd,
                eps: self.eps,
            },
            tables: HashTablesIn {
                layer_ids: &self.layer_ids,
                max_ngram: self.ngram,
                n_heads: self.heads,
                token_map: &self.token_map,
                pad_id: self.pad_id,
                multipliers: &self.multipliers,
                primes: &self.primes,
                offsets: &self.offsets,
            },
            limits,
            n_threads: 2,
            backend: engram::EngramBackend::Cpu as u32,
            device: 0,
            tuning: Default::default(),
        }
    }

    /// Layer 0 with `wkv` in place of its own, through a CPU context
    /// (`with_exact_quant(exact)`): the rows and `kv` (bf16 bits) of a fixed
    /// 16-token step (`DeviceCalls::stages`).
    pub fn stages_with_wkv(&self, wkv: Weights<'_>, exact: bool) -> (Vec<u16>, Vec<u16>) {
        let layer = &self.layers[0];
        let ctx = Context::new(&self.config(Tiny::limits()))
            .unwrap()
            .with_exact_quant(exact);
        ctx.set_layer(LayerIn::host(
            layer.layer_id,
            &layer.table,
            EngramType::row_format(layer.format as u32, self.hd).unwrap(),
            layer.rows,
            wkv,
            layer.q.weights(),
            layer.k.weights(),
        ))
        .unwrap();
        let tokens: Vec<i32> = (0..16).map(|i| i * 7 % 48).collect();
        let pos: Vec<i32> = (0..16).collect();
        let mut ids = vec![0i64; 16 * ctx.ids_per_token()];
        ctx.hash(&tokens, &[0; 16], &pos, &mut ids).unwrap();
        ctx.stages(layer.layer_id, &ids, 16).unwrap()
    }

    pub fn limits() -> Limits {
        Limits {
            max_tokens: 64,
            max_seqs: 4,
            max_positions: 256,
        }
    }

    /// A context with both layers' weights set.
    pub fn context(&self) -> Context<'_> {
        self.context_with(engram::cpu::projection::Kernel::detect())
    }

    /// The same, with the projection kernel chosen.
    pub fn context_with(&self, kernel: engram::cpu::projection::Kernel) -> Context<'_> {
        let mut cfg = self.config(Self::limits());
        cfg.tuning.cpu.kernel = Some(kernel);
        let ctx = Context::new(&cfg).expect("create");
        for l in &self.layers {
            ctx.set_layer(LayerIn::host(
                l.layer_id,
                &l.table,
                EngramType::row_format(l.format as u32, self.hd).unwrap(),
                l.rows,
                l.wkv.weights(),
                l.q.weights(),
                l.k.weights(),
            ))
            .expect("set_layer");
        }
        ctx
    }
}

// ---- GGUF blocks quantised as llama.cpp's reference quantisers do ----

/// Quantise `vals` (rows of whole 32-blocks) to Q8_0 the way llama.cpp's
/// reference quantiser does: `d = max|x| / 127` as f16, `q = round(x / d)`.
pub fn q8_0(vals: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in vals.chunks(32) {
        let amax = b.iter().fold(0f32, |m, &x| m.max(x.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        out.extend(b.iter().map(|&x| (x * id).round() as i8 as u8));
    }
    out
}

/// Q4_0: `d = max / -8` (the signed value of largest magnitude), nibbles `q + 8`.
pub fn q4_0(vals: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in vals.chunks(32) {
        let max = b
            .iter()
            .fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        for j in 0..16 {
            let lo = ((b[j] * id + 8.5) as i32).clamp(0, 15) as u8;
            let hi = ((b[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
            out.push(lo | (hi << 4));
        }
    }
    out
}

// ---- the golden's calls, and GGUF options ----

/// One call of a golden regime (`tiny.json`, `regimes.<name>.calls`).
pub struct GoldenCall {
    pub tokens: Vec<i32>,
    pub seq_ids: Vec<i32>,
    pub pos: Vec<i32>,
    /// The golden row ids, `[n, n_layers, C]`.
    pub ids: Vec<i64>,
    pub dead: Vec<bool>,
    /// The name of the highway the call starts from.
    pub highway: String,
    pub layers: Vec<Value>,
}

/// The golden's regimes.
pub const REGIMES: [&str; 6] = [
    "prefill",
    "decode",
    "chunked",
    "interleaved",
    "rollback",
    "dead",
];

/// Every call of `regime`, in order.
pub fn golden_calls(tiny: &Tiny, regime: &str) -> Vec<GoldenCall> {
    tiny.golden["regimes"][regime]["calls"]
        .as_array()
        .unwrap_or_else(|| panic!("regime {regime}"))
        .iter()
        .map(|c| GoldenCall {
            tokens: i32s(&c["tokens"]),
            seq_ids: i32s(&c["seq_ids"]),
            pos: i32s(&c["pos"]),
            ids: ints(&c["ids"]),
            dead: c["dead"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_bool().unwrap())
                .collect(),
            highway: c["highway_name"].as_str().unwrap().to_string(),
            layers: c["layers"].as_array().unwrap().clone(),
        })
        .collect()
}

/// A fresh, empty directory `<temp>/{prefix}-{pid}-{tag}` (whatever an
/// earlier run left there removed).
pub fn scratch_dir(prefix: &str, tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("{prefix}-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Options for a GGUF model's context: the CPU backend, two threads, the
/// tiny model's limits, and `eps`.
pub fn cpu_gguf_options(eps: f32) -> engram::gguf::GgufOptions {
    engram::gguf::GgufOptions {
        limits: Tiny::limits(),
        n_threads: 2,
        backend: engram::EngramBackend::Cpu as u32,
        device: 0,
        eps,
        tuning: Default::default(),
        row_cache_bytes: 0,
    }
}

// ---- calls on device memory (the CUDA tests), and the live tokens' stages ----

/// One layer's weights as device pointers.
#[derive(Clone, Copy, Debug)]
pub struct DeviceLayerIn {
    pub layer_id: u32,
    pub table: u64,
    pub table_rows: u64,
    pub table_type: u32,
    pub wkv: u64,
    pub wkv_type: u32,
    pub q: u64,
    pub k: u64,
    pub qk_type: u32,
}

/// The context's calls with device pointers, as the CUDA tests make them.
pub trait DeviceCalls {
    fn set_layer_device(&self, w: &DeviceLayerIn) -> engram::Result<()>;
    fn apply_device(
        &self,
        layer_id: u32,
        ids: RowIds<'_>,
        n: usize,
        highway: u64,
        highway_type: u32,
        stream: *mut std::ffi::c_void,
    ) -> engram::Result<()>;
    fn check_device(&self, stream: *mut std::ffi::c_void) -> engram::Result<()>;
    /// Rows `[n, C*Hd]` and kv `[n, D*(hc+1)]` of all `n` tokens.
    fn stages_device(
        &self,
        layer_id: u32,
        ids: RowIds<'_>,
        n: usize,
    ) -> engram::Result<(Vec<u16>, Vec<u16>)>;
    /// Rows and kv of the live tokens only (host ids), in token order.
    fn stages(&self, layer_id: u32, ids: &[i64], n: usize) -> engram::Result<(Vec<u16>, Vec<u16>)>;
}

impl DeviceCalls for Context<'_> {
    fn set_layer_device(&self, w: &DeviceLayerIn) -> engram::Result<()> {
        // SAFETY: the tests pass device pointers of the sizes the geometry
        // implies, alive while the context uses them.
        self.set_layer(unsafe {
            LayerIn::raw(
                w.layer_id,
                w.table,
                w.table_type,
                w.table_rows,
                w.wkv,
                w.wkv_type,
                w.q,
                w.k,
                w.qk_type,
            )
        })
    }

    fn apply_device(
        &self,
        layer_id: u32,
        ids: RowIds<'_>,
        n: usize,
        highway: u64,
        highway_type: u32,
        stream: *mut std::ffi::c_void,
    ) -> engram::Result<()> {
        let ty = HighwayType::new(highway_type)?;
        // SAFETY: as `set_layer_device`, for the highway of `n` tokens.
        let hw = unsafe { Highway::raw(highway, ty) };
        self.apply_on(layer_id, ids, n, hw, stream)
    }

    fn check_device(&self, stream: *mut std::ffi::c_void) -> engram::Result<()> {
        self.check(stream)
    }

    fn stages_device(
        &self,
        layer_id: u32,
        ids: RowIds<'_>,
        n: usize,
    ) -> engram::Result<(Vec<u16>, Vec<u16>)> {
        let r = self.read_back(layer_id, ids, n)?;
        Ok((r.rows, r.kv))
    }

    fn stages(&self, layer_id: u32, ids: &[i64], n: usize) -> engram::Result<(Vec<u16>, Vec<u16>)> {
        let r = self.read_back(layer_id, RowIds::Host(ids), n)?;
        let (per, cols) = (self.ids_per_token(), self.shape().cols);
        let li = self
            .tables()
            .layer_ids
            .iter()
            .position(|&l| l == layer_id)
            .unwrap();
        let (k_in, k_out) = (self.kv_in(), self.kv_out());
        let (mut rows, mut kv) = (Vec::new(), Vec::new());
        for t in 0..n {
            let tid = &ids[t * per + li * cols..t * per + (li + 1) * cols];
            if tid.iter().all(|&x| x == engram::ROW_ID_DEAD) {
                // A dead token's read-back values are zero.
                assert!(r.rows[t * k_in..(t + 1) * k_in].iter().all(|&v| v == 0));
                assert!(r.kv[t * k_out..(t + 1) * k_out].iter().all(|&v| v == 0));
                continue;
            }
            rows.extend_from_slice(&r.rows[t * k_in..(t + 1) * k_in]);
            kv.extend_from_slice(&r.kv[t * k_out..(t + 1) * k_out]);
        }
        Ok((rows, kv))
    }
}
