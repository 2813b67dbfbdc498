"""A model (not a measurement) of tiercheck's multi-rank commit protocol at scale.

    .venv/bin/python benchmarks/scale_sim.py --quick
    .venv/bin/python benchmarks/scale_sim.py --ranks 8,64,1k,10k,20k --json out.json

For each world size W it estimates, against an object store and the job's key-value
store (a torch TCPStore: one server thread, which every rank talks to):

* the commit of one step on the shared object-store tier (tier 2) and on a node-local
  tier 1: requests to the object store, store operations (polls counted apart), the
  bytes the store sends (rank 0 fetches every report; only the leaders fetch the
  `marker` key, every other rank a two-byte `verdict`), the commit marker's size, and the
  latency the protocol adds after the slowest rank's part is durable (until COMMIT is
  visible, until every rank knows it, until the last rank's `_commit` returns, which
  includes deleting the step's shared keys);
* restore discovery: agreeing on the candidate steps (rank 0 lists tier 2 once; each
  rank deletes its own `have/<rank>` once it has the plan) and reading the first
  candidate's COMMIT and manifest from tier 2; the store operations of a whole restore
  of the newest step, the clean-up included (every rank adds to `ack`, the last deletes
  `n`, `plan`, `ack` and four keys per candidate tried, one by one: 7 deletes, however
  many steps tier 2 holds); and the cost of a candidate that some rank cannot read
  (failing ranks count themselves in `r<i>/bad`, the first three append their reason to
  `r<i>/why`, and the last rank deletes the candidate's four keys at the end);
* replicated keys with a node-local tier 1 and a tier 2 (closed form, per node): every
  node writes its own copy to tier 1, rank 0's node uploads the one copy tier 2 gets,
  and a restore from tier 1 reads nothing from tier 2;
* designs tiercheck does not use, for comparison: every rank lists the bucket at
  restore, every rank polls the store with no backoff, a commit that "renames" a
  temporary prefix (an object store can only copy and delete);
* which resource saturates first, and at which W.

The commit phase is a small discrete-event simulation (deterministic: seeded) of every
rank's store operations in the order `tiercheck/coordination.py` and
`tiercheck/pipeline.py` issue them: the store serves one request at a time (FIFO) and
sends payloads over one egress link (FIFO; replies under 4 KiB are not held behind
payloads); each rank has one request in flight; polls back off 2 ms, 4 ms, ... up to
50 ms x max(1, W/1000), at most 1 s (`Coordinator._poll_max`).
Everything else is closed-form: request counts follow `tiers/remote.py` and s3fs
(multipart upload in 16 MiB parts, one recursive listing paginated 1000 keys per
request, ranged GETs of 64 MiB), the polling load before the last part is durable
comes from mean-value analysis of a closed queue (W clients thinking one poll interval).

Every number depends on the assumptions printed with the output (change them with the
options below). Treat the results as orders of magnitude and as a way to see which
term grows fastest, not as predictions for a particular cluster or bucket.

It imports the protocol's constants from tiercheck (so the package must import); `--plot PATH`
uses matplotlib if installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import inspect
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from tiercheck.coordination import Coordinator
from tiercheck.restore import MAX_MARKER_BYTES  # a larger COMMIT is rejected as corrupted
from tiercheck.tiers.remote import RemoteTier

MiB = 1 << 20
MAX_WORLD = 1 << 20  # tiercheck/manifest.py: the format's largest world_size (a literal there)
MULTI_GET_BATCH = 1024  # Coordinator._get_many (a literal there)
LIST_PAGE_KEYS = 1000  # S3 ListObjectsV2 page
DELETE_BATCH = 1000  # S3 DeleteObjects
SMALL_REPLY = 4096  # replies below this are not queued behind payloads on the store's link
_PART_BYTES: int = inspect.signature(RemoteTier).parameters["block_size"].default


@dataclass(frozen=True)
class Assumptions:
    """Inputs of the model. Defaults are round, plausible values, not measurements."""

    shard_mib: float = 1024.0  # each rank's own (per-rank) state per step (weak scaling: constant per rank)
    replicated_mib: float = 16384.0  # replicated keys, one copy (DDP: model + Adam state, ~1.4B fp32 parameters)
    replicated_keys: int = 2  # top-level replicated keys ("model", "optimizer"), taken as equal in size
    node_disk_mbps: float = 2000.0  # one node's tier-1 disk, MB/s (read or write; page cache ignored)
    manifest_kib: float = 200.0  # one rank's manifest (~1000 tensors)
    part_mib: int = _PART_BYTES >> 20  # RemoteTier's default block_size: multipart part size
    read_mib: int = 64  # _RemoteFile.read_into: one ranged GET
    put_p50_ms: float = 25.0  # object store: PUT / UploadPart / Create / Complete latency, excluding transfer
    put_sigma: float = 0.5  # lognormal shape: p99 = p50 * exp(2.326 * sigma) (= 80 ms at 25 ms, 0.5)
    get_p50_ms: float = 15.0  # GET / HEAD time to first byte
    get_sigma: float = 0.5
    list_page_ms: float = 50.0  # one LIST request (up to 1000 keys); pages are sequential
    rank_mbps: float = 100.0  # MB/s one rank moves over its one connection (s3fs uploads parts one by one)
    put_rate: float = 3500.0  # PUT/POST/DELETE-class requests per second per prefix (S3's documented start)
    get_rate: float = 5500.0  # GET/HEAD/LIST requests per second per prefix
    store_ops: float = 75_000.0  # job store: small operations per second, served one at a time
    store_mbps: float = 2000.0  # job store: payload bytes per second it can send (MB/s)
    store_rtt_ms: float = 0.2  # one store operation's round trip, network and Python included
    poll_min_ms: float = Coordinator.POLL_MIN * 1e3
    poll_max_ms: float = Coordinator.POLL_MAX * 1e3  # per 1000 ranks (see poll_max_s)
    poll_cap_ms: float = 1000.0  # the longest interval Coordinator ever uses
    gpus_per_node: int = 8  # ranks sharing one node-local tier-1 directory (one leader each)
    local_marker_ms: float = 2.0  # node-local COMMIT: write, rename, fsync
    cpu_us_per_rank: float = 8.0  # rank 0 parses W part reports and builds the marker (5-13 us measured)
    keep_remote: int = 3  # tier-2 retention in the commit model (rank 0 lists twice and deletes a step)
    accumulated: int = 100  # steps on tier 2 in the keep_remote=None restore scenario
    remote_timeout_s: float = 30.0  # Checkpointer(remote_timeout=): one attempt of one call, listing included
    copy_mbps: float = 250.0  # server-side CopyObject throughput per object (rename alternative)
    checksum_hex: int = 8  # crc32c digests (xxh3_64: 16)
    reason_chars: int = 200  # a failing rank's reason in r<i>/why (Coordinator keeps the first 500)

    def describe(self) -> list[str]:
        lat = math.exp(2.326 * self.put_sigma)
        return [
            f"per rank: {self.shard_mib:g} MiB shard + {self.manifest_kib:g} KiB manifest per step; "
            f"{self.gpus_per_node} ranks per node",
            f"replicated keys: {self.replicated_mib:g} MiB in {self.replicated_keys} equal keys (modelled apart: the "
            f"commit tables cover the per-rank shards); a node's tier-1 disk moves {self.node_disk_mbps:g} MB/s",
            f"object store: PUT {self.put_p50_ms:g} ms p50 / {self.put_p50_ms * lat:.0f} ms p99 (lognormal) "
            f"plus transfer at {self.rank_mbps:g} MB/s per rank; GET {self.get_p50_ms:g} ms to first byte; "
            f"LIST {self.list_page_ms:g} ms per {LIST_PAGE_KEYS} keys",
            f"per-prefix limits: {self.put_rate:g} PUT-class/s, {self.get_rate:g} GET-class/s (LIST counted as GET, "
            "each DeleteObjects call as one request); the whole tier-2 root is one prefix (a new prefix starts so; "
            "S3 splits hot prefixes only after sustained load)",
            f"job store: {self.store_ops:,.0f} ops/s served one at a time, payloads at {self.store_mbps:g} MB/s, "
            f"{self.store_rtt_ms:g} ms round trip; polls back off from {self.poll_min_ms:g} ms to "
            f"{self.poll_max_ms:g} ms x max(1, W/1000), at most {self.poll_cap_ms:g} ms (as Coordinator does)",
            f"multipart parts {self.part_mib} MiB, ranged reads {self.read_mib} MiB, keep_remote={self.keep_remote} "
            f"(commit model), {self.accumulated} steps kept for the keep_remote=None restore, "
            f"remote_timeout={self.remote_timeout_s:g} s; a failed restore candidate's reason: "
            f"{self.reason_chars} characters, recorded by the first {REASONS_KEPT} failing ranks",
        ]


# ----------------------------------------------------------------------------- sizes


def _digits(n: int) -> int:
    return len(str(n))


def _manifest_name_len(rank: int, world: int) -> int:
    # rank-{rank:05d}-of-{world:05d}.manifest.json
    return len("rank--of-.manifest.json") + max(5, _digits(rank)) + max(5, _digits(world))


def _ranks_by_width(world: int) -> list[tuple[int, int]]:
    """(count of ranks, zero-padded width of their number) for ranks 0..world-1."""
    out, lo, width = [], 0, 5
    while lo < world:
        hi = min(world, 10**width)
        out.append((hi - lo, width))
        lo, width = hi, width + 1
    return out


def marker_bytes(world: int, a: Assumptions, step: int = 10**6) -> int:
    """Exact size of the COMMIT that tiercheck's encode_marker writes for `world` ranks."""
    head = json.dumps(
        {
            "format": "tiercheck",
            "version": 1,
            "kind": "commit",
            "step": step,
            "world_size": world,
            "checksum_algorithm": "crc32c" if a.checksum_hex == 8 else "xxh3_64",
            "manifests": [],
        },
        separators=(",", ":"),
    )
    length = int(a.manifest_kib * 1024)
    per = len('{"name":"","length":,"checksum":""}') + _digits(length) + a.checksum_hex
    wide = max(5, _digits(world))
    names = sum(n * (len("rank--of-.manifest.json") + w + wide) for n, w in _ranks_by_width(world))
    return len(head) + world * per + names + (world - 1) + 1  # commas, trailing newline


