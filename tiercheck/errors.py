"""The error types tiercheck raises. Callers match types, never message text."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tiers.base import Tier

__all__ = [
    "CheckpointCorruptedError",
    "ClosedError",
    "CoordinationError",
    "DirectoryInUseError",
    "InvalidArgumentError",
    "NoCheckpointError",
    "SnapshotChangedError",
    "StateMismatchError",
    "StepConflictError",
    "StepInFlightError",
    "StepPrunedError",
    "TierError",
    "TiercheckError",
    "UnsupportedStateError",
    "UploadSkippedError",
    "tier_error",
]


class TiercheckError(Exception):
    """Base of every error tiercheck raises."""


class InvalidArgumentError(TiercheckError, ValueError, TypeError):
    """An argument or option is invalid: a wrong value or a value of the wrong type (an
    unknown tier name, a negative step, a template that is not a mapping, a bad retention
    policy); the message names it. Also a `ValueError` and a `TypeError`, so code written
    against the builtins keeps working."""


class ClosedError(TiercheckError, RuntimeError):
    """The Checkpointer was closed, or this process inherited it through `fork()` and may
    not use it (its background threads live in the parent): create a new one."""


class NoCheckpointError(TiercheckError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists on any tier."""


class StepPrunedError(NoCheckpointError):
    """A committed step was deleted while it was being read (a running job's retention,
    `tiercheck prune` or `rm`): its read failed because the step is gone, not damaged.

    Attributes:
        step: that step.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class CheckpointCorruptedError(TiercheckError, ValueError):
    """A checkpoint's bytes or metadata failed verification (size, checksum, schema)."""


class UnsupportedStateError(TiercheckError, TypeError):
    """`save()` was given a value tiercheck cannot store; the message names the key path."""


class StateMismatchError(TiercheckError, ValueError):
    """The restore template does not match the checkpoint (shape, dtype, structure, key)."""


class SnapshotChangedError(TiercheckError, RuntimeError):
    """A tensor copied after `save(overlap=True)` returned was changed in place before its
    copy finished (its version counter moved), so the step would mix states; that step
    fails, raised once as a `TierError` caused by this error."""


class StepConflictError(TiercheckError, FileExistsError):
    """`save()` was asked for a step that is not newer than existing or pending steps."""


class StepInFlightError(TiercheckError, RuntimeError):
    """`Checkpointer.delete(step)` was asked for a step still being written or uploaded.

    Attributes:
        step: that step; wait for its handle, then delete it.
    """

    def __init__(self, message: str, *, step: int) -> None:
        super().__init__(message)
        self.step = step


class CoordinationError(TiercheckError, TimeoutError):
    """The ranks of a job could not agree: another rank did not answer within
    `coordination_timeout`, or reported a failure (the message names the rank).

    Attributes:
        settled: True when rank 0 decided the step failed; False for a timeout, after which
            rank 0 may still commit the step.
    """

    def __init__(self, message: str, *, settled: bool = False) -> None:
        super().__init__(message)
        self.settled = settled


class DirectoryInUseError(TiercheckError, BlockingIOError):
    """Another live Checkpointer (in this process or another) is already the writer of this
    rank's part of a tier-1 directory; the message names the directory and that process.

    A Checkpointer becomes a writer at its first `save()` or `prepare()`; one that only
    restores never takes the lock, so an evaluation script may read a directory a job is
    writing. The lock is an OS file lock, released when its holder closes or dies.
    """


class UploadSkippedError(TiercheckError):
    """Raised by `SaveHandle.wait("remote")` for a step that will never reach tier 2: uploads
    were behind and newer steps superseded it (tier-2 retention would delete it anyway), or
    it failed on tier 1 first."""


class TierError(TiercheckError, OSError):
    """A tier failed in the background (disk full, permission, store down).

    Attributes:
        step: the step being written, or None for a tier-wide failure.
        tier: ``"local"`` or ``"remote"``.
        path: the file or directory involved.
    """

    def __init__(self, message: str, *, step: int | None, tier: str, path: str) -> None:
        super().__init__(message)
        self.step = step
        self.tier = tier
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:  # pragma: no cover - pickling support for logs
        return (_rebuild_tier_error, (str(self), self.step, self.tier, self.path))


def _rebuild_tier_error(message: str, step: int | None, tier: str, path: str) -> TierError:
    return TierError(message, step=step, tier=tier, path=path)


def tier_error(exc: BaseException, step: int | None, tier: Tier, doing: str) -> TierError:
    """A `TierError` for `exc`, raised by `tier` while `doing` `step`: names step, tier and path."""
    path = getattr(exc, "filename", None) or (tier.path_of(step) if step is not None else tier.location)
    what = f"step {step}" if step is not None else "a step"
    err = TierError(
        f"tier {tier.name!r} failed {doing} {what} at {path}: {type(exc).__name__}: {exc}. "
        "Earlier committed steps are intact.",
        step=step,
        tier=tier.name,
        path=str(path),
    )
    err.__cause__ = exc
    return err
