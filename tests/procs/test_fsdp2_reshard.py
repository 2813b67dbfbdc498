"""FSDP2 + Adam saved by 4 real ranks (gloo on CPU, `fully_shard`) and restored at 2 (issue
27 item 5): (a) with tiercheck into a fresh FSDP2 model and Adam, (b) with `dcp.load` from
`tiercheck export --format dcp` into another, through `get_state_dict`/`set_state_dict`.
Both hold exactly the trained parameters and Adam states (exp_avg, exp_avg_sq, step) that
were saved, and (a) trains on. State is compared, never the loss (FSDP2's gradient averaging
over gloo has been wrong in some torch versions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tiercheck.__main__ import main

REPO = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).resolve().parents[1] / "helpers" / "fsdp2_worker.py")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` (0-d included): equal only when every bit is."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def run(mode: str, world: int, root: Path) -> list[dict]:
    run_ranks(WORKER, world, lambda r, port: [mode, str(r), str(world), str(port), str(root)])
    got = [json.loads((root / f"result-{mode}-{r}.json").read_text()) for r in range(world)]
    assert all(g.get("ok") for g in got), [g.get("trace", g) for g in got]
    return got


def test_fsdp2_adam_saved_at_4_restores_at_2_with_tiercheck_and_through_a_dcp_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run("save", 4, tmp_path)
    dest = str(tmp_path / "export.dcp") + "/"
    assert main(["export", str(tmp_path / "ckpt"), "--to", dest, "--format", "dcp"]) == 0, capsys.readouterr()
    got = run("restore", 2, tmp_path)
    assert all(g["restored_step"] == 3 and g["plain_step"] == 3 and g["sharded"] for g in got), got
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    restored = torch.load(tmp_path / "restored.pt", weights_only=True)
    loaded = torch.load(tmp_path / "dcp.pt", weights_only=True)
    names = sorted(saved)
    assert names == sorted(restored) == sorted(loaded)
    # 4 parameters, each with Adam's step, exp_avg and exp_avg_sq
    assert len([n for n in names if n.startswith("param.")]) == 4 and len(names) == 16, names
    for n in names:
        assert saved[n].dtype == restored[n].dtype == loaded[n].dtype, n
        assert torch.equal(bits(restored[n]), bits(saved[n])), n
        assert torch.equal(bits(loaded[n]), bits(restored[n])), n
    assert float(saved["state.0.weight.step"]) == 3.0
    # (a) trains on: one more step moves every parameter, and Adam counts it
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    for n in names:
        if n.startswith("param."):
            assert not torch.equal(trained[n], restored[n]) and bool(trained[n].isfinite().all()), n
    assert float(trained["state.0.weight.step"]) == 4.0
