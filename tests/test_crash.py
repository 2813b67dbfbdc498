"""Crash consistency: SIGKILL a real writer process at random instants, then check the dir.

A worker process (`crash_worker.py`) saves steps 0, 1, 2, ... of a state that is a pure
function of the step, with keep_local=3 so that retention deletes steps as it goes. The
test kills it after a random delay (many very short, so kills land in start-up, staging,
the shard write, the manifest and marker writes, the rename and the pruning), sometimes
restarts it on the same directory (it resumes from the restored step + 1) and kills the
resumed run too. After every kill it checks invariant 1 of the design contract:

* a fresh Checkpointer on the directory removes every temp/trash leftover;
* the listed steps are exactly the step directories holding a COMMIT marker, and each
  one restores bit-exact (`tiercheck.load`) to the state the worker saved;
* the newest step the worker reported committed is still listed, and so is every
  reported step that retention (keep 3) must still keep;
* `restore()` returns the newest listed step, bit-exact, without skipping any step.

Trials: TIERCHECK_CRASH_TRIALS (default 25, ~20 s); seed: TIERCHECK_CRASH_SEED.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import torch

import tiercheck
from tiercheck import layout
from tiercheck.tiers.local import LocalTier

HERE = Path(__file__).resolve().parent
WORKER = HERE / "crash_worker.py"

pytestmark = pytest.mark.skipif(
    not hasattr(os, "fork") or sys.platform == "win32", reason="needs POSIX fork and SIGKILL"
)


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiercheck_crash_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # the test process and the worker share few cores
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------- processes


class Zygote:
    """A worker process that imported torch once and forks a writer per request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_worker_env(),
            text=True,
            bufsize=1,
        )

    def _ask(self, request: str, expect: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(request + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer and answer[0] == expect, f"zygote answered {answer!r} to {request!r}"
        return answer

    def start(self, directory: Path, out: Path, max_steps: int) -> int:
        return int(self._ask(f"run {directory} {out} {max_steps}", "pid")[1])

    def reap(self, pid: int) -> int:
        return int(self._ask(f"reap {pid}", "reaped")[2])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _wait_for_line(out: Path, word: str, alive: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and any(ln.split()[:1] == [word] for ln in out.read_text().splitlines()):
            return
        if not alive():  # type: ignore[operator]
            raise AssertionError(f"worker exited before printing {word!r}:\n{out.read_text()}")
        time.sleep(0.001)
    raise AssertionError(f"worker printed no {word!r} line within {timeout}s")


def _kill_delay(rng: random.Random) -> float:
    """Seconds after 'ready': many tiny delays (start-up, first save), some long runs."""
    r = rng.random()
    if r < 0.25:
        return rng.uniform(0.0, 0.03)
    if r < 0.70:
        return rng.uniform(0.03, 0.5)
    return rng.uniform(0.5, 1.5)


# ------------------------------------------------------------------- verification


@dataclass
class Figures:
    kills: int = 0
    restarts: int = 0
    spawned: int = 0
    steps_checked: int = 0
    torn_restores: int = 0
    committed_lost: int = 0
    leftovers_cleaned: int = 0  # temp/trash dirs a kill left and the next start removed
    markerless_dirs: int = 0  # step dirs whose marker a deletion had removed
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        self.failures.append(what)


def _printed(out: Path, word: str) -> list[int]:
    if not out.exists():
        return []
    return [int(ln.split()[1]) for ln in out.read_text().splitlines() if ln.split()[:1] == [word]]


def _verify(directory: Path, reported: list[int], figures: Figures, trial: str) -> int | None:
    """Check the directory after a kill; return the newest listed step."""
    names = os.listdir(directory) if directory.exists() else []
    figures.leftovers_cleaned += sum(layout.is_leftover(n) for n in names)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = tiercheck.Checkpointer(local=directory, keep_local=worker.KEEP_LOCAL)
        try:
            after = os.listdir(directory) if directory.exists() else []
            left = sorted(n for n in after if n.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX)))
            if left:
                figures.fail(f"{trial}: leftovers after a fresh Checkpointer started: {left}")
            step_dirs = {layout.parse_step_dir(n): n for n in after if layout.parse_step_dir(n) is not None}
            with_marker = sorted(s for s, n in step_dirs.items() if (directory / n / layout.COMMIT_NAME).is_file())
            figures.markerless_dirs += len(step_dirs) - len(with_marker)
            steps = ckpt.steps()
            if steps != with_marker:
                figures.fail(f"{trial}: steps() {steps} != step dirs with a COMMIT {with_marker}")
            for s in with_marker:
                figures.steps_checked += 1
                try:
                    why = worker.mismatch(tiercheck.load(directory, step=s), worker.make_state(s))
                except Exception as exc:  # a listed step that does not load is torn
                    why = f"load raised {type(exc).__name__}: {exc}"
                if why is not None:
                    figures.torn_restores += 1
                    figures.fail(f"{trial}: committed step {s} is torn: {why}")
            latest = ckpt.latest_step()
            if reported:
                newest = max(reported)
                # Retention (keep 3) never deletes one of the 3 newest steps of a
                # consecutive run, so every reported step in that window must be there.
                must_keep = [p for p in reported if latest is None or p >= latest - (worker.KEEP_LOCAL - 1)]
                lost = sorted({newest, *must_keep} - set(steps))
                if latest is None or newest > latest or lost:
                    figures.committed_lost += len(lost) or 1
                    figures.fail(f"{trial}: reported committed {lost or newest} but steps() is {steps}")
            template = worker.make_state(0)
            got = ckpt.restore(template)
            if got != latest:
                figures.torn_restores += 1
                figures.fail(f"{trial}: restore() returned {got}, newest listed step is {latest}")
            elif got is not None:
                why = worker.mismatch(template, worker.make_state(got))
                if why is not None:
                    figures.torn_restores += 1
                    figures.fail(f"{trial}: restore() of step {got} is not bit-exact: {why}")
        finally:
            ckpt.close()
    skipped = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if skipped:
        figures.torn_restores += 1
        figures.fail(f"{trial}: restore skipped a damaged step after a crash: {skipped}")
    return latest


# --------------------------------------------------------------------------- test


def test_sigkill_at_random_instants_never_tears_a_committed_step(tmp_path: Path) -> None:
    trials = int(os.environ.get("TIERCHECK_CRASH_TRIALS", "25"))
    seed = int(os.environ.get("TIERCHECK_CRASH_SEED", str(random.SystemRandom().randrange(2**32))))
    rng = random.Random(seed)
    figures = Figures()
    zygote = Zygote()
    started = time.monotonic()
    try:
        run = 0
        while figures.kills < trials:
            run += 1
            directory = tmp_path / f"run{run:03d}"
            reported: list[int] = []
            lives = rng.choice((1, 2, 2, 3))
            for life in range(lives):
                if figures.kills >= trials:
                    break
                trial = f"seed {seed} run {run} life {life}"
                out = tmp_path / f"run{run:03d}-life{life}.out"
                spawn = rng.random() < 0.12  # now and then a whole fresh interpreter
                if spawn:
                    figures.spawned += 1
                    with open(out, "wb") as sink:
                        proc = subprocess.Popen(
                            [sys.executable, str(WORKER), "run", str(directory)],
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                            env=_worker_env(),
                        )
                    _wait_for_line(out, "ready", lambda p=proc: p.poll() is None)
                    time.sleep(_kill_delay(rng))
                    proc.send_signal(signal.SIGKILL)
                    status = proc.wait()
                    killed = status == -signal.SIGKILL
                else:
                    pid = zygote.start(directory, out, 10**9)
                    _wait_for_line(out, "ready", lambda: zygote.proc.poll() is None)
                    time.sleep(_kill_delay(rng))
                    os.kill(pid, signal.SIGKILL)
                    status = zygote.reap(pid)  # the process is gone before we look
                    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                figures.kills += 1
                figures.restarts += life > 0
                text = out.read_text()
                if not killed:
                    figures.fail(f"{trial}: worker ended by itself (status {status}):\n{text[-2000:]}")
                for line in text.splitlines():
                    if line.startswith("torn"):
                        figures.torn_restores += 1
                        figures.fail(f"{trial}: the resumed worker restored a torn step: {line}")
                reported += _printed(out, "committed")
                _verify(directory, reported, figures, trial)
    finally:
        zygote.close()
    elapsed = time.monotonic() - started
    report = (
        f"crash campaign (seed {seed}): {figures.kills} kills ({figures.restarts} of resumed runs, "
        f"{figures.spawned} in fresh interpreters), {figures.steps_checked} listed steps verified, "
        f"torn restores {figures.torn_restores}, committed steps lost {figures.committed_lost}, "
        f"leftovers cleaned {figures.leftovers_cleaned}, marker-less step dirs seen "
        f"{figures.markerless_dirs}, {elapsed:.1f}s"
    )
    print(report)
    assert figures.failures == [], report + "\n" + "\n".join(figures.failures)
    assert figures.torn_restores == 0
    assert figures.committed_lost == 0
    assert figures.kills == trials


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
    (tmp_path / layout.step_dir_name(1) / layout.COMMIT_NAME).unlink()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        assert ckpt.steps() == [0, 2]
        template = worker.make_state(0)
        assert ckpt.restore(template) == 2
        assert worker.mismatch(template, worker.make_state(2)) is None


def test_crash_leftovers_are_removed_and_unrelated_dirs_kept(tmp_path: Path) -> None:
    _save_steps(tmp_path, range(2))
    tmp_dir = tmp_path / layout.tmp_dir_name(2, 0)
    trash_dir = tmp_path / layout.trash_dir_name(0)
    for d in (tmp_dir, trash_dir):
        d.mkdir()
        (d / "rank-00000-of-00001.shard").write_bytes(b"\0" * 4096)
    users = [tmp_path / ".tiercheck-tmp-mine", tmp_path / "step-7-copy", tmp_path / "notes"]
    for d in users:
        d.mkdir()
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
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
    (tmp_path / layout.step_dir_name(3) / layout.COMMIT_NAME).unlink()
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
    monkeypatch.setattr("tiercheck.tiers.local.shutil.rmtree", lambda *a, **k: None)  # "killed" here
    tier.delete_step(0)
    monkeypatch.undo()
    names = sorted(os.listdir(tmp_path))
    assert layout.step_dir_name(0) not in names
    assert any(layout.is_leftover(n) for n in names)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=2) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert ckpt.restore(worker.make_state(0)) == 2
        ckpt.save(3, worker.make_state(3)).wait()
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
    assert sorted(os.listdir(tmp_path)) == [layout.step_dir_name(2), layout.step_dir_name(3)]
