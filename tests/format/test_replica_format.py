"""The multi-rank additions to format version 1 (docs/format.md): the manifest's
`replicated` list and `replica` tree nodes, read without a process group.

* `decode_manifest` must reject, as `CheckpointCorruptedError` and never another
  exception, every manifest that breaks a rule of the spec for these two fields, and
  accept the valid shapes.
* A 2-rank step built by hand on disk (shards, manifests, COMMIT, real checksums) reads
  back through `tiercheck.load` and `tiercheck.steps.restore.restore_from`: a replica resolves
  to the owner rank's value, a replica whose owner does not hold the key is corruption,
  and a restore with another number of ranks gets the replicated keys only.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers.assertions import same
from tiercheck.errors import CheckpointCorruptedError, StateMismatchError
from tiercheck.format import naming
from tiercheck.format.checksum import checksum_function
from tiercheck.format.manifest import (
    Manifest,
    ManifestRef,
    Marker,
    ShardFile,
    build_entries,
    decode_manifest,
    encode_manifest,
    encode_marker,
)
from tiercheck.plan.shards import plan_shard
from tiercheck.state.flatten import flatten_state
from tiercheck.steps.restore import read_step, restore_from
from tiercheck.tiers.local import LocalTier

ALGO = "crc32c"
CHECKSUM = checksum_function(ALGO)
STEP = 30


# ------------------------------------------------------------------ building parts


def encode_key(k: str | int) -> list[str]:
    return ["i", str(k)] if type(k) is int else ["s", str(k)]


def leaf_bytes(src: object) -> bytes:
    if isinstance(src, torch.Tensor):
        return src.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    if isinstance(src, np.ndarray):
        return np.ascontiguousarray(src).tobytes()
    assert isinstance(src, (bytes, bytearray))
    return bytes(src)


@dataclass
class Part:
    manifest: Manifest
    shard: bytes

    @property
    def manifest_bytes(self) -> bytes:
        return encode_manifest(self.manifest)


def build_part(
    rank: int,
    world: int,
    state: Mapping[Any, Any],
    replicas: Mapping[Any, int] = {},
    replicated: tuple[Any, ...] = (),
    step: int = STEP,
) -> Part:
    """One rank's part, as the writer builds it: `state`'s keys in order, those in
    `replicas` as replica nodes pointing at the given rank, the rest flattened into this
    rank's shard; `replicated` lists the replicated top-level keys."""
    own = {k: v for k, v in state.items() if k not in replicas}
    flat = flatten_state(own)
    plan = plan_shard(flat.leaves)
    shard = bytearray(plan.total_bytes)
    sums = []
    for leaf, src, off in zip(flat.leaves, flat.sources, plan.offsets, strict=True):
        data = leaf_bytes(src)
        assert len(data) == leaf.nbytes
        shard[off : off + len(data)] = data
        sums.append(CHECKSUM(data))
    mine = dict(zip(map(tuple, flat.tree["k"]), flat.tree["v"], strict=True))
    keys = [encode_key(k) for k in state]
    values = [
        {"t": "replica", "r": replicas[k]} if k in replicas else mine[tuple(ek)]
        for k, ek in zip(state, keys, strict=True)
    ]
    name = naming.shard_name(rank, world)
    manifest = Manifest(
        step=step,
        rank=rank,
        world_size=world,
        checksum_algorithm=ALGO,
        files=(ShardFile(name, plan.total_bytes),),
        entries=build_entries(flat.leaves, plan.offsets, sums, name),
        tree={"t": "dict", "k": keys, "v": values},
        replicated=tuple((e[0], e[1]) for e in map(encode_key, replicated)),
    )
    return Part(manifest, bytes(shard))


