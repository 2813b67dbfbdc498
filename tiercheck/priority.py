"""Lower the CPU and I/O priority of the calling thread (Linux; a no-op elsewhere).

Background writers should take what training leaves, not compete with it: on Linux,
`setpriority` and `ioprio_set` with a thread id affect only that thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import threading

_IOPRIO_SYSCALL = {"x86_64": 251, "aarch64": 30, "ppc64le": 273}.get(platform.machine())
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_BE = 2
_IOPRIO_CLASS_SHIFT = 13
NICE = 10


def lower_current_thread() -> None:
    """nice 10 and best-effort I/O class, lowest level, for this thread. Never raises."""
    tid = threading.get_native_id()
    # Absolute, not relative: threads inherit nice, so a helper started by a lowered thread
    # would otherwise sink further.
    with contextlib.suppress(OSError, AttributeError):
        if os.getpriority(os.PRIO_PROCESS, tid) < NICE:
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
    if _IOPRIO_SYSCALL is None or platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(_IOPRIO_SYSCALL, _IOPRIO_WHO_PROCESS, tid, (_IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | 7)
    except (OSError, AttributeError):
        pass
