"""A write-rate cap shared by a tier's writes (bytes per second, smoothed over ~1 s)."""

from __future__ import annotations

import threading
import time

from ..errors import InvalidArgumentError


class RateLimiter:
    def __init__(self, bytes_per_second: float | None) -> None:
        if bytes_per_second is not None and bytes_per_second <= 0:
            raise InvalidArgumentError("a write-rate cap must be positive bytes/s (or None for no cap)")
        self._rate = bytes_per_second
        self._lock = threading.Lock()
        self._available = 0.0
        self._last = time.monotonic()

    def consume(self, nbytes: int) -> None:
        """Block until `nbytes` may be written without exceeding the cap."""
        if self._rate is None:
            return
        with self._lock:
            now = time.monotonic()
            self._available = min(self._rate, self._available + (now - self._last) * self._rate)
            self._last = now
            self._available -= nbytes
            wait = -self._available / self._rate if self._available < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