def write_step(root: Path, parts: list[Part], step: int = STEP) -> Path:
    """Write every part and a COMMIT marker covering their manifests."""
    world = len(parts)
    step_dir = root / naming.step_dir_name(step)
    step_dir.mkdir(parents=True)
    refs = []
    for rank, part in enumerate(parts):
        m = part.manifest
        assert (m.rank, m.world_size, m.step) == (rank, world, step)
        data = part.manifest_bytes
        (step_dir / naming.shard_name(rank, world)).write_bytes(part.shard)
        (step_dir / naming.manifest_name(rank, world)).write_bytes(data)
        refs.append(ManifestRef(naming.manifest_name(rank, world), len(data), CHECKSUM(data)))
    marker = Marker(step, world, ALGO, tuple(refs))
    (step_dir / naming.COMMIT_NAME).write_bytes(encode_marker(marker))
    return step_dir


def rank_state(rank: int) -> dict[Any, Any]:
    """What rank `rank` of a 2-rank data-parallel job holds: the same model and optimizer
    on every rank, a per-rank shard, position and blob."""
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([0.5, -1.5])},
        "shard": torch.randn(4, generator=g),
        "optimizer": {"step": 7, "lr": 0.1, "m": torch.full((3,), 2.0, dtype=torch.bfloat16)},
        "position": 1000 + rank,
        3: b"rank%d" % rank,
    }


REPLICATED = ("model", "optimizer")


def two_rank_parts(owners: Mapping[str, int]) -> list[Part]:
    """A 2-rank step: each replicated key is written by `owners[key]`, a replica elsewhere."""
    return [
        build_part(
            rank,
            2,
            rank_state(rank),
            replicas={k: o for k, o in owners.items() if o != rank},
            replicated=REPLICATED,
        )
        for rank in range(2)
    ]


# -------------------------------------------------------------- decode: valid cases


def base_doc(rank: int = 1, world: int = 2, owner: int = 0) -> dict[str, Any]:
    """A valid manifest of `rank`: "model" (and the int key 3) replicated and written by
    `owner`, the rest per rank."""
    state = rank_state(rank)
    replicas = {"model": owner, 3: owner} if owner != rank else {}
    part = build_part(rank, world, state, replicas=replicas, replicated=("model", 3))
    doc: dict[str, Any] = json.loads(part.manifest_bytes)
    return doc


def decode(doc: object) -> Manifest:
    return decode_manifest(json.dumps(doc).encode(), "test manifest")


def tree_value(doc: dict[str, Any], key: list[str]) -> dict[str, Any]:
    tree = doc["tree"]
    node: dict[str, Any] = tree["v"][tree["k"].index(key)]
    return node


def test_manifests_built_by_the_writer_code_round_trip() -> None:
    for part in two_rank_parts({"model": 0, "optimizer": 1}):
        data = part.manifest_bytes
        assert data.endswith(b"}\n")
        decoded = decode_manifest(data, "x")
        assert decoded == part.manifest
        assert encode_manifest(decoded) == data
        doc = json.loads(data)
        assert doc["replicated"] == [["s", "model"], ["s", "optimizer"]]
        assert list(doc)[-1] == "replicated"  # appended after "tree": older fields keep their order


def test_valid_replica_manifests_decode() -> None:
    doc = base_doc()
    m = decode(doc)
    assert m.replicated == (("s", "model"), ("i", "3"))
    assert tree_value(doc, ["s", "model"]) == {"t": "replica", "r": 0}
    assert tree_value(doc, ["i", "3"]) == {"t": "replica", "r": 0}

    # The owner lists the key as replicated and holds a regular node.
    owner = base_doc(rank=0, owner=0)
    assert decode(owner).replicated == (("s", "model"), ("i", "3"))
    assert all(v["t"] != "replica" for v in owner["tree"]["v"])

    # Any other rank of the world may be the owner.
    big = base_doc(rank=5, world=8, owner=7)
    assert decode(big).tree["v"][0] == {"t": "replica", "r": 7}

    # A single-rank save with replicated keys (restorable by a job of any size).
    single = base_doc(rank=0, world=1, owner=0)
    assert decode(single).replicated == (("s", "model"), ("i", "3"))

    # No replicated keys: the field is absent (and an empty list means the same).
    plain = base_doc(rank=0, owner=0)
    del plain["replicated"]
    assert decode(plain).replicated == ()
    plain["replicated"] = []
    assert decode(plain).replicated == ()

    # Replicated keys need not be replicas anywhere in this manifest, and fields a reader
    # does not know are still ignored.
    doc2 = base_doc()
    doc2["tree"]["v"][doc2["tree"]["k"].index(["s", "model"])] = {"t": "none"}
    doc2["x-future"] = {"anything": 1}
    assert decode(doc2).replicated == (("s", "model"), ("i", "3"))


