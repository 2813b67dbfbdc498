"""The read path: find committed steps, verify them, and bind them into a template.

Reading a step is two-phased: first every byte is read and checked against its
checksum (tensors land directly in the template's tensors where they can), and only
when the whole step verified are plain values written and `load_state_dict` called.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from . import layout
from .checksum import ALGORITHMS, checksum_function, checksum_stream
from .coordination import Coordinator
from .dtypes import TORCH_DTYPES, numpy_dtype_from_name, torch_dtype_name
from .errors import CheckpointCorruptedError, NoCheckpointError, StateMismatchError
from .manifest import (
    MAX_MANIFEST_BYTES,
    Entry,
    Manifest,
    Marker,
    ShardFile,
    decode_key,
    decode_manifest,
    decode_marker,
)
from .state import ROOT, JsonNode, decode_float, dtensor_local, is_stateful, key_path
from .tiers.base import ReadableFile, Tier

MAX_MARKER_BYTES = 128 << 20  # ~100 bytes per rank, up to the format's 2^20 ranks

Producer = Callable[[], object]
_MISSING = object()


@dataclass(slots=True)
class _Read:
    entry: Entry
    dest: memoryview


class _Binder:
    """Matches a manifest tree against a template and plans the reads."""

    def __init__(self, manifest: Manifest, step: int, parent: _Binder | None = None) -> None:
        self.entries = manifest.entries
        self.step = step
        self.reads: list[_Read] = parent.reads if parent else []
        self.fresh: dict[tuple[object, ...], torch.Tensor] = parent.fresh if parent else {}
        # replica node id -> (the binder of the rank holding the value, the value's node)
        self.replicas: dict[int, tuple[_Binder, JsonNode]] = parent.replicas if parent else {}

    def bind(self, tmpl: object, node: JsonNode, path: str, strict: bool) -> Producer:
        t = node["t"]
        if t == "replica":  # the value lives in another rank's part of this step
            owner, target = self.replicas[id(node)]
            return owner.bind(tmpl, target, path, strict)
        if t in ("tensor", "ndarray", "npscalar", "bytes"):
            return self._leaf(tmpl, self.entries[node["e"]], path, strict)
        if t == "dict":
            return self._dict(tmpl, node, path, strict)
        if t in ("list", "tuple"):
            return self._sequence(tmpl, node, path, strict)
        if t == "stateful":
            return self._stateful(tmpl, node["v"], path, strict)
        value = _plain(node)
        if strict and _is_structured(tmpl):
            raise self._mismatch(path, f"the template holds a {type(tmpl).__name__}, the checkpoint a {t}")
        return lambda: value

    def _mismatch(self, path: str, what: str) -> StateMismatchError:
        return StateMismatchError(f"{path}: {what} (checkpoint step {self.step})")

    def _leaf(self, tmpl: object, e: Entry, path: str, strict: bool) -> Producer:
        if e.kind == "tensor":
            dtype = TORCH_DTYPES[e.dtype]
            if isinstance(tmpl, torch.Tensor) and type(tmpl) not in (torch.Tensor, torch.nn.Parameter):
                local = dtensor_local(tmpl, path)
                if local is not None:  # a DTensor: its local piece is what this rank saved
                    if torch_dtype_name(local.dtype) != e.dtype or tuple(local.shape) != e.shape:
                        raise self._mismatch(
                            path,
                            f"template DTensor's local piece is {local.dtype} {tuple(local.shape)}, checkpoint "
                            f"has {dtype} {e.shape}: restore with the same device mesh and placements "
                            "(resharding is not supported)",
                        )
                    fill = self._into_tensor(local, e)
                    return lambda: (fill(), tmpl)[1]
            if isinstance(tmpl, torch.Tensor):
                ok = torch_dtype_name(tmpl.dtype) == e.dtype and tuple(tmpl.shape) == e.shape
                if ok:
                    return self._into_tensor(tmpl, e)
                # Inside a stateful object a dtype change may be load_state_dict's to make
                # (optimizers cast state to the parameter's dtype); a shape change never is,
                # and must fail before any byte lands in the object's other tensors.
                if strict or tuple(tmpl.shape) != e.shape:
                    raise self._mismatch(
                        path,
                        f"template tensor is {tmpl.dtype} {tuple(tmpl.shape)}, checkpoint has {dtype} {e.shape}",
                    )
            elif strict and _is_structured(tmpl):
                raise self._mismatch(path, f"the template holds a {type(tmpl).__name__}, the checkpoint a tensor")
            region = (e.file, e.offset, e.length, e.dtype, e.shape)
            fresh = self.fresh.get(region) if e.length else None
            if fresh is None:  # tied tensors come back tied, read once
                fresh = self.fresh[region] = torch.empty(e.shape, dtype=dtype)
                self._plan_read(e, fresh)
            return lambda: fresh
        if e.kind == "bytes":
            raw = bytearray(e.length)
            self.reads.append(_Read(e, memoryview(raw)))
            return lambda: bytes(raw)
        npd = numpy_dtype_from_name(e.dtype)
        assert npd is not None
        if isinstance(tmpl, np.ndarray) and e.kind == "ndarray":
            if tmpl.dtype == npd and tmpl.shape == e.shape and tmpl.flags.writeable:
                if tmpl.flags.c_contiguous:
                    self.reads.append(_Read(e, _bytes_of(tmpl)))
                    return lambda: tmpl
                staged: np.ndarray[Any, Any] = np.empty(e.shape, dtype=npd)
                self.reads.append(_Read(e, _bytes_of(staged)))

                def copy_back() -> object:
                    tmpl[...] = staged
                    return tmpl

                return copy_back
            if strict and (tmpl.dtype != npd or tmpl.shape != e.shape):
                raise self._mismatch(
                    path,
                    f"template array is {tmpl.dtype} {tmpl.shape}, checkpoint has {npd} {e.shape}",
                )
        elif strict and _is_structured(tmpl):
            raise self._mismatch(path, f"the template holds a {type(tmpl).__name__}, the checkpoint an array")
        arr: np.ndarray[Any, Any] = np.empty(e.shape, dtype=npd)
        self.reads.append(_Read(e, _bytes_of(arr)))
        if e.kind == "npscalar":
            return lambda: arr[()]
        return lambda: arr

    def _into_tensor(self, tmpl: torch.Tensor, e: Entry) -> Producer:
        target = tmpl.detach()
        if target.device.type == "cpu" and target.is_contiguous() and not target.is_conj() and not target.is_neg():
            self._plan_read(e, target)
            return lambda: tmpl
        staging = torch.empty(e.shape, dtype=target.dtype)
        self._plan_read(e, staging)

        def copy_back() -> object:
            target.copy_(staging)
            return tmpl

        return copy_back

    def _plan_read(self, e: Entry, t: torch.Tensor) -> None:
        if e.length:
            flat = t.reshape(-1).view(torch.uint8)
            self.reads.append(_Read(e, _bytes_of(flat.numpy())))
        else:
            self.reads.append(_Read(e, memoryview(b"")))

    def _dict(self, tmpl: object, node: JsonNode, path: str, strict: bool) -> Producer:
        keys = [decode_key(k) for k in node["k"]]
        children = dict(zip(keys, node["v"], strict=True))
        if strict and isinstance(tmpl, Mapping) and not is_stateful(tmpl):
            producers: list[tuple[object, Producer]] = []
            for k in tmpl:
                child = children.get(k, _MISSING)
                if child is _MISSING:
                    raise self._mismatch(key_path(path, k), "this key of the template is not in the checkpoint")
                producers.append((k, self.bind(tmpl[k], child, key_path(path, k), True)))

            def fill() -> object:
                for k, p in producers:
                    v = p()
                    if isinstance(tmpl, MutableMapping):
                        if tmpl[k] is not v:
                            tmpl[k] = v
                    elif tmpl[k] is not v:
                        raise self._mismatch(key_path(path, k), "read-only mapping in the template")
                return tmpl

            return fill
        if strict and tmpl is not None and _is_structured(tmpl):
            raise self._mismatch(path, f"the template holds a {type(tmpl).__name__}, the checkpoint a dict")
        hint = tmpl if isinstance(tmpl, Mapping) else {}
        built = [(k, self.bind(hint.get(k), child, key_path(path, k), False)) for k, child in children.items()]
        return lambda: {k: p() for k, p in built}

    def _sequence(self, tmpl: object, node: JsonNode, path: str, strict: bool) -> Producer:
        items: list[JsonNode] = node["v"]
        kind = list if node["t"] == "list" else tuple
        if isinstance(tmpl, (list, tuple)) and len(tmpl) == len(items):
            producers = [
                self.bind(tv, cv, key_path(path, i), strict) for i, (tv, cv) in enumerate(zip(tmpl, items, strict=True))
            ]
            if isinstance(tmpl, list) and kind is list:

                def fill() -> object:
                    for i, p in enumerate(producers):
                        v = p()
                        if tmpl[i] is not v:
                            tmpl[i] = v
                    return tmpl

                return fill
            return lambda: kind(p() for p in producers)
        if strict and _is_structured(tmpl):
            got = (
                f"{type(tmpl).__name__} of length {len(tmpl)}"
                if isinstance(tmpl, (list, tuple))
                else type(tmpl).__name__
            )
            raise self._mismatch(
                path,
                f"the template holds a {got}, the checkpoint a {node['t']} of length {len(items)}",
            )
        producers = [self.bind(None, cv, key_path(path, i), False) for i, cv in enumerate(items)]
        return lambda: kind(p() for p in producers)

    def _stateful(self, tmpl: object, inner: JsonNode, path: str, strict: bool) -> Producer:
        if not is_stateful(tmpl):
            return self._dict(tmpl, inner, path, strict)
        try:
            hint = tmpl.state_dict()  # type: ignore[attr-defined]
        except Exception as exc:
            raise self._mismatch(path, f"{type(tmpl).__name__}.state_dict() raised {exc!r}") from exc
        produce = self._dict(hint, inner, path, False)

        def load() -> object:
            sd = produce()
            try:
                tmpl.load_state_dict(sd)  # type: ignore[attr-defined]
            except Exception as exc:
                raise self._mismatch(
                    path, f"{type(tmpl).__name__}.load_state_dict() rejected the checkpoint: {exc}"
                ) from exc
            return tmpl

        return load


def _bytes_of(arr: np.ndarray[Any, Any]) -> memoryview:
    """A writable byte view of a C-contiguous array's memory."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _is_structured(tmpl: object) -> bool:
    """Template values that must match the checkpoint's kind (others are just replaced)."""
    return isinstance(tmpl, (torch.Tensor, np.ndarray, Mapping, list, tuple)) or is_stateful(tmpl)


