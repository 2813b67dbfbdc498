"""Where each leaf's bytes go in a rank's shard file (pure).

The placement rule (docs/format.md, "Shard files"): a cursor starts at 0; each entry that is
not an alias starts at the cursor rounded up to its alignment, `PACK_ALIGNMENT` (64 bytes)
for an entry shorter than `PACK_BELOW` (64 KiB), `ALIGNMENT` (4096) otherwise, and the
cursor moves to its end; the file is the cursor rounded up to `ALIGNMENT`. Small entries
are packed so that a state of many small tensors does not pay a page per tensor (a 1 KiB
tensor took 4 KiB of host buffer, shared memory, disk and upload), while large ones stay
page-aligned; 64 bytes keeps every dtype naturally aligned and is a cache line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..format.tree import Leaf

ALIGNMENT = 4096  # the file size and large entries: O_DIRECT and page alignment
PACK_ALIGNMENT = 64  # entries shorter than PACK_BELOW: every dtype aligned, a cache line
PACK_BELOW = 64 << 10


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def entry_offset(cursor: int, nbytes: int) -> int:
    """Where an entry of `nbytes` bytes starts when the previous one ended at `cursor`."""
    return align_up(cursor, PACK_ALIGNMENT if nbytes < PACK_BELOW else ALIGNMENT)


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
        offset = entry_offset(cursor, leaf.nbytes)
        offsets.append(offset)
        cursor = offset + leaf.nbytes
    return ShardPlan(offsets=tuple(offsets), total_bytes=align_up(cursor))
