"""The remote tier in the pipeline: chained uploads, per-tier retention, restore across
tiers, and failure handling, against ``memory://``, ``file://`` and the fault-injecting
``faultymem://`` filesystem (`faulty_fs.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import tiercheck
from tests.helpers.faulty_fs import OPS, Faults, FaultyMemoryFileSystem
from tiercheck import KeepEvery, KeepLast
from tiercheck.errors import UploadSkippedError
from tiercheck.format import naming

SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
COMMIT = naming.COMMIT_NAME

# ----------------------------------------------------------------------------- helpers


def state_of(step: int, n: int = 16_384) -> dict[str, Any]:
    """A state whose bytes depend on `step` (random bit patterns, bf16 included)."""
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(n, generator=g),
        "h": torch.randn(n // 4, generator=g).to(torch.bfloat16),
        "i": torch.randint(0, 2**62, (33,), generator=g),
        "step": step,
    }


def template() -> dict[str, Any]:
    return {"w": torch.zeros(16_384), "h": torch.zeros(4096, dtype=torch.bfloat16), "i": torch.zeros(33).long()}


def assert_state(got: dict[str, Any], step: int) -> None:
    want = state_of(step)
    for k in ("w", "h", "i"):
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k].view(torch.uint8) if got[k].dim() else got[k], want[k].view(torch.uint8)), k
    assert got["step"] == step


def restored(ckpt: tiercheck.Checkpointer, step: int | None = None) -> tuple[int | None, dict[str, Any]]:
    tmpl: dict[str, Any] = {**template(), "step": None}
    got = ckpt.restore(tmpl, step=step)
    return got, tmpl


def eventually(cond: Callable[[], object], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def step_path(root: str, step: int, name: str | None = None) -> str:
    """The path of a step (or a file of it) in the faulty store (no protocol)."""
    d = f"/{root}/{naming.step_dir_name(step)}"
    return d if name is None else f"{d}/{name}"


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
def faults() -> Iterator[Faults]:
    f = Faults()
    yield f
    f.heal()


@pytest.fixture
def bucket() -> Iterator[str]:
    """A fresh root in the faulty store: ``faultymem://<bucket>``."""
    name = f"bucket-{uuid.uuid4().hex[:12]}/run"
    yield name
    FaultyMemoryFileSystem(skip_instance_cache=True).clear_under(f"/{name}")


@pytest.fixture
def mem_url() -> Iterator[str]:
    name = f"remote-test-{uuid.uuid4().hex[:12]}"
    yield f"memory://{name}/run"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


@pytest.fixture
def make(tmp_path: Path, faults: Faults, bucket: str) -> Iterator[Callable[..., tiercheck.Checkpointer]]:
    """`make(**kwargs)`: a Checkpointer on tmp_path/"local" and faultymem://<bucket>, with
    keep_local=None; `local=None` or `remote=None` drops a tier. Closed at teardown."""
    made: list[tiercheck.Checkpointer] = []

    def build(**kwargs: Any) -> tiercheck.Checkpointer:
        kwargs.setdefault("local", tmp_path / "local")
        kwargs.setdefault("remote", f"faultymem://{bucket}")
        kwargs.setdefault("keep_local", None)
        if kwargs["remote"] is not None and kwargs["remote"].startswith("faultymem://"):
            kwargs.setdefault("storage_options", {"faults": faults})
        c = tiercheck.Checkpointer(**kwargs)
        made.append(c)
        return c

    yield build
    faults.heal()  # never let teardown wait out a retry budget
    for c in made:
        with contextlib.suppress(tiercheck.TiercheckError):
            c.close()


def local_step_dir(tmp_path: Path, step: int) -> Path:
    return tmp_path / "local" / naming.step_dir_name(step)


def down(faults: Faults, exc: type[BaseException] = ConnectionRefusedError, ops: tuple[str, ...] = ()) -> None:
    faults.fail(exc, ops=set(ops) if ops else OPS)


# ============================================================================= the chain


def test_step_reaches_both_tiers(make: Callable[..., tiercheck.Checkpointer], faults: Faults) -> None:
    ckpt = make()
    h1 = ckpt.save(1, state_of(1))
    h1.wait(tier="remote")
    assert h1.done("remote")
    h1.wait()
    assert h1.done("local") and h1.done()
    assert h1.tiers == ("local", "remote")
    assert ckpt.steps("local") == [1]
    assert ckpt.steps("remote") == [1]
    assert ckpt.latest_step("remote") == 1

    # uploads held back: the step is durable locally, not yet remotely
    faults.slow(60, ops={"write"})
    h2 = ckpt.save(2, state_of(2))
    h2.wait("local", timeout=10)
    assert h2.done("local")
    assert not h2.done("remote")
    assert not h2.done()
    with pytest.raises(tiercheck.WaitTimeoutError):
        h2.wait("remote", timeout=0.1)
    assert ckpt.steps("local") == [1, 2]
    assert ckpt.steps("remote") == [1]
    assert ckpt.latest_step("remote") == 1
    assert ckpt.latest_step() == 2
    faults.heal()
    h2.wait("remote", timeout=10)
    ckpt.wait()
    assert ckpt.steps("remote") == [1, 2]
    assert ckpt.latest_step("remote") == 2
    with pytest.raises(ValueError, match="tier"):
        h2.wait("cloud")
    with pytest.raises(ValueError, match="tier"):
        ckpt.steps("cloud")


