#!/usr/bin/env python3
"""Lost training time per save: what a checkpoint really costs a training loop.

A real training loop (an MLP or a small decoder-only transformer, Adam, synthetic data;
CPU, or CUDA when present) checkpoints every ``--every`` steps. The method used for each
save rotates through the methods under test, so every method sees the same state, the
same process and the same machine noise (interleaved, order rotated every repeat).

For each save it records, from per-step timestamps:

* **stall**: time the loop is blocked in the save call, plus any wait the method adds
  before the next ``optimizer.step()`` (DCP's ``staging_completion``, tiercheck's
  ``handle.wait_staged()`` for an overlapped save);
* **durable**: from the save call to the checkpoint being durable (fsynced) on disk;
* **steps/s during the background write** against the loop's baseline steps/s (the
  median step time of the clean steps just before the save);
* **lost training seconds** = wall time of the window from the save call to the end of
  the ``--tail-steps``-th step after durable, minus (steps in that window x baseline step
  time). That is the stall plus the integrated slowdown of the steps that overlapped the
  background write (slowdown = lost - stall).

Methods (``--methods``, default all):

  none                no checkpoint: the same accounting on a window of clean steps,
                      i.e. the noise floor of "lost seconds"
  memcpy              blocking copy of every tensor into one preallocated, pre-faulted
                      buffer (torch ``copy_``, intra-op threads): the floor for a stall
  odirect_writer      that copy, then a ~60-line writer thread: O_DIRECT writes of
                      ``--odirect-block`` bytes from the aligned buffer, fsync
  tiercheck           ``Checkpointer.save(step, state)`` then ``handle.wait()``
  tiercheck_overlap   ``save(step, state, overlap=True)``; ``handle.wait_staged()`` before
                      the next optimizer step
  tiercheck_normal_prio
                      (not in the default set) ``Checkpointer(low_priority=False)``: the
                      writer threads keep the training loop's CPU/IO priority
  torch_save          ``torch.save`` of the state dicts + flush + fsync (blocking)
  dcp_save            ``torch.distributed.checkpoint.save`` (blocking)
  dcp_async_thread    ``dcp.async_save``, THREAD executor, a reused ``DefaultStager``
                      with async staging (wait for ``staging_completion`` before the next
                      optimizer step)
  dcp_async_thread_sync
                      the same with ``use_async_staging=False`` (copy before returning)
  dcp_async_process   PROCESS executor, reused ``DefaultStager`` with shared memory and
                      async staging (needs a process group: a 1-rank gloo group is made)
  torchsnapshot       ``Snapshot.async_take`` then ``wait()`` (+ fsync of its files, as it
                      never fsyncs), if ``torchsnapshot`` imports

Outputs: JSON (every sample and every step's timestamps), a markdown table, and PNG
timelines (training throughput around the save, per method, plus an overview) when
matplotlib is installed.

Usage::

    python benchmarks/stall.py --quick                       # ~1 minute smoke run
    python benchmarks/stall.py --size-gib 1 --repeats 7 --out bench_out/stall --img-dir docs/img
    python benchmarks/stall.py --model transformer --size-gib 1
    tiercheck bench --quick                                  # same script, from a checkout
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import gc
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

ALL_METHODS = (
    "none",
    "memcpy",
    "odirect_writer",
    "tiercheck",
    "tiercheck_overlap",
    "torch_save",
    "dcp_save",
    "dcp_async_thread",
    "dcp_async_thread_sync",
    "dcp_async_process",
    "torchsnapshot",
)
DCP_METHODS = ("dcp_save", "dcp_async_thread", "dcp_async_thread_sync", "dcp_async_process")
TIERCHECK_METHODS = ("tiercheck", "tiercheck_overlap")

now = time.perf_counter


class Unavailable(Exception):
    """A method cannot run here (missing package, no O_DIRECT, ...); the reason is reported."""


# --------------------------------------------------------------------------- models


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


# --------------------------------------------------------------------------- methods


class Pending:
    """One save in flight."""

    def __init__(
        self,
        wait_durable: Callable[[], None] | None,
        before_step: Callable[[], None] | None = None,
        cleanup: Callable[[], None] | None = None,
        info: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.wait_durable = wait_durable  # None: durable when the call returned (or never)
        self.before_step = before_step  # a wait the loop must do before the next optimizer.step()
        self.cleanup = cleanup
        self.info = info


class Ctx:
    """What the methods share: the workload, the target dir, buffers, lazily made objects."""

    def __init__(self, args: argparse.Namespace, w: Workload, root: Path, device: torch.device) -> None:
        self.args = args
        self.w = w
        self.root = root
        self.device = device
        self.tensors = state_tensors(w.model, w.optimizer)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors)
        self.counter = 0
        self.notes: list[str] = []
        self._plain: PlainBuffer | None = None
        self._tc: Any = None
        self.pg_owned = False

    def fresh(self, stem: str) -> Path:
        self.counter += 1
        return self.root / f"{stem}-{self.counter}"

    def state_dicts(self) -> dict[str, Any]:
        return {"model": self.w.model.state_dict(), "optim": self.w.optimizer.state_dict()}

    def plain(self) -> PlainBuffer:
        if self._plain is None:
            self._plain = PlainBuffer(self.tensors, self.device.type == "cuda")
        return self._plain

    def tiercheck(self) -> Any:
        if self._tc is None:
            import tiercheck

            self._tc = tiercheck.Checkpointer(local=str(self.root / "tiercheck"), keep_local=1)
            self._tc.prepare({"model": self.w.model, "optim": self.w.optimizer})
        return self._tc

    def ensure_process_group(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            raise Unavailable("torch.distributed is not available")
        if not dist.is_initialized():
            store = dist.FileStore(str(self.root / "pg-store"), 1)
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
            self.pg_owned = True

    def close(self) -> None:
        if self._tc is not None:
            with contextlib.suppress(Exception):
                self._tc.close()
            self._tc = None
        self._plain = None
        if self.pg_owned:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            self.pg_owned = False


class PlainBuffer:
    """One page-aligned, pre-faulted host buffer (pinned on CUDA) with a view per tensor."""

    def __init__(self, tensors: Sequence[torch.Tensor], pinned: bool) -> None:
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.nbytes = total
        self.padded = max(ALIGN, -(-total // ALIGN) * ALIGN)
        self._mm: mmap.mmap | None = None
        if pinned:
            self.buf = torch.empty(self.padded, dtype=torch.uint8, pin_memory=True)
        else:
            self._mm = mmap.mmap(-1, self.padded)
            self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.buf.fill_(0)  # fault every page in now, outside any timed region
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                self.pairs.append((self.buf[off : off + n].view(t.dtype).view(t.shape), t))
            off += n

    def copy(self) -> None:
        non_blocking = self.buf.is_pinned()
        for dst, src in self.pairs:
            dst.copy_(src, non_blocking=non_blocking)
        if non_blocking:
            torch.cuda.synchronize()


def odirect_write(buf: torch.Tensor, path: Path, block: int) -> bool:
    """Write `buf` (page-aligned, length a multiple of 4 KiB) with O_DIRECT, fsync file and dir.

    Returns False if the filesystem refused O_DIRECT (then written buffered + fsync).
    """
    mv = memoryview(buf.numpy()).cast("B")
    direct = bool(O_DIRECT)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct = False
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off, n = 0, len(mv)
        while off < n:
            off += os.write(fd, mv[off : off + block])
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return direct


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        dfd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def rm(path: Path) -> Callable[[], None]:
    def go() -> None:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)

    return go


class Method:
    name = ""
    description = ""
    durable = True  # False: no checkpoint is made (baselines "none", "memcpy")

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx

    def setup(self) -> None:
        """Raise Unavailable if this method cannot run here."""

    def save(self, step: int) -> Pending:
        raise NotImplementedError

    def close(self) -> None:
        pass


class NoSave(Method):
    name = "none"
    description = "no checkpoint (noise floor of the lost-time estimate)"
    durable = False

    def save(self, step: int) -> Pending:
        return Pending(None)


class Memcpy(Method):
    name = "memcpy"
    description = "blocking copy into a preallocated pre-faulted buffer (torch copy_, 2 threads)"
    durable = False

    def setup(self) -> None:
        self.ctx.plain()

    def save(self, step: int) -> Pending:
        self.ctx.plain().copy()
        return Pending(None)


class ODirectWriter(Method):
    name = "odirect_writer"
    description = "that copy, then a writer thread: O_DIRECT writes from the aligned buffer + fsync"

    def setup(self) -> None:
        if not O_DIRECT:
            raise Unavailable("os.O_DIRECT is not available on this platform")
        self.ctx.plain()
        self.fell_back = False

    def save(self, step: int) -> Pending:
        plain = self.ctx.plain()
        plain.copy()
        path = self.ctx.fresh("odirect.bin")
        done = threading.Event()
        err: list[BaseException] = []

        def write() -> None:
            try:
                if not odirect_write(plain.buf, path, self.ctx.args.odirect_block):
                    self.fell_back = True
            except BaseException as e:
                err.append(e)
            finally:
                done.set()

        threading.Thread(target=write, name="odirect-writer", daemon=True).start()

        def wait() -> None:
            done.wait()
            if err:
                raise err[0]

        return Pending(wait, cleanup=rm(path))


class TiercheckSave(Method):
    overlap = False

    def setup(self) -> None:
        try:
            self.ctx.tiercheck()
        except ImportError as e:
            raise Unavailable(f"import tiercheck failed: {e}") from e

    def checkpointer(self) -> Any:
        return self.ctx.tiercheck()

    def save(self, step: int) -> Pending:
        ckpt = self.checkpointer()
        h = ckpt.save(step, {"model": self.ctx.w.model, "optim": self.ctx.w.optimizer}, overlap=self.overlap)

        def info() -> dict[str, Any]:
            st = h.stats
            return {
                "tiercheck_stats": {
                    k: getattr(st, k, None)
                    for k in ("bytes", "stall_s", "buffer_wait_s", "stage_s", "background_stage_s", "tier_s")
                }
            }

        return Pending(h.wait, before_step=h.wait_staged if self.overlap else None, info=info)


class TiercheckNormalPriority(TiercheckSave):
    name = "tiercheck_normal_prio"
    description = "tiercheck save(), Checkpointer(low_priority=False): writer and checksum at the default I/O priority"

    def setup(self) -> None:
        import inspect

        try:
            import tiercheck
        except ImportError as e:
            raise Unavailable(f"import tiercheck failed: {e}") from e
        if "low_priority" not in inspect.signature(tiercheck.Checkpointer).parameters:
            raise Unavailable("this tiercheck has no low_priority option")
        self.ckpt = tiercheck.Checkpointer(local=str(self.ctx.root / "tiercheck-np"), keep_local=1, low_priority=False)
        self.ckpt.prepare({"model": self.ctx.w.model, "optim": self.ctx.w.optimizer})

    def checkpointer(self) -> Any:
        return self.ckpt

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ckpt.close()


class Tiercheck(TiercheckSave):
    name = "tiercheck"
    description = "tiercheck Checkpointer.save(), then handle.wait() (O_DIRECT writer thread, CRC-32C)"


class TiercheckOverlap(TiercheckSave):
    name = "tiercheck_overlap"
    description = "tiercheck save(overlap=True): params + Adam state copied after return; wait_staged() before step"
    overlap = True


class TorchSave(Method):
    name = "torch_save"
    description = "torch.save of the state dicts + flush + fsync (blocking)"

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh("torch_save.pt")
        with open(path, "wb") as f:
            torch.save(self.ctx.state_dicts(), f)
            f.flush()
            os.fsync(f.fileno())
        return Pending(None, cleanup=rm(path))


class DCPSave(Method):
    name = "dcp_save"
    description = "torch.distributed.checkpoint.save (blocking; FileSystemWriter fsyncs)"

    def setup(self) -> None:
        try:
            import torch.distributed.checkpoint as dcp
        except ImportError as e:
            raise Unavailable(f"torch.distributed.checkpoint: {e}") from e
        self.dcp = dcp

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh("dcp_save")
        self.dcp.save(self.ctx.state_dicts(), checkpoint_id=str(path))
        return Pending(None, cleanup=rm(path))


class DCPAsync(Method):
    process = False
    async_staging = True
    shared_memory = False

    def setup(self) -> None:
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        except ImportError as e:
            raise Unavailable(f"DCP async pieces missing in torch {torch.__version__}: {e}") from e
        self.dcp = dcp
        self.kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        if self.process:
            self.ctx.ensure_process_group()
        cuda = self.ctx.device.type == "cuda"
        # Best options the installed torch offers: pinned memory and non-blocking copies need
        # an accelerator; shared memory is what the PROCESS executor needs to skip a copy.
        self.options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=self.shared_memory,
            use_async_staging=self.async_staging,
            use_non_blocking_copy=cuda,
        )
        self.stager = DefaultStager(self.options)  # reused: its staging buffers are cached

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh(self.name)
        r = self.dcp.async_save(
            self.ctx.state_dicts(),
            checkpoint_id=str(path),
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        staging = getattr(r, "staging_completion", None)
        upload = getattr(r, "upload_completion", r)
        before = None if staging is None else staging.result
        return Pending(upload.result, before_step=before, cleanup=rm(path))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stager.close()


class DCPAsyncThread(DCPAsync):
    name = "dcp_async_thread"
    description = "dcp.async_save, THREAD executor, reused DefaultStager (async staging)"


class DCPAsyncThreadSync(DCPAsync):
    name = "dcp_async_thread_sync"
    description = "dcp.async_save, THREAD executor, reused DefaultStager (staging before return)"
    async_staging = False


class DCPAsyncProcess(DCPAsync):
    name = "dcp_async_process"
    description = "dcp.async_save, PROCESS executor, reused DefaultStager (shared memory, async staging)"
    process = True
    shared_memory = True


class TorchSnapshot(Method):
    name = "torchsnapshot"
    description = "torchsnapshot Snapshot.async_take, wait(), fsync of its files (it never fsyncs)"

    def setup(self) -> None:
        try:
            from torchsnapshot import Snapshot
        except Exception as e:  # ImportError, or a broken install against this torch
            raise Unavailable(f"torchsnapshot does not import: {type(e).__name__}: {e}") from e
        self.Snapshot = Snapshot

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh("torchsnapshot")
        pending = self.Snapshot.async_take(
            path=str(path), app_state={"model": self.ctx.w.model, "optim": self.ctx.w.optimizer}
        )

        def wait() -> None:
            pending.wait()
            fsync_tree(path)

        return Pending(wait, cleanup=rm(path))


METHOD_CLASSES: dict[str, type[Method]] = {
    c.name: c
    for c in (
        NoSave,
        Memcpy,
        ODirectWriter,
        Tiercheck,
        TiercheckOverlap,
        TiercheckNormalPriority,
        TorchSave,
        DCPSave,
        DCPAsyncThread,
        DCPAsyncThreadSync,
        DCPAsyncProcess,
        TorchSnapshot,
    )
}


# --------------------------------------------------------------------------- measurement


@dataclasses.dataclass
class SaveRecord:
    method: str
    repeat: int
    step: int
    t_call: float
    t_return: float
    t_durable: float | None
    baseline_step_s: float
    steps: list[StepRec]  # the window: steps after the call, through the tail steps
    pre_steps: list[StepRec]  # the clean steps the baseline came from
    extra: dict[str, Any]
    window_capped: bool = False
    c_call: float = 0.0  # process CPU seconds at the save call
    baseline_step_cpu_s: float = 0.0

    def metrics(self) -> dict[str, Any]:
        base = self.baseline_step_s
        call = self.t_return - self.t_call
        wait = sum(s.wait for s in self.steps)
        end = self.steps[-1].t1 if self.steps else self.t_return
        lost = (end - self.t_call) - len(self.steps) * base
        t_bg_end = self.t_durable if self.t_durable is not None else self.t_return
        bg = [s for s in self.steps if s.t0 < t_bg_end]
        bg_time = sum(s.dur for s in bg)
        rel = (len(bg) * base / bg_time) if bg and bg_time > 0 else None
        return {
            "call_s": call,
            "wait_s": wait,
            "stall_s": call + wait,
            "durable_s": None if self.t_durable is None else self.t_durable - self.t_call,
            "bg_s": None if self.t_durable is None else self.t_durable - self.t_return,
            "lost_s": lost,
            "cpu_s": (self.steps[-1].c1 if self.steps else self.c_call)
            - self.c_call
            - len(self.steps) * self.baseline_step_cpu_s,
            "slowdown_s": lost - call - wait,
            "window_steps": len(self.steps),
            "bg_steps": len(bg),
            "bg_rel_throughput": rel,
            "bg_steps_per_s": (len(bg) / bg_time) if bg and bg_time > 0 else None,
            "baseline_step_s": base,
            "baseline_steps_per_s": 1.0 / base if base > 0 else None,
            "baseline_step_cpu_s": self.baseline_step_cpu_s,
        }


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        dev = args.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        print(
            f"# building {args.model} (~{args.size_gib:g} GiB of params + Adam) on {self.device} ...", file=sys.stderr
        )
        self.w = build_workload(args, self.device)
        self.trainer = Trainer(self.w, self.device)
        for _ in range(2):  # Adam state exists from the first step on
            self.trainer.step()
        self.ctx = Ctx(args, self.w, root, self.device)
        self.methods: list[Method] = []
        self.unavailable: dict[str, str] = {}
        self.failed: dict[str, str] = {}
        self.records: list[SaveRecord] = []
        self.step = 0
        self.t_start = now()

    def setup_methods(self) -> None:
        for name in self.args.methods:
            m = METHOD_CLASSES[name](self.ctx)
            try:
                m.setup()
            except Unavailable as e:
                self.unavailable[name] = str(e)
                print(f"# {name}: unavailable: {e}", file=sys.stderr)
                continue
            except Exception as e:
                self.unavailable[name] = f"setup failed: {type(e).__name__}: {e}"
                print(f"# {name}: setup failed:\n{traceback.format_exc()}", file=sys.stderr)
                continue
            self.methods.append(m)

    def clean_steps(self, n: int) -> list[StepRec]:
        out = []
        for _ in range(n):
            out.append(self.trainer.step())
            self.step += 1
        return out

    def one_save(self, m: Method, repeat: int, record: bool) -> None:
        a = self.args
        gc.collect()
        pre = self.clean_steps(max(a.pre_steps, a.every - self._last_window))
        base = statistics.median(s.dur for s in pre[-a.pre_steps :][1:] or pre)
        self.step += 1
        step = self.step
        base_cpu = statistics.median(s.cpu for s in pre[-a.pre_steps :][1:] or pre)
        c_call = cpu_now()
        t_call = now()
        pending = m.save(step)
        t_return = now()
        durable_at: list[float] = []
        err: list[BaseException] = []
        done = threading.Event()
        watcher = None
        if pending.wait_durable is None:
            durable_at.append(t_return)  # nothing runs in the background
            done.set()
        else:
            wait_durable = pending.wait_durable

            def watch() -> None:
                try:
                    wait_durable()
                except BaseException as e:
                    err.append(e)
                finally:
                    durable_at.append(now())
                    done.set()

            watcher = threading.Thread(target=watch, name="durable-watcher", daemon=True)
            watcher.start()
        window: list[StepRec] = []
        before = pending.before_step
        tail = a.noise_steps if isinstance(m, NoSave) else a.tail_steps
        after_durable = 0
        capped = False
        while True:
            rec = self.trainer.step(before)
            before = None  # only the first optimizer.step() after the save needs the wait
            self.step += 1
            window.append(rec)
            if done.is_set() and durable_at and durable_at[0] <= rec.t0:
                after_durable += 1
            if after_durable >= tail:
                break
            if rec.t1 - t_call > a.max_window_s:
                capped = True
                done.wait()
                break
        if watcher is not None:
            watcher.join()
        info = pending.info() if pending.info else {}
        if pending.cleanup:
            pending.cleanup()
        self._last_window = len(window)
        if err:
            raise err[0]
        if record:
            t_d = durable_at[0] if (durable_at and m.durable) else None
            self.records.append(
                SaveRecord(
                    m.name,
                    repeat,
                    step,
                    t_call,
                    t_return,
                    t_d,
                    base,
                    window,
                    pre[-a.pre_steps :],
                    info,
                    capped,
                    c_call,
                    base_cpu,
                )
            )
            r = self.records[-1].metrics()
            dur = "   -   " if r["durable_s"] is None else f"{r['durable_s']:7.3f}"
            print(
                f"  {m.name:24s} stall {r['stall_s']:7.3f}s  durable {dur}s  lost {r['lost_s']:7.3f}s  "
                f"(base step {base:.3f}s, window {len(window)} steps)",
                file=sys.stderr,
            )

    def run(self) -> None:
        a = self.args
        self._last_window = 0
        self.setup_methods()
        print(f"# warm-up: {a.warmup_steps} steps, then one unrecorded save per method", file=sys.stderr)
        self.clean_steps(a.warmup_steps)
        for m in list(self.methods):
            self._guarded(m, -1, record=False)
        for r in range(a.repeats):
            ms = self.methods
            k = r % len(ms) if ms else 0
            order = ms[k:] + ms[:k]
            print(f"# repeat {r + 1}/{a.repeats}: {[m.name for m in order]}", file=sys.stderr)
            for m in order:
                if m in self.methods:
                    self._guarded(m, r, record=True)

    def _guarded(self, m: Method, repeat: int, record: bool) -> None:
        try:
            self.one_save(m, repeat, record)
        except Exception as e:
            self.failed[m.name] = f"{type(e).__name__}: {e}"
            print(f"# {m.name} failed, dropped:\n{traceback.format_exc()}", file=sys.stderr)
            self.methods.remove(m)
            self.records = [rec for rec in self.records if rec.method != m.name]
            with contextlib.suppress(Exception):
                m.close()

    def close(self) -> None:
        for m in self.methods:
            with contextlib.suppress(Exception):
                m.close()
        self.ctx.close()
        _end_child_processes()


def _end_child_processes() -> None:
    """DCP's PROCESS executor keeps a spawned daemon process; end the ones we started."""
    import multiprocessing

    try:
        import torch.distributed.checkpoint._async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.__del__()
            ape._CHECKPOINT_PROCESS = None
    except Exception:
        pass
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)


