"""`tiercheck upload`: copy the committed steps of tier 1 that tier 2 lacks, by hand.

What a `Checkpointer`'s catch-up does at start-up (the steps an earlier run committed on tier
1 but never uploaded), for a person waiting at a terminal: with a progress bar, and for
every missing step rather than only those tier-2 retention would keep.

Each step is copied as the library's uploader copies it: the commit marker and the manifests
are checked first (the manifests against the marker's checksums); each shard file is then
streamed to tier 2 through the one opener (`catalog.ShardFiles`) while every entry's
checksum is computed on the bytes as they pass, and a mismatch stops the upload of that
file before it completes; the manifests follow, and the commit marker last
(`write.write_manifest`, `write.commit_parts`: the writer's own end of a part), so tier 2
lists the step only once everything is there. A shard is stored as tier 2 stores shards
(compressed if it compresses; the manifest then records it). A damaged step
is refused (`CheckpointCorruptedError`, naming the step and the file) and nothing of it is
left on tier 2. A step that a running job's retention deletes while it is copied is skipped
and reported as pruned (`UploadResult.pruned`), not as damaged: after a failed read the
marker is read again (`catalog.reading_committed`). Tier 1 is only read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import NoCheckpointError, StepPrunedError
from ..format import naming
from ..format.manifest import Manifest, ManifestRef, Marker
from ..observe.progress import ProgressCallback
from ..steps.catalog import MAX_MARKER_BYTES, ShardFiles, read_manifest_with_bytes, read_marker, reading_committed
from ..steps.write import commit_parts, write_manifest
from ..tiers.base import StepWriter, Tier
from ..tiers.local import LocalTier
from .step_writer import BLOCK
from .view import tier_at

__all__ = ["UploadResult", "upload_steps", "upload_tier_steps"]


@dataclass(frozen=True, slots=True)
class UploadResult:
    """What `upload_steps` did.

    Attributes:
        copied: steps copied to `remote`, ascending.
        present: steps asked for (or committed on `local`) that `remote` already had.
        bytes: bytes copied (shards, manifests and markers).
        pruned: steps deleted on `local` (a job's retention) while they were read: not
            copied, nothing of them left on `remote`, and not damaged.
    """

    local: str
    remote: str
    copied: tuple[int, ...]
    present: tuple[int, ...]
    bytes: int
    pruned: tuple[int, ...] = ()


def upload_steps(
    local: str | os.PathLike[str],
    remote: str | os.PathLike[str],
    *,
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> UploadResult:
    """Copy the steps committed in the directory `local` but not at `remote` (or just `step`).

    Args:
        local: tier 1, a directory.
        remote: tier 2, an fsspec URL (or a directory).
        step: copy only this step (nothing if `remote` has it already).
        storage_options: fsspec options for `remote`.
        progress: called as ``progress(done_bytes, total_bytes)`` over the bytes of every
            step to copy, as they are read.

    Returns:
        An `UploadResult`. Running it again copies nothing.

    Raises:
        NoCheckpointError: `step` is not committed in `local`.
        CheckpointCorruptedError: a step to copy is damaged on tier 1 (its marker, a
            manifest, or a shard's bytes); the steps before it were copied, it was not.

    Example:
        >>> upload_steps("ckpt/run7", "s3://bucket/run7")   # doctest: +SKIP
    """
    return upload_tier_steps(LocalTier(local), tier_at(remote, storage_options), step=step, progress=progress)


def upload_tier_steps(
    src: Tier, dst: Tier, *, step: int | None = None, progress: ProgressCallback | None = None
) -> UploadResult:
    """`upload_steps` between two tiers (`src` is read only): what the command runs."""
    on_local = src.committed_steps()
    on_remote = set(dst.committed_steps())
    if step is not None:
        if step not in on_local:
            raise NoCheckpointError(f"step {step} is not committed in {src.location} (committed there: {on_local})")
        wanted = [step]
    else:
        wanted = on_local
    todo = [s for s in wanted if s not in on_remote]
    present = tuple(s for s in wanted if s in on_remote)
    pruned: list[int] = []
    plans: list[_StepPlan] = []
    for s in todo:  # every marker and manifest checked before any byte moves
        try:
            with reading_committed(src, s):
                plans.append(_plan(src, s))
        except StepPrunedError:
            pruned.append(s)
    total = sum(p.nbytes for p in plans)
    done = 0
    if progress is not None:
        progress(0, total)

    def advance(n: int) -> None:
        nonlocal done
        done = min(done + n, total)  # a file retried from its start is not counted twice
        if progress is not None:
            progress(done, total)

    copied: list[int] = []
    for plan in plans:
        try:
            with reading_committed(src, plan.step):
                _copy(src, dst, plan, advance)
        except StepPrunedError:  # its partial upload was aborted: tier 2 holds nothing of it
            pruned.append(plan.step)
        else:
            copied.append(plan.step)
    return UploadResult(
        str(src.location),
        str(dst.location),
        tuple(copied),
        present,
        sum(p.nbytes for p in plans if p.step in copied),
        tuple(sorted(pruned)),
    )


@dataclass(frozen=True, slots=True)
class _StepPlan:
    step: int
    marker: Marker
    marker_bytes: int
    manifests: tuple[tuple[bytes, Manifest], ...]  # per rank

    @property
    def nbytes(self) -> int:
        return self.marker_bytes + sum(len(b) + sum(f.length for f in m.files) for b, m in self.manifests)


def _plan(src: Tier, step: int) -> _StepPlan:
    marker = read_marker(src, step)
    marker_bytes = len(src.read_bytes(step, naming.COMMIT_NAME, MAX_MARKER_BYTES))
    manifests = tuple(read_manifest_with_bytes(src, step, r, marker) for r in range(marker.world_size))
    return _StepPlan(step, marker, marker_bytes, manifests)


def _copy(src: Tier, dst: Tier, plan: _StepPlan, advance: Callable[[int], None]) -> None:
    shared = len(plan.manifests) > 1
    writers: list[StepWriter] = []
    parts: list[tuple[StepWriter, ManifestRef]] = []
    try:
        for rank, (manifest_bytes, manifest) in enumerate(plan.manifests):
            writer = dst.open_step(plan.step, rank, shared=shared)
            writers.append(writer)
            with ShardFiles(src, plan.step, manifest.files) as shards:
                stored = [
                    writer.write_chunks(
                        f.name,
                        functools.partial(_verified_chunks, shards, f.name, manifest, advance),
                        f.length,
                        compress=True,
                    )
                    for f in manifest.files
                ]
            parts.append((writer, write_manifest(writer, dst, manifest, stored, manifest_bytes)))
            advance(len(manifest_bytes))
        commit_parts(dst, parts, plan.marker)
        advance(plan.marker_bytes)
    except BaseException:
        for w in writers:
            w.abort()
        raise


def _verified_chunks(
    shards: ShardFiles, name: str, manifest: Manifest, advance: Callable[[int], None]
) -> Iterator[bytes | memoryview]:
    """The bytes of shard `name`, checked against every entry's checksum as they pass (the
    last chunk of an entry is not handed out before its checksum matched), so a mismatch
    stops the upload of the file before it completes."""
    buf = memoryview(bytearray(min(BLOCK, shards.listed[name].length)))
    for chunk in shards.verified_chunks(name, manifest, buf):
        yield chunk
        advance(len(chunk))
