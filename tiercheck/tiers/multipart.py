"""Several requests in flight per file: parallel multipart uploads and ranged reads.

One connection to an object store moves ~50-100 MB/s; a node reaches GB/s only with many
requests in flight. This module holds what the remote tier (`remote.py`) needs for that:

- `part_size_for` (pure): the part size that keeps a file of any size under the store's
  part-count limit, and spreads a small file over the connections;
- `MultipartStore`: the calls one backend offers to upload an object in parts, one small
  class per backend (`S3Parts`, `AzureBlocks`, `GCSCompose`); `store_for(fs)` picks it,
  or None for stores that take a plain stream (local files, ``memory://``);
- `PartSource`: where the parts come from (host memory, a tier-1 file, a chunk stream);
- `upload_parts`: sends a source's parts with at most `concurrency` in flight, each part
  retried on its own, and aborts the upload on any failure;
- `RangeReader`: positional reads of one object with concurrent ranged reads, the next
  bytes fetched ahead meanwhile.

Threads: `upload_parts` runs a pool of at most `concurrency` threads for the duration of
one call and joins it before it returns; a `RangeReader` keeps one such pool while its file
is open. Every request goes through the tier's `call` (retry with backoff, and a deadline
per attempt), so a hung server fails within the retry budget plus one attempt's deadline,
as a single request does.

Memory: an upload holds at most `concurrency` parts at a time, so at most
``concurrency x part_size`` bytes beyond the host buffer (parts of the host buffer are
slices of it: no bytes at all, except on S3, whose client takes only ``bytes``/``bytearray``
bodies, so a slice is copied once while it is sent). The S3 client (aiohttp) makes up to
two more copies of each part it is sending. A read holds its pieces while they are copied
into place, and the bytes it fetched ahead (see `RangeReader`).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import queue
import re
import secrets
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
logger = logging.getLogger("tiercheck")

MiB = 1 << 20
MIN_PART = 1 * MiB  # smaller parts cost more in requests than they gain
# Ranged reads: each request pays a round trip and the server's first-byte time, so larger
# pieces waste less of a connection (S3 advises 8-16 MB); but the reader waits for a whole
# piece on one connection, so smaller ones keep it moving. A 256 MiB restore through a 25
# MB/s x 20 ms shaped link (tests/helpers/servers/shapingproxy.py, 2 runs on 2026-12-01) reached
# 0.51x the link limit with pieces up to 16 MiB, 0.74-0.78x with pieces up to 4 or 8 MiB.
# A file is cut into pieces of one size (`read_piece_size`), at most about MAX_READ_PIECE.
MIN_READ_PIECE = 1 * MiB
MAX_READ_PIECE = 8 * MiB
PIECE_ALIGN = 64 << 10


class Call(Protocol):
    """The tier's way to run one request: retried on transient errors within the retry
    budget (until `stop()` says to give up), each attempt abandoned after its deadline
    (which grows with `nbytes`)."""

    def __call__(
        self, what: str, fn: Callable[[], T], nbytes: int = 0, stop: Callable[[], bool] | None = None
    ) -> T: ...


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """What one object store allows for a multipart upload.

    Attributes:
        max_parts: parts per object.
        min_part: bytes of every part but the last.
        max_part: bytes of one part.
    """

    max_parts: int
    min_part: int
    max_part: int


S3_LIMITS = StoreLimits(max_parts=10_000, min_part=5 * MiB, max_part=5 << 30)
AZURE_LIMITS = StoreLimits(max_parts=50_000, min_part=1, max_part=4000 * MiB)
# Compose takes 32 sources per request; two levels (32 x 32) bound an object to 1024 parts.
GCS_LIMITS = StoreLimits(max_parts=1024, min_part=1, max_part=5 << 40)


def part_size_for(nbytes: int, block_size: int, concurrency: int, limits: StoreLimits) -> int:
    """Bytes per part for a file of `nbytes`: `block_size`, or less for a small file so that
    each of the `concurrency` connections gets a part (never under 1 MiB or the store's
    minimum), or more for a huge one so that the parts stay within the store's count
    limit; whole MiB, at most the store's largest part.

    >>> part_size_for(512 * MiB, 16 * MiB, 8, S3_LIMITS) // MiB
    16
    >>> part_size_for(2 << 40, 16 * MiB, 8, S3_LIMITS) // MiB   # 2 TiB: 10,000 parts at most
    210
    >>> part_size_for(20 * MiB, 16 * MiB, 8, S3_LIMITS) // MiB  # 4 parts of 5 MiB, not 2 of 16
    5
    """
    if nbytes < 0 or block_size < 1 or concurrency < 1:
        raise ValueError(f"invalid part plan: nbytes={nbytes}, block_size={block_size}, concurrency={concurrency}")
    floor = max(limits.min_part, MIN_PART)
    size = max(floor, min(block_size, -(-nbytes // concurrency)))
    size = max(size, -(-nbytes // limits.max_parts))
    size = -(-size // MiB) * MiB
    if size > limits.max_part or -(-nbytes // size) > limits.max_parts:
        raise ValueError(f"{nbytes} bytes do not fit in {limits.max_parts} parts of at most {limits.max_part} bytes")
    return size


# ---------------------------------------------------------------------------- the stores


class MultipartStore(ABC):
    """The calls one object store offers for uploading one object in parts.

    For each object, `upload_parts` calls ``begin(path)`` once, then ``put_part`` for
    parts 1..n from up to `concurrency` threads at once (a part may be sent again after a
    failed attempt, and an abandoned attempt may still be running), then ``complete`` once
    every part has been acknowledged; after any failure, ``abort`` instead (also after a
    failed `complete`). Nothing is visible at `path` before `complete` returns. Every call
    blocks; the caller bounds and retries each. A store with a part-count limit states it
    in `limits`.
    """

    limits: StoreLimits

    @abstractmethod
    def begin(self, path: str) -> Any:
        """Start an upload to `path`; returns what the other calls take."""

    @abstractmethod
    def put_part(self, upload: Any, number: int, data: memoryview) -> Any:
        """Send part `number` (1-based); returns what `complete` needs of it."""

    @abstractmethod
    def complete(self, upload: Any, parts: Sequence[Any], size: int) -> None:
        """Make the object of `size` bytes from `parts` (in order) visible at its path."""

    @abstractmethod
    def abort(self, upload: Any) -> None:
        """Discard whatever the upload left on the store."""

    def incomplete(self, prefix: str) -> list[tuple[str, Any]]:
        """The uploads under `prefix` (a path ending in ``/``) begun and neither completed
        nor aborted, by anyone: (the object path each was to make, what `abort` takes). A
        store that keeps nothing of an unfinished upload, or cannot list them, has none."""
        return []


def store_for(fs: Any) -> MultipartStore | None:
    """The multipart calls for `fs`'s backend, or None where a file is streamed whole."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if protocols & {"s3", "s3a"}:
        return S3Parts(fs)
    if protocols & {"az", "abfs", "abfss"}:
        return AzureBlocks(fs)
    if protocols & {"gs", "gcs"}:
        return GCSCompose(fs)
    return None


