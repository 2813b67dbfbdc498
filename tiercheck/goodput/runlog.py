"""The run log: a few JSON lines per minute that say where a run's time went, kept across
restarts next to the checkpoints, for `tiercheck report` and `tiercheck plan`.

Where: ``<tier 1>/.tiercheck-runlog/rank-00000.jsonl``, one file per rank, appended to by
every session (Checkpointer) of that rank; with no tier 1, on tier 2 as
``<tier 2>/.tiercheck-runlog/rank-00000-<session>-p0000.jsonl``, one object per session
rewritten whole at each flush (object stores cannot append) by the uploader thread, a new
part after `PART_LIMIT` bytes. Listing, retention and the crash sweep only touch names that
`layout` makes for steps, temp and trash directories, so they never see these files.

What (schema `goodput.SCHEMA_VERSION`; every record has ``v``, ``kind``, ``session``,
``rank``, ``seq`` and ``t``, the wall-clock time in seconds since the epoch):

* ``start``: the Checkpointer was created (``world_size``, ``tiers``, ``pid``, ``host``);
* ``restore``: ``dur_s``, ``step`` (None: no checkpoint), ``iter`` (loop iterations done);
* ``save``: ``step``, ``iter``, ``stall_s``, ``bytes``;
* ``durable``: ``step``, ``tier_s`` (seconds from save() until durable per tier), ``errors``;
* ``loop``: one per flush interval, not per step: ``t0`` (window start), ``iter`` (the
  session's iterations so far), ``iters``, ``wait_s`` (in the loader's ``next()``),
  ``compute_s`` (the loop body less checkpoint calls), and the ``busy_`` share of these
  while a save was being written;
* ``wait`` / ``drain``: time blocked in `wait()` / `drain()` (``dur_s``);
* ``error``: a background error raised to the caller (``step``, ``tier``, ``message``);
* ``close``: the session ended cleanly (``dur_s``: the wait for pending saves);
* ``heartbeat``: the newest progress, ``iter``, and the counters of the window not yet
  flushed (the ``loop`` fields); tier 1 only: the ``.heartbeat`` file beside the log,
  overwritten about once a second, appended to the log by the next session.

Rules: the log and heartbeat are written only as regular files of their own inside the
directory, never through a link (invariant 8: a link, FIFO or device named like them is
refused and warned once; one hard-linked elsewhere is first replaced by a copy of its own);
nothing is written until the session trains (its first `save()` or a batch of
``ckpt.timed(loader)``), so a script that only restores never changes a tier; a failure to
write is logged once as a warning and otherwise ignored (training goes on); memory is
bounded (counters, and at most `MAX_PENDING` unwritten lines).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from ..format import naming
from ..observe.events import logger
from ..steps.handle import DrainReport, SaveHandle
from ..tiers.base import Tier
from ..tiers.remote import RemoteTier
from .summary import MAX_INT, SCHEMA_VERSION

__all__ = ["DEFAULT_INTERVAL", "RunLog", "RunLogFiles", "parse_record", "read_records"]

T = TypeVar("T")

DEFAULT_INTERVAL = 10.0  # seconds between flushes of the loop counters
REMOTE_MIN_INTERVAL = 60.0  # object stores: at most one rewrite a minute (plus saves and close)
PART_LIMIT = 256 << 10
MAX_PENDING = 4096  # unwritten lines kept in memory (a tier that keeps failing)
MAX_WATCHED = 256  # saves whose durability is still to be logged
MAX_RECORD_BYTES = 1 << 20  # a reader skips longer lines: no run log has them
HEARTBEAT_INTERVAL = 1.0  # seconds between heartbeats (tier 1 only)
HEARTBEAT_BYTES = 512
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # never append through a link planted in the directory
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # nor wait on a FIFO planted there
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _Refused(OSError):
    """A file named like one of the run log's that tiercheck may not open: a symbolic link,
    a FIFO, a device (invariant 8)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.reason = reason


