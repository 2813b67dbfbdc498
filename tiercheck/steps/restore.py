"""The read path: find committed steps, verify them, and bind them into a template.

Reading a step is two-phased: first every byte is read and checked against its
checksum (tensors land directly in the template's tensors where they can), and only
when the whole step verified are plain values written and `load_state_dict` called.
"""

from __future__ import annotations

import ctypes
import operator
import warnings
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar, Union

import numpy as np
import torch

from ..errors import CheckpointCorruptedError, NoCheckpointError, StateMismatchError, StepPrunedError
from ..format import naming
from ..format.checksum import checksum_function, checksum_stream, crc32c_combine
from ..format.dtypes import TORCH_DTYPES, numpy_dtype_from_name, torch_dtype_name
from ..format.manifest import LEAF_NODE_TYPES, Entry, Manifest, Marker, decode_key
from ..format.tree import ROOT, JsonNode, decode_plain, key_path
from ..job.agreement import RestoreAgreement
from ..observe.collector import collector_paused
from ..observe.events import report_missing_keys
from ..observe.progress import ProgressCallback, part_of
from ..state.flatten import dtensor_local, is_stateful
from ..tiers.base import Tier
from .catalog import (
    READ_CHUNK,
    ReplicaResolver,
    ShardFiles,
    ShardPrefetch,
    first_present_manifest,
    in_order,
    list_committed,
    prefetch_bytes,
    read_manifest,
    read_marker_and_guess,
    reading_committed,
)
from .catalog import READERS as _READERS  # threads reading large entries of a local shard
from .reshard import Resharder, consistent_keys

Producer = Callable[[], object]
_Target = Union[torch.Tensor, "np.ndarray[Any, Any]"]
_CPU = torch.device("cpu")
_T = TypeVar("_T")
_Memory = tuple[tuple[object, ...], int]  # (identity of a template tensor's memory, its byte span)
_MISSING = object()


@dataclass(slots=True)
class _Read:
    """`entry`'s bytes go to `dest`: a writable byte view, or a contiguous CPU tensor of
    exactly `entry.length` bytes (the uint8 view `_tensor_bytes`; for a read of at most
    `_SMALL_READ` bytes also a template's tensor itself, which `_place_run` copies into by
    address)."""

    entry: Entry
    dest: memoryview | torch.Tensor


@dataclass(frozen=True, slots=True)
class _Mode:
    """How a template subtree is matched (DESIGN.md section 1, the restore rules).

    Attributes:
        fill: write into the template's own dicts and lists (the user's state). False inside
            a stateful object: `load_state_dict` always gets fresh containers, since the ones
            `state_dict()` returned often alias the object's own state.
        cast: a template tensor of another dtype is not an error: the value is read into a
            fresh tensor (optimizer state, which `Optimizer.load_state_dict` casts itself).
    """

    fill: bool = True
    cast: bool = False


_FRESH = _Mode(fill=False)


