"""Resharding reads of local shards run on several reader threads (`steps.reshard`): DTensor
state saved by 4 real ranks (gloo on CPU) is read back whole in this process, through the
reader threads, bit-exact (pieces of several checksum blocks, a band of whole rows read
straight into the template, a column band through a buffer); a damaged block is refused
naming it, and the restore falls back to tier 2; a tier that allows no concurrent reads
keeps the one-reader path. The plan's reads go to disjoint parts of the box, or it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.format.manifest import decode_manifest
from tiercheck.plan.reshard import Piece, plan_box
from tiercheck.steps import catalog, reshard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO = Path(__file__).resolve().parents[2]
WORLD = 4

SAVE = """
import os, sys, torch, torch.distributed as dist, tiercheck
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
sys.path.insert(0, os.environ["PYTHONPATH"])
from tests.procs.test_reshard_parallel import global_tensors
root, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + os.path.join(root, "pg"), rank=rank, world_size=4)
mesh = init_device_mesh("cpu", (4,))
places = {"rows": [Shard(0)], "cols": [Shard(1)], "rep": [Replicate()]}
state = {"model": {k: distribute_tensor(v, mesh, places[k]) for k, v in global_tensors().items()}, "step": 7}
with tiercheck.Checkpointer(local=os.path.join(root, "ckpt"), remote="file://" + os.path.join(root, "remote"),
                            keep_local=None, run_log_interval=None, coordination_timeout=120) as ck:
    ck.save(3, state).wait()
dist.destroy_process_group()
"""


def global_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "rows": torch.randn(2000, 1000, generator=g),  # pieces of 500 rows, 2,000,000 bytes: 2 blocks each
        "cols": torch.randn(1000, 700, generator=g).to(torch.bfloat16),  # pieces of 175 columns
        "rep": torch.randn(33, generator=g).double(),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved4")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", SAVE, str(root), str(r)], cwd=REPO, env=env, stderr=subprocess.PIPE)
        for r in range(WORLD)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * WORLD, errors
    return root


def copy_of(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src / "ckpt", dst / "ckpt", symlinks=True)
    shutil.copytree(src / "remote", dst / "remote", symlinks=True)
    return dst


def spy_readers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that read bytes of the DTensor pieces (shard reads of 10 KB
    or more: the plain `step` and the manifests are smaller)."""
    names: list[str] = []
    real = catalog.ShardFiles.read_into

    def spy(self: catalog.ShardFiles, name: str, offset: int, dest: memoryview) -> None:
        if len(dest) >= 10_000:
            names.append(threading.current_thread().name)
        real(self, name, offset, dest)

    monkeypatch.setattr(catalog.ShardFiles, "read_into", spy)
    return names


def exact(got: dict[str, torch.Tensor]) -> dict[str, bool]:
    return {k: torch.equal(bits(got[k]), bits(v)) for k, v in global_tensors().items()}


@pytest.mark.parametrize("job_bytes", [4 << 20, 1], ids=["runs-of-4MiB", "a-job-per-block"])
def test_load_reads_the_pieces_on_reader_threads_bit_exact(
    saved: Path, monkeypatch: pytest.MonkeyPatch, job_bytes: int
) -> None:
    monkeypatch.setattr(reshard, "READERS", 3)  # parallel even where os.cpu_count() is 1
    monkeypatch.setattr(reshard, "_JOB_BYTES", job_bytes)
    readers = spy_readers(monkeypatch)
    loaded = tiercheck.load(str(saved / "ckpt"))
    assert exact(loaded["model"]) == dict.fromkeys(global_tensors(), True)
    assert loaded["step"] == 7
    assert readers and all(name.startswith("tiercheck-reshard") for name in readers), sorted(set(readers))


def test_restore_into_a_template_reads_bands_in_place_and_columns_through_a_buffer(
    saved: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reshard, "READERS", 3)
    regions: list[bool] = []
    real = reshard._run_job

    def spy(job: reshard._Job) -> None:
        regions.append(job.region is not None)
        real(job)

    monkeypatch.setattr(reshard, "_run_job", spy)
    readers = spy_readers(monkeypatch)
    template = {"model": {k: torch.zeros_like(v) for k, v in global_tensors().items()}, "step": 0}
    with tiercheck.Checkpointer(local=saved / "ckpt", keep_local=None, run_log_interval=None) as ck:
        assert ck.restore(template) == 3
    assert exact(template["model"]) == dict.fromkeys(global_tensors(), True)
    assert template["step"] == 7
    assert True in regions and False in regions  # rows of `rows` in place, `cols` through a buffer
    assert readers and all(name.startswith("tiercheck-reshard") for name in readers), sorted(set(readers))


def test_a_tier_without_concurrent_reads_keeps_one_reader(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reshard, "READERS", 3)
    monkeypatch.setattr(catalog.ShardFiles, "concurrent", lambda self, name: False)
    readers = spy_readers(monkeypatch)
    loaded = tiercheck.load(str(saved / "ckpt"))
    assert exact(loaded["model"]) == dict.fromkeys(global_tensors(), True)
    assert readers and set(readers) == {threading.current_thread().name}


