"""One writer per rank of a tier-1 directory; readers never modify it (issue 12, item 3).

A Checkpointer becomes the writer of its rank's part of a directory at its first `save()` or
`prepare()`: it takes an OS lock there (``flock`` on ``.tiercheck-lock-rank-<r>``) and only
then sweeps the leftovers that rank owns. These tests run real writer processes
(`lock_worker.py`): a reader next to a live writer, a second writer refused, a SIGKILLed
writer whose restart is not blocked, not even by a child it forked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.errors import DirectoryInUseError
from tiercheck.format import naming
from tiercheck.tiers.local import LocalTier

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs POSIX flock and fork")

WORKER = Path(__file__).resolve().parents[1] / "helpers" / "lock_worker.py"


class Worker:
    """A `lock_worker.py` process whose output is read line by line."""

    def __init__(self, mode: str, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line.rstrip("\n"))
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"no line starting {prefix!r}; the worker printed {self.lines}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


def test_a_reader_never_touches_the_temp_dir_of_a_save_in_flight(tmp_path: Path, workers: list[Worker]) -> None:
    # An evaluation script opening a Checkpointer on a directory a job is writing used to
    # sweep the job's in-flight temp directory at start-up: the job's next commit failed.
    writer = Worker("slow-save", tmp_path)
    workers.append(writer)
    writer.expect("committed 1")
    writer.expect("writing 2")
    in_flight = [n for n in os.listdir(tmp_path) if n.startswith(naming.TMP_PREFIX)]
    assert len(in_flight) == 1
    reader = tiercheck.Checkpointer(local=tmp_path, keep_local=1)
    state = {"x": torch.zeros(1024)}
    assert reader.restore(state, step=1) == 1
    assert torch.equal(state["x"], torch.full((1024,), 1.0))
    assert torch.equal(tiercheck.load(tmp_path, step=1)["x"], torch.full((1024,), 1.0))
    reader.close()
    assert (tmp_path / in_flight[0]).exists() or naming.step_dir_name(2) in os.listdir(tmp_path)
    assert writer.expect("committed 2", timeout=120) == "committed 2", writer.lines
    assert writer.proc.wait(timeout=30) == 0
    assert LocalTier(tmp_path).committed_steps() == [1, 2]
    assert torch.equal(tiercheck.load(tmp_path)["x"], torch.full((3 << 20,), 2.0))


def test_a_second_writer_of_one_rank_is_refused(tmp_path: Path) -> None:
    reader = tiercheck.Checkpointer(local=tmp_path)  # constructed first: it is no writer
    first = tiercheck.Checkpointer(local=tmp_path, keep_local=None)
    first.save(1, {"x": torch.ones(8)}).wait()
    second = tiercheck.Checkpointer(local=tmp_path, keep_local=None)
    state = {"x": torch.zeros(8)}
    assert second.restore(state) == 1  # reading needs no lock
    assert reader.restore(state) == 1
    with pytest.raises(DirectoryInUseError) as raised:
        second.save(2, {"x": torch.full((8,), 2.0)})
    err = raised.value
    assert isinstance(err, tiercheck.TiercheckError) and isinstance(err, BlockingIOError)
    assert str(tmp_path) in str(err) and "rank 0" in str(err)
    assert "not closed" in str(err)  # the holder is this very process
    with pytest.raises(DirectoryInUseError):
        second.prepare({"x": torch.zeros(8)})
    first.save(2, {"x": torch.full((8,), 2.0)}).wait()  # the writer is unaffected
    assert second.steps() == [1, 2]
    first.close()  # releases the lock
    second.save(3, {"x": torch.full((8,), 3.0)}).wait()
    second.close()
    reader.close()
    assert LocalTier(tmp_path).committed_steps() == [1, 2, 3]
    assert tiercheck.DirectoryInUseError is DirectoryInUseError  # type: ignore[attr-defined]


def test_a_writer_in_another_process_is_refused_and_its_death_frees_the_directory(
    tmp_path: Path, workers: list[Worker]
) -> None:
    holder = Worker("hold", tmp_path)
    workers.append(holder)
    holder.expect("holding")
    ckpt = tiercheck.Checkpointer(local=tmp_path, keep_local=None)
    with pytest.raises(DirectoryInUseError, match=f"pid {holder.proc.pid} "):
        ckpt.save(1, {"x": torch.ones(8)})
    holder.kill()  # SIGKILL: no clean-up runs, the kernel drops the lock
    t0 = time.monotonic()
    ckpt.save(1, {"x": torch.ones(8)}).wait()
    assert time.monotonic() - t0 < 10  # not blocked by the dead writer
    ckpt.close()
    assert LocalTier(tmp_path).committed_steps() == [1]


def test_a_child_forked_by_a_killed_writer_does_not_keep_its_lock(tmp_path: Path, workers: list[Worker]) -> None:
    holder = Worker("hold-fork", tmp_path)
    workers.append(holder)
    child = int(holder.expect("child ").split()[1])
    holder.expect("holding")
    try:
        holder.kill()
        os.kill(child, 0)  # the child (a data-loader worker, say) lives on
        with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as restarted:
            restarted.save(1, {"x": torch.ones(8)}).wait()
    finally:
        os.kill(child, signal.SIGKILL)
    assert LocalTier(tmp_path).committed_steps() == [1]


def test_ranks_sharing_a_directory_lock_and_sweep_only_their_own(tmp_path: Path) -> None:
    other_job = LocalTier(tmp_path)
    assert other_job.claim_writer(3, 4) == []  # a live writer of rank 3 (a job of 4 ranks)
    leftovers = {r: tmp_path / naming.tmp_dir_name(7, r) for r in range(4)}
    trash = tmp_path / naming.trash_dir_name(5)
    for d in (*leftovers.values(), trash):
        d.mkdir()
        (d / naming.shard_name(0, 1)).write_bytes(b"\0" * 4096)
    rank0, rank1 = LocalTier(tmp_path), LocalTier(tmp_path)
    removed = rank0.claim_writer(0, 2)  # a job of 2 ranks sharing the directory
    # Its own temp dirs, the trash, and those of rank 2 (beyond the job, lock free); rank 1
    # sweeps its own, and rank 3's writer is alive.
    assert sorted(removed) == sorted(str(p) for p in (leftovers[0], trash, leftovers[2]))
    assert leftovers[1].exists() and leftovers[3].exists()
    assert rank1.claim_writer(1, 2) == [str(leftovers[1])]
    with pytest.raises(DirectoryInUseError):
        LocalTier(tmp_path).claim_writer(0, 2)
    rank0.release_writer()
    again = LocalTier(tmp_path)
    assert again.claim_writer(0, 2) == []  # free once released
    assert leftovers[3].exists()
    # The lock files are neither steps nor leftovers.
    names = sorted(os.listdir(tmp_path))
    assert names == sorted([naming.lock_name(r) for r in (0, 1, 2, 3)] + [leftovers[3].name])
    assert LocalTier(tmp_path).committed_steps() == [] and LocalTier(tmp_path).stray_steps() == []
    assert not any(naming.is_leftover(naming.lock_name(r)) for r in range(4))
    for t in (other_job, rank1, again):
        t.release_writer()
