"""examples/python/ddp_in_a_notebook.ipynb, executed headless (nbclient, ipykernel) as a
notebook's kernel runs it: every cell runs; the lesson's MLP's PyTorch accuracy and the
Keras convnet's Keras accuracy equal lockstep's; and the MLP's final loss is the command
line's for the same model, weights and data (`lockstep train --model SPEC --init FILE`).
Skipped where torch, keras, nbclient or Fashion-MNIST's package are missing."""

import os
import re
import subprocess

import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")
torch = pytest.importorskip("torch")
pytest.importorskip("keras")
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
import lockstep  # noqa: E402
from test_fit import BIN, ROOT, write_dataset  # noqa: E402

NOTEBOOK = os.path.join(ROOT, "examples", "python", "ddp_in_a_notebook.ipynb")
FASHION = "/usr/share/datasets/fashion-mnist"


def test_the_notebook_runs_and_its_numbers_are_the_command_lines(tmp_path):
    if not os.path.isdir(FASHION):
        pytest.skip(f"no {FASHION} (apt-get install dataset-fashion-mnist)")
    if not os.path.exists(BIN):
        pytest.skip(f"no lockstep binary at {BIN}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stdout")
    torch_acc, lock_acc = re.search(r"mlp: PyTorch's test accuracy ([\d.]+), lockstep's ([\d.]+)", out).groups()
    assert torch_acc == lock_acc
    keras_acc, lock_acc = re.search(r"convnet: Keras's test accuracy ([\d.]+), lockstep's ([\d.]+)", out).groups()
    assert keras_acc == lock_acc
    loss = float(re.search(r"mlp: final train loss ([\d.]+)", out).group(1))

    # The same MLP, weights and data through the command line: the notebook's own cell
    # defines them.
    scope = {"torch": torch}
    source = next(c.source for c in nb.cells if "class NeuralNetwork" in c.source)
    exec(source, scope)  # noqa: S102
    model = lockstep.from_torch(scope["model"], scope["X_train"][:1])
    spec, init = tmp_path / "mlp.json", tmp_path / "init.safetensors"
    spec.write_text(__import__("json").dumps(model.spec))
    lockstep._write_safetensors(str(init), model.weights)
    for name, x, y in (("train", scope["X_train"], scope["y_train"]), ("test", scope["X_test"], scope["y_test"])):
        write_dataset(tmp_path / f"{name}.safetensors", x.numpy(), y.numpy())
    argv = [BIN, "train", "--model", str(spec), "--init", str(init), "--data", str(tmp_path / "train.safetensors")]
    argv += ["--val-data", str(tmp_path / "test.safetensors"), "--epochs=3", "--batch-size=2", "--optimizer=sgd"]
    argv += ["--lr=0.5", "--lr-schedule=constant", "--devices=cpu:2"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    cli = float(re.search(r"final train loss ([\d.]+)", done.stdout).group(1))
    assert f"{loss:.4f}" == f"{cli:.4f}"

