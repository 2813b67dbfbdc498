"""`tiercheck export` and `inspect` of DTensor state saved by 4 real ranks (gloo on CPU,
`distribute_tensor`): every format holds the whole tensors, bit-identical to the global
tensors that were distributed, assembled from every saved rank's pieces with every block
verified; a damaged block of another rank's piece is refused and leaves nothing at the
destination; inspect shows the global shape and the mesh and placements."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import tiercheck
from tests.helpers.reshard_worker import bits, global_tensors
from tests.procs.test_reshard import SAVE_4, SAVE_2x2, run
from tiercheck.__main__ import main
from tiercheck.format import naming
from tiercheck.tools import export_step
from tiercheck.tools import view as view_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved4")
    assert all(r["ok"] for r in run("save", 4, root, SAVE_4))
    return root


@pytest.fixture(scope="module")
def saved_at_2x2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("saved2x2")
    assert all(r["ok"] for r in run("save", 4, root, SAVE_2x2))
    return root


def _exported(fmt: str, dest: Path) -> dict[str, torch.Tensor]:
    """The tensors of an export, read by each format's own reader."""
    if fmt == "pt":
        return dict(torch.load(dest, weights_only=True)["model"])
    if fmt == "safetensors":
        from safetensors.torch import load_file

        return {k.removeprefix("model."): v for k, v in load_file(dest).items()}
    import torch.distributed.checkpoint as dcp

    template = {"model": {k: torch.zeros_like(v) for k, v in global_tensors().items()}, "step": 0}
    dcp.load(template, checkpoint_id=str(dest), no_dist=True)
    assert template["step"] == 7
    return template["model"]


@pytest.mark.parametrize("layout", ["1d-4", "2x2"])
@pytest.mark.parametrize("fmt", ["pt", "safetensors", "dcp"])
@pytest.mark.parametrize("rank", [0, 3])
def test_export_writes_whole_tensors(
    saved_at_4: Path, saved_at_2x2: Path, tmp_path: Path, fmt: str, rank: int, layout: str
) -> None:
    root = saved_at_4 if layout == "1d-4" else saved_at_2x2
    dest = tmp_path / ("out.pt" if fmt == "pt" else "out.safetensors" if fmt == "safetensors" else "out.dcp")
    result = export_step(root / "ckpt", dest, rank=rank)
    got = _exported(fmt, dest)
    want = global_tensors()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and tuple(got[k].shape) == tuple(v.shape), k
        assert torch.equal(bits(got[k]), bits(v)), k
    whole = sum(v.numel() * v.element_size() for v in want.values())
    assert result.bytes >= whole


def test_export_streams_in_row_bands_through_a_small_buffer(
    saved_at_2x2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bands of a few rows, each split across blocks and pieces (S0 x S1 on a 2x2 mesh):
    every band is planned, read and verified on its own; the bytes are still exact."""
    monkeypatch.setattr(view_module, "CHUNK", 3 * 4000 + 8)  # 3 rows of `big` per band
    for fmt, name in (("pt", "o.pt"), ("safetensors", "o.safetensors")):
        export_step(saved_at_2x2 / "ckpt", tmp_path / name, rank=1)
        got = _exported(fmt, tmp_path / name)
        for k, v in global_tensors().items():
            assert torch.equal(bits(got[k]), bits(v)), (fmt, k)


def _damage_rank3_big(root: Path) -> None:
    step = root / "ckpt" / naming.step_dir_name(3)
    shard = step / naming.shard_name(3, 4)
    manifest = json.loads((step / naming.manifest_name(3, 4)).read_text())
    big = next(e for e in manifest["entries"] if e["path"].endswith("['big']"))
    data = bytearray(shard.read_bytes())
    data[big["offset"] + big["length"] - 3] ^= 0x40  # the last block of rank 3's piece
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("suffix", ["o.pt", "o.safetensors", "o.dcp/"])
def test_a_damaged_block_of_another_ranks_piece_is_refused(
    saved_at_4: Path, tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved_at_4, root, symlinks=True)
    _damage_rank3_big(root)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(tiercheck.CheckpointCorruptedError, match=r"block \d+ of this piece"):
        export_step(root / "ckpt", out / suffix, rank=0)
    assert list(out.iterdir()) == []
    code = main(["export", str(root / "ckpt"), "--to", str(out / suffix)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "saved rank 3" in err and "checksum mismatch in block" in err
    assert list(out.iterdir()) == []


def test_inspect_shows_the_global_shape_and_the_layout(saved_at_4: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved_at_4 / "ckpt"), "--rank", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    nodes = {tuple(n["path"]): n for n in doc["nodes"]}
    w = nodes[("model", "w")]
    assert w["shape"] == [10, 12] and w["bytes"] == 10 * 12 * 4
    assert w["dtensor"]["mesh"] == [4] and w["dtensor"]["placements"] == ["S0"]
    assert w["dtensor"]["piece_shape"] == [1, 12] and w["dtensor"]["offsets"] == [9, 0]  # 3, 3, 3, 1 rows
    v = nodes[("model", "v")]
    assert v["shape"] == [7, 9] and v["dtensor"]["placements"] == ["S1"] and v["dtensor"]["piece_shape"] == [7, 0]
    b = nodes[("model", "b")]  # replicated: the piece is the whole tensor
    assert b["shape"] == [5] and b["dtensor"]["piece_shape"] == [5]
    assert main(["inspect", str(saved_at_4 / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert "tensor float32 [10, 12]" in text and "DTensor: mesh 4 [S0]; this rank's piece [3, 12] at [0, 0]" in text


def test_a_tier_without_every_ranks_part_cannot_assemble(saved_at_4: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved_at_4, root, symlinks=True)
    (root / "ckpt" / naming.step_dir_name(3) / naming.manifest_name(2, 4)).unlink()
    with pytest.raises(tiercheck.CheckpointCorruptedError, match="rank 2's part"):
        export_step(root / "ckpt", tmp_path / "o.pt", rank=0)
    assert not (tmp_path / "o.pt").exists()


def test_bands_never_read_behind_a_compressed_shards_position(
    saved_at_2x2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a zstd tier 2, a band that starts inside the block the previous band ended in
    takes that block from memory: no shard is decompressed again from its start."""
    from tiercheck.tiers import codec
    from tiercheck.tiers.local import LocalTier
    from tiercheck.tiers.remote import RemoteTier
    from tiercheck.tools.upload import upload_tier_steps

    remote = tmp_path / "zstd"
    upload_tier_steps(LocalTier(saved_at_2x2 / "ckpt"), RemoteTier(str(remote), compression="zstd"))
    rewinds = {"opened": 0, "again": 0}
    original = codec.ZstdFile._rewind

    def counted(self: codec.ZstdFile) -> None:
        rewinds["again" if hasattr(self, "_reader") else "opened"] += 1
        original(self)

    monkeypatch.setattr(codec.ZstdFile, "_rewind", counted)
    monkeypatch.setattr(view_module, "CHUNK", 3 * 4000 + 8)  # 3 rows of `big` per band
    export_step(remote, tmp_path / "o.pt", rank=2)
    assert rewinds["opened"] == 4 and rewinds["again"] == 0, rewinds
    got = _exported("pt", tmp_path / "o.pt")
    for k, v in global_tensors().items():
        assert torch.equal(bits(got[k]), bits(v)), k
