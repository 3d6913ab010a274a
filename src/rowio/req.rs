//! A call's requests and what it read (beneath the engines, which fill them).

use super::buf::Latency;

/// One row to read: `dst.len()` bytes at byte `offset` of the table.
pub struct RowRead<'a> {
    pub offset: u64,
    pub dst: &'a mut [u8],
}

/// What a call read.
#[derive(Clone, Debug, Default)]
pub struct ReadCounts {
    /// Rows given (duplicates included).
    pub rows: u64,
    /// Read system calls or io_uring reads issued (a short read continued
    /// counts again).
    pub reads_issued: u64,
    /// Bytes read from the file (whole blocks for direct reads).
    pub bytes_read: u64,
    /// The latency of each read issued.
    pub latency: Latency,
}

impl ReadCounts {
    /// Add `o`'s reads to these.
    pub fn add(&mut self, o: &ReadCounts) {
        self.rows += o.rows;
        self.reads_issued += o.reads_issued;
        self.bytes_read += o.bytes_read;
        self.latency.merge(&o.latency);
    }
}