def _plain(node: JsonNode) -> object:
    t = node["t"]
    if t == "none":
        return None
    if t == "bool":
        return node["v"]
    if t == "int":
        return int(node["v"])
    if t == "float":
        return decode_float(node["v"])
    return node["v"]  # str


# ------------------------------------------------------------------- reading a step


class ZstdFile(ReadableFile):
    """A zstd-compressed shard (one or more frames) read front to back (restore reads in
    offset order); a read behind the current position starts decompressing again from the
    beginning.

    Memory stays bounded whatever the frames claim: bytes are decompressed straight into the
    caller's buffer (or a fixed scratch buffer when skipping ahead), never more than asked
    for, and never past the declared length. `check_end` then reads at most one byte past
    it: a shard that decompresses to more or fewer bytes than declared is corrupted.
    """

    READ_SIZE = 8 << 20  # compressed bytes per read from the tier (one ranged GET on tier 2)
    SKIP_SIZE = 1 << 20  # decompressed bytes per step when skipping ahead

    def __init__(self, raw: ReadableFile, length: int, path: str) -> None:
        self.size = length
        self._raw = raw
        self._path = path
        self._scratch: memoryview | None = None
        self._rewind()

    def _rewind(self) -> None:
        import zstandard

        self._raw_pos = 0
        self._pos = 0
        # read_across_frames: the format allows several frames, decompressing back to back.
        self._reader: Any = zstandard.ZstdDecompressor().stream_reader(
            cast(Any, self), read_size=self.READ_SIZE, read_across_frames=True, closefd=False
        )

    def read(self, n: int) -> bytearray:
        """The next compressed bytes, for the decompressor (empty at the end of the file)."""
        n = min(n, self._raw.size - self._raw_pos)
        chunk = bytearray(n)
        if n:
            self._raw.read_into(self._raw_pos, memoryview(chunk))
            self._raw_pos += n
        return chunk

    def _fill(self, dest: memoryview) -> int:
        """Decompress into `dest`; fewer bytes only where the data ends."""
        filled = 0
        while filled < len(dest):
            try:
                n = self._reader.readinto(dest[filled:])
            except Exception as exc:  # zstandard.ZstdError: not a valid frame
                raise CheckpointCorruptedError(f"{self._path}: bad zstd data: {exc}") from None
            if not n:
                break
            filled += n
        self._pos += filled
        return filled

    def _skip_to(self, offset: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(min(self.SKIP_SIZE, max(self.size, 1))))
        while self._pos < offset:
            if not self._fill(self._scratch[: min(len(self._scratch), offset - self._pos)]):
                raise EOFError(f"{self._path}: decompressed data ends at byte {self._pos}, manifest says {self.size}")

    def read_into(self, offset: int, dest: memoryview) -> None:
        if offset + len(dest) > self.size:
            raise EOFError(f"{self._path}: bytes {offset}..{offset + len(dest)} lie past its {self.size} bytes")
        if offset < self._pos:
            self._rewind()
        self._skip_to(offset)
        if self._fill(dest) < len(dest):
            raise EOFError(f"{self._path}: decompressed data ends at byte {self._pos}, manifest says {self.size}")

    def check_end(self) -> None:
        """Raise CheckpointCorruptedError unless the data decompresses to exactly `size` bytes."""
        try:
            self._skip_to(self.size)
        except EOFError as exc:
            raise CheckpointCorruptedError(str(exc)) from None
        if self._fill(memoryview(bytearray(1))):
            raise CheckpointCorruptedError(
                f"{self._path}: decompresses to more than the {self.size} bytes its manifest declares"
            )

    def close(self) -> None:
        self._reader.close()
        self._raw.close()


