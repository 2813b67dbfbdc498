"""The store protocol of tiercheck.job.coordination, with in-process ranks on a real TCPStore,
and the multi-rank options' validation."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tiercheck
from tiercheck.errors import CoordinationError
from tiercheck.job.coordination import Coordinator, PartReport
from tiercheck.job.store import ranges as _ranges


@pytest.fixture
def store() -> Any:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


def coordinators(store: Any, world: int, timeout: float = 5.0) -> list[Coordinator]:
    return [Coordinator(store, r, world, "t/", timeout) for r in range(world)]


def ref(rank: int, world: int) -> dict[str, Any]:
    return {"name": tiercheck.format.naming.manifest_name(rank, world), "length": 10 + rank, "checksum": "ab"}


def run_ranks(fns: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def commit_fn(c: Coordinator, step: int, assignment: str = "") -> Any:
    def go() -> bytes:
        c.report(step, "remote", PartReport(c.rank, ref(c.rank, c.world_size), None, assignment))
        try:
            if c.rank == 0:
                marker = c.decide(step, "remote", lambda refs: repr(refs).encode())
            else:
                marker = c.verdict(step, "remote", want_marker=True)
            c.forget_part(step, "remote")  # as the pipeline does once the verdict is out
            return marker
        finally:
            c.acknowledge(step, "remote")

    return go


def test_every_rank_gets_rank_0s_marker_and_the_store_does_not_grow(store: Any) -> None:
    cs = coordinators(store, 3)
    baseline = store.num_keys()
    for step in range(5):
        results = run_ranks([commit_fn(c, step) for c in cs])
        assert len(set(results)) == 1 and isinstance(results[0], bytes)
        assert b"rank-00002-of-00003.manifest.json" in results[0]
    assert store.num_keys() == baseline  # the last rank to acknowledge deleted the step's keys


def test_a_silent_rank_fails_the_step_after_the_timeout_naming_it(store: Any) -> None:
    cs = coordinators(store, 3, timeout=0.5)
    t0 = time.monotonic()
    results = run_ranks([commit_fn(cs[0], 1), commit_fn(cs[1], 1)])  # rank 2 never reports
    assert time.monotonic() - t0 < 5
    for r in results:
        assert isinstance(r, CoordinationError) and "rank 2 did not report" in str(r)


def test_a_failed_part_fails_the_step_at_once_for_everyone(store: Any) -> None:
    cs = coordinators(store, 3, timeout=30)

    def failing() -> None:
        cs[2].abandon(4, "remote", "disk full at /x")

    t0 = time.monotonic()
    results = run_ranks([commit_fn(cs[0], 4), commit_fn(cs[1], 4), failing])
    assert time.monotonic() - t0 < 5  # not the 30 s timeout
    for r in results[:2]:
        assert isinstance(r, CoordinationError) and "rank 2 failed its part: disk full at /x" in str(r)
        assert r.settled  # rank 0 decided: the step will never commit


def test_ranks_that_disagree_on_replicated_owners_do_not_commit(store: Any) -> None:
    cs = coordinators(store, 2)
    results = run_ranks([commit_fn(cs[0], 2, "a"), commit_fn(cs[1], 2, "b")])
    for r in results:
        assert isinstance(r, CoordinationError) and "disagree" in str(r)


def test_rank_0_dead_others_give_up_within_twice_the_timeout(store: Any) -> None:
    cs = coordinators(store, 2, timeout=0.3)
    t0 = time.monotonic()
    (result,) = run_ranks([commit_fn(cs[1], 3)])
    assert isinstance(result, CoordinationError) and "verdict" in str(result)
    assert not result.settled  # rank 0 might still commit: the rank's part must stay
    assert time.monotonic() - t0 < 3


def test_restore_agreement_picks_the_newest_step_every_rank_can_read(store: Any) -> None:
    cs = coordinators(store, 3)
    baseline = store.num_keys()
    have = [[10, 20, 30], [10, 20], [10, 20, 30]]
    shared = [5, 10]
    results = run_ranks(
        [lambda c=c, h=h: c.agree_candidates(h, lambda: shared, None) for c, h in zip(cs, have, strict=True)]
    )
    assert results == [[20, 10, 5]] * 3  # 30 is missing on rank 1's node and not on tier 2
    # Outcome of a round: one rank failing sends everyone to the next candidate.
    outcomes = run_ranks([lambda c=c: c.agree_outcome(0, c.rank != 1, "checksum mismatch") for c in cs])
    assert outcomes == [(False, "rank 1: checksum mismatch", False)] * 3
    outcomes = run_ranks([lambda c=c: c.agree_outcome(1, True) for c in cs])
    assert outcomes == [(True, "", False)] * 3
    run_ranks([lambda c=c: c.finish_restore(2) for c in cs])
    assert store.num_keys() == baseline  # the restore's keys are gone
    results = run_ranks(
        [lambda c=c, h=h: c.agree_candidates(h, lambda: shared, 30) for c, h in zip(cs, have, strict=True)]
    )
    assert results == [[]] * 3
    run_ranks([lambda c=c: c.finish_restore(0) for c in cs])
    assert store.num_keys() == baseline


def test_restore_reasons_stay_few_when_every_rank_fails(store: Any) -> None:
    cs = coordinators(store, 6)
    run_ranks([lambda c=c: c.agree_candidates([1], list, None) for c in cs])
    outcomes = run_ranks([lambda c=c: c.agree_outcome(0, False, f"bad {c.rank}", fatal=c.rank == 5) for c in cs])
    for ok, why, stop in outcomes:
        assert not ok and stop  # one rank gave up: everyone stops
        assert why.count("rank ") == 3 and why.endswith("(and 3 more ranks)")


def test_ranges() -> None:
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert _ranges([]) == "none"


# -- options ---------------------------------------------------------------------------


def test_world_size_without_a_process_group_or_store_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="init_process_group"):
        tiercheck.Checkpointer(local=tmp_path, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        tiercheck.Checkpointer(local=tmp_path, rank=2, world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replicated": "model"}, "replicated"),
        ({"replicated": [1.5]}, "replicated"),
        ({"replicated_writer": 3}, "replicated_writer"),
        ({"replicated_writer": "spread"}, "replicated_writer"),
        ({"coordination_timeout": 0}, "coordination_timeout"),
    ],
)
def test_bad_multi_rank_options(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiercheck.Checkpointer(local=tmp_path, **kwargs)


def test_replicated_key_missing_from_the_state_is_named_and_nothing_changes(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(local=tmp_path, replicated=("model", "optimizer")) as ck:
        ck.save(1, {"model": {"w": torch.ones(2)}, "optimizer": {"lr": 0.1}}).wait()
        with pytest.raises(tiercheck.UnsupportedStateError, match="'optimizer'"):
            ck.save(2, {"model": {"w": torch.zeros(2)}})
        assert ck.steps() == [1]
    assert tiercheck.load(tmp_path)["model"]["w"].tolist() == [1.0, 1.0]


def test_single_process_replicated_keys_round_trip(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    with tiercheck.Checkpointer(local=tmp_path, replicated=True) as ck:
        ck.save(5, {"model": model, "epoch": 2}).wait()
        fresh = torch.nn.Linear(3, 2)
        template = {"model": fresh, "epoch": 0}
        assert ck.restore(template) == 5
    assert torch.equal(fresh.weight, model.weight) and template["epoch"] == 2
