"""Restore at another layout: DTensor pieces saved by other ranks read into this rank's boxes,
and the rule for per-rank values at another world size.

`Resharder` takes over the entries of DTensor leaves (`format.tree.DTensorInfo`) that the
template holds at another layout than the saved piece of this rank: a DTensor of another
mesh or placements, a plain tensor (which gets the whole tensor), or nothing (`load`: the
whole tensor). For each, it collects the saved pieces of that key from every saved rank's
manifest (read from this rank's tier where it holds that rank's part, else from the next
tier that does: a node-local tier 1 has only its node's ranks), plans the reads
(`plan.reshard`), reads only those bytes through the one shard opener, checks every
checksum block they span, and copies the intersections into place. When every shard read is
a positional read of a local file, the reads run on `catalog.READERS` threads, each block
hashed right after it is read, and a read whose rows are one contiguous range of the
template lands there directly (`_Job`); otherwise (tier 2, zstd) one after another. A piece
whose block does not verify fails the step on this tier (`CheckpointCorruptedError`): the
restore then tries the next tier, then an older step, as for any damaged step; as for any
failed read, the template's tensors may then hold partial data.

Resharding never guesses: a template whose global shape or dtype differs from the saved
tensor's is a `StateMismatchError` naming the key.

Per-rank values at another world size (`consistent_keys`): a top-level key that every saved
rank holds with the same bytes (plain values and checksums equal; DTensor pieces of one
global tensor) restores on every new rank; one whose ranks differ (RNG states, a data-loader
position) cannot be resharded implicitly.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CheckpointCorruptedError, NoCheckpointError, StateMismatchError
from ..format.checksum import checksum_function
from ..format.dtypes import TORCH_DTYPES
from ..format.manifest import Entry, Manifest, Marker
from ..format.tree import JsonNode
from ..plan.reshard import Piece, PieceRead, plan_box
from ..tiers.base import Tier
from .catalog import READERS, MissingManifestError, ShardFiles, in_order, read_manifest, read_marker

__all__ = [
    "LastBlocks",
    "Resharder",
    "check_pieces_agree",
    "consistent_keys",
    "pieces_of",
    "read_piece",
    "template_box",
]

Producer = Callable[[], object]

MANIFEST_READERS = 8  # threads reading the saved ranks' manifests at once (`Resharder.sources`)


def template_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor] | None:
    """(offsets, sizes, local piece) of a DTensor template; None for any other tensor."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    if not isinstance(t, DTensor):
        return None
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if tuple(local.shape) != tuple(shape):
        return None  # a layout the box model cannot express (padded): the caller refuses it
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape), local


class _Source:
    """One saved rank's part: the tier it is read from and its verified manifest."""

    def __init__(self, tier: Tier, manifest: Manifest) -> None:
        self.tier = tier
        self.manifest = manifest
        self.files: ShardFiles | None = None


