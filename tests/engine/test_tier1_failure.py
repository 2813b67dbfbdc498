"""When tier 1 fails (disk full), the step still reaches tier 2 from host memory, and a
free-space check refuses a step that cannot fit before writing anything."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.testing import FaultyTier
from tiercheck.tiers.local import LocalTier


def test_a_step_that_fails_on_tier1_is_uploaded_from_host_memory(tmp_path: Path) -> None:
    local = FaultyTier(LocalTier(tmp_path))
    full_disk = OSError(errno.ENOSPC, "No space left on device (injected)")
    local.faults.fail("write_file", lambda call: OSError(*full_disk.args, call.path), steps={2})
    remote = f"memory://t1fail-{uuid.uuid4().hex}"
    with tiercheck.Checkpointer(local=local, remote=remote, keep_local=None) as ckpt:
        ckpt.save(1, {"x": torch.full((64,), 1.0)}).wait()
        h = ckpt.save(2, {"x": torch.full((64,), 2.0)})
        with pytest.raises(tiercheck.TierError) as info:
            h.wait("local")
        assert info.value.tier == "local" and info.value.step == 2
        h.wait("remote")  # durable off the node all the same
        assert ckpt.steps("local") == [1]
        assert ckpt.steps("remote") == [1, 2]
        ckpt.save(3, {"x": torch.full((64,), 3.0)}).wait()
        assert ckpt.steps("local") == [1, 3]
    assert torch.equal(tiercheck.load(remote, step=2)["x"], torch.full((64,), 2.0))
    assert not [n for n in os.listdir(tmp_path) if naming.is_leftover(n)]


def test_free_space_check_names_the_shortfall(tmp_path: Path, monkeypatch) -> None:
    real = os.statvfs(tmp_path)

    class Tiny:
        f_bavail = 10
        f_frsize = real.f_frsize

    monkeypatch.setattr("tiercheck.tiers.local.os.statvfs", lambda p: Tiny)
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:
        h = ckpt.save(1, {"x": torch.zeros(1 << 20)})
        with pytest.raises(tiercheck.TierError) as info:
            h.wait()
    cause = info.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert "short by" in str(info.value) and "step 1" in str(info.value)
    # nothing was written but the writer lock (and the run log)
    assert [n for n in os.listdir(tmp_path) if n != naming.RUNLOG_DIR] == [naming.lock_name(0)]


def test_a_failed_copy_raises_in_save_and_later_saves_work(tmp_path: Path, monkeypatch) -> None:
    from tiercheck.steps import stage as staging

    original = staging.stage_into
    calls = {"n": 0}

    def flaky(buf, flat, plan, deferred=None, progress=None):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device copy failed (injected)")
        original(buf, flat, plan, deferred, progress)

    monkeypatch.setattr("tiercheck.engine.stager.stage_into", flaky)
    remote = f"memory://copyfail-{uuid.uuid4().hex}"
    with tiercheck.Checkpointer(local=tmp_path, remote=remote, keep_local=None) as ckpt:
        ckpt.save(1, {"x": torch.full((4096,), 1.0)}).wait()
        with pytest.raises(RuntimeError, match="injected"):
            ckpt.save(2, {"x": torch.full((4096,), 2.0)})
        ckpt.wait()  # nothing about step 2 is raised again, nothing hangs
        for step in (3, 4):
            ckpt.save(step, {"x": torch.full((4096,), float(step))}).wait()
        assert ckpt.steps("local") == [1, 3, 4]
        assert ckpt.steps("remote") == [1, 3, 4]
        assert ckpt._pool.allocations == 1
    assert torch.equal(tiercheck.load(tmp_path, step=4)["x"], torch.full((4096,), 4.0))
