"""Integrity: damaged bytes or metadata are never returned as valid data.

Each case damages the newest of two committed steps in one way and checks that
`restore()` warns (naming the step and the file) and falls back to the older step
bit-exact, that asking for the damaged step raises `CheckpointCorruptedError` (also a
`ValueError`), and that `tiercheck.load` does the same. A Hypothesis fuzz feeds the
manifest and marker parsers arbitrary bytes, arbitrary JSON and mutated valid documents:
they may only succeed or raise `CheckpointCorruptedError`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tiercheck
from tiercheck.errors import CheckpointCorruptedError
from tiercheck.format import naming
from tiercheck.format.checksum import checksum_function
from tiercheck.format.manifest import MAX_NDIM, decode_manifest, decode_marker

SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME


# ------------------------------------------------------------------------ helpers


def make_state(step: int) -> dict[Any, Any]:
    """A small state whose every value is a pure function of `step`."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(64, 64, generator=g),
        "h": torch.randn(300, generator=g).to(torch.bfloat16),
        "idx": torch.arange(step, step + 10, dtype=torch.int64),
        "np": np.random.default_rng(step).standard_normal(50),
        "blob": bytes([step % 256]) * 9,
        "meta": {"step": step, 0: (step, -0.0), "lr": 0.1 / (step + 1), "name": f"s{step}"},
    }


def same(actual: object, expected: object) -> bool:
    """Bit-exact equality, types included (NaN and -0.0 compared by bits)."""
    if type(actual) is not type(expected):
        return False
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        return (
            actual.dtype == expected.dtype
            and actual.shape == expected.shape
            and torch.equal(
                actual.contiguous().reshape(-1).view(torch.uint8),
                expected.contiguous().reshape(-1).view(torch.uint8),
            )
        )
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray)
        return (
            actual.dtype == expected.dtype and actual.shape == expected.shape and actual.tobytes() == expected.tobytes()
        )
    if isinstance(expected, dict):
        assert isinstance(actual, dict)
        return list(actual) == list(expected) and all(same(actual[k], expected[k]) for k in expected)
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple))
        return len(actual) == len(expected) and all(same(a, e) for a, e in zip(actual, expected, strict=True))
    if isinstance(expected, float):
        return struct.pack("<d", actual) == struct.pack("<d", expected)  # type: ignore[arg-type]
    return actual == expected


def step_path(root: Path, step: int, name: str | None = None) -> Path:
    d = root / naming.step_dir_name(step)
    return d if name is None else d / name


