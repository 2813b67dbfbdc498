"""Smoke test of the stall benchmark (benchmarks/stall.py) through `python -m tiercheck bench`.

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

REPO = Path(__file__).resolve().parent.parent
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