# ------------------------------------------------------------ decode: hostile cases

REPLICA = {"t": "replica", "r": 0}


def _set_tree_value(doc: dict[str, Any], key: list[str], node: object) -> None:
    doc["tree"]["v"][doc["tree"]["k"].index(key)] = node


def _nested(kind: str) -> dict[str, Any]:
    """A replica one level below a replicated top-level key."""
    inner = copy.deepcopy(REPLICA)
    if kind == "dict":
        return {"t": "dict", "k": [["s", "w"]], "v": [inner]}
    if kind in ("list", "tuple"):
        return {"t": kind, "v": [{"t": "none"}, inner]}
    if kind == "stateful":
        return {"t": "stateful", "v": {"t": "dict", "k": [["s", "w"]], "v": [inner]}}
    if kind == "stateful-itself":
        return {"t": "stateful", "v": inner}
    if kind == "deep":
        node: dict[str, Any] = inner
        for _ in range(5):
            node = {"t": "dict", "k": [["s", "x"]], "v": [node]}
        return node
    raise AssertionError(kind)


NESTED = ["dict", "list", "tuple", "stateful", "stateful-itself", "deep"]


@pytest.mark.parametrize("kind", NESTED)
def test_replica_below_the_top_level_is_rejected(kind: str) -> None:
    doc = base_doc()
    _set_tree_value(doc, ["s", "model"], _nested(kind))  # under a replicated key: only depth is wrong
    with pytest.raises(CheckpointCorruptedError):
        decode(doc)


def test_replica_as_the_root_is_rejected() -> None:
    doc = base_doc()
    doc["tree"] = dict(REPLICA)
    with pytest.raises(CheckpointCorruptedError):
        decode(doc)


def test_replica_inside_a_per_rank_value_is_rejected() -> None:
    doc = base_doc()
    _set_tree_value(doc, ["s", "optimizer"], _nested("dict"))
    with pytest.raises(CheckpointCorruptedError):
        decode(doc)


_DROP = "drop"


@pytest.mark.parametrize(
    "replicated",
    [
        _DROP,  # no 'replicated' field at all
        [],
        [["i", "3"]],  # the other replicated key only
        [["s", "Model"], ["i", "3"]],  # keys compare exactly
    ],
    ids=["absent", "empty", "other-key", "case"],
)
def test_replica_at_a_key_not_listed_as_replicated_is_rejected(replicated: object) -> None:
    doc = base_doc()
    if replicated == _DROP:
        del doc["replicated"]
        _set_tree_value(doc, ["i", "3"], {"t": "none"})
    else:
        doc["replicated"] = replicated
        if replicated == [["s", "Model"], ["i", "3"]]:
            doc["tree"]["k"].append(["s", "Model"])
            doc["tree"]["v"].append({"t": "none"})
    with pytest.raises(CheckpointCorruptedError, match="replica"):
        decode(doc)


def test_replica_at_a_per_rank_key_is_rejected() -> None:
    doc = base_doc()
    _set_tree_value(doc, ["s", "shard"], dict(REPLICA))
    with pytest.raises(CheckpointCorruptedError, match=r"replica node at key \['s', 'shard'\]"):
        decode(doc)


# Rank 2 of 3: r=0 and r=1 are valid, so False/True (== 0/1 in Python) and 0.0/1.0 are
# rejected for their type alone; 2 is the manifest's own rank, 3 the world size.
BAD_R = [3, 4, -1, 2**64, 2, "0", 0.0, 1.0, 1.5, None, [0], {"r": 0}, False, True]


