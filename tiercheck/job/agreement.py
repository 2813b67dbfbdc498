"""What the ranks of a job agree on besides commits: which step to restore, which steps to
catch up, and when to save.

Restore agreement (keys under ``g<generation>/restore/``, deleted once every rank is done):
each rank publishes the steps its own tier 1 holds; rank 0 adds what the shared tier 2
holds and publishes the candidates, newest first, that every rank can read (tier 2, or
tier 1 on every rank's node); then all ranks try candidates in order, each counting its
outcome in ``r<i>/n`` and failures in ``r<i>/bad`` (the first three failing ranks append
their reason to ``r<i>/why``), until one verifies on every rank (`restore.restore_collective` runs it).
The catch-up upload at a job's first write is planned the same way (keys under
``catchup/``).

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
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CoordinationError
from .store import StoreClient

if TYPE_CHECKING:
    from .coordination import Coordinator

__all__ = ["RestoreAgreement", "SaveRequests"]


class RestoreAgreement(StoreClient):
    """One rank's end of the restore and catch-up agreements (a mixin of
    `coordination.Coordinator`)."""

    REASONS_KEPT = 3  # failing ranks whose reason a restore round records

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
                self._append_to(f"{base}why", line)
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
                coord._append_to(f"{base}want", wanted + ";")
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
