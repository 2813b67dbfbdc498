"""Hostile checkpoints through the public read path (`tiercheck.load`, `Checkpointer.restore`).

A hostile (or badly buggy) writer can produce a step whose manifest is consistently
sealed: the commit marker's length and checksum match the altered manifest, so checksums
catch nothing and only the reader's validation stands between the bytes and the caller.
Each test crafts step 2 over a good step 1 and checks that the reader

* raises `CheckpointCorruptedError` (or `NoCheckpointError`), never another type;
* does not follow a path out of the step directory, even to a valid copy of the shard;
* does not allocate what a manifest claims before checking it against the files;
* does not recurse without bound on deep JSON, hang on a FIFO, or read /dev/zero forever;
* does not inflate a compressed shard past its declared length, or parse a manifest into
  many times its size in memory;
* does not follow a symbolic link out of the step directory;
* never unpickles anything;
* and, asked for the newest step, skips the hostile one and restores step 1 bit-exact.

`tests/helpers/fuzz_manifest_atheris.py` is a coverage-guided fuzzer for the same path (run by hand).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import shutil
import threading
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tiercheck
from tiercheck.__main__ import main as cli
from tiercheck.errors import CheckpointCorruptedError, NoCheckpointError, TierError
from tiercheck.format import naming
from tiercheck.format.checksum import checksum_function
from tiercheck.format.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ShardFile,
    build_entries,
    decode_manifest,
    encode_manifest,
)
from tiercheck.format.tree import JsonNode
from tiercheck.plan.shards import plan_shard
from tiercheck.state.flatten import flatten_state

SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME
REJECTED = (CheckpointCorruptedError, NoCheckpointError)


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(32, 32, generator=g),
        "h": torch.randn(100, generator=g).to(torch.bfloat16),
        "np": np.arange(7, dtype=np.int32) * step,
        "blob": bytes([step]) * 5,
        "meta": {"step": step, "name": f"s{step}", 0: (1.5, None)},
    }


def template() -> dict[str, Any]:
    return {
        "w": torch.zeros(32, 32),
        "h": torch.zeros(100, dtype=torch.bfloat16),
        "np": np.zeros(7, dtype=np.int32),
        "blob": b"",
        "meta": {"step": -1, "name": "", 0: None},
    }


def assert_is_step(got: dict[str, Any], step: int) -> None:
    want = make_state(step)
    assert torch.equal(got["w"], want["w"])
    assert torch.equal(got["h"].view(torch.int16), want["h"].view(torch.int16))
    assert got["np"].dtype == want["np"].dtype and np.array_equal(got["np"], want["np"])
    assert got["blob"] == want["blob"]
    assert got["meta"] == want["meta"]


class Crafted:
    """Steps 1 and 2 committed under `root`; step 2's files can be replaced and re-sealed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
            ckpt.save(1, make_state(1)).wait()
            ckpt.save(2, make_state(2)).wait()
        self.dir = root / naming.step_dir_name(2)
        self.manifest = (self.dir / MANIFEST).read_bytes()
        self.marker = (self.dir / COMMIT).read_bytes()
        self.shard = (self.dir / SHARD).read_bytes()

    def doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.manifest)
        return doc

    def reset(self) -> None:
        for name, data in ((SHARD, self.shard), (MANIFEST, self.manifest), (COMMIT, self.marker)):
            p = self.dir / name
            if p.is_symlink() or not p.is_file():
                p.unlink()
            p.write_bytes(data)

    def seal(self, manifest: bytes | dict[str, Any], **marker_fields: Any) -> None:
        """Write `manifest` and a commit marker whose length and checksum match it."""
        data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
        (self.dir / MANIFEST).write_bytes(data)
        marker = json.loads(self.marker)
        ref = marker["manifests"][0]
        ref["length"] = len(data)
        ref["checksum"] = checksum_function(marker["checksum_algorithm"])(data)
        ref.update(marker_fields)
        (self.dir / COMMIT).write_bytes(json.dumps(marker).encode())


@pytest.fixture
def crafted(tmp_path: Path) -> Crafted:
    return Crafted(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Crafted]:
    """One crafted checkpoint for the Hypothesis tests (reset before each example)."""
    yield Crafted(tmp_path_factory.mktemp("hostile") / "ckpt")


