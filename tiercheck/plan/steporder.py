"""Whether a step may be saved: steps increase, except right after a restore, when an older
step starts a new branch. A pure decision; the caller deletes the abandoned steps."""

from __future__ import annotations

import dataclasses

from ..errors import StepConflictError

__all__ = ["Branch", "Proceed", "claim"]


@dataclasses.dataclass(frozen=True, slots=True)
class Proceed:
    """The step is newer than every known step."""


@dataclasses.dataclass(frozen=True, slots=True)
class Branch:
    """The step starts a new branch after the restored step `branch_point`: the committed
    steps in `stale` (after it) must be deleted, newest first, before it is saved."""

    branch_point: int
    stale: tuple[int, ...]


def claim(step: int, newest: int, committed: list[int], branch_point: int | None, where: str) -> Proceed | Branch:
    """Decide on saving `step`, given the `newest` step committed or in flight, the
    `committed` steps (listed; empty when only this session's saves are known) and the
    step restored since the last save (`branch_point`, or None).

    Raises:
        StepConflictError: `step` is not newer and starts no branch; `where` is the path of
            the newest step, for the message.
    """
    if step > newest:
        return Proceed()
    if branch_point is None or step <= branch_point or not committed:
        raise StepConflictError(
            f"cannot save step {step}: step {newest} is already committed or being saved "
            f"({where}); steps must increase. To roll back, "
            f"restore(state, step=K) with K < {step} first: saving after that starts a new "
            f"branch and discards the steps after K"
        )
    return Branch(branch_point, tuple(s for s in committed if s > branch_point))
