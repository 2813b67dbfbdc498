"""The writer encodes a save's manifest from each entry's text kept but its checksum, and the
tree's text kept (`entry_json_parts`, `tree_json_text`, `encode_manifest_with`): the bytes
must be `encode_manifest`'s, for every kind of entry and key (quotes, non-ASCII, a path that
spells a checksum field, a key that spells the tree field)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tiercheck.format.manifest import (
    Manifest,
    ShardFile,
    UnsupportedStateError,
    build_entries,
    encode_manifest,
    encode_manifest_with,
    entry_json_parts,
    tree_json_text,
)
from tiercheck.plan.shards import plan_shard
from tiercheck.state.flatten import flatten_state


def state() -> dict[object, object]:
    w = torch.arange(6.0).reshape(2, 3)
    return {
        "w": w,
        "tied": w,
        'quote"key': torch.zeros(3, dtype=torch.int16),
        "schlüssel ☃": np.arange(4, dtype=">i2"),
        '"checksum":"",': torch.ones(2, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "scalar": np.float64(0.5),
        "blob": b"\x00\xff",
        7: {"nested": [torch.tensor(3), 1.5, None]},
        '"tree":{}': {},
    }


@pytest.mark.parametrize("replicated", [(), (("s", "w"),)])
def test_entry_texts_give_the_bytes_of_encode_manifest(replicated: tuple[tuple[str, str], ...]) -> None:
    flat = flatten_state(state())
    plan = plan_shard(flat.leaves)
    shard = "rank-00000-of-00001.shard"
    rng = random.Random(5)
    sums = [f"{rng.getrandbits(32):08x}" for _ in flat.leaves]
    for i, leaf in enumerate(flat.leaves):
        if leaf.alias_of is not None:
            sums[i] = sums[leaf.alias_of]
    entries = build_entries(flat.leaves, plan.offsets, sums, shard)
    m = Manifest(9, 0, 1, "crc32c", (ShardFile(shard, plan.total_bytes),), entries, flat.tree, replicated)
    parts = entry_json_parts(build_entries(flat.leaves, plan.offsets, [""] * len(flat.leaves), shard))
    text = "[" + ",".join(h + s + t for (h, t), s in zip(parts, sums, strict=True)) + "]"
    assert encode_manifest_with(dataclasses.replace(m, entries=()), text) == encode_manifest(m)
    tree = tree_json_text(m.tree)
    assert encode_manifest_with(dataclasses.replace(m, entries=()), text, tree) == encode_manifest(m)
    stored = dataclasses.replace(m, files=(ShardFile(shard, plan.total_bytes, "zstd", 17),))  # a tier-2 codec
    assert encode_manifest_with(dataclasses.replace(stored, entries=()), text, tree) == encode_manifest(stored)


def test_encode_manifest_with_keeps_the_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiercheck.format import manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 300)
    m = Manifest(1, 0, 1, "crc32c", (ShardFile("rank-00000-of-00001.shard", 0),), (), {"t": "dict", "k": [], "v": []})
    with pytest.raises(UnsupportedStateError, match="limit"):
        encode_manifest_with(m, "[" + ",".join(["{}"] * 200) + "]")


def test_a_changed_value_reaches_the_manifest_of_the_next_save(tmp_path: Path) -> None:
    """The writer keeps the tree's text while the structure cache gives the same tree: a
    changed plain value (a new tree) is written, an unchanged state writes the same bytes."""
    import tiercheck
    from tiercheck.format import naming

    state: dict[str, object] = {"w": torch.arange(4.0), "lr": 0.5, "n": 1}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, run_log_interval=None) as ckpt:
        for step, n in [(1, 1), (2, 2), (3, 2), (4, 7)]:
            state["n"] = n
            ckpt.save(step, state).wait()
    for step, n in [(1, 1), (2, 2), (3, 2), (4, 7)]:
        assert tiercheck.load(tmp_path, step=step)["n"] == n
    manifests = [(tmp_path / naming.step_dir_name(s) / naming.manifest_name(0, 1)).read_bytes() for s in (2, 3)]
    assert manifests[0].replace(b'"step":2', b'"step":3') == manifests[1]