@contextlib.contextmanager
def no_unpickling() -> Iterator[None]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the read path must never unpickle")

    with (
        mock.patch.object(pickle, "loads", refuse),
        mock.patch.object(pickle, "load", refuse),
        mock.patch.object(pickle, "Unpickler", refuse),
        mock.patch.object(torch, "load", refuse),
    ):
        yield


def assert_rejected_everywhere(c: Crafted, timeout: float = 20.0) -> None:
    """Step 2 is refused by `load` and `restore` (asked for exactly), and the newest-step
    restore falls back to step 1 bit-exact."""
    t0 = time.monotonic()
    with no_unpickling():
        with pytest.raises(CheckpointCorruptedError):
            tiercheck.load(c.root, step=2)
        with tiercheck.Checkpointer(local=c.root, keep_local=None) as ckpt:
            with pytest.raises(CheckpointCorruptedError):
                ckpt.restore(template(), step=2)
            t = template()
            with pytest.warns(RuntimeWarning, match=r"step 2\b"):
                assert ckpt.restore(t) == 1
            assert_is_step(t, 1)
        with pytest.warns(RuntimeWarning, match=r"step 2\b"):
            assert_is_step(tiercheck.load(c.root), 1)
    assert time.monotonic() - t0 < timeout


def test_the_crafting_itself_keeps_a_valid_step(crafted: Crafted) -> None:
    crafted.seal(crafted.doc())  # re-sealed but unchanged: still a good step
    assert_is_step(tiercheck.load(crafted.root, step=2), 2)


# ------------------------------------------------------------ paths out of the step


ESCAPES = [
    "../x",
    "../rank-00000-of-00001.shard",
    "../step-000000000001/rank-00000-of-00001.shard",
    "/etc/passwd",
    "PLANTED",  # replaced by the absolute path of a valid copy of the shard
    "s3://b/k",
    "file:///etc/passwd",
    "C:\\x",
    "..\\rank-00000-of-00001.shard",
    "rank-00000-of-00001.shard/../../x",
    "./rank-00000-of-00001.shard",
    "",
]


@pytest.mark.parametrize("where", ["files", "entries", "both"])
@pytest.mark.parametrize("name", ESCAPES)
def test_paths_escaping_the_step_dir_are_rejected(crafted: Crafted, tmp_path: Path, name: str, where: str) -> None:
    # Valid copies of the shard wherever a reader that followed the path would land.
    planted = tmp_path / "planted.shard"
    planted.write_bytes(crafted.shard)
    (crafted.root / "x").write_bytes(crafted.shard)
    (crafted.root / SHARD).write_bytes(crafted.shard)
    if name == "PLANTED":
        name = str(planted)
    doc = crafted.doc()
    if where in ("files", "both"):
        doc["files"][0]["name"] = name
    if where in ("entries", "both"):
        for e in doc["entries"]:
            e["file"] = name
    crafted.seal(doc)
    assert_rejected_everywhere(crafted)


def test_a_second_file_outside_the_step_dir_is_rejected(crafted: Crafted) -> None:
    doc = crafted.doc()
    doc["files"].append({"name": "../step-000000000001/" + SHARD, "length": len(crafted.shard)})
    doc["entries"][0]["file"] = doc["files"][1]["name"]
    crafted.seal(doc)
    assert_rejected_everywhere(crafted)


# ------------------------------------------------------------------- huge claims


def _claim(doc: dict[str, Any], path: str, shape: list[int], dtype: str, itemsize: int) -> dict[str, Any]:
    (e,) = [e for e in doc["entries"] if e["path"] == path]
    e["shape"], e["dtype"], e["length"] = shape, dtype, itemsize * int(np.prod(shape, dtype=object))
    e["offset"] = doc["files"][0]["length"]  # past every real entry: no overlap
    doc["files"][0]["length"] = e["offset"] + e["length"]
    return e


HUGE = {
    "tensor-2**40-float32": ("state['w']", [2**40], "float32", 4),
    "tensor-2**20x2**20": ("state['w']", [2**20, 2**20], "float32", 4),
    "ndarray-2**40": ("state['np']", [2**40], "<i4", 4),
    "bytes-2**40": ("state['blob']", [2**40], "uint8", 1),
    "tensor-64-dims": ("state['w']", [2] * 40 + [1] * 24, "float32", 4),
}


