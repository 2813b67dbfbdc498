"""Host buffers and the copies into them: the only module that touches CUDA.

A `HostBufferPool` holds at most `capacity` page-aligned buffers (pinned when the state
lives on CUDA). They are allocated on first use, grown only when a state gets larger,
and reused for every later save, so host memory stays flat from save to save.

With tier 0 (`SharedBuffers`), a buffer is a file of a shared-memory filesystem
(`tiers/memory.py`), sized exactly to the part it holds, so that the very bytes a save copies
become tier 0's shard once committed; on CUDA the mapping is registered as pinned memory.
Before such a buffer is overwritten, tier 0 takes back the step it holds.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import InvalidArgumentError, SnapshotChangedError
from ..format import naming
from ..format.tree import Leaf
from ..observe.events import logger
from ..plan.shards import ALIGNMENT, ShardPlan
from ..state.flatten import FlatState
from ..tiers.memory import SharedMemoryTier, ShmBuffer, mapped, space_free


class HostBuffer:
    """One reusable staging buffer: a uint8 tensor over page-aligned memory (a shared-memory
    file's mapping when `shm` is given: tier 0)."""

    def __init__(self, nbytes: int, pinned: bool, shm: ShmBuffer | None = None) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self.shm = shm
        self._mmap: mmap.mmap | None = None
        self._registered = False
        if shm is not None:
            self.tensor = torch.frombuffer(shm.map, dtype=torch.uint8)
            if pinned:  # page-locked for DMA, as cudaHostAlloc memory is
                _host_register(self.tensor)
                self._registered = True
        elif pinned:
            # cudaHostAlloc memory is page-aligned, usable for O_DIRECT writes.
            self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        else:
            self._mmap = mapped(-1, max(nbytes, ALIGNMENT), mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self.array: np.ndarray[Any, np.dtype[np.uint8]] = self.tensor.numpy()
        self.aligned = self.tensor.data_ptr() % ALIGNMENT == 0
        # The views of the last structure copied into this buffer (`layout_for`).
        self.layout: tuple[tuple[object, ...], dict[bool | None, _Group]] | None = None
        # The writer's texts of the manifest entries of the last structure written from it
        # (`steps.write`: leaves, plan, shard name, the texts).
        self.entry_texts: tuple[object, object, str, list[tuple[str, str]] | None] | None = None
        self.tree_text: tuple[object, str] | None = None  # (tree, its JSON text), likewise

    def view(self, nbytes: int) -> memoryview:
        return memoryview(self.array[:nbytes])  # type: ignore[arg-type]

    def free(self) -> None:
        self.layout = None  # its views keep the memory alive
        self.entry_texts = None
        self.tree_text = None
        if self._registered:
            _host_unregister(self.tensor)
            self._registered = False
        del self.array
        del self.tensor
        if self._mmap is not None:
            # BufferError: a view is still alive somewhere; the GC frees the map later.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None


def _host_register(t: torch.Tensor) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)  # type: ignore[no-untyped-call]
    if int(rc) != 0:
        raise RuntimeError(f"cudaHostRegister of a {t.numel()}-byte tier-0 buffer failed: error {int(rc)}")


def _host_unregister(t: torch.Tensor) -> None:
    with contextlib.suppress(Exception):
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())  # type: ignore[no-untyped-call]


class SharedBuffers:
    """Where the pool's buffers come from when tier 0 is on: files of `tier`'s
    shared-memory filesystem. A filesystem that is missing, too small or full turns tier 0
    off with one warning naming the size needed; the pool then allocates private memory and
    saves go on to the other tiers.

    Args:
        tier: this job's tier 0.
        rank: the rank whose buffers these are.
        copies: how many shards of this rank tier 0 may hold at once (host buffers, plus the
            replicas it receives): the space a first buffer checks for.
    """

    def __init__(self, tier: SharedMemoryTier, rank: int, copies: int) -> None:
        self.tier = tier
        self.rank = rank
        self.copies = copies
        self.enabled = True
        self.reason: str | None = None

    def new(self, nbytes: int) -> ShmBuffer | None:
        if not self.enabled or nbytes < 1:
            return None
        try:
            # What this rank will still allocate, this buffer included: the ones it holds
            # already took their room when they were made.
            need = nbytes * max(1, self.copies - self.tier.buffer_count)
            free = space_free(self.tier.memory_dir)
            if free < need:
                raise OSError(
                    28, f"{self.copies} shard(s) of {nbytes} bytes need {need} bytes, {free} are free"
                )
            return self.tier.new_buffer(self.rank, nbytes)
        except (OSError, ValueError) as exc:
            self.disable(str(exc) if isinstance(exc, ValueError) else f"{exc.strerror or exc}")
            return None

    def disable(self, why: str) -> None:
        if not self.enabled:
            return
        self.enabled = False
        self.reason = why
        logger.warning(
            "tiercheck: tier 0 (memory) is off for rank %d: %s (%s). Saves go on to the other tiers; "
            "give it room (memory_dir=, a larger /dev/shm, fewer host_buffers/keep_memory) to turn it on",
            self.rank,
            why,
            self.tier.memory_dir,
        )


