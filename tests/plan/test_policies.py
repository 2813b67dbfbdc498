"""When to save and what to keep: `Every` save policies, `should_save`/`maybe_save`,
preemption as a policy (one rank and a real gloo job), `delete`, done callbacks, and
metric-ranked retention (`KeepBest`) with metrics stored in the commit marker."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers.faulty_fs import Faults  # as the other tests: one module, one registered protocol
from tests.helpers.multirank_worker import digest
from tiercheck import Every, KeepBest, KeepEvery, KeepLast
from tiercheck.format import naming
from tiercheck.plan.retention import KeepAll, best_steps, plan_deletions
from tiercheck.plan.schedule import AnyDue
from tiercheck.testing import Faults as TierFaults
from tiercheck.testing import FaultyTier
from tiercheck.tiers.local import LocalTier

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "multirank_worker.py")


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[len("step-") :]) for p in root.glob("step-*") if (p / naming.COMMIT_NAME).is_file())


# ------------------------------------------------------------------ save policies (pure)


def test_every_steps_is_due_at_multiples_not_twice() -> None:
    p = Every(steps=5)
    assert [s for s in range(0, 21) if p.due_by_step(s, None)] == [0, 5, 10, 15, 20]
    assert not p.due_by_step(10, last_saved=10)  # already saved
    assert p.due_by_step(10, last_saved=9)
    assert not p.due_by_clock(1e9) and not p.uses_clock


def test_every_seconds_and_combinations() -> None:
    p = Every(seconds=30)
    assert not p.due_by_clock(29.9) and p.due_by_clock(30.0) and p.uses_clock
    assert not p.due_by_step(0, None)
    both = Every(steps=500) | Every(seconds=1800)
    assert isinstance(both, AnyDue) and both.uses_clock
    assert both.due_by_step(1000, 500) and not both.due_by_step(1001, 1000)
    assert both.due_by_clock(1800) and not both.due_by_clock(1799)
    one = Every(steps=500, seconds=1800)  # the same, in one
    assert [one.due_by_step(s, None) for s in (500, 501)] == [True, False] and one.due_by_clock(1800)
    with pytest.raises(TypeError):
        Every(steps=5) | 3  # type: ignore[operator]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"steps": 0}, {"steps": -5}, {"steps": 2.0}, {"steps": True}, {"seconds": 0}, {"seconds": -1},
     {"seconds": math.inf}, {"seconds": math.nan}, {"seconds": "60"}],
)  # fmt: skip
def test_every_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Every(**kwargs)


def test_checkpointer_rejects_a_non_policy_interval(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        tiercheck.Checkpointer(local=tmp_path, interval=500)  # type: ignore[arg-type]


# ------------------------------------------------------------ should_save / maybe_save


def test_maybe_save_follows_the_step_policy(tmp_path: Path) -> None:
    state = {"w": torch.zeros(4), "step": 0}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, interval=Every(steps=5)) as ckpt:
        saved = []
        for step in range(1, 18):
            state["w"].add_(1)
            state["step"] = step
            handle = ckpt.maybe_save(step, state)
            assert (handle is not None) == (step % 5 == 0)
            if handle is not None:
                assert handle.step == step
                saved.append(step)
            assert ckpt.should_save(step) == (step % 5 == 0)  # asking again: the same answer
        ckpt.wait()
        assert saved == [5, 10, 15] and ckpt.steps() == [5, 10, 15]
    assert tiercheck.load(tmp_path, step=10)["w"].eq(10).all()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        assert not any(ckpt.should_save(s) for s in range(20))  # no policy, no signal: never


def test_should_save_by_the_clock_resets_at_every_save(tmp_path: Path) -> None:
    state = {"w": torch.zeros(2)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, interval=Every(seconds=0.3)) as ckpt:
        assert not ckpt.should_save(1)
        time.sleep(0.35)
        assert ckpt.should_save(2)
        assert ckpt.maybe_save(2, state) is not None
        assert not ckpt.should_save(3)  # the save reset the clock
        time.sleep(0.35)
        ckpt.save(4, state)  # a save by hand resets it too
        assert not ckpt.should_save(5)
        time.sleep(0.35)
        assert ckpt.maybe_save(6, state) is not None
        ckpt.wait()
        assert ckpt.steps() == [2, 4, 6]


def test_should_save_rejects_bad_steps(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(local=tmp_path) as ckpt, pytest.raises(ValueError):
        ckpt.should_save(-1)


SIGTERM_CHILD = """
import os, sys, time, torch, tiercheck
from tiercheck.tiers import local
slow = local.LocalTier._write_all
def write_all(self, fd, data, *args):  # a slow disk: the drain has to wait for the write
    time.sleep(0.5)
    slow(self, fd, data, *args)
