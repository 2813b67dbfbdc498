"""tiercheck: asynchronous, tiered checkpointing for PyTorch training."""

from __future__ import annotations

from .api import load
from .checkpointer import Checkpointer
from .errors import (
    CheckpointCorruptedError,
    ClosedError,
    CoordinationError,
    DirectoryInUseError,
    InvalidArgumentError,
    NoCheckpointError,
    SnapshotChangedError,
    StateMismatchError,
    StepConflictError,
    StepInFlightError,
    StepPrunedError,
    TiercheckError,
    TierError,
    UnsupportedStateError,
    UploadSkippedError,
)
from .observe.events import SaveStats
from .plan.retention import KeepAll, KeepBest, KeepEvery, KeepLast, RetentionPolicy
from .plan.schedule import Every, SavePolicy
from .steps.handle import DrainReport, SaveHandle, WaitTimeoutError

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptedError",
    "Checkpointer",
    "ClosedError",
    "CoordinationError",
    "DirectoryInUseError",
    "DrainReport",
    "Every",
    "InvalidArgumentError",
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "NoCheckpointError",
    "RetentionPolicy",
    "SaveHandle",
    "SavePolicy",
    "SaveStats",
    "SnapshotChangedError",
    "StateMismatchError",
    "StepConflictError",
    "StepInFlightError",
    "StepPrunedError",
    "TierError",
    "TiercheckError",
    "UnsupportedStateError",
    "UploadSkippedError",
    "WaitTimeoutError",
    "load",
]
