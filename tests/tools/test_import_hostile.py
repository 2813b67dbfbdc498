"""`tiercheck import` of hostile sources (issue 23, items 8-10): DCP directories whose
``.metadata`` is built from DCP's own classes (by real `dcp.save`, then altered) to point
outside the source, at FIFOs and devices, at huge lengths, with huge list indices or fields of
the wrong type; and `torch.save`/safetensors files that are FIFOs, devices or nested deep.

Each is refused with one line on stderr naming the file and what is wrong, the documented
exit code (docs/cli.md: 1 a damaged source, 2 a refused one), in bounded time and memory,
and nothing written to the destination."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.__main__ import main
from tiercheck.tools import import_step

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TIME_LIMIT = 60.0  # generous: the machine may be busy; a hang or a list of 10**8 takes longer
RSS_LIMIT_MIB = 1024  # far above an import of these few bytes, far below a 40 GiB read


def save_dcp(path: Path, state: dict[str, Any]) -> Path:
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def victim(tmp_path: Path) -> Path:
    """The checkpoint a hostile directory tries to import bytes of: 7s where the source has 0s."""
    return save_dcp(tmp_path / "victim", {"w": torch.full((4,), 7.0)})


def source(tmp_path: Path, name: str = "src") -> Path:
    return save_dcp(tmp_path / name, {"w": torch.zeros(4), "lst": [torch.ones(2), torch.ones(3)], "n": 5})


def read_meta(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)  # the test's own trusted file
    assert isinstance(meta, Metadata)
    return meta


def write_meta(path: Path, meta: object) -> None:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))  # for the field nested 5,000 deep
    try:
        (path / ".metadata").write_bytes(pickle.dumps(meta))
    finally:
        sys.setrecursionlimit(limit)


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def entry(meta: Metadata, fqn: str) -> tuple[MetadataIndex, _StorageInfo]:
    [(key, info)] = [(k, v) for k, v in meta.storage_data.items() if k.fqn == fqn]
    return key, info


def repoint(src: Path, fqn: str, **changes: Any) -> None:
    """Alter the `_StorageInfo` of item `fqn` in `src`'s metadata."""
    meta = read_meta(src)
    key, info = entry(meta, fqn)
    fields = {"relative_path": info.relative_path, "offset": info.offset, "length": info.length}
    fields.update(changes)
    meta.storage_data[key] = _StorageInfo(**fields)
    write_meta(src, meta)


def run_import(src: Path, dest: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float]:
    start = time.monotonic()
    code = main(["import", str(src), str(dest), "--step", "1", *extra])
    elapsed = time.monotonic() - start
    _, err = capsys.readouterr()
    return code, err, elapsed


# The peak from /proc/self/status (VmHWM, this process's own memory since its exec), not
# getrusage's ru_maxrss: Linux carries ru_maxrss across exec from the parent's memory, so a
# child of a pytest process that has grown past 1 GiB in a full run reports the parent's peak.
RUNNER = textwrap.dedent(
    """
    import sys
    from tiercheck.__main__ import main
    code = main(sys.argv[1:])
    with open("/proc/self/status") as f:
        hwm = [int(line.split()[1]) for line in f if line.startswith("VmHWM:")]
    print("RSS_MIB", hwm[0] // 1024)
    sys.exit(code)
    """
)


def run_import_process(src: Path, dest: Path, *extra: str) -> tuple[int, str, int]:
    """The CLI in a process of its own (a hang must not hang the test): exit code, stderr, peak RSS."""
    argv = [sys.executable, "-c", RUNNER, "import", str(src), str(dest), "--step", "1", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=TIME_LIMIT, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tiercheck import {src} did not finish within {TIME_LIMIT} s")
    rss = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("RSS_MIB")]
    return out.returncode, out.stderr, rss[0] if rss else -1


