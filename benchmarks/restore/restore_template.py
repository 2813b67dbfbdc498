"""Restore into a live template: time and peak memory of a model + Adam state, per revision.

    python benchmarks/restore/restore_template.py --size-gib 1 --repeats 3 \
        --rev new=. --rev old=/path/to/older/checkout

The state is an MLP whose parameters take a third of `--size-gib`, and its Adam optimizer
(two moments: the other two thirds). It is saved once with the first revision. Each
measurement then runs in a fresh process for one revision (`PYTHONPATH` set to that
checkout), revisions interleaved: build the model and optimizer, take one optimizer step
so the optimizer state exists (the live template of a job that restores after a
rollback), then time `ckpt.restore(state)` and report the growth of peak RSS during it
(VmHWM, reset just before the restore). A restore that reads into the template's own tensors grows RSS by little
more than its read buffers; one that holds a second copy of the weights grows by the
state's size.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch


def build(size_gib: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    params = int(size_gib * (1 << 30) / 3 / 4)
    layers = max(1, params // (width * width + width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def child(directory: str, size_gib: float) -> None:
    import tiercheck

    model, opt = build(size_gib)
    state = {"model": model, "opt": opt}
    before = reset_peak()
    t0 = time.perf_counter()
    with tiercheck.Checkpointer(local=directory, keep_local=None) as ckpt:
        step = ckpt.restore(state)
    seconds = time.perf_counter() - t0
    after = peak_kib()
    print(json.dumps({"step": step, "seconds": seconds, "peak_growth_mib": (after - before) / 1024}))


def peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak() -> int:
    """Reset the peak RSS to the current RSS (Linux: clear_refs 5); return it in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_kib()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rev", action="append", default=[], help="NAME=CHECKOUT (repeatable)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.size_gib)
        return
    revs = [r.split("=", 1) for r in (args.rev or ["current=."])]
    with tempfile.TemporaryDirectory(dir=".") as directory:
        env0 = dict(os.environ, PYTHONPATH=os.path.abspath(revs[0][1]))
        save = (
            f"import sys, tiercheck; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "from restore_template import build;"
            f"m, o = build({args.size_gib});"
            f"c = tiercheck.Checkpointer(local={directory!r}); c.save(1, {{'model': m, 'opt': o}}); c.close()"
        )
        subprocess.run([sys.executable, "-c", save], check=True, env=env0)
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in revs}
        for _ in range(args.repeats):
            for name, path in revs:
                env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
                out = subprocess.run(
                    [sys.executable, __file__, "--child", directory, "--size-gib", str(args.size_gib)],
                    check=True,
                    env=env,
                    capture_output=True,
                    text=True,
                ).stdout
                results[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"restore of a {args.size_gib} GiB model + Adam state into a live template, {args.repeats} runs")
    print("| revision | median s | min s | median peak RSS growth MiB |")
    print("|---|---:|---:|---:|")
    for name, runs in results.items():
        secs = [r["seconds"] for r in runs]
        growth = [r["peak_growth_mib"] for r in runs]
        print(f"| {name} | {statistics.median(secs):.3f} | {min(secs):.3f} | {statistics.median(growth):.0f} |")


if __name__ == "__main__":
    main()
