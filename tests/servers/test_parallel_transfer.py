"""Parallel multipart uploads and parallel ranged reads of the remote tier
(`tiercheck/tiers/multipart.py`), against the real servers of tests/helpers/servers: SeaweedFS (S3),
Azurite (Azure Blob) and the GCS emulator, through the shaping proxy where speed matters.

Each connection through the shaping proxy is capped, so a transfer that keeps N requests in
flight takes about 1/N of the time one connection needs: the timing bounds below are half
of the one-connection time (generous for a loaded 2-core machine), and the proxy's count of
connections open at once says how many were in flight.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers.servers import FaultProxy, ObjectStoreServer, SeaweedFS, ShapingProxy
from tiercheck.format import naming
from tiercheck.tiers import multipart
from tiercheck.tiers.multipart import S3_LIMITS, part_size_for
from tiercheck.tiers.remote import RemoteTier
from tiercheck.tiers.retry import RetryPolicy

MiB = 1 << 20
SERVERS = ["seaweedfs", "azurite", "gcs_server"]
SHARD = naming.shard_name(0, 1)


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> ObjectStoreServer:
    s: ObjectStoreServer = request.getfixturevalue(request.param)
    if isinstance(s, SeaweedFS):
        request.getfixturevalue("seaweedfs_healthy")
    return s


@contextlib.contextmanager
def shaped(server: ObjectStoreServer, rate_bps: float, rtt_s: float = 0.0) -> Iterator[tuple[ShapingProxy, dict]]:
    """A shaping proxy in front of `server` and the storage options that go through it."""
    with ShapingProxy(server.port, rate_bps=rate_bps, rtt_s=rtt_s) as proxy:
        yield proxy, server.storage_options_via(proxy.port)


def object_path(fs: Any, url: str) -> str:
    return str(fs._strip_protocol(url))


def leftovers(server: ObjectStoreServer, url: str) -> list[str]:
    """What an upload to `url` left behind, as an independent client sees the store: S3
    multipart uploads in progress, GCS part objects, any object under the prefix."""
    fs = server.filesystem()
    path = object_path(fs, url)
    fs.invalidate_cache()
    found: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        found += [p for p, i in fs.find(path.rsplit("/", 1)[0], detail=True).items() if i["type"] == "file"]
    if server.protocol == "s3":
        bucket, key, _ = fs.split_path(path)
        uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.rsplit("/", 1)[0])
        found += [f"multipart upload of {u['Key']}" for u in uploads.get("Uploads", [])]
    return found


# ---------------------------------------------------------------------------- part plans


@pytest.mark.parametrize("nbytes", [0, 1, 5 * MiB, 20 * MiB, 10**9, 2 * 10**12 // 1000, 2 * 10**12, 48 << 40])
@pytest.mark.parametrize("block", [5 * MiB, 16 * MiB, 64 * MiB])
def test_part_size_keeps_every_shard_within_s3_limits(nbytes: int, block: int) -> None:
    part = part_size_for(nbytes, block, 8, S3_LIMITS)
    assert part % MiB == 0
    assert S3_LIMITS.min_part <= part <= S3_LIMITS.max_part
    assert math.ceil(nbytes / part) <= S3_LIMITS.max_parts
    assert part <= max(block, -(-nbytes // S3_LIMITS.max_parts) + MiB)  # never larger than it must be
    if nbytes >= 8 * block:
        assert part >= block


def test_part_size_refuses_an_object_beyond_the_store() -> None:
    with pytest.raises(ValueError):
        part_size_for(10_000 * (5 << 30) + 1, 16 * MiB, 8, S3_LIMITS)


# ------------------------------------------------------------------ round trips per server


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_multipart_round_trip_from_memory_file_and_stream(server: ObjectStoreServer, tmp_path: Path) -> None:
    """Each source (host buffer, tier-1 file, compressed stream) uploads in parts and reads back
    bit-exact, whole and by ranges that cross part and read-ahead boundaries."""
    url = server.unique_url("mp")
    tier = RemoteTier(url, server.storage_options, concurrency=3, block_size=5 * MiB, compression="zstd")
    data = payload(17 * MiB + 12345, seed=1)
    local = tmp_path / "shard.bin"
    local.write_bytes(data)
    w = tier.open_step(1, 0)
    assert w.write_file("a.bin", memoryview(data)) == len(data)
    assert w.write_from_path("b.bin", str(local)) == len(data)
    stored = w.write_from_path("c.bin", str(local), compress=True)  # random bytes: zstd keeps them
    fs = server.filesystem()
    for name, size in (("a.bin", len(data)), ("b.bin", len(data)), ("c.bin", stored)):
        assert fs.info(f"{object_path(fs, url)}/{naming.step_dir_name(1)}/{name}")["size"] == size
    assert fs.cat_file(f"{object_path(fs, url)}/{naming.step_dir_name(1)}/b.bin") == data
    f = tier.open_file(1, "a.bin")
    try:
        for offset, n in [(0, len(data)), (5 * MiB - 3, 7), (3, 5 * MiB), (len(data) - 10, 10), (MiB, 9 * MiB + 1)]:
            dest = bytearray(n)
            f.read_into(offset, memoryview(dest))
            assert dest == data[offset : offset + n], (offset, n)
        for offset in range(0, 40_000, 4000):  # small reads in order: served from the read-ahead
            dest = bytearray(4000)
            f.read_into(offset, memoryview(dest))
            assert dest == data[offset : offset + 4000]
        with pytest.raises(EOFError):
            f.read_into(len(data) - 5, memoryview(bytearray(6)))
    finally:
        f.close()
    w.commit(b"{}")
    # nothing but the files: no part objects, no multipart upload still open
    left = leftovers(server, f"{url}/{naming.step_dir_name(1)}/x")
    assert sorted(p.rsplit("/", 1)[-1] for p in left) == ["COMMIT", "a.bin", "b.bin", "c.bin"], left


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_checkpointer_fresh_node_round_trip_of_a_multipart_step(server: ObjectStoreServer, tmp_path: Path) -> None:
    """A state of a few parts saved through both tiers, then restored on a fresh node from the
    bucket alone (parallel ranged reads into the template's tensors, every byte checksummed)."""
    url = server.unique_url("ckmp")
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(3 * MiB, generator=g), "b": torch.randn(7, generator=g), "step": 3}
    opts = server.storage_options
    with tiercheck.Checkpointer(local=tmp_path / "n1", remote=url, storage_options=opts, remote_concurrency=4) as c:
        h = c.save(3, state)
        h.wait(timeout=120)
        assert h.stats.tier_s["remote"] >= h.stats.tier_s["local"] > 0
    with tiercheck.Checkpointer(local=tmp_path / "n2", remote=url, storage_options=opts, remote_concurrency=4) as c:
        tmpl = {"w": torch.zeros(3 * MiB), "b": torch.zeros(7), "step": 0}
        w_before = tmpl["w"]
        assert c.restore(tmpl) == 3
        assert tmpl["w"] is w_before  # filled in place
        assert torch.equal(tmpl["w"], state["w"]) and torch.equal(tmpl["b"], state["b"]) and tmpl["step"] == 3
    # the pools of parts and ranges are joined: nothing of them outlives the calls
    assert [t.name for t in threading.enumerate() if t.name.startswith(("tiercheck-read", "tiercheck-part"))] == []


