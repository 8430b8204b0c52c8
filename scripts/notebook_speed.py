"""The notebook's training speed against the command line's, measured in one sitting.

Runs a fresh evcxr kernel headless (nbclient) with examples/notebook.ipynb's setup cell
and data cell, then alternates, ROUNDS times: the notebook's training cell's run (its
TrainConfig, EPOCHS epochs) inside the kernel, and `lockstep train --epochs EPOCHS
--devices cpu:2` as a child process of the same kernel. Each pair runs back to back, so
the machine's drift (a shared 2-core machine varies by ±20% over minutes) touches both
alike; the figure is the median of the pairs' ratios.

    python scripts/notebook_speed.py [--rounds 5] [--epochs 10] [--cli target/release/lockstep]

Needs evcxr_jupyter installed as the kernel "rust" and nbclient; the command line built
with `cargo build --release`.
"""
import argparse, json, os, re, statistics, sys, time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--epochs", type=int, default=10)
ap.add_argument("--cli", default=os.path.join(ROOT, "target", "release", "lockstep"))
ap.add_argument("--setup-line", action="append", default=[],
                help="a line to add to the setup cell (to measure another setting)")
args = ap.parse_args()
if not os.access(args.cli, os.X_OK):
    sys.exit(f"notebook_speed: no command line at {args.cli}: build it with cargo build --release")

source = nbformat.read(os.path.join(ROOT, "examples", "notebook.ipynb"), as_version=4)
code = [c for c in source.cells if c.cell_type == "code"]
setup, data = code[0].source, code[1].source
setup = "\n".join(args.setup_line + [setup])
if ":dep lockstep" not in setup or "Devices::cpu(2, 1)" not in data:
    sys.exit("notebook_speed: examples/notebook.ipynb's first two code cells are not the setup and data cells")

measure = r"""
let mut pairs: Vec<(f64, f64)> = Vec::new();
for round in 0..ROUNDS {
    let config = TrainConfig {
        epochs: EPOCHS,
        batch_size: 32,
        schedule: LrSchedule::Cosine { floor: 0.1 },
        ..TrainConfig::default()
    };
    let report = train_data_parallel(&model, &splits.train, splits.test.as_ref(), &devices, &config)?;
    let cell = report.samples_per_sec;
    let out = std::process::Command::new("CLI")
        .args(["train", "--epochs", "EPOCHS", "--devices", "cpu:2"])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let line = text.lines().find(|l| l.starts_with("trained ")).ok_or("the command line printed no 'trained' line")?;
    let cli: f64 = line.rsplit('(').next().unwrap().split_whitespace().next().unwrap().parse()?;
    println!("PAIR {round} {cell:.1} {cli:.1}");
    pairs.push((cell, cli));
}
""".replace("ROUNDS", str(args.rounds)).replace("EPOCHS", str(args.epochs)).replace("CLI", args.cli)

nb = nbformat.v4.new_notebook()
nb.cells = [nbformat.v4.new_code_cell(s) for s in (setup, data, measure)]
t = time.time()
NotebookClient(nb, timeout=3600, kernel_name="rust",
               resources={"metadata": {"path": os.path.join(ROOT, "examples")}}).execute()
print(f"kernel ran the cells in {time.time() - t:.0f} s")

pairs = []
for o in nb.cells[2].get("outputs", []):
    for line in (o.get("text") or "").splitlines():
        m = re.match(r"PAIR (\d+) ([\d.]+) ([\d.]+)", line)
        if m:
            pairs.append((float(m[2]), float(m[3])))
if len(pairs) != args.rounds:
    sys.exit(f"notebook_speed: {len(pairs)} of {args.rounds} pairs came back:\n" + json.dumps(nb.cells[2].get("outputs"), indent=1)[:4000])
for i, (cell, cli) in enumerate(pairs):
    print(f"round {i + 1}: notebook {cell:7.0f} samples/s, command line {cli:7.0f} samples/s, ratio {cell / cli:.2f}")
ratios = [c / l for c, l in pairs]
print(f"median ratio {statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}) over {len(pairs)} pairs of {args.epochs} epochs")
