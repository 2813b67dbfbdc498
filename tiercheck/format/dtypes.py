"""Which element types the format stores, by name (pure lookup tables)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# Every torch dtype the format stores as raw bytes. The fnuz float8 variants, packed
# float4 and complex32 are rejected at save(): too rare to be worth a format promise.
_TORCH_NAMES = (
    "float64", "float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
    "complex64", "complex128",
    "int8", "int16", "int32", "int64",
    "uint8", "uint16", "uint32", "uint64",
    "bool",
)  # fmt: skip

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _TORCH_NAMES if isinstance(getattr(torch, name, None), torch.dtype)
}
TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

# numpy: bool, signed/unsigned ints, floats and complex, either byte order.
NUMPY_KINDS = frozenset("biufc")


def torch_dtype_name(dtype: torch.dtype) -> str | None:
    """The format's name for a torch dtype, or None when the format does not store it."""
    return TORCH_DTYPE_NAMES.get(dtype)


def numpy_dtype_name(dtype: np.dtype[Any]) -> str | None:
    """numpy's own ``dtype.str`` (e.g. ``<u4``), or None for object/str/void dtypes."""
    if dtype.kind not in NUMPY_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        return None
    return str(dtype.str)


def numpy_dtype_from_name(name: str) -> np.dtype[Any] | None:
    try:
        dtype: np.dtype[Any] = np.dtype(name)
    except (TypeError, ValueError):
        return None
    return dtype if numpy_dtype_name(dtype) == name else None


def itemsize(kind: str, dtype: str) -> int | None:
    """Bytes per element of a manifest entry's dtype, or None if the name is unknown."""
    if kind == "tensor":
        td = TORCH_DTYPES.get(dtype)
        return None if td is None else td.itemsize
    if kind in ("ndarray", "npscalar"):
        nd = numpy_dtype_from_name(dtype)
        return None if nd is None else nd.itemsize
    if kind == "bytes":
        return 1 if dtype == "uint8" else None
    return None


def torch_dtype_of_numpy(name: str) -> torch.dtype | None:
    """The torch dtype holding the same values as the numpy dtype `name` (either byte order),
    or None when torch has none (float128, ...)."""
    nd = numpy_dtype_from_name(name)
    if nd is None:
        return None
    try:
        return torch.from_numpy(np.empty(0, dtype=nd.newbyteorder("="))).dtype
    except TypeError:  # numpy dtypes torch does not have
        return None
