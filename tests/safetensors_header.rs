//! The safetensors header reader on hostile headers: a header that is not
//! UTF-8 anywhere (issue 34's regression: bytes the streaming parse skipped
//! were never checked), and the refusals the short form of the reader keeps.

use engram::safetensors::parse_header_bytes;
use engram::EngramStatus;

/// A safetensors file's first bytes for header `json`, followed by `data`
/// bytes of data; its total length.
fn file(json: &[u8], data: u64) -> (Vec<u8>, u64) {
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(json);
    let len = v.len() as u64 + data;
    (v, len)
}

fn parse(json: &[u8], data: u64) -> engram::Result<usize> {
    let (b, len) = file(json, data);
    parse_header_bytes(&b, len, "t.safetensors").map(|h| h.tensors.len())
}

const GOOD: &str =
    r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;

#[test]
fn a_header_that_is_not_utf8_is_refused_wherever_the_bytes_are() {
    assert_eq!(parse(GOOD.as_bytes(), 16).unwrap(), 1);
    // 0xff never occurs in UTF-8; 0xc3 alone is a cut sequence.
    for bad in [b"\xff".as_slice(), b"\xc3", b"\xed\xa0\x80"] {
        for (at, what) in [
            ("\"pt\"", "a metadata value"),
            ("\"format\"", "a metadata key"),
            ("\"a\":", "a tensor name"),
            ("\"F32\"", "a dtype"),
        ] {
            let i = GOOD.find(at).unwrap() + 2;
            let mut json = GOOD.as_bytes().to_vec();
            json.splice(i..i, bad.iter().copied());
            let e = parse(&json, 16)
                .err()
                .unwrap_or_else(|| panic!("{what} holding {bad:x?} was accepted"));
            assert_eq!(e.status, EngramStatus::ErrFormat, "{what}: {}", e.message);
            assert!(e.message.contains("UTF-8"), "{what}: {}", e.message);
            assert!(e.message.contains("t.safetensors"), "{what}: {}", e.message);
        }
    }
}

#[test]
fn hostile_entries_are_refused_with_the_tensor_named() {
    let cases: &[(&str, &str)] = &[
        (r#"[1,2]"#, "not a JSON object"),
        (r#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#, "no dtype"),
        (r#"{"a":{"dtype":"F32","data_offsets":[0,4]}}"#, "no shape"),
        (
            r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            "no shape",
        ),
        (r#"{"a":{"dtype":"F32","shape":[1]}}"#, "no data_offsets"),
        (
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            "begin <= end",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}}"#,
            "begin <= end",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,32]}}"#,
            "run past",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
            "hold 4",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#,
            "overflows",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#,
            "not valid JSON",
        ),
        (
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x"#,
            "not valid JSON",
        ),
    ];
    for (json, word) in cases {
        let e = parse(json.as_bytes(), 16)
            .err()
            .unwrap_or_else(|| panic!("{json} was accepted"));
        assert_eq!(e.status, EngramStatus::ErrFormat, "{json}: {}", e.message);
        assert!(
            e.message.contains(word),
            "{json}: no {word:?} in {}",
            e.message
        );
        if word != &"not a JSON object" && word != &"not valid JSON" {
            assert!(e.message.contains("tensor a"), "{json}: {}", e.message);
        }
    }
    // Unknown dtypes and unknown keys are kept and skipped as before.
    let ok = r#"{"a":{"dtype":"X9","shape":[3],"data_offsets":[0,5],"extra":[{"k":1}]},"b":{"dtype":"U8","shape":[],"data_offsets":[5,6]}}"#;
    assert_eq!(parse(ok.as_bytes(), 16).unwrap(), 2);
    // A header length past the file.
    let (mut b, len) = file(GOOD.as_bytes(), 16);
    b[..8].copy_from_slice(&(len).to_le_bytes());
    let e = parse_header_bytes(&b, len, "t.safetensors").unwrap_err();
    assert_eq!(e.status, EngramStatus::ErrFormat, "{}", e.message);
}
