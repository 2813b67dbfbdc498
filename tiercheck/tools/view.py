"""One rank's view of a committed step, for tools that work outside training.

`open_view` reads the commit marker and the manifests (never a shard byte) and turns the
manifest tree into `Node` values, with replica nodes replaced by the value their owner
rank holds, so every tool walks one plain tree. `ShardReader` then streams single entries
out of the shard files through a fixed buffer, checking each entry's checksum, so a tool
never holds more than one buffer of a checkpoint in memory.

A DTensor's saved piece (FSDP2, tensor parallel) is shown as the whole tensor: its node's
`entry` is the whole tensor's (global shape and length; the piece's file and offset, which
name it) and `piece` the viewed rank's own entry. `ShardReader` assembles the whole tensor
from every saved rank's pieces of that key (their manifests read from the same tier), row
band by row band through the same buffer, reading only whole checksum blocks and verifying
each (`plan.reshard.plan_box`, `steps.reshard.read_piece`: restore's resharding rules).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointCorruptedError, NoCheckpointError
from ..format.checksum import checksum_stream
from ..format.dtypes import TORCH_DTYPES
from ..format.manifest import Entry, Manifest, ShardFile, decode_key
from ..format.tree import JsonNode, decode_plain
from ..observe.progress import ProgressCallback
from ..plan.reshard import plan_box
from ..steps.catalog import (
    MissingManifestError,
    ReplicaResolver,
    ShardFiles,
    read_manifest,
    read_marker,
    reading_committed,
    shard_files,
)
from ..steps.reshard import LastBlocks, check_pieces_agree, pieces_of, read_piece
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
    piece: Entry | None = None  # a DTensor's: this rank's saved piece (`entry` is the whole tensor)

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
    # a DTensor's whole-tensor entry (a node's `entry`) -> every saved (rank, piece) of it
    assembled: Mapping[Entry, tuple[tuple[int, Entry], ...]] = dataclasses.field(default_factory=dict)

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
    wholes = _Wholes(tier, step, marker, manifests)
    children: list[Node] = []
    for k, node in zip(manifest.tree["k"], manifest.tree["v"], strict=True):
        if node["t"] != "replica":
            children.append(_node(node, manifest.entries, wholes))
            continue
        owner, held = replicas.resolve(k, node["r"], rank)
        r = _node(held, owner.entries, wholes)
        children.append(dataclasses.replace(r, replica_of=owner.rank))
    root = Node("dict", tuple(decode_key(k) for k in manifest.tree["k"]), tuple(children))
    files = shard_files(tier, step, manifests.values())  # the rule the opener applies
    metrics = dict(marker.metrics) if marker.metrics else None
    return StepView(
        tier, step, rank, marker.world_size, marker.checksum_algorithm, root, files, metrics, wholes.assembled
    )


class _Wholes:
    """The whole-tensor entries of DTensor pieces, and every saved rank's pieces of each
    (all ranks' manifests are read, into `manifests`, at the first piece that is not whole)."""

    def __init__(self, tier: Tier, step: int, marker: Any, manifests: dict[int, Manifest]) -> None:
        self.tier, self.step, self.marker, self.manifests = tier, step, marker, manifests
        self.assembled: dict[Entry, tuple[tuple[int, Entry], ...]] = {}
        self._index: dict[str, list[tuple[int, Entry]]] | None = None

    def whole(self, e: Entry) -> Entry:
        info = e.dtensor
        if info is None or tuple(info.global_shape) == tuple(e.shape):
            return e
        if self._index is None:
            for r in range(self.marker.world_size):
                if r not in self.manifests:
                    try:
                        self.manifests[r] = read_manifest(self.tier, self.step, r, self.marker)
                    except MissingManifestError:
                        raise CheckpointCorruptedError(
                            f"{self.tier.path_of(self.step)}: {e.path} is a DTensor saved as pieces, and rank "
                            f"{r}'s part (its manifest) is not on this tier ({self.tier.location}): the whole "
                            "tensor cannot be assembled here; read the step from a tier that holds every rank's "
                            "part (tier 2)"
                        ) from None
            index: dict[str, list[tuple[int, Entry]]] = {}
            for r, m in sorted(self.manifests.items()):
                for pe in m.entries:
                    if pe.dtensor is not None:
                        index.setdefault(pe.path, []).append((r, pe))
            self._index = index
        length = math.prod(info.global_shape) * TORCH_DTYPES[e.dtype].itemsize
        whole = dataclasses.replace(e, shape=tuple(info.global_shape), length=length)
        pieces = tuple(self._index.get(e.path, ()))
        check_pieces_agree(pieces, e, f"{self.tier.path_of(self.step)}: {e.path}")
        self.assembled[whole] = pieces
        return whole


def _node(node: JsonNode, entries: tuple[Entry, ...], wholes: _Wholes) -> Node:
    t = node["t"]
    if t in LEAF_KINDS:
        e = entries[node["e"]]
        whole = wholes.whole(e)
        return Node(t, entry=whole, piece=e if whole is not e else None)
    if t == "dict":
        return Node(t, tuple(decode_key(k) for k in node["k"]), tuple(_node(v, entries, wholes) for v in node["v"]))
    if t == "stateful":
        inner = _node(node["v"], entries, wholes)
        return Node(t, inner.keys, inner.children)
    if t in ("list", "tuple"):
        return Node(t, children=tuple(_node(v, entries, wholes) for v in node["v"]))
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
        self._last = LastBlocks()
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
        if entry in self._view.assembled:
            self._assemble(entry, self._view.assembled[entry], dest, sink, what)
            return
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

    def _assemble(
        self,
        entry: Entry,
        saved: tuple[tuple[int, Entry], ...],
        dest: memoryview | None,
        sink: Callable[[memoryview], None] | None,
        what: str,
    ) -> None:
        """The whole tensor of DTensor pieces, band of rows by band: each band planned from
        the saved pieces, its blocks read and verified, placed in the buffer (or `dest`)."""
        assert self._files is not None
        dtype = TORCH_DTYPES[entry.dtype]
        shape = entry.shape
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        if not entry.length:
            return
        band = max(1, CHUNK // row_bytes)
        pieces = pieces_of(saved, dtype.itemsize)
        by_piece = {id(p): pe for p, (_, pe) in zip(pieces, saved, strict=True)}
        for r0 in range(0, shape[0], band):
            rows = min(band, shape[0] - r0)
            n = rows * row_bytes
            if dest is not None:
                out = dest[r0 * row_bytes : r0 * row_bytes + n]
            else:  # a row longer than the buffer is its own band, in memory of its own
                out = self._buf[:n] if n <= len(self._buf) else memoryview(bytearray(n))
            target = torch.frombuffer(out, dtype=torch.uint8).view(dtype).reshape((rows, *shape[1:]))
            try:
                reads = plan_box(((r0, *(0 for _ in shape[1:])), (rows, *shape[1:])), pieces)
            except ValueError as exc:
                raise CheckpointCorruptedError(f"{self._view.path}: {what or entry.path}: {exc}") from None
            for rd in reads:
                pe = by_piece[id(rd.piece)]
                shard = self._view.tier.path_of(self._view.step, pe.file)
                where = f"{shard} ({what or entry.path}, saved rank {rd.piece.holder})"
                read_piece(self._files, self._view.checksum_algorithm, pe, rd, target, where, self._last)
            if sink is not None:
                sink(out)
            self.done += n
            if self._progress is not None:
                self._progress(self.done, self._total)
