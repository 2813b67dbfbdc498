"""Preemption: drain() and the opt-in SIGTERM handler make the newest snapshot durable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

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
