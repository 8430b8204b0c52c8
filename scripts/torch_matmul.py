#!/usr/bin/env python3
"""PyTorch's batched matrix product (ATen's matmul, `a @ b`; Keras's ops.matmul), its output
and both inputs' gradients, for src/ops/matmul's reference test.

The case: a (2, 2, 3, 4), b (2, 2, 4, 5) and dy (2, 2, 3, 5), a batch of 2 samples of 2
heads, by formulas the test writes too: multiples of 1/8, 1/4 and 1/16 with small
numerators, so that every product and sum is exact in float32 and the order of the sums
cannot show. Computed in float32 and in float64 (the script checks the two agree), then
printed: the Rust tables the test pastes, y, da, db, each flattened.
Run: python3 scripts/torch_matmul.py
"""

import torch

a0 = [((i * 37) % 23 - 11) / 8 for i in range(48)]
b0 = [((i * 29) % 19 - 9) / 4 for i in range(80)]
dy0 = [((i * 13) % 17 - 8) / 16 for i in range(60)]


def run(dtype):
    a = torch.tensor(a0, dtype=dtype).reshape(2, 2, 3, 4).requires_grad_(True)
    b = torch.tensor(b0, dtype=dtype).reshape(2, 2, 4, 5).requires_grad_(True)
    y = a @ b
    y.backward(torch.tensor(dy0, dtype=dtype).reshape(2, 2, 3, 5))
    return [t.detach().flatten() for t in (y, a.grad, b.grad)]


r32, r64 = run(torch.float32), run(torch.float64)
for t32, t64 in zip(r32, r64):
    assert torch.equal(t32.double(), t64), "float32 and float64 differ: not exact"
f = lambda t: ", ".join(repr(float(v)) for v in t)
print(f"// torch {torch.__version__}")
for name, t in zip(["y", "da", "db"], r32):
    print(f"    // {name}")
    print(f"        {f(t)},")
