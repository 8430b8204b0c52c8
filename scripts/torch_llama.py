#!/usr/bin/env python3
"""The PyTorch reference case of lockstep's Llama (issue 42), written to tests/data/llama/.

The model is this project's PyTorch Llama (scripts/torch_llama_model.py: Meta's
architecture and parameter names), its optimiser that file's `configure_optimizers`
(AdamW, weight decay on the tensors of 2 or more dimensions). Run from the repository root:

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install torch numpy safetensors
    /tmp/venv/bin/python scripts/torch_llama.py

llama.safetensors (tests/llama.rs reads it): the Llama with a window of 16, vocab 256, 2
layers, 2 heads, 32 wide, its feed-forward 96 wide (Meta's rule with multiple_of 32:
int(2·128/3) = 85, rounded up to 96), norm eps 1e-5, RoPE base 10000: its initial
state_dict (`init.<key>`), the token rows (`tokens` (STEPS·B, 17), taken in order: step k
trains rows k·B..(k+1)·B), the loss of every step (`losses`), and the weights after the
last (`final.<key>`); 20 steps of AdamW (lr 1e-3, betas (0.9, 0.99), weight decay 0.1,
eps 1e-8), lockstep's schedule (5 linear warm-up steps, then cosine to a tenth), clipping
at norm 1.0: the GPT case's recipe (scripts/torch_gpt.py), on the same text
(tests/data/gpt/text.md).
"""

import math
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_llama_model import Llama, LlamaConfig  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "data", "llama")
os.makedirs(OUT, exist_ok=True)

STEPS, B, BLOCK = 20, 6, 16
LR, WD, BETAS, WARMUP, FLOOR, CLIP = 1e-3, 0.1, (0.9, 0.99), 5, 0.1, 1.0
torch.manual_seed(1)
config = LlamaConfig(max_seq_len=BLOCK, vocab_size=256, n_layers=2, n_heads=2, dim=32, multiple_of=32)
model = Llama(config)
init = {"init." + k: v.clone() for k, v in model.state_dict().items()}
text = open(os.path.join(ROOT, "tests", "data", "gpt", "text.md"), "rb").read()
data = torch.tensor(list(text), dtype=torch.long)
starts = torch.randint(len(data) - BLOCK - 1, (STEPS * B,))
tokens = torch.stack([data[s : s + BLOCK + 1] for s in starts])
optimizer = model.configure_optimizers(WD, LR, BETAS)


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
final = {"final." + k: v.detach().clone() for k, v in model.state_dict().items()}
tensors = {**init, **final, "tokens": tokens.to(torch.int64), "losses": torch.tensor(losses, dtype=torch.float64)}
path = os.path.join(OUT, "llama.safetensors")
save_file({k: v.contiguous() for k, v in tensors.items()}, path)
print("wrote", path, "with torch", torch.__version__)
