"""Where each rank's tier-0 copies go (pure): to ranks on other nodes, never its own.

Nodes are told apart by the identity of their shared-memory directory (`tiers.memory`
`node_identity`). Nodes are ordered by identity and the ranks of a node by number; copy c
(1 <= c <= copies) of a rank at position j of node i goes to node (i + c) mod N, to the rank
at position j mod (ranks there). Any one node lost, every rank's copy 1 lives on another
node; with `copies` >= 1 the copies of one rank are on `copies` distinct other nodes while
there are that many (fewer nodes: fewer copies, never one on its own node).

Uneven nodes: a node with more ranks than the next one sends several ranks' copies to the
same receivers (a receiver then holds more than `copies` x `keep_memory` shards); a node with
fewer ranks leaves some receivers of the next node without a copy to hold. `peer_load`
says how many copies each rank receives, for the memory it needs.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["peer_load", "peer_sources", "peer_targets"]


def peer_targets(nodes: Mapping[int, str], copies: int) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks that hold its copies, from rank -> node identity."""
    by_node: dict[str, list[int]] = {}
    for rank in sorted(nodes):
        by_node.setdefault(nodes[rank], []).append(rank)
    order = sorted(by_node)
    targets: dict[int, tuple[int, ...]] = {}
    for i, node in enumerate(order):
        for j, rank in enumerate(by_node[node]):
            chosen = []
            for c in range(1, min(copies, len(order) - 1) + 1):
                peers = by_node[order[(i + c) % len(order)]]
                chosen.append(peers[j % len(peers)])
            targets[rank] = tuple(chosen)
    return targets


def peer_sources(targets: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """rank -> the ranks whose copies it holds (the inverse of `peer_targets`)."""
    sources: dict[int, list[int]] = {rank: [] for rank in targets}
    for rank in sorted(targets):
        for t in targets[rank]:
            sources[t].append(rank)
    return {rank: tuple(s) for rank, s in sources.items()}


def peer_load(targets: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
    """rank -> how many ranks' copies it holds."""
    return {rank: len(s) for rank, s in peer_sources(targets).items()}
