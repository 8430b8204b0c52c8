#!/usr/bin/env python3
"""PyTorch's sigmoid (torch.nn.Sigmoid) and its gradient, for src/ops/sigmoid's reference test.

For each float32 x below: torch's own float32 result y and its gradient dx at dy = 1
(torch.autograd), and the float64 evaluation of the same float32 input rounded once to
float32. Prints the Rust table the test pastes. Run: python3 scripts/torch_sigmoid.py
"""

import torch

xs = [0.0, 1e-3, -1e-3, 0.1, -0.3, 0.5, -0.5, 0.6, 0.65, -0.7, 1.0, -1.0, 2.5, -2.5, 6.0, -6.0, 9.0, 12.0, -12.0, 20.0, -20.0, 40.0, -40.0, 87.0, -87.0, 95.0, -95.0]
print(f"// torch {torch.__version__}")
for x in xs:
    t32 = torch.tensor([x], dtype=torch.float32, requires_grad=True)
    y32 = torch.sigmoid(t32)
    y32.backward(torch.ones_like(y32))
    t64 = torch.tensor([x], dtype=torch.float32).double().requires_grad_(True)
    y64 = torch.sigmoid(t64)
    y64.backward(torch.ones_like(y64))
    f = lambda v: repr(float(torch.tensor(float(v)).float()))
    print(f"        ({f(x)}, {f(y32.item())}, {f(t32.grad.item())}, {f(y64.item())}, {f(t64.grad.item())}),")