@dataclass(frozen=True, slots=True)
class _S3Upload:
    path: str
    bucket: str
    key: str
    upload_id: str


class S3Parts(MultipartStore):
    """S3 multipart upload: CreateMultipartUpload, UploadPart, CompleteMultipartUpload, and
    AbortMultipartUpload after a failure (S3 keeps, and bills, the parts of an upload that is
    neither completed nor aborted: a process killed mid-upload needs the bucket's lifecycle
    rule ``AbortIncompleteMultipartUpload``, see docs/remote.md)."""

    limits = S3_LIMITS

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def begin(self, path: str) -> _S3Upload:
        bucket, key, _ = self.fs.split_path(path)
        out = self.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        return _S3Upload(path, bucket, key, out["UploadId"])

    def put_part(self, upload: _S3Upload, number: int, data: memoryview) -> dict[str, Any]:
        # botocore takes bytes, bytearray or a file: a part that is a whole bytearray goes
        # as it is, a slice of the host buffer is copied once. An attempt abandoned at its
        # deadline that lands later, with the bytes of a buffer reused since, replaces the
        # part under another ETag: completion then fails (it names the ETags acknowledged)
        # instead of making a wrong object.
        owner = data.obj
        body = owner if isinstance(owner, bytearray) and data.nbytes == len(owner) else bytes(data)
        out = self.fs.call_s3(
            "upload_part",
            Bucket=upload.bucket,
            Key=upload.key,
            UploadId=upload.upload_id,
            PartNumber=number,
            Body=body,
        )
        return {"PartNumber": number, "ETag": out["ETag"]}

    def complete(self, upload: _S3Upload, parts: Sequence[Any], size: int) -> None:
        try:
            self.fs.call_s3(
                "complete_multipart_upload",
                Bucket=upload.bucket,
                Key=upload.key,
                UploadId=upload.upload_id,
                MultipartUpload={"Parts": list(parts)},
            )
        except Exception:
            # A retry of a completion that went through (its answer was lost) finds the
            # upload gone: the object is there, made of this many parts.
            self.fs.invalidate_cache(upload.path)
            try:
                info = self.fs.info(upload.path)
            except Exception:
                info = {}
            if info.get("size") != size or not str(info.get("ETag", "")).strip('"').endswith(f"-{len(parts)}"):
                raise
        self.fs.invalidate_cache(upload.path)

    def abort(self, upload: _S3Upload) -> None:
        self.fs.call_s3("abort_multipart_upload", Bucket=upload.bucket, Key=upload.key, UploadId=upload.upload_id)

    def incomplete(self, prefix: str) -> list[tuple[str, Any]]:
        bucket, key_prefix, _ = self.fs.split_path(prefix)
        found: list[tuple[str, Any]] = []
        markers: dict[str, str] = {}
        while True:  # ListMultipartUploads pages at 1,000 uploads
            out = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix, **markers)
            for u in out.get("Uploads", []):
                path = f"{bucket}/{u['Key']}"
                found.append((path, _S3Upload(path, bucket, u["Key"], u["UploadId"])))
            if not out.get("IsTruncated"):
                return found
            markers = {"KeyMarker": out["NextKeyMarker"], "UploadIdMarker": out["NextUploadIdMarker"]}


