"""Tier 0 across ranks and nodes, with real processes (gloo on CPU). A node is a set of rank
processes with its own shared-memory and tier-1 directories; losing a node is SIGKILL of
its processes (the job dies) plus deleting both directories. Copies of each rank's tier-0
step live on another node (`memory_peers=1`) and come back at restore, verified; without
them the lost ranks fall back to tier 2.

Faults, with a short coordination_timeout (8 s): a rank SIGKILLed mid-send of its tier-0
copy, and a peer lost while the others save (SIGKILLed in its tier-1 write, then its node's
directories deleted). The other ranks never hang: their copies stop with one warning (only
where the dead rank was their peer), every later step fails within the timeout instead of
waiting, and the restarted job restores the newest step every rank has, bit-exact."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.helpers.ranks import run_ranks
from tiercheck.format import naming
from tiercheck.plan.peers import peer_load, peer_sources, peer_targets
from tiercheck.tiers.memory import BUFFERS_DIR as BUFFERS

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "tier0_worker.py")
LAST = 3  # tier0_worker.STEPS - 1


def run_job(
    scenario: str, nodes: list[int], root: Path, env: dict[str, str] | None = None, killed: frozenset[int] = frozenset()
) -> list[dict]:
    """Run one job (a process per rank) to its end; the ranks in `killed` must die by SIGKILL
    (their result is None), the others exit 0 having written their result."""
    node_list = ",".join(map(str, nodes))
    run_ranks(
        WORKER, len(nodes), lambda r, port: [scenario, str(r), str(len(nodes)), str(port), str(root), node_list],
        env=env, killed=killed,
    )
    return [
        None if r in killed else json.loads((root / f"result-{scenario}-{r}.json").read_text())
        for r in range(len(nodes))
    ]


def lose_node(root: Path, node: int) -> None:
    shutil.rmtree(root / f"node{node}")


def test_placement_never_puts_a_copy_on_its_own_node():
    nodes = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}
    targets = peer_targets(nodes, 1)
    assert all(nodes[t] != nodes[r] for r, ts in targets.items() for t in ts)
    assert all(len(ts) == 1 for ts in targets.values())
    two = peer_targets(nodes, 2)
    assert all(len({nodes[t] for t in ts}) == 2 and nodes[r] not in {nodes[t] for t in ts} for r, ts in two.items())
    # uneven: node c has one rank, so it receives from both ranks of node b
    assert peer_load(targets)[4] == 2 and sorted(peer_sources(targets)[4]) == [2, 3]
    assert peer_targets({0: "a", 1: "a"}, 1) == {0: (), 1: ()}  # one node: no copy anywhere


def test_two_ranks_of_one_node_resume_from_memory(tmp_path):
    saved = run_job("save", [0, 0], tmp_path, {"PEERS": "0"})
    assert all(s["memory"] == [LAST] for s in saved)
    got = run_job("restore", [0, 0], tmp_path, {"PEERS": "0"})
    assert [g["step"] for g in got] == [LAST, LAST]
    assert all(g["exact"] for g in got)
    assert [g["tier"] for g in got] == [["memory"], ["memory"]]


def test_a_replaced_node_gets_its_part_back_from_its_peers(tmp_path):
    saved = run_job("save", [0, 0, 1, 1], tmp_path)
    replicas = tmp_path / "node0" / "shm" / "tiercheck-mr" / ".tiercheck-replicas"
    held = sorted(os.listdir(replicas))
    assert held == ["rank-00002", "rank-00003"]
    # 4 copies received per holder into 2 files (keep_memory=1: the newest copy stays while
    # the next arrives, then the older file is received into again): allocated once.
    assert [s["replica_buffers"] for s in saved] == [2, 2, 2, 2]
    spares = [p for h in held for p in (replicas / h / BUFFERS).glob("*.buf")]
    assert len(spares) == 2  # the dead job's spares, one per source it held copies of
    lose_node(tmp_path, 1)
    got = run_job("restore", [0, 0, 1, 1], tmp_path, {"SAVE_AFTER": "1"})
    assert [g["step"] for g in got] == [LAST] * 4
    assert all(g["exact"] for g in got)
    assert [g["tier"] for g in got] == [["memory"]] * 4
    assert all(g["memory"] == [LAST + 1] for g in got)
    # The restarted holders, writers again, removed the spares their killed predecessors
    # left; the one copy since (step LAST + 1) needed a new file, the older went with its step.
    assert [p for h in held for p in (replicas / h / BUFFERS).glob("*.buf")] == []


def test_a_node_lost_with_its_copies_falls_back_to_tier2(tmp_path):
    run_job("save", [0, 0, 1, 1], tmp_path)
    lose_node(tmp_path, 1)
    shutil.rmtree(tmp_path / "node0" / "shm" / "tiercheck-mr" / ".tiercheck-replicas")
    got = run_job("restore", [0, 0, 1, 1], tmp_path)
    assert [g["step"] for g in got] == [LAST] * 4 and all(g["exact"] for g in got)
    assert [g["tier"] for g in got] == [["memory"], ["memory"], ["remote"], ["remote"]]


def test_a_flipped_byte_in_a_copy_is_caught_and_never_returned(tmp_path):
    run_job("save", [0, 0, 1, 1], tmp_path)
    lose_node(tmp_path, 1)
    copy = (
        tmp_path
        / "node0"
        / "shm"
        / "tiercheck-mr"
        / ".tiercheck-replicas"
        / "rank-00002"
        / naming.step_dir_name(LAST)
        / naming.shard_name(2, 4)
    )
    data = bytearray(copy.read_bytes())
    data[777] ^= 0x10
    copy.write_bytes(bytes(data))
    got = run_job("restore", [0, 0, 1, 1], tmp_path)
    assert [g["step"] for g in got] == [LAST] * 4 and all(g["exact"] for g in got)
    assert got[2]["tier"] == ["remote"]  # its fetched copy failed verification: tier 2
    assert got[3]["tier"] == ["memory"]


FAULT = {"COORD": "8", "VICTIM": "2", "KILL_STEP": "2"}
STEP_BOUND_S = 60.0  # a step's save and waits, with a dead rank: 2 x 8 s votes and slack


def run_fault(root: Path, fault: str) -> list[dict]:
    """Steps 0-3 with rank 2 SIGKILLed at step 2 (`fault` says where); the others' records."""
    t0 = time.monotonic()
    res = run_job("fault", [0, 0, 1, 1], root, {**FAULT, "FAULT": fault}, killed=frozenset({2}))
    assert time.monotonic() - t0 < 240
    survivors = [res[r] for r in (0, 1, 3)]
    for r, out in zip((0, 1, 3), survivors, strict=True):
        steps = out["steps"]
        assert sorted(steps) == ["0", "1", "2", "3"], (r, out)
        for k in ("0", "1"):  # before the fault: committed on every tier
            assert [steps[k].get(t) for t in ("memory", "local", "remote")] == ["ok"] * 3, (r, k, steps[k])
        for k, got in steps.items():  # nothing hangs: each step ends within the bound
            assert got.get("done_s", got["save_s"]) < STEP_BOUND_S, (r, k, got)
        assert steps["3"].get("local") != "ok"  # rank 2 is gone: step 3 cannot commit...
        assert "did not report" in str(steps["3"]) or "gave up" in str(steps["3"]) or "raised" in steps["3"]
    # ... and the copies stopped with one warning, only on rank 0: rank 2's peer (rank 1's
    # peer, rank 3, is alive and their copies go on).
    assert [len(out["peer_warnings"]) for out in survivors] == [1, 0, 0], [o["peer_warnings"] for o in survivors]
    return res


