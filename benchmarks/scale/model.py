"""Inputs of the multi-rank protocol model (benchmarks/scale/scale_sim.py): the assumptions, the
sizes of what ranks exchange, object-store request counts and the closed-form queueing."""

from __future__ import annotations

import inspect
import json
import math
import random
from dataclasses import dataclass

from tiercheck.job.coordination import Coordinator
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
