"""Blocking byte stores, one per kind of tier. They know paths and bytes, not tensors.

`open_tier` builds one from a location; a `Tier` subclass declares its optional
`Capabilities`; `tiercheck.testing` holds the conformance suite every tier passes.
"""

from __future__ import annotations

from .base import Capabilities, ReadableFile, StepWriter, Tier
from .local import LocalTier
from .open import open_tier
from .remote import RemoteTier

FLOOR = 4

__all__ = ["Capabilities", "LocalTier", "ReadableFile", "RemoteTier", "StepWriter", "Tier", "open_tier"]
