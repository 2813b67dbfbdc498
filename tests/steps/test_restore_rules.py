"""The restore rules of DESIGN.md section 1, one test each (docs/restore.md states them).

Restore makes the template equal to the checkpoint, reusing the template's memory:
tensors and arrays of the same shape and dtype are filled in place, stateful objects get
`load_state_dict` with fresh containers, plain values/lists/tuples take the checkpoint's
value, nested dicts get every key, only the top level names a subset, and `strict=False`
leaves (and reports) template keys the checkpoint lacks.
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiercheck
from tests.helpers.assertions import same


def sequential_lr(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=20)
    return model, opt, torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[5])


def test_sequential_lr_comes_back_with_its_last_lr(make_ckpt):
    """SequentialLR's `_last_lr` is the same list object as its first sub-scheduler's:
    writing the checkpoint into the lists `state_dict()` returned made the last write win."""
    model, opt, sched = sequential_lr()
    for _ in range(8):  # past the milestone: the cosine schedule is the one in force
        opt.step()
        sched.step()
    ckpt = make_ckpt()
    ckpt.save(8, {"model": model, "opt": opt, "sched": sched}).wait()

    model2, opt2, sched2 = sequential_lr(1)
    assert ckpt.restore({"model": model2, "opt": opt2, "sched": sched2}) == 8
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    for _ in range(10):  # and the schedule goes on identically, through the milestone
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert sched2.get_last_lr() == sched.get_last_lr()


class ClearExtend:
    """A data-loader-like state whose load_state_dict empties its own containers first."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.buf = torch.zeros(3)
        self.config = {"batch": 8, "shuffle": True}
        self.received: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"items": self.items, "buf": self.buf, "config": self.config}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.received = sd
        if sd["config"] != self.config:  # validates its own config against the checkpoint
            raise ValueError(f"config changed: {sd['config']} != {self.config}")
        self.items.clear()
        self.items.extend(sd["items"])
        self.buf.zero_()
        self.buf.add_(sd["buf"])


def test_custom_object_gets_fresh_containers_and_tensors(make_ckpt):
    saved = ClearExtend()
    saved.items.extend([4, 5, 6])
    saved.buf += 7
    ckpt = make_ckpt()
    ckpt.save(1, {"loader": saved}).wait()

    fresh = ClearExtend()
    own_items, own_buf, own_config = fresh.items, fresh.buf, fresh.config
    ckpt.restore({"loader": fresh})
    assert fresh.items == [4, 5, 6] and fresh.items is own_items
    assert torch.equal(fresh.buf, torch.full((3,), 7.0)) and fresh.buf is own_buf
    assert fresh.received is not None
    assert fresh.received["items"] is not own_items
    assert fresh.received["buf"] is not own_buf
    assert fresh.received["config"] is not own_config


def test_custom_object_config_check_sees_the_checkpoint(make_ckpt):
    saved = ClearExtend()
    ckpt = make_ckpt()
    ckpt.save(1, {"loader": saved}).wait()
    other = ClearExtend()
    other.config["batch"] = 16  # a changed config must be seen, not compared with itself
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['loader'\].*config changed"):
        ckpt.restore({"loader": other})