class Resharder:
    """Fills template tensors from the saved pieces of DTensor entries.

    Args:
        tiers: this rank's tier first, then the tiers to read other ranks' parts from.
        step: the step restored.
        marker: the step's commit marker on `tiers[0]`.
        rank, world_size: this rank and this job's size.
    """

    def __init__(self, tiers: Sequence[Tier], step: int, marker: Marker, rank: int, world_size: int | None) -> None:
        self._tiers = list(tiers)
        self.step = step
        self.marker = marker
        self.rank = rank
        self.world_size = world_size
        self._sources: dict[int, _Source] | None = None
        self._by_path: dict[str, list[tuple[int, Entry]]] | None = None
        self._fills: list[tuple[str, torch.Tensor, tuple[tuple[int, ...], tuple[int, ...]], Entry]] = []

    # -- what is read from where -------------------------------------------------------

    def sources(self) -> dict[int, _Source]:
        """Every saved rank's part, each from the first tier that holds it (verified against
        that tier's own marker: a tier-2 part may differ from the tier-1 one).

        The manifests are read on up to `MANIFEST_READERS` threads: from an object store each
        is a request of tens of milliseconds, and a new rank reads all W of them (at W = 1,000
        one after another, ~30 s). Each tier's marker is read once. The first failure, in
        rank order, is raised as a serial read would raise it."""
        if self._sources is None:
            markers: dict[int, Marker | None] = {0: self.marker}
            lock = threading.Lock()

            def marker_of(i: int) -> Marker | None:
                with lock:  # each tier's marker once, whichever rank asks first
                    if i not in markers:
                        try:
                            markers[i] = read_marker(self._tiers[i], self.step)
                        except (NoCheckpointError, FileNotFoundError):
                            markers[i] = None  # this tier does not hold the step
                    return markers[i]

            def find(r: int) -> _Source:
                for i, tier in enumerate(self._tiers):
                    marker = marker_of(i)
                    if marker is None:
                        continue
                    try:
                        return _Source(tier, read_manifest(tier, self.step, r, marker))
                    except (MissingManifestError, NoCheckpointError, FileNotFoundError):
                        continue
                raise CheckpointCorruptedError(
                    f"step {self.step}: no tier of this rank holds saved rank {r}'s part "
                    f"({', '.join(f'{t.name}={t.location}' for t in self._tiers)})"
                )

            ranks = range(self.marker.world_size)
            threads = min(MANIFEST_READERS, len(ranks))
            if threads > 1:
                read = in_order(find, ((r,) for r in ranks), threads, "tiercheck-manifests")
                found = dict(zip(ranks, read, strict=True))
            else:
                found = {r: find(r) for r in ranks}
            self._sources = found
        return self._sources

    def all_manifests(self) -> list[Manifest]:
        return [s.manifest for _, s in sorted(self.sources().items())]

    def _pieces(self, path: str) -> list[tuple[int, Entry]]:
        if self._by_path is None:
            index: dict[str, list[tuple[int, Entry]]] = {}
            for r, src in sorted(self.sources().items()):
                for e in src.manifest.entries:
                    if e.dtensor is not None:
                        index.setdefault(e.path, []).append((r, e))
            self._by_path = index
        return self._by_path.get(path, [])

    # -- binding (before any byte is read) ------------------------------------------------

    def wants(self, tmpl: object, e: Entry, own: bool) -> bool:
        """Whether `e` (a leaf of the reference manifest bound to `tmpl`) must be resharded:
        its piece is not what `tmpl` holds here."""
        info = e.dtensor
        if info is None:
            return False
        if isinstance(tmpl, torch.Tensor):
            box = template_box(tmpl)
            if box is not None:
                same = own and tuple(tmpl.shape) == info.global_shape and box[:2] == (info.offsets, e.shape)
                return not same
        return tuple(info.global_shape) != tuple(e.shape)  # a plain template (or none): the whole tensor

    def bind(self, tmpl: object, e: Entry, path: str, fill: bool) -> Producer:
        """Plan `tmpl`'s fill from the pieces of `e`'s tensor; returns what the leaf becomes."""
        info = e.dtensor
        assert info is not None
        dtype = TORCH_DTYPES[e.dtype]
        shape = tuple(info.global_shape)

        def mismatch(what: str) -> StateMismatchError:
            return StateMismatchError(
                f"{path}: {what}; the checkpoint (step {self.step}) holds a {dtype} tensor of global shape "
                f"{list(shape)}, saved as pieces ({'x'.join(map(str, info.mesh))} mesh, {info.placements}). "
                "Resharding never guesses: give a template of that global shape and dtype"
            )

        if isinstance(tmpl, torch.Tensor) and tmpl.device.type != "meta":
            if tuple(tmpl.shape) != shape or tmpl.dtype != dtype:
                raise mismatch(f"the template is {tmpl.dtype} of global shape {list(tmpl.shape)}")
            box = template_box(tmpl)
            if box is None and type(tmpl) not in (torch.Tensor, torch.nn.Parameter):
                raise mismatch("the template DTensor's local piece is not a box of it (an uneven, padded layout)")
            if box is not None:
                offsets, sizes, local = box
                self._fills.append((path, local, (offsets, sizes), e))
            else:
                self._fills.append((path, tmpl, (tuple(0 for _ in shape), shape), e))
            return lambda: tmpl
        if fill and tmpl is not None and not (isinstance(tmpl, torch.Tensor) and tmpl.device.type == "meta"):
            raise mismatch(f"the template holds a {type(tmpl).__name__}")
        fresh = torch.empty(shape, dtype=dtype)
        self._fills.append((path, fresh, (tuple(0 for _ in shape), shape), e))
        return lambda: fresh

    # -- reading (after every binding check passed) ---------------------------------------

    def read_all(self) -> None:
        """Read, verify and place every planned fill: every fill planned first, then the
        reads in plan order, on several threads where every shard read allows it."""
        if not self._fills:
            return
        try:
            reads = [
                (path, dest, *planned)
                for path, dest, box, e in self._fills
                for planned in self._plan(path, dest, box, e)
            ]
            dests = [dest for _, dest, _, _ in self._fills]
            if READERS > 1 and _apart(dests) and all(self._concurrent(r, pe) for _, _, _, r, pe in reads):
                jobs = [job for read in reads for job in self._jobs(*read)]
                if len(jobs) > 1:
                    _run_parallel(jobs)
                    return
            for path, dest, rd, r, pe in reads:
                self._read_piece(path, dest, rd, r, pe)
        finally:
            for src in (self._sources or {}).values():
                if src.files is not None:
                    src.files.close()
                    src.files = None

    def _plan(
        self, path: str, dest: torch.Tensor, box: tuple[tuple[int, ...], tuple[int, ...]], e: Entry
    ) -> list[tuple[PieceRead, int, Entry]]:
        """The reads that fill `dest` (box `box` of `path`'s tensor): (read, saved rank, its entry)."""
        pieces = self._pieces(path) or [(self.rank, e)]
        check_pieces_agree(pieces, e, f"step {self.step}: {path}")
        plan_input = pieces_of(pieces, dest.element_size())
        by_piece = {id(p): saved for p, saved in zip(plan_input, pieces, strict=True)}
        try:
            reads = plan_box(box, plan_input)
        except ValueError as exc:
            raise CheckpointCorruptedError(f"step {self.step}: {path}: {exc}") from None
        return [(rd, *by_piece[id(rd.piece)]) for rd in reads]

    def _files(self, r: int) -> _Source:
        src = self.sources()[r]
        if src.files is None:
            src.files = ShardFiles(src.tier, self.step, src.manifest.files)
        return src

    def _concurrent(self, r: int, e: Entry) -> bool:
        files = self._files(r).files
        assert files is not None
        return files.concurrent(e.file)

    def _where(self, path: str, r: int, e: Entry) -> str:
        return f"{self.sources()[r].tier.path_of(self.step, e.file)} ({path}, saved rank {r})"

    def _read_piece(self, path: str, dest: torch.Tensor, rd: PieceRead, r: int, e: Entry) -> None:
        src = self._files(r)
        assert src.files is not None
        read_piece(src.files, src.manifest.checksum_algorithm, e, rd, dest, self._where(path, r, e))

    def _jobs(self, path: str, dest: torch.Tensor, rd: PieceRead, r: int, e: Entry) -> list[_Job]:
        """`rd` as reader threads' jobs: its blocks in runs of about `_JOB_BYTES` when it
        lands in the template directly, else one job through a buffer."""
        src = self._files(r)
        assert src.files is not None
        blocks = _blocks(e, rd)
        region = _region(dest, rd)
        runs = [blocks] if region is None else _runs(blocks)
        where = self._where(path, r, e)
        return [_Job(src.files, src.manifest.checksum_algorithm, e, rd, dest, where, region, run) for run in runs]