# --------------------------------------------------------------------------- report


def summary(xs: Sequence[float | None]) -> dict[str, float] | None:
    v = [x for x in xs if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def machine_info(target: Path) -> dict[str, Any]:
    cpu_model = "unknown"
    with contextlib.suppress(Exception), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(Exception), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) * KIB / GIB, 1)
    rev = "unknown"
    with contextlib.suppress(Exception):
        rev = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    fs = "unknown"
    with contextlib.suppress(Exception):
        out = subprocess.run(["df", "-T", "-P", str(target)], capture_output=True, text=True, check=True).stdout
        fields = out.strip().splitlines()[-1].split()
        fs = f"{fields[1]} ({fields[0]} at {fields[-1]})"
    gpu = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {
        "git_rev": rev,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_total_gib": mem,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "target_dir": str(target),
        "target_fs": fs,
    }


TARGETS = (
    # name, numerator (method, metric), denominator (method or "dcp_best", metric), op, value
    ("lost / torch.save stall", "lost_s", "torch_save", "stall_s", "<=", 0.1),
    ("lost / best DCP mode's lost", "lost_s", "dcp_best", "lost_s", "<=", 0.1),
    ("stall / memcpy stall", "stall_s", "memcpy", "stall_s", "<=", 1.2),
    # the naive writer (issue 18): copy into a pre-faulted buffer, O_DIRECT + fsync from one
    # thread; no checksum, no manifest, no retention (tiercheck runs with keep_local=1)
    ("lost / naive O_DIRECT writer lost", "lost_s", "odirect_writer", "lost_s", "<=", 1.1),
    ("background / naive writer background", "bg_s", "odirect_writer", "bg_s", "<=", None),
    ("durable / naive O_DIRECT writer durable", "durable_s", "odirect_writer", "durable_s", "<=", 1.05),
)


