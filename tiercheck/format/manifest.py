"""The manifest and commit-marker schema: build, serialise, and strictly validate (pure).

Every parse error, whatever its cause, surfaces as `CheckpointCorruptedError`: a
manifest is untrusted input. Nothing here executes code, and parsing allocates a bounded
multiple of the bytes it was given (see `decode_manifest`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import operator
import re
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from ..errors import CheckpointCorruptedError, UnsupportedStateError
from ..observe.collector import collector_paused
from . import naming
from .checksum import DIGEST_WIDTH
from .dtypes import itemsize
from .tree import DTensorInfo, JsonNode, Leaf, block_count

FORMAT = "tiercheck"
VERSION = 2  # what writers write; docs/format.md, Versioning
READ_VERSIONS = (1, 2)  # what readers accept
MAX_DEPTH = 256  # tree levels; the reader's recursion stays well inside Python's limit
MAX_NDIM = 64
# The largest manifest a writer produces or a reader parses; docs/format.md (Limits) says why.
MAX_MANIFEST_BYTES = 256 << 20
# JSON arrays outside strings: writers put at most one in ~13 bytes (an empty dict node has
# two in 27), so denser documents are refused before parsing; each array costs ~64 bytes.
MIN_BYTES_PER_ARRAY = 8
_NODE_TYPES = frozenset(
    {"dict", "list", "tuple", "none", "bool", "int", "float", "str", "tensor", "ndarray",
     "npscalar", "bytes", "stateful", "replica"}
)  # fmt: skip
LEAF_NODE_TYPES = frozenset({"tensor", "ndarray", "npscalar", "bytes"})  # tree nodes that name an entry
_MAX_INT_DIGITS = 4300  # Python's default int-from-str limit
MAX_METRIC_NAME = 256


@dataclass(frozen=True, slots=True)
class Entry:
    """One leaf's bytes in a shard file."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    checksum: str
    codec: str = "raw"
    dtensor: DTensorInfo | None = None  # version 2: a DTensor's piece, its box and block digests


CODECS = ("raw", "zstd")


@dataclass(frozen=True, slots=True)
class ShardFile:
    """A shard file: `length` bytes of entries; stored as-is, or zstd-compressed in
    `stored_length` bytes (the remote tier's optional compression)."""

    name: str
    length: int
    codec: str = "raw"
    stored_length: int | None = None

    @property
    def size_on_tier(self) -> int:
        return self.length if self.stored_length is None else self.stored_length


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    rank: int
    world_size: int
    checksum_algorithm: str
    files: tuple[ShardFile, ...]
    entries: tuple[Entry, ...]
    tree: JsonNode
    # Encoded top-level keys ([["s", "model"], ...]) saved as the same on every rank: each is
    # written by one rank; the others' trees hold a `replica` node pointing at that rank.
    replicated: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ManifestRef:
    """What the commit marker records about one rank's manifest."""

    file: str
    length: int
    checksum: str


Metric = int | float  # a value recorded with a step: `save(..., metrics={"val_loss": 0.31})`


@dataclass(frozen=True, slots=True)
class Marker:
    step: int
    world_size: int
    checksum_algorithm: str
    manifests: tuple[ManifestRef, ...]
    # (name, value) pairs in the order given to save(); optional in the format (absent: none).
    metrics: tuple[tuple[str, Metric], ...] = ()


def build_entries(
    leaves: Sequence[Leaf],
    offsets: Sequence[int],
    checksums: Sequence[str],
    file: str,
    blocks: Mapping[int, tuple[str, ...]] | None = None,
) -> tuple[Entry, ...]:
    """The entries of `leaves` in `file`; `blocks`: per DTensor leaf index (an alias: the leaf
    it aliases), the digests of its bytes' blocks.

    Raises:
        ValueError: a DTensor leaf without its block digests.
    """
    entries = [
        Entry(lf.path, lf.kind, lf.dtype, lf.shape, file, off, lf.nbytes, ck)
        for lf, off, ck in zip(leaves, offsets, checksums, strict=True)
    ]
    for i, lf in enumerate(leaves):
        if lf.dtensor is None:
            continue
        src = i if lf.alias_of is None else lf.alias_of
        digests = None if blocks is None else blocks.get(src)
        if digests is None or len(digests) != block_count(lf.nbytes, lf.dtensor.block):
            raise ValueError(f"{lf.path}: a DTensor leaf needs the digests of its blocks")
        entries[i] = dataclasses.replace(entries[i], dtensor=dataclasses.replace(lf.dtensor, blocks=digests))
    return tuple(entries)


def encode_manifest(m: Manifest) -> bytes:
    """The manifest's bytes.

    Raises:
        UnsupportedStateError: they would exceed `MAX_MANIFEST_BYTES` (too many arrays in one
            rank's state), so no reader would accept the step.
    """
    data = _encode_manifest(m)
    if len(data) > MAX_MANIFEST_BYTES:
        raise UnsupportedStateError(
            f"step {m.step}, rank {m.rank}: the manifest of this state would be {len(data)} bytes "
            f"({len(m.entries)} arrays), over the format's limit of {MAX_MANIFEST_BYTES} bytes; "
            "save fewer, larger arrays per rank (docs/format.md, Limits)"
        )
    return data