@pytest.mark.parametrize("claim", list(HUGE))
def test_a_huge_claim_is_rejected_before_allocating(crafted: Crafted, claim: str) -> None:
    doc = crafted.doc()
    _claim(doc, *HUGE[claim])
    crafted.seal(doc)
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(CheckpointCorruptedError, match="bytes"):
            tiercheck.load(crafted.root, step=2)
        elapsed = time.monotonic() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert elapsed < 5
    assert peak < 8 << 20, f"{peak} bytes allocated for a {len(crafted.shard)}-byte shard"
    assert_rejected_everywhere(crafted)


@pytest.mark.parametrize("claim", ["tensor-2**40-float32", "ndarray-2**40", "bytes-2**40"])
def test_a_huge_claim_backed_by_a_sparse_file_fails_cleanly(crafted: Crafted, claim: str) -> None:
    """The file really is as large as claimed (sparse): whatever the reader tries, the result
    is CheckpointCorruptedError, not MemoryError or RuntimeError, and quickly. (The claim is
    then legitimate, so this relies on the kernel refusing a 1-4 TiB allocation: with
    overcommit_memory=1 the reader would really try to read terabytes, so it is skipped.)"""
    with open("/proc/sys/vm/overcommit_memory") as f:
        if f.read().strip() == "1":
            pytest.skip("vm.overcommit_memory=1: the kernel would grant the allocation")
    doc = crafted.doc()
    _claim(doc, *HUGE[claim])
    crafted.seal(doc)
    try:
        with open(crafted.dir / SHARD, "r+b") as f:
            f.truncate(doc["files"][0]["length"])
    except OSError as exc:
        pytest.skip(f"this filesystem cannot hold a sparse {doc['files'][0]['length']}-byte file: {exc}")
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptedError):
        tiercheck.load(crafted.root, step=2)
    assert time.monotonic() - t0 < 5


def test_a_huge_compressed_claim_fails_cleanly(crafted: Crafted) -> None:
    """zstd shards are not bounded by their stored size; the claim must still fail cleanly."""
    import zstandard

    stored = zstandard.ZstdCompressor().compress(crafted.shard)
    (crafted.dir / SHARD).write_bytes(stored)
    doc = crafted.doc()
    _claim(doc, *HUGE["tensor-2**40-float32"])
    doc["files"][0].update(codec="zstd", stored_length=len(stored))
    crafted.seal(doc)
    t0 = time.monotonic()
    with pytest.raises(CheckpointCorruptedError):
        tiercheck.load(crafted.root, step=2)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("claim", [MAX_MANIFEST_BYTES, MAX_MANIFEST_BYTES + 1, 2**40])
def test_a_marker_claiming_a_huge_manifest_allocates_no_more_than_the_file(crafted: Crafted, claim: int) -> None:
    crafted.seal(crafted.manifest, length=claim)  # the largest the reader accepts, and more
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptedError):
            tiercheck.load(crafted.root, step=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak >> 20} MiB allocated to read a {len(crafted.manifest)}-byte manifest"


@contextlib.contextmanager
def address_space_limit(headroom: int) -> Iterator[None]:
    """Like a container without overcommit: allocations past `headroom` fail."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_marker_claiming_a_huge_manifest_under_a_memory_limit(crafted: Crafted) -> None:
    crafted.seal(crafted.manifest, length=MAX_MANIFEST_BYTES)
    with address_space_limit(512 << 20):
        with pytest.raises(CheckpointCorruptedError):
            tiercheck.load(crafted.root, step=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = tiercheck.load(crafted.root)
    assert_is_step(got, 1)


# ------------------------------------------------- compressed shards: zstd bombs


def _zstd_frame(*parts: bytes | int) -> bytes:
    """One zstd frame, streamed as the remote tier writes it, of `parts` in order: bytes as
    given, an int n as n zero bytes (a few bytes of zstd per 128 KiB of zeros)."""
    import zstandard

    cobj = zstandard.ZstdCompressor(level=1).compressobj()
    out = []
    for part in parts:
        if isinstance(part, int):
            zeros = bytes(min(part, 8 << 20))
            for pos in range(0, part, len(zeros)):
                out.append(cobj.compress(zeros if part - pos >= len(zeros) else zeros[: part - pos]))
        else:
            out.append(cobj.compress(part))
    out.append(cobj.flush())
    return b"".join(out)


def _store_compressed(c: Crafted, stored: bytes) -> None:
    """Step 2's shard replaced by `stored`, declared zstd (the declared length unchanged)."""
    (c.dir / SHARD).write_bytes(stored)
    doc = c.doc()
    doc["files"][0].update(codec="zstd", stored_length=len(stored))
    c.seal(doc)


