"""Where tiercheck's time to durable goes on a large state, part by part (no training loop).

    python benchmarks/save/durable_parts.py --size-gib 3 --repeats 4

Per repeat, in rotated order, on the same fp32 state (`--tensors` equal tensors):

* naive: copy into a pre-faulted buffer, O_DIRECT writes of 8 MiB from one thread, fsync of
  file and directory (no checksum, no manifest, no retention);
* tiercheck keep_local=1: `save()` then `handle.wait()` then `ckpt.wait()` (retention of the
  previous step included), with `handle.stats` (stall, copy, time to durable on tier 1);
* tiercheck without pruning: the same with `keep_local` larger than the run (nothing deleted);

and apart, the parts: the copy alone, CRC-32C of the whole buffer on one thread (wall and
that thread's CPU seconds), the O_DIRECT write alone, the fsync, and the unlink of a file
of the state's size (ext4 frees its extents in the unlink call).

Each method's process CPU seconds are recorded too (the process does nothing else): what a
save would take from a training loop's cores. `--no-keep-all` leaves the run without pruning
out, so that a larger state fits in memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import torch

import tiercheck
from benchmarks.common import GIB, MIB, PlainBuffer, fsync_path, machine_info, rotated, summary, write_file
from tiercheck.format.checksum import checksum_function

now = time.perf_counter


def make_state(size_gib: float, n: int) -> dict[str, torch.Tensor]:
    each = int(size_gib * GIB) // 4 // n
    return {f"t{i:03d}": torch.randn(each) for i in range(n)}


class Run:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.root = root
        self.state = make_state(args.size_gib, args.tensors)
        self.plain = PlainBuffer(self.state.values())
        self.crc = checksum_function("crc32c")
        self.keep1 = tiercheck.Checkpointer(local=str(root / "keep1"), keep_local=1)
        self.ckpts = [self.keep1]
        if args.keep_all:
            self.keep_all = tiercheck.Checkpointer(local=str(root / "keepall"), keep_local=args.repeats + 2)
            self.ckpts.append(self.keep_all)
        for c in self.ckpts:
            c.prepare(self.state)
        self.samples: dict[str, list[float]] = {}
        self.step = 0
        self.n = 0

    def add(self, key: str, v: float) -> None:
        self.samples.setdefault(key, []).append(v)

    def naive(self) -> None:
        self.n += 1
        path = self.root / f"naive-{self.n}.bin"
        c0, t0 = time.process_time(), now()
        self.plain.copy()
        t1 = now()
        write_file(self.plain.buf, path, 8 * MIB)
        t2, c2 = now(), time.process_time()
        self.add("naive durable", t2 - t0)
        self.add("naive durable: process CPU s", c2 - c0)
        self.add("naive copy", t1 - t0)
        self.add("naive write+fsync", t2 - t1)
        t3 = now()
        path.unlink()
        fsync_path(self.root)
        self.add("unlink of a state-sized file + dir fsync", now() - t3)

    def tiercheck(self, ckpt: Any, label: str) -> None:
        self.step += 1
        c0, t0 = time.process_time(), now()
        h = ckpt.save(self.step, self.state)
        t1 = now()
        h.wait()
        t2 = now()
        ckpt.wait()
        t3, c3 = now(), time.process_time()
        st = h.stats
        self.add(f"{label}: save() stall", t1 - t0)
        self.add(f"{label}: of it, copy (stats.stage_s)", st.stage_s)
        self.add(f"{label}: background (save return -> handle.wait)", t2 - t1)
        self.add(f"{label}: durable (handle.wait)", t2 - t0)
        self.add(f"{label}: tier 1 durable (stats.tier_s)", st.tier_s.get("local", float("nan")))
        self.add(f"{label}: ckpt.wait() return (retention done)", t3 - t0)
        self.add(f"{label}: save() to ckpt.wait(), process CPU s", c3 - c0)

    def parts(self) -> None:
        t0 = now()
        self.plain.copy()
        self.add("copy alone", now() - t0)
        mv = memoryview(self.plain.buf.numpy()).cast("B")
        c0, t0 = time.thread_time(), now()
        for off in range(0, len(mv), 32 * MIB):  # tiercheck checksums in pieces as well
            self.crc(mv[off : off + 32 * MIB])
        self.add("CRC-32C of the state, one thread (wall)", now() - t0)
        self.add("CRC-32C of the state, one thread (CPU s)", time.thread_time() - c0)

    def close(self) -> None:
        for c in self.ckpts:
            c.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=3.0)
    ap.add_argument("--tensors", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--dir", default="bench_out")
    ap.add_argument("--no-keep-all", dest="keep_all", action="store_false", help="leave out the run without pruning")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="durable-parts-", dir=args.dir))
    info = machine_info(root)
    t_start = now()
    try:
        run = Run(args, root)
        methods = [
            ("naive", run.naive),
            ("keep1", lambda: run.tiercheck(run.keep1, "tiercheck keep_local=1")),
            ("parts", run.parts),
        ]
        if args.keep_all:
            methods.insert(2, ("keepall", lambda: run.tiercheck(run.keep_all, "tiercheck, no pruning")))
        for _, fn in methods:  # warm-up: first saves, first files
            fn()
        run.samples.clear()
        for r in range(args.repeats):
            for name, fn in rotated(methods, r):
                print(f"# repeat {r + 1}: {name}", file=sys.stderr, flush=True)
                fn()
        run.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(t.numel() * 4 for t in run.state.values())
    print(
        f"state {nbytes / GIB:.2f} GiB in {args.tensors} fp32 tensors, {args.repeats} repeats (rotated); "
        f"repo {info['git_rev']}, {info['cpu_count']} CPUs ({info['cpu_model']}); load avg "
        f"{info['loadavg_start'][0]:.1f} -> {os.getloadavg()[0]:.1f}; {now() - t_start:.0f} s"
    )
    print("| part | median s | min s | max s |\n|---|---:|---:|---:|")
    for k, v in run.samples.items():
        s = summary(v)
        assert s is not None
        print(f"| {k} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")


if __name__ == "__main__":
    main()
