"""A fault-injecting in-memory fsspec filesystem for remote-tier tests.

``faultymem://root/path`` behaves like ``memory://`` (with a store of its own) except that
the calls tiercheck makes can be made to fail, hang, or be cut midway, on demand. The knob
is a `Faults` object. fsspec builds filesystem instances itself (tiercheck passes
``skip_instance_cache=True``), so a test hands its knob over through the storage options::

    faults = Faults()
    ckpt = Checkpointer(local=tmp, remote="faultymem://run", storage_options={"faults": faults})
    faults.fail(ConnectionRefusedError, times=3, ops={"write"})  # the next 3 writes refuse
    faults.fail(TimeoutError, seconds=2.0)                       # every call, for 2 s
    faults.fail(PermissionError)                                 # every call until heal()
    faults.slow(5.0, ops={"write"})                              # each write waits 5 s first
    faults.cut(1000, path=".shard")                              # next shard upload: 1000 bytes
                                                                 # land, then the connection drops
    faults.heal()                                                # clear all rules, wake sleepers
    faults.log                                                   # [(event, path), ...] in order

``{"faults": "name"}`` instead looks the knob up in a process-wide registry (`Faults.named`),
for code that only has a URL and options to pass around. Without the option, a filesystem
uses the shared, initially empty `DEFAULT` knob.

Operations, as rules name them: ``"list"`` (find, ls), ``"read"`` (cat_file, info, opening
for reading), ``"write"`` (pipe_file, opening for writing), ``"delete"`` (rm_file, rm). A
rule is checked once per call that tiercheck makes, not again for the calls an fsspec method
makes internally (``rm`` expanding its path, ``pipe_file`` opening a file).

The log records, per call: ``("list"|"read"|"write"|"delete", path)`` when it starts,
``("written", path)`` when a write completed (the object holds all its bytes), and
``("injected:<kind>", path)`` for each fault injected. Paths are stored without protocol
(``/run/step-000000000001/COMMIT``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

__all__ = ["DEFAULT", "OPS", "PROTOCOL", "Faults", "FaultyMemoryFileSystem", "Rule"]

PROTOCOL = "faultymem"
OPS = frozenset({"list", "read", "write", "delete"})

ExcFactory = Callable[[str], BaseException]


@dataclass
class Rule:
    """One injected behaviour; see `Faults.fail`, `Faults.slow`, `Faults.cut`."""

    kind: str  # "fail" | "slow" | "cut"
    ops: frozenset[str]
    path: str | None = None  # only paths containing this substring
    exc: ExcFactory | None = None
    times: int | None = None  # calls left to affect; None: unlimited
    until: float | None = None  # monotonic deadline; None: until removed
    delay_s: float = 0.0
    cut_after: int = 0
    hits: int = field(default=0)

    def matches(self, op: str, path: str, now: float) -> bool:
        if op not in self.ops or (self.path is not None and self.path not in path):
            return False
        if self.until is not None and now >= self.until:
            return False
        return self.times is None or self.times > 0

    def consume(self) -> None:
        self.hits += 1
        if self.times is not None:
            self.times -= 1


class Faults:
    """The knob one test turns; thread-safe (the uploader and the test thread both call)."""

    _registry: dict[str, Faults] = {}  # noqa: RUF012 - process-wide on purpose
    _registry_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._generation = 0  # bumped by heal(): sleeping calls stop waiting
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str]] = []

    @classmethod
    def named(cls, name: str) -> Faults:
        """The registry's knob called `name` (created on first use)."""
        with cls._registry_lock:
            return cls._registry.setdefault(name, cls())

    # -- turning the knob --------------------------------------------------------------

    def _add(self, rule: Rule, seconds: float | None) -> Rule:
        if not rule.ops <= OPS:
            raise ValueError(f"unknown ops {set(rule.ops - OPS)}; use {sorted(OPS)}")
        if seconds is not None:
            rule.until = time.monotonic() + seconds
        with self._lock:
            self.rules.append(rule)
        return rule

    def fail(
        self,
        exc: type[BaseException] | ExcFactory = ConnectionRefusedError,
        *,
        times: int | None = None,
        seconds: float | None = None,
        ops: Collection[str] = OPS,
        path: str | None = None,
    ) -> Rule:
        """Matching calls raise `exc` (a class or a message -> exception factory): the next
        `times` calls, or calls in the next `seconds`, or all until `heal()`/`remove()`."""
        return self._add(Rule("fail", frozenset(ops), path, exc=exc, times=times), seconds)

    def slow(
        self,
        delay_s: float,
        *,
        times: int | None = None,
        seconds: float | None = None,
        ops: Collection[str] = OPS,
        path: str | None = None,
    ) -> Rule:
        """Matching calls wait `delay_s` before running (cut short by `heal()`)."""
        return self._add(Rule("slow", frozenset(ops), path, times=times, delay_s=delay_s), seconds)

    def cut(
        self,
        after_bytes: int,
        *,
        path: str | None = None,
        exc: type[BaseException] | ExcFactory = ConnectionResetError,
        times: int | None = 1,
    ) -> Rule:
        """The next `times` matching writes store only their first `after_bytes` bytes (the
        partial object stays visible, as on a non-atomic store) and then raise `exc`."""
        return self._add(Rule("cut", frozenset({"write"}), path, exc=exc, times=times, cut_after=after_bytes), None)

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self.rules:
                self.rules.remove(rule)
            self._generation += 1
            self._wake.notify_all()

    def heal(self) -> None:
        """Remove every rule and wake calls that are sleeping in a `slow` rule."""
        with self._lock:
            self.rules.clear()
            self._generation += 1
            self._wake.notify_all()

    # -- reading the log ---------------------------------------------------------------

    def events(self, kind: str | None = None, under: str = "") -> list[tuple[str, str]]:
        with self._lock:
            return [(k, p) for k, p in self.log if (kind is None or k == kind) and under in p]

    def written(self, under: str = "") -> list[str]:
        """Paths whose writes completed, in completion order."""
        return [p for _, p in self.events("written", under)]

    def injected(self) -> int:
        with self._lock:
            return sum(1 for k, _ in self.log if k.startswith("injected:"))

    # -- called by the filesystem -------------------------------------------------------

    def record(self, kind: str, path: str) -> None:
        with self._lock:
            self.log.append((kind, path))

    def enter(self, op: str, path: str) -> Rule | None:
        """Apply the rules to a call starting now: sleep, raise, or return a cut rule."""
        cut: Rule | None = None
        with self._lock:
            self.log.append((op, path))
            now = time.monotonic()
            delay = 0.0
            failure: Rule | None = None
            for rule in self.rules:
                if not rule.matches(op, path, now):
                    continue
                if rule.kind == "slow":
                    rule.consume()
                    delay = max(delay, rule.delay_s)
                elif rule.kind == "fail" and failure is None:
                    failure = rule
                elif rule.kind == "cut" and cut is None:
                    cut = rule
            if delay:
                self.log.append(("injected:slow", path))
                generation = self._generation
                deadline = now + delay
                while self._generation == generation and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(left)
        if failure is not None:
            # the rule may have expired while this call slept
            with self._lock:
                if not failure.matches(op, path, time.monotonic()) or failure not in self.rules:
                    failure = None
                else:
                    failure.consume()
                    self.log.append(("injected:fail", path))
        if failure is not None:
            assert failure.exc is not None
            raise make_exc(failure.exc, f"injected {op} failure on {path}")
        if cut is not None:
            with self._lock:
                if cut not in self.rules or not cut.matches(op, path, time.monotonic()):
                    return None
                cut.consume()
        return cut


