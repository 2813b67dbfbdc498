"""Resource stability: hundreds of saves leave RSS, open files and threads flat, and a
Checkpointer leaves nothing behind when closed (or warns when it is dropped unclosed).

Measured from /proc: VmRSS from /proc/self/status, open descriptors from /proc/self/fd,
threads from `threading.enumerate()` and /proc/self/status, child processes by scanning
/proc for our pid as parent. Growth is judged on medians of the first and last 100
measurements (after a short warm-up), so one slow collection does not decide it.

`os.fsync` is a no-op during the loops: 1000 fsync'd steps take ~25 s on this disk, and
flushing is not what these tests measure (every open/close of the fsync path still runs).
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.tiers.local import LocalTier

MiB = 1 << 20
RSS_SLACK = 4 * MiB  # allowed growth of the median RSS over the loop
FD_SLACK = 2
THREAD_SLACK = 0


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def os_threads_at_rest(at_most: int | None, deadline_s: float = 30.0) -> int:
    """`os_threads()` once threads that already ended have left /proc/self/task: `join()`
    returns when a thread's Python state is gone, and its OS thread exits a moment later (a
    remote call's thread was counted at rest once under load). A thread that stays is still
    counted after `deadline_s`."""
    end = time.monotonic() + deadline_s
    n = os_threads()
    while at_most is not None and n > at_most and time.monotonic() < end:
        time.sleep(0.01)
        n = os_threads()
    return n


def tiercheck_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tiercheck")]


def child_pids() -> list[int]:
    me, kids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # field 4 of stat: the parent pid
            kids.append(int(entry))
    return kids


def small_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(128, 128, generator=g), "b": torch.randn(128, generator=g)},
        "opt": {0: {"m": torch.zeros(128, 128)}, "lr": 1e-3},
        "step": 0,
        "rng": torch.get_rng_state(),
    }


class Meter:
    def __init__(self) -> None:
        self.rss: list[int] = []
        self.fds: list[int] = []
        self.threads: list[int] = []

    def sample(self) -> None:
        self.rss.append(rss())
        self.fds.append(open_fds())
        self.threads.append(os_threads())

    @staticmethod
    def growth(xs: list[int], window: int = 100) -> float:
        return statistics.median(xs[-window:]) - statistics.median(xs[:window])

    def report(self) -> str:
        return (
            f"RSS {self.rss[0] / MiB:.1f} -> {self.rss[-1] / MiB:.1f} MiB "
            f"(median growth {self.growth(self.rss) / MiB:+.2f} MiB, max {max(self.rss) / MiB:.1f}); "
            f"fds {min(self.fds)}..{max(self.fds)} (median growth {self.growth(self.fds):+.1f}); "
            f"threads {min(self.threads)}..{max(self.threads)} (median growth {self.growth(self.threads):+.1f})"
        )

    def assert_flat(self) -> None:
        assert self.growth(self.rss) <= RSS_SLACK, self.report()
        assert self.growth(self.fds) <= FD_SLACK, self.report()
        assert self.growth(self.threads) <= THREAD_SLACK, self.report()
        assert max(self.threads) <= self.threads[0] + 2, self.report()  # no burst of threads either
        assert max(self.fds) <= self.fds[0] + 8, self.report()


@pytest.fixture
def no_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def private_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Route `tempfile` to a directory of our own, so anything left there is ours."""
    d = tmp_path / "systemp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.fixture
def memory_url() -> Iterator[str]:
    url = f"memory://resources-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def baseline() -> tuple[set[str], set[int]]:
    return {t.name for t in threading.enumerate()}, set(child_pids())


def assert_nothing_left(root: Path, tempdir: Path, before: tuple[set[str], set[int]]) -> None:
    """`before`: thread names and child pids from `baseline()` (session fixtures may run
    servers as child processes)."""
    threads_before, children_before = before
    assert tiercheck_threads() == [], tiercheck_threads()
    assert {t.name for t in threading.enumerate()} <= threads_before
    assert set(child_pids()) <= children_before
    assert os.listdir(tempdir) == []
    assert [n for n in os.listdir(root) if naming.is_leftover(n)] == []


@pytest.mark.slow  # ~20 s
def test_a_thousand_saves_stay_flat(tmp_path: Path, no_fsync: None, private_tempdir: Path) -> None:
    root = tmp_path / "ckpt"
    before = baseline()
    fds_before = open_fds()
    state = small_state()
    meter = Meter()
    t0 = time.perf_counter()
    ckpt = tiercheck.Checkpointer(local=root, keep_local=2)
    for step in range(1000):
        state["step"] = step
        state["model"]["w"][0, 0] = step
        handle = ckpt.save(step, state)
        if step % 4 == 3:
            handle.wait()
        if step >= 20:  # warm-up: first buffer, plan, lazily started pools
            meter.sample()
    ckpt.wait()
    elapsed = time.perf_counter() - t0
    assert ckpt._pool.allocations == 1
    assert ckpt.steps() == [998, 999]
    ckpt.close()
    print(f"1000 local saves in {elapsed:.1f} s: {meter.report()}")
    meter.assert_flat()
    assert_nothing_left(root, private_tempdir, before)
    gc.collect()
    assert open_fds() <= fds_before
    got = tiercheck.load(root)
    assert got["step"] == 999 and got["model"]["w"][0, 0].item() == 999


