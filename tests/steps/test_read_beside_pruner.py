"""A reader beside a job whose retention prunes (`tiercheck verify`/`ls`/`export`,
`tiercheck.load`, a restore-only Checkpointer on the job's tier-1 directory): a step deleted
while it is read is reported as pruned, never as damaged.

No race is hoped for: the reader's tier runs the prune at an exact point of the read (before
a shard is opened, after it is open but before its first byte is read, between the marker and
the manifest), through the real writer's retention, and waits until the bytes the reader
holds really changed (truncated by the reclaimer, or overwritten in place by recycling).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
import tiercheck.cli.main as cli
import tiercheck.tools.view as view
from tiercheck.format import naming
from tiercheck.testing import FaultyTier
from tiercheck.tiers import open_tier
from tiercheck.tiers.base import ReadableFile, Tier
from tiercheck.tiers.local import LocalTier
from tiercheck.tools import export_step

NBYTES = 3 << 20
MODES = ["before-open", "truncated", "overwritten", "before-manifest"]


class SmallShards(LocalTier):
    RECYCLE_MIN = 4096  # the test's shards are a few MiB; a real one is recycled from 64 MiB


def state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=g), "step": step}


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Job:
    """The writer: a Checkpointer with retention on tier 1, as a training job runs it."""

    def __init__(self, root: Path, keep: int, mode: str) -> None:
        self.root = root
        self.mode = mode
        self.tier = SmallShards(root, recycle=mode == "overwritten")
        self.ckpt = tiercheck.Checkpointer(local=self.tier, keep_local=keep)
        self.next = 1

    def save(self) -> None:
        self.ckpt.save(self.next, state(self.next)).wait()
        self.ckpt.wait()  # and its retention
        self.next += 1

    def prune(self, step: int, held: int | None) -> None:
        """Save until `step` is pruned and, where the reader holds its shard open (`held`),
        until the bytes behind that descriptor changed as the mode says."""
        before = b"" if held is None else os.pread(held, os.fstat(held).st_size, 0)
        while step in self.ckpt.steps():
            self.save()
        if self.mode == "truncated":
            assert held is not None
            wait_until(lambda: os.fstat(held).st_size == 0, "the reclaimer to truncate the pruned shard")
        elif self.mode == "overwritten":  # the next save writes over the shard kept as a spare
            assert held is not None
            wait_until(lambda: self.tier.spare_bytes > 0, "the pruned shard kept as a spare")
            self.save()
            after = os.pread(held, len(before), 0)
            assert len(after) == len(before) and after != before, "the spare was not overwritten"

    def close(self) -> None:
        self.ckpt.close()


class _FireOnRead(ReadableFile):
    def __init__(self, inner: ReadableFile, fire: Callable[[], None]) -> None:
        self._inner = inner
        self._fire = fire
        self.size = inner.size

    def read_into(self, offset: int, dest: memoryview) -> None:
        self._fire()
        self._inner.read_into(offset, dest)

    def close(self) -> None:
        self._inner.close()


class PruneWhileReading(FaultyTier):
    """The reader's tier: the job prunes `step` at the point of its read that `job.mode`
    names, once; every read is the real tier's."""

    def __init__(self, inner: Tier, job: Job, step: int) -> None:
        super().__init__(inner)
        self.job = job
        self.step = step
        self.fired = threading.Event()

    def _prune(self, held: int | None) -> None:
        if not self.fired.is_set():
            self.fired.set()
            self.job.prune(self.step, held)

    def read_bytes(self, step: int, name: str, limit: int) -> bytes:
        if step == self.step and name != naming.COMMIT_NAME and self.job.mode == "before-manifest":
            self._prune(None)
        return super().read_bytes(step, name, limit)

    def open_file(self, step: int, name: str) -> ReadableFile:
        if step != self.step or self.fired.is_set() or self.job.mode == "before-manifest":
            return super().open_file(step, name)
        if self.job.mode == "before-open":
            self._prune(None)
            return super().open_file(step, name)
        f = super().open_file(step, name)
        held = os.open(self.inner.path_of(step, name), os.O_RDONLY)  # the same file the reader holds

        def fire() -> None:
            try:
                self._prune(held)
            finally:
                os.close(held)

        return _FireOnRead(f, fire)


@pytest.fixture(params=MODES)
def job(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Job]:
    j = Job(tmp_path / "ckpt", keep=3, mode=request.param)
    for _ in range(3):
        j.save()
    assert j.ckpt.steps() == [1, 2, 3]
    yield j
    j.close()


def reader(job: Job, step: int) -> PruneWhileReading:
    return PruneWhileReading(open_tier(job.root), job, step)


def run_cli(monkeypatch: pytest.MonkeyPatch, module: Any, tier: Tier, argv: list[str]) -> int:
    monkeypatch.setattr(module, "open_tier", lambda *a, **k: tier)
    return cli.main(argv)


def test_verify_reports_a_step_pruned_while_it_was_read(job, monkeypatch, capsys):
    tier = reader(job, 1)
    code = run_cli(monkeypatch, cli, tier, ["verify", str(job.root)])
    out = capsys.readouterr().out
    assert tier.fired.is_set()
    assert "FAILED" not in out, out
    assert "step 1: pruned while it was read" in out
    assert "step 3: ok" in out  # still committed: checked, intact
    assert code == 0, out


