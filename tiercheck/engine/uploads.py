"""The tier-2 side of the pipeline: the uploader thread, the backlog policy, the catch-up
upload of an earlier run's steps, and the steps tier 1 keeps for tier 2.

The uploader copies committed tier-1 steps to tier 2 (`steps.upload`), or, without a tier 1
(or after a tier-1 failure), writes staged saves straight from the host buffer. When it
falls behind (``upload_backlog="newest"``), it skips the waiting steps that tier-2
retention would delete anyway; a step tier 2 would keep is always uploaded. Such a step
stays on tier 1 until it is on tier 2: while it waits for its upload, and after a failed
upload (the next session's catch-up uploads it). `protected` tells tier-1 retention which
steps those are. Deleting a step a catch-up upload is copying waits for that upload.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import StepInFlightError, TierError, UploadSkippedError, tier_error
from ..job.coordination import Membership
from ..observe.events import logger
from ..plan.retarget import Key
from ..plan.retention import KeepAll, plan_catch_up, superseded
from ..steps.handle import SaveHandle
from ..steps.prune import Pruner
from ..steps.stage import HostBufferPool, StagingAborted
from ..steps.upload import copy_from_local, uploaders_of
from ..steps.write import StagedSave
from ..tiers.base import Tier
from .tracking import Tracker
from .workers import Worker

__all__ = ["Uploads"]


@dataclass(frozen=True, slots=True)
class _Upload:
    """Copy a step committed on tier 1 to tier 2."""

    step: int
    rank: int
    handle: SaveHandle | None  # None: a catch-up upload of a step from an earlier run
    remote_owners: tuple[tuple[Key, int], ...] = ()


@dataclass(frozen=True, slots=True)
class _CatchUp:
    """Upload the tier-1 steps an earlier run never uploaded that tier 2 would keep."""


@dataclass(frozen=True, slots=True)
class _SideTask:
    """A small tier-2 write that is not a step (the run log, without a tier 1); it handles
    its own errors."""

    run: Callable[[], None]


class Uploads:
    """The uploader worker and the state it shares with tier-1 retention and deletions,
    guarded by the tracker's lock.

    Args:
        fast, durable: tier 1 (or None) and tier 2.
        pool: the host buffers (a save written from its buffer releases it here).
        tracker, pruner, group: the pipeline's.
        backlog: ``upload_backlog`` ("newest" or "all").
        low_priority: run the uploader at the lowest I/O priority.
        write_from_buffer: the pipeline's write of a staged save to a tier (`Pipeline`).
        prune_fast: queue a tier-1 retention pass (a step lost its protection).
    """

    def __init__(
        self,
        fast: Tier | None,
        durable: Tier,
        *,
        pool: HostBufferPool,
        tracker: Tracker,
        pruner: Pruner,
        group: Membership,
        backlog: str,
        low_priority: bool,
        write_from_buffer: Callable[[Tier, StagedSave, str], TierError | None],
        prune_fast: Callable[[], None],
    ) -> None:
        self.fast = fast
        self.durable = durable
        self._pool = pool
        self._tracker = tracker
        self._lock = tracker.lock
        self._idle = tracker.idle
        self._pruner = pruner
        self._group = group
        self._backlog = backlog
        self._write_from_buffer = write_from_buffer
        self._prune_fast = prune_fast
        self._uploading: int | None = None  # also protects a catch-up upload from tier-1 pruning
        # Tier-1 steps tier 2 still needs that no handle tracks: catch-up uploads not yet
        # attempted, and failed uploads that tier-2 retention would keep (`_settle_owed`).
        # Tier-1 retention never deletes them.
        self._catching_up: set[int] = set()
        self._owed: set[int] = set()
        # Steps `delete_step` was asked to delete while a catch-up upload (which no handle
        # tracks, so no caller can wait for it) was copying them: deleted when it ends.
        self._delete_after_upload: set[int] = set()
        self.worker = Worker("tiercheck-uploader", self._run, self._idle, low_priority)

    # -- queueing (any thread) ---------------------------------------------------------

    def catch_up(self) -> None:
        self.worker.put(_CatchUp())

    def side_task(self, run: Callable[[], None]) -> None:
        self.worker.put(_SideTask(run))

    def from_buffer(self, job: StagedSave) -> None:
        """Write `job` to tier 2 from its host buffer (no tier 1, or tier 1 failed)."""
        self.worker.put(job)

    def upload(self, job: StagedSave) -> None:
        """Queue the upload of `job`'s step, just committed on tier 1; under the "newest"
        policy, drop right away the waiting uploads (not the one in progress) that tier-2
        retention would delete anyway once the newer steps are there, so their steps lose
        tier-1 protection now rather than when the uploader gets to them. A step tier 2
        would keep (a `KeepEvery` milestone, one of `KeepLast(n)`'s n newest, any step under
        `KeepAll`) is never dropped: with keep_remote=KeepLast(n), tier 1 holds at most the
        step being uploaded, n waiting, and the milestones among them."""
        upload = _Upload(job.step, job.rank, job.handle, job.remote_owners)
        dropped: list[_Upload] = []
        if self._backlog == "newest":
            with self._lock:
                uploading = self._uploading
            queue = self.worker
            with queue.cond:
                waiting = [q.step for q in queue.queue if isinstance(q, _Upload) and q.step < upload.step]
                others = [upload.step] + [q.step for q in queue.queue if isinstance(q, StagedSave)]
                if uploading is not None:
                    others.append(uploading)
                doomed = set(superseded(waiting, self._pruner.policy(self.durable), others))
                keep: deque[object] = deque()
                for q in queue.queue:
                    if isinstance(q, _Upload) and q.step in doomed:
                        dropped.append(q)
                    else:
                        keep.append(q)
                queue.queue = keep
            if dropped:
                with self._idle:
                    queue.unfinished -= len(dropped)
                    self._catching_up.difference_update(q.step for q in dropped)
        self.worker.put(upload)
        for q in dropped:  # the tier-1 writer prunes right after queueing this upload
            self._skip(q)

    def _skip(self, item: _Upload) -> None:
        if item.handle is not None:
            self._tracker.finish(
                item.step,
                self.durable.name,
                UploadSkippedError(
                    f"step {item.step} was not uploaded to tier {self.durable.name!r}: uploads were behind "
                    "and newer steps superseded it, so tier-2 retention would delete it anyway "
                    "(upload_backlog='newest')"
                ),
            )

    def protected(self) -> set[int]:
        """Tier-1 steps tier 2 still needs beyond those in flight: being uploaded, queued for
        a catch-up upload, or failed to upload while tier 2 would keep them."""
        with self._lock:
            steps = self._catching_up | self._owed
            if self._uploading is not None:
                steps.add(self._uploading)
        return steps

    def forget_owed(self, committed: list[int]) -> None:
        """A failed upload deleted from tier 1 since (a new branch): nothing to keep for it."""
        with self._lock:
            self._owed.intersection_update(committed)

    # -- the uploader thread -------------------------------------------------------------

    def _run(self, item: object) -> None:
        tier = self.durable
        if isinstance(item, _CatchUp):
            self._catch_up(tier)
        elif isinstance(item, _SideTask):
            item.run()
        elif isinstance(item, StagedSave):
            self._run_from_buffer(tier, item)
        else:
            assert isinstance(item, _Upload)
            self._run_upload(tier, item)

    def _run_from_buffer(self, tier: Tier, item: StagedSave) -> None:
        try:
            error = self._write_from_buffer(tier, item, "uploading")
        except StagingAborted:
            return
        self._pool.release(item.buffer)
        self._tracker.finish(item.step, tier.name, error)
        if error is None:
            self._tracker.report(self._prune(tier, item.step))
            if self._settle_owed(tier, listed=True):
                self._prune_fast()

    def _run_upload(self, tier: Tier, item: _Upload) -> None:
        error = None
        with self._lock:
            if item.step in self._pruner.deleting:  # a catch-up upload of a step being deleted
                self._catching_up.discard(item.step)
                return
            self._uploading = item.step
        try:
            if item.handle is None and self.fast is not None and item.step not in self.fast.committed_steps():
                return  # a catch-up upload of a step deleted since (`finally` clears `_uploading`)
            self._copy_from_local(item.step, item.rank, dict(item.remote_owners))
        except Exception as exc:
            error = tier_error(exc, item.step, tier, "uploading")
        finally:
            with self._lock:
                self._uploading = None
                self._idle.notify_all()  # a branch deletion may wait for this upload (`delete_branch`)
                self._catching_up.discard(item.step)
                if error is not None:  # before the step leaves the in-flight list
                    self._owed.add(item.step)
                doomed = item.step in self._delete_after_upload
                self._delete_after_upload.discard(item.step)
            if doomed:
                self._delete_deferred(item.step)
        if item.handle is not None:
            item.handle.stats.tier_s[tier.name] = time.monotonic() - item.handle.started_at
            self._tracker.finish(item.step, tier.name, error)
        elif error is not None:
            self._tracker.report(error)
        if error is None:
            self._tracker.report(self._prune(tier, item.step))
        self._settle_owed(tier, listed=error is None)
        self._prune_fast()  # the step is off tier 1's protection list now

    def _prune(self, tier: Tier, newest: int) -> TierError | None:
        return self._pruner.prune(tier, newest, lambda: self._tracker.in_flight(tier.name))

    def _settle_owed(self, tier: Tier, listed: bool) -> bool:
        """Keep on tier 1 only the failed uploads tier-2 retention would still keep, given the
        steps known for tier 2: those in flight and, when `listed` (tier 2 just worked), its
        listing. A failed milestone stays until a later session uploads it; a failed step that
        `KeepLast` alone kept is released once enough newer steps exist. True if any was."""
        with self._lock:
            if not self._owed or isinstance(self._pruner.policy(tier), KeepAll):
                return False
        listing: list[int] = []
        if listed:
            try:
                listing = tier.committed_steps()
            except Exception as exc:
                logger.warning("tiercheck: could not list tier %s: %r", tier.name, exc)
        with self._lock:
            before = len(self._owed)
            self._owed.difference_update(listing)
            others = set(listing) | set(self._tracker.pending(tier.name))
            if self._uploading is not None:
                others.add(self._uploading)
            self._owed.difference_update(superseded(self._owed, self._pruner.policy(tier), others))
            return len(self._owed) != before

    def _catch_up(self, tier: Tier) -> None:
        """Upload the tier-1 steps an earlier run committed but never uploaded (a kill, a
        failed upload) that tier-2 retention would keep, milestones included. In a job, rank
        0 picks the steps (among those on every rank's tier 1) and every rank uploads its
        part of each."""
        assert self.fast is not None
        try:
            mine = self.fast.committed_steps()
        except Exception as exc:  # a job still takes part in the agreement, with nothing
            logger.warning("tiercheck: could not list tier 1 at start-up: %r", exc)
            mine = []

        planned: list[int] = []

        def plan(common: set[int]) -> list[int]:
            if not common:
                return []  # nothing to compare: tier 2 is not listed
            remote = tier.committed_steps()
            with self._lock:  # protected from tier-1 retention as soon as they are chosen
                planned[:] = plan_catch_up(common, remote, self._pruner.policy(tier), list(self._tracker.tracks))
                self._catching_up.update(planned)
            return list(planned)

        try:
            steps = self._group.agree_catch_up(mine, plan)
        except Exception as exc:
            logger.warning("tiercheck: no catch-up upload at start-up: %r", exc)
            with self._lock:
                self._catching_up.difference_update(planned)
            return
        for step in steps:
            owners: dict[Key, int] = {}
            if self._group.node_local:  # tier 2 gets one copy of the replicated keys, as for any step
                try:
                    owners = uploaders_of(self.fast, step, self._group)
                except Exception as exc:
                    logger.warning("tiercheck: no catch-up upload of step %d: %r", step, exc)
                    with self._lock:
                        self._catching_up.discard(step)
                    continue
            logger.info("uploading step %d, committed on tier 1 by an earlier run but not on tier 2", step)
            with self._lock:
                self._catching_up.add(step)
            self.worker.put(_Upload(step, self._group.rank, None, tuple(owners.items())))

    def _copy_from_local(self, step: int, rank: int, owners: dict[Key, int]) -> None:
        src, dst = self.fast, self.durable
        assert src is not None
        marker = copy_from_local(
            src, dst, step, rank, owners, self._group, lambda: self._tracker.first_report(step, dst.name)
        )
        self._pruner.remember_metrics(dst, step, marker.metrics)

    # -- deletions that meet a catch-up upload --------------------------------------------

    def delete_step(self, step: int, tiers: list[Tier]) -> None:
        """`Pipeline.delete_step`: a step a catch-up upload is copying is deleted when it ends."""
        tracks = self._tracker.tracks
        while True:
            with self._lock:
                if self._uploading == step and step not in tracks:
                    self._delete_after_upload.add(step)  # a catch-up upload: deleted when it ends
                    return
            try:
                self._pruner.delete_step(step, tiers, lambda s: s in tracks or self._uploading == s)
                return
            except StepInFlightError:
                with self._lock:
                    if step in tracks or self._uploading != step:
                        raise
                # else a catch-up upload of it started meanwhile: defer, as above

    def delete_branch(self, steps: Sequence[int], tiers: list[Tier]) -> None:
        """`Pipeline.delete_branch`: a catch-up upload copying one of `steps` is waited for."""

        def wait_copies(doomed: set[int]) -> None:
            with self._idle:
                self._idle.wait_for(lambda: self._uploading not in doomed)

        self._pruner.delete_branch(steps, tiers, wait_copies)

    def _delete_deferred(self, step: int) -> None:
        """Delete `step` (its catch-up upload just ended) from every tier this rank deletes
        from that holds it now, tier 2 included if the upload committed it there."""
        tiers = [t for t in (self.fast, self.durable) if t is not None and self._group.leads(t.name)]
        try:
            tiers = [t for t in tiers if step in t.committed_steps()]
            self._pruner.delete_step(step, tiers, lambda s: s in self._tracker.tracks)
        except StepInFlightError:  # saved again meanwhile (a new branch): that save's now
            logger.info("tiercheck: not deleting step %d after its upload: it is being saved again", step)
        except TierError as exc:
            self._tracker.report(exc)
        except Exception as exc:
            logger.warning("tiercheck: could not delete step %d after its upload: %r", step, exc)
