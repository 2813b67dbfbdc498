"""Golden bytes pin the on-disk format (docs/format.md).

* The writer's output for a fixed state (manifest, COMMIT, shard) must equal the files
  checked into tests/format/golden/v2/ byte for byte (v2-metrics/: a marker with metrics;
  v2-aligned/: the layout before small entries were packed, read only;
  v2-dtensor/: DTensor entries, tests/format/test_dtensor_format.py). After an intended format change,
  regenerate them with ``TIERCHECK_REGEN_GOLDEN=1 pytest tests/format/test_format_golden.py``
  and review the diff (a change that old readers would misread needs a new version).
* The checked-in golden steps, of every version (v1/, v1-metrics/ and the v2 ones), must
  keep loading to the expected values, so that readers stay compatible with checkpoints
  already on disk.
* An independent mini-reader (json + struct + crc32c, no tiercheck) decodes the golden
  shard, which checks the spec's byte-level claims (alignment, little-endian tensors,
  numpy byte order, aliases, checksum coverage).
* The JSON Schemas in docs/format.md must accept the writer's documents (if the
  `jsonschema` package is installed), multi-rank manifests with `replicated` keys and
  `replica` nodes included (built without a process group from the writer's internals),
  and reject malformed replica nodes and `replicated` lists, as the parser does.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import tiercheck
from tests.helpers.assertions import same
from tiercheck.errors import CheckpointCorruptedError
from tiercheck.format import naming
from tiercheck.format.checksum import checksum_function
from tiercheck.format.manifest import (
    Manifest,
    ManifestRef,
    Marker,
    ShardFile,
    build_entries,
    decode_manifest,
    decode_marker,
    encode_manifest,
    encode_marker,
)
from tiercheck.plan.placement import JobLayout, place_state
from tiercheck.plan.shards import plan_shard

HERE = Path(__file__).resolve().parent
GOLDEN_ROOT = HERE / "golden" / "v2"  # what the writer writes now
V1_ROOT = HERE / "golden" / "v1"  # written by version-1 writers: must still read
ALIGNED_ROOT = HERE / "golden" / "v2-aligned"  # version 2, every entry at 4096: must still read
READ_ROOTS = pytest.mark.parametrize("root", [V1_ROOT, ALIGNED_ROOT, GOLDEN_ROOT], ids=["v1", "v2-aligned", "v2"])
FORMAT_DOC = HERE.parents[1] / "docs" / "format.md"
STEP = 1234
STEP_DIR = naming.step_dir_name(STEP)
SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME
FILES = (SHARD, MANIFEST, COMMIT)
REGEN = os.environ.get("TIERCHECK_REGEN_GOLDEN") == "1"


class Counter:
    """A user object saved through state_dict()/load_state_dict()."""

    def __init__(self, count: int = 0) -> None:
        self.count = count
        self.hist = torch.zeros(2, dtype=torch.int16)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "hist": self.hist}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count = sd["count"]
        self.hist = sd["hist"]


def golden_state() -> dict[Any, Any]:
    f32 = torch.tensor([1.0, -2.5, 3.25])
    counter = Counter(3)
    counter.hist = torch.tensor([-1, 300], dtype=torch.int16)
    return {
        "f32": f32,
        "bf16": torch.tensor([[0.5, -1.0], [2.0, 0.001]], dtype=torch.bfloat16),
        "f16": torch.tensor([65504.0, -0.0], dtype=torch.float16),
        "f8": torch.tensor([1.0, -2.0], dtype=torch.float8_e4m3fn),
        "c64": torch.tensor([1 + 2j], dtype=torch.complex64),
        "i64": torch.arange(-2, 3),
        "u8_0d": torch.tensor(7, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 2),
        "strided": torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),  # stored row-major
        "tied": f32,  # the same tensor: written once
        "np_u4": np.array([1, 2**32 - 1], dtype=np.uint32),
        "np_be": np.array([1, 2], dtype=">i2"),
        "np_0d": np.array(1.5),
        "np_scalar": np.float64(0.1),
        "counter": counter,
        "plain": {
            "int": 42,
            7: "int key",
            "7": "str key",
            "big": -(2**100),
            "neg_zero": -0.0,
            "nan": math.nan,
            "inf": math.inf,
            "tenth": 0.1,
            "tuple": (1, "two", None, (False,)),
            "list": [True, 2.5],
            "bytes": b"\x00\xffhello",
            "str": "h\u00e9llo \u2713",
            "none": None,
            "empty_dict": {},
            "empty_tuple": (),
        },
    }


def loaded_golden_state() -> dict[Any, Any]:
    """What `tiercheck.load` returns for the golden state (no template)."""
    expected = golden_state()
    expected["strided"] = expected["strided"].contiguous()
    counter = expected["counter"]
    expected["counter"] = {"count": counter.count, "hist": counter.hist}
    return expected


def write_golden_state(root: Path) -> Path:
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        ckpt.save(STEP, golden_state()).wait()
    return root / STEP_DIR


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------- golden bytes


def test_writer_output_matches_golden_bytes(tmp_path: Path) -> None:
    produced = write_golden_state(tmp_path / "ckpt")
    assert sorted(os.listdir(produced)) == sorted(FILES)
    golden = GOLDEN_ROOT / STEP_DIR
    if REGEN:
        shutil.rmtree(GOLDEN_ROOT, ignore_errors=True)
        golden.mkdir(parents=True)
        for name in FILES:
            shutil.copyfile(produced / name, golden / name)
        pytest.skip(f"regenerated {golden}; review and commit the diff")
    for name in (MANIFEST, COMMIT):  # text first: the most readable diff on failure
        assert (produced / name).read_text("utf-8") == (golden / name).read_text("utf-8"), name
    assert (produced / SHARD).read_bytes() == (golden / SHARD).read_bytes()


@READ_ROOTS
def test_golden_step_loads_to_the_expected_values(root: Path) -> None:
    before = snapshot(root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = tiercheck.load(root)
        same(loaded, loaded_golden_state())
        assert loaded["tied"] is loaded["f32"]  # one entry region: one tensor, still tied
        same(tiercheck.load(root, step=STEP), loaded_golden_state())
    assert snapshot(root) == before  # reading never writes


def test_v2_differs_from_v1_only_in_the_version() -> None:
    """Without DTensors a version-2 step of the aligned layout is a version-1 step with
    `"version":2`: the shard is the same bytes, the manifest and marker differ in that field
    (and the marker in the manifest's checksum)."""
    old, new = V1_ROOT / STEP_DIR, ALIGNED_ROOT / STEP_DIR
    assert (old / SHARD).read_bytes() == (new / SHARD).read_bytes()
    v1 = (old / MANIFEST).read_bytes()
    assert (new / MANIFEST).read_bytes() == v1.replace(b'"version":1,', b'"version":2,', 1)
    marker = json.loads((old / COMMIT).read_bytes())
    marker["version"] = 2
    marker["manifests"][0]["checksum"] = f"{crc32c.crc32c((new / MANIFEST).read_bytes()):08x}"
    assert json.loads((new / COMMIT).read_bytes()) == marker


@READ_ROOTS
def test_golden_step_restores_into_a_template(tmp_path: Path, root: Path) -> None:
    source = root
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    template = golden_state()
    for v in template.values():  # scribble over every tensor so the restore must fill it
        if isinstance(v, torch.Tensor) and v.numel():
            if v.is_contiguous():
                v.reshape(-1).view(torch.uint8).fill_(0xAB)
            else:
                v.fill_(-7)
    template["plain"] = {"int": 0}
    template["counter"] = Counter()
    f32, strided = template["f32"], template["strided"]
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        assert ckpt.steps() == [STEP]
        assert ckpt.restore(template) == STEP
    expected = golden_state()
    assert template["f32"] is f32 and template["tied"] is f32  # in place, still tied
    assert template["strided"] is strided and not strided.is_contiguous()
    same(template["strided"].contiguous(), expected["strided"].contiguous())
    for key in ("f32", "bf16", "f16", "f8", "c64", "i64", "u8_0d", "bool", "empty", "np_u4", "np_be"):
        same(template[key], expected[key], key)
    same(template["np_scalar"], expected["np_scalar"])
    same(template["plain"]["int"], 42)
    assert template["counter"].count == 3
    same(template["counter"].hist, expected["counter"].hist)


# --------------------------------------------------- an independent reader of the bytes


@READ_ROOTS
def test_golden_shard_decodes_with_an_independent_reader(root: Path) -> None:
    step_dir = root / STEP_DIR
    marker_bytes = (step_dir / COMMIT).read_bytes()
    manifest_bytes = (step_dir / MANIFEST).read_bytes()
    shard = (step_dir / SHARD).read_bytes()
    marker = json.loads(marker_bytes)
    manifest = json.loads(manifest_bytes)

    # The marker covers the manifest: exact length and CRC-32C of all its bytes.
    (ref,) = marker["manifests"]
    assert (ref["name"], ref["length"]) == (MANIFEST, len(manifest_bytes))
    assert ref["checksum"] == f"{crc32c.crc32c(manifest_bytes):08x}"
    assert marker_bytes.endswith(b"}\n") and manifest_bytes.endswith(b"}\n")

    # The shard: the file padded to 4096, checksums cover entries. Entries of the packed
    # layout (v2/) start at a multiple of 64, or of 4096 from 64 KiB up; the earlier layout
    # (v1/, v2-aligned/) put every entry at a multiple of 4096.
    def alignment(length: int) -> int:
        return 64 if root == GOLDEN_ROOT and length < 65536 else 4096

    (file,) = manifest["files"]
    assert (file["name"], file["length"]) == (SHARD, len(shard))
    assert len(shard) % 4096 == 0
    entries = {e["path"]: e for e in manifest["entries"]}
    covered = set()
    for e in manifest["entries"]:
        assert e["offset"] % alignment(e["length"]) == 0, e
        data = shard[e["offset"] : e["offset"] + e["length"]]
        assert len(data) == e["length"]
        assert e["checksum"] == f"{crc32c.crc32c(data):08x}", e["path"]
        covered.update(range(e["offset"], e["offset"] + e["length"]))
    # Non-aliased entries are laid out in order, each at the next boundary of its alignment.
    cursor, seen = 0, {}
    for e in manifest["entries"]:
        key = (e["offset"], e["length"], e["checksum"])
        if e["length"] and key in seen:
            continue  # an alias: same bytes as an earlier entry
        a = alignment(e["length"])
        assert e["offset"] == (cursor + a - 1) // a * a, e["path"]
        seen[key] = e["path"]
        cursor = e["offset"] + e["length"]
    assert (cursor + 4095) // 4096 * 4096 == len(shard)
    if root == GOLDEN_ROOT:
        assert len(shard) == 4096  # packed: every entry of this state in one page

    def raw(path: str) -> bytes:
        e = entries[path]
        return shard[e["offset"] : e["offset"] + e["length"]]

    # Tensors: little-endian, C order; numpy: the byte order of dtype.str.
    assert raw("state['f32']") == struct.pack("<3f", 1.0, -2.5, 3.25)
    assert entries["state['tied']"]["offset"] == entries["state['f32']"]["offset"]
    assert raw("state['bf16']") == struct.pack("<4H", 0x3F00, 0xBF80, 0x4000, 0x3A83)
    assert raw("state['f16']") == struct.pack("<2H", 0x7BFF, 0x8000)
    assert raw("state['f8']") == bytes([0x38, 0xC0])
    assert raw("state['c64']") == struct.pack("<2f", 1.0, 2.0)
    assert raw("state['i64']") == struct.pack("<5q", -2, -1, 0, 1, 2)
    assert raw("state['u8_0d']") == b"\x07" and entries["state['u8_0d']"]["shape"] == []
    assert raw("state['bool']") == b"\x01\x00\x01"
    assert raw("state['strided']") == struct.pack("<6i", 0, 3, 1, 4, 2, 5)
    assert entries["state['empty']"]["length"] == 0
    assert entries["state['empty']"]["offset"] == entries["state['strided']"]["offset"]
    assert entries["state['np_u4']"]["dtype"] == "<u4"
    assert raw("state['np_u4']") == struct.pack("<2I", 1, 2**32 - 1)
    assert entries["state['np_be']"]["dtype"] == ">i2"
    assert raw("state['np_be']") == struct.pack(">2h", 1, 2)
    assert (entries["state['np_scalar']"]["kind"], entries["state['np_scalar']"]["shape"]) == ("npscalar", [])
    assert raw("state['np_scalar']") == struct.pack("<d", 0.1)
    assert raw("state['plain']['bytes']") == b"\x00\xffhello"
    assert raw("state['counter']['hist']") == struct.pack("<2h", -1, 300)

    # The tree keeps types: int keys, big ints as decimal text, floats as float.hex.
    tree = manifest["tree"]
    assert tree["t"] == "dict"
    plain = tree["v"][tree["k"].index(["s", "plain"])]
    values = dict(zip(map(tuple, plain["k"]), plain["v"], strict=True))
    assert values[("i", "7")] == {"t": "str", "v": "int key"}
    assert values[("s", "7")] == {"t": "str", "v": "str key"}
    assert values[("s", "big")] == {"t": "int", "v": str(-(2**100))}
    assert values[("s", "neg_zero")] == {"t": "float", "v": "-0x0.0p+0"}
    assert values[("s", "nan")] == {"t": "float", "v": "nan"}
    assert values[("s", "inf")] == {"t": "float", "v": "inf"}
    assert values[("s", "tenth")] == {"t": "float", "v": "0x1.999999999999ap-4"}
    assert values[("s", "tuple")]["t"] == "tuple"
    assert values[("s", "empty_tuple")] == {"t": "tuple", "v": []}
    assert values[("s", "empty_dict")] == {"t": "dict", "k": [], "v": []}
    counter = tree["v"][tree["k"].index(["s", "counter"])]
    assert counter["t"] == "stateful" and counter["v"]["t"] == "dict"


@READ_ROOTS
def test_golden_documents_pass_the_reference_parsers(root: Path) -> None:
    step_dir = root / STEP_DIR
    marker = decode_marker((step_dir / COMMIT).read_bytes(), "golden")
    manifest = decode_manifest((step_dir / MANIFEST).read_bytes(), "golden")
    assert (marker.step, marker.world_size, manifest.step, manifest.rank) == (STEP, 1, STEP, 0)


def test_unknown_version_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_ROOT, root)
    marker_path = root / STEP_DIR / COMMIT
    marker = json.loads(marker_path.read_bytes())
    marker["version"] = 3
    marker_path.write_bytes(json.dumps(marker).encode())
    with pytest.raises(CheckpointCorruptedError, match="version"):
        tiercheck.load(root, step=STEP)


