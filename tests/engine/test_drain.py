"""Preemption: drain() and the opt-in SIGTERM handler make the newest snapshot durable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.testing import FaultyTier
from tiercheck.tiers.local import LocalTier


def test_drain_reports_what_is_durable_where(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(local=tmp_path / "l", remote=f"file://{tmp_path}/r") as ckpt:
        ckpt.save(1, {"x": torch.ones(1000)})
        ckpt.save(2, {"x": torch.full((1000,), 2.0)})
        report = ckpt.drain(timeout=30)
        assert report.durable == {"local": 2, "remote": 2}
        assert report.pending == {"local": [], "remote": []}
        assert report.errors == ()
        assert ckpt.steps("remote")[-1] == 2


def test_drain_returns_at_the_deadline_and_reports_pending(tmp_path: Path, write_gate, tier_faults) -> None:
    with tiercheck.Checkpointer(local=FaultyTier(LocalTier(tmp_path), tier_faults)) as ckpt:
        ckpt.save(1, {"x": torch.ones(10)})  # the gate holds the write
        t0 = time.monotonic()
        report = ckpt.drain(timeout=0.3)
        assert time.monotonic() - t0 < 5
        assert report.pending == {"local": [1]}
        assert report.durable == {"local": None}
        write_gate.set()
        ckpt.wait()
        assert ckpt.steps() == [1]


def test_sigterm_handler_drains_before_the_process_exits(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time, torch, tiercheck
        from tiercheck.tiers import local
        slow = local.LocalTier._write_all
        def write_all(self, fd, data, *args):  # a slow disk: SIGTERM lands while step 3 is written
            time.sleep(1.0)
            slow(self, fd, data, *args)
        local.LocalTier._write_all = write_all
        ckpt = tiercheck.Checkpointer(local={str(tmp_path)!r}, keep_local=None)
        ckpt.install_sigterm_handler(grace_s=30)
        ckpt.save(3, {{"x": torch.full((100,), 3.0)}})
        print("saved", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "saved"
    os.kill(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=60)
    assert rc == -signal.SIGTERM  # the default action still happens, after the drain
    assert tiercheck.load(tmp_path)["x"].eq(3.0).all()


CLOSE_CHILD = """
import sys, threading, time, torch, tiercheck
from tiercheck.testing import Faults, FaultyTier
from tiercheck.tiers.local import LocalTier

root, fresh, grace, hold = sys.argv[1], sys.argv[2] == "1", float(sys.argv[3]), sys.argv[4] == "hold"
faults, gate = Faults(), threading.Event()
faults.block("commit", gate, timeout=120)  # step 3 stays in flight until the test says
ckpt = tiercheck.Checkpointer(local=FaultyTier(LocalTier(root), faults), keep_local=None)
ckpt.install_sigterm_handler(grace_s=grace, fresh=fresh)
ckpt.save(3, {"x": torch.full((100,), 3.0)})
main = threading.main_thread()

def in_close() -> bool:
    frame = sys._current_frames().get(main.ident)
    while frame is not None:
        if frame.f_code.co_name == "close" and frame.f_code.co_filename.endswith("checkpointer.py"):
            return True
        frame = frame.f_back
    return False

def report() -> None:
    deadline = time.monotonic() + 120
    while not in_close() and time.monotonic() < deadline:
        time.sleep(0.01)
    print("in close", flush=True)
    sys.stdin.readline()  # the test has sent SIGTERM
    if not hold:
        gate.set()

threading.Thread(target=report, daemon=True).start()
ckpt.close()
print("close returned", flush=True)
"""


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "drain"])
def test_sigterm_during_close_is_delivered_once_close_drained(tmp_path: Path, fresh: bool) -> None:
    """SIGTERM while close() drains a step: close finishes the drain, the step is durable,
    then the signal does what it did before the handler (terminate); the script does not
    run on past close()."""
    proc = close_child(tmp_path, fresh, 120, hold=False)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "in close"
        assert not (tmp_path / "step-000000000003" / "COMMIT").exists()
        os.kill(proc.pid, signal.SIGTERM)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        rest = proc.stdout.read()
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert "close returned" not in rest
    assert rc == -signal.SIGTERM
    assert tiercheck.load(tmp_path)["x"].eq(3.0).all()  # drained before the signal went on


def test_sigterm_during_close_is_delivered_when_the_grace_period_ends(tmp_path: Path) -> None:
    """A step that cannot become durable within the grace period: close() stops waiting
    when it ends and the signal terminates the process (the step is never visible)."""
    proc = close_child(tmp_path, True, 1.0, hold=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "in close"
        os.kill(proc.pid, signal.SIGTERM)
        t0 = time.monotonic()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        rest = proc.stdout.read()
        rc = proc.wait(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
    assert "close returned" not in rest
    assert rc == -signal.SIGTERM
    assert elapsed < 60  # the commit gate holds for 120 s: close did not wait for it
    assert list(tmp_path.glob("step-*/COMMIT")) == []


def close_child(tmp_path: Path, fresh: bool, grace: float, *, hold: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CLOSE_CHILD, str(tmp_path), "1" if fresh else "0", str(grace), "hold" if hold else "go"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
