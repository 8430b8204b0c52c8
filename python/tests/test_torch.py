"""`from_torch` on this project's PyTorch modules (scripts/torch_models.py: the lesson's
MLP, the Keras guide's convnet written in torch, resnet8, the DenseNet): each module's
graph captured, trained by `fit` from the module's own weights, the trained weights put
back with `load_state_dict(strict=True)`, and PyTorch's accuracy on them equal to
lockstep's on the same held-out samples. Skipped where torch is not installed."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import lockstep  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts"))
from torch_models import build  # noqa: E402


def learnable_images(n, seed):
    """n 1×28×28 uint8 images whose class (of 4) is which halves are brighter."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n, 1, 28, 28), dtype=np.uint8)
    top = x[:, 0, :14].mean((1, 2)) > x[:, 0, 14:].mean((1, 2))
    left = x[:, 0, :, :14].mean((1, 2)) > x[:, 0, :, 14:].mean((1, 2))
    return x, (top.astype(np.int64) + 2 * left)


@pytest.mark.parametrize(
    "name,devices,dtype", [("convnet", "cpu:2", np.uint8), ("convnet", "cpu:3", np.uint8), ("resnet8", "cpu:2", np.float32), ("densenet", "cpu:2", np.float32)]
)
def test_a_module_trains_and_its_weights_go_back(name, devices, dtype):
    torch.manual_seed(0)
    module = build(name, classes=10)
    x, y = learnable_images(384, 1)
    x = x.astype(dtype)
    xv, yv = x[:96], y[:96]
    model = lockstep.from_torch(module, torch.zeros(1, 1, 28, 28))
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    h = lockstep.fit(model, x, y, validation_data=(xv, yv), epochs=2, batch_size=48, devices=devices, verbose=False)
    assert h.stopped == "completed" and len(h.history["val_accuracy"]) == 2
    h.load_into(module)  # strict: every tensor of the module, none other
    assert any(not torch.equal(start[k], v) for k, v in module.state_dict().items()), "nothing trained"
    module.eval()
    with torch.no_grad():
        predicted = module(torch.from_numpy(xv).float()).argmax(1).numpy()
    assert (predicted == yv).mean() == h.history["val_accuracy"][-1]


def test_the_lessons_mlp():
    module = build("toy")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(200, 2)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] > 0).astype(np.int64)
    model = lockstep.from_torch(module, torch.zeros(1, 2))
    assert [l["type"] for l in model.spec["layers"]] == ["dense", "relu", "dense", "relu", "dense"]
    h = lockstep.fit(model, x, y, validation_data=(x[:50], y[:50]), epochs=3, batch_size=20, devices="cpu:4", verbose=False)
    h.load_into(module)
    with torch.no_grad():
        predicted = module(torch.from_numpy(x[:50])).argmax(1).numpy()
    assert (predicted == y[:50]).mean() == h.history["val_accuracy"][-1]


def test_a_node_without_a_layer_is_named():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.fc(torch.cumsum(x, 1))

    with pytest.raises(ValueError, match=r"node cumsum \(aten.cumsum.default\) has no lockstep layer.*lockstep maps: conv2d"):
        lockstep.from_torch(Odd(), torch.zeros(1, 4))


def test_a_module_off_the_cpu_is_refused():
    module = build("toy").to("meta")  # a device that is not the CPU, as a GPU would be
    with pytest.raises(ValueError, match=r"the module's dense0.weight is on meta: lockstep reads the module's weights from the CPU \(module.cpu\(\)\)"):
        lockstep.from_torch(module, torch.zeros(1, 2))


def test_nanogpts_gpt_trains_on_a_text_bitwise_on_1_and_2_devices():
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "test_fit.py"), "rb").read() * 4
    weights = []
    for devices in ("cpu:1", "cpu:2"):
        torch.manual_seed(0)
        module = build("gpt", context=16, layers=1, heads=2, width=32)
        model = lockstep.from_torch(module, torch.zeros(1, 16, dtype=torch.long))
        kinds = [l["type"] for l in model.spec["layers"]]
        assert kinds[:2] == ["embedding", "positional_embedding"] and "scaled_dot_product_attention" in kinds
        assert model.spec["layers"][-1]["tied_to"] == "transformer.wte.weight"
        h = lockstep.fit(model, text, steps=20, batch_size=8, replicas=2, devices=devices, verbose=False)
        assert h.stopped == "completed" and np.isfinite(h.history["val_loss"][-1])
        h.load_into(module)  # strict: the head's alias of the token table included
        weights.append(h.weights)
    assert all(weights[0][k].tobytes() == weights[1][k].tobytes() for k in weights[0])


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_language_models_graph_computes_pytorchs_loss(name):
    # 170 bytes: the last tenth, 17 bytes, is exactly one window of 16 and its next
    # tokens, so lockstep's held-out loss is that window's; lr 1e-30 leaves the weights
    # as the module's.
    import torch.nn.functional as F

    text = bytes((i * 37 + 11) % 251 for i in range(170))
    torch.manual_seed(0)
    module = build(name, context=16, layers=1, heads=2, width=32)
    model = lockstep.from_torch(module, torch.zeros(1, 16, dtype=torch.long))
    if name == "llama":
        kinds = [l["type"] for l in model.spec["layers"]]
        assert "rms_normalization" in kinds and kinds.count("rotary_embedding") == 2
        assert all(l["base"] == 10000.0 for l in model.spec["layers"] if l["type"] == "rotary_embedding")
    h = lockstep.fit(model, text, steps=1, lr=1e-30, batch_size=2, devices="cpu:2", verbose=False)
    window = torch.tensor(list(text[153:]))
    with torch.no_grad():
        out = module(window[None, :16])
        logits = out[0] if isinstance(out, tuple) else out
        reference = F.cross_entropy(logits[0], window[1:]).item()
    assert abs(h.history["val_loss"][0] - reference) < 1e-5
    h.load_into(module)  # strict


@pytest.mark.parametrize("name", ["toy", "convnet", "resnet8", "densenet"])
def test_a_built_in_models_history_loads_strictly_into_its_pytorch_module(name):
    x, y = learnable_images(64, 3)
    if name == "toy":
        x = np.random.default_rng(3).normal(size=(64, 2)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
    h = lockstep.fit(name, x, y, layout="NCHW", steps=2, batch_size=32, devices="cpu:2", classes=None if name == "toy" else 10, verbose=False)
    module = build(name) if name == "toy" else build(name, classes=10)
    h.load_into(module)  # strict: the names and shapes of its state_dict, every one


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_a_built_in_language_models_history_loads_strictly_into_its_pytorch_module(name):
    text = bytes(range(256)) * 8
    h = lockstep.fit(name, text, layers=1, heads=2, width=32, context=16, steps=2, batch_size=4, devices="cpu:2", verbose=False)
    h.load_into(build(name, context=16, layers=1, heads=2, width=32))
