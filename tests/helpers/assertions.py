"""Assertions shared by the test modules."""

from __future__ import annotations

import struct

import numpy as np
import torch


def same(actual: object, expected: object, path: str = "state") -> None:
    """Assert bit-exact equality, types included."""
    assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        a = actual.contiguous().reshape(-1).view(torch.uint8)
        e = expected.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), path
    elif isinstance(expected, (np.ndarray, np.generic)):
        a_np, e_np = np.asarray(actual), np.asarray(expected)
        assert (a_np.dtype.str, a_np.shape) == (e_np.dtype.str, e_np.shape), path
        assert a_np.tobytes() == e_np.tobytes(), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert list(actual) == list(expected), path
        for k in expected:
            same(actual[k], expected[k], f"{path}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple))
        assert len(actual) == len(expected), path
        for i, (a_item, e_item) in enumerate(zip(actual, expected, strict=True)):
            same(a_item, e_item, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert isinstance(actual, float)
        assert struct.pack("<d", actual) == struct.pack("<d", expected), f"{path}: {actual!r} != {expected!r}"
    else:
        assert actual == expected, path
