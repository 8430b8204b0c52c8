"""lockstep's built-in models as PyTorch modules, for weights files to go both ways.

The module that `build(name)` returns for a `--model` name has the state_dict of the
weights file lockstep saves for that model: the same tensor names, the same shapes. So

    model = build("convnet")
    model.load_state_dict(safetensors.torch.load_file("convnet.safetensors"), strict=True)

loads a file that `lockstep train --model convnet --save convnet.safetensors` wrote (in
f32, bf16 or f16: load_state_dict converts), and the module's state_dict saved with
safetensors is a file `--init` loads. docs/checkpoints.md shows both directions and
tests/python_interop.rs runs them for every built-in model.

What it owns: the table from name to module, and the toy MLP's module. The other modules
are the ones this project's PyTorch references already train, kept here by import so that
each is written once: the convnet's is scripts/torch_convnet.py's (the benchmark's), the
ResNets' scripts/torch_resnet.py's (the residual networks' reference cases), the
DenseNet's scripts/torch_densenet_model.py's (its reference cases' and benchmark's), the GPT's
scripts/torch_gpt_model.py's (the transformer's reference cases), the Llama's
scripts/torch_llama_model.py's (its reference case).

A module is built for the sizes of the run that saved the file; the defaults below are
the command line's for the built-in data (`--data toy`, `digits`, `fashion-mnist`,
`fortunes`). Sizes that differ from the file's make load_state_dict name each tensor
whose shape differs.
"""

import os
import sys

from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_convnet import Convnet  # noqa: E402
from torch_densenet_model import DenseNet  # noqa: E402
from torch_gpt_model import GPT, GPTConfig  # noqa: E402
from torch_llama_model import Llama, LlamaConfig  # noqa: E402
from torch_resnet import ResNet  # noqa: E402

NAMES = ("toy", "convnet", "convnet-nobn", "resnet8", "resnet20", "densenet", "gpt", "llama")


class ToyMLP(nn.Module):
    """lockstep's `toy`: Linear(inputs, 30) → ReLU → Linear(30, 20) → ReLU → Linear(20,
    classes), its tensors `dense0.weight` (30, inputs), `dense0.bias`, ..., `dense2.bias`."""

    def __init__(self, inputs=2, classes=2):
        super().__init__()
        self.dense0 = nn.Linear(inputs, 30)
        self.dense1 = nn.Linear(30, 20)
        self.dense2 = nn.Linear(20, classes)

    def forward(self, x):
        # x: (N, inputs) -> (N, classes) logits
        return self.dense2(F.relu(self.dense1(F.relu(self.dense0(x)))))


def build(name, classes=None, inputs=2, input_chw=(1, 28, 28), context=64, layers=4, heads=4, width=128):
    """The PyTorch module of lockstep's built-in model `name` (one of NAMES).

    classes: the output count (`--classes`, else the data's): 2 for the toy, 10 for the
             convnets, ResNets and the DenseNet, the vocabulary (256, bytes) for the GPT and
             the Llama.
    inputs:  the toy's features per sample (2 for `--data toy`).
    input_chw: the convnets' image (channels, height, width); the ResNets and the DenseNet take 1×28×28.
    context, layers, heads, width: the GPT's and the Llama's `--context`, `--layers`,
             `--heads`, `--width` (the Llama's feed-forward width follows from `width`
             by Meta's rule, multiple_of 256, as `--model llama` builds it).
    """
    if name == "toy":
        return ToyMLP(inputs, classes or 2)
    if name in ("convnet", "convnet-nobn"):
        return Convnet(tuple(input_chw), classes or 10, norm=name == "convnet")
    if name in ("resnet8", "resnet20"):
        return ResNet(1 if name == "resnet8" else 3, classes or 10)
    if name == "densenet":
        return DenseNet(classes=classes or 10)
    if name == "gpt":
        config = GPTConfig(block_size=context, vocab_size=classes or 256, n_layer=layers, n_head=heads, n_embd=width)
        return GPT(config)
    if name == "llama":
        config = LlamaConfig(max_seq_len=context, vocab_size=classes or 256, n_layers=layers, n_heads=heads, dim=width)
        return Llama(config)
    raise ValueError(f"{name!r} is not a built-in model: expected one of {', '.join(NAMES)}")
