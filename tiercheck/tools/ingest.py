"""`tiercheck import`: turn a `torch.save` file, a safetensors file or a DCP directory into a
committed tiercheck step, in the very format `Checkpointer.save` writes (`step_writer`).

No code from the input runs: `torch.save` files are read with ``weights_only=True``; a DCP
directory's ``.metadata`` (a pickle) is read by an unpickler that only builds DCP's own
metadata classes, and its pickled values with ``torch.load(weights_only=True)``.

Streamed: the step is written tensor by tensor in 8 MiB chunks, never gathered in memory.
Peak memory, beyond the chunk (benchmarks/tools/export_memory.py has the measurements):

- safetensors: nothing more; the structure comes from the header and each tensor's bytes
  are read from the file with ``pread`` as they are written;
- `torch.save` zip files (the default format since torch 1.6): loaded with ``mmap=True``, so
  tensors are mapped from the file, not read; each chunk's pages are dropped from the
  mapping once written (Linux), so they do not pile up in the process's memory. A tensor
  that is not contiguous is copied whole first. Legacy (non-zip) `torch.save` files cannot
  be mapped: they are read whole, so an import of one needs the file's size in memory;
- DCP directories: checked whole first (`dcp_source`, as a hostile input: DCP's own reader
  opens any path its metadata names); then tensors are read one at a time, each chunk with
  ``torch.load(weights_only=True)`` (a tensor in several chunks: the tensor and one chunk).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import json
import mmap
import os
import pickle
import stat
import sys
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    CheckpointCorruptedError,
    InvalidArgumentError,
    NoCheckpointError,
    StepConflictError,
    UnsupportedStateError,
)
from ..format import naming
from ..format.dtypes import TORCH_DTYPES
from ..format.tree import MAX_DEPTH
from ..observe.progress import ProgressCallback
from ..state.flatten import flatten_state
from ..tiers.local import LocalTier
from ..tiers.open import open_default_tier
from .dcp_source import DcpSource, one_line, weights_only_reason
from .step_writer import BLOCK, Chunk, memory_chunks, write_step
from .to_safetensors import MAX_HEADER, SAFETENSORS_DTYPES

__all__ = ["SOURCE_FORMATS", "ImportResult", "import_step", "source_format"]

SOURCE_FORMATS = ("pt", "safetensors", "dcp")


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What `import_step` committed: `step` at `location`, from `source` in `format`, holding
    `tensors` tensors of `bytes` bytes under the top-level `keys`."""

    source: str
    format: str
    location: str
    step: int
    tensors: int
    bytes: int
    keys: tuple[str | int, ...]


def source_format(source: str | os.PathLike[str], format: str | None = None) -> str:
    """`format` if given, else: a directory is DCP, a file starting like a safetensors header
    is safetensors, anything else a `torch.save` file.

    Raises:
        NoCheckpointError: `source` does not exist.
        InvalidArgumentError: `source` is not a regular file or directory (a FIFO, a device).
        ValueError: an unknown `format`.
    """
    if format is not None:
        if format not in SOURCE_FORMATS:
            raise ValueError(f"format must be one of {SOURCE_FORMATS}, got {format!r}")
        return format
    path = os.fspath(source)
    if os.path.isdir(path):
        return "dcp"
    fd = _open_source_file(path)
    try:
        return _format_of(fd)
    finally:
        os.close(fd)


def _format_of(fd: int) -> str:
    head = os.pread(fd, 9, 0)
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < (100 << 20):
        return "safetensors"
    return "pt"