def part_report_bytes(world: int, a: Assumptions) -> int:
    """One rank's `part/<rank>` value (json.dumps with default separators)."""
    doc = {
        "manifest": {
            "name": "x" * _manifest_name_len(world - 1, world),
            "length": int(a.manifest_kib * 1024),
            "checksum": "0" * a.checksum_hex,
        },
        "error": None,
        "assignment": "[]",
    }
    return len(json.dumps(doc))


REASONS_KEPT = Coordinator.REASONS_KEPT  # failing ranks whose reason a restore round records


def why_line_bytes(world: int, a: Assumptions) -> int:
    """One failing rank's line in `r<i>/why` (Coordinator.agree_outcome): [rank, reason]."""
    return len(json.dumps([world - 1, "x" * min(500, a.reason_chars)])) + 1


VERDICT_OK = len(b"ok")  # the `verdict` value of a step that commits


# ------------------------------------------------------------------- object-store counts


def shard_requests(a: Assumptions) -> int:
    """Requests for one shard upload: one PUT, or Create + parts + Complete (s3fs)."""
    size = a.shard_mib * MiB
    if size <= a.part_mib * MiB:
        return 1
    return math.ceil(size / (a.part_mib * MiB)) + 2


def list_pages(keys: int) -> int:
    return max(1, math.ceil(keys / LIST_PAGE_KEYS))


def objects_per_step(world: int) -> int:
    return 2 * world + 1  # a shard and a manifest per rank, one COMMIT


def prune_requests(world: int, kept: int) -> dict[str, int]:
    """Rank 0's retention after a commit on tier 2 with keep_remote=kept: `_prune` lists the
    root twice (committed_steps, then stray_steps), then deletes one step: COMMIT, then a
    recursive rm (a listing of the step, DeleteObjects in batches of 1000)."""
    if kept <= 0:
        return {"list": 0, "delete": 0}
    root = list_pages((kept + 1) * objects_per_step(world))
    step = list_pages(2 * world)
    return {"list": 2 * root + step, "delete": 1 + math.ceil(2 * world / DELETE_BATCH)}


def poll_max_s(world: int, a: Assumptions) -> float:
    """Coordinator._poll_max: the longest poll interval grows with the job, so that W ranks
    polling add up to about 1000 / POLL_MAX = 20k operations per second, up to a cap."""
    return min(a.poll_cap_ms, a.poll_max_ms * max(1.0, world / 1000)) / 1e3


def lognormal_mean(p50: float, sigma: float) -> float:
    return p50 * math.exp(sigma * sigma / 2)


def mean_upload_s(a: Assumptions) -> float:
    """Mean time one rank takes to upload its shard and manifest, unthrottled."""
    put = lognormal_mean(a.put_p50_ms, a.put_sigma) / 1e3
    bw = a.rank_mbps * 1e6
    n = shard_requests(a)
    return n * put + a.shard_mib * MiB / bw + put + a.manifest_kib * 1024 / bw


def sample_uploads(world: int, a: Assumptions, rng: random.Random) -> list[float]:
    """Each rank's upload time (shard + manifest), before any prefix throttling. Sums of
    many lognormal request latencies are drawn from their normal approximation."""
    n = shard_requests(a) + 1
    mu, s = math.log(a.put_p50_ms / 1e3), a.put_sigma
    mean = math.exp(mu + s * s / 2)
    var = (math.exp(s * s) - 1) * math.exp(2 * mu + s * s)
    transfer = (a.shard_mib * MiB + a.manifest_kib * 1024) / (a.rank_mbps * 1e6)
    out = []
    for _ in range(world):
        if n <= 8:
            lat = sum(rng.lognormvariate(mu, s) for _ in range(n))
        else:
            lat = max(0.0, rng.gauss(n * mean, math.sqrt(n * var)))
        out.append(transfer + lat)
    return out


# ------------------------------------------------------------------- queueing (closed form)


