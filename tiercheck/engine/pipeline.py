"""Background work: the pipeline's threads, queues, per-step tracking and backlog policy.

Two workers, one per tier role, each draining its own queue:

* the writer of the fast tier (tier 1) takes staged saves in order. For each step it
  checksums the host buffer on a helper thread while it writes the shard (`writestep`),
  commits it (`commit`), returns the host buffer to the pool, hands the step to the
  uploader and applies tier-1 retention (`pruner`);
* the uploader copies committed tier-1 steps to the durable tier (tier 2; `upload`), or,
  without a tier 1, writes staged saves straight from the host buffer. When it falls behind
  (``upload_backlog="newest"``), it skips the waiting steps that tier-2 retention would
  delete anyway; a step tier 2 would keep is always uploaded.

A step tier-2 retention would keep stays on tier 1 until it is on tier 2: while it waits
for its upload, and after a failed upload (the next session's catch-up uploads it).

Threads (docs/design.md lists every module that starts one): the two workers, a stager
for overlapped saves, the checksum helper, and a callback worker started at the first
`SaveHandle.add_done_callback`, so a slow callback never holds the writer or the uploader.
Outside this module only two helpers run threads, each joined before its call returns:
the object-store tier's per-call timeout (`tiers.remote`) and restore's checksum helper
(`restore`).

A session only reads until `become_writer` (its first save or prepare): it then takes its
rank's writer lock on tier 1, sweeps that rank's leftovers, and catches up the uploads an
earlier run left undone. Without a tier 1 the uploader also writes the run log's tier-2
copy between steps (`submit_side_task`).

Errors are captured and handed to the caller's thread exactly once.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ClosedError, StepInFlightError, TiercheckError, TierError, UploadSkippedError, tier_error
from ..job.coordination import Group
from ..observe.events import logger
from ..plan.retarget import Key
from ..plan.retention import KeepAll, RetentionPolicy, plan_catch_up, superseded
from ..state.flatten import FlatState
from ..steps.handle import SaveHandle
from ..steps.prune import Pruner
from ..steps.stage import HostBufferPool, StagingAborted, stage_into
from ..steps.upload import copy_from_local, uploaders_of
from ..steps.write import StagedSave, write_staged
from ..tiers.base import Tier
from .priority import lower_current_thread
from .tracking import Tracker
from .workers import STOP, Worker

__all__ = ["Pipeline", "StagedSave"]



@dataclass(frozen=True, slots=True)
class _Stage:
    """Finish an overlapped save's copy, then hand it to the writer."""

    job: StagedSave
    flat: FlatState


@dataclass(frozen=True, slots=True)
class _Upload:
    """Copy a step committed on tier 1 to tier 2."""

    step: int
    rank: int
    handle: SaveHandle | None  # None: a catch-up upload of a step from an earlier run
    remote_owners: tuple[tuple[Key, int], ...] = ()


@dataclass(frozen=True, slots=True)
class _Prune:
    """Apply tier-1 retention again (an upload finished, so a step lost its protection)."""


@dataclass(frozen=True, slots=True)
class _CatchUp:
    """Upload the tier-1 steps an earlier run never uploaded that tier 2 would keep."""


@dataclass(frozen=True, slots=True)
class _SideTask:
    """A small tier-2 write that is not a step (the run log, without a tier 1); it handles
    its own errors."""

    run: Callable[[], None]


