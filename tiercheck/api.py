"""`tiercheck.load`: read a checkpoint without a template."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import NoCheckpointError
from .progress import ProgressCallback
from .restore import restore_from
from .tiers.base import Tier
from .tiers.local import LocalTier
from .tiers.remote import RemoteTier


def load(
    location: str | os.PathLike[str],
    step: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    rank: int = 0,
    *,
    progress: ProgressCallback | None = None,
) -> dict[Any, Any]:
    """Read one rank's view of a checkpoint as plain values, without a template.

    Tensors come back as CPU tensors, numpy arrays as numpy arrays, objects that were
    saved through `state_dict()` as their state dicts.

    Args:
        location: a tier root: a local directory or an fsspec URL.
        step: the step to read; the newest committed one if None.
        storage_options: fsspec options for a URL (unused for directories).
        rank: which rank's part to read.
        progress: called as ``progress(done_bytes, total_bytes)`` while the step's bytes
            are read (`tiercheck.progress`); ``tiercheck.progress.terminal_bar`` draws a bar.

    Raises:
        NoCheckpointError: nothing committed at `location` (or not `step`).
        CheckpointCorruptedError: the step fails verification.

    Example:
        >>> sd = tiercheck.load("ckpt/run7")          # doctest: +SKIP
        >>> model.load_state_dict(sd["model"])        # doctest: +SKIP
    """
    loc = os.fspath(location)
    tier: Tier = LocalTier(loc) if "://" not in loc else RemoteTier(loc, storage_options)
    found = restore_from([tier], None, step, rank, strict=False, progress=progress)
    if found is None:
        raise NoCheckpointError(f"no committed checkpoint at {loc}")
    result = found.value
    assert isinstance(result, dict)
    return result


def read_tiers(
    local: str | os.PathLike[str] | None, remote: str | None, storage_options: Mapping[str, Any] | None = None
) -> list[Tier]:
    """Tiers to read from (fastest first), as a `Checkpointer` with these options has them,
    without starting anything: for readers on ranks or processes that never save."""
    tiers: list[Tier] = []
    if local is not None:
        tiers.append(LocalTier(local))
    if remote is not None:
        tiers.append(RemoteTier(remote, storage_options))
    return tiers