# ------------------------------------------------------------------------- parallelism


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_upload_and_read_keep_parts_in_flight(server: ObjectStoreServer, tmp_path: Path) -> None:
    """4 parts (ranges) in flight through connections capped at 1.5 MB/s take about a quarter
    of the time one connection needs, both ways (the aggregate 6 MB/s stays under what the
    servers take on a loaded 2-core machine)."""
    rate, conc = 1.5e6, 4
    n = 20 * MiB if server.protocol == "s3" else 16 * MiB  # 4 parts (S3: 5 MiB at least), 4 ranges
    one_connection_s = n / rate
    data = payload(n, seed=2)
    with shaped(server, rate) as (proxy, opts):
        opts.pop("config_kwargs", None)  # its 3 s read timeout would cut a 5 MiB part sent at 1.5 MB/s
        tier = RemoteTier(server.unique_url("par"), opts, concurrency=conc)
        tier.committed_steps()  # the client is set up before the clock starts
        w = tier.open_step(1, 0)
        t0 = time.monotonic()
        w.write_file(SHARD, memoryview(data))
        up_s = time.monotonic() - t0
        opened = proxy.stats()["max_open"]
        f = tier.open_file(1, SHARD)
        dest = bytearray(n)
        t0 = time.monotonic()
        f.read_into(0, memoryview(dest))
        down_s = time.monotonic() - t0
        f.close()
    assert dest == data
    assert opened >= conc, proxy.stats()
    if server.protocol == "gcs":
        # gcp-storage-emulator serves one request at a time (http.server.HTTPServer): the
        # connections above show the parts were sent together; the time cannot show it.
        return
    assert up_s < one_connection_s / 2, (up_s, one_connection_s)
    assert down_s < one_connection_s / 2, (down_s, one_connection_s)


