"""The state's JSON tree as the manifest stores it: its node type, key paths, the exact
encoding of plain values (both directions), and `Leaf`, the description of one array-like
value whose bytes go to a shard. Pure values; `state.flatten` builds them, every reader
decodes them here.
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


@dataclass(frozen=True, slots=True)
class Leaf:
    """One array-like value whose bytes go to a shard file."""

    path: str
    kind: str  # "tensor" | "ndarray" | "npscalar" | "bytes"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    alias_of: int | None = None  # index of an earlier leaf with the very same bytes


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