def test_a_rank_killed_mid_peer_send_never_hangs_the_others_and_the_job_restores(tmp_path):
    res = run_fault(tmp_path, "send")
    # Rank 2 died after step 2 was on tier 0 and tier 1 everywhere (copies come after tier 1).
    assert all(res[r]["steps"]["2"]["local"] == "ok" for r in (0, 1, 3)), [res[r]["steps"]["2"] for r in (0, 1, 3)]
    got = run_job("restore", [0, 0, 1, 1], tmp_path, {"COORD": "60"})
    assert [g["step"] for g in got] == [2] * 4
    assert all(g["exact"] for g in got)
    assert [g["tier"] for g in got] == [["memory"]] * 4  # no node was lost: every rank from its memory


def test_a_peer_lost_during_a_save_never_hangs_the_others_and_the_replaced_node_restores(tmp_path):
    res = run_fault(tmp_path, "lost")
    # Rank 2 died in its tier-1 write of step 2: step 2 never committed on tier 1.
    assert all(res[r]["steps"]["2"]["local"] != "ok" for r in (0, 1, 3))
    lose_node(tmp_path, 1)  # and its node with it
    got = run_job("restore", [0, 0, 1, 1], tmp_path, {"COORD": "60"})
    # Node 0's memory holds step 2 (keep_memory=1), node 1's copies of it were never made:
    # the newest step every rank has is 1 (node 0 from tier 1, node 1 from tier 2 or copies).
    assert [g["step"] for g in got] == [1] * 4
    assert all(g["exact"] for g in got)


def test_a_retried_save_never_makes_rank_0_wait_past_the_timeout_for_a_dead_rank():
    """A rank whose save(5) raised reported its part as failed, then its retried save(5)
    reported again; rank 2 is dead. Rank 0's vote must give up within coordination_timeout
    (1 s here), not block on rank 2's missing part until the store's own timeout (6 s)."""
    import datetime

    import torch.distributed as dist

    from tiercheck.errors import CoordinationError
    from tiercheck.job.commit import CommitVote, PartReport

    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=6), wait_for_workers=False)
    votes = [CommitVote(store, r, 3, "p/", timeout=1.0) for r in range(3)]
    ok = {"name": "x.shard", "length": 1, "checksum": "0"}
    votes[1].report(5, "local", PartReport(1, None, "save() raised TierError"))  # abandon_save's report
    votes[1].report(5, "local", PartReport(1, ok, None, ""))  # the retried save(5)
    votes[0].report(5, "local", PartReport(0, ok, None, ""))
    t0 = time.monotonic()
    with pytest.raises(CoordinationError):
        votes[0].decide(5, "local", lambda refs: b"marker")
    assert time.monotonic() - t0 < 3.0
