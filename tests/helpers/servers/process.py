"""A server subprocess that the tests own: start, readiness wait, signals, and no leftovers.

Every server runs in its own session (process group), so signals reach any children too.
Three layers make sure no server outlives the test run:
  1. the fixtures stop their server in a ``finally``;
  2. an ``atexit`` hook SIGKILLs every server that is still registered as live;
  3. servers started from the main thread get ``PR_SET_PDEATHSIG=SIGKILL``, so the kernel kills
     them if the test process itself dies (SIGKILL, crash) and ``atexit`` never runs.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_LIVE: set[ManagedProcess] = set()
_LIVE_LOCK = threading.Lock()

try:
    _LIBC: Any = ctypes.CDLL("libc.so.6", use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover - non-glibc
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerStartError(RuntimeError):
    """The server process did not become ready (message carries the tail of its log)."""


class ManagedProcess:
    """Base class: a subprocess with a log file in ``workdir`` and signal helpers.

    Subclasses implement ``_command()`` and ``_wait_ready(deadline)``; they may override
    ``_env()`` and ``_after_exit()`` (cleanup of files the server leaves behind).
    """

    name = "server"
    stop_timeout_s = 5.0  # SIGTERM, then SIGKILL after this long

    def __init__(self, workdir: str | os.PathLike[str]) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds: list[float] = []  # wall time of each (re)start until ready

    # --- to implement -------------------------------------------------------------------
    def _command(self) -> Sequence[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _wait_ready(self, deadline: float) -> None:
        raise NotImplementedError

    def _after_exit(self) -> None:
        """Called after the process is gone (kill, stop, close)."""

    # --- process control ----------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start: {' '.join(self._command())}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                list(self._command()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env=self._env(),
                start_new_session=True,
                preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
            )
        finally:
            log.close()
        with _LIVE_LOCK:
            _LIVE.add(self)

    def _start(self, timeout: float) -> None:
        t0 = time.monotonic()
        self._spawn()
        try:
            self._wait_ready(t0 + timeout)
        except BaseException:
            self.kill()
            raise
        self.start_seconds.append(time.monotonic() - t0)

    def _signal(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # own session: pgid == pid
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover
            self.proc.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL (the whole process group), like a crash. Data dir and ports are kept."""
        if self.proc is not None:
            self._signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # D state: give up waiting
                self.proc.wait(timeout=10)
        self._after_exit()

    def stop(self, timeout: float | None = None) -> None:
        """Graceful stop: SIGTERM (and SIGCONT, in case it is stopped), SIGKILL after a timeout."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=self.stop_timeout_s if timeout is None else timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._after_exit()

    def stop_process(self) -> None:
        """SIGSTOP: the server hangs (connections stay open, nothing answers)."""
        self._signal(signal.SIGSTOP)

    def cont_process(self) -> None:
        """SIGCONT: undo ``stop_process()``."""
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop for good (idempotent)."""
        try:
            self.stop()
        finally:
            with _LIVE_LOCK:
                _LIVE.discard(self)

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-nbytes:].decode(errors="replace")

    def _current_log(self) -> str:
        """Log text written by the current run only."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_offset", 0))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    # --- readiness helpers --------------------------------------------------------------
    def _check_exited(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerStartError(
                f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )

    def _poll_until(self, what: str, deadline: float, probe: Callable[[], bool], interval: float = 0.05) -> None:
        last_exc: BaseException | None = None
        while True:
            self._check_exited()
            try:
                if probe():
                    return
            except Exception as e:
                last_exc = e
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name}: timed out waiting for {what} (last error: {last_exc!r}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(interval)


def http_answers(url: str, timeout: float = 1.0) -> bool:
    """True once anything answers HTTP at url (any status code counts, 403 included)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True


def _kill_all_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
        _LIVE.clear()
    for p in live:
        with contextlib.suppress(Exception):
            p.kill()


atexit.register(_kill_all_live)


class ObjectStoreServer(ManagedProcess):
    """A ManagedProcess that serves an fsspec protocol.

    Public surface used by tests: ``url_root``, ``storage_options``, ``port``, ``pid``,
    ``filesystem()``, ``storage_options_via(port)``, ``unique_url()``, ``kill()``,
    ``restart()``, ``stop_process()``, ``cont_process()``.
    """

    protocol = ""
    port: int

    @property
    def url_root(self) -> str:
        raise NotImplementedError

    def storage_options_via(self, port: int) -> dict[str, Any]:
        """storage_options that reach this server through 127.0.0.1:port (e.g. a FaultProxy)."""
        raise NotImplementedError

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec storage_options: endpoint, creds, no instance cache, short timeouts/retries."""
        return self.storage_options_via(self.port)

    def filesystem(self, port: int | None = None, **overrides: Any) -> Any:
        """A fresh fsspec filesystem for this server (optionally through another port)."""
        import fsspec

        opts = self.storage_options_via(self.port if port is None else port)
        opts.update(overrides)
        return fsspec.filesystem(self.protocol, **opts)

    def unique_url(self, prefix: str = "t") -> str:
        """A fresh, empty path under url_root, e.g. ``s3://bucket/t-1a2b3c4d``."""
        import uuid

        return f"{self.url_root}/{prefix}-{uuid.uuid4().hex[:12]}"

    def start(self, timeout: float = 60.0) -> None:
        self._start(timeout)

    def restart(self, graceful: bool = True, timeout: float = 60.0) -> None:
        """Stop (gracefully, or SIGKILL with graceful=False) if running, then start again on
        the same port(s) with the same data dir, and wait until it serves again."""
        if self.alive():
            if graceful:
                self.stop()
            else:
                self.kill()
        self._start(timeout)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url_root} port={getattr(self, 'port', None)} pid={self.pid}>"
