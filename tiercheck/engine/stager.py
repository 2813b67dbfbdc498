"""Staging a save on the caller's thread: copy this rank's planned part into a host buffer
and hand it to the pipeline.

Without overlap the writer starts at once (it opens the step meanwhile) and writes once the
copy is done. With overlap (`Checkpointer.save(overlap=True)`), only what no optimizer
guards is copied here; the rest is copied on the pipeline's stager thread while training
goes on, and each optimizer in the state gets a pre-step hook that waits for that copy, so
the saved step is still exactly the state at `save()`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..format.manifest import Metric
from ..plan.settings import JobOptions, SaveOptions
from ..state.flatten import FlatState, tensor_versions
from ..steps.handle import SaveHandle
from ..steps.parts import Part
from ..steps.stage import HostBufferPool, StageProgress, layout_for, stage_into
from ..steps.write import StagedSave
from .pipeline import Pipeline

__all__ = ["SaveStager"]


class SaveStager:
    """Copies planned parts into the pool's host buffers and submits them. Called from the
    caller's thread, under the Checkpointer's lock.

    Args:
        pool: the host buffers.
        pipeline: where staged saves go.
        save: the default of ``overlap``.
        job: this rank and the job's size (written into every part).
        tiers: the names of the tiers a save goes to (its handle waits for each).
    """

    def __init__(
        self, pool: HostBufferPool, pipeline: Pipeline, save: SaveOptions, job: JobOptions, tiers: Sequence[str]
    ) -> None:
        self._pool = pool
        self._pipeline = pipeline
        self._overlap = save.overlap
        self._rank = job.rank
        self._world_size = job.world_size
        self._tiers = list(tiers)
        self._warned_unguarded = False
        self._guards: dict[int, tuple[weakref.ref[torch.optim.Optimizer], Any]] = {}
        self._pid = os.getpid()
        self._held: StageProgress | None = None  # the last step's progress, until `release`

    def prepare(self, part: Part) -> None:
        """Allocate every host buffer for `part` (up to `host_buffers`: with tier 0 the
        second is the one the next save copies into while the first holds tier 0's step) and
        build their views, ahead of the first saves."""
        held = []
        try:
            for _ in range(self._pool.capacity):
                if not self._pool.available():
                    break
                buf = self._pool.acquire(part.plan.total_bytes, part.pinned)
                held.append(buf)
                layout_for(buf, part.flat, part.plan)
        finally:
            for buf in held:
                self._pool.release(buf)

    def stage(
        self, step: int, part: Part, metrics: tuple[tuple[str, Metric], ...], overlap: bool | None
    ) -> SaveHandle:
        """Copy `part` as `step` and submit it; returns its handle, with the staging stats.
        If this raises, the pipeline does not hold the step (the caller may retry it)."""
        handle = SaveHandle(step, self._tiers, self._pipeline.error_seen, self._pipeline.call_soon)
        allocations = self._pool.allocations
        t1 = time.perf_counter()
        buf = self._pool.acquire(part.plan.total_bytes, part.pinned)
        t2 = time.perf_counter()
        overlapped = self._overlapped(part.flat, overlap)
        flat = part.flat
        if overlapped and not flat.versions:  # the deferred copy compares them
            flat = dataclasses.replace(flat, versions=tensor_versions(flat.sources))
        job = StagedSave(
            step=step,
            rank=self._rank,
            world_size=self._world_size,
            tree=part.flat.tree,
            leaves=part.flat.leaves,
            plan=part.plan,
            buffer=buf,
            handle=handle,
            progress=None if overlapped else StageProgress(held=True),
            replicated=part.replicated,
            remote_owners=part.remote_owners,
            metrics=metrics,
        )
        if overlapped:
            self._stage_overlapped(job, flat)
        else:
            self._held = job.progress  # released by `release` (a failed copy fails it first)
            self._stage_now(job, flat)
        stats = handle.stats
        stats.bytes = part.plan.total_bytes
        stats.allocated = self._pool.allocations != allocations
        stats.buffer_wait_s = t2 - t1
        stats.stage_s = time.perf_counter() - t2
        return handle

    def release(self) -> None:
        """The end of `save()`: the writer may go on with the step staged last (its progress
        was held so that the writer's Python does not compete with the rest of `save()`)."""
        held, self._held = self._held, None
        if held is not None:
            held.release()

    def wants_overlap(self, overlap: bool | None) -> bool:
        """`save(overlap=)` with the Checkpointer's default for None."""
        return self._overlap if overlap is None else overlap

    def _overlapped(self, flat: FlatState, overlap: bool | None) -> bool:
        """Whether this save defers the copy of optimizer-guarded tensors (`save(overlap=)`)."""
        wants_overlap = self.wants_overlap(overlap)
        if wants_overlap and flat.unguarded and not self._warned_unguarded:
            self._warned_unguarded = True
            warnings.warn(
                f"tiercheck: save(overlap=True): no optimizer in the saved state updates "
                f"{len(flat.unguarded)} module parameter(s) ({flat.unguarded[0]}, ...); they are "
                "copied before save() returns, since nothing would hold their writer back. Put "
                "the optimizer in the state to overlap their copy with training",
                RuntimeWarning,
                stacklevel=4,  # the caller of Checkpointer.save
            )
        return wants_overlap and any(flat.deferrable)

    def _stage_overlapped(self, job: StagedSave, flat: FlatState) -> None:
        try:
            with self._pipeline.copying():
                stage_into(job.buffer, flat, job.plan, deferred=False)
        except BaseException:
            self._pool.release(job.buffer)
            raise
        self._guard(flat.optimizers)
        job.handle._staged.clear()
        self._pipeline.submit(job, finish_staging=flat)

    def _stage_now(self, job: StagedSave, flat: FlatState) -> None:
        # The copy first, then the writer hears of the step. Queued before the copy, the
        # writer woke beside it and ran its Python (the space check, opening the step,
        # queueing the checksums) while the copy had let the GIL go; the copy then waited
        # for the GIL back: a save of 100 x 4 KiB stalled 0.8 ms instead of 0.45 ms
        # (docs/performance.md). The writer does nothing before `release` either.
        assert job.progress is not None
        try:
            with self._pipeline.copying():
                stage_into(job.buffer, flat, job.plan, progress=job.progress)
        except BaseException:
            # The writer still gets the step, to drop it (and, in a job, to take part in the
            # exchange of tier-0 copies): queued, taken off the in-flight list before the
            # writer hears that the copy failed (a retry of this step, after Ctrl-C say,
            # must not meet it there), then failed.
            try:
                self._pipeline.submit(job)
            except BaseException:
                self._pool.release(job.buffer)  # closed: no writer will drop it
            else:
                self._pipeline.forget_unstaged(job)
                job.progress.fail()
            raise
        self._pipeline.submit(job)

    def _guard(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Make each optimizer wait for an overlapped copy before it changes anything."""
        pipeline = weakref.ref(self._pipeline)  # no cycle: the optimizer may outlive us
        pid = self._pid

        def wait_for_copy(optimizer: object, args: object, kwargs: object) -> None:
            p = pipeline()
            if p is not None and os.getpid() == pid:  # a fork() child has no copy to wait for
                p.wait_staged()

        for opt in optimizers:
            known = self._guards.get(id(opt))
            if known is not None and known[0]() is opt:
                continue
            self._guards[id(opt)] = (weakref.ref(opt), opt.register_step_pre_hook(wait_for_copy))

    def unguard(self) -> None:
        """Remove the optimizers' pre-step hooks (at close)."""
        for _, hook in self._guards.values():
            hook.remove()
        self._guards.clear()
