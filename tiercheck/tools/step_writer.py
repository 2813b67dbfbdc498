"""Write a flattened state as a committed step, streamed leaf by leaf (for `tiercheck import`).

`Checkpointer.save` copies the whole state into one host buffer before writing it; a tool
converting a file that may be larger than memory cannot. `write_step` writes the same bytes
(`plan.shards.plan_shard`'s layout, zeros in the alignment padding, the manifest from the
one builder `plan.stepdoc.shard_manifest`, then the writer's own end of a part,
`steps.write.write_part`: the shard first, then the manifest, the commit marker last) from
a callback that yields each leaf's bytes in chunks, so at most one chunk (plus whatever
the callback holds) is in memory at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..format import naming
from ..format.checksum import checksum_stream
from ..format.manifest import Marker
from ..job.coordination import Solo
from ..observe.progress import ProgressCallback
from ..plan.shards import plan_shard
from ..plan.stepdoc import shard_manifest, with_alias_sums
from ..state.flatten import FlatState
from ..steps.write import write_part
from ..tiers.base import Tier

__all__ = ["BLOCK", "Chunk", "LeafChunks", "memory_chunks", "write_step"]

BLOCK = 8 << 20
"""Bytes per chunk a leaf is written in: the fixed buffer of a streamed write."""

Chunk = bytes | memoryview

LeafChunks = Callable[[int], Iterator[Chunk]]
"""``chunks(i)``: the bytes of leaf `i` of the flattened state, in order, in chunks of at most
`BLOCK` bytes; each chunk may be reused once the next is asked for. Called again for a leaf
when a tier retries a file from its start."""

_ZEROS = bytes(4096)  # alignment padding (planner.ALIGNMENT at most)


def write_step(
    tier: Tier,
    step: int,
    flat: FlatState,
    chunks: LeafChunks,
    *,
    checksum: str = "crc32c",
    progress: ProgressCallback | None = None,
) -> int:
    """Write `flat` as committed `step` of `tier` (rank 0 of 1), as `Checkpointer.save` would.

    Args:
        tier: the tier to write; the caller has checked that `step` is newer than its steps.
        step: the step number.
        flat: the state, from `state.flatten_state`; its sources are not read, `chunks` is.
        chunks: the bytes of each leaf (see `LeafChunks`).
        checksum: the checksum algorithm (``Checkpointer(checksum=)``).
        progress: ``progress(done, total)`` over the leaves' bytes as they are written.

    Returns:
        The bytes of leaves written (tied leaves once).

    Raises:
        Whatever `chunks` or the tier raises; nothing of the step is left visible then.
    """
    plan = plan_shard(flat.leaves)
    shard = naming.shard_name(0, 1)
    unique = [i for i, leaf in enumerate(flat.leaves) if leaf.alias_of is None]
    total = sum(flat.leaves[i].nbytes for i in unique)
    sums = [""] * len(flat.leaves)
    done = 0

    def shard_chunks() -> Iterator[Chunk]:
        nonlocal done
        pos = 0
        written = 0  # bytes of leaves in this pass (a retry starts again from zero)
        for i in unique:
            leaf, off = flat.leaves[i], plan.offsets[i]
            yield from _padding(off - pos)
            h = checksum_stream(checksum)
            got = 0
            for chunk in chunks(i):
                n = len(memoryview(chunk).cast("B"))
                got += n
                if got > leaf.nbytes:
                    break
                h.update(chunk)
                yield chunk
                written += n
                if progress is not None and written > done:
                    done = written
                    progress(done, total)
            if got != leaf.nbytes:
                raise ValueError(f"{leaf.path}: the source gave {got} bytes, its dtype and shape make {leaf.nbytes}")
            sums[i] = h.hexdigest()
            pos = off + leaf.nbytes
        yield from _padding(plan.total_bytes - pos)

    if tier.capabilities.space_check:
        tier.check_space(step, plan.total_bytes)
    writer = tier.open_step(step, 0)
    try:
        stored = writer.write_chunks(shard, shard_chunks, plan.total_bytes, compress=True)
        doc = shard_manifest(
            step=step,
            rank=0,
            world_size=1,
            checksum_algorithm=checksum,
            leaves=flat.leaves,
            plan=plan,
            sums=with_alias_sums(flat.leaves, sums),
            tree=flat.tree,
        )
        write_part(tier, writer, doc, [stored], Marker(step, 1, checksum, ()), group=Solo())
    except BaseException:
        writer.abort()
        raise
    if progress is not None:
        progress(total, total)
    return total


def _padding(n: int) -> Iterator[bytes]:
    while n > 0:
        k = min(n, len(_ZEROS))
        yield _ZEROS[:k]
        n -= k


def memory_chunks(
    source: object, block: int = BLOCK, release: Callable[[int, int], None] | None = None
) -> Iterator[Chunk]:
    """The bytes `stage_into` would copy for `source` (a tensor, numpy array or bytes), in
    chunks of `block` bytes. A tensor that is not contiguous, or has its conjugate or negative
    bit set, is first made a plain contiguous copy (one tensor at a time). `release(lo, hi)`,
    if given, is called with the address range of each chunk of a tensor once it is used."""
    if isinstance(source, torch.Tensor):
        t = source.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel() == 0:
            return
        raw = t.reshape(-1).view(torch.uint8).numpy()
        ptr = t.data_ptr()
        for pos in range(0, len(raw), block):
            piece = raw[pos : pos + block]
            yield memoryview(piece)  # type: ignore[arg-type]
            if release is not None:
                release(ptr + pos, ptr + pos + len(piece))
    elif isinstance(source, np.ndarray):
        arr = np.ascontiguousarray(source).reshape(-1).view(np.uint8)
        for pos in range(0, len(arr), block):
            yield memoryview(arr[pos : pos + block])  # type: ignore[arg-type]
    else:
        assert isinstance(source, bytes), type(source)
        view = memoryview(source)
        for pos in range(0, len(view), block):
            yield view[pos : pos + block]