def test_unknown_checksum_algorithm_is_rejected(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_ROOT, root)
    step_dir = root / STEP_DIR
    manifest = json.loads((step_dir / MANIFEST).read_bytes())
    manifest["checksum_algorithm"] = "md5"
    data = json.dumps(manifest).encode()
    (step_dir / MANIFEST).write_bytes(data)
    marker = json.loads((step_dir / COMMIT).read_bytes())
    marker["manifests"][0].update(length=len(data), checksum=f"{crc32c.crc32c(data):08x}")
    (step_dir / COMMIT).write_bytes(json.dumps(marker).encode())
    with pytest.raises(CheckpointCorruptedError, match="md5"):
        tiercheck.load(root, step=STEP)


# --------------------------------------------------------------------- docs/format.md


def _doc_blocks() -> dict[str, str]:
    """Fenced code blocks of docs/format.md that follow a ``<!-- schema:NAME -->`` line."""
    text = FORMAT_DOC.read_text("utf-8")
    return dict(re.findall(r"<!-- schema:(\w+) -->\s*```json\n(.*?)```", text, flags=re.S))


def _doc_examples() -> list[str]:
    text = FORMAT_DOC.read_text("utf-8")
    return [b for b in re.findall(r"```json\n(.*?)```", text, flags=re.S) if '"$schema"' not in b]


