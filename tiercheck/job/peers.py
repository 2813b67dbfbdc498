"""The tier-0 peer link: a gloo process group of the job's ranks, made for the copies of
tier-0 steps between nodes (`engine.peers`). Never the training process group: it is built
on its own store connection, so its traffic and its failures stay apart from training's.

One exchange moves, for one step, this rank's copy to each of its targets and each of its
sources' copies to this rank. Every rank takes part in every exchange, in the same order
(the order of the saves, the same on every rank), so the point-to-point operations pair up:

    1. headers: every rank sends ``[step, ok, len(marker), len(manifest), len(shard)]`` to each
       target and receives one from each source (ok = 0: this rank has nothing to send);
    2. bodies: the marker, the manifest and the shard in chunks of `CHUNK` bytes, each
       chunk's send held back by the rate cap; the receiver's destination is memory it chose
       (`Incoming`), so a shard lands in its shared-memory file with no copy.

A failed or timed-out operation breaks the exchange (`PeerLinkError`); the caller stops using
the link then, since the pairing of later exchanges cannot be trusted.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CoordinationError

__all__ = ["CHUNK", "Incoming", "Outgoing", "PeerLink", "PeerLinkError"]

CHUNK = 16 << 20  # bytes per point-to-point message of a shard
_HEADER = 5


class PeerLinkError(CoordinationError):
    """An exchange over the peer link failed or timed out (a peer died, the network broke)."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What this rank sends for one step: the commit marker, the manifest and the shard."""

    step: int
    marker: bytes
    manifest: bytes
    shard: torch.Tensor  # uint8, contiguous, CPU (a view of the host buffer)


@dataclass(frozen=True, slots=True)
class Incoming:
    """Where a source's copy lands: the shard's destination (uint8, exactly its length) and
    what to call once everything arrived (`done(marker, manifest)`)."""

    shard: torch.Tensor
    done: Callable[[bytes, bytes], None]


class PeerLink:
    """One rank's end of the peer group.

    Args:
        store: a store every rank reaches, with a connection of its own (`sub_store`).
        rank, world_size: this rank and the job's size.
        timeout: seconds any one operation may take before the exchange fails.
        throttle: called with a chunk's size before it is sent (the rate cap), or None.
    """

    def __init__(
        self, store: Any, rank: int, world_size: int, timeout: float, throttle: Callable[[int], None] | None = None
    ) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.timeout = datetime.timedelta(seconds=timeout)
        self._throttle = throttle
        self.group: Any = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)

    def exchange(
        self,
        outgoing: Outgoing | None,
        step: int,
        targets: Sequence[int],
        sources: Sequence[int],
        accept: Callable[[int, int, int], Incoming | None],
    ) -> list[int]:
        """Send `outgoing` (None: nothing this time) to `targets` and take one copy of
        `step` from each of `sources`; `accept(source, shard_len, step)` says where a copy
        lands (None: refuse it, e.g. no room). Returns the sources whose copy arrived.

        Raises:
            PeerLinkError: an operation failed or timed out; the link is not to be used again.
        """
        try:
            return self._exchange(outgoing, step, targets, sources, accept)
        except PeerLinkError:
            raise
        except Exception as exc:
            raise PeerLinkError(f"rank {self.rank}: tier-0 copy of step {step} over the peer group: {exc}") from exc

    def _exchange(
        self,
        outgoing: Outgoing | None,
        step: int,
        targets: Sequence[int],
        sources: Sequence[int],
        accept: Callable[[int, int, int], Incoming | None],
    ) -> list[int]:
        out = torch.tensor(
            [step, 1, len(outgoing.marker), len(outgoing.manifest), outgoing.shard.numel()]
            if outgoing is not None
            else [step, 0, 0, 0, 0],
            dtype=torch.int64,
        )
        heads = {src: torch.empty(_HEADER, dtype=torch.int64) for src in sources}
        work = [self.group.send([out], dst, 0) for dst in targets]
        work += [self.group.recv([heads[src]], src, 0) for src in sources]
        self._wait(work)
        landing: dict[int, tuple[Incoming | None, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        work = []
        for src in sources:
            h = [int(x) for x in heads[src].tolist()]
            if h[0] != step:
                raise PeerLinkError(f"rank {self.rank}: rank {src} sent step {h[0]} while this rank exchanges {step}")
            if not h[1]:
                continue
            into = accept(src, h[4], step)
            shard = into.shard if into is not None else torch.empty(h[4], dtype=torch.uint8)
            if shard.numel() != h[4]:
                raise PeerLinkError(f"rank {self.rank}: a destination of {shard.numel()} bytes for {h[4]}")
            marker, manifest = torch.empty(h[2], dtype=torch.uint8), torch.empty(h[3], dtype=torch.uint8)
            landing[src] = (into, marker, manifest, shard)
            work += [self.group.recv([marker], src, 0), self.group.recv([manifest], src, 0)]
            work += [self.group.recv([c], src, 0) for c in _chunks(shard)]
        if outgoing is not None:
            marker = torch.frombuffer(bytearray(outgoing.marker), dtype=torch.uint8)
            manifest = torch.frombuffer(bytearray(outgoing.manifest), dtype=torch.uint8)
            for dst in targets:
                work += [self.group.send([marker], dst, 0), self.group.send([manifest], dst, 0)]
            for chunk in _chunks(outgoing.shard):
                if self._throttle is not None:
                    self._throttle(chunk.numel() * max(1, len(targets)))
                work += [self.group.send([chunk], dst, 0) for dst in targets]
        self._wait(work)
        arrived = []
        for src, (into, marker, manifest, _shard) in landing.items():
            if into is not None:
                into.done(marker.numpy().tobytes(), manifest.numpy().tobytes())
                arrived.append(src)
        return arrived

    def send_one(self, dst: int, outgoing: Outgoing) -> None:
        """Restore: send a held copy to the rank it belongs to (paired with `receive_one`)."""
        self.exchange(outgoing, outgoing.step, [dst], [], lambda s, n, t: None)

    def receive_one(self, src: int, step: int, accept: Callable[[int, int, int], Incoming | None]) -> bool:
        return bool(self.exchange(None, step, [], [src], accept))

    def _wait(self, work: list[Any]) -> None:
        for w in work:
            if not w.wait(self.timeout):
                raise PeerLinkError(f"rank {self.rank}: a peer operation timed out after {self.timeout}")


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Zero-length tensors are not sent: a shard of 0 bytes has no chunk."""
    return [t[i : i + CHUNK] for i in range(0, t.numel(), CHUNK)]
