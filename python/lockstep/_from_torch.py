"""`from_torch`: a PyTorch module as a lockstep model. The module's graph is captured with
`torch.export` (ATen ops, every shape known), each node mapped onto one layer of a
lockstep graph spec (the JSON of `lockstep train --model FILE.json`: layers with names and
inbound layers), its tensors named as the module's `state_dict` names them, and the
module's current weights kept as the run's start (`--init`).

Owns: the table from ATen op to layer, and what a node that has no layer is told. The
layers' meaning is the library's (docs/command-line.md, "Models without Rust").
"""

import numpy as np


class Model:
    """A model `fit` trains: its graph spec (`spec`, the JSON spec as a dict), its initial
    weights (`weights`, numpy arrays by name), the layout of its image inputs, and where
    it came from."""

    def __init__(self, spec, weights, layout, source):
        self.spec = spec
        self.weights = weights
        self.layout = layout
        self.source = source

    def __repr__(self):
        return f"<lockstep.Model from {self.source}: {len(self.spec['layers'])} layers>"


def from_torch(module, example_input):
    """The lockstep model of a PyTorch `module` run on `example_input` (one batch, the
    first dimension the batch): its graph by `torch.export`, its weights as they are now.
    A node lockstep has no layer for is a ValueError naming the node, its op, and the ops
    lockstep maps."""
    import torch

    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type != "cpu":
            raise ValueError(
                f"from_torch: the module's {name} is on {t.device}: lockstep reads the module's weights from the CPU (module.cpu()), and trains on the devices fit is given"
            )
    if not isinstance(example_input, torch.Tensor):
        example_input = torch.as_tensor(np.asarray(example_input))
    if example_input.device.type != "cpu":
        raise ValueError(f"from_torch: example_input is on {example_input.device}: give it on the CPU")
    # Token ids stay integers (an embedding reads them); any other input is read as f32.
    if not (example_input.dtype in (torch.int64, torch.int32) and not example_input.is_floating_point()):
        example_input = example_input.float()
    ep = torch.export.export(module, (example_input,))
    return _Converter(module, ep, example_input).model(f"{type(module).__name__} (from PyTorch)")


_UNARY = {"relu": "relu", "silu": "silu", "sigmoid": "sigmoid", "tanh": "tanh"}
_IDENTITY = {"contiguous", "clone", "alias", "detach", "_assert_tensor_metadata", "lift_fresh_copy"}


