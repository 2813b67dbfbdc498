#!/usr/bin/env python3
"""How low can a restore of many small tensors go under the format? (issue 25, restore)

Issue 25 asks for a restore within 1.5x of a plain read + ``copy_`` of the same bytes. Two
parts of a tiercheck restore are not a choice of the implementation: the manifest is JSON
naming every leaf (DESIGN section 4), and every byte read is checked against its entry's
checksum (invariant 2). This measures those two alone, as a lower bound, beside the plain
read + ``copy_`` and tiercheck's restore, in one process, methods interleaved:

  plain      -- ``readinto`` of a file of the same bytes, then ``copy_`` of every view into
                the target tensors (`many_tensors.Restores`, page cache dropped)
  tiercheck  -- ``Checkpointer.restore(target, step)`` (page cache dropped)
  json       -- ``json.loads`` of the manifest's bytes (in memory), the collector paused:
                the bare parse, with no validation, no hook and no binding
  digests    -- the checksum of every entry computed from one buffer already holding the
                shard's bytes (in memory): one C call per entry, nothing else

``json + digests`` leaves out reading the files, binding the template and copying, so it is
less than any restore that parses this format and verifies every entry can take. Reported:
medians of ``--repeats``, each ratio to plain the median of per-repeat ratios.

    python benchmarks/restore/restore_floor.py --counts 1000,20000,140000 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import KIB, MIB, machine_info, rotated
from benchmarks.save import many_tensors as mt


def floor_parts(root: Path, step: int) -> tuple[bytes, bytes, list[tuple[int, int]], str]:
    """The manifest's bytes, the shard's bytes, each entry's (offset, length), the algorithm."""
    from tiercheck.format import naming
    from tiercheck.format.manifest import decode_manifest

    step_dir = root / "tc" / naming.step_dir_name(step)
    raw = (step_dir / naming.manifest_name(0, 1)).read_bytes()
    manifest = decode_manifest(raw, "manifest")
    files = {e.file for e in manifest.entries}
    assert len(files) == 1, files  # one rank, one shard
    shard = (step_dir / files.pop()).read_bytes()
    return raw, shard, [(e.offset, e.length) for e in manifest.entries], manifest.checksum_algorithm


def measure(count: int, leaf_bytes: int, repeats: int, work: Path) -> dict[str, Any]:
    from tiercheck.format.checksum import checksum_function

    saves = mt.Saves(mt.make_state(count, leaf_bytes), Path(tempfile.mkdtemp(prefix=f"floor{count}_", dir=work)), 0)
    try:
        restores = mt.Restores(saves)
        raw, shard, spans, algorithm = floor_parts(saves.root, saves.step)
        digest = checksum_function(algorithm)
        view = memoryview(shard)

        def parse() -> float:
            gc.disable()
            try:
                return mt.timed(lambda: json.loads(raw))
            finally:
                gc.enable()

        def digests() -> float:
            return mt.timed(lambda: [digest(view[o : o + n]) for o, n in spans])

        methods = {"plain": lambda: restores.run("plain"), "tiercheck": lambda: restores.run("tiercheck")}
        methods |= {"json": parse, "digests": digests}
        got: dict[str, list[float]] = {m: [] for m in methods}
        for r in range(repeats):
            for m in rotated(list(methods), r):
                gc.collect()
                got[m].append(methods[m]())
        per = [{m: got[m][i] for m in methods} for i in range(repeats)]  # one repeat's times, for the paired ratios
        return {
            "count": count,
            "leaf_bytes": leaf_bytes,
            "manifest_bytes": len(raw),
            "ms": {m: statistics.median(v) * 1e3 for m, v in got.items()},
            "floor_over_plain": statistics.median((p["json"] + p["digests"]) / p["plain"] for p in per),
            "tiercheck_over_plain": statistics.median(p["tiercheck"] / p["plain"] for p in per),
            "json_over_plain": statistics.median(p["json"] / p["plain"] for p in per),
        }
    finally:
        saves.close()


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| state | manifest | plain read+copy_ | json.loads | digests | json + digests / plain | tiercheck restore "
        "| tiercheck / plain | json / plain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["ms"]
        lines.append(
            f"| {r['count']:,} x {r['leaf_bytes'] / KIB:g} KiB | {r['manifest_bytes'] / MIB:.2f} MiB "
            f"| {ms['plain']:.1f} | {ms['json']:.1f} | {ms['digests']:.1f} | **{r['floor_over_plain']:.2f}x** "
            f"| {ms['tiercheck']:.1f} | {r['tiercheck_over_plain']:.2f}x | {r['json_over_plain']:.2f}x |"
        )
    return "\n".join([*lines, "", "(times in ms, medians; ratios: medians of per-repeat ratios)"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="1000,5000,20000,140000")
    ap.add_argument("--constant-mib", type=float, default=16.0, help="bytes in all, held constant across counts")
    ap.add_argument("--leaf-kib", type=float, default=4.0, help="bytes per leaf of the growing series")
    ap.add_argument("--series", default="constant,growing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = machine_info(Path(tempfile.gettempdir()))
    rows = []
    with tempfile.TemporaryDirectory(prefix="tc-floor-") as work:
        for series in args.series.split(","):
            for count in map(int, args.counts.split(",")):
                per_leaf = args.constant_mib * MIB / count if series == "constant" else args.leaf_kib * KIB
                rows.append(measure(count, int(per_leaf) // 4 * 4, args.repeats, Path(work)))
                print(f"{series} {count}: {json.dumps(rows[-1]['ms'])}", flush=True)
    print(f"\nrevision {info['git_rev']}, {info['cpu_count']} CPUs, load average {info['loadavg_start'][0]:.2f}\n")
    print(report(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