def test_format_doc_examples_are_what_the_writer_produces(tmp_path: Path) -> None:
    w = torch.arange(3.0)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(7, {"w": w, 5: (1, -0.0, b"xy"), "tied": w}).wait()
    step_dir = tmp_path / naming.step_dir_name(7)
    manifest_example, marker_example = _doc_examples()
    assert json.loads(manifest_example) == json.loads((step_dir / MANIFEST).read_bytes())
    assert (marker_example.strip() + "\n").encode() == (step_dir / COMMIT).read_bytes()
    assert (step_dir / SHARD).stat().st_size == 4096


@pytest.fixture(scope="module")
def validators() -> dict[str, Any]:
    jsonschema = pytest.importorskip("jsonschema")
    blocks = _doc_blocks()
    assert sorted(blocks) == ["manifest", "marker"]
    out = {}
    for name, text in blocks.items():
        schema = json.loads(text)
        jsonschema.Draft202012Validator.check_schema(schema)
        out[name] = jsonschema.Draft202012Validator(schema)
    return out


def _errors(validator: Any, doc: object) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]


def test_schemas_accept_the_golden_and_fresh_documents(validators: dict[str, Any], tmp_path: Path) -> None:
    fresh = write_golden_state(tmp_path / "ckpt")
    for step_dir in (V1_ROOT / STEP_DIR, GOLDEN_ROOT / STEP_DIR, fresh):
        assert _errors(validators["manifest"], json.loads((step_dir / MANIFEST).read_bytes())) == []
        assert _errors(validators["marker"], json.loads((step_dir / COMMIT).read_bytes())) == []
    manifest_example, marker_example = _doc_examples()
    assert _errors(validators["manifest"], json.loads(manifest_example)) == []
    assert _errors(validators["marker"], json.loads(marker_example)) == []


