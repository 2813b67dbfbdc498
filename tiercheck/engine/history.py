"""What this session knows of the order of its steps, and the deletions that follow from it.

A step must be newer than every step saved or committed before (`plan.steporder.claim`),
except right after a restore: a newer step then starts a new branch, and the committed
steps after the restored one (the abandoned branch) are deleted first, one rank per
directory, so that a later restore can never pick them up. `delete` is the user's
deletion of one committed step. Called from the caller's thread, under the Checkpointer's
lock.
"""

from __future__ import annotations

import warnings

from ..errors import NoCheckpointError, StepConflictError, StepInFlightError, TierError
from ..job.coordination import Membership
from ..plan.settings import JobOptions
from ..plan.steporder import Proceed, claim
from ..tiers.base import Tier
from .pipeline import Pipeline

__all__ = ["StepHistory"]


class StepHistory:
    """The newest step this session saved, the step it restored (the branch point, until
    the next save) and the committed steps that restore saw.

    Args:
        tiers: the tiers, fastest first (its listing answers when nothing is known yet).
        group: this process's place in the job (which directories it deletes in).
        pipeline: in-flight steps; carries out deletions between retention passes.
        job: this rank and the job's size (a deletion makes the session a writer).
    """

    def __init__(self, tiers: list[Tier], group: Membership, pipeline: Pipeline, job: JobOptions) -> None:
        self._tiers = tiers
        self._group = group
        self._pipeline = pipeline
        self._job = job
        self._latest_known: int | None = None
        self._branch_point: int | None = None
        self._seen_at_restore: tuple[int, ...] | None = None

    def saved(self, step: int) -> None:
        self._latest_known = step

    def restored(self, step: int, committed: tuple[int, ...]) -> None:
        self._branch_point = step
        self._seen_at_restore = committed
        self._latest_known = None  # re-derived at the next save

    def claim(self, step: int) -> None:
        """Check that `step` may be saved (`steporder.claim`); on a new branch after a
        restore, delete the abandoned steps first, through the pruner (one rank per
        directory); a TierError from that leaves the branch to the next try.

        Raises:
            StepConflictError: `step` is not newer than the existing or pending steps.
            TierError: deleting the abandoned branch failed.
        """
        if self._latest_known is not None:
            newest = self._latest_known  # set by this session's saves: no listing needed
            committed: list[int] = []
        else:  # first save, or first after a restore
            committed = self._committed_for_claim()
            in_flight = self._pipeline.in_flight()
            newest = max(committed[-1:] + in_flight[-1:], default=-1)
        branch_point, self._branch_point = self._branch_point, None
        try:
            decision = claim(step, newest, committed, branch_point, self._listed.path_of(newest))
        except StepConflictError:
            self._branch_point = branch_point
            raise
        if isinstance(decision, Proceed):
            return
        mine = [t for t in self._tiers if self._leads(t)]  # one rank per directory
        try:
            self._pipeline.delete_branch(decision.stale, mine)
        except TierError:
            self._branch_point = branch_point  # a retry of the save deletes what is left
            raise
        warnings.warn(
            f"tiercheck: step {step} starts a new branch after restored step {decision.branch_point}; "
            f"deleted the abandoned steps {list(decision.stale)}",
            RuntimeWarning,
            stacklevel=3,  # the caller of Checkpointer.save
        )

    def _committed_for_claim(self) -> list[int]:
        """Committed steps for the step-order check, without blocking on a down object store:
        what the last restore saw if there was one, else the fastest tier's listing."""
        if self._seen_at_restore is not None:
            seen, self._seen_at_restore = list(self._seen_at_restore), None
            return seen
        return self._listed.committed_steps()

    def _leads(self, tier: Tier) -> bool:
        """Whether this rank deletes on `tier`: its directory's leader, or every rank for its
        own part (tier 0)."""
        return self._group.leads(tier.name) or tier.capabilities.rank_parts

    @property
    def _listed(self) -> Tier:
        """The fastest tier that keeps every step retention keeps: tier 0 holds only the
        newest few (and nothing after a node is lost), so it cannot say what was committed."""
        return next((t for t in self._tiers if not t.capabilities.rank_parts), self._tiers[0])

    def delete(self, step: int) -> None:
        """`Checkpointer.delete`: `step` from every tier holding it, one rank per directory.

        Raises:
            StepInFlightError: `step` is still being written or uploaded.
            NoCheckpointError: `step` is not committed on any tier.
            TierError: a tier failed to delete it (the other tiers were still tried).
            DirectoryInUseError: another live Checkpointer writes this directory.
        """
        holders = [t for t in self._tiers if step in t.committed_steps()]
        if not holders:
            if step in self._pipeline.in_flight():
                raise StepInFlightError(f"cannot delete step {step}: it is still being written", step=step)
            where = ", ".join(f"{t.name}={t.location}" for t in self._tiers)
            raise NoCheckpointError(f"step {step} is not committed on any tier ({where})")
        mine = [t for t in holders if self._leads(t)]
        self._pipeline.become_writer(self._job.rank, self._job.world_size)  # deleting is writing
        self._pipeline.delete_step(step, mine)
        if self._latest_known == step:
            self._latest_known = None  # re-derived from the tiers at the next save
