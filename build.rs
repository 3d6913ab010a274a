//! Generates the C header from `src/ffi.rs` with cbindgen.
//!
//! The header is written to `$OUT_DIR/engram.h` on every build; the committed
//! `include/engram.h` is rewritten only when `ENGRAM_UPDATE_HEADER=1` is set (or
//! when it does not exist yet). The test `header_is_current` fails when the two
//! differ, so a change to the ABI that is not committed in the header is caught.

use std::env;
use std::path::PathBuf;

fn main() {
    let crate_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    // Any source file can add or change an exported item.
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rerun-if-env-changed=ENGRAM_UPDATE_HEADER");

    let version = env::var("CARGO_PKG_VERSION").unwrap();
    let major = env::var("CARGO_PKG_VERSION_MAJOR").unwrap();
    let minor = env::var("CARGO_PKG_VERSION_MINOR").unwrap();
    let patch = env::var("CARGO_PKG_VERSION_PATCH").unwrap();
    let mut config =
        cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    config.after_includes = Some(format!(
        "\n#define ENGRAM_VERSION_MAJOR {major}\n#define ENGRAM_VERSION_MINOR {minor}\n#define ENGRAM_VERSION_PATCH {patch}\n#define ENGRAM_VERSION_STRING \"{version}\"\n"
    ));
    let generated = out_dir.join("engram.h");
    match cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
    {
        Ok(b) => {
            b.write_to_file(&generated);
        }
        Err(e) => panic!("cbindgen failed: {e}"),
    }
    let committed = crate_dir.join("include").join("engram.h");
    if env::var("ENGRAM_UPDATE_HEADER").is_ok_and(|v| v == "1") || !committed.exists() {
        std::fs::create_dir_all(crate_dir.join("include")).unwrap();
        std::fs::copy(&generated, &committed).unwrap();
    }
}