@dataclass(frozen=True, slots=True)
class _AzureUpload:
    path: str
    container: str
    blob: str
    token: str

    def block_id(self, number: int) -> str:
        # Every block id of a blob must have the same length. Each attempt stages a block of
        # its own: an attempt abandoned at its deadline may still land later, with the bytes
        # of a buffer reused since, and must not replace a block the list commits.
        return base64.b64encode(f"{self.token}{number:06d}{secrets.token_hex(4)}".encode()).decode()


class AzureBlocks(MultipartStore):
    """Azure block blobs: Put Block per part, then Put Block List naming the blocks
    acknowledged. Uncommitted blocks never make a blob visible and the service discards them
    (after 7 days), so there is nothing to abort or to list (`incomplete`)."""

    limits = AZURE_LIMITS

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, fn, *args)

    def begin(self, path: str) -> _AzureUpload:
        container, blob, _ = self.fs.split_path(path)
        return _AzureUpload(path, container, blob, secrets.token_hex(8))

    def put_part(self, upload: _AzureUpload, number: int, data: memoryview) -> str:
        block_id = upload.block_id(number)

        async def stage() -> None:
            async with self.fs.service_client.get_blob_client(container=upload.container, blob=upload.blob) as bc:
                await bc.stage_block(block_id, data, length=data.nbytes, **self.fs._timeout_kwargs)

        self._run(stage)
        return block_id

    def complete(self, upload: _AzureUpload, parts: Sequence[Any], size: int) -> None:
        from azure.storage.blob import BlobBlock

        async def commit() -> None:
            async with self.fs.service_client.get_blob_client(container=upload.container, blob=upload.blob) as bc:
                await bc.commit_block_list(
                    [BlobBlock(block_id=b) for b in parts],
                    metadata={"is_directory": "false"},  # what adlfs' own uploads set
                    **self.fs._timeout_kwargs,
                )

        self._run(commit)
        self.fs.invalidate_cache(self.fs._parent(upload.path))

    def abort(self, upload: _AzureUpload) -> None:
        return None


