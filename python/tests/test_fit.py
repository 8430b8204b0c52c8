"""The Python package against the command line and against bad input: the same weights,
bit for bit, for the same data and flags; each bad argument a Python exception naming
it; Ctrl-C ending the run after its step; the interpreter's lock free while it trains.

The command line's binary is $LOCKSTEP_BIN, else the repository's target/release/lockstep
(`cargo build --release`); the tests that compare with it say so and skip without it."""

import json
import os
import signal
import struct
import subprocess
import threading
import time

import numpy as np
import pytest

import lockstep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LOCKSTEP_BIN", os.path.join(ROOT, "target", "release", "lockstep"))


def images(n, seed):
    """n random 1×28×28 uint8 images and labels of 10 classes."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 1, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=n)


def write_dataset(path, x, y):
    """A dataset file (tensors x and y) of the arrays: x uint8 or float32, y integers."""
    kind = "U8" if x.dtype == np.uint8 else "F32"
    x = np.ascontiguousarray(x, dtype=np.uint8 if kind == "U8" else "<f4")
    y = np.asarray(y).astype("<i8")
    header = {
        "x": {"dtype": kind, "shape": list(x.shape), "data_offsets": [0, x.nbytes]},
        "y": {"dtype": "I64", "shape": [len(y)], "data_offsets": [x.nbytes, x.nbytes + y.nbytes]},
    }
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + x.tobytes() + y.tobytes())


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2", "cpu:3"])
def test_arrays_train_the_command_lines_bytes(tmp_path, devices):
    if not os.path.exists(BIN):
        pytest.skip(f"no lockstep binary at {BIN} (cargo build --release, or set LOCKSTEP_BIN)")
    x, y = images(120, 1)
    xv, yv = images(48, 2)
    write_dataset(tmp_path / "train.safetensors", x, y)
    write_dataset(tmp_path / "val.safetensors", xv, yv)
    flags = dict(epochs=2, batch_size=24, devices=devices, seed=3)
    cli = tmp_path / "cli.safetensors"
    argv = [BIN, "train", "--model", "convnet", "--data", str(tmp_path / "train.safetensors")]
    argv += ["--val-data", str(tmp_path / "val.safetensors"), "--save", str(cli)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    py = tmp_path / "py.safetensors"
    h = lockstep.fit("convnet", x, y, layout="NCHW", validation_data=(xv, yv), save=py, verbose=False, **flags)
    assert py.read_bytes() == cli.read_bytes()
    saved = lockstep.load(cli)
    assert saved.keys() == h.weights.keys()
    for k in saved:
        assert saved[k].tobytes() == h.weights[k].tobytes(), k
    assert h.stopped == "completed" and len(h.history["loss"]) == 2 and len(h.history["val_loss"]) == 2
    # The command line's last epoch line holds the same numbers.
    last = [l for l in done.stdout.splitlines() if l.startswith("epoch 2/2")][0]
    assert f"train loss {h.history['loss'][-1]:.4f}" in last


@pytest.mark.parametrize("model,devices", [("gpt", "cpu:2"), ("llama", "cpu:3")])
def test_a_text_trains_the_command_lines_bytes(tmp_path, model, devices):
    if not os.path.exists(BIN):
        pytest.skip(f"no lockstep binary at {BIN} (cargo build --release, or set LOCKSTEP_BIN)")
    text = "Ünïcode and plain words, over and over, for a small language model to read. " * 40
    (tmp_path / "t.txt").write_bytes(text.encode("utf-8"))
    flags = dict(layers=1, heads=2, width=32, context=16, steps=12, batch_size=6, devices=devices)
    cli = tmp_path / "cli.safetensors"
    argv = [BIN, "train", "--model", model, "--data", f"text:{tmp_path / 't.txt'}", "--save", str(cli)]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    h = lockstep.fit(model, text, verbose=False, **flags)
    # The same text as token ids (its bytes, as int64 and as int32): the same weights.
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    for tokens in (ids.astype(np.int64), ids.astype(np.int32)):
        t = lockstep.fit(model, tokens, verbose=False, **flags)
        assert all(t.weights[k].tobytes() == h.weights[k].tobytes() for k in h.weights)
    saved = lockstep.load(cli)
    assert saved.keys() == h.weights.keys()
    assert all(saved[k].tobytes() == h.weights[k].tobytes() for k in saved)
    assert h.steps == 12 and h.history["val_loss"][-1] > 0


def test_generate_draws_the_command_lines_text(tmp_path):
    if not os.path.exists(BIN):
        pytest.skip(f"no lockstep binary at {BIN} (cargo build --release, or set LOCKSTEP_BIN)")
    text = "the quick brown fox jumps over the lazy dog, again and again. " * 40
    h = lockstep.fit("gpt", text, layers=1, heads=2, width=32, context=16, steps=30, batch_size=8,
                     devices="cpu:2", save=tmp_path / "g.safetensors", verbose=False)
    flags = dict(tokens=40, seed=3, temperature=0.8)
    ours = lockstep.generate("gpt", h, prompt="the ", **flags)
    argv = [BIN, "generate", "--weights", str(tmp_path / "g.safetensors"), "--prompt", "the "]
    argv += [f"--{k}={v}" for k, v in flags.items()]
    done = subprocess.run(argv, capture_output=True)
    assert done.returncode == 0, done.stderr
    raw = ours if isinstance(ours, bytes) else ours.encode("utf-8")  # bytes where not UTF-8
    assert raw + b"\n" == done.stdout


def test_layouts_and_copies_read_the_same_samples():
    x, y = images(48, 4)
    flags = dict(epochs=1, batch_size=16, devices="cpu:2", verbose=False)
    base = lockstep.fit("convnet", x, y, layout="NCHW", **flags).weights
    nhwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))
    strided = np.repeat(x, 2, axis=0)[::2]  # not contiguous: copied
    readonly = x.copy()
    readonly.setflags(write=False)
    for kw in [dict(x=nhwc, layout="NHWC"), dict(x=x[:, 0]), dict(x=strided, layout="NCHW"), dict(x=readonly, layout="NCHW")]:
        w = lockstep.fit("convnet", kw.pop("x"), y.astype(np.int32), **kw, **flags).weights
        assert all(w[k].tobytes() == base[k].tobytes() for k in base)


def bad(exc, match, *args, **kwargs):
    kwargs.setdefault("verbose", False)
    with pytest.raises(exc, match=match):
        lockstep.fit(*args, **kwargs)


def test_bad_input_is_an_exception_naming_it(tmp_path):
    x, y = images(32, 5)
    bad(ValueError, "dtype float64", "convnet", x.astype(np.float64), y, layout="NCHW")
    bad(ValueError, "say their layout", "convnet", x, y)
    bad(ValueError, r"shape \(32, 784, 1, 1, 1\)", "convnet", x.reshape(32, 784, 1, 1, 1), y)
    bad(ValueError, "32 samples and y 31 labels", "convnet", x, y[:31], layout="NCHW")
    bad(ValueError, "integer class ids", "convnet", x, y.astype(np.float32), layout="NCHW")
    bad(ValueError, "label 12 of sample 0 is outside the 10 classes", "convnet", x, np.r_[12, y[1:]], layout="NCHW", classes=10)
    xf = x.astype(np.float32)
    xf[3, 0, 2, 2] = np.nan
    bad(ValueError, "NaN at sample 3", "convnet", xf, y, layout="NCHW")
    bad(ValueError, "unknown keyword bogus_flag", "convnet", x, y, layout="NCHW", bogus_flag=3)
    bad(ValueError, "batch_size must be at least 1", "convnet", x, y, layout="NCHW", batch_size=0)
    bad(OSError, "save='/nonexistent/dir/w.safetensors': directory '/nonexistent/dir' does not exist", "convnet", x, y, layout="NCHW", save="/nonexistent/dir/w.safetensors")
    bad(OSError, "init='.*': no such file", "convnet", x, y, layout="NCHW", init=str(tmp_path / "none.safetensors"))
    bad(RuntimeError, "non-finite loss", "convnet", x, y, layout="NCHW", lr=1e12, epochs=3, devices="cpu:2")
    bad(ValueError, "data='digits': the data is given in memory; give no data", "convnet", x, y, layout="NCHW", data="digits")
    bad(ValueError, "val_data: the data is given in memory; give its held-out set in memory too", "convnet", x, y, layout="NCHW", val_data="v.safetensors")
    bad(ValueError, "validation_split and a held-out set given in memory: choose one", "convnet", x, y, layout="NCHW", validation_split=0.2, validation_data=(x, y))
    bad(ValueError, "validation_data: expected a pair", "convnet", x, y, layout="NCHW", validation_data=x)
    bad(ValueError, "y: samples need their labels", "convnet", x, layout="NCHW")
    bad(IsADirectoryError, "is a directory", str(tmp_path), x, y, layout="NCHW")
    bad(FileNotFoundError, "neither a built-in model", "no-such-model", x, y, layout="NCHW")
    bad(ValueError, "language model trains on a text", "gpt", x, y, layout="NCHW")
    bad(ValueError, "the convnet model reads samples and labels", "convnet", "some text")
    bad(ValueError, "a text is its own labels", "gpt", "some text", y)
    bad(ValueError, "fewer than a window", "gpt", "too short", context=64)
    bad(ValueError, "token id -1 at position 1 is negative", "gpt", np.array([3, -1] * 500), context=8)
    bad(ValueError, "token id 256 of sample 256, position 0 is at or above the model.s vocabulary of 256", "gpt", np.arange(1000) % 301, context=8)
    bad(ValueError, r"^the model's spec: layer 0 \(dense\): unknown field 'bogus'", {"input_shape": [1, 28, 28], "layers": [{"type": "dense", "units": 10, "bogus": 1}]}, x, y, layout="NCHW")
    assert not any(tmp_path.iterdir())


def test_ctrl_c_ends_the_run_after_its_step_with_its_weights():
    x, y = images(2048, 6)
    tasks = len(os.listdir("/proc/self/task"))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    h = lockstep.fit("convnet", x, y, layout="NCHW", epochs=1000, batch_size=256, devices="cpu:2", verbose=False)
    timer.join()
    assert h.stopped == "interrupted"
    assert 0 < h.steps < 1000 * 8
    assert all(np.isfinite(v).all() for v in h.weights.values())
    assert len(os.listdir("/proc/self/task")) == tasks, "a thread of the run outlived it"


def test_another_python_thread_runs_while_it_trains():
    x, y = images(2048, 7)
    state = {"done": False, "last": time.perf_counter(), "gap": 0.0}

    def count():
        while not state["done"]:
            now = time.perf_counter()
            state["gap"] = max(state["gap"], now - state["last"])
            state["last"] = now

    t = threading.Thread(target=count)
    t.start()
    h = lockstep.fit("convnet", x, y, layout="NCHW", epochs=2, batch_size=1024, devices="cpu:2", verbose=False)
    state["done"] = True
    t.join()
    step = h.seconds / h.steps
    # Held through a step, the lock would stop the thread for a whole step at least.
    assert state["gap"] < step / 2, f"the thread waited {state['gap']:.3f} s; a step takes {step:.3f} s"


@pytest.mark.parametrize("devices", ["cpu:1", "cpu:2", "cpu:3"])
def test_evaluate_and_predict_score_the_weights_as_the_run_did(tmp_path, devices):
    x, y = images(96, 8)
    xv, yv = images(40, 9)
    h = lockstep.fit("convnet", x, y, layout="NCHW", validation_data=(xv, yv), epochs=1, batch_size=24, devices="cpu:2",
                     save=tmp_path / "w.safetensors", verbose=False)
    for weights in (h, tmp_path / "w.safetensors", h.weights):
        e = lockstep.evaluate("convnet", xv, yv, weights, layout="NCHW", devices=devices)
        # The loss is a sum over the devices' shares: its last bits follow their number.
        assert e["loss"] == pytest.approx(h.history["val_loss"][-1], rel=1e-6)
        assert e["accuracy"] == h.history["val_accuracy"][-1]
        assert e["count"] == 40 and e["probabilities"].shape == (40, 10)
        p = lockstep.predict("convnet", xv, weights, layout="NCHW", devices=devices)
        assert p.tobytes() == e["probabilities"].tobytes()
    assert lockstep.predict("convnet", xv, h, layout="NCHW", limit=5).shape == (5, 10)
    with pytest.raises(ValueError, match="a language model is scored on a text"):
        lockstep.evaluate("gpt", xv, yv, h, layout="NCHW")
    with pytest.raises(OSError, match="weights='.*none.safetensors': no such file"):
        lockstep.evaluate("convnet", xv, yv, tmp_path / "none.safetensors", layout="NCHW")
    with pytest.raises(ValueError, match="data='digits': the samples are given in memory; give no data"):
        lockstep.evaluate("convnet", xv, yv, h, layout="NCHW", data="digits")
    with pytest.raises(ValueError, match="limit must be at least 1"):
        lockstep.predict("convnet", xv, h, layout="NCHW", limit=0)
