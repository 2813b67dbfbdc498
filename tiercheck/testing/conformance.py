"""The conformance suite every tier passes: the contract of `tiercheck.tiers.base`, checked.

Each check is a function ``check_x(case, scratch)`` that raises AssertionError when the
tier breaks the contract, or `NotApplicable` when the check does not apply to it. A
`TierCase` says how to build the tier (a fresh object on the same storage each call), how
to plant raw bytes under its root, and how a `Checkpointer` reaches it. Each check needs a
case whose storage is empty.

Run them all (no pytest needed)::

    from tiercheck.testing.conformance import TierCase, check_tier
    check_tier(lambda: TierCase(make_tier=..., put_raw=...), scratch_dir)

or one pytest test per check::

    @pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
    def test_conformance(check, case, tmp_path):
        try:
            check(case, tmp_path)
        except NotApplicable as why:
            pytest.skip(str(why))
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.tiers.base import Tier

SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)


class NotApplicable(Exception):
    """A check that does not apply to this tier (its message says why)."""


@dataclass(frozen=True)
class TierCase:
    """A tier under test and the ways to reach it.

    Attributes:
        make_tier: a fresh `Tier` object on the case's storage at each call.
        put_raw: write bytes at a path relative to the tier's root, bypassing the tier
            (to plant junk its listing must ignore).
        role: "local" or "remote": the Checkpointer argument the tier is given as.
        location: what `tiercheck.load` and `Checkpointer` take instead of the tier object
            (a path or URL); None: the tier object itself is passed.
        storage_options: fsspec options going with `location`.
        compression: a Checkpointer on `location` accepts ``remote_compression="zstd"``.
        kind: a label for reports.
    """

    make_tier: Callable[[], Tier]
    put_raw: Callable[[str, bytes], None]
    role: str = "remote"
    location: str | os.PathLike[str] | None = None
    storage_options: dict[str, Any] | None = None
    compression: bool = False
    kind: str = ""

    def checkpointer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments that put a Checkpointer on this tier alone."""
        if self.location is None:
            return {self.role: self.make_tier()}
        if self.storage_options is None:
            return {self.role: self.location}
        return {self.role: self.location, "storage_options": self.storage_options}

    def load(self, step: int | None = None) -> dict[Any, Any]:
        """`tiercheck.load` on this tier."""
        if self.location is None:
            return tiercheck.load(self.make_tier(), step=step)
        return tiercheck.load(self.location, step=step, storage_options=self.storage_options)


@contextlib.contextmanager
def raises(kind: type[BaseException]) -> Iterator[None]:
    """Like pytest.raises, without pytest: the block must raise `kind`."""
    try:
        yield
    except kind:
        return
    raise AssertionError(f"did not raise {kind.__name__}")


# ------------------------------------------------------------------------- helpers


def write_step(tier: Tier, step: int, files: dict[str, bytes], marker: bytes = b"{}") -> None:
    w = tier.open_step(step, 0)
    for name, data in files.items():
        assert w.write_file(name, memoryview(data)) == len(data)
    w.commit(marker)


def payload(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def sample_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    raw = bytearray(np.random.default_rng(seed).bytes(4096))
    return {
        "model": {
            "w": torch.randn(64, 33, generator=g),
            "b16": torch.randn(17, generator=g).to(torch.bfloat16),
            "h": torch.randn(5, 3, generator=g).half(),
            "bits": torch.frombuffer(raw, dtype=torch.uint8).clone().view(torch.float32),  # NaN payloads
        },
        "opt": {0: {"m": torch.randint(-(2**40), 2**40, (9,), generator=g)}, "0": [1, (2.5, None)]},
        "mask": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 4, dtype=torch.int16),
        "np": np.arange(7, dtype=np.uint32) * seed,
        "rng": (seed, 2**100 + seed, -0.0, math.inf),
        "tag": f"run-{seed}",
        "blob": b"\x00\xffbytes",
        "epoch": seed,
    }


def template_of(state: dict[str, Any]) -> dict[str, Any]:
    def blank(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, np.ndarray):
            return np.zeros_like(v)
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        if isinstance(v, list):
            return [blank(x) for x in v]
        return None if not isinstance(v, tuple) else tuple(blank(x) for x in v)

    return blank(state)  # type: ignore[no-any-return]