def assert_refused(code: int, err: str, dest: Path, expected_code: int, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == expected_code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("tiercheck: import: "), err
    for word in words:
        assert word in lines[0], err
    assert not dest.exists(), sorted(p.name for p in dest.iterdir())


# ------------------------------------------------------------------ item 8: paths out of the source


def _absolute(src: Path, other: Path) -> str:
    return str(other / entry(read_meta(other), "w")[1].relative_path)


def _dotdot(src: Path, other: Path) -> str:
    return f"../{other.name}/{entry(read_meta(other), 'w')[1].relative_path}"


def _symlinked_file(src: Path, other: Path) -> str:
    os.symlink(_absolute(src, other), src / "__9_0.distcp")
    return "__9_0.distcp"


def _symlinked_dir(src: Path, other: Path) -> str:
    os.symlink(other, src / "shards")
    return f"shards/{entry(read_meta(other), 'w')[1].relative_path}"


@pytest.mark.parametrize("escape", [_absolute, _dotdot, _symlinked_file, _symlinked_dir])
def test_an_item_path_leading_out_of_the_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], escape: Callable[[Path, Path], str]
) -> None:
    other = victim(tmp_path)
    src = source(tmp_path)
    _, info = entry(read_meta(other), "w")
    # the victim's item has the length and offset the source's own would have: only the path differs
    repoint(src, "w", relative_path=escape(src, other), offset=info.offset, length=info.length)
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, capsys=capsys)
    assert_refused(code, err, dest, 1, str(src))


def test_the_unaltered_source_imports_and_a_root_through_a_symlink_reads(tmp_path: Path) -> None:
    src = source(tmp_path)
    link = tmp_path / "link"
    os.symlink(src, link)  # the directory given may itself be a link: only what is below it is checked
    import_step(link, tmp_path / "dest", 1)
    got = tiercheck.load(tmp_path / "dest", 1)
    assert torch.equal(got["w"], torch.zeros(4)) and got["n"] == 5
    assert [t.tolist() for t in got["lst"]] == [[1.0, 1.0], [1.0, 1.0, 1.0]]


# ------------------------------------------------------------------ item 9: FIFOs, devices, huge lengths


def test_a_fifo_named_like_a_data_file_is_refused_without_blocking(tmp_path: Path) -> None:
    src = source(tmp_path)
    os.mkfifo(src / "__0_1.distcp")
    repoint(src, "w", relative_path="__0_1.distcp", offset=0)
    dest = tmp_path / "dest"
    code, err, _ = run_import_process(src, dest)
    assert_refused(code, err, dest, 1, "__0_1.distcp", "FIFO")


def test_a_symlink_to_dev_zero_claiming_40_gib_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    src = source(tmp_path)
    os.symlink("/dev/zero", src / "__0_1.distcp")
    meta = read_meta(src)
    # a tensor of 40 GiB whose single chunk lives in that "file": consistent metadata
    md = meta.state_dict_metadata["w"]
    md.size = torch.Size([10 << 30])
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([10 << 30]))]
    key, _ = entry(meta, "w")
    meta.storage_data[key] = _StorageInfo("__0_1.distcp", 0, 40 << 30)
    write_meta(src, meta)
    dest = tmp_path / "dest"
    code, err, rss = run_import_process(src, dest)
    assert_refused(code, err, dest, 1, "__0_1.distcp", "symlink")
    assert 0 < rss < RSS_LIMIT_MIB


@pytest.mark.parametrize("what", ["length", "offset"])
def test_an_item_past_the_end_of_its_file_is_refused_before_reading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    src = source(tmp_path)
    _, info = entry(read_meta(src), "w")
    repoint(src, "w", **({"length": 40 << 30} if what == "length" else {"offset": 1 << 40}))
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, capsys=capsys)
    # a length no chunk of 4 floats can have is refused from the metadata alone; a right
    # length at an offset past the file from the file's size
    assert_refused(
        code,
        err,
        dest,
        1,
        *(["'w'", "42949672960 bytes"] if what == "length" else [info.relative_path, "past the end"]),
    )