@pytest.mark.parametrize("r", BAD_R, ids=[repr(r) for r in BAD_R])
def test_replica_rank_must_be_another_rank_of_this_world(r: object) -> None:
    doc = base_doc(rank=2, world=3, owner=0)
    _set_tree_value(doc, ["s", "model"], {"t": "replica", "r": r})
    with pytest.raises(CheckpointCorruptedError, match="replica"):
        decode(doc)


def test_replica_rank_valid_neighbours_decode() -> None:
    for r in (0, 1):
        doc = base_doc(rank=2, world=3, owner=0)
        _set_tree_value(doc, ["s", "model"], {"t": "replica", "r": r})
        assert decode(doc).tree["v"][0] == {"t": "replica", "r": r}


def test_replica_in_a_single_rank_manifest_is_rejected() -> None:
    doc = base_doc(rank=0, world=1, owner=0)
    _set_tree_value(doc, ["s", "model"], {"t": "replica", "r": 0})
    with pytest.raises(CheckpointCorruptedError, match="replica"):
        decode(doc)


BAD_NODES = [
    {"t": "replica"},
    {"t": "replica", "r": 0, "e": 0},
    {"t": "replica", "r": 0, "v": None},
    {"t": "replica", "r": 0, "k": [], "v": []},
    {"t": "replica", "r": 0, "x-future": 1},
    {"t": "replica", "rank": 0},
    {"t": "Replica", "r": 0},
]


@pytest.mark.parametrize("node", BAD_NODES, ids=[json.dumps(n) for n in BAD_NODES])
def test_replica_node_with_missing_or_extra_fields_is_rejected(node: dict[str, Any]) -> None:
    doc = base_doc()
    _set_tree_value(doc, ["s", "model"], node)
    with pytest.raises(CheckpointCorruptedError):
        decode(doc)


BAD_REPLICATED: list[object] = [
    None,
    "model",
    5,
    {"s": "model"},
    ["s", "model"],  # one key, not a list of keys
    [["x", "model"]],
    [["s"]],
    [["s", "model", "extra"]],
    [["s", 5]],
    [["s", None]],
    ["model"],
    [[]],
    [None],
    [["i", "abc"]],
    [["i", ""]],
    [["i", "1.5"]],
    [["i", "1" * 4301]],
    [["S", "model"]],
    [["s", "model"], ["i", "3"], ["s", "model"]],  # repeated
    [["i", "3"], ["i", "3"]],  # repeated
    [["s", "model"], ["s", "absent"]],  # not a top-level key of the tree
    [["s", "model"], ["i", "3"], ["s", "3"]],  # "3" is not 3
    [["s", "model"], ["i", "3"], ["s", "w"]],  # a nested key is not a top-level key
]


@pytest.mark.parametrize("replicated", BAD_REPLICATED, ids=[json.dumps(r)[:40] for r in BAD_REPLICATED])
def test_bad_replicated_list_is_rejected(replicated: object) -> None:
    doc = base_doc(rank=0, owner=0)  # no replica nodes: only the list itself is wrong
    doc["replicated"] = replicated
    with pytest.raises(CheckpointCorruptedError, match="replicated"):
        decode(doc)


def test_replicated_key_absent_from_the_tree_is_rejected_even_when_nothing_refers_to_it() -> None:
    doc = base_doc(rank=0, owner=0)
    doc["replicated"] = [["s", "gone"]]
    with pytest.raises(CheckpointCorruptedError, match="not a top-level key"):
        decode(doc)


def test_hostile_mutations_raise_only_checkpoint_corrupted() -> None:
    """Every single-field mutation of the replica fields gives a clean error or a valid
    manifest; nothing else escapes decode_manifest."""
    junk: list[object] = [None, True, 0, -1, 2**70, 1.5, "", "replica", [], {}, [[]], {"t": "replica"}]
    for rank, owner in ((1, 0), (0, 0)):
        for value in junk:
            for where in ("replicated", "node", "node.r", "node.t", "key"):
                doc = base_doc(rank=rank, owner=owner)
                if where == "replicated":
                    doc["replicated"] = value
                elif where == "node":
                    _set_tree_value(doc, ["s", "model"], value)
                elif where == "node.r":
                    tree_value(doc, ["s", "model"])["r"] = value
                elif where == "node.t":
                    tree_value(doc, ["s", "model"])["t"] = value
                else:
                    doc["tree"]["k"][0] = value
                with contextlib.suppress(CheckpointCorruptedError):
                    decode(doc)


