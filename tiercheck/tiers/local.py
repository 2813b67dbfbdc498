"""Tier 1: a directory on a local filesystem (NVMe).

Durability protocol for a step: files are written into a temp directory, each fsynced;
the commit marker is written and fsynced last; the temp directory is fsynced, renamed to
its step name, and the parent fsynced. Deletion renames the step directory to a trash name (so the
step, marker included, disappears atomically), fsyncs the parent, then removes it.

Recycling: with a reclaimer (the pipeline's), a deleted step's shard file is not freed but
kept in its trash directory as a spare, and the next shard of about its size is written over
it in place (renamed into the new step's temp directory, overwritten with O_DIRECT, trimmed,
fsynced). Freeing a multi-GB file and allocating a new one are both filesystem work that
training pays for (ext4 frees extents for seconds; with the `discard` mount option the device
or hypervisor trims them too); overwriting allocated blocks is neither. PostgreSQL recycles
its WAL segments for the same reason. At most one shard's worth of spares is held (the
largest shard this tier wrote), so the disk holds what it holds while a save is written;
`check_space` counts the spare as free, frees it when short, and `close` frees it.

Links (invariant 8): a file is written into or truncated only if it is a regular file with no
other hard link, checked on the descriptor that is written (a step pinned by ``ln``, or a run
forked with ``cp -al``, shares its inodes with this tier: its files only lose their name here).
A link planted at a step's or a trash directory's name loses only itself; nothing is deleted
through one.

Ownership: a process writes rank r's part of a directory only while it holds an exclusive
`flock` on the file ``.tiercheck-lock-rank-<r>`` there (`claim_writer`). The kernel releases
it when the holder closes it or dies, SIGKILL included, so a killed job never blocks its own
restart, and a forked child closes its inherited copy at once, so a data-loader worker that
outlives its trainer does not hold it either. Leftover temp directories are swept only by the
holder of their rank's lock; readers take no lock and never modify the directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from ..errors import CheckpointCorruptedError, DirectoryInUseError, InvalidArgumentError
from ..format import naming
from ..observe.events import logger
from .base import Capabilities, ReadableFile, StepWriter, Tier
from .throttle import RateLimiter

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no writer lock
    fcntl = None  # type: ignore[assignment]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalTier(Tier):
    """A tier on a local directory.

    Args:
        root: the directory; created if missing.
        direct_io: write shard files with O_DIRECT from the page-aligned host buffer where
            the filesystem allows it (falls back to buffered writes otherwise). Avoids
            copying every byte through the page cache, which costs training CPU time.
        fsync: flush files and directories before a step is committed. Turning it off
            means a power loss or kernel crash (not a process crash) can lose or tear the
            newest steps while they are already listed as committed.
        block_size: bytes per write system call (at least 1 MiB).
        write_rate: optional cap in bytes/s for all writes to this tier.
        recycle: overwrite a deleted step's shard file in place for the next step instead
            of freeing it and allocating a new one (module docstring). No gain on a
            copy-on-write filesystem (btrfs, ZFS), where an overwrite allocates anyway.
    """

    capabilities = Capabilities(
        space_check=True, strays=True, writer_lock=True, local_files=True, deferred_reclaim=True
    )
    RECLAIM_STEP = 64 << 20  # bytes freed per truncate when reclaiming a deleted shard (~80 ms here)
    RECLAIM_PAUSE_S = 0.005  # between those truncates: the filesystem stays responsive
    RECYCLE_MIN = 64 << 20  # smaller deleted files are freed, not kept to be overwritten

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        name: str = "local",
        direct_io: bool = True,
        fsync: bool = True,
        block_size: int = 8 << 20,
        write_rate: float | None = None,
        recycle: bool = True,
    ) -> None:
        if block_size < (1 << 20) or block_size % 4096:
            raise InvalidArgumentError("block_size must be a multiple of 4096 and at least 1 MiB")
        self.name = name
        self.location = os.fspath(root)
        self.root = os.path.abspath(self.location)
        self.direct_io = direct_io and bool(_O_DIRECT)
        self.fsync = fsync
        self.block_size = block_size
        self.limiter = RateLimiter(write_rate)
        self._writer_lock: weakref.finalize[..., LocalTier] | None = None  # closes the lock file
        self._reclaimer: Callable[[str], None] | None = None
        self._between: Callable[[], None] | None = None  # called between paced truncates
        self._unreclaimed: set[str] = set()  # trash directories handed to the reclaimer
        self._reclaim_lock = threading.Lock()  # guards the two sets above and below
        self.recycle = recycle and self.direct_io
        self._spares: list[tuple[str, int]] = []  # (path in a trash directory, size) to overwrite
        self._largest = 0  # the largest shard written here: the bytes of spares held at most

    def path_of(self, step: int, name: str | None = None) -> str:
        d = os.path.join(self.root, naming.step_dir_name(step))
        return d if name is None else os.path.join(d, name)

    def local_dir(self) -> str:
        return self.root

    def local_file(self, step: int, name: str) -> str:
        return self.path_of(step, name)

    def committed_steps(self) -> list[int]:
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:
            return []
        steps = []
        with it:
            for entry in it:
                step = naming.parse_step_dir(entry.name)
                if step is not None and os.path.isfile(os.path.join(entry.path, naming.COMMIT_NAME)):
                    steps.append(step)
        return sorted(steps)

    def check_space(self, step: int, nbytes: int) -> None:
        """Fail before writing when the filesystem has less than `nbytes` (plus 1%) free."""
        os.makedirs(self.root, exist_ok=True)
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        need = nbytes + nbytes // 100 + (1 << 20)
        free += self._reusable(nbytes)  # the spare the shard will overwrite
        if free < need and self._reclaim_now():  # deleted steps still held space: free it now
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize
        if free < need:
            raise OSError(
                errno.ENOSPC,
                f"not enough space for step {step}: it needs {need} bytes, {free} are free "
                f"(short by {need - free}); free space or lower keep_local",
                self.root,
            )

    def stray_steps(self) -> list[int]:
        """Step directories without a marker: parts of a multi-rank step that never committed."""
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:
            return []
        with it:
            return sorted(
                step
                for entry in it
                if (step := naming.parse_step_dir(entry.name)) is not None
                and entry.is_dir(follow_symlinks=False)
                and not os.path.lexists(os.path.join(entry.path, naming.COMMIT_NAME))
            )

    def open_step(self, step: int, rank: int, shared: bool = False) -> StepWriter:
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, naming.tmp_dir_name(step, rank))
        os.mkdir(tmp)
        return _LocalStepWriter(self, step, tmp, shared)

    def write_marker(self, step: int, marker: bytes) -> None:
        # Written under a temporary name and renamed: the marker appears whole or not at all.
        final = self.path_of(step)
        tmp = os.path.join(final, f".{naming.COMMIT_NAME}.tmp-{secrets.token_hex(8)}")
        try:
            self.write_file(tmp, memoryview(marker), False)
            os.rename(tmp, os.path.join(final, naming.COMMIT_NAME))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            fsync_dir(final)

    def read_bytes(self, step: int, name: str, limit: int) -> bytes:
        f = _LocalFile(self.path_of(step), name)
        try:
            if f.size > limit:
                raise CheckpointCorruptedError(f"{f.path}: {f.size} bytes, over the {limit}-byte limit")
            data = bytearray(f.size)
            f.read_into(0, memoryview(data))
            return bytes(data)
        except EOFError as exc:
            raise CheckpointCorruptedError(str(exc)) from None
        finally:
            f.close()

    def open_file(self, step: int, name: str) -> ReadableFile:
        return _LocalFile(self.path_of(step), name)

    def delete_step(self, step: int) -> None:
        # One atomic rename hides the whole step, marker included, before any data goes; a
        # crash after it leaves a trash directory that the next start removes.
        step_dir = self.path_of(step)
        try:
            planted = not stat.S_ISDIR(os.lstat(step_dir).st_mode)
        except FileNotFoundError:
            return
        if planted:  # a link at a step's name: only the name goes, never what it points to
            _remove(step_dir)
            if self.fsync:
                fsync_dir(self.root)
            return
        trash = os.path.join(self.root, naming.trash_dir_name(step))
        try:
            os.rename(step_dir, trash)
        except FileNotFoundError:
            return
        if self.fsync:
            fsync_dir(self.root)
        reclaimer = self._reclaimer
        if reclaimer is None:
            _remove(trash)
            return
        with self._reclaim_lock:
            self._unreclaimed.add(trash)
        reclaimer(trash)

    def set_reclaimer(
        self, reclaimer: Callable[[str], None] | None, between: Callable[[], None] | None = None
    ) -> None:
        old = self._reclaimer
        self._reclaimer = reclaimer
        self._between = between
        if reclaimer is None and old is not None:  # closing: the spares go with what is queued
            for token in self._drop_spares():
                with self._reclaim_lock:
                    self._unreclaimed.add(token)
                old(token)

    def reclaim(self, token: str) -> None:
        """Free trash directory `token`: its shard kept as a spare to be overwritten (module
        docstring) while the spares are under one shard's size and a reclaimer is set; every
        other file truncated in `RECLAIM_STEP` pieces, each after `between()` (a pause, and
        the pipeline holds it back while a save copies: ext4 frees a multi-GB file's extents
        for seconds in one unlink, on a core and a journal the loop needs), then unlinked."""
        kept = False
        # OSError: gone already (check_space reclaimed it), unreadable, or a link: removed below.
        with contextlib.suppress(OSError):
            kept = self._reclaim_dir(token)
        if not kept:
            _remove(token)
        with self._reclaim_lock:
            self._unreclaimed.discard(token)

    def _reclaim_dir(self, token: str) -> bool:
        """`reclaim`'s work, through a descriptor of the trash directory opened without
        following a link (one planted in its place is the user's: `_remove` unlinks it).
        Only a regular file with no other hard link is truncated or kept as a spare: the
        bytes of a linked one are also another name's (a step pinned by ``ln``, a
        ``cp -al`` fork), so only this name goes. True if a spare was kept."""
        dfd = os.open(token, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
        try:
            with os.scandir(dfd) as it:
                files = [(e.name, e.stat(follow_symlinks=False)) for e in it if e.is_file(follow_symlinks=False)]
            sole = [(name, st.st_size) for name, st in files if st.st_nlink == 1]
            spare = max(sole, key=lambda f: f[1]) if sole else None
            if spare is not None and not self._keep_spare(os.path.join(token, spare[0]), spare[1], hold=False):
                spare = None
            for name, _ in files:
                if spare is None or name != spare[0]:
                    _free_paced(dfd, name, self.RECLAIM_STEP, self._pace)
        finally:
            os.close(dfd)
        # Last: takeable from now on (`_into_spare` checks the file again when it opens it).
        return spare is not None and self._keep_spare(os.path.join(token, spare[0]), spare[1], hold=True)

    def _pace(self) -> None:
        """Before each reclaimed piece: a short pause, then the reclaimer's own gate."""
        time.sleep(self.RECLAIM_PAUSE_S)
        between = self._between
        if between is not None:
            between()

    def _reclaim_now(self) -> bool:
        """Free every deleted step still waiting for the reclaimer, and the spares, here; True
        if any was."""
        with self._reclaim_lock:
            pending = list(self._unreclaimed)
        pending += self._drop_spares()
        for token in pending:
            _remove(token)
            with self._reclaim_lock:
                self._unreclaimed.discard(token)
        return bool(pending)

    # -- recycling deleted shards (module docstring) ------------------------------------

    @property
    def spare_bytes(self) -> int:
        """Bytes of deleted steps' shards held now to be overwritten by the next step."""
        with self._reclaim_lock:
            return self._held()

    def _held(self) -> int:
        """Bytes of the spares held; guarded."""
        return sum(n for _, n in self._spares)

    def _keep_spare(self, path: str, size: int, hold: bool) -> bool:
        """Whether `path` (a file of a trash directory) may be a spare: recycling is on, a
        reclaimer is set and the spares stay within one shard's size; with `hold`, hold it."""
        with self._reclaim_lock:
            fits = size >= self.RECYCLE_MIN and self._held() + size <= self._largest
            if not (self.recycle and self._reclaimer is not None and fits):
                return False
            if hold:
                self._spares.append((path, size))
            return True

    def _pick_spare(self, nbytes: int) -> int | None:
        """Index of the spare best fit to hold `nbytes` (at most twice as large); guarded."""
        fits = [(abs(n - nbytes), i) for i, (_, n) in enumerate(self._spares) if n <= 2 * nbytes]
        return min(fits)[1] if fits else None

    def _reusable(self, nbytes: int) -> int:
        """Bytes of a spare that a shard of `nbytes` would overwrite instead of allocating."""
        with self._reclaim_lock:
            i = self._pick_spare(nbytes)
            return 0 if i is None else min(self._spares[i][1], nbytes)

    def _take_spare(self, nbytes: int) -> tuple[str, int] | None:
        with self._reclaim_lock:
            i = self._pick_spare(nbytes)
            return None if i is None else self._spares.pop(i)

    def _drop_spares(self) -> list[str]:
        """Forget every spare; returns their trash directories, for the caller to free."""
        with self._reclaim_lock:
            spares, self._spares = self._spares, []
        return sorted({os.path.dirname(path) for path, _ in spares})

    def _into_spare(self, path: str, nbytes: int) -> int | None:
        """Move a spare to `path` to be overwritten: an O_DIRECT descriptor of it, or None
        (no spare fits, or it could not be moved or opened: the caller writes a new file)."""
        spare = self._take_spare(nbytes)
        if spare is None:
            return None
        old, _ = spare
        try:
            os.rename(old, path)
        except OSError:
            _remove(os.path.dirname(old))
            return None
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(old))  # the trash directory, empty now
        try:
            fd = os.open(path, os.O_WRONLY | _O_DIRECT | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
        except OSError:
            os.unlink(path)
            return None
        st = os.fstat(fd)
        if not _sole_regular(st):  # linked (or replaced) while it waited: its bytes are not only ours
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

    def remove_leftovers(self, owned: Callable[[int | None], bool] | None = None) -> list[str]:
        """Remove temp and trash directories; with `owned`, only the temp directories of the
        ranks it accepts (it gets None for a trash directory, which has no rank)."""
        removed = []
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:
            return []
        with it:
            for entry in it:
                if not (naming.is_leftover(entry.name) and entry.is_dir(follow_symlinks=False)):
                    continue
                if owned is None or owned(naming.leftover_rank(entry.name)):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
        return removed

    # -- ownership ------------------------------------------------------------------

    def claim_writer(self, rank: int, world_size: int) -> list[str]:
        """Take rank `rank`'s writer lock (DirectoryInUseError if a live process holds it),
        then sweep: this rank's temp directories, trash directories, and the temp directories
        of ranks beyond `world_size` whose lock no live process holds. The other ranks of the
        job sweep their own.

        A directory that cannot hold the lock (full, read-only, no flock on this filesystem)
        is written unlocked, with a warning: the write itself then fails (or not) as before,
        in the background, and never stops training here."""
        if self._writer_lock is None:
            path = os.path.join(self.root, naming.lock_name(rank))
            try:
                os.makedirs(self.root, exist_ok=True)
                fd = self._lock(rank)
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
                self._writer_lock = weakref.finalize(self, _close_quietly, fd)
                _LOCK_HOLDERS.add(self)
        borrowed: dict[int, int | None] = {}

        def owned(r: int | None) -> bool:
            if r is None or r == rank:
                return True
            if r < world_size:
                return False
            if r not in borrowed:  # held until the sweep ends, so no writer of r starts meanwhile
                try:
                    borrowed[r] = self._lock(r)
                except OSError:
                    borrowed[r] = None
            fd = borrowed[r]
            return fd is not None and fd >= 0

        try:
            return self.remove_leftovers(owned)
        except OSError as exc:
            logger.warning("tiercheck: cannot sweep leftovers in %s: %r", self.root, exc)
            return []
        finally:
            for fd in borrowed.values():
                if fd is not None and fd >= 0:
                    _close_quietly(fd)

    def release_writer(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock()  # closing the file releases the lock
            self._writer_lock = None
        _LOCK_HOLDERS.discard(self)

    def _lock(self, rank: int) -> int | None:
        """Try rank `rank`'s lock: an open descriptor that holds it; None if a live process
        holds it; -1 where this platform has no flock. Raises OSError if the lock file
        cannot be opened or the filesystem refuses flock."""
        if fcntl is None:
            return -1
        # No link followed: O_CREAT through a dangling one would make a file elsewhere.
        flags = os.O_RDONLY | os.O_CREAT | _O_CLOEXEC | _O_NOFOLLOW | _O_NONBLOCK
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

    # -- writing ------------------------------------------------------------------

    def write_file(self, path: str, data: memoryview, aligned: bool) -> None:
        if aligned and self.direct_io and len(data) % 4096 == 0:
            with self._reclaim_lock:
                self._largest = max(self._largest, len(data))
            try:
                fd = self._into_spare(path, len(data)) if self.recycle else None
                if fd is None:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise
            else:
                try:
                    self._write_all(fd, data)
                except OSError as exc:
                    os.close(fd)
                    if exc.errno != errno.EINVAL:
                        raise
                    os.unlink(path)
                    self.direct_io = self.recycle = False  # remember: this filesystem refuses O_DIRECT
                else:
                    self._finish(fd)
                    return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            self._write_all(fd, data)
        except BaseException:
            os.close(fd)
            raise
        self._finish(fd)

    def _write_all(self, fd: int, data: memoryview) -> None:
        pos, total, block = 0, len(data), self.block_size
        while pos < total:
            n = min(block, total - pos)
            self.limiter.consume(n)
            pos += os.write(fd, data[pos : pos + n])

    def _finish(self, fd: int) -> None:
        try:
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


_LOCK_HOLDERS: weakref.WeakSet[LocalTier] = weakref.WeakSet()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


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
    for tier in list(_LOCK_HOLDERS):
        tier.release_writer()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class _LocalStepWriter(StepWriter):
    def __init__(self, tier: LocalTier, step: int, tmp: str, shared: bool = False) -> None:
        self._tier = tier
        self._step = step
        self._tmp = tmp
        self._shared = shared
        self._published: list[str] = []

    def write_file(
        self,
        name: str,
        data: memoryview,
        aligned: bool = False,
        compress: bool = False,
    ) -> int:
        path = os.path.join(self._tmp, name)
        self._tier.write_file(path, data, aligned)
        return len(data)

    def write_chunks(
        self, name: str, chunks: Callable[[], Iterator[bytes | memoryview]], nbytes: int, compress: bool = False
    ) -> int:
        """Streamed: each chunk is written as it comes, so none is gathered in memory."""
        path = os.path.join(self._tmp, name)
        tier = self._tier
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            written = 0
            for chunk in chunks():
                view = memoryview(chunk).cast("B")
                tier.limiter.consume(len(view))
                while len(view):
                    n = os.write(fd, view)
                    view = view[n:]
                    written += n
            if written != nbytes:
                raise ValueError(f"{path}: got {written} bytes, expected {nbytes}")
        except BaseException:
            os.close(fd)
            raise
        tier._finish(fd)
        return written

    def commit(self, marker: bytes) -> None:
        tier = self._tier
        tier.write_file(os.path.join(self._tmp, naming.COMMIT_NAME), memoryview(marker), False)
        if tier.fsync:
            fsync_dir(self._tmp)
        final = tier.path_of(self._step)
        if os.path.lexists(final):
            if os.path.exists(os.path.join(final, naming.COMMIT_NAME)):
                raise FileExistsError(errno.EEXIST, "step is already committed", final)
            # An unmarked step directory: a deletion that crashed after removing the marker.
            # It is invisible; move it out of the way rather than fail this step forever. A
            # link there loses only itself: what it points to is the user's.
            if stat.S_ISDIR(os.lstat(final).st_mode):
                trash = os.path.join(tier.root, naming.trash_dir_name(self._step))
                os.rename(final, trash)
                _remove(trash)
            else:
                _remove(final)
        os.rename(self._tmp, final)
        if tier.fsync:
            fsync_dir(tier.root)

    def publish_part(self) -> None:
        """Move this rank's files (each already fsynced) into the step directory, which other
        ranks share; one rename per file, so each appears whole. No marker yet."""
        assert self._shared, "publish_part() is for steps written by several ranks"
        tier = self._tier
        final = tier.path_of(self._step)
        if os.path.lexists(os.path.join(final, naming.COMMIT_NAME)):
            raise FileExistsError(errno.EEXIST, "step is already committed", final)
        _own_dir(final)
        for name in sorted(os.listdir(self._tmp)):
            dest = os.path.join(final, name)
            os.rename(os.path.join(self._tmp, name), dest)
            self._published.append(dest)
        if tier.fsync:
            fsync_dir(final)
            fsync_dir(tier.root)
        os.rmdir(self._tmp)

    def abort(self) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)
        for path in self._published:  # the step never committed: take back our part
            with contextlib.suppress(OSError):
                os.unlink(path)


def _open_step_file(step_dir: str, name: str) -> int:
    """A read-only descriptor of file `name` of a step, following no symbolic link from the
    tier's root down: tiercheck writes none, and one planted in a checkpoint must not make
    the reader open a file outside its step directory (the root itself is the user's path
    and may be reached through links).

    Raises:
        CheckpointCorruptedError: the step directory or the file is a symbolic link, or the
            file is not a regular file.
    """
    if os.sep in name or name in (".", ".."):  # one component, or O_NOFOLLOW guards only the last
        raise CheckpointCorruptedError(f"{step_dir}: {name!r} is not a file name of this format")
    try:
        dfd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(step_dir):
            raise CheckpointCorruptedError(
                f"{step_dir}: the step directory is a symbolic link; tiercheck follows none inside a tier "
                "(copy the step directory in instead)"
            ) from None
        raise
    path = os.path.join(step_dir, name)
    try:
        # O_NONBLOCK: opening a FIFO planted in a checkpoint must not wait for a writer.
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CheckpointCorruptedError(
                f"{path}: a symbolic link; tiercheck follows none inside a tier (copy the file in instead)"
            ) from None
        raise
    finally:
        os.close(dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptedError(f"{path}: not a regular file")
    return fd


class _LocalFile(ReadableFile):
    def __init__(self, step_dir: str, name: str) -> None:
        self.path = os.path.join(step_dir, name)
        self._fd = _open_step_file(step_dir, name)
        self.size = os.fstat(self._fd).st_size

    def read_into(self, offset: int, dest: memoryview) -> None:
        pos, total = 0, len(dest)
        while pos < total:
            n = os.preadv(self._fd, [dest[pos : min(total, pos + (64 << 20))]], offset + pos)
            if n <= 0:
                raise EOFError(f"{self.path}: file ends at byte {offset + pos}")
            pos += n

    def close(self) -> None:
        os.close(self._fd)


def _sole_regular(st: os.stat_result) -> bool:
    """Whether tiercheck may write into or truncate the file `st` describes: a regular file
    whose bytes no other name shares (invariant 8)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _remove(path: str) -> None:
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


def _own_dir(path: str) -> None:
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


def _free_paced(dfd: int, name: str, step: int, between: Callable[[], None]) -> None:
    """Free file `name` of directory `dfd`: shrunk to nothing `step` bytes at a time, calling
    `between()` before each piece, then unlinked. The descriptor truncated is the one checked
    (no link followed, no other hard link), and checked again before each piece: a link made
    while the reclaimer paused stops the truncating. Otherwise only the name is unlinked."""
    fd = os.open(name, os.O_WRONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        size = st.st_size if _sole_regular(st) else 0
        while size > 0:
            between()
            if not _sole_regular(os.fstat(fd)):
                break
            size = max(0, size - step)
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    os.unlink(name, dir_fd=dfd)


def _write_holder(path: str, lock_fd: int) -> None:
    """Write who holds the lock into its file, the one `lock_fd` holds, unless the file has
    other hard links (a ``cp -al`` copy of the directory): those are not ours to write."""
    fd = os.open(path, os.O_WRONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    try:
        st, held = os.fstat(fd), os.fstat(lock_fd)
        if _sole_regular(st) and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
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
