"""The catalog of a tier: which steps are committed, their markers and manifests, each
checked against its checksum; `ShardFiles`, the one opener of a step's shard files; and
`verify_files`, which checks every byte of a step's shards through it.

Restore, `load`, the tools, both uploaders (a damaged tier-1 copy is never spread) and the
command line all read steps through here.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import CheckpointCorruptedError, NoCheckpointError, StepPrunedError
from ..format import naming
from ..format.checksum import ALGORITHMS, checksum_function, checksum_stream, feed_regions
from ..format.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    Marker,
    ShardFile,
    decode_key,
    decode_manifest,
    decode_marker,
)
from ..format.tree import JsonNode
from ..observe.progress import ProgressCallback
from ..tiers.base import ReadableFile, StepWriter, Tier
from ..tiers.codec import ZstdFile

__all__ = [
    "MAX_MARKER_BYTES",
    "READERS",
    "READ_CHUNK",
    "MissingManifestError",
    "ReplicaResolver",
    "ShardFiles",
    "ShardPrefetch",
    "in_order",
    "list_committed",
    "present_manifests",
    "pruned_while_read",
    "read_manifest",
    "read_manifest_with_bytes",
    "read_marker",
    "read_marker_and_guess",
    "reading_committed",
    "shard_files",
    "verify_files",
]

MAX_MARKER_BYTES = 128 << 20  # ~100 bytes per rank, up to the format's 2^20 ranks
READ_CHUNK = 32 << 20
READERS = max(1, min(4, os.cpu_count() or 1))  # threads reading a local shard at once (`ShardFiles.concurrent`)
COPY_BLOCK = 8 << 20  # bytes per read when a shard is copied through the opener
GUESS_MANIFEST_BYTES = 8 << 20  # a guessed manifest is fetched only if smaller (~200 bytes per tensor)


_T = TypeVar("_T")


def in_order(fn: Callable[..., _T], calls: Iterable[tuple[Any, ...]], threads: int, name: str) -> Iterator[_T]:
    """`fn(*args)` of each of `calls` on `threads` threads (named `name`), at most twice as
    many submitted and not yet done; the results in the order of `calls`. A failure is raised
    here, after what had not started is cancelled and what had has ended: once this returns
    or raises, no thread of it writes into the caller's memory (the reads of a restore land
    in the template)."""
    out: deque[Future[_T]] = deque()
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    try:
        for args in calls:
            if len(out) >= 2 * threads:
                yield out.popleft().result()
            out.append(pool.submit(fn, *args))
        while out:
            yield out.popleft().result()
    finally:
        for fut in out:
            fut.cancel()
        pool.shutdown(wait=True)


class MissingManifestError(CheckpointCorruptedError):
    """A committed step's marker lists a manifest this tier does not hold (on a node-local
    directory: another node's rank)."""


def read_marker(tier: Tier, step: int) -> Marker:
    """Read and check the commit marker of `step`."""
    where = tier.path_of(step, naming.COMMIT_NAME)
    try:
        marker = decode_marker(tier.read_bytes(step, naming.COMMIT_NAME, MAX_MARKER_BYTES), where)
    except FileNotFoundError:
        raise NoCheckpointError(f"step {step} is not committed on tier {tier.name!r} ({where})") from None
    if marker.step != step:
        raise CheckpointCorruptedError(f"{where}: marker is for step {marker.step}, directory for step {step}")
    if marker.checksum_algorithm not in ALGORITHMS:
        raise CheckpointCorruptedError(f"{where}: unknown checksum algorithm {marker.checksum_algorithm!r}")
    return marker


def read_marker_and_guess(tier: Tier, step: int, rank: int, world_size: int | None) -> tuple[Marker, bytes | None]:
    """`read_marker`, and the bytes of the manifest `rank` of a `world_size`-rank job (None:
    the fewest ranks that have `rank`) saved, fetched beside the marker (None when not
    fetched or not there), for `read_manifest`.

    On tier 2 each read is a round trip of its own, and the manifest's name and length are
    known only from the marker: read one after the other, a fresh-node restore pays two
    round trips before its first byte of tensor data. The guess costs one request when
    wrong (a job of another size); its bytes count only if they are the file the marker
    names and match its checksum (`read_manifest` reads again otherwise)."""
    world = rank + 1 if world_size is None else world_size
    if not 0 <= rank < world or tier.capabilities.local_files:
        return read_marker(tier, step), None  # a local read takes microseconds: no thread for it
    guess = naming.manifest_name(rank, world)
    with ThreadPoolExecutor(1, thread_name_prefix="tiercheck-manifest") as pool:
        early = pool.submit(tier.read_bytes, step, guess, GUESS_MANIFEST_BYTES)
        marker = read_marker(tier, step)
        if not 0 <= rank < marker.world_size or marker.manifests[rank].file != guess:
            early.cancel()
            return marker, None
        try:
            return marker, early.result()
        except Exception:  # missing, too large, unreadable: the read after the marker says why
            return marker, None


