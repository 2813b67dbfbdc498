"""Background work: the pipeline's threads, queues and per-step tracking.

Two workers, one per tier role, each draining its own queue:

* the writer of the fast tiers takes staged saves in order. With tier 0 on, it first
  commits the step there (`tiers.memory`: the host buffer itself becomes the shard, so
  this costs the checksums, a manifest and the commit), then goes on to tier 1. For each step it
  checksums the host buffer on a helper thread while it writes the shard (`steps.write`),
  commits it (`job.commit`), returns the host buffer to the pool, hands the step to the
  uploader and applies tier-1 retention (`steps.prune`);
* the uploader (`uploads`: the tier-2 side, its backlog policy and the catch-up upload)
  copies committed tier-1 steps to tier 2, or, without a tier 1, writes staged saves
  straight from the host buffer.

Threads (docs/design.md lists every module that starts one): the two workers, a stager
for overlapped saves, the checksum helper, the reclaimer that frees deleted tier-1 steps,
and a callback worker started at the first `SaveHandle.add_done_callback` (`tracking`), so
a slow callback never holds the writer or the uploader. All are started here or by the
parts this module builds (`uploads`, `tracking`). Outside the engine only two helpers run
threads, each joined before its call returns: the object-store tier's per-call timeout
(`tiers.remote`) and restore's checksum helper (`steps.restore`).

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
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..errors import ClosedError, TiercheckError, TierError, UploadSkippedError, tier_error
from ..job.coordination import Membership
from ..job.trigger import SigtermState
from ..observe.events import logger
from ..plan.retention import KeepLast
from ..plan.settings import RetentionOptions, SaveOptions
from ..state.flatten import FlatState
from ..steps.handle import DrainReport
from ..steps.prune import Pruner
from ..steps.stage import HostBufferPool, StagingAborted, stage_into
from ..steps.write import StagedSave, write_staged
from ..tiers.base import Tier
from .peers import PeerCopies
from .priority import lower_current_thread
from .tracking import Tracker
from .uploads import Uploads
from .workers import STOP, Worker

__all__ = ["Pipeline", "StagedSave"]


@dataclass(frozen=True, slots=True)
class _Stage:
    """Finish an overlapped save's copy, then hand it to the writer."""

    job: StagedSave
    flat: FlatState


@dataclass(frozen=True, slots=True)
class _Prune:
    """Apply tier-1 retention again (an upload finished, so a step lost its protection)."""


