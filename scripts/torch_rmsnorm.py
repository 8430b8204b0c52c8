#!/usr/bin/env python3
"""PyTorch's RMSNorm (torch.nn.RMSNorm, Llama's), its input and weight gradients, for
src/ops/rmsnorm's reference test.

The case: x (2, 2, 5), weight (5) and dy (2, 2, 5) by formulas the test writes too, every
value exact in float32; eps 1e-5. For each element: y and dx of float64 evaluation of the
float32 inputs, rounded once to float32, then torch's own float32 results; then for each
of the 5 weights: dweight, float64 then float32. Prints the Rust tables the test pastes.
Run: python3 scripts/torch_rmsnorm.py
"""

import torch

N, T, C, EPS = 2, 2, 5, 1e-5
x = [((i * 37 % 23) - 11) / 8 for i in range(N * T * C)]
w = [0.5 + j / 4 for j in range(C)]
dy = [((i * 13 % 17) - 8) / 16 for i in range(N * T * C)]


def run(dtype):
    xt = torch.tensor(x, dtype=dtype).reshape(N, T, C).requires_grad_(True)
    norm = torch.nn.RMSNorm(C, eps=EPS, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor(w, dtype=dtype))
    y = norm(xt)
    y.backward(torch.tensor(dy, dtype=dtype).reshape(N, T, C))
    return y.detach().flatten().tolist(), xt.grad.flatten().tolist(), norm.weight.grad.tolist()


f = lambda v: repr(float(torch.tensor(float(v)).float()))
(y64, dx64, dw64), (y32, dx32, dw32) = run(torch.float64), run(torch.float32)
print(f"// torch {torch.__version__}")
print("    // (y, torch_y, dx, torch_dx) per element")
for a, b, c, d in zip(y64, y32, dx64, dx32):
    print(f"        ({f(a)}, {f(b)}, {f(c)}, {f(d)}),")
print("    // (dweight, torch_dweight) per weight")
for a, b in zip(dw64, dw32):
    print(f"        ({f(a)}, {f(b)}),")
