//! GGUF blocks. Each function reads one block (exactly the block's bytes) and
//! writes its values in ggml's element order. The arithmetic is f32 with one
//! rounding per operation, in ggml's order (`dequantize_row_*` in
//! ggml-quants.c); Rust never fuses a multiply and an add, so these are the
//! values of an unfused ggml build (and of gguf-py's numpy dequantisers).

use super::EngramType;

/// Dequantise one block of a GGUF block format (`blk` is its bytes, `out` its
/// `block().0` values).
pub fn dequant_block_f32(fmt: EngramType, blk: &[u8], out: &mut [f32]) {
    match fmt {
        EngramType::Q8_0 => q8_0(blk.try_into().unwrap(), out.try_into().unwrap()),
        EngramType::Q4_0 => q4_0(blk.try_into().unwrap(), out.try_into().unwrap()),
        EngramType::Q2_K => q2_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        EngramType::Q3_K => q3_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        EngramType::Q4_K => q4_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        EngramType::Q5_K => q5_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        EngramType::Q6_K => q6_k(blk.try_into().unwrap(), out.try_into().unwrap()),
        other => panic!("{} is not a block format", other.name()),
    }
}

/// An f16 stored little-endian at `b[at..at + 2]`, widened exactly.
#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// `y = q * d`, `q` the signed byte.
fn q8_0(b: &[u8; 34], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    for (o, &q) in y.iter_mut().zip(&b[2..]) {
        *o = (q as i8) as f32 * d;
    }
}

/// `y = (q - 8) * d`; byte `j` holds value `j` (low nibble) and `j + 16` (high).
fn q4_0(b: &[u8; 18], y: &mut [f32; 32]) {
    let d = f16_at(b, 0);
    let (lo, hi) = y.split_at_mut(16);
    for (j, &q) in b[2..].iter().enumerate() {
        lo[j] = ((q & 0xF) as i32 - 8) as f32 * d;
        hi[j] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// Each half (128 values) reads 32 bytes of `qs`; its four groups of 32 take
/// the 2-bit fields at shifts 0, 2, 4, 6. Sub-block `s` (16 values) has the
/// scale byte `scales[s]`: low nibble times `d`, high nibble times `dmin`;
/// `y = (d * sc) * q - (dmin * m)`.
fn q2_k(b: &[u8; 84], y: &mut [f32; 256]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let d = f16_at(b, 80);
    let dmin = f16_at(b, 82);
    for (s, ys) in y.chunks_exact_mut(16).enumerate() {
        let sc = scales[s];
        let dl = d * (sc & 0xF) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
        let q = &qs[32 * half + 16 * part..][..16];
        for (o, &qb) in ys.iter_mut().zip(q) {
            *o = dl * ((qb >> (2 * group)) & 3) as f32 - ml;
        }
    }
}

/// The 6-bit scales of `q3_K`: value `s` has its low 4 bits in `scales[s]`
/// (s < 8, low nibble) or `scales[s - 8]` (high nibble) and its high 2 bits in
/// `scales[8 + s % 4]` at bit `2 * (s / 4)`; the scale is that minus 32.
#[inline]
fn q3_k_scale(sc: &[u8], s: usize) -> i32 {
    let lo = if s < 8 { sc[s] & 0xF } else { sc[s - 8] >> 4 };
    let hi = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
    (lo | (hi << 4)) as i32 - 32
}

/// Like `q2_K` for the low 2 bits; `hmask[l]` bit `4 * half + group` set means
/// no offset, clear means `-4`; `y = (d * (sc - 32)) * q`.
fn q3_k(b: &[u8; 110], y: &mut [f32; 256]) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (s, ys) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * q3_k_scale(scales, s) as f32;
        let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
        let q = &qs[32 * half + 16 * part..][..16];
        let h = &hmask[16 * part..][..16];
        let bit = 1u8 << (4 * half + group);
        for ((o, &qb), &hb) in ys.iter_mut().zip(q).zip(h) {
            let v = ((qb >> (2 * group)) & 3) as i32 - if hb & bit != 0 { 0 } else { 4 };
            *o = dl * v as f32;
        }
    }
}

/// The packed 6-bit (scale, min) pair `j` of `q4_K` / `q5_K` (ggml's
/// `get_scale_min_k4`).
#[inline]
pub(crate) fn scale_min_k4(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        (
            (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
        )
    }
}

/// Sub-block `s` (32 values) reads `qs[32 * (s / 2)..][..32]`, low nibbles for
/// even `s`, high for odd; `y = (d * sc) * q - (dmin * m)`.
fn q4_k(b: &[u8; 144], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (s, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, s);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let q = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        for (o, &qb) in ys.iter_mut().zip(q) {
            *o = d1 * ((qb >> shift) & 0xF) as f32 - m1;
        }
    }
}

