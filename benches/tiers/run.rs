//! The measurements and the report.

use super::*;
use ids::{distinct, PageLru};

/// Where `apply` gets the table's rows.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// The measured rows in an anonymous mapping (resident, bit-identical to the file's).
    Resident,
    /// `TableSource::File`: `pread` through the page cache, no row cache.
    Pread,
    /// `TableSource::Memory` over a shared mapping of the file.
    Mmap,
    /// `TableSource::File` with a row cache of this many bytes.
    Cache(u64),
}

impl Path {
    fn name(self) -> String {
        match self {
            Path::Resident => "resident".into(),
            Path::Pread => "pread (File, no cache)".into(),
            Path::Mmap => "mmap (Memory over the file)".into(),
            Path::Cache(b) => format!("row cache {} MiB", b >> 20),
        }
    }
}

/// Give `ctx`'s layer (the one set) a row cache of `bytes`, before the
/// layer is set: the context splits `row_cache_bytes` evenly over its
/// engram layers (two, of which this bench sets one), so it is given twice.
fn enable_cache(ctx: &Context, bytes: u64) -> bool {
    ctx.set_row_cache(bytes * ctx.tables().layer_ids.len() as u64)
        .unwrap();
    true
}

/// The row cache's figures since its last reset, per `tokens` tokens.
fn cache_line(ctx: &Context, p: Path, what: &str, tokens: usize) -> String {
    let s = ctx.cache_stats(0, engram::rowcache::Tier::Host).unwrap();
    format!(
        "{} ({what}): {:.1}% of {} lookups hit, {} reads, {:.0} bytes read a token (the cache's count), read latency p50 {} us p99 {} us, policy {}, {} rows held, {:.1} MB allocated",
        p.name(),
        s.hits as f64 * 100.0 / s.lookups.max(1) as f64,
        s.lookups,
        s.reads,
        s.bytes_read as f64 / tokens as f64,
        s.read_p50_us,
        s.read_p99_us,
        s.policy.map_or("none", |k| k.name()),
        s.rows_held,
        s.memory_bytes as f64 / 1e6
    )
}

struct Bench {
    o: Opts,
    t: EngramTables,
    file: Arc<File>,
    map: memmap2::Mmap,
    rows: u64,
    /// Per lane, every token's ids `[tokens, per]` (both layers).
    lanes: Vec<Vec<i64>>,
    per: usize,
    label: String,
    w: Weights0,
    out: Vec<String>,
    /// The row cache's storage bytes a token in the 64-sequence decode, per budget.
    cache_bpt: Vec<(u64, f64)>,
}

/// How a step's reads are issued (see [`Bench::pass`]).
#[derive(Clone, Copy)]
enum Lead {
    Resident(Duration),
    Prefetch(Duration),
}

const ZERO: Duration = Duration::ZERO;

/// One timed pass: per step seconds and a fingerprint of each step's output.
struct Pass {
    secs: Vec<f64>,
    bits: Vec<u64>,
    read: u64,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn fingerprint(h: &[f32]) -> u64 {
    h.iter().fold(0xcbf29ce484222325u64, |a, x| {
        (a ^ x.to_bits() as u64).wrapping_mul(0x100000001b3)
    })
}

impl Bench {
    fn table(&self) -> &[u8] {
        &self.map[HEADER as usize..]
    }

    /// Steps `s0..s1` of `n` tokens: ids `[n, per]` each.
    fn steps(&self, n: usize, s0: usize, s1: usize) -> Vec<Vec<i64>> {
        let p = self.per;
        (s0..s1)
            .map(|s| {
                (0..n)
                    .flat_map(|l| self.lanes[l][s * p..(s + 1) * p].iter().copied())
                    .collect()
            })
            .collect()
    }

    fn layer1(&self, ids: &[i64]) -> Vec<i64> {
        ids.chunks_exact(self.per)
            .flat_map(|t| t[..C].iter().copied())
            .collect()
    }

    /// A context reading the table through `path` (`anon`: the resident copy).
    fn ctx<'w>(&'w self, path: Path, anon: &'w Anon) -> Option<Context<'w>> {
        let ctx = context(&self.t);
        let l = match path {
            Path::Resident => {
                self.w
                    .layer(&anon.slice()[..self.rows as usize * RB], self.rows, None)
            }
            Path::Mmap => self.w.layer(self.table(), self.rows, None),
            Path::Pread => self.w.layer(&[], self.rows, Some(self.file.clone())),
            Path::Cache(b) => {
                if !enable_cache(&ctx, b) {
                    return None;
                }
                self.w.layer(&[], self.rows, Some(self.file.clone()))
            }
        };
        ctx.set_layer(l).unwrap();
        Some(ctx)
    }