def _mutated(doc: dict[str, Any], path: tuple[Any, ...], value: object) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    target = doc
    for p in path[:-1]:
        target = target[p]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


_DELETE = object()


def _case_id(path: tuple[Any, ...], value: object) -> str:
    """A test id that is the same in every process (pytest-xdist's workers compare them):
    the deleted-field marker by name, not by its address."""
    shown = "<deleted>" if value is _DELETE else repr(value)
    return f"{'.'.join(map(str, path))}={shown}"[:60]
BAD_MANIFESTS = [
    (("version",), 3),
    (("version",), 0),
    (("kind",), "commit"),
    (("step",), -1),
    (("step",), "1234"),
    (("world_size",), 0),
    (("rank",), 2**20),
    (("checksum_algorithm",), "md5"),
    (("files", 0, "name"), "../rank-00000-of-00001.shard"),
    (("files", 0, "name"), "/tmp/rank-00000-of-00001.shard"),
    (("files", 0, "name"), "s3://bucket/rank-00000-of-00001.shard"),
    (("entries", 0, "file"), "../x"),
    (("entries", 0, "shape"), [1] * 65),
    (("entries", 0, "shape"), [-1]),
    (("entries", 0, "offset"), -4096),
    (("entries", 0, "codec"), "zstd"),
    (("entries", 0, "checksum"), "ABCDEF12"),
    (("entries", 0, "kind"), "pickle"),
    (("entries", 0, "dtype"), "float4_e2m1fn_x2"),
    (("entries", 0, "path"), _DELETE),
    (("tree",), {"t": "list", "v": []}),
    (("tree", "t"), "pickle"),
    (("tree", "k", 0), ["x", "f32"]),
    (("tree", "v", 0), {"t": "int", "v": 5}),
    (("tree", "v", 0), {"t": "float", "v": 0.5}),
    (("tree", "v", 0), {"t": "bool", "v": "true"}),
    (("tree", "v", 0), {"t": "tensor"}),
    (("tree", "v", 0), {"t": "stateful", "v": {"t": "list", "v": []}}),
]


