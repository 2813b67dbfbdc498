"""Checkpointer's options, validated once into a frozen value.

`Checkpointer.__init__` keeps its keyword arguments (they are the public API); it hands
them to `Options.validate`, which checks each one, resolves the job's place (rank, world
size, store), turns retention arguments into policies and groups them by concern (tiers,
retention, job, save, run log). Every later decision reads the frozen groups, each part
of the Checkpointer the one it needs, never the raw arguments.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import InvalidArgumentError
from .format.checksum import ALGORITHMS
from .job.store import from_process_group
from .plan.placement import normalize_replicated
from .plan.retention import as_policy
from .plan.schedule import SavePolicy
from .plan.settings import JobOptions, MemoryOptions, RetentionOptions, RunLogOptions, SaveOptions
from .tiers.base import Tier
from .tiers.memory import DEFAULT_MEMORY_DIR
from .tiers.open import REMOTE_RETRY_BUDGET, REMOTE_TIMEOUT, open_tier, with_timeouts
from .tiers.retry import RetryPolicy

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "BACKLOG_POLICIES",
    "REMOTE_RETRY_BUDGET",
    "REMOTE_TIMEOUT",
    "JobOptions",
    "MemoryOptions",
    "Options",
    "RetentionOptions",
    "RunLogOptions",
    "SaveOptions",
    "TierOptions",
    "job_place",
    "open_tiers",
]

BACKLOG_POLICIES = ("newest", "all")

Location = str | os.PathLike[str] | Tier
_G = TypeVar("_G", bound="DataclassInstance")


@dataclasses.dataclass(frozen=True, slots=True)
class TierOptions:
    """How the two tiers are opened (`open_tiers`): the locations and each tier's knobs."""

    local: Location | None
    remote: Location | None
    storage_options: Mapping[str, Any] | None
    direct_io: bool
    fsync: bool
    local_write_rate: float | None
    remote_write_rate: float | None
    remote_retry_budget: float
    remote_timeout: float
    remote_compression: str | None
    remote_concurrency: int
    remote_part_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """Every Checkpointer option, checked and grouped by concern; see `Checkpointer` for
    what each means. Each part of the Checkpointer is handed the group it needs."""

    tiers: TierOptions
    retention: RetentionOptions
    job: JobOptions
    save: SaveOptions
    run_log: RunLogOptions
    memory: MemoryOptions

    @classmethod
    def validate(cls, **kwargs: Any) -> Options:
        """Check the arguments of `Checkpointer.__init__` (by name) and return them as Options.

        Raises:
            InvalidArgumentError: no tier given, or an invalid option (names it).
        """
        if kwargs["local"] is None and kwargs["remote"] is None:
            raise InvalidArgumentError("Checkpointer needs at least one tier: local=DIR and/or remote=URL")
        if kwargs["checksum"] not in ALGORITHMS:
            raise InvalidArgumentError(f"checksum must be one of {ALGORITHMS}, got {kwargs['checksum']!r}")
        rank, world_size, store = job_place(kwargs["rank"], kwargs["world_size"], kwargs["store"])
        for name in ("coordination_timeout", "remote_timeout"):
            value = kwargs[name]
            if not (isinstance(value, (int, float)) and value > 0):
                raise InvalidArgumentError(f"{name} must be a positive number, got {value!r}")
        interval_s = kwargs["run_log_interval"]
        if interval_s is not None and not (
            type(interval_s) in (int, float) and interval_s >= 0 and math.isfinite(interval_s)
        ):
            raise InvalidArgumentError(f"run_log_interval must be None or a number of seconds >= 0, got {interval_s!r}")
        interval = kwargs["interval"]
        if interval is not None and not isinstance(interval, SavePolicy):
            raise InvalidArgumentError(
                f"interval must be a save policy such as tiercheck.Every(steps=500), got {interval!r}"
            )
        writer = kwargs["replicated_writer"]
        if not (writer == "balance" or (type(writer) is int and 0 <= writer < world_size)):
            raise InvalidArgumentError(
                f"replicated_writer must be 'balance' or a rank below {world_size}, got {writer!r}"
            )
        if kwargs["upload_backlog"] not in BACKLOG_POLICIES:
            raise InvalidArgumentError(
                f"upload_backlog must be one of {BACKLOG_POLICIES}, got {kwargs['upload_backlog']!r}"
            )
        memory = _memory_fields(kwargs)
        fields = {
            **kwargs,
            **memory,
            "rank": rank,
            "world_size": world_size,
            "store": store,
            "replicated": normalize_replicated(kwargs["replicated"]),
            "keep_local": as_policy(kwargs["keep_local"], "keep_local"),
            "keep_remote": as_policy(kwargs["keep_remote"], "keep_remote"),
        }

        def group(kind: type[_G]) -> _G:
            return kind(**{f.name: fields[f.name] for f in dataclasses.fields(kind)})

        return cls(
            tiers=group(TierOptions),
            retention=group(RetentionOptions),
            job=group(JobOptions),
            save=group(SaveOptions),
            run_log=RunLogOptions(interval=interval_s),
            memory=group(MemoryOptions),
        )


