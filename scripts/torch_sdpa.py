#!/usr/bin/env python3
"""PyTorch's F.scaled_dot_product_attention(q, k, v, is_causal, scale), its output and the
gradients of q, k and v, for src/ops/sdpa's reference test.

The case: q, k, v and dy (1, H 2, T 4, D 3) by formulas the test writes too, every value
exact in float32. Two runs: not causal at the default scale 1/sqrt(D); causal at scale
0.3. For each element: (y, dq, dk, dv), each as float64 evaluation of the float32 inputs
rounded once to float32, then torch's own float32 (the gradients are those of
sum(y * dy)). Prints the Rust tables the test pastes.
Run: python3 scripts/torch_sdpa.py
"""

import torch
import torch.nn.functional as F

H, T, D = 2, 4, 3
n = H * T * D
q = [((i * 37 % 23) - 11) / 8 for i in range(n)]
k = [((i * 29 % 19) - 9) / 8 for i in range(n)]
v = [((i * 13 % 17) - 8) / 4 for i in range(n)]
dy = [((i * 11 % 13) - 6) / 8 for i in range(n)]


def run(dtype, causal, scale):
    ts = [torch.tensor(a, dtype=dtype).reshape(1, H, T, D).requires_grad_(True) for a in (q, k, v)]
    y = F.scaled_dot_product_attention(*ts, is_causal=causal, scale=scale)
    y.backward(torch.tensor(dy, dtype=dtype).reshape(1, H, T, D))
    return [y.detach().flatten().tolist()] + [t.grad.flatten().tolist() for t in ts]


f = lambda v: repr(float(torch.tensor(float(v)).float()))
print(f"// torch {torch.__version__}")
for causal, scale in [(False, None), (True, 0.3)]:
    exact, torch32 = run(torch.float64, causal, scale), run(torch.float32, causal, scale)
    print(f"    // causal {causal}, scale {scale}: (y, torch_y, dq, torch_dq, dk, torch_dk, dv, torch_dv)")
    for i in range(n):
        row = ", ".join(f"{f(exact[j][i])}, {f(torch32[j][i])}" for j in range(4))
        print(f"        [{row}],")
