"""A restore asks the disk for its own shard while it decodes the manifest (`ShardPrefetch`).

The asking is a hint: these tests check what is asked (this rank's shard, from its start, a
readahead window at a time, on a helper thread that is gone when the restore returns), that
it fills the page cache where the filesystem lets a test see that, and that no failure of
it, nor a hostile file at the shard's name, changes what a restore returns or raises.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.errors import CheckpointCorruptedError
from tiercheck.format import naming
from tiercheck.steps.catalog import PREFETCH_ADVICE, PREFETCH_FROM, ShardPrefetch, prefetch_bytes, read_marker
from tiercheck.tiers.base import ReadableFile
from tiercheck.tiers.local import LocalTier

PAGE = mmap.PAGESIZE


def state(n: int = 512, numel: int = 8 << 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {f"w{i}": torch.randn(numel, generator=g) for i in range(n)}  # 16 MiB of fp32, 512 leaves


def template_of(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in s.items()}


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tiercheck-prefetch"]


class _Recorded(ReadableFile):
    def __init__(self, inner: ReadableFile, tier: Recording, name: str, fail: bool) -> None:
        self._inner, self._tier, self._name, self._fail = inner, tier, name, fail
        self.size = inner.size
        self.concurrent = inner.concurrent

    def read_into(self, offset: int, dest: memoryview) -> None:
        if self._tier.hold_reads:  # a busy machine may stop the hint early: wait for its end (or 60 s)
            self._tier.hinted.wait(60)
        self._inner.read_into(offset, dest)

    def prefetch(self, offset: int, n: int) -> None:
        with self._tier.lock:
            self._tier.asked.append((self._name, offset, n, threading.current_thread().name))
        if self._fail:
            raise RuntimeError("the store refuses the hint")
        self._inner.prefetch(offset, n)
        if offset + n >= self.size:
            self._tier.hinted.set()

    def close(self) -> None:
        self._inner.close()


class Recording(LocalTier):
    """Tier 1, recording every `prefetch` asked of its files (and, with `fail`, refusing it)."""

    def __init__(self, root: Path, fail: bool = False, hold_reads: bool = False) -> None:
        super().__init__(root)
        self.fail = fail
        self.hold_reads = hold_reads  # reads wait until the file's last window was asked
        self.hinted = threading.Event()
        self.lock = threading.Lock()
        self.asked: list[tuple[str, int, int, str]] = []

    def open_file(self, step: int, name: str) -> ReadableFile:
        return _Recorded(super().open_file(step, name), self, name, self.fail)


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[tuple[Path, dict[str, torch.Tensor]]]:
    s = state()
    with tiercheck.Checkpointer(local=tmp_path / "ckpt") as ckpt:
        ckpt.save(5, s).wait()
    yield tmp_path / "ckpt", s


def restore_exactly(tier: Recording, s: dict[str, torch.Tensor]) -> None:
    """Restore the newest step through `tier` and check it is step 5, bit-exact."""
    with tiercheck.Checkpointer(local=tier) as ckpt:
        target = template_of(s)
        assert ckpt.restore(target) == 5
    for k, v in s.items():
        assert torch.equal(target[k], v), k


def test_a_restore_asks_its_own_shard_ahead_a_window_at_a_time(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, s = saved
    tier = Recording(root, hold_reads=True)
    restore_exactly(tier, s)
    assert tier.hinted.is_set()
    shard = naming.shard_name(0, 1)
    size = os.path.getsize(tier.path_of(5, shard))
    manifest = read_marker(tier, 5).manifests[0].length
    assert manifest >= PREFETCH_FROM  # 512 leaves: a manifest worth asking ahead for
    end = min(size, prefetch_bytes(manifest))
    assert end == size  # a 16 MiB shard is asked whole
    windows = range(0, end, PREFETCH_ADVICE)
    want = [(shard, pos, min(PREFETCH_ADVICE, end - pos), "tiercheck-prefetch") for pos in windows]
    assert tier.asked == want
    assert len(want) > 1  # more than one window: the loop, not one call
    assert prefetch_threads() == []  # stopped and joined before restore returned


def test_a_small_manifest_asks_nothing_ahead(tmp_path: Path) -> None:
    s = state(n=16)  # 16 leaves of 32 KiB: decoded in well under a millisecond
    with tiercheck.Checkpointer(local=tmp_path / "ckpt") as ckpt:
        ckpt.save(5, s).wait()
    tier = Recording(tmp_path / "ckpt")
    assert read_marker(tier, 5).manifests[0].length < PREFETCH_FROM
    restore_exactly(tier, s)
    assert tier.asked == []
    assert prefetch_threads() == []


def test_a_failing_hint_changes_nothing(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, s = saved
    tier = Recording(root, fail=True)
    restore_exactly(tier, s)
    assert len(tier.asked) == 1  # the first refusal ends the asking; the restore reads as before
    assert prefetch_threads() == []


def test_no_thread_for_the_hint_changes_nothing(
    saved: tuple[Path, dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, s = saved
    start = threading.Thread.start
    refused: list[str] = []

    def start_or_refuse(self: threading.Thread) -> None:
        if self.name == "tiercheck-prefetch":  # as when the process is out of threads
            refused.append(self.name)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", start_or_refuse)
    tier = Recording(root)
    restore_exactly(tier, s)
    assert refused == ["tiercheck-prefetch"]
    assert tier.asked == []


def test_a_fifo_at_the_shards_name_is_refused_as_before(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, s = saved
    tier = Recording(root)
    shard = Path(tier.path_of(5, naming.shard_name(0, 1)))
    shard.unlink()
    os.mkfifo(shard)
    out: list[object] = []

    def restore() -> None:
        try:
            with tiercheck.Checkpointer(local=tier) as ckpt:
                ckpt.restore(template_of(s), step=5)
        except Exception as exc:
            out.append(exc)

    t = threading.Thread(target=restore, daemon=True)
    t.start()
    t.join(120)
    if t.is_alive():  # let a stuck open() return (a writer comes and goes) before failing
        fd = os.open(shard, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(30)
        pytest.fail("a restore hangs on a FIFO at its shard's name")
    (exc,) = out
    assert isinstance(exc, CheckpointCorruptedError), repr(exc)
    assert "not a regular file" in str(exc) or "FIFO" in str(exc), str(exc)
    assert tier.asked == []  # the hint never opened it either
    assert prefetch_threads() == []


def _resident(path: Path) -> list[bool]:
    """Whether each page of `path` is in the page cache, by mincore(2) of a private mapping."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        vec = (ctypes.c_ubyte * -(-size // PAGE))()
        base = ctypes.c_char.from_buffer(m)
        try:
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(base)), ctypes.c_size_t(size), vec) != 0:
                pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        finally:
            del base
        return [bool(v & 1) for v in vec]
    finally:
        m.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here")
def test_the_hint_fills_the_page_cache(saved: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, _ = saved
    tier = LocalTier(root)
    path = Path(tier.path_of(5, naming.shard_name(0, 1)))
    os.sync()  # written pages must be clean before they can be dropped
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    before = _resident(path)
    if sum(before) > len(before) // 2:
        pytest.skip(f"this filesystem keeps the file's pages ({sum(before)} of {len(before)} after DONTNEED): tmpfs?")
    # A kernel reads at most its readahead window per advice (read_ahead_kb, 128 KiB to a few
    # MiB by disk), so what every advice brings whatever the window: its first pages.
    firsts = [pos // PAGE for pos in range(0, len(before) * PAGE, PREFETCH_ADVICE)]
    assert len(firsts) > 1
    with ShardPrefetch(tier, 5, path.name, len(before) * PAGE):
        deadline = time.monotonic() + 120
        while not all((now := _resident(path))[i] for i in firsts):  # read asynchronously: wait for it
            assert time.monotonic() < deadline, f"pages cached after 120 s: {[now[i] for i in firsts]}"
            time.sleep(0.01)
    assert sum(_resident(path)) > sum(before)
    assert prefetch_threads() == []
