"""Sanity tests for the real test servers in tests/helpers/servers (round trips and fault knobs)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest

from tests.helpers.servers import FaultProxy, ProxiedServer, SeaweedFS
from tests.helpers.servers.seaweedfs import disable_expect_100_continue

# Also registered from tests/conftest.py; listing it here too keeps this module self-contained.
pytest_plugins = ["tests.helpers.servers.plugin"]

MiB = 1 << 20
SERVERS = ["seaweedfs", "azurite", "gcs_server"]


def _payload(n: int, seed: int = 0) -> bytes:
    # Cheap but not trivially compressible: repeat a random block with the offset mixed in.
    block = os.urandom(MiB)
    return b"".join(bytes([i & 0xFF]) + block[1:] for i in range(seed, seed + n // MiB)) + block[: n % MiB]


def _round_trip(fs: Any, root: str, tmp_path: Path) -> None:
    data = _payload(6 * MiB)
    small = b"hello tiercheck"
    # pipe (one shot) and put (from a local file)
    fs.pipe_file(f"{root}/a/one.bin", data)
    local = tmp_path / "local.bin"
    local.write_bytes(data[: 3 * MiB])
    fs.put_file(str(local), f"{root}/a/two.bin")
    fs.pipe_file(f"{root}/b/small.txt", small)
    # streamed write in blocks (multipart / block list / resumable, depending on the backend)
    with fs.open(f"{root}/a/three.bin", "wb", block_size=5 * MiB) as f:
        for i in range(0, len(data), MiB):
            f.write(data[i : i + MiB])
    fs.invalidate_cache()
    # ls
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{root}/a", detail=False))
    assert names == ["one.bin", "three.bin", "two.bin"]
    sizes = {p["name"].rsplit("/", 1)[-1]: p["size"] for p in fs.ls(f"{root}/a", detail=True)}
    assert sizes == {"one.bin": 6 * MiB, "two.bin": 3 * MiB, "three.bin": 6 * MiB}
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(root)) == ["one.bin", "small.txt", "three.bin", "two.bin"]
    # cat, ranged cat, cat_ranges, seek+read
    assert fs.cat_file(f"{root}/b/small.txt") == small
    assert fs.cat_file(f"{root}/a/one.bin") == data
    assert fs.cat_file(f"{root}/a/three.bin") == data
    assert fs.cat_file(f"{root}/a/one.bin", start=MiB - 7, end=2 * MiB + 5) == data[MiB - 7 : 2 * MiB + 5]
    assert fs.cat_file(f"{root}/a/two.bin", start=3 * MiB - 100) == data[3 * MiB - 100 : 3 * MiB]
    got = fs.cat_ranges([f"{root}/a/one.bin", f"{root}/a/two.bin"], [0, 5 * MiB // 2], [10, 5 * MiB // 2 + 10])
    assert got == [data[:10], data[5 * MiB // 2 : 5 * MiB // 2 + 10]]
    with fs.open(f"{root}/a/three.bin", "rb") as f:
        f.seek(4 * MiB + 3)
        assert f.read(1000) == data[4 * MiB + 3 : 4 * MiB + 1003]
    out = tmp_path / "back.bin"
    fs.get_file(f"{root}/a/two.bin", str(out))
    assert out.read_bytes() == data[: 3 * MiB]
    # rm
    fs.rm(f"{root}/a/two.bin")
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/a/two.bin")
    fs.rm(root, recursive=True)
    fs.invalidate_cache()
    # SeaweedFS keeps emptied "directories" (listed as prefixes), so look at files only.
    assert [p for p, i in fs.find(root, detail=True).items() if i["type"] == "file"] == []


# --- trivial protocols ---------------------------------------------------------------------
def test_memory_round_trip(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    _round_trip(fs, "memory://tc-servers-test", tmp_path)


def test_file_round_trip(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    fs, root = fsspec.url_to_fs(f"file://{tmp_path}/store", auto_mkdir=True)
    _round_trip(fs, root, tmp_path)


# --- real servers --------------------------------------------------------------------------
@pytest.mark.parametrize("server_name", SERVERS)
def test_round_trip(server_name: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    server = request.getfixturevalue(server_name)
    url = server.unique_url("rt")
    # The way tiercheck will use it: URL + storage_options.
    fs, _root = fsspec.url_to_fs(url, **server.storage_options)
    assert fs.protocol == server.protocol or server.protocol in fs.protocol
    _round_trip(fs, url, tmp_path)
    assert isinstance(server.pid, int) and server.alive()
    assert server.url_root.startswith(f"{server.protocol}://")


@pytest.mark.parametrize(
    "server_name",
    [
        "seaweedfs",
        pytest.param(
            "azurite",
            marks=pytest.mark.xfail(
                raises=ValueError,
                strict=True,
                reason=("Azurite 3.35 answers a suffix range (bytes=-N) without Content-Range"),
            ),
        ),
        pytest.param(
            "gcs_server",
            marks=pytest.mark.xfail(
                raises=AssertionError,
                strict=True,
                reason=("gcp-storage-emulator ignores a suffix range and returns the whole object"),
            ),
        ),
    ],
)
def test_suffix_range(server_name: str, request: pytest.FixtureRequest) -> None:
    """cat_file(start=-N): a known emulator gap; tiercheck should read tails by absolute offsets."""
    server = request.getfixturevalue(server_name)
    fs = server.filesystem()
    url = server.unique_url("sfx")
    data = bytes(range(256)) * 8
    fs.pipe_file(f"{url}/f", data)
    try:
        assert fs.cat_file(f"{url}/f", start=-100) == data[-100:]
    finally:
        fs.rm(url, recursive=True)


@pytest.mark.parametrize("server_name", SERVERS)
def test_storage_options_are_fresh_and_fast(server_name: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue(server_name)
    opts = server.storage_options
    assert opts["skip_instance_cache"] is True
    opts["mutated"] = 1
    assert "mutated" not in server.storage_options  # a new dict every time


# --- fault proxy ---------------------------------------------------------------------------
def test_proxy_passthrough_latency_and_bandwidth(seaweedfs_proxy: ProxiedServer) -> None:
    fs = seaweedfs_proxy.filesystem()
    url = seaweedfs_proxy.unique_url("px")
    data = _payload(4 * MiB)
    fs.pipe_file(f"{url}/x", data)
    assert fs.cat_file(f"{url}/x") == data
    up0 = seaweedfs_proxy.proxy.stats()["bytes_up"]
    assert up0 >= len(data)
    seaweedfs_proxy.proxy.bandwidth_bps = 16 * MiB
    t0 = time.monotonic()
    fs.pipe_file(f"{url}/y", data)
    assert time.monotonic() - t0 >= 0.25 - 0.05  # 4 MiB at 16 MiB/s
    seaweedfs_proxy.proxy.clear()
    seaweedfs_proxy.proxy.latency_s = 0.2
    t0 = time.monotonic()
    assert fs.cat_file(f"{url}/y", start=0, end=10) == data[:10]
    assert time.monotonic() - t0 >= 0.2
    seaweedfs_proxy.proxy.clear()
    fs.rm(url, recursive=True)


def test_proxy_refuse_fails_write_fast(seaweedfs_proxy: ProxiedServer) -> None:
    fs = seaweedfs_proxy.filesystem()
    url = seaweedfs_proxy.unique_url("refuse")
    fs.pipe_file(f"{url}/before", b"x")  # works through the proxy
    seaweedfs_proxy.proxy.refuse = True
    seaweedfs_proxy.proxy.reset_all()  # drop pooled keep-alive connections too
    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:
        fsspec.filesystem("s3", **seaweedfs_proxy.storage_options).pipe_file(f"{url}/after", b"y" * MiB)
    elapsed = time.monotonic() - t0
    assert elapsed < 10, f"refused write took {elapsed:.1f} s ({ei.value!r})"
    assert seaweedfs_proxy.proxy.stats()["refused"] >= 1
    seaweedfs_proxy.proxy.refuse = False
    assert fs.cat_file(f"{url}/before") == b"x"


def test_proxy_reset_after_bytes_breaks_upload(seaweedfs_proxy: ProxiedServer) -> None:
    seaweedfs_proxy.proxy.reset_after_bytes = MiB
    fs = seaweedfs_proxy.filesystem()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017
        fs.pipe_file(seaweedfs_proxy.unique_url("rst") + "/big", _payload(3 * MiB))
    assert time.monotonic() - t0 < 10
    assert seaweedfs_proxy.proxy.stats()["reset"] >= 1


QUICK_S3: dict[str, Any] = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 0}}}


def test_proxy_blackhole_read_times_out(seaweedfs_proxy: ProxiedServer) -> None:
    fs = seaweedfs_proxy.filesystem()
    url = seaweedfs_proxy.unique_url("bh")
    fs.pipe_file(f"{url}/x", b"abc")
    seaweedfs_proxy.proxy.blackhole = True
    seaweedfs_proxy.proxy.reset_all()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - botocore ReadTimeoutError
        seaweedfs_proxy.filesystem(**QUICK_S3).cat_file(f"{url}/x")
    assert time.monotonic() - t0 < 5
    # A PUT to a silent server only times out without "Expect: 100-continue" (see seaweedfs.py).
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017
        disable_expect_100_continue(seaweedfs_proxy.filesystem(**QUICK_S3)).pipe_file(f"{url}/y", b"y" * MiB)
    assert time.monotonic() - t0 < 5


def test_put_to_silent_server_hangs_with_expect_100(seaweedfs_proxy: ProxiedServer) -> None:
    """Documents the client trap: the default s3fs PUT never times out against a silent peer.
    If this starts failing, aiohttp/aiobotocore fixed it and the workaround can go."""
    seaweedfs_proxy.proxy.blackhole = True
    fs = seaweedfs_proxy.filesystem(**QUICK_S3)
    outcome: list[BaseException | None] = []

    def put() -> None:
        try:
            fs.pipe_file(seaweedfs_proxy.unique_url("hang") + "/y", b"y")
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=put, daemon=True)
    t.start()
    t.join(3)
    assert t.is_alive() and not outcome, f"PUT returned: {outcome}"
    # An RST frees the stuck request (the client reconnects at once, so refuse that too).
    seaweedfs_proxy.proxy.blackhole = False
    seaweedfs_proxy.proxy.refuse = True
    seaweedfs_proxy.proxy.reset_all()
    t.join(10)
    assert not t.is_alive() and outcome and outcome[0] is not None


def test_proxy_rst_is_a_real_reset(fault_proxy: Any) -> None:
    """Raw sockets: refuse and reset_after_bytes give ECONNRESET, blackhole gives silence."""
    echo = socket.socket()
    echo.bind(("127.0.0.1", 0))
    echo.listen()

    def echo_conn(c: socket.socket) -> None:
        with c:
            try:
                while d := c.recv(65536):
                    c.sendall(d)
            except OSError:
                pass

    def serve() -> None:
        while True:
            try:
                c, _ = echo.accept()
            except OSError:
                return
            threading.Thread(target=echo_conn, args=(c,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        p: FaultProxy = fault_proxy(echo.getsockname()[1])
        with socket.create_connection(("127.0.0.1", p.port), timeout=2) as s:
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
        p.reset_after_bytes = 6
        with socket.create_connection(("127.0.0.1", p.port), timeout=2) as s:
            s.sendall(b"0123456789")
            with pytest.raises(ConnectionResetError):
                for _ in range(10):
                    if not s.recv(100):
                        break
        p.clear()
        p.blackhole = True
        with socket.create_connection(("127.0.0.1", p.port), timeout=0.3) as s:
            s.sendall(b"ping")
            with pytest.raises(socket.timeout):
                s.recv(4)
        p.clear()
        p.refuse = True
        # The RST may land while connect() is still returning, or at the first send/recv.
        with pytest.raises(ConnectionResetError), socket.create_connection(("127.0.0.1", p.port), timeout=2) as s:
            s.sendall(b"ping")
            s.recv(4)
            s.sendall(b"ping")
    finally:
        echo.close()


def test_azurite_fast_fail_through_refusing_proxy(azurite: Any, fault_proxy: Any) -> None:
    p = fault_proxy(azurite.port)
    fs = azurite.filesystem(port=p.port, fast_fail=True)
    url = azurite.unique_url("ff")
    fs.pipe_file(f"{url}/ok", b"ok")
    p.refuse = True
    p.reset_all()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017
        fs.pipe_file(f"{url}/fail", b"z" * MiB)
    assert time.monotonic() - t0 < 10


# --- process faults on SeaweedFS -----------------------------------------------------------
def test_seaweedfs_sigstop_times_out_then_recovers(seaweedfs_healthy: SeaweedFS) -> None:
    server = seaweedfs_healthy
    url = server.unique_url("stop")
    fs = server.filesystem()
    fs.pipe_file(f"{url}/x", b"abc")
    quick = server.filesystem(**QUICK_S3)
    server.stop_process()
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017
            quick.cat_file(f"{url}/x")
        assert time.monotonic() - t0 < 10
    finally:
        server.cont_process()
    assert server.filesystem().cat_file(f"{url}/x") == b"abc"


def test_seaweedfs_kill_and_restart_keeps_data(seaweedfs_healthy: SeaweedFS) -> None:
    server = seaweedfs_healthy
    port, old_pid = server.port, server.pid
    url = server.unique_url("crash")
    data = _payload(3 * MiB, seed=7)
    fs = server.filesystem()
    fs.pipe_file(f"{url}/kept.bin", data)
    server.kill()
    assert not server.alive()
    t0 = time.monotonic()
    with pytest.raises(Exception):  # noqa: B017 - botocore EndpointConnectionError
        server.filesystem().pipe_file(f"{url}/lost", b"x")
    assert time.monotonic() - t0 < 10
    server.restart()
    assert server.port == port and server.pid != old_pid
    fs = server.filesystem()
    assert fs.cat_file(f"{url}/kept.bin") == data
    assert fs.cat_file(f"{url}/kept.bin", start=MiB, end=MiB + 100) == data[MiB : MiB + 100]
    fs.rm(url, recursive=True)


# --- shaping proxy -------------------------------------------------------------------------
class _Sink:
    """A TCP server on 127.0.0.1: after a header (kind, n) it answers one byte, reads `n`
    bytes, answers one byte, then sends `n` bytes back; or (kind "p") echoes `n` single bytes."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    @staticmethod
    def _one(conn: socket.socket) -> None:
        with conn:
            head = conn.recv(9, socket.MSG_WAITALL)
            kind, n = head[:1], int.from_bytes(head[1:], "big")
            if kind == b"p":  # ping-pong n times
                for _ in range(n):
                    conn.sendall(conn.recv(1, socket.MSG_WAITALL))
                return
            conn.sendall(b"r")
            left = n
            while left:
                left -= len(conn.recv(min(left, 1 << 20)))
            conn.sendall(b"k")
            conn.sendall(bytes(n))

    def close(self) -> None:
        self.sock.close()


