#!/usr/bin/env bash
# install-nvrtc.sh — puts NVRTC (CUDA 13's run-time compiler, libnvrtc.so.13) in a cached
# folder and prints the directory holding the library as the LAST line of stdout.
#
# lockstep compiles kernels/ with NVRTC at run time; the NVRTC tests
# (src/cuda/nvrtc_tests.rs) need it even on machines without a GPU or driver. NVIDIA ships
# it as the pip wheel `nvidia-cuda-nvrtc` (13.x), whose files land in nvidia/cu13/lib/.
# Idempotent: a second run finds the library and installs nothing.
#
#   export LD_LIBRARY_PATH="$(scripts/install-nvrtc.sh | tail -1):$LD_LIBRARY_PATH"
#
# Env: LOCKSTEP_NVRTC_DIR (default $HOME/.cache/lockstep/nvrtc), PYTHON (default python3),
#      LOCKSTEP_NVRTC_SPEC (default 'nvidia-cuda-nvrtc>=13,<14': the newest 13.x).
# No pin to the driver's version is needed: lockstep compiles kernels/ to cubins for the
# GPU's own architecture (src/cuda/kernels.rs), and a cubin from any CUDA 13.x NVRTC loads
# on any CUDA 13 driver (CUDA's minor-version compatibility). Only PTX, which lockstep makes
# just for a GPU of a major version its NVRTC does not know, must not be newer than the
# driver. A second version goes in a second folder, e.g. for the kernel test against
# NVRTC 13.0 (.ci/run does this):
#   LOCKSTEP_NVRTC_SPEC='nvidia-cuda-nvrtc==13.0.*' LOCKSTEP_NVRTC_DIR=$HOME/.cache/lockstep/nvrtc-13.0 \
#       scripts/install-nvrtc.sh
set -euo pipefail

dir="${LOCKSTEP_NVRTC_DIR:-$HOME/.cache/lockstep/nvrtc}"
lib="$dir/nvidia/cu13/lib"
python="${PYTHON:-python3}"
spec="${LOCKSTEP_NVRTC_SPEC:-nvidia-cuda-nvrtc>=13,<14}"

if [[ ! -e "$lib/libnvrtc.so.13" ]]; then
    mkdir -p "$dir"
    # Pinned to the CUDA 13 major version cudarc is built for (feature cuda-13000).
    # pip's chatter goes to stderr so that stdout's last line is the directory.
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$dir" --upgrade "$spec" >&2
fi
if [[ ! -e "$lib/libnvrtc.so.13" ]]; then
    echo "install-nvrtc.sh: nvidia-cuda-nvrtc installed into $dir but $lib/libnvrtc.so.13 is missing" >&2
    exit 1
fi
echo "$lib"
