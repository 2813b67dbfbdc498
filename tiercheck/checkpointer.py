"""`Checkpointer`: the facade. It validates, stages, and hands work to the pipeline."""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import Any, TypeVar

from .engine.history import StepHistory
from .engine.peers import PeerCopies, join_peers
from .engine.pipeline import Pipeline
from .engine.stager import SaveStager
from .errors import (
    CheckpointCorruptedError,
    ClosedError,
    InvalidArgumentError,
    NoCheckpointError,
    TiercheckError,
    UnsupportedStateError,
)
from .goodput.runlog import DEFAULT_INTERVAL, RunLog
from .job.coordination import Group, Membership, join_job
from .job.trigger import SaveTrigger, SigtermState, sigterm_handler
from .observe.events import emit_restore, logger
from .observe.progress import ProgressCallback
from .options import REMOTE_RETRY_BUDGET, REMOTE_TIMEOUT, Options, open_tiers
from .plan.retention import RetentionPolicy
from .plan.schedule import SavePolicy
from .state.flatten import metric_values
from .steps.catalog import read_marker
from .steps.handle import DrainReport, SaveHandle, WaitTimeoutError
from .steps.parts import PartPlanner
from .steps.restore import restore_collective, restore_from
from .steps.stage import HostBufferPool, SharedBuffers
from .tiers.base import Tier
from .tiers.memory import SharedMemoryTier
from .tiers.open import open_memory_tier
from .tiers.remote import RemoteTier

__all__ = ["Checkpointer"]

T = TypeVar("T")


