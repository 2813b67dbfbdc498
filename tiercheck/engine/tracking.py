"""Per-step tracking for the pipeline: which tiers each step still needs, its handle, the
error mailbox (each background error reaches the caller once) and the done callbacks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import TiercheckError, TierError
from ..job.coordination import Membership
from ..observe.events import emit, logger
from ..steps.handle import SaveHandle
from .workers import STOP, Worker, run_callback

__all__ = ["Tracker"]


@dataclass(slots=True)
class _Track:
    handle: SaveHandle
    remaining: set[str] = field(default_factory=set)
    reported: set[str] = field(default_factory=set)  # tiers whose outcome the other ranks know


class Tracker:
    """The steps in flight, their outcomes and the errors not yet raised.

    `lock` guards everything here (and the pipeline's own state); `idle` is notified
    whenever a step finishes or a queued item ran.

    Args:
        group: the job, told at once when this rank's part of a step fails.
        failed: called with a tier's name when a step failed there (it may have left data
            without a marker).
    """

    def __init__(self, group: Membership, failed: Callable[[str], None]) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.tracks: dict[int, _Track] = {}  # guarded by `lock`
        self.newest_durable: dict[str, int] = {}  # per tier, the newest step this session made durable
        self._group = group
        self._failed = failed
        self._errors: list[TierError] = []
        self._callbacks: Worker | None = None  # started at the first done callback
        self._callbacks_stopped = False

    def add(self, step: int, handle: SaveHandle, tiers: set[str]) -> None:
        """Track `step` until it finished on each of `tiers`. Call with `lock` held."""
        self.tracks[step] = _Track(handle, set(tiers))

    def forget(self, step: int, handle: SaveHandle) -> None:
        """`handle`'s save of `step` raised before it was staged: no longer in flight."""
        with self.lock:
            track = self.tracks.get(step)
            if track is not None and track.handle is handle:
                del self.tracks[step]
                self.idle.notify_all()

    def in_flight(self, tier: str | None = None) -> list[int]:
        """Steps not yet finished on `tier` (on any tier if None)."""
        with self.lock:
            return self.pending(tier)

    def pending(self, tier: str | None = None) -> list[int]:
        """`in_flight`, with `lock` already held."""
        return sorted(s for s, t in self.tracks.items() if tier is None or tier in t.remaining)

    def wait_tier(self, tier: str, timeout: float | None = None) -> bool:
        """Wait until no pending step still needs `tier`."""
        with self.idle:
            return self.idle.wait_for(lambda: not any(tier in t.remaining for t in self.tracks.values()), timeout)

    def callbacks_busy(self) -> bool:
        """Done callbacks are queued or running, other than the caller's own thread's."""
        cb = self._callbacks  # may start while a waiter waits
        return cb is not None and cb.thread is not threading.current_thread() and cb.unfinished > 0

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the callback thread (started now if needed); after close, right here.
        Never called with `lock` held."""
        with self.lock:
            worker = self._callback_worker(1)
        if worker is None:
            run_callback(fn)
        else:
            worker.put(fn, reserved=True)

    def _callback_worker(self, n: int) -> Worker | None:
        """The callback thread, with `n` items counted as queued; None after close. Call with
        `lock` held."""
        if self._callbacks_stopped:
            return None
        if self._callbacks is None:
            self._callbacks = Worker("tiercheck-callbacks", run_callback, self.idle)
        self._callbacks.unfinished += n
        return self._callbacks

    def stop_callbacks(self, timeout: float | None) -> None:
        """Run the callbacks queued so far, then stop their thread; later ones run inline."""
        with self.lock:
            self._callbacks_stopped = True
        if self._callbacks is not None:
            self._callbacks.put(STOP)
            if threading.current_thread() is not self._callbacks.thread:
                self._callbacks.thread.join(timeout)

    def take_errors(self) -> list[TierError]:
        with self.lock:
            errors, self._errors = self._errors, []
        return errors

    def take_error(self, each: Callable[[TierError], None]) -> TierError | None:
        """The background errors since the last call as one error to raise (the first, or
        one naming every failed step and caused by the first); `each` sees every one."""
        errors = self.take_errors()
        for e in errors:
            each(e)
        if len(errors) <= 1:
            return errors[0] if errors else None
        first = errors[0]
        steps = ", ".join(str(e.step) for e in errors)
        combined = TierError(
            f"{len(errors)} background saves failed (steps {steps}); first: {first}",
            step=first.step,
            tier=first.tier,
            path=first.path,
        )
        combined.__cause__ = first
        return combined

    def error_seen(self, err: TierError) -> None:
        """A handle raised `err` to the caller: it must not be raised again."""
        with self.lock, contextlib.suppress(ValueError):
            self._errors.remove(err)

    def report(self, error: TierError | None) -> None:
        """An error of no save's own (retention, a catch-up upload): raised once, later."""
        if error is not None:
            with self.lock:
                self._errors.append(error)
            logger.error("%s", error)

    def finish(
        self, step: int, tier: str, error: TiercheckError | None = None, handle: SaveHandle | None = None
    ) -> None:
        """Record `step`'s outcome on `tier`. With `handle`, only if that save still owns
        the step: a save whose copy failed may have been retried with the same step since."""
        if error is not None and self.first_report(step, tier, handle):
            try:  # tell the other ranks now, so they do not wait for us until the timeout
                self._group.abandon(step, tier, str(error))
            except Exception as exc:
                logger.warning("tiercheck: could not tell the other ranks that step %d failed: %r", step, exc)
        with self.lock:
            if error is not None:
                self._failed(tier)
            track = self.tracks.get(step)
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
                    del self.tracks[step]
                    emit(track.handle.stats)
            # Counted as queued before the step stops counting as pending, so that `wait()`
            # also waits for them; queued below, outside the lock the callbacks may need.
            callbacks = self._callback_worker(len(runs)) if runs else None
            self.idle.notify_all()
        for run in runs:
            if callbacks is None:
                run_callback(run)
            else:
                callbacks.put(run, reserved=True)
        if isinstance(error, TierError):
            logger.error("%s", error)

    def first_report(self, step: int, tier: str, handle: SaveHandle | None = None) -> bool:
        """True the first time this rank reports its outcome for `step` on `tier`."""
        with self.lock:
            track = self.tracks.get(step)
            if track is None or tier in track.reported or (handle is not None and track.handle is not handle):
                return False
            track.reported.add(tier)
            return True
