"""Tier 1 beside the user's links (invariant 8): a file with other hard links (a step pinned by
``ln`` into ``keep/``, a run forked with ``cp -al``) is never truncated or overwritten, only its
name here is unlinked; a step directory that is a symbolic link loses only the link, never the
directory it points to. Both through a Checkpointer's retention and recycling and through
``tiercheck prune`` / ``tiercheck rm``."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.__main__ import main as cli
from tiercheck.errors import DirectoryInUseError
from tiercheck.format import naming
from tiercheck.tiers.local import LocalTier
from tiercheck.tools import prune_steps

STEP0 = naming.step_dir_name(0)
NBYTES = 3 << 20


class LargeShards(LocalTier):
    """A tier that treats the tests' 3 MiB shards as large ones: kept as spares to recycle
    (from 64 MiB otherwise) and freed in several paced truncates."""

    RECYCLE_MIN = 4096
    RECLAIM_STEP = 1 << 20


TIERS: dict[str, type[LocalTier]] = {"small": LocalTier, "large": LargeShards}


def state(step: int, nbytes: int = NBYTES) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g), "step": step}


def assert_state(got: dict[str, Any], step: int) -> None:
    want = state(step)
    assert got["step"] == step and torch.equal(got["w"], want["w"]), step


def files_of(d: Path) -> dict[str, bytes]:
    """Every regular file below `d` and its bytes (links not followed)."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(d))] = p.read_bytes()
    return out


