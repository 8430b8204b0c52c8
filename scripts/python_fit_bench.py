"""Training from Python against the command line, the same run: the convnet on
Fashion-MNIST (Debian's dataset-fashion-mnist) at a global batch of 256 on `cpu:2`, each
side's own samples/s over its training steps (the run's `trained N steps in S s (R
samples/s)`), rounds alternated. The issue's target: Python at least 0.97× the CLI.

    python3 scripts/python_fit_bench.py [--rounds 3] [--epochs 2] [--bin target/release/lockstep]

Needs the package installed (`pip install ./python`)."""

import argparse
import gzip
import os
import re
import subprocess

import numpy as np

import lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FASHION = "/usr/share/datasets/fashion-mnist"


def idx(path):
    with gzip.open(path) as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "lockstep"))
    a = p.parse_args()
    x = idx(f"{FASHION}/train-images-idx3-ubyte.gz")  # (60000, 28, 28): read where it lies
    y = idx(f"{FASHION}/train-labels-idx1-ubyte.gz")
    xt = idx(f"{FASHION}/t10k-images-idx3-ubyte.gz")
    yt = idx(f"{FASHION}/t10k-labels-idx1-ubyte.gz")
    flags = dict(epochs=a.epochs, batch_size=256, devices="cpu:2")
    argv = [a.bin, "train", "--model", "convnet", "--data", "fashion-mnist"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    ratios = []
    for r in range(a.rounds):
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        cli = float(re.search(r"trained \d+ steps in [\d.]+s \(([\d.]+) samples/s\)", out).group(1))
        h = lockstep.fit("convnet", x, y, validation_data=(xt, yt), verbose=False, **flags)
        ratios.append(h.samples_per_sec / cli)
        print(f"round {r + 1}: command line {cli:.0f} samples/s, Python {h.samples_per_sec:.0f}: {ratios[-1]:.3f}x", flush=True)
    print(f"Python / command line: {min(ratios):.3f}-{max(ratios):.3f}x (median {sorted(ratios)[len(ratios) // 2]:.3f}x)")


if __name__ == "__main__":
    main()
