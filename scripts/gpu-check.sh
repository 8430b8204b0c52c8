#!/usr/bin/env bash
# gpu-check.sh — run on the lent GPU machine (bare: no Rust, no internet), from the
# repository root, after scripts/build-gpu-check.sh filled .gpu/ here:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=330)
# REQUIRES glibc >= the floor in .gpu/glibc-floor (2.28: build-gpu-check.sh links the
# executables with cargo-zigbuild against glibc 2.28's symbol versions; 2.34 for a
# LOCKSTEP_GLIBC=host build on Debian 12). The log's first lines print that floor and
# this machine's `ldd --version | head -1`; an older glibc fails the check at once.
# It finds CUDA 13's NVRTC and NCCL in the site-packages of the machine's python3
# (PyTorch's wheels), makes the libnccl.so link cudarc needs (the wheels ship only
# libnccl.so.2), then runs, each section under `timeout` and counted PASS or FAIL:
#   1. the devices; the library's GPU tests (lib_tests: every layer type on the GPU
#      against the CPU, every op's kernels against its CPU code, the optimiser's, the
#      codec's, the buffers', the GPU exchanges' on both transports, every kernel compiled
#      with NVRTC); every CUDA test executable in .gpu/ (cuda_train, ...: whatever
#      tests/cuda_*.rs build-gpu-check.sh found; the oracle cases, data_parallel,
#      label_smoothing and model_inputs with their GPU variants). LOCKSTEP_REQUIRE_GPU=1 is set for all of
#      them: a test that would skip for want of a GPU fails instead.
#   2. the CPU all-reduce on the machine's cores (bench allreduce --devices cpu:4);
#   3. `lockstep train` (the default: convnet, digits, 15 epochs, seed 0) on cpu:1 and on
#      cuda:0 (1 logical replica each), compared step by step by scripts/compare_losses.py
#      (loss within 1e-3 scaled over the first 20 steps; why in its doc) and on the final
#      test accuracy (within 2 points);
#   4. the same on cpu:2 and cuda:0,0 (2 logical replicas each: the same BatchNorm shards
#      and dropout streams, so the same losses; the run also checks that both replicas are
#      bitwise identical every 100 steps and at the end);
#   5. `lockstep bench allreduce --devices cuda:0,0` beside the device-to-device copy
#      bandwidth PyTorch measures on the same GPU (a 1-member cuda:0 all-reduce moves
#      nothing, busbw = algbw · 2(n−1)/n = 0, so it is not run);
#   6. `lockstep bench step --model convnet --batch-size 256 --devices cuda:0` against
#      scripts/torch_convnet.py (PyTorch eager, same network and batch; also its
#      CUDA-graph figure, for information) and the ratio (target: ≥ 1.5× eager).
# A summary with every figure ends the log. Exit 0 when every section passed. A missed
# speed target is printed as MISSED and does not fail the check (timings are not
# correctness). The whole run keeps under GPU_CHECK_BUDGET_S (default 290 s): a section
# gets at most what is left, and one that cannot start in time counts as FAIL (not run).
# Output is copied to $OUT/gpu-check.log, and the runs' own logs to
# $OUT/gpu-check-logs.tar.gz, when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
log="${OUT:-/tmp}/gpu-check.log"
exec > >(tee "$log") 2>&1
tee_pid=$!
budget="${GPU_CHECK_BUDGET_S:-290}"
work="$(mktemp -d)"

# The CUDA 13 libraries of PyTorch's wheels: every lib/ folder under each `nvidia`
# package folder Python can see (site-packages, dist-packages, the user's site).
nvidia_dirs="$(python3 -c '
import site, os
dirs = site.getsitepackages() + [site.getusersitepackages()]
try:
    import nvidia
    dirs = list(nvidia.__path__) + [os.path.join(d, "nvidia") for d in dirs]
except ImportError:
    dirs = [os.path.join(d, "nvidia") for d in dirs]
seen = []
for d in dirs:
    if os.path.isdir(d) and d not in seen:
        seen.append(d)
print("\n".join(seen))' 2>/dev/null)"
libs=""
nccl=""
while IFS= read -r nv; do
    [[ -n "$nv" ]] || continue
    for d in "$nv"/*/lib; do
        [[ -d "$d" && ":$libs:" != *":$d:"* ]] && libs="$libs:$d"
    done
    for f in "$nv"/nccl/lib/libnccl.so.2 "$nv"/*/lib/libnccl.so.2; do
        [[ -z "$nccl" && -e $f ]] && nccl="$f"
    done
