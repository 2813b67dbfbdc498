"""The abandoned branch after a rollback is deleted by the pruner, like every deletion: a
catch-up upload of an abandoned step ends before the step goes (it would otherwise lose
its files mid-copy, or commit the step on tier 2 after the branch deletion ran there), and
a tier that fails the deletion raises one TierError naming step, tier and path."""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.format.naming import step_dir_name
from tiercheck.testing import Faults, FaultyTier
from tiercheck.tiers.open import open_tier


def state_for(step: int, tag: float = 0.0) -> dict[str, Any]:
    return {"w": torch.full((8,), step + tag), "tag": tag}


def template() -> dict[str, Any]:
    return {"w": torch.zeros(8), "tag": None}


def test_a_branch_waits_for_the_catch_up_upload_of_an_abandoned_step_then_deletes_it_on_both_tiers(
    tmp_path: Path,
) -> None:
    local, remote_url = tmp_path / "ckpt", f"file://{tmp_path}/remote"
    with tiercheck.Checkpointer(local=local, keep_local=None) as earlier:  # no tier 2 then
        for step in (5, 10):
            earlier.save(step, state_for(step))
    faults, gate, uploading = Faults(), threading.Event(), threading.Event()
    faults.block("open_step", gate, timeout=120, steps={10}, when=lambda call: not uploading.set())
    remote = FaultyTier(open_tier(remote_url, role="remote"), faults)
    ckpt = tiercheck.Checkpointer(local=local, remote=remote, keep_local=None)
    failures: list[BaseException] = []

    def save_new_branch() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # "starts a new branch"
                ckpt.save(6, state_for(6, tag=0.5))
        except BaseException as exc:
            failures.append(exc)

    try:
        state = template()
        assert ckpt.restore(state, step=5) == 5
        ckpt.prepare(state)  # queues the catch-up upload of 5 and 10 (an earlier run's steps)
        assert uploading.wait(120)  # the upload of abandoned step 10 is under way
        saver = threading.Thread(target=save_new_branch)
        saver.start()
        deadline = time.monotonic() + 120
        # The branch deletion waits for that upload (step 10 is being deleted meanwhile, so no
        # other upload of it starts); before, it deleted 10 under the upload at once.
        while saver.is_alive() and 10 not in ckpt._pipeline._pruner.deleting and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        saver.join(120)
        assert not saver.is_alive() and not failures
        ckpt.wait()  # the catch-up upload neither failed nor left anything to report
        assert ckpt.steps("local") == [5, 6]
        assert ckpt.steps("remote") == [5, 6]  # 10 did not come back on tier 2
    finally:
        gate.set()
        ckpt.close()
    got = template()
    assert tiercheck.Checkpointer(remote=remote_url).restore(got) == 6
    assert torch.equal(got["w"], torch.full((8,), 6.5)) and got["tag"] == 0.5


def test_a_failing_deletion_of_an_abandoned_step_raises_one_tier_error_and_the_save_can_be_retried(
    make_ckpt: Any, ckpt_dir: Path, tier_faults: Faults
) -> None:
    ckpt = make_ckpt()
    for s in (1, 2, 3, 4):
        ckpt.save(s, state_for(s))
    ckpt.wait()
    assert ckpt.restore(template(), step=2) == 2
    tier_faults.fail("delete_step", OSError(errno.EIO, "the disk says no"), steps={4}, times=1)

    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.save(3, state_for(3, tag=0.25))

    assert (ei.value.step, ei.value.tier) == (4, "local")
    assert ei.value.path == os.path.join(str(ckpt_dir), step_dir_name(4))
    assert "the disk says no" in str(ei.value) and isinstance(ei.value.__cause__, OSError)
    # newest first: 4 failed, so 3 stays too and nothing of the new branch was written
    assert ckpt.steps() == [1, 2, 3, 4]
    ckpt.wait()  # raised once: nothing left to report in the background
    with pytest.warns(RuntimeWarning, match="branch"):
        ckpt.save(3, state_for(3, tag=0.25))  # still the branch after step 2
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3]
    got = template()
    assert ckpt.restore(got) == 3
    assert torch.equal(got["w"], torch.full((8,), 3.25))
