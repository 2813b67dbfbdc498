"""Hugging Face Accelerate: `save_state`/`load_state` through tiercheck.

The equivalents of ``accelerator.save_state(dir)`` / ``accelerator.load_state(dir)``, for
everything an ``Accelerator`` tracks, written asynchronously to tiercheck's tiers::

    from tiercheck.integrations import accelerate as tc

    accelerator = Accelerator()
    model, opt, sched, dl = accelerator.prepare(model, opt, sched, dl)
    accelerator.register_for_checkpointing(ema)
    ckpt = tc.checkpointer(accelerator, local="ckpt", remote="s3://bucket/run7")
    step = tc.load_state(accelerator, ckpt)          # None: nothing saved yet
    ...
    tc.save_state(accelerator, ckpt, step)           # returns after the host copy

What is saved, per ``Accelerator`` (the keys of `state_of`):

* ``models``: each prepared model, unwrapped (no ``module.`` prefixes: a DDP run and a
  single-process run read each other's checkpoints); ``optimizers`` and ``schedulers``:
  the optimizers and schedulers inside Accelerate's wrappers;
* ``scaler``: the ``GradScaler`` (fp16 mixed precision), or None;
* ``custom``: the objects given to ``register_for_checkpointing`` (through
  ``state_dict``/``load_state_dict``);
* ``dataloaders``: for each prepared data loader, its epoch (``iteration``), the seed and
  epoch of Accelerate's ``SeedableRandomSampler``, and, with
  ``DataLoaderConfiguration(use_stateful_dataloader=True)``, the loader's own state (its
  position inside the epoch). Without a stateful loader, Accelerate keeps no position
  inside an epoch, and neither does this: skip the batches already seen with
  ``accelerator.skip_first_batches(dl, step_in_epoch)``, as with Accelerate's own
  checkpoints;
* ``rng``: this process's Python, numpy and torch (CPU, and CUDA when initialised) random
  states, restored on load, as Accelerate does;
* ``accelerator``: ``accelerator.step`` (the gradient-accumulation counter).

In a job of several processes every process calls both functions (like Accelerate's);
`checkpointer` marks models, optimizers, schedulers, scaler and registered objects
``replicated`` (written once), and data-loader and RNG states stay per process.
FSDP, DeepSpeed, Megatron-LM and XLA set-ups save through their own engines: use
Accelerate's ``save_state`` there. Hooks registered with
``register_save_state_pre_hook`` write files into a directory and are not called.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..checkpointer import Checkpointer
from ..errors import InvalidArgumentError, StateMismatchError
from ..format.tree import ROOT, key_path
from ..steps.handle import SaveHandle

__all__ = ["REPLICATED", "checkpointer", "load_state", "save_state", "state_of"]

REPLICATED = ("models", "optimizers", "schedulers", "scaler", "custom")
"""The keys of `state_of` that are the same on every process of a data-parallel job."""

_OWN_ENGINES = ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA")


def checkpointer(
    accelerator: Any,
    local: str | os.PathLike[str] | None = None,
    remote: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Checkpointer:
    """A `Checkpointer` for `accelerator`'s job: `REPLICATED` keys written once when there is
    more than one process (the job's rank and size come from the process group Accelerate
    initialised). Every other argument is the `Checkpointer`'s."""
    _check_supported(accelerator)
    if accelerator.num_processes > 1:
        options.setdefault("replicated", REPLICATED)
    return Checkpointer(local, remote, storage_options, **options)


def state_of(accelerator: Any) -> dict[str, Any]:
    """Everything `accelerator` tracks, as a tiercheck state (see the module docstring)."""
    _check_supported(accelerator)
    return {
        "models": [accelerator.unwrap_model(m) for m in accelerator._models],
        "optimizers": [getattr(o, "optimizer", o) for o in accelerator._optimizers],
        "schedulers": [getattr(s, "scheduler", s) for s in accelerator._schedulers],
        "scaler": accelerator.scaler,
        "custom": list(accelerator._custom_objects),
        "dataloaders": [_LoaderPosition(dl) for dl in accelerator._dataloaders],
        "rng": _RandomStates(),
        "accelerator": _Counters(accelerator),
    }


