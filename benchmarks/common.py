"""What the benchmarks share: sizes, the machine/revision/load header, summaries, the
pre-faulted host buffer and the plain writer the baselines use, fsync and page-cache
helpers, and the interleaved (rotated) order of the methods under test.

Only the standard library and torch; no tiercheck import, so that a baseline never runs
library code by accident.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

T = TypeVar("T")


# --------------------------------------------------------------------------- machine


def git_rev() -> str:
    """`git describe --always --dirty` of the checkout the benchmarks live in."""
    with contextlib.suppress(Exception):
        return subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return "unknown"


def filesystem_of(path: Path) -> dict[str, str]:
    """fstype, source and mountpoint of the filesystem holding `path` (df, else /proc/mounts)."""
    info = {"fstype": "unknown", "source": "unknown", "mountpoint": "unknown"}
    try:
        out = subprocess.run(["df", "-T", "-P", str(path)], capture_output=True, text=True, check=True).stdout
        fields = out.strip().splitlines()[-1].split()
        return {"source": fields[0], "fstype": fields[1], "mountpoint": fields[-1]}
    except Exception:
        best = ""
        real = os.path.realpath(path)
        with contextlib.suppress(Exception), open("/proc/mounts") as f:
            for line in f:
                src, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best = mnt
                    info = {"source": src, "fstype": fstype, "mountpoint": mnt}
    return info


def fs_text(fs: dict[str, str] | str) -> str:
    """'ext4 (/dev/vda at /)' (reports written before the dict form hold the string)."""
    if isinstance(fs, str):
        return fs
    return f"{fs['fstype']} ({fs['source']} at {fs['mountpoint']})"


def machine_info(target: Path) -> dict[str, Any]:
    """The header of every report: machine, software, revision, target filesystem, load."""
    cpu_model = "unknown"
    with contextlib.suppress(Exception), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(Exception), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) * KIB / GIB, 1)
                break
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return {
        "git_rev": git_rev(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "cpu_model": cpu_model,
        "mem_total_gib": mem,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
        "target_dir": str(target),
        "target_fs": filesystem_of(target),
    }


# --------------------------------------------------------------------------- statistics


def run_in_checkout(checkout: str, script: str, *args: object, timeout: float = 1800) -> dict[str, Any]:
    """Run `script` (`python -c`, its argv: `checkout` then `args`) in a fresh process from
    `checkout`; the JSON object its last output line holds, which must name the tiercheck it
    imported (``"tiercheck": tiercheck.__file__``) from that checkout (an A/B of revisions)."""
    cmd = [sys.executable, "-c", script, checkout, *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=checkout)
    if out.returncode:
        raise RuntimeError(f"{checkout} {args}: exit {out.returncode}\n{out.stderr[-4000:]}")
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if not got["tiercheck"].startswith(os.path.realpath(checkout)):
        raise RuntimeError(f"{checkout}: imported tiercheck from {got['tiercheck']}")
    return got


def summary(xs: Iterable[float | None]) -> dict[str, float] | None:
    """median, min, max and n of the values that are not None; None if there are none."""
    v = [x for x in xs if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """The order of the methods in one repeat: interleaved, rotated by one each repeat, so
    every method sees the same machine noise and none always runs first."""
    if not items:
        return []
    k = repeat % len(items)
    return list(items[k:]) + list(items[:k])


# --------------------------------------------------------------------------- buffers and files


class PlainBuffer:
    """One page-aligned, pre-faulted host buffer (pinned on CUDA) with a view per tensor:
    the naive baselines copy into it and write it out."""

    def __init__(self, tensors: Iterable[torch.Tensor], pinned: bool = False) -> None:
        tensors = list(tensors)
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.nbytes = total
        self.padded = max(ALIGN, -(-total // ALIGN) * ALIGN)
        self._mm: mmap.mmap | None = None
        if pinned:
            self.buf = torch.empty(self.padded, dtype=torch.uint8, pin_memory=True)
        else:
            self._mm = mmap.mmap(-1, self.padded)  # page-aligned: O_DIRECT can write from it
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.buf.fill_(0)  # fault every page in now, outside any timed region
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                self.pairs.append((self.buf[off : off + n].view(t.dtype).view(t.shape), t))
            off += n

    def copy(self) -> None:
        non_blocking = self.buf.is_pinned()
        for dst, src in self.pairs:
            dst.copy_(src, non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()


def write_file(
    buf: torch.Tensor, path: Path, block: int, direct: bool = True, sync_dir: bool = True, truncate: bool = True
) -> bool:
    """Write `buf` to a new file in `block`-byte writes, fsync it (and its directory).

    With `direct`, O_DIRECT (`buf` page-aligned, its length a multiple of 4 KiB); returns
    False if the filesystem refused O_DIRECT (then the file was written buffered). Without
    `truncate`, an existing file is overwritten in place (its blocks stay allocated)."""
    mv = memoryview(buf.numpy()).cast("B")
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else 0)
    direct = direct and bool(O_DIRECT)
    try:
        fd = os.open(path, flags | (O_DIRECT if direct else 0), 0o644)
    except OSError as exc:
        if not direct or exc.errno != errno.EINVAL:
            raise
        direct = False
        fd = os.open(path, flags, 0o644)
    try:
        off, n = 0, len(mv)
        while off < n:
            off += os.write(fd, mv[off : off + block])
        os.fsync(fd)
    finally:
        os.close(fd)
    if sync_dir:
        fsync_path(path.parent)
    return direct


def fsync_path(path: str | Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under `root`."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def drop_file_cache(path: str | Path) -> None:
    """Evict one file's pages from the page cache: fsync (dirty pages stay), then
    POSIX_FADV_DONTNEED. Needs no privileges and leaves the rest of the cache alone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree_cache(root: str | Path, everything: bool = False) -> str:
    """Empty the page cache of the files under `root` (of the whole machine if `everything`
    and allowed); return how: "drop_caches", "fadvise", or "" if it could not."""
    if everything:
        try:
            subprocess.run(["sync"], check=True)
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    if not hasattr(os, "posix_fadvise"):
        return ""
    for dirpath, _, files in os.walk(root):
        for name in files:
            drop_file_cache(os.path.join(dirpath, name))
    return "fadvise"
