"""A Hypothesis state machine of save, commit, crash, prune, corrupt and restore on two tiers.

In the style of zarr's store state machine: random sequences of operations run against a
real `Checkpointer` (a local directory as tier 1, ``file://`` as tier 2) and against a
model that is nothing but a few sets: which steps are committed on each tier, which of
those copies were damaged, and which state each step holds. After every operation (each
ends with ``wait()``, so the model only describes settled states):

* ``steps(tier)`` is exactly the model's set for that tier;
* ``restore()`` returns the newest step the model says is committed on some tier with an
  undamaged copy, bit-exact (None when nothing is committed; `CheckpointCorruptedError`
  when every copy is damaged); every listed copy loads bit-exact with `tiercheck.load`,
  or raises `CheckpointCorruptedError` if the model damaged it.

Operations: save (healthy, or with one tier failing: the error is raised exactly once and
the other tier still gets the step), restore of an older step followed by a save that
starts a new branch, corruption of one copy (flip an entry's byte, truncate or delete the
shard, alter the manifest or the marker), a crash (the Checkpointer is dropped unclosed,
then debris is left by hand as a kill would leave it: a tier-1 temp dir, a step renamed to
trash, a half-uploaded or unmarked tier-2 step, a tier-2 deletion cut after the marker, a
step committed on tier 1 but never uploaded), and reopening with other retention (keep 1,
2, 3 or all on each tier). Each (re)open then calls ``prepare()``, as a restarted job would:
the Checkpointer becomes the writer, sweeps tier-1 leftovers and uploads every tier-1 step
tier 2 lacks and would keep. A step whose upload failed stays on tier 1 while tier-2
retention would keep it (the model's ``owed`` set).

Examples: TIERCHECK_STATEFUL_EXAMPLES (default 20, ~30 s alone, ~60 s inside the whole
suite), steps per example: TIERCHECK_STATEFUL_STEPS (default 25).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import tiercheck
from tiercheck.errors import CheckpointCorruptedError, TierError
from tiercheck.format import naming
from tiercheck.plan.retention import as_policy, plan_catch_up, superseded

HERE = Path(__file__).resolve().parent
SHARD = naming.shard_name(0, 1)
MANIFEST = naming.manifest_name(0, 1)
TIERS = ("local", "remote")


def _load_worker() -> Any:
    spec = importlib.util.spec_from_file_location("tiercheck_crash_worker", HERE.parent / "helpers" / "crash_worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mismatch = _load_worker().mismatch


def small_state(seed: int) -> dict[str, Any]:
    """A small state with the same structure for every seed, its values a function of it."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(16, generator=g),
        "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "ids": np.random.default_rng(seed).integers(-(2**40), 2**40, size=7),
        "seed": seed,
        "note": f"state {seed}",
    }


def keep_newest(steps: set[int], keep: int | None) -> set[int]:
    return set(steps) if keep is None else set(sorted(steps)[-keep:])


class TwoTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="tiercheck-model-"))
        self.local = self.root / "local"
        self.remote = self.root / "remote"
        self.url = f"file://{self.remote}"
        self.keep: dict[str, int | None] = {"local": 2, "remote": 3}
        self.contents: dict[int, int] = {}  # step -> seed of the state saved as that step
        self.on: dict[str, set[int]] = {t: set() for t in TIERS}  # committed copies
        self.bad: dict[str, set[int]] = {t: set() for t in TIERS}  # damaged committed copies
        self.next_step = 0
        self.failing: str | None = None  # the tier the next save fails on
        self.owed: set[int] = set()  # failed uploads this session keeps on tier 1 for tier 2
        self.ckpt = self._open()

    def teardown(self) -> None:
        if self.ckpt is not None:
            with contextlib.suppress(tiercheck.TiercheckError):
                self.ckpt.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- the real checkpointer ---------------------------------------------------------

    def _open(self) -> tiercheck.Checkpointer:
        """Open a Checkpointer, make it the writer (`prepare`), and apply to the model what
        that does: the catch-up upload of every tier-1 step tier 2 lacks and would keep, then
        retention on both tiers."""
        catch_up = plan_catch_up(self.on["local"], self.on["remote"], self._policy("remote"))
        # Uploading a damaged tier-1 copy is refused with a TierError (see
        # test_an_upload_never_spreads_a_damaged_tier1_copy); the model stays away from it.
        assume(not set(catch_up) & self.bad["local"])
        ckpt = tiercheck.Checkpointer(
            local=self.local,
            remote=self.url,
            keep_local=self.keep["local"],
            keep_remote=self.keep["remote"],
            remote_retry_budget=0.0,
        )
        self._arm(ckpt)
        ckpt.wait()
        assert ckpt.steps("remote") == sorted(self.on["remote"])  # opening alone uploads nothing
        ckpt.prepare(small_state(0))
        ckpt.wait()
        self.owed = set()
        if catch_up:
            self.on["remote"].update(catch_up)
            self._apply_retention()
        return ckpt

    def _policy(self, tier: str) -> tiercheck.RetentionPolicy:
        return as_policy(self.keep[tier], f"keep_{tier}")

    def _settle_owed(self, listed: bool) -> bool:
        """The failed uploads tier 1 keeps: those tier-2 retention would still keep, given
        tier 2's listing when it just worked. True if the set changed."""
        before = set(self.owed)
        if self.keep["remote"] is not None:
            others = self.on["remote"] if listed else set()
            self.owed -= others
            self.owed -= set(superseded(self.owed, self._policy("remote"), others))
        return self.owed != before

    def _prune_remote(self) -> None:
        kept = keep_newest(self.on["remote"], self.keep["remote"])
        self.on["remote"] &= kept
        self.bad["remote"] &= kept

    def _prune_local(self) -> None:
        kept = keep_newest(self.on["local"], self.keep["local"]) | self.owed
        self.on["local"] &= kept
        self.bad["local"] &= kept

    def _arm(self, ckpt: tiercheck.Checkpointer) -> None:
        """Let the machine make one tier fail (on this checkpointer's tier objects only)."""
        local_tier, remote_tier = ckpt._local, ckpt._remote  # the tiers the pipeline writes with
        assert local_tier is not None and remote_tier is not None
        machine = weakref.ref(self)

        def failing(tier: str, original: Any, exc: type[OSError]) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                m = machine()
                if m is not None and m.failing == tier:
                    raise exc(5, f"injected failure of tier {tier}")
                return original(*args, **kwargs)

            return call

        local_tier.write_file = failing("local", local_tier.write_file, OSError)  # type: ignore[method-assign]
        remote_tier.put_bytes = failing("remote", remote_tier.put_bytes, PermissionError)  # type: ignore[method-assign]
        remote_tier.put_local_file = failing("remote", remote_tier.put_local_file, PermissionError)  # type: ignore[method-assign]

    def _apply_retention(self) -> None:
        for tier in TIERS:
            kept = keep_newest(self.on[tier], self.keep[tier])
            self.on[tier] &= kept
            self.bad[tier] &= kept

    def _forget(self, steps: set[int]) -> None:
        for tier in TIERS:
            self.on[tier] -= steps
            self.bad[tier] -= steps

    def _good(self) -> set[int]:
        return {s for t in TIERS for s in self.on[t] - self.bad[t]}

    def _committed(self) -> set[int]:
        return self.on["local"] | self.on["remote"]

    def _dir(self, tier: str, step: int) -> Path:
        return (self.local if tier == "local" else self.remote) / naming.step_dir_name(step)

    def _new_step(self) -> int:
        step = self.next_step
        self.next_step += 1
        return step

    # -- rules ---------------------------------------------------------------------------

    @rule(seed=st.integers(1, 2**31))
    def save(self, seed: int) -> None:
        step = self._new_step()
        self.ckpt.save(step, small_state(seed))
        self.ckpt.wait()
        self.contents[step] = seed
        self.on["local"].add(step)
        self.on["remote"].add(step)
        self._prune_remote()
        self._settle_owed(listed=True)
        self._prune_local()

    @rule(seed=st.integers(1, 2**31), tier=st.sampled_from(TIERS))
    def save_with_a_failing_tier(self, seed: int, tier: str) -> None:
        step = self._new_step()
        self.failing = tier
        try:
            handle = self.ckpt.save(step, small_state(seed))
            with pytest.raises(TierError) as raised:
                self.ckpt.wait()
        finally:
            self.failing = None
        assert (raised.value.tier, raised.value.step) == (tier, step)
        self.ckpt.wait()  # raised once, not again
        other = "remote" if tier == "local" else "local"
        handle.wait(other)  # the healthy tier got the step
        self.contents[step] = seed
        self.on[other].add(step)
        # Retention runs on the tier that committed the step, not on the failed one.
        if other == "local":  # the upload failed: tier 1 keeps the step if tier 2 would
            self.owed.add(step)
            self._settle_owed(listed=False)
            self._prune_local()
        else:
            self._prune_remote()
            if self._settle_owed(listed=True):  # released steps leave tier 1 too
                self._prune_local()

    @precondition(lambda self: bool(self._good()))
    @rule(data=st.data(), seed=st.integers(1, 2**31))
    def restore_older_then_branch(self, data: st.DataObject, seed: int) -> None:
        back = data.draw(st.sampled_from(sorted(self._good())), label="restore step")
        template = small_state(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a damaged copy skipped for the other tier
            assert self.ckpt.restore(template, step=back) == back
        assert mismatch(template, small_state(self.contents[back])) is None
        newer = sorted(s for s in self._committed() if s > back)
        if not newer:
            return
        step = data.draw(st.sampled_from(newer), label="branch step")
        with pytest.warns(RuntimeWarning, match="new branch"):
            self.ckpt.save(step, small_state(seed))
        self.ckpt.wait()
        self._forget(set(newer))
        self.owed -= set(newer)
        for s in newer:
            self.contents.pop(s, None)
        self.contents[step] = seed
        self.on["local"].add(step)
        self.on["remote"].add(step)
        self._prune_remote()
        self._settle_owed(listed=True)
        self._prune_local()
        self.next_step = max(self.next_step, step + 1)

    def _corruptible(self) -> list[tuple[str, int]]:
        # Not a tier-1 step tier 2 lacks: a later start-up may upload it, and refuses a damaged
        # copy loudly (modelled separately, see test_an_upload_never_spreads_a_damaged_tier1_copy).
        return [
            (t, s)
            for t in TIERS
            for s in sorted(self.on[t] - self.bad[t])
            if not (t == "local" and s not in self.on["remote"])
        ]

    @precondition(lambda self: bool(self._corruptible()))
    @rule(data=st.data(), how=st.sampled_from(["flip", "truncate", "delete-shard", "manifest", "marker"]))
    def corrupt_a_copy(self, data: st.DataObject, how: str) -> None:
        tier, step = data.draw(st.sampled_from(self._corruptible()), label="copy")
        d = self._dir(tier, step)
        if how == "flip":  # one bit of one entry's bytes (padding is not covered, on purpose)
            entries = [e for e in json.loads((d / MANIFEST).read_bytes())["entries"] if e["length"] > 0]
            e = data.draw(st.sampled_from(entries), label="entry")
            pos = e["offset"] + data.draw(st.integers(0, e["length"] - 1), label="byte")
            with open(d / SHARD, "r+b") as f:
                f.seek(pos)
                byte = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([byte ^ (1 << data.draw(st.integers(0, 7), label="bit"))]))
        elif how == "truncate":
            size = (d / SHARD).stat().st_size
            os.truncate(d / SHARD, data.draw(st.integers(0, size - 1), label="size"))
        elif how == "delete-shard":
            (d / SHARD).unlink()
        elif how == "manifest":
            (d / MANIFEST).write_bytes((d / MANIFEST).read_bytes().replace(b'"step"', b'"stap"'))
        else:
            (d / naming.COMMIT_NAME).write_bytes(b"{not json")
        self.bad[tier].add(step)

    @rule(
        debris=st.sampled_from(
            ["none", "tmp-dir", "trash", "partial-upload", "unmarked-upload", "remote-marker-gone", "not-uploaded"]
        ),
        data=st.data(),
    )
    def crash(self, debris: str, data: st.DataObject) -> None:
        """Drop the Checkpointer unclosed, leave what a kill at some instant leaves, reopen."""
        ref = weakref.ref(self.ckpt)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.ckpt = None  # type: ignore[assignment]
            gc.collect()
        if ref() is None:
            assert any(issubclass(w.category, ResourceWarning) for w in caught), [str(w.message) for w in caught]
        else:  # something still holds it: close it so its threads stop
            ref().close()  # type: ignore[union-attr]
        step = self.next_step  # the step a kill interrupted; the next save reuses the number
        if debris == "tmp-dir":
            tmp = self.local / naming.tmp_dir_name(step, 0)
            tmp.mkdir(parents=True)
            (tmp / SHARD).write_bytes(os.urandom(3000))
        elif debris == "trash" and self.on["local"]:
            victim = data.draw(st.sampled_from(sorted(self.on["local"])), label="trashed step")
            os.rename(self._dir("local", victim), self.local / naming.trash_dir_name(victim))
            self.on["local"].discard(victim)
            self.bad["local"].discard(victim)
        elif debris in ("partial-upload", "unmarked-upload"):
            scratch = self.root / "scratch"
            with tiercheck.Checkpointer(local=scratch, keep_local=None) as other:
                other.save(step, small_state(data.draw(st.integers(1, 2**31), label="stale seed"))).wait()
            target = self._dir("remote", step)
            target.mkdir(parents=True, exist_ok=True)
            src = scratch / naming.step_dir_name(step)
            if debris == "partial-upload":
                (target / SHARD).write_bytes((src / SHARD).read_bytes()[:4096])
            else:
                shutil.copy(src / SHARD, target / SHARD)
                shutil.copy(src / MANIFEST, target / MANIFEST)
            shutil.rmtree(scratch)
        elif debris == "remote-marker-gone" and len(self.on["remote"]) > 1:
            victim = data.draw(st.sampled_from(sorted(self.on["remote"])[:-1]), label="deleted step")
            (self._dir("remote", victim) / naming.COMMIT_NAME).unlink()
            self.on["remote"].discard(victim)
            self.bad["remote"].discard(victim)
        elif debris == "not-uploaded":  # committed on tier 1, killed before the upload began
            seed = data.draw(st.integers(1, 2**31), label="seed")
            with tiercheck.Checkpointer(local=self.local, keep_local=None) as alone:
                alone.save(self._new_step(), small_state(seed)).wait()
            self.contents[step] = seed
            self.on["local"].add(step)
        debris_left = {n for n in os.listdir(self.local) if naming.is_leftover(n)} if self.local.exists() else set()
        self.ckpt = self._open()
        # The kill's leftovers are swept; trash of a step this session pruned since may still
        # be freed by the reclaimer thread (close() waits for it).
        left = [
            n
            for n in (os.listdir(self.local) if self.local.exists() else [])
            if naming.is_leftover(n) and (n in debris_left or not n.startswith(".tiercheck-trash-"))
        ]
        assert left == []
        self.restore_newest()  # what a restarted job does first

    @rule(keep_local=st.sampled_from([1, 2, 3, None]), keep_remote=st.sampled_from([1, 2, 3, None]))
    def reopen_with_other_retention(self, keep_local: int | None, keep_remote: int | None) -> None:
        self.ckpt.close()
        self.keep = {"local": keep_local, "remote": keep_remote}
        self.ckpt = self._open()
        self.restore_newest()

    @rule()
    def restore_newest(self) -> None:
        template = small_state(0)
        good = self._good()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # damaged copies are skipped, with a warning
            if self._committed() and not good:
                with pytest.raises(CheckpointCorruptedError):
                    self.ckpt.restore(template)
                return
            got = self.ckpt.restore(template)
        assert got == max(good, default=None)
        if got is not None:
            assert mismatch(template, small_state(self.contents[got])) is None

    @invariant()
    def listings_match_the_model_and_every_copy_loads_or_is_rejected(self) -> None:
        if self.ckpt is None:
            return
        for tier, where in (("local", str(self.local)), ("remote", self.url)):
            assert self.ckpt.steps(tier) == sorted(self.on[tier]), tier
            for step in sorted(self.on[tier]):
                if step in self.bad[tier]:
                    with pytest.raises(CheckpointCorruptedError):
                        tiercheck.load(where, step=step)
                else:
                    assert mismatch(tiercheck.load(where, step=step), small_state(self.contents[step])) is None


TwoTierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("TIERCHECK_STATEFUL_EXAMPLES", "20")),
    stateful_step_count=int(os.environ.get("TIERCHECK_STATEFUL_STEPS", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_two_tier_model = pytest.mark.slow(TwoTierMachine.TestCase)  # ~30 s: 20 runs of 25 steps


# --------------------------------------------------------------------- known bugs


def test_an_upload_never_spreads_a_damaged_tier1_copy(tmp_path: Path) -> None:
    local, url = tmp_path / "local", f"file://{tmp_path / 'remote'}"
    with tiercheck.Checkpointer(local=local, remote=url, keep_local=2, keep_remote=1) as ckpt:
        ckpt.save(1, small_state(1)).wait()
    # Step 2 committed on tier 1; the process was killed before the upload started.
    with tiercheck.Checkpointer(local=local, keep_local=None) as alone:
        alone.save(2, small_state(2)).wait()
    shard = local / naming.step_dir_name(2) / SHARD
    data = bytearray(shard.read_bytes())
    data[0] ^= 1  # bit rot in the first entry, after the commit
    shard.write_bytes(bytes(data))
    # Refusing the upload loudly (a TierError) would be fine.
    with (
        tiercheck.Checkpointer(local=local, remote=url, keep_local=2, keep_remote=1) as ckpt,
        contextlib.suppress(TierError),
    ):
        ckpt.prepare(small_state(3))  # the writer's catch-up upload of step 2
        ckpt.wait()
    # A fresh node must still find a good step on tier 2.
    with tiercheck.Checkpointer(remote=url) as node:
        for step in node.steps("remote"):
            assert mismatch(tiercheck.load(url, step=step), small_state(step)) is None
        template = small_state(0)
        got = node.restore(template)
        assert got is not None
        assert mismatch(template, small_state(got)) is None
