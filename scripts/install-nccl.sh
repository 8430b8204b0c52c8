#!/usr/bin/env bash
# install-nccl.sh — puts NCCL (libnccl.so.2, from the pip wheel nvidia-nccl-cu13) in a
# cached folder, links it as libnccl.so (the one name cudarc loads; src/cuda/probe.rs says
# why) and prints the directory holding the link as the LAST line of stdout.
#
# Making an NCCL clique's rendezvous id needs only the library, no GPU: a test of the
# library (src/exchange/gpu/tests.rs, with the mpi feature) has process 0 of an MPI world
# make one and broadcast it (what a run across processes' GPUs does), and skips, saying so,
# where NCCL does not load. Idempotent.
#
#   export LD_LIBRARY_PATH="$(scripts/install-nccl.sh | tail -1):$LD_LIBRARY_PATH"
#
# Env: LOCKSTEP_NCCL_WHEEL_DIR (default $HOME/.cache/lockstep/nccl-wheel),
#      LOCKSTEP_NCCL_LINK_DIR (default $HOME/.cache/lockstep/nccl), PYTHON (default python3).
set -euo pipefail

wheel="${LOCKSTEP_NCCL_WHEEL_DIR:-$HOME/.cache/lockstep/nccl-wheel}"
link_dir="${LOCKSTEP_NCCL_LINK_DIR:-$HOME/.cache/lockstep/nccl}"
python="${PYTHON:-python3}"
lib="$wheel/nvidia/nccl/lib/libnccl.so.2"

if [[ ! -e "$lib" ]]; then
    mkdir -p "$wheel"
    # pip's chatter goes to stderr so that stdout's last line is the directory.
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$wheel" --upgrade 'nvidia-nccl-cu13' >&2
fi
if [[ ! -e "$lib" ]]; then
    echo "install-nccl.sh: nvidia-nccl-cu13 installed into $wheel but $lib is missing" >&2
    exit 1
fi
mkdir -p "$link_dir"
ln -sf "$lib" "$link_dir/libnccl.so"
echo "$link_dir"
