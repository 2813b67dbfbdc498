"""How tier 2 is read on a fresh node (issue 23, item 20): a shard in ranges of one size that
keep every connection busy (`multipart.read_piece_size`, `multipart.RangeReader`), pieces
copied into place in whatever order they arrive, a bounded window fetched ahead, and the
commit marker and the manifest fetched in one round trip (`catalog.read_marker_and_guess`);
every byte still checked. Against ``memory://`` (the real fsspec store; each test has a
root of its own); the network side of it is `benchmarks/remote/restore_network.py`.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.steps.restore import read_step
from tiercheck.tiers import multipart
from tiercheck.tiers.multipart import MAX_READ_PIECE, MIN_READ_PIECE, RangeReader, read_piece_size
from tiercheck.tiers.remote import RemoteTier
from tiercheck.tiers.retry import RetryPolicy

MiB = 1 << 20
SHARD = naming.shard_name(0, 1)
WAIT_S = 30.0  # generous: a busy 2-core machine


def memory_url(name: str) -> str:
    return f"memory://range-reads-{name}-{uuid.uuid4().hex}"


def state_of(mib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """fp32 tensors of 4 MiB (the last one smaller), `mib` MiB in all."""
    g = torch.Generator().manual_seed(seed)
    left = mib * MiB // 4
    out: dict[str, torch.Tensor] = {}
    while left:
        n = min(MiB, left)
        out[f"t{len(out):03d}"] = torch.randn(n, generator=g)
        left -= n
    return out


def saved(name: str, state: dict[str, torch.Tensor]) -> str:
    url = memory_url(name)
    with tiercheck.Checkpointer(remote=url) as c:
        c.save(1, state).wait(timeout=WAIT_S)
    return url


class Ranges:
    """Every ranged read of the shard through `tier.fs.cat_file` (the real call, counted),
    optionally held at a gate before it and told after it."""

    def __init__(
        self,
        tier: RemoteTier,
        gate: Callable[[int, int], None] | None = None,
        after: Callable[[int, int], None] | None = None,
    ) -> None:
        self.seen: list[tuple[int, int]] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        fs, orig = tier.fs, tier.fs.cat_file

        def cat_file(path: str, start: int | None = None, end: int | None = None, **kw: Any) -> bytes:
            if not str(path).endswith(SHARD):
                return bytes(orig(path, start=start, end=end, **kw))
            assert start is not None and end is not None
            with self._lock:
                self.seen.append((start, end))
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                if gate is not None:
                    gate(start, end)
                data = bytes(orig(path, start=start, end=end, **kw))
                if after is not None:
                    after(start, end)
                return data
            finally:
                with self._lock:
                    self.in_flight -= 1

        fs.cat_file = cat_file


# ------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("conc", [1, 2, 3, 4, 8, 16, 32])
def test_every_connection_carries_its_share_of_any_file(conc: int) -> None:
    """Whatever the size, the slowest connection carries at most ~1.1x its fair share (the
    waves of equal pieces are full), and pieces stay within 1 MiB .. ~9 MiB."""
    sizes = [*range(conc * MiB, 400 * MiB, 2_999_999), 64 * MiB + 4096, (1 << 30) + 4096, 100 << 30]
    for size in sizes:
        piece = read_piece_size(size, conc)
        pieces = -(-size // piece)
        waves = -(-pieces // conc)
        assert MIN_READ_PIECE <= piece <= MAX_READ_PIECE * 9 // 8 + multipart.PIECE_ALIGN, (size, piece)
        assert (size / conc) / (waves * piece) > 0.9, (size, piece, pieces)
    assert read_piece_size(5 * MiB, 8) == MIN_READ_PIECE  # fewer pieces than connections: no slivers


def test_a_64_mib_shard_moves_as_one_wave_of_8_equal_ranges() -> None:
    """The issue's case: 64 MiB on 8 connections. Before, its first 16 MiB read took 4 MiB
    pieces on 4 connections and queued 8 MiB pieces behind them: 10 ranges in two waves, the
    second on 2 connections (0.62x of 8 hand-written range reads through a shaped link).
    Now 8 ranges of one size, all in flight at once (each waits here until all 8 are)."""
    state = state_of(64, seed=1)
    url = saved("wave", state)
    tier = RemoteTier(url, concurrency=8)
    together = threading.Barrier(8, timeout=WAIT_S)
    held = iter(range(8))

    def gate(start: int, end: int) -> None:
        if next(held, None) is not None:
            together.wait()  # BrokenBarrierError (the read fails) unless 8 are in flight at once

    ranges = Ranges(tier, gate)
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    read_step(tier, 1, 0, tmpl, strict=True, world_size=1)
    assert all(torch.equal(tmpl[k], v) for k, v in state.items())
    size = tier.open_file(1, SHARD).size
    seen = sorted(ranges.seen)
    assert len(seen) == 8 and ranges.most_in_flight == 8, seen
    assert seen[0][0] == 0 and seen[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(seen))  # contiguous, no overlap
    assert len({e - s for s, e in seen[:-1]}) == 1 and seen[-1][1] - seen[-1][0] <= seen[0][1] - seen[0][0]


# ------------------------------------------------------------------------ the reader


def reader_over(data: bytes, conc: int, tier: RemoteTier, gate: Callable[[int], None] | None = None) -> RangeReader:
    def fetch(start: int, n: int) -> bytes:
        if gate is not None:
            gate(start)
        return data[start : start + n]

    return RangeReader(fetch, len(data), conc, tier._call, "reading test data")


def test_pieces_arriving_out_of_order_are_assembled_exactly() -> None:
    """The first piece of each read is held until every later piece of the window has
    arrived, so pieces complete in reverse; reads in order, overlapping, backwards, tiny and
    whole-file all return the exact bytes."""
    data = np.random.default_rng(3).bytes(40 * MiB + 12345)
    tier = RemoteTier(memory_url("order"))
    piece = read_piece_size(len(data), 4)
    count = -(-len(data) // piece)
    done: set[int] = set()
    cond = threading.Condition()

    def gate(start: int) -> None:
        i = start // piece
        with cond:
            if i % 4 == 0:  # the first of every group of 4 waits for the 3 after it
                later = {j for j in range(i + 1, min(i + 4, count))}
                assert cond.wait_for(lambda: later <= done, WAIT_S), (i, later, done)
        with cond:
            done.add(i)
            cond.notify_all()

    reader = reader_over(data, 4, tier, gate)
    try:
        reads = [(0, 3 * MiB), (3 * MiB, 10 * MiB), (13 * MiB, 7), (13 * MiB + 7, 18 * MiB), (MiB, 2 * MiB)]
        reads += [(len(data) - 9 * MiB, 9 * MiB), (0, len(data)), (len(data) - 1, 1), (5 * MiB + 1, 1)]
        for off, n in reads:
            dest = bytearray(n)
            reader.read_into(off, memoryview(dest))
            assert dest == data[off : off + n], (off, n)
    finally:
        reader.close()


def test_what_is_fetched_ahead_stays_within_its_window() -> None:
    """A 256 MiB file read front to back in 16 MiB reads: no piece is fetched more than
    AHEAD_MAX plus one piece past the read in progress (the memory a restore holds), every
    byte is fetched once, and each read finds the pieces it needs already requested."""
    size, conc, step = 256 * MiB, 8, 16 * MiB
    data = bytes(size)
    tier = RemoteTier(memory_url("window"))
    reading = [0, 0]  # the read in progress: [offset, end)
    past: list[int] = []
    fetched: list[int] = []
    lock = threading.Lock()

    def gate(start: int) -> None:
        with lock:
            fetched.append(start)
            past.append(min(start + piece, size) - reading[1])

    piece = read_piece_size(size, conc)
    reader = reader_over(data, conc, tier, gate)
    try:
        for off in range(0, size, step):
            reading[:] = [off, off + step]
            dest = bytearray(step)
            reader.read_into(off, memoryview(dest))
    finally:
        reader.close()
    assert sorted(fetched) == list(range(0, size, piece))
    assert max(past) <= RangeReader.AHEAD_MAX + piece, max(past) / MiB


def test_a_failed_or_short_range_fails_the_read() -> None:
    """A range that cannot be fetched fails the read that needs it (after its retries), and
    is asked for again by a later read; one that comes back short is an EOFError (restore:
    a corrupted shard), never zeros."""
    data = np.random.default_rng(4).bytes(20 * MiB)
    tier = RemoteTier(memory_url("fail"))
    tier.retry = RetryPolicy(budget_s=0.2, initial_s=0.01, max_s=0.05)
    bad = read_piece_size(len(data), 4) * 2

    failing = [True]

    def broken(start: int, n: int) -> bytes:
        if start == bad and failing[0]:
            raise OSError(5, "input/output error")
        return data[start : start + n]

    reader = RangeReader(broken, len(data), 4, tier._call, "reading test data")
    try:
        reader.read_into(0, memoryview(bytearray(bad)))  # before the bad piece: fine
        with pytest.raises(OSError, match="input/output"):
            reader.read_into(bad, memoryview(bytearray(MiB)))
        failing[0] = False
        again = bytearray(MiB)
        reader.read_into(bad, memoryview(again))
        assert again == data[bad : bad + MiB]
    finally:
        reader.close()
    short = RangeReader(lambda s, n: data[s : s + n - 1], len(data), 4, tier._call, "reading test data")
    try:
        with pytest.raises(EOFError, match="ends before byte"):
            short.read_into(0, memoryview(bytearray(MiB)))
    finally:
        short.close()


# --------------------------------------------------------------- restore, end to end


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_range_is_caught_while_ranges_complete_out_of_order(where: str) -> None:
    """One byte flipped in the first, a middle or the last range of a multi-range shard on
    tier 2; the last range arrives first (the others wait for it): the restore raises
    CheckpointCorruptedError naming the tensor, never returns the bytes."""
    state = state_of(24, seed=5)
    url = saved(f"flip-{where}", state)
    tier = RemoteTier(url, concurrency=8)
    path = f"{tier.root}/{naming.step_dir_name(1)}/{SHARD}"
    raw = bytearray(tier.fs.cat_file(path))
    piece = read_piece_size(len(raw), 8)
    count = -(-len(raw) // piece)
    assert 4 <= count <= 8  # all in flight at once: the last one is asked for with the first
    at = {"first": 100, "middle": (count // 2) * piece + 7, "last": len(raw) - 1000}[where]
    raw[at] ^= 0x01
    tier.fs.pipe_file(path, bytes(raw))
    last_done = threading.Event()

    def gate(start: int, end: int) -> None:
        if end != len(raw):
            assert last_done.wait(WAIT_S)

    def after(start: int, end: int) -> None:
        if end == len(raw):
            last_done.set()

    ranges = Ranges(tier, gate, after)
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(tiercheck.CheckpointCorruptedError, match=r"checksum mismatch for state\['t\d{3}'\]"):
        read_step(tier, 1, 0, tmpl, strict=True, world_size=1)
    assert len(ranges.seen) == count


def test_marker_and_manifest_come_in_one_round_trip() -> None:
    """A fresh-node restore reads the marker and then the manifest it names: two round
    trips before the first tensor byte. The manifest a job of this size saved is now
    fetched beside the marker: here the marker's read waits until the manifest's has
    started (before, it never did: the manifest was read only after the marker)."""
    state = state_of(2, seed=6)
    url = saved("guess", state)
    tier = RemoteTier(url)
    manifest_asked = threading.Event()
    overlapped: list[bool] = []
    orig = tier.read_bytes

    def read_bytes(step: int, name: str, limit: int) -> bytes:
        if name == naming.COMMIT_NAME:
            overlapped.append(manifest_asked.wait(5.0))
        elif name.endswith(".manifest.json"):
            manifest_asked.set()
        return orig(step, name, limit)

    tier.read_bytes = read_bytes  # type: ignore[method-assign]
    tmpl = {k: torch.zeros_like(v) for k, v in state.items()}
    read_step(tier, 1, 0, tmpl, strict=True, world_size=1)
    assert all(torch.equal(tmpl[k], v) for k, v in state.items())
    assert overlapped == [True]


def test_a_guessed_manifest_is_used_only_if_the_marker_vouches_for_it() -> None:
    """The manifest fetched beside the marker is the file the marker names only if the job
    has the saved number of ranks: a 1-rank step read with world_size=2 (a resized restore
    of its replicated keys) or a rank the step lacks reads what the marker says, and a
    manifest altered on the store is refused whichever read fetched it."""
    state = state_of(2, seed=7)
    url = memory_url("vouch")
    with tiercheck.Checkpointer(remote=url, replicated=["t000"]) as c:
        c.save(1, state).wait(timeout=WAIT_S)
    tier = RemoteTier(url)
    tmpl = {"t000": torch.zeros_like(state["t000"])}
    read_step(tier, 1, 1, tmpl, strict=True, world_size=2)  # rank 1 of 2: guesses rank-00001-of-00002
    assert torch.equal(tmpl["t000"], state["t000"])
    with pytest.raises(tiercheck.NoCheckpointError, match="no rank 1"):
        read_step(tier, 1, 1, tmpl, strict=True, world_size=None)
    name = naming.manifest_name(0, 1)
    path = f"{tier.root}/{naming.step_dir_name(1)}/{name}"
    raw = bytearray(tier.fs.cat_file(path))
    raw[len(raw) // 2] ^= 0x20
    tier.fs.pipe_file(path, bytes(raw))
    with pytest.raises(tiercheck.CheckpointCorruptedError, match="does not match the checksum"):
        read_step(tier, 1, 0, {k: torch.zeros_like(v) for k, v in state.items()}, strict=True, world_size=1)
