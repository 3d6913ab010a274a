//! The committed header is what cbindgen generates from the current sources,
//! and its version macros equal Cargo.toml's version.

use std::ffi::CStr;

const GENERATED: &str = include_str!(concat!(env!("OUT_DIR"), "/engram.h"));
const COMMITTED: &str = include_str!("../include/engram.h");

#[test]
fn header_is_current() {
    assert!(
        GENERATED == COMMITTED,
        "include/engram.h differs from what cbindgen generates from src/ffi.rs; \
         regenerate with `ENGRAM_UPDATE_HEADER=1 cargo build` and commit it"
    );
}

fn define(name: &str) -> String {
    COMMITTED
        .lines()
        .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
        .unwrap_or_else(|| panic!("{name} not in the header"))
        .trim()
        .trim_matches('"')
        .to_string()
}

#[test]
fn version_macros_equal_the_crate_version() {
    assert_eq!(
        define("ENGRAM_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MAJOR")
    );
    assert_eq!(
        define("ENGRAM_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_MINOR")
    );
    assert_eq!(
        define("ENGRAM_VERSION_PATCH"),
        env!("CARGO_PKG_VERSION_PATCH")
    );
    assert_eq!(define("ENGRAM_VERSION_STRING"), env!("CARGO_PKG_VERSION"));
    // SAFETY: engram_version returns a static NUL-terminated string.
    let v = unsafe { CStr::from_ptr(engram::ffi::engram_version()) };
    assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn header_has_guard_and_cpp_linkage() {
    assert!(COMMITTED.contains("#ifndef ENGRAM_H") && COMMITTED.contains("#define ENGRAM_H"));
    assert!(COMMITTED.contains("extern \"C\" {"));
    for f in [
        "engram_create",
        "engram_hash",
        "engram_apply",
        "engram_free",
        "engram_version",
        "engram_last_error",
    ] {
        let declared = COMMITTED.lines().any(|l| {
            !l.starts_with(' ') && (l.contains(&format!(" {f}(")) || l.contains(&format!("*{f}(")))
        });
        assert!(declared, "{f} is not declared in the header");
    }
}
