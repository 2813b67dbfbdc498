"""Tier 0's copies on other nodes (issue 26 item 6, the peer parts), with real gloo ranks on
CPU: 4 ranks on 2 simulated nodes (`restore/tier0_peers_worker.py` is one rank; a node is
a set of rank processes with a shared-memory directory and a tier-1 directory of its own,
as in `tests/procs/test_tier0_multirank.py`).

    python benchmarks/restore/tier0_peers.py [--part restore|cost|lost|all] [--mib 256]
        [--rates 50,200,none] [--repeats 3] [--cost-mib 256] [--cost-repeats 7]

``--part restore``: per repeat and rate R (rates in an order rotated between repeats), a job
with ``memory=True, memory_peers=1`` saves one step and is SIGKILLed; node 1's directories
(its shared memory and its tier 1) are deleted; the job restarts with
``memory_peer_rate=R`` and restores. Node 1's ranks get their parts back from the copies
node 0's ranks hold. Reported per receiving rank: the transfer's throughput (the bytes of
its part over ``PeerLink.receive_one``), the paced rate (after the limiter's first-second
budget: the chunks that arrived past it), the whole fetch (``fetch_replicas``) and the
whole ``restore()``, against R. R is the rate cap the library applies to each holder's
sends, standing in for a link of that rate: gloo connects every pair of ranks directly
(its own TCP connections, addresses exchanged through the store), so a shaping proxy
cannot be put in its path on one machine.

``--part cost``: one job, three Checkpointers saved in turn (rotated), each save started
together on every rank and waited for until idle: no tier 0, ``memory=True,
memory_peers=0``, ``memory=True, memory_peers=1``. Save stall, time to tier 0, time to
durable (committed on tier 1), time until idle (the copy to the peer included), CPU seconds
per save; ratios to no tier 0 and between the two tier-0 settings, of medians and paired.

``--part lost``: lost training time per save, 2 simulated nodes of one training rank each
(an MLP + Adam state, ``--lost-width``/``--lost-depth``, 192 MiB by default), no save / tier 1
only / tier 0 / tier 0 with ``memory_peers=1`` rotated, each save started at the same step on
both ranks; lost = the window until the Checkpointer is idle (copies done) plus a few steps,
minus as many clean steps. By default each rank trains on the CPU (every core of this
machine trains, so any CPU the copies take is taken from training); ``--lost-device-ms D``
models a GPU node instead: each step is a small host step (about a millisecond of Python and
launches) and then the host blocked for D ms, as in a blocking device synchronisation.

Every run is bounded (``--budget-s``: no new repeat starts past it; each job has a
timeout) and removes its temp dirs in /dev/shm and on disk, also on an error or SIGTERM.
``--json`` writes everything measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import MIB, machine_info, rotated

HERE = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parent / "tier0_peers_worker.py")
NODES = [0, 0, 1, 1]
MB = 1e6  # rates in decimal MB/s, as memory_peer_rate is bytes/s
COST_METHODS = ("tier1", "tier0", "tier0+peers")

_procs: list[subprocess.Popen[str]] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(
    mode: str,
    spec: dict[str, Any],
    scratch: Path,
    timeout: float,
    killed: bool = False,
    nodes: list[int] = NODES,
) -> list[dict[str, Any]]:
    """Run the ranks of the worker (rank r on node `nodes[r]`); their JSON results, by rank.
    `killed`: every rank must die by SIGKILL (after writing its result)."""
    port = free_port()
    outs = [scratch / f"out-{mode}-{r}-{port}.json" for r in range(len(nodes))]
    procs = []
    link: Link | None = spec.get("link")
    for r in range(len(nodes)):
        s = dict(spec, out=str(outs[r]), nodes=nodes)
        env = {**os.environ, "PYTHONPATH": str(HERE), "OMP_NUM_THREADS": "1"}
        prefix: list[str] = []
        if link is not None:  # each node's ranks run in its network namespace
            s.update(link=None, master=link.addresses[0])
            env["GLOO_SOCKET_IFNAME"] = link.ifnames[nodes[r]]
            prefix = ["ip", "netns", "exec", link.namespaces[nodes[r]]]
        p = subprocess.Popen(
            [*prefix, sys.executable, WORKER, mode, str(r), str(len(nodes)), str(port), json.dumps(s)],
            cwd=str(HERE),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append(p)
        _procs.append(p)
    logs = []
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            _procs.remove(p)
    want = -signal.SIGKILL if killed else 0
    for r, p in enumerate(procs):
        if p.returncode != want:
            raise RuntimeError(f"{mode} rank {r} exited {p.returncode}, expected {want}:\n{logs[r][-4000:]}")
    results = [json.loads(o.read_text()) for o in outs]
    for o in outs:
        o.unlink()
    return results


class Link:
    """Two simulated nodes joined by a real, shaped link: a network namespace per node, a
    veth pair between them, and a token-bucket qdisc (`tc ... tbf`) at `mbit` megabits/s on
    each end's egress. Ranks of one node talk inside their namespace (not shaped); every
    byte between the nodes, the tier-0 copies included, crosses the link. Needs root and
    iproute2 (`ip`, `tc`); `available()` says whether this machine has them."""

    def __init__(self, mbit: float) -> None:
        tag = f"tcl{os.getpid() % 100000}"
        self.mbit = mbit
        self.namespaces = (f"{tag}a", f"{tag}b")
        self.ifnames = (f"{tag}x", f"{tag}y")
        self.addresses = ("10.213.77.1", "10.213.77.2")

    @staticmethod
    def available() -> str | None:
        if os.geteuid() != 0:
            return "not root"
        if shutil.which("ip") is None or shutil.which("tc") is None:
            return "no iproute2 (ip, tc)"
        return None

    def _run(self, *cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def __enter__(self) -> Link:
        try:
            for ns in self.namespaces:
                self._run("ip", "netns", "add", ns)
            self._run("ip", "link", "add", self.ifnames[0], "type", "veth", "peer", "name", self.ifnames[1])
            for ns, ifname, addr in zip(self.namespaces, self.ifnames, self.addresses, strict=True):
                self._run("ip", "link", "set", ifname, "netns", ns)
                inside = ("ip", "netns", "exec", ns)
                self._run(*inside, "ip", "addr", "add", f"{addr}/24", "dev", ifname)
                self._run(*inside, "ip", "link", "set", ifname, "up")
                self._run(*inside, "ip", "link", "set", "lo", "up")
                self._run(
                    *inside, "tc", "qdisc", "add", "dev", ifname, "root", "tbf",
                    "rate", f"{self.mbit:g}mbit", "burst", "256kb", "latency", "400ms",
                )  # fmt: skip
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self.namespaces:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def link_throughput(ranks: list[dict[str, Any]]) -> float | None:
    """Bytes/s of every copy sent back over the link together: the bytes received by all
    receiving ranks over the span from the first chunk to the last (all ranks' clocks start
    at the barrier just before `restore()`)."""
    recv = [g for g in ranks if "recv_bytes" in g]
    if not recv:
        return None
    span = max(g["recv_end"] for g in recv) - min(g["recv_start"] for g in recv)
    return sum(g["recv_bytes"] for g in recv) / span if span > 0 else None


def rate_name(rate: float | None) -> str:
    return "uncapped" if rate is None else f"{rate / MB:g} MB/s"


# --------------------------------------------------------------------------- restore


def paced_rate(rec: dict[str, Any], bucket: float | None) -> float | None:
    """Bytes/s of the chunks that arrived after the sender's first-second budget was spent
    (None: fewer than two such chunks, or no cap)."""
    if bucket is None or not rec.get("recv_marks"):
        return None
    body = rec["recv_marks"][-1][2:]  # marker and manifest first, then the chunks in order
    total, chunk = rec["recv_bytes"], rec["chunk"]
    ends = [min(total, (i + 1) * chunk) for i in range(len(body))]
    past = [(t, b) for t, b in zip(body, ends, strict=True) if b - chunk >= bucket]
    if len(past) < 2 or past[-1][0] <= past[0][0]:
        return None
    return float(past[-1][1] - past[0][1]) / float(past[-1][0] - past[0][0])


def restore_part(args: argparse.Namespace, scratch: Path, shm: Path, deadline: float) -> list[dict[str, Any]]:
    rates = [None if x.strip().lower() in ("none", "uncapped", "0") else float(x) * MB for x in args.rates.split(",")]
    # (memory_peer_rate, link megabits/s): the library's cap over loopback, or a real shaped
    # link between network namespaces with the copies uncapped
    configs: list[tuple[float | None, float | None]] = (
        [(None, float(x)) for x in args.link_mbit.split(",")] if args.link_mbit else [(r, None) for r in rates]
    )
    runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for rate, mbit in rotated(configs, rep):
            if time.monotonic() > deadline:
                print(f"  budget spent: stopping before repeat {rep} at {rate_name(rate)}", file=sys.stderr)
                return runs
            with contextlib.ExitStack() as stack:
                link = None if mbit is None else stack.enter_context(Link(mbit))
                run = restore_run(args, scratch, shm, rep, rate, link)
            runs.append(run)
    return runs


def restore_run(
    args: argparse.Namespace, scratch: Path, shm: Path, rep: int, rate: float | None, link: Link | None
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    root, mem = scratch / run_id, shm / run_id
    spec = {
        "root": str(root),
        "shm": str(mem),
        "job_id": f"peers-{run_id}",
        "mib": args.mib,
        "tensors": args.tensors,
        "save_rate": None,
        "rate": rate,
        "coord": 120.0,
        "link": link,
    }
    try:
        saved = job("save", spec, scratch, 300, killed=True)
        held = sorted(p.name for p in (mem / "node0").glob("*/.tiercheck-replicas/*"))
        shutil.rmtree(mem / "node1")  # node 1 is lost: its memory and its tier 1
        shutil.rmtree(root / "node1")
        got = job("restore", spec, scratch, 300)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    senders = {s["dst"]: s for g in got for s in g.get("sends", [])}
    mbit = None if link is None else link.mbit
    run = {"repeat": rep, "rate": rate, "link_mbit": mbit, "held_on_node0": held, "save": saved, "ranks": got}
    for g in got:
        if "recv_bytes" in g:
            send = senders.get(g["rank"], {})
            g["bucket"] = send.get("bucket")
            g["send_s"] = send.get("s")
            g["transfer_s"] = g["recv_end"] - g["recv_start"]
            g["throughput"] = g["recv_bytes"] / g["transfer_s"]
            g["paced"] = paced_rate(g, g["bucket"])
    run["link_throughput"] = link_throughput(got)
    line = "  ".join(
        f"rank {g['rank']}: {g['tier']} exact={g['exact']} restore {g['restore_s']:.2f} s"
        + (
            f" fetch {g['fetch_end'] - g['fetch_start']:.2f} s transfer {g['transfer_s']:.2f} s "
            f"{g['throughput'] / MB:.0f} MB/s" + (f" paced {g['paced'] / MB:.0f}" if g.get("paced") else "")
            if "recv_bytes" in g
            else ""
        )
        for g in got
    )
    where = rate_name(rate) if link is None else f"link {link.mbit:g} Mbit/s"
    both = run["link_throughput"]
    if link is not None and both is not None:
        share = both * 8 / (link.mbit * 1e6)
        line += f"  both copies over the link: {both / MB:.1f} MB/s = {share:.2f}x the link"
    print(f"  repeat {rep} {where}: {line}", file=sys.stderr)
    return run


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def restore_report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    lines = [
        "| rate R | repeats | restore s, node 0 / node 1 ranks | fetch s | transfer s "
        "| throughput per receiving rank MB/s [min-max] | / R | rest of restore s | limiter budget at start MB "
        "| every rank from memory, bit-exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    configs: list[tuple[float | None, float | None]] = []
    for r in runs:
        if (r["rate"], r.get("link_mbit")) not in configs:
            configs.append((r["rate"], r.get("link_mbit")))
    for rate, mbit in configs:
        rs = [r for r in runs if (r["rate"], r.get("link_mbit")) == (rate, mbit)]
        recv = [g for r in rs for g in r["ranks"] if "recv_bytes" in g]
        node0 = [g["restore_s"] for r in rs for g in r["ranks"] if g["node"] == 0]
        node1 = [g["restore_s"] for r in rs for g in r["ranks"] if g["node"] == 1]
        fetch = [g["fetch_end"] - g["fetch_start"] for g in recv]
        rest = [g["restore_s"] - (g["fetch_end"] - g["fetch_start"]) for g in recv]
        thr = [g["throughput"] / MB for g in recv]
        buckets = [g["bucket"] / MB for g in recv if g.get("bucket") is not None]
        ok = all(g["exact"] and g["tier"] == ["memory"] for r in rs for g in r["ranks"])
        rel = f"**{med(thr) * MB / rate:.2f}x**" if rate else "-"
        name = rate_name(rate)
        if mbit is not None:  # a shaped link: both copies share it, so the link's use is the measure
            both = [r["link_throughput"] for r in rs if r.get("link_throughput")]
            shares = [b * 8 / (mbit * 1e6) for b in both]
            name = f"link {mbit:g} Mbit/s ({mbit / 8:g} MB/s), copies uncapped"
            rel = f"both: {med(both) / MB:.1f} MB/s = **{med(shares):.2f}x** [{min(shares):.2f}-{max(shares):.2f}]"
        lines.append(
            f"| {name} | {len(rs)} | {med(node0):.2f} / {med(node1):.2f} | {med(fetch):.2f} | "
            f"{med([g['transfer_s'] for g in recv]):.2f} | "
            f"{med(thr):.0f} [{min(thr, default=0):.0f}-{max(thr, default=0):.0f}] | {rel} | {med(rest):.2f} | "
            f"{f'{med(buckets):.1f}' if buckets else '-'} | "
            f"{'yes' if ok else 'NO'} ({sum(len(r['ranks']) for r in rs)} rank restores) |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- cost


def one_job_rows(
    mode: str, scratch: Path, shm: Path, spec: dict[str, Any], timeout: float, nodes: list[int]
) -> list[dict[str, Any]]:
    """Run one `mode` job in fresh directories (removed after) and return every rank's rows,
    each with its rank and the rank's other results."""
    run_id = uuid.uuid4().hex[:8]
    root, mem = scratch / run_id, shm / run_id
    spec = dict(spec, root=str(root), shm=str(mem), job_id=f"{mode}-{run_id}", coord=120.0)
    try:
        got = job(mode, spec, scratch, timeout, nodes=nodes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    return [dict(row, **{k: v for k, v in g.items() if k != "rows"}) for g in got for row in g["rows"]]


def cost_part(args: argparse.Namespace, scratch: Path, shm: Path) -> list[dict[str, Any]]:
    spec = {
        "mib": args.cost_mib,
        "tensors": args.tensors,
        "save_rate": None if args.save_rate is None else args.save_rate * MB,
        "repeats": args.cost_repeats,
        "warmup": 2,
    }
    nodes = [int(n) for n in args.cost_nodes.split(",")]
    rows = one_job_rows("cost", scratch, shm, spec, args.cost_timeout, nodes)
    for row in rows:
        print(
            f"  repeat {row['repeat']} rank {row['rank']} {row['method']:12s} stall {row['stall_s']:.3f} s "
            f"durable {row['durable_s']:.3f} s idle {row['idle_s']:.3f} s cpu {row['cpu_s']:.2f} s",
            file=sys.stderr,
        )
    return rows


def method_rows(methods: tuple[str, ...], keys: tuple[str, ...], vals: Any) -> list[str]:
    """A table row per method: the median [min-max] of each key (`vals(method, key)`)."""
    out = []
    for m in methods:
        cells = []
        for k in keys:
            v = vals(m, k)
            cells.append(f"{med(v):.3f} [{min(v):.3f}-{max(v):.3f}]" if v else "-")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    return out


def cost_report(rows: list[dict[str, Any]]) -> str:
    def vals(m: str, k: str) -> list[float]:
        return [r[k] for r in rows if r["method"] == m and r[k] is not None]

    def paired(a: str, b: str, k: str) -> float:
        by: dict[tuple[int, int], dict[str, float]] = {}
        for r in rows:
            by.setdefault((r["repeat"], r["rank"]), {})[r["method"]] = r[k]
        return med([d[a] / d[b] for d in by.values() if d.get(b)])

    keys = ("stall_s", "memory_wait_s", "durable_s", "idle_s", "cpu_s")
    lines = [
        "| | stall s | tier 0 s | durable (tier 1 committed) s | idle (copies done) s | CPU s per save per rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += method_rows(COST_METHODS, keys, vals)
    for a, b in (("tier0", "tier1"), ("tier0+peers", "tier1"), ("tier0+peers", "tier0")):
        cells = []
        for k in keys:
            if k == "memory_wait_s" and b == "tier1":
                cells.append("-")
                continue
            cells.append(f"**{med(vals(a, k)) / med(vals(b, k)):.2f}x** ({paired(a, b, k):.2f}x)")
        lines.append(f"| {a} / {b} (paired) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- lost

LOST_METHODS = ("none", "tier1", "tier0", "tier0+peers")


def lost_part(args: argparse.Namespace, scratch: Path, shm: Path) -> list[dict[str, Any]]:
    """Lost training time per save: 2 nodes of one training rank each (the worker's `lost`)."""
    spec = {
        "width": args.lost_width,
        "depth": args.lost_depth,
        "batch": args.lost_batch,
        "save_rate": None if args.save_rate is None else args.save_rate * MB,
        "repeats": args.lost_repeats,
        "pre_steps": 6,
        "tail_steps": 3,
        "warmup": 1,
        "device_ms": args.lost_device_ms,
    }
    rows = one_job_rows("lost", scratch, shm, spec, args.lost_timeout, [0, 1])
    for row in rows:
        print(
            f"  repeat {row['repeat']} rank {row['rank']} {row['method']:12s} stall {row['stall_s']:.3f} s "
            f"idle {row['idle_s']:.3f} s lost {row['lost_s']:.3f} s (base step {row['base_step_s']:.3f} s, "
            f"{row['window_steps']} steps) extra cpu {row['extra_cpu_s']:.2f} s",
            file=sys.stderr,
        )
    return rows


def lost_report(rows: list[dict[str, Any]]) -> str:
    def vals(m: str, k: str) -> list[float]:
        return [r[k] for r in rows if r["method"] == m]

    def paired(a: str, b: str, k: str) -> float:
        by: dict[tuple[int, int], dict[str, float]] = {}
        for r in rows:
            by.setdefault((r["repeat"], r["rank"]), {})[r["method"]] = r[k]
        return med([d[a] - d[b] for d in by.values() if a in d and b in d])

    mib = rows[0]["state_bytes"] / MIB if rows else 0
    keys = ("lost_s", "stall_s", "idle_s", "extra_cpu_s", "base_step_s")
    lines = [
        f"state {mib:.0f} MiB per rank (MLP + Adam), 2 nodes x 1 rank, one training thread each"
        + (
            f" (a GPU node's step modelled: host work, then {rows[0]['device_ms']:g} ms blocked)"
            if rows and rows[0].get("device_ms")
            else ""
        )
        + "; medians [min-max] over ranks x repeats",
        "",
        "| | lost s/save | stall s | idle (copies done) s | extra CPU s | baseline step s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += method_rows(LOST_METHODS, keys, vals)
    for a, b in (("tier0", "tier1"), ("tier0+peers", "tier1"), ("tier0+peers", "tier0")):
        lost_a, lost_b = med(vals(a, "lost_s")), med(vals(b, "lost_s"))
        lines.append(
            f"| {a} - {b}: lost s (paired) | {lost_a - lost_b:+.3f} ({paired(a, b, 'lost_s'):+.3f}) | "
            f"{a} / {b}: {lost_a / lost_b if lost_b > 0 else float('nan'):.2f}x | | | |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def _on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["restore", "cost", "lost", "all"], default="all")
    ap.add_argument("--mib", type=int, default=256, help="state per rank, MiB (restore)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rates", default="50,200,none", help="memory_peer_rate at restore, MB/s (none: uncapped)")
    ap.add_argument("--repeats", type=int, default=3, help="restore repeats per rate")
    ap.add_argument(
        "--link-mbit",
        default=None,
        help="restore over a real shaped link between network namespaces at these Mbit/s (root; copies uncapped)",
    )
    ap.add_argument("--cost-mib", type=int, default=256, help="state per rank, MiB (cost)")
    ap.add_argument("--cost-repeats", type=int, default=7)
    ap.add_argument("--cost-nodes", default="0,0,1,1", help="node of each rank (cost): 0,1 gives each rank a core here")
    ap.add_argument("--cost-timeout", type=float, default=240.0)
    ap.add_argument("--save-rate", type=float, default=None, help="memory_peer_rate of tier0+peers (cost), MB/s")
    ap.add_argument("--lost-width", type=int, default=2048, help="MLP width (lost)")
    ap.add_argument("--lost-depth", type=int, default=4, help="MLP layers (lost): 4 x 2048^2 params + Adam = 192 MiB")
    ap.add_argument("--lost-batch", type=int, default=64)
    ap.add_argument("--lost-repeats", type=int, default=7)
    ap.add_argument(
        "--lost-device-ms",
        type=float,
        default=0.0,
        help="lost: model a GPU node, each step a small host step then the host blocked this long (0: CPU training)",
    )
    ap.add_argument("--lost-timeout", type=float, default=900.0)
    ap.add_argument("--budget-s", type=float, default=240.0, help="no restore repeat starts after this")
    ap.add_argument("--scratch", default=None, help="parent of the tier-1 temp dir (default: the system's)")
    ap.add_argument("--memory-dir", default="/dev/shm")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.link_mbit and (why := Link.available()) is not None:
        ap.error(f"--link-mbit needs network namespaces and tc: {why}")
    signal.signal(signal.SIGTERM, _on_term)
    scratch = Path(tempfile.mkdtemp(prefix="tc-peers-", dir=args.scratch))
    shm = Path(tempfile.mkdtemp(prefix="tc-peers-", dir=args.memory_dir))
    info = machine_info(scratch)
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    try:
        if args.part in ("restore", "all"):
            res["restore"] = restore_part(args, scratch, shm, t0 + args.budget_s)
        if args.part in ("cost", "all"):
            res["cost"] = cost_part(args, scratch, shm)
        if args.part in ("lost", "all"):
            res["lost"] = lost_part(args, scratch, shm)
    finally:
        for p in list(_procs):
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["wall_s"] = time.monotonic() - t0
    res["loadavg_end"] = os.getloadavg()
    head = (
        f"revision {info['git_rev']}, {info['cpu_count']} cores ({info['cpu_model']}), load avg "
        f"{info['loadavg_start'][0]:.1f} -> {res['loadavg_end'][0]:.1f}, {res['wall_s']:.0f} s"
    )
    print()
    print(head)
    if res.get("restore"):
        print(f"\nrestore of node 1's ranks from peers: {args.mib} MiB per rank ({args.mib * MIB / MB:.0f} MB)\n")
        print(restore_report(args, res["restore"]))
    if res.get("cost"):
        print(
            f"\nsave cost, ranks on nodes {args.cost_nodes}, {args.cost_mib} MiB each, {args.cost_repeats} repeats, "
            "medians [min-max] over ranks x repeats\n"
        )
        print(cost_report(res["cost"]))
    if res.get("lost"):
        print(f"\nlost training time per save, {args.lost_repeats} repeats\n")
        print(lost_report(res["lost"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "args": vars(args), **res}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