def test_listing_the_remote_costs_one_call(make: Callable[..., tiercheck.Checkpointer], faults: Faults) -> None:
    ckpt = make(upload_backlog="all")
    for s in range(1, 9):
        ckpt.save(s, state_of(s, 256))
    ckpt.wait()
    before = len(faults.log)
    assert ckpt.steps("remote") == list(range(1, 9))
    assert [k for k, _ in faults.log[before:]] == ["list"]  # not a round trip per step


@pytest.mark.parametrize("with_local", [True, False], ids=["from-tier1", "from-host-buffer"])
def test_remote_step_has_local_layout_and_commit_goes_last(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, tmp_path: Path, with_local: bool
) -> None:
    ckpt = make() if with_local else make(local=None)
    for s in (3, 4):
        ckpt.save(s, state_of(s)).wait()
    fs = FaultyMemoryFileSystem(skip_instance_cache=True)
    for s in (3, 4):
        remote_names = sorted(p.rsplit("/", 1)[1] for p in fs.find(step_path(bucket, s)))
        assert remote_names == sorted([SHARD, MANIFEST, COMMIT])
        if with_local:
            assert sorted(p.name for p in local_step_dir(tmp_path, s).iterdir()) == remote_names
        events = faults.events(under=step_path(bucket, s) + "/")
        written = [p.rsplit("/", 1)[1] for k, p in events if k == "written"]
        assert written == [SHARD, MANIFEST, COMMIT]  # marker last, and each file once
        # the marker's upload starts only after every other file completed
        commit_start = events.index(("write", step_path(bucket, s, COMMIT)))
        for name in (SHARD, MANIFEST):
            assert events.index(("written", step_path(bucket, s, name))) < commit_start
        assert not [e for e in events if e[0] == "delete"]  # no renames or clean-ups
    ckpt.close()
    got = tiercheck.load(f"faultymem://{bucket}", storage_options={"faults": faults})
    assert_state(got, 4)


def test_uploaded_files_equal_local_files(make: Callable[..., tiercheck.Checkpointer], tmp_path: Path) -> None:
    remote = f"file://{tmp_path / 'bucket'}"
    ckpt = make(remote=remote)
    ckpt.save(5, state_of(5)).wait()
    local_dir = local_step_dir(tmp_path, 5)
    remote_dir = tmp_path / "bucket" / naming.step_dir_name(5)
    assert sorted(p.name for p in remote_dir.iterdir()) == sorted(p.name for p in local_dir.iterdir())
    for p in local_dir.iterdir():
        assert (remote_dir / p.name).read_bytes() == p.read_bytes(), p.name


def test_compressed_upload_from_tier1_restores_on_a_fresh_node(
    make: Callable[..., tiercheck.Checkpointer], mem_url: str, tmp_path: Path
) -> None:
    ckpt = make(remote=mem_url, remote_compression="zstd")
    st = state_of(6)
    st["zeros"] = torch.zeros(1 << 18)
    ckpt.save(6, st).wait()
    fs, root = fsspec.core.url_to_fs(mem_url)
    manifest = json.loads(fs.cat_file(f"{root}/{naming.step_dir_name(6)}/{MANIFEST}"))
    assert manifest["files"][0]["codec"] == "zstd"
    assert fs.info(f"{root}/{naming.step_dir_name(6)}/{SHARD}")["size"] < manifest["files"][0]["length"]
    # the local copy stays raw
    local_manifest = json.loads((local_step_dir(tmp_path, 6) / MANIFEST).read_bytes())
    assert "codec" not in local_manifest["files"][0]
    fresh = make(local=tmp_path / "fresh", remote=mem_url)
    tmpl = {**template(), "step": None, "zeros": torch.ones(1 << 18)}
    assert fresh.restore(tmpl) == 6
    assert_state(tmpl, 6)
    assert torch.equal(tmpl["zeros"], st["zeros"])


# ============================================================================= retention


