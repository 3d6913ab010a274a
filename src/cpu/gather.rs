//! Gather rows by id from a host table and dequantise them to bf16.

use crate::formats::{dequant_row_bf16, EngramType, RowDataError};

/// Gather rows by id and dequantise them to bf16 (bit patterns).
/// `ids` are already checked to lie inside the table. On bad data the error
/// names the position in `ids` and what was wrong.
pub fn gather_rows(
    table: &[u8],
    fmt: EngramType,
    width: usize,
    ids: &[i64],
    out: &mut [u16],
) -> Result<(), (usize, RowDataError)> {
    let rb = fmt.row_bytes(width);
    for (j, (&id, o)) in ids.iter().zip(out.chunks_exact_mut(width)).enumerate() {
        let r = id as usize;
        dequant_row_bf16(fmt, &table[r * rb..(r + 1) * rb], o).map_err(|e| (j, e))?;
    }
    Ok(())
}
