"""Restore of DTensor state at another world size, mesh or placements, with real processes
(gloo on CPU, `distribute_tensor`): every `full_tensor()` bit-identical to the saved one;
per-rank values that every saved rank holds alike restore anywhere, those that differ are an
error naming them (or left as they are with strict=False); a damaged block of a piece
another rank reads is detected and another tier used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.plan.reshard import Piece, intersect, plan_box

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "reshard_worker.py")
sys.path.insert(0, str(REPO))
from tests.helpers.ranks import free_port, run_ranks  # noqa: E402, F401
from tests.helpers.reshard_worker import bits, global_tensors  # noqa: E402


def run(mode: str, world: int, root: Path, spec: dict) -> list[dict]:
    run_ranks(WORKER, world, lambda r, port: [mode, str(r), str(world), str(port), str(root), json.dumps(spec)])
    return [json.loads((root / f"result-{mode}-{r}.json").read_text()) for r in range(world)]


SAVE_4 = {"mesh": [4], "placements": {"w": ["S0"], "v": ["S1"], "b": ["R"], "big": ["S0"]}}
SAVE_2x2 = {"mesh": [2, 2], "placements": {"w": ["S0", "S1"], "v": ["S1", "R"], "b": ["R", "R"], "big": ["S0", "S1"]}}


def restored_ok(got: list[dict]) -> bool:
    return all("error" not in g and g["step"] == 3 and g["plain_step"] == 7 and all(g["exact"].values()) for g in got)


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved4")
    assert all(r["ok"] for r in run("save", 4, root, SAVE_4))
    return root


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    for f in dst.glob("result-*.json"):
        f.unlink()
    return dst


@pytest.mark.parametrize(
    ("world", "mesh", "places"),
    [
        (1, [1], {"w": ["S0"], "v": ["R"], "b": ["R"], "big": ["S1"]}),
        (2, [2], {"w": ["S1"], "v": ["S0"], "b": ["S0"], "big": ["S1"]}),
        (3, [3], {"w": ["S0"], "v": ["S1"], "b": ["R"], "big": ["S0"]}),  # 10 rows over 3: uneven
        (4, [4], {"w": ["S1"], "v": ["R"], "b": ["S0"], "big": ["S1"]}),  # same size, other placements
    ],
    ids=["to-1", "to-2", "to-3-uneven", "to-4-other"],
)
def test_save_at_4_restore_at_other_layouts(saved_at_4, tmp_path, world, mesh, places):
    root = copy_of(saved_at_4, tmp_path / "c")
    got = run("restore", world, root, {"mesh": mesh, "placements": places})
    assert restored_ok(got), got


def test_2_to_4(tmp_path):
    spec = {"mesh": [2], "placements": {"w": ["S0"], "v": ["S0"], "b": ["R"], "big": ["S0"]}}
    assert all(r["ok"] for r in run("save", 2, tmp_path, spec))
    got = run("restore", 4, tmp_path, {"mesh": [4], "placements": {"w": ["S0"], "v": ["S1"], "b": ["R"], "big": ["S1"]}})
    assert restored_ok(got), got


@pytest.mark.parametrize("mesh", [[1, 4], [4, 1]])
def test_2x2_mesh_to_1x4_and_4x1(tmp_path, mesh):
    assert all(r["ok"] for r in run("save", 4, tmp_path, SAVE_2x2))
    places = {"w": ["S1", "S0"], "v": ["R", "S0"], "b": ["R", "S0"], "big": ["S0", "S1"]}
    got = run("restore", 4, tmp_path, {"mesh": mesh, "placements": places})
    assert restored_ok(got), got


def test_a_plain_template_gets_the_whole_tensor_and_load_too(saved_at_4, tmp_path):
    root = copy_of(saved_at_4, tmp_path / "c")
    got = run("restore", 1, root, {"mesh": [1], "placements": {"w": [], "v": [], "b": [], "big": []}})
    assert restored_ok(got), got
    loaded = tiercheck.load(str(root / "ckpt"))
    for k, v in global_tensors().items():
        assert torch.equal(bits(loaded["model"][k]), bits(v)), k
    assert loaded["step"] == 7


def test_per_rank_values_that_differ_are_named_or_left(tmp_path):
    spec = {**SAVE_4, "seed": True}
    assert all(r["ok"] for r in run("save", 4, tmp_path, spec))
    got = run("restore", 2, tmp_path, {"mesh": [2], "placements": SAVE_4["placements"], "seed": True})
    assert all("StateMismatchError" in g["error"] and "state['seed']" in g["error"] for g in got), got
    lenient = run("restore", 2, tmp_path, {"mesh": [2], "placements": SAVE_4["placements"], "seed": True, "lenient": True})
    assert restored_ok(lenient) and all(g["seed"] == -1 for g in lenient), lenient


def test_a_damaged_block_another_rank_reads_falls_back_to_tier2(saved_at_4, tmp_path):
    root = copy_of(saved_at_4, tmp_path / "c")
    shard = root / "ckpt" / naming.step_dir_name(3) / naming.shard_name(3, 4)
    data = bytearray(shard.read_bytes())
    manifest = json.loads((root / "ckpt" / naming.step_dir_name(3) / naming.manifest_name(3, 4)).read_text())
    big = next(e for e in manifest["entries"] if e["path"].endswith("['big']"))
    data[big["offset"] + 5] ^= 0x40  # rank 3's piece of `big`: read by the new rank 1 at 2 ranks
    shard.write_bytes(bytes(data))
    with pytest.raises(tiercheck.CheckpointCorruptedError, match="block"), pytest.warns(RuntimeWarning):
        tiercheck.load(str(root / "ckpt"))  # a reader without the other tier finds the damage
    got = run("restore", 2, root, {"mesh": [2], "placements": SAVE_4["placements"]})
    assert restored_ok(got), got


def test_plan_reads_only_the_rows_it_needs():
    pieces = [Piece(r, (r * 250, 0), (250, 1000), 4, 1 << 20) for r in range(4)]
    reads = plan_box(((0, 0), (500, 1000)), pieces)
    assert [rd.piece.holder for rd in reads] == [0, 1]
    assert sum(rd.end - rd.start for rd in reads) <= 1.1 * 500 * 1000 * 4 + 2 * (1 << 20)
    with pytest.raises(ValueError, match="cover"):
        plan_box(((0, 0), (500, 1000)), pieces[:1])
    assert intersect(((0,), (5,)), ((5,), (5,))) is None


def test_node_local_tier1_reads_its_own_parts_and_tier2_for_the_rest(tmp_path):
    """Saved at 4 ranks on two nodes with node-local tier 1; restored at 2 ranks on node 0
    only: each new rank reads the saved pieces its node holds from its tier 1 and the rest
    (saved ranks 2, 3: the other node's, never read from there) from tier 2."""
    spec = {**SAVE_4, "node_local": True, "nodes": [0, 0, 1, 1]}
    assert all(r["ok"] for r in run("save", 4, tmp_path, spec))
    import shutil

    shutil.rmtree(tmp_path / "node1")  # the other node is gone: its tier 1 cannot be read
    got = run("restore", 2, tmp_path, {"mesh": [2], "placements": SAVE_4["placements"], "node_local": True})
    assert restored_ok(got), got


EMPTY_ADAM = """
import os, sys, torch, torch.distributed as dist, tiercheck
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
root = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "pg"), rank=0, world_size=1)
def build():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    return m, torch.optim.Adam(m.parameters(), lr=0.1)
model, opt = build()
model(torch.randn(4, 6)).sum().backward()
opt.step()
with tiercheck.Checkpointer(local=os.path.join(root, "ckpt"), run_log_interval=None) as ck:
    ck.save(1, {"model": model, "optim": opt}).wait()
fresh, empty = build()
before = [p.full_tensor().clone() for p in fresh.parameters()]
with tiercheck.Checkpointer(local=os.path.join(root, "ckpt"), run_log_interval=None) as ck:
    try:
        ck.restore({"model": fresh, "optim": empty})
    except tiercheck.StateMismatchError as exc:
        unchanged = all(torch.equal(a, p.full_tensor()) for a, p in zip(before, fresh.parameters()))
        print("refused", "state" in str(exc) and "initialise" in str(exc), unchanged)
dist.destroy_process_group()
"""


def test_an_optimizer_without_state_over_dtensors_is_refused_before_any_read(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", EMPTY_ADAM, str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "True", "True"]