@pytest.mark.parametrize(
    ("path", "value"), BAD_MANIFESTS, ids=[_case_id(p, v) for p, v in BAD_MANIFESTS]
)
def test_schema_rejects_invalid_manifests(validators: dict[str, Any], path: tuple[Any, ...], value: object) -> None:
    golden = json.loads((GOLDEN_ROOT / STEP_DIR / MANIFEST).read_bytes())
    doc = _mutated(golden, path, value)
    assert _errors(validators["manifest"], doc) != []


# The checksum algorithm is not a parse error: it is checked when a step is read
# (test_unknown_checksum_algorithm_is_rejected).
PARSE_ERRORS = [p for p in BAD_MANIFESTS if p[0] != ("checksum_algorithm",)]


@pytest.mark.parametrize(("path", "value"), PARSE_ERRORS)
def test_reference_parser_rejects_the_same_invalid_manifests(path: tuple[Any, ...], value: object) -> None:
    golden = json.loads((GOLDEN_ROOT / STEP_DIR / MANIFEST).read_bytes())
    with pytest.raises(CheckpointCorruptedError):
        decode_manifest(json.dumps(_mutated(golden, path, value)).encode(), "x")


BAD_MARKERS = [
    (("kind",), "manifest"),
    (("step",), 2**63),
    (("world_size",), 2**20 + 1),
    (("manifests", 0, "name"), "../rank-00000-of-00001.manifest.json"),
    (("manifests", 0, "length"), -1),
    (("manifests", 0, "checksum"), "xyz"),
    (("manifests",), []),
]


@pytest.mark.parametrize(("path", "value"), BAD_MARKERS)
def test_schema_and_parser_reject_invalid_markers(
    validators: dict[str, Any], path: tuple[Any, ...], value: object
) -> None:
    golden = json.loads((GOLDEN_ROOT / STEP_DIR / COMMIT).read_bytes())
    doc = _mutated(golden, path, value)
    assert _errors(validators["marker"], doc) != []
    with pytest.raises(CheckpointCorruptedError):
        decode_marker(json.dumps(doc).encode(), "x")


@pytest.mark.parametrize("version", [True, 1.0, 2.0, "2"])
def test_version_must_be_the_integer_1_or_2(version: object) -> None:
    for name, decode in ((MANIFEST, decode_manifest), (COMMIT, decode_marker)):
        doc = json.loads((GOLDEN_ROOT / STEP_DIR / name).read_bytes())
        doc["version"] = version
        with pytest.raises(CheckpointCorruptedError, match="version"):
            decode(json.dumps(doc).encode(), name)


# ------------------------------------------------------ multi-rank: replicated keys


def _job_rank_state(rank: int) -> dict[Any, Any]:
    """What rank `rank` of a data-parallel job saves: model, optimizer and int key 3 the same
    on every rank, the rest per rank (a stateful object among them)."""
    counter = Counter(rank)
    counter.hist = torch.tensor([rank, -rank], dtype=torch.int16)
    return {
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([0.5])},
        "optimizer": {"state": {0: {"m": torch.ones(2, dtype=torch.bfloat16)}}, "lr": 0.1},
        3: (1, "three", None),
        "shard": torch.full((4,), float(rank)),
        "counter": counter,
        "position": 100 + rank,
    }


JOB_REPLICATED = ("model", "optimizer", 3)


def _writer_parts(
    states: list[dict[Any, Any]], replicated: tuple[Any, ...], step: int
) -> tuple[list[bytes], bytes, list[Manifest]]:
    """Each rank's manifest bytes, the commit marker and the manifests, as the writer builds
    them, without a process group: `placement.place_state` (replica nodes, owners, the
    `replicated` list), then the manifest and marker as the writer builds them."""
    world = len(states)
    checksum = checksum_function("crc32c")
    encoded: list[bytes] = []
    manifests: list[Manifest] = []
    for rank, state in enumerate(states):
        placed = place_state(state, rank, frozenset(replicated), JobLayout(world), "balance")
        flat, keys = placed.flat, placed.replicated
        plan = plan_shard(flat.leaves)
        sums = []
        for leaf, src in zip(flat.leaves, flat.sources, strict=True):
            if isinstance(src, torch.Tensor):
                data = src.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            elif isinstance(src, np.ndarray):
                data = np.ascontiguousarray(src).tobytes()
            else:
                assert isinstance(src, (bytes, bytearray))
                data = bytes(src)
            assert len(data) == leaf.nbytes
            sums.append(checksum(data))
        shard = naming.shard_name(rank, world)
        m = Manifest(
            step=step,
            rank=rank,
            world_size=world,
            checksum_algorithm="crc32c",
            files=(ShardFile(shard, plan.total_bytes),),
            entries=build_entries(flat.leaves, plan.offsets, sums, shard),
            tree=flat.tree,
            replicated=keys,
        )
        manifests.append(m)
        encoded.append(encode_manifest(m))
    refs = tuple(ManifestRef(naming.manifest_name(r, world), len(b), checksum(b)) for r, b in enumerate(encoded))
    return encoded, encode_marker(Marker(step, world, "crc32c", refs)), manifests


