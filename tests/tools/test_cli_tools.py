"""`tiercheck inspect/export/import/prune/rm` and progress: checked against each format's own
reader (safetensors, torch.load(weights_only=True), torch.distributed.checkpoint)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers.assertions import same
from tiercheck.__main__ import main
from tiercheck.errors import CheckpointCorruptedError, DirectoryInUseError, UnsupportedStateError
from tiercheck.format import naming
from tiercheck.observe.progress import terminal_bar
from tiercheck.steps.catalog import read_manifest, verify_files
from tiercheck.tiers.local import LocalTier
from tiercheck.tools import export_step, import_step, prune_steps, remove_step
from tiercheck.tools.prune import writers_excluded

safetensors_torch = pytest.importorskip("safetensors.torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
]  # fmt: skip


def raw_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes viewed as `dtype`: every bit pattern (NaN payloads too) must survive."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return model, opt


def rich_state() -> dict[Any, Any]:
    model, opt = model_and_optimizer()
    return {
        "model": model,
        "optimizer": opt,
        "dtypes": {str(d).removeprefix("torch."): raw_tensor(d, (3, 5), i) for i, d in enumerate(DTYPES)},
        "scalar0d": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "tied": model[0].weight,
        "pair": (torch.arange(4), 7),
        "history": [torch.ones(2), {"inner": torch.zeros(3, dtype=torch.int16)}],
        "step": 10,
        "big": 2**100,
        "neg_zero": -0.0,
        "name": "run7",
        "nothing": None,
        "flag": True,
        "blob": b"\x00\x01xyz",
        "arr": np.arange(6, dtype=np.uint32).reshape(2, 3),
        "arr_be": np.arange(4, dtype=">f4"),
        "npf": np.float64(1.5),
        3: "int key",
    }


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with tiercheck.Checkpointer(local=root, keep_local=None) as ck:
        ck.save(10, rich_state())
    return root


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def flat_tensors(value: object, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(flat_tensors(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def as_plain(value: object) -> object:
    """What the .pt and DCP exports hold: tiercheck.load's value with numpy made tensors."""
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(as_plain(v) for v in value)
    if isinstance(value, (np.ndarray, np.generic)):
        arr = np.asarray(value)
        return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("="), copy=True))
    return value


def zeros_like_state(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeros_like_state(v) for k, v in value.items()}
    if isinstance(value, list):
        return [zeros_like_state(v) for v in value]
    return value


# ----------------------------------------------------------------------------- inspect