def mva(clients: int, think_s: float, service_s: float) -> tuple[float, float]:
    """Exact mean-value analysis of `clients` each alternating a think time and one request
    at a single FIFO server: (response time at the server, throughput)."""
    q = 0.0
    r = service_s
    x = 0.0
    for n in range(1, clients + 1):
        r = service_s * (1 + q)
        x = n / (think_s + r)
        q = x * r
    return r, x


# ------------------------------------------------------------------- discrete-event commit


Action = tuple[Any, ...]
Proc = Generator[Action, Any, None]


class Store:
    """The job's store as the model sees it: one thread serves requests in arrival order;
    payload replies then queue on one egress link; small replies go straight out."""

    def __init__(self, a: Assumptions) -> None:
        self.service = 1.0 / a.store_ops
        self.bps = a.store_mbps * 1e6
        self.half_rtt = a.store_rtt_ms / 2e3
        self.cpu_free = -math.inf
        self.link_free = -math.inf
        self.busy = 0.0
        self.link_busy = 0.0
        self.sent = 0  # reply payload bytes (values fetched by get / multi_get)
        self.values: dict[str, int] = {}  # key -> value size
        self.counters: Counter[str] = Counter()

    def serve(self, now: float, op: str, key: str, arg: Any, req_bytes: int) -> tuple[float, Any, int]:
        """(time the reply reaches the client, result, reply bytes)."""
        arrive = now + self.half_rtt + req_bytes / self.bps
        start = max(arrive, self.cpu_free)
        self.cpu_free = start + self.service
        self.busy += self.service
        reply = 0
        result: Any = None
        if op == "set":
            self.values[key] = arg
        elif op == "add":
            self.counters[key] += arg
            result = self.counters[key]
        elif op == "check":
            result = key in self.values
        elif op == "get":
            reply = self.values[key]
        elif op == "multi_get":
            reply = arg
        elif op == "delete":
            self.values.pop(key, None)
            self.counters.pop(key, None)
        self.sent += reply
        if reply >= SMALL_REPLY:
            send = max(self.cpu_free, self.link_free)
            self.link_free = send + reply / self.bps
            self.link_busy += reply / self.bps
            return self.link_free + self.half_rtt, result, reply
        return self.cpu_free + self.half_rtt, result, reply


@dataclass
class CommitResult:
    verdict_s: float = 0.0  # rank 0 set the verdict
    visible_s: float = 0.0  # COMMIT durable (shared tier: rank 0's PUT; node-local: the last leader's write)
    known_s: float = 0.0  # the last rank knows its marker is written
    returned_s: float = 0.0  # the last rank's _commit returned (the last to ack deletes the step's keys)
    ops: int = 0  # store operations issued after the slowest part was durable, polls included
    polls: int = 0
    ops_rank0: int = 0
    store_busy: float = 0.0  # fraction of [0, returned] the store's thread was busy
    link_s: float = 0.0  # seconds of payload on the store's link
    sent_bytes: float = 0.0  # payload bytes the store sent (reports to rank 0, verdicts, markers)
    events: int = 0


