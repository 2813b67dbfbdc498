"""DTensor entries (format version 2, docs/format.md "DTensor entries").

* The writer's output for a fixed state of DTensors on a one-rank CPU mesh (a gloo process
  group of world size 1) equals tests/format/golden/v2-dtensor/ byte for byte; regenerate with
  ``TIERCHECK_REGEN_GOLDEN=1`` as tests/format/test_format_golden.py says.
* An independent reader (json + crc32c) checks each block digest against the shard.
* The parser refuses every `dtensor` field that breaks a rule, naming the file and entry.
* Flatten records what the DTensor says (and refuses a piece that is no box of the whole);
  the structure cache notices a changed placement; the writer's block digests are right
  for several blocks, either algorithm, and aliases; retargeting and re-encoding keep them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tiercheck
from tiercheck.errors import CheckpointCorruptedError, UnsupportedStateError
from tiercheck.format import naming
from tiercheck.format.checksum import checksum_function
from tiercheck.format.manifest import decode_manifest, encode_manifest
from tiercheck.format.tree import BLOCK
from tiercheck.plan.retarget import retarget
from tiercheck.state.flatten import flatten_state
from tiercheck.state.structure import StructureCache

HERE = Path(__file__).resolve().parent
ROOT = HERE / "golden" / "v2-dtensor"
STEP = 5
STEP_DIR = naming.step_dir_name(STEP)
SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME
REGEN = os.environ.get("TIERCHECK_REGEN_GOLDEN") == "1"


@pytest.fixture(scope="module", autouse=True)
def one_rank() -> Iterator[None]:
    """A gloo process group of one rank (an in-memory store), for DeviceMeshes on CPU."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dtensor_state() -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    unnamed = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.arange(12, dtype=torch.float32).reshape(3, 4), mesh, [Shard(0), Shard(1)])
    return {
        "w": w,
        "b": distribute_tensor(torch.tensor([0.5, -1.0], dtype=torch.bfloat16), mesh, [Replicate(), Shard(0)]),
        "empty": distribute_tensor(torch.empty(0, 3), unnamed, [Shard(0)]),  # 0 bytes: no blocks
        "tied": w,  # the same DTensor: one region, an alias entry
        "plain": torch.arange(3),  # no `dtensor` field
        "raw": b"xy",
        "step": 7,
    }


def write_state(root: Path, state: dict[str, Any], step: int = STEP, **options: Any) -> Path:
    with tiercheck.Checkpointer(local=root, keep_local=None, **options) as ckpt:
        ckpt.save(step, state).wait()
    return root / naming.step_dir_name(step)


def test_writer_output_matches_golden_bytes(tmp_path: Path) -> None:
    produced = write_state(tmp_path / "ckpt", dtensor_state())
    golden = ROOT / STEP_DIR
    if REGEN:
        shutil.rmtree(ROOT, ignore_errors=True)
        golden.mkdir(parents=True)
        for name in (SHARD, MANIFEST, COMMIT):
            shutil.copyfile(produced / name, golden / name)
        pytest.skip(f"regenerated {golden}; review and commit the diff")
    for name in (MANIFEST, COMMIT):
        assert (produced / name).read_text("utf-8") == (golden / name).read_text("utf-8"), name
    assert (produced / SHARD).read_bytes() == (golden / SHARD).read_bytes()


def test_golden_dtensor_fields_with_an_independent_reader() -> None:
    step_dir = ROOT / STEP_DIR
    data = (step_dir / MANIFEST).read_bytes()
    manifest, shard = json.loads(data), (step_dir / SHARD).read_bytes()
    marker = json.loads((step_dir / COMMIT).read_bytes())
    assert (manifest["version"], marker["version"]) == (2, 2)
    entries = {e["path"]: e for e in manifest["entries"]}
    assert entries["state['w']"]["dtensor"] == {
        "global_shape": [3, 4],
        "offsets": [0, 0],
        "mesh": [1, 1],
        "dims": ["dp", "tp"],
        "placements": ["S0", "S1"],
        "coordinate": [0, 0],
        "block": 1 << 20,
        "blocks": [f"{crc32c.crc32c(shard[0:48]):08x}"],
    }
    assert list(entries["state['w']"])[-1] == "dtensor"  # written after "codec"
    assert entries["state['tied']"]["dtensor"] == entries["state['w']"]["dtensor"]
    assert entries["state['b']"]["dtensor"]["placements"] == ["R", "S0"]
    empty = entries["state['empty']"]["dtensor"]
    assert (empty["dims"], empty["global_shape"], empty["blocks"]) == ([None], [0, 3], [])
    assert "dtensor" not in entries["state['plain']"] and "dtensor" not in entries["state['raw']"]
    for e in manifest["entries"]:
        if "dtensor" in e:
            d = e["dtensor"]
            body = shard[e["offset"] : e["offset"] + e["length"]]
            want = [f"{crc32c.crc32c(body[i : i + d['block']]):08x}" for i in range(0, len(body), d["block"])]
            assert d["blocks"] == want, e["path"]
    assert encode_manifest(decode_manifest(data, "golden")) == data  # decoding keeps every field