    fn drop_caches(&self) {
        file::drop_map(&self.map);
        file::drop_cache(&self.file);
    }

    /// Run `steps` through `ctx`: `lead` None = apply alone; Some(d) =
    /// prefetch, `d` of other work (a sleep: the GPU's layers), then apply;
    /// the time is from the prefetch (zero lead) or from the apply. The
    /// resident table is not prefetched: `Resident(d)` sleeps `d`, then
    /// times the apply, as a step with the same lead would.
    fn pass(&self, ctx: &Context, steps: &[Vec<i64>], lead: Lead) -> Pass {
        let mut p = Pass {
            secs: vec![],
            bits: vec![],
            read: 0,
        };
        let r0 = file::read_bytes();
        for ids in steps {
            let n = ids.len() / self.per;
            let mut h: Vec<f32> = (0..n * HC * D)
                .map(|i| ((i % 7) as f32 - 3.0) * 0.25)
                .collect();
            let t = match lead {
                Lead::Resident(d) => {
                    std::thread::sleep(d);
                    let t = Instant::now();
                    ctx.apply(LAYER, ids, n, Highway::F32(&mut h)).unwrap();
                    t.elapsed()
                }
                Lead::Prefetch(d) if d.is_zero() => {
                    let t = Instant::now();
                    ctx.prefetch(LAYER, ids, n).unwrap();
                    ctx.apply(LAYER, ids, n, Highway::F32(&mut h)).unwrap();
                    t.elapsed()
                }
                Lead::Prefetch(d) => {
                    ctx.prefetch(LAYER, ids, n).unwrap();
                    std::thread::sleep(d);
                    let t = Instant::now();
                    ctx.apply(LAYER, ids, n, Highway::F32(&mut h)).unwrap();
                    t.elapsed()
                }
            };
            p.secs.push(t.as_secs_f64());
            p.bits.push(fingerprint(&h));
        }
        p.read = file::read_bytes() - r0;
        p
    }

    /// Warm `ctx` with the steps before `s0` of `n` tokens, as big batches.
    fn warm_up(&self, ctx: &Context, n: usize, s0: usize) {
        let per_call = (PREFILL / n).max(1);
        let mut s = 0;
        while s < s0 {
            let e = (s + per_call).min(s0);
            let ids: Vec<i64> = self.steps(n, s, e).concat();
            let k = ids.len() / self.per;
            let mut h = vec![0f32; k * HC * D];
            ctx.prefetch(LAYER, &ids, k).unwrap();
            ctx.apply(LAYER, &ids, k, Highway::F32(&mut h)).unwrap();
            s = e;
        }
    }