class _Binder:
    """Matches a manifest tree against a template and plans the reads.

    Binding raises every template mismatch before a byte is read; the reads then land
    directly in the template's tensors where the rules allow, and the returned producer
    writes the rest (plain values, fresh containers, `load_state_dict`) once every byte
    verified.
    """

    def __init__(self, manifest: Manifest, step: int, parent: _Binder | None = None) -> None:
        self.entries = manifest.entries
        self.step = step
        self.reads: list[_Read] = parent.reads if parent else []
        self.fresh: dict[tuple[object, ...], torch.Tensor] = parent.fresh if parent else {}
        # replica node id -> (the binder of the rank holding the value, the value's node)
        self.replicas: dict[int, tuple[_Binder, JsonNode]] = parent.replicas if parent else {}
        # key paths of template keys the checkpoint lacks (an error unless strict=False)
        self.missing: list[str] = parent.missing if parent else []
        # template memory lent to the read: (device, address, shape, strides, dtype) ->
        # (the entry read into it, key path); every lent span, whose reads `place_lent`
        # plans once all are known; and the groups of them that overlap in memory
        self.lent: dict[tuple[object, ...], tuple[Entry, str]] = parent.lent if parent else {}
        self.spans: list[_Lent] = parent.spans if parent else []
        self.overlaps: list[_Overlap] = parent.overlaps if parent else []
        # DTensor leaves held here at another layout (another mesh, placements or world
        # size; a plain template; none): read from the saved pieces (`steps.reshard`)
        self.resharder: Resharder | None = parent.resharder if parent else None
        self.own = parent is None  # this manifest is this rank's own part

    def bind(self, tmpl: object, node: JsonNode, path: str, mode: _Mode) -> Producer:
        t = node["t"]
        if t in LEAF_NODE_TYPES:  # first: a large state is mostly leaves
            e = self.entries[node["e"]]
            if e.dtensor is not None and self.resharder is not None and self.resharder.wants(tmpl, e, self.own):
                return self.resharder.bind(tmpl, e, path, mode.fill)
            return self._tensor(tmpl, e, path, mode) if e.kind == "tensor" else self._leaf(tmpl, e, path, mode)
        if t == "replica":  # the value lives in another rank's part of this step
            owner, target = self.replicas[id(node)]
            return owner.bind(tmpl, target, path, mode)
        if t == "dict":
            return self._mapping(tmpl, node, path, mode)
        if t == "stateful":
            return self._mapping(tmpl, node["v"], path, mode)
        if t in ("list", "tuple"):
            return self._sequence(tmpl, node, path, mode)
        value = decode_plain(node)
        if mode.fill:
            self._refuse_conflict(tmpl, path, t)
        return lambda: value

    def _mismatch(self, path: str, what: str) -> StateMismatchError:
        return StateMismatchError(f"{path}: {what} (checkpoint step {self.step})")

    def _refuse_conflict(self, tmpl: object, path: str, what: str) -> None:
        """A tensor, array or stateful object in the user's template is never silently
        replaced by a value of another kind."""
        if isinstance(tmpl, (torch.Tensor, np.ndarray)) or is_stateful(tmpl):
            raise self._mismatch(path, f"the template holds a {type(tmpl).__name__}, the checkpoint a {what}")

    # -- leaves

    def _leaf(self, tmpl: object, e: Entry, path: str, mode: _Mode) -> Producer:
        if e.kind == "tensor":
            return self._tensor(tmpl, e, path, mode)
        if mode.fill and not (isinstance(tmpl, np.ndarray) and e.kind == "ndarray"):
            self._refuse_conflict(tmpl, path, e.kind)
        if e.kind == "bytes":
            raw = bytearray(e.length)
            self.reads.append(_Read(e, memoryview(raw)))
            return lambda: bytes(raw)
        npd = numpy_dtype_from_name(e.dtype)
        assert npd is not None
        if isinstance(tmpl, np.ndarray) and e.kind == "ndarray":
            if tmpl.dtype != npd or tmpl.shape != e.shape:
                raise self._mismatch(
                    path, f"template array is {tmpl.dtype} {tmpl.shape}, checkpoint has {npd} {e.shape}"
                )
            if tmpl.flags.writeable:
                lent = self._lend(tmpl, _array_memory(tmpl), e, path)
                if lent is not None:
                    return lent
        arr: np.ndarray[Any, Any] = np.empty(e.shape, dtype=npd)
        self.reads.append(_Read(e, _bytes_of(arr)))
        if e.kind == "npscalar":
            return lambda: arr[()]
        return lambda: arr

    def _tensor(self, tmpl: object, e: Entry, path: str, mode: _Mode) -> Producer:
        dtype = TORCH_DTYPES[e.dtype]
        if (
            (type(tmpl) is torch.Tensor or type(tmpl) is torch.nn.Parameter)
            and tmpl.dtype == dtype
            and tmpl.shape == e.shape
            and e.length
            and tmpl.is_cpu
            and tmpl.is_contiguous()
            and not tmpl.is_conj()
            and not tmpl.is_neg()
        ):  # the common case in few steps (a state of many small tensors spends its time here)
            plain = self._lend_plain(tmpl, dtype, e, path)
            if plain is not None:
                return plain
        elif isinstance(tmpl, torch.Tensor):
            if type(tmpl) not in (torch.Tensor, torch.nn.Parameter):
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
            same_dtype = torch_dtype_name(tmpl.dtype) == e.dtype
            if tuple(tmpl.shape) != e.shape or not (same_dtype or mode.cast):
                raise self._mismatch(
                    path, f"template tensor is {tmpl.dtype} {tuple(tmpl.shape)}, checkpoint has {dtype} {e.shape}"
                )
            # A meta tensor has no memory to fill: it is materialised from the checkpoint.
            if same_dtype and tmpl.device.type != "meta":
                lent = self._lend(tmpl, _tensor_memory(tmpl), e, path)
                if lent is not None:
                    return lent
        elif mode.fill:
            self._refuse_conflict(tmpl, path, "tensor")
        region = _region(e)
        fresh = self.fresh.get(region) if e.length else None
        if fresh is None:  # tied tensors come back tied, read once
            fresh = self.fresh[region] = torch.empty(e.shape, dtype=dtype)
            self._plan_read(e, fresh)
        return lambda: fresh

    def _lend(self, tmpl: _Target, memory: _Memory | None, e: Entry, path: str) -> Producer | None:
        """Plan the read of `e` into the template's own memory; None when that memory is
        already lent to another checkpoint value (two template keys share one tensor that
        the checkpoint holds as two values): then `e` is read into a fresh tensor, which
        replaces that key's value, so neither read clobbers the other."""
        if memory is None:  # empty: nothing to read
            return self._into(tmpl, e)
        identity, span = memory
        known = self.lent.get(identity)
        if known is not None:
            return (lambda: tmpl) if _region(known[0]) == _region(e) else None  # tied on both sides: read once
        self.lent[identity] = (e, path)
        device, low = str(identity[0]), int(identity[1])  # type: ignore[call-overload]
        # numpy and CPU tensors can share memory (torch.from_numpy): one address space
        lent = _Lent(tmpl, e, path, device if isinstance(tmpl, torch.Tensor) else "cpu", low, low + span)
        self.spans.append(lent)
        return lent

    def _lend_plain(self, tmpl: torch.Tensor, dtype: torch.dtype, e: Entry, path: str) -> Producer | None:
        """`_lend` of a contiguous CPU tensor of `e`'s dtype and shape, not a conjugate or
        negative view (the same identity as `_tensor_memory`'s, so it ties with the others)."""
        low = tmpl.data_ptr()
        identity = (_CPU, low, e.shape, tmpl.stride(), dtype)
        known = self.lent.get(identity)
        if known is not None:
            return _returns(tmpl) if _region(known[0]) == _region(e) else None  # tied on both sides: read once
        self.lent[identity] = (e, path)
        lent = _Lent(tmpl, e, path, "cpu", low, low + e.length, plain=True)
        self.spans.append(lent)
        return lent

    def _into(self, tmpl: _Target, e: Entry) -> Producer:
        return self._into_tensor(tmpl, e) if isinstance(tmpl, torch.Tensor) else self._into_array(tmpl, e)

    def place_lent(self) -> None:
        """Plan the reads into lent template memory, once binding has lent all of it: in
        place where a span overlaps no other, else read aside as one `_Overlap` per group of
        views that overlap (transitively), checked and written only once every byte verified.
        The byte views of template tensors are made without autograd (`_place_run` copies
        into them the same way): a parameter's view needs no graph, only its memory."""
        with torch.no_grad():
            self._place_lent()

    def _place_lent(self) -> None:
        spans = sorted(self.spans, key=_BY_ADDRESS)
        # Sorted by start, spans none of which ends after the next one starts overlap nowhere
        # (a device change between two may fail this test: the loop below then decides).
        if all(map(operator.le, map(_HIGH, spans), map(_LOW, islice(spans, 1, None)))):
            for lent in spans:
                self._place_one(lent)
            return
        group: list[_Lent] = []
        high = 0
        for lent in spans:
            if group and (lent.device != group[0].device or lent.low >= high):
                self._place(group)
                group = []
            high = lent.high if not group else max(high, lent.high)
            group.append(lent)
        if group:
            self._place(group)

    def _place_one(self, lent: _Lent) -> None:
        """The read of a lent span that overlaps no other: into the template's own memory."""
        if lent.plain:  # `_into_tensor`, its checks made by `_lend_plain`
            t = lent.tmpl
            assert isinstance(t, torch.Tensor)
            # a small read is copied by address (`_place_run`): the tensor itself will do
            self.reads.append(_Read(lent.entry, t if lent.entry.length <= _SMALL_READ else _tensor_bytes(t)))
            lent.produce = None  # the template's tensor itself
        else:
            lent.produce = self._into(lent.tmpl, lent.entry)

    def _place(self, group: list[_Lent]) -> None:
        if len(group) == 1:
            self._place_one(group[0])
            return
        odd = next((g for g in group if not _plain_memory(g.tmpl)), None)
        if odd is not None:
            others = " and ".join(g.path for g in group if g is not odd)
            raise StateMismatchError(
                f"{odd.path} and {others}: template tensors overlap in memory, and {odd.path} is a conjugate, "
                f"negative or expanded view whose bytes cannot be checked against checkpoint step {self.step}; "
                "give the template separate tensors"
            )
        self.overlaps.append(_Overlap(group, self.step))
        for g in group:
            g.produce = None  # the template's value, written by `_Overlap.write`

    def _into_tensor(self, tmpl: torch.Tensor, e: Entry) -> Producer:
        target = tmpl.detach()
        if target.device.type == "cpu" and target.is_contiguous() and not target.is_conj() and not target.is_neg():
            self._plan_read(e, target)
            return _returns(tmpl)
        staging = torch.empty(e.shape, dtype=target.dtype)
        self._plan_read(e, staging)

        def copy_back() -> object:
            target.copy_(staging)
            return tmpl

        return copy_back

    def _into_array(self, tmpl: np.ndarray[Any, Any], e: Entry) -> Producer:
        if tmpl.flags.c_contiguous:
            self.reads.append(_Read(e, _bytes_of(tmpl)))
            return lambda: tmpl
        staged: np.ndarray[Any, Any] = np.empty(e.shape, dtype=tmpl.dtype)
        self.reads.append(_Read(e, _bytes_of(staged)))

        def copy_back() -> object:
            tmpl[...] = staged
            return tmpl

        return copy_back

    def _plan_read(self, e: Entry, t: torch.Tensor) -> None:
        """Read `e` into `t`, a contiguous CPU tensor of `e`'s bytes (not a conjugate or negative view)."""
        if not e.length:
            self.reads.append(_Read(e, memoryview(b"")))
        elif type(t) is torch.Tensor:
            self.reads.append(_Read(e, _tensor_bytes(t)))
        else:  # a subclass's own torch functions are not called with a list of others' tensors
            self.reads.append(_Read(e, _bytes_of(_tensor_bytes(t).numpy())))

    # -- containers

    def _mapping(self, tmpl: object, node: JsonNode, path: str, mode: _Mode) -> Producer:
        children = _children(node)
        if mode.fill and is_stateful(tmpl):
            return self._load_into(tmpl, children, path, mode)
        if mode.fill and isinstance(tmpl, Mapping):
            return self._fill_mapping(tmpl, children, path, mode)
        if mode.fill:
            self._refuse_conflict(tmpl, path, "dict")
        hint: Mapping[Any, Any] = tmpl if isinstance(tmpl, Mapping) and not mode.fill else {}
        built = [(k, self.bind(hint.get(k), child, key_path(path, k), mode)) for k, child in children.items()]
        return lambda: {k: p() for k, p in built}

    def _fill_mapping(self, tmpl: Mapping[Any, Any], children: dict[Any, JsonNode], path: str, mode: _Mode) -> Producer:
        """The user's dict: it gets every key the checkpoint holds (only the top level may
        name a subset), and a template key the checkpoint lacks is an error or reported."""
        self.missing.extend(key_path(path, k) for k in tmpl if k not in children)
        top = path == ROOT
        producers = [
            (k, self.bind(tmpl.get(k), child, key_path(path, k), mode))
            for k, child in children.items()
            if not top or k in tmpl
        ]

        def fill() -> object:
            for k, p in producers:
                v = p()
                if k in tmpl and tmpl[k] is v:
                    continue
                if not isinstance(tmpl, MutableMapping):
                    raise self._mismatch(key_path(path, k), "read-only mapping in the template")
                tmpl[k] = v
            return tmpl

        return fill

    def _load_into(self, tmpl: Any, children: dict[Any, JsonNode], path: str, mode: _Mode) -> Producer:
        """A stateful object gets `load_state_dict` with fresh containers. Only modules and
        optimizers lend the tensors of their `state_dict()` to the read: their
        `load_state_dict` copies values in (so the model is not held twice in memory); any
        other object gets fresh tensors, since its `load_state_dict` may clear or zero its
        own tensors before reading the ones it is given."""
        hint: Mapping[Any, Any] = {}
        sub = _FRESH
        assign = False
        if isinstance(tmpl, (torch.nn.Module, torch.optim.Optimizer)):
            try:
                hint = tmpl.state_dict()
            except Exception as exc:
                raise self._mismatch(path, f"{type(tmpl).__name__}.state_dict() raised {exc!r}") from exc
            if isinstance(tmpl, torch.optim.Optimizer):
                sub = _Mode(fill=False, cast=True)
                self._check_param_groups(tmpl, children.get("param_groups"), path)
                self._check_dtensor_state(tmpl, children.get("state"), path)
                if any(p.device.type == "meta" for g in tmpl.param_groups for p in g["params"]):
                    raise self._mismatch(
                        path,
                        "the optimizer's parameters are on the meta device, where its state cannot be "
                        "loaded; materialise the model first (restore it, or to_empty()), then build "
                        "the optimizer over its parameters and restore that",
                    )
            else:  # a module built on the meta device (for to_empty()) gets the checkpoint's tensors
                assign = any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in hint.values())
        built = [(k, self.bind(hint.get(k), child, key_path(path, k), sub)) for k, child in children.items()]

        def load() -> object:
            sd = {k: p() for k, p in built}
            try:
                if assign:
                    tmpl.load_state_dict(sd, assign=True)
                else:
                    tmpl.load_state_dict(sd)
            except Exception as exc:
                raise self._mismatch(
                    path, f"{type(tmpl).__name__}.load_state_dict() rejected the checkpoint: {exc}"
                ) from exc
            return tmpl

        return load

    def _check_dtensor_state(self, opt: torch.optim.Optimizer, node: JsonNode | None, path: str) -> None:
        """An optimizer over DTensor parameters whose state is still empty cannot say what
        layout its DTensor state (exp_avg, ...) takes here: refused before a byte is read,
        rather than loaded as plain tensors that its next step() cannot mix with DTensors."""
        if opt.state or node is None:
            return
        if not any(type(p) not in (torch.Tensor, torch.nn.Parameter) for g in opt.param_groups for p in g["params"]):
            return
        stack = [node]
        while stack:
            n = stack.pop()
            t = n.get("t")
            if t in ("tensor", "ndarray", "npscalar", "bytes"):
                if self.entries[n["e"]].dtensor is not None:
                    raise self._mismatch(
                        key_path(path, "state"),
                        "the optimizer holds no state yet, so the layout its DTensor state (exp_avg, ...) takes "
                        "on this mesh is unknown; initialise it first (zero gradients and one optimizer.step() "
                        "with lr 0, as torch.distributed.checkpoint.state_dict.set_state_dict does), then restore",
                    )
            elif t == "dict" or t in ("list", "tuple"):
                stack.extend(n["v"])
            elif t == "stateful":
                stack.append(n["v"])

    def _check_param_groups(self, opt: torch.optim.Optimizer, node: JsonNode | None, path: str) -> None:
        """What `Optimizer.load_state_dict` refuses (another number of parameter groups, or of
        parameters in a group), refused here, while binding: its own refusal comes after the
        read, when the model's tensors, filled in place, already hold the checkpoint's."""
        if node is None or node.get("t") not in ("list", "tuple"):
            return  # not an optimizer's state dict as saved: load_state_dict says what is wrong
        groups: list[JsonNode] = node["v"]
        where = key_path(path, "param_groups")
        if len(groups) != len(opt.param_groups):
            raise self._mismatch(
                where,
                f"the optimizer has {len(opt.param_groups)} parameter groups, the checkpoint {len(groups)}; "
                "nothing was restored",
            )
        for i, (group, mine) in enumerate(zip(groups, opt.param_groups, strict=True)):
            if group.get("t") != "dict":
                continue
            params = _children(group).get("params")
            if params is not None and params.get("t") in ("list", "tuple") and len(params["v"]) != len(mine["params"]):
                raise self._mismatch(
                    key_path(where, i),
                    f"the optimizer's group {i} has {len(mine['params'])} parameters, the checkpoint's "
                    f"{len(params['v'])}; nothing was restored",
                )

    def _sequence(self, tmpl: object, node: JsonNode, path: str, mode: _Mode) -> Producer:
        """Lists and tuples take the checkpoint's value whatever the template held; a
        template of the same length lends its elements (tensors filled in place)."""
        items: list[JsonNode] = node["v"]
        kind = list if node["t"] == "list" else tuple
        same = isinstance(tmpl, (list, tuple)) and len(tmpl) == len(items)
        if mode.fill and not same:
            self._refuse_conflict(tmpl, path, node["t"])
        hints: Sequence[object] = tmpl if same else [None] * len(items)  # type: ignore[assignment]
        producers = [self.bind(hints[i], cv, key_path(path, i), mode) for i, cv in enumerate(items)]
        if mode.fill and same and isinstance(tmpl, list) and kind is list:
            target = tmpl

            def fill() -> object:
                for i, p in enumerate(producers):
                    v = p()
                    if target[i] is not v:
                        target[i] = v
                return target

            return fill
        return lambda: kind(p() for p in producers)


