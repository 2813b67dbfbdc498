"""`tiercheck import`: turn a `torch.save` file, a safetensors file or a DCP directory into a
committed tiercheck step, through `Checkpointer.save` (so the format, the checksums and the
commit marker are the library's own).

No code from the input runs: `torch.save` files are read with ``weights_only=True``; a DCP
directory's ``.metadata`` (a pickle) is read by an unpickler that only builds DCP's own
metadata classes, and its pickled values with ``torch.load(weights_only=True)``.

Memory: `Checkpointer.save` copies the whole state into one host buffer, so an import
needs about the checkpoint's size in memory, plus: nothing for safetensors and `torch.save`
zip files (their tensors are mapped from the file, read as the copy goes), the whole
checkpoint again for legacy (non-zip) `torch.save` files and for DCP directories (their
tensors are read into memory before the copy).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import layout
from ..checkpointer import Checkpointer
from ..errors import CheckpointCorruptedError, NoCheckpointError, UnsupportedStateError
from ..handle import WaitTimeoutError
from ..progress import ProgressCallback
from .to_dcp import dcp_call

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
        ValueError: an unknown `format`.
    """
    if format is not None:
        if format not in SOURCE_FORMATS:
            raise ValueError(f"format must be one of {SOURCE_FORMATS}, got {format!r}")
        return format
    path = os.fspath(source)
    if os.path.isdir(path):
        return "dcp"
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except FileNotFoundError:
        raise NoCheckpointError(f"{path}: no such file or directory") from None
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
    """Save the contents of `source` as committed `step` of the tier at `location`.

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
        progress: called as ``progress(done_bytes, total_bytes)`` while a local tier writes
            the step (the copy into host memory before it is not counted).

    Returns:
        An `ImportResult`.

    Raises:
        NoCheckpointError: `source` does not exist.
        CheckpointCorruptedError: `source` is not a readable file of its format.
        UnsupportedStateError: `source` holds something tiercheck cannot store (the key path
            is named), or that ``weights_only=True`` refuses to unpickle.
        StepConflictError: `step` is not newer than the committed steps at `location`.

    Example:
        >>> import_step("last.pt", "ckpt/run7", step=12000)                 # doctest: +SKIP
        >>> import_step("model.safetensors", "ckpt/hf", 0, prefix="model")  # doctest: +SKIP
    """
    src = os.fspath(source)
    fmt = source_format(src, format)
    if fmt == "pt":
        state = _read_torch(src)
    elif fmt == "safetensors":
        state = _read_safetensors(src)
    else:
        state = _read_dcp(src)
    if prefix:
        for key in reversed(prefix.split(".")):
            state = {key: state}
    if not isinstance(state, Mapping):
        raise UnsupportedStateError(
            f"{src}: holds a {type(state).__name__}, not a dict; name the key to save it under (prefix)"
        )
    if int_keys:
        state = _int_keys(state)
    tensors, nbytes = _count_tensors(state)
    keys = tuple(state)
    loc = os.fspath(location)
    remote = "://" in loc
    ckpt = Checkpointer(
        local=None if remote else loc, remote=loc if remote else None, storage_options=storage_options, keep_local=None
    )
    with ckpt:
        handle = ckpt.save(step, state)
        del state  # the host buffer holds the step now; the input's memory can go
        _await(handle, None if remote else loc, step, nbytes, progress)
    return ImportResult(src, fmt, loc, step, tensors, nbytes, keys)


def _await(handle: Any, root: str | None, step: int, total: int, progress: ProgressCallback | None) -> None:
    """Wait for the step, reporting the bytes the local tier has written so far."""
    if progress is None or root is None:
        handle.wait()
        return
    while True:
        try:
            handle.wait(timeout=0.2)
            break
        except WaitTimeoutError:
            progress(min(_written(root, step), total), total)
    progress(total, total)


