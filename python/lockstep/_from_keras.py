"""`from_keras`: a Keras 3 model (Sequential or functional) as a lockstep model, from its
config (`get_config()`: layers, each naming its inbound layers, which lockstep's graph spec
follows field by field) and its current weights; and those weights' way back
(`model.set_weights`).

Keras lays images out channels-last (N, H, W, C), lockstep channels-first (N, C, H, W): the
model's input, every axis a layer names and the kernels are carried across (a Conv2D's
kernel (kh, kw, in, out) is lockstep's (out, in, kh, kw), a Dense's (in, out) its (out,
in)), and a Flatten of an image first puts its values in Keras's order, so that the Dense
after it keeps its kernel. The data `fit` is given stays Keras's (`layout="NHWC"`).

Owns: the table from Keras layer to lockstep layer, the weights' layouts both ways.
"""

import numpy as np

from ._from_torch import Model

# Keras's (N, H, W, C) axes as lockstep's (N, C, H, W) ones.
_IMAGE_AXIS = {0: 0, 1: 2, 2: 3, 3: 1}

_ACTIVATIONS = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh", "silu": "silu", "swish": "silu", "gelu": "gelu", "softmax": "softmax"}


def from_keras(model):
    """The lockstep model of a built Keras 3 model: its layers from its config, its
    weights as they are now. A layer lockstep has no counterpart for is a ValueError
    naming it, its class and the classes lockstep maps."""
    config = model.get_config()
    layers = config.get("layers")
    if layers is None:
        raise ValueError("from_keras: the model has no layers in its config (build it, or give a Sequential or functional model)")
    by_name = {l.name: l for l in model.layers}
    c = _Converter(model, by_name)
    for entry in layers:
        c.layer(entry)
    outputs = config.get("output_layers") or []
    if outputs and isinstance(outputs[0], str):
        outputs = [outputs]  # one output: [name, node, tensor]
    if len(outputs) > 1:
        raise ValueError("from_keras: the model has several outputs; lockstep's has one, the logits")
    last = c.names[outputs[0][0]] if outputs else c.spec_layers[-1]["name"]
    i = next(k for k, l in enumerate(c.spec_layers) if l["name"] == last)
    c.spec_layers.append(c.spec_layers.pop(i))
    if c.input_shape is None:
        raise ValueError("from_keras: the model states no input shape (keras.Input(shape=...))")
    spec = {"input_shape": c.input_shape, "layers": c.spec_layers}
    m = Model(spec, c.weights, "NHWC" if len(c.input_shape) == 3 else None, f"{model.name} (from Keras)")
    m.keras_back = c.back
    return m


