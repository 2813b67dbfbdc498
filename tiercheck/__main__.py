"""Command line: ``tiercheck ls DIR`` and ``tiercheck verify DIR [--step N]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import TiercheckError
from .restore import read_manifest, read_step
from .tiers.local import LocalTier


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tiercheck", description="Inspect tiercheck checkpoints.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list committed steps with their size")
    ls.add_argument("location")
    verify = sub.add_parser("verify", help="read every byte of a step and check its checksums")
    verify.add_argument("location")
    verify.add_argument("--step", type=int, default=None, help="default: every committed step")
    args = ap.parse_args(argv)
    tier = LocalTier(args.location)
    steps = tier.committed_steps()
    if args.cmd == "ls":
        for step in steps:
            try:
                m = read_manifest(tier, step, 0)
                size = sum(f.size_on_tier for f in m.files)
                print(f"{step}\t{len(m.entries)} entries\t{size} bytes\t{tier.path_of(step)}")
            except TiercheckError as exc:
                print(f"{step}\tUNREADABLE: {exc}")
        return 0
    targets = steps if args.step is None else [args.step]
    bad = 0
    for step in targets:
        try:
            read_step(tier, step, 0, None, strict=False)
            print(f"step {step}: ok")
        except TiercheckError as exc:
            bad += 1
            print(f"step {step}: FAILED: {exc}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