def read_manifest(
    tier: Tier, step: int, rank: int, marker: Marker | None = None, guessed: bytes | None = None
) -> Manifest:
    """Read and verify one rank's manifest of `step` against the commit marker (`guessed`:
    bytes `read_marker_and_guess` fetched, used if they match the marker)."""
    return read_manifest_with_bytes(tier, step, rank, marker, guessed)[1]


class ReplicaResolver:
    """The one rule for a replica node, which every reader applies (restore, `load`, the
    tools): the rank it points at reads and verifies, lists the key as replicated, and holds
    the value itself. Anything else is corruption naming that rank's manifest and the key.

    `manifests` (rank -> manifest, the reading rank's included) is shared with the caller:
    each owner's manifest is read once, on first reference, and added to it.
    """

    def __init__(self, tier: Tier, step: int, marker: Marker, manifests: dict[int, Manifest]) -> None:
        self._tier = tier
        self._step = step
        self._marker = marker
        self.manifests = manifests
        self._held: dict[int, dict[tuple[str, ...], JsonNode]] = {}

    def resolve(self, key: Sequence[str], owner_rank: int, referrer: int) -> tuple[Manifest, JsonNode]:
        """The owner's manifest and its node for the top-level `key` rank `referrer` refers to it for."""
        if owner_rank not in self._held:
            if owner_rank not in self.manifests:
                self.manifests[owner_rank] = read_manifest(self._tier, self._step, owner_rank, self._marker)
            self._held[owner_rank] = _held_replicated(self.manifests[owner_rank])
        owner = self.manifests[owner_rank]
        node = self._held[owner_rank].get(tuple(key))
        if node is None:
            where = self._tier.path_of(self._step, naming.manifest_name(owner.rank, owner.world_size))
            raise CheckpointCorruptedError(
                f"{where}: does not hold the replicated key {decode_key(list(key))!r} that rank {referrer} refers to"
            )
        return owner, node


def _held_replicated(owner: Manifest) -> dict[tuple[str, ...], JsonNode]:
    """The owner's top-level values it lists as replicated and holds itself (not a replica)."""
    listed = set(owner.replicated)
    return {
        tuple(k): v
        for k, v in zip(owner.tree["k"], owner.tree["v"], strict=True)
        if tuple(k) in listed and v["t"] != "replica"
    }


def read_manifest_with_bytes(
    tier: Tier, step: int, rank: int, marker: Marker | None = None, guessed: bytes | None = None
) -> tuple[bytes, Manifest]:
    """`read_manifest`, with the bytes it decoded (those the marker's checksum covers)."""
    if marker is None:
        marker = read_marker(tier, step)
    if not 0 <= rank < marker.world_size:
        raise NoCheckpointError(f"step {step} on tier {tier.name!r} has {marker.world_size} ranks, no rank {rank}")
    ref = marker.manifests[rank]
    mwhere = tier.path_of(step, ref.file)
    if ref.length > MAX_MANIFEST_BYTES:
        raise CheckpointCorruptedError(f"{mwhere}: manifest claims {ref.length} bytes")
    checksum = checksum_function(marker.checksum_algorithm)

    def matches(data: bytes) -> bool:
        return len(data) == ref.length and checksum(data) == ref.checksum

    if guessed is not None and matches(guessed):
        data = guessed
    else:
        try:
            data = tier.read_bytes(step, ref.file, ref.length)
        except FileNotFoundError:
            raise MissingManifestError(
                f"{mwhere}: manifest is missing from a committed step (a node-local directory holds only "
                "the parts of the ranks that share it: read it with one of their ranks)"
            ) from None
        if not matches(data):
            raise CheckpointCorruptedError(f"{mwhere}: manifest does not match the checksum in its commit marker")
    manifest = decode_manifest(data, mwhere)
    if (manifest.step, manifest.rank, manifest.world_size) != (step, rank, marker.world_size):
        raise CheckpointCorruptedError(
            f"{mwhere}: manifest names step/rank/world {manifest.step}/{manifest.rank}/{manifest.world_size}"
        )
    if manifest.checksum_algorithm != marker.checksum_algorithm:
        raise CheckpointCorruptedError(
            f"{mwhere}: checksum algorithm {manifest.checksum_algorithm!r}, marker says {marker.checksum_algorithm!r}"
        )
    return data, manifest