class HostBufferPool:
    """At most `capacity` buffers; `acquire` blocks while all are in flight."""

    def __init__(self, capacity: int, shared: SharedBuffers | None = None) -> None:
        if type(capacity) is not int or capacity < 1:
            raise InvalidArgumentError(f"host_buffers must be an int >= 1, got {capacity!r}")
        self.shared = shared
        self._capacity = capacity
        self._free: list[HostBuffer] = []
        self._count = 0
        self._cond = threading.Condition()
        self.allocations = 0  # how many times memory was (re)allocated: for tests and stats

    def acquire(self, nbytes: int, pinned: bool, timeout: float | None = None) -> HostBuffer:
        with self._cond:
            if not self._cond.wait_for(lambda: self._free or self._count < self._capacity, timeout):
                raise TimeoutError("no host buffer became free in time")
            if self._free and not self._grow_instead(nbytes, pinned):
                buf = self._pick(nbytes, pinned)
                self._free.remove(buf)
                if self._fits(buf, nbytes, pinned):
                    if buf.shm is not None and self.shared is not None:
                        self.shared.tier.take_back(buf.shm)  # marker first, then it is ours again
                    return buf
                self._free_one(buf)
                self._count -= 1
            self._count += 1
        try:
            shm = self.shared.new(nbytes) if self.shared is not None else None
            buf = HostBuffer(nbytes, pinned, shm)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise
        self.allocations += 1
        return buf

    def _fits(self, buf: HostBuffer, nbytes: int, pinned: bool) -> bool:
        if buf.pinned != pinned:
            return False
        if buf.shm is not None:  # tier 0's shard is the whole file: exactly the part's size
            return buf.nbytes == nbytes
        if self.shared is not None and self.shared.enabled and nbytes > 0:
            return False  # tier 0 is on: trade a private buffer for a shared one
        return buf.nbytes >= nbytes

    def _grow_instead(self, nbytes: int, pinned: bool) -> bool:
        """With tier 0 on, a new buffer (while under capacity) rather than overwriting one
        that holds a committed tier-0 step: the newest step stays in memory while the next
        is copied."""
        if self._count >= self._capacity or self.shared is None or not self.shared.enabled:
            return False
        return all(_held_step(b) >= 0 for b in self._free if self._fits(b, nbytes, pinned))

    def _pick(self, nbytes: int, pinned: bool) -> HostBuffer:
        """A free buffer to reuse or replace: one that fits, holding no tier-0 step or the
        oldest one (tier 0 keeps its newest steps longest); else the largest."""
        fitting = [b for b in self._free if self._fits(b, nbytes, pinned)]
        if fitting:
            return min(fitting, key=_held_step)
        return max(self._free, key=lambda b: b.nbytes)

    def _free_one(self, buf: HostBuffer) -> None:
        buf.free()
        if buf.shm is not None and self.shared is not None:
            self.shared.tier.forget_buffer(buf.shm)

    @property
    def capacity(self) -> int:
        return self._capacity

    def available(self) -> bool:
        """Whether `acquire` would return at once (a free buffer, or room for a new one)."""
        with self._cond:
            return bool(self._free) or self._count < self._capacity

    def release(self, buf: HostBuffer) -> None:
        with self._cond:
            if any(b is buf for b in self._free):  # two owners of one buffer would tear saves
                raise RuntimeError("tiercheck internal error: host buffer released twice")
            self._free.append(buf)
            self._cond.notify()

    def clear(self) -> None:
        with self._cond:
            for buf in self._free:
                self._free_one(buf)
            self._count -= len(self._free)
            self._free.clear()


def _held_step(buf: HostBuffer) -> int:
    """The step tier 0 holds in `buf` (-1: none), to reuse the oldest first."""
    if buf.shm is None:
        return -1
    step = naming.parse_step_dir(os.path.basename(os.path.dirname(buf.shm.path)))
    return -1 if step is None else step


