"""What tier 0 adds to a save, without a training loop: `Checkpointer(memory=True)` beside the
same Checkpointer without it, saves interleaved in one process.

    python benchmarks/save/tier0_save_cost.py --size-gib 1 --repeats 7

Per repeat, in rotated order, each of the two Checkpointers saves the same state (fp32
tensors, changed in place before every save) and waits until it is durable on every tier.
Recorded per save: the stall (time `save()` blocked), the time to tier 0 (`memory`) and to
tier 1 (`local`, durable: fsynced), and the CPU seconds the process used from the call to
durable (`os.times()`: user + system of every thread). CPU seconds barely move with other
jobs' load on a shared machine, where the lost training time of benchmarks/stall (a noise
floor of seconds on a loaded 2-core machine) cannot resolve a few per cent.

Both Checkpointers are prepared and saved twice before the recorded saves, so every host
buffer exists (tier 0's default is two: the newest step stays in memory while the next is
copied). Everything the run makes is removed at the end, also on an error or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

import torch

import tiercheck
from benchmarks.common import GIB, machine_info, rotated

METHODS = ("tier1", "tier0+tier1")


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def one_save(ckpt: Any, step: int, state: dict[str, torch.Tensor]) -> dict[str, float]:
    for t in state.values():
        t.add_(1.0)  # the state changes between saves, as in training
    c0 = cpu_s()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    h = ckpt.save(step, state)
    t1 = time.perf_counter()
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    h.wait()
    t2 = time.perf_counter()
    c1 = cpu_s()
    f2 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    st = h.stats
    return {
        "stall_s": t1 - t0,
        "durable_s": t2 - t0,
        "memory_s": st.tier_s.get("memory", float("nan")),
        "local_s": st.tier_s.get("local", float("nan")),
        "cpu_s": c1 - c0,
        "faults_in_save": float(f1 - f0),  # minor page faults (4 KiB each) while save() ran
        "faults_to_durable": float(f2 - f0),
        "allocated": float(bool(getattr(st, "allocated", False))),
    }


def _on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--tensors", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default="bench_out")
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tier0-save-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="tier0-save-", dir=args.memory_dir)
    info = machine_info(Path(work))
    n = int(args.size_gib * GIB) // 4 // args.tensors
    state = {f"t{i:03d}": torch.randn(n, generator=torch.Generator().manual_seed(i)) for i in range(args.tensors)}
    nbytes = 4 * n * args.tensors
    ckpts: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    try:
        ckpts["tier1"] = tiercheck.Checkpointer(local=os.path.join(work, "t1"), keep_local=1)
        ckpts["tier0+tier1"] = tiercheck.Checkpointer(
            local=os.path.join(work, "t01"), keep_local=1, memory=True, memory_dir=shm, job_id="bench", keep_memory=1
        )
        step = 0
        for ck in ckpts.values():
            ck.prepare(state)
        for _ in range(2):  # every host buffer allocated and touched
            for ck in ckpts.values():
                step += 1
                one_save(ck, step, state)
        for rep in range(args.repeats):
            for name in rotated(METHODS, rep):
                step += 1
                r = one_save(ckpts[name], step, state)
                rows.append({"repeat": rep, "method": name, **r})
                print(
                    f"  {name:12s} stall {r['stall_s']:.3f} s  tier 0 {r['memory_s']:.3f} s  durable "
                    f"{r['durable_s']:.3f} s  cpu {r['cpu_s']:.2f} s  faults {r['faults_in_save']:.0f} in save(), "
                    f"{r['faults_to_durable']:.0f} to durable" + ("  (allocated)" if r["allocated"] else ""),
                    file=sys.stderr,
                )
    finally:
        for ck in ckpts.values():
            ck.close()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    load_end = os.getloadavg()

    def med(method: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["method"] == method)

    def paired(key: str) -> float:
        by: dict[int, dict[str, float]] = {}
        for r in rows:
            by.setdefault(r["repeat"], {})[r["method"]] = r[key]
        return statistics.median(d["tier0+tier1"] / d["tier1"] for d in by.values() if d["tier1"] > 0)

    lines = [
        f"state {nbytes / GIB:.2f} GiB ({args.tensors} fp32 tensors), {args.repeats} repeats, revision "
        f"{info['git_rev']}, load avg {info['loadavg_start'][0]:.1f} -> {load_end[0]:.1f}; medians",
        "",
        "| | stall s | tier 0 s | durable (tier 1) s | CPU s per save | minor faults in save() |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in METHODS:
        mem = "-" if m == "tier1" else f"{med(m, 'memory_s'):.3f}"
        lines.append(
            f"| {m} | {med(m, 'stall_s'):.3f} | {mem} | {med(m, 'durable_s'):.3f} | {med(m, 'cpu_s'):.2f} | "
            f"{med(m, 'faults_in_save'):.0f} |"
        )
    ratios = {k: (med("tier0+tier1", k) / med("tier1", k), paired(k)) for k in ("stall_s", "durable_s", "cpu_s")}
    lines.append(
        "| **with / without tier 0** (paired) | "
        + " | ".join(
            f"**{ratios[k][0]:.2f}x** ({ratios[k][1]:.2f}x)" + (" | -" if k == "stall_s" else "")
            for k in ("stall_s", "durable_s", "cpu_s")
        )
        + " | - |"
    )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": rows, "ratios": ratios, "table": table}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