class MissingManifestError(CheckpointCorruptedError):
    """A committed step's marker lists a manifest this tier does not hold (on a node-local
    directory: another node's rank)."""


def read_marker(tier: Tier, step: int) -> Marker:
    """Read and check the commit marker of `step`."""
    where = tier.path_of(step, layout.COMMIT_NAME)
    try:
        marker = decode_marker(tier.read_bytes(step, layout.COMMIT_NAME, MAX_MARKER_BYTES), where)
    except FileNotFoundError:
        raise NoCheckpointError(f"step {step} is not committed on tier {tier.name!r} ({where})") from None
    if marker.step != step:
        raise CheckpointCorruptedError(f"{where}: marker is for step {marker.step}, directory for step {step}")
    if marker.checksum_algorithm not in ALGORITHMS:
        raise CheckpointCorruptedError(f"{where}: unknown checksum algorithm {marker.checksum_algorithm!r}")
    return marker


def read_manifest(tier: Tier, step: int, rank: int, marker: Marker | None = None) -> Manifest:
    """Read and verify one rank's manifest of `step` against the commit marker."""
    return read_manifest_with_bytes(tier, step, rank, marker)[1]


def read_manifest_with_bytes(tier: Tier, step: int, rank: int, marker: Marker | None = None) -> tuple[bytes, Manifest]:
    """`read_manifest`, with the bytes it decoded (those the marker's checksum covers)."""
    if marker is None:
        marker = read_marker(tier, step)
    if not 0 <= rank < marker.world_size:
        raise NoCheckpointError(f"step {step} on tier {tier.name!r} has {marker.world_size} ranks, no rank {rank}")
    ref = marker.manifests[rank]
    mwhere = tier.path_of(step, ref.file)
    if ref.length > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptedError(f"{mwhere}: manifest claims {ref.length} bytes")
    try:
        data = tier.read_bytes(step, ref.file, ref.length)
    except FileNotFoundError:
        raise MissingManifestError(
            f"{mwhere}: manifest is missing from a committed step (a node-local directory holds only "
            "the parts of the ranks that share it: read it with one of their ranks)"
        ) from None
    checksum = checksum_function(marker.checksum_algorithm)
    if len(data) != ref.length or checksum(data) != ref.checksum:
        raise CheckpointCorruptedError(f"{mwhere}: manifest does not match the checksum in its commit marker")
    manifest = decode_manifest(data, mwhere)
    if (manifest.step, manifest.rank, manifest.world_size) != (step, rank, marker.world_size):
        raise CheckpointCorruptedError(
            f"{mwhere}: manifest names step/rank/world {manifest.step}/{manifest.rank}/{manifest.world_size}"
        )
    if manifest.checksum_algorithm != marker.checksum_algorithm:
        raise CheckpointCorruptedError(
            f"{mwhere}: checksum algorithm {manifest.checksum_algorithm!r}, marker says {marker.checksum_algorithm!r}"
        )
    return data, manifest


