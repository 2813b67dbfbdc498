"""`SaveHandle`: the caller's view of one save as it becomes durable tier by tier."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import ClosedError, InvalidArgumentError, TiercheckError, TierError
from ..observe.events import SaveStats

__all__ = ["DoneCallback", "DrainReport", "SaveHandle", "WaitTimeoutError"]


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What `Checkpointer.drain()` achieved.

    Attributes:
        durable: per tier, the newest step this session made durable there (None: none).
        pending: per tier, steps still not durable there when the drain ended.
        errors: background errors the drain collected (they will not be raised again).
    """

    durable: dict[str, int | None]
    pending: dict[str, list[int]]
    errors: tuple[TierError, ...] = ()


DoneCallback = Callable[["SaveHandle", str, "TiercheckError | None"], None]
"""``fn(handle, tier, error)``: see `SaveHandle.add_done_callback`."""


class WaitTimeoutError(TiercheckError, TimeoutError):
    """`wait(timeout=...)` ran out before the save was durable."""


class SaveHandle:
    """Returned by `Checkpointer.save`; tracks one step on every configured tier.

    Example:
        >>> h = ckpt.save(100, state)       # doctest: +SKIP
        >>> h.wait("local")                  # durable on tier 1  # doctest: +SKIP
        >>> h.done()                         # durable on every tier  # doctest: +SKIP
    """

    def __init__(
        self,
        step: int,
        tiers: Sequence[str],
        on_error_seen: Callable[[TierError], None],
        call_soon: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.step = step
        self.tiers = tuple(tiers)
        self.stats = SaveStats(step=step)
        self.started_at = time.monotonic()  # save() creates the handle as it starts; tier times count from here
        self._events = {t: threading.Event() for t in self.tiers}
        self._staged = threading.Event()
        self._staged.set()  # cleared by the checkpointer for an overlapped save
        self._errors: dict[str, TiercheckError] = {}
        self._on_error_seen = on_error_seen
        self._call_soon = call_soon
        self._lock = threading.Lock()
        self._callbacks: list[DoneCallback] = []
        self._pid = os.getpid()

    def __repr__(self) -> str:
        state = {
            t: ("failed" if t in self._errors else "done" if e.is_set() else "pending") for t, e in self._events.items()
        }
        return f"SaveHandle(step={self.step}, {state})"

    def _tiers(self, tier: str | None) -> tuple[str, ...]:
        if tier is None:
            return self.tiers
        if tier not in self._events:
            raise InvalidArgumentError(f"tier must be one of {self.tiers} or None, got {tier!r}")
        return (tier,)

    def _check_process(self, pending: bool) -> None:
        """A fork() child never sees a pending save finish: its threads are the parent's."""
        if pending and os.getpid() != self._pid:
            raise ClosedError(
                f"step {self.step} is being saved by process {self._pid}; this process inherited its "
                "handle through fork() and cannot wait for it"
            )

    def staged(self) -> bool:
        """True once every byte of the state is copied into host memory."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot is complete in host memory; after this the state may be
        changed in any way. Only an overlapped save (`save(..., overlap=True)`) returns
        before that; its optimizers wait for it by themselves before stepping.

        Raises:
            WaitTimeoutError: `timeout` seconds passed first.
            ClosedError: called in a fork() child while the copy is pending.
        """
        self._check_process(not self._staged.is_set())
        if not self._staged.wait(timeout):
            raise WaitTimeoutError(f"step {self.step} not staged after {timeout}s")

    def done(self, tier: str | None = None) -> bool:
        """True once the step is durable (or failed) on `tier` (every tier if None)."""
        return all(self._events[t].is_set() for t in self._tiers(tier))

    def wait(self, tier: str | None = None, timeout: float | None = None) -> None:
        """Block until the step is durable on `tier` ("local", "remote", or all if None).

        Raises:
            TierError: the step failed on that tier (raised here, and not again later).
            UploadSkippedError: the step will never reach tier 2 (uploads were behind and
                newer steps superseded it, so tier-2 retention would delete it anyway; or it
                failed on tier 1).
            WaitTimeoutError: `timeout` seconds passed first.
            ClosedError: called in a fork() child while the save is pending.
        """
        err = self._first_outcome_error(tier, timeout)
        if err is not None:
            if isinstance(err, TierError):
                self._on_error_seen(err)
            raise err

    def exception(self, tier: str | None = None, timeout: float | None = None) -> TiercheckError | None:
        """The error the step ended with on `tier` (the first failing tier if None), or None
        once it is durable there; waits like `wait` but raises nothing of the step's own.

        Raises:
            WaitTimeoutError: `timeout` seconds passed first.
            ClosedError: called in a fork() child while the save is pending.
        """
        return self._first_outcome_error(tier, timeout)

    def _first_outcome_error(self, tier: str | None, timeout: float | None) -> TiercheckError | None:
        """Wait for the outcome on each of the tiers in turn; the first error, or None."""
        self._check_process(not self.done(tier))
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._tiers(tier):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._events[t].wait(left):
                raise WaitTimeoutError(f"step {self.step} not durable on tier {t!r} after {timeout}s")
            err = self._errors.get(t)
            if err is not None:
                return err
        return None

    def add_done_callback(self, fn: DoneCallback) -> None:
        """Call ``fn(handle, tier, error)`` once per tier when the step is durable there
        (`error` None) or failed there (`error` the `TiercheckError`, e.g. `TierError` or
        `UploadSkippedError`), as `concurrent.futures.Future.add_done_callback` does.

        Callbacks run one at a time on a background thread of the Checkpointer, never on
        the writer or uploader, so a slow callback delays other callbacks, not a save; for
        tiers already finished they are queued at once. An exception in a callback is logged
        and ignored. `Checkpointer.wait()` and `close()` also wait for queued callbacks
        (except when called from a callback). After `close()`, a callback added to a
        finished handle runs on the calling thread.

        Example:
            >>> h = ckpt.save(100, state)                                     # doctest: +SKIP
            >>> h.add_done_callback(lambda h, tier, err: print(h.step, tier, err))  # doctest: +SKIP
        """
        with self._lock:
            self._callbacks.append(fn)
            finished = [t for t in self.tiers if self._events[t].is_set()]
        for t in finished:
            self._dispatch(fn, t, self._errors.get(t))

    def _dispatch(self, fn: DoneCallback, tier: str, error: TiercheckError | None) -> None:
        run = self._bind(fn, tier, error)
        if self._call_soon is None:
            run()
        else:
            self._call_soon(run)

    def _bind(self, fn: DoneCallback, tier: str, error: TiercheckError | None) -> Callable[[], None]:
        def run() -> None:
            fn(self, tier, error)

        return run

    # -- called by the pipeline --------------------------------------------------

    def _finish(self, tier: str, error: TiercheckError | None = None) -> list[Callable[[], None]]:
        """Record the outcome on `tier`; return the done callbacks to run for it (the
        pipeline queues them on its callback thread)."""
        with self._lock:
            if error is not None:
                self._errors[tier] = error
            self._events[tier].set()
            return [self._bind(fn, tier, error) for fn in self._callbacks]
