"""`tiercheck export`: write a committed step in another format, streamed.

========================  ==========================================  =========================
format (chosen by)        what is written                             peak memory
========================  ==========================================  =========================
``.safetensors``          the tensors, named by their key paths        one 8 MiB buffer
                          joined with dots (below ``prefix``)
``.pt`` / ``.pth``        the plain state, as `torch.save` writes it   one 8 MiB buffer (plus
                          (loadable with ``weights_only=True``)        ``bytes`` values)
a directory (``DIR/``,    a `torch.distributed.checkpoint` save of    the largest tensor
``*.dcp``, an existing    the plain state
directory)
========================  ==========================================  =========================

A DTensor (FSDP2, tensor parallel) is written as the whole tensor, whichever rank's view is
exported: assembled from every saved rank's pieces of it (read from the same tier), band of
rows by band through the same buffer, every checksum block read verified (`view.ShardReader`);
for DCP the largest tensor is then the largest whole tensor.

Every tensor's bytes are checked against the manifest's checksum on the way; the output is
written under a temporary name beside the destination and renamed into place only once
complete, so a failed export never leaves a file that looks finished.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..observe.progress import ProgressCallback
from . import to_dcp, to_safetensors, to_torch
from .view import LEAF_KINDS, KeyPath, Node, ShardReader, choose_step, dotted, open_view, select, tier_at, walk

__all__ = ["FORMATS", "ExportResult", "export_format", "export_step"]

FORMATS = ("safetensors", "pt", "dcp")


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What `export_step` wrote.

    Attributes:
        path: the file or directory written.
        format: ``"safetensors"``, ``"pt"`` or ``"dcp"``.
        step: the step exported; `rank`, the rank whose view was.
        tensors: tensors written (tied tensors count once in a .pt file).
        bytes: checkpoint bytes read and checked.
        skipped: key paths of values left out (safetensors holds tensors only).
        converted: key paths of numpy values written as tensors (.pt and DCP).
    """

    path: str
    format: str
    step: int
    rank: int
    tensors: int
    bytes: int
    skipped: tuple[KeyPath, ...] = ()
    converted: tuple[KeyPath, ...] = ()


def export_format(dest: str | os.PathLike[str], format: str | None = None) -> str:
    """The format `dest` asks for: `format` if given, else by suffix (see the module docstring).

    Raises:
        ValueError: an unknown `format`, or a suffix that names none.
    """
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        return format
    text = os.fspath(dest)
    if text.endswith(".safetensors"):
        return "safetensors"
    if text.endswith((".pt", ".pth")):
        return "pt"
    if text.endswith((os.sep, "/", ".dcp")) or os.path.isdir(text):
        return "dcp"
    raise ValueError(
        f"cannot tell the format of {text!r} from its name: use a .safetensors or .pt file, a directory "
        "(a trailing / or .dcp) for DCP, or name the format"
    )


