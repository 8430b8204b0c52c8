#!/usr/bin/env python3
"""Tokens per second of PyTorch's F.scaled_dot_product_attention(q, k, v, is_causal=True),
forward and backward (the gradients of q, k and v), in float32 on 2 threads: the shapes
and the measure of src/ops/sdpa's `sdpa_timing` (N·T = 2048 tokens a pass, q, k, v
(N, H, T, D); the fastest of 20 passes after 3), so that the two tables compare.
Run: python3 scripts/torch_sdpa_bench.py
"""

import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
print("   T  H   D   N | torch sdpa tok/s")
for t in (64, 128, 256):
    for h, d in ((4, 32), (4, 64), (6, 32), (6, 64)):
        n = 2048 // t
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.rand(n, h, t, d, generator=g).mul_(2).sub_(1).requires_grad_(True) for _ in range(3))
        dy = torch.rand(n, h, t, d, generator=g).mul_(2).sub_(1)
        best = float("inf")
        for rep in range(23):
            t0 = time.perf_counter()
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(dy)
            q.grad = k.grad = v.grad = None
            if rep >= 3:
                best = min(best, time.perf_counter() - t0)
        print(f"{t:4} {h:2} {d:3} {n:3} | {n * t / best:16.0f}")
