"""`tiercheck.integrations.lightning.TiercheckIO` with the real Lightning Trainer on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import tiercheck  # noqa: E402
from tests.helpers.lightning_worker import Net, SaveAt, fit, weights_digest  # noqa: E402
from tiercheck.format import naming  # noqa: E402
from tiercheck.integrations.lightning import TiercheckIO, load_from_checkpoint, read_pointer  # noqa: E402
from tiercheck.integrations.pointers import pointers_in, read_pointer_doc  # noqa: E402
from tiercheck.testing import Faults, FaultyTier  # noqa: E402
from tiercheck.tiers.local import LocalTier  # noqa: E402
from tiercheck.tiers.open import open_tier  # noqa: E402

WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "lightning_worker.py")
ModelCheckpoint = pl.callbacks.ModelCheckpoint


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[len("step-") :]) for p in root.glob("step-*") if (p / naming.COMMIT_NAME).is_file())


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
    # committed on tier 1. And last.ckpt is there: step 10 was committed before step 20's
    # save returned (one host buffer: the write of 15 waited for 10), and each save writes
    # the pointers of the steps durable by then, however far the done callbacks lag (on a
    # busy machine they had not run, last.ckpt was missing, and the resume started over).
    pointers = pointer_steps(killed_dir)
    assert all(s in on_disk for s in pointers.values()), (pointers, on_disk)
    assert pointers.get("last.ckpt", -1) >= 10 and {5, 10} <= set(on_disk), (pointers, on_disk)
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
    from tests.helpers.lightning_worker import data

    trainer.fit(Net(), data())
    loaded = io.load_checkpoint(ckpt_dir / "epoch=1-step=10.ckpt")
    assert loaded["loops"] == {k: v for k, v in captured.items() if k != "hp"}
    assert loaded["hyper_parameters"] == captured["hp"]
    state = next(v for k, v in loaded["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["dirpath"] == str(ckpt_dir)


def state_at(step: int) -> dict[str, Any]:
    return {"global_step": step, "state_dict": {"w": torch.full((3,), float(step))}}


def test_a_manual_save_keeps_its_step_when_top_k_removes_its_own_name(tmp_path: Path) -> None:
    """trainer.save_checkpoint("milestones/...") at a step ModelCheckpoint(save_top_k=1) also
    saved: top-k rotating its own name away leaves the step, for this session and the next."""
    ckpt_dir = tmp_path / "ckpt"
    milestones = {10: str(ckpt_dir / "milestones" / "at10.ckpt"), 20: str(ckpt_dir / "milestones" / "at20.ckpt")}
    checkpoint = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=5, save_top_k=1)
    record, _, _ = fit(str(ckpt_dir), None, 20, checkpoint=checkpoint, callbacks=[SaveAt(milestones)])
    assert pointer_steps(ckpt_dir) == {"epoch=3-step=20.ckpt": 20}  # top-1 removed 5, 10 and 15
    assert committed(ckpt_dir) == [10, 20]
    io = TiercheckIO(local=ckpt_dir)
    model = Net()
    model.load_state_dict(io.load_checkpoint(milestones[10])["state_dict"])
    assert weights_digest(model) == record.digests[10]
    # A restarted job's top-k rotating step 20's name away: that session knows the
    # milestones directory too (recorded in tier 1), so the step stays.
    io.remove_checkpoint(ckpt_dir / "epoch=3-step=20.ckpt")
    assert committed(ckpt_dir) == [10, 20]
    model.load_state_dict(io.load_checkpoint(milestones[20])["state_dict"])
    assert weights_digest(model) == record.digests[20]
    io.remove_checkpoint(milestones[20])  # its last name: now it goes
    io.teardown()
    assert committed(ckpt_dir) == [10]


def test_a_weights_only_checkpoint_beside_a_full_one_at_the_same_step(tmp_path: Path) -> None:
    """ModelCheckpoint(save_weights_only=True) saving before a full one at every step: both
    are checkpoints of their own, the full one resumes bit-exactly, the weights-only one
    holds what Lightning's weights-only file holds."""
    ckpt_dir, remote = tmp_path / "ckpt", f"file://{tmp_path}/remote"

    def checkpoints() -> tuple[Any, Any]:
        weights = ModelCheckpoint(  # a monitor: Lightning needs the two callbacks' state keys to differ
            dirpath=str(ckpt_dir / "weights"),
            every_n_train_steps=5,
            save_top_k=-1,
            monitor="train_loss",
            save_weights_only=True,
        )
        return weights, ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=5, save_top_k=-1, save_last=True)

    ref, ref_model, _ = fit(str(tmp_path / "ref"), None, 15)
    weights, full = checkpoints()
    fit(str(ckpt_dir), remote, 10, checkpoint=full, callbacks=[weights])
    assert committed(ckpt_dir) == [5, 10] and committed(tmp_path / "remote") == [5, 10]
    assert committed(ckpt_dir / "weights-only") == [5, 10] == committed(tmp_path / "remote" / "weights-only")
    io = TiercheckIO(local=ckpt_dir, remote=remote)
    whole = io.load_checkpoint(ckpt_dir / "epoch=1-step=10.ckpt")
    only = io.load_checkpoint(ckpt_dir / "weights" / "epoch=1-step=10.ckpt")
    assert {"optimizer_states", "lr_schedulers", "callbacks"} <= set(whole)
    assert set(only) == set(whole) - {"optimizer_states", "lr_schedulers", "callbacks"}  # as Lightning builds it
    assert only["global_step"] == 10 and only["state_dict"].keys() == whole["state_dict"].keys()
    assert all(torch.equal(only["state_dict"][k], v) for k, v in whole["state_dict"].items())
    assert read_pointer_doc(str(ckpt_dir / "weights" / "epoch=1-step=10.ckpt")).store == "weights-only"  # type: ignore[union-attr]

    weights, full = checkpoints()
    record, model, _ = fit(str(ckpt_dir), remote, 15, ckpt_path="last", checkpoint=full, callbacks=[weights])
    assert min(record.losses) == 11
    assert all(record.losses[s] == ref.losses[s] for s in record.losses)
    assert weights_digest(model) == weights_digest(ref_model)
    assert committed(ckpt_dir / "weights-only") == [5, 10, 15]


