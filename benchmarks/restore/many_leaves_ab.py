#!/usr/bin/env python3
"""Restore of many small tensors at two revisions, side by side (issue 25).

Each revision runs in fresh processes, alternating (new, base, base, new, ...), so the
machine's load falls on both alike; each process imports tiercheck and
`benchmarks/save/many_tensors.py` from its own checkout. Per process, for a state of
``count`` fp32 tensors of ``leaf_bytes`` each (`many_tensors.make_state`): one tier-1 step
(`many_tensors.Saves`), then ``--restores`` cold restores into a template of the same
structure (page cache dropped) interleaved with the plain read + ``copy_`` of the same bytes
(`many_tensors.Restores`), plus the process's CPU time over the tiercheck restores. Reported:
medians over the processes of each process's median, and new / base.

    git worktree add --detach /tmp/tc-base HEAD~1
    python benchmarks/restore/many_leaves_ab.py --base /tmp/tc-base --cases 20000x832,140000x112
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE))  # the checkout: `benchmarks.*` when run as a script
from benchmarks.common import run_in_checkout  # noqa: E402

CHILD = r"""
import json, statistics, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from benchmarks.save import many_tensors as mt
count, leaf_bytes, n, work = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
import tempfile
root = Path(tempfile.mkdtemp(prefix="ab_", dir=work))
s = mt.Saves(mt.make_state(count, leaf_bytes), root, 0)
try:
    r = mt.Restores(s)
    restore, plain, cpu = [], [], []
    for i in range(n):
        for m in ("plain", "tiercheck") if i % 2 else ("tiercheck", "plain"):
            c0 = time.process_time()
            t = r.run(m)
            if m == "plain":
                plain.append(t)
            else:
                restore.append(t)
                cpu.append(time.process_time() - c0)
finally:
    s.close()
import tiercheck
print(json.dumps({
    "tiercheck": tiercheck.__file__,
    "restore_s": statistics.median(restore),
    "restore_cpu_s": statistics.median(cpu),
    "plain_s": statistics.median(plain),
    "restore_over_plain": statistics.median(a / b for a, b in zip(restore, plain)),
}))
"""


def run_child(checkout: str, count: int, leaf_bytes: int, n: int, work: str) -> dict[str, Any]:
    return run_in_checkout(checkout, CHILD, count, leaf_bytes, n, work)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="a checkout of the base revision")
    ap.add_argument("--new", default=str(HERE), help="a checkout of the new revision (default: this one)")
    ap.add_argument("--cases", default="20000x832,140000x112,5000x3352,1000x16768", help="COUNTxLEAF_BYTES,...")
    ap.add_argument("--pairs", type=int, default=3, help="processes per revision and case")
    ap.add_argument("--restores", type=int, default=5, help="restores (and plain reads) per process")
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="many_leaves_ab_")
    sides = {"new": os.path.realpath(args.new), "base": os.path.realpath(args.base)}
    rows = []
    print(
        "| state | base restore ms (CPU) | new restore ms (CPU) | plain ms | new / base"
        " | restore / plain, base -> new | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for count, leaf_bytes in cases:
        got: dict[str, list[dict[str, Any]]] = {"new": [], "base": []}
        load0 = os.getloadavg()[0]
        for i in range(args.pairs):
            for side in ("new", "base") if i % 2 == 0 else ("base", "new"):
                got[side].append(run_child(sides[side], count, leaf_bytes, args.restores, work))
        row: dict[str, Any] = {"leaves": count, "leaf_bytes": leaf_bytes, "load": [load0, os.getloadavg()[0]]}
        row["runs"] = got
        for side, runs in got.items():
            row[side] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "tiercheck"}
        b, n = row["base"], row["new"]
        row["new_over_base"] = n["restore_s"] / b["restore_s"]
        rows.append(row)
        print(
            f"| {count:,} x {leaf_bytes:,} B | {b['restore_s'] * 1e3:.1f} ({b['restore_cpu_s'] * 1e3:.0f})"
            f" | {n['restore_s'] * 1e3:.1f} ({n['restore_cpu_s'] * 1e3:.0f})"
            f" | {statistics.median([b['plain_s'], n['plain_s']]) * 1e3:.1f} | {row['new_over_base']:.2f}"
            f" | {b['restore_over_plain']:.2f}x -> {n['restore_over_plain']:.2f}x"
            f" | {load0:.1f} -> {row['load'][1]:.1f} |",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"sides": sides, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
