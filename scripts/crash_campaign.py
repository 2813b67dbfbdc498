"""Crash campaign from the command line: SIGKILL a saving process at instants aimed at every
phase of the save path, then check what it left on every tier (the campaign and its checks:
`tests/helpers/crash_campaign.py`).

Usage::

    python scripts/crash_campaign.py --kills 1000 [--seed N] [--widen 0.02] [--local-only] [--memory]

It prints a progress line every 50 kills and the figures as markdown tables; the exit
status is 1 if any check failed. ``tests/procs/test_crash.py`` runs the same campaign CI-sized.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: `tests.helpers.crash_campaign`

from tests.helpers.crash_campaign import Config, Figures, run_campaign, worker

ROOT = Path(__file__).resolve().parents[1]


def git_revision() -> str:
    """The checked-out commit (with "+dirty" if tiercheck/ has local changes), or "unknown"."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "tiercheck"], cwd=ROOT, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty.stdout.strip() else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=1000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--widen", type=float, default=Config.widen_s, help="pause (s) at each dangerous instant")
    p.add_argument("--local-only", action="store_true", help="tier 1 only (keep_local=3)")
    p.add_argument(
        "--memory",
        action="store_true",
        help="tier 0 too (memory=True, keep_memory=1; with --local-only: tiers 0 and 1)",
    )
    p.add_argument("--workdir", type=Path, default=None, help="where the tiers live (default: a temp dir)")
    opts = p.parse_args(argv)
    seed = opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**32)
    config = (
        Config(remote=False, keep_local=worker.KEEP_LOCAL, widen_s=opts.widen, wipe_local=0.0, memory=opts.memory)
        if opts.local_only
        else Config(widen_s=opts.widen, memory=opts.memory)
    )
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="tiercheck-crash-"))
    workdir.mkdir(parents=True, exist_ok=True)

    def progress(f: Figures) -> None:
        print(f"  {f.kills} kills, {f.elapsed_s:.0f}s: torn {f.torn_restores}, lost {f.committed_lost}", flush=True)

    try:
        figures = run_campaign(opts.kills, seed, workdir, config, progress)
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(figures.summary())
    tiers = "tiers 0, 1" if config.memory else "tier 1"
    tiers += ", 2" if config.remote else ""
    print(f"tiercheck at {git_revision()}, {os.cpu_count()} CPUs, widen {config.widen_s}s, {tiers}")
    print()
    print(figures.table(config))
    for failure in figures.failures[:20]:
        print("FAILED:", failure, file=sys.stderr)
    return 1 if figures.failures or figures.torn_restores or figures.committed_lost else 0


if __name__ == "__main__":
    sys.exit(main())
