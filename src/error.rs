//! Status codes and the error type every fallible call returns.

use std::fmt;

/// Status of every `engram_*` call. `ENGRAM_OK` is zero; every error code sits
/// above a nonzero base so that a stray `0`/`1`/`-1` from elsewhere in an engine
/// is never mistaken for one of ours.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EngramStatus {
    /// Success.
    Ok = 0,
    /// A required pointer argument was NULL.
    ErrNullArgument = 7001,
    /// An options struct's `struct_size` does not match this library's.
    ErrStructSize = 7002,
    /// The configuration is invalid (geometry, hash tables, capacities).
    ErrInvalidConfig = 7003,
    /// A token id is negative (other than `ENGRAM_TOKEN_DEAD`) or outside `token_map`.
    ErrInvalidToken = 7004,
    /// A look-back position of a sequence was never hashed.
    ErrMissingHistory = 7005,
    /// The layer id is not one of the configured engram layers.
    ErrUnknownLayer = 7006,
    /// More tokens in one call than `max_tokens`, or no memory left: every
    /// allocation whose size a caller or a file chooses (a call's working
    /// buffers, a sequence's history and its copy, the histories of
    /// `max_seqs` sequences, a token map) is fallible and fails with this.
    /// A sequence id or position out of range is
    /// `ENGRAM_STATUS_ERR_INVALID_SEQUENCE`, a `row_ids` buffer too small
    /// `ENGRAM_STATUS_ERR_INVALID_ARGUMENT`.
    ErrCapacity = 7007,
    /// A format, dtype or backend this build does not support.
    ErrUnsupported = 7008,
    /// Table data that must not be turned into numbers: a gathered row holds
    /// a NaN e8m0 scale, an e4m3 NaN code, or a value that is not finite once
    /// dequantised (an e8m0 scale that overflows the row, a NaN or infinite
    /// GGUF block scale, a stored NaN or infinity). The token is left untouched.
    ErrInvalidData = 7009,
    /// `engram_apply` on a layer whose weights were never set.
    ErrNoWeights = 7010,
    /// A row id outside the layer's table, or a token whose ids are only partly dead.
    ErrInvalidRowId = 7011,
    /// A sequence id outside `[0, max_seqs)`, a position outside
    /// `[0, max_positions)`, the same (sequence, position) twice in one batch,
    /// or a position range of an `engram_seq_*` call outside
    /// `[0, max_positions]` or ending before it starts.
    ErrInvalidSequence = 7012,
    /// Any other invalid argument (sizes, alignment, a stream of another
    /// context, ...). A highway type other than f32 or bf16 is
    /// `ERR_UNSUPPORTED`.
    ErrInvalidArgument = 7013,
    /// The backend's device is not usable (no driver, bad ordinal, ...).
    ErrDevice = 7014,
    /// A file could not be opened, read or mapped, or a read of table rows
    /// from a file failed (an I/O error).
    ErrIo = 7015,
    /// A file is not what it claims: not GGUF (wrong magic), truncated, or
    /// inconsistent (a tensor whose data lies outside the file or overlaps
    /// another, metadata of the wrong type or length).
    ErrFormat = 7016,
    /// A bug: a panic was caught at the C boundary. The context is still valid
    /// but the call had no effect that can be relied on.
    ErrInternal = 7099,
}

