"""The cyclic garbage collector paused around work that allocates a few objects a leaf and
frees them before it ends (`collector_paused`)."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]

_pause_lock = threading.Lock()
_pauses = 0  # windows open now, in any thread
_paused_here = False  # the first of them disabled the collector (it was enabled)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: reading a manifest (and binding it, `steps/restore`)
    allocates a few objects a leaf, enough to set off full collections, each traversing every
    live object (a model's tensors): a third of the time of a restore of 20,000 tensors into a
    template of as many (cProfile of benchmarks/many_tensors.py's state, issue 25). What they
    allocate lives until they return, so a collection meanwhile would free nothing. The
    writer's manifest of every save (`steps/write.py`) and the structure check of `save()`
    (`state/structure.py`) pause it the same way.

    Windows of several threads nest: the collector is enabled again when the last one
    closes, and only if it was enabled when the first one opened (a program that disabled it
    keeps it disabled)."""
    global _pauses, _paused_here
    with _pause_lock:
        if _pauses == 0:
            _paused_here = gc.isenabled()
            if _paused_here:
                gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _paused_here:
                _paused_here = False
                gc.enable()