def read_step(
    tier: Tier, step: int, rank: int, template: object, strict: bool, world_size: int | None = None
) -> object:
    """Read `step` from `tier` into `template` (or fresh values if None); verify every byte.

    Raises:
        CheckpointCorruptedError: missing, short or altered bytes; the template's tensors
            may then hold partial data, its plain values and stateful objects are untouched.
        StateMismatchError: the template does not fit the checkpoint. Raised before any byte
            is read, except when a stateful object's `load_state_dict` itself rejects the
            checkpoint after its tensors were filled.
    """
    return prepare_step(tier, step, rank, template, strict, world_size)()


def prepare_step(
    tier: Tier, step: int, rank: int, template: object, strict: bool, world_size: int | None = None
) -> Producer:
    """Read and verify `step` (tensors land in the template's tensors); return the function
    that then writes plain values and calls `load_state_dict` (see `read_step`).

    `world_size` is the restoring job's: when it differs from the checkpoint's, only the
    replicated top-level keys can be restored, read through rank 0's manifest."""
    marker = read_marker(tier, step)
    resized = world_size is not None and world_size != marker.world_size
    # Resized: any rank's view holds the replicated keys; take the first one this tier has.
    manifest = _first_present_manifest(tier, step, marker) if resized else read_manifest(tier, step, rank, marker)
    tree = manifest.tree
    if world_size is not None and resized:
        tree = _replicated_view(tier, step, manifest, marker.world_size, world_size, template)
    binder = _Binder(manifest, step)
    manifests = {manifest.rank: manifest}
    owned: dict[int, tuple[_Binder, dict[tuple[str, ...], JsonNode], set[tuple[str, str]]]] = {}
    for k, node in zip(tree["k"], tree["v"], strict=True):
        if node["t"] != "replica" or (isinstance(template, Mapping) and decode_key(k) not in template and strict):
            continue
        if node["r"] not in owned:  # each owner's manifest read and indexed once
            owner = manifests[node["r"]] = read_manifest(tier, step, node["r"], marker)
            index = dict(zip(map(tuple, owner.tree["k"]), owner.tree["v"], strict=True))
            owned[node["r"]] = (_Binder(owner, step, binder), index, set(owner.replicated))
        sub, index, replicated = owned[node["r"]]
        owner = manifests[node["r"]]
        target = index.get(tuple(k))
        if target is None or target["t"] == "replica" or tuple(k) not in replicated:
            raise CheckpointCorruptedError(
                f"{tier.path_of(step, layout.manifest_name(owner.rank, owner.world_size))}: "
                f"does not hold the replicated key {decode_key(k)!r} that rank {manifest.rank} refers to"
            )
        binder.replicas[id(node)] = (sub, target)
    files: dict[str, ReadableFile] = {}
    try:
        # Sizes first: the manifest's regions are validated against the sizes it declares,
        # so once those match the real files, nothing below allocates more than they hold.
        listed: dict[str, ShardFile] = {}
        for sf in (sf for m in manifests.values() for sf in m.files):
            path = tier.path_of(step, sf.name)
            if sf.name in listed:  # two manifests of the step name one file: open it once
                if listed[sf.name] != sf:
                    raise CheckpointCorruptedError(f"{path}: manifests of step {step} disagree on this file's size")
                continue
            listed[sf.name] = sf
            try:
                f = tier.open_file(step, sf.name)
            except FileNotFoundError:
                raise CheckpointCorruptedError(f"{path}: shard file is missing") from None
            files[sf.name] = f
            if f.size != sf.size_on_tier:
                raise CheckpointCorruptedError(f"{path}: shard file is {f.size} bytes, manifest says {sf.size_on_tier}")
            if sf.codec == "zstd":
                files[sf.name] = ZstdFile(f, sf.length, path)
        try:
            produce = binder.bind(template, tree, ROOT, strict)
        except RecursionError:
            raise CheckpointCorruptedError(f"{tier.path_of(step)}: the state tree is nested too deep") from None
        except (MemoryError, RuntimeError) as exc:  # sizes a compressed shard cannot bound
            raise CheckpointCorruptedError(
                f"{tier.path_of(step)}: cannot allocate what the manifest claims: {exc}"
            ) from None
        _read_verified(tier, step, files, binder.reads, manifest.checksum_algorithm)
        for f in files.values():
            if isinstance(f, ZstdFile):
                f.check_end()
    finally:
        for f in files.values():
            f.close()
    return produce


