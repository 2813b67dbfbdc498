"""What an object store's listing says about steps, as pure functions over its paths.

Object stores have no directories: a step is the objects under its prefix, committed once
its marker is there. A step's files are ``<root>/<step dir>/<name>``; anything else under
the root (a user's file, a deeper path) belongs to no step.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..format import naming

# A step file of one rank's writer: rank-<r>-of-<w>.shard or .manifest.json.
_RANK_FILE_RE = re.compile(r"rank-([0-9]{5,})-of-[0-9]{5,}\.(?:shard|manifest\.json)", re.ASCII)


def _step_file(path: str, root: str) -> tuple[int, str] | None:
    """(step, file name) of a path that is a step's file under `root`; else None."""
    prefix = root.lstrip("/") + "/"
    rel = path.lstrip("/")
    if not rel.startswith(prefix):
        return None
    parts = rel[len(prefix) :].split("/")
    step = naming.parse_step_dir(parts[0]) if len(parts) == 2 else None
    return None if step is None else (step, parts[1])


def steps_listed(paths: Iterable[str], root: str) -> tuple[list[int], list[int]]:
    """(committed steps, step prefixes holding objects but no marker) among `paths`, a
    recursive listing of `root`."""
    committed: set[int] = set()
    present: set[int] = set()
    for path in paths:
        found = _step_file(path, root)
        if found is None:
            continue
        present.add(found[0])
        if found[1] == naming.COMMIT_NAME:
            committed.add(found[0])
    return sorted(committed), sorted(present - committed)


def written_by(path: str, root: str, rank: int, world: int) -> bool:
    """Whether `path` is a file of a step that the writer of `rank` makes: its own rank's
    files, and for rank 0 also those of ranks beyond a job of `world`."""
    found = _step_file(path, root)
    m = None if found is None else _RANK_FILE_RE.fullmatch(found[1])
    if m is None:
        return False
    owner = int(m.group(1))
    return owner == rank or (rank == 0 and owner >= world)
