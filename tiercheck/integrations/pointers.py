"""TiercheckIO's pointer files, and the registry of the directories that hold them.

A pointer is the file at a path Lightning saves to: a tiny torch archive naming the store
and step (see `lightning.py`), written atomically (temporary name, fsync, rename). It is
read without unpickling: its own JSON member, at most `_POINTER_MAX` bytes of a regular
file, never a FIFO or device. A step's last pointer going frees the step, so the plugin
keeps the list of every directory it wrote a pointer into in a small file in tier 1
(`PointerDirs`), so a later session knows them too.
"""

from __future__ import annotations

import contextlib
import io as _io
import json
import logging
import os
import secrets
import stat
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NoCheckpointError
from ..tiers.base import Tier
from ..tiers.owned import fsync_dir

logger = logging.getLogger("tiercheck")

POINTER_FORMAT = "tiercheck-lightning-pointer"
FULL = "full"
WEIGHTS_ONLY = "weights-only"  # also the subdirectory of each tier holding that store
STORES = (FULL, WEIGHTS_ONLY)
_POINTER_MAX = 64 << 10  # a pointer is ~1.5 KB; anything larger is not one
_MEMBER = "tiercheck-pointer.json"  # the pointer's own record inside the torch archive
_MEMBER_MAX = 4096
_DIRS_FILE = ".tiercheck-lightning-dirs.json"  # in tier 1: the directories holding pointers
_DIRS_FORMAT = "tiercheck-lightning-dirs"
_DIRS_MAX = 1 << 20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