def manifest_doc(root: Path, step: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(step_path(root, step, MANIFEST).read_bytes())
    return doc


def entry(root: Path, step: int, path: str) -> dict[str, Any]:
    (found,) = [e for e in manifest_doc(root, step)["entries"] if e["path"] == path]
    return found


def flip_bit(file: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 1 << bit
    file.write_bytes(bytes(data))


def write_manifest_and_marker(root: Path, step: int, manifest: bytes) -> None:
    """Replace a step's manifest and re-seal its marker: a consistent but crafted step."""
    step_path(root, step, MANIFEST).write_bytes(manifest)
    marker = json.loads(step_path(root, step, COMMIT).read_bytes())
    marker["manifests"][0]["length"] = len(manifest)
    marker["manifests"][0]["checksum"] = checksum_function(marker["checksum_algorithm"])(manifest)
    step_path(root, step, COMMIT).write_bytes(json.dumps(marker).encode())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1 and 2 committed under tmp_path/ckpt."""
    d = tmp_path / "ckpt"
    with tiercheck.Checkpointer(local=d, keep_local=None) as ckpt:
        for s in (1, 2):
            ckpt.save(s, make_state(s)).wait()
    return d


# ------------------------------------------------------------- damage, one at a time


def _flip_tensor_bit(root: Path) -> str:
    e = entry(root, 2, "state['w']")
    flip_bit(step_path(root, 2, SHARD), e["offset"] + e["length"] // 2, bit=3)
    return SHARD


def _flip_bf16_bit(root: Path) -> str:
    e = entry(root, 2, "state['h']")
    flip_bit(step_path(root, 2, SHARD), e["offset"] + e["length"] - 1, bit=7)
    return SHARD


def _flip_ndarray_bit(root: Path) -> str:
    e = entry(root, 2, "state['np']")
    flip_bit(step_path(root, 2, SHARD), e["offset"], bit=0)
    return SHARD


def _flip_bytes_bit(root: Path) -> str:
    e = entry(root, 2, "state['blob']")
    flip_bit(step_path(root, 2, SHARD), e["offset"] + 4, bit=5)
    return SHARD


def _truncate_shard(root: Path) -> str:
    p = step_path(root, 2, SHARD)
    p.write_bytes(p.read_bytes()[:-1])
    return SHARD


def _truncate_shard_to_zero(root: Path) -> str:
    step_path(root, 2, SHARD).write_bytes(b"")
    return SHARD


def _extend_shard(root: Path) -> str:
    p = step_path(root, 2, SHARD)
    p.write_bytes(p.read_bytes() + b"\0")
    return SHARD


def _delete_shard(root: Path) -> str:
    step_path(root, 2, SHARD).unlink()
    return SHARD


def _shard_is_a_directory(root: Path) -> str:
    p = step_path(root, 2, SHARD)
    p.unlink()
    p.mkdir()
    return SHARD


def _delete_manifest(root: Path) -> str:
    step_path(root, 2, MANIFEST).unlink()
    return MANIFEST


def _garble_manifest_json(root: Path) -> str:
    p = step_path(root, 2, MANIFEST)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2] + b"}{" + data[len(data) // 2 + 2 :])  # same length
    return MANIFEST


def _garble_manifest_json_and_reseal(root: Path) -> str:
    write_manifest_and_marker(root, 2, step_path(root, 2, MANIFEST).read_bytes()[:-40])
    return MANIFEST


def _edit_manifest_value_not_marker(root: Path) -> str:
    p = step_path(root, 2, MANIFEST)
    doc = json.loads(p.read_bytes())
    doc["tree"]["v"][-1]["v"][0]["v"] = "999"  # meta.step, still valid JSON and schema
    p.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    return MANIFEST


def _edit_entry_checksum_and_reseal(root: Path) -> str:
    # The shard is intact, but the manifest's checksum for a tensor is wrong.
    doc = manifest_doc(root, 2)
    e = doc["entries"][0]
    e["checksum"] = f"{(int(e['checksum'], 16) + 1) % 2**32:08x}"
    write_manifest_and_marker(root, 2, json.dumps(doc).encode())
    return SHARD


def _garble_commit(root: Path) -> str:
    p = step_path(root, 2, COMMIT)
    p.write_bytes(p.read_bytes()[:-10])
    return COMMIT


def _empty_commit(root: Path) -> str:
    step_path(root, 2, COMMIT).write_bytes(b"")
    return COMMIT


def _commit_of_another_step(root: Path) -> str:
    step_path(root, 2, COMMIT).write_bytes(step_path(root, 1, COMMIT).read_bytes())
    return COMMIT


def _commit_wrong_manifest_length(root: Path) -> str:
    p = step_path(root, 2, COMMIT)
    marker = json.loads(p.read_bytes())
    marker["manifests"][0]["length"] -= 1
    p.write_bytes(json.dumps(marker).encode())
    return MANIFEST


DAMAGE: dict[str, Callable[[Path], str]] = {
    "flip-float32-bit": _flip_tensor_bit,
    "flip-bf16-bit": _flip_bf16_bit,
    "flip-ndarray-bit": _flip_ndarray_bit,
    "flip-bytes-bit": _flip_bytes_bit,
    "truncated-shard": _truncate_shard,
    "empty-shard": _truncate_shard_to_zero,
    "extended-shard": _extend_shard,
    "deleted-shard": _delete_shard,
    "shard-is-a-directory": _shard_is_a_directory,
    "deleted-manifest": _delete_manifest,
    "garbled-manifest": _garble_manifest_json,
    "garbled-manifest-resealed": _garble_manifest_json_and_reseal,
    "manifest-edited-marker-not": _edit_manifest_value_not_marker,
    "entry-checksum-wrong-resealed": _edit_entry_checksum_and_reseal,
    "garbled-commit": _garble_commit,
    "empty-commit": _empty_commit,
    "commit-of-another-step": _commit_of_another_step,
    "commit-wrong-manifest-length": _commit_wrong_manifest_length,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_restore_skips_a_damaged_step_with_a_warning(root: Path, damage: str) -> None:
    file = DAMAGE[damage](root)
    template = make_state(0)
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        assert ckpt.steps() == [1, 2]
        with pytest.warns(RuntimeWarning) as record:
            assert ckpt.restore(template) == 1
    messages = [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert re.search(r"\bstep 2\b", messages[0]), messages[0]
    assert naming.step_dir_name(2) in messages[0]
    assert file in messages[0]
    assert same(template, make_state(1))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_restore_of_exactly_the_damaged_step_raises(root: Path, damage: str) -> None:
    DAMAGE[damage](root)
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        with pytest.raises(CheckpointCorruptedError) as info:
            ckpt.restore(make_state(0), step=2)
        assert isinstance(info.value, ValueError)
        assert isinstance(info.value, tiercheck.TiercheckError)
        assert "step 2" in str(info.value)
        # The older step is untouched by the failed attempt.
        template = make_state(0)
        assert ckpt.restore(template, step=1) == 1
        assert same(template, make_state(1))


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_load_of_a_damaged_step_raises(root: Path, damage: str) -> None:
    DAMAGE[damage](root)
    with pytest.raises(CheckpointCorruptedError):
        tiercheck.load(root, step=2)
    with pytest.warns(RuntimeWarning, match=r"step 2\b"):
        newest_good = tiercheck.load(root)
    assert same(newest_good, make_state(1))


def test_flipped_bit_in_padding_is_not_checked(root: Path) -> None:
    """Padding is outside every entry, so no checksum covers it (docs/format.md)."""
    e = entry(root, 2, "state['h']")
    assert e["length"] % 4096 != 0
    flip_bit(step_path(root, 2, SHARD), e["offset"] + e["length"])  # first padding byte
    template = make_state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
            assert ckpt.restore(template) == 2
    assert same(template, make_state(2))


def test_deleted_commit_marker_makes_the_step_invisible(root: Path) -> None:
    step_path(root, 2, COMMIT).unlink()
    template = make_state(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
            assert ckpt.steps() == [1]
            assert ckpt.restore(template) == 1
            with pytest.raises(tiercheck.NoCheckpointError):
                ckpt.restore(make_state(0), step=2)
    assert same(template, make_state(1))


def test_every_step_damaged_raises_instead_of_returning_none(root: Path) -> None:
    for s in (1, 2):
        e = entry(root, s, "state['idx']")
        flip_bit(step_path(root, s, SHARD), e["offset"] + 3)
    with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
        with pytest.warns(RuntimeWarning) as record, pytest.raises(CheckpointCorruptedError) as info:
            ckpt.restore(make_state(0))
        assert isinstance(info.value, ValueError)
    warned = " ".join(str(w.message) for w in record)
    assert "step 2" in warned
    assert "step 1" in warned
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointCorruptedError):
        tiercheck.load(root)


def test_flipped_bit_is_never_returned_even_partially(root: Path) -> None:
    """Every byte of every entry is checked: flip each entry once, restore must refuse it."""
    for e in manifest_doc(root, 2)["entries"]:
        if e["length"] == 0:
            continue
        shard = step_path(root, 2, SHARD)
        original = shard.read_bytes()
        for pos in (e["offset"], e["offset"] + e["length"] - 1):
            flip_bit(shard, pos, bit=pos % 8)
            with pytest.raises(CheckpointCorruptedError):
                tiercheck.load(root, step=2)
            shard.write_bytes(original)
    assert same(tiercheck.load(root, step=2), make_state(2))


# ----------------------------------------------- crafted (consistently sealed) steps
# The marker is re-sealed over an altered manifest, as a buggy or hostile writer could
# do: checksums cannot catch it, so the reader must validate it as untrusted input.


def test_load_rejects_a_tree_root_that_is_not_a_dict(root: Path) -> None:
    doc = manifest_doc(root, 2)
    doc["tree"] = {"t": "list", "v": []}
    write_manifest_and_marker(root, 2, json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptedError):
        tiercheck.load(root, step=2)


def test_load_checks_file_sizes_before_allocating(root: Path) -> None:
    doc = manifest_doc(root, 2)
    doc["files"][0]["length"] = 2**62
    e = next(e for e in doc["entries"] if e["path"] == "state['w']")
    e["offset"], e["shape"], e["length"] = 2**61, [2**59], 2**61  # float32, overlapping nothing
    write_manifest_and_marker(root, 2, json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptedError, match="bytes"):
        tiercheck.load(root, step=2)


def test_load_rejects_overlapping_entries(root: Path) -> None:
    doc = manifest_doc(root, 2)
    w, h = (next(e for e in doc["entries"] if e["path"] == p) for p in ("state['w']", "state['h']"))
    h["offset"] = w["offset"] + 4096  # inside w's bytes, not an exact alias of them
    write_manifest_and_marker(root, 2, json.dumps(doc).encode())
    with pytest.raises(CheckpointCorruptedError, match="overlap"):
        tiercheck.load(root, step=2)


# --------------------------------------------------------------------------- fuzz


def _make_valid_documents() -> dict[str, bytes]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        state = make_state(3)
        state["extra"] = {
            "empty": torch.empty(0),
            "scalar": torch.tensor(1.5),
            "np0": np.float32(2.5),
            "npu4": np.arange(4, dtype=np.uint32),
            "big": 2**130,
            "lst": [True, None, "x", b""],
        }
        with tiercheck.Checkpointer(local=d, keep_local=None) as ckpt:
            ckpt.save(3, state).wait()
        sd = Path(d) / naming.step_dir_name(3)
        return {"manifest": (sd / MANIFEST).read_bytes(), "marker": (sd / COMMIT).read_bytes()}


_VALID = _make_valid_documents()


def _decode_either(data: bytes) -> None:
    for decode in (decode_manifest, decode_marker):
        with contextlib.suppress(CheckpointCorruptedError):
            decode(data, "fuzz")


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 4096, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
NASTY_STRINGS = [
    "",
    "..",
    "../rank-00000-of-00001.shard",
    "../../../etc/passwd",
    "/etc/passwd",
    "/tmp/rank-00000-of-00001.shard",
    "C:\\Windows\\x",
    "http://example.com/x",
    "s3://bucket/rank-00000-of-00001.shard",
    "file:///etc/passwd",
    "rank-00000-of-00001.shard/../../x",
    "sub/rank-00000-of-00001.shard",
    "rank-00000-of-00001.shard\x00",
    "rank-0-of-1.shard",
    "rank-00000-of-00001.manifest.json",
    "COMMIT",
    "tensor",
    "ndarray",
    "float32",
    "<f8",
    "|b1",
    ">u4",
    "O",
    "V8",
    "<M8[s]",
    "U3",
    "i4,i4",
    "(2,)i4",
    "float8_e4m3fnuz",
    "crc32c",
    "xxh3_64",
    "md5",
    "zstd",
    "nan",
    "inf",
    "0x1.8p+1",
    "1" * 5000,
    "-" + "9" * 4300,
    "00000000",
    "ABCDEF12",
    "é",
]
json_values = st.recursive(
    st.one_of(json_scalars, st.sampled_from(NASTY_STRINGS)),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=8), st.sampled_from(["t", "v", "k", "e"])), children, max_size=4),
    ),
    max_leaves=12,
)
nasty_values = st.one_of(
    json_values,
    st.sampled_from(NASTY_STRINGS),
    st.just([2**40] * MAX_NDIM),
    st.just([1] * (MAX_NDIM + 1)),
    st.just([10**20]),
    st.just([-1]),
    st.just([True]),
    st.just([2.0]),
    st.just({"t": "dict", "k": [["i", "1" * 40]], "v": [{"t": "none"}]}),
    st.just({"t": "tensor", "e": 10**6}),
    st.just({"t": "tensor", "e": True}),
    st.just({"t": "float", "v": "0x1p+99999"}),
    st.just({"t": "int", "v": "1" * 4301}),
    st.just({"t": "stateful", "v": {"t": "list", "v": []}}),
)


def _paths(doc: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


@st.composite
def mutated_documents(draw: st.DrawFn, base: bytes) -> Any:
    doc = json.loads(base)
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "insert", "duplicate", "wrap", "offset"]))
        if not path:
            if op == "replace":
                doc = copy.deepcopy(draw(nasty_values))
            continue
        parent, key = _get(doc, path[:-1]), path[-1]
        if op == "replace":
            parent[key] = copy.deepcopy(draw(nasty_values))
        elif op == "delete":
            del parent[key]
        elif op == "insert":
            if isinstance(parent, dict):
                name = draw(st.sampled_from(["t", "v", "k", "e", "x", "shape", "files"]))
                parent[name] = copy.deepcopy(draw(nasty_values))
            else:
                parent.insert(key, copy.deepcopy(draw(nasty_values)))
        elif op == "duplicate":
            if isinstance(parent, list):
                parent.append(copy.deepcopy(parent[key]))
        elif op == "wrap":
            parent[key] = [parent[key]] if draw(st.booleans()) else {"t": parent[key]}
        elif op == "offset":
            value = parent[key]
            if type(value) is int:
                parent[key] = value + draw(st.sampled_from([1, -1, 4096, -4096, 2**40, -(2**63)]))
    return doc


def _check_accepted_manifest(data: bytes) -> None:
    """What a manifest that decodes is guaranteed to satisfy."""
    m = decode_manifest(data, "fuzz")
    sizes = {f.name: f.length for f in m.files}
    for e in m.entries:
        assert naming.is_safe_file_name(e.file)
        assert "/" not in e.file and "\\" not in e.file and ":" not in e.file and ".." not in e.file
        assert e.offset >= 0 and e.offset + e.length <= sizes[e.file]
        assert len(e.shape) <= MAX_NDIM
        assert e.codec == "raw"
    assert 0 <= m.rank < m.world_size <= 2**20


FUZZ = settings(
    max_examples=int(os.environ.get("TIERCHECK_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(st.binary(max_size=4096))
@example(b"")
@example(b"\xef\xbb\xbf{}")
@example(b"[" * 100_000)
@example(b'{"format":"tiercheck","version":1,"kind":"manifest","step":NaN}')
@example(b"1" * 5000)
def test_parsers_on_arbitrary_bytes(data: bytes) -> None:
    _decode_either(data)


@FUZZ
@given(json_values)
def test_parsers_on_arbitrary_json(doc: object) -> None:
    _decode_either(json.dumps(doc).encode())


@FUZZ
@given(mutated_documents(_VALID["manifest"]))
def test_manifest_parser_on_mutated_manifests(doc: Any) -> None:
    data = json.dumps(doc).encode()
    with contextlib.suppress(CheckpointCorruptedError):
        _check_accepted_manifest(data)


@FUZZ
@given(mutated_documents(_VALID["marker"]))
def test_marker_parser_on_mutated_markers(doc: Any) -> None:
    data = json.dumps(doc).encode()
    try:
        m = decode_marker(data, "fuzz")
    except CheckpointCorruptedError:
        return
    assert len(m.manifests) == m.world_size
    assert [r.file for r in m.manifests] == [naming.manifest_name(i, m.world_size) for i in range(m.world_size)]


@FUZZ
@given(st.data())
def test_parsers_on_byte_level_damage_to_valid_documents(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["manifest", "marker"]))
    doc = bytearray(_VALID[which])
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(doc) - 1))
        op = data.draw(st.sampled_from(["flip", "delete", "insert"]))
        if op == "flip":
            doc[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "delete":
            del doc[pos]
        else:
            doc.insert(pos, data.draw(st.integers(0, 255)))
    _decode_either(bytes(doc))


def test_the_valid_documents_decode() -> None:
    _check_accepted_manifest(_VALID["manifest"])
    assert decode_marker(_VALID["marker"], "x").step == 3


@pytest.mark.parametrize(
    "name",
    ["../rank-00000-of-00001.shard", "/abs/rank-00000-of-00001.shard", "s3://b/rank-00000-of-00001.shard", "x/../y"],
)
def test_manifest_rejects_file_names_outside_the_step_dir(name: str) -> None:
    doc = json.loads(_VALID["manifest"])
    doc["files"][0]["name"] = name
    with pytest.raises(CheckpointCorruptedError, match="not a shard name"):
        decode_manifest(json.dumps(doc).encode(), "x")
    doc = json.loads(_VALID["manifest"])
    doc["entries"][0]["file"] = name
    with pytest.raises(CheckpointCorruptedError, match="not listed"):
        decode_manifest(json.dumps(doc).encode(), "x")


@pytest.mark.parametrize("tag", [[], {}, ["dict"]])
def test_tree_node_with_unhashable_type_tag_is_corruption(tag: object) -> None:
    doc = json.loads(_VALID["manifest"])
    doc["tree"]["v"][0] = {"t": tag}
    with pytest.raises(CheckpointCorruptedError):
        decode_manifest(json.dumps(doc).encode(), "x")


def test_layout_names_are_strict_ascii() -> None:
    assert not naming.is_safe_file_name("rank-00000-of-00001.shard\n")
    assert not naming.is_safe_file_name("rank-\u0660\u0660\u0660\u0660\u0660-of-00001.shard")
    assert naming.parse_step_dir("step-000000000001\n") is None
    assert naming.parse_step_dir("step-0000000000001") is None
    assert naming.parse_step_dir("step-" + "\u0661" * 12) is None
