#!/usr/bin/env python3
"""torch_optim.py — the PyTorch reference of tests/optim_reference.rs: the optimisers and
recipes of issue 18 (SGD with momentum and Nesterov momentum, Adam, AdamW, weight decay on
the weights only, linear warm-up before a cosine schedule, clipping by the global gradient
norm), step by step on small tensors.

    python3 scripts/torch_optim.py > tests/data/torch_optim.json   # needs torch (CPU)

Each case trains two parameters, a weight W (3, 4) and a bias b (4,), from the same initial
values and on the same gradients (one per step, set as p.grad: the mean gradient of a
batch; lockstep's test hands them over as sums over a batch of 1). Weight decay on the
weights only is PyTorch's two parameter groups, [W] with weight_decay=wd and [b] with 0.
Clipping is torch.nn.utils.clip_grad_norm_([W, b], C) before optimizer.step(). Warm-up
of N steps then cosine to floor·lr is SequentialLR([LinearLR(start_factor=1/N,
total_iters=N-1), CosineAnnealingLR(T_max=T-N-1, eta_min=floor·lr)], milestones=[N]),
stepped after every optimizer.step(): step s < N runs at (s+1)/N of the rate, then the
cosine runs over the remaining T-N steps.

The JSON holds every float32 as the double equal to it (exact), W before b, flattened in
row-major order; for each step, the learning rate PyTorch used, the gradient norm
clip_grad_norm_ returned (when clipping) and both parameters after the step. Only the
test's author runs this; CI needs no PyTorch.
"""

import json
import math

import torch

STEPS = 8


def flat(*ts):
    return [float(v) for t in ts for v in t.detach().reshape(-1).tolist()]


def run(case, w0, b0, grads):
    W = torch.nn.Parameter(w0.clone())
    b = torch.nn.Parameter(b0.clone())
    wd = case["weight_decay"]
    if case["decay_on"] == "weights":
        groups = [{"params": [W], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}]
    else:
        groups = [{"params": [W, b], "weight_decay": wd}]
    lr = case["lr"]
    kind = case["optimizer"]
    if kind == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=case["momentum"], nesterov=case["nesterov"])
    elif kind == "adam":
        opt = torch.optim.Adam(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    elif kind == "adamw":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8)
    else:
        raise ValueError(kind)
    n, floor = case["warmup_steps"], case["cosine_floor"]
    if n > 0:
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0 / n, end_factor=1.0, total_iters=n - 1)
        cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - n - 1, eta_min=floor * lr)
        sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[n])
    elif floor is not None:
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 1, eta_min=floor * lr)
    else:
        sched = None
    steps = []
    for g in grads:
        W.grad = g[:12].reshape(3, 4).clone()
        b.grad = g[12:].clone()
        record = {"lr": opt.param_groups[0]["lr"]}
        if case["clip_grad_norm"] is not None:
            record["norm"] = float(torch.nn.utils.clip_grad_norm_([W, b], case["clip_grad_norm"]))
        opt.step()
        if sched is not None:
            sched.step()
        record["params"] = flat(W, b)
        steps.append(record)
    return steps


def main():
    gen = torch.Generator().manual_seed(18)
    w0 = torch.randn(3, 4, generator=gen, dtype=torch.float32)
    b0 = torch.randn(4, generator=gen, dtype=torch.float32)
    grads = [torch.randn(16, generator=gen, dtype=torch.float32) * 0.8 for _ in range(STEPS)]
    base = {
        "momentum": 0.0,
        "nesterov": False,
        "weight_decay": 0.0,
        "decay_on": "weights",
        "warmup_steps": 0,
        "cosine_floor": None,
        "clip_grad_norm": None,
    }
    cases = [
        {"name": "sgd momentum, weight decay on the weights", "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
        {"name": "sgd nesterov, weight decay on all, clipped", "optimizer": "sgd", "lr": 0.1, "momentum": 0.9,
         "nesterov": True, "weight_decay": 5e-2, "decay_on": "all", "clip_grad_norm": 1.0},
        {"name": "sgd nesterov, weights decay, warm-up 3 then cosine, clipped", "optimizer": "sgd", "lr": 0.1,
         "momentum": 0.9, "nesterov": True, "weight_decay": 5e-2, "warmup_steps": 3, "cosine_floor": 0.1,
         "clip_grad_norm": 3.3},
        {"name": "sgd plain, clipped", "optimizer": "sgd", "lr": 0.2, "clip_grad_norm": 0.5},
        {"name": "adam, L2 on the weights", "optimizer": "adam", "lr": 1e-2, "weight_decay": 1e-1},
        {"name": "adamw, decay on the weights", "optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.5},
        {"name": "adamw, decay on all, warm-up 2 then cosine, clipped", "optimizer": "adamw", "lr": 1e-2,
         "weight_decay": 0.5, "decay_on": "all", "warmup_steps": 2, "cosine_floor": 0.1, "clip_grad_norm": 0.5},
        {"name": "adam, cosine without warm-up", "optimizer": "adam", "lr": 1e-2, "cosine_floor": 0.1},
    ]
    out = {
        "made_by": f"scripts/torch_optim.py, torch {torch.__version__}",
        "steps": STEPS,
        "initial": flat(w0, b0),
        "grads": [flat(g) for g in grads],
        "cases": [],
    }
    for c in cases:
        case = {**base, **c}
        case["steps"] = run(case, w0, b0, grads)
        out["cases"].append(case)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
