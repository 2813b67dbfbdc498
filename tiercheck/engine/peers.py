"""Tier 0's copies on other nodes: send each committed tier-0 step to the peers
`plan.peers` chooses, keep the copies received from others, and give them back to a
replaced node's ranks at restore.

Sending runs on the pipeline's writer thread, after the step is on tier 1 and before its
host buffer goes back to the pool (the buffer is the shard sent: no copy), over the peer
group (`job.peers`), never the training group, rate-capped by ``memory_peer_rate``. A copy
received from rank s lands in a shared-memory file of its own under
``<tier-0 root>/.tiercheck-replicas/rank-<s>/``, committed there by its marker (the
source's, byte for byte) like any tier-0 step; the newest ``keep_memory`` per source stay.

At restore (`fetch_replicas`, collective), ranks publish through the job's store which
steps they hold in memory and which copies of whom; every rank computes the same plan: the
newest step every rank holds in memory or has a copy of somewhere, and for each rank
lacking it, one holder that sends it back. The receiver commits it as its own tier-0 part,
and the restore then reads it from tier 0 like any other, verified byte by byte (a damaged
copy falls back to tier 1 or 2 there). Peers are never trusted: the marker and manifest
that came with a copy are checked as on every tier.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import torch

from ..format import naming
from ..job.coordination import Group
from ..job.peers import Incoming, Outgoing, PeerLink, PeerLinkError
from ..observe.events import logger
from ..plan.peers import peer_sources, peer_targets
from ..plan.retention import KeepLast, plan_deletions
from ..steps.write import commit_received, mark_received
from ..tiers.memory import SharedMemoryTier, ShmBuffer, node_identity, replica_root
from ..tiers.throttle import RateLimiter

__all__ = ["PeerCopies", "join_peers"]

_LIMIT = 1 << 20  # bytes a marker or manifest read for sending may have


class PeerCopies:
    """This rank's side of the tier-0 copies: what it sends where, what it holds of whom."""

    def __init__(
        self,
        link: PeerLink,
        group: Group,
        memory: SharedMemoryTier,
        targets: dict[int, tuple[int, ...]],
        keep: int,
    ) -> None:
        self.link = link
        self.group = group
        self.memory = memory
        self.rank = group.rank
        self.targets = targets
        self.sources = peer_sources(targets)
        self.keep = keep
        self.broken: str | None = None  # why the link is not used any more
        self._restores = 0
        self._fetched: bytes | None = None  # the marker of a part fetched back at restore
        self._held: dict[int, SharedMemoryTier] = {}
        self._swept: set[int] = set()  # sources whose stale buffers were removed

    def held(self, source: int) -> SharedMemoryTier:
        """The store of the copies this rank holds of `source` (made once per source)."""
        store = self._held.get(source)
        if store is None:
            m = self.memory
            store = SharedMemoryTier(m.memory_dir, m.job_id, m.source, rank=source, root=replica_root(m.root, source))
            self._held[source] = store
        if source not in self._swept and self.memory.writing:
            # A receive buffer or spare that a killed holder of these copies left: this rank
            # is their only holder (`plan.peers`), and a writer of this node's tier 0 now (a
            # process that only restores changes nothing).
            store.drop_stale_buffers(source)
            self._swept.add(source)
        return store

    # -- after every save (writer thread) ------------------------------------------------

    def replicate(self, step: int, shard: torch.Tensor | None) -> None:
        """Exchange `step`'s copies with the peers (every rank, every saved step, in order).
        `shard`: this rank's committed tier-0 shard (the host buffer), None when it has none
        this time. A broken link is reported once and not used again; training goes on."""
        if self.broken is not None:
            return
        outgoing = None
        if shard is not None:
            try:
                outgoing = self._outgoing(self.memory, step, shard)
            except OSError as exc:
                logger.warning("tiercheck: step %d: cannot read tier 0 to copy it to peers: %r", step, exc)
        try:
            self.link.exchange(outgoing, step, self.targets[self.rank], self.sources[self.rank], self._accept)
        except PeerLinkError as exc:
            self.broken = str(exc)
            logger.warning(
                "tiercheck: tier-0 copies to other nodes stopped on rank %d at step %d: %s. Tier 0 on this "
                "node, tier 1 and tier 2 go on; a lost node's ranks restore from tier 1/2",
                self.rank,
                step,
                exc,
            )

    def _outgoing(self, tier: SharedMemoryTier, step: int, shard: torch.Tensor) -> Outgoing:
        owner = tier.rank
        world = self.group.coord.world_size
        marker = tier.read_bytes(step, naming.COMMIT_NAME, _LIMIT)
        manifest = tier.read_bytes(step, naming.manifest_name(owner, world), _LIMIT)
        return Outgoing(step, marker, manifest, shard)

    def _accept(self, source: int, nbytes: int, step: int) -> Incoming | None:
        """Where `source`'s copy of `step` lands: a new shared-memory file of the copies'
        store; once all of it arrived it is committed there and older copies go."""
        store = self.held(source)
        if nbytes == 0:
            return None
        try:
            buf = store.spare_buffer(nbytes) or store.new_buffer(source, nbytes)
        except OSError as exc:
            logger.warning("tiercheck: no room for rank %d's copy of step %d: %r", source, step, exc)
            return None
        shard = torch.frombuffer(buf.map, dtype=torch.uint8)

        def done(marker: bytes, manifest: bytes) -> None:
            try:
                _commit_copy(store, buf, step, source, self.group.coord.world_size, marker, manifest, shard, spare=True)
                # Each deleted copy's file goes back to the buffers folder as a spare, which
                # the next copy is received into: allocated once, no page zeroed or faulted in
                # again (a fresh 192 MiB file cost 0.17 CPU-seconds a copy, docs/performance.md).
                for old in plan_deletions(store.committed_steps(), KeepLast(self.keep), in_flight=[]):
                    store.delete_step(old)
            except OSError as exc:
                logger.warning("tiercheck: cannot keep rank %d's copy of step %d: %r", source, step, exc)

        return Incoming(shard, done)

    # -- restore (collective) --------------------------------------------------------------

    def fetch_replicas(self) -> int | None:
        """Give a replaced node's ranks their tier-0 part back from the copies other ranks
        hold. Collective. Returns the step fetched (None: nothing to fetch, or no step every
        rank can have from memory)."""
        if self.broken is not None:
            return None
        coord = self.group.coord
        self._restores += 1
        base = f"peers/restore/{self._restores}/"
        mine = {
            "mem": self.memory.committed_steps(),
            "held": {str(s): self.held(s).committed_steps() for s in self.sources[self.rank]},
        }
        coord._op(lambda s: s.set(f"{base}{self.rank}", json.dumps(mine)))
        deadline = time.monotonic() + coord.timeout
        keys = [f"{base}{r}" for r in range(coord.world_size)]
        coord._poll(lambda: bool(coord._op(lambda s: s.check(keys))), deadline, "every rank's tier-0 holdings")
        everyone = [json.loads(v) for v in coord._get_many(keys)]
        plan = plan_fetch(everyone)
        if plan is None:
            return None
        step, transfers = plan
        self._fetched = None
        try:
            for holder, owner in transfers:
                if holder == self.rank:
                    store = self.held(owner)
                    shard = _map_shard(store, step, owner, coord.world_size)
                    self.link.send_one(owner, self._outgoing(store, step, shard))
                elif owner == self.rank:
                    self.link.receive_one(holder, step, self._accept_own)
        except (PeerLinkError, OSError) as exc:
            self.broken = str(exc)
            self._fetched = None
            logger.warning("tiercheck: could not fetch tier-0 copies at restore: %s", exc)
        # Every part of a node's directory in before any rank of it writes the marker: a
        # marker first would make the step committed there with a part still missing.
        coord._op(lambda s: s.set(f"{base}done/{self.rank}", b"1"))
        done = [f"{base}done/{r}" for r in range(coord.world_size)]
        coord._poll(lambda: bool(coord._op(lambda s: s.check(done))), deadline + coord.timeout, "every rank's fetch")
        if self._fetched is None:
            return None
        try:
            mark_received(self.memory, step, self._fetched)
        except OSError as exc:
            logger.warning("tiercheck: could not commit the fetched tier-0 part of step %d: %r", step, exc)
            return None
        return step

    def _accept_own(self, source: int, nbytes: int, step: int) -> Incoming | None:
        """This rank's own part, sent back by a holder: committed in this rank's tier 0."""
        tier = self.memory
        if nbytes == 0:
            return None
        buf = tier.new_buffer(self.rank, nbytes)
        shard = torch.frombuffer(buf.map, dtype=torch.uint8)

        def done(marker: bytes, manifest: bytes) -> None:
            _commit_copy(tier, buf, step, self.rank, self.group.coord.world_size, None, manifest, shard)
            self._fetched = marker  # written once every rank's fetch is done

        return Incoming(shard, done)


