"""The state's JSON tree as the manifest stores it: its node type, key paths, the exact
encoding of plain values (both directions), `Leaf`, the description of one array-like
value whose bytes go to a shard, and `DTensorInfo`, where a DTensor's piece sits in the
whole. Pure values; `state.flatten` builds them, every reader decodes them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JsonNode = dict[str, Any]

ROOT = "state"
MAX_DEPTH = 200  # tree levels (a stateful object takes two); readers accept 256


def key_path(parent: str, key: object) -> str:
    """``state['model']['fc.weight']``, ``state['optimizer']['state'][0]``: unambiguous."""
    return f"{parent}[{key!r}]"


BLOCK = 1 << 20  # bytes per block checksum of a DTensor entry (docs/format.md, DTensor entries)


@dataclass(frozen=True, slots=True)
class DTensorInfo:
    """Where a DTensor's saved piece sits in the whole tensor, and the checksums that let a
    reader verify any part of it: the box of the piece (`offsets`, and the entry's shape as
    sizes) in a tensor of `global_shape`, the mesh and placements it was laid out by, this
    rank's coordinate in that mesh, and one digest per `block` bytes of the entry (the last
    block shorter; none for an empty entry).

    `placements` has one item per mesh dimension: ``"R"`` (Replicate) or ``"S<d>"``
    (Shard(d)); `dims` the mesh's dimension names, or all None.
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    mesh: tuple[int, ...]
    dims: tuple[str | None, ...]
    placements: tuple[str, ...]
    coordinate: tuple[int, ...]
    block: int = BLOCK
    blocks: tuple[str, ...] = ()  # the writer fills them in; `flatten` leaves them empty


def block_count(length: int, block: int) -> int:
    """How many block digests an entry of `length` bytes has: ceil(length / block)."""
    return -(-length // block)


@dataclass(frozen=True, slots=True)
class Leaf:
    """One array-like value whose bytes go to a shard file."""

    path: str
    kind: str  # "tensor" | "ndarray" | "npscalar" | "bytes"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    alias_of: int | None = None  # index of an earlier leaf with the very same bytes
    dtensor: DTensorInfo | None = None  # a DTensor's piece: where it sits in the whole


def encode_float(value: float) -> str:
    return value.hex()


def decode_float(text: str) -> float:
    return float.fromhex(text)


def decode_plain(node: JsonNode) -> object:
    """The value of a plain node (``none``, ``bool``, ``int``, ``float``, ``str``), as
    `_Flattener.node` encoded it; the one decoder restore and the tools share."""
    t = node["t"]
    if t == "none":
        return None
    if t == "int":
        return int(node["v"])
    if t == "float":
        return decode_float(node["v"])
    return node["v"]  # bool, str: stored as JSON's own
