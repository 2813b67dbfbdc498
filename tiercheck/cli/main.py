"""Command line: ``tiercheck ls DIR``, ``tiercheck verify DIR [--step N]``, ``tiercheck --version``,
``tiercheck bench ...``, ``tiercheck report DIR`` / ``tiercheck plan`` (in `cli/goodput.py`), the
checkpoint tools ``inspect``, ``export``, ``import``, ``upload``, ``prune``, ``rm`` (in `cli/tools.py`), and
``tiercheck memory ls|clean`` (what jobs left in shared memory, tier 0: `cli/memory.py`).

Exit status: 0 every step checked is intact, 1 a step is damaged, 2 nothing was checked (bad
usage, a missing location or step, nothing committed there, an unreachable store); such an
error is one line on stderr: ``tiercheck: <what failed>: <where>: <what to check>``. A step
deleted while it was read (``verify`` or ``ls`` beside a job whose retention prunes) is not
damaged: ``verify`` says ``step N: pruned while it was read`` and counts it neither way (2 if
every step it was to check went), ``ls`` leaves it out.

``tiercheck bench`` runs the stall benchmark, ``benchmarks/stall/stall.py``, which lives in the
source checkout (it is not part of the installed package): the script is found next to the
package (``<checkout>/benchmarks/stall/stall.py``, i.e. an editable install or ``python -m
tiercheck`` from the checkout), or at the path in ``$TIERCHECK_BENCH_SCRIPT``. Every argument
after ``bench`` goes to the script (``tiercheck bench --help``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import CheckpointCorruptedError, StepPrunedError, TiercheckError
from ..format.manifest import Manifest, Marker
from ..observe.progress import part_of, terminal_bar
from ..steps.catalog import present_manifests, read_marker, reading_committed, verify_files
from ..tiers.base import Tier
from ..tiers.open import open_tier
from ..tiers.open import with_timeouts as _with_timeouts
from ..tiers.retry import RetryPolicy
from . import goodput as cli_goodput
from . import memory as memory_cli
from . import tools as tools_cli
from .tools import json_object as _json_object

BENCH_ENV = "TIERCHECK_BENCH_SCRIPT"


def bench_script() -> Path | None:
    """Where benchmarks/stall/stall.py is: $TIERCHECK_BENCH_SCRIPT, else beside the package's checkout."""
    env = os.environ.get(BENCH_ENV)
    if env:
        return Path(env)
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "stall" / "stall.py"
    return path if path.is_file() else None