class LastBlocks:
    """The last checksum block read of each saved piece, so that a read of the next rows of
    that piece which starts inside it (row bands that split a block: `tiercheck export`)
    does not read behind the shard's position (a zstd shard would decompress again from
    its start)."""

    def __init__(self) -> None:
        self._last: dict[tuple[int, str], tuple[int, bytes]] = {}

    def take(self, holder: int, file: str, offset: int, buf: memoryview) -> int:
        """Copy the remembered block into `buf` if it is the one at `offset`; its length, or 0."""
        held = self._last.get((holder, file))
        if held is None or held[0] != offset or len(held[1]) > len(buf):
            return 0
        buf[: len(held[1])] = held[1]
        return len(held[1])

    def keep(self, holder: int, file: str, offset: int, data: memoryview) -> None:
        self._last[(holder, file)] = (offset, bytes(data))


def read_piece(
    files: ShardFiles,
    algorithm: str,
    e: Entry,
    rd: PieceRead,
    dest: torch.Tensor,
    where: str,
    last: LastBlocks | None = None,
) -> None:
    """Read the whole blocks `rd` spans of saved piece `e` (through `files`), verify each
    against its digest (the entry's checksum for a piece without blocks), and copy `rd`'s
    intersection into `dest`.

    Raises:
        CheckpointCorruptedError: a block (or the piece) differs from its digest; `where`
            names it.
    """
    info = e.dtensor
    assert info is not None
    buf = torch.empty(rd.end - rd.start, dtype=torch.uint8)  # every byte is read or taken below
    view = _bytes(buf)
    reused = 0
    if last is not None and rd.piece.block:
        reused = last.take(rd.piece.holder, e.file, e.offset + rd.start, view)
    if reused < len(buf):
        files.read_into(e.file, e.offset + rd.start + reused, view[reused:])
    digest = checksum_function(algorithm)
    if rd.piece.block:
        first = rd.start // info.block
        for k in range(first, first + -(-(rd.end - rd.start) // info.block)):
            lo = k * info.block - rd.start
            chunk = view[lo : min(len(buf), lo + info.block)]
            if k >= len(info.blocks) or digest(chunk) != info.blocks[k]:
                raise CheckpointCorruptedError(f"{where}: checksum mismatch in block {k} of this piece")
        if last is not None and len(view):
            lo = (rd.end - 1) // info.block * info.block - rd.start
            last.keep(rd.piece.holder, e.file, e.offset + rd.start + lo, view[lo:])
    elif digest(view) != e.checksum:
        raise CheckpointCorruptedError(f"{where}: checksum mismatch")
    _place(rd, buf, dest)


def _place(rd: PieceRead, buf: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy `rd`'s intersection from `buf` (bytes [rd.start, rd.end) of its piece) into `dest`."""
    row_bytes = rd.piece.itemsize * math.prod(rd.piece.sizes[1:])
    lo = rd.row0 * row_bytes - rd.start if rd.piece.sizes else 0
    raw = buf[lo : lo + rd.rows * row_bytes if rd.piece.sizes else None]
    rows = raw.view(dest.dtype).reshape((rd.rows, *rd.piece.sizes[1:]) if rd.piece.sizes else ())
    with torch.no_grad():
        target, part = dest[rd.dst], rows[rd.src]
        same = _SAME_SIZE_INT.get(target.element_size())
        if same is not None and target.device.type == "cpu" and not (target.is_conj() or target.is_neg()):
            # the bits as integers, copied by numpy on this thread: torch's copy_ spreads a
            # large copy over its intra-op threads, which wait for each other on a host whose
            # cores are busy (16 strided copies of 4 MiB: 8 ms with numpy, 120 ms with copy_
            # on the caller's thread, on 2 cores that other processes kept busy)
            np.copyto(target.detach().view(same).numpy(), part.view(same).numpy())
        else:
            target.copy_(part)


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_Block = tuple[int | None, int, int]  # (block number, None: the piece's one checksum; its bytes [start, end))


@dataclass(frozen=True, slots=True)
class _Job:
    """Blocks `blocks` of read `rd` for one reader thread. With `region` (the bytes of
    `dest[rd.dst]`, exactly rows [rd.row0, rd.row0 + rd.rows) of the piece: whole rows into a
    contiguous part of a CPU template) a block inside those rows is read into it and verified
    there, a block that sticks out (the first and last of an unaligned band) through a
    buffer of one block; without, all of `rd` is read into a buffer and its intersection
    copied (`_place`)."""

    files: ShardFiles
    algorithm: str
    entry: Entry
    rd: PieceRead
    dest: torch.Tensor
    where: str
    region: memoryview | None
    blocks: list[_Block]


def _blocks(e: Entry, rd: PieceRead) -> list[_Block]:
    """The checksum blocks `rd` spans, as `read_piece` checks them."""
    info = e.dtensor
    assert info is not None
    if not rd.piece.block:
        return [(None, rd.start, rd.end)]
    first = rd.start // info.block
    count = -(-(rd.end - rd.start) // info.block)
    return [(k, k * info.block, min(rd.end, (k + 1) * info.block)) for k in range(first, first + count)]


def _runs(blocks: list[_Block]) -> list[list[_Block]]:
    """`blocks` cut into runs of about `_JOB_BYTES` (at least one block each)."""
    runs: list[list[_Block]] = [[]]
    size = 0
    for b in blocks:
        if runs[-1] and size + b[2] - b[1] > _JOB_BYTES:
            runs.append([])
            size = 0
        runs[-1].append(b)
        size += b[2] - b[1]
    return runs


def _region(dest: torch.Tensor, rd: PieceRead) -> memoryview | None:
    """The bytes of `dest[rd.dst]` when they are exactly rows [rd.row0, rd.row0 + rd.rows)
    of `rd`'s piece (whole rows into a contiguous part of a CPU tensor); else None."""
    sizes = rd.piece.sizes
    if not sizes or dest.device.type != "cpu" or dest.element_size() != rd.piece.itemsize:
        return None
    if any(s != slice(0, n) for s, n in zip(rd.src[1:], sizes[1:], strict=True)):
        return None  # part of each row: not one range of the piece
    part = dest[rd.dst]
    if not part.is_contiguous() or part.is_conj() or part.is_neg() or part.numel() == 0:
        return None
    return _bytes(part.detach().reshape(-1).view(torch.uint8))


def _apart(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two of `tensors` share memory: the reads of one fill go to disjoint parts of
    it (`plan_box`), those of two fills only if their tensors are apart (tied or overlapping
    template views are filled one read after another, the last one winning as ever)."""
    spans = []
    for t in tensors:
        if t.numel():
            extent = (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()
            spans.append((str(t.device), t.data_ptr(), t.data_ptr() + extent))
    spans.sort()
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in itertools.pairwise(spans))


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable view of the memory of a contiguous uint8 CPU tensor."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


def _check(job: _Job, k: int | None, view: memoryview) -> None:
    info = job.entry.dtensor
    assert info is not None
    digest = checksum_function(job.algorithm)
    if k is None:
        if digest(view) != job.entry.checksum:
            raise CheckpointCorruptedError(f"{job.where}: checksum mismatch")
    elif k >= len(info.blocks) or digest(view) != info.blocks[k]:
        raise CheckpointCorruptedError(f"{job.where}: checksum mismatch in block {k} of this piece")


def _run_job(job: _Job) -> None:
    """Read, verify and place `job`'s blocks, each hashed right after its read (in cache)."""
    e, rd = job.entry, job.rd
    if job.region is None:
        buf = _scratch(rd.end - rd.start)
        view = _bytes(buf)
        for k, lo, hi in job.blocks:
            chunk = view[lo - rd.start : hi - rd.start]
            job.files.read_into(e.file, e.offset + lo, chunk)
            _check(job, k, chunk)
        _place(rd, buf, job.dest)
        return
    first = rd.row0 * rd.piece.itemsize * math.prod(rd.piece.sizes[1:])  # the region's first byte in the piece
    last = first + len(job.region)
    for k, lo, hi in job.blocks:
        if first <= lo and hi <= last:
            chunk = job.region[lo - first : hi - first]
            job.files.read_into(e.file, e.offset + lo, chunk)
            _check(job, k, chunk)
        else:
            edge = _bytes(_scratch(hi - lo))
            job.files.read_into(e.file, e.offset + lo, edge)
            _check(job, k, edge)
            a, b = max(lo, first), min(hi, last)
            job.region[a - first : b - first] = edge[a - lo : b - lo]


def _scratch(n: int) -> torch.Tensor:
    """`n` bytes of this reader thread's buffer, grown as needed: a fresh buffer per read
    cost its page faults each time (a 16 MiB piece read 4x by each of 4 ranks took 0.48 s
    with a buffer per read, 0.29 s with one per thread)."""
    held: torch.Tensor | None = getattr(_SCRATCH, "buf", None)
    if held is None or held.numel() < n:
        held = _SCRATCH.buf = torch.empty(n, dtype=torch.uint8)
    return held[:n]


def _run_parallel(jobs: Sequence[_Job]) -> None:
    """`_run_job` of every job on `READERS` threads (`catalog.in_order`), at most twice as many
    submitted and not yet done (each thread's buffer, the size of its largest read, ends with the pool); the
    first failure in plan order is raised here, after what had not started is cancelled and
    what had has ended, so no thread writes into the template afterwards. The jobs'
    destinations are disjoint (`plan_box`), so their copies need no lock."""
    for _ in in_order(_run_job, ((job,) for job in jobs), READERS, "tiercheck-reshard"):
        pass


_SCRATCH = threading.local()  # each reader thread's buffer (`_scratch`)
_JOB_BYTES = 4 << 20  # bytes of blocks one job reads straight into the template, about


def check_pieces_agree(pieces: Sequence[tuple[int, Entry]], e: Entry, where: str) -> None:
    """Raise CheckpointCorruptedError (prefixed `where`) unless every saved piece of a DTensor
    has entry `e`'s dtype and global shape: the one rule restore and the tools apply."""
    ref = e.dtensor
    assert ref is not None
    for r, pe in pieces:
        info = pe.dtensor
        assert info is not None
        if pe.dtype != e.dtype or tuple(info.global_shape) != tuple(ref.global_shape):
            raise CheckpointCorruptedError(
                f"{where}: saved rank {r}'s piece is {pe.dtype} of global shape "
                f"{list(info.global_shape)}, another rank's says {e.dtype} {list(ref.global_shape)}"
            )


def pieces_of(saved: Sequence[tuple[int, Entry]], itemsize: int) -> list[Piece]:
    """The `Piece`s of (saved rank, DTensor entry) pairs, in that order."""
    out = []
    for r, e in saved:
        info = e.dtensor
        assert info is not None
        out.append(Piece(r, tuple(info.offsets), tuple(e.shape), itemsize, info.block if info.blocks else 0))
    return out


def _fingerprint(node: JsonNode, entries: Sequence[Entry]) -> object:
    """What must be equal on every saved rank for a per-rank value to restore anywhere."""
    t = node["t"]
    if t in ("tensor", "ndarray", "npscalar", "bytes"):
        e = entries[node["e"]]
        if e.dtensor is not None:  # one global tensor, a piece per rank: equal by its metadata
            info = e.dtensor
            return ("dtensor", e.dtype, tuple(info.global_shape), tuple(info.mesh), tuple(info.placements))
        return (t, e.dtype, tuple(e.shape), e.checksum)
    if t == "dict":
        return ("dict", tuple(tuple(k) for k in node["k"]), tuple(_fingerprint(v, entries) for v in node["v"]))
    if t == "stateful":
        return ("stateful", _fingerprint(node["v"], entries))
    if t in ("list", "tuple"):
        return (t, tuple(_fingerprint(v, entries) for v in node["v"]))
    if t == "replica":
        return ("replica",)
    return (t, str(node.get("v")))


def consistent_keys(manifests: Sequence[Manifest]) -> set[tuple[str, ...]]:
    """The top-level keys (encoded) every saved rank holds alike."""
    ref = manifests[0]
    same: set[tuple[str, ...]] = set()
    views = [dict(zip((tuple(k) for k in m.tree["k"]), m.tree["v"], strict=True)) for m in manifests]
    for k in ref.tree["k"]:
        key = tuple(k)
        prints = {_fingerprint(v[key], m.entries) if key in v else None for v, m in zip(views, manifests, strict=True)}
        if len(prints) == 1 and None not in prints:
            same.add(key)
    return same
