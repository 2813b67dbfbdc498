#!/usr/bin/env python3
"""The writer's kept manifest texts against building them each save, side by side (issue 25).

While the structure cache gives the writer the same leaves, plan and tree, it keeps each
manifest entry's JSON text but its checksum and the tree's JSON text on the host buffer
(`steps/write.py` `_entry_texts`, `_tree_text`). This measures, in one process and
alternating save by save, the background time of a save (``save()`` returning to
``handle.wait()`` returning: the writer's work on tier 1) of a state of ``--leaves`` fp32
tensors of ``--numel`` elements under three modes:

- ``kept``: as shipped;
- ``tree``: the tree's text built again each save (``_tree_text`` replaced);
- ``neither``: no kept texts (``_entry_texts`` returns None: an entry object a leaf and
  the whole manifest encoded, the path of a changed structure).

The first round is a warm-up and is not counted. Reported: the median per mode and the
ratio to ``neither``.

    python benchmarks/save/writer_texts_ab.py --leaves 20000 --numel 208 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import tiercheck
from tiercheck.format.manifest import tree_json_text
from tiercheck.steps import write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--leaves", type=int, default=20000)
    p.add_argument("--numel", type=int, default=208)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args()

    kept_entries, kept_tree = write._entry_texts, write._tree_text
    modes = {
        "kept": (kept_entries, kept_tree),
        "tree": (kept_entries, lambda job: tree_json_text(job.tree)),
        "neither": (lambda job, shard: None, kept_tree),
    }
    state = {f"l{i}": torch.randn(args.numel) for i in range(args.leaves)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as d, tiercheck.Checkpointer(local=d, keep_local=1, run_log_interval=None) as ck:
        step = 0
        for r in range(args.rounds + 1):
            for name, (entries, tree) in modes.items():
                write._entry_texts, write._tree_text = entries, tree  # type: ignore[assignment]
                step += 1
                handle = ck.save(step, state)
                t0 = time.perf_counter()
                handle.wait()
                if r:
                    times[name].append(time.perf_counter() - t0)
        write._entry_texts, write._tree_text = kept_entries, kept_tree
    base = statistics.median(times["neither"])
    print(f"{args.leaves} leaves x {args.numel * 4} B, {args.rounds} saves per mode")
    print("| mode | background s (median) | / neither |")
    print("|---|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.4f} | {med / base:.2f} |")


if __name__ == "__main__":
    main()
