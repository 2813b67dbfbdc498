"""Multi-rank checkpoints with real torch.distributed processes (gloo on CPU).

Every test starts its ranks as separate Python processes (tests/helpers/multirank_worker.py) that
join a real process group; world-size changes mix such jobs with single-process use.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.helpers.multirank_worker import digest, make_state, saved_view, train, zero
from tiercheck.__main__ import main as cli
from tiercheck.format import naming
from tiercheck.state.flatten import flatten_state

REPLICATED = ("state['model']", "state['optimizer']")
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "multirank_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(
    scenario: str, world: int, root: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[list[dict[str, Any] | None], list[int]]:
    """Run `scenario` on `world` ranks; return each rank's result (None if it wrote none)
    and exit codes."""
    port = free_port()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, scenario, str(r), str(world), str(port), str(root)],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{scenario}: ranks still running after {timeout}s") from None
        outputs.append(out.decode(errors="replace"))
    results: list[dict[str, Any] | None] = []
    for r in range(world):
        path = root / f"result-{scenario}-{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
        if path.exists():
            path.unlink()
    codes = [p.returncode for p in procs]
    for r, (code, res) in enumerate(zip(codes, results, strict=True)):
        if res is None and code != -9:
            raise AssertionError(f"rank {r} of {scenario} failed (exit {code}):\n{outputs[r][-4000:]}")
    return results, codes


def committed(root: Path) -> list[int]:
    return sorted(int(p.name[len("step-") :]) for p in root.glob("step-*") if (p / naming.COMMIT_NAME).is_file())


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_round_trip_bit_exact_with_node_local_tier(tmp_path: Path, world: int) -> None:
    results, _ = run_job("roundtrip", world, tmp_path)
    saved = [r["saved"] for r in results if r]
    assert len(set(saved)) == world  # per-rank keys differ, so each rank's state is its own
    for rank, res in enumerate(results):
        assert res is not None
        assert res["restored_step"] == 30
        assert res["restored"] == res["saved"], f"rank {rank} restored other bytes"
        assert res["restored_20"] == 20 and res["digest_20"] == res["saved_20"]
        assert res["local_steps"] == [20, 30]  # keep_local=2 on every node
        assert res["remote_steps"] == [10, 20, 30]
        # Node-local: each node's directory holds only its own rank's files, and a marker.
        node = tmp_path / f"node{rank}" / "step-000000000030"
        assert sorted(p.name for p in node.iterdir()) == [
            naming.COMMIT_NAME,
            naming.manifest_name(rank, world),
            naming.shard_name(rank, world),
        ]
    # Tier 2: one step directory with every rank's part and one marker listing them all.
    marker = json.loads((tmp_path / "remote" / "step-000000000030" / naming.COMMIT_NAME).read_text())
    assert [m["name"] for m in marker["manifests"]] == [naming.manifest_name(r, world) for r in range(world)]
    assert committed(tmp_path / "remote") == [10, 20, 30]


def test_replicated_keys_are_written_once(tmp_path: Path) -> None:
    world = 2
    run_job("roundtrip", world, tmp_path)
    step_dir = tmp_path / "remote" / "step-000000000030"
    owners: dict[str, list[int]] = {"model": [], "optimizer": []}
    for r in range(world):
        m = json.loads((step_dir / naming.manifest_name(r, world)).read_text())
        assert sorted(map(tuple, m["replicated"])) == [("s", "model"), ("s", "optimizer")]
        for k, v in zip(m["tree"]["k"], m["tree"]["v"], strict=True):
            if k[1] in owners and v["t"] != "replica":
                owners[k[1]].append(r)
            elif k[1] in owners:
                assert v == {"t": "replica", "r": v["r"]} and v["r"] != r
    # Tier 2 holds each replicated key once. With node-local tier 1 (one directory per rank
    # here) every directory keeps its own copy and the ranks of rank 0's directory upload.
    assert sorted(len(v) for v in owners.values()) == [1, 1]
    assert {v[0] for v in owners.values()} == {0}
    for r in range(world):
        tier1 = json.loads((tmp_path / f"node{r}" / "step-000000000030" / naming.manifest_name(r, world)).read_text())
        assert [v["t"] for v in tier1["tree"]["v"][:2]] == ["stateful", "stateful"]  # a full copy per node
    # The replicated bytes on tier 2 add up to one copy of model + optimizer, not one per rank.
    state = make_state(0)
    train(state, 1)
    one_copy = sum(lf.nbytes for lf in flatten_state(saved_view(state)).leaves if lf.path.startswith(REPLICATED))
    stored = 0
    for r in range(world):
        m = json.loads((step_dir / naming.manifest_name(r, world)).read_text())
        stored += sum(e["length"] for e in m["entries"] if e["path"].startswith(REPLICATED))
    assert stored == one_copy > 0


def test_shared_tier1_directory_one_marker(tmp_path: Path) -> None:
    results, _ = run_job("roundtrip", 2, tmp_path, env={"MR_LAYOUT": "shared"})
    for res in results:
        assert res is not None and res["restored_step"] == 30 and res["restored"] == res["saved"]
        assert not res["warnings"], res["warnings"]  # everything read from the shared tier 1
    step_dir = tmp_path / "shared" / "step-000000000030"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [naming.COMMIT_NAME] + [f(r, 2) for r in range(2) for f in (naming.manifest_name, naming.shard_name)]
    )
    assert committed(tmp_path / "shared") == [20, 30]
    shared = tmp_path / "shared"
    # no temp left; each rank wrote under its own lock
    assert sorted(p.name for p in shared.iterdir() if p.name.startswith(".") and p.name != naming.RUNLOG_DIR) == [
        naming.lock_name(0),
        naming.lock_name(1),
    ]
    # Each rank keeps its own run log in the directory the ranks share.
    assert sorted(p.name for p in (shared / naming.RUNLOG_DIR).iterdir()) == [
        naming.runlog_file_name(0),
        naming.runlog_file_name(1),
    ]


def test_damaged_tier1_copy_on_one_rank_reads_tier2_and_others_keep_tier1(tmp_path: Path) -> None:
    run_job("roundtrip", 2, tmp_path)
    step_dir = tmp_path / "node1" / "step-000000000030"
    manifest = json.loads((step_dir / naming.manifest_name(1, 2)).read_text())
    (entry,) = [e for e in manifest["entries"] if e["path"] == "state['shard']"]
    shard = step_dir / naming.shard_name(1, 2)
    data = bytearray(shard.read_bytes())
    data[entry["offset"]] ^= 0xFF
    shard.write_bytes(bytes(data))
    # `tiercheck verify` checks every rank's part a directory holds.
    assert cli(["verify", str(tmp_path / "node1"), "--step", "30"]) == 1
    assert cli(["verify", str(tmp_path / "node0")]) == 0
    assert cli(["verify", f"file://{tmp_path}/remote"]) == 0
    results, _ = run_job("restore_only", 2, tmp_path, env={"MR_KEYS": "shard,rng,position"})
    r0, r1 = results
    assert r0 is not None and r1 is not None
    assert r0["restored_step"] == r1["restored_step"] == 30
    assert any("node1" in w and "checksum" in w for w in r1["warnings"]), r1["warnings"]
    assert not r0["warnings"], r0["warnings"]  # rank 0 kept its tier-1 copy


def test_step_missing_for_one_rank_everyone_restores_an_older_step(tmp_path: Path) -> None:
    results, _ = run_job("roundtrip", 2, tmp_path)
    older = results[1]
    assert older is not None
    # Rank 1's part of step 30 is gone from its node and from tier 2: no rank may restore 30.
    for p in (
        tmp_path / "node1" / "step-000000000030" / naming.shard_name(1, 2),
        tmp_path / "remote" / "step-000000000030" / naming.shard_name(1, 2),
    ):
        p.unlink()
    restored, _ = run_job("restore_only", 2, tmp_path, env={"MR_KEYS": "model,optimizer,shard"})
    assert [r["restored_step"] for r in restored if r] == [20, 20]


def test_rank_killed_mid_save_others_fail_within_timeout_and_previous_step_restores(tmp_path: Path) -> None:
    timeout = 4.0
    results, codes = run_job("kill_mid_save", 2, tmp_path, env={"MR_TIMEOUT": str(timeout)})
    assert codes[1] == -9 and results[1] is None
    r0 = results[0]
    assert r0 is not None
    assert r0["step20"].startswith("TierError") and "step 20" in r0["step20"], r0["step20"]
    assert r0["waited_s"] < 3 * timeout + 5, r0["waited_s"]  # bounded, not a hang
    assert r0["local_steps"] == [10] and r0["remote_steps"] == [10]
    for d in (tmp_path / "node0", tmp_path / "node1", tmp_path / "remote"):
        assert committed(d) == [10]
    restored, _ = run_job("restore_after_kill", 2, tmp_path)
    for res in restored:
        assert res is not None and res["restored_step"] == 10
    # Rank 0's restored state is what it saved at step 10 (rank 1's result died with it).
    assert restored[0] is not None and restored[0]["digest"] == r0["saved_10"]
    # Once the job commits again, nothing of the failed step 20 is left on any tier.
    for d in (tmp_path / "node0", tmp_path / "node1", tmp_path / "remote"):
        assert committed(d) == [10, 30]
        # (files, as an object store sees them; file:// may keep an empty directory), the
        # writer lock of the rank writing there (rank r writes node<r>); the run log is on
        # tier 1 only
        locks = {naming.lock_name(int(d.name[4:]))} if d.name.startswith("node") else set()
        assert {p.relative_to(d).parts[0] for p in d.rglob("*") if p.is_file()} - {naming.RUNLOG_DIR} == {
            "step-000000000010",
            "step-000000000030",
        } | locks, d


def test_world_size_change_replicated_state(tmp_path: Path) -> None:
    # 2 -> 1: a single process (no process group) restores the replicated keys.
    run_job("roundtrip", 2, tmp_path)
    state = make_state(0, seed=9)
    zero(state)
    template = {"model": state["model"], "optimizer": state["optimizer"]}
    with tiercheck.Checkpointer(local=tmp_path / "node0", remote=f"file://{tmp_path}/remote") as ck:
        assert ck.restore(template) == 30
        with pytest.raises(tiercheck.StateMismatchError, match=r"2 ranks.*'shard'"):
            ck.restore({"model": state["model"], "shard": state["shard"]})
    view0 = tiercheck.load(f"file://{tmp_path}/remote", rank=0)
    view1 = tiercheck.load(f"file://{tmp_path}/remote", rank=1)
    assert digest(view0["model"]) == digest(view1["model"]) == digest(state["model"].state_dict())
    assert not torch.equal(view0["shard"], view1["shard"])  # per-rank keys are each rank's own
    with pytest.raises(tiercheck.NoCheckpointError, match="no rank 2"):
        tiercheck.load(f"file://{tmp_path}/remote", rank=2)

    # 1 -> 2: a single process saves; two ranks restore the replicated keys from it.
    single = tmp_path / "single"
    state = make_state(0, seed=3)
    train(state, 2)
    with tiercheck.Checkpointer(remote=f"file://{single}/remote", replicated=("model", "optimizer")) as ck:
        ck.save(7, saved_view(state))
    want = digest({"model": state["model"], "optimizer": state["optimizer"]})
    results, _ = run_job("restore_only", 2, single, env={"MR_KEYS": "model,optimizer"})
    for res in results:
        assert res is not None and res["restored_step"] == 7 and res["digest"] == want
    # A per-rank key that every saved rank holds alike (here the only one) follows the
    # world-size change (issue 27): both new ranks get the saved value.
    results, _ = run_job("restore_only", 2, single, env={"MR_KEYS": "model,position"})
    want = digest({"model": state["model"], "position": state["position"]})
    for res in results:
        assert res is not None and "error" not in res and res["restored_step"] == 7, res
        assert res["digest"] == want


def test_save_failing_on_one_rank_fails_the_step_everywhere_at_once(tmp_path: Path) -> None:
    results, _ = run_job("one_rank_fails", 2, tmp_path, env={"MR_FAIL": "state"})
    r0, r1 = results
    assert r0 is not None and r1 is not None
    assert r1["save20"].startswith("UnsupportedStateError") and "state['bad']" in r1["save20"]
    # Rank 0 hears about it from the store right away, far below the 60 s timeout.
    assert r0["local20"].startswith("TierError") and "rank 1" in r0["local20"], r0["local20"]
    assert r0["waited_s"] < 20, r0["waited_s"]
    for res in results:
        assert res["local_steps"] == [10, 30]  # keep_local=2; step 20 never committed
        assert 20 not in res["remote_steps"] and res["remote_steps"][-1] == 30
        assert res["restored_step"] == 30 and res["restored"] == res["saved_30"]


def test_disk_full_on_one_rank_tier1_step_still_reaches_tier2(tmp_path: Path) -> None:
    results, _ = run_job("one_rank_fails", 2, tmp_path, env={"MR_FAIL": "disk"})
    r0, r1 = results
    assert r0 is not None and r1 is not None
    assert "No space left" in r1["local20"] and "step 20" in r1["local20"]
    assert r0["local20"].startswith("TierError") and "rank 1" in r0["local20"]
    # Tier 1 failed for the job, but every rank still had the snapshot in host memory.
    assert r0["remote20"] == r1["remote20"] == "ok"
    assert r0["waited_s"] < 20
    for res in results:
        assert 20 not in res["local_steps"] and 20 in res["remote_steps"]
        assert res["restored_step"] == 30 and res["restored"] == res["saved_30"]


def test_fsdp2_sharded_state_round_trip_and_resharded_to_one_process(tmp_path: Path) -> None:
    results, _ = run_job("fsdp", 2, tmp_path)
    r0, r1 = results
    assert r0 is not None and r1 is not None
    for res in results:
        assert res["restored_step"] == 5 and res["restored"] == res["saved"]
    assert r0["saved"] != r1["saved"]  # each rank holds a different slice
    # Without a process group: whole tensors, assembled from both ranks' pieces (the same
    # whichever rank's view), each piece of the shape its rank held.
    view = tiercheck.load(f"file://{tmp_path}/remote", rank=1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    assert {k: tuple(t.shape) for k, t in view["model"].items()} == {
        k: tuple(t.shape) for k, t in model.state_dict().items()
    }
    assert [tuple(s) for s in r1["shapes"]] != [tuple(t.shape) for t in view["model"].values()]
    # A job of another size restores the sharded model as plain tensors (issue 27).
    ck = tiercheck.Checkpointer(remote=f"file://{tmp_path}/remote")
    with ck:
        assert ck.restore({"model": model}) == 5
    for k, t in model.state_dict().items():
        assert torch.equal(t, view["model"][k]), k


def test_node_local_tier1_without_tier2_keeps_a_replicated_copy_per_node(tmp_path: Path) -> None:
    # No shared tier: a replicated key written by one rank only could never be read back on
    # the other node, so each directory's leader writes it.
    results, _ = run_job("roundtrip", 2, tmp_path, env={"MR_NO_REMOTE": "1"})
    for rank, res in enumerate(results):
        assert res is not None and res["restored_step"] == 30 and res["restored"] == res["saved"]
        assert not res["warnings"], res["warnings"]
        m = json.loads((tmp_path / f"node{rank}" / "step-000000000030" / naming.manifest_name(rank, 2)).read_text())
        assert [v["t"] for v in m["tree"]["v"][:2]] == ["stateful", "stateful"]  # model, optimizer held here
    # A job of another size on the second node restores the replicated keys from its own disk.
    state = make_state(0, seed=4)
    zero(state)
    with tiercheck.Checkpointer(local=tmp_path / "node1") as ck:
        assert ck.restore({"model": state["model"]}) == 30
    assert digest(state["model"]) != digest(make_state(0, seed=4)["model"])


def test_newest_step_only_on_node_local_tier1_restores_from_tier1(tmp_path: Path) -> None:
    # Tier 2 has not got step 30 yet (an upload still running when the job died): every node
    # holds its own full copy on tier 1, so no rank needs tier 2 for it.
    run_job("roundtrip", 2, tmp_path)
    shutil.rmtree(tmp_path / "remote" / "step-000000000030")
    keys = {"MR_KEYS": "model,optimizer,shard,rng,position"}
    restored, _ = run_job("restore_only", 2, tmp_path, env=keys)
    for res in restored:
        assert res is not None and res["restored_step"] == 30 and not res["warnings"], res
    assert committed(tmp_path / "remote") == [10, 20]  # a job that only restores changes no tier
    # A job that becomes the writer (prepare, or its first save) agrees to upload step 30,
    # which the earlier run never did: tier 2 has it again, with one copy of the replicated
    # keys (rank 0's), verified.
    restored, _ = run_job("restore_only", 2, tmp_path, env={**keys, "MR_PREPARE": "1"})
    for res in restored:
        assert res is not None and res["restored_step"] == 30 and not res["warnings"], res
    assert committed(tmp_path / "remote") == [10, 20, 30]
    step_dir = tmp_path / "remote" / "step-000000000030"
    trees = [json.loads((step_dir / naming.manifest_name(r, 2)).read_text())["tree"] for r in range(2)]
    assert [v["t"] for v in trees[0]["v"][:2]] == ["stateful", "stateful"]
    assert trees[1]["v"][:2] == [{"t": "replica", "r": 0}, {"t": "replica", "r": 0}]
    assert cli(["verify", f"file://{tmp_path}/remote", "--step", "30"]) == 0


@pytest.mark.parametrize("env", [{}, {"PER_RANK": "1", "REMOTE": "1"}], ids=["shared-dir", "node-local+tier2"])
def test_ddp_example_under_torchrun_resumes_with_identical_losses(env: dict[str, str]) -> None:
    # The Checkpointer picks rank and world size up from torchrun's process group unchanged;
    # the demo SIGKILLs rank 1 mid-save, restarts, and compares every loss with a clean run.
    demo = Path(__file__).resolve().parents[2] / "examples" / "run_ddp_demo.sh"
    proc = subprocess.run(["bash", str(demo)], env={**os.environ, **env}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS" in proc.stdout


def test_two_nodes_of_two_ranks_each_node_holds_a_copy_and_tier2_one(tmp_path: Path) -> None:
    # The real multi-node shape: ranks 0-1 share node0's disk, ranks 2-3 node1's.
    world = 4
    results, _ = run_job("roundtrip", world, tmp_path, env={"MR_LAYOUT": "pairs"})
    for res in results:
        assert res is not None and res["restored_step"] == 30 and res["restored"] == res["saved"]
        assert not res["warnings"], res["warnings"]  # every node restored from its own disk

    def owners(step_dir: Path, ranks: range) -> dict[str, list[int]]:
        held: dict[str, list[int]] = {"model": [], "optimizer": []}
        for r in ranks:
            m = json.loads((step_dir / naming.manifest_name(r, world)).read_text())
            for k, v in zip(m["tree"]["k"], m["tree"]["v"], strict=True):
                if k[1] in held and v["t"] != "replica":
                    held[k[1]].append(r)
        return held

    # Each node's directory: one copy, spread over its two ranks; one marker.
    for node, ranks in (("node0", range(0, 2)), ("node1", range(2, 4))):
        held = owners(tmp_path / node / "step-000000000030", ranks)
        assert sorted(r for v in held.values() for r in v) == list(ranks), (node, held)
    # Tier 2: one copy, uploaded by the ranks of rank 0's node; the others' parts retargeted.
    held = owners(tmp_path / "remote" / "step-000000000030", range(world))
    assert sorted(r for v in held.values() for r in v) == [0, 1], held


@pytest.mark.parametrize("layout", ["shared", "nodelocal"])
def test_rollback_then_save_deletes_the_abandoned_steps_once_on_every_tier(tmp_path: Path, layout: str) -> None:
    results, _ = run_job("rollback", 2, tmp_path, env={"MR_LAYOUT": layout})
    for res in results:
        assert res is not None and res["restored_step"] == 10
        assert [w for w in res["warnings"] if "new branch" in w], res["warnings"]
        assert res["local_steps"] == [10, 20] and res["remote_steps"] == [10, 20]
        assert res["latest"] == 20 and res["restored"] == res["saved"]  # the new branch's 20
    dirs = [tmp_path / "shared"] if layout == "shared" else [tmp_path / "node0", tmp_path / "node1"]
    for d in [*dirs, tmp_path / "remote"]:
        assert committed(d) == [10, 20]
        assert not (d / "step-000000000030").exists()  # nothing of it left, marker or data
