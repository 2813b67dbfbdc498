"""Bit-exact round trips through `Checkpointer.restore` (in place) and `tiercheck.load`."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiercheck
from tiercheck.format import naming

SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)


# ----------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def assert_tensor_bits(got: object, want: torch.Tensor, path: str = "") -> None:
    assert isinstance(got, torch.Tensor), path
    assert got.dtype == want.dtype, path
    assert got.shape == want.shape, path
    assert torch.equal(bits(got), bits(want)), path


def assert_same(got: object, want: object, path: str = "state") -> None:
    """Deep equality with exact types, bitwise floats, and key types kept."""
    if isinstance(want, torch.Tensor):
        assert_tensor_bits(got, want, path)
    elif isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, path
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert got.tobytes() == want.tobytes(), path
    elif isinstance(want, np.generic):
        assert type(got) is type(want), path
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), path
    elif type(want) is float:
        assert type(got) is float, path
        if math.isnan(want):
            assert math.isnan(got), path
        else:
            assert got == want, path
            assert math.copysign(1.0, got) == math.copysign(1.0, want), path
    elif type(want) is dict:
        assert type(got) is dict, path
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif type(want) in (list, tuple):
        assert type(got) is type(want), path
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    else:
        assert type(got) is type(want), path
        assert got == want, path


def raw(nbytes: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaN payloads, denormals, ...) reinterpreted as `dtype`."""
    data = bytearray(np.random.default_rng(seed).bytes(nbytes))
    return torch.frombuffer(data, dtype=torch.uint8).clone().view(dtype)


ALL8 = torch.arange(256, dtype=torch.int32).to(torch.uint8)
ALL16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
SPECIALS = [math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-40, 1.5]


def tensor_leaves() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(8, 6, generator=g)
    return {
        "fp32": torch.cat([torch.tensor(SPECIALS, dtype=torch.float32), raw(4000, torch.float32, 1)]),
        "fp64": torch.cat([torch.tensor(SPECIALS, dtype=torch.float64), raw(8000, torch.float64, 2)]),
        "fp16": ALL16.view(torch.float16),  # every bit pattern
        "bf16": ALL16.view(torch.bfloat16),
        "f8e4m3fn": ALL8.view(torch.float8_e4m3fn),
        "f8e5m2": ALL8.view(torch.float8_e5m2),
        "int8": ALL8.view(torch.int8),
        "int16": ALL16.clone(),
        "int32": raw(4000, torch.int32, 3),
        "int64": torch.cat([torch.tensor([-(2**63), 2**63 - 1, 0, -1]), raw(800, torch.int64, 4)]),
        "uint8": ALL8.clone(),
        "uint16": ALL16.view(torch.uint16),
        "uint32": raw(4000, torch.uint32, 5),
        "uint64": torch.cat([torch.tensor([-1, 0]).view(torch.uint64), raw(800, torch.uint64, 6)]),
        "bool": torch.tensor([True, False, True, True]),
        "complex64": torch.cat(
            [torch.tensor([complex(math.nan, -0.0)], dtype=torch.complex64), raw(800, torch.complex64, 7)]
        ),
        "complex128": raw(1600, torch.complex128, 8),
        "zero_d": torch.tensor(-0.0),
        "zero_d_int": torch.tensor(-(2**63)),
        "empty": torch.empty(0, 5),
        "empty_u64": torch.empty(0, dtype=torch.uint64),
        "transposed": base.t(),
        "strided": base[1::3, ::2],
        "expanded": torch.tensor([1.0, 2.0]).expand(3, 2),
        "param": nn.Parameter(torch.randn(3, generator=g)),
        "requires_grad": torch.randn(2, 2, generator=g, requires_grad=True),
    }


NP_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128, ">u4", ">f8",
]  # fmt: skip


