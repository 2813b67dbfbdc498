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
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tiercheck.__main__ import main as tiercheck_main
from tiercheck.goodput.recovery import Recovery, effective_restart, tier0_plan
from tiercheck.goodput.runlog import read_records
from tiercheck.goodput.summary import daly_interval, lost_fraction, summarise

ROOT = Path(__file__).resolve().parents[2]
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


# -- tiercheck plan with tier 0 ---------------------------------------------------------------


def test_effective_restart_against_hand_computed_values() -> None:
    # q = 0.75 e^(-10/28800) + 0.25 e^(-300/28800) = 0.7497396 + 0.2474093 = 0.9971489;
    # R_eff = -28800 ln q = 28800 x 0.0028552 = 82.23 s (the mean restart would be 82.5 s).
    mix = [Recovery(0.75, 10.0), Recovery(0.25, 300.0)]
    assert effective_restart(28800, mix) == pytest.approx(82.2267, rel=1e-5)
    # One recovery: its restart plus its lag, exactly (then the model is Daly's).
    assert effective_restart(28800, [Recovery(1.0, 300.0, 45.0)]) == pytest.approx(345.0, rel=1e-12)
    # A share of 0 changes nothing; restarts far beyond M do not underflow to a crash.
    assert effective_restart(28800, [Recovery(0.0, 1.0), Recovery(1.0, 300.0)]) == pytest.approx(300.0)
    far = effective_restart(10.0, [Recovery(0.5, 1e6), Recovery(0.5, 2e6)])
    assert far == pytest.approx(1e6 + 10.0 * math.log(2), rel=1e-9)
    for bad in ([Recovery(0.5, 10.0)], [Recovery(1.2, 1.0), Recovery(-0.2, 1.0)], [Recovery(1.0, -1.0)], []):
        with pytest.raises(ValueError):
            effective_restart(28800, bad)


def test_tier0_plan_is_daly_at_the_ends_and_in_between() -> None:
    p = tier0_plan(30.0, 28800.0, 300.0, memory_restart=10.0, memory_share=0.75)
    assert p.interval_s == pytest.approx(daly_interval(30.0, 28800.0))
    assert p.durable_lost_fraction == pytest.approx(lost_fraction(p.interval_s, 30.0, 28800.0, 300.0))
    assert p.durable_lost_fraction == pytest.approx(0.054849, rel=1e-4)  # test_goodput's hand-computed value
    assert p.lost_fraction == pytest.approx(lost_fraction(p.interval_s, 30.0, 28800.0, 82.2267), rel=1e-6)
    assert p.lost_fraction == pytest.approx(0.047675, rel=1e-4)
    none = tier0_plan(30.0, 28800.0, 300.0, memory_restart=10.0, memory_share=0.0)
    assert none.lost_fraction == pytest.approx(none.durable_lost_fraction, rel=1e-12)
    every = tier0_plan(30.0, 28800.0, 300.0, memory_restart=10.0, memory_share=1.0)
    assert every.lost_fraction == pytest.approx(lost_fraction(every.interval_s, 30.0, 28800.0, 10.0), rel=1e-12)
    # A lag: the durable tiers' snapshot is W behind; tier 0's is not. Saves stay W apart.
    lag = tier0_plan(0.2, 50400.0, 300.0, memory_restart=30.0, memory_share=0.75, durable_after=300.0)
    assert lag.interval_s == 300.0 > daly_interval(0.2, 50400.0)
    assert lag.durable_restart_effective_s == pytest.approx(600.0)
    assert lag.lost_fraction < lag.durable_lost_fraction / 2


def simulate(interval: float, cost: float, mtbf: float, kinds: list[tuple[float, float]], segments: int) -> float:
    """The lost fraction by simulation: segments of T + C that a failure (exponential, mean M)
    sends back to their start after a restart of the failure's kind (itself interruptible)."""
    rng = random.Random(1234)
    shares = [p for p, _ in kinds]
    wall = 0.0
    for _ in range(segments):
        while True:
            fail = rng.expovariate(1.0 / mtbf)
            if fail >= interval + cost:
                wall += interval + cost
                break
            wall += fail
            while True:  # a restart of the kind drawn, until one completes
                restart = rng.choices(kinds, shares)[0][1]
                fail = rng.expovariate(1.0 / mtbf)
                if fail >= restart:
                    wall += restart
                    break
                wall += fail
    return 1.0 - segments * interval / wall


def test_the_mixed_model_matches_a_simulation() -> None:
    # M = 1, T = 0.4, C = 0.05: tier 0 brings 75% back in 0.02, the rest take 0.6.
    mtbf, interval, cost = 1.0, 0.4, 0.05
    model = lost_fraction(interval, cost, mtbf, effective_restart(mtbf, [Recovery(0.75, 0.02), Recovery(0.25, 0.6)]))
    seen = simulate(interval, cost, mtbf, [(0.75, 0.02), (0.25, 0.6)], 40_000)
    assert seen == pytest.approx(model, abs=0.01)  # ~0.35 lost; the simulation's error is ~0.003
    # The mean restart (0.165) in Daly's single-restart model is not the same thing.
    assert abs(lost_fraction(interval, cost, mtbf, 0.165) - model) > 0.01


