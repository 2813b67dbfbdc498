"""Retention: pure policies and deletion plans, then what a Checkpointer leaves on disk."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck import KeepEvery, KeepLast
from tiercheck.format import naming
from tiercheck.plan.retention import KeepAll, as_policy, plan_deletions
from tiercheck.tiers.local import LocalTier

# ----------------------------------------------------------------------------- pure


def test_keep_last_keeps_the_n_newest():
    assert KeepLast(2).keep([10, 20, 30]) == frozenset({20, 30})
    assert KeepLast(1).keep([10, 20, 30]) == frozenset({30})
    assert KeepLast(5).keep([10, 20, 30]) == frozenset({10, 20, 30})
    assert KeepLast(3).keep([]) == frozenset()


def test_keep_every_keeps_multiples():
    assert KeepEvery(4).keep(list(range(1, 10))) == frozenset({4, 8})
    assert KeepEvery(1000).keep([0, 500, 1000, 1500]) == frozenset({0, 1000})
    assert KeepEvery(1).keep([3, 7]) == frozenset({3, 7})


def test_policies_combine_with_or():
    policy = KeepLast(1) | KeepEvery(4)
    assert policy.keep(list(range(1, 10))) == frozenset({4, 8, 9})
    three = KeepLast(2) | KeepEvery(5) | KeepEvery(7)
    assert three.keep(list(range(1, 16))) == frozenset({5, 7, 10, 14, 15})
    with pytest.raises(TypeError):
        KeepLast(1) | 3


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "2", None])
def test_policies_reject_bad_arguments(bad):
    with pytest.raises(ValueError):
        KeepLast(bad)
    with pytest.raises(ValueError):
        KeepEvery(bad)


def test_as_policy_accepts_the_option_forms():
    assert as_policy(None, "keep_local") == KeepAll()
    assert as_policy(3, "keep_local") == KeepLast(3)
    policy = KeepLast(1) | KeepEvery(10)
    assert as_policy(policy, "keep_local") is policy
    for bad in (True, 2.5, "3"):
        with pytest.raises(TypeError):
            as_policy(bad, "keep_local")


def test_plan_deletions_follows_the_policy():
    assert plan_deletions([1, 2, 3, 4], KeepLast(2)) == [1, 2]
    assert plan_deletions([4, 1, 3, 2, 3], KeepLast(2)) == [1, 2]  # unsorted, duplicate
    assert plan_deletions([1, 2, 3], KeepAll()) == []
    assert plan_deletions([], KeepLast(1)) == []


def test_plan_deletions_never_deletes_the_newest_step():
    assert plan_deletions([1, 2, 3], KeepEvery(100)) == [1, 2]
    assert plan_deletions([7], KeepEvery(100)) == []
    assert plan_deletions([0, 5, 7], KeepEvery(5)) == []
    assert plan_deletions([100, 150], KeepEvery(100)) == []


def test_plan_deletions_never_deletes_in_flight_or_not_yet_uploaded_steps():
    assert plan_deletions([1, 2, 3, 4], KeepLast(1), in_flight=[2]) == [1, 3]
    assert plan_deletions([1, 2, 3, 4], KeepLast(1), not_yet_on_next_tier=[1, 3]) == [2]
    assert plan_deletions([1, 2, 3], KeepLast(1), in_flight=[1, 2], not_yet_on_next_tier=[3]) == []


# ----------------------------------------------------------------------------- integration


def step_dirs(root) -> list[str]:
    """Everything in `root` but the library's own bookkeeping (the writer lock, a run log):
    steps, users' files, and any leftover temp or trash directory."""
    return sorted(n for n in os.listdir(root) if not n.startswith(".tiercheck-") or naming.is_leftover(n))


def save_steps(ckpt: tiercheck.Checkpointer, steps) -> None:
    for s in steps:
        ckpt.save(s, {"x": torch.full((8,), float(s)), "step": s})
    ckpt.wait()


def saved_and_closed(ckpt: tiercheck.Checkpointer, steps) -> None:
    """close() joins the writer, so retention of the last step has run whatever wait() does
    (test_wait_returns_only_after_retention_ran checks wait() itself)."""
    save_steps(ckpt, steps)
    ckpt.close()


