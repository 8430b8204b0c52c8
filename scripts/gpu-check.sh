#!/usr/bin/env bash
# gpu-check.sh — run on the lent GPU machine (bare: no Rust, no internet), from the
# repository root, after scripts/build-gpu-check.sh filled .gpu/ here:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=300)
# It finds CUDA 13's NVRTC and NCCL in the site-packages of the machine's python3
# (PyTorch's wheels), makes the libnccl.so link cudarc needs (the wheels ship only
# libnccl.so.2), then: lists the devices, compiles every kernel with NVRTC for the GPU,
# and checks every kernel against the CPU reference (tests/cuda_ops.rs). Output is
# copied to $OUT/gpu-check.log when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu-check.log"
exec > >(tee "$log") 2>&1

site="$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)"
libs=""
for d in "$site"/nvidia/*/lib "$site"/nvidia/cu13/lib; do
    [[ -d "$d" ]] && libs="$libs:$d"
done
linkdir="$(mktemp -d)"
nccl="$(ls "$site"/nvidia/nccl/lib/libnccl.so.2 "$site"/nvidia/*/lib/libnccl.so.2 2>/dev/null | head -1)"
if [[ -n "$nccl" ]]; then
    ln -sf "$nccl" "$linkdir/libnccl.so"
fi
export LD_LIBRARY_PATH="$linkdir${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "== nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || true
echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
status=0
echo "== lockstep devices"; .gpu/lockstep devices || status=1
echo "== kernels compile (NVRTC)"; .gpu/kernels_nvrtc --test-threads 1 || status=1
echo "== kernels against the CPU reference"; .gpu/cuda_ops --test-threads 1 --nocapture || status=1
echo "== CPU all-reduce on the GPU machine's cores"
.gpu/lockstep bench allreduce --devices cpu:4 --sizes 4K,256K,4M,64M --iters 50 || status=1
echo "== gpu-check: $([[ $status == 0 ]] && echo PASS || echo FAIL)"
exit $status
