"""Tier 1: a directory on a local filesystem (NVMe).

Durability protocol for a step: files are written into a temp directory, each fsynced;
the commit marker is written and fsynced last; the temp directory is fsynced, renamed to
its step name, and the parent fsynced. Deletion renames the step directory to a trash name (so the
step, marker included, disappears atomically), fsyncs the parent, then frees it: at once, or
on the pipeline's reclaimer thread, its shard kept to be overwritten by the next step
(`recycle.py`). `check_space` counts that spare as free, frees it when short, and `close`
frees it.

Links (invariant 8, `owned.py`): a file is written into or truncated only if it is a regular
file with no other hard link, checked on the descriptor that is written (a step pinned by
``ln``, or a run forked with ``cp -al``, shares its inodes with this tier: its files only lose
their name here). A link planted at a step's or a trash directory's name loses only itself;
nothing is deleted through one.

Ownership: a process writes rank r's part of a directory only while it holds rank r's writer
lock there (`lock.py`, `claim_writer`). Leftover temp directories are swept only by the
holder of their rank's lock; readers take no lock and never modify the directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator

from ..errors import CheckpointCorruptedError, InvalidArgumentError
from ..format import naming
from ..observe.events import logger
from .base import Capabilities, ReadableFile, StepWriter, Tier
from .lock import WriterLock
from .owned import O_DIRECT, fsync_dir, own_dir, remove
from .recycle import Recycler
from .throttle import RateLimiter


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
        space_check=True, strays=True, writer_lock=True, local_files=True, deferred_reclaim=True, prefetch=True
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
        self.direct_io = direct_io and bool(O_DIRECT)
        self.fsync = fsync
        self.block_size = block_size
        self.limiter = RateLimiter(write_rate)
        self._writer = WriterLock(self.root)
        self.recycler = Recycler(
            recycle and self.direct_io, self.RECYCLE_MIN, self.RECLAIM_STEP, self.RECLAIM_PAUSE_S
        )

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
        free += self.recycler.reusable(nbytes)  # the spare the shard will overwrite
        if free < need and self.recycler.reclaim_now():  # deleted steps still held space: free it now
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
            remove(step_dir)
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
        self.recycler.discard(trash)

    def set_reclaimer(
        self, reclaimer: Callable[[str], None] | None, between: Callable[[], None] | None = None
    ) -> None:
        self.recycler.set_reclaimer(reclaimer, between)

    def reclaim(self, token: str) -> None:
        self.recycler.reclaim(token)

    @property
    def spare_bytes(self) -> int:
        """Bytes of deleted steps' shards held now to be overwritten by the next step."""
        return self.recycler.spare_bytes

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
        self._writer.take(rank)
        with self._writer.sweepable(rank, world_size) as owned:
            try:
                return self.remove_leftovers(owned)
            except OSError as exc:
                logger.warning("tiercheck: cannot sweep leftovers in %s: %r", self.root, exc)
                return []

    @property
    def writing(self) -> bool:
        """Whether this process became a writer here (`claim_writer`)."""
        return self._writer.held

    def release_writer(self) -> None:
        self._writer.release()

    # -- writing ------------------------------------------------------------------

    def write_file(self, path: str, data: memoryview, aligned: bool) -> None:
        if aligned and self.direct_io and len(data) % 4096 == 0:
            self.recycler.note_shard(len(data))
            try:
                fd = self.recycler.into_spare(path, len(data)) if self.recycler.enabled else None
                if fd is None:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
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
                    self.direct_io = self.recycler.enabled = False  # remember: this filesystem refuses O_DIRECT
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
                remove(trash)
            else:
                remove(final)
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
        own_dir(final)
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
    concurrent = True  # preadv on one descriptor: safe from any number of threads

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

    def prefetch(self, offset: int, n: int) -> None:
        # The kernel reads at most its readahead window (read_ahead_kb) per advice, without
        # waiting for the disk: callers ask a window's worth at a time (`ShardPrefetch`).
        if _FADVISE is not None:
            with contextlib.suppress(OSError):
                _FADVISE(self._fd, offset, n, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        os.close(self._fd)


_FADVISE = getattr(os, "posix_fadvise", None)  # Linux and most Unixes; not macOS