def plan_fetch(everyone: Sequence[dict[str, object]]) -> tuple[int, list[tuple[int, int]]] | None:
    """(step, [(holder, owner), ...]) from every rank's holdings (pure): the newest step every
    rank holds in memory or has a copy of somewhere, and one holder (the lowest rank) for
    each rank that lacks it in memory. None when no rank lacks anything or no step fits."""
    world = len(everyone)
    mem = [set(_ints(e.get("mem"))) for e in everyone]
    copies: dict[int, dict[int, list[int]]] = {}  # owner -> step -> holders
    for holder, e in enumerate(everyone):
        held = e.get("held")
        if not isinstance(held, dict):
            continue
        for owner_text, steps in held.items():
            owner = int(owner_text)
            if 0 <= owner < world:
                for s in _ints(steps):
                    copies.setdefault(owner, {}).setdefault(s, []).append(holder)
    reachable = [mem[r] | set(copies.get(r, {})) for r in range(world)]
    common = set.intersection(*reachable) if reachable else set()
    if not common:
        return None
    step = max(common)
    lacking = [r for r in range(world) if step not in mem[r]]
    if not lacking:
        return None
    return step, [(min(copies[r][step]), r) for r in lacking]


def _ints(v: object) -> list[int]:
    return [int(x) for x in v if type(x) is int] if isinstance(v, list) else []


