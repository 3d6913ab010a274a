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