@dataclass(frozen=True, slots=True)
class _GCSUpload:
    path: str
    prefix: str  # part objects are named prefix + number + attempt, next to the object

    def part(self, number: int) -> str:
        # An object per attempt, for the reason `_AzureUpload.block_id` gives.
        return f"{self.prefix}{number:05d}-{secrets.token_hex(3)}"


_GCS_PART_RE = re.compile(r"(.+)\.tcpart-([0-9a-f]{12})-(?:[0-9]{5}-[0-9a-f]{6}|c[0-9]{3})", re.ASCII)


class GCSCompose(MultipartStore):
    """GCS parallel composite upload: each part is an object of its own next to the target
    (``<name>.tcpart-<token>-<n>-<attempt>``), composed into the target (32 sources per request, in
    two levels beyond 32 parts), then deleted; an abort deletes them."""

    limits = GCS_LIMITS
    FAN_IN = 32

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def begin(self, path: str) -> _GCSUpload:
        return _GCSUpload(path, f"{path}.tcpart-{secrets.token_hex(6)}-")

    def put_part(self, upload: _GCSUpload, number: int, data: memoryview) -> str:
        name = upload.part(number)
        self.fs.pipe_file(name, data)
        return name

    def complete(self, upload: _GCSUpload, parts: Sequence[Any], size: int) -> None:
        sources = list(parts)
        made: list[str] = []
        if len(sources) > self.FAN_IN:
            groups = [sources[i : i + self.FAN_IN] for i in range(0, len(sources), self.FAN_IN)]
            for i, group in enumerate(groups):
                name = f"{upload.prefix}c{i:03d}"
                self.fs.merge(name, group)
                made.append(name)
            sources = made
        self.fs.merge(upload.path, sources)
        self.fs.invalidate_cache(self.fs._parent(upload.path))
        self._delete([*parts, *made], upload)

    def incomplete(self, prefix: str) -> list[tuple[str, Any]]:
        self.fs.invalidate_cache(prefix.rstrip("/"))
        try:
            names: list[str] = self.fs.find(prefix)
        except FileNotFoundError:
            return []
        uploads: dict[str, tuple[str, Any]] = {}
        for name in names:  # <target>.tcpart-<token>-<part>-<attempt>, or -c<group> (composed)
            m = _GCS_PART_RE.fullmatch(name.lstrip("/"))
            if m is not None:
                target, token = m.group(1), m.group(2)
                uploads.setdefault(token, (target, _GCSUpload(target, f"{target}.tcpart-{token}-")))
        return list(uploads.values())

    def abort(self, upload: _GCSUpload) -> None:
        parent = self.fs._parent(upload.path)
        self.fs.invalidate_cache(parent)
        try:
            found = [p for p in self.fs.find(parent) if p.startswith(upload.prefix.lstrip("/"))]
        except FileNotFoundError:
            return
        self._delete(found, upload)

    def _delete(self, names: Sequence[str], upload: _GCSUpload) -> None:
        if not names:
            return
        try:
            self.fs.rm(list(names))
        except Exception as exc:  # leftovers sit in an unlisted name; deleting the step removes them
            logger.warning("could not delete the %d part objects of %s: %r", len(names), upload.path, exc)


# --------------------------------------------------------------------------- the sources


