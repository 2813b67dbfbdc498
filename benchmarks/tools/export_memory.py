"""Peak memory of `tiercheck export` / `tiercheck import` on a large checkpoint, per format.

    python benchmarks/tools/export_memory.py --size-gib 2 [--largest-mib 256] [--dir DIR] [--json OUT]

Builds one tiercheck step of `--size-gib` GiB of float32 tensors (the largest one
`--largest-mib` MiB, the rest 64 MiB each), then runs each operation in a fresh child
process and reports, over the operation alone (the child's memory after importing torch
and tiercheck is the baseline):

- peak anonymous RSS growth (``RssAnon`` in /proc/self/status, sampled every 5 ms): the
  memory the operation allocates;
- peak total RSS growth (``VmHWM``, exact): that plus file pages mapped into the process
  (an import maps its source file; those pages are clean page cache the kernel may
  drop under pressure, but they count in RSS while mapped);
- wall time.

Operations: export to .safetensors, .pt and a DCP directory, and import of each of those
files back; all streamed, so each must stay near a fixed buffer (8 MiB) plus the largest
tensor (DCP's reader: about three times the largest tensor), whatever the checkpoint's size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MiB = 1 << 20


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def child(op: str, src: str, dest: str) -> dict[str, Any]:
    import torch.distributed.checkpoint.state_dict_loader  # noqa: F401 - DCP's modules (~90 MiB) are baseline too

    import tiercheck  # noqa: F401 - the baseline includes the library and torch
    from tiercheck.tools import export_step, import_step

    base_anon = status_kib("RssAnon")
    base_rss = status_kib("VmRSS")
    peak_anon = base_anon
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_anon
        while not stop.is_set():
            peak_anon = max(peak_anon, status_kib("RssAnon"))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if op.startswith("export"):
        result = export_step(src, dest)
        nbytes = result.bytes
    else:
        imported = import_step(src, dest, 1)
        nbytes = imported.bytes
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    peak_anon = max(peak_anon, status_kib("RssAnon"))
    return {
        "op": op,
        "bytes": nbytes,
        "seconds": round(seconds, 2),
        "peak_anon_growth_mib": round((peak_anon - base_anon) / 1024, 1),
        "peak_rss_growth_mib": round((status_kib("VmHWM") - base_rss) / 1024, 1),
        "baseline_rss_mib": round(base_rss / 1024, 1),
    }


def build(root: str, size_gib: float, largest_mib: int) -> tuple[int, int]:
    import torch

    import tiercheck

    total = int(size_gib * (1 << 30))
    tensors: dict[str, torch.Tensor] = {"embed.weight": torch.randn(largest_mib * MiB // 4 // 1024, 1024)}
    left = total - largest_mib * MiB
    i = 0
    while left > 0:
        n = min(64 * MiB, left)
        tensors[f"layers.{i}.weight"] = torch.randn(n // 4)
        left -= n
        i += 1
    with tiercheck.Checkpointer(local=root) as ck:
        ck.save(0, {"model": tensors, "step": 0})
    return sum(t.nbytes for t in tensors.values()), max(t.nbytes for t in tensors.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--largest-mib", type=int, default=256)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir, removed after)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", nargs=3, metavar=("OP", "SRC", "DEST"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    scratch = args.dir or tempfile.mkdtemp(prefix="tiercheck-export-mem-")
    os.makedirs(scratch, exist_ok=True)
    try:
        ckpt = os.path.join(scratch, "ckpt")
        size, largest = build(ckpt, args.size_gib, args.largest_mib)
        print(f"checkpoint: {size / MiB:.0f} MiB of tensors, largest {largest / MiB:.0f} MiB ({ckpt})", flush=True)
        ops = [
            ("export-safetensors", ckpt, os.path.join(scratch, "out.safetensors")),
            ("export-pt", ckpt, os.path.join(scratch, "out.pt")),
            ("export-dcp", ckpt, os.path.join(scratch, "out_dcp") + "/"),
            ("import-safetensors", os.path.join(scratch, "out.safetensors"), os.path.join(scratch, "in_st")),
            ("import-pt", os.path.join(scratch, "out.pt"), os.path.join(scratch, "in_pt")),
            ("import-dcp", os.path.join(scratch, "out_dcp"), os.path.join(scratch, "in_dcp")),
        ]
        results = []
        print(f"{'operation':<20} {'time s':>7} {'anon MiB':>9} {'rss MiB':>8}  (growth over the child's baseline)")
        for op, src, dest in ops:
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--child", op, src, dest],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "TIERCHECK_PROGRESS": "0"},
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            results.append(r)
            print(
                f"{op:<20} {r['seconds']:>7} {r['peak_anon_growth_mib']:>9} {r['peak_rss_growth_mib']:>8}", flush=True
            )
        doc = {"checkpoint_mib": round(size / MiB), "largest_tensor_mib": round(largest / MiB), "results": results}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