@pytest.mark.parametrize("block", [0, 1])
def test_a_damaged_block_read_in_parallel_is_refused_and_tier2_used(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(reshard, "READERS", 3)
    root = copy_of(saved, tmp_path)
    step_dir = root / "ckpt" / naming.step_dir_name(3)
    manifest = decode_manifest((step_dir / naming.manifest_name(2, WORLD)).read_bytes(), "m")
    piece = next(e for e in manifest.entries if e.path.endswith("['rows']"))
    shard = step_dir / piece.file
    data = bytearray(shard.read_bytes())
    data[piece.offset + block * (1 << 20) + 17] ^= 0x08  # saved rank 2's piece of `rows`, block 0 or 1
    shard.write_bytes(bytes(data))
    with (
        pytest.raises(tiercheck.CheckpointCorruptedError, match=rf"saved rank 2\).*block {block} of this piece"),
        pytest.warns(RuntimeWarning),
    ):
        tiercheck.load(str(root / "ckpt"))
    template = {"model": {k: torch.zeros_like(v) for k, v in global_tensors().items()}, "step": 0}
    with (
        tiercheck.Checkpointer(
            local=root / "ckpt", remote=f"file://{root / 'remote'}", keep_local=None, run_log_interval=None
        ) as ck,
        pytest.warns(RuntimeWarning),
    ):
        assert ck.restore(template) == 3  # from tier 2
    assert exact(template["model"]) == dict.fromkeys(global_tensors(), True)


def test_saved_manifests_are_read_on_manifest_threads_once_each(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At another world size a rank reads every saved rank's manifest (from an object store,
    a request each): they are read on `MANIFEST_READERS` threads, each once, each tier's
    marker once."""
    monkeypatch.setattr(reshard, "MANIFEST_READERS", 3)
    manifests: list[tuple[int, str]] = []
    markers: list[str] = []
    real_manifest, real_marker = reshard.read_manifest, reshard.read_marker

    def spy_manifest(tier, step, rank, marker):  # type: ignore[no-untyped-def]
        manifests.append((rank, threading.current_thread().name))
        return real_manifest(tier, step, rank, marker)

    def spy_marker(tier, step):  # type: ignore[no-untyped-def]
        markers.append(tier.name)
        return real_marker(tier, step)

    monkeypatch.setattr(reshard, "read_manifest", spy_manifest)
    monkeypatch.setattr(reshard, "read_marker", spy_marker)
    loaded = tiercheck.load(str(saved / "ckpt"))
    assert exact(loaded["model"]) == dict.fromkeys(global_tensors(), True)
    assert sorted(r for r, _ in manifests) == list(range(WORLD))
    assert all(name.startswith("tiercheck-manifests") for _, name in manifests), manifests
    assert markers == []  # the caller's marker is the first tier's: read before, not again


def test_a_damaged_saved_manifest_read_in_parallel_is_named(saved: Path, tmp_path: Path) -> None:
    """A saved rank's manifest that does not match the marker fails the read as a serial read
    would: the first failure in rank order, naming that manifest."""
    root = copy_of(saved, tmp_path)
    step_dir = root / "ckpt" / naming.step_dir_name(3)
    for rank in (2, 3):
        path = step_dir / naming.manifest_name(rank, WORLD)
        data = bytearray(path.read_bytes())
        data[40] ^= 0x01
        path.write_bytes(bytes(data))
    with (
        pytest.raises(tiercheck.CheckpointCorruptedError, match=naming.manifest_name(2, WORLD)),
        pytest.warns(RuntimeWarning),
    ):
        tiercheck.load(str(root / "ckpt"))


def test_the_plan_refuses_pieces_that_overlap_and_leave_a_hole() -> None:
    # global 2x2, target the first row: two saved boxes meet it in the same element, the
    # other element is in none: the volumes add up, the cover does not.
    pieces = [Piece(0, (0, 0), (2, 1), 4, 0), Piece(1, (0, 0), (1, 1), 4, 0)]
    with pytest.raises(ValueError, match="overlapping or missing"):
        plan_box(((0, 0), (1, 2)), pieces)
    crossed = [Piece(0, (0, 0), (2, 1), 4, 0), Piece(1, (0, 0), (1, 2), 4, 0)]  # both hold (0, 0); (1, 1) none
    with pytest.raises(ValueError, match="overlapping or missing"):
        plan_box(((0, 0), (2, 2)), crossed)
    uneven = [Piece(r, (o, 0), (n, 3), 4, 0) for r, (o, n) in enumerate([(0, 4), (4, 4), (8, 2)])]
    reads = plan_box(((2, 0), (7, 3)), uneven)  # an uneven grid: disjoint, exact
    assert [(rd.piece.holder, rd.dst[0]) for rd in reads] == [(0, slice(0, 2)), (1, slice(2, 6)), (2, slice(6, 7))]
