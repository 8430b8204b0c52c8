#!/usr/bin/env python3
"""torch_gelu.py — the reference values of src/ops/gelu/'s PyTorch comparison test.

    python3 scripts/torch_gelu.py        # needs torch and mpmath (pip install torch)

Prints, for fixed f32 inputs x, as Rust tuples:

    (x, torch_y, torch_dx, exact_y, exact_dx)

- torch_y, torch_dx: torch.nn.GELU() (approximate='none', the exact erf form) on a float32
  tensor on the CPU, and the gradient of sum(y) by x (dy = 1), as a user gets them in f32;
- exact_y, exact_dx: x·Φ(x) and Φ(x) + x·φ(x) in 60-digit arithmetic (mpmath, which torch
  installs through sympy), rounded once to f32: the correctly rounded values.

Floats are printed as numpy prints an f32: the shortest decimal that rounds back to it, so
that Rust's `f32` literal parses back to the same bits. Only the test's author runs
this; CI needs neither torch nor mpmath.
"""

import mpmath
import numpy as np
import torch

XS = [0.0, 1e-3, -1e-3, 0.5, -0.5, 1.0, -1.0, 3.0, -3.0, 8.0, -8.0, -20.0]


def f32(v):
    """The f32 nearest to v (a Python float or an mpf, which goes through its nearest
    double: that differs from rounding once only within 2^-53 of a midpoint between two
    f32s), as its shortest decimal."""
    return str(np.float32(float(v)))


def exact(x):
    mpmath.mp.dps = 60
    x = mpmath.mpf(x)
    cdf = mpmath.ncdf(x)
    pdf = mpmath.npdf(x)
    return x * cdf, cdf + x * pdf


def main():
    x = torch.tensor(XS, dtype=torch.float32, requires_grad=True)
    y = torch.nn.GELU()(x)
    y.sum().backward()
    print(f"# torch {torch.__version__}, mpmath {mpmath.__version__}")
    for xi, yi, gi in zip(x.detach().tolist(), y.detach().tolist(), x.grad.tolist()):
        ey, eg = exact(xi)
        print(f"    ({f32(xi)}, {f32(yi)}, {f32(gi)}, {f32(ey)}, {f32(eg)}),")


if __name__ == "__main__":
    main()