def present_manifests(tier: Tier, step: int, marker: Marker, ranks: Iterable[int] | None = None) -> Iterator[Manifest]:
    """The manifests of `ranks` (default: every rank of the step) that this tier holds, each
    verified against the marker, lowest rank first; a node-local directory holds only the
    parts of the ranks that share it."""
    for r in range(marker.world_size) if ranks is None else ranks:
        try:
            yield read_manifest(tier, step, r, marker)
        except MissingManifestError:
            continue


def _first_present_manifest(tier: Tier, step: int, marker: Marker) -> Manifest:
    """The lowest rank's manifest this tier holds: any rank's view holds the replicated keys."""
    manifest = next(present_manifests(tier, step, marker), None)
    if manifest is None:
        raise CheckpointCorruptedError(f"{tier.path_of(step)}: no manifest of any rank is present")
    return manifest


def _replicated_view(
    tier: Tier, step: int, manifest: Manifest, saved_world: int, world_size: int, template: object
) -> JsonNode:
    """The part of rank 0's tree that any rank of a job of another size may restore: the
    replicated keys. A template key saved per rank is an error naming it."""
    tree = manifest.tree
    replicated = set(manifest.replicated)
    if isinstance(template, Mapping) and not is_stateful(template):
        wanted = set(template)
        per_rank = [decode_key(k) for k in tree["k"] if tuple(k) not in replicated and decode_key(k) in wanted]
        if per_rank:
            raise StateMismatchError(
                f"step {step} ({tier.path_of(step)}) was saved by {saved_world} ranks; this job has "
                f"{world_size}. Only keys saved as replicated (Checkpointer(replicated=...)) can be restored "
                f"with another number of ranks: {sorted(map(str, (decode_key(list(k)) for k in replicated)))}. "
                f"Per-rank keys in the template: {per_rank}; drop them from the template, or restore with "
                f"{saved_world} ranks (resharding per-rank state is not supported)"
            )
    pairs = [(k, v) for k, v in zip(tree["k"], tree["v"], strict=True) if tuple(k) in replicated]
    return {"t": "dict", "k": [k for k, _ in pairs], "v": [v for _, v in pairs]}


