"""Lightning: `TiercheckIO`, a ``CheckpointIO`` plugin that checkpoints through tiercheck.

The user's code is Lightning's usual idiom::

    io = TiercheckIO(local="ckpt", remote="s3://bucket/run7", storage_options=...)
    trainer = pl.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt",
                         every_n_train_steps=5, save_top_k=-1, save_last=True)], max_steps=40)
    trainer.fit(model, datamodule=dm, ckpt_path="last")   # resumes after a crash

How Lightning's paths map to tiercheck steps:

* each ``save_checkpoint(checkpoint, path)`` is tiercheck step ``checkpoint["global_step"]``
  of one of two stores: full checkpoints in the tiers given, weights-only ones (what
  ``save_weights_only=True`` builds: no optimizer or callback state) in their
  ``weights-only`` subdirectory (``local/weights-only``, ``remote/weights-only``). Two
  different dicts at one step are two checkpoints; a second name saved for a step already
  saved in its store (``last.ckpt`` right after ``epoch=0-step=5.ckpt``, or
  ``trainer.save_checkpoint("final.ckpt")`` after ``fit``) is a name for the same step,
  not written again;
* the file at `path` is a *pointer*: a tiny archive naming the store and step, written
  (atomically: temporary name, fsync, rename) only once the step is committed on its first
  tier, so a crash never leaves a path that names an uncommitted step. A pointer is
  written at the first chance once its step is durable (every call into the plugin checks,
  besides the done callback), so ``last.ckpt`` exists as soon as any step of it is
  committed. Lightning's own bookkeeping (``ckpt_path="last"`` lists the directory, the
  version counter checks for existing names) sees these files. ``torch.load`` opens a
  pointer (``weights_only=True`` suffices: it is a dict of strings and ints) and finds a
  note saying what it is; ``Model.load_from_checkpoint(pointer)``, which bypasses
  ``CheckpointIO``, fails with that note naming `load_from_checkpoint` here, which works;
* ``load_checkpoint(path)`` reads: for a ``last*.ckpt`` name, the newest committed step
  of its store (on any tier); else the step the pointer names; without a pointer (a new
  node that has only tier 2), the step in a ``step=N`` part of the name. A path that
  resolves to no committed step raises `NoCheckpointError` (a `FileNotFoundError`);
* ``remove_checkpoint(path)`` removes the pointer, and the step on every tier (marker
  first) once no pointer anywhere names it: the plugin remembers every directory it wrote
  a pointer into (a ``milestones/`` directory of ``trainer.save_checkpoint`` beside
  ModelCheckpoint's), in a small file in the tier-1 directory so a later session knows
  them too. A step still being written is deleted as soon as it is durable.

Only global rank 0 saves and removes (as Lightning's DDP strategies call the plugin);
every rank may load. The checkpoint dict is stored as it is (tensors, numpy, and plain
dict/list/tuple/str/int/float/bool/None/bytes values), never pickled: a value of another
type (an ``argparse.Namespace`` or a ``pathlib.Path`` among the hyperparameters) is
refused at save with `UnsupportedStateError` naming its key path. Loading returns plain
dicts (``OrderedDict`` and ``AttributeDict`` come back as ``dict``) and CPU tensors (or
moved as `map_location` says); Lightning's loading accepts both.

Works with ``pytorch_lightning`` and ``lightning.pytorch``: the plugin is an instance of
the ``CheckpointIO`` class of each one installed. The pointer files and the registry of the
directories holding them are `pointers.py`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import read_tiers
from ..checkpointer import Checkpointer
from ..errors import (
    ClosedError,
    InvalidArgumentError,
    NoCheckpointError,
    StepConflictError,
    StepInFlightError,
    TiercheckError,
)
from ..plan.retention import RetentionPolicy
from ..steps.catalog import list_committed
from ..steps.handle import SaveHandle
from ..steps.restore import restore_from
from ..tiers.base import Tier
from .pointers import (
    FULL,
    POINTER_FORMAT,
    WEIGHTS_ONLY,
    PointerDirs,
    Ref,
    read_pointer,
    read_pointer_doc,
    write_pointer,
)

__all__ = ["POINTER_FORMAT", "TiercheckIO", "load_from_checkpoint", "read_pointer"]

logger = logging.getLogger("tiercheck")

_LAST = re.compile(r"^last(-(\d+))?")  # ModelCheckpoint's test of a "last" checkpoint's stem
_STEP = re.compile(r"(?:^|[-_])step=(\d+)")


def _checkpoint_io_bases() -> tuple[type, ...]:
    bases: list[type] = []
    with contextlib.suppress(ImportError):
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as PlainCheckpointIO

        bases.append(PlainCheckpointIO)
    with contextlib.suppress(ImportError):
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as UnifiedCheckpointIO

        bases.append(UnifiedCheckpointIO)
    if not bases:
        raise ImportError(
            "tiercheck.integrations.lightning needs pytorch_lightning or lightning: pip install tiercheck[lightning]"
        )
    return tuple(bases)


def is_last(path: str) -> bool:
    """Whether Lightning treats `path` as a "last" checkpoint (``last.ckpt``, ``last-v1.ckpt``)."""
    p = Path(path)
    return p.suffix == ".ckpt" and bool(_LAST.match(p.stem))


def step_in_name(path: str) -> int | None:
    """The N of a ``step=N`` part of the file name (Lightning's default names have one)."""
    m = _STEP.search(Path(path).stem)
    return int(m.group(1)) if m else None


def is_weights_only(checkpoint: Mapping[str, Any]) -> bool:
    """Whether `checkpoint` is what Lightning's ``dump_checkpoint(weights_only=True)`` builds:
    its loops' state but none of the optimizer and callback state every full one has."""
    return (
        "loops" in checkpoint
        and "pytorch-lightning_version" in checkpoint
        and "optimizer_states" not in checkpoint
        and "callbacks" not in checkpoint
    )


# -- the plugin ---------------------------------------------------------------------------


@dataclass
class _Store:
    """One store's tiers and this session's saves into it."""

    name: str
    local: str | Tier | None
    remote: str | Tier | None
    storage_options: dict[str, Any]
    keep: tuple[int | RetentionPolicy | None, int | RetentionPolicy | None]  # keep_local, keep_remote
    options: dict[str, Any]  # the rest of Checkpointer's options
    ckpt: Checkpointer | None = None
    handles: dict[int, SaveHandle] = field(default_factory=dict)  # not yet finished on every tier
    doomed: set[int] = field(default_factory=set)  # lost their names while in flight
    saved: set[int] = field(default_factory=set)  # saved by this plugin (every session)
    last_step: int | None = None  # this session's newest save, None after a load
    restored: int | None = None  # the step loaded last: a branch point for the next save

    @property
    def usable(self) -> bool:
        return self.local is not None or self.remote is not None

    def checkpointer(self) -> Checkpointer:
        """This store's `Checkpointer` (global rank 0 only: created at the first save or removal)."""
        if self.ckpt is None:
            keep_local, keep_remote = self.keep
            self.ckpt = Checkpointer(
                self.local,
                self.remote,
                self.storage_options,
                keep_local=keep_local,
                keep_remote=keep_remote,
                rank=0,
                world_size=1,
                **self.options,
            )
        return self.ckpt

    def tiers(self) -> list[Tier]:
        return read_tiers(self.local, self.remote, self.storage_options)

    def where(self) -> str:
        return ", ".join(x if isinstance(x, str) else x.location for x in (self.local, self.remote) if x)

    def durable(self, step: int) -> bool | None:
        """True once `step` is durable on a tier (or was finished before), False while it is
        in flight, None if it failed on every tier."""
        handle = self.handles.get(step)
        if handle is None:
            return True
        if any(handle.done(t) and handle.exception(t) is None for t in handle.tiers):
            return True
        return None if handle.done() else False


def _subdir(tier: str | os.PathLike[str] | Tier | None, name: str) -> str | None:
    """`name` below a tier given as a path or URL (a Tier object has no such child)."""
    if tier is None or isinstance(tier, Tier):
        return None
    return f"{os.fspath(tier).rstrip('/')}/{name}"


class _TiercheckIOImpl:
    """What `TiercheckIO` does; see the module docstring."""

    def __init__(
        self,
        local: str | os.PathLike[str] | Tier | None = None,
        remote: str | Tier | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keep_local: int | RetentionPolicy | None = None,
        keep_remote: int | RetentionPolicy | None = None,
        **options: Any,
    ) -> None:
        if local is None and remote is None:
            raise InvalidArgumentError("TiercheckIO needs at least one tier: local=DIR and/or remote=URL")
        for fixed in ("rank", "world_size", "store", "replicated"):
            if fixed in options:
                raise InvalidArgumentError(
                    f"TiercheckIO sets {fixed}= itself: Lightning saves the whole checkpoint from global rank 0"
                )
        self._local = None if local is None else local if isinstance(local, Tier) else os.path.abspath(local)
        self._remote = remote
        settings = (dict(storage_options or {}), (keep_local, keep_remote), options)
        weights_local, weights_remote = _subdir(self._local, WEIGHTS_ONLY), _subdir(remote, WEIGHTS_ONLY)
        if (weights_local is None) != (self._local is None) or (weights_remote is None) != (remote is None):
            weights_local = weights_remote = None  # a Tier object has no subdirectory: no such store
        self._stores = {
            FULL: _Store(FULL, self._local, remote, *settings),
            WEIGHTS_ONLY: _Store(WEIGHTS_ONLY, weights_local, weights_remote, *settings),
        }
        self._lock = threading.RLock()
        # path -> the refs it was given, oldest first, whose pointer is not written yet: it
        # names the newest of them that is durable, and the last one once that is.
        self._pending: dict[str, list[Ref]] = {}
        self._dirs = PointerDirs(self._local)

    @property
    def checkpointer(self) -> Checkpointer:
        """The `Checkpointer` this plugin saves full checkpoints through (created if needed;
        rank 0 only)."""
        with self._lock:
            return self._stores[FULL].checkpointer()

    # -- CheckpointIO ---------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage `checkpoint` as step ``checkpoint["global_step"]`` and return after the
        host copy; the pointer file at `path` appears once the step is committed."""
        if storage_options is not None:
            raise InvalidArgumentError(
                "TiercheckIO.save_checkpoint does not take storage_options; give "
                "TiercheckIO(storage_options=...) for the remote tier"
            )
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise InvalidArgumentError(f"the checkpoint for {path} has no valid 'global_step' ({step!r})")
        target = os.path.abspath(os.fspath(path))
        store = self._stores[WEIGHTS_ONLY if is_weights_only(checkpoint) else FULL]
        if not store.usable:
            raise InvalidArgumentError(
                f"cannot save the weights-only checkpoint {target}: weights-only checkpoints go to a "
                "'weights-only' subdirectory of the tiers, and TiercheckIO was given Tier objects; give "
                "local= a directory or remote= a URL"
            )
        with self._lock:
            self._flush()
            if step != store.last_step:
                if store.last_step is None and not self._claim(store, step, os.path.dirname(target)):
                    self._name(target, (store.name, step))  # already committed: a new name for it
                    return
                ckpt = store.checkpointer()
                handle = ckpt.save(step, checkpoint)
                store.last_step = step
                store.saved.add(step)
                store.handles[step] = handle
                handle.add_done_callback(lambda h, tier, error: self._on_done(store, h, error))
            # else: another name for the step just saved (last.ckpt after the top-k name)
            self._name(target, (store.name, step))

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict at `path` (see the module docstring for how it resolves).
        `weights_only` is moot: nothing is unpickled, whatever it says.

        Raises:
            NoCheckpointError: `path` resolves to no committed step.
            CheckpointCorruptedError: that step fails verification on every tier.
        """
        target = os.path.abspath(os.fspath(path))
        value, step = self._load(target)
        if is_last(target):
            _name_last_checkpoint(value, target)
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            value = _move(value, torch.device(map_location))
        with self._lock:
            for store in self._stores.values():
                store.restored = step
                store.last_step = None  # the next save checks for a rollback
        return value

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at `path`, and its step from every tier once no pointer
        anywhere names it (after it is durable, if it is still being written)."""
        target = os.path.abspath(os.fspath(path))
        with self._lock:
            self._flush()
            refs = self._pending.pop(target, [])
            try:
                on_disk = read_pointer_doc(target)
            except NoCheckpointError:
                logger.warning("tiercheck: not removing %s: it is not a tiercheck pointer file", target)
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            self._dirs.remember(os.path.dirname(target))  # its other pointers count, as ever
            if on_disk is not None:
                refs.append(on_disk.ref)
            for ref in dict.fromkeys(refs):
                self._release(ref)

    def teardown(self) -> None:
        """Drain: every save durable on every tier (pointers written, removed steps
        deleted), then release the writer threads and host buffers. A later save starts a
        new `Checkpointer`.

        Raises:
            TierError: a background save failed since the last save (raised once).
        """
        errors: list[BaseException] = []
        for store in self._stores.values():
            with self._lock:
                ckpt = store.ckpt
            try:
                if ckpt is not None:
                    ckpt.close()  # runs the last done callbacks, which use store.ckpt
            except BaseException as exc:
                errors.append(exc)
            finally:
                with self._lock:
                    store.ckpt = None
                    store.handles.clear()
                    store.doomed.clear()
                    store.last_step = None
        with self._lock:
            self._pending.clear()
        if errors:
            raise errors[0]

    # -- saving: which steps may be saved ----------------------------------------------------

    def _claim(self, store: _Store, step: int, directory: str) -> bool:
        """The first save of a store in this session (or after a load): True to save `step`.
        False when `step` is committed already and is this plugin's own (saved by it, or the
        step it loaded): a new name for it. Saving an older step after a load of an older
        one starts a new branch (the abandoned steps are deleted first, as
        `Checkpointer.restore` does); anything else is refused (another run's steps)."""
        committed = sorted(list_committed(store.tiers()[:1]))
        newest = committed[-1] if committed else None
        if newest is None or step > newest:
            store.restored = None
            return True
        restored = store.restored
        if step in committed and (step in store.saved or step == restored):
            return False
        if restored is None or step <= restored:
            raise StepConflictError(
                f"cannot save step {step} to {store.where()}: step {newest} is already committed there "
                "(an earlier run's?). Resume with trainer.fit(..., ckpt_path='last'), or use another directory"
            )
        stale = [s for s in store.checkpointer().steps() if s > restored]
        self._dirs.unlink_naming(store.name, stale, directory)
        for s in reversed(stale):
            self._delete((store.name, s))
        store.restored = None
        warnings.warn(
            f"tiercheck: step {step} starts a new branch after loaded step {restored}; deleted the abandoned "
            f"steps {stale}" + ("" if store.name == FULL else f" of the {store.name} store"),
            RuntimeWarning,
            stacklevel=5,
        )
        return True

    # -- pointers -------------------------------------------------------------------------------

    def _name(self, target: str, ref: Ref) -> None:
        """`target` now names `ref`: its pointer is written once the step is durable on a
        tier (now, if it already is); until then it names what it named before."""
        self._dirs.remember(os.path.dirname(target))
        refs = self._pending.setdefault(target, [])
        if ref in refs:
            refs.remove(ref)
        refs.append(ref)
        self._flush_target(target)

    def _flush(self) -> None:
        """Write every pointer whose step is durable now, and retry the deletions a done
        callback could not do: the callback thread may lag behind the training loop (a busy
        machine), and a kill must not find ``last.ckpt`` missing while a step of it is
        committed."""
        for target in list(self._pending):
            self._flush_target(target)
        for store in self._stores.values():
            for step in [s for s in store.doomed if s not in store.handles]:
                store.doomed.discard(step)
                self._release((store.name, step))

    def _flush_target(self, target: str) -> None:
        refs = self._pending.get(target, [])
        states = [self._stores[r[0]].durable(r[1]) for r in refs]
        ready = [i for i, s in enumerate(states) if s]
        failed = [r for r, s in zip(refs, states, strict=True) if s is None]
        if not ready and not failed:
            return
        upto = ready[-1] if ready else -1
        dropped = [r for i, r in enumerate(refs) if i < upto or states[i] is None]
        kept = [r for i, r in enumerate(refs) if i > upto and states[i] is not None]
        if kept:
            self._pending[target] = kept
        else:
            del self._pending[target]
        if ready:
            self._repoint(target, refs[upto])
        for r in dropped:  # superseded by a newer durable step, or failed: no longer named here
            self._release(r)

    def _repoint(self, target: str, ref: Ref) -> None:
        """Write the pointer `target` -> `ref`; release what it named before."""
        try:
            before = read_pointer_doc(target)
        except NoCheckpointError:
            before = None  # another plugin's file at that name: replaced, as Lightning would
        local, remote = self._local, self._remote
        try:
            write_pointer(
                target,
                ref[1],
                ref[0],
                local if isinstance(local, str) else None,
                remote if isinstance(remote, str) else None,
            )
        except OSError as exc:
            logger.error("tiercheck: cannot write the checkpoint pointer %s: %r", target, exc)
            return
        if before is not None and before.ref != ref:
            self._release(before.ref)

    def _named(self, ref: Ref) -> bool:
        if any(ref in refs for refs in self._pending.values()):
            return True
        return self._dirs.names(ref)

    def _release(self, ref: Ref) -> None:
        """`ref` lost a name: delete it from every tier unless a pointer anywhere still names
        it (after it is finished, if it is still being written)."""
        if self._named(ref):
            return
        store = self._stores[ref[0]]
        handle = store.handles.get(ref[1])
        if handle is not None and not handle.done():
            store.doomed.add(ref[1])
            return
        self._delete(ref)

    def _on_done(self, store: _Store, handle: SaveHandle, error: TiercheckError | None) -> None:
        """Done callback (background thread): write the pointers of a step durable now; once
        it is finished everywhere, delete it if it lost its names."""
        with self._lock:
            if store.ckpt is None:
                return
            if handle.done() and store.handles.get(handle.step) is handle:
                self._flush()  # before it leaves `handles`: a failed step is no pointer's
                del store.handles[handle.step]
                if handle.step in store.doomed:
                    store.doomed.discard(handle.step)
                    self._release((store.name, handle.step))
            self._flush()

    def _delete(self, ref: Ref) -> None:
        store = self._stores[ref[0]]
        try:
            store.checkpointer().delete(ref[1])
        except NoCheckpointError:
            pass
        except StepInFlightError:  # finishing on its last tier right now: retried at the next flush
            store.doomed.add(ref[1])
        except ClosedError:  # a done callback of a closing session: the next session's removal deletes it
            logger.warning("tiercheck: step %d lost its last name while closing; it stays on its tiers", ref[1])

    # -- loading ------------------------------------------------------------------------------------

    def _load(self, target: str) -> tuple[dict[str, Any], int]:
        errors: list[NoCheckpointError] = []
        for store, step in self._resolve(target):
            try:
                found = restore_from(self._stores[store].tiers(), None, step, 0, False)
            except NoCheckpointError as exc:
                errors.append(exc)
                continue
            assert found is not None and isinstance(found.value, dict)
            return found.value, found.step
        raise errors[0]

    def _resolve(self, target: str) -> list[Ref]:
        """The refs `target` may name, in the order to try them."""
        if is_last(target):
            with contextlib.suppress(NoCheckpointError):
                doc = read_pointer_doc(target)
                if doc is not None:
                    return [self._newest(target, self._stores[doc.store])]
            return [self._newest(target, self._stores[FULL])]
        with self._lock:
            self._flush()
            refs = list(self._pending.get(target, []))
            handle = self._stores[refs[-1][0]].handles.get(refs[-1][1]) if refs else None
        if refs:
            if handle is not None:
                handle.exception()  # wait until it is finished on every tier
            return [refs[-1]]
        doc = read_pointer_doc(target)
        if doc is not None:
            return [doc.ref]
        step = step_in_name(target)
        if step is None:
            raise NoCheckpointError(
                f"{target}: no pointer file there and no step=N in its name; pass a path ModelCheckpoint "
                f"wrote, or 'last' ({self._stores[FULL].where()})"
            )
        return [(s.name, step) for s in self._stores.values() if s.usable]

    def _newest(self, target: str, store: _Store) -> Ref:
        with self._lock:
            ckpt = store.ckpt
        if ckpt is not None:
            ckpt.wait()  # this session's own saves count
        committed = list_committed(store.tiers()) if store.usable else {}
        if not committed:
            raise NoCheckpointError(f"{target}: no committed checkpoint in {store.where()}")
        return (store.name, max(committed))


def _name_last_checkpoint(checkpoint: dict[str, Any], path: str) -> None:
    """A step saved as ``epoch=..-step=N.ckpt`` and then as ``last.ckpt`` is stored once,
    with the first dict, whose ModelCheckpoint state may not yet name ``last.ckpt`` as its
    last checkpoint (Lightning sets it just before saving the second name): loaded through
    a last path, make it say so, as Lightning's own ``last.ckpt`` would."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return
    directory = os.path.dirname(path)
    for state in callbacks.values():
        if (
            isinstance(state, dict)
            and "last_model_path" in state
            and isinstance(state.get("dirpath"), str)
            and os.path.abspath(state["dirpath"]) == directory
        ):
            state["last_model_path"] = path


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_move(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_move(v, device) for v in value)
    return value


def _lightning_package(cls: type) -> str:
    """``pytorch_lightning`` or ``lightning.pytorch``: whichever `cls` derives from."""
    for package in ("pytorch_lightning", "lightning.pytorch"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(package)
            if issubclass(cls, (module.LightningModule, module.LightningDataModule)):
                return package
    raise InvalidArgumentError(f"{cls!r} is not a LightningModule or LightningDataModule")


def load_from_checkpoint(
    cls: type,
    checkpoint_path: str | os.PathLike[str],
    io: _TiercheckIOImpl | None = None,
    *,
    map_location: Any | None = None,
    strict: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, ...)`` for a path TiercheckIO wrote.

    Lightning's classmethod opens the file with ``torch.load`` and never calls the
    ``CheckpointIO`` plugin, so it cannot read a pointer; this reads the checkpoint through
    tiercheck (`io`, or the tiers the pointer was written for, a new node's pointer-less
    path needing `io`) and then does what Lightning's does with it: version migration,
    ``hyper_parameters`` (updated with `kwargs`) passed to ``cls``, ``on_load_checkpoint``,
    ``load_state_dict(strict=strict)``, and the model moved to the checkpoint's device.

    Example:
        >>> model = load_from_checkpoint(Net, checkpoint_callback.best_model_path)  # doctest: +SKIP

    Raises:
        NoCheckpointError: the path resolves to no committed step.
        CheckpointCorruptedError: that step fails verification on every tier.
    """
    path = os.path.abspath(os.fspath(checkpoint_path))
    if io is None:
        doc = read_pointer_doc(path)
        if doc is None or (doc.local is None and doc.remote is None):
            raise NoCheckpointError(
                f"{path}: no tiercheck pointer there that says where its tiers are; pass "
                "io=TiercheckIO(local=..., remote=...)"
            )
        io = TiercheckIO(local=doc.local, remote=doc.remote)
    package = _lightning_package(cls)
    saving = importlib.import_module(f"{package}.core.saving")
    migration = importlib.import_module(f"{package}.utilities.migration.utils")
    checkpoint = migration._pl_migrate_checkpoint(io.load_checkpoint(path, map_location), checkpoint_path=path)
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})  # type: ignore[attr-defined]
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)  # type: ignore[attr-defined]
    module = importlib.import_module(package)
    if issubclass(cls, module.LightningDataModule):
        return saving._load_state(cls, checkpoint, **kwargs)
    model = saving._load_state(cls, checkpoint, strict=strict, **kwargs)
    state_dict = checkpoint["state_dict"]
    device = next((t for t in state_dict.values() if isinstance(t, torch.Tensor)), torch.tensor(0)).device
    return model.to(device)


class TiercheckIO(_TiercheckIOImpl, *_checkpoint_io_bases()):  # type: ignore[misc]
    """A Lightning ``CheckpointIO`` plugin: asynchronous, tiered checkpoints.

    Args:
        local, remote, storage_options: the tiers, as for `tiercheck.Checkpointer`.
        keep_local, keep_remote: tiercheck's own retention per tier; None (the default)
            keeps every step, since ModelCheckpoint decides what to keep and calls
            ``remove_checkpoint`` (``save_top_k``).
        **options: any other `Checkpointer` option (``host_buffers=2``, ``remote_compression``,
            ...), except ``rank``/``world_size``/``store``/``replicated``.

    Example:
        >>> io = TiercheckIO(local="ckpt", remote="s3://bucket/run7")             # doctest: +SKIP
        >>> trainer = pl.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt",
        ...                      every_n_train_steps=500, save_last=True)])       # doctest: +SKIP
        >>> trainer.fit(model, datamodule=dm, ckpt_path="last")                   # doctest: +SKIP
    """
