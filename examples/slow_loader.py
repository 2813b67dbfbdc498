"""A training run whose data loader is deliberately slow, killed once and resumed, then
`tiercheck report` on it: the run log shows the loader, not checkpointing, as the loss.

    python examples/slow_loader.py DIR [--plot FILE.png] [--load-ms 25] [--kill-at 90]

Two processes train the same small MLP on CPU (about 5 ms a step here) from batches that a
loader hands out after sleeping `--load-ms` (a stand-in for slow storage or decoding), saving
every 50 steps into DIR. The first one dies (``os._exit``, no clean-up) while fetching batch
`--kill-at`; the second restores the newest step (50), redoes the lost steps and finishes at
step 200. Then the report is printed (and drawn with --plot). docs/goodput.md shows its output.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import tiercheck

STEPS, EVERY, BATCH, DIM = 200, 50, 256, 512


def batches(load_s: float, kill_at: int | None, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    i = 0
    while True:
        time.sleep(load_s)  # the slow part: storage, decoding, augmentation
        if i == kill_at:
            os._exit(1)  # a node failure: no close, no flush
        x = torch.randn(BATCH, DIM, generator=g)
        yield x, x.sum(dim=1, keepdim=True)
        i += 1


def train(ckpt_dir: str, load_s: float, kill_at: int | None) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, DIM), nn.ReLU(), nn.Linear(DIM, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt, "step": 0}
    with tiercheck.Checkpointer(local=ckpt_dir, keep_local=2) as ckpt:
        restored = ckpt.restore(state)
        step = 0 if restored is None else restored + 1
        for x, y in ckpt.timed(batches(load_s, kill_at, seed=step)):
            if step >= STEPS:
                break
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % EVERY == 0:
                state["step"] = step
                ckpt.save(step, state)
            step += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--load-ms", type=float, default=25.0)
    ap.add_argument("--kill-at", type=int, default=90)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        train(args.dir, args.load_ms / 1000, args.kill_at if args.kill_at >= 0 else None)
        return 0
    if Path(args.dir).exists() and any(Path(args.dir).iterdir()):
        print(f"{args.dir} is not empty: give a new directory", file=sys.stderr)
        return 2
    cmd = [sys.executable, __file__, args.dir, "--load-ms", str(args.load_ms), "--child"]
    first = subprocess.run([*cmd, "--kill-at", str(args.kill_at)], check=False)
    print(f"run 1 ended with status {first.returncode} (killed while fetching batch {args.kill_at})")
    subprocess.run([*cmd, "--kill-at", "-1"], check=True)
    report = [sys.executable, "-m", "tiercheck", "report", args.dir]
    if args.plot:
        report += ["--plot", args.plot]
    print("$ tiercheck report", args.dir)
    return subprocess.run(report, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
