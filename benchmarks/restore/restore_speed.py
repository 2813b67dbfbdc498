"""Restore speed: tiercheck.steps.restore vs a plain preadv of the same bytes into the live tensors
vs torch.load, side by side, cold page cache where the machine allows dropping it.

    python benchmarks/restore/restore_speed.py --size-gib 1 --repeats 5
    python benchmarks/restore/restore_speed.py --sizes 1,3,8 --repeats 5 --no-torch-load

Per repeat, in rotated order: (a) tiercheck restore into the live state (every byte
checksummed), (b) plain: os.preadv of the shard's bytes straight into the same tensors
(no checks), (c) torch.load of a torch.save file of the same state, then copy_ into the
live tensors (``--no-torch-load`` leaves it out: it needs a second copy of the state in
memory). Before each timed read every file the run wrote is evicted from the page cache
with posix_fadvise(POSIX_FADV_DONTNEED) after an fsync, which needs no privileges and
leaves the rest of a shared machine's cache alone; ``--drop-caches`` empties the whole
cache instead (echo 3 > /proc/sys/vm/drop_caches, root only). If neither works the run
says "WARM" and the numbers measure memory copies and checksums, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import torch

import tiercheck
from benchmarks.common import drop_tree_cache
from tiercheck.format import naming
from tiercheck.steps.catalog import read_manifest
from tiercheck.tiers.local import LocalTier


def make_state(size_gib: float) -> dict[str, torch.Tensor]:
    """fp32 tensors of mixed sizes (64 MiB down to 16 KiB); tensor i is `expected(i, n)`."""
    total = int(size_gib * (1 << 30)) // 4
    sizes = [1 << 24, 1 << 22, 1 << 20, 1 << 16, 1 << 12]
    state: dict[str, torch.Tensor] = {}
    i = 0
    while total > 0:
        n = min(sizes[i % len(sizes)], total)
        state[f"t{i}"] = expected(i, n)
        total -= n
        i += 1
    return state


def expected(i: int, n: int) -> torch.Tensor:
    """Tensor i of the state, made again to check a restore without a second copy in memory."""
    return torch.randn(n, generator=torch.Generator().manual_seed(i))


def check(state: dict[str, torch.Tensor], name: str) -> None:
    for i, t in enumerate(state.values()):
        if not torch.equal(t, expected(i, t.numel())):
            raise AssertionError(f"{name}: tensor {i} differs after the read")


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


def measure(size_gib: float, args: argparse.Namespace) -> dict[str, Any]:
    """One size: write the checkpoint (and the torch.save file), then the timed reads."""
    root = tempfile.mkdtemp(prefix="restore-", dir=args.dir)
    try:
        state = make_state(size_gib)
        nbytes = sum(t.numel() * 4 for t in state.values())
        with tiercheck.Checkpointer(local=os.path.join(root, "tc")) as ckpt:
            ckpt.save(1, state).wait()
        torch_path = os.path.join(root, "state.pt")
        if args.torch_load:
            torch.save(state, torch_path)
        tier = LocalTier(os.path.join(root, "tc"))
        manifest = read_manifest(tier, 1, 0)
        shard = tier.path_of(1, naming.shard_name(0, 1))
        by_path = {e.path: e.offset for e in manifest.entries}
        targets = [(by_path[f"state[{k!r}]"], t) for k, t in state.items()]

        def run_tiercheck() -> None:
            with tiercheck.Checkpointer(local=os.path.join(root, "tc")) as c:
                assert c.restore(state) == 1

        def run_plain() -> None:
            plain_preadv(shard, targets)

        def run_torch_load() -> None:
            loaded = torch.load(torch_path, weights_only=True)
            for k, t in state.items():
                t.copy_(loaded[k])

        methods = {"tiercheck restore": run_tiercheck, "plain preadv": run_plain}
        if args.torch_load:
            methods["torch.load + copy_"] = run_torch_load
        times: dict[str, list[float]] = {m: [] for m in methods}
        how: set[str] = set()
        names = list(methods)
        load0 = os.getloadavg()
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                for t in state.values():
                    t.zero_()
                how.add(drop_tree_cache(root, args.drop_caches))
                t0 = time.perf_counter()
                methods[name]()
                times[name].append(time.perf_counter() - t0)
                check(state, name)
        med = {m: statistics.median(v) for m, v in times.items()}
        cold = "" not in how
        out: dict[str, Any] = {
            "size_gib": size_gib,
            "bytes": nbytes,
            "tensors": len(state),
            "repeats": args.repeats,
            "cold": cold,
            "cache": f"cold ({', '.join(sorted(how))})" if cold else "WARM",
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
            "times": times,
            "median": med,
            # tiercheck speed / plain preadv speed = plain time / tiercheck time
            "vs_plain": med["plain preadv"] / med["tiercheck restore"],
            "vs_plain_paired": statistics.median(
                p / t for p, t in zip(times["plain preadv"], times["tiercheck restore"], strict=True)
            ),
        }
        if args.torch_load:
            out["vs_torch_load"] = med["torch.load + copy_"] / med["tiercheck restore"]
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(r: dict[str, Any]) -> str:
    gib = r["bytes"] / (1 << 30)
    lines = [
        f"state {gib:.2f} GiB, {r['tensors']} tensors, {r['repeats']} repeats, cache {r['cache']}, "
        f"load avg {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}",
        "| method | median s | min s | max s | GiB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for m, v in r["times"].items():
        med = r["median"][m]
        lines.append(f"| {m} | {med:.3f} | {min(v):.3f} | {max(v):.3f} | {gib / med:.2f} |")
    lines.append(
        f"\ntiercheck speed vs plain preadv: {r['vs_plain']:.2f}x of medians, {r['vs_plain_paired']:.2f}x paired "
        "(target >= 0.9)"
    )
    if "vs_torch_load" in r:
        lines.append(f"tiercheck speed vs torch.load:   {r['vs_torch_load']:.2f}x (target >= 2.5)")
    return "\n".join(lines) + "\n"


def sizes_table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| state GiB | tiercheck restore s | plain preadv s | tiercheck / preadv speed (paired) | cache | load avg |",
        "|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        t, p = r["median"]["tiercheck restore"], r["median"]["plain preadv"]
        lines.append(
            f"| {r['bytes'] / (1 << 30):.2f} | {t:.3f} | {p:.3f} | **{r['vs_plain']:.2f}x** "
            f"({r['vs_plain_paired']:.2f}x) | {r['cache']} | {r['loadavg_start'][0]:.1f} -> "
            f"{r['loadavg_end'][0]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--sizes", default=None, help="comma-separated GiB, e.g. 1,3,8 (overrides --size-gib)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="bench_out")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-torch-load", dest="torch_load", action="store_false", help="leave torch.load out")
    ap.add_argument(
        "--drop-caches", action="store_true", help="empty the whole page cache (root) instead of the run's files"
    )
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    sizes = [float(x) for x in args.sizes.split(",")] if args.sizes else [args.size_gib]
    results = []
    for size in sizes:
        r = measure(size, args)
        print(report(r), flush=True)
        results.append(r)
    if len(results) > 1:
        print(sizes_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=2)


if __name__ == "__main__":
    main()
