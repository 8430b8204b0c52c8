#!/usr/bin/env python3
"""torch_convnet.py — the PyTorch reference for `lockstep bench step --model convnet`.

    python3 scripts/torch_convnet.py [--batch 256] [--steps 200] [--warmup 20] [--device cuda]
                                     [--cuda-graph] [--tf32]

Trains exactly the network of src/models.rs `convnet(ConvnetOptions::default())`, as
`lockstep bench step --model convnet` and `lockstep train` build it for the embedded digits
(input 1×28×28 u8 pixel values 0..255, 10 classes):

    Rescaling(1/255)
    Conv2d(1→12, 3×3, stride 1, Keras 'same', no bias)   → BN(12) → ReLU    28×28
    Conv2d(12→24, 6×6, stride 2, 'valid', no bias)       → BN(24) → ReLU    12×12
    Conv2d(24→32, 6×6, stride 2, Keras 'same', bias)     → BN(32) → ReLU     6×6
    GlobalAvgPool → Linear(32→256) → ReLU → Dropout(0.5) → Linear(256→10)
    softmax cross-entropy, mean over the global batch; Adam lr 1e-3, betas (0.9, 0.999),
    eps 1e-8, no weight decay, constant lr (bench step's TrainConfig::default());
    torch.optim.Adam's default implementation (foreach), as an eager user gets it.

BatchNorm is Keras's `BatchNormalization(scale=False, center=True)`, eps 1e-3
(`KerasBatchNorm`): PyTorch's batch norm with a scale of 1, not trained, and a trained
shift `beta`, the computation of BatchNorm2d(eps=1e-3) with its weight frozen at 1. The
module's state_dict is the weights file lockstep saves for the convnet, name for name
(`conv0.weight`, `bn0.beta`, `bn0.running_mean`, ...), so that file loads into `Convnet`
with load_state_dict(strict=True) (scripts/torch_models.py; docs/checkpoints.md). Keras
momentum m (the weight of the OLD running value; 0.9 in ConvnetOptions::default(),
which is `lockstep train`'s default, 0.99 in bench step) is PyTorch momentum 1 − m (the
weight of the NEW value); both update running_var with the unbiased batch variance. It
changes no timing. Keras 'same' pads ⌊total/2⌋ before and the rest after; here every
'same' padding is symmetric (28: 1/1, 12 with stride 2: 2/2), and an asymmetric one would
go through F.pad. The trainable parameter count printed (params=) must equal the count
`lockstep bench step` prints (49242).

Data: random pixel values 0..255 (f32) and labels 0..9, 8 distinct batches made on the
device before timing and cycled, as bench step cycles 8 batches (PyTorch is spared the
host-to-device copy of each batch: a conservative baseline).

Synchronisation: lockstep's coordinator reads every step's loss sum and correct count
back to the host (StepReport.metrics, what `train` logs per step), so this script reads
the loss and the number of correct predictions back once per step too (one
`.tolist()` of a 2-element tensor, i.e. one device-to-host copy and sync per step), and
nothing else. torch.cuda.synchronize() brackets the timed loop.

Precision: f32 everywhere by default (TF32 off for cuDNN convolutions and matmuls, as
lockstep computes in f32); --tf32 allows it. cudnn.benchmark is on (a tuned eager run).

Prints, for eager mode (no torch.compile, no CUDA graphs):
    torch_convnet samples_per_s=<float> batch=<B> steps=<n> device=<name> ...
and with --cuda-graph also, after it, the same step captured whole in one CUDA graph
(forward, backward, capturable Adam; the per-step loss read-back kept):
    torch_convnet_cudagraph samples_per_s=<float> batch=<B> steps=<n> device=<name> ...
(or `torch_convnet_cudagraph error=...` if capture fails; the eager figure stands). The
device name has its spaces replaced by '_'. Needs torch and the standard library only.
"""

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def same_pads(size, k, s):
    """Keras 'same' padding along one axis: (before, after), as src/ops/conv2d/ `pads`."""
    out = -(-size // s)  # ⌈size / s⌉
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


class KerasConv2d(nn.Conv2d):
    """nn.Conv2d with Keras 'same' or 'valid' padding on a fixed input size. Its tensors
    are nn.Conv2d's own (`weight`, `bias`), named as lockstep names them (`conv0.weight`)."""

    def __init__(self, cin, cout, k, stride, padding, bias, in_hw):
        h, w = in_hw
        if padding == "same":
            (top, bottom), (left, right) = same_pads(h, k, stride), same_pads(w, k, stride)
        else:
            top = bottom = left = right = 0
        symmetric = top == bottom and left == right
        super().__init__(cin, cout, k, stride=stride, padding=(top, left) if symmetric else 0, bias=bias)
        self.symmetric = symmetric
        self.keras_pad = (left, right, top, bottom)  # F.pad's order: last dimension first
        ph, pw = h + top + bottom, w + left + right
        self.out_hw = ((ph - k) // stride + 1, (pw - k) // stride + 1)

    def forward(self, x):
        if not self.symmetric:
            x = F.pad(x, self.keras_pad)
        return super().forward(x)


class KerasBatchNorm(nn.Module):
    """Keras's BatchNormalization(scale=False, center=True) over channels: a trained shift
    `beta`, no scale, and the running statistics. Its state_dict is what lockstep saves
    for one (`bn0.beta`, `bn0.running_mean`, `bn0.running_var`; Keras keeps no
    `num_batches_tracked`). Keras momentum m (the weight of the OLD running value) is
    PyTorch momentum 1 − m; both update running_var with the unbiased batch variance.
    The scale, 1, is passed as a tensor (a buffer that is not saved) so that PyTorch takes
    the same kernel as for nn.BatchNorm2d with its weight frozen at 1."""

    def __init__(self, channels, keras_momentum, eps=1e-3):
        super().__init__()
        self.beta = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("gamma", torch.ones(channels), persistent=False)
        self.momentum = 1.0 - keras_momentum
        self.eps = eps

    def forward(self, x):
        # x: (N, C, H, W) -> (N, C, H, W)
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.gamma, self.beta, self.training, self.momentum, self.eps
        )


class Convnet(nn.Module):
    """lockstep's `convnet` (`norm=True`) and `convnet-nobn` (`norm=False`), its state_dict
    the tensors of the weights file lockstep saves for it, name for name."""

    def __init__(self, input_chw=(1, 28, 28), classes=10, dropout=0.5, keras_bn_momentum=0.99, norm=True):
        super().__init__()
        c, h, w = input_chw

        def bn(channels):
            return KerasBatchNorm(channels, keras_bn_momentum) if norm else nn.Identity()

        self.conv0 = KerasConv2d(c, 12, 3, 1, "same", False, (h, w))
        self.bn0 = bn(12)
        self.conv1 = KerasConv2d(12, 24, 6, 2, "valid", False, self.conv0.out_hw)
        self.bn1 = bn(24)
        self.conv2 = KerasConv2d(24, 32, 6, 2, "same", True, self.conv1.out_hw)
        self.bn2 = bn(32)
        self.dense0 = nn.Linear(32, 256)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.dense1 = nn.Linear(256, classes)

    def forward(self, x):
        # x: (N, C, H, W) pixel values 0..255 -> (N, classes) logits
        x = x * (1.0 / 255.0)  # Rescaling(1/255)
        x = F.relu(self.bn0(self.conv0(x)))
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = x.mean(dim=(2, 3))  # GlobalAveragePooling2D
        x = self.dropout(F.relu(self.dense0(x)))
        return self.dense1(x)


def make_batches(batch, device, count=8, input_chw=(1, 28, 28), classes=10, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    xs = [torch.randint(0, 256, (batch, *input_chw), generator=g).float().to(device) for _ in range(count)]
    ys = [torch.randint(0, classes, (batch,), generator=g).to(device) for _ in range(count)]
    return xs, ys


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_tf32(on):
    """TF32 in cuDNN convolutions (PyTorch's default: on) and matmuls (default: off)."""
    try:
        torch.backends.cudnn.allow_tf32 = on
        torch.backends.cuda.matmul.allow_tf32 = on
    except Exception:  # a torch that only has the newer fp32_precision settings
        precision = "tf32" if on else "ieee"
        torch.backends.cudnn.conv.fp32_precision = precision
        torch.backends.cuda.matmul.fp32_precision = precision


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "_")
    return f"cpu_{torch.get_num_threads()}threads"


def run_eager(args, device):
    torch.manual_seed(0)
    model = Convnet(keras_bn_momentum=args.keras_bn_momentum, dropout=args.dropout).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    xs, ys = make_batches(args.batch, device)

    def step(i):
        x, y = xs[i % len(xs)], ys[i % len(ys)]
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        correct = (logits.argmax(dim=1) == y).sum()
        # The only read-back, as lockstep's per-step metrics: loss and correct count.
        return torch.stack((loss.detach(), correct.to(loss.dtype))).tolist()

    for i in range(args.warmup):
        step(i)
    sync(device)
    times = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        ts = time.perf_counter()
        loss, _ = step(args.warmup + i)
        times.append(time.perf_counter() - ts)
    sync(device)
    elapsed = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss}")
    return model, elapsed, times, loss