def test_keep_local_2_leaves_the_last_two_steps(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(keep_local=2)
    saved_and_closed(ckpt, range(1, 7))
    assert step_dirs(ckpt_dir) == [naming.step_dir_name(5), naming.step_dir_name(6)]
    assert make_ckpt().steps() == [5, 6]
    assert tiercheck.load(ckpt_dir, step=5)["step"] == 5
    assert tiercheck.load(ckpt_dir)["step"] == 6


def test_wait_returns_only_after_retention_ran(make_ckpt, ckpt_dir, tier_faults):
    tier_faults.delay("delete_step", 0.3)  # widens the window between durable and pruned
    ckpt = make_ckpt(keep_local=1)
    save_steps(ckpt, [1, 2])  # ends with wait()
    # The pruned step is gone: only its bytes may still be freed in the background (a trash
    # directory, never a step directory), and close() waits for that.
    assert [d for d in step_dirs(ckpt_dir) if not naming.is_leftover(d)] == [naming.step_dir_name(2)]
    assert ckpt.steps() == [2]
    ckpt.close()
    assert step_dirs(ckpt_dir) == [naming.step_dir_name(2)]


def test_wait_does_not_wait_for_the_bytes_of_a_pruned_step_to_be_freed(make_ckpt, ckpt_dir, tier_faults):
    # Freeing a deleted multi-GB shard takes seconds on ext4 (docs/performance.md): a step is
    # durable, and wait() returns, while the reclaimer thread frees the older step's bytes.
    release = threading.Event()
    tier_faults.block("reclaim", release)
    ckpt = make_ckpt(keep_local=1)
    try:
        t0 = time.monotonic()
        save_steps(ckpt, [1, 2, 3])  # ends with wait(); steps 1 and 2 pruned, their reclaim blocked
        assert time.monotonic() - t0 < 5.0
        assert ckpt.steps() == [3]
        leftovers = [d for d in step_dirs(ckpt_dir) if naming.is_leftover(d)]
        assert leftovers and all(".tiercheck-trash-" in d for d in leftovers)
        assert tiercheck.load(ckpt_dir)["step"] == 3  # trash is never read
    finally:
        release.set()
        ckpt.close()
    assert step_dirs(ckpt_dir) == [naming.step_dir_name(3)]


def test_keep_local_none_keeps_every_step(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(keep_local=None)
    saved_and_closed(ckpt, range(1, 7))
    assert step_dirs(ckpt_dir) == [naming.step_dir_name(s) for s in range(1, 7)]
    assert make_ckpt().steps() == list(range(1, 7))


def test_keep_last_or_keep_every(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(keep_local=KeepLast(1) | KeepEvery(4))
    saved_and_closed(ckpt, range(1, 10))
    assert step_dirs(ckpt_dir) == [naming.step_dir_name(s) for s in (4, 8, 9)]
    assert make_ckpt().steps() == [4, 8, 9]


def test_default_retention_keeps_two(ckpt_dir):
    ckpt = tiercheck.Checkpointer(local=ckpt_dir)
    try:
        save_steps(ckpt, range(5))
    finally:
        ckpt.close()
    assert step_dirs(ckpt_dir) == [naming.step_dir_name(3), naming.step_dir_name(4)]


def test_retention_leaves_user_files_alone(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(keep_local=1)
    save_steps(ckpt, [1])
    (ckpt_dir / "notes.txt").write_text("mine")
    (ckpt_dir / "step-000000000001-copy").mkdir()
    saved_and_closed(ckpt, [2, 3])
    assert step_dirs(ckpt_dir) == sorted(["notes.txt", "step-000000000001-copy", naming.step_dir_name(3)])


def test_deletion_hides_the_step_before_removing_data(make_ckpt, ckpt_dir, monkeypatch):
    ckpt = make_ckpt(keep_local=None)
    saved_and_closed(ckpt, [1, 2, 3])
    step2 = ckpt_dir / naming.step_dir_name(2)
    tier = LocalTier(ckpt_dir)
    # "Crash" after the rename that hides the step, before any data is removed.
    monkeypatch.setattr("tiercheck.tiers.owned.shutil.rmtree", lambda *a, **k: None)
    tier.delete_step(2)
    monkeypatch.undo()

    assert not step2.exists()
    trash = [p for p in ckpt_dir.iterdir() if naming.is_leftover(p.name)]
    assert len(trash) == 1 and (trash[0] / naming.shard_name(0, 1)).exists()  # data still there
    assert tier.committed_steps() == [1, 3]

    fresh = make_ckpt(keep_local=None)
    assert fresh.steps() == [1, 3]
    with pytest.raises(tiercheck.NoCheckpointError):
        fresh.restore({"x": torch.zeros(8)}, step=2)
    with pytest.raises(tiercheck.NoCheckpointError):
        tiercheck.load(ckpt_dir, step=2)
    state = {"x": torch.zeros(8), "step": None}
    assert fresh.restore(state) == 3
    assert torch.equal(state["x"], torch.full((8,), 3.0))
    assert trash[0].exists()  # reading never modifies the directory
    save_steps(fresh, [4])  # the first save makes it the writer: it removes the trash
    assert not trash[0].exists()
    assert fresh.steps() == [1, 3, 4]
    assert tiercheck.load(ckpt_dir)["step"] == 4


def test_a_marker_less_step_dir_does_not_block_saving_that_step(make_ckpt, ckpt_dir):
    # E.g. left by an older release's marker-first deletion, or a COMMIT removed by hand.
    ckpt = make_ckpt(keep_local=None)
    saved_and_closed(ckpt, [1, 2, 3])
    (ckpt_dir / naming.step_dir_name(3) / naming.COMMIT_NAME).unlink()

    fresh = make_ckpt(keep_local=None)
    state = {"x": torch.zeros(8), "step": None}
    assert fresh.restore(state) == 2
    fresh.save(3, {"x": torch.full((8,), 33.0), "step": 33}).wait()
    assert fresh.steps() == [1, 2, 3]
    assert tiercheck.load(ckpt_dir)["step"] == 33


def test_keep_all_tier_still_sweeps_leftovers_once_per_session(tmp_path: Path) -> None:
    # An upload cut by a crash left objects without a marker; keep_remote=None deletes no
    # step, but the leftovers of an older, never-committed step are removed after the next commit.
    remote = tmp_path / "bucket"
    stray = remote / "step-000000000003"
    stray.mkdir(parents=True)
    (stray / "rank-00000-of-00001.shard").write_bytes(b"x" * 4096)
    with tiercheck.Checkpointer(remote=f"file://{remote}", keep_remote=None) as ck:
        for step in (5, 6):
            ck.save(step, {"w": torch.ones(4)}).wait()
        assert ck.steps("remote") == [5, 6]
    assert not (stray / "rank-00000-of-00001.shard").exists()
