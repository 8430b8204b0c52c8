#!/usr/bin/env python3
"""nanoGPT's CPU recipe, its own way, for lockstep's speed comparison (issue 21).

nanoGPT's README: `python train.py config/train_shakespeare_char.py --device=cpu
--compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12
--n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000
--dropout=0.0`. This is that loop (train.py's get_batch, get_lr, estimate_loss,
clipping, its AdamW from `configure_optimizers`), restated over lockstep's text: the
bytes of Debian's fortunes (every file of /usr/share/games/fortunes but the .dat and .u8,
in name order, the first 90% training), vocabulary 256, with this project's PyTorch GPT
(scripts/torch_gpt_model.py, nanoGPT's architecture). It prints the tokens per second of
the training steps (evaluation excluded, as lockstep's figure excludes it) and the
validation loss.

    /tmp/venv/bin/python scripts/torch_gpt_bench.py --threads 2 --iters 2000
"""

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_gpt_model import GPT, GPTConfig  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--iters", type=int, default=2000)
p.add_argument("--eval-interval", type=int, default=250)
p.add_argument("--eval-iters", type=int, default=20)
p.add_argument("--dir", default="/usr/share/games/fortunes")
a = p.parse_args()
torch.set_num_threads(a.threads)
torch.manual_seed(1337)

names = sorted(n for n in os.listdir(a.dir) if not n.endswith((".dat", ".u8")) and os.path.isfile(os.path.join(a.dir, n)))
text = b"".join(open(os.path.join(a.dir, n), "rb").read() for n in names)
data = torch.tensor(list(text), dtype=torch.long)
cut = int(len(data) * 0.9)
train_data, val_data = data[:cut], data[cut:]

block, batch = 64, 12
lr, min_lr, warmup, decay_iters = 1e-3, 1e-4, 100, a.iters
model = GPT(GPTConfig(block_size=block, vocab_size=256, n_layer=4, n_head=4, n_embd=128, dropout=0.0, bias=True))
optimizer = model.configure_optimizers(0.1, lr, (0.9, 0.99), "cpu")


def get_batch(split):
    d = train_data if split == "train" else val_data
    ix = torch.randint(len(d) - block, (batch,))
    x = torch.stack([d[i : i + block] for i in ix])
    y = torch.stack([d[i + 1 : i + 1 + block] for i in ix])
    return x, y


def get_lr(it):
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(a.eval_iters)
    for k in range(a.eval_iters):
        _, loss = model(*get_batch("val"))
        losses[k] = loss.item()
    model.train()
    return losses.mean().item()


train_time, tokens = 0.0, 0
for it in range(a.iters + 1):
    if it % a.eval_interval == 0 or it == a.iters:
        print(f"step {it}: val loss {estimate_loss():.4f}, {tokens / max(train_time, 1e-9):.0f} tokens/s", flush=True)
    if it == a.iters:
        break
    t0 = time.perf_counter()
    for g in optimizer.param_groups:
        g["lr"] = get_lr(it)
    x, y = get_batch("train")
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss.item()
    train_time += time.perf_counter() - t0
    tokens += batch * block
print(f"nanogpt: {a.iters} iters, {tokens / train_time:.0f} tokens/s over the training steps ({train_time:.1f} s)")