def run_cuda_graph(args, device):
    """The whole step (forward, backward, Adam) in one CUDA graph, after PyTorch's
    'whole network capture' recipe; the batch is copied into static inputs each step."""
    torch.manual_seed(0)
    model = Convnet(keras_bn_momentum=args.keras_bn_momentum, dropout=args.dropout).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, capturable=True)
    xs, ys = make_batches(args.batch, device)
    static_x, static_y = xs[0].clone(), ys[0].clone()

    def body():
        logits = model(static_x)
        loss = F.cross_entropy(logits, static_y)
        loss.backward()
        opt.step()
        correct = (logits.argmax(dim=1) == static_y).sum()
        return torch.stack((loss.detach(), correct.to(loss.dtype)))

    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up on a side stream before capture, as the recipe asks
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_out = body()

    def step(i):
        static_x.copy_(xs[i % len(xs)])
        static_y.copy_(ys[i % len(ys)])
        graph.replay()
        return static_out.tolist()

    for i in range(args.warmup):
        step(i)
    sync(device)
    times = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        ts = time.perf_counter()
        loss, _ = step(args.warmup + i)
        times.append(time.perf_counter() - ts)
    sync(device)
    elapsed = time.perf_counter() - t0
    if not math.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss}")
    return elapsed, times, loss


