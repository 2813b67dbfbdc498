"""`Checkpointer.delete` of a step the start-up catch-up upload is copying (an earlier run's
step, which no handle tracks): deleted from every tier when that upload ends."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import tiercheck
from tiercheck.testing import Faults, FaultyTier
from tiercheck.tiers.open import open_tier


def test_deleting_a_step_its_catch_up_upload_is_copying_deletes_it_when_the_upload_ends(tmp_path: Path) -> None:
    local, remote_url = tmp_path / "ckpt", f"file://{tmp_path}/remote"
    with tiercheck.Checkpointer(local=local, keep_local=None) as earlier:  # no tier 2 then
        for step in (5, 10):
            earlier.save(step, {"w": torch.full((4,), float(step))})
    faults, gate, uploading = Faults(), threading.Event(), threading.Event()
    faults.block("open_step", gate, timeout=120, steps={5}, when=lambda call: not uploading.set())
    remote = FaultyTier(open_tier(remote_url, role="remote"), faults)
    ckpt = tiercheck.Checkpointer(local=local, remote=remote, keep_local=None)
    try:
        ckpt.save(15, {"w": torch.full((4,), 15.0)})  # queues the catch-up upload of 5 and 10 first
        assert uploading.wait(120)
        ckpt.delete(5)  # was StepInFlightError, and nothing the caller could wait for
        gate.set()
        ckpt.wait()
        assert ckpt.steps("local") == [10, 15] and ckpt.steps("remote") == [10, 15]
    finally:
        gate.set()
        ckpt.close()
    state = {"w": torch.zeros(4)}
    assert tiercheck.Checkpointer(remote=remote_url).restore(state, step=10) == 10 and state["w"].eq(10).all()
