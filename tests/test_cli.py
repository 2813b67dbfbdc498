"""`tiercheck ls` and `tiercheck verify` (python -m tiercheck)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck import layout
from tiercheck.__main__ import main


def test_ls_and_verify_single_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ck:
        for step in (1, 2):
            ck.save(step, {"w": torch.full((1000,), float(step)), "n": step})
    assert main(["ls", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("\t")[:3] for ln in lines] == [["1", "1 rank", "1 entries"], ["2", "1 rank", "1 entries"]]
    assert main(["verify", str(tmp_path)]) == 0
    shard = tmp_path / "step-000000000002" / layout.shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step 1: ok" in out and "step 2: FAILED" in out and "checksum mismatch" in out
    assert main(["verify", f"file://{tmp_path}", "--step", "1"]) == 0  # URLs too