def _memory_fields(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Tier 0's options checked, and `host_buffers` resolved: by default one more buffer than
    tier 0 keeps steps with tier 0 on (the newest step stays in memory while the next is
    copied), else 1."""
    on = kwargs["memory"]
    if type(on) is not bool:
        raise InvalidArgumentError(f"memory must be True or False, got {on!r}")
    for name in ("keep_memory", "memory_peers"):
        v = kwargs[name]
        if type(v) is not int or v < (1 if name == "keep_memory" else 0):
            raise InvalidArgumentError(f"{name} must be an int >= {1 if name == 'keep_memory' else 0}, got {v!r}")
    rate = kwargs["memory_peer_rate"]
    if rate is not None and not (type(rate) in (int, float) and rate > 0 and math.isfinite(rate)):
        raise InvalidArgumentError(f"memory_peer_rate must be None or bytes/s > 0, got {rate!r}")
    ttl = kwargs["memory_ttl"]
    if not (type(ttl) in (int, float) and ttl > 0):
        raise InvalidArgumentError(f"memory_ttl must be a number of seconds > 0, got {ttl!r}")
    memory_dir = kwargs["memory_dir"]
    if memory_dir is None:
        memory_dir = DEFAULT_MEMORY_DIR
    if not isinstance(memory_dir, (str, os.PathLike)):
        raise InvalidArgumentError(f"memory_dir must be a directory path, got {memory_dir!r}")
    job_id = kwargs["job_id"]
    if job_id is not None and (type(job_id) is not str or not job_id):
        raise InvalidArgumentError(f"job_id must be a non-empty str, got {job_id!r}")
    buffers = kwargs["host_buffers"]
    if buffers is None:
        buffers = kwargs["keep_memory"] + 1 if on else 1
    if type(buffers) is not int or buffers < 1:
        raise InvalidArgumentError(f"host_buffers must be an int >= 1, got {buffers!r}")
    return {"memory_dir": os.fspath(memory_dir), "host_buffers": buffers}


def job_place(rank: int | None, world_size: int | None, store: Any) -> tuple[int, int, Any]:
    """(rank, world size, store): as given, else from the default process group, else 0 of 1."""
    if rank is None or world_size is None:
        found = from_process_group()
        if found is not None:
            rank = found[0] if rank is None else rank
            world_size = found[1] if world_size is None else world_size
            store = found[2] if store is None else store
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if type(rank) is not int or type(world_size) is not int or not 0 <= rank < world_size:
        raise InvalidArgumentError(f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}")
    if world_size > 1 and store is None:
        found = from_process_group()
        if found is None:
            raise InvalidArgumentError(
                f"world_size={world_size} needs a way to reach the other ranks: initialise the default "
                "process group (torch.distributed.init_process_group, as torchrun jobs do) or pass store="
            )
        store = found[2]
    return rank, world_size, store


def open_tiers(opts: TierOptions, defaults: Mapping[str, Any]) -> tuple[Tier | None, Tier | None]:
    """Tier 1 and tier 2 from the options (`open_tier`). A `Tier` passed in is used as it
    is: a tier option of the same role that differs from its default (`defaults`, by
    argument name) is an InvalidArgumentError, since the tier keeps the options it was
    built with."""
    local_opts = {"direct_io": "direct_io", "fsync": "fsync", "local_write_rate": "write_rate"}
    remote_opts = {
        "remote_write_rate": "write_rate",
        "remote_compression": "compression",
        "remote_concurrency": "concurrency",
        "remote_part_size": "block_size",
        "remote_timeout": "op_timeout",
        "remote_retry_budget": "retry",
    }
    given = {name: getattr(opts, name) for name in (*local_opts, *remote_opts)}

    def reject(tier: Tier, role: str, names: list[str]) -> None:
        if names:
            raise InvalidArgumentError(
                f"{', '.join(names)} cannot be applied to the {type(tier).__name__} given as {role}=: a Tier "
                "passed in keeps the options it was built with; set them when building it"
            )

    local_tier = remote_tier = None
    if isinstance(opts.local, Tier):
        reject(opts.local, "local", [n for n in local_opts if given[n] != defaults[n]])
        local_tier = open_tier(opts.local, role="local")
    elif opts.local is not None:
        local_tier = open_tier(opts.local, role="local", **{local_opts[n]: given[n] for n in local_opts})
    if isinstance(opts.remote, Tier):
        changed = [n for n in remote_opts if given[n] != defaults[n]]
        reject(opts.remote, "remote", changed + (["storage_options"] if opts.storage_options else []))
        remote_tier = open_tier(opts.remote, role="remote")
    elif opts.remote is not None:
        kwargs = {remote_opts[n]: given[n] for n in remote_opts}
        kwargs["retry"] = RetryPolicy(budget_s=opts.remote_retry_budget)
        storage = with_timeouts(os.fspath(opts.remote), opts.storage_options, opts.remote_timeout)
        remote_tier = open_tier(opts.remote, role="remote", storage_options=storage, **kwargs)
    return local_tier, remote_tier
