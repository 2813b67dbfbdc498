"""Multi-rank (DDP) training loop checkpointed with tiercheck, run under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --ckpt DIR \
        [--remote URL] [--steps N] [--every K] [--kill-at STEP] [--kill-rank R] [--per-rank-dirs]

Every rank builds the same `tiercheck.Checkpointer` and calls `save` with the same steps.
The DDP model and optimizer are identical on every rank, so they are `replicated`: written
once per tier-1 directory (spread over the ranks sharing it) and once on tier 2. The RNG
state (dropout) and the data sampler's position differ per rank and are saved per rank.
`restore` is collective: all ranks resume from the same step. Tier 1 is `DIR/node-local`
(shared by the ranks of this node), or `DIR/rank<r>` with --per-rank-dirs (one "node-local
disk" per rank); tier 2 (--remote, e.g. file:///tmp/t2) is shared by all ranks.

Each step prints `step N rank R loss X` on every rank. The run is deterministic, so a
run that is killed (--kill-at: rank R SIGKILLs itself right after queueing the save of
step STEP) and restarted prints the same lines, after the resume point, as a run that
was never interrupted. Gloo on CPU; NCCL when there is one GPU per local rank.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tiercheck

N_SAMPLES, IN_DIM, HIDDEN, BATCH = 2048, 16, 64, 32


class ShardedSampler:
    """This rank's share of a per-epoch shuffle, with a resumable position (what
    `DistributedSampler` plus a data-loader position amounts to)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size, self.epoch, self.pos = rank, world_size, 0, 0

    def next_batch(self) -> torch.Tensor:
        mine = torch.randperm(N_SAMPLES, generator=torch.Generator().manual_seed(self.epoch))
        mine = mine[self.rank :: self.world_size]
        if self.pos + BATCH > len(mine):
            self.epoch, self.pos = self.epoch + 1, 0
            return self.next_batch()
        self.pos += BATCH
        return mine[self.pos - BATCH : self.pos]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def say(line: str) -> None:
    """One write per line, so the ranks' lines do not interleave on a shared stdout."""
    print(line + "\n", end="", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint root; tier 1 lives under it")
    p.add_argument("--remote", default=None, help="tier 2 URL shared by all ranks (file://, s3://, ...)")
    p.add_argument("--steps", type=int, default=40, help="total training steps")
    p.add_argument("--every", type=int, default=5, help="checkpoint every K steps")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL after queueing step STEP's save")
    p.add_argument("--kill-rank", type=int, default=1, help="the rank that kills itself; -1: every rank")
    p.add_argument("--per-rank-dirs", action="store_true", help="tier 1 in DIR/rank<r> instead of DIR/node-local")
    args = p.parse_args()

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    data = torch.Generator().manual_seed(1234)  # the same synthetic regression set on every rank
    x = torch.randn(N_SAMPLES, IN_DIM, generator=data)
    y = torch.sin(x @ torch.randn(IN_DIM, 1, generator=data) / IN_DIM**0.5)
    x, y = x.to(device), y.to(device)
    torch.manual_seed(0)  # identical initial weights (DDP also broadcasts rank 0's)
    net = nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.ReLU(), nn.Dropout(0.1), nn.Linear(HIDDEN, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(100 + rank)  # dropout masks differ per rank
    sampler = ShardedSampler(rank, world)

    def rng_state() -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state(), **({"cuda": torch.cuda.get_rng_state()} if use_cuda else {})}

    state: dict[str, object] = {"model": model.module, "optimizer": opt, "rng": rng_state(), "step": 0, "data": sampler}
    local = os.path.join(args.ckpt, f"rank{rank}" if args.per_rank_dirs else "node-local")
    with tiercheck.Checkpointer(
        local=local, remote=args.remote, keep_local=3, replicated=("model", "optimizer"), coordination_timeout=60
    ) as ckpt:
        restored = ckpt.restore(state)  # collective: every rank gets the same step (or None)
        start = 1
        if restored is not None:
            torch.set_rng_state(state["rng"]["cpu"])  # type: ignore[index]
            if use_cuda:
                torch.cuda.set_rng_state(state["rng"]["cuda"])  # type: ignore[index]
            start = restored + 1
            say(f"rank {rank}: resumed from step {restored} (data position {sampler.state_dict()})")

        loss_fn = nn.MSELoss()
        for step in range(start, args.steps + 1):
            idx = sampler.next_batch().to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()  # DDP averages the gradients over the ranks
            opt.step()
            say(f"step {step} rank {rank} loss {loss.item():.8f}")
            if step % args.every == 0:
                state["step"], state["rng"] = step, rng_state()
                ckpt.save(step, state)  # returns once copied to host memory; written in the background
            if step == args.kill_at and args.kill_rank in (rank, -1):
                say(f"rank {rank}: SIGKILL at step {step}")
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: no cleanup, saves cut off mid-write
        ckpt.wait()
        if rank == 0:
            say(f"done; committed steps: {ckpt.steps()}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