class Checkpointer:
    """Asynchronous, tiered checkpoints of a training state.

    `save()` copies the state into reused host buffers and returns; a background writer
    makes the step durable on the local tier (temp name, fsync, rename, commit marker
    last) and applies retention. `restore()` reads the newest committed step back, in
    place, verifying every byte against its checksum.

    Args:
        local: tier 1, a local directory (ideally NVMe). Created if missing.
        remote: tier 2, an fsspec URL (``s3://``, ``gs://``, ``az://``, ``file://``, ``memory://``),
            or a plain path, which is the local filesystem as ``file://`` is (created on demand).
            With `local`, each step committed on tier 1 is uploaded from the tier-1 files;
            alone, it is uploaded straight from the host buffer.
            Either may instead be a `tiercheck.tiers.Tier` built beforehand (named "local" for
            `local`, "remote" for `remote`): it is used as it is, with the options it was built
            with, so the tier options below (and `storage_options` for tier 2) must then keep
            their defaults.
        storage_options: fsspec options for the remote tier (credentials, ``endpoint_url``,
            client timeouts such as S3's ``config_kwargs``).
        keep_local: retention on tier 1: an int n (keep the n newest committed steps),
            a policy (`KeepLast(3) | KeepEvery(1000)`), or None to keep everything.
            The newest committed step and steps being written are never deleted.
        keep_remote: the same for tier 2; None (the default) keeps everything. A step tier 2
            would keep is never deleted from tier 1 before it is on tier 2, and never skipped.
        host_buffers: how many staging buffers (each the size of the state) may exist.
            With 1, a `save()` issued while the previous step is still being written
            waits for it (that wait is counted in the stall); 2 lets it proceed at the cost
            of twice the host memory. Default: 1, or ``keep_memory + 1`` with ``memory=True``
            (tier 0 keeps its newest step while the next save copies).
        checksum: "crc32c" (default) or "xxh3_64"; both run ~12 GB/s, faster than disks.
        direct_io: write shards with O_DIRECT where the filesystem supports it, so the
            bytes skip the page cache and training keeps its CPU and memory bandwidth.
        fsync: flush before commit. Off means a power loss may lose or tear steps that
            were already reported committed (a process crash still cannot).
        local_write_rate: cap tier-1 writes at this many bytes/s (None: no cap).
        remote_write_rate: cap uploads at this many bytes/s (None: no cap).
        remote_retry_budget: seconds a transient object-store failure (connection refused or
            reset, timeout, 5xx, throttling) is retried, with exponential backoff and jitter,
            before the upload is reported failed. Covers an outage of that length.
        remote_timeout: seconds one attempt of one object-store call may take, plus 1 s per
            MiB it moves, before it counts as a transient failure (a hung server cannot stall
            an upload forever). For S3 it is also botocore's connect/read timeout (put into
            ``storage_options["config_kwargs"]`` unless you set it there yourself).
        upload_backlog: when tier 2 falls behind, "newest" (default) skips the pending steps
            that `keep_remote` would delete anyway once newer ones are uploaded, so with
            ``keep_remote=KeepLast(n)`` the backlog (and the tier-1 steps kept for it) stays
            bounded by n plus milestones; steps tier 2 would keep (`KeepEvery` milestones,
            everything under the default ``keep_remote=None``) are always uploaded. "all"
            uploads every step, in order.
        remote_concurrency: parts of one upload, or ranges of one read, in flight at once on
            tier 2 (S3, Azure, GCS). One connection carries ~50-100 MB/s; a node's uplink needs
            several. An upload holds at most this many parts beyond the host buffer; see
            docs/remote.md.
        remote_part_size: bytes per part of a multipart upload (default 16 MiB; more when a
            shard would need more parts than the store allows, less for a shard smaller than
            `remote_concurrency` parts). Larger parts mean fewer requests per second, which
            matters with thousands of ranks (S3: 3,500 PUT/s per prefix; docs/scaling.md).
        remote_compression: None (default) or "zstd": store shards zstd-1 compressed on tier 2.
            Measured here: ~0.65 GB/s per core, ratio 1.08 on fp32 and 1.29 on bf16 weights;
            worth it only when the uplink is slower than that.
        overlap: the default for `save(..., overlap=)`: let `save()` return before module
            parameters and optimizer state are copied, overlapping the copy with the next
            forward/backward (see `save`).
        low_priority: give the writer, uploader and checksum threads the lowest
            best-effort I/O priority (Linux), so training's own reads from a shared disk
            come first. Their CPU priority stays that of the loop (nice 10 delayed durable
            by ~20% and saved no training time: docs/performance.md).
        rank, world_size: this process's place in a multi-rank job. By default taken from
            the initialised default process group (torchrun), else 0 of 1. With more than one
            rank, every rank must create its Checkpointers in the same order, call `save`
            with the same steps and `restore` together (it is collective); see docs/scaling.md.
        store: the ``torch.distributed.Store`` the ranks coordinate through (default: the
            default process group's). Only this store is used, on a connection of its own,
            never a collective of the training process group.
        replicated: top-level keys of the state that hold the same value on every rank
            (DDP: ``("model", "optimizer")``), or True for all of them. Each is written by
            one rank per tier-1 directory (once in all if the ranks share one) and once on
            tier 2, and can be restored by a job with a different number of ranks. Other
            keys are per rank (sharded state such as FSDP2 DTensors, data-loader position, RNG).
        replicated_writer: which rank writes each replicated key: "balance" (default: keys
            spread over the ranks by size, largest first) or one rank's number. When tier 1 is
            node-local (ranks do not all share one directory), every directory keeps its own
            copy, balanced over the ranks sharing it, and tier 2 gets one copy, uploaded by the
            ranks of rank 0's directory; a rank number is then not used.
        coordination_timeout: seconds a rank waits for the others at one point of a save or
            a restore before it gives up (the save then fails with a TierError; nothing
            hangs forever when a rank dies).
        run_log_interval: seconds between flushes of the run log (``.tiercheck-runlog/`` in
            the tier-1 directory, else on tier 2: at most one rewrite a minute), which
            `tiercheck report` and `tiercheck plan` read: each save's stall and durable
            times, restores, drains, errors and, for a loop wrapped in `timed`, its data
            wait and compute, aggregated per interval (about 85 KB per hour and rank at
            10 s), plus a heartbeat file overwritten about once a second, so a crash loses at
            most a second of it on tier 1 (one interval on tier 2). Nothing is written before
            the first `save()` or timed batch. None keeps no run log. See docs/goodput.md.
        interval: when `should_save`/`maybe_save` say a save is due: a `SavePolicy` such as
            ``Every(steps=500) | Every(seconds=1800)`` (None: only after a preemption signal,
            see `install_sigterm_handler`). In a job, the time-based part follows rank 0's
            clock and every rank saves at the same step.
        memory: tier 0 (tier name "memory"): the host buffers are files of a shared-memory
            filesystem, and each step is committed there (manifest, marker last) as soon as
            its copy is checksummed, with no extra copy and no extra memory. The memory
            outlives the process, not the node: a restarted process of the same job
            (`job_id`) restores from it first, every byte verified, then from tier 1 and 2.
            A filesystem that is missing, too small or full turns tier 0 off with one
            warning; the other tiers go on. See docs/design.md ("Tier 0").
        memory_dir: the shared-memory directory (default ``/dev/shm``). Ranks giving the same
            directory are one node; give ranks that share `local` the same one.
        job_id: the job's identity, which a restarted process must give again to find its
            tier 0 (default: torchrun's ``TORCHELASTIC_RUN_ID``, which its restarts keep,
            else derived from the tier-1 directory, else from the tier-2 location).
        keep_memory: steps kept on tier 0 (the newest; retention as ``keep_local``).
        memory_peers: copies of each rank's tier-0 step kept on other nodes (0: none).
        memory_peer_rate: cap on the bytes/s sent to peers (None: no cap).
        memory_ttl: seconds after which a Checkpointer's start-up removes the tier-0 files of
            a job that never came back (no live process holds them); `tiercheck memory clean`
            does it by hand.

    Raises:
        InvalidArgumentError: no tier given, or an invalid option (also a ValueError).

    A process forked while a Checkpointer exists gets an inert copy: its `close()` returns
    at once and its other methods raise `ClosedError`; the parent's saves are unaffected.

    Example:
        >>> ckpt = tiercheck.Checkpointer(local="ckpt/run7", keep_local=2)  # doctest: +SKIP
        >>> start = (ckpt.restore(state) or -1) + 1                          # doctest: +SKIP
        >>> for step in range(start, n_steps):                               # doctest: +SKIP
        ...     train_step()
        ...     if step % 100 == 0:
        ...         ckpt.save(step, state)
        >>> ckpt.close()                                                     # doctest: +SKIP
    """

    def __init__(
        self,
        local: str | os.PathLike[str] | Tier | None = None,
        remote: str | os.PathLike[str] | Tier | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keep_local: int | RetentionPolicy | None = 2,
        keep_remote: int | RetentionPolicy | None = None,
        *,
        host_buffers: int | None = None,
        checksum: str = "crc32c",
        direct_io: bool = True,
        fsync: bool = True,
        local_write_rate: float | None = None,
        remote_write_rate: float | None = None,
        remote_retry_budget: float = REMOTE_RETRY_BUDGET,
        remote_timeout: float = REMOTE_TIMEOUT,
        upload_backlog: str = "newest",
        remote_compression: str | None = None,
        remote_concurrency: int = 8,
        remote_part_size: int = 16 << 20,
        overlap: bool = False,
        low_priority: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        store: Any = None,
        replicated: bool | Iterable[str | int] = False,
        replicated_writer: int | str = "balance",
        coordination_timeout: float = 600.0,
        run_log_interval: float | None = DEFAULT_INTERVAL,
        interval: SavePolicy | None = None,
        memory: bool = False,
        memory_dir: str | os.PathLike[str] | None = None,
        job_id: str | None = None,
        keep_memory: int = 1,
        memory_peers: int = 0,
        memory_peer_rate: float | None = None,
        memory_ttl: float = 86400.0,
    ) -> None:
        opts = Options.validate(**{k: v for k, v in locals().items() if k != "self"})
        job = opts.job
        self._local, self._remote = open_tiers(opts.tiers, _TIER_DEFAULTS)
        if isinstance(self._remote, RemoteTier):  # before the pipeline can upload anything
            self._remote.sweep_before_upload(job.rank, job.world_size)
        self._memory = _open_tier0(opts, self._local, self._remote)
        self._tiers: list[Tier] = [t for t in (self._memory, self._local, self._remote) if t is not None]
        self.rank = job.rank
        self.world_size = job.world_size
        self._lock = threading.RLock()  # save/restore/close are serialised
        self._closed = False
        self._group = join_job(job, self._local, self._remote, self._memory)
        self._peers = _join_peers(opts, self._group, self._memory)
        self._pool = _host_buffers(opts, self._memory)
        self._pipeline = Pipeline(
            self._local, self._remote, self._pool, self._group, retention=opts.retention, save=opts.save,
            memory=self._memory, keep_memory=opts.memory.keep_memory, peers=self._peers,
        )
        self._planner = PartPlanner(job, self._group, has_remote=self._remote is not None)
        self._stager = SaveStager(self._pool, self._pipeline, opts.save, job, [t.name for t in self._tiers])
        self._history = StepHistory(self._tiers, self._group, self._pipeline, job)
        side_tasks = self._pipeline.submit_side_task if self._remote is not None else None
        self._runlog = RunLog(self._local, self._remote, job.rank, job.world_size, opts.run_log.interval, side_tasks)
        self._trigger = SaveTrigger(opts.save.interval, self._group.save_requests(), job.rank)
        # A fork() child gets a copy of this object but none of the pipeline's threads: it
        # compares its pid with this one and does nothing (see `_check_process`).
        self._pid = os.getpid()
        # Runs when the Checkpointer is garbage-collected unclosed, or at interpreter exit
        # (weakref.finalize hooks atexit), so pending saves are drained, not dropped.
        self._finalizer = weakref.finalize(
            self, _finalize, self._pipeline, self._pool, self._tiers[-1].location, self._runlog, self._pid
        )

    # -- context manager -------------------------------------------------------------

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # don't mask the user's exception with a checkpoint error
            try:
                self.close()
            except TiercheckError as err:
                logger.error("tiercheck: error while closing after an exception: %s", err)

    # -- queries ---------------------------------------------------------------------

    def _tier_list(self, tier: str | None) -> list[Tier]:
        if tier is None:
            return self._tiers
        matches = [t for t in self._tiers if t.name == tier]
        if not matches:
            raise InvalidArgumentError(f"tier must be one of {[t.name for t in self._tiers]} or None, got {tier!r}")
        return matches

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending, on `tier` ("local"/"remote") or on any tier."""
        found: set[int] = set()
        for t in self._tier_list(tier):
            found.update(t.committed_steps())
        return sorted(found)

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step on `tier` (or on any tier), or None."""
        steps = self.steps(tier)
        return steps[-1] if steps else None

    # -- the training loop -----------------------------------------------------------

    def timed(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield the items of `iterable` (a data loader), timing the loop for the run log.

        The time spent in the loader's ``next()`` is data wait; the time from an item until
        the next request is the loop body (compute), less the `save`/`restore`/`wait`/
        `drain` calls made in it. Both are summed per flush interval, never written per
        step; the cost is a few microseconds per item (docs/goodput.md). `tiercheck report` turns them into
        compute, data wait and redone work per run. Without a run log
        (``run_log_interval=None``) the items pass through untouched.

        Example:
            >>> for batch in ckpt.timed(loader):      # doctest: +SKIP
            ...     loss = train_step(batch)
            ...     step += 1
            ...     if step % 500 == 0:
            ...         ckpt.save(step, state)
        """
        if not self._runlog.enabled:
            return iter(iterable)
        return self._runlog.timed(iterable)

    # -- save ------------------------------------------------------------------------

    def prepare(self, state: Mapping[Any, Any]) -> None:
        """Allocate (and pre-fault) the host buffer for `state` ahead of the first `save()`.

        The first save otherwise pays for allocating and touching a buffer as large as the
        state; call this at start-up, e.g. right after building the model and optimizer.

        Like the first `save()`, it makes this Checkpointer the writer of its directory (see
        `save`) and starts the catch-up upload of steps an earlier run left on tier 1 only: a
        restarted job that may not save again should call it.

        Raises:
            DirectoryInUseError: another live Checkpointer writes this rank of the directory.
        """
        self._check_open()
        with self._lock:
            self._check_open()
            part = self._planner.part(state)
            self._pipeline.become_writer(self.rank, self.world_size)
            self._pipeline.start_catch_up()
            self._stager.prepare(part)

    def save(
        self,
        step: int,
        state: Mapping[Any, Any],
        *,
        overlap: bool | None = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Snapshot `state` as `step` and return once it is copied into host memory.

        The caller may modify every tensor in `state` as soon as this returns; the saved
        step is the state as it was during the call.

        With ``overlap=True`` (or ``Checkpointer(overlap=True)``), tensors that only an
        optimizer in `state` changes (the module parameters it updates, and its own state)
        are copied on a background thread after `save()` returns, while the next
        forward/backward runs; everything else (buffers such as BatchNorm statistics, plain
        tensors, RNG states, parameters no optimizer in `state` updates) is still copied
        before returning. Each optimizer in `state` gets a pre-step hook that waits for that
        copy, so the saved step is still exactly the state at `save()`. Code that changes
        those tensors outside `optimizer.step()` (an EMA update, a second optimizer sharing
        parameters) must call `handle.wait_staged()` first: a deferred tensor whose version
        counter moved before its copy finished fails the step (`TierError` caused by
        `SnapshotChangedError`) instead of committing a torn snapshot. Writes through
        ``tensor.data`` do not move the version counter and are not detected.

        A step must be newer than every step saved or committed before, except right after
        `restore()`: saving a step newer than the restored one starts a new branch, and the
        committed steps after the restored one (the abandoned branch) are deleted first, so
        that a later restore can never pick them up.

        ``metrics={"val_loss": 0.31, "epoch": 3}`` records numbers with the step, in its
        commit marker: `metrics(step)` and ``tiercheck ls`` read them without loading any
        tensor, and `KeepBest` retention ranks steps by them. Values are ints or floats
        (NaN, infinities and -0.0 kept exactly) or one-element real tensors/numpy values
        (read with ``.item()``, exactly). In a job, rank 0's metrics are recorded.

        The first `save()` (or `prepare()`) makes this Checkpointer the writer of this rank's
        part of the tier-1 directory: it takes an OS lock there (released at `close()` or when
        the process dies), removes the leftovers of interrupted saves, and starts uploading the
        steps an earlier run committed on tier 1 only that tier 2 would keep. Until then it
        only reads, so an evaluation script can `restore()` while a job writes.

        Raises:
            UnsupportedStateError: a value that cannot be stored; names its key path
                (or a metric that is not a number; names the metric).
            DirectoryInUseError: another live Checkpointer writes this rank of the directory.
            StepConflictError: `step` is not newer than the existing or pending steps.
            TierError: an earlier background save failed (raised once).
            ClosedError: the Checkpointer is closed, or was inherited through fork().
        """
        t0 = time.perf_counter()
        self._check_process()  # before the lock: a fork() child may inherit it held
        with self._lock:
            self._check_open()
            if type(step) is not int or step < 0:
                raise UnsupportedStateError(f"step must be a non-negative int, got {step!r}")
            try:
                try:
                    self._raise_background_errors()
                    recorded = metric_values(metrics)
                    part = self._planner.part(state, params=self._stager.wants_overlap(overlap))
                    self._pipeline.become_writer(self.rank, self.world_size)
                    self._history.claim(step)
                    handle = self._stager.stage(step, part, recorded, overlap)
                except BaseException as exc:
                    # Nothing reached the pipeline (or it was taken back): tell the other ranks now.
                    self._group.abandon_save(step, [t.name for t in self._tiers], exc)
                    raise
                del part  # its tensors (a state_dict()'s detached views: 5,000 at 20,000 leaves)
                # go here, in save(), not while the writer starts (below) and takes the GIL
                self._history.saved(step)
                self._trigger.saved(step)
                handle.stats.stall_s = time.perf_counter() - t0
                self._runlog.saved(handle)
            finally:
                self._stager.release()  # the writer goes on once save() is done with the GIL
            return handle

    # -- when to save ----------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether to save at `step`: the `interval` policy says so, or a preemption signal
        asked for a fresh snapshot (`install_sigterm_handler(fresh=True)`).

        Call it once per step (asking again for the same step gives the same answer), with
        the same steps on every rank of a job: every rank then gets the same answer. Steps
        decide alone; the clock (``Every(seconds=)``) is rank 0's, and a save that rank 0's
        clock or a signal on any rank asks for happens on every rank at the first step of
        theirs after every rank has seen the request (one store call per step; the step the
        request is first seen on is not waited at, so this never deadlocks with a training
        loop's own collectives). Alone, a signal makes the very next call true.

        Raises:
            CoordinationError: another rank did not see a save request within
                `coordination_timeout` (it stopped calling `should_save`).
        """
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        self._check_open()
        return self._trigger.should_save(step)

    def maybe_save(self, step: int, state: Mapping[Any, Any], **kwargs: Any) -> SaveHandle | None:
        """`save(step, state, **kwargs)` if `should_save(step)`, else None.

        After a preemption signal (`install_sigterm_handler(fresh=True)`), the save it asked
        for is drained (tier 1 first, then tier 2, within what is left of the grace period),
        and on the rank that received the signal, the signal then does what it did before
        the handler was installed (the default: terminate the process).

        Example:
            >>> ckpt = tiercheck.Checkpointer("ckpt", interval=tiercheck.Every(steps=500))  # doctest: +SKIP
            >>> for step in range(start, n_steps):                                          # doctest: +SKIP
            ...     train_step()
            ...     ckpt.maybe_save(step, state)
            ...     if ckpt.preempted:
            ...         break
        """
        trigger = self._trigger
        preempted_before = trigger.preempted
        if not self.should_save(step):
            return None
        handle = self.save(step, state, **kwargs)
        if trigger.preempted and not preempted_before:
            report = self.drain(trigger.grace_left())
            logger.warning("tiercheck: preemption snapshot drained: %s", report)
            trigger.after_preemption_save()
        return handle

    @property
    def preempted(self) -> bool:
        """True once a preemption save was agreed (on every rank of a job, whichever rank
        received the signal): a training loop may stop after that save."""
        return self._trigger.preempted

    # -- deleting and reading metadata -------------------------------------------------

    def delete(self, step: int) -> None:
        """Delete committed `step` from every tier: on each, the commit marker first, so a
        crash midway leaves the step invisible, never half there.

        The newest committed step may be deleted too (`latest_step()` is then the one
        before it); a step still being written or uploaded by a save is refused. A step the
        start-up catch-up upload is copying (an earlier run's, which no handle tracks) is
        deleted, from every tier holding it, as soon as that upload ends. In a job, call it on
        every rank: one rank per directory deletes.

        Like `save()`, it makes this Checkpointer the writer of its tier-1 directory.

        Raises:
            StepInFlightError: `step` is still being written or uploaded (wait for it first).
            NoCheckpointError: `step` is not committed on any tier.
            TierError: a tier failed to delete it (the other tiers were still tried).
            DirectoryInUseError: another live Checkpointer writes this directory.
            ClosedError: the Checkpointer is closed, or was inherited through fork().
        """
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"step must be a non-negative int, got {step!r}")
        self._check_process()
        with self._lock:
            self._check_open()
            self._history.delete(step)

    def metrics(self, step: int) -> dict[str, int | float]:
        """The metrics recorded with committed `step` (`save(..., metrics=)`), read from its
        commit marker only (no tensor is loaded); {} if none were recorded.

        Raises:
            NoCheckpointError: `step` is not committed on any tier.
            CheckpointCorruptedError: its marker fails verification on every tier holding it.
        """
        errors: list[str] = []
        for tier in self._tiers:
            try:
                return dict(read_marker(tier, step).metrics)
            except NoCheckpointError:
                continue
            except (CheckpointCorruptedError, OSError) as exc:
                errors.append(f"tier {tier.name!r}: {exc}")
        if errors:
            raise CheckpointCorruptedError(f"cannot read the metrics of step {step}: {'; '.join(errors)}")
        where = ", ".join(f"{t.name}={t.location}" for t in self._tiers)
        raise NoCheckpointError(f"step {step} is not committed on any tier ({where})")

    # -- sync points -----------------------------------------------------------------

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _check_process(self) -> None:
        if self._forked():
            raise ClosedError(
                f"this Checkpointer was created by process {self._pid}; process {os.getpid()} inherited it "
                "through fork() without its background threads and cannot use it: create a new Checkpointer"
            )

    def _check_open(self) -> None:
        self._check_process()
        if self._closed:
            raise ClosedError("this Checkpointer is closed; create a new one to save or restore")

    def _raise_background_errors(self) -> None:
        error = self._pipeline.take_error(lambda e: self._runlog.errored(e.step, e.tier, str(e)))
        if error is not None:
            raise error

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is durable on every tier and retention ran.

        Raises:
            TierError: a background save failed since the last sync point (raised once).
            WaitTimeoutError: `timeout` seconds passed first.
            ClosedError: called in a fork() child of the process that created it.
        """
        self._check_process()
        t0 = time.perf_counter()
        try:
            self._wait(timeout)
        finally:
            self._runlog.waited(time.perf_counter() - t0)

    def _wait(self, timeout: float | None = None) -> None:
        if not self._pipeline.wait_idle(timeout):
            raise WaitTimeoutError(f"pending saves {self._pipeline.in_flight()} not durable after {timeout}s")
        self._raise_background_errors()

    def drain(self, timeout: float | None = None) -> DrainReport:
        """Make pending snapshots durable within `timeout` seconds: tier 1 first (fast), then
        tier 2 as time allows. For preemption: it never raises a background error, it
        reports it. The Checkpointer stays usable.

        Returns:
            A `DrainReport`: the newest step this session made durable on each tier, the
            steps still pending per tier, and the background errors (now consumed).

        Raises:
            ClosedError: called in a fork() child of the process that created it.
        """
        self._check_process()
        t0 = time.perf_counter()
        report = self._pipeline.drain(timeout)
        logger.warning("tiercheck drain: %s", report)
        self._runlog.drained(report, time.perf_counter() - t0)
        return report

    def install_sigterm_handler(self, grace_s: float = 30.0, *, fresh: bool = False) -> None:
        """Handle SIGTERM (preemption). Call from the main thread.

        By default, the handler drains for up to `grace_s` seconds (making the newest
        snapshot already in host memory durable), then lets the signal do what it did
        before (the previous handler, or terminate).

        With ``fresh=True`` the handler only takes note: the next `should_save` is true (on
        every rank of a job at the same step, agreed through the job's store, also when one
        rank alone received the signal), so a fresh snapshot of the current state is taken;
        `maybe_save` then drains it within what is left of `grace_s` and lets the signal do
        what it did before, on the rank(s) that received it; `preempted` turns true on every
        rank. The training loop must keep calling `should_save`/`maybe_save` for this.
        """
        previous = signal.getsignal(signal.SIGTERM)
        me = weakref.ref(self)
        state = SigtermState(grace_s, previous)
        state.before_deliver = lambda: _abort_uploads(me())
        self._trigger.sigterm = state if fresh else None
        self._trigger.handler = state

        def live() -> SaveTrigger | None:
            ckpt = me()
            usable = ckpt is not None and not ckpt._closed and not ckpt._forked()
            return ckpt._trigger if usable and ckpt is not None else None

        def drain(grace: float) -> None:
            ckpt = me()
            if ckpt is not None:
                ckpt.drain(grace)

        signal.signal(signal.SIGTERM, sigterm_handler(state, fresh, live, drain))

    def close(self) -> None:
        """Drain pending saves, stop the writer, free the host buffers. Idempotent.

        In a fork() child of the process that created it, it only detaches the exit-time
        drain and returns: the threads and pending saves are the parent's.

        Under `install_sigterm_handler`, a SIGTERM that lands while close drains (and one
        the ``fresh=True`` handler noted that no `maybe_save` delivered) is delivered once
        close has drained, or when its grace period ends first.

        Raises:
            TierError: a background save failed since the last sync point (raised once).
        """
        if self._forked():  # no lock: a parent's thread may have held it at the fork
            self._finalizer.detach()
            return
        sig = self._trigger.handler
        if sig is None or sig.closing or self._closed:
            self._close(None)
            return
        sig.closing = True
        try:
            self._close(sig)
        except BaseException as exc:
            if sig.undelivered:  # the signal may end the process: say first what failed
                logger.error("tiercheck: close() failed: %s; delivering SIGTERM now", exc)
            raise
        finally:
            sig.closing = False
            if sig.undelivered:
                sig.deliver()

    def _close(self, sig: SigtermState | None) -> None:
        # Without the lock the first time: a done callback may call delete() or metrics().
        if not self._closed and not self._pipeline.wait_closing(sig):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer.detach()
            self._stager.unguard()
            t0 = time.perf_counter()
            if not self._pipeline.wait_closing(sig):
                return
            self._runlog.close(time.perf_counter() - t0)
            if not self._pipeline.wait_closing(sig):  # the run log's last tier-2 write, if it has one
                return
            self._pipeline.close()
            self._pool.clear()
            if self._memory is not None and self._pipeline.writing and not (sig is not None and sig.received):
                # A finished job's memory goes; a preempted one keeps it for its restart.
                self._memory.close_job()
            self._raise_background_errors()

    # -- restore ---------------------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[Any, Any],
        step: int | None = None,
        strict: bool = True,
        *,
        progress: ProgressCallback | None = None,
    ) -> int | None:
        """Restore `state` in place from the newest committed step (or exactly `step`).

        The template becomes equal to the checkpoint, reusing its memory
        (docs/restore.md has the rules):

        - a tensor or array of the same shape and dtype is filled in place (same object);
          one of another shape or dtype is an error; one on the meta device is replaced by
          the checkpoint's value;
        - a stateful object gets `load_state_dict` with fresh containers (modules and
          optimizers lend their own tensors to the read; other objects get fresh tensors);
        - plain values, lists and tuples take the checkpoint's value; a nested dict gets
          every key the checkpoint holds. Only the top level may name a subset of the
          saved keys.

        Pending saves are waited for first.

        Args:
            state: the template: a mutable mapping, such as the one given to `save()`.
            step: restore exactly this step instead of the newest committed one.
            strict: when False, a template key the checkpoint lacks (a metric or an EMA
                added to a running job) is left as it is and reported in a warning and a
                ``restore_missing_keys`` event, instead of raising.
            progress: called as ``progress(done_bytes, total_bytes)`` while the step's
                bytes are read (`tiercheck.observe.progress`; ``terminal_bar`` draws a bar).

        Returns:
            The restored step, or None when no checkpoint exists on any tier.

        Raises:
            NoCheckpointError: `step` was given and is not committed anywhere.
            CheckpointCorruptedError: `step` was given and fails verification, or every
                committed step does (without `step`, a damaged step is skipped with a
                warning naming it and the next older one is tried).
            StateMismatchError: the template does not fit the checkpoint (names the key path).
            InvalidArgumentError: `state` is not a mutable mapping, or `step` is not a
                non-negative int.
            ClosedError: the Checkpointer is closed, or was inherited through fork().
        """
        self._check_process()
        if not isinstance(state, MutableMapping):
            raise InvalidArgumentError(f"restore() needs a mutable mapping as template, got {type(state).__name__}")
        if step is not None and (type(step) is not int or step < 0):
            raise InvalidArgumentError(f"step must be a non-negative int or None, got {step!r}")
        self._pipeline.wait_idle()  # without the lock first: a done callback may call delete()
        with self._lock:
            self._check_open()
            t0 = time.perf_counter()
            self._wait()
            if isinstance(self._group, Group):
                if self._peers is not None:  # a replaced node's ranks get their tier-0 part back first
                    self._peers.fetch_replicas()
                found = restore_collective(
                    self._group.coord,
                    self._local,
                    self._remote,
                    state,
                    step,
                    self.rank,
                    self.world_size,
                    strict,
                    progress,
                    memory=self._memory,
                )
            else:
                found = restore_from(
                    self._tiers, state, step, self.rank, strict, world_size=self.world_size, progress=progress
                )
            took = time.perf_counter() - t0
            self._runlog.restored(None if found is None else found.step, took, None if found is None else found.tier)
            if found is None:
                return None
            emit_restore(found.step, found.tier, took)
            self._history.restored(found.step, found.committed)
            return found.step


def _open_tier0(opts: Options, local: Tier | None, remote: Tier | None) -> SharedMemoryTier | None:
    """Tier 0 when asked for and its directory can hold it (else None, with one warning)."""
    m = opts.memory
    if not m.memory:
        return None
    return open_memory_tier(m.memory_dir, m.job_id, local, remote, opts.job.rank, m.memory_ttl)


def _join_peers(opts: Options, group: Membership, memory: SharedMemoryTier | None) -> PeerCopies | None:
    """The copies of tier 0 on other nodes (collective in a job), when asked for."""
    m = opts.memory
    if memory is None or not m.memory_peers or not isinstance(group, Group):
        return None
    return join_peers(group, memory, m.memory_peers, m.keep_memory, m.memory_peer_rate)


def _host_buffers(opts: Options, memory: SharedMemoryTier | None) -> HostBufferPool:
    """The pool, its buffers in tier 0's shared memory when it is on; the memory it may need
    is stated (docs/design.md): host buffers plus the copies it holds for other nodes, one more
    per source than `keep_memory` (the copy being received while the newest complete one stays)."""
    n = opts.save.host_buffers
    copies = n + opts.memory.memory_peers * (opts.memory.keep_memory + 1)
    return HostBufferPool(n, None if memory is None else SharedBuffers(memory, opts.job.rank, copies))


def _abort_uploads(ckpt: Checkpointer | None) -> None:
    """Before SIGTERM goes on: abort the multipart uploads a drain out of grace left in
    flight, so that the store keeps none of their parts (the step stays invisible)."""
    remote = None if ckpt is None else ckpt._remote
    if not isinstance(remote, RemoteTier):
        return
    try:
        n = remote.abort_uploads_in_flight()
    except Exception as exc:  # the restarted job's sweep, or the bucket's lifecycle rule, is the backstop
        logger.warning("tiercheck: could not abort the uploads in flight before SIGTERM: %r", exc)
        return
    if n:
        logger.warning("tiercheck: aborted %d multipart uploads in flight before SIGTERM", n)


def _finalize(pipeline: Pipeline, pool: HostBufferPool, where: str, runlog: RunLog, pid: int) -> None:
    if os.getpid() != pid:
        # A fork() child exiting: the pipeline's threads and pending saves are the parent's,
        # so waiting here would wait for threads that do not exist in this process.
        return
    pending = pipeline.in_flight()
    warnings.warn(
        f"tiercheck: Checkpointer for {where} was not closed (pending steps: {pending or 'none'}); "
        "draining it now. Call close() or use it as a context manager.",
        ResourceWarning,
        stacklevel=2,
    )
    t0 = time.perf_counter()
    pipeline.wait_idle(timeout=600)
    runlog.close(time.perf_counter() - t0)
    pipeline.wait_idle(timeout=60)
    pipeline.close(timeout=10)
    pool.clear()


_TIER_DEFAULTS = {
    name: p.default for name, p in inspect.signature(Checkpointer.__init__).parameters.items() if name != "self"
}
