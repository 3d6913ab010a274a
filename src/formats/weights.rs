//! How a weight matrix (`wkv`, `q`, `k`) is held: dense f32 or bf16 values,
//! or quantised rows in a ggml block format, read in place.

use super::{bf16_to_f32, dequant_row_f32, EngramType, Fp8Blocks};
use crate::error::{bail, Result};

/// A weight dtype (`wkv`, `q`, `k`) this build reads as dense values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    /// f32 or bf16; any other type is `ErrUnsupported`. (Quantised weights are
    /// described by [`WeightFormat::new`], which also needs the row length.)
    pub fn new(ty: u32, what: &str) -> Result<WeightDtype> {
        match EngramType::from_u32(ty) {
            Some(EngramType::F32) => Ok(WeightDtype::F32),
            Some(EngramType::Bf16) => Ok(WeightDtype::Bf16),
            Some(t) => bail!(
                ErrUnsupported,
                "{what} dtype {} ({ty}) is not supported here (f32 or bf16)",
                t.name()
            ),
            None => bail!(ErrUnsupported, "unknown {what} dtype {ty}"),
        }
    }

    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }
}

/// How a weight matrix is stored: dense f32/bf16 values, or quantised rows
/// (ggml block formats; each row of `row_len` values is
/// `format.row_bytes(row_len)` bytes, rows back to back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    Dense(WeightDtype),
    Quant(EngramType),
    /// `ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK`: one code byte a value here, the
    /// block scales in a second array ([`Fp8Blocks`]).
    Fp8Block,
}

impl WeightFormat {
    /// The format of a weight of type `ty` whose rows hold `row_len` values
    /// (for `wkv`, `[D*(hc+1), C*Hd]`, that is `C*Hd`): f32, bf16, or read in
    /// place: f16 (ds4's GGUFs carry `wkv` so) or one of `q8_0`, `q4_0`,
    /// `q2_K` ... `q6_K` with `row_len` a whole number of blocks. Anything
    /// else is `ErrUnsupported`, naming `what`.
    pub fn new(ty: u32, row_len: usize, what: &str) -> Result<WeightFormat> {
        let Some(t) = EngramType::from_u32(ty) else {
            bail!(ErrUnsupported, "unknown {what} dtype {ty}");
        };
        match t {
            EngramType::F32 => Ok(WeightFormat::Dense(WeightDtype::F32)),
            EngramType::Bf16 => Ok(WeightFormat::Dense(WeightDtype::Bf16)),
            EngramType::F16
            | EngramType::Q8_0
            | EngramType::Q4_0
            | EngramType::Q2_K
            | EngramType::Q3_K
            | EngramType::Q4_K
            | EngramType::Q5_K
            | EngramType::Q6_K => {
                let f = EngramType::row_format(ty, row_len).map_err(|e| {
                    crate::error::Error::new(e.status, format!("{what}: {}", e.message))
                })?;
                Ok(WeightFormat::Quant(f))
            }
            EngramType::Fp8E4m3E8m0Block => Ok(WeightFormat::Fp8Block),
            EngramType::Fp8E4m3E8m0 | EngramType::Fp8E4m3E8m0Split => bail!(
                ErrUnsupported,
                "{what} dtype {} ({ty}) is not supported (f32, bf16, f16, q8_0, q4_0, q2_K..q6_K \
                 or fp8_e4m3_e8m0_block)",
                t.name()
            ),
        }
    }

    /// Bytes of `rows` rows of `row_len` values, or `None` on overflow.
    pub fn bytes(self, rows: usize, row_len: usize) -> Option<usize> {
        let per_row = match self {
            WeightFormat::Dense(d) => d.size().checked_mul(row_len)?,
            WeightFormat::Quant(f) => f.row_bytes(row_len),
            WeightFormat::Fp8Block => row_len,
        };
        rows.checked_mul(per_row)
    }
}

/// A borrowed weight matrix: dense f32 values or bf16 bit patterns, or
/// quantised rows.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    /// Rows of `row_len` values, each `format.row_bytes(row_len)` bytes, back
    /// to back in `data` (a GGUF tensor's data as it is in the file). Build it
    /// with [`Weights::quant`], which checks the sizes. Values are read with
    /// [`Weights::to_f32`] (any range; whole rows are the fast path) or
    /// [`Weights::get`] (dequantises the containing block each call: slow).
    Quant {
        format: EngramType,
        data: &'a [u8],
        row_len: usize,
    },
    /// Block-scaled fp8 (the checkpoint's `wkv` as stored): e4m3 codes and
    /// one e8m0 scale per block, read in place (see [`Fp8Blocks`]).
    Fp8Block(Fp8Blocks<'a>),
}