def test_restore_pays_no_round_trip_per_small_tensor(seaweedfs_healthy: SeaweedFS, tmp_path: Path) -> None:
    """200 small tensors behind a 50 ms round trip: read in file order, they come with the
    read-ahead of the reads before them, not one request (50 ms) each."""
    server = seaweedfs_healthy
    url = server.unique_url("small")
    state = {f"t{i:03d}": torch.full((100 + i,), float(i)) for i in range(200)}
    with tiercheck.Checkpointer(remote=url, storage_options=server.storage_options) as c:
        c.save(1, state).wait(timeout=60)
    with (
        shaped(server, 50e6, rtt_s=0.05) as (_, opts),
        tiercheck.Checkpointer(remote=url, storage_options=opts) as c,
    ):
        assert c.steps() == [1]  # the client is set up before the clock starts
        tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
        t0 = time.monotonic()
        assert c.restore(tmpl) == 1
        elapsed = time.monotonic() - t0
    assert all(torch.equal(tmpl[k], v) for k, v in state.items())
    # listing, marker, manifest, size, one read: ~6 round trips, measured 0.5 s; not 200 (10 s)
    assert elapsed < 40 * 0.05, elapsed


# ----------------------------------------------------------------------------- failures


def _failing_stream(data: bytes, fail_after: int, pause_s: float) -> Iterator[bytes]:
    """Yields `data` in 1 MiB chunks, then, after `fail_after` bytes and a pause (time for the
    parts already handed out to land), fails as a tier-1 read error would."""
    for pos in range(0, len(data), MiB):
        if pos >= fail_after:
            time.sleep(pause_s)
            raise OSError(5, "input/output error reading the tier-1 shard")
        yield data[pos : pos + MiB]


@pytest.mark.parametrize("server", SERVERS, indirect=True)
def test_upload_cut_by_a_failure_leaves_nothing_behind(server: ObjectStoreServer) -> None:
    """Two parts are uploaded, then the source fails: the error is raised, the object is not
    there, and neither are its parts (S3: no multipart upload in progress; GCS: no part
    objects; Azure: the uncommitted blocks make no blob)."""
    url = server.unique_url("cut")
    tier = RemoteTier(url, server.storage_options, concurrency=2, block_size=5 * MiB)
    data = payload(30 * MiB, seed=4)
    w = tier.open_step(1, 0)
    with pytest.raises(OSError, match="input/output error"):
        w.write_chunks(SHARD, lambda: _failing_stream(data, 12 * MiB, 1.0), len(data))
    assert leftovers(server, f"{url}/{naming.step_dir_name(1)}/{SHARD}") == []
    assert tier.committed_steps() == [] and tier.stray_steps() == []


def test_upload_cut_by_the_network_is_aborted_and_never_listed(seaweedfs_healthy: SeaweedFS) -> None:
    """Every connection is reset after 3 MiB, so no 5 MiB part ever lands: the upload fails
    once its retry budget is spent, and the multipart upload is aborted."""
    server = seaweedfs_healthy
    url = server.unique_url("rst")
    with FaultProxy(server.port, reset_after_bytes=3 * MiB) as proxy:
        opts = server.storage_options_via(proxy.port)
        tier = RemoteTier(url, opts, concurrency=2, block_size=5 * MiB, op_timeout=5)
        tier.retry = RetryPolicy(budget_s=1.0, initial_s=0.1, max_s=0.2)
        data = payload(12 * MiB, seed=5)
        w = tier.open_step(1, 0)
        with pytest.raises(Exception) as info:
            w.write_file(SHARD, memoryview(data))
        w.abort()
        assert proxy.stats()["reset"] >= 2
    assert not isinstance(info.value, AssertionError)
    assert leftovers(server, f"{url}/{naming.step_dir_name(1)}/{SHARD}") == []
    assert RemoteTier(url, server.storage_options).committed_steps() == []


