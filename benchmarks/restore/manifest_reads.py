#!/usr/bin/env python3
"""Reading every saved rank's manifest from tier 2, as a rank restoring at another world size
does (issue 27): one after another against `Resharder.MANIFEST_READERS` threads.

A job of ``--world`` real gloo ranks (one process each, a small per-rank state: a DTensor
piece of one sharded tensor and a per-rank int) saves one step to tier 2, a SeaweedFS server
on 127.0.0.1 reached through a shaping proxy with a round trip of ``--rtt-ms`` (the
`tests/helpers/servers/shapingproxy.py` process: every request pays it once, as to a real
object store). Then, in this process, ``Resharder(...).sources()`` (what every new rank does
first: find and verify every saved rank's manifest) is timed with 1 thread and with the
library's count, interleaved, ``--repeats`` each, a fresh filesystem object each time.

    python benchmarks/restore/manifest_reads.py --world 16 --rtt-ms 20 --repeats 5
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.common import machine_info  # noqa: E402
from tests.helpers.servers import SeaweedFS, ShapingProxyProcess  # noqa: E402

SAVE = r"""
import os, sys, json, torch, torch.distributed as dist, tiercheck
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
root, rank, world, url, options = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], json.loads(sys.argv[5])
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "pg"), rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
state = {"w": distribute_tensor(torch.arange(world * 64.0), mesh, [Shard(0)]), "rank": rank}
with tiercheck.Checkpointer(remote=url, storage_options=options, run_log_interval=None, coordination_timeout=300) as ck:
    ck.save(1, state).wait()
dist.destroy_process_group()
"""


def save_job(world: int, url: str, options: dict[str, object], work: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SAVE, str(work), str(r), str(world), url, json.dumps(options)],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errors = [p.communicate(timeout=900)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("\n".join(e[-2000:] for e in errors))


def time_sources(url: str, options: dict[str, object], readers: int) -> float:
    from tiercheck.steps import catalog, reshard
    from tiercheck.tiers.open import open_tier

    tier = open_tier(url, role="remote", storage_options=options)
    step = max(tier.committed_steps())
    marker = catalog.read_marker(tier, step)
    reshard.MANIFEST_READERS = readers
    t0 = time.perf_counter()
    found = reshard.Resharder([tier], step, marker, rank=0, world_size=1).sources()
    elapsed = time.perf_counter() - t0
    assert sorted(found) == list(range(marker.world_size))
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=16)
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tiercheck.steps import reshard

    threads = reshard.MANIFEST_READERS
    work = Path(tempfile.mkdtemp(prefix="tc-mr-"))
    server = SeaweedFS(tempfile.mkdtemp(prefix="tc-mr-weed-"))
    server.start()
    try:
        url = f"{server.url_root}/manifest-reads-{os.getpid()}"
        save_job(args.world, url, server.storage_options_via(server.port), work)
        with ShapingProxyProcess(server.port, rate_bps=None, rtt_s=args.rtt_ms / 1e3) as proxy:
            options = server.storage_options_via(proxy.port)
            got: dict[int, list[float]] = {1: [], threads: []}
            for i in range(args.repeats):
                for n in (1, threads) if i % 2 == 0 else (threads, 1):
                    got[n].append(time_sources(url, options, n))
    finally:
        server.stop()
    one, many = statistics.median(got[1]), statistics.median(got[threads])
    print(
        f"{args.world} saved manifests through a {args.rtt_ms:g} ms round trip: 1 thread {one:.3f} s, "
        f"{threads} threads {many:.3f} s ({one / many:.1f}x); per manifest {one / args.world * 1e3:.1f} ms serial"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(work), "args": vars(args), "s": got}, indent=1))


if __name__ == "__main__":
    main()
