"""`tiercheck inspect`: what a step holds, from its manifests alone (no shard byte is read).

`describe_step` returns a JSON-ready document; `render` turns it into the indented text
the command prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..errors import NoCheckpointError
from ..format.manifest import Entry
from ..observe.progress import format_bytes
from ..tiers.base import Tier
from .view import LEAF_KINDS, PLAIN_KINDS, KeyPath, Node, StepView, open_view, walk

__all__ = ["describe_step", "render"]

LIST_ITEMS_SHOWN = 8  # children of a long list or tuple shown in the text form
VALUE_CHARS = 60  # a plain value longer than this is cut in the text form


def describe_step(tiers: Sequence[Tier], step: int | None = None, rank: int = 0) -> dict[str, Any]:
    """Describe `step` (newest committed on any of `tiers` by default) as the first tier
    holding it records it.

    Returns:
        A JSON-ready dict: ``step``, ``rank``, ``world_size``, ``checksum_algorithm``,
        ``path``, ``tiers`` (each given tier and whether the step is committed there),
        ``metrics`` (those saved with the step, or None), ``files``, ``bytes`` and ``leaves``
        (totals; tied tensors counted once), ``keys`` (totals per top-level key) and
        ``nodes``: every value in depth-first order with its ``path`` (a list of keys, ints
        kept as ints) and ``kind``; leaves add ``dtype``, ``shape``, ``bytes``, ``file``,
        ``offset`` (and ``alias_of``, the path of the first leaf with the same bytes, for
        tied tensors; for a DTensor, ``shape`` and ``bytes`` are the whole tensor's, and
        ``dtensor`` holds ``mesh``, ``dims``, ``placements``, this rank's ``coordinate``, and
        its piece's ``piece_shape``, ``offsets`` and ``piece_bytes``); plain values add
        ``value`` (a float that is not finite as the string ``"nan"``, ``"inf"`` or
        ``"-inf"``); containers add ``length``.

    Raises:
        NoCheckpointError: nothing committed (or not `step`, or no rank `rank`).
        CheckpointCorruptedError: the marker or a manifest fails verification.
    """
    committed = {id(t): set(t.committed_steps()) for t in tiers}
    if step is None:
        every = set().union(*committed.values())
        if not every:
            raise NoCheckpointError(f"no committed step at {', '.join(t.location for t in tiers)}")
        step = max(every)
    holder = next((t for t in tiers if step in committed[id(t)]), None)
    if holder is None:
        steps = sorted(set().union(*committed.values()))
        raise NoCheckpointError(
            f"step {step} is not committed at {', '.join(t.location for t in tiers)}; committed: {steps}"
        )
    view = open_view(holder, step, rank)
    nodes = [_node_doc(path, node) for path, node in walk(view.root) if path]
    first: dict[tuple[str, int, int], list[object]] = {}
    for n in nodes:  # tied tensors: the later ones name the first
        if "file" in n and n["bytes"]:
            region = (n["file"], n["offset"], n["bytes"])
            if region in first:
                n["alias_of"] = first[region]
            else:
                first[region] = n["path"]
    return {
        "step": view.step,
        "rank": view.rank,
        "world_size": view.world_size,
        "checksum_algorithm": view.checksum_algorithm,
        "location": holder.location,
        "path": view.path,
        "tiers": [{"name": t.name, "location": t.location, "committed": step in committed[id(t)]} for t in tiers],
        "metrics": step_metrics(view),
        "files": [
            {"name": f.name, "length": f.length, "codec": f.codec, "stored_length": f.size_on_tier} for f in view.files
        ],
        "bytes": _unique_bytes(view.root),
        "leaves": sum(1 for _, n in walk(view.root) if n.kind in LEAF_KINDS),
        "keys": [
            {
                "key": k,
                "kind": child.kind,
                "bytes": _unique_bytes(child),
                "leaves": sum(1 for _, n in walk(child) if n.kind in LEAF_KINDS),
                **({"replica_of": child.replica_of} if child.replica_of is not None else {}),
            }
            for k, child in view.root.items()
        ],
        "nodes": nodes,
    }


def step_metrics(view: StepView) -> dict[str, Any] | None:
    """The metrics saved with the step (`save(..., metrics=)`, in its commit marker), JSON-ready;
    None when it has none."""
    return None if view.metrics is None else {k: _json_value(v) for k, v in view.metrics.items()}


def _unique_bytes(node: Node) -> int:
    regions = {(e.file, e.offset, e.length) for e in _entries(node)}
    return sum(length for _, _, length in regions)


def _entries(node: Node) -> list[Entry]:
    return [n.entry for _, n in walk(node) if n.entry is not None]


def _node_doc(path: KeyPath, node: Node) -> dict[str, Any]:
    doc: dict[str, Any] = {"path": list(path), "kind": node.kind}
    if node.entry is not None:
        e = node.entry
        doc.update(dtype=e.dtype, shape=list(e.shape), bytes=e.length, file=e.file, offset=e.offset)
        if e.dtensor is not None:
            info, piece = e.dtensor, node.piece or e
            doc["dtensor"] = {
                "mesh": list(info.mesh),
                "dims": list(info.dims),
                "placements": list(info.placements),
                "coordinate": list(info.coordinate),
                "piece_shape": list(piece.shape),
                "offsets": list(info.offsets),
                "piece_bytes": piece.length,
            }
    elif node.kind in PLAIN_KINDS:
        doc["value"] = _json_value(node.value)
    else:
        doc["length"] = len(node.children)
    if node.replica_of is not None:
        doc["replica_of"] = node.replica_of
    return doc


def _json_value(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan", "inf", "-inf": JSON has no literal for them
    return value


# ------------------------------------------------------------------------------ text


def render(doc: dict[str, Any]) -> str:
    """The text form of a `describe_step` document."""
    lines = [
        f"step {doc['step']}  rank {doc['rank']} of {doc['world_size']}  {doc['checksum_algorithm']}  {doc['path']}",
        "tiers: "
        + ", ".join(
            f"{t['name']} {t['location']} ({'committed' if t['committed'] else 'absent'})" for t in doc["tiers"]
        ),
    ]
    if doc["metrics"] is not None:
        lines.append("metrics: " + ", ".join(f"{k}={v}" for k, v in doc["metrics"].items()))
    lines.append(f"total: {format_bytes(doc['bytes'])} in {doc['leaves']} leaves")
    lines.append("")
    totals = {_key_text(k["key"]): k for k in doc["keys"]}
    nodes = doc["nodes"]
    by_path: dict[tuple[object, ...], dict[str, Any]] = {tuple(n["path"]): n for n in nodes}
    children: dict[tuple[object, ...], list[dict[str, Any]]] = {}
    for n in nodes:
        children.setdefault(tuple(n["path"])[:-1], []).append(n)
    rows: list[tuple[str, str]] = []
    skipped: set[tuple[object, ...]] = set()  # subtrees not printed line by line
    for n in nodes:
        path = tuple(n["path"])
        parent = path[:-1]
        if any(path[:i] in skipped for i in range(1, len(path))):
            continue
        indent = "  " * (len(path) - 1)
        if parent in by_path and by_path[parent]["kind"] in ("list", "tuple") and path[-1] == LIST_ITEMS_SHOWN:
            rows.append((f"{indent}... {by_path[parent]['length'] - LIST_ITEMS_SHOWN} more items", ""))
        if parent in by_path and by_path[parent]["kind"] in ("list", "tuple") and path[-1] >= LIST_ITEMS_SHOWN:
            skipped.add(path)
            continue
        kids = children.get(path, [])
        if n["kind"] in ("list", "tuple") and kids and all(k["kind"] in PLAIN_KINDS for k in kids):
            skipped.add(path)  # a list of plain values is shown on one line
            open_, close = ("[", "]") if n["kind"] == "list" else ("(", ",)" if len(kids) == 1 else ")")
            inline = open_ + ", ".join(_plain_text(k) for k in kids) + close
            rows.append((indent + _key_text(path[-1]), f"{n['kind']} = {_cut(inline)}"))
            continue
        rows.append((indent + _key_text(path[-1]), _describe_node(n, totals if len(path) == 1 else None)))
    width = min(max((len(a) for a, _ in rows), default=0), 48)
    lines.extend(f"{a:<{width}}  {b}".rstrip() for a, b in rows)
    return "\n".join(lines) + "\n"


def _plain_text(n: dict[str, Any]) -> str:
    value = n["value"]
    return value if n["kind"] == "float" and isinstance(value, str) else repr(value)


def _describe_node(n: dict[str, Any], totals: dict[str, dict[str, Any]] | None) -> str:
    kind = n["kind"]
    if "dtype" in n:
        shape = "[" + ", ".join(map(str, n["shape"])) + "]"
        text = f"{kind} {n['dtype']} {shape}  {format_bytes(n['bytes'])}"
        if "dtensor" in n:
            d = n["dtensor"]
            mesh = "x".join(map(str, d["mesh"]))
            piece = "[" + ", ".join(map(str, d["piece_shape"])) + "]"
            at = "[" + ", ".join(map(str, d["offsets"])) + "]"
            text += f"  (DTensor: mesh {mesh} [{', '.join(d['placements'])}]; this rank's piece {piece} at {at})"
        if "alias_of" in n:
            text += "  (same bytes as " + ".".join(map(str, n["alias_of"])) + ")"
    elif "value" in n:
        text = "= " + _cut(_plain_text(n))
    else:
        text = f"{kind}, {n['length']} {'keys' if kind in ('dict', 'stateful') else 'items'}"
        if totals is not None:
            t = totals[_key_text(n["path"][-1])]
            text += f"  {format_bytes(t['bytes'])} in {t['leaves']} leaves"
    if "replica_of" in n:
        text += f"  (replicated: stored by rank {n['replica_of']})"
    return text


def _key_text(k: object) -> str:
    # A str key that reads like an int is quoted so it is told apart from an int key.
    if isinstance(k, str):
        return repr(k) if k.lstrip("-").isdigit() or not k or k != k.strip() else k
    return str(k)


def _cut(text: str) -> str:
    return text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 3] + "..."