def test_saves_with_a_remote_tier_stay_flat(
    tmp_path: Path, no_fsync: None, private_tempdir: Path, memory_url: str
) -> None:
    root = tmp_path / "ckpt"
    before = baseline()
    state = small_state()
    meter = Meter()
    t0 = time.perf_counter()
    ckpt = tiercheck.Checkpointer(local=root, remote=memory_url, keep_local=2, keep_remote=2)
    idle_threads: list[int] = []  # with nothing in flight: each remote call's thread is gone
    own_threads: list[list[str]] = []  # tiercheck's own threads at rest, by name
    for step in range(300):
        state["step"] = step
        handle = ckpt.save(step, state)
        if step % 3 == 2:
            handle.wait()
        if step >= 20:
            meter.sample()
        if step % 30 == 29:
            ckpt.wait()
            idle_threads.append(os_threads_at_rest(idle_threads[0] if idle_threads else None))
            own_threads.append(sorted(t.name for t in threading.enumerate() if t.name.startswith("tiercheck")))
    ckpt.wait()
    elapsed = time.perf_counter() - t0
    assert ckpt._pool.allocations == 1
    assert ckpt.steps("remote")[-1] == 299
    assert len(ckpt.steps("remote")) <= 2
    ckpt.close()
    print(f"300 saves with memory:// in {elapsed:.1f} s: {meter.report()}")
    # 280 samples: compare the first and last 100
    assert meter.growth(meter.fds) <= FD_SLACK, meter.report()
    # Samples taken while an upload runs may catch its short-lived call thread; at rest
    # tiercheck's own threads are exactly the same every time, and the process's count never
    # grows (another test's thread ending meanwhile may lower it: seen once under load).
    assert all(t == own_threads[0] for t in own_threads), own_threads
    assert max(idle_threads) == idle_threads[0] and idle_threads[-1] <= idle_threads[0], idle_threads
    assert max(meter.threads) <= meter.threads[0] + 2, meter.report()
    assert meter.growth(meter.rss) <= RSS_SLACK, meter.report()
    assert_nothing_left(root, private_tempdir, before)
    assert tiercheck.load(memory_url)["step"] == 299


def test_close_leaves_no_threads_processes_or_temp_files(tmp_path: Path, private_tempdir: Path) -> None:
    root = tmp_path / "ckpt"
    before = baseline()
    with tiercheck.Checkpointer(local=root, remote=(tmp_path / "remote").as_uri(), keep_local=2) as ckpt:
        for step in range(5):
            ckpt.save(step, small_state())
        template = small_state()
        assert ckpt.restore(template) == 4  # the read path's verify pool too
        assert tiercheck_threads()  # the workers exist while open
    assert_nothing_left(root, private_tempdir, before)
    ckpt.close()  # idempotent
    assert tiercheck_threads() == []


@pytest.fixture
def slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    original = LocalTier.write_file

    def slow(self: LocalTier, path: str, data: memoryview, aligned: bool, *args: Any) -> None:
        time.sleep(0.1)
        original(self, path, data, aligned, *args)

    monkeypatch.setattr(LocalTier, "write_file", slow)


def _save_and_drop(root: Path) -> tiercheck.SaveHandle:
    ckpt = tiercheck.Checkpointer(local=root, keep_local=2)
    ckpt.save(1, small_state()).wait()
    handle = ckpt.save(2, small_state())
    assert not handle.done()  # still being written when the last reference to `ckpt` goes
    return handle


def test_a_dropped_checkpointer_warns_and_drains_its_pending_save(
    tmp_path: Path, slow_writes: None, private_tempdir: Path
) -> None:
    root = tmp_path / "ckpt"
    before = baseline()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = _save_and_drop(root)
        gc.collect()
    resource = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert len(resource) == 1, [str(w.message) for w in caught]
    message = str(resource[0].message)
    assert "not closed" in message and str(root) in message and "[2]" in message
    assert handle.done()
    handle.wait()  # drained: durable, no error
    assert LocalTier(root).committed_steps() == [1, 2]
    assert tiercheck.load(root)["step"] == 0
    assert_nothing_left(root, private_tempdir, before)


def test_a_dropped_idle_checkpointer_warns_too(tmp_path: Path) -> None:
    ckpt = tiercheck.Checkpointer(local=tmp_path / "ckpt")
    ckpt.save(1, small_state()).wait()
    with pytest.warns(ResourceWarning, match="not closed"):
        del ckpt
        gc.collect()
    assert tiercheck_threads() == []


def test_a_closed_checkpointer_does_not_warn(tmp_path: Path) -> None:
    ckpt = tiercheck.Checkpointer(local=tmp_path / "ckpt")
    ckpt.save(1, small_state()).wait()
    ckpt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del ckpt
        gc.collect()