def make_exc(exc: type[BaseException] | ExcFactory, message: str) -> BaseException:
    return exc(message)


DEFAULT = Faults()
_depth = threading.local()


class _FaultyFile(MemoryFile):  # type: ignore[misc]
    """A file being written: counts bytes for a cut, records completion on close."""

    def __init__(self, fs: FaultyMemoryFileSystem, path: str, cut: Rule | None) -> None:
        super().__init__(fs, path, None)
        self._faults = fs.faults
        self._cut = cut
        self._nbytes = 0
        self._recorded = False

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        cut = self._cut
        if cut is not None and self._nbytes + n > cut.cut_after:
            keep = cut.cut_after - self._nbytes
            super().write(memoryview(data).cast("B")[:keep])
            self._nbytes += keep
            self._recorded = True
            self._faults.record("injected:cut", self.path)
            assert cut.exc is not None
            raise make_exc(cut.exc, f"injected cut after {cut.cut_after} bytes of {self.path}")
        self._nbytes += n
        return int(super().write(data))

    def close(self) -> None:
        if not self._recorded:
            self._recorded = True
            self._faults.record("written", self.path)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self._recorded = True  # an exception inside `with`: the object is incomplete
        self.close()


class FaultyMemoryFileSystem(MemoryFileSystem):  # type: ignore[misc]
    """``memory://`` with its own store and a `Faults` knob (``faults=`` storage option)."""

    protocol = PROTOCOL
    store: dict[str, Any] = {}  # noqa: RUF012 - one store per class, like MemoryFileSystem
    pseudo_dirs: list[str] = [""]  # noqa: RUF012

    def __init__(self, *args: Any, faults: Faults | str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = Faults.named(faults) if isinstance(faults, str) else faults or DEFAULT

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, str):
            path = path.removeprefix(PROTOCOL + "://")
        return super()._strip_protocol(path)

    @contextlib.contextmanager
    def _call(self, op: str, path: Any) -> Iterator[Rule | None]:
        """Apply the faults once per outermost call (fsspec methods call each other)."""
        depth = getattr(_depth, "n", 0)
        cut = self.faults.enter(op, self._strip_protocol(str(path))) if depth == 0 else None
        _depth.n = depth + 1
        try:
            yield cut
        finally:
            _depth.n = depth

    def find(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        with self._call("list", path):
            return super().find(path, *args, **kwargs)

    def ls(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        with self._call("list", path):
            return super().ls(path, *args, **kwargs)

    def info(self, path: Any, **kwargs: Any) -> Any:
        with self._call("read", path):
            return super().info(path, **kwargs)

    def cat_file(self, path: Any, start: int | None = None, end: int | None = None, **kwargs: Any) -> Any:
        with self._call("read", path):
            return super().cat_file(path, start=start, end=end, **kwargs)

    def pipe_file(self, path: Any, value: Any, mode: str = "overwrite", **kwargs: Any) -> None:
        stripped = self._strip_protocol(path)
        with self._call("write", path) as cut:
            if cut is not None:
                data = bytes(value)
                partial = MemoryFile(self, stripped, data[: cut.cut_after])
                partial.commit()
                self.faults.record("injected:cut", stripped)
                assert cut.exc is not None
                raise make_exc(cut.exc, f"injected cut after {cut.cut_after} bytes of {stripped}")
            super().pipe_file(path, value, mode, **kwargs)
        self.faults.record("written", stripped)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        if mode not in ("wb", "xb", "w+b", "x+b"):
            with self._call("read", path):
                return super()._open(path, mode, **kwargs)
        if getattr(_depth, "n", 0):  # inside pipe_file: it handles faults and the log
            return super()._open(path, mode, **kwargs)
        with self._call("write", path) as cut:
            stripped = self._strip_protocol(path)
            if "x" in mode and self.exists(stripped):
                raise FileExistsError(stripped)
            if stripped in self.pseudo_dirs:
                raise IsADirectoryError(stripped)
            f = _FaultyFile(self, stripped, cut)
            f.commit()  # like MemoryFileSystem: visible (and growing) from the start
            return f

    def rm_file(self, path: Any) -> None:
        with self._call("delete", path):
            super().rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        with self._call("delete", path):
            super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def clear_under(self, root: str) -> None:
        """Drop every object and directory under `root` (test teardown), without faults."""
        prefix = self._strip_protocol(root).rstrip("/") + "/"
        for p in [p for p in self.store if p.startswith(prefix)]:
            del self.store[p]
        self.pseudo_dirs[:] = [p for p in self.pseudo_dirs if not p.startswith(prefix)]


fsspec.register_implementation(PROTOCOL, FaultyMemoryFileSystem, clobber=True)