def test_module_and_optimizer_are_read_in_place(make_ckpt):
    """Modules and optimizers lend their tensors: no second copy of the model in memory."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model, "opt": opt}).wait()

    torch.manual_seed(1)
    model2 = nn.Linear(8, 4)
    opt2 = torch.optim.Adam(model2.parameters())
    model2(torch.randn(2, 8)).sum().backward()
    opt2.step()
    weight_ptr = model2.weight.data_ptr()
    exp_avg = opt2.state[model2.weight]["exp_avg"]
    ckpt.restore({"model": model2, "opt": opt2})
    assert model2.weight.data_ptr() == weight_ptr
    assert opt2.state[model2.weight]["exp_avg"] is exp_avg
    same(model2.state_dict(), model.state_dict())
    same(opt2.state_dict(), opt.state_dict())


def test_nested_dict_gets_every_checkpoint_key(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"meta": {"epoch": 3, "best": 0.25, "seen": {"a": 1}}, "w": torch.ones(2)}).wait()
    empty: dict[str, Any] = {"meta": {}}
    ckpt.restore(empty)
    same(empty["meta"], {"epoch": 3, "best": 0.25, "seen": {"a": 1}})
    some: dict[str, Any] = {"meta": {"epoch": 0}}
    inner = some["meta"]
    ckpt.restore(some)
    assert some["meta"] is inner  # filled in place
    assert inner == {"epoch": 3, "best": 0.25, "seen": {"a": 1}}


def test_lists_and_tuples_take_the_checkpoint_value(make_ckpt):
    ckpt = make_ckpt()
    t = torch.arange(3.0)
    ckpt.save(1, {"history": [0.5, 0.25, 0.125], "pair": (1, t), "tensors": [t, t + 1]}).wait()
    template: dict[str, Any] = {"history": [], "pair": None, "tensors": [torch.zeros(3), torch.zeros(3)]}
    first = template["tensors"][0]
    ckpt.restore(template)
    assert template["history"] == [0.5, 0.25, 0.125]
    assert type(template["pair"]) is tuple and template["pair"][0] == 1
    assert torch.equal(template["pair"][1], t)
    assert template["tensors"][0] is first and torch.equal(first, t)  # same length: in place
    longer: dict[str, Any] = {"history": [1.0] * 9}
    ckpt.restore(longer)
    assert longer["history"] == [0.5, 0.25, 0.125]


def test_meta_module_is_materialised(make_ckpt):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.train()
    model(torch.randn(8, 4))
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model, "w": torch.ones(3)}).wait()
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    template: dict[str, Any] = {"model": empty, "w": torch.empty(3, device="meta")}
    assert ckpt.restore(template) == 1
    for k, v in empty.state_dict().items():
        assert v.device.type == "cpu", k
    same(empty.state_dict(), model.state_dict())
    assert all(p.requires_grad for p in empty.parameters())
    assert template["w"].device.type == "cpu" and torch.equal(template["w"], torch.ones(3))


def test_optimizer_over_meta_parameters_is_refused(make_ckpt):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    ckpt = make_ckpt()
    ckpt.save(1, {"opt": opt}).wait()
    with torch.device("meta"):
        meta_model = nn.Linear(2, 2)
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['opt'\].*meta device"):
        ckpt.restore({"opt": torch.optim.SGD(meta_model.parameters(), lr=0.1, momentum=0.9)})


def _trained(groups: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    params = {
        "one": [{"params": list(model.parameters())}],
        "two": [{"params": list(model[0].parameters())}, {"params": list(model[1].parameters())}],
        "first-layer": [{"params": list(model[0].parameters())}],
    }[groups]
    opt = torch.optim.Adam(params, lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("saved, live", [("one", "two"), ("two", "one"), ("one", "first-layer")])
def test_an_optimizer_of_other_param_groups_is_refused_before_the_model_changes(make_ckpt, saved, live):
    model, opt = _trained(saved)
    ckpt = make_ckpt()
    ckpt.save(1, {"model": model, "opt": opt, "n": 1}).wait()
    other_model, other_opt = _trained(live)
    with torch.no_grad():
        for p in other_model.parameters():
            p.mul_(-3.0)  # differs from the checkpoint's, so a partial restore would show
    before = {k: v.clone() for k, v in other_model.state_dict().items()}
    opt_before = other_opt.state_dict()
    template = {"model": other_model, "opt": other_opt, "n": 0}
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['opt'\]\['param_groups'\].*nothing was restored"):
        ckpt.restore(template, step=1)
    for k, v in other_model.state_dict().items():
        assert torch.equal(v, before[k]), k
    after = other_opt.state_dict()
    assert after["param_groups"] == opt_before["param_groups"]
    for i, st in opt_before["state"].items():
        for name, t in st.items():
            assert torch.equal(after["state"][i][name], t), (i, name)
    assert template["n"] == 0


def test_module_dtype_change_is_an_error_not_a_silent_cast(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"model": nn.Linear(2, 2)}).wait()
    half = nn.Linear(2, 2).to(torch.bfloat16)
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['model'\]\['weight'\].*bfloat16"):
        ckpt.restore({"model": half})


def test_kind_conflict_names_the_path(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"x": 3, "m": {"a": 1}}).wait()
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['x'\].*Tensor.*int"):
        ckpt.restore({"x": torch.zeros(1)})
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['m'\].*Linear.*dict"):
        ckpt.restore({"m": nn.Linear(1, 1)})


def test_strict_false_leaves_and_reports_missing_keys(make_ckpt, caplog):
    ckpt = make_ckpt()
    ckpt.save(1, {"model": {"w": torch.ones(2)}, "step": 1}).wait()
    ema = torch.full((2,), 9.0)
    template: dict[str, Any] = {"model": {"w": torch.zeros(2), "new": 5}, "step": 0, "ema": ema}
    with pytest.raises(tiercheck.StateMismatchError) as raised:
        ckpt.restore(template)
    assert "state['model']['new']" in str(raised.value) and "state['ema']" in str(raised.value)
    assert template["step"] == 0 and torch.equal(template["model"]["w"], torch.zeros(2))  # untouched
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO, "tiercheck.events"):
        warnings.simplefilter("always")
        assert ckpt.restore(template, strict=False) == 1
    assert template["step"] == 1 and torch.equal(template["model"]["w"], torch.ones(2))
    assert template["ema"] is ema and torch.equal(ema, torch.full((2,), 9.0))
    assert template["model"]["new"] == 5
    messages = [str(w.message) for w in caught if "strict=False" in str(w.message)]
    assert len(messages) == 1
    assert "state['model']['new']" in messages[0] and "state['ema']" in messages[0]
    events = [json.loads(r.getMessage()) for r in caplog.records if "restore_missing_keys" in r.getMessage()]
    assert [sorted(e["keys"]) for e in events] == [["state['ema']", "state['model']['new']"]]


def test_restore_twice_and_numpy_in_place(make_ckpt):
    ckpt = make_ckpt()
    arr = np.arange(6, dtype=np.uint32).reshape(2, 3)
    ckpt.save(1, {"a": arr, "s": np.float32(1.5)}).wait()
    template: dict[str, Any] = {"a": np.zeros((2, 3), dtype=np.uint32), "s": np.float32(0)}
    target = template["a"]
    for _ in range(2):
        ckpt.restore(template)
        assert template["a"] is target
        same(target, arr)
        same(template["s"], np.float32(1.5))
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['a'\].*array"):
        ckpt.restore({"a": np.zeros((3, 2), dtype=np.uint32)})


def test_saved_state_dict_restores_into_a_module(make_ckpt):
    """A step saved as a plain dict (`model.state_dict()`) restores into the module."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    ckpt = make_ckpt()
    ckpt.save(1, {"model": dict(model.state_dict())}).wait()
    other = nn.Linear(3, 3)
    ckpt.restore({"model": other})
    same(other.state_dict(), model.state_dict())