@pytest.mark.parametrize("world", [2, 3])
def test_multi_rank_manifests_round_trip_and_pass_the_schema(validators: dict[str, Any], world: int) -> None:
    encoded, marker, manifests = _writer_parts([_job_rank_state(r) for r in range(world)], JOB_REPLICATED, 42)
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, (data, m) in enumerate(zip(encoded, manifests, strict=True)):
        decoded = decode_manifest(data, f"rank {rank}")
        assert decoded == m
        assert encode_manifest(decoded) == data
        doc = json.loads(data)
        assert list(doc)[-1] == "replicated"
        assert doc["replicated"] == [["s", "model"], ["s", "optimizer"], ["i", "3"]]
        assert _errors(validators["manifest"], doc) == []
        for k, v in zip(doc["tree"]["k"], doc["tree"]["v"], strict=True):
            if v["t"] == "replica":
                assert set(v) == {"t", "r"} and v["r"] != rank and k in doc["replicated"]
            elif k in doc["replicated"]:
                owners.setdefault(tuple(k), []).append(rank)
    # Each replicated key has exactly one owner, and some rank holds a replica node.
    assert sorted(owners) == sorted([("s", "model"), ("s", "optimizer"), ("i", "3")])
    assert all(len(v) == 1 for v in owners.values())
    assert len({r for v in owners.values() for r in v}) > 1  # "balance" spreads them
    assert _errors(validators["marker"], json.loads(marker)) == []
    assert decode_marker(marker, "marker").world_size == world


def test_single_rank_save_with_replicated_keys_passes_the_schema(validators: dict[str, Any], tmp_path: Path) -> None:
    # World size 1: the `replicated` list is written, every key is this rank's own.
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, replicated=("f32", "plain")) as ckpt:
        ckpt.save(STEP, golden_state()).wait()
    data = (tmp_path / STEP_DIR / MANIFEST).read_bytes()
    doc = json.loads(data)
    assert doc["replicated"] == [["s", "f32"], ["s", "plain"]]
    assert all(v["t"] != "replica" for v in doc["tree"]["v"])
    assert _errors(validators["manifest"], doc) == []
    assert decode_manifest(data, "single").replicated == (("s", "f32"), ("s", "plain"))
    # Without replicated keys the field is absent (the golden manifest pins the bytes).
    assert "replicated" not in json.loads((GOLDEN_ROOT / STEP_DIR / MANIFEST).read_bytes())


def _doc_multirank_examples() -> list[str]:
    """The multi-rank example of docs/format.md: fenced as ``json multirank`` so that the
    single-rank examples (`_doc_examples`, fenced as plain ``json``) stay two."""
    text = FORMAT_DOC.read_text("utf-8")
    return re.findall(r"```json multirank\n(.*?)```", text, flags=re.S)


def test_format_doc_multirank_example_is_what_the_writer_produces(validators: dict[str, Any]) -> None:
    w = torch.arange(2.0)
    states = [{"model": {"w": w}, "position": 100 + r} for r in range(2)]
    encoded, marker, _ = _writer_parts(states, ("model",), 30)
    rank0, rank1, marker_example = _doc_multirank_examples()
    for example, data in ((rank0, encoded[0]), (rank1, encoded[1])):
        doc = json.loads(example)
        assert doc == json.loads(data)
        assert _errors(validators["manifest"], doc) == []
        decode_manifest(json.dumps(doc).encode(), "doc example")
    assert json.loads(rank1)["tree"]["v"][0] == {"t": "replica", "r": 0}
    assert (marker_example.strip() + "\n").encode() == marker
    assert _errors(validators["marker"], json.loads(marker_example)) == []


def _multirank_doc() -> dict[str, Any]:
    """A valid rank-1 manifest of a 2-rank step whose "model" and 3 are replicas of rank 0."""
    encoded, _, _ = _writer_parts([_job_rank_state(r) for r in range(2)], ("model", 3), 42)
    doc: dict[str, Any] = json.loads(encoded[1])
    assert doc["tree"]["v"][0] == {"t": "replica", "r": 0}
    return doc