def _children(node: JsonNode) -> dict[Any, JsonNode]:
    """A saved dict node's children by their (decoded) keys."""
    return dict(zip((decode_key(k) for k in node["k"]), node["v"], strict=True))


def _tensor_memory(t: torch.Tensor) -> _Memory | None:
    """(identity, byte span) of a tensor's memory; None when it holds no bytes."""
    numel = t.numel()
    if numel == 0:
        return None
    stride = t.stride()
    if t.is_contiguous():
        span = numel * t.element_size()
    else:
        span = (sum((n - 1) * st for n, st in zip(t.shape, stride, strict=True)) + 1) * t.element_size()
    return (t.device, t.data_ptr(), tuple(t.shape), stride, t.dtype), span


def _array_memory(a: np.ndarray[Any, Any]) -> _Memory | None:
    if a.size == 0:
        return None
    span = sum((n - 1) * abs(st) for n, st in zip(a.shape, a.strides, strict=True)) + a.itemsize  # strides in bytes
    address = int(a.__array_interface__["data"][0])
    low = address + sum((n - 1) * st for n, st in zip(a.shape, a.strides, strict=True) if st < 0)
    return ("numpy", low, a.shape, a.strides, a.dtype.str), span


def _unplaced() -> object:
    raise AssertionError("place_lent runs before any value is produced")