def import_step(
    source: str | os.PathLike[str],
    location: str | os.PathLike[str],
    step: int,
    *,
    format: str | None = None,
    prefix: str | None = None,
    int_keys: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: ProgressCallback | None = None,
) -> ImportResult:
    """Save the contents of `source` as committed `step` of the tier at `location`, streamed
    (see the module docstring for the memory each format needs).

    Args:
        source: a `torch.save` file, a safetensors file, or a DCP checkpoint directory.
        location: the tier root to write (a directory, or an fsspec URL for tier 2).
        step: the step number; it must be newer than every step already committed there.
        format: ``"pt"``, ``"safetensors"`` or ``"dcp"`` instead of guessing (`source_format`).
        prefix: put the contents under this key (dotted: ``"a.b"`` nests two levels), e.g.
            ``"model"`` for a safetensors file of a model, so ``restore({"model": model})``
            finds it. Required when a `torch.save` file holds something other than a dict.
        int_keys: turn dict keys that are decimal integers into ints. DCP stores every key as
            a string, including the int keys of an optimizer's ``state``, which
            ``Optimizer.load_state_dict`` needs back as ints.
        storage_options: fsspec options for a URL `location`.
        progress: called as ``progress(done_bytes, total_bytes)`` as the step's bytes are
            written (tied tensors count once).

    Returns:
        An `ImportResult`.

    Raises:
        NoCheckpointError: `source` does not exist.
        CheckpointCorruptedError: `source` is not a readable file of its format.
        UnsupportedStateError: `source` holds something tiercheck cannot store (the key path
            is named), or that ``weights_only=True`` refuses to unpickle.
        StepConflictError: `step` is not newer than the committed steps at `location`.
        DirectoryInUseError: a `Checkpointer` writes the directory `location`.

    Example:
        >>> import_step("last.pt", "ckpt/run7", step=12000)                 # doctest: +SKIP
        >>> import_step("model.safetensors", "ckpt/hf", 0, prefix="model")  # doctest: +SKIP
    """
    if type(step) is not int or step < 0:
        raise UnsupportedStateError(f"step must be a non-negative int, got {step!r}")
    src = os.fspath(source)
    sources = _Sources()
    try:
        fmt, state = _read_source(src, format, sources)
        return _commit(src, fmt, state, sources, location, step, prefix, int_keys, storage_options, progress)
    finally:
        sources.close()


def _read_source(src: str, format: str | None, sources: _Sources) -> tuple[str, Any]:
    """The source's format and state; a file is opened once, checked to be a regular file,
    and read only through that descriptor (`_fd_path`), never reopened by its name."""
    if format is not None:
        source_format(src, format)  # checks the name
    if format == "dcp" or (format is None and os.path.isdir(src)):
        return "dcp", _read_dcp(src, sources)
    fd = _open_source_file(src)
    sources.closers.append(functools.partial(os.close, fd))
    fmt = format or _format_of(fd)
    if fmt == "pt":
        return fmt, _read_torch(src, _fd_path(fd, src), sources)
    return fmt, _read_safetensors(src, fd, sources)


def _open_source_file(path: str) -> int:
    """A descriptor of the regular file at `path` (a symlink to one is followed: a user's
    own link, e.g. a Hugging Face cache's). ``O_NONBLOCK`` so that a FIFO cannot block the
    open; the type is checked before opening (opening a device can act on it) and after."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                return fd
            os.close(fd)
    except FileNotFoundError:
        raise NoCheckpointError(f"{path}: no such file or directory") from None
    raise InvalidArgumentError(
        f"{path}: {'a directory' if stat.S_ISDIR(st.st_mode) else 'not a regular file'}; "
        "tiercheck imports regular files (and DCP directories)"
    )


def _fd_path(fd: int, path: str) -> str:
    """A name for the already-checked open file `fd`, for readers that want a path (its
    name could be pointed elsewhere after the check): /proc/self/fd/N where there is one."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else path


