"""Deterministic CPU training loop checkpointed with tiercheck.

A small MLP (with dropout) is trained with Adam + StepLR on a synthetic regression
dataset. Every ``--every`` steps the full training state is handed to
``tiercheck.Checkpointer.save``, which returns as soon as the state is copied into host
memory and persists it in the background: to ``--dir`` (tier 1) and, with ``--remote``,
to an object store (tier 2, e.g. ``s3://bucket/run``). On start the script calls
``Checkpointer.restore``; if a checkpoint exists on either tier it resumes from the step
after it. Once a save is durable everywhere it prints what it cost: the stall, the time
to durable on each tier (``handle.stats``), and, for comparison, how long ``torch.save``
of the same state (with flush and fsync, in the same loop) blocks training.

Determinism: the dataset comes from a fixed seed, each step's mini-batch is a pure
function of the step number, and the only other randomness (dropout, drawn from torch's
global RNG) is covered by the checkpointed RNG state. So a run that is killed and
resumed prints exactly the same ``step N loss X`` lines as an uninterrupted run.

    python examples/train_demo.py --fresh          # start over
    python examples/train_demo.py                  # resume if a checkpoint exists
    python examples/train_demo.py --remote s3://bucket/run --endpoint-url http://127.0.0.1:8333
                                                   # both tiers (credentials: AWS_* variables)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import torch
from torch import nn

import tiercheck

DATA_SEED = 1234
INIT_SEED = 0
N_SAMPLES = 2048
IN_DIM = 16
HIDDEN = 64
BATCH = 64


def make_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data: y = sin(x @ a) + 0.5 * tanh(x @ b) + noise."""
    g = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(N_SAMPLES, IN_DIM, generator=g)
    a = torch.randn(IN_DIM, 1, generator=g) / IN_DIM**0.5
    b = torch.randn(IN_DIM, 1, generator=g) / IN_DIM**0.5
    y = torch.sin(x @ a) + 0.5 * torch.tanh(x @ b) + 0.05 * torch.randn(N_SAMPLES, 1, generator=g)
    return x, y


def batch_indices(step: int) -> torch.Tensor:
    """Mini-batch for ``step``: a pure function of the step number."""
    g = torch.Generator().manual_seed(DATA_SEED * 1_000_003 + step)
    return torch.randint(0, N_SAMPLES, (BATCH,), generator=g)


def make_model(hidden: int = HIDDEN) -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_DIM, hidden),
        nn.ReLU(),
        nn.Dropout(p=0.1),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 1),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="demo_ckpt", help="local checkpoint directory")
    p.add_argument("--steps", type=int, default=60, help="total training steps")
    p.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    p.add_argument("--sleep", type=float, default=0.05, help="seconds to sleep per step")
    p.add_argument("--fresh", action="store_true", help="delete --dir before starting")
    p.add_argument("--remote", default=None, help="tier 2: an fsspec URL (s3://bucket/run)")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint for --remote (credentials: AWS_* env)")
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden width (the state grows with its square)")
    p.add_argument(
        "--memory-dir",
        default=None,
        help="tier 0: host buffers as files in this shared-memory directory (e.g. under /dev/shm); a process "
        "restarted with the same --job-id restores from it first",
    )
    p.add_argument("--job-id", default=None, help="the job's identity for tier 0 (default: from the tier-1 path)")
    p.add_argument("--no-stats", action="store_true", help="do not print per-save costs")
    return p.parse_args(argv)


