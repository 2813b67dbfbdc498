"""Tier 0 end to end, with real processes: a process killed after its saves is resumed from
its node's shared memory, every byte verified; damage there falls back to tier 1; a full or
missing shared-memory filesystem turns tier 0 off with one warning; two jobs on one node keep
apart; a job's own close removes its memory, a stale job's files go after memory_ttl."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import tiercheck
from tiercheck.format import naming
from tiercheck.tiers.memory import list_jobs

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import json, os, sys, time, torch, tiercheck
    root, steps, kill_after, job = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    def state_at(k):
        g = torch.Generator().manual_seed(k)
        return {"w": torch.randn(1000, 257, generator=g), "b": torch.randn(33, generator=g).to(torch.bfloat16),
                "step": k, "name": f"s{k}"}
    ck = tiercheck.Checkpointer(local=os.path.join(root, "ckpt"), memory=True, keep_local=None,
                                memory_dir=os.path.join(root, "shm"), job_id=job, run_log_interval=None)
    for k in range(steps):
        h = ck.save(k, state_at(k))
        h.wait("memory")
        if k == kill_after:
            h.wait()
            print(json.dumps({"memory": ck.steps("memory"), "local": ck.steps("local")}), flush=True)
            os.kill(os.getpid(), 9)
    ck.close()
    """
)


def state_at(k: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(k)
    return {
        "w": torch.randn(1000, 257, generator=g),
        "b": torch.randn(33, generator=g).to(torch.bfloat16),
        "step": k,
        "name": f"s{k}",
    }


def template() -> dict[str, object]:
    return {"w": torch.zeros(1000, 257), "b": torch.zeros(33, dtype=torch.bfloat16), "step": -1, "name": ""}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return (
        torch.equal(a["w"], b["w"])  # type: ignore[arg-type]
        and torch.equal(a["b"].view(torch.int16), b["b"].view(torch.int16))  # type: ignore[union-attr]
        and a["step"] == b["step"]
        and a["name"] == b["name"]
    )


def run_killed(root: Path, steps: int, kill_after: int, job: str = "job-t0") -> dict[str, list[int]]:
    (root / "shm").mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(steps), str(kill_after), job],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def restore_logged(root: Path, caplog: pytest.LogCaptureFixture, job: str = "job-t0", **kw: object):
    state = template()
    with caplog.at_level(logging.INFO, logger="tiercheck.events"):
        with tiercheck.Checkpointer(
            local=root / "ckpt", memory=True, memory_dir=str(root / "shm"), job_id=job, run_log_interval=None, **kw
        ) as ck:
            step = ck.restore(state)
            events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tiercheck.events"]
    tiers = [e["tier"] for e in events if e.get("event") == "restore"]
    return step, state, tiers


def memory_root(root: Path, job: str = "job-t0") -> Path:
    return root / "shm" / f"tiercheck-{job}"


def test_a_killed_process_resumes_from_memory_bit_exact(tmp_path, caplog):
    seen = run_killed(tmp_path, 10, 4)
    assert seen["memory"] == [4] and seen["local"] == [0, 1, 2, 3, 4]
    step, state, tiers = restore_logged(tmp_path, caplog)
    assert step == 4 and same(state, state_at(4))
    assert len(tiers) == 1 and tiers[0] == "memory"


def test_a_flipped_byte_in_memory_is_caught_and_tier1_used(tmp_path, caplog):
    run_killed(tmp_path, 10, 3)
    shard = memory_root(tmp_path) / naming.step_dir_name(3) / naming.shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[1234] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="tier 'memory'"):
        step, state, tiers = restore_logged(tmp_path, caplog)
    assert step == 3 and same(state, state_at(3))
    assert tiers[0] == "local"


def test_a_truncated_memory_shard_is_caught_and_tier1_used(tmp_path, caplog):
    run_killed(tmp_path, 10, 2)
    shard = memory_root(tmp_path) / naming.step_dir_name(2) / naming.shard_name(0, 1)
    os.truncate(shard, 4096)
    with pytest.warns(RuntimeWarning, match="tier 'memory'"):
        step, state, tiers = restore_logged(tmp_path, caplog)
    assert step == 2 and same(state, state_at(2)) and tiers[0] == "local"


