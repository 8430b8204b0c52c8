#!/usr/bin/env python3
"""PyTorch's grouped and depthwise convolution (torch.nn.Conv2d with groups), its output,
input gradient and weight and bias gradients, for src/ops/conv2d's reference test.

Per case, x, the weight (O, C/G, KH, KW), the bias and dy by formulas the test writes too
(every value exact in float32):
  x[i]  = ((i*37 + case) % 29 - 14) / 8      w[i] = ((i*11 + 3) % 13 - 6) / 16
  b[f]  = (f - 1) / 4                        dy[i] = ((i*7 + 2) % 17 - 8) / 16
Five cases, each as the layer's spec writes it:
  "G2":   x (2, 4, 3, 4); filters 4, groups 2, kernel [2, 3], valid, bias
  "SAME2": x (1, 3, 6, 6); filters 3, groups 3 (depthwise), kernel 3, strides 2, "same",
          bias (Keras's same pads 0 top/left and 1 bottom/right here: F.pad, then no pad)
  "PAD2": x (2, 2, 5, 5); filters 2, groups 2, kernel 3, strides 2, padding 1, no bias
  "MULT": x (1, 2, 4, 5); filters 4, groups 2 (two filters a channel), kernel 3, "same"
          (1 each side), bias
  "WIDE": x (1, 10, 3, 3); filters 4, groups 2 (5 channels a group: a convolution a
          group), kernel 2, valid, bias
Every product and sum of these is exact in float32 (multiples of 1/128 far below 2^24), so
float64 evaluation and torch's own float32 agree to the bit; the script checks that they
do, and prints each value once: y, dx, dweight and dbias. Prints the Rust tables the test
pastes.
Run: python3 scripts/torch_conv2d_groups.py (with --bench: PyTorch's time of a depthwise
training pass at the shapes the layer's ignored test `depthwise_speed` times).
"""

import torch
import torch.nn.functional as F

# name, case index, x shape, filters, groups, kernel, stride, pads (left, right, top, bottom), bias
CASES = [
    ("G2", 0, (2, 4, 3, 4), 4, 2, (2, 3), 1, (0, 0, 0, 0), True),
    ("SAME2", 1, (1, 3, 6, 6), 3, 3, (3, 3), 2, (0, 1, 0, 1), True),
    ("PAD2", 2, (2, 2, 5, 5), 2, 2, (3, 3), 2, (1, 1, 1, 1), False),
    ("MULT", 3, (1, 2, 4, 5), 4, 2, (3, 3), 1, (1, 1, 1, 1), True),
    ("WIDE", 4, (1, 10, 3, 3), 4, 2, (2, 2), 1, (0, 0, 0, 0), True),
]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def run(case, dtype):
    _, k, xs, o, g, (kh, kw), s, pads, bias = case
    c = xs[1]
    x = torch.tensor([((i * 37 + k) % 29 - 14) / 8 for i in range(numel(xs))], dtype=dtype)
    x = x.reshape(xs).requires_grad_(True)
    ws = (o, c // g, kh, kw)
    w = torch.tensor([((i * 11 + 3) % 13 - 6) / 16 for i in range(numel(ws))], dtype=dtype)
    w = w.reshape(ws).requires_grad_(True)
    b = torch.tensor([(f - 1) / 4 for f in range(o)], dtype=dtype).requires_grad_(True) if bias else None
    y = F.conv2d(F.pad(x, pads), w, b, stride=s, groups=g)
    dy = torch.tensor([((i * 7 + 2) % 17 - 8) / 16 for i in range(y.numel())], dtype=dtype)
    y.backward(dy.reshape(y.shape))
    out = [("Y", y), ("DX", x.grad), ("DW", w.grad)] + ([("DB", b.grad)] if bias else [])
    return [(part, t.detach().flatten().tolist()) for part, t in out], tuple(y.shape)


def bench(threads=2):
    """Milliseconds of a training pass (forward, backward with the input gradient) of
    nn.Conv2d(C, C, k, stride, padding=k//2, groups=C) at the shapes the layer's ignored
    test `depthwise_speed` times: best of 10 after 2 warm-ups, on `threads` threads."""
    import time

    torch.set_num_threads(threads)
    for n, c, hw, k, stride in [(32, 64, 32, 3, 1), (32, 64, 32, 3, 2), (32, 96, 28, 7, 1), (32, 256, 14, 3, 1)]:
        conv = torch.nn.Conv2d(c, c, k, stride, padding=k // 2, groups=c)
        x0 = torch.rand(n, c, hw, hw) - 0.5
        times = []
        for _ in range(12):
            x = x0.clone().requires_grad_(True)
            start = time.perf_counter()
            y = conv(x)
            y.backward(y.detach())
            times.append((time.perf_counter() - start) * 1e3)
        best = min(times[2:])
        print(f"depthwise N {n} C {c} {hw}x{hw} {k}x{k} stride {stride}: {best:.2f} ms forward+backward "
              f"({threads} threads, torch {torch.__version__})")


def tables():
    print(f"// torch {torch.__version__}")
    for case in CASES:
        (parts64, shape), (parts32, _) = run(case, torch.float64), run(case, torch.float32)
        print(f"    // {case[0]}: y {shape}")
        for (part, a64), (_, a32) in zip(parts64, parts32):
            assert a64 == a32, f"{case[0]} {part}: float32 differs from float64"
            items = [repr(float(v)) for v in a64]
            print(f"    const {case[0]}_{part}: &[f32] = &[")
            for i in range(0, len(items), 8):
                print("        " + ", ".join(items[i : i + 8]) + ",")
            print("    ];")


if __name__ == "__main__":
    import sys

    bench() if "--bench" in sys.argv[1:] else tables()
