"""What one background operation on a large file costs a training loop that keeps every core
busy: a fresh O_DIRECT write, an overwrite in place, an unlink, paced truncates, a CRC.

    python benchmarks/save/fs_ops.py --size-gib 6 --repeats 2

The loop is 2-thread float32 matmuls (no tiercheck). Per operation, in rotated order: the
loop's rate is measured for 3 s alone, then the operation runs on a thread while the loop
goes on; "loop lost s" is the operation's wall time minus the loop's work in it at the rate
alone, i.e. the training time it took. Beside it the machine-wide CPU split from
/proc/stat, including **steal**: on a virtual machine, time the hypervisor took from this
machine's CPUs (here: the virtual disk's work on writes, allocation and discards).

Operations (each on a file of `--size-gib` in `--dir`, written and let settle before):

* fresh: O_DIRECT 8 MiB writes into a new file (O_TRUNC), fsync file and directory;
* overwrite: the same into the existing file of that size (no O_TRUNC): blocks already
  allocated (what tiercheck's tier 1 does with a recycled shard);
* unlink: unlink the file, then syncfs (ext4 frees its extents; with `discard`, trims);
* truncates: 64 MiB ftruncate steps with an fsync each, then unlink and syncfs (tiercheck's
  paced reclaim before recycling);
* crc: CRC-32C of the buffer on one thread (tiercheck's checksum);
* idle: a 3 s sleep (the noise floor).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import torch

from benchmarks.common import GIB, MIB, O_DIRECT, fs_text, machine_info, rotated, write_file

OPS = ("idle", "crc", "fresh", "overwrite", "unlink", "truncates")
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_split() -> dict[str, float]:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    tick = os.sysconf("SC_CLK_TCK")
    return {k: v / tick for k, v in zip(_STAT_FIELDS, values, strict=True)}


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.size = int(args.size_gib * GIB) // MIB * MIB
        self.root = root
        self.path = root / "big.bin"
        self._mm = mmap.mmap(-1, self.size)  # page-aligned: O_DIRECT writes from it
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.buf.fill_(7)  # fault every page in now
        self.view = memoryview(self._mm)
        self.a, self.b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def unit(self) -> None:
        for _ in range(4):
            torch.mm(self.a, self.b)

    def rate(self, seconds: float) -> float:
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            self.unit()
            n += 1
        return n / (time.perf_counter() - t0)

    def write(self, truncate: bool) -> None:
        write_file(self.buf, self.path, 8 * MIB, truncate=truncate)

    def syncfs(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()  # type: ignore[attr-defined]
        finally:
            os.close(fd)

    def settle(self) -> None:
        self.syncfs()
        time.sleep(3)

    def have_file(self) -> None:
        if not self.path.exists() or self.path.stat().st_size != self.size:
            self.write(True)
            self.settle()

    def truncates(self) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            n = self.size
            while n > 0:
                n = max(0, n - 64 * MIB)
                os.ftruncate(fd, n)
                os.fsync(fd)
        finally:
            os.close(fd)
        self.path.unlink()
        self.syncfs()

    def prepare(self, op: str) -> Callable[[], object]:
        """Set the file up for `op` (outside the timed part); the operation to time."""
        if op == "fresh":
            if self.path.exists():
                self.path.unlink()
                self.settle()
            return lambda: self.write(True)
        if op == "crc":
            from tiercheck.format.checksum import checksum_function

            crc = checksum_function("crc32c")
            return lambda: crc(self.view)
        if op == "idle":
            return lambda: time.sleep(3)
        self.have_file()
        if op == "overwrite":
            return lambda: self.write(False)
        if op == "unlink":
            return lambda: (self.path.unlink(), self.syncfs())
        if op == "truncates":
            return self.truncates
        raise ValueError(op)

    def measure(self, op: str) -> dict[str, float]:
        go = self.prepare(op)
        base = self.rate(3.0)
        done = threading.Event()
        out: dict[str, float] = {}

        def run() -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                go()
            finally:
                out["wall_s"] = time.perf_counter() - t0
                out["thread_cpu_s"] = time.thread_time() - c0
                done.set()

        s0, t0, n = cpu_split(), time.perf_counter(), 0
        worker = threading.Thread(target=run, name=f"fs-op-{op}")
        worker.start()
        while not done.is_set():
            self.unit()
            n += 1
        t1, s1 = time.perf_counter(), cpu_split()
        worker.join()
        out["loop_lost_s"] = (t1 - t0) - n / base
        for k in ("user", "system", "iowait", "steal"):
            out[f"{k}_s"] = s1[k] - s0[k]
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    p.add_argument("--dir", default=None, help="where the file is written (default: a temp dir here)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    for op in ops:
        if op not in OPS:
            p.error(f"unknown operation {op!r}")
    if not O_DIRECT:
        sys.exit("os.O_DIRECT is not available here")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(dir=args.dir or ".", prefix="fs-ops-") as tmp:
        bench = Bench(args, Path(tmp))
        info = machine_info(Path(tmp))
        for _ in range(20):
            bench.unit()  # warm up
        results: dict[str, list[dict[str, float]]] = {op: [] for op in ops}
        for r in range(args.repeats):
            for op in rotated(ops, r):
                res = bench.measure(op)
                results[op].append(res)
                print(
                    f"  {op:10s} wall {res['wall_s']:6.2f}s  loop lost {res['loop_lost_s']:6.2f}s  "
                    f"thread CPU {res['thread_cpu_s']:5.2f}s  steal {res['steal_s']:5.2f}s",
                    file=sys.stderr,
                )
                time.sleep(2)
    print(f"\n{args.size_gib:g} GiB, {args.repeats} repeats, medians; machine load at start {info['loadavg_start']}")
    print(f"target: {fs_text(info['target_fs'])}, repo {info['git_rev']}\n")
    cols = ("wall_s", "loop_lost_s", "thread_cpu_s", "user_s", "system_s", "iowait_s", "steal_s")
    print("| operation | " + " | ".join(c.removesuffix("_s").replace("_", " ") + " s" for c in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for op in ops:
        row = [statistics.median(x[c] for x in results[op]) for c in cols]
        print(f"| {op} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