def test_retention_per_tier(make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str) -> None:
    ckpt = make(keep_local=1, keep_remote=3, upload_backlog="all")
    for s in range(1, 7):
        ckpt.save(s, state_of(s))
    ckpt.wait()
    assert ckpt.steps("local") == [6]
    assert ckpt.steps("remote") == [4, 5, 6]
    assert ckpt.steps() == [4, 5, 6]
    fs = FaultyMemoryFileSystem(skip_instance_cache=True)
    for s in (1, 2, 3):
        # the marker goes first, so a deletion cut short never leaves a listed, partial step
        deletes = faults.events("delete", under=step_path(bucket, s))
        assert deletes[0] == ("delete", step_path(bucket, s, COMMIT)), deletes
        assert fs.find(step_path(bucket, s)) == []
    _, got = restored(ckpt, 4)  # an older step, only on the remote tier now
    assert_state(got, 4)


def test_local_step_awaiting_upload_is_not_pruned(make: Callable[..., tiercheck.Checkpointer], faults: Faults) -> None:
    ckpt = make(keep_local=1, upload_backlog="all")
    faults.slow(60, ops={"write"})  # the remote tier hangs
    handles = [ckpt.save(s, state_of(s)) for s in (1, 2, 3)]
    for h in handles:
        h.wait("local", timeout=10)
    ckpt.save(4, state_of(4)).wait("local", timeout=10)
    # keep_local=1, but none of these is on tier 2 yet
    assert ckpt.steps("local") == [1, 2, 3, 4]
    assert ckpt.steps("remote") == []
    faults.heal()
    ckpt.wait()
    assert ckpt.steps("remote") == [1, 2, 3, 4]
    assert ckpt.steps("local") == [4]


