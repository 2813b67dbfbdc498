"""Agreement between the ranks of a torch.distributed job, through its key-value store.

Nothing here runs a collective on the training process group: every exchange is a few
small operations on a *clone* of the job's store (its own connection), polled with
bounded deadlines, so a slow or dead rank makes the others fail after the timeout
instead of hanging them. The protocol, per step and tier (keys under
``tiercheck/<instance>/g<generation>/s<step>/<tier>/``):

1. every rank makes its part durable (shard files and manifest, no marker), then
   ``set part/<rank>`` (its manifest's name, length and checksum, or the error that
   stopped it) and ``add n 1``; a rank that fails before that reports the failure at
   once, so nobody waits for it;
2. rank 0 polls ``n`` until every rank reported (or the timeout), then ``set marker``
   (the commit marker listing every rank's manifest) and ``set verdict`` (``ok``, or the
   reason the step fails: a failed or silent rank, ranks disagreeing on the replicated
   keys); each rank then deletes its own report;
3. one *leader* per distinct directory fetches the marker and writes it (rank 0 on a
   shared tier; on a node-local tier, one rank per directory) and ``set marked/<leader>``;
   the other ranks wait for their leader's key, so every handle reports the step durable
   only once the marker covering its part exists;
4. each rank ``add ack 1``; the rank that completes the count deletes the step's shared
   keys, so the store does not grow from step to step.

Waits poll with backoff (2 ms up to 50 ms per 1000 ranks, at most 1 s), each bounded by
the timeout: rank 0 waits that long for the reports, the others twice that for the verdict.

Save requests (keys under ``save/<round>/``; `SaveRequests`): a save that one rank decides on
its own (a SIGTERM it received; rank 0's clock for ``Every(seconds=...)``) must happen on every
rank at the same step, without a barrier at every step. Every rank calls
``Checkpointer.should_save`` with the same steps:

1. a rank with a request ``append``s to ``want``; every rank checks ``want`` (one store call)
   at each `should_save`;
2. the first time a rank sees it, it sets ``at/<rank>`` to its current step (and its own
   reasons) and ``add``s 1 to ``n``; it returns False for that step;
3. at its next call, a rank waits (bounded by the timeout) until ``n`` counts every rank,
   then reads every ``at/<rank>``: the save step is the first call with a step above their
   maximum, the same on every rank. A rank never waits at the step it registered at, so a
   rank behind it (in a collective of the training loop, say) always reaches its own
   registration: the wait cannot deadlock a job whose ranks call `should_save` in step;
4. after the save step each rank ``add``s 1 to ``done``; the last one deletes the round's keys.

Restore agreement (keys under ``g<generation>/restore/``, deleted once every rank is done):
each rank publishes the steps its own tier 1 holds; rank 0 adds what the shared tier 2
holds and publishes the candidates, newest first, that every rank can read (tier 2, or
tier 1 on every rank's node); then all ranks try candidates in order, each counting its
outcome in ``r<i>/n`` and failures in ``r<i>/bad`` (the first three failing ranks append
their reason to ``r<i>/why``), until one verifies on every rank.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import CoordinationError

__all__ = ["CoordinationError", "Coordinator", "SaveRequests", "from_process_group", "instance_prefix"]


_instances = 0
_instances_lock = threading.Lock()


def instance_prefix() -> str:
    """A store prefix for the next multi-rank Checkpointer of this process. Every rank
    creates its Checkpointers in the same order, so the n-th one has the same prefix on
    every rank."""
    global _instances
    with _instances_lock:
        n = _instances
        _instances += 1
    return f"tiercheck/{n}/"


def from_process_group() -> tuple[int, int, Any] | None:
    """(rank, world size, store) of the initialised default process group, or None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    return dist.get_rank(), dist.get_world_size(), store