def present_manifests(tier: Tier, step: int, marker: Marker, ranks: Iterable[int] | None = None) -> Iterator[Manifest]:
    """The manifests of `ranks` (default: every rank of the step) that this tier holds, each
    verified against the marker, lowest rank first; a node-local directory holds only the
    parts of the ranks that share it."""
    for r in range(marker.world_size) if ranks is None else ranks:
        try:
            yield read_manifest(tier, step, r, marker)
        except MissingManifestError:
            continue


def first_present_manifest(tier: Tier, step: int, marker: Marker) -> Manifest:
    """The lowest rank's manifest this tier holds: any rank's view holds the replicated keys."""
    manifest = next(present_manifests(tier, step, marker), None)
    if manifest is None:
        raise CheckpointCorruptedError(f"{tier.path_of(step)}: no manifest of any rank is present")
    return manifest


class ShardFiles:
    """The one shard opener: the shard files of committed `step` on `tier`, open for reading
    their bytes as the manifest declares them. Every reader of shard bytes goes through it
    (restore, `load`, `verify_files`, the tools, both uploaders); `tests/steps/test_read_path.py`
    checks that no other module opens a shard.

    Each file is opened once (two manifests naming one file must agree on it); a missing
    file, or one whose size on the tier is not the manifest's, is corrupted before a byte is
    read; a zstd shard is decompressed (`codec.ZstdFile`) and `check_ends` checks it holds
    exactly its declared bytes; a short read is corrupted. A failure of any of these while
    the step's marker is gone is raised as `StepPrunedError` (`reading_committed`).
    Use as a context manager: every file is closed on exit.
    """

    def __init__(self, tier: Tier, step: int, files: Iterable[ShardFile]) -> None:
        self.tier = tier
        self.step = step
        self.listed: dict[str, ShardFile] = {}
        self._files: dict[str, ReadableFile] = {}
        try:
            with reading_committed(tier, step):
                for sf in files:
                    self._open(sf)
        except BaseException:
            self.close()
            raise

    def _open(self, sf: ShardFile) -> None:
        path = self.tier.path_of(self.step, sf.name)
        if sf.name in self.listed:
            if self.listed[sf.name] != sf:
                raise CheckpointCorruptedError(f"{path}: manifests of step {self.step} disagree on this file's size")
            return
        self.listed[sf.name] = sf
        try:
            raw = self.tier.open_file(self.step, sf.name)
        except FileNotFoundError:
            raise CheckpointCorruptedError(f"{path}: shard file is missing") from None
        self._files[sf.name] = raw
        if raw.size != sf.size_on_tier:
            raise CheckpointCorruptedError(f"{path}: shard file is {raw.size} bytes, manifest says {sf.size_on_tier}")
        if sf.codec == "zstd":
            self._files[sf.name] = ZstdFile(raw, sf.length, path)

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()

    def read_into(self, name: str, offset: int, dest: memoryview) -> None:
        """Fill `dest` with the (decoded) bytes of shard `name` from `offset`."""
        with reading_committed(self.tier, self.step):
            try:
                self._files[name].read_into(offset, dest)
            except EOFError as exc:
                raise CheckpointCorruptedError(str(exc)) from None

    def concurrent(self, name: str) -> bool:
        """Whether `read_into` of shard `name` may run on several threads at once."""
        return self._files[name].concurrent

    def read(self, name: str, offset: int, n: int) -> bytes:
        """`n` (decoded) bytes of shard `name` from `offset`."""
        buf = bytearray(n)
        self.read_into(name, offset, memoryview(buf))
        return bytes(buf)

    def check_ends(self) -> None:
        """Raise CheckpointCorruptedError unless every compressed shard decompresses to
        exactly its declared length (a raw one's size was checked at open)."""
        with reading_committed(self.tier, self.step):
            for f in self._files.values():
                if isinstance(f, ZstdFile):
                    f.check_end()

    def verified_chunks(self, name: str, manifest: Manifest, buf: memoryview | None = None) -> Iterator[memoryview]:
        """The whole of shard `name`, front to back through `buf` (default: a fresh buffer of
        up to `READ_CHUNK` bytes), every entry of `manifest` in it checked against its
        checksum as its last byte passes: a chunk completing an entry is yielded only once
        the entry matched, and the last one only once the shard held exactly its bytes.
        Each chunk is valid until the next is asked for."""
        sf = self.listed[name]
        path = self.tier.path_of(self.step, name)
        regions = sorted({(e.offset, e.length): e.checksum for e in manifest.entries if e.file == name}.items())
        hashers = [checksum_stream(manifest.checksum_algorithm) for _ in regions]
        if buf is None:
            buf = memoryview(bytearray(min(READ_CHUNK, sf.length)))
        first = 0  # regions before this one are complete
        for pos in range(0, sf.length, max(len(buf), 1)):
            n = min(len(buf), sf.length - pos)
            self.read_into(name, pos, buf[:n])
            first, completed = feed_regions(regions, hashers, first, pos, buf[:n])
            for i in completed:
                (off, length), expected = regions[i]
                if hashers[i].hexdigest() != expected:
                    raise CheckpointCorruptedError(
                        f"step {self.step}: {path}: checksum mismatch in bytes {off}..{off + length}"
                    )
            if pos + n == sf.length:
                self._check_end(name)
            yield buf[:n]
        if sf.length == 0:
            self._check_end(name)

    def _check_end(self, name: str) -> None:
        f = self._files[name]
        if isinstance(f, ZstdFile):
            with reading_committed(self.tier, self.step):
                f.check_end()

    def copy_to(self, writer: StepWriter, name: str) -> int:
        """Write the (decoded) bytes of shard `name` through `writer`, compressed if its tier
        compresses; return the bytes stored. Not verified: the caller ran `verify_files`."""
        sf = self.listed[name]
        if sf.codec == "raw" and self.tier.capabilities.local_files:  # the tier streams from the file
            return writer.write_from_path(name, self.tier.local_file(self.step, name), compress=True)

        def chunks() -> Iterator[bytes]:
            for pos in range(0, sf.length, COPY_BLOCK):
                yield self.read(name, pos, min(COPY_BLOCK, sf.length - pos))

        return writer.write_chunks(name, chunks, sf.length, compress=True)


