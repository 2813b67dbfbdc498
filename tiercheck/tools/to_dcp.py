"""Export to a `torch.distributed.checkpoint` (DCP) directory, one process, no process group.

The state handed to `dcp.save` holds meta-device placeholders; a save planner reads each
tensor from the shard only when DCP's writer asks for it (`resolve_data`), and the writer
(one thread, one file per tensor) drops it once written: peak memory is the largest tensor.
Values DCP stores as one pickled object (non-tensor values, and tuples, which DCP never
looks into) are built in full first.
"""

from __future__ import annotations

import contextlib
import mmap
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from .skeleton import SkeletonBuilder, Slot, fill
from .view import KeyPath, Node, ShardReader


@contextlib.contextmanager
def dcp_call() -> Iterator[None]:
    """Run a `dcp.save`/`dcp.load` in one process: its warning about that is silenced, and
    the error it wraps in `CheckpointException` (a BaseException) is raised as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as exc:
            inner = [e for e, _ in exc.failures.values()]
            if inner and isinstance(inner[0], Exception):
                raise inner[0] from None
            raise RuntimeError(str(exc)) from None


def _released_later(shape: torch.Size, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A tensor in private anonymous memory, whose pages `madvise(MADV_DONTNEED)` frees."""
    nbytes = shape.numel() * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype), None
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).reshape(shape), memory


def meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def write(node: Node, base: KeyPath, tmp_dir: str, reader: ShardReader) -> tuple[int, list[KeyPath]]:
    """Write the plain state of `node` (a mapping) as a DCP checkpoint in `tmp_dir`.

    Returns:
        (number of tensors written in the second pass, key paths of numpy values turned into tensors)
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
    from torch.distributed.checkpoint.state_dict_saver import save

    builder = SkeletonBuilder(reader, meta, whole_tuples=True)
    state = builder.build(node, base)
    if not isinstance(state, dict):
        raise ValueError(f"a DCP checkpoint holds a mapping; {'.'.join(map(str, base))} is a {node.kind}")
    slots = {id(s.tensor): s for s in builder.slots}
    written: list[mmap.mmap] = []

    class StreamingPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item: WriteItem) -> Any:
            if write_item.type != WriteItemType.BYTE_IO:
                slot: Slot | None = slots.get(id(self.lookup_object(write_item.index)))
                if slot is not None:
                    # The serial writer asks for a tensor only once the one before it is
                    # written, but still holds a reference to that one: its memory is
                    # given back (the mapping stays valid, reading zeros).
                    if written:
                        written.pop().madvise(mmap.MADV_DONTNEED)
                    real, memory = _released_later(slot.tensor.shape, slot.tensor.dtype)
                    fill(reader, slot, real)
                    if memory is not None:
                        written.append(memory)
                    return real
            return super().resolve_data(write_item)

    # One file per tensor: DCP's writer keeps every tensor of a file referenced until the
    # file is done (torch 2.13, for its safetensors option), so one file per rank would hold
    # the whole checkpoint. No copy-ahead: with it, DCP's writer (on a machine with CUDA)
    # resolves tensors before the previous ones are written. Measured:
    # benchmarks/tools/export_memory.py, numbers in docs/cli.md.
    writer = FileSystemWriter(
        tmp_dir, single_file_per_rank=False, sync_files=True, thread_count=1, per_thread_copy_ahead=0
    )
    with dcp_call():
        save(state, storage_writer=writer, planner=StreamingPlanner(), no_dist=True)
    return len(builder.slots), builder.converted
