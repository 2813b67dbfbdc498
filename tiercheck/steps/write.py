"""Writing one staged step from the host buffer to a tier: shard, manifest, commit; and
`write_part`, the manifest-then-marker end of that sequence, which every writer of a part
calls (this writer, the uploader, `tiercheck import`, and through `write_manifest` and
`commit_parts`, `tiercheck upload`).

The shard is written while a checksum thread (the pipeline's, passed in) hashes each leaf
of the same buffer; both release the GIL. The writer is queued once the copy into the
buffer ended, and opens the step only once `save()` returned (`StageProgress`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from ..format import naming
from ..format.checksum import block_checksums, checksum_function
from ..format.manifest import (
    Manifest,
    ManifestRef,
    Marker,
    Metric,
    assignment_digest,
    encode_manifest,
    encode_manifest_with,
    encode_marker,
    tree_json_text,
)
from ..format.tree import JsonNode, Leaf
from ..job.commit import commit_step, part_may_commit
from ..job.coordination import Membership, Solo
from ..observe.collector import collector_paused
from ..plan.retarget import Key, Retargeted, region_chunks, retarget
from ..plan.shards import ShardPlan
from ..plan.stepdoc import entry_texts, shard_manifest, stored_as, with_alias_sums
from ..tiers.base import StepWriter, Tier
from .handle import SaveHandle
from .stage import HostBuffer, StageProgress

__all__ = [
    "REGION_BLOCK",
    "StagedSave",
    "commit_parts",
    "commit_received",
    "mark_received",
    "write_manifest",
    "write_part",
    "write_regions",
    "write_staged",
]

REGION_BLOCK = 8 << 20  # bytes per read when packing the regions of a retargeted shard


@dataclass(frozen=True, slots=True)
class StagedSave:
    """Everything a writer needs for one step; the buffer is the pipeline's until written."""

    step: int
    rank: int
    world_size: int
    tree: JsonNode
    leaves: tuple[Leaf, ...]
    plan: ShardPlan
    buffer: HostBuffer
    handle: SaveHandle
    progress: StageProgress | None = None  # set when the writer waits for the end of save()
    replicated: tuple[tuple[str, str], ...] = ()  # top-level keys the same on every rank
    # Node-local tier 1: who uploads each replicated key to tier 2 (empty: as on tier 1).
    remote_owners: tuple[tuple[Key, int], ...] = ()
    metrics: tuple[tuple[str, Metric], ...] = ()  # recorded in the commit marker
    # Per checksum algorithm, the leaves' digests once a writer has computed them: tier 0 and
    # tier 1 write the same buffer, so the second hashes nothing.
    digests: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    # Per checksum algorithm, the block digests of each DTensor leaf (by leaf index; an alias
    # uses its source's), computed with `digests` and cached alike.
    block_digests: dict[str, dict[int, tuple[str, ...]]] = dataclasses.field(default_factory=dict)