def _written(root: str, step: int) -> int:
    """Bytes in the temporary directories of `step` at `root` (layout.tmp_dir_name)."""
    prefix = layout.TMP_PREFIX + layout.step_dir_name(step) + "-"
    n = 0
    try:
        with os.scandir(root) as it:
            for entry in it:
                if entry.name.startswith(prefix) and layout.is_leftover(entry.name):
                    for f in os.scandir(entry.path):
                        n += f.stat(follow_symlinks=False).st_size
    except OSError:  # the directory was renamed into place while listed
        pass
    return n


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


def _int_keys(value: object) -> Any:
    if isinstance(value, Mapping):
        return {_as_int(k): _int_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_int_keys(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_int_keys(v) for v in value)
    return value


def _as_int(k: object) -> object:
    if isinstance(k, str) and k.lstrip("-").isdigit() and str(int(k)) == k:
        return int(k)
    return k


# ------------------------------------------------------------------ torch.save


def _read_torch(src: str) -> Any:
    try:
        try:
            return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):  # a legacy (non-zip) file cannot be mapped: read it whole
                raise
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsupportedStateError(
            f"{src}: torch.load(weights_only=True) refused it (tiercheck never unpickles code): {exc}"
        ) from None
    except FileNotFoundError:
        raise NoCheckpointError(f"{src}: no such file") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointCorruptedError(f"{src}: not a readable torch.save file: {exc}") from None


# ------------------------------------------------------------------ safetensors


def _read_safetensors(src: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open  # optional dependency: tiercheck[safetensors]

    try:
        with safe_open(src, framework="pt", device="cpu") as f:
            # get_tensor maps the file: bytes are read when save() copies them
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except FileNotFoundError:
        raise NoCheckpointError(f"{src}: no such file") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointCorruptedError(f"{src}: not a readable safetensors file: {exc}") from None


# ------------------------------------------------------------------ DCP


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's ``.metadata`` holds: its metadata dataclasses, torch sizes,
    dtypes, layouts and memory formats, and paths; any other global is refused."""

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


def _read_dcp_metadata(path: str) -> Any:
    meta_path = os.path.join(path, ".metadata")
    try:
        with open(meta_path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise NoCheckpointError(f"{path}: no .metadata: not a DCP checkpoint directory") from None
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise UnsupportedStateError(f"{meta_path}: {exc}") from None
    except Exception as exc:  # a truncated or garbled pickle raises many kinds of error
        raise CheckpointCorruptedError(f"{meta_path}: not readable DCP metadata: {exc!r}") from None


def _read_dcp(src: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import ReadItem
    from torch.distributed.checkpoint.state_dict_loader import load

    raw = _read_dcp_metadata(src)
    if not isinstance(raw, Metadata):
        raise CheckpointCorruptedError(f"{src}/.metadata: holds a {type(raw).__name__}, not DCP Metadata")
    metadata: Metadata = raw

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return metadata  # read once, by the restricted unpickler

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsupportedStateError(
                    f"{src}: value {read_item.dest_index.fqn!r}: torch.load(weights_only=True) refused it: {exc}"
                ) from None

    flat: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        elif isinstance(md, BytesStorageMetadata):
            flat[fqn] = None
        else:
            raise CheckpointCorruptedError(f"{src}/.metadata: unknown item kind {type(md).__name__} for {fqn!r}")
    with dcp_call():
        planner = SafePlanner(flatten_state_dict=False)
        load(flat, storage_reader=SafeReader(src), planner=planner, no_dist=True)
    loaded = {fqn: planner.state_dict.get(fqn, value) for fqn, value in flat.items()}  # values land in its copy
    paths = metadata.planner_data or {}
    nested: dict[str, Any] = {}
    for fqn, value in loaded.items():
        _set_path(nested, tuple(paths.get(fqn, (fqn,))), value)
    return nested


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: object) -> None:
    """DCP's unflattening (its `set_element`): str keys are dict keys, ints list indices."""
    container: Any = root
    for key, nxt in itertools.pairwise(path):
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
            raise CheckpointCorruptedError(f"DCP planner data nests a value below another value at {list(path)}")
    if isinstance(container, list):
        while len(container) <= path[-1]:
            container.append(None)
    container[path[-1]] = value
