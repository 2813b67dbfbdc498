"""Upload speed of the remote tier: tiercheck vs a plain fsspec ``put_file`` of the same
shard file to the same S3 server (SeaweedFS, started here from tests/helpers/servers), side by side.

    python benchmarks/remote/upload_speed.py --size-mib 512 --repeats 5 --json out.json
    python benchmarks/remote/upload_speed.py --quick

Per repeat, methods in rotated order:

(a) tiercheck upload: ``save()`` a step into a Checkpointer(local=..., remote=s3://...);
    the time from its local commit to its remote commit (``SaveStats.tier_s["remote"] -
    tier_s["local"]``): shard, manifest and marker uploaded from the committed tier-1 files;
(b) plain ``fs.put_file`` of a copy of the same shard file (s3fs defaults: 50 MiB parts,
    up to 10 uploaded concurrently), page cache dropped for it first (tier 1 writes with
    O_DIRECT, so tiercheck reads it cold too);
(e) the same ``put_file`` with ``max_concurrency=1`` (parts one at a time), which shows what
    uploading parts concurrently is worth on this server;
(d) plain ``fs.open(path, "wb", block_size=16 MiB)`` streaming the same file in 16 MiB writes,
    the s3fs call RemoteTier made before it sent parts in parallel (it still does on stores
    without multipart calls).

Over loopback the server is the limit; ``benchmarks/remote/network_speed.py`` measures the same
methods through a shaped link, where parts in flight matter.

And from (a)'s runs: (c) time from calling ``save()`` to ``handle.wait("remote")`` returning
(durable on the remote tier), and the ``save()`` stall itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import fsspec  # noqa: E402
import torch  # noqa: E402

import tiercheck  # noqa: E402
from benchmarks.common import drop_file_cache  # noqa: E402
from tests.helpers.servers import SeaweedFS  # noqa: E402
from tiercheck.format import naming  # noqa: E402

MiB = 1 << 20
SHARD = naming.shard_name(0, 1)


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    """fp32 random tensors (incompressible), 64 MiB at most each."""
    g = torch.Generator().manual_seed(0)
    left = size_mib * MiB // 4
    state: dict[str, torch.Tensor] = {}
    i = 0
    while left > 0:
        n = min(16 * MiB, left)
        state[f"layer{i:03d}.weight"] = torch.randn(n, generator=g)
        left -= n
        i += 1
    return state


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        cmd = ["git", "-C", REPO, "status", "--porcelain", "tiercheck"]
        dirty = subprocess.run(cmd, capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="64 MiB, 3 repeats (unless given explicitly)")
    ap.add_argument("--dir", default=os.path.join(REPO, "bench_out"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        if "--size-mib" not in sys.argv:
            args.size_mib = 64
        if "--repeats" not in sys.argv:
            args.repeats = 3
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="upload-", dir=args.dir)
    # SeaweedFS puts unix sockets in its work dir: keep that path short
    server_dir = tempfile.mkdtemp(prefix="tc-bench-weed-")
    server = SeaweedFS(server_dir)
    load_start = os.getloadavg()
    try:
        server.start()
        # The same client options for every method: credentials and endpoint, s3fs defaults.
        opts: dict[str, Any] = {
            "key": server.KEY,
            "secret": server.SECRET,
            "endpoint_url": server.endpoint_url,
            "skip_instance_cache": True,
        }
        results = run(args, root, server, opts)
    finally:
        server.close()
        shutil.rmtree(server_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    results["load_avg_start"] = load_start
    results["load_avg_end"] = os.getloadavg()
    report(args, results)


def run(args: argparse.Namespace, root: str, server: SeaweedFS, opts: dict[str, Any]) -> dict[str, Any]:
    state = make_state(args.size_mib)
    url = f"{server.url_root}/bench-{os.getpid()}"
    fs = fsspec.filesystem("s3", **opts)
    local = os.path.join(root, "tier1")
    ckpt = tiercheck.Checkpointer(local=local, remote=url, storage_options=opts, keep_local=1, keep_remote=1)
    ref = os.path.join(root, "shard-copy.bin")
    times: dict[str, list[float]] = {"a": [], "b": [], "e": [], "d": [], "c": [], "stall": []}
    step = 0

    def tiercheck_upload() -> None:
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        h = ckpt.save(step, state)
        h.wait("remote")
        durable = time.perf_counter() - t0
        ckpt.wait()  # retention too, so it does not overlap the next method
        st = h.stats
        times["a"].append(st.tier_s["remote"] - st.tier_s["local"])
        times["c"].append(durable)
        times["stall"].append(st.stall_s)

    def put_file() -> None:
        drop_file_cache(ref)
        t0 = time.perf_counter()
        fs.put_file(ref, f"{url}-put/{SHARD}")
        times["b"].append(time.perf_counter() - t0)

    def put_file_sequential() -> None:
        drop_file_cache(ref)
        t0 = time.perf_counter()
        fs.put_file(ref, f"{url}-put1/{SHARD}", max_concurrency=1)
        times["e"].append(time.perf_counter() - t0)

    def streamed() -> None:
        drop_file_cache(ref)
        t0 = time.perf_counter()
        with open(ref, "rb") as src, fs.open(f"{url}-open/{SHARD}", "wb", block_size=16 * MiB) as f:
            while chunk := src.read(16 * MiB):
                f.write(chunk)
        times["d"].append(time.perf_counter() - t0)

    try:
        # warm-up (not timed): buffers, connections, the reference copy of the shard
        ckpt.save(0, state).wait()
        ckpt.wait()
        shutil.copyfile(os.path.join(local, naming.step_dir_name(0), SHARD), ref)
        fs.put_file(ref, f"{url}-put/{SHARD}")
        shard_bytes = os.path.getsize(ref)
        step_bytes = sum(info["size"] for info in fs.ls(f"{url}/{naming.step_dir_name(0)}", detail=True))
        methods: list[tuple[str, Callable[[], None]]] = [
            ("a", tiercheck_upload),
            ("b", put_file),
            ("e", put_file_sequential),
            ("d", streamed),
        ]
        for rep in range(args.repeats):
            k = rep % len(methods)
            for _name, fn in methods[k:] + methods[:k]:
                fn()
            print(
                f"repeat {rep + 1}/{args.repeats}: "
                + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in ("a", "b", "e", "d", "c")),
                flush=True,
            )
        # the uploaded step is bit-exact in the bucket
        got = tiercheck.load(url, storage_options=opts)
        assert all(torch.equal(got[k], v) for k, v in state.items())
    finally:
        ckpt.close()
    return {"times": times, "shard_bytes": shard_bytes, "step_bytes": step_bytes, "state_bytes": args.size_mib * MiB}


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    times = r["times"]
    sizes = {"a": r["step_bytes"], "c": r["step_bytes"]} | dict.fromkeys("bed", r["shard_bytes"])
    labels = {
        "a": "a. tiercheck upload (local commit -> remote commit)",
        "b": "b. fsspec put_file of the shard",
        "e": "e. fsspec put_file, max_concurrency=1",
        "d": "d. s3fs open('wb', 16 MiB blocks) of the shard (parts one at a time)",
        "c": "c. tiercheck save() -> durable on remote",
        "stall": "   tiercheck save() stall",
    }
    mibs = {m: sizes[m] / MiB / statistics.median(times[m]) for m in sizes}
    ratio = mibs["a"] / mibs["b"]
    ratio_stream = mibs["a"] / mibs["d"]
    ratio_min = (sizes["a"] / min(times["a"])) / (sizes["b"] / min(times["b"]))
    cpu = platform.processor() or platform.machine()
    print()
    print(
        f"**upload_speed**: state {r['state_bytes'] / MiB:.0f} MiB fp32 (step {r['step_bytes'] / MiB:.1f} MiB "
        f"on the bucket), {args.repeats} repeats, SeaweedFS on 127.0.0.1 (same machine)"
    )
    print(
        f"machine: {os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, python {platform.python_version()}, "
        f"repo {git_rev()}; load avg start {'/'.join(f'{x:.1f}' for x in r['load_avg_start'])}, "
        f"end {'/'.join(f'{x:.1f}' for x in r['load_avg_end'])}"
    )
    print()
    print("| method | median s | min s | max s | MiB/s @median |")
    print("|---|---:|---:|---:|---:|")
    for m in ("a", "b", "e", "d", "c", "stall"):
        s = summary(times[m])
        rate = f"{mibs[m]:.0f}" if m in mibs else ""
        print(f"| {labels[m]} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} | {rate} |")
    print()
    print(f"tiercheck upload throughput vs put_file: {ratio:.2f}x (target >= 0.8); on the minima {ratio_min:.2f}x")
    print(f"tiercheck upload throughput vs s3fs streamed open('wb'): {ratio_stream:.2f}x")
    if args.json:
        out = {
            **r,
            "summary": {m: summary(v) for m, v in times.items()},
            "mib_per_s": mibs,
            "ratio_vs_put_file": ratio,
            "ratio_vs_put_file_minima": ratio_min,
            "ratio_vs_streamed_open": ratio_stream,
            "repo": git_rev(),
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