def test_a_huge_tensor_claimed_in_a_small_item_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    src = source(tmp_path)
    meta = read_meta(src)
    md = meta.state_dict_metadata["w"]
    md.size = torch.Size([10 << 30])
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([10 << 30]))]
    write_meta(src, meta)
    dest = tmp_path / "dest"
    code, err, rss = run_import_process(src, dest)
    assert_refused(code, err, dest, 1, ".metadata", "'w'", "bytes")
    assert 0 < rss < RSS_LIMIT_MIB


def test_a_compressed_record_in_an_item_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A deflated record could inflate a thousandfold inside torch.load: only stored ones are read."""
    src = source(tmp_path)
    raw = save_dcp(tmp_path / "raw", {"w": torch.zeros(4)})
    _, info = entry(read_meta(raw), "w")
    item = (raw / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    (tmp_path / "item.zip").write_bytes(item)
    with zipfile.ZipFile(tmp_path / "item.zip") as zin, zipfile.ZipFile(src / "z.distcp", "w") as zout:
        for zi in zin.infolist():
            zout.writestr(zi.filename, zin.read(zi.filename), compress_type=zipfile.ZIP_DEFLATED)
    repoint(src, "w", relative_path="z.distcp", offset=0, length=(src / "z.distcp").stat().st_size)
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, capsys=capsys)
    assert_refused(code, err, dest, 1, "z.distcp", "compressed")


def _replace_item(src: Path, fqn: str, value: object, raw: bytes | None = None) -> None:
    """Item `fqn` of `src` becomes a `torch.save` of `value` (or `raw` bytes), in a file of its own."""
    path = src / "__5_0.distcp"
    if raw is None:
        torch.save(value, path)
    else:
        path.write_bytes(raw)
    repoint(src, fqn, relative_path=path.name, offset=0, length=path.stat().st_size)


@pytest.mark.parametrize("what", ["other shape", "other dtype", "not a tensor", "pickle refused"])
def test_an_item_that_is_not_its_chunk_is_refused_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """Found by unpickling each item without its data before the destination is touched (a
    damaged item found halfway through the write would leave the destination created)."""
    src = source(tmp_path)
    if what == "pickle refused":
        buf = io.BytesIO()
        torch.save(torch.zeros(4), buf)
        data = bytearray(buf.getvalue())
        at = data.index(b"\x80\x02", data.index(b"data.pkl"))
        data[at + 2] = 0xFF  # an opcode weights_only refuses
        _replace_item(src, "w", None, bytes(data))
    else:
        value = {"other shape": torch.zeros(2, 2), "other dtype": torch.zeros(4, dtype=torch.float64)}.get(
            what, {"w": torch.zeros(4)}
        )
        _replace_item(src, "w", value)
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, capsys=capsys)
    if what == "pickle refused":
        assert_refused(code, err, dest, 2, "__5_0.distcp", "'w'", "weights_only", "Unsupported operand 255")
    else:
        assert_refused(code, err, dest, 1, "__5_0.distcp", "'w'", "the metadata says")


def test_a_tensor_in_two_chunks_in_two_files_imports_exactly(tmp_path: Path) -> None:
    """What a two-rank DCP save writes: each half in its own file, assembled into one tensor."""
    full = torch.arange(10, dtype=torch.float64)
    src = save_dcp(tmp_path / "src", {"w": torch.zeros(10)})
    meta = read_meta(src)
    meta.state_dict_metadata["w"].properties.dtype = torch.float64
    meta.state_dict_metadata["w"].chunks = [
        ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([6])),
        ChunkStorageMetadata(offsets=torch.Size([6]), sizes=torch.Size([4])),
    ]
    meta.storage_data = {}
    for rank, (lo, hi) in enumerate([(0, 6), (6, 10)]):
        name = f"__{rank}_0.distcp"
        torch.save(full[lo:hi].clone(), src / name)
        meta.storage_data[MetadataIndex("w", [lo])] = _StorageInfo(name, 0, (src / name).stat().st_size)
    write_meta(src, meta)
    import_step(src, tmp_path / "dest", 1)
    assert torch.equal(tiercheck.load(tmp_path / "dest", 1)["w"], full)
    # and two chunks that overlap (leaving elements uncovered) are refused
    meta.state_dict_metadata["w"].chunks[1] = ChunkStorageMetadata(offsets=torch.Size([5]), sizes=torch.Size([4]))
    meta.storage_data = {MetadataIndex("w", [0]): meta.storage_data[MetadataIndex("w", [0])]}
    meta.storage_data[MetadataIndex("w", [5])] = _StorageInfo("__1_0.distcp", 0, (src / "__1_0.distcp").stat().st_size)
    write_meta(src, meta)
    with pytest.raises(tiercheck.CheckpointCorruptedError, match="overlap"):
        import_step(src, tmp_path / "dest2", 1)
    assert not (tmp_path / "dest2").exists()


# ------------------------------------------------------------------ item 10: structure


@pytest.mark.parametrize("index", [-5, 10**8])
def test_a_negative_or_huge_list_index_is_refused_quickly(tmp_path: Path, index: int) -> None:
    src = source(tmp_path)
    meta = read_meta(src)
    meta.planner_data["lst.0"] = ("lst", index)
    write_meta(src, meta)
    dest = tmp_path / "dest"
    start = time.monotonic()
    code, err, rss = run_import_process(src, dest)
    assert_refused(code, err, dest, 1, ".metadata", "lst.0", str(index))
    assert time.monotonic() - start < TIME_LIMIT
    assert 0 < rss < RSS_LIMIT_MIB


def _set(obj: Any, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # MetadataIndex is frozen


WRONG: dict[str, Callable[[Metadata], None]] = {
    "properties None": lambda m: _set(m.state_dict_metadata["w"], "properties", None),
    "dtype a str": lambda m: _set(m.state_dict_metadata["w"].properties, "dtype", "float32"),
    "size of floats": lambda m: _set(m.state_dict_metadata["w"], "size", (4.0,)),
    "size a str": lambda m: _set(m.state_dict_metadata["w"], "size", "4"),
    "size beyond int64": lambda m: _set(m.state_dict_metadata["w"], "size", (1 << 70,)),
    "chunks a str": lambda m: _set(m.state_dict_metadata["w"], "chunks", "abc"),
    "chunk offsets short": lambda m: _set(m.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([])),
    "chunk outside": lambda m: _set(m.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([3])),
    "state_dict_metadata a list": lambda m: _set(m, "state_dict_metadata", [1]),
    "item kind an int": lambda m: m.state_dict_metadata.__setitem__("w", 3),
    "storage_data None": lambda m: _set(m, "storage_data", None),
    "storage key a str": lambda m: _set(m, "storage_data", dict.fromkeys(["w"], entry(m, "w")[1])),
    "offset a str": lambda m: _set(entry(m, "w")[1], "offset", "0"),
    "length negative": lambda m: _set(entry(m, "w")[1], "length", -1),
    "relative_path an int": lambda m: _set(entry(m, "w")[1], "relative_path", 5),
    "relative_path missing": lambda m: vars(entry(m, "w")[1]).pop("relative_path"),
    "item missing": lambda m: m.storage_data.pop(entry(m, "w")[0]),
    "planner_data a str": lambda m: _set(m, "planner_data", "x"),
    "planner path empty": lambda m: m.planner_data.__setitem__("w", ()),
    "planner path of a float": lambda m: m.planner_data.__setitem__("w", ("w", 1.5)),
    "planner path twice": lambda m: m.planner_data.__setitem__("w", ("lst", 0)),
    "planner str into a list": lambda m: m.planner_data.__setitem__("w", ("lst", "x")),
    "planner path deep": lambda m: m.planner_data.__setitem__("w", ("w",) * 100_000),
    "planner key nested deep": lambda m: m.planner_data.__setitem__("w", (nested(5_000),)),
    "chunks nested deep": lambda m: _set(m.state_dict_metadata["w"], "chunks", [nested(5_000)]),
    "a list, not Metadata": lambda m: None,
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_metadata_field_of_the_wrong_type_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], wrong: str
) -> None:
    src = source(tmp_path)
    meta = read_meta(src)
    WRONG[wrong](meta)
    write_meta(src, [meta] if wrong == "a list, not Metadata" else meta)
    dest = tmp_path / "dest"
    code, err, elapsed = run_import(src, dest, capsys=capsys)
    assert_refused(code, err, dest, 1, str(src))
    assert elapsed < TIME_LIMIT


def test_a_pickle_memo_index_of_2_28_costs_no_memory(tmp_path: Path) -> None:
    """9 bytes that make the C unpickler allocate and clear 2 GiB of memo (4 GiB RSS, 7 s)."""
    src = source(tmp_path)
    (src / ".metadata").write_bytes(b"\x80\x04N" + b"r" + (1 << 28).to_bytes(4, "little") + b".")
    dest = tmp_path / "dest"
    code, err, rss = run_import_process(src, dest)
    assert_refused(code, err, dest, 1, ".metadata", "not DCP Metadata")
    assert 0 < rss < RSS_LIMIT_MIB


def test_an_item_stored_with_a_transform_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = source(tmp_path)
    repoint(src, "w", transform_descriptors=["zstd"])
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, capsys=capsys)
    assert_refused(code, err, dest, 2, ".metadata", "transform")


def test_the_metadata_itself_must_be_a_regular_file(tmp_path: Path) -> None:
    src = source(tmp_path)
    (src / ".metadata").unlink()
    os.mkfifo(src / ".metadata")
    dest = tmp_path / "dest"
    code, err, _ = run_import_process(src, dest)
    assert_refused(code, err, dest, 1, ".metadata", "FIFO")


# ------------------------------------------------------------------ torch.save and safetensors files


@pytest.mark.parametrize("fmt", [None, "pt", "safetensors"])
def test_a_fifo_as_the_source_file_is_refused_without_blocking(tmp_path: Path, fmt: str | None) -> None:
    fifo = tmp_path / "last.pt"
    os.mkfifo(fifo)
    dest = tmp_path / "dest"
    code, err, _ = run_import_process(fifo, dest, *(["--format", fmt] if fmt else []))
    assert_refused(code, err, dest, 2, str(fifo), "not a regular file")


@pytest.mark.parametrize("fmt", [None, "safetensors"])
def test_a_symlink_to_dev_zero_as_the_source_file_is_refused(tmp_path: Path, fmt: str | None) -> None:
    link = tmp_path / "model.safetensors"
    os.symlink("/dev/zero", link)
    dest = tmp_path / "dest"
    code, err, rss = run_import_process(link, dest, *(["--format", fmt] if fmt else []))
    assert_refused(code, err, dest, 2, str(link), "not a regular file")
    assert 0 < rss < RSS_LIMIT_MIB


def test_a_symlink_to_a_regular_source_file_imports(tmp_path: Path) -> None:
    """A user's own link (a Hugging Face cache is all links into its blobs) is followed."""
    blob = tmp_path / "blobs" / "abc123"
    blob.parent.mkdir()
    torch.save({"w": torch.arange(3.0)}, blob)
    link = tmp_path / "last.pt"
    os.symlink(blob, link)
    import_step(link, tmp_path / "dest", 1)
    assert torch.equal(tiercheck.load(tmp_path / "dest", 1)["w"], torch.arange(3.0))


