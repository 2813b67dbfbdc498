"""Smoke test of the stall benchmark (benchmarks/stall/stall.py) through `python -m tiercheck bench`,
the product's command for it; the benchmarks' own parts are imported as the `benchmarks`
package (the checkout is on pytest's path).

It only checks that the benchmark runs and reports: every method that can run here has
positive timings; a method that cannot (torchsnapshot not installed, DCP async pieces
missing) is listed as unavailable with its reason.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ALWAYS = ("none", "memcpy", "tiercheck", "tiercheck_overlap", "torch_save", "dcp_save")
MAY_BE_MISSING = ("odirect_writer", "dcp_async_thread", "dcp_async_thread_sync", "dcp_async_process", "torchsnapshot")


def test_bench_quick_reports_every_method(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "tiercheck",
        "bench",
        "--quick",
        "--repeats",
        "1",
        "--size-gib",
        "0.01",
        "--out",
        str(out),
        "--name",
        "smoke",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=85)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"tiercheck bench --quick took more than 85 s:\n{exc.stderr}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads((out / "smoke.json").read_text())
    assert "| tiercheck | **" in (out / "smoke.md").read_text()
    methods = rep["methods"]
    assert set(ALWAYS + MAY_BE_MISSING) <= set(methods)
    assert rep["config"]["state_bytes"] > 0
    for name, entry in methods.items():
        if name in MAY_BE_MISSING and not entry["available"]:
            assert entry["reason"], f"{name} is missing without a reason"
            continue
        assert entry["available"], f"{name}: {entry['reason']}"
        s = entry["summary"]
        assert s["baseline_step_s"]["median"] > 0
        assert math.isfinite(s["lost_s"]["median"])
        if name != "none":
            assert s["stall_s"]["median"] > 0, name
        if name not in ("none", "memcpy"):
            assert s["durable_s"]["median"] > 0, name
            assert s["durable_s"]["median"] >= s["stall_s"]["median"] * 0.99 or name.endswith("overlap"), name
        assert entry["saves"] and entry["saves"][0]["steps"], name
    tc = methods["tiercheck"]["saves"][0]["tiercheck_stats"]
    assert tc["bytes"] > 0 and tc["stall_s"] > 0
    subjects = {t["subject"] for t in rep["targets"]}
    assert subjects == {"tiercheck", "tiercheck_overlap"}
    if rep.get("images"):
        assert all(Path(p).is_file() for p in rep["images"])


def test_isolated_runs_merge_into_one_report() -> None:
    """`stall.py --isolate K`: the children's reports (one method each, beside `none`) merge
    with their saves renumbered and the targets recomputed, paired by save index."""
    import argparse

    from benchmarks.stall.isolate import merge
    from benchmarks.stall.report import METRIC_NAMES

    def child(pid: int, method: str, lost: list[float]) -> dict[str, object]:
        def saves(values: list[float]) -> list[dict[str, object]]:
            return [{**dict.fromkeys(METRIC_NAMES, 1.0), "repeat": i, "lost_s": v} for i, v in enumerate(values)]

        return {
            "machine": {"pid": pid},
            "config": {"process": pid, "wall_s": 1.0, "loadavg_end": (pid, 0, 0), "repeats": len(lost)},
            "definitions": {},
            "notes": [],
            "methods": {
                "none": {"description": "floor", "available": True, "reason": None, "saves": saves([0.0] * len(lost))},
                method: {"description": method, "available": True, "reason": None, "saves": saves(lost)},
            },
        }

    args = argparse.Namespace(methods=["none", "odirect_writer", "tiercheck"], repeats=4, isolate=2)
    reports = [
        (0, child(1, "odirect_writer", [2.0, 4.0])),
        (0, child(2, "tiercheck", [1.0, 8.0])),
        (2, child(3, "tiercheck", [3.0, 3.0])),
        (2, child(4, "odirect_writer", [6.0, 6.0])),
    ]
    rep = merge(args, reports, 9.0)
    assert list(rep["methods"]) == ["none", "odirect_writer", "tiercheck"]
    tc = rep["methods"]["tiercheck"]
    assert [s["repeat"] for s in tc["saves"]] == [0, 1, 2, 3]
    assert [s["process"] for s in tc["saves"]] == [2, 2, 3, 3]
    assert tc["summary"]["lost_s"] == {"median": 3.0, "min": 1.0, "max": 8.0, "n": 4}
    assert rep["methods"]["none"]["summary"]["lost_s"]["n"] == 8
    (lost,) = [t for t in rep["targets"] if t["target"] == "lost / naive O_DIRECT writer lost"]
    assert lost["of_medians"] == 3.0 / 5.0
    assert lost["paired_median"] == 0.5  # median of 1/2, 8/4, 3/6, 3/6
    assert rep["config"]["repeats"] == 4 and rep["config"]["loadavg_end"] == (4, 0, 0)


def test_save_stall_of_many_small_tensors_follows_the_bytes(tmp_path: Path) -> None:
    """5,000 tensors of 1 KiB: save()'s stall over a plain per-tensor copy_ into one buffer,
    measured side by side (benchmarks/save/many_tensors.py). It was about 12x before the structure
    cache and the batched copy (issue 25); the bound is generous for a busy machine but far
    below a per-leaf regression."""
    from benchmarks.save.many_tensors import stall_over_floor
    ratio = stall_over_floor(5000, 1024, repeats=5, work=tmp_path)
    assert ratio < 3.0, f"save() stall is {ratio:.2f}x the plain copy at 5,000 small tensors"


def test_restore_of_many_small_tensors_follows_the_bytes(tmp_path: Path) -> None:
    """5,000 tensors of 1 KiB: restore() into a template of the same structure over a plain
    read and per-tensor copy_ of the same bytes, side by side (benchmarks/save/many_tensors.py).
    It was about 20x before the bulk entry checks and the batched binding and copy (issue 25),
    8x to 13x after on a busy 2-core machine; the bound catches a return to per-leaf costs."""
    from benchmarks.save.many_tensors import restore_over_plain

    ratio = restore_over_plain(5000, 1024, repeats=5, work=tmp_path)
    assert ratio < 16.0, f"restore is {ratio:.2f}x a plain read and copy at 5,000 small tensors"