def build_report(b: Bench, info: dict[str, Any], wall_s: float) -> dict[str, Any]:
    a = b.args
    per_method: dict[str, Any] = {}
    metric_names = (
        "stall_s",
        "call_s",
        "wait_s",
        "durable_s",
        "bg_s",
        "lost_s",
        "slowdown_s",
        "cpu_s",
        "bg_rel_throughput",
        "bg_steps_per_s",
        "baseline_steps_per_s",
        "baseline_step_s",
        "window_steps",
    )
    t0 = b.t_start
    for name in a.methods:
        recs = [r for r in b.records if r.method == name]
        entry: dict[str, Any] = {
            "description": METHOD_CLASSES[name].description,
            "available": name not in b.unavailable and name not in b.failed,
            "reason": b.unavailable.get(name) or b.failed.get(name),
        }
        if recs:
            ms = [r.metrics() for r in recs]
            entry["summary"] = {k: summary([m[k] for m in ms]) for k in metric_names}
            entry["saves"] = [
                {
                    "repeat": r.repeat,
                    "step": r.step,
                    **m,
                    **r.extra,
                    "window_capped": r.window_capped,
                    # timestamps relative to the start of the run, for the timelines
                    "t_call": r.t_call - t0,
                    "t_return": r.t_return - t0,
                    "t_durable": None if r.t_durable is None else r.t_durable - t0,
                    "steps": [
                        [round(s.t0 - t0, 5), round(s.tw0 - t0, 5), round(s.tw1 - t0, 5), round(s.t1 - t0, 5)]
                        for s in r.pre_steps + r.steps
                    ],
                    "n_pre_steps": len(r.pre_steps),
                }
                for r, m in zip(recs, ms, strict=True)
            ]
        per_method[name] = entry
    if "odirect_writer" in per_method:
        m = METHOD_CLASSES["odirect_writer"]
        odw = next((x for x in b.methods if isinstance(x, m)), None)
        if odw is not None and getattr(odw, "fell_back", False):
            b.ctx.notes.append("odirect_writer: the filesystem refused O_DIRECT; it wrote buffered + fsync")
    dcp_best = _dcp_best(per_method)
    targets = []
    for subject in TIERCHECK_METHODS:
        if "summary" not in per_method.get(subject, {}):
            continue
        for label, num_metric, den_method, den_metric, op, val in TARGETS:
            den_name = dcp_best if den_method == "dcp_best" else den_method
            t = _ratio(b.records, per_method, subject, num_metric, den_name, den_metric)
            if t is None:
                targets.append(
                    {
                        "subject": subject,
                        "target": label,
                        "limit": "-" if val is None else f"{op} {val}",
                        "met": None,
                        "note": f"no {den_method} measurement",
                    }
                )
                continue
            t.update(
                {
                    "subject": subject,
                    "target": label,
                    "limit": "-" if val is None else f"{op} {val}",
                    "denominator": den_name,
                }
            )
            t["met"] = None if val is None else t["of_medians"] <= val
            t["met_paired"] = None if val is None else t["paired_median"] is not None and t["paired_median"] <= val
            targets.append(t)
    return {
        "benchmark": "stall",
        "machine": info,
        "config": {
            "model": a.model,
            "workload": b.w.description,
            "device": str(b.device),
            "params": b.w.params,
            "state_bytes": b.ctx.nbytes,
            "state_tensors": len(b.ctx.tensors),
            "repeats": a.repeats,
            "every": a.every,
            "pre_steps": a.pre_steps,
            "tail_steps": a.tail_steps,
            "noise_steps": a.noise_steps,
            "odirect_block": a.odirect_block,
            "quick": a.quick,
            "methods": list(a.methods),
            "loadavg_end": os.getloadavg(),
            "wall_s": wall_s,
        },
        "definitions": {
            "stall_s": "time in the save call + waits the method adds before the next optimizer.step()",
            "durable_s": "save call to durable on disk (fsynced); None for methods that make no checkpoint",
            "bg_s": "the background part: from the save call's return to durable",
            "lost_s": "wall time from the save call to the end of the tail steps after durable, minus "
            "(steps in that window x baseline step time)",
            "slowdown_s": "lost_s - stall_s: the integrated slowdown of the steps overlapping the background work",
            "bg_rel_throughput": "steps/s of the steps that started before durable, over baseline steps/s",
            "baseline_step_s": "median duration of the clean steps just before the save (first one excluded)",
            "cpu_s": "CPU seconds (this process + child processes) used in the window, minus steps x the baseline "
            "step's CPU seconds: what the save cost in CPU; less sensitive to other load on the machine than "
            "lost_s, and on a CPU-bound loop that fills every core, lost_s is about cpu_s / cores",
        },
        "dcp_best": dcp_best,
        "methods": per_method,
        "targets": targets,
        "notes": b.ctx.notes,
    }