def wait_until(cond: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def leftovers(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if naming.is_leftover(n))


def save_pruning(ckpt: tiercheck.Checkpointer, tier: LocalTier, steps: range) -> None:
    """Save `steps` one by one with retention running after each, and each save after the
    reclaimer has freed (or kept as a spare to overwrite) what retention deleted before it."""
    for step in steps:
        wait_until(lambda: not tier.recycler.waiting, f"the reclaimer before step {step}")
        ckpt.save(step, state(step)).wait()
        ckpt.wait()
    wait_until(lambda: not tier.recycler.waiting, "the reclaimer")  # a copy (cp -al) meets no file going


# ------------------------------------------------------------------ hard links


@pytest.mark.parametrize("size", sorted(TIERS))
@pytest.mark.parametrize("recycle", [True, False], ids=["recycle", "no-recycle"])
def test_a_step_pinned_by_hard_links_stays_restorable(tmp_path: Path, size: str, recycle: bool) -> None:
    root = tmp_path / "ckpt"
    pinned = root / "keep" / STEP0
    tier = TIERS[size](root, recycle=recycle)
    with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt:
        ckpt.save(0, state(0)).wait()
        pinned.mkdir(parents=True)
        for f in (root / STEP0).iterdir():
            os.link(f, pinned / f.name)
        before = files_of(pinned)
        save_pruning(ckpt, tier, range(1, 5))
        assert ckpt.steps() == [4]
        assert_state(tiercheck.load(root), 4)
    assert files_of(pinned) == before  # the marker, manifest and shard: none truncated or overwritten
    assert all(os.stat(pinned / name).st_nlink == 1 for name in before)  # tiercheck's names are gone
    assert_state(tiercheck.load(pinned.parent), 0)
    assert leftovers(root) == []


@pytest.mark.parametrize("size", sorted(TIERS))
@pytest.mark.parametrize("recycle", [True, False], ids=["recycle", "no-recycle"])
def test_a_cp_al_fork_stays_restorable_while_the_original_prunes(tmp_path: Path, size: str, recycle: bool) -> None:
    root, fork = tmp_path / "run7", tmp_path / "run7-fork"
    tier = TIERS[size](root, recycle=recycle)
    with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt:
        save_pruning(ckpt, tier, range(0, 2))
        # Forked while the run writes, as a user would: its spare, if any, is linked too.
        subprocess.run(["cp", "-al", str(root), str(fork)], check=True)
        before = files_of(fork)
        save_pruning(ckpt, tier, range(2, 6))
        assert_state(tiercheck.load(root), 5)
    assert files_of(fork) == before
    assert_state(tiercheck.load(fork), 1)
    # The fork trains on, pruning its own copy of step 1: the original's files stay as they are.
    before = files_of(root)
    fork_tier = TIERS[size](fork, recycle=recycle)
    with tiercheck.Checkpointer(local=fork_tier, keep_local=1) as ckpt:
        save_pruning(ckpt, fork_tier, range(10, 13))
    assert files_of(root) == before
    assert_state(tiercheck.load(root), 5)
    assert_state(tiercheck.load(fork), 12)


def test_a_fork_sharing_the_lock_files_of_a_running_original(tmp_path: Path) -> None:
    """``cp -al`` links the fork's writer-lock files to the original's: a writer of the fork
    meets the running original's lock, and the refusal says why and how to go on. Nothing is
    written into the original's lock file, by the fork's writer or by `tiercheck prune`."""
    root, fork = tmp_path / "run7", tmp_path / "run7-fork"
    lock, fork_lock = root / naming.lock_name(0), fork / naming.lock_name(0)
    tier = LocalTier(root)
    with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt:
        save_pruning(ckpt, tier, range(0, 2))
        subprocess.run(["cp", "-al", str(root), str(fork)], check=True)
        holder = lock.read_bytes()
        with (
            pytest.raises(DirectoryInUseError, match="other hard link") as err,
            tiercheck.Checkpointer(local=fork, keep_local=1) as forked,
        ):
            forked.save(2, state(2)).wait()
        assert str(fork_lock) in str(err.value)
        with pytest.raises(DirectoryInUseError, match="other hard link"):
            prune_steps(fork, 1)
        for name in os.listdir(fork):
            if name.startswith(naming.LOCK_PREFIX):
                os.unlink(fork / name)
        with tiercheck.Checkpointer(local=fork, keep_local=1) as forked:
            forked.save(5, state(5)).wait()
            ckpt.save(2, state(2)).wait()
        assert lock.read_bytes() == holder
        assert os.stat(lock).st_nlink == 1 and os.stat(fork_lock).st_nlink == 1
    assert_state(tiercheck.load(root), 2)
    assert_state(tiercheck.load(fork), 5)


@pytest.mark.parametrize("command", ["prune", "rm"])
def test_prune_and_rm_leave_a_pinned_and_a_forked_step_intact(tmp_path: Path, command: str) -> None:
    root, fork = tmp_path / "ckpt", tmp_path / "fork"
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        for step in range(3):
            ckpt.save(step, state(step)).wait()
    pinned = root / "keep" / STEP0
    pinned.mkdir(parents=True)
    for f in (root / STEP0).iterdir():
        os.link(f, pinned / f.name)
    subprocess.run(["cp", "-al", str(root), str(fork)], check=True)
    before_pinned, before_fork = files_of(pinned), files_of(fork)
    if command == "prune":
        assert cli(["prune", str(root), "--keep-last", "1"]) == 0
    else:
        assert cli(["rm", str(root), "--step", "0"]) == 0
        assert cli(["rm", str(root), "--step", "1"]) == 0
    assert sorted(n for n in os.listdir(root) if n.startswith(naming.STEP_PREFIX)) == [naming.step_dir_name(2)]
    assert files_of(pinned) == before_pinned and files_of(fork) == before_fork
    assert_state(tiercheck.load(pinned.parent), 0)
    for step in range(3):
        assert_state(tiercheck.load(fork, step=step), step)


def test_the_reclaimer_unlinks_a_linked_file_it_finds_in_the_trash(tmp_path: Path) -> None:
    """Linked after the step was deleted, before its reclaim (and FIFOs, links planted there):
    what the reclaimer opens is checked, not only what it listed."""
    root = tmp_path / "ckpt"
    tier = LargeShards(root)
    with tiercheck.Checkpointer(local=tier, keep_local=None) as ckpt:
        ckpt.save(0, state(0)).wait()
    trash = root / naming.trash_dir_name(0)
    os.rename(root / STEP0, trash)
    outside = tmp_path / "outside"
    outside.mkdir()
    for f in trash.iterdir():
        os.link(f, outside / f.name)
    (tmp_path / "user-file").write_bytes(b"the user's")
    (trash / "link").symlink_to(tmp_path / "user-file")
    os.mkfifo(trash / "fifo")
    before = files_of(outside)
    tier.recycler.note_shard(1 << 40)  # room for a spare: the shard would be kept to overwrite
    tier.set_reclaimer(lambda token: None)
    tier.reclaim(str(trash))
    assert tier.spare_bytes == 0  # a linked file is never kept to overwrite
    assert not trash.exists()
    assert files_of(outside) == before and (tmp_path / "user-file").read_bytes() == b"the user's"


def test_a_spare_linked_while_held_is_not_overwritten(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    tier = LargeShards(root)
    with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt:
        save_pruning(ckpt, tier, range(0, 2))
        wait_until(lambda: tier.spare_bytes > 0, "a spare")  # step 0's shard
        (spare,) = [p for t in leftovers(root) for p in (root / t).iterdir()]
        os.link(spare, outside)
        before = outside.read_bytes()
        ckpt.save(2, state(2)).wait()
        assert not os.path.samefile(outside, root / naming.step_dir_name(2) / spare.name)
        assert_state(tiercheck.load(root), 2)
    assert outside.read_bytes() == before


# ----------------------------------------------------- a symlinked step directory


def user_dir_as_step_0(tmp_path: Path, root: Path) -> tuple[Path, dict[str, bytes]]:
    """Step 0 saved elsewhere, moved into a directory of the user's beside their own files,
    and linked in as ``root/step-000000000000``."""
    elsewhere = tmp_path / "elsewhere"
    with tiercheck.Checkpointer(local=elsewhere, keep_local=None) as ckpt:
        ckpt.save(0, state(0)).wait()
    user = tmp_path / "user"
    shutil.move(elsewhere / STEP0, user)
    (user / "notes.txt").write_bytes(b"my notes")
    (user / "data").mkdir()
    (user / "data" / "big.bin").write_bytes(os.urandom(1 << 20))
    root.mkdir(exist_ok=True)
    (root / STEP0).symlink_to(user, target_is_directory=True)
    return user, files_of(user)


@pytest.mark.parametrize("size", sorted(TIERS))
@pytest.mark.parametrize("recycle", [True, False], ids=["recycle", "no-recycle"])
def test_retention_removes_only_the_link_of_a_symlinked_step(tmp_path: Path, size: str, recycle: bool) -> None:
    root = tmp_path / "ckpt"
    user, before = user_dir_as_step_0(tmp_path, root)
    tier = TIERS[size](root, recycle=recycle)
    with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt:
        save_pruning(ckpt, tier, range(1, 5))
        assert ckpt.steps() == [4]
    assert not os.path.lexists(root / STEP0)
    assert files_of(user) == before
    assert leftovers(root) == []
    assert_state(tiercheck.load(root), 4)


@pytest.mark.parametrize("command", ["prune", "rm"])
def test_prune_and_rm_remove_only_the_link_of_a_symlinked_step(tmp_path: Path, command: str) -> None:
    root = tmp_path / "ckpt"
    user, before = user_dir_as_step_0(tmp_path, root)
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        ckpt.save(1, state(1)).wait()
    if command == "prune":
        assert cli(["prune", str(root), "--keep-last", "1"]) == 0
    else:
        assert cli(["rm", str(root), "--step", "0"]) == 0
    assert not os.path.lexists(root / STEP0)
    assert files_of(user) == before
    assert leftovers(root) == []


def test_saving_over_an_uncommitted_symlinked_step_replaces_only_the_link(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    user, _ = user_dir_as_step_0(tmp_path, root)
    (user / naming.COMMIT_NAME).unlink()  # not a committed step: its name is free to save step 0
    before = files_of(user)
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        ckpt.save(0, state(0)).wait()
    assert not (root / STEP0).is_symlink()
    assert files_of(user) == before
    assert leftovers(root) == []
    assert_state(tiercheck.load(root), 0)


def test_restore_skips_a_symlinked_newest_step_with_a_warning(tmp_path: Path) -> None:
    """The reader follows no link inside a tier (invariant 8): the link to a valid copy of
    step 0 is refused and the next older step restored."""
    root = tmp_path / "ckpt"
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        ckpt.save(1, state(1)).wait()
    user_dir_as_step_0(tmp_path, root)
    os.rename(root / STEP0, root / naming.step_dir_name(9))
    template = {"w": torch.zeros(NBYTES, dtype=torch.uint8), "step": -1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
            assert ckpt.restore(template) == 1
    assert_state(template, 1)
    assert any("symbolic link" in str(w.message) and "step 9" in str(w.message) for w in caught)


def test_links_in_the_trash_commit_and_manifest_places_are_never_followed(tmp_path: Path) -> None:
    """A step whose marker and manifest are links to the user's files, and a trash directory
    name that is a link to the user's directory: deleting the step and sweeping the trash
    remove the links alone."""
    root = tmp_path / "ckpt"
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        for step in range(3):
            ckpt.save(step, state(step)).wait()
    user = tmp_path / "user"
    user.mkdir()
    for name in (naming.COMMIT_NAME, naming.manifest_name(0, 1)):
        shutil.copyfile(root / STEP0 / name, user / name)
        (root / STEP0 / name).unlink()
        (root / STEP0 / name).symlink_to(user / name)
    (user / "mine").write_bytes(b"keep me")
    trash_link = root / naming.trash_dir_name(7)
    trash_link.symlink_to(user, target_is_directory=True)
    before = files_of(user)
    assert cli(["rm", str(root), "--step", "0"]) == 0
    with tiercheck.Checkpointer(local=LargeShards(root), keep_local=1) as ckpt:  # its start sweeps the trash
        ckpt.save(3, state(3)).wait()
    assert files_of(user) == before
    assert not os.path.lexists(root / STEP0)
    assert_state(tiercheck.load(root), 3)
