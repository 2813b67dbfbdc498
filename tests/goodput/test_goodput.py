"""The run log, `tiercheck report` and `tiercheck plan` (issue 17).

Pure parts are checked against hand-computed values; the report against a real training
loop with known sleeps, run as two processes (the first killed mid-run, the second
restoring), whose own measurements are the ground truth.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.__main__ import main as tiercheck_main
from tiercheck.format import naming
from tiercheck.goodput import summary as goodput
from tiercheck.goodput.runlog import read_records
from tiercheck.goodput.summary import (
    daly_interval,
    format_duration,
    lost_fraction,
    parse_duration,
    plan,
    summarise,
    young_interval,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "goodput_worker.py"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`tiercheck ARGS` in this process (the entry point itself runs as a subprocess in
    test_cli.py): 3-4 s less per call than starting an interpreter that imports torch."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tiercheck_main(list(args))
    return subprocess.CompletedProcess(["tiercheck", *args], code, out.getvalue(), err.getvalue())


# -- formulas (pure) -------------------------------------------------------------------


def test_young_and_daly_against_hand_computed_values() -> None:
    # C = 30 s, M = 8 h = 28800 s: sqrt(2*30*28800) = sqrt(1728000) = 1314.534;
    # C/2M = 5.2083e-4, sqrt = 0.022822: 1314.534 * (1 + 0.0076073 + 0.0000579) - 30 = 1294.610.
    assert young_interval(30, 28800) == pytest.approx(1314.5341, rel=1e-6)
    assert daly_interval(30, 28800) == pytest.approx(1294.6102, rel=1e-6)
    # C >= 2M: Daly says checkpoint every M.
    assert daly_interval(100, 40) == 40
    assert daly_interval(80, 40) == 40


def test_lost_fraction_model() -> None:
    # 1 - T / (M (e^((T+C)/M) - 1)) at T = 1294.610, C = 30, M = 28800: 0.044952.
    assert lost_fraction(1294.6102, 30, 28800) == pytest.approx(0.044952, rel=1e-4)
    # With a 5 min restart: e^(300/28800) multiplies the wall time: 0.054849.
    assert lost_fraction(1294.6102, 30, 28800, 300) == pytest.approx(0.054849, rel=1e-4)
    # First order: C/T + T/2M = 0.02317 + 0.02248 = 0.0456 (Daly's model is a bit lower).
    assert lost_fraction(1294.6102, 30, 28800) == pytest.approx(30 / 1294.61 + 1294.61 / 57600, rel=0.03)
    # Daly's interval is (near) the minimum of the model; far from it, more is lost.
    best = min(lost_fraction(t, 30, 28800) for t in range(200, 6000, 5))
    assert lost_fraction(daly_interval(30, 28800), 30, 28800) == pytest.approx(best, rel=1e-3)
    assert lost_fraction(300, 30, 28800) > 0.09 and lost_fraction(6000, 30, 28800) > 0.09
    assert lost_fraction(10**7, 30, 28800) == 1.0  # beyond overflow: nothing is ever finished
    with pytest.raises(ValueError):
        lost_fraction(0, 30, 28800)
    with pytest.raises(ValueError):
        young_interval(-1, 28800)


def test_plan_compares_costs() -> None:
    p = plan(30, 28800, 300)
    assert (p.young_interval_s, p.daly_interval_s) == (
        pytest.approx(1314.534, rel=1e-6),
        pytest.approx(1294.61, rel=1e-6),
    )
    assert p.lost_fraction == pytest.approx(0.054849, rel=1e-4)
    assert p.lost_fraction <= p.lost_fraction_young
    cheap = plan(0.5, 28800, 300)
    assert cheap.lost_fraction < p.lost_fraction / 3  # a cheap save: save often and lose far less


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30.0),
        ("5m", 300.0),
        ("8h", 28800.0),
        ("1.5d", 129600.0),
        ("1h30m", 5400.0),
        ("2 h", 7200.0),
        ("250ms", 0.25),
        ("42", 42.0),
        (".5s", 0.5),
        ("1w", 604800.0),
        ("10min", 600.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "  ", "8x", "h", "-5s", "5m3", "1e3s", "30 s s", "nan", "inf", "5,5s"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_format_duration() -> None:
    assert [format_duration(x) for x in (0, 5e-4, 0.0123, 4.561, 750, 11520, 181440, None)] == [
        "0 s",
        "500 us",
        "12.3 ms",
        "4.56 s",
        "12.5 min",
        "3.20 h",
        "2.1 d",
        "-",
    ]


# -- report from records (pure) ----------------------------------------------------------


def rec(kind: str, session: str, t: float, seq: int = 0, rank: int = 0, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "session": session, "rank": rank, "seq": seq, "t": t, **fields}


def loop(session: str, t0: float, t: float, it: int, iters: int, wait: float, comp: float, busy: int = 0,
         bwait: float = 0.0, bcomp: float = 0.0) -> dict[str, Any]:  # fmt: skip
    return rec(
        "loop", session, t, t0=t0, iter=it, iters=iters, wait_s=wait, compute_s=comp,
        busy_iters=busy, busy_wait_s=bwait, busy_compute_s=bcomp,
    )  # fmt: skip


def two_runs() -> list[dict[str, Any]]:
    """Run A: 100 steps of 1 s (0.7 compute + 0.3 wait) from t=10, saves at steps 0, 50
    (1 s stall each), killed at t=112 after step 99. Run B starts at t=142, restores step 50
    in 4 s, does 60 steps of 1 s, closes at t=210 after a 2 s wait."""
    a, b = "a" * 16, "b" * 16
    return [
        rec("start", a, 10.0),
        rec("restore", a, 10.0, dur_s=0.0, step=None, iter=0),
        rec("save", a, 11.0, step=0, iter=1, stall_s=1.0, bytes=10),
        rec("durable", a, 14.0, step=0, tier_s={"local": 3.0, "remote": 9.0}),
        loop(a, 10.0, 61.0, 50, 50, 15.0, 35.0, busy=3, bwait=0.9, bcomp=2.7),  # 0.3 s slower per busy step
        rec("save", a, 61.0, step=50, iter=51, stall_s=1.0, bytes=10),
        rec("durable", a, 64.0, step=50, tier_s={"local": 3.0, "remote": 7.0}, errors={"remote": "boom"}),
        loop(a, 61.0, 112.0, 100, 50, 15.0, 35.0),
        rec("start", b, 142.0),
        rec("restore", b, 142.0, dur_s=4.0, step=50, iter=0),
        loop(b, 146.0, 206.0, 60, 60, 18.0, 42.0),
        rec("close", b, 206.0, dur_s=2.0),
    ]


def test_summarise_two_runs_by_hand() -> None:
    r = summarise(two_runs())
    a, b = r.runs
    assert (a.ended, b.ended) == ("failed", "closed")
    assert (a.wall_s, a.compute_s, a.data_wait_s, a.checkpoint_s) == (102.0, 70.0, 30.0, 2.0)
    assert (a.iterations, a.saves, a.furthest_step, a.step_time_s) == (100, 2, 99, 1.0)
    # Lost per save: 1 s stall, plus 3 busy steps 0.2 s slower than the 1 s idle mean...
    idle = (70 - 2.7 + 30 - 0.9) / 97
    assert a.save_cost_s == pytest.approx((2.0 + (2.7 + 0.9 - 3 * idle)) / 2)
    assert a.durable_s == {"local": 3.0, "remote": 8.0}
    assert a.errors == 1
    # B repeats steps 51..99 of A: 49 steps of A's 1 s; it started 30 s after A's last record.
    assert (b.redo_steps, b.redo_s, b.gap_before_s, b.after_failure) == (49, 49.0, 30.0, True)
    assert (b.wall_s, b.restore_s, b.checkpoint_s, b.restored_step, b.furthest_step) == (66.0, 4.0, 2.0, 50, 110)
    t = r.total
    assert (t.runs, t.failures, t.wall_s, t.gap_s, t.redo_s, t.saves) == (2, 1, 198.0, 30.0, 49.0, 2)
    assert t.useful_compute_s == pytest.approx(70 + 42 - 49 * 0.7)
    assert t.bar["data wait"] == pytest.approx(30 + 18 - 49 * 0.3)
    assert sum(t.bar.values()) == pytest.approx(t.wall_s)
    assert t.goodput == pytest.approx(t.useful_compute_s / 198.0)
    assert t.blocking_cost_s == 3.0  # a save blocking until durable on tier 1
    # Data wait (48 s) exceeds checkpoint cost (4 + 4 + 49 s) in run A only (30 s > 2 s).
    assert [x.data_wait_exceeds_checkpoint for x in r.runs] == [True, False]
    assert len(r.flags) == 1 and "data wait" in r.flags[0] and "run 1" in r.flags[0]
    assert json.loads(json.dumps(r.to_dict()))["total"]["redo_s"] == 49.0


def test_summarise_skips_torn_and_foreign_records() -> None:
    records = [*two_runs(), {"v": 1, "kind": "loop"}, {"v": 99, "kind": "start"}, rec("loop", "a" * 16, 50.0)]
    records.append(rec("newkind", "a" * 16, 60.0))  # a later version's record: ignored quietly
    r = summarise(records)
    assert r.skipped_records == 3 and len(r.runs) == 2 and r.runs[0].compute_s == 70.0


def test_heartbeat_window_counts_only_when_no_loop_record_covers_it() -> None:
    a = "a" * 16
    base = [rec("start", a, 0.0), loop(a, 0.0, 50.0, 50, 50, 10.0, 40.0)]

    def beat(t: float, t0: float, it: int, iters: int) -> dict[str, Any]:
        return rec("heartbeat", a, t, t0=t0, iter=it, iters=iters, wait_s=iters * 0.2, compute_s=iters * 0.8,
                   busy_iters=0, busy_wait_s=0.0, busy_compute_s=0.0)  # fmt: skip

    fresh = summarise([*base, beat(58.0, 50.0, 58, 8)]).runs[0]  # killed 8 s after the last flush
    assert (fresh.iterations, fresh.compute_s, fresh.data_wait_s, fresh.end_t) == (58, 46.4, 11.6, 58.0)
    stale = summarise([*base, beat(30.0, 0.0, 30, 30)]).runs[0]  # older than the flushed window
    assert (stale.iterations, stale.compute_s, stale.data_wait_s, stale.end_t) == (50, 40.0, 10.0, 50.0)
    bare = summarise([*base, rec("heartbeat", a, 55.0, iter=55)]).runs[0]  # no window: progress only
    assert (bare.iterations, bare.furthest_step, bare.compute_s, bare.end_t) == (50, 54, 40.0, 55.0)


def test_summarise_picks_a_rank() -> None:
    records = [*two_runs(), rec("start", "c" * 16, 5.0, rank=3), rec("close", "c" * 16, 6.0, rank=3, dur_s=0.0)]
    assert summarise(records).rank == 0 and summarise(records).ranks == (0, 3)
    only = summarise(records, rank=3)
    assert [x.wall_s for x in only.runs] == [1.0]


def test_utilisation_fractions_sum_to_one_while_running() -> None:
    r = summarise(two_runs())
    edges, frac = goodput.utilisation(r, bins=198)  # from t=10 to B's end at 208: 1 s a bin
    assert len(edges) == 199 and edges[-1] == pytest.approx(198.0)
    sums = [sum(frac[c][i] for c in goodput.CATEGORIES) for i in range(198)]
    assert all(s == pytest.approx(1.0, abs=1e-6) for s in sums)
    assert frac["gap"][125 - 10] == pytest.approx(1.0)  # between A's end (112) and B's start (142)
    assert frac["restore"][144 - 10] == pytest.approx(1.0)  # B restores from 142 to 146
    assert frac["redo"][150 - 10] == pytest.approx(1.0)  # then redoes 49 s of A's steps
    assert frac["compute"][200 - 10] == pytest.approx(0.7) and frac["data wait"][200 - 10] == pytest.approx(0.3)
    assert frac["checkpoint"][207 - 10] == pytest.approx(1.0)  # close() waits 2 s


# -- the run log on a real Checkpointer ----------------------------------------------------


def sleepy(n: int, wait: float) -> Iterator[int]:
    for i in range(n):
        time.sleep(wait)
        yield i


def test_aggregated_not_one_record_per_step(tmp_path: Path) -> None:
    state = {"w": torch.zeros(100)}
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:  # default interval
        for i in ckpt.timed(range(2000)):
            if i % 500 == 0:
                ckpt.save(i, state)
    records, bad = read_records(str(tmp_path))
    kinds = [r["kind"] for r in records]
    assert bad == 0
    assert kinds.count("loop") <= 5 and kinds.count("save") == 4 and kinds.count("durable") == 4
    assert len(records) <= 16
    r = summarise(records)
    assert r.runs[0].iterations == 2000 and r.runs[0].furthest_step == 1999
    # The run log never counts as a step, and retention and the leftover sweep leave it.
    assert tiercheck.Checkpointer(local=tmp_path, run_log_interval=None).steps() == [1000, 1500]
    assert (tmp_path / naming.RUNLOG_DIR / naming.runlog_file_name(0)).is_file()


def test_restore_only_session_writes_nothing(tmp_path: Path, dir_snapshot: Any) -> None:
    state = {"w": torch.ones(10)}
    with tiercheck.Checkpointer(local=tmp_path, run_log_interval=None) as ckpt:
        ckpt.save(1, state)
    before = dir_snapshot(tmp_path)
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:
        assert ckpt.restore(state) == 1
        ckpt.wait()
    assert dir_snapshot(tmp_path) == before  # readers never modify a tier
    with pytest.raises(FileNotFoundError, match="no run log"):
        read_records(str(tmp_path))


def test_write_failure_is_warned_once_and_training_goes_on(tmp_path: Path, caplog: Any) -> None:
    (tmp_path / naming.RUNLOG_DIR).write_bytes(b"a file where the directory should be")
    state = {"w": torch.zeros(10)}
    with (
        caplog.at_level(logging.WARNING, logger="tiercheck"),
        tiercheck.Checkpointer(local=tmp_path, keep_local=None, run_log_interval=0) as ckpt,
    ):
        for i in ckpt.timed(range(30)):
            if i % 10 == 0:
                ckpt.save(i, state)
    warned = [r for r in caplog.records if "run log" in r.getMessage()]
    assert len(warned) == 1 and naming.RUNLOG_DIR in warned[0].getMessage()
    assert tiercheck.Checkpointer(local=tmp_path, run_log_interval=None).steps() == [0, 10, 20]


def test_torn_line_does_not_swallow_the_next_session(tmp_path: Path) -> None:
    log = tmp_path / naming.RUNLOG_DIR / naming.runlog_file_name(0)
    log.parent.mkdir(parents=True)
    log.write_bytes(b'{"v":1,"kind":"loo')  # a crash cut this line
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:
        ckpt.save(0, {"w": torch.zeros(10)})
    records, bad = read_records(str(tmp_path))
    assert bad == 1
    assert [r["kind"] for r in records][:2] == ["start", "save"]


def test_remote_only_run_log(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/bucket-{uuid.uuid4().hex[:8]}"
    with tiercheck.Checkpointer(remote=url) as ckpt:
        for i in ckpt.timed(sleepy(6, 0.001)):
            if i % 3 == 0:
                ckpt.save(i, {"w": torch.full((10,), float(i))})
    records, bad = read_records(url)
    r = summarise(records)
    assert (bad, r.runs[0].saves, r.runs[0].iterations, r.runs[0].ended) == (0, 2, 6, "closed")
    assert set(r.runs[0].durable_s) == {"remote"}
    with tiercheck.Checkpointer(remote=url, run_log_interval=None) as ckpt:
        assert ckpt.steps() == [0, 3]
    assert tiercheck.load(url)["w"][0].item() == 3.0


def test_timed_costs_under_one_percent_of_a_10ms_step(tmp_path: Path) -> None:
    n = 20000
    with tiercheck.Checkpointer(local=tmp_path, run_log_interval=0.05) as ckpt:
        ckpt.save(0, {"w": torch.zeros(10)})
        best = math.inf
        for _ in range(3):  # best of three: a loaded machine only ever adds time
            t0 = time.perf_counter()
            for _ in range(n):
                pass
            plain = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in ckpt.timed(range(n)):
                pass
            best = min(best, (time.perf_counter() - t0 - plain) / n)
    assert best < 100e-6  # 1% of a 10 ms step (it measures ~1 us)


def test_run_log_interval_is_validated(tmp_path: Path) -> None:
    for bad in (-1, "10", float("nan"), True):
        with pytest.raises(ValueError, match="run_log_interval"):
            tiercheck.Checkpointer(local=tmp_path, run_log_interval=bad)


# -- a real loop over two processes, the first one killed -----------------------------------


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Run 1 saves steps 0, 10, 20 and dies fetching batch 24 (after step 23); run 2, started
    ~0.5 s later, restores step 20, redoes 21..23 and goes on to step 40."""
    d = tmp_path_factory.mktemp("goodput")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    common = ["--wait", "0.02", "--compute", "0.03", "--every", "10", "--interval", "0"]
    out1, out2 = d / "run1.json", d / "run2.json"
    p1 = subprocess.run(
        [sys.executable, str(WORKER), str(d / "ckpt"), str(out1), "--steps", "1000", "--crash-at-batch", "24", *common],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p1.returncode == 3, p1.stderr
    time.sleep(0.5)
    p2 = subprocess.run(
        [sys.executable, str(WORKER), str(d / "ckpt"), str(out2), "--steps", "41", *common],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p2.returncode == 0, p2.stderr
    return d / "ckpt", json.loads(out1.read_text()), json.loads(out2.read_text())


def test_report_recovers_known_sleeps(crashed_run: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    ckpt_dir, t1, t2 = crashed_run
    assert (t1["steps"], t2["restored"], t2["steps"]) == (24, 20, 20)
    records, bad = read_records(str(ckpt_dir))
    r = summarise(records)
    assert bad == 0 and len(r.runs) == 2
    a, b = r.runs
    assert (a.ended, b.ended, b.after_failure) == ("failed", "closed", True)
    close = {"rel": 0.15}
    assert a.data_wait_s == pytest.approx(t1["wait_s"], **close)
    assert a.compute_s == pytest.approx(t1["compute_s"], **close)
    assert b.data_wait_s == pytest.approx(t2["wait_s"], **close)
    assert b.compute_s == pytest.approx(t2["compute_s"], **close)
    assert (a.saves, a.furthest_step, b.restored_step, b.redo_steps) == (3, 23, 20, 3)
    # Steps 21..23 again, at run 1's step time (its measured compute + wait per step).
    step_time = (t1["compute_s"] + t1["wait_s"]) / t1["steps"]
    assert b.redo_s == pytest.approx(3 * step_time, **close)
    assert b.gap_before_s == pytest.approx(t2["t_create"] - t1["t_crash"], **close)
    assert r.total.data_wait_s == pytest.approx(t1["wait_s"] + t2["wait_s"], **close)
    assert r.total.compute_s == pytest.approx(t1["compute_s"] + t2["compute_s"], **close)
    assert b.wall_s == pytest.approx(t2["t_end"] - t2["t_create"], **close)
    # The loader is the larger loss here (20 ms a batch vs ~ms saves): said in one line.
    assert r.total.data_wait_exceeds_checkpoint and sum("data wait" in f for f in r.flags) == 1


def test_cli_report_json_and_plot(crashed_run: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    ckpt_dir, t1, t2 = crashed_run
    png = tmp_path / "timeline.png"
    p = run_cli("report", str(ckpt_dir), "--json", "--plot", str(png))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [run["ended"] for run in out["runs"]] == ["failed", "closed"]
    assert out["runs"][1]["redo_steps"] == 3
    assert out["total"]["data_wait_s"] == pytest.approx(t1["wait_s"] + t2["wait_s"], rel=0.15)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = run_cli("report", str(ckpt_dir))
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith(f"tiercheck report {ckpt_dir} (rank 0): 2 run(s), 1 failed")
    assert sum(ln.startswith("! data wait") for ln in lines) == 1
    assert any(ln.startswith("2 ") and "(3 steps)" in ln and "(after failure)" in ln for ln in lines)


def test_cli_plan_from_the_run_log(crashed_run: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    ckpt_dir = crashed_run[0]
    report = summarise(read_records(str(ckpt_dir))[0])
    p = run_cli("plan", str(ckpt_dir), "--mtbf", "8h", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    cost = report.total.save_cost_s
    assert cost is not None and out["cost_source"] == "run log"
    assert out["cost_s"] == pytest.approx(cost)
    assert out["young_interval_s"] == pytest.approx(math.sqrt(2 * cost * 28800))
    assert out["blocking"]["cost_s"] == pytest.approx(report.total.durable_s["local"])
    # The measured restart: the gap before run 2 plus its restore.
    run2 = report.runs[1]
    assert out["restart_s"] == pytest.approx((run2.gap_before_s or 0) + run2.restore_s)


def test_cli_plan_from_arguments() -> None:
    p = run_cli("plan", "--cost", "30s", "--mtbf", "8h", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["young_interval_s"] == pytest.approx(1314.534, rel=1e-6)
    assert out["daly_interval_s"] == pytest.approx(1294.610, rel=1e-6)
    assert out["lost_fraction"] == pytest.approx(0.044952, rel=1e-4)
    assert "blocking" not in out
    p = run_cli("plan", "--cost", "2s", "--blocking-cost", "5m", "--mtbf", "8h", "--restart", "5m")
    assert p.returncode == 0, p.stderr
    rows = p.stdout.splitlines()
    assert rows[2].split()[0:3] == ["this", "save", "2.00"] and rows[3].startswith("blocking save  5.0 min")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--cost", "30x", "--mtbf", "8h"], "tiercheck plan: --cost: cannot read '30x' as a duration"),
        (["plan", "--cost", "30s", "--mtbf", "0s"], "tiercheck plan: --mtbf: must be more than zero"),
        (["plan", "--mtbf", "8h"], "tiercheck plan: give --cost"),
        (["report", "/nonexistent/tiercheck-dir"], "tiercheck report: no run log in /nonexistent/tiercheck-dir"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args: list[str], message: str) -> None:
    p = run_cli(*args)
    assert p.returncode == 2
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1 and p.stderr.startswith(message)


def test_heartbeat_tells_how_far_a_run_got_between_flushes(tmp_path: Path) -> None:
    """With a long flush interval and one save (step 0), the log alone would say run 1 died
    near step 0; the heartbeat (about once a second) says how far it really got, and the next
    session keeps it in the log before writing its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ckpt_dir = tmp_path / "ckpt"
    common = ["--wait", "0.005", "--compute", "0.015", "--every", "100000", "--interval", "600"]
    runs = []
    for i, extra in enumerate((["--steps", "100000", "--crash-at-batch", "150"], ["--steps", "160"])):
        out = tmp_path / f"run{i}.json"
        p = subprocess.run(
            [sys.executable, str(WORKER), str(ckpt_dir), str(out), *extra, *common],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == (3 if i == 0 else 0), p.stderr
        runs.append(json.loads(out.read_text()))
    assert (runs[0]["steps"], runs[1]["restored"]) == (150, 0)
    log = (ckpt_dir / naming.RUNLOG_DIR / naming.runlog_file_name(0)).read_bytes().decode()
    first = summarise(read_records(str(ckpt_dir))[0]).runs[0]
    kinds = [json.loads(ln)["kind"] for ln in log.splitlines() if first.session in ln]
    assert kinds.count("heartbeat") == 1 and kinds.count("loop") <= 1  # aggregated: saved by the heartbeat
    a, b = summarise(read_records(str(ckpt_dir))[0]).runs
    # Run 1 finished steps 0..149; the heartbeat is at most ~1 s (here <= 60 steps) behind.
    assert a.furthest_step is not None and 149 - 60 <= a.furthest_step <= 149
    assert b.redo_steps == a.furthest_step
    # The heartbeat also carries the unflushed window's timing: most of run 1's loop is known.
    assert 0.5 * runs[0]["compute_s"] <= a.compute_s <= 1.05 * runs[0]["compute_s"]
    assert 0.5 * runs[0]["wait_s"] <= a.data_wait_s <= 1.05 * runs[0]["wait_s"]
    assert a.end_t == pytest.approx(runs[0]["t_crash"], abs=1.5)
