"""lockstep for Python: synchronous data-parallel training in this one process, one thread
per device, the replicas kept bitwise identical. No fork, no launcher: it runs in a
notebook as it runs in a script.

    import lockstep
    history = lockstep.fit("convnet", x, y, epochs=3, devices="cpu:2")
    history.history["loss"], history.weights["conv1.weight"]

`fit`'s keyword arguments are `lockstep train`'s flags, `_` for `-`
(`batch_size=64` is `--batch-size 64`, `no_shuffle=True` is `--no-shuffle`), with the
same defaults: a keyword left out is a flag not given. The run is the command line's own
(the same checks, the same model, the same bytes); this module turns arrays and keywords
into its inputs and its results into Python's.

Owns: the arrays' checks before they reach the library (dtype, rank, layout, length,
contiguity), the keywords' translation, the progress display, `History`, the four calls
(`fit`, `evaluate`, `predict`, `generate`: `lockstep train`, `eval`, `predict` and
`generate` on data in memory) and reading a weights file (`load`). The native module
`_lockstep` owns nothing but the calls; `_from_torch` and `_from_keras` the converters.
"""

import contextlib
import json
import os
import re
import struct
import sys
import tempfile
import time

import numpy as np

from . import _lockstep
from ._from_keras import from_keras
from ._from_torch import Model, from_torch

__all__ = ["fit", "evaluate", "predict", "generate", "from_keras", "from_torch", "History", "Model", "load", "BUILTIN_MODELS"]

#: The built-in models `fit` trains by name (`lockstep train --model NAME`), as the library
#: lists them; the language models ("gpt", "llama") train on a text.
BUILTIN_MODELS = tuple(_lockstep.builtin_models())

_SAMPLE_DTYPES = (np.dtype(np.float32), np.dtype(np.uint8))
_LABEL_DTYPES = (np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.uint8))


class History:
    """What `fit` returns, as Keras's `History`: `history` is a dict of per-epoch lists
    ("loss", "accuracy", and "val_loss", "val_accuracy" with held-out data); `weights` the
    trained tensors as numpy arrays, named and laid out as PyTorch's `state_dict` names
    them (the file `save=` writes holds the same bytes); `stopped` why the run ended
    ("completed", "early_stopping", "interrupted", "time_limit"); `report` the run's
    summary as the command line prints it; `epochs` each epoch's row."""

    def __init__(self, result, model=None):
        self._model = model
        self.epochs = list(result["epochs"])
        keys = ["loss", "accuracy"]
        if any("val_loss" in e for e in self.epochs):
            keys += ["val_loss", "val_accuracy"]
        self.history = {k: [e.get(k) for e in self.epochs] for k in keys}
        self.weights = _tensors(result["weights"], "the trained weights")
        self._bytes = result["weights"]
        self.stopped = result["stopped"]
        self.steps = result["steps"]
        self.seconds = result["seconds"]
        self.samples_per_sec = result["samples_per_sec"]
        self.report = result["report"]
        self._html = result["html"]

    def load_into(self, target, strict=True):
        """Puts the trained weights into the model they came from: a Keras model of
        `from_keras` (`set_weights`, each kernel back in Keras's layout), or a PyTorch
        module (`load_state_dict`, `strict` by default: the module whose names the
        model's tensors carry)."""
        back = getattr(self._model, "keras_back", None)
        if back is not None and hasattr(target, "get_weights") and hasattr(target, "set_weights"):
            by_path = {var.path: (name, to_keras) for var, name, to_keras in back}
            values = []
            for v in target.weights:
                if v.path in by_path:
                    name, to_keras = by_path[v.path]
                    values.append(np.ascontiguousarray(to_keras(self.weights[name])).astype(np.asarray(v).dtype))
                elif strict:
                    raise ValueError(f"load_into: the Keras model's {v.path} is no tensor of the trained model")
                else:
                    values.append(np.asarray(v))
            target.set_weights(values)
            return None
        import torch

        state = {k: torch.from_numpy(v.copy()) for k, v in self.weights.items()}
        return target.load_state_dict(state, strict=strict)

    def __repr__(self):
        return f"<lockstep.History: {len(self.epochs)} epochs, {self.steps} steps, {self.stopped}>"

    def _repr_html_(self):
        return self._html


