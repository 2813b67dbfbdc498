"""A fault-injecting tier: wraps any tier and makes chosen operations fail, stall or block.

Tests pass it in where a tier goes, so the library runs its real code against a real tier
with faults at the tier's interface (as torchsnapshot's faulty storage plugin does)::

    faults = Faults()
    ckpt = tiercheck.Checkpointer(local=FaultyTier(LocalTier(path), faults))
    faults.fail("write_file", OSError(errno.ENOSPC, "disk full"), steps={2})  # step 2's writes
    faults.fail("write_file", ConnectionResetError(), after_bytes=1000, times=1)  # cut midway
    faults.delay("delete_step", 0.5)                    # every deletion takes 0.5 s longer
    faults.block("write_file", gate)                     # writes wait until gate.set()
    faults.heal()                                        # clear every rule

Operations, as rules name them: the tier's ``committed_steps``, ``stray_steps``,
``check_space``, ``open_step``, ``write_marker``, ``read_bytes``, ``open_file``,
``delete_step``, ``remove_leftovers``, ``claim_writer``; its writers' ``write_file``
(every file written through a writer: shards and manifest, whichever of ``write_file``,
``write_chunks`` or ``write_from_path`` the pipeline uses), ``commit`` and ``publish_part``.
``abort`` never fails: the contract says it never raises. Rules are checked at the start of
each call: every matching delay and block applies, in the order added, then the first
matching failure.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from ..tiers.base import Capabilities, ReadableFile, StepWriter, Tier

OPERATIONS = frozenset(
    {
        "committed_steps",
        "stray_steps",
        "check_space",
        "open_step",
        "write_marker",
        "read_bytes",
        "open_file",
        "delete_step",
        "reclaim",
        "remove_leftovers",
        "claim_writer",
        "write_file",
        "commit",
        "publish_part",
    }
)


@dataclass(frozen=True, slots=True)
class Call:
    """One operation a rule is asked about."""

    op: str
    step: int | None = None
    name: str | None = None  # the file, for write_file/read_bytes/open_file
    path: str | None = None  # the inner tier's path_of(step, name), for messages


ErrorFactory = BaseException | Callable[[Call], BaseException]


@dataclass(slots=True)
class _Rule:
    ops: frozenset[str]
    steps: frozenset[int] | None
    when: Callable[[Call], bool] | None
    times: int | None  # None: every matching call
    error: ErrorFactory | None = None
    after_bytes: int | None = None
    seconds: float = 0.0
    gate: threading.Event | None = None
    gate_timeout: float | None = None

    def matches(self, call: Call) -> bool:
        return (
            call.op in self.ops
            and (self.steps is None or call.step in self.steps)
            and (self.when is None or self.when(call))
            and (self.times is None or self.times > 0)
        )


class Faults:
    """The rules of one or more `FaultyTier` objects; thread-safe, changeable at any time.

    Each method adds a rule for the operations `ops` (one name or several), limited to
    `steps` and to calls for which `when(call)` is true, acting on the first `times` such
    calls (None: all of them). `log` records every call made, as ``(op, step, name)``.
    """

    def __init__(self) -> None:
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self.log: list[tuple[str, int | None, str | None]] = []

    def fail(
        self,
        ops: str | Collection[str],
        error: ErrorFactory,
        *,
        steps: Collection[int] | None = None,
        when: Callable[[Call], bool] | None = None,
        times: int | None = None,
        after_bytes: int | None = None,
    ) -> None:
        """Raise `error` (an exception, or ``error(call)`` building one) instead of the call;
        with `after_bytes`, a file write first stores that many bytes of the file, then
        raises (a connection cut midway)."""
        self._add(_Rule(_ops(ops), _steps(steps), when, times, error=error, after_bytes=after_bytes))

    def delay(
        self,
        ops: str | Collection[str],
        seconds: float,
        *,
        steps: Collection[int] | None = None,
        when: Callable[[Call], bool] | None = None,
        times: int | None = None,
    ) -> None:
        """Sleep `seconds` before the call, then make it."""
        self._add(_Rule(_ops(ops), _steps(steps), when, times, seconds=seconds))

    def block(
        self,
        ops: str | Collection[str],
        gate: threading.Event,
        *,
        timeout: float | None = None,
        steps: Collection[int] | None = None,
        when: Callable[[Call], bool] | None = None,
        times: int | None = None,
    ) -> None:
        """Wait until `gate` is set before the call; past `timeout` s, raise TimeoutError."""
        self._add(_Rule(_ops(ops), _steps(steps), when, times, gate=gate, gate_timeout=timeout))

    def heal(self) -> None:
        """Remove every rule (blocked calls stay blocked until their gate is set)."""
        with self._lock:
            self._rules.clear()

    def _add(self, rule: _Rule) -> None:
        with self._lock:
            self._rules.append(rule)

    def check(self, call: Call) -> _Rule | None:
        """Apply the rules matching `call`: sleep and wait, then raise. Returns a rule whose
        error comes after `after_bytes` bytes (the caller writes them, then raises)."""
        with self._lock:
            self.log.append((call.op, call.step, call.name))
            waits = [r for r in self._rules if r.error is None and r.matches(call)]
            failure = next((r for r in self._rules if r.error is not None and r.matches(call)), None)
            for r in [*waits, failure]:
                if r is not None and r.times is not None:
                    r.times -= 1
        for rule in waits:
            if rule.seconds:
                time.sleep(rule.seconds)
            if rule.gate is not None and not rule.gate.wait(rule.gate_timeout):
                raise TimeoutError(f"injected: {call.op} of step {call.step} blocked past {rule.gate_timeout}s")
        if failure is None:
            return None
        if failure.after_bytes is not None and call.op == "write_file":
            return failure
        raise error_for(failure, call)


def error_for(rule: _Rule, call: Call) -> BaseException:
    assert rule.error is not None
    return rule.error if isinstance(rule.error, BaseException) else rule.error(call)


def _ops(ops: str | Collection[str]) -> frozenset[str]:
    names = frozenset({ops} if isinstance(ops, str) else ops)
    unknown = names - OPERATIONS
    if unknown:
        raise ValueError(f"unknown operations {sorted(unknown)}; choose from {sorted(OPERATIONS)}")
    return names


def _steps(steps: Collection[int] | None) -> frozenset[int] | None:
    return None if steps is None else frozenset(steps)


class FaultyTier(Tier):
    """`inner` with the faults of `faults` (a fresh `Faults` if none is given).

    Name, location, codec and capabilities are the inner tier's, and any other attribute
    is read from it (``FaultyTier(LocalTier(d)).root``), so it goes wherever `inner` goes.
    One capability is left out: `prefetch`, a hint whose own `open_file` (a restore's, on a
    helper thread, `steps.catalog.ShardPrefetch`) would count among the calls a fault
    waits for, at a moment no test chooses.
    """

    def __init__(self, inner: Tier, faults: Faults | None = None) -> None:
        self.inner = inner
        self.faults = faults if faults is not None else Faults()
        self.name = inner.name
        self.location = inner.location
        self.codec = inner.codec
        self.capabilities: Capabilities = dataclasses.replace(inner.capabilities, prefetch=False)

    def __getattr__(self, attr: str) -> Any:
        if attr == "inner":  # not set yet: no recursion while unpickling or in __init__
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def _check(self, op: str, step: int | None = None, name: str | None = None) -> None:
        path = None if step is None else self.inner.path_of(step, name)
        self.faults.check(Call(op, step, name, path))

    def committed_steps(self) -> list[int]:
        self._check("committed_steps")
        return self.inner.committed_steps()

    def stray_steps(self) -> list[int]:
        self._check("stray_steps")
        return self.inner.stray_steps()

    def check_space(self, step: int, nbytes: int) -> None:
        self._check("check_space", step)
        self.inner.check_space(step, nbytes)

    def open_step(self, step: int, rank: int, shared: bool = False) -> StepWriter:
        self._check("open_step", step)
        return _FaultyStepWriter(self, step, self.inner.open_step(step, rank, shared))

    def write_marker(self, step: int, marker: bytes) -> None:
        self._check("write_marker", step)
        self.inner.write_marker(step, marker)

    def read_bytes(self, step: int, name: str, limit: int) -> bytes:
        self._check("read_bytes", step, name)
        return self.inner.read_bytes(step, name, limit)

    def open_file(self, step: int, name: str) -> ReadableFile:
        self._check("open_file", step, name)
        return self.inner.open_file(step, name)

    def delete_step(self, step: int) -> None:
        self._check("delete_step", step)
        self.inner.delete_step(step)

    def remove_leftovers(self) -> list[str]:
        self._check("remove_leftovers")
        return self.inner.remove_leftovers()

    def claim_writer(self, rank: int, world_size: int) -> list[str]:
        self._check("claim_writer")
        return self.inner.claim_writer(rank, world_size)

    def release_writer(self) -> None:
        self.inner.release_writer()

    def set_reclaimer(
        self, reclaimer: Callable[[str], None] | None, between: Callable[[], None] | None = None
    ) -> None:
        self.inner.set_reclaimer(reclaimer, between)

    def reclaim(self, token: str) -> None:
        self._check("reclaim")
        self.inner.reclaim(token)

    def local_dir(self) -> str:
        return self.inner.local_dir()

    def local_file(self, step: int, name: str) -> str:
        return self.inner.local_file(step, name)

    def path_of(self, step: int, name: str | None = None) -> str:
        return self.inner.path_of(step, name)


class _FaultyStepWriter(StepWriter):
    def __init__(self, tier: FaultyTier, step: int, inner: StepWriter) -> None:
        self._tier = tier
        self._step = step
        self._inner = inner

    def _cut(self, name: str) -> _Rule | None:
        call = Call("write_file", self._step, name, self._tier.inner.path_of(self._step, name))
        return self._tier.faults.check(call)

    def _raise_after(self, rule: _Rule, name: str, data: bytes | memoryview) -> None:
        assert rule.after_bytes is not None
        self._inner.write_file(name, memoryview(data)[: rule.after_bytes])
        raise error_for(rule, Call("write_file", self._step, name, self._tier.inner.path_of(self._step, name)))

    def write_file(
        self,
        name: str,
        data: memoryview,
        aligned: bool = False,
        compress: bool = False,
    ) -> int:
        rule = self._cut(name)
        if rule is not None:
            self._raise_after(rule, name, data)
        return self._inner.write_file(name, data, aligned, compress)

    def write_chunks(
        self, name: str, chunks: Callable[[], Iterator[bytes | memoryview]], nbytes: int, compress: bool = False
    ) -> int:
        rule = self._cut(name)
        if rule is not None:
            self._raise_after(rule, name, b"".join(chunks()))
        return self._inner.write_chunks(name, chunks, nbytes, compress)

    def write_from_path(self, name: str, local_path: str, compress: bool = False) -> int:
        rule = self._cut(name)
        if rule is not None:
            with open(local_path, "rb") as f:
                self._raise_after(rule, name, f.read())
        return self._inner.write_from_path(name, local_path, compress)

    def commit(self, marker: bytes) -> None:
        self._tier._check("commit", self._step)
        self._inner.commit(marker)

    def publish_part(self) -> None:
        self._tier._check("publish_part", self._step)
        self._inner.publish_part()

    def abort(self) -> None:
        self._inner.abort()
