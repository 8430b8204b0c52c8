#!/usr/bin/env python3
"""bench_tables.py — reads the tables `lockstep bench allreduce` prints, for gpu-check.sh.

The two tables differ (src/cmd/bench.rs prints both; its unit tests run this script on
their real output):

  cpu (--devices cpu:N):      size count | time algbw busbw | time algbw busbw
                                           (trainer path)     (classic all-reduce)
  gpu (--devices cuda:I,...): size count | time algbw busbw | copy busbw/copy

Usage: bench_tables.py cpu|gpu FILE. Prints one line of figures from the largest and the
smallest size (rows in any order; lines starting with '#' and lines without '|' skipped):

  cpu: BYTES busbw_trainer busbw_classic | SMALL_BYTES time_trainer_us time_classic_us
  gpu: BYTES busbw copy_gbps busbw/copy | SMALL_BYTES time_us

A table of the other kind (a cell group of the wrong width) or no row at all is an error
(exit 1, message on stderr): gpu-check.sh then prints n/a instead of a wrong figure.
"""

import sys

# Values per '|'-separated cell group, after the (size, count) group.
WIDTHS = {"cpu": (3, 3), "gpu": (3, 2)}


def rows(path, kind):
    """(bytes, group1, group2) per data row, each group a list of floats."""
    out = []
    for n, line in enumerate(open(path), 1):
        if line.startswith("#") or "|" not in line:
            continue
        cells = [c.split() for c in line.split("|")]
        widths = tuple(len(c) for c in cells[1:])
        if len(cells[0]) != 2 or widths != WIDTHS[kind]:
            raise ValueError(
                f"{path}:{n}: cell groups of {len(cells[0])}, {widths}; a {kind} table has 2, {WIDTHS[kind]}"
            )
        out.append((int(cells[0][0]), [float(v) for v in cells[1]], [float(v) for v in cells[2]]))
    if not out:
        raise ValueError(f"{path}: no row")
    return sorted(out)


def figures(path, kind):
    rs = rows(path, kind)
    (big, b1, b2), (small, s1, s2) = rs[-1], rs[0]
    if kind == "cpu":
        # busbw is the third value of each path's group, the time the first.
        return f"{big} {b1[2]:.2f} {b2[2]:.2f} | {small} {s1[0]:.1f} {s2[0]:.1f}"
    # gpu: busbw in the first group, then the copy bandwidth and the ratio.
    return f"{big} {b1[2]:.2f} {b2[0]:.2f} {b2[1]:.2f} | {small} {s1[0]:.1f}"


def main(argv):
    if len(argv) != 3 or argv[1] not in WIDTHS:
        print("usage: bench_tables.py cpu|gpu FILE", file=sys.stderr)
        return 2
    try:
        print(figures(argv[2], argv[1]))
    except (OSError, ValueError) as e:
        print(f"bench_tables.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
