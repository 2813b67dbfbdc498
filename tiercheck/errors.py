"""The error types tiercheck raises. Callers match types, never message text."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptedError",
    "CoordinationError",
    "NoCheckpointError",
    "SnapshotChangedError",
    "StateMismatchError",
    "StepConflictError",
    "StepInFlightError",
    "TierError",
    "TiercheckError",
    "UnsupportedStateError",
    "UploadSkippedError",
]


class TiercheckError(Exception):
    """Base of every error tiercheck raises."""


class NoCheckpointError(TiercheckError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists on any tier."""


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


class UploadSkippedError(TiercheckError):
    """Raised by `SaveHandle.wait("remote")` for a step that will never reach tier 2: a newer
    step superseded it while uploads were behind, or it failed on tier 1 first."""


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
