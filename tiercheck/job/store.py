"""The ranks' key-value store: one connection of our own, bounded polls, nothing blocking.

Nothing here runs a collective on the training process group: every exchange is a few
small operations on a *clone* of the job's store (its own connection), polled with
bounded deadlines, so a slow or dead rank makes the others fail after the timeout
instead of hanging them. Waits poll with backoff (2 ms up to 50 ms per 1000 ranks, at
most 1 s), each bounded by the timeout.

`StoreClient` holds the primitives; the protocols built on them each have a module:
the commit vote (`commit`), the restore, catch-up and save-request agreements
(`agreement`), and the job's membership (`coordination`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CoordinationError

__all__ = ["StoreClient", "from_process_group", "instance_prefix", "ranges"]



_instances = 0
_instances_lock = threading.Lock()


def instance_prefix() -> str:
    """A store prefix for the next multi-rank Checkpointer of this process. Every rank
    creates its Checkpointers in the same order, so the n-th one has the same prefix on
    every rank."""
    global _instances
    with _instances_lock:
        n = _instances
        _instances += 1
    return f"tiercheck/{n}/"


def from_process_group() -> tuple[int, int, Any] | None:
    """(rank, world size, store) of the initialised default process group, or None."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    return dist.get_rank(), dist.get_world_size(), store


class StoreClient:
    """One rank's connection to the job's store, with the primitives every protocol uses.

    Args:
        store: a ``torch.distributed.Store`` reachable by every rank. It is cloned, so
            polling here never shares a connection with the training loop.
        rank, world_size: this rank and the job's size.
        prefix: the namespace of one Checkpointer (`instance_prefix()`).
        timeout: seconds to wait for the other ranks at any one point.
    """

    POLL_MIN = 0.002
    POLL_MAX = 0.05  # per 1000 ranks: W ranks polling rank 0's store stay near 20k ops/s

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, timeout: float) -> None:
        import torch.distributed as dist

        try:
            base = store.clone()  # a connection of our own
        except Exception:  # stores without clone (HashStore, FileStore) are safe to share
            base = store
        # Only non-blocking calls are made (get/multi_get only after check() saw the keys),
        # so the store's own timeout never applies and is left as the job set it.
        self._store = dist.PrefixStore(prefix, base)  # type: ignore[attr-defined]
        self._store_base = base
        self._store_prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._poll_max = min(1.0, self.POLL_MAX * max(1.0, world_size / 1000))
        self.generation = 0  # bumped by every collective restore, on every rank alike
        self._lock = threading.Lock()  # one operation at a time on our connection

    # -- primitives ------------------------------------------------------------------

    def _op(self, fn: Callable[[Any], Any]) -> Any:
        with self._lock:
            return fn(self._store)

    def _poll(self, ready: Callable[[], bool], deadline: float, what: str) -> None:
        delay = self.POLL_MIN
        while not ready():
            if time.monotonic() >= deadline:
                raise CoordinationError(f"rank {self.rank}: gave up after {self.timeout:.0f}s waiting for {what}")
            time.sleep(delay)
            delay = min(self._poll_max, delay * 2)

    def _has(self, key: str) -> bool:
        return bool(self._op(lambda s: s.check([key])))

    def _get(self, key: str) -> bytes:
        return bytes(self._op(lambda s: s.get(key)))

    def _count(self, key: str) -> int:
        return int(self._op(lambda s: s.add(key, 0)))

    def _delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self._op(functools.partial(_delete_key, key=k))

    def _get_many(self, keys: Sequence[str]) -> list[bytes]:
        out: list[bytes] = []
        for i in range(0, len(keys), 1024):
            out.extend(bytes(v) for v in self._op(functools.partial(_multi_get, keys=list(keys[i : i + 1024]))))
        return out

    def sub_store(self, name: str) -> Any:
        """A store of its own connection under this Checkpointer's namespace + `name`, for a
        protocol that drives the store from another thread (the tier-0 peer group)."""
        import torch.distributed as dist

        try:
            base = self._store_base.clone()
        except Exception:
            base = self._store_base
        return dist.PrefixStore(f"{self._store_prefix}{name}", base)  # type: ignore[attr-defined]

    # -- set-up ------------------------------------------------------------------------

    def _append_to(self, key: str, value: str) -> None:
        self._op(functools.partial(_append, key=key, value=value))

    def elect(self, what: str, identity: str) -> int:
        """The leader among the ranks that name the same `identity` (one directory): the
        first to ask. Every rank of that group gets the same answer."""
        key = f"leader/{what}/{identity}"
        return int(self._op(lambda s: s.compare_set(key, "", str(self.rank))))


def _delete_key(store: Any, key: str) -> None:
    store.delete_key(key)


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    return list(store.multi_get(keys))


def _append(store: Any, key: str, value: str) -> None:
    store.append(key, value)



def ranges(ranks: Sequence[int]) -> str:
    """``0-3,7``: a compact list of ranks for messages."""
    out: list[str] = []
    start = prev = None
    for r in ranks:
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ",".join(out) or "none"