def numpy_leaves() -> dict[str, Any]:
    rng = np.random.default_rng(11)
    out: dict[str, Any] = {}
    for dt in NP_DTYPES:
        dtype = np.dtype(dt)
        if dtype.kind == "b":
            arr = rng.integers(0, 2, size=(3, 5)).astype(bool)
        else:  # random bit patterns, NaNs and all
            arr = np.frombuffer(rng.bytes(15 * dtype.itemsize), dtype=dtype).reshape(3, 5).copy()
        out[f"np_{dtype.str}"] = arr
    big = np.arange(48, dtype=np.float64).reshape(6, 8)
    out.update(
        np_zero_d=np.array(4294967295, dtype=np.uint32),
        np_zero_d_f=np.array(-0.0),
        np_empty=np.zeros((0, 3), dtype=np.int16),
        np_strided=big[::2, 1:],
        np_fortran=np.asfortranarray(big),
        sc_f32=np.float32(1.5),
        sc_f64_nan=np.float64("nan"),
        sc_f16_negzero=np.float16(-0.0),
        sc_u32=np.uint32(4294967295),
        sc_i64=np.int64(-(2**63)),
        sc_bool=np.bool_(True),
        sc_c128=np.complex128(1 - 2j),
    )
    return out


def plain_values() -> dict[Any, Any]:
    return {
        "none": None,
        "bytes": b"\x00\xffabc",
        "empty_bytes": b"",
        "str": "h\u00e9llo\x00\u2713",
        "empty_str": "",
        "big": 2**130,
        "neg_big": -(2**130) - 1,
        "zero": 0,
        "neg": -7,
        "true": True,
        "false": False,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "negzero": -0.0,
        "denormal": 5e-324,
        "pi": math.pi,
        0: "int zero",
        "0": "str zero",
        -3: "negative int key",
        "tuple": (1, [2, (3, "x")], (), ((),)),
        "list": [(), [], {}, [None], [(1, 2)]],
        "nested": {"a": {"b": {"c": [1, {"d": (2.5,)}]}}},
    }


def full_state() -> dict[str, Any]:
    return {"tensors": tensor_leaves(), "arrays": numpy_leaves(), "plain": plain_values()}


def placeholder(v: object) -> object:
    """A template for `v`: zeroed tensors/arrays of the same layout, None for plain values."""
    if isinstance(v, torch.Tensor):
        z = torch.zeros(v.shape, dtype=torch.uint8 if v.dtype.itemsize == 1 else v.dtype)
        return z.view(v.dtype) if v.dtype.itemsize == 1 else z
    if isinstance(v, np.ndarray):
        return np.zeros(v.shape, dtype=v.dtype)
    if type(v) is dict:
        return {k: placeholder(x) for k, x in v.items()}
    if type(v) in (list, tuple):
        return type(v)(placeholder(x) for x in v)
    return None


def tensors_and_arrays(tree: object) -> list[object]:
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        return [tree]
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in tensors_and_arrays(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in tensors_and_arrays(v)]
    return []


def read_manifest(ckpt_dir: Path, step: int) -> dict[str, Any]:
    return json.loads((ckpt_dir / naming.step_dir_name(step) / MANIFEST).read_bytes())


# ------------------------------------------------------------------ every leaf kind


def test_load_returns_every_leaf_bit_exact_with_exact_types(make_ckpt, ckpt_dir):
    state = full_state()
    expected = copy.deepcopy(state)
    make_ckpt().save(1, state).wait()

    loaded = tiercheck.load(ckpt_dir)

    assert_same(loaded, expected)
    for t in tensors_and_arrays(loaded):
        if isinstance(t, torch.Tensor):
            assert type(t) is torch.Tensor
            assert t.device.type == "cpu"


def test_restore_writes_every_leaf_in_place_bit_exact(make_ckpt):
    state = full_state()
    expected = copy.deepcopy(state)
    ckpt = make_ckpt()
    ckpt.save(4, state).wait()
    template = placeholder(state)
    assert isinstance(template, dict)
    # non-contiguous template tensors are filled through their views
    template["tensors"]["transposed"] = torch.zeros(8, 6).t()
    strided_base = torch.zeros(8, 6)
    template["tensors"]["strided"] = strided_base[1::3, ::2]
    targets = tensors_and_arrays(template)

    assert ckpt.restore(template) == 4

    assert_same(template, expected)
    # the very same tensor/array objects now hold the data (restore is in place)
    assert all(a is b for a, b in zip(tensors_and_arrays(template), targets, strict=True))
    # writing the strided view left the rest of its base untouched
    mask = torch.ones(8, 6, dtype=torch.bool)
    mask[1::3, ::2] = False
    assert torch.equal(strided_base[mask], torch.zeros(int(mask.sum())))