def _verify_step_2(c: Crafted, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["verify", str(c.root), "--step", "2"])
    return rc, capsys.readouterr().out


def test_a_compressed_shard_of_several_frames_reads_back(crafted: Crafted, capsys: pytest.CaptureFixture[str]) -> None:
    """The format allows one or more frames that decompress to exactly the declared length."""
    half = len(crafted.shard) // 2 + 100
    _store_compressed(crafted, _zstd_frame(crafted.shard[:half]) + _zstd_frame(crafted.shard[half:]))
    assert_is_step(tiercheck.load(crafted.root, step=2), 2)
    assert _verify_step_2(crafted, capsys) == (0, "step 2: ok (1 rank)\n")


BAD_STREAMS: dict[str, Callable[[bytes], bytes]] = {
    "512MiB-past-the-end": lambda shard: _zstd_frame(shard, 512 << 20),
    "one-byte-past-the-end": lambda shard: _zstd_frame(shard, b"\1"),
    "one-byte-short": lambda shard: _zstd_frame(shard[:-1]),
    "junk-after-the-frame": lambda shard: _zstd_frame(shard) + b"junk",
    "a-second-frame-past-the-end": lambda shard: _zstd_frame(shard) + _zstd_frame(b"\1"),
}


@pytest.mark.parametrize("stream", list(BAD_STREAMS))
def test_a_compressed_shard_that_is_not_its_declared_length_is_corruption(
    crafted: Crafted, capsys: pytest.CaptureFixture[str], stream: str
) -> None:
    """Every entry's bytes are intact, but the shard does not decompress to exactly the
    declared length: the step is refused, not read as if it did."""
    _store_compressed(crafted, BAD_STREAMS[stream](crafted.shard))
    rc, out = _verify_step_2(crafted, capsys)
    assert rc == 1 and "step 2: FAILED" in out and SHARD in out, out
    assert_rejected_everywhere(crafted)


def test_a_decompression_bomb_is_read_in_bounded_memory(crafted: Crafted, capsys: pytest.CaptureFixture[str]) -> None:
    """16 KiB on disk that inflate to 512 MiB: the reader never holds more than a fixed
    buffer of decompressed bytes beyond the declared length (16 KiB here)."""
    bomb = _zstd_frame(crafted.shard, 512 << 20)
    assert len(bomb) < 32 << 10
    _store_compressed(crafted, bomb)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptedError, match="more than"):
            tiercheck.load(crafted.root, step=2)
        peak_load = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        rc, out = _verify_step_2(crafted, capsys)
        peak_verify = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rc == 1 and "more than" in out, out
    assert peak_load < 4 << 20, f"load: {peak_load >> 20} MiB allocated for a {len(bomb)}-byte shard"
    assert peak_verify < 4 << 20, f"verify: {peak_verify >> 20} MiB allocated for a {len(bomb)}-byte shard"


# ------------------------------------------------------ links out of the step dir