def _commit_copy(
    tier: SharedMemoryTier,
    buf: ShmBuffer,
    step: int,
    owner: int,
    world: int,
    marker: bytes | None,
    manifest: bytes,
    shard: torch.Tensor,
    spare: bool = False,
) -> None:
    """Commit a received part on `tier` as `owner`'s: the shard file is the buffer it was
    received into (moved in), the manifest and marker the source's bytes (marker None: the
    part only, the caller writes the marker once every part is in). `spare`: `tier` keeps
    the buffer, so that deleting the step takes its file back as a spare to receive into
    (`SharedMemoryTier.spare_buffer`); else the buffer is forgotten once committed."""
    if os.path.lexists(tier.path_of(step, naming.shard_name(owner, world))):  # this part is there already
        if not spare:
            tier.forget_buffer(buf)
        return
    writer = tier.open_step(step, owner, shared=True)
    try:
        writer.write_file(naming.shard_name(owner, world), memoryview(buf.map), aligned=True)
        writer.write_file(naming.manifest_name(owner, world), memoryview(manifest))
        commit_received(tier, writer, step, marker)
    except BaseException:
        writer.abort()
        tier.forget_buffer(buf)
        raise
    if not spare:
        tier.forget_buffer(buf)  # a committed part now: retention removes its file, not the pool


def _map_shard(tier: SharedMemoryTier, step: int, owner: int, world: int) -> torch.Tensor:
    """A read-only view of a held copy's shard file, for sending it."""
    import mmap

    from ..tiers.owned import O_CLOEXEC, O_NOFOLLOW

    path = tier.path_of(step, naming.shard_name(owner, world))
    fd = os.open(path, os.O_RDONLY | O_NOFOLLOW | O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return torch.frombuffer(memoryview(m), dtype=torch.uint8)  # keeps the map alive


def join_peers(
    group: Group, memory: SharedMemoryTier, copies: int, keep: int, rate: float | None
) -> PeerCopies | None:
    """Set up the peer copies (collective: every rank of the job calls it, in the same
    order, right after joining the job): learn every rank's node, place the copies, and open
    the peer group. None (with one warning) when no other node is there to copy to."""
    coord = group.coord
    me = node_identity(memory.memory_dir)
    coord._op(lambda s: s.set(f"peers/node/{coord.rank}", me))
    keys = [f"peers/node/{r}" for r in range(coord.world_size)]
    coord._poll(lambda: bool(coord._op(lambda s: s.check(keys))), time.monotonic() + coord.timeout, "every rank's node")
    nodes = {r: v.decode() for r, v in enumerate(coord._get_many(keys))}
    targets = peer_targets(nodes, copies)
    limiter = RateLimiter(rate)
    timeout = min(coord.timeout, 300.0)
    link = PeerLink(coord.sub_store("peers/group/"), coord.rank, coord.world_size, timeout, limiter.consume)
    if not any(targets.values()):
        logger.warning(
            "tiercheck: memory_peers=%d but every rank is on one node (%s): no copies are made", copies, me
        )
    return PeerCopies(link, group, memory, targets, keep)
