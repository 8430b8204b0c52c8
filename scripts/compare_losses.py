#!/usr/bin/env python3
"""compare_losses.py — step-by-step comparison of two `lockstep train` runs.

    python3 scripts/compare_losses.py A B [--tol 1e-3] [--steps 20] [--acc-tol F]

A and B are the per-step logs of two runs of the same training (same flags, same
--seed, same number of logical replicas --replicas), on different devices. Each is
either what `lockstep train --log-format json` prints on stdout (one JSON object per
line: `{"kind":"step","step":1,"loss":...}` after every step, `{"kind":"epoch",...,
"val_accuracy":...}` after every epoch) or the CSV of `--metrics-out FILE.csv`
(`kind,step,epoch,loss,accuracy,val_loss,val_accuracy,samples_per_sec`); the format is
recognised from the first line. Both carry the mean loss of the global batch of every
step, so the runs are compared step by step, not per epoch.

Check: |a − b| ≤ tol · max(1, |a|) for the loss of every step 1..--steps (a relative
bound for losses above 1, an absolute one below). Default: tol 1e-3 over the first 20
steps. Both runs start from the same weights (made on the host from the seed) and see the
same batches, dropout masks and BatchNorm shards (the same --replicas), so a correct
device differs from the CPU only by f32 rounding (other summation orders in its GEMMs
and reductions). Adam amplifies such differences: at its first steps every parameter
moves by about ±lr whatever the size of its gradient, so a gradient element near zero
whose sign flips under rounding moves by 2·lr. Measured on CPU (the default convnet run,
`--steps 100`, every initial weight multiplied by 1 + u·eps, u uniform in [−1, 1], three
seeds each), the scaled loss deviation from the unperturbed run was:

    perturbation       steps 1..10   1..20        1..50        1..100
    eps 1e-7 (~1 ulp)  ≤ 4e-8        ≤ 1.5e-4     ≤ 1.8e-3     ≤ 2.1e-3
    eps 1e-6           ≤ 2.0e-4      ≤ 5.4e-4     ≤ 3.0e-3     ≤ 4.0e-3

while real mistakes, against the same reference over steps 1..20, gave: BatchNorm
statistics over other shards (`--devices cpu:2` without `--replicas`) 3.4e-2 (2.8e-3 at
step 1), another dropout rate (0.45) 1.2e-2, lr 5% off 4.8e-3, a stray weight decay
1e-4 2.3e-3. So 1e-3 over 20 steps separates the two with a margin of about two on each
side. A GPU adds rounding differences at every step, not only at the start, so a correct
one may drift faster than these perturbed starts: if a CUDA run fails by a small factor
while its final accuracy agrees, look at where the deviation starts before raising --tol;
over 50 steps a correct run can exceed it (1e-3 over 50 steps, first proposed, fails
runs that differ by one ulp in their initial weights). Past ~50 steps two correct
runs drift apart chaotically: the comparison then is the final accuracy (--acc-tol),
and the deviation over every common step is printed for information (max_dev_all).

A step whose loss is null (non-finite) in either log fails the check. With --steps 0
every step that both logs hold is compared. Fewer steps than asked in either log is a
failure unless both runs simply ended there (then their step counts must agree).
--acc-tol F also requires |acc_a − acc_b| ≤ F for the last epoch's val_accuracy
(absolute, e.g. 0.02 = 2 points), when both logs have one.

Prints one summary line (`compare_losses result=PASS|FAIL steps=N max_dev=... at_step=S
...`) and exits 0 on PASS, 1 on FAIL, 2 on an unreadable input. Python standard library
only (it runs on the bare GPU machine).
"""

import argparse
import csv
import json
import math
import sys


class LogError(Exception):
    pass


def _num(v, where):
    """A JSON/CSV number, or None for a non-finite one (null in JSON, NaN/inf in CSV)."""
    if v is None or v == "":
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise LogError(f"{where}: not a number: {v!r}") from None
    return x if math.isfinite(x) else None


