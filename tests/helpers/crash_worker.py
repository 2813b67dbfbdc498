"""Crash-test worker: saves a deterministic state, step after step, until it is killed.

The state saved as step N is a pure function of N (`make_state`), so whoever inspects
the tiers afterwards knows the exact bytes every committed step must hold.

Modes::

    python crash_worker.py run LOCAL_DIR [--remote DIR] [--keep-local N] [--keep-remote N]
                               [--memory DIR [--host-buffers N]]
                               [--widen S] [--kill-at POINT [--kill-step N]] [--max-steps N]
        Open a Checkpointer on LOCAL_DIR (and on ``file://DIR`` as tier 2 with --remote; with
        --memory, tier 0 too: ``memory=True, memory_dir=DIR, job_id=JOB_ID, keep_memory=1``),
        restore the newest step if any (and check it bit-exact against `make_state`), then
        save latest+1, latest+2, ... After each save it waits until the step is kept on
        tier 0 (with --memory: ``durable memory N``), then durable on tier 1 (``durable local
        N``); it prints ``durable remote N`` once an upload it did not wait for has finished
        (``skipped remote N`` when a newer step overtook it).

    python crash_worker.py zygote
        Import torch and tiercheck once, then serve requests read from stdin, one a line,
        so that a crash campaign does not pay the interpreter start-up per kill:
          ``run OUTFILE ARGS...`` fork a child running ``run ARGS...`` with its stdout and
            stderr sent to OUTFILE; answer ``pid PID``.
          ``reap PID`` wait for that child to end; answer ``reaped PID STATUS``.
        The zygote never runs a torch operation before forking, so no OpenMP or
        intra-op thread pool exists that a forked child could inherit in a bad state.

Phases. The ``run`` mode wraps tier methods (in the worker process only) to print
``enter PHASE STEP`` / ``leave PHASE STEP`` around each phase of the save path, so the
campaign can aim a kill at a phase and afterwards tell which phases a kill interrupted:
staging, local-write, local-commit, local-prune, upload, remote-commit, remote-prune (and
startup, restore); with --memory also memory-write (the host buffer moved into a tier-0
step, its manifest), memory-commit, memory-takeback (a save about to overwrite the buffer
that holds the newest tier-0 step hides that step and moves the buffer back: with
``--host-buffers 1`` every save does) and memory-prune (tier-0 retention). With
``--widen S`` each phase also sleeps about S seconds at its dangerous instants (a shard half
uploaded, a marker written but not renamed, a step renamed to trash, a remote marker
deleted before the data; with --memory also half of the state copied into the shared
buffer, the buffer moved into the step, a tier-0 marker written but not renamed, a tier-0
marker removed by take_back or retention before the buffer or files go), so that a random
kill lands there often enough. ``--kill-at POINT`` makes the worker SIGKILL itself at
exactly one of `KILL_POINTS`, the first time it passes it at a step >= ``--kill-step``.

Other lines: ``ready`` (imports done, before the Checkpointer starts), ``resumed N TIER``
(restored step N from TIER, and it matched), ``torn N <why>`` (restored step N did not match: exit
status 3), ``suicide POINT N`` (just before a --kill-at kill), ``error ...`` (an
unexpected exception: exit status 4), ``done``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import tiercheck

KEEP_LOCAL = 3  # the local-only campaign's default
JOB_ID = "crash"  # tier 0's job identity: every life of a campaign run finds its memory again

PHASES = (
    "startup",
    "restore",
    "staging",
    "local-write",
    "local-commit",
    "local-prune",
    "upload",
    "remote-commit",
    "remote-prune",
    "memory-write",
    "memory-commit",
    "memory-takeback",
    "memory-prune",
)

KILL_POINTS = (
    "local-shard-written",  # shard in the temp dir, manifest not yet
    "local-marker-written",  # COMMIT in the temp dir, not yet renamed to the step name
    "local-committed",  # renamed and fsynced; the handle does not know yet
    "local-trashed",  # retention renamed a step to trash, data not yet removed
    "local-spare-taken",  # a deleted step's shard moved into the temp dir, not yet overwritten
    "remote-shard-partial",  # 1 MiB of the shard uploaded
    "remote-manifest-written",  # shard and manifest uploaded, no marker
    "remote-marker-created",  # the marker's temp file exists (file://), still empty
    "remote-committed",  # the marker upload returned
    "remote-marker-removed",  # remote retention removed the marker, not yet the data
    "memory-copy-partial",  # half of the first batch of leaves copied into the shared buffer
    "memory-buffer-moved",  # the buffer renamed into tier 0's temp step dir, no manifest yet
    "memory-marker-written",  # tier-0 COMMIT in the temp dir, not yet renamed
    "memory-committed",  # tier-0 step renamed into place; tier 1 not yet written
    "memory-takeback-hidden",  # take_back removed the newest tier-0 step's marker, buffer still in it
    "memory-prune-hidden",  # tier-0 retention removed a marker, the step's files not yet
)

UPLOAD_PIECE = 512 << 10  # with --widen, uploads are cut into pieces with pauses between


def make_state(step: int) -> dict[Any, Any]:
    """The state saved as `step`: about 3.5 MB, every value a pure function of `step`."""
    g = torch.Generator().manual_seed(1_000_003 * step + 17)
    w = torch.randn(512, 512, generator=g)
    rng = np.random.default_rng(step)
    return {
        "model": {
            "w": w,
            "tied": w,  # shares storage with "w": written once, restored into both
            "b": torch.randn(512, generator=g).to(torch.bfloat16),
            "emb": torch.randn(256, 1024, generator=g).to(torch.bfloat16),
            "mask": torch.rand(1000, generator=g) > 0.5,
            "empty": torch.empty(0, 3),
        },
        "optimizer": {
            "state": {
                0: {
                    "exp_avg": torch.randn(512, 512, generator=g),
                    "step": torch.tensor(float(step)),
                },
                "0": "a str key beside the int key 0",
            },
            "param_groups": [{"lr": 1e-3 * (step + 1), "betas": (0.9, 0.999), "params": [0]}],
        },
        "counts": torch.randint(-(2**62), 2**62, (64, 64), generator=g, dtype=torch.int64),
        "np_f8": rng.standard_normal((256, 256)),
        "np_u4": rng.integers(0, 2**32, size=624, dtype=np.uint32),
        "np_scalar": np.int16(step % 30000),
        "step": step,
        "epoch": step // 10,
        "loss": 1.0 / (step + 1),
        "neg_zero": -0.0,
        "nan": math.nan,
        "big": 2**100 + step,
        "name": f"step {step}",
        "even": step % 2 == 0,
        "none": None,
        "blob": bytes((step + i) % 256 for i in range(37)),
        "rng_state": (3, tuple(range(step % 7, step % 7 + 5)), None),
    }


def mismatch(actual: object, expected: object, path: str = "state") -> str | None:
    """Where `actual` differs from `expected` bit for bit (types included), or None."""
    if type(actual) is not type(expected):
        return f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return f"{path}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().contiguous().reshape(-1).view(torch.uint8)
        return None if torch.equal(a, e) else f"{path}: tensor bytes differ"
    if isinstance(expected, (np.ndarray, np.generic)):
        a_np, e_np = np.asarray(actual), np.asarray(expected)
        if a_np.dtype.str != e_np.dtype.str or a_np.shape != e_np.shape:
            return f"{path}: {a_np.dtype.str}{a_np.shape} != {e_np.dtype.str}{e_np.shape}"
        return None if a_np.tobytes() == e_np.tobytes() else f"{path}: array bytes differ"
    if isinstance(expected, dict):
        assert isinstance(actual, dict)
        if list(actual) != list(expected):
            return f"{path}: keys {list(actual)!r} != {list(expected)!r}"
        for k in expected:
            found = mismatch(actual[k], expected[k], f"{path}[{k!r}]")
            if found:
                return found
        return None
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple))
        if len(actual) != len(expected):
            return f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a_item, e_item) in enumerate(zip(actual, expected, strict=True)):
            found = mismatch(a_item, e_item, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, float):
        assert isinstance(actual, float)
        same = struct.pack("<d", actual) == struct.pack("<d", expected)
        return None if same else f"{path}: {actual!r} != {expected!r}"
    return None if actual == expected else f"{path}: {actual!r} != {expected!r}"


def say(line: str) -> None:
    # One write(2) per line, unbuffered: a kill can never leave half a line.
    os.write(1, (line + "\n").encode())


# ------------------------------------------------------------------- instrumentation

_STEP_IN_PATH = re.compile(r"step-([0-9]{12,})")


def _step_of(path: str) -> int:
    m = _STEP_IN_PATH.search(path)
    return int(m.group(1)) if m else -1


def instrument(
    widen: float, kill_at: str | None, kill_step: int, remote_root: str | None, memory: bool = False
) -> None:
    """Wrap tier methods (in this process) to print phase markers, pause `widen` seconds at
    the dangerous instants, and SIGKILL this process at `kill_at`."""
    from fsspec.implementations import local as fs_local

    from tiercheck import checkpointer as ckpt_mod
    from tiercheck.engine import stager as stager_mod
    from tiercheck.steps import stage as stage_mod
    from tiercheck.tiers import local as local_mod
    from tiercheck.tiers import memory as memory_mod
    from tiercheck.tiers import recycle as recycle_mod
    from tiercheck.tiers import remote as remote_mod

    def in_memory(tier: Any) -> bool:  # tier 0 is a LocalTier too: its calls get its own phases
        return isinstance(tier, memory_mod.SharedMemoryTier)

    def nap(fraction: float) -> None:
        if widen > 0:
            time.sleep(widen * fraction)

    def point(name: str, step: int) -> None:
        if name == kill_at and step >= kill_step:
            say(f"suicide {name} {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    saving = {"step": -1}

    def wrap(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        setattr(owner, attr, make(getattr(owner, attr)))

    # -- staging (caller thread) ------------------------------------------------------

    def save(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> Any:
            saving["step"] = step
            return orig(self, step, *a, **k)

        return wrapper

    def stage_into(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            step = saving["step"]
            say(f"enter staging {step}")
            nap(1.0)
            orig(*a, **k)
            say(f"leave staging {step}")

        return wrapper

    wrap(ckpt_mod.Checkpointer, "save", save)
    wrap(stager_mod, "stage_into", stage_into)  # the caller thread's copy (engine/stager.py)

    # -- tier 1 -------------------------------------------------------------------------

    def local_open_step(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> Any:
            say(f"enter local-write {step}")
            return orig(self, step, *a, **k)

        return wrapper

    def local_writer_write(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, name: str, *a: Any, **k: Any) -> Any:
            n = orig(self, name, *a, **k)
            if name.endswith(".shard") and not in_memory(self._tier):
                point("local-shard-written", self._step)
            nap(0.5)
            return n

        return wrapper

    def local_commit(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *a: Any, **k: Any) -> None:
            tier = "memory" if in_memory(self._tier) else "local"
            say(f"leave {tier}-write {self._step}")
            say(f"enter {tier}-commit {self._step}")
            orig(self, *a, **k)
            point(f"{tier}-committed", self._step)
            if tier == "memory":
                nap(0.5)  # tier 0 holds the step, tier 1 does not yet
            say(f"leave {tier}-commit {self._step}")

        return wrapper

    def local_abort(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *a: Any, **k: Any) -> None:
            orig(self, *a, **k)
            tier = "memory" if in_memory(self._tier) else "local"
            say(f"leave {tier}-write {self._step}")
            say(f"leave {tier}-commit {self._step}")

        return wrapper

    def local_write_file(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, path: str, *a: Any, **k: Any) -> None:
            orig(self, path, *a, **k)
            if os.path.basename(path) == "COMMIT":  # in the temp dir, before the rename
                point("memory-marker-written" if in_memory(self) else "local-marker-written", _step_of(path))
                nap(1.0)

        return wrapper

    def local_delete(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> None:
            say(f"enter local-prune {step}")
            nap(0.5)
            orig(self, step, *a, **k)
            say(f"leave local-prune {step}")

        return wrapper

    def local_reclaim(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, token: str) -> None:
            point("local-trashed", _step_of(os.path.basename(token)))
            nap(1.0)
            orig(self, token)

        return wrapper

    def local_into_spare(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, path: str, nbytes: int) -> Any:
            fd = orig(self, path, nbytes)
            if fd is not None:  # the old bytes under the new name, in the temp dir
                say(f"recycled {_step_of(path)}")
                point("local-spare-taken", _step_of(path))
                nap(0.5)
            return fd

        return wrapper

    rmtree = shutil.rmtree

    def rmtree_paused(path: Any, *a: Any, **k: Any) -> None:
        name = os.path.basename(os.fspath(path))
        if name.startswith(".tiercheck-trash-"):  # the step is hidden, its data still there
            point("local-trashed", _step_of(name))
            nap(1.0)
        rmtree(path, *a, **k)

    wrap(local_mod.LocalTier, "open_step", local_open_step)
    wrap(local_mod._LocalStepWriter, "write_file", local_writer_write)
    wrap(local_mod._LocalStepWriter, "commit", local_commit)
    wrap(local_mod._LocalStepWriter, "abort", local_abort)
    wrap(local_mod.LocalTier, "write_file", local_write_file)
    wrap(local_mod.LocalTier, "delete_step", local_delete)
    wrap(local_mod.LocalTier, "reclaim", local_reclaim)
    wrap(recycle_mod.Recycler, "into_spare", local_into_spare)
    # Recycle this worker's ~3.5 MB shards the way a multi-GB state's are (a deleted step's
    # shard overwritten in place by a later step), so kills land in the middle of that too.
    local_mod.LocalTier.RECYCLE_MIN = 1 << 20
    shutil.rmtree = rmtree_paused  # type: ignore[assignment]

    if memory:
        instrument_memory(memory_mod, stage_mod, nap, point, saving, widen > 0 or kill_at is not None)
    if remote_root is None:
        return

    # -- tier 2 -------------------------------------------------------------------------

    def remote_open_step(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> Any:
            say(f"enter upload {step}")
            return orig(self, step, *a, **k)

        return wrapper

    def put_chunks(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, path: str, chunks: Callable[[], Iterator[Any]], *a: Any, **k: Any) -> int:
            step = _step_of(path)

            def pieces() -> Iterator[Any]:
                sent = 0
                for chunk in chunks():
                    view = memoryview(chunk)
                    for pos in range(0, len(view), UPLOAD_PIECE):
                        if sent:
                            if sent == 2 and path.endswith(".shard"):
                                point("remote-shard-partial", step)
                            nap(0.125)
                        yield view[pos : pos + UPLOAD_PIECE]
                        sent += 1

            return int(orig(self, path, pieces if widen > 0 or kill_at else chunks, *a, **k))

        return wrapper

    def put_bytes(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, path: str, *a: Any, **k: Any) -> int:
            n = int(orig(self, path, *a, **k))
            if path.endswith(".manifest.json"):
                point("remote-manifest-written", _step_of(path))
                nap(0.25)
            return n

        return wrapper

    def remote_commit(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *a: Any, **k: Any) -> None:
            say(f"leave upload {self._step}")
            say(f"enter remote-commit {self._step}")
            nap(0.5)
            orig(self, *a, **k)
            point("remote-committed", self._step)
            nap(0.5)
            say(f"leave remote-commit {self._step}")

        return wrapper

    def remote_abort(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *a: Any, **k: Any) -> None:
            orig(self, *a, **k)
            say(f"leave upload {self._step}")
            say(f"leave remote-commit {self._step}")

        return wrapper

    def remote_delete(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> None:
            say(f"enter remote-prune {step}")
            nap(0.5)
            orig(self, step, *a, **k)
            say(f"leave remote-prune {step}")

        return wrapper

    def rm_file(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, path: str, *a: Any, **k: Any) -> Any:
            out = orig(self, path, *a, **k)
            if path.endswith("/COMMIT") and remote_root in path:  # marker gone, data not yet
                point("remote-marker-removed", _step_of(path))
                nap(1.0)
            return out

        return wrapper

    def opener_open(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any) -> None:
            orig(self)
            path = str(self.path)
            # file:// markers are written to COMMIT.tmp-<hex> and renamed into place: this is
            # the instant the marker's file exists but its bytes are not yet written.
            if "w" in self.mode and "/COMMIT.tmp-" in path and remote_root in path:
                point("remote-marker-created", _step_of(path))

        return wrapper

    wrap(remote_mod.RemoteTier, "open_step", remote_open_step)
    wrap(remote_mod.RemoteTier, "put_chunks", put_chunks)
    wrap(remote_mod.RemoteTier, "put_bytes", put_bytes)
    wrap(remote_mod._RemoteStepWriter, "commit", remote_commit)
    wrap(remote_mod._RemoteStepWriter, "abort", remote_abort)
    wrap(remote_mod.RemoteTier, "delete_step", remote_delete)
    wrap(fs_local.LocalFileSystem, "rm_file", rm_file)
    wrap(fs_local.LocalFileOpener, "_open", opener_open)


def instrument_memory(
    memory_mod: Any,
    stage_mod: Any,
    nap: Callable[[float], None],
    point: Callable[[str, int], None],
    saving: dict[str, int],
    active: bool,
) -> None:
    """Tier 0's phases: the copy into the shared buffer (half done), the buffer moved into
    the step (write_file's rename), the commit (see `local_commit`: tier 0's writer is a
    tier-1 writer), `take_back` and retention (a marker removed, the rest not yet)."""
    context = threading.local()  # which tier-0 operation is removing a marker: take_back or prune

    def wrap(owner: Any, attr: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        setattr(owner, attr, make(getattr(owner, attr)))

    def copy_cpu(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(group: Any, flat: Any, changed: Any) -> None:
            if active and group.cpu_batches:
                # Copy the first half of the first batch, pause there (the shared buffer half
                # written), then let the real copy do all of it (the first half again: same bytes).
                a, b = group.cpu_batches[0]
                half = a + max(1, (b - a) // 2)
                sources = flat.sources if group.all_sources else [flat.sources[i] for i in group.cpu]
                with torch.no_grad():
                    torch._foreach_copy_(group.cpu_dst[a:half], list(sources[a:half]))
                point("memory-copy-partial", saving["step"])
                nap(0.5)
            orig(group, flat, changed)

        return wrapper

    def open_step(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> Any:
            say(f"enter memory-write {step}")
            return orig(self, step, *a, **k)

        return wrapper

    def write_file(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, name: str, data: Any, *a: Any, **k: Any) -> int:
            n = int(orig(self, name, data, *a, **k))
            if name.endswith(".shard"):  # the buffer is the shard now, in the temp dir
                point("memory-buffer-moved", self._step)
                nap(1.0)
            return n

        return wrapper

    def take_back(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, buf: Any) -> Any:
            step = _step_of(os.path.dirname(buf.path))
            if step < 0:  # the buffer holds no step: nothing to take back
                return orig(self, buf)
            say(f"enter memory-takeback {step}")
            context.op = "memory-takeback-hidden"
            try:
                out = orig(self, buf)
            finally:
                context.op = None
            say(f"leave memory-takeback {step}")
            return out

        return wrapper

    def delete_step(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, step: int, *a: Any, **k: Any) -> None:
            say(f"enter memory-prune {step}")
            context.op = "memory-prune-hidden"
            try:
                orig(self, step, *a, **k)
            finally:
                context.op = None
            say(f"leave memory-prune {step}")

        return wrapper

    class _Os:
        """memory.py's `os`: as os, but a marker removed by take_back or retention is a
        dangerous instant (the step hidden, its buffer or files still in its directory)."""

        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        @staticmethod
        def unlink(path: Any, *a: Any, **k: Any) -> None:
            os.unlink(path, *a, **k)
            op = getattr(context, "op", None)
            if op and os.path.basename(os.fspath(path)) == "COMMIT":
                point(op, _step_of(os.fspath(path)))
                nap(1.0)

    wrap(stage_mod, "_copy_cpu", copy_cpu)
    wrap(memory_mod.SharedMemoryTier, "open_step", open_step)
    wrap(memory_mod._MemoryStepWriter, "write_file", write_file)
    wrap(memory_mod.SharedMemoryTier, "take_back", take_back)
    wrap(memory_mod.SharedMemoryTier, "delete_step", delete_step)
    memory_mod.os = _Os()


# ------------------------------------------------------------------------------ run


def parse_run_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="crash_worker.py run")
    p.add_argument("local")
    p.add_argument("--remote", default=None, help="a directory, used as file://DIR (tier 2)")
    p.add_argument("--keep-local", type=int, default=KEEP_LOCAL)
    p.add_argument("--keep-remote", type=int, default=None)
    p.add_argument("--memory", default=None, help="tier 0's memory_dir (tier 0 on)")
    p.add_argument("--host-buffers", type=int, default=None)
    p.add_argument("--widen", type=float, default=0.0)
    p.add_argument("--kill-at", choices=KILL_POINTS, default=None)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=10**9)
    return p.parse_args(argv)


def run(argv: list[str]) -> int:
    opts = parse_run_args(argv)
    remote_root = None if opts.remote is None else os.path.abspath(opts.remote)
    instrument(opts.widen, opts.kill_at, opts.kill_step, remote_root, memory=opts.memory is not None)
    say("ready")
    try:
        return _run(opts, remote_root)
    except Exception:
        say("error " + traceback.format_exc().replace("\n", " | "))
        return 4


def _run(opts: argparse.Namespace, remote_root: str | None) -> int:
    say("enter startup -")
    tier0: dict[str, Any] = {}
    if opts.memory is not None:
        tier0 = {"memory": True, "memory_dir": opts.memory, "job_id": JOB_ID, "keep_memory": 1, "memory_peers": 0}
    ckpt = tiercheck.Checkpointer(
        local=opts.local,
        remote=None if remote_root is None else f"file://{remote_root}",
        keep_local=opts.keep_local,
        keep_remote=opts.keep_remote,
        remote_retry_budget=5.0,
        host_buffers=opts.host_buffers,
        **tier0,
    )
    say("leave startup -")
    template = make_state(0)
    say("enter restore -")
    with RestoreEvents() as events:
        restored = ckpt.restore(template)
    say("leave restore -")
    if restored is not None:
        why = mismatch(template, make_state(restored))
        if why is not None:
            say(f"torn {restored} {why}")
            return 3
        say(f"resumed {restored} {events.tier()}")
    step = 0 if restored is None else restored + 1
    uploading: list[Any] = []

    def report_uploads() -> None:
        for h in list(uploading):
            if h.done("remote"):
                uploading.remove(h)
                try:
                    h.wait("remote")
                except tiercheck.UploadSkippedError:
                    say(f"skipped remote {h.step}")
                else:
                    say(f"durable remote {h.step}")

    while step < opts.max_steps:
        handle = ckpt.save(step, make_state(step))
        if opts.memory is not None:
            handle.wait("memory")
            say(f"durable memory {step}")
        handle.wait("local")
        say(f"durable local {step}")
        if remote_root is not None:
            uploading.append(handle)
            report_uploads()
        step += 1
    ckpt.wait()
    report_uploads()
    ckpt.close()
    say("done")
    return 0


class RestoreEvents(logging.Handler):
    """Which tier a restore read (the ``restore`` event of ``tiercheck.events``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.tiers: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(record.getMessage())
        except ValueError:
            return
        if isinstance(event, dict) and event.get("event") == "restore":
            self.tiers.append(str(event.get("tier")))

    def tier(self) -> str:
        return ",".join(self.tiers) or "?"

    def __enter__(self) -> RestoreEvents:
        log = logging.getLogger("tiercheck.events")
        self._level = log.level
        log.addHandler(self)
        if not log.isEnabledFor(logging.INFO):
            log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("tiercheck.events")
        log.removeHandler(self)
        log.setLevel(self._level)


def zygote() -> int:
    children: set[int] = set()
    while True:
        line = sys.stdin.readline()
        if not line:
            break
        words = line.split()
        if not words:
            continue
        if words[0] == "run":
            out_path, args = words[1], words[2:]
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    os.close(fd)
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.close(null)
                    status = run(args)
                finally:
                    os._exit(status)
            children.add(pid)
            print(f"pid {pid}", flush=True)
        elif words[0] == "reap":
            pid = int(words[1])
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            print(f"reaped {pid} {status}", flush=True)
        else:
            print(f"error unknown request {line.strip()!r}", flush=True)
    for pid in children:
        os.waitpid(pid, 0)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[1] == "zygote":
        return zygote()
    if len(argv) >= 3 and argv[1] == "run":
        return run(argv[2:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
