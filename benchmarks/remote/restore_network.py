"""Fresh-node restore from tier 2 beside hand-written parallel ranged GETs of the same shard,
through the same shaped link, in one run (issue 23, item 20).

    python benchmarks/remote/restore_network.py             # 64 MiB @ 10 MiB/s x 5, 1 GiB @ 10 MiB/s x 3
    python benchmarks/remote/restore_network.py --cases 64:10:7
    python benchmarks/remote/restore_network.py --profile   # plus one traced restore per case

SeaweedFS on 127.0.0.1; per case a shaping proxy (tests/helpers/servers/shapingproxy.py, a process
of its own) caps each TCP connection at RATE MiB/s and adds ``--rtt-ms`` of round trip. A
case is ``SIZE_MIB:RATE_MIBPS[:REPEATS]`` (repeats default to ``--repeats``). The step is
saved once (without the proxy); then, per repeat, in rotated order, each through the proxy
and each with a fresh S3 client (its connections not yet open; one request made before
the clock starts, as a client that has just listed the bucket):

tiercheck     ``Checkpointer(local=<empty dir>, remote=...).restore(template)``: listing,
              marker, manifest, size, then the shard's ranges into the template's tensors,
              every byte checksummed
ranges        ``--concurrency`` threads, each one ``fs.cat_file(shard, start, end)`` of an
              equal share of the shard, copied into one preallocated buffer (no listing, no
              marker, no manifest, no checksum): the hand-written ideal
one_get       one ``fs.cat_file(shard)`` (cases up to ``--one-get-max-mib``)

``--profile`` traces one more tiercheck restore per case: every request (listing, marker,
manifest, size, each range: when it started and ended, on which thread), how many ranges
were in flight, and the time before the first range and after the last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import fsspec  # noqa: E402
import torch  # noqa: E402

import tiercheck  # noqa: E402
from benchmarks.common import git_rev  # noqa: E402
from tests.helpers.servers import SeaweedFS, ShapingProxyProcess  # noqa: E402
from tiercheck.format import naming  # noqa: E402

MiB = 1 << 20
SHARD = naming.shard_name(0, 1)
METHODS = ("tiercheck", "ranges", "one_get")


def make_state(size_mib: int) -> dict[str, torch.Tensor]:
    """fp32 random tensors (incompressible) of at most 16 MiB each."""
    g = torch.Generator().manual_seed(0)
    left = size_mib * MiB // 4
    state: dict[str, torch.Tensor] = {}
    while left > 0:
        n = min(4 * MiB, left)
        state[f"layer{len(state):03d}.weight"] = torch.randn(n, generator=g)
        left -= n
    return state


class Trace:
    """Requests of one restore: (what, thread, t0, t1, bytes), wrapped around the S3 client."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, str, float, float, int]] = []
        self._lock = threading.Lock()

    def wrap(self, fs: Any) -> None:
        for name in ("find", "cat_file", "info", "ls"):
            orig = getattr(fs, name)

            def traced(*a: Any, _orig: Callable[..., Any] = orig, _name: str = name, **kw: Any) -> Any:
                t0 = time.perf_counter()
                out = _orig(*a, **kw)
                t1 = time.perf_counter()
                what = _name
                if _name == "cat_file":
                    path = str(a[0])
                    what = "range" if path.endswith(SHARD) else f"read {path.rsplit('/', 1)[-1]}"
                n = len(out) if isinstance(out, bytes) else 0
                with self._lock:
                    self.events.append((what, threading.current_thread().name, t0, t1, n))
                return out

            setattr(fs, name, traced)

    def report(self, total: float) -> None:
        ev = sorted(self.events, key=lambda e: e[2])
        print(f"  traced restore: {total:.2f} s; requests (ms from the restore's start):")
        for k, (what, thread, t0, t1, n) in enumerate(ev):
            if 16 <= k < len(ev) - 4:  # a long run of ranges: its start and its end
                if k == 16:
                    print(f"    ... {len(ev) - 20} more ...")
                continue
            size = f" {n / MiB:6.2f} MiB" if n >= MiB else ""
            print(f"    {what:<22} {thread:<26} {1e3 * (t0 - self.t0):8.1f} .. {1e3 * (t1 - self.t0):8.1f}{size}")
        ranges = [e for e in ev if e[0] == "range"]
        if ranges:
            points = sorted([(e[2], 1) for e in ranges] + [(e[3], -1) for e in ranges])
            live = peak = 0
            for _, d in points:
                live += d
                peak = max(peak, live)
            first, last = min(e[2] for e in ranges), max(e[3] for e in ranges)
            busy = sum(e[3] - e[2] for e in ranges)
            print(
                f"  before the first range: {1e3 * (first - self.t0):.0f} ms; ranges {len(ranges)}, at most {peak} in "
                f"flight, from {1e3 * (first - self.t0):.0f} to {1e3 * (last - self.t0):.0f} ms "
                f"(mean {busy / (last - first):.1f} in flight); after the last range: "
                f"{1e3 * (self.t0 + total - last):.0f} ms"
            )