def fit(model, x, y=None, *, validation_data=None, layout=None, verbose=True, **flags):
    """Trains `model` on samples `x` and labels `y` on every device found (or `devices=`),
    and returns a `History`.

    model: a built-in model's name (`BUILTIN_MODELS`), a model spec (the JSON spec of
      `lockstep train --model FILE.json`) as a dict, or the path of such a file.
    x: a numpy array of samples: (N, F), (N, H, W) (one channel), or (N, C, H, W) /
      (N, H, W, C) with `layout="NCHW"` / `"NHWC"` said; uint8 or float32 (finite).
      Copied once into the run's dataset (an NHWC, strided or big-endian array once
      more before).
    y: (N,) integer class ids.
    A language model ("gpt", "llama") takes a text instead, as x: a str (its UTF-8 bytes),
      bytes, or a one-dimensional integer array of token ids, and no y; its last tenth by
      position is the validation part, as `lockstep train --data text:FILE` reads a file
      of the same bytes.
    validation_data: (x_val, y_val), evaluated after every epoch ("val_loss").
    verbose: the run's lines and a progress display (tqdm's bar where tqdm is installed).
    **flags: `lockstep train`'s flags, `_` for `-`: `epochs=3`, `batch_size=64`,
      `devices="cpu:2"`, `optimizer="adamw"`, `lr=1e-3`, `seed=0`, `save="w.safetensors"`,
      `no_shuffle=True`, ... (`lockstep train -h` lists them; their defaults are its own).

    Ctrl-C (or the notebook's stop button) ends the run after the step it is in: the
    History holds the weights of that step, and `stopped` is "interrupted".
    """
    name = None
    with tempfile.TemporaryDirectory(prefix="lockstep-") as tmp:
        argv = ["--model", _model_flag(model, tmp)]
        if isinstance(model, Model):
            # A converted model: its module's weights are the run's start.
            if "init" in flags:
                raise ValueError("init: a converted model starts from its module's weights; give no init=")
            init = os.path.join(tmp, "init.safetensors")
            _write_safetensors(init, model.weights)
            argv += ["--init", init]
            layout = layout or model.layout
            name = model.source
            # A language model's windows are its input's length.
            if model.spec["layers"][0]["type"] == "embedding" and "context" not in flags:
                argv.append(f"--context={model.spec['input_shape'][0]}")
        elif isinstance(model, dict):
            name = "the spec given"
        argv += _flags(flags)
        held = None
        tokens = isinstance(x, np.ndarray) and x.ndim == 1 and y is None and np.issubdtype(x.dtype, np.integer)
        if isinstance(x, (str, bytes, bytearray, memoryview)) or tokens:
            if y is not None or validation_data is not None:
                raise ValueError("y, validation_data: a text is its own labels (each token's next), and its last tenth validates")
            if tokens:
                # Token ids: int64, int32 or uint8 as they are, other integers converted.
                xs = _native(x if x.dtype.newbyteorder("=") in _LABEL_DTYPES else x.astype(np.int64))
            else:
                xs = x.encode("utf-8") if isinstance(x, str) else bytes(x)
            ys = None
        else:
            if y is None:
                raise ValueError("y: samples need their labels (a language model takes a str or bytes as x)")
            xs, ys = _samples(x, y, layout, "x", "y")
        if validation_data is not None:
            if not (isinstance(validation_data, (tuple, list)) and len(validation_data) == 2):
                raise ValueError("validation_data: expected a pair (x_val, y_val)")
            held = _samples(validation_data[0], validation_data[1], layout, "validation_data[0]", "validation_data[1]")
        display = _Progress(verbose)
        # The arrays (xs, ys, held) stay referenced until the call returns: the library
        # copies them into the run's datasets, under the interpreter's lock, before the run.
        try:
            with _refusals(flags):
                result = _lockstep.train(
                    argv,
                    _raw(xs) if isinstance(xs, np.ndarray) else xs,
                    None if ys is None else _raw(ys),
                    None if held is None else (_raw(held[0]), _raw(held[1])),
                    display.say,
                    display.event if verbose else None,
                    name,
                )
        finally:
            display.close()
    return History(result, model if isinstance(model, Model) else None)


