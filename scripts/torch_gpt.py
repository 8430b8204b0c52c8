#!/usr/bin/env python3
"""PyTorch reference cases of lockstep's transformer (issue 21), written to tests/data/gpt/.

The model is this project's PyTorch GPT (scripts/torch_gpt_model.py: nanoGPT's
architecture and state_dict names), its optimiser that file's `configure_optimizers`
(AdamW, weight decay on the tensors of 2 or more dimensions). Run from the repository root:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch numpy safetensors
    /tmp/venv/bin/python scripts/torch_gpt.py

Cases (tests/gpt.rs reads them):
* layer_<name>.safetensors, one per new layer: its input `x`, its parameters
  `param.<name>`, an upstream gradient `dy`, and PyTorch's `y`, `dx` and `grad.<name>`,
  computed in float64 from the float32 values (so the reference is exact to f32's
  rounding): layer_norm, embedding, positional, attention, dense over (N, T, C), and a
  tied head (an embedding and a head sharing its table);
* gpt.safetensors: the GPT with block 16, vocab 256, 2 layers, 2 heads, 32 wide,
  no dropout: its initial state_dict (`init.<key>`, both names of the tied tensor), the
  token rows (`tokens` (STEPS·B, 17), taken in order: step k trains rows k·B..(k+1)·B),
  the loss of every step (`losses`), and the weights after the last (`final.<key>`); 20
  steps of AdamW (lr 1e-3, betas (0.9, 0.99), weight decay 0.1, eps 1e-8), lockstep's
  schedule (5 linear warm-up steps, then cosine to a tenth), clipping at norm 1.0.

The token rows are windows of tests/data/gpt/text.md's bytes: this project's README as
it was when the cases were first made (commit 3528bd2), kept as its own file so that the
script remakes every case byte for byte whatever the README says today.
"""

import math
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt_model import GPT, GPTConfig, CausalSelfAttention, LayerNorm  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "gpt")
os.makedirs(OUT, exist_ok=True)
torch.manual_seed(0)


def f32(t):
    """A float64 tensor of float32 values: the reference sees exactly what lockstep sees."""
    return t.float().double()


def save(name, tensors):
    path = os.path.join(OUT, name)
    save_file({k: (v.detach().float() if v.is_floating_point() else v).clone().contiguous() for k, v in tensors.items()}, path)
    print("wrote", path)


def layer_case(name, module, x, dy, x_is_ids=False):
    """Forward x through `module` (float64), backward dy; save the case."""
    module = module.double()
    if not x_is_ids:
        x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    t = {"x": x.detach().double() if not x_is_ids else x.double(), "dy": dy, "y": y}
    if not x_is_ids:
        t["dx"] = x.grad
    for pn, p in module.named_parameters():
        t["param." + pn] = p
        t["grad." + pn] = p.grad
    save(f"layer_{name}.safetensors", t)


N, T, C, V, P = 2, 5, 8, 11, 7

# LayerNorm over the last dimension, affine, eps 1e-5 (the model's LayerNorm(bias=True)).
ln = LayerNorm(C, bias=True)
with torch.no_grad():
    ln.weight.copy_(f32(torch.randn(C) * 0.5 + 1))
    ln.bias.copy_(f32(torch.randn(C) * 0.1))
layer_case("layer_norm", ln, f32(torch.randn(N, T, C) * 2 + 0.5), f32(torch.randn(N, T, C)))

# Embedding: repeated ids, so the backward sums rows.
emb = torch.nn.Embedding(V, C)
with torch.no_grad():
    emb.weight.copy_(f32(torch.randn(V, C) * 0.02))
ids = torch.tensor([[1, 3, 3, 10, 0], [3, 1, 7, 7, 7]])
layer_case("embedding", emb, ids, f32(torch.randn(N, T, C)), x_is_ids=True)


class Positional(torch.nn.Module):
    """The position table as the GPT uses it: x + wpe(arange(T))."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(f32(torch.randn(P, C) * 0.02))

    def forward(self, x):
        return x + self.weight[: x.shape[1]]


layer_case("positional", Positional(), f32(torch.randn(N, T, C)), f32(torch.randn(N, T, C)))

# Causal self-attention, 2 heads, no dropout (the model's module as it is).
attn = CausalSelfAttention(GPTConfig(block_size=T, vocab_size=V, n_layer=1, n_head=2, n_embd=C, dropout=0.0, bias=True))
with torch.no_grad():
    for p in attn.parameters():
        p.copy_(f32(torch.randn_like(p) * 0.3))
layer_case("attention", attn, f32(torch.randn(N, T, C)), f32(torch.randn(N, T, C)))

# Dense over the last dimension of (N, T, C).
dense = torch.nn.Linear(C, 6)
with torch.no_grad():
    for p in dense.parameters():
        p.copy_(f32(torch.randn_like(p) * 0.3))
layer_case("dense", dense, f32(torch.randn(N, T, C)), f32(torch.randn(N, T, 6)))


class TiedHead(torch.nn.Module):
    """An embedding and a head that is its table: logits = wte[ids] · wteᵀ."""

    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(V, C)
        self.head = torch.nn.Linear(C, V, bias=False)
        self.wte.weight = self.head.weight
        with torch.no_grad():
            self.wte.weight.copy_(f32(torch.randn(V, C) * 0.3))

    def forward(self, ids):
        return self.head(self.wte(ids))


layer_case("tied_head", TiedHead(), ids, f32(torch.randn(N, T, V)), x_is_ids=True)

# ---- the GPT, 20 steps ------------------------------------------------------------------
STEPS, B, BLOCK = 20, 6, 16
LR, WD, BETAS, WARMUP, FLOOR, CLIP = 1e-3, 0.1, (0.9, 0.99), 5, 0.1, 1.0
torch.manual_seed(1)
config = GPTConfig(block_size=BLOCK, vocab_size=256, n_layer=2, n_head=2, n_embd=32, dropout=0.0, bias=True)
model = GPT(config)
init = {"init." + k: v.clone() for k, v in model.state_dict().items()}
text = open(os.path.join(os.path.dirname(__file__), "..", "tests", "data", "gpt", "text.md"), "rb").read()
data = torch.tensor(list(text), dtype=torch.long)
starts = torch.randint(len(data) - BLOCK - 1, (STEPS * B,))
tokens = torch.stack([data[s : s + BLOCK + 1] for s in starts])
optimizer = model.configure_optimizers(WD, LR, BETAS, "cpu")


def scale(step, total):
    """lockstep's schedule (optim::LrSchedule::scale_after_warmup): linear warm-up, then cosine."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    t, n = step - WARMUP, total - WARMUP
    frac = 0.0 if n <= 1 else min(t, n - 1) / (n - 1)
    return FLOOR + (1 - FLOOR) * 0.5 * (1 + math.cos(math.pi * frac))


losses = []
model.train()
for step in range(STEPS):
    rows = tokens[step * B : (step + 1) * B]
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    for g in optimizer.param_groups:
        g["lr"] = LR * scale(step, STEPS)
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    losses.append(loss.item())
    print(f"step {step}: loss {loss.item():.6f}")
final = {"final." + k: v for k, v in model.state_dict().items()}
save("gpt.safetensors", {**init, **final, "tokens": tokens.to(torch.int64), "losses": torch.tensor(losses, dtype=torch.float64)})
