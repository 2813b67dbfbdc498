"""`tiercheck.load`: read a checkpoint without a template."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .errors import NoCheckpointError
from .observe.progress import ProgressCallback
from .steps.restore import restore_from
from .tiers.base import Tier
from .tiers.open import open_tier


def load(
    location: str | os.PathLike[str] | Tier,
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
        location: a tier root: a local directory or an fsspec URL; or a `Tier`, read as it
            is (then without `storage_options`).
        step: the step to read; the newest committed one if None.
        storage_options: fsspec options for a URL (unused for directories).
        rank: which rank's part to read.
        progress: called as ``progress(done_bytes, total_bytes)`` while the step's bytes
            are read (`tiercheck.observe.progress`); ``tiercheck.observe.progress.terminal_bar`` draws a bar.

    Raises:
        NoCheckpointError: nothing committed at `location` (or not `step`).
        CheckpointCorruptedError: the step fails verification.
        InvalidArgumentError: a `Tier` given together with `storage_options`.

    Example:
        >>> sd = tiercheck.load("ckpt/run7")          # doctest: +SKIP
        >>> model.load_state_dict(sd["model"])        # doctest: +SKIP
    """
    tier = open_tier(location, storage_options=storage_options)
    found = restore_from([tier], None, step, rank, strict=False, progress=progress)
    if found is None:
        raise NoCheckpointError(f"no committed checkpoint at {tier.location}")
    result = found.value
    assert isinstance(result, dict)
    return result


def read_tiers(
    local: str | os.PathLike[str] | Tier | None,
    remote: str | os.PathLike[str] | Tier | None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Tier]:
    """Tiers to read from (fastest first), as a `Checkpointer` with these options has them,
    without starting anything: for readers on ranks or processes that never save."""
    tiers: list[Tier] = []
    if local is not None:
        tiers.append(open_tier(local, role="local"))
    if remote is not None:
        options = None if isinstance(remote, Tier) else storage_options
        tiers.append(open_tier(remote, role="remote", storage_options=options))
    return tiers