def write_staged(
    tier: Tier,
    job: StagedSave,
    *,
    hasher: Executor,
    checksum_algorithm: str,
    group: Membership,
    owners: dict[Key, int],
    owners_agree: bool,
    reported: Callable[[], object],
) -> None:
    """Write `job` to `tier` and commit it (alone, or through the job's vote).

    `owners`: replicated keys other ranks upload, left out of this copy (tier 1 failed and
    this part goes to tier 2 from host memory); `owners_agree`: whether the ranks must agree
    on who holds each replicated key (not on a node-local tier 1, where each directory holds
    its own copies). `reported` runs once this rank's part is published in a job.
    """
    if job.progress is not None:
        # Before anything else: the copy's end, and `save()` returned (`StageProgress`).
        job.progress.wait(job.plan.total_bytes)
    if tier.capabilities.space_check:
        tier.check_space(job.step, job.plan.total_bytes)
    checksum = checksum_function(checksum_algorithm)
    cached = job.digests.get(checksum_algorithm)
    batches = checksum_batches(job) if cached is None else []
    blocked = block_sizes(job.leaves)
    futures = [hasher.submit(_batch_checksums, job, checksum, batch, checksum_algorithm, blocked) for batch in batches]
    writer = tier.open_step(job.step, job.rank, shared=group.shared)

    def manifest_with(sums: list[str] | None, blocks: dict[int, tuple[str, ...]] | None = None) -> Manifest:
        return shard_manifest(
            step=job.step,
            rank=job.rank,
            world_size=job.world_size,
            checksum_algorithm=checksum_algorithm,
            leaves=job.leaves,
            plan=job.plan,
            sums=sums,
            tree=job.tree,
            replicated=job.replicated,
            blocks=blocks if blocks is not None or sums is None else _placeholder_blocks(job.leaves),
        )

    try:
        view = job.buffer.view(job.plan.total_bytes)
        shard = naming.shard_name(job.rank, job.world_size)
        moved = retarget(manifest_with([""] * len(job.leaves)), owners) if owners else None
        if moved is None:
            stored = writer.write_file(shard, view, job.buffer.aligned, compress=True)
        else:
            stored = write_regions(writer, shard, lambda o, n: view[o : o + n], moved)
        if cached is None:
            sums = [""] * len(job.leaves)
            blocks: dict[int, tuple[str, ...]] = {}
            for batch, f in zip(batches, futures, strict=True):
                digests, batch_blocks = f.result()
                for i, digest in zip(batch, digests, strict=True):
                    sums[i] = digest
                blocks.update(batch_blocks)
            job.block_digests[checksum_algorithm] = blocks
            job.digests[checksum_algorithm] = sums
        else:
            sums = list(cached)
            blocks = job.block_digests[checksum_algorithm]
        # The manifest's objects (an entry a leaf, and their JSON) are made and freed with the
        # collector paused: built beside training, they set off a full collection every
        # other save at 20,000 leaves (0.2 s, traversing every live tensor). `write_part`'s
        # two halves, the commit (which may wait for other ranks) after the window.
        with collector_paused():
            parts = _entry_texts(job, shard) if moved is None else None
            entries_json: str | None = None
            tree_json: str | None = None
            if parts is not None:  # the entries' texts kept from the last save: no object a leaf
                texts = [
                    head + ck + tail for (head, tail), ck in zip(parts, with_alias_sums(job.leaves, sums), strict=True)
                ]
                entries_json = "[" + ",".join(texts) + "]"
                del texts
                tree_json = _tree_text(job)
                doc = manifest_with(None)
            else:
                doc = manifest_with(with_alias_sums(job.leaves, sums), blocks)
                if moved is not None:
                    again = retarget(doc, owners)
                    assert again is not None and again.regions == moved.regions
                    doc = again.manifest
                    del again
            assignment = assignment_digest(doc, owners_agree)
            ref = write_manifest(writer, tier, doc, [stored], entries_json=entries_json, tree_json=tree_json)
            del doc, entries_json, tree_json
        marker = Marker(job.step, job.world_size, checksum_algorithm, (), job.metrics)
        commit_step(group, tier, writer, job.step, ref, marker, assignment, reported)
    except BaseException as exc:
        for f in futures:
            f.cancel()
        if not part_may_commit(exc):
            writer.abort()
        raise


def write_manifest(
    writer: StepWriter,
    tier: Tier,
    doc: Manifest,
    stored: Sequence[int],
    source: bytes | None = None,
    *,
    entries_json: str | None = None,
    tree_json: str | None = None,
) -> ManifestRef:
    """Write the manifest of the part whose shard files `writer` stored (`stored`: the bytes
    stored per file of `doc.files`): `doc` as `tier` holds them (the builder's `stored_as`).
    `source`: `doc` as another tier encoded it (a copy), written unchanged when storing it
    here changed nothing, so a copy keeps its source's bytes. `entries_json`: the text of
    the entries' array, `doc.entries` being empty, and `tree_json` that of `doc.tree` if
    given (`encode_manifest_with`)."""
    held = stored_as(doc, tier.codec, stored)
    if entries_json is not None:
        data = encode_manifest_with(held, entries_json, tree_json)
    else:
        data = source if source is not None and held == doc else encode_manifest(held)
    name = naming.manifest_name(doc.rank, doc.world_size)
    writer.write_file(name, memoryview(data))
    return ManifestRef(name, len(data), checksum_function(doc.checksum_algorithm)(data))


def write_part(
    tier: Tier,
    writer: StepWriter,
    doc: Manifest,
    stored: Sequence[int],
    marker: Marker,
    *,
    group: Membership,
    assignment: str = "",
    reported: Callable[[], object] = lambda: None,
    source: bytes | None = None,
) -> None:
    """The end of writing one rank's part, the same for every writer (the uploader, `tiercheck
    import`; the engine's writer, `write_staged`, calls its two halves itself, so that the
    manifest is built and written with the collector paused and freed before the commit):
    its shard files are stored; then its manifest (`write_manifest`), then the commit marker
    last (`commit_step`: alone, the marker listing this part; in a job, the ranks' vote).
    `marker`: the step's marker, its manifests filled in here. On failure the caller aborts
    `writer` (`part_may_commit`)."""
    ref = write_manifest(writer, tier, doc, stored, source)
    commit_step(group, tier, writer, doc.step, ref, marker, assignment, reported)


def commit_parts(tier: Tier, parts: Sequence[tuple[StepWriter, ManifestRef]], marker: Marker) -> None:
    """Commit a step every part of which this process wrote (`tiercheck upload` copies whole
    steps), each with `write_manifest`: one part as `write_part` commits it alone; several
    (opened `shared`) each published, then the marker listing them all, last."""
    if len(parts) == 1:
        writer, ref = parts[0]
        commit_step(Solo(), tier, writer, marker.step, ref, marker, "")
        return
    for writer, _ in parts:
        writer.publish_part()
    tier.write_marker(marker.step, encode_marker(dataclasses.replace(marker, manifests=tuple(r for _, r in parts))))