def test_golden_dtensor_step_reads_back() -> None:
    got = tiercheck.load(ROOT)
    assert got["w"].equal(torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert got["tied"] is got["w"]
    assert got["empty"].shape == (0, 3) and got["step"] == 7 and got["raw"] == b"xy"


def test_schema_accepts_the_golden_dtensor_manifest() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from tests.format.test_format_golden import _doc_blocks

    schema = json.loads(_doc_blocks()["manifest"])
    validator = jsonschema.Draft202012Validator(schema)
    doc = json.loads((ROOT / STEP_DIR / MANIFEST).read_bytes())
    assert [e.message for e in validator.iter_errors(doc)] == []
    v1 = dict(doc, version=1)  # a version-1 manifest has no DTensor entries
    assert [e.message for e in validator.iter_errors(v1)] != []
    bad = json.loads(json.dumps(doc))
    bad["entries"][0]["dtensor"]["placements"] = ["S0", "X"]
    assert [e.message for e in validator.iter_errors(bad)] != []


# ------------------------------------------------------------------ hostile `dtensor` fields

W = 0  # entries[0]: state['w'], float32 [3, 4], 48 bytes, placements S0 S1 on a 1x1 mesh
RAW = 5  # entries[5]: state['raw'], bytes
BAD_DTENSOR: dict[str, tuple[int, dict[str, Any]]] = {
    "null": (W, {"dtensor": None}),
    "a list": (W, {"dtensor": []}),
    "a string": (W, {"dtensor": "S0"}),
    "empty object": (W, {"dtensor": {}}),
    "no blocks": (W, {"-": "blocks"}),
    "no block": (W, {"-": "block"}),
    "no coordinate": (W, {"-": "coordinate"}),
    "global_shape rank": (W, {"global_shape": [12]}),
    "global_shape longer": (W, {"global_shape": [3, 4, 1]}),
    "global_shape text": (W, {"global_shape": [3, "4"]}),
    "global_shape negative": (W, {"global_shape": [3, -4]}),
    "global_shape bool": (W, {"global_shape": [3, True]}),
    "global_shape float": (W, {"global_shape": [3, 4.0]}),
    "box past the whole": (W, {"global_shape": [2, 4]}),
    "offsets rank": (W, {"offsets": [0]}),
    "offset past the whole": (W, {"offsets": [1, 0]}),
    "offset negative": (W, {"offsets": [0, -1]}),
    "offsets huge": (W, {"offsets": [0, 2**63], "global_shape": [3, 2**63 + 4]}),
    "mesh empty": (W, {"mesh": [], "dims": [], "placements": [], "coordinate": []}),
    "mesh dim 0": (W, {"mesh": [0, 1]}),
    "mesh too big": (W, {"mesh": [1024, 1025]}),
    "mesh 65 dims": (W, {"mesh": [1] * 65, "dims": [None] * 65, "placements": ["R"] * 65, "coordinate": [0] * 65}),
    "mesh text": (W, {"mesh": ["1", 1]}),
    "dims count": (W, {"dims": ["dp"]}),
    "dims int": (W, {"dims": ["dp", 5]}),
    "dims string": (W, {"dims": "dp"}),
    "placements count": (W, {"placements": ["S0"]}),
    "placement unknown": (W, {"placements": ["S0", "X"]}),
    "placement lowercase": (W, {"placements": ["s0", "S1"]}),
    "placement negative": (W, {"placements": ["S-1", "S1"]}),
    "placement newline": (W, {"placements": ["S0\n", "S1"]}),
    "placement non-ASCII digit": (W, {"placements": ["S\uff10", "S1"]}),
    "placement partial": (W, {"placements": ["P", "S1"]}),
    "placement null": (W, {"placements": [None, "S1"]}),
    "placement past ndim": (W, {"placements": ["S2", "S1"]}),
    "placement huge dim": (W, {"placements": ["S" + "9" * 50, "S1"]}),
    "unsharded dim not whole": (W, {"placements": ["R", "S1"], "global_shape": [6, 4]}),
    "coordinate count": (W, {"coordinate": [0]}),
    "coordinate outside": (W, {"coordinate": [1, 0]}),
    "coordinate negative": (W, {"coordinate": [0, -1]}),
    "block small": (W, {"block": 4096}),
    "block unaligned": (W, {"block": (1 << 20) + 1}),
    "block huge": (W, {"block": 1 << 31}),
    "block float": (W, {"block": 1048576.0}),
    "block bool": (W, {"block": True}),
    "blocks none": (W, {"blocks": []}),
    "blocks too many": (W, {"blocks": ["00000000", "00000000"]}),
    "block digest capitals": (W, {"blocks": ["ABCDEF01"]}),
    "block digest short": (W, {"blocks": ["abcdef0"]}),
    "block digest long": (W, {"blocks": ["abcdef0100"]}),
    "block digest int": (W, {"blocks": [5]}),
    "blocks a string": (W, {"blocks": "abcdef01"}),
    "a bytes entry": (
        RAW,
        {
            "dtensor": {
                "global_shape": [2],
                "offsets": [0],
                "mesh": [1],
                "dims": [None],
                "placements": ["R"],
                "coordinate": [0],
                "block": 1 << 20,
                "blocks": ["00000000"],
            }
        },
    ),
}


def _golden_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((ROOT / STEP_DIR / MANIFEST).read_bytes())
    assert doc["entries"][W]["path"] == "state['w']" and doc["entries"][RAW]["path"] == "state['raw']"
    return doc


def _damaged(index: int, change: dict[str, Any]) -> dict[str, Any]:
    doc = _golden_doc()
    entry = doc["entries"][index]
    if "dtensor" in change:
        entry["dtensor"] = change["dtensor"]
    elif "-" in change:
        del entry["dtensor"][change["-"]]
    else:
        entry["dtensor"].update(change)
    return doc


@pytest.mark.parametrize("damage", list(BAD_DTENSOR))
def test_the_parser_refuses_a_bad_dtensor_field_naming_file_and_entry(damage: str) -> None:
    index, change = BAD_DTENSOR[damage]
    doc = _damaged(index, change)
    with pytest.raises(CheckpointCorruptedError, match=rf"^step-5/m\.json entries\[{index}\]"):
        decode_manifest(json.dumps(doc).encode(), "step-5/m.json")


@pytest.mark.parametrize("damage", ["placement past ndim", "blocks too many", "coordinate outside"])
def test_a_bad_dtensor_entry_among_thousands_is_named(damage: str) -> None:
    """The batch check (`_entry_batch`) refuses it too, and the entry-by-entry check names it."""
    doc = _golden_doc()
    good = doc["entries"][W]
    doc["entries"] = [dict(good, path=f"state['p{i}']") for i in range(5000)]
    doc["tree"] = {
        "t": "dict",
        "k": [["s", f"p{i}"] for i in range(5000)],
        "v": [{"t": "tensor", "e": i} for i in range(5000)],
    }
    index, change = BAD_DTENSOR[damage]
    bad = _damaged(index, change)["entries"][index]
    doc["entries"][4321] = dict(bad, path="state['p4321']")
    with pytest.raises(CheckpointCorruptedError, match=r"entries\[4321\]"):
        decode_manifest(json.dumps(doc).encode(), "m")
    doc["entries"][4321] = good
    assert {e.dtensor for e in decode_manifest(json.dumps(doc).encode(), "m").entries} == {
        decode_manifest(json.dumps(_golden_doc()).encode(), "m").entries[W].dtensor
    }


def test_a_dtensor_field_needs_version_2_and_a_known_algorithm() -> None:
    doc = _golden_doc()
    with pytest.raises(CheckpointCorruptedError, match=r"entries\[0\].*version-1"):
        decode_manifest(json.dumps(dict(doc, version=1)).encode(), "m")
    with pytest.raises(CheckpointCorruptedError, match=r"entries\[0\].*16 lowercase hex"):
        decode_manifest(json.dumps(dict(doc, checksum_algorithm="xxh3_64")).encode(), "m")
    with pytest.raises(CheckpointCorruptedError, match=r"entries\[0\].*does not know"):
        decode_manifest(json.dumps(dict(doc, checksum_algorithm="md5")).encode(), "m")
    without = dict(doc, entries=[{k: v for k, v in e.items() if k != "dtensor"} for e in doc["entries"]])
    assert decode_manifest(json.dumps(dict(without, version=1)).encode(), "m").entries[W].dtensor is None


def test_a_sealed_bad_dtensor_field_fails_the_read(tmp_path: Path) -> None:
    """Through the read path: the marker covers the damaged manifest, only validation stands."""
    root = tmp_path / "ckpt"
    shutil.copytree(ROOT, root)
    step_dir = root / STEP_DIR
    data = json.dumps(_damaged(W, {"offsets": [1, 0]})).encode()
    (step_dir / MANIFEST).write_bytes(data)
    marker = json.loads((step_dir / COMMIT).read_bytes())
    marker["manifests"][0].update(length=len(data), checksum=f"{crc32c.crc32c(data):08x}")
    (step_dir / COMMIT).write_bytes(json.dumps(marker).encode())
    with pytest.raises(CheckpointCorruptedError, match=r"entries\[0\]"):
        tiercheck.load(root, step=STEP)


# ------------------------------------------------------------------ flatten, cache, writer


def test_flatten_records_the_dtensor_layout() -> None:
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    t = distribute_tensor(torch.ones(4, 6), mesh, [Shard(-1)])
    (leaf,) = flatten_state({"t": t}).leaves
    assert leaf.dtensor is not None
    assert (leaf.shape, leaf.dtensor.global_shape, leaf.dtensor.offsets) == ((4, 6), (4, 6), (0, 0))
    assert (leaf.dtensor.mesh, leaf.dtensor.dims, leaf.dtensor.placements) == ((1,), ("fsdp",), ("S1",))
    assert (leaf.dtensor.coordinate, leaf.dtensor.block, leaf.dtensor.blocks) == ((0,), BLOCK, ())


def test_a_piece_that_is_no_box_of_the_whole_is_refused() -> None:
    mesh = init_device_mesh("cpu", (1,))
    padded = DTensor.from_local(
        torch.ones(3, 4), mesh, [Shard(0)], run_check=False, shape=torch.Size([6, 4]), stride=(4, 1)
    )
    with pytest.raises(UnsupportedStateError, match=r"state\['model'\]\['w'\].*box"):
        flatten_state({"model": {"w": padded}})


def test_the_structure_cache_sees_a_changed_placement() -> None:
    """The DTensor's global shape, placements and mesh are part of what the cache compares."""
    mesh = init_device_mesh("cpu", (1,))
    local = torch.arange(8.0)
    cache = StructureCache()
    first = cache.flatten({"w": DTensor.from_local(local, mesh, [Shard(0)])})
    again = cache.flatten({"w": DTensor.from_local(local, mesh, [Shard(0)])})
    assert (cache.hits, cache.misses) == (1, 1) and again.leaves is first.leaves
    moved = cache.flatten({"w": DTensor.from_local(local, mesh, [Replicate()])})
    assert (cache.hits, cache.misses) == (1, 2)
    assert moved.leaves[0].dtensor is not None and moved.leaves[0].dtensor.placements == ("R",)
    assert moved.leaves == flatten_state({"w": DTensor.from_local(local, mesh, [Replicate()])}).leaves
    other_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    named = cache.flatten({"w": DTensor.from_local(local, other_mesh, [Replicate()])})
    assert cache.misses == 3 and named.leaves[0].dtensor is not None
    assert named.leaves[0].dtensor.dims == ("dp",)


@pytest.mark.parametrize("algorithm", ["crc32c", "xxh3_64"])
def test_block_digests_of_a_piece_of_several_blocks(tmp_path: Path, algorithm: str) -> None:
    mesh = init_device_mesh("cpu", (1,))
    n = (5 << 19) // 4 + 3  # 2.5 MiB and 12 bytes of float32: three blocks, the last short
    t = distribute_tensor(torch.arange(n, dtype=torch.float32), mesh, [Shard(0)])
    step_dir = write_state(tmp_path / "ckpt", {"t": t, "alias": t}, 9, checksum=algorithm)
    shard = (step_dir / SHARD).read_bytes()
    digest = checksum_function(algorithm)
    manifest = decode_manifest((step_dir / MANIFEST).read_bytes(), "m")
    first, alias = manifest.entries
    assert first.dtensor is not None and alias.dtensor == first.dtensor
    body = shard[first.offset : first.offset + first.length]
    assert first.checksum == digest(body)
    assert first.dtensor.blocks == tuple(digest(body[i : i + BLOCK]) for i in range(0, len(body), BLOCK))
    assert len(first.dtensor.blocks) == 3
    assert tiercheck.load(tmp_path / "ckpt")["t"].equal(torch.arange(n, dtype=torch.float32))


def test_retargeting_keeps_the_dtensor_fields() -> None:
    m = decode_manifest((ROOT / STEP_DIR / MANIFEST).read_bytes(), "m")
    m = dataclasses.replace(m, world_size=2, replicated=(("s", "b"),))
    moved = retarget(m, {("s", "b"): 1})
    assert moved is not None
    before = {e.path: e.dtensor for e in m.entries}
    after = {e.path: e.dtensor for e in moved.manifest.entries}
    assert "state['b']" not in after and after == {p: d for p, d in before.items() if p != "state['b']"}
    assert encode_manifest(decode_manifest(encode_manifest(moved.manifest), "m")) == encode_manifest(moved.manifest)


def test_format_doc_dtensor_example_is_the_golden_entry() -> None:
    import re

    text = (HERE.parents[1] / "docs" / "format.md").read_text("utf-8")
    (example,) = re.findall(r"```json dtensor\n(.*?)```", text, flags=re.S)
    assert json.loads(example) == _golden_doc()["entries"][W]
