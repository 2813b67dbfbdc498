"""Committing a step: one rank writes its marker; in a job, the ranks vote through the store.

The vote, per step and tier (keys under ``tiercheck/<instance>/g<generation>/s<step>/<tier>/``):

1. every rank makes its part durable (shard files and manifest, no marker), then
   ``set part/<rank>`` (its manifest's name, length and checksum, or the error that
   stopped it) and ``add n 1``; a rank that fails before that reports the failure at
   once, so nobody waits for it;
2. rank 0 polls ``n`` until every rank reported (or the timeout), then ``set marker``
   (the commit marker listing every rank's manifest) and ``set verdict`` (``ok``, or the
   reason the step fails: a failed or silent rank, ranks disagreeing on the replicated
   keys); each rank then deletes its own report;
3. one *leader* per distinct directory fetches the marker and writes it (rank 0 on a
   shared tier; on a node-local tier, one rank per directory) and ``set marked/<leader>``;
   the other ranks wait for their leader's key, so every handle reports the step durable
   only once the marker covering its part exists;
4. each rank ``add ack 1``; the rank that completes the count deletes the step's shared
   keys, so the store does not grow from step to step.

Rank 0 waits up to the timeout for the reports, the others twice that for the verdict.
`commit_step` is the writer's side: alone it writes the marker, in a job it runs the vote.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CoordinationError
from ..format import naming
from ..format.manifest import ManifestRef, Marker, encode_marker
from ..observe.events import logger
from ..tiers.base import StepWriter, Tier
from .store import StoreClient, ranges

if TYPE_CHECKING:
    from .coordination import Group, Membership

__all__ = ["CommitVote", "PartReport", "commit_step", "job_marker", "part_may_commit", "vote_commit"]


@dataclass(frozen=True, slots=True)
class PartReport:
    """What one rank reports about its part of a step on one tier."""

    rank: int
    manifest: dict[str, Any] | None  # {"name", "length", "checksum"} when the part is durable
    error: str | None = None
    assignment: str = ""  # digest of who writes which replicated key: must agree everywhere



class CommitVote(StoreClient):
    """One rank's end of the vote above (a mixin of `coordination.Coordinator`)."""

    def _base(self, step: int, tier: str) -> str:
        return f"g{self.generation}/s{step}/{tier}/"

    def report(self, step: int, tier: str, part: PartReport) -> None:
        """Tell the others how this rank's part of `step` went (once per step and tier)."""
        base = self._base(step, tier)
        doc = {"manifest": part.manifest, "error": part.error, "assignment": part.assignment}
        self._op(lambda s: s.set(f"{base}part/{self.rank}", json.dumps(doc)))
        self._op(lambda s: s.add(f"{base}n", 1))

    def decide(self, step: int, tier: str, build_marker: Callable[[list[dict[str, Any]]], bytes]) -> bytes:
        """Rank 0: wait for every rank's report, then publish the marker (for the leaders)
        and the verdict (for everyone); return the marker or raise CoordinationError."""
        assert self.rank == 0
        base = self._base(step, tier)
        deadline = time.monotonic() + self.timeout
        try:
            what = f"every rank's part of step {step}"
            keys = [f"{base}part/{r}" for r in range(self.world_size)]
            # The count alone is not enough: a rank whose save() raised and was retried reports
            # twice, so the count can reach the world size while a dead rank never reported.
            self._poll(
                lambda: self._count(f"{base}n") >= self.world_size and bool(self._op(lambda s: s.check(keys))),
                deadline,
                what,
            )
        except CoordinationError:
            missing = [r for r in range(self.world_size) if not self._has(f"{base}part/{r}")]
            who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {ranges(missing)}"
            return self._fail(base, f"{who} did not report their part within {self.timeout:.0f}s")
        docs = [json.loads(v) for v in self._get_many([f"{base}part/{r}" for r in range(self.world_size)])]
        failed = [(r, d["error"]) for r, d in enumerate(docs) if d["manifest"] is None]
        if failed:
            r, why = failed[0]
            more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
            return self._fail(base, f"rank {r} failed its part: {why}{more}")
        if len({d["assignment"] for d in docs}) != 1:
            return self._fail(base, "ranks disagree on who writes the replicated keys (their states differ)")
        try:
            marker = build_marker([d["manifest"] for d in docs])
        except Exception as exc:
            return self._fail(base, f"cannot build the commit marker: {exc!r}")
        # The marker (~100 bytes per rank) goes to a key of its own: only the leaders read it;
        # every other rank reads the two-byte verdict.
        self._op(lambda s: s.set(f"{base}marker", marker))
        self._op(lambda s: s.set(f"{base}verdict", b"ok"))
        return marker

    def _fail(self, base: str, reason: str) -> bytes:
        self._op(lambda s: s.set(f"{base}verdict", b"fail\n" + reason.encode()))
        raise CoordinationError(reason, settled=True)

    def abandon(self, step: int, tier: str, reason: str) -> None:
        """This rank's part failed: report it and, on rank 0, fail the step at once, so no
        rank waits for the timeout."""
        self.report(step, tier, PartReport(self.rank, None, reason))
        if self.rank == 0:
            base = self._base(step, tier)
            self._op(lambda s: s.set(f"{base}verdict", b"fail\n" + f"rank 0 failed its part: {reason}".encode()))
        self.acknowledge(step, tier)

    def verdict(self, step: int, tier: str, want_marker: bool) -> bytes:
        """Wait for rank 0's verdict; return the marker bytes if `want_marker` (a leader).

        Raises:
            CoordinationError: the step failed (`settled`: rank 0 said so, remove your part),
                or no verdict came within twice the timeout (not settled: rank 0 may still
                commit the step, so a part already in place must stay).
        """
        base = self._base(step, tier)
        deadline = time.monotonic() + 2 * self.timeout  # rank 0 itself waits up to `timeout`
        self._poll(lambda: self._has(f"{base}verdict"), deadline, f"rank 0's verdict on step {step}")
        kind, _, why = self._get(f"{base}verdict").partition(b"\n")
        if kind != b"ok":
            raise CoordinationError(why.decode(errors="replace"), settled=True)
        return self._get(f"{base}marker") if want_marker else b""

    def marked(self, step: int, tier: str, error: str | None = None) -> None:
        """Leader: the marker is written in this rank's directory (or could not be)."""
        base = self._base(step, tier)
        value = b"ok" if error is None else b"fail\n" + error.encode()
        self._op(lambda s: s.set(f"{base}marked/{self.rank}", value))

    def wait_marked(self, step: int, tier: str, leader: int) -> None:
        """Wait until `leader` wrote the marker into the directory this rank shares with it."""
        base = self._base(step, tier)
        deadline = time.monotonic() + self.timeout
        self._poll(lambda: self._has(f"{base}marked/{leader}"), deadline, f"rank {leader} to write the marker")
        kind, _, why = self._get(f"{base}marked/{leader}").partition(b"\n")
        if kind != b"ok":
            raise CoordinationError(f"rank {leader} could not write the commit marker: {why.decode(errors='replace')}")

    def acknowledge(self, step: int, tier: str, leaders: Sequence[int] = ()) -> None:
        """Done with `step` on `tier`; the last rank to say so deletes the step's keys: the few
        shared ones, plus every rank's report only if the step failed (a committed step's
        reports were deleted by their ranks as soon as the verdict was out)."""
        base = self._base(step, tier)
        if self._op(lambda s: s.add(f"{base}ack", 1)) < self.world_size:
            return
        keys = [f"{base}marked/{r}" for r in leaders] + [f"{base}{k}" for k in ("n", "marker", "verdict", "ack")]
        if not self._has(f"{base}verdict") or self._get(f"{base}verdict") != b"ok":
            keys += [f"{base}part/{r}" for r in range(self.world_size)]
        self._delete(keys)

    def forget_part(self, step: int, tier: str) -> None:
        """After an "ok" verdict: rank 0 has read this rank's report; delete it."""
        self._delete([f"{self._base(step, tier)}part/{self.rank}"])


