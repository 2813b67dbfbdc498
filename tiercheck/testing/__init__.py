"""Tools for testing tiers and the code around them, shipped with the library.

* `conformance`: the checks every `Tier` must pass (`check_tier`, or one by one).
* `faulty`: `FaultyTier`, which wraps any tier and makes chosen operations fail, stall
  or block, for fault-injection tests that run the library's real code.
* `dicttier`: `DictTier`, a complete dict-backed tier in one file: the example to copy.

None of these imports pytest; they raise `AssertionError` on a failed check.
"""

from __future__ import annotations

from .dicttier import DictStore, DictTier
from .faulty import Call, Faults, FaultyTier

FLOOR = 10

__all__ = ["Call", "DictStore", "DictTier", "Faults", "FaultyTier"]
