"""`tiercheck memory ls` and `tiercheck memory clean` (issue 26, item 4): what jobs left in a
shared-memory directory, listed and removed; never a live job's files, never anything
outside, whatever is planted there (links, FIFOs, a file where the directory should be, huge
or hostile job files)."""

from __future__ import annotations

import contextlib
import io
import json
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
from tiercheck.__main__ import main as tiercheck_main
from tiercheck.format import naming
from tiercheck.tiers.memory import JOB_FILE

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
HANG_TIMEOUT = 180  # seconds: only a hang (a FIFO opened for reading) reaches it

# Saves steps 0..2 on tier 0 and tier 1, then dies by SIGKILL: its tier-0 root is left behind.
KILLED = textwrap.dedent(
    """
    import os, sys, torch, tiercheck
    root, job = sys.argv[1], sys.argv[2]
    ck = tiercheck.Checkpointer(local=os.path.join(root, "ckpt-" + job), memory=True, keep_local=None,
                                keep_memory=2, memory_dir=os.path.join(root, "shm"), job_id=job,
                                run_log_interval=None)
    for k in range(3):
        ck.save(k, {"w": torch.full((4096,), float(k))}).wait()
    print(ck.steps("memory"), flush=True)
    os.kill(os.getpid(), 9)
    """
)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tiercheck_main(list(args))
    return subprocess.CompletedProcess(["tiercheck", *args], code, out.getvalue(), err.getvalue())


def run_cli_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiercheck", *args], env=ENV, capture_output=True, text=True, timeout=HANG_TIMEOUT
    )


def leave_job(root: Path, job: str) -> Path:
    """A job killed after its saves: its tier-0 root stays in root/shm."""
    (root / "shm").mkdir(exist_ok=True)
    p = subprocess.run(
        [sys.executable, "-c", KILLED, str(root), job], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert p.stdout.strip() == "[1, 2]"
    return root / "shm" / f"tiercheck-{job}"


def fake_root(shm: Path, job: str, steps: tuple[int, ...] = (7,), job_file: bytes | None = None) -> Path:
    """A tier-0 root laid out by hand (committed steps: a marker in a step directory)."""
    root = shm / f"tiercheck-{job}"
    root.mkdir(parents=True)
    doc = {"job_id": job, "source": "job_id=", "host": "node-a", "created": 1.0e9}
    (root / JOB_FILE).write_bytes(json.dumps(doc).encode() if job_file is None else job_file)
    for step in steps:
        d = root / naming.step_dir_name(step)
        d.mkdir()
        (d / naming.shard_name(0, 1)).write_bytes(b"x" * 8192)
        (d / naming.COMMIT_NAME).write_bytes(b"{}")
    return root


def outside(tmp: Path) -> Path:
    """A directory with a file that no command may touch."""
    d = tmp / "precious"
    d.mkdir(exist_ok=True)
    (d / "data.bin").write_bytes(b"keep me")
    return d


def intact(d: Path) -> bool:
    return (d / "data.bin").read_bytes() == b"keep me"


# -- a real job left behind, and a live one -----------------------------------------------------


def test_ls_and_clean_a_killed_job_but_never_a_live_one(tmp_path: Path) -> None:
    left = leave_job(tmp_path, "killed")
    shm = tmp_path / "shm"
    with tiercheck.Checkpointer(
        local=tmp_path / "ckpt-live", memory=True, memory_dir=str(shm), job_id="live", run_log_interval=None
    ) as ck:
        ck.save(5, {"w": torch.ones(4096)}).wait()
        p = run_cli("memory", "ls", str(shm), "--json")
        assert p.returncode == 0, p.stderr
        jobs = {j["job_id"]: j for j in json.loads(p.stdout)["jobs"]}
        assert set(jobs) == {"killed", "live"}
        assert (jobs["killed"]["live"], jobs["killed"]["steps"], jobs["killed"]["root"]) == (False, [1, 2], str(left))
        assert (jobs["live"]["live"], jobs["live"]["steps"]) == (True, [5])
        assert jobs["killed"]["bytes"] >= 2 * 4096 * 4 and jobs["killed"]["source"] == "job_id="
        text = run_cli("memory", "ls", str(shm))
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].split() == ["job", "state", "steps", "size", "untouched", "for", "host", "root"]
        assert any(ln.startswith("killed") and " left " in ln and "2 steps (1, 2)" in ln for ln in lines)
        assert any(ln.startswith("live") and " live " in ln for ln in lines)
        assert lines[-1].startswith("1 left by jobs no process holds")

        dry = run_cli("memory", "clean", str(shm), "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        out = json.loads(dry.stdout)
        assert [j["job_id"] for j in out["removed"]] == ["killed"] and out["dry_run"] is True
        assert left.is_dir()  # a dry run removes nothing

        young = run_cli("memory", "clean", str(shm), "--older-than", "1h")
        assert young.returncode == 0 and young.stdout.splitlines()[-1].startswith("removed 0 tier-0 root(s)")
        assert left.is_dir()  # touched seconds ago

        done = run_cli("memory", "clean", str(shm))
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0].startswith(f"removed {left} (job killed, 2 steps (1, 2)")
        assert not left.exists()
        assert ck.steps("memory") == [5]  # the live job's files are all there
        state = {"w": torch.zeros(4096)}
        assert ck.restore(state) == 5 and torch.equal(state["w"], torch.ones(4096))
    assert run_cli("memory", "ls", str(shm)).stdout == f"no tier-0 job in {shm}\n"