@dataclass(frozen=True, slots=True)
class PartReport:
    """What one rank reports about its part of a step on one tier."""

    rank: int
    manifest: dict[str, Any] | None  # {"name", "length", "checksum"} when the part is durable
    error: str | None = None
    assignment: str = ""  # digest of who writes which replicated key: must agree everywhere


class Coordinator:
    """One rank's end of the protocol above.

    Args:
        store: a ``torch.distributed.Store`` reachable by every rank. It is cloned, so
            polling here never shares a connection with the training loop.
        rank, world_size: this rank and the job's size.
        prefix: the namespace of one Checkpointer (`instance_prefix()`).
        timeout: seconds to wait for the other ranks at any one point.
    """

    POLL_MIN = 0.002
    REASONS_KEPT = 3  # failing ranks whose reason a restore round records
    POLL_MAX = 0.05  # per 1000 ranks: W ranks polling rank 0's store stay near 20k ops/s

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, timeout: float) -> None:
        import torch.distributed as dist

        try:
            base = store.clone()  # a connection of our own
        except Exception:  # stores without clone (HashStore, FileStore) are safe to share
            base = store
        # Only non-blocking calls are made (get/multi_get only after check() saw the keys),
        # so the store's own timeout never applies and is left as the job set it.
        self._store = dist.PrefixStore(prefix, base)  # type: ignore[attr-defined]
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._poll_max = min(1.0, self.POLL_MAX * max(1.0, world_size / 1000))
        self.generation = 0  # bumped by every collective restore, on every rank alike
        self._lock = threading.Lock()  # one operation at a time on our connection

    # -- primitives ------------------------------------------------------------------

    def _op(self, fn: Callable[[Any], Any]) -> Any:
        with self._lock:
            return fn(self._store)

    def _poll(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        delay = self.POLL_MIN
        while not ready():
            if time.monotonic() >= deadline:
                raise CoordinationError(f"rank {self.rank}: gave up after {self.timeout:.0f}s waiting for {what}")
            time.sleep(delay)
            delay = min(self._poll_max, delay * 2)

    def _has(self, key: str) -> bool:
        return bool(self._op(lambda s: s.check([key])))

    def _get(self, key: str) -> bytes:
        return bytes(self._op(lambda s: s.get(key)))

    def _count(self, key: str) -> int:
        return int(self._op(lambda s: s.add(key, 0)))

    def _delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._op(functools.partial(_delete_key, key=k))

    def _get_many(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(0, len(keys), 1024):
            out.extend(bytes(v) for v in self._op(functools.partial(_multi_get, keys=list(keys[i : i + 1024]))))
        return out

    # -- set-up ------------------------------------------------------------------------

    def elect(self, what: str, identity: str) -> int:
        """The leader among the ranks that name the same `identity` (one directory): the
        first to ask. Every rank of that group gets the same answer."""
        key = f"leader/{what}/{identity}"
        return int(self._op(lambda s: s.compare_set(key, "", str(self.rank))))

    # -- committing a step -------------------------------------------------------------

    def _base(self, step: int, tier: str) -> str:
        return f"g{self.generation}/s{step}/{tier}/"

    def report(self, step: int, tier: str, part: PartReport) -> None:
        """Tell the others how this rank's part of `step` went (once per step and tier)."""
        base = self._base(step, tier)
        doc = {"manifest": part.manifest, "error": part.error, "assignment": part.assignment}
        self._op(lambda s: s.set(f"{base}part/{self.rank}", json.dumps(doc)))
        self._op(lambda s: s.add(f"{base}n", 1))

    def decide(self, step: int, tier: str, build_marker: Callable[[list[dict[str, Any]]], bytes]) -> bytes:
        """Rank 0: wait for every rank's report, then publish the marker (for the leaders)
        and the verdict (for everyone); return the marker or raise CoordinationError."""
        assert self.rank == 0
        base = self._base(step, tier)
        deadline = time.monotonic() + self.timeout
        try:
            what = f"every rank's part of step {step}"
            self._poll(lambda: self._count(f"{base}n") >= self.world_size, deadline, what)
        except CoordinationError:
            missing = [r for r in range(self.world_size) if not self._has(f"{base}part/{r}")]
            who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {_ranges(missing)}"
            return self._fail(base, f"{who} did not report their part within {self.timeout:.0f}s")
        docs = [json.loads(v) for v in self._get_many([f"{base}part/{r}" for r in range(self.world_size)])]
        failed = [(r, d["error"]) for r, d in enumerate(docs) if d["manifest"] is None]
        if failed:
            r, why = failed[0]
            more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
            return self._fail(base, f"rank {r} failed its part: {why}{more}")
        if len({d["assignment"] for d in docs}) != 1:
            return self._fail(base, "ranks disagree on who writes the replicated keys (their states differ)")
        try:
            marker = build_marker([d["manifest"] for d in docs])
        except Exception as exc:
            return self._fail(base, f"cannot build the commit marker: {exc!r}")
        # The marker (~100 bytes per rank) goes to a key of its own: only the leaders read it;
        # every other rank reads the two-byte verdict.
        self._op(lambda s: s.set(f"{base}marker", marker))
        self._op(lambda s: s.set(f"{base}verdict", b"ok"))
        return marker

    def _fail(self, base: str, reason: str) -> bytes:
        self._op(lambda s: s.set(f"{base}verdict", b"fail\n" + reason.encode()))
        raise CoordinationError(reason, settled=True)

    def abandon(self, step: int, tier: str, reason: str) -> None:
        """This rank's part failed: report it and, on rank 0, fail the step at once, so no
        rank waits for the timeout."""
        self.report(step, tier, PartReport(self.rank, None, reason))
        if self.rank == 0:
            base = self._base(step, tier)
            self._op(lambda s: s.set(f"{base}verdict", b"fail\n" + f"rank 0 failed its part: {reason}".encode()))
        self.acknowledge(step, tier)

    def verdict(self, step: int, tier: str, want_marker: bool) -> bytes:
        """Wait for rank 0's verdict; return the marker bytes if `want_marker` (a leader).

        Raises:
            CoordinationError: the step failed (`settled`: rank 0 said so, remove your part),
                or no verdict came within twice the timeout (not settled: rank 0 may still
                commit the step, so a part already in place must stay).
        """
        base = self._base(step, tier)
        deadline = time.monotonic() + 2 * self.timeout  # rank 0 itself waits up to `timeout`
        self._poll(lambda: self._has(f"{base}verdict"), deadline, f"rank 0's verdict on step {step}")
        kind, _, why = self._get(f"{base}verdict").partition(b"\n")
        if kind != b"ok":
            raise CoordinationError(why.decode(errors="replace"), settled=True)
        return self._get(f"{base}marker") if want_marker else b""

    def marked(self, step: int, tier: str, error: str | None = None) -> None:
        """Leader: the marker is written in this rank's directory (or could not be)."""
        base = self._base(step, tier)
        value = b"ok" if error is None else b"fail\n" + error.encode()
        self._op(lambda s: s.set(f"{base}marked/{self.rank}", value))

    def wait_marked(self, step: int, tier: str, leader: int) -> None:
        """Wait until `leader` wrote the marker into the directory this rank shares with it."""
        base = self._base(step, tier)
        deadline = time.monotonic() + self.timeout
        self._poll(lambda: self._has(f"{base}marked/{leader}"), deadline, f"rank {leader} to write the marker")
        kind, _, why = self._get(f"{base}marked/{leader}").partition(b"\n")
        if kind != b"ok":
            raise CoordinationError(f"rank {leader} could not write the commit marker: {why.decode(errors='replace')}")

    def acknowledge(self, step: int, tier: str, leaders: Sequence[int] = ()) -> None:
        """Done with `step` on `tier`; the last rank to say so deletes the step's keys: the few
        shared ones, plus every rank's report only if the step failed (a committed step's
        reports were deleted by their ranks as soon as the verdict was out)."""
        base = self._base(step, tier)
        if self._op(lambda s: s.add(f"{base}ack", 1)) < self.world_size:
            return
        keys = [f"{base}marked/{r}" for r in leaders] + [f"{base}{k}" for k in ("n", "marker", "verdict", "ack")]
        if not self._has(f"{base}verdict") or self._get(f"{base}verdict") != b"ok":
            keys += [f"{base}part/{r}" for r in range(self.world_size)]
        self._delete(keys)

    def forget_part(self, step: int, tier: str) -> None:
        """After an "ok" verdict: rank 0 has read this rank's report; delete it."""
        self._delete([f"{self._base(step, tier)}part/{self.rank}"])

    # -- restore agreement -------------------------------------------------------------

    def _plan_from_tier1(self, base: str, mine: Sequence[int], plan: Callable[[set[int]], Any], what: str) -> Any:
        """Each rank publishes the steps its tier 1 holds; rank 0 calls `plan` with the steps
        every rank holds and publishes its (JSON) answer, which every rank returns.

        Raises:
            CoordinationError: rank 0 could not make a plan (the reason is in the message).
        """
        self._op(lambda s: s.set(f"{base}have/{self.rank}", json.dumps(sorted(mine))))
        self._op(lambda s: s.add(f"{base}n", 1))
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            try:
                self._poll(lambda: self._count(f"{base}n") >= self.world_size, deadline, "every rank to list its steps")
                common: set[int] | None = None
                for v in self._get_many([f"{base}have/{r}" for r in range(self.world_size)]):
                    have = set(json.loads(v))
                    common = have if common is None else common & have
                doc = json.dumps({"plan": plan(common or set())})
            except Exception as exc:
                doc = json.dumps({"error": f"{type(exc).__name__}: {exc}"})
            self._op(lambda s: s.set(f"{base}plan", doc))
        self._poll(lambda: self._has(f"{base}plan"), deadline + self.timeout, f"rank 0's {what} plan")
        answer = json.loads(self._get(f"{base}plan"))
        self._delete([f"{base}have/{self.rank}"])  # rank 0 has read it: the plan is out
        if "error" in answer:
            raise CoordinationError(f"rank 0 could not plan the {what}: {answer['error']}")
        return answer["plan"]

    def agree_candidates(self, mine: Sequence[int], shared: Callable[[], list[int]], step: int | None) -> list[int]:
        """Steps every rank can restore, newest first (or [step] if every rank can).

        `mine` is what this rank's own tier 1 holds; `shared` lists the tier every rank
        reads (called on rank 0 only). Collective: every rank must call it.
        """
        self.generation += 1

        def plan(common: set[int]) -> list[int]:
            feasible = sorted(set(shared()) | common, reverse=True)
            return feasible if step is None else [step] if step in feasible else []

        return [int(s) for s in self._plan_from_tier1(f"g{self.generation}/restore/", mine, plan, "restore")]

    def agree_outcome(self, index: int, ok: bool, reason: str = "", fatal: bool = False) -> tuple[bool, str, bool]:
        """After trying candidate `index`: did every rank succeed? Returns (everyone ok, the
        first failures, whether some rank gave up on the restore altogether). Only the first
        few failing ranks record a reason, so what every rank reads stays small at any scale."""
        base = f"g{self.generation}/restore/r{index}/"
        if not ok:
            nth = int(self._op(lambda s: s.add(f"{base}bad", 1)))
            if fatal:
                self._op(lambda s: s.add(f"{base}fatal", 1))
            if nth <= self.REASONS_KEPT:
                line = json.dumps([self.rank, reason[:500]]) + "\n"
                self._op(functools.partial(_append, key=f"{base}why", value=line))
        self._op(lambda s: s.add(f"{base}n", 1))
        deadline = time.monotonic() + self.timeout
        self._poll(lambda: self._count(f"{base}n") >= self.world_size, deadline, "every rank to read the step")
        bad = self._count(f"{base}bad")
        if bad == 0:
            return True, "", False
        reports = sorted(json.loads(x) for x in self._get(f"{base}why").decode(errors="replace").splitlines() if x)
        first = "; ".join(f"rank {r}: {why}" for r, why in reports)
        if bad > len(reports):
            first += f" (and {bad - len(reports)} more ranks)"
        return False, first, self._count(f"{base}fatal") > 0

    def agree_catch_up(self, mine: Sequence[int], plan: Callable[[set[int]], list[int]]) -> list[int]:
        """When the job first writes: the tier-1 steps to upload because an earlier run
        committed them but never uploaded them. Rank 0 alone calls `plan` with the steps every
        rank's tier 1 holds (it lists tier 2 and applies tier-2 retention). Collective."""
        steps = self._plan_from_tier1("catchup/", mine, plan, "catch-up")
        return [int(s) for s in steps]

    def finish_restore(self, rounds: int) -> None:
        """Done with this restore after `rounds` outcome rounds; the last rank deletes its keys."""
        base = f"g{self.generation}/restore/"
        if self._op(lambda s: s.add(f"{base}ack", 1)) < self.world_size:
            return
        keys = [f"{base}{k}" for k in ("n", "plan", "ack")]
        keys += [f"{base}r{i}/{k}" for i in range(rounds) for k in ("n", "bad", "fatal", "why")]
        self._delete(keys)


class SaveRequests:
    """One rank's end of the save-request protocol above (a job of more than one rank).

    Args:
        coord: this rank's coordinator (its store connection, rank, size and timeout).
    """

    def __init__(self, coord: Coordinator) -> None:
        self._coord = coord
        self.round = 0
        self._pending: set[str] = set()  # this rank's own reasons, not yet registered
        self._registered: int | None = None  # the step this rank registered at, this round
        self._above: int | None = None  # every rank's registrations' maximum, once known
        self._reasons: frozenset[str] = frozenset()

    def request(self, reason: str) -> None:
        """Ask for a save on every rank (published at the next `poll`)."""
        self._pending.add(reason)

    @property
    def requested(self) -> bool:
        """A request of this rank is pending, or a round is in progress."""
        return bool(self._pending) or self._registered is not None

    def _base(self) -> str:
        return f"save/{self.round}/"

    def poll(self, step: int) -> frozenset[str] | None:
        """Called once per step, with the same steps on every rank. Returns the reasons
        (``{"preempt"}``, ``{"interval"}``) when every rank saves at `step`, else None.

        Raises:
            CoordinationError: another rank did not register within the timeout.
        """
        coord, base = self._coord, self._base()
        if self._registered is None:
            if self._pending:
                wanted = ",".join(sorted(self._pending))
                coord._op(functools.partial(_append, key=f"{base}want", value=wanted + ";"))
            elif not coord._has(f"{base}want"):
                return None
            mine = sorted(self._pending)
            self._pending.clear()
            coord._op(lambda s: s.set(f"{base}at/{coord.rank}", json.dumps([step, mine])))
            self._registered = step
            if int(coord._op(lambda s: s.add(f"{base}n", 1))) >= coord.world_size:
                self._learn(base)
            return None
        if self._above is None:
            deadline = time.monotonic() + coord.timeout
            what = f"every rank to see the save request of round {self.round}"
            coord._poll(lambda: coord._count(f"{base}n") >= coord.world_size, deadline, what)
            self._learn(base)
        assert self._above is not None
        if step <= self._above:
            return None
        reasons = self._reasons
        if int(coord._op(lambda s: s.add(f"{base}done", 1))) >= coord.world_size:
            keys = [f"{base}at/{r}" for r in range(coord.world_size)]
            coord._delete([*keys, f"{base}want", f"{base}n", f"{base}done"])
        self.round += 1
        self._registered = self._above = None
        self._reasons = frozenset()
        return reasons

    def _learn(self, base: str) -> None:
        coord = self._coord
        docs = [json.loads(v) for v in coord._get_many([f"{base}at/{r}" for r in range(coord.world_size)])]
        self._above = max(int(d[0]) for d in docs)
        self._reasons = frozenset(r for d in docs for r in d[1])


def _delete_key(store: Any, key: str) -> None:
    store.delete_key(key)


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    return list(store.multi_get(keys))


def _append(store: Any, key: str, value: str) -> None:
    store.append(key, value)


def node_identity(path: str) -> str:
    """Which directory `path` is, across the job: host name plus device and inode, so ranks
    sharing a node-local directory (or one path on a shared filesystem) find each other."""
    os.makedirs(path, exist_ok=True)
    st = os.stat(path)
    return f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"


def _ranges(ranks: Sequence[int]) -> str:
    """``0-3,7``: a compact list of ranks for messages."""
    out: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out) or "none"


@dataclass(frozen=True, slots=True)
class Group:
    """This rank's place in the job, as the pipeline needs it."""

    coord: Coordinator
    leader: dict[str, int]  # per tier: the rank that writes markers and prunes in my directory
    leaders: dict[str, tuple[int, ...]]  # per tier: every leader (one per distinct directory)
    members: tuple[int, ...] = ()  # the ranks sharing my tier-1 directory (me included)
    first_members: tuple[int, ...] = ()  # the ranks sharing rank 0's tier-1 directory

    @property
    def rank(self) -> int:
        return self.coord.rank

    def leads(self, tier: str) -> bool:
        return self.leader[tier] == self.coord.rank

    @property
    def node_local(self) -> bool:
        """Tier 1 is not one shared directory: each node (or rank) has its own. Replicated
        keys are then written once per directory, so every node can restore from its own
        tier 1, and uploaded once, from rank 0's directory."""
        return len(self.leaders.get("local", ())) > 1


def _rank_list(data: bytes) -> tuple[int, ...]:
    return tuple(sorted(int(r) for r in data.decode().split(",") if r))


def join_group(store: Any, rank: int, world_size: int, timeout: float, local: Any, remote: Any) -> Group:
    """Set up this rank's side of the protocol (collective: every rank calls it once per
    Checkpointer, in the same order): elect one leader per tier-1 directory, learn every
    leader and the ranks sharing this rank's directory, and wait until all ranks are there."""
    coord = Coordinator(store, rank, world_size, instance_prefix(), timeout)
    leader: dict[str, int] = {}
    identity = ""
    if local is not None:
        identity = node_identity(local.root)
        leader[local.name] = coord.elect(local.name, identity)
        coord._op(functools.partial(_append, key=f"members/{identity}", value=f"{rank},"))
    if remote is not None:
        leader[remote.name] = 0  # shared by every rank: rank 0 commits and prunes it
    for tier, who in leader.items():
        if who == rank:
            coord._op(functools.partial(_append, key=f"leaders/{tier}", value=f"{rank},"))
    coord._op(lambda s: s.add("joined", 1))
    deadline = time.monotonic() + timeout
    coord._poll(lambda: coord._count("joined") >= world_size, deadline, "every rank to create its Checkpointer")
    leaders = {tier: _rank_list(coord._get(f"leaders/{tier}")) for tier in leader}
    members: tuple[int, ...] = ()
    first: tuple[int, ...] = ()
    if local is not None:
        members = _rank_list(coord._get(f"members/{identity}"))
        if rank == 0:
            coord._op(lambda s: s.set("first_members", ",".join(map(str, members))))
        coord._poll(lambda: coord._has("first_members"), deadline, "rank 0's directory")
        first = _rank_list(coord._get("first_members"))
    return Group(coord, leader, leaders, members, first)
