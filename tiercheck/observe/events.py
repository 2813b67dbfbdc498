"""What each save costs: stall, staging and tier durations and bytes, logged as JSON lines."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

logger = logging.getLogger("tiercheck")
event_logger = logging.getLogger("tiercheck.events")


@dataclass(slots=True)
class SaveStats:
    """Timings of one save, in seconds, filled in as the save progresses.

    Attributes:
        step: the step saved.
        bytes: bytes of tensor/array data staged and written (aliases counted once).
        stall_s: how long `save()` blocked the caller (validation, planning, waiting for a
            free host buffer, and the copy).
        buffer_wait_s: the part of the stall spent waiting for a host buffer to free up.
        stage_s: the part of the stall spent copying into the host buffer.
        allocated: whether this save had to allocate (or grow) a host buffer.
        background_stage_s: for an overlapped save, the copy that ran after `save()`
            returned (module parameters and optimizer state), overlapping training.
        tier_s: per tier, seconds from the start of `save()` until durable there (the
            stall included; the tier-1 writer opens the step during the copy and writes
            once it is done).
    """

    step: int
    bytes: int = 0
    stall_s: float = 0.0
    buffer_wait_s: float = 0.0
    stage_s: float = 0.0
    allocated: bool = False
    background_stage_s: float = 0.0
    tier_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"event": "save", **asdict(self)}, sort_keys=True)


def emit(stats: SaveStats) -> None:
    if event_logger.isEnabledFor(logging.INFO):
        event_logger.info(stats.to_json())


def emit_restore(step: int, tier: str, seconds: float) -> None:
    """A `restore` event: which step, from which tier (tier 0 after a process restart,
    tier 1 or 2 otherwise), and how long `restore()` took."""
    if event_logger.isEnabledFor(logging.INFO):
        event = {"event": "restore", "step": step, "tier": tier, "seconds": round(seconds, 6)}
        event_logger.info(json.dumps(event, sort_keys=True))


def report_missing_keys(step: int, tier: str, paths: Sequence[str]) -> None:
    """`restore(state, strict=False)` left template keys the checkpoint lacks as they were:
    say which, once, as a warning and a `restore_missing_keys` event."""
    warnings.warn(
        f"tiercheck: restored step {step} from tier {tier!r}; the checkpoint does not hold "
        f"{len(paths)} template key(s), left as they were (strict=False): {', '.join(paths)}",
        RuntimeWarning,
        stacklevel=4,
    )
    if event_logger.isEnabledFor(logging.INFO):
        event = {"event": "restore_missing_keys", "step": step, "tier": tier, "keys": list(paths)}
        event_logger.info(json.dumps(event, sort_keys=True))
