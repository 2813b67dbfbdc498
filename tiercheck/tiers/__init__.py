"""Blocking byte stores, one per kind of tier. They know paths and bytes, not tensors."""

from __future__ import annotations

from .base import ReadableFile, StepWriter, Tier
from .local import LocalTier

__all__ = ["LocalTier", "ReadableFile", "StepWriter", "Tier"]