def test_verify_of_one_step_pruned_while_read_checks_nothing(job, monkeypatch, capsys):
    code = run_cli(monkeypatch, cli, reader(job, 1), ["verify", str(job.root), "--step", "1"])
    out = capsys.readouterr().out
    assert "step 1: pruned while it was read" in out and "FAILED" not in out
    assert code == 2  # nothing was checked: not "intact", not "damaged"


def test_verify_still_fails_a_damaged_step_that_stays_committed(tmp_path, monkeypatch, capsys):
    j = Job(tmp_path / "ckpt", keep=3, mode="truncated")
    try:
        j.save()
        j.save()
    finally:
        j.close()
    shard = j.root / naming.step_dir_name(1) / naming.shard_name(0, 1)
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert cli.main(["verify", str(j.root)]) == 1
    out = capsys.readouterr().out
    assert "step 1: FAILED" in out and "checksum mismatch" in out and "step 2: ok" in out


def test_ls_leaves_out_a_step_pruned_while_it_was_listed(tmp_path, monkeypatch, capsys):
    j = Job(tmp_path / "ckpt", keep=3, mode="before-manifest")
    try:
        for _ in range(3):
            j.save()
        code = run_cli(monkeypatch, cli, reader(j, 1), ["ls", str(j.root)])
    finally:
        j.close()
    out = capsys.readouterr().out
    assert "UNREADABLE" not in out, out
    assert code == 0
    assert [line.split("\t")[0] for line in out.splitlines()] == ["2", "3"]  # step 1 went


def test_export_of_a_step_pruned_while_read_says_so(job, tmp_path, monkeypatch, capsys):
    dest = tmp_path / "out.safetensors"
    with pytest.raises(tiercheck.StepPrunedError, match=r"step 1 .*deleted while it was read") as info:
        export_step(reader(job, 1), dest, step=1)
    assert info.value.step == 1 and isinstance(info.value, tiercheck.NoCheckpointError)
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if "tiercheck-tmp" in p.name]


def test_export_command_exits_2_for_a_step_pruned_while_read(tmp_path, monkeypatch, capsys):
    j = Job(tmp_path / "ckpt", keep=2, mode="truncated")
    try:
        j.save()
        j.save()
        dest = tmp_path / "out.pt"
        argv = ["export", str(j.root), "--step", "1", "--to", str(dest), "--json"]
        code = run_cli(monkeypatch, view, reader(j, 1), argv)
    finally:
        j.close()
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "deleted while it was read" in captured.err and "not damaged" in captured.err
    assert '"type": "StepPrunedError"' in captured.out
    assert not dest.exists()


def test_restore_of_a_named_step_pruned_while_read_raises_pruned(job):
    with tiercheck.Checkpointer(local=reader(job, 1), keep_local=None) as r:
        template = state(0)
        with pytest.raises(tiercheck.StepPrunedError, match="deleted while it was read") as info:
            r.restore(template, step=1)
    assert info.value.step == 1 and template["step"] == 0  # no plain value written


def test_automatic_restore_moves_to_a_newer_step_when_the_newest_is_pruned_while_read(tmp_path, recwarn):
    """keep_local=2: the reader picks step 2, the job saves 3 and 4 meanwhile and prunes 1
    and 2. Falling back to an older step finds none: the reader lists again and restores 4."""
    j = Job(tmp_path / "ckpt", keep=2, mode="truncated")
    try:
        j.save()
        j.save()
        tier = reader(j, 2)
        with tiercheck.Checkpointer(local=tier, keep_local=None) as r:
            template = state(0)
            got = r.restore(template)
        assert tier.fired.is_set() and got == 4
        assert torch.equal(template["w"], state(4)["w"]) and template["step"] == 4
        messages = [str(w.message) for w in recwarn.list if issubclass(w.category, RuntimeWarning)]
        assert any("step 2" in m and "deleted while it was read" in m for m in messages), messages
        assert not any("checksum mismatch" in m and "deleted" not in m for m in messages), messages
        assert tiercheck.load(str(j.root))["step"] == 4
    finally:
        j.close()


def test_load_of_a_step_pruned_while_read(job):
    with pytest.raises(tiercheck.StepPrunedError):
        tiercheck.load(reader(job, 1), step=1)


def test_upload_skips_a_step_pruned_while_it_was_copied(job, tmp_path):
    from tiercheck.tools.upload import upload_tier_steps

    remote = open_tier(tmp_path / "remote")
    tier = reader(job, 1)
    result = upload_tier_steps(tier, remote)
    assert tier.fired.is_set()
    assert 1 in result.pruned and 1 not in result.copied
    assert 3 in result.copied
    assert 1 not in remote.committed_steps()
    for s in result.copied:  # what was copied is the job's step, bit-exact from tier 2 alone
        got = tiercheck.load(tmp_path / "remote", step=s)
        assert torch.equal(got["w"], state(s)["w"]) and got["step"] == s
