"""`tiercheck.integrations.accelerate` with the real `accelerate` library on CPU."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

accelerate = pytest.importorskip("accelerate")

import tiercheck  # noqa: E402
from tiercheck.format import naming  # noqa: E402
from tiercheck.integrations import accelerate as tc  # noqa: E402

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "accelerate_worker.py")


def run_worker(
    tmp_path: Path, name: str, ckpt: Path, remote: str, kill_at: int, resume: bool
) -> subprocess.CompletedProcess[str]:
    out = tmp_path / f"{name}.json"
    return subprocess.run(
        [sys.executable, WORKER, str(out), str(ckpt), remote, "40", str(kill_at), "1" if resume else "0"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[len("step-") :]) for p in root.glob("step-*") if (p / naming.COMMIT_NAME).is_file())


def test_sigkill_then_load_state_resumes_bit_exact(tmp_path: Path) -> None:
    """An uninterrupted run, and one SIGKILLed at step 22 and resumed with load_state: the
    same losses at every step after the resume, the same final weights, registered object,
    LR and accelerator step (dropout, shuffling, numpy and Python draws included)."""
    remote = f"file://{tmp_path}/remote"
    ref = run_worker(tmp_path, "ref", tmp_path / "ref", "", -1, False)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = run_worker(tmp_path, "killed", tmp_path / "ckpt", remote, 22, False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = committed(tmp_path / "ckpt")
    assert saved and set(saved) <= {4, 9, 14, 19} and 19 >= max(saved) >= 14
    resumed = run_worker(tmp_path, "resumed", tmp_path / "ckpt", remote, -1, True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = json.loads((tmp_path / "ref.json").read_text())
    b = json.loads((tmp_path / "resumed.json").read_text())
    assert b["start"] == max(saved)
    assert sorted(map(int, b["losses"])) == list(range(max(saved) + 1, 40))
    for step, loss in b["losses"].items():
        assert loss == a["losses"][step], f"step {step}"
    for key in ("final", "tally", "lr", "step"):
        assert b[key] == a[key], key
    assert committed(tmp_path / "ckpt")[-1] == 39 and committed(tmp_path / "remote")[-1] == 39


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.ema = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]
        self.ema = state["ema"].clone()


@pytest.fixture
def accelerator() -> Any:
    acc = accelerate.Accelerator(cpu=True)
    yield acc
    acc.free_memory()


def test_save_and_load_state_round_trip_everything_tracked(tmp_path: Path, accelerator: Any) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    for (x,) in dl:
        model(x).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    counter.n, counter.ema = 7, torch.tensor([1.0, 2.0, 3.0])
    accelerator.step = 3
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    before = {
        "w": model.weight.detach().clone(),
        "opt": opt.state_dict()["state"][0]["momentum_buffer"].clone(),
        "sched": sched.state_dict()["last_epoch"],
        "draws": (random.random(), float(np.random.rand()), torch.rand(1).item()),
        "iteration": dl.iteration,
    }
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        assert tc.load_state(accelerator, ckpt) is None  # nothing yet: nothing changes
        handle = tc.save_state(accelerator, ckpt, 12, metrics={"loss": 0.5})
        assert accelerator.project_configuration.iteration == 1
        handle.wait()
        assert ckpt.metrics(12) == {"loss": 0.5}
        saved = tiercheck.load(tmp_path)
        assert set(saved) == {"models", "optimizers", "schedulers", "scaler", "custom", "dataloaders", "rng",
                              "accelerator"}  # fmt: skip
        assert list(saved["models"][0]) == ["weight", "bias"]  # unwrapped: no "module." prefix
        # Scribble over everything, then load.
        with torch.no_grad():
            model.weight.fill_(0)
        opt.state[model.weight]["momentum_buffer"].fill_(0)
        sched.step()
        counter.n, counter.ema = 0, torch.zeros(3)
        accelerator.step = 0
        dl.iteration = 9
        random.random(), np.random.rand(), torch.rand(1)
        assert tc.load_state(accelerator, ckpt) == 12
    assert torch.equal(model.weight, before["w"])
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], before["opt"])
    assert sched.state_dict()["last_epoch"] == before["sched"]
    assert counter.n == 7 and torch.equal(counter.ema, torch.tensor([1.0, 2.0, 3.0]))
    assert accelerator.step == 3 and dl.iteration == before["iteration"]
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == before["draws"]


def rng_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def assert_same_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0]
    assert a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:]
    assert torch.equal(a[2], b[2])


@pytest.mark.parametrize("change", ["register_one_more", "track_one_fewer"])
def test_load_state_refused_for_other_tracked_objects_changes_nothing(
    tmp_path: Path, accelerator: Any, change: str
) -> None:
    """A checkpoint holding another number of registered objects than the accelerator
    tracks: `load_state` raises StateMismatchError, and the weights, the optimizer's state,
    the registered objects and every RNG stream are bit-identical to before the call."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    first = Counter()
    accelerator.register_for_checkpointing(first)
    if change == "track_one_fewer":
        accelerator.register_for_checkpointing(Counter())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        tc.save_state(accelerator, ckpt, 1).wait()
        # The live objects move on past the checkpoint, so a partial load would show.
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        first.n, first.ema = 5, torch.tensor([4.0, 5.0, 6.0])
        if change == "register_one_more":
            accelerator.register_for_checkpointing(Counter())
        else:
            accelerator._custom_objects.pop()
        random.random(), np.random.rand(), torch.rand(3)  # RNG streams past the saved ones
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        opt_state = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        rngs = rng_states()
        with pytest.raises(tiercheck.StateMismatchError, match="custom"):
            tc.load_state(accelerator, ckpt)
        after = rng_states()
    assert_same_rng(after, rngs)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, opt_state[k]) for k, v in opt.state_dict()["state"][0].items())
    assert first.n == 5 and torch.equal(first.ema, torch.tensor([4.0, 5.0, 6.0]))
