"""A tiny Lightning job for tests/integrations/test_lightning.py: ``python tests/helpers/lightning_worker.py OUT.json
CKPT_DIR REMOTE_URL MAX_STEPS KILL_AT RESUME [SLOW_WRITE_S]``, or `fit` in-process.

The data and save points are chosen so that Lightning itself resumes bit-exactly (see
docs/integrations.md): 5 batches per epoch, no shuffling, a save every 5 steps (at the end
of each epoch), no randomness in the training step, one thread.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiercheck.integrations.lightning import TiercheckIO


class Net(pl.LightningModule):
    def __init__(self, width: int = 16, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)}


def weights_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Record(Callback):
    """Per step: the loss (exact) and a digest of the weights; SIGKILL at `kill_at`."""

    def __init__(self, kill_at: int = -1) -> None:
        self.losses: dict[int, str] = {}
        self.digests: dict[int, str] = {}
        self.kill_at = kill_at

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        step = trainer.global_step
        self.losses[step] = outputs["loss"].item().hex()
        self.digests[step] = weights_digest(module)
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` by hand at the given steps (a milestone)."""

    def __init__(self, paths: dict[int, str]) -> None:
        self.paths = paths

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        path = self.paths.get(trainer.global_step)
        if path is not None:
            trainer.save_checkpoint(path)


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(20, 8, generator=g), torch.randn(20, 1, generator=g))
    return DataLoader(ds, batch_size=4, shuffle=False)


def fit(
    ckpt_dir: str,
    remote: str | None,
    max_steps: int,
    *,
    kill_at: int = -1,
    ckpt_path: str | None = None,
    checkpoint: ModelCheckpoint | None = None,
    io: Any = None,
    model: pl.LightningModule | None = None,
    callbacks: Sequence[Callback] = (),
) -> tuple[Record, pl.LightningModule, pl.Trainer]:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = model if model is not None else Net()
    record = Record(kill_at)
    checkpoint = checkpoint or ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1, save_last=True)
    trainer = pl.Trainer(
        plugins=[io if io is not None else TiercheckIO(local=ckpt_dir, remote=remote)],
        callbacks=[record, *callbacks, checkpoint],
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return record, model, trainer


def main() -> None:
    out, ckpt_dir, remote, max_steps, kill_at, resume = sys.argv[1:7]
    if len(sys.argv) > 7:  # a slow disk: each tier-1 file write sleeps first
        from tiercheck.tiers import local

        pause, write_all = float(sys.argv[7]), local.LocalTier._write_all

        def slow(self: Any, *args: Any) -> Any:
            time.sleep(pause)
            return write_all(self, *args)

        local.LocalTier._write_all = slow  # type: ignore[method-assign]
    record, model, _ = fit(
        ckpt_dir, remote or None, int(max_steps), kill_at=int(kill_at), ckpt_path="last" if resume == "1" else None
    )
    with open(out, "w") as f:
        json.dump({"losses": record.losses, "digests": record.digests, "final": weights_digest(model)}, f)


if __name__ == "__main__":
    main()