def read_log(path):
    """Returns ({step: loss or None}, last epoch's val_accuracy or None)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise LogError(f"{path}: {e.strerror}") from None
    losses, val_acc = {}, None
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise LogError(f"{path}: empty log")
    if first.lstrip().startswith("{"):
        for i, line in enumerate(lines, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue  # anything else that went to stdout is not ours to judge
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise LogError(f"{path}:{i}: malformed JSON ({e.msg})") from None
            kind = obj.get("kind")
            if kind == "step":
                if not isinstance(obj.get("step"), int) or "loss" not in obj:
                    raise LogError(f"{path}:{i}: a step object without an integer step and a loss")
                losses[obj["step"]] = _num(obj["loss"], f"{path}:{i}")
            elif kind == "epoch":
                val_acc = _num(obj.get("val_accuracy"), f"{path}:{i}")
    elif first.startswith("kind,"):
        rows = csv.DictReader(lines)
        for i, row in enumerate(rows, 2):
            if "step" not in row or "loss" not in row:
                raise LogError(f"{path}: CSV without step and loss columns")
            if row["kind"] == "step":
                losses[int(row["step"])] = _num(row["loss"], f"{path}:{i}")
            elif row["kind"] == "epoch":
                val_acc = _num(row.get("val_accuracy"), f"{path}:{i}")
    else:
        raise LogError(f"{path}: neither `lockstep train --log-format json` output nor a --metrics-out CSV")
    if not losses:
        raise LogError(f"{path}: no step in the log")
    return losses, val_acc


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="reference log (e.g. the CPU run)")
    p.add_argument("b", help="log to check (e.g. the CUDA run)")
    p.add_argument("--tol", type=float, default=1e-3, help="relative tolerance (absolute below 1) [1e-3]")
    p.add_argument("--steps", type=int, default=20, help="compare steps 1..N; 0 = every common step [20]")
    p.add_argument("--acc-tol", type=float, default=None, help="also bound |Δ final val_accuracy| (absolute)")
    args = p.parse_args(argv)
    try:
        la, acc_a = read_log(args.a)
        lb, acc_b = read_log(args.b)
    except LogError as e:
        print(f"compare_losses: error: {e}", file=sys.stderr)
        return 2

    failures = []
    na, nb = max(la), max(lb)
    if args.steps > 0:
        want = args.steps
        if na < want or nb < want:
            if na != nb:
                failures.append(f"the logs end at different steps ({na} and {nb}) before step {want}")
            want = min(want, na, nb)
    else:
        want = min(na, nb)
        if na != nb:
            print(f"compare_losses: note: the logs hold {na} and {nb} steps; comparing 1..{want}")
    worst, worst_step, compared = 0.0, None, 0
    for s in range(1, want + 1):
        if s not in la or s not in lb:
            failures.append(f"step {s} missing from {'A' if s not in la else 'B'}")
            break
        a, b = la[s], lb[s]
        if a is None or b is None:
            failures.append(f"step {s}: non-finite loss ({a} vs {b})")
            break
        compared += 1
        dev = abs(a - b) / max(1.0, abs(a))
        if worst_step is None or dev > worst:
            worst, worst_step = dev, s
        if dev > args.tol and not any(f.startswith("loss deviates") for f in failures):
            failures.append(
                f"loss deviates first at step {s}: {a!r} vs {b!r} (scaled deviation {dev:.3g} > {args.tol:g})"
            )
    # For information: the deviation over every step both logs hold.
    worst_all, worst_all_step = 0.0, None
    for s in range(1, min(na, nb) + 1):
        a, b = la.get(s), lb.get(s)
        if a is None or b is None:
            continue
        dev = abs(a - b) / max(1.0, abs(a))
        if worst_all_step is None or dev > worst_all:
            worst_all, worst_all_step = dev, s
    acc_text = ""
    if args.acc_tol is not None:
        if acc_a is None or acc_b is None:
            failures.append("--acc-tol given but a log has no final val_accuracy")
        else:
            acc_text = f" val_acc_a={acc_a:.4f} val_acc_b={acc_b:.4f}"
            if abs(acc_a - acc_b) > args.acc_tol:
                failures.append(f"final val_accuracy {acc_a:.4f} vs {acc_b:.4f} differs by more than {args.acc_tol:g}")
    result = "FAIL" if failures else "PASS"
    for f in failures:
        print(f"compare_losses: {f}")
    print(
        f"compare_losses result={result} steps={compared} max_dev={worst:.3g} at_step={worst_step} "
        f"tol={args.tol:g}{acc_text} all_steps={min(na, nb)} max_dev_all={worst_all:.3g} at_step_all={worst_all_step}"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