def test_cli_plan_with_tier0_from_arguments() -> None:
    p = run_cli(
        "plan", "--cost", "30s", "--mtbf", "8h", "--restart", "5m", "--memory-restart", "10s", "--memory-share", "0.75",
        "--json",
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["lost_fraction"] == pytest.approx(0.054849, rel=1e-4)  # the row without tier 0 is unchanged
    t0 = out["tier0"]
    assert (t0["memory_share"], t0["memory_restart_s"], t0["restart_s"], t0["durable_after_s"]) == (0.75, 10, 300, 0)
    assert t0["lost_fraction"] == pytest.approx(0.047675, rel=1e-4)
    assert t0["durable_lost_fraction"] == pytest.approx(out["lost_fraction"], rel=1e-9)
    text = run_cli("plan", "--cost", "30s", "--mtbf", "8h", "--restart", "5m", "--memory-restart", "10s")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[3].startswith("with tier 0: 75% of failures restart from memory in 10.00 s")
    assert lines[5].split() == ["tiers", "1-2", "only", "21.6", "min", "5.0", "min", "5.48%"]
    assert lines[6].split() == ["with", "tier", "0", "21.6", "min", "1.4", "min", "4.77%"]
    assert lines[7].startswith("tier 0 saves 0.72% of the time")
    pct = run_cli("plan", "--cost", "30s", "--mtbf", "8h", "--memory-restart", "10s", "--memory-share", "40%", "--json")
    assert json.loads(pct.stdout)["tier0"]["memory_share"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory-share", "0.75"], "tiercheck plan: give --memory-restart"),
        (["--memory-restart", "10s", "--memory-share", "1.5"], "tiercheck plan: --memory-share: give a fraction"),
        (["--memory-restart", "10s", "--memory-share", "nan"], "tiercheck plan: --memory-share: give a fraction"),
        (["--memory-restart", "10s", "--memory-share=-5%"], "tiercheck plan: --memory-share: give a fraction"),
        (["--memory-restart", "ten"], "tiercheck plan: --memory-restart: cannot read 'ten' as a duration"),
        (["--memory-restart", "1s", "--durable-after", "x"], "tiercheck plan: --durable-after: cannot read 'x'"),
    ],
)
def test_cli_plan_tier0_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    p = run_cli("plan", "--cost", "30s", "--mtbf", "8h", *args)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(message)


def test_cli_plan_measures_both_restarts_from_the_run_log(three_runs: Path) -> None:
    report = summarise(read_records(str(three_runs))[0])
    run2, run3 = report.runs[1], report.runs[2]
    p = run_cli("plan", str(three_runs), "--mtbf", "8h", "--memory-share", "0.75", "--json")
    assert p.returncode == 0, p.stderr
    t0 = json.loads(p.stdout)["tier0"]
    assert t0["memory_restart_s"] == pytest.approx((run2.gap_before_s or 0) + run2.restore_s)  # from memory
    assert t0["restart_s"] == pytest.approx((run3.gap_before_s or 0) + run3.restore_s)  # from tier 1
    assert t0["durable_after_s"] == pytest.approx(report.total.durable_s["local"])
    assert t0["cost_s"] == pytest.approx(report.total.save_cost_s)


@pytest.mark.parametrize(
    ("relaunch", "bandwidth", "durable_gpu_h", "tier0_gpu_h", "saved_gpu_h"),
    [
        (300.0, 70e9, 6972, 6379, 593),
        (300.0, 7e9, 14928, 8843, 6085),
        (60.0, 70e9, None, None, 596),
        (900.0, 70e9, None, None, 586),
        (60.0, 7e9, None, None, 6115),
        (900.0, 7e9, None, None, 6013),
    ],
)
def test_docs_goodput_seed_scenario_with_tier0(
    relaunch: float, bandwidth: float, durable_gpu_h: int | None, tier0_gpu_h: int | None, saved_gpu_h: int
) -> None:
    """docs/goodput.md, "The same run with tier 0": every number, recomputed."""
    mtbf = 2 * 730 * 3600 / 105  # 105 restarts in two months of 730 h
    cost = 2e12 / 992 / 12.5e9  # each GPU's share of 2 TB at 12.5 GB/s to host memory
    w = 2e12 / bandwidth
    p = tier0_plan(cost, mtbf, relaunch + w, relaunch + 2.0, 0.75, w)
    gpu_h = 992 * 730
    assert round(p.interval_s / 60, 1) == (2.1 if bandwidth == 70e9 else 4.8)
    if durable_gpu_h is not None:
        assert round(p.durable_lost_fraction * gpu_h) == durable_gpu_h
        assert round(p.lost_fraction * gpu_h) == tier0_gpu_h
    assert round((p.durable_lost_fraction - p.lost_fraction) * gpu_h) == saved_gpu_h
