#!/usr/bin/env python3
"""PyTorch's training speed for the Llama on the CPU, the peer figure of
`lockstep bench step --model llama --devices cpu:2`.

One process, `torch.set_num_threads(THREADS)` (2: the cores lockstep's cpu:2 uses), this
project's PyTorch Llama (scripts/torch_llama_model.py) at nanoGPT's CPU recipe's sizes (4
layers, 4 heads, 128 wide, a window of 64, bytes; the feed-forward 512 wide, Meta's rule),
training mode, Adam lr 1e-3 (the optimiser `bench step` uses), batches of B windows of
random byte ids (the speed does not depend on the values), each configuration timed over
STEPS steps after WARMUP:
  eager      the module as written
  compile    torch.compile of the module (inductor), when it compiles here
The best is PyTorch's figure. One line per configuration:
  torch_llama config=<name> tokens_per_s=<float> median_step_ms=<float> batch=<B> threads=<T>
Usage: python scripts/torch_llama_bench.py [--batch 12] [--threads 2] [--steps 30]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_llama_model import Llama, LlamaConfig  # noqa: E402


def bench(model, x, y, steps, warmup):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--configs", default="eager,compile")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    rows = torch.randint(0, 256, (a.batch, a.context + 1))
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    for config in a.configs.split(","):
        model = Llama(LlamaConfig(max_seq_len=a.context, vocab_size=256, n_layers=4, n_heads=4, dim=128)).train()
        try:
            if config == "compile":
                model = torch.compile(model)
            step = bench(model, x, y, a.steps, a.warmup)
        except Exception as e:  # a configuration that does not run here says why
            print(f"torch_llama config={config} failed={type(e).__name__}: {e}", flush=True)
            continue
        tokens = a.batch * a.context
        print(f"torch_llama config={config} tokens_per_s={tokens / step:.0f} "
              f"median_step_ms={step * 1e3:.2f} batch={a.batch} threads={a.threads}", flush=True)


if __name__ == "__main__":
    main()
