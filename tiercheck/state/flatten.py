"""Flatten a training state into a JSON tree plus byte leaves (pure over values).

The tree keeps every container's type (dict keys keep int/str, tuples stay tuples),
plain values are encoded exactly (ints of any size as decimal strings, floats as
``float.hex``), and each array-like value becomes a `Leaf` whose bytes go to a shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedStateError
from ..format.dtypes import numpy_dtype_name, torch_dtype_name
from ..format.tree import MAX_DEPTH, ROOT, DTensorInfo, JsonNode, Leaf, encode_float, key_path


@dataclass(frozen=True, slots=True)
class FlatState:
    """The result of flattening: a JSON tree, leaf descriptions, and their live sources."""

    tree: JsonNode
    leaves: tuple[Leaf, ...]
    sources: tuple[object, ...]  # torch.Tensor | np.ndarray | bytes, parallel to leaves
    # Per leaf: does only `optimizer.step()` of an optimizer in the state change it (its
    # state, or a module parameter it updates)? Those may be copied after save() returns,
    # guarded by an optimizer pre-step hook.
    deferrable: tuple[bool, ...] = ()
    optimizers: tuple[torch.optim.Optimizer, ...] = ()
    # Per leaf: the tensor's version counter at flatten time (-1 for other leaves); an
    # in-place change moves it, so a deferred copy can tell it did not see a torn tensor.
    versions: tuple[int, ...] = ()
    # Module parameters that no optimizer in the state updates: never deferred, since
    # nothing would hold their writer back until the copy is done.
    unguarded: tuple[str, ...] = ()

    @property
    def signature(self) -> tuple[tuple[str, str, tuple[int, ...], int | None], ...]:
        """Equal for two states whose byte layout is the same (the plan cache key)."""
        return tuple((lf.kind, lf.dtype, lf.shape, lf.alias_of) for lf in self.leaves)


def dtensor_local(t: torch.Tensor, path: str) -> torch.Tensor | None:
    """The local piece of a DTensor (a view of its storage), or None for other subclasses.

    Raises:
        UnsupportedStateError: a DTensor with a Partial placement (its local piece is not a
            part of the value: reduce it first).
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    if not isinstance(t, DTensor):
        return None
    if any(p.is_partial() for p in t.placements):
        raise UnsupportedStateError(f"{path}: a DTensor with a Partial placement cannot be saved; reduce it first")
    local: torch.Tensor = t.to_local()
    return local


def dtensor_info(t: torch.Tensor, local: torch.Tensor, path: str) -> DTensorInfo:
    """Where DTensor `t`'s piece `local` sits in the whole tensor (`DTensorInfo`, blocks
    left to the writer).

    Raises:
        UnsupportedStateError: a placement other than Shard and Replicate (a strided shard's
            piece is no box of the whole), this rank outside the mesh, or a piece whose shape
            is not the box its placements give (an uneven, padded layout).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt: Any = t
    mesh, placements = dt.device_mesh, tuple(dt.placements)
    global_shape = tuple(int(s) for s in dt.shape)
    names: list[str] = []
    for p in placements:
        if type(p) is Replicate:
            names.append("R")
        elif type(p) is Shard:
            names.append(f"S{p.dim % len(global_shape) if global_shape else p.dim}")
        else:
            raise UnsupportedStateError(
                f"{path}: a DTensor placement {p!r} cannot be saved (Shard and Replicate can); redistribute it first"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedStateError(f"{path}: this rank is not part of the DTensor's mesh, so it holds no piece of it")
    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    if tuple(local_shape) != tuple(local.shape):
        raise UnsupportedStateError(
            f"{path}: this DTensor's local piece has shape {tuple(local.shape)}, but its placements give a box of "
            f"{tuple(local_shape)} (an uneven, padded layout); only a piece that is a box of the whole can be saved"
        )
    dims = mesh.mesh_dim_names
    return DTensorInfo(
        global_shape=global_shape,
        offsets=tuple(int(o) for o in offsets),
        mesh=tuple(int(m) for m in mesh.shape),
        dims=tuple(dims) if dims is not None else (None,) * mesh.ndim,
        placements=tuple(names),
        coordinate=tuple(int(c) for c in coordinate),
    )


def param_identity(p: torch.Tensor) -> tuple[torch.device, int]:
    """A parameter by (device, data pointer), a DTensor's by its local piece's."""
    local = dtensor_local(p, "") if type(p) not in (torch.Tensor, torch.nn.Parameter) else None
    t = p if local is None else local
    return t.device, t.data_ptr()


def is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _int_text(value: int, path: str) -> str:
    try:
        return str(value)
    except ValueError:  # over Python's int-to-str digit limit; readers could not parse it either
        raise UnsupportedStateError(f"{path}: integer has more than 4300 digits") from None


def flatten_state(state: Mapping[Any, Any]) -> FlatState:
    """Flatten `state` for `save()`.

    Raises:
        UnsupportedStateError: a value, key or dtype the format cannot store; names its key path.
    """
    return flatten_traced(state)[0]


def flatten_traced(state: Mapping[Any, Any]) -> tuple[FlatState, list[Mapping[Any, Any]]]:
    """`flatten_state`, plus what each stateful object's ``state_dict()`` returned, in the
    order they were met (so that `structure.StructureCache` need not call them again)."""
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"state must be a mapping (a dict of tensors, modules, optimizers, ...), got {type(state).__name__}"
        )
    builder = _Flattener()
    try:
        tree = builder.node(state, ROOT)
    except RecursionError:
        raise UnsupportedStateError(
            f"the state is nested more than {MAX_DEPTH} levels deep (or a state_dict() refers back to itself)"
        ) from None
    guarded = {param_identity(p) for opt in builder.optimizers for g in opt.param_groups for p in g["params"]}
    deferrable = [
        in_opt or (param is not None and param in guarded)
        for in_opt, param in zip(builder.in_optimizer, builder.param_of, strict=True)
    ]
    unguarded = tuple(
        leaf.path
        for leaf, param in zip(builder.leaves, builder.param_of, strict=True)
        if param is not None and param not in guarded
    )
    flat = FlatState(
        tree=tree,
        leaves=tuple(builder.leaves),
        sources=tuple(builder.sources),
        deferrable=tuple(deferrable),
        optimizers=tuple(builder.optimizers),
        versions=tensor_versions(builder.sources),
        unguarded=unguarded,
    )
    return flat, builder.inner


def tensor_versions(sources: Sequence[object]) -> tuple[int, ...]:
    """Per source: a tensor's version counter (it moves at every in-place change), -1 for others."""
    return tuple(s._version if isinstance(s, torch.Tensor) else -1 for s in sources)