def shard_files(tier: Tier, step: int, manifests: Iterable[Manifest]) -> tuple[ShardFile, ...]:
    """Every shard file `manifests` name, once, in order; two manifests naming one file
    must agree on it (the rule `ShardFiles` applies)."""
    listed: dict[str, ShardFile] = {}
    for sf in (sf for m in manifests for sf in m.files):
        if listed.setdefault(sf.name, sf) != sf:
            raise CheckpointCorruptedError(
                f"{tier.path_of(step, sf.name)}: manifests of step {step} disagree on this file's size"
            )
    return tuple(listed.values())


PREFETCH_ADVICE = 8 << 20  # bytes asked ahead at a time (a kernel reads at most its readahead window per advice)
PREFETCH_MIN = 64 << 20  # a shard's first bytes asked ahead, at least ...
PREFETCH_MAX = 1 << 30  # ... and at most
PREFETCH_PER_MANIFEST_BYTE = 64  # ~what a disk of 2 GB/s reads while a manifest byte is decoded (~30 ns)
PREFETCH_FROM = 64 << 10  # manifest bytes (~300 leaves) below which nothing is asked ahead


def prefetch_bytes(manifest_length: int) -> int:
    """How much of its shard a rank asks ahead while it decodes a manifest of this length:
    nothing for a manifest decoded in a few milliseconds (under `PREFETCH_FROM` bytes), which
    leaves the disk nothing to hide behind, while starting and joining the helper thread cost
    a 1-leaf restore 0.7 ms (1.08 against 0.41 ms, warm)."""
    if manifest_length < PREFETCH_FROM:
        return 0
    return min(PREFETCH_MAX, max(PREFETCH_MIN, PREFETCH_PER_MANIFEST_BYTE * manifest_length))


