"""The structure cache: saving a state whose structure is unchanged skips the work that
depends only on the structure (pure over values, like `state.py`).

`flatten_state` validates every value, names every key path, decides aliases, builds the
JSON tree and the `Leaf` descriptions, and works out which leaves an optimizer guards; at
tens of microseconds per leaf it cost more than the copy for states of many small tensors.
`StructureCache.flatten` does that once, keeps a template of what it found, and at the next
save walks the new state against the template, collecting the current tensors. The
walk reuses the tree, the leaves, the deferral decisions (and, through the identity of the
leaves tuple, the shard plan and the destination views in the host buffer) only if all of
this is as it was:

- every container: the same Python type; a dict the same keys, in the same order, of the
  same types (``1`` and ``True`` compare equal, so the key types are compared too); a list
  or tuple the same length;
- every stateful object (module, optimizer, ...): the very same object (a weak reference
  where it allows one), its ``state_dict()`` a mapping that matches in turn; a module's
  parameters and an optimizer's params the same tensors by (device, data pointer), which is
  what the deferral decisions of ``save(overlap=True)`` are made of (checked for the saves
  that overlap their copy, the only ones that read those decisions: `flatten(params=)`);
- every tensor: the same Python type (a DTensor's local piece is checked), dtype, shape,
  strides, data pointer and device (CPU, else the device itself), and for a leaf in an
  alias pair also its conjugate and negative bits; a DTensor also its global shape, its
  placements and the very same device mesh (these make its `DTensorInfo`: the box its piece
  is of the whole, the mesh shape, names and this rank's coordinate, all compared here
  rather than recomputed);
- every numpy value the same type, dtype and shape; bytes the same type and length;
- every plain value (int, float, str, bool, None) the same type. A changed value (a
  learning rate, a step counter) is not a structure change: the tree is rebuilt along the
  path to it only, with the value encoded as `flatten_state` would.

Why that is enough: a leaf's description is its kind, dtype and shape, checked; where its
bytes go is a function of the leaves alone; the alias decision of `flatten_state` depends
on the storage, offset, shape, strides, dtype and the two bits, and a tensor's data pointer
is its storage pointer plus offset times element size, so equal data pointers, strides,
shapes and dtypes give equal decisions (and two tensors that newly share memory change a
data pointer); the deferral decisions depend on which optimizers and modules enclose which
leaves (the template's shape) and on their parameters' identities, checked. The copy reads
the tensors collected by this walk, never the ones of an earlier save, so what is written
is the state at this save. Anything else (a new key, a replaced or resized tensor, a
changed dtype or device, a ``.data`` reassignment, a container changed in place, a
``state_dict()`` that raises) fails the check, and `flatten_state` runs on the state
again: its errors, with their key paths, are the ones the caller sees. A check never
changes a dtype or converts a value.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..format.tree import JsonNode, encode_float
from ..observe.collector import collector_paused
from .flatten import FlatState, dtensor_local, flatten_traced, param_identity

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_stride = torch.Tensor.stride
_data_ptr = torch.Tensor.data_ptr


class _Mismatch(Exception):
    """The state differs from the template: flatten it again."""


class _Walk:
    """One match in progress: the sources in leaf order, the optimizers in visit order, and
    the template nodes whose cached JSON is replaced once the whole match succeeded."""

    __slots__ = ("optimizers", "params", "sources", "updates")

    def __init__(self, params: bool = True) -> None:
        self.params = params  # check modules' and optimizers' parameter identities
        self.sources: list[object] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.updates: list[tuple[_Slot, JsonNode, object]] = []


class _Slot:
    __slots__ = ("node",)

    def __init__(self, node: JsonNode) -> None:
        self.node = node

    def match(self, value: object, walk: _Walk) -> JsonNode:
        raise NotImplementedError

    def update(self, node: JsonNode, value: object) -> None:
        self.node = node


class _TensorSlot(_Slot):
    """A tensor leaf: its checks run over all tensors at once (`_Template._check_tensors`)."""

    __slots__ = ()

    def match(self, value: object, walk: _Walk) -> JsonNode:
        walk.sources.append(value)
        return self.node


class _ArraySlot(_Slot):
    __slots__ = ("dtype", "pytype", "scalar", "shape")

    def __init__(self, node: JsonNode, value: object) -> None:
        super().__init__(node)
        self.pytype = type(value)
        self.scalar = node["t"] == "npscalar"
        a = np.asarray(value)
        self.dtype, self.shape = a.dtype, a.shape

    def match(self, value: object, walk: _Walk) -> JsonNode:
        if type(value) is not self.pytype:
            raise _Mismatch
        a = np.asarray(value) if self.scalar else value
        assert isinstance(a, np.ndarray)
        if a.dtype != self.dtype or a.shape != self.shape:
            raise _Mismatch
        walk.sources.append(a)
        return self.node


class _BytesSlot(_Slot):
    __slots__ = ("length", "pytype")

    def __init__(self, node: JsonNode, value: bytes | bytearray) -> None:
        super().__init__(node)
        self.pytype, self.length = type(value), len(value)

    def match(self, value: object, walk: _Walk) -> JsonNode:
        if type(value) is not self.pytype:
            raise _Mismatch
        assert isinstance(value, (bytes, bytearray))
        if len(value) != self.length:
            raise _Mismatch
        walk.sources.append(bytes(value))
        return self.node


class _PlainSlot(_Slot):
    """None, bool, int, float or str: the same type; a new value gets a new node."""

    __slots__ = ("pytype", "value")

    def __init__(self, node: JsonNode, value: object) -> None:
        super().__init__(node)
        self.pytype, self.value = type(value), value

    def match(self, value: object, walk: _Walk) -> JsonNode:
        kind = self.pytype
        if type(value) is not kind:
            raise _Mismatch
        if kind is float:
            assert isinstance(value, float)
            text = encode_float(value)  # -0.0 == 0.0 and NaN != NaN: compare the encoding
            if text == self.node["v"]:
                return self.node
            node: JsonNode = {"t": "float", "v": text}
        elif value is self.value or value == self.value:
            return self.node
        elif kind is int:
            node = {"t": "int", "v": str(value)}  # over 4300 digits: ValueError, a mismatch
        elif kind is str:
            node = {"t": "str", "v": value}
        elif kind is bool:
            node = {"t": "bool", "v": value}
        else:  # None is always None
            raise _Mismatch
        walk.updates.append((self, node, value))
        return node

    def update(self, node: JsonNode, value: object) -> None:
        self.node, self.value = node, value


class _Container(_Slot):
    __slots__ = ("all_tensors", "children", "is_dict", "keys", "keytypes", "pytype")

    def __init__(self, node: JsonNode, value: Any, children: list[_Slot]) -> None:
        super().__init__(node)
        self.pytype = type(value)
        self.is_dict = node["t"] == "dict"
        self.keys = list(value) if self.is_dict else []
        self.keytypes = list(map(type, self.keys))
        self.children = children
        self.all_tensors = bool(children) and all(type(c) is _TensorSlot for c in children)

    def match(self, value: Any, walk: _Walk) -> JsonNode:
        if type(value) is not self.pytype:
            raise _Mismatch
        if self.is_dict:
            keys = list(value)
            if keys != self.keys or list(map(type, keys)) != self.keytypes:
                raise _Mismatch
            values = list(value.values())
        else:
            values = value
        if len(values) != len(self.children):
            raise _Mismatch
        if self.all_tensors:
            walk.sources.extend(values)
            return self.node
        changed: list[JsonNode] | None = None
        for i, (v, child) in enumerate(zip(values, self.children, strict=True)):
            node = child.match(v, walk)
            if node is not child.node:
                if changed is None:
                    changed = list(self.node["v"])
                changed[i] = node
        if changed is None:
            return self.node
        new = dict(self.node)
        new["v"] = changed
        walk.updates.append((self, new, None))
        return new


def _param_ids(value: object) -> tuple[tuple[torch.device, int], ...]:
    """A module's parameters, or an optimizer's params, by (device, data pointer)."""
    if isinstance(value, torch.optim.Optimizer):
        return tuple(param_identity(p) for g in value.param_groups for p in g["params"])
    assert isinstance(value, torch.nn.Module)
    return tuple(map(param_identity, value.parameters()))


class _StatefulSlot(_Slot):
    __slots__ = ("inner", "is_opt", "params", "ref")

    def __init__(self, node: JsonNode, value: object, inner: _Slot) -> None:
        super().__init__(node)
        try:
            self.ref: Callable[[], Any] = weakref.ref(value)
        except TypeError:  # no weak references: hold it (one structure's worth)
            self.ref = lambda: value
        self.is_opt = isinstance(value, torch.optim.Optimizer)
        tracked = self.is_opt or isinstance(value, torch.nn.Module)
        self.params = _param_ids(value) if tracked else None
        self.inner = inner

    def match(self, value: object, walk: _Walk) -> JsonNode:
        if self.ref() is not value:
            raise _Mismatch
        obj: Any = value
        inner = obj.state_dict()
        if not isinstance(inner, Mapping):
            raise _Mismatch
        if self.params is not None and walk.params and _param_ids(obj) != self.params:
            raise _Mismatch
        if self.is_opt:
            walk.optimizers.append(obj)
        node = self.inner.match(inner, walk)
        if node is self.inner.node:
            return self.node
        new: JsonNode = {"t": "stateful", "v": node}
        walk.updates.append((self, new, None))
        return new


class _Uncacheable(Exception):
    """The tree does not have the shape the template expects: do not cache it."""


class _Builder:
    """Builds a template from a state and what `flatten_traced` made of it."""

    def __init__(self, inner: list[Mapping[Any, Any]]) -> None:
        self.inner = iter(inner)
        self.count = 0  # leaves seen, in order
        self.tensor_pos: list[int] = []
        self.tensor_types: list[type] = []
        self.dtensors: list[tuple[int, Any, Any, Any]] = []  # (tensor index, shape, placements, mesh)

    def leaf(self, node: JsonNode) -> int:
        if node["e"] != self.count:
            raise _Uncacheable
        self.count += 1
        return self.count - 1

    def slot(self, value: Any, node: JsonNode) -> _Slot:
        t = node["t"]
        if t == "tensor":
            self.tensor_pos.append(self.leaf(node))
            self.tensor_types.append(type(value))
            if type(value) not in _PLAIN_TENSORS:
                self.dtensors.append((len(self.tensor_types) - 1, *_dtensor_layout(value)))
            return _TensorSlot(node)
        if t in ("ndarray", "npscalar"):
            self.leaf(node)
            return _ArraySlot(node, value)
        if t == "bytes":
            self.leaf(node)
            return _BytesSlot(node, value)
        if t in ("none", "bool", "int", "float", "str"):
            return _PlainSlot(node, value)
        if t in ("dict", "list", "tuple"):
            values = list(value.values()) if t == "dict" else list(value)
            if len(values) != len(node["v"]):
                raise _Uncacheable
            return _Container(node, value, [self.slot(v, n) for v, n in zip(values, node["v"], strict=True)])
        if t == "stateful":
            inner = next(self.inner)
            return _StatefulSlot(node, value, self.slot(inner, node["v"]))
        raise _Uncacheable


class _Template:
    """One state's structure and the per-tensor facts the check compares (see the module doc)."""

    def __init__(self, flat: FlatState, root: _Slot, builder: _Builder) -> None:
        self.root = root
        n = len(flat.leaves)
        self.nleaves = n
        pos = builder.tensor_pos
        self.tensor_pos: list[int] | None = None if len(pos) == n else pos
        self.types = builder.tensor_types
        self.dtensors = any(t not in _PLAIN_TENSORS for t in self.types)
        self.layouts = builder.dtensors
        tensors: list[Any] = [flat.sources[i] for i in pos]
        assert all(isinstance(t, torch.Tensor) for t in tensors)
        self.dtypes = [t.dtype for t in tensors]
        self.shapes = [t.shape for t in tensors]
        self.strides = list(map(_stride, tensors))
        self.ptrs = list(map(_data_ptr, tensors))
        self.cpu = [t.is_cpu for t in tensors]
        self.devices = [(j, t.device) for j, t in enumerate(tensors) if not t.is_cpu]
        aliased = {i for i, lf in enumerate(flat.leaves) if lf.alias_of is not None}
        aliased |= {lf.alias_of for lf in flat.leaves if lf.alias_of is not None}
        self.bits = [
            (j, t.is_conj(), t.is_neg()) for j, (i, t) in enumerate(zip(pos, tensors, strict=True)) if i in aliased
        ]
        self.flat = FlatState(  # the parts that depend on the structure only: no tensor is held
            tree={},
            leaves=flat.leaves,
            sources=(),
            deferrable=flat.deferrable,
            unguarded=flat.unguarded,
        )

    def match(self, state: object, params: bool = True) -> FlatState | None:
        walk = _Walk(params)
        try:
            tree = self.root.match(state, walk)
            if len(walk.sources) != self.nleaves:
                raise _Mismatch
            self._check_tensors(walk.sources)
        except Exception:  # a mismatch, or a value the check cannot read: the full path decides
            return None
        for slot, node, value in walk.updates:
            slot.update(node, value)
        return FlatState(
            tree=tree,
            leaves=self.flat.leaves,
            sources=tuple(walk.sources),
            deferrable=self.flat.deferrable,
            optimizers=tuple(walk.optimizers),
            versions=(),  # read by save() when it overlaps the copy (state.tensor_versions)
            unguarded=self.flat.unguarded,
        )

    def _check_tensors(self, sources: list[Any]) -> None:
        pos = self.tensor_pos
        tensors = sources if pos is None else [sources[i] for i in pos]
        if list(map(type, tensors)) != self.types:
            raise _Mismatch
        if self.dtensors:
            for j, shape, placements, mesh in self.layouts:
                if _dtensor_layout(tensors[j]) != (shape, placements, mesh):
                    raise _Mismatch
            tensors = [t if type(t) in _PLAIN_TENSORS else _local(t) for t in tensors]
            for j, t in enumerate(tensors):
                sources[j if pos is None else pos[j]] = t
        if (
            [t.dtype for t in tensors] != self.dtypes
            or [t.shape for t in tensors] != self.shapes
            or list(map(_stride, tensors)) != self.strides
            or list(map(_data_ptr, tensors)) != self.ptrs
            or [t.is_cpu for t in tensors] != self.cpu
        ):
            raise _Mismatch
        for j, device in self.devices:
            if tensors[j].device != device:
                raise _Mismatch
        for j, conj, neg in self.bits:
            if tensors[j].is_conj() != conj or tensors[j].is_neg() != neg:
                raise _Mismatch