class StagingAborted(Exception):
    """The copy into the host buffer failed; `save()` raises the cause to its caller."""


class StageProgress:
    """How much of a host buffer's prefix is already copied, and whether `save()` let the
    writer go on. The writer waits here before it does anything with the step (the
    checksum tasks are queued after that), and `save()` queues it only once the copy ended
    or failed: the copy runs with no other thread of tiercheck's awake.

    The copy reports only its end, not each leaf: a writer or checksum thread woken
    beside the copy's two threads slowed the blocking copy by 10-15% in a training loop
    on two CPU cores (benchmarks, docs/performance.md), more than overlapping the write
    with the copy gained on time to durable; a writer woken only to open the step beside
    the copy still took the GIL from its end (`SaveStager._stage_now`)."""

    def __init__(self, held: bool = False) -> None:
        self._cond = threading.Condition()
        self._ready = 0
        self._failed = False
        self._held = held

    def advance(self, upto: int) -> None:
        with self._cond:
            if upto > self._ready:
                self._ready = upto
                if not self._held:
                    self._cond.notify_all()

    def release(self) -> None:
        """Let the waiters see the copied bytes (a progress made `held`): `save()` releases its
        step's when it returns, so that the writer's Python (the manifest of every leaf, the
        checksums of many small ones) does not take the GIL from the end of `save()`. Begun
        beside it, at 20,000 leaves, it made `save()` return 0.1 to 0.3 s later (a switch
        interval per GIL hand-off, and the collections its allocations set off)."""
        with self._cond:
            if self._held:
                self._held = False
                self._cond.notify_all()

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def wait(self, upto: int) -> None:
        """Block until bytes [0, upto) are staged; raise StagingAborted if the copy failed."""
        with self._cond:
            self._cond.wait_for(lambda: (self._ready >= upto and not self._held) or self._failed)
            if self._ready < upto or self._held:
                raise StagingAborted("the copy into host memory failed")


def needs_pinned(sources: Sequence[object]) -> bool:
    return any(isinstance(s, torch.Tensor) and s.device.type == "cuda" for s in sources)


# Copies per torch._foreach_copy_ call of a deferred copy, and bytes per call: small enough
# that a deferred copy checks the version counters soon after each tensor's copy, large
# enough that the per-call cost vanishes. A copy before save() returns is bounded by bytes
# only: between two calls a writer thread may take the GIL for a switch interval (5 ms).
_BATCH_LEAVES = 1024
_BATCH_BYTES = 64 << 20


@dataclass(slots=True)
class _Group:
    """The leaves one `stage_into` call copies, by how they are copied, with their
    destination views in the buffer and the batches the CPU and CUDA copies run in."""

    cpu: list[int] = field(default_factory=list)
    cpu_dst: list[torch.Tensor] = field(default_factory=list)
    cpu_batches: list[tuple[int, int]] = field(default_factory=list)
    cuda: list[int] = field(default_factory=list)
    cuda_dst: list[torch.Tensor] = field(default_factory=list)
    cuda_batches: list[tuple[int, int]] = field(default_factory=list)
    other: list[tuple[int, Any]] = field(default_factory=list)  # numpy arrays and bytes
    all_sources: bool = False  # cpu == range(len(sources)): no gathering needed