def evaluate(model, x, y, weights, *, layout=None, **flags):
    """The loss and accuracy of `weights` (a History, a weights file, or a dict of arrays
    by name) on samples x and labels y, as `lockstep eval` scores them: a dict of "loss",
    "accuracy", "correct", "count" and "probabilities" (N × classes). `model`, x, y and
    `layout` as `fit` takes them; the keywords are `lockstep eval`'s flags (`devices=`,
    `classes=`)."""
    with tempfile.TemporaryDirectory(prefix="lockstep-") as tmp:
        argv, layout, said = _scoring_flags(model, weights, layout, flags, tmp)
        xs, ys = _samples(x, y, layout, "x", "y")
        with _refusals(said):
            r = _lockstep.evaluate(argv, _raw(xs), _raw(ys))
    r["probabilities"] = np.frombuffer(r["probabilities"], dtype="<f4").reshape(-1, r.pop("classes")).copy()
    return r


def predict(model, x, weights, *, layout=None, **flags):
    """Each input's class probabilities (N × classes) under `weights`, as `lockstep
    predict` computes them; the arguments as `evaluate`'s, without labels (`limit=` the
    first inputs only)."""
    with tempfile.TemporaryDirectory(prefix="lockstep-") as tmp:
        argv, layout, said = _scoring_flags(model, weights, layout, flags, tmp)
        xs, _ = _samples(x, np.zeros(len(x), dtype=np.int64) if hasattr(x, "__len__") else x, layout, "x", "y")
        with _refusals(said):
            k, probs = _lockstep.predict(argv, _raw(xs))
    return np.frombuffer(probs, dtype="<f4").reshape(-1, k).copy()


def generate(model, weights, prompt="\n", **flags):
    """Text a language model continues `prompt` with, as `lockstep generate` draws it
    (`tokens=`, `temperature=`, `top_k=`, `seed=`: its flags and defaults): the bytes it
    draws, decoded as UTF-8 where they are (a `str`; `bytes` otherwise). `model` a
    language model's name ("gpt", "llama"), a from_torch model or a spec; `weights` a
    History, a weights file or a dict of arrays."""
    with tempfile.TemporaryDirectory(prefix="lockstep-") as tmp:
        argv, _, said = _scoring_flags(model, weights, None, flags, tmp)
        if isinstance(prompt, bytes):
            prompt = prompt.decode("utf-8", errors="surrogateescape")
        argv.append(f"--prompt={prompt}")
        with _refusals(said):
            text = _lockstep.generate(argv)
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError:
        return text


def _scoring_flags(model, weights, layout, flags, tmp):
    """`eval`'s, `predict`'s and `generate`'s flags: --model and --weights for `model` and
    `weights` (written into `tmp` where they are in memory) and the keywords'; the samples'
    layout; and what the refusals call each flag (the keywords, and `weights`)."""
    argv = ["--model", _model_flag(model, tmp)]
    if isinstance(model, Model):
        layout = layout or model.layout
    path = os.path.join(tmp, "weights.safetensors")
    if isinstance(weights, History):
        with open(path, "wb") as f:
            f.write(weights._bytes)
    elif isinstance(weights, dict):
        _write_safetensors(path, weights)
    else:
        path = os.fspath(weights)
        if os.path.isdir(path):
            raise IsADirectoryError(f"weights: {path} is a directory, not a weights file")
    argv += ["--weights", path] + _flags(flags)
    return argv, layout, {**flags, "weights": path}


