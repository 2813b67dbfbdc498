"""How the background threads share the machine with training: the lowest best-effort I/O
priority but the loop's CPU priority, and no writing or hashing beside the blocking copy."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.engine import priority
from tiercheck.steps import stage as staging

_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "ppc64le": 274}.get(platform.machine())

linux_only = pytest.mark.skipif(
    platform.system() != "Linux" or _IOPRIO_GET is None, reason="ioprio_get is a Linux syscall"
)


def ioprio_of(tid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(_IOPRIO_GET, 1, tid)  # IOPRIO_WHO_PROCESS: a thread id
    assert value >= 0, os.strerror(ctypes.get_errno())
    return int(value)


def threads_named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


@linux_only
def test_lowering_a_thread_changes_its_io_priority_not_its_nice() -> None:
    seen: dict[str, int] = {}

    def body() -> None:
        tid = threading.get_native_id()
        seen["before"] = ioprio_of(tid)
        priority.lower_current_thread()
        seen["after"] = ioprio_of(tid)
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen["after"] == priority.IOPRIO_LOWEST != seen["before"]
    assert seen["nice"] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert ioprio_of(threading.get_native_id()) != priority.IOPRIO_LOWEST  # the caller is untouched


@linux_only
@pytest.mark.parametrize("low", [True, False])
def test_writer_and_checksum_threads_follow_low_priority(tmp_path: Path, low: bool) -> None:
    state = {"w": torch.randn(1000)}
    with tiercheck.Checkpointer(local=str(tmp_path), low_priority=low) as ckpt:
        ckpt.save(1, state).wait()  # the checksum pool starts its thread on first use
        workers = threads_named("tiercheck-writer") + threads_named("tiercheck-checksum")
        assert len(workers) == 2, [t.name for t in threading.enumerate()]
        main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        for t in workers:
            assert t.native_id is not None
            assert (ioprio_of(t.native_id) == priority.IOPRIO_LOWEST) is low, t.name
            assert os.getpriority(os.PRIO_PROCESS, t.native_id) == main_nice, t.name
        # The stager, which an optimizer step may wait for, always keeps the loop's priority.
        (stager,) = threads_named("tiercheck-stager")
        assert stager.native_id is not None and ioprio_of(stager.native_id) != priority.IOPRIO_LOWEST


def test_writer_and_checksums_start_only_after_the_whole_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU save reports its copy once, at the end: nothing is written or hashed while the
    copy still runs (a third busy thread slows the two-thread copy, which training waits for)."""
    advances: list[int] = []
    waited: list[int] = []
    original_advance = staging.StageProgress.advance
    original_wait = staging.StageProgress.wait

    def advance(self: staging.StageProgress, upto: int) -> None:
        advances.append(upto)
        original_advance(self, upto)

    def wait(self: staging.StageProgress, upto: int) -> None:
        original_wait(self, upto)
        waited.append(upto)

    monkeypatch.setattr(staging.StageProgress, "advance", advance)
    monkeypatch.setattr(staging.StageProgress, "wait", wait)
    state = {f"t{i}": torch.randn(300_000) for i in range(8)}  # 8 leaves, 9.6 MB: several write blocks
    expected = {k: v.clone() for k, v in state.items()}
    with tiercheck.Checkpointer(local=str(tmp_path)) as ckpt:
        h = ckpt.save(1, state)
        total = h.stats.bytes
        h.wait()
        assert advances == [total]
        assert waited and all(u <= total for u in waited)  # writer and hasher did wait on it
        for v in state.values():
            v.zero_()
        assert ckpt.restore(state) == 1
    assert all(torch.equal(state[k], expected[k]) for k in state)
