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
    TiercheckError,
    TierError,
    UnsupportedStateError,
    UploadSkippedError,
)
from .events import SaveStats
from .handle import DrainReport, SaveHandle, WaitTimeoutError
from .retention import KeepAll, KeepEvery, KeepLast, RetentionPolicy

__version__ = "0.1.0"

__all__ = [
    "CheckpointCorruptedError",
    "Checkpointer",
    "ClosedError",
    "CoordinationError",
    "DirectoryInUseError",
    "DrainReport",
    "InvalidArgumentError",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "NoCheckpointError",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "SnapshotChangedError",
    "StateMismatchError",
    "StepConflictError",
    "TierError",
    "TiercheckError",
    "UnsupportedStateError",
    "UploadSkippedError",
    "WaitTimeoutError",
    "load",
]
