"""The directory tier's deleted steps: freed in the background, or their shard recycled.

A deleted step is first renamed to a trash directory (`local.py`); what frees it is here.
With a reclaimer (the pipeline's), a trash directory is freed on that thread, each file
truncated in paced pieces, and a deleted step's shard file is not freed but kept as a
spare: the next shard of about its size is written over it in place (renamed into the new
step's temp directory, overwritten with O_DIRECT, trimmed, fsynced). Freeing a multi-GB
file and allocating a new one are both filesystem work that training pays for (ext4 frees
extents for seconds; with the `discard` mount option the device or hypervisor trims them
too); overwriting allocated blocks is neither. PostgreSQL recycles its WAL segments for the
same reason. At most one shard's worth of spares is held (the largest shard the tier
wrote), so the disk holds what it holds while a save is written.

Only a regular file with no other hard link is truncated or kept as a spare, checked on the
descriptor that is truncated or written (invariant 8, `owned.py`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from .owned import O_CLOEXEC, O_DIRECT, O_NOFOLLOW, O_NONBLOCK, remove, sole_regular


class Recycler:
    """The trash directories of one tier and the spares kept from them.

    Args:
        enabled: keep spares at all (the tier turns it off where O_DIRECT is refused).
        min_size: smaller deleted files are freed, not kept to be overwritten.
        step: bytes freed per truncate when a file is freed.
        pause_s: the pause between those truncates: the filesystem stays responsive.
    """

    def __init__(self, enabled: bool, min_size: int, step: int, pause_s: float) -> None:
        self.enabled = enabled
        self.min_size = min_size
        self.step = step
        self.pause_s = pause_s
        self._reclaimer: Callable[[str], None] | None = None
        self._between: Callable[[], None] | None = None  # called between paced truncates
        self._unreclaimed: set[str] = set()  # trash directories handed to the reclaimer
        self._lock = threading.Lock()  # guards the set above and the two fields below
        self._spares: list[tuple[str, int]] = []  # (path in a trash directory, size) to overwrite
        self._largest = 0  # the largest shard written: the bytes of spares held at most

    def set_reclaimer(
        self, reclaimer: Callable[[str], None] | None, between: Callable[[], None] | None = None
    ) -> None:
        old = self._reclaimer
        self._reclaimer = reclaimer
        self._between = between
        if reclaimer is None and old is not None:  # closing: the spares go with what is queued
            for token in self._drop_spares():
                with self._lock:
                    self._unreclaimed.add(token)
                old(token)

    def discard(self, trash: str) -> None:
        """Trash directory `trash` is a deleted step's: to the reclaimer, or removed now."""
        reclaimer = self._reclaimer
        if reclaimer is None:
            remove(trash)
            return
        with self._lock:
            self._unreclaimed.add(trash)
        reclaimer(trash)

    @property
    def waiting(self) -> bool:
        """Whether a trash directory handed to the reclaimer is not freed yet."""
        with self._lock:
            return bool(self._unreclaimed)

    def reclaim(self, token: str) -> None:
        """Free trash directory `token`: its shard kept as a spare while the spares are under
        one shard's size and a reclaimer is set; every other file truncated in `step`
        pieces, each after `between()` (a pause, and the pipeline holds it back while a save
        copies: ext4 frees a multi-GB file's extents for seconds in one unlink, on a core and
        a journal the loop needs), then unlinked."""
        kept = False
        # OSError: gone already (check_space reclaimed it), unreadable, or a link: removed below.
        with contextlib.suppress(OSError):
            kept = self._reclaim_dir(token)
        if not kept:
            remove(token)
        with self._lock:
            self._unreclaimed.discard(token)

    def _reclaim_dir(self, token: str) -> bool:
        """`reclaim`'s work, through a descriptor of the trash directory opened without
        following a link (one planted in its place is the user's: `remove` unlinks it).
        Only a regular file with no other hard link is truncated or kept as a spare: the
        bytes of a linked one are also another name's, so only this name goes. True if a
        spare was kept."""
        dfd = os.open(token, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        try:
            with os.scandir(dfd) as it:
                files = [(e.name, e.stat(follow_symlinks=False)) for e in it if e.is_file(follow_symlinks=False)]
            sole = [(name, st.st_size) for name, st in files if st.st_nlink == 1]
            spare = max(sole, key=lambda f: f[1]) if sole else None
            if spare is not None and not self._keep_spare(os.path.join(token, spare[0]), spare[1], hold=False):
                spare = None
            for name, _ in files:
                if spare is None or name != spare[0]:
                    _free_paced(dfd, name, self.step, self._pace)
        finally:
            os.close(dfd)
        # Last: takeable from now on (`into_spare` checks the file again when it opens it).
        return spare is not None and self._keep_spare(os.path.join(token, spare[0]), spare[1], hold=True)

    def _pace(self) -> None:
        """Before each reclaimed piece: a short pause, then the reclaimer's own gate."""
        time.sleep(self.pause_s)
        between = self._between
        if between is not None:
            between()

    def reclaim_now(self) -> bool:
        """Free every deleted step still waiting for the reclaimer, and the spares, here; True
        if any was."""
        with self._lock:
            pending = list(self._unreclaimed)
        pending += self._drop_spares()
        for token in pending:
            remove(token)
            with self._lock:
                self._unreclaimed.discard(token)
        return bool(pending)

    # -- the spares -----------------------------------------------------------------------

    def note_shard(self, nbytes: int) -> None:
        """A shard of `nbytes` is being written: the spares may hold up to the largest."""
        with self._lock:
            self._largest = max(self._largest, nbytes)

    @property
    def spare_bytes(self) -> int:
        """Bytes of deleted steps' shards held now to be overwritten by the next step."""
        with self._lock:
            return self._held()

    def _held(self) -> int:
        """Bytes of the spares held; guarded."""
        return sum(n for _, n in self._spares)

    def _keep_spare(self, path: str, size: int, hold: bool) -> bool:
        """Whether `path` (a file of a trash directory) may be a spare: recycling is on, a
        reclaimer is set and the spares stay within one shard's size; with `hold`, hold it."""
        with self._lock:
            fits = size >= self.min_size and self._held() + size <= self._largest
            if not (self.enabled and self._reclaimer is not None and fits):
                return False
            if hold:
                self._spares.append((path, size))
            return True

    def _pick_spare(self, nbytes: int) -> int | None:
        """Index of the spare best fit to hold `nbytes` (at most twice as large); guarded."""
        fits = [(abs(n - nbytes), i) for i, (_, n) in enumerate(self._spares) if n <= 2 * nbytes]
        return min(fits)[1] if fits else None

    def reusable(self, nbytes: int) -> int:
        """Bytes of a spare that a shard of `nbytes` would overwrite instead of allocating."""
        with self._lock:
            i = self._pick_spare(nbytes)
            return 0 if i is None else min(self._spares[i][1], nbytes)

    def _take_spare(self, nbytes: int) -> tuple[str, int] | None:
        with self._lock:
            i = self._pick_spare(nbytes)
            return None if i is None else self._spares.pop(i)

    def _drop_spares(self) -> list[str]:
        """Forget every spare; returns their trash directories, for the caller to free."""
        with self._lock:
            spares, self._spares = self._spares, []
        return sorted({os.path.dirname(path) for path, _ in spares})

    def into_spare(self, path: str, nbytes: int) -> int | None:
        """Move a spare to `path` to be overwritten: an O_DIRECT descriptor of it, or None
        (no spare fits, or it could not be moved or opened: the caller writes a new file)."""
        spare = self._take_spare(nbytes)
        if spare is None:
            return None
        old, _ = spare
        try:
            os.rename(old, path)
        except OSError:
            remove(os.path.dirname(old))
            return None
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(old))  # the trash directory, empty now
        try:
            fd = os.open(path, os.O_WRONLY | O_DIRECT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
        except OSError:
            os.unlink(path)
            return None
        st = os.fstat(fd)
        if not sole_regular(st):  # linked (or replaced) while it waited: its bytes are not only ours
            os.close(fd)
            os.unlink(path)
            return None
        size = st.st_size
        if size > nbytes:
            try:
                os.ftruncate(fd, nbytes)  # a trimmed tail, small beside what is overwritten
            except BaseException:
                os.close(fd)
                raise
        return fd


def _free_paced(dfd: int, name: str, step: int, between: Callable[[], None]) -> None:
    """Free file `name` of directory `dfd`: shrunk to nothing `step` bytes at a time, calling
    `between()` before each piece, then unlinked. The descriptor truncated is the one checked
    (no link followed, no other hard link), and checked again before each piece: a link made
    while the reclaimer paused stops the truncating. Otherwise only the name is unlinked."""
    fd = os.open(name, os.O_WRONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        size = st.st_size if sole_regular(st) else 0
        while size > 0:
            between()
            if not sole_regular(os.fstat(fd)):
                break
            size = max(0, size - step)
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    os.unlink(name, dir_fd=dfd)
