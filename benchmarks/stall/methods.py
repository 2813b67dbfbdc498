"""The saves the stall benchmark times, part 1: the shared context, the baselines (no save,
a blocking copy, the naive O_DIRECT writer) and tiercheck. The other libraries' saves are
in others.py.

A method's `save(step)` returns a `Pending`: how to wait until the checkpoint is durable,
what the loop must wait for before its next optimizer step, and how to clean up."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import O_DIRECT, PlainBuffer, write_file
from benchmarks.stall.workloads import Workload, state_tensors


class Unavailable(Exception):
    """A method cannot run here (missing package, no O_DIRECT, ...); the reason is reported."""


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
                if not write_file(plain.buf, path, self.ctx.args.odirect_block):
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


class TiercheckMemory(TiercheckSave):
    name = "tiercheck_memory"
    description = (
        "tiercheck save() with tier 0: Checkpointer(memory=True, keep_memory=1), host buffers are files in "
        "/dev/shm (2 by default), the step committed there, then on tier 1; handle.wait() (both tiers)"
    )

    def setup(self) -> None:
        import inspect

        try:
            import tiercheck
        except ImportError as e:
            raise Unavailable(f"import tiercheck failed: {e}") from e
        if "memory" not in inspect.signature(tiercheck.Checkpointer).parameters:
            raise Unavailable("this tiercheck has no tier 0 (memory=)")
        base = getattr(self.ctx.args, "memory_dir", None) or "/dev/shm"
        if not os.path.isdir(base):
            raise Unavailable(f"no shared-memory directory {base}")
        self.shm = tempfile.mkdtemp(prefix="stall-tier0-", dir=base)
        try:
            self.ckpt = tiercheck.Checkpointer(
                local=str(self.ctx.root / "tiercheck-memory"),
                keep_local=1,
                memory=True,
                memory_dir=self.shm,
                job_id=f"stall-{os.getpid()}",
                keep_memory=1,
            )
            state = {"model": self.ctx.w.model, "optim": self.ctx.w.optimizer}
            self.ckpt.prepare(state)
            # prepare() allocates one host buffer; with tier 0 the default is two (the newest
            # step stays in memory while the next is copied), and the second save allocates
            # the other (1.4 s of stall once at 1 GiB here). One save now, plus the benchmark's
            # unrecorded warm-up save, leave both allocated: the recorded saves are steady state.
            self.ckpt.save(0, state).wait()
        except BaseException:
            shutil.rmtree(self.shm, ignore_errors=True)
            raise

    def checkpointer(self) -> Any:
        return self.ckpt

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ckpt.close()
        shutil.rmtree(self.shm, ignore_errors=True)
