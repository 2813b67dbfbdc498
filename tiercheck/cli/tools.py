"""The subcommands `inspect`, `export`, `import`, `upload`, `prune` and `rm` of the ``tiercheck`` command.

`register` adds them to the command's subparsers; `run` executes one. Exit codes: 0 done,
1 the checkpoint is damaged (a checksum or a manifest failed), 2 a usage error, something
not found, or an operation refused. With ``--json`` the result (or the error) is one JSON
document on stdout; errors also go to stderr as one line,
``tiercheck: <command>: <what failed, where>[; <what to check>]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import CheckpointCorruptedError, DirectoryInUseError, NoCheckpointError
from ..observe.progress import format_bytes, terminal_bar
from ..tools.dcp_source import one_line
from ..tools.describe import describe_step, render
from ..tools.export import FORMATS, describe_result, export_step
from ..tools.ingest import SOURCE_FORMATS, import_step
from ..tools.prune import PruneResult, prune_steps, remove_step
from ..tools.upload import upload_steps
from ..tools.view import tier_at

__all__ = ["COMMANDS", "register", "run"]

COMMANDS = ("inspect", "export", "import", "upload", "prune", "rm")

EXIT_OK, EXIT_DAMAGED, EXIT_USAGE = 0, 1, 2


def register(sub: Any) -> None:
    """Add the subcommands to `sub`, the command's ``add_subparsers()`` object."""
    p = sub.add_parser("inspect", help="keys, dtypes, shapes and sizes of a step, from its manifest alone")
    p.add_argument("locations", nargs="+", metavar="LOCATION", help="tier roots; the first holding the step is read")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--rank", type=int, default=0, help="whose view of a multi-rank step (default 0)")
    _common_flags(p)

    p = sub.add_parser("export", help="write a step as .safetensors, .pt, or a DCP directory (streamed)")
    p.add_argument("location")
    p.add_argument("--to", required=True, metavar="DEST", help="FILE.safetensors, FILE.pt, or DIR/ for DCP")
    p.add_argument("--step", type=int, default=None, help="default: the newest committed step")
    p.add_argument("--prefix", default=None, help="export only this key path, dotted (e.g. model)")
    p.add_argument("--rank", type=int, default=0, help="whose view of a multi-rank step (default 0)")
    p.add_argument("--format", choices=FORMATS, default=None, help="instead of the destination's suffix")
    p.add_argument("--force", action="store_true", help="replace an existing destination")
    _common_flags(p)

    p = sub.add_parser("import", help="commit a torch.save file, a safetensors file or a DCP directory as a step")
    p.add_argument("source", metavar="FILE")
    p.add_argument("location")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--prefix", default=None, help="save the contents under this key (dotted nests)")
    p.add_argument("--format", choices=SOURCE_FORMATS, default=None, help="instead of guessing from the source")
    p.add_argument("--int-keys", action="store_true", help="turn decimal-string dict keys into ints (DCP)")
    _common_flags(p)

    p = sub.add_parser("upload", help="copy the committed steps tier 1 has and tier 2 lacks (checked, marker last)")
    p.add_argument("local", metavar="LOCAL", help="tier 1: the local directory")
    p.add_argument("remote", metavar="REMOTE", help="tier 2: an fsspec URL (or a directory)")
    p.add_argument("--step", type=int, default=None, help="copy only this step")
    _common_flags(p)

    p = sub.add_parser("prune", help="delete old steps, as retention would (never the newest)")
    p.add_argument("location")
    p.add_argument("--keep-last", type=int, required=True, metavar="K")
    p.add_argument("--keep-every", type=int, default=None, metavar="N", help="also keep multiples of N")
    p.add_argument("--remote", default=None, metavar="URL", help="keep steps not yet committed on this next tier")
    p.add_argument("--dry-run", action="store_true", help="only show what would be deleted")
    _common_flags(p)

    p = sub.add_parser("rm", help="delete one committed step")
    p.add_argument("location")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--allow-newest", action="store_true", help="allow deleting the newest committed step")
    p.add_argument("--dry-run", action="store_true", help="only show what would be deleted")
    _common_flags(p)


def _common_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as one JSON document")
    p.add_argument(
        "--storage-options",
        type=json_object,
        default=None,
        metavar="JSON",
        help='fsspec options for URLs, e.g. \'{"endpoint_url": "http://minio:9000"}\'',
    )


