#!/usr/bin/env python3
"""PyTorch reference cases for lockstep's built-in DenseNet (`--model densenet`).

Writes tests/data/densenet/ (committed; tests/densenet.rs reads it, CI needs no PyTorch):

  block.safetensors    a dense block of 2 layers (8 channels in, growth 4) and its
                       transition (16 -> 8 channels, AvgPool2d(2)), training mode, with
                       non-trivial BatchNorm weights and running statistics: x (4, 8, 8, 8),
                       dy, y (4, 8, 4, 4), dx, the tensors p.<name> before the pass, their
                       gradients g.<name>, the buffers after the pass b.<name>. Names as in
                       torch_densenet_model: layers.denselayer{1,2}.*, transition.*.
  init.safetensors     the DenseNet's state_dict (PyTorch's default init, seed 0), as
                       lockstep loads it with --init (num_batches_tracked int64).
  w{W}.safetensors     for W = 1, 2, 3 replicas with per-replica BatchNorm:
                       grads_step0.<name> (the gradient of the mean loss over the global
                       batch at step 0) and final.<name> (parameters and buffers after the
                       STEPS steps).
  losses.json          the config and the STEPS losses of each W (computed before update k).

The data are tests/data/resnet/data.safetensors (the first 480 Fashion-MNIST training
images, raw 0..255, and their labels; scripts/torch_resnet.py wrote them): step k takes
rows [k*B, (k+1)*B), replica r of W the rows [k*B + r*B/W, k*B + (r+1)*B/W). The input is
lockstep's normalisation, x * scale + offset in float32 (torch_resnet.normalize).

Data parallelism is simulated as scripts/torch_resnet.py simulates it (DESIGN.md): each
replica normalises with its own shard's batch statistics, the loss is the SUM of the
shards' summed cross-entropies divided by B, the running statistics are each replica's
own update averaged over the W replicas, num_batches_tracked counts 1 a step.

Optimiser: SGD with momentum 0.9 (PyTorch's: buf = 0.9 buf + g, p -= lr buf), lr 0.05,
two steps, so that the second step's loss and gradient are those of moved weights and the
final weights carry two updates of full size. float32, one thread, deterministic
algorithms. The script also reruns each case in float64 and prints how far the float32
run lies from it: the scale of what float32's rounding alone moves, which sets the
tolerances of tests/densenet.rs.

Usage: python scripts/torch_densenet.py [--out tests/data/densenet]
Needs torch, numpy, safetensors.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_densenet_model import DenseLayer, DenseNet, Transition  # noqa: E402
from torch_resnet import normalize  # noqa: E402

STEPS, BATCH = 2, 24
LR, MOMENTUM = 0.05, 0.9
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def block(out):
    """A dense block of two layers and a transition, forward and backward."""
    torch.manual_seed(1)
    m = nn.Sequential()
    m.add_module("layers", nn.Sequential())
    m.layers.add_module("denselayer1", DenseLayer(8, 4))
    m.layers.add_module("denselayer2", DenseLayer(12, 4))
    m.add_module("transition", Transition(16, 8))
    m.train()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5); mod.bias.uniform_(-0.5, 0.5)
                mod.running_mean.uniform_(-0.1, 0.1); mod.running_var.uniform_(0.5, 1.5)
    t = {f"p.{n}": v.clone() for n, v in m.state_dict().items()}
    x = torch.randn(4, 8, 8, 8, requires_grad=True)
    y = m(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    t.update({"x": x.detach().clone(), "dy": dy, "y": y.detach().clone(), "dx": x.grad.clone()})
    t.update({f"g.{n}": p.grad.clone() for n, p in m.named_parameters()})
    t.update({f"b.{n}": b.clone() for n, b in m.named_buffers()})
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(out, "block.safetensors"))


def trajectory(model, xs, ys, world):
    """STEPS steps of W simulated replicas: the losses, step 0's gradient, the final state."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, grads0 = [], None
    for k in range(STEPS):
        opt.zero_grad(set_to_none=False)
        x, y = xs[k * BATCH:(k + 1) * BATCH], ys[k * BATCH:(k + 1) * BATCH]
        before = {n: b.clone() for n, b in model.named_buffers()}
        after, total = [], 0.0
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
            for n, b in model.named_buffers():
                if n.endswith("num_batches_tracked"):
                    b.copy_(after[0][n])
                else:
                    s = after[0][n].clone()
                    for a in after[1:]:
                        s += a[n]
                    b.copy_(s * np.float32(1.0 / world))
        losses.append(total / BATCH)
        if k == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads0, {n: t.clone() for n, t in model.state_dict().items()}


def float32_against_float64(init, xs, ys, world, f32):
    """Prints how far the float32 run `f32` (losses, step-0 gradients, final state) lies from
    the same run in float64: the size of float32's rounding here, which the tolerances of
    tests/densenet.rs are set against. A ReLU input within ~1e-6 of zero that float32
    rounds to the other side moves a gradient by ~1e-4 (one such at step 0 for W = 1)."""
    model = DenseNet()
    model.load_state_dict(init)
    model = model.double().train()
    losses, grads0, final = trajectory(model, xs.double(), ys, world)
    dl = max(abs(p - q) for p, q in zip(losses, f32[0]))
    dg = max(((grads0[k] - f32[1][k].double()).abs().max() / max(1.0, grads0[k].abs().max())).item()
             for k in grads0)
    dw = max((final[k] - f32[2][k].double()).abs().max().item() for k in final
             if not k.endswith("num_batches_tracked"))
    print(f"W {world}: float32 against float64: losses {dl:.2e}, step-0 gradients {dg:.2e} of max(1, |g|), "
          f"final tensors {dw:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "densenet"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.makedirs(a.out, exist_ok=True)
    print("densenet params", sum(p.numel() for p in DenseNet().parameters()))
    block(a.out)
    data = load_file(os.path.join(ROOT, "tests", "data", "resnet", "data.safetensors"))
    n = STEPS * BATCH
    xs, ys = normalize(data["x"][:n].numpy()), data["y"][:n]
    torch.manual_seed(0)
    init = DenseNet().state_dict()
    save_file({k: v.contiguous() for k, v in init.items()}, os.path.join(a.out, "init.safetensors"))
    record = {"model": "densenet", "steps": STEPS, "global_batch": BATCH,
              "optimizer": f"sgd lr {LR} momentum {MOMENTUM}", "losses": {}}
    for world in (1, 2, 3):
        model = DenseNet()
        model.load_state_dict(init)
        model.train()
        losses, grads0, final = trajectory(model, xs, ys, world)
        out = {f"grads_step0.{k}": g for k, g in grads0.items()}
        out.update({f"final.{k}": t for k, t in final.items()})
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(a.out, f"w{world}.safetensors"))
        record["losses"][str(world)] = losses
        print("W", world, "losses", losses)
        float32_against_float64(init, xs, ys, world, (losses, grads0, final))
    with open(os.path.join(a.out, "losses.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
