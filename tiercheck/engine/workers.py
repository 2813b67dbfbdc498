"""The pipeline's threads: a worker draining a queue, counted for "idle" waits."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from ..observe.events import logger
from .priority import lower_current_thread

__all__ = ["STOP", "Worker", "run_callback"]

STOP = object()  # put last: the worker exits when it reaches it


class Worker:
    """A thread draining a deque; `run_one` does the work for one item.

    `unfinished` counts items queued or running, guarded by the owner's `idle` condition, so
    "idle" means every queued item (retention included) has run.
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
        owner's lock, which this then does not need)."""
        if item is not STOP and not reserved:
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
            if item is STOP:
                return
            try:
                self._run_one(item)
            except Exception:  # a bug in the pipeline itself: keep the worker alive, say so
                logger.exception("tiercheck: internal error in %s", self.thread.name)
            finally:
                with self._idle:
                    self.unfinished -= 1
                    self._idle.notify_all()


def run_callback(item: object) -> None:
    """Run a user's done callback; an exception is logged, never raised."""
    assert callable(item)
    try:
        item()
    except Exception:  # the user's callback: say so, keep the thread for the next one
        logger.exception("tiercheck: a done callback raised")
