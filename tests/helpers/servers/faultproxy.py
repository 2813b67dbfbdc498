"""A TCP fault proxy: asyncio in a background thread, 127.0.0.1:0 -> 127.0.0.1:<target>.

Point a client's endpoint at ``proxy.port`` and change the knobs while it runs:

- ``latency_s``: sleep before forwarding each chunk (both directions);
- ``bandwidth_bps``: cap each direction of each connection (sleep ``len/bps`` per chunk);
- ``reset_after_bytes``: once a connection has forwarded this many bytes (both directions
  together), RST both sides (SO_LINGER(1, 0) + close, a real TCP reset);
- ``blackhole``: new connections are accepted and read but never answered nor forwarded; open
  connections stop forwarding (data is swallowed) while it is on;
- ``refuse``: new connections are reset right after accept (the client sees ECONNRESET);
- ``reset_all()``: RST every open connection now;  ``close()``: stop (also RSTs everything).

It is per-connection and HTTP-unaware: good for connection and stream faults, not for
"answer the 3rd request with 503". ``stats()`` counts connections and bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import TYPE_CHECKING, Any

from .loopserver import LoopServer

if TYPE_CHECKING:
    from .process import ObjectStoreServer

_CHUNK = 65536


def _rst(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER(1, 0): the kernel sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Conn:
    def __init__(self, client_w: asyncio.StreamWriter) -> None:
        self.client_w = client_w
        self.upstream_w: asyncio.StreamWriter | None = None
        self.nbytes = 0
        self.done = False

    def reset(self) -> None:
        if self.done:
            return
        self.done = True
        for w in (self.client_w, self.upstream_w):
            if w is not None:
                _rst(w)


class FaultProxy(LoopServer):
    def __init__(
        self,
        target_port: int,
        target_host: str = "127.0.0.1",
        *,
        latency_s: float = 0.0,
        bandwidth_bps: float | None = None,
        reset_after_bytes: int | None = None,
        blackhole: bool = False,
        refuse: bool = False,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.reset_after_bytes = reset_after_bytes
        self.blackhole = blackhole
        self.refuse = refuse
        self.connect_timeout_s = connect_timeout_s
        self._conns: set[_Conn] = set()
        self._stats = {"accepted": 0, "refused": 0, "blackholed": 0, "reset": 0, "bytes_up": 0, "bytes_down": 0}
        self._start(f"FaultProxy->{target_port}", 0)

    # --- public -------------------------------------------------------------------------
    def clear(self) -> None:
        """All knobs back to 'no fault' (open connections are left alone)."""
        self.latency_s = 0.0
        self.bandwidth_bps = None
        self.reset_after_bytes = None
        self.blackhole = False
        self.refuse = False

    def stats(self) -> dict[str, int]:
        return dict(self._stats, open=len(self._conns))

    def reset_all(self) -> int:
        """RST every open connection; returns how many."""
        if self._closed:
            return 0
        fut = asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop)
        return fut.result(10)

    def __repr__(self) -> str:
        return f"<FaultProxy 127.0.0.1:{self.port} -> {self.target_host}:{self.target_port}>"

    # --- loop thread --------------------------------------------------------------------
    async def _reset_all(self) -> int:
        conns = list(self._conns)
        for c in conns:
            c.reset()
        self._stats["reset"] += len(conns)
        return len(conns)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        conn = _Conn(client_w)
        self._stats["accepted"] += 1
        if self.refuse:
            self._stats["refused"] += 1
            _rst(client_w)
            return
        self._conns.add(conn)
        try:
            if self.blackhole:
                self._stats["blackholed"] += 1
                while not conn.done and await client_r.read(_CHUNK):
                    pass
                return
            try:
                up_r, up_w = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port), self.connect_timeout_s
                )
            except (OSError, asyncio.TimeoutError):
                conn.reset()  # upstream down: the client sees a reset, as if refused
                return
            conn.upstream_w = up_w
            await asyncio.gather(
                self._pipe(conn, client_r, up_w, "bytes_up"),
                self._pipe(conn, up_r, client_w, "bytes_down"),
                return_exceptions=True,
            )
        finally:
            self._conns.discard(conn)
            if not conn.done:
                conn.done = True
                for w in (conn.client_w, conn.upstream_w):
                    if w is not None:
                        w.close()

    async def _pipe(self, conn: _Conn, r: asyncio.StreamReader, w: asyncio.StreamWriter, stat: str) -> None:
        try:
            while not conn.done:
                data = await r.read(_CHUNK)
                if not data:
                    if w.can_write_eof():
                        w.write_eof()  # half-close, pass the FIN on
                    return
                if self.blackhole:
                    continue  # swallow
                limit = self.reset_after_bytes
                if limit is not None and conn.nbytes + len(data) >= limit:
                    keep = max(0, limit - conn.nbytes)
                    if keep:
                        w.write(data[:keep])
                        await w.drain()
                        conn.nbytes += keep
                        self._stats[stat] += keep
                    self._stats["reset"] += 1
                    conn.reset()
                    return
                if self.latency_s > 0:
                    await asyncio.sleep(self.latency_s)
                bps = self.bandwidth_bps
                if bps:
                    await asyncio.sleep(len(data) / bps)
                if conn.done:
                    return
                w.write(data)
                await w.drain()
                conn.nbytes += len(data)
                self._stats[stat] += len(data)
        except (ConnectionError, OSError):
            conn.reset()


class ProxiedServer:
    """A server reached through a FaultProxy: same url_root, storage_options via the proxy."""

    def __init__(self, server: ObjectStoreServer, proxy: FaultProxy) -> None:
        self.server, self.proxy = server, proxy

    @property
    def url_root(self) -> str:
        return self.server.url_root

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.server.storage_options_via(self.proxy.port)

    def filesystem(self, **overrides: Any) -> Any:
        return self.server.filesystem(port=self.proxy.port, **overrides)

    def unique_url(self, prefix: str = "t") -> str:
        return self.server.unique_url(prefix)


def proxied(server: ObjectStoreServer, **knobs: Any) -> ProxiedServer:
    """Put a new FaultProxy in front of ``server`` (caller closes ``.proxy``)."""
    return ProxiedServer(server, FaultProxy(server.port, **knobs))
