"""One rank of a multi-rank test job: ``python tests/helpers/multirank_worker.py SCENARIO RANK WORLD PORT DIR``.

Each scenario joins a real gloo process group, runs tiercheck, and writes what it saw to
``DIR/result-SCENARIO-RANK.json`` for `tests/procs/test_multirank.py` to check.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import tiercheck
from tiercheck.tiers.local import LocalTier

SCENARIOS: dict[str, Callable[[int, int, str], dict[str, Any]]] = {}


def scenario(fn: Callable[[int, int, str], dict[str, Any]]) -> Callable[[int, int, str], dict[str, Any]]:
    SCENARIOS[fn.__name__] = fn
    return fn


def digest(obj: object) -> str:
    """A hash of every tensor's bytes and every plain value, in key order."""
    h = hashlib.sha256()

    def walk(v: object) -> None:
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                v = v.to_local()  # a DTensor: the piece this rank holds
            h.update(str((v.dtype, tuple(v.shape))).encode())
            h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, dict):
            for k in v:
                h.update(repr(k).encode())
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif hasattr(v, "state_dict"):
            walk(v.state_dict())
        else:
            h.update(repr(v).encode())

    walk(obj)
    return h.hexdigest()


def make_state(rank: int, seed: int = 0) -> dict[str, Any]:
    """A DDP-style state: replicated model and optimizer, per-rank shard/RNG/position."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)
    return {
        "model": model,
        "optimizer": opt,
        "shard": torch.arange(16, dtype=torch.float32) + 100 * rank,  # each rank a different slice
        "rng": gen.get_state(),
        "position": rank * 7,
        "_ddp": ddp,
        "_gen": gen,
    }


def train(state: dict[str, Any], steps: int) -> None:
    ddp, opt, gen = state["_ddp"], state["optimizer"], state["_gen"]
    for _ in range(steps):
        x = torch.randn(4, 32, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["shard"].add_(1)
        state["position"] += 1
    state["rng"] = gen.get_state()


def saved_view(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if not k.startswith("_")}


def zero(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.zero_()
    state["shard"].zero_()
    state["position"] = -1


def tiers(root: str, rank: int, layout: str) -> dict[str, Any]:
    if layout == "shared":
        local = f"{root}/shared"
    elif layout == "pairs":  # two ranks per "node"
        local = f"{root}/node{rank // 2}"
    else:
        local = f"{root}/node{rank}"
    if os.environ.get("MR_NO_REMOTE"):
        return {"local": local}
    return {"local": local, "remote": f"file://{root}/remote"}


@scenario
def roundtrip(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train, save three steps with node-local tier 1 + shared tier 2, restore bit-exact."""
    layout = os.environ.get("MR_LAYOUT", "nodelocal")
    state = make_state(rank)
    ck = tiercheck.Checkpointer(
        **tiers(root, rank, layout),
        keep_local=2,
        replicated=("model", "optimizer"),
        coordination_timeout=30,
    )
    digests = {}
    for step in (10, 20, 30):
        train(state, 2)
        ck.save(step, saved_view(state)).wait()
        digests[step] = digest(saved_view(state))
    ck.wait()
    out: dict[str, Any] = {
        "local_steps": ck.steps("local"),
        "remote_steps": [] if os.environ.get("MR_NO_REMOTE") else ck.steps("remote"),
        "saved": digests[30],
    }
    zero(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        view = saved_view(state)
        out["restored_step"] = ck.restore(view)
    out["restored"] = digest(view)
    out["warnings"] = [str(w.message) for w in caught]
    # Restore an older step explicitly: every rank must get the same one.
    view = saved_view(state)
    out["restored_20"] = ck.restore(view, step=20)
    out["digest_20"] = digest(view)
    out["saved_20"] = digests[20]
    ck.close()
    return out


@scenario
def restore_only(rank: int, world: int, root: str) -> dict[str, Any]:
    """A fresh job restores what an earlier job saved (maybe with another world size)."""
    layout = os.environ.get("MR_LAYOUT", "nodelocal")
    keys = os.environ.get("MR_KEYS", "model,optimizer").split(",")
    state = make_state(rank, seed=1)
    zero(state)
    ck = tiercheck.Checkpointer(**tiers(root, rank, layout), replicated=("model", "optimizer"), coordination_timeout=30)
    template = {k: saved_view(state)[k] for k in keys}
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["restored_step"] = ck.restore(template)
        except tiercheck.TiercheckError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
    out["warnings"] = [str(w.message) for w in caught]
    out["digest"] = digest(template)
    if os.environ.get("MR_PREPARE"):  # a restarted job that becomes the writer: it catches up
        ck.prepare(template)
    ck.close()
    return out


@scenario
def kill_mid_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 10 commits; rank 1 is SIGKILLed while writing its tier-1 part of step 20; the
    other ranks' save of step 20 must fail within the timeout, not hang."""
    timeout = float(os.environ.get("MR_TIMEOUT", "4"))
    state = make_state(rank)
    ck = tiercheck.Checkpointer(
        **tiers(root, rank, "nodelocal"), replicated=("model", "optimizer"), coordination_timeout=timeout
    )
    train(state, 1)
    ck.save(10, saved_view(state)).wait()
    saved = digest(saved_view(state))
    out: dict[str, Any] = {"saved_10": saved}
    if rank == 1:
        real = LocalTier.write_file

        def dying(self: LocalTier, path: str, data: memoryview, *args: Any, **kwargs: Any) -> None:
            if "step-000000000020" in path and path.endswith(".shard"):
                half = memoryview(bytes(data))[: len(data) // 2]
                with open(path, "wb") as f:  # leave half a shard behind, then die
                    f.write(half)
                os.kill(os.getpid(), signal.SIGKILL)
            real(self, path, data, *args, **kwargs)

        LocalTier.write_file = dying  # type: ignore[method-assign]
    train(state, 1)
    t0 = time.monotonic()
    handle = ck.save(20, saved_view(state))
    try:
        handle.wait()
        out["step20"] = "committed"
    except tiercheck.TiercheckError as exc:
        out["step20"] = f"{type(exc).__name__}: {exc}"
    out["waited_s"] = time.monotonic() - t0
    out["local_steps"] = ck.steps("local")
    out["remote_steps"] = ck.steps("remote")
    try:
        ck.close()
    except tiercheck.TiercheckError as exc:
        out["close_error"] = str(exc)
    return out


@scenario
def restore_after_kill(rank: int, world: int, root: str) -> dict[str, Any]:
    state = make_state(rank, seed=5)
    zero(state)
    ck = tiercheck.Checkpointer(
        **tiers(root, rank, "nodelocal"), replicated=("model", "optimizer"), coordination_timeout=30
    )
    view = saved_view(state)
    out: dict[str, Any] = {"restored_step": ck.restore(view)}
    out["digest"] = digest(view)
    ck.save(30, view).wait()  # the job goes on; leftovers of the failed step are swept
    ck.close()
    return out


@scenario
def one_rank_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 20 fails on rank 1 only (MR_FAIL=state: save() raises on a bad value;
    MR_FAIL=disk: its tier-1 write hits ENOSPC). The other ranks must learn it at once, not
    at the 60 s timeout, and the job goes on: step 30 commits everywhere."""
    how = os.environ["MR_FAIL"]
    state = make_state(rank)
    ck = tiercheck.Checkpointer(
        **tiers(root, rank, "nodelocal"), replicated=("model", "optimizer"), coordination_timeout=60
    )
    train(state, 1)
    ck.save(10, saved_view(state)).wait()
    out: dict[str, Any] = {}
    view = saved_view(state)
    if rank == 1 and how == "state":
        view["bad"] = object()
    if rank == 1 and how == "disk":
        real = LocalTier.write_file

        def full(self: LocalTier, path: str, data: memoryview, *args: Any, **kwargs: Any) -> None:
            if "step-000000000020" in path:
                raise OSError(28, "No space left on device", path)
            real(self, path, data, *args, **kwargs)

        LocalTier.write_file = full  # type: ignore[method-assign]
    t0 = time.monotonic()
    try:
        handle = ck.save(20, view)
        out["local20"] = "ok"
        try:
            handle.wait("local")
        except tiercheck.TiercheckError as exc:
            out["local20"] = f"{type(exc).__name__}: {exc}"
        try:
            handle.wait("remote")
            out["remote20"] = "ok"
        except tiercheck.TiercheckError as exc:
            out["remote20"] = f"{type(exc).__name__}: {exc}"
    except tiercheck.TiercheckError as exc:
        out["save20"] = f"{type(exc).__name__}: {exc}"
    out["waited_s"] = time.monotonic() - t0
    train(state, 1)
    try:
        ck.save(30, saved_view(state)).wait()
    except tiercheck.TiercheckError as exc:  # rank 1 sees its own disk error once, here
        out["save30_error"] = f"{type(exc).__name__}: {exc}"
        ck.save(30, saved_view(state)).wait()
    out["saved_30"] = digest(saved_view(state))
    ck.wait()
    out["local_steps"] = ck.steps("local")
    out["remote_steps"] = ck.steps("remote")
    zero(state)
    view = saved_view(state)
    out["restored_step"] = ck.restore(view)
    out["restored"] = digest(view)
    ck.close()
    return out


@scenario
def fsdp(rank: int, world: int, root: str) -> dict[str, Any]:
    """FSDP2 (fully_shard) on CPU: parameters and optimizer state are DTensors; each rank
    saves the piece it holds and restores it in place, bit-exact."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        loss = model(torch.randn(8, 16, generator=gen)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = {"model": model, "optimizer": opt}
    local_shapes = [tuple(p.to_local().shape) for p in model.parameters()]
    ck = tiercheck.Checkpointer(local=f"{root}/node{rank}", remote=f"file://{root}/remote", coordination_timeout=30)
    ck.save(5, state).wait()
    saved = digest({"m": {k: v.to_local() for k, v in model.state_dict().items()}, "o": opt.state_dict()})
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().zero_()
    out: dict[str, Any] = {"restored_step": ck.restore(state), "shapes": local_shapes}
    out["restored"] = digest({"m": {k: v.to_local() for k, v in model.state_dict().items()}, "o": opt.state_dict()})
    out["saved"] = saved
    ck.close()
    return out


@scenario
def preempt_one(rank: int, world: int, root: str) -> dict[str, Any]:
    """Train in lockstep (a DDP model: an all-reduce every step) with `maybe_save` and a save
    policy that is never due by itself; the test sends SIGTERM to rank 1 alone. Every rank
    must save the same fresh step; rank 1 drains it and dies of its SIGTERM; the others stop
    (`preempted`) and report. Progress lines go to DIR/progress-RANK for the test to watch."""
    state = make_state(rank)
    ck = tiercheck.Checkpointer(
        **tiers(root, rank, "node"),
        keep_local=None,
        replicated=("model", "optimizer"),
        interval=tiercheck.Every(steps=10_000),
        coordination_timeout=60,
    )
    ck.install_sigterm_handler(grace_s=60, fresh=True)
    saved: list[int] = []
    step = 0
    with open(os.path.join(root, f"progress-{rank}"), "a", buffering=1) as progress:
        for step in range(1, 10_000):
            train(state, 1)
            state["position"] = step
            progress.write(f"{step}\n")
            if ck.maybe_save(step, saved_view(state)) is not None:
                saved.append(step)
            if ck.preempted:
                break
            time.sleep(0.01)
    out = {"saved": saved, "preempted": ck.preempted, "last_step": step, "digest": digest(saved_view(state))}
    ck.close()
    return out


@scenario
def rollback(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save 10, 20, 30; restore 10 and save 20 again: one rank per directory deletes the
    abandoned 20 and 30 (through the pruner) before the new branch's 20 is written."""
    layout = os.environ.get("MR_LAYOUT", "shared")
    state = make_state(rank)
    ck = tiercheck.Checkpointer(
        **tiers(root, rank, layout), keep_local=None, replicated=("model", "optimizer"), coordination_timeout=30
    )
    for step in (10, 20, 30):
        train(state, 2)
        ck.save(step, saved_view(state)).wait()
    ck.wait()
    zero(state)
    out: dict[str, Any] = {"restored_step": ck.restore(saved_view(state), step=10)}
    train(state, 1)  # the new branch differs from the abandoned one
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.save(20, saved_view(state)).wait()
    ck.wait()
    out["warnings"] = [str(w.message) for w in caught]
    out["saved"] = digest(saved_view(state))
    out["local_steps"], out["remote_steps"] = ck.steps("local"), ck.steps("remote")
    zero(state)
    view = saved_view(state)
    out["latest"] = ck.restore(view)
    out["restored"] = digest(view)
    ck.close()
    return out


def main() -> None:
    name, rank, world, port, root = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = SCENARIOS[name](rank, world, root)
    finally:
        pass
    with open(os.path.join(root, f"result-{name}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