def _deep_torch_save(path: Path, depth: int) -> None:
    """A `torch.save` zip whose pickle nests lists `depth` deep (weights_only builds it)."""
    torch.save({"a": 1}, path)
    pkl = b"\x80\x02}X\x01\x00\x00\x00a" + b"]" * depth + b"a" * (depth - 1) + b"s."
    with zipfile.ZipFile(path) as z:
        records = [(zi, pkl if zi.filename.endswith("/data.pkl") else z.read(zi)) for zi in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for zi, data in records:
            z.writestr(zi, data)


@pytest.mark.parametrize("int_keys", [False, True])
def test_a_deeply_nested_torch_save_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], int_keys: bool
) -> None:
    src = tmp_path / "deep.pt"
    _deep_torch_save(src, 100_000)
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, *(["--int-keys"] if int_keys else []), capsys=capsys)
    assert_refused(code, err, dest, 2, "nested more than")


def _header(text: bytes) -> bytes:
    return len(text).to_bytes(8, "little") + text


HEADERS = {
    "header-past-the-file": (90_000_000).to_bytes(8, "little") + b"{}",
    "header-2-62": (1 << 62).to_bytes(8, "little") + b"{}",
    "tensor-of-4-tib": _header(
        json.dumps({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}).encode()
    ),
    "deep-json": _header(("{" + '"a":{' * 50_000 + "}" * 50_001).encode()),
}