def json_object(text: str) -> dict[str, Any]:
    """argparse type of ``--storage-options``: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def run(args: argparse.Namespace) -> int:
    """Execute the parsed subcommand; return the exit code."""
    try:
        doc, text = _COMMANDS[args.cmd](args)
    except CheckpointCorruptedError as exc:
        if args.cmd == "import":  # the source is damaged (or hostile), not a step
            return _fail(args, exc, EXIT_DAMAGED, "the source is not a readable checkpoint of its format")
        return _fail(args, exc, EXIT_DAMAGED, "run `tiercheck verify` on the step; restore falls back to an older one")
    except NoCheckpointError as exc:
        return _fail(args, exc, EXIT_USAGE, "check the location and the step (`tiercheck ls LOCATION`)")
    except DirectoryInUseError as exc:
        return _fail(args, exc, EXIT_USAGE, "")
    except ImportError as exc:  # an optional dependency
        return _fail(args, exc, EXIT_USAGE, "pip install 'tiercheck[safetensors]'")
    except (OSError, ValueError, TypeError) as exc:  # the library's typed errors included
        return _fail(args, exc, EXIT_USAGE, "")
    if args.json:
        print(json.dumps(doc, allow_nan=False))
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _fail(args: argparse.Namespace, exc: BaseException, code: int, hint: str) -> int:
    message = one_line(exc)  # one line, whatever a library's message holds
    print(f"tiercheck: {args.cmd}: {message}" + (f"; {hint}" if hint else ""), file=sys.stderr)
    if args.json:
        print(json.dumps({"error": {"type": type(exc).__name__, "message": message, "exit_code": code}}))
    return code


def _inspect(args: argparse.Namespace) -> tuple[Any, str]:
    doc = describe_step([tier_at(loc, args.storage_options) for loc in args.locations], args.step, args.rank)
    return doc, render(doc)


def _export(args: argparse.Namespace) -> tuple[Any, str]:
    with terminal_bar("export") as progress:
        result = export_step(
            args.location,
            args.to,
            step=args.step,
            format=args.format,
            prefix=args.prefix,
            rank=args.rank,
            overwrite=args.force,
            storage_options=args.storage_options,
            progress=progress,
        )
    text = (
        f"step {result.step} of {args.location} -> {result.path} ({result.format}): "
        f"{result.tensors} tensors, {format_bytes(result.bytes)}\n"
    )
    if result.skipped:
        text += f"left out {len(result.skipped)} values that are not tensors (--json lists them)\n"
    if result.converted:
        text += f"wrote {len(result.converted)} numpy values as tensors (--json lists them)\n"
    return describe_result(result), text


def _import(args: argparse.Namespace) -> tuple[Any, str]:
    with terminal_bar("import") as progress:
        result = import_step(
            args.source,
            args.location,
            args.step,
            format=args.format,
            prefix=args.prefix,
            int_keys=args.int_keys,
            storage_options=args.storage_options,
            progress=progress,
        )
    doc = {
        "source": result.source,
        "format": result.format,
        "location": result.location,
        "step": result.step,
        "tensors": result.tensors,
        "bytes": result.bytes,
        "keys": list(result.keys),
    }
    keys = ", ".join(map(str, result.keys[:8])) + (", ..." if len(result.keys) > 8 else "")
    text = (
        f"{result.source} ({result.format}) -> {result.location} step {result.step}: "
        f"{result.tensors} tensors, {format_bytes(result.bytes)}; keys {keys}\n"
    )
    return doc, text


def _upload(args: argparse.Namespace) -> tuple[Any, str]:
    with terminal_bar("upload") as progress:
        result = upload_steps(
            args.local, args.remote, step=args.step, storage_options=args.storage_options, progress=progress
        )
    doc = {
        "local": result.local,
        "remote": result.remote,
        "copied": list(result.copied),
        "present": list(result.present),
        "pruned": list(result.pruned),
        "bytes": result.bytes,
    }
    text = f"copied {_steps(result.copied)} ({format_bytes(result.bytes)}) to {result.remote}"
    text += f"; already there: {_steps(result.present)}" if result.present else ""
    text += f"; pruned on tier 1 while read, not copied: {_steps(result.pruned)}" if result.pruned else ""
    text += "\n"
    return doc, text


def _prune(args: argparse.Namespace) -> tuple[Any, str]:
    result = prune_steps(
        args.location,
        args.keep_last,
        args.keep_every,
        next_tier=args.remote,
        dry_run=args.dry_run,
        storage_options=args.storage_options,
    )
    return _deletion(result)


def _rm(args: argparse.Namespace) -> tuple[Any, str]:
    return _deletion(
        remove_step(
            args.location,
            args.step,
            allow_newest=args.allow_newest,
            dry_run=args.dry_run,
            storage_options=args.storage_options,
        )
    )


def _deletion(result: PruneResult) -> tuple[Any, str]:
    doc = {
        "location": result.location,
        "deleted": list(result.deleted),
        "kept": list(result.kept),
        "dry_run": result.dry_run,
        "writer_check": result.writer_check,
    }
    verb = "would delete" if result.dry_run else "deleted"
    text = f"{verb} {_steps(result.deleted)}; kept {_steps(result.kept)}\n"
    if result.writer_check == "impossible":
        text += "note: an object store has no writer lock: make sure no Checkpointer writes there\n"
    return doc, text


def _steps(steps: tuple[int, ...]) -> str:
    if not steps:
        return "no step"
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


_COMMANDS = {
    "inspect": _inspect,
    "export": _export,
    "import": _import,
    "upload": _upload,
    "prune": _prune,
    "rm": _rm,
}