def commit_step(
    group: Membership,
    tier: Tier,
    writer: StepWriter,
    step: int,
    ref: ManifestRef,
    marker: Marker,
    assignment: str,
    reported: Callable[[], object] = lambda: None,
) -> None:
    """Make the step visible: alone, write the marker; in a job, publish this rank's part
    and wait until rank 0 has heard from every rank and the marker is written. `reported`
    runs once this rank's part is published (its outcome is then the vote's to tell)."""
    group.commit(tier, writer, step, ref, marker, assignment, reported)


def vote_commit(
    group: Group,
    tier: Tier,
    writer: StepWriter,
    step: int,
    ref: ManifestRef,
    marker: Marker,
    assignment: str,
    reported: Callable[[], object],
) -> None:
    """`commit_step` in a job: the vote of this module's docstring, for this rank's part."""
    coord = group.coord
    writer.publish_part()
    reported()
    try:
        coord.report(
            step,
            tier.name,
            PartReport(
                coord.rank, {"name": ref.file, "length": ref.length, "checksum": ref.checksum}, None, assignment
            ),
        )
        if coord.rank == 0:
            body = coord.decide(step, tier.name, lambda refs: job_marker(marker, refs))
        else:
            body = coord.verdict(step, tier.name, want_marker=group.leads(tier.name))
        # The verdict is "ok": from here on, this part is in a committed step.
        coord.forget_part(step, tier.name)
        if group.leads(tier.name):
            try:
                tier.write_marker(step, body)
            except Exception as exc:
                coord.marked(step, tier.name, f"{type(exc).__name__}: {exc}")
                raise
            coord.marked(step, tier.name)
        else:
            coord.wait_marked(step, tier.name, group.leader[tier.name])
    except CoordinationError:
        raise
    except Exception as exc:
        # A store or marker error once the part is published: whether the step commits
        # is not settled here (rank 0, or another directory's leader, may commit it), so
        # the part stays; if no marker ever lists it, retention removes it.
        raise CoordinationError(f"step {step} on tier {tier.name!r}: {type(exc).__name__}: {exc}") from exc
    finally:
        try:
            coord.acknowledge(step, tier.name, group.leaders[tier.name])
        except Exception as exc:  # the store is gone: the outcome above stands
            logger.warning("tiercheck: could not acknowledge step %d on tier %s: %r", step, tier.name, exc)


def part_may_commit(exc: BaseException) -> bool:
    """A rank gave up waiting for the others, but rank 0 may still commit the step with this
    rank's part in it: the part must stay (if the step never commits, retention removes it)."""
    return isinstance(exc, CoordinationError) and not exc.settled


def job_marker(marker: Marker, refs: list[dict[str, object]]) -> bytes:
    """The commit marker of a multi-rank step, from every rank's manifest reference."""
    manifests = []
    for rank, ref in enumerate(refs):
        name, length, checksum = ref["name"], ref["length"], ref["checksum"]
        if (
            name != naming.manifest_name(rank, marker.world_size)
            or type(length) is not int
            or type(checksum) is not str
        ):
            raise ValueError(f"rank {rank} reported a malformed manifest reference {ref!r}")
        manifests.append(ManifestRef(name, length, checksum))
    return encode_marker(dataclasses.replace(marker, manifests=tuple(manifests)))