def test_save_checkpoint_after_fit_adds_a_name_for_the_newest_step(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    record, _, trainer = fit(str(ckpt_dir), None, 20)
    trainer.save_checkpoint(ckpt_dir / "final.ckpt")  # step 20, committed during fit
    trainer.save_checkpoint(tmp_path / "export" / "final-weights.ckpt", weights_only=True)
    trainer.strategy.checkpoint_io.teardown()
    assert pointer_steps(ckpt_dir)["final.ckpt"] == 20
    assert committed(ckpt_dir) == [5, 10, 15, 20]
    io = TiercheckIO(local=ckpt_dir)
    for path in (ckpt_dir / "final.ckpt", tmp_path / "export" / "final-weights.ckpt"):
        loaded = io.load_checkpoint(path)
        model = Net()
        model.load_state_dict(loaded["state_dict"])
        assert loaded["global_step"] == 20 and weights_digest(model) == record.digests[20]
    assert "optimizer_states" not in io.load_checkpoint(tmp_path / "export" / "final-weights.ckpt")


def test_top_k_removal_during_a_catch_up_upload_deletes_the_step_when_it_ends(tmp_path: Path) -> None:
    """A restarted job uploads the steps an earlier run left on tier 1 only; top-k removing
    one of them while it is being uploaded deletes it from both tiers once the upload ends."""
    ckpt_dir = tmp_path / "ckpt"
    earlier = TiercheckIO(local=ckpt_dir)  # the earlier run: killed before uploading, say
    for step in (5, 10):
        earlier.save_checkpoint(state_at(step), ckpt_dir / f"epoch=0-step={step}.ckpt")
    earlier.teardown()
    faults, gate, uploading = Faults(), threading.Event(), threading.Event()
    faults.block("open_step", gate, timeout=120, steps={5}, when=lambda call: not uploading.set())
    remote = FaultyTier(open_tier(f"file://{tmp_path}/remote", role="remote"), faults)
    io = TiercheckIO(local=ckpt_dir, remote=remote)
    io.save_checkpoint(state_at(15), ckpt_dir / "epoch=0-step=15.ckpt")  # starts the catch-up upload
    assert uploading.wait(120)
    io.remove_checkpoint(ckpt_dir / "epoch=0-step=5.ckpt")  # what top-k does
    gate.set()
    io.teardown()
    assert committed(ckpt_dir) == [10, 15] and committed(tmp_path / "remote") == [10, 15]
    assert set(pointer_steps(ckpt_dir).values()) == {10, 15}


def test_load_from_checkpoint_of_a_pointer(tmp_path: Path) -> None:
    """Model.load_from_checkpoint(mc.best_model_path) bypasses CheckpointIO: it fails with a
    message naming tiercheck and its helper, and the helper loads the model."""
    ckpt_dir = tmp_path / "ckpt"
    checkpoint = ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=5, save_top_k=1, monitor="train_loss")
    record, _, _ = fit(str(ckpt_dir), None, 20, checkpoint=checkpoint)
    best = checkpoint.best_model_path
    with pytest.raises(
        ValueError, match=r"tiercheck: .* is not a checkpoint but a TiercheckIO pointer .*load_from_checkpoint"
    ):
        Net.load_from_checkpoint(best)
    seen = torch.load(best, weights_only=True)  # a dict of strings and ints, nothing else
    assert seen["tiercheck_pointer"]["step"] == read_pointer(best)
    model = load_from_checkpoint(Net, best)
    assert isinstance(model, Net) and model.hparams == {"width": 16, "lr": 1e-2}
    assert weights_digest(model) == record.digests[read_pointer(best)]  # type: ignore[index]
    wider = load_from_checkpoint(Net, ckpt_dir / "last.ckpt", TiercheckIO(local=ckpt_dir), strict=False, lr=0.5)
    assert wider.hparams["lr"] == 0.5