def test_inspect_reads_the_manifest_alone(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["inspect", str(saved), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    loaded = tiercheck.load(saved)
    leaves = {tuple(n["path"]): n for n in doc["nodes"] if "dtype" in n}
    expected = flat_tensors(loaded)
    tensor_leaves = {".".join(map(str, p)): n for p, n in leaves.items() if n["kind"] == "tensor"}
    assert set(tensor_leaves) == set(expected)
    for name, t in expected.items():
        n = tensor_leaves[name]
        assert (n["dtype"], n["shape"], n["bytes"]) == (str(t.dtype).removeprefix("torch."), list(t.shape), t.nbytes)
    plain = {tuple(n["path"]): n["value"] for n in doc["nodes"] if "value" in n}
    assert plain[("step",)] == 10 and plain[("big",)] == 2**100 and plain[(3,)] == "int key"
    assert plain[("name",)] == "run7" and plain[("nothing",)] is None
    assert leaves[("tied",)]["alias_of"] == ["model", "0.weight"]
    by_key = {k["key"]: k for k in doc["keys"]}
    assert by_key["dtypes"]["bytes"] == sum(t.nbytes for t in loaded["dtypes"].values())
    assert by_key["dtypes"]["leaves"] == len(DTYPES)
    assert doc["step"] == 10 and doc["metrics"] is None
    assert doc["tiers"] == [{"name": "local", "location": str(saved), "committed": True}]

    # No tensor byte is read: with the shard gone, inspect still answers the same.
    shard = saved / naming.step_dir_name(10) / naming.shard_name(0, 1)
    shard.unlink()
    code, out2, _ = run_cli(["inspect", str(saved), "--json"], capsys)
    assert code == 0 and json.loads(out2) == doc

    code, text, _ = run_cli(["inspect", str(saved)], capsys)
    assert code == 0
    assert "bfloat16 [3, 5]" in text and "step" in text and "= 10" in text
    assert "(same bytes as model.0.weight)" in text


def test_inspect_several_tiers_and_errors(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    with tiercheck.Checkpointer(local=other, keep_local=None) as ck:
        ck.save(20, {"w": torch.ones(3)})
    code, out, _ = run_cli(["inspect", str(saved), str(other), "--json"], capsys)
    doc = json.loads(out)
    assert code == 0 and doc["step"] == 20 and doc["location"] == str(other)
    assert [t["committed"] for t in doc["tiers"]] == [False, True]
    code, out, err = run_cli(["inspect", str(saved), "--step", "5", "--json"], capsys)
    assert code == 2 and json.loads(out)["error"]["type"] == "NoCheckpointError"
    assert err.startswith("tiercheck: inspect: ") and err.count("\n") == 1
    # A manifest that fails its checksum is damage: exit 1.
    manifest = saved / naming.step_dir_name(10) / naming.manifest_name(0, 1)
    manifest.write_bytes(manifest.read_bytes().replace(b'"run7"', b'"run8"'))
    code, _, err = run_cli(["inspect", str(saved), "--step", "10"], capsys)
    assert code == 1 and "checksum" in err


# ----------------------------------------------------------------------------- export


def test_export_safetensors_matches_the_safetensors_reader(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors import safe_open

    dest = tmp_path / "all.safetensors"
    code, out, _ = run_cli(["export", str(saved), "--to", str(dest), "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    got = safetensors_torch.load_file(str(dest))
    expected = flat_tensors(tiercheck.load(saved))
    assert set(got) == set(expected)
    for name, t in expected.items():
        same(got[name], t, name)
    assert doc["tensors"] == len(expected) and "step" in doc["skipped"] and "arr" in doc["skipped"]
    with safe_open(str(dest), "pt") as f:
        assert f.metadata() == {"format": "pt", "tiercheck_step": "10"}

    # Just the model, named as model.state_dict() names it: loads straight into a model.
    model_file = tmp_path / "model.safetensors"
    assert main(["export", str(saved), "--step", "10", "--to", str(model_file), "--prefix", "model"]) == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh.load_state_dict(safetensors_torch.load_file(str(model_file)))
    same(dict(fresh.state_dict()), dict(model_and_optimizer()[0].state_dict()))


def test_export_safetensors_refuses_dtypes_it_cannot_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "c"
    with tiercheck.Checkpointer(local=root) as ck:
        ck.save(1, {"ok": torch.ones(2), "z": {"c": torch.zeros(2, dtype=torch.complex128)}})
    dest = tmp_path / "x.safetensors"
    with pytest.raises(UnsupportedStateError, match=r"z\.c: safetensors has no dtype for complex128"):
        export_step(root, dest)
    assert not dest.exists()
    code, _, _ = run_cli(["export", str(root), "--to", str(dest)], capsys)
    assert code == 2
    assert export_step(root, dest, prefix="ok").tensors == 1


def test_export_pt_matches_torch_load_weights_only(saved: Path, tmp_path: Path) -> None:
    dest = tmp_path / "state.pt"
    result = export_step(saved, dest)
    got = torch.load(dest, weights_only=True)
    same(got, as_plain(tiercheck.load(saved)))
    assert got["tied"].data_ptr() == got["model"]["0.weight"].data_ptr()  # tied stays tied
    assert sorted(map(list, result.converted)) == [["arr"], ["arr_be"], ["npf"]]
    with zipfile.ZipFile(dest) as z:
        assert z.testzip() is None  # every record's CRC-32 is right
    # A prefix exports one subtree; a whole tensor too.
    model_pt = tmp_path / "model.pt"
    export_step(saved, model_pt, prefix="model")
    same(torch.load(model_pt, weights_only=True), tiercheck.load(saved)["model"])
    one = tmp_path / "one.pt"
    export_step(saved, one, prefix="dtypes.bfloat16")
    same(torch.load(one, weights_only=True), tiercheck.load(saved)["dtypes"]["bfloat16"])


def test_export_dcp_matches_dcp_load(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "dcp_out"
    code, _, _ = run_cli(["export", str(saved), "--to", f"{dest}/"], capsys)
    assert code == 0
    expected = as_plain(tiercheck.load(saved))
    assert isinstance(expected, dict)
    expected["3"] = expected.pop(3)  # DCP names keys by str(key); its load cannot sort mixed int/str keys
    template = zeros_like_state(expected)
    assert isinstance(template, dict)
    template["step"] = template["name"] = None  # non-tensor values come from the checkpoint
    dcp.load(template, checkpoint_id=str(dest), no_dist=True)
    same(template, expected)


def test_export_of_damaged_bytes_leaves_nothing(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shard = saved / naming.step_dir_name(10) / naming.shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0x40  # the first tensor's first byte
    shard.write_bytes(bytes(data))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for dest in ("x.safetensors", "x.pt", "x_dcp/"):
        code, _, err = run_cli(["export", str(saved), "--to", f"{out_dir}/{dest}"], capsys)
        assert code == 1 and "checksum mismatch" in err, (dest, err)
    assert os.listdir(out_dir) == []  # no file, no temp file


def test_export_destination_rules(saved: Path, tmp_path: Path) -> None:
    dest = tmp_path / "x.pt"
    dest.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        export_step(saved, dest)
    assert dest.read_bytes() == b"keep me"
    export_step(saved, dest, overwrite=True)
    assert torch.load(dest, weights_only=True)["step"] == 10
    with pytest.raises(ValueError, match="cannot tell the format"):
        export_step(saved, tmp_path / "x.bin")
    not_dcp = tmp_path / "mine"
    not_dcp.mkdir()
    (not_dcp / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError):
        export_step(saved, not_dcp, format="dcp", overwrite=True)
    assert (not_dcp / "notes.txt").read_text() == "x"


# ----------------------------------------------------------------------------- import


def torch_save_state() -> dict[str, Any]:
    model, opt = model_and_optimizer()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1200,
        "rng": torch.get_rng_state(),
        "extra": {"bf16": raw_tensor(torch.bfloat16, (4,), 1), "u64": raw_tensor(torch.uint64, (3,), 2)},
        "history": [1.5, -0.0, float("inf")],
        "pair": (3, "x"),
    }


@pytest.mark.parametrize("zip_format", [True, False])
def test_import_torch_save_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str], zip_format: bool) -> None:
    src = tmp_path / "last.pt"
    original = torch_save_state()
    if not zip_format:  # torch 2.13 cannot load uint64 from its own legacy format
        del original["extra"]["u64"]
    torch.save(original, src, _use_new_zipfile_serialization=zip_format)
    root = tmp_path / "ckpt"
    code, out, _ = run_cli(["import", str(src), str(root), "--step", "1200", "--json"], capsys)
    assert code == 0 and json.loads(out)["format"] == "pt"
    reference = torch.load(src, weights_only=True)
    same(tiercheck.load(root, 1200), {k: dict(v) if k == "model" else v for k, v in reference.items()})
    # The run switches to tiercheck and resumes: a fresh model and optimizer restore exactly.
    model, opt = model_and_optimizer()
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    with tiercheck.Checkpointer(local=root) as ck:
        assert ck.restore(state, strict=False) == 1200
    same(dict(fresh.state_dict()), dict(model.state_dict()))
    same(fresh_opt.state_dict()["state"], opt.state_dict()["state"])
    assert state["step"] == 1200
    # Exported back to .pt: what torch.load reads is what was imported.
    back = tmp_path / "back.pt"
    export_step(root, back)
    same(torch.load(back, weights_only=True), tiercheck.load(root))


def test_import_safetensors_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = {f"layer.{i}.{d}": raw_tensor(getattr(torch, d), (2, 3), i) for i, d in enumerate(
        ["float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "uint16", "bool", "complex64"])}  # fmt: skip
    tensors["scalar"] = torch.tensor(3.0)
    src = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, str(src))
    root = tmp_path / "ckpt"
    code, _, _ = run_cli(["import", str(src), str(root), "--step", "0", "--prefix", "model"], capsys)
    assert code == 0
    reference = safetensors_torch.load_file(str(src))
    imported = tiercheck.load(root)["model"]
    same(imported, _ordered(reference, imported))
    # and back out: the safetensors reader sees the same tensors
    back = tmp_path / "back.safetensors"
    export_step(root, back, prefix="model")
    again = safetensors_torch.load_file(str(back))
    assert set(again) == set(reference)
    for k in reference:
        same(again[k], reference[k], k)


def _ordered(reference: dict[str, torch.Tensor], like: dict[str, Any]) -> dict[str, torch.Tensor]:
    assert set(reference) == set(like)
    return {k: reference[k] for k in like}


def test_import_dcp_round_trip(tmp_path: Path) -> None:
    original = torch_save_state()
    src = tmp_path / "dcp_in"
    dcp.save(original, checkpoint_id=str(src), no_dist=True)
    root = tmp_path / "ckpt"
    result = import_step(src, root, 5, int_keys=True)
    assert result.format == "dcp"
    # DCP's own reader, into a template shaped like the original:
    template = zeros_like_state({k: dict(v) if k == "model" else v for k, v in original.items()})
    dcp.load(template, checkpoint_id=str(src), no_dist=True)
    same(tiercheck.load(root, 5), template)
    # Without int_keys, DCP's string keys are kept as they are.
    root2 = tmp_path / "ckpt2"
    import_step(src, root2, 5)
    assert list(tiercheck.load(root2)["optimizer"]["state"]) == ["0", "1", "2", "3"]
    # tiercheck -> DCP -> tiercheck is bit-exact too
    out = tmp_path / "dcp_out"
    export_step(root, out, format="dcp")
    root3 = tmp_path / "ckpt3"
    import_step(out, root3, 5, int_keys=True)
    same(tiercheck.load(root3), tiercheck.load(root))


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_import_never_runs_code_from_the_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "pwned"
    src = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": _RunsCode(str(marker))}, src)
    code, _, err = run_cli(["import", str(src), str(tmp_path / "c1"), "--step", "1"], capsys)
    assert code == 2 and "weights_only" in err
    assert not marker.exists()

    # A DCP directory whose .metadata is a pickle that would run code
    evil = tmp_path / "evil_dcp"
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(evil), no_dist=True)
    (evil / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    code, _, err = run_cli(["import", str(evil), str(tmp_path / "c2"), "--step", "1"], capsys)
    assert code == 2 and "not DCP metadata" in err
    assert not marker.exists()
    # and a pickled value inside a DCP directory that weights_only refuses
    evil2 = tmp_path / "evil_dcp2"
    dcp.save({"w": torch.ones(2), "v": _RunsCode(str(marker))}, checkpoint_id=str(evil2), no_dist=True)
    with pytest.raises(UnsupportedStateError, match="weights_only"):
        import_step(evil2, tmp_path / "c3", 1)
    assert not marker.exists()
    assert not (tmp_path / "c3").exists() or tiercheck.Checkpointer(local=tmp_path / "c3").steps() == []


def test_import_refuses_a_step_that_is_not_newer(saved: Path, tmp_path: Path) -> None:
    src = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2)}, src)
    with pytest.raises(tiercheck.StepConflictError):
        import_step(src, saved, 10)
    torch.save([torch.ones(2)], src)
    with pytest.raises(UnsupportedStateError, match="not a dict"):
        import_step(src, saved, 11)
    import_step(src, saved, 11, prefix="weights")
    same(tiercheck.load(saved, 11)["weights"], [torch.ones(2)])


# ----------------------------------------------------------------------------- prune / rm


@pytest.fixture
def many_steps(tmp_path: Path) -> Path:
    root = tmp_path / "steps"
    with tiercheck.Checkpointer(local=root, keep_local=None) as ck:
        for s in (100, 200, 300, 400, 500, 600):
            ck.save(s, {"w": torch.full((4,), float(s))})
    return root


def test_prune_keeps_what_retention_would(
    many_steps: Path, capsys: pytest.CaptureFixture[str], dir_snapshot: Callable[[Path], dict[str, bytes | None]]
) -> None:
    before = dir_snapshot(many_steps)
    code, out, _ = run_cli(
        ["prune", str(many_steps), "--keep-last", "2", "--keep-every", "200", "--dry-run", "--json"], capsys
    )
    assert code == 0
    assert json.loads(out) == {
        "location": str(many_steps),
        "deleted": [100, 300],
        "kept": [200, 400, 500, 600],
        "dry_run": True,
        "writer_check": "locked",
    }
    assert dir_snapshot(many_steps) == before  # a dry run changes nothing
    code, out, _ = run_cli(["prune", str(many_steps), "--keep-last", "2", "--keep-every", "200"], capsys)
    assert code == 0 and "deleted steps 100, 300" in out
    assert LocalTier(many_steps).committed_steps() == [200, 400, 500, 600]
    same(tiercheck.load(many_steps, 600)["w"], torch.full((4,), 600.0))
    assert not [n for n in os.listdir(many_steps) if naming.is_leftover(n)]  # no trash left


def test_prune_keeps_steps_not_yet_on_the_next_tier(many_steps: Path, tmp_path: Path) -> None:
    remote = tmp_path / "remote"
    with tiercheck.Checkpointer(local=remote, keep_local=None) as ck:
        ck.save(100, {"w": torch.ones(1)})
        ck.save(200, {"w": torch.ones(1)})
    result = prune_steps(many_steps, 1, next_tier=str(remote))
    assert result.deleted == (100, 200)
    assert LocalTier(many_steps).committed_steps() == [300, 400, 500, 600]


def test_rm_never_the_newest_unless_asked(many_steps: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(["rm", str(many_steps), "--step", "600"], capsys)
    assert code == 2 and "newest" in err
    assert 600 in LocalTier(many_steps).committed_steps()
    code, out, _ = run_cli(["rm", str(many_steps), "--step", "300", "--json"], capsys)
    assert code == 0 and json.loads(out)["deleted"] == [300]
    assert LocalTier(many_steps).committed_steps() == [100, 200, 400, 500, 600]
    code, out, _ = run_cli(["rm", str(many_steps), "--step", "300", "--json"], capsys)
    assert code == 2 and json.loads(out)["error"]["type"] == "NoCheckpointError"
    assert remove_step(many_steps, 600, allow_newest=True, dry_run=True).deleted == (600,)
    assert 600 in LocalTier(many_steps).committed_steps()
    assert remove_step(many_steps, 600, allow_newest=True).kept == (100, 200, 400, 500)


LOCK_HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()
    """
)


def test_prune_and_rm_refuse_while_a_writer_holds_the_directory(
    many_steps: Path, capsys: pytest.CaptureFixture[str], dir_snapshot: Callable[[Path], dict[str, bytes | None]]
) -> None:
    lock = many_steps / ".tiercheck-lock-rank-00000"
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = dir_snapshot(many_steps)
        code, out, err = run_cli(["prune", str(many_steps), "--keep-last", "1", "--json"], capsys)
        assert code == 2 and json.loads(out)["error"]["type"] == "DirectoryInUseError"
        assert str(lock) in err
        with pytest.raises(DirectoryInUseError):
            remove_step(many_steps, 100)
        assert dir_snapshot(many_steps) == before
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    result = prune_steps(many_steps, 1)  # the writer is gone: the lock is free
    assert result.writer_check == "locked" and result.kept == (600,)


# ----------------------------------------------------------------------------- progress


def test_progress_callbacks_count_every_byte(saved: Path, tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    loaded = tiercheck.load(saved, progress=lambda d, t: calls.append((d, t)))
    total = calls[-1][1]
    assert calls[-1][0] == total
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert {t for _, t in calls} == {total}
    unique = {(t.untyped_storage().data_ptr(), t.nbytes) for t in flat_tensors(loaded).values()}
    arrays = sum(v.nbytes for v in (loaded["arr"], loaded["arr_be"])) + 8 + len(loaded["blob"])
    assert total == sum(n for _, n in unique) + arrays

    calls.clear()
    export_step(saved, tmp_path / "x.safetensors", progress=lambda d, t: calls.append((d, t)))
    assert calls[-1][0] == calls[-1][1] == sum(t.nbytes for t in flat_tensors(tiercheck.load(saved)).values())

    calls.clear()
    tier = LocalTier(saved)
    verify_files(tier, 10, read_manifest(tier, 10, 0), progress=lambda d, t: calls.append((d, t)))
    shard = saved / naming.step_dir_name(10) / naming.shard_name(0, 1)
    assert calls[-1] == (shard.stat().st_size, shard.stat().st_size)

    calls.clear()
    model = model_and_optimizer()[0]
    with tiercheck.Checkpointer(local=saved) as ck:
        ck.restore({"model": model}, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1][0] == calls[-1][1] == sum(p.nbytes for p in model.state_dict().values())


def test_import_writes_what_checkpointer_save_writes(tmp_path: Path) -> None:
    """The streamed writer's step is byte for byte the step `save` writes of the same state:
    shard (tied tensors once, views, conjugate bits, padding), manifest and marker."""
    state = torch_save_state()
    weight = state["model"]["0.weight"]
    state["tied"] = weight
    state["transposed"] = weight.t()
    state["conj"] = torch.randn(3, dtype=torch.complex64).conj()
    src = tmp_path / "s.pt"
    torch.save(state, src)
    import_step(src, tmp_path / "imported", 7)
    with tiercheck.Checkpointer(local=tmp_path / "saved", keep_local=None, run_log_interval=None) as ck:
        ck.save(7, torch.load(src, weights_only=True))
    step = naming.step_dir_name(7)
    names = sorted(os.listdir(tmp_path / "saved" / step))
    assert sorted(os.listdir(tmp_path / "imported" / step)) == names
    for name in names:
        assert (tmp_path / "imported" / step / name).read_bytes() == (tmp_path / "saved" / step / name).read_bytes()


def test_import_into_an_object_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = {f"w{i}": raw_tensor(torch.float32, (300, 7), i) for i in range(3)}
    src = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, str(src))
    url = f"memory://import-{os.getpid()}-{id(tensors)}"
    code, _, _ = run_cli(["import", str(src), url, "--step", "3", "--prefix", "model"], capsys)
    assert code == 0
    same(tiercheck.load(url)["model"], _ordered(tensors, tiercheck.load(url)["model"]))
    assert run_cli(["verify", url], capsys)[0] == 0


_PEAK_RSS = textwrap.dedent(
    """
    import json, sys
    import torch, tiercheck
    import torch.distributed.checkpoint, torch.distributed.checkpoint.state_dict_loader
    from tiercheck.tools import import_step
    def peak_kib():  # this process's own peak (ru_maxrss carries the parent's across exec)
        with open("/proc/self/status") as f:
            return [int(line.split()[1]) for line in f if line.startswith("VmHWM:")][0]
    before = peak_kib()
    import_step(sys.argv[1], sys.argv[2], 1)
    print(json.dumps((peak_kib() - before) << 10))
    """
)


@pytest.fixture(scope="module")
def large_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """One 96 MiB state (12 tensors of 8 MiB) in each input format."""
    root = tmp_path_factory.mktemp("large")
    g = torch.Generator().manual_seed(3)
    tensors = {f"layer{i:02d}.w": torch.randn(2 << 20, generator=g) for i in range(12)}
    torch.save(tensors, root / "m.pt")
    safetensors_torch.save_file(tensors, str(root / "m.safetensors"))
    dcp.save(tensors, checkpoint_id=str(root / "m_dcp"), no_dist=True)
    return {
        "pt": (root / "m.pt", tensors),
        "safetensors": (root / "m.safetensors", tensors),
        "dcp": (root / "m_dcp", tensors),
    }


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "dcp"])
def test_import_peak_memory_is_bounded_by_the_largest_tensor(
    fmt: str, large_sources: dict[str, tuple[Path, dict[str, torch.Tensor]]], tmp_path: Path
) -> None:
    """Streamed: the peak RSS growth of an import stays near the largest tensor (8 MiB) plus
    the 8 MiB chunk, below the checkpoint (96 MiB); it was about twice the checkpoint when
    the whole state went through one host buffer. DCP's reader holds a tensor about three
    times while it reads it."""
    src, tensors = large_sources[fmt]
    dest = tmp_path / "c"
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(src), str(dest)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ).stdout
    growth = json.loads(out.strip().splitlines()[-1])
    largest = max(t.nbytes for t in tensors.values())
    total = sum(t.nbytes for t in tensors.values())
    copies = 4 if fmt == "dcp" else 1
    bound = copies * largest + (8 << 20) + (24 << 20)
    assert bound < total * 3 // 4
    assert growth < bound, (fmt, growth >> 20)
    same(tiercheck.load(dest, 1), tensors)


def test_import_progress_reaches_the_total(tmp_path: Path) -> None:
    src = tmp_path / "in.pt"
    torch.save({"w": torch.ones(1 << 20)}, src)
    calls: list[tuple[int, int]] = []
    import_step(src, tmp_path / "c", 1, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (4 << 20, 4 << 20)
    assert all(d <= t for d, t in calls)


def read_all(fd: int) -> str:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("use_tqdm", [True, False])
def test_terminal_bar_draws_on_a_terminal_only(use_tqdm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCHECK_PROGRESS", raising=False)
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            with terminal_bar("export", stream=tty, min_bytes=100, use_tqdm=use_tqdm) as progress:
                assert progress is not None
                for done in range(0, 1001, 250):
                    progress(done, 1000)
            tty.flush()
        drawn = read_all(master)
    finally:
        os.close(master)
        os.close(slave)
    assert "export" in drawn and "100%" in drawn
    # Not a terminal: no bar, nothing written.
    pipe = io.StringIO()
    with terminal_bar("export", stream=pipe, min_bytes=1) as progress:
        assert progress is None
    assert pipe.getvalue() == ""
    # A small operation on a terminal: no bar either.
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty, terminal_bar("x", stream=tty, min_bytes=10**6) as progress:
            assert progress is not None
            progress(10, 10)
        assert read_all(master) == ""
    finally:
        os.close(master)
        os.close(slave)


def test_the_library_works_without_the_optional_packages(saved: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import io, sys
        sys.modules["safetensors"] = None  # import fails as if not installed
        sys.modules["tqdm"] = None
        import tiercheck, tiercheck.tools
        from tiercheck.observe.progress import terminal_bar
        r = tiercheck.tools.export_step({str(saved)!r}, {str(tmp_path / "a.safetensors")!r}, prefix="model")
        print(r.tensors)
        class Tty(io.StringIO):
            def isatty(self): return True
        s = Tty()
        with terminal_bar("t", stream=s, min_bytes=1) as p:
            p(5, 10); p(10, 10)
        print("ETA" in s.getvalue())
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["4", "True"]
    same(safetensors_torch.load_file(str(tmp_path / "a.safetensors")), dict(model_and_optimizer()[0].state_dict()))


def test_every_tool_subcommand_takes_json_and_usage_errors_exit_2(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.pt"
    torch.save({"w": torch.ones(2)}, src)
    for argv in (
        ["inspect", str(saved)],
        ["export", str(saved), "--to", str(tmp_path / "o.pt")],
        ["import", str(src), str(tmp_path / "c"), "--step", "1"],
        ["prune", str(saved), "--keep-last", "1"],
        ["rm", str(tmp_path / "c"), "--step", "1", "--allow-newest", "--dry-run"],
    ):
        code, out, _ = run_cli([*argv, "--json"], capsys)
        assert code == 0, argv
        assert isinstance(json.loads(out), dict)
    for argv in (["export", str(saved)], ["import", str(src)], ["prune", str(saved)], ["rm", str(saved)]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    capsys.readouterr()
    code, _, _ = run_cli(["prune", str(saved), "--keep-last", "0"], capsys)
    assert code == 2
    code, _, _ = run_cli(["import", str(tmp_path / "missing.pt"), str(tmp_path / "c"), "--step", "2"], capsys)
    assert code == 2
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    code, _, _ = run_cli(["import", str(bad), str(tmp_path / "c"), "--step", "2"], capsys)
    assert code == 1  # a damaged input


def test_corrupted_step_in_export_exits_1_and_inspect_still_works(saved: Path, tmp_path: Path) -> None:
    shard = saved / naming.step_dir_name(10) / naming.shard_name(0, 1)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointCorruptedError):
        export_step(saved, tmp_path / "x.pt")
    assert main(["inspect", str(saved)]) == 0


def test_verify_shows_progress_when_asked(
    saved: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tiercheck.observe.progress.MIN_BYTES", 1)
    monkeypatch.setenv("TIERCHECK_PROGRESS", "1")  # stderr is captured, not a terminal
    code, out, err = run_cli(["verify", str(saved)], capsys)
    assert code == 0 and "step 10: ok" in out
    assert "verify step 10" in err and "100%" in err
    monkeypatch.setenv("TIERCHECK_PROGRESS", "0")
    code, out, err = run_cli(["verify", str(saved)], capsys)
    assert code == 0 and err == ""


def test_inspect_and_export_resolve_replicated_keys_of_a_multi_rank_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.format.test_replica_format import STEP, two_rank_parts, write_step

    root = tmp_path / "job"
    write_step(root, two_rank_parts({"model": 0, "optimizer": 1}))
    code, out, _ = run_cli(["inspect", str(root), "--rank", "1", "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert (doc["rank"], doc["world_size"]) == (1, 2)
    keys = {k["key"]: k for k in doc["keys"]}
    assert keys["model"]["replica_of"] == 0 and "replica_of" not in keys["optimizer"]
    assert keys["model"]["leaves"] == 2
    for rank in (0, 1):
        dest = tmp_path / f"rank{rank}.pt"
        assert main(["export", str(root), "--rank", str(rank), "--to", str(dest)]) == 0
        same(torch.load(dest, weights_only=True), as_plain(tiercheck.load(root, STEP, rank=rank)))
    code, text, _ = run_cli(["inspect", str(root), "--rank", "1"], capsys)
    assert "(replicated: stored by rank 0)" in text


def test_tools_on_a_url_with_compressed_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"file://{tmp_path}/bucket"
    state = {"model": {f"w{i}": raw_tensor(torch.float32, (64, 64), i) for i in range(4)}, "step": 3}
    with tiercheck.Checkpointer(remote=url, keep_remote=None, remote_compression="zstd") as ck:
        ck.save(1, state)
        ck.save(2, state)
    manifest = json.loads((tmp_path / "bucket" / naming.step_dir_name(2) / naming.manifest_name(0, 1)).read_text())
    assert manifest["files"][0]["codec"] == "zstd"
    code, out, _ = run_cli(["inspect", url, "--json"], capsys)
    assert code == 0 and json.loads(out)["files"][0]["codec"] == "zstd"
    dest = tmp_path / "m.safetensors"
    assert run_cli(["export", url, "--to", str(dest), "--prefix", "model"], capsys)[0] == 0
    same(safetensors_torch.load_file(str(dest)), _ordered(state["model"], safetensors_torch.load_file(str(dest))))
    code, out, _ = run_cli(["prune", url, "--keep-last", "1", "--json"], capsys)
    assert code == 0
    assert json.loads(out) | {"location": None} == {
        "location": None,
        "deleted": [1],
        "kept": [2],
        "dry_run": False,
        "writer_check": "impossible",
    }
    assert tiercheck.Checkpointer(remote=url).steps() == [2]


def test_prune_refuses_while_a_checkpointer_writes_the_directory(
    many_steps: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with tiercheck.Checkpointer(local=many_steps, keep_local=None) as ck:
        ck.save(700, {"w": torch.zeros(4)}).wait()  # a writer from its first save on
        code, _, err = run_cli(["prune", str(many_steps), "--keep-last", "1"], capsys)
        assert code == 2 and "is being written by" in err
        assert LocalTier(many_steps).committed_steps() == [100, 200, 300, 400, 500, 600, 700]
    # While a tool holds the locks, a writer starting is the one refused.
    late = tiercheck.Checkpointer(local=many_steps, keep_local=None)
    with writers_excluded(LocalTier(many_steps)), pytest.raises(DirectoryInUseError):
        late.save(800, {"w": torch.zeros(4)})
    late.close()
    assert prune_steps(many_steps, 2).kept == (600, 700)


def test_inspect_shows_the_metrics_saved_with_the_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "m"
    with tiercheck.Checkpointer(local=root) as ck:
        ck.save(1, {"w": torch.ones(2)}, metrics={"val_loss": 0.3125, "epoch": 3, "bad": float("nan")})
        ck.save(2, {"w": torch.ones(2)})
    code, out, _ = run_cli(["inspect", str(root), "--step", "1", "--json"], capsys)
    assert code == 0 and json.loads(out)["metrics"] == {"val_loss": 0.3125, "epoch": 3, "bad": "nan"}
    code, text, _ = run_cli(["inspect", str(root), "--step", "1"], capsys)
    assert "metrics: val_loss=0.3125, epoch=3, bad=nan" in text
    code, out, _ = run_cli(["inspect", str(root), "--json"], capsys)
    assert json.loads(out)["metrics"] is None
