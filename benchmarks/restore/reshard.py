"""Resharding restore (issue 27 item 6), measured side by side in one run with real gloo ranks
on CPU (`restore/reshard_worker.py` is one rank):

    python benchmarks/restore/reshard.py [--part reshard|same|all] [--base CHECKOUT] [--size-mib 384]

``--part reshard``: the state (``--big`` fp32 matrices of 4096 columns, ``--size-mib`` in
all, plus ``--small`` 64x4096 ones) is saved by 4 ranks as DTensors in three layouts (1-D
mesh Shard(0); 2x2 mesh Shard(0), Shard(0); 1-D mesh Shard(1)), each with tiercheck (tier 1,
step 1) and with ``torch.distributed.checkpoint.save`` (one file per saving rank, on the
same disk). Then each restore case (a saved layout restored at another world size, mesh or
placements) runs ``--repeats`` times tiercheck's ``restore`` and ``dcp.load`` into the same
zeroed DTensor template of the target layout, interleaved, order rotated, page cache of
both directories dropped before each call (``--cache cold``, the default) or every file of
both read once before each call (``--cache warm``: both methods read from memory, which
shows what each costs beyond the disk). Reported per case:

1. bytes each rank read against its share (the bytes of its target pieces): shard bytes
   counted through ``ShardFiles.read_into`` (tiercheck), and ``rchar`` of
   ``/proc/self/io`` around the call (both methods: shards, manifests or metadata, and the
   process group's sockets). Target (tiercheck): <= 1.1x.
2. restore time (the slowest rank; median over repeats), tiercheck / DCP. Target <= 0.7x.

``--part same --base CHECKOUT``: restore at the same world size (4) and layout (1-D
Shard(0)) with this checkout (or ``--checkout``) and with ``--base`` (e.g. ``git worktree
add --detach /tmp/base 9f543b3^``, the revision before resharding), each side saving its own
step once, then ``--jobs`` restore jobs per side interleaved (A B B A ...), each job
``--repeats`` cold restores. Target: new / base <= 1.05x.

Every temp dir is removed at the end; ``--json`` writes everything measured.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import MIB, machine_info

HERE = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parent / "reshard_worker.py")

SAVES = {  # name: (mesh, placements), all at 4 ranks
    "1d-S0": ([4], ["S0"]),
    "2x2-S0S0": ([2, 2], ["S0", "S0"]),
    "1d-S1": ([4], ["S1"]),
}
CASES = [  # (saved layout, restore world, mesh, placements)
    ("1d-S0", 2, [2], ["S0"]),
    ("1d-S0", 3, [3], ["S0"]),
    ("2x2-S0S0", 2, [2], ["S0"]),
    ("2x2-S0S0", 3, [3], ["S0"]),
    ("1d-S1", 4, [4], ["S0"]),
    ("1d-S0", 4, [4], ["S1"]),
]


PRIMED = {  # --cache: what each restore call finds in the page cache
    "cold": "page cache dropped before each call",
    "warm": "every file read once before each call",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(mode: str, world: int, spec: dict[str, Any], scratch: Path, timeout: float = 240) -> list[dict[str, Any]]:
    """Run `world` ranks of the worker; their JSON results, by rank."""
    port = free_port()
    outs = [scratch / f"out-{mode}-{r}-{port}.json" for r in range(world)]
    procs = []
    for r in range(world):
        s = dict(spec, out=str(outs[r]))
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, mode, str(r), str(world), str(port), json.dumps(s)],
                cwd=spec["checkout"],
                env={**os.environ, "PYTHONPATH": spec["checkout"], "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        if p.returncode != 0:
            raise SystemExit(f"{mode} rank {r} of {world} failed:\n{logs[r][-4000:]}")
    results = [json.loads(o.read_text()) for o in outs]
    for o in outs:
        o.unlink()
    return results


def tensors(size_mib: int, big: int, small: int) -> list[list[Any]]:
    cols = 4096
    rows = size_mib * MIB // 4 // cols // big
    return [[f"w{i}", rows, cols] for i in range(big)] + [[f"n{i}", 64, cols] for i in range(small)]


def per_call(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Calls grouped by method, each: the slowest rank's time and every rank's bytes."""
    out: dict[str, list[dict[str, Any]]] = {}
    for i, call in enumerate(results[0]["calls"]):
        ranks = [r["calls"][i] for r in results]
        out.setdefault(call["method"], []).append(
            {
                "s": max(c["s"] for c in ranks),
                "shard_bytes": [c["shard_bytes"] for c in ranks],
                "rchar": [c["rchar"] for c in ranks],
                "read_bytes": [c["read_bytes"] for c in ranks],
            }
        )
    return out