def commit_received(tier: Tier, writer: StepWriter, step: int, marker: bytes | None) -> None:
    """Commit a part received whole from another node (a tier-0 copy, or one sent back at
    restore): its files are written; the step's marker goes in as the bytes that came, since
    it lists every rank's manifest (a reader verifies it, then the manifest against it).
    `marker` None: publish the part only; `mark_received` writes the marker once every part
    of the directory is in (ranks of one node receiving theirs at the same time)."""
    writer.publish_part()
    if marker is not None:
        mark_received(tier, step, marker)


def mark_received(tier: Tier, step: int, marker: bytes) -> None:
    """The marker of a step whose parts were received (`commit_received`), last."""
    tier.write_marker(step, marker)


def write_regions(
    writer: StepWriter, name: str, read: Callable[[int, int], bytes | memoryview], moved: Retargeted
) -> int:
    """Write the packed shard of a retargeted part; returns the bytes stored."""
    return writer.write_chunks(
        name, lambda: region_chunks(read, moved.regions, moved.length, REGION_BLOCK), moved.length, compress=True
    )


def _entry_texts(job: StagedSave, shard: str) -> list[tuple[str, str]] | None:
    """Each entry's text of `job`'s manifest but its checksum (`stepdoc.entry_texts`), kept on
    the host buffer from the last save written from it while the structure cache gives the
    same leaves and plan (tier 0 and tier 1 write the same job; the pool frees it at close).
    At 20,000 leaves building and encoding an entry a leaf took 0.13 s of the writer's
    0.17 s a save, beside training."""
    cached = job.buffer.entry_texts
    if cached is not None and cached[0] is job.leaves and cached[1] is job.plan and cached[2] == shard:
        return cached[3]
    parts = entry_texts(job.leaves, job.plan, shard)
    job.buffer.entry_texts = (job.leaves, job.plan, shard, parts)
    return parts


def _tree_text(job: StagedSave) -> str:
    """The JSON text of `job.tree`, kept on the host buffer while the structure cache gives
    the same tree object (an unchanged state's: its nodes are never changed in place; a
    changed value gives a new root). 0.023 s a save at 20,000 leaves."""
    cached = job.buffer.tree_text
    if cached is not None and cached[0] is job.tree:
        return cached[1]
    text = tree_json_text(job.tree)
    job.buffer.tree_text = (job.tree, text)
    return text


CHECKSUM_BATCH = 4 << 20  # bytes of small leaves hashed per task


def checksum_batches(job: StagedSave) -> list[list[int]]:
    """The leaves (not aliases) hashed by one checksum task each: runs of consecutive leaves
    of about `CHECKSUM_BATCH` bytes, so that a state of many small tensors costs a few
    tasks, not one per leaf (a task per leaf, submitted beside the copy, took the GIL from
    it: 20,000 leaves made the copy several times slower)."""
    out: list[list[int]] = []
    run: list[int] = []
    nbytes = 0
    for i, leaf in enumerate(job.leaves):
        if leaf.alias_of is not None:
            continue
        if run and nbytes + leaf.nbytes > CHECKSUM_BATCH:
            out.append(run)
            run, nbytes = [], 0
        run.append(i)
        nbytes += leaf.nbytes
    if run:
        out.append(run)
    return out


def block_sizes(leaves: Sequence[Leaf]) -> dict[int, int]:
    """The leaves whose bytes get block digests (a DTensor's piece, or the leaf a DTensor's
    piece aliases), and their block sizes."""
    out: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if leaf.dtensor is not None:
            out[i if leaf.alias_of is None else leaf.alias_of] = leaf.dtensor.block
    return out


def _placeholder_blocks(leaves: Sequence[Leaf]) -> dict[int, tuple[str, ...]]:
    """Blocks of the right count, no digest: the manifest `retarget` lays out before the
    digests exist (it reads only offsets and lengths)."""
    return {i: ("",) * -(-leaves[i].nbytes // block) for i, block in block_sizes(leaves).items()}


def _batch_checksums(
    job: StagedSave, checksum: Callable[[memoryview], str], batch: list[int], algorithm: str, blocked: dict[int, int]
) -> tuple[list[str], dict[int, tuple[str, ...]]]:
    """The digests of the leaves of `batch`, and the block digests of those in `blocked`,
    hashed in the same pass over their bytes."""
    offsets = job.plan.offsets
    last = batch[-1]
    end = offsets[last] + job.leaves[last].nbytes
    view = job.buffer.view(end)
    if not blocked:
        return [checksum(view[offsets[i] : offsets[i] + job.leaves[i].nbytes]) for i in batch], {}
    sums: list[str] = []
    blocks: dict[int, tuple[str, ...]] = {}
    for i in batch:
        data = view[offsets[i] : offsets[i] + job.leaves[i].nbytes]
        block = blocked.get(i)
        if block is None:
            sums.append(checksum(data))
        else:
            whole, blocks[i] = block_checksums(algorithm, data, block)
            sums.append(whole)
    return sums, blocks
