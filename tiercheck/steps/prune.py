"""Carrying out retention on one tier, `Checkpointer.delete` and the abandoned branch after a
rollback: every deletion the Checkpointer makes.

What to delete is decided by `retention` (pure); this module lists, reads the metrics a
policy ranks by, deletes (marker first: a crash midway leaves the step invisible), and
finishes the deletions a crash cut short. Retention passes and user deletions take turns
per tier (a slow tier-2 listing never holds up tier 1's pruning, hence its writer).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

from ..errors import StepInFlightError, TierError, tier_error
from ..format.manifest import Metric
from ..job.coordination import Membership
from ..observe.events import logger
from ..plan.retention import KeepAll, RetentionPolicy, plan_deletions
from ..tiers.base import Tier
from .catalog import read_marker

__all__ = ["Pruner"]


class Pruner:
    """Retention and deletions for the tiers of one pipeline.

    Args:
        tiers: the pipeline's tiers.
        keep: each tier's retention policy, by tier name.
        group: the job (one rank per directory prunes it).
        lock: the pipeline's lock: `deleting` is read under it together with the uploads
            in progress, so a deletion and a catch-up upload never start on the same step.
    """

    def __init__(
        self, tiers: list[Tier], keep: dict[str, RetentionPolicy], group: Membership, lock: threading.Lock
    ) -> None:
        self._keep = keep
        self._group = group
        self._lock = lock
        self._turns = {t.name: threading.Lock() for t in tiers}
        self.deleting: set[int] = set()  # steps whose deletion has begun (guarded by `lock`)
        # Per tier: may unmarked leftovers exist (a crash before this session, a failed step)?
        self._sweep = {t.name: True for t in tiers}
        # Per tier: the metrics recorded with each committed step (read once per step, and
        # only for policies that rank by a metric).
        self._metrics: dict[str, dict[int, dict[str, Metric]]] = {t.name: {} for t in tiers}

    def policy(self, tier: Tier) -> RetentionPolicy:
        return self._keep[tier.name]

    def failed(self, tier_name: str) -> None:
        """A step failed on the tier: it may have left data without a marker to sweep."""
        self._sweep[tier_name] = True

    def prune(
        self,
        tier: Tier,
        newest: int | None,
        protected: Callable[[], list[int]],
        listed: Callable[[list[int]], None] = lambda committed: None,
    ) -> TierError | None:
        """Apply the tier's retention: never a step in `protected()` (in flight, or owed to
        the next tier), never the newest committed one. `listed(committed)` sees the listing.
        Returns the error (naming `newest`, the step whose commit ran this pass) or None."""
        if not (self._group.leads(tier.name) or tier.capabilities.rank_parts):
            return None  # one rank per directory prunes it (on tier 0, each rank its own part)
        with self._turns[tier.name]:
            if isinstance(self._keep[tier.name], KeepAll):
                self._sweep_only(tier, protected)
                return None
            try:
                committed = tier.committed_steps()
                listed(committed)
                guarded = protected()
                policy = self._keep[tier.name]
                metrics = self._metrics_of(tier, committed) if policy.metric_names else None
                for step in plan_deletions(committed, policy, in_flight=guarded, metrics=metrics):
                    tier.delete_step(step)
                    self._metrics[tier.name].pop(step, None)
                    logger.debug("retention deleted step %d from tier %s", step, tier.name)
                if committed:
                    self._remove_strays(tier, committed[-1], guarded)
            except Exception as exc:
                return tier_error(exc, newest, tier, "applying retention after")
            return None

    def _sweep_only(self, tier: Tier, protected: Callable[[], list[int]]) -> None:
        """Nothing to delete but leftovers, and those only after a failure (or a crash
        before this session): list once then, not after every step."""
        if not self._sweep.pop(tier.name, False):
            return
        try:
            committed = tier.committed_steps()
            if committed:
                self._remove_strays(tier, committed[-1], protected())
        except Exception as exc:
            logger.warning("tiercheck: could not look for leftovers on tier %s: %r", tier.name, exc)

    def delete_step(self, step: int, tiers: list[Tier], busy: Callable[[int], bool]) -> None:
        """Delete `step` from `tiers` (marker first on each), between retention passes.
        `busy(step)` (called under the pipeline's lock) says whether it is in flight.

        Raises:
            StepInFlightError: `step` is still being written or uploaded.
            TierError: a tier failed; the other tiers were still tried.
        """
        with contextlib.ExitStack() as held:
            for name in sorted(t.name for t in tiers):  # one order everywhere: no deadlock
                held.enter_context(self._turns[name])
            with self._lock:
                if busy(step):
                    raise StepInFlightError(
                        f"cannot delete step {step}: it is still being written or uploaded; wait for its "
                        "handle (or Checkpointer.wait()) first",
                        step=step,
                    )
                self.deleting.add(step)
            errors: list[TierError] = []
            try:
                for tier in tiers:
                    try:
                        tier.delete_step(step)
                    except Exception as exc:
                        errors.append(tier_error(exc, step, tier, "deleting"))
                    with self._lock:
                        self._metrics[tier.name].pop(step, None)
            finally:
                with self._lock:
                    self.deleting.discard(step)
        if errors:
            raise errors[0]

    def delete_branch(self, steps: Sequence[int], tiers: list[Tier], wait_copies: Callable[[set[int]], None]) -> None:
        """Delete the abandoned `steps` (committed after the restored step) from `tiers`, newest
        first and marker first, before the new branch's first step is written: a crash midway
        leaves only older abandoned steps, and none outlives the branch for a restore to pick.
        While they are in `deleting` no upload of them starts; `wait_copies(steps)` (called
        without the lock) returns once none is being copied, so no upload loses its files
        mid-copy or commits a step on tier 2 after it was deleted there.

        Raises:
            TierError: a tier failed (the first failure; on that tier the older steps stay, as
                the newer one did; the other tiers were still tried).
        """
        with self._lock:
            doomed = set(steps) - self.deleting  # a deletion of one already under way keeps its own
            self.deleting |= doomed
        errors: list[TierError] = []
        try:
            wait_copies(set(steps))
            for tier in tiers:
                with self._turns[tier.name]:
                    error = self._delete_newest_first(tier, sorted(steps, reverse=True))
                if error is not None:
                    errors.append(error)
        finally:
            with self._lock:
                self.deleting -= doomed
        if errors:
            raise errors[0]

    def _delete_newest_first(self, tier: Tier, steps: list[int]) -> TierError | None:
        step = steps[0] if steps else None
        try:
            on_tier = set(tier.committed_steps())
            for step in steps:
                if step in on_tier:
                    tier.delete_step(step)
                    with self._lock:
                        self._metrics[tier.name].pop(step, None)
        except Exception as exc:
            return tier_error(exc, step, tier, "deleting abandoned")
        return None

    def remember_metrics(self, tier: Tier, step: int, metrics: tuple[tuple[str, Metric], ...]) -> None:
        if self._keep[tier.name].metric_names:  # only policies ranking by a metric read them
            with self._lock:
                self._metrics[tier.name][step] = dict(metrics)

    def _metrics_of(self, tier: Tier, committed: list[int]) -> dict[int, dict[str, Metric]]:
        """The recorded metrics of the `committed` steps of `tier`: known ones from this
        session's commits, the others read from their markers (once). A marker that cannot
        be read counts as no metrics, so a metric-ranked policy keeps that step."""
        with self._lock:
            known = self._metrics[tier.name]
            present = set(committed)
            for s in [s for s in known if s not in present]:
                del known[s]
            missing = [s for s in committed if s not in known]
        found: dict[int, dict[str, Metric]] = {}
        for s in missing:
            try:
                found[s] = dict(read_marker(tier, s).metrics)
            except Exception as exc:
                logger.warning("tiercheck: cannot read the metrics of step %d on tier %s: %r", s, tier.name, exc)
        with self._lock:
            known.update(found)
            return {s: known.get(s, {}) for s in committed}

    @staticmethod
    def _remove_strays(tier: Tier, newest: int, protected: list[int]) -> None:
        """Data a crash or a failed step left without a marker (a cut deletion or upload, the
        parts of a multi-rank step that did not commit), older than the newest committed step
        and not being written now: finish deleting it."""
        for step in tier.stray_steps() if tier.capabilities.strays else ():
            if step < newest and step not in protected:
                tier.delete_step(step)
                logger.info("removed unmarked leftovers of step %d from tier %s", step, tier.name)
