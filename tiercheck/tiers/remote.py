"""Tier 2: any fsspec location (s3://, gs://, az://, file://, memory://).

Object stores have no rename and no fsync, so visibility rests on ordering alone: a
step's shard files go first, then its manifest, and the commit marker last. A step whose
upload was cut midway has no marker and is never listed. Deletion removes the marker
first. Every call is retried on transient errors (see `retry.py`), each attempt bounded in
time (`calls.py`); what a listing says about steps is `listing.py`.

On S3, Azure and GCS a large file moves as several parts or ranges in flight at once
(`multipart.py`): one connection carries ~50-100 MB/s, a node's uplink needs many.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointCorruptedError, InvalidArgumentError, TierError
from ..format import naming
from . import calls, codec, listing, multipart
from .base import Capabilities, ReadableFile, StepWriter, Tier
from .retry import RetryPolicy
from .throttle import RateLimiter

T = TypeVar("T")
logger = logging.getLogger("tiercheck")


class RemoteTier(Tier):
    """A tier on an fsspec URL.

    Args:
        url: the root, e.g. ``s3://bucket/run7``. A plain path is the local filesystem,
            as ``file://`` (no fsync or rename but for the marker); its directories are
            created on demand.
        storage_options: passed to fsspec (credentials, ``endpoint_url``, client config).
            A fresh filesystem instance is created (``skip_instance_cache``), so credentials
            are never served from a stale cached client.
        retry: backoff and time budget for transient errors.
        op_timeout: seconds one attempt of one call may take (plus 1 s per MiB it moves)
            before it is abandoned as a transient failure. Client libraries do not bound
            every wait (s3fs never times out sending a body to a hung server); this does.
        block_size: bytes per part of a multipart upload (more for a file that would need
            more parts than the store allows: S3 10,000, Azure 50,000, GCS 1,024 here; less
            for a small file, so each connection gets a part; at least 5 MiB on S3), and per
            streamed write on stores without multipart calls.
        concurrency: parts (uploads) or ranges (reads) of one file in flight at once.
            Memory: an upload holds at most ``concurrency`` parts, so at most
            ``concurrency x part size`` bytes beyond the host buffer (from tier 1, parts
            are read with pread into that many reused part buffers; from the host buffer,
            parts are slices of it, copied only on S3, whose client takes only
            ``bytes``/``bytearray``; S3's aiohttp makes up to two more copies of a part
            while sending it). A read holds its ranges while they are copied into place,
            plus the bytes it fetched ahead of the reader: at most 114 MiB per open file
            at restore (see `multipart.RangeReader`).
        write_rate: optional cap in bytes/s for uploads.
        compression: None, or "zstd" to store shard files zstd-compressed (level
            `compression_level`); the manifest then records codec and stored size.

    Each request (a part, a range, a whole small file) is retried on its own within the
    retry budget, and each attempt is bounded by `op_timeout`. A multipart upload that
    fails is aborted (S3: AbortMultipartUpload; GCS: its part objects deleted; Azure:
    uncommitted blocks never make a blob and the service discards them), so a cut upload
    is never listed and leaves no parts behind.
    """

    capabilities = Capabilities(strays=True)  # no statvfs, no lock, no local files

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        *,
        name: str = "remote",
        retry: RetryPolicy | None = None,
        block_size: int = 16 << 20,
        concurrency: int = 8,
        write_rate: float | None = None,
        compression: str | None = None,
        compression_level: int = 1,
        op_timeout: float = 60.0,
    ) -> None:
        if compression not in (None, "zstd"):
            raise InvalidArgumentError(f"compression must be None or 'zstd', got {compression!r}")
        self.codec = compression or "raw"
        self.compression_level = compression_level
        if concurrency < 1:
            raise InvalidArgumentError(f"concurrency must be at least 1, got {concurrency}")
        if block_size < 1 << 20:
            raise InvalidArgumentError(f"block_size must be at least 1 MiB, got {block_size}")
        url = os.fspath(url)
        if "://" not in url and "::" not in url:
            url = os.path.abspath(url)  # a plain path: the local filesystem, as file:// is
        opts = dict(storage_options or {})
        opts.setdefault("skip_instance_cache", True)
        if url.startswith(("s3://", "s3a://")):  # botocore's pool (10) must not queue the parts
            config = dict(opts.get("config_kwargs") or {})
            config.setdefault("max_pool_connections", max(10, 2 * concurrency))
            opts["config_kwargs"] = config
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **opts)
        except (ValueError, ImportError, TypeError) as exc:  # unknown protocol, backend not installed
            raise InvalidArgumentError(f"cannot open remote {url!r}: {type(exc).__name__}: {exc}") from exc
        if isinstance(self.fs, LocalFileSystem) and "auto_mkdir" not in opts:
            # Object stores have no directories to create; a local path must get them.
            self.fs.auto_mkdir = True
        self.root = root.rstrip("/")
        self.name = name
        self.location = url
        self.retry = retry or RetryPolicy()
        self.block_size = block_size
        self.concurrency = concurrency
        self._parts = multipart.store_for(self.fs)  # None: files are streamed whole
        self.limiter = RateLimiter(write_rate)
        self.stopping = threading.Event()  # set on close: stop retrying
        self.op_timeout = op_timeout
        self._patched_client: object = None
        self.live_uploads = multipart.LiveUploads()
        self._sweep: tuple[int, int] | None = None  # (rank, world size) to sweep for, once
        self._sweep_lock = threading.Lock()

    def _bound_writes(self) -> None:
        self._patched_client = calls.bound_s3_writes(self.fs, self._patched_client)

    def _call(self, what: str, fn: Callable[[], T], nbytes: int = 0, stop: Callable[[], bool] | None = None) -> T:
        """`fn()` retried on transient errors, each attempt bounded by `_attempt`; no retry
        once the tier closes or `stop()` is true (another part of the same file failed)."""

        def log(exc: BaseException, attempt: int, delay: float) -> None:
            msg = "tier %r: %s failed (attempt %d: %r); retrying in %.1fs"
            logger.warning(msg, self.name, what, attempt, exc, delay)

        def stopped() -> bool:
            return self.stopping.is_set() or (stop is not None and stop())

        deadline = self.op_timeout + nbytes / (1 << 20)
        return self.retry.run(lambda: self._attempt(what, fn, deadline), on_retry=log, stop=stopped)

    def _call_once(self, what: str, fn: Callable[[], None]) -> None:
        self._attempt(what, fn, self.op_timeout)

    def _attempt(self, what: str, fn: Callable[[], T], deadline: float) -> T:
        return calls.attempt_within(self.name, what, fn, deadline)

    def _path(self, step: int, name: str | None = None) -> str:
        d = f"{self.root}/{naming.step_dir_name(step)}"
        return d if name is None else f"{d}/{name}"

    def path_of(self, step: int, name: str | None = None) -> str:
        return f"{self.location.rstrip('/')}/{naming.step_dir_name(step)}" + ("" if name is None else f"/{name}")

    def committed_steps(self) -> list[int]:
        return self._list_steps()[0]

    def stray_steps(self) -> list[int]:
        return self._list_steps()[1]

    def _list_steps(self) -> tuple[list[int], list[int]]:
        """(committed steps, step prefixes holding objects but no marker), one listing."""

        def find() -> list[str]:
            self.fs.invalidate_cache(self.root)
            try:
                found: list[str] = self.fs.find(self.root)
            except FileNotFoundError:
                return []
            return found

        try:
            found = self._call(f"listing {self.location}", find)
        except Exception as exc:
            raise TierError(
                f"tier {self.name!r}: cannot list {self.location}: {type(exc).__name__}: {exc}",
                step=None,
                tier=self.name,
                path=self.location,
            ) from exc
        return listing.steps_listed(found, self.root)

    def open_step(self, step: int, rank: int, shared: bool = False) -> StepWriter:
        self._sweep_unfinished()
        return _RemoteStepWriter(self, step)

    # -- unfinished multipart uploads ------------------------------------------------

    def sweep_before_upload(self, rank: int, world_size: int) -> None:
        """This process is becoming the writer of `rank`'s part of a `world_size`-rank job:
        before its first upload, abort the unfinished multipart uploads an earlier writer of
        that part left under the root (killed mid-upload: S3 keeps and bills their parts
        forever). Rank 0 also takes those of ranks the job no longer has. Uploads of other
        ranks' files, which a live rank may be sending, and objects of other names are left
        alone. Call it before anything of this process uploads."""
        self._sweep = (rank, world_size)

    def _sweep_unfinished(self) -> None:
        with self._sweep_lock:  # the first upload of this writer waits for the sweep
            if self._sweep is None or self._parts is None:
                return
            rank, world = self._sweep
            self._sweep = None  # once: a store that refuses the listing is not asked again

            def ours(path: str) -> bool:
                return listing.written_by(path, self.root, rank, world)

            try:
                aborted = multipart.abort_unfinished(self._parts, f"{self.root}/", ours, self._call_once)
            except Exception as exc:
                logger.warning(
                    "tier %r: cannot list the unfinished multipart uploads under %s (%r); the bucket's "
                    "lifecycle rule must remove those of a killed upload (docs/remote.md)",
                    self.name,
                    self.location,
                    exc,
                )
                return
            if aborted:
                logger.warning("tier %r: aborted %d unfinished multipart uploads: %s", self.name, len(aborted), aborted)

    def abort_uploads_in_flight(self) -> int:
        """Abort this tier's multipart uploads in flight: for a process about to end with
        uploads unfinished. Each abort gets one attempt of at most 5 s (the process is out of
        grace). Returns how many were aborted."""
        return self.live_uploads.abort_all(lambda what, fn: self._attempt(what, fn, min(self.op_timeout, 5.0)))

    def write_marker(self, step: int, marker: bytes) -> None:
        path = self._path(step, naming.COMMIT_NAME)
        if "file" in self.fs.protocol or "local" in self.fs.protocol:
            # A local filesystem creates the file before writing it: a kill in between would
            # leave an empty, listed marker. Object-store PUTs are atomic; here, rename is.
            tmp = f"{path}.tmp-{secrets.token_hex(8)}"
            self.put_bytes(tmp, memoryview(marker))
            self._call(f"renaming {tmp}", lambda: self.fs.mv(tmp, path))
            return
        self.put_bytes(path, memoryview(marker))

    def read_bytes(self, step: int, name: str, limit: int) -> bytes:
        path = self._path(step, name)

        def fetch() -> bytes:
            try:
                data: bytes = self.fs.cat_file(path, start=0, end=limit + 1)
            except FileNotFoundError:
                raise
            except Exception:  # S3 and Azure answer a ranged read of an empty object with 416
                if self.fs.info(path).get("size") == 0:
                    return b""
                raise
            return data

        data = self._call(f"reading {path}", fetch)
        if len(data) > limit:
            raise CheckpointCorruptedError(f"{self.path_of(step, name)}: larger than the {limit}-byte limit")
        return data

    def open_file(self, step: int, name: str) -> ReadableFile:
        path = self._path(step, name)
        info = self._call(f"stat {path}", lambda: self.fs.info(path))
        return _RemoteFile(self, path, int(info["size"]))

    def delete_step(self, step: int) -> None:
        marker = self._path(step, naming.COMMIT_NAME)

        def rm_marker() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(marker)

        self._call(f"deleting {marker}", rm_marker)
        step_dir = self._path(step)

        def rm_rest() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(step_dir, recursive=True)

        self._call(f"deleting {step_dir}", rm_rest)

    def remove_leftovers(self) -> list[str]:
        return []  # object stores hold no temp names; an unmarked step is simply never listed

    # -- writing ---------------------------------------------------------------------

    def _part_size(self, nbytes: int) -> int:
        assert self._parts is not None
        return multipart.part_size_for(nbytes, self.block_size, self.concurrency, self._parts.limits)

    def _upload_parts(self, path: str, source: multipart.PartSource, part_size: int) -> int:
        assert self._parts is not None
        self._bound_writes()
        return multipart.upload_parts(
            self._parts,
            path,
            source,
            part_size,
            self.concurrency,
            self._call,
            self._call_once,
            self.limiter.consume,
            self.live_uploads,
        )

    def put_chunks(
        self, path: str, chunks: Callable[[], Iterator[bytes | memoryview]], compress: bool, nbytes: int
    ) -> int:
        """Upload the `nbytes` bytes `chunks()` yields to `path`; return the bytes stored. In
        parts where the store has multipart calls and the file is larger than a part (each
        part retried alone); else streamed, and retried from the start (`chunks()` again)."""
        compress = compress and self.codec == "zstd"
        if self._parts is not None:
            bound = nbytes + (nbytes >> 10) + (64 << 10) if compress else nbytes  # zstd may grow a little
            part = self._part_size(bound)
            if bound > part:
                stream = codec.compressed(chunks(), self.compression_level) if compress else chunks()
                return self._upload_parts(path, multipart.ChunkSource(stream), part)

        def put() -> int:
            self._bound_writes()
            stored = 0
            cobj = codec.compressor(self.compression_level) if compress else None
            with self.fs.open(path, "wb", block_size=self.block_size) as f:
                for chunk in chunks():
                    out = cobj.compress(chunk) if cobj is not None else chunk
                    if len(out):
                        self.limiter.consume(len(out))
                        f.write(out)
                        stored += len(out)
                if cobj is not None:
                    tail = cobj.flush()
                    self.limiter.consume(len(tail))
                    f.write(tail)
                    stored += len(tail)
            return stored

        return self._call(f"uploading {path}", put, nbytes)

    def put_bytes(self, path: str, data: memoryview, compress: bool = False) -> int:
        compress = compress and self.codec == "zstd"
        if self._parts is not None and not compress and len(data) > (part := self._part_size(len(data))):
            return self._upload_parts(path, multipart.ViewSource(data), part)  # slices of `data`, no copy
        if len(data) <= self.block_size and not compress:

            def pipe() -> int:
                self._bound_writes()
                self.limiter.consume(len(data))
                self.fs.pipe_file(path, bytes(data))
                return len(data)

            return self._call(f"uploading {path}", pipe, len(data))
        block = self.block_size
        return self.put_chunks(
            path, lambda: (data[p : p + block] for p in range(0, len(data), block)), compress, len(data)
        )

    def put_local_file(self, path: str, local_path: str, compress: bool = False) -> int:
        size = os.path.getsize(local_path)
        compress = compress and self.codec == "zstd"
        if self._parts is not None and not compress and size > (part := self._part_size(size)):
            with open(local_path, "rb") as src:  # parts read with pread into the part buffers
                return self._upload_parts(path, multipart.FileSource(src.fileno(), size), part)

        def chunks() -> Iterator[bytes]:
            with open(local_path, "rb") as src:
                while chunk := src.read(self.block_size):
                    yield chunk

        return self.put_chunks(path, chunks, compress, size)


class _RemoteStepWriter(StepWriter):
    def __init__(self, tier: RemoteTier, step: int) -> None:
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
        path = self._tier._path(self._step, name)
        self._written.append(path)
        return self._tier.put_bytes(path, data, compress)

    def write_chunks(
        self, name: str, chunks: Callable[[], Iterator[bytes | memoryview]], nbytes: int, compress: bool = False
    ) -> int:
        path = self._tier._path(self._step, name)
        self._written.append(path)
        return self._tier.put_chunks(path, chunks, compress, nbytes)

    def write_from_path(self, name: str, local_path: str, compress: bool = False) -> int:
        path = self._tier._path(self._step, name)
        self._written.append(path)
        return self._tier.put_local_file(path, local_path, compress)

    def publish_part(self) -> None:
        return None  # every file was written in place under the step's name

    def commit(self, marker: bytes) -> None:
        self._written.append(self._tier._path(self._step, naming.COMMIT_NAME))  # a cut marker must go too
        self._tier.write_marker(self._step, marker)

    def abort(self) -> None:
        tier = self._tier
        for path in reversed(self._written):  # the marker first
            try:
                tier._attempt(f"removing {path}", lambda p=path: tier.fs.rm_file(p), tier.op_timeout)  # type: ignore[misc]
            except Exception:  # best effort: an unmarked step is invisible anyway
                logger.debug("tier %r: could not remove %s after a failed upload", self._tier.name, path)


class _RemoteFile(ReadableFile):
    def __init__(self, tier: RemoteTier, path: str, size: int) -> None:
        self._path = path
        self.size = size
        fs = tier.fs

        def fetch(start: int, n: int) -> bytes:
            data: bytes = fs.cat_file(path, start=start, end=start + n)
            return data

        self._reader = multipart.RangeReader(fetch, size, tier.concurrency, tier._call, f"reading {path}")

    def read_into(self, offset: int, dest: memoryview) -> None:
        if offset < 0 or offset + len(dest) > self.size:  # servers answer 416 there; say what it means
            raise EOFError(f"{self._path}: file ends at byte {self.size}, before byte {offset + len(dest)}")
        self._reader.read_into(offset, dest)

    def close(self) -> None:
        self._reader.close()
