#!/usr/bin/env python3
"""PyTorch's permute (torch.Tensor.permute, then .contiguous()) and its input gradient, for
src/ops/permute's reference test: Keras's Permute((3, 1, 2)), which is x.permute(0, 3, 1, 2),
and Permute((1, 3, 2)), which is x.transpose(2, 3), on samples (2, 3, 4).

x: (2, 2, 3, 4) and dy (shaped as each output) by formulas the test writes too (every value
exact in float32): y and dx in float32, exact (values move, none is computed). Prints the
Rust tables the test pastes. Run: python3 scripts/torch_permute.py
"""

import torch

xs = [((i * 7 % 23) - 11) / 4 for i in range(48)]
dys = [((j * 5 % 17) - 8) / 8 for j in range(48)]


def case(move):
    x = torch.tensor(xs, dtype=torch.float32).reshape(2, 2, 3, 4).requires_grad_(True)
    y = move(x).contiguous()
    y.backward(torch.tensor(dys, dtype=torch.float32).reshape(y.shape))
    return y.detach(), x.grad


print(f"        // made by torch {torch.__version__}")
y, dx = case(lambda x: x.permute(0, 3, 1, 2))
yt, dxt = case(lambda x: x.transpose(2, 3))
for name, t in (("Y", y), ("DX", dx), ("Y_T", yt), ("DX_T", dxt)):
    v = [repr(float(a)) for a in t.flatten().tolist()]
    print(f"        pub const {name}: &[f32] = &[")
    for i in range(0, len(v), 12):
        print("            " + ", ".join(v[i : i + 12]) + ",")
    print("        ];")