def _dcp_best(per_method: dict[str, Any]) -> str | None:
    best, best_v = None, math.inf
    for name in DCP_METHODS:
        s = per_method.get(name, {}).get("summary", {}).get("lost_s")
        if s and s["median"] < best_v:
            best, best_v = name, s["median"]
    return best


def _ratio(
    records: list[SaveRecord], per_method: dict[str, Any], num: str, num_metric: str, den: str | None, den_metric: str
) -> dict[str, Any] | None:
    if den is None:
        return None
    sn = per_method.get(num, {}).get("summary", {}).get(num_metric)
    sd = per_method.get(den, {}).get("summary", {}).get(den_metric)
    if not sn or not sd or sd["median"] <= 0:
        return None
    by_rep: dict[int, dict[str, float]] = {}
    for r in records:
        if r.method in (num, den):
            v = r.metrics()[num_metric if r.method == num else den_metric]
            if v is not None:
                by_rep.setdefault(r.repeat, {})[r.method] = v
    paired = [d[num] / d[den] for d in by_rep.values() if num in d and den in d and d[den] > 0]
    return {
        "numerator": f"{num}.{num_metric}",
        "denominator_metric": f"{den}.{den_metric}",
        "num_median": sn["median"],
        "den_median": sd["median"],
        "of_medians": sn["median"] / sd["median"],
        "paired_median": statistics.median(paired) if paired else None,
    }


