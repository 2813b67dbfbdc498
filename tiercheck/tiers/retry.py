"""Which object-store errors are worth retrying, and the backoff loop (no I/O of its own)."""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import InvalidArgumentError

T = TypeVar("T")

# Exception class names from botocore, aiohttp, azure-core and google-auth that mean "the
# network or the service hiccupped": matched by name (along the class's MRO) so no client
# library is imported.
_TRANSIENT_NAMES = frozenset(
    {
        "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
        "ProxyConnectionError", "ResponseStreamingError", "IncompleteReadError",
        "ClientConnectorError", "ClientConnectionError", "ServerDisconnectedError", "ClientOSError",
        "ClientPayloadError", "ServerTimeoutError", "ClientConnectionResetError",
        "ServiceRequestError", "ServiceResponseError", "TransportError",
    }
)  # fmt: skip
# errno values of a dropped or refused connection, or of a busy service (s3fs turns S3's
# SlowDown and ServiceUnavailable into EBUSY, InternalError into EREMOTEIO).
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN, errno.EBUSY,
     getattr(errno, "EREMOTEIO", errno.EIO)}
)  # fmt: skip
# Service error codes (S3's ``Error.Code``, Azure's ``error_code``) that mean "try again".
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests",
        "TooManyRequestsException", "RequestLimitExceeded", "ServiceUnavailable", "InternalError",
        "RequestTimeout", "RequestTimeoutException", "ServerBusy", "OperationTimedOut",
    }
)  # fmt: skip
_PERMANENT_TYPES = (PermissionError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


def is_transient(exc: BaseException) -> bool:
    """True for connection, timeout, throttling and 5xx errors; False for e.g. bad credentials.

    Decided by the exception's type, errno, HTTP status and service error code, never by
    its text: a message quotes paths (``step-000000000503``) and server prose. The first
    exception along ``__cause__``/``__context__`` that says either way decides; an exception
    that says nothing either way (a bare ``OSError(EIO)``) defers to its cause, and a chain
    that never says is permanent."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        verdict = _classify(cur)
        if verdict is not None:
            return verdict
        cur = cur.__cause__ or cur.__context__
    return False


def _classify(exc: BaseException) -> bool | None:
    """True (transient), False (permanent) or None (this exception does not say)."""
    if isinstance(exc, _PERMANENT_TYPES):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if any(c.__name__ in _TRANSIENT_NAMES for c in type(exc).__mro__):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    code, status = _service_code(exc), _http_status(exc)
    if code is not None and code in _TRANSIENT_CODES:
        return True
    if status is not None:
        return status >= 500 or status in (408, 429)
    return None


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status a client library attached: botocore ``ClientError.response``,
    azure-core ``status_code``, aiohttp ``status``, gcsfs ``HttpError.code``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata")
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        if type(status) is int:
            return status
    for attr in ("status_code", "status", "code"):
        status = getattr(exc, attr, None)
        if type(status) is int and 100 <= status < 600:
            return status
    return None


def _service_code(exc: BaseException) -> str | None:
    """The service's error code: botocore ``response["Error"]["Code"]``, azure ``error_code``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error")
        code = error.get("Code") if isinstance(error, dict) else None
        if isinstance(code, str):
            return code
    code = getattr(exc, "error_code", None)
    return code if isinstance(code, str) else None


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
