#!/usr/bin/env python3
"""Packed small entries against the page-aligned layout, side by side (issue 25).

The writer places entries shorter than 64 KiB at 64-byte boundaries (docs/format.md, "Shard
files"); before, every entry started at a multiple of 4096. This runs the same workload under
both layouts in fresh processes, alternating (packed, aligned, aligned, packed, ...), so the
machine's load falls on both alike. The aligned side is the same code with
``tiercheck.plan.shards.PACK_BELOW = 0`` (every entry then starts at a multiple of 4096: the
earlier layout, byte for byte).

Per process, for a state of ``count`` fp32 tensors of ``leaf_bytes`` each
(`many_tensors.make_state`): a `Checkpointer(local=..., keep_local=1)`, `prepare()`, one
warm-up save, then ``--saves`` saves, each waited for: the stall (``save()`` returning) and the
time to durable on tier 1 (``handle.wait()``); the shard's size; then ``--saves`` cold restores
into a template of the same structure (page cache dropped) interleaved with the plain read +
``copy_`` of the same bytes (`many_tensors.Restores`). Reported: medians over the processes of
each process's median, and packed / aligned.

    python benchmarks/save/packing_ab.py --cases 20000x832,140000x112,5000x3352 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script
from benchmarks.common import machine_info


def child(layout: str, count: int, leaf_bytes: int, saves_n: int, work: Path) -> dict[str, Any]:
    import gc

    import tiercheck.plan.shards as shards

    if layout == "aligned":
        shards.PACK_BELOW = 0  # every entry at a multiple of 4096: the layout before packing
    from benchmarks.save.many_tensors import Restores, Saves, make_state

    root = Path(tempfile.mkdtemp(prefix=f"pack_{layout}_", dir=work))
    s = Saves(make_state(count, leaf_bytes), root, dcp_max=0)
    stall, durable = [], []
    try:
        for _ in range(saves_n):
            gc.collect()
            s.step += 1
            t0 = time.perf_counter()
            handle = s.ckpt.save(s.step, s.state)
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            stall.append(t1 - t0)
            durable.append(t2 - t0)
        from tiercheck.format import naming

        shard = root / "tc" / naming.step_dir_name(s.step) / naming.shard_name(0, 1)
        shard_bytes = shard.stat().st_size
        r = Restores(s)
        restore, plain = [], []
        for i in range(saves_n):
            for m in ("plain", "tiercheck") if i % 2 else ("tiercheck", "plain"):
                (plain if m == "plain" else restore).append(r.run(m))
    finally:
        s.close()
    return {
        "layout": layout,
        "stall_s": statistics.median(stall),
        "durable_s": statistics.median(durable),
        "restore_s": statistics.median(restore),
        "plain_s": statistics.median(plain),
        "restore_over_plain": statistics.median(a / b for a, b in zip(restore, plain, strict=True)),
        "shard_bytes": shard_bytes,
    }


def run_child(layout: str, count: int, leaf_bytes: int, saves_n: int, work: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", layout, "--cases", f"{count}x{leaf_bytes}", "--saves", str(saves_n)]
    out = subprocess.run([*cmd, "--dir", work], capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{layout} {count}x{leaf_bytes}: exit {out.returncode}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="20000x832,140000x112,5000x3352,1000x16768", help="COUNTxLEAF_BYTES,...")
    ap.add_argument("--pairs", type=int, default=3, help="processes per layout and case")
    ap.add_argument("--saves", type=int, default=5, help="saves (and restores) per process")
    ap.add_argument("--dir", default=None, help="where files are written (default: a temp dir)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="packing_ab_")
    if args.child:
        ((count, leaf_bytes),) = cases
        print(json.dumps(child(args.child, count, leaf_bytes, args.saves, Path(work))))
        return
    print(json.dumps(machine_info(Path(work))), file=sys.stderr)
    rows = []
    for count, leaf_bytes in cases:
        got: dict[str, list[dict[str, Any]]] = {"packed": [], "aligned": []}
        for i in range(args.pairs):
            for layout in ("packed", "aligned") if i % 2 == 0 else ("aligned", "packed"):
                got[layout].append(run_child(layout, count, leaf_bytes, args.saves, work))
        row: dict[str, Any] = {"leaves": count, "leaf_bytes": leaf_bytes, "loadavg": os.getloadavg()[0]}
        for layout, runs in got.items():
            row[layout] = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "layout"}
        row["packed_over_aligned"] = {
            k: row["packed"][k] / row["aligned"][k] for k in row["packed"] if row["aligned"][k]
        }
        rows.append(row)
        p, a = row["packed"], row["aligned"]
        print(
            f"{count:>7,} x {leaf_bytes:>6,} B"
            f" | shard {a['shard_bytes'] / 2**20:8.1f} -> {p['shard_bytes'] / 2**20:6.1f} MiB"
            f" | stall {a['stall_s'] * 1e3:7.1f} -> {p['stall_s'] * 1e3:7.1f} ms"
            f" | durable {a['durable_s'] * 1e3:7.1f} -> {p['durable_s'] * 1e3:7.1f} ms"
            f" | restore {a['restore_s'] * 1e3:7.1f} -> {p['restore_s'] * 1e3:7.1f} ms"
            f" (plain {a['plain_s'] * 1e3:.1f} / {p['plain_s'] * 1e3:.1f})"
            f" | restore/plain {a['restore_over_plain']:.2f}x -> {p['restore_over_plain']:.2f}x"
            f" | load {row['loadavg']:.1f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(Path(work)), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
