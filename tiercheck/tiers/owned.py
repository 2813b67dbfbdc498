"""What the directory tier may write into, truncate or delete (invariant 8).

tiercheck writes into, truncates or deletes only files it created and still owns: never
through a symbolic link, never a file with other hard links (a step pinned by ``ln``, a run
forked with ``cp -al``: its bytes are another name's too), never a FIFO or device. A link
planted at a name tiercheck made loses only itself. The writer lock (`lock.py`), the
recycling of deleted shards (`recycle.py`) and the tier itself (`local.py`) all check
through these.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat

O_DIRECT = getattr(os, "O_DIRECT", 0)
O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sole_regular(st: os.stat_result) -> bool:
    """Whether tiercheck may write into or truncate the file `st` describes: a regular file
    whose bytes no other name shares (invariant 8)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def remove(path: str) -> None:
    """Remove a directory tree tiercheck made at `path`, or whatever was planted at that name
    instead: a link loses only itself, never what it points to. `shutil.rmtree` walks by
    descriptors and follows no link inside; it only unlinks, which leaves another hard link's
    bytes to that name."""
    try:
        is_dir = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return
    if is_dir:
        shutil.rmtree(path, ignore_errors=True)  # refuses a link swapped in meanwhile
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def own_dir(path: str) -> None:
    """`path` as a directory, created if missing; a link (or file) planted at that name is
    removed, not written through. Ranks race here: each accepts the directory another made."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    if stat.S_ISDIR(os.lstat(path).st_mode):
        return
    with contextlib.suppress(FileNotFoundError, IsADirectoryError):  # another rank got here first
        os.unlink(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise FileExistsError(errno.EEXIST, "not a directory", path)


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