def line(tag, args, device, elapsed, times, loss, params):
    return (
        f"{tag} samples_per_s={args.batch * args.steps / elapsed:.1f} batch={args.batch} steps={args.steps} "
        f"device={device_name(device)} warmup={args.warmup} median_step_ms={statistics.median(times) * 1e3:.4f} "
        f"mean_step_ms={elapsed * 1e3 / args.steps:.4f} params={params} "
        f"precision={'tf32' if args.tf32 else 'fp32'} last_loss={loss:.4f} torch={torch.__version__}"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description="PyTorch eager training of lockstep's convnet: samples/s")
    p.add_argument("--batch", type=int, default=256, help="global batch [256]")
    p.add_argument("--steps", type=int, default=200, help="timed steps [200]")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first [20]")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu [cuda if available, else cpu]")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam lr [1e-3, the CLI's default]")
    p.add_argument("--dropout", type=float, default=0.5, help="dropout rate [0.5]")
    p.add_argument(
        "--keras-bn-momentum", type=float, default=0.99, help="Keras BN momentum m; PyTorch gets 1 - m [0.99]"
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 in convolutions and matmuls")
    p.add_argument("--cuda-graph", action="store_true", help="also time the step captured in a CUDA graph")
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--batch and --steps must be at least 1, --warmup at least 0")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("torch_convnet: error: CUDA is not available to this torch", file=sys.stderr)
            return 2
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    set_tf32(args.tf32)

    model, elapsed, times, loss = run_eager(args, device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(line("torch_convnet", args, device, elapsed, times, loss, params), flush=True)
    if args.cuda_graph:
        if device.type != "cuda":
            print("torch_convnet_cudagraph error=needs_a_cuda_device", flush=True)
        else:
            try:
                elapsed, times, loss = run_cuda_graph(args, device)
                print(line("torch_convnet_cudagraph", args, device, elapsed, times, loss, params), flush=True)
            except Exception as e:  # the eager figure stands; say why this one is missing
                msg = f"{type(e).__name__}: {e}".splitlines()[0].replace(" ", "_")[:200]
                print(f"torch_convnet_cudagraph error={msg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
