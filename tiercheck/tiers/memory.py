"""Tier 0: the host buffers themselves, as files in a shared-memory filesystem.

A save copies the state into a host buffer; with tier 0 that buffer is a file of a
shared-memory filesystem (``/dev/shm``), mapped once (`ShmBuffer`). When the copy is done and
checksummed, the buffer file is *moved* (renamed, not copied) into a step directory of the
one on-disk format under the job's tier-0 root, and the step is committed with its manifest
and marker like on any tier. The memory outlives the process, not the node: a restarted job
with the same identity finds its newest step there and restores it at memory speed, every
byte verified.

Layout under ``memory_dir`` (names in `format/naming.py`)::

    tiercheck-<job key>/                      the job's tier-0 root: a step store like tier 1
        .tiercheck-job.json                   who made it: job id, where the id came from, host
        .tiercheck-lock-rank-00000            rank 0's writer lock (as on tier 1)
        .tiercheck-buffers/rank-00000-<token>.buf   a host buffer holding no committed step
        step-000000000120/                    a committed step; its shard is a host buffer
        .tiercheck-replicas/rank-00003/       steps received from rank 3 (another node)

A buffer holding a committed step goes back to ``.tiercheck-buffers/`` (marker first) before
the next save overwrites it (`SharedMemoryTier.take_back`); a step whose shard is not one
of this process's buffers (an earlier process's, a replica) is deleted as on tier 1.

Shared memory is allocated with ``posix_fallocate`` before it is mapped: a full filesystem
fails there with ENOSPC, never later as a SIGBUS inside a copy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError
from ..format import naming
from .base import Capabilities, StepWriter
from .local import LocalTier, _LocalStepWriter
from .lock import WriterLock
from .owned import O_CLOEXEC, O_NOFOLLOW, close_quietly, sole_regular

DEFAULT_MEMORY_DIR = "/dev/shm"
JOB_FILE = ".tiercheck-job.json"
BUFFERS_DIR = ".tiercheck-buffers"
REPLICAS_DIR = ".tiercheck-replicas"
ROOT_PREFIX = "tiercheck-"
_SAFE_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)
_ROOT_RE = re.compile(r"tiercheck-[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)
_BUFFER_RE = re.compile(r"rank-([0-9]{5,})-[0-9a-f]{16}\.buf", re.ASCII)


def job_key(job_id: str) -> str:
    """The job's name in a tier-0 root: the id itself when it is a short safe name, else a
    digest of it (an id is the user's text; a name is ours)."""
    if _SAFE_KEY.fullmatch(job_id):
        return job_id
    return "h" + hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def job_identity(job_id: str | None, local: str | None, remote: str | None) -> tuple[str, str]:
    """(the job's id, where it came from). The id a restarted process must find again:
    ``job_id=`` when given; else the launcher's run id (torchrun keeps ``TORCHELASTIC_RUN_ID``
    across the restarts of one job); else the tier-1 directory's real path, else the tier-2
    location, so that running the same script again finds its own memory."""
    if job_id is not None:
        if type(job_id) is not str or not job_id:
            raise InvalidArgumentError(f"job_id must be a non-empty str, got {job_id!r}")
        return job_id, "job_id="
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchelastic-{run_id}", "TORCHELASTIC_RUN_ID"
    if local is not None:
        return "local-" + hashlib.sha256(os.path.realpath(local).encode()).hexdigest()[:20], "local="
    if remote is not None:
        return "remote-" + hashlib.sha256(remote.encode()).hexdigest()[:20], "remote="
    raise InvalidArgumentError("tier 0 needs a job identity: pass job_id=")


def node_identity(memory_dir: str) -> str:
    """Which node a shared-memory directory belongs to: host name, device and inode (the
    identity the job also gives tier-1 directories). Two processes given different
    directories on one machine count as two nodes (how tests simulate nodes); a replica is
    never placed on its own node."""
    st = os.stat(memory_dir)
    return f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"


def buffer_file_name(rank: int) -> str:
    return f"rank-{rank:05d}-{secrets.token_hex(8)}.buf"


def replica_root(root: str, source_rank: int) -> str:
    return os.path.join(root, REPLICAS_DIR, f"rank-{source_rank:05d}")


class ShmBuffer:
    """One host buffer as a file of a shared-memory filesystem, mapped shared.

    The file is created exclusively by this process (never opened through a link, never one
    with other hard links) and fully allocated before it is mapped. Its name moves between
    the buffers folder and the tier-0 step that holds it; the mapping and the descriptor stay.
    """

    def __init__(self, folder: str, rank: int, nbytes: int) -> None:
        if nbytes < 1:
            raise ValueError("a shared-memory buffer holds at least one byte")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        self.path = os.path.join(folder, buffer_file_name(rank))
        self.nbytes = nbytes
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS in a copy
            self.map = mapped(fd, nbytes, mmap.MAP_SHARED)
        except BaseException:
            close_quietly(fd)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise
        self.fd = fd
        st = os.fstat(fd)
        self.identity = (st.st_dev, st.st_ino)
        self.address = address_of(memoryview(self.map))

    def owns(self, path: str) -> bool:
        """Whether `path` names this buffer's file (and nothing else shares it)."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.identity and sole_regular(st)

    def close(self, unlink: bool) -> None:
        with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it later
            self.map.close()
        close_quietly(self.fd)
        if unlink and self.owns(self.path):
            with contextlib.suppress(OSError):
                os.unlink(self.path)


@dataclass(frozen=True, slots=True)
class MemoryJob:
    """A job's tier-0 root found under a shared-memory directory (`list_jobs`)."""

    root: str
    job_id: str
    source: str
    host: str
    created: float
    modified: float  # newest change of anything directly in the root
    bytes: int
    steps: tuple[int, ...]
    live: bool  # a process holds one of its writer locks


class SharedMemoryTier(LocalTier):
    """Tier 0 of one job on one node: a `LocalTier` (same format, same checks) in a
    shared-memory filesystem, whose shard files are the host buffers themselves.

    Args:
        memory_dir: the shared-memory filesystem's directory (``/dev/shm``).
        job_id: the job's identity (`job_identity`): a restarted process with the same id
            finds this job's steps again.
        source: where the id came from, recorded for ``tiercheck memory ls``.
    """

    # No space check: a step's shard is a buffer already allocated (and checked for room
    # when it was, `SharedBuffers`); moving it into the step takes no space.
    capabilities = Capabilities(
        space_check=False, strays=True, writer_lock=True, local_files=True, deferred_reclaim=False, rank_parts=True
    )

    def __init__(
        self, memory_dir: str, job_id: str, source: str = "job_id=", *, rank: int = 0, root: str | None = None
    ) -> None:
        self.memory_dir = os.path.abspath(memory_dir)
        self.job_id = job_id
        self.source = source
        super().__init__(
            root or os.path.join(self.memory_dir, ROOT_PREFIX + job_key(job_id)),
            name="memory",
            direct_io=False,
            fsync=False,  # memory does not outlive the node; fsync would only cost time
            recycle=False,
        )
        self.buffers_dir = os.path.join(self.root, BUFFERS_DIR)
        self._buffers: list[ShmBuffer] = []  # this process's buffers, by identity
        self.rank = rank
        # Held while a buffer's file changes place: the writer, retention and the pool (a
        # save about to overwrite a buffer) may each move one.
        self.lock = threading.RLock()

    # -- buffers ---------------------------------------------------------------------

    def new_buffer(self, rank: int, nbytes: int) -> ShmBuffer:
        """A new host buffer of exactly `nbytes` in this root's buffers folder.

        Raises:
            OSError: ENOSPC when the filesystem cannot hold it (the caller turns tier 0 off).
        """
        self.write_job_file()
        buf = ShmBuffer(self.buffers_dir, rank, nbytes)
        self._buffers.append(buf)
        return buf

    @property
    def buffer_count(self) -> int:
        """How many buffers of this process are alive."""
        return len(self._buffers)

    def forget_buffer(self, buf: ShmBuffer) -> None:
        """`buf` is freed: its file goes unless it holds a committed step (which then stays
        until retention or a later process deletes it)."""
        self._buffers = [b for b in self._buffers if b is not buf]
        in_step = os.path.dirname(buf.path) != self.buffers_dir
        buf.close(unlink=not in_step)

    def spare_buffer(self, nbytes: int) -> ShmBuffer | None:
        """A buffer of this process of exactly `nbytes` that holds no step (one retention took
        back), to receive into again instead of allocating; spares of other sizes are freed."""
        with self.lock:
            spares = [b for b in self._buffers if os.path.dirname(b.path) == self.buffers_dir]
            found = next((b for b in spares if b.nbytes == nbytes), None)
            for b in spares:
                if b is not found:
                    self.forget_buffer(b)
            return found

    def drop_stale_buffers(self, rank: int) -> list[str]:
        """Remove `rank`'s buffer files that no buffer of this process is (a dead process of
        that rank left them: no step holds a file in the buffers folder). Call only while this
        process is the one that writes `rank`'s buffers here (its writer lock, or the one
        holder of `rank`'s copies)."""
        removed = []
        with self.lock:
            for entry in _entries(self.buffers_dir):
                m = _BUFFER_RE.fullmatch(entry.name)
                if m is None or int(m.group(1)) != rank or any(b.owns(entry.path) for b in self._buffers):
                    continue
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False):
                        os.unlink(entry.path)
                        removed.append(entry.path)
        return removed

    def buffer_of(self, data: memoryview) -> ShmBuffer | None:
        """This process's buffer whose whole mapping `data` is, if any."""
        if not self._buffers or len(data) == 0:
            return None
        addr = address_of(data)
        return next((b for b in self._buffers if b.address == addr and b.nbytes == len(data)), None)

    def take_back(self, buf: ShmBuffer) -> int | None:
        """Before `buf` is overwritten: if it holds a committed step, make that step invisible
        (marker first) and move the file back to the buffers folder. Returns the step it held."""
        with self.lock:
            return self._take_back(buf)

    def _take_back(self, buf: ShmBuffer) -> int | None:
        folder = os.path.dirname(buf.path)
        if folder == self.buffers_dir:
            return None
        step = naming.parse_step_dir(os.path.basename(folder))
        marker = os.path.join(folder, naming.COMMIT_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(marker)
        dest = os.path.join(self.buffers_dir, buffer_file_name(self.rank))  # never onto another buffer
        os.makedirs(self.buffers_dir, mode=0o700, exist_ok=True)
        if buf.owns(buf.path):
            os.rename(buf.path, dest)
        buf.path = dest
        self._drop_own_files(folder)
        return step

    def _drop_own_files(self, folder: str) -> None:
        """Remove this rank's files from an invisible step (the other ranks' files are live
        buffers of their processes: each rank removes its own), and the directory once empty."""
        own = f"rank-{self.rank:05d}-"
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if name.startswith(own) and not any(b.owns(path) for b in self._buffers):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            os.rmdir(folder)

    def claim_writer(self, rank: int, world_size: int) -> list[str]:
        """As on tier 1 (the writer lock, then this rank's leftovers), and this rank's buffers
        that a process of this rank left in the buffers folder when it died (no step holds
        them, and the lock says no live process writes this rank): without this, every killed
        process would leave its free buffers in shared memory until the job ends."""
        removed = super().claim_writer(rank, world_size)
        return removed + self.drop_stale_buffers(rank)

    def open_step(self, step: int, rank: int, shared: bool = False) -> StepWriter:
        self.write_job_file()
        os.makedirs(self.root, exist_ok=True)
        tmp = os.path.join(self.root, naming.tmp_dir_name(step, rank))
        os.mkdir(tmp)
        return _MemoryStepWriter(self, step, tmp, shared)

    def delete_step(self, step: int) -> None:
        """Marker first; then this rank's part only (capability `rank_parts`): its buffers go
        back to the buffers folder, its other files (an earlier process's shard, a manifest)
        are removed; the directory goes with the last rank's part."""
        folder = self.path_of(step)
        try:
            if not stat.S_ISDIR(os.lstat(folder).st_mode):
                os.unlink(folder)  # a link at a step's name loses only itself
                return
        except FileNotFoundError:
            return
        with self.lock:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, naming.COMMIT_NAME))
            for buf in self._buffers:
                if os.path.dirname(buf.path) == folder:
                    self._take_back(buf)
            self._drop_own_files(folder)

    # -- the job file and cleaning -----------------------------------------------------

    def write_job_file(self) -> None:
        path = os.path.join(self.root, JOB_FILE)
        if os.path.lexists(path):
            return
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        doc = {"job_id": self.job_id, "source": self.source, "host": socket.gethostname(), "created": time.time()}
        tmp = f"{path}.tmp-{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(doc).encode())
        finally:
            os.close(fd)
        os.rename(tmp, path)

    def close_job(self) -> None:
        """A finished job's `close` (after its writer stopped): this rank's part of every
        step goes, and the whole root once no other live process holds a lock there (the
        last rank out removes it). Only names tier 0 makes are removed."""
        with self.lock:
            for step in self.committed_steps() + self.stray_steps():
                self.delete_step(step)
            for buf in self._buffers:
                buf.close(unlink=True)
            self._buffers = []
        if not _live(self.root):
            remove_root(self.root)


