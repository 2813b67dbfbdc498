#!/usr/bin/env python3
"""Lost training time per save: what a checkpoint really costs a training loop.

A real training loop (an MLP or a small decoder-only transformer, Adam, synthetic data;
CPU, or CUDA when present) checkpoints every ``--every`` steps. The method used for each
save rotates through the methods under test, so every method sees the same state, the
same process and the same machine noise (interleaved, order rotated every repeat).

For each save it records, from per-step timestamps:

* **stall**: time the loop is blocked in the save call, plus any wait the method adds
  before the next ``optimizer.step()`` (DCP's ``staging_completion``, tiercheck's
  ``handle.wait_staged()`` for an overlapped save);
* **durable**: from the save call to the checkpoint being durable (fsynced) on disk;
* **steps/s during the background write** against the loop's baseline steps/s (the
  median step time of the clean steps just before the save);
* **lost training seconds** = wall time of the window from the save call to the end of
  the ``--tail-steps``-th step after durable, minus (steps in that window x baseline step
  time). That is the stall plus the integrated slowdown of the steps that overlapped the
  background write (slowdown = lost - stall).

Methods (``--methods``, default all):

  none                no checkpoint: the same accounting on a window of clean steps,
                      i.e. the noise floor of "lost seconds"
  memcpy              blocking copy of every tensor into one preallocated, pre-faulted
                      buffer (torch ``copy_``, intra-op threads): the floor for a stall
  odirect_writer      that copy, then a ~60-line writer thread: O_DIRECT writes of
                      ``--odirect-block`` bytes from the aligned buffer, fsync
  tiercheck           ``Checkpointer.save(step, state)`` then ``handle.wait()``
  tiercheck_overlap   ``save(step, state, overlap=True)``; ``handle.wait_staged()`` before
                      the next optimizer step
  tiercheck_memory    (not in the default set) ``Checkpointer(memory=True, keep_memory=1)``:
                      tier 0, the host buffers are files in ``--memory-dir``, the step
                      is committed there and then written to tier 1; ``handle.wait()``
  tiercheck_normal_prio
                      (not in the default set) ``Checkpointer(low_priority=False)``: the
                      writer threads keep the training loop's CPU/IO priority
  torch_save          ``torch.save`` of the state dicts + flush + fsync (blocking)
  dcp_save            ``torch.distributed.checkpoint.save`` (blocking)
  dcp_async_thread    ``dcp.async_save``, THREAD executor, a reused ``DefaultStager``
                      with async staging (wait for ``staging_completion`` before the next
                      optimizer step)
  dcp_async_thread_sync
                      the same with ``use_async_staging=False`` (copy before returning)
  dcp_async_process   PROCESS executor, reused ``DefaultStager`` with shared memory and
                      async staging (needs a process group: a 1-rank gloo group is made)
  torchsnapshot       ``Snapshot.async_take`` then ``wait()`` (+ fsync of its files, as it
                      never fsyncs), if ``torchsnapshot`` imports

Outputs: JSON (every sample and every step's timestamps), a markdown table, and PNG
timelines (training throughput around the save, per method, plus an overview) when
matplotlib is installed.

Usage::

    python benchmarks/stall/stall.py --quick                       # ~1 minute smoke run
    python benchmarks/stall/stall.py --size-gib 1 --repeats 7 --out bench_out/stall --img-dir docs/img
    python benchmarks/stall/stall.py --model transformer --size-gib 1
    tiercheck bench --quick                                  # same script, from a checkout
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*`, also for `tiercheck bench`

from benchmarks.common import MIB, machine_info
from benchmarks.stall.isolate import run_isolated
from benchmarks.stall.measure import ALL_METHODS, METHOD_CLASSES, Bench, end_child_processes
from benchmarks.stall.plot import plot
from benchmarks.stall.report import build_report, naive_writer_table, to_markdown
from benchmarks.stall.workloads import now


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="tiercheck bench" if os.environ.get("TIERCHECK_BENCH_PROG") else "stall.py",
        description="Lost training time per checkpoint save, for tiercheck and the usual alternatives.",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 repeats: about a minute (CI smoke)")
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--size-gib", type=float, default=None, help="params + Adam moments (default 1.0; quick 0.03)")
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma-separated GiB, e.g. 1,3,8: one run per size, one after the other (a report each, named "
        "NAME_<size>g, and a table of ratios to the naive O_DIRECT writer across sizes); overrides --size-gib",
    )
    ap.add_argument("--width", type=int, default=0, help="MLP width / transformer d_model (default: from size)")
    ap.add_argument("--depth", type=int, default=None, help="MLP layers / transformer blocks (default 8 / 6)")
    ap.add_argument("--batch", type=int, default=None, help="default: 16 (MLP), 1 (transformer)")
    ap.add_argument("--seq", type=int, default=64, help="transformer sequence length")
    ap.add_argument("--vocab", type=int, default=8192, help="transformer vocabulary")
    ap.add_argument("--optim", choices=("adam-fused", "adam-foreach", "adam"), default="adam-fused")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    ap.add_argument(
        "--methods",
        default=",".join(ALL_METHODS),
        help="comma-separated, default all but tiercheck_normal_prio and tiercheck_memory; of: "
        + ", ".join(METHOD_CLASSES),
    )
    ap.add_argument("--repeats", type=int, default=None, help="saves per method (default 7; quick 2)")
    ap.add_argument("--every", type=int, default=None, help="steps from one save to the next, at least (default 10)")
    ap.add_argument(
        "--pre-steps", type=int, default=None, help="clean steps before a save for its baseline (default 6)"
    )
    ap.add_argument(
        "--tail-steps", type=int, default=None, help="steps after durable counted in the window (default 1)"
    )
    ap.add_argument("--noise-steps", type=int, default=None, help="window length of the 'none' method (default 4)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps before the first save (default 5)")
    ap.add_argument("--max-window-s", type=float, default=300.0, help="stop counting a window after this long")
    ap.add_argument("--odirect-block", type=int, default=8 * MIB, help="bytes per O_DIRECT write (baseline)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir under --out)")
    ap.add_argument("--memory-dir", default="/dev/shm", help="tier 0 of tiercheck_memory (a temp dir under it)")
    ap.add_argument("--out", default="bench_out/stall", help="output directory for JSON and markdown")
    ap.add_argument("--img-dir", default=None, help="PNG directory (default: OUT/img)")
    ap.add_argument("--name", default=None, help="file name stem (default: stall_<model>[_quick])")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only rewrite markdown + PNGs from a JSON report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--isolate",
        type=int,
        default=0,
        metavar="K",
        help="run each method in processes of its own, K saves each, alternating (with `none` in each), "
        "merged into one report: for a state whose buffers do not fit twice in memory (no plots)",
    )
    a = ap.parse_args(argv)
    q = a.quick

    def pick(v: Any, normal: Any, quick: Any) -> Any:
        return v if v is not None else (quick if q else normal)

    a.size_gib = pick(a.size_gib, 1.0, 0.03)
    a.sizes = [float(x) for x in a.sizes.split(",") if x.strip()] if a.sizes else []
    a.depth = pick(a.depth, 8 if a.model == "mlp" else 6, 4 if a.model == "mlp" else 2)
    a.batch = pick(a.batch, 16 if a.model == "mlp" else 1, 8 if a.model == "mlp" else 1)
    a.repeats = pick(a.repeats, 7, 2)
    a.every = pick(a.every, 10, 4)
    a.pre_steps = pick(a.pre_steps, 6, 3)
    a.tail_steps = pick(a.tail_steps, 1, 1)
    a.noise_steps = pick(a.noise_steps, 4, 2)
    a.warmup_steps = pick(a.warmup_steps, 5, 2)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_CLASSES]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {', '.join(METHOD_CLASSES)}")
    a.methods = methods
    if a.pre_steps < 2:
        ap.error("--pre-steps must be at least 2")
    if a.tail_steps < 1 or a.noise_steps < 1:
        ap.error("--tail-steps and --noise-steps must be at least 1")
    a.name_given = a.name
    a.name = a.name or f"stall_{a.model}" + ("_quick" if q else "")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:  # redo the markdown and PNGs from a JSON report; no measuring
        rep = json.loads(Path(args.replot).read_text())
        rep["notes"] = [n for n in rep.get("notes", []) if "matplotlib" not in n]
        args.name = args.name_given or Path(args.replot).stem
        return write_outputs(rep, args, out)
    if args.isolate:
        args.no_plots = True  # the children's timelines have clocks of their own
    if not args.sizes:
        return write_outputs(measure(args), args, out)
    stem, reps = args.name, []
    for size in args.sizes:
        args.size_gib, args.name = size, f"{stem}_{size:g}g"
        rep = measure(args)
        write_outputs(rep, args, out)
        reps.append(rep)
        gc.collect()
    md = naive_writer_table(reps)
    (out / f"{stem}_sizes.md").write_text(md)
    print(md)
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    return run_isolated(args) if args.isolate else run_one(args)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="stall-", dir=args.dir or out))
    info = machine_info(root)
    info["loadavg_start"] = os.getloadavg()
    t0 = now()
    bench = None
    try:
        bench = Bench(args, root)
        bench.run()
    finally:
        if bench is not None:
            bench.close()
        else:
            end_child_processes()
        shutil.rmtree(root, ignore_errors=True)
    return build_report(bench, info, now() - t0)


def write_outputs(rep: dict[str, Any], args: argparse.Namespace, out: Path) -> int:
    if not args.no_plots:
        img_dir = Path(args.img_dir) if args.img_dir else out / "img"
        rep["images"] = plot(rep, img_dir, args.name)
    jpath = out / f"{args.name}.json"
    mpath = out / f"{args.name}.md"
    jpath.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    md = to_markdown(rep)
    mpath.write_text(md)
    print(md)
    print(
        f"# wrote {jpath}, {mpath}" + (f" and {len(rep.get('images', []))} PNGs" if rep.get("images") else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
