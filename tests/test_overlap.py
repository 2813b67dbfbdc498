"""Overlapped snapshots: save() returns before parameters and optimizer state are copied,
and the saved step is still exactly the state at save() while training goes on."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck import staging


def make_training(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, torch.randn(32, 64)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()  # BatchNorm statistics change here, in forward
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()},
    }


def assert_saved_equals(root: Path, step: int, expected: dict[str, object]) -> None:
    got = tiercheck.load(root, step=step)
    model_exp = expected["model"]
    assert isinstance(model_exp, dict)
    assert got["model"].keys() == model_exp.keys()
    for k, v in model_exp.items():
        assert torch.equal(got["model"][k], v), k
    opt_exp = expected["opt"]
    assert isinstance(opt_exp, dict)
    for idx, st in opt_exp.items():
        for name, t in st.items():
            assert torch.equal(got["opt"]["state"][idx][name], t), (idx, name)


def hold_background_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The overlapped (background) part of the copy waits until the returned event is set."""
    release = threading.Event()
    original = staging.stage_into

    def slow_stage(buf, flat, plan, deferred=None, progress=None):  # type: ignore[no-untyped-def]
        if deferred is True:
            assert release.wait(10)
        original(buf, flat, plan, deferred, progress)

    monkeypatch.setattr("tiercheck.pipeline.stage_into", slow_stage)
    return release


def test_saved_step_is_the_state_at_save_while_training_continues(tmp_path: Path) -> None:
    model, opt, x = make_training()
    train_step(model, opt, x)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, overlap=True) as ckpt:
        for step in range(5):
            expected = snapshot(model, opt)
            handle = ckpt.save(step, {"model": model, "opt": opt})
            train_step(model, opt, x)  # no wait: forward, backward and the guarded step
            train_step(model, opt, x)
            handle.wait()
            assert handle.staged()
            assert_saved_equals(tmp_path, step, expected)


def test_optimizer_step_waits_for_the_background_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, x = make_training()
    train_step(model, opt, x)
    release = hold_background_copy(monkeypatch)
    with tiercheck.Checkpointer(local=tmp_path, overlap=True) as ckpt:
        expected = snapshot(model, opt)
        handle = ckpt.save(1, {"model": model, "opt": opt})
        assert not handle.staged()  # returned before the parameters were copied
        with pytest.raises(tiercheck.WaitTimeoutError):
            handle.wait_staged(timeout=0.05)
        stepped = threading.Event()

        def step_in_thread() -> None:
            train_step(model, opt, x)
            stepped.set()

        worker = threading.Thread(target=step_in_thread)
        worker.start()
        assert not stepped.wait(0.3)  # opt.step() is held by the guard
        release.set()
        worker.join(10)
        assert stepped.is_set()
        handle.wait()
        assert_saved_equals(tmp_path, 1, expected)


def test_buffers_and_plain_tensors_are_copied_before_save_returns(tmp_path: Path, monkeypatch) -> None:
    model, opt, x = make_training()
    train_step(model, opt, x)
    release = hold_background_copy(monkeypatch)
    extra = torch.arange(10.0)
    with tiercheck.Checkpointer(local=tmp_path, overlap=True) as ckpt:
        running_mean = model[1].running_mean.clone()
        handle = ckpt.save(1, {"model": model, "opt": opt, "extra": extra})
        model(x)  # forward in train mode: BatchNorm statistics change while the copy waits
        extra.add_(100)
        assert not torch.equal(model[1].running_mean, running_mean)
        release.set()
        handle.wait()
    got = tiercheck.load(tmp_path, step=1)
    assert torch.equal(got["model"]["1.running_mean"], running_mean)
    assert torch.equal(got["extra"], torch.arange(10.0))


def test_overlap_without_parameters_behaves_like_a_plain_save(tmp_path: Path) -> None:
    state = {"x": torch.ones(4)}
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:
        handle = ckpt.save(1, state, overlap=True)
        assert handle.staged()
        state["x"].zero_()
        handle.wait()
    assert torch.equal(tiercheck.load(tmp_path)["x"], torch.ones(4))


def test_close_removes_the_guard_hooks(tmp_path: Path) -> None:
    model, opt, x = make_training()
    train_step(model, opt, x)
    before = len(opt._optimizer_step_pre_hooks)
    ckpt = tiercheck.Checkpointer(local=tmp_path, overlap=True)
    ckpt.save(1, {"model": model, "opt": opt})
    ckpt.save(2, {"model": model, "opt": opt})
    assert len(opt._optimizer_step_pre_hooks) == before + 1  # installed once
    ckpt.close()
    assert len(opt._optimizer_step_pre_hooks) == before