class _MemoryStepWriter(_LocalStepWriter):
    """Writes a tier-0 step: a shard that is one of this process's buffers is moved into the
    step, not copied; anything else (a replica, a manifest) is written as on tier 1."""

    def __init__(self, tier: SharedMemoryTier, step: int, tmp: str, shared: bool = False) -> None:
        super().__init__(tier, step, tmp, shared)
        self._mem = tier
        self._moved: list[ShmBuffer] = []

    def write_file(self, name: str, data: memoryview, aligned: bool = False, compress: bool = False) -> int:
        buf = self._mem.buffer_of(data)
        if buf is None or not buf.owns(buf.path):
            return super().write_file(name, data, aligned, compress)
        dest = os.path.join(self._tmp, name)
        with self._mem.lock:
            os.rename(buf.path, dest)
            buf.path = dest
        self._moved.append(buf)
        return len(data)

    def commit(self, marker: bytes) -> None:
        super().commit(marker)
        self._settle()

    def publish_part(self) -> None:
        super().publish_part()
        self._settle()

    def _settle(self) -> None:
        """The step's directory moved (commit) or its files did (publish): follow them."""
        final = self._mem.path_of(self._step)
        with self._mem.lock:
            for buf in self._moved:
                buf.path = os.path.join(final, os.path.basename(buf.path))

    def abort(self) -> None:
        for buf in self._moved:  # a buffer moved in goes back before the rest goes
            if os.path.dirname(buf.path) in (self._tmp, self._mem.path_of(self._step)):
                self._mem.take_back(buf)
        super().abort()


