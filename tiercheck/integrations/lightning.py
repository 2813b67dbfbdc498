"""Lightning: `TiercheckIO`, a ``CheckpointIO`` plugin that checkpoints through tiercheck.

The user's code is Lightning's usual idiom::

    io = TiercheckIO(local="ckpt", remote="s3://bucket/run7", storage_options=...)
    trainer = pl.Trainer(plugins=[io], callbacks=[ModelCheckpoint(dirpath="ckpt",
                         every_n_train_steps=5, save_top_k=-1, save_last=True)], max_steps=40)
    trainer.fit(model, datamodule=dm, ckpt_path="last")   # resumes after a crash

How Lightning's paths map to tiercheck steps:

* each ``save_checkpoint(checkpoint, path)`` is tiercheck step ``checkpoint["global_step"]``;
  a second name saved at the same step (``last.ckpt`` right after ``epoch=0-step=5.ckpt``)
  is the same step, not written again;
* the file at `path` is a *pointer*: a few bytes of JSON naming the step, written
  (atomically: temporary name, fsync, rename) only once the step is committed on its first
  tier, so a crash never leaves a path that names an uncommitted step. Lightning's own
  bookkeeping (``ckpt_path="last"`` lists the directory, the version counter checks for
  existing names) sees these files;
* ``load_checkpoint(path)`` reads: for a ``last*.ckpt`` name, the newest committed step
  (on any tier); else the step the pointer names; without a pointer (a new node that has
  only tier 2), the step in a ``step=N`` part of the name. A path that resolves to no
  committed step raises `NoCheckpointError` (a `FileNotFoundError`);
* ``remove_checkpoint(path)`` removes the pointer, and the step on every tier (marker
  first) once no other pointer names it; a step still being written is deleted as soon as
  it is durable.

Only global rank 0 saves and removes (as Lightning's DDP strategies call the plugin);
every rank may load. The checkpoint dict is stored as it is (tensors, numpy, and plain
dict/list/tuple/str/int/float/bool/None/bytes values), never pickled: a value of another
type (an ``argparse.Namespace`` or a ``pathlib.Path`` among the hyperparameters) is
refused at save with `UnsupportedStateError` naming its key path. Loading returns plain
dicts (``OrderedDict`` and ``AttributeDict`` come back as ``dict``) and CPU tensors (or
moved as `map_location` says); Lightning's loading accepts both.

Works with ``pytorch_lightning`` and ``lightning.pytorch``: the plugin is an instance of
the ``CheckpointIO`` class of each one installed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..api import read_tiers
from ..catalog import list_committed
from ..checkpointer import Checkpointer
from ..errors import InvalidArgumentError, NoCheckpointError, StepConflictError, StepInFlightError, TiercheckError
from ..handle import SaveHandle
from ..restore import restore_from
from ..retention import RetentionPolicy
from ..tiers.base import Tier
from ..tiers.local import fsync_dir

__all__ = ["POINTER_FORMAT", "TiercheckIO", "read_pointer"]

logger = logging.getLogger("tiercheck")

POINTER_FORMAT = "tiercheck-lightning-pointer"
_POINTER_MAX = 4096
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


def read_pointer(path: str) -> int | None:
    """The step the pointer file at `path` names; None if there is no file there.

    Raises:
        NoCheckpointError: the file is not a tiercheck pointer (e.g. a ``torch.save`` file,
            which tiercheck never unpickles).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(_POINTER_MAX + 1)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise NoCheckpointError(f"{path} is a directory, not a tiercheck pointer file") from None
    try:
        doc = json.loads(data.decode()) if len(data) <= _POINTER_MAX else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT or type(doc.get("step")) is not int:
        raise NoCheckpointError(
            f"{path} is not a tiercheck pointer file (a checkpoint saved by another CheckpointIO?); "
            "tiercheck reads only checkpoints it wrote and never unpickles"
        )
    step: int = doc["step"]
    return step


