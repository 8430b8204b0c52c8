#!/usr/bin/env python3
"""PyTorch's training speed for the ResNets of issue 18 on the CPU, the peer figure of
`lockstep bench step --model resnet8 --batch-size 128 --devices cpu:2`.

One process, `torch.set_num_threads(THREADS)` (2: the cores lockstep's cpu:2 uses), the
issue's module (scripts/torch_resnet.py's ResNet), training mode, Adam lr 1e-3 (the
optimiser `bench step` uses), batches of B random 1x28x28 inputs (the speed does not
depend on the values), each configuration timed over STEPS steps after WARMUP:
  eager            contiguous NCHW
  channels_last    NHWC memory format (oneDNN's preferred layout for convolutions)
  compile          torch.compile of the module (inductor), when it compiles here
The best is PyTorch's figure. One line per configuration:
  torch_resnet config=<name> samples_per_s=<float> median_step_ms=<float> batch=<B> threads=<T>
Usage: python scripts/torch_resnet_bench.py [--depth 1|3] [--batch 128] [--threads 2] [--steps 20]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_resnet import ResNet  # noqa: E402


def bench(model, x, y, steps, warmup):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=1, help="blocks per stage: 1 resnet8, 3 resnet20")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--configs", default="eager,channels_last,compile")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    x = torch.randn(a.batch, 1, 28, 28)
    y = torch.randint(0, 10, (a.batch,))
    for config in a.configs.split(","):
        model = ResNet(a.depth).train()
        xs = x
        try:
            if config == "channels_last":
                model = model.to(memory_format=torch.channels_last)
                xs = x.contiguous(memory_format=torch.channels_last)
            elif config == "compile":
                model = torch.compile(model)
            step = bench(model, xs, y, a.steps, a.warmup)
        except Exception as e:  # a configuration that does not run here says why
            print(f"torch_resnet config={config} failed={type(e).__name__}", flush=True)
            continue
        print(f"torch_resnet config={config} samples_per_s={a.batch / step:.1f} "
              f"median_step_ms={step * 1e3:.2f} batch={a.batch} threads={a.threads}", flush=True)


if __name__ == "__main__":
    main()
