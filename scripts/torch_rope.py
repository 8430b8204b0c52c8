#!/usr/bin/env python3
"""Rotary position embeddings as Meta's Llama applies them (a complex table made with
torch.polar, each pair (2i, 2i+1) of a head read as one complex number with
view_as_complex, multiplied by its position's entry), for src/ops/rotary_embedding's
reference test. Written here from the description of the method, not copied.

Two cases, x (1, T, H, D) and dy (1, T, H, D) by formulas the test writes too, every value
exact in float32:
  A: T 4, H 2, D 8, base 10000, positions from 0;
  B: T 3, H 1, D 8, base 500, positions from 1000 (angles up to ~1000 radians, where a
     cosine's argument reduction matters).
For each case: the table's cos and sin (T, D/2), then per element (y, dx) of torch's
float32 autograd (dx is the gradient of sum(y * dy)). Prints the Rust tables the test
pastes. Run: python3 scripts/torch_rope.py
"""

import torch


def table(d, positions, start, base):
    """Entry (t, i) = exp(i·t·base^(−2i/d)) for t in start..start+positions, float32 angles."""
    inv = 1.0 / (base ** (torch.arange(0, d, 2)[: d // 2].float() / d))
    pos = torch.arange(start + positions, dtype=torch.float32)
    angles = torch.outer(pos, inv).float()
    cis = torch.polar(torch.ones_like(angles), angles)  # complex64
    return cis[start : start + positions]


def rotate(x, cis):
    """x: (N, T, H, D) real; cis: (T, D/2) complex: each pair times its position's entry."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * cis.view(1, x.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(turned).flatten(3).type_as(x)


def case(t, h, d, start, base):
    n = t * h * d
    x = torch.tensor([((i * 37 % 23) - 11) / 8 for i in range(n)], dtype=torch.float32).reshape(1, t, h, d)
    dy = torch.tensor([((i * 13 % 17) - 8) / 16 for i in range(n)], dtype=torch.float32).reshape(1, t, h, d)
    cis = table(d, t, start, base)
    x.requires_grad_(True)
    y = rotate(x, cis)
    y.backward(dy)
    return cis, y.detach().flatten().tolist(), x.grad.flatten().tolist()


f = lambda v: repr(float(v))
print(f"// torch {torch.__version__}")
for name, args in [("A", (4, 2, 8, 0, 10000.0)), ("B", (3, 1, 8, 1000, 500.0))]:
    cis, y, dx = case(*args)
    print(f"    // case {name} (T, H, D, start, base) = {args}: (cos, sin) per (t, i)")
    for c in cis.flatten().tolist():
        print(f"        ({f(c.real)}, {f(c.imag)}),")
    print(f"    // case {name}: (y, dx) per element")
    for a, b in zip(y, dx):
        print(f"        ({f(a)}, {f(b)}),")