def run_bench(argv: Sequence[str]) -> int:
    path = bench_script()
    if path is None or not path.is_file():
        print(
            "tiercheck bench: benchmarks/stall/stall.py not found. It ships with the source checkout, not the "
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
    """Run the command line; returns the exit status: 0 every step checked is intact, 1 a
    step is damaged, 2 nothing could be checked (bad usage, the location or step is missing,
    the store cannot be reached, every step to verify was deleted while it was read). Errors
    are one line on stderr, never a traceback."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["bench"]:
        return run_bench(args_in[1:])
    if args_in[:1] and args_in[0] in cli_goodput.COMMANDS:
        return cli_goodput.main(args_in)
    ap = argparse.ArgumentParser(
        prog="tiercheck",
        description="Inspect tiercheck checkpoints; benchmark saves.",
        epilog="Exit status: 0 ok, 1 a step is damaged, 2 nothing checked (usage, location or step "
        "not found, store unreachable, every step to verify deleted while it was read).",
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list committed steps with their size")
    verify = sub.add_parser("verify", help="read every byte of a step and check its checksums")
    for p in (ls, verify):
        p.add_argument("location", help="a tier root: a directory or an fsspec URL (s3://bucket/run)")
        p.add_argument(
            "--storage-options",
            type=_json_object,
            default={},
            metavar="JSON",
            help='fsspec options for a URL, e.g. \'{"endpoint_url": "http://minio:9000"}\'',
        )
        p.add_argument(
            "--timeout",
            type=float,
            default=10.0,
            metavar="S",
            help="give up on an unreachable store after S seconds of retries (default 10)",
        )
    verify.add_argument("--step", type=int, default=None, help="default: every committed step")
    sub.add_parser(
        "bench",
        help="lost training time per save, tiercheck vs torch.save/DCP/... (benchmarks/stall/stall.py; "
        "`tiercheck bench --help`)",
        add_help=False,
    )
    cli_goodput.add_parsers(sub)
    tools_cli.register(sub)
    memory_cli.register(sub)
    args = ap.parse_args(args_in)
    if args.cmd in tools_cli.COMMANDS:
        return tools_cli.run(args)
    if args.cmd == memory_cli.COMMAND:
        return memory_cli.run(args)
    log = logging.getLogger("tiercheck")
    level = log.level
    log.setLevel(logging.ERROR)  # retry warnings would bury the one line an error gets
    try:
        return _run(args)
    except _Failed as failed:
        print(f"tiercheck: {failed}", file=sys.stderr)
        return 2
    except Exception as exc:  # the store or disk failed mid-way: nothing more was checked
        what = _one_line(f"{type(exc).__name__}: {exc}")
        print(f"tiercheck: {args.cmd} stopped ({what}): {args.location}: check the store and retry", file=sys.stderr)
        return 2
    finally:
        log.setLevel(level)


class _Failed(Exception):
    """What the CLI could not do, as one line: what failed, where, what to check."""

    def __init__(self, what: str, where: str, check: str) -> None:
        super().__init__(f"{what}: {where}: {check}")


def _run(args: argparse.Namespace) -> int:
    loc: str = args.location
    tier = _open_tier(loc, args.storage_options, args.timeout)
    steps = _committed(tier, loc)
    if args.cmd == "ls":
        bad = 0
        for step in steps:
            try:
                with reading_committed(tier, step):
                    marker = read_marker(tier, step)
                    manifests = list(present_manifests(tier, step, marker))
                    if not manifests:
                        raise CheckpointCorruptedError(f"{tier.path_of(step)}: no rank's manifest is present")
                size = sum(f.size_on_tier for m in manifests for f in m.files)
                entries = sum(len(m.entries) for m in manifests)
                print(
                    f"{step}\t{_ranks(manifests, marker.world_size)}\t{entries} entries\t{size} bytes"
                    f"\t{tier.path_of(step)}{_metrics_column(marker)}"
                )
            except StepPrunedError:
                continue  # deleted since it was listed (a job's retention): no longer committed
            except TiercheckError as exc:
                bad += 1
                print(f"{step}\tUNREADABLE: {exc}")
        return 1 if bad else 0
    if args.step is not None and args.step not in steps:
        raise _Failed(
            f"step {args.step} is not committed",
            tier.location,
            f"committed steps there: {_some(steps)} (run `tiercheck ls {loc}`)",
        )
    targets = steps if args.step is None else [args.step]
    bad = 0
    pruned = 0
    for step in targets:
        try:
            with reading_committed(tier, step):
                ranks = _verify_step(tier, step)
            print(f"step {step}: ok ({ranks})")
        except StepPrunedError:  # a job's retention beside this reader: gone, not damaged
            pruned += 1
            print(f"step {step}: pruned while it was read (no longer committed there; not damaged)")
        except TiercheckError as exc:
            bad += 1
            print(f"step {step}: FAILED: {_one_line(str(exc))}")
    if bad:
        return 1
    return 2 if pruned == len(targets) else 0  # every step went: nothing was checked


def _verify_step(tier: Tier, step: int) -> str:
    """Read every byte of `step`'s parts on `tier` against its checksums; returns its ranks."""
    marker = read_marker(tier, step)
    manifests = list(present_manifests(tier, step, marker))
    if not manifests:
        raise CheckpointCorruptedError(f"{tier.path_of(step)}: no rank's manifest is present")
    total = sum(sf.length for m in manifests for sf in m.files)
    before = 0
    with terminal_bar(f"verify step {step}") as progress:
        for m in manifests:
            verify_files(tier, step, m, part_of(progress, before, total))
            before += sum(sf.length for sf in m.files)
    return _ranks(manifests, marker.world_size)


def _metrics_column(marker: Marker) -> str:
    """``\tval_loss=0.31 epoch=3``: the step's recorded metrics (repr: exact), or nothing."""
    if not marker.metrics:
        return ""
    return "\t" + " ".join(f"{name}={value!r}" for name, value in marker.metrics)


def _open_tier(loc: str, options: dict[str, Any], timeout: float) -> Tier:
    if "://" not in loc:
        if not os.path.exists(loc):
            raise _Failed("no such directory", os.path.abspath(loc), "check the path (a tier root, as given to local=)")
        if not os.path.isdir(loc):
            raise _Failed("not a directory", os.path.abspath(loc), "give a tier root directory, as given to local=")
        return open_tier(loc)
    try:
        return open_tier(
            loc,
            storage_options=_with_timeouts(loc, options, timeout),
            retry=RetryPolicy(budget_s=timeout, initial_s=0.25, max_s=2.0),
            op_timeout=timeout,
        )
    except TiercheckError as exc:
        raise _Failed("cannot open", loc, _one_line(str(exc))) from exc


def _committed(tier: Tier, loc: str) -> list[int]:
    """The committed steps at `loc`; none at all is an error: a check that checks nothing
    must not pass."""
    try:
        steps = tier.committed_steps()
        strays = tier.stray_steps() if not steps and tier.capabilities.strays else []
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, TiercheckError) and exc.__cause__ is not None else exc
        raise _Failed(
            f"cannot list {tier.location}",
            _one_line(f"{type(cause).__name__}: {cause}"),
            "check the URL, the credentials and --storage-options (endpoint_url, ...); "
            "--timeout sets how long an unreachable store is retried",
        ) from exc
    if not steps:
        found = f"{len(strays)} step directories there have no commit marker (interrupted saves); " if strays else ""
        raise _Failed(
            "no committed step",
            tier.location,
            f"{found}check that this is a tier root, as given to local= or remote=",
        )
    return steps


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _some(steps: list[int]) -> str:
    if not steps:
        return "none"
    shown = ", ".join(str(s) for s in steps[-10:])
    return shown if len(steps) <= 10 else f"{len(steps)} steps, the newest {shown}"


def _version() -> str:
    try:
        return importlib.metadata.version("tiercheck")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return __version__


def _ranks(manifests: list[Manifest], world: int) -> str:
    if world == 1:
        return "1 rank"
    return f"{len(manifests)} of {world} ranks' parts here"
