"""The PyTorch module of lockstep's `--model densenet`: a small DenseNet-BC for 1x28x28
images (Huang et al. 2017, the bottleneck and compression variant), written here so that
its state_dict names are the ones lockstep's `models::densenet` gives its tensors.

What it owns: the module and its sizes. The reference cases (scripts/torch_densenet.py),
the benchmark (scripts/torch_densenet_bench.py) and `torch_models.build("densenet")` all
import it, so that the module is written once.

Shapes, for growth k = 12 and blocks (4, 4, 4) (lockstep's defaults):

    x: (N, 1, 28, 28), already (x/255 - mean) / std   (lockstep's `normalize` layer)
    features.conv0          3x3 conv, 1 -> 2k = 24, no bias         (N, 24, 28, 28)
    features.denseblock1    4 layers, each adding k channels         (N, 72, 28, 28)
    features.transition1    BN-ReLU-1x1 conv to half, AvgPool2d(2)   (N, 36, 14, 14)
    features.denseblock2                                             (N, 84, 14, 14)
    features.transition2                                             (N, 42, 7, 7)
    features.denseblock3                                             (N, 90, 7, 7)
    features.norm_final     BN, then ReLU and the mean over H, W     (N, 90)
    classifier              Linear(90, classes)                      (N, classes)

A dense layer is BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k) on everything before it, its k
channels concatenated after them (torch.cat along the channels). Every convolution is
bias-free; BatchNorm is PyTorch's (eps 1e-5, momentum 0.1, num_batches_tracked).
"""

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

GROWTH = 12
BLOCKS = (4, 4, 4)
BOTTLENECK = 4  # the 1x1 convolution's width, in growths
COMPRESSION = 0.5  # a transition keeps this share of its channels


class DenseLayer(nn.Module):
    def __init__(s, cin, growth):
        super().__init__()
        s.norm1 = nn.BatchNorm2d(cin)
        s.conv1 = nn.Conv2d(cin, BOTTLENECK * growth, 1, bias=False)
        s.norm2 = nn.BatchNorm2d(BOTTLENECK * growth)
        s.conv2 = nn.Conv2d(BOTTLENECK * growth, growth, 3, padding=1, bias=False)

    def forward(s, x):
        # x: (N, cin, H, W) -> (N, cin + growth, H, W)
        h = s.conv1(F.relu(s.norm1(x)))
        h = s.conv2(F.relu(s.norm2(h)))
        return torch.cat([x, h], 1)


class Transition(nn.Module):
    def __init__(s, cin, cout):
        super().__init__()
        s.norm = nn.BatchNorm2d(cin)
        s.conv = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(s, x):
        # x: (N, cin, H, W) -> (N, cout, H/2, W/2)
        return F.avg_pool2d(s.conv(F.relu(s.norm(x))), 2)


class DenseNet(nn.Module):
    def __init__(s, growth=GROWTH, blocks=BLOCKS, classes=10):
        super().__init__()
        c = 2 * growth
        features = OrderedDict(conv0=nn.Conv2d(1, c, 3, padding=1, bias=False))
        for b, layers in enumerate(blocks, start=1):
            block = OrderedDict()
            for i in range(1, layers + 1):
                block[f"denselayer{i}"] = DenseLayer(c, growth)
                c += growth
            features[f"denseblock{b}"] = nn.Sequential(block)
            if b < len(blocks):
                features[f"transition{b}"] = Transition(c, int(c * COMPRESSION))
                c = int(c * COMPRESSION)
        features["norm_final"] = nn.BatchNorm2d(c)
        s.features = nn.Sequential(features)
        s.classifier = nn.Linear(c, classes)

    def forward(s, x):
        # x: (N, 1, 28, 28) -> (N, classes) logits
        return s.classifier(F.relu(s.features(x)).mean((2, 3)))