    fn say(&mut self, s: String) {
        println!("{s}");
        self.out.push(s);
    }
}

pub fn main() {
    let args: Vec<String> = std::env::args().collect();
    let o = opts();
    if args.iter().any(|a| a == "--delete") {
        match std::fs::remove_file(&o.path) {
            Ok(()) => println!("deleted {}", o.path.display()),
            Err(e) => println!("{}: {e}", o.path.display()),
        }
        return;
    }
    let b = setup(o);
    report(b);
}

fn setup(o: Opts) -> Bench {
    let scaled: Option<u64> = std::env::var("ENGRAM_TIERS_ROWS")
        .ok()
        .and_then(|v| v.parse().ok());
    let (t, tok) = tables(scaled);
    let rows = t.rows[0];
    let file = file::open_or_create(&o.path, rows);
    // SAFETY: the bench's own table file, not written while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let s = o.steps;
    let long = (o.warm + 2 * s).max(PREFILL);
    let short = o.warm / DECODE[1] + 2 * s;
    let ctx = context(&t);
    let per = ctx.ids_per_token();
    let (lanes, label) = match ids::text_lanes(&o.text, &tok, 64, long, short) {
        Some(l) => {
            let lab = l.label.clone();
            (ids::hash_lanes(&ctx, &l, PREFILL), lab)
        }
        None => (
            ids::zipf_lanes(64, long.max(PREFILL), rows, per),
            format!(
                "SYNTHETIC Zipf(1) ids (no corpus at {}): development only, not a target figure",
                o.text.display()
            ),
        ),
    };
    drop(ctx);
    Bench {
        o,
        t,
        file: Arc::new(file),
        map,
        rows,
        lanes,
        per,
        label,
        w: Weights0::new(),
        out: vec![],
        cache_bpt: vec![],
    }
}

fn sh(cmd: &str) -> String {
    std::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

fn report(mut b: Bench) {
    let lead = Duration::from_secs_f64(b.o.layer_us * b.o.layers_before as f64 * 1e-6);
    b.say(format!(
        "## Tiered tables: layer {LAYER}'s table, {} rows of {RB} bytes (Q2_K), {:.2} GB file {}",
        b.rows,
        file::file_len(b.rows) as f64 / 1e9,
        b.o.path.display()
    ));
    b.say(format!(
        "CPU: {} ({} vCPUs), RAM {}",
        sh("lscpu | sed -n 's/^Model name: *//p'"),
        sh("nproc"),
        sh("free -g | awk '/Mem:/{print $2\" GiB\"}'")
    ));
    b.say(format!(
        "disk: {} | {}",
        sh("lsblk -dno NAME,SIZE,ROTA,LOG-SEC,PHY-SEC,MODEL | tr '\\n' ';'"),
        sh("findmnt -no SOURCE,FSTYPE -T /work")
    ));
    b.say(format!("ids: {}", b.label));
    b.say(format!("lead time: {} layer(s) before the engram layer (V4.1: 1 before layer 1, 13 before layer 14; the rows are layer {LAYER}'s) x {:.0} us a layer (ENGRAM_TIERS_LAYER_US: an assumed V4.1 decode layer on a GPU, not measured here) = {:.0} us; zero lead also shown", b.o.layers_before, b.o.layer_us, lead.as_secs_f64() * 1e6));
    b.say(format!("projection: light (D = {D}, hc = {HC}, bf16 wkv [{}, {}]); apply timed whole; CPU backend, 2 threads", D * (HC + 1), C * HD));
    let best = probe(&mut b);
    let mut anon = Anon::new(b.rows as usize * RB);
    let pre: Vec<i64> = b.lanes[0][..PREFILL * b.per].to_vec();
    let mut all: Vec<i64> = b.layer1(&pre);
    for n in DECODE {
        let w = b.o.warm / n;
        for st in b.steps(n, w, w + 2 * b.o.steps) {
            all.extend(b.layer1(&st));
        }
    }
    let pages = anon.fill(&b.file, &all);
    b.say(format!("resident: an anonymous MAP_NORESERVE mapping of the table's size, exactly the {pages} pages ({:.1} MB) holding the measured rows filled from the file", pages as f64 * 4096.0 / 1e6));
    let mut paths = vec![Path::Pread, Path::Mmap];
    paths.extend(b.o.caches.iter().map(|&c| Path::Cache(c)));
    for n in DECODE {
        decode(&mut b, &anon, n, lead, &paths);
    }
    prefill(&mut b, &anon, &pre, best, &paths);
    bytes_sim(&mut b);
    let md = target_dir().join("tiers.md");
    std::fs::write(&md, b.out.join("\n") + "\n").unwrap();
    println!("(written to {})", md.display());
}

fn probe(b: &mut Bench) -> f64 {
    use engram::rowio::{
        probe::{random_read_rate_with, Method},
        Force,
    };
    let secs = env("ENGRAM_TIERS_PROBE_S", 0.5);
    let depths = [1, 2, 4, 8, 16, 32, 64, 128];
    let rows =
        random_read_rate_with(&b.o.path, 512, &depths, Method::Reader(Force::Auto), secs).unwrap();
    let best = rows.iter().map(|r| r.reads_per_s).fold(0.0, f64::max);
    let line: String = rows
        .iter()
        .map(|r| {
            format!(
                " {}: {:.0}k/s (p50 {:.0} us);",
                r.depth,
                r.reads_per_s / 1e3,
                r.p50_us
            )
        })
        .collect();
    b.say(format!(
        "disk probe (engram::rowio::probe, {}: 512-byte random reads of the table file, {secs} s a depth, in flight:{line} best {:.0}k/s",
        rows[0].method, best / 1e3
    ));
    best
}

fn decode(b: &mut Bench, anon: &Anon, n: usize, lead: Duration, paths: &[Path]) {
    let (w, s) = (b.o.warm / n, b.o.steps);
    let (sa, sb) = (b.steps(n, w, w + s), b.steps(n, w + s, w + 2 * s));
    let ctx = b.ctx(Path::Resident, anon).unwrap();
    b.pass(&ctx, &sa[..1], Lead::Resident(ZERO));
    let (ra, rb) = (
        b.pass(&ctx, &sa, Lead::Resident(lead)),
        b.pass(&ctx, &sb, Lead::Resident(ZERO)),
    );
    drop(ctx);
    let (ma, mb) = (median(&ra.secs), median(&rb.secs));
    let (mut notes, mut bpts) = (vec![], vec![]);
    b.say(format!("\n### decode, {n} token(s) a step ({} sequences), median of {s} steps; warm = after {} warm-up tokens of the same streams", n, w * n));
    b.say(format!("| path | warm, lead {:.0} us | x resident | warm, zero lead | x resident | cold, lead | cold, zero lead | storage bytes/token (warm) |", lead.as_secs_f64() * 1e6));
    b.say("|---|---|---|---|---|---|---|---|".into());
    b.say(format!(
        "| resident | {:.1} us | 1 | {:.1} us | 1 | | | 0 |",
        ma * 1e6,
        mb * 1e6
    ));
    for &p in paths {
        let Some(ctx) = b.ctx(p, anon) else {
            b.say(format!("| {} | not in this build | | | | | | |", p.name()));
            continue;
        };
        b.drop_caches();
        b.warm_up(&ctx, n, w);
        ctx.cache_stats_reset();
        let (wa, wb) = (
            b.pass(&ctx, &sa, Lead::Prefetch(lead)),
            b.pass(&ctx, &sb, Lead::Prefetch(ZERO)),
        );
        assert_eq!(
            wa.bits,
            ra.bits,
            "{}: apply's output differs from the resident table's",
            p.name()
        );
        assert_eq!(
            wb.bits,
            rb.bits,
            "{}: apply's output differs from the resident table's",
            p.name()
        );
        if let Path::Cache(c) = p {
            notes.push(cache_line(&ctx, p, "warm, measured steps", 2 * s * n));
            let st = ctx.cache_stats(0, engram::rowcache::Tier::Host).unwrap();
            if n == 64 {
                bpts.push((c, st.bytes_read as f64 / (2 * s * n) as f64));
            }
        }
        drop(ctx);
        b.drop_caches();
        let ctx = b.ctx(p, anon).unwrap();
        let ca = b.pass(&ctx, &sa, Lead::Prefetch(lead));
        drop(ctx);
        b.drop_caches();
        let ctx = b.ctx(p, anon).unwrap();
        let cb = b.pass(&ctx, &sb, Lead::Prefetch(ZERO));
        assert_eq!(ca.bits, ra.bits);
        assert_eq!(cb.bits, rb.bits);
        drop(ctx);
        let bpt = (wa.read + wb.read) as f64 / (2 * s * n) as f64;
        let (x, y) = (median(&wa.secs), median(&wb.secs));
        b.say(format!(
            "| {} | {:.1} us | {:.2}x | {:.1} us | {:.2}x | {:.1} us | {:.1} us | {:.0} |",
            p.name(),
            x * 1e6,
            x / ma,
            y * 1e6,
            y / mb,
            median(&ca.secs) * 1e6,
            median(&cb.secs) * 1e6,
            bpt
        ));
    }
    for l in notes {
        b.say(l);
    }
    b.cache_bpt.extend(bpts);
}

fn prefill(b: &mut Bench, anon: &Anon, pre: &[i64], best: f64, paths: &[Path]) {
    let (rows, blocks, runs) = distinct(&b.layer1(pre), RB as u64, HEADER);
    let floor = runs as f64 / best;
    b.say(format!(
        "\n### cold prefill, one {PREFILL}-token chunk (lane 0's first tokens), median of {} runs",
        b.o.runs
    ));
    b.say(format!(
        "must read: {rows} distinct rows of {} ids, {blocks} distinct 512-byte blocks in {runs} contiguous runs; floor = {runs} reads / {:.0}k reads/s = {:.1} ms",
        PREFILL * C, best / 1e3, floor * 1e3
    ));
    let ctx = b.ctx(Path::Resident, anon).unwrap();
    let res: Vec<f64> = (0..b.o.runs)
        .map(|_| b.pass(&ctx, &[pre.to_vec()], Lead::Resident(ZERO)).secs[0])
        .collect();
    let want = b.pass(&ctx, &[pre.to_vec()], Lead::Resident(ZERO)).bits;
    drop(ctx);
    let mr = median(&res);
    b.say("| path | cold (prefetch + apply) | x floor | (cold - resident) x floor | warm | x resident | storage bytes/token (cold) |".into());
    b.say("|---|---|---|---|---|---|---|".into());
    b.say(format!("| resident | | | | {:.1} ms | 1 | 0 |", mr * 1e3));
    let mut checked = false;
    let mut notes = vec![];
    for &p in paths {
        if b.ctx(p, anon).is_none() {
            b.say(format!("| {} | not in this build | | | | | |", p.name()));
            continue;
        }
        let (mut cold, mut read) = (vec![], 0);
        for _ in 0..b.o.runs {
            b.drop_caches();
            if !checked {
                let f = file::cached_fraction(&b.file);
                b.say(format!(
                    "(page cache dropped: mincore finds {:.4}% of the file resident)",
                    f * 100.0
                ));
                checked = true;
            }
            let ctx = b.ctx(p, anon).unwrap();
            let r = b.pass(&ctx, &[pre.to_vec()], Lead::Prefetch(ZERO));
            assert_eq!(
                r.bits,
                want,
                "{}: prefill output differs from the resident table's",
                p.name()
            );
            cold.push(r.secs[0]);
            read += r.read;
            if matches!(p, Path::Cache(_)) && cold.len() == b.o.runs {
                notes.push(cache_line(&ctx, p, "one cold prefill", PREFILL));
            }
        }
        let ctx = b.ctx(p, anon).unwrap();
        b.pass(&ctx, &[pre.to_vec()], Lead::Prefetch(ZERO));
        let warm: Vec<f64> = (0..b.o.runs)
            .map(|_| b.pass(&ctx, &[pre.to_vec()], Lead::Prefetch(ZERO)).secs[0])
            .collect();
        drop(ctx);
        let (c, wm) = (median(&cold), median(&warm));
        b.say(format!(
            "| {} | {:.1} ms | {:.2}x | {:.2}x | {:.1} ms | {:.2}x | {:.0} |",
            p.name(),
            c * 1e3,
            c / floor,
            (c - mr) / floor,
            wm * 1e3,
            wm / mr,
            read as f64 / (b.o.runs * PREFILL) as f64
        ));
    }
    for l in notes {
        b.say(l);
    }
}

/// mmap at equal RAM: an exact LRU of 4 KiB pages of each cache budget over
/// the 64-sequence decode stream (warm-up, then the measured steps counted).
fn bytes_sim(b: &mut Bench) {
    let (w, s) = (b.o.warm / 64, b.o.steps);
    let warm: Vec<Vec<i64>> = b.steps(64, 0, w).iter().map(|x| b.layer1(x)).collect();
    let meas: Vec<Vec<i64>> = b
        .steps(64, w, w + 2 * s)
        .iter()
        .map(|x| b.layer1(x))
        .collect();
    b.say(format!("\n### storage bytes per token at equal RAM, 64-sequence decode ({} warm-up tokens, {} counted)", w * 64, 2 * s * 64));
    for &c in &b.o.caches.clone() {
        let mut lru = PageLru::new(c);
        for x in &warm {
            lru.touch(x, RB as u64, HEADER);
        }
        let m0 = lru.misses;
        for x in &meas {
            lru.touch(x, RB as u64, HEADER);
        }
        let bpt = (lru.misses - m0) as f64 * 4096.0 / (2 * s * 64) as f64;
        b.say(format!("mmap model (exact LRU of 4 KiB pages, {} MiB, no read-around: a lower bound for mmap): {bpt:.0} bytes/token", c >> 20));
        if let Some(&(_, cb)) = b.cache_bpt.iter().find(|x| x.0 == c) {
            b.say(format!("row cache {} MiB (its count, same steps): {cb:.0} bytes/token = 1/{:.1} of the mmap model (target: at most 1/5)", c >> 20, bpt / cb.max(1e-9)));
        }
    }
}
