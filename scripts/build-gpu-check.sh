#!/usr/bin/env bash
# build-gpu-check.sh — run HERE (a machine with Rust): builds the release binary and the
# CUDA test executables and copies them into .gpu/ (git-ignored), which the device tool
# carries to the GPU machine, where scripts/gpu-check.sh runs them. Both machines are
# x86-64 Linux; the GPU machine has no Rust toolchain. The test executables are
# kernels_nvrtc, oracle (as oracle_tests, with the cases in .gpu/oracle), data_parallel
# (its equivalence tests take cuda:0 and cuda:0,0 where a GPU is present) and every tests/cuda_*.rs (cuda_ops, cuda_collectives, cuda_train, ...:
# a new one is picked up by its file name). The Python scripts gpu-check.sh runs
# (scripts/torch_convnet.py, scripts/compare_losses.py) travel with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu
mkdir -p .gpu
cargo build --release --bin lockstep
cp target/release/lockstep .gpu/
tests=(--test kernels_nvrtc --test oracle --test data_parallel)
shopt -s nullglob
for f in tests/cuda_*.rs; do
    tests+=(--test "$(basename "$f" .rs)")
done
shopt -u nullglob
# `cargo test --no-run --message-format=json` names every test executable it built.
# Compiler errors come inside the JSON: print them.
cargo test --release --no-run "${tests[@]}" --message-format=json |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-message" and m["message"].get("level") == "error":
        print(m["message"].get("rendered") or m["message"].get("message"), file=sys.stderr)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        name = "oracle_tests" if name == "oracle" else name  # .gpu/oracle holds the cases
        shutil.copy(m["executable"], ".gpu/" + name)
        print(".gpu/" + name)
'
# The PyTorch reference cases: ../shared does not travel to the GPU machine.
mkdir -p .gpu/oracle
cp -r ../shared/oracle/*_s0_* .gpu/oracle/
# Debug info would exceed what the device tool carries (64 MiB).
find .gpu -maxdepth 1 -type f -perm -u+x -exec strip {} +
ls -la .gpu
echo "total: $(du -sh .gpu | cut -f1) (the device tool carries at most 64 MiB, the working tree included)"