def test_a_lost_node_memory_falls_back_to_tier1(tmp_path, caplog):
    run_killed(tmp_path, 10, 5)
    import shutil

    shutil.rmtree(tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    step, state, tiers = restore_logged(tmp_path, caplog)
    assert step == 5 and same(state, state_at(5)) and tiers[0] == "local"


def test_two_jobs_on_one_node_keep_apart(tmp_path, caplog):
    a, b = tmp_path / "a", tmp_path / "b"
    b.mkdir()
    run_killed(a, 10, 1, job="alpha")
    (b / "shm").symlink_to(a / "shm")  # the same shared-memory directory: one node
    run_killed(b, 10, 6, job="beta")
    assert {j.job_id for j in list_jobs(str(a / "shm"))} == {"alpha", "beta"}
    step_a, state_a, _ = restore_logged(a, caplog, job="alpha")
    step_b, state_b, _ = restore_logged(b, caplog, job="beta")
    assert (step_a, step_b) == (1, 6)
    assert same(state_a, state_at(1)) and same(state_b, state_at(6))


def test_close_of_a_finished_job_removes_its_memory(tmp_path):
    (tmp_path / "shm").mkdir()
    with tiercheck.Checkpointer(
        local=tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"), job_id="done", run_log_interval=None
    ) as ck:
        for k in range(3):
            ck.save(k, state_at(k)).wait()
        assert ck.steps("memory") == [2]
        assert memory_root(tmp_path, "done").is_dir()
    assert list(os.listdir(tmp_path / "shm")) == []
    reader = tiercheck.Checkpointer(local=tmp_path / "ckpt")
    assert reader.steps() == [1, 2]  # keep_local=2: tier 1 keeps its own
    reader.close()


def test_start_up_removes_a_stale_job_but_never_a_live_one(tmp_path, caplog):
    run_killed(tmp_path, 10, 2, job="stale")
    stale = memory_root(tmp_path, "stale")
    old = time.time() - 7200
    for p in [stale, *stale.rglob("*")]:
        os.utime(p, (old, old), follow_symlinks=False)
    live = tiercheck.Checkpointer(
        local=tmp_path / "live", memory=True, memory_dir=str(tmp_path / "shm"), job_id="live", run_log_interval=None
    )
    live.save(0, state_at(0)).wait()
    with tiercheck.Checkpointer(
        local=tmp_path / "other", memory=True, memory_dir=str(tmp_path / "shm"), job_id="other",
        memory_ttl=3600, run_log_interval=None,
    ):
        pass
    assert not stale.exists()
    assert memory_root(tmp_path, "live").is_dir() and live.steps("memory") == [0]
    live.close()


def test_a_missing_memory_dir_turns_tier0_off_with_one_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tiercheck.events"):
        with tiercheck.Checkpointer(
            local=tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "nope"), run_log_interval=None
        ) as ck:
            for k in range(2):
                ck.save(k, state_at(k)).wait()
            assert ck.steps() == [0, 1]
    off = [r for r in caplog.records if "tier 0 (memory) is off" in r.getMessage()]
    assert len(off) == 1 and str(tmp_path / "nope") in off[0].getMessage()