class Pipeline:
    """Owns the workers, the checksum helper, per-step tracking, the backlog policy and the
    error mailbox; the work itself is `writestep`, `upload`, `commit` and `pruner`."""

    def __init__(
        self,
        fast: Tier | None,
        durable: Tier | None,
        pool: HostBufferPool,
        keep_fast: RetentionPolicy,
        keep_durable: RetentionPolicy,
        checksum: str,
        upload_backlog: str = "newest",
        low_priority: bool = True,
        group: Group | None = None,
    ) -> None:
        self.fast = fast  # tier 1: written first, from the host buffer
        self.durable = durable  # tier 2: filled from tier 1 (or from the buffer without one)
        tiers = [t for t in (fast, durable) if t is not None]
        self._pool = pool
        self._backlog = upload_backlog
        self._group = group
        self._checksum_name = checksum
        keep = {t.name: k for t, k in ((fast, keep_fast), (durable, keep_durable)) if t is not None}
        self._tracker = Tracker(group, lambda tier: self._pruner.failed(tier))
        self._lock = self._tracker.lock
        self._idle = self._tracker.idle
        self._pruner = Pruner(tiers, keep, group, self._lock)
        self._tracks = self._tracker.tracks  # guarded by `_lock`
        self.in_flight = self._tracker.in_flight
        self.wait_tier = self._tracker.wait_tier
        self.call_soon = self._tracker.call_soon
        self.take_errors = self._tracker.take_errors
        self.error_seen = self._tracker.error_seen
        self.newest_durable = self._tracker.newest_durable  # per tier, the newest step made durable here
        self._finish = self._tracker.finish
        self._first_report = self._tracker.first_report
        self._report = self._tracker.report
        self._uploading: int | None = None  # also protects a catch-up upload from tier-1 pruning
        # Tier-1 steps tier 2 still needs that no handle tracks: catch-up uploads not yet
        # attempted, and failed uploads that tier-2 retention would keep (`_settle_owed`).
        # Tier-1 retention never deletes them.
        self._catching_up: set[int] = set()
        self._owed: set[int] = set()
        # Steps `delete_step` was asked to delete while a catch-up upload (which no handle
        # tracks, so no caller can wait for it) was copying them: deleted when it ends.
        self._delete_after_upload: set[int] = set()
        self._writing = False
        self._catch_up_queued = False
        self._closed = False
        self._copies = 0  # saves copying into host memory now (guarded by `_lock`)
        # The stager keeps normal priority: an optimizer step may be waiting for it.
        init = lower_current_thread if low_priority else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-checksum", initializer=init)
        self._stager = Worker("tiercheck-stager", self._run_stage, self._idle)
        self._writer = Worker("tiercheck-writer", self._run_local, self._idle, low_priority) if fast else None
        self._uploader = Worker("tiercheck-uploader", self._run_remote, self._idle, low_priority) if durable else None
        # Freeing a deleted tier-1 step's bytes (seconds for a multi-GB shard on ext4) runs on
        # a thread of its own that `wait_idle` does not wait for: a step is durable, and
        # `wait()` returns, without waiting for an older step's bytes to be freed.
        self._reclaimer: Worker | None = None
        if fast is not None and fast.capabilities.deferred_reclaim:
            self._reclaimer = Worker("tiercheck-reclaimer", self._run_reclaim, threading.Condition(), True)
            fast.set_reclaimer(self._reclaimer.put, self._between_reclaims)

    # -- caller side -------------------------------------------------------------

    def become_writer(self, rank: int, world_size: int) -> None:
        """Before this session first writes (save, prepare): take `rank`'s writer lock on
        tier 1 and sweep the leftovers it owns. Until then the session only reads, so an
        evaluation script can restore from a directory a job is writing. Idempotent.

        Raises:
            DirectoryInUseError: another live process (or Checkpointer) writes that rank there.
        """
        if self._writing:
            return
        if self.fast is not None and self.fast.capabilities.writer_lock:
            for path in self.fast.claim_writer(rank, world_size):
                logger.info("removed leftover %s from an interrupted save or deletion", path)
        self._writing = True

    def start_catch_up(self) -> None:
        """Queue, once per session, the upload of the tier-1 steps an earlier run committed but
        never uploaded, where tier 2 would keep them (after `become_writer`)."""
        if self.fast is None or self.durable is None:
            return
        with self._lock:
            if self._catch_up_queued:
                return
            self._catch_up_queued = True
        self._uploader_put(_CatchUp())

    def submit(self, job: StagedSave, finish_staging: FlatState | None = None) -> None:
        """Queue `job` for writing; with `finish_staging`, first copy its deferred leaves on
        the staging thread (an overlapped save)."""
        tiers = {t.name for t in (self.fast, self.durable) if t is not None}
        with self._lock:
            if self._closed:
                raise ClosedError("the checkpointer is closed")
            self._tracker.add(job.step, job.handle, tiers)
        self.start_catch_up()  # after the step is tracked: the catch-up counts it as pending
        if finish_staging is not None:
            self._stager.put(_Stage(job, finish_staging))
        else:
            self._write_next(job)

    def forget_unstaged(self, job: StagedSave) -> None:
        """save() failed while copying `job` and raises: the step is no longer in flight, so
        the caller may retry it at once. The writer still drops the job (and its buffer)."""
        self._tracker.forget(job.step, job.handle)

    def submit_side_task(self, run: Callable[[], None]) -> None:
        """Run `run` on the uploader thread, between steps; dropped once the pipeline is closed."""
        with self._lock:
            if self._closed or self._uploader is None:
                return
        self._uploader_put(_SideTask(run))

    def _write_next(self, job: StagedSave) -> None:
        if self._writer is not None:
            self._writer.put(job)
        else:
            self._uploader_put(job)

    def wait_staged(self) -> None:
        """Block while an overlapped save is still copying (the optimizer pre-step guard)."""
        with self._idle:
            self._idle.wait_for(lambda: self._stager.unfinished == 0)

    def _run_stage(self, item: object) -> None:
        assert isinstance(item, _Stage)
        job = item.job
        t0 = time.perf_counter()
        try:
            with self.copying():
                stage_into(job.buffer, item.flat, job.plan, deferred=True)
        except Exception as exc:
            self._pool.release(job.buffer)
            job.handle._staged.set()
            tier = self.fast or self.durable
            assert tier is not None
            error = tier_error(exc, job.step, tier, "copying the state of")
            for name in list(job.handle.tiers):
                self._finish(job.step, name, error if name == tier.name else UploadSkippedError(str(error)))
            return
        job.handle.stats.background_stage_s = time.perf_counter() - t0
        job.handle._staged.set()
        self._write_next(job)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no step is pending and every queued item (retention, done callbacks)
        has run; from a done callback, the callbacks queued behind it are not waited for."""
        workers = [w for w in (self._stager, self._writer, self._uploader) if w is not None]

        def idle() -> bool:
            busy = self._tracker.callbacks_busy()
            return not self._tracks and not busy and not any(w.unfinished for w in workers)

        with self._idle:
            return self._idle.wait_for(idle, timeout)

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for worker in (self._stager, self._writer, self._uploader):
            if worker is not None:
                worker.put(STOP)
        for worker in (self._stager, self._writer, self._uploader):
            if worker is not None:
                worker.thread.join(timeout)
        # Last: the workers above may still have finished a step (and queued its callbacks).
        self._tracker.stop_callbacks(timeout)
        if self._reclaimer is not None:  # after the writer: its last pruning may queue some
            assert self.fast is not None
            self.fast.set_reclaimer(None)
            self._reclaimer.put(STOP)
            self._reclaimer.thread.join(timeout)
        self._hasher.shutdown(wait=True)
        if (
            self.fast is not None
            and self.fast.capabilities.writer_lock
            and not (self._writer is not None and self._writer.thread.is_alive())
        ):
            self.fast.release_writer()  # never while a write may still be running

    # -- bookkeeping -----------------------------------------------------------------

    def _uploader_put(self, item: object) -> None:
        assert self._uploader is not None
        self._uploader.put(item)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Around a save's copy into host memory: freeing deleted steps waits meanwhile."""
        with self._lock:
            self._copies += 1
        try:
            yield
        finally:
            with self._idle:
                self._copies -= 1
                self._idle.notify_all()

    def _between_reclaims(self) -> None:
        """Between two paced pieces of freeing a deleted step: no competing with a save's
        copy for the memory bus and the cores (held at most 2 s)."""
        with self._idle:
            self._idle.wait_for(lambda: self._copies == 0, timeout=2.0)

    def _run_reclaim(self, item: object) -> None:
        assert self.fast is not None and isinstance(item, str)
        self.fast.reclaim(item)

    # -- tier-1 writer ---------------------------------------------------------------

    def _run_local(self, item: object) -> None:
        tier = self.fast
        assert tier is not None
        if isinstance(item, _Prune):
            self._report(self._prune(tier, None))
            return
        assert isinstance(item, StagedSave)
        try:
            error = self._write_from_buffer(tier, item, "writing")
        except StagingAborted:
            return
        if error is None:
            self._pool.release(item.buffer)
            if self.durable is not None:
                self._queue_upload(_Upload(item.step, item.rank, item.handle, item.remote_owners))
        elif self.durable is not None:
            # Tier 1 failed (disk full, say): the snapshot is still in host memory, so it
            # goes to tier 2 from there, and the step is not lost with the local disk.
            self._uploader_put(item)
        else:
            self._pool.release(item.buffer)
        self._finish(item.step, tier.name, error)
        if error is None:
            self._report(self._prune(tier, item.step))

    def _write_from_buffer(self, tier: Tier, item: StagedSave, doing: str) -> TierError | None:
        """Write a staged step to `tier`; the caller releases the buffer. If the copy itself
        failed, drop the step (save() raised the cause) and raise StagingAborted."""
        error: TierError | None = None
        try:
            self._write_staged(tier, item)
        except StagingAborted:
            self._drop_unstaged(item)
            raise
        except Exception as exc:
            error = tier_error(exc, item.step, tier, doing)
        item.handle.stats.tier_s[tier.name] = time.monotonic() - item.handle.started_at
        return error

    def _drop_unstaged(self, item: StagedSave) -> None:
        """The copy failed in save(), which raised it to the caller: drop the step quietly.
        The caller may already have retried the same step (after a KeyboardInterrupt, say):
        only this save's handle fails, not the retry's."""
        error = TiercheckError(f"step {item.step} was never staged: its save() raised")
        for name in item.handle.tiers:
            self._finish(item.step, name, error, handle=item.handle)
        self._pool.release(item.buffer)

    # -- tier-2 uploader -------------------------------------------------------------

    def _run_remote(self, item: object) -> None:
        tier = self.durable
        assert tier is not None
        if isinstance(item, _CatchUp):
            self._catch_up(tier)
            return
        if isinstance(item, _SideTask):
            item.run()
            return
        if isinstance(item, StagedSave):  # no tier 1 (or it failed): from the host buffer
            try:
                error = self._write_from_buffer(tier, item, "uploading")
            except StagingAborted:
                return
            self._pool.release(item.buffer)
            self._finish(item.step, tier.name, error)
            if error is None:
                self._report(self._prune(tier, item.step))
                if self._settle_owed(tier, listed=True):
                    self._request_local_prune()
            return
        assert isinstance(item, _Upload)
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
            self._finish(item.step, tier.name, error)
        elif error is not None:
            self._report(error)
        if error is None:
            self._report(self._prune(tier, item.step))
        self._settle_owed(tier, listed=error is None)
        self._request_local_prune()  # the step is off tier 1's protection list now

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
            others = set(listing) | {s for s, t in self._tracks.items() if tier.name in t.remaining}
            if self._uploading is not None:
                others.add(self._uploading)
            self._owed.difference_update(superseded(self._owed, self._pruner.policy(tier), others))
            return len(self._owed) != before

    def _queue_upload(self, upload: _Upload) -> None:
        """Queue an upload; under the "newest" policy, drop right away the waiting uploads (not
        the one in progress) that tier-2 retention would delete anyway once the newer steps are
        there, so their steps lose tier-1 protection now rather than when the uploader gets to
        them. A step tier 2 would keep (a `KeepEvery` milestone, one of `KeepLast(n)`'s n
        newest, any step under `KeepAll`) is never dropped: with keep_remote=KeepLast(n), tier 1
        holds at most the step being uploaded, n waiting, and the milestones among them."""
        assert self._uploader is not None
        dropped: list[_Upload] = []
        if self._backlog == "newest":
            assert self.durable is not None
            with self._lock:
                uploading = self._uploading
            with self._uploader.cond:
                waiting = [q.step for q in self._uploader.queue if isinstance(q, _Upload) and q.step < upload.step]
                others = [upload.step] + [q.step for q in self._uploader.queue if isinstance(q, StagedSave)]
                if uploading is not None:
                    others.append(uploading)
                doomed = set(superseded(waiting, self._pruner.policy(self.durable), others))
                keep: deque[object] = deque()
                for q in self._uploader.queue:
                    if isinstance(q, _Upload) and q.step in doomed:
                        dropped.append(q)
                    else:
                        keep.append(q)
                self._uploader.queue = keep
            if dropped:
                with self._idle:
                    self._uploader.unfinished -= len(dropped)
                    self._catching_up.difference_update(q.step for q in dropped)
        self._uploader_put(upload)
        for q in dropped:  # the tier-1 writer prunes right after queueing this upload
            self._skip_upload(q)

    def _skip_upload(self, item: _Upload) -> None:
        assert self.durable is not None
        if item.handle is not None:
            self._finish(
                item.step,
                self.durable.name,
                UploadSkippedError(
                    f"step {item.step} was not uploaded to tier {self.durable.name!r}: uploads were behind "
                    "and newer steps superseded it, so tier-2 retention would delete it anyway "
                    "(upload_backlog='newest')"
                ),
            )

    def _request_local_prune(self) -> None:
        if self._writer is not None:
            self._writer.put(_Prune())

    def _catch_up(self, tier: Tier) -> None:
        """Upload the tier-1 steps an earlier run committed but never uploaded (a kill, a
        failed upload) that tier-2 retention would keep, milestones included."""
        assert self.fast is not None
        if self._group is not None:
            self._catch_up_job(tier)
            return
        try:
            local_steps = self.fast.committed_steps()
            if not local_steps:
                return
            remote_steps = tier.committed_steps()
        except Exception as exc:
            logger.warning("tiercheck: could not compare tiers at start-up: %r", exc)
            return
        with self._lock:
            steps = plan_catch_up(local_steps, remote_steps, self._pruner.policy(tier), list(self._tracks))
            self._catching_up.update(steps)
        if steps:
            logger.info("uploading steps %s, committed on tier 1 by an earlier run but not on tier 2", steps)
        for step in steps:
            self._uploader_put(_Upload(step, 0, None))

    def _catch_up_job(self, tier: Tier) -> None:
        """`_catch_up` for a job: rank 0 picks the steps (among those on every rank's tier 1)
        and every rank uploads its part of each."""
        assert self.fast is not None and self._group is not None
        try:
            mine = self.fast.committed_steps()
        except OSError:
            mine = []
        with self._lock:
            pending = list(self._tracks)

        def plan(common: set[int]) -> list[int]:
            return plan_catch_up(common, tier.committed_steps(), self._pruner.policy(tier), pending)

        try:
            steps = self._group.coord.agree_catch_up(mine, plan)
        except Exception as exc:
            logger.warning("tiercheck: no catch-up upload at start-up: %r", exc)
            return
        for step in steps:
            owners: dict[Key, int] = {}
            if self._group.node_local:  # tier 2 gets one copy of the replicated keys, as for any step
                try:
                    owners = uploaders_of(self.fast, step, self._group)
                except Exception as exc:
                    logger.warning("tiercheck: no catch-up upload of step %d: %r", step, exc)
                    continue
            logger.info("uploading step %d, committed on tier 1 by an earlier run but not on tier 2", step)
            with self._lock:
                self._catching_up.add(step)
            self._uploader_put(_Upload(step, self._group.rank, None, tuple(owners.items())))

    def _copy_from_local(self, step: int, rank: int, owners: dict[Key, int]) -> None:
        src, dst = self.fast, self.durable
        assert src is not None and dst is not None
        marker = copy_from_local(
            src, dst, step, rank, owners, self._group, lambda: self._first_report(step, dst.name)
        )
        self._pruner.remember_metrics(dst, step, marker.metrics)

    # -- shared ------------------------------------------------------------------------

    def _write_staged(self, tier: Tier, job: StagedSave) -> None:
        # Tier 1 failed and this part goes to tier 2 from host memory: as a tier-1 upload
        # would, leave out the replicated keys other ranks upload. On a node-local tier 1,
        # directories hold their own copies of replicated keys, so ranks agree there on which
        # keys are replicated, not on who holds them.
        node_local = self._group is not None and self._group.node_local
        write_staged(
            tier,
            job,
            hasher=self._hasher,
            checksum_algorithm=self._checksum_name,
            group=self._group,
            owners=dict(job.remote_owners) if tier is self.durable else {},
            owners_agree=not (node_local and tier is self.fast),
            reported=lambda: self._first_report(job.step, tier.name),
        )
        self._pruner.remember_metrics(tier, job.step, job.metrics)

    def _prune(self, tier: Tier, newest: int | None) -> TierError | None:
        if tier is self.fast:
            return self._pruner.prune(tier, newest, self._tier1_protected, self._forget_owed)
        return self._pruner.prune(tier, newest, lambda: self.in_flight(tier.name))

    def _forget_owed(self, committed: list[int]) -> None:
        """A failed upload deleted from tier 1 since (a new branch): nothing to keep for it."""
        with self._lock:
            self._owed.intersection_update(committed)

    def _tier1_protected(self) -> list[int]:
        """Tier-1 steps retention must not delete: in flight on either tier, being uploaded,
        queued for a catch-up upload, or failed to upload while tier 2 would keep them."""
        steps = set(self.in_flight())
        with self._lock:
            steps |= self._catching_up | self._owed
            if self._uploading is not None:
                steps.add(self._uploading)
        return sorted(steps)

    def delete_step(self, step: int, tiers: list[Tier]) -> None:
        """Delete `step` from `tiers` (marker first on each), between retention passes. A
        step a catch-up upload is copying (an earlier run's: no handle to wait for) is
        deleted from every tier holding it when that upload ends, whoever started it.

        Raises:
            StepInFlightError: `step` is still being written or uploaded by a save.
            TierError: a tier failed; the other tiers were still tried.
        """
        while True:
            with self._lock:
                if self._uploading == step and step not in self._tracks:
                    self._delete_after_upload.add(step)  # a catch-up upload: deleted when it ends
                    return
            try:
                self._pruner.delete_step(step, tiers, lambda s: s in self._tracks or self._uploading == s)
                return
            except StepInFlightError:
                with self._lock:
                    if step in self._tracks or self._uploading != step:
                        raise
                # else a catch-up upload of it started meanwhile: defer, as above

    def delete_branch(self, steps: Sequence[int], tiers: list[Tier]) -> None:
        """Delete the abandoned `steps` after a rollback from `tiers` before the new branch is
        written (`Pruner.delete_branch`). A catch-up upload copying one of them (an earlier
        run's step: no handle tracks it) is waited for, then the step goes from tier 2 too.

        Raises:
            TierError: a tier failed to delete one of them.
        """

        def wait_copies(doomed: set[int]) -> None:
            with self._idle:
                self._idle.wait_for(lambda: self._uploading not in doomed)

        self._pruner.delete_branch(steps, tiers, wait_copies)

    def _delete_deferred(self, step: int) -> None:
        """Delete `step` (its catch-up upload just ended) from every tier this rank deletes
        from that holds it now, tier 2 included if the upload committed it there."""
        tiers = [t for t in (self.fast, self.durable) if t is not None]
        tiers = [t for t in tiers if self._group is None or self._group.leads(t.name)]
        try:
            tiers = [t for t in tiers if step in t.committed_steps()]
            self._pruner.delete_step(step, tiers, lambda s: s in self._tracks)
        except StepInFlightError:  # saved again meanwhile (a new branch): that save's now
            logger.info("tiercheck: not deleting step %d after its upload: it is being saved again", step)
        except TierError as exc:
            self._report(exc)
        except Exception as exc:
            logger.warning("tiercheck: could not delete step %d after its upload: %r", step, exc)