def _replica_below(kind: str) -> dict[str, Any]:
    replica = {"t": "replica", "r": 0}
    if kind == "dict":
        return {"t": "dict", "k": [["s", "w"]], "v": [replica]}
    if kind == "list":
        return {"t": "list", "v": [replica]}
    if kind == "tuple":
        return {"t": "tuple", "v": [{"t": "none"}, replica]}
    assert kind == "stateful"
    return {"t": "stateful", "v": {"t": "dict", "k": [["s", "w"]], "v": [replica]}}


# Mutations of `_multirank_doc()` that both the schema and the reference parser reject.
BAD_MULTIRANK = [
    (("tree", "v", 0), {"t": "replica", "r": 0, "e": 0}),
    (("tree", "v", 0), {"t": "replica", "r": 0, "v": None}),
    (("tree", "v", 0), {"t": "replica", "r": 0, "extra": 1}),
    (("tree", "v", 0), {"t": "replica"}),
    (("tree", "v", 0), {"t": "replica", "r": -1}),
    (("tree", "v", 0), {"t": "replica", "r": 2**20}),
    (("tree", "v", 0), {"t": "replica", "r": "0"}),
    (("tree", "v", 0), {"t": "replica", "r": True}),
    (("tree", "v", 0), _replica_below("dict")),
    (("tree", "v", 0), _replica_below("list")),
    (("tree", "v", 0), _replica_below("tuple")),
    (("tree", "v", 0), _replica_below("stateful")),
    (("tree",), {"t": "replica", "r": 0}),
    (("replicated",), _DELETE),
    (("replicated",), "model"),
    (("replicated",), [["s", "model"], ["i", "3"], ["s", "model"]]),
    (("replicated", 0), ["x", "model"]),
    (("replicated", 0), ["s"]),
    (("replicated", 1), ["i", "three"]),
]


@pytest.mark.parametrize(
    ("path", "value"), BAD_MULTIRANK, ids=[_case_id(p, v) for p, v in BAD_MULTIRANK]
)
def test_schema_and_parser_reject_invalid_multi_rank_manifests(
    validators: dict[str, Any], path: tuple[Any, ...], value: object
) -> None:
    doc = _mutated(_multirank_doc(), path, value)
    assert _errors(validators["manifest"], doc) != []
    with pytest.raises(CheckpointCorruptedError):
        decode_manifest(json.dumps(doc).encode(), "x")


def test_schema_describes_what_writers_write_for_replicated(validators: dict[str, Any]) -> None:
    doc = _multirank_doc()
    assert _errors(validators["manifest"], doc) == []
    # Writers omit an empty list; readers take `[]` as absent (valid without replicas).
    owner = json.loads(_writer_parts([_job_rank_state(0)], (), 42)[0][0])
    assert "replicated" not in owner
    owner["replicated"] = []
    assert _errors(validators["manifest"], owner) != []
    assert decode_manifest(json.dumps(owner).encode(), "x").replicated == ()
    # A replica node's extra field is rejected; other nodes' unknown fields are not.
    extra = _mutated(doc, ("tree", "v", 0, "note"), "x")
    assert _errors(validators["manifest"], extra) != []
    tolerant = _mutated(doc, ("tree", "v", 3, "note"), "x")
    assert tolerant["tree"]["v"][3]["t"] == "tensor"
    assert _errors(validators["manifest"], tolerant) == []
    decode_manifest(json.dumps(tolerant).encode(), "x")


# ------------------------------------------------------ commit marker: optional metrics

METRICS_ROOT = HERE / "golden" / "v2-metrics"  # what the writer writes now
V1_METRICS_ROOT = HERE / "golden" / "v1-metrics"  # written by version-1 writers: must still read
METRICS_STEP = 42


def golden_metrics() -> dict[str, Any]:
    return {
        "val_loss": 0.31,
        "neg_zero": -0.0,
        "nan": math.nan,
        "inf": math.inf,
        "-inf": -math.inf,
        "epoch": 3,
        "big": -(2**100),
        "bf16": torch.tensor(0.1, dtype=torch.bfloat16),  # read with .item(): exactly
        "np_f32": np.float32(0.1),
        "h\u00e9": 1e-300,
    }


def expected_metrics() -> dict[str, int | float]:
    m = golden_metrics()
    m["bf16"] = torch.tensor(0.1, dtype=torch.bfloat16).item()
    m["np_f32"] = float(np.float32(0.1))
    return m


def write_metrics_golden(root: Path) -> Path:
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        ckpt.save(METRICS_STEP, {"w": torch.arange(3.0)}, metrics=golden_metrics()).wait()
    return root / naming.step_dir_name(METRICS_STEP)