def test_float_specials_keep_sign_bit(make_ckpt, ckpt_dir):
    make_ckpt().save(0, {"negzero": -0.0, "zero": 0.0, "vals": [math.nan, -math.inf]}).wait()
    got = tiercheck.load(ckpt_dir)
    assert math.copysign(1.0, got["negzero"]) == -1.0
    assert math.copysign(1.0, got["zero"]) == 1.0
    assert math.isnan(got["vals"][0])
    assert got["vals"][1] == -math.inf


def test_int_and_str_keys_side_by_side_keep_their_type(make_ckpt, ckpt_dir):
    make_ckpt().save(1, {"d": {0: "int", "0": "str", -1: "neg", 2**40: "big"}}).wait()
    d = tiercheck.load(ckpt_dir)["d"]
    assert [(type(k), k, v) for k, v in d.items()] == [
        (int, 0, "int"),
        (str, "0", "str"),
        (int, -1, "neg"),
        (int, 2**40, "big"),
    ]


def test_large_int_dict_key_round_trips_or_is_rejected_at_save(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    try:
        ckpt.save(1, {"d": {10**40: "x"}}).wait()
    except tiercheck.UnsupportedStateError:
        return  # rejecting it at save() also honours the contract
    assert tiercheck.load(ckpt_dir)["d"] == {10**40: "x"}


def test_huge_int_round_trips_or_is_rejected_at_save(make_ckpt, ckpt_dir):
    ckpt = make_ckpt()
    try:
        ckpt.save(1, {"x": 10**5000}).wait()
    except tiercheck.UnsupportedStateError:
        return
    assert tiercheck.load(ckpt_dir)["x"] == 10**5000


def test_tuples_stay_tuples_and_lists_stay_lists_via_restore(make_ckpt):
    ckpt = make_ckpt()
    value = {"seq": ([1, (2, [3])], [(4,), []])}
    ckpt.save(1, value).wait()
    template: dict[str, Any] = {"seq": None}
    ckpt.restore(template)
    assert_same(template, {"seq": ([1, (2, [3])], [(4,), []])})


# ------------------------------------------------------------------ tied tensors


def test_two_keys_sharing_a_tensor_are_written_once(make_ckpt, ckpt_dir):
    t = torch.arange(1024, dtype=torch.float32)  # exactly one 4 KiB block
    state = {"a": t, "b": t, "copy": t.clone(), "view": t.view(32, 32)}
    make_ckpt().save(1, state).wait()

    entries = {e["path"]: e for e in read_manifest(ckpt_dir, 1)["entries"]}
    assert entries["state['a']"]["offset"] == entries["state['b']"]["offset"]
    assert entries["state['copy']"]["offset"] != entries["state['a']"]["offset"]
    assert entries["state['view']"]["offset"] != entries["state['a']"]["offset"]
    assert (ckpt_dir / naming.step_dir_name(1) / SHARD).stat().st_size == 3 * 4096

    loaded = tiercheck.load(ckpt_dir)
    for k in ("a", "b", "copy"):
        assert torch.equal(loaded[k], t)
    assert torch.equal(loaded["view"], t.view(32, 32))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 64)
        self.out = nn.Linear(64, 64, bias=False)
        self.out.weight = self.emb.weight


def test_module_with_tied_weights_is_written_once_and_stays_tied(make_ckpt, ckpt_dir):
    torch.manual_seed(0)
    model = TiedLM()
    expected = model.emb.weight.detach().clone()
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model}).wait()

    shard_size = (ckpt_dir / naming.step_dir_name(1) / SHARD).stat().st_size
    assert shard_size == 64 * 64 * 4  # once, not twice
    entries = {e["path"]: e for e in read_manifest(ckpt_dir, 1)["entries"]}
    assert entries["state['model']['emb.weight']"]["offset"] == entries["state['model']['out.weight']"]["offset"]

    torch.manual_seed(1)
    fresh = TiedLM()
    weight = fresh.emb.weight
    ckpt.restore({"model": fresh})
    assert fresh.emb.weight is weight
    assert fresh.out.weight is weight
    assert torch.equal(weight.detach(), expected)


# ------------------------------------------------------------------ stateful objects


def build_training(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, seed: int) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(seed))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()


