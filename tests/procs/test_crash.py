"""Crash consistency: SIGKILL a real writer process, then check what it left on every tier.

The campaign itself lives in `tests/helpers/crash_campaign.py` (`scripts/crash_campaign.py` runs it
for 1000 kills and prints the figures); these tests run it CI-sized:

* two tiers (local dir + ``file://`` standing in for an object store), keep_local=2,
  keep_remote=3: kills aimed in turn at staging, tier-1 write, commit, pruning, upload,
  remote commit and remote pruning (the worker prints phase markers and pauses at the
  dangerous instants inside each phase), the rest at random instants; restarts resume the
  same tiers, sometimes after tier 1 was wiped;
* tier 1 alone (keep_local=3), as the original campaign;
* tier 0 with tier 1 (``memory=True``, keep_memory=1, host_buffers 1 or 2 per life): kills
  aimed in turn at staging (the copy into the shared buffer), tier-0 write (the buffer moved
  into the step), tier-0 commit, take_back, tier-0 retention and the tier-1 phases; restarts
  sometimes begin with tier 0 wiped (node lost);
* deterministic kill points: the worker SIGKILLs itself at one exact instant (a shard half
  uploaded, a marker written but not renamed, half the state copied into the shared buffer,
  a tier-0 marker removed by take_back, ...), then a restart runs to completion.

After every kill (see `crash_campaign.verify`): each tier lists exactly the step dirs with a
COMMIT and every listed step loads bit-exact from that tier; every step reported durable on
a tier is still listed there unless retention had `keep` newer ones; a fresh Checkpointer on
both tiers leaves no tier-1 leftovers and `restore()` returns the newest listed step
bit-exact without skipping a damaged one; a fresh node (tier 2 alone) restores the newest
step on tier 2. With tier 0: it lists exactly its step dirs with a COMMIT, each loads
bit-exact (``tiercheck.load`` on the tier-0 root), the checking Checkpointer has memory=True
and the same job_id (on a copy of the memory_dir, since its close() removes tier 0) and
restores the newest step of all tiers, from tier 0 when tier 0 holds it, and a restart
removes what the killed process left in tier 0 (temp step dirs, free buffers).

Sizes: TIERCHECK_CRASH_TRIALS (two-tier kills, default 50, ~35 s),
TIERCHECK_CRASH_LOCAL_TRIALS (tier-1-only kills, default 15), TIERCHECK_CRASH_MEMORY_TRIALS
(tier 0 + tier 1 kills, default 24, ~20 s); seed: TIERCHECK_CRASH_SEED.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tiercheck
from tests.helpers import crash_campaign as campaign
from tests.helpers import crash_worker as worker
from tiercheck.format import naming
from tiercheck.tiers.local import LocalTier

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform == "win32", reason="needs POSIX fork and SIGKILL"
)


def _seed() -> int:
    return int(os.environ.get("TIERCHECK_CRASH_SEED", str(random.SystemRandom().randrange(2**32))))


def _assert_clean(figures: Any, kills: int) -> None:
    report = figures.summary()
    print(report)
    assert figures.failures == [], report + "\n" + "\n".join(figures.failures)
    assert figures.torn_restores == 0
    assert figures.committed_lost == 0
    assert figures.kills == kills


# ------------------------------------------------------------------------ campaigns


@pytest.mark.slow
@pytest.mark.procs  # the workers start in `campaign.Zygote`: a module attribute, which tests/helpers/markers.py does not follow
def test_sigkill_aimed_at_every_phase_of_two_tiers_never_tears_or_loses_a_step(tmp_path: Path) -> None:
    kills = int(os.environ.get("TIERCHECK_CRASH_TRIALS", "50"))
    config = campaign.Config()
    figures = campaign.run_campaign(kills, _seed(), tmp_path, config)
    print(figures.table(config))
    _assert_clean(figures, kills)
    assert figures.steps_checked["remote"] > 0
    if kills >= 50:  # aimed kills rotate over the 7 phases: each got several
        hit = {p for p in config.targets if figures.per_phase[p]}
        assert len(hit) >= len(config.targets) - 1, figures.table(config)


@pytest.mark.slow
@pytest.mark.procs
def test_sigkill_at_random_instants_on_tier_1_alone(tmp_path: Path) -> None:
    kills = int(os.environ.get("TIERCHECK_CRASH_LOCAL_TRIALS", "15"))
    config = campaign.Config(remote=False, keep_local=worker.KEEP_LOCAL, aimed=0.5, wipe_local=0.0, spawn=0.1)
    figures = campaign.run_campaign(kills, _seed(), tmp_path, config)
    _assert_clean(figures, kills)


@pytest.mark.slow
@pytest.mark.procs
def test_sigkill_aimed_at_every_phase_of_tier_0_never_tears_or_loses_a_step(tmp_path: Path) -> None:
    kills = int(os.environ.get("TIERCHECK_CRASH_MEMORY_TRIALS", "24"))
    config = campaign.Config(memory=True, remote=False, wipe_memory=0.2)
    figures = campaign.run_campaign(kills, _seed(), tmp_path, config)
    print(figures.table(config))
    _assert_clean(figures, kills)
    assert figures.steps_checked["memory"] > 0
    if kills >= 24:
        assert figures.checked_from["memory"] > 0  # tier 0 held the newest step, and was read
        hit = {p for p in campaign.MEMORY_TARGETS if figures.per_phase[p]}
        assert len(hit) >= len(campaign.MEMORY_TARGETS) - 1, figures.table(config)


# ---------------------------------------------------------------- exact kill points


@pytest.fixture(scope="module")
def zygote() -> Iterator[Any]:
    z = campaign.Zygote()
    yield z
    z.close()


def _run_worker(zygote: Any, out: Path, args: list[str], timeout: float = 60.0) -> tuple[bool, Any]:
    """Run a worker until it ends (or kill it after `timeout`); (killed by SIGKILL, output)."""
    pid = zygote.start(out, args)
    tail = campaign.Tail(out)
    ended = campaign.wait_until(tail, lambda: False, lambda: campaign.is_running(pid), timeout)
    if not ended and campaign.is_running(pid):
        os.kill(pid, signal.SIGKILL)
    status = zygote.reap(pid)
    tail.close()
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, tail


def _crash_at(zygote: Any, tmp_path: Path, point: str, kill_step: int = 1) -> tuple[Any, Path, Path]:
    """Kill the worker at `point`, check, restart it for 3 more steps, check again."""
    config = campaign.Config()
    local, remote = tmp_path / "local", tmp_path / "remote"
    figures = campaign.Figures()
    reported: dict[str, list[int]] = {"local": [], "remote": []}
    args = campaign.worker_args(local, remote, config)
    extra = ["--kill-at", point, "--kill-step", str(kill_step)]
    killed, tail = _run_worker(zygote, tmp_path / "crash.out", [*args, "--widen", "0", *extra])
    assert killed and tail.numbers("suicide", point), tail.lines[-10:]
    reported["local"] += tail.numbers("durable", "local")
    reported["remote"] += tail.numbers("durable", "remote")
    campaign.verify(local, remote, reported, config, figures, f"killed at {point}", tolerate_marker_cuts=False)
    assert figures.failures == [], "\n".join(figures.failures)
    resume_to = max(reported["local"], default=0) + 4
    killed, tail = _run_worker(zygote, tmp_path / "resume.out", [*args, "--widen", "0", "--max-steps", str(resume_to)])
    assert not killed and tail.has("done"), tail.lines[-10:]
    reported["local"] += tail.numbers("durable", "local")
    reported["remote"] += tail.numbers("durable", "remote")
    campaign.verify(local, remote, reported, config, figures, f"resumed after {point}", tolerate_marker_cuts=False)
    assert figures.failures == [], "\n".join(figures.failures)
    assert max(reported["remote"]) == resume_to - 1  # the resumed run's last upload finished
    return figures, local, remote


@pytest.mark.parametrize(
    "point",
    [
        "local-shard-written",
        "local-marker-written",
        "local-committed",
        "local-trashed",
        "local-spare-taken",
        "remote-shard-partial",
        "remote-manifest-written",
        "remote-marker-created",
        "remote-committed",
        "remote-marker-removed",
    ],
)
@pytest.mark.procs
def test_sigkill_at_an_exact_instant_then_resume(zygote: Any, tmp_path: Path, point: str) -> None:
    assert point in worker.KILL_POINTS
    _crash_at(zygote, tmp_path, point)


MEMORY_POINTS = {  # kill point: host_buffers, tier a restart right after it must restore from
    "memory-copy-partial": (2, "memory"),  # the previous step is still on tier 0
    "memory-buffer-moved": (2, "memory"),
    "memory-marker-written": (2, "memory"),
    "memory-committed": (2, "memory"),  # the killed step is on tier 0 alone
    "memory-takeback-hidden": (1, "local"),  # tier 0 hid its only step: tier 1 has it
    "memory-prune-hidden": (2, "memory"),
}


@pytest.mark.parametrize("point", sorted(MEMORY_POINTS))
@pytest.mark.procs
def test_sigkill_at_an_exact_tier_0_instant_then_resume(zygote: Any, tmp_path: Path, point: str) -> None:
    """Tier 0 and tier 1: killed at `point` (at step 2 or the first pass after it), checked;
    restarted, it restores the newest step from the expected tier, then saves 3 more steps."""
    assert point in worker.KILL_POINTS
    buffers, tier = MEMORY_POINTS[point]
    config = campaign.Config(remote=False, memory=True)
    local, memory = tmp_path / "local", tmp_path / "memory"
    memory.mkdir()
    figures = campaign.Figures()
    reported: dict[str, list[int]] = {"local": [], "memory": []}
    args = campaign.worker_args(local, None, config, memory=memory, host_buffers=buffers)
    extra = ["--widen", "0", "--kill-at", point, "--kill-step", "2"]
    killed, tail = _run_worker(zygote, tmp_path / "crash.out", [*args, *extra])
    assert killed and tail.numbers("suicide", point), tail.lines[-10:]
    reported["local"] += tail.numbers("durable", "local")
    reported["memory"] += tail.numbers("durable", "memory")
    taken_back = set(tail.numbers("enter", "memory-takeback"))
    good, _ = campaign.verify(
        local, None, reported, config, figures, f"killed at {point}", memory=memory, taken_back=taken_back
    )
    assert figures.failures == [], "\n".join(figures.failures)
    assert figures.checked_from[tier] == 1, dict(figures.checked_from)
    if point == "memory-committed":  # tier 0 is ahead of tier 1
        assert max(good) == tail.numbers("suicide", point)[0] > max(reported["local"])
    resume_to = max(good) + 4
    killed, tail = _run_worker(zygote, tmp_path / "resume.out", [*args, "--widen", "0", "--max-steps", str(resume_to)])
    assert not killed and tail.has("done"), tail.lines[-10:]
    resumed = [ln.split() for ln in tail.lines if ln.startswith("resumed ")]
    assert resumed == [["resumed", str(max(good)), tier]], resumed
    assert tail.numbers("durable", "memory")[-1] == resume_to - 1
    # close() of the finished job removed its tier 0; tier 1 keeps its own.
    assert os.listdir(memory) == []
    assert worker.mismatch(tiercheck.load(local, step=resume_to - 1), worker.make_state(resume_to - 1)) is None


@pytest.mark.procs
def test_a_remote_deletion_cut_by_a_kill_is_finished_later(zygote: Any, tmp_path: Path) -> None:
    _, _, remote = _crash_at(zygote, tmp_path, "remote-marker-removed")
    listed = set(campaign.step_dirs(remote)[0])
    orphans = [s for s in campaign.step_dirs(remote)[1] if s < max(listed)]
    assert orphans == [], f"tier 2 still holds data of deleted steps {orphans}"


def test_worker_state_is_a_pure_function_of_the_step() -> None:
    assert worker.mismatch(worker.make_state(5), worker.make_state(5)) is None
    assert worker.mismatch(worker.make_state(5), worker.make_state(6)) is not None


def test_worker_mismatch_sees_one_flipped_bit() -> None:
    a, b = worker.make_state(3), worker.make_state(3)
    b["model"]["emb"].view(torch.int16)[7, 7] ^= 1
    assert worker.mismatch(a, b) == "state['model']['emb']: tensor bytes differ"
    c = worker.make_state(3)
    c["neg_zero"] = 0.0
    assert worker.mismatch(c, a) == "state['neg_zero']: 0.0 != -0.0"


# ---------------------------------------------------------- deterministic crash points


def _save_steps(directory: Path, steps: range, keep: int | None = None) -> None:
    with tiercheck.Checkpointer(local=directory, keep_local=keep) as ckpt:
        for s in steps:
            ckpt.save(s, worker.make_state(s)).wait()


def test_crash_between_marker_unlink_and_rename_hides_the_step(tmp_path: Path) -> None:
    """A deletion killed right after it removed the marker: the step is simply gone."""
    _save_steps(tmp_path, range(3))
    (tmp_path / naming.step_dir_name(1) / naming.COMMIT_NAME).unlink()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        assert ckpt.steps() == [0, 2]
        template = worker.make_state(0)
        assert ckpt.restore(template) == 2
        assert worker.mismatch(template, worker.make_state(2)) is None


def test_crash_leftovers_are_removed_and_unrelated_dirs_kept(tmp_path: Path) -> None:
    _save_steps(tmp_path, range(2))
    tmp_dir = tmp_path / naming.tmp_dir_name(2, 0)
    trash_dir = tmp_path / naming.trash_dir_name(0)
    for d in (tmp_dir, trash_dir):
        d.mkdir()
        (d / "rank-00000-of-00001.shard").write_bytes(b"\0" * 4096)
    users = [tmp_path / ".tiercheck-tmp-mine", tmp_path / "step-7-copy", tmp_path / "notes"]
    for d in users:
        d.mkdir()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        assert ckpt.steps() == [0, 1]
        assert tmp_dir.exists() and trash_dir.exists()  # a Checkpointer that only reads sweeps nothing
        ckpt.prepare(worker.make_state(0))  # the writer sweeps
        assert not tmp_dir.exists()
        assert not trash_dir.exists()
        assert [d.exists() for d in users] == [True, True, True]
        assert ckpt.steps() == [0, 1]


def test_step_number_is_reusable_after_a_crash_mid_deletion(tmp_path: Path) -> None:
    """A marker-less step directory must not block saving that step number again."""
    # Reachable without any hand editing: restore(state, step=1) then save(2) deletes the
    # abandoned steps 3, 2 (newest first); a kill after step 3's marker is unlinked leaves
    # step-000000000003/ without COMMIT. The next run resumes at step 2 and saves step 3.
    _save_steps(tmp_path, range(4))
    (tmp_path / naming.step_dir_name(3) / naming.COMMIT_NAME).unlink()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        assert ckpt.restore(worker.make_state(0)) == 2
        ckpt.save(3, worker.make_state(3)).wait()
        assert ckpt.steps() == [0, 1, 2, 3]
    assert worker.mismatch(tiercheck.load(tmp_path, step=3), worker.make_state(3)) is None


def test_a_step_killed_mid_deletion_is_invisible_and_reclaimed(tmp_path: Path, monkeypatch) -> None:
    """Deletion renames the step directory to a trash name first (one atomic step that hides
    the marker with the data); a kill before the trash is removed leaves only a trash
    directory, which the next start-up removes."""
    _save_steps(tmp_path, range(3))
    tier = LocalTier(tmp_path)
    monkeypatch.setattr("tiercheck.tiers.owned.shutil.rmtree", lambda *a, **k: None)  # "killed" here
    tier.delete_step(0)
    monkeypatch.undo()
    names = sorted(os.listdir(tmp_path))
    assert naming.step_dir_name(0) not in names
    assert any(naming.is_leftover(n) for n in names)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=2) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert ckpt.restore(worker.make_state(0)) == 2
        ckpt.save(3, worker.make_state(3)).wait()
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
    assert sorted(os.listdir(tmp_path)) == sorted(
        [naming.lock_name(0), naming.RUNLOG_DIR, naming.step_dir_name(2), naming.step_dir_name(3)]
    )
