#!/usr/bin/env bash
# build-gpu-check.sh — run HERE (a machine with Rust): builds the release binary and the
# CUDA test executables and copies them into .gpu/ (git-ignored), which the device tool
# carries to the GPU machine, where scripts/gpu-check.sh runs them. Both machines are
# x86-64 Linux; the GPU machine has no Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu
cargo build --release --bin lockstep
cp target/release/lockstep .gpu/
# `cargo test --no-run --message-format=json` names every test executable it built.
cargo test --release --no-run --test cuda_ops --test kernels_nvrtc --message-format=json 2>/dev/null |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".gpu/" + m["target"]["name"])
        print(".gpu/" + m["target"]["name"])
'
strip .gpu/* # debug info would exceed what the device tool carries (64 MiB)
ls -la .gpu