def assert_optimizer_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert list(got["state"]) == list(want["state"])
    for idx, per_param in want["state"].items():
        assert sorted(got["state"][idx]) == sorted(per_param)
        for k, v in per_param.items():
            assert_tensor_bits(got["state"][idx][k], v, f"state[{idx}][{k}]")


def test_module_optimizer_and_schedulers_restore_in_place(make_ckpt):
    model, opt, sched = build_training(0)
    for s in range(3):
        train_step(model, opt, sched, s)
    p = nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([p], lr=1.0)
    lam = torch.optim.lr_scheduler.LambdaLR(sgd, lambda epoch: 0.9**epoch)
    for _ in range(3):
        sgd.step()
        lam.step()
    want_model = copy.deepcopy(model.state_dict())
    want_opt = copy.deepcopy(opt.state_dict())
    want_sched = sched.state_dict()
    ckpt = make_ckpt()
    ckpt.save(3, {"model": model, "opt": opt, "sched": sched, "sgd": sgd, "lam": lam}).wait()

    model2, opt2, sched2 = build_training(1)
    train_step(model2, opt2, sched2, 100)  # different state to overwrite
    params_before = list(model2.parameters())
    p2 = nn.Parameter(torch.zeros(1))
    sgd2 = torch.optim.SGD([p2], lr=1.0)
    lam2 = torch.optim.lr_scheduler.LambdaLR(sgd2, lambda epoch: 0.9**epoch)
    template = {"model": model2, "opt": opt2, "sched": sched2, "sgd": sgd2, "lam": lam2}
    assert ckpt.restore(template) == 3

    assert all(a is b for a, b in zip(model2.parameters(), params_before, strict=True))
    got_model = model2.state_dict()
    assert list(got_model) == list(want_model)
    for k, v in want_model.items():
        assert_tensor_bits(got_model[k], v, k)
    assert_optimizer_state_equal(opt2.state_dict(), want_opt)
    assert sched2.state_dict() == want_sched
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert lam2.last_epoch == 3
    assert sgd2.param_groups[0]["lr"] == sgd.param_groups[0]["lr"] == 0.9**3
    # training continues identically from the restored state
    train_step(model, opt, sched, 7)
    train_step(model2, opt2, sched2, 7)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_adam_restores_into_a_never_stepped_optimizer_and_via_load(make_ckpt, ckpt_dir):
    model, opt, sched = build_training(0)
    train_step(model, opt, sched, 0)
    want_opt = copy.deepcopy(opt.state_dict())
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model, "opt": opt}).wait()

    model2, opt2, _ = build_training(5)
    ckpt.restore({"model": model2, "opt": opt2})
    assert_optimizer_state_equal(opt2.state_dict(), want_opt)

    loaded = tiercheck.load(ckpt_dir)["opt"]
    assert all(type(k) is int for k in loaded["state"])
    assert type(loaded["param_groups"][0]["betas"]) is tuple
    _, opt3, _ = build_training(6)
    opt3.load_state_dict(loaded)
    assert_optimizer_state_equal(opt3.state_dict(), want_opt)


def test_template_subset_restores_only_the_named_top_level_keys(make_ckpt):
    """Only the top level may name a subset: a nested dict gets every key the checkpoint
    holds (DESIGN.md section 1), its own tensors filled in place."""
    model, opt, _ = build_training(0)
    ckpt = make_ckpt()
    ckpt.save(
        1, {"model": model, "opt": opt, "epoch": 3, "nested": {"x": torch.ones(2), "y": torch.full((2,), 5.0)}}
    ).wait()

    model2, _, _ = build_training(1)
    y = torch.zeros(2)
    template: dict[str, Any] = {"model": model2, "nested": {"y": y}}
    assert ckpt.restore(template) == 1
    assert list(template) == ["model", "nested"]
    assert sorted(template["nested"]) == ["x", "y"]
    assert template["nested"]["y"] is y
    assert torch.equal(y, torch.full((2,), 5.0))
    assert torch.equal(template["nested"]["x"], torch.ones(2))
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_plain_values_are_written_into_the_template_mapping(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"epoch": 7, "name": "run", "w": torch.ones(3), "cfg": {"lr": 0.5}}).wait()
    state: dict[str, Any] = {"epoch": 0, "name": "", "w": torch.zeros(3), "cfg": {"lr": 0.0}}
    cfg = state["cfg"]
    ckpt.restore(state)
    assert state["epoch"] == 7
    assert state["name"] == "run"
    assert state["cfg"] is cfg
    assert cfg["lr"] == 0.5
    assert torch.equal(state["w"], torch.ones(3))


