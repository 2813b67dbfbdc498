"""Lower the I/O priority of the calling thread (Linux; a no-op elsewhere).

Background writers should not delay training's own reads (its data loader) on a shared
disk: `ioprio_set` with a thread id moves only that thread to the lowest best-effort level.

Their CPU priority is left alone. With writer threads at nice 10 on two cores kept busy by
training, the lost training time per save was the same within noise, but time to durable
grew ~20% (the writer waited for a CPU after each write): docs/performance.md.
"""

from __future__ import annotations

import ctypes
import platform
import threading

_IOPRIO_SYSCALL = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(platform.machine())
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13
IOPRIO_LOWEST = (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7


def lower_current_thread() -> None:
    """Best-effort I/O class, lowest level, for this thread. Never raises."""
    if _IOPRIO_SYSCALL is None or platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(_IOPRIO_SYSCALL, _IOPRIO_WHO_PROCESS, threading.get_native_id(), IOPRIO_LOWEST)
    except (OSError, AttributeError):
        pass