READ_CHUNK = 32 << 20


def _read_verified(
    tier: Tier, step: int, files: Mapping[str, ReadableFile], reads: Sequence[_Read], algorithm: str
) -> None:
    """Read every entry in file order, checksumming on a helper thread chunk by chunk while
    the next chunk is read, so verification costs no time when the disk is the bottleneck."""
    pending: list[tuple[Entry, Future[str]]] = []
    with ThreadPoolExecutor(1, thread_name_prefix="tiercheck-verify") as hasher:
        try:
            for r in sorted(reads, key=lambda r: (r.entry.file, r.entry.offset)):
                e, dest = r.entry, r.dest
                h = checksum_stream(algorithm)
                for pos in range(0, len(dest), READ_CHUNK):
                    chunk = dest[pos : pos + READ_CHUNK]
                    try:
                        files[e.file].read_into(e.offset + pos, chunk)
                    except EOFError as exc:
                        raise CheckpointCorruptedError(str(exc)) from None
                    hasher.submit(h.update, chunk)
                pending.append((e, hasher.submit(h.hexdigest)))
        except BaseException:
            for _, fut in pending:
                fut.cancel()
            raise
        for e, fut in pending:
            if fut.result() != e.checksum:
                raise CheckpointCorruptedError(
                    f"{tier.path_of(step, e.file)}: checksum mismatch for {e.path} "
                    f"(bytes {e.offset}..{e.offset + e.length})"
                )


