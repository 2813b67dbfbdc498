"""Closed-form parts of the multi-rank model: restore discovery and failed rounds, the
rename alternative, replicated keys, and which shared resource saturates first."""

from __future__ import annotations

import math
from typing import Any

from benchmarks.scale.model import (
    LIST_PAGE_KEYS,
    MAX_WORLD,
    MULTI_GET_BATCH,
    REASONS_KEPT,
    Assumptions,
    MiB,
    list_pages,
    lognormal_mean,
    marker_bytes,
    mean_upload_s,
    mva,
    objects_per_step,
    poll_max_s,
    shard_requests,
    why_line_bytes,
)
from tiercheck.steps.catalog import MAX_MARKER_BYTES  # a larger COMMIT is rejected as corrupted

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