def _fmt(s: dict[str, float] | None, digits: int = 3, pct: bool = False) -> str:
    if not s:
        return "-"
    if pct:
        return f"{100 * s['median']:.0f}% [{100 * s['min']:.0f}-{100 * s['max']:.0f}]"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def to_markdown(rep: dict[str, Any]) -> str:
    c, mi = rep["config"], rep["machine"]
    lines = [
        f"**stall** — {c['workload']} on {c['device']}; state {c['state_bytes'] / GIB:.3f} GiB "
        f"({c['params'] / 1e6:.1f} M params + Adam, {c['state_tensors']} tensors); "
        f"a save every >= {c['every']} steps, methods interleaved, {c['repeats']} repeats; "
        "median [min-max] in seconds",
        "",
        f"machine: {mi['cpu_count']} CPUs ({mi['cpu_model']}), {mi['mem_total_gib']} GiB RAM"
        + (f", GPU {mi['gpu']}" if mi.get("gpu") else "")
        + f", torch {mi['torch']} ({mi['torch_num_threads']} threads), python {mi['python']}, repo {mi['git_rev']}; "
        f"target {mi['target_fs']}; load avg at start {tuple(round(x, 1) for x in mi['loadavg_start'])}, "
        f"at end {tuple(round(x, 1) for x in c['loadavg_end'])}; run took {c['wall_s']:.0f} s",
        "",
        "| method | lost s/save | stall s | background s | durable s | slowdown s |"
        " steps/s during bg write (vs baseline) | extra CPU s | baseline step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, e in rep["methods"].items():
        s = e.get("summary")
        if not s:
            lines.append(f"| {name} | n/a: {e.get('reason') or 'no samples'} | | | | | | | |")
            continue
        lines.append(
            f"| {name} | **{_fmt(s['lost_s'])}** | {_fmt(s['stall_s'])} | {_fmt(s.get('bg_s'))} | "
            f"{_fmt(s['durable_s'])} | "
            f"{_fmt(s['slowdown_s'])} | {_fmt(s['bg_rel_throughput'], pct=True)} | {_fmt(s['cpu_s'], 2)} | "
            f"{_fmt(s['baseline_step_s'])} |"
        )
    lines += ["", "Methods:", ""]
    for name, e in rep["methods"].items():
        lines.append(f"- `{name}`: {e['description']}")
    if rep["targets"]:
        lines += [
            "",
            f"Targets (best DCP mode by median lost seconds: `{rep['dcp_best']}`):",
            "",
            "| subject | target | numerator | denominator | ratio of medians | paired median | limit | met |",
            "|---|---|---:|---:|---:|---:|---|---|",
        ]
        for t in rep["targets"]:
            if t.get("of_medians") is None:
                lines.append(f"| {t['subject']} | {t['target']} | | | | | {t['limit']} | n/a ({t.get('note')}) |")
                continue
            pm = "-" if t["paired_median"] is None else f"{t['paired_median']:.3f}"
            lines.append(
                f"| {t['subject']} | {t['target']} | {t['num_median']:.3f} | {t['den_median']:.3f} "
                f"({t['denominator']}) | {t['of_medians']:.3f} | {pm} | {t['limit']} | "
                f"{'-' if t['met'] is None else 'yes' if t['met'] else 'no'} |"
            )
    if rep["notes"]:
        lines += ["", "Notes: " + " ".join(rep["notes"])]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- plots


def plot(rep: dict[str, Any], img_dir: Path, prefix: str) -> list[str]:
    """One PNG per method (throughput around each save) and an overview; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        rep["notes"].append("matplotlib is not installed: no PNG timelines")
        return []
    img_dir.mkdir(parents=True, exist_ok=True)
    methods = {k: v for k, v in rep["methods"].items() if v.get("saves")}
    if not methods:
        return []
    xmax = 0.0
    for e in methods.values():
        for s in e["saves"]:
            xmax = max(xmax, s["steps"][-1][3] - s["t_call"])
    xmin = -2.5 * max(e["summary"]["baseline_step_s"]["median"] for e in methods.values())
    written = []

    def own_xmax(e: dict[str, Any]) -> float:
        return max(s["steps"][-1][3] - s["t_call"] for s in e["saves"])

    def draw(ax: Any, name: str, e: dict[str, Any], x_max: float) -> None:
        saves = e["saves"]
        lost = [s["lost_s"] for s in saves]
        med = sorted(range(len(saves)), key=lambda i: lost[i])[len(saves) // 2]
        for i, s in enumerate(saves):
            xs, ys = _throughput_curve(s)
            ax.plot(
                xs,
                ys,
                color="C0" if i == med else "0.6",
                lw=1.6 if i == med else 0.7,
                alpha=1.0 if i == med else 0.6,
                zorder=3 if i == med else 2,
            )
        s = saves[med]
        stall_end = s["t_return"] - s["t_call"]
        ax.axvspan(0, max(stall_end, 1e-3), color="C3", alpha=0.25, lw=0, label="save call (blocked)")
        if s["t_durable"] is not None and s["t_durable"] > s["t_return"]:
            ax.axvspan(
                stall_end,
                s["t_durable"] - s["t_call"],
                color="C2",
                alpha=0.15,
                lw=0,
                label="background work until durable",
            )
        ax.axvline(0, color="C3", lw=1)
        if s["t_durable"] is not None:
            ax.axvline(s["t_durable"] - s["t_call"], color="C2", lw=1, ls="--")
        sm = e["summary"]
        ax.set_title(
            f"{name}: lost {sm['lost_s']['median']:.2f} s/save, stall {sm['stall_s']['median']:.2f} s"
            + (f", durable {sm['durable_s']['median']:.2f} s" if sm["durable_s"] else ""),
            fontsize=9,
        )
        ax.set_ylim(-5, 130)
        ax.set_xlim(xmin, x_max)
        ax.set_ylabel("throughput, % of baseline", fontsize=8)
        ax.grid(alpha=0.3)

    cfg = rep["config"]
    sub = f"{cfg['workload']}; state {cfg['state_bytes'] / GIB:.2f} GiB; {cfg['device']}"
    for name, e in methods.items():
        fig, ax = plt.subplots(figsize=(8, 3))
        draw(ax, name, e, own_xmax(e))
        ax.set_xlabel("seconds since the save call (bold: median-lost repeat; grey: other repeats)", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
        fig.suptitle(sub, fontsize=7)
        fig.tight_layout()
        p = img_dir / f"{prefix}_{name}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(str(p))
    # overview: lost seconds per save (stall + slowdown), then every timeline stacked
    names = list(methods)
    fig = plt.figure(figsize=(9, 2.2 + 1.35 * len(names)))
    gs = fig.add_gridspec(len(names) + 1, 1, height_ratios=[2.2] + [1.0] * len(names))
    ax0 = fig.add_subplot(gs[0])
    stall = [methods[n]["summary"]["stall_s"]["median"] for n in names]
    slow = [methods[n]["summary"]["slowdown_s"]["median"] for n in names]
    lo = [methods[n]["summary"]["lost_s"]["min"] for n in names]
    hi = [methods[n]["summary"]["lost_s"]["max"] for n in names]
    med = [methods[n]["summary"]["lost_s"]["median"] for n in names]
    y = list(range(len(names)))
    ax0.barh(y, stall, color="C3", alpha=0.7, label="stall (median)")
    ax0.barh(y, [max(0.0, x) for x in slow], left=stall, color="C1", alpha=0.7, label="slowdown (median, if > 0)")
    cpu = [(methods[n]["summary"].get("cpu_s") or {}).get("median") for n in names]
    cy = [yy for yy, c in zip(y, cpu, strict=True) if c is not None]
    if cy:
        ax0.plot([c for c in cpu if c is not None], cy, "D", color="C4", ms=4, label="extra CPU s (all cores)")
    ax0.errorbar(
        med,
        y,
        xerr=[[m - a for m, a in zip(med, lo, strict=True)], [b - m for m, b in zip(med, hi, strict=True)]],
        fmt="k|",
        lw=0.8,
        capsize=2,
        label="lost: median [min-max]",
    )
    ax0.set_yticks(y, names, fontsize=7)
    ax0.invert_yaxis()
    ax0.set_xlabel("training seconds lost per save", fontsize=8)
    ax0.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax0.grid(axis="x", alpha=0.3)
    ax0.set_title(sub, fontsize=8)
    for i, n in enumerate(names):
        ax = fig.add_subplot(gs[i + 1])
        draw(ax, n, methods[n], xmax)
        ax.set_ylabel("%", fontsize=7)
        ax.tick_params(labelsize=7)
        if i < len(names) - 1:
            ax.set_xticklabels([])
    ax.set_xlabel("seconds since the save call", fontsize=8)
    fig.tight_layout()
    p = img_dir / f"{prefix}_overview.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    written.append(str(p))
    return written


def _throughput_curve(s: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Throughput (% of baseline) as a step function of time since the save call: 0 while the
    loop is blocked (save call, waits), baseline/duration elsewhere within each step."""
    base = s["baseline_step_s"]
    tc = s["t_call"]
    xs: list[float] = []
    ys: list[float] = []

    def seg(a: float, b: float, v: float) -> None:
        if b <= a:
            return
        xs.extend([a - tc, b - tc])
        ys.extend([v, v])

    steps = s["steps"]
    npre = s["n_pre_steps"]
    for i, (t0, tw0, tw1, t1) in enumerate(steps):
        if i == npre:
            seg(steps[i - 1][3] if i else tc, t0, 0.0)  # the save call
        wait = tw1 - tw0
        if wait < 0.02 * base:  # a negligible wait: don't draw a spike for it
            v = 100.0 * base / (t1 - t0) if t1 > t0 else 0.0
            seg(t0, t1, v)
            continue
        v = 100.0 * base / (t1 - t0 - wait) if t1 - t0 > wait else 0.0
        seg(t0, tw0, v)
        seg(tw0, tw1, 0.0)
        seg(tw1, t1, v)
    return xs, ys


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="tiercheck bench" if os.environ.get("TIERCHECK_BENCH_PROG") else "stall.py",
        description="Lost training time per checkpoint save, for tiercheck and the usual alternatives.",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, 2 repeats: about a minute (CI smoke)")
    ap.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    ap.add_argument("--size-gib", type=float, default=None, help="params + Adam moments (default 1.0; quick 0.03)")
    ap.add_argument(
        "--sizes",
        default=None,
        help="comma-separated GiB, e.g. 1,3,8: one run per size, one after the other (a report each, named "
        "NAME_<size>g, and a table of ratios to the naive O_DIRECT writer across sizes); overrides --size-gib",
    )
    ap.add_argument("--width", type=int, default=0, help="MLP width / transformer d_model (default: from size)")
    ap.add_argument("--depth", type=int, default=None, help="MLP layers / transformer blocks (default 8 / 6)")
    ap.add_argument("--batch", type=int, default=None, help="default: 16 (MLP), 1 (transformer)")
    ap.add_argument("--seq", type=int, default=64, help="transformer sequence length")
    ap.add_argument("--vocab", type=int, default=8192, help="transformer vocabulary")
    ap.add_argument("--optim", choices=("adam-fused", "adam-foreach", "adam"), default="adam-fused")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    ap.add_argument(
        "--methods",
        default=",".join(ALL_METHODS),
        help="comma-separated, default all but tiercheck_normal_prio; of: " + ", ".join(METHOD_CLASSES),
    )
    ap.add_argument("--repeats", type=int, default=None, help="saves per method (default 7; quick 2)")
    ap.add_argument("--every", type=int, default=None, help="steps from one save to the next, at least (default 10)")
    ap.add_argument(
        "--pre-steps", type=int, default=None, help="clean steps before a save for its baseline (default 6)"
    )
    ap.add_argument(
        "--tail-steps", type=int, default=None, help="steps after durable counted in the window (default 1)"
    )
    ap.add_argument("--noise-steps", type=int, default=None, help="window length of the 'none' method (default 4)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps before the first save (default 5)")
    ap.add_argument("--max-window-s", type=float, default=300.0, help="stop counting a window after this long")
    ap.add_argument("--odirect-block", type=int, default=8 * MIB, help="bytes per O_DIRECT write (baseline)")
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir under --out)")
    ap.add_argument("--out", default="bench_out/stall", help="output directory for JSON and markdown")
    ap.add_argument("--img-dir", default=None, help="PNG directory (default: OUT/img)")
    ap.add_argument("--name", default=None, help="file name stem (default: stall_<model>[_quick])")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only rewrite markdown + PNGs from a JSON report")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    q = a.quick

    def pick(v: Any, normal: Any, quick: Any) -> Any:
        return v if v is not None else (quick if q else normal)

    a.size_gib = pick(a.size_gib, 1.0, 0.03)
    a.sizes = [float(x) for x in a.sizes.split(",") if x.strip()] if a.sizes else []
    a.depth = pick(a.depth, 8 if a.model == "mlp" else 6, 4 if a.model == "mlp" else 2)
    a.batch = pick(a.batch, 16 if a.model == "mlp" else 1, 8 if a.model == "mlp" else 1)
    a.repeats = pick(a.repeats, 7, 2)
    a.every = pick(a.every, 10, 4)
    a.pre_steps = pick(a.pre_steps, 6, 3)
    a.tail_steps = pick(a.tail_steps, 1, 1)
    a.noise_steps = pick(a.noise_steps, 4, 2)
    a.warmup_steps = pick(a.warmup_steps, 5, 2)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHOD_CLASSES]
    if bad:
        ap.error(f"unknown methods {bad}; choose from {', '.join(METHOD_CLASSES)}")
    a.methods = methods
    if a.pre_steps < 2:
        ap.error("--pre-steps must be at least 2")
    if a.tail_steps < 1 or a.noise_steps < 1:
        ap.error("--tail-steps and --noise-steps must be at least 1")
    a.name_given = a.name
    a.name = a.name or f"stall_{a.model}" + ("_quick" if q else "")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:  # redo the markdown and PNGs from a JSON report; no measuring
        rep = json.loads(Path(args.replot).read_text())
        rep["notes"] = [n for n in rep.get("notes", []) if "matplotlib" not in n]
        args.name = args.name_given or Path(args.replot).stem
        return write_outputs(rep, args, out)
    if not args.sizes:
        return write_outputs(run_one(args), args, out)
    stem, reps = args.name, []
    for size in args.sizes:
        args.size_gib, args.name = size, f"{stem}_{size:g}g"
        rep = run_one(args)
        write_outputs(rep, args, out)
        reps.append(rep)
        gc.collect()
    md = naive_writer_table(reps)
    (out / f"{stem}_sizes.md").write_text(md)
    print(md)
    return 0


