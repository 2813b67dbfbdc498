"""`stall.py --isolate K`: each method under test in a process of its own, K saves at a time,
the processes alternating (order rotated per round), merged into one report.

For a state whose host buffers do not fit twice beside the model: at 8 GiB the model (params,
Adam moments, gradients: 10.7 GiB), tiercheck's 8 GiB buffer and the naive writer's 8 GiB
buffer need 26.7 GiB in one process, but 18.7 GiB in each of two. Every child also runs
`none` (the noise floor) beside its method. Pairs for the paired ratios are the same save
index of the two methods, i.e. neighbouring processes rather than the same process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import rotated, summary
from benchmarks.stall.report import METRIC_NAMES, Row, best_dcp_method, compute_targets
from benchmarks.stall.workloads import now

# options a child takes over as they are
_PASSED = (
    "model",
    "width",
    "depth",
    "batch",
    "seq",
    "vocab",
    "optim",
    "device",
    "every",
    "pre_steps",
    "tail_steps",
    "noise_steps",
    "warmup_steps",
    "max_window_s",
    "odirect_block",
    "dir",
    "memory_dir",
    "seed",
)


def child_argv(args: argparse.Namespace, methods: list[str], repeats: int, name: str, out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve().parent / "stall.py"), "--size-gib", str(args.size_gib)]
    for key in _PASSED:
        value = getattr(args, key)
        if value is not None and value != 0:
            argv += ["--" + key.replace("_", "-"), str(value)]
    argv += ["--methods", ",".join(methods), "--repeats", str(repeats), "--name", name, "--out", str(out)]
    return [*argv, "--no-plots"]


def run_isolated(args: argparse.Namespace) -> dict[str, Any]:
    """Run the children, merge their reports into one (summaries and targets recomputed)."""
    subjects = [m for m in args.methods if m != "none"]
    floor = ["none"] if "none" in args.methods else []
    rounds = -(-args.repeats // args.isolate)
    t0 = now()
    reports: list[tuple[int, dict[str, Any]]] = []  # (first repeat index, report)
    with tempfile.TemporaryDirectory(prefix="stall-isolate-", dir=args.out) as tmp:
        for r in range(rounds):
            first = r * args.isolate
            k = min(args.isolate, args.repeats - first)
            for method in rotated(subjects, r):
                name = f"round{r}_{method}"
                print(f"# round {r + 1}/{rounds}: {method} ({k} saves) in a process of its own", file=sys.stderr)
                subprocess.run(child_argv(args, [*floor, method], k, name, Path(tmp)), check=True)
                reports.append((first, json.loads((Path(tmp) / f"{name}.json").read_text())))
    return merge(args, reports, now() - t0)


def merge(args: argparse.Namespace, reports: list[tuple[int, dict[str, Any]]], wall_s: float) -> dict[str, Any]:
    per_method: dict[str, Any] = {}
    rows: list[Row] = []
    notes: list[str] = []
    for first, rep in reports:
        notes += [n for n in rep.get("notes", []) if n not in notes]
        for name, entry in rep["methods"].items():
            merged = per_method.setdefault(
                name, {"description": entry["description"], "available": True, "reason": None, "saves": []}
            )
            merged["available"] = merged["available"] and entry["available"]
            merged["reason"] = merged["reason"] or entry.get("reason")
            for save in entry.get("saves", []):
                save = {**save, "repeat": first + save["repeat"], "process": rep["config"]["process"]}
                merged["saves"].append(save)
                rows.append((name, save["repeat"], save))
    ordered = {m: per_method[m] for m in args.methods if m in per_method}
    for entry in ordered.values():
        if entry["saves"]:
            entry["summary"] = {k: summary(s[k] for s in entry["saves"]) for k in METRIC_NAMES}
    dcp_best = best_dcp_method(ordered)
    first_rep, last_rep = reports[0][1], reports[-1][1]
    config = {
        **first_rep["config"],
        "repeats": args.repeats,
        "methods": list(args.methods),
        "loadavg_end": last_rep["config"]["loadavg_end"],
        "wall_s": wall_s,
        "isolate": args.isolate,
    }
    notes.append(
        f"Each method ran in processes of its own, {args.isolate} saves each, alternating "
        f"({len(reports)} processes, each with `none` beside its method); paired ratios pair the same "
        "save index of neighbouring processes."
    )
    return {
        "benchmark": "stall",
        "machine": first_rep["machine"],
        "config": config,
        "definitions": first_rep["definitions"],
        "dcp_best": dcp_best,
        "methods": ordered,
        "targets": compute_targets(ordered, rows, dcp_best),
        "notes": notes,
        "processes": [
            {"first_repeat": f, "pid": rep["config"]["process"], "wall_s": rep["config"]["wall_s"]}
            for f, rep in reports
        ],
    }
