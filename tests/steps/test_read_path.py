"""One read path (issue 24 item 2): restore, `tiercheck.load` and the tools resolve replicas
with one rule, decode plain values with one decoder, and decompress with the codec the
remote tier compresses with."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

import tiercheck
from tests.format.test_replica_format import CHECKSUM, STEP, rank_state, two_rank_parts
from tests.format.test_replica_format import write_step as write_parts
from tiercheck.__main__ import main
from tiercheck.errors import CheckpointCorruptedError
from tiercheck.format import naming
from tiercheck.format.manifest import ShardFile, decode_manifest, decode_marker, encode_manifest, encode_marker
from tiercheck.format.tree import decode_plain
from tiercheck.state.flatten import flatten_state
from tiercheck.steps.catalog import read_manifest, verify_files
from tiercheck.steps.restore import restore_from
from tiercheck.tiers import codec
from tiercheck.tiers.base import ReadableFile
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import RemoteTier
from tiercheck.tools import export_step
from tiercheck.tools.step_writer import memory_chunks, write_step
from tiercheck.tools.view import open_view

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

# ------------------------------------------------------------------ replica resolution


def _unlist_on_owner(root: Path, key: list[str]) -> None:
    """Drop `key` from rank 0's `replicated` list (its value stays in rank 0's tree, now as
    a per-rank value) while rank 1 still refers to rank 0 for it; re-encode that manifest
    and the marker's checksum of it with the library's encoders, so both verify."""
    step_dir = root / naming.step_dir_name(STEP)
    path = step_dir / naming.manifest_name(0, 2)
    owner = decode_manifest(path.read_bytes(), "rank 0")
    assert tuple(key) in owner.replicated
    edited = dataclasses.replace(owner, replicated=tuple(k for k in owner.replicated if list(k) != key))
    data = encode_manifest(edited)
    path.write_bytes(data)
    marker = decode_marker((step_dir / naming.COMMIT_NAME).read_bytes(), "marker")
    refs = tuple(
        dataclasses.replace(r, length=len(data), checksum=CHECKSUM(data)) if r.file == path.name else r
        for r in marker.manifests
    )
    (step_dir / naming.COMMIT_NAME).write_bytes(encode_marker(dataclasses.replace(marker, manifests=refs)))


@pytest.fixture
def unlisted(tmp_path: Path) -> Path:
    root = tmp_path / "job"
    write_parts(root, two_rank_parts({"model": 0, "optimizer": 1}))
    _unlist_on_owner(root, ["s", "model"])
    return root


REFUSAL = r"rank-00000-of-00002\.manifest\.json: does not hold the replicated key 'model' that rank 1 refers to"


def test_a_replica_the_owner_does_not_list_is_refused_by_every_reader(
    unlisted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = LocalTier(unlisted)
    before = {p.name: p.read_bytes() for p in (unlisted / naming.step_dir_name(STEP)).iterdir()}
    # The edited step itself is well formed: rank 0 reads its own view, "model" per rank.
    assert torch.equal(tiercheck.load(unlisted, STEP, rank=0)["model"]["w"], rank_state(0)["model"]["w"])
    template = rank_state(1)
    with pytest.raises(CheckpointCorruptedError, match=REFUSAL):
        restore_from([tier], template, STEP, 1)
    with pytest.raises(CheckpointCorruptedError, match=REFUSAL):
        tiercheck.load(unlisted, STEP, rank=1)
    with pytest.raises(CheckpointCorruptedError, match=REFUSAL):
        open_view(tier, STEP, rank=1)
    with pytest.raises(CheckpointCorruptedError, match=REFUSAL):
        export_step(unlisted, tmp_path / "out.pt", step=STEP, rank=1)
    assert not (tmp_path / "out.pt").exists()
    for argv in (["inspect", str(unlisted)], ["export", str(unlisted), "--to", str(tmp_path / "o.pt")]):
        code = main([*argv, "--step", str(STEP), "--rank", "1", "--json"])
        error = json.loads(capsys.readouterr().out)["error"]
        assert (code, error["type"]) == (1, "CheckpointCorruptedError"), argv
        assert "does not hold the replicated key 'model' that rank 1 refers to" in error["message"]
    assert {p.name: p.read_bytes() for p in (unlisted / naming.step_dir_name(STEP)).iterdir()} == before


# ------------------------------------------------------------------ plain values


PLAIN = [None, True, False, 0, -(10**40), 7, 0.1, -0.0, math.inf, 5e-324, "", "säge"]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_decode_to_what_was_saved(value: object) -> None:
    node = flatten_state({"v": value}).tree["v"][0]
    got = decode_plain(node)
    assert type(got) is type(value) and (got == value or repr(got) == repr(value))


def test_plain_nan_decodes_to_nan() -> None:
    got = decode_plain(flatten_state({"v": math.nan}).tree["v"][0])
    assert isinstance(got, float) and math.isnan(got)


def test_view_and_restore_decode_plain_values_alike(tmp_path: Path) -> None:
    state: dict[str, Any] = {f"k{i}": v for i, v in enumerate(PLAIN)}
    with tiercheck.Checkpointer(local=tmp_path / "c", keep_local=None) as ck:
        ck.save(1, {**state, "t": torch.ones(2)}).wait()
    loaded = tiercheck.load(tmp_path / "c", 1)
    view = open_view(LocalTier(tmp_path / "c"), 1)
    seen = {k: n.value for k, n in view.root.items() if n.kind != "tensor"}
    for k, v in state.items():
        assert repr(loaded[k]) == repr(v) and repr(seen[k]) == repr(v), k


# ------------------------------------------------------------------ the codec


class _Bytes(ReadableFile):
    def __init__(self, data: bytes) -> None:
        self._data = data
        self.size = len(data)

    def read_into(self, offset: int, dest: memoryview) -> None:
        if offset + len(dest) > self.size:
            raise EOFError("past the end")
        dest[:] = self._data[offset : offset + len(dest)]

    def close(self) -> None:
        pass


def _compress(data: bytes, pieces: int = 7) -> bytes:
    step = max(1, len(data) // pieces)
    chunks = [memoryview(data)[p : p + step] for p in range(0, len(data), step)]
    return b"".join(bytes(c) for c in codec.compressed(iter(chunks), level=1))


def test_codec_round_trip_and_offsets() -> None:
    data = bytes(range(256)) * 4099 + b"tail"
    frame = _compress(data)
    assert len(frame) < len(data)
    assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == data  # a standard frame
    f = codec.ZstdFile(_Bytes(frame), len(data), "shard")
    out = memoryview(bytearray(1000))
    for off in (5000, 0, len(data) - 1000, 123):  # forward, back (rewinds), to the end
        f.read_into(off, out)
        assert bytes(out) == data[off : off + 1000]
    f.check_end()
    empty = codec.ZstdFile(_Bytes(_compress(b"")), 0, "empty")
    empty.check_end()


def test_codec_refuses_a_corrupted_frame_and_a_wrong_length() -> None:
    data = bytes(range(256)) * 512
    good = _compress(data)
    cut = codec.ZstdFile(_Bytes(good[: len(good) // 2]), len(data), "cut.shard")
    with pytest.raises(EOFError, match=r"cut\.shard: decompressed data ends at byte"):
        cut.read_into(0, memoryview(bytearray(len(data))))
    garbage = codec.ZstdFile(_Bytes(b"not a zstd frame at all"), 10, "junk.shard")
    with pytest.raises(CheckpointCorruptedError, match=r"junk\.shard: bad zstd data"):
        garbage.read_into(0, memoryview(bytearray(10)))
    with pytest.raises(CheckpointCorruptedError, match="more"):
        codec.ZstdFile(_Bytes(good), len(data) - 1, "long.shard").check_end()
    with pytest.raises(CheckpointCorruptedError, match="ends at byte"):
        codec.ZstdFile(_Bytes(good), len(data) + 1, "short.shard").check_end()


# ------------------------------------------------------------------ the one shard opener

PACKAGE = Path(__file__).resolve().parents[2] / "tiercheck"
OPENER = "steps/catalog.py"
# The tiers themselves (their implementations and wrappers) and the tier test kit may open
# a tier's files; every other reader goes through the opener.
MAY_OPEN = ("tiers/", "testing/")


def _shard_opens(path: Path) -> list[str]:
    """`open_file(`, `local_file(` and `ZstdFile(` calls in the module at `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("open_file", "local_file", "ZstdFile"):
            found.append(f"{name}( at line {node.lineno}")
    return found


def test_only_the_opener_opens_shard_files() -> None:
    openers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(MAY_OPEN):
            continue
        calls = _shard_opens(path)
        if calls:
            openers[rel] = calls
    assert list(openers) == [OPENER], f"shard files opened outside catalog.ShardFiles: {openers}"
    assert {c.split("(")[0] for c in openers[OPENER]} == {"open_file", "local_file", "ZstdFile"}


def _zstd_step(root: Path, step: int, state: dict[str, Any]) -> None:
    """`state` as tier 2 stores it compressed (the import tool's writer; no Checkpointer)."""
    tier = RemoteTier(str(root), compression="zstd")
    flat = flatten_state(state)
    write_step(tier, step, flat, lambda i: memory_chunks(flat.sources[i]))


def _rewrite_manifest(step_dir: Path, rank: int, world: int, edit: Any) -> None:
    """Replace one manifest by `edit(manifest)`, and its checksum in the marker, both encoded
    by the library, so that the step verifies up to what `edit` changed."""
    path = step_dir / naming.manifest_name(rank, world)
    data = encode_manifest(edit(decode_manifest(path.read_bytes(), path.name)))
    path.write_bytes(data)
    marker = decode_marker((step_dir / naming.COMMIT_NAME).read_bytes(), "marker")
    refs = tuple(
        dataclasses.replace(r, length=len(data), checksum=CHECKSUM(data)) if r.file == path.name else r
        for r in marker.manifests
    )
    (step_dir / naming.COMMIT_NAME).write_bytes(encode_marker(dataclasses.replace(marker, manifests=refs)))


def test_a_compressed_shard_longer_than_declared_is_refused_by_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "z"
    state = {"model": {"w": torch.arange(5000, dtype=torch.float32)}, "n": 3}
    _zstd_step(root, 4, state)
    assert torch.equal(tiercheck.load(root, 4)["model"]["w"], state["model"]["w"])
    step_dir = root / naming.step_dir_name(4)
    shard = step_dir / naming.shard_name(0, 1)
    # A second frame: every entry still reads and verifies, but the shard decompresses to
    # more than its manifest declares; the stored size is brought in line with the file.
    with shard.open("ab") as f:
        f.write(_compress(b"trailing bytes no manifest declares"))

    def grown(m: Any) -> Any:
        return dataclasses.replace(m, files=(dataclasses.replace(m.files[0], stored_length=shard.stat().st_size),))

    _rewrite_manifest(step_dir, 0, 1, grown)
    with pytest.raises(CheckpointCorruptedError, match="decompresses to more"):
        tiercheck.load(root, 4)
    with pytest.raises(CheckpointCorruptedError, match="decompresses to more"):
        export_step(root, tmp_path / "out.pt", step=4)
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(CheckpointCorruptedError, match="decompresses to more"):
        verify_files(LocalTier(root), 4, read_manifest(LocalTier(root), 4, 0))
    assert main(["verify", str(root)]) == 1
    assert "decompresses to more" in capsys.readouterr().out


def test_manifests_disagreeing_on_a_file_are_refused_by_restore_and_the_tools(tmp_path: Path) -> None:
    root = tmp_path / "job"
    write_parts(root, two_rank_parts({"model": 0, "optimizer": 0}))
    step_dir = root / naming.step_dir_name(STEP)
    owner_shard = naming.shard_name(0, 2)
    # Rank 1's manifest also names rank 0's shard (its replicas' file), of the right size
    # but as compressed: the first record a reader meets opens; the second disagrees.
    size = (step_dir / owner_shard).stat().st_size
    listed = ShardFile(owner_shard, size, "zstd", size)
    _rewrite_manifest(step_dir, 1, 2, lambda m: dataclasses.replace(m, files=(*m.files, listed)))
    refusal = rf"{owner_shard}: manifests of step {STEP} disagree on this file's size"
    with pytest.raises(CheckpointCorruptedError, match=refusal):
        restore_from([LocalTier(root)], rank_state(1), STEP, 1)
    with pytest.raises(CheckpointCorruptedError, match=refusal):
        tiercheck.load(root, STEP, rank=1)
    with pytest.raises(CheckpointCorruptedError, match=refusal):
        open_view(LocalTier(root), STEP, rank=1)
    with pytest.raises(CheckpointCorruptedError, match=refusal):
        export_step(root, tmp_path / "out.pt", step=STEP, rank=1)
    # Rank 0's view never meets rank 1's manifest: it reads as it did.
    assert torch.equal(tiercheck.load(root, STEP, rank=0)["model"]["w"], rank_state(0)["model"]["w"])