done <<<"$nvidia_dirs"
linkdir="$(mktemp -d)"
if [[ -n "$nccl" ]]; then
    ln -sf "$nccl" "$linkdir/libnccl.so"
fi
export LD_LIBRARY_PATH="$linkdir${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
# Here a GPU must be found: the one skip helper turns a skip for want of one into a failure.
export LOCKSTEP_REQUIRE_GPU=1

results=()  # one line per section: verdict, title, seconds
figures=()  # one line per figure
fails=0

# section [--stdout FILE] TITLE LIMIT_S CMD...: runs CMD under `timeout` (at most what is
# left of the budget), its stdout to FILE when given (else stdout and stderr to the log
# and to $work/last.out), and records PASS or FAIL. Returns CMD's exit status.
section() {
    local out=""
    if [[ $1 == --stdout ]]; then out="$2"; shift 2; fi
    local title="$1" limit="$2"; shift 2
    local left=$((budget - SECONDS)) t0=$SECONDS rc verdict
    echo
    echo "== $title"
    if ((left < 5)); then
        verdict="FAIL (not run: the ${budget}s budget is spent)"
        rc=125
    else
        ((limit > left)) && limit=$left
        if [[ -n $out ]]; then
            timeout -k 5 "$limit" "$@" >"$out"
            rc=$?
            echo "($(wc -l <"$out") lines of stdout in $(basename "$out"))"
        else
            timeout -k 5 "$limit" "$@" 2>&1 | tee "$work/last.out"
            rc=$?
        fi
        if ((rc == 124 || rc == 137)); then
            verdict="FAIL (timed out after ${limit}s)"
        elif ((rc != 0)); then
            verdict="FAIL (exit $rc)"
        else
            verdict=PASS
        fi
    fi
    record "$title" "$verdict" $((SECONDS - t0))
    return $rc
}

