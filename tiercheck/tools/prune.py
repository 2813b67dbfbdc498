"""`tiercheck prune` and `tiercheck rm`: delete committed steps by hand, as safely as retention.

The plan is retention's own (`retention.plan_deletions`: never the newest committed step,
never a step not yet committed on the next tier when one is named), and each step goes
through the tier's own `delete_step` (the marker disappears first, so a crash midway
leaves the step invisible, never half-listed).

Writers: a `Checkpointer` writing to a local directory holds an exclusive `flock` on a
lock file in it, ``.tiercheck-lock-rank-<r>`` (one per rank sharing the directory). Before
deleting anything these tools take every ``.tiercheck-lock-*`` file of the directory with
``LOCK_EX | LOCK_NB`` and hold them until done: a held lock means a writer is running, and
the tool refuses (`WriterActiveError`); a writer starting meanwhile waits or fails to lock.
Object stores have no locks: there these tools cannot tell whether a writer is running.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import NoCheckpointError, WriterActiveError
from ..retention import KeepEvery, KeepLast, RetentionPolicy, plan_deletions
from ..tiers.base import Tier
from ..tiers.local import LocalTier
from .view import tier_at

__all__ = ["LOCK_PREFIX", "PruneResult", "prune_steps", "remove_step", "writers_excluded"]

LOCK_PREFIX = ".tiercheck-lock-"


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What `prune_steps` / `remove_step` did (or, with `dry_run`, would do).

    Attributes:
        deleted: steps deleted (or to delete), ascending.
        kept: committed steps left in place, ascending.
        writer_check: ``"free"`` (lock files found, none held), ``"no lock files"``, or
            ``"impossible"`` (an object store: no locks to check).
    """

    location: str
    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    dry_run: bool
    writer_check: str


@contextlib.contextmanager
def writers_excluded(tier: Tier) -> Iterator[str]:
    """Hold every writer lock of `tier`'s directory for the duration of the block.

    Yields the `PruneResult.writer_check` value.

    Raises:
        WriterActiveError: a writer holds one of the locks.
    """
    if not isinstance(tier, LocalTier):
        yield "impossible"
        return
    fds: list[int] = []
    try:
        try:
            names = sorted(n for n in os.listdir(tier.root) if n.startswith(LOCK_PREFIX))
        except FileNotFoundError:
            names = []
        for name in names:
            path = os.path.join(tier.root, name)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            except FileNotFoundError:  # its writer removed it while closing
                continue
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise WriterActiveError(
                    f"{path}: a writer holds this lock (a Checkpointer is open on {tier.root}); "
                    "close it, or let its own retention (keep_local=...) prune"
                ) from None
        yield "free" if names else "no lock files"
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock


def prune_steps(
    location: str | os.PathLike[str],
    keep_last: int,
    keep_every: int | None = None,
    *,
    next_tier: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> PruneResult:
    """Delete the committed steps that ``KeepLast(keep_last) | KeepEvery(keep_every)`` does
    not keep, never the newest one.

    Args:
        location: the tier root (directory or fsspec URL).
        keep_last: keep this many newest steps (at least 1).
        keep_every: also keep every step that is a multiple of this.
        next_tier: the tier this one uploads to: steps not committed there yet are kept
            (what retention does on tier 1).
        dry_run: only report what would be deleted.
        storage_options: fsspec options for URLs.

    Raises:
        WriterActiveError: a Checkpointer holds the directory.
        ValueError: `keep_last` < 1 or `keep_every` < 1.
    """
    policy: RetentionPolicy = KeepLast(keep_last)
    if keep_every is not None:
        policy = policy | KeepEvery(keep_every)
    tier = tier_at(location, storage_options)
    with writers_excluded(tier) as check:
        committed = tier.committed_steps()
        pending: list[int] = []
        if next_tier is not None:
            there = set(tier_at(next_tier, storage_options).committed_steps())
            pending = [s for s in committed if s not in there]
        doomed = plan_deletions(committed, policy, not_yet_on_next_tier=pending)
        return _execute(tier, committed, doomed, dry_run, check)


def remove_step(
    location: str | os.PathLike[str],
    step: int,
    *,
    allow_newest: bool = False,
    dry_run: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> PruneResult:
    """Delete one committed step.

    Raises:
        NoCheckpointError: `step` is not committed at `location`.
        ValueError: `step` is the newest committed step and `allow_newest` is False.
        WriterActiveError: a Checkpointer holds the directory.
    """
    tier = tier_at(location, storage_options)
    with writers_excluded(tier) as check:
        committed = tier.committed_steps()
        if step not in committed:
            raise NoCheckpointError(f"step {step} is not committed at {tier.location}; committed: {committed}")
        if step == committed[-1] and not allow_newest:
            raise ValueError(
                f"step {step} is the newest committed step at {tier.location}: restore would fall back to "
                f"{committed[-2] if len(committed) > 1 else 'nothing'}; "
                "to delete it anyway: --allow-newest (allow_newest=True)"
            )
        return _execute(tier, committed, [step], dry_run, check)


def _execute(tier: Tier, committed: list[int], doomed: list[int], dry_run: bool, check: str) -> PruneResult:
    if not dry_run:
        for s in doomed:
            tier.delete_step(s)
    kept = tuple(s for s in committed if s not in set(doomed))
    return PruneResult(tier.location, tuple(doomed), kept, dry_run, check)