def _check_regular(st: os.stat_result, path: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _Refused(path, "a symbolic link, which tiercheck does not follow in its directory")
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(path, "not a regular file (a FIFO, a device or a directory named like a run log)")


def _open_regular(dfd: int, name: str, flags: int) -> int:
    """A descriptor of regular file `name` in directory `dfd`, opened with `flags` (with
    ``O_CREAT``: created if absent), never through a symbolic link. A FIFO or device is
    refused before it is opened (opening some devices acts on them), and opened without
    waiting should one be swapped in since (``O_NONBLOCK``).

    Raises:
        _Refused: `name` is not a regular file.
    """
    try:
        _check_regular(os.stat(name, dir_fd=dfd, follow_symlinks=False), name)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    try:
        fd = os.open(name, flags | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, 0o644, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link or a FIFO swapped in since the check
            raise _Refused(name, "not a regular file") from None
        raise
    try:
        _check_regular(os.fstat(fd), name)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_dir(path: str, shown: str, link_reason: str) -> int:
    """A descriptor of directory `path`, not opened through a link at its last component.

    Raises:
        _Refused: `path` is a symbolic link (named `shown`, for `link_reason`).
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise _Refused(shown, link_reason) from None
        raise


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class _LocalSink:
    """Appends to one file per rank in the tier-1 directory (no fsync: a process crash keeps
    what was written; a power loss may cost the last lines, which the reader tolerates).

    Beside it, ``rank-00000.heartbeat`` holds one fixed-size record overwritten in place
    about once a second (iterations done, time), so that a run killed between two flushes
    is still known to have got that far. A session that starts first appends the previous
    session's last heartbeat to the log, so the next one cannot overwrite it unseen.

    Both are written only as regular files of their own, inside the directory and through no
    link (invariant 8): a symbolic link, FIFO or device named like them is refused (the
    write fails, warned once); a file hard-linked elsewhere (a run forked with ``cp -al``,
    a log kept with ``ln``) is first replaced by a copy of its own, so that the other name
    keeps what it held."""

    def __init__(self, root: str, rank: int, session: str) -> None:
        self.dir = os.path.join(root, naming.RUNLOG_DIR)
        self.name = naming.runlog_file_name(rank)
        self.beat_name = naming.runlog_heartbeat_name(rank)
        self.path = os.path.join(self.dir, self.name)
        self._session = session
        self._taken_over = False

    def _dir_fd(self) -> int:
        os.makedirs(self.dir, exist_ok=True)
        return _open_dir(self.dir, self.dir, "a symbolic link; the run log is written through none")

    def _own(self, dfd: int, name: str, flags: int) -> int:
        """A descriptor of our file `name` for writing, created if absent, with no other link."""
        for _ in range(3):
            fd = _open_regular(dfd, name, flags | os.O_CREAT)
            if os.fstat(fd).st_nlink <= 1:
                return fd
            os.close(fd)
            self._unshare(dfd, name)
        raise _Refused(os.path.join(self.dir, name), "hard-linked again each time it was copied")

    def _unshare(self, dfd: int, name: str) -> None:
        """Replace `name` by a copy of its own (the other links keep the original)."""
        tmp = f".{name}.{self._session}.tmp"  # a name `layout` never lists as a log
        src = _open_regular(dfd, name, os.O_RDONLY)
        try:
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o644, dir_fd=dfd)
            try:
                try:
                    while chunk := os.read(src, READ_CHUNK):
                        _write_all(dst, chunk)
                finally:
                    os.close(dst)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
        finally:
            os.close(src)

    def _take_over(self, dfd: int) -> bytes:
        """Once per session: a torn last line is ended, and a foreign heartbeat is kept."""
        self._taken_over = True
        prefix = b""
        try:
            fd = _open_regular(dfd, self.name, os.O_RDONLY)
        except FileNotFoundError:
            pass
        else:
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # a line torn by a crash must not swallow ours
                    prefix = b"\n"
            finally:
                os.close(fd)
        try:
            fd = _open_regular(dfd, self.beat_name, os.O_RDONLY)
            try:
                beat = os.pread(fd, HEARTBEAT_BYTES + 1, 0).strip()
            finally:
                os.close(fd)
            rec = parse_record(beat)
            if rec is not None and rec.get("session") != self._session:
                prefix += beat + b"\n"
        except OSError:  # none, or not ours to read: the beat() that follows says so
            pass
        return prefix

    def write(self, data: bytes) -> None:
        dfd = self._dir_fd()
        try:
            if not self._taken_over:
                data = self._take_over(dfd) + data
            fd = self._own(dfd, self.name, os.O_WRONLY | os.O_APPEND)
            try:
                _write_all(fd, data)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def beat(self, line: bytes) -> None:
        if not self._taken_over:
            self.write(b"")
        dfd = self._dir_fd()
        try:
            fd = self._own(dfd, self.beat_name, os.O_WRONLY)
        finally:
            os.close(dfd)
        try:
            os.pwrite(fd, line.ljust(HEARTBEAT_BYTES - 1) + b"\n", 0)  # one write, always the same size
        finally:
            os.close(fd)


class _RemoteSink:
    """Rewrites this session's current part on tier 2 from the uploader thread; a flush
    that finds one upload already queued only adds its lines to what that upload sends."""

    def __init__(self, tier: RemoteTier, rank: int, session: str, submit: Callable[[Callable[[], None]], None]) -> None:
        self._tier = tier
        self._rank = rank
        self._session = session
        self._submit = submit
        self._lock = threading.Lock()
        self._part = 0
        self._buf = bytearray()
        self._sealed: deque[tuple[str, bytes]] = deque(maxlen=4)
        self._queued = False
        self.on_error: Callable[[BaseException], None] = lambda exc: None

    def _name(self) -> str:
        return naming.runlog_part_name(self._rank, self._session, self._part)

    def write(self, data: bytes) -> None:
        with self._lock:
            self._buf += data
            if len(self._buf) >= PART_LIMIT:
                self._sealed.append((self._name(), bytes(self._buf)))
                self._part += 1
                self._buf = bytearray()
            if self._queued:
                return
            self._queued = True
        self._submit(self._upload)

    def _upload(self) -> None:
        with self._lock:
            self._queued = False
            todo = list(self._sealed) + ([(self._name(), bytes(self._buf))] if self._buf else [])
            self._sealed.clear()
        try:
            for name, data in todo:
                path = f"{self._tier.root}/{naming.RUNLOG_DIR}/{name}"
                self._tier.put_bytes(path, memoryview(data))
        except Exception as exc:
            self.on_error(exc)


class RunLog:
    """One session's run log; the Checkpointer calls it at each save, restore, wait, drain
    and close, and ``ckpt.timed(loader)`` feeds it the loop's timing.

    Calls come from the training thread (and the SIGTERM handler or the finalizer, which
    run on it or after it): only the remote sink's upload runs elsewhere.
    """

    def __init__(
        self,
        local: Tier | None,
        remote: Tier | None,
        rank: int,
        world_size: int,
        interval: float | None,
        submit_remote: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self.session = secrets.token_hex(8)
        self.rank = rank
        self.enabled = interval is not None
        self._interval = DEFAULT_INTERVAL if interval is None else float(interval)
        self._sink: _LocalSink | _RemoteSink | None = None
        self._where = ""
        if self.enabled:
            if local is not None and local.capabilities.local_files:
                self._sink = _LocalSink(local.local_dir(), rank, self.session)
                self._where = self._sink.path
            elif isinstance(remote, RemoteTier) and submit_remote is not None:
                sink = _RemoteSink(remote, rank, self.session, submit_remote)
                sink.on_error = self._failed
                self._sink = sink
                self._interval = max(self._interval, REMOTE_MIN_INTERVAL)
                self._where = f"{remote.location.rstrip('/')}/{naming.RUNLOG_DIR}/"
            else:
                self.enabled = False
        self._lock = threading.RLock()
        self._lines: deque[str] = deque()
        self._dropped = 0
        self._seq = 0
        self._active = False  # set by the first save() or timed batch: only then is anything written
        self._closed = False
        self._warned = False
        self._watched: deque[SaveHandle] = deque()
        self._watch: SaveHandle | None = None  # the newest save not yet durable everywhere
        self._next_flush = 0.0
        self._next_beat = 0.0
        # loop counters: the session's iterations, the current window's sums
        self._iters = 0
        self._in_body = False
        self._excl = 0.0  # checkpoint calls inside the current loop body, taken out of compute
        self._blocked = 0.0  # wait() calls since the last flush: one record for all of them
        self._blocked_n = 0
        self._blocked_t0 = 0.0
        self._in_loop = False
        self._wall = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self._tick_at = 0.0  # perf_counter when the current iteration began (asked for its batch)
        self._w_t0: float | None = None  # wall time the current window began (None: at its first batch)
        self._w_iters = 0
        self._w_wait = 0.0
        self._w_compute = 0.0
        self._w_busy = 0
        self._w_busy_wait = 0.0
        self._w_busy_compute = 0.0
        if self.enabled:
            tiers = [t.name for t in (local, remote) if t is not None]
            self._record("start", world_size=world_size, tiers=tiers, pid=os.getpid(), host=socket.gethostname())

    # -- records ---------------------------------------------------------------------

    def _record(self, kind: str, t: float | None = None, **fields: Any) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._seq += 1
            rec = {
                "v": SCHEMA_VERSION,
                "kind": kind,
                "session": self.session,
                "rank": self.rank,
                "seq": self._seq,
                "t": round(time.time() if t is None else t, 6),
                **fields,
            }
            try:
                line = json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n"
            except (TypeError, ValueError) as exc:  # a value JSON cannot hold: drop the record
                self._failed(exc)
                return
            self._lines.append(line)
            while len(self._lines) > MAX_PENDING:
                self._lines.popleft()
                self._dropped += 1

    def _iter_now(self) -> int:
        """Loop iterations done, the current one included when a checkpoint call is made from
        its body (the save of step N comes after the iteration that computed step N)."""
        return self._iters + (1 if self._in_body else 0)

    def _excluded(self, seconds: float) -> None:
        if self._in_body:
            self._excl += seconds

    def saved(self, handle: SaveHandle) -> None:
        """After `save()` returned `handle`: log its stall, then flush."""
        if not self.enabled or self._closed:
            return
        t0 = time.perf_counter()
        stats = handle.stats
        self._active = True
        self._record(
            "save",
            t=time.time() - stats.stall_s,
            step=handle.step,
            iter=self._iter_now(),
            stall_s=round(stats.stall_s, 6),
            bytes=stats.bytes,
        )
        with self._lock:
            self._watched.append(handle)
            while len(self._watched) > MAX_WATCHED:
                self._watched.popleft()
            self._watch = handle
        self.flush()
        self._excluded(stats.stall_s + time.perf_counter() - t0)

    def restored(self, step: int | None, seconds: float, tier: str | None = None) -> None:
        if not self.enabled or self._closed:
            return
        fields: dict[str, Any] = {"tier": tier} if tier else {}
        self._record(
            "restore", t=time.time() - seconds, dur_s=round(seconds, 6), step=step, iter=self._iter_now(), **fields
        )
        self._excluded(seconds)
        if self._active:
            self.flush()

    def waited(self, seconds: float) -> None:
        """`wait()` blocked `seconds`; summed into one record per flush, however often it is called."""
        if not self.enabled or self._closed:
            return
        if not self._blocked_n:
            self._blocked_t0 = time.time() - seconds
        self._blocked += seconds
        self._blocked_n += 1
        self._excluded(seconds)

    def drained(self, report: DrainReport, seconds: float) -> None:
        if not self.enabled or self._closed:
            return
        self._record(
            "drain",
            t=time.time() - seconds,
            dur_s=round(seconds, 6),
            durable=report.durable,
            pending=report.pending,
            errors=[str(e) for e in report.errors],
        )
        self._excluded(seconds)
        self.flush()  # a drain usually precedes the end of the process (SIGTERM)

    def errored(self, step: int | None, tier: str | None, message: str) -> None:
        if self.enabled and not self._closed:
            self._record("error", step=step, tier=tier, message=message[:1000])

    def close(self, seconds: float) -> None:
        """The session ends cleanly; `seconds`: how long close() waited for pending saves."""
        if not self.enabled or self._closed:
            return
        self._record("close", t=time.time() - seconds, dur_s=round(seconds, 6))
        self.flush()
        self._closed = True

    # -- the loop --------------------------------------------------------------------

    def timed(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield `iterable`'s items, timing ``next()`` (data wait) and the loop body."""
        if not self.enabled:
            yield from iterable
            return
        clock = time.perf_counter
        tick = self._tick
        self._in_body = False
        self._in_loop = True
        self._excl = 0.0
        t_req = self._tick_at = clock()
        it = iter(iterable)  # a DataLoader starts its workers here: that is data wait too
        wait = -1.0
        t_got = 0.0
        try:
            while True:
                try:
                    item = next(it)
                except StopIteration:
                    return
                t_got = clock()
                wait = t_got - t_req
                self._in_body = True
                yield item
                t_req = clock()
                self._in_body = False
                tick(wait, t_req - t_got, t_req)
                wait = -1.0
        finally:
            self._in_loop = False
            if wait >= 0:  # left from inside the body (break, exception): count it
                self._in_body = False
                tick(wait, clock() - t_got, clock())
            if not self._w_iters:  # a window opened by a flush but without a batch: none
                self._w_t0 = None

    def _tick(self, wait: float, body: float, now: float) -> None:
        """One finished iteration: `wait` in next(), then `body` (checkpoint calls excluded)."""
        if self._closed:
            return
        self._tick_at = now
        if self._w_t0 is None:
            self._w_t0 = self._wall + now - wait - body
        body -= self._excl
        self._excl = 0.0
        if body < 0.0:
            body = 0.0
        if not self._active:
            self._active = True
            self._next_flush = now + self._interval
        self._iters += 1
        self._w_iters += 1
        self._w_wait += wait
        self._w_compute += body
        h = self._watch
        if h is not None:
            if h.done():
                self._watch = None
            else:
                self._w_busy += 1
                self._w_busy_wait += wait
                self._w_busy_compute += body
        if now >= self._next_flush:
            self.flush()
            self._excl += time.perf_counter() - now  # the flush ran in the next iteration's body
        elif now >= self._next_beat:
            self._beat(now)
            self._excl += time.perf_counter() - now

    def _beat(self, now: float) -> None:
        self._next_beat = now + HEARTBEAT_INTERVAL
        sink = self._sink
        if not isinstance(sink, _LocalSink):
            return
        rec: dict[str, Any] = {
            "v": SCHEMA_VERSION,
            "kind": "heartbeat",
            "session": self.session,
            "rank": self.rank,
            "seq": 0,
            "t": round(self._wall + now, 6),
            **self._window_fields(self._wall + now),
        }
        try:
            sink.beat(json.dumps(rec, separators=(",", ":")).encode())
        except Exception as exc:
            self._failed(exc)

    # -- writing ---------------------------------------------------------------------

    def _window(self) -> None:
        """Turn the loop counters (and summed waits) into records and start a new window."""
        if self._blocked_n:
            self._record("wait", t=self._blocked_t0, dur_s=round(self._blocked, 6), calls=self._blocked_n)
            self._blocked, self._blocked_n = 0.0, 0
        # A flush from inside the loop body (a save) ends the window where that iteration began:
        # the iteration is counted in the next window.
        end = self._wall + self._tick_at if self._in_body else time.time()
        if self._w_iters:
            self._record("loop", t=end, **self._window_fields(end))
        self._w_t0 = end if self._in_loop else None
        self._w_iters = self._w_busy = 0
        self._w_wait = self._w_compute = self._w_busy_wait = self._w_busy_compute = 0.0

    def _window_fields(self, end: float) -> dict[str, Any]:
        """The current window's counters (a heartbeat carries them too: the window a crash
        cut short is then not lost)."""
        if not self._w_iters:
            return {"iter": self._iters}
        return {
            "t0": round(end if self._w_t0 is None else self._w_t0, 6),
            "iter": self._iters,
            "iters": self._w_iters,
            "wait_s": round(self._w_wait, 6),
            "compute_s": round(self._w_compute, 6),
            "busy_iters": self._w_busy,
            "busy_wait_s": round(self._w_busy_wait, 6),
            "busy_compute_s": round(self._w_busy_compute, 6),
        }

    def _durable(self) -> None:
        while self._watched and self._watched[0].done():
            h = self._watched.popleft()
            fields: dict[str, Any] = {"step": h.step, "tier_s": {t: round(v, 6) for t, v in h.stats.tier_s.items()}}
            if h._errors:
                fields["errors"] = {t: str(e) for t, e in h._errors.items()}
            self._record("durable", **fields)

    def flush(self) -> None:
        """Write what is pending, once the session trains (a session that only restores writes
        nothing); never raises."""
        if not self.enabled or self._closed or self._sink is None or not self._active:
            return
        with self._lock:
            self._durable()
            self._window()
            if self._dropped:
                self._record("dropped", lines=self._dropped)
                self._dropped = 0
            lines, self._lines = self._lines, deque()
            now = time.perf_counter()
            self._next_flush = now + self._interval
            self._next_beat = now + HEARTBEAT_INTERVAL  # the loop record says as much
        if not lines:
            return
        try:
            self._sink.write("".join(lines).encode())
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "tiercheck: cannot write the run log %s (%s: %s); training goes on, `tiercheck report` "
                "will miss this part of the run (logged once)",
                self._where,
                type(exc).__name__,
                exc,
            )


# -- reading ---------------------------------------------------------------------------

READ_CHUNK = 256 << 10  # bytes read at a time: with the longest record, what a reader holds of a log
MAX_BRACKETS = 64  # more [ and { outside strings than any record has: not a record (nor parsed)
_STRING_RE = re.compile(rb'"(?:[^"\\]|\\.)*"')


class RunLogFiles:
    """The run-log files under a tier root (a directory or an fsspec URL), listed once by
    name; one rank's records are then read on demand, a line at a time, in bounded memory.
    Reads only; never writes.

    Locally, only regular files directly inside ``<root>/.tiercheck-runlog`` are read: no
    symbolic link is followed (the directory itself included) and a FIFO or device named
    like a log is never read from (opening one does not wait for a writer). Each file
    skipped so is named in `skipped_files`, with the reason.

    Attributes:
        where: the run-log directory, for messages.
        ranks: the ranks that have a log, from the file names (no file is opened to know).
        bad: lines read so far that are no record: torn by a crash, too long, not JSON, too
            deeply nested, or with a number out of range.
        skipped_files: ``"path: reason"`` for each file not read.
    """

    def __init__(self, location: str, storage_options: dict[str, Any] | None = None) -> None:
        self.bad = 0
        self.skipped_files: list[str] = []
        self._fs: Any = None
        self._logs: dict[int, list[str]] = {}
        self._beats: dict[int, list[str]] = {}
        if "://" in location and not location.startswith("file://"):
            import fsspec

            self._fs, root = fsspec.core.url_to_fs(location, **(storage_options or {}))
            self._base = f"{root.rstrip('/')}/{naming.RUNLOG_DIR}"
            self.where = f"{location.rstrip('/')}/{naming.RUNLOG_DIR}"
            try:
                paths = list(self._fs.find(self._base))
            except FileNotFoundError:
                paths = []
            names = [p.rsplit("/", 1)[-1] for p in paths]
        else:
            root = location[len("file://") :] if location.startswith("file://") else location
            self._base = self.where = os.path.join(root, naming.RUNLOG_DIR)
            names = []
            try:
                dfd = self._open_dir()
            except _Refused as exc:
                self.skipped_files.append(str(exc))
            except (FileNotFoundError, NotADirectoryError):
                pass
            else:
                try:
                    names = os.listdir(dfd)
                finally:
                    os.close(dfd)
        for name in sorted(names):
            rank = naming.parse_runlog_rank(name)
            if rank is not None:
                self._logs.setdefault(rank, []).append(name)
            elif self._fs is None and name.endswith(".heartbeat"):
                rank = naming.parse_runlog_rank(name[: -len(".heartbeat")] + ".jsonl")
                if rank is not None:
                    self._beats.setdefault(rank, []).append(name)
        self.ranks = sorted(self._logs)

    def _open_dir(self) -> int:
        """The local run-log directory, not through a link (its root may be reached through links)."""
        return _open_dir(
            self._base, self.where, "a symbolic link, which tiercheck does not follow (give the directory it links to)"
        )

    def records(self, rank: int) -> Iterator[dict[str, Any]]:
        """Rank `rank`'s records, file by file and line by line (its heartbeat last); lines
        that are no record are counted in `bad`. Other ranks' files are not opened."""
        for name in self._logs.get(rank, []):
            yield from self._file_records(name, None)
        for name in self._beats.get(rank, []):
            yield from self._file_records(name, HEARTBEAT_BYTES + 1)

    def _file_records(self, name: str, limit: int | None) -> Iterator[dict[str, Any]]:
        heartbeat = limit is not None  # a heartbeat torn by a crash is not an unreadable record
        with self._open(name) as read:
            if read is None:
                return
            chunks = [read(limit)] if limit is not None else iter(lambda: read(READ_CHUNK), b"")
            for line in _lines(chunks):
                rec = None if line is None else parse_record(line)
                if rec is not None:
                    yield rec
                elif not heartbeat:
                    self.bad += 1

    @contextlib.contextmanager
    def _open(self, name: str) -> Iterator[Callable[[int], bytes] | None]:
        """A `read(n)` of file `name`, or None (the reason added to `skipped_files`)."""
        if self._fs is not None:
            with self._fs.open(f"{self._base}/{name}", "rb") as f:
                yield f.read
            return
        path = os.path.join(self.where, name)
        try:
            dfd = self._open_dir()
            try:
                fd = _open_regular(dfd, name, os.O_RDONLY)
            finally:
                os.close(dfd)
        except _Refused as exc:
            self.skipped_files.append(f"{path}: {exc.reason}")
            yield None
            return
        except FileNotFoundError:  # gone since the listing (a remote part rewritten, a copy removed)
            yield None
            return
        except OSError as exc:  # not ours to read (permissions): the others still are
            self.skipped_files.append(f"{path}: {exc.strerror or exc}")
            yield None
            return
        try:
            yield lambda n: os.read(fd, n)
        finally:
            os.close(fd)


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes | None]:
    """The lines in a stream of chunks; None for each line longer than `MAX_RECORD_BYTES`, of
    which no more than that is ever held."""
    buf = bytearray()
    skipping = False  # inside a line too long to be a record: drop bytes until its end
    for chunk in chunks:
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            if skipping or nl - start > MAX_RECORD_BYTES:
                skipping = False
                yield None
            else:
                yield bytes(buf[start:nl])
            start = nl + 1
        del buf[:start]
        if len(buf) > MAX_RECORD_BYTES:
            skipping = True
            buf.clear()
    if skipping:
        yield None
    elif buf.strip():
        yield bytes(buf)


