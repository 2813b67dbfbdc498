#!/usr/bin/env python3
"""Saves issued right after the last one's ``wait()`` (issue 25): the stall of ``save()``
when nothing runs between saves, so any work the writer does before it gives the host
buffer back shows as stall. Per checkout (``--checkout``, repeatable; default this one),
in fresh processes alternating between checkouts: a state of ``--leaves`` fp32 tensors of
``--numel`` elements, ``Checkpointer(local=..., keep_local=1)`` (retention deletes a step
at every save), ``prepare()``, one warm-up save, then ``--saves`` saves each waited for;
reported: the median stall per process and the median over processes.

    git worktree add --detach /tmp/tc-base HEAD~1
    python benchmarks/save/back_to_back.py --checkout /tmp/tc-base --checkout .
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script
from benchmarks.common import run_in_checkout

CHILD = r"""
import json, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import torch, tiercheck
leaves, numel, saves = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
state = {f"w{i}": torch.randn(numel) for i in range(leaves)}
with tempfile.TemporaryDirectory() as d, tiercheck.Checkpointer(local=d, keep_local=1, run_log_interval=None) as ck:
    ck.prepare(state)
    ck.save(0, state).wait()
    stalls = []
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        handle = ck.save(step, state)
        stalls.append(time.perf_counter() - t0)
        handle.wait()
print(json.dumps({"tiercheck": tiercheck.__file__, "stall_s": statistics.median(stalls)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=None, help="a checkout to measure (repeatable)")
    ap.add_argument("--leaves", type=int, default=100)
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--processes", type=int, default=3, help="per checkout")
    args = ap.parse_args()
    checkouts = [os.path.realpath(c) for c in (args.checkout or [os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))])]
    got: dict[str, list[float]] = {c: [] for c in checkouts}
    for i in range(args.processes):
        for c in checkouts if i % 2 == 0 else checkouts[::-1]:
            got[c].append(run_in_checkout(c, CHILD, args.leaves, args.numel, args.saves)["stall_s"])
    print(f"{args.leaves} x {args.numel * 4} B, {args.saves} saves a process, load {os.getloadavg()[0]:.1f}")
    for c, stalls in got.items():
        per = ", ".join(f"{s * 1e3:.2f}" for s in stalls)
        print(f"{c}: stall {statistics.median(stalls) * 1e3:.2f} ms (per process: {per})")


if __name__ == "__main__":
    main()
