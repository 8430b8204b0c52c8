#!/usr/bin/env python3
"""PyTorch's softmax over the last dimension (torch.nn.Softmax(dim=-1)) and its input
gradient, for src/ops/softmax's reference test.

x: (3, 5) and dy: (3, 5) by formulas the test writes too (every value exact in float32).
For each element: y and dx of float64 evaluation of the float32 inputs, rounded once to
float32, then torch's own float32 results. Prints the Rust table the test pastes.
Run: python3 scripts/torch_softmax.py
"""

import torch

x = [((i * 11 % 17) - 8) / 2 for i in range(15)]
dy = [((i * 5 % 9) - 4) / 8 for i in range(15)]


def run(dtype):
    xt = torch.tensor(x, dtype=dtype).reshape(3, 5).requires_grad_(True)
    y = torch.nn.Softmax(dim=-1)(xt)
    y.backward(torch.tensor(dy, dtype=dtype).reshape(3, 5))
    return y.detach().flatten().tolist(), xt.grad.flatten().tolist()


f = lambda v: repr(float(torch.tensor(float(v)).float()))
(y64, dx64), (y32, dx32) = run(torch.float64), run(torch.float32)
print(f"// torch {torch.__version__}")
for a, b, c, d in zip(y64, y32, dx64, dx32):
    print(f"        ({f(a)}, {f(b)}, {f(c)}, {f(d)}),")