def parse_record(line: bytes) -> dict[str, Any] | None:
    """One run-log line as a record, or None: blank, not a JSON object, nested deeper than a
    record is (json would recurse on it), or holding a number no record holds (a non-finite
    float, an integer beyond 2**63: arithmetic on it overflows). Never raises."""
    if not line.strip():
        return None
    if line.count(b"[") + line.count(b"{") > MAX_BRACKETS:
        bare = _STRING_RE.sub(b"", line)  # brackets inside strings (a message) are text
        if bare.count(b"[") + bare.count(b"{") > MAX_BRACKETS:
            return None
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(rec, dict) or not _sane(rec, 0):
        return None
    return rec


def _sane(value: object, depth: int) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int):  # bool included
        return -MAX_INT <= value <= MAX_INT
    if isinstance(value, dict):
        return depth < 3 and all(_sane(v, depth + 1) for v in value.values())
    if isinstance(value, list):
        return depth < 3 and all(_sane(v, depth + 1) for v in value)
    return True


def read_records(
    location: str, storage_options: dict[str, Any] | None = None, rank: int | None = None
) -> tuple[list[dict[str, Any]], int]:
    """The run-log records under a tier root (a directory or an fsspec URL), of `rank` only
    or of every rank, and the number of lines that could not be read (torn by a crash). All
    in memory: `RunLogFiles` reads one rank a line at a time.

    Raises:
        FileNotFoundError: the location holds no run log (of `rank`).
    """
    files = RunLogFiles(location, storage_options)
    ranks = files.ranks if rank is None else [r for r in files.ranks if r == rank]
    if not ranks:
        raise FileNotFoundError(no_log_message(files, rank))
    records = [r for rk in ranks for r in files.records(rk)]
    return records, files.bad


def no_log_message(files: RunLogFiles, rank: int | None) -> str:
    """Why `files` holds no log (of `rank`), in one line."""
    whose = "" if rank is None else f" of rank {rank}"
    if files.skipped_files:
        return f"no run log{whose} in {files.where}: skipped {'; '.join(files.skipped_files)}"
    if files.ranks:
        return f"no run log{whose} in {files.where} (ranks there: {files.ranks})"
    return (
        f"no run log{whose} in {files.where}: it is written by a Checkpointer on this directory once it saves "
        "or runs a `ckpt.timed(loader)` loop (tiercheck >= 0.1 with run_log_interval set)"
    )
