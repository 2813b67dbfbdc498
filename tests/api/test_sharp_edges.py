"""Edges a user hits without trying: a fork() while a save is in flight, a save retried after
Ctrl-C, the error types of every public call, and a plain path as the remote tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import tiercheck
from tiercheck.format import naming

REPO = Path(__file__).resolve().parents[2]


def run_script(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


# ----------------------------------------------------------------------------- fork()


def test_a_forked_child_exits_at_once_while_the_parent_saves(tmp_path: Path) -> None:
    """The child's copy of a Checkpointer is inert: its exit-time drain does not wait for
    the parent's threads, its methods raise ClosedError, close() returns, and it writes
    nothing; the parent's save in flight commits."""
    script = f"""
        import json, os, sys, time, torch, tiercheck
        root = {str(tmp_path / "ckpt")!r}
        # 24 MiB at 4 MiB/s: the tier-1 write takes ~6 s, the fork lands in the middle of it
        ckpt = tiercheck.Checkpointer(local=root, keep_local=None, local_write_rate=4 << 20, direct_io=False)
        state = {{"w": torch.arange(6 << 20, dtype=torch.int32)}}
        handle = ckpt.save(1, state)
        pid = os.fork()
        if pid == 0:
            raised = []
            for call in (lambda: ckpt.save(2, state), ckpt.wait, lambda: ckpt.restore({{}}),
                         ckpt.drain, handle.wait, lambda: ckpt.prepare(state)):
                try:
                    call()
                    raised.append(None)
                except Exception as exc:
                    raised.append(type(exc).__name__)
            t0 = time.monotonic()
            with ckpt:  # __exit__ closes: it must not join the parent's threads
                pass
            print(json.dumps({{"child": raised, "close_s": time.monotonic() - t0}}), flush=True)
            sys.exit(0)  # a normal exit: atexit runs the Checkpointer's finalizer
        t0 = time.monotonic()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > 60:
                os.kill(pid, 9)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.02)
        exit_s, pending = time.monotonic() - t0, not handle.done()
        ckpt.close()
        same = bool(torch.equal(tiercheck.load(root, step=1)["w"], state["w"]))
        print(json.dumps({{"exit_code": os.waitstatus_to_exitcode(status), "exit_s": exit_s, "pending": pending,
                          "steps": ckpt.steps(), "same": same, "files": sorted(os.listdir(root))}}), flush=True)
    """
    proc = run_script(script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert len(lines) == 2, f"the child printed nothing: it hung and was killed\n{proc.stdout}{proc.stderr}"
    child, parent = lines
    assert child["child"] == ["ClosedError"] * 6
    assert child["close_s"] < 1.0  # close() in the child returned at once
    assert parent["pending"] is True, "the fork must land while the save is in flight"
    assert parent["exit_code"] == 0
    # Interpreter start-up and torch's own exit take ~1-2 s on a loaded 2-core machine; the
    # bug waited 600 s for threads the child does not have.
    assert parent["exit_s"] < 15, parent
    assert parent["steps"] == [1] and parent["same"] is True
    # the child left nothing behind (the parent's writer lock is kept by design)
    assert parent["files"] == sorted([naming.lock_name(0), naming.RUNLOG_DIR, naming.step_dir_name(1)])


# ----------------------------------------------------------------------------- Ctrl-C


def interrupt_nth_copy(n: int) -> Callable[[FrameType, str, Any], None]:
    """A profile hook that raises KeyboardInterrupt as the `n`-th tensor copy call starts
    (``copy_``, or ``_foreach_copy_`` of a batch: a small state is one batch, one call), as
    a Ctrl-C during the copy into host memory does."""
    calls = [0]

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") in ("copy_", "_foreach_copy_"):
            calls[0] += 1
            if calls[0] == n:
                raise KeyboardInterrupt

    return hook


def test_a_save_retried_after_ctrl_c_commits_and_reports_it(tmp_path: Path) -> None:
    state = {"a": torch.full((1 << 20,), 7, dtype=torch.uint8), "b": torch.arange(1000)}
    # A slow tier 1 keeps step 1's write busy, so the interrupted step 2 is still queued
    # behind it when save(2) is retried into the second host buffer.
    with tiercheck.Checkpointer(
        local=tmp_path, keep_local=None, host_buffers=2, local_write_rate=2 << 20, direct_io=False
    ) as ckpt:
        ckpt.save(1, state)
        sys.setprofile(interrupt_nth_copy(1))
        try:
            with pytest.raises(KeyboardInterrupt):
                ckpt.save(2, state)
        finally:
            sys.setprofile(None)
        state["b"] += 1
        handle = ckpt.save(2, state)  # the retry
        handle.wait(timeout=60)  # the bug: TiercheckError "step 2 was never staged"
        assert handle.done()
        assert ckpt.steps() == [1, 2]
        ckpt.wait()  # nothing was left to raise
        got = tiercheck.load(tmp_path, step=2)
        assert torch.equal(got["b"], torch.arange(1, 1001))
        assert torch.equal(got["a"], state["a"])
        h3 = ckpt.save(3, state)
        h3.wait(timeout=60)
    names = [n for n in os.listdir(tmp_path) if n != naming.RUNLOG_DIR]
    assert sorted(names) == [naming.lock_name(0)] + [naming.step_dir_name(s) for s in (1, 2, 3)]


def test_the_first_save_retried_after_ctrl_c_is_not_a_step_conflict(tmp_path: Path) -> None:
    """With no earlier step in the session, the retry lists the steps in flight: the
    interrupted one must not be among them (it raised StepConflictError "step 2 is already
    committed or being saved" in about half the tries). Five tries in fresh Checkpointers."""
    state = {"a": torch.full((1 << 20,), 5, dtype=torch.uint8), "b": torch.arange(10)}
    for attempt in range(5):
        root = tmp_path / str(attempt)
        with tiercheck.Checkpointer(local=root, keep_local=None) as ckpt:
            sys.setprofile(interrupt_nth_copy(1))
            try:
                with pytest.raises(KeyboardInterrupt):
                    ckpt.save(2, state)
            finally:
                sys.setprofile(None)
            ckpt.save(2, state).wait(timeout=60)
            assert ckpt.steps() == [2]
        assert torch.equal(tiercheck.load(root)["a"], state["a"])


# ----------------------------------------------------------------------------- error types


def _closed(tmp_path: Path) -> tiercheck.Checkpointer:
    ckpt = tiercheck.Checkpointer(local=tmp_path / "closed")
    ckpt.close()
    return ckpt


def _open(tmp_path: Path) -> tiercheck.Checkpointer:
    return tiercheck.Checkpointer(local=tmp_path / "open")


MEM = "memory://errors-test"

# (what, call, the builtin it also is, a word the message names)
PUBLIC_ERRORS: list[tuple[str, Callable[[Path], object], type[BaseException], str]] = [
    ("no tier", lambda p: tiercheck.Checkpointer(), ValueError, "tier"),
    ("checksum", lambda p: tiercheck.Checkpointer(local=p, checksum="md5"), ValueError, "checksum"),
    ("coordination_timeout", lambda p: tiercheck.Checkpointer(local=p, coordination_timeout=0), ValueError, "coord"),
    ("remote_timeout", lambda p: tiercheck.Checkpointer(remote=MEM, remote_timeout=-1), ValueError, "remote_timeout"),
    ("retry budget", lambda p: tiercheck.Checkpointer(remote=MEM, remote_retry_budget=-1), ValueError, "retry"),
    ("compression", lambda p: tiercheck.Checkpointer(remote=MEM, remote_compression="gzip"), ValueError, "compr"),
    ("backlog", lambda p: tiercheck.Checkpointer(local=p, upload_backlog="some"), ValueError, "upload_backlog"),
    ("host_buffers", lambda p: tiercheck.Checkpointer(local=p, host_buffers=0), ValueError, "host_buffers"),
    ("host_buffers type", lambda p: tiercheck.Checkpointer(local=p, host_buffers="2"), ValueError, "host_buffers"),
    ("write rate", lambda p: tiercheck.Checkpointer(local=p, local_write_rate=0), ValueError, "rate"),
    ("keep_local type", lambda p: tiercheck.Checkpointer(local=p, keep_local="3"), TypeError, "keep_local"),
    ("keep_local value", lambda p: tiercheck.Checkpointer(local=p, keep_local=0), ValueError, "KeepLast"),
    ("rank", lambda p: tiercheck.Checkpointer(local=p, rank=2, world_size=2), ValueError, "rank"),
    ("no store", lambda p: tiercheck.Checkpointer(local=p, rank=0, world_size=2), ValueError, "store"),
    ("replicated", lambda p: tiercheck.Checkpointer(local=p, replicated="model"), ValueError, "replicated"),
    ("writer", lambda p: tiercheck.Checkpointer(local=p, replicated_writer=3), ValueError, "replicated_writer"),
    ("protocol", lambda p: tiercheck.Checkpointer(remote="nosuchproto://b/run"), ValueError, "nosuchproto"),
    ("KeepLast", lambda p: tiercheck.KeepLast(0), ValueError, "KeepLast"),
    ("KeepEvery", lambda p: tiercheck.KeepEvery(-5), ValueError, "KeepEvery"),
    ("tier name", lambda p: _open(p).steps("nowhere"), ValueError, "nowhere"),
    ("template", lambda p: _open(p).restore([torch.zeros(1)]), TypeError, "mapping"),  # type: ignore[arg-type]
    ("restore step", lambda p: _open(p).restore({}, step=-1), ValueError, "step"),
    ("handle tier", lambda p: _open(p).save(0, {"x": torch.zeros(1)}).wait("nowhere"), ValueError, "nowhere"),
    ("save step", lambda p: _open(p).save(-1, {"x": torch.zeros(1)}), TypeError, "step"),
    ("state value", lambda p: _open(p).save(0, {"x": object()}), TypeError, "x"),
    ("save closed", lambda p: _closed(p).save(0, {"x": torch.zeros(1)}), RuntimeError, "closed"),
    ("restore closed", lambda p: _closed(p).restore({}), RuntimeError, "closed"),
    ("prepare closed", lambda p: _closed(p).prepare({"x": torch.zeros(1)}), RuntimeError, "closed"),
    ("load nothing", lambda p: tiercheck.load(p / "nothing"), FileNotFoundError, "nothing"),
]


@pytest.mark.parametrize(("what", "call", "builtin", "named"), PUBLIC_ERRORS, ids=[e[0] for e in PUBLIC_ERRORS])
def test_every_public_error_is_a_tiercheck_error(
    tmp_path: Path, what: str, call: Callable[[Path], object], builtin: type[BaseException], named: str
) -> None:
    with pytest.raises(tiercheck.TiercheckError) as info:
        call(tmp_path)
    assert isinstance(info.value, builtin), f"{what}: {type(info.value).__mro__}"
    assert named in str(info.value), str(info.value)


def test_closed_and_invalid_argument_errors_are_public() -> None:
    assert issubclass(tiercheck.ClosedError, tiercheck.TiercheckError)
    assert issubclass(tiercheck.ClosedError, RuntimeError)
    assert issubclass(tiercheck.InvalidArgumentError, tiercheck.TiercheckError)
    assert issubclass(tiercheck.InvalidArgumentError, ValueError)
    assert issubclass(tiercheck.InvalidArgumentError, TypeError)
    assert {"ClosedError", "InvalidArgumentError"} <= set(tiercheck.__all__)


# ----------------------------------------------------------------------------- plain-path remote


def test_a_plain_path_remote_is_created_and_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = tmp_path / "not" / "yet" / "there"
    state = {"w": torch.randn(4096), "n": 3}
    with tiercheck.Checkpointer(local=tmp_path / "local", remote=str(remote)) as ckpt:
        ckpt.save(3, state).wait(timeout=60)
        assert ckpt.steps("remote") == [3]
    assert sorted(os.listdir(remote)) == [naming.step_dir_name(3)]
    # a fresh node: tier 2 alone, given as a path object this time, relative to the cwd
    monkeypatch.chdir(tmp_path)
    fresh = {"w": torch.zeros(4096), "n": None}
    with tiercheck.Checkpointer(remote=os.path.join("not", "yet", "there")) as node:  # type: ignore[arg-type]
        assert node.restore(fresh) == 3
    assert torch.equal(fresh["w"], state["w"]) and fresh["n"] == 3
    got = tiercheck.load(remote)
    assert torch.equal(got["w"], state["w"])


def test_a_remote_only_plain_path_saves_from_host_memory(tmp_path: Path) -> None:
    remote = tmp_path / "r"
    with tiercheck.Checkpointer(remote=remote) as ckpt:  # a Path works too
        for step in (1, 2):
            ckpt.save(step, {"x": torch.full((100,), float(step))})
    assert tiercheck.load(remote)["x"].eq(2.0).all()
    assert tiercheck.load(f"file://{remote}", step=1)["x"].eq(1.0).all()


def test_an_unknown_protocol_is_refused_at_construction() -> None:
    name = f"nosuch{uuid.uuid4().hex[:6]}"
    t0 = time.monotonic()
    with pytest.raises(tiercheck.InvalidArgumentError, match=name):
        tiercheck.Checkpointer(remote=f"{name}://bucket/run")
    assert time.monotonic() - t0 < 5
