"""An asyncio TCP server on 127.0.0.1 running on a daemon thread: what the test proxies share.

A subclass sets its own state, then calls `_start(name, listen_port)`, and implements
`_handle(reader, writer)` (one accepted connection) and `_shutdown()` (close the server and
end the connections, on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any


class LoopServer:
    host = "127.0.0.1"

    def _start(self, name: str, listen_port: int = 0) -> None:
        self.port = listen_port
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._start_error is not None:
            raise self._start_error
        if not self.port:
            raise RuntimeError(f"{type(self).__name__} did not start")

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, self.port, reuse_address=True)
            )
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:
            self._start_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.sleep(0))
