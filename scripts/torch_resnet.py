#!/usr/bin/env python3
"""PyTorch reference cases for lockstep's residual block and built-in ResNets.

Writes tests/data/resnet/ (committed; lockstep's tests read it, CI needs no PyTorch):

  blocks.safetensors   two residual blocks (BatchNorm2d inside, training mode): one with
                       the identity shortcut (16 -> 16), one with a projection shortcut
                       (1x1 conv stride 2 + BatchNorm2d, 16 -> 32). For each block <b>:
                       <b>.x (4, 16, 8, 8), <b>.dy, <b>.y, <b>.dx, the block's tensors
                       <b>.p.<name> before the pass, their gradients <b>.g.<name> and its
                       buffers after the pass <b>.b.<name>.
  data.safetensors     x u8 (N, 1, 28, 28): the first N Fashion-MNIST training images,
                       raw 0..255; y i64 (N,). Step k uses rows [k*B, (k+1)*B); replica r
                       of W takes rows [k*B + r*B/W, k*B + (r+1)*B/W).
  init.safetensors     resnet8's state_dict (PyTorch's default init, seed 0), as lockstep
                       loads it with --init (num_batches_tracked int64).
  w{W}.safetensors     for W = 1, 2, 3 replicas with per-replica BatchNorm: grads_step0.<name>
                       (the gradient of the mean loss over the global batch at step 0) and
                       final.<name> (parameters and buffers after K steps).
  losses.json          the config and the K losses of each W (computed before update k).

The model is the issue's module: ResNet(n=1). Its input is lockstep's normalisation,
x * scale + offset in float32 (scale = 1/(255*std), offset = -mean/std, each rounded to
float32 first), as lockstep's `normalize` layer computes it.

Data parallelism, simulated in one process as lockstep defines it (DESIGN.md): each of
the W logical replicas normalises with its own shard's batch statistics; the loss is the
SUM of the shards' summed cross-entropies divided by B; every replica's BatchNorm running
statistics are updated from its own shard and then averaged over the W replicas (the
exchange sums the slots' buffers and scales by 1/W); num_batches_tracked counts 1 a step.
With synchronized BatchNorm the statistics are the global batch's, which is W = 1's
trajectory: lockstep's SyncBatchNorm runs are tested against w1.

Optimiser: SGD with momentum 0.9 (PyTorch's: buf = 0.9 buf + g, p -= lr buf), lr 1e-4.
(Adam normalises each gradient by its own size, so the rounding noise of near-zero
gradients becomes full-size steps: over 20 steps its losses drift apart by 4e-5, past
the issue's 1e-5.) float32, one thread, deterministic algorithms.

Usage: python scripts/torch_resnet.py [--fashion DIR] [--out tests/data/resnet]
Needs torch, numpy, safetensors.
"""
import argparse
import gzip
import json
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

STEPS, BATCH = 20, 24
LR, MOMENTUM = 0.0001, 0.9
# Fashion-MNIST's 60,000 training images, pixels / 255, in float64 (main() recomputes them).
MEAN, STD = 0.2860405969887955, 0.35302424451492254


class Basic(nn.Module):
    def __init__(s, cin, cout, stride):
        super().__init__()
        s.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False); s.bn1 = nn.BatchNorm2d(cout)
        s.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False);     s.bn2 = nn.BatchNorm2d(cout)
        s.short = None
        if stride != 1 or cin != cout:
            s.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(s, x):
        y = s.bn2(s.conv2(F.relu(s.bn1(s.conv1(x)))))
        return F.relu(y + (x if s.short is None else s.short(x)))


class ResNet(nn.Module):          # n = 1: resnet8, n = 3: resnet20
    def __init__(s, n, classes=10):
        super().__init__()
        s.stem = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for i, c in enumerate((16, 32, 64)):
            for b in range(n):
                layers.append(Basic(cin, c, 2 if (b == 0 and i > 0) else 1)); cin = c
        s.blocks = nn.Sequential(*layers)
        s.head = nn.Linear(64, classes)

    def forward(s, x):             # x: (N, 1, 28, 28), already (x/255 - mean) / std
        return s.head(s.blocks(s.stem(x)).mean((2, 3)))


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def normalize(x_u8):
    scale = np.float32(1.0 / (255.0 * STD))
    offset = np.float32(-MEAN / STD)
    x = x_u8.astype(np.float32)
    return torch.from_numpy((x * scale).astype(np.float32) + offset)


