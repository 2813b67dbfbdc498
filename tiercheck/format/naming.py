"""Names on every tier (pure). Only names these rules produce are ever deleted.

A tier root holds one directory per step::

    step-000000000120/
        rank-00000-of-00001.shard          raw tensor bytes, entries packed (64 B; 4 KiB from 64 KiB)
        rank-00000-of-00001.manifest.json  JSON manifest of that rank's leaves
        COMMIT                             commit marker, written last
    .tiercheck-tmp-step-000000000125-r00000-<token>/   local tier: a step being written
    .tiercheck-trash-step-000000000100-<token>/        local tier: a step being deleted
    .tiercheck-lock-rank-00000                         local tier: rank 0's writer lock (kept)
    .tiercheck-runlog/                                 the run log (runlog.py): never a step,
                                                       never swept, never pruned
"""

from __future__ import annotations

import re
import secrets

STEP_PREFIX = "step-"
STEP_DIGITS = 12
COMMIT_NAME = "COMMIT"
TMP_PREFIX = ".tiercheck-tmp-"
TRASH_PREFIX = ".tiercheck-trash-"
LOCK_PREFIX = ".tiercheck-lock-rank-"
RUNLOG_DIR = ".tiercheck-runlog"

_STEP_RE = re.compile(r"step-([0-9]{12,})", re.ASCII)
_TMP_RE = re.compile(r"\.tiercheck-tmp-step-[0-9]{12,}-r([0-9]{5,})-[0-9a-f]{16}", re.ASCII)
_TRASH_RE = re.compile(r"\.tiercheck-trash-step-[0-9]{12,}-[0-9a-f]{16}", re.ASCII)
_RUNLOG_RE = re.compile(r"rank-([0-9]{5,})(?:-[0-9a-f]{16}-p[0-9]{4,})?\.jsonl", re.ASCII)
_SHARD_RE = re.compile(r"rank-([0-9]{5,})-of-([0-9]{5,})\.shard", re.ASCII)


def step_dir_name(step: int) -> str:
    """``step-000000000042``: zero-padded so object-store listings sort by step."""
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name denotes, or None if the name is not a step directory."""
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None  # only the canonical spelling


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.shard"


def manifest_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.manifest.json"


def tmp_dir_name(step: int, rank: int) -> str:
    return f"{TMP_PREFIX}{step_dir_name(step)}-r{rank:05d}-{secrets.token_hex(8)}"


def trash_dir_name(step: int) -> str:
    return f"{TRASH_PREFIX}{step_dir_name(step)}-{secrets.token_hex(8)}"


def lock_name(rank: int) -> str:
    """The file whose `flock` makes a process the one writer of `rank`'s part of a directory."""
    return f"{LOCK_PREFIX}{rank:05d}"


def is_leftover(name: str) -> bool:
    """True for temp and trash directories a crashed writer may leave behind."""
    return bool(_TMP_RE.fullmatch(name) or _TRASH_RE.fullmatch(name))


def leftover_rank(name: str) -> int | None:
    """The rank whose writer made the temp directory `name`; None for a trash directory (or
    any other name)."""
    m = _TMP_RE.fullmatch(name)
    return None if m is None else int(m.group(1))


def is_safe_file_name(name: str) -> bool:
    """A manifest may only name plain files inside its step directory."""
    m = _SHARD_RE.fullmatch(name)
    if m is None:
        return False
    rank, world = int(m.group(1)), int(m.group(2))
    return rank < world and shard_name(rank, world) == name


def runlog_file_name(rank: int) -> str:
    """The tier-1 run log of one rank, appended to by every session of that rank."""
    return f"rank-{rank:05d}.jsonl"


def runlog_heartbeat_name(rank: int) -> str:
    """One rank's heartbeat beside its tier-1 run log: the newest progress, overwritten in place."""
    return f"rank-{rank:05d}.heartbeat"


def runlog_part_name(rank: int, session: str, part: int) -> str:
    """A tier-2 run-log object: one session's records, rewritten whole until it is full."""
    return f"rank-{rank:05d}-{session}-p{part:04d}.jsonl"


def parse_runlog_rank(name: str) -> int | None:
    """The rank a run-log file name belongs to, or None for a name this library did not make."""
    m = _RUNLOG_RE.fullmatch(name)
    return None if m is None else int(m.group(1))
