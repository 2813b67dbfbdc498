"""One write path (issue 24 item 3): every writer of a part (the engine's writer and
uploader, `tiercheck upload`, `tiercheck import`) builds its manifest with the one builder
(`plan/stepdoc.py`) and ends with the same manifest-then-marker sequence
(`steps/write.py`); the two uploaders store a shard by one rule."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.format.test_replica_format import STEP, rank_state, two_rank_parts
from tests.format.test_replica_format import write_step as write_parts
from tiercheck.format import naming
from tiercheck.job.coordination import Solo
from tiercheck.state.flatten import flatten_state
from tiercheck.steps.catalog import read_manifest, read_marker
from tiercheck.steps.upload import copy_from_local
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import RemoteTier
from tiercheck.tools.step_writer import memory_chunks, write_step
from tiercheck.tools.upload import upload_tier_steps

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

PACKAGE = Path(__file__).resolve().parents[2] / "tiercheck"


def _calls(path: Path, names: set[str]) -> list[str]:
    """Calls in the module at `path` of a function or method named in `names`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in names:
                out.append(f"{name}( at line {node.lineno}")
    return out


def _modules_calling(names: set[str], allowed: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        calls = _calls(path, names)
        if calls and not rel.startswith(allowed):
            found[rel] = calls
    return found


def test_only_the_builder_constructs_a_manifest() -> None:
    # format/manifest.py's decoder makes one from bytes; every written one is the builder's.
    builders = _modules_calling({"Manifest"}, ("format/manifest.py",))
    assert list(builders) == ["plan/stepdoc.py"], builders


def test_only_the_write_path_writes_manifests_and_markers() -> None:
    # The format encodes; job/ holds the commit protocols (the marker alone, the vote);
    # tiers/ and testing/ implement and test the tier calls. Everything else ends a part
    # through steps/write.py.
    allowed = ("format/manifest.py", "job/", "tiers/", "testing/")
    writers = _modules_calling({"encode_manifest", "encode_marker", "write_marker", "publish_part"}, allowed)
    assert list(writers) == ["steps/write.py"], writers


STATE: dict[str, Any] = {
    "model": {"w": torch.arange(30000, dtype=torch.float32).reshape(300, 100), "b": torch.ones(7)},
    "step": 9,
    "blob": b"\x00\x01payload",
}


def _compressed_step(root: Path, step: int) -> None:
    """`STATE` as a compressing tier 2 stores it, written by `tiercheck import`'s writer."""
    flat = flatten_state(STATE)
    write_step(RemoteTier(str(root), compression="zstd"), step, flat, lambda i: memory_chunks(flat.sources[i]))


def _same(loaded: dict[str, Any]) -> None:
    assert torch.equal(loaded["model"]["w"], STATE["model"]["w"])
    assert torch.equal(loaded["model"]["b"], STATE["model"]["b"])
    assert (loaded["step"], loaded["blob"]) == (STATE["step"], STATE["blob"])


def _codecs(tier: Tier, step: int) -> list[str]:
    return [f.codec for f in read_manifest(tier, step, 0).files]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_both_uploaders_copy_a_compressed_tier_1_step_as_tier_2_stores_shards(
    tmp_path: Path, compression: str | None
) -> None:
    # A tier-2 step copied into tier 1 by hand (the layout is one on every tier): its shard
    # is compressed. Both uploaders read it through the opener and store it as the
    # destination stores shards. (Before, `tiercheck upload` refused it, and the engine's
    # uploader copied the compressed bytes and compressed them again for a compressing
    # tier 2, under a manifest declaring one compression: a copy no reader could verify.)
    src = tmp_path / "tier1"
    _compressed_step(src, 5)
    want = "raw" if compression is None else "zstd"
    engine_dst = RemoteTier(str(tmp_path / "engine"), compression=compression)
    copy_from_local(LocalTier(src), engine_dst, 5, 0, {}, Solo(), lambda: None)
    tool_dst = RemoteTier(str(tmp_path / "tool"), compression=compression)
    result = upload_tier_steps(LocalTier(src), tool_dst, step=5)
    assert result.copied == (5,)
    for dst in (engine_dst, tool_dst):
        assert dst.committed_steps() == [5] and dst.stray_steps() == []
        assert _codecs(dst, 5) == [want]
        _same(tiercheck.load(dst, 5))
    same_bytes = [
        naming.COMMIT_NAME,
        naming.manifest_name(0, 1),
        naming.shard_name(0, 1),
    ]
    for name in same_bytes:  # one rule, one result
        assert engine_dst.read_bytes(5, name, 1 << 30) == tool_dst.read_bytes(5, name, 1 << 30), name


def test_upload_of_a_raw_two_rank_step_keeps_every_byte(tmp_path: Path) -> None:
    # The tool writes the parts through the writer's own end of a part (`write_manifest`,
    # `commit_parts`): unchanged manifests are kept byte for byte, and the marker, encoded
    # again over the same references, is the source's.
    src = tmp_path / "tier1"
    step_dir = write_parts(src, two_rank_parts({"model": 0, "optimizer": 1}))
    dst = RemoteTier(str(tmp_path / "tier2"))
    assert upload_tier_steps(LocalTier(src), dst).copied == (STEP,)
    for p in sorted(step_dir.iterdir()):
        assert dst.read_bytes(STEP, p.name, 1 << 30) == p.read_bytes(), p.name
    assert read_marker(dst, STEP).world_size == 2 and dst.stray_steps() == []
    for rank in range(2):
        loaded = tiercheck.load(dst, STEP, rank=rank)
        assert torch.equal(loaded["shard"], rank_state(rank)["shard"]) and loaded["position"] == 1000 + rank


def test_import_writes_what_the_builder_builds(tmp_path: Path) -> None:
    # `tiercheck import`'s writer and the engine's writer share the builder and the end of
    # a part: a raw import's manifest is the builder's, encoded, byte for byte.
    from tiercheck.format.manifest import encode_manifest
    from tiercheck.plan.shards import plan_shard
    from tiercheck.plan.stepdoc import shard_manifest, with_alias_sums

    flat = flatten_state(STATE)
    tier = LocalTier(tmp_path / "c")
    write_step(tier, 3, flat, lambda i: memory_chunks(flat.sources[i]))
    got = read_manifest(tier, 3, 0)
    plan = plan_shard(flat.leaves)
    built = shard_manifest(
        step=3,
        rank=0,
        world_size=1,
        checksum_algorithm="crc32c",
        leaves=flat.leaves,
        plan=plan,
        sums=with_alias_sums(flat.leaves, [e.checksum for e in got.entries]),
        tree=flat.tree,
    )
    on_disk = (tmp_path / "c" / naming.step_dir_name(3) / naming.manifest_name(0, 1)).read_bytes()
    assert encode_manifest(built) == on_disk
    _same(tiercheck.load(tmp_path / "c", 3))
