#!/usr/bin/env python3
"""PyTorch's view (torch.Tensor.view, ATen's view / reshape) and its input gradient, for
src/ops/reshape's reference test: Keras's Reshape((4, -1)) on samples (3, 4).

x: (2, 3, 4) and dy: (2, 4, 3) by formulas the test writes too (every value exact in
float32): y = x.view(2, 4, -1) and dx, in float32, exact (the values do not change), so one
table each. Prints the Rust tables the test pastes. Run: python3 scripts/torch_reshape.py
"""

import torch

x = torch.tensor([((i * 7 % 19) - 9) / 4 for i in range(24)], dtype=torch.float32).reshape(2, 3, 4)
x.requires_grad_(True)
y = x.view(2, 4, -1)
dy = torch.tensor([((j * 5 % 9) - 4) / 8 for j in range(24)], dtype=torch.float32).reshape(y.shape)
y.backward(dy)
print(f"// made by torch {torch.__version__}")
for name, t in (("Y", y.detach()), ("DX", x.grad)):
    v = [repr(float(a)) for a in t.flatten().tolist()]
    print(f"    pub const {name}: &[f32] = &[")
    for i in range(0, len(v), 12):
        print("        " + ", ".join(v[i : i + 12]) + ",")
    print("    ];")
