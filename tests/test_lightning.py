"""`tiercheck.integrations.lightning.TiercheckIO` with the real Lightning Trainer on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import tiercheck  # noqa: E402
from tests.lightning_worker import Net, fit, weights_digest  # noqa: E402
from tiercheck import layout  # noqa: E402
from tiercheck.integrations.lightning import TiercheckIO, pointers_in, read_pointer  # noqa: E402
from tiercheck.testing import Faults, FaultyTier  # noqa: E402
from tiercheck.tiers.local import LocalTier  # noqa: E402

WORKER = str(Path(__file__).with_name("lightning_worker.py"))
ModelCheckpoint = pl.callbacks.ModelCheckpoint


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[len("step-") :]) for p in root.glob("step-*") if (p / layout.COMMIT_NAME).is_file())


def pointer_steps(root: Path) -> dict[str, int]:
    return {os.path.basename(p): s for p, s in pointers_in(str(root)).items()}


def test_plugin_is_a_checkpoint_io_of_the_installed_lightning() -> None:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO

    assert isinstance(TiercheckIO(local="x"), CheckpointIO)
    with pytest.raises(ValueError):
        TiercheckIO()
    with pytest.raises(ValueError):
        TiercheckIO(local="x", world_size=2)


def test_sigkill_mid_fit_then_resume_from_last_is_bit_exact(tmp_path: Path) -> None:
    """An uninterrupted run, and a run SIGKILLed at step 22 while step 20 is still being
    written (a slow disk) and resumed with ckpt_path="last": the resumed run's losses and
    weights equal the uninterrupted run's, bit for bit."""
    remote = f"file://{tmp_path}/remote"
    ref, ref_model, _ = fit(str(tmp_path / "ref"), None, 40)
    killed_dir = tmp_path / "ckpt"
    out = tmp_path / "killed.json"
    proc = subprocess.run(
        [sys.executable, WORKER, str(out), str(killed_dir), remote, "40", "22", "0", "0.3"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    on_disk = committed(killed_dir)
    assert on_disk and max(on_disk) < 22
    # A crash never leaves a path naming an uncommitted step: every pointer names a step
    # committed on tier 1, and last.ckpt (if written) its newest.
    pointers = pointer_steps(killed_dir)
    assert pointers and all(s in on_disk for s in pointers.values()), (pointers, on_disk)
    assert 20 in on_disk or "epoch=3-step=20.ckpt" not in pointers
    resumed_from = max(on_disk)

    record, model, _ = fit(str(killed_dir), remote, 40, ckpt_path="last")
    assert min(record.losses) == resumed_from + 1
    for step, loss in record.losses.items():
        assert loss == ref.losses[step], f"step {step}"
        assert record.digests[step] == ref.digests[step], f"step {step}"
    assert weights_digest(model) == weights_digest(ref_model)
    # teardown drained: every save after the resume is committed on both tiers, with a pointer.
    assert committed(killed_dir) == [5, 10, 15, 20, 25, 30, 35, 40][: len(committed(killed_dir))]
    assert committed(killed_dir)[-1] == 40 and committed(tmp_path / "remote")[-1] == 40
    assert pointer_steps(killed_dir)["last.ckpt"] == 40
    assert pointer_steps(killed_dir)["epoch=7-step=40.ckpt"] == 40


def test_top_k_removal_deletes_steps_on_every_tier(tmp_path: Path) -> None:
    ckpt_dir, remote = tmp_path / "ckpt", tmp_path / "remote"
    checkpoint = ModelCheckpoint(
        dirpath=str(ckpt_dir), every_n_train_steps=2, save_top_k=2, monitor="train_loss", save_last=True
    )
    fit(str(ckpt_dir), f"file://{remote}", 24, checkpoint=checkpoint)
    pointers = pointer_steps(ckpt_dir)
    top_k = {os.path.basename(p) for p in checkpoint.best_k_models}
    assert set(pointers) == top_k | {"last.ckpt"}
    kept = sorted(set(pointers.values()))
    assert pointers["last.ckpt"] == 24
    assert committed(ckpt_dir) == kept and committed(remote) == kept  # the rest removed everywhere
    assert len(kept) in (2, 3)


def test_explicit_paths_resolve_to_committed_steps(tmp_path: Path) -> None:
    ckpt_dir, remote = tmp_path / "ckpt", f"file://{tmp_path}/remote"
    record, _, _ = fit(str(ckpt_dir), remote, 20)
    io = TiercheckIO(local=ckpt_dir, remote=remote)
    at10 = io.load_checkpoint(ckpt_dir / "epoch=1-step=10.ckpt")
    assert at10["global_step"] == 10 and at10["epoch"] == 1
    model = Net()
    model.load_state_dict(at10["state_dict"])
    assert weights_digest(model) == record.digests[10]
    assert io.load_checkpoint(ckpt_dir / "last.ckpt")["global_step"] == 20
    assert set(at10) >= {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters"}
    assert at10["hyper_parameters"] == {"width": 16, "lr": 1e-2}
    # A new node with only tier 2 (no pointer files): last.ckpt is the newest committed step,
    # other names resolve through their step=N.
    fresh = TiercheckIO(remote=remote)
    assert fresh.load_checkpoint(tmp_path / "elsewhere" / "last.ckpt")["global_step"] == 20
    assert fresh.load_checkpoint(tmp_path / "elsewhere" / "epoch=2-step=15.ckpt")["global_step"] == 15
    with pytest.raises(tiercheck.NoCheckpointError):
        fresh.load_checkpoint(tmp_path / "elsewhere" / "epoch=2-step=16.ckpt")  # not a committed step
    with pytest.raises(tiercheck.NoCheckpointError):
        fresh.load_checkpoint(tmp_path / "elsewhere" / "best.ckpt")  # no pointer, no step in the name
    torch.save({"x": 1}, ckpt_dir / "other.ckpt")
    with pytest.raises(tiercheck.NoCheckpointError):
        io.load_checkpoint(ckpt_dir / "other.ckpt")  # never unpickled
    assert io.load_checkpoint(ckpt_dir / "last.ckpt", map_location="meta")["state_dict"]["net.0.weight"].is_meta


def test_resume_from_an_explicit_older_path_starts_a_new_branch(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    fit(str(ckpt_dir), None, 20)
    with pytest.warns(RuntimeWarning, match="new branch"):
        record, _, _ = fit(str(ckpt_dir), None, 30, ckpt_path=str(ckpt_dir / "epoch=1-step=10.ckpt"))
    assert min(record.losses) == 11
    assert committed(ckpt_dir) == [5, 10, 15, 20, 25, 30]
    pointers = pointer_steps(ckpt_dir)
    assert pointers["last.ckpt"] == 30
    # The names of the abandoned steps went with them; reused, they name the new branch's.
    assert "epoch=2-step=15.ckpt" not in pointers and pointers["epoch=2-step=15-v1.ckpt"] == 15
    io = TiercheckIO(local=ckpt_dir)
    model = Net()
    model.load_state_dict(io.load_checkpoint(ckpt_dir / "epoch=3-step=20.ckpt")["state_dict"])
    assert weights_digest(model) == record.digests[20]
    # A fresh fit in a directory holding another run's newer steps is refused, not mixed in.
    with pytest.raises(tiercheck.StepConflictError):
        fit(str(ckpt_dir), None, 10)


def test_removing_a_step_still_being_written_deletes_it_once_durable(
    tmp_path: Path, write_gate: threading.Event, tier_faults: Faults
) -> None:
    io = TiercheckIO(local=FaultyTier(LocalTier(tmp_path), tier_faults))
    state = {"global_step": 5, "state_dict": {"w": torch.ones(3)}}
    io.save_checkpoint(state, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()  # no pointer before the step is committed
    io.remove_checkpoint(tmp_path / "a.ckpt")
    write_gate.set()
    io.teardown()
    assert committed(tmp_path) == [] and not (tmp_path / "a.ckpt").exists()


def test_a_second_name_for_the_same_step_is_not_written_twice(tmp_path: Path) -> None:
    io = TiercheckIO(local=tmp_path)
    for step in (5, 10):
        state: dict[str, Any] = {"global_step": step, "state_dict": {"w": torch.full((3,), float(step))}}
        io.save_checkpoint(state, tmp_path / f"step={step}.ckpt")
        io.save_checkpoint(state, tmp_path / "last.ckpt")
    io.teardown()
    assert committed(tmp_path) == [5, 10]
    assert pointer_steps(tmp_path) == {"step=5.ckpt": 5, "step=10.ckpt": 10, "last.ckpt": 10}
    io.remove_checkpoint(tmp_path / "step=10.ckpt")  # last.ckpt still names step 10: kept
    assert committed(tmp_path) == [5, 10]
    io.remove_checkpoint(tmp_path / "step=5.ckpt")
    assert committed(tmp_path) == [10]
    assert read_pointer(str(tmp_path / "step=5.ckpt")) is None
    io.teardown()


def test_unstorable_hyperparameters_are_refused_naming_the_key(tmp_path: Path) -> None:
    io = TiercheckIO(local=tmp_path)
    with pytest.raises(tiercheck.UnsupportedStateError, match=r"state\['hyper_parameters'\]\['path'\]"):
        io.save_checkpoint({"global_step": 1, "hyper_parameters": {"path": Path("/data")}}, tmp_path / "x.ckpt")
    io.teardown()
    assert committed(tmp_path) == []


def test_callback_state_round_trips(tmp_path: Path) -> None:
    """What Lightning puts in the dict on CPU comes back equal (types: dicts for OrderedDicts)."""
    ckpt_dir = tmp_path / "ckpt"
    captured: dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
            if checkpoint["global_step"] == 10:
                captured.update(json.loads(json.dumps(checkpoint["loops"])), hp=dict(checkpoint["hyper_parameters"]))

    checkpoint = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=5, save_top_k=-1)
    io = TiercheckIO(local=ckpt_dir)
    trainer = pl.Trainer(
        plugins=[io], callbacks=[Capture(), checkpoint], max_steps=10, logger=False,
        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    from tests.lightning_worker import data

    trainer.fit(Net(), data())
    loaded = io.load_checkpoint(ckpt_dir / "epoch=1-step=10.ckpt")
    assert loaded["loops"] == {k: v for k, v in captured.items() if k != "hp"}
    assert loaded["hyper_parameters"] == captured["hp"]
    state = next(v for k, v in loaded["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["dirpath"] == str(ckpt_dir)
