"""When to save: the `interval` policy, and preemption (SIGTERM) turned into a fresh save.

`SaveTrigger` holds what `Checkpointer.should_save`/`maybe_save` decide from: the policy,
the last save, a pending signal and, in a job, the save-request agreement (`agreement`)
that makes every rank save at the same step.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from ..plan.schedule import SavePolicy
from .agreement import SaveRequests

__all__ = ["DEFAULT_GRACE_S", "SaveTrigger", "SigtermState"]

DEFAULT_GRACE_S = 30.0  # drain time after a preemption save on a rank without a SIGTERM handler


@dataclasses.dataclass(slots=True)
class SigtermState:
    """What `install_sigterm_handler(fresh=True)` remembers between the signal and the save."""

    grace_s: float
    previous: Any  # the disposition before ours: a callable, SIG_DFL, SIG_IGN or None
    received: bool = False
    deadline: float = 0.0
    frame: types.FrameType | None = None
    closing: bool = False  # close() is draining: it delivers a signal that lands meanwhile
    delivered: bool = False
    # Run before the signal goes on: aborts the uploads a drain cut short (never raises).
    before_deliver: Callable[[], None] | None = None

    def note(self, frame: types.FrameType | None) -> None:
        """A SIGTERM arrived: its grace period runs from the first one."""
        if not self.received:
            self.deadline = time.monotonic() + self.grace_s
        self.received = True
        self.frame = frame

    @property
    def undelivered(self) -> bool:
        return self.received and not self.delivered

    def deliver(self, frame: types.FrameType | None = None) -> None:
        """Let SIGTERM do what it did before the handler. Off the main thread (where signal
        dispositions cannot be changed), the signal is sent again: the handler delivers it
        on the main thread, since the Checkpointer is then no longer closing."""
        if threading.current_thread() is not threading.main_thread():
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.delivered = True
        if self.before_deliver is not None:
            self.before_deliver()
        previous = self.previous
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signal.SIGTERM, frame if frame is not None else self.frame)
        elif previous == signal.SIG_DFL or previous is None:
            os.kill(os.getpid(), signal.SIGTERM)


class SaveTrigger:
    """Decides `should_save(step)` for one Checkpointer (see its docstring for the rules)."""

    def __init__(self, interval: SavePolicy | None, requests: SaveRequests | None, rank: int) -> None:
        self._interval = interval
        self._requests = requests
        self._rank = rank
        self._last_save_time = time.monotonic()
        self._last_saved: int | None = None
        self._asked: tuple[int, bool] | None = None  # the last should_save (step, answer)
        self.preempt_pending = False  # a SIGTERM asked for a save, not yet published
        self.preempted = False
        self.sigterm: SigtermState | None = None  # set by install_sigterm_handler(fresh=True)
        self.handler: SigtermState | None = None  # set by install_sigterm_handler, either mode

    def saved(self, step: int) -> None:
        """A save of `step` was issued."""
        self._last_saved = step
        self._last_save_time = time.monotonic()

    def should_save(self, step: int) -> bool:
        if self._asked is not None and self._asked[0] == step:
            return self._asked[1]
        policy = self._interval
        due = policy is not None and policy.due_by_step(step, self._last_saved)
        clock_due = policy is not None and policy.due_by_clock(time.monotonic() - self._last_save_time)
        requests = self._requests
        if requests is None:
            due = due or clock_due or self.preempt_pending
            if self.preempt_pending:
                self.preempt_pending = False
                self.preempted = True
        else:
            if clock_due and self._rank == 0 and not requests.requested:
                requests.request("interval")
            if self.preempt_pending:
                self.preempt_pending = False
                requests.request("preempt")
            agreed = requests.poll(step)
            if agreed is not None:
                due = True
                self.preempted = self.preempted or "preempt" in agreed
        self._asked = (step, due)
        return due

    def grace_left(self) -> float:
        """Seconds left to drain a preemption save: what the signal's grace period leaves."""
        sig = self.sigterm
        if sig is None:  # a rank without the handler, saving for another rank's signal
            return DEFAULT_GRACE_S
        if sig.received:
            return max(0.0, sig.deadline - time.monotonic())
        return sig.grace_s

    def after_preemption_save(self) -> None:
        """The preemption save is drained: on the rank that received the signal, deliver it."""
        sig = self.sigterm
        if sig is not None and sig.undelivered:
            sig.deliver()


def sigterm_handler(
    state: SigtermState, fresh: bool, target: Callable[[], SaveTrigger | None], drain: Callable[[float], object]
) -> Callable[[int, types.FrameType | None], None]:
    """The SIGTERM handler: with `fresh`, note the signal for the next `should_save`; else
    drain for the grace period and deliver the signal. While `close()` drains (either mode),
    only note it: close delivers it once drained. `target` gives the live trigger (None
    once the Checkpointer is closed or inherited by a fork child)."""

    def on_sigterm(signum: int, frame: types.FrameType | None) -> None:
        if state.closing:
            state.note(frame)
            return
        trigger = target()
        if fresh and trigger is not None:
            state.note(frame)
            trigger.preempt_pending = True
            return
        if trigger is not None:
            drain(state.grace_s)
        state.deliver(frame)

    return on_sigterm