def naive_writer_table(reps: Sequence[dict[str, Any]]) -> str:
    """Per size: tiercheck's lost time, background part and time to durable (retention
    included) as ratios of medians to the naive O_DIRECT writer's (paired median in brackets)."""
    lines = [
        "| state GiB | subject | lost s (naive) | lost ratio | background s (naive) | background ratio |"
        " durable s (naive) | durable ratio | load avg start / end |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for rep in reps:
        gib = rep["config"]["state_bytes"] / GIB
        load = f"{rep['machine']['loadavg_start'][0]:.1f} / {rep['config']['loadavg_end'][0]:.1f}"
        by: dict[str, dict[str, Any]] = {}
        for t in rep["targets"]:
            if t.get("denominator") == "odirect_writer":
                by.setdefault(t["subject"], {})[t["numerator"].split(".", 1)[1]] = t
        for subject, ts in by.items():
            cells = []
            for metric in ("lost_s", "bg_s", "durable_s"):
                t = ts.get(metric)
                if t is None:
                    cells += ["-", "-"]
                    continue
                pm = "-" if t["paired_median"] is None else f"{t['paired_median']:.2f}"
                cells += [f"{t['num_median']:.3f} ({t['den_median']:.3f})", f"**{t['of_medians']:.2f}** ({pm})"]
            lines.append(f"| {gib:.2f} | {subject} | " + " | ".join(cells) + f" | {load} |")
    return "\n".join(lines) + "\n"


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="stall-", dir=args.dir or out))
    info = machine_info(root)
    info["loadavg_start"] = os.getloadavg()
    t0 = now()
    bench = None
    try:
        bench = Bench(args, root)
        bench.run()
    finally:
        if bench is not None:
            bench.close()
        else:
            _end_child_processes()
        shutil.rmtree(root, ignore_errors=True)
    return build_report(bench, info, now() - t0)


def write_outputs(rep: dict[str, Any], args: argparse.Namespace, out: Path) -> int:
    if not args.no_plots:
        img_dir = Path(args.img_dir) if args.img_dir else out / "img"
        rep["images"] = plot(rep, img_dir, args.name)
    jpath = out / f"{args.name}.json"
    mpath = out / f"{args.name}.md"
    jpath.write_text(json.dumps(rep, indent=1, default=str) + "\n")
    md = to_markdown(rep)
    mpath.write_text(md)
    print(md)
    print(
        f"# wrote {jpath}, {mpath}" + (f" and {len(rep.get('images', []))} PNGs" if rep.get("images") else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
