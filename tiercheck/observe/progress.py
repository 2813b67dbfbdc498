"""Progress of long reads and writes: a callback protocol, and a bar for a person at a terminal.

Library calls that move many bytes (`tiercheck.load`, `Checkpointer.restore`, `verify_files`,
`tiercheck.convert.export_step` / `import_step`) take ``progress=``: a callable called with
``(done_bytes, total_bytes)`` as the work advances, from the caller's thread. It must be
cheap (it runs between reads) and must not raise; `total_bytes` stays the same for one
operation, and the last call has ``done_bytes == total_bytes`` when the operation succeeds.

`terminal_bar` is what the command line passes: a tqdm bar on stderr when stderr is a
terminal and tqdm is installed (``pip install tiercheck[progress]``), a one-line text bar
otherwise, and nothing at all when stderr is not a terminal (logs and pipes stay clean) or
when the operation moves fewer than `MIN_BYTES`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["MIN_BYTES", "ProgressCallback", "format_bytes", "part_of", "terminal_bar"]

ProgressCallback = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``; see the module docstring for the contract."""

MIN_BYTES = 256 << 20
"""Operations smaller than this finish before a bar would be worth reading: none is shown."""

ENV = "TIERCHECK_PROGRESS"
"""``TIERCHECK_PROGRESS=0`` hides every bar; ``=1`` shows one even off a terminal."""


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``512 B``: binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def part_of(progress: ProgressCallback | None, before: int, total: int) -> ProgressCallback | None:
    """The callback for one part of a larger operation: the part's ``(done, part_total)``
    is reported as ``(before + done, total)``. None stays None."""
    if progress is None:
        return None
    whole = progress
    return lambda done, _part_total: whole(before + done, total)


class _TextBar:
    """The zero-dependency bar: one line, redrawn with ``\\r`` at most 5 times a second."""

    WIDTH = 24

    def __init__(self, stream: IO[str], description: str, total: int) -> None:
        self._stream = stream
        self._description = description
        self._total = total
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._done = 0

    def update(self, done: int) -> None:
        self._done = done
        now = time.monotonic()
        if done < self._total and now - self._last_draw < 0.2:
            return
        self._last_draw = now
        elapsed = max(now - self._start, 1e-9)
        rate = done / elapsed
        frac = done / self._total if self._total else 1.0
        filled = int(frac * self.WIDTH)
        eta = (self._total - done) / rate if rate > 0 else float("inf")
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        line = (
            f"\r{self._description}: {frac * 100:3.0f}% |{'#' * filled}{' ' * (self.WIDTH - filled)}| "
            f"{format_bytes(done)}/{format_bytes(self._total)} {format_bytes(rate)}/s ETA {eta_text}"
        )
        self._stream.write(line)
        self._stream.flush()

    def close(self) -> None:
        if self._last_draw:
            self._stream.write("\n")
            self._stream.flush()


def _wanted(stream: IO[str]) -> bool:
    setting = os.environ.get(ENV, "")
    if setting == "0":
        return False
    if setting == "1":
        return True
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or fake stream
        return False


@contextlib.contextmanager
def terminal_bar(
    description: str, *, stream: IO[str] | None = None, min_bytes: int | None = None, use_tqdm: bool = True
) -> Iterator[ProgressCallback | None]:
    """A progress callback that draws a bar on `stream` (default stderr), or None.

    None when `stream` is not a terminal (unless ``TIERCHECK_PROGRESS=1``) or when
    ``TIERCHECK_PROGRESS=0``; callers pass it on as ``progress=`` either way. The bar
    appears at the first call whose total reaches `min_bytes` (default `MIN_BYTES`), and
    is closed when the block exits.

    Example:
        >>> with terminal_bar("export") as progress:        # doctest: +SKIP
        ...     export_step("ckpt/run7", "model.safetensors", progress=progress)
    """
    out = sys.stderr if stream is None else stream
    least = MIN_BYTES if min_bytes is None else min_bytes
    if not _wanted(out):
        yield None
        return
    bar: Any = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            if total < least:
                return
            bar = _make_bar(out, description, total, use_tqdm)
        if isinstance(bar, _TextBar):
            bar.update(done)
        else:
            bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def _make_bar(stream: IO[str], description: str, total: int, use_tqdm: bool) -> Any:
    if use_tqdm:
        try:
            from tqdm import tqdm  # optional dependency: tiercheck[progress]
        except ImportError:
            pass
        else:
            return tqdm(
                total=total, desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=stream, leave=True
            )
    return _TextBar(stream, description, total)