/// As `q4_K`, plus the fifth bit: bit `s` of `qh[l]` adds 16.
fn q5_k(b: &[u8; 176], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (s, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, s);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let q = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        for ((o, &qb), &hb) in ys.iter_mut().zip(q).zip(qh) {
            let v = ((qb >> shift) & 0xF) as u32 + if hb & (1 << s) != 0 { 16 } else { 0 };
            *o = d1 * v as f32 - m1;
        }
    }
}

/// Each half (128 values) reads `ql[64 * half..][..64]` and `qh[32 * half..][..32]`;
/// its group `g` of 32 values takes the low (g = 0, 1) or high (g = 2, 3)
/// nibbles of `ql[32 * (g % 2)..][..32]` and the 2 bits of `qh` at shift
/// `2 * g`; `q` is that 6-bit value minus 32 and `y = (d * sc) * q` with the
/// signed scale `scales[s]` of sub-block `s` (16 values).
fn q6_k(b: &[u8; 210], y: &mut [f32; 256]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (s, ys) in y.chunks_exact_mut(16).enumerate() {
        let sd = d * (scales[s] as i8) as f32;
        let (half, group, part) = (s / 8, (s / 2) % 4, s % 2);
        let l0 = 16 * part;
        let lq = &ql[64 * half + 32 * (group % 2) + l0..][..16];
        let hq = &qh[32 * half + l0..][..16];
        let shift = 4 * (group / 2);
        for ((o, &lb), &hb) in ys.iter_mut().zip(lq).zip(hq) {
            let v = (((lb >> shift) & 0xF) | (((hb >> (2 * group)) & 3) << 4)) as i32 - 32;
            *o = sd * v as f32;
        }
    }
}

/// Random rows of `f` (f16 or a GGUF block format), `len` bytes: every
/// code, and f16 values (an f16 row's values, a block's scales) finite, of
/// all magnitudes, subnormals included (tests of the kernels that decode
/// these formats against [`dequant_block_f32`]).
#[cfg(test)]
pub(crate) fn random_blocks(f: EngramType, len: usize, seed: u64) -> Vec<u8> {
    let mut z = seed;
    let mut data: Vec<u8> = (0..len)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 56) as u8
        })
        .collect();
    // Where each format keeps its f16 values: (bytes per unit, high bytes).
    let (bb, at): (usize, &[usize]) = match f {
        EngramType::F16 => (2, &[1]),
        EngramType::Q8_0 | EngramType::Q4_0 => (f.block().unwrap().1, &[1]),
        EngramType::Q2_K => (84, &[81, 83]),
        EngramType::Q3_K => (110, &[109]),
        EngramType::Q4_K | EngramType::Q5_K => (f.block().unwrap().1, &[1, 3]),
        EngramType::Q6_K => (210, &[209]),
        other => panic!("{} is not f16 or a block format", other.name()),
    };
    for blk in data.chunks_mut(bb) {
        for &i in at {
            if blk[i] & 0x7C == 0x7C {
                blk[i] ^= 0x04;
            }
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::dequant_row_f32;

    /// The K-quant scale unpacking against hand-packed codes.
    #[test]
    fn packed_scales_unpack() {
        // q4_K/q5_K: scale j and min j for j = 0..8.
        let (sc, mn) = (
            [1u8, 2, 3, 63, 40, 17, 0, 63],
            [5u8, 0, 63, 9, 33, 48, 62, 1],
        );
        let mut b = [0u8; 12];
        for j in 0..4 {
            b[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            b[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
            b[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4);
        }
        for j in 0..8 {
            assert_eq!(scale_min_k4(&b, j), (sc[j], mn[j]), "{j}");
        }
        // q3_K: 16 six-bit codes, scale = code - 32.
        let codes: Vec<u8> = (0..16).map(|j| (j * 7 + 3) % 64).collect();
        let mut b = [0u8; 12];
        for (j, &c) in codes.iter().enumerate() {
            if j < 8 {
                b[j] |= c & 0xF;
            } else {
                b[j - 8] |= (c & 0xF) << 4;
            }
            b[8 + j % 4] |= (c >> 4) << (2 * (j / 4));
        }
        for (j, &c) in codes.iter().enumerate() {
            assert_eq!(q3_k_scale(&b, j), c as i32 - 32, "{j}");
        }
    }

    #[test]
    fn q4_0_nibbles_and_q8_0_signs() {
        let mut b = [0u8; 18];
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut y = [0f32; 32];
        dequant_row_f32(EngramType::Q4_0, &b, &mut y).unwrap();
        for j in 0..16 {
            assert_eq!(y[j], j as f32 - 8.0);
            assert_eq!(y[16 + j], 7.0 - j as f32);
        }
        let mut b = [0u8; 34];
        b[0..2].copy_from_slice(&0xc000u16.to_le_bytes()); // d = -2
        for j in 0..32 {
            b[2 + j] = (j as u8).wrapping_mul(8);
        }
        dequant_row_f32(EngramType::Q8_0, &b, &mut y).unwrap();
        for (j, &v) in y.iter().enumerate() {
            assert_eq!(v, -2.0 * ((j as u8).wrapping_mul(8) as i8) as f32);
        }
    }
}
