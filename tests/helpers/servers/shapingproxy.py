"""A TCP proxy that shapes each connection like a network link: 127.0.0.1:0 -> target.

- ``rate_bps``: each direction of each connection is capped at this many bytes/s (a token
  bucket holding ``burst_bytes``), as one TCP stream over a real link is;
- ``rtt_s``: every chunk is delivered ``rtt_s / 2`` after it was read, in each direction,
  without holding up the chunks behind it (a delay line, not a stop-and-wait), so a
  request/response pays the round trip once and a bulk transfer still runs at the cap.

Over loopback the server and the client are the only limits; through this proxy, one
connection moves at most ``rate_bps`` and N connections in flight at most ``N x rate_bps``:
what parallel transfers are for. Knobs may change while it runs (new chunks see them).

Run it in-process (``ShapingProxy(port, rate_bps=..., rtt_s=...)``: an asyncio loop on a
daemon thread), or in a process of its own so that its CPU does not compete with the client
for the GIL (``ShapingProxyProcess``, or ``python tests/helpers/servers/shapingproxy.py PORT
--rate-mbps 25 --rtt-ms 20``, which prints the port it listens on).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

try:
    from .loopserver import LoopServer
except ImportError:  # run as a script: python tests/helpers/servers/shapingproxy.py PORT ...
    from loopserver import LoopServer  # type: ignore[no-redef]

_CHUNK = 64 << 10


class _Bucket:
    """A token bucket on a virtual clock: `reserve(n)` is how long to wait before sending n bytes."""

    CATCH_UP_S = 0.05

    def __init__(self) -> None:
        self.free_at = 0.0  # when the link is next idle

    def reserve(self, n: int, rate: float | None, burst: int) -> float:
        now = time.monotonic()
        if not rate:
            return 0.0
        # Idle link: it saved up `burst` at most. Busy link on a loop that woke up late: catch
        # up, so that timer slack does not lower the rate.
        idle = now - self.free_at > self.CATCH_UP_S
        start = max(now - burst / rate, self.free_at) if idle else self.free_at
        self.free_at = start + n / rate
        return max(0.0, self.free_at - now)


class ShapingProxy(LoopServer):
    """Per-connection bandwidth cap and added round-trip time; see the module docstring."""

    def __init__(
        self,
        target_port: int,
        target_host: str = "127.0.0.1",
        *,
        rate_bps: float | None = None,
        rtt_s: float = 0.0,
        burst_bytes: int = _CHUNK,
        listen_port: int = 0,
    ) -> None:
        self.target_host, self.target_port = target_host, target_port
        self.rate_bps = rate_bps
        self.rtt_s = rtt_s
        self.burst_bytes = burst_bytes
        self._stats = {"accepted": 0, "bytes_up": 0, "bytes_down": 0, "open": 0, "max_open": 0}
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._start(f"ShapingProxy->{target_port}", listen_port)

    def stats(self) -> dict[str, int]:
        """Connections accepted, open now, most open at once, and bytes each way."""
        return dict(self._stats)

    def __repr__(self) -> str:
        rate = f"{self.rate_bps / 1e6:g} MB/s" if self.rate_bps else "no cap"
        return f"<ShapingProxy :{self.port} -> :{self.target_port}, {rate} per connection, rtt {self.rtt_s * 1e3:g} ms>"

    # --- loop thread --------------------------------------------------------------------
    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        if self._tasks:  # aborted transports end their pipes; cancel only what does not end
            _, late = await asyncio.wait(list(self._tasks), timeout=2)
            for task in late:
                task.cancel()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._stats["accepted"] += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(self.target_host, self.target_port), 5)
        except (OSError, asyncio.TimeoutError):
            client_w.transport.abort()
            return
        self._writers.update((client_w, up_w))
        self._stats["open"] += 1
        self._stats["max_open"] = max(self._stats["max_open"], self._stats["open"])
        try:
            await asyncio.gather(
                self._pipe(client_r, up_w, "bytes_up"), self._pipe(up_r, client_w, "bytes_down"), return_exceptions=True
            )
        finally:
            self._stats["open"] -= 1
            for w in (client_w, up_w):
                self._writers.discard(w)
                w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, stat: str) -> None:
        """Read, pace to the cap, then hand each chunk to a writer that delivers it rtt/2 later."""
        bucket = _Bucket()
        line: deque[tuple[float, bytes]] = deque()
        wake = asyncio.Event()
        done = False

        async def deliver() -> None:
            while True:
                while not line:
                    if done:
                        return
                    wake.clear()
                    await wake.wait()
                at, data = line.popleft()
                delay = at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                if data:
                    w.write(data)
                    await w.drain()
                    self._stats[stat] += len(data)
                elif w.can_write_eof():
                    w.write_eof()  # half-close, passed on in order

        writer = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await r.read(_CHUNK)
                wait = bucket.reserve(len(data), self.rate_bps, self.burst_bytes) if data else 0.0
                if wait > 0:
                    await asyncio.sleep(wait)
                line.append((time.monotonic() + self.rtt_s / 2, data))
                wake.set()
                if not data:
                    break
                if writer.done():  # the other side went away
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            done = True
            wake.set()
            with contextlib.suppress(Exception):
                await writer
            if writer.done() and not writer.cancelled() and writer.exception() is not None:
                w.transport.abort()


class ShapingProxyProcess:
    """`ShapingProxy` in a child process (this file run as a script)."""

    def __init__(self, target_port: int, *, rate_bps: float | None, rtt_s: float = 0.0) -> None:
        cmd = [sys.executable, os.path.abspath(__file__), str(target_port), "--rtt-ms", str(rtt_s * 1e3)]
        if rate_bps:
            cmd += ["--rate-mbps", str(rate_bps / 1e6)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            self.close()
            raise RuntimeError(f"shaping proxy did not start: {line!r}")
        self.port = int(line.split()[1])
        self.rate_bps, self.rtt_s = rate_bps, rtt_s

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ShapingProxyProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="per-connection bandwidth cap and added RTT in front of a TCP port")
    ap.add_argument("target_port", type=int)
    ap.add_argument("--rate-mbps", type=float, default=None, help="cap per connection and direction, MB/s (1e6)")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time, ms")
    args = ap.parse_args(argv)
    rate = args.rate_mbps * 1e6 if args.rate_mbps else None
    proxy = ShapingProxy(args.target_port, rate_bps=rate, rtt_s=args.rtt_ms / 1e3)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"listening {proxy.port}", flush=True)
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()  # parent gone: stop
    stop.wait()
    proxy.close()


if __name__ == "__main__":
    main()
