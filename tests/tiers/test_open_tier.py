"""`open_tier` and tiers passed in as objects (`local=`/`remote=` take a `Tier`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.errors import InvalidArgumentError
from tiercheck.tiers import LocalTier, RemoteTier, open_tier


def test_locations_by_role(tmp_path: Path) -> None:
    local = open_tier(tmp_path / "a", role="local", fsync=False)
    assert isinstance(local, LocalTier)
    assert (local.name, local.root, local.fsync) == ("local", str(tmp_path / "a"), False)
    from_url = open_tier(f"file://{tmp_path}/b", role="local")
    assert isinstance(from_url, LocalTier) and from_url.root == str(tmp_path / "b")
    # a plain path as tier 2 is the local filesystem through fsspec, as remote="/path" always was
    remote = open_tier(tmp_path / "c", role="remote", concurrency=3)
    assert isinstance(remote, RemoteTier) and (remote.name, remote.location, remote.concurrency) == (
        "remote",
        str(tmp_path / "c"),
        3,
    )
    # readers: a path is a directory, a URL a remote tier
    assert isinstance(open_tier(str(tmp_path)), LocalTier)
    mem = open_tier("memory://open-tier/run")
    assert isinstance(mem, RemoteTier) and mem.name == "remote"


def test_bad_locations_and_options(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="remote="):
        open_tier("s3://bucket/run", role="local")
    with pytest.raises(InvalidArgumentError, match="role"):
        open_tier(tmp_path, role="fast")
    with pytest.raises(InvalidArgumentError, match="compression"):
        open_tier(tmp_path, role="local", compression="zstd")


def test_a_tier_object_is_used_as_it_is(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path, fsync=False)
    assert open_tier(tier, role="local") is tier
    with pytest.raises(InvalidArgumentError, match="named 'remote'"):
        open_tier(tier, role="remote")
    with pytest.raises(InvalidArgumentError, match="fsync"):
        open_tier(tier, role="local", fsync=True)
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        open_tier(tier, storage_options={"anon": True})


def test_checkpointer_takes_tier_objects(tmp_path: Path) -> None:
    local = LocalTier(tmp_path / "l", fsync=False)
    remote = RemoteTier(tmp_path / "r", concurrency=2)
    state = {"w": torch.arange(10.0)}
    with tiercheck.Checkpointer(local=local, remote=remote) as ckpt:
        ckpt.save(1, state).wait()
        assert (ckpt.steps("local"), ckpt.steps("remote")) == ([1], [1])
    assert (local.committed_steps(), remote.committed_steps()) == ([1], [1])
    assert sorted(os.listdir(tmp_path / "r")) == ["step-000000000001"]
    assert torch.equal(tiercheck.load(remote)["w"], state["w"])
    assert torch.equal(tiercheck.load(LocalTier(tmp_path / "l"))["w"], state["w"])


def test_checkpointer_refuses_options_a_tier_object_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="direct_io"):
        tiercheck.Checkpointer(local=LocalTier(tmp_path), direct_io=False)
    with pytest.raises(InvalidArgumentError, match="remote_concurrency, storage_options"):
        tiercheck.Checkpointer(remote=RemoteTier(tmp_path), remote_concurrency=2, storage_options={"x": 1})
    with pytest.raises(InvalidArgumentError, match="named 'local'"):
        tiercheck.Checkpointer(local=RemoteTier(tmp_path))
    # options of the other tier's role are fine
    with tiercheck.Checkpointer(local=LocalTier(tmp_path / "l"), remote=tmp_path / "r", remote_concurrency=2) as ckpt:
        ckpt.save(3, {"x": 1}).wait()
        assert ckpt.steps("remote") == [3]
