"""Uploading one step committed on tier 1 to tier 2: verify, copy, manifest, commit.

The tier-1 copy is verified first (a copy damaged after its commit must never reach tier
2, least of all under a marker signed anew there), then its shards are streamed from the
tier-1 files (through the one opener, `catalog.ShardFiles`), then the manifest (rewritten
when tier 2 stores the shards differently) and the commit marker last (`write.write_part`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..format.manifest import Marker, assignment_digest
from ..job.commit import part_may_commit
from ..job.coordination import Membership
from ..plan.retarget import Key, balance, replicated_sizes, retarget
from ..tiers.base import Tier
from .catalog import ShardFiles, present_manifests, read_manifest_with_bytes, read_marker, verify_files
from .write import write_part, write_regions

__all__ = ["copy_from_local", "uploaders_of"]


def copy_from_local(
    src: Tier,
    dst: Tier,
    step: int,
    rank: int,
    owners: dict[Key, int],
    group: Membership,
    reported: Callable[[], object],
) -> Marker:
    """Upload `rank`'s part of committed `step` from `src` to `dst` and commit it there;
    `owners`: replicated keys another rank uploads (left out, the rest packed). Returns the
    tier-1 marker (its metrics are the step's)."""
    marker = read_marker(src, step)
    manifest_bytes, manifest = read_manifest_with_bytes(src, step, rank, marker)
    verify_files(src, step, manifest)  # never spread a copy that went bad on tier 1
    moved = retarget(manifest, owners) if owners else None
    writer = dst.open_step(step, rank, shared=group.shared)
    try:
        with ShardFiles(src, step, manifest.files) as shards:
            if moved is not None:
                shard = manifest.files[0].name
                stored = [write_regions(writer, shard, lambda o, n: shards.read(shard, o, n), moved)]
            else:
                stored = [shards.copy_to(writer, f.name) for f in manifest.files]
        doc = manifest if moved is None else moved.manifest
        write_part(
            dst,
            writer,
            doc,
            stored,
            marker,
            group=group,
            assignment=assignment_digest(doc),
            reported=reported,
            source=manifest_bytes if moved is None else None,  # kept byte for byte where nothing changed
        )
    except BaseException as exc:
        if not part_may_commit(exc):
            writer.abort()
        raise
    return marker


def uploaders_of(local: Tier, step: int, group: Membership) -> dict[Key, int]:
    """Who uploads each replicated key of a tier-1 step (node-local tier 1): the same
    placement `Checkpointer` computes from the live state, here from the manifests of this
    directory, which hold one full copy."""
    manifests = list(present_manifests(local, step, read_marker(local, step), group.members))
    if not manifests or not manifests[0].replicated:
        return {}
    sizes = replicated_sizes(manifests)
    keys = manifests[0].replicated
    if set(sizes) != set(keys):
        raise ValueError(f"step {step}: this directory does not hold every replicated key")
    return balance(keys, sizes, group.first_members, lambda k: repr(list(k)))
