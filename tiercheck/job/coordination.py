"""The job: its ranks, who leads each directory, and the store they coordinate through.

A process alone is `Solo`; a multi-rank Checkpointer joins a `Group` (`join_group`,
collective): both are a `Membership`, so callers never test for a job. One leader per
tier-1 directory (it writes markers and prunes there), the ranks sharing this rank's
directory and rank 0's, all learnt through the job's key-value store (`store`). The
protocols on top have a module each: the commit vote (`commit`), and the restore,
catch-up and save-request agreements (`agreement`); `Coordinator` is one rank's end of
all of them.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CoordinationError
from ..format.manifest import ManifestRef, Marker, encode_marker
from ..observe.events import logger
from ..plan.settings import JobOptions
from ..tiers.base import StepWriter, Tier
from ..tiers.memory import node_identity as directory_identity
from .agreement import RestoreAgreement, SaveRequests
from .commit import CommitVote, PartReport, vote_commit
from .store import from_process_group, instance_prefix

__all__ = [
    "CoordinationError",
    "Coordinator",
    "Group",
    "Membership",
    "PartReport",
    "SaveRequests",
    "Solo",
    "from_process_group",
    "instance_prefix",
    "join_group",
    "join_job",
]


class Coordinator(CommitVote, RestoreAgreement):
    """One rank's end of every protocol between the ranks: the primitives (`StoreClient`),
    the commit vote (`CommitVote`) and the agreements (`RestoreAgreement`).

    Args:
        store: a ``torch.distributed.Store`` reachable by every rank. It is cloned, so
            polling here never shares a connection with the training loop.
        rank, world_size: this rank and the job's size.
        prefix: the namespace of one Checkpointer (`instance_prefix()`).
        timeout: seconds to wait for the other ranks at any one point.
    """


def node_identity(path: str) -> str:
    """Which directory `path` is, across the job (created if missing): host name plus device
    and inode (`tiers.memory.node_identity`), so ranks sharing a node-local directory (or one
    path on a shared filesystem) find each other."""
    os.makedirs(path, exist_ok=True)
    return directory_identity(path)



class Membership:
    """This process's place in the job, as the pipeline and the facade need it: a `Group` of
    ranks, or `Solo` for a process alone. Callers ask it rather than test for a job.

    `leads(tier)`: whether this process writes markers and prunes in its directory of
    `tier`; `shared`: whether other ranks write parts of the same steps; `node_local`,
    `members`, `first_members`: see `Group`. `abandon` tells the other ranks at once that
    this rank's part of a step failed; `commit` makes a written part visible (the marker
    alone, or the vote); `agree_catch_up` picks the steps to catch up (collective in a
    job); `save_requests` is the save-request protocol, None alone. Called from the caller's
    thread and the pipeline's workers; each call may block on the job's store.
    """

    __slots__ = ()
    shared: bool = False
    node_local: bool = False
    members: tuple[int, ...] = ()
    first_members: tuple[int, ...] = ()

    @property
    def rank(self) -> int:
        raise NotImplementedError

    def leads(self, tier: str) -> bool:
        raise NotImplementedError

    def abandon(self, step: int, tier: str, reason: str) -> None:
        raise NotImplementedError

    def commit(
        self,
        tier: Tier,
        writer: StepWriter,
        step: int,
        ref: ManifestRef,
        marker: Marker,
        assignment: str,
        reported: Callable[[], object],
    ) -> None:
        raise NotImplementedError

    def agree_catch_up(self, mine: Sequence[int], plan: Callable[[set[int]], list[int]]) -> list[int]:
        raise NotImplementedError

    def save_requests(self) -> SaveRequests | None:
        raise NotImplementedError

    def abandon_save(self, step: int, tiers: Sequence[str], exc: BaseException) -> None:
        """save() failed on this rank before the step reached the pipeline: tell the other
        ranks now, so their part of `step` fails at once instead of at the timeout."""
        for tier in tiers:
            try:
                self.abandon(step, tier, f"save() raised {type(exc).__name__}: {exc}")
            except Exception as err:
                logger.warning("tiercheck: could not tell the other ranks that step %d failed: %r", step, err)


class Solo(Membership):
    """A process alone (world size 1): it leads every tier, shares no step, has nobody to
    tell or agree with, and commits a step by writing its marker."""

    __slots__ = ()

    @property
    def rank(self) -> int:
        return 0

    def leads(self, tier: str) -> bool:
        return True

    def abandon(self, step: int, tier: str, reason: str) -> None:
        pass  # nobody waits for this part

    def commit(
        self,
        tier: Tier,
        writer: StepWriter,
        step: int,
        ref: ManifestRef,
        marker: Marker,
        assignment: str,
        reported: Callable[[], object],
    ) -> None:
        writer.commit(encode_marker(dataclasses.replace(marker, manifests=(ref,))))

    def agree_catch_up(self, mine: Sequence[int], plan: Callable[[set[int]], list[int]]) -> list[int]:
        return plan(set(mine))

    def save_requests(self) -> SaveRequests | None:
        return None


@dataclass(frozen=True, slots=True)
class Group(Membership):
    """This rank's place in a job of several ranks."""

    coord: Coordinator
    leader: dict[str, int]  # per tier: the rank that writes markers and prunes in my directory
    leaders: dict[str, tuple[int, ...]]  # per tier: every leader (one per distinct directory)
    members: tuple[int, ...] = ()  # the ranks sharing my tier-1 directory (me included)
    first_members: tuple[int, ...] = ()  # the ranks sharing rank 0's tier-1 directory
    shared = True

    @property
    def rank(self) -> int:
        return self.coord.rank

    def leads(self, tier: str) -> bool:
        return self.leader[tier] == self.coord.rank

    @property
    def node_local(self) -> bool:  # type: ignore[override]
        """Tier 1 is not one shared directory: each node (or rank) has its own. Replicated
        keys are then written once per directory, so every node can restore from its own
        tier 1, and uploaded once, from rank 0's directory."""
        return len(self.leaders.get("local", ())) > 1

    def abandon(self, step: int, tier: str, reason: str) -> None:
        self.coord.abandon(step, tier, reason)

    def commit(
        self,
        tier: Tier,
        writer: StepWriter,
        step: int,
        ref: ManifestRef,
        marker: Marker,
        assignment: str,
        reported: Callable[[], object],
    ) -> None:
        vote_commit(self, tier, writer, step, ref, marker, assignment, reported)

    def agree_catch_up(self, mine: Sequence[int], plan: Callable[[set[int]], list[int]]) -> list[int]:
        return self.coord.agree_catch_up(mine, plan)

    def save_requests(self) -> SaveRequests | None:
        return SaveRequests(self.coord)


