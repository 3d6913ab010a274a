//! The driver on emulated tiles against a plain model of its order, and
//! the emulation against the instructions where the CPU has AMX.

use super::*;

/// A bf16 as f32.
fn bf(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// Subnormal to signed zero.
fn flush(x: f32) -> f32 {
    if x != 0.0 && x.abs() < f32::MIN_POSITIVE {
        0.0 * x.signum()
    } else {
        x
    }
}

/// The kernel's order written out per output, independently of the tiles:
/// K in chunks of 32 (zero past `k`), each chunk's even and odd products
/// summed apart from zero by single-rounding FMAs, their sum added to the
/// output's running sum; inputs and every result flushed (DAZ/FTZ).
fn model(w: &[u16], x: &[u16], k: usize, o: usize, t: usize) -> f32 {
    let at = |v: &[u16], row: usize, i: usize| {
        if i < k {
            flush(bf(v[row * k + i]))
        } else {
            0.0
        }
    };
    let mut acc = 0f32;
    for c in 0..k.div_ceil(32) {
        let mut s = [0f32; 2];
        for i in 0..32 {
            let kk = c * 32 + i;
            s[i % 2] = flush(at(w, o, kk).mul_add(at(x, t, kk), s[i % 2]));
        }
        acc = flush(acc + flush(s[0] + s[1]));
    }
    acc
}

/// Deterministic bf16 values around 1 in magnitude, some tiny, some zero.
fn values(n: usize, seed: u64) -> Vec<u16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            match i % 97 {
                0 => 0x0001 | ((s as u16) & 0x8000), // a subnormal
                1 => 0,
                _ => {
                    let f = ((s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32;
                    (f.to_bits() >> 16) as u16
                }
            }
        })
        .collect()
}

fn run_emu(w: &[u16], x: &[u16], n: usize, k: usize, lo: usize, hi: usize) -> Vec<f32> {
    let p = Packed::new(x, n, k).unwrap();
    let mut out = vec![f32::NAN; (hi - lo) * n];
    // SAFETY: the emulation runs anywhere; `w` holds `hi` rows of `k`.
    unsafe { task(&mut Emu::default(), Src::Bf16(w), &p, lo, hi, &mut out).unwrap() };
    out
}

#[test]
fn emulated_driver_is_the_model_at_every_edge() {
    // Outputs and tokens off and on whole tiles; K whole chunks, a
    // fraction of one, and more than one with a tail.
    for &k in &[32, 64, 7, 50, 96] {
        for &(lo, hi) in &[(0, 16), (0, 17), (3, 40), (0, 33), (5, 6)] {
            for &n in &[1, 2, 15, 16, 17, 31, 33, 40] {
                let w = values(hi * k, 1 + k as u64);
                let x = values(n * k, 2 + n as u64);
                let out = run_emu(&w, &x, n, k, lo, hi);
                for o in lo..hi {
                    for t in 0..n {
                        let (got, want) = (out[(o - lo) * n + t], model(&w, &x, k, o, t));
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "k {k} rows {lo}..{hi} n {n}: output {o} token {t}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn emulated_fp8_is_the_bf16_path_on_the_widened_weights() {
    use crate::formats::fp8_block::fp8_block_scale_len;
    let (k, rows, br, bc) = (96, 40, 16, 32);
    let codes: Vec<u8> = (0..rows * k)
        .map(|i| (i as u32 * 37 % 251) as u8 & 0x7E)
        .collect();
    let scales: Vec<u8> = (0..fp8_block_scale_len(rows, k, br, bc).unwrap())
        .map(|i| 120 + (i % 9) as u8)
        .collect();
    let b = Fp8Blocks::new(&codes, &scales, k, br, bc).unwrap();
    let mut wf = vec![0f32; rows * k];
    b.to_f32(0, &mut wf);
    let wb: Vec<u16> = wf.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
    assert!(wf.iter().zip(&wb).all(|(v, &h)| bf(h) == *v));
    for n in [1, 5, 33, 70] {
        let x = values(n * k, n as u64);
        let p = Packed::new(&x, n, k).unwrap();
        let mut out = vec![0f32; (rows - 3) * n];
        // SAFETY: the emulation runs anywhere; `b` holds `rows` rows.
        unsafe { task(&mut Emu::default(), Src::Fp8(b), &p, 3, rows, &mut out).unwrap() };
        let want = run_emu(&wb, &x, n, k, 3, rows);
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "fp8 n {n}"
        );
    }
}

#[test]
fn emulation_refuses_what_the_hardware_faults_on() {
    let mut e = Emu::default();
    let bad = std::panic::catch_unwind(move || {
        // SAFETY: the emulation; it panics before reading anything.
        unsafe { e.zero(0) }
    });
    assert!(bad.is_err(), "tilezero without a configuration");
    let mut cfg = Config::for_tokens(4);
    cfg.colsb[A[0] as usize] = 32; // 8 pairs against a B tile of 16 rows
    let mut e = Emu::default();
    let bad = std::panic::catch_unwind(move || {
        // SAFETY: the emulation; it panics before reading anything.
        unsafe {
            e.configure(&cfg);
            e.dp(C[0][0], A[0], B[0]);
        }
    });
    assert!(bad.is_err(), "tdpbf16ps with A's pairs != B's rows");
}

/// On a CPU with AMX: the instructions give the emulation's bits.
#[test]
fn amx_hardware_matches_emulation() {
    if let Err(why) = status() {
        eprintln!("no AMX here ({why}): skipped");
        return;
    }
    for &(k, hi, n) in &[(32, 16, 1), (96, 40, 17), (50, 33, 33), (6144 / 8, 64, 64)] {
        let w = values(hi * k, k as u64);
        let x = values(n * k, n as u64 + 9);
        let p = Packed::new(&x, n, k).unwrap();
        let mut out = vec![0f32; hi * n];
        // SAFETY: `status` is Ok (AMX granted); `w` holds `hi` rows.
        unsafe { task(&mut Hw, Src::Bf16(&w), &p, 0, hi, &mut out).unwrap() };
        let want = run_emu(&w, &x, n, k, 0, hi);
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "k {k} n {n} at {i}: {a} vs {b}");
        }
    }
}
