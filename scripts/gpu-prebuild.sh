#!/usr/bin/env bash
# Build, on a machine with cargo and the crates (no GPU needed), everything
# scripts/gpu-check.sh runs on a GPU machine, into one small folder:
#
#   target/gpu-bundle/
#     cuda_golden      the GPU tests (tests/cuda_golden.rs), release
#     cuda_nvrtc       the NVRTC compile test (tests/cuda_nvrtc.rs), release
#     cuda_formats     every row format on the GPU (tests/cuda_formats.rs), release
#     fp8_split        the split fp8 table format, its GPU test included (tests/fp8_split.rs)
#     gpu_bench        the benchmark (benches/gpu.rs), release
#     libengram.so     the library, for the C ABI test on CUDA
#     ROOT             the source path compiled into the binaries (they read
#                      tests/golden/data and bench/gpu_peer.py from there)
#
# Debug info is stripped so the bundle stays well under 64 MiB. A GPU machine
# without network (or without cargo) runs these as they are; one with cargo
# and the crates rebuilds instead (scripts/gpu-check.sh decides).
#
# Usage: bash scripts/gpu-prebuild.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
B=target/gpu-bundle
rm -rf "$B"
mkdir -p "$B"

exe_of() { # the test/bench executable cargo built, from its JSON messages
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$1"
}

echo "== cargo build --release --lib"
cargo build --release --lib
cp target/release/libengram.so "$B/"
for t in cuda_golden cuda_nvrtc cuda_formats fp8_split; do
    echo "== cargo test --release --test $t --no-run"
    exe="$(cargo test --release --test "$t" --no-run --message-format=json 2>/dev/null | exe_of "$t")"
    cp "$exe" "$B/$t"
done
echo "== cargo bench --bench gpu --no-run"
exe="$(cargo bench --bench gpu --no-run --message-format=json 2>/dev/null | exe_of gpu)"
cp "$exe" "$B/gpu_bench"
for f in "$B"/cuda_golden "$B"/cuda_nvrtc "$B"/cuda_formats "$B"/fp8_split "$B"/gpu_bench "$B"/libengram.so; do
    strip --strip-debug "$f"
done
echo "$ROOT" >"$B/ROOT"
git rev-parse HEAD >"$B/COMMIT" 2>/dev/null || true
ls -la "$B"
du -sh "$B"