# ------------------------------------------------------- end to end: a 2-rank step


@pytest.fixture
def job_root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def expected_view(rank: int, keys: tuple[Any, ...] | None = None) -> dict[Any, Any]:
    """What rank `rank` reads back: its own state (replicated values are equal anyway)."""
    state = rank_state(rank)
    return {k: v for k, v in state.items() if keys is None or k in keys}


@pytest.mark.parametrize("owners", [{"model": 0, "optimizer": 0}, {"model": 0, "optimizer": 1}], ids=["r0", "split"])
def test_load_resolves_replicas_from_the_owner_rank(job_root: Path, owners: dict[str, int]) -> None:
    parts = two_rank_parts(owners)
    step_dir = write_step(job_root, parts)
    # Written once: rank 1's shard holds none of rank 0's replicated bytes and vice versa.
    for rank, part in enumerate(parts):
        paths = {e.path for e in part.manifest.entries}
        for key, owner in owners.items():
            assert any(p.startswith(f"state[{key!r}]") for p in paths) == (owner == rank)
    before = {p.name: p.read_bytes() for p in step_dir.iterdir()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rank in range(2):
            loaded = tiercheck.load(job_root, rank=rank)
            same(loaded, expected_view(rank))
            assert list(loaded) == list(rank_state(rank))  # the reading rank's key order
            same(tiercheck.load(job_root, step=STEP, rank=rank), expected_view(rank))
    assert {p.name: p.read_bytes() for p in step_dir.iterdir()} == before


def test_template_restore_fills_replicated_tensors_in_place(job_root: Path) -> None:
    write_step(job_root, two_rank_parts({"model": 0, "optimizer": 1}))
    template = rank_state(1)
    for v in (template["model"]["w"], template["model"]["b"], template["optimizer"]["m"], template["shard"]):
        v.zero_()
    template["position"] = -1
    w = template["model"]["w"]
    restored = restore_from([LocalTier(job_root)], template, None, 1)
    assert restored is not None and restored.step == STEP
    assert template["model"]["w"] is w
    same(template, expected_view(1))


def test_template_without_the_replicated_key_does_not_read_the_owner(job_root: Path) -> None:
    # Rank 1 asks only for its per-rank keys: rank 0's files are not needed, so rank 0's
    # manifest may even be unreadable.
    step_dir = write_step(job_root, two_rank_parts({"model": 0, "optimizer": 0}))
    os.unlink(step_dir / naming.shard_name(0, 2))
    template = {"shard": torch.zeros(4), "position": 0}
    read_step(LocalTier(job_root), STEP, 1, template, strict=True)
    same(template, expected_view(1, ("shard", "position")))
    with pytest.raises(CheckpointCorruptedError, match="shard file is missing"):
        tiercheck.load(job_root, step=STEP, rank=1)


def test_replica_pointing_at_an_owner_that_holds_a_replica_is_corruption(job_root: Path) -> None:
    # Each rank claims the other wrote "model": no rank holds it.
    parts = [build_part(r, 2, rank_state(r), replicas={"model": 1 - r}, replicated=REPLICATED) for r in range(2)]
    write_step(job_root, parts)
    for rank in range(2):
        with pytest.raises(CheckpointCorruptedError, match="does not hold the replicated key 'model'"):
            tiercheck.load(job_root, step=STEP, rank=rank)


def test_replica_pointing_at_an_owner_that_does_not_list_the_key_is_corruption(job_root: Path) -> None:
    parts = [
        build_part(0, 2, rank_state(0), replicated=("optimizer",)),  # "model" per rank on rank 0
        build_part(1, 2, rank_state(1), replicas={"model": 0}, replicated=REPLICATED),
    ]
    write_step(job_root, parts)
    tiercheck.load(job_root, step=STEP, rank=0)  # rank 0's own view is fine
    with pytest.raises(CheckpointCorruptedError, match="does not hold the replicated key 'model'"):
        tiercheck.load(job_root, step=STEP, rank=1)


def test_replica_pointing_at_an_owner_without_the_key_is_corruption(job_root: Path) -> None:
    owner_state = {k: v for k, v in rank_state(0).items() if k != "model"}
    parts = [
        build_part(0, 2, owner_state, replicated=("optimizer",)),
        build_part(1, 2, rank_state(1), replicas={"model": 0}, replicated=REPLICATED),
    ]
    write_step(job_root, parts)
    with pytest.raises(CheckpointCorruptedError, match="does not hold the replicated key 'model'"):
        tiercheck.load(job_root, step=STEP, rank=1)


def test_replica_whose_owner_bytes_are_damaged_is_corruption(job_root: Path) -> None:
    step_dir = write_step(job_root, two_rank_parts({"model": 0, "optimizer": 0}))
    shard = step_dir / naming.shard_name(0, 2)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x01  # model.w, which rank 1 reads through its replica
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match="checksum mismatch"):
        tiercheck.load(job_root, step=STEP, rank=1)


