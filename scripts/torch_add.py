#!/usr/bin/env python3
"""PyTorch's sum of three tensors (ATen's add.Tensor, Keras's Add), its output and each
input's gradient, for src/ops/add's reference test.

The case: x0, x1, x2 (2, 3) by formulas the test writes too (x0[0] = 1e8 and x1[0] = -1e8,
so that the order of the sum shows: left to right, x2[0] survives), dy (2, 3) likewise.
y = x0 + x1 + x2 in float32, as PyTorch rounds it (left to right); each input's gradient.
Prints the Rust table the test pastes: per element (y, dx0, dx1, dx2).
Run: python3 scripts/torch_add.py
"""

import torch

N, C = 2, 3


def xs(k):
    v = [((i * 37 + k * 11) % 23 - 11) / 7 for i in range(N * C)]
    v[0] = [1e8, -1e8, 0.375][k]
    return v


dy = [((i * 13) % 17 - 8) / 16 for i in range(N * C)]
x = [torch.tensor(xs(k), dtype=torch.float32).reshape(N, C).requires_grad_(True) for k in range(3)]
y = x[0] + x[1] + x[2]
y.backward(torch.tensor(dy, dtype=torch.float32).reshape(N, C))
f = lambda v: repr(float(v))
print(f"// torch {torch.__version__}")
print("    // (y, dx0, dx1, dx2) per element")
for e in range(N * C):
    row = [y.detach().flatten()[e]] + [x[k].grad.flatten()[e] for k in range(3)]
    print(f"        ({', '.join(f(v) for v in row)}),")