impl EngramStatus {
    /// A short, static description.
    pub fn as_str(self) -> &'static str {
        use EngramStatus::*;
        match self {
            Ok => "ok",
            ErrNullArgument => "null argument",
            ErrStructSize => "struct_size mismatch",
            ErrInvalidConfig => "invalid configuration",
            ErrInvalidToken => "invalid token id",
            ErrMissingHistory => "look-back position never hashed",
            ErrUnknownLayer => "unknown engram layer",
            ErrCapacity => "capacity exceeded",
            ErrUnsupported => "unsupported format, dtype or backend",
            ErrInvalidData => "invalid table data",
            ErrNoWeights => "layer weights not set",
            ErrInvalidRowId => "invalid row id",
            ErrInvalidSequence => "invalid sequence or position",
            ErrInvalidArgument => "invalid argument",
            ErrDevice => "device unavailable",
            ErrIo => "I/O error",
            ErrFormat => "malformed file",
            ErrInternal => "internal error (caught panic)",
        }
    }

    /// Every status, for tests and for `engram_status_str`.
    pub(crate) const ALL: [EngramStatus; 18] = {
        use EngramStatus::*;
        [
            Ok,
            ErrNullArgument,
            ErrStructSize,
            ErrInvalidConfig,
            ErrInvalidToken,
            ErrMissingHistory,
            ErrUnknownLayer,
            ErrCapacity,
            ErrUnsupported,
            ErrInvalidData,
            ErrNoWeights,
            ErrInvalidRowId,
            ErrInvalidSequence,
            ErrInvalidArgument,
            ErrDevice,
            ErrIo,
            ErrFormat,
            ErrInternal,
        ]
    };

    pub fn from_i32(v: i32) -> Option<EngramStatus> {
        Self::ALL.iter().copied().find(|s| *s as i32 == v)
    }
}

/// A failed call: its status and a message naming what was wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: EngramStatus,
    pub message: String,
}

impl Error {
    /// An error with `message`, its control characters escaped
    /// ([`escape_text`]): messages carry text from model files (key names,
    /// strings, paths), and no byte of a file reaches a log or a terminal as
    /// a control character.
    pub fn new(status: EngramStatus, message: impl Into<String>) -> Error {
        let message = message.into();
        let message = match escape_text(&message) {
            std::borrow::Cow::Borrowed(_) => message,
            std::borrow::Cow::Owned(e) => e,
        };
        Error { status, message }
    }
}

/// Whether `c` must not reach a message raw: C0 and C1 controls, DEL, and
/// the characters that move or reorder text on a terminal or in a log viewer
/// (line and paragraph separators, bidirectional marks, embeddings, overrides
/// and isolates).
fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{2028}' | '\u{2029}' | '\u{202A}'..='\u{202E}'
                | '\u{2066}'..='\u{2069}'
        )
}

/// `s` with every character [`must_escape`] names written as an escape:
/// `\t`, `\n`, `\r`, else `\u{XX}` (hex). Every other character, the
/// backslash included, is kept, so escaping twice changes nothing. The one
/// function the library and its tools use for text from a file that goes
/// into a message or onto a terminal (every [`Error::new`] applies it).
pub fn escape_text(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(must_escape) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut o = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '\t' => o.push_str("\\t"),
            '\n' => o.push_str("\\n"),
            '\r' => o.push_str("\\r"),
            c if must_escape(c) => {
                use std::fmt::Write;
                let _ = write!(o, "\\u{{{:x}}}", c as u32);
            }
            c => o.push(c),
        }
    }
    std::borrow::Cow::Owned(o)
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status.as_str(), self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// `return Err(Error::new(status, format!(...)))` in one line.
macro_rules! bail {
    ($status:ident, $($arg:tt)*) => {
        return Err($crate::error::Error::new(
            $crate::error::EngramStatus::$status,
            format!($($arg)*),
        ))
    };
}
pub(crate) use bail;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_once() {
        let raw = "key\r\x1b[2K  ok\u{202E}\u{85}\0\\t";
        let e = Error::new(EngramStatus::ErrFormat, raw);
        assert_eq!(e.message, "key\\r\\u{1b}[2K  ok\\u{202e}\\u{85}\\u{0}\\t");
        assert!(!e.message.chars().any(must_escape), "{}", e.message);
        // Escaping twice changes nothing; plain text is kept as it is.
        assert_eq!(escape_text(&e.message), e.message);
        assert!(matches!(
            escape_text("tensor blk.0 é"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