def _batches(leaves: Sequence[Leaf], idx: list[int], max_leaves: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    start, nbytes = 0, 0
    for j, i in enumerate(idx):
        if j > start and (j - start >= max_leaves or nbytes + leaves[i].nbytes > _BATCH_BYTES):
            out.append((start, j))
            start, nbytes = j, 0
        nbytes += leaves[i].nbytes
    if start < len(idx):
        out.append((start, len(idx)))
    return out


def _build_layout(buf: HostBuffer, flat: FlatState, plan: ShardPlan) -> dict[bool | None, _Group]:
    groups: dict[bool | None, _Group] = {None: _Group(), False: _Group(), True: _Group()}
    flags = flat.deferrable or (False,) * len(flat.leaves)
    for i, (leaf, src, off, flag) in enumerate(zip(flat.leaves, flat.sources, plan.offsets, flags, strict=True)):
        if leaf.alias_of is not None or leaf.nbytes == 0:
            continue
        dst: Any
        if isinstance(src, torch.Tensor):
            dst = buf.tensor[off : off + leaf.nbytes].view(src.dtype).view(src.shape)
        elif isinstance(src, np.ndarray):
            dst = buf.array[off : off + leaf.nbytes].view(src.dtype).reshape(src.shape)
        else:
            dst = buf.array[off : off + leaf.nbytes]
        for g in (groups[None], groups[flag]):
            if not isinstance(src, torch.Tensor):
                g.other.append((i, dst))
            elif src.device.type == "cuda":
                g.cuda.append(i)
                g.cuda_dst.append(dst)
            else:
                g.cpu.append(i)
                g.cpu_dst.append(dst)
    for key, g in groups.items():
        max_leaves = _BATCH_LEAVES if key is True else len(flat.leaves)
        g.cpu_batches = _batches(flat.leaves, g.cpu, max_leaves)
        g.cuda_batches = _batches(flat.leaves, g.cuda, max_leaves)
        g.all_sources = g.cpu == list(range(len(flat.sources)))
    return groups


def layout_for(buf: HostBuffer, flat: FlatState, plan: ShardPlan) -> dict[bool | None, _Group]:
    """The destination views and copy groups of `flat` in `buf`, built once per structure.

    Reused while `flat.leaves`, `flat.deferrable` and `plan` are the very objects they were
    built for: only `structure.StructureCache` hands out the same leaves tuple again, and
    only after checking that every source still has the dtype, shape and device the views
    were made for. A fresh `flatten_state` makes new tuples, so new views."""
    key = (flat.leaves, flat.deferrable, plan)
    cached = buf.layout
    if cached is not None and all(a is b for a, b in zip(cached[0], key, strict=True)):
        return cached[1]
    groups = _build_layout(buf, flat, plan)
    buf.layout = (key, groups)
    return groups


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

    Tensors are copied with ``torch._foreach_copy_`` in batches (`_BATCH_BYTES`), into
    views built once per structure (`layout_for`): a state of many small tensors costs one
    call per batch, not one per tensor. Each copy is a ``copy_`` between tensors of the same
    dtype and shape, so bit-exact for every dtype; non-contiguous sources are read through
    their strides. CUDA tensors are copied on a side stream with non_blocking copies into
    pinned memory, then synchronised once, so the default stream of the training loop is
    not serialised behind the device-to-host transfer.
    """
    group = layout_for(buf, flat, plan)[deferred]
    # A deferred copy runs while training goes on: a tensor changed in place since save()
    # (its version counter moved) may have been copied torn, so the step must fail.
    check = deferred is True
    if check and len(flat.versions) != len(flat.leaves):
        raise RuntimeError("tiercheck internal error: a deferred copy without the version counters")
    changed: list[str] = []
    with torch.no_grad():
        _copy_cpu(group, flat, changed if check else None)
        if group.cuda:
            _copy_cuda(group, flat, changed if check else None)
        for i, dst in group.other:
            src = flat.sources[i]
            if isinstance(src, np.ndarray):
                np.copyto(dst, src, casting="no")
            else:
                assert isinstance(src, bytes)
                dst[:] = np.frombuffer(src, dtype=np.uint8)
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


def _changed(flat: FlatState, idx: list[int], srcs: Sequence[torch.Tensor]) -> list[str]:
    """The paths of `srcs` (leaves `idx`) whose version counter moved since save()."""
    now = [s._version for s in srcs]
    then = [flat.versions[i] for i in idx]
    if now == then:
        return []
    return [flat.leaves[i].path for i, a, b in zip(idx, now, then, strict=True) if a != b]


def _copy_cpu(group: _Group, flat: FlatState, changed: list[str] | None) -> None:
    idx = group.cpu
    if not idx:
        return
    sources = flat.sources
    srcs: Sequence[Any] = sources if group.all_sources else [sources[i] for i in idx]
    for a, b in group.cpu_batches:
        part = list(srcs[a:b])
        torch._foreach_copy_(group.cpu_dst[a:b], part)
        if changed is not None:
            changed += _changed(flat, idx[a:b], part)


def _copy_cuda(group: _Group, flat: FlatState, changed: list[str] | None) -> None:
    srcs: list[Any] = [flat.sources[i] for i in group.cuda]
    device = srcs[0].device
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for a, b in group.cuda_batches:
            torch._foreach_copy_(group.cuda_dst[a:b], srcs[a:b], non_blocking=True)
        for s in srcs:
            s.record_stream(stream)
    stream.synchronize()
    if changed is not None:
        changed += _changed(flat, group.cuda, srcs)
