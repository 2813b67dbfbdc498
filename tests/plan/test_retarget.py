"""tiercheck.plan.retarget: a part rewritten for tier 2, where other ranks upload replicated keys."""

from __future__ import annotations

import pytest

from tiercheck.format.manifest import Entry, Manifest, ShardFile, decode_manifest, encode_manifest
from tiercheck.plan.retarget import region_chunks, retarget

SHARD = "rank-00001-of-00002.shard"


def entry(path: str, offset: int, length: int, checksum: str = "aa") -> Entry:
    return Entry(path, "tensor", "uint8", (length,), SHARD, offset, length, checksum)


def part() -> Manifest:
    """Rank 1's tier-1 part holding its own copy of 'model' (2 tensors, one tied into
    'ema') plus a per-rank 'shard'."""
    entries = (
        entry("state['model']['w']", 0, 5000, "01"),
        entry("state['model']['b']", 8192, 10, "02"),
        entry("state['shard']", 12288, 7, "03"),
        entry("state['ema']", 0, 5000, "01"),  # tied to model.w
        entry("state['empty']", 16384, 0, "00"),
    )
    tree = {
        "t": "dict",
        "k": [["s", "model"], ["s", "shard"], ["s", "ema"], ["s", "empty"]],
        "v": [
            {"t": "dict", "k": [["s", "w"], ["s", "b"]], "v": [{"t": "tensor", "e": 0}, {"t": "tensor", "e": 1}]},
            {"t": "tensor", "e": 2},
            {"t": "tensor", "e": 3},
            {"t": "tensor", "e": 4},
        ],
    }
    return Manifest(5, 1, 2, "crc32c", (ShardFile(SHARD, 16384),), entries, tree, (("s", "model"),))


def test_a_key_uploaded_by_another_rank_becomes_a_replica_and_the_rest_is_packed() -> None:
    moved = retarget(part(), {("s", "model"): 0})
    assert moved is not None
    m = moved.manifest
    assert m.tree["v"][0] == {"t": "replica", "r": 0}
    # 'shard' and the tied 'ema' keep their bytes (and checksums); model.b is gone.
    assert [(e.path, e.offset, e.length, e.checksum) for e in m.entries] == [
        ("state['shard']", 0, 7, "03"),
        ("state['ema']", 64, 5000, "01"),  # packed: entries under 64 KiB at 64-byte boundaries
        ("state['empty']", 5120, 0, "00"),
    ]
    assert [v.get("e") for v in m.tree["v"][1:]] == [0, 1, 2]
    assert moved.regions == ((12288, 0, 7), (0, 64, 5000))
    assert moved.length == 8192 == m.files[0].length  # the file padded to 4096
    assert decode_manifest(encode_manifest(m), "x") == m  # still a valid manifest


def test_region_chunks_build_the_packed_shard() -> None:
    old = bytes(range(256)) * 64  # 16 KiB
    moved = retarget(part(), {("s", "model"): 0})
    assert moved is not None
    new = b"".join(bytes(c) for c in region_chunks(lambda o, n: old[o : o + n], moved.regions, moved.length, 1000))
    assert len(new) == moved.length
    assert new[0:7] == old[12288 : 12288 + 7] and new[64 : 64 + 5000] == old[0:5000]
    assert new[7:64] == bytes(64 - 7) and new[5064:] == bytes(8192 - 5064)


def test_unchanged_part_is_not_rewritten_and_a_missing_key_is_refused() -> None:
    assert retarget(part(), {("s", "model"): 1}) is None  # rank 1 uploads its own copy
    m = part()
    replica = dict(m.tree)
    replica["v"] = [{"t": "replica", "r": 0}, *m.tree["v"][1:]]
    moved_to_0 = Manifest(m.step, m.rank, m.world_size, m.checksum_algorithm, m.files, m.entries, replica, m.replicated)
    with pytest.raises(ValueError, match="does not"):
        retarget(moved_to_0, {("s", "model"): 1})
