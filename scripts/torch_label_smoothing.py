#!/usr/bin/env python3
"""torch_label_smoothing.py — the PyTorch reference values of tests/label_smoothing.rs.

    python3 scripts/torch_label_smoothing.py > tests/label_smoothing.json
    # needs torch, numpy and safetensors (pip install torch numpy safetensors), and the
    # oracle cases of ../shared/oracle (or --oracle-dir DIR)

Writes one JSON object:

- "losses": F.cross_entropy(z, y, label_smoothing=eps, reduction="none") of fixed float32
  logits z (N, K) and labels y, and the gradient of their sum by z (what lockstep's loss
  returns: the gradient of the SUMMED loss), for several eps;
- "training": two of the oracle's cases (../shared/oracle/README.md) trained again with
  label smoothing 0.1, from their init.safetensors on their data.safetensors, exactly as
  oracle.py trains them (its ManualSGD / ManualAdam, one thread, deterministic), the loss
  being the mean of F.cross_entropy(model(x), y, label_smoothing=0.1) over the global
  batch of 64: the loss of every step (before its update) and, for the toy, every final
  parameter.

Floats are written as the f32 values torch holds, each a JSON number that parses back to
the same f32. Only the test's author runs this; CI needs neither torch nor this script.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))

# The cases of "losses": (name, K, logits rows, labels, eps values). Values chosen to
# cover ties, a large logit (the max must be subtracted) and both ends of eps.
LOSS_CASES = [
    ("hand", 3, [[1.0, 2.0, 3.0]], [0], [0.0, 0.1, 0.5, 0.9]),
    (
        "k10",
        10,
        [
            [0.3, -1.2, 2.5, 0.0, 0.7, -0.4, 1.1, -2.2, 0.9, 0.05],
            [-0.5, 0.5, -0.5, 0.5, 3.0, 3.0, -1.0, 0.0, 0.25, -0.75],
            [4.0, -4.0, 2.0, -2.0, 1.0, -1.0, 0.5, -0.5, 0.0, 0.125],
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ],
        [2, 5, 9, 3],
        [0.1, 0.25],
    ),
    ("large", 2, [[1000.0, 0.0], [-50.0, 50.0]], [1, 1], [0.2]),
]

TRAINING_EPS = 0.1


def f32s(t):
    return [float(v) for v in t.detach().to(torch.float32).reshape(-1).tolist()]


def loss_cases():
    out = []
    for name, k, rows, labels, epss in LOSS_CASES:
        for eps in epss:
            z = torch.tensor(rows, dtype=torch.float32, requires_grad=True)
            y = torch.tensor(labels, dtype=torch.int64)
            per = F.cross_entropy(z, y, label_smoothing=eps, reduction="none")
            per.sum().backward()
            out.append({
                "name": name,
                "k": k,
                "eps": eps,
                "logits": f32s(z),
                "labels": labels,
                "loss": f32s(per),
                "dlogits": f32s(z.grad),
            })
    return out


def train_case(oracle_dir, case, steps):
    sys.path.insert(0, oracle_dir)
    from oracle import ADAM_LR, SGD_LR, ManualAdam, ManualSGD  # noqa: E402
    from peer_models import build_model  # noqa: E402

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    kind = "toy" if case.startswith("toy") else "convnet_nobn"
    model = build_model(kind, 0, dropout=0.0)
    model.train()
    d = os.path.join(oracle_dir, case)
    model.load_state_dict(load_file(os.path.join(d, "init.safetensors")), strict=True)
    data = load_file(os.path.join(d, "data.safetensors"))
    x, y = data["x"], data["y"]
    if x.is_floating_point():
        x = x.to(torch.float32)
    params = [p for _, p in model.named_parameters()]
    opt = ManualSGD(params, SGD_LR) if kind == "toy" else ManualAdam(params, ADAM_LR, form="torch")
    batch = 64
    losses = []
    for k in range(steps):
        xb, yb = x[k * batch:(k + 1) * batch], y[k * batch:(k + 1) * batch]
        loss = F.cross_entropy(model(xb), yb, label_smoothing=TRAINING_EPS)  # mean over the batch
        grads = torch.autograd.grad(loss, params)
        losses.append(float(loss.detach()))
        opt.step(grads)
    out = {"case": case, "eps": TRAINING_EPS, "steps": steps, "losses": losses}
    if kind == "toy":
        out["final"] = {n: f32s(t) for n, t in model.state_dict().items()}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oracle-dir", default=os.path.join(HERE, "..", "..", "shared", "oracle"))
    args = ap.parse_args()
    oracle_dir = os.path.abspath(args.oracle_dir)
    result = {
        "made_by": f"scripts/torch_label_smoothing.py, torch {torch.__version__} (CPU, float32, one thread)",
        "losses": loss_cases(),
        "training": [
            train_case(oracle_dir, "toy_s0_k50_b64_w1", 50),
            train_case(oracle_dir, "convnet_nobn_s0_k20_b64_w1", 20),
        ],
    }
    json.dump(result, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
