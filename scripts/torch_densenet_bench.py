#!/usr/bin/env python3
"""PyTorch's training speed for the DenseNet of issue 42 on the CPU, the peer figure of
`lockstep bench step --model densenet --batch-size 128 --devices cpu:2`.

One process, `torch.set_num_threads(THREADS)` (2: the cores lockstep's cpu:2 uses), the
module of scripts/torch_densenet_model.py, training mode, Adam lr 1e-3 (the optimiser
`bench step` uses), batches of B random 1x28x28 inputs (the speed does not depend on the
values), each configuration timed over STEPS steps after WARMUP, as
scripts/torch_resnet_bench.py times the ResNets:
  eager            contiguous NCHW
  channels_last    NHWC memory format (oneDNN's preferred layout for convolutions)
  compile          torch.compile of the module (inductor), when it compiles here
The best is PyTorch's figure. One line per configuration:
  torch_densenet config=<name> samples_per_s=<float> median_step_ms=<float> batch=<B> threads=<T>
Usage: python scripts/torch_densenet_bench.py [--batch 128] [--threads 2] [--steps 20]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_densenet_model import DenseNet  # noqa: E402
from torch_resnet_bench import bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
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
        model = DenseNet().train()
        xs = x
        try:
            if config == "channels_last":
                model = model.to(memory_format=torch.channels_last)
                xs = x.contiguous(memory_format=torch.channels_last)
            elif config == "compile":
                model = torch.compile(model)
            step = bench(model, xs, y, a.steps, a.warmup)
        except Exception as e:  # a configuration that does not run here says why
            print(f"torch_densenet config={config} failed={type(e).__name__}", flush=True)
            continue
        print(f"torch_densenet config={config} samples_per_s={a.batch / step:.1f} "
              f"median_step_ms={step * 1e3:.2f} batch={a.batch} threads={a.threads}", flush=True)


if __name__ == "__main__":
    main()
