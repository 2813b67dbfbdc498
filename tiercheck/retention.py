"""Retention policies and the deletion plan (pure: no I/O).

A policy answers "which of these committed steps would you like to keep?"; the plan
then adds the safety rules no policy can override: the newest committed step, steps
still being written, and (on tier 1) steps not yet committed on tier 2 are never deleted.

The same policies decide what tier 2 must get: a step that tier-2 retention would keep (a
milestone of `KeepEvery`, one of the `n` newest for `KeepLast`, any step for `KeepAll`) is
never left off it. `superseded` answers the one question both the upload backlog and the
start-up catch-up ask: which of these steps would the tier delete anyway?
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from .errors import InvalidArgumentError

__all__ = [
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "as_policy",
    "plan_catch_up",
    "plan_deletions",
    "superseded",
]


class RetentionPolicy(ABC):
    """Decides which committed steps a tier keeps. Combine policies with ``|``."""

    @abstractmethod
    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        """Of the committed `steps` (ascending), the ones this policy wants kept."""

    def __or__(self, other: RetentionPolicy) -> RetentionPolicy:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return KeepAny((self, other))


@dataclass(frozen=True, slots=True)
class KeepLast(RetentionPolicy):
    """Keep the `n` newest committed steps.

    Example:
        >>> sorted(KeepLast(2).keep([10, 20, 30]))
        [20, 30]
    """

    n: int

    def __post_init__(self) -> None:
        if type(self.n) is not int or self.n < 1:
            raise InvalidArgumentError(f"KeepLast(n) needs an int n >= 1, got {self.n!r}")

    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        return frozenset(steps[-self.n :])


@dataclass(frozen=True, slots=True)
class KeepEvery(RetentionPolicy):
    """Keep every step that is a multiple of `n_steps` (long-term milestones).

    Example:
        >>> sorted((KeepLast(1) | KeepEvery(1000)).keep([500, 1000, 1500, 2000, 2500]))
        [1000, 2000, 2500]
    """

    n_steps: int

    def __post_init__(self) -> None:
        if type(self.n_steps) is not int or self.n_steps < 1:
            raise InvalidArgumentError(f"KeepEvery(n_steps) needs an int >= 1, got {self.n_steps!r}")

    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        return frozenset(s for s in steps if s % self.n_steps == 0)


@dataclass(frozen=True, slots=True)
class KeepAny(RetentionPolicy):
    """Keep a step if any of `policies` keeps it (what ``a | b`` builds)."""

    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return frozenset(kept)


@dataclass(frozen=True, slots=True)
class KeepAll(RetentionPolicy):
    """Keep everything (what ``keep_local=None`` means)."""

    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        return frozenset(steps)


def as_policy(value: int | RetentionPolicy | None, option: str) -> RetentionPolicy:
    """Accept the forms the `Checkpointer` options take: int, policy, or None."""
    if value is None:
        return KeepAll()
    if isinstance(value, RetentionPolicy):
        return value
    if type(value) is int:
        return KeepLast(value)
    raise InvalidArgumentError(f"{option} must be an int, a retention policy or None, got {value!r}")


def plan_deletions(
    committed: Sequence[int],
    policy: RetentionPolicy,
    in_flight: Collection[int] = (),
    not_yet_on_next_tier: Collection[int] = (),
) -> list[int]:
    """The committed steps to delete now, ascending.

    Never the newest committed step, a step in `in_flight`, or one in
    `not_yet_on_next_tier`, whatever the policy says.
    """
    steps = sorted(set(committed))
    if not steps:
        return []
    keep = set(policy.keep(steps))
    keep.add(steps[-1])
    keep.update(in_flight)
    keep.update(not_yet_on_next_tier)
    return [s for s in steps if s not in keep]


def superseded(steps: Collection[int], policy: RetentionPolicy, others: Collection[int] = ()) -> list[int]:
    """Of `steps`, not yet on a tier, those the tier's retention `policy` would delete anyway
    once every step of `steps` and `others` is there; ascending. Only these may be left off
    the tier: `KeepLast(n)` supersedes a step once `n` newer ones are known, `KeepEvery`
    never supersedes a multiple, `KeepAll` nothing, and the newest step is never superseded.

    Example:
        >>> superseded([5, 10, 15], KeepLast(2) | KeepEvery(10), others=[20, 25])
        [5, 15]
    """
    known = sorted(set(steps) | set(others))
    if not known:
        return []
    keep = set(policy.keep(known))
    keep.add(known[-1])
    return sorted(s for s in set(steps) if s not in keep)


def plan_catch_up(
    on_tier1: Collection[int], on_tier2: Collection[int], policy: RetentionPolicy, pending: Collection[int] = ()
) -> list[int]:
    """At start-up: the tier-1 steps an earlier run left without their tier-2 copy that tier-2
    retention `policy` would keep (given the steps on both tiers and `pending`, the steps this
    run is saving, which are uploaded anyway and never returned); ascending.

    Example:
        >>> plan_catch_up([10, 11], [5], KeepLast(1) | KeepEvery(10))
        [10, 11]
        >>> plan_catch_up([10, 11], [5], KeepLast(1) | KeepEvery(10), pending=[12])
        [10]
    """
    missing = set(on_tier1) - set(on_tier2) - set(pending)
    gone = superseded(missing, policy, set(on_tier2) | set(pending))
    return sorted(missing.difference(gone))