def write_pointer(path: str, step: int) -> None:
    """Write the pointer file `path` -> `step` atomically and durably."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tiercheck-tmp-{secrets.token_hex(8)}")
    body = json.dumps({"format": POINTER_FORMAT, "version": 1, "step": step}).encode() + b"\n"
    try:
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def pointers_in(directory: str) -> dict[str, int]:
    """Every pointer file (``*.ckpt``) in `directory` and the step it names."""
    found: dict[str, int] = {}
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return found
    for name in names:
        if not name.endswith(".ckpt"):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(NoCheckpointError, OSError):
            step = read_pointer(path)
            if step is not None:
                found[path] = step
    return found


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
        self._local = None if local is None else local if isinstance(local, Tier) else os.fspath(local)
        self._remote = remote
        self._storage_options = dict(storage_options or {})
        self._keep = (keep_local, keep_remote)
        self._options = options
        self._ckpt: Checkpointer | None = None
        self._lock = threading.RLock()
        self._pending: dict[str, int] = {}  # path -> step: pointer written once the step is durable
        self._handles: dict[int, SaveHandle] = {}  # this session's steps not yet finished on every tier
        self._doomed: dict[int, str] = {}  # step -> its directory: lost its names while in flight
        self._dirs: dict[int, str] = {}  # step -> the directory of its pointers (this session)
        self._last_step: int | None = None
        self._restored: int | None = None  # the step the last load returned: a branch point

    # -- the Checkpointer (global rank 0 only: created at the first save or removal) ------

    def _checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            keep_local, keep_remote = self._keep
            self._ckpt = Checkpointer(
                self._local,
                self._remote,
                self._storage_options,
                keep_local=keep_local,
                keep_remote=keep_remote,
                rank=0,
                world_size=1,
                **self._options,
            )
        return self._ckpt

    @property
    def checkpointer(self) -> Checkpointer:
        """The `Checkpointer` this plugin saves through (created if needed; rank 0 only)."""
        with self._lock:
            return self._checkpointer()

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
        with self._lock:
            ckpt = self._checkpointer()
            if step != self._last_step:
                if self._last_step is None:  # first save of this session, or after a load
                    self._start_branch(ckpt, step, os.path.dirname(target))
                handle = ckpt.save(step, checkpoint)
                self._last_step = step
                self._handles[step] = handle
                self._dirs[step] = os.path.dirname(target)
                handle.add_done_callback(self._on_done)
            # else: another name for the step just saved (last.ckpt after the top-k name)
            self._name(target, step)

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
        step = self._resolve(target)
        found = restore_from(read_tiers(self._local, self._remote, self._storage_options), None, step, 0, False)
        assert found is not None
        value = found.value
        assert isinstance(value, dict)
        if is_last(target):
            _name_last_checkpoint(value, target)
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            device = torch.device(map_location)
            value = _move(value, device)
        with self._lock:
            self._restored = found.step
            self._last_step = None  # the next save checks for a rollback
        return value

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at `path`, and its step from every tier once no other pointer
        names it (after it is durable, if it is still being written)."""
        target = os.path.abspath(os.fspath(path))
        with self._lock:
            step = self._pending.pop(target, None)
            try:
                on_disk = read_pointer(target)
            except NoCheckpointError:
                logger.warning("tiercheck: not removing %s: it is not a tiercheck pointer file", target)
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            self._checkpointer()  # global rank 0 (the only caller): deleting may need it
            for s in {step, on_disk} - {None}:
                assert s is not None
                self._release(s, os.path.dirname(target))

    def teardown(self) -> None:
        """Drain: every save durable on every tier (pointers written, removed steps
        deleted), then release the writer threads and host buffers. A later save starts a
        new `Checkpointer`.

        Raises:
            TierError: a background save failed since the last save (raised once).
        """
        with self._lock:
            ckpt = self._ckpt
        try:
            if ckpt is not None:
                ckpt.close()  # runs the last done callbacks, which use self._ckpt
        finally:
            with self._lock:
                self._ckpt = None
                self._handles.clear()
                self._pending.clear()
                self._doomed.clear()
                self._dirs.clear()
                self._last_step = None

    # -- helpers ----------------------------------------------------------------------------

    def _name(self, target: str, step: int) -> None:
        """`target` now names `step`: its pointer is written once the step is durable on a
        tier (now, if it already is); the step it named before loses that name."""
        previous = self._pending.pop(target, None)
        handle = self._handles.get(step)
        if handle is None or self._durable_somewhere(handle):
            self._repoint(target, step)
        elif not handle.done():
            self._pending[target] = step  # `_on_done` writes it
        # else: the step failed on every tier; the name keeps what it named before
        if previous is not None and previous != step:
            self._release(previous, os.path.dirname(target))

    @staticmethod
    def _durable_somewhere(handle: SaveHandle) -> bool:
        return any(handle.done(t) and handle.exception(t) is None for t in handle.tiers)

    def _repoint(self, target: str, step: int) -> None:
        """Write the pointer `target` -> `step`; release the step it named before."""
        try:
            before = read_pointer(target)
        except NoCheckpointError:
            before = None  # another plugin's file at that name: replaced, as Lightning would
        try:
            write_pointer(target, step)
        except OSError as exc:
            logger.error("tiercheck: cannot write the checkpoint pointer %s: %r", target, exc)
            return
        if before is not None and before != step:
            self._release(before, os.path.dirname(target))

    def _release(self, step: int, directory: str) -> None:
        """`step` lost a name: delete it from every tier unless a name still points at it
        (after it is finished, if it is still being written)."""
        if step in self._pending.values() or step in pointers_in(directory).values():
            return
        handle = self._handles.get(step)
        if handle is not None and not handle.done():
            self._doomed[step] = directory
            return
        self._delete(step)

    def _on_done(self, handle: SaveHandle, tier: str, error: TiercheckError | None) -> None:
        """Done callback (background thread): write the pointers of a step on its first
        durable tier; once it is finished everywhere, delete it if it lost its names."""
        with self._lock:
            if self._ckpt is None:
                return
            if error is None:
                for target, step in list(self._pending.items()):
                    if step == handle.step:
                        del self._pending[target]
                        self._repoint(target, step)
            if not handle.done():
                return
            if self._handles.get(handle.step) is handle:
                del self._handles[handle.step]
                self._dirs.pop(handle.step, None)
            for target, step in list(self._pending.items()):  # failed on every tier: no pointer
                if step == handle.step:
                    del self._pending[target]
            directory = self._doomed.pop(handle.step, None)
            if directory is not None:
                self._release(handle.step, directory)

    def _delete(self, step: int) -> None:
        ckpt = self._ckpt
        if ckpt is None:
            return
        try:
            ckpt.delete(step)
        except NoCheckpointError:
            pass
        except StepInFlightError:  # finishing on its last tier right now
            self._doomed[step] = self._dirs.get(step, "")

    def _resolve(self, target: str) -> int:
        if is_last(target):
            with self._lock:
                ckpt = self._ckpt
            if ckpt is not None:
                ckpt.wait()  # this session's own saves count
            committed = list_committed(read_tiers(self._local, self._remote, self._storage_options))
            if not committed:
                raise NoCheckpointError(f"{target}: no committed checkpoint in {self._where()}")
            return max(committed)
        with self._lock:
            pending = self._pending.get(target)
            handle = None if pending is None else self._handles.get(pending)
        if pending is not None:
            if handle is not None:
                handle.exception()  # wait until it is finished on every tier
            return pending
        step = read_pointer(target)
        if step is None:
            step = step_in_name(target)
        if step is None:
            raise NoCheckpointError(
                f"{target}: no pointer file there and no step=N in its name; pass a path ModelCheckpoint "
                f"wrote, or 'last' ({self._where()})"
            )
        return step

    def _start_branch(self, ckpt: Checkpointer, step: int, directory: str) -> None:
        """Saving `step` when steps at or after it are committed: after a load of an older
        step (a rollback), delete the abandoned ones first, as `Checkpointer.restore` does;
        otherwise refuse (the directory holds another run's steps)."""
        newest = ckpt.latest_step("local" if self._local is not None else "remote")
        if newest is None or step > newest:
            self._restored = None
            return
        restored = self._restored
        if restored is None or step <= restored:
            raise StepConflictError(
                f"cannot save step {step} to {self._where()}: step {newest} is already committed there "
                "(an earlier run's?). Resume with trainer.fit(..., ckpt_path='last'), or use another directory"
            )
        stale = [s for s in ckpt.steps() if s > restored]
        for path, s in pointers_in(directory).items():
            if s in stale:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        for s in reversed(stale):
            self._delete(s)
        self._restored = None
        warnings.warn(
            f"tiercheck: step {step} starts a new branch after loaded step {restored}; deleted the abandoned "
            f"steps {stale}",
            RuntimeWarning,
            stacklevel=4,
        )

    def _where(self) -> str:
        return ", ".join(x if isinstance(x, str) else x.location for x in (self._local, self._remote) if x)


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
