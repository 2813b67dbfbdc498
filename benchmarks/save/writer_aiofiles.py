"""Why tiercheck's writer is a plain thread, not asyncio + aiofiles: one measurement.

Writes the same buffer (default 512 MiB) with os.write in 8 MiB blocks from a thread, and
with aiofiles in the same blocks from an event loop, each followed by fsync, interleaved
over a few repeats, and prints the medians and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import aiofiles
import numpy as np

BLOCK = 8 << 20


def plain(path: str, buf: memoryview) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for i in range(0, len(buf), BLOCK):
        os.write(fd, buf[i : i + BLOCK])
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


async def _aio(path: str, buf: memoryview) -> None:
    async with aiofiles.open(path, "wb") as f:
        for i in range(0, len(buf), BLOCK):
            await f.write(buf[i : i + BLOCK])
        await f.flush()
        await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())


def aio(path: str, buf: memoryview) -> float:
    t = time.perf_counter()
    asyncio.run(_aio(path, buf))
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=".")
    args = ap.parse_args()
    buf = memoryview(np.random.default_rng(0).integers(0, 255, args.mib << 20, dtype=np.uint8))  # type: ignore[arg-type]
    res: dict[str, list[float]] = {"os.write thread": [], "aiofiles": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for _ in range(args.repeats):
            for name, fn in (("os.write thread", plain), ("aiofiles", aio)):
                path = os.path.join(d, "f")
                res[name].append(fn(path, buf))
                os.unlink(path)
    med = {k: statistics.median(v) for k, v in res.items()}
    for k, v in med.items():
        print(f"{k:16s} median {v:.3f}s  {args.mib / 1024 / v:.2f} GiB/s  (runs: {', '.join(f'{x:.3f}' for x in res[k])})")
    print(f"aiofiles / os.write time ratio: {med['aiofiles'] / med['os.write thread']:.2f}")


if __name__ == "__main__":
    main()
