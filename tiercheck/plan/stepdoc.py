"""What one rank's manifest of a step says: a pure function of the staged save.

The one builder of a manifest (no other module constructs `Manifest`, which
`tests/steps/test_write_path.py` checks): the writer (`steps/write.py`) and `tiercheck import`
(`tools/step_writer.py`) build one from the save's leaves, their offsets in the shard and
their checksums; every writer records it as its tier stored the shards (`stored_as`:
compressed, or packed without another rank's replicated keys).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from ..format import naming
from ..format.manifest import Manifest, ShardFile, build_entries, entry_json_parts
from ..format.tree import JsonNode, Leaf
from .shards import ShardPlan

__all__ = ["entry_texts", "shard_manifest", "stored_as", "with_alias_sums"]


def shard_manifest(
    *,
    step: int,
    rank: int,
    world_size: int,
    checksum_algorithm: str,
    leaves: Sequence[Leaf],
    plan: ShardPlan,
    sums: Sequence[str] | None,
    tree: JsonNode,
    replicated: tuple[tuple[str, str], ...] = (),
    blocks: Mapping[int, tuple[str, ...]] | None = None,
) -> Manifest:
    """The manifest of one rank's single-shard part of `step` (`sums`: one per leaf;
    `blocks`: the block digests of each DTensor leaf by index, an alias's under its source's).
    `sums` None: the manifest without its entries, for a writer that gives them as text
    (`entry_texts`, `format.manifest.encode_manifest_with`).

    Raises:
        ValueError: a DTensor leaf without its block digests.
    """
    shard = naming.shard_name(rank, world_size)
    return Manifest(
        step=step,
        rank=rank,
        world_size=world_size,
        checksum_algorithm=checksum_algorithm,
        files=(ShardFile(shard, plan.total_bytes),),
        entries=() if sums is None else build_entries(leaves, plan.offsets, sums, shard, blocks),
        tree=tree,
        replicated=replicated,
    )


def entry_texts(leaves: Sequence[Leaf], plan: ShardPlan, shard: str) -> list[tuple[str, str]] | None:
    """Each entry's text in the manifest of `leaves` laid out by `plan` in `shard`, split
    around its checksum (`format.manifest.entry_json_parts`); None if a leaf is a DTensor
    (its block digests change with its bytes)."""
    if any(leaf.dtensor is not None for leaf in leaves):
        return None
    return entry_json_parts(build_entries(leaves, plan.offsets, [""] * len(leaves), shard))


def with_alias_sums(leaves: Sequence[Leaf], sums: Sequence[str]) -> list[str]:
    """`sums` with each alias leaf given the checksum of the leaf it aliases."""
    out = list(sums)
    for i, leaf in enumerate(leaves):
        if leaf.alias_of is not None:
            out[i] = out[leaf.alias_of]
    return out


def stored_as(doc: Manifest, codec: str, stored: Sequence[int]) -> Manifest:
    """`doc` with its shard files recorded as a tier stores them: `codec`, and the stored
    sizes when that codec changes them."""
    files = tuple(
        ShardFile(f.name, f.length, codec, n if codec != "raw" else None)
        for f, n in zip(doc.files, stored, strict=True)
    )
    return dataclasses.replace(doc, files=files)