class _Converter:
    def __init__(self, module, ep, example_input):
        import torch

        self.torch = torch
        self.module = module
        self.ep = ep
        self.example = example_input
        self.layers = []
        self.names = {}  # fx node name -> lockstep layer name ("input" for the input)
        self.tensors = {}  # placeholder name -> state_dict key
        self.kinds = {}  # placeholder name -> PARAMETER or BUFFER
        self.used = set()  # layer names taken
        self.positions = {}  # fx node name -> (key, length): a positional table's rows 0..T
        self.inputs = []
        for spec in ep.graph_signature.input_specs:
            kind = spec.kind.name
            if kind in ("PARAMETER", "BUFFER"):
                self.tensors[spec.arg.name] = spec.target
                self.kinds[spec.arg.name] = kind
            elif kind == "USER_INPUT":
                self.inputs.append(spec.arg.name)
        if len(self.inputs) != 1:
            raise ValueError(f"from_torch: the module takes {len(self.inputs)} tensors; lockstep's fit gives one")
        self.names[self.inputs[0]] = "input"
        # Every name a tensor has (a tied tensor has several).
        self.aliases = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(name)

    # -- helpers

    def shape(self, node):
        """The node's output shape per sample (the batch left out)."""
        return list(node.meta["val"].shape[1:])

    def key(self, node):
        """The state_dict key of a weight node."""
        if node is None:
            return None
        if node.name not in self.tensors:
            raise self.refuse(node, "a tensor that is neither a parameter nor a buffer of the module")
        return self.tensors[node.name]

    def prefix(self, key, node=None, suffix="weight"):
        """The layer name whose tensors are `{name}.weight`..., of the tensor `key` that
        `node` reads, and the tensor it is tied to (or False): a tensor has one name a
        module that holds it (several where it is tied, as a GPT's token table and its
        head), and the node's own module, the innermost of its module stack, says which."""
        owner = self._param(key)
        names = [key] + [n for n in self.aliases.get(id(owner), []) if n != key] if owner is not None else [key]
        stack = list((node.meta.get("nn_module_stack") or {}).values()) if node is not None else []
        own = stack[-1][0] if stack else None
        ranked = sorted(names, key=lambda n: n.rpartition(".")[0] != own)
        for k in ranked:
            name, _, last = k.rpartition(".")
            if last == suffix and name not in self.used:
                taken = [n for n in names if n.rpartition(".")[0] in self.used]
                return name, bool(taken) and taken[0]
        raise ValueError(f"from_torch: tensor {key} is read by two layers; lockstep ties only a dense layer's weight to an earlier tensor")

    def trained(self, node, t, constant):
        """Whether tensor node `t` is a trained parameter; a buffer must then hold
        `constant` everywhere (the layer without that tensor computes the same)."""
        if t is None:
            return False
        if self.kinds.get(t.name) == "PARAMETER":
            return True
        value = self.module.get_buffer(self.key(t))
        if not bool((value == constant).all()):
            raise self.refuse(node, f"takes {self.key(t)}, a buffer that is not all {constant}, as a trained tensor")
        return False

    def _param(self, key):
        try:
            return self.module.get_parameter(key)
        except (AttributeError, KeyError):
            return None

    def refuse(self, node, why):
        return ValueError(
            f"from_torch: node {node.name} ({node.target}) {why}. lockstep maps: "
            "conv2d, linear, batch_norm, layer_norm, rms_norm, relu, gelu, silu, sigmoid, tanh, softmax, "
            "max_pool2d, avg_pool2d, adaptive_avg_pool2d (to 1×1), mean over the image, flatten, view, reshape, "
            "permute, transpose, add, mul, cat, split, matmul, dropout, embedding, scaled_dot_product_attention"
        )

    def emit(self, node, layer, inputs, name=None):
        name = name or node.name
        if name in self.used:
            raise self.refuse(node, f"would make a second layer named {name}")
        layer["name"] = name
        # An input is a node, or the name of a layer emitted for this node before.
        layer["inbound"] = [i if isinstance(i, str) else self.names[i.name] for i in inputs]
        self.used.add(name)
        self.layers.append(layer)
        self.names[node.name] = name

    # -- the walk

    def model(self, source):
        graph = self.ep.graph
        self.absorbed, self.patterns = set(), {}
        for node in graph.nodes:
            if node.op == "call_function":
                self.find_rms_norm(node)
                self.find_rotary(node)
        out = None
        for node in graph.nodes:
            if node.op == "placeholder" or node.name in self.absorbed:
                continue
            if node.name in self.patterns:
                self.patterns[node.name]()
                continue
            if node.op == "output":
                out = node.args[0]
                continue
            if node.op != "call_function":
                raise self.refuse(node, f"is a {node.op}")
            self.node(node)
        if isinstance(out, (tuple, list)):
            out = [o for o in out if o is not None]  # nanoGPT's (logits, None) without targets
        if not isinstance(out, (tuple, list)) or len(out) != 1:
            raise ValueError("from_torch: the module returns several tensors; lockstep's model has one output, the logits")
        last = self.names.get(out[0].name)
        if last is None or last == "input":
            raise ValueError("from_torch: the module's output is not computed by any layer")
        # The output's layer last: the spec's model output is its last layer's.
        i = next(k for k, l in enumerate(self.layers) if l["name"] == last)
        self.layers.append(self.layers.pop(i))
        spec = {"input_shape": list(self.example.shape[1:]), "layers": self.layers}
        state = self.module.state_dict(keep_vars=False)
        weights = {k: v.detach().cpu().numpy() for k, v in state.items()}
        layout = "NCHW" if self.example.dim() == 4 else None
        return Model(spec, weights, layout, source)

    def node(self, node):
        t = node.target
        op = getattr(t, "_opname", None) or str(t)
        overload = getattr(t, "_overloadname", "")
        a = node.args
        kw = node.kwargs
        if op in _IDENTITY or (op == "dropout" and a[1] == 0.0):
            self.names[node.name] = self.names[a[0].name]
            return
        if op == "add_" and a[0].name in self.tensors:
            return  # a BatchNorm's num_batches_tracked: the layer counts its own
        if op == "conv2d":
            x, w = a[0], a[1]
            b = a[2] if len(a) > 2 else None
            stride, padding = (list(a[3]) if len(a) > 3 else [1, 1]), (a[4] if len(a) > 4 else [0, 0])
            dilation, groups = (list(a[5]) if len(a) > 5 else [1, 1]), (a[6] if len(a) > 6 else 1)
            if dilation != [1, 1]:
                raise self.refuse(node, f"is dilated ({dilation}); lockstep's conv2d is not")
            key = self.key(w)
            name, _ = self.prefix(key, node)
            wv = w.meta["val"]
            layer = {"type": "conv2d", "filters": int(wv.shape[0]), "kernel_size": [int(wv.shape[2]), int(wv.shape[3])],
                     "strides": stride, "padding": padding if isinstance(padding, str) else list(padding),
                     "use_bias": b is not None, "groups": int(groups)}
            return self.emit(node, layer, [x], name)
        if op == "linear":
            x, w = a[0], a[1]
            b = a[2] if len(a) > 2 else None
            key = self.key(w)
            name, tied = self.prefix(key, node)
            layer = {"type": "dense", "units": int(w.meta["val"].shape[0]), "use_bias": b is not None}
            if tied:
                layer["tied_to"] = tied
            return self.emit(node, layer, [x], name)
        if op == "batch_norm":
            x, w, b, rm, rv = a[:5]
            momentum, eps = a[6], a[7]
            name = self.key(rm).rpartition(".")[0]
            # A scale or shift that is a constant buffer (ones, zeros) is no tensor of the
            # layer: Keras's BatchNormalization(scale=False) written in PyTorch.
            scale = self.trained(node, w, 1.0)
            center = self.trained(node, b, 0.0)
            keras = (scale and self.key(w).endswith(".gamma")) or (center and self.key(b).endswith(".beta"))
            layer = {"type": "batch_normalization", "names": "keras" if keras else "pytorch", "epsilon": float(eps),
                     "momentum": float(1.0 - momentum), "scale": scale, "center": center}
            return self.emit(node, layer, [x], name)
        if op == "layer_norm":
            x, shape = a[0], a[1]
            w = a[2] if len(a) > 2 else None
            b = a[3] if len(a) > 3 else None
            eps = a[4] if len(a) > 4 else 1e-5
            if len(shape) != 1 or w is None:
                raise self.refuse(node, "normalises more than the last dimension, or has no weight")
            name, _ = self.prefix(self.key(w), node)
            return self.emit(node, {"type": "layer_norm", "eps": float(eps), "use_bias": b is not None}, [x], name)
        if op == "rms_norm":
            x, shape = a[0], a[1]
            w = a[2] if len(a) > 2 else None
            eps = a[3] if len(a) > 3 else None
            if len(shape) != 1 or w is None or eps is None:
                raise self.refuse(node, "normalises more than the last dimension, or has no weight or epsilon")
            name, _ = self.prefix(self.key(w), node)
            return self.emit(node, {"type": "rms_normalization", "epsilon": float(eps)}, [x], name)
        if op in _UNARY:
            return self.emit(node, {"type": _UNARY[op]}, [a[0]])
        if op == "gelu":
            if kw.get("approximate", a[1] if len(a) > 1 else "none") != "none":
                raise self.refuse(node, "is the tanh approximation of GELU; lockstep's is the exact one")
            return self.emit(node, {"type": "gelu"}, [a[0]])
        if op in ("softmax", "_softmax"):
            if a[1] not in (-1, len(node.meta["val"].shape) - 1):
                raise self.refuse(node, "is over another axis than the last")
            return self.emit(node, {"type": "softmax"}, [a[0]])
        if op == "dropout":
            return self.emit(node, {"type": "dropout", "rate": float(a[1])}, [a[0]])
        if op == "max_pool2d":
            k = list(a[1])
            s = list(a[2]) if len(a) > 2 and a[2] else k
            p = list(a[3]) if len(a) > 3 else [0, 0]
            if (len(a) > 4 and list(a[4]) != [1, 1]) or (len(a) > 5 and a[5]):
                raise self.refuse(node, "is dilated or rounds up (ceil_mode)")
            return self.emit(node, {"type": "max_pooling2d", "pool_size": k, "strides": s, "padding": p}, [a[0]])
        if op == "avg_pool2d":
            k = list(a[1])
            s = list(a[2]) if len(a) > 2 and a[2] else k
            p = list(a[3]) if len(a) > 3 else [0, 0]
            if (len(a) > 4 and a[4]) or (len(a) > 5 and not a[5] and p != [0, 0]) or (len(a) > 6 and a[6] is not None):
                raise self.refuse(node, "rounds up, leaves padding out of its count, or overrides its divisor")
            return self.emit(node, {"type": "average_pooling2d", "pool_size": k, "strides": s, "padding": p}, [a[0]])
        if op in ("adaptive_avg_pool2d", "mean"):
            x = a[0]
            whole = (op == "adaptive_avg_pool2d" and list(a[1]) == [1, 1]) or (
                op == "mean" and sorted(d % 4 for d in a[1]) == [2, 3] and len(x.meta["val"].shape) == 4
            )
            if not whole:
                raise self.refuse(node, "pools to more than one value a channel")
            if len(self.shape(node)) == 1:
                return self.emit(node, {"type": "global_average_pooling2d"}, [x])
            # PyTorch keeps the 1×1 image: the pooled channels, then that shape.
            pooled = node.name + "_pool"
            self.emit(node, {"type": "global_average_pooling2d"}, [x], pooled)
            return self.emit(node, {"type": "reshape", "target_shape": self.shape(node)}, [pooled])
        if op in ("flatten", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze"):
            return self.reshape_to(node, a[0])
        if op in ("transpose", "permute"):
            x = a[0]
            rank = len(x.meta["val"].shape)
            if op == "transpose":
                i, j = a[1] % rank, a[2] % rank
                dims = list(range(rank))
                dims[i], dims[j] = dims[j], dims[i]
            else:
                dims = [d % rank for d in a[1]]
            if dims[0] != 0:
                raise self.refuse(node, "moves the batch dimension")
            return self.emit(node, {"type": "permute", "dims": dims[1:]}, [x])
        if op in ("add", "sub", "mul", "div") and not hasattr(a[1], "meta"):
            # A tensor and a number: x·s, x/s (as x·(1/s)), x + o, x − o.
            c = float(a[1]) * (a[2] if op in ("add", "sub") and len(a) > 2 else 1)
            scale, offset = {"mul": (c, 0.0), "div": (1.0 / c, 0.0), "add": (1.0, c), "sub": (1.0, -c)}[op]
            return self.emit(node, {"type": "rescaling", "scale": scale, "offset": offset}, [a[0]])
        if op in ("add", "mul") and overload == "Tensor":
            x, y = a[0], a[1]
            for p in (x, y):
                if p.name in self.positions:
                    other = y if p is x else x
                    key, length, table = self.positions[p.name]
                    name, _ = self.prefix(key, table)
                    return self.emit(node, {"type": "positional_embedding", "length": length}, [other], name)
            kind = "add" if op == "add" else "multiply"
            if list(x.meta["val"].shape) != list(y.meta["val"].shape):
                raise self.refuse(node, f"broadcasts {list(x.meta['val'].shape)} against {list(y.meta['val'].shape)}")
            return self.emit(node, {"type": kind}, [x, y])
        if op == "cat":
            parts, dim = a[0], (a[1] if len(a) > 1 else 0)
            if dim % len(node.meta["val"].shape) == 0:
                raise self.refuse(node, "concatenates along the batch")
            return self.emit(node, {"type": "concatenate", "axis": int(dim)}, list(parts))
        if op in ("matmul", "bmm"):
            return self.emit(node, {"type": "matmul"}, [a[0], a[1]])
        if op == "embedding":
            w, ids = a[0], a[1]
            key = self.key(w)
            if ids.op == "call_function" and getattr(ids.target, "_opname", "") == "arange":
                self.positions[node.name] = (key, int(w.meta["val"].shape[0]), node)
                return
            name, tied = self.prefix(key, node)
            if tied:
                raise self.refuse(node, f"reads {key}, which an earlier layer holds; lockstep ties a dense layer's weight to an embedding, not the other way")
            wv = w.meta["val"]
            return self.emit(node, {"type": "embedding", "vocab": int(wv.shape[0]), "width": int(wv.shape[1])}, [ids], name)
        if op == "arange":
            return  # read by a positional table (above), or refused where another op reads it
        if op == "scaled_dot_product_attention":
            q, k, v = a[:3]
            mask = a[3] if len(a) > 3 else kw.get("attn_mask")
            p = a[4] if len(a) > 4 else kw.get("dropout_p", 0.0)
            causal = a[5] if len(a) > 5 else kw.get("is_causal", False)
            scale = kw.get("scale", a[6] if len(a) > 6 else None)
            if mask is not None or p:
                raise self.refuse(node, "has a mask or dropout; lockstep's takes is_causal only")
            layer = {"type": "scaled_dot_product_attention", "causal": bool(causal)}
            if scale is not None:
                layer["scale"] = float(scale)
            return self.emit(node, layer, [q, k, v])
        if op in ("split", "split_with_sizes", "chunk"):
            x, size = a[0], a[1]
            dim = a[2] if len(a) > 2 else 0
            n = x.meta["val"].shape[dim]
            if op == "chunk":
                size = -(-n // size)  # torch.chunk's parts: ceil(n / chunks) each
            sizes = list(size) if op == "split_with_sizes" else [min(size, n - i) for i in range(0, n, size)]
            self.splits = getattr(self, "splits", {})
            self.splits[node.name] = (x, int(dim), sizes)
            return
        if getattr(t, "__name__", "") == "getitem":
            src, index = a[0], a[1]
            if src.name not in getattr(self, "splits", {}):
                raise self.refuse(node, "takes an item of what is not a split")
            x, dim, sizes = self.splits[src.name]
            return self.emit(node, {"type": "split", "axis": dim, "sizes": sizes, "index": int(index)}, [x])
        raise self.refuse(node, "has no lockstep layer")

    # -- layers written out in elementwise ops

    @staticmethod
    def _op(node, *names):
        return node is not None and hasattr(node, "target") and node.op == "call_function" and getattr(node.target, "_opname", None) in names

    @staticmethod
    def _only_user(node):
        users = list(node.users)
        return users[0] if len(users) == 1 else None

    def find_rms_norm(self, r):
        """Meta's RMSNorm, `x * rsqrt(mean(x²) + eps) * weight` over the last dimension,
        ending at the product with the weight: one `rms_normalization`."""
        if not self._op(r, "rsqrt"):
            return
        add = r.args[0]
        if not (self._op(add, "add") and not hasattr(add.args[1], "meta") and self._op(add.args[0], "mean")):
            return
        mean = add.args[0]
        if list(mean.args[1]) != [-1] or not (len(mean.args) > 2 and mean.args[2]) or not self._op(mean.args[0], "pow"):
            return
        pw = mean.args[0]
        x = pw.args[0]
        if pw.args[1] != 2:
            return
        m1 = self._only_user(r)
        if not (self._op(m1, "mul") and set(a.name for a in m1.args if hasattr(a, "name")) == {x.name, r.name}):
            return
        m2 = self._only_user(m1)
        if not self._op(m2, "mul"):
            return
        w = next((a for a in m2.args if hasattr(a, "name") and a.name in self.tensors), None)
        if w is None or len(w.meta["val"].shape) != 1:
            return
        eps = float(add.args[1])
        self.absorbed |= {pw.name, mean.name, add.name, r.name, m1.name}

        def emit():
            name, _ = self.prefix(self.key(w), m2)
            self.emit(m2, {"type": "rms_normalization", "epsilon": eps}, [x], name)

        self.patterns[m2.name] = emit

    def find_rotary(self, st):
        """Llama's rotary embedding in real arithmetic: x (N, T, H, D) as pairs
        (x[2i], x[2i+1]), times cos + i·sin of position t's angle t·θ^(−2i/D), stacked and
        reshaped back: one `rotary_embedding`, θ read off the module's tables."""
        if not (self._op(st, "stack") and len(st.args[0]) == 2 and st.args[1] in (-1, 4)):
            return
        sub, add = st.args[0]
        if not (self._op(sub, "sub") and self._op(add, "add")):
            return
        prods = [sub.args[0], sub.args[1], add.args[0], add.args[1]]
        if not all(self._op(p, "mul") for p in prods):
            return
        (s0, c), (s1, s_) = prods[0].args, prods[1].args
        if not (self._op(s0, "select") and self._op(s1, "select") and s0.args[0] is s1.args[0] and (s0.args[2], s1.args[2]) == (0, 1)):
            return
        pairs = s0.args[0]
        if not self._op(pairs, "reshape", "view", "_unsafe_view"):
            return
        x = pairs.args[0]
        out = self._only_user(st)
        if not (self._op(out, "reshape", "view", "_unsafe_view") and list(out.meta["val"].shape) == list(x.meta["val"].shape)):
            return
        tables = []
        for t in (c, s_):
            while self._op(t, "unsqueeze", "slice", "view", "reshape"):
                t = t.args[0]
            if getattr(t, "name", None) not in self.tensors:
                return
            tables.append(self.module.get_buffer(self.key(t)).detach().double())
        cos, sin = tables
        d = 2 * cos.shape[-1]
        theta = self.rotary_base(cos, sin, d, st)
        self.absorbed |= {pairs.name, s0.name, s1.name, sub.name, add.name, st.name} | {p.name for p in prods}
        for p in prods:
            for a in p.args:
                if hasattr(a, "name") and a.name not in self.tensors and a not in (s0, s1):
                    self.absorbed.add(a.name)
        self.patterns[out.name] = lambda: self.emit(out, {"type": "rotary_embedding", "base": theta}, [x])

    def rotary_base(self, cos, sin, d, node):
        """θ of a rotary table: the angle of pair 1 at position 1 is θ^(−2/D); every
        angle of the table must then be t·θ^(−2i/D) (to f32's rounding)."""
        import math

        if cos.shape[0] < 2 or d < 4:
            raise self.refuse(node, "has a rotary table too small to read its base from")
        freq = math.atan2(float(sin[1, 1]), float(cos[1, 1]))
        theta = freq ** (-d / 2)
        if abs(theta - round(theta)) < 1e-3 * theta:
            theta = float(round(theta))
        t = self.torch.arange(cos.shape[0], dtype=self.torch.float64)[:, None]
        i = self.torch.arange(d // 2, dtype=self.torch.float64)[None, :]
        angles = t * theta ** (-2 * i / d)
        if not (self.torch.allclose(angles.cos(), cos, atol=1e-4) and self.torch.allclose(angles.sin(), sin, atol=1e-4)):
            raise self.refuse(node, "multiplies pairs by tables that are not a rotary embedding's (position t, pair i: t·θ^(−2i/D))")
        return theta

    def reshape_to(self, node, x):
        """A reshape of x to the node's shape (the batch left first), or nothing where the
        shapes are one already."""
        shape = self.shape(node)
        if node.meta["val"].shape[0] != self.example.shape[0]:
            raise self.refuse(node, "reshapes across the batch")
        if shape == self.shape(x):
            self.names[node.name] = self.names[x.name]
            return
        layer = {"type": "flatten"} if len(shape) == 1 else {"type": "reshape", "target_shape": shape}
        return self.emit(node, layer, [x])
