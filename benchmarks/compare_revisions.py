"""Two revisions of tiercheck side by side: the save stall, time to durable and restore time
of the same workload, each revision in its own process, interleaved (A B B A ...), so a
refactor can show that it costs nothing on a noisy machine.

    python benchmarks/compare_revisions.py --base /path/to/old/checkout [--size-mib 512] [--repeats 6]

`--base` is a checkout (e.g. ``git worktree add --detach /tmp/base REV``); the other side is
this checkout. Per run: a state of 32 fp32 tensors (`--size-mib` in all) plus a plain
value, 8 saves into a fresh tier-1 directory (``--keep-local``, default 2; each waited
for), then 3
restores into the live state with the shard files dropped from the page cache first
(``POSIX_FADV_DONTNEED``). Reported per revision: median stall (``handle.stats.stall_s``),
median time to durable on tier 1 (``tier_s["local"]``, retention included since each save
is waited for with ``ckpt.wait()``), median cold restore, and the ratio new/base.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, os, sys, tempfile, time
import torch
import tiercheck

size_mib, n_tensors = int(sys.argv[1]), 32
keep = int(sys.argv[3]) or None
per = size_mib * (1 << 20) // 4 // n_tensors
state = {"model": {f"w{i}": torch.randn(per) for i in range(n_tensors)}, "step": 0}
root = tempfile.mkdtemp(prefix="tc-rev-", dir=sys.argv[2])

def drop_cache(d):
    for dirpath, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

stalls, durable, restores = [], [], []
with tiercheck.Checkpointer(local=root, keep_local=keep, run_log_interval=None) as ckpt:
    ckpt.prepare(state)
    for step in range(8):
        state["step"] = step
        for t in state["model"].values():
            t.add_(1.0)
        t0 = time.perf_counter()
        h = ckpt.save(step, state)
        ckpt.wait()
        total = time.perf_counter() - t0
        if step >= 2:  # the first saves fault in the buffer and the files' extents
            stalls.append(h.stats.stall_s)
            durable.append(total)
    for _ in range(3):
        os.sync()
        drop_cache(root)
        t0 = time.perf_counter()
        ckpt.restore(state)
        restores.append(time.perf_counter() - t0)
import shutil
shutil.rmtree(root, ignore_errors=True)
print(json.dumps({"stall": stalls, "durable": durable, "restore": restores}))
"""


def run(checkout: str, size_mib: int, scratch: str, keep: int) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=checkout)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(size_mib), scratch, str(keep)],
        env=env,
        cwd=checkout,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, list[float]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="checkout of the base revision")
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--keep-local", type=int, default=2, help="keep_local of the runs; 0 keeps every step")
    ap.add_argument("--scratch", default=None, help="directory for the tier-1 files (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    scratch = args.scratch or tempfile.mkdtemp(prefix="tc-compare-")
    sides = {"base": os.path.abspath(args.base), "new": HERE}
    samples: dict[str, dict[str, list[float]]] = {k: {"stall": [], "durable": [], "restore": []} for k in sides}
    for i in range(args.repeats):
        order = ["base", "new"] if i % 2 == 0 else ["new", "base"]
        for side in order:
            got = run(sides[side], args.size_mib, scratch, args.keep_local)
            for k, v in got.items():
                samples[side][k].extend(v)
            print(
                f"repeat {i + 1}/{args.repeats} {side}: "
                + ", ".join(f"{k} {statistics.median(v) * 1e3:.0f} ms" for k, v in got.items()),
                flush=True,
            )
    load = os.getloadavg()[0]
    print(
        f"\n{args.size_mib} MiB, keep_local={args.keep_local or None}, {args.repeats} runs each, load {load:.1f}"
    )
    print("| metric | base (median) | new (median) | new / base |")
    print("|---|---:|---:|---:|")
    report: dict[str, dict[str, float]] = {}
    for k in ("stall", "durable", "restore"):
        b, n = statistics.median(samples["base"][k]), statistics.median(samples["new"][k])
        report[k] = {"base_s": b, "new_s": n, "ratio": n / b}
        print(f"| {k} | {b * 1e3:.0f} ms | {n * 1e3:.0f} ms | {n / b:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_mib": args.size_mib, "load": load, "samples": samples, "report": report}, f, indent=1)


if __name__ == "__main__":
    main()
