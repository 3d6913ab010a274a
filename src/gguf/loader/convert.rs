//! Weights converted once at load into a format the context reads: f16 to
//! bf16 (or f32), and the checkpoint's block-scaled fp8 to bf16.

use super::*;

/// f16 values (little-endian) as f32.
fn f16_values(raw: &[u8]) -> impl Iterator<Item = f32> + '_ {
    raw.chunks_exact(2)
        .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
}

/// Whether every f16 value in `raw` is exact in bf16; a NaN or infinity is
/// `ErrInvalidData` naming its element (`first` is the index of `raw`'s
/// first element in the weight).
pub(super) fn f16_scan(raw: &[u8], what: &str, first: usize) -> Result<bool> {
    if let Some(i) = f16_values(raw).position(|v| !v.is_finite()) {
        let i = first + i;
        bail!(
            ErrInvalidData,
            "{what}: element {i} is not a finite number (a NaN or infinity stored in an f16 weight)"
        );
    }
    Ok(f16_values(raw).all(|v| bf16_to_f32(f32_to_bf16(v)) == v))
}

/// f16 values (little-endian) to bf16 when every one is exact in bf16 (and
/// `!always_f32`), else to f32: the file's values unchanged, in a format the
/// context reads. `whole_exact`: the choice made over the whole weight when
/// `raw` is a shard's part of it (`None`: `raw` is the whole weight).
pub(super) fn convert_f16(
    raw: &[u8],
    what: &str,
    always_f32: bool,
    whole_exact: Option<bool>,
) -> Result<(AlignedBuf, u32)> {
    let vals = || f16_values(raw);
    let exact = match whole_exact {
        Some(e) => e,
        None => f16_scan(raw, what, 0)? && !always_f32,
    };
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
