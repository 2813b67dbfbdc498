"""Smoke test of benchmarks/save/trainers.py (the stall of each trainer's checkpointing vs
tiercheck): it runs and reports a positive stall for both methods of every idiom."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_trainers_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(  # as a module of the checkout's `benchmarks` package, not by file path
        [sys.executable, "-m", "benchmarks.save.trainers", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"plain loop", "Lightning", "Accelerate"}
    for idiom, methods in summary.items():
        assert set(methods) == {"default", "tiercheck"}, idiom
        for method, m in methods.items():
            assert m["steady_s"] > 0 and m["first_s"] > 0, (idiom, method, m)
    assert "| Lightning |" in proc.stdout
