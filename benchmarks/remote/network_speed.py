"""The remote tier at network speed: upload and restore through a shaped link, side by side
with fsspec, s3fs and DCP moving the same bytes to the same S3 server.

    python benchmarks/remote/network_speed.py --size-mib 256 --repeats 3 --json out.json
    python benchmarks/remote/network_speed.py --quick              # 32 MiB, 1 repeat: a smoke run

SeaweedFS is started on 127.0.0.1, and a shaping proxy (tests/helpers/servers/shapingproxy.py, in a
process of its own) in front of it caps each TCP connection at ``--rate-mbps`` (25 MB/s)
and adds ``--rtt-ms`` (20 ms) of round trip: what one S3 connection gets on a real network.
Per repeat, methods in rotated order, all through the proxy unless marked direct:

upload
  up_tiercheck   ``save()`` into Checkpointer(local=..., remote=s3://...): time from the local
                 commit to the remote commit (``SaveStats.tier_s``), i.e. the committed tier-1
                 files uploaded (parallel multipart, ``remote_concurrency`` parts in flight),
                 manifest and marker after them
  up_put_file    ``fs.put_file`` of a copy of the shard (s3fs: 50 MiB parts, 10 in flight)
  up_open_wb     ``fs.open(path, "wb")`` written in 16 MiB blocks (s3fs: parts one at a time)
  up_dcp         ``dcp.save`` through ``FsspecWriter(thread_count=N)`` (N files in parallel)
  up_*_direct    the same without the proxy: the server's own ceiling over loopback
restore
  dn_tiercheck   ``restore()`` on a fresh node (empty local dir) from the bucket into a
                 preallocated template (parallel ranged reads, every byte checksummed)
  dn_get_file    ``fs.get_file`` of the shard to a local file (s3fs: 50 MiB ranges, 10 in flight)
  dn_open_rb     ``fs.open(path, "rb")`` read in 16 MiB blocks (one request at a time)
  dn_dcp         ``dcp.load`` into the same template through ``FsspecReader``
  dn_*_direct    without the proxy: the server's ceiling

The link limit of a method is ``rate x connections in flight``, or the server's loopback
ceiling (the best direct method of that direction), whichever is lower; each method's ratio
to its limit is reported. Restore times exclude creating the S3 client (done before the clock
starts, for every method); upload times from tier 1 read a file the page cache was asked to
drop (``POSIX_FADV_DONTNEED``), as the tier-1 writer leaves it. CPU seconds of the client
(this process, all threads), the proxy and the server are reported per method, over the
timed window: on a small machine they share the cores.
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
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

import tiercheck  # noqa: E402
from tests.helpers.servers import SeaweedFS, ShapingProxyProcess  # noqa: E402
from tiercheck.format import naming  # noqa: E402
from tiercheck.steps.catalog import read_manifest, verify_files  # noqa: E402
from tiercheck.tiers.local import LocalTier  # noqa: E402

MiB = 1 << 20
MB = 1e6
SHARD = naming.shard_name(0, 1)
UP = ("up_tiercheck", "up_put_file", "up_open_wb", "up_dcp")
EXTRA = ("up_tiercheck_verify",)
DOWN = ("dn_tiercheck", "dn_get_file", "dn_open_rb", "dn_dcp")
DIRECT = ("up_tiercheck_direct", "up_put_file_direct", "dn_tiercheck_direct", "dn_get_file_direct")
UNCAPPED = ("up_tiercheck_uncapped", "dn_tiercheck_uncapped")
LABELS = {
    "up_tiercheck": "tiercheck upload (local commit -> remote commit)",
    "up_put_file": "fsspec `put_file`",
    "up_open_wb": "s3fs `open('wb')`, 16 MiB blocks",
    "up_dcp": "DCP `FsspecWriter(thread_count={dcp})`",
    "up_tiercheck_direct": "tiercheck upload, direct (no proxy)",
    "up_tiercheck_verify": "  of which: checksum of the tier-1 copy before its upload",
    "up_put_file_direct": "fsspec `put_file`, direct (no proxy)",
    "dn_tiercheck": "tiercheck restore from tier 2 (fresh node)",
    "dn_get_file": "fsspec `get_file`",
    "dn_open_rb": "s3fs `open('rb')`, 16 MiB reads",
    "dn_dcp": "DCP `FsspecReader` (`dcp.load`)",
    "dn_tiercheck_direct": "tiercheck restore, direct (no proxy)",
    "dn_get_file_direct": "fsspec `get_file`, direct (no proxy)",
    "up_tiercheck_uncapped": "tiercheck upload, proxy without a cap (same RTT)",
    "dn_tiercheck_uncapped": "tiercheck restore, proxy without a cap (same RTT)",
}


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    """fp32 random tensors (incompressible), 16 of them (at most 16 MiB each), so that each of
    DCP's threads gets files to write."""
    g = torch.Generator().manual_seed(0)
    left = size_mib * MiB // 4
    each = max(1, min(4 * MiB, left // 16))
    state: dict[str, torch.Tensor] = {}
    while left > 0:
        n = min(each, left)
        state[f"layer{len(state):03d}.weight"] = torch.randn(n, generator=g)
        left -= n
    return state


def drop_file_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (0 if unknown)."""
    if pid is None:
        return time.process_time()  # this process, every thread
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def git_rev() -> str:
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", REPO, "status", "--porcelain", "tiercheck"], capture_output=True, text=True
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except OSError:
        return "?"


class Run:
    """The state, the clients and one timing list per method."""

    def __init__(self, args: argparse.Namespace, root: str, server: SeaweedFS, ports: dict[str, int]) -> None:
        self.args = args
        self.root = root
        self.state = make_state(args.size_mib)
        self.template = {k: torch.zeros_like(v) for k, v in self.state.items()}
        base = {"key": server.KEY, "secret": server.SECRET, "skip_instance_cache": True}
        self.opts = {
            "shaped": dict(base, endpoint_url=f"http://127.0.0.1:{ports['shaped']}"),
            "uncapped": dict(base, endpoint_url=f"http://127.0.0.1:{ports['uncapped']}"),
            "direct": dict(base, endpoint_url=server.endpoint_url),
        }
        self.fs = {k: fsspec.filesystem("s3", **o) for k, o in self.opts.items()}
        self.url = f"{server.url_root}/bench-{os.getpid()}"
        self.times: dict[str, list[float]] = {m: [] for m in (*UP, *DOWN, *DIRECT, *UNCAPPED, *EXTRA)}
        # CPU seconds per method of: this process (client), the shaping proxy, the server
        self.cpu: dict[str, list[tuple[float, float, float]]] = {m: [] for m in self.times}
        self.pids: dict[str, tuple[int | None, int | None, int | None]] = {}  # per link
        self.last_cpu = (0.0, 0.0, 0.0)
        self.durable: list[dict[str, float]] = []  # per tiercheck save: stall and tier_s
        self.step = 0
        self.last = {"shaped": 0, "direct": 0, "uncapped": 0}  # the newest step saved through each link
        self.ckpts = {
            link: tiercheck.Checkpointer(
                local=os.path.join(root, f"tier1-{link}"),
                remote=f"{self.url}/tc-{link}",
                storage_options=self.opts[link],
                keep_local=1,
                keep_remote=1,
                remote_concurrency=args.concurrency,
            )
            for link in ("shaped", "direct", "uncapped")
        }
        self.ref = os.path.join(root, "shard-copy.bin")
        self.shard_bytes = 0
        self.step_bytes = 0

    def close(self) -> None:
        for c in self.ckpts.values():
            c.close()

    def start(self, link: str = "shaped") -> tuple[float, str, list[float]]:
        """Start the clock (wall time and the CPU of client, proxy and server)."""
        return time.perf_counter(), link, [cpu_seconds(p) for p in self.pids[link]]

    def stop(self, started: tuple[float, str, list[float]]) -> float:
        """Stop the clock: record the CPU used since `started`, return the wall seconds."""
        t0, link, cpu0 = started
        elapsed = time.perf_counter() - t0
        used = [cpu_seconds(p) - c for p, c in zip(self.pids[link], cpu0, strict=True)]
        self.last_cpu = (used[0], used[1], used[2])
        return elapsed

    # -- upload ----------------------------------------------------------------------
    def up_tiercheck(self, link: str = "shaped") -> float:
        self.step += 1
        self.last[link] = self.step
        ckpt = self.ckpts[link]
        clock = self.start(link)
        h = ckpt.save(self.step, self.state)
        h.wait("remote")
        durable = self.stop(clock)
        ckpt.wait()  # retention too, so it does not overlap the next method
        st = h.stats
        if link == "shaped":
            # the uploader first checks the tier-1 copy (never spread a damaged one): the same
            # work again, timed alone, with the page cache dropped as the O_DIRECT writer leaves it
            tier1 = os.path.join(self.root, "tier1-shaped")
            shard = os.path.join(tier1, naming.step_dir_name(self.step), SHARD)
            drop_file_cache(shard)
            local = LocalTier(tier1)
            t0 = time.perf_counter()
            verify_files(local, self.step, read_manifest(local, self.step, 0))
            self.times["up_tiercheck_verify"].append(time.perf_counter() - t0)
            self.durable.append(
                {
                    "stall_s": st.stall_s,
                    "local_s": st.tier_s["local"],
                    "remote_s": st.tier_s["remote"],
                    "wall_s": durable,
                }
            )
        return st.tier_s["remote"] - st.tier_s["local"]

    def up_put_file(self, link: str = "shaped") -> float:
        drop_file_cache(self.ref)
        clock = self.start(link)
        self.fs[link].put_file(self.ref, f"{self.url}/put-{link}/{SHARD}")
        return self.stop(clock)

    def up_open_wb(self) -> float:
        drop_file_cache(self.ref)
        clock = self.start()
        with (
            open(self.ref, "rb") as src,
            self.fs["shaped"].open(f"{self.url}/open/{SHARD}", "wb", block_size=16 * MiB) as f,
        ):
            while chunk := src.read(16 * MiB):
                f.write(chunk)
        return self.stop(clock)

    def up_dcp(self) -> float:
        path = f"{self.url}/dcp"
        writer = FsspecWriter(path, thread_count=self.args.dcp_threads, sync_files=False, **self.opts["shaped"])
        writer.fs.exists(path)  # the client is set up before the clock starts
        clock = self.start()
        dcp.save(self.state, storage_writer=writer)
        return self.stop(clock)

    # -- restore ---------------------------------------------------------------------
    def dn_tiercheck(self, link: str = "shaped") -> float:
        fresh = tempfile.mkdtemp(prefix="fresh-", dir=self.root)
        url = f"{self.url}/tc-{link}"
        with tiercheck.Checkpointer(
            local=fresh, remote=url, storage_options=self.opts[link], remote_concurrency=self.args.concurrency
        ) as c:
            assert c.steps("local") == [] and c.steps("remote")  # a fresh node; the client is set up
            clock = self.start(link)
            got = c.restore(self.template)
            elapsed = self.stop(clock)
        assert got == self.last[link]
        shutil.rmtree(fresh, ignore_errors=True)
        return elapsed

    def dn_get_file(self, link: str = "shaped") -> float:
        out = os.path.join(self.root, "got.bin")
        fs = self.fs[link]
        fs.info(f"{self.url}/put-direct/{SHARD}")
        clock = self.start(link)
        fs.get_file(f"{self.url}/put-direct/{SHARD}", out)
        elapsed = self.stop(clock)
        os.unlink(out)
        return elapsed

    def dn_open_rb(self) -> float:
        view = memoryview(bytearray(16 * MiB))
        clock = self.start()
        with self.fs["shaped"].open(
            f"{self.url}/put-direct/{SHARD}", "rb", block_size=16 * MiB, cache_type="none"
        ) as f:
            while f.readinto(view):
                pass
        return self.stop(clock)

    def dn_dcp(self) -> float:
        path = f"{self.url}/dcp"
        reader = FsspecReader(path, **self.opts["shaped"])
        reader.fs.exists(path)  # the client is set up before the clock starts
        clock = self.start()
        dcp.load(self.template, storage_reader=reader)
        return self.stop(clock)

    def methods(self) -> list[tuple[str, Callable[[], float]]]:
        return [
            ("up_tiercheck", self.up_tiercheck),
            ("up_put_file", self.up_put_file),
            ("up_open_wb", self.up_open_wb),
            ("up_dcp", self.up_dcp),
            ("up_tiercheck_direct", lambda: self.up_tiercheck("direct")),
            ("up_put_file_direct", lambda: self.up_put_file("direct")),
            ("dn_tiercheck", self.dn_tiercheck),
            ("dn_get_file", self.dn_get_file),
            ("dn_open_rb", self.dn_open_rb),
            ("dn_dcp", self.dn_dcp),
            ("dn_tiercheck_direct", lambda: self.dn_tiercheck("direct")),
            ("dn_get_file_direct", lambda: self.dn_get_file("direct")),
            ("up_tiercheck_uncapped", lambda: self.up_tiercheck("uncapped")),
            ("dn_tiercheck_uncapped", lambda: self.dn_tiercheck("uncapped")),
        ]


def run(
    args: argparse.Namespace, root: str, server: SeaweedFS, proxies: dict[str, ShapingProxyProcess]
) -> dict[str, Any]:
    r = Run(args, root, server, {k: p.port for k, p in proxies.items()})
    r.pids = {k: (None, p.proc.pid, server.pid) for k, p in proxies.items()} | {"direct": (None, 0, server.pid)}
    try:
        # warm-up (not timed): buffers, clients, connections, every object the reads need
        for link in ("shaped", "direct", "uncapped"):
            r.up_tiercheck(link)
        r.durable.clear()
        r.times["up_tiercheck_verify"].clear()
        shutil.copyfile(os.path.join(root, "tier1-direct", naming.step_dir_name(r.last["direct"]), SHARD), r.ref)
        r.shard_bytes = os.path.getsize(r.ref)
        r.fs["direct"].put_file(r.ref, f"{r.url}/put-direct/{SHARD}")
        r.up_dcp()
        r.dn_open_rb()
        step_dir = f"{r.url}/tc-direct/{naming.step_dir_name(r.last['direct'])}"
        r.step_bytes = sum(i["size"] for i in r.fs["direct"].ls(step_dir, detail=True))
        methods = r.methods()
        loads = []
        for rep in range(args.repeats):
            k = (rep * 5) % len(methods)
            for name, fn in methods[k:] + methods[:k]:
                r.times[name].append(fn())
                r.cpu[name].append(r.last_cpu)
            loads.append(os.getloadavg()[0])
            print(
                f"repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{m} {v[-1]:.2f}s" for m, v in r.times.items()),
                flush=True,
            )
        # the restored template is the state, bit for bit (tiercheck and DCP both wrote into it last)
        r.dn_tiercheck()
        assert all(torch.equal(r.template[k], v) for k, v in r.state.items())
    finally:
        r.close()
    sizes = {m: (r.step_bytes if m.endswith(("tiercheck", "tiercheck_direct")) else r.shard_bytes) for m in r.times}
    sizes["up_dcp"] = sizes["dn_dcp"] = r.shard_bytes  # DCP stores the same tensor bytes (+ metadata)
    return {
        "times": r.times,
        "cpu": r.cpu,
        "sizes": sizes,
        "durable": r.durable,
        "shard_bytes": r.shard_bytes,
        "step_bytes": r.step_bytes,
        "loads": loads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rate-mbps", type=float, default=25.0, help="cap per connection, MB/s (1e6 B/s)")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=8, help="tiercheck's remote_concurrency")
    ap.add_argument("--dcp-threads", type=int, default=8, help="DCP FsspecWriter thread_count")
    ap.add_argument("--quick", action="store_true", help="32 MiB, 1 repeat (unless given explicitly)")
    ap.add_argument("--dir", default=os.path.join(REPO, "bench_out"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.size_mib = args.size_mib if "--size-mib" in sys.argv else 32
        args.repeats = args.repeats if "--repeats" in sys.argv else 1
    os.makedirs(args.dir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="network-", dir=args.dir)
    server_dir = tempfile.mkdtemp(prefix="tc-bench-weed-")  # SeaweedFS puts unix sockets there: keep it short
    server = SeaweedFS(server_dir)
    load_start = os.getloadavg()
    t_start = time.monotonic()
    try:
        server.start()
        rtt = args.rtt_ms / 1e3
        with (
            ShapingProxyProcess(server.port, rate_bps=args.rate_mbps * MB, rtt_s=rtt) as shaped,
            ShapingProxyProcess(server.port, rate_bps=None, rtt_s=rtt) as uncapped,
        ):
            results = run(args, root, server, {"shaped": shaped, "uncapped": uncapped})
    finally:
        server.close()
        shutil.rmtree(server_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    results.update(load_avg_start=load_start, load_avg_end=os.getloadavg(), run_s=time.monotonic() - t_start)
    report(args, results)


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    times, sizes = r["times"], r["sizes"]
    rate = args.rate_mbps
    med = {m: statistics.median(v) for m, v in times.items()}
    mbps = {m: sizes[m] / MB / med[m] for m in times}
    conns = {"up_tiercheck": args.concurrency, "up_put_file": 10, "up_open_wb": 1, "up_dcp": args.dcp_threads}
    conns |= {"dn_tiercheck": args.concurrency, "dn_get_file": 10, "dn_open_rb": 1, "dn_dcp": 1}
    ceiling = {"up": max(mbps["up_tiercheck_direct"], mbps["up_put_file_direct"])}
    ceiling["dn"] = max(mbps["dn_tiercheck_direct"], mbps["dn_get_file_direct"])
    limit = {m: min(rate * conns[m], ceiling[m[:2]]) for m in (*UP, *DOWN)}
    cpu = platform.processor() or platform.machine()
    loads = r["loads"]
    print()
    print(
        f"**network_speed** — state {args.size_mib} MiB fp32 in 16 MiB tensors (tiercheck step "
        f"{r['step_bytes'] / MiB:.1f} MiB on the bucket, shard {r['shard_bytes'] / MiB:.1f} MiB); link: "
        f"{rate:g} MB/s per connection, {args.rtt_ms:g} ms RTT (shaping proxy) to SeaweedFS on 127.0.0.1; "
        f"tiercheck remote_concurrency={args.concurrency}; {args.repeats} repeats, methods interleaved"
    )
    print()
    print(
        f"machine: {os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, python {platform.python_version()}, "
        f"repo {git_rev()}; load avg (1 min) start {r['load_avg_start'][0]:.1f}, after each repeat "
        f"{', '.join(f'{x:.1f}' for x in loads)}, end {r['load_avg_end'][0]:.1f}; run took {r['run_s']:.0f} s"
    )
    print()
    print(
        "| method | connections | median s | min s | max s | MB/s @median | link limit MB/s | / limit "
        "| CPU s: client / proxy / server |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in (UP[0], *EXTRA, *UP[1:], *DOWN, *DIRECT, *UNCAPPED):
        v = times[m]
        label = LABELS[m].format(dcp=args.dcp_threads)
        lim = f"{limit[m]:.0f}" if m in limit else ""
        ratio = f"{mbps[m] / limit[m]:.2f}" if m in limit else ""
        timing = [f"{med[m]:.2f}", f"{min(v):.2f}", f"{max(v):.2f}", f"{mbps[m]:.1f}"]
        cpus = r["cpu"][m]
        cpu = " / ".join(f"{statistics.median(c[i] for c in cpus):.1f}" for i in range(3)) if cpus else ""
        cells = [label, conns.get(m, ""), *timing, lim, ratio, cpu]
        print("| " + " | ".join(map(str, cells)) + " |")
    print()
    up, dn = ceiling["up"], ceiling["dn"]
    print(f"Server ceiling over loopback (best direct method): upload {up:.1f} MB/s, restore {dn:.1f} MB/s.")
    via_up, via_dn = mbps["up_tiercheck_uncapped"], mbps["dn_tiercheck_uncapped"]
    print(
        f"Through the proxy without its cap (same RTT), tiercheck moves {via_up:.1f} MB/s up and {via_dn:.1f} MB/s "
        f"down: what this machine carries with the proxy's CPU in the path; the shaped upload is "
        f"{mbps['up_tiercheck'] / via_up:.2f}x of it, the shaped restore {mbps['dn_tiercheck'] / via_dn:.2f}x."
    )
    print()
    targets = []
    for d, tc, single, peers in (
        ("upload", "up_tiercheck", "up_open_wb", ("up_put_file", "up_open_wb", "up_dcp")),
        ("restore from tier 2", "dn_tiercheck", "dn_open_rb", ("dn_get_file", "dn_open_rb", "dn_dcp")),
    ):
        best = max(peers, key=lambda m: mbps[m])
        targets += [
            (d, ">= 0.8 x link limit", mbps[tc] / limit[tc], 0.8, f"{mbps[tc]:.1f} / {limit[tc]:.1f}"),
            (
                d,
                ">= 4 x one connection",
                mbps[tc] / mbps[single],
                4.0,
                f"{mbps[tc]:.1f} / {mbps[single]:.1f} ({single})",
            ),
            (d, ">= best peer", mbps[tc] / mbps[best], 1.0, f"{mbps[tc]:.1f} / {mbps[best]:.1f} ({best})"),
        ]
    print("| direction | target | MB/s | ratio | met |")
    print("|---|---|---|---:|---|")
    for d, what, ratio, need, detail in targets:
        print(f"| {d} | {what} | {detail} | {ratio:.2f} | {'yes' if ratio >= need else 'no'} |")
    print()
    dur = r["durable"]
    if dur:
        print("tiercheck, per save through the shaped link (`handle.stats`), seconds:")
        print()
        print("| save | stall | durable on tier 1 | durable on tier 2 |")
        print("|---:|---:|---:|---:|")
        for i, d in enumerate(dur, 1):
            print(f"| {i} | {d['stall_s']:.3f} | {d['local_s']:.2f} | {d['remote_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {**r, "mb_per_s": mbps, "limit": limit, "ceiling": ceiling, "args": vars(args), "repo": git_rev()},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
