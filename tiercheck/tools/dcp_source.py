"""A torch.distributed.checkpoint (DCP) directory read as a hostile input, for `tiercheck import`.

DCP's own reader trusts its ``.metadata``: it opens whatever path an item names (absolute,
``..``, a symlink, a FIFO), reads whatever length it claims, and the structure is used as it
comes (a list index of 10**9 grows a list for minutes). Here nothing of the metadata is used
before all of it is checked, and no byte is read outside the source directory:

- ``.metadata`` is unpickled by Python's own (pure-Python) unpickler restricted to DCP's
  metadata classes: no code runs, and its memo is a dict, so a 9-byte pickle cannot make it
  allocate gigabytes as the C unpickler's memo array does;
- every field is checked for its type and range (`_Plan.of`): chunks inside their tensor,
  covering it exactly; each chunk's item stored in a file, its length what a `torch.save`
  of the chunk takes; list indices below the number of items; paths relative, without
  ``..``;
- every file is opened below the source directory one component at a time with
  ``O_NOFOLLOW`` (so neither a symlink nor a directory link leads out), only if it is a
  regular file (``lstat`` first, then ``fstat`` of the opened descriptor, ``O_NONBLOCK`` so
  that a FIFO cannot block the open), and each item must lie inside the file's real size;
- each tensor item is a ``torch.save`` zip of stored (uncompressed) records, checked before
  ``torch.load(weights_only=True)`` reads it, so it never holds more than the item's bytes.

All of that happens before the destination is touched. Memory: one tensor at a time (a
tensor in several chunks: the tensor and one chunk), never more than the files hold.
"""

from __future__ import annotations

import io
import os
import pickle
import reprlib
import stat
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Any

import torch

from ..errors import CheckpointCorruptedError, NoCheckpointError, UnsupportedStateError
from ..format.dtypes import TORCH_DTYPES
from ..format.tree import MAX_DEPTH

__all__ = ["DcpSource", "one_line", "weights_only_reason"]

MAX_METADATA = 1 << 30
"""Bytes of ``.metadata`` read at most (a 1000-rank checkpoint of a 70B model has ~150 MB)."""

ITEM_SLACK = 1 << 20
"""Bytes a tensor item may hold beyond its data: `torch.save`'s own records (~1.5 KiB)."""

_OVERLAP_BUDGET = 10_000_000  # chunk pairs compared at most when checking that chunks do not overlap

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True, slots=True)
class _Item:
    """Bytes [offset, offset + length) of the file `path` (relative to the source)."""

    path: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    item: _Item | None  # None for a chunk of no elements


@dataclass(frozen=True, slots=True)
class _Tensor:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[_Chunk, ...]