def _commit(
    src: str,
    fmt: str,
    state: Any,
    sources: _Sources,
    location: str | os.PathLike[str],
    step: int,
    prefix: str | None,
    int_keys: bool,
    storage_options: Mapping[str, Any] | None,
    progress: ProgressCallback | None,
) -> ImportResult:
    if prefix:
        for key in reversed(prefix.split(".")):
            state = {key: state}
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"{src}: holds a {type(state).__name__}, not a dict; name the key to save it under (prefix)"
        )
    if int_keys:
        state = _int_keys(state, src)
    flat = flatten_state(state)  # first: it refuses a state nested too deep for the walks below
    tensors, nbytes = _count_tensors(state)
    keys = tuple(state)
    loc = os.fspath(location)
    tier = open_default_tier(loc, storage_options)
    # As a Checkpointer's first save: the one writer of the directory (a running job's
    # Checkpointer holds it: DirectoryInUseError), its leftovers swept.
    locks = tier.capabilities.writer_lock
    root = tier.root if isinstance(tier, LocalTier) else None
    created = root is not None and not os.path.lexists(root)
    if locks:
        tier.claim_writer(0, 1)
    try:
        committed = tier.committed_steps()
        if committed and step <= committed[-1]:
            raise StepConflictError(
                f"cannot import as step {step}: step {committed[-1]} is already committed "
                f"({tier.path_of(committed[-1])}); steps must increase, choose a step after {committed[-1]}"
            )
        write_step(tier, step, flat, lambda i: sources.chunks(flat.sources[i]), progress=progress)
    except BaseException:
        if locks:
            tier.release_writer()
        if created and root is not None:
            _remove_created(root)
        raise
    if locks:
        tier.release_writer()
    return ImportResult(src, fmt, loc, step, tensors, nbytes, keys)


def _remove_created(root: str) -> None:
    """Remove the directory a failed import created (its step was aborted): its lock file,
    if it is still the regular, unlinked file the import made, then the directory if nothing
    else is in it. Nothing else is touched, so a file someone put there meanwhile stays."""
    lock = os.path.join(root, naming.lock_name(0))
    try:
        st = os.lstat(lock)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            os.unlink(lock)
        os.rmdir(root)
    except OSError:
        pass


class _Sources:
    """Where each leaf's bytes come from when the step is written.

    A format whose tensors are read only when written (safetensors, DCP) puts a stand-in in
    the state: a one-element tensor of the right dtype expanded to the right shape, which
    `flatten_state` describes exactly (dtype, shape, bytes) without the bytes existing; its
    reader is found by the stand-in's storage. Any other value is read from memory, with
    `release` called on each chunk's addresses once written (a mapped `torch.save` file)."""

    def __init__(self) -> None:
        self._lazy: dict[int, Callable[[], Iterator[Chunk]]] = {}
        self.release: Callable[[int, int], None] | None = None
        self.closers: list[Callable[[], None]] = []  # the source's open files, closed after the import

    def close(self) -> None:
        while self.closers:
            self.closers.pop()()

    def stand_in(self, dtype: torch.dtype, shape: tuple[int, ...], read: Callable[[], Iterator[Chunk]]) -> torch.Tensor:
        t = torch.empty((), dtype=dtype).expand(shape)
        self._lazy[t.untyped_storage().data_ptr()] = read
        return t

    def chunks(self, source: object) -> Iterator[Chunk]:
        if isinstance(source, torch.Tensor) and self._lazy:
            read = self._lazy.get(source.untyped_storage().data_ptr())
            if read is not None:
                return read()
        return memory_chunks(source, BLOCK, self.release)


def _pread_chunks(fd: int, path: str, offset: int, n: int) -> Iterator[Chunk]:
    """Bytes [offset, offset + n) of the open file `fd` (named `path`), in chunks of one reused buffer."""
    if n == 0:
        return
    buf = bytearray(min(n, BLOCK))
    view = memoryview(buf)
    pos = 0
    while pos < n:
        k = min(len(buf), n - pos)
        got = os.preadv(fd, [view[:k]], offset + pos)
        if got <= 0:
            raise CheckpointCorruptedError(f"{path}: file ends at byte {offset + pos}, expected {offset + n}")
        yield view[:got]
        pos += got


def _count_tensors(state: object) -> tuple[int, int]:
    if isinstance(state, torch.Tensor):
        return 1, state.numel() * state.element_size()
    items: Any = state.values() if isinstance(state, Mapping) else state if isinstance(state, (list, tuple)) else ()
    count = size = 0
    for v in items:
        c, s = _count_tensors(v)
        count += c
        size += s
    return count, size


