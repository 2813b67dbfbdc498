"""A tier held in a dict: the whole `Tier` contract in one file, without fsspec.

It is the worked example of a third tier (docs/design.md, "Tiers") and a fast store for
tests. Files live in a `DictStore` (path relative to the root -> bytes) that several
`DictTier` objects may share, as processes share a bucket. Like an object store it writes
files in place under the step's name and the marker last, so a cut step is data without a
marker (`stray_steps`), never a listed step. Everything is lost when the store is.

Example:
    >>> store = DictStore()
    >>> ckpt = tiercheck.Checkpointer(remote=DictTier(store))      # doctest: +SKIP
    >>> tiercheck.load(DictTier(store))                            # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import threading

from ..errors import CheckpointCorruptedError
from ..format import naming
from ..tiers.base import Capabilities, ReadableFile, StepWriter, Tier

_ids = itertools.count()


class DictStore:
    """The bytes of one memory tier root: relative path -> bytes, under a lock."""

    def __init__(self, label: str | None = None) -> None:
        self.label = label or f"store-{next(_ids)}"
        self.files: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def put(self, rel: str, data: bytes) -> None:
        with self.lock:
            self.files[rel] = data

    def get(self, rel: str) -> bytes:
        with self.lock:
            try:
                return self.files[rel]
            except KeyError:
                raise FileNotFoundError(rel) from None

    def remove(self, rels: list[str]) -> None:
        with self.lock:
            for rel in rels:
                self.files.pop(rel, None)

    def under(self, prefix: str) -> list[str]:
        with self.lock:
            return [rel for rel in self.files if rel.startswith(prefix)]


class DictTier(Tier):
    """A tier on a `DictStore` (a fresh one if none is given).

    Args:
        store: where the files live; share it between tiers to see the same steps.
        name: the role, "remote" (default) or "local".
    """

    capabilities = Capabilities(strays=True)

    def __init__(self, store: DictStore | None = None, *, name: str = "remote") -> None:
        self.store = store if store is not None else DictStore()
        self.name = name
        self.location = f"mem://{self.store.label}"

    def _rel(self, step: int, name: str) -> str:
        return f"{naming.step_dir_name(step)}/{name}"

    def path_of(self, step: int, name: str | None = None) -> str:
        d = f"{self.location}/{naming.step_dir_name(step)}"
        return d if name is None else f"{d}/{name}"

    def _steps(self) -> tuple[set[int], set[int]]:
        committed: set[int] = set()
        present: set[int] = set()
        for rel in self.store.under(""):
            parts = rel.split("/")
            step = naming.parse_step_dir(parts[0]) if len(parts) == 2 else None
            if step is not None:
                present.add(step)
                if parts[1] == naming.COMMIT_NAME:
                    committed.add(step)
        return committed, present

    def committed_steps(self) -> list[int]:
        return sorted(self._steps()[0])

    def stray_steps(self) -> list[int]:
        committed, present = self._steps()
        return sorted(present - committed)

    def open_step(self, step: int, rank: int, shared: bool = False) -> StepWriter:
        return _MemoryStepWriter(self, step)

    def write_marker(self, step: int, marker: bytes) -> None:
        self.store.put(self._rel(step, naming.COMMIT_NAME), bytes(marker))

    def read_bytes(self, step: int, name: str, limit: int) -> bytes:
        data = self.store.get(self._rel(step, name))
        if len(data) > limit:
            raise CheckpointCorruptedError(f"{self.path_of(step, name)}: larger than the {limit}-byte limit")
        return data

    def open_file(self, step: int, name: str) -> ReadableFile:
        return _MemoryFile(self.path_of(step, name), self.store.get(self._rel(step, name)))

    def delete_step(self, step: int) -> None:
        prefix = f"{naming.step_dir_name(step)}/"
        self.store.remove([prefix + naming.COMMIT_NAME])  # invisible first
        self.store.remove(self.store.under(prefix))

    def remove_leftovers(self) -> list[str]:
        return []  # files are written in place: a cut step is a stray, never a temp name


class _MemoryStepWriter(StepWriter):
    def __init__(self, tier: DictTier, step: int) -> None:
        self._tier = tier
        self._step = step
        self._written: list[str] = []

    def write_file(
        self,
        name: str,
        data: memoryview,
        aligned: bool = False,
        compress: bool = False,
    ) -> int:
        rel = self._tier._rel(self._step, name)
        self._written.append(rel)
        self._tier.store.put(rel, bytes(data))
        return len(data)

    def publish_part(self) -> None:
        return None  # written in place under the step's name

    def commit(self, marker: bytes) -> None:
        self._written.append(self._tier._rel(self._step, naming.COMMIT_NAME))
        self._tier.write_marker(self._step, marker)

    def abort(self) -> None:
        self._tier.store.remove(self._written[::-1])


class _MemoryFile(ReadableFile):
    def __init__(self, path: str, data: bytes) -> None:
        self._path = path
        self._data = data
        self.size = len(data)

    def read_into(self, offset: int, dest: memoryview) -> None:
        if offset < 0 or offset + len(dest) > self.size:
            raise EOFError(f"{self._path}: file ends at byte {self.size}, before byte {offset + len(dest)}")
        dest[:] = self._data[offset : offset + len(dest)]

    def close(self) -> None:
        return None
