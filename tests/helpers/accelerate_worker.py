"""A tiny Accelerate training loop for tests/integrations/test_accelerate.py: ``python
tests/helpers/accelerate_worker.py OUT.json CKPT_DIR REMOTE_URL TOTAL_STEPS KILL_AT RESUME``.

Everything that could make a resumed run differ is in it: dropout (the torch RNG), a
shuffled loader (Accelerate's seedable sampler), numpy and Python random draws in the loss,
an LR schedule, and a registered object. It saves every 5 steps, mid-epoch, with
`tiercheck.integrations.accelerate.save_state`, and resumes with `load_state` plus
``accelerator.skip_first_batches`` for the rest of the interrupted epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sys
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiercheck.integrations import accelerate as tc

BATCHES_PER_EPOCH = 6


class Tally:
    """A registered object: the sum of the losses so far (a float and a tensor)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.history = torch.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = state["total"]
        self.history = state["history"].clone()


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def build(ckpt_dir: str, remote: str | None) -> tuple[Any, ...]:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.97**s)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(
        torch.randn(4 * BATCHES_PER_EPOCH, 8, generator=g), torch.randn(4 * BATCHES_PER_EPOCH, 1, generator=g)
    )
    # The loader's own generator: creating an iterator then draws from it, not from the
    # global torch RNG (whose stream the dropout masks come from).
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    tally = Tally()
    accelerator.register_for_checkpointing(tally)
    ckpt = tc.checkpointer(accelerator, local=ckpt_dir, remote=remote, keep_local=None)
    return accelerator, model, opt, dl, sched, tally, ckpt


def run(ckpt_dir: str, remote: str | None, total: int, kill_at: int = -1, resume: bool = False) -> dict[str, Any]:
    accelerator, model, opt, dl, sched, tally, ckpt = build(ckpt_dir, remote)
    start = tc.load_state(accelerator, ckpt) if resume else None
    step = 0 if start is None else start + 1
    losses: dict[int, str] = {}
    while step < total:
        epoch, skip = divmod(step, BATCHES_PER_EPOCH)
        dl.set_epoch(epoch)
        loader = accelerator.skip_first_batches(dl, skip) if skip else dl
        for x, y in loader:
            model.train()
            noise = float(np.random.rand()) * 1e-3 + random.random() * 1e-3  # numpy and Python RNG
            loss = torch.nn.functional.mse_loss(model(x), y) + noise
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            tally.total += loss.item()
            tally.history = torch.cat([tally.history, loss.detach().reshape(1)])
            losses[step] = loss.item().hex()
            if step % 5 == 4:
                tc.save_state(accelerator, ckpt, step)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            step += 1
            if step == total:
                break
    ckpt.close()
    return {
        "start": start,
        "losses": losses,
        "final": digest(accelerator.unwrap_model(model)),
        "tally": tally.total.hex(),
        "lr": sched.get_last_lr()[0].hex(),
        "step": accelerator.step,
    }


def main() -> None:
    out, ckpt_dir, remote, total, kill_at, resume = sys.argv[1:7]
    result = run(ckpt_dir, remote or None, int(total), int(kill_at), resume == "1")
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