def reshard_part(args: argparse.Namespace, scratch: Path, checkout: str) -> dict[str, Any]:
    state = tensors(args.size_mib, args.big, args.small)
    total = sum(r * c * 4 for _, r, c in state)
    print(f"state: {len(state)} fp32 tensors, {total / MIB:.0f} MiB", flush=True)
    saves: dict[str, Any] = {}
    for name, (mesh, places) in SAVES.items():
        if name not in args.cases_saves:
            continue
        spec = {
            "checkout": checkout, "tensors": state, "mesh": mesh, "placements": places,
            "tc_dir": str(scratch / name / "tc"), "dcp_dir": str(scratch / name / "dcp"),
        }  # fmt: skip
        t0 = time.perf_counter()
        got = job("save", 4, spec, scratch)
        saves[name] = {
            "spec": spec,
            "tiercheck_save_s": max(g["tiercheck_save_s"] for g in got),
            "dcp_save_s": max(g["dcp_save_s"] for g in got),
        }
        print(f"saved {name} at 4 ranks ({time.perf_counter() - t0:.0f} s)", flush=True)
    cases = []
    for saved, world, mesh, places in CASES:
        if saved not in saves:
            continue
        spec = dict(saves[saved]["spec"], mesh=mesh, placements=places, methods=["tiercheck", "dcp"])
        spec["repeats"] = args.repeats
        spec["cache"] = args.cache
        t0 = time.perf_counter()
        got = job("restore", world, spec, scratch)
        calls = per_call(got)
        shares = [g["share_bytes"] for g in got]
        case = {
            "saved": saved,
            "world": world,
            "mesh": mesh,
            "placements": places,
            "share_bytes": shares,
            "calls": calls,
        }
        cases.append(case)
        tc, dc = calls["tiercheck"], calls["dcp"]
        ratio = statistics.median(c["s"] for c in tc) / statistics.median(c["s"] for c in dc)
        worst = max(max(b / s for b, s in zip(c["shard_bytes"], shares, strict=True)) for c in tc)
        print(
            f"{saved} -> {world} {mesh} {places}: tiercheck {statistics.median(c['s'] for c in tc):.2f} s, "
            f"dcp {statistics.median(c['s'] for c in dc):.2f} s ({ratio:.2f}x); "
            f"shard bytes / share up to {worst:.3f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return {"state": state, "total_bytes": total, "saves": saves, "cases": cases}


def same_part(args: argparse.Namespace, scratch: Path, checkout: str) -> dict[str, Any]:
    state = tensors(args.size_mib, args.big, args.small)
    mesh, places = SAVES["1d-S0"]
    sides = {"base": os.path.abspath(args.base), "new": checkout}
    specs = {}
    for side, co in sides.items():
        spec = {
            "checkout": co, "tensors": state, "mesh": mesh, "placements": places,
            "tc_dir": str(scratch / f"same-{side}" / "tc"), "dcp_dir": None,
            "methods": ["tiercheck"], "repeats": args.repeats,
        }  # fmt: skip
        job("save", 4, spec, scratch)
        specs[side] = spec
    samples: dict[str, list[float]] = {"base": [], "new": []}
    for i in range(args.jobs):
        for side in ["base", "new"] if i % 2 == 0 else ["new", "base"]:
            calls = per_call(job("restore", 4, specs[side], scratch))["tiercheck"]
            samples[side].extend(c["s"] for c in calls)
            print(f"job {i + 1}/{args.jobs} {side}: " + ", ".join(f"{c['s']:.2f}" for c in calls) + " s", flush=True)
    b, n = statistics.median(samples["base"]), statistics.median(samples["new"])
    return {"base": sides["base"], "samples": samples, "base_s": b, "new_s": n, "ratio": n / b}


def mib(x: float) -> str:
    return f"{x / MIB:.1f}"


def report(info: dict[str, Any], res: dict[str, Any]) -> str:
    lines = [
        f"revision {info['git_rev']} (tiercheck from {res['checkout']}), torch {info['torch']}, "
        f"{info['cpu_count']} CPUs, load average {info['loadavg_start'][0]:.2f} at start, "
        f"{res['loadavg_end'][0]:.2f} at end; {res['wall_s']:.0f} s",
        "",
    ]
    rs = res.get("reshard")
    if rs:
        lines += [
            f"State: {len(rs['state'])} fp32 tensors, {rs['total_bytes'] / MIB:.0f} MiB, saved by 4 ranks; "
            f"{res['repeats']} {res.get('cache', 'cold')} restores per method and case, interleaved.",
            "",
            "Bytes read per rank (MiB) against its share (the bytes of its target pieces); tiercheck's shard "
            "bytes counted at `ShardFiles.read_into`, `rchar` of /proc/self/io for both (first call):",
            "",
            "| saved at 4 | restored as | rank | share | tiercheck shard bytes | / share | tiercheck rchar "
            "| / share | DCP rchar | / share |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in rs["cases"]:
            tc, dc = c["calls"]["tiercheck"][0], c["calls"]["dcp"][0]
            for r, share in enumerate(c["share_bytes"]):
                sb, rc, dr = tc["shard_bytes"][r], tc["rchar"][r], dc["rchar"][r]
                lines.append(
                    f"| {c['saved']} | {c['world']} {c['mesh']} {'/'.join(c['placements'])} | {r} | {mib(share)} "
                    f"| {mib(sb)} | {sb / share:.3f} | {mib(rc)} | {rc / share:.3f} | {mib(dr)} | {dr / share:.3f} |"
                )
        lines += [
            "",
            f"Restore time (slowest rank, {PRIMED[res.get('cache', 'cold')]}; median [min-max]):",
            "",
            "| saved at 4 | restored as | tiercheck s | DCP load s | tiercheck / DCP (paired) | target <= 0.7 |",
            "|---|---|---:|---:|---:|---|",
        ]
        for c in rs["cases"]:
            t = [x["s"] for x in c["calls"]["tiercheck"]]
            d = [x["s"] for x in c["calls"]["dcp"]]
            ratio = statistics.median(t) / statistics.median(d)
            paired = statistics.median(a / b for a, b in zip(t, d, strict=True))
            lines.append(
                f"| {c['saved']} | {c['world']} {c['mesh']} {'/'.join(c['placements'])} "
                f"| {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}] "
                f"| {statistics.median(d):.2f} [{min(d):.2f}-{max(d):.2f}] | {ratio:.2f} ({paired:.2f}) "
                f"| {'met' if ratio <= 0.7 else 'missed'} |"
            )
        lines += ["", "| saved at 4 | tiercheck save s | DCP save s |", "|---|---:|---:|"]
        for name, s in rs["saves"].items():
            lines.append(f"| {name} | {s['tiercheck_save_s']:.2f} | {s['dcp_save_s']:.2f} |")
    sm = res.get("same")
    if sm:
        b, n = sm["samples"]["base"], sm["samples"]["new"]
        lines += [
            "",
            f"Same world size (4) and layout (1-D Shard(0)), {len(n)} cold restores per side "
            f"({args_jobs(res)} jobs each, interleaved); base {sm['base']}:",
            "",
            "| side | median s | min-max s |",
            "|---|---:|---:|",
            f"| base | {sm['base_s']:.3f} | {min(b):.3f}-{max(b):.3f} |",
            f"| new | {sm['new_s']:.3f} | {min(n):.3f}-{max(n):.3f} |",
            f"| new / base | {sm['ratio']:.3f} | target <= 1.05: {'met' if sm['ratio'] <= 1.05 else 'missed'} |",
        ]
    return "\n".join(lines)


def args_jobs(res: dict[str, Any]) -> int:
    return int(res.get("jobs", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["reshard", "same", "all"], default="reshard")
    ap.add_argument("--checkout", default=str(HERE), help="tiercheck checkout under test (default: this one)")
    ap.add_argument("--base", default=None, help="checkout of the base revision (--part same)")
    ap.add_argument("--size-mib", type=int, default=384, help="bytes of the big matrices in all")
    ap.add_argument("--big", type=int, default=6, help="big matrices (4096 columns)")
    ap.add_argument("--small", type=int, default=6, help="64x4096 matrices")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", choices=list(PRIMED), default="cold", help="the page cache before each restore")
    ap.add_argument("--jobs", type=int, default=4, help="restore jobs per side (--part same)")
    ap.add_argument("--saves", default=",".join(SAVES), help="saved layouts whose cases run")
    ap.add_argument("--scratch", default=None, help="parent of the temp dir (default: the system's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.cases_saves = set(args.saves.split(","))
    if args.part in ("same", "all") and not args.base:
        ap.error("--part same needs --base")
    scratch = Path(tempfile.mkdtemp(prefix="tc-reshard-", dir=args.scratch))
    info = machine_info(scratch)
    checkout = os.path.abspath(args.checkout)
    res: dict[str, Any] = {"checkout": checkout, "repeats": args.repeats, "jobs": args.jobs, "cache": args.cache}
    t0 = time.perf_counter()
    try:
        if args.part in ("reshard", "all"):
            res["reshard"] = reshard_part(args, scratch, checkout)
        if args.part in ("same", "all"):
            res["same"] = same_part(args, scratch, checkout)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t0
    res["loadavg_end"] = os.getloadavg()
    rev = subprocess.run(["git", "-C", checkout, "describe", "--always", "--dirty"], capture_output=True, text=True)
    info["git_rev"] = rev.stdout.strip() or info["git_rev"]
    print()
    print(report(info, res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, **res}, f, indent=1)


if __name__ == "__main__":
    main()
