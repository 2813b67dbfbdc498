"""Reading a committed step's files to copy them to another tier: from the local file
where the tier has one (capability `local_files`), else through `Tier.open_file`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from .base import StepWriter, Tier

_BLOCK = 8 << 20  # bytes per read when a file is streamed through open_file


def reader_of(tier: Tier, step: int, name: str) -> Callable[[int, int], bytes]:
    """``read(offset, n)``: `n` bytes of file `name` of committed `step`; EOFError if short."""
    if tier.capabilities.local_files:
        path = tier.local_file(step, name)

        def read_local(offset: int, n: int) -> bytes:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), n, offset)
            if len(data) != n:
                raise EOFError(f"{path}: file ends before byte {offset + n}")
            return data

        return read_local

    def read(offset: int, n: int) -> bytes:
        f = tier.open_file(step, name)
        try:
            buf = bytearray(n)
            f.read_into(offset, memoryview(buf))
            return bytes(buf)
        finally:
            f.close()

    return read


def copy_file(src: Tier, step: int, name: str, writer: StepWriter, compress: bool = False) -> int:
    """Write file `name` of `src`'s committed `step` through `writer`; return the bytes stored."""
    if src.capabilities.local_files:
        return writer.write_from_path(name, src.local_file(step, name), compress=compress)
    f = src.open_file(step, name)
    size = f.size
    f.close()

    def chunks() -> Iterator[bytes]:
        g = src.open_file(step, name)
        try:
            for pos in range(0, size, _BLOCK):
                buf = bytearray(min(_BLOCK, size - pos))
                g.read_into(pos, memoryview(buf))
                yield bytes(buf)
        finally:
            g.close()

    return writer.write_chunks(name, chunks, size, compress=compress)
