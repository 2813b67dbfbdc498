"""The shard codec, both directions: zstd compression as the remote tier stores a shard
(`compressed`, `compressor`) and decompression as every reader reads one back (`ZstdFile`),
so the two sides agree on one frame format and its limits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, cast

from ..errors import CheckpointCorruptedError
from .base import ReadableFile

__all__ = ["Compressor", "ZstdFile", "compressed", "compressor"]


class Compressor(Protocol):
    """One stream being compressed: `compress` returns what is ready (maybe nothing), `flush`
    the rest and the frame's end."""

    def compress(self, data: bytes | memoryview) -> bytes: ...

    def flush(self) -> bytes: ...


def compressor(level: int) -> Compressor:
    """A fresh zstd stream at `level` (one frame)."""
    import zstandard  # optional: only a tier that compresses, or a reader of compressed shards, needs it

    return cast(Compressor, zstandard.ZstdCompressor(level=level).compressobj())


def compressed(chunks: Iterable[bytes | memoryview], level: int) -> Iterator[bytes | memoryview]:
    """`chunks` as one zstd frame, yielded as the compressor releases it."""
    cobj = compressor(level)
    for chunk in chunks:
        out = cobj.compress(chunk)
        if out:
            yield out
    yield cobj.flush()


class ZstdFile(ReadableFile):
    """A zstd-compressed shard (one or more frames) read front to back (restore reads in
    offset order); a read behind the current position starts decompressing again from the
    beginning.

    Memory stays bounded whatever the frames claim: bytes are decompressed straight into the
    caller's buffer (or a fixed scratch buffer when skipping ahead), never more than asked
    for, and never past the declared length. `check_end` then reads at most one byte past
    it: a shard that decompresses to more or fewer bytes than declared is corrupted.
    """

    READ_SIZE = 8 << 20  # compressed bytes per read from the tier (one ranged GET on tier 2)
    SKIP_SIZE = 1 << 20  # decompressed bytes per step when skipping ahead

    def __init__(self, raw: ReadableFile, length: int, path: str) -> None:
        self.size = length
        self._raw = raw
        self._path = path
        self._scratch: memoryview | None = None
        self._rewind()

    def _rewind(self) -> None:
        import zstandard

        self._raw_pos = 0
        self._pos = 0
        # read_across_frames: the format allows several frames, decompressing back to back.
        self._reader: Any = zstandard.ZstdDecompressor().stream_reader(
            cast(Any, self), read_size=self.READ_SIZE, read_across_frames=True, closefd=False
        )

    def read(self, n: int) -> bytearray:
        """The next compressed bytes, for the decompressor (empty at the end of the file)."""
        n = min(n, self._raw.size - self._raw_pos)
        chunk = bytearray(n)
        if n:
            self._raw.read_into(self._raw_pos, memoryview(chunk))
            self._raw_pos += n
        return chunk

    def _fill(self, dest: memoryview) -> int:
        """Decompress into `dest`; fewer bytes only where the data ends."""
        filled = 0
        while filled < len(dest):
            try:
                n = self._reader.readinto(dest[filled:])
            except Exception as exc:  # zstandard.ZstdError: not a valid frame
                raise CheckpointCorruptedError(f"{self._path}: bad zstd data: {exc}") from None
            if not n:
                break
            filled += n
        self._pos += filled
        return filled

    def _skip_to(self, offset: int) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(min(self.SKIP_SIZE, max(self.size, 1))))
        while self._pos < offset:
            if not self._fill(self._scratch[: min(len(self._scratch), offset - self._pos)]):
                raise EOFError(f"{self._path}: decompressed data ends at byte {self._pos}, manifest says {self.size}")

    def read_into(self, offset: int, dest: memoryview) -> None:
        if offset + len(dest) > self.size:
            raise EOFError(f"{self._path}: bytes {offset}..{offset + len(dest)} lie past its {self.size} bytes")
        if offset < self._pos:
            self._rewind()
        self._skip_to(offset)
        if self._fill(dest) < len(dest):
            raise EOFError(f"{self._path}: decompressed data ends at byte {self._pos}, manifest says {self.size}")

    def check_end(self) -> None:
        """Raise CheckpointCorruptedError unless the data decompresses to exactly `size` bytes."""
        try:
            self._skip_to(self.size)
        except EOFError as exc:
            raise CheckpointCorruptedError(str(exc)) from None
        if self._fill(memoryview(bytearray(1))):
            raise CheckpointCorruptedError(
                f"{self._path}: decompresses to more than the {self.size} bytes its manifest declares"
            )

    def close(self) -> None:
        self._reader.close()
        self._raw.close()