def assert_same(got: Any, want: Any, path: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert torch.equal(bits(got), bits(want)), path
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), path
        assert (got.dtype, got.shape, got.tobytes()) == (want.dtype, want.shape, want.tobytes()), path
    elif isinstance(want, dict):
        assert type(got) is dict, path
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], path
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want), path
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert type(got) is float, path
        assert (got, math.copysign(1, got)) == (want, math.copysign(1, want)), path
    else:
        assert (type(got), got) == (type(want), want), path


# ------------------------------------------------------------------------- the contract
# Each check gets a case whose tier is empty and a scratch directory of its own.


def check_step_listed_only_after_commit(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    assert tier.committed_steps() == []
    w = tier.open_step(5, 0)
    w.write_file(SHARD, memoryview(payload(10_000)))
    assert tier.committed_steps() == []
    w.write_file(MANIFEST, memoryview(b'{"m": 1}'))
    assert tier.committed_steps() == []
    w.commit(b'{"marker": 1}')
    assert tier.committed_steps() == [5]
    assert tier.read_bytes(5, naming.COMMIT_NAME, 1 << 20) == b'{"marker": 1}'
    write_step(tier, 7, {SHARD: b"x"})
    write_step(tier, 6, {SHARD: b"y"})
    assert tier.committed_steps() == [5, 6, 7]


def check_a_fresh_tier_object_sees_committed_steps(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    write_step(tier, 3, {SHARD: payload(5000, 3)})
    again = case.make_tier()
    assert again.committed_steps() == [3]
    assert again.read_bytes(3, SHARD, 5000) == payload(5000, 3)


def check_abort_leaves_nothing_listed(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    w = tier.open_step(9, 0)
    w.write_file(SHARD, memoryview(payload(20_000)))
    w.write_file(MANIFEST, memoryview(b"{}"))
    w.abort()
    assert tier.committed_steps() == []
    with raises(FileNotFoundError):
        tier.read_bytes(9, SHARD, 1 << 20)
    assert tier.remove_leftovers() == []  # abort cleaned up after itself
    # the same step can be written again after an abort
    write_step(tier, 9, {SHARD: b"again"})
    assert tier.committed_steps() == [9]
    assert tier.read_bytes(9, SHARD, 100) == b"again"


def check_abort_before_any_write_and_twice_never_raises(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    w = tier.open_step(1, 0)
    w.abort()
    w.abort()
    assert tier.committed_steps() == []


def check_read_bytes(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    data = payload(3000, 1)
    write_step(tier, 2, {SHARD: data, MANIFEST: b""})
    assert tier.read_bytes(2, SHARD, 3000) == data
    assert tier.read_bytes(2, SHARD, 1 << 30) == data
    assert tier.read_bytes(2, MANIFEST, 10) == b""
    with raises(tiercheck.CheckpointCorruptedError):
        tier.read_bytes(2, SHARD, 2999)
    with raises(FileNotFoundError):
        tier.read_bytes(2, "rank-00000-of-00002.shard", 100)
    with raises(FileNotFoundError):
        tier.read_bytes(99, SHARD, 100)


def check_open_file_and_read_into_ranges(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    data = payload(200_000, 2)
    write_step(tier, 4, {SHARD: data})
    f = tier.open_file(4, SHARD)
    try:
        assert f.size == len(data)
        for offset, n in [(0, 0), (0, 1), (0, 4096), (4095, 3), (123_457, 50_000), (len(data) - 7, 7), (0, len(data))]:
            dest = bytearray(n)
            f.read_into(offset, memoryview(dest))
            assert bytes(dest) == data[offset : offset + n], (offset, n)
        # out of order and repeated reads are fine
        dest = bytearray(10)
        f.read_into(100, memoryview(dest))
        f.read_into(100, memoryview(dest))
        assert bytes(dest) == data[100:110]
        for offset, n in [(len(data) - 5, 6), (len(data), 1), (len(data) + 100, 10)]:
            with raises(EOFError):
                f.read_into(offset, memoryview(bytearray(n)))
    finally:
        f.close()


def check_prefetch_is_a_hint(case: TierCase, scratch: Path) -> None:
    """`prefetch` (a no-op unless the tier declares `capabilities.prefetch`) returns for any
    range, past the end included, and changes no byte a read returns."""
    tier = case.make_tier()
    data = payload(300_000, 3)
    write_step(tier, 2, {SHARD: data})
    f = tier.open_file(2, SHARD)
    try:
        for offset, n in [(0, len(data)), (0, 0), (4096, 10), (len(data) - 1, 100), (len(data) + 4096, 1 << 20)]:
            f.prefetch(offset, n)
        dest = bytearray(len(data))
        f.read_into(0, memoryview(dest))
        assert bytes(dest) == data
    finally:
        f.close()


def check_open_file_of_an_empty_file(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    write_step(tier, 1, {SHARD: b""})
    f = tier.open_file(1, SHARD)
    try:
        assert f.size == 0
        f.read_into(0, memoryview(bytearray(0)))
        with raises(EOFError):
            f.read_into(0, memoryview(bytearray(1)))
    finally:
        f.close()


def check_open_file_missing_raises_file_not_found(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    write_step(tier, 1, {SHARD: b"abc"})
    with raises(FileNotFoundError):
        tier.open_file(1, "rank-00001-of-00002.shard")
    with raises(FileNotFoundError):
        tier.open_file(2, SHARD)


def check_delete_step(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    for s in (1, 2, 3):
        write_step(tier, s, {SHARD: payload(1000, s), MANIFEST: b"{}"})
    tier.delete_step(2)
    assert tier.committed_steps() == [1, 3]
    with raises(FileNotFoundError):
        tier.read_bytes(2, SHARD, 1 << 20)
    with raises(FileNotFoundError):
        tier.read_bytes(2, naming.COMMIT_NAME, 1 << 20)
    tier.delete_step(2)  # deleting again, or a step never written, is a no-op
    tier.delete_step(1000)
    assert tier.committed_steps() == [1, 3]
    assert tier.read_bytes(3, SHARD, 1 << 20) == payload(1000, 3)
    # a deleted step can be written again (a new branch after a restore does that)
    write_step(tier, 2, {SHARD: b"new"})
    assert tier.committed_steps() == [1, 2, 3]
    assert tier.read_bytes(2, SHARD, 10) == b"new"


def check_committed_steps_ignores_junk_and_uncommitted_steps(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    write_step(tier, 12, {SHARD: b"ok"})
    junk = {
        "README": b"not a step",
        "step-1/COMMIT": b"{}",  # not the canonical spelling
        "step-0000000000013/COMMIT": b"{}",  # 13 digits with a leading zero: not canonical
        "step-00000000001x/COMMIT": b"{}",
        "Step-000000000014/COMMIT": b"{}",
        "step-000000000015.bak/COMMIT": b"{}",
        "step-000000000016/rank-00000-of-00001.shard": b"uncommitted",
        "step-000000000017/sub/COMMIT": b"{}",  # a marker one level too deep
        "nested/step-000000000018/COMMIT": b"{}",  # a step dir one level too deep
        ".tiercheck-tmp-step-000000000019-r00000-0123456789abcdef/COMMIT": b"{}",
        ".tiercheck-trash-step-000000000020-0123456789abcdef/COMMIT": b"{}",
        "step-000000000021/COMMIT.tmp": b"{}",
        "step-000000000022/XCOMMIT": b"{}",
        "step-000000000023": b"a file, not a directory",
    }
    for rel, data in junk.items():
        case.put_raw(rel, data)
    assert tier.committed_steps() == [12]
    # a step dir written by hand with a marker counts, whatever wrote it
    case.put_raw("step-000000000030/COMMIT", b"{}")
    assert tier.committed_steps() == [12, 30]


def check_committed_steps_of_a_missing_root_is_empty(case: TierCase, scratch: Path) -> None:
    assert case.make_tier().committed_steps() == []


def check_path_of_names_the_step(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    assert naming.step_dir_name(42) in tier.path_of(42)
    assert tier.path_of(42, SHARD).endswith(f"{naming.step_dir_name(42)}/{SHARD}")


def check_write_from_path(case: TierCase, scratch: Path) -> None:
    tier = case.make_tier()
    tmp_path = scratch
    src = tmp_path / "src.bin"
    data = payload(300_000, 5)
    src.write_bytes(data)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    w = tier.open_step(8, 0)
    assert w.write_from_path(SHARD, str(src)) == len(data)
    assert w.write_from_path(MANIFEST, str(empty)) == 0
    w.commit(b"{}")
    assert tier.read_bytes(8, SHARD, len(data)) == data
    assert tier.read_bytes(8, MANIFEST, 10) == b""


# ------------------------------------------------------------------------- through a Checkpointer


def check_checkpointer_round_trip_through_this_tier_alone(case: TierCase, scratch: Path) -> None:
    states = {s: sample_state(s) for s in (10, 20, 30)}
    with tiercheck.Checkpointer(**case.checkpointer_kwargs(), keep_local=None) as ckpt:
        for s, st in states.items():
            h = ckpt.save(s, st)
            h.wait()
            assert h.done()
        assert ckpt.steps(case.role) == [10, 20, 30]
        assert ckpt.latest_step() == 30
        tmpl = template_of(states[30])
        model_w = tmpl["model"]["w"]
        assert ckpt.restore(tmpl) == 30
        assert tmpl["model"]["w"] is model_w  # in place
        assert_same(tmpl, states[30])
        tmpl = template_of(states[20])
        assert ckpt.restore(tmpl, step=20) == 20
        assert_same(tmpl, states[20])
    assert_same(case.load(), states[30])
    assert_same(case.load(step=10), states[10])
    # a new checkpointer on the same tier finds the steps
    with tiercheck.Checkpointer(**case.checkpointer_kwargs(), keep_local=None) as again:
        assert again.steps() == [10, 20, 30]
        sub: dict[str, Any] = {"model": {"w": torch.zeros(64, 33)}, "epoch": None}
        assert again.restore(sub) == 30
        assert torch.equal(sub["model"]["w"], states[30]["model"]["w"])
        assert sub["epoch"] == 30


def check_checkpointer_retention_on_this_tier(case: TierCase, scratch: Path) -> None:
    key = f"keep_{case.role}"
    kwargs = {**case.checkpointer_kwargs(), "keep_local": None, key: 2}
    with tiercheck.Checkpointer(**kwargs) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, {"x": torch.full((100,), float(s))})
        ckpt.wait()
        assert ckpt.steps() == [4, 5]
    assert case.make_tier().committed_steps() == [4, 5]


def check_compressed_round_trip(case: TierCase, scratch: Path) -> None:
    if not case.compression:
        raise NotApplicable("remote_compression applies to a remote tier the Checkpointer builds from a URL")
    # compressible (bf16, repeated) and incompressible (random bits) tensors side by side
    state = sample_state(7)
    state["model"]["zeros"] = torch.zeros(300_000, dtype=torch.bfloat16)
    with tiercheck.Checkpointer(**case.checkpointer_kwargs(), remote_compression="zstd") as ckpt:
        ckpt.save(1, state).wait()
        tmpl = template_of(state)
        assert ckpt.restore(tmpl) == 1
        assert_same(tmpl, state)
    tier = case.make_tier()
    manifest = json.loads(tier.read_bytes(1, MANIFEST, 1 << 30))
    (shard,) = manifest["files"]
    assert shard["codec"] == "zstd"
    stored = tier.open_file(1, SHARD)
    try:
        assert stored.size == shard["stored_length"]
        assert stored.size < 600_000 // 4  # the zeros compress
    finally:
        stored.close()
    assert_same(case.load(), state)


CHECKS: tuple[Callable[[TierCase, Path], None], ...] = (
    check_step_listed_only_after_commit,
    check_a_fresh_tier_object_sees_committed_steps,
    check_abort_leaves_nothing_listed,
    check_abort_before_any_write_and_twice_never_raises,
    check_read_bytes,
    check_open_file_and_read_into_ranges,
    check_prefetch_is_a_hint,
    check_open_file_of_an_empty_file,
    check_open_file_missing_raises_file_not_found,
    check_delete_step,
    check_committed_steps_ignores_junk_and_uncommitted_steps,
    check_committed_steps_of_a_missing_root_is_empty,
    check_path_of_names_the_step,
    check_write_from_path,
    check_checkpointer_round_trip_through_this_tier_alone,
    check_checkpointer_retention_on_this_tier,
    check_compressed_round_trip,
)


def check_tier(new_case: Callable[[], TierCase], scratch: str | os.PathLike[str]) -> dict[str, str]:
    """Run every check, each on a fresh case from `new_case()` and its own directory under
    `scratch`; return the checks that did not apply, with why. Raises the first failure."""
    skipped: dict[str, str] = {}
    for check in CHECKS:
        own = Path(scratch) / check.__name__
        own.mkdir(parents=True, exist_ok=True)
        try:
            check(new_case(), own)
        except NotApplicable as why:
            skipped[check.__name__] = str(why)
    return skipped
