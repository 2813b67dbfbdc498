"""The job: its ranks, who leads each directory, and the store they coordinate through.

A multi-rank Checkpointer joins a `Group` (`join_group`, collective): one leader per
tier-1 directory (it writes markers and prunes there), the ranks sharing this rank's
directory and rank 0's, all learnt through the job's key-value store (`store`). The
protocols on top have a module each: the commit vote (`commit`), and the restore,
catch-up and save-request agreements (`agreement`); `Coordinator` is one rank's end of
all of them.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CoordinationError
from .agreement import RestoreAgreement, SaveRequests
from .commit import CommitVote, PartReport
from .store import from_process_group, instance_prefix

__all__ = [
    "CoordinationError",
    "Coordinator",
    "Group",
    "PartReport",
    "SaveRequests",
    "from_process_group",
    "instance_prefix",
    "join_group",
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
    """Which directory `path` is, across the job: host name plus device and inode, so ranks
    sharing a node-local directory (or one path on a shared filesystem) find each other."""
    os.makedirs(path, exist_ok=True)
    st = os.stat(path)
    return f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"



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