class DcpSource:
    """The DCP directory `src`, checked whole on construction.

    Raises:
        NoCheckpointError: no `src` directory, or no ``.metadata`` in it.
        CheckpointCorruptedError: a field of the metadata of the wrong type or out of range,
            a path leaving `src`, a file that is not a regular file, an item outside its file
            or of a length its chunk cannot have (the message names the file and the field).
        UnsupportedStateError: a pickled global that is not DCP metadata, an item stored with
            a transform (compression), a dtype tiercheck does not store.
    """

    def __init__(self, src: str) -> None:
        self.src = src
        self._meta_path = os.path.join(src, ".metadata")
        try:
            self._root = os.open(src, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise NoCheckpointError(f"{src}: no such directory") from None
        except OSError as exc:
            raise CheckpointCorruptedError(f"{src}: cannot open the DCP directory: {exc.strerror}") from None
        try:
            plan = _Plan.of(self._load_metadata(), self._meta_path)
            self.tensors = plan.tensors
            self.value_items = plan.values
            self.paths = plan.paths
            self.order = plan.order
            self._files = self._check_files(plan)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    # ---------------------------------------------------------------- files

    def _open(self, rel: str) -> int:
        """A descriptor of the regular file `rel` below the source, reached without a link."""
        parts = rel.split("/")
        fd = self._root
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                try:
                    st = os.stat(part, dir_fd=fd, follow_symlinks=False)
                    if last and not stat.S_ISREG(st.st_mode):
                        raise CheckpointCorruptedError(f"{self._where(rel)}: {_kind(st.st_mode)}, not a regular file")
                    nxt = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    raise CheckpointCorruptedError(f"{self._where(rel)}: no such file") from None
                except OSError as exc:
                    raise CheckpointCorruptedError(
                        f"{self._where(rel)}: cannot open it inside the source ({exc.strerror}; "
                        "tiercheck reads only regular files reached without symlinks)"
                    ) from None
                if fd != self._root:
                    os.close(fd)
                fd = nxt
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # swapped between the lstat and the open
                raise CheckpointCorruptedError(f"{self._where(rel)}: {_kind(st.st_mode)}, not a regular file")
            return fd
        except BaseException:
            if fd != self._root:
                os.close(fd)
            raise

    def _where(self, rel: str) -> str:
        return os.path.join(self.src, rel)

    def _load_metadata(self) -> Any:
        try:
            os.stat(".metadata", dir_fd=self._root, follow_symlinks=False)
        except FileNotFoundError:
            raise NoCheckpointError(f"{self.src}: no .metadata: not a DCP checkpoint directory") from None
        fd = self._open(".metadata")
        try:
            size = os.fstat(fd).st_size
            if size > MAX_METADATA:
                raise CheckpointCorruptedError(f"{self._meta_path}: {size} bytes, over the {MAX_METADATA} read at most")
            data = os.pread(fd, size, 0) if size else b""
        finally:
            os.close(fd)
        try:
            return _MetadataUnpickler(io.BytesIO(data)).load()
        except pickle.UnpicklingError as exc:
            raise UnsupportedStateError(f"{self._meta_path}: {exc}") from None
        except Exception as exc:  # a truncated or garbled pickle raises many kinds of error
            raise CheckpointCorruptedError(f"{self._meta_path}: not readable DCP metadata: {exc!r}") from None

    def _check_files(self, plan: _Plan) -> dict[str, tuple[int, int, int]]:
        """(device, inode, size) of each file an item is in, every item checked inside it."""
        files: dict[str, tuple[int, int, int]] = {}
        for rel in sorted({item.path for item in plan.items()}):
            fd = self._open(rel)
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            files[rel] = (st.st_dev, st.st_ino, st.st_size)
        for item in plan.items():
            size = files[item.path][2]
            if item.offset + item.length > size:
                raise CheckpointCorruptedError(
                    f"{self._where(item.path)}: an item at bytes [{item.offset}, {item.offset + item.length}) "
                    f"is past the end of the file ({size} bytes)"
                )
        for fqn, tensor in plan.tensors.items():
            for chunk in tensor.chunks:
                if chunk.item is not None:
                    with self._window(chunk.item) as f:
                        _check_zip(f, chunk.item.length, f"{self._where(chunk.item.path)}: item of {fqn!r}")
                        self._probe(f, fqn, tensor, chunk)
        return files

    def _probe(self, f: IO[bytes], fqn: str, spec: _Tensor, chunk: _Chunk) -> None:
        """Unpickle the item without its data (torch >= 2.5), so that an item that is not the
        chunk it should be is refused before anything is written, not halfway through."""
        skip_data = getattr(torch.serialization, "skip_data", None)
        if skip_data is None:
            return
        f.seek(0)
        with skip_data():
            value = self._torch_load(f, fqn, chunk, "meta")
        self._check_chunk(value, fqn, spec, chunk)

    def _window(self, item: _Item) -> io.BufferedReader:
        fd = self._open(item.path)
        try:
            if hasattr(self, "_files"):  # after the check: the very file that was checked
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino, st.st_size) != self._files[item.path]:
                    raise CheckpointCorruptedError(f"{self._where(item.path)}: changed while it was imported")
            return io.BufferedReader(_Window(fd, item.offset, item.length), 1 << 16)
        except BaseException:
            os.close(fd)
            raise

    # ---------------------------------------------------------------- reading

    def read_values(self) -> dict[str, Any]:
        """The pickled (non-tensor) values, read with ``torch.load(weights_only=True)``."""
        values: dict[str, Any] = {}
        for fqn, item in self.value_items.items():
            with self._window(item) as f:
                data = f.read()
            values[fqn] = self._torch_load(io.BytesIO(data), fqn, item)
        return values

    def tensor(self, fqn: str) -> torch.Tensor:
        """The tensor `fqn`, read chunk by chunk (a chunk covering it whole is returned as read)."""
        spec = self.tensors[fqn]
        stored = [c for c in spec.chunks if c.item is not None]
        if len(stored) == 1 and stored[0].sizes == spec.shape:
            return self._chunk(fqn, spec, stored[0])
        whole = torch.empty(spec.shape, dtype=spec.dtype)
        for chunk in stored:
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            whole[region].copy_(self._chunk(fqn, spec, chunk))
        return whole

    def _chunk(self, fqn: str, spec: _Tensor, chunk: _Chunk) -> torch.Tensor:
        item = chunk.item
        assert item is not None
        with self._window(item) as f:
            _check_crc(f, f"{self._where(item.path)}: item of {fqn!r} at byte {item.offset}")
            value = self._torch_load(f, fqn, chunk)
        return self._check_chunk(value, fqn, spec, chunk)

    def _check_chunk(self, value: object, fqn: str, spec: _Tensor, chunk: _Chunk) -> torch.Tensor:
        item = chunk.item
        assert item is not None
        if not isinstance(value, torch.Tensor) or value.dtype != spec.dtype or tuple(value.shape) != chunk.sizes:
            got = (
                f"a {value.dtype} tensor of shape {list(value.shape)}"
                if isinstance(value, torch.Tensor)
                else (f"a {type(value).__name__}")
            )
            raise CheckpointCorruptedError(
                f"{self._where(item.path)}: the item of {fqn!r} at {list(chunk.offsets)} holds {got}, "
                f"the metadata says a {spec.dtype} chunk of shape {list(chunk.sizes)}"
            )
        return value

    def _torch_load(self, f: IO[bytes], fqn: str, of: _Item | _Chunk, device: str = "cpu") -> Any:
        item = of.item if isinstance(of, _Chunk) else of
        assert item is not None
        where = f"{self._where(item.path)}: item of {fqn!r} at byte {item.offset}"
        try:
            return torch.load(f, map_location=device, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsupportedStateError(
                f"{where}: torch.load(weights_only=True) refused it: {weights_only_reason(exc)}"
            ) from None
        except Exception as exc:
            raise CheckpointCorruptedError(f"{where}: not a readable torch.save item: {one_line(exc)}") from None


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line (torch's run over several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def weights_only_reason(exc: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, without its paragraphs of advice."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().split("\n\n", 1)[0]
        return one_line(ValueError(reason))
    return one_line(exc)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of the descriptor `fd` (owned: closed with the window)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the item")
        self._pos = base + pos
        return self._pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        self._pos += got
        return got

    def close(self) -> None:
        if not self.closed and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        super().close()


def _check_zip(f: io.BufferedReader, length: int, where: str) -> None:
    """`f` is a zip of stored records, all inside its `length` bytes: then `torch.load` holds
    no more than that (a deflated record could inflate a thousandfold)."""
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointCorruptedError(f"{where}: not a torch.save zip: {exc}") from None
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise CheckpointCorruptedError(f"{where}: record {info.filename!r} is compressed (torch.save stores them)")
        total += info.file_size
    if total > length:
        raise CheckpointCorruptedError(f"{where}: its records claim {total} bytes, the item has {length}")


def _check_crc(f: io.BufferedReader, where: str) -> None:
    """Every record of the item against the CRC-32 its zip directory holds, streamed (1 MiB at a
    time), then `f` back at its start. torch.save writes the CRCs and torch.load never checks
    them (nor does DCP, which has no checksums of its own), so without this a flipped byte in
    the source would be imported, checksummed and committed as if it were the saved value."""
    try:
        with zipfile.ZipFile(f) as z:
            for info in z.infolist():
                if info.CRC == 0 and info.file_size > 0:  # written without CRCs (set_crc32_options(False))
                    continue
                with z.open(info) as r:
                    while r.read(1 << 20):
                        pass
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise CheckpointCorruptedError(f"{where}: damaged: {exc}") from None
    f.seek(0)


# ------------------------------------------------------------------ the metadata


class _MetadataUnpickler(pickle._Unpickler):
    """Builds only what DCP's ``.metadata`` holds: its metadata dataclasses, torch sizes,
    dtypes, layouts and memory formats; any other global is refused. Python's own
    unpickler, not the C one: its memo is a dict (a huge memo index costs nothing)."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed_globals()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which is not DCP metadata")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    }
    storage_info = getattr(fs, "_StorageInfo", None)  # where each item's bytes are
    if storage_info is not None:
        allowed[(fs.__name__, "_StorageInfo")] = storage_info
    for name in dir(md):
        obj = getattr(md, name)
        if isinstance(obj, type) and obj.__module__ == md.__name__:
            allowed[(md.__name__, name)] = obj
    return allowed


_MISSING = object()


def _field(obj: object, name: str, where: str) -> Any:
    value = getattr(obj, name, _MISSING)  # an unpickled object may lack any field
    if value is _MISSING:
        raise CheckpointCorruptedError(f"{where}: {type(obj).__name__} has no {name}")
    return value


def _ints(value: object, where: str) -> tuple[int, ...]:
    if type(value) not in (torch.Size, tuple, list) or not all(
        type(x) is int and 0 <= x < 1 << 63
        for x in value  # type: ignore[attr-defined]
    ):
        raise CheckpointCorruptedError(f"{where}: {_show(value)}, not a list of non-negative int64s")
    return tuple(value)  # type: ignore[arg-type]


def _show(value: object) -> str:
    text = _REPR.repr(value)  # bounded in depth and length: a field may be a list nested 10**5 deep
    return f"{type(value).__name__} {text}"


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


@dataclass
class _Plan:
    """What the metadata describes, every field checked."""

    tensors: dict[str, _Tensor]
    values: dict[str, _Item]
    paths: dict[str, tuple[str | int, ...]]
    order: list[str]

    def items(self) -> Iterator[_Item]:
        yield from self.values.values()
        for tensor in self.tensors.values():
            for chunk in tensor.chunks:
                if chunk.item is not None:
                    yield chunk.item

    @classmethod
    def of(cls, meta: object, where: str) -> _Plan:
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            Metadata,
            MetadataIndex,
            TensorStorageMetadata,
        )

        if type(meta) is not Metadata:
            raise CheckpointCorruptedError(f"{where}: holds a {type(meta).__name__}, not DCP Metadata")
        described = _field(meta, "state_dict_metadata", where)
        if not isinstance(described, dict):
            raise CheckpointCorruptedError(f"{where}: state_dict_metadata is a {type(described).__name__}, not a dict")
        storage = _storage(_field(meta, "storage_data", where), where, MetadataIndex)
        tensors: dict[str, _Tensor] = {}
        values: dict[str, _Item] = {}
        for fqn, md in described.items():
            if type(fqn) is not str:
                raise CheckpointCorruptedError(f"{where}: state_dict_metadata has a key {_show(fqn)}, not a str")
            if type(md) is TensorStorageMetadata:
                tensors[fqn] = _tensor(md, storage, f"{where}: {fqn!r}", fqn)
            elif type(md) is BytesStorageMetadata:
                item = storage.get((fqn, None))
                if item is None:
                    raise CheckpointCorruptedError(f"{where}: value {fqn!r} is not in storage_data")
                values[fqn] = item
            else:
                raise CheckpointCorruptedError(f"{where}: {fqn!r} is a {type(md).__name__}, not a DCP item kind")
        paths = _paths(getattr(meta, "planner_data", None), list(described), where)
        return cls(tensors, values, paths, list(described))


def _storage(raw: object, where: str, index_type: type) -> dict[tuple[str, tuple[int, ...] | None], _Item]:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(raw, dict):
        raise CheckpointCorruptedError(f"{where}: storage_data is a {type(raw).__name__}, not a dict")
    out: dict[tuple[str, tuple[int, ...] | None], _Item] = {}
    for key, info in raw.items():
        if type(key) is not index_type:
            raise CheckpointCorruptedError(f"{where}: storage_data has a key {_show(key)}, not a MetadataIndex")
        fqn = _field(key, "fqn", where)
        offset = _field(key, "offset", where)
        if type(fqn) is not str:
            raise CheckpointCorruptedError(f"{where}: storage_data names an item {_show(fqn)}, not a str")
        at = f"{where}: storage_data[{fqn!r}]"
        off = None if offset is None else _ints(offset, f"{at}.offset")
        if type(info) is not _StorageInfo:
            raise CheckpointCorruptedError(f"{at}: a {type(info).__name__}, not a _StorageInfo")
        out[(fqn, off)] = _item(info, at)
    return out


def _item(info: object, at: str) -> _Item:
    path = _field(info, "relative_path", at)
    offset = _field(info, "offset", at)
    length = _field(info, "length", at)
    if type(path) is not str:
        raise CheckpointCorruptedError(f"{at}.relative_path: {_show(path)}, not a str")
    parts = path.split("/")
    if not path or path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
        raise CheckpointCorruptedError(
            f"{at}.relative_path: {path!r} leaves the source directory or is not a plain relative path"
        )
    for name, v in (("offset", offset), ("length", length)):
        if type(v) is not int or v < 0:
            raise CheckpointCorruptedError(f"{at}.{name}: {_show(v)}, not a non-negative int")
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        raise UnsupportedStateError(
            f"{at}: stored with transforms {_show(transforms)}; tiercheck imports only items DCP stored as they are"
        )
    return _Item(path, offset, length)


def _tensor(md: object, storage: Mapping[tuple[str, tuple[int, ...] | None], _Item], at: str, fqn: str) -> _Tensor:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    props = _field(md, "properties", at)
    if type(props) is not TensorProperties:
        raise CheckpointCorruptedError(f"{at}: properties is a {type(props).__name__}, not TensorProperties")
    dtype = _field(props, "dtype", at)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptedError(f"{at}: dtype is {_show(dtype)}, not a torch dtype")
    if dtype not in TORCH_DTYPES.values():
        raise UnsupportedStateError(f"{at}: dtype {dtype}, which tiercheck does not store")
    shape = _ints(_field(md, "size", at), f"{at}: size")
    raw_chunks = _field(md, "chunks", at)
    if not isinstance(raw_chunks, list):
        raise CheckpointCorruptedError(f"{at}: chunks is a {type(raw_chunks).__name__}, not a list")
    chunks: list[_Chunk] = []
    volume = 0
    for i, c in enumerate(raw_chunks):
        cat = f"{at}: chunk {i}"
        if type(c) is not ChunkStorageMetadata:
            raise CheckpointCorruptedError(f"{cat}: a {type(c).__name__}, not ChunkStorageMetadata")
        offsets = _ints(_field(c, "offsets", cat), f"{cat}.offsets")
        sizes = _ints(_field(c, "sizes", cat), f"{cat}.sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CheckpointCorruptedError(
                f"{cat}: offsets {list(offsets)}, sizes {list(sizes)} for shape {list(shape)}"
            )
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise CheckpointCorruptedError(
                f"{cat}: offsets {list(offsets)}, sizes {list(sizes)} reach outside shape {list(shape)}"
            )
        n = _numel(sizes)
        volume += n
        item = None
        if n:
            item = storage.get((fqn, offsets))
            if item is None:
                raise CheckpointCorruptedError(f"{cat}: no storage_data entry for offsets {list(offsets)}")
            need = n * dtype.itemsize
            if not need <= item.length <= need + ITEM_SLACK:
                raise CheckpointCorruptedError(
                    f"{cat}: its item has {item.length} bytes, a {dtype} chunk of shape {list(sizes)} "
                    f"takes {need} (+ at most {ITEM_SLACK} of torch.save's own)"
                )
        chunks.append(_Chunk(offsets, sizes, item))
    if volume != _numel(shape):
        raise CheckpointCorruptedError(
            f"{at}: its chunks hold {volume} elements, shape {list(shape)} has {_numel(shape)}"
        )
    _no_overlap([c for c in chunks if c.item is not None], at)
    return _Tensor(shape, dtype, tuple(chunks))


def _no_overlap(chunks: list[_Chunk], at: str) -> None:
    """No two chunks share an element (with the element count equal to the tensor's, the
    chunks then cover it exactly): a sweep along the first dimension."""
    if len(chunks) < 2:
        return
    order = sorted(chunks, key=lambda c: c.offsets[0])
    active: list[_Chunk] = []
    budget = _OVERLAP_BUDGET
    for c in order:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        budget -= len(active)
        if budget < 0:
            raise CheckpointCorruptedError(f"{at}: too many chunks overlapping in their first dimension to check")
        for a in active:
            if all(
                ao < co + cs and co < ao + as_
                for ao, as_, co, cs in zip(a.offsets, a.sizes, c.offsets, c.sizes, strict=True)
            ):
                raise CheckpointCorruptedError(f"{at}: chunks at {list(a.offsets)} and {list(c.offsets)} overlap")
        active.append(c)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _paths(raw: object, fqns: list[str], where: str) -> dict[str, tuple[str | int, ...]]:
    """Each item's key path in the nested state (DCP's ``planner_data``), checked: str keys
    and list indices below the number of items (a list holds one item per index at least),
    at most `MAX_DEPTH` deep, no path repeated or below another."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CheckpointCorruptedError(f"{where}: planner_data is a {type(raw).__name__}, not a dict")
    limit = len(fqns)
    wanted = set(fqns)
    paths: dict[str, tuple[str | int, ...]] = {}
    for fqn, path in raw.items():
        if fqn not in wanted:
            continue
        at = f"{where}: planner_data[{fqn!r}]"
        if type(path) not in (tuple, list) or not 1 <= len(path) <= MAX_DEPTH:
            raise CheckpointCorruptedError(f"{at}: {_show(path)}, not a key path of 1 to {MAX_DEPTH} keys")
        if type(path[0]) is not str:
            raise CheckpointCorruptedError(f"{at}: starts with {_show(path[0])}, not a str key")
        for key in path:
            if type(key) is str:
                continue
            if type(key) is not int or not 0 <= key < limit:
                raise CheckpointCorruptedError(
                    f"{at}: key {_show(key)} is neither a str nor a list index in [0, {limit})"
                )
        paths[fqn] = tuple(path)
    return paths