def encode_manifest_with(m: Manifest, entries_json: str, tree_json: str | None = None) -> bytes:
    """`encode_manifest` of `m` with its entries given as the text of their JSON array
    (`m.entries` is not read), and its tree as `tree_json` if given (`tree_json_text` of
    `m.tree`): a writer that keeps each entry's text but its checksum (`entry_json_parts`),
    and the tree's text while the tree is the same object, encodes the manifest of a save of
    many leaves without building an object a leaf. The bytes are those `encode_manifest`
    gives for the same entries and tree.

    Raises:
        UnsupportedStateError: as `encode_manifest`.
    """
    doc = _manifest_doc(m, [])
    if tree_json is not None:
        doc["tree"] = {}
    text = _dump_text(doc)
    i = text.index('"entries":[]') + len('"entries":')  # fields before it: constants, shard names
    if tree_json is not None:
        j = text.index('"tree":', i) + len('"tree":')
        assert text.startswith("{}", j)
        text = text[:j] + tree_json + text[j + 2 :]
    data = (text[:i] + entries_json + text[i + 2 :]).encode()
    if len(data) > MAX_MANIFEST_BYTES:
        raise UnsupportedStateError(
            f"step {m.step}, rank {m.rank}: the manifest of this state would be {len(data)} bytes, "
            f"over the format's limit of {MAX_MANIFEST_BYTES} bytes; save fewer, larger arrays per rank "
            "(docs/format.md, Limits)"
        )
    return data


def tree_json_text(tree: JsonNode) -> str:
    """The text `encode_manifest` gives `tree` in the manifest (`encode_manifest_with`)."""
    return _dump_text(tree)[:-1]


def entry_json_parts(entries: Sequence[Entry]) -> list[tuple[str, str]]:
    """Each entry's JSON text (as in the manifest's `entries` array) split around its checksum:
    ``head + checksum + tail`` is the entry's text with that checksum. For entries without a
    `dtensor` field (whose block digests change with the bytes too)."""
    out = []
    mark = '"checksum":""'
    for e in entries:
        assert e.dtensor is None and e.checksum == ""
        text = _dump_text(_entry_doc(e))[:-1]
        i = text.rindex(mark) + len(mark) - 1  # the fields after it are the codec's
        out.append((text[:i], text[i:]))
    return out


def _entry_doc(e: Entry) -> dict[str, Any]:
    doc = {
        "path": e.path,
        "kind": e.kind,
        "dtype": e.dtype,
        "shape": list(e.shape),
        "file": e.file,
        "offset": e.offset,
        "length": e.length,
        "checksum": e.checksum,
        "codec": e.codec,
    }
    if e.dtensor is not None:  # after "codec": only DTensor entries carry it
        doc["dtensor"] = _dtensor_doc(e.dtensor)
    return doc


def _manifest_doc(m: Manifest, entries: list[dict[str, Any]]) -> dict[str, Any]:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "manifest",
        "step": m.step,
        "rank": m.rank,
        "world_size": m.world_size,
        "checksum_algorithm": m.checksum_algorithm,
        "files": [_file_doc(f) for f in m.files],
        "entries": entries,
        "tree": m.tree,
    }
    if m.replicated:  # absent when empty: single-rank manifests stay byte-identical
        doc["replicated"] = [list(k) for k in m.replicated]
    return doc


def _encode_manifest(m: Manifest) -> bytes:
    return _dump(_manifest_doc(m, [_entry_doc(e) for e in m.entries]))


def _dtensor_doc(d: DTensorInfo) -> dict[str, Any]:
    return {
        "global_shape": list(d.global_shape),
        "offsets": list(d.offsets),
        "mesh": list(d.mesh),
        "dims": list(d.dims),
        "placements": list(d.placements),
        "coordinate": list(d.coordinate),
        "block": d.block,
        "blocks": list(d.blocks),
    }


def _file_doc(f: ShardFile) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": f.name, "length": f.length}
    if f.codec != "raw":  # absent means raw: v1 manifests without compression stay byte-identical
        doc["codec"] = f.codec
        doc["stored_length"] = f.stored_length
    return doc


def encode_marker(m: Marker) -> bytes:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "kind": "commit",
        "step": m.step,
        "world_size": m.world_size,
        "checksum_algorithm": m.checksum_algorithm,
        "manifests": [{"name": r.file, "length": r.length, "checksum": r.checksum} for r in m.manifests],
    }
    if m.metrics:  # absent when empty: markers without metrics stay byte-identical
        doc["metrics"] = {name: _metric_node(v) for name, v in m.metrics}
    return _dump(doc)


def _metric_node(v: Metric) -> dict[str, str]:
    if type(v) is int:
        return {"t": "int", "v": str(v)}
    assert type(v) is float
    return {"t": "float", "v": v.hex()}


def _dump(doc: dict[str, Any]) -> bytes:
    return _dump_text(doc).encode()


def _dump_text(doc: dict[str, Any]) -> str:
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n"


# ----------------------------------------------------------------------------- parsing


def _fail(where: str, what: str) -> CheckpointCorruptedError:
    return CheckpointCorruptedError(f"{where}: {what}")