class PartSource(ABC):
    """A file's bytes, handed out part by part to `upload_parts` (from one thread).

    `uses_buffers` says whether parts are copied into the part buffers the uploader lends
    (`next_part`'s `buf`, `part_size` bytes each) or are views of memory the source holds.
    """

    uses_buffers: bool = True

    @abstractmethod
    def next_part(self, buf: bytearray, n: int) -> memoryview:
        """The next at most `n` bytes (exactly `n` unless at the end); empty at the end."""


class ViewSource(PartSource):
    """Parts of a buffer in memory: slices, no copy."""

    uses_buffers = False

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def next_part(self, buf: bytearray, n: int) -> memoryview:
        start = self._pos
        end = min(len(self._view), start + n)
        self._pos = end
        return self._view[start:end]


class FileSource(PartSource):
    """Parts of an open local file (its descriptor), read with pread into the part buffers."""

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._pos = 0

    def next_part(self, buf: bytearray, n: int) -> memoryview:
        want = min(n, self._size - self._pos)
        view = memoryview(buf)[:want]
        got = 0
        while got < want:
            k = os.preadv(self._fd, [view[got:]], self._pos + got)
            if k == 0:
                raise EOFError(f"file descriptor {self._fd}: ends at byte {self._pos + got}, expected {self._size}")
            got += k
        self._pos += want
        return view


class ChunkSource(PartSource):
    """Parts gathered from a stream of chunks (a compressor's output, packed regions)."""

    def __init__(self, chunks: Iterator[bytes | memoryview]) -> None:
        self._chunks = chunks
        self._carry = memoryview(b"")

    def next_part(self, buf: bytearray, n: int) -> memoryview:
        view = memoryview(buf)
        filled = 0
        while filled < n:
            if not len(self._carry):
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._carry = memoryview(chunk).cast("B")
                continue
            k = min(n - filled, len(self._carry))
            view[filled : filled + k] = self._carry[:k]
            self._carry = self._carry[k:]
            filled += k
        return view[:filled]


# ------------------------------------------------------------------ unfinished uploads