def torch_save_stall(state: dict[str, object], directory: str) -> float:
    """Seconds `torch.save` of the same state dicts (+ flush + fsync) blocks the caller."""
    plain = {k: (v.state_dict() if hasattr(v, "state_dict") else v) for k, v in state.items()}
    fd, path = tempfile.mkstemp(prefix=".torch_save-", suffix=".pt", dir=directory)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            torch.save(plain, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    finally:
        os.unlink(path)


TIER_NUMBER = {"memory": 0, "local": 1, "remote": 2}


class RestoreEvent(logging.Handler):
    """Keeps the `restore` event tiercheck logs on `tiercheck.events`: which tier, how long."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.event: dict[str, object] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(record.getMessage())
        except ValueError:
            return
        if event.get("event") == "restore":
            self.event = event


def report(step: int, handle: tiercheck.SaveHandle, torch_save_s: float) -> None:
    """One line per save, once it is durable on every tier."""
    st = handle.stats
    tiers = ", ".join(f"tier {TIER_NUMBER.get(t, t)} ({t}) {st.tier_s[t] * 1e3:.0f} ms" for t in handle.tiers)
    print(
        f"  save {step}: {st.bytes / 2**20:.1f} MiB, stall {st.stall_s * 1e3:.1f} ms | durable on {tiers} "
        f"| torch.save would stall {torch_save_s * 1e3:.0f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.every < 1:
        raise SystemExit("--every must be >= 1")
    if args.fresh:
        shutil.rmtree(args.dir, ignore_errors=True)

    # Bit-exact reproducibility across processes: single thread, deterministic kernels.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(INIT_SEED)

    x, y = make_dataset()
    model = make_model(args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)
    loss_fn = nn.MSELoss()

    # The template handed to save()/restore(). Stateful objects are saved through
    # state_dict() and restored through load_state_dict(); tensors are restored in place;
    # plain values ("step") are written back into this mapping.
    state: dict[str, object] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "rng": {"torch": torch.get_rng_state()},
        "step": 0,
    }

    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    # Tier 0 (--memory-dir): the host buffers saves copy into are files in shared memory; each
    # step is committed there before tier 1. They outlive the process (not the node), so a
    # restarted process with the same job id restores from memory first.
    tier0 = {"memory": True, "memory_dir": args.memory_dir, "job_id": args.job_id} if args.memory_dir else {}
    events = logging.getLogger("tiercheck.events")
    restore_event = RestoreEvent()
    events.addHandler(restore_event)
    events.setLevel(logging.INFO)
    with tiercheck.Checkpointer(
        local=args.dir, remote=args.remote, storage_options=options, keep_local=3, keep_remote=3, **tier0
    ) as ckpt:
        restored = ckpt.restore(state)
        events.removeHandler(restore_event)
        start = 1
        if restored is not None:
            if state["step"] != restored:
                raise RuntimeError(f"restore returned {restored} but state['step'] is {state['step']}")
            torch.set_rng_state(state["rng"]["torch"])  # type: ignore[index]
            start = restored + 1
            print(f"resumed from step {restored}", flush=True)
            ev = restore_event.event
            if ev is not None:
                tier = str(ev["tier"])
                where = {"memory": args.memory_dir, "local": args.dir, "remote": args.remote}.get(tier)
                print(
                    f"  restored from tier {TIER_NUMBER.get(tier, tier)} ({tier}: {where}) "
                    f"in {float(ev['seconds']) * 1e3:.1f} ms",  # type: ignore[arg-type]
                    flush=True,
                )
        pending: list[tuple[int, tiercheck.SaveHandle, float]] = []
        stats_dir = os.path.dirname(os.path.abspath(args.dir))

        model.train()
        for step in range(start, args.steps + 1):
            idx = batch_indices(step)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            scheduler.step()
            print(f"step {step} loss {loss.item():.8f}", flush=True)

            if step % args.every == 0:
                state["step"] = step
                state["rng"] = {"torch": torch.get_rng_state()}
                # Returns once the state is in host memory; persisting happens in the
                # background while training continues (and mutates the parameters).
                handle = ckpt.save(step, state)
                print(f"  checkpoint {step} queued", flush=True)
                if not args.no_stats:
                    pending.append((step, handle, torch_save_stall(state, stats_dir)))
            while pending and pending[0][1].done():
                report(*pending.pop(0))

            if args.sleep > 0:
                time.sleep(args.sleep)

        ckpt.wait()
        for item in pending:
            report(*item)
        where = f"; remote: {ckpt.steps('remote')}" if args.remote else ""
        if args.memory_dir:
            where = f"; memory: {ckpt.steps('memory')}" + where
        print(f"done; local checkpoints: {ckpt.steps('local')}{where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