def load(path):
    """The tensors of a weights file (`save=`, `lockstep train --save`) as a dict of numpy
    arrays, by name."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: a directory, not a weights file")
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header's length)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > min(size - 8, 100 << 20):
            raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes in a file of {size})")
        f.seek(0)
        data = f.read()
    return _tensors(data, path)


# ---------------------------------------------------------------------------------------
# keywords and arrays


def _model_flag(model, tmp):
    """`--model`'s value: a name or a path as given, a spec (a dict, or a converted
    model's) written into the call's own temporary directory (removed when it returns)."""
    if isinstance(model, (dict, Model)):
        path = os.path.join(tmp, "model.json")
        with open(path, "w") as f:
            json.dump(model.spec if isinstance(model, Model) else model, f)
        return path
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        raise ValueError(
            f"model: expected a built-in model's name ({', '.join(BUILTIN_MODELS)}), a spec dict or a path, got {type(model).__name__}"
        )
    if os.path.isdir(model):
        raise IsADirectoryError(f"model: {model} is a directory, not a model spec file")
    if model not in BUILTIN_MODELS and not os.path.exists(model):
        raise FileNotFoundError(
            f"model: {model!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a file"
        )
    return model


def _flags(flags):
    """`lockstep train`'s flags of keywords: `name=value` → `--name value` (`_` for `-`),
    `name=True` → `--name`, `name=False` or None → left out (the flag's default)."""
    argv = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv.append(f"{flag}={','.join(str(v) for v in value)}")
        else:
            argv.append(f"{flag}={os.fspath(value) if isinstance(value, os.PathLike) else value}")
    return argv


@contextlib.contextmanager
def _refusals(flags):
    """The library's refusals, raised as their own kind in the keywords' words."""
    try:
        yield
    except ValueError as e:
        raise _keyword_error(e, flags) from None
    except (OSError, RuntimeError) as e:
        raise type(e)(_in_keywords(str(e), flags)) from None


def _keyword_error(e, flags):
    """A flag the parser does not know, said of the keyword that made it; any other
    refusal in the keywords' words."""
    text = str(e)
    for key in flags:
        if f"'--{key.replace('_', '-')}'" in text and "unexpected argument" in text:
            return ValueError(
                f"fit(): unknown keyword {key}: lockstep train has no --{key.replace('_', '-')} (lockstep train -h lists its flags)"
            )
    return ValueError(_in_keywords(text, flags))


# What the files a call writes into its own temporary directory are, in its messages.
_OWN_FILES = {"model.json": "the model's spec", "init.safetensors": "the model's own weights",
              "weights.safetensors": "the weights given"}


def _own_files_named(text):
    """`text` with the files a call wrote into its own temporary directory named by what
    they hold."""
    own = re.escape(tempfile.gettempdir()) + r"/lockstep-[^/'\s]+/(" + "|".join(map(re.escape, _OWN_FILES)) + ")"
    return re.sub(own, lambda m: _OWN_FILES[m.group(1)], text)


def _in_keywords(text, flags):
    """A message of the command line's with each flag given as a keyword written as that
    keyword (`--batch-size 0` → `batch_size=0`), and the files the call wrote for the
    run named by what they hold."""
    text = _own_files_named(text)
    for key in sorted(flags, key=len, reverse=True):
        flag = "--" + key.replace("_", "-")
        value = flags[key]
        value = os.fspath(value) if isinstance(value, os.PathLike) else value
        for given in (f"{flag} '{value}'", f"{flag} {value}", f"{flag}={value}"):
            text = text.replace(given, f"{key}={value!r}")
        text = text.replace(flag, key)
    return text


def _samples(x, y, layout, xname, yname):
    """x and y checked, as the library reads them: x (N, C, H, W) or (N, F) of float32 or
    uint8, y (N,) of int64, int32 or uint8, both C-contiguous and little-endian. Copies
    only what is not so already."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{xname}: expected a numpy array, got {type(x).__name__}")
    if not isinstance(y, np.ndarray):
        raise ValueError(f"{yname}: expected a numpy array of integer labels, got {type(y).__name__}")
    if x.dtype.newbyteorder("=") not in _SAMPLE_DTYPES:
        raise ValueError(f"{xname}: dtype {x.dtype}; expected uint8 or float32 (for example {xname}.astype(np.float32))")
    if x.ndim == 3:
        x = x[:, None, :, :]
    elif x.ndim == 4:
        if layout not in ("NCHW", "NHWC"):
            raise ValueError(f"{xname}: images of shape {x.shape}: say their layout, layout='NCHW' or layout='NHWC'")
        if layout == "NHWC":
            x = x.transpose(0, 3, 1, 2)
    elif x.ndim != 2:
        raise ValueError(f"{xname}: shape {x.shape}; expected (N, F), (N, H, W), or (N, C, H, W) / (N, H, W, C) with layout=")
    if y.ndim != 1:
        raise ValueError(f"{yname}: shape {y.shape}; expected (N,) class ids")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{yname}: dtype {y.dtype}; expected integer class ids")
    if len(x) != len(y):
        raise ValueError(f"{xname} holds {len(x)} samples and {yname} {len(y)} labels: they must be as many")
    if y.dtype.newbyteorder("=") not in _LABEL_DTYPES:
        y = y.astype(np.int64)
    return _native(x), _native(y)


def _native(a):
    """`a` C-contiguous and little-endian, copied only where it is not."""
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def _raw(a):
    """(dtype name, shape, address, bytes) of a C-contiguous array, which the caller keeps."""
    return (a.dtype.name, list(a.shape), a.ctypes.data, a.nbytes)


def _write_safetensors(path, tensors):
    """A safetensors file of numpy arrays by name: float ones as F32, integer ones as I64."""
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        kind = "I64" if np.issubdtype(a.dtype, np.integer) else "F32"
        data = np.ascontiguousarray(a, dtype="<i8" if kind == "I64" else "<f4").tobytes()
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


_DTYPES = {"F32": np.float32, "I64": np.int64, "F16": np.float16, "U8": np.uint8, "I32": np.int32}


def _tensors(data, origin):
    """The tensors of safetensors bytes, by name, each its own array."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(bytes(data[8 : 8 + n]))
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if t["dtype"] not in _DTYPES:
            raise ValueError(f"{origin}: tensor {name} has dtype {t['dtype']}, which this reader does not read")
        start, end = t["data_offsets"]
        out[name] = np.frombuffer(data, dtype=np.dtype(_DTYPES[t["dtype"]]).newbyteorder("<"), count=(end - start) // np.dtype(_DTYPES[t["dtype"]]).itemsize, offset=8 + n + start).reshape(t["shape"]).copy()
    return out


# ---------------------------------------------------------------------------------------
# the progress display


class _Progress:
    """The run's lines printed, its steps drawn: on tqdm's bar where tqdm is installed
    (the notebook's bar in Jupyter), else on one line that updates in place (a display
    that a notebook redraws, a terminal's carriage return); silent without `verbose`."""

    def __init__(self, verbose):
        self.verbose = verbose
        self.bar = None  # tqdm's bar; False once tqdm is known to be missing
        self.handle = None  # a notebook's display
        self.line = False  # a terminal line left open
        self.shown = 0.0

    def say(self, text):
        if self.verbose:
            self._end_line()
            print(_own_files_named(text), flush=True)

    def event(self, kind, fields):
        if not self.verbose:
            return
        if kind == "step":
            self._step(fields)
        elif kind == "epoch":
            self._close()
            held = ""
            if "val_loss" in fields:
                held = f" | val loss {fields['val_loss']:.4f} acc {fields['val_accuracy']:.4f}"
            print(
                f"epoch {fields['epoch'] + 1}/{fields['epochs']} | loss {fields['loss']:.4f} acc {fields['accuracy']:.4f}{held}"
                f" | {fields['samples_per_sec']:.0f} samples/s | {fields['seconds']:.2f}s",
                flush=True,
            )

    def _step(self, f):
        text = f"step {f['step']}/{f['total_steps']} | loss {f['loss']:.4f}"
        if self.bar is None:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=f["total_steps"], desc="lockstep", unit="step", leave=False)
            except ImportError:
                self.bar = False
        if self.bar:
            self.bar.n = f["step"]
            self.bar.set_postfix(loss=f"{f['loss']:.4f}", refresh=False)
            self.bar.refresh()
            return
        # At most ten redraws a second, and the last step's.
        now = time.monotonic()
        if now - self.shown < 0.1 and f["step"] != f["total_steps"]:
            return
        self.shown = now
        if "ipykernel" in sys.modules:
            from IPython.display import display

            if self.handle is None:
                self.handle = display({"text/plain": text}, raw=True, display_id=True)
            else:
                self.handle.update({"text/plain": text}, raw=True)
        else:
            sys.stdout.write("\r" + text)
            sys.stdout.flush()
            self.line = True

    def _close(self):
        if self.bar:
            self.bar.close()
        self.bar = None
        self.handle = None
        self._end_line()

    def _end_line(self):
        if self.line:
            sys.stdout.write("\n")
            self.line = False

    def close(self):
        self._close()
