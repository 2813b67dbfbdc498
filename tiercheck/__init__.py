"""tiercheck: asynchronous, tiered checkpointing for PyTorch training."""

from __future__ import annotations

from .api import load
from .checkpointer import Checkpointer
from .errors import (
    CheckpointCorruptedError,
    CoordinationError,
    DirectoryInUseError,
    NoCheckpointError,
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
    "CoordinationError",
    "DirectoryInUseError",
    "DrainReport",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "NoCheckpointError",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "StateMismatchError",
    "StepConflictError",
    "TierError",
    "TiercheckError",
    "UnsupportedStateError",
    "UploadSkippedError",
    "WaitTimeoutError",
    "load",
]
