"""The commit of one step as a discrete-event simulation (every rank's store operations in
the order tiercheck issues them), and the whole model of one world size."""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.scale.closed import ratios, rename_model, replicated_model, restore_model
from benchmarks.scale.model import (
    MULTI_GET_BATCH,
    SMALL_REPLY,
    VERDICT_OK,
    Assumptions,
    marker_bytes,
    mean_upload_s,
    mva,
    part_report_bytes,
    poll_max_s,
    prune_requests,
    sample_uploads,
    shard_requests,
)
from tiercheck.steps.catalog import MAX_MARKER_BYTES  # a larger COMMIT is rejected as corrupted

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