local.LocalTier._write_all = write_all
ckpt = tiercheck.Checkpointer(local=sys.argv[1], keep_local=None, interval=tiercheck.Every(steps=10**6))
ckpt.install_sigterm_handler(grace_s=60, fresh=True)
state = {"w": torch.zeros(1000), "step": 0}
for step in range(1, 10**6):
    state["w"].add_(1)
    state["step"] = step
    print(step, flush=True)
    ckpt.maybe_save(step, state)
    time.sleep(0.01)
print("not reached", flush=True)
"""


def test_sigterm_makes_the_next_step_a_fresh_save_then_terminates(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True, bufsize=1
    )
    assert proc.stdout is not None
    seen = [int(proc.stdout.readline())]
    while seen[-1] < 20:
        seen.append(int(proc.stdout.readline()))
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    printed = seen + [int(x) for x in out.split()]
    assert proc.returncode == -signal.SIGTERM  # the default action, after the drain
    # Exactly one step saved: the first step the loop reached after the signal (not the
    # newest snapshot in memory: there was none), durable despite the slow disk.
    assert committed(tmp_path) == [printed[-1]]
    loaded = tiercheck.load(tmp_path)
    assert loaded["step"] == printed[-1] and loaded["w"].eq(printed[-1]).all()


def run_preempt_job(root: Path, world: int) -> tuple[list[int | None], list[str]]:
    """Start `preempt_one` on `world` gloo ranks, SIGTERM rank 1 once every rank passed step
    10, and return the exit codes and outputs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "preempt_one", str(r), str(world), str(port), str(root)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    try:
        deadline = time.monotonic() + 300  # imports alone take a while on a loaded machine
        while True:
            lines = [(root / f"progress-{r}").read_text().split() if (root / f"progress-{r}").exists() else []
                     for r in range(world)]  # fmt: skip
            if all(len(x) >= 10 for x in lines):
                break
            assert time.monotonic() < deadline, f"ranks did not reach step 10: {[len(x) for x in lines]}"
            time.sleep(0.02)
        os.kill(procs[1].pid, signal.SIGTERM)
        outputs = [p.communicate(timeout=300)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], outputs


def test_sigterm_to_one_rank_saves_the_same_fresh_step_on_every_rank(tmp_path: Path) -> None:
    import json

    world = 3
    codes, outputs = run_preempt_job(tmp_path, world)
    assert codes[1] == -signal.SIGTERM, outputs[1][-3000:]
    assert codes[0] == 0 and codes[2] == 0, outputs
    results = [json.loads((tmp_path / f"result-preempt_one-{r}.json").read_text()) for r in (0, 2)]
    (step,) = results[0]["saved"]  # one save, the agreed one
    for res in results:
        assert res["saved"] == [step] and res["preempted"] is True and res["last_step"] == step
    signalled_at = len((tmp_path / "progress-1").read_text().split())
    assert step >= 10 and step <= signalled_at + 2  # fresh: right after the signal, not older
    # The step is committed on tier 2 with every rank's part, and on every node's tier 1.
    assert committed(tmp_path / "remote") == [step]
    for r in range(world):
        assert committed(tmp_path / f"node{r}") == [step]
        loaded = tiercheck.load(f"file://{tmp_path}/remote", rank=r)
        assert loaded["position"] == step  # rank r's own state at that step
    # What ranks 0 and 2 saved is their state at that step, bit for bit.
    for r, res in zip((0, 2), results, strict=True):
        assert digest(tiercheck.load(tmp_path / f"node{r}", rank=r)) == res["digest"]