# ------------------------------------------------------------------ RNG states


def test_rng_states_round_trip_and_reproduce_draws(make_ckpt, ckpt_dir):
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    gen = np.random.default_rng(3)
    np.random.standard_normal()  # leaves a cached gaussian in the legacy state
    state = {
        "torch": torch.get_rng_state(),
        "np_legacy": np.random.get_state(),
        "np_gen": gen.bit_generator.state,
        "py": random.getstate(),
    }
    want = (torch.rand(5), np.random.standard_normal(5), gen.random(5), [random.random() for _ in range(5)])
    ckpt = make_ckpt()
    ckpt.save(1, state).wait()

    def draws_after(restored: dict[str, Any]) -> tuple[Any, ...]:
        torch.set_rng_state(restored["torch"])
        np.random.set_state(restored["np_legacy"])
        g = np.random.default_rng()
        g.bit_generator.state = restored["np_gen"]
        random.setstate(restored["py"])
        return torch.rand(5), np.random.standard_normal(5), g.random(5), [random.random() for _ in range(5)]

    loaded = tiercheck.load(ckpt_dir)
    legacy = loaded["np_legacy"]
    assert type(legacy) is tuple
    assert legacy[0] == "MT19937"
    assert legacy[1].dtype == np.uint32 and legacy[1].shape == (624,)
    assert type(loaded["np_gen"]["state"]["state"]) is int
    assert loaded["np_gen"] == state["np_gen"]
    assert type(loaded["py"]) is tuple and type(loaded["py"][1]) is tuple

    for restored in (loaded, _restore_rng(ckpt)):
        got = draws_after(restored)
        assert torch.equal(got[0], want[0])
        assert np.array_equal(got[1], want[1])
        assert np.array_equal(got[2], want[2])
        assert got[3] == want[3]


def _restore_rng(ckpt: tiercheck.Checkpointer) -> dict[str, Any]:
    template: dict[str, Any] = {
        "torch": torch.zeros_like(torch.get_rng_state()),
        "np_legacy": None,
        "np_gen": None,
        "py": None,
    }
    ckpt.restore(template)
    return template


# ------------------------------------------------------------------ snapshot semantics


def test_mutating_state_after_save_returns_does_not_change_the_saved_step(make_ckpt, write_gate, ckpt_dir):
    model = nn.Linear(3, 2)
    state = {
        "w": torch.arange(6.0).reshape(2, 3),
        "z": torch.ones(4, dtype=torch.int64),
        "arr": np.arange(5, dtype=np.uint32),
        "model": model,
    }
    want = {
        "w": state["w"].clone(),
        "z": state["z"].clone(),
        "arr": state["arr"].copy(),
        "model": copy.deepcopy(model.state_dict()),
    }
    ckpt = make_ckpt()
    handle = ckpt.save(1, state)
    assert not handle.done()  # the writer is held at the gate: nothing written yet
    state["w"].add_(1)
    state["z"].zero_()
    state["arr"][:] = 7
    with torch.no_grad():
        model.weight.zero_()
    write_gate.set()
    handle.wait()

    loaded = tiercheck.load(ckpt_dir)
    assert_same(loaded["w"], want["w"])
    assert_same(loaded["z"], want["z"])
    assert_same(loaded["arr"], want["arr"])
    for k, v in want["model"].items():
        assert_tensor_bits(loaded["model"][k], v, k)


# ------------------------------------------------------------------ restore errors and steps


