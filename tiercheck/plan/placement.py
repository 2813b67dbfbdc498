"""Which rank writes each replicated key: a pure decision, the same on every rank.

A key the job marks replicated (``Checkpointer(replicated=...)``) holds the same value on
every rank, so one rank per tier-1 directory writes it (once in all when the ranks share
one directory) and one rank uploads it to tier 2; the others record a ``replica``
reference in their tree. Everything here depends only on the keys, their sizes and the
job's layout, so every rank computes the same placement without talking to the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import InvalidArgumentError, UnsupportedStateError
from ..state.flatten import FlatState, flatten_state
from .retarget import Key, balance

__all__ = [
    "JobLayout",
    "Placed",
    "Placement",
    "encode_key",
    "key_sizes",
    "normalize_replicated",
    "place",
    "place_state",
    "replicated_keys",
    "split_state",
]


@dataclasses.dataclass(frozen=True, slots=True)
class JobLayout:
    """What placement needs to know of the job: its size, and when tier 1 is node-local
    (each node has its own directory), the ranks sharing this rank's directory and rank 0's."""

    world_size: int
    node_local: bool = False
    members: tuple[int, ...] = ()
    first_members: tuple[int, ...] = ()
    has_remote: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Per replicated key: the rank writing it to tier 1, and (node-local tier 1 only) the
    rank uploading it to tier 2; an empty `uploaders` means "as on tier 1"."""

    owners: Mapping[Any, int]
    uploaders: Mapping[Any, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """This rank's part of a state: its flattened leaves (replicated keys another rank
    writes become ``replica`` references), the replicated keys (encoded), and who uploads
    each to tier 2 when that differs from tier 1."""

    flat: FlatState
    replicated: tuple[Key, ...]
    remote_owners: tuple[tuple[Key, int], ...]


def normalize_replicated(replicated: bool | Iterable[str | int]) -> bool | frozenset[str | int]:
    """``replicated=`` as given to Checkpointer: True, False, or the set of top-level keys."""
    if replicated is True or replicated is False:
        return replicated
    if isinstance(replicated, (str, bytes)) or not isinstance(replicated, Iterable):
        raise InvalidArgumentError(
            f"replicated must be True, False or a collection of top-level keys, got {replicated!r}"
        )
    keys = frozenset(replicated)
    for k in keys:
        if type(k) not in (str, int):
            raise InvalidArgumentError(f"replicated keys must be str or int, got {k!r}")
    return keys or False


def encode_key(k: object) -> Key:
    """A top-level key as the manifest names it: ``("s", name)`` or ``("i", "3")``."""
    if type(k) is str:
        return ("s", k)
    if type(k) is int:
        return ("i", str(k))
    raise UnsupportedStateError(f"state[{k!r}]: dict keys must be str or int, got {type(k).__name__}")


def replicated_keys(state: Mapping[Any, Any], replicated: bool | frozenset[str | int]) -> list[Any]:
    """The top-level keys of `state` that are replicated, in the state's order.

    Raises:
        UnsupportedStateError: a key named in `replicated` is not in the state.
    """
    if replicated is True:
        return list(state)
    if replicated is False:
        return []
    missing = [k for k in replicated if k not in state]
    if missing:
        raise UnsupportedStateError(f"replicated keys {missing!r} are not in the state (keys: {list(state)!r})")
    return [k for k in state if k in replicated]


def key_sizes(state: Mapping[Any, Any], keys: Iterable[Any]) -> dict[Any, int]:
    """The bytes each key's value stores (aliases counted once)."""
    return {k: sum(lf.nbytes for lf in flatten_state({k: state[k]}).leaves if lf.alias_of is None) for k in keys}


def _balance(keys: list[Any], nbytes: Mapping[Any, int], ranks: Iterable[int]) -> dict[Any, int]:
    return balance(keys, nbytes, ranks, lambda k: repr(list(encode_key(k))))


def place(keys: list[Any], sizes: Callable[[], Mapping[Any, int]], job: JobLayout, writer: int | str) -> Placement:
    """Who writes (and uploads) each of `keys`. `writer` is "balance" (spread by size,
    largest first) or one rank; a node-local tier 1 keeps one copy per directory, balanced
    over the ranks sharing it, and tier 2 one copy, from the ranks of rank 0's directory.
    `sizes` is called only when the placement depends on sizes."""
    if job.world_size == 1:
        return Placement(dict.fromkeys(keys, 0), {})
    if job.node_local:
        nbytes = sizes()
        uploaders = _balance(keys, nbytes, job.first_members) if job.has_remote else {}
        return Placement(_balance(keys, nbytes, job.members), uploaders)
    if writer != "balance":
        return Placement(dict.fromkeys(keys, int(writer)), {})
    return Placement(_balance(keys, sizes(), range(job.world_size)), {})


def split_state(
    state: Mapping[Any, Any],
    rank: int,
    keys: list[Any],
    placement: Placement,
    flatten: Callable[[Mapping[Any, Any]], FlatState] = flatten_state,
) -> Placed:
    """Flatten (with `flatten`) what `rank` writes of `state`: every key but the replicated
    ones another rank writes, which become ``replica`` references in the tree, in the
    state's key order."""
    owners = placement.owners
    encoded = {k: encode_key(k) for k in keys}
    flat = flatten({k: v for k, v in state.items() if owners.get(k, rank) == rank})
    mine = iter(zip(flat.tree["k"], flat.tree["v"], strict=True))
    tree_k: list[list[str]] = []
    tree_v: list[dict[str, Any]] = []
    for k in state:
        if owners.get(k, rank) == rank:
            ek, node = next(mine)
        else:
            ek, node = list(encoded[k]), {"t": "replica", "r": owners[k]}
        tree_k.append(ek)
        tree_v.append(node)
    tree = {"t": "dict", "k": tree_k, "v": tree_v}
    remote_owners = tuple((encoded[k], r) for k, r in placement.uploaders.items())
    return Placed(dataclasses.replace(flat, tree=tree), tuple(encoded.values()), remote_owners)


def place_state(
    state: Mapping[Any, Any], rank: int, replicated: bool | frozenset[str | int], job: JobLayout, writer: int | str
) -> Placed:
    """`split_state` after `place`, in one call (what a writer of rank `rank` writes)."""
    if not replicated or not isinstance(state, Mapping):
        return Placed(flatten_state(state), (), ())
    keys = replicated_keys(state, replicated)
    return split_state(state, rank, keys, place(keys, lambda: key_sizes(state, keys), job, writer))