# record TITLE VERDICT SECONDS: counts a section (VERDICT is PASS or "FAIL (why)").
record() {
    [[ $2 == PASS ]] || fails=$((fails + 1))
    echo "-- $1: $2 ($3s)"
    local why="${2#PASS}"
    results+=("$(printf '%-4s %4ss  %s%s' "${2%% *}" "$3" "$1" "${why#FAIL}")")
}

figure() { figures+=("$(printf '%-44s %s' "$1" "$2")"); }

# py EXPR-PROGRAM ARGS...: a small python3 computation; prints n/a when it fails.
py() {
    local prog="$1"
    shift
    python3 -c "$prog" "$@" 2>/dev/null || echo n/a
}

# The last epoch of a `train --log-format json` log: "val_accuracy samples_per_sec".
last_epoch() {
    py '
import json, sys
e = [o for o in map(json.loads, (l for l in open(sys.argv[1]) if l.startswith("{"))) if o.get("kind") == "epoch"][-1]
print("%.4f %.0f" % (e["val_accuracy"], e["samples_per_sec"]))' "$1"
}

# The figures of a `bench allreduce` table (KIND cpu or gpu: the two tables have other
# columns) from scripts/bench_tables.py, whose parsers the bench code's unit tests run on
# the tables it really prints; n/a when it refuses the table.
#   cpu: "BYTES busbw_trainer busbw_classic | SMALL time_trainer_us time_classic_us"
#   gpu: "BYTES busbw copy_gbps busbw/copy | SMALL time_us"
allreduce_figures() {
    python3 scripts/bench_tables.py "$1" "$2" || echo n/a
}

# A key=value field of the first line of FILE that starts with TAG.
field() {
    py '
import re, sys
for l in open(sys.argv[1]):
    if l.split(" ", 1)[0] == sys.argv[2]:
        m = re.search(r"(?:^| )" + sys.argv[3] + r"=(\S+)", l)
        print(m.group(1) if m else "n/a")
        break
else:
    print("n/a")' "$1" "$2" "$3"
}

echo "== gpu-check $(date -u +%FT%TZ) on $(hostname), budget ${budget}s, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
# First: can the carried executables run here at all (glibc symbol versions)?
floor="$(cat .gpu/glibc-floor 2>/dev/null || echo unknown)"
here="$(ldd --version 2>&1 | head -1)"
echo "== glibc: .gpu/ needs >= $floor; this machine: $here"
here_version="$(grep -o '[0-9]\+\.[0-9]\+$' <<<"$here" || true)"
if [[ $floor != unknown && -n $here_version &&
    "$(printf '%s\n%s\n' "$floor" "$here_version" | sort -V | head -1)" != "$floor" ]]; then
    echo "== gpu-check: FAIL: glibc $here_version is older than the $floor the executables need;" \
        "rebuild them with LOCKSTEP_GLIBC=$here_version scripts/build-gpu-check.sh"
    exit 1
fi
echo "== nvidia-smi"
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv || true
echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# --- 1. devices, kernels, CUDA tests ----------------------------------------------------
section "lockstep devices" 30 .gpu/lockstep devices
# The library's tests of GPU code: every test whose path names a GPU or CUDA module (the
# host-run kernel checks among them, which need no GPU; the GPU exchanges', under
# exchange::gpu; every kernel file compiled by NVRTC, under cuda::nvrtc_tests). Its
# limit: 150 s for the ops', optimiser's, codec's and buffers' tests, 90 s for NVRTC's,
# 120 s for the GPU exchanges'.
section "the library's GPU tests: lib_tests" 360 .gpu/lib_tests --test-threads 1 gpu cuda
for t in .gpu/cuda_*; do
    [[ -x $t ]] || continue
    section "CUDA tests: $(basename "$t")" 120 "$t" --test-threads 1 --nocapture
done

if [[ -x .gpu/oracle_tests ]]; then
    # The PyTorch reference cases on cuda:0 and on two replicas sharing it.
    section "PyTorch reference cases on the GPU: oracle" 120 \
        env LOCKSTEP_ORACLE_DIR=.gpu/oracle .gpu/oracle_tests --test-threads 1 --nocapture gpu
fi

if [[ -x .gpu/data_parallel ]]; then
    # The data-parallel contract's equivalence tests, their GPU variants included.
    section "data-parallel contract on CPU devices and GPUs: data_parallel" 120 \
        .gpu/data_parallel --test-threads 2 --nocapture
fi

if [[ -x .gpu/label_smoothing ]]; then
    # Label smoothing against PyTorch (the loss kernel's eps) on CPU devices, cuda:0 and cuda:0,0.
    section "label smoothing against PyTorch on CPU devices and GPUs: label_smoothing" 120 \
        env LOCKSTEP_ORACLE_DIR=.gpu/oracle .gpu/label_smoothing --test-threads 1 --nocapture
fi

if [[ -x .gpu/model_inputs ]]; then
    # A model of two inputs on cuda:0 and cuda:0,0 against its one-input Split form there.
    section "a model of two inputs on a GPU: model_inputs" 60 \
        .gpu/model_inputs --test-threads 1 --nocapture gpu
fi

# --- 2. CPU all-reduce ------------------------------------------------------------------
if section "CPU all-reduce (bench allreduce --devices cpu:4)" 30 \
    .gpu/lockstep bench allreduce --devices cpu:4 --sizes 4K,256K,4M,64M --iters 50; then
    read -r bytes bus_t bus_c _ small t_t t_c <<<"$(allreduce_figures cpu "$work/last.out")"
    figure "cpu:4 all-reduce busbw at ${bytes:-?} B" "trainer ${bus_t:-n/a} GB/s, classic ${bus_c:-n/a} GB/s"
    figure "cpu:4 all-reduce time at ${small:-?} B" "trainer ${t_t:-n/a} us, classic ${t_c:-n/a} us"
fi

# --- 3 and 4. training on the GPU against the same run on CPU ----------------------------
# train_pair CPU_SPEC CUDA_SPEC: the default training on both, then the comparison.
train_pair() {
    local cpu="$1" gpu="$2" ok=1 cmp
    for spec in "$cpu" "$gpu"; do
        if section --stdout "$work/train-$spec.jsonl" "train convnet --devices $spec (JSON log)" 90 \
            .gpu/lockstep train --devices "$spec" --log-format json; then
            read -r acc sps <<<"$(last_epoch "$work/train-$spec.jsonl")"
            figure "train $spec: test accuracy, samples/s" "${acc:-n/a}, ${sps:-n/a} (last epoch)"
        else
            ok=0
        fi
    done
    if ((ok)); then
        section "per-step loss: $gpu vs $cpu (compare_losses.py)" 20 \
            python3 scripts/compare_losses.py "$work/train-$cpu.jsonl" "$work/train-$gpu.jsonl" --acc-tol 0.02
        cmp="$work/last.out"
        figure "loss dev. $gpu vs $cpu, steps 1..20" \
            "$(field "$cmp" compare_losses max_dev) at step $(field "$cmp" compare_losses at_step) (tol $(field "$cmp" compare_losses tol))"
        figure "loss dev. $gpu vs $cpu, every step" \
            "$(field "$cmp" compare_losses max_dev_all) at step $(field "$cmp" compare_losses at_step_all) of $(field "$cmp" compare_losses all_steps) (information)"
    else
        echo
        echo "== per-step loss: $gpu vs $cpu (compare_losses.py)"
        record "per-step loss: $gpu vs $cpu (compare_losses.py)" "FAIL (not run: a training run failed)" 0
    fi
}
train_pair cpu:1 cuda:0
train_pair cpu:2 cuda:0,0

# --- 5. all-reduce on the GPU -----------------------------------------------------------
busbw_gpu=n/a
if section "GPU all-reduce (bench allreduce --devices cuda:0,0)" 60 \
    .gpu/lockstep bench allreduce --devices cuda:0,0 --sizes 4K,256K,4M,64M --iters 50; then
    read -r bytes bus copy ratio _ small t <<<"$(allreduce_figures gpu "$work/last.out")"
    busbw_gpu="${bus:-n/a}"
    figure "cuda:0,0 all-reduce busbw at ${bytes:-?} B" "${bus:-n/a} GB/s (bench's own d2d copy ${copy:-n/a} GB/s, busbw/copy ${ratio:-n/a})"
    figure "cuda:0,0 all-reduce time at ${small:-?} B" "${t:-n/a} us"
fi
copy_bw=n/a
# Device-to-device copy of 64 MiB (the bench's largest size) through PyTorch: bytes / time,
# the way algbw counts (the copy reads and writes them: twice that crosses HBM).
if section "device-to-device copy bandwidth (PyTorch, 64 MiB)" 60 python3 -c '
import torch
n = 64 << 20
x = torch.empty(n, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(10):
    y.copy_(x)
ts = []
for _ in range(50):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) / 1e3)
t = sorted(ts)[len(ts) // 2]
print(f"d2d_copy bytes={n} median_us={t * 1e6:.1f} gb_per_s={n / t / 1e9:.1f}")'; then
    copy_bw="$(field "$work/last.out" d2d_copy gb_per_s)"
    figure "device-to-device copy, 64 MiB (PyTorch)" "$copy_bw GB/s (bytes/time; HBM traffic is twice that)"
fi
figure "cuda:0,0 busbw / d2d copy bandwidth" \
    "$(py 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.3g}")' "$busbw_gpu" "$copy_bw")"

# --- 6. training throughput against PyTorch --------------------------------------------
lk=n/a
if section "lockstep bench step --model convnet --batch-size 256 --devices cuda:0" 90 \
    .gpu/lockstep bench step --model convnet --batch-size 256 --devices cuda:0 --steps 200 --warmup 20; then
    lk="$(py '
import re, sys
m = re.search(r"^([0-9.]+) samples/s", open(sys.argv[1]).read(), re.M)
print(m.group(1))' "$work/last.out")"
fi
figure "lockstep convnet B=256 cuda:0" "$lk samples/s"
pt=n/a
pt_graph=n/a
if section "PyTorch eager, same convnet (scripts/torch_convnet.py --batch 256)" 120 \
    python3 scripts/torch_convnet.py --batch 256 --steps 200 --warmup 20 --device cuda:0 --cuda-graph; then
    pt="$(field "$work/last.out" torch_convnet samples_per_s)"
    pt_graph="$(field "$work/last.out" torch_convnet_cudagraph samples_per_s)"
fi
figure "PyTorch eager convnet B=256" "$pt samples/s"
figure "PyTorch CUDA graph convnet B=256" "$pt_graph samples/s (information)"
ratio="$(py 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.2f}x")' "$lk" "$pt")"
target="$(py 'import sys; print("MET" if float(sys.argv[1].rstrip("x")) >= 1.5 else "MISSED")' "$ratio")"
figure "lockstep / PyTorch eager (target >= 1.5x)" "$ratio $target"
figure "lockstep / PyTorch CUDA graph" "$(py 'import sys; print(f"{float(sys.argv[1]) / float(sys.argv[2]):.2f}x")' "$lk" "$pt_graph") (information)"

# --- summary ---------------------------------------------------------------------------
echo
echo "== summary ($SECONDS s of ${budget}s)"
printf '%s\n' "${results[@]}"
echo "-- figures"
printf '%s\n' "${figures[@]}"
if [[ -n ${OUT:-} ]]; then
    tar -C "$work" -czf "$OUT/gpu-check-logs.tar.gz" . 2>/dev/null
fi
status=$((fails > 0))
echo "== gpu-check: $([[ $status == 0 ]] && echo PASS || echo "FAIL ($fails section(s))")"
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null
exit $status