def test_no_room_in_shared_memory_turns_tier0_off_and_saves_go_on(tmp_path, caplog):
    """A shared-memory filesystem too small for the shards (memory_peers inflates the stated
    need far past any filesystem): one warning naming the size, tier 1 keeps every step, and
    a handle's wait('memory') says the step is not there."""
    (tmp_path / "shm").mkdir()
    with caplog.at_level(logging.WARNING, logger="tiercheck.events"):
        with tiercheck.Checkpointer(
            local=tmp_path / "ckpt", memory=True, memory_dir=str(tmp_path / "shm"), memory_peers=1 << 40,
            run_log_interval=None,
        ) as ck:
            handles = [ck.save(k, state_at(k)) for k in range(3)]
            for h in handles:
                h.wait("local")
                with pytest.raises(tiercheck.UploadSkippedError, match="tier 0 is off"):
                    h.wait("memory")
            ck.wait()  # retention included
            assert ck.steps("local") == [1, 2] and ck.steps("memory") == []
    off = [r.getMessage() for r in caplog.records if "tier 0 (memory) is off" in r.getMessage()]
    assert len(off) == 1 and "need" in off[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_tmpfs_turns_tier0_off_before_any_copy(tmp_path, caplog):
    shm = tmp_path / "shm"
    shm.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(shm)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with caplog.at_level(logging.WARNING, logger="tiercheck.events"):
            with tiercheck.Checkpointer(
                local=tmp_path / "ckpt", memory=True, memory_dir=str(shm), run_log_interval=None
            ) as ck:
                ck.save(0, state_at(0)).wait("local")
                assert ck.steps("memory") == []
        assert any("tier 0 (memory) is off" in r.getMessage() for r in caplog.records)
        step, state, _ = restore_logged(tmp_path, caplog)
        assert step == 0 and same(state, state_at(0))
    finally:
        subprocess.run(["umount", str(shm)])


def test_sigkill_at_any_point_of_a_tier0_save_leaves_a_restorable_step(tmp_path):
    """Kill a saving process at spread-out instants (mid-copy, mid-commit, between): the
    restore is always an exact committed step, from memory when memory has it."""
    script = textwrap.dedent(
        """
        import os, sys, torch, tiercheck
        root = sys.argv[1]
        ck = tiercheck.Checkpointer(local=os.path.join(root, "ckpt"), memory=True, keep_local=2,
                                    memory_dir=os.path.join(root, "shm"), job_id="crash", run_log_interval=None)
        k = 0
        while True:
            g = torch.Generator().manual_seed(k)
            ck.save(k, {"w": torch.randn(2000, 500, generator=g), "step": k})
            if k == 0:
                print("go", flush=True)
            k += 1
        """
    )
    for i, delay in enumerate((0.05, 0.3, 0.7, 1.3)):
        root = tmp_path / f"r{i}"
        (root / "shm").mkdir(parents=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", script, str(root)], stdout=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "go"
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=60)
        state = {"w": torch.zeros(2000, 500), "step": -1}
        with tiercheck.Checkpointer(
            local=root / "ckpt", memory=True, memory_dir=str(root / "shm"), job_id="crash", run_log_interval=None
        ) as ck:
            step = ck.restore(state)
        assert step is not None and state["step"] == step
        g = torch.Generator().manual_seed(step)
        assert torch.equal(state["w"], torch.randn(2000, 500, generator=g))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_tmpfs_just_big_enough_for_the_buffers_keeps_every_step(tmp_path, caplog):
    """Committing a tier-0 step moves a buffer that is already allocated: no free space is
    needed then, so a shared-memory filesystem with room for the buffers and little more keeps
    every step in memory (no space check refuses it)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    shard = state_at(0)["w"].numel() * 4 + 8192  # w, b (and alignment): under 1.1 MB
    size_kib = (2 * shard + 300 * 1024) // 1024  # two buffers (host_buffers=2) and 300 KiB
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(shm)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with tiercheck.Checkpointer(
            local=tmp_path / "ckpt", memory=True, memory_dir=str(shm), job_id="tight", run_log_interval=None
        ) as ck:
            for k in range(4):
                h = ck.save(k, state_at(k))
                h.wait("memory")
                assert ck.steps("memory")[-1] == k
            ck.wait()
    finally:
        subprocess.run(["umount", str(shm)])


def test_a_reader_with_memory_on_changes_nothing_in_tier0(tmp_path):
    """A Checkpointer that only restores (an evaluation script beside the job) reads tier 0
    and, closing, leaves it as it was: only a finished writer removes its memory."""
    (tmp_path / "shm").mkdir()
    opts = {"local": tmp_path / "ckpt", "memory": True, "memory_dir": str(tmp_path / "shm"), "job_id": "live"}
    writer = tiercheck.Checkpointer(**opts, run_log_interval=None)
    writer.save(0, state_at(0)).wait()
    root = memory_root(tmp_path, "live")
    before = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    state = template()
    with tiercheck.Checkpointer(**opts, run_log_interval=None) as reader:
        assert reader.restore(state) == 0
    assert same(state, state_at(0))
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == before
    assert writer.steps("memory") == [0]
    writer.close()
    assert not root.exists()  # the writer, finished, frees it