_MADV_POPULATE_WRITE = 23  # Linux 5.14: fault every page of a range in, writable
_madvise: Any = None


def mapped(fd: int, nbytes: int, flags: int) -> mmap.mmap:
    """``mmap.mmap(fd, nbytes, flags=flags)`` (``fd`` -1: anonymous) with every page faulted
    in for writing, as ``MAP_POPULATE`` would, without holding the GIL meanwhile.

    CPython's ``mmap.mmap`` keeps the GIL through the ``mmap`` call, and with ``MAP_POPULATE``
    that call is the whole population: 80 ms for 192 MiB of shared memory on the 2-core
    test machine, during which every other thread of the process waited (a copy from another
    node received into a new buffer on a background thread stopped training's thread for
    that long; docs/performance.md, "Tier 0"). The mapping is made without it, then populated
    by ``madvise(MADV_POPULATE_WRITE)`` called through ctypes, which releases the GIL around
    a foreign call. A kernel without that advice (before 5.14) leaves the pages to fault in
    at first touch, in whichever copy first writes them (a torch copy or a receive, both
    outside the GIL)."""
    m = mmap.mmap(fd, nbytes, flags=flags)
    global _madvise
    if _madvise is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    view = memoryview(m)
    try:
        address = address_of(view)
    finally:
        view.release()
    _madvise(address, nbytes, _MADV_POPULATE_WRITE)  # -1 (EINVAL: an older kernel): faulted in on use
    return m