class _Converter:
    def __init__(self, model, by_name):
        self.model = model
        self.by_name = by_name
        self.spec_layers = []
        self.names = {}  # Keras layer name -> the lockstep layer giving its output
        self.rank = {}  # Keras layer name -> its output's rank per sample
        self.weights = {}  # lockstep tensor name -> array (lockstep's layout)
        self.back = []  # per Keras weight, in model.weights order: (lockstep name, to Keras layout)
        self.input_shape = None
        self.sequential_prev = None

    def refuse(self, entry, why):
        return ValueError(
            f"from_keras: layer {entry.get('name')} ({entry.get('class_name')}) {why}. lockstep maps: InputLayer, "
            "Rescaling, Conv2D, DepthwiseConv2D, BatchNormalization, Dense, Activation, ReLU, Dropout, Flatten, Reshape, "
            "Permute, GlobalAveragePooling2D, MaxPooling2D, AveragePooling2D, UpSampling2D, Add, Multiply, Concatenate, "
            "LayerNormalization, RMSNormalization, Softmax"
        )

    def inbound(self, entry):
        """The Keras layer names an entry reads, in order."""
        nodes = entry.get("inbound_nodes") or []
        if not nodes:
            return [self.sequential_prev] if self.sequential_prev else []
        if len(nodes) > 1:
            raise self.refuse(entry, "is called more than once (shared); lockstep's layers are called once")
        args = nodes[0]["args"]
        tensors = args[0] if len(args) == 1 and isinstance(args[0], list) else args
        out = []
        for t in tensors:
            if isinstance(t, dict) and t.get("class_name") == "__keras_tensor__":
                out.append(t["config"]["keras_history"][0])
        return out

    def add(self, name, layer, reads):
        layer["name"] = name
        layer["inbound"] = reads
        self.spec_layers.append(layer)
        return name

    def layer(self, entry):
        cls, cfg, name = entry["class_name"], entry["config"], entry.get("name") or entry["config"]["name"]
        if cls == "InputLayer":
            shape = list(cfg.get("batch_shape") or cfg.get("batch_input_shape"))[1:]
            if None in shape:
                raise self.refuse(entry, f"has an unknown dimension in its shape {shape}")
            self.input_shape = [shape[2], shape[0], shape[1]] if len(shape) == 3 else shape
            self.names[name] = "input"
            self.rank[name] = len(shape)
            self.sequential_prev = name
            return
        reads = self.inbound(entry)
        if not reads:
            raise self.refuse(entry, "reads nothing (a Sequential without an input shape?)")
        ins = [self.names[r] for r in reads]
        rank = self.rank[reads[0]]
        image = rank == 3
        keras_layer = self.by_name[name]
        w = {v.path.rsplit("/", 1)[-1]: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in keras_layer.weights}
        out = name
        act = cfg.get("activation", "linear")
        if act not in ("linear", None) and act not in _ACTIVATIONS:
            raise self.refuse(entry, f"has activation {act}")
        if cls == "Rescaling":
            self.add(name, {"type": "rescaling", "scale": float(cfg["scale"]), "offset": float(cfg["offset"])}, ins)
        elif cls in ("Conv2D", "DepthwiseConv2D"):
            if cfg.get("data_format", "channels_last") != "channels_last" or list(cfg.get("dilation_rate", [1, 1])) != [1, 1]:
                raise self.refuse(entry, "is channels-first or dilated")
            kernel = w["kernel"]  # (kh, kw, in/groups, out) or depthwise (kh, kw, in, mult)
            if cls == "DepthwiseConv2D":
                cin, mult = kernel.shape[2], kernel.shape[3]
                filters, groups = cin * mult, cin
                lock = kernel.reshape(kernel.shape[0], kernel.shape[1], 1, cin * mult).transpose(3, 2, 0, 1)
                back_kernel = lambda a, s=kernel.shape: a.transpose(2, 3, 1, 0).reshape(s)  # noqa: E731
            else:
                filters, groups = int(cfg["filters"]), int(cfg.get("groups", 1))
                lock = kernel.transpose(3, 2, 0, 1)
                back_kernel = lambda a: a.transpose(2, 3, 1, 0)  # noqa: E731
            layer = {"type": "conv2d", "filters": filters, "kernel_size": list(kernel.shape[:2]), "strides": list(cfg["strides"]),
                     "padding": cfg["padding"], "use_bias": bool(cfg["use_bias"]), "groups": groups}
            self.add(name, layer, ins)
            self.tensor(keras_layer, "kernel", f"{name}.weight", lock, back_kernel)
            if cfg["use_bias"]:
                self.tensor(keras_layer, "bias", f"{name}.bias", w["bias"], lambda a: a)
        elif cls == "BatchNormalization":
            axis = cfg.get("axis", -1)
            axis = axis[0] if isinstance(axis, list) and len(axis) == 1 else axis
            if axis not in (-1, rank):
                raise self.refuse(entry, f"normalises axis {axis}, not the channels")
            layer = {"type": "batch_normalization", "names": "keras", "epsilon": float(cfg["epsilon"]), "momentum": float(cfg["momentum"]),
                     "scale": bool(cfg["scale"]), "center": bool(cfg["center"]), "synchronized": bool(cfg.get("synchronized", False))}
            self.add(name, layer, ins)
            for k, lock_name in (("gamma", "gamma"), ("beta", "beta"), ("moving_mean", "running_mean"), ("moving_variance", "running_var")):
                if k in w:
                    self.tensor(keras_layer, k, f"{name}.{lock_name}", w[k], lambda a: a)
        elif cls == "Dense":
            if rank != 1:
                raise self.refuse(entry, f"reads a tensor of rank {rank} per sample; lockstep's Dense here reads vectors")
            self.add(name, {"type": "dense", "units": int(cfg["units"]), "use_bias": bool(cfg["use_bias"])}, ins)
            self.tensor(keras_layer, "kernel", f"{name}.weight", w["kernel"].T, lambda a: a.T)
            if cfg["use_bias"]:
                self.tensor(keras_layer, "bias", f"{name}.bias", w["bias"], lambda a: a)
        elif cls in ("ReLU", "Activation", "Softmax"):
            kind = "relu" if cls == "ReLU" else "softmax" if cls == "Softmax" else _ACTIVATIONS.get(act)
            if cls == "ReLU" and (cfg.get("max_value") is not None or cfg.get("negative_slope", 0) or cfg.get("threshold", 0)):
                raise self.refuse(entry, "is clipped, leaky or thresholded")
            if kind is None:
                raise self.refuse(entry, f"is activation {act}")
            if kind == "softmax" and image:
                raise self.refuse(entry, "is a softmax over an image's channels")
            self.add(name, {"type": kind}, ins)
            act = "linear"
        elif cls == "Dropout":
            self.add(name, {"type": "dropout", "rate": float(cfg["rate"])}, ins)
        elif cls == "Flatten":
            if image:
                # Keras's order: each pixel's channels together.
                self.add(name + "_channels_last", {"type": "permute", "dims": [2, 3, 1]}, ins)
                ins = [name + "_channels_last"]
            self.add(name, {"type": "flatten"}, ins)
            rank = 1
        elif cls == "GlobalAveragePooling2D":
            if cfg.get("keepdims"):
                raise self.refuse(entry, "keeps its dimensions")
            self.add(name, {"type": "global_average_pooling2d"}, ins)
            rank = 1
        elif cls in ("MaxPooling2D", "AveragePooling2D"):
            kind = "max_pooling2d" if cls == "MaxPooling2D" else "average_pooling2d"
            self.add(name, {"type": kind, "pool_size": list(cfg["pool_size"]), "strides": list(cfg["strides"] or cfg["pool_size"]),
                            "padding": cfg["padding"]}, ins)
        elif cls == "UpSampling2D":
            if cfg.get("interpolation", "nearest") != "nearest":
                raise self.refuse(entry, "interpolates other than nearest")
            self.add(name, {"type": "up_sampling2d", "size": list(cfg["size"])}, ins)
        elif cls in ("Add", "Multiply"):
            self.add(name, {"type": cls.lower()}, ins)
        elif cls == "Concatenate":
            axis = int(cfg.get("axis", -1))
            if image:
                axis = _IMAGE_AXIS[axis % 4]
            self.add(name, {"type": "concatenate", "axis": axis}, ins)
        elif cls in ("LayerNormalization", "RMSNormalization"):
            axis = cfg.get("axis", -1)
            if axis not in (-1, [-1], rank, [rank]) or image:
                raise self.refuse(entry, "normalises another axis than a vector's last")
            if cls == "RMSNormalization":
                self.add(name, {"type": "rms_normalization", "epsilon": float(cfg["epsilon"])}, ins)
                self.tensor(keras_layer, "scale", f"{name}.weight", w["scale"], lambda a: a)
            else:
                if not cfg.get("scale", True):
                    raise self.refuse(entry, "has no scale")
                self.add(name, {"type": "layer_norm", "eps": float(cfg["epsilon"]), "use_bias": bool(cfg.get("center", True))}, ins)
                self.tensor(keras_layer, "gamma", f"{name}.weight", w["gamma"], lambda a: a)
                if cfg.get("center", True):
                    self.tensor(keras_layer, "beta", f"{name}.bias", w["beta"], lambda a: a)
        elif cls in ("Reshape", "Permute"):
            if image or rank == 3 or len(cfg.get("target_shape", cfg.get("dims", []))) == 3:
                raise self.refuse(entry, "reshapes or permutes an image, whose axes lockstep orders otherwise")
            if cls == "Reshape":
                self.add(name, {"type": "reshape", "target_shape": list(cfg["target_shape"])}, ins)
                rank = len(cfg["target_shape"])
            else:
                self.add(name, {"type": "permute", "dims": list(cfg["dims"])}, ins)
        else:
            raise self.refuse(entry, "has no lockstep counterpart")
        if act not in ("linear", None):
            self.add(name + "_" + act, {"type": _ACTIVATIONS[act]}, [out])
            out = name + "_" + act
        self.names[name] = out
        self.rank[name] = rank
        self.sequential_prev = name

    def tensor(self, keras_layer, key, lock_name, value, to_keras):
        """A weight: lockstep's name and value, and the way back to its Keras variable."""
        self.weights[lock_name] = np.ascontiguousarray(value)
        var = next(v for v in keras_layer.weights if v.path.rsplit("/", 1)[-1] == key)
        self.back.append((var, lock_name, to_keras))