# ------------------------------------------------------------------------ delete


def test_delete_removes_a_step_from_every_tier(tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with tiercheck.Checkpointer(local=tmp_path / "local", remote=f"file://{remote}", keep_local=None) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": torch.full((8,), float(step))})
        ckpt.wait()
        ckpt.delete(2)
        assert ckpt.steps("local") == [1, 3] and ckpt.steps("remote") == [1, 3]
        assert not (tmp_path / "local" / naming.step_dir_name(2)).exists()
        assert not (remote / naming.step_dir_name(2)).exists()
        with pytest.raises(tiercheck.NoCheckpointError):
            ckpt.delete(2)
        with pytest.raises(tiercheck.NoCheckpointError):
            ckpt.delete(99)
        state = {"w": torch.zeros(8)}
        assert ckpt.restore(state) == 3 and state["w"].eq(3).all()


def test_delete_may_remove_the_newest_step_and_saving_goes_on(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(local=tmp_path, keep_local=2) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)})
        ckpt.save(2, {"w": torch.ones(4) * 2}).wait()
        ckpt.delete(2)
        assert ckpt.latest_step() == 1
        ckpt.save(3, {"w": torch.ones(4) * 3})
        ckpt.wait()
        assert ckpt.steps() == [1, 3]


def test_delete_refuses_a_step_in_flight(tmp_path: Path, write_gate: threading.Event, tier_faults: TierFaults) -> None:
    with tiercheck.Checkpointer(local=FaultyTier(LocalTier(tmp_path), tier_faults), keep_local=None) as ckpt:
        handle = ckpt.save(7, {"w": torch.ones(4)})
        with pytest.raises(tiercheck.StepInFlightError) as info:
            ckpt.delete(7)
        assert info.value.step == 7 and isinstance(info.value, RuntimeError)
        write_gate.set()
        handle.wait()
        ckpt.delete(7)
        assert ckpt.steps() == []


def test_delete_refuses_a_step_still_uploading(tmp_path: Path) -> None:
    faults = Faults()
    faults.slow(0.5, ops={"write"})
    ckpt = tiercheck.Checkpointer(local=tmp_path, remote="faultymem://del", storage_options={"faults": faults})
    try:
        handle = ckpt.save(1, {"w": torch.ones(4)})
        handle.wait("local")
        with pytest.raises(tiercheck.StepInFlightError):
            ckpt.delete(1)  # committed on tier 1, still uploading
        handle.wait()
        ckpt.delete(1)
        assert ckpt.steps() == []
    finally:
        faults.heal()
        ckpt.close()


# -------------------------------------------------------------- done callbacks


def test_done_callbacks_run_once_per_tier_on_a_background_thread(tmp_path: Path) -> None:
    calls: list[tuple[int, str, object, str]] = []
    lock = threading.Lock()

    def record(handle: tiercheck.SaveHandle, tier: str, error: object) -> None:
        with lock:
            calls.append((handle.step, tier, error, threading.current_thread().name))

    with tiercheck.Checkpointer(local=tmp_path / "l", remote=f"file://{tmp_path}/r", keep_local=None) as ckpt:
        h1 = ckpt.save(1, {"w": torch.ones(4)})
        h1.add_done_callback(record)
        h2 = ckpt.save(2, {"w": torch.ones(4)})
        h2.wait()
        h2.add_done_callback(record)  # already durable: still called, once per tier
        ckpt.wait()  # also waits for queued callbacks
        assert sorted(c[:3] for c in calls) == [(1, "local", None), (1, "remote", None),
                                                (2, "local", None), (2, "remote", None)]  # fmt: skip
        assert {c[3] for c in calls} == {"tiercheck-callbacks"}
        h1.add_done_callback(record)
        ckpt.wait()
        assert len(calls) == 6
    assert h1.exception() is None