def test_older_than_keeps_what_was_touched_recently(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    old, new = fake_root(shm, "old"), fake_root(shm, "new")
    week_ago = time.time() - 7 * 86400
    for path in [old, *old.iterdir()]:
        os.utime(path, (week_ago, week_ago))
    p = run_cli("memory", "clean", str(shm), "--older-than", "2d", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert [j["job_id"] for j in out["removed"]] == ["old"] and [j["job_id"] for j in out["kept"]] == ["new"]
    assert out["older_than_s"] == 2 * 86400 and not old.exists() and new.is_dir()


BAD_DURATION = "tiercheck: memory clean: cannot read --older-than"


@pytest.mark.parametrize(
    ("args", "message", "kind"),
    [
        (["memory", "ls", "{tmp}/nope"], "tiercheck: memory ls: no such directory: {tmp}/nope: ", "FileNotFoundError"),
        (["memory", "clean", "{tmp}/file"], "tiercheck: memory clean: not a directory: {tmp}/f", "NotADirectoryError"),
        (["memory", "clean", "{tmp}", "--older-than", "5x"], BAD_DURATION, "ValueError"),
        (["memory", "clean", "{tmp}", "--older-than=-1h"], BAD_DURATION, "ValueError"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str, kind: str) -> None:
    (tmp_path / "file").write_bytes(b"not a directory")
    argv = [a.format(tmp=tmp_path) for a in args]
    p = run_cli(*argv)
    assert p.returncode == 2 and p.stdout == ""
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith(message.format(tmp=tmp_path))
    j = run_cli(*argv, "--json")
    assert j.returncode == 2 and json.loads(j.stdout)["error"]["type"] == kind
    assert (tmp_path / "file").read_bytes() == b"not a directory"


# -- hostile contents ----------------------------------------------------------------------------


def test_a_link_planted_in_the_memory_dir_is_neither_listed_nor_followed(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    precious = outside(tmp_path)
    # A link named like a root, to a directory laid out like one: its contents stay.
    decoy = fake_root(tmp_path / "decoy-dir", "decoy")
    shm.mkdir()
    (shm / "tiercheck-decoy").symlink_to(decoy)
    (shm / "tiercheck-precious").symlink_to(precious)
    # Links inside a real root: a step, the job file, a lock and the buffers folder.
    root = fake_root(shm, "real")
    (root / naming.step_dir_name(9)).symlink_to(precious)
    (root / naming.lock_name(0)).symlink_to(precious / "data.bin")
    (root / ".tiercheck-buffers").symlink_to(precious)
    (root / JOB_FILE).unlink()
    (root / JOB_FILE).symlink_to(precious / "data.bin")
    p = run_cli("memory", "ls", str(shm), "--json")
    assert p.returncode == 0, p.stderr
    jobs = json.loads(p.stdout)["jobs"]
    assert [(j["root"], j["job_id"], j["live"]) for j in jobs] == [(str(root), "?", False)]
    c = run_cli("memory", "clean", str(shm), "--json")
    assert c.returncode == 0, c.stderr
    assert [j["root"] for j in json.loads(c.stdout)["removed"]] == [str(root)]
    assert not root.exists() and intact(precious) and sorted(os.listdir(precious)) == ["data.bin"]
    assert (decoy / naming.step_dir_name(7) / naming.COMMIT_NAME).is_file() and (decoy / JOB_FILE).is_file()
    assert (shm / "tiercheck-decoy").is_symlink() and (shm / "tiercheck-precious").is_symlink()


def test_fifos_named_like_tier0_files_never_block(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    os.mkfifo(shm / "tiercheck-fifo")  # named like a root
    root = fake_root(shm, "piped")
    (root / JOB_FILE).unlink()
    os.mkfifo(root / JOB_FILE)
    os.mkfifo(root / naming.lock_name(3))
    os.mkfifo(root / naming.step_dir_name(4))
    p = run_cli_subprocess("memory", "ls", str(shm), "--json")  # a blocked open fails at the timeout
    assert p.returncode == 0, p.stderr
    assert [(j["job_id"], j["steps"], j["live"]) for j in json.loads(p.stdout)["jobs"]] == [("?", [7], False)]
    c = run_cli_subprocess("memory", "clean", str(shm))
    assert c.returncode == 0, c.stderr
    assert not root.exists() and (shm / "tiercheck-fifo").exists()  # not a root: not ours to remove


def test_a_memory_dir_that_is_a_link_or_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    p = run_cli_subprocess("memory", "ls", str(tmp_path / "fifo"))
    assert p.returncode == 2 and p.stderr.startswith("tiercheck: memory ls: not a directory: ")
    # A link the user names is followed, as `ls` would: the directory it names is listed.
    fake_root(tmp_path / "real-shm", "via-link")
    (tmp_path / "shm-link").symlink_to(tmp_path / "real-shm")
    out = run_cli("memory", "ls", str(tmp_path / "shm-link"), "--json")
    assert [j["job_id"] for j in json.loads(out.stdout)["jobs"]] == ["via-link"]


@pytest.mark.parametrize(
    "job_file",
    [
        b"[" * 100_000,  # nested past the recursion limit
        b'{"job_id": "x", "created": 1' + b"0" * 400 + b"}",  # a float() overflow
        b'{"job_id": "x", "created": 1e999, "host": NaN}',
        b"\xff\xfe not json \x00",
        b'{"job_id": ' + b'"' + b"a" * 200_000 + b'"}',  # longer than is read
        b'{"job_id": {"a": [1, 2]}, "source": 7, "host": null, "created": true}',
        b'{"job_id": "evil\\u001b]0;pwned\\u0007\\n\\ud800", "host": "h\\r"}',  # escapes, a lone surrogate
    ],
    ids=["nested", "huge-int", "inf-nan", "binary", "long", "wrong-types", "terminal-escapes"],
)
def test_a_hostile_job_file_is_read_safely(tmp_path: Path, job_file: bytes) -> None:
    shm = tmp_path / "shm"
    root = fake_root(shm, "hostile", job_file=job_file)
    p = run_cli("memory", "ls", str(shm), "--json")
    assert p.returncode == 0, p.stderr
    (job,) = json.loads(p.stdout)["jobs"]
    assert job["steps"] == [7] and job["live"] is False and len(job["job_id"]) <= 256
    assert job["created"] is None or job["created"] == pytest.approx(job["created"])  # finite, JSON-valid
    text = run_cli("memory", "ls", str(shm))
    assert text.returncode == 0, text.stderr
    assert all(c.isprintable() for ln in text.stdout.splitlines() for c in ln)  # no escape reaches a terminal
    c = run_cli("memory", "clean", str(shm))
    assert c.returncode == 0 and not root.exists()


def test_a_huge_job_file_is_not_read_whole(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    root = fake_root(shm, "big")
    with open(root / JOB_FILE, "wb") as f:
        f.truncate(8 << 30)  # 8 GiB, sparse: reading it whole would take the time and memory
    t0 = time.monotonic()
    p = run_cli("memory", "ls", str(shm), "--json")
    assert p.returncode == 0, p.stderr
    assert [j["job_id"] for j in json.loads(p.stdout)["jobs"]] == ["?"]
    assert time.monotonic() - t0 < 30


def test_names_not_made_by_tier0_stay(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    root = fake_root(shm, "mixed")
    (root / "notes.txt").write_bytes(b"a user's file")
    (shm / "tiercheck-not a root").mkdir()  # not a name tier 0 makes
    (shm / "other-app").mkdir()
    c = run_cli("memory", "clean", str(shm), "--json")
    assert c.returncode == 0, c.stderr
    assert (root / "notes.txt").read_bytes() == b"a user's file" and not (root / naming.step_dir_name(7)).exists()
    assert (shm / "tiercheck-not a root").is_dir() and (shm / "other-app").is_dir()