class _Same:
    """Compares equal to the very same object only (a DeviceMesh's ``==`` compares devices)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _dtensor_layout(t: Any) -> tuple[Any, Any, _Same]:
    """What a DTensor's `DTensorInfo` is made of: its global shape, placements and mesh (by
    identity: one mesh object has one shape, names and coordinate)."""
    try:
        return t.shape, tuple(t.placements), _Same(t.device_mesh)
    except AttributeError:  # not a DTensor: `_local` refuses it
        raise _Mismatch from None


def _local(t: torch.Tensor) -> torch.Tensor:
    local = dtensor_local(t, "")
    if local is None:
        raise _Mismatch
    return local


class StructureCache:
    """`flatten` is `state.flatten_state`, done in full only when the structure changed.

    One template is kept (the structure of the last state flattened); a state that does not
    match replaces it. Not thread-safe: `Checkpointer` calls it under its lock.
    """

    def __init__(self) -> None:
        self._template: _Template | None = None
        self.hits = 0  # saves that reused the structure: for tests and stats
        self.misses = 0

    def flatten(self, state: Mapping[Any, Any], params: bool = True) -> FlatState:
        """What `flatten_state(state)` returns, except that `versions` may be empty (read them
        with `state.tensor_versions` when needed) and the sources are the state's own tensors
        rather than detached aliases of them (the copy runs without autograd).

        `params` False: a reused structure's modules and optimizers are not checked for the
        same parameters (by identity), which only the deferral decisions of
        ``save(overlap=True)`` are made of: a save that copies everything before it returns
        (the default) does not read them, and every overlapping save checks them. At 20,000
        leaves (5,000 parameters) that check was 0.026 s of a 0.067 s `save()`.

        Raises:
            UnsupportedStateError: as `flatten_state`.
        """
        template = self._template
        if template is not None:
            # The collector paused: the check holds a shape and a stride tuple per tensor at
            # once, enough allocations to set off a full collection, which traverses every
            # live tensor (0.4 s at 20,000 leaves, every other save, beside a model of 5,000
            # parameters). The check's objects die with the lists holding them, before the
            # collector would see them, so the pause defers no work.
            with collector_paused():
                flat = template.match(state, params)
            if flat is not None:
                self.hits += 1
                return flat
        self._template = None
        flat, inner = flatten_traced(state)
        self.misses += 1
        self._template = _build(state, flat, inner)
        return flat

    def clear(self) -> None:
        self._template = None


def _build(state: Mapping[Any, Any], flat: FlatState, inner: list[Mapping[Any, Any]]) -> _Template | None:
    builder = _Builder(inner)
    try:
        root = builder.slot(state, flat.tree)
    except _Uncacheable:
        return None
    if builder.count != len(flat.leaves):
        return None
    return _Template(flat, root, builder)