def test_done_callback_gets_the_failure_of_a_tier(tmp_path: Path) -> None:
    faults = Faults()
    faults.fail(PermissionError, ops={"write"})
    seen: dict[str, object] = {}
    ckpt = tiercheck.Checkpointer(
        local=tmp_path, remote="faultymem://cb", storage_options={"faults": faults}, remote_retry_budget=0.5
    )
    try:
        h = ckpt.save(1, {"w": torch.ones(4)})
        h.add_done_callback(lambda handle, tier, error: seen.__setitem__(tier, error))
        with pytest.raises(tiercheck.TierError):
            ckpt.wait()
        assert seen["local"] is None
        assert isinstance(seen["remote"], tiercheck.TierError) and seen["remote"].step == 1
        assert h.exception("remote") is seen["remote"] and h.exception("local") is None
    finally:
        faults.heal()
        ckpt.close()


def test_a_slow_or_failing_callback_never_holds_the_writer(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()

    def slow(handle: tiercheck.SaveHandle, tier: str, error: object) -> None:
        release.wait(10)
        raise RuntimeError("a callback bug")

    with (
        caplog.at_level(logging.ERROR, logger="tiercheck"),
        tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt,
    ):
        ckpt.save(1, {"w": torch.ones(4)}).add_done_callback(slow)
        t0 = time.monotonic()
        for step in (2, 3):
            ckpt.save(step, {"w": torch.ones(4)}).wait()  # durable while the callback sleeps
        assert time.monotonic() - t0 < 5
        assert ckpt.steps() == [1, 2, 3]
        release.set()
        ckpt.wait()
    assert "a done callback raised" in caplog.text


def test_a_callback_may_wait_and_delete(tmp_path: Path) -> None:
    """A callback calling back into the Checkpointer (waiting, deleting) does not deadlock."""
    done = threading.Event()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}).wait()

        def on_done(handle: tiercheck.SaveHandle, tier: str, error: object) -> None:
            ckpt.wait()
            ckpt.delete(1)
            done.set()

        ckpt.save(2, {"w": torch.ones(4)}).add_done_callback(on_done)
        assert done.wait(10)
        ckpt.wait()
        assert ckpt.steps() == [2]


# ------------------------------------------------------------- KeepBest (pure)


def test_best_steps_ranks_by_the_metric() -> None:
    m = {1: {"loss": 0.5}, 2: {"loss": 0.2}, 3: {"loss": 0.9}, 4: {"acc": 0.7}, 5: {"loss": 0.2}}
    assert best_steps([1, 2, 3, 4, 5], m, 2, "loss", "min") == {2, 5}
    assert best_steps([1, 2, 3, 4, 5], m, 1, "loss", "min") == {5}  # a tie: the newer
    assert best_steps([1, 2, 3, 4, 5], m, 1, "loss", "max") == {3}
    assert best_steps([1, 2, 3], {1: {"x": math.nan}, 2: {"x": math.inf}, 3: {"x": 1}}, 2, "x", "max") == {2, 3}
    assert best_steps([1, 2, 3], {1: {"x": math.nan}, 2: {"x": math.inf}, 3: {"x": 1}}, 2, "x", "min") == {2, 3}
    assert best_steps([1, 2], {1: {"x": -(2**80)}, 2: {"x": 0.5}}, 1, "x", "min") == {1}


def test_keep_best_never_deletes_a_step_without_the_metric_alone() -> None:
    steps = [10, 20, 30, 40, 50]
    m = {10: {"val": 0.5}, 20: {}, 30: {"val": 0.1}, 40: {"val": 0.4}}  # 50 recorded nothing
    best = KeepBest(1, "val")
    assert best.select(steps, m) == {20, 30, 50}
    assert plan_deletions(steps, best, metrics=m) == [10, 40]
    # Combined, the other policy decides the unranked steps; the union keeps the rest.
    assert (best | KeepLast(1)).select(steps, m) == {30, 50}
    assert (best | KeepEvery(20)).select(steps, m) == {20, 30, 40}
    assert plan_deletions(steps, best | KeepEvery(20), metrics=m) == [10]  # the newest stays
    assert (KeepBest(2, "val", mode="max") | KeepLast(1)).select(steps, m) == {10, 40, 50}
    assert (best | KeepAll()).select(steps, m) == set(steps)
    # Without metrics nothing is ranked: KeepBest keeps everything.
    assert best.select(steps, {}) == set(steps) and best.keep(steps) == set(steps)
    assert (best | KeepLast(2)).metric_names == {"val"} and KeepLast(2).metric_names == frozenset()


