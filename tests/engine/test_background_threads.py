"""How the background threads share the machine with training: the lowest best-effort I/O
priority but the loop's CPU priority, and no writing or hashing beside the blocking copy."""

from __future__ import annotations

import ctypes
import os
import platform
import threading
import uuid
from pathlib import Path
from typing import Any

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
        assert waited and all(u <= total for u in waited)  # the writer did wait on it
        for v in state.values():
            v.zero_()
        assert ckpt.restore(state) == 1
    assert all(torch.equal(state[k], expected[k]) for k in state)


def test_a_held_progress_lets_nothing_through_until_released() -> None:
    """`save()` holds its step's progress until it returns: the copy's end alone does not wake
    the writer; a copy that failed wakes it with the failure, held or not."""
    progress = staging.StageProgress(held=True)
    progress.advance(100)
    woke = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            progress.wait(100)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)
        woke.set()

    t = threading.Thread(target=writer)
    t.start()
    assert not woke.wait(0.2)  # copied, not released: the writer still waits
    progress.release()
    assert woke.wait(60)
    t.join(60)
    assert errors == []
    failed = staging.StageProgress(held=True)
    failed.fail()
    with pytest.raises(staging.StagingAborted):
        failed.wait(1)


def test_the_writer_builds_no_manifest_while_save_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's Python (the manifest of every leaf) waits until `save()` returns: begun
    beside the end of `save()`, it took the GIL from it (0.1 to 0.3 s more of stall at 20,000
    leaves). Here the end of `save()` waits for the writer to build the manifest; it must not
    see it built before it returns."""
    from tiercheck.steps import write

    built = threading.Event()
    seen_in_save: list[bool] = []
    real = write.write_manifest

    def spy(*args: object, **kwargs: object) -> object:
        built.set()
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(write, "write_manifest", spy)
    state = {f"t{i}": torch.randn(1000) for i in range(50)}
    with tiercheck.Checkpointer(local=str(tmp_path), run_log_interval=None) as ckpt:
        ckpt.save(1, state).wait()
        built.clear()
        real_saved = ckpt._trigger.saved

        def saved(step: int) -> None:  # the end of save(): give the writer every chance
            seen_in_save.append(built.wait(1.0))
            real_saved(step)

        monkeypatch.setattr(ckpt._trigger, "saved", saved)
        ckpt.save(2, state).wait()
        assert built.is_set()
    assert seen_in_save == [False]


@pytest.mark.parametrize("tiers", ["local", "memory+local", "memory+remote"])
def test_the_writer_opens_no_step_while_save_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiers: str
) -> None:
    """`save()` queues the writer only once the copy is done, and the writer then waits for
    `save()` to return before it opens the step on any tier: woken before the copy, its
    Python (the space check, opening the step) took the GIL from the copy's end (a save of
    100 x 4 KiB stalled 0.8 ms instead of 0.45 ms). Here the copy and the end of `save()`
    each give the writer every chance to open the step; neither may see it opened."""
    from tiercheck.engine import stager
    from tiercheck.tiers.base import Tier

    opened = threading.Event()
    seen: list[tuple[str, bool]] = []
    real_open = {cls: cls.open_step for cls in _tier_classes()}
    for cls, real in real_open.items():

        def spy(self: Tier, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            opened.set()
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "open_step", spy)
    real_stage = stager.stage_into

    def copy(*args: Any, **kwargs: Any) -> None:
        real_stage(*args, **kwargs)
        seen.append(("copy", opened.wait(1.0)))

    monkeypatch.setattr(stager, "stage_into", copy)
    state = {f"t{i}": torch.randn(1000) for i in range(50)}
    kwargs: dict[str, Any] = {"run_log_interval": None}
    if "memory" in tiers:
        kwargs.update(memory=True, memory_dir=str(tmp_path / "shm"), keep_memory=1)
    if "remote" in tiers:
        kwargs["remote"] = f"memory://writer-waits-{uuid.uuid4().hex}"
    else:
        kwargs["local"] = str(tmp_path / "t1")
    with tiercheck.Checkpointer(**kwargs) as ckpt:
        ckpt.save(1, state).wait()
        opened.clear()
        seen.clear()
        real_saved = ckpt._trigger.saved

        def saved(step: int) -> None:  # the end of save()
            seen.append(("end of save", opened.wait(1.0)))
            real_saved(step)

        monkeypatch.setattr(ckpt._trigger, "saved", saved)
        ckpt.save(2, state).wait()
        assert opened.is_set()  # the spy sees the writer's opening of step 2
        got = {k: torch.empty_like(v) for k, v in state.items()}
        assert ckpt.restore(got) == 2
    assert seen == [("copy", False), ("end of save", False)]
    assert all(torch.equal(got[k], v) for k, v in state.items())


def _tier_classes() -> list[type]:
    from tiercheck.tiers.local import LocalTier
    from tiercheck.tiers.memory import SharedMemoryTier
    from tiercheck.tiers.remote import RemoteTier

    return [LocalTier, SharedMemoryTier, RemoteTier]


def test_collector_pauses_of_several_threads_nest() -> None:
    """The collector is enabled again only when the last window closes, and only if it was
    enabled when the first opened."""
    import gc

    from tiercheck.observe.collector import collector_paused

    was = gc.isenabled()
    try:
        gc.enable()
        a, b = collector_paused(), collector_paused()
        a.__enter__()
        assert not gc.isenabled()
        opened, close = threading.Event(), threading.Event()

        def other() -> None:
            with b:
                opened.set()
                close.wait(60)

        t = threading.Thread(target=other)
        t.start()
        assert opened.wait(60)
        a.__exit__(None, None, None)
        assert not gc.isenabled()  # the other thread's window is still open
        close.set()
        t.join(60)
        assert gc.isenabled()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()  # a program that disabled it keeps it disabled
    finally:
        (gc.enable if was else gc.disable)()


def test_the_buffer_goes_back_before_retention_runs(tmp_path: Path) -> None:
    """With one host buffer, a save issued right after the last one's `wait()` gets the
    buffer while the writer still deletes older steps (retention runs after the release):
    it copies and returns although that deletion is held here; the deletion then ends
    and retention is what `keep_local` says."""
    state = {"w": torch.arange(256.0)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=1, host_buffers=1, run_log_interval=None) as ckpt:
        pruner = ckpt._pipeline._pruner
        real_prune = pruner.prune
        pruning, go_on = threading.Event(), threading.Event()

        def held_prune(*args: object, **kwargs: object) -> object:
            pruning.set()
            assert go_on.wait(120), "the test never let retention go on"
            return real_prune(*args, **kwargs)  # type: ignore[arg-type]

        ckpt.save(1, state).wait()
        pruner.prune = held_prune  # type: ignore[method-assign]
        try:
            ckpt.save(2, state).wait()  # durable: then retention starts and is held
            assert pruning.wait(60), "retention never ran"
            saved = threading.Event()

            def third() -> None:
                ckpt.save(3, state)
                saved.set()

            t = threading.Thread(target=third, name="test-third-save", daemon=True)
            t.start()
            assert saved.wait(60), "save() waited for retention to give the buffer back"
        finally:
            go_on.set()
        t.join(60)
        ckpt.wait()
        assert ckpt.steps("local") == [3]