impl<'a> Weights<'a> {
    /// A weight read in place over `data`, checked: `format` is f16 or a GGUF
    /// block format, `row_len` a positive whole number of its blocks and
    /// `data` whole rows.
    pub fn quant(format: EngramType, data: &'a [u8], row_len: usize) -> Result<Weights<'a>> {
        let bl = match (format, format.block()) {
            (EngramType::F16, _) => 1,
            (_, Some((bl, _))) => bl,
            _ => bail!(
                ErrUnsupported,
                "weights read in place are f16 or GGUF block formats, not {}",
                format.name()
            ),
        };
        if row_len == 0 || !row_len.is_multiple_of(bl) {
            bail!(
                ErrUnsupported,
                "{} weight rows are whole blocks of {bl} values; got rows of {row_len}",
                format.name()
            );
        }
        let rb = format.row_bytes(row_len);
        if !data.len().is_multiple_of(rb) {
            bail!(
                ErrInvalidArgument,
                "{} weight data of {} bytes is not whole rows of {rb} bytes",
                format.name(),
                data.len()
            );
        }
        Ok(Weights::Quant {
            format,
            data,
            row_len,
        })
    }

    /// Output rows `[lo, hi)` of a matrix whose rows hold `row_len` values
    /// (a shard's part of `wkv`), read in place. A block-scaled fp8 matrix is
    /// cut at its scale blocks only: `lo` a multiple of the block's rows
    /// (else `ErrInvalidArgument`); `hi` past the end is `ErrInvalidArgument`.
    pub fn rows(&self, lo: usize, hi: usize, row_len: usize) -> Result<Weights<'a>> {
        let n_rows = self.len().checked_div(row_len).unwrap_or(0);
        if lo > hi || hi > n_rows {
            bail!(
                ErrInvalidArgument,
                "output rows [{lo}, {hi}) of a weight with {n_rows} rows"
            );
        }
        Ok(match *self {
            Weights::F32(v) => Weights::F32(&v[lo * row_len..hi * row_len]),
            Weights::Bf16(v) => Weights::Bf16(&v[lo * row_len..hi * row_len]),
            Weights::Quant { format, data, .. } => {
                let rb = format.row_bytes(row_len);
                Weights::Quant {
                    format,
                    data: &data[lo * rb..hi * rb],
                    row_len,
                }
            }
            Weights::Fp8Block(b) => {
                if !lo.is_multiple_of(b.br) {
                    bail!(
                        ErrInvalidArgument,
                        "output rows [{lo}, {hi}) of a block-scaled fp8 weight: the range \
                         starts inside a block of {} rows",
                        b.br
                    );
                }
                let sc = b.block_cols();
                let s_lo = (lo / b.br) * sc;
                let s_hi = hi.div_ceil(b.br) * sc;
                Weights::Fp8Block(Fp8Blocks {
                    codes: &b.codes[lo * row_len..hi * row_len],
                    scales: &b.scales[s_lo..s_hi],
                    ..b
                })
            }
        })
    }

    /// Total values.
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(v) => v.len(),
            Weights::Bf16(v) => v.len(),
            Weights::Quant {
                format,
                data,
                row_len,
            } => {
                let rb = format.row_bytes(*row_len);
                data.len().checked_div(rb).map_or(0, |r| r * row_len)
            }
            Weights::Fp8Block(b) => b.codes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `i` as f32. For `Quant` this dequantises the block (or, for a
    /// non-block format, the row) holding `i`: fine for a few values, slow for
    /// many (use [`Weights::to_f32`]).
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Weights::F32(v) => v[i],
            Weights::Bf16(v) => bf16_to_f32(v[i]),
            Weights::Fp8Block(b) => b.value(i / b.k, i % b.k),
            Weights::Quant { .. } => {
                let mut x = [0f32];
                self.to_f32(i, &mut x);
                x[0]
            }
        }
    }

    /// Values `start..start + out.len()` converted to f32 into `out` (panics if
    /// the range passes the end). For `Quant` any range works; ranges of whole
    /// rows (or whole blocks) are dequantised straight into `out`, partial
    /// blocks through a scratch block. Quantised values are exactly
    /// [`dequant_row_f32`]'s; a row that fails to dequantise (fp8 NaN codes, the
    /// only format that can) reads as NaN.
    pub fn to_f32(&self, start: usize, out: &mut [f32]) {
        match *self {
            Weights::F32(v) => out.copy_from_slice(&v[start..start + out.len()]),
            Weights::Bf16(v) => {
                let n = out.len();
                for (o, &b) in out.iter_mut().zip(&v[start..start + n]) {
                    *o = bf16_to_f32(b);
                }
            }
            Weights::Quant {
                format,
                data,
                row_len,
            } => quant_to_f32(format, data, row_len, start, out, self.len()),
            Weights::Fp8Block(b) => b.to_f32(start, out),
        }
    }
}

/// `Weights::Quant`'s `to_f32`. The matrix is a run of units: blocks for block
/// formats (rows are whole blocks, so the rows' blocks are one stream), rows
/// otherwise.
fn quant_to_f32(
    format: EngramType,
    data: &[u8],
    row_len: usize,
    start: usize,
    out: &mut [f32],
    len: usize,
) {
    let n = out.len();
    assert!(
        start <= len && n <= len - start,
        "values {start}..{} of a weight of {len}",
        start + n
    );
    let (ul, ub) = format
        .block()
        .unwrap_or((row_len, format.row_bytes(row_len)));
    // Dequantise whole units `u0..u0 + k` into `o` (k * ul values).
    let units = |u0: usize, k: usize, o: &mut [f32]| {
        let bytes = &data[u0 * ub..(u0 + k) * ub];
        if format.is_gguf_block() || format == EngramType::F16 {
            // Written in full whatever the values (non-finite ones included).
            let _ = dequant_row_f32(format, bytes, o);
        } else {
            for (b, o) in bytes.chunks_exact(ub).zip(o.chunks_exact_mut(ul)) {
                if dequant_row_f32(format, b, o).is_err() {
                    o.fill(f32::NAN);
                }
            }
        }
    };
    let mut scratch = Vec::new();
    let (mut pos, mut o) = (start, 0);
    while o < n {
        let (u, off) = (pos / ul, pos % ul);
        let whole = if off == 0 { (n - o) / ul } else { 0 };
        if whole > 0 {
            units(u, whole, &mut out[o..o + whole * ul]);
            pos += whole * ul;
            o += whole * ul;
        } else {
            scratch.resize(ul, 0f32);
            units(u, 1, &mut scratch);
            let take = (ul - off).min(n - o);
            out[o..o + take].copy_from_slice(&scratch[off..off + take]);
            pos += take;
            o += take;
        }
    }
}