def test_template_key_missing_in_checkpoint_names_the_key(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"a": {"x": torch.ones(2)}}).wait()
    with pytest.raises(tiercheck.StateMismatchError) as ei:
        ckpt.restore({"a": {"x": torch.zeros(2), "q": torch.zeros(2)}})
    assert "state['a']['q']" in str(ei.value)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['extra'\]"):
        ckpt.restore({"a": {"x": torch.zeros(2)}, "extra": 1})


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float64), torch.zeros(6)],
    ids=["shape", "dtype", "flat"],
)
def test_shape_or_dtype_mismatch_names_the_path_and_changes_nothing(make_ckpt, bad):
    ckpt = make_ckpt()
    ckpt.save(1, {"ok": torch.ones(4), "a": {"x": torch.ones(2, 3)}, "epoch": 5}).wait()
    template: dict[str, Any] = {"ok": torch.zeros(4), "a": {"x": bad}, "epoch": None}
    with pytest.raises(tiercheck.StateMismatchError) as ei:
        ckpt.restore(template)
    assert "state['a']['x']" in str(ei.value)
    assert torch.equal(template["ok"], torch.zeros(4))  # nothing read before the error
    assert template["epoch"] is None
    assert torch.equal(bad, torch.zeros_like(bad))


def test_module_mismatch_leaves_the_module_untouched(make_ckpt):
    torch.manual_seed(0)
    ckpt = make_ckpt()
    ckpt.save(1, {"model": nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))}).wait()
    torch.manual_seed(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))  # second layer differs
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['model'\]"):
        ckpt.restore({"model": other})
    for k, v in before.items():
        assert torch.equal(other.state_dict()[k], v), k


def test_non_contiguous_numpy_template_is_filled(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"a": np.arange(3.0)}).wait()
    template = {"a": np.zeros(6)[::2]}
    ckpt.restore(template)
    assert np.array_equal(template["a"], np.arange(3.0))


def test_restore_returns_none_when_no_checkpoint_exists(make_ckpt, tmp_path):
    assert make_ckpt().restore({"x": torch.zeros(1)}) is None
    missing = tmp_path / "never-created"
    assert make_ckpt(local=missing).restore({"x": torch.zeros(1)}) is None
    with pytest.raises(tiercheck.NoCheckpointError):
        tiercheck.load(missing)


def test_restore_an_older_kept_step(make_ckpt):
    ckpt = make_ckpt(keep_local=None)
    for s in (1, 2, 3):
        ckpt.save(s, {"x": torch.full((4,), float(s)), "step": s})
    ckpt.wait()
    state: dict[str, Any] = {"x": torch.zeros(4), "step": None}
    assert ckpt.restore(state, step=2) == 2
    assert torch.equal(state["x"], torch.full((4,), 2.0))
    assert state["step"] == 2
    assert ckpt.restore(state) == 3
    assert state["step"] == 3
    with pytest.raises(tiercheck.NoCheckpointError):
        ckpt.restore(state, step=99)
    assert ckpt.steps() == ckpt.steps("local") == [1, 2, 3]
    assert ckpt.latest_step() == 3


# ------------------------------------------------------------------ handle and buffers


def test_save_handle_done_wait_and_stats(make_ckpt, write_gate):
    ckpt = make_ckpt()
    state = {"w": torch.zeros(1000), "v": torch.zeros(3, dtype=torch.int64)}
    handle = ckpt.save(1, state)
    assert handle.step == 1
    assert handle.done() is False
    assert handle.done("local") is False
    with pytest.raises(tiercheck.WaitTimeoutError):
        handle.wait(timeout=0.05)
    with pytest.raises(TimeoutError):
        ckpt.wait(timeout=0.05)
    with pytest.raises(ValueError):
        handle.wait(tier="remote")
    write_gate.set()
    handle.wait()
    assert handle.done() is True
    assert handle.done("local") is True

    stats = handle.stats
    assert stats.step == 1
    assert stats.bytes == 4096  # 4,000 + 24 bytes, the second at 4,032 (64-byte packing), padded to 4 KiB
    assert stats.stall_s > 0
    assert stats.stage_s > 0
    assert stats.allocated is True
    assert stats.tier_s["local"] > 0
    second = ckpt.save(2, state)
    second.wait("local")
    assert second.stats.allocated is False


def test_host_buffer_is_allocated_once_over_many_saves(make_ckpt, ckpt_dir):
    ckpt = make_ckpt(keep_local=2)
    state = {"w": torch.randn(256, 256), "i": np.arange(100), "epoch": 0}
    handles = []
    for step in range(20):
        state["w"].add_(1)
        state["epoch"] = step
        handles.append(ckpt.save(step, state))
    ckpt.wait()
    assert ckpt._pool.allocations == 1
    assert [h.stats.allocated for h in handles] == [True] + [False] * 19
    assert tiercheck.load(ckpt_dir)["epoch"] == 19
