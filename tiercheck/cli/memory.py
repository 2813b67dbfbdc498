"""``tiercheck memory ls [MEMORY_DIR]`` and ``tiercheck memory clean [MEMORY_DIR]``: what jobs
left in a shared-memory directory (tier 0, `tiers/memory.py`), and removing it.

`ls` only reads. `clean` removes the tier-0 roots no live process holds (a process holds a
writer lock in every root it uses) and that nothing touched for ``--older-than``; a live
job's files are never removed, only names tier 0 makes are, and no link is followed.
Exit codes as for the other tools: 0 done, 2 a usage error or the directory not found; an
error is one line on stderr, ``tiercheck: memory <ls|clean>: <what failed>: <where>: <what
to check>``, and with ``--json`` also ``{"error": {...}}`` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import time
from typing import Any

from ..goodput.summary import format_duration, parse_duration
from ..observe.progress import format_bytes
from ..tiers.memory import DEFAULT_MEMORY_DIR, MemoryJob, clean_jobs, list_jobs

__all__ = ["COMMAND", "register", "run"]

COMMAND = "memory"

EXIT_OK, EXIT_USAGE = 0, 2


def register(sub: Any) -> None:
    """Add ``memory`` (with ``ls`` and ``clean``) to `sub`, the command's subparsers."""
    p = sub.add_parser("memory", help="list or remove what jobs left in shared memory (tier 0)")
    actions = p.add_subparsers(dest="memory_cmd", required=True, metavar="{ls,clean}")
    ls = actions.add_parser("ls", help="the jobs' tier-0 roots: job, steps, size, age, live or not")
    clean = actions.add_parser(
        "clean",
        help="remove the tier-0 roots no live process holds",
        description="Remove the tier-0 roots under MEMORY_DIR that no live process holds and that "
        "nothing touched for --older-than (default 0: every one no live process holds). A live job's "
        "files are never removed.",
    )
    for q in (ls, clean):
        q.add_argument(
            "memory_dir",
            nargs="?",
            default=DEFAULT_MEMORY_DIR,
            metavar="MEMORY_DIR",
            help=f"the shared-memory directory, as given to memory_dir= (default {DEFAULT_MEMORY_DIR})",
        )
        q.add_argument("--json", action="store_true", help="print the result as one JSON document")
    clean.add_argument(
        "--older-than",
        default="0",
        metavar="DURATION",
        help="only roots untouched for this long: 30m, 12h, 2d, or seconds (default 0)",
    )
    clean.add_argument("--dry-run", action="store_true", help="only show what would be removed")


class _Failed(Exception):
    """What the command could not do: what failed, where, what to check."""

    def __init__(self, what: str, where: str, check: str, kind: str) -> None:
        super().__init__(f"{what}: {where}: {check}")
        self.kind = kind  # the builtin error it stands for, named in --json's error


def run(args: argparse.Namespace) -> int:
    """Execute ``memory ls`` or ``memory clean``; return the exit code."""
    name = f"memory {args.memory_cmd}"
    try:
        where = _memory_dir(args.memory_dir)
        if args.memory_cmd == "ls":
            doc, text = _ls(where)
        else:
            doc, text = _clean(where, _older_than(args.older_than), args.dry_run)
    except _Failed as failed:
        return _fail(args, name, failed.kind, str(failed))
    except OSError as exc:  # the directory went or refused us mid-way
        what = _printable(f"{type(exc).__name__}: {exc}")
        return _fail(args, name, type(exc).__name__, f"stopped ({what}): {args.memory_dir}: check the directory")
    if args.json:
        print(json.dumps(doc, allow_nan=False))
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _fail(args: argparse.Namespace, name: str, kind: str, message: str) -> int:
    print(f"tiercheck: {name}: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"error": {"type": kind, "message": message, "exit_code": EXIT_USAGE}}))
    return EXIT_USAGE


def _memory_dir(path: str) -> str:
    """The directory named on the command line (the user's own link to it is followed, as
    ``ls`` would; nothing inside it is)."""
    where = os.path.abspath(path)
    try:
        st = os.stat(where)
    except FileNotFoundError:
        raise _Failed(
            "no such directory", where, "give the shared-memory directory, as given to memory_dir=", "FileNotFoundError"
        ) from None
    except OSError as exc:
        raise _Failed(
            f"cannot read ({exc.strerror})", where, "check the path and its permissions", type(exc).__name__
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise _Failed(
            "not a directory", where, "give the shared-memory directory, as given to memory_dir=", "NotADirectoryError"
        )
    return where


def _older_than(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError:
        raise _Failed(
            "cannot read --older-than as a duration",
            _printable(repr(text)),
            "use e.g. 30m, 12h, 2d or 3600",
            "ValueError",
        ) from None


def _ls(where: str) -> tuple[dict[str, Any], str]:
    now = time.time()
    jobs = list_jobs(where)
    doc = {"memory_dir": where, "jobs": [_job_doc(j, now) for j in jobs]}
    if not jobs:
        return doc, f"no tier-0 job in {where}\n"
    rows = [["job", "state", "steps", "size", "untouched for", "host", "root"]]
    rows += [
        [
            _printable(j.job_id),
            "live" if j.live else "left",
            _steps(j.steps),
            format_bytes(j.bytes),
            format_duration(max(0.0, now - j.modified)),
            _printable(j.host),
            _printable(j.root),
        ]
        for j in jobs
    ]
    left = [j for j in jobs if not j.live]
    tail = (
        f"{len(left)} left by jobs no process holds ({format_bytes(sum(j.bytes for j in left))}): "
        f"`tiercheck memory clean {where}` removes them\n"
        if left
        else ""
    )
    return doc, _table(rows) + tail


def _clean(where: str, older_than: float, dry_run: bool) -> tuple[dict[str, Any], str]:
    now = time.time()
    gone = clean_jobs(where, older_than, dry_run=dry_run, now=now)
    kept = [j for j in list_jobs(where) if j.root not in {g.root for g in gone}] if dry_run else list_jobs(where)
    doc = {
        "memory_dir": where,
        "older_than_s": older_than,
        "dry_run": dry_run,
        "removed": [_job_doc(j, now) for j in gone],
        "kept": [_job_doc(j, now) for j in kept],
    }
    verb = "would remove" if dry_run else "removed"
    lines = [
        f"{verb} {_printable(j.root)} (job {_printable(j.job_id)}, {_steps(j.steps)}, {format_bytes(j.bytes)})"
        for j in gone
    ]
    live = sum(j.live for j in kept)
    young = len(kept) - live
    lines.append(
        f"{verb} {len(gone)} tier-0 root(s), {format_bytes(sum(j.bytes for j in gone))}; kept {live} live"
        + (f" and {young} touched within {format_duration(older_than)}" if young else "")
    )
    return doc, "\n".join(lines) + "\n"


def _job_doc(job: MemoryJob, now: float) -> dict[str, Any]:
    return {
        "root": job.root,
        "job_id": job.job_id,
        "source": job.source,
        "host": job.host,
        "created": job.created or None,
        "modified": job.modified,
        "untouched_s": max(0.0, now - job.modified),
        "bytes": job.bytes,
        "steps": list(job.steps),
        "live": job.live,
    }


def _steps(steps: tuple[int, ...]) -> str:
    if not steps:
        return "no step"
    shown = ", ".join(map(str, steps[-3:]))
    return f"step {shown}" if len(steps) == 1 else f"{len(steps)} steps ({'..., ' if len(steps) > 3 else ''}{shown})"


def _printable(text: str) -> str:
    """A job file's text as one safe line: control characters (a terminal's escapes) escaped."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n" for r in rows)
