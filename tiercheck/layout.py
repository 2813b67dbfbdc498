"""Names on every tier (pure). Only names these rules produce are ever deleted.

A tier root holds one directory per step::

    step-000000000120/
        rank-00000-of-00001.shard          raw tensor bytes, 4 KiB-aligned entries
        rank-00000-of-00001.manifest.json  JSON manifest of that rank's leaves
        COMMIT                             commit marker, written last
    .tiercheck-tmp-step-000000000125-r00000-<token>/   local tier: a step being written
    .tiercheck-trash-step-000000000100-<token>/        local tier: a step being deleted
"""

from __future__ import annotations

import re
import secrets

STEP_PREFIX = "step-"
STEP_DIGITS = 12
COMMIT_NAME = "COMMIT"
TMP_PREFIX = ".tiercheck-tmp-"
TRASH_PREFIX = ".tiercheck-trash-"

_STEP_RE = re.compile(r"^step-(\d{12,})$")
_TMP_RE = re.compile(r"^\.tiercheck-tmp-step-\d{12,}-r\d{5,}-[0-9a-f]{16}$")
_TRASH_RE = re.compile(r"^\.tiercheck-trash-step-\d{12,}-[0-9a-f]{16}$")
_SHARD_RE = re.compile(r"^rank-(\d{5,})-of-(\d{5,})\.shard$")


def step_dir_name(step: int) -> str:
    """``step-000000000042``: zero-padded so object-store listings sort by step."""
    return f"{STEP_PREFIX}{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a directory name denotes, or None if the name is not a step directory."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.shard"


def manifest_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.manifest.json"


def tmp_dir_name(step: int, rank: int) -> str:
    return f"{TMP_PREFIX}{step_dir_name(step)}-r{rank:05d}-{secrets.token_hex(8)}"


def trash_dir_name(step: int) -> str:
    return f"{TRASH_PREFIX}{step_dir_name(step)}-{secrets.token_hex(8)}"


def is_leftover(name: str) -> bool:
    """True for temp and trash directories a crashed writer may leave behind."""
    return bool(_TMP_RE.match(name) or _TRASH_RE.match(name))


def is_safe_file_name(name: str) -> bool:
    """A manifest may only name plain files inside its step directory."""
    return bool(_SHARD_RE.match(name))
