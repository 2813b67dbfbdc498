"""Large entries of a local shard (tier 0, tier 1) are read on several threads at once,
straight into the template, each thread hashing what it read, a large CRC-32C entry in
pieces whose CRCs are combined: bit-exact, a damaged byte anywhere refused, and only
positional reads of a local file go parallel."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.errors import CheckpointCorruptedError
from tiercheck.format import naming
from tiercheck.format.checksum import crc32c_combine
from tiercheck.format.manifest import decode_manifest
from tiercheck.steps import catalog, restore
from tiercheck.tiers.codec import ZstdFile
from tiercheck.tiers.local import LocalTier

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BIG = (restore.READ_CHUNK * 5) // 4 + 12  # bytes of "big": two chunks, the second short
# pieces larger than any entry (each entry on one thread): the library's default, whose
# splitting the 3 MiB pieces exercise too; ~1.4 s each, so the inner loop leaves them out
WHOLE = pytest.param(64 << 20, marks=pytest.mark.slow, id="67108864")


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    out = {f"w{i}": torch.randn(3 << 18, generator=g) for i in range(5)}  # 3 MiB each: large reads
    out["big"] = torch.randint(0, 255, (BIG,), dtype=torch.uint8, generator=g)
    out["small"] = torch.randn(100, generator=g)
    return out


def zeros_like(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in s.items()}


def save_two(root: Path, checksum: str = "crc32c") -> None:
    with tiercheck.Checkpointer(root, checksum=checksum) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(step)).wait()


@pytest.mark.parametrize("checksum", ["crc32c", "xxh3_64"])
@pytest.mark.parametrize("piece", [WHOLE, 3 << 20, (1 << 20) + 3])
def test_large_entries_are_read_on_several_threads_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, piece: int, checksum: str
) -> None:
    monkeypatch.setattr(restore, "_PIECE", piece)
    save_two(tmp_path, checksum)
    readers: set[str] = set()
    real = catalog.ShardFiles.read_into

    def spy(self: catalog.ShardFiles, name: str, offset: int, dest: memoryview) -> None:
        if len(dest) > restore._SMALL_READ:
            readers.add(threading.current_thread().name)
        real(self, name, offset, dest)

    monkeypatch.setattr(catalog.ShardFiles, "read_into", spy)
    monkeypatch.setattr(restore, "_READERS", 3)
    target = zeros_like(state(2))
    with tiercheck.Checkpointer(tmp_path, checksum=checksum) as ckpt:
        assert ckpt.restore(target) == 2
    for k, v in state(2).items():
        assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), k
    assert len(readers) > 1 and all(n.startswith("tiercheck-read") for n in readers), readers


@pytest.mark.parametrize("checksum", ["crc32c", "xxh3_64"])
@pytest.mark.parametrize("piece", [WHOLE, 3 << 20])
@pytest.mark.parametrize("where", ["first chunk", "second chunk", "last entry"])
def test_a_damaged_chunk_read_in_parallel_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, piece: int, checksum: str
) -> None:
    monkeypatch.setattr(restore, "_PIECE", piece)
    monkeypatch.setattr(restore, "_READERS", 2)
    save_two(tmp_path, checksum)
    step_dir = tmp_path / naming.step_dir_name(2)
    manifest = decode_manifest((step_dir / naming.manifest_name(0, 1)).read_bytes(), "m")
    entry = {e.path: e for e in manifest.entries}
    big = next(e for p, e in entry.items() if "big" in p)
    last = max((e for e in manifest.entries if e.length > restore._SMALL_READ), key=lambda e: e.offset)
    at = {
        "first chunk": big.offset + 7,
        "second chunk": big.offset + restore.READ_CHUNK + 5,
        "last entry": last.offset + last.length - 1,
    }[where]
    shard = step_dir / big.file
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    with tiercheck.Checkpointer(tmp_path, checksum=checksum) as ckpt:
        with pytest.raises(CheckpointCorruptedError, match="checksum mismatch"):
            ckpt.restore(zeros_like(state(2)), step=2)
        target = zeros_like(state(2))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert ckpt.restore(target) == 1  # falls back to the older step, bit-exact
    assert any("step 2" in str(w.message) for w in seen)
    for k, v in state(1).items():
        assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), k


def test_a_short_file_read_in_parallel_raises_corrupted(tmp_path: Path) -> None:
    save_two(tmp_path)
    tier = LocalTier(str(tmp_path))
    manifest = catalog.read_manifest(tier, 2, 0)
    reads = [
        restore._Read(e, torch.empty(e.length, dtype=torch.uint8))
        for e in manifest.entries
        if e.length > restore._SMALL_READ
    ]
    with catalog.ShardFiles(tier, 2, manifest.files) as files:
        name = reads[0].entry.file
        good = files._files[name].read_into

        def short(offset: int, dest: memoryview) -> None:
            if offset >= reads[-1].entry.offset:
                raise EOFError(f"{name}: file ends at byte {offset}")
            good(offset, dest)

        files._files[name].read_into = short  # type: ignore[method-assign]
        with pytest.raises(CheckpointCorruptedError, match="file ends"):
            restore._read_verified(tier, 2, files, reads, manifest.checksum_algorithm)


def test_only_positional_reads_of_local_files_go_parallel(tmp_path: Path) -> None:
    save_two(tmp_path)
    tier = LocalTier(str(tmp_path))
    manifest = catalog.read_manifest(tier, 2, 0)
    with catalog.ShardFiles(tier, 2, manifest.files) as files:
        assert all(files.concurrent(sf.name) for sf in manifest.files)
    assert ZstdFile.concurrent is False  # a decoder keeps its position between reads


@pytest.mark.parametrize("n1,n2", [(0, 0), (0, 5), (5, 0), (1, 1), (100, 3), (1 << 20, 12345), (7, 3 << 20)])
def test_crc32c_combine_equals_the_crc_of_the_concatenation(n1: int, n2: int) -> None:
    import crc32c

    g = torch.Generator().manual_seed(n1 * 31 + n2)
    a = torch.randint(0, 256, (n1,), dtype=torch.uint8, generator=g).numpy().tobytes()
    b = torch.randint(0, 256, (n2,), dtype=torch.uint8, generator=g).numpy().tobytes()
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), n2) == crc32c.crc32c(a + b)
    with pytest.raises(ValueError):
        crc32c_combine(0, 0, 1 << 60)