def test_replica_whose_owner_manifest_is_missing_is_corruption(job_root: Path) -> None:
    step_dir = write_step(job_root, two_rank_parts({"model": 0, "optimizer": 0}))
    os.unlink(step_dir / naming.manifest_name(0, 2))  # e.g. a node-local copy on rank 1's node
    os.unlink(step_dir / naming.shard_name(0, 2))
    with pytest.raises(CheckpointCorruptedError, match="manifest is missing"):
        tiercheck.load(job_root, step=STEP, rank=1)
    template = {"shard": torch.zeros(4), "position": 0, 3: b""}
    read_step(LocalTier(job_root), STEP, 1, template, strict=True)  # per-rank keys only: fine
    same(template, expected_view(1, ("shard", "position", 3)))


# --------------------------------------------------------- world-size change


@pytest.mark.parametrize("owners", [{"model": 0, "optimizer": 0}, {"model": 1, "optimizer": 1}], ids=["r0", "r1"])
@pytest.mark.parametrize(("rank", "world"), [(0, 1), (2, 3), (3, 4)])
def test_world_size_change_restores_replicated_keys(
    job_root: Path, owners: dict[str, int], rank: int, world: int
) -> None:
    write_step(job_root, two_rank_parts(owners))
    tier = LocalTier(job_root)
    template: dict[str, dict[str, Any]] = {
        "model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)},
        "optimizer": {"step": 0, "lr": 0.0, "m": None},
    }
    w = template["model"]["w"]
    restored = restore_from([tier], template, None, rank, world_size=world)
    assert restored is not None and restored.step == STEP
    assert template["model"]["w"] is w
    expected = rank_state(0)
    same(template["model"], expected["model"])
    same(template["optimizer"], expected["optimizer"])

    # Without a template: the replicated keys only, in rank 0's order.
    fresh = restore_from([tier], None, None, rank, world_size=world)
    assert fresh is not None
    same(fresh.value, expected_view(0, REPLICATED))


@pytest.mark.parametrize("per_rank", ["shard", "position", 3])
def test_world_size_change_refuses_per_rank_keys(job_root: Path, per_rank: object) -> None:
    write_step(job_root, two_rank_parts({"model": 0, "optimizer": 1}))
    template: dict[Any, Any] = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, per_rank: None}
    w_before = template["model"]["w"].clone()
    with pytest.raises(StateMismatchError, match=rf"2 ranks.*this job has 1.*{per_rank!r}"):
        restore_from([LocalTier(job_root)], template, None, 0, world_size=1)
    assert torch.equal(template["model"]["w"], w_before)  # raised before any byte was read


def test_same_world_size_reads_the_own_rank_view(job_root: Path) -> None:
    write_step(job_root, two_rank_parts({"model": 0, "optimizer": 1}))
    restored = restore_from([LocalTier(job_root)], None, None, 1, world_size=2)
    assert restored is not None
    same(restored.value, expected_view(1))


