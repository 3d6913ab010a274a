//! Weights converted once at load into a format the context reads: f16 to
//! bf16 (or f32), and the checkpoint's block-scaled fp8 to bf16.

use super::*;

/// f16 values (little-endian) to bf16 when every one is exact in bf16 (and
/// `!always_f32`), else to f32: the file's values unchanged, in a format the
/// context reads.
pub(super) fn convert_f16(raw: &[u8], what: &str, always_f32: bool) -> Result<(AlignedBuf, u32)> {
    let vals = || {
        raw.chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
    };
    if let Some(i) = vals().position(|v| !v.is_finite()) {
        bail!(
            ErrInvalidData,
            "{what}: element {i} is not a finite number (a NaN or infinity stored in an f16 weight)"
        );
    }
    let exact = !always_f32 && vals().all(|v| bf16_to_f32(f32_to_bf16(v)) == v);
    if exact {
        let mut out = AlignedBuf::zeroed(raw.len(), what)?;
        for (o, v) in out.as_mut_slice().chunks_exact_mut(2).zip(vals()) {
            o.copy_from_slice(&f32_to_bf16(v).to_le_bytes());
        }
        Ok((out, EngramType::Bf16 as u32))
    } else {
        let n = raw.len() / 2 * 4;
        let mut out = AlignedBuf::zeroed(n, what)?;
        for (o, v) in out.as_mut_slice().chunks_exact_mut(4).zip(vals()) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        Ok((out, EngramType::F32 as u32))
    }
}

/// fp8 e4m3 codes `[rows, cols]` with one e8m0 scale per `block` (rows,
/// columns) block (`scales` `[ceil(rows/br), ceil(cols/bc)]`) to bf16: each
/// value `e4m3 * 2^(scale-127)` rounded to nearest-even (exact unless it
/// leaves bf16's normal range). A NaN code or scale, or a value that is not
/// finite, is `ErrInvalidData` naming the element.
pub fn convert_fp8_block(
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    (br, bc): (usize, usize),
    what: &str,
    scale_what: &str,
) -> Result<AlignedBuf> {
    let (sr, sc) = (rows.div_ceil(br), cols.div_ceil(bc));
    if codes.len() != rows * cols || scales.len() != sr * sc {
        bail!(
            ErrFormat,
            "{what}: {} codes and {} scales for [{rows}, {cols}] in {br}x{bc} blocks",
            codes.len(),
            scales.len()
        );
    }
    let mut out = AlignedBuf::zeroed(rows * cols * 2, what)?;
    let o = out.as_mut_slice();
    for r in 0..rows {
        for c in 0..cols {
            let i = r * cols + c;
            let s = scales[(r / br) * sc + c / bc];
            let Some(sv) = e8m0_to_f32(s) else {
                bail!(
                    ErrInvalidData,
                    "{scale_what}: the scale of block ({}, {}) is the e8m0 NaN code 255",
                    r / br,
                    c / bc
                );
            };
            let code = codes[i];
            if code & 0x7F == 0x7F {
                bail!(
                    ErrInvalidData,
                    "{what}: element [{r}, {c}] is an e4m3 NaN code"
                );
            }
            let b = f32_to_bf16(e4m3_to_f32(code) * sv);
            if b & 0x7F80 == 0x7F80 {
                bail!(
                    ErrInvalidData,
                    "{what}: element [{r}, {c}] is not finite once scaled (scale code {s})"
                );
            }
            o[2 * i..2 * i + 2].copy_from_slice(&b.to_le_bytes());
        }
    }
    Ok(out)
}
