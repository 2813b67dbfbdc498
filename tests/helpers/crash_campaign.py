"""Crash campaign: SIGKILL a saving process at instants aimed at every phase, then check.

A worker (`tests/helpers/crash_worker.py`) saves steps 0, 1, 2, ... of a state that is a pure
function of the step, with ``Checkpointer(local=DIR, remote="file://REMOTE", keep_local=2,
keep_remote=3)``. ``file://`` stands in for an object store: the remote tier writes it with
neither rename nor fsync, shard files first and the COMMIT marker last, as on S3.

Each kill is either aimed at one phase of the save path (staging, tier-1 write, commit,
pruning, upload, remote commit, remote pruning: the worker prints ``enter``/``leave``
markers and, with ``--widen``, pauses at the dangerous instants inside each phase, so a kill
a few milliseconds after the ``enter`` line lands inside it) or falls at a random instant.
The phases still open in the worker's output when it died are the phases it interrupted.
A directory lives through 1 to 4 kills: each restart resumes from the restored step, and
now and then tier 1 is wiped first (the node was replaced; tier 2 must carry the run).

With ``Config(memory=True)`` the worker also keeps every step on tier 0 (``memory=True``,
memory_dir in the run's directory, a fixed job id, keep_memory=1), and kills are aimed at
tier 0's phases too: the copy into the shared buffer (staging, paused half done), the
buffer moved into the tier-0 step, the tier-0 commit, ``take_back`` (each life runs with
host_buffers 1, where every save takes back the buffer holding the newest tier-0 step, or
2) and tier-0 retention. Now and then a restart begins with tier 0 wiped (the node lost).

After every kill, before anything else touches the tiers:

* each tier lists exactly the step directories holding a COMMIT marker, and every listed
  step loads bit-exact from that tier (``tiercheck.load(location, step=s)``);
* every step the worker reported durable on a tier is still listed there, unless
  ``keep`` newer steps are listed there (what retention may legitimately delete);

* tier 0 likewise lists exactly its step directories with a COMMIT, each loads bit-exact
  (``tiercheck.load`` on the tier-0 root: a local directory of the one format), and keeps
  the newest step it reported unless a save began to take its buffer back;

then a fresh ``Checkpointer`` on all tiers (with tier 0: memory=True, the same job id, on a
copy of the memory_dir, since a finished job's close() removes tier 0 and the next life
must find it): ``restore()`` returns the newest listed step of all tiers, bit-exact, from
tier 0 when tier 0 holds it, without skipping a damaged one, and changes nothing on tier 1;
its ``prepare()`` (a restarted job's first write) removes the tier-1 leftovers and uploads
every tier-1 step that tier 2 lacks and would keep, each checked bit-exact, and removes
what the killed process left in tier 0 (temp step dirs, free buffers); and a fresh node
(tier 2 alone) restores the newest step listed there.

Figures: kills run and per phase, torn or partial restores (must be 0), committed steps
lost (must be 0).

`scripts/crash_campaign.py` runs it from the command line (1000 kills, the figures as
markdown tables); ``tests/procs/test_crash.py`` runs it CI-sized.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tiercheck
from tests.helpers import crash_worker as worker
from tiercheck.format import naming
from tiercheck.plan.retention import as_policy, plan_catch_up
from tiercheck.tiers.local import LocalTier
from tiercheck.tiers.memory import BUFFERS_DIR, ROOT_PREFIX, job_key
from tiercheck.tiers.remote import RemoteTier

WORKER_PATH = Path(__file__).with_name("crash_worker.py")

LOCAL_TARGETS = ("staging", "local-write", "local-commit", "local-prune")
REMOTE_TARGETS = ("upload", "remote-commit", "remote-prune")
MEMORY_TARGETS = ("memory-write", "memory-commit", "memory-takeback", "memory-prune")


@dataclass(frozen=True)
class Config:
    """One campaign's shape.

    Attributes:
        remote: run with tier 2 (``file://``) as well as tier 1.
        keep_local, keep_remote: the worker's retention (KeepLast).
        widen_s: pause at each dangerous instant inside a phase (0: natural widths).
        aimed: share of kills aimed at a phase; the rest fall at random instants.
        lives: how many kills a directory goes through (one is drawn per directory).
        wipe_local: chance that a restart begins with tier 1 wiped (two tiers only).
        spawn: chance that a worker is a fresh interpreter rather than a fork.
        aim_timeout_s: kill anyway if the aimed phase has not started by then.
        memory: tier 0 too (``memory=True``, memory_dir in the run's directory, job id
            `worker.JOB_ID`, keep_memory=1); each life runs with host_buffers 1 (every save
            takes back the buffer holding the newest tier-0 step) or 2 (the default: tier-0
            retention frees the older step's buffer).
        wipe_memory: chance that a restart begins with tier 0 wiped (the node was lost).
    """

    remote: bool = True
    keep_local: int = 2
    keep_remote: int = 3
    widen_s: float = 0.02
    aimed: float = 0.75
    lives: tuple[int, ...] = (1, 2, 3, 4)
    wipe_local: float = 0.1
    spawn: float = 0.03
    aim_timeout_s: float = 6.0
    memory: bool = False
    wipe_memory: float = 0.15

    @property
    def targets(self) -> tuple[str, ...]:
        return LOCAL_TARGETS + (MEMORY_TARGETS if self.memory else ()) + (REMOTE_TARGETS if self.remote else ())


@dataclass
class Figures:
    seed: int = 0
    kills: int = 0
    restarts: int = 0
    spawned: int = 0
    wiped: int = 0
    memory_wiped: int = 0
    per_phase: Counter[str] = field(default_factory=Counter)  # kills that interrupted the phase
    aimed: Counter[str] = field(default_factory=Counter)
    aimed_hits: Counter[str] = field(default_factory=Counter)
    steps_checked: Counter[str] = field(default_factory=Counter)  # listed steps loaded, per tier
    torn_restores: int = 0
    committed_lost: int = 0
    leftovers_cleaned: int = 0  # tier-1 temp/trash dirs a kill left and the next start removed
    memory_leftovers: int = 0  # tier-0 temp dirs and free buffers a kill left (removed at the next start)
    resumed_from: Counter[str] = field(default_factory=Counter)  # the workers' restores, by tier
    checked_from: Counter[str] = field(default_factory=Counter)  # the checking restores, by tier
    remote_orphans: set[tuple[int, int]] = field(default_factory=set)  # (run, step): no marker
    marker_cuts: set[tuple[int, int]] = field(default_factory=set)  # known bug, see tests
    stuck_runs: int = 0  # runs whose only listed steps had cut markers: no restart possible
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def summary(self) -> str:
        return (
            f"crash campaign (seed {self.seed}): {self.kills} kills ({self.restarts} of resumed runs, "
            f"{self.spawned} in fresh interpreters, {self.wiped} after losing tier 1), "
            f"steps verified {dict(self.steps_checked)}, torn restores {self.torn_restores}, "
            f"committed steps lost {self.committed_lost}, leftovers cleaned {self.leftovers_cleaned}, "
            f"remote orphans {len(self.remote_orphans)}, cut remote markers {len(self.marker_cuts)} "
            f"({self.stuck_runs} runs stuck), "
            + (
                f"tier 0 wiped {self.memory_wiped}, tier-0 leftovers {self.memory_leftovers}, "
                f"resumed from {dict(self.resumed_from)}, checked restores from {dict(self.checked_from)}, "
                if self.memory_wiped or self.resumed_from.get("memory") or self.steps_checked.get("memory")
                else ""
            )
            + f"{self.elapsed_s:.1f}s"
        )

    def table(self, config: Config) -> str:
        checked = ", ".join(f"{t} {n}" for t, n in sorted(self.steps_checked.items()))
        rows = [
            "| figure | value |",
            "|---|---|",
            f"| kills run | {self.kills} ({self.restarts} of resumed runs, {self.spawned} in fresh "
            f"interpreters, {self.wiped} after tier 1 was wiped) |",
            f"| torn or partial restores | {self.torn_restores} |",
            f"| committed steps lost | {self.committed_lost} |",
            f"| listed steps loaded and compared bit for bit | {checked} |",
            f"| tier-1 leftovers removed at the next start | {self.leftovers_cleaned} |",
            f"| marker-less step dirs left on tier 2 (never listed) | {len(self.remote_orphans)} |",
            f"| tier-2 markers cut by the kill (listed, not loadable) | {len(self.marker_cuts)} |",
            f"| runs that could not restart (only cut markers listed) | {self.stuck_runs} |",
        ]
        if config.memory:
            resumed = ", ".join(f"{t} {n}" for t, n in sorted(self.resumed_from.items()))
            checked_from = ", ".join(f"{t} {n}" for t, n in sorted(self.checked_from.items()))
            rows += [
                f"| restarts that began with tier 0 wiped (node lost) | {self.memory_wiped} |",
                f"| workers' restores, by the tier read | {resumed} |",
                f"| checking restores (fresh Checkpointer, memory=True), by the tier read | {checked_from} |",
                f"| tier-0 temp dirs and dead processes' free buffers left by a kill | {self.memory_leftovers} |",
            ]
        rows += [
            f"| check failures | {len(self.failures)} |",
            f"| seed, wall time | {self.seed}, {self.elapsed_s:.0f} s |",
            "",
            "| phase | kills that interrupted it | kills aimed at it | aimed kills that landed in it |",
            "|---|---|---|---|",
        ]
        for phase in (*worker.PHASES, "other"):
            if phase in config.targets or self.per_phase[phase]:
                aimed = self.aimed[phase] if phase in config.targets else "-"
                hits = self.aimed_hits[phase] if phase in config.targets else "-"
                rows.append(f"| {phase} | {self.per_phase[phase]} | {aimed} | {hits} |")
        return "\n".join(rows)


# ---------------------------------------------------------------------- processes


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # the campaign and the worker share few cores
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Zygote:
    """A worker process that imported torch once and forks a writer per request."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_PATH), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_env(),
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

    def start(self, out: Path, args: list[str]) -> int:
        return int(self._ask(" ".join(["run", str(out), *args]), "pid")[1])

    def reap(self, pid: int) -> int:
        return int(self._ask(f"reap {pid}", "reaped")[2])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Tail:
    """Reads a worker's output file as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []
        self.enters: Counter[str] = Counter()
        self._file: object = None
        self._rest = b""

    def poll(self) -> None:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            except FileNotFoundError:
                return
        data = self._file.read()  # type: ignore[attr-defined]
        if data:
            *complete, self._rest = (self._rest + data).split(b"\n")
            for raw in complete:
                line = raw.decode(errors="replace")
                self.lines.append(line)
                words = line.split()
                if words[:1] == ["enter"] and len(words) > 1:
                    self.enters[words[1]] += 1

    def has(self, word: str) -> bool:
        return any(ln.split()[:1] == [word] for ln in self.lines)

    def close(self) -> None:
        self.poll()
        if self._file is not None:
            self._file.close()  # type: ignore[attr-defined]

    def interrupted(self) -> set[str]:
        """Phases entered and not left: what the kill interrupted."""
        open_: Counter[tuple[str, str]] = Counter()
        for line in self.lines:
            words = line.split()
            if len(words) == 3 and words[0] in ("enter", "leave"):
                key = (words[1], words[2])
                if words[0] == "enter":
                    open_[key] += 1
                elif open_[key] > 0:
                    open_[key] -= 1
        return {phase for (phase, _), n in open_.items() if n > 0}

    def numbers(self, *words: str) -> list[int]:
        n = len(words)
        return [int(ln.split()[n]) for ln in self.lines if ln.split()[:n] == list(words)]


def random_delay(rng: random.Random) -> float:
    """Seconds after 'ready' for a kill not aimed at a phase: many tiny, some long."""
    r = rng.random()
    if r < 0.25:
        return rng.uniform(0.0, 0.03)
    if r < 0.70:
        return rng.uniform(0.03, 0.5)
    return rng.uniform(0.5, 1.5)


def is_running(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped by the zygote, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: ask the kernel, which cannot tell a zombie apart
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_until(tail: Tail, done: Callable[[], bool], alive: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail.poll()
        if done():
            return True
        if not alive():
            tail.poll()
            return done()
        time.sleep(0.0005)
    return False


# ------------------------------------------------------------------- verification


def step_dirs(root: Path) -> tuple[list[int], list[int]]:
    """(steps whose directory holds a COMMIT file, steps whose directory does not)."""
    marked, unmarked = [], []
    names = os.listdir(root) if root.is_dir() else []
    for name in names:
        step = naming.parse_step_dir(name)
        if step is not None:
            (marked if (root / name / naming.COMMIT_NAME).is_file() else unmarked).append(step)
    return sorted(marked), sorted(unmarked)


def marker_cut(remote: Path, local: Path, step: int) -> bool:
    """A tier-2 COMMIT that a kill cut while it was written: empty, or a strict prefix of the
    same step's tier-1 marker (``file://`` writes objects in place, not atomically)."""
    name = naming.step_dir_name(step)
    try:
        data = (remote / name / naming.COMMIT_NAME).read_bytes()
    except OSError:
        return False
    if not data:
        return True
    try:
        full = (local / name / naming.COMMIT_NAME).read_bytes()
    except OSError:
        return False
    return len(data) < len(full) and full.startswith(data)


def load_problem(location: str, step: int) -> str | None:
    try:
        return worker.mismatch(tiercheck.load(location, step=step), worker.make_state(step))
    except Exception as exc:
        return f"load raised {type(exc).__name__}: {exc}"


def verify(
    local: Path,
    remote: Path | None,
    reported: dict[str, list[int]],
    config: Config,
    figures: Figures,
    trial: str,
    run: int = 0,
    tolerate_marker_cuts: bool = True,
    memory: Path | None = None,
    taken_back: set[int] | None = None,
) -> tuple[set[int], set[int]]:
    """Check every tier after a kill (see the module docstring); return the listed steps
    that load bit-exact from some tier and those listed only through a cut marker.

    `memory`: tier 0's memory_dir (None: no tier 0); `taken_back`: the steps whose buffer a
    save began to take back (tier 0 may have dropped them: memory is reused, not durable)."""
    urls = {"local": str(local)}
    if remote is not None:
        urls["remote"] = f"file://{remote}"
    keep = {"local": config.keep_local, "remote": config.keep_remote, "memory": 1}
    names = os.listdir(local) if local.is_dir() else []
    figures.leftovers_cleaned += sum(naming.is_leftover(n) for n in names)
    mem_root = None if memory is None else memory / (ROOT_PREFIX + job_key(worker.JOB_ID))
    mem_left: list[str] = []
    if mem_root is not None:
        urls["memory"] = str(mem_root)  # a local directory of the one format: tiercheck.load reads it
        mem_left = memory_leftovers(mem_root)
        figures.memory_leftovers += len(mem_left)

    # 1. What the kill left, read before anything touches the tiers.
    listed: dict[str, list[int]] = {"local": LocalTier(local).committed_steps()}
    raw = {"local": step_dirs(local)[0]}
    if remote is not None:
        listed["remote"] = RemoteTier(urls["remote"]).committed_steps()
        raw["remote"], orphans = step_dirs(remote)
        figures.remote_orphans.update((run, s) for s in orphans)
    if mem_root is not None:
        listed["memory"] = LocalTier(
            mem_root, name="memory", direct_io=False, fsync=False, recycle=False
        ).committed_steps()
        raw["memory"] = step_dirs(mem_root)[0]
    good: set[int] = set()
    cut: set[int] = set()
    for tier, steps in listed.items():
        if steps != raw[tier]:
            figures.fail(f"{trial}: {tier} lists {steps}, step dirs with a COMMIT are {raw[tier]}")
        for s in steps:
            figures.steps_checked[tier] += 1
            why = load_problem(urls[tier], s)
            if why is None:
                good.add(s)
            elif tier == "remote" and remote is not None and tolerate_marker_cuts and marker_cut(remote, local, s):
                figures.marker_cuts.add((run, s))
                cut.add(s)
            else:
                figures.torn_restores += 1
                figures.fail(f"{trial}: step {s} listed on tier {tier} does not restore bit-exact: {why}")

    # 2. Durable means durable: only retention may remove a reported step, and only once
    #    `keep` newer steps are listed on that tier.
    #    Tier 0 (keep_memory=1) keeps the newest step it reported, unless a save began to
    #    take its buffer back: memory is reused, and the step is on tier 1 by then.
    for tier, steps in listed.items():
        for r in sorted(set(reported.get(tier, []))):
            if tier == "memory" and (r in (taken_back or set()) or max(reported[tier]) > r):
                continue
            if r not in steps and sum(s > r for s in steps) < keep[tier]:
                figures.committed_lost += 1
                figures.fail(f"{trial}: step {r} was reported durable on tier {tier}, which now lists {steps}")

    # 3. A fresh Checkpointer on every tier restores the newest listed step. With tier 0 it
    #    runs on a copy of the memory_dir: a checking Checkpointer is a job that finishes,
    #    and a finished job's close() removes its tier-0 files, which the next life must find.
    expected = max(good, default=None)
    check_mem = None
    tier0: dict[str, object] = {}
    if memory is not None and mem_root is not None:
        check_mem = memory.parent / (memory.name + "-check")
        shutil.rmtree(check_mem, ignore_errors=True)
        shutil.copytree(memory, check_mem, symlinks=True)
        tier0 = {"memory": True, "memory_dir": str(check_mem), "job_id": worker.JOB_ID, "keep_memory": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt = tiercheck.Checkpointer(
            local=local,
            remote=urls.get("remote"),
            keep_local=config.keep_local,
            keep_remote=config.keep_remote if remote is not None else None,
            remote_retry_budget=5.0,
            **tier0,  # type: ignore[arg-type]
        )
        try:
            before = sorted(os.listdir(local)) if local.is_dir() else []
            tier_read = check_restore(ckpt, expected, bool(cut), figures, f"{trial}: restore()")
            if check_mem is not None and tier_read is not None:
                figures.checked_from[tier_read] += 1
                if expected is not None and expected in listed["memory"] and tier_read != "memory":
                    figures.fail(f"{trial}: tier 0 holds the newest step {expected}, restore read it from {tier_read}")
            after = sorted(os.listdir(local)) if local.is_dir() else []
            if after != before:
                figures.fail(f"{trial}: a Checkpointer that only restored changed tier 1: {before} -> {after}")
            ckpt.prepare(worker.make_state(0))  # a restarted job's first write: sweep, catch up
            ckpt.wait()
            # The crash's leftovers are gone; trash of a step this session pruned since may still
            # be freed in the background (the reclaimer), until close() (checked below).
            left = sorted(
                n
                for n in (os.listdir(local) if local.is_dir() else [])
                if naming.is_leftover(n) and (n in before or not n.startswith(".tiercheck-trash-"))
            )
            if left:
                figures.fail(f"{trial}: tier-1 leftovers after a fresh Checkpointer started writing: {left}")
            if check_mem is not None:
                still = set(memory_leftovers(check_mem / mem_root.name)) & set(mem_left)  # type: ignore[union-attr]
                if still:
                    figures.fail(f"{trial}: tier-0 leftovers of the killed process after a restart: {sorted(still)}")
            if remote is not None:
                now = RemoteTier(urls["remote"]).committed_steps()
                owed = plan_catch_up(listed["local"], listed["remote"], as_policy(config.keep_remote, "keep_remote"))
                if [s for s in owed if s not in now]:
                    figures.committed_lost += 1
                    figures.fail(f"{trial}: the catch-up left tier-1 steps {owed} off tier 2, which lists {now}")
                for s in now:
                    if s not in listed["remote"]:  # uploaded by the catch-up just now
                        figures.steps_checked["remote"] += 1
                        why = load_problem(urls["remote"], s)
                        if why is not None:
                            figures.torn_restores += 1
                            figures.fail(f"{trial}: step {s} caught up to tier 2 is not bit-exact: {why}")
        finally:
            try:
                ckpt.close()
            except tiercheck.TiercheckError as exc:
                figures.fail(f"{trial}: the checking Checkpointer failed: {exc}")
        left = sorted(n for n in (os.listdir(local) if local.is_dir() else []) if naming.is_leftover(n))
        if left:
            figures.fail(f"{trial}: tier-1 leftovers after the checking Checkpointer closed: {left}")
        if check_mem is not None:
            shutil.rmtree(check_mem, ignore_errors=True)
    _check_warnings(caught, cut, figures, trial)

    # 4. A fresh node (tier 2 alone) restores the newest step listed there.
    if remote is not None:
        on_remote = [s for s in RemoteTier(urls["remote"]).committed_steps() if s not in cut]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tiercheck.Checkpointer(remote=urls["remote"], keep_remote=None, remote_retry_budget=5.0) as node:
                check_restore(node, max(on_remote, default=None), bool(cut), figures, f"{trial}: a fresh node")
        _check_warnings(caught, cut, figures, trial)
    return good, cut - good


def memory_leftovers(root: Path) -> list[str]:
    """What a killed process left in a tier-0 root besides committed steps: temp step dirs
    (a buffer moved in, no marker yet) and free buffers (``.tiercheck-buffers/``)."""
    names = [n for n in (os.listdir(root) if root.is_dir() else []) if naming.is_leftover(n)]
    buffers = root / BUFFERS_DIR
    names += [f"{BUFFERS_DIR}/{n}" for n in (os.listdir(buffers) if buffers.is_dir() else [])]
    return sorted(names)


def check_restore(
    ckpt: tiercheck.Checkpointer, expected: int | None, cut: bool, figures: Figures, who: str
) -> str | None:
    """`ckpt.restore()` must return `expected` (the newest listed step with a good copy),
    bit-exact. If there is none but cut markers are listed, it may raise instead. Returns
    the tier the restore read (None: nothing restored)."""
    template = worker.make_state(0)
    try:
        with worker.RestoreEvents() as events:
            got = ckpt.restore(template)
    except tiercheck.CheckpointCorruptedError as exc:
        if expected is None and cut:
            return None  # only steps with a cut marker are listed: the known bug, counted above
        figures.torn_restores += 1
        figures.fail(f"{who} raised {exc}")
        return None
    if got != expected:
        figures.torn_restores += 1
        figures.fail(f"{who} returned step {got}, the newest listed step with a good copy is {expected}")
    elif got is not None:
        why = worker.mismatch(template, worker.make_state(got))
        if why is not None:
            figures.torn_restores += 1
            figures.fail(f"{who} gave step {got}, not bit-exact: {why}")
    return None if got is None else events.tier()


def _check_warnings(caught: list[warnings.WarningMessage], cut: set[int], figures: Figures, trial: str) -> None:
    for w in caught:
        if not issubclass(w.category, RuntimeWarning):
            continue
        text = str(w.message)
        if any(f"step {s} from tier 'remote'" in text for s in cut):
            continue  # the cut marker counted above
        figures.torn_restores += 1
        figures.fail(f"{trial}: restore skipped a damaged step after a crash: {text}")


# ------------------------------------------------------------------------ campaign


def worker_args(
    local: Path,
    remote: Path | None,
    config: Config,
    extra: tuple[str, ...] = (),
    memory: Path | None = None,
    host_buffers: int | None = None,
) -> list[str]:
    args = [str(local), "--keep-local", str(config.keep_local), "--widen", str(config.widen_s)]
    if remote is not None:
        args += ["--remote", str(remote), "--keep-remote", str(config.keep_remote)]
    if memory is not None:
        args += ["--memory", str(memory)]
        if host_buffers is not None:
            args += ["--host-buffers", str(host_buffers)]
    return args + list(extra)


def run_campaign(
    kills: int,
    seed: int,
    workdir: Path,
    config: Config = Config(),
    progress: Callable[[Figures], None] | None = None,
) -> Figures:
    rng = random.Random(seed)
    figures = Figures(seed=seed)
    targets = config.targets
    zygote = Zygote()
    started = time.monotonic()
    try:
        run = 0
        while figures.kills < kills:
            run += 1
            base = workdir / f"run{run:04d}"
            local = base / "local"
            remote = base / "remote" if config.remote else None
            memory = base / "memory" if config.memory else None
            if memory is not None:
                memory.mkdir(parents=True, exist_ok=True)
            reported: dict[str, list[int]] = {"local": [], "remote": [], "memory": []}
            taken_back: set[int] = set()
            for life in range(rng.choice(config.lives)):
                if figures.kills >= kills:
                    break
                trial = f"seed {seed} run {run} life {life}"
                if life and remote is not None and rng.random() < config.wipe_local:
                    shutil.rmtree(local, ignore_errors=True)  # the node was replaced
                    reported["local"] = []
                    figures.wiped += 1
                if life and memory is not None and rng.random() < config.wipe_memory:
                    shutil.rmtree(memory, ignore_errors=True)  # the node was lost (or rebooted)
                    memory.mkdir()
                    reported["memory"] = []
                    figures.memory_wiped += 1
                target = targets[figures.kills % len(targets)] if rng.random() < config.aimed else None
                buffers = None
                if memory is not None:  # 1: every save takes back the newest step's buffer
                    buffers = {"memory-takeback": 1, "memory-prune": 2}.get(target or "", rng.choice((1, 2)))
                out = base / f"life{life}.out"
                tail = _kill_one(zygote, rng, config, figures, local, remote, out, target, trial, memory, buffers)
                figures.restarts += life > 0
                for line in tail.lines:
                    if line.startswith(("torn", "error")):
                        figures.torn_restores += line.startswith("torn")
                        figures.fail(f"{trial}: the worker printed: {line}")
                    words = line.split()
                    if words[:1] == ["resumed"] and len(words) == 3:
                        figures.resumed_from[words[2]] += 1
                reported["local"] += tail.numbers("durable", "local")
                reported["remote"] += tail.numbers("durable", "remote")
                reported["memory"] += tail.numbers("durable", "memory")
                taken_back.update(tail.numbers("enter", "memory-takeback"))
                try:
                    good, cut = verify(local, remote, reported, config, figures, trial, run, True, memory, taken_back)
                except Exception as exc:  # keep the campaign going; the failure is in the figures
                    figures.fail(f"{trial}: checking raised {type(exc).__name__}: {exc}")
                    break
                if cut and not good:  # nothing restorable is listed: a restart could only fail
                    figures.stuck_runs += 1
                    break
                if progress is not None and figures.kills % 50 == 0:
                    figures.elapsed_s = time.monotonic() - started
                    progress(figures)
            shutil.rmtree(base, ignore_errors=True)
    finally:
        zygote.close()
    figures.elapsed_s = time.monotonic() - started
    return figures


def _kill_one(
    zygote: Zygote,
    rng: random.Random,
    config: Config,
    figures: Figures,
    local: Path,
    remote: Path | None,
    out: Path,
    target: str | None,
    trial: str,
    memory: Path | None = None,
    host_buffers: int | None = None,
) -> Tail:
    """Start a worker, kill it at an instant aimed at `target` (or at random), reap it;
    return its output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    args = worker_args(local, remote, config, memory=memory, host_buffers=host_buffers)
    tail = Tail(out)
    spawn = rng.random() < config.spawn
    proc: subprocess.Popen[bytes] | None = None
    if spawn:
        figures.spawned += 1
        with open(out, "wb") as sink:
            proc = subprocess.Popen(
                [sys.executable, str(WORKER_PATH), "run", *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=worker_env(),
            )
        pid = proc.pid

        def alive() -> bool:
            return proc.poll() is None
    else:
        pid = zygote.start(out, args)

        def alive() -> bool:
            return is_running(pid)

    try:
        if not wait_until(tail, lambda: tail.has("ready"), alive, 120.0):
            figures.fail(f"{trial}: the worker printed no 'ready'")
        if target is None:
            time.sleep(random_delay(rng))
        else:
            figures.aimed[target] += 1
            nth = 1 if target.endswith("prune") else rng.randint(1, 2)
            wait_until(tail, lambda: tail.enters[target] >= nth, alive, config.aim_timeout_s)
            time.sleep(rng.uniform(0.0, 1.3 * config.widen_s if config.widen_s else 0.005))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if proc is not None:
            status = proc.wait()
            killed = status == -signal.SIGKILL
        else:
            status = zygote.reap(pid)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        tail.close()
    figures.kills += 1
    if not killed:
        figures.fail(f"{trial}: worker ended by itself (status {status}):\n" + "\n".join(tail.lines[-20:]))
    interrupted = tail.interrupted()
    figures.per_phase.update(interrupted or {"other"})
    if target is not None and target in interrupted:
        figures.aimed_hits[target] += 1
    return tail