def simulate_commit(
    world: int, a: Assumptions, rng: random.Random, *, node_local: bool, backoff: bool, commit_put_s: float
) -> CommitResult:
    """Time 0: the slowest rank's part (shard + manifest) is durable. Every other rank
    reported earlier and is polling (rank 0 the counter `n`, the others `verdict`).

    Keys and order as in Coordinator and Pipeline._commit: rank 0 multi_gets the reports,
    sets `marker` (the COMMIT bytes) then `verdict` ("ok"); every other rank gets the
    verdict, and a leader then gets `marker` (rank 0 already has it); each rank deletes its
    own `part/<rank>` (forget_part), the leaders write COMMIT and set `marked/<leader>`,
    the others poll their leader's key; the last to `add ack` checks and gets the verdict
    and deletes the shared keys (the leaders' `marked`, n, marker, verdict, ack). A step
    that commits; on a node-local tier 1 the lowest rank of each node leads it (rank 0
    node 0's), so L - 1 leaders fetch `marker`."""
    store = Store(a)
    poll_min = a.poll_min_ms / 1e3 if backoff else 0.0
    poll_max = poll_max_s(world, a) if backoff else 0.0
    m_bytes = marker_bytes(world, a)
    p_bytes = part_report_bytes(world, a)
    g = a.gpus_per_node if node_local else world
    leader_of = [(r // g) * g for r in range(world)] if node_local else [0] * world
    leaders = sorted(set(leader_of))
    slowest = world - 1
    res = CommitResult()
    known = [0.0] * world
    returned = [0.0] * world
    # The step so far: every rank but the slowest reported its part.
    for r in range(world):
        if r != slowest:
            store.values[f"part/{r}"] = p_bytes
    store.counters["n"] = world - 1
    warmup = max(0.3, 3 * (poll_max + a.store_rtt_ms / 1e3)) if world > 1 else 0.0
    now = [0.0]
    stats: Counter[str] = Counter()

    def op(rank: int, name: str, key: str, arg: Any = 0, req: int = 0, poll: bool = False) -> Action:
        return ("op", rank, name, key, arg, req, poll)

    def poll_until(rank: int, name: str, key: str, ready: Callable[[Any], bool], steady: bool) -> Proc:
        delay = poll_max if steady else poll_min
        while True:
            got = yield op(rank, name, key, 0, 0, True)
            if ready(got):
                return
            yield ("sleep", delay)
            delay = min(poll_max, 2 * delay)

    def finish(rank: int) -> Proc:
        count = yield op(rank, "add", "ack", 1)
        if count >= world:  # the last to acknowledge deletes the shared keys, one by one
            yield op(rank, "check", "verdict")
            yield op(rank, "get", "verdict")  # "ok": the reports are gone already
            keys = [f"marked/{r}" for r in leaders] + ["n", "marker", "verdict", "ack"]
            for k in keys:
                yield op(rank, "delete", k)
        returned[rank] = now[0]

    def rank0() -> Proc:
        yield ("sleep", rng.uniform(0, poll_max or a.store_rtt_ms / 1e3))
        yield from poll_until(0, "add", "n", lambda c: c >= world, steady=True)
        for i in range(0, world, MULTI_GET_BATCH):
            n = min(MULTI_GET_BATCH, world - i)
            yield op(0, "multi_get", "part", n * p_bytes, 32 * n)
        yield ("sleep", world * a.cpu_us_per_rank / 1e6)
        yield op(0, "set", "marker", m_bytes, m_bytes)
        yield op(0, "set", "verdict", VERDICT_OK, VERDICT_OK)
        res.verdict_s = now[0]
        yield op(0, "delete", "part/0")  # forget_part
        if node_local:
            yield ("sleep", a.local_marker_ms / 1e3 + m_bytes / 1e9)
        else:
            yield ("sleep", commit_put_s)
        res.visible_s = max(res.visible_s, now[0])
        yield op(0, "set", "marked/0", 2)
        known[0] = now[0]
        yield from finish(0)

    def other(rank: int) -> Proc:
        if rank == slowest:
            yield ("sleep", warmup)
            yield op(rank, "set", f"part/{rank}", p_bytes, p_bytes)
            yield op(rank, "add", "n", 1)
            yield from poll_until(rank, "check", "verdict", bool, steady=False)
        else:
            yield ("sleep", rng.uniform(0, poll_max or a.store_rtt_ms / 1e3))
            yield from poll_until(rank, "check", "verdict", bool, steady=True)
        yield op(rank, "get", "verdict")  # two bytes: "ok"
        if leader_of[rank] == rank:
            yield op(rank, "get", "marker")  # only a leader fetches the COMMIT bytes
        yield op(rank, "delete", f"part/{rank}")  # forget_part
        if leader_of[rank] == rank:
            yield ("sleep", a.local_marker_ms / 1e3 + m_bytes / 1e9)
            res.visible_s = max(res.visible_s, now[0])
            yield op(rank, "set", f"marked/{rank}", 2)
        else:
            lead = leader_of[rank]
            yield from poll_until(rank, "check", f"marked/{lead}", bool, steady=False)
            yield op(rank, "get", f"marked/{lead}")
        known[rank] = now[0]
        yield from finish(rank)

    procs: list[Proc] = [rank0()] + [other(r) for r in range(1, world)]
    heap: list[tuple[float, int, int]] = [(-warmup, r, r) for r in range(world)]
    heapq.heapify(heap)
    replies: list[Any] = [None] * world
    seq = world
    while heap:
        t, _, r = heapq.heappop(heap)
        now[0] = t  # time since the slowest part was durable (negative: warm-up)
        try:
            act = procs[r].send(replies[r])
        except StopIteration:
            continue
        res.events += 1
        if act[0] == "sleep":
            replies[r] = None
            due = t + act[1]
        else:
            _, rank, name, key, arg, req, poll = act
            due, replies[r], _ = store.serve(t, name, key, arg, req)
            if now[0] >= 0:
                stats["ops"] += 1
                stats["polls"] += poll
                stats["rank0"] += rank == 0
        seq += 1
        heapq.heappush(heap, (due, seq, r))
    res.known_s = max(known)
    res.returned_s = max(returned)
    res.ops, res.polls, res.ops_rank0 = stats["ops"], stats["polls"], stats["rank0"]
    res.store_busy = min(1.0, store.busy / (res.returned_s + warmup)) if res.returned_s > 0 else 0.0
    res.link_s = store.link_busy
    res.sent_bytes = store.sent
    return res


# ------------------------------------------------------------------- one world size


def commit_counts(world: int, a: Assumptions, node_local: bool) -> dict[str, int]:
    """Store operations and payload bytes of one committed step on one tier, polls
    excluded (from coordination.py): 6W + 2L + ceil(W/1024) + 6 operations."""
    leaders = math.ceil(world / a.gpus_per_node) if node_local else 1
    m = marker_bytes(world, a)
    report = 2 * world  # set part/<rank>, add n
    decide = math.ceil(world / MULTI_GET_BATCH) + 2  # multi_get batches, set marker, set verdict
    verdict = world - 1  # get verdict ("ok")
    marker = leaders - 1  # the leaders other than rank 0 get `marker`
    forget = world  # each rank deletes its own part/<rank>
    marked = leaders + (world - leaders)  # leaders set marked/<r>; the others get it once ready
    ack = world
    cleanup = 2 + leaders + 4  # check + get verdict; delete marked/<leaders>, n, marker, verdict, ack
    total = report + decide + verdict + marker + forget + marked + ack + cleanup
    rank0 = 2 + decide + 1 + 1 + 1  # report, decide, forget_part, set marked/0, ack (+ cleanup if last)
    gets = world * part_report_bytes(world, a) + (leaders - 1) * m  # rank 0's multi_get; leaders' marker
    small = (world - 1) * VERDICT_OK + (world - leaders) * len(b"ok") + VERDICT_OK  # verdict, marked, cleanup
    return {"total": total, "rank0": rank0, "cleanup": cleanup, "sent": gets + small}


def run_world(world: int, a: Assumptions, seeds: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"W": world}
    m = marker_bytes(world, a)
    out["marker_bytes"] = m
    out["marker_over_limit"] = m > MAX_MARKER_BYTES
    nodes = math.ceil(world / a.gpus_per_node)

    # Object-store requests per step on tier 2.
    per_rank = shard_requests(a) + 1  # shard, manifest
    prune = prune_requests(world, a.keep_remote)
    out["obj_requests_total"] = world * per_rank + 1 + prune["list"] + prune["delete"]
    out["obj_requests_rank0"] = per_rank + 1 + prune["list"] + prune["delete"]
    out["obj_prune_lists_rank0"] = prune["list"]
    out["obj_put_class"] = world * per_rank + 1 + prune["delete"]

    # Upload window and the polling before the slowest part is durable (closed form).
    service = 1.0 / a.store_ops
    rtt = a.store_rtt_ms / 1e3
    runs: list[dict[str, Any]] = []
    for seed in seeds:
        rng = random.Random(seed * 1_000_003 + world)
        ups = sample_uploads(world, a, rng)
        mean_up = statistics.fmean(ups)
        throttle = max(1.0, out["obj_put_class"] / a.put_rate / mean_up)
        ups = [u * throttle for u in ups]
        longest = max(ups)
        waits = sum(longest - u for u in ups)
        run: dict[str, Any] = {"upload_s": longest, "throttle": throttle}
        for label, backoff in (("backoff", True), ("nobackoff", False)):
            think = (poll_max_s(world, a) if backoff else 0.0) + rtt
            resp, thru = mva(world, think, service)
            run[f"pre_polls_{label}"] = waits * thru / world
            run[f"pre_store_rate_{label}"] = thru
            run[f"pre_resp_{label}"] = resp
        put_lat = rng.lognormvariate(math.log(a.put_p50_ms / 1e3), a.put_sigma) + m / (a.rank_mbps * 1e6)
        run["shared"] = simulate_commit(world, a, rng, node_local=False, backoff=True, commit_put_s=put_lat)
        run["local"] = simulate_commit(world, a, rng, node_local=True, backoff=True, commit_put_s=put_lat)
        run["nobackoff"] = simulate_commit(world, a, rng, node_local=False, backoff=False, commit_put_s=put_lat)
        runs.append(run)

    def med(f: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(f(r) for r in runs)

    out["upload_s"] = med(lambda r: r["upload_s"])
    out["upload_unthrottled_s"] = mean_upload_s(a)
    out["put_throttle"] = med(lambda r: r["throttle"])
    for tier in ("shared", "local", "nobackoff"):
        out[f"commit_{tier}"] = {
            fld.name: statistics.median(float(getattr(r[tier], fld.name)) for r in runs)
            for fld in dataclasses.fields(CommitResult)
        }
    for tier, local in (("shared", False), ("local", True)):
        c = commit_counts(world, a, local)
        out[f"store_ops_{tier}"] = c["total"]
        out[f"store_ops_rank0_{tier}"] = c["rank0"]
        out[f"store_sent_{tier}"] = c["sent"]
        out[f"store_polls_{tier}"] = statistics.median(r[tier].polls for r in runs) + med(
            lambda r: r["pre_polls_backoff"]
        )
    out["store_polls_nobackoff"] = med(lambda r: r["nobackoff"].polls) + med(lambda r: r["pre_polls_nobackoff"])
    out["store_rate_backoff"] = med(lambda r: r["pre_store_rate_backoff"])
    out["store_rate_nobackoff"] = med(lambda r: r["pre_store_rate_nobackoff"])
    out["store_resp_backoff_ms"] = 1e3 * med(lambda r: r["pre_resp_backoff"])
    out["store_resp_nobackoff_ms"] = 1e3 * med(lambda r: r["pre_resp_nobackoff"])
    out["leaders_local"] = nodes
    out["poll_max_s"] = poll_max_s(world, a)

    out["restore"] = restore_model(world, a)
    out["rename"] = rename_model(world, a)
    out["replicated"] = replicated_model(world, a)
    out["ratios"] = ratios(world, a)
    return out


# ------------------------------------------------------------------- restore (closed form)


def restore_model(world: int, a: Assumptions) -> dict[str, Any]:
    """Restore of the newest step from tier 2 (fresh nodes: every tier 1 empty).

    restore_collective: every rank lists its tier 1 and publishes it (set + add); rank 0
    waits for all, lists tier 2 once, multi_gets the W lists, sets the plan; the others
    poll for the plan (backoff), get it and delete their own `have/<rank>` (rank 0 too).
    Then each rank GETs COMMIT, GETs its manifest, HEADs its shard, and reads the shard in
    64 MiB ranged GETs; outcome agreement costs each rank two store ops (add r<i>/n, read
    r<i>/bad) and polls when every rank read the candidate (see failed_round for one that
    some rank could not read). At the end (finish_restore) every rank adds to `ack`, and
    the last deletes n, plan, ack and r<i>/n, bad, fatal, why for each candidate tried
    (the rounds run, not the plan's length), one by one. The newest step is the first
    candidate, so its restore deletes 3 + 4 = 7 keys however many steps tier 2 holds
    (with no candidate at all, 3). Store operations: planning 4W + ceil(W/1024) + 1, one
    round every rank passes 2W, clean-up W + 3 + 4T for T candidates tried; polls not
    counted."""
    service = 1.0 / a.store_ops
    rtt = a.store_rtt_ms / 1e3
    bps = a.store_mbps * 1e6
    z = poll_max_s(world, a)
    resp, _ = mva(world, z + rtt, service)
    op = rtt + resp
    m = marker_bytes(world, a)
    out: dict[str, Any] = {}
    publish = 2 * world * service + 2 * rtt  # W sets and adds arrive together
    detect = _first_check_after(publish, a.poll_min_ms / 1e3, z, rtt)
    plan_bytes = 14 * max(a.keep_remote, 1)
    gets = math.ceil(world / MULTI_GET_BATCH) * op + world * 16 * max(a.keep_remote, 1) / bps
    fanout = max(z, world * (2 * service + plan_bytes / bps))  # W gets of the plan, W deletes of `have`
    get_s = lognormal_mean(a.get_p50_ms, a.get_sigma) / 1e3
    bw = a.rank_mbps * 1e6
    meta_rank = 2 * get_s + m / bw + a.manifest_kib * 1024 / bw + get_s  # COMMIT, manifest, HEAD
    meta_floor = 3 * world / a.get_rate
    meta = max(meta_rank, meta_floor)
    n_reads = math.ceil(a.shard_mib / a.read_mib)
    data_rank = n_reads * (get_s + a.read_mib * MiB / bw)
    data_floor = world * n_reads / a.get_rate
    out["meta_get_requests"] = 3 * world
    plan_ops = 4 * world + math.ceil(world / MULTI_GET_BATCH) + 1  # set have, add n, get plan, delete have
    out["plan_ops"] = plan_ops
    for label, failing in (("one", 1), ("all", world)):
        out[f"failed_{label}"] = failed_round(world, failing, a)
    out["meta_s"] = meta
    out["marker_download_total_mb"] = world * m / 1e6
    out["data_get_requests"] = world * n_reads
    out["data_s"] = max(data_rank, data_floor)
    out["data_rate_ratio"] = (world * n_reads / data_rank) / a.get_rate
    for label, kept in (("kept", a.keep_remote), ("accumulated", a.accumulated)):
        keys = kept * objects_per_step(world)
        pages = list_pages(keys)
        listing = pages * a.list_page_ms / 1e3
        fails = listing > a.remote_timeout_s
        # Alternative: every rank lists (pages are sequential per rank; all share the GET budget).
        every = max(listing, world * pages / a.get_rate)
        d = {
            "keys": keys,
            "list_requests": pages,
            "listing_s": listing,
            "listing_fails": fails,
            "plan_s": publish + detect + listing + gets + op + fanout + op,  # the last: a rank's delete
            "every_rank_list_requests": world * pages,
            "every_rank_list_s": every,
        }
        d["discovery_s"] = d["plan_s"] + meta
        # A restore of the newest step: the plan, one round every rank passes, finish_restore
        # for that one round tried (not the `kept` candidates in the plan).
        d["cleanup_deletes"] = 3 + 4 * 1  # n, plan, ack; r<i>/n, bad, fatal, why per candidate tried
        d["cleanup_s"] = world * service + rtt + d["cleanup_deletes"] * (rtt + service)
        d["restore_ops"] = plan_ops + 2 * world + world + d["cleanup_deletes"]
        out[label] = d
    out["max_steps_listable"] = (
        int(a.remote_timeout_s * 1e3 / a.list_page_ms) * LIST_PAGE_KEYS // objects_per_step(world)
    )
    return out


def failed_round(world: int, failing: int, a: Assumptions, fatal: int = 0) -> dict[str, float]:
    """Coordinator.agree_outcome for a candidate that `failing` ranks could not read
    (`fatal` of them gave up on the restore, e.g. a template that does not fit): each
    failing rank adds 1 to r<i>/bad (and to r<i>/fatal if fatal); the first REASONS_KEPT
    of them append one JSON line to r<i>/why; every rank adds to r<i>/n, polls it until it
    reaches W, reads r<i>/bad, then gets r<i>/why (at most REASONS_KEPT lines) and reads
    r<i>/fatal. At the end of the restore the last rank deletes the candidate's four keys
    (r<i>/n, bad, fatal, why), one by one: 4W + F + min(F, 3) + 4 operations for F
    failing ranks (2W + 4 for a round every rank passes), growing as W, whatever F.
    Polls not counted; the time is the store's busy time (thread or link, whichever is
    longer) plus the round trips of a failing rank that records its reason (add bad,
    append, add n; read bad, get why, read fatal) and of the last rank's four deletes."""
    kept = min(failing, REASONS_KEPT)
    line = why_line_bytes(world, a)
    deletes = 4  # finish_restore: r<i>/n, bad, fatal, why
    if failing:
        ops = failing + fatal + kept + 4 * world + deletes
        sent = world * kept * line
        trips = 6 + (1 if fatal else 0) + deletes
    else:
        ops, sent, trips = 2 * world + deletes, 0, 2 + deletes
    busy = max(ops / a.store_ops, sent / (a.store_mbps * 1e6))
    return {"ops": ops, "bytes": sent, "s": busy + trips * a.store_rtt_ms / 1e3}


def _first_check_after(t: float, poll_min: float, poll_max: float, rtt: float) -> float:
    """When a poll loop started at 0 (fresh backoff) first sees an event that happened at t."""
    at, delay = 0.0, poll_min
    while at < t:
        at += rtt + delay
        delay = min(poll_max, 2 * delay)
    return at


# ------------------------------------------------------------------- rename alternative


def rename_model(world: int, a: Assumptions) -> dict[str, Any]:
    """A commit that writes each part under a temporary prefix and then 'renames' it. An
    object store has no rename: each object is copied server-side (CopyObject; objects over
    5 GiB need UploadPartCopy per part) and the original deleted. The 2W copies are not
    atomic together, so readers still need a marker written last."""
    objects = 2 * world
    size = a.shard_mib * MiB
    copy_calls = 1 if size <= 5 * 1024 * MiB else math.ceil(size / (a.part_mib * MiB)) + 2
    requests = world * (copy_calls + 1) + objects + list_pages(objects)  # copies, deletes, a listing
    put = lognormal_mean(a.put_p50_ms, a.put_sigma) / 1e3
    per_rank = size / (a.copy_mbps * 1e6) + 3 * put
    floor = (requests - list_pages(objects)) / a.put_rate
    return {"requests": requests, "added_s": max(per_rank, floor), "bytes_copied_gb": world * size / 1e9}


# ------------------------------------------------------------------- replicated keys (closed form)


def _keys_per_rank(keys: int, ranks: int) -> int:
    """The most equal-sized keys one of `ranks` ranks gets from checkpointer._balance
    (largest first, each to the least loaded rank, ties to the lowest: key i to rank i
    modulo `ranks`)."""
    return math.ceil(keys / ranks)


def replicated_model(world: int, a: Assumptions) -> dict[str, Any]:
    """Replicated keys (R bytes in K equal top-level keys) with a node-local tier 1 (g ranks
    per node, one directory each) and a tier 2, per node and per step.

    This design (Checkpointer._owners_of, Pipeline._copy_from_local): every node's tier-1
    directory keeps a full copy, the keys balanced over its g ranks; tier 2 gets one copy,
    uploaded by the ranks of rank 0's node, balanced over them (at most min(K, g) ranks
    upload), and every other part is retargeted (uploaded without them). A restore of a
    step that every node's tier 1 holds reads nothing from tier 2: each rank reads its
    part and its node's copy of the replicated keys from its own disk."""
    g = min(a.gpus_per_node, world)
    nodes = math.ceil(world / g)
    s = a.shard_mib * MiB
    r = a.replicated_mib * MiB
    k = max(1, a.replicated_keys)
    key = r / k
    bw = a.rank_mbps * 1e6
    disk = a.node_disk_mbps * 1e6
    out: dict[str, Any] = {"nodes": nodes}
    # Tier 1, bytes written per node and step.
    out["tier1_node_bytes"] = g * s + r
    out["tier1_replicated_s"] = r / disk  # the node's disk writes one more copy of R
    # Tier 2: rank 0's node uploads R (one copy), the other nodes only their own state.
    uploaders = min(k, g)
    busiest = _keys_per_rank(k, uploaders) * key
    out["uploaders"] = uploaders
    out["tier2_node0_bytes"] = g * s + r
    out["tier2_other_bytes"] = g * s
    out["upload_busiest_s"] = (s + busiest) / bw  # a rank of rank 0's node carrying replicated keys
    out["upload_plain_s"] = s / bw  # a rank carrying only its own state
    out["extra_put_requests"] = uploaders * (  # parts for the replicated bytes (whole parts, s3fs)
        math.ceil((s + busiest) / (a.part_mib * MiB)) - math.ceil(s / (a.part_mib * MiB))
    )
    # Restore of a step on every node's tier 1.
    out["restore_node_disk_bytes"] = g * (s + r)  # every rank reads its own state and all of R
    out["restore_node_disk_s"] = g * (s + r) / disk
    return out


# ------------------------------------------------------------------- what saturates


def ratios(world: int, a: Assumptions) -> dict[str, float]:
    """Demand over capacity of each shared resource at `world` ranks (closed form, means).
    Above 1 the resource is saturated (rates) or the limit is crossed (sizes, timeouts);
    for the latency terms ('>1 s') the threshold is an arbitrary 1 s added to a save or a
    restore round."""
    up = mean_upload_s(a)
    per_rank = shard_requests(a) + 1
    rtt = a.store_rtt_ms / 1e3
    m = marker_bytes(world, a)
    n_reads = math.ceil(a.shard_mib / a.read_mib)
    get_s = lognormal_mean(a.get_p50_ms, a.get_sigma) / 1e3
    read_rank = n_reads * (get_s + a.read_mib * MiB / (a.rank_mbps * 1e6))
    listing_acc = list_pages(a.accumulated * objects_per_step(world)) * a.list_page_ms / 1e3
    leaders = math.ceil(world / a.gpus_per_node)
    bps = a.store_mbps * 1e6
    cleanup = (leaders + 6) * (rtt + 1 / a.store_ops)  # check + get verdict, L + 4 deletes, one by one
    k = REASONS_KEPT
    failed_all = failed_round(world, world, a)["s"]
    return {
        "prefix PUT rate while all ranks upload": world * per_rank / up / a.put_rate,
        "prefix GET rate while all ranks read shards at restore": world * n_reads / read_rank / a.get_rate,
        "job store ops under backoff polling": world / (poll_max_s(world, a) + rtt) / a.store_ops,
        "node-local tier 1: marker sent to the L-1 other leaders, >1 s": (leaders - 1) * m / bps,
        "node-local tier 1: the last rank deletes L+4 shared keys one by one, >1 s": cleanup,
        f"a restore candidate every rank fails: 5W + {k + 4} store ops, {k} reason lines per rank, >1 s": failed_all,
        f"tier-2 listing with {a.accumulated} steps kept vs remote_timeout": listing_acc / a.remote_timeout_s,
        f"COMMIT size vs the reader's {MAX_MARKER_BYTES >> 20} MiB limit": m / MAX_MARKER_BYTES,
        "[avoided design] job store ops if every rank polled with no backoff": world / rtt / a.store_ops,
    }


def crossing_points(a: Assumptions) -> dict[str, int | None]:
    """The smallest W (bisection, up to 2^20) at which each ratio reaches 1."""
    out: dict[str, int | None] = {}
    for name in ratios(2, a):
        lo, hi = 1, MAX_WORLD
        if ratios(hi, a)[name] < 1:
            out[name] = None
            continue
        if ratios(lo, a)[name] >= 1:
            out[name] = lo
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ratios(mid, a)[name] >= 1:
                hi = mid
            else:
                lo = mid
        out[name] = hi
    return out


# ------------------------------------------------------------------- output


def _fmt_s(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    return f"{s * 1e3:.0f} ms" if s >= 0.001 else f"{s * 1e3:.2f} ms"


def _fmt_n(n: float) -> str:
    if n >= 1e7:
        return f"{n / 1e6:.0f}M"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e4:
        return f"{n / 1e3:.0f}k"
    return f"{n:,.0f}"


def _fmt_ratio(x: float) -> str:
    if x < 0.01:
        return "<0.01"
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}"


def _fmt_b(b: float) -> str:
    if b >= 1e12:
        return f"{b / 1e12:.1f} TB"
    if b >= 1e9:
        return f"{b / 1e9:.1f} GB"
    if b >= 1e6:
        return f"{b / 1e6:.2f} MB"
    if b >= 1e3:
        return f"{b / 1e3:.1f} kB"
    return f"{b:.0f} B"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(results: list[dict[str, Any]], a: Assumptions, crossings: dict[str, int | None], seeds: int) -> str:
    out = [
        "### tiercheck multi-rank protocol: a model, not a measurement",
        "",
        f"benchmarks/scale_sim.py; median of {seeds} seeded run(s). Assumptions:",
        "",
        *[f"- {line}" for line in a.describe()],
        "",
        "#### Commit of one step on the object-store tier (tier 2, rank 0 writes COMMIT)",
        "",
        "Latencies count from the moment the slowest rank's shard and manifest are durable. The upload window "
        "covers the per-rank shards; the replicated keys lengthen the uploads of rank 0's node (next tables).",
        "",
    ]
    rows = []
    for r in results:
        c = r["commit_shared"]
        rows.append(
            [
                _fmt_n(r["W"]),
                f"{_fmt_n(r['obj_requests_total'])} / {_fmt_n(r['obj_requests_rank0'])}",
                f"{_fmt_s(r['upload_s'])}" + (f" (x{r['put_throttle']:.1f})" if r["put_throttle"] > 1.05 else ""),
                _fmt_b(r["marker_bytes"])
                + (f" **over {MAX_MARKER_BYTES >> 20} MiB**" if r["marker_over_limit"] else ""),
                f"{_fmt_n(r['store_ops_shared'])} + {_fmt_n(r['store_polls_shared'])}",
                f"{_fmt_b(r['store_sent_shared'])} ({VERDICT_OK} B)",
                f"{_fmt_n(r['store_rate_backoff'])}/s ({r['store_rate_backoff'] / a.store_ops:.0%})",
                _fmt_s(c["visible_s"]),
                _fmt_s(c["known_s"]),
                _fmt_s(c["returned_s"]),
            ]
        )
    out.append(
        _table(
            [
                "W",
                "object-store requests/step: all / rank 0",
                "upload window (PUT-rate stretch)",
                "COMMIT size",
                "store ops/step + polls",
                "store bytes sent/step (a non-leader's get)",
                "store load while waiting",
                "+COMMIT visible",
                "+every rank knows",
                "+last _commit returns",
            ],
            rows,
        )
    )
    out += [
        "",
        f"Rank 0's requests include retention (keep_remote={a.keep_remote}): two listings of the root and the "
        "deletion of one step. Store ops: non-poll operations (formula) + polls (simulated after the slowest "
        "part is durable, closed form before). Store bytes: payload the store sends, mostly the W reports rank 0 "
        "fetches (rank 0, the only leader, never fetches the marker); in brackets what one non-leader's get "
        "of the verdict carries. 'Store load': polls per second while ranks wait for the slowest part, as a share "
        "of the store's capacity.",
        "",
        "#### Commit on a node-local tier 1 (one leader per node writes COMMIT)",
        "",
    ]
    rows = []
    for r in results:
        c = r["commit_local"]
        rows.append(
            [
                _fmt_n(r["W"]),
                _fmt_n(r["leaders_local"]),
                f"{_fmt_n(r['store_ops_local'])} + {_fmt_n(r['commit_local']['polls'])}",
                f"{_fmt_b(r['store_sent_local'])} ({_fmt_b(r['marker_bytes'])} / {VERDICT_OK} B)",
                _fmt_s(c["visible_s"]),
                _fmt_s(c["known_s"]),
                _fmt_s(c["returned_s"]),
                _fmt_s(c["link_s"]),
            ]
        )
    out.append(
        _table(
            [
                "W",
                "leaders",
                "store ops/step + polls after the slowest part",
                "store bytes sent/step (a leader's / a non-leader's get)",
                "+last marker written",
                "+every rank knows",
                "+last _commit returns",
                "store link time (marker to the other leaders)",
            ],
            rows,
        )
    )
    out += [
        "",
        "#### Replicated keys with a node-local tier 1 and a tier 2 (per node, per step)",
        "",
    ]
    rows = []
    for r in results:
        x = r["replicated"]
        other = _fmt_b(x["tier2_other_bytes"]) if x["nodes"] > 1 else "-"
        rows.append(
            [
                _fmt_n(r["W"]),
                _fmt_n(x["nodes"]),
                _fmt_b(x["tier1_node_bytes"]),
                f"+{_fmt_s(x['tier1_replicated_s'])}",
                f"{_fmt_b(x['tier2_node0_bytes'])} / {other}",
                f"{x['uploaders']}: {_fmt_s(x['upload_busiest_s'])} vs {_fmt_s(x['upload_plain_s'])}; "
                f"+{_fmt_n(x['extra_put_requests'])} PUT",
                f"0 B; {_fmt_b(x['restore_node_disk_bytes'])} from each node's disk, "
                f"{_fmt_s(x['restore_node_disk_s'])}",
            ]
        )
    out.append(
        _table(
            [
                "W",
                "nodes",
                "tier-1 bytes written per node",
                "a node's disk, for its copy of the keys",
                "tier-2 bytes uploaded: rank 0's node / another",
                "ranks uploading the keys: busiest upload vs a rank's own state only",
                "restore from tier 1: bytes from tier 2; from disk",
            ],
            rows,
        )
    )
    out += [
        "",
        f"{a.replicated_mib:g} MiB of replicated keys in {a.replicated_keys} equal keys, {a.gpus_per_node} ranks and "
        "one tier-1 directory per node. Every node now writes its own copy to tier 1; tier 2 still gets one copy, "
        "all of it from rank 0's node, whose uplink carries it.",
        "",
        "#### Restore discovery from tier 2 (fresh nodes)",
        "",
    ]
    rows = []
    for r in results:
        x = r["restore"]
        k, acc = x["kept"], x["accumulated"]
        rows.append(
            [
                _fmt_n(r["W"]),
                f"{_fmt_n(k['list_requests'])} ({_fmt_s(k['listing_s'])})",
                _fmt_s(k["discovery_s"]),
                f"{_fmt_n(k['restore_ops'])} ({_fmt_n(k['cleanup_deletes'])} deletes, {_fmt_s(k['cleanup_s'])})",
                f"{_fmt_n(acc['list_requests'])} ({_fmt_s(acc['listing_s'])})"
                + (" **> remote_timeout: fails**" if acc["listing_fails"] else ""),
                _fmt_n(x["max_steps_listable"]),
                f"{_fmt_n(x['meta_get_requests'])}, {_fmt_b(x['marker_download_total_mb'] * 1e6)} of COMMIT",
                f"{_fmt_n(x['data_get_requests'])} ({_fmt_s(x['data_s'])})",
                f"{_fmt_n(x['failed_one']['ops'])} ops, {_fmt_b(x['failed_one']['bytes'])} "
                f"({_fmt_s(x['failed_one']['s'])})",
                f"{_fmt_n(x['failed_all']['ops'])} ops, {_fmt_b(x['failed_all']['bytes'])} "
                f"({_fmt_s(x['failed_all']['s'])})",
            ]
        )
    out.append(
        _table(
            [
                "W",
                f"rank 0 LIST requests, {a.keep_remote} steps kept",
                "discovery (plan + COMMIT/manifest reads)",
                "store ops, restore of the newest step (clean-up: the last rank's deletes; time from the acks)",
                f"LIST requests, {a.accumulated} steps (keep_remote=None)",
                "steps listable within remote_timeout",
                "GET/HEAD for COMMIT, manifest, shard size",
                "ranged GETs for the shards",
                "a candidate one rank fails: store ops, bytes sent (time)",
                "a candidate every rank fails: store ops, bytes sent (time)",
            ],
            rows,
        )
    )
    out += [
        "",
        "Store ops of a restore (polls not counted): the plan (each rank sets `have/<rank>`, adds to `n`, gets "
        "`plan` and deletes its `have/<rank>`; rank 0 fetches the lists and sets `plan`), one round every rank "
        "passes (`add r<i>/n`, read `r<i>/bad`), and the clean-up: every rank adds to `ack`, the last deletes "
        "`n`, `plan`, `ack` and 4 keys for each candidate tried (here the first, the newest step), one by one: "
        f"{results[0]['restore']['kept']['cleanup_deletes']} deletes, with {a.keep_remote} steps on tier 2 as with "
        f"{a.accumulated}. "
        "Failed candidate: each failing rank adds to `r<i>/bad` and the first "
        f"{REASONS_KEPT} append a line to `r<i>/why`; then every rank adds to `r<i>/n`, reads `r<i>/bad`, gets "
        f"`r<i>/why` (at most {REASONS_KEPT} lines) and reads `r<i>/fatal`, and at the end the last rank deletes "
        f"the candidate's 4 keys; reasons of {a.reason_chars} characters; no rank gives up (each that does adds "
        "one `add r<i>/fatal`).",
        "",
        "#### Designs tiercheck avoids (same assumptions)",
        "",
    ]
    rows = []
    for r in results:
        x, c, nb, rn = r["restore"]["kept"], r["commit_shared"], r["commit_nobackoff"], r["rename"]
        rows.append(
            [
                _fmt_n(r["W"]),
                f"{_fmt_n(x['every_rank_list_requests'])} LIST, {_fmt_s(x['every_rank_list_s'])} "
                f"(vs {_fmt_n(x['list_requests'])}, {_fmt_s(x['listing_s'])})",
                f"{_fmt_n(r['store_polls_nobackoff'])} polls, {_fmt_n(r['store_rate_nobackoff'])}/s, "
                f"{r['store_resp_nobackoff_ms']:.2f} ms/op (vs {_fmt_n(r['store_polls_shared'])}, "
                f"{_fmt_n(r['store_rate_backoff'])}/s, {r['store_resp_backoff_ms']:.2f} ms)",
                f"{_fmt_s(nb['known_s'])} (vs {_fmt_s(c['known_s'])})",
                f"{_fmt_n(rn['requests'])} req, +{_fmt_s(rn['added_s'])}, {_fmt_b(rn['bytes_copied_gb'] * 1e9)} copied",
            ]
        )
    out.append(
        _table(
            [
                "W",
                "restore: every rank lists tier 2",
                "commit, polls with no backoff: polls/step, store rate, queueing per op (vs backoff)",
                "+every rank knows, no backoff",
                "commit by copy-and-delete 'rename'",
            ],
            rows,
        )
    )
    out += [
        "",
        "#### What saturates first",
        "",
        "Demand over capacity at each W (closed form, mean values); at 1 or more the resource is saturated or the "
        "limit crossed. Rows marked '>1 s' compare a delay with 1 s, an arbitrary threshold. L: leaders "
        f"({a.gpus_per_node} ranks per node). [avoided design]: what tiercheck never did.",
        "",
    ]
    rows = []
    for name, w in sorted(crossings.items(), key=lambda kv: (kv[1] is None, kv[1] or 0)):
        cells = [_fmt_ratio(r["ratios"][name]) for r in results]
        cells = [f"**{c}**" if r["ratios"][name] >= 1 else c for c, r in zip(cells, results, strict=True)]
        rows.append([name, "never (up to 2^20)" if w is None else f"{w:,}", *cells])
    out.append(_table(["resource", "from W =", *[f"W={_fmt_n(r['W'])}" for r in results]], rows))
    return "\n".join(out) + "\n"


def plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    ws = [r["W"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("commit_shared", "tier 2: every rank knows"),
        ("commit_local", "node-local tier 1: every rank knows"),
        ("commit_nobackoff", "tier 2, polling without backoff"),
    ):
        ax.plot(ws, [r[key]["known_s"] for r in results], marker="o", label=label)
    ax.plot(ws, [r["restore"]["kept"]["discovery_s"] for r in results], marker="s", label="restore discovery")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ranks (W)")
    ax.set_ylabel("seconds (model)")
    ax.set_title("tiercheck multi-rank protocol: modelled latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parse_ranks(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1000 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    if any(w < 2 for w in out):
        raise argparse.ArgumentTypeError("world sizes must be at least 2")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=_parse_ranks, default=_parse_ranks("8,64,1k,10k"), help="world sizes (8,64,1k,10k)")
    p.add_argument("--quick", action="store_true", help="one seeded run per world size (a few seconds)")
    p.add_argument("--seeds", type=int, default=5, help="seeded runs per world size without --quick (median)")
    p.add_argument("--json", metavar="PATH", help="also write the results and assumptions as JSON")
    p.add_argument("--plot", metavar="PATH", help="PNG of the modelled latencies (needs matplotlib)")
    for f in dataclasses.fields(Assumptions):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            metavar="X",
            help=f"(default {f.default}; see Assumptions)",
        )
    args = p.parse_args(argv)
    a = Assumptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Assumptions)})
    seeds = [1] if args.quick else list(range(1, args.seeds + 1))
    t0 = time.perf_counter()
    results = [run_world(w, a, seeds) for w in args.ranks]
    crossings = crossing_points(a)
    sys.stdout.write(render(results, a, crossings, len(seeds)))
    print(f"\n(model computed in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:

        def plain(o: Any) -> Any:
            if dataclasses.is_dataclass(o) and not isinstance(o, type):
                return dataclasses.asdict(o)
            raise TypeError(type(o).__name__)

        doc = {
            "kind": "model, not a measurement",
            "assumptions": dataclasses.asdict(a),
            "seeds": seeds,
            "results": results,
            "crossings": crossings,
        }
        with open(args.json, "w") as out:
            json.dump(doc, out, indent=1, default=plain)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
