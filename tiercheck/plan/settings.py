"""The Checkpointer's settings, grouped by concern: frozen values each part of it is handed
whole (retention and backlog to the pipeline, the job's layout to the part planner, the
save's knobs to the stager). `tiercheck.options.Options` checks and builds them; the tier
options, which name tiers, stay there with `open_tiers`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .retention import RetentionPolicy
from .schedule import SavePolicy

__all__ = ["JobOptions", "MemoryOptions", "RetentionOptions", "RunLogOptions", "SaveOptions"]


@dataclasses.dataclass(frozen=True, slots=True)
class RetentionOptions:
    """What each tier keeps, and which uploads a backlog may skip (those tier 2 would not
    keep: ``upload_backlog="newest"``; "all" skips none)."""

    keep_local: RetentionPolicy
    keep_remote: RetentionPolicy
    upload_backlog: str


@dataclasses.dataclass(frozen=True, slots=True)
class JobOptions:
    """This process's place in the job and how its ranks share the state."""

    rank: int
    world_size: int
    store: Any
    replicated: bool | frozenset[str | int]
    replicated_writer: int | str
    coordination_timeout: float


@dataclasses.dataclass(frozen=True, slots=True)
class SaveOptions:
    """How a save is staged and written, and when one is due."""

    host_buffers: int
    checksum: str
    overlap: bool
    low_priority: bool
    interval: SavePolicy | None


@dataclasses.dataclass(frozen=True, slots=True)
class RunLogOptions:
    """The run log (`goodput.runlog`): seconds between flushes, or None for no run log."""

    interval: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryOptions:
    """Tier 0 (`tiers.memory`): whether the host buffers live in shared memory, where, under
    which job identity, how many steps it keeps, and the copies sent to other nodes."""

    memory: bool
    memory_dir: str
    job_id: str | None
    keep_memory: int
    memory_peers: int
    memory_peer_rate: float | None
    memory_ttl: float