def address_of(data: memoryview) -> int:
    """The address of the first byte of `data` (read-only views too)."""
    import numpy as np

    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)


def remove_root(root: str) -> None:
    """Remove a tier-0 root: only entries whose names tier-0 makes, never through a link."""
    try:
        if not stat.S_ISDIR(os.lstat(root).st_mode):
            return
    except FileNotFoundError:
        return
    for entry in _entries(root):
        name = entry.name
        ours = (
            naming.parse_step_dir(name) is not None
            or naming.is_leftover(name)
            or name in (JOB_FILE, BUFFERS_DIR, REPLICAS_DIR)
            or name.startswith(naming.LOCK_PREFIX)
            or name.startswith(JOB_FILE + ".tmp-")
        )
        if not ours:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def _entries(root: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(root) as it:
            yield from list(it)
    except OSError:
        return


def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _dirs, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_blocks * 512
    return total


def _live(root: str) -> bool:
    """Whether a process holds one of the root's writer locks (it is a live job's)."""
    for entry in _entries(root):
        if not entry.name.startswith(naming.LOCK_PREFIX):
            continue
        rank_text = entry.name[len(naming.LOCK_PREFIX) :]
        if not (rank_text.isascii() and rank_text.isdigit()):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue  # a link, FIFO or directory at a lock's name is no process's lock
            fd = WriterLock(root).try_lock(int(rank_text))
        except OSError:
            return True  # cannot tell (permissions): as if live, so never removed
        if fd is None:
            return True
        close_quietly(fd)
    return False


def list_jobs(memory_dir: str) -> list[MemoryJob]:
    """Every job's tier-0 root under `memory_dir` (only names tier 0 makes; no link followed)."""
    jobs = []
    for entry in _entries(memory_dir):
        if not (_ROOT_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
            continue
        info: dict[str, object] = {}
        with contextlib.suppress(OSError, ValueError, RecursionError):  # a hostile file: no info
            fd = os.open(os.path.join(entry.path, JOB_FILE), os.O_RDONLY | O_NOFOLLOW | os.O_NONBLOCK | O_CLOEXEC)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    raw = os.read(fd, 1 << 16)
                    loaded = json.loads(raw)
                    if isinstance(loaded, dict):
                        info = loaded
            finally:
                os.close(fd)
        modified = max((_mtime(e) for e in _entries(entry.path)), default=_mtime(entry))
        tier = LocalTier(entry.path, name="memory", direct_io=False, fsync=False, recycle=False)
        jobs.append(
            MemoryJob(
                root=entry.path,
                job_id=str(info.get("job_id", "?"))[:256],
                source=str(info.get("source", "?"))[:64],
                host=str(info.get("host", "?"))[:256],
                created=_number(info.get("created")),
                modified=modified,
                bytes=_tree_bytes(entry.path),
                steps=tuple(tier.committed_steps()),
                live=_live(entry.path),
            )
        )
    return sorted(jobs, key=lambda j: j.root)


def clean_jobs(
    memory_dir: str,
    older_than: float,
    *,
    dry_run: bool = False,
    now: float | None = None,
    keep: str | None = None,
) -> list[MemoryJob]:
    """Remove the tier-0 roots no live process holds and nothing touched for `older_than`
    seconds (but `keep`, the caller's own); returns them. A live job's files are never removed."""
    now = time.time() if now is None else now
    gone = []
    for job in list_jobs(memory_dir):
        if job.live or now - job.modified < older_than or job.root == keep:
            continue
        if not dry_run:
            remove_root(job.root)
        gone.append(job)
    return gone


def _mtime(entry: os.DirEntry[str]) -> float:
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def _number(value: object) -> float:
    """A time from a job file: a finite number, else 0 (a huge int overflows float())."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0
    try:
        x = float(value)
    except OverflowError:
        return 0.0
    return x if math.isfinite(x) else 0.0


def space_free(memory_dir: str) -> int:
    st = os.statvfs(memory_dir)
    return st.f_bavail * st.f_frsize


def check_memory_dir(memory_dir: str) -> str | None:
    """None when `memory_dir` can hold tier 0, else why not (for the one warning)."""
    try:
        st = os.stat(memory_dir)
    except OSError as exc:
        return f"{memory_dir} is not there ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{memory_dir} is not a directory"
    if not os.access(memory_dir, os.W_OK | os.X_OK):
        return f"{memory_dir} is not writable"
    return None


__all__ = [
    "DEFAULT_MEMORY_DIR",
    "MemoryJob",
    "SharedMemoryTier",
    "ShmBuffer",
    "check_memory_dir",
    "clean_jobs",
    "job_identity",
    "job_key",
    "list_jobs",
    "node_identity",
    "replica_root",
    "space_free",
]