class ShardPrefetch:
    """The first `nbytes` of shard file `name` of committed `step`, asked of the tier ahead of
    the reads (`ReadableFile.prefetch`) on a helper thread while the caller decodes the
    manifest and binds the template: on a local disk the kernel reads them into the page
    cache meanwhile, so the reads that follow wait less for the disk (a cold restore of
    1,000 tensors of 16 KiB: docs/performance.md, "The disk works while the manifest is
    decoded"). Only where the tier declares `Capabilities.prefetch` (tier 1; tier 0 is
    memory already, tier 2 has no page cache to fill), and for `name` None, not at all.

    A hint, never a read: the file is opened through the tier like every shard (no link
    followed, a regular file only), no byte comes into this process, and any failure
    (missing, replaced, not a regular file) is ignored: the reads that follow, through
    `ShardFiles`, report it. `stop()` (or leaving the `with` block) ends the asking and
    waits for the thread, so none outlives the read.
    """

    def __init__(self, tier: Tier, step: int, name: str | None, nbytes: int) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if name is None or nbytes <= 0 or not tier.capabilities.prefetch:
            return
        thread = threading.Thread(
            target=self._run, args=(tier, step, name, nbytes), name="tiercheck-prefetch", daemon=True
        )
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: the restore reads as it would without the hint
            return
        self._thread = thread

    def _run(self, tier: Tier, step: int, name: str, nbytes: int) -> None:
        try:
            f = tier.open_file(step, name)
        except Exception:  # the reads that follow say what is wrong with it
            return
        try:
            end = min(nbytes, f.size)
            for pos in range(0, end, PREFETCH_ADVICE):
                if self._stop.is_set():
                    return
                f.prefetch(pos, min(PREFETCH_ADVICE, end - pos))
        except Exception:
            return
        finally:
            with contextlib.suppress(Exception):
                f.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> ShardPrefetch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def verify_files(tier: Tier, step: int, manifest: Manifest, progress: ProgressCallback | None = None) -> None:
    """Check every entry's checksum by streaming each shard file through one reused buffer
    (no allocation per tensor): what the uploader runs before copying a step to tier 2, so a
    damaged tier-1 copy is never spread. `progress(done, total)` counts the shard bytes read.

    Raises:
        CheckpointCorruptedError: a shard is missing, short, or an entry's bytes differ.
        StepPrunedError: that, but the step is no longer committed: deleted meanwhile.
    """
    buf = memoryview(bytearray(min(READ_CHUNK, max((sf.length for sf in manifest.files), default=0))))
    total = sum(sf.length for sf in manifest.files)
    done = 0
    with ShardFiles(tier, step, manifest.files) as shards:
        for sf in manifest.files:
            for chunk in shards.verified_chunks(sf.name, manifest, buf):
                if progress is not None:
                    done += len(chunk)
                    progress(done, total)


def pruned_while_read(tier: Tier, step: int, failure: BaseException) -> StepPrunedError | None:
    """After a read of committed `step` failed with `failure`: a `StepPrunedError` if the step
    is no longer committed there (deleted meanwhile: the bytes the read saw change or end
    were a deletion's, not damage), else None (the failure stands).

    A reader beside a running job (`tiercheck verify`, an evaluation script) meets this when
    the job's retention deletes the step it is reading: tier 1 hides the step (one rename,
    marker included) before its shard is truncated or overwritten, and tier 2 deletes the
    marker first, so a step whose bytes went is one whose marker went first.
    """
    if isinstance(failure, StepPrunedError):
        return failure
    try:
        read_marker(tier, step)
    except NoCheckpointError:
        return StepPrunedError(
            f"step {step} on tier {tier.name!r} ({tier.path_of(step)}) was deleted while it was read "
            f"(a job's retention, or tiercheck prune/rm), not damaged; the read saw: {failure}",
            step=step,
        )
    except Exception:  # the tier cannot answer now: nothing shows the step went
        return None
    return None


@contextlib.contextmanager
def reading_committed(tier: Tier, step: int) -> Iterator[None]:
    """Run a read of committed `step`: a failure of it (missing, short or altered bytes, a
    marker or manifest gone) is raised as `StepPrunedError` when the step is no longer
    committed on `tier` (`pruned_while_read`), else as it was."""
    try:
        yield
    except (CheckpointCorruptedError, OSError) as exc:  # NoCheckpointError is an OSError
        pruned = pruned_while_read(tier, step, exc)
        if pruned is None or pruned is exc:
            raise
        raise pruned from exc


def list_committed(tiers: Sequence[Tier]) -> dict[int, list[Tier]]:
    """Committed steps and the tiers holding each, fastest tier first.

    A tier that cannot be listed (object store down) is skipped with a warning as long as
    another tier answers; if none does, the first error is raised.
    """
    holders: dict[int, list[Tier]] = {}
    failures: list[BaseException] = []
    for tier in tiers:
        try:
            steps = tier.committed_steps()
        except Exception as exc:
            failures.append(exc)
            warnings.warn(
                f"tiercheck: cannot list tier {tier.name!r} ({tier.location}): {exc!r}", RuntimeWarning, stacklevel=3
            )
            continue
        for s in steps:
            holders.setdefault(s, []).append(tier)
    if failures and len(failures) == len(tiers):
        raise failures[0]
    return holders
