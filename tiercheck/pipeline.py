"""Background work: the only module that starts threads.

One writer thread per tier-1 `Tier` drains a FIFO of staged saves. For each step it
checksums the host buffer on a helper thread while it writes the shard (both release
the GIL, and CRC-32C runs ~7x faster than the disk, so the checksum never limits the
save), then writes the manifest and the commit marker, releases the host buffer, and
applies retention. Errors are captured and handed to the caller's thread once.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from . import layout
from .checksum import checksum_function
from .errors import TierError
from .events import emit, logger
from .handle import SaveHandle
from .manifest import Manifest, ManifestRef, Marker, build_entries, encode_manifest, encode_marker
from .planner import ShardPlan
from .retention import RetentionPolicy, plan_deletions
from .staging import HostBuffer, HostBufferPool
from .state import JsonNode, Leaf
from .tiers.base import Tier


@dataclass(frozen=True, slots=True)
class StagedSave:
    """Everything the writer needs for one step; the buffer is the pipeline's until done."""

    step: int
    rank: int
    world_size: int
    tree: JsonNode
    leaves: tuple[Leaf, ...]
    plan: ShardPlan
    buffer: HostBuffer
    handle: SaveHandle
    returned_at: float  # monotonic time save() returned


_STOP = object()


class Pipeline:
    """Owns the writer thread, the checksum helper, and the error mailbox."""

    def __init__(
        self,
        tier: Tier,
        pool: HostBufferPool,
        retention: RetentionPolicy,
        checksum: str,
    ) -> None:
        self.tier = tier
        self._pool = pool
        self._retention = retention
        self._checksum_name = checksum
        self._checksum = checksum_function(checksum)
        self._queue: queue.Queue[object] = queue.Queue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[int, StagedSave] = {}
        self._errors: list[TierError] = []
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="tiercheck-checksum")
        self._thread = threading.Thread(target=self._run, name="tiercheck-writer", daemon=True)
        self._thread.start()
        self._closed = False

    # -- caller side -------------------------------------------------------------

    def submit(self, job: StagedSave) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the checkpointer is closed")
            self._pending[job.step] = job
        self._queue.put(job)

    def in_flight(self) -> list[int]:
        with self._lock:
            return sorted(self._pending)

    def wait_idle(self, timeout: float | None = None) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending, timeout)

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
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._hasher.shutdown(wait=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- writer thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            assert isinstance(job, StagedSave)
            error: TierError | None = None
            try:
                self._write(job)
            except Exception as exc:
                error = _tier_error(exc, job.step, self.tier, "writing")
            finally:
                self._pool.release(job.buffer)
            job.handle.stats.tier_s[self.tier.name] = time.monotonic() - job.returned_at
            if error is None:
                error = self._prune(job.step)
            with self._lock:
                if error is not None:
                    self._errors.append(error)
                del self._pending[job.step]
                job.handle._finish(self.tier.name, error)
                self._idle.notify_all()
            if error is not None:
                logger.error("%s", error)
            emit(job.handle.stats)

    def _write(self, job: StagedSave) -> None:
        shard = layout.shard_name(job.rank, job.world_size)
        futures: list[Future[str] | str] = []
        for leaf, off in zip(job.leaves, job.plan.offsets, strict=True):
            if leaf.alias_of is not None:
                futures.append("")  # filled from the first leaf below
            else:
                futures.append(self._hasher.submit(self._checksum, job.buffer.view(off + leaf.nbytes)[off:]))
        writer = self.tier.open_step(job.step, job.rank)
        try:
            writer.write_file(shard, job.buffer.view(job.plan.total_bytes), job.buffer.aligned)
            sums = [f if isinstance(f, str) else f.result() for f in futures]
            for i, leaf in enumerate(job.leaves):
                if leaf.alias_of is not None:
                    sums[i] = sums[leaf.alias_of]
            manifest = encode_manifest(
                Manifest(
                    step=job.step,
                    rank=job.rank,
                    world_size=job.world_size,
                    checksum_algorithm=self._checksum_name,
                    files=((shard, job.plan.total_bytes),),
                    entries=build_entries(job.leaves, job.plan.offsets, sums, shard),
                    tree=job.tree,
                )
            )
            mname = layout.manifest_name(job.rank, job.world_size)
            writer.write_file(mname, memoryview(manifest))
            marker = Marker(
                step=job.step,
                world_size=job.world_size,
                checksum_algorithm=self._checksum_name,
                manifests=(ManifestRef(mname, len(manifest), self._checksum(manifest)),),
            )
            writer.commit(encode_marker(marker))
        except BaseException:
            for f in futures:
                if not isinstance(f, str):
                    f.cancel()
            writer.abort()
            raise

    def _prune(self, newest: int) -> TierError | None:
        try:
            committed = self.tier.committed_steps()
            doomed = plan_deletions(committed, self._retention, in_flight=self.in_flight())
            for step in doomed:
                self.tier.delete_step(step)
                logger.debug("retention deleted step %d from tier %s", step, self.tier.name)
        except Exception as exc:
            return _tier_error(exc, newest, self.tier, "applying retention after")
        return None


def _tier_error(exc: BaseException, step: int, tier: Tier, doing: str) -> TierError:
    path = getattr(exc, "filename", None) or tier.path_of(step)
    err = TierError(
        f"tier {tier.name!r} failed {doing} step {step} at {path}: "
        f"{type(exc).__name__}: {exc}. Earlier committed steps are intact.",
        step=step,
        tier=tier.name,
        path=str(path),
    )
    err.__cause__ = exc
    return err


def run_quietly(fn: Callable[[], object]) -> None:
    """For interpreter-exit hooks: never raise."""
    try:
        fn()
    except Exception:  # pragma: no cover
        logging.getLogger("tiercheck").exception("tiercheck exit hook failed")
