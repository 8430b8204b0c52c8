#!/usr/bin/env python3
"""PyTorch's permute, `x.permute(0, *dims).contiguous()`, forward and backward, timed for
src/ops/permute's speed comparison: the same shapes as that module's timing test
(`cargo test --release --lib ops::permute -- --ignored --nocapture`), on the same threads.
For each: the minimum and the median over 200 repetitions (after 20 untimed) of a forward
and a backward (y.backward(dy): the gradient moved back by the inverse permutation), in µs.

    python3 scripts/torch_permute_bench.py --threads 2
"""

import argparse
import time

import torch

# (what, per-sample shape with the batch first, Keras's 1-based dims)
CASES = [
    ("attention heads (T, H, D) -> (H, T, D)", (12, 64, 4, 32), (2, 1, 3)),
    ("attention heads, larger", (12, 256, 8, 64), (2, 1, 3)),
    ("last two axes (T, C) -> (C, T)", (12, 64, 128), (2, 1)),
    ("last two axes of (H, T, D)", (12, 8, 256, 64), (1, 3, 2)),
    ("channels last (C, H, W) -> (H, W, C)", (64, 32, 28, 28), (2, 3, 1)),
]

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--reps", type=int, default=200)
a = p.parse_args()
torch.set_num_threads(a.threads)
print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
for what, shape, dims in CASES:
    x = torch.randn(shape, requires_grad=True)
    perm = (0, *dims)
    dy = torch.randn(tuple(shape[p] for p in perm))
    times = []
    for rep in range(a.reps + 20):
        x.grad = None
        t = time.perf_counter()
        y = x.permute(*perm).contiguous()
        y.backward(dy)
        t = time.perf_counter() - t
        if rep >= 20:
            times.append(t * 1e6)
    times.sort()
    print(f"{what:<40} {str(shape):<20} min {times[0]:9.1f} µs, median {times[len(times) // 2]:9.1f} µs")
