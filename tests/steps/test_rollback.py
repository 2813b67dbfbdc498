"""Steps must increase, except right after a restore: then the abandoned branch goes."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import tiercheck


def state_for(step: int, tag: float = 0.0) -> dict[str, Any]:
    return {"x": torch.full((16,), step + tag), "step": step, "tag": tag}


def template() -> dict[str, Any]:
    return {"x": torch.zeros(16), "step": None, "tag": None}


def saved(ckpt: tiercheck.Checkpointer, steps) -> None:
    for s in steps:
        ckpt.save(s, state_for(s))
    ckpt.wait()


@pytest.mark.parametrize("step", [3, 2, 0])
def test_saving_a_committed_or_older_step_without_restore_raises(make_ckpt, ckpt_dir, dir_snapshot, step):
    first = make_ckpt()
    saved(first, [1, 2, 3])
    first.close()  # one writer at a time (an unclosed one would hold the directory's lock)
    before = dir_snapshot(ckpt_dir)
    fresh = make_ckpt()  # knows nothing but what is on disk

    with pytest.raises(tiercheck.StepConflictError) as ei:
        fresh.save(step, state_for(step, tag=0.5))

    assert isinstance(ei.value, FileExistsError)
    assert isinstance(ei.value, tiercheck.TiercheckError)
    fresh.wait()
    assert dir_snapshot(ckpt_dir) == before
    assert fresh.steps() == [1, 2, 3]


def test_same_checkpointer_rejects_repeating_a_step(make_ckpt, ckpt_dir, dir_snapshot):
    ckpt = make_ckpt()
    saved(ckpt, [5])
    before = dir_snapshot(ckpt_dir)
    with pytest.raises(tiercheck.StepConflictError):
        ckpt.save(5, state_for(5, tag=0.5))
    with pytest.raises(tiercheck.StepConflictError):
        ckpt.save(4, state_for(4))
    ckpt.wait()
    assert dir_snapshot(ckpt_dir) == before
    saved(ckpt, [6])
    assert ckpt.steps() == [5, 6]


def test_saving_after_restore_of_an_older_step_starts_a_new_branch(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    saved(ckpt, [1, 2, 3, 4])
    state = template()
    assert ckpt.restore(state, step=2) == 2
    assert state["step"] == 2

    with pytest.warns(RuntimeWarning, match="branch"):
        ckpt.save(3, state_for(3, tag=0.25))
    # the abandoned steps are gone before the new step is written
    assert 4 not in ckpt.steps()
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3]
    saved(ckpt, [4])
    assert ckpt.steps() == [1, 2, 3, 4]
    ckpt.close()

    fresh = make_ckpt()
    got = template()
    assert fresh.restore(got) == 4
    assert got["tag"] == 0.0  # the new step 4, saved after the new step 3
    assert fresh.restore(got, step=3) == 3
    assert got["tag"] == 0.25
    assert torch.equal(got["x"], torch.full((16,), 3.25))


def test_new_branch_from_the_oldest_step_never_restores_a_stale_step(make_ckpt):
    ckpt = make_ckpt()
    saved(ckpt, [10, 20, 30])
    assert ckpt.restore(template(), step=10) == 10
    with pytest.warns(RuntimeWarning):
        ckpt.save(11, state_for(11, tag=0.5))
    ckpt.close()

    fresh = make_ckpt()
    assert fresh.steps() == [10, 11]
    got = template()
    assert fresh.restore(got) == 11
    assert got["tag"] == 0.5


def test_saving_after_restoring_the_newest_step_does_not_warn(make_ckpt):
    ckpt = make_ckpt()
    saved(ckpt, [1, 2])
    assert ckpt.restore(template()) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(3, state_for(3)).wait()
    assert ckpt.steps() == [1, 2, 3]


def test_restore_then_saving_the_restored_step_raises(make_ckpt, ckpt_dir, dir_snapshot):
    ckpt = make_ckpt()
    saved(ckpt, [1, 2, 3])
    ckpt.restore(template(), step=2)
    before = dir_snapshot(ckpt_dir)
    with pytest.raises(tiercheck.StepConflictError):
        ckpt.save(2, state_for(2, tag=0.5))
    with pytest.raises(tiercheck.StepConflictError):
        ckpt.save(1, state_for(1, tag=0.5))
    assert dir_snapshot(ckpt_dir) == before


def test_saving_a_step_not_newer_than_an_in_flight_step_raises(make_ckpt, write_gate):
    ckpt = make_ckpt()
    handle = ckpt.save(5, state_for(5))
    assert not handle.done()
    with pytest.raises(tiercheck.StepConflictError):
        ckpt.save(5, state_for(5, tag=0.5))
    with pytest.raises(tiercheck.StepConflictError):
        ckpt.save(3, state_for(3))
    write_gate.set()
    handle.wait()
    assert ckpt.steps() == [5]
    got = template()
    ckpt.restore(got)
    assert got["tag"] == 0.0


def test_only_the_first_save_after_restore_may_go_back(make_ckpt):
    ckpt = make_ckpt()
    saved(ckpt, [1, 2, 3, 4])
    ckpt.restore(template(), step=2)
    with pytest.warns(RuntimeWarning):
        ckpt.save(3, state_for(3, tag=0.5))
    ckpt.save(4, state_for(4, tag=0.5))
    ckpt.wait()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(tiercheck.StepConflictError):
            ckpt.save(3, state_for(3, tag=0.75))
    ckpt.wait()
    assert ckpt.steps() == [1, 2, 3, 4]
