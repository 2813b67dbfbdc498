"""Retention policies and the deletion plan (pure: no I/O).

A policy answers "which of these committed steps would you like to keep?"; the plan
then adds the safety rules no policy can override: the newest committed step, steps
still being written, and (on tier 1) steps not yet committed on tier 2 are never deleted.

The same policies decide what tier 2 must get: a step that tier-2 retention would keep (a
milestone of `KeepEvery`, one of the `n` newest for `KeepLast`, any step for `KeepAll`) is
never left off it. `superseded` answers the one question both the upload backlog and the
start-up catch-up ask: which of these steps would the tier delete anyway?

Policies that rank steps by a metric (`KeepBest`) also get each step's recorded metrics
(`save(..., metrics=)`), and may abstain on a step: `KeepBest` has no opinion on a step
without its metric. A step is kept if any combined policy keeps it, or if none of them
has an opinion on it; so `KeepBest` alone never deletes a step that lacks its metric,
while ``KeepBest(...) | KeepLast(2)`` lets `KeepLast` decide such steps. Where the metrics
are not known (``metrics=None``), `KeepBest` keeps every step: nothing is deleted or left
off tier 2 on a guess.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = [
    "KeepAll",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "Metrics",
    "RetentionPolicy",
    "as_policy",
    "best_steps",
    "plan_catch_up",
    "plan_deletions",
    "superseded",
]

Metrics = Mapping[int, Mapping[str, "int | float"]]
"""Each step's recorded metrics; a step missing from the mapping recorded none."""


class RetentionPolicy(ABC):
    """Decides which committed steps a tier keeps. Combine policies with ``|``."""

    @abstractmethod
    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        """Of the committed `steps` (ascending), the ones this policy wants kept."""

    @property
    def metric_names(self) -> frozenset[str]:
        """The metrics this policy ranks by; empty when it needs none (the pipeline then
        never reads a step's metrics for it)."""
        return frozenset()

    def verdict(self, steps: Sequence[int], metrics: Metrics) -> tuple[frozenset[int], frozenset[int]]:
        """(steps to keep, steps this policy has an opinion on) given each step's metrics.
        Policies that ignore metrics decide every step: ``(keep(steps), all steps)``."""
        return self.keep(steps), frozenset(steps)

    def select(self, steps: Sequence[int], metrics: Metrics) -> frozenset[int]:
        """The steps to keep given each step's metrics: those kept, plus those no part of
        the policy has an opinion on."""
        kept, decided = self.verdict(steps, metrics)
        return kept | (frozenset(steps) - decided)

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
class KeepBest(RetentionPolicy):
    """Keep the `k` steps with the best recorded value of `metric` (``save(..., metrics=)``).

    `mode` is "min" (lower is better, a loss) or "max" (an accuracy). NaN ranks below every
    number; among equal values the newer step ranks first. A step that did not record
    `metric` is not ranked: `KeepBest` has no opinion on it, so alone it never deletes it,
    and combined (``KeepBest(3, "val_loss") | KeepLast(2)``) the other policies decide it.

    Example:
        >>> m = {10: {"val_loss": 0.5}, 20: {"val_loss": 0.3}, 30: {"val_loss": 0.4}, 40: {}}
        >>> sorted(KeepBest(2, "val_loss").select([10, 20, 30, 40], m))
        [20, 30, 40]
        >>> sorted((KeepBest(1, "val_loss") | KeepLast(1)).select([10, 20, 30, 40], m))
        [20, 40]
    """

    k: int
    metric: str
    mode: str = "min"

    def __post_init__(self) -> None:
        if type(self.k) is not int or self.k < 1:
            raise InvalidArgumentError(f"KeepBest(k, ...) needs an int k >= 1, got {self.k!r}")
        if type(self.metric) is not str or not self.metric:
            raise InvalidArgumentError(f"KeepBest(k, metric) needs a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise InvalidArgumentError(f"KeepBest(mode=) must be 'min' or 'max', got {self.mode!r}")

    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        return frozenset(steps)  # without metrics nothing is ranked: keep everything

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset({self.metric})

    def verdict(self, steps: Sequence[int], metrics: Metrics) -> tuple[frozenset[int], frozenset[int]]:
        ranked = frozenset(s for s in steps if self.metric in metrics.get(s, {}))
        return best_steps(steps, metrics, self.k, self.metric, self.mode), ranked


def best_steps(steps: Sequence[int], metrics: Metrics, k: int, metric: str, mode: str) -> frozenset[int]:
    """The `k` best of `steps` that recorded `metric` (see `KeepBest`)."""
    scored = [(s, metrics[s][metric]) for s in steps if metric in metrics.get(s, {})]

    def rank(item: tuple[int, int | float]) -> tuple[int, float | int, int]:
        step, value = item
        if isinstance(value, float) and math.isnan(value):
            return (1, 0, -step)
        return (0, value if mode == "min" else -value, -step)

    return frozenset(s for s, _ in sorted(scored, key=rank)[:k])


@dataclass(frozen=True, slots=True)
class KeepAny(RetentionPolicy):
    """Keep a step if any of `policies` keeps it (what ``a | b`` builds)."""

    policies: tuple[RetentionPolicy, ...]

    def keep(self, steps: Sequence[int]) -> frozenset[int]:
        kept: set[int] = set()
        for p in self.policies:
            kept |= p.keep(steps)
        return frozenset(kept)

    @property
    def metric_names(self) -> frozenset[str]:
        return frozenset().union(*(p.metric_names for p in self.policies))

    def verdict(self, steps: Sequence[int], metrics: Metrics) -> tuple[frozenset[int], frozenset[int]]:
        kept: set[int] = set()
        decided: set[int] = set()
        for p in self.policies:
            k, d = p.verdict(steps, metrics)
            kept |= k
            decided |= d
        return frozenset(kept), frozenset(decided)


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
    metrics: Metrics | None = None,
) -> list[int]:
    """The committed steps to delete now, ascending.

    Never the newest committed step, a step in `in_flight`, or one in
    `not_yet_on_next_tier`, whatever the policy says. `metrics` (each step's recorded
    metrics) is what metric-ranked policies (`KeepBest`) decide by.
    """
    steps = sorted(set(committed))
    if not steps:
        return []
    keep = set(policy.keep(steps) if metrics is None else policy.select(steps, metrics))
    keep.add(steps[-1])
    keep.update(in_flight)
    keep.update(not_yet_on_next_tier)
    return [s for s in steps if s not in keep]


def superseded(
    steps: Collection[int], policy: RetentionPolicy, others: Collection[int] = (), metrics: Metrics | None = None
) -> list[int]:
    """Of `steps`, not yet on a tier, those the tier's retention `policy` would delete anyway
    once every step of `steps` and `others` is there; ascending. Only these may be left off
    the tier: `KeepLast(n)` supersedes a step once `n` newer ones are known, `KeepEvery`
    never supersedes a multiple, `KeepAll` nothing, and the newest step is never superseded.
    `metrics` holds the recorded metrics of every step of `steps` and `others`, for policies
    ranking by a metric; without it (None) `KeepBest` supersedes nothing: a step that may be
    among the best is never left off.

    Example:
        >>> superseded([5, 10, 15], KeepLast(2) | KeepEvery(10), others=[20, 25])
        [5, 15]
    """
    known = sorted(set(steps) | set(others))
    if not known:
        return []
    keep = set(policy.keep(known) if metrics is None else policy.select(known, metrics))
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
