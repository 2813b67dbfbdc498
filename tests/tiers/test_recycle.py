"""Tier 1 recycles deleted shards: a later step overwrites a pruned step's shard file in place
instead of the filesystem freeing one file and allocating another (`tiercheck.tiers.local`).

Whether a file was recycled is seen through a descriptor the test holds open on a step's
shard: it keeps the inode (and its number) whatever tiercheck does, so it is the same file as a
later step's shard only if that shard was written over it, and it shrinks to nothing if the
shard was freed. (Not through a hard link: tiercheck never writes into a file that has one,
`tests/tiers/test_links.py`.)"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.tiers.local import LocalTier

SHARD = naming.shard_name(0, 1)


class SmallShards(LocalTier):
    RECYCLE_MIN = 4096  # the test's shards are a few MiB; a real one is recycled from 64 MiB


def state(step: int, nbytes: int = 3 << 20) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g), "step": step}


def restored(ckpt: tiercheck.Checkpointer, nbytes: int) -> dict[str, Any]:
    template = {"w": torch.zeros(nbytes, dtype=torch.uint8), "step": -1}
    ckpt.restore(template)
    return template


def shard(root: Path, step: int) -> Path:
    return root / naming.step_dir_name(step) / SHARD


def wait_until(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def held_open() -> Iterator[dict[str, int]]:
    """Descriptors the test holds on files, by a name of its choosing; closed at the end."""
    fds: dict[str, int] = {}
    try:
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def same_file(fd: int, path: Path) -> bool:
    a, b = os.fstat(fd), os.stat(path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def trash_dirs(root: Path) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(naming.TRASH_PREFIX)]


def test_a_later_step_overwrites_a_deleted_steps_shard_in_place(tmp_path: Path) -> None:
    root = tmp_path / "t"
    tier = SmallShards(root)
    with tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt, held_open() as held:
        ckpt.save(0, state(0)).wait()
        held["step0"] = os.open(shard(root, 0), os.O_RDONLY)
        ckpt.save(1, state(1)).wait()
        ckpt.wait()  # step 0 pruned: hidden at once, its shard kept by the reclaimer
        wait_until(lambda: tier.spare_bytes > 0, "the spare")
        assert ckpt.steps() == [1] and len(trash_dirs(root)) == 1
        ckpt.save(2, state(2)).wait()
        assert same_file(held["step0"], shard(root, 2))
        # Step 0's emptied trash directory went with its spare. (Step 1's may be there
        # already: retention runs after the step is durable, which is all wait() promises.)
        assert [n for n in trash_dirs(root) if naming.step_dir_name(0) in n] == []
        got = restored(ckpt, 3 << 20)
        assert got["step"] == 2 and torch.equal(got["w"], state(2)["w"])
        assert tiercheck.load(str(root))["w"].equal(state(2)["w"])
        ckpt.wait()
        wait_until(lambda: tier.spare_bytes > 0, "step 1's shard as the spare")
    # close frees the spare it held (paced truncates, then the unlink)
    assert trash_dirs(root) == []
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [naming.step_dir_name(2)]


def test_the_spare_is_trimmed_or_extended_to_a_resized_state(tmp_path: Path) -> None:
    root, fresh = tmp_path / "t", tmp_path / "fresh"
    tier = SmallShards(root)
    sizes = [4 << 20, 6 << 20, 6 << 20, 3 << 20, 3 << 20]  # grows, then shrinks
    with (
        tiercheck.Checkpointer(local=tier, keep_local=1) as ckpt,
        tiercheck.Checkpointer(local=LocalTier(fresh, recycle=False), keep_local=None) as plain,
        held_open() as held,
    ):
        for step, n in enumerate(sizes):
            if step >= 2:
                wait_until(lambda: tier.spare_bytes > 0, f"a spare before step {step}")
            ckpt.save(step, state(step, n)).wait()
            held[f"held-{step}"] = os.open(shard(root, step), os.O_RDONLY)
            ckpt.wait()
            plain.save(step, state(step, n)).wait()
            assert os.path.getsize(shard(root, step)) == os.path.getsize(shard(fresh, step))
            got = restored(ckpt, n)
            assert got["step"] == step and torch.equal(got["w"], state(step, n)["w"])
        # Each step from 2 on went over the shard of the step two before it: step 2 (6 MiB)
        # over step 0's 4 MiB, extended; steps 3 and 4 (3 MiB) over 6 MiB ones, trimmed.
        for step in (2, 3, 4):
            a, b = os.fstat(held[f"held-{step - 2}"]), os.fstat(held[f"held-{step}"])
            assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino), step
        assert os.fstat(held["held-4"]).st_size == os.path.getsize(shard(fresh, 4))


def test_recycle_false_frees_the_deleted_shard(tmp_path: Path) -> None:
    root = tmp_path / "t"
    with (
        tiercheck.Checkpointer(local=SmallShards(root, recycle=False), keep_local=1) as ckpt,
        held_open() as held,
    ):
        ckpt.save(0, state(0)).wait()
        held["step0"] = os.open(shard(root, 0), os.O_RDONLY)
        ckpt.save(1, state(1)).wait()
        ckpt.wait()
        wait_until(lambda: trash_dirs(root) == [], "step 0's trash directory removed")
        st = os.fstat(held["step0"])
        assert (st.st_size, st.st_nlink) == (0, 0)  # truncated and unlinked, not kept
        ckpt.save(2, state(2)).wait()
        assert not same_file(held["step0"], shard(root, 2))
