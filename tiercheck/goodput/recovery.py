"""The time lost when failures recover from different tiers: tier 0 (the node's shared
memory) for the failures that leave the node up, the durable tiers (1 and 2) for the rest.
Pure: values in, values out (`tiercheck plan --memory-share/--memory-restart`).

The model is Daly's (`summary.lost_fraction`) with a mix of recoveries. Failures come at
random times (exponential, mean M). A failure is of kind i with probability p_i; after it,
training runs again R_i later, from a snapshot L_i older than the newest save: tier 0 holds
a step as soon as its copy is committed in memory (L = 0), tiers 1 and 2 once it is durable
(L = W, the time from ``save()`` until durable). Redoing L is time without progress that a
failure can interrupt like a restart, so each kind acts as a restart of R_i + L_i (to first
order: a failure within W of a save falls back one interval further, T + C, with probability
W / (T + C)). The expected wall time for T seconds of compute, saves costing C, is then

    E = M (e^((T+C)/M) - 1) / q,    q = sum_i p_i e^(-(R_i + L_i)/M),

which is Daly's M e^(R/M) (e^((T+C)/M) - 1) with R = R_eff = -M ln q; for one kind,
R_eff = R + L and it is Daly's model exactly. (Derivation: from a failure, the expected time
until work resumes solves G = sum_i p_i [(1 - e^(-x_i/M)) (M + G) + e^(-x_i/M) X] with
x_i = R_i + L_i, which gives G = X + M (1/q - 1); with X = (1 - e^(-(T+C)/M)) (M + G), X = E.)
R_eff only scales E, so the best interval is Daly's whatever the mix: tier 0 changes what a
failure costs, not how often to save, except that saves closer than W apart would queue
behind the durable write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .summary import daly_interval, lost_fraction

__all__ = ["Recovery", "Tier0Plan", "effective_restart", "tier0_plan"]

# Of the faults DLRover's flash checkpoint saw, about three in four were recovered by
# restarting the process on the same node (its memory intact): the default share.
DLROVER_SHARE = 0.75


@dataclass(frozen=True, slots=True)
class Recovery:
    """One way a job comes back after a failure.

    Attributes:
        share: the fraction of failures that come back this way (the shares sum to 1).
        restart_s: seconds from the failure until training runs again (relaunch + restore).
        lag_s: how far the snapshot it reads is behind the newest save: 0 for tier 0, the
            time until durable for tiers 1 and 2.
    """

    share: float
    restart_s: float
    lag_s: float = 0.0


def effective_restart(mtbf: float, recoveries: Sequence[Recovery]) -> float:
    """R_eff = -M ln(sum_i p_i e^(-(R_i + L_i)/M)): the one restart time that loses as much as
    the mix (the module docstring); R + L for a single recovery.

    Raises:
        ValueError: shares not summing to 1, or a negative share, restart or lag.
    """
    if not (isinstance(mtbf, (int, float)) and math.isfinite(mtbf) and mtbf > 0):
        raise ValueError(f"mtbf must be a positive number of seconds, got {mtbf!r}")
    if not recoveries:
        raise ValueError("give at least one recovery")
    for r in recoveries:
        if not (0.0 <= r.share <= 1.0 and r.restart_s >= 0.0 and r.lag_s >= 0.0):
            raise ValueError(f"a share in [0, 1] and restart and lag >= 0 seconds, got {r!r}")
    if not math.isclose(sum(r.share for r in recoveries), 1.0, abs_tol=1e-9):
        raise ValueError(f"the shares sum to {sum(r.share for r in recoveries)!r}, not 1")
    kinds = [(r.share, (r.restart_s + r.lag_s) / mtbf) for r in recoveries if r.share > 0]
    least = min(x for _, x in kinds)  # factored out: e^(-x) of a long restart underflows
    return mtbf * (least - math.log(sum(p * math.exp(least - x) for p, x in kinds)))


@dataclass(frozen=True, slots=True)
class Tier0Plan:
    """Saving at `interval_s`, the expected fraction of time lost with and without tier 0.

    Attributes:
        interval_s: Daly's interval, or `durable_after_s` when longer (saves do not queue).
        memory_share: the fraction of failures tier 0 brings back (the node is still up).
        memory_restart_s: restart from tier 0 (relaunch + restore from memory).
        restart_s: restart from tier 1 or 2.
        durable_after_s: seconds from ``save()`` until durable: how far tiers 1-2 lag.
        restart_effective_s: R_eff with tier 0; `durable_restart_effective_s` without.
        lost_fraction: expected fraction of time lost with tier 0;
            `durable_lost_fraction` without it (every failure from tiers 1-2).
    """

    cost_s: float
    mtbf_s: float
    interval_s: float
    memory_share: float
    memory_restart_s: float
    restart_s: float
    durable_after_s: float
    restart_effective_s: float
    durable_restart_effective_s: float
    lost_fraction: float
    durable_lost_fraction: float


def tier0_plan(
    cost: float,
    mtbf: float,
    restart: float,
    memory_restart: float,
    memory_share: float = DLROVER_SHARE,
    durable_after: float = 0.0,
) -> Tier0Plan:
    """The time lost with tier 0 beside the time lost with tiers 1-2 alone.

    Example:
        >>> p = tier0_plan(30.0, 8 * 3600.0, 300.0, memory_restart=10.0, memory_share=0.75)
        >>> round(p.durable_lost_fraction, 4), round(p.lost_fraction, 4)
        (0.0548, 0.0477)
    """
    interval = max(daly_interval(cost, mtbf), durable_after)
    mixed = effective_restart(
        mtbf,
        [
            Recovery(memory_share, memory_restart, 0.0),
            Recovery(1.0 - memory_share, restart, durable_after),
        ],
    )
    alone = effective_restart(mtbf, [Recovery(1.0, restart, durable_after)])
    return Tier0Plan(
        cost_s=cost,
        mtbf_s=mtbf,
        interval_s=interval,
        memory_share=memory_share,
        memory_restart_s=memory_restart,
        restart_s=restart,
        durable_after_s=durable_after,
        restart_effective_s=mixed,
        durable_restart_effective_s=alone,
        lost_fraction=lost_fraction(interval, cost, mtbf, mixed),
        durable_lost_fraction=lost_fraction(interval, cost, mtbf, alone),
    )
