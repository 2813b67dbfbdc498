#!/usr/bin/env python3
"""Many small tensors beyond save and restore: the first save, `tiercheck.load`, the CLI
(`inspect`, `verify`, `export`) and a multi-rank save with its commit, from 1,000 to 140,000
leaves (issue 25, item 3): does each grow linearly with the leaves?

For each count (``--counts``), a state of fp32 tensors of ``--floats`` elements each
(`many_tensors.make_state`), in one run:

- first save: ``Checkpointer.save()`` of a fresh checkpointer (the full flatten and plan) and
  its time to durable on tier 1; then ``--repeats`` cached saves (stall, durable);
- load: ``tiercheck.load(root)`` in this process (reads, verifies, builds the tensors);
- CLI: ``tiercheck inspect``, ``tiercheck verify`` and ``tiercheck export --to x.safetensors``
  as subprocesses, median of 3, each minus the same command's median time on a step of one tensor (its
  start-up: Python, torch and the CLI's imports);
- 2 ranks: two gloo processes each saving ``count / 2`` leaves of its own (tier 1 shared, one
  step directory, rank 0 writes the marker once both manifests are durable), ``--repeats``
  saves each waited for; the slowest rank's median time to durable, commit included.

Reported: the times and microseconds a leaf; a cost that grows linearly keeps its
microseconds a leaf from 1,000 to 140,000 leaves (a quadratic step would multiply them by 140).

    python benchmarks/save/many_tensors_tools.py --counts 1000,20000,140000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script
from benchmarks.common import machine_info

CLI = [sys.executable, "-m", "tiercheck"]
TIMEOUT = 3600


def cli_time(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([*CLI, *args], check=True, stdout=subprocess.DEVNULL, timeout=TIMEOUT)
    return time.perf_counter() - t0


def single(count: int, floats: int, repeats: int, work: Path) -> dict[str, Any]:
    import torch

    import tiercheck
    from benchmarks.save.many_tensors import make_state

    state = make_state(count, floats * 4)
    root = work / f"single{count}"
    out: dict[str, Any] = {}
    with tiercheck.Checkpointer(local=root, keep_local=1, run_log_interval=None) as ckpt:
        t0 = time.perf_counter()
        handle = ckpt.save(0, state)
        out["first_save_stall_s"] = time.perf_counter() - t0
        handle.wait()
        out["first_save_durable_s"] = time.perf_counter() - t0
        stall, durable = [], []
        for step in range(1, repeats + 1):
            t0 = time.perf_counter()
            handle = ckpt.save(step, state)
            stall.append(time.perf_counter() - t0)
            handle.wait()
            durable.append(time.perf_counter() - t0)
        out["save_stall_s"], out["save_durable_s"] = statistics.median(stall), statistics.median(durable)
    t0 = time.perf_counter()
    loaded = tiercheck.load(root)
    out["load_s"] = time.perf_counter() - t0
    assert len(loaded) == count and all(torch.equal(loaded[k], v) for k, v in state.items())
    del loaded
    for name, base in cli_baseline(work).items():
        got = statistics.median(cli_time(cli_args(name, root, work)) for _ in range(3))
        out[f"{name}_s"] = got - base  # the command's own work, its start-up (a 1-leaf step's time) taken off
        out[f"{name}_total_s"] = got
    shutil.rmtree(root)
    return out


def cli_args(name: str, root: Path, work: Path) -> list[str]:
    if name == "export":
        dest = work / "x.safetensors"
        dest.unlink(missing_ok=True)
        return ["export", str(root), "--to", str(dest)]
    return [name, str(root)]


_BASELINE: dict[str, float] = {}


def cli_baseline(work: Path) -> dict[str, float]:
    """Each command's time on a step of one tensor (median of 3): the start-up (Python,
    torch, the CLI's imports) that every count pays alike."""
    if not _BASELINE:
        import torch

        import tiercheck

        root = work / "tiny"
        with tiercheck.Checkpointer(local=root, run_log_interval=None) as ckpt:
            ckpt.save(0, {"w": torch.zeros(64)}).wait()
        for name in ("inspect", "verify", "export"):
            _BASELINE[name] = statistics.median(cli_time(cli_args(name, root, work)) for _ in range(3))
        shutil.rmtree(root)
    return _BASELINE


WORKER = r"""
import json, os, statistics, sys, time
sys.path.insert(0, sys.argv[6])
import torch, torch.distributed as dist
import tiercheck
from benchmarks.save.many_tensors import make_state
rank, world, port, count, floats, repeats, root = (int(sys.argv[1]), 2, sys.argv[2], int(sys.argv[3]),
                                                   int(sys.argv[4]), int(sys.argv[5]), sys.argv[7])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
state = {f"r{rank}.{k}": v for k, v in make_state(count // world, floats * 4).items()}
durable = []
with tiercheck.Checkpointer(local=root, keep_local=1, run_log_interval=None) as ckpt:
    ckpt.save(0, state).wait()
    for step in range(1, repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(step, state).wait()
        durable.append(time.perf_counter() - t0)
dist.barrier()
print(json.dumps({"rank": rank, "durable_s": statistics.median(durable)}))
dist.destroy_process_group()
"""


def two_ranks(count: int, floats: int, repeats: int, work: Path) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = work / f"ranks{count}"
    here = str(Path(__file__).resolve().parents[2])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, str(r), str(port), str(count), str(floats), str(repeats), here, str(root)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    results = []
    for p in procs:
        stdout, _ = p.communicate(timeout=TIMEOUT)
        if p.returncode:
            raise RuntimeError(f"a rank exited with {p.returncode}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    shutil.rmtree(root)
    return {"two_ranks_durable_s": max(r["durable_s"] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1000,20000,140000")
    ap.add_argument("--floats", type=int, default=64, help="elements per tensor")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="many_tools_"))
    print(json.dumps(machine_info(work)), file=sys.stderr)
    rows = []
    for count in map(int, args.counts.split(",")):
        row: dict[str, Any] = {"leaves": count, "loadavg_start": os.getloadavg()[0]}
        row.update(single(count, args.floats, args.repeats, work))
        row.update(two_ranks(count, args.floats, args.repeats, work))
        row["loadavg_end"] = os.getloadavg()[0]
        rows.append(row)
        keys = [k for k in row if k.endswith("_s") and not k.endswith("_total_s")]
        print(
            f"{count:>7,} leaves: "
            + ", ".join(f"{k[:-2]} {row[k]:.3f} s ({row[k] / count * 1e6:.1f} us)" for k in keys)
            + f" | load {row['loadavg_start']:.1f}->{row['loadavg_end']:.1f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(work), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
