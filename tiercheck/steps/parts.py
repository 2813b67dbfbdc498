"""Planning this rank's part of a save, once per structure: which keys it writes
(`placement`, for replicated keys), its leaves and JSON tree (`state.structure`), where
each leaf goes in the shard (`plan.shards`) and whether its host buffer must be pinned.

A save of an unchanged structure reuses all of it: the structure cache hands back the same
leaves tuple, and the plan is keyed by that identity; the placement is kept per set of
replicated keys. This is the only place the facade's save path visits the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..job.coordination import Membership
from ..plan.placement import JobLayout, Placed, Placement, key_sizes, place, replicated_keys, split_state
from ..plan.retarget import Key
from ..plan.settings import JobOptions
from ..plan.shards import ShardPlan, plan_shard
from ..state.flatten import FlatState
from ..state.structure import StructureCache
from .stage import needs_pinned

__all__ = ["Part", "PartPlanner"]


@dataclass(frozen=True, slots=True)
class Part:
    """This rank's part of one save, planned: its flattened leaves (replicated keys another
    rank writes are references), the shard plan, whether a source is on CUDA (the buffer is
    then pinned), the replicated keys and who uploads each to tier 2 when that differs."""

    flat: FlatState
    plan: ShardPlan
    pinned: bool
    replicated: tuple[Key, ...]
    remote_owners: tuple[tuple[Key, int], ...]


class PartPlanner:
    """Turns a state into this rank's `Part`, reusing the work of the previous save while
    the state's structure is unchanged. Called from the caller's thread only.

    Args:
        job: the job's options (rank, world size, replicated keys, who writes them).
        group: this process's place in the job (node-local tier 1, the ranks per directory).
        has_remote: whether there is a tier 2 (replicated keys then get one uploader each).
    """

    def __init__(self, job: JobOptions, group: Membership, has_remote: bool) -> None:
        self._job = job
        self._layout = JobLayout(
            job.world_size,
            node_local=group.node_local,
            members=group.members,
            first_members=group.first_members,
            has_remote=has_remote,
        )
        self.structure = StructureCache()
        self._placement: tuple[tuple[object, ...], Placement] | None = None  # per key set
        self._plans: dict[object, ShardPlan] = {}  # one: the last structure's
        self._last: tuple[object, ShardPlan, bool] | None = None  # (leaves, plan, pinned)

    def part(self, state: Mapping[Any, Any], params: bool = True) -> Part:
        """Flatten, place and plan `state` (`params`: as `StructureCache.flatten`'s).

        Raises:
            UnsupportedStateError: a value that cannot be stored (names its key path).
        """
        placed = self._placed(state, params)
        plan, pinned = self._plan_for(placed.flat)
        return Part(placed.flat, plan, pinned, placed.replicated, placed.remote_owners)

    def _placed(self, state: Mapping[Any, Any], params: bool) -> Placed:
        replicated = self._job.replicated
        if not replicated or not isinstance(state, Mapping):
            return Placed(self.structure.flatten(state, params), (), ())
        keys = replicated_keys(state, replicated)
        cached = self._placement
        if cached is None or cached[0] != tuple(keys):
            placement = place(keys, lambda: key_sizes(state, keys), self._layout, self._job.replicated_writer)
            cached = self._placement = (tuple(keys), placement)
        return split_state(state, self._job.rank, keys, cached[1], partial(self.structure.flatten, params=params))

    def _plan_for(self, flat: FlatState) -> tuple[ShardPlan, bool]:
        last = self._last
        if last is not None and last[0] is flat.leaves:  # the structure cache's leaves: unchanged
            return last[1], last[2]
        sig = flat.signature
        plan = self._plans.get(sig)
        if plan is None:
            self._plans.clear()  # the structure changed: keep one plan, not a growing cache
            plan = self._plans[sig] = plan_shard(flat.leaves)
        self._last = (flat.leaves, plan, needs_pinned(flat.sources))
        return plan, self._last[2]