@pytest.mark.parametrize("args", [(0, "x"), (1.0, "x"), (True, "x"), (1, ""), (1, 3), (1, "x", "mean")])
def test_keep_best_rejects_bad_arguments(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        KeepBest(*args)


# ----------------------------------------------- metrics with a step, KeepBest per tier


def test_metrics_are_stored_with_the_step_and_read_without_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiercheck.__main__ import main as cli

    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(1, {"w": torch.ones(4)}, metrics={"val_loss": torch.tensor(0.25), "epoch": 0})
        ckpt.save(2, {"w": torch.ones(4)}, metrics={"val_loss": math.nan, "acc": -0.0, "n": 2**70})
        ckpt.save(3, {"w": torch.ones(4)})
        ckpt.wait()
        assert ckpt.metrics(1) == {"val_loss": 0.25, "epoch": 0}
        m2 = ckpt.metrics(2)
        assert math.isnan(m2["val_loss"]) and math.copysign(1, m2["acc"]) == -1 and m2["n"] == 2**70
        assert ckpt.metrics(3) == {}
    for step in (1, 2, 3):
        (tmp_path / naming.step_dir_name(step) / naming.shard_name(0, 1)).unlink()
    capsys.readouterr()
    assert cli(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("\tval_loss=0.25 epoch=0")
    assert lines[1].endswith(f"\tval_loss=nan acc=-0.0 n={2**70}")
    assert lines[2].endswith(naming.step_dir_name(3))


@pytest.mark.parametrize(
    "metrics",
    [{"ok": True}, {"ok": "0.3"}, {"ok": None}, {"ok": [1.0]}, {"ok": torch.ones(2)}, {"ok": torch.tensor(1 + 1j)},
     {3: 0.5}, {"": 0.5}, {"x" * 257: 0.5}, {"ok": torch.tensor(True)}, {"ok": np.array(["a"])}, [("a", 1.0)]],
)  # fmt: skip
def test_bad_metrics_are_refused_at_save(tmp_path: Path, metrics: Any) -> None:
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        with pytest.raises(tiercheck.UnsupportedStateError) as info:
            ckpt.save(1, {"w": torch.ones(2)}, metrics=metrics)
        if isinstance(metrics, dict):
            assert repr(next(iter(metrics)))[:20] in str(info.value)
        assert ckpt.steps() == []
        ckpt.save(1, {"w": torch.ones(2)}, metrics={"ok": np.float16(0.5)}).wait()
        assert ckpt.metrics(1) == {"ok": 0.5}


def test_keep_best_retention_per_tier(tmp_path: Path) -> None:
    losses = {1: 0.9, 2: 0.3, 3: 0.7, 4: None, 5: 0.2, 6: 0.8, 7: None, 8: 0.5}
    remote = tmp_path / "remote"
    with tiercheck.Checkpointer(
        local=tmp_path / "local",
        remote=f"file://{remote}",
        keep_local=KeepBest(2, "val_loss") | KeepLast(1),
        keep_remote=KeepBest(3, "val_loss"),
        upload_backlog="all",
    ) as ckpt:
        for step, loss in losses.items():
            metrics = None if loss is None else {"val_loss": loss, "step": step}
            ckpt.save(step, {"w": torch.full((4,), float(step))}, metrics=metrics)
            ckpt.wait()
        # Tier 1: the two best (5, 2) and the newest; KeepLast decides the unranked 4 and 7.
        assert ckpt.steps("local") == [2, 5, 8]
        # Tier 2, KeepBest alone: the three best (5, 2, 8), and every step without the metric.
        assert ckpt.steps("remote") == [2, 4, 5, 7, 8]
    # A new session ranks the steps of the old one by the metrics in their markers.
    with tiercheck.Checkpointer(local=tmp_path / "local", keep_local=KeepBest(1, "val_loss", mode="max")) as ckpt:
        ckpt.save(9, {"w": torch.zeros(4)}, metrics={"val_loss": 0.1})
        ckpt.wait()
        assert ckpt.steps("local") == [8, 9]  # 8 is the best by "max"; 9 the newest
