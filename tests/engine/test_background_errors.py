"""A failing background write surfaces once, as a TierError, and training goes on."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.testing import Faults


def small(step: int) -> dict[str, Any]:
    return {"x": torch.full((1024,), float(step)), "step": step}


def assert_restores(ckpt: tiercheck.Checkpointer, step: int) -> None:
    got: dict[str, Any] = {"x": torch.zeros(1024), "step": None}
    assert ckpt.restore(got) == step
    assert got["step"] == step
    assert torch.equal(got["x"], torch.full((1024,), float(step)))


def no_temp_dirs(root: Path) -> bool:
    return not [n for n in os.listdir(root) if n.startswith(naming.TMP_PREFIX)]


@pytest.fixture
def fail_step(tier_faults: Faults) -> set[int]:
    """Steps in the returned set fail their shard write with ENOSPC (fault injection)."""
    failing: set[int] = set()
    tier_faults.fail(
        "write_file",
        lambda call: OSError(errno.ENOSPC, "No space left on device (injected)", call.path),
        when=lambda call: call.step in failing,
    )
    return failing


def wait_done(handle: tiercheck.SaveHandle) -> None:
    deadline = time.monotonic() + 20
    while not handle.done():  # done() observes without consuming the error
        assert time.monotonic() < deadline
        time.sleep(0.005)


def assert_tier_error(err: BaseException, step: int) -> None:
    assert isinstance(err, tiercheck.TierError)
    assert isinstance(err, tiercheck.TiercheckError)
    assert isinstance(err, OSError)
    assert err.step == step
    assert err.tier == "local"
    assert isinstance(err.path, str) and err.path
    assert f"step {step}" in str(err)
    cause = err.__cause__
    assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC


def test_handle_wait_raises_it_and_it_is_not_raised_again(make_ckpt, ckpt_dir, fail_step):
    ckpt = make_ckpt()
    ckpt.save(1, small(1)).wait()
    fail_step.add(2)
    handle = ckpt.save(2, small(2))

    with pytest.raises(tiercheck.TierError) as ei:
        handle.wait()
    assert_tier_error(ei.value, 2)
    assert str(ckpt_dir) in ei.value.path

    ckpt.wait()  # already seen through the handle: not raised again
    assert ckpt.steps() == [1]
    assert no_temp_dirs(ckpt_dir)
    assert_restores(ckpt, 1)
    fail_step.clear()
    ckpt.save(3, small(3)).wait()
    assert ckpt.steps() == [1, 3]
    ckpt.close()  # nothing left to raise


def test_error_is_raised_once_at_the_next_save(make_ckpt, ckpt_dir, fail_step):
    ckpt = make_ckpt()
    ckpt.save(1, small(1)).wait()
    fail_step.add(2)
    wait_done(ckpt.save(2, small(2)))
    fail_step.clear()

    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.save(3, small(3))
    assert_tier_error(ei.value, 2)
    assert ckpt.steps() == [1]  # the save that raised wrote nothing

    ckpt.save(3, small(3)).wait()  # training goes on
    ckpt.wait()
    assert ckpt.steps() == [1, 3]
    assert_restores(ckpt, 3)


def test_error_is_raised_once_at_the_next_wait(make_ckpt, fail_step):
    ckpt = make_ckpt()
    ckpt.save(1, small(1)).wait()
    fail_step.add(2)
    ckpt.save(2, small(2))
    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.wait()
    assert_tier_error(ei.value, 2)
    ckpt.wait()
    fail_step.clear()
    ckpt.save(3, small(3)).wait()
    assert ckpt.steps() == [1, 3]


def test_error_is_raised_once_at_close(make_ckpt, ckpt_dir, fail_step):
    ckpt = make_ckpt()
    ckpt.save(1, small(1)).wait()
    fail_step.add(2)
    ckpt.save(2, small(2))
    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.close()
    assert_tier_error(ei.value, 2)
    ckpt.close()  # idempotent, and the error is not raised twice
    fresh = make_ckpt()
    assert fresh.steps() == [1]
    assert_restores(fresh, 1)


def test_several_failures_are_reported_together_once(make_ckpt, fail_step, write_gate):
    ckpt = make_ckpt(host_buffers=2)
    fail_step.update({1, 2})
    first = ckpt.save(1, small(1))
    second = ckpt.save(2, small(2))  # queued before step 1 fails
    write_gate.set()
    wait_done(first)
    wait_done(second)
    with pytest.raises(tiercheck.TierError) as ei:
        ckpt.wait()
    assert ei.value.step == 1
    assert ei.value.tier == "local"
    assert "1, 2" in str(ei.value)
    ckpt.wait()
    assert ckpt.steps() == []


# ----------------------------------------------------------------------------- real ENOSPC


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, so a larger step fails with a real ENOSPC."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)


def test_disk_full_is_a_tier_error_and_earlier_steps_survive(make_ckpt, tiny_fs):
    root = tiny_fs / "ckpt"
    ckpt = make_ckpt(local=root)
    ckpt.save(1, small(1)).wait()
    handle = ckpt.save(2, {"x": torch.zeros(3 << 20, dtype=torch.uint8), "step": 2})

    with pytest.raises(tiercheck.TierError) as ei:
        handle.wait()
    assert_tier_error(ei.value, 2)
    ckpt.wait()  # seen already

    assert ckpt.steps() == [1]
    assert no_temp_dirs(root)  # the partial step was cleaned up, freeing the space
    assert_restores(ckpt, 1)
    ckpt.save(3, small(3)).wait()  # the cause is gone (small state fits)
    assert ckpt.steps() == [1, 3]
    ckpt.close()
    assert tiercheck.load(root)["step"] == 3


# ----------------------------------------------------------------------------- leftovers


def test_leftover_temp_and_trash_dirs_are_removed_at_start(make_ckpt, ckpt_dir, dir_snapshot):
    first = make_ckpt()
    first.save(1, small(1)).wait()
    first.close()
    tmp = ckpt_dir / f"{naming.TMP_PREFIX}{naming.step_dir_name(5)}-r00000-0123456789abcdef"
    trash = ckpt_dir / f"{naming.TRASH_PREFIX}{naming.step_dir_name(3)}-fedcba9876543210"
    generated = ckpt_dir / naming.tmp_dir_name(7, 0)
    for d in (tmp, trash, generated):
        d.mkdir()
        (d / naming.shard_name(0, 1)).write_bytes(b"partial")
    (ckpt_dir / "my-notes").mkdir()
    (ckpt_dir / "my-notes" / "todo.txt").write_text("keep me")
    copy = ckpt_dir / "step-000000000005-copy"
    copy.mkdir()
    (copy / naming.COMMIT_NAME).write_text("a user's copy")
    (ckpt_dir / ".tiercheck-tmp-notes").mkdir()  # prefix only: not our name
    (ckpt_dir / f"{naming.TMP_PREFIX}{naming.step_dir_name(6)}-r00000-0123456789abcdef.txt").write_text("file")
    user_files = {
        k: v for k, v in dir_snapshot(ckpt_dir).items() if not k.startswith((tmp.name, trash.name, generated.name))
    }

    fresh = make_ckpt()
    assert fresh.steps() == [1]
    assert tmp.exists() and trash.exists() and generated.exists()  # reading sweeps nothing
    fresh.prepare(small(2))  # becoming the writer does

    assert not tmp.exists()
    assert not trash.exists()
    assert not generated.exists()
    assert dir_snapshot(ckpt_dir) == user_files
    assert fresh.steps() == [1]
    assert_restores(fresh, 1)