def blocks(out):
    torch.manual_seed(1)
    cases = {"identity": Basic(16, 16, 1), "projection": Basic(16, 32, 2)}
    tensors = {}
    for name, block in cases.items():
        block.train()
        # Non-trivial BatchNorm parameters and running statistics.
        with torch.no_grad():
            for m in block.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.uniform_(0.5, 1.5); m.bias.uniform_(-0.5, 0.5)
                    m.running_mean.uniform_(-0.1, 0.1); m.running_var.uniform_(0.5, 1.5)
        for n, t in block.state_dict().items():
            tensors[f"{name}.p.{n}"] = t.clone()
        x = torch.randn(4, 16, 8, 8, requires_grad=True)
        y = block(x)
        dy = torch.randn_like(y)
        y.backward(dy)
        tensors[f"{name}.x"] = x.detach().clone()
        tensors[f"{name}.dy"] = dy
        tensors[f"{name}.y"] = y.detach().clone()
        tensors[f"{name}.dx"] = x.grad.clone()
        for n, p in block.named_parameters():
            tensors[f"{name}.g.{n}"] = p.grad.clone()
        for n, b in block.named_buffers():
            tensors[f"{name}.b.{n}"] = b.clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "blocks.safetensors"))


def trajectory(model, xs, ys, world):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads0 = [], None
    buffers = [n for n, _ in model.named_buffers()]
    for k in range(STEPS):
        opt.zero_grad(set_to_none=False)
        rows = slice(k * BATCH, (k + 1) * BATCH)
        x, y = xs[rows], ys[rows]
        before = {n: b.clone() for n, b in model.named_buffers()}
        after = []
        total = 0.0
        for r in range(world):
            lo, hi = r * BATCH // world, (r + 1) * BATCH // world
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(before[n])
            loss = F.cross_entropy(model(x[lo:hi]), y[lo:hi], reduction="sum")
            (loss / BATCH).backward()
            total += loss.item()
            after.append({n: b.clone() for n, b in model.named_buffers()})
        with torch.no_grad():
            bufs = dict(model.named_buffers())
            for n in buffers:
                if n.endswith("num_batches_tracked"):
                    bufs[n].copy_(after[0][n])
                else:
                    s = after[0][n].clone()
                    for a in after[1:]:
                        s += a[n]
                    bufs[n].copy_(s * np.float32(1.0 / world))
        losses.append(total / BATCH)
        if k == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads0, {n: t.clone() for n, t in model.state_dict().items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fashion", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "resnet"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(a.out, exist_ok=True)
    print("resnet8 params", sum(p.numel() for p in ResNet(1).parameters()),
          "resnet20 params", sum(p.numel() for p in ResNet(3).parameters()))
    blocks(a.out)
    all_x = idx(os.path.join(a.fashion, "train-images-idx3-ubyte.gz")).astype(np.float64) / 255.0
    assert (all_x.mean(), all_x.std()) == (MEAN, STD), (all_x.mean(), all_x.std())
    n = STEPS * BATCH
    x_u8 = idx(os.path.join(a.fashion, "train-images-idx3-ubyte.gz"))[:n].reshape(n, 1, 28, 28).copy()
    y = torch.from_numpy(idx(os.path.join(a.fashion, "train-labels-idx1-ubyte.gz"))[:n].astype(np.int64))
    save_file({"x": torch.from_numpy(x_u8), "y": y}, os.path.join(a.out, "data.safetensors"))
    xs = normalize(x_u8)
    torch.manual_seed(0)
    init = ResNet(1).state_dict()
    save_file({k: v.contiguous() for k, v in init.items()}, os.path.join(a.out, "init.safetensors"))
    record = {"model": "resnet8", "steps": STEPS, "global_batch": BATCH, "optimizer": "sgd lr 1e-4 momentum 0.9",
              "mean": MEAN, "std": STD, "losses": {}}
    for world in (1, 2, 3):
        model = ResNet(1)
        model.load_state_dict(init)
        model.train()
        losses, grads0, final = trajectory(model, xs, y, world)
        out = {f"grads_step0.{n}": g for n, g in grads0.items()}
        out.update({f"final.{n}": t for n, t in final.items()})
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(a.out, f"w{world}.safetensors"))
        record["losses"][str(world)] = losses
        print("W", world, "losses", losses[0], losses[-1])
    with open(os.path.join(a.out, "losses.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
