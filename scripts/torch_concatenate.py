#!/usr/bin/env python3
"""PyTorch's concatenation of two batches of images along their channels (ATen's cat,
torch.cat(xs, dim=1): Keras's Concatenate(axis=1) on channels-first images), its output and
each input's gradient, for src/ops/concatenate's reference test.

The case: a (2, 1, 2, 2) = 0, 1, ..., b (2, 2, 2, 2) = 100, 101, ..., and dy (2, 3, 2, 2) by
the formula the test writes too. Prints the Rust tables the test pastes: y, da, db, each
flattened (copies: every value exact).
Run: python3 scripts/torch_concatenate.py
"""

import torch

a = torch.arange(8, dtype=torch.float32).reshape(2, 1, 2, 2).requires_grad_(True)
b = (100 + torch.arange(16, dtype=torch.float32)).reshape(2, 2, 2, 2).requires_grad_(True)
dy = torch.tensor([((i * 13) % 17 - 8) / 16 for i in range(24)], dtype=torch.float32).reshape(2, 3, 2, 2)
y = torch.cat([a, b], dim=1)
y.backward(dy)
f = lambda t: ", ".join(repr(float(v)) for v in t.detach().flatten())
print(f"// torch {torch.__version__}")
for name, t in [("y", y), ("da", a.grad), ("db", b.grad)]:
    print(f"    // {name}")
    print(f"        {f(t)},")