def same_metrics(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert type(got[k]) is type(want[k]), k
        if isinstance(want[k], float):
            assert got[k].hex() == want[k].hex(), k  # NaN, -0.0 and every bit
        else:
            assert got[k] == want[k], k


def test_marker_with_metrics_matches_golden_bytes(tmp_path: Path) -> None:
    produced = write_metrics_golden(tmp_path / "ckpt")
    golden = METRICS_ROOT / naming.step_dir_name(METRICS_STEP)
    if REGEN:
        shutil.rmtree(METRICS_ROOT, ignore_errors=True)
        golden.mkdir(parents=True)
        for name in FILES:
            shutil.copyfile(produced / name, golden / name)
        pytest.skip(f"regenerated {golden}; review and commit the diff")
    for name in FILES:
        assert (produced / name).read_bytes() == (golden / name).read_bytes(), name
    marker = json.loads((golden / COMMIT).read_bytes())
    assert list(marker)[-1] == "metrics"
    assert marker["metrics"]["nan"] == {"t": "float", "v": "nan"}
    assert marker["metrics"]["neg_zero"] == {"t": "float", "v": "-0x0.0p+0"}
    assert marker["metrics"]["big"] == {"t": "int", "v": str(-(2**100))}


@pytest.mark.parametrize("source", [V1_METRICS_ROOT, METRICS_ROOT], ids=["v1", "v2"])
def test_golden_metrics_read_back_exactly_without_loading_tensors(tmp_path: Path, source: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    (root / naming.step_dir_name(METRICS_STEP) / SHARD).unlink()  # no tensor byte is needed
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        same_metrics(ckpt.metrics(METRICS_STEP), expected_metrics())
        with pytest.raises(tiercheck.NoCheckpointError):
            ckpt.metrics(7)
    same_metrics(dict(decode_marker((source / naming.step_dir_name(METRICS_STEP) / COMMIT).read_bytes(),
                                    "m").metrics), expected_metrics())  # fmt: skip
    assert tiercheck.load(source)["w"].equal(torch.arange(3.0))


@READ_ROOTS
def test_markers_without_metrics_still_read(tmp_path: Path, root: Path) -> None:
    assert decode_marker((root / STEP_DIR / COMMIT).read_bytes(), "old").metrics == ()
    source = root
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        assert ckpt.metrics(STEP) == {}


def test_format_doc_metrics_example_is_what_the_writer_produces(tmp_path: Path, validators: dict[str, Any]) -> None:
    (example,) = re.findall(r"```json metrics\n(.*?)```", FORMAT_DOC.read_text("utf-8"), flags=re.S)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(42, {"w": torch.arange(3.0)}, metrics={"val_loss": 0.31, "epoch": 3, "nan": math.nan}).wait()
    assert (example.strip() + "\n").encode() == (tmp_path / naming.step_dir_name(42) / COMMIT).read_bytes()
    assert _errors(validators["marker"], json.loads(example)) == []


def test_schema_accepts_the_golden_marker_with_metrics(validators: dict[str, Any]) -> None:
    for root in (V1_METRICS_ROOT, METRICS_ROOT):
        marker = json.loads((root / naming.step_dir_name(METRICS_STEP) / COMMIT).read_bytes())
        assert _errors(validators["marker"], marker) == []


BAD_METRICS = [
    ("x", 0.5),
    ("x", {"t": "float", "v": 0.5}),
    ("x", {"t": "int", "v": "1.5"}),
    ("x", {"t": "float", "v": "0.5"}),
    ("x", {"t": "bool", "v": True}),
    ("x", {"t": "str", "v": "a"}),
    ("x", {"t": "float"}),
    ("x", {"t": "float", "v": "nan", "e": 0}),
    ("", {"t": "int", "v": "1"}),
    ("n" * 257, {"t": "int", "v": "1"}),
]


@pytest.mark.parametrize(("name", "node"), BAD_METRICS, ids=[f"{n[:8]!r}={v!r}"[:50] for n, v in BAD_METRICS])
def test_schema_and_parser_reject_bad_metrics(validators: dict[str, Any], name: str, node: object) -> None:
    doc = json.loads((METRICS_ROOT / naming.step_dir_name(METRICS_STEP) / COMMIT).read_bytes())
    doc["metrics"] = {"ok": {"t": "int", "v": "1"}, name: node}
    assert _errors(validators["marker"], doc) != []
    with pytest.raises(CheckpointCorruptedError):
        decode_marker(json.dumps(doc).encode(), "x")
    doc["metrics"] = [["x", 1]]
    assert _errors(validators["marker"], doc) != []
    with pytest.raises(CheckpointCorruptedError):
        decode_marker(json.dumps(doc).encode(), "x")


def test_an_empty_metrics_object_is_not_what_writers_write(validators: dict[str, Any]) -> None:
    doc = json.loads((METRICS_ROOT / naming.step_dir_name(METRICS_STEP) / COMMIT).read_bytes())
    doc["metrics"] = {}
    assert _errors(validators["marker"], doc) != []
    with pytest.raises(CheckpointCorruptedError):
        decode_marker(json.dumps(doc).encode(), "x")
