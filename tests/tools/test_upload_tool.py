"""`tiercheck upload LOCAL REMOTE`: the tier-1 steps tier 2 lacks, copied with every byte
checked, marker last; against memory:// and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.helpers.assertions import same
from tiercheck.__main__ import main
from tiercheck.format import naming
from tiercheck.tiers.remote import RemoteTier
from tiercheck.tools import upload_steps

STEPS = (100, 200, 300)


def state_at(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).bfloat16()},
        "tied": None,
        "step": step,
        "blob": bytes(range(7)),
    }


@pytest.fixture
def tier1(tmp_path: Path) -> Path:
    root = tmp_path / "tier1"
    with tiercheck.Checkpointer(local=root, keep_local=None, run_log_interval=None) as ck:
        for s in STEPS:
            ck.save(s, state_at(s))
    return root


@pytest.fixture(params=["memory", "s3"])
def tier2(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(url, storage_options) of an empty tier-2 location."""
    if request.param == "memory":
        return f"memory://upload-{secrets.token_hex(6)}", {}
    server = request.getfixturevalue("seaweedfs_healthy")
    return server.unique_url("upload"), dict(server.storage_options)


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_upload_copies_once_and_the_copy_restores_from_tier_2_alone(
    tier1: Path, tier2: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, opts = tier2
    opt_args = ["--storage-options", json.dumps(opts)] if opts else []
    code, out, _ = cli(["upload", str(tier1), url, "--step", "200", "--json", *opt_args], capsys)
    assert code == 0
    assert json.loads(out)["copied"] == [200]
    code, out, _ = cli(["upload", str(tier1), url, "--json", *opt_args], capsys)
    assert code == 0
    doc = json.loads(out)
    assert (doc["copied"], doc["present"]) == ([100, 300], [200])
    assert doc["bytes"] > 0
    # Idempotent: a second run finds every step there and copies nothing.
    code, out, _ = cli(["upload", str(tier1), url, "--json", *opt_args], capsys)
    assert code == 0
    doc = json.loads(out)
    assert (doc["copied"], doc["present"], doc["bytes"]) == ([], [100, 200, 300], 0)
    remote = RemoteTier(url, opts)
    assert remote.committed_steps() == [100, 200, 300] and remote.stray_steps() == []
    # The same bytes on both tiers: marker, manifest, shard.
    for name in (naming.COMMIT_NAME, naming.manifest_name(0, 1), naming.shard_name(0, 1)):
        local_bytes = (tier1 / naming.step_dir_name(300) / name).read_bytes()
        assert remote.read_bytes(300, name, 1 << 30) == local_bytes, name
    # Restored from tier 2 alone, bit-exact.
    template = {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(64, dtype=torch.bfloat16)}}
    with tiercheck.Checkpointer(remote=url, storage_options=opts) as ck:
        assert ck.restore(template, strict=False) == 300
    same(template["model"], state_at(300)["model"])
    same(tiercheck.load(url, 100, storage_options=opts), state_at(100))


def test_upload_refuses_a_damaged_step_and_leaves_nothing_of_it(
    tier1: Path, tier2: tuple[str, dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, opts = tier2
    shard = tier1 / naming.step_dir_name(200) / naming.shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[5000] ^= 0x01  # inside model.w, the first entry
    shard.write_bytes(bytes(data))
    argv = ["upload", str(tier1), url] + (["--storage-options", json.dumps(opts)] if opts else [])
    code, _, err = cli(argv, capsys)
    assert code == 1
    assert "step 200" in err and str(shard) in err and "checksum mismatch" in err
    remote = RemoteTier(url, opts)
    assert remote.committed_steps() == [100]  # the steps before it were copied; none after
    assert remote.stray_steps() == []  # nothing of step 200 was left behind
    assert not remote.fs.exists(remote.path_of(200, naming.shard_name(0, 1)))


def test_upload_progress_counts_every_byte_and_a_missing_step_is_exit_2(
    tier1: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[int, int]] = []
    dest = tmp_path / "tier2"
    result = upload_steps(tier1, f"file://{dest}", progress=lambda d, t: calls.append((d, t)))
    assert result.copied == STEPS
    expected = sum(
        os.path.getsize(tier1 / naming.step_dir_name(s) / n)
        for s in STEPS
        for n in os.listdir(tier1 / naming.step_dir_name(s))
    )
    assert result.bytes == expected
    assert calls[-1] == (expected, expected)
    assert all(d1 <= d2 for (d1, _), (d2, _) in itertools.pairwise(calls))
    code, _, err = cli(["upload", str(tier1), f"file://{dest}", "--step", "250"], capsys)
    assert code == 2 and "step 250" in err
