"""A third tier, written in one file (`tiercheck.testing.dicttier`), through a Checkpointer."""

from __future__ import annotations

from pathlib import Path

import torch

import tiercheck
from tiercheck.testing import DictStore, DictTier


def state(step: int) -> dict[str, object]:
    return {"w": torch.arange(1000.0) * step, "opt": {0: torch.full((7,), step, dtype=torch.int64)}, "step": step}


def test_memory_tier_alone_round_trip() -> None:
    store = DictStore()
    with tiercheck.Checkpointer(remote=DictTier(store), keep_remote=2) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, state(s)).wait()
        ckpt.wait()  # a handle is done when durable; retention runs after (DESIGN: ckpt.wait)
        assert ckpt.steps() == [2, 3]
    with tiercheck.Checkpointer(remote=DictTier(store)) as again:
        got = {"w": torch.zeros(1000), "opt": {0: torch.zeros(7, dtype=torch.int64)}, "step": None}
        assert again.restore(got) == 3
        assert torch.equal(got["w"], torch.arange(1000.0) * 3) and got["step"] == 3
    assert tiercheck.load(DictTier(store), step=2)["step"] == 2


def test_memory_tier_as_tier_2_behind_a_local_directory(tmp_path: Path) -> None:
    store = DictStore()
    with tiercheck.Checkpointer(local=tmp_path, remote=DictTier(store), keep_local=1) as ckpt:
        for s in (10, 20):
            ckpt.save(s, state(s)).wait()
        ckpt.wait()  # tier-1 retention runs after the upload that the handle waited for
        assert (ckpt.steps("local"), ckpt.steps("remote")) == ([20], [10, 20])
    # tier 1 lost: restore comes from the memory tier
    with tiercheck.Checkpointer(local=tmp_path / "fresh", remote=DictTier(store)) as ckpt:
        got = {"w": torch.zeros(1000), "opt": {0: torch.zeros(7, dtype=torch.int64)}, "step": None}
        assert ckpt.restore(got, step=10) == 10
        assert torch.equal(got["opt"][0], torch.full((7,), 10, dtype=torch.int64)) and got["step"] == 10


def test_memory_tier_as_tier_1_uploads_through_open_file(tmp_path: Path) -> None:
    # a tier 1 without local files: the uploader reads it through open_file
    store = DictStore()
    with tiercheck.Checkpointer(local=DictTier(store, name="local"), remote=tmp_path / "r") as ckpt:
        ckpt.save(5, state(5)).wait()
        assert (ckpt.steps("local"), ckpt.steps("remote")) == ([5], [5])
    assert torch.equal(tiercheck.load(tmp_path / "r")["w"], torch.arange(1000.0) * 5)