def _max_arrays(data: bytes) -> int:
    """An upper bound on the JSON arrays in `data`, in C speed and one copy: every array
    opens at the start or after `:`, `,` or `[` (whitespace aside); brackets inside strings
    only add to the count. Two non-overlapping `[[` per run stand for its overlapping ones."""
    c = data.translate(None, b" \t\n\r")
    return c.count(b":[") + c.count(b",[") + 2 * c.count(b"[[") + 1


def _load_json(data: bytes, where: str) -> dict[str, Any]:
    # Arrays are the one JSON value the parser builds without a hook to drop junk: refuse a
    # document made mostly of them before building any (`[[]],` costs 25x its bytes).
    # `_max_arrays` counts each `[` at most twice: a document within the limit by that
    # bound, one C-level count of a byte, is within it by the closer one (15 ms less at
    # 20,000 entries).
    arrays = 2 * data.count(b"[") + 1
    if arrays * MIN_BYTES_PER_ARRAY > len(data) + MIN_BYTES_PER_ARRAY:
        arrays = _max_arrays(data)
    if arrays * MIN_BYTES_PER_ARRAY > len(data) + MIN_BYTES_PER_ARRAY:
        raise _fail(
            where,
            f"up to {arrays} JSON arrays in {len(data)} bytes, denser than any writer produces "
            f"(at most one per {MIN_BYTES_PER_ARRAY} bytes)",
        )
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant, object_hook=_compacting_hook())
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise _fail(where, f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _fail(where, "top level is not a JSON object with 'format' and 'version' fields")
    if doc.get("format") != FORMAT:
        raise _fail(where, f"format is {doc.get('format')!r}, expected {FORMAT!r}")
    if type(doc.get("version")) is not int or doc["version"] not in READ_VERSIONS:
        raise _fail(where, f"unsupported format version {doc.get('version')!r} (reader: {READ_VERSIONS})")
    return doc


class _Unrecognised:
    """What the parser keeps of a JSON object that is none of the kinds this format defines
    (the value of a field readers ignore, or damage): nothing, so junk costs no memory."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<an object of no kind this format defines>"


_UNRECOGNISED = _Unrecognised()
_ENTRY_FIELDS = frozenset({"path", "kind", "dtype", "shape", "file", "offset", "length", "checksum"})
_NODE_TYPE_NAMES = {t: t for t in _NODE_TYPES}
_VALUE_NODES = frozenset({"int", "float", "str"})
_METRIC_NODES = frozenset({"int", "float"})


def _compacting_hook() -> Callable[[dict[str, Any]], object]:
    """A `json` object hook that keeps a parse small (a dict costs ~200 bytes, ten times a tree
    node's JSON): the constant tree nodes (none, true, false, empty containers) are shared,
    repeated names (node types, entries' kind/dtype/file/codec) stored once, and an object of
    no kind this format defines, or a tree node without the fields its type needs, is
    dropped for `_UNRECOGNISED` (validation then reports it). Decoded trees are read-only."""
    names: dict[str, str] = {}
    shared: dict[tuple[object, ...], dict[str, Any]] = {
        ("none",): {"t": "none"},
        ("bool", True): {"t": "bool", "v": True},
        ("bool", False): {"t": "bool", "v": False},
        ("list",): {"t": "list", "v": []},
        ("tuple",): {"t": "tuple", "v": []},
        ("dict",): {"t": "dict", "k": [], "v": []},
    }

    def node(obj: dict[str, Any], t: object) -> object:
        name = _NODE_TYPE_NAMES.get(t) if type(t) is str else None
        if name is None:
            return _UNRECOGNISED
        obj["t"] = t = name
        if t in LEAF_NODE_TYPES:  # first: a large state's nodes are mostly leaves
            return obj if type(obj.get("e")) is int else _UNRECOGNISED
        v, n = obj.get("v"), len(obj)
        if t == "none":
            return shared[("none",)] if n == 1 else obj
        if t == "bool":
            if type(v) is not bool:
                return _UNRECOGNISED
            return shared[("bool", v)] if n == 2 else obj
        if t in _VALUE_NODES:
            return obj if type(v) is str else _UNRECOGNISED
        if t in ("list", "tuple"):
            if type(v) is not list:
                return _UNRECOGNISED
            return shared[(t,)] if n == 2 and not v else obj
        if t == "dict":
            k = obj.get("k")
            if type(k) is not list or type(v) is not list:
                return _UNRECOGNISED
            return shared[("dict",)] if n == 3 and not k and not v else obj
        if t == "stateful":
            return obj if isinstance(v, dict) else _UNRECOGNISED
        return obj  # replica: validated with its context (the marker's world, the keys)

    def hook(obj: dict[str, Any]) -> object:
        if "t" in obj:
            return node(obj, obj["t"])
        # Entries next, the most numerous objects after nodes. Were this a document or metrics
        # with an entry's field names, sharing equal strings changes none of its values.
        if obj.keys() >= _ENTRY_FIELDS:
            kind, dtype, file, codec = obj["kind"], obj["dtype"], obj["file"], obj.get("codec")
            if type(kind) is str:
                obj["kind"] = names.setdefault(kind, kind)
            if type(dtype) is str:
                obj["dtype"] = names.setdefault(dtype, dtype)
            if type(file) is str:
                obj["file"] = names.setdefault(file, file)
            if type(codec) is str:
                obj["codec"] = names.setdefault(codec, codec)
            return obj
        if "format" in obj and "version" in obj:  # the document itself
            return obj
        if obj and all(type(v) is dict and v.get("t") in _METRIC_NODES for v in obj.values()):
            return obj  # a marker's metrics: name -> int or float node
        if "name" in obj and "length" in obj:  # a shard file, or a marker's manifest reference
            return obj
        if "global_shape" in obj:  # an entry's `dtensor`
            return obj
        return _UNRECOGNISED

    return hook


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-standard JSON constant {name}")


def _int(doc: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    v = doc.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(where, f"field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(doc: dict[str, Any], key: str, where: str) -> str:
    v = doc.get(key)
    if type(v) is not str:
        raise _fail(where, f"field {key!r} must be a string, got {type(v).__name__}")
    return v


def _list(doc: dict[str, Any], key: str, where: str) -> list[Any]:
    v = doc.get(key)
    if type(v) is not list:
        raise _fail(where, f"field {key!r} must be a list")
    return v


def _checksum_text(v: str, where: str) -> str:
    if not (1 <= len(v) <= 64) or any(c not in "0123456789abcdef" for c in v):
        raise _fail(where, f"checksum {v!r} is not lowercase hex")
    return v


def decode_marker(data: bytes, where: str) -> Marker:
    doc = _load_json(data, where)
    if doc.get("kind") != "commit":
        raise _fail(where, "not a commit marker")
    step = _int(doc, "step", where)
    world = _int(doc, "world_size", where, 1, 1 << 20)
    algo = _str(doc, "checksum_algorithm", where)
    refs = []
    for i, r in enumerate(_list(doc, "manifests", where)):
        w = f"{where} manifests[{i}]"
        if not isinstance(r, dict):
            raise _fail(w, "not an object with 'name' and 'length'")
        name = _str(r, "name", w)
        if name != naming.manifest_name(i, world):
            raise _fail(w, f"unexpected manifest name {name!r}")
        refs.append(ManifestRef(name, _int(r, "length", w, 0, 1 << 40), _checksum_text(_str(r, "checksum", w), w)))
    if len(refs) != world:
        raise _fail(where, f"lists {len(refs)} manifests for world size {world}")
    return Marker(step, world, algo, tuple(refs), _metrics(doc, where))


def _metrics(doc: dict[str, Any], where: str) -> tuple[tuple[str, Metric], ...]:
    """The optional `metrics` object: metric name -> an int or float node of the tree's form."""
    raw = doc.get("metrics", {})
    if type(raw) is not dict:
        raise _fail(where, "field 'metrics' must be a non-empty object of metric name -> int or float node")
    out: list[tuple[str, Metric]] = []
    for name, node in raw.items():
        w = f"{where} metrics[{name[:40]!r}]"
        if not name or len(name) > MAX_METRIC_NAME:
            raise _fail(w, f"a metric name must have 1 to {MAX_METRIC_NAME} characters")
        if type(node) is not dict or set(node) != {"t", "v"} or node["t"] not in ("int", "float"):
            raise _fail(w, 'must be {"t": "int" or "float", "v": text}')
        v = node["v"]
        if type(v) is not str:
            raise _fail(w, "value must be a string")
        value = _canonical_number(node["t"], v)
        if value is None:
            raise _fail(w, f"bad {node['t']} literal {v[:40]!r}")
        out.append((name, value))
    return tuple(out)


def _canonical_number(kind: str, text: str) -> Metric | None:
    """The value of `text` if it is the writer's exact spelling (``str(int)``, ``float.hex()``),
    so that one value has one text; else None."""
    try:
        if kind == "int":
            if len(text) > _MAX_INT_DIGITS:
                return None
            i = int(text)
            return i if str(i) == text else None
        f = float.fromhex(text)
    except (ValueError, OverflowError):
        return None
    return f if f.hex() == text else None


def decode_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest (`where` names it in errors).

    Parsing holds a small multiple of `data` whatever the input (docs/format.md, Limits, has
    the measurements: ~5x for a model's manifest, ~13x for the worst input measured): see
    `_compacting_hook` and `MIN_BYTES_PER_ARRAY`. The tree shares its constant nodes and must
    not be modified.

    Raises:
        CheckpointCorruptedError: anything this format does not allow.
    """
    with collector_paused():
        return _decode_manifest(data, where)


def _decode_manifest(data: bytes, where: str) -> Manifest:
    doc = _load_json(data, where)
    if doc.get("kind") != "manifest":
        raise _fail(where, "not a manifest")
    step = _int(doc, "step", where)
    world = _int(doc, "world_size", where, 1, 1 << 20)
    rank = _int(doc, "rank", where, 0, world - 1)
    algo = _str(doc, "checksum_algorithm", where)
    files: dict[str, int] = {}
    shard_files: list[ShardFile] = []
    for i, f in enumerate(_list(doc, "files", where)):
        w = f"{where} files[{i}]"
        if not isinstance(f, dict):
            raise _fail(w, "not an object with 'name' and 'length'")
        name = _str(f, "name", w)
        if not naming.is_safe_file_name(name) or name in files:
            raise _fail(w, f"file name {name!r} is not a shard name of this format, or repeated")
        files[name] = _int(f, "length", w)
        codec = f.get("codec", "raw")
        if codec not in CODECS:
            raise _fail(w, f"unsupported codec {codec!r}")
        stored = None if codec == "raw" else _int(f, "stored_length", w)
        shard_files.append(ShardFile(name, files[name], codec, stored))
    entries = _entries(_list(doc, "entries", where), files, where, _DTensorRules(doc["version"], algo))
    _check_regions(entries, where)
    tree = doc.get("tree")
    if not isinstance(tree, dict) or tree.get("t") != "dict":
        raise _fail(where, "the tree's root must be a dict node")
    _check_tree(tree, entries, where, 0)
    replicated = _replicated_keys(doc, tree, rank, world, where)
    return Manifest(step, rank, world, algo, tuple(shard_files), entries, tree, replicated)


def _replicated_keys(
    doc: dict[str, Any], tree: JsonNode, rank: int, world: int, where: str
) -> tuple[tuple[str, str], ...]:
    """Validate the optional `replicated` list and the `replica` nodes: replica nodes sit only
    directly under the root, at replicated keys, and point at another rank of this world."""
    raw = doc.get("replicated", [])
    if type(raw) is not list:
        raise _fail(where, "field 'replicated' must be a list of keys")
    keys: list[tuple[str, str]] = []
    for k in raw:
        if not _is_key(k):
            raise _fail(where, f"bad replicated key {str(k)[:40]!r}")
        keys.append((k[0], k[1]))
    if len(set(keys)) != len(keys):
        raise _fail(where, "repeated key in 'replicated'")
    root_keys = {(k[0], k[1]) for k in tree["k"]}
    for k in keys:
        if k not in root_keys:
            raise _fail(where, f"replicated key {list(k)!r} is not a top-level key of the tree")
    listed = set(keys)
    for k, v in zip(tree["k"], tree["v"], strict=True):
        if v["t"] != "replica":
            continue
        r = v.get("r")
        if (k[0], k[1]) not in listed or type(r) is not int or not 0 <= r < world or r == rank or len(v) != 2:
            raise _fail(where, f"bad replica node at key {k!r}")
    return tuple(keys)


_ENTRY_ORDER = ("path", "kind", "dtype", "shape", "file", "offset", "length", "checksum", "codec")
_entry_row = operator.itemgetter(*_ENTRY_ORDER)
_BATCH = 4096  # entries checked at a time: what `_entries` holds beside the parsed JSON
_HEX = frozenset("0123456789abcdef")
_MAX_FIELD = 2**63 - 1  # `_int`'s bound


def _entries(raw: list[Any], files: dict[str, int], where: str, rules: _DTensorRules) -> tuple[Entry, ...]:
    """Every entry, checked a batch at a time by `_entry_batch`; a batch it refuses is decoded
    entry by entry (`_entry`), which names what is wrong. Each JSON object goes once its
    Entry exists, so the parse and the entries never peak together."""
    out: list[Entry] = []
    for lo in range(0, len(raw), _BATCH):
        batch = raw[lo : lo + _BATCH]
        got = _entry_batch(batch, files, rules)
        out.extend(got if got is not None else (_entry(e, lo + i, files, where, rules) for i, e in enumerate(batch)))
        raw[lo : lo + _BATCH] = [None] * len(batch)
        del batch
    return tuple(out)


def _entry_batch(batch: list[Any], files: dict[str, int], rules: _DTensorRules) -> list[Entry] | None:
    """`_entry` of every item of `batch`, each check run over whole columns (C-level loops
    instead of a dozen Python steps an entry); None when any check fails. It accepts exactly
    what `_entry` accepts: a manifest's every entry is validated either way."""
    try:
        rows = list(map(_entry_row, batch))  # KeyError: a field missing; TypeError: not an object
    except (KeyError, TypeError):
        return None
    if not rows:
        return []
    paths, kinds, dtypes, shapes, names, offsets, lengths, checksums, codecs = zip(*rows, strict=True)
    strs, ints = {str}, {int}
    if not all(set(map(type, col)) <= strs for col in (paths, kinds, dtypes, names, checksums, codecs)):
        return None
    if set(codecs) != {"raw"} or not set(names) <= files.keys():
        return None
    sizes: dict[tuple[str, str], int] = {}
    for kind_dtype in set(zip(kinds, dtypes, strict=True)):
        size = itemsize(*kind_dtype)
        if size is None:
            return None
        sizes[kind_dtype] = size
    if not set(map(type, shapes)) <= {list} or max(map(len, shapes)) > MAX_NDIM:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and (not set(map(type, dims)) <= ints or min(dims) < 0):
        return None
    if "npscalar" in kinds and any(s for k, s in zip(kinds, shapes, strict=True) if k == "npscalar"):
        return None
    if not (set(map(type, offsets)) <= ints and set(map(type, lengths)) <= ints):
        return None
    if min(offsets) < 0 or max(offsets) > _MAX_FIELD or min(lengths) < 0 or max(lengths) > _MAX_FIELD:
        return None
    expected = map(operator.mul, map(math.prod, shapes), map(sizes.__getitem__, zip(kinds, dtypes, strict=True)))
    if any(map(operator.ne, lengths, expected)):
        return None
    if any(map(operator.gt, map(operator.add, offsets, lengths), map(files.__getitem__, names))):
        return None
    if min(map(len, checksums)) < 1 or max(map(len, checksums)) > 64 or not set("".join(checksums)) <= _HEX:
        return None
    dtensors = list(map(dict.get, batch, itertools.repeat("dtensor"), itertools.repeat(_ABSENT)))
    if dtensors.count(_ABSENT) == len(dtensors):
        nodt = itertools.repeat(None)
        return _new_entries(
            len(rows), paths, kinds, dtypes, map(tuple, shapes), names, offsets, lengths, checksums, codecs, nodt
        )
    out = list(map(Entry, paths, kinds, dtypes, map(tuple, shapes), names, offsets, lengths, checksums, codecs))
    try:  # a version-2 manifest of DTensors
        infos = [None if d is _ABSENT else rules.info(d, e, "") for d, e in zip(dtensors, out, strict=True)]
    except CheckpointCorruptedError:
        return None
    return list(map(Entry, paths, kinds, dtypes, map(tuple, shapes), names, offsets, lengths, checksums, codecs, infos))


_ENTRY_SLOTS = tuple(getattr(Entry, f.name).__set__ for f in dataclasses.fields(Entry))


def _new_entries(n: int, *columns: Iterable[object]) -> list[Entry]:
    """`Entry(*row)` for each of the `n` rows of `columns` (one a field, in field order), in a
    few C-level passes: the frozen dataclass's `__init__` sets its fields one Python call at
    a time (about 1.2 us an entry against 0.55 us here, issue 25). Each slot is set as that
    `__init__` sets it (`object.__setattr__` is the slot's `__set__`), so the objects are equal."""
    out = list(map(object.__new__, itertools.repeat(Entry, n)))
    for put, column in zip(_ENTRY_SLOTS, columns, strict=True):
        deque(map(put, out, column), maxlen=0)
    return out


def _entry(e: object, i: int, files: dict[str, int], where: str, rules: _DTensorRules) -> Entry:
    w = f"{where} entries[{i}]"
    if not isinstance(e, dict):
        raise _fail(w, f"not an object with the fields {sorted(_ENTRY_FIELDS)}")
    kind = _str(e, "kind", w)
    dtype = _str(e, "dtype", w)
    size = itemsize(kind, dtype)
    if size is None:
        raise _fail(w, f"unknown kind/dtype {kind!r}/{dtype!r}")
    shape_v = e.get("shape")
    if type(shape_v) is not list or len(shape_v) > MAX_NDIM:
        raise _fail(w, "shape must be a list of at most 64 non-negative integers")
    for d in shape_v:
        if type(d) is not int or d < 0:
            raise _fail(w, f"bad dimension {d!r} in shape")
    shape = tuple(shape_v)
    file = _str(e, "file", w)
    if file not in files:
        raise _fail(w, f"refers to file {file!r} not listed in 'files'")
    offset = _int(e, "offset", w)
    length = _int(e, "length", w)
    if length != math.prod(shape) * size:
        raise _fail(w, f"length {length} does not match shape {shape} of {dtype}")
    if offset + length > files[file]:
        raise _fail(w, f"bytes [{offset}, {offset + length}) lie outside {file} ({files[file]} bytes)")
    if kind == "npscalar" and shape:
        raise _fail(w, "a numpy scalar must have shape []")
    codec = _str(e, "codec", w)
    if codec != "raw":
        raise _fail(w, f"unsupported codec {codec!r}")
    path = _str(e, "path", w)
    entry = Entry(path, kind, dtype, shape, file, offset, length, _checksum_text(_str(e, "checksum", w), w), codec)
    d = e.get("dtensor", _ABSENT)
    return entry if d is _ABSENT else dataclasses.replace(entry, dtensor=rules.info(d, entry, w))


_ABSENT = object()  # an entry without a `dtensor` field (`null` is a present, bad one)
_PLACEMENT = re.compile(r"R|S[0-9]+", re.ASCII)
_MAX_MESH = 1 << 20  # devices in a mesh: the format's largest world
MIN_BLOCK = 1 << 20
MAX_BLOCK = 1 << 30
_DTENSOR_FIELDS = ("global_shape", "offsets", "mesh", "dims", "placements", "coordinate", "block", "blocks")
_DTENSOR_KEYS = frozenset(_DTENSOR_FIELDS)
_STR = {str}


class _DTensorRules:
    """Validates entries' `dtensor` fields (docs/format.md, DTensor entries) for one manifest:
    its version (1 has none) and checksum algorithm (the width of a block digest). The mesh
    part (mesh, names, placements, coordinate), the same for most entries of a rank, is
    checked once per distinct value and its tuples shared among the entries."""

    __slots__ = ("_meshes", "version", "width")

    def __init__(self, version: int, algorithm: str) -> None:
        self.version = version
        self.width = DIGEST_WIDTH.get(algorithm)
        # (ndim, mesh, dims, placements, coordinate) as given -> the checked tuples and the
        # tensor dimensions no placement shards
        self._meshes: dict[tuple[object, ...], tuple[Any, ...]] = {}

    def info(self, d: object, e: Entry, where: str) -> DTensorInfo:
        """The `dtensor` field `d` of entry `e` (`where` names it).

        Raises:
            CheckpointCorruptedError: `d` breaks a rule.
        """
        if self.version < 2:
            raise _fail(where, "a 'dtensor' field in a version-1 manifest (DTensor entries are version 2)")
        if type(d) is not dict or not d.keys() >= _DTENSOR_KEYS:
            raise _fail(where, f"'dtensor' must be an object with the fields {list(_DTENSOR_FIELDS)}")
        if e.kind != "tensor":
            raise _fail(where, f"a {e.kind!r} entry cannot have a 'dtensor' field")
        shape, ndim = e.shape, len(e.shape)
        mesh, dims, placements, coordinate, unsharded = self._mesh_part(d, ndim, where)
        global_shape = _ints(d["global_shape"], "global_shape", 0, where)
        offsets = _ints(d["offsets"], "offsets", 0, where)
        if len(global_shape) != ndim or len(offsets) != ndim:
            raise _fail(where, f"dtensor global_shape and offsets must have {ndim} items, as shape has")
        if any(map(operator.gt, map(operator.add, offsets, shape), global_shape)):
            raise _fail(
                where, f"dtensor box at {list(offsets)} of sizes {list(shape)} lies outside {list(global_shape)}"
            )
        for i in unsharded:
            if offsets[i] != 0 or shape[i] != global_shape[i]:
                raise _fail(where, f"dtensor dimension {i} is not sharded, yet the piece does not span it")
        block = d["block"]
        if type(block) is not int or block % 4096 or not MIN_BLOCK <= block <= MAX_BLOCK:
            raise _fail(where, f"dtensor block {block!r} must be a multiple of 4096 in [{MIN_BLOCK}, {MAX_BLOCK}]")
        blocks = d["blocks"]
        count = block_count(e.length, block)
        if type(blocks) is not list or len(blocks) != count:
            raise _fail(where, f"dtensor blocks must list {count} digests for {e.length} bytes")
        width = self.width
        if width is None:
            raise _fail(where, "dtensor block digests of a checksum algorithm this reader does not know")
        if blocks and not (
            set(map(type, blocks)) == _STR and set(map(len, blocks)) == {width} and _HEX.issuperset("".join(blocks))
        ):
            bad = next(b for b in blocks if type(b) is not str or len(b) != width or not _HEX.issuperset(b))
            raise _fail(where, f"dtensor block digest {str(bad)[:20]!r} is not {width} lowercase hex digits")
        return DTensorInfo(global_shape, offsets, mesh, dims, placements, coordinate, block, tuple(blocks))

    def _mesh_part(self, d: dict[str, Any], ndim: int, where: str) -> tuple[Any, ...]:
        raw = (d["mesh"], d["dims"], d["placements"], d["coordinate"])
        try:
            key: tuple[object, ...] | None = (ndim, *(tuple(v) if type(v) is list else v for v in raw))
            got = self._meshes.get(key)  # type: ignore[arg-type]
        except TypeError:  # an unhashable item: checked below, which refuses it
            key, got = None, None
        if got is not None:
            return got
        mesh = _ints(raw[0], "mesh", 1, where)
        if not 1 <= len(mesh) <= MAX_NDIM or math.prod(mesh) > _MAX_MESH:
            raise _fail(
                where, f"dtensor mesh {list(mesh)[:8]} needs 1 to {MAX_NDIM} dimensions, {_MAX_MESH} devices at most"
            )
        n = len(mesh)
        dims, placements, coordinate = raw[1], raw[2], _ints(raw[3], "coordinate", 0, where)
        if type(dims) is not list or len(dims) != n or any(x is not None and type(x) is not str for x in dims):
            raise _fail(where, f"dtensor dims must be {n} names (strings) or nulls, one per mesh dimension")
        if type(placements) is not list or len(placements) != n:
            raise _fail(where, f"dtensor placements must be {n} items, one per mesh dimension")
        sharded: set[int] = set()
        for p in placements:
            if type(p) is not str or _PLACEMENT.fullmatch(p) is None:
                raise _fail(where, f"dtensor placement {str(p)[:20]!r} is not 'R' or 'S<dim>'")
            if p != "R":
                dim = int(p[1:]) if len(p) <= 4 else ndim  # longer: no dimension of <= 64
                if dim >= ndim:
                    raise _fail(where, f"dtensor placement {p[:20]!r} shards a dimension the tensor ({ndim}-d) lacks")
                sharded.add(dim)
        if len(coordinate) != n or any(map(operator.ge, coordinate, mesh)):
            raise _fail(where, f"dtensor coordinate {list(coordinate)[:8]} lies outside mesh {list(mesh)[:8]}")
        part = (mesh, tuple(dims), tuple(placements), coordinate, tuple(i for i in range(ndim) if i not in sharded))
        if key is not None:
            self._meshes[key] = part
        return part


def _ints(v: object, name: str, lo: int, where: str) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_NDIM:
        raise _fail(where, f"dtensor {name} must be a list of at most {MAX_NDIM} integers")
    if v and (set(map(type, v)) != _INT or min(v) < lo or max(v) > _MAX_FIELD):
        bad = next(x for x in v if type(x) is not int or not lo <= x <= _MAX_FIELD)
        raise _fail(where, f"dtensor {name} holds {str(bad)[:20]!r}, not an integer in [{lo}, {_MAX_FIELD}]")
    return tuple(v)


_INT = {int}


def _check_regions(entries: tuple[Entry, ...], where: str) -> None:
    """Entries either share a region exactly (tied tensors) or do not overlap, so a reader
    never allocates more than the shard files hold."""
    if len({e.file for e in entries}) <= 1:
        offsets = list(map(_OFFSET, entries))
        ends = list(map(operator.add, offsets, map(_LENGTH, entries)))
        if all(map(operator.le, ends, islice(offsets, 1, None))):
            return  # in file order, each ending before the next starts: as writers lay them out
    regions = sorted({(e.file, e.offset, e.length) for e in entries if e.length})
    for (f1, o1, n1), (f2, o2, _) in itertools.pairwise(regions):
        if f1 == f2 and o2 < o1 + n1:
            raise _fail(where, f"entries overlap in {f1} at bytes {o2}..{o1 + n1}")


_OFFSET = operator.attrgetter("offset")
_LENGTH = operator.attrgetter("length")


def _check_tree(node: object, entries: tuple[Entry, ...], where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _fail(where, "tree nesting is too deep")
    if not isinstance(node, dict) or type(node.get("t")) is not str or node["t"] not in _NODE_TYPES:
        raise _fail(where, f"malformed tree node {str(node)[:80]!r}")
    t = node["t"]
    if t == "replica" and depth != 1:  # only a top-level value may live in another rank's part
        raise _fail(where, "a replica node below the top level")
    if t in LEAF_NODE_TYPES:
        e = node.get("e")
        if type(e) is not int or not 0 <= e < len(entries) or entries[e].kind != t:
            raise _fail(where, f"tree refers to a bad entry {e!r}")
    elif t == "bool":
        if type(node.get("v")) is not bool:
            raise _fail(where, "bool node without a bool value")
    elif t in ("int", "float", "str"):
        v = node.get("v")
        if type(v) is not str:
            raise _fail(where, f"{t} node without a string value")
        try:
            if t == "int":
                if len(v) > _MAX_INT_DIGITS:
                    raise ValueError("too many digits")
                int(v)
            elif t == "float":
                float.fromhex(v)
        except (ValueError, OverflowError):
            raise _fail(where, f"bad {t} literal {v[:40]!r}") from None
    elif t in ("list", "tuple"):
        items = node.get("v")
        if type(items) is not list:
            raise _fail(where, f"{t} node without items")
        _check_children(items, entries, where, depth + 1)
    elif t == "dict":
        keys, values = node.get("k"), node.get("v")
        if type(keys) is not list or type(values) is not list or len(keys) != len(values):
            raise _fail(where, "dict node with mismatched keys and values")
        for k in keys:
            if not _is_key(k):
                raise _fail(where, f"bad dict key {str(k)[:40]!r}")
        _check_children(values, entries, where, depth + 1)
    elif t == "stateful":
        inner = node.get("v")
        if not isinstance(inner, dict) or inner.get("t") != "dict":
            raise _fail(where, "stateful node without a dict")
        _check_tree(inner, entries, where, depth + 1)


def _check_children(nodes: list[Any], entries: tuple[Entry, ...], where: str, depth: int) -> None:
    """`_check_tree` of each of `nodes`, a leaf node's checks made here, without a call: a
    large state's nodes are mostly leaves. Anything else, or a leaf too deep, is checked by
    `_check_tree`, which says what is wrong."""
    n = len(entries)
    for node in nodes:
        if type(node) is dict and depth <= MAX_DEPTH:
            t, e = node.get("t"), node.get("e")
            if type(t) is str and t in LEAF_NODE_TYPES and type(e) is int and 0 <= e < n and entries[e].kind == t:
                continue
        _check_tree(node, entries, where, depth)


def _is_key(k: object) -> bool:
    return (
        type(k) is list
        and len(k) == 2
        and k[0] in ("s", "i")
        and type(k[1]) is str
        and (k[0] != "i" or _is_int_text(k[1]))
    )


def _is_int_text(v: str) -> bool:
    if not 0 < len(v) <= _MAX_INT_DIGITS:
        return False
    try:
        int(v)
    except ValueError:
        return False
    return True


def decode_key(k: list[str]) -> str | int:
    return int(k[1]) if k[0] == "i" else k[1]


def replica_owners(m: Manifest) -> list[tuple[tuple[str, str], int]]:
    """Each replicated top-level key and the rank whose files hold it."""
    nodes = {(k[0], k[1]): v for k, v in zip(m.tree["k"], m.tree["v"], strict=True)}
    return [(k, nodes[k]["r"] if nodes[k]["t"] == "replica" else m.rank) for k in m.replicated]


def assignment_digest(m: Manifest, with_owners: bool = True) -> str:
    """Equal on every rank of a step exactly when they agree on who writes which replicated key
    (without owners: only on which keys are replicated, when each directory has its own copy)."""
    owners = replica_owners(m) if with_owners else [(k, -1) for k in m.replicated]
    return json.dumps(owners, separators=(",", ":"))
