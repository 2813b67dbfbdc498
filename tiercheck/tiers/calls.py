"""Each call to an object store bounded in time.

Client libraries do not bound every wait: s3fs never times out sending a body to a hung
server, and aiohttp waits with no timeout for the reply to ``Expect: 100-continue``. So one
attempt of a call runs on a short-lived daemon thread of its own and the caller stops
waiting after its deadline (the only thread the tiers start); and on S3 that header goes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def attempt_within(tier: str, what: str, fn: Callable[[], T], deadline: float) -> T:
    """Run one attempt of `fn` on its own daemon thread and stop waiting after `deadline` s.

    A thread stuck in the client (a hung server) is abandoned, not killed. If it finishes
    later, what it wrote is the same bytes a retry writes, or, in the rare case of a marker
    upload that hung, gave up and then went through after `abort()`, a marker whose files are
    gone: restore then finds that step damaged and falls back to an older one; it never
    returns its bytes.

    Raises:
        TimeoutError: `fn` did not return within `deadline` (a transient error to retry).
    """
    results: list[T] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            results.append(fn())
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    call = threading.Thread(target=run, name="tiercheck-remote-call", daemon=True)
    call.start()
    if not done.wait(deadline):
        raise TimeoutError(f"tier {tier!r}: {what} took longer than {deadline:.0f}s")
    call.join()  # past fn(): it ends at once, so no call thread outlives its call
    if errors:
        raise errors[0]
    return results[0]


def bound_s3_writes(fs: Any, patched: object) -> object:
    """s3fs/botocore send ``Expect: 100-continue`` on every PUT and aiohttp then waits for
    the server's interim reply with no timeout, so a write to a hung server never returns
    whatever ``read_timeout`` says. Dropping the header lets the timeouts bound writes too.
    `patched` is the client done last time; returns the client done now (re-apply whenever
    s3fs has built a new one)."""
    if "s3" not in getattr(fs, "protocol", ()):
        return patched
    client = fs.s3  # connects on first use
    if client is patched:
        return patched
    try:
        from botocore.handlers import add_expect_header  # type: ignore[import-untyped]
    except ImportError:  # pragma: no cover - botocore always comes with s3fs
        return patched
    client.meta.events.unregister("before-call.s3", add_expect_header)
    return client