def export_step(
    location: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    step: int | None = None,
    format: str | None = None,
    prefix: str | None = None,
    rank: int = 0,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> ExportResult:
    """Write committed `step` of the tier at `location` to `dest`, streamed from its shards.

    Args:
        location: a tier root (directory or fsspec URL).
        dest: the file or directory to write; its name picks the format (`export_format`).
        step: the step; the newest committed one if None.
        format: ``"safetensors"``, ``"pt"`` or ``"dcp"``, to override the name's suffix.
        prefix: export only the value at this key path, keys joined with dots (``"model"``,
            ``"model.encoder"``); safetensors names are then relative to it.
        rank: whose view of a multi-rank step (replicated keys included).
        overwrite: replace an existing `dest` (a file, or a directory holding a DCP
            checkpoint); otherwise an existing `dest` is an error.
        storage_options: fsspec options for a URL `location`.
        progress: called as ``progress(done_bytes, total_bytes)`` while shard bytes are read.

    Returns:
        An `ExportResult`.

    Raises:
        NoCheckpointError: `step` (or `prefix`, or `rank`) does not exist.
        StepPrunedError: a NoCheckpointError: the step was deleted while it was read (a
            job's retention beside this export), not damaged; nothing is left at `dest`.
        CheckpointCorruptedError: a byte read differs from its checksum (nothing is left at `dest`).
        UnsupportedStateError: a dtype the format has no name for (safetensors: complex128,
            float8_e8m0fnu; .pt/DCP: numpy float128).
        FileExistsError: `dest` exists and `overwrite` is False.
        ValueError: a format or prefix problem the message names.

    Example:
        >>> export_step("ckpt/run7", "model.safetensors", prefix="model")   # doctest: +SKIP
    """
    fmt = export_format(dest, format)
    target = os.path.abspath(os.fspath(dest).rstrip("/" + os.sep) or os.fspath(dest))
    _check_destination(target, fmt, overwrite)
    tier = tier_at(location, storage_options)
    chosen = choose_step(tier, step)
    view = open_view(tier, chosen, rank)
    base, node = select(view.root, prefix)
    planned = to_safetensors.plan(node, base, chosen) if fmt == "safetensors" else None
    total = _bytes_to_read(node, fmt, planned)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(target)}.tiercheck-tmp-{secrets.token_hex(8)}")
    converted: list[KeyPath] = []
    try:
        with ShardReader(view, progress, total) as reader:
            if planned is not None:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    to_safetensors.write(planned, fd, reader)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                tensors = len(planned.tensors)
            elif fmt == "pt":
                tensors, converted = to_torch.write(node, base, tmp, reader)
            else:
                tensors, converted = to_dcp.write(node, base, tmp, reader)
            reader.finish()  # restore refuses a compressed shard of the wrong length: so does export
            done = reader.done
        _replace(tmp, target)
    except BaseException:
        _remove(tmp)
        raise
    return ExportResult(
        target,
        fmt,
        chosen,
        rank,
        tensors,
        done,
        planned.skipped if planned is not None else (),
        tuple(converted),
    )


def _bytes_to_read(node: Node, fmt: str, planned: to_safetensors.Planned | None) -> int:
    if planned is not None:
        return sum(e.length for _, e in planned.tensors)
    seen: set[tuple[str, int, int]] = set()
    total = 0
    for _, n in walk(node):
        if n.kind not in LEAF_KINDS or n.entry is None:
            continue
        e = n.entry
        region = (e.file, e.offset, e.length)
        # .pt writes tied tensors once; DCP writes each key path (so reads it again).
        if fmt == "pt" and n.kind != "bytes" and e.length and region in seen:
            continue
        seen.add(region)
        total += e.length
    return total


def _check_destination(target: str, fmt: str, overwrite: bool) -> None:
    if not os.path.lexists(target):
        return
    if fmt == "dcp" and os.path.isdir(target) and not os.listdir(target):
        return  # an empty directory made for the export
    if not overwrite:
        raise FileExistsError(f"{target} exists; choose another destination, or replace it (--force, overwrite=True)")
    if os.path.isdir(target) and not (fmt == "dcp" and os.path.isfile(os.path.join(target, ".metadata"))):
        raise FileExistsError(f"{target} is a directory that does not hold a DCP checkpoint: not replaced")


def _replace(tmp: str, target: str) -> None:
    if os.path.isdir(tmp):
        if os.path.lexists(target):
            old = f"{target}.tiercheck-old-{secrets.token_hex(8)}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    else:
        os.replace(tmp, target)


def _remove(tmp: str) -> None:
    if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def describe_result(result: ExportResult) -> dict[str, Any]:
    """`result` as a JSON-ready dict (key paths as lists, dotted names beside them)."""
    return {
        "path": result.path,
        "format": result.format,
        "step": result.step,
        "rank": result.rank,
        "tensors": result.tensors,
        "bytes": result.bytes,
        "skipped": [dotted(p) for p in result.skipped],
        "converted": [dotted(p) for p in result.converted],
    }