def verify_files(tier: Tier, step: int, manifest: Manifest) -> None:
    """Check every entry's checksum by streaming each shard file through one reused buffer
    (no allocation per tensor): what the uploader runs before copying a step to tier 2, so a
    damaged tier-1 copy is never spread.

    Raises:
        CheckpointCorruptedError: a shard is missing, short, or an entry's bytes differ.
    """
    buf = bytearray(min(READ_CHUNK, max((sf.length for sf in manifest.files), default=0)))
    view = memoryview(buf)
    for sf in manifest.files:
        path = tier.path_of(step, sf.name)
        regions: dict[tuple[int, int], str] = {}
        for e in manifest.entries:
            if e.file == sf.name:
                regions[(e.offset, e.length)] = e.checksum
        ordered = sorted(regions.items())
        hashers = [checksum_stream(manifest.checksum_algorithm) for _ in ordered]
        try:
            raw = tier.open_file(step, sf.name)
        except FileNotFoundError:
            raise CheckpointCorruptedError(f"{path}: shard file is missing") from None
        f: ReadableFile = ZstdFile(raw, sf.length, path) if sf.codec == "zstd" else raw
        try:
            if raw.size != sf.size_on_tier:
                raise CheckpointCorruptedError(
                    f"{path}: shard file is {raw.size} bytes, manifest says {sf.size_on_tier}"
                )
            first = 0  # regions before this one are complete
            for pos in range(0, sf.length, READ_CHUNK):
                n = min(READ_CHUNK, sf.length - pos)
                try:
                    f.read_into(pos, view[:n])
                except EOFError as exc:
                    raise CheckpointCorruptedError(str(exc)) from None
                for i in range(first, len(ordered)):
                    (off, length), _ = ordered[i]
                    if off >= pos + n:
                        break
                    lo, hi = max(off, pos), min(off + length, pos + n)
                    if hi > lo:
                        hashers[i].update(view[lo - pos : hi - pos])
                    if off + length <= pos + n and i == first:
                        first += 1
            if isinstance(f, ZstdFile):
                f.check_end()
        finally:
            f.close()
        for ((off, length), expected), h in zip(ordered, hashers, strict=True):
            if h.hexdigest() != expected:
                raise CheckpointCorruptedError(f"{path}: checksum mismatch in bytes {off}..{off + length}")


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    value: object
    committed: tuple[int, ...]  # every committed step seen on any tier


def list_committed(tiers: Sequence[Tier]) -> dict[int, list[Tier]]:
    """Committed steps and the tiers holding each, fastest tier first.

    A tier that cannot be listed (object store down) is skipped with a warning as long as
    another tier answers; if none does, the first error is raised.
    """
    holders: dict[int, list[Tier]] = {}
    failures: list[BaseException] = []
    for tier in tiers:
        try:
            steps = tier.committed_steps()
        except Exception as exc:
            failures.append(exc)
            warnings.warn(
                f"tiercheck: cannot list tier {tier.name!r} ({tier.location}): {exc!r}", RuntimeWarning, stacklevel=3
            )
            continue
        for s in steps:
            holders.setdefault(s, []).append(tier)
    if failures and len(failures) == len(tiers):
        raise failures[0]
    return holders


