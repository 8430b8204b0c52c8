#!/usr/bin/env python3
"""PyTorch's split (torch.split(x, sizes, dim)[index], ATen's split_with_sizes and the
getitem of one part) and its input gradient, for src/ops/split's reference test.

x: (2, 3, 6) by a formula the test writes too (every value exact in float32), split along
the last axis into [1, 3, 2] and along the first axis of a sample (dim=1) into [2, 1]; for
each part alone, y and the gradient of a dy (shaped as the part, by a formula the test
writes too), in float32, exact (values move, none is computed). Prints the Rust tables the
test pastes. Run: python3 scripts/torch_split.py
"""

import torch

xs = [((i * 7 % 19) - 9) / 4 for i in range(36)]


def parts(sizes, dim):
    ys, dxs = [], []
    for index in range(len(sizes)):
        x = torch.tensor(xs, dtype=torch.float32).reshape(2, 3, 6).requires_grad_(True)
        y = torch.split(x, sizes, dim)[index]
        dy = torch.tensor([((j * 5 % 11) - 5) / 8 for j in range(y.numel())], dtype=torch.float32)
        y.backward(dy.reshape(y.shape))
        ys.append(y.detach().flatten().tolist())
        dxs.append(x.grad.flatten().tolist())
    return ys, dxs


def table(name, rows):
    print(f"        pub const {name}: &[&[f32]] = &[")
    for row in rows:
        v = [repr(float(a)) for a in row]
        print("            &[")
        for i in range(0, len(v), 12):
            print("                " + ", ".join(v[i : i + 12]) + ",")
        print("            ],")
    print("        ];")


print(f"        // made by torch {torch.__version__}")
last_y, last_dx = parts([1, 3, 2], -1)
first_y, first_dx = parts([2, 1], 1)
table("LAST_Y", last_y)
table("LAST_DX", last_dx)
table("FIRST_Y", first_y)
table("FIRST_DX", first_dx)