def _rank_list(data: bytes) -> tuple[int, ...]:
    return tuple(sorted(int(r) for r in data.decode().split(",") if r))


def join_group(
    store: Any, rank: int, world_size: int, timeout: float, local: Any, remote: Any, memory: Any = None
) -> Group:
    """Set up this rank's side of the protocol (collective: every rank calls it once per
    Checkpointer, in the same order): elect one leader per tier-1 (and tier-0) directory,
    learn every leader and the ranks sharing this rank's directory, and wait until all ranks
    are there."""
    coord = Coordinator(store, rank, world_size, instance_prefix(), timeout)
    leader: dict[str, int] = {}
    if memory is not None:  # tier 0: one directory per node (its memory_dir), like a node-local tier 1
        leader[memory.name] = coord.elect(memory.name, node_identity(memory.root))
    identity = ""
    if local is not None:
        identity = node_identity(local.root)
        leader[local.name] = coord.elect(local.name, identity)
        coord._append_to(f"members/{identity}", f"{rank},")
    if remote is not None:
        leader[remote.name] = 0  # shared by every rank: rank 0 commits and prunes it
    for tier, who in leader.items():
        if who == rank:
            coord._append_to(f"leaders/{tier}", f"{rank},")
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


def join_job(job: JobOptions, local: Any, remote: Any, memory: Any = None) -> Membership:
    """This process's place in the job: `Solo` alone, else `join_group` (collective)."""
    if job.world_size == 1:
        return Solo()
    return join_group(job.store, job.rank, job.world_size, job.coordination_timeout, local, remote, memory)