class _Flattener:
    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self.sources: list[object] = []
        self._alias: dict[tuple[object, ...], int] = {}
        self._on_path: set[int] = set()
        self.in_optimizer: list[bool] = []  # per leaf: part of an optimizer's state
        self.param_of: list[tuple[torch.device, int] | None] = []  # per leaf: the module parameter it is
        self.optimizers: list[torch.optim.Optimizer] = []
        self._params: set[tuple[torch.device, int]] = set()  # parameters of enclosing modules
        self._in_optimizer = 0
        self.inner: list[Mapping[Any, Any]] = []  # each state_dict() result, in visit order

    def node(self, value: object, path: str, depth: int = 0) -> JsonNode:
        if depth > MAX_DEPTH:
            raise UnsupportedStateError(f"{path}: the state is nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, torch.Tensor):
            return {"t": "tensor", "e": self._tensor(value, path)}
        if isinstance(value, np.ndarray):
            return {"t": "ndarray", "e": self._ndarray(value, path, "ndarray")}
        if isinstance(value, np.generic):
            return {"t": "npscalar", "e": self._ndarray(np.asarray(value), path, "npscalar")}
        kind = type(value)
        if value is None:
            return {"t": "none"}
        if kind is bool:
            return {"t": "bool", "v": value}
        if kind is int:
            return {"t": "int", "v": _int_text(value, path)}  # type: ignore[arg-type]
        if kind is float:
            return {"t": "float", "v": encode_float(value)}  # type: ignore[arg-type]
        if kind is str:
            return {"t": "str", "v": value}
        if kind is bytes or kind is bytearray:
            return {"t": "bytes", "e": self._bytes(bytes(value), path)}  # type: ignore[call-overload]
        if isinstance(value, Mapping):
            return self._container(value, path, "dict", depth)
        if kind is list or kind is tuple:
            return self._container(value, path, kind.__name__, depth)
        if is_stateful(value):
            try:
                inner = value.state_dict()  # type: ignore[attr-defined]
            except Exception as exc:
                raise UnsupportedStateError(f"{path}: {type(value).__name__}.state_dict() raised {exc!r}") from exc
            if not isinstance(inner, Mapping):
                raise UnsupportedStateError(
                    f"{path}: {type(value).__name__}.state_dict() returned {type(inner).__name__}, expected a mapping"
                )
            if id(value) in self._on_path:
                raise UnsupportedStateError(f"{path}: the state contains a reference cycle")
            self.inner.append(inner)
            self._on_path.add(id(value))
            is_opt = isinstance(value, torch.optim.Optimizer)
            params = (
                {param_identity(p) for p in value.parameters()} - self._params
                if isinstance(value, torch.nn.Module)
                else set()
            )
            if is_opt:
                self.optimizers.append(value)  # type: ignore[arg-type]
            self._in_optimizer += is_opt
            self._params |= params
            try:
                return {"t": "stateful", "v": self._container(inner, path, "dict", depth + 1)}
            finally:
                self._on_path.discard(id(value))
                self._in_optimizer -= is_opt
                self._params -= params
        raise UnsupportedStateError(
            f"{path}: cannot checkpoint a value of type {kind.__module__}.{kind.__qualname__}; "
            "supported are tensors, numpy arrays, int/float/bool/str/bytes/None, "
            "dict/list/tuple of these, and objects with state_dict()/load_state_dict()"
        )

    def _container(self, value: Any, path: str, kind: str, depth: int) -> JsonNode:
        if id(value) in self._on_path:
            raise UnsupportedStateError(f"{path}: the state contains a reference cycle")
        self._on_path.add(id(value))
        try:
            if kind == "dict":
                keys: list[list[str]] = []
                values: list[JsonNode] = []
                for k, v in value.items():
                    if type(k) is str:
                        keys.append(["s", k])
                    elif type(k) is int:
                        keys.append(["i", _int_text(k, key_path(path, k))])
                    else:
                        raise UnsupportedStateError(
                            f"{key_path(path, k)}: dict keys must be str or int, got {type(k).__name__}"
                        )
                    values.append(self.node(v, key_path(path, k), depth + 1))
                return {"t": "dict", "k": keys, "v": values}
            return {"t": kind, "v": [self.node(v, key_path(path, i), depth + 1) for i, v in enumerate(value)]}
        finally:
            self._on_path.discard(id(value))

    def _add(self, leaf: Leaf, source: object, alias_key: tuple[object, ...] | None) -> int:
        if alias_key is not None:
            first = self._alias.get(alias_key)
            if first is not None:
                leaf = dataclasses.replace(leaf, alias_of=first)
            else:
                self._alias[alias_key] = len(self.leaves)
        self.leaves.append(leaf)
        self.sources.append(source)
        tensor = isinstance(source, torch.Tensor)
        self.in_optimizer.append(tensor and self._in_optimizer > 0)
        ident = (source.device, source.data_ptr()) if isinstance(source, torch.Tensor) else None
        self.param_of.append(ident if ident in self._params and not self._in_optimizer else None)
        return len(self.leaves) - 1

    def _tensor(self, t: torch.Tensor, path: str) -> int:
        dtensor = None
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            local = dtensor_local(t, path)
            if local is None:
                raise UnsupportedStateError(
                    f"{path}: tensor subclass {type(t).__name__} is not supported; save a plain tensor"
                )
            dtensor = dtensor_info(t, local, path)
            t = local  # a DTensor (FSDP2, tensor parallel) is saved as the piece this rank holds
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            raise UnsupportedStateError(f"{path}: only dense strided tensors are supported, got layout {t.layout}")
        if t.device.type == "meta":
            raise UnsupportedStateError(f"{path}: a meta tensor has no data to save")
        name = torch_dtype_name(t.dtype)
        if name is None:
            raise UnsupportedStateError(f"{path}: dtype {t.dtype} is not supported by the format")
        shape = tuple(int(s) for s in t.shape)
        nbytes = t.numel() * t.element_size()
        alias_key: tuple[object, ...] | None = None
        if nbytes:
            alias_key = (
                t.device,
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                shape,
                tuple(t.stride()),
                t.dtype,
                t.is_conj(),
                t.is_neg(),
            )
        return self._add(Leaf(path, "tensor", name, shape, nbytes, dtensor=dtensor), t.detach(), alias_key)

    def _ndarray(self, a: np.ndarray[Any, Any], path: str, kind: str) -> int:
        name = numpy_dtype_name(a.dtype)
        if name is None:
            raise UnsupportedStateError(f"{path}: numpy dtype {a.dtype} is not supported (numeric and bool only)")
        return self._add(Leaf(path, kind, name, tuple(int(s) for s in a.shape), int(a.nbytes)), a, None)

    def _bytes(self, b: bytes, path: str) -> int:
        return self._add(Leaf(path, "bytes", "uint8", (len(b),), len(b)), b, None)


def metric_values(metrics: Mapping[Any, Any] | None) -> tuple[tuple[str, int | float], ...]:
    """Check the `metrics` of `save()` and return them as (name, value) pairs.

    A value is an int or a float (NaN and infinities included), or a one-element tensor or
    numpy scalar/array, read with ``.item()`` (exact: every float dtype widens exactly to a
    Python float). bool is refused, as are names that are not 1 to 256 characters.

    Raises:
        UnsupportedStateError: names the offending metric.
    """
    if metrics is None:
        return ()
    if not isinstance(metrics, Mapping):
        raise UnsupportedStateError(f"metrics must be a mapping of name -> number, got {type(metrics).__name__}")
    out: list[tuple[str, int | float]] = []
    for name, value in metrics.items():
        if type(name) is not str or not 0 < len(name) <= 256:
            raise UnsupportedStateError(f"metrics[{name!r}]: a metric name must be a str of 1 to 256 characters")
        v = value
        if isinstance(v, torch.Tensor):
            if v.numel() == 1 and not v.dtype.is_complex and v.dtype != torch.bool and v.device.type != "meta":
                v = v.item()
        elif isinstance(v, (np.ndarray, np.generic)) and v.size == 1 and v.dtype.kind in "iuf":
            v = v.item()
        if type(v) is int:
            out.append((name, _metric_int(v, name)))
        elif type(v) is float:
            out.append((name, v))
        else:
            raise UnsupportedStateError(
                f"metrics[{name!r}]: a metric must be an int or a float (or a one-element real tensor), "
                f"got {type(value).__name__}"
            )
    return tuple(out)


def _metric_int(v: int, name: str) -> int:
    _int_text(v, f"metrics[{name!r}]")
    return v