class Case:
    def __init__(
        self, args: argparse.Namespace, server: SeaweedFS, size_mib: int, rate_mibps: float, repeats: int
    ) -> None:
        self.args, self.server, self.repeats = args, server, repeats
        self.size_mib, self.rate = size_mib, rate_mibps
        self.state = make_state(size_mib)
        self.template = {k: torch.zeros_like(v) for k, v in self.state.items()}
        self.url = f"{server.url_root}/restore-net-{os.getpid()}-{size_mib}"
        self.root = tempfile.mkdtemp(prefix="restore-net-", dir=args.dir)
        self.times: dict[str, list[float]] = {m: [] for m in METHODS}
        self.proxy: ShapingProxyProcess | None = None
        self.opts: dict[str, Any] = {}
        self.shard = ""
        self.shard_bytes = 0

    def methods(self) -> list[tuple[str, Callable[[Trace | None], float]]]:
        out: list[tuple[str, Callable[[Trace | None], float]]] = [
            ("tiercheck", self.tiercheck),
            ("ranges", self.ranges),
        ]
        if self.size_mib <= self.args.one_get_max_mib:
            out.append(("one_get", self.one_get))
        return out

    def setup(self) -> None:
        base = {"key": self.server.KEY, "secret": self.server.SECRET, "skip_instance_cache": True}
        with tiercheck.Checkpointer(
            remote=self.url, storage_options=dict(base, endpoint_url=self.server.endpoint_url)
        ) as c:
            c.save(1, self.state).wait(timeout=600)
        self.proxy = ShapingProxyProcess(self.server.port, rate_bps=self.rate * MiB, rtt_s=self.args.rtt_ms / 1e3)
        self.opts = dict(base, endpoint_url=self.proxy.endpoint_url)
        fs = fsspec.filesystem("s3", **self.opts)
        self.shard = f"{fs._strip_protocol(self.url)}/{naming.step_dir_name(1)}/{SHARD}"
        self.shard_bytes = int(fs.info(self.shard)["size"])

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def fresh_fs(self) -> Any:
        fs = fsspec.filesystem("s3", **self.opts)
        fs.info(self.shard)  # the client is set up before the clock starts
        return fs

    def tiercheck(self, trace: Trace | None = None) -> float:
        fresh = tempfile.mkdtemp(prefix="fresh-", dir=self.root)
        with tiercheck.Checkpointer(
            local=fresh, remote=self.url, storage_options=self.opts, remote_concurrency=self.args.concurrency
        ) as c:
            assert c.steps("local") == [] and c.steps("remote") == [1]  # a fresh node; the client is set up
            if trace is not None:
                trace.wrap(c._tier_list("remote")[0].fs)  # type: ignore[attr-defined]
                trace.t0 = time.perf_counter()
            t0 = time.perf_counter()
            got = c.restore(self.template)
            elapsed = time.perf_counter() - t0
        assert got == 1
        shutil.rmtree(fresh, ignore_errors=True)
        return elapsed

    def ranges(self, trace: Trace | None = None) -> float:
        fs = self.fresh_fs()
        n, conc = self.shard_bytes, self.args.concurrency
        buf = memoryview(bytearray(n))
        bounds = [(i * n // conc, (i + 1) * n // conc) for i in range(conc)]

        def get(lo: int, hi: int) -> None:
            data = fs.cat_file(self.shard, start=lo, end=hi)
            assert len(data) == hi - lo
            buf[lo:hi] = data

        with ThreadPoolExecutor(conc) as pool:
            t0 = time.perf_counter()
            for f in [pool.submit(get, lo, hi) for lo, hi in bounds]:
                f.result()
            return time.perf_counter() - t0

    def one_get(self, trace: Trace | None = None) -> float:
        fs = self.fresh_fs()
        t0 = time.perf_counter()
        data = fs.cat_file(self.shard)
        elapsed = time.perf_counter() - t0
        assert len(data) == self.shard_bytes
        return elapsed

    def run(self) -> None:
        self.tiercheck()  # warm-up (not timed): buffers, the server's caches
        methods = self.methods()
        for rep in range(self.repeats):
            k = rep % len(methods)
            for name, fn in methods[k:] + methods[:k]:
                self.times[name].append(fn(None))
            print(
                f"  repeat {rep + 1}/{self.repeats}: "
                + ", ".join(f"{m} {v[-1]:.2f}s" for m, v in self.times.items() if v),
                flush=True,
            )
        for t in self.template.values():  # the template is the state, bit for bit
            t.zero_()
        self.tiercheck()
        assert all(torch.equal(self.template[k], v) for k, v in self.state.items())
        if self.args.profile:
            trace = Trace()
            trace.report(self.tiercheck(trace))

    def summary(self) -> dict[str, Any]:
        med = {m: statistics.median(v) for m, v in self.times.items() if v}
        return {
            "size_mib": self.size_mib,
            "rate_mibps": self.rate,
            "repeats": self.repeats,
            "shard_bytes": self.shard_bytes,
            "times": self.times,
            "median": med,
            "ratio_tiercheck_over_ranges": med["ranges"] / med["tiercheck"],
        }


def report(args: argparse.Namespace, results: list[dict[str, Any]], load: tuple[float, float], run_s: float) -> None:
    print()
    print(
        f"**restore_network**: {args.rtt_ms:g} ms RTT, remote_concurrency={args.concurrency}, methods interleaved; "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, revision {git_rev()}; load avg (1 min) start "
        f"{load[0]:.1f}, end {load[1]:.1f}; run took {run_s:.0f} s"
    )
    print()
    print(
        "| state | per connection | method | repeats | median s | min s | max s | MiB/s @median | ranges / tiercheck |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for m in METHODS:
            v = r["times"][m]
            if not v:
                continue
            med = r["median"][m]
            ratio = f"{r['median']['ranges'] / med:.2f}" if m == "tiercheck" else ""
            print(
                f"| {r['size_mib']} MiB | {r['rate_mibps']:g} MiB/s | {m} | {len(v)} | {med:.2f} | {min(v):.2f} "
                f"| {max(v):.2f} | {r['shard_bytes'] / MiB / med:.1f} | {ratio} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "load": load, "run_s": run_s}, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cases", default="64:10:5,1024:10:3", help="SIZE_MIB:RATE_MIBPS[:REPEATS],... (rate per connection)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="for cases that give none")
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--concurrency", type=int, default=8, help="tiercheck's remote_concurrency = the GETs in flight")
    ap.add_argument("--one-get-max-mib", type=int, default=256, help="skip the single GET above this size")
    ap.add_argument("--profile", action="store_true", help="trace one more tiercheck restore per case")
    ap.add_argument("--dir", default=os.path.join(REPO, "bench_out"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    cases = []
    for spec in args.cases.split(","):
        size, rate, *reps = spec.split(":")
        cases.append((int(size), float(rate), int(reps[0]) if reps else args.repeats))
    server_dir = tempfile.mkdtemp(prefix="tc-rn-weed-")  # SeaweedFS puts unix sockets there: keep it short
    server = SeaweedFS(server_dir)
    load0 = os.getloadavg()[0]
    t_start = time.monotonic()
    results = []
    try:
        server.start()
        for size, rate, repeats in cases:
            print(f"case {size} MiB at {rate:g} MiB/s per connection, {args.rtt_ms:g} ms RTT", flush=True)
            case = Case(args, server, size, rate, repeats)
            try:
                case.setup()
                case.run()
                results.append(case.summary())
            finally:
                case.close()
    finally:
        server.close()
        shutil.rmtree(server_dir, ignore_errors=True)
    report(args, results, (load0, os.getloadavg()[0]), time.monotonic() - t_start)


if __name__ == "__main__":
    main()
