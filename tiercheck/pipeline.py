"""Background work: the only module that starts threads.

Two workers, one per tier, each draining its own queue:

* the tier-1 writer takes staged saves in order. For each step it checksums the host
  buffer on a helper thread while it writes the shard (both release the GIL, and CRC-32C
  runs ~7x faster than the disk, so the checksum never limits the save), then writes the
  manifest and the commit marker, returns the host buffer to the pool, hands the step to
  the uploader and applies tier-1 retention;
* the uploader copies committed tier-1 steps to tier 2 (shards, manifest, marker last),
  or, without a tier 1, writes staged saves straight from the host buffer. When it falls
  behind (``upload_backlog="newest"``), it skips the waiting steps that tier-2 retention
  would delete anyway; a step tier 2 would keep is always uploaded.

A step tier-2 retention would keep stays on tier 1 until it is on tier 2: while it waits
for its upload, and after a failed upload (the next session's catch-up uploads it).

Done callbacks (`SaveHandle.add_done_callback`) run one at a time on a third worker, started
at the first one, so a slow callback never holds the writer or the uploader.

A session only reads until `become_writer` (its first save or prepare): it then takes its
rank's writer lock on tier 1, sweeps that rank's leftovers, and catches up the uploads an
earlier run left undone.
Without a tier 1 the uploader also writes the run log's tier-2 copy between steps
(`submit_side_task`).

Errors are captured and handed to the caller's thread exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from . import layout
from .checksum import checksum_function
from .coordination import CoordinationError, Group, PartReport
from .errors import (
    ClosedError,
    InvalidArgumentError,
    StepInFlightError,
    TiercheckError,
    TierError,
    UploadSkippedError,
)
from .events import emit, logger
from .handle import SaveHandle
from .manifest import (
    Manifest,
    ManifestRef,
    Marker,
    Metric,
    ShardFile,
    assignment_digest,
    build_entries,
    encode_manifest,
    encode_marker,
)
from .planner import ShardPlan
from .priority import lower_current_thread
from .restore import present_manifests, read_manifest_with_bytes, read_marker, verify_files
from .retarget import Key, Retargeted, balance, region_chunks, replicated_sizes, retarget
from .retention import KeepAll, RetentionPolicy, plan_catch_up, plan_deletions, superseded
from .staging import HostBuffer, HostBufferPool, StageProgress, StagingAborted, stage_into
from .state import FlatState, JsonNode, Leaf
from .tiers.base import StepWriter, Tier
from .tiers.copy import copy_file, reader_of

BACKLOG_POLICIES = ("newest", "all")


@dataclass(frozen=True, slots=True)
class StagedSave:
    """Everything a writer needs for one step; the buffer is the pipeline's until written."""

    step: int
    rank: int
    world_size: int
    tree: JsonNode
    leaves: tuple[Leaf, ...]
    plan: ShardPlan
    buffer: HostBuffer
    handle: SaveHandle
    progress: StageProgress | None = None  # set when the writer may start before the copy ends
    replicated: tuple[tuple[str, str], ...] = ()  # top-level keys the same on every rank
    # Node-local tier 1: who uploads each replicated key to tier 2 (empty: as on tier 1).
    remote_owners: tuple[tuple[Key, int], ...] = ()
    metrics: tuple[tuple[str, Metric], ...] = ()  # recorded in the commit marker


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


_STOP = object()


class _Worker:
    """A thread draining a deque; `run_one` does the work for one item.

    `unfinished` counts items queued or running, guarded by the pipeline's `idle`
    condition, so "idle" means every queued item (retention included) has run.
    """

    def __init__(
        self, name: str, run_one: Callable[[object], None], idle: threading.Condition, low_priority: bool = False
    ) -> None:
        self.queue: deque[object] = deque()
        self._low_priority = low_priority
        self.cond = threading.Condition()
        self.unfinished = 0
        self._idle = idle
        self._run_one = run_one
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def put(self, item: object, reserved: bool = False) -> None:
        """Queue `item`; `reserved`: its `unfinished` count was already taken (under the
        pipeline's lock, which this then does not need)."""
        if item is not _STOP and not reserved:
            with self._idle:
                self.unfinished += 1
        with self.cond:
            self.queue.append(item)
            self.cond.notify()

    def _loop(self) -> None:
        if self._low_priority:
            lower_current_thread()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: bool(self.queue))
                item = self.queue.popleft()
            if item is _STOP:
                return
            try:
                self._run_one(item)
            except Exception:  # a bug in the pipeline itself: keep the worker alive, say so
                logger.exception("tiercheck: internal error in %s", self.thread.name)
            finally:
                with self._idle:
                    self.unfinished -= 1
                    self._idle.notify_all()