@dataclass(slots=True)
class _Lent:
    """Template memory lent to the read of `entry`; `produce` is planned by `place_lent`.

    Attributes:
        low, high: the byte span the value's elements lie in.
        plain: lent by `_lend_plain`.
        produce: what makes the value; None: the template's value itself, read in place.
    """

    tmpl: _Target
    entry: Entry
    path: str
    device: str
    low: int
    high: int
    plain: bool = False
    produce: Producer | None = _unplaced

    def __call__(self) -> object:
        produce = self.produce
        return self.tmpl if produce is None else produce()

    def bytes_view(self, scratch: np.ndarray[Any, Any], low: int) -> np.ndarray[Any, Any]:
        """The value's bytes as they would lie in `scratch`, a copy of memory from `low` on:
        shape + (element size,), C order like the checkpoint's bytes."""
        if isinstance(self.tmpl, torch.Tensor):  # torch has no negative strides: element 0 is at `low`
            start, strides = self.low, tuple(s * self.tmpl.element_size() for s in self.tmpl.stride())
        else:
            start, strides = int(self.tmpl.__array_interface__["data"][0]), tuple(self.tmpl.strides)
        view: np.ndarray[Any, Any] = np.ndarray(self.byte_shape(), np.uint8, scratch, start - low, (*strides, 1))
        return view

    def byte_shape(self) -> tuple[int, ...]:
        """The checkpoint value's shape + (element size,): its bytes as a uint8 array."""
        return (*self.entry.shape, self.entry.length // max(1, int(np.prod(self.entry.shape))))


class _Overlap:
    """Template views that share memory (`b = a[1]`, `base.t()`), the checkpoint holding
    each as its own value: the values are read aside, then written in key order into a
    scratch span and read back. Only when every view reads back exactly what was saved
    (the checkpoint was saved from the same overlapping memory) are they written into the
    template, and read back there once more; otherwise the restore is refused before any
    byte of the template changed."""

    def __init__(self, members: list[_Lent], step: int) -> None:
        self.members = members
        self.step = step
        self.staged = [np.empty(m.entry.length, np.uint8) for m in members]
        self.reads = [_Read(m.entry, _bytes_of(b)) for m, b in zip(members, self.staged, strict=True)]

    def _saved(self, i: int) -> np.ndarray[Any, Any]:
        return self.staged[i].reshape(self.members[i].byte_shape())

    def check(self) -> None:
        """Raise StateMismatchError unless one memory state reads back every saved value."""
        low = min(m.low for m in self.members)
        scratch = np.zeros(max(m.high for m in self.members) - low, np.uint8)
        views = [m.bytes_view(scratch, low) for m in self.members]
        for i, v in enumerate(views):
            v[...] = self._saved(i)
        for i, v in enumerate(views):
            if not np.array_equal(v, self._saved(i)):
                raise self._disagree(i)

    def _disagree(self, i: int) -> StateMismatchError:
        m = self.members[i]
        # a later value in write order overwrote some of this one's bytes
        later = [o for o in self.members[i + 1 :] if o.low < m.high and m.low < o.high] or [
            o for o in self.members if o is not m
        ]
        return StateMismatchError(
            f"{m.path} and {later[0].path}: template tensors overlap in memory, and checkpoint step {self.step} "
            "holds values that disagree where they overlap (it was not saved from memory shared this way); "
            "give the template separate tensors"
        )

    def write(self) -> None:
        """Write the checked values into the template, then read each back (bit-exact)."""
        for i, m in enumerate(self.members):
            saved = self.staged[i]
            if isinstance(m.tmpl, torch.Tensor):
                value = torch.from_numpy(saved).view(m.tmpl.dtype).reshape(m.tmpl.shape)
                m.tmpl.detach().copy_(value)
            else:
                m.tmpl[...] = saved.view(m.tmpl.dtype).reshape(m.tmpl.shape)
        for i, m in enumerate(self.members):
            if isinstance(m.tmpl, torch.Tensor):
                back = m.tmpl.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            else:
                back = np.ascontiguousarray(m.tmpl).reshape(-1).view(np.uint8)
            if not np.array_equal(back, self.staged[i]):
                raise StateMismatchError(
                    f"{m.path}: does not read back the value of checkpoint step {self.step} after it was "
                    "written into the template's overlapping views (was the template changed meanwhile?)"
                )


def _plain_memory(t: _Target) -> bool:
    """Bytes that are the value: not a conjugate or negative view, no element twice."""
    if isinstance(t, torch.Tensor):
        if t.is_conj() or t.is_neg():
            return False
        strides = t.stride()
    else:
        strides = t.strides
    return all(st != 0 or n <= 1 for n, st in zip(t.shape, strides, strict=True))


def _returns(value: object) -> Producer:
    return lambda: value


def _region(e: Entry) -> tuple[object, ...]:
    """Where `e`'s bytes lie and what they are: entries equal in it are one value (tied)."""
    return (e.file, e.offset, e.length, e.dtype, e.shape)


_BY_ADDRESS = operator.attrgetter("device", "low")
_LOW = operator.attrgetter("low")
_HIGH = operator.attrgetter("high")


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    return t.reshape(-1).view(torch.uint8)


def _bytes_of(arr: np.ndarray[Any, Any]) -> memoryview:
    """A writable byte view of a C-contiguous array's memory."""
    return memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


# ------------------------------------------------------------------- reading a step


def read_step(
    tier: Tier,
    step: int,
    rank: int,
    template: object,
    strict: bool,
    world_size: int | None = None,
    progress: ProgressCallback | None = None,
    sources: Sequence[Tier] = (),
) -> object:
    """Read `step` from `tier` into `template` (or fresh values if None); verify every byte.
    `sources`: the tiers after it, where other ranks' parts are read from when resharding.

    Raises:
        CheckpointCorruptedError: missing, short or altered bytes; the template's tensors
            may then hold partial data, its plain values and stateful objects are untouched.
        StateMismatchError: the template does not fit the checkpoint. Raised before any byte
            is read, except when a stateful object's `load_state_dict` itself rejects the
            checkpoint after its tensors were filled.
    """
    with collector_paused():  # until the read's objects are freed too: none is left for a collection
        return prepare_step(tier, step, rank, template, strict, world_size, progress, sources)()


def prepare_step(
    tier: Tier,
    step: int,
    rank: int,
    template: object,
    strict: bool,
    world_size: int | None = None,
    progress: ProgressCallback | None = None,
    sources: Sequence[Tier] = (),
) -> Producer:
    """Read and verify `step` (tensors land in the template's tensors); return the function
    that then writes plain values and calls `load_state_dict` (see `read_step`).

    `world_size` is the restoring job's: when it differs from the checkpoint's, only the
    replicated top-level keys can be restored, read through rank 0's manifest."""
    with collector_paused():
        return _prepare_step(tier, step, rank, template, strict, world_size, progress, sources)


def _prepare_step(
    tier: Tier,
    step: int,
    rank: int,
    template: object,
    strict: bool,
    world_size: int | None,
    progress: ProgressCallback | None,
    sources: Sequence[Tier] = (),
) -> Producer:
    marker, guessed = read_marker_and_guess(tier, step, rank, world_size)  # one round trip for both
    resized = world_size is not None and world_size != marker.world_size
    # This rank's own shard, asked of the disk while its manifest is decoded and bound.
    own = not resized and 0 <= rank < marker.world_size
    shard = naming.shard_name(rank, marker.world_size) if own else None
    ahead = prefetch_bytes(marker.manifests[rank].length) if own else 0
    with ShardPrefetch(tier, step, shard, ahead):
        return _prepare_read(
            tier, step, rank, marker, guessed, resized, template, strict, world_size, progress, sources
        )


def _prepare_read(
    tier: Tier,
    step: int,
    rank: int,
    marker: Marker,
    guessed: bytes | None,
    resized: bool,
    template: object,
    strict: bool,
    world_size: int | None,
    progress: ProgressCallback | None,
    sources: Sequence[Tier],
) -> Producer:
    # Resized: any rank's view holds the replicated keys; take the first one this tier has.
    if resized:
        manifest = first_present_manifest(tier, step, marker)
    else:
        manifest = read_manifest(tier, step, rank, marker, guessed)
    resharder = None
    if resized or any(e.dtensor is not None for e in manifest.entries):
        resharder = Resharder([tier, *sources], step, marker, rank, world_size)
    tree = manifest.tree
    differing: list[str] = []
    if world_size is not None and resized:
        assert resharder is not None
        saved = marker.world_size
        tree, differing = _resized_view(tier, step, manifest, saved, world_size, template, strict, resharder)
    binder = _Binder(manifest, step)
    binder.resharder = resharder
    binder.own = not resized

    manifests = {manifest.rank: manifest}
    replicas = ReplicaResolver(tier, step, marker, manifests)
    owners: dict[int, _Binder] = {}
    for k, node in zip(tree["k"], tree["v"], strict=True):
        if node["t"] != "replica" or (isinstance(template, Mapping) and decode_key(k) not in template):
            continue
        owner, target = replicas.resolve(k, node["r"], manifest.rank)
        if owner.rank not in owners:
            owners[owner.rank] = _Binder(owner, step, binder)
        binder.replicas[id(node)] = (owners[owner.rank], target)
    # Sizes first: the manifest's regions are validated against the sizes it declares, so
    # once the opener matched those to the real files, nothing below allocates more than they hold.
    with ShardFiles(tier, step, (sf for m in manifests.values() for sf in m.files)) as files:
        try:
            produce = binder.bind(template, tree, ROOT, _Mode())
        except RecursionError:
            raise CheckpointCorruptedError(f"{tier.path_of(step)}: the state tree is nested too deep") from None
        except (MemoryError, RuntimeError) as exc:  # sizes a compressed shard cannot bound
            raise CheckpointCorruptedError(
                f"{tier.path_of(step)}: cannot allocate what the manifest claims: {exc}"
            ) from None
        binder.place_lent()
        if differing:  # say why a per-rank key was left as it is
            why = {d.split(" (", 1)[0]: d for d in differing}
            binder.missing[:] = [why.get(m, m) for m in binder.missing]
        if binder.missing and strict:
            raise StateMismatchError(
                f"{', '.join(binder.missing)}: template key(s) not in the checkpoint (step {step}); "
                "drop them from the template, or restore(state, strict=False) to leave them as they are"
            )
        _read_overlaps_first(tier, step, files, binder, manifest.checksum_algorithm, progress)
        files.check_ends()
        if resharder is not None:
            resharder.read_all()
    for overlap in binder.overlaps:
        overlap.write()
    if not binder.missing:
        return produce
    missing = tuple(binder.missing)

    def produce_and_report() -> object:
        value = produce()
        report_missing_keys(step, tier.name, missing)
        return value

    return produce_and_report


def _resized_view(
    tier: Tier,
    step: int,
    manifest: Manifest,
    saved_world: int,
    world_size: int,
    template: object,
    strict: bool,
    resharder: Resharder,
) -> tuple[JsonNode, list[str]]:
    """The part of the reference manifest's tree that any rank of a job of another size may
    restore, and the template keys left out (restore(strict=False)). Replicated keys always;
    a per-rank key when every saved rank holds it alike (its DTensors are pieces of one
    tensor, everything else byte-equal: a `step`, a config, a scheduler stepped alike).
    A per-rank key whose saved ranks differ (RNG states, a data-loader position) is an error
    naming every such key, or with strict=False is left as it is and reported."""
    tree = manifest.tree
    replicated = set(manifest.replicated)
    wanted = set(template) if isinstance(template, Mapping) and not is_stateful(template) else None
    per_rank = [
        tuple(k) for k in tree["k"] if tuple(k) not in replicated and (wanted is None or decode_key(k) in wanted)
    ]
    keep = set(replicated)
    left: list[str] = []
    if per_rank:
        alike = consistent_keys(resharder.all_manifests())
        keep |= {k for k in per_rank if k in alike}
        bad = [f"{ROOT}[{decode_key(list(k))!r}]" for k in per_rank if k not in alike]
        if wanted is None:  # no template (`load`): what every new rank may hold, no more
            bad = []
        if bad and strict:
            raise StateMismatchError(
                f"step {step} ({tier.path_of(step)}) was saved by {saved_world} ranks; this job has {world_size}. "
                f"These per-rank keys differ between the saved ranks, so no new rank can take one of them as "
                f"its own: {', '.join(bad)}. Drop them from the template (and set them yourself, e.g. a fresh "
                "RNG seed per new rank, a data-loader position rebuilt from the step), save them as "
                "replicated if they are the same on every rank, or restore(state, strict=False) to leave "
                "them as they are"
            )
        left = [f"{b} (differs between the {saved_world} saved ranks)" for b in bad]
    pairs = [(k, v) for k, v in zip(tree["k"], tree["v"], strict=True) if tuple(k) in keep]
    return {"t": "dict", "k": [k for k, _ in pairs], "v": [v for _, v in pairs]}, left


def _read_overlaps_first(
    tier: Tier,
    step: int,
    files: ShardFiles,
    binder: _Binder,
    algorithm: str,
    progress: ProgressCallback | None,
) -> None:
    """`_read_verified` of every planned read; the values of overlapping template views
    first, checked for agreement before any read lands in the template, so a refused
    restore changes nothing."""
    if not binder.overlaps:
        _read_verified(tier, step, files, binder.reads, algorithm, progress)
        return
    aside = [r for o in binder.overlaps for r in o.reads]
    first = sum(r.entry.length for r in aside)
    total = first + sum(r.entry.length for r in binder.reads)
    _read_verified(tier, step, files, aside, algorithm, part_of(progress, 0, total))
    for overlap in binder.overlaps:
        overlap.check()
    _read_verified(tier, step, files, binder.reads, algorithm, part_of(progress, first, total))


def _read_verified(
    tier: Tier,
    step: int,
    files: ShardFiles,
    reads: Sequence[_Read],
    algorithm: str,
    progress: ProgressCallback | None = None,
) -> None:
    """Read every entry in file order, checksumming on a helper thread chunk by chunk while
    the next chunk is read, so verification costs no time when the disk is the bottleneck;
    large entries of local shards on several threads instead (`_read_large_parallel`).
    Runs of small entries (`_small_runs`) take one read and one task each, which checks
    them and only then copies them to their destinations (`_verify_run`). A read of one run
    and nothing else has nothing to overlap: it is checked on this thread (`_Inline`), with
    no helper thread started (at 1,000 x 4 KiB, 1.6 ms of a 22.6 ms restore)."""
    pending: list[tuple[Entry, Future[str]]] = []
    batched: list[tuple[list[_Read], Future[list[str] | None]]] = []
    checked: list[tuple[Entry, str]] = []
    total = sum(r.entry.length for r in reads) if progress is not None else 0
    done = 0
    large, runs = _small_runs(reads)
    inline = not large and len(runs) <= 1
    with _Inline() if inline else ThreadPoolExecutor(1, thread_name_prefix="tiercheck-verify") as hasher:
        try:
            for run in runs:
                if len(batched) >= _RUNS_AHEAD:  # each run's buffer lives until its task ran
                    batched[-_RUNS_AHEAD][1].result()
                start, buf = _read_run(files, run)
                batched.append((run, hasher.submit(_verify_run, algorithm, run, start, buf)))
                if progress is not None:
                    done += sum(r.entry.length for r in run)
                    progress(done, total)
            if _in_parallel(files, large):
                for n in _read_large_parallel(files, large, algorithm, checked):
                    if progress is not None:
                        done += n
                        progress(done, total)
            else:
                for r in large:
                    e, dest = r.entry, _writable(r.dest)
                    h = checksum_stream(algorithm)
                    for pos in range(0, len(dest), READ_CHUNK):
                        chunk = dest[pos : pos + READ_CHUNK]
                        files.read_into(e.file, e.offset + pos, chunk)
                        hasher.submit(h.update, chunk)
                        if progress is not None:
                            done += len(chunk)
                            progress(done, total)
                    pending.append((e, hasher.submit(h.hexdigest)))
        except BaseException:
            for fut in [f for _, f in pending] + [f for _, f in batched]:
                fut.cancel()
            raise
        checked += [(e, fut.result()) for e, fut in pending]
        for run, bfut in batched:
            got = bfut.result()
            if got is not None:  # some digest differs: the check below names the entry
                checked += zip(map(_ENTRY, run), got, strict=True)
        for e, digest in checked:
            if digest != e.checksum:
                raise CheckpointCorruptedError(
                    f"{tier.path_of(step, e.file)}: checksum mismatch for {e.path} "
                    f"(bytes {e.offset}..{e.offset + e.length})"
                )


class _Inline:
    """An executor that runs each task when it is submitted, on the caller's thread: its
    future is done on return, holding the result or the exception, as a pool's would."""

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def submit(self, fn: Callable[..., _T], /, *args: Any) -> Future[_T]:
        fut: Future[_T] = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:
            fut.set_exception(exc)
        return fut


def _in_parallel(files: ShardFiles, reads: Sequence[_Read]) -> bool:
    """Whether large reads go to `_read_large_parallel`: more than one thread to use, more
    than one piece to read, and every shard read a positional read of a local file (tier 0
    in shared memory, tier 1 on NVMe); a decoder or a remote reader keeps state."""
    pieces = sum(-(-r.entry.length // _PIECE) for r in reads)
    return _READERS > 1 and pieces > 1 and all(files.concurrent(r.entry.file) for r in reads)


def _read_large_parallel(
    files: ShardFiles, reads: Sequence[_Read], algorithm: str, checked: list[tuple[Entry, str]]
) -> Iterator[int]:
    """Read large entries straight into their destinations on `_READERS` threads, each
    thread reading a piece a few MiB at a time and hashing each chunk right after reading
    it, while it is still in the CPU's cache: one pass over memory, as a plain copy makes
    (reading on one thread and hashing on another passed over it twice, and one thread's
    copy out of the page cache was the bottleneck). With CRC-32C an entry is cut into
    `_PIECE`-byte pieces whose CRCs are combined in order (`crc32c_combine`), so one huge
    tensor is read in parallel too; other algorithms hash an entry on one thread. Yields
    the bytes of each piece done, in order; appends (entry, digest) to `checked`."""
    todo: list[tuple[_Read, int, int]] = []  # (read, offset in the entry, bytes)
    for r in reads:
        piece = _PIECE if algorithm == "crc32c" else r.entry.length
        todo += [(r, pos, min(piece, r.entry.length - pos)) for pos in range(0, r.entry.length, piece)]
    calls = ((files, r.entry.file, r.entry.offset + p, _writable(r.dest)[p : p + n], algorithm) for r, p, n in todo)
    parts: list[tuple[int, str]] = []  # (bytes, digest) of the entry's pieces so far
    # the reads first: their generator ends (its pool joined) before zip looks at `todo` again
    for digest, (r, pos, n) in zip(in_order(_read_hashed, calls, _READERS, "tiercheck-read"), todo, strict=True):
        parts.append((n, digest))
        if pos + n == r.entry.length:  # its last piece (pieces come in order)
            checked.append((r.entry, _joined(parts)))
            parts = []
        yield n


def _read_hashed(files: ShardFiles, name: str, offset: int, dest: memoryview, algorithm: str) -> str:
    h = checksum_stream(algorithm)
    for pos in range(0, len(dest), _HASH_CHUNK):
        chunk = dest[pos : pos + _HASH_CHUNK]
        files.read_into(name, offset + pos, chunk)
        h.update(chunk)
    return h.hexdigest()


def _joined(parts: list[tuple[int, str]]) -> str:
    """The digest of an entry from its pieces' (length, digest), in order (one piece: its
    digest; several: CRC-32C only)."""
    if len(parts) == 1:
        return parts[0][1]
    crc = int(parts[0][1], 16)
    for n, digest in parts[1:]:
        crc = crc32c_combine(crc, int(digest, 16), n)
    return f"{crc:08x}"


_PIECE = 64 << 20  # bytes of an entry one thread reads and hashes (CRC-32C: pieces combined)
_HASH_CHUNK = 2 << 20  # bytes read, then hashed while in cache


_SMALL_READ = 1 << 20  # entries up to this size are read in runs (`_small_runs`)
_RUN_BYTES = 4 << 20  # file bytes one run's read spans at most (8 MiB: 100 x 164 KiB restored 1.1x slower)
_RUNS_AHEAD = 2  # runs read but not yet verified and copied, at most


def _small_runs(reads: Sequence[_Read]) -> tuple[list[_Read], list[list[_Read]]]:
    """The large reads, and the small ones grouped in runs of one file spanning at most
    `_RUN_BYTES`, all in file order: a state of many small tensors is read (and hashed) a
    few MiB per call, not one system call and two checksum tasks per leaf."""
    large: list[_Read] = []
    runs: list[list[_Read]] = []
    run: list[_Read] = []
    file: str | None = None
    start = 0  # the offset of the run's first read
    for r in sorted(reads, key=_IN_FILE_ORDER):
        e = r.entry
        if e.length > _SMALL_READ:
            large.append(r)
        elif e.file != file or e.offset + e.length - start > _RUN_BYTES:
            run = [r]
            runs.append(run)
            file, start = e.file, e.offset
        else:
            run.append(r)
    return large, runs


_IN_FILE_ORDER = operator.attrgetter("entry.file", "entry.offset")
_ENTRY = operator.attrgetter("entry")
_OFFSET = operator.attrgetter("offset")
_LENGTH = operator.attrgetter("length")
_CHECKSUM = operator.attrgetter("checksum")


def _writable(dest: memoryview | torch.Tensor) -> memoryview:
    return _bytes_of(dest.numpy()) if isinstance(dest, torch.Tensor) else dest


def _read_run(files: ShardFiles, run: list[_Read]) -> tuple[int, torch.Tensor]:
    """One read of the file span `run` covers: its first byte's offset, and the bytes."""
    entries = list(map(_ENTRY, run))
    start = entries[0].offset
    end = max(map(operator.add, map(_OFFSET, entries), map(_LENGTH, entries)))
    buf = torch.empty(end - start, dtype=torch.uint8)
    files.read_into(run[0].entry.file, start, _bytes_of(buf.numpy()))
    return start, buf


def _verify_run(algorithm: str, run: list[_Read], start: int, buf: torch.Tensor) -> list[str] | None:
    """Check each read of `run` in `buf` (the file's bytes from `start`) against its digest;
    only when every one matches are the reads copied to their destinations, so a damaged run
    never reaches the template. Returns None then, else every read's digest."""
    digest = checksum_function(algorithm)
    span = _bytes_of(buf.numpy())
    entries = list(map(_ENTRY, run))
    los = [e.offset - start for e in entries]
    ns = list(map(_LENGTH, entries))
    got = [digest(span[lo : lo + n]) for lo, n in zip(los, ns, strict=True)]
    if got != list(map(_CHECKSUM, entries)):
        return got
    _place_run(run, los, ns, buf, span)
    return None


def _place_run(run: list[_Read], los: list[int], ns: list[int], buf: torch.Tensor, span: memoryview) -> None:
    """Copy each read of `run` (`ns` bytes at `los` in `buf`): a tensor destination (a
    contiguous CPU tensor of exactly those bytes: a template's own, or its byte view) by
    one `memmove` to its address, then every such tensor's version counter bumped in one
    call, as an in-place write by torch would (at 20,000 leaves a `_foreach_copy_` of byte
    views made a leaf cost about 3 us more); any other destination by a byte copy."""
    base = buf.data_ptr()
    written: list[torch.Tensor] = []
    for r, lo, n in zip(run, los, ns, strict=True):
        if not n:
            continue
        dest = r.dest
        if isinstance(dest, torch.Tensor):
            if dest.nbytes != n:  # never written past: planned exact, checked all the same
                raise AssertionError(f"{r.entry.path}: a {dest.nbytes}-byte destination for {n} bytes")
            _memmove(dest.data_ptr(), base + lo, n)
            written.append(dest)
        else:
            dest[:] = span[lo : lo + n]
    if written:
        _increment_versions(written)


_memmove = ctypes.memmove


def _increment_versions(tensors: list[torch.Tensor]) -> None:
    """Bump the version counters of `tensors`, written by address: autograd then refuses a
    backward pass through a graph that saved their earlier values, as after `copy_`."""
    try:
        torch._C._increment_version(tensors)
    except TypeError:  # an older torch takes one tensor a call
        for t in tensors:
            torch._C._increment_version(t)


_RELISTS = 3  # how often a step pruned while read makes an automatic restore list the tiers again


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    value: object
    committed: tuple[int, ...]  # every committed step seen on any tier
    tier: str = ""  # the tier this rank read it from


def restore_from(
    tiers: Sequence[Tier],
    template: object,
    step: int | None,
    rank: int,
    strict: bool = True,
    world_size: int | None = None,
    progress: ProgressCallback | None = None,
) -> Restored | None:
    """Restore the newest verifiable step (or exactly `step`) from the fastest tier having it.

    `world_size` is the restoring job's (see `prepare_step`); None reads rank `rank`'s view
    whatever the world size of the checkpoint. Returns None when no tier has any committed step.
    `progress(done, total)` counts the bytes of the step being read (it starts again from 0
    when a damaged copy makes the read move to another tier or step).
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
    pruned_only = True  # every failure a step deleted while it was read
    tried: set[int] = set()
    relists = 0
    while candidates:
        s = candidates.pop(0)
        tried.add(s)
        for tier in holders[s]:
            try:
                with reading_committed(tier, s):
                    later = holders[s][holders[s].index(tier) + 1 :]
                    value = read_step(tier, s, rank, template, strict, world_size, progress, later)
                return Restored(s, value, tuple(sorted(holders)), tier.name)
            except (CheckpointCorruptedError, NoCheckpointError, OSError) as exc:
                missing_only = missing_only and isinstance(exc, NoCheckpointError)
                pruned_only = pruned_only and isinstance(exc, StepPrunedError)
                failures.append(f"step {s} on tier {tier.name!r}: {exc}")
                last = tier is holders[s][-1]
                # A job beside this reader pruned the step: it has saved newer ones meanwhile.
                relist = step is None and last and isinstance(exc, StepPrunedError) and relists < _RELISTS
                if step is None or not last:
                    then = "trying the next tier" if not last else "looking for newer steps" if relist else ""
                    warnings.warn(
                        f"tiercheck: cannot restore step {s} from tier {tier.name!r}: {exc}; "
                        + (then or "trying an older step"),
                        RuntimeWarning,
                        stacklevel=3,
                    )
                if relist:
                    relists += 1
                    holders = list_committed(tiers)
                    candidates = sorted((c for c in holders if c not in tried), reverse=True)
    detail = "; ".join(failures)
    error = NoCheckpointError if missing_only else CheckpointCorruptedError
    if step is not None:
        if pruned_only:
            raise StepPrunedError(f"step {step} cannot be restored: {detail}", step=step)
        raise error(f"step {step} cannot be restored: {detail}")
    raise error(f"no committed step could be restored ({len(tried)} tried, newest first): {detail}")


def restore_collective(
    coord: RestoreAgreement,
    local: Tier | None,
    remote: Tier | None,
    template: object,
    step: int | None,
    rank: int,
    world_size: int,
    strict: bool = True,
    progress: ProgressCallback | None = None,
    memory: Tier | None = None,
) -> Restored | None:
    """`restore_from` for one rank of a job: every rank calls it, and all restore the same
    step, the newest that every rank can read (or exactly `step`).

    Each rank reads its part from its tier 0 when its node still holds the step in memory,
    else from its tier 1 when its node has the step there, else from tier 2; a rank whose
    copy fails verification tries the next tier, and if some rank cannot read a step at all,
    every rank moves on to the next older candidate.
    """
    held: dict[str, set[int]] = {}
    for own in (memory, local):
        if own is not None:
            try:
                held[own.name] = set(own.committed_steps())
            except OSError as exc:
                warnings.warn(f"tiercheck: cannot list tier {own.name!r}: {exc!r}", RuntimeWarning, stacklevel=3)
    mine = sorted(set().union(*held.values())) if held else []

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
            tiers = [t for t in (memory, local, remote) if t is not None and (t is remote or s in held.get(t.name, ()))]
            produce: Producer | None = None
            why = source = ""
            for tier in tiers:
                try:
                    with reading_committed(tier, s):
                        later = tiers[tiers.index(tier) + 1 :]
                        produce = prepare_step(tier, s, rank, template, strict, world_size, progress, later)
                    source = tier.name
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
                return Restored(s, produce(), tuple(sorted(set(mine) | set(candidates))), source)
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
