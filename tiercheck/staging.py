"""Host buffers and the copies into them: the only module that touches CUDA.

A `HostBufferPool` holds at most `capacity` page-aligned buffers (pinned when the state
lives on CUDA). They are allocated on first use, grown only when a state gets larger,
and reused for every later save, so host memory stays flat from save to save.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError, SnapshotChangedError
from .planner import ALIGNMENT, ShardPlan
from .state import FlatState


class HostBuffer:
    """One reusable staging buffer: a uint8 tensor over page-aligned memory."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self._mmap: mmap.mmap | None = None
        if pinned:
            # cudaHostAlloc memory is page-aligned, usable for O_DIRECT writes.
            self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._mmap = mmap.mmap(-1, max(nbytes, ALIGNMENT), flags=flags)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.array: np.ndarray[Any, np.dtype[np.uint8]] = self.tensor.numpy()
        self.aligned = self.tensor.data_ptr() % ALIGNMENT == 0

    def view(self, nbytes: int) -> memoryview:
        return memoryview(self.array[:nbytes])  # type: ignore[arg-type]

    def free(self) -> None:
        del self.array
        del self.tensor
        if self._mmap is not None:
            # BufferError: a view is still alive somewhere; the GC frees the map later.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None


class HostBufferPool:
    """At most `capacity` buffers; `acquire` blocks while all are in flight."""

    def __init__(self, capacity: int) -> None:
        if type(capacity) is not int or capacity < 1:
            raise InvalidArgumentError(f"host_buffers must be an int >= 1, got {capacity!r}")
        self._capacity = capacity
        self._free: list[HostBuffer] = []
        self._count = 0
        self._cond = threading.Condition()
        self.allocations = 0  # how many times memory was (re)allocated: for tests and stats

    def acquire(self, nbytes: int, pinned: bool, timeout: float | None = None) -> HostBuffer:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._count < self._capacity, timeout):
                raise TimeoutError("no host buffer became free in time")
            if self._free:
                buf = max(self._free, key=lambda b: b.nbytes)
                self._free.remove(buf)
                if buf.nbytes >= nbytes and buf.pinned == pinned:
                    return buf
                buf.free()
                self._count -= 1
            self._count += 1
        try:
            buf = HostBuffer(nbytes, pinned)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise
        self.allocations += 1
        return buf

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            if any(b is buf for b in self._free):  # two owners of one buffer would tear saves
                raise RuntimeError("tiercheck internal error: host buffer released twice")
            self._free.append(buf)
            self._cond.notify()

    def clear(self) -> None:
        with self._cond:
            for buf in self._free:
                buf.free()
            self._count -= len(self._free)
            self._free.clear()


class StagingAborted(Exception):
    """The copy into the host buffer failed; `save()` raises the cause to its caller."""


class StageProgress:
    """How much of a host buffer's prefix is already copied. The writer and the checksum
    helper are queued before the copy starts and wait here for the bytes they need.

    The copy reports only its end, not each leaf: a writer or checksum thread woken
    beside the copy's two threads slowed the blocking copy by 10-15% in a training loop
    on two CPU cores (benchmarks, docs/performance.md), more than overlapping the write
    with the copy gained on time to durable."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready = 0
        self._failed = False

    def advance(self, upto: int) -> None:
        with self._cond:
            if upto > self._ready:
                self._ready = upto
                self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def wait(self, upto: int) -> None:
        """Block until bytes [0, upto) are staged; raise StagingAborted if the copy failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready >= upto or self._failed)
            if self._ready < upto:
                raise StagingAborted("the copy into host memory failed")


def needs_pinned(sources: Sequence[object]) -> bool:
    return any(isinstance(s, torch.Tensor) and s.device.type == "cuda" for s in sources)


def stage_into(
    buf: HostBuffer,
    flat: FlatState,
    plan: ShardPlan,
    deferred: bool | None = None,
    progress: StageProgress | None = None,
) -> None:
    """Copy every leaf's bytes into `buf` at the planned offsets; returns when the copy is done.

    `deferred` selects a subset: True copies only the leaves `flat.deferrable` marks, False
    only the others, None all of them. `progress`, for a full copy, is advanced to the
    whole buffer once the copy is done (see `StageProgress` for why not leaf by leaf).

    CUDA tensors are copied on a side stream with non_blocking copies into pinned memory,
    then synchronised once, so the default stream of the training loop is not serialised
    behind the device-to-host transfer.
    """
    cuda_stream = None
    flags = flat.deferrable or (False,) * len(flat.leaves)
    # A deferred copy runs while training goes on: a tensor changed in place since save()
    # (its version counter moved) may have been copied torn, so the step must fail.
    check = deferred is True and bool(flat.versions)
    changed: list[str] = []
    on_device: list[int] = []
    for i, (leaf, src, off, flag) in enumerate(zip(flat.leaves, flat.sources, plan.offsets, flags, strict=True)):
        if leaf.alias_of is not None or leaf.nbytes == 0 or (deferred is not None and flag != deferred):
            continue
        if isinstance(src, torch.Tensor):
            dst = buf.tensor[off : off + leaf.nbytes].view(src.dtype).view(src.shape)
            if src.device.type == "cuda":
                if cuda_stream is None:
                    cuda_stream = torch.cuda.Stream(device=src.device)  # type: ignore[no-untyped-call]
                    cuda_stream.wait_stream(torch.cuda.current_stream(src.device))
                with torch.cuda.stream(cuda_stream):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(cuda_stream)
                on_device.append(i)
            else:
                dst.copy_(src)
                if check and src._version != flat.versions[i]:
                    changed.append(leaf.path)
        elif isinstance(src, np.ndarray):
            dst_np = buf.array[off : off + leaf.nbytes].view(src.dtype).reshape(src.shape)
            np.copyto(dst_np, src, casting="no")
        else:
            assert isinstance(src, bytes)
            buf.array[off : off + leaf.nbytes] = np.frombuffer(src, dtype=np.uint8)
    if cuda_stream is not None:
        cuda_stream.synchronize()
    if check:
        changed += [flat.leaves[i].path for i in on_device if _version(flat.sources[i]) != flat.versions[i]]
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise SnapshotChangedError(
            f"{shown} changed in place while save(overlap=True) was still copying it, so this step "
            "would not be the state at save(): something other than an optimizer in the saved state "
            "modified it. Put that optimizer in the state, or call handle.wait_staged() before "
            "modifying the tensor outside optimizer.step()"
        )
    if progress is not None:
        progress.advance(plan.total_bytes)


def _version(src: object) -> int:
    assert isinstance(src, torch.Tensor)
    return src._version
