#!/usr/bin/env python3
"""PyTorch's average pooling (torch.nn.AvgPool2d) and its input gradient, for
src/ops/avgpool2d's reference test.

x: (1, 1, 5, 4) and, per case, dy by formulas the test writes too (every value exact in
float32). Three cases, each as the layer's spec writes it:
  "pad": pool 3, strides 2, padding [1, 1]  = AvgPool2d(3, 2, padding=1), count_include_pad=True
  "valid": pool [2, 3], strides [2, 1]      = AvgPool2d((2, 3), (2, 1))
  "same": pool 3, strides [2, 1], "same"    = AvgPool2d(3, (2, 1), padding=1,
          count_include_pad=False) (Keras's same pads 1 / 1 here: 5 rows at stride 2, 4
          columns at stride 1, a 3x3 pool; padded positions not counted, as Keras's)
For each: y and dx of float64 evaluation of the float32 inputs, rounded once to float32,
then torch's own float32 results. Prints the Rust tables the test pastes.
Run: python3 scripts/torch_avgpool2d.py
"""

import torch

x = [((i * 7 % 11) - 5) / 4 for i in range(20)]
cases = [
    ("PAD", dict(kernel_size=3, stride=2, padding=1)),
    ("VALID", dict(kernel_size=(2, 3), stride=(2, 1))),
    ("SAME", dict(kernel_size=3, stride=(2, 1), padding=1, count_include_pad=False)),
]


def run(args, dtype):
    xt = torch.tensor(x, dtype=dtype).reshape(1, 1, 5, 4).requires_grad_(True)
    y = torch.nn.AvgPool2d(**args)(xt)
    dy = [((j * 5 % 7) - 3) / 8 for j in range(y.numel())]
    y.backward(torch.tensor(dy, dtype=dtype).reshape(y.shape))
    return y.detach().flatten().tolist(), xt.grad.flatten().tolist()


f = lambda v: repr(float(torch.tensor(float(v)).float()))
print(f"// torch {torch.__version__}")
for name, args in cases:
    (y64, dx64), (y32, dx32) = run(args, torch.float64), run(args, torch.float32)
    for part, pairs in (("Y", zip(y64, y32)), ("DX", zip(dx64, dx32))):
        items = [f"({f(a)}, {f(b)})" for a, b in pairs]
        print(f"    const {name}_{part}: &[(f32, f32)] = &[")
        for i in range(0, len(items), 2):
            print("        " + ", ".join(items[i : i + 2]) + ",")
        print("    ];")
