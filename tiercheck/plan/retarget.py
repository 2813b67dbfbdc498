"""Rewrite one rank's part for a tier where replicated keys live elsewhere (pure).

With a node-local tier 1, every node keeps its own copy of the replicated keys (so each
node restores from its own disk), but tier 2 must hold them once. Uploading a part then
means: point each replicated key at the rank that uploads it (a `replica` node), drop the
entries only those keys used, and lay the remaining entries out again, packed, in the same
order (the writer's placement rule, `shards.entry_offset`). Checksums stay valid: they cover
each entry's bytes, which do not change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..format.manifest import Entry, Manifest, ShardFile
from ..format.tree import JsonNode
from .shards import align_up, entry_offset

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Retargeted:
    manifest: Manifest  # files: one raw ShardFile of `length` bytes (the caller records codecs)
    regions: tuple[tuple[int, int, int], ...]  # (offset in the old shard, in the new one, length)
    length: int  # the new shard's size


def retarget(m: Manifest, owners: Mapping[Key, int]) -> Retargeted | None:
    """Rank `m.rank`'s manifest as it must read on a tier where replicated key k is held by
    rank `owners[k]`; None if it already reads that way.

    Raises:
        ValueError: the part does not hold a key it is to own there.
    """
    if len(m.files) != 1 or any(e.file != m.files[0].name for e in m.entries):
        raise ValueError("a part to retarget has exactly one shard file")
    tree = m.tree
    values: list[JsonNode] = []
    changed = False
    for k, v in zip(tree["k"], tree["v"], strict=True):
        owner = owners.get((k[0], k[1]))
        if owner is None or (owner == m.rank and v["t"] != "replica"):
            values.append(v)
        elif owner == m.rank:
            raise ValueError(f"rank {m.rank} is to hold replicated key {k!r} but its part does not")
        else:
            changed = changed or v != {"t": "replica", "r": owner}
            values.append({"t": "replica", "r": owner})
    if not changed:
        return None
    new_tree: JsonNode = {"t": "dict", "k": tree["k"], "v": values}
    used = sorted(set(_entry_refs(new_tree)))
    renumber = {old: new for new, old in enumerate(used)}
    entries: list[Entry] = []
    regions: list[tuple[int, int, int]] = []
    placed: dict[tuple[int, int], int] = {}  # (old offset, length) -> new offset: aliases stay aliases
    cursor = 0
    for i in used:
        e = m.entries[i]
        if e.length and (e.offset, e.length) in placed:
            entries.append(dataclasses.replace(e, offset=placed[(e.offset, e.length)]))
            continue
        offset = entry_offset(cursor, e.length)
        entries.append(dataclasses.replace(e, offset=offset))
        if e.length:
            placed[(e.offset, e.length)] = offset
            regions.append((e.offset, offset, e.length))
        cursor = offset + e.length
    length = align_up(cursor)
    shard = ShardFile(m.files[0].name, length)
    manifest = dataclasses.replace(m, files=(shard,), entries=tuple(entries), tree=_renumber(new_tree, renumber))
    return Retargeted(manifest, tuple(regions), length)


def _entry_refs(node: JsonNode) -> Iterator[int]:
    if "e" in node:
        yield node["e"]
    v = node.get("v")
    if isinstance(v, list):
        for child in v:
            yield from _entry_refs(child)
    elif isinstance(v, dict):
        yield from _entry_refs(v)


def _renumber(node: JsonNode, renumber: Mapping[int, int]) -> JsonNode:
    out: dict[str, Any] = dict(node)
    if "e" in node:
        out["e"] = renumber[node["e"]]
    v = node.get("v")
    if isinstance(v, list):
        out["v"] = [_renumber(c, renumber) for c in v]
    elif isinstance(v, dict):
        out["v"] = _renumber(v, renumber)
    return out


def region_chunks(
    read: Callable[[int, int], bytes | memoryview], regions: tuple[tuple[int, int, int], ...], length: int, block: int
) -> Iterator[bytes | memoryview]:
    """The new shard's bytes, in order: each region read from the old shard in blocks of at
    most `block` bytes, zero padding between regions and at the end."""
    pos = 0
    for old, new, n in regions:
        if new > pos:
            yield bytes(new - pos)
        for off in range(0, n, block):
            yield read(old + off, min(block, n - off))
        pos = new + n
    if length > pos:
        yield bytes(length - pos)


def balance(
    keys: Iterable[Hashable], nbytes: Mapping[Any, int], ranks: Iterable[int], name: Callable[[Any], str]
) -> dict[Any, int]:
    """Spread `keys` over `ranks`, largest first (ties by `name`), each to the least loaded
    rank (ties: the lowest). Deterministic: every rank computes the same answer."""
    load = dict.fromkeys(ranks, 0)
    owners: dict[Any, int] = {}
    for k in sorted(keys, key=lambda k: (-nbytes[k], name(k))):
        r = min(load, key=lambda r: (load[r], r))
        owners[k] = r
        load[r] += nbytes[k]
    return owners


def replicated_sizes(manifests: Iterable[Manifest]) -> dict[Key, int]:
    """The bytes of each replicated key, from the manifests that hold it (not as a replica):
    what `Checkpointer` measured from the live state when it placed the keys."""
    sizes: dict[Key, int] = {}
    for m in manifests:
        for k, v in zip(m.tree["k"], m.tree["v"], strict=True):
            key = (k[0], k[1])
            if key in m.replicated and v["t"] != "replica":
                regions = {(m.entries[i].offset, m.entries[i].length) for i in _entry_refs(v)}
                sizes[key] = sum(n for _, n in regions)
    return sizes
