"""Where each leaf's bytes go in a rank's shard file (pure)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..format.tree import Leaf

ALIGNMENT = 4096  # O_DIRECT and page alignment; also keeps every dtype naturally aligned


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Byte offsets of every leaf in one shard; aliases share their first leaf's offset."""

    offsets: tuple[int, ...]
    total_bytes: int  # padded to ALIGNMENT: the shard file's exact size


def plan_shard(leaves: Sequence[Leaf]) -> ShardPlan:
    offsets: list[int] = []
    cursor = 0
    for leaf in leaves:
        if leaf.alias_of is not None:
            offsets.append(offsets[leaf.alias_of])
            continue
        offsets.append(cursor)
        cursor = align_up(cursor + leaf.nbytes)
    return ShardPlan(offsets=tuple(offsets), total_bytes=cursor)