def _int_keys(value: object, src: str, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise UnsupportedStateError(f"{src}: the state is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, Mapping):
        return {_as_int(k): _int_keys(v, src, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_int_keys(v, src, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(_int_keys(v, src, depth + 1) for v in value)
    return value


def _as_int(k: object) -> object:
    if isinstance(k, str) and k.lstrip("-").isdigit() and str(int(k)) == k:
        return int(k)
    return k


# ------------------------------------------------------------------ torch.save


def _read_torch(src: str, path: str, sources: _Sources) -> Any:
    """`src` read through `path`, the name of its checked open descriptor."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # a legacy (non-zip) file cannot be mapped: read it whole
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsupportedStateError(
            f"{src}: torch.load(weights_only=True) refused it (tiercheck never unpickles code): "
            f"{weights_only_reason(exc)}"
        ) from None
    except FileNotFoundError:
        raise NoCheckpointError(f"{src}: no such file") from None
    except Exception as exc:  # a damaged zip or pickle raises many kinds of error
        raise CheckpointCorruptedError(f"{src}: not a readable torch.save file: {one_line(exc)}") from None
    if _native_byte_order(path):
        sources.release = _MappedPages.of(path)
    return state


def _native_byte_order(src: str) -> bool:
    """Whether torch.load left the mapped pages of zip file `src` as they are in the file: it
    swaps the bytes of a file of the other byte order in place (so the pages are private
    copies, which must not be dropped)."""
    try:
        with zipfile.ZipFile(src) as z:
            names = [n for n in z.namelist() if n.endswith("/byteorder") and n.count("/") == 1]
            order = z.read(names[0]).decode() if names else "little"
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError):
        return False
    return order == sys.byteorder


class _MappedPages:
    """Drops the pages of a mapped file from this process once they are written out.

    ``torch.load(mmap=True)`` maps the file privately; reading a tensor faults its pages in,
    and they stay in the process (and its RSS) until the mapping goes, at the end of the
    import: the whole file. Those pages are clean copies of the file (torch writes to them
    only to swap byte order, see `_native_byte_order`), so ``madvise(MADV_DONTNEED)`` drops
    them and a later read faults them in again from the file, unchanged. Only addresses
    inside this file's mappings (from /proc/self/maps) are ever touched."""

    def __init__(self, ranges: list[tuple[int, int]], madvise: Any, advice: int) -> None:
        self._ranges = ranges
        self._madvise = madvise
        self._advice = advice
        self._page = mmap.PAGESIZE

    @classmethod
    def of(cls, path: str) -> Callable[[int, int], None] | None:
        """`release(lo, hi)` for the current mappings of `path`, or None where there is no
        /proc/self/maps or madvise (not Linux): the pages then stay until the import ends."""
        dont_need = getattr(mmap, "MADV_DONTNEED", None)
        if dont_need is None:
            return None
        try:
            st = os.stat(path)
            with open("/proc/self/maps") as f:
                lines = f.readlines()
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return None
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        ranges = []
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or not fields[1].endswith("p"):  # private mappings only
                continue
            major, minor = (int(x, 16) for x in fields[3].split(":"))
            if int(fields[4]) == st.st_ino and (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((lo, hi))
        if not ranges:
            return None
        return cls(ranges, madvise, dont_need).release

    def release(self, lo: int, hi: int) -> None:
        lo -= lo % self._page
        hi += -hi % self._page
        for start, end in self._ranges:
            a, b = max(lo, start), min(hi, end)
            if a < b:
                self._madvise(a, b - a, self._advice)  # a failure only leaves the pages in place


# ------------------------------------------------------------------ safetensors

# safetensors dtype -> torch dtype, the inverse of the export's table (plus E8M0, which
# tiercheck stores though it does not export it)
_FROM_SAFETENSORS = {st: TORCH_DTYPES[name] for name, st in SAFETENSORS_DTYPES.items() if name in TORCH_DTYPES}
if "float8_e8m0fnu" in TORCH_DTYPES:
    _FROM_SAFETENSORS["F8_E8M0"] = TORCH_DTYPES["float8_e8m0fnu"]


def _read_safetensors(src: str, fd: int, sources: _Sources) -> dict[str, torch.Tensor]:
    """`src` read through its checked open descriptor `fd`."""
    from safetensors import SafetensorError, safe_open  # optional dependency: tiercheck[safetensors]

    try:
        # safe_open checks the header (its size, nesting, JSON) and the offsets, in Rust
        with safe_open(_fd_path(fd, src), framework="pt", device="cpu") as f:
            names = list(f.keys())
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if n > MAX_HEADER:
            raise ValueError(f"header of {n} bytes")
        header = json.loads(os.pread(fd, n, 8))
    except FileNotFoundError:
        raise NoCheckpointError(f"{src}: no such file") from None
    except (SafetensorError, OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptedError(f"{src}: not a readable safetensors file: {exc}") from None
    start = 8 + n
    state: dict[str, torch.Tensor] = {}
    for name in names:
        info = header.get(name)
        if not isinstance(info, dict):
            raise CheckpointCorruptedError(f"{src}: tensor {name!r} is not described in the header")
        dtype = _FROM_SAFETENSORS.get(info.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise UnsupportedStateError(
                f"{src}: tensor {name!r} has safetensors dtype {info.get('dtype')!r}, which tiercheck does not store"
            )
        shape = tuple(info["shape"])
        begin, end = info["data_offsets"]
        if end - begin != dtype.itemsize * _numel(shape):
            raise CheckpointCorruptedError(f"{src}: tensor {name!r}: {end - begin} bytes for shape {list(shape)}")
        read = functools.partial(_pread_chunks, fd, src, start + begin, end - begin)
        state[name] = sources.stand_in(dtype, shape, read)
    return state


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------ DCP


def _read_dcp(src: str, sources: _Sources) -> dict[str, Any]:
    """The nested state of the DCP directory `src`, its tensors as stand-ins read when written;
    the whole directory is checked first (`dcp_source`), before anything is written."""
    source = DcpSource(src)
    sources.closers.append(source.close)
    values = source.read_values()  # the plain values (pickled by DCP): small, read now
    nested: dict[str, Any] = {}
    placed = _Placed()
    for fqn in source.order:
        spec = source.tensors.get(fqn)
        if spec is not None:
            value: object = sources.stand_in(spec.dtype, spec.shape, functools.partial(_tensor_chunks, source, fqn))
        else:
            value = values[fqn]
        path = source.paths.get(fqn, (fqn,))
        placed.claim(path, f"{src}/.metadata")
        _set_path(nested, path, value, f"{src}/.metadata")
    return nested


def _tensor_chunks(source: DcpSource, fqn: str) -> Iterator[Chunk]:
    return memory_chunks(source.tensor(fqn), BLOCK)


class _Placed:
    """The key paths already given a value: a path repeated, or one below another's value,
    would silently replace a value (or put one inside it)."""

    def __init__(self) -> None:
        self._leaves: set[tuple[Any, ...]] = set()
        self._inner: set[tuple[Any, ...]] = set()

    def claim(self, path: tuple[Any, ...], where: str) -> None:
        if path in self._leaves or path in self._inner or any(path[:i] in self._leaves for i in range(1, len(path))):
            raise CheckpointCorruptedError(f"{where}: planner data puts two values at or below {list(path)}")
        self._leaves.add(path)
        self._inner.update(path[:i] for i in range(1, len(path)))


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: object, where: str) -> None:
    """DCP's unflattening (its `set_element`): str keys are dict keys, ints list indices
    (`dcp_source` bounds them by the number of items, and `_Placed` keeps paths apart)."""
    container: Any = root
    for key, nxt in itertools.pairwise(path):
        _check_key(container, key, path, where)
        empty: Any = [] if type(nxt) is int else {}
        if isinstance(container, list):
            while len(container) <= key:
                container.append(None)
            if container[key] is None:
                container[key] = empty
        elif key not in container:
            container[key] = empty
        container = container[key]
        if not isinstance(container, (dict, list)):
            raise CheckpointCorruptedError(f"{where}: planner data nests a value below another value at {list(path)}")
    _check_key(container, path[-1], path, where)
    if isinstance(container, list):
        while len(container) <= path[-1]:
            container.append(None)
    container[path[-1]] = value


def _check_key(container: object, key: object, path: tuple[Any, ...], where: str) -> None:
    if isinstance(container, list) != (type(key) is int):
        raise CheckpointCorruptedError(
            f"{where}: planner data indexes a {type(container).__name__} with {key!r} at {list(path)}"
        )