def sgd_two_groups(lr0: torch.Tensor, lr1: torch.Tensor) -> torch.optim.Optimizer:
    w, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    return torch.optim.SGD([{"params": [w], "lr": lr0}, {"params": [b], "lr": lr1}])


def test_template_tensor_shared_by_two_keys_holding_different_values(make_ckpt):
    """Two template keys share one tensor, the checkpoint holds two values: each key gets
    its own value (no read clobbers the other), never a silent mix or a false corruption."""
    ckpt = make_ckpt()
    ckpt.save(1, {"o": sgd_two_groups(torch.tensor(0.1), torch.tensor(0.2))}).wait()
    ckpt.save(2, {"o": sgd_two_groups(torch.tensor(0.3), torch.tensor(0.4))}).wait()
    shared = torch.tensor(0.0)
    opt = sgd_two_groups(shared, shared)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to an older step
        assert ckpt.restore({"o": opt}) == 2
    assert [float(g["lr"]) for g in opt.param_groups] == [float(torch.tensor(0.3)), float(torch.tensor(0.4))]

    ckpt.save(3, {"a": torch.ones(4), "b": torch.full((4,), 2.0), "c": torch.ones(4)}).wait()
    t = torch.zeros(4)
    template: dict[str, Any] = {"a": t, "b": t, "c": torch.zeros(4)}
    assert ckpt.restore(template) == 3
    assert torch.equal(template["a"], torch.ones(4)) and torch.equal(template["b"], torch.full((4,), 2.0))


def test_tied_on_both_sides_is_read_once_in_place(make_ckpt):
    ckpt = make_ckpt()
    w = torch.arange(6.0)
    ckpt.save(1, {"a": w, "b": w}).wait()
    t = torch.zeros(6)
    template: dict[str, Any] = {"a": t, "b": t}
    ckpt.restore(template)
    assert template["a"] is t and template["b"] is t and torch.equal(t, w)


def test_partly_overlapping_template_views_are_refused(make_ckpt):
    ckpt = make_ckpt()
    ckpt.save(1, {"a": torch.ones(4), "b": torch.full((4,), 2.0)}).wait()
    base = torch.zeros(6)
    template: dict[str, Any] = {"a": base[0:4], "b": base[2:6]}
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['a'\] and state\['b'\].*overlap"):
        ckpt.restore(template)
    assert torch.equal(base, torch.zeros(6))


def test_separate_arrays_in_neighbouring_memory_are_not_an_overlap(make_ckpt):
    """numpy strides count bytes: two arrays side by side in one buffer do not overlap."""
    ckpt = make_ckpt()
    ckpt.save(1, {"a": np.arange(12.0).reshape(3, 4), "b": np.arange(4.0)}).wait()
    base = np.zeros(16)
    template: dict[str, Any] = {"a": base[:12].reshape(3, 4), "b": base[12:]}
    ckpt.restore(template)
    assert np.array_equal(base, np.concatenate([np.arange(12.0), np.arange(4.0)]))
