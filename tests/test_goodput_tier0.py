"""Tier 0 in `tiercheck report` and `tiercheck plan` (issue 26, item 6): which tier each
restore read and how long it took, from a real run log of a job killed (SIGKILL) and
restarted; the expected loss when a share of failures restarts from memory, checked against
hand-computed values and the model's own definition, without I/O."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tiercheck.__main__ import main as tiercheck_main
from tiercheck.goodput.runlog import read_records
from tiercheck.goodput.summary import summarise

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

# Trains from the restored step (if any) with a timed loop, saving every step; with KILL >= 0
# it dies by SIGKILL right after step KILL is durable on every tier.
WORKER = textwrap.dedent(
    """
    import json, os, signal, sys, time, torch, tiercheck
    root, last, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    state = {"w": torch.zeros(1 << 16), "step": -1}
    ck = tiercheck.Checkpointer(local=os.path.join(root, "ckpt"), memory=True, keep_local=2,
                                memory_dir=os.path.join(root, "shm"), job_id="report-t0", run_log_interval=0)
    restored = ck.restore(state)
    print(json.dumps({"restored": restored, "w": float(state["w"][0])}), flush=True)
    step = 0 if restored is None else restored + 1
    for _ in ck.timed(range(10**6)):
        if step > last:
            break
        time.sleep(0.01)
        state["w"].fill_(step)
        state["step"] = step
        h = ck.save(step, state)
        if step == kill:
            h.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        step += 1
    ck.close()
    """
)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tiercheck_main(list(args))
    return subprocess.CompletedProcess(["tiercheck", *args], code, out.getvalue(), err.getvalue())


def run_worker(root: Path, last: int, kill: int) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-c", WORKER, str(root), str(last), str(kill)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == (-signal.SIGKILL if kill >= 0 else 0), p.stderr
    return json.loads(p.stdout.splitlines()[0])


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 1 saves steps 0..5 and is killed; run 2 restores step 5 from memory, saves 6..9
    and is killed; the node's memory is then lost; run 3 restores step 9 from tier 1 and
    finishes at step 12."""
    root = tmp_path_factory.mktemp("report-t0")
    (root / "shm").mkdir()
    assert run_worker(root, 100, 5) == {"restored": None, "w": 0.0}
    assert run_worker(root, 100, 9) == {"restored": 5, "w": 5.0}
    shutil.rmtree(root / "shm" / "tiercheck-report-t0")
    assert run_worker(root, 12, -1) == {"restored": 9, "w": 9.0}
    return root / "ckpt"


def test_report_names_the_tier_each_restore_read(three_runs: Path) -> None:
    report = summarise(read_records(str(three_runs))[0])
    runs = report.runs
    assert [(r.ended, r.restored_step, r.restored_tier) for r in runs] == [
        ("failed", None, None),
        ("failed", 5, "memory"),
        ("closed", 9, "local"),
    ]
    assert all(r.restore_s > 0 for r in runs[1:])
    assert set(report.total.restores) == {"memory", "local"}
    assert report.total.restores["memory"] == {"count": 1, "mean_s": pytest.approx(runs[1].restore_s)}
    assert report.total.restores["local"] == {"count": 1, "mean_s": pytest.approx(runs[2].restore_s)}

    p = run_cli("report", str(three_runs), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [r["restored_tier"] for r in out["runs"]] == [None, "memory", "local"]
    assert out["total"]["restores"]["memory"]["count"] == 1

    text = run_cli("report", str(three_runs))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    row2 = next(ln for ln in lines if ln.startswith("2 "))
    row3 = next(ln for ln in lines if ln.startswith("3 "))
    assert "(memory)" in row2 and "(local)" in row3
    restores = next(ln for ln in lines if ln.startswith("restores, mean time each: "))
    assert restores.count("; ") == 1 and "1 from local " in restores and "1 from memory " in restores


def rec(kind: str, session: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "session": session, "rank": 0, "seq": 0, "t": t, **fields}


def test_a_log_older_than_tier0_shows_no_tier() -> None:
    records = [
        rec("start", "a", 100.0),
        rec("save", "a", 101.0, step=0, iter=0, stall_s=0.01),
        rec("start", "b", 200.0),
        rec("restore", "b", 200.5, dur_s=0.25, step=0, iter=0),  # no "tier": written before tier 0
        rec("close", "b", 201.0, dur_s=0.0),
    ]
    report = summarise(records)
    assert [r.restored_tier for r in report.runs] == [None, None]
    assert report.runs[1].restore_s == 0.25 and report.total.restores == {"?": {"count": 1, "mean_s": 0.25}}
    from tiercheck.cli.goodput import format_report

    text = format_report(report, "DIR")
    row = next(ln for ln in text.splitlines() if ln.startswith("2 "))
    assert "250.0 ms" in row and "(" not in row.split("250.0 ms")[1].split()[0]
    assert "restores, mean time each: 1 from an unnamed tier (a log older than tier 0) 250.0 ms" in text


@pytest.mark.parametrize("tier", [7, "", "Memory", "x" * 33, "memory\n", "\x1b[2J", ["memory"], {"a": 1}, True])
def test_a_hostile_tier_field_skips_the_record(tier: object) -> None:
    good = rec("restore", "b", 200.5, dur_s=0.25, step=0, iter=0, tier="memory")
    base = [rec("start", "a", 100.0), rec("start", "b", 200.0)]
    report = summarise([*base, {**good, "tier": tier}])
    assert report.skipped_records == 1 and report.runs[1].restore_s == 0.0 and report.runs[1].restored_tier is None
    assert summarise([*base, good]).runs[1].restored_tier == "memory"
