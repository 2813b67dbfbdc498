"""The plain state of a step with placeholder tensors, for exporters that write tensor bytes
in a second pass (torch.save with `skip_data`, DCP with a planner that reads on demand).

Values become what `tiercheck.load` returns, except that numpy arrays and numpy scalars
become tensors (a `.pt` file loaded with ``weights_only=True`` and DCP's tensor items take
no numpy objects): an array as a tensor of the same dtype and shape, a scalar as a 0-d tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedStateError
from ..format.dtypes import TORCH_DTYPES, numpy_dtype_from_name, torch_dtype_of_numpy
from ..format.manifest import Entry
from .view import KeyPath, Node, ShardReader, dotted

Placeholder = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Slot:
    """A placeholder tensor whose bytes are `entry`'s."""

    tensor: torch.Tensor
    entry: Entry
    path: KeyPath
    swap: np.dtype[Any] | None  # a big-endian numpy dtype whose bytes are swapped on the way


def fill(reader: ShardReader, slot: Slot, dest: torch.Tensor) -> None:
    """Read `slot`'s checked bytes into the CPU tensor `dest` (same dtype and shape)."""
    if slot.entry.length:
        reader.read(slot.entry, dest.reshape(-1).view(torch.uint8).numpy().data, dotted(slot.path))
        if slot.swap is not None:
            native = dest.reshape(-1).view(torch.uint8).numpy().view(slot.swap)
            native.byteswap(inplace=True)


def swap_chunk(slot: Slot, chunk: memoryview) -> memoryview:
    """`chunk` of `slot`'s bytes in native byte order (chunks hold whole elements)."""
    if slot.swap is None:
        return chunk
    return memoryview(np.frombuffer(chunk, dtype=slot.swap).byteswap().view(np.uint8))


class SkeletonBuilder:
    """Builds the plain state from `Node`s, one placeholder per distinct tensor region.

    Args:
        reader: reads the values that must be whole now (bytes, and whatever `materialise`
            marks): open while `build` runs.
        placeholder: makes the stand-in for a tensor of a shape and dtype.
        whole_tuples: tensors inside tuples hold their real bytes (DCP stores a tuple as
            one pickled object, so its tensors are not written in a second pass).
    """

    def __init__(self, reader: ShardReader, placeholder: Placeholder, whole_tuples: bool = False) -> None:
        self.reader = reader
        self.placeholder = placeholder
        self.whole_tuples = whole_tuples
        self.slots: list[Slot] = []
        self.converted: list[KeyPath] = []  # numpy values that became tensors
        self._by_region: dict[tuple[str, int, int, str, tuple[int, ...]], Slot] = {}

    def build(self, node: Node, path: KeyPath, materialise: bool = False) -> object:
        """The plain value of `node`; with `materialise`, tensors below hold their real bytes."""
        kind = node.kind
        if kind in ("dict", "stateful"):
            return {k: self.build(c, (*path, k), materialise) for k, c in node.items()}
        if kind == "list":
            return [self.build(c, (*path, i), materialise) for i, c in node.items()]
        if kind == "tuple":
            inner = materialise or self.whole_tuples
            return tuple(self.build(c, (*path, i), inner) for i, c in node.items())
        if node.entry is None:
            return node.value
        e = node.entry
        if kind == "bytes":
            raw = bytearray(e.length)
            if e.length:
                self.reader.read(e, memoryview(raw), dotted(path))
            return bytes(raw)
        swap: np.dtype[Any] | None = None
        if kind == "tensor":
            dtype = TORCH_DTYPES[e.dtype]
        else:
            found = torch_dtype_of_numpy(e.dtype)
            if found is None:
                raise UnsupportedStateError(f"{dotted(path)}: torch has no dtype for numpy {e.dtype}")
            dtype = found
            nd = numpy_dtype_from_name(e.dtype)
            assert nd is not None
            if not nd.isnative:
                swap = nd
            self.converted.append(path)
        if materialise:
            real = torch.empty(e.shape, dtype=dtype)
            fill(self.reader, Slot(real, e, path, swap), real)
            return real
        region = (e.file, e.offset, e.length, e.dtype, e.shape)
        slot = self._by_region.get(region) if e.length else None
        if slot is None:  # tied tensors share one placeholder, as they shared one region
            slot = Slot(self.placeholder(e.shape, dtype), e, path, swap)
            self.slots.append(slot)
            self._by_region[region] = slot
        return slot.tensor
