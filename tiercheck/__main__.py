"""Command line: ``tiercheck ls DIR``, ``tiercheck verify DIR [--step N]`` and ``tiercheck bench ...``.

``tiercheck bench`` runs the stall benchmark, ``benchmarks/stall.py``, which lives in the
source checkout (it is not part of the installed package): the script is found next to the
package (``<checkout>/benchmarks/stall.py``, i.e. an editable install or ``python -m
tiercheck`` from the checkout), or at the path in ``$TIERCHECK_BENCH_SCRIPT``. Every argument
after ``bench`` goes to the script (``tiercheck bench --help``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import CheckpointCorruptedError, TiercheckError
from .manifest import Manifest, Marker
from .restore import present_manifests, read_marker, verify_files
from .tiers.base import Tier
from .tiers.local import LocalTier
from .tiers.remote import RemoteTier

BENCH_ENV = "TIERCHECK_BENCH_SCRIPT"


def bench_script() -> Path | None:
    """Where benchmarks/stall.py is: $TIERCHECK_BENCH_SCRIPT, else beside the package's checkout."""
    env = os.environ.get(BENCH_ENV)
    if env:
        return Path(env)
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "stall.py"
    return path if path.is_file() else None


def run_bench(argv: Sequence[str]) -> int:
    path = bench_script()
    if path is None or not path.is_file():
        print(
            "tiercheck bench: benchmarks/stall.py not found. It ships with the source checkout, not the "
            f"installed package: run it from a checkout (pip install -e .) or set {BENCH_ENV}=/path/to/stall.py",
            file=sys.stderr,
        )
        return 2
    name = "tiercheck_bench_stall"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        print(f"tiercheck bench: cannot load {path}", file=sys.stderr)
        return 2
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    os.environ.setdefault("TIERCHECK_BENCH_PROG", "1")
    spec.loader.exec_module(module)
    result = module.main(list(argv))
    return int(result or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["bench"]:
        return run_bench(args_in[1:])
    ap = argparse.ArgumentParser(prog="tiercheck", description="Inspect tiercheck checkpoints; benchmark saves.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list committed steps with their size")
    ls.add_argument("location")
    verify = sub.add_parser("verify", help="read every byte of a step and check its checksums")
    verify.add_argument("location")
    verify.add_argument("--step", type=int, default=None, help="default: every committed step")
    sub.add_parser(
        "bench",
        help="lost training time per save, tiercheck vs torch.save/DCP/... (benchmarks/stall.py; "
        "`tiercheck bench --help`)",
        add_help=False,
    )
    args = ap.parse_args(args_in)
    loc = args.location
    tier: Tier = RemoteTier(loc) if "://" in loc else LocalTier(loc)
    steps = tier.committed_steps()
    if args.cmd == "ls":
        for step in steps:
            try:
                marker = read_marker(tier, step)
                manifests = list(present_manifests(tier, step, marker))
                size = sum(f.size_on_tier for m in manifests for f in m.files)
                entries = sum(len(m.entries) for m in manifests)
                print(
                    f"{step}\t{_ranks(manifests, marker.world_size)}\t{entries} entries\t{size} bytes"
                    f"\t{tier.path_of(step)}{_metrics_column(marker)}"
                )
            except TiercheckError as exc:
                print(f"{step}\tUNREADABLE: {exc}")
        return 0
    targets = steps if args.step is None else [args.step]
    bad = 0
    for step in targets:
        try:
            marker = read_marker(tier, step)
            manifests = list(present_manifests(tier, step, marker))
            if not manifests:
                raise CheckpointCorruptedError(f"{tier.path_of(step)}: no rank's manifest is present")
            for m in manifests:
                verify_files(tier, step, m)
            print(f"step {step}: ok ({_ranks(manifests, marker.world_size)})")
        except TiercheckError as exc:
            bad += 1
            print(f"step {step}: FAILED: {exc}")
    return 1 if bad else 0


def _metrics_column(marker: Marker) -> str:
    """``\tval_loss=0.31 epoch=3``: the step's recorded metrics (repr: exact), or nothing."""
    if not marker.metrics:
        return ""
    return "\t" + " ".join(f"{name}={value!r}" for name, value in marker.metrics)


def _ranks(manifests: list[Manifest], world: int) -> str:
    if world == 1:
        return "1 rank"
    return f"{len(manifests)} of {world} ranks' parts here"


if __name__ == "__main__":
    sys.exit(main())
