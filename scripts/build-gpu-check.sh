#!/usr/bin/env bash
# build-gpu-check.sh — run HERE (a machine with Rust): builds the release binary and the
# CUDA test executables and copies them into .gpu/ (git-ignored), which the device tool
# carries to the GPU machine, where scripts/gpu-check.sh runs them. Both machines are
# x86-64 Linux; the GPU machine has no Rust toolchain. The test executables are the
# library's own tests (as lib_tests: the conformance test's GPU half, every op's GPU
# tests beside its code, the optimiser's, the codec's and the buffers', the GPU exchanges',
# the NVRTC tests), oracle (as oracle_tests, with the cases in .gpu/oracle), data_parallel
# (its equivalence tests take cuda:0 and cuda:0,0 where a GPU is present), label_smoothing
# (its PyTorch training cases likewise, reading .gpu/oracle too), model_inputs (a model of
# two inputs on cuda:0 against its Split form) and every tests/cuda_*.rs
# (cuda_train, ...: a new one is picked up by its file name). The Python scripts
# gpu-check.sh runs (scripts/torch_convnet.py, scripts/compare_losses.py,
# scripts/bench_tables.py) travel with the working tree.
#
# glibc: a binary linked here asks for the symbol versions of THIS machine's glibc (2.36
# on Debian 12; the plain build needs GLIBC_2.34), so it would not start on an older GPU
# machine. The executables are therefore linked by cargo-zigbuild (zig as the linker and
# C compiler, against the symbol versions of glibc 2.28, the manylinux_2_28 floor of
# PyTorch's wheels: target x86_64-unknown-linux-gnu.2.28), and run on any glibc >= 2.28.
# The floor actually reached (the newest GLIBC_x.y any of them needs, read back with
# objdump -T) goes to .gpu/glibc-floor, which gpu-check.sh prints first; the build fails if
# it is above the target. cargo-zigbuild (`cargo install`) and zig (the `ziglang` wheel)
# are installed into caches on first use, pinned to the versions this was tried with.
# None of this touches the normal `cargo build` / `cargo test` (another target folder).
#   LOCKSTEP_GLIBC=host  link against this machine's glibc instead (no zig needed)
#   LOCKSTEP_ZIG_DIR     where the ziglang wheel goes (default $HOME/.cache/lockstep/ziglang)
set -euo pipefail
cd "$(dirname "$0")/.."

glibc="${LOCKSTEP_GLIBC:-2.28}"
zigbuild_version=0.24.1
ziglang_version=0.17.1
if [[ $glibc == host ]]; then
    build=(cargo build)
    test=(cargo test)
    target_args=()
    target_dir=target/release
else
    zig_dir="${LOCKSTEP_ZIG_DIR:-$HOME/.cache/lockstep/ziglang}"
    export PYTHONPATH="$zig_dir${PYTHONPATH:+:$PYTHONPATH}"
    if ! command -v cargo-zigbuild >/dev/null; then
        echo "build-gpu-check.sh: installing cargo-zigbuild $zigbuild_version (once)" >&2
        cargo install --locked "cargo-zigbuild@$zigbuild_version" >&2
    fi
    # cargo-zigbuild runs `zig` from PATH, else `python3 -m ziglang`.
    if ! command -v zig >/dev/null && ! python3 -m ziglang version >/dev/null 2>&1; then
        echo "build-gpu-check.sh: installing zig (ziglang $ziglang_version) into $zig_dir (once)" >&2
        python3 -m pip install --quiet --disable-pip-version-check --target "$zig_dir" "ziglang==$ziglang_version" >&2
    fi
    build=(cargo-zigbuild zigbuild)
    test=(cargo-zigbuild test)
    target_args=(--target "x86_64-unknown-linux-gnu.$glibc")
    target_dir=target/x86_64-unknown-linux-gnu/release
fi

rm -rf .gpu
mkdir -p .gpu
"${build[@]}" --release "${target_args[@]}" --bin lockstep
cp "$target_dir/lockstep" .gpu/
tests=(--lib --test oracle --test data_parallel --test label_smoothing --test model_inputs)
shopt -s nullglob
for f in tests/cuda_*.rs; do
    tests+=(--test "$(basename "$f" .rs)")
done
shopt -u nullglob
# `cargo test --no-run --message-format=json` names every test executable it built.
# Compiler errors come inside the JSON: print them.
"${test[@]}" --release "${target_args[@]}" --no-run "${tests[@]}" --message-format=json |
    python3 -c '
import json, shutil, sys
for line in sys.stdin:
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") == "compiler-message" and m["message"].get("level") == "error":
        print(m["message"].get("rendered") or m["message"].get("message"), file=sys.stderr)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"]
        name = "oracle_tests" if name == "oracle" else name  # .gpu/oracle holds the cases
        name = "lib_tests" if m["target"]["kind"] == ["lib"] else name
        shutil.copy(m["executable"], ".gpu/" + name)
        print(".gpu/" + name)
'
# The PyTorch reference cases: ../shared does not travel to the GPU machine.
mkdir -p .gpu/oracle
cp -r ../shared/oracle/*_s0_* .gpu/oracle/
# Debug info would exceed what the device tool carries (64 MiB).
find .gpu -maxdepth 1 -type f -perm -u+x -exec strip {} +
# The glibc the executables need: the newest GLIBC_ symbol version any of them asks for.
floor="$(find .gpu -maxdepth 1 -type f -perm -u+x -exec objdump -T {} + |
    grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -1)"
echo "$floor" >.gpu/glibc-floor
echo "glibc: the executables in .gpu/ need glibc >= $floor"
if [[ $glibc != host && "$(printf '%s\n%s\n' "$floor" "$glibc" | sort -V | tail -1)" != "$glibc" ]]; then
    echo "build-gpu-check.sh: linked for glibc $glibc but they need $floor" >&2
    exit 1
fi
ls -la .gpu
echo "total: $(du -sh .gpu | cut -f1) (the device tool carries at most 64 MiB, the working tree included)"
