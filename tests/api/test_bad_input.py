"""Inputs `save()` must reject, by type and key path, without touching the directory."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck


class MyTensor(torch.Tensor):
    pass


class BrokenStateDict:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("cannot snapshot")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


class NotAMappingStateDict:
    def state_dict(self) -> list[int]:
        return [1, 2]

    def load_state_dict(self, sd: object) -> None:
        pass


def _complex32() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        return torch.zeros(2, dtype=torch.complex32)


def _cycle() -> dict[str, Any]:
    d: dict[str, Any] = {"ok": 1}
    d["self"] = d
    return {"a": d}


def _list_cycle() -> dict[str, Any]:
    lst: list[Any] = [1]
    lst.append(lst)
    return {"a": {"b": lst}}


# (state, the key path the message must name)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "object": ({"a": {"b": object()}}, "state['a']['b']"),
    "lambda": ({"a": {"b": lambda: 0}}, "state['a']['b']"),
    "set": ({"a": {"b": {1, 2}}}, "state['a']['b']"),
    "frozenset": ({"a": {"b": frozenset()}}, "state['a']['b']"),
    "list_item": ({"a": [1, 2, object()]}, "state['a'][2]"),
    "tensor_subclass": ({"a": {"b": torch.zeros(2).as_subclass(MyTensor)}}, "state['a']['b']"),
    "sparse_tensor": ({"a": {"b": torch.zeros(2, 2).to_sparse()}}, "state['a']['b']"),
    "meta_tensor": ({"a": {"b": torch.empty(2, device="meta")}}, "state['a']['b']"),
    "complex32": ({"a": {"b": _complex32()}}, "state['a']['b']"),
    "float8_fnuz": ({"a": {"b": torch.zeros(2).to(torch.float8_e4m3fnuz)}}, "state['a']['b']"),
    "tuple_key": ({"a": {(1, 2): 3}}, "state['a'][(1, 2)]"),
    "float_key": ({"a": {1.5: 3}}, "state['a'][1.5]"),
    "bool_key": ({"a": {True: 3}}, "state['a'][True]"),
    "none_key": ({"a": {None: 3}}, "state['a'][None]"),
    "numpy_object_array": ({"a": {"b": np.array([object(), 1], dtype=object)}}, "state['a']['b']"),
    "numpy_str_array": ({"a": {"b": np.array(["x", "y"])}}, "state['a']['b']"),
    "numpy_structured": ({"a": {"b": np.zeros(2, dtype=[("x", "i4"), ("y", "f8")])}}, "state['a']['b']"),
    "numpy_datetime": ({"a": {"b": np.array(["2024-01-01"], dtype="datetime64[D]")}}, "state['a']['b']"),
    "dict_cycle": (_cycle(), "state['a']['self']"),
    "list_cycle": (_list_cycle(), "state['a']['b'][1]"),
    "state_dict_raises": ({"a": {"b": BrokenStateDict()}}, "state['a']['b']"),
    "state_dict_not_mapping": ({"a": {"b": NotAMappingStateDict()}}, "state['a']['b']"),
}


@pytest.fixture
def committed(make_ckpt, ckpt_dir, dir_snapshot):
    """A Checkpointer whose directory holds one committed step, and its byte snapshot."""
    ckpt = make_ckpt()
    ckpt.save(1, {"w": torch.arange(10.0), "epoch": 1}).wait()
    return ckpt, dir_snapshot(ckpt_dir)


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_value_is_rejected_with_its_key_path(committed, ckpt_dir, dir_snapshot, case):
    ckpt, before = committed
    state, path = UNSUPPORTED[case]

    with pytest.raises(tiercheck.UnsupportedStateError) as ei:
        ckpt.save(2, state)

    assert isinstance(ei.value, TypeError)
    assert isinstance(ei.value, tiercheck.TiercheckError)
    assert path in str(ei.value)
    assert dir_snapshot(ckpt_dir) == before
    assert ckpt.steps() == [1]
    # the rejected save claimed nothing: the same step number still works
    ckpt.save(2, {"w": torch.zeros(1)}).wait()
    assert ckpt.steps() == [1, 2]


@pytest.mark.parametrize("state", [[1, 2], None, torch.zeros(2)], ids=["list", "none", "tensor"])
def test_state_that_is_not_a_mapping_is_rejected(committed, ckpt_dir, dir_snapshot, state):
    ckpt, before = committed
    with pytest.raises(tiercheck.UnsupportedStateError):
        ckpt.save(2, state)
    assert dir_snapshot(ckpt_dir) == before


@pytest.mark.parametrize("step", [-1, 1.5, 2.0, "3", True, None])
def test_bad_step_is_rejected_before_anything_is_written(committed, ckpt_dir, dir_snapshot, step):
    ckpt, before = committed
    with pytest.raises(tiercheck.TiercheckError) as ei:
        ckpt.save(step, {"w": torch.zeros(1)})
    assert isinstance(ei.value, (TypeError, ValueError))
    assert dir_snapshot(ckpt_dir) == before
    assert ckpt.steps() == [1]


@pytest.mark.parametrize("step", [-1, 1.5, "1", True])
def test_bad_restore_step_is_rejected_and_changes_nothing(committed, ckpt_dir, dir_snapshot, step):
    ckpt, before = committed
    template = {"w": torch.zeros(10), "epoch": None}
    with pytest.raises(ValueError):
        ckpt.restore(template, step=step)
    assert torch.equal(template["w"], torch.zeros(10))
    assert template["epoch"] is None
    assert dir_snapshot(ckpt_dir) == before


def test_restore_template_must_be_a_mutable_mapping(committed):
    ckpt, _ = committed
    with pytest.raises(TypeError):
        ckpt.restore([torch.zeros(10)])


def test_checkpointer_needs_a_tier():
    with pytest.raises(ValueError):
        tiercheck.Checkpointer()
    with pytest.raises(ValueError):
        tiercheck.Checkpointer(local=None, remote=None)


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"keep_local": 0}, ValueError),
        ({"keep_local": -1}, ValueError),
        ({"keep_local": "2"}, TypeError),
        ({"keep_local": 2.0}, TypeError),
        ({"host_buffers": 0}, ValueError),
        ({"checksum": "md5"}, ValueError),
    ],
)
def test_invalid_options_are_rejected_and_create_nothing(tmp_path, kwargs, exc):
    root = tmp_path / "never"
    with pytest.raises(exc):
        tiercheck.Checkpointer(local=root, **kwargs)
    assert not root.exists()


def _deep(depth: int) -> list[Any]:
    v: list[Any] = []
    for _ in range(depth):
        v = [v]
    return v


class SelfReferencing:
    """Its state_dict() contains itself: an infinite structure built lazily."""

    def state_dict(self) -> dict[str, Any]:
        return {"me": self}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@pytest.mark.parametrize("state", [{"a": _deep(2000)}, {"a": SelfReferencing()}], ids=["deep", "self_ref"])
def test_pathologically_deep_state_is_rejected_as_unsupported(committed, ckpt_dir, dir_snapshot, state):
    ckpt, before = committed
    with pytest.raises(tiercheck.UnsupportedStateError):
        ckpt.save(2, state)
    assert dir_snapshot(ckpt_dir) == before
