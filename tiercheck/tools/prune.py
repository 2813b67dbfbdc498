"""`tiercheck prune` and `tiercheck rm`: delete committed steps by hand, as safely as retention.

The plan is retention's own (`retention.plan_deletions`: never the newest committed step,
never a step not yet committed on the next tier when one is named), and each step goes
through the tier's own `delete_step` (the marker disappears first, so a crash midway
leaves the step invisible, never half-listed).

Writers: a `Checkpointer` writing to a local directory holds an exclusive `flock` on
``.tiercheck-lock-rank-<r>`` there (`LocalTier.claim_writer`, one file per rank). These tools
take every such lock of the directory, and rank 0's (creating its file if no writer ever ran
there), with ``LOCK_EX | LOCK_NB``, and hold them until done: a held lock means a writer is
running, and the tool refuses (`DirectoryInUseError`, naming the lock and its holder); a
Checkpointer starting meanwhile gets that same error. Object stores have no locks: there
these tools cannot tell whether a writer is running.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import DirectoryInUseError, NoCheckpointError
from ..format import naming
from ..plan.retention import KeepEvery, KeepLast, RetentionPolicy, plan_deletions
from ..tiers.base import Tier
from ..tiers.local import LocalTier
from ..tiers.lock import linked_lock_hint
from .view import tier_at

__all__ = ["PruneResult", "prune_steps", "remove_step", "writers_excluded"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What `prune_steps` / `remove_step` did (or, with `dry_run`, would do).

    Attributes:
        deleted: steps deleted (or to delete), ascending.
        kept: committed steps left in place, ascending.
        writer_check: ``"locked"`` (this tool held every writer lock of the directory
            while it deleted), or ``"impossible"`` (an object store: no locks to check).
    """

    location: str
    deleted: tuple[int, ...]
    kept: tuple[int, ...]
    dry_run: bool
    writer_check: str


@contextlib.contextmanager
def writers_excluded(tier: Tier, create: bool = True) -> Iterator[str]:
    """Hold every writer lock of `tier`'s directory for the duration of the block, and rank
    0's, its file created if missing and `create` is set (a dry run creates nothing).

    Yields the `PruneResult.writer_check` value.

    Raises:
        DirectoryInUseError: a writer holds one of the locks.
    """
    if not isinstance(tier, LocalTier):
        yield "impossible"
        return
    try:
        names = sorted(n for n in os.listdir(tier.root) if n.startswith(naming.LOCK_PREFIX))
    except FileNotFoundError:
        names = []
    else:
        if create:  # rank 0's too, so that no writer starts on a directory none has locked yet
            names = sorted({*names, naming.lock_name(0)})
    fds: list[int] = []
    try:
        for name in names:
            path = os.path.join(tier.root, name)
            try:
                fd = os.open(path, os.O_RDONLY | (os.O_CREAT if create else 0) | _O_CLOEXEC | _O_NOFOLLOW, 0o644)
            except FileNotFoundError:  # its writer's directory is being removed
                continue
            except OSError as exc:  # a read-only directory: its deletions would fail as well
                if name == naming.lock_name(0) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                    continue
                raise
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise DirectoryInUseError(
                    f"{tier.root} is being written by {_holder(path)} (it holds the lock {path}); "
                    "close that Checkpointer first, or let its own retention (keep_local=...) prune"
                    f"{linked_lock_hint(path)}"
                ) from None
        yield "locked"
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock


def _holder(path: str) -> str:
    """Who holds a writer lock, as its holder wrote it into the file."""
    try:
        with open(path, "rb") as f:
            text = f.read(200).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "another process"


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
        DirectoryInUseError: a Checkpointer holds the directory.
        ValueError: `keep_last` < 1 or `keep_every` < 1.
    """
    policy: RetentionPolicy = KeepLast(keep_last)
    if keep_every is not None:
        policy = policy | KeepEvery(keep_every)
    tier = tier_at(location, storage_options)
    with writers_excluded(tier, create=not dry_run) as check:
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
        DirectoryInUseError: a Checkpointer holds the directory.
    """
    tier = tier_at(location, storage_options)
    with writers_excluded(tier, create=not dry_run) as check:
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