class LiveUploads:
    """The multipart uploads one tier has in flight, so that a process about to end (a
    SIGTERM delivered after its drain ran out of grace) aborts them rather than leave their
    parts on the store, where S3 keeps and bills them until someone aborts them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[MultipartStore, Any, str, threading.Event]] = {}

    def add(self, store: MultipartStore, upload: Any, path: str, failed: threading.Event) -> int:
        with self._lock:
            self._live[id(failed)] = (store, upload, path, failed)
            return id(failed)

    def discard(self, token: int) -> None:
        with self._lock:
            self._live.pop(token, None)

    def abort_all(self, call_once: Callable[[str, Callable[[], None]], None]) -> int:
        """Abort every upload in flight, one bounded attempt each; their own threads then
        fail (an upload begun later is the restarted writer's to abort, see `abort_unfinished`).
        Returns how many were aborted."""
        with self._lock:
            live = list(self._live.values())
            self._live.clear()
        aborted = 0
        for store, upload, path, failed in live:
            failed.set()  # its parts stop being sent or retried
            aborted += _abort_once(store, upload, f"the multipart upload of {path}", call_once)
        return aborted


def _abort_once(
    store: MultipartStore, upload: Any, what: str, call_once: Callable[[str, Callable[[], None]], None]
) -> bool:
    """Abort `upload` with one bounded attempt; a failure is logged (best effort: nothing
    unfinished is ever visible, and the bucket's lifecycle rule is the backstop)."""
    try:
        call_once(f"aborting {what}", lambda: store.abort(upload))
        return True
    except Exception as exc:
        logger.warning("could not abort %s: %r", what, exc)
        return False


def abort_unfinished(
    store: MultipartStore,
    prefix: str,
    owned: Callable[[str], bool],
    call_once: Callable[[str, Callable[[], None]], None],
) -> list[str]:
    """Abort the unfinished uploads under `prefix` whose object path `owned` says are the
    caller's (an earlier writer of its part, killed mid-upload); one bounded attempt for
    the listing and for each abort. Returns the object paths aborted."""
    found: list[list[tuple[str, Any]]] = []
    call_once(f"listing the unfinished uploads under {prefix}", lambda: found.append(store.incomplete(prefix)))
    aborted: list[str] = []
    for path, upload in found[0]:
        if owned(path) and _abort_once(store, upload, f"the unfinished multipart upload of {path}", call_once):
            aborted.append(path)
    return aborted


# ------------------------------------------------------------------------ the transfers


def upload_parts(
    store: MultipartStore,
    path: str,
    source: PartSource,
    part_size: int,
    concurrency: int,
    call: Call,
    call_once: Callable[[str, Callable[[], None]], None],
    before_send: Callable[[int], None] = lambda n: None,
    live: LiveUploads | None = None,
) -> int:
    """Upload `source` to `path` in parts of `part_size` bytes, `concurrency` at a time;
    returns the bytes uploaded. Each request goes through `call` (each part retried on its
    own); on any failure the upload is aborted with one bounded attempt (`call_once`), the
    parts still in flight are waited for, and the first error is raised. `before_send(n)`
    runs before each part is sent (a rate limit). The upload is in `live` while it runs."""
    upload = call(f"starting a multipart upload of {path}", lambda: store.begin(path))
    failed = threading.Event()
    token = None if live is None else live.add(store, upload, path, failed)
    errors: list[BaseException] = []
    acks: dict[int, Any] = {}
    slots: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for _ in range(concurrency):
        slots.put(bytearray())  # the buffer is allocated when a part first needs it

    def send(number: int, data: memoryview, slot: bytearray) -> None:
        try:
            if not failed.is_set():
                before_send(data.nbytes)
                acks[number] = call(
                    f"uploading part {number} of {path}",
                    lambda: store.put_part(upload, number, data),
                    data.nbytes,
                    failed.is_set,
                )
        except BaseException as exc:
            errors.append(exc)
            failed.set()
        finally:
            slots.put(slot)

    count = stored = 0
    try:
        with ThreadPoolExecutor(concurrency, thread_name_prefix="tiercheck-part") as pool:
            try:
                while (slot := _take(slots, failed)) is not None:
                    if source.uses_buffers and len(slot) < part_size:
                        slot = bytearray(part_size)
                    data = source.next_part(slot, part_size)
                    if not data.nbytes:
                        slots.put(slot)
                        break
                    count += 1
                    if count > store.limits.max_parts:
                        raise ValueError(f"{path}: more than {store.limits.max_parts} parts of {part_size} bytes")
                    stored += data.nbytes
                    pool.submit(send, count, data, slot)
            except BaseException:
                failed.set()
                raise
        if errors:
            raise errors[0]
        parts = [acks[i] for i in range(1, count + 1)]
        call(f"completing the multipart upload of {path}", lambda: store.complete(upload, parts, stored))
    except BaseException:
        failed.set()
        _abort_once(store, upload, f"the multipart upload of {path}", call_once)
        raise
    finally:
        if live is not None and token is not None:
            live.discard(token)
    return stored


def _take(slots: queue.SimpleQueue[bytearray], failed: threading.Event) -> bytearray | None:
    """A free part slot, or None once the upload has failed."""
    while not failed.is_set():
        with contextlib.suppress(queue.Empty):
            return slots.get(timeout=0.05)
    return None


def read_piece_size(size: int, concurrency: int) -> int:
    """The length of the ranges a file of `size` bytes is read in (the last may be shorter).

    The file is cut into waves of `concurrency` equal pieces of about MAX_READ_PIECE at most,
    so that a small file keeps every connection busy (64 MiB on 8 connections: one wave of 8
    MiB pieces, not 4 MiB ones and then 8 MiB ones on half the connections) and the last wave
    of a large one is full; a file up to an eighth over a whole number of waves takes slightly
    longer pieces instead of a wave of slivers. At least MIN_READ_PIECE: below it a request's
    round trip costs more than its share of the link gains."""
    wave = concurrency * MAX_READ_PIECE
    waves = max(1, -(-(8 * size - wave) // (8 * wave)))  # ceil(size / wave - 1/8)
    piece = -(-size // (waves * concurrency))
    piece = -(-piece // PIECE_ALIGN) * PIECE_ALIGN
    return max(MIN_READ_PIECE, piece)


class RangeReader:
    """Positional reads of one object, with up to `concurrency` ranged reads in flight.

    The object is read in pieces of a fixed grid (`read_piece_size`). A read fetches the
    pieces it covers, and queues the next `concurrency` pieces after them (about AHEAD_MAX
    bytes at most), so that a reader going through the file in order (restore, a zstd
    stream) finds them arriving: every connection stays busy, none waits for the slowest
    piece of a read, and a run of small reads costs one request. Pieces are copied into
    place as they complete, in whatever order. A read elsewhere drops what is outside its
    window. Memory: the pieces of one read plus those fetched ahead: at most the read plus
    AHEAD_MAX and two pieces (32 + 64 + 18 MiB at most with restore's 32 MiB reads).

    One reader thread at a time. `close()` drops what is queued, stops retrying, and joins
    the pool: a fetch still running ends within its attempt's deadline (at once, when the
    reader went through the whole file).
    """

    AHEAD_MAX = 64 * MiB

    def __init__(self, fetch: Callable[[int, int], bytes], size: int, concurrency: int, call: Call, what: str) -> None:
        self._fetch = fetch
        self._size = size
        self._concurrency = concurrency
        self._call = call
        self._what = what
        self.piece = read_piece_size(size, concurrency)
        self._count = -(-size // self.piece)
        self._ahead = min(concurrency, max(1, self.AHEAD_MAX // self.piece))  # pieces queued past a read
        self._pool: ThreadPoolExecutor | None = None
        self._pieces: dict[int, Future[bytes]] = {}  # piece index -> its bytes, in flight or arrived
        self._closed = threading.Event()

    def _get(self, index: int) -> bytes:
        start = index * self.piece
        n = min(self.piece, self._size - start)
        data = self._call(self._what, lambda: self._fetch(start, n), n, self._closed.is_set)
        if len(data) != n:
            raise EOFError(f"{self._what}: the file ends before byte {start + n}")
        return data

    def _window(self, first: int, last: int) -> None:
        """Pieces `first`..`last` and the ones ahead of them queued (in file order, so the
        pool runs the read's own first); every other piece dropped."""
        hi = min(self._count - 1, last + self._ahead)
        for i in [i for i in self._pieces if i < first or i > hi]:
            self._pieces.pop(i).cancel()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._concurrency, thread_name_prefix="tiercheck-read")
        for i in range(first, hi + 1):
            if i not in self._pieces:
                self._pieces[i] = self._pool.submit(self._get, i)

    def read_into(self, offset: int, dest: memoryview) -> None:
        end = offset + dest.nbytes
        if dest.nbytes == 0:
            return
        first, last = offset // self.piece, (end - 1) // self.piece
        self._window(first, last)
        wanted = {self._pieces[i]: i for i in range(first, last + 1)}
        for fut in as_completed(wanted):
            i = wanted[fut]
            if fut.exception() is not None:
                del self._pieces[i]  # a later read of it asks again
            data = memoryview(fut.result())
            start = i * self.piece
            lo, hi = max(start, offset), min(start + len(data), end)
            dest[lo - offset : hi - offset] = data[lo - start : hi - start]
        for i in range(first, last + 1):  # read whole: dropped; a tail past `end` is the next read's
            if min((i + 1) * self.piece, self._size) <= end:
                del self._pieces[i]

    def close(self) -> None:
        self._closed.set()  # fetches in flight stop retrying
        for fut in self._pieces.values():
            fut.cancel()
        self._pieces = {}
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
