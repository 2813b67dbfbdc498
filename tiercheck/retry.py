"""Which object-store errors are worth retrying, and the backoff loop (no I/O of its own)."""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import InvalidArgumentError

T = TypeVar("T")

# Exception class names from botocore, aiohttp, azure-core and google-auth that mean "the
# network or the service hiccupped": matched by name so no client library is imported.
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
        "ProxyConnectionError", "ResponseStreamingError", "IncompleteReadError",
        "ClientConnectorError", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError",
        "ClientPayloadError", "ServerTimeoutError", "ClientConnectionResetError",
        "ServiceRequestError", "ServiceResponseError", "TransportError",
    }
)  # fmt: skip
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EAGAIN, errno.EBUSY}
)  # fmt: skip
_TRANSIENT_TEXT = (
    "SlowDown", "Throttl", "TooManyRequests", "Too Many Requests", "ServiceUnavailable",
    "InternalError", "RequestTimeout", "503", "500 ", "502", "504", "reset by peer",
    "Connection refused", "timed out", "Server disconnected",
)  # fmt: skip


def is_transient(exc: BaseException) -> bool:
    """True for connection, timeout, throttling and 5xx errors; False for e.g. bad credentials."""
    if isinstance(exc, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (ConnectionError, TimeoutError)):
            return True
        if type(cur).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(cur, OSError) and cur.errno in _TRANSIENT_ERRNOS:
            return True
        status = getattr(cur, "status_code", None) or getattr(cur, "status", None)
        if isinstance(status, int) and (status >= 500 or status in (408, 429)):
            return True
        text = str(cur)
        if any(t in text for t in _TRANSIENT_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with full jitter within a time budget.

    Attributes:
        budget_s: give up when the next attempt would start later than this after the
            first one. The default covers an outage of at least 60 s.
        initial_s: the first backoff's upper bound.
        max_s: the cap on one backoff.
    """

    budget_s: float = 120.0
    initial_s: float = 0.5
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.budget_s < 0 or self.initial_s <= 0 or self.max_s < self.initial_s:
            raise InvalidArgumentError(f"invalid retry policy {self}")

    def run(
        self,
        fn: Callable[[], T],
        on_retry: Callable[[BaseException, int, float], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        stop: Callable[[], bool] = lambda: False,
    ) -> T:
        """Call `fn` until it succeeds, a permanent error occurs, or the budget runs out."""
        start = time.monotonic()
        attempt = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                attempt += 1
                if not is_transient(exc) or stop():
                    raise
                delay = random.uniform(0, min(self.max_s, self.initial_s * 2 ** (attempt - 1)))
                if time.monotonic() + delay - start > self.budget_s:
                    raise
                if on_retry is not None:
                    on_retry(exc, attempt, delay)
                sleep(delay)