@pytest.mark.parametrize("name", [SHARD, MANIFEST, COMMIT, "the step directory"])
def test_a_symlink_to_a_valid_copy_outside_is_refused(
    crafted: Crafted, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A link to a valid copy of the file (or of the whole step) outside the tier: following
    it would read bytes from outside the step directory, so the reader refuses it."""
    outside = tmp_path / "outside"
    if name == "the step directory":
        shutil.copytree(crafted.dir, outside)
        shutil.rmtree(crafted.dir)
        crafted.dir.symlink_to(outside, target_is_directory=True)
    else:
        shutil.copyfile(crafted.dir / name, outside)
        (crafted.dir / name).unlink()
        (crafted.dir / name).symlink_to(outside)
    rc, out = _verify_step_2(crafted, capsys)
    assert rc == 1 and "step 2: FAILED" in out and "symbolic link" in out, out
    with pytest.raises(CheckpointCorruptedError, match="symbolic link"):
        tiercheck.load(crafted.root, step=2)
    assert_rejected_everywhere(crafted)
    remote = tmp_path / "remote"  # nor does the upload of step 2 (a writer's catch-up at start) copy it
    ckpt = tiercheck.Checkpointer(local=crafted.root, remote=f"file://{remote}", keep_local=None)
    with ckpt, pytest.raises(TierError, match="symbolic link") as err:
        ckpt.prepare({"x": torch.zeros(1)})  # a writer now: it catches tier 2 up
        ckpt.wait()
    assert (err.value.step, err.value.tier) == (2, "remote")
    assert not (remote / naming.step_dir_name(2)).exists()


def test_a_symlink_inside_the_step_dir_is_refused_too(crafted: Crafted) -> None:
    """Not only links that leave the directory: the reader follows no link at all."""
    (crafted.dir / SHARD).rename(crafted.dir / "copy")
    (crafted.dir / SHARD).symlink_to("copy")
    with pytest.raises(CheckpointCorruptedError, match="symbolic link"):
        tiercheck.load(crafted.root, step=2)


def test_a_root_reached_through_a_symlink_still_reads(crafted: Crafted, tmp_path: Path) -> None:
    """The tier's root itself is the user's choice of path and may be a link."""
    link = tmp_path / "link-to-root"
    link.symlink_to(crafted.root, target_is_directory=True)
    assert_is_step(tiercheck.load(link, step=2), 2)


# ------------------------------------------- a manifest damaged before its upload


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_an_upload_never_re_signs_a_manifest_damaged_on_tier1(
    crafted: Crafted, tmp_path: Path, compression: str | None
) -> None:
    """Step 2's manifest changes on tier 1 after its commit, in a plain value that no shard
    checksum covers. An upload that rewrites the manifest for tier 2 (here: compression)
    must not seal the damaged copy with a fresh, valid marker there."""
    damaged = crafted.manifest.replace(b'"v":"s2"', b'"v":"s9"')
    assert damaged != crafted.manifest and json.loads(damaged)  # still a well-formed manifest
    (crafted.dir / MANIFEST).write_bytes(damaged)
    remote = tmp_path / "remote"
    url = f"file://{remote}"
    # A writer starts by uploading step 2, committed on tier 1 but not on tier 2.
    ckpt = tiercheck.Checkpointer(local=crafted.root, remote=url, keep_local=None, remote_compression=compression)
    with ckpt, pytest.raises(TierError) as err:
        ckpt.prepare({"x": torch.zeros(1)})
        ckpt.wait()
    assert (err.value.step, err.value.tier) == (2, "remote")
    assert str(crafted.dir / MANIFEST) in str(err.value) and "commit marker" in str(err.value)
    assert not (remote / naming.step_dir_name(2)).exists()
    with pytest.raises(NoCheckpointError):  # step 1, intact, was caught up; step 2 never
        tiercheck.load(url, step=2)


# ------------------------------------------------------------- manifest parse cost


def _model_manifest(layers: int) -> bytes:
    """A writer's manifest of a transformer's weights and Adam state (each tensor a view of one
    element, so no bytes are allocated), as `Checkpointer` builds it."""
    names = [
        (f"model.layers.{i}.{m}", shape)
        for i in range(layers)
        for m, shape in [
            *((f"self_attn.{p}_proj.weight", (4096, 4096)) for p in "qkvo"),
            *((f"mlp.{p}_proj.weight", (4096, 11008)) for p in ("gate", "up", "down")),
            ("input_layernorm.weight", (4096,)),
            ("post_attention_layernorm.weight", (4096,)),
        ]
    ]
    big = {shape: torch.zeros(1) for _, shape in names}
    state = {
        "model": {name: big[shape].expand(shape) for name, shape in names},
        "optimizer": {
            "state": {
                i: {"step": torch.zeros(()), "exp_avg": big[s].expand(s), "exp_avg_sq": big[s].expand(s)}
                for i, (_, s) in enumerate(names)
            },
            "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "params": list(range(len(names)))}],
        },
        "step": 7,
    }
    flat = flatten_state(state)
    plan = plan_shard(flat.leaves)
    entries = build_entries(flat.leaves, plan.offsets, ["0123abcd"] * len(flat.leaves), SHARD)
    return encode_manifest(Manifest(2, 0, 1, "crc32c", (ShardFile(SHARD, plan.total_bytes),), entries, flat.tree))


def _tree_manifest(items: list[JsonNode], keys: list[list[str]] | None = None) -> bytes:
    """A manifest without entries whose tree holds `items` as one list (or as a dict's values)."""
    value: JsonNode = {"t": "list", "v": items} if keys is None else {"t": "dict", "k": keys, "v": items}
    return encode_manifest(Manifest(2, 0, 1, "crc32c", (), (), {"t": "dict", "k": [["s", "x"]], "v": [value]}))


PARSED_SHAPES: dict[str, Callable[[], bytes]] = {
    "a model and its Adam state": lambda: _model_manifest(120),
    "a list of None": lambda: _tree_manifest([{"t": "none"}] * 60_000),
    "a list of distinct ints": lambda: _tree_manifest([{"t": "int", "v": str(i)} for i in range(60_000)]),
    "a list of empty lists": lambda: _tree_manifest([{"t": "list", "v": []}] * 60_000),
    "a dict of int keys to None": lambda: _tree_manifest(
        [{"t": "none"}] * 60_000, [["i", str(i)] for i in range(60_000)]
    ),
}


@pytest.mark.parametrize("shape", list(PARSED_SHAPES))
def test_parsing_a_writers_manifest_allocates_a_small_multiple_of_it(shape: str) -> None:
    """About a MiB of each shape: a model's manifest parses into about 5x its bytes (the
    result itself), and no writer's shape into more than 12x (it was up to 20x)."""
    data = PARSED_SHAPES[shape]()
    assert len(data) > 700 << 10
    tracemalloc.start()
    try:
        decode_manifest(data, shape)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    bound = 6 if shape == "a model and its Adam state" else 12
    assert peak < bound * len(data), f"{peak / len(data):.1f}x the {len(data)}-byte manifest"


def _sealed_junk(c: Crafted, unit: bytes, total: int) -> int:
    """Step 2's manifest with an ignored field of `unit` repeated up to `total` bytes in all,
    sealed; returns the manifest's size."""
    doc = c.manifest
    n = (total - len(doc)) // (len(unit) + 1)
    data = doc.replace(b'"tree":', b'"junk":[' + b",".join([unit] * n) + b'],"tree":', 1)
    c.seal(data)
    return len(data)


def test_a_manifest_of_nested_arrays_is_refused_before_parsing(crafted: Crafted) -> None:
    """24 MiB of `[[]]` in a field readers ignore cost 35x its bytes in memory to parse; it is
    denser in arrays than any writer's manifest, and refused before parsing."""
    size = _sealed_junk(crafted, b"[[]]", 24 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointCorruptedError, match="denser than any writer"):
            tiercheck.load(crafted.root, step=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * size, f"{peak / size:.1f}x the {size}-byte manifest"
    assert_rejected_everywhere(crafted)


@pytest.mark.parametrize("unit", [b"{}", b'{"a":0}', b'{"t":"int"}'])
def test_objects_of_no_kind_in_a_manifest_cost_no_memory(crafted: Crafted, unit: bytes) -> None:
    """Objects the format does not define, in a field readers ignore, are dropped as they are
    parsed (they cost up to 25x their bytes): the step still reads, in a few times its size."""
    size = _sealed_junk(crafted, unit, 1 << 20)
    tracemalloc.start()
    try:
        got = tiercheck.load(crafted.root, step=2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert_is_step(got, 2)
    assert peak < 5 * size, f"{peak / size:.1f}x the {size}-byte manifest"


def test_a_state_whose_manifest_is_over_the_limit_is_refused_at_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer never commits a step whose manifest no reader would accept: the save fails
    with a TierError naming the limit, and the step is not listed. (The limit is lowered so
    that a small state crosses it.)"""
    import tiercheck.format.manifest

    monkeypatch.setattr(tiercheck.format.manifest, "MAX_MANIFEST_BYTES", 64 << 10)
    with tiercheck.Checkpointer(local=tmp_path / "c") as ckpt:
        ckpt.save(1, {"small": list(range(10))}).wait()
        handle = ckpt.save(2, {"many": list(range(10_000))})
        with pytest.raises(TierError, match="over the format's limit") as err:
            handle.wait()
        assert (err.value.step, err.value.tier) == (2, "local")
        assert ckpt.steps() == [1]


# ------------------------------------------------------------------- deep nesting


def _deep_manifest(c: Crafted, depth: int, kind: str) -> bytes:
    """Step 2's manifest with one more top-level key holding `depth` nested nodes (built as
    text: json.dumps itself would hit the recursion limit)."""
    text = json.dumps(c.doc()["tree"])
    assert text.startswith('{"t": "dict", "k": [')
    if kind == "list":
        inner = '{"t":"list","v":[' * depth + '{"t":"none"}' + "]}" * depth
    elif kind == "dict":
        inner = '{"t":"dict","k":[["s","a"]],"v":[' * depth + '{"t":"none"}' + "]}" * depth
    else:  # raw JSON arrays, not even tree nodes
        inner = "[" * depth + "]" * depth
    tree = text.replace('{"t": "dict", "k": [', '{"t": "dict", "k": [["s", "deep"], ', 1)
    tree = tree.replace('], "v": [', '], "v": [' + inner + ", ", 1)
    doc = c.doc()
    doc["tree"] = "@TREE@"
    return json.dumps(doc).replace('"@TREE@"', tree).encode()


@pytest.mark.parametrize("kind", ["list", "dict", "raw"])
@pytest.mark.parametrize("depth", [600, 5_000, 10**5])
def test_deep_nesting_is_corruption_not_recursion_error(crafted: Crafted, depth: int, kind: str) -> None:
    crafted.seal(_deep_manifest(crafted, depth, kind))
    assert_rejected_everywhere(crafted)


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_nesting_near_the_limits_never_escapes_as_recursion_error(crafted: Crafted, kind: str) -> None:
    """Between what writers produce (256 levels) and what the schema allows (512), a step may
    be read or refused as corrupted, from a shallow or a deeper caller stack, and a template
    that does not ask for the deep key gets the rest; never a RecursionError."""

    def nested(frames: int, call: Callable[[], object]) -> object:
        return nested(frames - 1, call) if frames else call()

    for depth in range(250, 521, 30):
        crafted.seal(_deep_manifest(crafted, depth, kind))
        for frames in (0, 150):
            got = _outcome(lambda: nested(frames, lambda: tiercheck.load(crafted.root, step=2)))  # noqa: B023
            assert isinstance(got, (dict, CheckpointCorruptedError)), (depth, frames, repr(got))
        with tiercheck.Checkpointer(local=crafted.root, keep_local=None) as ckpt:
            t = template()
            restored = _outcome(lambda: ckpt.restore(t, step=2))  # noqa: B023
            assert restored == 2 or isinstance(restored, CheckpointCorruptedError), (depth, repr(restored))
            if restored == 2:
                assert_is_step(t, 2)


def test_a_valid_nested_state_still_round_trips(tmp_path: Path) -> None:
    deep: object = 1
    for _ in range(150):  # save() accepts up to 200 tree levels
        deep = [deep]
    with tiercheck.Checkpointer(local=tmp_path / "c") as ckpt:
        ckpt.save(1, {"deep": deep}).wait()
    assert tiercheck.load(tmp_path / "c")["deep"] == deep


# -------------------------------------------------- special files instead of files


def _load_in_thread(c: Crafted, step: int | None, wait: float) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out.append(tiercheck.load(c.root, step=step))
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run, daemon=True, name="hostile-load")
    t.start()
    t.join(wait)
    return t, out


@pytest.mark.parametrize("name", [SHARD, MANIFEST, COMMIT])
@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_device_instead_of_a_file(crafted: Crafted, name: str, device: str) -> None:
    target = crafted.dir / name
    target.unlink()
    target.symlink_to(device)
    for step in (2, None):
        t, out = _load_in_thread(crafted, step, wait=10)
        assert not t.is_alive(), f"load({step}) hangs on {name} -> {device}"
        (got,) = out
        if step is None:
            assert isinstance(got, dict), got
            assert_is_step(got, 1)
        else:
            assert isinstance(got, REJECTED), repr(got)


@pytest.mark.parametrize(
    "name",
    [
        SHARD,
        MANIFEST,
        COMMIT,
    ],
)
def test_a_fifo_instead_of_a_file_does_not_hang(crafted: Crafted, name: str) -> None:
    target = crafted.dir / name
    target.unlink()
    os.mkfifo(target)
    results = []
    for step in (2, None):
        t, out = _load_in_thread(crafted, step, wait=1)
        hung = t.is_alive()
        if hung:  # let the stuck open() return (a writer appears and goes) so the thread ends
            with contextlib.suppress(OSError):
                os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
            t.join(10)
        results.append((step, hung, out))
    for step, hung, out in results:
        assert not hung, f"load(step={step}) hangs on a FIFO named {name}"
        (got,) = out
        if step is None:
            assert isinstance(got, dict), repr(got)
            assert_is_step(got, 1)
        else:
            assert isinstance(got, REJECTED), repr(got)


# ------------------------------------------------------------- Hypothesis: any bytes


HOSTILE = settings(
    max_examples=int(os.environ.get("TIERCHECK_HOSTILE_EXAMPLES", "120")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _outcome(call: Callable[[], object]) -> object:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call()
    except REJECTED as exc:
        return exc


def _check_public_paths(c: Crafted, restorer: tiercheck.Checkpointer, allow_success: bool) -> None:
    with no_unpickling():
        got = _outcome(lambda: tiercheck.load(c.root, step=2))
        assert allow_success or isinstance(got, REJECTED), repr(got)
        t = template()
        try:
            restored = _outcome(lambda: restorer.restore(t, step=2))
        except tiercheck.StateMismatchError:  # a decodable manifest that no longer fits
            assert allow_success
        else:
            assert allow_success or isinstance(restored, REJECTED), repr(restored)
        newest = _outcome(lambda: tiercheck.load(c.root))
        assert isinstance(newest, dict), repr(newest)
        if isinstance(got, REJECTED):  # the hostile step is skipped, never half-taken
            assert_is_step(newest, 1)


@pytest.fixture(scope="module")
def restorer(shared: Crafted) -> Iterator[tiercheck.Checkpointer]:
    with tiercheck.Checkpointer(local=shared.root, keep_local=None) as ckpt:
        yield ckpt


@HOSTILE
@given(data=st.binary(max_size=2048))
@example(data=b"")
@example(data=b"[" * 100_000)
@example(data=b'{"format":"tiercheck","version":1,"kind":"commit","step":2,"world_size":1}')
def test_any_bytes_as_commit_marker(shared: Crafted, restorer: tiercheck.Checkpointer, data: bytes) -> None:
    shared.reset()
    (shared.dir / COMMIT).write_bytes(data)
    _check_public_paths(shared, restorer, allow_success=False)


@HOSTILE
@given(data=st.binary(max_size=2048))
@example(data=b"")
@example(data=b"{" * 100_000)
@example(data=b'{"format":"tiercheck","version":1,"kind":"manifest"}')
def test_any_bytes_as_sealed_manifest(shared: Crafted, restorer: tiercheck.Checkpointer, data: bytes) -> None:
    shared.reset()
    shared.seal(data)
    _check_public_paths(shared, restorer, allow_success=False)


@HOSTILE
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.integers(0, 2)), min_size=1, max_size=4))
def test_byte_edits_of_a_sealed_manifest(
    shared: Crafted, restorer: tiercheck.Checkpointer, edits: list[tuple[int, int, int]]
) -> None:
    doc = bytearray(shared.manifest)
    for pos, byte, op in edits:
        i = pos % len(doc)
        if op == 0:
            doc[i] = byte
        elif op == 1:
            del doc[i]
        else:
            doc.insert(i, byte)
    shared.reset()
    shared.seal(bytes(doc))
    _check_public_paths(shared, restorer, allow_success=True)


@HOSTILE
@given(
    field=st.sampled_from(["length", "checksum", "name", "step", "world_size", "checksum_algorithm", "manifests"]),
    value=st.one_of(
        st.integers(-(2**64), 2**64),
        st.sampled_from([2**30, 2**31, 2**40, 0, -1]),
        st.text(max_size=12),
        st.sampled_from(["../" + MANIFEST, "/etc/passwd", MANIFEST + "\x00", "crc32c", "md5", ""]),
        st.none(),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_edited_commit_marker_fields(
    shared: Crafted, restorer: tiercheck.Checkpointer, field: str, value: object
) -> None:
    shared.reset()
    marker = json.loads(shared.marker)
    if field in ("length", "checksum", "name"):
        marker["manifests"][0][field] = value
    else:
        marker[field] = value
    (shared.dir / COMMIT).write_bytes(json.dumps(marker).encode())
    _check_public_paths(shared, restorer, allow_success=marker == json.loads(shared.marker))


def test_the_shared_checkpoint_is_intact_after_the_fuzzing(shared: Crafted) -> None:
    shared.reset()
    assert_is_step(tiercheck.load(shared.root, step=2), 2)
    assert_is_step(tiercheck.load(shared.root), 2)
