"""The interface every tier implements.

A tier is a blocking byte store rooted at one location. Calls come from one
background worker per tier (writes, deletions) and from the caller's thread
(listing, reads during restore); implementations must allow a listing or read
concurrently with a write of a *different* step.

Writing one step, a worker calls, in this order::

    w = tier.open_step(step, rank)
    w.write_file(shard_name, data, aligned)   # once per shard file
    w.write_file(manifest_name, data)
    w.commit(marker_bytes)                    # the step becomes visible here, atomically
    # or, on any error before commit:
    w.abort()                                 # removes everything this writer created

After `commit` returns, the step is durable: a crash at any later instant leaves it
listed and readable. Before `commit` returns, `committed_steps()` never lists it.

In a multi-rank job, every rank writes its own files and calls ``w.publish_part()``
instead of `commit`: the part is then durable under the step's name, still without a
marker. Once every rank's part is there, one rank per directory calls
``tier.write_marker(step, marker_bytes)``.

Optional capabilities are declared in `Tier.capabilities` (a `Capabilities` value), never
guessed from a method that silently does nothing: a caller checks the flag before it calls
`check_space`, `stray_steps`, `claim_writer`/`release_writer`, `local_dir` or `local_file`,
and the base class raises `NotImplementedError` for a capability the tier does not declare.
`path_of` is for messages only; `local_file` is the one path that may be opened.

A new tier subclasses `Tier` and `StepWriter` in one module, declares its capabilities,
and passes the conformance suite `tiercheck.testing.conformance` (see docs/design.md,
"Tiers"); `tiercheck.testing.dicttier` is a complete example in one file.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a tier can do beyond the required methods; callers check these flags.

    Attributes:
        space_check: `check_space` tells whether a step fits (a filesystem with statvfs).
            Without it every write is attempted and a full store fails the write itself.
        strays: `stray_steps` lists step names that hold data but no marker (a cut upload or
            deletion, or the parts of a multi-rank step that never committed), so retention
            can finish deleting them. Without it such data stays, invisible.
        writer_lock: `claim_writer`/`release_writer` make one process the writer of a rank's
            part of the tier and sweep that writer's leftovers. Without it two writers of one
            root are not detected (object stores), and a tier must leave no leftovers.
        local_files: the tier is a directory of this machine's filesystem: `local_dir()` is
            its root and `local_file(step, name)` the real path of a committed step's file,
            which the uploader reads from directly (else it reads through `open_file`).
        deferred_reclaim: `delete_step` hides a step at once and can leave freeing its bytes
            to a background thread (`set_reclaimer`, `reclaim`): unlinking a multi-GB file
            takes seconds on ext4, which must not delay the next step's durability.
        rank_parts: `delete_step` hides the step (marker first) but removes only the part of
            the rank this tier object writes, so every rank prunes its own part (tier 0,
            whose shards are live host buffers of each rank's process), not one leader.
        prefetch: `prefetch` of an `open_file` file makes the store start fetching those
            bytes ahead of the reads (a local filesystem: into the page cache), so a
            restore asks for its own shard while it decodes the manifest and binds the
            template (`steps.catalog.ShardPrefetch`). Without it nothing is asked.
    """

    space_check: bool = False
    strays: bool = False
    writer_lock: bool = False
    local_files: bool = False
    deferred_reclaim: bool = False
    rank_parts: bool = False
    prefetch: bool = False


def _undeclared(tier: Tier, method: str, flag: str) -> NotImplementedError:
    return NotImplementedError(
        f"tier {tier.name!r} ({type(tier).__name__}) has no {method}(): it does not declare "
        f"capabilities.{flag}; check the flag before calling"
    )


