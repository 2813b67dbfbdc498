"""Save policies: *when* to save (pure: no I/O, no clock reads).

A policy answers "is a save due at this step?" from values the `Checkpointer` passes in:
the step, the last step saved and the seconds since the last save. Combine policies with
``|`` (a save is due when any of them says so)::

    tiercheck.Every(steps=500) | tiercheck.Every(seconds=1800)

Steps are decided by every rank alone (the same steps give the same answer). Seconds are
not: clocks differ, so in a multi-rank job only rank 0's clock counts, and the ranks agree
on the step through the job's store (`coordination.SaveRequests`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["AnyDue", "Every", "SavePolicy"]


class SavePolicy(ABC):
    """Decides whether a save is due. Combine policies with ``|``."""

    @abstractmethod
    def due_by_step(self, step: int, last_saved: int | None) -> bool:
        """Due at `step` by the step count alone (the same answer on every rank)."""

    @abstractmethod
    def due_by_clock(self, seconds_since_save: float) -> bool:
        """Due because `seconds_since_save` seconds passed since the last save (or since
        the Checkpointer was created, before the first save)."""

    @property
    @abstractmethod
    def uses_clock(self) -> bool:
        """True if `due_by_clock` can ever be true (a job must then agree on the step)."""

    def __or__(self, other: SavePolicy) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return AnyDue((self, other))


@dataclass(frozen=True, slots=True)
class Every(SavePolicy):
    """Save every `steps` steps and/or every `seconds` seconds.

    ``Every(steps=n)`` is due at the steps that are multiples of n (0 included), so the
    save points are the same after a resume; a step already saved is not due again.
    ``Every(seconds=s)`` is due once `s` seconds passed since the last save (any save,
    including one made by hand), or since the Checkpointer was created.

    Example:
        >>> p = Every(steps=500) | Every(seconds=1800)
        >>> p.due_by_step(1000, last_saved=500), p.due_by_step(1001, last_saved=1000)
        (True, False)
        >>> p.due_by_clock(1800.0)
        True
    """

    steps: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if self.steps is None and self.seconds is None:
            raise InvalidArgumentError("Every() needs steps=N and/or seconds=S")
        if self.steps is not None and (type(self.steps) is not int or self.steps < 1):
            raise InvalidArgumentError(f"Every(steps=) needs an int >= 1, got {self.steps!r}")
        if self.seconds is not None and (
            type(self.seconds) not in (int, float) or not math.isfinite(self.seconds) or self.seconds <= 0
        ):
            raise InvalidArgumentError(f"Every(seconds=) needs a positive finite number, got {self.seconds!r}")

    def due_by_step(self, step: int, last_saved: int | None) -> bool:
        return self.steps is not None and step % self.steps == 0 and step != last_saved

    def due_by_clock(self, seconds_since_save: float) -> bool:
        return self.seconds is not None and seconds_since_save >= self.seconds

    @property
    def uses_clock(self) -> bool:
        return self.seconds is not None


@dataclass(frozen=True, slots=True)
class AnyDue(SavePolicy):
    """Due when any of `policies` is (what ``a | b`` builds)."""

    policies: tuple[SavePolicy, ...]

    def due_by_step(self, step: int, last_saved: int | None) -> bool:
        return any(p.due_by_step(step, last_saved) for p in self.policies)

    def due_by_clock(self, seconds_since_save: float) -> bool:
        return any(p.due_by_clock(seconds_since_save) for p in self.policies)

    @property
    def uses_clock(self) -> bool:
        return any(p.uses_clock for p in self.policies)
