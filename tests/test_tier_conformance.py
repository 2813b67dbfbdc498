"""One conformance suite that every tier passes (the contract in `tiercheck/tiers/base.py`).

Each case is a fixture returning a `TierCase`: how to build the `Tier`, the `Checkpointer`
keyword arguments that put a checkpointer on that tier alone, and a way to drop raw bytes
under the tier's root (to plant junk the listing must ignore).

Adding a tier (e.g. a real S3 server from ``tests/servers``) takes two steps:

1. write a fixture that returns a `TierCase`, e.g.::

       @pytest.fixture
       def seaweedfs_case(s3_url: str, seaweedfs: Any) -> TierCase:
           return remote_case("s3", s3_url, seaweedfs.storage_options)

   (it may depend on server fixtures, and skip when their binary is absent);
2. append its name to `TIER_CASES`. Every test below then runs against it.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import tiercheck
from tiercheck import layout
from tiercheck.tiers.base import Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.remote import RemoteTier

SHARD = layout.shard_name(0, 1)
MANIFEST = layout.manifest_name(0, 1)


@dataclass
class TierCase:
    """A tier under test and the ways to reach it."""

    kind: str  # "local" or a remote protocol
    make_tier: Callable[[], Tier]
    ckpt_kwargs: dict[str, Any]  # Checkpointer(**ckpt_kwargs) uses only this tier
    location: str  # what tiercheck.load() takes
    storage_options: dict[str, Any] | None
    put_raw: Callable[[str, bytes], None]  # write bytes at a path relative to the root
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_remote(self) -> bool:
        return self.kind != "local"


def local_case(root: Path) -> TierCase:
    def put_raw(rel: str, data: bytes) -> None:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    return TierCase(
        kind="local",
        make_tier=lambda: LocalTier(root),
        ckpt_kwargs={"local": root},
        location=str(root),
        storage_options=None,
        put_raw=put_raw,
    )


def remote_case(kind: str, url: str, storage_options: dict[str, Any] | None = None) -> TierCase:
    """A case for any fsspec URL; raw writes go through a fresh fsspec filesystem."""
    opts = dict(storage_options or {})

    def put_raw(rel: str, data: bytes) -> None:
        fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **opts)
        if url.startswith("file://"):
            fs.makedirs(fs._parent(f"{root.rstrip('/')}/{rel}"), exist_ok=True)
        fs.pipe_file(f"{root.rstrip('/')}/{rel}", data)

    return TierCase(
        kind=kind,
        make_tier=lambda: RemoteTier(url, opts),
        ckpt_kwargs={"remote": url, "storage_options": opts},
        location=url,
        storage_options=opts,
        put_raw=put_raw,
    )


# ------------------------------------------------------------------------- the cases


@pytest.fixture
def local_dir_case(tmp_path: Path) -> TierCase:
    return local_case(tmp_path / "tier")


@pytest.fixture
def file_url_case(tmp_path: Path) -> TierCase:
    return remote_case("file", f"file://{tmp_path / 'bucket' / 'run'}")


@pytest.fixture
def memory_url_case() -> Iterator[TierCase]:
    name = f"conformance-{uuid.uuid4().hex}"
    yield remote_case("memory", f"memory://{name}/run")
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


# Gaps a tier shows only on real servers, as strict xfails per (case, test), so the tests
# themselves stay the same for every tier. Empty now; keep the mechanism for the next one.
SERVER_XFAILS: dict[str, dict[str, str]] = {}


def server_case(name: str, server: Any, request: pytest.FixtureRequest) -> TierCase:
    """A case on a real object-store server from tests/servers (a fresh prefix per test)."""
    reason = SERVER_XFAILS.get(name, {}).get(request.node.originalname)
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    opts = {k: v for k, v in server.storage_options.items() if k != "skip_instance_cache"}
    return remote_case(server.protocol, server.unique_url("conf"), opts)


@pytest.fixture
def seaweedfs_case(seaweedfs_healthy: Any, request: pytest.FixtureRequest) -> TierCase:
    return server_case("seaweedfs_case", seaweedfs_healthy, request)


@pytest.fixture
def azurite_case(azurite: Any, request: pytest.FixtureRequest) -> TierCase:
    return server_case("azurite_case", azurite, request)


@pytest.fixture
def gcs_case(gcs_server: Any, request: pytest.FixtureRequest) -> TierCase:
    return server_case("gcs_case", gcs_server, request)


TIER_CASES = ["local_dir_case", "file_url_case", "memory_url_case", "seaweedfs_case", "azurite_case", "gcs_case"]


@pytest.fixture(params=TIER_CASES)
def case(request: pytest.FixtureRequest) -> TierCase:
    got = request.getfixturevalue(request.param)
    assert isinstance(got, TierCase)
    return got


@pytest.fixture
def tier(case: TierCase) -> Tier:
    return case.make_tier()


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


def test_step_listed_only_after_commit(tier: Tier) -> None:
    assert tier.committed_steps() == []
    w = tier.open_step(5, 0)
    w.write_file(SHARD, memoryview(payload(10_000)))
    assert tier.committed_steps() == []
    w.write_file(MANIFEST, memoryview(b'{"m": 1}'))
    assert tier.committed_steps() == []
    w.commit(b'{"marker": 1}')
    assert tier.committed_steps() == [5]
    assert tier.read_bytes(5, layout.COMMIT_NAME, 1 << 20) == b'{"marker": 1}'
    write_step(tier, 7, {SHARD: b"x"})
    write_step(tier, 6, {SHARD: b"y"})
    assert tier.committed_steps() == [5, 6, 7]


def test_a_fresh_tier_object_sees_committed_steps(case: TierCase, tier: Tier) -> None:
    write_step(tier, 3, {SHARD: payload(5000, 3)})
    again = case.make_tier()
    assert again.committed_steps() == [3]
    assert again.read_bytes(3, SHARD, 5000) == payload(5000, 3)


def test_abort_leaves_nothing_listed(tier: Tier) -> None:
    w = tier.open_step(9, 0)
    w.write_file(SHARD, memoryview(payload(20_000)))
    w.write_file(MANIFEST, memoryview(b"{}"))
    w.abort()
    assert tier.committed_steps() == []
    with pytest.raises(FileNotFoundError):
        tier.read_bytes(9, SHARD, 1 << 20)
    assert tier.remove_leftovers() == []  # abort cleaned up after itself
    # the same step can be written again after an abort
    write_step(tier, 9, {SHARD: b"again"})
    assert tier.committed_steps() == [9]
    assert tier.read_bytes(9, SHARD, 100) == b"again"


def test_abort_before_any_write_and_twice_never_raises(tier: Tier) -> None:
    w = tier.open_step(1, 0)
    w.abort()
    w.abort()
    assert tier.committed_steps() == []


def test_read_bytes(tier: Tier) -> None:
    data = payload(3000, 1)
    write_step(tier, 2, {SHARD: data, MANIFEST: b""})
    assert tier.read_bytes(2, SHARD, 3000) == data
    assert tier.read_bytes(2, SHARD, 1 << 30) == data
    assert tier.read_bytes(2, MANIFEST, 10) == b""
    with pytest.raises(tiercheck.CheckpointCorruptedError):
        tier.read_bytes(2, SHARD, 2999)
    with pytest.raises(FileNotFoundError):
        tier.read_bytes(2, "rank-00000-of-00002.shard", 100)
    with pytest.raises(FileNotFoundError):
        tier.read_bytes(99, SHARD, 100)


def test_open_file_and_read_into_ranges(tier: Tier) -> None:
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
            with pytest.raises(EOFError):
                f.read_into(offset, memoryview(bytearray(n)))
    finally:
        f.close()


def test_open_file_of_an_empty_file(tier: Tier) -> None:
    write_step(tier, 1, {SHARD: b""})
    f = tier.open_file(1, SHARD)
    try:
        assert f.size == 0
        f.read_into(0, memoryview(bytearray(0)))
        with pytest.raises(EOFError):
            f.read_into(0, memoryview(bytearray(1)))
    finally:
        f.close()


def test_open_file_missing_raises_file_not_found(tier: Tier) -> None:
    write_step(tier, 1, {SHARD: b"abc"})
    with pytest.raises(FileNotFoundError):
        tier.open_file(1, "rank-00001-of-00002.shard")
    with pytest.raises(FileNotFoundError):
        tier.open_file(2, SHARD)


def test_delete_step(tier: Tier) -> None:
    for s in (1, 2, 3):
        write_step(tier, s, {SHARD: payload(1000, s), MANIFEST: b"{}"})
    tier.delete_step(2)
    assert tier.committed_steps() == [1, 3]
    with pytest.raises(FileNotFoundError):
        tier.read_bytes(2, SHARD, 1 << 20)
    with pytest.raises(FileNotFoundError):
        tier.read_bytes(2, layout.COMMIT_NAME, 1 << 20)
    tier.delete_step(2)  # deleting again, or a step never written, is a no-op
    tier.delete_step(1000)
    assert tier.committed_steps() == [1, 3]
    assert tier.read_bytes(3, SHARD, 1 << 20) == payload(1000, 3)
    # a deleted step can be written again (a new branch after a restore does that)
    write_step(tier, 2, {SHARD: b"new"})
    assert tier.committed_steps() == [1, 2, 3]
    assert tier.read_bytes(2, SHARD, 10) == b"new"


def test_committed_steps_ignores_junk_and_uncommitted_steps(case: TierCase, tier: Tier) -> None:
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


def test_committed_steps_of_a_missing_root_is_empty(case: TierCase) -> None:
    assert case.make_tier().committed_steps() == []


def test_path_of_names_the_step(tier: Tier) -> None:
    assert layout.step_dir_name(42) in tier.path_of(42)
    assert tier.path_of(42, SHARD).endswith(f"{layout.step_dir_name(42)}/{SHARD}")


def test_write_from_path(tier: Tier, tmp_path: Path) -> None:
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


def test_checkpointer_round_trip_through_this_tier_alone(case: TierCase) -> None:
    states = {s: sample_state(s) for s in (10, 20, 30)}
    with tiercheck.Checkpointer(**case.ckpt_kwargs, keep_local=None) as ckpt:
        for s, st in states.items():
            h = ckpt.save(s, st)
            h.wait()
            assert h.done()
        tier_name = "remote" if case.is_remote else "local"
        assert ckpt.steps(tier_name) == [10, 20, 30]
        assert ckpt.latest_step() == 30
        tmpl = template_of(states[30])
        model_w = tmpl["model"]["w"]
        assert ckpt.restore(tmpl) == 30
        assert tmpl["model"]["w"] is model_w  # in place
        assert_same(tmpl, states[30])
        tmpl = template_of(states[20])
        assert ckpt.restore(tmpl, step=20) == 20
        assert_same(tmpl, states[20])
    assert_same(tiercheck.load(case.location, storage_options=case.storage_options), states[30])
    assert_same(tiercheck.load(case.location, step=10, storage_options=case.storage_options), states[10])
    # a new checkpointer on the same tier finds the steps
    with tiercheck.Checkpointer(**case.ckpt_kwargs, keep_local=None) as again:
        assert again.steps() == [10, 20, 30]
        sub: dict[str, Any] = {"model": {"w": torch.zeros(64, 33)}, "epoch": None}
        assert again.restore(sub) == 30
        assert torch.equal(sub["model"]["w"], states[30]["model"]["w"])
        assert sub["epoch"] == 30


def test_checkpointer_retention_on_this_tier(case: TierCase) -> None:
    key = "keep_remote" if case.is_remote else "keep_local"
    kwargs = {**case.ckpt_kwargs, "keep_local": None, key: 2}
    with tiercheck.Checkpointer(**kwargs) as ckpt:
        for s in range(1, 6):
            ckpt.save(s, {"x": torch.full((100,), float(s))})
        ckpt.wait()
        assert ckpt.steps() == [4, 5]
    assert case.make_tier().committed_steps() == [4, 5]


def test_compressed_round_trip(case: TierCase) -> None:
    if not case.is_remote:
        pytest.skip("remote_compression applies to the remote tier only")
    # compressible (bf16, repeated) and incompressible (random bits) tensors side by side
    state = sample_state(7)
    state["model"]["zeros"] = torch.zeros(300_000, dtype=torch.bfloat16)
    with tiercheck.Checkpointer(**case.ckpt_kwargs, remote_compression="zstd") as ckpt:
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
    assert_same(tiercheck.load(case.location, storage_options=case.storage_options), state)