def test_hung_server_fails_a_multipart_upload_within_its_budget(seaweedfs_healthy: SeaweedFS) -> None:
    """The server stops answering while parts are in flight: each part's attempt ends at its
    deadline, no part retries past the budget, and the upload raises in bounded time."""
    server = seaweedfs_healthy
    url = server.unique_url("hang")
    with FaultProxy(server.port, bandwidth_bps=4 * MiB) as proxy:
        opts = server.storage_options_via(proxy.port)
        opts.pop("config_kwargs", None)  # no client timeouts: only tiercheck's own bound the wait
        tier = RemoteTier(url, opts, concurrency=3, block_size=5 * MiB, op_timeout=1)
        tier.retry = RetryPolicy(budget_s=1.0, initial_s=0.1, max_s=0.2)
        errors: list[BaseException] = []

        def upload() -> None:
            try:
                tier.open_step(1, 0).write_file(SHARD, memoryview(payload(20 * MiB, seed=6)))
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=upload, daemon=True)
        t.start()
        deadline = time.monotonic() + 20
        while proxy.stats()["bytes_up"] < 2 * MiB and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.blackhole = True
        t0 = time.monotonic()
        t.join(30)  # deadline per part attempt: 1 s + 5 s for its 5 MiB; then a 1 s abort attempt
        elapsed = time.monotonic() - t0
        alive = t.is_alive()
        proxy.clear()
        proxy.reset_all()
    assert not alive, "the upload still hangs 30 s after the server stopped answering"
    assert len(errors) == 1 and isinstance(errors[0], Exception), errors
    assert elapsed < 20, elapsed


def test_restore_from_the_bucket_checks_every_byte(seaweedfs_healthy: SeaweedFS, tmp_path: Path) -> None:
    """One flipped byte in the middle of a multipart shard on the bucket: the ranged reads
    deliver it and the checksum on the way catches it."""
    server = seaweedfs_healthy
    url = server.unique_url("flip")
    state = {"w": torch.randn(4 * MiB, generator=torch.Generator().manual_seed(8))}
    with tiercheck.Checkpointer(remote=url, storage_options=server.storage_options) as c:
        c.save(1, state).wait(timeout=60)
    fs = server.filesystem()
    path = f"{object_path(fs, url)}/{naming.step_dir_name(1)}/{SHARD}"
    raw = bytearray(fs.cat_file(path))
    raw[len(raw) // 2 + 3] ^= 0x10
    fs.pipe_file(path, bytes(raw))
    with (
        pytest.warns(RuntimeWarning, match="checksum mismatch"),
        pytest.raises(tiercheck.CheckpointCorruptedError, match="checksum"),
    ):
        tiercheck.load(url, storage_options=server.storage_options)


def test_upload_memory_stays_within_concurrency_parts(seaweedfs_healthy: SeaweedFS, tmp_path: Path) -> None:
    """Uploading a 60 MiB tier-1 file with 2 parts of 5 MiB in flight holds a few parts'
    worth of memory, whatever the file's size: 2 part buffers, plus the copies the S3 client
    (aiohttp) makes of each part it sends (measured ~27 MiB in all)."""
    server = seaweedfs_healthy
    conc, part = 2, 5 * MiB
    tier = RemoteTier(server.unique_url("mem"), server.storage_options, concurrency=conc, block_size=part)
    local = tmp_path / "shard.bin"
    with open(local, "wb") as f:
        for i in range(60):
            f.write(payload(MiB, seed=i))
    tier.open_step(1, 0).write_file("warm.bin", memoryview(payload(6 * MiB)))  # client set up
    tracemalloc.start()
    try:
        tier.open_step(2, 0).write_from_path(SHARD, str(local))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3.5 * conc * part, f"peak {peak / MiB:.1f} MiB"
    assert os.path.getsize(local) == 60 * MiB


def test_stores_are_picked_by_protocol() -> None:
    class FakeFS:
        def __init__(self, protocol: Any) -> None:
            self.protocol = protocol

    assert isinstance(multipart.store_for(FakeFS(("s3", "s3a"))), multipart.S3Parts)
    assert isinstance(multipart.store_for(FakeFS(("abfs", "az"))), multipart.AzureBlocks)
    assert isinstance(multipart.store_for(FakeFS(("gcs", "gs"))), multipart.GCSCompose)
    assert multipart.store_for(FakeFS(("file", "local"))) is None
    assert multipart.store_for(FakeFS("memory")) is None