def test_local_step_kept_until_slow_upload_finishes(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    ckpt = make(keep_local=1, keep_remote=1)
    faults.slow(60, ops={"write"}, path=naming.step_dir_name(1))
    h1 = ckpt.save(1, state_of(1))
    eventually(lambda: faults.events("write", under=step_path(bucket, 1)), what="step 1's upload to start")
    ckpt.save(2, state_of(2)).wait("local", timeout=10)
    ckpt.save(3, state_of(3)).wait("local", timeout=10)  # tier-1 retention ran after step 2
    assert 1 in ckpt.steps("local")  # step 1 is still being uploaded: kept
    assert not h1.done("remote")
    faults.heal()
    h1.wait("remote", timeout=10)
    ckpt.wait()
    assert ckpt.steps("local") == [3]
    # step 2 was superseded (upload_backlog="newest"), and keep_remote=1 deleted step 1 after 3
    assert ckpt.steps("remote") == [3]
    assert [p for p in faults.written() if naming.step_dir_name(2) in p] == []


def _outage_then_saves(
    ckpt: tiercheck.Checkpointer, faults: Faults, bucket: str, steps: range
) -> list[tiercheck.SaveHandle]:
    """Take the remote down once the first step's upload started; save the rest meanwhile."""
    faults.fail(ConnectionRefusedError, ops={"write"})
    first = ckpt.save(steps[0], state_of(steps[0]))
    eventually(lambda: faults.events("write", under=step_path(bucket, steps[0])), what="first upload attempt")
    handles = [first]
    for s in steps[1:]:
        h = ckpt.save(s, state_of(s))
        h.wait("local", timeout=10)
        handles.append(h)
    return handles


def test_backlog_newest_uploads_only_the_newest_pending(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    # keep_remote=1: tier 2 keeps only the newest step, so the older waiting ones may be skipped
    ckpt = make(keep_local=1, keep_remote=1, upload_backlog="newest", remote_retry_budget=30)
    handles = _outage_then_saves(ckpt, faults, bucket, range(1, 6))
    faults.heal()
    handles[0].wait("remote", timeout=20)  # in progress when the outage began: retried, uploaded
    for h in handles[1:-1]:
        with pytest.raises(UploadSkippedError):
            h.wait("remote", timeout=20)
        assert h.done()
    handles[-1].wait("remote", timeout=20)
    ckpt.wait()  # skipping is policy, not an error: nothing is raised
    assert ckpt.steps("remote") == [5]
    assert [p for p in faults.written() if naming.step_dir_name(1) in p] != []  # 1 was uploaded, then pruned
    assert ckpt.steps("local") == [5]
    fs = FaultyMemoryFileSystem(skip_instance_cache=True)
    for s in (2, 3, 4):
        assert not fs.exists(step_path(bucket, s))  # not even partly uploaded


def test_backlog_newest_bounds_tier1_during_an_outage(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    ckpt = make(keep_local=1, keep_remote=1, upload_backlog="newest", remote_retry_budget=30)
    _outage_then_saves(ckpt, faults, bucket, range(1, 9))
    local = ckpt.steps("local")
    faults.heal()
    ckpt.wait()
    # keep_local=1, plus the step being uploaded and keep_remote=1 waiting one (docs/remote.md)
    assert len(local) <= 3, local


@pytest.mark.parametrize("backlog", ["all", "newest"])
def test_backlog_all_uploads_every_step(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, backlog: str
) -> None:
    # "newest" too: keep_remote=None (the default) keeps every step on tier 2, so no step
    # is ever superseded and none may be skipped.
    ckpt = make(keep_local=1, upload_backlog=backlog, remote_retry_budget=30)
    handles = _outage_then_saves(ckpt, faults, bucket, range(1, 6))
    assert ckpt.steps("local") == [1, 2, 3, 4, 5]  # all wait for their upload
    faults.heal()
    for h in handles:
        h.wait("remote", timeout=30)
    ckpt.wait()
    assert ckpt.steps("remote") == [1, 2, 3, 4, 5]
    assert ckpt.steps("local") == [5]
    for s in (2, 4):
        _, got = restored(ckpt, s)
        assert_state(got, s)


def test_backlog_never_skips_a_milestone(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    # Issue 12, item 1: uploads slower than saves. Step 10 is a tier-2 milestone (KeepEvery)
    # and must reach tier 2 however far behind the uploads are; it used to be skipped, then
    # pruned from tier 1, and end on no tier while wait() raised nothing.
    ckpt = make(keep_local=2, keep_remote=KeepLast(2) | KeepEvery(10), upload_backlog="newest")
    faults.slow(60, ops={"write"}, path=naming.step_dir_name(5))  # uploads fall behind
    ckpt.save(5, state_of(5))
    eventually(lambda: faults.events("write", under=step_path(bucket, 5)), what="step 5's upload to start")
    handles = {s: ckpt.save(s, state_of(s)) for s in (10, 15, 20)}
    for h in handles.values():
        h.wait("local", timeout=10)
    faults.heal()
    ckpt.wait()
    handles[10].wait("remote", timeout=10)  # uploaded, not skipped
    assert ckpt.steps("remote") == [10, 15, 20]  # what KeepLast(2) | KeepEvery(10) keeps
    assert ckpt.steps("local") == [15, 20]
    _, got = restored(ckpt, 10)
    assert_state(got, 10)


def test_backlog_uploads_milestones_and_skips_only_what_tier2_would_delete(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    # KeepEvery(10) on both tiers: milestones used to stay on tier 1 and never be uploaded.
    ckpt = make(keep_local=KeepEvery(10), keep_remote=KeepEvery(10), upload_backlog="newest")
    faults.slow(60, ops={"write"}, path=naming.step_dir_name(5))
    ckpt.save(5, state_of(5))
    eventually(lambda: faults.events("write", under=step_path(bucket, 5)), what="step 5's upload to start")
    handles = {s: ckpt.save(s, state_of(s)) for s in (10, 15, 20)}
    for h in handles.values():
        h.wait("local", timeout=10)
    faults.heal()
    ckpt.wait()
    handles[10].wait("remote", timeout=10)
    with pytest.raises(UploadSkippedError):  # tier 2 would delete step 15 anyway
        handles[15].wait("remote", timeout=10)
    assert ckpt.steps("remote") == [10, 20]
    assert ckpt.steps("local") == [10, 20]
    fs = FaultyMemoryFileSystem(skip_instance_cache=True)
    assert not fs.exists(step_path(bucket, 15))  # skipped: not even partly uploaded


def test_a_milestone_that_cannot_be_uploaded_stays_on_tier1(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    policy = KeepLast(1) | KeepEvery(10)
    ckpt = make(keep_local=1, keep_remote=policy)
    faults.fail(PermissionError, ops={"write"}, path=naming.step_dir_name(10))  # not retried
    ckpt.save(5, state_of(5)).wait()
    with pytest.raises(tiercheck.TierError) as raised:
        ckpt.save(10, state_of(10)).wait(timeout=10)
    assert (raised.value.step, raised.value.tier) == (10, "remote")
    for s in (15, 20):
        ckpt.save(s, state_of(s)).wait(timeout=10)  # the error was raised once, not again
    ckpt.wait()
    assert ckpt.steps("remote") == [20]
    # keep_local=1, but step 10 is a tier-2 milestone without its tier-2 copy: it stays
    assert ckpt.steps("local") == [10, 20]
    ckpt.close()
    faults.heal()
    again = make(keep_local=1, keep_remote=policy)
    again.prepare(state_of(21))  # the next writer uploads it
    again.wait()
    assert again.steps("remote") == [10, 20]
    assert again.steps("local") == [20]
    _, got = restored(again, 10)
    assert_state(got, 10)


def test_upload_backlog_is_validated(tmp_path: Path, mem_url: str) -> None:
    with pytest.raises(ValueError, match="upload_backlog"):
        tiercheck.Checkpointer(local=tmp_path, remote=mem_url, upload_backlog="oldest")


def test_upload_skipped_error_is_public() -> None:
    assert tiercheck.UploadSkippedError is UploadSkippedError  # type: ignore[attr-defined]


# ============================================================================= restore


def test_restore_prefers_tier1_and_reads_nothing_remote(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    ckpt = make()
    for s in (1, 2):
        ckpt.save(s, state_of(s))
    ckpt.wait()
    assert ckpt.steps("remote") == [1, 2]
    before = len(faults.log)
    step, got = restored(ckpt)
    assert step == 2
    assert_state(got, 2)
    during = faults.log[before:]
    assert [e for e in during if e[0] in ("read", "write", "delete")] == []  # listing only


def test_restore_newest_step_on_any_tier(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, tmp_path: Path
) -> None:
    ckpt = make()
    for s in (1, 2, 3):
        ckpt.save(s, state_of(s))
    ckpt.wait()
    ckpt.close()
    for s in (2, 3):  # this node lost its newer local steps; the bucket has them
        shutil.rmtree(local_step_dir(tmp_path, s))
    again = make()
    assert again.steps("local") == [1]
    assert again.steps() == [1, 2, 3]
    before = len(faults.log)
    step, got = restored(again)
    assert step == 3
    assert_state(got, 3)
    assert ("read", step_path(bucket, 3, SHARD)) in faults.log[before:]

    # and the other way round: tier 1 is ahead of a bucket that refuses uploads
    down(faults, PermissionError, ops=("write",))
    h = again.save(4, state_of(4))
    with pytest.raises(tiercheck.TierError):
        h.wait("remote", timeout=10)
    faults.heal()
    assert again.steps("remote") == [1, 2, 3]
    step, got = restored(again)
    assert step == 4
    assert_state(got, 4)


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _middle_of_largest_entry(manifest: dict[str, Any]) -> int:
    e = max(manifest["entries"], key=lambda e: e["length"])
    return int(e["offset"] + e["length"] // 2)


DAMAGE: dict[str, Callable[[Path, dict[str, Any]], object]] = {
    "flipped-bit": lambda d, m: _flip_bit(d / SHARD, _middle_of_largest_entry(m)),
    "deleted-shard": lambda d, m: (d / SHARD).unlink(),
    "truncated-shard": lambda d, m: (d / SHARD).write_bytes((d / SHARD).read_bytes()[:1000]),
    "deleted-manifest": lambda d, m: (d / MANIFEST).unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_tier1_copy_is_read_from_tier2(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, tmp_path: Path, damage: str
) -> None:
    ckpt = make()
    for s in (1, 2):
        ckpt.save(s, state_of(s))
    ckpt.wait()
    d = local_step_dir(tmp_path, 2)
    DAMAGE[damage](d, json.loads((d / MANIFEST).read_bytes()))
    before = len(faults.log)
    with pytest.warns(RuntimeWarning, match="local"):
        step, got = restored(ckpt)
    assert step == 2  # the same step, not an older one
    assert_state(got, 2)
    assert ("read", step_path(bucket, 2, SHARD)) in faults.log[before:]


def test_damaged_on_both_tiers_falls_back_to_an_older_step(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, tmp_path: Path
) -> None:
    ckpt = make()
    for s in (1, 2):
        ckpt.save(s, state_of(s))
    ckpt.wait()
    (local_step_dir(tmp_path, 2) / SHARD).unlink()
    FaultyMemoryFileSystem(skip_instance_cache=True).rm_file(step_path(bucket, 2, SHARD))
    with pytest.warns(RuntimeWarning) as caught:
        step, got = restored(ckpt)
    messages = [str(w.message) for w in caught]
    assert any("tier 'local'" in m and "next tier" in m for m in messages), messages
    assert any("tier 'remote'" in m and "older step" in m for m in messages), messages
    assert step == 1
    assert_state(got, 1)


def test_fresh_node_restores_from_remote(
    make: Callable[..., tiercheck.Checkpointer], mem_url: str, tmp_path: Path
) -> None:
    first = make(remote=mem_url)
    for s in (10, 20):
        first.save(s, state_of(s))
    first.close()
    fresh = make(local=tmp_path / "new-node", remote=mem_url)
    assert fresh.steps("local") == []
    assert fresh.steps() == [10, 20]
    step, got = restored(fresh)
    assert step == 20
    assert_state(got, 20)
    # training goes on from there, on both tiers
    fresh.save(30, state_of(30)).wait()
    assert fresh.steps("local") == [30]
    assert fresh.steps("remote") == [10, 20, 30]


def test_remote_only_checkpointer(mem_url: str) -> None:
    with tiercheck.Checkpointer(remote=mem_url, keep_remote=2) as ckpt:
        assert ckpt.steps() == []
        assert ckpt.restore(template()) is None
        handles = []
        for s in range(1, 5):
            st = state_of(s)
            h = ckpt.save(s, st)
            st["w"].fill_(-1.0)  # the snapshot is a copy
            handles.append(h)
            h.wait("remote")
        assert [h.tiers for h in handles] == [("remote",)] * 4
        assert [h.stats.allocated for h in handles] == [True, False, False, False]  # one host buffer, reused
        with pytest.raises(ValueError):
            handles[0].wait("local")
        with pytest.raises(ValueError):
            ckpt.steps("local")
        ckpt.wait()
        assert ckpt.steps() == ckpt.steps("remote") == [3, 4]
        step, got = restored(ckpt)
        assert step == 4
        assert_state(got, 4)
        step, got = restored(ckpt, 3)
        assert_state(got, 3)
    assert_state(tiercheck.load(mem_url), 4)


# ============================================================================= failures


def test_transient_errors_are_retried(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, tmp_path: Path
) -> None:
    ckpt = make()
    faults.fail(ConnectionRefusedError, times=1, ops={"write"})
    faults.fail(TimeoutError, times=1, ops={"write"}, path=MANIFEST)
    h = ckpt.save(1, state_of(1))
    h.wait(timeout=20)  # no error
    ckpt.wait()
    assert faults.injected() == 2
    assert faults.written(step_path(bucket, 1)) == [step_path(bucket, 1, n) for n in (SHARD, MANIFEST, COMMIT)]
    faults.fail(ConnectionResetError, times=1, ops={"list"})
    assert ckpt.steps("remote") == [1]
    faults.fail(TimeoutError, times=1, ops={"read"})
    fresh = make(local=tmp_path / "fresh")
    step, got = restored(fresh)
    assert step == 1
    assert_state(got, 1)
    assert faults.injected() == 4
    fresh.close()
    ckpt.close()


@pytest.mark.parametrize("sync_point", ["save", "wait", "close", "handle"])
def test_outage_beyond_the_retry_budget_is_raised_once(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, sync_point: str
) -> None:
    ckpt = make(remote_retry_budget=1.0)
    ckpt.save(1, state_of(1)).wait()
    down(faults)  # every remote call is refused
    h = ckpt.save(2, state_of(2))
    h.wait("local", timeout=10)  # tier 1 keeps committing
    assert ckpt.steps("local") == [1, 2]
    t0 = time.monotonic()
    eventually(lambda: h.done("remote"), timeout=15, what="the upload to give up")
    assert time.monotonic() - t0 < 10  # about the 1 s budget, with generous slack
    with pytest.raises(tiercheck.TierError) as info:
        if sync_point == "save":
            ckpt.save(3, state_of(3))
        elif sync_point == "wait":
            ckpt.wait()
        elif sync_point == "close":
            ckpt.close()
        else:
            h.wait("remote")
    err = info.value
    assert err.tier == "remote"
    assert err.step == 2
    assert naming.step_dir_name(2) in err.path
    assert err.path.startswith(f"faultymem://{bucket}")
    assert isinstance(err.__cause__, ConnectionRefusedError)
    assert isinstance(err, tiercheck.TiercheckError) and isinstance(err, OSError)
    assert h.done()
    faults.heal()
    if sync_point == "close":
        ckpt.close()  # idempotent, and the error is not raised again
        return
    ckpt.wait()  # raised once: not again
    # training goes on, and once the bucket is back, later steps upload fine
    h3 = ckpt.save(3, state_of(3))  # after a raising save(3), saving step 3 again works
    h3.wait(timeout=20)
    ckpt.wait()
    assert ckpt.steps("remote") == [1, 3]
    assert ckpt.steps("local") == [1, 2, 3]
    ckpt.close()


def test_save_stall_does_not_grow_while_remote_hangs(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults
) -> None:
    ckpt = make(keep_local=2)
    ckpt.save(0, state_of(0, 1 << 20)).wait()
    faults.slow(5.0)  # every remote call takes 5 s
    stalls = []
    for s in range(1, 6):
        st = state_of(s, 1 << 20)
        t0 = time.perf_counter()
        h = ckpt.save(s, st)
        stalls.append(time.perf_counter() - t0)
        h.wait("local", timeout=10)
    assert max(stalls) < 1.0, stalls
    assert ckpt.steps("local")[-1] == 5
    faults.heal()
    ckpt.wait()
    assert ckpt.latest_step("remote") == 5


@pytest.mark.parametrize("exc", [PermissionError, FileNotFoundError])
def test_permanent_error_is_raised_once_without_retrying(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, exc: type[BaseException]
) -> None:
    ckpt = make()  # the default 120 s retry budget: retrying would show
    down(faults, exc, ops=("write",))
    t0 = time.monotonic()
    h = ckpt.save(1, state_of(1))
    with pytest.raises(tiercheck.TierError) as info:
        ckpt.wait()
    assert time.monotonic() - t0 < 5
    assert info.value.tier == "remote" and info.value.step == 1
    assert isinstance(info.value.__cause__, exc)
    assert faults.events("write", under=step_path(bucket, 1)) == [("write", step_path(bucket, 1, SHARD))]
    assert h.done("remote")
    ckpt.wait()  # raised once
    assert ckpt.steps("local") == [1]
    assert ckpt.steps("remote") == []
    faults.heal()
    ckpt.save(2, state_of(2)).wait()
    assert ckpt.steps("remote") == [2]
    ckpt.close()


@pytest.mark.parametrize("cut_file", [SHARD, MANIFEST])
def test_cut_upload_never_leaves_a_listed_step(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, cut_file: str
) -> None:
    ckpt = make(remote_retry_budget=1.0)
    faults.cut(100, path=cut_file, times=None)  # every attempt of this file is cut at 100 bytes
    faults.fail(ConnectionRefusedError, ops={"delete"})  # and the clean-up cannot run
    h = ckpt.save(1, state_of(1))
    with pytest.raises(tiercheck.TierError) as info:
        h.wait("remote", timeout=20)
    assert info.value.step == 1
    fs = FaultyMemoryFileSystem(skip_instance_cache=True)
    partial = step_path(bucket, 1, cut_file)
    assert fs.exists(partial) and fs.info(partial)["size"] == 100  # the torn object is there
    assert not fs.exists(step_path(bucket, 1, COMMIT))
    assert ckpt.steps("remote") == []
    remote_only = make(local=None)
    assert remote_only.steps() == []
    assert remote_only.restore(template()) is None
    with pytest.raises(tiercheck.NoCheckpointError):
        tiercheck.load(f"faultymem://{bucket}", storage_options={"faults": faults})
    faults.heal()
    ckpt.save(2, state_of(2)).wait()
    assert ckpt.steps("remote") == [2]
    step, got = restored(remote_only)
    assert step == 2
    assert_state(got, 2)


def test_cut_upload_that_recovers_is_rewritten_whole(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    ckpt = make()
    faults.cut(5000, path=SHARD)  # once: the retry writes the whole file again
    ckpt.save(1, state_of(1)).wait(timeout=20)
    ckpt.wait()
    assert faults.injected() == 1
    step, got = restored(make(local=None))
    assert step == 1
    assert_state(got, 1)


def test_cut_marker_upload_is_cleaned_up(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str
) -> None:
    ckpt = make(remote_retry_budget=1.0)
    faults.cut(10, path=COMMIT, times=None)  # deletions work: abort could clean up
    h = ckpt.save(1, state_of(1))
    with pytest.raises(tiercheck.TierError):
        h.wait("remote", timeout=20)
    assert ckpt.steps("remote") == []


def test_close_does_not_hang_beyond_the_budget(make: Callable[..., tiercheck.Checkpointer], faults: Faults) -> None:
    ckpt = make(remote_retry_budget=1.0)
    down(faults)
    for s in (1, 2, 3):
        ckpt.save(s, state_of(s)).wait("local", timeout=10)
    t0 = time.monotonic()
    with pytest.raises(tiercheck.TierError) as info:
        ckpt.close()
    assert time.monotonic() - t0 < 10  # one or two uploads give up after ~1 s each
    assert info.value.tier == "remote"
    ckpt.close()


def test_restore_while_the_remote_is_down_uses_tier1(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults
) -> None:
    ckpt = make(remote_retry_budget=0.5)
    ckpt.save(1, state_of(1)).wait()
    down(faults)
    with pytest.warns(RuntimeWarning, match="cannot list tier 'remote'"):
        step, got = restored(ckpt)
    assert step == 1
    assert_state(got, 1)


def test_listing_a_down_remote_raises_a_tiercheck_error(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults
) -> None:
    ckpt = make(remote_retry_budget=0.3)
    down(faults)
    with pytest.raises(tiercheck.TiercheckError):
        ckpt.steps("remote")


# ============================================================================= hand copies, catch-up


def test_step_copied_by_hand_is_recognised(tmp_path: Path) -> None:
    with tiercheck.Checkpointer(local=tmp_path / "local", keep_local=None) as ckpt:
        for s in (7, 8):
            ckpt.save(s, state_of(s))
    bucket = tmp_path / "bucket" / "run"
    bucket.mkdir(parents=True)
    shutil.copytree(local_step_dir(tmp_path, 8), bucket / naming.step_dir_name(8))  # like `aws s3 cp`
    url = f"file://{bucket}"
    with tiercheck.Checkpointer(remote=url) as remote_only:
        assert remote_only.steps("remote") == [8]
        step, got = restored(remote_only)
        assert step == 8
        assert_state(got, 8)
    assert_state(tiercheck.load(url), 8)
    with tiercheck.Checkpointer(local=tmp_path / "local", remote=url, keep_local=None) as both:
        assert both.steps("remote") == [8]
        assert both.steps() == [7, 8]


def test_compressed_remote_step_copied_to_a_local_dir_is_recognised(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'bucket'}"
    with tiercheck.Checkpointer(remote=url, remote_compression="zstd") as ckpt:
        ckpt.save(3, state_of(3))
    local = tmp_path / "copied"
    local.mkdir()
    shutil.copytree(tmp_path / "bucket" / naming.step_dir_name(3), local / naming.step_dir_name(3))
    assert_state(tiercheck.load(local), 3)
    with tiercheck.Checkpointer(local=local) as ckpt:
        step, got = restored(ckpt)
        assert step == 3
        assert_state(got, 3)


def test_catch_up_runs_when_the_checkpointer_first_writes(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, bucket: str, tmp_path: Path
) -> None:
    local_only = make(remote=None)
    for s in (1, 2, 3):
        local_only.save(s, state_of(s))
    local_only.close()
    assert faults.log == []
    both = make(keep_remote=2)
    both.prepare(state_of(4))  # becomes the writer: the catch-up upload starts
    both.wait()  # the catch-up upload runs in the background; wait() covers it
    assert both.steps("remote") == [2, 3]  # what keep_remote=2 would keep
    assert both.steps("local") == [1, 2, 3]
    both.close()
    step, got = restored(make(local=None))
    assert step == 3
    assert_state(got, 3)
    # a later start with the bucket up to date uploads nothing
    n_written = len(faults.written())
    again = make(keep_remote=2)
    again.prepare(state_of(4))
    again.wait()
    assert len(faults.written()) == n_written
    assert again.steps("remote") == [2, 3]


def test_catch_up_uploads_every_step_tier2_would_keep(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, tmp_path: Path
) -> None:
    # Issue 12, item 2: a job killed with steps 10 and 11 committed on tier 1 only. The
    # restart used to upload 11 alone; tier-1 retention then deleted 10, a tier-2 milestone.
    policy = KeepLast(1) | KeepEvery(10)
    first = make(keep_local=2, keep_remote=policy)
    first.save(5, state_of(5)).wait()
    first.close()
    killed = make(remote=None, keep_local=None)  # what the kill left: 10, 11 on tier 1 only
    for s in (10, 11):
        killed.save(s, state_of(s))
    killed.close()
    restart = make(keep_local=2, keep_remote=policy)
    step, got = restored(restart)
    assert step == 11
    restart.save(12, state_of(12)).wait(timeout=20)
    restart.wait()
    assert restart.steps("remote") == [10, 12]
    assert restart.steps("local") == [11, 12]
    _, got = restored(restart, 10)
    assert_state(got, 10)


def test_a_checkpointer_that_only_restores_changes_no_tier(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, tmp_path: Path
) -> None:
    # An evaluation script on the directory of a job: readers never modify a tier (no
    # catch-up upload, no retention, no sweeping), whatever its own keep_* options say.
    local_only = make(remote=None)
    for s in (1, 2, 3):
        local_only.save(s, state_of(s))
    local_only.close()
    before = sorted(os.listdir(tmp_path / "local"))
    reader = make(keep_local=1, keep_remote=1)
    step, got = restored(reader)
    assert step == 3
    assert_state(got, 3)
    reader.wait()
    reader.close()
    assert [k for k, _ in faults.log if k not in ("list", "read")] == []
    assert sorted(os.listdir(tmp_path / "local")) == before


def test_catch_up_survives_a_down_remote(
    make: Callable[..., tiercheck.Checkpointer], faults: Faults, tmp_path: Path
) -> None:
    local_only = make(remote=None)
    local_only.save(1, state_of(1))
    local_only.close()
    down(faults)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is warned or raised on the caller's thread
        both = make(remote_retry_budget=0.5)
        h = both.save(2, state_of(2))
        h.wait("local", timeout=10)
    faults.heal()
    with contextlib.suppress(tiercheck.TierError):
        both.wait()
    both.save(3, state_of(3)).wait(timeout=20)
    assert both.latest_step("remote") == 3
