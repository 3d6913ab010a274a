#!/usr/bin/env bash
# Every test: formatting, the Rust tests (golden, properties, header freshness,
# unit tests), the C ABI tests under AddressSanitizer, and the demo.
# Needs only what a fresh machine of this project has: cargo, gcc/g++.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo test"
mkdir -p target
cargo test --all-targets 2>&1 | tee target/cargo-test.log
# `cargo test` prints one 'test result' line per test binary; fail loudly if none ran.
grep -q "test result: ok" target/cargo-test.log

echo "== C ABI tests (C and C++, AddressSanitizer + UBSan)"
bash c_tests/run.sh

echo "== demo"
cargo run --quiet --example demo > target/demo.log
tail -n 3 target/demo.log