def test_single_rank_save_with_replicated_keys_restores_on_more_ranks(job_root: Path) -> None:
    write_step(job_root, [build_part(0, 1, rank_state(0), replicated=REPLICATED)])
    template = {"model": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}}
    for rank in range(4):
        restore_from([LocalTier(job_root)], template, None, rank, world_size=4)
        same(template["model"], rank_state(0)["model"])
    # A per-rank key that every saved rank (here the only one) holds alike restores on
    # every new rank (DESIGN.md section 9): one saved rank cannot disagree with itself.
    position: dict[str, Any] = {"position": 0}
    restore_from([LocalTier(job_root)], position, None, 1, world_size=2)
    assert position["position"] == rank_state(0)["position"]


def test_single_rank_save_without_replicated_keys_restores_on_more_ranks(job_root: Path) -> None:
    write_step(job_root, [build_part(0, 1, rank_state(0))])
    template: dict[str, Any] = {"model": None}
    restore_from([LocalTier(job_root)], template, None, 1, world_size=2)
    same(template["model"], rank_state(0)["model"])


# ------------------------------------------------------------ shared shard names


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_manifests_naming_the_same_shard_file_leak_no_descriptor(job_root: Path) -> None:
    # Rank 1's manifest names rank 0's shard for an entry of its own (a shard name of this
    # format, so it passes validation); reading rank 1's view opens that file for both
    # manifests. Every descriptor opened must be closed again.
    parts = two_rank_parts({"model": 0, "optimizer": 0})
    p0, p1 = parts
    m1 = p1.manifest
    shared = p0.manifest.files[0]
    entry = next(e for e in p0.manifest.entries if e.path == "state['model']['w']")
    m1 = dataclasses.replace(
        m1,
        files=(*m1.files, shared),
        entries=(*m1.entries, entry),
        tree={
            "t": "dict",
            "k": [*m1.tree["k"], ["s", "extra"]],
            "v": [*m1.tree["v"], {"t": "tensor", "e": len(m1.entries)}],
        },
    )
    write_step(job_root, [p0, Part(m1, p1.shard)])
    tiercheck.load(job_root, step=STEP, rank=1)  # warm up lazy imports and thread pools
    before = _open_fds()
    for _ in range(5):
        loaded = tiercheck.load(job_root, step=STEP, rank=1)
    same(loaded["extra"], rank_state(0)["model"]["w"])
    assert _open_fds() == before


# ------------------------------------------------------------------ cost of reading


def _many_keys_parts(n: int) -> list[Part]:
    """A 2-rank step of `n` replicated top-level keys, all written by rank 0."""
    state = {f"k{i}": i for i in range(n)}
    keys = tuple(state)
    return [
        build_part(0, 2, state, replicated=keys),
        build_part(1, 2, state, replicas=dict.fromkeys(keys, 0), replicated=keys),
    ]


def _seconds(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_decoding_many_replica_nodes_costs_about_as_much_as_regular_nodes() -> None:
    owner, reader = (p.manifest_bytes for p in _many_keys_parts(12_000))
    decode_manifest(owner, "warm-up")
    decode_manifest(reader, "warm-up")
    # Best of three each: a quadratic decoder is slow every time, a GC pause only once.
    t_owner = min(_seconds(lambda: decode_manifest(owner, "owner")) for _ in range(3))
    t_reader = min(_seconds(lambda: decode_manifest(reader, "reader")) for _ in range(3))
    assert t_reader < max(0.5, 10 * t_owner), (t_reader, t_owner)


def test_reading_many_replicas_costs_about_as_much_as_reading_the_owner(job_root: Path) -> None:
    write_step(job_root, _many_keys_parts(4_000))
    tiercheck.load(job_root, rank=0)
    tiercheck.load(job_root, rank=1)
    t_owner = min(_seconds(lambda: tiercheck.load(job_root, rank=0)) for _ in range(3))
    t_reader = min(_seconds(lambda: tiercheck.load(job_root, rank=1)) for _ in range(3))  # reads both manifests
    assert t_reader < max(1.0, 20 * t_owner), (t_reader, t_owner)
