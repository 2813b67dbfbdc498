"""Restore speed: tiercheck.restore vs a plain preadv of the same bytes into the live tensors
vs torch.load, side by side, cold page cache where the machine allows dropping it.

    python benchmarks/restore_speed.py --size-gib 1 --repeats 5

Per repeat, in rotated order: (a) tiercheck restore into the live state (every byte
checksummed), (b) plain: os.preadv of the shard's bytes straight into the same tensors
(no checks), (c) torch.load of a torch.save file of the same state, then copy_ into the
live tensors. Before each timed read the page cache is dropped (echo 3 >
/proc/sys/vm/drop_caches, root only). Where that is refused (a container), every file the
run wrote is evicted instead with posix_fadvise(POSIX_FADV_DONTNEED) after an fsync, which
drops a file's clean pages without privileges; if that is unavailable too the run says
"WARM" and the numbers measure memory copies and checksums, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any

import torch

import tiercheck
from tiercheck import layout
from tiercheck.restore import read_manifest
from tiercheck.tiers.local import LocalTier


def drop_caches(root: str) -> str:
    """Empty the page cache of the files under `root`; return how ("" if it could not)."""
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
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not evicted
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def make_state(size_gib: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    total = int(size_gib * (1 << 30)) // 4
    sizes = [1 << 24, 1 << 22, 1 << 20, 1 << 16, 1 << 12]
    state: dict[str, torch.Tensor] = {}
    i = 0
    while total > 0:
        n = min(sizes[i % len(sizes)], total)
        state[f"t{i}"] = torch.randn(n, generator=g)
        total -= n
        i += 1
    return state


def plain_preadv(shard: str, targets: list[tuple[int, torch.Tensor]]) -> None:
    fd = os.open(shard, os.O_RDONLY)
    try:
        for offset, t in targets:
            view = memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]
            pos = 0
            while pos < len(view):
                pos += os.preadv(fd, [view[pos : pos + (32 << 20)]], offset + pos)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="bench_out")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="restore-", dir=args.dir)
    try:
        state = make_state(args.size_gib)
        nbytes = sum(t.numel() * 4 for t in state.values())
        with tiercheck.Checkpointer(local=os.path.join(root, "tc")) as ckpt:
            ckpt.save(1, state).wait()
        torch_path = os.path.join(root, "state.pt")
        torch.save(state, torch_path)
        tier = LocalTier(os.path.join(root, "tc"))
        manifest = read_manifest(tier, 1, 0)
        shard = tier.path_of(1, layout.shard_name(0, 1))
        by_path = {e.path: e.offset for e in manifest.entries}
        targets = [(by_path[f"state[{k!r}]"], t) for k, t in state.items()]
        expected = {k: t.clone() for k, t in state.items()}

        def run_tiercheck() -> None:
            with tiercheck.Checkpointer(local=os.path.join(root, "tc")) as c:
                assert c.restore(state) == 1

        def run_plain() -> None:
            plain_preadv(shard, targets)

        def run_torch_load() -> None:
            loaded = torch.load(torch_path, weights_only=True)
            for k, t in state.items():
                t.copy_(loaded[k])

        methods = {"tiercheck restore": run_tiercheck, "plain preadv": run_plain, "torch.load + copy_": run_torch_load}
        times: dict[str, list[float]] = {m: [] for m in methods}
        how: set[str] = set()
        names = list(methods)
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                for t in state.values():
                    t.zero_()
                how.add(drop_caches(root))
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
                assert all(torch.equal(state[k], expected[k]) for k in state), name
        med = {m: statistics.median(v) for m, v in times.items()}
        cold = "" not in how
        cache = f"cold ({', '.join(sorted(how))})" if cold else "WARM"
        print(f"state {nbytes / (1 << 30):.2f} GiB, {len(state)} tensors, {args.repeats} repeats, cache {cache}")
        print("| method | median s | min s | max s | GiB/s |")
        print("|---|---:|---:|---:|---:|")
        for m, v in times.items():
            print(f"| {m} | {med[m]:.3f} | {min(v):.3f} | {max(v):.3f} | {nbytes / (1 << 30) / med[m]:.2f} |")
        r_plain = med["plain preadv"] / med["tiercheck restore"]
        r_torch = med["torch.load + copy_"] / med["tiercheck restore"]
        print(f"\ntiercheck speed vs plain preadv: {r_plain:.2f}x (target >= 0.9)")
        print(f"tiercheck speed vs torch.load:   {r_torch:.2f}x (target >= 2.5)")
        if args.json:
            out: dict[str, Any] = {
                "bytes": nbytes,
                "cold": cold,
                "cache": cache,
                "times": times,
                "vs_plain": r_plain,
                "vs_torch_load": r_torch,
            }
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