def _transfer_rates(port: int, n: int) -> tuple[float, float]:
    """Bytes/s of sending `n` bytes through one connection, then of receiving `n` bytes back."""
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"s" + n.to_bytes(8, "big"))
        assert c.recv(1, socket.MSG_WAITALL) == b"r"  # connected end to end: time the bytes only
        t0 = time.monotonic()
        c.sendall(bytes(n))
        assert c.recv(1, socket.MSG_WAITALL) == b"k"
        t1 = time.monotonic()
        got = 0
        while got < n:
            got += len(c.recv(1 << 20))
        t2 = time.monotonic()
    return n / (t1 - t0), n / (t2 - t1)


@pytest.mark.slow  # ~3 s: times a rate-capped stream
def test_shaping_proxy_caps_one_connection_at_its_rate() -> None:
    """One connection through the proxy moves within 10% of its cap, each way (2.5 MB at 5 MB/s,
    0.5 s per direction); the best of three tries, since a loaded machine only slows it down."""
    from tests.helpers.servers import ShapingProxy

    sink = _Sink()
    cap = 5e6
    try:
        with ShapingProxy(sink.port, rate_bps=cap) as proxy:
            tries = [_transfer_rates(proxy.port, 2_500_000) for _ in range(3)]
        best_up, best_down = max(t[0] for t in tries), max(t[1] for t in tries)
        assert 0.9 * cap <= best_up <= 1.1 * cap, tries
        assert 0.9 * cap <= best_down <= 1.1 * cap, tries
        # without the proxy the same transfer is far faster: the cap, not the machine, set the pace
        direct = _transfer_rates(sink.port, 2_500_000)
        assert min(direct) > 3 * cap, direct
    finally:
        sink.close()


def test_shaping_proxy_adds_its_round_trip_without_slowing_a_stream() -> None:
    from tests.helpers.servers import ShapingProxy

    sink = _Sink()
    try:
        with ShapingProxy(sink.port, rtt_s=0.04) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as c:
            c.sendall(b"p" + (5).to_bytes(8, "big"))
            rtts = []
            for i in range(5):
                t0 = time.monotonic()
                c.sendall(bytes([i]))
                assert c.recv(1, socket.MSG_WAITALL) == bytes([i])
                rtts.append(time.monotonic() - t0)
            assert min(rtts) >= 0.04 - 0.002, rtts
            assert sorted(rtts)[2] < 0.12, rtts
        # a delay line, not stop-and-wait: 4 MB with 40 ms of RTT and no cap is still fast
        with ShapingProxy(sink.port, rtt_s=0.04) as proxy:
            up, down = _transfer_rates(proxy.port, 4_000_000)
        assert min(up, down) > 20e6, (up, down)
    finally:
        sink.close()
