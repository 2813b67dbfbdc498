"""One rank's view of a committed step, for tools that work outside training.

`open_view` reads the commit marker and the manifests (never a shard byte) and turns the
manifest tree into `Node` values, with replica nodes replaced by the value their owner
rank holds, so every tool walks one plain tree. `ShardReader` then streams single entries
out of the shard files through a fixed buffer, checking each entry's checksum, so a tool
never holds more than one buffer of a checkpoint in memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorruptedError, NoCheckpointError
from ..format.checksum import checksum_stream
from ..format.manifest import Entry, Manifest, ShardFile, decode_key
from ..format.tree import JsonNode, decode_plain
from ..observe.progress import ProgressCallback
from ..steps.catalog import ReplicaResolver, ShardFiles, read_manifest, read_marker, reading_committed, shard_files
from ..tiers.base import Tier
from ..tiers.open import open_tier

Key = str | int
KeyPath = tuple[Key, ...]

PLAIN_KINDS = frozenset({"none", "bool", "int", "float", "str"})
LEAF_KINDS = frozenset({"tensor", "ndarray", "npscalar", "bytes"})
CHUNK = 8 << 20  # the fixed buffer every streamed read goes through


def tier_at(location: str | os.PathLike[str] | Tier, storage_options: Mapping[str, Any] | None = None) -> Tier:
    """The tier rooted at `location`: a local directory, or an fsspec URL (`open_tier`)."""
    return open_tier(location, storage_options=storage_options)


@dataclass(frozen=True, slots=True)
class Node:
    """A value of the saved state.

    Attributes:
        kind: the manifest's node type: ``dict``, ``stateful`` (an object saved through its
            `state_dict()`; `keys`/`children` are that dict's), ``list``, ``tuple``, a plain
            kind (``none``, ``bool``, ``int``, ``float``, ``str``: `value` holds it), or a
            leaf kind (``tensor``, ``ndarray``, ``npscalar``, ``bytes``: `entry` holds it).
    """

    kind: str
    keys: tuple[Key, ...] = ()
    children: tuple[Node, ...] = ()
    value: object = None
    entry: Entry | None = None
    replica_of: int | None = None  # a top-level value stored in this rank's view by another rank

    def items(self) -> Iterator[tuple[Key, Node]]:
        """(key, child) of a dict or stateful node; (index, child) of a list or tuple."""
        if self.kind in ("dict", "stateful"):
            yield from zip(self.keys, self.children, strict=True)
        else:
            yield from enumerate(self.children)


@dataclass(frozen=True, slots=True)
class StepView:
    """What one rank of a committed step holds, from the manifests alone."""

    tier: Tier
    step: int
    rank: int
    world_size: int
    checksum_algorithm: str
    root: Node
    files: tuple[ShardFile, ...]  # every shard file the view's entries live in
    metrics: Mapping[str, int | float] | None = None  # `save(..., metrics=)`, from the marker

    @property
    def path(self) -> str:
        return self.tier.path_of(self.step)


def choose_step(tier: Tier, step: int | None) -> int:
    """`step` if committed on `tier`, else the newest committed step.

    Raises:
        NoCheckpointError: nothing committed, or not `step`.
    """
    steps = tier.committed_steps()
    if step is None:
        if not steps:
            raise NoCheckpointError(f"no committed step at {tier.location}")
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(f"step {step} is not committed at {tier.location}; committed: {steps}")
    return step


def open_view(tier: Tier, step: int, rank: int = 0) -> StepView:
    """Read `rank`'s manifest of `step` (and those of the ranks holding its replicated keys).

    Raises:
        NoCheckpointError: `step` is not committed, or has no rank `rank`.
        StepPrunedError: `step` was deleted while it was read (a job's retention beside this reader).
        CheckpointCorruptedError: the marker or a manifest fails verification.
    """
    with reading_committed(tier, step):
        return _read_view(tier, step, rank)


def _read_view(tier: Tier, step: int, rank: int) -> StepView:
    marker = read_marker(tier, step)
    manifest = read_manifest(tier, step, rank, marker)
    manifests: dict[int, Manifest] = {rank: manifest}
    replicas = ReplicaResolver(tier, step, marker, manifests)  # the rule restore applies
    children: list[Node] = []
    for k, node in zip(manifest.tree["k"], manifest.tree["v"], strict=True):
        if node["t"] != "replica":
            children.append(_node(node, manifest.entries))
            continue
        owner, held = replicas.resolve(k, node["r"], rank)
        r = _node(held, owner.entries)
        children.append(Node(r.kind, r.keys, r.children, r.value, r.entry, owner.rank))
    root = Node("dict", tuple(decode_key(k) for k in manifest.tree["k"]), tuple(children))
    files = shard_files(tier, step, manifests.values())  # the rule the opener applies
    metrics = dict(marker.metrics) if marker.metrics else None
    return StepView(tier, step, rank, marker.world_size, marker.checksum_algorithm, root, files, metrics)


def _node(node: JsonNode, entries: tuple[Entry, ...]) -> Node:
    t = node["t"]
    if t in LEAF_KINDS:
        return Node(t, entry=entries[node["e"]])
    if t == "dict":
        return Node(t, tuple(decode_key(k) for k in node["k"]), tuple(_node(v, entries) for v in node["v"]))
    if t == "stateful":
        inner = _node(node["v"], entries)
        return Node(t, inner.keys, inner.children)
    if t in ("list", "tuple"):
        return Node(t, children=tuple(_node(v, entries) for v in node["v"]))
    return Node(t, value=decode_plain(node))


def walk(node: Node, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Node]]:
    """Every node below `node` (itself first), depth-first in saved order, with its key path."""
    yield path, node
    for k, child in node.items():
        yield from walk(child, (*path, k))


def dotted(path: KeyPath) -> str:
    """``model.fc.weight``, ``optimizer.state.0.exp_avg``: keys joined with dots."""
    return ".".join(str(k) for k in path)


def select(root: Node, prefix: str | None) -> tuple[KeyPath, Node]:
    """The node whose dotted key path is `prefix` (the root for None or "").

    Raises:
        NoCheckpointError: no such key path (the message lists the top-level keys).
        ValueError: two key paths spell `prefix` (a key that itself holds a dot).
    """
    if not prefix:
        return (), root
    found = [(p, n) for p, n in walk(root) if p and dotted(p) == prefix]
    if not found:
        keys = ", ".join(repr(k) for k in root.keys)
        raise NoCheckpointError(f"no key path {prefix!r} in the step; its top-level keys are {keys}")
    if len(found) > 1:
        spelled = " and ".join(repr(list(p)) for p, _ in found)
        raise ValueError(f"the prefix {prefix!r} is ambiguous: both {spelled} join to it")
    return found[0]


class ShardReader:
    """Streams single entries out of one step's shard files, each checked against its checksum.

    Use as a context manager; `copy` reads one entry through a fixed buffer of `CHUNK`
    bytes. Callers read entries in (file, offset) order: a compressed shard is decompressed
    front to back, and a read behind the current position starts it again.
    """

    def __init__(self, view: StepView, progress: ProgressCallback | None = None, total: int = 0) -> None:
        self._view = view
        self._files: ShardFiles | None = None
        self._buf = memoryview(bytearray(CHUNK))
        self._progress = progress
        self._total = total
        self.done = 0

    def __enter__(self) -> ShardReader:
        self._files = ShardFiles(self._view.tier, self._view.step, self._view.files)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._files is not None:
            self._files.close()
            self._files = None

    def finish(self) -> None:
        """After every entry was read: check each compressed shard holds exactly its
        declared bytes, as restore does (a reader of a few entries need not pay for it)."""
        assert self._files is not None, "ShardReader used outside its with block"
        self._files.check_ends()

    def copy(self, entry: Entry, sink: Callable[[memoryview], None], what: str = "") -> None:
        """Pass the entry's bytes to `sink` chunk by chunk (each chunk valid only during the
        call), then check its checksum.

        Raises:
            CheckpointCorruptedError: the bytes differ from the checksum (`sink` has then
                seen them: the caller discards what it wrote), or the shard is short.
            StepPrunedError: that, but the step is no longer committed: deleted meanwhile.
        """
        with reading_committed(self._view.tier, self._view.step):
            self._stream(entry, None, sink, what)

    def read(self, entry: Entry, dest: memoryview, what: str = "") -> None:
        """Read the entry's bytes into `dest` (exactly `entry.length` bytes), checked as `copy`."""
        if len(dest) != entry.length:
            raise ValueError(f"{what or entry.path}: destination holds {len(dest)} bytes, the entry {entry.length}")
        with reading_committed(self._view.tier, self._view.step):
            self._stream(entry, dest, None, what)

    def _stream(
        self, entry: Entry, dest: memoryview | None, sink: Callable[[memoryview], None] | None, what: str
    ) -> None:
        assert self._files is not None, "ShardReader used outside its with block"
        h = checksum_stream(self._view.checksum_algorithm)
        for pos in range(0, entry.length, CHUNK):
            n = min(CHUNK, entry.length - pos)
            chunk = self._buf[:n] if dest is None else dest[pos : pos + n]
            self._files.read_into(entry.file, entry.offset + pos, chunk)
            h.update(chunk)
            if sink is not None:
                sink(chunk)
            self.done += n
            if self._progress is not None:
                self._progress(self.done, self._total)
        if h.hexdigest() != entry.checksum:
            raise CheckpointCorruptedError(
                f"{self._view.tier.path_of(self._view.step, entry.file)}: checksum mismatch for "
                f"{what or entry.path} (bytes {entry.offset}..{entry.offset + entry.length})"
            )