def save_state(
    accelerator: Any, ckpt: Checkpointer, step: int, *, metrics: Mapping[str, Any] | None = None
) -> SaveHandle:
    """``accelerator.save_state()`` through tiercheck: snapshot everything `accelerator`
    tracks as `step` and return once it is copied to host memory (the training loop may go
    on at once; the handle says when it is durable on each tier). Call it on every process.

    Args:
        metrics: numbers to record with the step (`Checkpointer.save`), e.g. for `KeepBest`.

    Raises:
        UnsupportedStateError: a registered object's state holds a value tiercheck cannot
            store (names its key path).
        InvalidArgumentError: an FSDP/DeepSpeed/Megatron-LM/XLA set-up (use Accelerate's).
    """
    handle = ckpt.save(step, state_of(accelerator), metrics=metrics)
    accelerator.project_configuration.iteration += 1  # as save_state() counts its saves
    return handle


def load_state(accelerator: Any, ckpt: Checkpointer, step: int | None = None, *, strict: bool = True) -> int | None:
    """``accelerator.load_state()`` through tiercheck: restore everything `accelerator`
    tracks from the newest committed step (or exactly `step`), in place, and the random
    states. Call it on every process (in a job it is collective, like `restore`).

    Returns:
        The restored step, or None when nothing was saved yet (nothing is changed then).

    Raises:
        StateMismatchError: the accelerator tracks other objects than the checkpoint holds
            (another number of models, or of registered objects...): raised before any
            weight, optimizer state or random state is changed.
        NoCheckpointError, CheckpointCorruptedError: as `Checkpointer.restore`.
    """
    state = state_of(accelerator)
    # Each list of tracked objects as a template list that must keep its length: restore
    # refuses it while binding, before a byte is read or a live object is touched.
    for kind in _COUNTED:
        state[kind] = _Tracked(state[kind])
    try:
        return ckpt.restore(state, step, strict=strict)
    except StateMismatchError as exc:
        key = next((k for k in _COUNTED if str(exc).startswith(f"{key_path(ROOT, k)}: {_Tracked.REFUSED}")), None)
        if key is None:
            raise
        raise StateMismatchError(
            f"{key_path(ROOT, key)}: the accelerator tracks {len(state[key])} {key}, the checkpoint holds "
            f"another number (prepare and register the objects the saving job had); nothing was loaded ({exc})"
        ) from None


_COUNTED = ("models", "optimizers", "schedulers", "custom", "dataloaders")


class _Tracked(list[Any]):
    """A restore template for the objects of one kind an accelerator tracks.

    Restore fills a template list of the checkpoint's length element by element, and
    replaces one of another length, unless the template is stateful: then it refuses while
    binding. Stateful in name only (it is never saved: `state_of` gives plain lists), so
    that a checkpoint of another count is refused before anything changes.
    """

    REFUSED = "the template holds a _Tracked"

    def state_dict(self) -> dict[str, Any]:
        raise TypeError("a load_state template, never saved")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise TypeError("a load_state template: restore fills it as a list")


def _check_supported(accelerator: Any) -> None:
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind in _OWN_ENGINES:
        raise InvalidArgumentError(
            f"tiercheck.integrations.accelerate does not save {kind} set-ups (their engines shard and save "
            "the state themselves): use accelerator.save_state() there"
        )


class _LoaderPosition:
    """A prepared data loader's epoch, sampler seed/epoch and (stateful loaders) position."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def _sampler(self) -> Any:
        get = getattr(self._loader, "get_sampler", None)
        sampler = get() if callable(get) else None
        return sampler if hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch") else None

    def state_dict(self) -> dict[str, Any]:
        dl = self._loader
        sampler = self._sampler()
        out: dict[str, Any] = {"iteration": int(getattr(dl, "iteration", 0))}
        if sampler is not None:
            out["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
        if getattr(dl, "use_stateful_dataloader", False):
            out["loader"] = dl.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        dl = self._loader
        if hasattr(dl, "iteration"):
            dl.iteration = state["iteration"]
        sampler = self._sampler()
        if sampler is not None and "sampler" in state:
            sampler.epoch = state["sampler"]["epoch"]
            sampler.initial_seed = state["sampler"]["initial_seed"]
        if "loader" in state and getattr(dl, "use_stateful_dataloader", False):
            dl.load_state_dict(dict(state["loader"]))


class _RandomStates:
    """This process's random number generators, as Accelerate saves them."""

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class _Counters:
    """``accelerator.step``: where gradient accumulation stands."""

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self._accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._accelerator.step = state["step"]