Ref = tuple[str, int]  # (store, step)


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the store and step it names, and the plugin's tiers (its
    ``local=`` and ``remote=``) when they were a path and a URL."""

    step: int
    store: str = FULL
    local: str | None = None
    remote: str | None = None

    @property
    def ref(self) -> Ref:
        return (self.store, self.step)


def _read_small_regular_file(path: str, limit: int) -> bytes | None:
    """At most `limit` + 1 bytes of the regular file at `path` (through a symlink, as
    Lightning's ``save_last="link"`` makes); None if there is none. A FIFO or device is never
    opened for reading (O_NONBLOCK, then fstat), so it cannot hang the trainer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise NoCheckpointError(f"{path} is a directory, not a tiercheck pointer file") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NoCheckpointError(f"{path} is not a regular file, so not a tiercheck pointer file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _parse_pointer(data: bytes) -> Any:
    """The pointer record in `data`: the JSON member of a torch archive, or (pointers of
    tiercheck 0.x) the file itself as JSON. Never unpickles the archive's ``data.pkl``."""
    if len(data) > _POINTER_MAX:
        return None
    try:
        if data.startswith(b"PK\x03\x04"):
            with zipfile.ZipFile(_io.BytesIO(data)) as archive:
                members = [
                    i for i in archive.infolist() if i.filename.count("/") == 1 and i.filename.endswith("/" + _MEMBER)
                ]
                if len(members) != 1 or members[0].file_size > _MEMBER_MAX:
                    return None
                if members[0].compress_type != zipfile.ZIP_STORED:
                    return None
                data = archive.read(members[0])
        return json.loads(data.decode())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, UnicodeDecodeError, ValueError, RecursionError, EOFError):
        return None


def read_pointer_doc(path: str) -> Pointer | None:
    """What the pointer file at `path` names; None if there is no file there.

    Raises:
        NoCheckpointError: the file is not a tiercheck pointer (e.g. a ``torch.save`` file,
            which tiercheck never unpickles).
    """
    data = _read_small_regular_file(path, _POINTER_MAX)
    if data is None:
        return None
    doc = _parse_pointer(data)
    if (
        not isinstance(doc, dict)
        or doc.get("format") != POINTER_FORMAT
        or type(doc.get("step")) is not int
        or doc["step"] < 0
        or doc.get("store", FULL) not in STORES
    ):
        raise NoCheckpointError(
            f"{path} is not a tiercheck pointer file (a checkpoint saved by another CheckpointIO?); "
            "tiercheck reads only checkpoints it wrote and never unpickles"
        )
    local, remote = doc.get("local"), doc.get("remote")
    return Pointer(
        doc["step"],
        doc.get("store", FULL),
        local if isinstance(local, str) else None,
        remote if isinstance(remote, str) else None,
    )


def read_pointer(path: str) -> int | None:
    """The step the pointer file at `path` names; None if there is no file there.

    Raises:
        NoCheckpointError: the file is not a tiercheck pointer.
    """
    doc = read_pointer_doc(path)
    return None if doc is None else doc.step


def _pointer_bytes(path: str, pointer: Pointer) -> bytes:
    """A torch archive (what ``torch.save`` writes) of a dict of strings and ints that says
    what the file is, plus the pointer record as a JSON member, which is what tiercheck
    reads. Lightning's ``load_from_checkpoint`` reads the version field first and fails
    with the note as its message."""
    note = (
        f"tiercheck: {path} is not a checkpoint but a TiercheckIO pointer to step {pointer.step} "
        f"({pointer.store} store of {pointer.local or pointer.remote}); Lightning bypasses CheckpointIO "
        "in Model.load_from_checkpoint, so load it with "
        "tiercheck.integrations.lightning.load_from_checkpoint(Model, path), or through a Trainer "
        "with plugins=[TiercheckIO(...)] and ckpt_path=path (docs/integrations.md)"
    )
    record = {
        "format": POINTER_FORMAT,
        "version": 2,
        "step": pointer.step,
        "store": pointer.store,
        "local": pointer.local,
        "remote": pointer.remote,
    }
    buf = _io.BytesIO()
    torch.save({"pytorch-lightning_version": note, "tiercheck_pointer": record, "note": note}, buf)
    with zipfile.ZipFile(buf, "a", compression=zipfile.ZIP_STORED) as archive:
        prefix = archive.namelist()[0].split("/", 1)[0]
        archive.writestr(f"{prefix}/{_MEMBER}", json.dumps(record))
    return buf.getvalue()


def _write_atomically(path: str, body: bytes) -> None:
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tiercheck-tmp-{secrets.token_hex(8)}")
    try:
        with open(tmp, "xb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_pointer(path: str, step: int, store: str = FULL, local: str | None = None, remote: str | None = None) -> None:
    """Write the pointer file `path` -> (`store`, `step`) atomically and durably."""
    _write_atomically(path, _pointer_bytes(path, Pointer(step, store, local, remote)))


_FileId = tuple[int, int, int]  # inode, size, mtime: a pointer is replaced by a rename


def refs_in(directory: str, cache: dict[str, tuple[_FileId, Ref | None]] | None = None) -> dict[str, Ref]:
    """Every pointer (``*.ckpt``) in `directory` and what it names; with `cache`, a file
    not changed since it was last read is not read again (every save moving ``last.ckpt``
    asks whether a pointer still names the step it named)."""
    found: dict[str, Ref] = {}
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return found
    for entry in entries:
        if not entry.name.endswith(".ckpt"):
            continue
        ref: Ref | None = None
        with contextlib.suppress(NoCheckpointError, OSError):
            st = entry.stat()
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            known = None if cache is None else cache.get(entry.path)
            if known is not None and known[0] == key:
                ref = known[1]
            else:
                if cache is not None:
                    cache[entry.path] = (key, None)  # not a pointer, unless read as one below
                doc = read_pointer_doc(entry.path)
                ref = None if doc is None else doc.ref
                if cache is not None:
                    cache[entry.path] = (key, ref)
        if ref is not None:
            found[entry.path] = ref
    return found


def pointers_in(directory: str) -> dict[str, int]:
    """Every pointer file (``*.ckpt``) in `directory` and the step it names."""
    return {path: step for path, (_, step) in refs_in(directory).items()}


class PointerDirs:
    """The directories holding this plugin's pointers: those of this session, and (with a
    tier-1 directory, `local`) those recorded there by earlier sessions."""

    def __init__(self, local: str | Tier | None) -> None:
        self._local = local
        self._dirs: set[str] | None = None  # loaded at the first ask
        self._read: dict[str, tuple[_FileId, Ref | None]] = {}  # `refs_in`'s cache

    def _file(self) -> str | None:
        local = self._local
        if isinstance(local, str):
            return os.path.join(local, _DIRS_FILE)
        if isinstance(local, Tier) and local.capabilities.local_files:
            return os.path.join(local.local_dir(), _DIRS_FILE)
        return None  # no tier 1: this session's directories only

    def known(self) -> set[str]:
        if self._dirs is None:
            self._dirs = set()
            path = self._file()
            doc: Any = None
            if path is not None:
                with contextlib.suppress(OSError, NoCheckpointError, ValueError, UnicodeDecodeError, RecursionError):
                    data = _read_small_regular_file(path, _DIRS_MAX)
                    doc = None if data is None or len(data) > _DIRS_MAX else json.loads(data.decode())
            if isinstance(doc, dict) and doc.get("format") == _DIRS_FORMAT and isinstance(doc.get("dirs"), list):
                self._dirs.update(d for d in doc["dirs"] if isinstance(d, str) and os.path.isabs(d))
        return self._dirs

    def remember(self, directory: str) -> None:
        dirs = self.known()
        if directory in dirs:
            return
        dirs.add(directory)
        path = self._file()
        if path is None:
            return
        body = json.dumps({"format": _DIRS_FORMAT, "dirs": sorted(dirs)}).encode() + b"\n"
        try:
            _write_atomically(path, body)
        except OSError as exc:
            logger.warning("tiercheck: cannot record the pointer directory %s in %s: %r", directory, path, exc)

    def names(self, ref: Ref) -> bool:
        """Whether a pointer in any known directory names `ref` (files unchanged since they
        were last read are not read again)."""
        return any(ref in refs_in(d, self._read).values() for d in self.known())

    def unlink_naming(self, store: str, steps: list[int], also: str) -> None:
        """Remove every pointer, in the known directories and `also`, naming one of `steps`
        of `store` (an abandoned branch)."""
        for directory in self.known() | {also}:
            for path, ref in refs_in(directory).items():
                if ref[0] == store and ref[1] in steps:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
