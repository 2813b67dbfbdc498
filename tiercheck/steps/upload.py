"""Uploading one step committed on tier 1 to tier 2: verify, copy, manifest, commit.

The tier-1 copy is verified first (a copy damaged after its commit must never reach tier
2, least of all under a marker signed anew there), then its shards are streamed from the
tier-1 files, then the manifest (rewritten when tier 2 stores the shards differently), and
the commit marker last.
"""

from __future__ import annotations

from collections.abc import Callable

from ..format.checksum import checksum_function
from ..format.manifest import ManifestRef, Marker, assignment_digest, encode_manifest
from ..job.commit import commit_step, part_may_commit
from ..job.coordination import Group
from ..plan.retarget import Key, balance, replicated_sizes, retarget
from ..plan.stepdoc import stored_as
from ..tiers.base import Tier
from ..tiers.copy import copy_file, reader_of
from .catalog import present_manifests, read_manifest_with_bytes, read_marker, verify_files
from .write import write_regions

__all__ = ["copy_from_local", "uploaders_of"]


def copy_from_local(
    src: Tier,
    dst: Tier,
    step: int,
    rank: int,
    owners: dict[Key, int],
    group: Group | None,
    reported: Callable[[], object],
) -> Marker:
    """Upload `rank`'s part of committed `step` from `src` to `dst` and commit it there;
    `owners`: replicated keys another rank uploads (left out, the rest packed). Returns the
    tier-1 marker (its metrics are the step's)."""
    marker = read_marker(src, step)
    manifest_bytes, manifest = read_manifest_with_bytes(src, step, rank, marker)
    ref = marker.manifests[rank]
    verify_files(src, step, manifest)  # never spread a copy that went bad on tier 1
    moved = retarget(manifest, owners) if owners else None
    writer = dst.open_step(step, rank, shared=group is not None)
    try:
        if moved is not None:
            shard = manifest.files[0].name
            manifest = moved.manifest
            stored = [write_regions(writer, shard, reader_of(src, step, shard), moved)]
        else:
            stored = [copy_file(src, step, f.name, writer, compress=True) for f in manifest.files]
        if dst.codec != "raw" or moved is not None:  # the tier-2 copy records its own shards
            manifest_bytes = encode_manifest(stored_as(manifest, dst.codec, stored))
            digest = checksum_function(marker.checksum_algorithm)(manifest_bytes)
            ref = ManifestRef(ref.file, len(manifest_bytes), digest)
        writer.write_file(ref.file, memoryview(manifest_bytes))
        commit_step(group, dst, writer, step, ref, marker, assignment_digest(manifest), reported)
    except BaseException as exc:
        if not part_may_commit(exc):
            writer.abort()
        raise
    return marker


def uploaders_of(local: Tier, step: int, group: Group) -> dict[Key, int]:
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
