"""Overlapped snapshots: save() returns before parameters and optimizer state are copied,
and the saved step is still exactly the state at save() while training goes on."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.steps import stage as staging


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
            assert release.wait(60)  # generous: a busy machine
        original(buf, flat, plan, deferred, progress)

    monkeypatch.setattr("tiercheck.engine.pipeline.stage_into", slow_stage)
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


# --------------------------------------------------------------- an overlapped save cannot tear


def test_optimizer_outside_the_state_keeps_parameters_out_of_the_overlap(tmp_path: Path, monkeypatch) -> None:
    """Nothing holds an optimizer the state lacks: its parameters are copied before save()
    returns (with a warning), so its next step cannot tear the saved weights."""
    model, opt, x = make_training()
    train_step(model, opt, x)
    hold_background_copy(monkeypatch)  # would block forever if anything were deferred
    with tiercheck.Checkpointer(local=tmp_path, overlap=True) as ckpt:
        for step in (1, 2):
            expected = snapshot(model, opt)
            with pytest.warns(RuntimeWarning, match="no optimizer in the saved state") if step == 1 else _no_warning():
                handle = ckpt.save(step, {"model": model})
            assert handle.staged()
            train_step(model, opt, x)  # the optimizer steps right away
            handle.wait()
            got = tiercheck.load(tmp_path, step=step)
            for k, v in expected["model"].items():  # type: ignore[union-attr]
                assert torch.equal(got["model"][k], v), k


def test_second_optimizer_the_state_lacks(tmp_path: Path, monkeypatch) -> None:
    """Parameters only a second optimizer updates are copied before save() returns; one that
    both update is deferred, and the second optimizer's step during the copy fails the step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model[1].parameters(), lr=0.1)
    x = torch.randn(4, 8)
    model(x).sum().backward()
    release = hold_background_copy(monkeypatch)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, overlap=True) as ckpt:
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.warns(RuntimeWarning, match="no optimizer"):
            handle = ckpt.save(1, {"model": model, "opt_a": opt_a})
        opt_b.step()  # not held back: model[1] was copied before save() returned
        release.set()
        handle.wait()
        got = tiercheck.load(tmp_path, step=1)
        for k, v in want.items():
            assert torch.equal(got["model"][k], v), k

        release.clear()
        shared = torch.optim.SGD(model[0].parameters(), lr=0.5)  # also updates opt_a's parameters
        handle = ckpt.save(2, {"model": model, "opt_a": opt_a})
        shared.step()  # during the deferred copy: model[0] changes under it
        release.set()
        with pytest.raises(tiercheck.TierError) as raised:
            handle.wait()
        assert isinstance(raised.value.__cause__, tiercheck.SnapshotChangedError)
        assert raised.value.step == 2
        assert "state['model']['0.weight']" in str(raised.value)
        ckpt.wait()  # raised once: the handle reported it, the checkpointer does not again
        assert ckpt.steps() == [1]


def test_in_place_edit_during_the_copy_fails_the_step(tmp_path: Path, monkeypatch) -> None:
    model, opt, x = make_training()
    train_step(model, opt, x)
    release = hold_background_copy(monkeypatch)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, overlap=True) as ckpt:
        release.set()
        ckpt.save(1, {"model": model, "opt": opt}).wait()
        release.clear()  # the copy of step 2 waits
        handle = ckpt.save(2, {"model": model, "opt": opt})
        with torch.no_grad():
            model[0].weight.mul_(0.5)  # an EMA-style edit outside optimizer.step()
        release.set()
        with pytest.raises(tiercheck.TierError, match=r"state\['model'\]\['0.weight'\] changed in place") as raised:
            ckpt.wait()
        assert raised.value.step == 2
        ckpt.wait()
        assert ckpt.steps() == [1]
        # after wait_staged() the same edit is fine
        handle = ckpt.save(3, {"model": model, "opt": opt})
        release.set()
        handle.wait_staged()
        with torch.no_grad():
            model[0].weight.mul_(0.5)
        handle.wait()
        assert ckpt.steps() == [1, 3]


class _no_warning:
    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