class StepWriter(ABC):
    """Writes one step's files on a tier; see the module docstring for the call order."""

    @abstractmethod
    def write_file(
        self,
        name: str,
        data: memoryview,
        aligned: bool = False,
        compress: bool = False,
    ) -> int:
        """Write the whole file `name` of this step and return the bytes stored.

        `aligned` promises that `data` starts on a page boundary and its length is a
        multiple of 4096 (O_DIRECT may be used). `compress` allows the tier to store the
        file with its `codec` (shard files only; the stored size is then returned)."""

    def write_chunks(
        self, name: str, chunks: Callable[[], Iterator[bytes | memoryview]], nbytes: int, compress: bool = False
    ) -> int:
        """Write file `name` from the `nbytes` bytes `chunks()` yields (called again to retry);
        this default gathers them and calls `write_file`."""
        data = bytearray()
        for c in chunks():
            data += c
        if len(data) != nbytes:
            raise ValueError(f"{name}: got {len(data)} bytes, expected {nbytes}")
        return self.write_file(name, memoryview(data), compress=compress)

    def write_from_path(self, name: str, local_path: str, compress: bool = False) -> int:
        """Write file `name` with the contents of the local file `local_path` (streamed
        where the tier can; this default maps the file and calls `write_file`)."""
        import mmap

        with open(local_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return self.write_file(name, memoryview(b""), compress=compress)
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    return self.write_file(name, view, compress=compress)
                finally:
                    view.release()

    @abstractmethod
    def commit(self, marker: bytes) -> None:
        """Write the commit marker last and make the step visible; durable on return."""

    @abstractmethod
    def publish_part(self) -> None:
        """Multi-rank: make this rank's files durable under the step's final name, without
        a marker. A store that writes files in place (object stores) has nothing left to do
        and says so in its implementation."""

    @abstractmethod
    def abort(self) -> None:
        """Remove whatever this writer created; never raises."""


class ReadableFile(ABC):
    """A positional reader over one file of a committed step."""

    size: int
    # Whether `read_into` may run on several threads at once (a positional read of a file
    # descriptor: no state between calls); a decoder or a remote reader keeps state.
    concurrent: bool = False

    @abstractmethod
    def read_into(self, offset: int, dest: memoryview) -> None:
        """Fill `dest` with the bytes at `offset`; raises EOFError if the file is short."""

    def prefetch(self, offset: int, n: int) -> None:
        """Ask the store to start fetching bytes [offset, offset + n) for reads to come, and
        return without waiting for them: a hint that reads nothing into this process and
        never fails (`Capabilities.prefetch`). By default it does nothing."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class Tier(ABC):
    """A store of committed steps under one root."""

    name: str  # "local" or "remote": the role it plays in a Checkpointer
    location: str  # the root, as the user gave it
    codec: str = "raw"  # how shard files written with compress=True are stored
    capabilities: Capabilities = Capabilities()  # the optional methods it implements

    @abstractmethod
    def committed_steps(self) -> list[int]:
        """Steps whose commit marker exists, ascending. O(1) listings of the root."""

    def stray_steps(self) -> list[int]:
        """Step names holding data but no commit marker: a deletion or an upload that a
        crash cut short, the parts of a multi-rank step that never committed. Capability
        `strays`."""
        raise _undeclared(self, "stray_steps", "strays")

    def check_space(self, step: int, nbytes: int) -> None:
        """Raise OSError(ENOSPC) naming the shortfall if `nbytes` cannot fit. Capability
        `space_check`."""
        raise _undeclared(self, "check_space", "space_check")

    @abstractmethod
    def open_step(self, step: int, rank: int, shared: bool = False) -> StepWriter:
        """A writer for this rank's files of `step`; `shared` when other ranks write parts of
        the same step (then `publish_part` + `write_marker` replace `commit`)."""

    @abstractmethod
    def write_marker(self, step: int, marker: bytes) -> None:
        """Multi-rank: write the commit marker of `step`, whose parts are all durable; the step
        is visible and durable on return. Writing the same bytes twice is harmless."""

    @abstractmethod
    def read_bytes(self, step: int, name: str, limit: int) -> bytes:
        """The whole (small) file `name` of `step`; raises CheckpointCorruptedError if it
        is larger than `limit` bytes and FileNotFoundError if it is missing."""

    @abstractmethod
    def open_file(self, step: int, name: str) -> ReadableFile: ...

    @abstractmethod
    def delete_step(self, step: int) -> None:
        """Make `step` invisible first (marker), then delete its data. Crash-safe."""

    @abstractmethod
    def remove_leftovers(self) -> list[str]:
        """Delete temp/trash entries that this library's naming rules recognise; return them."""

    def claim_writer(self, rank: int, world_size: int) -> list[str]:
        """Become the one writer of `rank`'s part of this tier until `release_writer()` or the
        end of the process, then remove the leftovers that writer owns; return their paths.
        Called before a session first writes; reading never calls it. Raises
        DirectoryInUseError when another live writer holds it. Capability `writer_lock`."""
        raise _undeclared(self, "claim_writer", "writer_lock")

    def release_writer(self) -> None:
        """Give up what `claim_writer` took; idempotent. Capability `writer_lock`."""
        raise _undeclared(self, "release_writer", "writer_lock")

    def set_reclaimer(
        self, reclaimer: Callable[[str], None] | None, between: Callable[[], None] | None = None
    ) -> None:
        """From now on `delete_step` hides a step and passes what is left to free (an opaque
        token) to `reclaimer`, which must call `reclaim(token)` later, on any thread; None:
        free it inline again. `reclaim` calls `between()` between its paced pieces (the
        pipeline holds it back while a save copies). Capability `deferred_reclaim`."""
        raise _undeclared(self, "set_reclaimer", "deferred_reclaim")

    def reclaim(self, token: str) -> None:
        """Free what a deferred `delete_step` left (paced; never raises). Capability
        `deferred_reclaim`."""
        raise _undeclared(self, "reclaim", "deferred_reclaim")

    def local_dir(self) -> str:
        """The tier's root as a real directory of this machine. Capability `local_files`."""
        raise _undeclared(self, "local_dir", "local_files")

    def local_file(self, step: int, name: str) -> str:
        """The real path of file `name` of committed `step`, to be opened and read (the
        uploader streams tier-1 files to tier 2 from it). Capability `local_files`."""
        raise _undeclared(self, "local_file", "local_files")

    @abstractmethod
    def path_of(self, step: int, name: str | None = None) -> str:
        """A human-readable path for messages only: never opened (see `local_file`)."""
