"""The directory tier's writer lock: one writer per rank's part of a directory.

A process writes rank r's part of a directory only while it holds an exclusive `flock` on
the file ``.tiercheck-lock-rank-<r>`` there. The kernel releases it when the holder closes
it or dies, SIGKILL included, so a killed job never blocks its own restart, and a forked
child closes its inherited copy at once, so a data-loader worker that outlives its trainer
does not hold it either. Readers take no lock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import weakref
from collections.abc import Callable, Iterator

from ..errors import DirectoryInUseError
from ..format import naming
from ..observe.events import logger
from .owned import O_CLOEXEC, O_NOFOLLOW, O_NONBLOCK, close_quietly, sole_regular

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no writer lock
    fcntl = None  # type: ignore[assignment]


class WriterLock:
    """The writer locks of directory `root`: the one this process holds (`take`) and those
    of departed ranks borrowed for a sweep (`sweepable`)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._held: weakref.finalize[..., WriterLock] | None = None  # closes the lock file

    @property
    def held(self) -> bool:
        """Whether this process holds a writer lock of the root (taken with `take`)."""
        return self._held is not None

    def take(self, rank: int) -> None:
        """Hold rank `rank`'s lock (a no-op while held). A directory that cannot hold it
        (full, read-only, no flock on this filesystem) is written unlocked, with a warning.

        Raises:
            DirectoryInUseError: a live process holds it.
        """
        if self._held is not None:
            return
        path = os.path.join(self.root, naming.lock_name(rank))
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = self.try_lock(rank)
        except OSError as exc:
            logger.warning("tiercheck: cannot lock %s (%r); a second writer would not be detected", path, exc)
            fd = -1
        if fd is None:
            raise DirectoryInUseError(
                f"{self.root} is already being written for rank {rank} by {_read_holder(path)} "
                f"(it holds the lock {path}). Two writers of one directory would delete each "
                "other's files. Close or stop the other writer, or give this one its own directory; "
                "a Checkpointer that only restores (or tiercheck.load) takes no lock and may run "
                f"alongside.{linked_lock_hint(path)}"
            )
        if fd >= 0:
            # Who holds it, for the error a second writer gets; through a descriptor of its
            # own, closed at once: a file held open for writing would block a read-only
            # remount of the filesystem.
            with contextlib.suppress(OSError):
                _write_holder(path, fd)
            self._held = weakref.finalize(self, close_quietly, fd)
            _LOCK_HOLDERS.add(self)

    @contextlib.contextmanager
    def sweepable(self, rank: int, world_size: int) -> Iterator[Callable[[int | None], bool]]:
        """Whether the leftovers of a rank may be swept: this rank's and a trash directory's
        (rank None) yes, another rank of the job's no, and those of a rank beyond
        `world_size` only while its lock is free: held from the first ask to the end of the
        block, so no writer of that rank starts meanwhile."""
        borrowed: dict[int, int | None] = {}

        def owned(r: int | None) -> bool:
            if r is None or r == rank:
                return True
            if r < world_size:
                return False
            if r not in borrowed:
                try:
                    borrowed[r] = self.try_lock(r)
                except OSError:
                    borrowed[r] = None
            fd = borrowed[r]
            return fd is not None and fd >= 0

        try:
            yield owned
        finally:
            for fd in borrowed.values():
                if fd is not None and fd >= 0:
                    close_quietly(fd)

    def release(self) -> None:
        if self._held is not None:
            self._held()  # closing the file releases the lock
            self._held = None
        _LOCK_HOLDERS.discard(self)

    def try_lock(self, rank: int) -> int | None:
        """Try rank `rank`'s lock: an open descriptor that holds it; None if a live process
        holds it; -1 where this platform has no flock. Raises OSError if the lock file
        cannot be opened or the filesystem refuses flock."""
        if fcntl is None:
            return -1
        # No link followed: O_CREAT through a dangling one would make a file elsewhere.
        flags = os.O_RDONLY | os.O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK
        fd = os.open(os.path.join(self.root, naming.lock_name(rank)), flags, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return fd


_LOCK_HOLDERS: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _read_holder(path: str) -> str:
    """Who holds a writer lock, as its holder wrote it; this process is named as such."""
    text = ""
    with contextlib.suppress(OSError), open(path, "rb") as f:
        text = f.read(200).decode(errors="replace").strip()
    if text.startswith(f"pid {os.getpid()} "):
        return "a Checkpointer of this process that is not closed yet"
    return text or "another process"


def _drop_inherited_locks() -> None:
    # A forked child shares its parent's open lock file: closing the child's copy keeps the
    # lock with the parent alone, so it is released when the parent dies, whatever children
    # (data-loader workers) live on.
    for lock in list(_LOCK_HOLDERS):
        lock.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


def _write_holder(path: str, lock_fd: int) -> None:
    """Write who holds the lock into its file, the one `lock_fd` holds, unless the file has
    other hard links (a ``cp -al`` copy of the directory): those are not ours to write."""
    fd = os.open(path, os.O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
    try:
        st, held = os.fstat(fd), os.fstat(lock_fd)
        if sole_regular(st) and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    finally:
        os.close(fd)


def linked_lock_hint(path: str) -> str:
    """For a refusal over a held lock: where its file has other hard links, the holder may be
    writing another directory (a ``cp -al`` copy shares its lock files with the original)."""
    try:
        links = os.lstat(path).st_nlink
    except OSError:
        return ""
    if links < 2:
        return ""
    return (
        f" The lock file has {links - 1} other hard link(s), as in a copy made with `cp -al`: the "
        "holder may be writing the other directory. If no writer runs here, delete this directory's "
        f"lock files ({naming.LOCK_PREFIX}*) and start again."
    )
