"""Resharding plans (pure): which bytes of which saved pieces fill a box of a tensor.

A DTensor is saved as pieces, each an axis-aligned box of the global tensor (offsets,
sizes) stored row-major in its entry. A rank restoring at another mesh, placements or world
size holds another box (its local piece; the whole tensor for a plain template). For each
saved piece that intersects it, the plan reads the rows of the piece (along its first
dimension) that the intersection spans, widened to the piece's checksum blocks so every byte
read is verified, and copies the intersection from them. Pieces with the same box (a
Replicate placement) are read once, from the first holder. No rank plans for another: each
rank intersects its own boxes with the saved boxes, as DCP's load planner does, and the
cost is (saved pieces) x (own boxes) comparisons per tensor.

The reads of one box copy into disjoint parts of it (`plan_box` checks it), so they may run
on several threads at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Piece", "PieceRead", "box_volume", "intersect", "plan_box"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


@dataclass(frozen=True, slots=True)
class Piece:
    """A saved piece: who holds it, its box, and where its bytes are in that holder's entry."""

    holder: int  # the saved rank whose manifest lists it
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    itemsize: int
    block: int  # bytes per checksum block of its entry (0: one checksum for the whole entry)


@dataclass(frozen=True, slots=True)
class PieceRead:
    """Read bytes [start, end) of `piece`'s entry (whole blocks), view them as rows
    [row0, row0 + rows) of the piece, and copy `src` (slices of that view) into `dst`
    (slices of the destination box)."""

    piece: Piece
    start: int
    end: int
    row0: int
    rows: int
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def box_volume(sizes: Sequence[int]) -> int:
    return math.prod(sizes)


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or None when it is empty."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def plan_box(target: Box, pieces: Sequence[Piece]) -> list[PieceRead]:
    """The reads that fill box `target` from `pieces`, one per distinct saved box that
    intersects it.

    The reads' destinations are disjoint: the saved boxes' intersections with `target` are
    distinct and, along every dimension, span equal or disjoint ranges (the grid that Shard
    and Replicate placements cut, evenly or not), so two of them are apart along at least one
    dimension; with their volumes summing to the target's, they cover it exactly once.

    Raises:
        ValueError: the pieces do not cover `target` exactly once (overlapping distinct
            boxes, or a hole): the checkpoint cannot fill this box.
    """
    seen: set[Box] = set()
    reads: list[PieceRead] = []
    covered = 0
    spans: list[set[tuple[int, int]]] = [set() for _ in target[1]]
    placed: set[Box] = set()
    repeated = False
    for p in pieces:
        box = (p.offsets, p.sizes)
        if box in seen:
            continue  # a replica of a box already planned
        seen.add(box)
        common = intersect(target, box)
        if common is None:
            continue
        offs, sizes = common
        covered += box_volume(sizes)
        repeated = repeated or common in placed
        placed.add(common)
        for dim, o, sz in zip(spans, offs, sizes, strict=True):
            dim.add((o, o + sz))
        rel = [o - po for o, po in zip(offs, p.offsets, strict=True)]
        row_bytes = box_volume(p.sizes[1:]) * p.itemsize if p.sizes else p.itemsize
        if not p.sizes:  # 0-d: the single element
            reads.append(PieceRead(p, 0, _round_up(p.itemsize, p), 0, 1, (), ()))
            continue
        row0, rows = rel[0], sizes[0]
        first, last = row0 * row_bytes, (row0 + rows) * row_bytes
        length = box_volume(p.sizes) * p.itemsize
        start, end = (0, length) if p.block <= 0 else (first - first % p.block, min(length, _round_up(last, p)))
        src = (slice(0, rows), *(slice(r, r + s) for r, s in zip(rel[1:], sizes[1:], strict=True)))
        dst = tuple(slice(o - to, o - to + s) for o, to, s in zip(offs, target[0], sizes, strict=True))
        reads.append(PieceRead(p, start, end, row0, rows, src, dst))
    if repeated or covered != box_volume(target[1]) or not all(_apart(dim) for dim in spans):
        raise ValueError(
            f"the saved pieces cover {covered} of the {box_volume(target[1])} elements of box "
            f"offsets={list(target[0])} sizes={list(target[1])} (overlapping or missing pieces)"
        )
    return reads


def _apart(spans: set[tuple[int, int]]) -> bool:
    """Whether distinct ranges [lo, hi) are pairwise disjoint."""
    ordered = sorted(spans)
    return all(a[1] <= b[0] for a, b in itertools.pairwise(ordered))


def _round_up(n: int, p: Piece) -> int:
    return n if p.block <= 0 else -(-n // p.block) * p.block