class Pipeline:
    """Owns the workers, the checksum helper, per-step tracking and the error mailbox; the
    tier-2 side is `Uploads`, the work itself `steps.write`, `steps.upload`, `job.commit`
    and `steps.prune`.

    Args:
        fast: tier 1 (written first, from the host buffer), or None.
        durable: tier 2 (filled from tier 1, or from the buffer without one), or None.
        memory: tier 0 (committed before tier 1 is written, from the same buffer), or None.
        pool: the host buffers saves are staged into.
        group: this process's place in the job.
        retention: each tier's policy and the upload backlog policy.
        save: the checksum algorithm and the workers' I/O priority.
    """

    def __init__(
        self,
        fast: Tier | None,
        durable: Tier | None,
        pool: HostBufferPool,
        group: Membership,
        *,
        retention: RetentionOptions,
        save: SaveOptions,
        memory: Tier | None = None,
        keep_memory: int = 1,
        peers: PeerCopies | None = None,
    ) -> None:
        self.fast = fast
        self.durable = durable
        self.memory = memory
        self._peers = peers
        self._tiers = [t for t in (memory, fast, durable) if t is not None]
        self._pool = pool
        self._group = group
        self._checksum_name = save.checksum
        keep = {t.name: k for t, k in ((fast, retention.keep_local), (durable, retention.keep_remote)) if t}
        if memory is not None:
            keep[memory.name] = KeepLast(keep_memory)
        self._tracker = Tracker(group, lambda tier: self._pruner.failed(tier))
        self._lock = self._tracker.lock
        self._idle = self._tracker.idle
        self._pruner = Pruner(self._tiers, keep, group, self._lock)
        self._tracks = self._tracker.tracks  # guarded by `_lock`
        self.in_flight = self._tracker.in_flight
        self.wait_tier = self._tracker.wait_tier
        self.call_soon = self._tracker.call_soon
        self.take_errors = self._tracker.take_errors
        self.take_error = self._tracker.take_error
        self.error_seen = self._tracker.error_seen
        self.newest_durable = self._tracker.newest_durable  # per tier, the newest step made durable here
        self._finish = self._tracker.finish
        self._report = self._tracker.report
        self._writing = False
        self._catch_up_queued = False
        self._closed = False
        self._copies = 0  # saves copying into host memory now (guarded by `_lock`)
        low = save.low_priority
        # The stager keeps normal priority: an optimizer step may be waiting for it.
        init = lower_current_thread if low else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-checksum", initializer=init)
        self._stager = Worker("tiercheck-stager", self._run_stage, self._idle)
        self._writer = Worker("tiercheck-writer", self._run_local, self._idle, low) if fast or memory else None
        self._uploads: Uploads | None = None
        if durable is not None:
            self._uploads = Uploads(
                fast,
                durable,
                pool=pool,
                tracker=self._tracker,
                pruner=self._pruner,
                group=group,
                backlog=retention.upload_backlog,
                low_priority=low,
                write_from_buffer=self._write_from_buffer,
                prune_fast=self._request_local_prune,
            )
        self._uploader = None if self._uploads is None else self._uploads.worker
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
        for tier in (self.memory, self.fast):
            if tier is not None and tier.capabilities.writer_lock:
                for path in tier.claim_writer(rank, world_size):
                    logger.info("removed leftover %s from an interrupted save or deletion", path)
        self._writing = True

    @property
    def writing(self) -> bool:
        """Whether this session became a writer (`become_writer`): a session that only read
        changes nothing on any tier, its close included."""
        return self._writing

    def start_catch_up(self) -> None:
        """Queue, once per session, the upload of the tier-1 steps an earlier run committed but
        never uploaded, where tier 2 would keep them (after `become_writer`)."""
        if self.fast is None or self.durable is None:
            return
        with self._lock:
            if self._catch_up_queued:
                return
            self._catch_up_queued = True
        assert self._uploads is not None
        self._uploads.catch_up()

    def submit(self, job: StagedSave, finish_staging: FlatState | None = None) -> None:
        """Queue `job` for writing; with `finish_staging`, first copy its deferred leaves on
        the staging thread (an overlapped save)."""
        with self._lock:
            if self._closed:
                raise ClosedError("the checkpointer is closed")
            self._tracker.add(job.step, job.handle, {t.name for t in self._tiers})
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
            if self._closed or self._uploads is None:
                return
        self._uploads.side_task(run)

    def _write_next(self, job: StagedSave) -> None:
        if self._writer is not None:
            self._writer.put(job)
        else:
            assert self._uploads is not None
            self._uploads.from_buffer(job)

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
        if not (self._writer is not None and self._writer.thread.is_alive()):
            for tier in (self.memory, self.fast):  # never while a write may still be running
                if tier is not None and tier.capabilities.writer_lock:
                    tier.release_writer()

    def wait_closing(self, sig: SigtermState | None) -> bool:
        """Wait until nothing is pending; once a SIGTERM arrived (`sig`), only until its grace
        period ends: False then, and close stops there for the signal to be delivered."""
        if sig is None:
            return self.wait_idle()
        # In slices: a signal landing during the wait sets the deadline.
        while not self.wait_idle(0.1):
            if sig.received and time.monotonic() >= sig.deadline:
                logger.warning(
                    "tiercheck: SIGTERM's grace period ended during close(); steps still pending: %s",
                    self.in_flight(),
                )
                return False
        return True

    def drain(self, timeout: float | None) -> DrainReport:
        """Tier 1 first, then everything, within `timeout` seconds; the errors are consumed."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        if self.fast is not None:
            self.wait_tier(self.fast.name, left())
        self.wait_idle(left())
        return DrainReport(
            durable={t.name: self.newest_durable.get(t.name) for t in self._tiers},
            pending={t.name: self.in_flight(t.name) for t in self._tiers},
            errors=tuple(self.take_errors()),
        )

    # -- bookkeeping -----------------------------------------------------------------

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
        if isinstance(item, _Prune):
            if self.fast is not None:
                self._report(self._prune_fast())
            return
        assert isinstance(item, StagedSave)
        in_memory = False
        if self.memory is not None:
            try:
                in_memory = self._keep_in_memory(self.memory, item)
            except StagingAborted:
                self._copy_to_peers(item, False)
                return
        tier = self.fast
        if tier is None:  # tier 0 and tier 2: the step goes on from the buffer
            assert self._uploads is not None
            self._copy_to_peers(item, in_memory)
            self._uploads.from_buffer(item)
            return
        try:
            error = self._write_from_buffer(tier, item, "writing")
        except StagingAborted:
            return
        if error is None:
            if self._uploads is not None:
                self._uploads.upload(item)  # from the tier-1 files: the buffer is not needed
            self._finish(item.step, tier.name, None)  # durable on tier 1 now, copies or not
            self._copy_to_peers(item, in_memory)  # before the buffer (the shard sent) goes back
            # The buffer before retention: a save waiting for a free buffer (one issued right
            # after the last one's wait()) need not wait for older steps' files to be deleted.
            self._pool.release(item.buffer)
            self._report(self._prune_fast(item.step))
            return
        self._copy_to_peers(item, in_memory)
        if self._uploads is not None:
            # Tier 1 failed (disk full, say): the snapshot is still in host memory, so it
            # goes to tier 2 from there, and the step is not lost with the local disk.
            self._uploads.from_buffer(item)
        else:
            self._pool.release(item.buffer)
        self._finish(item.step, tier.name, error)

    def _copy_to_peers(self, item: StagedSave, in_memory: bool) -> None:
        """Every rank takes part in every step's exchange, with or without a copy to send."""
        if self._peers is not None:
            shard = item.buffer.tensor[: item.plan.total_bytes] if in_memory else None
            self._peers.replicate(item.step, shard)

    def _keep_in_memory(self, tier: Tier, item: StagedSave) -> bool:
        """Commit `item` on tier 0 (its buffer becomes the shard) and apply tier-0 retention.
        A buffer outside shared memory (tier 0 turned off for want of room: one warning said
        so) leaves the step off tier 0 without an error. Raises StagingAborted as
        `_write_from_buffer` does."""
        if item.buffer.shm is None:
            why = UploadSkippedError(f"step {item.step} is not kept on tier 0 ({tier.location}): tier 0 is off")
            self._finish(item.step, tier.name, why)
            return False
        error = self._write_from_buffer(tier, item, "keeping in memory")
        self._finish(item.step, tier.name, error)
        if error is None:
            self._report(self._pruner.prune(tier, item.step, self.in_flight))
        return error is None

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

    def _request_local_prune(self) -> None:
        if self._writer is not None:
            self._writer.put(_Prune())

    def _write_staged(self, tier: Tier, job: StagedSave) -> None:
        # Tier 1 failed and this part goes to tier 2 from host memory: as a tier-1 upload
        # would, leave out the replicated keys other ranks upload. On a node-local tier 1,
        # directories hold their own copies of replicated keys, so ranks agree there on which
        # keys are replicated, not on who holds them.
        write_staged(
            tier,
            job,
            hasher=self._hasher,
            checksum_algorithm=self._checksum_name,
            group=self._group,
            owners=dict(job.remote_owners) if tier is self.durable else {},
            owners_agree=not (self._group.node_local and tier is not self.durable),
            reported=lambda: self._tracker.first_report(job.step, tier.name),
        )
        self._pruner.remember_metrics(tier, job.step, job.metrics)

    def _prune_fast(self, newest: int | None = None) -> TierError | None:
        assert self.fast is not None
        forget = self._uploads.forget_owed if self._uploads is not None else lambda committed: None
        return self._pruner.prune(self.fast, newest, self._tier1_protected, forget)

    def _tier1_protected(self) -> list[int]:
        """Tier-1 steps retention must not delete: in flight on either tier, or still needed
        by tier 2 (`Uploads.protected`)."""
        steps = set(self.in_flight())
        if self._uploads is not None:
            steps |= self._uploads.protected()
        return sorted(steps)

    def delete_step(self, step: int, tiers: list[Tier]) -> None:
        """Delete `step` from `tiers` (marker first on each), between retention passes. A
        step a catch-up upload is copying (an earlier run's: no handle to wait for) is
        deleted from every tier holding it when that upload ends, whoever started it.

        Raises:
            StepInFlightError: `step` is still being written or uploaded by a save.
            TierError: a tier failed; the other tiers were still tried.
        """
        if self._uploads is not None:
            self._uploads.delete_step(step, tiers)
        else:
            self._pruner.delete_step(step, tiers, lambda s: s in self._tracks)

    def delete_branch(self, steps: Sequence[int], tiers: list[Tier]) -> None:
        """Delete the abandoned `steps` after a rollback from `tiers` before the new branch is
        written (`Pruner.delete_branch`). A catch-up upload copying one of them (an earlier
        run's step: no handle tracks it) is waited for, then the step goes from tier 2 too.

        Raises:
            TierError: a tier failed to delete one of them.
        """
        if self._uploads is not None:
            self._uploads.delete_branch(steps, tiers)
        else:
            self._pruner.delete_branch(steps, tiers, lambda doomed: None)
