"""Export to a safetensors file, streamed: the header is planned from the manifest, then every
tensor's bytes are copied from the shard through a fixed buffer.

The safetensors format (https://github.com/huggingface/safetensors, "Format"): an unsigned
little-endian 64-bit header size N, N bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}``, offsets relative to the end of
the header, tensors contiguous and covering the whole byte buffer), padded here with spaces
to a multiple of 8, then the little-endian tensor bytes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import UnsupportedStateError
from ..format.dtypes import TORCH_DTYPES
from ..format.manifest import Entry
from .view import KeyPath, Node, ShardReader, dotted, walk

# tiercheck dtype name -> safetensors dtype; float8_e8m0fnu and complex128 have none.
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "complex64": "C64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
MAX_HEADER = 100_000_000  # the safetensors reader's limit


@dataclass(frozen=True, slots=True)
class Planned:
    """The header and the order in which tensors follow it."""

    header: bytes  # size prefix + JSON + padding
    tensors: tuple[tuple[str, Entry], ...]  # (name, entry) in file order
    skipped: tuple[KeyPath, ...]  # values under the selection that are not tensors


def plan(node: Node, base: KeyPath, step: int) -> Planned:
    """Name every tensor under `node` by its key path below `base`, joined with dots, and
    lay them out: widest element type first, so every tensor starts at a multiple of its
    element size (as the safetensors writer does).

    Raises:
        UnsupportedStateError: a tensor of a dtype safetensors has no name for.
        ValueError: two key paths join to the same name, or there is no tensor at all.
    """
    named: dict[str, tuple[KeyPath, Entry]] = {}
    skipped: list[KeyPath] = []
    for path, n in walk(node, base):
        if n.kind == "tensor":
            assert n.entry is not None
            e = n.entry
            if e.dtype not in SAFETENSORS_DTYPES:
                raise UnsupportedStateError(f"{dotted(path)}: safetensors has no dtype for {e.dtype}")
            rel = path[len(base) :] or path[-1:]
            name = dotted(rel)
            if name in named:
                raise ValueError(
                    f"key paths {list(named[name][0])} and {list(path)} both join to the name {name!r}; "
                    "export a narrower --prefix"
                )
            named[name] = (path, e)
        elif n.entry is not None or n.kind in ("none", "bool", "int", "float", "str"):
            skipped.append(path)
    if not named:
        raise ValueError(f"no tensor under {dotted(base) or 'the root'}: nothing to write")
    order = sorted(
        named.items(), key=lambda kv: (-TORCH_DTYPES[kv[1][1].dtype].itemsize, kv[1][1].file, kv[1][1].offset)
    )
    doc: dict[str, object] = {"__metadata__": {"format": "pt", "tiercheck_step": str(step)}}
    pos = 0
    for name, (_, e) in order:
        doc[name] = {
            "dtype": SAFETENSORS_DTYPES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [pos, pos + e.length],
        }
        pos += e.length
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER:
        raise ValueError(f"the safetensors header would be {len(text)} bytes, over the format's {MAX_HEADER}")
    return Planned(struct.pack("<Q", len(text)) + text, tuple((n, e) for n, (_, e) in order), tuple(skipped))


def write(planned: Planned, fd: int, reader: ShardReader) -> None:
    """Write the header, then each tensor's checked bytes, to the open file `fd`."""
    _write_all(fd, [memoryview(planned.header)])
    for name, e in planned.tensors:
        reader.copy(e, lambda chunk: _write_all(fd, [chunk]), what=name)


def _write_all(fd: int, chunks: Iterable[memoryview]) -> None:
    for chunk in chunks:
        pos = 0
        while pos < len(chunk):
            pos += os.write(fd, chunk[pos:])