def test_last_ckpt_names_a_committed_step_while_pointer_callbacks_lag(tmp_path: Path, tier_faults: Faults) -> None:
    """The race behind a resume from nothing: step 5 committed, its done callback (which
    writes pointers) not yet run when step 10 is saved as the new last.ckpt. A kill then
    must find last.ckpt naming step 5, not no last.ckpt at all."""
    gate = threading.Event()
    tier_faults.block("write_file", gate, timeout=120, steps={10})
    io = TiercheckIO(local=FaultyTier(LocalTier(tmp_path), tier_faults))
    # Holding the plugin's lock keeps its done callbacks from running, as a busy machine's
    # scheduler (or a save blocked on a host buffer) does.
    with io._lock:
        io.save_checkpoint(state_at(5), tmp_path / "step=5.ckpt")
        io.save_checkpoint(state_at(5), tmp_path / "last.ckpt")
        deadline = time.monotonic() + 120
        while 5 not in committed(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition (the commit), with a generous deadline
        assert 5 in committed(tmp_path)
        io.save_checkpoint(state_at(10), tmp_path / "step=10.ckpt")
        io.save_checkpoint(state_at(10), tmp_path / "last.ckpt")
        assert pointer_steps(tmp_path) == {"step=5.ckpt": 5, "last.ckpt": 5}  # what a kill now leaves
    gate.set()
    io.teardown()
    assert pointer_steps(tmp_path) == {"step=5.ckpt": 5, "step=10.ckpt": 10, "last.ckpt": 10}


def test_a_pointer_is_plain_data_and_only_regular_pointer_files_are_read(tmp_path: Path) -> None:
    import io as _io
    import pickletools
    import zipfile

    from tiercheck.integrations.pointers import write_pointer

    path = tmp_path / "epoch=0-step=5.ckpt"
    write_pointer(str(path), 5, local=str(tmp_path))
    with zipfile.ZipFile(_io.BytesIO(path.read_bytes())) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("/data.pkl")))
    ops = {op.name for op, _, _ in pickletools.genops(pickled)}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"}, ops
    assert torch.load(path, weights_only=False)["tiercheck_pointer"]["step"] == 5  # nothing to run, either way
    (tmp_path / "old.ckpt").write_text(json.dumps({"format": "tiercheck-lightning-pointer", "version": 1, "step": 3}))
    os.mkfifo(tmp_path / "fifo.ckpt")  # would block an open() for reading forever
    (tmp_path / "dir.ckpt").mkdir()
    assert pointer_steps(tmp_path) == {"epoch=0-step=5.ckpt": 5, "old.ckpt": 3}
    for bad in ("fifo.ckpt", "dir.ckpt"):
        with pytest.raises(tiercheck.NoCheckpointError, match=r"not a tiercheck pointer|not a regular file"):
            read_pointer(str(tmp_path / bad))