@dataclass(slots=True)
class _Track:
    handle: SaveHandle
    remaining: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)  # tiers whose outcome the other ranks know


class Pipeline:
    """Owns the workers, the checksum helper, per-step progress and the error mailbox."""

    def __init__(
        self,
        local: Tier | None,
        remote: Tier | None,
        pool: HostBufferPool,
        keep_local: RetentionPolicy,
        keep_remote: RetentionPolicy,
        checksum: str,
        upload_backlog: str = "newest",
        low_priority: bool = True,
        group: Group | None = None,
    ) -> None:
        if upload_backlog not in BACKLOG_POLICIES:
            raise InvalidArgumentError(f"upload_backlog must be one of {BACKLOG_POLICIES}, got {upload_backlog!r}")
        self.local = local
        self.remote = remote
        self._pool = pool
        self._keep = {"local": keep_local, "remote": keep_remote}
        self._backlog = upload_backlog
        self._group = group
        self._checksum_name = checksum
        self._checksum = checksum_function(checksum)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._tracks: dict[int, _Track] = {}
        self._uploading: int | None = None  # also protects a catch-up upload from tier-1 pruning
        # Tier-1 steps tier 2 still needs that no handle tracks: catch-up uploads not yet
        # attempted, and failed uploads that tier-2 retention would keep (`_settle_owed`).
        # Tier-1 retention never deletes them.
        self._catching_up: set[int] = set()
        self._owed: set[int] = set()
        self._writing = False
        self._catch_up_queued = False
        self._errors: list[TierError] = []
        # Per tier: may unmarked leftovers exist (a crash before this session, a failed step)?
        self._sweep = {t.name: True for t in (local, remote) if t is not None}
        self.newest_durable: dict[str, int] = {}  # per tier, the newest step this session made durable
        # Retention and Checkpointer.delete take turns deleting steps, per tier (a slow tier-2
        # listing must not hold up tier 1's pruning, hence its writer); `_deleting` holds a
        # step whose deletion has begun, so no catch-up upload starts on it.
        self._retention_locks = {t.name: threading.Lock() for t in (local, remote) if t is not None}
        self._deleting: set[int] = set()
        # Per tier: the metrics recorded with each committed step (read once per step, and
        # only for policies that rank by a metric).
        self._metrics: dict[str, dict[int, dict[str, Metric]]] = {t.name: {} for t in (local, remote) if t is not None}
        self._callbacks: _Worker | None = None  # started at the first done callback
        self._callbacks_stopped = False
        self._closed = False
        # The stager keeps normal priority: an optimizer step may be waiting for it.
        init = lower_current_thread if low_priority else None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-checksum", initializer=init)
        self._stager = _Worker("tiercheck-stager", self._run_stage, self._idle)
        self._writer = _Worker("tiercheck-writer", self._run_local, self._idle, low_priority) if local else None
        self._uploader = _Worker("tiercheck-uploader", self._run_remote, self._idle, low_priority) if remote else None

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
        if self.local is not None and self.local.capabilities.writer_lock:
            for path in self.local.claim_writer(rank, world_size):
                logger.info("removed leftover %s from an interrupted save or deletion", path)
        self._writing = True

    def start_catch_up(self) -> None:
        """Queue, once per session, the upload of the tier-1 steps an earlier run committed but
        never uploaded, where tier 2 would keep them (after `become_writer`)."""
        if self.local is None or self.remote is None:
            return
        with self._lock:
            if self._catch_up_queued:
                return
            self._catch_up_queued = True
        self._uploader_put(_CatchUp())

    def submit(self, job: StagedSave, finish_staging: FlatState | None = None) -> None:
        """Queue `job` for writing; with `finish_staging`, first copy its deferred leaves on
        the staging thread (an overlapped save)."""
        tiers = {t.name for t in (self.local, self.remote) if t is not None}
        with self._lock:
            if self._closed:
                raise ClosedError("the checkpointer is closed")
            self._tracks[job.step] = _Track(job.handle, set(tiers))
        self.start_catch_up()  # after the step is tracked: the catch-up counts it as pending
        if finish_staging is not None:
            self._stager.put(_Stage(job, finish_staging))
        else:
            self._write_next(job)

    def forget_unstaged(self, job: StagedSave) -> None:
        """save() failed while copying `job` and raises: the step is no longer in flight, so
        the caller may retry it at once. The writer still drops the job (and its buffer)."""
        with self._lock:
            track = self._tracks.get(job.step)
            if track is not None and track.handle is job.handle:
                del self._tracks[job.step]
                self._idle.notify_all()

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
            stage_into(job.buffer, item.flat, job.plan, deferred=True)
        except Exception as exc:
            self._pool.release(job.buffer)
            job.handle._staged.set()
            tier = self.local or self.remote
            assert tier is not None
            error = tier_error(exc, job.step, tier, "copying the state of")
            for name in list(job.handle.tiers):
                self._finish(job.step, name, error if name == tier.name else UploadSkippedError(str(error)))
            return
        job.handle.stats.background_stage_s = time.perf_counter() - t0
        job.handle._staged.set()
        self._write_next(job)

    def in_flight(self, tier: str | None = None) -> list[int]:
        """Steps not yet finished on `tier` (on any tier if None)."""
        with self._lock:
            return sorted(s for s, t in self._tracks.items() if tier is None or tier in t.remaining)

    def wait_tier(self, tier: str, timeout: float | None = None) -> bool:
        """Wait until no pending step still needs `tier`."""
        with self._idle:
            return self._idle.wait_for(lambda: not any(tier in t.remaining for t in self._tracks.values()), timeout)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no step is pending and every queued item (retention, done callbacks)
        has run; from a done callback, the callbacks queued behind it are not waited for."""
        workers = [w for w in (self._stager, self._writer, self._uploader) if w is not None]
        me = threading.current_thread()

        def idle() -> bool:
            cb = self._callbacks  # may start while we wait
            busy = cb is not None and cb.thread is not me and cb.unfinished > 0
            return not self._tracks and not busy and not any(w.unfinished for w in workers)

        with self._idle:
            return self._idle.wait_for(idle, timeout)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the callback thread (started now if needed); after close, right here.
        Never called with the pipeline's lock held."""
        with self._lock:
            worker = self._callback_worker(1)
        if worker is None:
            _run_callback(fn)
        else:
            worker.put(fn, reserved=True)

    def _callback_worker(self, n: int) -> _Worker | None:
        """The callback thread, with `n` items counted as queued; None after close. Call with
        the lock held."""
        if self._callbacks_stopped:
            return None
        if self._callbacks is None:
            self._callbacks = _Worker("tiercheck-callbacks", _run_callback, self._idle)
        self._callbacks.unfinished += n
        return self._callbacks

    def take_errors(self) -> list[TierError]:
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def error_seen(self, err: TierError) -> None:
        """A handle raised `err` to the caller: it must not be raised again."""
        with self._lock, contextlib.suppress(ValueError):
            self._errors.remove(err)

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for worker in (self._stager, self._writer, self._uploader):
            if worker is not None:
                worker.put(_STOP)
        for worker in (self._stager, self._writer, self._uploader):
            if worker is not None:
                worker.thread.join(timeout)
        # Last: the workers above may still have finished a step (and queued its callbacks).
        with self._lock:
            self._callbacks_stopped = True
        if self._callbacks is not None:
            self._callbacks.put(_STOP)
            if threading.current_thread() is not self._callbacks.thread:
                self._callbacks.thread.join(timeout)
        self._hasher.shutdown(wait=True)
        if (
            self.local is not None
            and self.local.capabilities.writer_lock
            and not (self._writer is not None and self._writer.thread.is_alive())
        ):
            self.local.release_writer()  # never while a write may still be running

    # -- bookkeeping -----------------------------------------------------------------

    def _finish(
        self, step: int, tier: str, error: TiercheckError | None = None, handle: SaveHandle | None = None
    ) -> None:
        """Record `step`'s outcome on `tier`. With `handle`, only if that save still owns
        the step: a save whose copy failed may have been retried with the same step since."""
        if error is not None and self._group is not None and self._first_report(step, tier, handle):
            try:  # tell the other ranks now, so they do not wait for us until the timeout
                self._group.coord.abandon(step, tier, str(error))
            except Exception as exc:
                logger.warning("tiercheck: could not tell the other ranks that step %d failed: %r", step, exc)
        with self._lock:
            if error is not None:
                self._sweep[tier] = True
            track = self._tracks.get(step)
            if handle is not None and (track is None or track.handle is not handle):
                handle._finish(tier, error)  # no longer in flight, or a retry owns the step now
                return
            if isinstance(error, TierError):
                self._errors.append(error)
            if error is None:
                self.newest_durable[tier] = max(step, self.newest_durable.get(tier, step))
            runs: list[Callable[[], None]] = []
            if track is not None:
                runs = track.handle._finish(tier, error)
                track.remaining.discard(tier)
                if not track.remaining:
                    del self._tracks[step]
                    emit(track.handle.stats)
            # Counted as queued before the step stops counting as pending, so that `wait()`
            # also waits for them; queued below, outside the lock the callbacks may need.
            callbacks = self._callback_worker(len(runs)) if runs else None
            self._idle.notify_all()
        for run in runs:
            if callbacks is None:
                _run_callback(run)
            else:
                callbacks.put(run, reserved=True)
        if isinstance(error, TierError):
            logger.error("%s", error)

    def _first_report(self, step: int, tier: str, handle: SaveHandle | None = None) -> bool:
        """True the first time this rank reports its outcome for `step` on `tier`."""
        with self._lock:
            track = self._tracks.get(step)
            if track is None or tier in track.reported or (handle is not None and track.handle is not handle):
                return False
            track.reported.add(tier)
            return True

    def _commit(
        self, tier: Tier, writer: StepWriter, step: int, ref: ManifestRef, marker: Marker, assignment: str
    ) -> None:
        """Make the step visible: alone, write the marker; in a job, publish this rank's part
        and wait until rank 0 has heard from every rank and the marker is written."""
        group = self._group
        if group is None:
            writer.commit(encode_marker(dataclasses.replace(marker, manifests=(ref,))))
            return
        coord = group.coord
        writer.publish_part()
        self._first_report(step, tier.name)
        try:
            coord.report(
                step,
                tier.name,
                PartReport(
                    coord.rank, {"name": ref.file, "length": ref.length, "checksum": ref.checksum}, None, assignment
                ),
            )
            if coord.rank == 0:
                body = coord.decide(step, tier.name, lambda refs: _job_marker(marker, refs))
            else:
                body = coord.verdict(step, tier.name, want_marker=group.leads(tier.name))
            # The verdict is "ok": from here on, this part is in a committed step.
            coord.forget_part(step, tier.name)
            if group.leads(tier.name):
                try:
                    tier.write_marker(step, body)
                except Exception as exc:
                    coord.marked(step, tier.name, f"{type(exc).__name__}: {exc}")
                    raise
                coord.marked(step, tier.name)
            else:
                coord.wait_marked(step, tier.name, group.leader[tier.name])
        except CoordinationError:
            raise
        except Exception as exc:
            # A store or marker error once the part is published: whether the step commits
            # is not settled here (rank 0, or another directory's leader, may commit it), so
            # the part stays; if no marker ever lists it, retention removes it.
            raise CoordinationError(f"step {step} on tier {tier.name!r}: {type(exc).__name__}: {exc}") from exc
        finally:
            try:
                coord.acknowledge(step, tier.name, group.leaders[tier.name])
            except Exception as exc:  # the store is gone: the outcome above stands
                logger.warning("tiercheck: could not acknowledge step %d on tier %s: %r", step, tier.name, exc)

    def _uploader_put(self, item: object) -> None:
        assert self._uploader is not None
        self._uploader.put(item)

    # -- tier-1 writer ---------------------------------------------------------------

    def _run_local(self, item: object) -> None:
        tier = self.local
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
            if self.remote is not None:
                self._queue_upload(_Upload(item.step, item.rank, item.handle, item.remote_owners))
        elif self.remote is not None:
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

    def _report(self, error: TierError | None) -> None:
        if error is not None:
            with self._lock:
                self._errors.append(error)
            logger.error("%s", error)

    # -- tier-2 uploader -------------------------------------------------------------

    def _run_remote(self, item: object) -> None:
        tier = self.remote
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
            if item.step in self._deleting:  # a catch-up upload of a step being deleted
                self._catching_up.discard(item.step)
                return
            self._uploading = item.step
        try:
            if item.handle is None and self.local is not None and item.step not in self.local.committed_steps():
                return  # a catch-up upload of a step deleted since (`finally` clears `_uploading`)
            self._copy_from_local(item.step, item.rank, dict(item.remote_owners))
        except Exception as exc:
            error = tier_error(exc, item.step, tier, "uploading")
        finally:
            with self._lock:
                self._uploading = None
                self._catching_up.discard(item.step)
                if error is not None:  # before the step leaves the in-flight list
                    self._owed.add(item.step)
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
            if not self._owed or isinstance(self._keep[tier.name], KeepAll):
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
            self._owed.difference_update(superseded(self._owed, self._keep[tier.name], others))
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
            assert self.remote is not None
            with self._lock:
                uploading = self._uploading
            with self._uploader.cond:
                waiting = [q.step for q in self._uploader.queue if isinstance(q, _Upload) and q.step < upload.step]
                others = [upload.step] + [q.step for q in self._uploader.queue if isinstance(q, StagedSave)]
                if uploading is not None:
                    others.append(uploading)
                doomed = set(superseded(waiting, self._keep[self.remote.name], others))
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
        assert self.remote is not None
        if item.handle is not None:
            self._finish(
                item.step,
                self.remote.name,
                UploadSkippedError(
                    f"step {item.step} was not uploaded to tier {self.remote.name!r}: uploads were behind "
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
        assert self.local is not None
        if self._group is not None:
            self._catch_up_job(tier)
            return
        try:
            local_steps = self.local.committed_steps()
            if not local_steps:
                return
            remote_steps = tier.committed_steps()
        except Exception as exc:
            logger.warning("tiercheck: could not compare tiers at start-up: %r", exc)
            return
        with self._lock:
            steps = plan_catch_up(local_steps, remote_steps, self._keep[tier.name], list(self._tracks))
            self._catching_up.update(steps)
        if steps:
            logger.info("uploading steps %s, committed on tier 1 by an earlier run but not on tier 2", steps)
        for step in steps:
            self._uploader_put(_Upload(step, 0, None))

    def _catch_up_job(self, tier: Tier) -> None:
        """`_catch_up` for a job: rank 0 picks the steps (among those on every rank's tier 1)
        and every rank uploads its part of each."""
        assert self.local is not None and self._group is not None
        try:
            mine = self.local.committed_steps()
        except OSError:
            mine = []
        with self._lock:
            pending = list(self._tracks)

        def plan(common: set[int]) -> list[int]:
            return plan_catch_up(common, tier.committed_steps(), self._keep[tier.name], pending)

        try:
            steps = self._group.coord.agree_catch_up(mine, plan)
        except Exception as exc:
            logger.warning("tiercheck: no catch-up upload at start-up: %r", exc)
            return
        for step in steps:
            owners: dict[Key, int] = {}
            if self._group.node_local:  # tier 2 gets one copy of the replicated keys, as for any step
                try:
                    owners = self._uploaders_of(step)
                except Exception as exc:
                    logger.warning("tiercheck: no catch-up upload of step %d: %r", step, exc)
                    continue
            logger.info("uploading step %d, committed on tier 1 by an earlier run but not on tier 2", step)
            with self._lock:
                self._catching_up.add(step)
            self._uploader_put(_Upload(step, self._group.rank, None, tuple(owners.items())))

    def _uploaders_of(self, step: int) -> dict[Key, int]:
        """Who uploads each replicated key of a tier-1 step (node-local tier 1): the same
        placement `Checkpointer` computes from the live state, here from the manifests of
        this directory, which hold one full copy."""
        assert self.local is not None and self._group is not None
        manifests = list(present_manifests(self.local, step, read_marker(self.local, step), self._group.members))
        if not manifests or not manifests[0].replicated:
            return {}
        sizes = replicated_sizes(manifests)
        keys = manifests[0].replicated
        if set(sizes) != set(keys):
            raise ValueError(f"step {step}: this directory does not hold every replicated key")
        return balance(keys, sizes, self._group.first_members, lambda k: repr(list(k)))

    def _copy_from_local(self, step: int, rank: int, owners: dict[Key, int]) -> None:
        src, dst = self.local, self.remote
        assert src is not None and dst is not None
        # The manifest is checked against the marker before anything else: a copy damaged on
        # tier 1 after its commit must not reach tier 2, least of all under a marker signed
        # anew there for a rewritten manifest (compressed or retargeted).
        marker = read_marker(src, step)
        manifest_bytes, manifest = read_manifest_with_bytes(src, step, rank, marker)
        ref = marker.manifests[rank]
        verify_files(src, step, manifest)  # never spread a copy that went bad on tier 1
        moved = retarget(manifest, owners) if owners else None
        writer = dst.open_step(step, rank, shared=self._group is not None)
        try:
            if moved is not None:  # replicated keys another rank uploads: left out, the rest packed
                shard = manifest.files[0].name
                manifest = moved.manifest
                stored = [self._write_regions(writer, shard, reader_of(src, step, shard), moved)]
            else:
                stored = [copy_file(src, step, f.name, writer, compress=True) for f in manifest.files]
            if dst.codec != "raw" or moved is not None:  # the tier-2 copy records its own shards
                stored_as = [n if dst.codec != "raw" else None for n in stored]
                files = tuple(
                    ShardFile(f.name, f.length, dst.codec, n) for f, n in zip(manifest.files, stored_as, strict=True)
                )
                manifest_bytes = encode_manifest(dataclasses.replace(manifest, files=files))
                ref = ManifestRef(
                    ref.file, len(manifest_bytes), checksum_function(marker.checksum_algorithm)(manifest_bytes)
                )
            writer.write_file(ref.file, memoryview(manifest_bytes))
            self._commit(dst, writer, step, ref, marker, assignment_digest(manifest))
            self._remember_metrics(dst, step, marker.metrics)
        except BaseException as exc:
            if not _part_may_commit(exc):
                writer.abort()
            raise

    # -- shared ------------------------------------------------------------------------

    def _write_staged(self, tier: Tier, job: StagedSave) -> None:
        if tier.capabilities.space_check:
            tier.check_space(job.step, job.plan.total_bytes)
        shard = layout.shard_name(job.rank, job.world_size)
        futures: list[Future[str] | str] = []
        for leaf, off in zip(job.leaves, job.plan.offsets, strict=True):
            if leaf.alias_of is not None:
                futures.append("")  # filled from the first leaf below
            else:
                futures.append(self._hasher.submit(self._staged_checksum, job, off, leaf.nbytes))
        ready = job.progress.wait if job.progress is not None else None
        writer = tier.open_step(job.step, job.rank, shared=self._group is not None)
        # Tier 1 failed and this part goes to tier 2 from host memory: as a tier-1 upload
        # would, leave out the replicated keys other ranks upload.
        owners = dict(job.remote_owners) if tier is self.remote else {}

        def manifest_with(sums: list[str]) -> Manifest:
            return Manifest(
                step=job.step,
                rank=job.rank,
                world_size=job.world_size,
                checksum_algorithm=self._checksum_name,
                files=(ShardFile(shard, job.plan.total_bytes),),
                entries=build_entries(job.leaves, job.plan.offsets, sums, shard),
                tree=job.tree,
                replicated=job.replicated,
            )

        try:
            view = job.buffer.view(job.plan.total_bytes)
            moved = retarget(manifest_with([""] * len(job.leaves)), owners) if owners else None
            if moved is None:
                stored = writer.write_file(shard, view, job.buffer.aligned, compress=True, ready=ready)
            else:
                if ready is not None:
                    ready(len(view))
                stored = self._write_regions(writer, shard, lambda off, n: view[off : off + n], moved)
            sums = [f if isinstance(f, str) else f.result() for f in futures]
            for i, leaf in enumerate(job.leaves):
                if leaf.alias_of is not None:
                    sums[i] = sums[leaf.alias_of]
            doc = manifest_with(sums)
            if moved is not None:
                again = retarget(doc, owners)
                assert again is not None and again.regions == moved.regions
                doc = again.manifest
            sf = doc.files[0]
            doc = dataclasses.replace(
                doc, files=(ShardFile(sf.name, sf.length, tier.codec, stored if tier.codec != "raw" else None),)
            )
            manifest = encode_manifest(doc)
            mname = layout.manifest_name(job.rank, job.world_size)
            writer.write_file(mname, memoryview(manifest))
            ref = ManifestRef(mname, len(manifest), self._checksum(manifest))
            marker = Marker(job.step, job.world_size, self._checksum_name, (), job.metrics)
            # Node-local tier 1: directories hold their own copies of replicated keys, so ranks
            # agree there on which keys are replicated, not on who holds them.
            owners_agree = not (self._group is not None and self._group.node_local and tier is self.local)
            self._commit(tier, writer, job.step, ref, marker, assignment_digest(doc, owners_agree))
            self._remember_metrics(tier, job.step, job.metrics)
        except BaseException as exc:
            for f in futures:
                if not isinstance(f, str):
                    f.cancel()
            if not _part_may_commit(exc):
                writer.abort()
            raise

    def _write_regions(
        self, writer: StepWriter, name: str, read: Callable[[int, int], bytes | memoryview], moved: Retargeted
    ) -> int:
        """Write the packed shard of a retargeted part; returns the bytes stored."""
        block = 8 << 20
        return writer.write_chunks(
            name, lambda: region_chunks(read, moved.regions, moved.length, block), moved.length, compress=True
        )

    def _staged_checksum(self, job: StagedSave, off: int, nbytes: int) -> str:
        if job.progress is not None:
            job.progress.wait(off + nbytes)
        return self._checksum(job.buffer.view(off + nbytes)[off:])

    def _prune(self, tier: Tier, newest: int | None) -> TierError | None:
        if self._group is not None and not self._group.leads(tier.name):
            return None  # one rank per directory prunes it
        with self._retention_locks[tier.name]:
            return self._prune_locked(tier, newest)

    def _prune_locked(self, tier: Tier, newest: int | None) -> TierError | None:
        if isinstance(self._keep[tier.name], KeepAll):
            # Nothing to delete but leftovers, and those only after a failure (or a crash
            # before this session): list once then, not after every step.
            if not self._sweep.pop(tier.name, False):
                return None
            try:
                committed = tier.committed_steps()
                if committed:
                    self._remove_strays(tier, committed[-1], self.in_flight(tier.name))
            except Exception as exc:
                logger.warning("tiercheck: could not look for leftovers on tier %s: %r", tier.name, exc)
            return None
        try:
            committed = tier.committed_steps()
            if tier is self.local:
                with self._lock:  # a failed upload deleted since (a new branch): nothing to keep
                    self._owed.intersection_update(committed)
            # Steps still to be uploaded (or that tier 2 needs) stay on tier 1.
            protected = self._tier1_protected() if tier is self.local else self.in_flight(tier.name)
            policy = self._keep[tier.name]
            metrics = self._metrics_of(tier, committed) if policy.metric_names else None
            doomed = plan_deletions(committed, policy, in_flight=protected, metrics=metrics)
            for step in doomed:
                tier.delete_step(step)
                self._metrics[tier.name].pop(step, None)
                logger.debug("retention deleted step %d from tier %s", step, tier.name)
            if committed:
                self._remove_strays(tier, committed[-1], protected)
        except Exception as exc:
            return tier_error(exc, newest, tier, "applying retention after")
        return None

    def _tier1_protected(self) -> list[int]:
        """Tier-1 steps retention must not delete: in flight on either tier, being uploaded,
        queued for a catch-up upload, or failed to upload while tier 2 would keep them."""
        steps = set(self.in_flight())
        with self._lock:
            steps |= self._catching_up | self._owed
            if self._uploading is not None:
                steps.add(self._uploading)
        return sorted(steps)

    def _remember_metrics(self, tier: Tier, step: int, metrics: tuple[tuple[str, Metric], ...]) -> None:
        if self._keep[tier.name].metric_names:  # only policies ranking by a metric read them
            with self._lock:
                self._metrics[tier.name][step] = dict(metrics)

    def _metrics_of(self, tier: Tier, committed: list[int]) -> dict[int, dict[str, Metric]]:
        """The recorded metrics of the `committed` steps of `tier`: known ones from this
        session's commits, the others read from their markers (once). A marker that cannot
        be read counts as no metrics, so a metric-ranked policy keeps that step."""
        with self._lock:
            known = self._metrics[tier.name]
            present = set(committed)
            for s in [s for s in known if s not in present]:
                del known[s]
            missing = [s for s in committed if s not in known]
        found: dict[int, dict[str, Metric]] = {}
        for s in missing:
            try:
                found[s] = dict(read_marker(tier, s).metrics)
            except Exception as exc:
                logger.warning("tiercheck: cannot read the metrics of step %d on tier %s: %r", s, tier.name, exc)
        with self._lock:
            known.update(found)
            return {s: known.get(s, {}) for s in committed}

    def delete_step(self, step: int, tiers: list[Tier]) -> None:
        """Delete `step` from `tiers` (marker first on each), between retention passes.

        Raises:
            StepInFlightError: `step` is still being written or uploaded.
            TierError: a tier failed; the other tiers were still tried.
        """
        with contextlib.ExitStack() as held:
            for name in sorted(t.name for t in tiers):  # one order everywhere: no deadlock
                held.enter_context(self._retention_locks[name])
            with self._lock:
                if step in self._tracks or self._uploading == step:
                    raise StepInFlightError(
                        f"cannot delete step {step}: it is still being written or uploaded; wait for its "
                        "handle (or Checkpointer.wait()) first",
                        step=step,
                    )
                self._deleting.add(step)
            errors: list[TierError] = []
            try:
                for tier in tiers:
                    try:
                        tier.delete_step(step)
                    except Exception as exc:
                        errors.append(tier_error(exc, step, tier, "deleting"))
                    with self._lock:
                        self._metrics[tier.name].pop(step, None)
            finally:
                with self._lock:
                    self._deleting.discard(step)
        if errors:
            raise errors[0]

    def _remove_strays(self, tier: Tier, newest: int, protected: list[int]) -> None:
        """Data a crash or a failed step left without a marker (a cut deletion or upload, the
        parts of a multi-rank step that did not commit), older than the newest committed step
        and not being written now: finish deleting it."""
        for step in tier.stray_steps() if tier.capabilities.strays else ():
            if step < newest and step not in protected:
                tier.delete_step(step)
                logger.info("removed unmarked leftovers of step %d from tier %s", step, tier.name)


def _run_callback(item: object) -> None:
    assert callable(item)
    try:
        item()
    except Exception:  # the user's callback: say so, keep the thread for the next one
        logger.exception("tiercheck: a done callback raised")


def _part_may_commit(exc: BaseException) -> bool:
    """A rank gave up waiting for the others, but rank 0 may still commit the step with this
    rank's part in it: the part must stay (if the step never commits, retention removes it)."""
    return isinstance(exc, CoordinationError) and not exc.settled


def _job_marker(marker: Marker, refs: list[dict[str, object]]) -> bytes:
    """The commit marker of a multi-rank step, from every rank's manifest reference."""
    manifests = []
    for rank, ref in enumerate(refs):
        name, length, checksum = ref["name"], ref["length"], ref["checksum"]
        if (
            name != layout.manifest_name(rank, marker.world_size)
            or type(length) is not int
            or type(checksum) is not str
        ):
            raise ValueError(f"rank {rank} reported a malformed manifest reference {ref!r}")
        manifests.append(ManifestRef(name, length, checksum))
    return encode_marker(dataclasses.replace(marker, manifests=tuple(manifests)))


def tier_error(exc: BaseException, step: int | None, tier: Tier, doing: str) -> TierError:
    path = getattr(exc, "filename", None) or (tier.path_of(step) if step is not None else tier.location)
    what = f"step {step}" if step is not None else "a step"
    err = TierError(
        f"tier {tier.name!r} failed {doing} {what} at {path}: {type(exc).__name__}: {exc}. "
        "Earlier committed steps are intact.",
        step=step,
        tier=tier.name,
        path=str(path),
    )
    err.__cause__ = exc
    return err
