"""The training loop of the stall benchmark (benchmarks/stall/stall.py): an MLP or a small
decoder-only transformer with Adam on synthetic data, and a trainer that timestamps every
step (wall and CPU seconds) so that the cost of a save can be read off the steps around it."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.common import GIB

now = time.perf_counter


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, pre-norm blocks, LM head."""

    def __init__(self, vocab: int, d_model: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, max(1, d_model // 64), 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


@dataclasses.dataclass
class Workload:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[], torch.Tensor]
    description: str
    params: int


def build_workload(args: argparse.Namespace, device: torch.device) -> Workload:
    """A model whose fp32 params + Adam moments come to about ``--size-gib``."""
    torch.manual_seed(args.seed)
    n_params = max(int(args.size_gib * GIB / 12), 1000)  # 4 B param + 8 B Adam moments
    model: nn.Module
    if args.model == "mlp":
        depth = args.depth
        width = args.width or max(64, round(math.sqrt(n_params / depth) / 64) * 64)
        model = MLP(width, depth)
        x = torch.randn(args.batch, width, device=device)
        y = torch.randn(args.batch, width, device=device)

        def loss_fn() -> torch.Tensor:
            return ((model(x) - y) ** 2).mean()

        desc = f"MLP {depth} x Linear({width}, {width}) + GELU, batch {args.batch}"
    else:
        layers, vocab, seq = args.depth, args.vocab, args.seq
        # 12 L d^2 (attention + 4x MLP) + 2 V d (embedding + head) = n_params
        a, b = 12 * layers, 2 * vocab
        d = (-b + math.sqrt(b * b + 4 * a * n_params)) / (2 * a)
        d_model = args.width or max(64, round(d / 64) * 64)
        model = TinyGPT(vocab, d_model, layers, seq)
        idx = torch.randint(0, vocab, (args.batch, seq + 1), device=device)

        def loss_fn() -> torch.Tensor:
            logits = model(idx[:, :-1])
            return nn.functional.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))

        desc = (
            f"decoder-only transformer: {layers} layers, d_model {d_model}, {max(1, d_model // 64)} heads, "
            f"vocab {vocab}, seq {seq}, batch {args.batch}"
        )
    model.to(device)
    kw: dict[str, Any] = {}
    if args.optim == "adam-fused":
        kw["fused"] = True
    elif args.optim == "adam-foreach":
        kw["foreach"] = True
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-6, **kw)
    except (RuntimeError, TypeError):  # fused Adam not supported here
        opt = torch.optim.Adam(model.parameters(), lr=1e-6)
    params = sum(p.numel() for p in model.parameters())
    return Workload(model, opt, loss_fn, desc + f", {args.optim}", params)


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor a checkpoint of (model, optimizer) holds, once each."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    tensors = list(model.state_dict().values())
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        if t.data_ptr() in seen and t.numel():
            continue
        seen.add(t.data_ptr())
        out.append(t)
    return out


# --------------------------------------------------------------------------- training loop


@dataclasses.dataclass(slots=True)
class StepRec:
    t0: float  # step start
    tw0: float  # wait before optimizer.step() started
    tw1: float  # ... and ended
    t1: float  # step end (optimizer.step() returned; CUDA synchronised)
    c0: float = 0.0  # CPU seconds of this process and its children at the start
    c1: float = 0.0  # ... and at the end

    @property
    def cpu(self) -> float:
        return self.c1 - self.c0

    @property
    def dur(self) -> float:
        return self.t1 - self.t0

    @property
    def wait(self) -> float:
        return self.tw1 - self.tw0


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_now() -> float:
    """CPU seconds (user + system) used so far by this process and its live child processes
    (DCP's PROCESS executor writes from one)."""
    t = os.times()
    total = t.user + t.system
    import multiprocessing

    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{child.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


class Trainer:
    def __init__(self, w: Workload, device: torch.device) -> None:
        self.w = w
        self.cuda = device.type == "cuda"
        self.steps: list[StepRec] = []

    def step(self, before_opt: Callable[[], None] | None = None) -> StepRec:
        c0 = cpu_now()
        t0 = now()
        opt = self.w.optimizer
        opt.zero_grad(set_to_none=False)
        self.w.loss_fn().backward()
        if self.cuda:
            torch.cuda.synchronize()
        tw0 = now()
        if before_opt is not None:
            before_opt()
        tw1 = now()
        opt.step()
        if self.cuda:
            torch.cuda.synchronize()
        t1 = now()
        rec = StepRec(t0, tw0, tw1, t1, c0, cpu_now())
        self.steps.append(rec)
        return rec