@pytest.mark.parametrize("name", list(HEADERS))
def test_a_hostile_safetensors_header_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    src = tmp_path / "m.safetensors"
    src.write_bytes(HEADERS[name] + b" " * 16)
    dest = tmp_path / "dest"
    code, err, elapsed = run_import(src, dest, "--format", "safetensors", capsys=capsys)
    assert_refused(code, err, dest, 1, str(src))
    assert elapsed < TIME_LIMIT


# ------------------------------------------------------------------ damaged bytes, and what a failure leaves


def _flip_tensor_byte(src: Path, fqn: str) -> None:
    """Flip one byte of `fqn`'s tensor data inside its item (the zip record, not its header)."""
    _, info = entry(read_meta(src), fqn)
    path = src / info.relative_path
    data = bytearray(path.read_bytes())
    item = bytes(data[info.offset : info.offset + info.length])
    with zipfile.ZipFile(io.BytesIO(item)) as z:
        [rec] = [i for i in z.infolist() if "/data/" in i.filename]
        start = rec.header_offset + 30 + len(rec.filename.encode()) + len(rec.extra)
    data[info.offset + start + rec.file_size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_dcp_tensor_is_refused_and_leaves_no_destination(tmp_path: Path, capsys) -> None:
    src = save_dcp(tmp_path / "src", {"w": torch.arange(50_000, dtype=torch.float32)})
    _flip_tensor_byte(src, "w")
    dest = tmp_path / "dest"
    code, err, _ = run_import(src, dest, capsys=capsys)
    # found while the step is written (torch.load never checks the zip's CRC-32): the
    # aborted step, its lock file and the directory the import created are all gone
    assert_refused(code, err, dest, 1, "CRC-32", "'w'")


def test_a_failed_import_into_an_existing_checkpoint_leaves_it_as_it_was(tmp_path: Path, capsys) -> None:
    dest = tmp_path / "dest"
    good = save_dcp(tmp_path / "good", {"w": torch.full((8,), 3.0)})
    assert main(["import", str(good), str(dest), "--step", "0"]) == 0
    before = sorted((p.relative_to(dest), p.stat().st_size) for p in dest.rglob("*"))
    src = save_dcp(tmp_path / "src", {"w": torch.arange(50_000, dtype=torch.float32)})
    _flip_tensor_byte(src, "w")
    capsys.readouterr()
    code, err, _ = run_import(src, dest, capsys=capsys)
    assert code == 1 and "CRC-32" in err, err
    assert sorted((p.relative_to(dest), p.stat().st_size) for p in dest.rglob("*")) == before
    assert torch.equal(tiercheck.load(dest)["w"], torch.full((8,), 3.0))
