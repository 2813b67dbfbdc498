"""Tier 0's store (`tiercheck/tiers/memory.py`) and the shared-memory host buffers
(`steps/stage.py`): the buffer a save copies into becomes the tier-0 shard by a rename, not a
copy; it goes back (marker first) before it is overwritten; a job's files are listed and
cleaned, never a live job's."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tiercheck.format import naming
from tiercheck.steps.stage import HostBufferPool, SharedBuffers
from tiercheck.testing.conformance import CHECKS, NotApplicable, TierCase
from tiercheck.tiers.memory import (
    BUFFERS_DIR,
    SharedMemoryTier,
    ShmBuffer,
    clean_jobs,
    job_identity,
    job_key,
    list_jobs,
    node_identity,
)

SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)


def memory_case(memory_dir: Path) -> TierCase:
    def put_raw(rel: str, data: bytes) -> None:
        p = Path(SharedMemoryTier(str(memory_dir), "conf").root) / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    return TierCase(
        make_tier=lambda: SharedMemoryTier(str(memory_dir), "conf"), put_raw=put_raw, role="local", kind="memory"
    )


STORE_CHECKS = [c for c in CHECKS if "checkpointer" not in c.__name__ and "compressed" not in c.__name__]


@pytest.mark.parametrize("check", STORE_CHECKS, ids=lambda c: c.__name__)
def test_tier0_store_passes_the_conformance_checks(check, tmp_path):
    try:
        check(memory_case(tmp_path / "shm"), tmp_path)
    except NotApplicable as why:
        pytest.skip(str(why))


def write_buffer_step(tier: SharedMemoryTier, step: int, payload: bytes):
    buf = tier.new_buffer(0, len(payload))
    buf.map[:] = payload
    writer = tier.open_step(step, 0)
    assert writer.write_file(SHARD, memoryview(buf.map), aligned=True) == len(payload)
    writer.write_file(MANIFEST, memoryview(b"{}"))
    writer.commit(b"{}")
    return buf


def test_a_buffer_becomes_the_shard_by_rename_not_copy(tmp_path):
    tier = SharedMemoryTier(str(tmp_path), "job-a")
    payload = os.urandom(3 * 4096 + 17)
    buf = write_buffer_step(tier, 5, payload)
    shard = Path(tier.path_of(5, SHARD))
    assert tier.committed_steps() == [5]
    assert shard.read_bytes() == payload
    st = shard.stat()
    assert (st.st_dev, st.st_ino) == buf.identity  # the same file: no second copy in memory
    assert os.listdir(tier.buffers_dir) == []
    # writing into the mapping changes the committed shard: they are one memory
    buf.map[0:4] = b"ABCD"
    assert shard.read_bytes()[:4] == b"ABCD"


def test_take_back_hides_the_step_first_and_keeps_the_memory(tmp_path):
    tier = SharedMemoryTier(str(tmp_path), "job-b")
    buf = write_buffer_step(tier, 7, b"x" * 8192)
    assert tier.take_back(buf) == 7
    assert tier.committed_steps() == []
    assert not os.path.exists(tier.path_of(7))
    assert os.path.dirname(buf.path) == tier.buffers_dir
    st = os.stat(buf.path)
    assert (st.st_dev, st.st_ino) == buf.identity
    assert tier.take_back(buf) is None  # already back: nothing to hide


def test_delete_step_gives_this_process_its_buffer_back(tmp_path):
    tier = SharedMemoryTier(str(tmp_path), "job-c")
    buf = write_buffer_step(tier, 3, b"y" * 4096)
    tier.delete_step(3)
    assert tier.committed_steps() == []
    assert os.path.dirname(buf.path) == tier.buffers_dir and os.path.exists(buf.path)


def test_a_linked_buffer_file_is_copied_not_moved(tmp_path):
    """Invariant 8: a buffer file someone hard-linked is not ours alone any more: the shard
    is written as a new file and the linked name keeps its bytes."""
    tier = SharedMemoryTier(str(tmp_path), "job-d")
    buf = tier.new_buffer(0, 4096)
    buf.map[:] = b"z" * 4096
    os.link(buf.path, tmp_path / "pinned")
    writer = tier.open_step(1, 0)
    writer.write_file(SHARD, memoryview(buf.map), aligned=True)
    writer.write_file(MANIFEST, memoryview(b"{}"))
    writer.commit(b"{}")
    assert os.stat(tier.path_of(1, SHARD)).st_ino != buf.identity[1]
    assert (tmp_path / "pinned").read_bytes() == b"z" * 4096


def test_pool_reuses_the_shared_buffer_and_takes_its_step_back(tmp_path):
    tier = SharedMemoryTier(str(tmp_path), "job-e")
    pool = HostBufferPool(1, SharedBuffers(tier, rank=0, copies=1))
    a = pool.acquire(8192, pinned=False)
    assert a.shm is not None and os.path.dirname(a.shm.path) == tier.buffers_dir
    a.tensor.fill_(1)
    writer = tier.open_step(2, 0)
    writer.write_file(SHARD, a.view(8192), aligned=True)
    writer.write_file(MANIFEST, memoryview(b"{}"))
    writer.commit(b"{}")
    pool.release(a)
    assert tier.committed_steps() == [2]
    b = pool.acquire(8192, pinned=False)
    assert b is a and pool.allocations == 1  # no new memory
    assert tier.committed_steps() == []  # the step went before the buffer could change
    pool.release(b)
    c = pool.acquire(4096, pinned=False)  # another size: a new file of exactly that size
    assert c is not a and c.nbytes == 4096 and os.path.getsize(c.shm.path) == 4096
    assert sorted(os.listdir(tier.buffers_dir)) == [os.path.basename(c.shm.path)]
    pool.release(c)
    pool.clear()
    assert os.listdir(tier.buffers_dir) == []


def test_no_room_turns_tier0_off_with_one_warning(tmp_path, caplog):
    tier = SharedMemoryTier(str(tmp_path), "job-f")
    shared = SharedBuffers(tier, rank=0, copies=1 << 40)  # far more than any filesystem holds
    pool = HostBufferPool(1, shared)
    with caplog.at_level(logging.WARNING, logger="tiercheck.events"):
        buf = pool.acquire(4096, pinned=False)
        pool.release(buf)
        buf = pool.acquire(4096, pinned=False)
    assert buf.shm is None and not shared.enabled
    warnings = [r for r in caplog.records if "tier 0 (memory) is off" in r.getMessage()]
    assert len(warnings) == 1
    assert "need" in warnings[0].getMessage() and str(tmp_path) in warnings[0].getMessage()


def test_job_identity_survives_a_restart(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert job_identity("run7", None, None) == ("run7", "job_id=")
    a = job_identity(None, str(tmp_path / "ckpt"), None)
    assert a == job_identity(None, str(tmp_path / "ckpt"), None) and a[1] == "local="
    assert a != job_identity(None, str(tmp_path / "other"), None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert job_identity(None, str(tmp_path / "ckpt"), None) == ("torchelastic-abc123", "TORCHELASTIC_RUN_ID")
    assert job_key("run7") == "run7"
    assert job_key("../../etc") != "../../etc" and "/" not in job_key("../../etc")


def test_node_identity_tells_directories_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert node_identity(str(tmp_path / "a")) != node_identity(str(tmp_path / "b"))
    assert node_identity(str(tmp_path / "a")) == node_identity(str(tmp_path / "a"))


def test_memory_ls_and_clean_never_touch_a_live_job(tmp_path):
    live = SharedMemoryTier(str(tmp_path), "live-job")
    write_buffer_step(live, 1, b"l" * 4096)
    live.claim_writer(0, 1)
    dead = SharedMemoryTier(str(tmp_path), "dead-job")
    write_buffer_step(dead, 4, b"d" * 4096)
    (tmp_path / "not-ours").mkdir()
    jobs = {j.job_id: j for j in list_jobs(str(tmp_path))}
    assert set(jobs) == {"live-job", "dead-job"}
    assert jobs["live-job"].live and not jobs["dead-job"].live
    assert jobs["dead-job"].steps == (4,) and jobs["dead-job"].bytes >= 4096
    later = time.time() + 3600
    assert [j.job_id for j in clean_jobs(str(tmp_path), 60, dry_run=True, now=later)] == ["dead-job"]
    assert os.path.isdir(dead.root)
    assert [j.job_id for j in clean_jobs(str(tmp_path), 60, now=later)] == ["dead-job"]
    assert not os.path.exists(dead.root)
    assert os.path.isdir(live.root) and live.committed_steps() == [1]
    assert (tmp_path / "not-ours").is_dir()
    assert clean_jobs(str(tmp_path), 10 * 3600, now=later) == []  # too recent
    live.release_writer()


def test_clean_follows_no_link_out_of_the_memory_dir(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    shm = tmp_path / "shm"
    shm.mkdir()
    os.symlink(outside, shm / "tiercheck-planted")
    assert list_jobs(str(shm)) == []
    clean_jobs(str(shm), 0, now=time.time() + 10)
    assert (outside / "precious").read_bytes() == b"keep"


def test_buffers_dir_name_is_not_a_step(tmp_path):
    assert naming.parse_step_dir(BUFFERS_DIR) is None
    tier = SharedMemoryTier(str(tmp_path), "j")
    buf = tier.new_buffer(0, 4096)
    assert tier.committed_steps() == [] and tier.stray_steps() == []
    assert np.frombuffer(buf.map, dtype=np.uint8).size == 4096


def _resident_kib(address: int) -> int:
    """Rss of the mapping that starts at `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ", 1)[0]
        if "-" in head and int(head.split("-")[0], 16) == address:
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.parametrize("shared", [True, False], ids=["shm-file", "anonymous"])
def test_buffers_are_populated_without_map_populate(tmp_path, monkeypatch, shared):
    """CPython's mmap() holds the GIL through the call, and with MAP_POPULATE that is the
    whole page population (80 ms for 192 MiB here: every other thread of the process, training
    included, waited). Buffers are mapped without it and populated by madvise through ctypes
    (no GIL held); the pages are resident all the same."""
    import mmap

    from tiercheck.tiers import memory

    calls = []
    real = mmap.mmap

    def spy(*args, **kwargs):
        calls.append(kwargs.get("flags", 0))
        return real(*args, **kwargs)

    monkeypatch.setattr(memory.mmap, "mmap", spy)
    nbytes = 8 << 20
    if shared:
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
        buf = ShmBuffer(str(folder / f"tc-test-{os.getpid()}"), 0, nbytes)
        m, address = buf.map, buf.address
    else:
        m = memory.mapped(-1, nbytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(m)
        address = memory.address_of(view)
        view.release()
    try:
        assert calls and not any(flags & getattr(mmap, "MAP_POPULATE", 0) for flags in calls)
        major, minor = (int(x) for x in os.uname().release.split(".")[:2])
        if (major, minor) >= (5, 14):  # MADV_POPULATE_WRITE
            assert _resident_kib(address) == nbytes // 1024  # every page faulted in
    finally:
        if shared:
            buf.close(unlink=True)
            os.rmdir(os.path.dirname(buf.path))
        else:
            m.close()
