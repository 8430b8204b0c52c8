#!/usr/bin/env python3
"""PyTorch's nearest upsampling (torch.nn.Upsample(scale_factor=(2, 3), mode="nearest")) and
its input gradient, for src/ops/upsample's reference test.

x: (1, 1, 2, 3) and dy: (1, 1, 4, 9) by formulas the test writes too (every value exact in
float32, every sum of them too): y and dx in float32, exact (copies and sums of eighths),
so one table. Prints the Rust tables the test pastes. Run: python3 scripts/torch_upsample.py
"""

import torch

x = torch.tensor([((i * 5 % 7) - 3) / 4 for i in range(6)], dtype=torch.float32).reshape(1, 1, 2, 3)
x.requires_grad_(True)
y = torch.nn.Upsample(scale_factor=(2, 3), mode="nearest")(x)
dy = torch.tensor([((j * 7 % 13) - 6) / 8 for j in range(36)], dtype=torch.float32).reshape(y.shape)
y.backward(dy)
print(f"// torch {torch.__version__}")
for name, t in (("Y", y.detach()), ("DX", x.grad)):
    v = [repr(float(a)) for a in t.flatten().tolist()]
    print(f"    const {name}: &[f32] = &[")
    for i in range(0, len(v), 9):
        print("        " + ", ".join(v[i : i + 9]) + ",")
    print("    ];")