def restore_from(
    tiers: Sequence[Tier],
    template: object,
    step: int | None,
    rank: int,
    strict: bool = True,
    world_size: int | None = None,
) -> Restored | None:
    """Restore the newest verifiable step (or exactly `step`) from the fastest tier having it.

    `world_size` is the restoring job's (see `prepare_step`); None reads rank `rank`'s view
    whatever the world size of the checkpoint. Returns None when no tier has any committed step.
    """
    holders = list_committed(tiers)
    if step is not None:
        if step not in holders:
            where = ", ".join(f"{t.name}={t.location}" for t in tiers)
            raise NoCheckpointError(f"step {step} is not committed on any tier ({where}); committed: {sorted(holders)}")
        candidates = [step]
    else:
        candidates = sorted(holders, reverse=True)
    if not candidates:
        return None
    failures: list[str] = []
    missing_only = True  # every failure a NoCheckpointError (e.g. no such rank): say so
    for s in candidates:
        for tier in holders[s]:
            try:
                value = read_step(tier, s, rank, template, strict, world_size)
                return Restored(s, value, tuple(sorted(holders)))
            except (CheckpointCorruptedError, NoCheckpointError, OSError) as exc:
                missing_only = missing_only and isinstance(exc, NoCheckpointError)
                failures.append(f"step {s} on tier {tier.name!r}: {exc}")
                if step is None or tier is not holders[s][-1]:
                    warnings.warn(
                        f"tiercheck: cannot restore step {s} from tier {tier.name!r}: {exc}; "
                        + ("trying the next tier" if tier is not holders[s][-1] else "trying an older step"),
                        RuntimeWarning,
                        stacklevel=3,
                    )
    detail = "; ".join(failures)
    error = NoCheckpointError if missing_only else CheckpointCorruptedError
    if step is not None:
        raise error(f"step {step} cannot be restored: {detail}")
    raise error(f"no committed step could be restored ({len(candidates)} tried, newest first): {detail}")


def restore_collective(
    coord: Coordinator,
    local: Tier | None,
    remote: Tier | None,
    template: object,
    step: int | None,
    rank: int,
    world_size: int,
) -> Restored | None:
    """`restore_from` for one rank of a job: every rank calls it, and all restore the same
    step, the newest that every rank can read (or exactly `step`).

    Each rank reads its part from its tier 1 when its node has the step there, else from
    tier 2; a rank whose copy fails verification tries the other tier, and if some rank
    cannot read a step at all, every rank moves on to the next older candidate.
    """
    mine: list[int] = []
    if local is not None:
        try:
            mine = local.committed_steps()
        except OSError as exc:
            warnings.warn(f"tiercheck: cannot list tier {local.name!r}: {exc!r}", RuntimeWarning, stacklevel=3)

    def shared() -> list[int]:  # rank 0 only
        if remote is None:
            return []
        try:
            return remote.committed_steps()
        except Exception as exc:  # tier 2 down: what every rank's tier 1 holds may still do
            warnings.warn(f"tiercheck: cannot list tier {remote.name!r}: {exc!r}", RuntimeWarning, stacklevel=4)
            return []

    candidates = coord.agree_candidates(mine, shared, step)
    if not candidates:
        coord.finish_restore(0)
        if step is not None:
            raise NoCheckpointError(f"step {step} is not committed on every rank's tiers (rank {rank}: {mine})")
        return None
    failures: list[str] = []
    tried = 0  # outcome rounds run: their keys are deleted at the end
    try:
        for i, s in enumerate(candidates):
            tried = i + 1
            tiers = [t for t in (local, remote) if t is not None and (t is not local or s in mine)]
            produce: Producer | None = None
            why = ""
            for tier in tiers:
                try:
                    produce = prepare_step(tier, s, rank, template, True, world_size)
                    break
                except StateMismatchError as exc:  # the template is wrong: no older step helps
                    coord.agree_outcome(i, False, str(exc), fatal=True)
                    raise
                except (CheckpointCorruptedError, NoCheckpointError, OSError) as exc:
                    why = f"step {s} on tier {tier.name!r}: {exc}"
                    if tier is not tiers[-1]:
                        msg = f"tiercheck: cannot restore {why}; trying the next tier"
                        warnings.warn(msg, RuntimeWarning, stacklevel=3)
            if not tiers:
                why = f"step {s} is on no tier of rank {rank}"
            everyone, first, stop = coord.agree_outcome(i, produce is not None, why)
            if everyone:
                assert produce is not None
                return Restored(s, produce(), tuple(sorted(set(mine) | set(candidates))))
            if stop:
                raise StateMismatchError(f"restore of step {s} stopped: {first}")
            failures.append(first)
            if step is None:
                warnings.warn(
                    f"tiercheck: cannot restore step {s} on every rank ({first}); trying an older step",
                    RuntimeWarning,
                    stacklevel=3,
                )
    finally:
        coord.finish_restore(tried)
    detail = "; ".join(failures)
    if step is not None:
        raise CheckpointCorruptedError(f"step {step} cannot be restored on every rank: {detail}")
    raise CheckpointCorruptedError(f"no step could be restored on every rank ({len(candidates)} tried): {detail}")
