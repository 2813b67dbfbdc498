"""A training loop with known sleeps, for the run-log tests (`test_goodput.py`).

    python goodput_worker.py DIR OUT.json --steps N [--crash-at-batch B] [--wait S] [--compute S]
                             [--every K] [--interval S]

Restores DIR (if it holds a step), then runs steps from the one after it until step N-1:
each batch takes `--wait` seconds in the loader's ``next()``, each step `--compute` seconds
in the loop body, and every step divisible by `--every` is saved. With ``--crash-at-batch B``
the loader ends the process with ``os._exit`` while fetching its B-th batch (0-based), as a
node failure would: no close, no flush. OUT.json gets the ground truth the worker measured
itself: the sleeps it actually did, when the Checkpointer was created, when it crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

import tiercheck


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--crash-at-batch", type=int, default=None)
    ap.add_argument("--wait", type=float, default=0.02)
    ap.add_argument("--compute", type=float, default=0.03)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--interval", type=float, default=0.0)
    args = ap.parse_args()
    truth: dict[str, Any] = {"wait_s": 0.0, "compute_s": 0.0, "batches": 0, "steps": 0}

    def dump() -> None:
        with open(args.out, "w") as f:
            json.dump(truth, f)

    def loader() -> Iterator[int]:
        i = 0
        while True:
            t0 = time.perf_counter()
            time.sleep(args.wait)
            if i == args.crash_at_batch:
                truth["t_crash"] = time.time()
                dump()
                os._exit(3)
            truth["wait_s"] += time.perf_counter() - t0
            truth["batches"] += 1
            yield i
            i += 1

    state: dict[str, Any] = {"w": torch.zeros(1000), "step": -1}
    truth["t_create"] = time.time()
    with tiercheck.Checkpointer(local=args.dir, keep_local=2, run_log_interval=args.interval) as ckpt:
        restored = ckpt.restore(state)
        truth["restored"] = restored
        step = 0 if restored is None else restored + 1
        for _ in ckpt.timed(loader()):
            if step >= args.steps:
                break
            t0 = time.perf_counter()
            time.sleep(args.compute)
            truth["compute_s"] += time.perf_counter() - t0
            state["w"].fill_(step)
            state["step"] = step
            if step % args.every == 0:
                ckpt.save(step, state)
            truth["steps"] += 1
            step += 1
    truth["t_end"] = time.time()
    dump()


if __name__ == "__main__":
    main()
